/* Checkpoint writing, reading, resolution of `latest`, and pruning (checkpoint.h). */
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "error.h"
#include "h5io.h"
#include "timer.h"

static void write_set(hid_t f, const struct model *m, const char *prefix, const float *base,
                      bool writer) {
  char path[PARAM_NAME + 64];
  for (int i = 0; i < m->plist.count; i++) {
    const struct param_desc *p = &m->plist.p[i];
    snprintf(path, sizeof path, "%s/%s", prefix, p->name);
    h5_write_floats(f, path, p->ndim, p->shape, writer ? base + p->offset : NULL, true, writer);
  }
}

double checkpoint_write(const struct model *m, struct comm *comm, long step, const char *dir) {
  double t0 = timer_now();
  timer_start(TIMER_IO);
  char final[1024], tmp[1040];
  snprintf(final, sizeof final, "%s/ckpt_%06ld.h5", dir, step);
  snprintf(tmp, sizeof tmp, "%s.tmp", final);
  const bool writer = comm->world_rank == 0; /* parameters are replicated; one rank writes */
  hid_t f = h5_create_collective(tmp, comm->world);
  write_set(f, m, "/model", m->params, writer);
  write_set(f, m, "/optimizer/m", m->m, writer);
  write_set(f, m, "/optimizer/v", m->v, writer);
  /* attributes are collective metadata: every rank writes the same values */
  h5_attr_long(f, "/", "step", step);
  h5_attr_string(f, "/", "rng", "counter-based: every stream is a function of (seed, step)");
  h5_attr_long(f, "/", "seed", (long)m->cfg->run.seed);
  h5_attr_long(f, "/", "data_cursor", step);
  h5_attr_string(f, "/", "deck", m->cfg->resolved);
  h5_attr_string(f, "/", "version", PACKAGE_VERSION);
  h5_attr_string(f, "/", "variant", m->attn->name);
  h5_attr_string(f, "/", "heads_mode",
                 m->cfg->attention.heads_mode == HEADS_FISH ? "fish" : "standard");
  h5_attr_long(f, "/", "ranks", comm->world_size);
  h5_attr_long(f, "/", "seq_ranks", comm->S);
  h5_close(f);
  comm_barrier(comm, COMM_WORLD);
  int rc = 0;
  if (writer && rename(tmp, final) != 0) rc = errno;
  comm_allreduce_max_int(comm, COMM_WORLD, &rc, 1);
  if (rc) error("cannot rename %s to %s: %s", tmp, final, strerror(rc));
  timer_stop(TIMER_IO);
  return timer_now() - t0;
}

static void read_set(hid_t f, struct model *m, const char *prefix, float *base, const char *file) {
  char path[PARAM_NAME + 64];
  for (int i = 0; i < m->plist.count; i++) {
    const struct param_desc *p = &m->plist.p[i];
    snprintf(path, sizeof path, "%s/%s", prefix, p->name);
    h5_read_floats(f, path, p->ndim, p->shape, base + p->offset, file);
  }
}

long checkpoint_read(struct model *m, struct comm *comm, const char *path) {
  timer_start(TIMER_IO);
  if (access(path, R_OK) != 0) error("cannot read checkpoint '%s': %s", path, strerror(errno));
  hid_t f = h5_open_collective(path, comm->world);
  long step = -1;
  if (!h5_read_attr_long(f, "/", "step", &step) || step < 0)
    error("'%s' is not an fmattn checkpoint (no step attribute)", path);
  char *variant = NULL;
  if (h5_read_attr_string(f, "/", "variant", &variant) && strcmp(variant, m->attn->name) != 0)
    error("checkpoint '%s' holds attention variant %s, but the deck asks for %s", path, variant,
          m->attn->name);
  free(variant);
  char *heads = NULL; /* absent in checkpoints of standard heads written before FiSH existed */
  const char *want = m->cfg->attention.heads_mode == HEADS_FISH ? "fish" : "standard";
  if (h5_read_attr_string(f, "/", "heads_mode", &heads) ? strcmp(heads, want) != 0
                                                        : strcmp(want, "standard") != 0)
    error("checkpoint '%s' holds attention.heads_mode = %s, but the deck asks for %s", path,
          heads ? heads : "standard", want);
  free(heads);
  read_set(f, m, "/model", m->params, path);
  read_set(f, m, "/optimizer/m", m->m, path);
  read_set(f, m, "/optimizer/v", m->v, path);
  h5_close(f);
  timer_stop(TIMER_IO);
  return step;
}

static long ckpt_step(const char *name) {
  long step;
  char tail[8];
  if (sscanf(name, "ckpt_%ld.%7s", &step, tail) == 2 && strcmp(tail, "h5") == 0) return step;
  return -1;
}

int checkpoint_resolve(const char *restart, const char *dir, char *path, size_t len) {
  if (strcmp(restart, "latest") != 0) {
    snprintf(path, len, "%s", restart);
    return 0;
  }
  DIR *d = opendir(dir);
  long best = -1;
  if (d) {
    struct dirent *e;
    while ((e = readdir(d))) {
      long s = ckpt_step(e->d_name);
      if (s > best) best = s;
    }
    closedir(d);
  }
  if (best < 0) {
    snprintf(path, len, "output.restart = latest, but %s holds no checkpoint (ckpt_<step>.h5)",
             dir);
    return 1;
  }
  snprintf(path, len, "%s/ckpt_%06ld.h5", dir, best);
  return 0;
}

static int cmp_long(const void *a, const void *b) {
  long x = *(const long *)a, y = *(const long *)b;
  return (x > y) - (x < y);
}

void checkpoint_prune(const char *dir, int keep) {
  DIR *d = opendir(dir);
  if (!d) return;
  long steps[4096];
  int count = 0;
  struct dirent *e;
  while ((e = readdir(d)) && count < 4096) {
    long s = ckpt_step(e->d_name);
    if (s >= 0) steps[count++] = s;
  }
  closedir(d);
  qsort(steps, (size_t)count, sizeof(long), cmp_long);
  for (int i = 0; i < count - keep; i++) {
    char path[1024];
    snprintf(path, sizeof path, "%s/ckpt_%06ld.h5", dir, steps[i]);
    if (unlink(path) != 0) warning("cannot remove old checkpoint %s: %s", path, strerror(errno));
  }
}
