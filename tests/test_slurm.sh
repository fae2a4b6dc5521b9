#!/bin/bash
# A real one-node SLURM cluster (munge, slurmctld, slurmd on localhost, configured in the test's
# directory) runs scripts/slurm/enwik8.sbatch and scaling.sbatch with tiny decks; pre-emption by
# `scancel --signal=USR1 --batch` checkpoints, requeues and resumes the job bit for bit. Every
# daemon is stopped by its pid at the end; skipped, with the reason, where they cannot start.
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
H5C="$TESTDIR/h5check.py"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

skip() {
  ok "a one-node SLURM cluster # SKIP $1"
  tap_done
  exit 0
}
for p in munged slurmctld slurmd sbatch squeue scontrol scancel sinfo; do
  command -v "$p" > /dev/null ||
    skip "$p is not installed (Debian's slurm-wlm and munge: scripts/install-deps.sh installs them)"
done
[ "$(id -u)" = 0 ] || skip "slurmd runs jobs as their users, so it needs root"

# ---- the cluster: munge, then slurmctld and slurmd, all in $WORK/s ---------------------------
D="$WORK/s"
mkdir -p "$D/state" "$D/spool" "$D/munge"
chmod 700 "$D/munge"
head -c 1024 /dev/urandom > "$D/munge/munge.key"
chmod 400 "$D/munge/munge.key"
# alive PID: running, not a zombie left for an init that does not reap (as in some containers)
alive() { kill -0 "$1" 2> /dev/null && ! grep -q '^State:.*Z' "/proc/$1/status" 2> /dev/null; }
pids_of_daemons() { cat "$D"/munge/munged.pid "$D"/slurmctld.pid "$D"/slurmd.pid 2> /dev/null; }
stop_daemons() {
  # jobs first, while slurmctld can still cancel them (a failed or timed-out check can leave one
  # running), so that no fmattn outlives the test
  if alive "$(cat "$D/slurmctld.pid" 2> /dev/null)"; then
    jobs=$(squeue -h -o %A 2> /dev/null)
    [ -n "$jobs" ] && scancel $jobs 2> /dev/null
    for _ in $(seq 100); do [ -z "$(squeue -h -o %A 2> /dev/null)" ] && break; sleep 0.1; done
  fi
  for pid in $(pids_of_daemons); do kill "$pid" 2> /dev/null; done
  for _ in $(seq 50); do
    alive=0
    for pid in $(pids_of_daemons); do alive "$pid" && alive=1; done
    [ "$alive" = 0 ] && return 0
    sleep 0.1
  done
  for pid in $(pids_of_daemons); do kill -9 "$pid" 2> /dev/null; done
}
trap stop_daemons EXIT

munged --force --socket="$D/munge/munge.socket" --key-file="$D/munge/munge.key" \
  --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" --seed-file="$D/munge/seed" ||
  skip "munged would not start: $(tail -n 1 "$D/munge/munged.log" 2> /dev/null)"

host=$(hostname -s)
port=$((20000 + ($$ % 4000) * 2)) # two ports of our own, so that a concurrent run cannot clash
cat > "$D/slurm.conf" << CONF
ClusterName=fmattntest
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.socket,cred_expire=10
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
PlugStackConfig=$D/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=$host NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
: > "$D/plugstack.conf"
export SLURM_CONF="$D/slurm.conf"
slurmctld -f "$SLURM_CONF" || skip "slurmctld would not start: $(tail -n 1 "$D/slurmctld.log" 2> /dev/null)"
slurmd -f "$SLURM_CONF" || skip "slurmd would not start: $(tail -n 1 "$D/slurmd.log" 2> /dev/null)"
for _ in $(seq 150); do
  [ "$(sinfo -h -o %T 2> /dev/null)" = idle ] && break
  sleep 0.2
done
[ "$(sinfo -h -o %T 2> /dev/null)" = idle ] ||
  skip "the node did not come up: $(tail -n 2 "$D/slurmctld.log" "$D/slurmd.log" 2> /dev/null | tr '\n' ' ')"
ok "a one-node cluster is up: slurmctld and slurmd on $host with munge, partition cpu idle"

# ---- helpers -----------------------------------------------------------------------------------
# wait_job JOB SECONDS: until the job has left the queue; then its final state is printed
wait_job() {
  for _ in $(seq $(($2 * 5))); do
    squeue -h -j "$1" 2> /dev/null | grep -q . || break
    sleep 0.2
  done
  scontrol show job "$1" 2> /dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'
}
# wait_for FILE PATTERN SECONDS
wait_for() {
  for _ in $(seq $(($3 * 10))); do
    grep -q -- "$2" "$1" 2> /dev/null && return 0
    sleep 0.1
  done
  return 1
}
submit() { sbatch --parsable --ntasks=2 --cpus-per-task=1 --chdir="$WORK" "$@"; }

TINY="$TESTDIR/decks/slurm_train.in"

# ---- enwik8.sbatch: accepted, runs to completion, leaves its outputs -----------------------------
job=$(submit --export="ALL,FMATTN=$FMATTN,DECK=$TINY" "$SRCDIR/scripts/slurm/enwik8.sbatch")
if [[ "$job" =~ ^[0-9]+$ ]]; then ok "enwik8.sbatch is accepted: job $job"; else not_ok "enwik8.sbatch is accepted" "$job"; fi
state=$(wait_job "$job" 120)
check "enwik8.sbatch runs to completion (state $state)" test "$state" = COMPLETED
check "its log, checkpoint and diagnostics are there" bash -c \
  "grep -q 'test  step 30 ' fmattn-enwik8-$job.out && test -f runs/tiny/ckpt_000030.h5 && test -f runs/tiny/diag.h5"
check "the checkpoint it wrote is whole" py "$H5C" ckpt runs/tiny/ckpt_000030.h5

# ---- scaling.sbatch: a tiny strong-scaling sweep over S = 1, 2 ---------------------------------
ln -s "$SRCDIR/scripts" scripts
SCALE="$TESTDIR/decks/slurm_scaling.in"
job=$(submit --export="ALL,FMATTN=$FMATTN,DECK=$SCALE,PYTHON=${PYTHON3:-/usr/bin/python3},SWEEP_ARGS=--kind strong --n 1024" \
  "$SRCDIR/scripts/slurm/scaling.sbatch")
if [[ "$job" =~ ^[0-9]+$ ]]; then ok "scaling.sbatch is accepted: job $job"; else not_ok "scaling.sbatch is accepted" "$job"; fi
state=$(wait_job "$job" 300)
check "scaling.sbatch runs to completion (state $state)" test "$state" = COMPLETED
check "its sweep file and plots are there" bash -c \
  "test -f runs/scaling/scaling.h5 && ls runs/scaling/*.png > /dev/null && grep -q 'scaling.sbatch: done' fmattn-scaling-$job.out"

# ---- pre-emption: SIGUSR1 to the batch shell, checkpoint, requeue, resume ----------------------
# A step of this model takes about a millisecond and the signal needs tens of milliseconds to reach
# fmattn (30 to 50 steps on an idle machine, more on a loaded one), so the run is long enough in steps
# that the signal always lands inside it.
long=(--set train.steps=2000 --set train.eval_every=200 --set output.checkpoint_every=1000)
check "the uninterrupted run, 2 ranks, for comparison" \
  "$MPI_RUN" 2 "$FMATTN" "$TINY" --set run.name=straight "${long[@]}"
job=$(submit --export="ALL,FMATTN=$FMATTN,DECK=$TINY" "$SRCDIR/scripts/slurm/enwik8.sbatch" \
  --set run.name=pre "${long[@]}")
joblog="fmattn-enwik8-$job.out"
if wait_for "$joblog" "step 50/2000 " 120; then
  scancel --signal=USR1 --batch "$job"
  ok "job $job at step 50 gets SIGUSR1 through scancel --signal=USR1 --batch"
else
  not_ok "job $job reaches step 50" "$(tail -n 20 "$joblog")"
fi
if wait_for "$joblog" "requeueing job $job" 60; then
  ok "the job checkpoints and requeues itself"
else
  not_ok "the job checkpoints and requeues itself" "$(tail -n 20 "$joblog")"
fi
# SLURM holds a requeued job back until its old credential expires (AuthInfo cred_expire, default
# 120 s, 10 s here), then starts it again with the same job id.
state=$(wait_job "$job" 300)
# The last lines of the log may come after the state: seconds later on a loaded machine (a CI
# rehearsal beside two training runs once missed them at 30 s), so wait up to 2 minutes.
wait_for "$joblog" "test  step 2000 " 120
check "the requeued job runs to completion (state $state)" test "$state" = COMPLETED
# The signal lands some steps after step 50 (a loaded machine once took it past step 100), so the
# check is on the step the second segment starts from, not on a file name.
resumed=$(sed -n 's|.*restarting from runs/pre/ckpt_[0-9]*\.h5 at step \([0-9]*\).*|\1|p' "$joblog" | head -n 1)
if grep -q 'restart count 1' "$joblog" && [ -n "$resumed" ] && [ "$resumed" -ge 50 ] &&
  [ "$resumed" -lt 2000 ] && grep -q 'test  step 2000 ' "$joblog"; then
  ok "it resumed from the checkpoint of its first segment (step $resumed)"
else
  not_ok "it resumed from the checkpoint of its first segment" \
    "$(grep -n 'restart count\|restarting from\|test  step' "$joblog"; tail -n 5 "$joblog")"
fi
check "its losses and gradient norms continue the uninterrupted run's, bit for bit" \
  py "$H5C" same-series runs/straight/diag.h5 runs/pre/diag.h5 train 0 0
check "its validation losses too" py "$H5C" same-series runs/straight/diag.h5 runs/pre/diag.h5 eval 0 0
check "its final checkpoint equals the uninterrupted run's" \
  py "$H5C" same-tensors runs/pre/ckpt_002000.h5 runs/straight/ckpt_002000.h5 0

# ---- stop what we started --------------------------------------------------------------------
pids=$(pids_of_daemons | tr '\n' ' ')
stop_daemons
alive=""
for pid in $pids; do alive "$pid" && alive="$alive $pid"; done
check "munged, slurmctld and slurmd (pids $pids) are stopped" test -z "$alive"
tap_done
