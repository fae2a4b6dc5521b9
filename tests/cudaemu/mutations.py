#!/usr/bin/env python3
"""mutations.py: the CUDA emulation's mutation check (run by test_mutations.sh in make check).

Each mutant plants one defect in a copy of one gpu/*.cu file (a removed barrier, an off-by-one
tile or guard, a wrong causal or band mask, a wrong warp mask, a wrong cuBLAS leading dimension,
work on the wrong stream), compiles only that file through cu2cc.py at -O1, links it with the
unmutated objects of test_gpu_emu, runs test_gpu under the emulation and requires it to FAIL
(a mutant of FMA's files: test_gpu_fma_emu and tests/test_gpu_fma.c, named by its tenth field).
A mutant whose anchor or pattern is not found exactly once is itself a failure ("no longer
applies: update it"), so the check cannot go stale silently. Output: TAP, one line per mutant. CUDAEMU_MUTANTS=REGEX runs
only the mutants whose name matches (while one works on them).
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cu2cc  # noqa: E402  (its masking of comments and strings)

# (name, file, function anchor, old text, new text, what, tests to run, environment, ranks
#  [, test program: test_gpu_emu unless given])
EXACT = "test_gpu_exact*"
FMA = "test_gpu_fma_emu"
# tests of tests/test_gpu_full.c (exact attention, blocked and distributed) run test_gpu_full_emu
FULL = "test_gpu_full_emu"
BLOCKED = "test_gpu_full_blocked"
CHUNKS = "test_gpu_full_chunks"
SEQ = "test_gpu_full_seq"
MUTANTS = [
    ("fwd-barrier-before-restage", "attention_full.cu", "void exact_fwd(",
     "    __syncthreads();  // the previous tile is no longer read\n", "",
     "exact_fwd: the barrier before a tile is restaged removed", EXACT, {}, 1),
    ("fwd-barrier-after-stage", "attention_full.cu", "void exact_fwd(",
     "stage<D>(ks, k + head, vs, v + head, j0, bj);\n    __syncthreads();\n",
     "stage<D>(ks, k + head, vs, v + head, j0, bj);\n",
     "exact_fwd: the barrier after staging a tile removed", EXACT, {}, 1),
    ("dq-barrier-before-restage", "attention_full.cu", "void exact_bwd_dq(",
     "    __syncthreads();\n    stage<D>(ks", "    stage<D>(ks",
     "exact_bwd_dq: the barrier before a tile is restaged removed", EXACT, {}, 1),
    ("dq-barrier-after-stage", "attention_full.cu", "void exact_bwd_dq(",
     "stage<D>(ks, k + head, vs, v + head, j0, bj);\n    __syncthreads();\n",
     "stage<D>(ks, k + head, vs, v + head, j0, bj);\n",
     "exact_bwd_dq: the barrier after staging a tile removed", EXACT, {}, 1),
    ("dkv-barrier-before-restage", "attention_full.cu", "void exact_bwd_dkv(",
     "    __syncthreads();\n    stage<D>(qs", "    stage<D>(qs",
     "exact_bwd_dkv: the barrier before a tile is restaged removed", EXACT, {}, 1),
    ("dkv-barrier-after-stage", "attention_full.cu", "void exact_bwd_dkv(",
     "    }\n    __syncthreads();\n    if (!live) continue;", "    }\n    if (!live) continue;",
     "exact_bwd_dkv: the barrier after staging q, dout, lse, D removed", EXACT, {}, 1),
    ("fwd-live-off-by-one", "attention_full.cu", "void exact_fwd(",
     "const bool live = i < T;", "const bool live = i <= T;",
     "exact_fwd: query row T counted as live (off by one)", EXACT, {}, 1),
    ("fwd-tile-off-by-one", "attention_full.cu", "void exact_fwd(",
     "(int)min((long)kTile, hi + 1 - j0)", "(int)min((long)kTile, hi + 2 - j0)",
     "exact_fwd: a key tile one row too long", EXACT, {}, 1),
    ("stage-off-by-one", "attention_full.cu", "void stage(",
     "e < count * D;", "e <= count * D;",
     "stage: one element staged past the tile", EXACT, {}, 1),
    ("causal-mask-diagonal", "attention_full.cu", "bool allows(",
     "mk.causal && j > i", "mk.causal && j >= i",
     "allows: the causal mask hides the diagonal", EXACT, {}, 1),
    ("band-mask-wide", "attention_full.cu", "bool allows(",
     "j > i - mk.band", "j >= i - mk.band",
     "allows: the band one key wider on the left", EXACT, {}, 1),
    ("key-span-short", "attention_full.cu", "void key_span(",
     "i0 - mk.band + 1", "i0 - mk.band + 2",
     "key_span: the first key of a band left out", EXACT, {}, 1),
    ("query-span-short", "attention_full.cu", "void query_span(",
     "j1 + mk.band - 1", "j1 + mk.band - 2",
     "query_span: the last query of a band left out", EXACT, {}, 1),
    ("rowdot-off-by-one", "blas.cu", "void rows_dot(",
     "if (r < rows) D[r] = acc;", "if (r <= rows) D[r] = acc;",
     "rows_dot: one row past the end", EXACT, {}, 1),
    ("rowdot-tile-barrier", "blas.cu", "void rows_dot(",
     "    __syncthreads();\n    if (r < rows)", "    if (r < rows)",
     "rows_dot: the barrier between staging a tile and summing it removed", EXACT, {}, 1),
    ("reduce-barrier-after-partials", "layers.cu", "float block_reduce(",
     "  if (lane == 0) part[warp] = v;\n  __syncthreads();\n", "  if (lane == 0) part[warp] = v;\n",
     "block_reduce (softmax_xent): the barrier after the warp partials removed",
     "test_gpu_softmax*", {}, 1),
    ("reduce-barrier-after-result", "layers.cu", "float block_reduce(",
     "  if (threadIdx.x == 0) result = r;\n  __syncthreads();\n",
     "  if (threadIdx.x == 0) result = r;\n",
     "block_reduce (softmax_xent): the barrier after the result removed", "test_gpu_softmax*", {}, 1),
    ("warp-sum-mask", "layers.cu", "float warp_sum(",
     "__shfl_xor_sync(0xffffffffu, v, o)", "__shfl_xor_sync(0x0000ffffu, v, o)",
     "warp_sum (layernorm): a shuffle mask of half the warp", "test_gpu_layernorm", {}, 1),
    ("warp-sum-half", "layers.cu", "float warp_sum(",
     "for (int o = kWarp / 2;", "for (int o = kWarp / 4;",
     "warp_sum (layernorm): the butterfly skips its first step", "test_gpu_layernorm", {}, 1),
    ("layernorm-row-off-by-one", "layers.cu", "void layernorm_fwd(",
     "if (row >= N) return;", "if (row > N) return;",
     "layernorm_fwd: one row past the end", "test_gpu_layernorm", {}, 1),
    ("chunk-sums-off-by-one", "layers.cu", "void chunk_sums(",
     "if (c >= C) return;", "if (c > C) return;",
     "chunk_sums (linear dbias, first stage): one column past the end", "test_gpu_linear", {}, 1),
    ("chunk-rows-overlap", "layers.cu", "void chunk_sums(",
     "r1 = N * (blockIdx.y + 1) / kChunks;", "r1 = N * (blockIdx.y + 1) / kChunks + 1;",
     "chunk_sums: a chunk also sums the next chunk's first row", "test_gpu_linear", {}, 1),
    ("layernorm-params-chunk-order", "layers.cu", "void gpu_layernorm_backward(",
     "part, part + kChunks * C, dout", "part + kChunks * C, part, dout",
     "gpu_layernorm_backward: the weight and bias partial sums swapped", "test_gpu_layernorm",
     {}, 1),
    ("embedding-token-chunks", "layers.cu", "void gpu_embedding_backward(",
     "dtoken, part,\n", "dtoken, part + V * C,\n",
     "gpu_embedding_backward: the second stage skips the first chunk", "test_gpu_embedding",
     {}, 1),
    ("add-bias-off-by-one", "layers.cu", "void add_bias(",
     "if (i < (size_t)N * C)", "if (i <= (size_t)N * C)",
     "add_bias (linear): one element past the end", "test_gpu_linear", {}, 1),
    ("linear-forward-lda", "layers.cu", "void gpu_linear_forward(",
     "1.0f, inp, IC, 0, weight, IC, 0", "1.0f, inp, IC, 0, weight, OC, 0",
     "gpu_linear_forward: the weight's leading dimension OC instead of IC (reads past it)",
     "test_gpu_linear", {}, 1),
    ("linear-dinp-ldb", "layers.cu", "void gpu_linear_backward(",
     "1.0f, dout, OC, 0, weight, IC, 0, 0.0f, dinp", "1.0f, dout, OC, 0, weight, OC, 0, 0.0f, dinp",
     "gpu_linear_backward: the weight's leading dimension OC < k (cuBLAS's argument check)",
     "test_gpu_linear", {}, 1),
    ("linear-dweight-ldc", "layers.cu", "void gpu_linear_backward(",
     "0, 1.0f, dweight, IC, 0, 1);", "0, 1.0f, dweight, OC, 0, 1);",
     "gpu_linear_backward: dweight's leading dimension OC instead of IC (writes past it)",
     "test_gpu_linear", {}, 1),
    ("rowdot-copy-of-b", "blas.cu", "void rows_dot(",
     "a16[at] = __float2bfloat16(ta[y][lane])", "a16[at] = __float2bfloat16(tb[y][lane])",
     "rows_dot: the bf16 copy of dout made from out's rows", "test_gpu_fma_bf16", {}, 1, FMA),
    ("gemm-swapped-strides", "blas.cu", "void gpu_gemm_as(",
     "c.ld1, sB, a, c.ld2, sA,", "c.ld1, sA, a, c.ld2, sA,",
     "gpu_gemm: the batched product's B stride taken from A", "test_gpu_gemm", {}, 1),
    ("gemm-bf16-swapped-strides", "blas.cu", "void gpu_gemm_as(",
     "c.in, c.ld1, sB, A, c.in, c.ld2, sA,", "c.in, c.ld1, sA, A, c.in, c.ld2, sA,",
     "gpu_gemm_as: the bf16 product's B stride taken from A", "test_gpu_fma_bf16", {}, 1, FMA),
    ("gemm-table-operands-swapped", "blas.cu", "void gpu_gemm_table(",
     "in, c.in,\n                                   c.ld1, in + c.count,",
     "in + c.count, c.in,\n                                   c.ld1, in,",
     "gpu_gemm_table: A's and B's pointer tables swapped", "test_gpu_fma_bf16", {}, 1, FMA),
    ("upload-wrong-stream", "memory.cu", "void gpu_upload(",
     "cudaMemcpyHostToDevice, gpu_stream())", "cudaMemcpyHostToDevice, 0)",
     "gpu_upload: the copy on the legacy default stream, not the back end's (deferred mode)",
     "test_gpu_gelu", {"CUDAEMU_DEFER": "1"}, 1),
    ("dropout-mask-key", "layers.cu", "float dropout_mask(",
     "(uint64_t)(key.t0 + t) * (uint64_t)C4", "(uint64_t)(key.t0 + t + 1) * (uint64_t)C4",
     "dropout_mask: the token counter off by one (another mask than the CPU's)",
     "test_gpu_dropout", {}, 1),
    ("heads-split-wrong-head", "layers.cu", "void heads_split(",
     "(((size_t)b * H + (w - 2 * Cqk) / d) * T + t)", "(((size_t)b * Hqk + (w - 2 * Cqk) / d) * T + t)",
     "heads_split: v heads laid out with Hqk, not H (FiSH's shapes)", "test_gpu_heads", {}, 1),
    ("rows-kernel-stride", "memory.cu", "void rows_kernel(",
     "dst[r * ds + i] += src[r * ss + i];", "dst[r * ss + i] += src[r * ss + i];",
     "rows_kernel: the added rows land at the source's stride", "test_gpu_memory", {}, 1),
    ("pool-best-fit-of-all", "memory.cu", "void *gpu_alloc(",
     "nullptr, nullptr, segments++}", "nullptr, nullptr, 0}",
     "gpu_alloc: every segment numbered 0, so a request takes the best fit over all of them",
     "test_gpu_pool_steady", {"FMATTN_GPU_POOL": "1"}, 1),
    ("bias-kernel-wrong-stream", "layers.cu", "void gpu_linear_forward(",
     "kThreads, 0, gpu_stream()>>>", "kThreads, 0, 0>>>",
     "gpu_linear_forward: add_bias on the legacy default stream (deferred mode)",
     "test_gpu_linear", {"CUDAEMU_DEFER": "1"}, 1),
    ("sumsq-barrier-after-store", "optimizer.cu", "void sum_squares(",
     "  s[threadIdx.x] = acc;\n  __syncthreads();\n", "  s[threadIdx.x] = acc;\n",
     "sum_squares: the barrier after the per-thread sums removed", "test_gpu_adamw", {}, 1),
    ("sumsq-barrier-in-tree", "optimizer.cu", "void sum_squares(",
     "s[threadIdx.x + o];\n    __syncthreads();\n", "s[threadIdx.x + o];\n",
     "sum_squares: the barrier inside the tree reduction removed", "test_gpu_adamw", {}, 1),
    ("adamw-off-by-one", "optimizer.cu", "void adamw(",
     "if (e >= n) return;", "if (e > n) return;",
     "adamw: one element past the end", "test_gpu_adamw", {}, 1),
    ("fill-normal-row-keys", "blas.cu", "void fill_normal(",
     "(uint64_t)(r * key_stride + key0 + j)", "(uint64_t)(r * len + key0 + j)",
     "fill_normal: a row's keys at the row's offset in x, not in the key space (bench's inputs "
     "would not be the same draws on every layout)", "test_gpu_fill_normal", {}, 1),
    ("allreduce-wrong-op", "comm.cu", "void allreduce_sum_float(",
     "ncclFloat32, ncclSum,", "ncclFloat32, ncclMax,",
     "the NCCL transport's allreduce: max instead of sum (2 ranks)", "test_gpu_nccl*", {}, 2),
    ("alltoallv-wrong-part", "comm.cu", "void alltoallv_float(",
     "ncclSend(send + sdispl[r],", "ncclSend(send + sdispl[me],",
     "the NCCL transport's alltoallv: sends every peer its own part, not the peer's (2 ranks; a "
     "wrong peer would deadlock, as on NCCL, until the time-out)", "test_gpu_nccl*", {}, 2),
    # fma: gpu/attention_fma.cu and gpu/fma_*.cu, caught by tests/test_gpu_fma.c
    ("fma-softmax-half-warp-sum", "fma_evaluate.cu", "float warp_sum(",
     "for (unsigned o = kLanes / 2;", "for (unsigned o = kLanes / 4;",
     "warp_sum (the fused softmax): the lanes' partial sums added over half the warp",
     "test_gpu_fma_m2m", {}, 1, FMA),
    ("fma-softmax-rows-rounded-down", "fma_evaluate.cu", "unsigned soft_grid(",
     "(rows + kSoftRows - 1) / kSoftRows", "rows / kSoftRows",
     "soft_grid: the softmax's row groups rounded down (the last rows' probabilities unwritten)",
     "test_gpu_fma_chunks", {}, 1, FMA),
    ("fma-held-softmax-unweighted", "fma_evaluate.cu", "void softmax_forward_held(",
     "? s[c] + add : -INFINITY", "? s[c] : -INFINITY",
     "softmax_forward_held: the row held in registers without the far field's log-weights",
     "test_gpu_fma_m2m", {}, 1, FMA),
    ("fma-probabilities-unweighted", "fma_evaluate.cu", "void probabilities(",
     "expf(s[c] + add - L)", "expf(s[c] - L)",
     "probabilities: backward's probabilities without the far field's log-weights",
     "test_gpu_fma_m2m", {}, 1, FMA),
    ("fma-near-past-the-end", "fma_evaluate.cu", "bool visible(",
     "c >= (mk.nb + 1 - qb) * mk.m", "c >= (mk.nb + 2 - qb) * mk.m",
     "visible: the near block after the sequence's last one seen (off by one)",
     "test_gpu_fma_avg", {}, 1, FMA),
    ("fma-near-causal-off-by-one", "fma_evaluate.cu", "bool visible(",
     "c <= mk.m + r", "c <= mk.m + r + 1",
     "visible: a causal query row sees the key after it",
     "test_gpu_fma_causality", {}, 1, FMA),
    ("fma-gather-row-step", "fma_evaluate.cu", "void gather_far(",
     "if (r >= p) r -= p, f++;", "if (r > p) r -= p, f++;",
     "gather_far: the stepped element index wraps its row one late",
     "test_gpu_fma_conv", {}, 1, FMA),
    ("fma-near-end-copy", "fma_evaluate.cu", "near_ends ends_of(",
     "gpu_copy(e.first + es * blk, keys, es * tail);",
     "gpu_copy(e.first + es * blk, keys + es * blk, es * tail);",
     "ends_of: the padded first end of the keys copied from their second block",
     "test_gpu_fma_m2m", {}, 1, FMA),
    ("fma-near-end-offset", "fma_evaluate.cu", "void *near_at(",
     "if (r < 0) p = o.first + (r + k.m) * k.d * o.es;", "if (r < 0) p = o.first + r * k.d * o.es;",
     "near_at: the sequence's first block reads before its padded copy of the keys' end",
     "test_gpu_fma_conv", {}, 1, FMA),
    ("fma-near-each-last", "fma_evaluate.cu", "void blocks_in_keys(",
     "near_row(k, *gb - 1, s) + k.m > k.rows", "near_row(k, *gb - 1, s) + k.m > k.rows + k.m",
     "blocks_in_keys: dv and dk of the last block's key block past the array's end written",
     "test_gpu_fma_avg", {}, 1, FMA),
    ("fma-causal-diagonal", "fma_evaluate.cu", "bool visible(",
     "return !mk.causal || c <= mk.m + r;", "return !mk.causal || c < mk.m + r;",
     "visible: the causal mask in the query's own block hides the diagonal",
     "test_gpu_fma_conv", {}, 1, FMA),
    ("fma-list-window", "fma_lists.cu", "void build_far(",
     "qb * tr->m / tr->window[l]", "(qb + 1) * tr->m / tr->window[l]",
     "build_far: each block gets the lists of its successor's window (off by one)",
     "test_gpu_fma_m2m", {}, 1, FMA),
    ("fma-multiplicity", "fma_lists.cu", "void build_far(",
     "logf((float)(tr->window[l] / tr->p))", "logf((float)tr->window[l])",
     "build_far: the multiplicity log(w_l) instead of log(w_l/p)",
     "test_gpu_fma_conv", {}, 1, FMA),
    ("fma-query-taps", "fma_upward.cu", "void query_taps(",
     "t < (r + 1) * (span / P)", "t <= (r + 1) * (span / P)",
     "query_taps: a causal query summary reads the first tap of the next sub-segment",
     "test_gpu_fma_linear_conv", {}, 1, FMA),
    ("fma-far-values-stride", "fma_evaluate.cu", "void values(",
     "c.Vf, d, g->nfmax * d,", "c.Vf, d, g->p * d,",
     "values: the batch stride of the gathered summary values wrong (M2P values)",
     "test_gpu_fma_avg", {}, 1, FMA),
    ("fma-p2m-channel-stride", "fma_upward.cu", "void p2m(",
     "x0 + ox * es, ldx, hn * T,", "x0 + ox * es, ldx, T,",
     "p2m: the channel stride of the transposed tokens that of one head",
     "test_gpu_fma_conv", {}, 1, FMA),
    ("fma-transpose-copy-transposed", "fma_upward.cu", "void transpose_tiles(",
     "if (copy) copy[r * cols + c]", "if (copy) copy[c * rows + r]",
     "transpose_tiles: the bf16 copy of the tokens written transposed, as the tile",
     "test_gpu_fma_bf16", {}, 1, FMA),
    ("fma-bf16-saved-copies-swapped", "attention_fma.cu", "gfma_copies made_of(",
     "in.kx ? nullptr : cp.x[FMA_K]", "in.kx ? nullptr : cp.x[FMA_V]",
     "made_of: the evaluation reads the saved bf16 copy of v as its keys",
     "test_gpu_fma_bf16", {}, 1, FMA),
    ("fma-transpose-barrier", "fma_upward.cu", "void transpose_tiles(",
     "  }\n  __syncthreads();\n", "  }\n",
     "transpose_tiles: the barrier between loading and storing a tile removed",
     "test_gpu_fma_m2m", {}, 1, FMA),
    ("fma-scatter-chunk-edge", "fma_evaluate.cu", "void ref_range(",
     "refs.off[k + 1], slots, s1)", "refs.off[k + 1], slots, s1 + 1)",
     "ref_range: a summary row also gathers the first block after the chunk (twice in all)",
     "test_gpu_fma_chunks", {}, 1, FMA),
    ("fma-linear-barrier-before-D", "fma_linear.cu", "void level_backward(",
     "    os[f] = o;\n  }\n  __syncthreads();\n", "    os[f] = o;\n  }\n",
     "level_backward (fma_linear): the barrier before D = g·o is summed removed",
     "test_gpu_fma_linear_m2m", {}, 1, FMA),
    ("fma-gather-wrong-stream", "fma_evaluate.cu", "void gather_as(",
     "dim3(kRow, kGather), 0, gpu_stream()>>>", "dim3(kRow, kGather), 0, 0>>>",
     "gather_as: the gather on the legacy default stream (deferred mode)",
     "test_gpu_fma_avg", {"CUDAEMU_DEFER": "1"}, 1, FMA),
    ("fma-bf16-dS-unweighted", "fma_evaluate.cu", "void softmax_backward(",
     "expf(P[at + c] + add - L)", "expf(P[at + c] - L)",
     "softmax_backward (bf16 products): P recomputed without the far field's log-weights",
     "test_gpu_fma_bf16", {}, 1, FMA),
    ("fma-bf16-last-end", "fma_evaluate.cu", "near_ends ends_of(",
     "e.last = buf + es * (blk + tail);", "e.last = buf + sizeof(float) * (blk + tail);",
     "ends_of: the padded last end placed for fp32 elements (bf16 products: over v's ends)",
     "test_gpu_fma_bf16", {}, 1, FMA),
    ("fma-scatter-barrier-after-store", "fma_evaluate.cu", "void scatter_far(",
     "    part[1][threadIdx.y][threadIdx.x] = av;\n    __syncthreads();\n",
     "    part[1][threadIdx.y][threadIdx.x] = av;\n",
     "scatter_far: the barrier between the warps' partial sums and their total removed",
     "test_gpu_fma_scatter_split", {}, 1, FMA),
    ("fma-scatter-light-share-overrun", "fma_evaluate.cu", "void scatter_far_light(",
     "e1 = e0 + share < b ? e0 + share : b;", "e1 = e0 + share;",
     "scatter_far_light: a warp's shares run past the row's (or the chunk's) last reference",
     "test_gpu_fma_m2m", {}, 1, FMA),
    ("fma-scatter-light-order", "fma_evaluate.cu", "void scatter_far_light(",
     "for (int w = 0; w < (int)kWarps; w++) {", "for (int w = (int)kWarps - 1; w >= 0; w--) {",
     "scatter_far_light: the shares' sums added last to first (within float rounding of the "
     "CPU, but not scatter_far's bits)", "test_gpu_fma_scatter_split", {}, 1, FMA),
    ("fma-let-unpack-off-by-one", "fma_let.cu", "void fetch(",
     "in_lw + 2 * in_off[r],", "in_lw + 2 * in_off[r] + 2,",
     "fetch: the summaries from each rank unpacked one window along its list (2 ranks)",
     "test_gpu_fma_seq", {}, 2, FMA),
    ("fma-let-tops", "fma_let.cu", "void gfma_let_upward(",
     "pack(g, all + per * (size_t)r, X, nsets, let->tops + 2 * r, 1, UNPACK);",
     "pack(g, all + per * (size_t)r, X, nsets, let->tops + 2 * let->s, 1, UNPACK);",
     "gfma_let_upward: every rank's gathered top window written over this rank's own (8 ranks)",
     "test_gpu_fma_seq", {}, 8, FMA),
    ("fma-let-top-sum", "fma_let.cu", "void gfma_let_upward_backward(",
     "for (int r = 0; r < S; r++)\n      pack(g, in + displ[r]",
     "for (int r = 1; r < S; r++)\n      pack(g, in + displ[r]",
     "gfma_let_upward_backward: rank 0's part of each top window's gradient left out (8 ranks)",
     "test_gpu_fma_seq", {}, 8, FMA),
    # exact attention, blocked and distributed (attention_full_blocked.cu, attention_full_seq.cu;
    # caught by tests/test_gpu_full.c)
    ("blocked-reduce-barrier", "attention_full_blocked.cu", "float block_reduce(",
     "  if (lane == 0) red[warp] = v;\n  __syncthreads();  // every warp's partial is written\n",
     "  if (lane == 0) red[warp] = v;\n",
     "block_reduce (fold_rows): the barrier after the warps' partials removed", BLOCKED, {}, 1, FULL),
    ("blocked-causal-diagonal", "attention_full_blocked.cu", "bool sees(",
     "g.mk.causal && j > i", "g.mk.causal && j >= i",
     "sees: the causal mask hides the diagonal", BLOCKED, {}, 1, FULL),
    ("blocked-band-edge", "attention_full_blocked.cu", "bool sees(",
     "j > i - g.mk.band", "j >= i - g.mk.band",
     "sees: the band one key wider on the left", BLOCKED, {}, 1, FULL),
    ("key-rows-short", "attention_full_blocked.cu", "void key_rows(",
     "std::min(b - ks.off + 1, ks.n)", "std::min(b - ks.off, ks.n)",
     "key_rows: a query chunk's last visible key left out (the full form)", BLOCKED, {}, 1, FULL),
    ("band-window-shift", "attention_full_blocked.cu", "Band band_layout(",
     "qs.off - ks.off - (b - 1)", "qs.off - ks.off - b",
     "band_layout: every key window starts one key early (its last key left out)", BLOCKED, {}, 1, FULL),
    ("windows-add-first-window", "attention_full_blocked.cu", "void windows_add(",
     "(x - W + step) / step", "(x - W + step + 1) / step",
     "windows_add: a key row's first window skipped (dk, dv of local)", BLOCKED, {}, 1, FULL),
    ("windows-gather-guard", "attention_full_blocked.cu", "void windows_gather(",
     "s >= 0 && s < n", "s >= 0 && s <= n",
     "windows_gather: the row after the key slab read", BLOCKED, {}, 1, FULL),
    ("grad-dv-ldc", "attention_full_blocked.cu", "void exact_grad(",
     "1.0f, dv + kr * d, d,\n               kst, G);", "1.0f, dv + kr * d, C,\n               kst, G);",
     "exact_grad: dv's leading dimension the span C instead of d", BLOCKED, {}, 1, FULL),
    ("fold-scores-ldc", "attention_full_blocked.cu", "void exact_fold(",
     "0.0f, S, C, R * C, G);", "0.0f, S, R, R * C, G);",
     "exact_fold: the score tile's leading dimension R (rows) instead of C (keys)", CHUNKS, {}, 1, FULL),
    ("band-dk-stride", "attention_full_blocked.cu", "void band_backward(",
     "Qp, d, bq * d, 0.0f, dKw", "Qp, d, W * d, 0.0f, dKw",
     "band_backward: dSᵀ Q takes Q's blocks a window's stride apart", BLOCKED, {}, 1, FULL),
    ("fold-wrong-stream", "attention_full_blocked.cu", "void exact_fold(",
     "kThreads, 0, gpu_stream()>>>", "kThreads, 0, 0>>>",
     "exact_fold: fold_rows on the legacy default stream (deferred mode)", BLOCKED,
     {"CUDAEMU_DEFER": "1"}, 1, FULL),
    ("gather-wrong-stream", "attention_full_blocked.cu", "void gather(",
     "kGridStride, 0, gpu_stream()>>>", "kGridStride, 0, 0>>>",
     "gather: the band's windows gathered on the legacy default stream (deferred mode)", BLOCKED,
     {"CUDAEMU_DEFER": "1"}, 1, FULL),
    ("ring-key-offsets", "attention_full_seq.cu", "void ring_fold(",
     "ring_side(rg, s->src, kp)", "ring_side(rg, rg->me, kp)",
     "ring_fold: the travelling keys masked as if they were my own slab's (2 ranks)", SEQ, {}, 2, FULL),
    ("ring-state-start", "attention_full_seq.cu", "void ring_fold(",
     "if (s->t == 0)", "if (s->t == 1)",
     "ring_fold: the online-softmax state started at step 1, not 0 (2 ranks)", SEQ, {}, 2, FULL),
    ("ring-grad-pieces", "attention_full_seq.cu", "void ring_grad(",
     "s->dtravel[1] + ko * d", "s->dtravel[1] + qo * d",
     "ring_grad: dv of a zigzag piece added at the other piece (2 ranks)", SEQ, {}, 2, FULL),
    ("halo-causal-after", "attention_full_seq.cu", "float *halo_keys(",
     "dm->causal ? 0 : reach", "reach",
     "halo_keys: a causal halo gathers keys after the slab too (bytes differ from MPI's; 2 ranks)",
     SEQ, {}, 2, FULL),
    ("halo-dv-from-dk", "attention_full_seq.cu", "void local_backward(",
     "gpu_add_rows(dv, slab, dkv + slab,", "gpu_add_rows(dv, slab, dkv,",
     "local_backward: dv takes the halo's dk (2 ranks)", SEQ, {}, 2, FULL),
]


def target(tests):
    """The test program whose tests the filter names: test_gpu_full_emu or test_gpu_emu."""
    return "test_gpu_full_emu" if tests.startswith("test_gpu_full") else "test_gpu_emu"


def function_span(masked, anchor_pos):
    """[start, end) of the function whose signature starts at anchor_pos: to its closing brace."""
    j = masked.find("{", anchor_pos)
    if j < 0:
        return None
    end = cu2cc.match_close(masked, j, "{", "}")
    return anchor_pos, end + 1


def apply(src, anchor, old, new):
    """The mutated source, or an explanation why the mutation no longer applies."""
    masked = cu2cc.mask(src)
    hits = [m.start() for m in re.finditer(re.escape(anchor), masked)]
    if len(hits) != 1:
        return None, "its anchor '%s' occurs %d times" % (anchor, len(hits))
    start, end = function_span(masked, hits[0])
    body = src[start:end]
    count = body.count(old)
    if count != 1:
        return None, "its pattern occurs %d times in the function of '%s'" % (count, anchor)
    return src[:start] + body.replace(old, new, 1) + src[end:], None


def run(cmd, cwd=None, env=None, timeout=300):
    p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=timeout)
    return p.returncode, p.stdout.decode("utf-8", "replace")


def how_caught(out):
    """A short account of how the test run failed."""
    for line in out.splitlines():
        if line.startswith("cudaemu") and ("illegal" in line or "divergent" in line or
                                           "deadlock" in line or "warp" in line or
                                           "not inside" in line or "shared memory" in line):
            return line[:200]
    for line in out.splitlines():
        if "CUBLAS_STATUS" in line or "failed:" in line:
            return line[:200]
    failed = [l.split(" - ", 1)[-1] for l in out.splitlines() if l.startswith("not ok")]
    reasons = [l.strip("# ") for l in out.splitlines() if "relative error" in l or "differ" in l]
    if failed:
        return "test failed: %s%s" % (", ".join(failed), " (%s)" % reasons[0] if reasons else "")
    return "exit status non-zero"


class Harness:
    def __init__(self, work):
        e = os.environ
        self.work = work
        self.build = e["EMU_BUILD"]
        self.src = os.path.join(e["SRCDIR"], "gpu")
        self.rewriter = os.path.join(e["EMU_SRC"], "cu2cc.py")
        self.compile = shlex.split(e["CUDAEMU_COMPILE"])
        self.link = shlex.split(e["CUDAEMU_LINK"])
        self.libs = shlex.split(e["CUDAEMU_LINK_LIBS"])
        self.gpu_objects = shlex.split(e["CUDAEMU_GPU_OBJECTS"])
        self.test_objects = {"test_gpu_emu": shlex.split(e["CUDAEMU_TEST_OBJECTS"]),
                             "test_gpu_fma_emu": shlex.split(e.get("CUDAEMU_FMA_TEST_OBJECTS", "")),
                             "test_gpu_full_emu": shlex.split(e.get("CUDAEMU_FULL_TEST_OBJECTS", ""))}
        self.mpi_run = e["MPI_RUN"]
        self.python = e.get("PYTHON3") or sys.executable

    def program(self, name, cu_file, text, target):
        """target (test_gpu_emu, test_gpu_fma_emu) with gpu/cu_file replaced by `text`; (path,
        None) or (None, log)."""
        d = os.path.join(self.work, name)
        os.makedirs(d, exist_ok=True)
        cu, cpp, obj = (os.path.join(d, cu_file + ext) for ext in ("", ".cpp", ".o"))
        with open(cu, "w") as f:
            f.write(text)
        rc, out = run([self.python, self.rewriter, cu, cpp])
        if rc == 0:
            rc, out = run(self.compile + ["-c", cpp, "-o", obj])
        if rc != 0:
            return None, out
        stem = "gpu_" + cu_file[:-3]
        objects = [obj if re.search(r"\b%s\.o" % re.escape(stem), o) else o for o in self.gpu_objects]
        if obj not in objects:
            return None, "no object of %s among %s" % (cu_file, self.gpu_objects)
        prog = os.path.join(d, "test_gpu_mutant")
        rc, out = run(self.link + ["-o", prog] + self.test_objects[target] + objects + self.libs,
                      cwd=self.build)
        return (prog, None) if rc == 0 else (None, out)

    def test(self, prog, tests, env_extra, ranks):
        env = dict(os.environ)
        env["FMATTN_GPU_POOL"] = "0"  # blocks of exactly their size: one float past one shows
        env.update(env_extra)
        env["CUDAEMU_TEST_FILTER"] = tests
        cmd = [prog] if ranks == 1 else [self.mpi_run, str(ranks), "env",
                                         "CUDAEMU_DEVICES=%d" % ranks, prog]
        try:
            return run(cmd, env=env, timeout=240)
        except subprocess.TimeoutExpired:
            return 124, "timed out after 240 s"


def main():
    work = tempfile.mkdtemp(prefix="fmattn-mutations-")
    h = Harness(work)
    n, failed, t0 = 0, 0, time.time()

    def tap(ok, what, detail=""):
        nonlocal n, failed
        n += 1
        failed += not ok
        print("%s %d - %s" % ("ok" if ok else "not ok", n, what))
        for line in detail.strip().splitlines()[-25:]:
            print("# " + line)
        sys.stdout.flush()

    # the unmutated test_gpu_emu passes every run the mutants get: their failures are theirs,
    # not the harness's
    only = re.compile(os.environ.get("CUDAEMU_MUTANTS", ""))
    mutants = [(i, m[:9], m[9] if len(m) > 9 else "test_gpu_emu")
               for i, m in enumerate(MUTANTS, 1) if only.search(m[0])]
    seen = set()
    for _, (name, cu_file, anchor, old, new, what, tests, env, ranks), target in mutants:
        key = (target, tests, tuple(sorted(env.items())), ranks)
        if key in seen:
            continue
        seen.add(key)
        rc, out = h.test(os.path.join(h.build, target), tests, env, ranks)
        tap(rc == 0, "control: the unmutated %s passes %s%s%s" % (
            target, tests, " with %s" % env if env else "",
            " on %d ranks" % ranks if ranks > 1 else ""), out if rc else "")
    for i, (name, cu_file, anchor, old, new, what, tests, env, ranks), target in mutants:
        with open(os.path.join(h.src, cu_file)) as f:
            src = f.read()
        text, why = apply(src, anchor, old, new)
        if text is None:
            tap(False, "mutation %d (%s) no longer applies: update it in tests/cudaemu/mutations.py "
                "(%s)" % (i, name, why))
            continue
        prog, log = h.program(name, cu_file, text, target)
        if not prog:
            tap(False, "mutation %d (%s): the mutant does not build" % (i, name), log)
            continue
        rc, out = h.test(prog, tests, env, ranks)
        label = "mutation %d (%s) %s: %s" % (i, name, cu_file, what)
        if rc != 0:
            tap(True, label + " -- caught: " + how_caught(out))
        else:
            tap(False, label + " -- NOT caught: %s passes with the defect" % target, out)
    print("1..%d" % n)
    print("# %d mutants and controls in %.0f s" % (n, time.time() - t0))
    if failed == 0:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print("# work kept in " + work)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
