/* Checkpoints (SPEC §8.2): parameters and AdamW moments written from rank 0 (collectively through
 * MPI-IO with parallel HDF5; by rank 0 alone with serial HDF5, read by every rank independently)
 * to ckpt_<step>.h5.tmp, renamed only when complete (a killed write never replaces a good one),
 * each tensor with its CRC-32 (attribute crc32), so a damaged file is refused by name and
 * `latest` falls back to the one before; a checkpoint of another model is refused outright.
 * Restart state is complete: every random stream and the data order are functions of the step. */
#ifndef FMATTN_CHECKPOINT_H
#define FMATTN_CHECKPOINT_H

#include <stddef.h>

#include "deck/config.h"
#include "model/model.h"
#include "parallel/comm.h"

/* Write ckpt_<step>.h5 in dir (collective over the world). Returns the seconds it took. */
double checkpoint_write(struct model *model, struct comm *comm, long step, const char *dir);
/* Read a checkpoint into the model (parameters and optimizer moments); returns its step. A
 * missing, damaged or foreign file ends the job with one message naming it. Collective. */
long checkpoint_read(struct model *model, struct comm *comm, const char *path);
/* Restore output.restart: "latest" → the newest intact ckpt_<step>.h5 in dir (a damaged one is
 * reported and the one before it tried); a path → that file. Writes the file used into `used`
 * and returns its step; ends the job when nothing usable is found. Collective. */
long checkpoint_restore(struct model *model, struct comm *comm, const char *restart,
                        const char *dir, char *used, size_t len);
/* Remove all but the newest `keep` checkpoints in dir (rank 0 only). */
void checkpoint_prune(const char *dir, int keep);

#endif
