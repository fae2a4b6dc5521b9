/* `run.mode = generate`: sample bytes after a prompt from a checkpoint (one rank, causal), with
 * every layer's decode cache (a byte costs one token's work) or, without one, by recomputing the
 * context; a full window moves on by half a context and the caches are rebuilt, so both paths
 * give the same bytes (docs/generate.md). Writes stdout, generate.txt and, with generate.record,
 * every step's logits to generate.h5. */
#include "run/generate.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/h5io.h"
#include "core/memory.h"
#include "core/rng.h"
#include "core/timer.h"
#include "run/train.h"

/* The prompt: the bytes of generate.prompt_file, or generate.prompt, or a newline. The file is
 * read to its end in chunks, not sized by seeking, so a pipe or a FIFO
 * (generate.prompt_file = /dev/stdin) works too. */
static unsigned char *read_prompt(const struct config *cfg, long *len) {
  const char *path = cfg->generate.prompt_file;
  unsigned char *text;
  size_t used = 0;
  if (path[0]) {
    FILE *f = fopen(path, "rb");
    if (!f) error("cannot open generate.prompt_file '%s'", path);
    size_t cap = 1 << 16;
    text = xmalloc(cap);
    for (size_t got; (got = fread(text + used, 1, cap - used, f)) > 0;) {
      used += got;
      if (used == cap) text = xrealloc(text, cap *= 2);
    }
    if (ferror(f)) error("cannot read generate.prompt_file '%s': %s", path, strerror(errno));
    fclose(f);
  } else {
    used = strlen(cfg->generate.prompt);
    text = xmalloc(used + 1);
    memcpy(text, cfg->generate.prompt, used);
  }
  *len = (long)used;
  if (*len == 0) text[(*len)++] = '\n'; /* something to condition on */
  return text;
}

/* Sample a byte from logits (V ≥ 256; only the 256 bytes are candidates) with temperature and
 * top-k, from the counter-based stream keyed by (checkpoint step, position, sample). */
static int sample_byte(const struct config *cfg, const float *z, long step, long pos, int sample) {
  float probs[256], mx = -INFINITY;
  for (int j = 0; j < 256; j++) mx = z[j] > mx ? z[j] : mx;
  double s = 0.0;
  for (int j = 0; j < 256; j++) {
    probs[j] = expf((z[j] - mx) / (float)cfg->generate.temperature);
    s += probs[j];
  }
  if (cfg->generate.top_k > 0 && cfg->generate.top_k < 256) { /* keep the k most probable */
    float sorted[256];
    memcpy(sorted, probs, sizeof sorted);
    for (int a = 0; a < cfg->generate.top_k; a++)
      for (int b = a + 1; b < 256; b++)
        if (sorted[b] > sorted[a]) {
          float t = sorted[a];
          sorted[a] = sorted[b];
          sorted[b] = t;
        }
    const float kth = sorted[cfg->generate.top_k - 1];
    s = 0.0;
    for (int j = 0; j < 256; j++) {
      if (probs[j] < kth) probs[j] = 0.0f;
      s += probs[j];
    }
  }
  double u = rng_uniform_double(cfg->run.seed, RNG_GENERATE, (uint64_t)step, (uint64_t)pos,
                                (uint64_t)sample) *
             s;
  for (int j = 0; j < 256; j++) {
    u -= probs[j];
    if (u < 0) return j;
  }
  return 255;
}

/* Logits of the byte at pos given the window text[start, pos), by one forward over the window
 * (padded to the context; causal, so the padding is never seen). */
static void recompute_logits(struct model *m, const unsigned char *text, long start, long pos,
                             float *logits) {
  const long used = pos - start;
  for (long t = 0; t < m->n; t++) {
    m->tokens[t] = t < used ? text[start + t] : 0;
    m->targets[t] = -1;
  }
  model_forward_logits(m);
  memcpy(logits, m->logits + (size_t)(used - 1) * m->V, sizeof(float) * (size_t)m->V);
}

/* One sample of generate.length bytes appended to text[0, len); returns the seconds spent. */
static double generate_sample(const struct config *cfg, struct model *m, bool cached,
                              unsigned char *text, long len, long step, int sample, FILE *txt,
                              hid_t rec) {
  const long n = m->n, total = len + cfg->generate.length;
  float *logits = xmalloc(sizeof(float) * (size_t)m->V);
  struct model_decoder dec = {0};
  long start = 0, fed = 0; /* the window text[start, pos); the cache holds text[start, fed) */
  const double t0 = timer_now();
  for (long pos = len; pos < total; pos++) {
    long s = start;
    while (pos - s > n) s += n / 2; /* the window is full: move on by half a context */
    if (!cached) {
      start = s;
      recompute_logits(m, text, start, pos, logits);
    } else {
      if (s != start || !dec.cache) { /* (re)build the caches from the window's bytes */
        model_decode_close(m, &dec);
        model_decode_open(m, &dec);
        start = fed = s;
      }
      for (; fed < pos; fed++) model_decode_step(m, &dec, text[fed], fed - start, logits);
    }
    const int byte = sample_byte(cfg, logits, step, pos, sample);
    text[pos] = (unsigned char)byte;
    fputc(byte, stdout);
    fputc(byte, txt);
    fflush(stdout);
    if (rec >= 0) {
      double *row = xmalloc(sizeof(double) * (size_t)m->V);
      for (int j = 0; j < m->V; j++) row[j] = logits[j];
      const long shape[1] = {m->V};
      h5_append_doubles(rec, "/logits", 1, shape, row, "logits of the byte at that position");
      const double meta[3] = {(double)sample, (double)pos, (double)byte};
      h5_append_doubles(rec, "/sample", 0, NULL, &meta[0], "sample index");
      h5_append_doubles(rec, "/position", 0, NULL, &meta[1], "position in the text");
      h5_append_doubles(rec, "/byte", 0, NULL, &meta[2], "the byte sampled");
      free(row);
    }
  }
  const double secs = timer_now() - t0;
  model_decode_close(m, &dec);
  free(logits);
  return secs;
}

int generate_run(const struct config *cfg, struct comm *comm) {
  if (comm->world_size != 1) error_collective("run.mode = generate runs on one rank");
  if (cfg->model.objective != OBJECTIVE_CLM)
    error_collective("run.mode = generate needs a causal model (model.objective = clm)");
  struct config one = *cfg;
  one.train.batch = 1;
  if (cfg->parallel.device == DEVICE_GPU) { /* the decode caches and the sampling are host code */
    message("note: generation runs on the CPU (parallel.device = gpu trains and evaluates)");
    one.parallel.device = DEVICE_CPU;
    one.parallel.precision = PRECISION_FP32;
  }
  struct run_state rs;
  const long step = train_open_run(&rs, &one, comm, true);
  struct model *m = &rs.model;
  bool cached = cfg->generate.cache && m->attn->decode_open;
  if (cfg->generate.cache && !cached)
    message(
        "note: attention.variant = %s%s has no decode cache: every byte recomputes the "
        "context (as generate.cache = false)",
        m->attn->name, cfg->attention.heads_mode == HEADS_FISH ? " with FiSH heads" : "");
  long len;
  unsigned char *prompt = read_prompt(cfg, &len);
  unsigned char *text = xmalloc((size_t)(len + cfg->generate.length + 1));
  char path[1200];
  snprintf(path, sizeof path, "%s/generate.txt", rs.dir);
  FILE *txt = fopen(path, "w");
  if (!txt) error("cannot write %s", path);
  hid_t rec = -1;
  if (cfg->generate.record) {
    snprintf(path, sizeof path, "%s/generate.h5", rs.dir);
    rec = h5_create(path);
    h5_attr_string(rec, "/", "deck", cfg->resolved);
    h5_attr_long(rec, "/", "step", step);
    h5_attr_long(rec, "/", "cache", cached);
  }
  message("generating %d bytes x %d sample(s) from step %ld (temperature %.2f, top_k %d, %s)",
          cfg->generate.length, cfg->generate.samples, step, cfg->generate.temperature,
          cfg->generate.top_k, cached ? "decode cache" : "recomputing the context");
  double secs = 0.0;
  for (int s = 0; s < cfg->generate.samples; s++) {
    if (cfg->generate.samples > 1) {
      printf("%s--- sample %d ---\n", s ? "\n" : "", s + 1);
      fprintf(txt, "%s--- sample %d ---\n", s ? "\n" : "", s + 1);
    }
    memcpy(text, prompt, (size_t)len);
    fwrite(text, 1, (size_t)len, stdout);
    fwrite(text, 1, (size_t)len, txt);
    secs += generate_sample(cfg, m, cached, text, len, step, s, txt, rec);
  }
  fputc('\n', stdout);
  fputc('\n', txt);
  fclose(txt);
  if (rec >= 0) h5_close(rec);
  const long bytes = (long)cfg->generate.length * cfg->generate.samples;
  message("generated %ld bytes in %.2f s: %.1f bytes/s (%s); written to %s/generate.txt", bytes,
          secs, (double)bytes / secs, cached ? "decode cache" : "recomputing the context", rs.dir);
  free(prompt);
  free(text);
  train_close_run(&rs);
  return 0;
}
