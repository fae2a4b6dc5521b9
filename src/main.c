/* fmattn: the command line (SPEC §2). Parses arguments, brings up MPI and threads, validates the
 * deck once on rank 0 and shares it, checks the layout and the attention variant against the rank
 * count — all before anything is written — then runs the mode. No numerics here. */
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "core/blascore.h"
#include "core/error.h"
#include "core/threads.h"
#include "deck/config.h"
#include "model/backend.h"
#include "parallel/comm.h"
#include "parallel/simsample.h"
#include "run/bench.h"
#include "run/eval.h"
#include "run/generate.h"
#include "run/kernel_file.h"
#include "run/train.h"

static void usage(FILE *out) {
  fprintf(out,
          "usage:\n"
          "  fmattn DECK.in [--set section.key=value ...]   run the job the deck describes\n"
          "  fmattn --print-defaults                         print a complete deck with every key\n"
          "  fmattn --check DECK.in [--set ...]              validate a deck, print the resolved "
          "configuration\n"
          "  fmattn kernel IN.h5 OUT.h5                      one attention op forward+backward\n"
          "  fmattn --version | --help\n"
          "Run with `mpirun -n P fmattn ...` for P ranks; a plain `fmattn ...` is one rank.\n"
          "See README.md for the deck reference and output files.\n");
}

/* Deck-level checks that need the rank count or the attention registry; every rank evaluates
 * them identically, so the error exit is collective. */
static void check_runnable(const struct config *cfg, int world, bool check_only) {
  char err[CONFIG_ERR_LEN];
  /* A plain `fmattn --check` of a deck written for a sequence-parallel job cannot know the rank
   * count it will run with: it says so instead of refusing the deck. */
  if (check_only && world == 1 && cfg->parallel.seq_ranks > 1) {
    if (error_rank() <= 0)
      printf(
          "; layout not checked: parallel.seq_ranks = %d needs mpirun -n <a multiple of %d>; "
          "run --check under mpirun to check it\n",
          cfg->parallel.seq_ranks, cfg->parallel.seq_ranks);
  } else if (config_check_layout(cfg, world, err, sizeof err)) {
    error_collective(err);
  }
  long n = cfg->model.context;
  if (cfg->run.mode != MODE_BENCH &&
      attention_check(cfg, n, cfg->parallel.seq_ranks, err, sizeof err))
    error_collective(err);
  const struct backend *be = backend_for(cfg, err, sizeof err);
  if (!be || backend_check(be, cfg, world, err, sizeof err)) error_collective(err);
  const struct attn_variant *v = attention_select(cfg);
  if (v && !attention_impl(v, be->device)) {
    snprintf(err, sizeof err,
             "attention.variant = %s has no implementation on the %s back end "
             "(parallel.device = %s)",
             cfg->attention.variant, be->name, config_device_name(cfg->parallel.device));
    error_collective(err);
  }
  if (v && attention_impl_refuses(v, be->device, cfg, err, sizeof err)) error_collective(err);
}

/* `fmattn [--check] DECK.in [--set section.key=value ...]`: the deck, whether only to check it,
 * and the overrides. A bad command line ends the job (on every rank). */
static const char *parse_deck_args(int argc, char **argv, bool *check_only,
                                   struct config_overrides *ov) {
  int argi = 1;
  if (strcmp(argv[1], "--check") == 0) {
    *check_only = true;
    argi = 2;
  }
  const char *deck = NULL;
  for (; argi < argc; argi++) {
    const bool set_split = strcmp(argv[argi], "--set") == 0;
    if (set_split || strncmp(argv[argi], "--set=", 6) == 0) {
      if (set_split && argi + 1 >= argc) error_collective("--set needs section.key=value");
      if (ov->count == (int)(sizeof ov->items / sizeof ov->items[0]))
        error_collective("too many --set options (at most 64)");
      ov->items[ov->count++] = set_split ? argv[++argi] : argv[argi] + 6;
    } else if (argv[argi][0] == '-') {
      char msg[256];
      snprintf(msg, sizeof msg, "unknown option '%s' (see fmattn --help)", argv[argi]);
      error_collective(msg);
    } else if (!deck) {
      deck = argv[argi];
    } else {
      char msg[256];
      snprintf(msg, sizeof msg, "more than one deck given ('%s' and '%s')", deck, argv[argi]);
      error_collective(msg);
    }
  }
  if (!deck) error_collective("no deck given (usage: fmattn DECK.in; see fmattn --help)");
  return deck;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
    usage(stdout);
    return 0;
  }
  if (strcmp(argv[1], "--version") == 0) {
#ifdef FMATTN_SMPI
    printf("fmattn %s (SimGrid SMPI build)\n", PACKAGE_VERSION);
#else
    printf("fmattn %s\n", PACKAGE_VERSION);
#endif
    return 0;
  }
  if (strcmp(argv[1], "--print-defaults") == 0) {
    config_print_defaults(stdout);
    return 0;
  }

  blas_core_check(argv); /* may run fmattn again with OPENBLAS_CORETYPE set: before MPI starts */
  MPI_CHECK(MPI_Init(&argc, &argv));
  int rank, world;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  error_set_rank(rank, world);
  sim_sample_open(MPI_COMM_WORLD); /* simulations only (simsample.h) */
  if (blas_core_note()[0] && rank == 0) {
    if (blas_core_corrected_from())
      message("%s", blas_core_note());
    else
      warning("%s", blas_core_note());
  }
  H5Eset_auto2(H5E_DEFAULT, NULL, NULL); /* fmattn reports HDF5 failures itself */

  if (strcmp(argv[1], "kernel") == 0) {
    if (argc != 4) {
      if (rank == 0) usage(stderr);
      error_collective("usage: fmattn kernel IN.h5 OUT.h5");
    }
    threads_setup(MPI_COMM_WORLD);
    int rc = kernel_file_run(argv[2], argv[3]);
    MPI_Finalize();
    return rc;
  }

  bool check_only = false;
  struct config_overrides ov = {0};
  const char *deck = parse_deck_args(argc, argv, &check_only, &ov);

  struct config cfg;
  config_add_rule(task_deck_rule); /* the tasks' rules, then the variants', at their keys */
  config_add_rule(attention_deck_rule);
  config_load_collective(&cfg, deck, &ov);
  check_runnable(&cfg, world, check_only);
  if (check_only) {
    if (rank == 0) {
      fputs(cfg.resolved, stdout);
      printf("; deck is valid for %d rank(s)\n", world);
    }
    config_free(&cfg);
    MPI_Finalize();
    return 0;
  }

  threads_setup(MPI_COMM_WORLD);
  struct comm comm;
  comm_init(&comm, cfg.parallel.seq_ranks);
  comm.overlap = cfg.parallel.overlap;
  comm.balance = cfg.parallel.balance;
  comm.sparse = cfg.parallel.alltoallv != ALLTOALLV_MPI;
  comm.nbx = cfg.parallel.alltoallv == ALLTOALLV_NBX;
  char err[CONFIG_ERR_LEN];
  const struct backend *be = backend_for(&cfg, err, sizeof err);
  if (!be) error_collective(err);
  backend_attach_comm(be, &comm);
  if (rank == 0) {
    printf("; fmattn %s resolved deck\n", PACKAGE_VERSION);
    fputs(cfg.resolved, stdout);
    fflush(stdout);
  }
  int rc = 0;
  switch (cfg.run.mode) {
    case MODE_TRAIN:
      rc = train_run(&cfg, &comm);
      break;
    case MODE_EVAL:
      rc = eval_run(&cfg, &comm);
      break;
    case MODE_GENERATE:
      rc = generate_run(&cfg, &comm);
      break;
    case MODE_BENCH:
      rc = bench_run(&cfg, &comm);
      break;
  }
  backend_detach_comm(&comm);
  comm_free(&comm);
  config_free(&cfg);
  MPI_Finalize();
  return rc;
}
