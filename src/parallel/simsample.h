/* Sampled compute, for simulations only (the SimGrid SMPI build, FMATTN_SMPI_SAMPLE=k in the
 * environment): a region of arithmetic wrapped in sim_sample_begin / sim_sample_end runs for real
 * only until its site has k measurements taken after every simulated rank finished its warm-up
 * step; from then on every rank skips it and is charged its own work times the site's measured
 * seconds per unit of work, on the simulated clock. One table serves every simulated rank, so the
 * measurements come from the first few ranks alone, while the others skip: the charged costs do
 * not carry what 64 or 128 ranks sharing one simulating process do to each other's caches and
 * page tables (docs/scaling.md), and a simulated step runs far faster than its ranks' arithmetic.
 * The values the skipped regions leave are stale; the timings are not. A region holds no
 * communication. FMATTN_SMPI_SAMPLE_SAVE=FILE writes the measured rates at the end of bench's
 * training rows; FMATTN_SMPI_SAMPLE_LOAD=FILE starts a run with them (its sites are measured
 * already): a sweep can charge every S at the rates one rank measured alone. A line of that file
 * is "NAME<tab>measurements seconds work [floor]": the optional floor is the least a call is
 * charged, in seconds (scripts/simgrid/gpu_rates.py writes it: a GPU's kernel launches, which do
 * not shrink with the work). Everywhere else (every
 * other build, or the variable unset) sim_sample_begin returns true and costs nothing.
 *
 *   struct sim_sample s;
 *   if (sim_sample_begin(&s, "fma near forward", work)) {
 *     ... the arithmetic ...
 *     sim_sample_end(&s);
 *   } else {
 *     times->p2p += s.charged; // an operator timer the region's body would have fed
 *   }
 */
#ifndef FMATTN_SIMSAMPLE_H
#define FMATTN_SIMSAMPLE_H

#include <stdbool.h>

#include <mpi.h>

struct sim_sample {
  int site;       /* the table's entry being measured, or −1: not measured */
  double t0;      /* the simulated clock at the region's start */
  double work;    /* the caller's measure of the region's work (flops, rows: any unit) */
  double charged; /* seconds charged for a skipped region */
};

#ifdef FMATTN_SMPI
/* After MPI_Init, on every rank of MPI_COMM_WORLD (collective): measures the regions' clock
 * scale (timer.h) one rank at a time, reads FMATTN_SMPI_SAMPLE (the measurements per site; unset
 * or 0: off) and shares one table among the simulated ranks. */
void sim_sample_open(MPI_Comm world);
/* A rank's warm-up step is done: measuring starts once every rank has said so. Idempotent. Only
 * bench's training steps call it (a training run's losses would be stale), so every other mode
 * runs every region. */
void sim_sample_arm(void);
bool sim_sample_begin(struct sim_sample *s, const char *site, double work);
void sim_sample_end(struct sim_sample *s);
/* This rank's regions run and skipped so far (for bench's report); false when sampling is off. */
bool sim_sample_counts(long *run, long *skipped);
/* Rank 0 prints the `top` sites with the longest measured regions, and writes every site's rate
 * to FMATTN_SMPI_SAMPLE_SAVE when it is set. */
void sim_sample_report(int top);
/* Whether regions may be skipped in this run: a caller computes a costly work measure only then. */
bool sim_sampling(void);
#else
static inline void sim_sample_open(MPI_Comm world) { (void)world; }
static inline void sim_sample_arm(void) {}
static inline bool sim_sample_begin(struct sim_sample *s, const char *site, double work) {
  (void)site, (void)work;
  s->site = -1;
  s->charged = 0.0;
  return true;
}
static inline void sim_sample_end(struct sim_sample *s) { (void)s; }
static inline bool sim_sample_counts(long *run, long *skipped) {
  *run = *skipped = 0;
  return false;
}
static inline bool sim_sampling(void) { return false; }
static inline void sim_sample_report(int top) { (void)top; }
#endif

#endif
