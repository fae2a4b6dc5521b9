/* Sampled compute for simulations (simsample.h): one table of measured sites shared by every
 * simulated rank of the SMPI build. SimGrid runs the ranks one at a time in one thread (the SMPI
 * build has no OpenMP), so the table needs no lock. */
#include "parallel/simsample.h"

#ifdef FMATTN_SMPI
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <simgrid/host.h>
#include <smpi/smpi.h>

#include "core/error.h"
#include "core/timer.h"

#define SIM_SITES     128
#define SIM_SITE_NAME 48

struct sim_site {
  char name[SIM_SITE_NAME];
  int started;    /* measurements begun (a rank yields to the others at a region's start) */
  int n;          /* measurements taken */
  double seconds; /* their simulated seconds, summed */
  double work;    /* their work, summed */
  double floor;   /* seconds charged at least per call (a loaded file's fourth field; else 0) */
};

struct sim_table {
  int k;     /* measurements per site */
  int world; /* simulated ranks */
  int armed; /* ranks past their warm-up step */
  int nsites;
  struct sim_site site[SIM_SITES];
};

/* Under SMPI's privatisation every simulated rank has its own copy of these; table_ points at
 * the one table rank 0 allocated (the ranks share the process's heap). */
static struct sim_table *table_;
static bool armed_;
static long run_, skipped_;

static struct sim_site *site_of(const char *name) {
  for (int i = 0; i < table_->nsites; i++)
    if (strncmp(table_->site[i].name, name, SIM_SITE_NAME - 1) == 0) return &table_->site[i];
  if (table_->nsites == SIM_SITES) error("internal: more than %d sampled sites", SIM_SITES);
  struct sim_site *s = &table_->site[table_->nsites++];
  const size_t len = strnlen(name, SIM_SITE_NAME - 1);
  memcpy(s->name, name, len);
  s->name[len] = '\0';
  return s;
}

/* The rates another run measured (the file sim_sample_report writes to FMATTN_SMPI_SAMPLE_SAVE):
 * its sites count as measured. Rank 0, before the table is shared; false on a malformed file. */
static bool load(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return false;
  char line[512];
  bool ok = true;
  while (fgets(line, sizeof line, f)) {
    char *tab = strchr(line, '\t');
    int n, fields = 0;
    double seconds, work, floor = 0.0;
    if (line[0] == '#') continue;
    if (tab) fields = sscanf(tab + 1, "%d %lf %lf %lf", &n, &seconds, &work, &floor);
    if (fields < 3 || n <= 0 || !(floor >= 0.0)) {
      ok = false;
      break;
    }
    *tab = '\0';
    struct sim_site *e = site_of(line);
    e->started = e->n = n > table_->k ? n : table_->k;
    e->seconds = seconds / n * e->n;
    e->work = work / n * e->n;
    e->floor = floor;
  }
  fclose(f);
  return ok;
}

void sim_sample_open(MPI_Comm world) {
  int rank, size;
  MPI_CHECK(MPI_Comm_rank(world, &rank));
  MPI_CHECK(MPI_Comm_size(world, &size));
  /* the regions' clock scale (timer.h), one rank at a time: a rank waiting in the barrier does
   * not share its simulated host with the one measuring */
  for (int r = 0; r < size; r++) {
    if (r == rank) timer_region_calibrate();
    MPI_CHECK(MPI_Barrier(world));
  }
  const char *e = getenv("FMATTN_SMPI_SAMPLE");
  char *end = NULL;
  long k = e && *e ? strtol(e, &end, 10) : 0;
  if (e && *e && (*end != '\0' || k < 0 || k > 1000))
    error_collective(
        "FMATTN_SMPI_SAMPLE: expected the measurements per site, 0 to 1000 (0: every region "
        "runs)");
  table_ = NULL;
  if (k == 0) return;
  uint64_t addr = 0;
  int loaded = 1;
  if (rank == 0) {
    table_ = calloc(1, sizeof *table_);
    if (!table_) error("out of memory: the sampled sites' table");
    table_->k = (int)k;
    table_->world = size;
    const char *from = getenv("FMATTN_SMPI_SAMPLE_LOAD");
    if (from && *from) loaded = load(from);
    addr = (uint64_t)(uintptr_t)table_;
  }
  MPI_CHECK(MPI_Bcast(&loaded, 1, MPI_INT, 0, world));
  if (!loaded)
    error_collective(
        "FMATTN_SMPI_SAMPLE_LOAD: cannot read the sampled rates (a file that "
        "FMATTN_SMPI_SAMPLE_SAVE wrote: one line per site, NAME<tab>N SECONDS WORK [FLOOR])");
  MPI_CHECK(MPI_Bcast(&addr, 1, MPI_UINT64_T, 0, world));
  table_ = (struct sim_table *)(uintptr_t)addr;
  if (table_->nsites > 0)
    message("sampled compute: the measured rates of %d sites from %s", table_->nsites,
            getenv("FMATTN_SMPI_SAMPLE_LOAD"));
}

void sim_sample_arm(void) {
  if (!table_ || armed_) return;
  armed_ = true;
  table_->armed++;
}

bool sim_sampling(void) { return table_ != NULL; }

bool sim_sample_begin(struct sim_sample *s, const char *site, double work) {
  s->site = -1;
  s->charged = 0.0;
  if (!table_ || table_->armed < table_->world) {
    timer_region_begin(); /* one burst, sampled or not (timer.h) */
    return true;
  }
  struct sim_site *e = site_of(site);
  if (e->started < table_->k) { /* measured: runs for real, in one burst */
    e->started++; /* before the region's first clock reading lets the other ranks reach it */
    s->site = (int)(e - table_->site);
    s->work = work;
    timer_region_begin();
    /* the region's own clock: its arithmetic alone, not what a simulated host shared with
     * another rank makes of it (the charge is shared again when it is executed) */
    s->t0 = timer_now();
    run_++;
    return true;
  }
  if (e->n == 0) { /* measurements under way on other ranks, none finished: runs, unmeasured */
    timer_region_begin();
    run_++;
    return true;
  }
  /* charged: this rank's work at the site's measured rate (its mean, where no work is counted) */
  s->charged = e->work > 0.0 ? work * e->seconds / e->work : e->seconds / e->n;
  if (s->charged < e->floor) s->charged = e->floor;
  if (s->charged > 0.0) smpi_execute_flops_benched(s->charged * sg_host_get_speed(sg_host_self()));
  skipped_++;
  return false;
}

void sim_sample_end(struct sim_sample *s) {
  const double t1 = s->site >= 0 ? timer_now() : 0.0;
  timer_region_end();
  if (s->site < 0) return;
  struct sim_site *e = &table_->site[s->site];
  e->seconds += t1 - s->t0;
  e->work += s->work;
  e->n++;
}

void sim_sample_report(int top) {
  if (!table_) return;
  bool shown[SIM_SITES] = {false};
  for (int t = 0; t < top && t < table_->nsites; t++) {
    int best = -1;
    for (int i = 0; i < table_->nsites; i++)
      if (!shown[i] && table_->site[i].n > 0 &&
          (best < 0 || table_->site[i].seconds / table_->site[i].n >
                           table_->site[best].seconds / table_->site[best].n))
        best = i;
    if (best < 0) break;
    shown[best] = true;
    const struct sim_site *e = &table_->site[best];
    message("  sampled    %-47s %d measurements, %.2f ms each (%.4g ms per unit of work)", e->name,
            e->n, 1e3 * e->seconds / e->n, e->work > 0 ? 1e3 * e->seconds / e->work : 0.0);
  }
  const char *to = getenv("FMATTN_SMPI_SAMPLE_SAVE");
  if (!to || !*to || error_rank() > 0) return;
  FILE *f = fopen(to, "w");
  if (!f) error("FMATTN_SMPI_SAMPLE_SAVE: cannot write '%s'", to);
  fprintf(f, "# fmattn sampled sites: NAME<tab>measurements seconds work [floor] (simsample.h)\n");
  for (int i = 0; i < table_->nsites; i++) {
    const struct sim_site *e = &table_->site[i];
    if (e->n == 0) continue;
    fprintf(f, "%s\t%d %.9g %.9g", e->name, e->n, e->seconds, e->work);
    if (e->floor > 0.0) fprintf(f, " %.9g", e->floor);
    fputc('\n', f);
  }
  if (fclose(f) != 0) error("FMATTN_SMPI_SAMPLE_SAVE: cannot write '%s'", to);
  message("  sampled    rates of %d sites saved to %s", table_->nsites, to);
}

bool sim_sample_counts(long *run, long *skipped) {
  *run = run_;
  *skipped = skipped_;
  return table_ != NULL;
}
#endif
