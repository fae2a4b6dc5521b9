/* AdamW, clipping and schedule (optimizer.h). */
#include "model/optimizer.h"

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
  return sqrt(model->be->sum_squares(model->grads, model->plist.total));
}

void optimizer_step(struct model *model, long t, double lr, float grad_scale) {
  const struct config_train *tc = &model->cfg->train;
  struct adamw_step s = {.beta1 = (float)tc->beta1,
                         .beta2 = (float)tc->beta2,
                         .eps = (float)tc->eps,
                         .bc1 = 1.0f - (float)pow(tc->beta1, (double)t),
                         .bc2 = 1.0f - (float)pow(tc->beta2, (double)t),
                         .grad_scale = grad_scale};
  const float flr = (float)lr;
  for (int i = 0; i < model->plist.count; i++) {
    const struct param_desc *p = &model->plist.p[i];
    if (p->frozen) continue;
    s.wd = p->decay ? (float)tc->weight_decay : 0.0f;
    s.lr = flr * p->lr_scale;
    const size_t o = p->offset;
    model->be->adamw(model->params + o, model->grads + o, model->m + o, model->v + o, p->numel, &s);
  }
}
