/* Checkpoints (SPEC §8.2): parameters under /model/<name>, AdamW moments under /optimizer/m and
 * /optimizer/v, attributes step, rng, data cursor, deck, version. Written collectively with
 * parallel HDF5 into ckpt_<step>.h5.tmp and renamed only when complete, so a killed write never
 * replaces a good checkpoint; only `output.keep` checkpoints are kept. Restart state is complete:
 * every random stream and the data order are functions of (seed, step).
 *
 * Every dataset carries attribute crc32, zlib's CRC-32 of its float32 bytes, checked on reading:
 * a truncated or bit-flipped file is refused naming the file and the problem, and `latest` then
 * falls back to the checkpoint before it. A checkpoint of another model (variant, head mode,
 * tensor shapes) is refused outright: no older file would do better. */
#ifndef FMATTN_CHECKPOINT_H
#define FMATTN_CHECKPOINT_H

#include <stddef.h>

#include "comm.h"
#include "config.h"
#include "model.h"

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
