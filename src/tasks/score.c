/* Accuracy on scored targets (tasks.h): sums over an evaluation's batches, by distance bucket and
 * by sample, in one buffer of doubles that the caller reduces over ranks before reading it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "tasks/tasks.h"

int task_bucket(long distance, int buckets) {
  if (distance < 0) return -1;
  int k = 0;
  while (k + 1 < buckets && distance >= (1L << k)) k++; /* [2^(k−1), 2^k) is bucket k */
  return k;
}

int task_buckets(long n) { return n <= 1 ? 1 : task_bucket(n - 1, 64) + 1; }

void task_bucket_edges(int k, long n, long *start, long *end) {
  *start = k == 0 ? 0 : 1L << (k - 1);
  *end = 1L << k;
  if (*end > n || k + 1 == task_buckets(n)) *end = n;
}

/* Offsets of the parts of sums. */
enum { SCORED, CORRECT, BY_BUCKET };

void task_score_open(struct task_score *s, long n, long windows) {
  s->n = n;
  s->windows = windows;
  s->buckets = task_buckets(n);
  s->count = (size_t)(BY_BUCKET + 2 * s->buckets + 2 * windows);
  s->sums = xcalloc(s->count, sizeof(double));
}

void task_score_close(struct task_score *s) {
  free(s->sums);
  s->sums = NULL;
}

void task_score_add(struct task_score *s, long first, long stride, long B, long T,
                    const int *targets, const int *pred, const int *distance) {
  double *bscored = s->sums + BY_BUCKET, *bcorrect = bscored + s->buckets;
  double *wscored = bcorrect + s->buckets, *wwrong = wscored + s->windows;
  for (long b = 0; b < B; b++) {
    const long k = first + b * stride;
    if (k >= s->windows) continue;
    for (long t = 0; t < T; t++) {
      const long i = b * T + t;
      if (targets[i] < 0) continue;
      const bool right = pred[i] == targets[i];
      s->sums[SCORED] += 1.0;
      s->sums[CORRECT] += right;
      wscored[k] += 1.0;
      wwrong[k] += !right;
      const int bucket = distance ? task_bucket(distance[i], s->buckets) : -1;
      if (bucket >= 0) {
        bscored[bucket] += 1.0;
        bcorrect[bucket] += right;
      }
    }
  }
}

void task_score_result(const struct task_score *s, struct task_accuracy *r, double *by_bucket,
                       double *scored_by_bucket) {
  const double *bscored = s->sums + BY_BUCKET, *bcorrect = bscored + s->buckets;
  const double *wscored = bcorrect + s->buckets, *wwrong = wscored + s->windows;
  r->scored = s->sums[SCORED];
  r->accuracy = r->scored > 0 ? s->sums[CORRECT] / r->scored : NAN;
  double samples = 0, right = 0;
  for (long k = 0; k < s->windows; k++)
    if (wscored[k] > 0) {
      samples += 1.0;
      right += wwrong[k] == 0;
    }
  r->samples = samples;
  r->sample_accuracy = samples > 0 ? right / samples : NAN;
  for (int k = 0; k < s->buckets; k++) {
    if (by_bucket) by_bucket[k] = bscored[k] > 0 ? bcorrect[k] / bscored[k] : NAN;
    if (scored_by_bucket) scored_by_bucket[k] = bscored[k];
  }
}
