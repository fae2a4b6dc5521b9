#!/bin/sh
# The suite's bit-for-bit claims across thread counts and kernels, under every OpenBLAS core this
# CPU can run (issue 52; docs/perf.md, "Bits on every BLAS core"). OpenBLAS picks its kernels by
# CPU, and a site may force another set through OPENBLAS_CORETYPE; fmattn promises the same bits
# on 1, 2 or 3 threads whichever kernels run. For each of Prescott, Haswell, Zen, SkylakeX and
# Cooperlake that the CPU has the instructions for, forced through OPENBLAS_CORETYPE (with
# OPENBLAS_L2_SIZE unset):
#   - fmattn's device line names the forced core (the library took it);
#   - test_layers (linear's pieces and blocks at 2 and 3 threads against 1, GELU's threads, the
#     in-place and across-kernel bits) and test_attention pass;
#   - a short training run gives the same checkpoint at 1 and 2 threads, on libxsmm's tiles (the
#     default) and on CBLAS alone (FMATTN_TILE_GEMM=blas), for full and for fma; under Haswell's
#     kernels, every other variant too (fma.open and FiSH heads included) on CBLAS.
# A core the CPU lacks the instructions for is a TAP skip that names them.
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
B="${BUILDDIR:-$TESTDIR}"
D="$TESTDIR/decks/majority.in"
flags=$(grep -m 1 '^flags' /proc/cpuinfo 2> /dev/null)
has() { # has FLAG...: the CPU has every one
  for f in "$@"; do
    case " ${flags#*:} " in *" $f "*) ;; *) return 1 ;; esac
  done
}
if "$FMATTN" "$D" --set run.name=probe --set train.steps=1 2>&1 | grep -q "BLAS core unknown"; then
  skip_all "every OpenBLAS core # SKIP fmattn's BLAS is not OpenBLAS (no core to force)"
fi
# dim 128 and 1024 rows a step: the MLP's products are cut into pieces on CBLAS (src/nn/layers.c)
run() { # run NAME THREADS TILES [SETTINGS...]: 4 steps on TILES' kernels, a checkpoint at the end
  name="$1" t="$2" tiles="$3"
  shift 3
  FMATTN_TILE_GEMM="$tiles" OMP_NUM_THREADS="$t" OPENBLAS_NUM_THREADS="$t" "$FMATTN" "$D" --set run.name="$name" \
    --set train.steps=4 --set train.batch=4 --set model.dim=128 --set output.checkpoint_every=4 "$@" > "$name.log" 2>&1 ||
    { tail -n 20 "$name.log"; return 1; }
}
for spec in Prescott:pni Haswell:avx2,fma Zen:avx2,fma \
  SkylakeX:avx512f,avx512cd,avx512bw,avx512dq,avx512vl \
  Cooperlake:avx512f,avx512cd,avx512bw,avx512dq,avx512vl,avx512_bf16; do
  core="${spec%%:*}"
  need=$(echo "${spec#*:}" | tr , ' ')
  # shellcheck disable=SC2086 # need is a list of flags
  if ! has $need; then
    ok "$core # SKIP this CPU lacks $need"
    continue
  fi
  export OPENBLAS_CORETYPE="$core"
  run "$core-probe" 1 xsmm --set train.steps=1 --set output.checkpoint_every=0 > /dev/null
  check "$core: fmattn runs OpenBLAS's $core kernels" grep -q "BLAS core $core" "$core-probe.log"
  for prog in test_layers test_attention; do
    "$B/$prog" > "$core-$prog.tap" 2>&1
    tap_program "$core: $prog" $? "$core-$prog.tap"
  done
  for v in full fma; do
    for tiles in xsmm blas; do
      n="$core-$v-$tiles"
      run "${n}1" 1 "$tiles" --set attention.variant="$v" > /dev/null &&
        run "${n}2" 2 "$tiles" --set attention.variant="$v" > /dev/null
      check "$core, $v on $tiles: 2 threads give the 1-thread checkpoint, bit for bit" \
        py "$TESTDIR/h5check.py" same-tensors "out/${n}1/ckpt_000004.h5" "out/${n}2/ckpt_000004.h5" 0
    done
  done
  # every other variant too, on CBLAS, under the first core whose kernels give bits by a row's
  # place in the call (Haswell's; src/nn/layers.c)
  if [ "$core" = Haswell ]; then
    for v in local linear fma_linear fmmformer rmfa "nystrom --set model.objective=mlm" \
      "fma --set attention.fma.open=2" "full --set attention.heads_mode=fish"; do
      n="$core-$(echo "$v" | tr -c 'a-z0-9_' '_')"
      # shellcheck disable=SC2086 # $v is a variant and its settings
      run "${n}1" 1 blas --set attention.variant=$v > /dev/null &&
        run "${n}2" 2 blas --set attention.variant=$v > /dev/null
      check "$core, $v on blas: 2 threads give the 1-thread checkpoint, bit for bit" \
        py "$TESTDIR/h5check.py" same-tensors "out/${n}1/ckpt_000004.h5" "out/${n}2/ckpt_000004.h5" 0
    done
  fi
  unset OPENBLAS_CORETYPE
done
tap_done
