/* One error vocabulary for fmattn: error(), warning(), message(), each stamped with the rank and
 * the source location, and a checker macro per library (MPI, HDF5). error() ends the whole job:
 * MPI_Abort when other ranks may be waiting, a plain exit otherwise. Nothing here allocates. */
#ifndef FMATTN_ERROR_H
#define FMATTN_ERROR_H

#include <mpi.h>
#include <stdnoreturn.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Rank stamped on every message; set once MPI is up (-1 before). */
void error_set_rank(int rank, int nranks);
int error_rank(void);

/* A fatal error on this rank: print "[rank] file:function:line: error: ..." and end the job on
 * every rank (MPI_Abort with code 1 when the world has more than one rank, exit(1) otherwise). */
noreturn void error_at(const char *file, const char *func, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void warning_at(const char *file, const char *func, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* What the job is doing, for the fatal errors of library calls deep inside it ("writing
 * checkpoint X"): error() appends "(while <context>)" and, when remove_on_error is not NULL,
 * removes that file (a half-written temporary) before ending the job. error_context(NULL, NULL)
 * clears it. The strings are copied. */
void error_context(const char *context, const char *remove_on_error);

/* Ordinary progress output: rank 0 only, with the elapsed wall time. */
void message(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Output from every rank, stamped with the rank. */
void message_all(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A user error that every rank has detected together (a bad deck, a missing file): rank 0 prints
 * the one message, every rank finalises MPI and exits with status 1. Collective. */
noreturn void error_collective(const char *msg);

#define error(...)   error_at(__FILE__, __func__, __LINE__, __VA_ARGS__)
#define warning(...) warning_at(__FILE__, __func__, __LINE__, __VA_ARGS__)

#define MPI_CHECK(call)                                                 \
  do {                                                                  \
    int mpi_check_rc_ = (call);                                         \
    if (mpi_check_rc_ != MPI_SUCCESS) {                                 \
      char mpi_check_msg_[MPI_MAX_ERROR_STRING];                        \
      int mpi_check_len_ = 0;                                           \
      MPI_Error_string(mpi_check_rc_, mpi_check_msg_, &mpi_check_len_); \
      error("%s failed: %s", #call, mpi_check_msg_);                    \
    }                                                                   \
  } while (0)

/* HDF5 calls return a negative value on failure (herr_t or hid_t). */
#define H5_CHECK(call)                               \
  ({                                                 \
    __typeof__(call) h5_check_rc_ = (call);          \
    if (h5_check_rc_ < 0) error("%s failed", #call); \
    h5_check_rc_;                                    \
  })

/* malloc that never returns NULL. */
void *xmalloc(size_t bytes);
void *xcalloc(size_t count, size_t bytes);
void *xrealloc(void *p, size_t bytes);
char *xstrdup(const char *s);

#ifdef __cplusplus
}
#endif

#endif
