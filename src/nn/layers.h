/* The per-token layers of the transformer, _forward/_backward pairs (SPEC §1): outputs, inputs,
 * parameters, sizes; backward takes input-gradients first, then the output-gradient, then what
 * forward saved. Parameter gradients ACCUMULATE (+=); an input gradient is WRITTEN (=) into a
 * buffer that need not be zeroed, except where the line above the function says += (layer norm's
 * and the embedding's, which add to the residual stream's and the table's gradients). Local tokens
 * only (t0: the global index of the first). The CPU implementations, fp32, reductions over rows in
 * a fixed chunk order so results do not depend on the thread count; gpu/layers.cu mirrors them. */
#ifndef FMATTN_LAYERS_H
#define FMATTN_LAYERS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* out (N, OC) = inp (N, IC) · weight (OC, IC)ᵀ + bias (OC); bias may be NULL. */
void linear_forward(float *out, const float *inp, const float *weight, const float *bias, long N,
                    int IC, int OC);
/* dinp (N, IC) = dout · weight; dweight (OC, IC) += doutᵀ · inp; dbias (OC) += Σ_rows dout.
 * dinp, dweight or dbias may be NULL to skip that gradient. */
void linear_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                     const float *weight, long N, int IC, int OC);

/* out = (inp − mean) · rstd · weight + bias per row, eps 1e-5. mean, rstd: (N) saved for backward.
 */
void layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                       const float *bias, long N, int C);
/* dinp += the input's gradient; dweight, dbias += theirs. */
void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                        const float *inp, const float *weight, const float *mean, const float *rstd,
                        long N, int C);

/* GELU, tanh form: 0.5 x (1 + tanh(√(2/π)(x + 0.044715 x³))). */
void gelu_forward(float *out, const float *inp, size_t count);
/* dinp = gelu'(inp) · dout (dinp may alias neither). */
void gelu_backward(float *dinp, const float *dout, const float *inp, size_t count);

/* out (B, T, C) = token (V, C)[tokens] + position (n, C)[t0 + t]; position may be NULL. */
void embedding_forward(float *out, const int *tokens, const float *token, const float *position,
                       long B, long T, int C, long t0);
void embedding_backward(float *dtoken, float *dposition, const float *dout, const int *tokens,
                        long B, long T, int C, int V, long t0);

/* x (B, T, C) += scale · PE(t0 + t), the fixed sinusoidal table of Vaswani et al. No parameters,
 * so there is no backward (the gradient passes through unchanged). */
void sinusoidal_forward(float *x, long B, long T, int C, long t0, float scale);

/* Rotary position embedding in place on x (B, H, T, d) (q or k in head layout): pairs (2i, 2i+1)
 * rotated by angle (t0 + t) · 10000^(−2i/d). Backward rotates the gradient back. */
void rope_forward(float *x, long BH, long T, int d, long t0);
void rope_backward(float *dx, long BH, long T, int d, long t0);

/* Dropout keyed by the counter-based stream: the mask of element (sample, token, channel) at a
 * site is a pure function of (seed, step, site, global sample, global token, channel), so it is
 * recomputed in backward (never stored) and is the same on every rank layout. */
struct dropout_key {
  uint64_t seed;
  long step;
  int site;     /* 0: embedding; 1 + 2l: attention output of layer l; 2 + 2l: MLP output */
  long sample0; /* global index of local sample 0 */
  long t0;      /* global index of local token 0 */
  float p;      /* drop probability; 0 disables */
};
/* x (B, T, C) ← dropout(x), in place (embedding output). */
void dropout_forward(float *x, const struct dropout_key *key, long B, long T, int C);
void dropout_backward(float *dx, const struct dropout_key *key, long B, long T, int C);
/* out = res + dropout(y), all (B, T, C). */
void residual_dropout_forward(float *out, const float *res, const float *y,
                              const struct dropout_key *key, long B, long T, int C);
/* dres = dout; dy = dropout'(dout). dres may be dout (the model adds into the residual stream's
 * gradient in place): then it is left as it is. */
void residual_dropout_backward(float *dres, float *dy, const float *dout,
                               const struct dropout_key *key, long B, long T, int C);

/* (B, T, (2·Hqk + H)·d) packed q|k|v → q, k (B, Hqk, T, d) and v (B, H, T, d). Hqk = H but for
 * FiSH heads, whose Hqk global query/key heads serve H value heads (SPEC §6.9). */
void heads_split_forward(float *q, float *k, float *v, const float *qkv, long B, long T, int Hqk,
                         int H, int d);
/* backward: dqkv = dq | dk | dv, datt = dy in head layout (=). */
void heads_split_backward(float *dqkv, const float *dq, const float *dk, const float *dv, long B,
                          long T, int Hqk, int H, int d);
/* (B, H, T, d) → (B, T, C). */
void heads_merge_forward(float *y, const float *att, long B, long T, int H, int d);
void heads_merge_backward(float *datt, const float *dy, long B, long T, int H, int d);

/* Softmax cross-entropy, fused with its backward: logits (N, V) are overwritten by
 * dlogits = (softmax − onehot) · grad_scale. Rows whose target is negative are ignored (their
 * dlogits are zero). Returns Σ over counted rows of −log p(target), in double; row_loss (N), when
 * given, receives each row's −log p(target) (0 for ignored rows). */
double softmax_xent_forward_backward(float *logits, const int *targets, long N, int V,
                                     float grad_scale, float *row_loss);
/* The same, and row_pred (N), when given, receives each counted row's argmax of the logits (the
 * lowest index among equals; −1 for ignored rows), read before the logits are overwritten: what
 * task accuracy is measured from. The back ends' table entry has this form. */
double softmax_xent_rows_forward_backward(float *logits, const int *targets, long N, int V,
                                          float grad_scale, float *row_loss, int *row_pred);

#ifdef __cplusplus
}
#endif

#endif
