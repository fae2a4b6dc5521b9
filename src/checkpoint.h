/* Checkpoints (SPEC §8.2): parameters under /model/<name>, AdamW moments under /optimizer/m and
 * /optimizer/v, attributes step, rng, data cursor, deck, version. Written collectively with
 * parallel HDF5 into ckpt_<step>.h5.tmp and renamed only when complete, so a killed write never
 * replaces a good checkpoint; only `output.keep` checkpoints are kept. Restart state is complete:
 * every random stream and the data order are functions of (seed, step). */
#ifndef FMATTN_CHECKPOINT_H
#define FMATTN_CHECKPOINT_H

#include <stddef.h>

#include "comm.h"
#include "config.h"
#include "model.h"

/* Write ckpt_<step>.h5 in dir (collective over the world). Returns the seconds it took. */
double checkpoint_write(const struct model *model, struct comm *comm, long step, const char *dir);
/* Read a checkpoint into the model (parameters and optimizer moments); returns its step. A
 * missing file, a missing tensor or a shape mismatch ends the job with one message. Collective. */
long checkpoint_read(struct model *model, struct comm *comm, const char *path);
/* Resolve output.restart: "latest" → the newest ckpt_<step>.h5 in dir; a path is returned as is.
 * Returns 0 and writes the path, or non-zero when "latest" finds none (message in path). */
int checkpoint_resolve(const char *restart, const char *dir, char *path, size_t len);
/* Remove all but the newest `keep` checkpoints in dir (rank 0 only). */
void checkpoint_prune(const char *dir, int keep);

#endif
