/* Wall-clock timers by phase and by operator. Inclusive: attention time is also forward (or
 * backward) time; comm time is counted inside the phase that communicates. Per-step values feed
 * diag.h5 /timing/<phase>_ms; run totals feed the final summary. Single-threaded use only (call
 * from outside OpenMP regions). */
#ifndef FMATTN_TIMER_H
#define FMATTN_TIMER_H

#ifdef __cplusplus
extern "C" {
#endif

enum timer_id {
  TIMER_FORWARD,
  TIMER_BACKWARD,
  TIMER_ATTENTION,
  TIMER_COMM,
  TIMER_OPTIMIZER,
  TIMER_IO,
  TIMER_DATA,
  TIMER_EVAL,
  /* FMA operators (SPEC §6.4), forward + backward */
  TIMER_P2P,
  TIMER_P2M,
  TIMER_M2M,
  TIMER_M2P,
  /* time inside the blocking exchanges between sequence ranks (comm.c: halos, the LET, the ring;
   * a wait on a slower rank included) */
  TIMER_EXCHANGE,
  /* the model's per-token passes (model.c), by kind: matrix products of the linear layers (their
   * bias copies included), layer norms, GELU, dropout (residual adds included), copies (head
   * split and merge, rotary and sinusoidal positions, embedding, zeroing of gradient buffers) and
   * the loss; the attention operators are TIMER_ATTENTION */
  TIMER_GEMM,
  TIMER_NORM,
  TIMER_ACTIVATION,
  TIMER_DROPOUT,
  TIMER_COPY,
  TIMER_LOSS,
  TIMER_COUNT
};

/* The phases written to diag.h5 every logged step: TIMER_FORWARD .. TIMER_IO. */
#define TIMER_DIAG_COUNT (TIMER_IO + 1)

double timer_now(void); /* seconds, monotonic */

/* A stretch of arithmetic with no communication inside (simsample.h's regions). In the SimGrid
 * SMPI build every clock reading asks the simulation for its time, which ends the rank's burst
 * and lets every other simulated rank run before this one goes on: the fma operators' timers,
 * read per block of 64 queries, then interleave 64 ranks block by block on the simulating core,
 * and each rank's arithmetic finds the caches the others left. Inside a region timer_now()
 * instead reads the simulating core's clock from the region's start, scaled as SMPI charges a
 * burst (measured once per rank), and the region is one burst. Nests; no-ops in
 * every other build. */
#ifdef FMATTN_SMPI
void timer_region_begin(void);
void timer_region_end(void);
/* Measure this rank's scale now (simsample.c calls it on one rank at a time at start-up, so that
 * no other rank shares the simulated host meanwhile); else the first region measures it. */
void timer_region_calibrate(void);
#else
static inline void timer_region_begin(void) {}
static inline void timer_region_end(void) {}
#endif
void timer_start(enum timer_id id);
void timer_stop(enum timer_id id);
/* Add time measured elsewhere (e.g. summed over threads) to a timer. */
void timer_add_ms(enum timer_id id, double ms);
/* Milliseconds accumulated since the last timer_step_reset. */
double timer_step_ms(enum timer_id id);
void timer_step_reset(void);
/* Milliseconds accumulated over the run. */
double timer_total_ms(enum timer_id id);
const char *timer_name(enum timer_id id);

#ifdef __cplusplus
}
#endif

#endif
