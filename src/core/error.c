/* Implementation of the error vocabulary of error.h: formatting, rank stamps, and ending the job.
 * Messages go to stderr (errors, warnings) or stdout (progress), flushed at once so that SLURM
 * logs interleave sensibly. */
#include "core/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int error_rank_ = -1;
static int error_nranks_ = 1;
static struct timespec error_t0_;
static int error_t0_set_ = 0;

void error_set_rank(int rank, int nranks) {
  error_rank_ = rank;
  error_nranks_ = nranks;
}

int error_rank(void) { return error_rank_; }

static char error_context_[1024];
static char error_remove_[1024];

void error_context(const char *context, const char *remove_on_error) {
  snprintf(error_context_, sizeof error_context_, "%s", context ? context : "");
  snprintf(error_remove_, sizeof error_remove_, "%s", remove_on_error ? remove_on_error : "");
}

static double elapsed(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  if (!error_t0_set_) {
    error_t0_ = t;
    error_t0_set_ = 1;
  }
  return (double)(t.tv_sec - error_t0_.tv_sec) + 1e-9 * (double)(t.tv_nsec - error_t0_.tv_nsec);
}

static const char *basename_of(const char *path) {
  const char *s = strrchr(path, '/');
  return s ? s + 1 : path;
}

noreturn void error_at(const char *file, const char *func, int line, const char *fmt, ...) {
  char text[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  fflush(stdout);
  fprintf(stderr, "[%d] %s:%s:%d: error: %s%s%s%s\n", error_rank_ < 0 ? 0 : error_rank_,
          basename_of(file), func, line, text, error_context_[0] ? " (while " : "", error_context_,
          error_context_[0] ? ")" : "");
  fflush(stderr);
  if (error_remove_[0]) unlink(error_remove_); /* several ranks may try: the first one wins */
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized && error_nranks_ > 1) MPI_Abort(MPI_COMM_WORLD, 1);
  exit(1);
}

void warning_at(const char *file, const char *func, int line, const char *fmt, ...) {
  char text[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  fflush(stdout);
  fprintf(stderr, "[%d] %s:%s:%d: warning: %s\n", error_rank_ < 0 ? 0 : error_rank_,
          basename_of(file), func, line, text);
  fflush(stderr);
}

void message(const char *fmt, ...) {
  if (error_rank_ > 0) return;
  double t = elapsed();
  va_list ap;
  va_start(ap, fmt);
  printf("[%8.1fs] ", t);
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
}

void message_all(const char *fmt, ...) {
  double t = elapsed();
  va_list ap;
  va_start(ap, fmt);
  printf("[%d %8.1fs] ", error_rank_ < 0 ? 0 : error_rank_, t);
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
}

noreturn void error_collective(const char *msg) {
  if (error_rank_ <= 0) {
    fflush(stdout);
    fprintf(stderr, "fmattn: error: %s\n", msg);
    fflush(stderr);
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
  exit(1);
}

void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) error("out of memory allocating %zu bytes", bytes);
  return p;
}

void *xcalloc(size_t count, size_t bytes) {
  void *p = calloc(count ? count : 1, bytes ? bytes : 1);
  if (!p) error("out of memory allocating %zu x %zu bytes", count, bytes);
  return p;
}

void *xrealloc(void *p, size_t bytes) {
  void *q = realloc(p, bytes ? bytes : 1);
  if (!q) error("out of memory allocating %zu bytes", bytes);
  return q;
}

char *xstrdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *p = xmalloc(n);
  memcpy(p, s, n);
  return p;
}
