/* HDF5 helpers (h5io.h). HDF5's own error printing is switched off at start-up (main), so a
 * failure here prints one fmattn message naming the call, the file or path involved. */
#include "core/h5io.h"

#include <stdlib.h>
#include <string.h>

#include "core/error.h"

static hid_t lcpl_intermediate(void) {
  hid_t lcpl = H5_CHECK(H5Pcreate(H5P_LINK_CREATE));
  H5_CHECK(H5Pset_create_intermediate_group(lcpl, 1));
  return lcpl;
}

hid_t h5_create(const char *path) {
  hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (f < 0)
    error("cannot create HDF5 file '%s' (does the directory exist and is it writable?)", path);
  return f;
}

hid_t h5_open(const char *path, bool writable) {
  hid_t f = H5Fopen(path, writable ? H5F_ACC_RDWR : H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) error("cannot open HDF5 file '%s' (missing, unreadable or not HDF5)", path);
  return f;
}

bool h5_parallel(void) {
#ifdef H5_HAVE_PARALLEL
  return true;
#else
  return false;
#endif
}

/* File access through MPI-IO over comm; the default (the calling rank alone) in a serial build. */
static hid_t access_plist(MPI_Comm comm) {
  hid_t fapl = H5_CHECK(H5Pcreate(H5P_FILE_ACCESS));
#ifdef H5_HAVE_PARALLEL
  H5_CHECK(H5Pset_fapl_mpio(fapl, comm, MPI_INFO_NULL));
#else
  (void)comm;
#endif
  return fapl;
}

hid_t h5_create_collective(const char *path, MPI_Comm comm) {
  hid_t fapl = access_plist(comm);
  hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
  H5Pclose(fapl);
  if (f < 0) error("cannot create HDF5 file '%s' collectively (is the directory writable?)", path);
  return f;
}

hid_t h5_open_collective(const char *path, MPI_Comm comm) {
  hid_t fapl = access_plist(comm);
  hid_t f = H5Fopen(path, H5F_ACC_RDONLY, fapl);
  H5Pclose(fapl);
  if (f < 0) error("cannot open HDF5 file '%s' (missing, unreadable or not HDF5)", path);
  return f;
}

hid_t h5_try_open_collective(const char *path, MPI_Comm comm) {
  H5E_auto2_t func;
  void *data;
  H5Eget_auto2(H5E_DEFAULT, &func, &data); /* a damaged file is an answer here, not an error */
  H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
  hid_t fapl = access_plist(comm);
  hid_t f = H5Fopen(path, H5F_ACC_RDONLY, fapl);
  H5Pclose(fapl);
  H5Eset_auto2(H5E_DEFAULT, func, data);
  return f < 0 ? -1 : f;
}

void h5_close(hid_t file) { H5_CHECK(H5Fclose(file)); }

bool h5_exists(hid_t loc, const char *path) {
  char buf[1024];
  snprintf(buf, sizeof buf, "%s", path);
  /* check every prefix: H5Lexists fails (rather than returning false) on a missing parent */
  for (char *p = buf + 1;; p++) {
    if (*p == '/' || *p == '\0') {
      char saved = *p;
      *p = '\0';
      if (strlen(buf) > 0 && strcmp(buf, "/") != 0 && H5Lexists(loc, buf, H5P_DEFAULT) <= 0)
        return false;
      *p = saved;
      if (saved == '\0') break;
    }
  }
  return true;
}

/* ---------------------------------------------------------------------------------------------
 * attributes */

static void attr_write(hid_t loc, const char *obj, const char *name, hid_t type, const void *buf) {
  if (H5Aexists_by_name(loc, obj, name, H5P_DEFAULT) > 0)
    H5_CHECK(H5Adelete_by_name(loc, obj, name, H5P_DEFAULT));
  hid_t space = H5_CHECK(H5Screate(H5S_SCALAR));
  hid_t a = H5Acreate_by_name(loc, obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  if (a < 0) error("cannot create attribute %s on %s", name, obj);
  H5_CHECK(H5Awrite(a, type, buf));
  H5Aclose(a);
  H5Sclose(space);
}

static hid_t string_type(void) {
  hid_t t = H5_CHECK(H5Tcopy(H5T_C_S1));
  H5_CHECK(H5Tset_size(t, H5T_VARIABLE));
  H5_CHECK(H5Tset_cset(t, H5T_CSET_UTF8));
  return t;
}

void h5_attr_string(hid_t loc, const char *obj, const char *name, const char *value) {
  hid_t t = string_type();
  attr_write(loc, obj, name, t, &value);
  H5Tclose(t);
}

void h5_attr_long(hid_t loc, const char *obj, const char *name, long value) {
  attr_write(loc, obj, name, H5T_NATIVE_LONG, &value);
}

void h5_attr_double(hid_t loc, const char *obj, const char *name, double value) {
  attr_write(loc, obj, name, H5T_NATIVE_DOUBLE, &value);
}

/* An attribute holding exactly one value (a read into one variable must not overrun). */
static hid_t attr_open(hid_t loc, const char *obj, const char *name) {
  if (H5Aexists_by_name(loc, obj, name, H5P_DEFAULT) <= 0) return -1;
  hid_t a = H5Aopen_by_name(loc, obj, name, H5P_DEFAULT, H5P_DEFAULT);
  if (a < 0) return -1;
  hid_t space = H5_CHECK(H5Aget_space(a));
  const hssize_t points = H5Sget_simple_extent_npoints(space);
  H5Sclose(space);
  if (points != 1)
    error("attribute %s of %s holds %lld values, expected one", name, obj, (long long)points);
  return a;
}

bool h5_read_attr_string(hid_t loc, const char *obj, const char *name, char **value) {
  hid_t a = attr_open(loc, obj, name);
  if (a < 0) return false;
  hid_t ft = H5_CHECK(H5Aget_type(a));
  bool ok = H5Tget_class(ft) == H5T_STRING;
  if (ok && H5Tis_variable_str(ft) > 0) {
    hid_t t = string_type();
    char *s = NULL;
    H5_CHECK(H5Aread(a, t, &s));
    *value = xstrdup(s ? s : "");
    H5free_memory(s);
    H5Tclose(t);
  } else if (ok) {
    size_t n = H5Tget_size(ft);
    hid_t t = H5_CHECK(H5Tcopy(H5T_C_S1));
    H5_CHECK(H5Tset_size(t, n + 1));
    *value = xcalloc(n + 2, 1);
    H5_CHECK(H5Aread(a, t, *value));
    H5Tclose(t);
  }
  H5Tclose(ft);
  H5Aclose(a);
  return ok;
}

bool h5_read_attr_long(hid_t loc, const char *obj, const char *name, long *value) {
  hid_t a = attr_open(loc, obj, name);
  if (a < 0) return false;
  H5_CHECK(H5Aread(a, H5T_NATIVE_LONG, value));
  H5Aclose(a);
  return true;
}

bool h5_read_attr_bool(hid_t loc, const char *obj, const char *name, long *value) {
  hid_t a = attr_open(loc, obj, name);
  if (a < 0) return false;
  hid_t t = H5_CHECK(H5Aget_type(a));
  bool ok = H5Tget_class(t) == H5T_ENUM && H5Tget_size(t) <= sizeof(long);
  if (ok) { /* h5py's booleans: an enum of one byte, FALSE = 0, TRUE = 1 */
    unsigned char raw[sizeof(long)] = {0};
    H5_CHECK(H5Aread(a, t, raw));
    *value = raw[0] != 0;
  }
  H5Tclose(t);
  H5Aclose(a);
  return ok;
}

bool h5_read_attr_double(hid_t loc, const char *obj, const char *name, double *value) {
  hid_t a = attr_open(loc, obj, name);
  if (a < 0) return false;
  H5_CHECK(H5Aread(a, H5T_NATIVE_DOUBLE, value));
  H5Aclose(a);
  return true;
}

/* ---------------------------------------------------------------------------------------------
 * whole datasets */

void h5_write_floats(hid_t loc, const char *path, int ndim, const long *shape, const float *data,
                     bool collective, bool writer) {
  hsize_t dims[8];
  for (int i = 0; i < ndim; i++) dims[i] = (hsize_t)shape[i];
  hid_t space = H5_CHECK(H5Screate_simple(ndim, dims, NULL));
  hid_t lcpl = lcpl_intermediate();
  hid_t ds = H5Dcreate2(loc, path, H5T_NATIVE_FLOAT, space, lcpl, H5P_DEFAULT, H5P_DEFAULT);
  if (ds < 0) error("cannot create dataset %s", path);
  hid_t xfer = H5P_DEFAULT;
  collective = collective && h5_parallel();
#ifdef H5_HAVE_PARALLEL
  if (collective) {
    xfer = H5_CHECK(H5Pcreate(H5P_DATASET_XFER));
    H5_CHECK(H5Pset_dxpl_mpio(xfer, H5FD_MPIO_COLLECTIVE));
  }
#endif
  hid_t mem = H5S_ALL, file = H5S_ALL;
  if (!writer) {
    mem = H5_CHECK(H5Screate_simple(ndim, dims, NULL));
    H5_CHECK(H5Sselect_none(mem));
    file = H5_CHECK(H5Scopy(space));
    H5_CHECK(H5Sselect_none(file));
  }
  if (writer || collective) {
    float dummy = 0.0f;
    if (H5Dwrite(ds, H5T_NATIVE_FLOAT, mem, file, xfer, writer ? (const void *)data : &dummy) < 0)
      error("cannot write dataset %s", path);
  }
  if (!writer) {
    H5Sclose(mem);
    H5Sclose(file);
  }
  if (collective) H5Pclose(xfer);
  H5Dclose(ds);
  H5Pclose(lcpl);
  H5Sclose(space);
}

void h5_write_doubles(hid_t loc, const char *path, int ndim, const long *shape, const double *data,
                      const char *units) {
  hsize_t dims[8];
  for (int i = 0; i < ndim; i++) dims[i] = (hsize_t)shape[i];
  hid_t space = H5_CHECK(H5Screate_simple(ndim, dims, NULL));
  hid_t lcpl = lcpl_intermediate();
  hid_t ds = H5Dcreate2(loc, path, H5T_NATIVE_DOUBLE, space, lcpl, H5P_DEFAULT, H5P_DEFAULT);
  if (ds < 0) error("cannot create dataset %s", path);
  if (H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    error("cannot write dataset %s", path);
  H5Dclose(ds);
  H5Pclose(lcpl);
  H5Sclose(space);
  if (units) h5_attr_string(loc, path, strchr(units, ' ') ? "description" : "units", units);
}

int h5_dataset_shape(hid_t loc, const char *path, long *shape, int maxdim) {
  if (!h5_exists(loc, path)) return -1;
  hid_t ds = H5Dopen2(loc, path, H5P_DEFAULT);
  if (ds < 0) return -1;
  hid_t space = H5_CHECK(H5Dget_space(ds));
  int nd = H5Sget_simple_extent_ndims(space);
  hsize_t dims[H5S_MAX_RANK];
  H5Sget_simple_extent_dims(space, dims, NULL);
  for (int i = 0; i < nd && i < maxdim; i++) shape[i] = (long)dims[i];
  H5Sclose(space);
  H5Dclose(ds);
  return nd;
}

static void shape_text(char *buf, size_t len, int nd, const long *shape) {
  size_t u = (size_t)snprintf(buf, len, "[");
  for (int i = 0; i < nd && u < len; i++)
    u += (size_t)snprintf(buf + u, len - u, i ? ", %ld" : "%ld", shape[i]);
  if (u < len) snprintf(buf + u, len - u, "]");
}

enum h5_read_status h5_try_read_floats(hid_t loc, const char *path, int ndim, const long *shape,
                                       float *data, char *why, size_t len) {
  long have[16];
  int nd = h5_dataset_shape(loc, path, have, 16);
  if (nd < 0) {
    snprintf(why, len, "dataset %s is missing", path);
    return H5_READ_MISMATCH;
  }
  bool same = nd == ndim;
  for (int i = 0; same && i < nd; i++) same = have[i] == shape[i];
  if (!same) {
    char a[128], b[128];
    shape_text(a, sizeof a, nd, have);
    shape_text(b, sizeof b, ndim, shape);
    snprintf(why, len, "dataset %s has shape %s, the model's is %s", path, a, b);
    return H5_READ_MISMATCH;
  }
  H5E_auto2_t func;
  void *edata;
  H5Eget_auto2(H5E_DEFAULT, &func, &edata);
  H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
  hid_t ds = H5Dopen2(loc, path, H5P_DEFAULT);
  herr_t rc = ds < 0 ? -1 : H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data);
  if (ds >= 0) H5Dclose(ds);
  H5Eset_auto2(H5E_DEFAULT, func, edata);
  if (rc < 0) {
    snprintf(why, len, "dataset %s cannot be read (the file is damaged)", path);
    return H5_READ_DAMAGED;
  }
  return H5_READ_OK;
}

void h5_read_floats(hid_t loc, const char *path, int ndim, const long *shape, float *data,
                    const char *file_name) {
  long have[16];
  int nd = h5_dataset_shape(loc, path, have, 16);
  if (nd < 0) error("%s: dataset %s is missing", file_name, path);
  bool same = nd == ndim;
  for (int i = 0; same && i < nd; i++) same = have[i] == shape[i];
  if (!same) {
    char a[128], b[128];
    shape_text(a, sizeof a, nd, have);
    shape_text(b, sizeof b, ndim, shape);
    error("%s: dataset %s has shape %s, expected %s (a different model configuration?)", file_name,
          path, a, b);
  }
  hid_t ds = H5_CHECK(H5Dopen2(loc, path, H5P_DEFAULT));
  if (H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    error("%s: cannot read dataset %s", file_name, path);
  H5Dclose(ds);
}

/* ---------------------------------------------------------------------------------------------
 * record series */

static hid_t series_open(hid_t loc, const char *path, hid_t type, int rec_ndim,
                         const long *rec_shape, const char *units, bool is_string) {
  if (h5_exists(loc, path)) {
    hid_t ds = H5_CHECK(H5Dopen2(loc, path, H5P_DEFAULT));
    hid_t space = H5_CHECK(H5Dget_space(ds));
    int nd = H5Sget_simple_extent_ndims(space);
    hsize_t dims[H5S_MAX_RANK];
    H5Sget_simple_extent_dims(space, dims, NULL);
    H5Sclose(space);
    bool same = nd == rec_ndim + 1;
    for (int i = 0; same && i < rec_ndim; i++) same = dims[i + 1] == (hsize_t)rec_shape[i];
    if (!same) error("diagnostics series %s exists with another record shape", path);
    return ds;
  }
  hsize_t dims[H5S_MAX_RANK], maxdims[H5S_MAX_RANK], chunk[H5S_MAX_RANK];
  if (rec_ndim + 1 > H5S_MAX_RANK) error("series %s: too many dimensions", path);
  dims[0] = 0;
  maxdims[0] = H5S_UNLIMITED;
  chunk[0] = 64;
  for (int i = 0; i < rec_ndim; i++) {
    dims[i + 1] = maxdims[i + 1] = chunk[i + 1] = (hsize_t)rec_shape[i];
  }
  hid_t space = H5_CHECK(H5Screate_simple(rec_ndim + 1, dims, maxdims));
  hid_t dcpl = H5_CHECK(H5Pcreate(H5P_DATASET_CREATE));
  H5_CHECK(H5Pset_chunk(dcpl, rec_ndim + 1, chunk));
  hid_t lcpl = lcpl_intermediate();
  hid_t ds = H5Dcreate2(loc, path, type, space, lcpl, dcpl, H5P_DEFAULT);
  if (ds < 0) error("cannot create series %s", path);
  H5Pclose(lcpl);
  H5Pclose(dcpl);
  H5Sclose(space);
  if (units) h5_attr_string(loc, path, is_string ? "description" : "units", units);
  return ds;
}

static void series_append(hid_t ds, hid_t type, int rec_ndim, const long *rec_shape,
                          const void *values) {
  hid_t space = H5_CHECK(H5Dget_space(ds));
  hsize_t dims[H5S_MAX_RANK];
  H5Sget_simple_extent_dims(space, dims, NULL);
  H5Sclose(space);
  hsize_t start[H5S_MAX_RANK] = {0}, count[H5S_MAX_RANK];
  start[0] = dims[0];
  dims[0] += 1;
  count[0] = 1;
  for (int i = 0; i < rec_ndim; i++) count[i + 1] = (hsize_t)rec_shape[i];
  H5_CHECK(H5Dset_extent(ds, dims));
  space = H5_CHECK(H5Dget_space(ds));
  H5_CHECK(H5Sselect_hyperslab(space, H5S_SELECT_SET, start, NULL, count, NULL));
  hid_t mem = H5_CHECK(H5Screate_simple(rec_ndim + 1, count, NULL));
  H5_CHECK(H5Dwrite(ds, type, mem, space, H5P_DEFAULT, values));
  H5Sclose(mem);
  H5Sclose(space);
}

void h5_append_doubles(hid_t loc, const char *path, int rec_ndim, const long *rec_shape,
                       const double *values, const char *units) {
  hid_t ds = series_open(loc, path, H5T_NATIVE_DOUBLE, rec_ndim, rec_shape, units, false);
  series_append(ds, H5T_NATIVE_DOUBLE, rec_ndim, rec_shape, values);
  H5Dclose(ds);
}

void h5_append_string(hid_t loc, const char *path, const char *value, const char *description) {
  hid_t t = string_type();
  hid_t ds = series_open(loc, path, t, 0, NULL, description, true);
  series_append(ds, t, 0, NULL, &value);
  H5Dclose(ds);
  H5Tclose(t);
}

struct truncate_ctx {
  hsize_t keep;
};

static herr_t truncate_one(hid_t group, const char *name, const H5L_info_t *info, void *data) {
  struct truncate_ctx *ctx = data;
  hid_t ds = H5Oopen(group, name, H5P_DEFAULT);
  if (ds < 0) return 0;
  if (H5Iget_type(ds) != H5I_DATASET) {
    H5Oclose(ds);
    return 0;
  }
  hid_t space = H5Dget_space(ds);
  hsize_t dims[H5S_MAX_RANK], maxdims[H5S_MAX_RANK];
  int nd = H5Sget_simple_extent_dims(space, dims, maxdims);
  H5Sclose(space);
  if (nd >= 1 && maxdims[0] == H5S_UNLIMITED && dims[0] > ctx->keep) {
    dims[0] = ctx->keep;
    H5_CHECK(H5Dset_extent(ds, dims));
  }
  H5Oclose(ds);
  return 0;
}

void h5_truncate_series(hid_t loc, const char *group, const char *key, double last) {
  if (!h5_exists(loc, group) || !h5_exists(loc, key)) return;
  hid_t ds = H5_CHECK(H5Dopen2(loc, key, H5P_DEFAULT));
  hid_t space = H5_CHECK(H5Dget_space(ds));
  hsize_t n = 0;
  if (H5Sget_simple_extent_ndims(space) != 1) error("%s is not a 1-D series", key);
  H5Sget_simple_extent_dims(space, &n, NULL);
  H5Sclose(space);
  double *v = xmalloc(sizeof(double) * (n ? n : 1));
  if (n) H5_CHECK(H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v));
  H5Dclose(ds);
  struct truncate_ctx ctx = {0};
  while (ctx.keep < n && v[ctx.keep] <= last) ctx.keep++;
  free(v);
  hid_t g = H5_CHECK(H5Gopen2(loc, group, H5P_DEFAULT));
  H5_CHECK(H5Literate(g, H5_INDEX_NAME, H5_ITER_NATIVE, NULL, truncate_one, &ctx));
  H5Gclose(g);
}
