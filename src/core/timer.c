/* Phase and operator timers (timer.h). */
#include "core/timer.h"

#include <time.h>

static double timer_begin_[TIMER_COUNT];
static double timer_step_[TIMER_COUNT];
static double timer_total_[TIMER_COUNT];
static int timer_depth_[TIMER_COUNT];

static const char *timer_names_[TIMER_COUNT] = {
    "forward", "backward",   "attention", "comm", "optimizer", "io",       "data",
    "eval",    "P2P",        "P2M",       "M2M",  "M2P",       "exchange", "gemm",
    "norm",    "activation", "dropout",   "copy", "loss"};

double timer_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Re-entrant starts (a phase timed again inside itself) count once. */
void timer_start(enum timer_id id) {
  if (timer_depth_[id]++ == 0) timer_begin_[id] = timer_now();
}

void timer_stop(enum timer_id id) {
  if (--timer_depth_[id] == 0) {
    double ms = 1e3 * (timer_now() - timer_begin_[id]);
    timer_step_[id] += ms;
    timer_total_[id] += ms;
  }
}

void timer_add_ms(enum timer_id id, double ms) {
  timer_step_[id] += ms;
  timer_total_[id] += ms;
}

double timer_step_ms(enum timer_id id) { return timer_step_[id]; }

void timer_step_reset(void) {
  for (int i = 0; i < TIMER_COUNT; i++) timer_step_[i] = 0.0;
}

double timer_total_ms(enum timer_id id) { return timer_total_[id]; }
const char *timer_name(enum timer_id id) { return timer_names_[id]; }
