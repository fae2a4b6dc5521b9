#!/bin/sh
# Training with sequence parallelism against one rank (SPEC §7): with parallel.seq_ranks = S = 2, 4
# the losses, gradient norms, validation losses and attention diagnostics equal the 1-rank run's
# within 1e-5, for every variant (both objectives where they can), FiSH heads and fma.open = 2;
# world 4 as S = 2 × 2 replicas, and S = 8 (balanced or not), equal world 1; parallel.overlap = false equals the
# overlapped runs, parallel.alltoallv = mpi the sparse exchanges and nbx fma.open's requests; a checkpoint written with S = 4 restarts with S = 2 and 1 (fma.open too).
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
F="$FMATTN"
SP="$TESTDIR/decks/seq_parallel.in"

same() { # name: the run out/$1 equals its 1-rank twin out/$2 within 1e-5
  check "$1: training losses and gradient norms equal 1 rank" py "$TESTDIR/h5check.py" same-series "out/$2/diag.h5" "out/$1/diag.h5" train 0 1e-5
  check "$1: validation losses equal 1 rank" py "$TESTDIR/h5check.py" same-series "out/$2/diag.h5" "out/$1/diag.h5" eval 0 1e-5
  check "$1: attention level masses and entropies equal 1 rank" py "$TESTDIR/h5check.py" same-series "out/$2/diag.h5" "out/$1/diag.h5" attention 0 1e-5
}

for v in "fma clm" "fma mlm" "fmaopen clm" "fmaopen mlm" "fma_linear clm" "full clm" "full mlm" "local clm" "linear clm" "fmmformer mlm" "rmfa clm" "nystrom mlm" "fish clm" "fish-local mlm"; do
  set -- $v
  tag="$1-$2"
  extra="--set attention.variant=$1 --set model.objective=$2"
  # FiSH heads (one global head for the two value heads) with training noise, on full and local
  [ "$1" = fish ] && extra="--set attention.variant=full --set attention.heads_mode=fish --set attention.fish.noise=0.3 --set model.objective=$2"
  # fma.open (SPEC §6.4a): windows opened by content, fetched from other ranks as the descent goes
  [ "$1" = fmaopen ] && extra="--set attention.variant=fma --set attention.fma.open=2 --set model.objective=$2"
  [ "$1" = fish-local ] && extra="--set attention.variant=local --set attention.heads_mode=fish --set attention.fish.mix=mlp --set model.objective=$2"
  # mlm scores masked positions; the majority task scores only its markers: use the copy task
  [ "$2" = mlm ] && extra="$extra --set data.source=copy"
  check "$tag: 1 rank" "$MPI_RUN" 1 "$F" "$SP" --set run.name=$tag-1 $extra
  for S in 2 4; do
    check "$tag: $S sequence ranks" "$MPI_RUN" $S "$F" "$SP" --set run.name=$tag-$S --set parallel.seq_ranks=$S $extra
    printf '%s\n' "$out" > "out/$tag-$S.console"
    same "$tag-$S" "$tag-1"
  done
done
check "fma: world 4 as 2 sequence ranks x 2 replicas" "$MPI_RUN" 4 "$F" "$SP" --set run.name=mixed --set parallel.seq_ranks=2
same mixed fma-clm-1
# parallel.overlap (on by default): the LET's fetch behind the near field and the gradient
# allreduce in buckets behind the backward change when bytes move, not what is computed: the same
# bits with them off (2 ranks: a sum of two is the same in any order), and within 1e-6 on 4
check "fma, 2 sequence ranks, parallel.overlap = false" "$MPI_RUN" 2 "$F" "$SP" --set run.name=fma-2-blocking --set parallel.seq_ranks=2 --set parallel.overlap=false
printf '%s\n' "$out" > out/fma-2-blocking.console
check "parallel.overlap = false: the same losses and gradient norms, bit for bit" py "$TESTDIR/h5check.py" same-series out/fma-clm-2/diag.h5 out/fma-2-blocking/diag.h5 train 0 0
check "the overlapped runs say so, the blocking run too" sh -c "grep -q 'communication overlapped: the gradient allreduce in [0-9]* buckets behind the backward; fma.s LET fetch behind the near field' out/fma-clm-2.console && grep -q 'communication blocking (parallel.overlap = false)' out/fma-2-blocking.console"
check "world 4 as 2 x 2, parallel.overlap = false" "$MPI_RUN" 4 "$F" "$SP" --set run.name=mixed-blocking --set parallel.seq_ranks=2 --set parallel.overlap=false
check "parallel.overlap = false on 4 ranks: the same losses within 1e-6" py "$TESTDIR/h5check.py" same-series out/mixed/diag.h5 out/mixed-blocking/diag.h5 train 0 1e-6
check "fma with 8 sequence ranks (windows span ranks, slabs of 16 tokens)" "$MPI_RUN" 8 "$F" "$SP" --set run.name=fma-8 --set parallel.seq_ranks=8
same fma-8 fma-clm-1
# parallel.balance = false: every rank evaluates its own slab's far field (fma/balance.c moves the
# held levels' part of the busiest ranks' work otherwise); the same training within rounding
check "fma with 8 sequence ranks, parallel.balance = false" "$MPI_RUN" 8 "$F" "$SP" --set run.name=fma-8-unbalanced --set parallel.seq_ranks=8 --set parallel.balance=false
same fma-8-unbalanced fma-clm-1
check "parallel.balance: the balanced run's exchanges per layer 4 more than the unbalanced's" py -c "
import h5py, sys
a = h5py.File('out/fma-8/diag.h5')['/comm/exchanges_per_layer'][...]
b = h5py.File('out/fma-8-unbalanced/diag.h5')['/comm/exchanges_per_layer'][...]
print(a, b)
sys.exit(0 if len(a) > 1 and a[-1] == b[-1] + 4 else 1)"
# parallel.alltoallv = mpi: the halo, LET and balance exchanges through MPI_Alltoallv and
# MPI_Ialltoallv instead of messages to the ranks with a part (the default): the same bytes move,
# the same bits
check "fma with 8 sequence ranks, parallel.alltoallv = mpi" "$MPI_RUN" 8 "$F" "$SP" --set run.name=fma-8-mpi --set parallel.seq_ranks=8 --set parallel.alltoallv=mpi
check "parallel.alltoallv = mpi: the same losses and gradient norms as sparse, bit for bit" py "$TESTDIR/h5check.py" same-series out/fma-8/diag.h5 out/fma-8-mpi/diag.h5 train 0 0
O="--set attention.fma.open=2"
check "fma.open = 2 with 8 sequence ranks (opened windows and blocks on other ranks)" "$MPI_RUN" 8 "$F" "$SP" --set run.name=fmaopen-8 --set parallel.seq_ranks=8 $O
same fmaopen-8 fmaopen-clm-1
# parallel.alltoallv = nbx: fma.open's requests by NBX (synchronous sends and a non-blocking
# barrier) instead of after an exchange of counts: the same requests arrive, so the same bits
check "fma.open = 2 with 8 sequence ranks, parallel.alltoallv = nbx" "$MPI_RUN" 8 "$F" "$SP" --set run.name=fmaopen-8-nbx --set parallel.seq_ranks=8 --set parallel.alltoallv=nbx $O
check "parallel.alltoallv = nbx: the same losses and gradient norms as sparse, bit for bit" py "$TESTDIR/h5check.py" same-series out/fmaopen-8/diag.h5 out/fmaopen-8-nbx/diag.h5 train 0 0
for S in 2 1; do
  mkdir -p "out/from4-$S" && cp out/fma-clm-4/ckpt_000005.h5 "out/from4-$S/"
  check "a checkpoint written with S = 4 restarts with S = $S" "$MPI_RUN" $S "$F" "$SP" --set run.name=from4-$S --set parallel.seq_ranks=$S --set output.restart=latest
  check "restarted with S = $S: the same losses within 1e-5" py "$TESTDIR/h5check.py" same-series out/fma-clm-4/diag.h5 "out/from4-$S/diag.h5" train 5 1e-5
  mkdir -p "out/open4-$S" && cp out/fmaopen-clm-4/ckpt_000005.h5 "out/open4-$S/"
  check "fma.open = 2: a checkpoint written with S = 4 restarts with S = $S" "$MPI_RUN" $S "$F" "$SP" --set run.name=open4-$S --set parallel.seq_ranks=$S --set output.restart=latest $O
  check "fma.open = 2, restarted with S = $S: the same losses and diagnostics within 1e-5" sh -c "'${PYTHON3:-/usr/bin/python3}' '$TESTDIR/h5check.py' same-series out/fmaopen-clm-4/diag.h5 out/open4-$S/diag.h5 train 5 1e-5 && '${PYTHON3:-/usr/bin/python3}' '$TESTDIR/h5check.py' same-series out/fmaopen-clm-4/diag.h5 out/open4-$S/diag.h5 attention 4 1e-5"
done
check "diag.h5 of a sequence-parallel run has the SPEC layout" py "$TESTDIR/h5check.py" diag out/fma-clm-4/diag.h5
expect_fail "slabs that are not whole fine blocks are refused" "must be a whole number of fine blocks" "$MPI_RUN" 4 "$F" "$SP" --set parallel.seq_ranks=4 --set attention.fma.m=64
tap_done
