/* Checkpoint writing, reading, resolution of `latest`, and pruning (checkpoint.h). */
#include "io/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <zlib.h>

#include "core/error.h"
#include "core/fault.h"
#include "core/h5io.h"
#include "core/timer.h"

/* The three tensor sets of a checkpoint, in file order. */
enum { NSETS = 3 };
static const char *const set_prefix[NSETS] = {"/model", "/optimizer/m", "/optimizer/v"};

/* The host copy of a set: checkpoints are written from and read into the host, whatever device
 * the model runs on (model_sync_to_host before a write, model_sync_to_device after a read). */
static const float *set_base(const struct model *m, int set) {
  return set == 0 ? m->host_params : set == 1 ? m->host_m : m->host_v;
}

/* CRC-32 (zlib) of a tensor's float32 bytes as they lie in memory and in the file (little-endian
 * on every machine fmattn runs on): h5py users check it with zlib.crc32(dataset[...].tobytes()). */
static long tensor_crc(const float *x, size_t count) {
  return (long)crc32_z(crc32_z(0L, Z_NULL, 0), (const Bytef *)x, (z_size_t)(count * sizeof(float)));
}

/* Bytes a checkpoint of this model takes on disk, roughly (tensors plus HDF5 metadata). */
static double checkpoint_bytes(const struct model *m) {
  return (double)NSETS * (double)m->plist.total * sizeof(float) +
         4096.0 * (double)(NSETS * m->plist.count) + (1 << 20);
}

/* Refuse, on every rank and before touching the disk, a checkpoint that cannot fit. */
static void check_free_space(const struct model *m, struct comm *comm, const char *dir,
                             const char *final) {
  double avail = -1.0; /* unknown: let the write itself find out */
  struct statvfs fs;
  if (comm->world_rank == 0 && !fault_no_space_check() && statvfs(dir, &fs) == 0)
    avail = (double)fs.f_bavail * (double)fs.f_frsize;
  MPI_CHECK(MPI_Bcast(&avail, 1, MPI_DOUBLE, 0, comm->world));
  const double need = checkpoint_bytes(m);
  if (avail >= 0 && avail < need) {
    char msg[1400];
    snprintf(msg, sizeof msg,
             "cannot write checkpoint %s: it needs about %.1f MiB and the file system of %s has "
             "%.1f MiB free. The run stops here; the checkpoints already written are untouched. "
             "Free some space (or move output.dir) and resume with output.restart = latest",
             final, need / 1048576.0, dir, avail / 1048576.0);
    error_collective(msg);
  }
}

/* The file itself: the three tensor sets with their checksums, then the run's attributes. */
static void write_file(const struct model *m, const struct comm *comm, long step, const char *tmp,
                       bool writer, const long *crc) {
  const int count = m->plist.count;
  hid_t f = h5_create_collective(tmp, comm->world);
  char path[PARAM_NAME + 64];
  for (int s = 0; s < NSETS; s++)
    for (int i = 0; i < count; i++) {
      const struct param_desc *p = &m->plist.p[i];
      snprintf(path, sizeof path, "%s/%s", set_prefix[s], p->name);
      h5_write_floats(f, path, p->ndim, p->shape, writer ? set_base(m, s) + p->offset : NULL, true,
                      writer);
      /* attributes are collective metadata: every rank writes the same values */
      h5_attr_long(f, path, "crc32", crc[s * count + i]);
    }
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
  h5_attr_string(f, "/", "checksum",
                 "crc32: attribute crc32 of every dataset, zlib's CRC-32 of its float32 bytes");
  h5_close(f);
}

double checkpoint_write(struct model *m, struct comm *comm, long step, const char *dir) {
  double t0 = timer_now();
  timer_start(TIMER_IO);
  model_sync_to_host(m);
  char final[1024], tmp[1040], context[1200];
  snprintf(final, sizeof final, "%s/ckpt_%06ld.h5", dir, step);
  snprintf(tmp, sizeof tmp, "%s.tmp", final);
  check_free_space(m, comm, dir, final);
  const bool writer = comm->world_rank == 0; /* parameters are replicated; one rank writes */
  /* the checksums are computed where the data is and travel with the (collective) attributes */
  const int count = m->plist.count;
  long *crc = xcalloc((size_t)(NSETS * count), sizeof(long));
  for (int s = 0; writer && s < NSETS; s++)
    for (int i = 0; i < count; i++)
      crc[s * count + i] = tensor_crc(set_base(m, s) + m->plist.p[i].offset, m->plist.p[i].numel);
  MPI_CHECK(MPI_Bcast(crc, NSETS * count, MPI_LONG, 0, comm->world));

  /* a failed write (a full disk, a file-size limit) ends the job saying what it was writing, and
   * removes the temporary: the checkpoints already in dir are never touched */
  snprintf(context, sizeof context,
           "writing checkpoint %s: is its file system full or read-only? The earlier checkpoints "
           "are intact",
           tmp);
  error_context(context, tmp);
  /* parallel HDF5: every rank opens the file through MPI-IO and rank 0 supplies the data; serial
   * HDF5 (--with-hdf5=serial): rank 0 writes the same file alone */
  if (h5_parallel() || writer) write_file(m, comm, step, tmp, writer, crc);
  free(crc);
  error_context(NULL, NULL);
  comm_barrier(comm, COMM_WORLD);
  int rc = 0;
  if (writer && rename(tmp, final) != 0) rc = errno;
  comm_allreduce_max_int(comm, COMM_WORLD, &rc, 1);
  if (rc) error("cannot rename %s to %s: %s", tmp, final, strerror(rc));
  timer_stop(TIMER_IO);
  return timer_now() - t0;
}

/* A checkpoint that cannot be used: damaged (try an older one) or of another model (fatal). */
enum ckpt_status { CKPT_OK, CKPT_DAMAGED, CKPT_MISMATCH };

/* The worst status over the ranks; why holds rank 0's reason (every rank reads the same file,
 * so rank 0 is the one that has seen a problem whenever one was seen). */
static enum ckpt_status agree(struct comm *comm, enum ckpt_status st, char *why, size_t len) {
  int v = (int)st;
  comm_allreduce_max_int(comm, COMM_WORLD, &v, 1);
  if (v != CKPT_OK && !why[0]) snprintf(why, len, "another rank could not read it");
  return (enum ckpt_status)v;
}

/* Whether the file's model is the deck's: variant and head mode (shapes come with the tensors). */
static enum ckpt_status check_identity(hid_t f, const struct model *m, char *why, size_t len) {
  long step = -1;
  if (!h5_read_attr_long(f, "/", "step", &step) || step < 0) {
    snprintf(why, len, "it is not an fmattn checkpoint (no step attribute)");
    return CKPT_MISMATCH;
  }
  enum ckpt_status st = CKPT_OK;
  char *variant = NULL;
  if (h5_read_attr_string(f, "/", "variant", &variant) && strcmp(variant, m->attn->name) != 0) {
    snprintf(why, len, "it holds attention variant %s, but the deck asks for %s", variant,
             m->attn->name);
    st = CKPT_MISMATCH;
  }
  free(variant);
  char *heads = NULL; /* absent in checkpoints of standard heads written before FiSH existed */
  const char *want = m->cfg->attention.heads_mode == HEADS_FISH ? "fish" : "standard";
  if (st == CKPT_OK &&
      (h5_read_attr_string(f, "/", "heads_mode", &heads) ? strcmp(heads, want) != 0
                                                         : strcmp(want, "standard") != 0)) {
    snprintf(why, len, "it holds attention.heads_mode = %s, but the deck asks for %s",
             heads ? heads : "standard", want);
    st = CKPT_MISMATCH;
  }
  free(heads);
  return st;
}

/* Read every tensor and check it against its stored CRC-32. */
static enum ckpt_status read_tensors(hid_t f, struct model *m, char *why, size_t len,
                                     bool *verified) {
  char path[PARAM_NAME + 64];
  *verified = true;
  for (int s = 0; s < NSETS; s++)
    for (int i = 0; i < m->plist.count; i++) {
      const struct param_desc *p = &m->plist.p[i];
      snprintf(path, sizeof path, "%s/%s", set_prefix[s], p->name);
      float *dst = (float *)set_base(m, s) + p->offset;
      enum h5_read_status rs = h5_try_read_floats(f, path, p->ndim, p->shape, dst, why, len);
      if (rs == H5_READ_MISMATCH) return CKPT_MISMATCH;
      if (rs == H5_READ_DAMAGED) return CKPT_DAMAGED;
      long stored;
      if (!h5_read_attr_long(f, path, "crc32", &stored)) {
        *verified = false; /* written before checkpoints carried checksums */
        continue;
      }
      const long crc = tensor_crc(dst, p->numel);
      if (crc != stored) {
        snprintf(why, len, "dataset %s fails its checksum (crc32 %08lx stored, %08lx read)", path,
                 (unsigned long)stored, (unsigned long)crc);
        return CKPT_DAMAGED;
      }
    }
  return CKPT_OK;
}

/* Try one checkpoint: its step, or −1 with the status and the reason. Collective. */
static long try_read(struct model *m, struct comm *comm, const char *path, enum ckpt_status *st,
                     char *why, size_t len) {
  why[0] = '\0';
  char context[1200];
  snprintf(context, sizeof context, "reading checkpoint %s", path);
  error_context(context, NULL);
  *st = CKPT_OK;
  if (access(path, R_OK) != 0) {
    snprintf(why, len, "it cannot be read: %s", strerror(errno));
    *st = CKPT_DAMAGED;
  }
  hid_t f = -1;
  if (agree(comm, *st, why, len) == CKPT_OK) {
    f = h5_try_open_collective(path, comm->world);
    if (f < 0) {
      snprintf(why, len, "HDF5 cannot open it: truncated, or not an HDF5 file");
      *st = CKPT_DAMAGED;
    }
    *st = agree(comm, *st, why, len);
  } else {
    *st = CKPT_DAMAGED;
  }
  long step = -1;
  bool verified = true;
  if (*st == CKPT_OK) *st = agree(comm, check_identity(f, m, why, len), why, len);
  if (*st == CKPT_OK) *st = agree(comm, read_tensors(f, m, why, len, &verified), why, len);
  if (*st == CKPT_OK) h5_read_attr_long(f, "/", "step", &step);
  if (f >= 0) H5Fclose(f); /* a damaged file may not close cleanly; nothing to do about it */
  error_context(NULL, NULL);
  if (*st == CKPT_OK && !verified)
    message("note: %s carries no checksums (an older fmattn wrote it): not verified", path);
  return *st == CKPT_OK ? step : -1;
}

static void refuse(const char *path, enum ckpt_status st, const char *why) {
  char msg[1800];
  snprintf(msg, sizeof msg, "checkpoint %s is refused: %s%s", path, why,
           st == CKPT_MISMATCH ? " (it was written for another model: compare its deck "
                                 "attribute with this deck)"
                               : "");
  error_collective(msg);
}

long checkpoint_read(struct model *m, struct comm *comm, const char *path) {
  timer_start(TIMER_IO);
  enum ckpt_status st;
  char why[1024];
  long step = try_read(m, comm, path, &st, why, sizeof why);
  if (st != CKPT_OK) refuse(path, st, why);
  model_sync_to_device(m);
  timer_stop(TIMER_IO);
  return step;
}

static long ckpt_step(const char *name) {
  long step;
  char tail[8];
  if (sscanf(name, "ckpt_%ld.%7s", &step, tail) == 2 && strcmp(tail, "h5") == 0) return step;
  return -1;
}

static int cmp_long(const void *a, const void *b) {
  long x = *(const long *)a, y = *(const long *)b;
  return (x > y) - (x < y);
}

/* The steps of the ckpt_<step>.h5 files in dir, ascending; returns how many (at most max). */
static int list_steps(const char *dir, long *steps, int max) {
  DIR *d = opendir(dir);
  if (!d) return 0;
  int count = 0;
  struct dirent *e;
  while ((e = readdir(d)) && count < max) {
    long s = ckpt_step(e->d_name);
    if (s >= 0) steps[count++] = s;
  }
  closedir(d);
  qsort(steps, (size_t)count, sizeof(long), cmp_long);
  return count;
}

/* The newest checkpoint of dir that reads whole, falling back past damaged ones; its path in used.
 */
static long read_latest(struct model *m, struct comm *comm, const char *dir, char *used,
                        size_t len) {
  timer_start(TIMER_IO);
  enum { MAX_CKPT = 4096 };
  long *steps = xmalloc(sizeof(long) * MAX_CKPT);
  /* rank 0 lists the directory: every rank must try the same files in the same order */
  int count = comm->world_rank == 0 ? list_steps(dir, steps, MAX_CKPT) : 0;
  MPI_CHECK(MPI_Bcast(&count, 1, MPI_INT, 0, comm->world));
  MPI_CHECK(MPI_Bcast(steps, count, MPI_LONG, 0, comm->world));
  if (count == 0) {
    char msg[1200];
    snprintf(msg, sizeof msg,
             "output.restart = latest, but %s holds no checkpoint (ckpt_<step>.h5)", dir);
    error_collective(msg);
  }
  long step = -1;
  for (int k = count - 1; k >= 0 && step < 0; k--) {
    snprintf(used, len, "%s/ckpt_%06ld.h5", dir, steps[k]);
    message("reading checkpoint %s", used);
    enum ckpt_status st;
    char why[1024];
    step = try_read(m, comm, used, &st, why, sizeof why);
    if (st == CKPT_MISMATCH || (st == CKPT_DAMAGED && k == 0)) refuse(used, st, why);
    if (st == CKPT_DAMAGED && comm->world_rank == 0)
      warning(
          "checkpoint %s is damaged: %s. Trying the one before it, ckpt_%06ld.h5 (the damaged "
          "file is left in place, and replaced when the run writes that step again)",
          used, why, steps[k - 1]);
  }
  free(steps);
  timer_stop(TIMER_IO);
  return step;
}

long checkpoint_restore(struct model *m, struct comm *comm, const char *restart, const char *dir,
                        char *used, size_t len) {
  long step;
  if (strcmp(restart, "latest") == 0) {
    step = read_latest(m, comm, dir, used, len);
    model_sync_to_device(m);
  } else {
    snprintf(used, len, "%s", restart);
    message("reading checkpoint %s", restart);
    step = checkpoint_read(m, comm, restart);
  }
  message("restarting from %s at step %ld", used, step);
  return step;
}

void checkpoint_prune(const char *dir, int keep) {
  enum { MAX_CKPT = 4096 };
  long *steps = xmalloc(sizeof(long) * MAX_CKPT);
  int count = list_steps(dir, steps, MAX_CKPT);
  for (int i = 0; i < count - keep; i++) {
    char path[1024];
    snprintf(path, sizeof path, "%s/ckpt_%06ld.h5", dir, steps[i]);
    if (unlink(path) != 0) warning("cannot remove old checkpoint %s: %s", path, strerror(errno));
  }
  free(steps);
}
