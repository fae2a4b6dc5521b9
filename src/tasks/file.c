/* Task files (tasks.h, docs/tasks.md): reading and checking one, with one clear message for each
 * way a file can be wrong, and writing one (data.export). Serial HDF5 on the calling rank; the
 * caller decides who reads and who writes. */
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/h5io.h"
#include "tasks/tasks.h"

/* A dataset's shape (ndim ≤ 2) and class; false when absent. */
static bool dataset_info(hid_t f, const char *name, int *ndim, hsize_t *dims, H5T_class_t *cls) {
  if (H5Lexists(f, name, H5P_DEFAULT) <= 0) return false;
  hid_t ds = H5Dopen2(f, name, H5P_DEFAULT);
  if (ds < 0) return false;
  hid_t space = H5Dget_space(ds), type = H5Dget_type(ds);
  *ndim = H5Sget_simple_extent_ndims(space);
  if (*ndim >= 1 && *ndim <= 2) H5Sget_simple_extent_dims(space, dims, NULL);
  *cls = H5Tget_class(type);
  H5Tclose(type);
  H5Sclose(space);
  H5Dclose(ds);
  return true;
}

/* Reads a whole integer (or boolean enum) dataset as long long; false on a read failure. */
static bool read_integers(hid_t f, const char *name, long long *out) {
  hid_t ds = H5Dopen2(f, name, H5P_DEFAULT);
  if (ds < 0) return false;
  hid_t type = H5Dget_type(ds);
  herr_t rc;
  if (H5Tget_class(type) == H5T_ENUM) { /* h5py's bool: an enum over a 1-byte integer */
    hid_t base = H5Tget_super(type);
    const size_t size = H5Tget_size(base);
    hssize_t count = 0;
    hid_t space = H5Dget_space(ds);
    count = H5Sget_simple_extent_npoints(space);
    H5Sclose(space);
    if (size != 1) {
      rc = -1;
    } else {
      signed char *tmp = xmalloc((size_t)count);
      hid_t mem = H5Tcopy(type);
      rc = H5Dread(ds, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, tmp);
      for (hssize_t i = 0; i < count && rc >= 0; i++) out[i] = tmp[i];
      H5Tclose(mem);
      free(tmp);
    }
    H5Tclose(base);
  } else {
    rc = H5Dread(ds, H5T_NATIVE_LLONG, H5S_ALL, H5S_ALL, H5P_DEFAULT, out);
  }
  H5Tclose(type);
  H5Dclose(ds);
  return rc >= 0;
}

static const char *const layout =
    "a task file holds tokens (N, L) in [0, 256), scored (N, L-1) of 0/1 and optionally "
    "distance (N, L-1); docs/tasks.md";

/* Shape and class checks of the three datasets; fills rows and L. */
static int check_shapes(hid_t f, const char *path, long n, long *rows, long *L, bool *has_dist,
                        char *err, size_t len) {
  int nd;
  hsize_t dims[2] = {0, 0};
  H5T_class_t cls;
  if (!dataset_info(f, "tokens", &nd, dims, &cls)) {
    snprintf(err, len, "task file '%s' has no dataset 'tokens' (%s)", path, layout);
    return 1;
  }
  if (nd != 2 || cls != H5T_INTEGER) {
    snprintf(err, len, "task file '%s': tokens must be a 2-D integer dataset (N, L) (%s)", path,
             layout);
    return 1;
  }
  *rows = (long)dims[0];
  *L = (long)dims[1];
  if (*rows < 1 || *L < 2) {
    snprintf(err, len, "task file '%s': tokens has shape (%ld, %ld): no rows of two tokens or more",
             path, *rows, *L);
    return 1;
  }
  static const char *const names[2] = {"scored", "distance"};
  for (int i = 0; i < 2; i++) {
    hsize_t d2[2] = {0, 0};
    if (!dataset_info(f, names[i], &nd, d2, &cls)) {
      if (i == 1) {
        *has_dist = false;
        continue;
      }
      snprintf(err, len, "task file '%s' has no dataset 'scored' (%s)", path, layout);
      return 1;
    }
    if (i == 1) *has_dist = true;
    if (nd != 2 || (long)d2[0] != *rows || (long)d2[1] != *L - 1) {
      snprintf(err, len,
               "task file '%s': %s has shape (%ld, %ld), but tokens (%ld, %ld) needs (%ld, %ld): "
               "one entry per target tokens[:, 1:]",
               path, names[i], nd == 2 ? (long)d2[0] : -1L, nd == 2 ? (long)d2[1] : -1L, *rows, *L,
               *rows, *L - 1);
      return 1;
    }
    if (cls != H5T_INTEGER && cls != H5T_ENUM) {
      snprintf(err, len, "task file '%s': %s must hold integers", path, names[i]);
      return 1;
    }
  }
  if (*L - 1 != n) {
    snprintf(err, len,
             "task file '%s': rows hold L = %ld tokens, a context of L-1 = %ld, %s than "
             "model.context = %ld; set model.context = %ld",
             path, *L, *L - 1, *L - 1 < n ? "shorter" : "longer", n, *L - 1);
    return 1;
  }
  return 0;
}

/* Values: tokens in [0, 256), scored 0 or 1 with one scored target at least per row. */
static int check_values(const char *path, struct task_file *tf, const long long *tok,
                        const long long *sc, char *err, size_t len) {
  const long L = tf->L, rows = tf->rows;
  for (long i = 0; i < rows * L; i++) {
    if (tok[i] < 0 || tok[i] > 255) {
      snprintf(err, len, "task file '%s': tokens[%ld, %ld] = %lld is outside [0, 256)", path, i / L,
               i % L, tok[i]);
      return 1;
    }
    tf->tokens[i] = (uint8_t)tok[i];
  }
  for (long r = 0; r < rows; r++) {
    long count = 0;
    for (long t = 0; t < L - 1; t++) {
      const long long v = sc[r * (L - 1) + t];
      if (v != 0 && v != 1) {
        snprintf(err, len, "task file '%s': scored[%ld, %ld] = %lld is not 0 or 1", path, r, t, v);
        return 1;
      }
      tf->scored[r * (L - 1) + t] = (uint8_t)v;
      count += v;
    }
    if (count == 0) {
      snprintf(err, len,
               "task file '%s': row %ld has no scored position (scored[%ld, :] is all 0): it "
               "would teach and measure nothing",
               path, r, r);
      return 1;
    }
  }
  return 0;
}

int task_file_read(const char *path, long n, struct task_file *tf, char *err, size_t len) {
  memset(tf, 0, sizeof *tf);
  hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) {
    snprintf(err, len, "cannot open task file '%s' as HDF5 (%s)", path, layout);
    return 1;
  }
  bool has_dist = false;
  int rc = check_shapes(f, path, n, &tf->rows, &tf->L, &has_dist, err, len);
  long long *tok = NULL, *sc = NULL;
  if (!rc) {
    const size_t cells = (size_t)tf->rows * (size_t)tf->L, targets = cells - (size_t)tf->rows;
    tok = xmalloc(sizeof(long long) * cells);
    sc = xmalloc(sizeof(long long) * targets);
    tf->tokens = xmalloc(cells);
    tf->scored = xmalloc(targets);
    if (!read_integers(f, "tokens", tok) || !read_integers(f, "scored", sc)) {
      snprintf(err, len, "task file '%s': cannot read tokens or scored (damaged file?)", path);
      rc = 1;
    }
    if (!rc) rc = check_values(path, tf, tok, sc, err, len);
    if (!rc && has_dist) {
      tf->distance = xmalloc(sizeof(int32_t) * targets);
      if (!read_integers(f, "distance", sc)) {
        snprintf(err, len, "task file '%s': cannot read distance (damaged file?)", path);
        rc = 1;
      }
      for (size_t i = 0; i < targets && !rc; i++)
        tf->distance[i] = sc[i] < 0 ? -1 : sc[i] > INT32_MAX ? INT32_MAX : (int32_t)sc[i];
    }
  }
  free(tok);
  free(sc);
  H5Fclose(f);
  if (rc) task_file_free(tf);
  return rc;
}

void task_file_free(struct task_file *tf) {
  free(tf->tokens);
  free(tf->scored);
  free(tf->distance);
  memset(tf, 0, sizeof *tf);
}

/* ---------------------------------------------------------------------------------------------
 * writing */

struct task_writer {
  char path[1100];
  hid_t file, ds[3]; /* tokens, scored, distance */
  long rows, row, n;
};

static hid_t create_2d(hid_t f, const char *name, hid_t type, long rows, long cols,
                       const char *description) {
  hsize_t dims[2] = {(hsize_t)rows, (hsize_t)cols};
  hsize_t chunk[2] = {(hsize_t)(rows < 16 ? rows : 16), (hsize_t)cols};
  hid_t space = H5_CHECK(H5Screate_simple(2, dims, NULL));
  hid_t plist = H5_CHECK(H5Pcreate(H5P_DATASET_CREATE));
  H5_CHECK(H5Pset_chunk(plist, 2, chunk));
  H5_CHECK(H5Pset_deflate(plist, 4));
  hid_t ds = H5Dcreate2(f, name, type, space, H5P_DEFAULT, plist, H5P_DEFAULT);
  if (ds < 0) error("cannot create dataset %s", name);
  H5Pclose(plist);
  H5Sclose(space);
  h5_attr_string(f, name, "description", description);
  return ds;
}

struct task_writer *task_writer_open(const char *path, long rows, long n, const char *source,
                                     const char *deck, const char *split) {
  struct task_writer *w = xcalloc(1, sizeof *w);
  snprintf(w->path, sizeof w->path, "%s.tmp", path);
  error_context("writing the task file of data.export", w->path);
  w->file = h5_create(w->path);
  w->rows = rows;
  w->n = n;
  w->ds[0] = create_2d(w->file, "tokens", H5T_STD_U8LE, rows, n + 1,
                       "sample tokens (bytes); the targets are tokens[:, 1:]");
  w->ds[1] = create_2d(w->file, "scored", H5T_STD_U8LE, rows, n,
                       "1 where the target tokens[:, t + 1] counts in the loss and accuracy");
  w->ds[2] = create_2d(w->file, "distance", H5T_STD_I32LE, rows, n,
                       "tokens back from position t to the token target t needs; -1: no single "
                       "place");
  h5_attr_string(w->file, "/", "source", source);
  h5_attr_string(w->file, "/", "deck", deck);
  h5_attr_string(w->file, "/", "split", split);
  h5_attr_string(w->file, "/", "version", PACKAGE_VERSION);
  h5_attr_long(w->file, "/", "context", n);
  return w;
}

void task_writer_add(struct task_writer *w, const struct task_sample *s) {
  if (w->row >= w->rows) error("task writer: more rows than the %ld announced", w->rows);
  const void *data[3] = {s->tokens, s->scored, s->distance};
  const hid_t mem[3] = {H5T_NATIVE_UINT8, H5T_NATIVE_UINT8, H5T_NATIVE_INT32};
  for (int i = 0; i < 3; i++) {
    const hsize_t cols = (hsize_t)(i == 0 ? w->n + 1 : w->n);
    hsize_t start[2] = {(hsize_t)w->row, 0}, count[2] = {1, cols};
    hid_t fspace = H5_CHECK(H5Dget_space(w->ds[i]));
    H5_CHECK(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, NULL, count, NULL));
    hid_t mspace = H5_CHECK(H5Screate_simple(2, count, NULL));
    H5_CHECK(H5Dwrite(w->ds[i], mem[i], mspace, fspace, H5P_DEFAULT, data[i]));
    H5Sclose(mspace);
    H5Sclose(fspace);
  }
  w->row++;
}

void task_writer_close(struct task_writer *w) {
  if (w->row != w->rows) error("task writer: %ld rows written of %ld", w->row, w->rows);
  for (int i = 0; i < 3; i++) H5Dclose(w->ds[i]);
  h5_close(w->file);
  char final[1100];
  snprintf(final, sizeof final, "%.*s", (int)(strlen(w->path) - 4), w->path);
  if (rename(w->path, final) != 0) error("cannot rename %s to %s", w->path, final);
  error_context(NULL, NULL);
  free(w);
}
