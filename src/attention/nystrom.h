/* The pseudo-inverse iteration of `nystrom` (SPEC §6.7), exposed so that tests can set it against
 * numpy's pinv. Internal to src/attention/ otherwise. */
#ifndef FMATTN_ATTENTION_NYSTROM_H
#define FMATTN_ATTENTION_NYSTROM_H

/* Z (iters + 1, m, m) ← the iterates for A (m, m): Z_0 = Aᵀ/(max row sum · max column sum), then
 * Z_{t+1} = ¼ Z_t (13I − A Z_t (15I − A Z_t (7I − A Z_t))). work: 4 m² floats. */
void nystrom_pinv(float *Z, const float *A, long m, int iters, float *work);

#endif
