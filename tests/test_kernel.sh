#!/bin/sh
# `fmattn kernel IN.h5 OUT.h5` (SPEC §8.3) for every variant built: OUT holds out, dq, dk, dv and
# the variant's dparams under their checkpoint names, and its diagnostics; fma with open = all
# equals full, and its diagnostics show every level opened; fma with n = 2m (no levels) equals full; fma
# with avg summaries, and linear, give 1 everywhere for v ≡ 1; parameters given in the file are
# used; bad kernel files get one clear message. The numerical ladders against the dense oracles
# are test_fma and test_kernelized.
. "$TESTDIR/tap.sh"
need_h5py
cd "$WORK" || exit 1
F="$FMATTN"
K="$TESTDIR/kernel_files.py"
for c in 1 0; do
  py "$K" make full.h5 full $c 2 64 8
  py "$K" make fma2m.h5 fma $c 2 64 8 m=32 p=4 downsample=avg
  check "causal=$c: kernel runs full" "$F" kernel full.h5 full_out.h5
  check "causal=$c: kernel runs fma with n = 2m" "$F" kernel fma2m.h5 fma2m_out.h5
  check "causal=$c: fma with n = 2m equals full" py "$K" close fma2m_out.h5 full_out.h5 1e-5
  py "$K" make ones.h5 fma $c 2 256 8 m=8 p=2 downsample=avg multiplicity=false --ones-v
  check "causal=$c: kernel runs fma on v = 1" "$F" kernel ones.h5 ones_out.h5
  check "causal=$c: fma, avg summaries, v = 1: every output is 1" py "$K" ones ones_out.h5 1e-6
done
# fma.open (SPEC §6.4a): all is exact attention; the output carries the opening's diagnostics
for c in 1 0; do
  py "$K" make fullo.h5 full $c 2 128 8
  py "$K" make openall.h5 fma $c 2 128 8 m=8 p=2 downsample=conv init=random open=all
  py "$K" make open2.h5 fma $c 2 128 8 m=8 p=2 downsample=m2m open=2
  check "causal=$c: kernel runs full" "$F" kernel fullo.h5 fullo_out.h5
  check "causal=$c: kernel runs fma with open = all" "$F" kernel openall.h5 openall_out.h5
  check "causal=$c: fma with open = all equals full" py "$K" close openall_out.h5 fullo_out.h5 1e-5
  check "causal=$c: open = all: no summary keeps mass; every level opens" py "$K" diagnostics openall_out.h5 all
  check "causal=$c: kernel runs fma with open = 2" "$F" kernel open2.h5 open2_out.h5
  check "causal=$c: open = 2: shares add up to 1, at most 2 windows a level" py "$K" diagnostics open2_out.h5 2
done
check "full's diagnostics in the kernel output add up to 1" py "$K" diagnostics fullo_out.h5
py "$K" make conv.h5 fma 1 2 128 8 m=16 p=2 downsample=conv
check "fma conv: kernel runs" "$F" kernel conv.h5 conv_out.h5
check "fma conv: dparams/k_down/level_02/weight has shape [d, p, w_2]" py "$K" dparams conv_out.h5 k_down/level_02/weight 8,2,32
py "$K" make lin.h5 fma_linear 1 2 128 8 m=16 p=2 downsample=m2m init=random linear_zero_values=false
check "fma_linear m2m: kernel runs" "$F" kernel lin.h5 lin_out.h5
check "fma_linear m2m: dparams/q_down/level_02/weight has shape [d, p, 2p]" py "$K" dparams lin_out.h5 q_down/level_02/weight 8,2,4
py "$K" make loc.h5 local 0 1 100 8 band=7
check "local: kernel runs (odd n)" "$F" kernel loc.h5 loc_out.h5


# the kernelized variants (SPEC 6.3, 6.6, 6.8); their numerical ladder is test_kernelized
for c in 1 0; do
  py "$K" make lin1.h5 linear $c 2 100 8 --ones-v
  check "causal=$c: kernel runs linear on v = 1" "$F" kernel lin1.h5 lin1_out.h5
  check "causal=$c: linear, v = 1: every output is 1" py "$K" ones lin1_out.h5 1e-6
done
py "$K" make fmm.h5 fmmformer 1 2 100 8 band=5 kernels=elu,tanh
check "fmmformer (kernels elu,tanh, band 5): kernel runs" "$F" kernel fmm.h5 fmm_out.h5
check "fmmformer: dparams/w1 has shape [H]" py "$K" dparams fmm_out.h5 w1 2
check "fmmformer: dparams/w2 has shape [H]" py "$K" dparams fmm_out.h5 w2 2
py "$K" make rmfa.h5 rmfa 0 2 100 8 kernel=sqrt features=16
py "$K" make rmfa2.h5 rmfa 0 2 100 8 kernel=sqrt features=16 param=gamma:2,8:2.0
check "rmfa (sqrt, 16 features): kernel runs" "$F" kernel rmfa.h5 rmfa_out.h5
check "rmfa: dparams/gamma has shape [H, d]" py "$K" dparams rmfa_out.h5 gamma 2,8
check "rmfa: the frozen features have no dparams" py "$K" nodparams rmfa_out.h5 omega
check "rmfa: kernel runs with params/gamma given" "$F" kernel rmfa2.h5 rmfa2_out.h5
check "rmfa: params/gamma from the file is used (gamma = 2 doubles out)" py "$K" scaled rmfa2_out.h5 rmfa_out.h5 2.0 1e-6
# a prototype's own feature draw (degrees, and omega of as many rows as they need)
for c in 1 0; do
  py "$K" make own$c.h5 rmfa $c 2 60 8 kernel=exp features=12
  py "$K" draw own$c.h5 5
  check "causal=$c: rmfa kernel runs on the file's own feature draw" "$F" kernel own$c.h5 own${c}_out.h5
  check "causal=$c: rmfa uses the file's draw (float64 reference)" py "$K" rmfa own${c}_out.h5 own$c.h5 1e-4
done
py "$K" make bad_draw.h5 rmfa 0 2 60 8 kernel=exp features=12 param=omega:5,8:1.0
expect_fail "rmfa: an omega too short for any draw is refused" "params/omega does not have the shape" "$F" kernel bad_draw.h5 bad_draw_out.h5
py "$K" make ny.h5 nystrom 0 2 96 8 landmarks=12 conv=5 pinv_iters=8
check "nystrom (12 landmarks, conv 5): kernel runs" "$F" kernel ny.h5 ny_out.h5
check "nystrom: dparams/conv has shape [H, k]" py "$K" dparams ny_out.h5 conv 2,5
py "$K" make nyc.h5 nystrom 1 2 96 8 landmarks=12
expect_fail "nystrom refuses causal kernel files" "bidirectional only" "$F" kernel nyc.h5 nyc_out.h5
# FiSH heads: q and k with the G global heads, v and dout with the H value heads
py "$K" make fish.h5 full 1 3 64 8 heads_mode=fish global_heads=2 mix=mlp --qk-heads=2
check "FiSH heads on full (2 global heads, mlp mix): kernel runs" "$F" kernel fish.h5 fish_out.h5
check "FiSH: dparams/w2 has shape [H, R]" py "$K" dparams fish_out.h5 w2 3,3
check "FiSH: dq has the global heads' shape [G, n, d]" py -c "
import h5py, sys
f = h5py.File('fish_out.h5')
sys.exit(0 if f['dq'].shape == (2, 64, 8) and f['dv'].shape == (3, 64, 8) else 1)"
py "$K" make fishbad.h5 full 1 3 64 8 heads_mode=fish global_heads=2
expect_fail "FiSH: q with the wrong number of heads is refused" "q and k have 3 heads" "$F" kernel fishbad.h5 fishbad_out.h5
py "$K" make badk.h5 fmmformer 1 2 100 8 kernels=elu,cosine
expect_fail "fmmformer refuses an unknown kernel" "cosine" "$F" kernel badk.h5 badk_out.h5

py "$K" make bad.h5 fma 1 2 128 8 m=16 p=2 --bad-attr
expect_fail "a kernel attribute with several values is refused" "attribute 'm' must hold one value" "$F" kernel bad.h5 bad_out.h5
py "$K" make badn.h5 fma 1 2 96 8 m=16 p=2
expect_fail "fma refuses n/m not a power of two" "power of two" "$F" kernel badn.h5 badn_out.h5
py "$K" make unknown.h5 fma 1 2 128 8 m=16 frobnicate=3
expect_fail "an unknown kernel attribute is named" "frobnicate" "$F" kernel unknown.h5 unknown_out.h5
expect_fail "a missing IN file" "cannot open HDF5 file 'absent.h5'" "$F" kernel absent.h5 out.h5
tap_done
