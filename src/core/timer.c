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

#ifdef FMATTN_SMPI

/* Per simulated rank (SMPI privatises these): the open regions' depth, and the outermost one's
 * start on the simulated clock and on the simulating core's, with the burst's scale. */
static int region_depth_;
static double region_sim0_, region_real0_, region_scale_;

static double real_now(void) {
  struct timespec t;
  (clock_gettime)(CLOCK_MONOTONIC, &t); /* the C library's, not SMPI's simulated clock */
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Simulated seconds per second of the simulating core, as SMPI charges this rank's bursts
 * (smpi/host-speed over the host's speed in the platform; 0 under smpi/simulate-computation:no):
 * measured on a burst of 2 ms, since SimGrid keeps smpi/host-speed where sg_cfg_get_double cannot
 * read it — while no other rank computes on the host (timer_region_calibrate), or else the
 * host's sharing would enter the scale. */
static double burst_scale(void) {
  double sim0 = timer_now(), real0 = real_now(), real1;
  volatile double x = 0.0;
  do {
    for (int i = 0; i < 1000; i++) x += (double)i;
    real1 = real_now();
  } while (real1 - real0 < 2e-3);
  const double scale = (timer_now() - sim0) / (real1 - real0);
  return scale > 0.0 ? scale : 1e-300; /* 1e-300: measured, no computation simulated */
}

void timer_region_calibrate(void) { region_scale_ = burst_scale(); }

void timer_region_begin(void) {
  if (region_depth_ > 0) {
    region_depth_++;
    return;
  }
  if (region_scale_ == 0.0) region_scale_ = burst_scale();
  region_sim0_ = timer_now(); /* ends the burst before the region: the region starts a new one */
  region_real0_ = real_now();
  region_depth_ = 1;
}

void timer_region_end(void) { region_depth_--; }
#endif

double timer_now(void) {
#ifdef FMATTN_SMPI
  if (region_depth_ > 0) return region_sim0_ + (real_now() - region_real0_) * region_scale_;
#endif
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
