/* The transformer of SPEC §5: token embedding (+ position) → L pre-norm blocks
 * [x += Attn(LN(x)); x += MLP(LN(x))] → LN → head → softmax cross-entropy. The model owns the
 * parameter registry and buffers (params, grads, AdamW moments) and the activations of its local
 * batch and local tokens; attention goes through the variant's ops table only. With
 * train.recompute the blocks keep only their inputs and recompute the rest in backward. */
#ifndef FMATTN_MODEL_H
#define FMATTN_MODEL_H

#include <stdbool.h>

#include "attention/attention.h"
#include "deck/config.h"
#include "model/backend.h"
#include "nn/params.h"
#include "parallel/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Pointers into one of the contiguous buffers (params or grads), one set per block. */
struct block_tensors {
  float *ln1w, *ln1b; /* (C) */
  float *wqkv;        /* (QKV, C): q (Hqk·d) | k (Hqk·d) | v (C) rows */
  float *bqkv;        /* (QKV) */
  float *wo, *bo;     /* (C, C), (C) */
  float *attn;        /* the variant's parameters for this block (contiguous), or NULL */
  float *ln2w, *ln2b; /* (C) */
  float *w1, *b1;     /* (R, C), (R) */
  float *w2, *b2;     /* (C, R), (C) */
};

struct model_tensors {
  float *token;       /* (V, C) */
  float *position;    /* (n, C) when learned, else NULL */
  float *lnfw, *lnfb; /* (C) */
  float *head;        /* (V, C); == token when tied */
  struct block_tensors *block;
};

/* Saved activations of one block, over the local (B, T). */
struct block_acts {
  float *ln1, *ln1_mean, *ln1_rstd; /* (B,T,C), (B,T), (B,T) */
  float *q, *k, *v;                 /* (B,Hqk,T,d), (B,Hqk,T,d), (B,H,T,d), after rope */
  float *att;                       /* (B,H,T,d) attention output */
  float *qkv;       /* (B,T,3C) the q|k|v product, kept where the attention reads it in place
                     * (model.heads_in_place: then q, k, v, att are NULL and the output is atty) */
  float *att_saved; /* variant's saved floats */
  float *atty;      /* (B,T,C) heads merged */
  float *res2;      /* (B,T,C) x + dropout(attn proj) */
  float *ln2, *ln2_mean, *ln2_rstd; /* (B,T,C), (B,T), (B,T) */
  float *fch, *fch_gelu;            /* (B,T,R) each */
};

struct model {
  /* the deck, for what is done once a run (parameters registered and initialised, checkpoints'
   * records, the optimizer's settings); the passes below read the fields that follow */
  const struct config *cfg;
  struct comm *comm;
  const struct backend *be; /* every buffer below lives on its device, but the host_* ones */
  int L, C, H, d, V, R;     /* blocks, width, heads, head size, vocabulary, MLP hidden */
  int Hqk;                  /* query/key heads: H, or FiSH's global heads G */
  int QKV;                  /* width of the q|k|v projection: (2·Hqk + H)·d (3C when Hqk = H) */
  long n;                   /* global sequence length */
  long B, T, t0;            /* local batch, local tokens, global index of local token 0 */
  bool causal, recompute;
  /* The attention reads q, k, v from the q|k|v product and writes its output where the output
   * projection reads it (attn_ctx.rows): no head split or merge, and their gradients likewise.
   * Where the variant's implementation takes it (full on the CPU, one sequence rank),
   * without rope; FMATTN_HEAD_COPIES=1 turns it off (the copies' cost, measured). */
  bool heads_in_place;
  enum position_kind position; /* model.position */
  bool tie_embeddings;         /* model.tie_embeddings: the head is the token embedding */
  float dropout;               /* model.dropout */
  uint64_t seed;               /* run.seed: the dropout masks' key */
  long mlp_chunk;              /* MLP rows at once: the activations' size under recomputation */
  bool last_train;             /* dropout state of the last forward, which backward must match */

  struct param_list plist;
  float *params, *grads, *m, *v; /* plist.total floats each */
  /* host copies for host code (initialisation, checkpoints): the same buffers on a host back end;
   * otherwise in step only after model_sync_to_host, and read back by model_sync_to_device */
  float *host_params, *host_m, *host_v;
  struct model_tensors P, G;    /* views of params and grads */
  size_t attn_params_per_block; /* floats of one block's variant parameters */

  const struct attn_variant *attn;
  struct attn_ctx *actx; /* one per block */

  /* activations */
  int *tokens, *targets; /* (B,T) inputs and targets (−1: not predicted), host: data fills them */
  int *dev_tokens, *dev_targets; /* their device copies, uploaded once per forward */
  float *row_loss; /* (B,T) each position's loss after a forward, when set (eval), else NULL */
  int *row_pred;   /* (B,T) each counted position's argmax after a forward, when set, else NULL */
  float *residual; /* (L+1, B, T, C) block inputs; residual[L] is the final stream */
  struct block_acts *acts;
  int nacts;                        /* L, or 1 with recompute */
  float *lnf, *lnf_mean, *lnf_rstd; /* (B,T,C), (B,T), (B,T) */
  float *logits;                    /* (B,T,V); dlogits after the loss */
  float *qkv, *proj;                /* (B,T,3C), (B,T,C) scratch */

  /* activation gradients (one block's worth); dproj and dqkv share proj's and qkv's memory */
  float *dres, *dproj, *dfch_gelu, *dln, *dqkv, *dq, *dk, *dv, *datt, *datty;

  /* diagnostics requested for the next forward: (L, H, bands) mass and (L, H) entropy sums;
   * when the attention opens windows (fma.open), (L, H) opened-token mass and (L, bands) windows
   * opened per level (index 0 unused) sums, else NULL */
  bool diag_request;
  int diag_bands;
  double *diag_mass, *diag_entropy;
  double *diag_open_mass, *diag_opened;
  long diag_queries;

  /* the gradient allreduce in buckets behind the backward (parallel.overlap, several ranks, MPI):
   * block l's gradients [bucket_lo[l], bucket_hi[l]) start summing once its backward is done;
   * NULL when the allreduce is one call after the backward */
  size_t *bucket_lo, *bucket_hi;
  struct comm_request *bucket_req;
};

/* Build the model for a local batch of B sequences of T local tokens (T = n / S) on the back end
 * of parallel.device. Allocates every buffer; parameters are left at zero (call
 * model_init_params or load a checkpoint). model_build_on: on the given back end. */
void model_build(struct model *model, const struct config *cfg, struct comm *comm, long B);
void model_build_on(struct model *model, const struct config *cfg, struct comm *comm, long B,
                    const struct backend *be);
void model_free(struct model *model);
/* Initialise every parameter per SPEC §5 from the counter-based stream (layout-independent). */
void model_init_params(struct model *model);

/* Forward over model->tokens/targets. train: dropout on. Leaves dlogits = ∂loss/∂logits ·
 * grad_scale in model->logits (grad_scale = 1 / predicted positions over all ranks). Returns the
 * local sum of −log p(target) over counted positions; *count receives their number. */
double model_forward(struct model *model, long step, bool train, float grad_scale, long *count);
/* Forward without the loss, dropout off: raw logits stay in model->logits (generation). */
void model_forward_logits(struct model *model);
/* Backward of the last forward; accumulates into model->grads. With buckets (above) it also
 * starts each block's gradient allreduce: model_allreduce_grads must follow every backward. */
void model_backward(struct model *model, long step);
void model_zero_grads(struct model *model);
/* Sum the gradients over every rank: complete the buckets the backward started and sum the rest
 * (embeddings, final norm, head), or the whole contiguous buffer in one allreduce. */
void model_allreduce_grads(struct model *model);
/* Overwrite the first gradient (the test suite's faults). */
void model_poison_grad(struct model *model, float value);
/* Parameters and AdamW moments from the device to host_* (before a checkpoint is written), and
 * back (after host code changed them: initialisation, a restart). No-ops on a host back end. */
void model_sync_to_host(struct model *model);
void model_sync_to_device(struct model *model);

/* Incremental decoding of one sequence for generation (B = 1, one rank): every layer's attention
 * cache, and one token's buffers. model_decode_open returns false when the attention variant has
 * no cache (the caller then recomputes the context for every token). */
struct model_decoder {
  void **cache;                                                                   /* (L) */
  float *x, *ln, *mean, *rstd, *qkv, *q, *k, *v, *att, *proj, *res2, *fch, *fchg; /* one token */
};
bool model_decode_open(struct model *model, struct model_decoder *dec);
/* Feed the byte at position pos (0 .. n − 1, every earlier position fed before): logits (V) of the
 * next byte. */
void model_decode_step(struct model *model, struct model_decoder *dec, int token, long pos,
                       float *logits);
void model_decode_close(struct model *model, struct model_decoder *dec);

/* Trainable parameter count (frozen tensors such as random features excluded), and model FLOPs per
 * token for forward + backward (6 · parameters in matrices + attention, SPEC issue 2's accounting).
 */
size_t model_param_count(const struct model *model);
double model_flops_per_token(struct model *model);

#ifdef __cplusplus
}
#endif

#endif
