/* The resolved run configuration: every deck key of SPEC §3 as a typed field. A deck is parsed and
 * validated once, on rank 0 (config_load), then broadcast as resolved deck text that the other
 * ranks parse again (both in config_load_collective); no rank ever sees an unvalidated
 * configuration. This module knows keys, types, ranges and cross-key rules; it does not open data
 * files other than to check them. */
#ifndef FMATTN_CONFIG_H
#define FMATTN_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fma/options.h" /* enum fma_downsample, fma_init_kind, fma_down_lr */

#ifdef __cplusplus
extern "C" {
#endif

#define CONFIG_STR      512
#define CONFIG_LIST_MAX 32
/* bench.fma_open's item `deck`: the deck's own attention.fma.open. */
#define BENCH_OPEN_DECK (-2)

/* Bytes of the err buffer that callers pass to config_load, config_from_text and
 * config_check_layout: size it with this, and no message is cut short. */
#define CONFIG_ERR_LEN 4096

enum run_mode { MODE_TRAIN, MODE_EVAL, MODE_GENERATE, MODE_BENCH };
enum data_source {
  SOURCE_FILE,
  SOURCE_COPY,
  SOURCE_MAJORITY,
  SOURCE_TASK,    /* an HDF5 task file (docs/tasks.md) */
  SOURCE_MQAR,    /* multi-query associative recall */
  SOURCE_PASSKEY, /* a digit string inside filler, asked for at the end */
  SOURCE_LISTOPS  /* LRA ListOps: nested MAX, MIN, MED, SM; the answer digit */
};
/* Where MQAR's queries go after its key-value pairs. */
enum mqar_spread { MQAR_COMPACT, MQAR_UNIFORM, MQAR_LOG };
enum position_kind { POSITION_LEARNED, POSITION_SINUSOIDAL, POSITION_ROPE, POSITION_NONE };
enum objective_kind { OBJECTIVE_CLM, OBJECTIVE_MLM };
enum schedule_kind { SCHEDULE_COSINE, SCHEDULE_LINEAR, SCHEDULE_CONSTANT };
enum backend_kind { BACKEND_AUTO, BACKEND_MPI, BACKEND_NCCL };
enum alltoallv_kind { ALLTOALLV_SPARSE, ALLTOALLV_MPI, ALLTOALLV_NBX };
enum device_kind { DEVICE_AUTO, DEVICE_CPU, DEVICE_GPU };
enum precision_kind { PRECISION_FP32, PRECISION_BF16 };
enum exact_kernels { EXACT_BLOCKED, EXACT_REFERENCE }; /* gpu.exact */
enum heads_mode { HEADS_STANDARD, HEADS_FISH };

/* Bench sections, as a bit set. */
enum bench_what { BENCH_ATTENTION = 1, BENCH_TRAIN = 2, BENCH_COMM = 4, BENCH_GENERATE = 8 };

struct config_run {
  char name[CONFIG_STR];
  enum run_mode mode;
  uint64_t seed;
};

struct config_data {
  enum data_source source;
  char path[CONFIG_STR];
  double split[3];              /* fractions (sum 1) or byte counts, as given */
  bool split_is_bytes;          /* true when the split was given in bytes */
  int symbols;                  /* synthetic tasks: alphabet size */
  int copy_len;                 /* copy task: symbols before the separator (0: as many as fit) */
  char export_path[CONFIG_STR]; /* data.export: write the run's samples as a task file ("") */
  int mqar_pairs;               /* data.mqar.pairs: key-value pairs */
  int mqar_queries;             /* data.mqar.queries: keys asked for (0: every pair) */
  enum mqar_spread mqar_spread; /* data.mqar.spread */
  bool mqar_one_hop;            /* data.mqar.one_hop: a pair is one byte */
  int passkey_digits;           /* data.passkey.digits */
  bool passkey_one_hop;         /* data.passkey.one_hop: digits carry their index */
  double passkey_depth[2];      /* data.passkey.depth: the needle's depth drawn in [lo, hi] */
  double passkey_length[2];     /* data.passkey.length: the haystack's share of the sample */
  int listops_max_args, listops_max_depth, listops_min_length; /* data.listops.* */
};

struct config_model {
  int layers;
  int dim;
  int heads;
  int mlp_ratio;
  int context;
  enum position_kind position;
  double dropout;
  enum objective_kind objective;
  bool tie_embeddings;
};

struct config_attention {
  char variant[64];
  enum heads_mode heads_mode;
  int full_block; /* full.block: query/key tile size */
  int fma_m;      /* fma.m: fine block */
  int fma_p;      /* fma.p: summaries per window */
  enum fma_downsample fma_downsample;
  enum fma_init_kind fma_init;
  enum fma_down_lr fma_down_lr;
  bool fma_linear_zero_values;
  bool fma_multiplicity;
  int fma_open; /* fma.open: windows opened per level (FMA_OPEN_ALL: every candidate) */
  int local_band;
  int fmmformer_band;
  char fmmformer_kernels[CONFIG_STR];
  int nystrom_landmarks;
  int nystrom_pinv_iters;
  int nystrom_conv;
  char rmfa_kernel[32];
  int rmfa_features;
  bool rmfa_ppsbn;
  /* Not a deck key: the rows of rmfa's omega when the features are not the run seed's draw (a
   * kernel file carrying its own, attn_variant.adopt_shape); 0: the seed's draw. */
  int rmfa_omega_rows;
  int fish_global_heads;
  char fish_mix[32];
  double fish_noise;
};

struct config_train {
  long steps;
  int batch;
  double lr, min_lr;
  long warmup;
  enum schedule_kind schedule;
  double weight_decay, beta1, beta2, eps, clip;
  long eval_every;
  int eval_windows;
  bool recompute;
};

struct config_output {
  char dir[CONFIG_STR];
  long log_every;
  long diag_every;
  long checkpoint_every;
  int keep;
  char restart[CONFIG_STR];
};

struct config_parallel {
  int seq_ranks;
  enum backend_kind backend;
  enum device_kind device;
  enum precision_kind precision; /* of the GPU's matrix products */
  bool overlap;                  /* communication behind computation where it can be */
  bool balance;                  /* causal fma's work balanced across sequence ranks */
  enum alltoallv_kind alltoallv; /* MPI's alltoallvs: point to point (fma.open's requests after
                                  * an exchange of counts, or by NBX), or MPI_Alltoallv */
};

/* The CUDA back end's options (read by src/model/backend.c into gpu/'s struct gpu_options). */
struct config_gpu {
  bool debug;               /* wait after every launch; a fault names its kernel */
  enum exact_kernels exact; /* full and local: the blocked form (cuBLAS) or the SIMT reference */
  int exact_workspace_mb;   /* the blocked exact attention's workspace per call */
  int fma_workspace_mb;     /* fma's evaluate: the workspace of one chunk of query blocks */
  int outside_reserve_mb;   /* device memory the pool leaves free for allocations outside it */
  double nccl_timeout;      /* seconds an NCCL operation may run before the watchdog ends it */
};

struct config_bench {
  unsigned what; /* enum bench_what bits */
  int n_count;
  long n_list[CONFIG_LIST_MAX];
  int variant_count;
  char variants[CONFIG_LIST_MAX][64];
  int fma_open_count; /* bench.fma_open: the fma.open values of variants that open windows */
  int fma_open[CONFIG_LIST_MAX]; /* FMA_OPEN_ALL, or BENCH_OPEN_DECK: attention.fma.open */
  int repeats;
  int batch; /* sequences per timed attention call and per timed training step */
};

struct config_generate {
  char prompt[CONFIG_STR];
  int length;
  double temperature;
  int top_k;
  char prompt_file[CONFIG_STR];
  int samples;
  bool cache;
  bool record;
};

struct config {
  struct config_run run;
  struct config_data data;
  struct config_model model;
  struct config_attention attention;
  struct config_train train;
  struct config_output output;
  struct config_parallel parallel;
  struct config_gpu gpu;
  struct config_bench bench;
  struct config_generate generate;

  char deck_path[CONFIG_STR]; /* the deck file given on the command line ("" for defaults) */
  char *resolved;             /* resolved deck text: every key, defaults filled in (owned) */
};

/* Overrides from the command line: "section.key=value" strings. */
struct config_overrides {
  int count;
  const char *items[64];
};

/* Parse and validate a deck with its overrides. On success returns 0 and fills *cfg; on failure
 * returns non-zero and writes one message (file:line, key, what was expected, a suggestion for a
 * misspelt key) into err. No MPI, no output. deck_path may be NULL for the built-in defaults. */
int config_load(struct config *cfg, const char *deck_path, const struct config_overrides *ov,
                char *err, size_t err_len);

/* A rule another module owns (the tasks' task_deck_rule, the attention variants'
 * attention_deck_rule): given a configuration that passed the deck's own rules, true when it
 * refuses it, with the deck keys at fault in keys (space separated) and the reason in msg.
 * config_load reports it where the last of those keys was set. Rules run in the order added, each
 * while no earlier one has refused (the first refusal is the one reported); add them before
 * loading (main does). Adding a rule twice adds it once. */
typedef bool (*config_rule_fn)(const struct config *cfg, char *keys, size_t keys_len, char *msg,
                               size_t msg_len);
void config_add_rule(config_rule_fn rule);
/* Whether "section.key" is a deck key. */
bool config_key_exists(const char *qualified);
/* Parse resolved deck text (as produced by config_load) into cfg; used by the non-root ranks and
 * when a checkpoint's deck is read back. Returns 0 on success. cfg->deck_path is left empty
 * (config_load_collective sets it afterwards), and cfg->resolved is a copy of text exactly as
 * given, not re-generated, so a deck read back is written out again byte for byte. The data file is
 * not checked again. */
int config_from_text(struct config *cfg, const char *text, char *err, size_t err_len);

/* Rank 0 loads and validates; every rank receives the result. On a deck error every rank exits
 * with status 1 after rank 0 prints the message. Collective over MPI_COMM_WORLD. */
void config_load_collective(struct config *cfg, const char *deck_path,
                            const struct config_overrides *ov);

/* Checks that depend on the rank count (divisibility of batch and context by the layout). Returns
 * 0 when consistent, else writes a message into err. */
int config_check_layout(const struct config *cfg, int world_size, char *err, size_t err_len);

/* Print a complete, commented deck with every key at its default. */
void config_print_defaults(FILE *out);

/* Free what config_load allocated. */
void config_free(struct config *cfg);

/* Names for the enums, for messages and HDF5 attributes. */
const char *config_mode_name(enum run_mode m);
const char *config_position_name(enum position_kind p);
const char *config_downsample_name(enum fma_downsample d);
const char *config_device_name(enum device_kind d);
const char *config_source_name(enum data_source s);

/* Vocabulary size implied by the objective: 256 bytes, plus the mask symbol for mlm. */
int config_vocab(const struct config *cfg);

#ifdef __cplusplus
}
#endif

#endif
