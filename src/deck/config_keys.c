/* The deck's keys (SPEC §3): the one table of every key (type, default, range, help), and what is
 * done with one value: deck text to a typed field and back, the "expected ..." text, the comma
 * lists, "did you mean" suggestions and the enum names. Parsing, the cross-key rules, loading and
 * writing decks are src/deck/config.c's; nothing here parses a deck, reads a file or calls MPI. */
#define _POSIX_C_SOURCE 200809L

#include "deck/config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "deck/config_keys.h"
#include "deck/variants.h"

/* Enums are written through an int pointer; that is only sound while they are int-sized. */
_Static_assert(sizeof(enum run_mode) == sizeof(int), "enum storage");
_Static_assert(sizeof(enum position_kind) == sizeof(int), "enum storage");
_Static_assert(sizeof(enum fma_downsample) == sizeof(int), "enum storage");
_Static_assert(sizeof(enum fma_down_lr) == sizeof(int), "enum storage");
_Static_assert(sizeof(enum precision_kind) == sizeof(int), "enum storage");
_Static_assert(sizeof(enum exact_kernels) == sizeof(int), "enum storage");
_Static_assert(sizeof(enum data_source) == sizeof(int), "enum storage");
_Static_assert(sizeof(enum mqar_spread) == sizeof(int), "enum storage");

/* ---------------------------------------------------------------------------------------------
 * Names. Each list is in enum order: the index of a word is the enum value it stands for. */

const char *const config_section_names[] = {"run",   "data",     "model",    "attention",
                                            "train", "output",   "parallel", "gpu",
                                            "bench", "generate", NULL};
static const char *const mode_names[] = {"train", "eval", "generate", "bench", NULL};
static const char *const source_names[] = {"file", "copy",    "majority", "task",
                                           "mqar", "passkey", "listops",  NULL};
static const char *const mqar_spread_names[] = {"compact", "uniform", "log", NULL};
static const char *const position_names[] = {"learned", "sinusoidal", "rope", "none", NULL};
static const char *const objective_names[] = {"clm", "mlm", NULL};
static const char *const schedule_names[] = {"cosine", "linear", "constant", NULL};
static const char *const backend_names[] = {"auto", "mpi", "nccl", NULL};
static const char *const alltoallv_names[] = {"sparse", "mpi", "nbx", NULL};
static const char *const device_names[] = {"auto", "cpu", "gpu", NULL};
static const char *const precision_names[] = {"fp32", "bf16", NULL};
static const char *const exact_names[] = {"blocked", "reference", NULL};
static const char *const downsample_names[] = {"conv", "m2m", "avg", NULL};
static const char *const init_names[] = {"mean", "random", NULL};
static const char *const down_lr_names[] = {"scaled", "plain", NULL};
static const char *const heads_mode_names[] = {"standard", "fish", NULL};
/* The variants: the registry's names (src/deck/variants.h). */
#define VARIANT_NAME(name) #name,
static const char *const variant_names[] = {ATTENTION_REGISTRY(VARIANT_NAME) NULL};
#undef VARIANT_NAME
static const char *const rmfa_kernel_names[] = {"exp", "inv", "log", "trigh", "sqrt", NULL};
static const char *const fish_mix_names[] = {"linear", "mlp", NULL};
static const char *const kernel_names[] = {"elu", "elu_neg", "tanh", NULL};
/* In bit order of enum bench_what. */
static const char *const bench_what_names[] = {"attention", "train", "comm", "generate", NULL};

int config_name_index(const char *const *names, const char *word) {
  for (int i = 0; names[i]; i++)
    if (strcasecmp(names[i], word) == 0) return i;
  return -1;
}

/* ---------------------------------------------------------------------------------------------
 * The key table. */

static int store_split(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                       size_t len);
static int store_what(struct config *cfg, char items[][LIST_ITEM], int n, char *detail, size_t len);
static int store_n_list(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                        size_t len);
static int store_variants(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                          size_t len);
static int store_kernels(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                         size_t len);
static void format_what(const struct config *cfg, char *out, size_t len);
static void format_n_list(const struct config *cfg, char *out, size_t len);
static void format_variants(const struct config *cfg, char *out, size_t len);
static void format_kernels(const struct config *cfg, char *out, size_t len);
static int store_depth(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                       size_t len);
static void format_depth(const struct config *cfg, char *out, size_t len);
static int store_length(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                        size_t len);
static void format_length(const struct config *cfg, char *out, size_t len);
static int store_open(struct config *cfg, char items[][LIST_ITEM], int n, char *detail, size_t len);
static int store_bench_open(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                            size_t len);
static void format_bench_open(const struct config *cfg, char *out, size_t len);
static void format_open(const struct config *cfg, char *out, size_t len);

static const struct list_kind split_list = {
    NULL,
    "three comma-separated numbers >= 0 (train,valid,test): fractions summing to 1, or whole "
    "byte counts",
    store_split, config_format_split};
static const struct list_kind what_list = {bench_what_names, NULL, store_what, format_what};
static const struct list_kind n_list = {NULL, "a comma list of up to 32 integers >= 2",
                                        store_n_list, format_n_list};
static const struct list_kind variants_list = {variant_names, NULL, store_variants,
                                               format_variants};
static const struct list_kind kernels_list = {kernel_names, NULL, store_kernels, format_kernels};
static const struct list_kind depth_list = {
    NULL, "a fraction in [0, 1], or two (lo,hi) with lo <= hi", store_depth, format_depth};
static const struct list_kind length_list = {
    NULL, "a fraction in [0, 1], or two (lo,hi) with lo <= hi", store_length, format_length};
static const struct list_kind bench_open_list = {
    NULL, "a comma list of fma.open values: integers >= 0, all, or deck (attention.fma.open)",
    store_bench_open, format_bench_open};
static const struct list_kind open_list = {NULL, "an integer >= 0, or all", store_open,
                                           format_open};

#define FIELD(f)      offsetof(struct config, f)
#define FIELD_SIZE(f) sizeof(((struct config *)0)->f)
#define K_NUM(sec, key, type, def, lo, hi, flags, f, aliases, help) \
  { sec, key, type, def, lo, hi, flags, NULL, NULL, FIELD(f), 0, aliases, help }
#define K_BOOL(sec, key, def, f, aliases, help) \
  { sec, key, KEY_BOOL, def, 0, 0, 0, NULL, NULL, FIELD(f), 0, aliases, help }
#define K_TEXT(sec, key, def, flags, f, aliases, help) \
  { sec, key, KEY_STRING, def, 0, 0, flags, NULL, NULL, FIELD(f), FIELD_SIZE(f), aliases, help }
#define K_ENUM(sec, key, def, words, f, aliases, help) \
  { sec, key, KEY_CHOICE, def, 0, 0, 0, words, NULL, FIELD(f), 0, aliases, help }
/* A choice the struct keeps as its word (attention.variant and friends). */
#define K_WORD(sec, key, def, words, f, aliases, help) \
  { sec, key, KEY_CHOICE, def, 0, 0, 0, words, NULL, FIELD(f), FIELD_SIZE(f), aliases, help }
#define K_LIST(sec, key, def, kind, aliases, help) \
  { sec, key, KEY_LIST, def, 0, 0, 0, NULL, &kind, 0, 0, aliases, help }

#define LO1  HAS_LO
#define LOHI (HAS_LO | HAS_HI)

/* Grouped by section, in config_section_names order: the resolved deck and --print-defaults follow
 * it. */
const struct key_def config_keys[] = {
    K_TEXT(
        "run", "name", "", NAME_CHARS, run.name, "run_name experiment",
        "run name; outputs go to output.dir/name/ (empty: the deck file name without extension)"),
    K_ENUM("run", "mode", "train", mode_names, run.mode, "",
           "train; eval (valid and test loss of the output.restart checkpoint); generate; bench"),
    K_NUM("run", "seed", KEY_UINT64, "1234", 0, 0, LO1, run.seed, "random_seed",
          "seed of every random stream"),

    K_ENUM("data", "source", "file", source_names, data.source, "task",
           "file: the byte file data.path; task: the task file data.path; mqar, passkey, "
           "listops, copy, majority: tasks made in-process (docs/tasks.md)"),
    K_TEXT("data", "path", "", 0, data.path, "file data_path dataset",
           "byte file (data.source = file: scripts/get_kjv.sh or scripts/get_enwik8.sh write one), "
           "task file (task), or passkey filler text (passkey; empty: random bytes)"),
    K_LIST("data", "split", "0.9,0.05,0.05", split_list, "splits",
           "train,valid,test in file order: fractions, or byte counts (enwik8: "
           "90000000,5000000,5000000)"),
    K_NUM("data", "symbols", KEY_INT, "16", 2, 255, LOHI, data.symbols, "alphabet vocab",
          "alphabet size of the copy and majority tasks"),
    K_NUM("data", "copy_len", KEY_INT, "0", 0, 0, LO1, data.copy_len, "copy_length",
          "copy task: symbols before the separator (0: as many as fit)"),
    K_TEXT("data", "export", "", 0, data.export_path, "export_path dump",
           "write the run's samples as a task file at start-up (every step's training rows, then "
           "the valid and test sets; docs/tasks.md); empty: none"),
    K_NUM("data", "mqar.pairs", KEY_INT, "8", 1, 64, LOHI, data.mqar_pairs, "pairs",
          "mqar: key-value pairs at the start of a sample (one_hop: at most 16)"),
    K_BOOL("data", "mqar.one_hop", "true", data.mqar_one_hop, "fused",
           "mqar: a pair is one byte (16 keys x 8 values) that a query's target copies, so one "
           "attention hop retrieves it; false: a key byte then a value byte (Zoology; retrieval "
           "needs a two-layer induction circuit)"),
    K_NUM("data", "mqar.queries", KEY_INT, "0", 0, 64, LOHI, data.mqar_queries, "queries",
          "mqar: keys asked for, in random order, each once (at most mqar.pairs; 0: every pair)"),
    K_ENUM("data", "mqar.spread", "log", mqar_spread_names, data.mqar_spread, "spread",
           "mqar: where the queries go after the pairs (compact: right after them; uniform: "
           "anywhere; log: log-uniform gaps, every distance octave alike)"),
    K_NUM("data", "passkey.digits", KEY_INT, "5", 1, 64, LOHI, data.passkey_digits, "digits",
          "passkey: digits of the pass key (one_hop: at most 12)"),
    K_BOOL("data", "passkey.one_hop", "true", data.passkey_one_hop, "tagged",
           "passkey: each digit byte carries its index, so one attention hop fetches it; false: "
           "plain digits (an induction circuit must find each)"),
    K_LIST("data", "passkey.depth", "0,1", depth_list, "depth",
           "passkey: depth of the needle in the filler (0: the start, 1: just before the "
           "question), or lo,hi to draw it uniformly per sample"),
    K_LIST("data", "passkey.length", "1", length_list, "haystack",
           "passkey: the haystack's share of the sample (filler, needle and question; padding "
           "after it), or lo,hi to draw it uniformly per sample"),
    K_NUM("data", "listops.max_args", KEY_INT, "10", 2, 20, LOHI, data.listops_max_args, "max_args",
          "listops: most arguments of one operator (LRA: 10)"),
    K_NUM("data", "listops.max_depth", KEY_INT, "10", 1, 20, LOHI, data.listops_max_depth,
          "max_depth", "listops: deepest nesting (LRA: 10)"),
    K_NUM("data", "listops.min_length", KEY_INT, "64", 4, 0, LO1, data.listops_min_length,
          "min_length", "listops: shortest expression in bytes (LRA: 500 of at most 2000)"),

    K_NUM("model", "layers", KEY_INT, "6", 1, 1024, LOHI, model.layers,
          "n_layer n_layers num_layers depth", "transformer blocks"),
    K_NUM("model", "dim", KEY_INT, "256", 1, 65536, LOHI, model.dim,
          "n_embd d_model hidden_size embed_dim width", "model width C"),
    K_NUM("model", "heads", KEY_INT, "4", 1, 1024, LOHI, model.heads, "n_head n_heads num_heads",
          "attention heads H (head size dim/heads)"),
    K_NUM("model", "mlp_ratio", KEY_INT, "4", 1, 64, LOHI, model.mlp_ratio, "ffn_ratio mlp_mult",
          "MLP hidden width = mlp_ratio * dim"),
    K_NUM("model", "context", KEY_INT, "1024", 2, 16777216, LOHI, model.context,
          "block_size seq_len sequence_length n_ctx max_seq_len ctx n",
          "sequence length n per sample"),
    K_ENUM("model", "position", "learned", position_names, model.position,
           "pos_emb positional_encoding pos_encoding", "position encoding"),
    K_NUM("model", "dropout", KEY_DOUBLE, "0.1", 0, 1, LOHI | HI_OPEN, model.dropout, "p_drop",
          "residual and MLP dropout"),
    K_ENUM("model", "objective", "clm", objective_names, model.objective, "loss",
           "clm: causal next byte; mlm: bidirectional, 15% of the bytes masked"),
    K_BOOL("model", "tie_embeddings", "true", model.tie_embeddings, "tie_weights weight_tying",
           "the output head shares the token embedding"),

    K_WORD("attention", "variant", "fma", variant_names, attention.variant, "type kind attention",
           "attention of every layer"),
    K_ENUM("attention", "heads_mode", "standard", heads_mode_names, attention.heads_mode, "fish",
           "standard, or fish (global query/key heads shared by the value heads)"),
    K_NUM("attention", "full.block", KEY_INT, "64", 8, 4096, LOHI, attention.full_block, "tile",
          "full: query/key tile size"),
    K_NUM("attention", "fma.m", KEY_INT, "64", 1, 65536, LOHI, attention.fma_m, "",
          "fma: fine block size m (model.context / m a power of two >= 2)"),
    K_NUM("attention", "fma.p", KEY_INT, "4", 1, 4096, LOHI, attention.fma_p, "rank",
          "fma: summaries per window p (divides fma.m)"),
    K_ENUM("attention", "fma.downsample", "conv", downsample_names, attention.fma_downsample, "",
           "fma: how windows are summarised (conv: the paper; m2m: hierarchical; avg: fixed)"),
    K_ENUM("attention", "fma.init", "mean", init_names, attention.fma_init, "",
           "fma: initial summary weights (mean: start as avg; random: uniform)"),
    K_ENUM("attention", "fma.down_lr", "scaled", down_lr_names, attention.fma_down_lr, "",
           "fma: summary weights learn at lr x p/taps (scaled) or at lr (plain)"),
    K_BOOL("attention", "fma.linear_zero_values", "true", attention.fma_linear_zero_values, "",
           "fma_linear: value summaries start at 0, far-field levels off until trained"),
    K_BOOL("attention", "fma.multiplicity", "true", attention.fma_multiplicity, "",
           "fma: add log(w/p) to coarse scores (a summary stands for w/p tokens)"),
    K_LIST("attention", "fma.open", "0", open_list, "open_k",
           "fma: far windows a query opens per level by content, down to exact tokens (0: none, "
           "the paper's fma; all: every one, = full attention)"),
    K_NUM("attention", "local.band", KEY_INT, "128", 1, 0, LO1, attention.local_band, "window",
          "local: band width in tokens"),
    K_NUM("attention", "fmmformer.band", KEY_INT, "64", 1, 0, LO1, attention.fmmformer_band, "",
          "fmmformer: band width of the near field"),
    K_LIST("attention", "fmmformer.kernels", "elu", kernels_list, "",
           "fmmformer: feature maps of the far field"),
    K_NUM("attention", "nystrom.landmarks", KEY_INT, "64", 1, 0, LO1, attention.nystrom_landmarks,
          "landmarks", "nystrom: landmarks, means of equal segments (divides model.context)"),
    K_NUM("attention", "nystrom.pinv_iters", KEY_INT, "6", 1, 100, LOHI,
          attention.nystrom_pinv_iters, "", "nystrom: iterations of the pseudo-inverse"),
    K_NUM("attention", "nystrom.conv", KEY_INT, "33", 0, 1025, LOHI | ODD_OR_ZERO,
          attention.nystrom_conv, "", "nystrom: depthwise convolution length on v (0: none)"),
    K_WORD("attention", "rmfa.kernel", "exp", rmfa_kernel_names, attention.rmfa_kernel, "",
           "rmfa: kernel whose Maclaurin series is sampled"),
    K_NUM("attention", "rmfa.features", KEY_INT, "64", 2, 65536, LOHI, attention.rmfa_features, "",
          "rmfa: random features D"),
    K_BOOL("attention", "rmfa.ppsbn", "true", attention.rmfa_ppsbn, "",
           "rmfa: pre- and post-scaling batch normalisation"),
    K_NUM("attention", "fish.global_heads", KEY_INT, "1", 1, 0, LO1, attention.fish_global_heads,
          "", "fish: global query/key heads G (< model.heads)"),
    K_WORD("attention", "fish.mix", "linear", fish_mix_names, attention.fish_mix, "",
           "fish: linear (hard FiSH) or mlp (GFiSH) mixing of global scores"),
    K_NUM("attention", "fish.noise", KEY_DOUBLE, "0", 0, 0, LO1, attention.fish_noise, "",
          "fish: noise scale on global scores, training only"),

    K_NUM("train", "steps", KEY_LONG, "1000", 0, 0, LO1, train.steps,
          "max_steps max_iters iters num_steps", "optimizer steps"),
    K_NUM("train", "batch", KEY_INT, "8", 1, 0, LO1, train.batch, "batch_size bs",
          "sequences per step, global (all ranks)"),
    K_NUM("train", "lr", KEY_DOUBLE, "3e-4", 0, 0, LO1 | LO_OPEN, train.lr, "learning_rate",
          "peak learning rate"),
    K_NUM("train", "min_lr", KEY_DOUBLE, "3e-5", 0, 0, LO1, train.min_lr,
          "min_learning_rate lr_min final_lr", "final learning rate (<= lr)"),
    K_NUM("train", "warmup", KEY_LONG, "100", 0, 0, LO1, train.warmup, "warmup_steps warmup_iters",
          "linear warm-up steps"),
    K_ENUM("train", "schedule", "cosine", schedule_names, train.schedule,
           "lr_schedule decay scheduler", "learning-rate decay after warm-up"),
    K_NUM("train", "weight_decay", KEY_DOUBLE, "0.01", 0, 0, LO1, train.weight_decay, "wd",
          "AdamW weight decay"),
    K_NUM("train", "beta1", KEY_DOUBLE, "0.9", 0, 1, LOHI | HI_OPEN, train.beta1, "",
          "AdamW beta1"),
    K_NUM("train", "beta2", KEY_DOUBLE, "0.99", 0, 1, LOHI | HI_OPEN, train.beta2, "",
          "AdamW beta2"),
    K_NUM("train", "eps", KEY_DOUBLE, "1e-8", 0, 0, LO1 | LO_OPEN, train.eps, "epsilon adam_eps",
          "AdamW epsilon"),
    K_NUM("train", "clip", KEY_DOUBLE, "1.0", 0, 0, LO1, train.clip,
          "grad_clip clip_grad max_grad_norm", "global gradient-norm clip (0: off)"),
    K_NUM("train", "eval_every", KEY_LONG, "200", 0, 0, LO1, train.eval_every, "eval_interval",
          "validation cadence in steps (0: only at the end)"),
    K_NUM("train", "eval_windows", KEY_INT, "64", 1, 0, LO1, train.eval_windows, "eval_iters",
          "contiguous windows per evaluation"),
    K_BOOL("train", "recompute", "false", train.recompute, "checkpointing activation_checkpointing",
           "recompute activations in backward (needed for very long n)"),

    K_TEXT("output", "dir", "runs", NONEMPTY, output.dir, "out_dir output_dir", "output directory"),
    K_NUM("output", "log_every", KEY_LONG, "10", 1, 0, LO1, output.log_every, "log_interval",
          "console and diag.h5 cadence in steps"),
    K_NUM("output", "diag_every", KEY_LONG, "100", 0, 0, LO1, output.diag_every, "",
          "attention diagnostics cadence (0: off)"),
    K_NUM("output", "checkpoint_every", KEY_LONG, "500", 0, 0, LO1, output.checkpoint_every,
          "save_every checkpoint_interval",
          "checkpoint cadence (0: only at the end and on SIGTERM/SIGUSR1)"),
    K_NUM("output", "keep", KEY_INT, "3", 1, 0, LO1, output.keep, "", "checkpoints kept"),
    K_TEXT("output", "restart", "", 0, output.restart, "resume init_from",
           "checkpoint to start from: a path, or latest (empty: a fresh start)"),

    K_NUM("parallel", "seq_ranks", KEY_INT, "1", 1, 0, LO1, parallel.seq_ranks, "sp",
          "ranks sharing one sequence; the world size must be a multiple"),
    K_ENUM("parallel", "backend", "auto", backend_names, parallel.backend, "",
           "communication (auto: nccl on GPUs, else mpi)"),
    K_ENUM("parallel", "device", "auto", device_names, parallel.device, "",
           "where to compute (auto: a GPU when fmattn was built --with-cuda and one is visible)"),
    K_ENUM("parallel", "precision", "fp32", precision_names, parallel.precision, "dtype",
           "matrix products on the GPU: fp32, or bf16 operands with fp32 accumulation"),
    K_BOOL("parallel", "overlap", "true", parallel.overlap, "",
           "hide communication: fma's LET fetch behind the near field, the gradient allreduce "
           "behind the backward (false: each blocking, where it is needed)"),
    K_BOOL("parallel", "balance", "true", parallel.balance, "",
           "causal fma: the busiest sequence ranks hand the far field of the levels every rank "
           "holds to the least busy (false: each rank evaluates its own slab's)"),
    K_ENUM("parallel", "alltoallv", "sparse", alltoallv_names, parallel.alltoallv, "",
           "the MPI transport's alltoallv exchanges (halo, LET, balance, fma.open's descent): "
           "sparse, a message to each rank with a part and none to the others; nbx, the same "
           "and fma.open's requests without an exchange of counts first; or mpi, "
           "MPI_Alltoallv/MPI_Ialltoallv"),

    K_BOOL("gpu", "debug", "false", gpu.debug, "",
           "wait for every kernel after its launch, so that a device fault names its kernel "
           "(slow: for finding a fault, not for runs)"),
    K_ENUM("gpu", "exact", "blocked", exact_names, gpu.exact, "",
           "full and local on the GPU: blocked (cuBLAS tiles) or reference (SIMT kernels; one "
           "sequence rank, head size 16, 32, 64 or 128)"),
    K_NUM("gpu", "exact_workspace_mb", KEY_INT, "256", 1, 1048576, LOHI, gpu.exact_workspace_mb, "",
          "MiB of device workspace per call of the blocked full/local attention"),
    K_NUM("gpu", "fma_workspace_mb", KEY_INT, "1024", 1, 1048576, LOHI, gpu.fma_workspace_mb, "",
          "MiB of device workspace per chunk of query blocks in fma's evaluation"),
    K_NUM("gpu", "outside_reserve_mb", KEY_INT, "1024", 0, 1048576, LOHI, gpu.outside_reserve_mb,
          "",
          "MiB of device memory the pool leaves to allocations outside it (NCCL, cuBLAS, other "
          "libraries): a growth that would leave less free first gives back what the pool holds "
          "unused (0: never)"),
    K_NUM("gpu", "nccl_timeout", KEY_DOUBLE, "45", 0, 86400, LOHI, gpu.nccl_timeout, "",
          "seconds an NCCL operation may run once started before its communicators are aborted "
          "and the job ends (a peer stopped or dead; 0: wait for ever)"),

    K_LIST("bench", "what", "attention,train", what_list, "", "what to time"),
    K_LIST("bench", "n_list", "1024,4096,16384", n_list, "n lengths",
           "sequence lengths of the sweep"),
    K_LIST("bench", "variants", "full,fma", variants_list, "", "attention variants of the sweep"),
    K_LIST("bench", "fma_open", "deck", bench_open_list, "open_list",
           "fma.open values timed for fma (each a row): integers >= 0, all, or deck (the deck's "
           "attention.fma.open)"),
    K_NUM("bench", "repeats", KEY_INT, "5", 1, 1000, LOHI, bench.repeats, "",
          "timed repetitions after one warm-up (the median is reported)"),
    K_NUM("bench", "batch", KEY_INT, "1", 1, 0, LO1, bench.batch, "",
          "sequences per timed attention call and per timed training step"),

    K_TEXT("generate", "prompt", "", 0, generate.prompt, "",
           "text the generation continues (a space before ; or # starts a comment)"),
    K_NUM("generate", "length", KEY_INT, "256", 1, 1048576, LOHI, generate.length, "max_new_tokens",
          "bytes to generate"),
    K_NUM("generate", "temperature", KEY_DOUBLE, "1.0", 0, 0, LO1 | LO_OPEN, generate.temperature,
          "temp", "sampling temperature"),
    K_NUM("generate", "top_k", KEY_INT, "0", 0, 0, LO1, generate.top_k, "topk",
          "sample among the k likeliest bytes (0: all)"),
    K_TEXT("generate", "prompt_file", "", 0, generate.prompt_file, "prompt_path",
           "file whose bytes are the prompt (instead of generate.prompt)"),
    K_NUM("generate", "samples", KEY_INT, "1", 1, 1000, LOHI, generate.samples, "num_samples",
          "independent samples from the prompt"),
    K_BOOL("generate", "cache", "true", generate.cache, "kv_cache use_cache",
           "decode with the attention caches (one token costs one token's work); false: recompute "
           "the context for every byte"),
    K_BOOL("generate", "record", "false", generate.record, "",
           "write every step's logits and byte to generate.h5 in the run directory"),
};

_Static_assert(sizeof config_keys / sizeof config_keys[0] == CONFIG_NKEYS,
               "CONFIG_NKEYS in config_keys.h must count the entries of config_keys");

int config_key_find(const char *section, const char *name) {
  for (int k = 0; k < CONFIG_NKEYS; k++)
    if (strcmp(config_keys[k].section, section) == 0 && strcmp(config_keys[k].name, name) == 0)
      return k;
  return -1;
}

/* "model.dim" → its index; only the first dot separates section and key (attention.fma.m). */
int config_key_find_qualified(const char *qualified) {
  const char *dot = strchr(qualified, '.');
  if (!dot) return -1;
  char section[64];
  snprintf(section, sizeof section, "%.*s", (int)(dot - qualified), qualified);
  return config_key_find(section, dot + 1);
}

/* ---------------------------------------------------------------------------------------------
 * Converting one value. */

void config_expected_text(const struct key_def *k, char *out, size_t len) {
  switch (k->type) {
    case KEY_INT:
    case KEY_LONG:
    case KEY_UINT64:
    case KEY_DOUBLE: {
      const char *noun = k->type == KEY_DOUBLE ? "a number" : "an integer";
      if ((k->flags & HAS_LO) && (k->flags & HAS_HI))
        snprintf(out, len, "%s in %c%.15g, %.15g%c%s", noun, k->flags & LO_OPEN ? '(' : '[', k->lo,
                 k->hi, k->flags & HI_OPEN ? ')' : ']',
                 k->flags & ODD_OR_ZERO ? " that is odd or 0" : "");
      else if (k->flags & HAS_LO)
        snprintf(out, len, "%s %s %.15g", noun, k->flags & LO_OPEN ? ">" : ">=", k->lo);
      else
        snprintf(out, len, "%s", noun);
      break;
    }
    case KEY_BOOL:
      snprintf(out, len, "true or false (or yes/no, on/off, 1/0)");
      break;
    case KEY_STRING:
      if (k->flags & NAME_CHARS)
        snprintf(out, len, "up to %zu letters, digits, '.', '_' or '-'", k->size - 1);
      else
        snprintf(out, len, "%s of at most %zu characters",
                 k->flags & NONEMPTY ? "a non-empty text" : "a text", k->size - 1);
      break;
    case KEY_CHOICE: {
      char words[512];
      config_join_words(k->choices, words, sizeof words);
      snprintf(out, len, "one of %s", words);
      break;
    }
    case KEY_LIST:
      if (k->list->words) {
        char words[512];
        config_join_words(k->list->words, words, sizeof words);
        snprintf(out, len, "a comma list of %s", words);
      } else {
        snprintf(out, len, "%s", k->list->expected);
      }
      break;
  }
}

static bool outside(const struct key_def *k, double v) {
  if (k->flags & HAS_LO && ((k->flags & LO_OPEN) ? v <= k->lo : v < k->lo)) return true;
  if (k->flags & HAS_HI && ((k->flags & HI_OPEN) ? v >= k->hi : v > k->hi)) return true;
  return false;
}

/* Splits a comma list into trimmed items. Returns the count, or -1 with the reason in detail. */
static int list_split(const char *text, char items[][LIST_ITEM], char *detail, size_t len) {
  char copy[CONFIG_LIST_MAX * LIST_ITEM + 64];
  if (strlen(text) >= sizeof copy) {
    snprintf(detail, len, "; the list is too long");
    return -1;
  }
  strcpy(copy, text);
  if (!*config_trim(copy)) {
    snprintf(detail, len, "; the list is empty");
    return -1;
  }
  int n = 0;
  for (char *item = copy;;) {
    char *comma = strchr(item, ',');
    if (comma) *comma = '\0';
    char *word = config_trim(item);
    if (!*word) {
      snprintf(detail, len, "; item %d is empty", n + 1);
      return -1;
    }
    if (n == CONFIG_LIST_MAX) {
      snprintf(detail, len, "; more than %d items", CONFIG_LIST_MAX);
      return -1;
    }
    if (strlen(word) >= LIST_ITEM) {
      snprintf(detail, len, "; item '%.20s...' is too long", word);
      return -1;
    }
    strcpy(items[n++], word);
    if (!comma) return n;
    item = comma + 1;
  }
}

/* KEY_INT and KEY_LONG: a strict integer in k's range (and odd or zero when flagged). */
static int convert_integer(const struct key_def *k, const char *text, void *field, char *detail,
                           size_t len) {
  long long v;
  const int rc = config_parse_integer(text, &v);
  const long long top = k->type == KEY_INT ? INT_MAX : LONG_MAX;
  if (rc < 0) return CONVERT_BAD;
  if (rc > 0 || outside(k, (double)v) || v > top || v < -top) {
    if (!(k->flags & HAS_HI) && rc == 0 && !outside(k, (double)v))
      snprintf(detail, len, " (at most %lld)", top);
    return CONVERT_RANGE;
  }
  if (k->flags & ODD_OR_ZERO && v != 0 && v % 2 == 0) return CONVERT_BAD;
  if (k->type == KEY_INT)
    *(int *)field = (int)v;
  else
    *(long *)field = (long)v;
  return CONVERT_OK;
}

/* KEY_UINT64 (the seed): digits only — strtoull would take "-1" as 2^64 − 1. */
static int convert_uint64(const char *text, void *field) {
  char *end;
  errno = 0;
  const unsigned long long v = strtoull(text, &end, 10);
  if (!isdigit((unsigned char)text[0]) || *end) return CONVERT_BAD;
  if (errno == ERANGE) return CONVERT_RANGE;
  *(uint64_t *)field = (uint64_t)v;
  return CONVERT_OK;
}

static int convert_double(const struct key_def *k, const char *text, void *field) {
  double v;
  const int rc = config_parse_number(text, &v);
  if (rc < 0) return CONVERT_BAD;
  if (rc > 0 || outside(k, v)) return CONVERT_RANGE;
  *(double *)field = v;
  return CONVERT_OK;
}

static int convert_bool(const char *text, void *field) {
  static const char *const yes[] = {"true", "yes", "on", "1", NULL};
  static const char *const no[] = {"false", "no", "off", "0", NULL};
  if (config_name_index(yes, text) >= 0)
    *(bool *)field = true;
  else if (config_name_index(no, text) >= 0)
    *(bool *)field = false;
  else
    return CONVERT_BAD;
  return CONVERT_OK;
}

/* KEY_STRING: fits the field; run.name also as a directory name. */
static int convert_string(const struct key_def *k, const char *text, void *field) {
  const size_t n = strlen(text);
  bool ok = n < k->size && !(k->flags & NONEMPTY && n == 0);
  if (ok && k->flags & NAME_CHARS) {
    for (size_t i = 0; i < n; i++)
      if (!isalnum((unsigned char)text[i]) && !strchr("._-", text[i])) ok = false;
    /* "." and ".." would put outputs beside or above output.dir. */
    if (strcmp(text, ".") == 0 || strcmp(text, "..") == 0) ok = false;
  }
  if (!ok) return CONVERT_BAD;
  memset(field, 0, k->size); /* zeroed tails keep configs comparable with memcmp */
  memcpy(field, text, n);
  return CONVERT_OK;
}

/* KEY_CHOICE: one of k's words, kept as its enum value or (k->size) as the word. */
static int convert_choice(const struct key_def *k, const char *text, void *field, char *detail,
                          size_t len) {
  const int i = config_name_index(k->choices, text);
  if (i < 0) {
    config_suggest_word(k->choices, text, detail, len);
    return CONVERT_BAD;
  }
  if (k->size) {
    memset(field, 0, k->size);
    snprintf(field, k->size, "%s", k->choices[i]);
  } else {
    *(int *)field = i;
  }
  return CONVERT_OK;
}

/* KEY_LIST: items of the list's words (or numbers), stored by the list's own function. */
static int convert_list(const struct key_def *k, const char *text, struct config *cfg, char *detail,
                        size_t len) {
  char items[CONFIG_LIST_MAX][LIST_ITEM];
  const int n = list_split(text, items, detail, len);
  if (n < 0) return CONVERT_BAD;
  for (int i = 0; k->list->words && i < n; i++) {
    if (config_name_index(k->list->words, items[i]) >= 0) continue;
    char hint[128];
    config_suggest_word(k->list->words, items[i], hint, sizeof hint);
    snprintf(detail, len, "; '%s' is not one%s", items[i], hint);
    return CONVERT_BAD;
  }
  return k->list->store(cfg, items, n, detail, len) ? CONVERT_BAD : CONVERT_OK;
}

/* Converts text into k's field of cfg. On failure returns CONVERT_BAD or CONVERT_RANGE and writes
 * the message after the location ("train.lr = 'abc': expected a number > 0") into msg. */
int config_key_convert(const struct key_def *k, const char *text, struct config *cfg, char *msg,
                       size_t len) {
  void *field = (char *)cfg + k->offset;
  char detail[256] = "";
  int status = CONVERT_OK;
  switch (k->type) {
    case KEY_INT:
    case KEY_LONG:
      status = convert_integer(k, text, field, detail, sizeof detail);
      break;
    case KEY_UINT64:
      status = convert_uint64(text, field);
      break;
    case KEY_DOUBLE:
      status = convert_double(k, text, field);
      break;
    case KEY_BOOL:
      status = convert_bool(text, field);
      break;
    case KEY_STRING:
      status = convert_string(k, text, field);
      break;
    case KEY_CHOICE:
      status = convert_choice(k, text, field, detail, sizeof detail);
      break;
    case KEY_LIST:
      status = convert_list(k, text, cfg, detail, sizeof detail);
      break;
  }
  if (status == CONVERT_OK) return CONVERT_OK;
  char expected[600];
  config_expected_text(k, expected, sizeof expected);
  if (status == CONVERT_BAD)
    snprintf(msg, len, "%s.%s = '%s': expected %s%s", k->section, k->name, text, expected, detail);
  else
    snprintf(msg, len, "%s.%s = %s is out of range: expected %s%s", k->section, k->name, text,
             expected, detail);
  return status;
}

/* The value of k in cfg as deck text: the resolved deck writes this, config_from_text reads it. */
void config_key_format(const struct key_def *k, const struct config *cfg, char *out, size_t len) {
  const void *field = (const char *)cfg + k->offset;
  switch (k->type) {
    case KEY_INT:
      snprintf(out, len, "%d", *(const int *)field);
      break;
    case KEY_LONG:
      snprintf(out, len, "%ld", *(const long *)field);
      break;
    case KEY_UINT64:
      snprintf(out, len, "%llu", (unsigned long long)*(const uint64_t *)field);
      break;
    case KEY_DOUBLE:
      config_format_double(*(const double *)field, out, len);
      break;
    case KEY_BOOL:
      snprintf(out, len, "%s", *(const bool *)field ? "true" : "false");
      break;
    case KEY_STRING:
      snprintf(out, len, "%s", (const char *)field);
      break;
    case KEY_CHOICE:
      snprintf(out, len, "%s", k->size ? (const char *)field : k->choices[*(const int *)field]);
      break;
    case KEY_LIST:
      k->list->format(cfg, out, len);
      break;
  }
}

/* ---------------------------------------------------------------------------------------------
 * Comma lists. */

static int store_split(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                       size_t len) {
  if (n != 3) {
    snprintf(detail, len, "; got %d item%s", n, n == 1 ? "" : "s");
    return 1;
  }
  double v[3], sum = 0;
  bool fractions = true, whole = true;
  for (int i = 0; i < 3; i++) {
    if (config_parse_number(items[i], &v[i]) != 0 || v[i] < 0) {
      snprintf(detail, len, "; '%s' is not a number >= 0", items[i]);
      return 1;
    }
    sum += v[i];
    if (v[i] > 1) fractions = false;
    if (v[i] != floor(v[i]) || v[i] > 9007199254740992.0) whole = false; /* exact up to 2^53 */
  }
  fractions = fractions && fabs(sum - 1) <= 1e-6;
  if (!fractions && !whole) {
    if (sum <= 3 && v[0] <= 1 && v[1] <= 1 && v[2] <= 1)
      snprintf(detail, len, "; these fractions sum to %.15g, not 1", sum);
    else
      snprintf(detail, len, "; it mixes fractions and byte counts");
    return 1;
  }
  for (int i = 0; i < 3; i++) cfg->data.split[i] = v[i];
  cfg->data.split_is_bytes = !fractions;
  return 0;
}

void config_format_split(const struct config *cfg, char *out, size_t len) {
  char v[3][32];
  for (int i = 0; i < 3; i++) config_format_double(cfg->data.split[i], v[i], sizeof v[i]);
  snprintf(out, len, "%s,%s,%s", v[0], v[1], v[2]);
}

static int store_what(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                      size_t len) {
  (void)detail, (void)len;
  cfg->bench.what = 0;
  for (int i = 0; i < n; i++)
    cfg->bench.what |= 1u << config_name_index(bench_what_names, items[i]);
  return 0;
}

static void format_what(const struct config *cfg, char *out, size_t len) {
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; bench_what_names[i]; i++)
    if (cfg->bench.what & (1u << i))
      used +=
          (size_t)snprintf(out + used, len - used, "%s%s", used ? "," : "", bench_what_names[i]);
}

static int store_n_list(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                        size_t len) {
  for (int i = 0; i < n; i++) {
    long long v;
    if (config_parse_integer(items[i], &v) != 0 || v < 2 || v > LONG_MAX) {
      snprintf(detail, len, "; '%s' is not an integer >= 2", items[i]);
      return 1;
    }
    cfg->bench.n_list[i] = (long)v;
  }
  cfg->bench.n_count = n;
  for (int i = n; i < CONFIG_LIST_MAX; i++) cfg->bench.n_list[i] = 0;
  return 0;
}

static void format_n_list(const struct config *cfg, char *out, size_t len) {
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; i < cfg->bench.n_count && used < len; i++)
    used += (size_t)snprintf(out + used, len - used, "%s%ld", i ? "," : "", cfg->bench.n_list[i]);
}

/* The canonical spelling of each word, and no word twice. */
static int canonical_words(const char *const *words, char items[][LIST_ITEM], int n, char *detail,
                           size_t len) {
  for (int i = 0; i < n; i++) {
    snprintf(items[i], LIST_ITEM, "%s", words[config_name_index(words, items[i])]);
    for (int j = 0; j < i; j++)
      if (strcmp(items[i], items[j]) == 0) {
        snprintf(detail, len, "; '%s' is given twice", items[i]);
        return 1;
      }
  }
  return 0;
}

static int store_variants(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                          size_t len) {
  if (canonical_words(variant_names, items, n, detail, len)) return 1;
  memset(cfg->bench.variants, 0, sizeof cfg->bench.variants);
  for (int i = 0; i < n; i++) memcpy(cfg->bench.variants[i], items[i], strlen(items[i]));
  cfg->bench.variant_count = n;
  return 0;
}

static void format_variants(const struct config *cfg, char *out, size_t len) {
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; i < cfg->bench.variant_count && used < len; i++)
    used += (size_t)snprintf(out + used, len - used, "%s%s", i ? "," : "", cfg->bench.variants[i]);
}

static int store_kernels(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                         size_t len) {
  if (canonical_words(kernel_names, items, n, detail, len)) return 1;
  char *out = cfg->attention.fmmformer_kernels;
  size_t size = sizeof cfg->attention.fmmformer_kernels, used = 0;
  memset(out, 0, size);
  for (int i = 0; i < n; i++)
    used += (size_t)snprintf(out + used, size - used, "%s%s", i ? "," : "", items[i]);
  return 0;
}

static void format_kernels(const struct config *cfg, char *out, size_t len) {
  snprintf(out, len, "%s", cfg->attention.fmmformer_kernels);
}

/* data.passkey.depth and .length: one fraction (the same for every sample) or a range lo,hi. */
static int store_range(double *range, char items[][LIST_ITEM], int n, char *detail, size_t len) {
  if (n > 2) {
    snprintf(detail, len, "; got %d items", n);
    return 1;
  }
  double v[2];
  for (int i = 0; i < n; i++)
    if (config_parse_number(items[i], &v[i]) != 0 || v[i] < 0 || v[i] > 1) {
      snprintf(detail, len, "; '%s' is not a number in [0, 1]", items[i]);
      return 1;
    }
  if (n == 1) v[1] = v[0];
  if (v[0] > v[1]) {
    snprintf(detail, len, "; lo > hi");
    return 1;
  }
  range[0] = v[0];
  range[1] = v[1];
  return 0;
}

static void format_range(const double *range, char *out, size_t len) {
  char lo[32], hi[32];
  config_format_double(range[0], lo, sizeof lo);
  config_format_double(range[1], hi, sizeof hi);
  if (range[0] == range[1])
    snprintf(out, len, "%s", lo);
  else
    snprintf(out, len, "%s,%s", lo, hi);
}

static int store_depth(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                       size_t len) {
  return store_range(cfg->data.passkey_depth, items, n, detail, len);
}

/* One fma.open value of a list: an integer >= 0, all, or (when deck_ok) deck. */
static int parse_open(const char *item, bool deck_ok, int *out) {
  long long v;
  if (strcasecmp(item, "all") == 0)
    *out = FMA_OPEN_ALL;
  else if (deck_ok && strcasecmp(item, "deck") == 0)
    *out = BENCH_OPEN_DECK;
  else if (config_parse_integer(item, &v) == 0 && v >= 0 && v <= 1000000)
    *out = (int)v;
  else
    return 1;
  return 0;
}

/* attention.fma.open: one integer >= 0, or `all` (every candidate window: SPEC §6.4a). */
static int store_open(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                      size_t len) {
  if (n != 1) {
    snprintf(detail, len, "; give one value, not %d", n);
    return 1;
  }
  if (parse_open(items[0], false, &cfg->attention.fma_open)) {
    snprintf(detail, len, "; '%s' is neither an integer >= 0 nor all", items[0]);
    return 1;
  }
  return 0;
}

static int store_bench_open(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                            size_t len) {
  for (int i = 0; i < n; i++)
    if (parse_open(items[i], true, &cfg->bench.fma_open[i])) {
      snprintf(detail, len, "; '%s' is not an integer >= 0, all or deck", items[i]);
      return 1;
    }
  cfg->bench.fma_open_count = n;
  return 0;
}

static void format_bench_open(const struct config *cfg, char *out, size_t len) {
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; i < cfg->bench.fma_open_count && used < len; i++) {
    const int k = cfg->bench.fma_open[i];
    const char *sep = i ? "," : "";
    int w = k == FMA_OPEN_ALL      ? snprintf(out + used, len - used, "%sall", sep)
            : k == BENCH_OPEN_DECK ? snprintf(out + used, len - used, "%sdeck", sep)
                                   : snprintf(out + used, len - used, "%s%d", sep, k);
    used += w > 0 ? (size_t)w : 0;
  }
}

static void format_open(const struct config *cfg, char *out, size_t len) {
  if (cfg->attention.fma_open == FMA_OPEN_ALL)
    snprintf(out, len, "all");
  else
    snprintf(out, len, "%d", cfg->attention.fma_open);
}

static void format_depth(const struct config *cfg, char *out, size_t len) {
  format_range(cfg->data.passkey_depth, out, len);
}

static int store_length(struct config *cfg, char items[][LIST_ITEM], int n, char *detail,
                        size_t len) {
  return store_range(cfg->data.passkey_length, items, n, detail, len);
}

static void format_length(const struct config *cfg, char *out, size_t len) {
  format_range(cfg->data.passkey_length, out, len);
}

const char *config_mode_name(enum run_mode m) {
  return (unsigned)m < sizeof mode_names / sizeof mode_names[0] - 1 ? mode_names[m] : "?";
}

const char *config_position_name(enum position_kind p) {
  return (unsigned)p < sizeof position_names / sizeof position_names[0] - 1 ? position_names[p]
                                                                            : "?";
}

const char *config_downsample_name(enum fma_downsample d) {
  return (unsigned)d < sizeof downsample_names / sizeof downsample_names[0] - 1
             ? downsample_names[d]
             : "?";
}

const char *config_source_name(enum data_source s) {
  return (unsigned)s < sizeof source_names / sizeof source_names[0] - 1 ? source_names[s] : "?";
}

const char *config_device_name(enum device_kind d) {
  return (unsigned)d < sizeof device_names / sizeof device_names[0] - 1 ? device_names[d] : "?";
}
