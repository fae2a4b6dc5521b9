/* AdamW with decoupled weight decay (on weight matrices and embeddings only, SPEC §5), global-norm
 * gradient clipping, and the learning-rate schedule (linear warm-up, then cosine or linear decay
 * to train.min_lr, or constant). Works on the model's contiguous buffers through its back end;
 * knows nothing of MPI (the caller reduces gradients first, so every rank takes the identical
 * step). */
#ifndef FMATTN_OPTIMIZER_H
#define FMATTN_OPTIMIZER_H

#include "deck/config.h"
#include "model/model.h"

/* Learning rate for optimizer step `step` (0-based). */
double optimizer_lr(const struct config *cfg, long step);
/* L2 norm of all gradients (double accumulation, fixed chunk order). */
double optimizer_grad_norm(const struct model *model);
/* One AdamW step t (1-based, for bias correction) with learning rate lr; gradients are first
 * multiplied by grad_scale (the clipping factor, 1 when not clipping). */
void optimizer_step(struct model *model, long t, double lr, float grad_scale);

#endif
