#!/bin/sh
# Run a command on N MPI ranks for the test suite: mpi_run.sh N command args...
# Handles what a CI machine needs: running as root (Open MPI refuses without the two variables),
# more ranks than cores (--oversubscribe), and one thread per rank unless the caller set threads.
set -e
n="$1"; shift
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
: "${OMP_NUM_THREADS:=1}"
export OMP_NUM_THREADS
export OPENBLAS_NUM_THREADS="$OMP_NUM_THREADS"
exec /usr/bin/mpiexec -n "$n" --oversubscribe --bind-to none "$@"
