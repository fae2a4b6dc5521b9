/* Small HDF5 helpers shared by diag.h5, checkpoints, bench.h5 and kernel files: opening files
 * (serial, or collective through MPI-IO where HDF5 is parallel), datasets addressed by path with
 * intermediate groups created on the way, string and numeric attributes, and extendible 1-D record
 * series. Every HDF5 call is checked; a failure ends the job with the call that failed. */
#ifndef FMATTN_H5IO_H
#define FMATTN_H5IO_H

#include <hdf5.h>
#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>

/* Serial access (one rank): create (truncating) or open read-write / read-only. */
hid_t h5_create(const char *path);
hid_t h5_open(const char *path, bool writable);
/* Whether this build's HDF5 has MPI-IO (parallel HDF5, the default). In a serial build
 * (./configure --with-hdf5=serial) the *_collective calls below open the file for the calling rank
 * alone: one rank writes a shared file, and every rank may open one for reading. */
bool h5_parallel(void);
/* Collective access over comm through MPI-IO (parallel builds). */
hid_t h5_create_collective(const char *path, MPI_Comm comm);
hid_t h5_open_collective(const char *path, MPI_Comm comm);
/* As h5_open_collective, but −1 (and no message) when the file cannot be opened: a damaged or
 * truncated file is an answer for the caller (checkpoint restart), not an error. */
hid_t h5_try_open_collective(const char *path, MPI_Comm comm);
void h5_close(hid_t file);

bool h5_exists(hid_t loc, const char *path);

/* Attributes on the object at `obj` (a path below loc; "/" for the root). */
void h5_attr_string(hid_t loc, const char *obj, const char *name, const char *value);
void h5_attr_long(hid_t loc, const char *obj, const char *name, long value);
void h5_attr_double(hid_t loc, const char *obj, const char *name, double value);
/* Read attributes; return false when absent. A string is returned in a malloc'd buffer. */
bool h5_read_attr_string(hid_t loc, const char *obj, const char *name, char **value);
bool h5_read_attr_long(hid_t loc, const char *obj, const char *name, long *value);
bool h5_read_attr_double(hid_t loc, const char *obj, const char *name, double *value);
/* A boolean as h5py writes it (a one-byte enum); false when absent or another type. */
bool h5_read_attr_bool(hid_t loc, const char *obj, const char *name, long *value);

/* Create a float32 dataset of the given shape at path and write data. With a collective file,
 * every rank calls this and only `writer` (a rank of the file's communicator, or −1 for all)
 * supplies data; others pass NULL. In a serial build `collective` is ignored. */
void h5_write_floats(hid_t loc, const char *path, int ndim, const long *shape, const float *data,
                     bool collective, bool writer);
/* Create a float64 dataset of the given shape at path (serial files) with its units (one word) or
 * description (several) attribute, and write data. */
void h5_write_doubles(hid_t loc, const char *path, int ndim, const long *shape, const double *data,
                      const char *units);
/* Read a float32 dataset whose shape must equal `shape` (error otherwise, naming both shapes). */
void h5_read_floats(hid_t loc, const char *path, int ndim, const long *shape, float *data,
                    const char *file_name);
/* As h5_read_floats, but reporting instead of ending the job: why receives the reason. */
enum h5_read_status { H5_READ_OK, H5_READ_MISMATCH, H5_READ_DAMAGED };
enum h5_read_status h5_try_read_floats(hid_t loc, const char *path, int ndim, const long *shape,
                                       float *data, char *why, size_t len);
/* Shape of a dataset: returns ndim (≤ maxdim), or −1 when absent. */
int h5_dataset_shape(hid_t loc, const char *path, long *shape, int maxdim);

/* Record series: an extendible dataset with leading dimension = records. Each call appends one
 * record of `count` values with the record shape given (rec_ndim may be 0 for scalars). The
 * dataset is created on first use with a `units` or `description` attribute. */
void h5_append_doubles(hid_t loc, const char *path, int rec_ndim, const long *rec_shape,
                       const double *values, const char *units);
void h5_append_string(hid_t loc, const char *path, const char *value, const char *description);
/* Truncate every series under group `group` to the records whose `key` series (e.g.
 * "/train/step") is ≤ last. Used when a run restarts from an earlier checkpoint. */
void h5_truncate_series(hid_t loc, const char *group, const char *key, double last);

#endif
