/* AdamW, clipping and schedule (optimizer.h). */
#include "optimizer.h"

#include <math.h>

#define PI 3.14159265358979323846

double optimizer_lr(const struct config *cfg, long step) {
  const struct config_train *t = &cfg->train;
  if (t->warmup > 0 && step < t->warmup) return t->lr * (double)(step + 1) / (double)t->warmup;
  if (t->schedule == SCHEDULE_CONSTANT) return t->lr;
  long span = t->steps - t->warmup;
  double frac = span > 0 ? (double)(step - t->warmup) / (double)span : 1.0;
  if (frac > 1.0) frac = 1.0;
  if (frac < 0.0) frac = 0.0;
  double shape = t->schedule == SCHEDULE_COSINE ? 0.5 * (1.0 + cos(PI * frac)) : 1.0 - frac;
  return t->min_lr + (t->lr - t->min_lr) * shape;
}

double optimizer_grad_norm(const struct model *model) {
  const size_t total = model->plist.total;
  enum { CHUNKS = 256 };
  double part[CHUNKS] = {0};
#pragma omp parallel for schedule(static)
  for (int c = 0; c < CHUNKS; c++) {
    size_t lo = total * (size_t)c / CHUNKS, hi = total * (size_t)(c + 1) / CHUNKS;
    double s = 0.0;
    for (size_t i = lo; i < hi; i++) s += (double)model->grads[i] * model->grads[i];
    part[c] = s;
  }
  double s = 0.0;
  for (int c = 0; c < CHUNKS; c++) s += part[c];
  return sqrt(s);
}

void optimizer_step(struct model *model, long t, double lr, float grad_scale) {
  const struct config_train *tc = &model->cfg->train;
  const float b1 = (float)tc->beta1, b2 = (float)tc->beta2, eps = (float)tc->eps;
  const float bc1 = 1.0f - (float)pow(tc->beta1, (double)t);
  const float bc2 = 1.0f - (float)pow(tc->beta2, (double)t);
  const float flr = (float)lr;
  for (int i = 0; i < model->plist.count; i++) {
    const struct param_desc *p = &model->plist.p[i];
    if (p->frozen) continue;
    const float wd = p->decay ? (float)tc->weight_decay : 0.0f;
    const float plr = flr * p->lr_scale;
    float *w = model->params + p->offset, *g = model->grads + p->offset;
    float *m = model->m + p->offset, *v = model->v + p->offset;
    const long count = (long)p->numel;
#pragma omp parallel for simd schedule(static) if (count > 65536)
    for (long e = 0; e < count; e++) {
      float grad = g[e] * grad_scale;
      m[e] = b1 * m[e] + (1.0f - b1) * grad;
      v[e] = b2 * v[e] + (1.0f - b2) * grad * grad;
      float mhat = m[e] / bc1, vhat = v[e] / bc2;
      w[e] -= plr * (mhat / (sqrtf(vhat) + eps) + wd * w[e]);
    }
  }
}
