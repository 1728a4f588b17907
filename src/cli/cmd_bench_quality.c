/* cli/cmd_bench_quality.c — `kvbridge bench quality`: does the cache the bridge delivers keep the
 * model's answers? Over a fixed, deterministic set of needle-in-a-document prompts
 * (quality_prompts.c), the SAME decoder (the CPU engine, the decoder's cache format) decodes each
 * prompt twice:
 *   native   the decoder computes the prompt's cache itself;
 *   bridged  the bridge's slabs for every position before the last prompt token, as a decode node
 *            asks for them, are assembled into a fresh store through the store's slab assembler
 *            (kvb_bridge_receiver): the full blocks committed by the one block writer, the tail
 *            (the partial block before the last token) kept as a page; a decoder engine over that
 *            store adopts the blocks as a prefix-cache hit and the tail as its writing block,
 *            computes the last prompt token itself and decodes.
 * Two bridge modes, wired into the engines as the prefill node wires them:
 *   decoder  the bridge runs the decoder's arithmetic (kvb_bridge_cpu_layer, the engine's layer
 *            hook) on the attention inputs of a prefill engine that computes in the decoder's own
 *            cache format — which is exactly the decoder's native forward, so the native forward
 *            serves as that prefill engine and the bridge hooks on it (one forward, not two);
 *   prefill  a second engine computes the prompt in its own cache dtype (--prefill-engine-cache)
 *            and its own rows are re-encoded into the decoder's format (kvb_bridge_cpu_rows, the
 *            engine's rows hook).
 * Per prompt and mode: greedy agreement over the first --gen tokens (tokens before the first
 * divergence; the fraction of positions with the same token), next-token KL(native || bridged)
 * at each step teacher-forced on the native tokens (softmax in double), and needle retrieval
 * (the answer in the generated text, case-insensitive) for both paths. Generation does not stop
 * at end-of-generation tokens: both paths generate exactly --gen tokens. Decoder mode must be
 * bit-exact (every step's logits identical, so KL 0 and agreement 100 %): checked, printed as a
 * claim, exit status 1 when it does not hold.
 * Resumable and shardable (the full set takes hours): --results FILE appends one JSON line per
 * finished prompt and a later run over the same FILE loads the prompts it holds instead of
 * computing them; --first skips prompts; --table-only tabulates a file (shards concatenated) without
 * computing. See "the results file" below. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cJSON.h>
#include <math.h>

#include "kvb_bridge.h"
#include "kvb_cli.h"
#include "kvb_engine_cpu.h"
#include "kvb_quant.h"
#include "kvb_tokenizer.h"

enum { MODE_DECODER, MODE_PREFILL, N_MODES };
static const char *const k_mode_names[N_MODES] = {"decoder", "prefill"};

#define BLOCK_TOKENS 32u
#define MAX_BATCH 512u

typedef struct {
    const char *model;
    long long n_prompts, min_tok, max_tok, gen, threads;
    uint64_t seed;
    uint32_t cache_type, prefill_cache_type;
    bool modes[N_MODES];
    bool verbose;
    bool perturb;
    const char *results; /* --results FILE, or NULL */
    long long first;     /* --first: prompts [first, n_prompts) are computed */
    bool table_only;
} qopts;

/* One prompt's figures in one mode. */
typedef struct {
    uint32_t agree;    /* generated tokens identical before the first divergence */
    uint32_t same;     /* positions with the same token, of gen */
    uint32_t exact;    /* steps whose next-token logits were bit-identical, of gen */
    double kl_mean;    /* over the gen teacher-forced steps */
    double kl_max;
    bool needle;       /* the bridged text contains the answer */
    double seconds;    /* the prefill engine (mode prefill) and the bridged decode */
} mode_result;

typedef struct {
    uint32_t index;    /* 0-based; the progress line says index + 1 */
    uint32_t tokens, ship;
    bool needle_native;
    double native_s;   /* the native forward (with the decoder-mode bridge hooked on it) and decode */
    mode_result m[N_MODES];
} prompt_result;

typedef struct {
    const qopts *o;
    kvb_model *m;
    kvb_tokenizer *tok;
    uint32_t gen, n_vocab, max_ctx;
    kvb_engine_opts dec_opts;  /* the decoder's engine options (without hooks) */
    kvb_engine *dec;           /* the decoder computing natively; the decoder-mode bridge hooks on it */
    kvb_engine *pre;           /* mode prefill: the prefill engine in its own cache dtype */
    kvb_bridge_cpu *br[N_MODES];
    kvb_sampler greedy;
    float *native_logits;      /* (gen, n_vocab): the native next-token logits at each step */
    float *logits;             /* (n_vocab) */
    int32_t *native_ids, *bridged_ids; /* (gen) */
    int32_t *ctx;              /* (max_ctx + 1) prompt + generated tokens */
} qbench;

/* ---- the prompt set ------------------------------------------------------------------------ */

/* Prompt i's target length: octave i % n_octaves of [min, max], uniform inside it. */
static uint32_t prompt_target(const qopts *o, uint64_t i, kvb_rng *r) {
    const uint64_t lo0 = (uint64_t)o->min_tok, hi0 = (uint64_t)o->max_tok;
    uint32_t n_oct = 1;
    while ((lo0 << n_oct) < hi0) n_oct++;
    const uint32_t k = (uint32_t)(i % n_oct);
    const uint64_t lo = lo0 << k, hi = (lo0 << (k + 1)) < hi0 ? (lo0 << (k + 1)) : hi0 + 1;
    return (uint32_t)(hi > lo ? lo + kvb_rng_u64(r) % (hi - lo) : lo);
}

static kvb_status tokenize_prompt(const qbench *q, const char *text, const char *question, int32_t **ids, uint32_t *n,
                                  kvb_err *err) {
    kvb_strbuf b = {0};
    kvb_strbuf_put(&b, text);
    kvb_strbuf_put(&b, "\n\nQuestion: ");
    kvb_strbuf_put(&b, question);
    kvb_strbuf_put(&b, "\nAnswer:");
    if (b.oom) {
        free(b.p);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory building a prompt");
    }
    size_t nt = 0;
    kvb_status st = kvb_tokenize(q->tok, b.p, b.n, true, false, ids, &nt, err);
    free(b.p);
    *n = (uint32_t)nt;
    return st;
}

/* Prompt i: the document for its target length, regenerated with a corrected size until it
 * tokenizes to between the target and 5 % above it (the generator assumes 4 characters per
 * token; the vocabulary decides), so a prompt is rarely shorter than --min-tokens; when the
 * generator's sentences cannot land in that band, the closest attempt that fits the context (one
 * at or above the target preferred) is taken. *ids (n) and *answer are malloc'd. */
static kvb_status make_prompt(const qbench *q, uint64_t i, int32_t **ids, uint32_t *n, char **answer, kvb_err *err) {
    kvb_rng r;
    kvb_rng_seed(&r, kvb_splitmix64(q->o->seed ^ kvb_splitmix64(i + 1)));
    const uint32_t target = prompt_target(q->o, i, &r);
    const uint64_t doc_seed = kvb_rng_u64(&r);
    const uint32_t limit = q->max_ctx - q->gen - 1;
    uint64_t size = target, best_size = 0, best_score = UINT64_MAX;
    for (int attempt = 0; attempt <= 8; attempt++) {
        const bool last = attempt == 8; /* regenerate the best attempt */
        if (last && !best_size) break;
        char *text, *question;
        if (kvb_quality_prompt(doc_seed, (uint32_t)(last ? best_size : size), &text, &question, answer))
            return kvb_err_set(err, KVB_ERR_NOMEM, "could not generate prompt %llu", (unsigned long long)i + 1);
        kvb_status st = tokenize_prompt(q, text, question, ids, n, err);
        free(text);
        free(question);
        if (!st && (last || (*n >= target && *n <= target + target / 20 && *n <= limit))) return KVB_OK;
        free(*answer);
        *answer = NULL;
        free(*ids);
        *ids = NULL;
        if (st) return st;
        /* the closest that fits, one at or above the target preferred */
        const uint64_t score = *n >= target ? *n - target : ((uint64_t)(target - *n) << 32);
        if (*n <= limit && score < best_score) {
            best_score = score;
            best_size = size;
        }
        /* aim 2.5 % above the target; push harder when still off after a correction */
        size = size * (target + target / 40 + (uint64_t)attempt * target / 100) / (*n ? *n : 1);
        if (size < 1) size = 1;
    }
    return kvb_err_set(err, KVB_ERR_RANGE, "prompt %llu (%u tokens) does not fit the context of %u tokens",
                       (unsigned long long)i + 1, target, q->max_ctx);
}

/* ---- figures --------------------------------------------------------------------------------- */

/* KL(p || q) of the softmaxes of two logit vectors, in double. Identical logits give exactly 0
 * (every term is p_i * 0). */
static double kl_div(const float *p, const float *q, uint32_t n) {
    double mp = p[0], mq = q[0];
    for (uint32_t i = 1; i < n; i++) {
        if (p[i] > mp) mp = p[i];
        if (q[i] > mq) mq = q[i];
    }
    double sp = 0, sq = 0;
    for (uint32_t i = 0; i < n; i++) {
        sp += exp((double)p[i] - mp);
        sq += exp((double)q[i] - mq);
    }
    const double lp = mp + log(sp), lq = mq + log(sq);
    double kl = 0;
    for (uint32_t i = 0; i < n; i++) {
        const double a = (double)p[i] - lp, b = (double)q[i] - lq;
        kl += exp(a) * (a - b);
    }
    return kl;
}

/* Whether the detokenized ids contain `answer`, case-insensitively. */
static bool says(const kvb_tokenizer *t, const int32_t *ids, uint32_t n, const char *answer, bool verbose,
                 const char *label) {
    kvb_detok d;
    kvb_detok_init(&d, t);
    kvb_strbuf b = {0};
    char piece[1024];
    for (uint32_t i = 0; i < n; i++) {
        size_t k = kvb_detok_push(&d, ids[i], piece, sizeof piece);
        kvb_strbuf_putn(&b, piece, k);
    }
    size_t k = kvb_detok_flush(&d, piece, sizeof piece);
    kvb_strbuf_putn(&b, piece, k);
    bool found = b.p && strcasestr(b.p, answer) != NULL;
    if (verbose) fprintf(stderr, "    %-8s %s\n", label, b.p ? b.p : "");
    free(b.p);
    return found;
}

/* ---- one prompt ------------------------------------------------------------------------------ */

/* A fresh store in the decoder's format for one prompt's bridged cache: room for the prompt, the
 * generated tokens and a second sequence's own tail, so nothing bridged is ever evicted. */
static kvb_status bridged_store(const qbench *q, uint32_t L, kvb_store **out, kvb_err *err) {
    const uint32_t blocks = (L + q->gen + 1 + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
    return kvb_store_create(kvb_engine_kvformat(q->dec), q->m->fingerprint, 2 * blocks + 2, out, err);
}

/* Runs tokens[0, n) through engine e in a new sequence *s (the caller frees it) with bridge br,
 * when not NULL, on the engine's hook shipping [0, ship) into a receiver over `store`; checks
 * with the receiver's DONE check that every shipped block was committed and the tail (the partial
 * block before the last prompt token, if any) arrived whole; *tail receives its page (owned by the
 * caller) or KVB_BLOCK_NONE. */
static kvb_status forward_shipping(kvb_engine *e, kvb_seq **s, kvb_bridge_cpu *br, kvb_store *store,
                                   const int32_t *ids, uint32_t n, uint32_t ship, float *logits, kvb_block_id *tail,
                                   kvb_err *err) {
    kvb_bridge_receiver *rcv = NULL;
    *tail = KVB_BLOCK_NONE;
    kvb_status st = br ? kvb_bridge_receiver_create(store, ids, 0, ship, &rcv, err) : KVB_OK;
    if (!st && br) kvb_bridge_cpu_begin(br, 0, ship, kvb_bridge_receiver_put, rcv);
    if (!st) st = kvb_seq_create(e, s, err);
    if (!st) st = kvb_engine_forward(e, *s, ids, n, logits, false, err);
    if (br) {
        kvb_bridge_cpu_begin(br, 0, 0, NULL, NULL); /* disarmed: decode steps ship nothing */
        /* held to the DONE a sender would send: every block committed, the tail complete */
        kvb_msg_done done;
        const uint32_t slabs = rcv ? kvb_bridge_receiver_slabs(rcv) : 0;
        if (!st) st = kvb_bridge_done_for(store, ids, 0, ship, slabs, &done, err);
        if (!st) st = kvb_bridge_receiver_check_done(rcv, &done, &slabs, 1, err);
        if (!st) *tail = kvb_bridge_receiver_take_tail(rcv);
    }
    kvb_bridge_receiver_free(rcv);
    return st;
}

/* The native path on the decoder: the prompt (the decoder-mode bridge ships [0, ship) into
 * `dstore` from this very forward when dstore is not NULL), then gen greedy steps keeping every
 * step's logits. */
static kvb_status native_path(qbench *q, const int32_t *ids, uint32_t L, uint32_t ship, kvb_store *dstore,
                              kvb_block_id *tail, kvb_err *err) {
    kvb_seq *s = NULL;
    kvb_status st = forward_shipping(q->dec, &s, dstore ? q->br[MODE_DECODER] : NULL, dstore, ids, L, ship,
                                     q->native_logits, tail, err);
    for (uint32_t k = 0; k < q->gen && !st; k++) {
        q->native_ids[k] = kvb_sample(&q->greedy, q->native_logits + (size_t)k * q->n_vocab);
        if (k + 1 < q->gen)
            st = kvb_engine_forward(q->dec, s, &q->native_ids[k], 1, q->native_logits + (size_t)(k + 1) * q->n_vocab,
                                    false, err);
    }
    kvb_seq_free(s);
    return st;
}

/* A new sequence on e holding tokens[0, n) from the bridged store: the committed chain (the
 * bridged blocks, and blocks the decoder finished on top of them), then, when the chain ends
 * exactly at the bridged full blocks, the bridged tail *tail (adopted: *tail becomes NONE). At
 * least the `full` bridged tokens must be adopted. *adopted: tokens the sequence holds. */
static kvb_status adopt_bridged(kvb_engine *e, kvb_seq **s, const int32_t *ids, uint32_t n, uint32_t full,
                                uint32_t tail_len, kvb_block_id *tail, uint32_t *adopted, kvb_err *err) {
    kvb_status st = kvb_seq_create(e, s, err);
    if (!st) st = kvb_seq_attach_cached(*s, ids, n, adopted, err);
    if (!st && *adopted < full)
        st = kvb_err_set(err, KVB_ERR_INTERNAL, "the decoder adopted %u bridged tokens, the bridge shipped %u",
                         *adopted, full);
    if (!st && *adopted == full && tail_len) {
        if (*tail == KVB_BLOCK_NONE) return kvb_err_set(err, KVB_ERR_INTERNAL, "the bridged tail is missing");
        st = kvb_seq_adopt_tail(*s, *tail, ids + full, tail_len, err);
        if (!st) {
            *tail = KVB_BLOCK_NONE;
            *adopted += tail_len;
        }
    }
    return st;
}

/* The bridged path: a decoder engine over the bridged store adopts the shipped blocks and tail
 * (every position before the last prompt token), computes the last prompt token, then gen steps
 * teacher-forced on the native tokens (KL, bit-identical logits); from the first divergence on, a
 * second sequence — over the same bridged cache: the chain, and a byte copy of the bridged tail
 * when the first sequence's finished tail block does not cover it — continues greedily on its
 * own tokens, for agreement and the needle. `tail` (owned) is the bridged tail's page or NONE. */
static kvb_status bridged_path(qbench *q, kvb_store *store, const int32_t *ids, uint32_t L, kvb_block_id tail,
                               mode_result *r, kvb_err *err) {
    const uint32_t full = (L - 1) / BLOCK_TOKENS * BLOCK_TOKENS, tail_len = L - 1 - full;
    kvb_engine *e = NULL;
    kvb_seq *s = NULL, *s2 = NULL;
    kvb_engine_opts eo = q->dec_opts;
    eo.store = store;
    uint32_t adopted = 0, div = q->gen;
    int32_t div_tok = -1;
    kvb_block_id copy = KVB_BLOCK_NONE; /* the tail's bytes again, for the second sequence */
    kvb_status st = kvb_engine_create(q->m, &eo, &e, err);
    if (!st && tail != KVB_BLOCK_NONE && (st = kvb_store_alloc(store, 1, &copy, err)) == KVB_OK)
        memcpy(kvb_store_block_data(store, copy), kvb_store_block_data(store, tail), kvb_store_block_bytes(store));
    if (!st) st = adopt_bridged(e, &s, ids, L, full, tail_len, &tail, &adopted, err);
    if (!st && adopted != L - 1)
        st = kvb_err_set(err, KVB_ERR_INTERNAL, "the decoder adopted %u of the %u bridged tokens", adopted, L - 1);
    if (!st) st = kvb_engine_forward(e, s, ids + adopted, L - adopted, q->logits, false, err);
    double kl_sum = 0;
    for (uint32_t k = 0; k < q->gen && !st; k++) {
        const float *nat = q->native_logits + (size_t)k * q->n_vocab;
        const double kl = kl_div(nat, q->logits, q->n_vocab);
        kl_sum += kl;
        if (k == 0 || kl > r->kl_max) r->kl_max = kl;
        r->exact += memcmp(nat, q->logits, sizeof(float) * q->n_vocab) == 0;
        const int32_t t = kvb_sample(&q->greedy, q->logits);
        if (t != q->native_ids[k] && div == q->gen) {
            div = k;
            div_tok = t;
        }
        if (k + 1 < q->gen) st = kvb_engine_forward(e, s, &q->native_ids[k], 1, q->logits, false, err);
    }
    r->kl_mean = q->gen ? kl_sum / q->gen : 0;
    /* the bridged path's own greedy tokens: the native ones up to the divergence, then its own */
    memcpy(q->bridged_ids, q->native_ids, sizeof(int32_t) * div);
    if (!st && div < q->gen) {
        q->bridged_ids[div] = div_tok;
        const uint32_t n = L + div + 1;
        memcpy(q->ctx, ids, sizeof(int32_t) * L);
        memcpy(q->ctx + L, q->native_ids, sizeof(int32_t) * div);
        q->ctx[L + div] = div_tok;
        uint32_t c2 = 0;
        st = adopt_bridged(e, &s2, q->ctx, n, full, tail_len, &copy, &c2, err);
        if (!st && div + 1 < q->gen) st = kvb_engine_forward(e, s2, q->ctx + c2, n - c2, q->logits, false, err);
        for (uint32_t k = div + 1; k < q->gen && !st; k++) {
            q->bridged_ids[k] = kvb_sample(&q->greedy, q->logits);
            if (k + 1 < q->gen) st = kvb_engine_forward(e, s2, &q->bridged_ids[k], 1, q->logits, false, err);
        }
    }
    r->agree = div;
    r->same = 0;
    for (uint32_t k = 0; k < q->gen; k++) r->same += q->bridged_ids[k] == q->native_ids[k];
    kvb_seq_free(s2);
    kvb_seq_free(s);
    kvb_block_id unused[2] = {tail, copy};
    for (int i = 0; i < 2; i++)
        if (unused[i] != KVB_BLOCK_NONE) kvb_store_release(store, &unused[i], 1, NULL);
    kvb_engine_free(e);
    return st;
}

static kvb_status run_prompt(qbench *q, const int32_t *ids, uint32_t L, const char *answer, prompt_result *pr,
                             kvb_err *err) {
    const uint32_t ship = L - 1; /* every position before the last prompt token, as a decode node asks */
    memset(pr, 0, sizeof *pr);
    pr->tokens = L;
    pr->ship = ship;
    if (ship < BLOCK_TOKENS)
        return kvb_err_set(err, KVB_ERR_INVALID, "a prompt of %u tokens has no full block to bridge", L);
    kvb_store *bs[N_MODES] = {NULL, NULL};
    kvb_block_id tail[N_MODES] = {KVB_BLOCK_NONE, KVB_BLOCK_NONE};
    kvb_status st = KVB_OK;
    for (int m = 0; m < N_MODES && !st; m++)
        if (q->o->modes[m]) st = bridged_store(q, L, &bs[m], err);
    double t0 = kvb_now_s();
    if (!st) st = native_path(q, ids, L, ship, bs[MODE_DECODER], &tail[MODE_DECODER], err);
    pr->native_s = kvb_now_s() - t0;
    if (!st) pr->needle_native = says(q->tok, q->native_ids, q->gen, answer, q->o->verbose, "native:");
    for (int m = 0; m < N_MODES; m++) {
        if (!q->o->modes[m]) continue;
        t0 = kvb_now_s();
        if (!st && m == MODE_PREFILL) { /* like a prefill node: the shipped positions only */
            kvb_seq *s = NULL;
            st = forward_shipping(q->pre, &s, q->br[m], bs[m], ids, ship, ship, NULL, &tail[m], err);
            kvb_seq_free(s);
        }
        if (!st) st = bridged_path(q, bs[m], ids, L, tail[m], &pr->m[m], err);
        else if (tail[m] != KVB_BLOCK_NONE) kvb_store_release(bs[m], &tail[m], 1, NULL);
        pr->m[m].seconds = kvb_now_s() - t0;
        if (!st) pr->m[m].needle = says(q->tok, q->bridged_ids, q->gen, answer, q->o->verbose, k_mode_names[m]);
    }
    for (int m = 0; m < N_MODES; m++) kvb_store_free(bs[m]);
    return st;
}

/* ---- the table ------------------------------------------------------------------------------- */

static const struct {
    const char *name;
    uint32_t lo, hi; /* tokens in [lo, hi) */
} k_buckets[] = {{"<1K", 0, 1024},        {"1K-4K", 1024, 4096},     {"4K-8K", 4096, 8192},
                 {"8K-16K", 8192, 16384}, {"16K-32K", 16384, 32768}, {">=32K", 32768, UINT32_MAX}};

static void fmt_kl(char *buf, size_t cap, double kl) {
    if (kl == 0) snprintf(buf, cap, "0");
    else snprintf(buf, cap, "%.3g", kl);
}

static void table_row(const char *label, const prompt_result *pr, uint32_t n, int mode, uint32_t lo, uint32_t hi,
                      uint32_t gen) {
    uint32_t cnt = 0, full = 0, nn = 0, nb = 0;
    double tok = 0, agree = 0, same = 0, kl = 0, klmax = 0;
    for (uint32_t i = 0; i < n; i++) {
        const prompt_result *p = &pr[i];
        if (p->tokens < lo || p->tokens >= hi) continue;
        const mode_result *r = &p->m[mode];
        cnt++;
        tok += p->tokens;
        agree += (double)r->agree / gen;
        same += (double)r->same / gen;
        full += r->same == gen;
        kl += r->kl_mean;
        if (r->kl_max > klmax) klmax = r->kl_max;
        nn += p->needle_native;
        nb += r->needle;
    }
    if (!cnt) return;
    char a[32], b[32], f[32], x[32], y[32];
    fmt_kl(a, sizeof a, kl / cnt);
    fmt_kl(b, sizeof b, klmax);
    snprintf(f, sizeof f, "%u/%u", full, cnt);
    snprintf(x, sizeof x, "%u/%u", nn, cnt);
    snprintf(y, sizeof y, "%u/%u", nb, cnt);
    printf("%-8s %7u %11.0f %10.1f%% %10.1f%% %11s %10s %10s %14s %14s\n", label, cnt, tok / cnt, 100 * agree / cnt,
           100 * same / cnt, f, a, b, x, y);
}

static void print_table(const prompt_result *pr, uint32_t n, int mode, uint32_t gen) {
    printf("%-8s %7s %11s %11s %11s %11s %10s %10s %14s %14s\n", "length", "prompts", "mean tokens", "agree run",
           "same tokens", "identical", "mean KL", "max KL", "needle native", "needle bridged");
    for (size_t b = 0; b < sizeof k_buckets / sizeof k_buckets[0]; b++)
        table_row(k_buckets[b].name, pr, n, mode, k_buckets[b].lo, k_buckets[b].hi, gen);
    table_row("total", pr, n, mode, 0, UINT32_MAX, gen);
}

/* ---- the results file (--results) ------------------------------------------------------------ */

/* One JSON object a line, one a finished prompt:
 *   {"run": {...}, "index": I, "tokens": T, "ship": T-1, "needle_native": B, "native_s": S,
 *    "decoder": {"agree": A, "same": N, "exact": E, "kl_mean": K, "kl_max": K, "needle": B,
 *                "seconds": S}, "prefill": {...}}
 * with one object per enabled mode. "run" holds every setting that decides the figures
 * (run_json); "index" is 0-based. A line is written whole, by one write(2) on an O_APPEND
 * descriptor, as its prompt finishes, so a killed run leaves at most its last line cut short.
 * Doubles are printed so that they read back to the same bits (cJSON: %.15g, else %.17g): a KL of
 * exactly 0 stays 0 and the decoder-mode claim holds over loaded prompts as over computed ones.
 * The file is hostile input: every field's type and range is checked. */

#define RESULTS_MAX_BYTES ((size_t)256 << 20)
#define KL_FLOOR -1e-6 /* KL >= 0; its sum in double may land a few ulps below */

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/* The settings that decide a prompt's figures: the model (its file name, and its fingerprint when
 * fp is not NULL), the prompt set, --gen, the modes and cache types, --perturb. Not --threads or
 * --verbose: they change no figure. NULL when out of memory. */
static cJSON *run_json(const qopts *o, const uint64_t *fp) {
    char buf[32];
    cJSON *r = cJSON_CreateObject(), *modes = NULL;
    bool ok = r && cJSON_AddStringToObject(r, "model", base_name(o->model));
    if (ok && fp) {
        snprintf(buf, sizeof buf, "%016" PRIx64, *fp);
        ok = cJSON_AddStringToObject(r, "fingerprint", buf) != NULL;
    }
    snprintf(buf, sizeof buf, "%" PRIu64, o->seed); /* a string: a JSON number holds 53 bits */
    ok = ok && cJSON_AddStringToObject(r, "seed", buf) && cJSON_AddNumberToObject(r, "min_tokens", (double)o->min_tok) &&
         cJSON_AddNumberToObject(r, "max_tokens", (double)o->max_tok) &&
         cJSON_AddNumberToObject(r, "gen", (double)o->gen) && (modes = cJSON_AddArrayToObject(r, "modes"));
    for (int m = 0; m < N_MODES && ok; m++)
        if (o->modes[m]) ok = cJSON_AddItemToArray(modes, cJSON_CreateString(k_mode_names[m]));
    ok = ok && cJSON_AddStringToObject(r, "cache_type", kvb_type_name(o->cache_type));
    if (ok && o->modes[MODE_PREFILL])
        ok = cJSON_AddStringToObject(r, "prefill_engine_cache", kvb_type_name(o->prefill_cache_type)) != NULL;
    ok = ok && cJSON_AddBoolToObject(r, "perturb", o->perturb);
    if (!ok) {
        cJSON_Delete(r);
        return NULL;
    }
    return r;
}

/* Opens FILE for appending (creating it), first cutting it to `keep` bytes when keep >= 0 (a last
 * line without its newline, which the next line must not be glued to). -1 on error. */
static int results_open(const char *path, long keep, kvb_err *err) {
    const int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        kvb_err_set(err, KVB_ERR_IO, "cannot open %s to append results: %s", path, strerror(errno));
        return -1;
    }
    if (keep >= 0 && ftruncate(fd, (off_t)keep)) {
        kvb_err_set(err, KVB_ERR_IO, "cannot cut the unfinished last line off %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

/* Appends prompt p's line (see above) to fd in one write. */
static kvb_status results_append(int fd, const char *path, cJSON *run, const bool modes[N_MODES],
                                 const prompt_result *p, kvb_err *err) {
    cJSON *o = cJSON_CreateObject();
    bool ok = o && cJSON_AddItemReferenceToObject(o, "run", run) && cJSON_AddNumberToObject(o, "index", p->index) &&
              cJSON_AddNumberToObject(o, "tokens", p->tokens) && cJSON_AddNumberToObject(o, "ship", p->ship) &&
              cJSON_AddBoolToObject(o, "needle_native", p->needle_native) &&
              cJSON_AddNumberToObject(o, "native_s", p->native_s);
    for (int m = 0; m < N_MODES && ok; m++) {
        if (!modes[m]) continue;
        const mode_result *r = &p->m[m];
        cJSON *j = cJSON_AddObjectToObject(o, k_mode_names[m]);
        ok = j && cJSON_AddNumberToObject(j, "agree", r->agree) && cJSON_AddNumberToObject(j, "same", r->same) &&
             cJSON_AddNumberToObject(j, "exact", r->exact) && cJSON_AddNumberToObject(j, "kl_mean", r->kl_mean) &&
             cJSON_AddNumberToObject(j, "kl_max", r->kl_max) && cJSON_AddBoolToObject(j, "needle", r->needle) &&
             cJSON_AddNumberToObject(j, "seconds", r->seconds);
    }
    char *json = ok ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    const size_t n = json ? strlen(json) : 0;
    char *line = json ? malloc(n + 1) : NULL;
    if (line) {
        memcpy(line, json, n);
        line[n] = '\n';
    }
    cJSON_free(json);
    if (!line) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory writing a line of %s", path);
    size_t off = 0;
    while (off < n + 1) {
        const ssize_t k = write(fd, line + off, n + 1 - off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            const int e = k < 0 ? errno : EIO;
            free(line);
            return kvb_err_set(err, KVB_ERR_IO, "cannot append prompt %u's results to %s: %s", p->index + 1, path,
                               strerror(e));
        }
        off += (size_t)k;
    }
    free(line);
    return KVB_OK;
}

/* One line being read: where it is, for messages. */
typedef struct {
    const char *path;
    size_t line;
    kvb_err *err;
} rline;

/* A short rendering of a value found in the file (or "missing"). */
static void shown(const cJSON *v, char *buf, size_t cap) {
    if (cJSON_IsNumber(v) && !isfinite(v->valuedouble)) { /* cJSON would print null */
        snprintf(buf, cap, "%g", v->valuedouble);
        return;
    }
    char *s = v ? cJSON_PrintUnformatted(v) : NULL;
    if (s && strlen(s) > 40) snprintf(buf, cap, "%.37s...", s);
    else snprintf(buf, cap, "%s", v ? (s ? s : "?") : "missing");
    cJSON_free(s);
}

static kvb_status bad_line(const rline *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static kvb_status bad_line(const rline *c, const char *fmt, ...) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return kvb_err_set(c->err, KVB_ERR_INVALID,
                       "%s line %zu: %s. The file is damaged or is not a bench quality results file: repair or "
                       "delete that line, or give another --results file",
                       c->path, c->line, what);
}

/* obj[key] (named where+key in messages) as a whole number in [lo, hi]. */
static kvb_status get_u32(const rline *c, const cJSON *obj, const char *where, const char *key, uint32_t lo,
                          uint32_t hi, uint32_t *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= lo && v->valuedouble <= hi) || v->valuedouble != floor(v->valuedouble)) {
        char got[48];
        shown(v, got, sizeof got);
        return bad_line(c, "\"%s%s\" must be a whole number from %u to %u, not %s", where, key, lo, hi, got);
    }
    *out = (uint32_t)v->valuedouble;
    return KVB_OK;
}

/* obj[key] as a finite number >= lo; with nan_ok, null too (what a NaN is written as), read as NaN. */
static kvb_status get_num(const rline *c, const cJSON *obj, const char *where, const char *key, double lo,
                          bool nan_ok, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (nan_ok && cJSON_IsNull(v)) {
        *out = NAN;
        return KVB_OK;
    }
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble < lo) {
        char got[48];
        shown(v, got, sizeof got);
        return bad_line(c, "\"%s%s\" must be a number, at least %g, not %s", where, key, lo, got);
    }
    *out = v->valuedouble;
    return KVB_OK;
}

static kvb_status get_bool(const rline *c, const cJSON *obj, const char *where, const char *key, bool *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsBool(v)) {
        char got[48];
        shown(v, got, sizeof got);
        return bad_line(c, "\"%s%s\" must be true or false, not %s", where, key, got);
    }
    *out = cJSON_IsTrue(v);
    return KVB_OK;
}

/* Mode m's figures in record rec. */
static kvb_status parse_mode(const rline *c, const cJSON *rec, int m, uint32_t gen, mode_result *r) {
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(rec, k_mode_names[m]);
    if (!cJSON_IsObject(o)) return bad_line(c, "\"%s\" (that mode's figures) must be an object", k_mode_names[m]);
    char w[16];
    snprintf(w, sizeof w, "%s.", k_mode_names[m]);
    kvb_status st = get_u32(c, o, w, "agree", 0, gen, &r->agree);
    if (!st) st = get_u32(c, o, w, "same", 0, gen, &r->same);
    if (!st) st = get_u32(c, o, w, "exact", 0, gen, &r->exact);
    if (!st) st = get_num(c, o, w, "kl_mean", KL_FLOOR, true, &r->kl_mean);
    if (!st) st = get_num(c, o, w, "kl_max", KL_FLOOR, true, &r->kl_max);
    if (!st) st = get_bool(c, o, w, "needle", &r->needle);
    if (!st) st = get_num(c, o, w, "seconds", 0, false, &r->seconds);
    if (!st && r->agree > r->same)
        st = bad_line(c, "\"%sagree\" %u is above \"%ssame\" %u (the tokens before the first divergence are the same)",
                      w, r->agree, w, r->same);
    return st;
}

/* A record's figures into *p (its index included); the run is checked by check_run. */
static kvb_status parse_record(const rline *c, const cJSON *rec, const qopts *o, prompt_result *p) {
    memset(p, 0, sizeof *p);
    const uint32_t max_tokens = (uint32_t)(o->max_tok + o->max_tok / 8 + BLOCK_TOKENS - 1); /* make_prompt's limit */
    kvb_status st = get_u32(c, rec, "", "index", 0, 99999, &p->index);
    if (!st) st = get_u32(c, rec, "", "tokens", BLOCK_TOKENS + 1, max_tokens, &p->tokens);
    if (!st) st = get_u32(c, rec, "", "ship", BLOCK_TOKENS, max_tokens - 1, &p->ship);
    if (!st && p->ship != p->tokens - 1)
        st = bad_line(c, "\"ship\" %u must be \"tokens\" - 1 (%u): every position before the last prompt token",
                      p->ship, p->tokens - 1);
    if (!st) st = get_bool(c, rec, "", "needle_native", &p->needle_native);
    if (!st) st = get_num(c, rec, "", "native_s", 0, false, &p->native_s);
    for (int m = 0; m < N_MODES && !st; m++)
        if (o->modes[m]) st = parse_mode(c, rec, m, (uint32_t)o->gen, &p->m[m]);
    return st;
}

/* Whether the record's "run" is this run's settings `want`; if not, an error naming the first
 * setting that differs. With --table-only (want has no fingerprint: the model is not loaded) the
 * first line's fingerprint joins want, so that every line must come from one model file. */
static kvb_status check_run(const rline *c, const cJSON *run, cJSON *want, size_t *fp_line) {
    if (!cJSON_IsObject(run))
        return bad_line(c, "\"run\" (the settings of the run that wrote the line) must be an object");
    const cJSON *fp = cJSON_GetObjectItemCaseSensitive(run, "fingerprint");
    if (!cJSON_GetObjectItemCaseSensitive(want, "fingerprint") && cJSON_IsString(fp)) {
        cJSON *copy = cJSON_Duplicate(fp, false);
        if (!copy || !cJSON_AddItemToObject(want, "fingerprint", copy)) {
            cJSON_Delete(copy);
            return kvb_err_set(c->err, KVB_ERR_NOMEM, "out of memory");
        }
        *fp_line = c->line;
    }
    const cJSON *w, *g, *diff = NULL;
    cJSON_ArrayForEach(w, want) {
        g = cJSON_GetObjectItemCaseSensitive(run, w->string);
        if (!g || !cJSON_Compare(w, g, true)) {
            diff = w;
            break;
        }
    }
    cJSON_ArrayForEach(g, run) {
        if (diff) break;
        if (g->string && !cJSON_GetObjectItemCaseSensitive(want, g->string)) diff = g;
    }
    if (!diff) return KVB_OK;
    const char *key = diff->string ? diff->string : "?";
    char there[48], here[48], ref[32] = "this run's";
    shown(cJSON_GetObjectItemCaseSensitive(run, key), there, sizeof there);
    shown(cJSON_GetObjectItemCaseSensitive(want, key), here, sizeof here);
    if (!strcmp(key, "fingerprint") && *fp_line) snprintf(ref, sizeof ref, "line %zu's", *fp_line);
    return kvb_err_set(c->err, KVB_ERR_INVALID,
                       "%s line %zu holds the results of another run: its %s is %s where %s is %s. The file belongs "
                       "to other settings: give another --results file (or that run's settings)",
                       c->path, c->line, key, there, ref, here);
}

/* Whether two results of one prompt have the same figures (all but the times). */
static bool same_figures(const prompt_result *a, const prompt_result *b, const bool modes[N_MODES]) {
    bool same = a->tokens == b->tokens && a->needle_native == b->needle_native;
    for (int m = 0; m < N_MODES; m++) {
        const mode_result *x = &a->m[m], *y = &b->m[m];
        if (modes[m])
            same = same && x->agree == y->agree && x->same == y->same && x->exact == y->exact &&
                   !memcmp(&x->kl_mean, &y->kl_mean, sizeof(double)) && !memcmp(&x->kl_max, &y->kl_max, sizeof(double)) &&
                   x->needle == y->needle;
    }
    return same;
}

/* Reads o->results into a NUL-terminated buffer; *buf NULL (and OK) when the file does not exist. */
static kvb_status results_read(const char *path, char **buf, size_t *n, kvb_err *err) {
    *buf = NULL;
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        if (errno == ENOENT) return KVB_OK;
        return kvb_err_set(err, KVB_ERR_IO, "cannot open results file %s: %s", path, strerror(errno));
    }
    size_t cap = 0, k;
    char tmp[65536];
    kvb_status st = KVB_OK;
    while (!st && (k = fread(tmp, 1, sizeof tmp, f)) > 0) {
        if (*n + k > RESULTS_MAX_BYTES) {
            st = kvb_err_set(err, KVB_ERR_RANGE, "%s is larger than %zu MiB: not a bench quality results file; give "
                             "another --results file", path, RESULTS_MAX_BYTES >> 20);
        } else if (*n + k + 1 > cap) {
            cap = (*n + k + 1) * 2;
            char *nb = realloc(*buf, cap);
            if (!nb) st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory reading %s", path);
            else *buf = nb;
        }
        if (!st) {
            memcpy(*buf + *n, tmp, k);
            *n += k;
        }
    }
    if (!st && ferror(f)) st = kvb_err_set(err, KVB_ERR_IO, "cannot read results file %s: %s", path, strerror(errno));
    fclose(f);
    if (!st && !*buf && !(*buf = calloc(1, 1))) st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    if (st) {
        free(*buf);
        *buf = NULL;
        return st;
    }
    (*buf)[*n] = 0;
    return KVB_OK;
}

static bool blank(const char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != ' ' && p[i] != '\t' && p[i] != '\r') return false;
    return true;
}

/* Loads the results file o->results, when it exists (*existed): every line is checked (its run
 * against this run's settings, fp: the model's fingerprint, NULL with --table-only); the prompts
 * of index < --prompts go into pr[] with have[] set (*loaded of them; when an index is there twice
 * the first line counts, and other figures on the later line are warned about). A last line
 * without its newline is ignored with a warning and *keep is set to where it starts (else -1). */
static kvb_status results_load(const qopts *o, const uint64_t *fp, prompt_result *pr, bool *have, uint32_t *loaded,
                               bool *existed, long *keep, kvb_err *err) {
    *loaded = 0;
    *keep = -1;
    char *buf;
    size_t size;
    kvb_status st = results_read(o->results, &buf, &size, err);
    *existed = buf != NULL;
    if (st || !buf) return st;
    cJSON *want = run_json(o, fp);
    size_t *line_of = calloc((size_t)o->n_prompts, sizeof *line_of), fp_line = 0;
    if (!want || !line_of) st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    rline c = {.path = o->results, .err = err};
    for (const char *p = buf, *end = buf + size; !st && p < end;) {
        c.line++;
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl) {
            if (!blank(p, (size_t)(end - p))) {
                fprintf(stderr, "kvbridge bench quality: warning: %s line %zu has no newline at its end: a run "
                                "stopped while writing it. Ignored (%s)\n", o->results, c.line,
                        o->table_only ? "its prompt is left out" : "cut off before the next line is appended");
                *keep = (long)(p - buf);
            }
            break;
        }
        const size_t len = (size_t)(nl - p);
        const char *line = p, *stop = NULL;
        p = nl + 1;
        if (blank(line, len)) continue;
        cJSON *rec = cJSON_ParseWithLengthOpts(line, len, &stop, false);
        prompt_result r;
        const size_t col = (stop ? (size_t)(stop - line) : 0) + 1;
        if (!rec) st = bad_line(&c, "not JSON (a syntax error at column %zu)", col);
        else if (!cJSON_IsObject(rec)) st = bad_line(&c, "a JSON value but not an object");
        else if (!blank(stop, len - (col - 1))) st = bad_line(&c, "something after the JSON object at column %zu", col);
        if (!st) st = check_run(&c, cJSON_GetObjectItemCaseSensitive(rec, "run"), want, &fp_line);
        if (!st) st = parse_record(&c, rec, o, &r);
        cJSON_Delete(rec);
        if (st || r.index >= o->n_prompts) continue;
        if (!have[r.index]) {
            pr[r.index] = r;
            have[r.index] = true;
            line_of[r.index] = c.line;
            (*loaded)++;
        } else if (!same_figures(&pr[r.index], &r, o->modes)) {
            fprintf(stderr, "kvbridge bench quality: warning: %s lines %zu and %zu both hold prompt %u, with other "
                            "figures; line %zu's are used\n", o->results, line_of[r.index], c.line, r.index + 1,
                    line_of[r.index]);
        }
    }
    cJSON_Delete(want);
    free(line_of);
    free(buf);
    return st;
}

/* Prints the prompt numbers (1-based) i in [lo, hi) with have[i] == want as ranges: "1-5, 8". */
static void print_ranges(const bool *have, uint32_t lo, uint32_t hi, bool want) {
    const char *sep = "";
    for (uint32_t i = lo; i < hi; i++) {
        if (have[i] != want) continue;
        uint32_t j = i;
        while (j + 1 < hi && have[j + 1] == want) j++;
        if (j > i) printf("%s%u-%u", sep, i + 1, j + 1);
        else printf("%s%u", sep, i + 1);
        sep = ", ";
        i = j;
    }
}

/* ---- the command ----------------------------------------------------------------------------- */

/* --modes LIST (decoder, prefill or both, comma-separated) into a bool[N_MODES]. */
static kvb_status parse_modes(const char *v, void *dst, kvb_err *err) {
    bool *modes = dst;
    modes[MODE_DECODER] = modes[MODE_PREFILL] = false;
    const char *p = v;
    while (*p) {
        size_t len = strcspn(p, ",");
        int m = -1;
        for (int k = 0; k < N_MODES; k++)
            if (len == strlen(k_mode_names[k]) && !strncmp(p, k_mode_names[k], len)) m = k;
        if (m < 0) return kvb_err_set(err, KVB_ERR_RANGE, "expects decoder, prefill or decoder,prefill, got '%s'", v);
        modes[m] = true;
        p += len;
        if (*p == ',') p++;
    }
    if (!modes[MODE_DECODER] && !modes[MODE_PREFILL]) return kvb_err_set(err, KVB_ERR_RANGE, "names no mode");
    return KVB_OK;
}

/* Fills *o from argv; KVB_CLI_GO, or the code the command returns. */
static int parse_args(int argc, char **argv, qopts *o, char *model_buf, size_t cap) {
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&o->model, "GGUF model (default: the Gemma 3 270M file tools/fetch_gemma3.sh installs, "
                                     "~/.cache/kvbridge/gemma-3-270m-q4_k_m.gguf)", false),
        KVB_CLI_INT("prompts", &o->n_prompts, "N", 1, 100000, "200", "prompts"),
        KVB_CLI_INT("min-tokens", &o->min_tok, "N", 64, 1 << 20, "1024", "shortest prompt in tokens"),
        KVB_CLI_INT("max-tokens", &o->max_tok, "N", 64, 1 << 20, "30720",
                    "longest prompt in tokens; lengths go round-robin over the octaves [min, 2 min), [2 min, 4 min), "
                    "... and are uniform inside one, so prompt i is the same whatever --prompts says"),
        {.long_name = "seed", .kind = KVB_OPT_UINT, .dst = &o->seed, .meta = "S", .def = "1", .help = "the prompt set"},
        KVB_CLI_INT("gen", &o->gen, "N", 1, 4096, "64", "greedy tokens per prompt and path"),
        {.long_name = "modes", .kind = KVB_OPT_CUSTOM, .dst = o->modes, .meta = "LIST", .def = "decoder,prefill",
         .parse = parse_modes, .help = "the bridge modes compared: decoder, prefill or both"},
        KVB_CLI_OPT_CACHE_TYPE(&o->cache_type, "the decoder's cache dtype: f16, f32, bf16, q8_0"),
        {.long_name = "prefill-engine-cache", .kind = KVB_OPT_CUSTOM, .dst = &o->prefill_cache_type, .meta = "T",
         .def = "f32", .parse = kvb_opt_parse_type, .help = "the prefill engine's own cache dtype in mode prefill"},
        KVB_CLI_OPT_THREADS(&o->threads, "CPU threads (default: all)"),
        {.long_name = "verbose", .short_name = 'v', .kind = KVB_OPT_FLAG, .dst = &o->verbose,
         .help = "also print each prompt's generated texts (stderr)"},
        KVB_CLI_FLAG("perturb", &o->perturb,
                     "test-only: perturb the decoder-mode bridge by one reordered addition (as kvbridge verify "
                     "--perturb); the decoder-mode claim must then fail"),
        KVB_CLI_STR("results", &o->results, "FILE",
                    "append one JSON line to FILE as each prompt finishes: its figures, its 0-based \"index\" (the "
                    "progress line shows index + 1) and the settings that decide them (model file name and "
                    "fingerprint, --seed, --min-tokens, --max-tokens, --gen, --modes, --cache-type, "
                    "--prefill-engine-cache, --perturb). When FILE exists, the prompts it holds are loaded and not "
                    "computed again; a line from other settings stops the command (use another FILE), as does a "
                    "damaged line (its line number is named). A last line without its newline (a run killed while "
                    "writing it) is dropped with a warning. Shards' files can be concatenated into one"),
        KVB_CLI_INT("first", &o->first, "I", 0, 99999, "0",
                    "skip the first I prompts: compute prompts I+1 .. N of --prompts N only (prompt i is the same "
                    "in every shard); the tables cover those and the ones FILE holds"),
        KVB_CLI_FLAG("table-only", &o->table_only,
                     "compute nothing (the model file need not be here): print the tables and the decoder-mode "
                     "claim over the prompts of 1 .. --prompts that --results FILE holds, saying how many are "
                     "present; give the run's settings (they must match the file's)"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "bench quality", .opts = opts,
        .usage = "[-m MODEL] [--prompts N] [--min-tokens N] [--max-tokens N] [options]",
        .about = "Bridged vs native cache on the same decoder (the CPU engine, the decoder's cache format), over a "
                 "fixed, deterministic set of needle-in-a-document prompts: a generated English document with one "
                 "fact (\"The secret code of the blue lighthouse is 48217.\") at a random depth, then "
                 "\"Question: ...\\nAnswer:\". For each prompt the decoder computes the cache itself (native), and "
                 "decodes again from the cache the bridge delivers (bridged: slabs for every position before the "
                 "last prompt token, assembled into a fresh store through the slab assembler as a decode node "
                 "does: full blocks committed, the partial tail adopted; the decoder computes only the last prompt "
                 "token).\n\n"
                 "Per prompt and bridge mode: greedy token agreement over the first --gen tokens (tokens before "
                 "the first divergence, and the fraction of identical tokens), mean next-token KL(native || "
                 "bridged) teacher-forced on the native tokens (softmax in double), and needle retrieval (the "
                 "answer in the generated text, case-insensitive) for both paths. Prints a table by prompt length "
                 "and totals; one progress line per prompt on stderr. Decoder mode is checked to be bit-exact "
                 "(identical logits at every step: KL 0, agreement 100 %); the exit status is 1 when it is not.\n\n"
                 "Modes:\n"
                 "  decoder   the bridge runs the decoder's arithmetic on the attention inputs of a prefill engine\n"
                 "            computing in the decoder's cache format; that engine's forward IS the decoder's native\n"
                 "            forward, so the bridge hooks on it (the slabs still go through the whole bridge path)\n"
                 "  prefill   a prefill engine computes in its own cache dtype (--prefill-engine-cache) and its own\n"
                 "            K/V rows are re-encoded into the decoder's format",
        .epilog = "Resuming and sharding (the default set takes hours): a run stopped part way continues where it\n"
                  "stopped when the same command is run again (--results). On two machines, then one table:\n"
                  "  A:  kvbridge bench quality --prompts 100 --results a.jsonl\n"
                  "  B:  kvbridge bench quality --first 100 --prompts 200 --results b.jsonl\n"
                  "  cat a.jsonl b.jsonl > all.jsonl\n"
                  "  kvbridge bench quality --prompts 200 --results all.jsonl --table-only\n\n"
                  "Cost: two prefills per prompt with both modes (the native forward with the decoder-mode bridge on\n"
                  "it, and the prefill engine's), plus about 3 x --gen decode steps."};
    int rc = kvb_cli_parse(&spec, argc, argv);
    if (rc != KVB_CLI_GO) return rc;
    if (o->min_tok > o->max_tok) {
        fprintf(stderr, "kvbridge bench quality: --min-tokens %lld is above --max-tokens %lld\n", o->min_tok,
                o->max_tok);
        return 2;
    }
    if (o->table_only && !o->results) {
        fprintf(stderr, "kvbridge bench quality: --table-only tabulates the results of earlier runs: give their "
                        "file with --results FILE\n");
        return 2;
    }
    if (o->table_only && o->first) {
        fprintf(stderr, "kvbridge bench quality: --first chooses the prompts to compute and --table-only computes "
                        "none (the tables cover the prompts of 1 .. --prompts that the file holds); drop --first\n");
        return 2;
    }
    if (o->first >= o->n_prompts) {
        fprintf(stderr, "kvbridge bench quality: --first %lld skips all %lld prompts of --prompts %lld: nothing to "
                        "compute (--first I computes prompts I+1 .. --prompts)\n", o->first, o->n_prompts,
                o->n_prompts);
        return 2;
    }
    if (!o->model) {
        kvb_gemma3_path(model_buf, cap);
        o->model = model_buf;
    }
    return KVB_CLI_GO;
}

static kvb_status bench_setup(qbench *q, kvb_err *err) {
    const qopts *o = q->o;
    kvb_status st = kvb_model_load(o->model, &q->m, err);
    if (st) return st;
    if ((st = kvb_tokenizer_load(q->m->gguf, &q->tok, err))) return st;
    q->n_vocab = q->m->d.n_vocab;
    q->gen = (uint32_t)o->gen;
    const uint64_t need = (uint64_t)o->max_tok + (uint64_t)o->max_tok / 8 + q->gen + BLOCK_TOKENS;
    const uint32_t train = q->m->d.n_ctx_train;
    if ((uint64_t)o->max_tok + q->gen + 1 > train)
        return kvb_err_set(err, KVB_ERR_RANGE,
                           "--max-tokens %lld + --gen %u exceed the model's context of %u tokens", o->max_tok, q->gen,
                           train);
    q->max_ctx = need < train ? (uint32_t)need : train;
    kvb_sampler_opts so = {.temperature = 0};
    if ((st = kvb_sampler_init(&q->greedy, &so, q->n_vocab, err))) return st;
    q->native_logits = malloc(sizeof(float) * q->gen * q->n_vocab);
    q->logits = malloc(sizeof(float) * q->n_vocab);
    q->native_ids = malloc(sizeof(int32_t) * q->gen);
    q->bridged_ids = malloc(sizeof(int32_t) * q->gen);
    q->ctx = malloc(sizeof(int32_t) * ((size_t)q->max_ctx + 1));
    if (!q->native_logits || !q->logits || !q->native_ids || !q->bridged_ids || !q->ctx)
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    q->dec_opts = (kvb_engine_opts){.n_threads = (int)o->threads, .cache_dtype = o->cache_type,
                                    .block_tokens = BLOCK_TOKENS, .max_ctx = q->max_ctx, .max_batch = MAX_BATCH};
    kvb_kvformat fmt;
    if ((st = kvb_model_kvformat(&q->m->d, o->cache_type, BLOCK_TOKENS, &fmt, err)))
        return st;
    for (int m = 0; m < N_MODES && !st; m++)
        if (o->modes[m]) st = kvb_bridge_cpu_create(q->m, &fmt, NULL, MAX_BATCH, &q->br[m], err);
    if (st) return st;
    /* the decoder: in decoder mode the bridge rides on its native forward (see the file comment) */
    kvb_engine_opts eo = q->dec_opts;
    if (o->modes[MODE_DECODER]) {
        eo.layer_hook = kvb_bridge_cpu_layer;
        eo.layer_hook_ctx = q->br[MODE_DECODER];
        kvb_bridge_cpu_begin(q->br[MODE_DECODER], 0, 0, NULL, NULL);
        kvb_bridge_cpu_set_perturbed(q->br[MODE_DECODER], o->perturb);
    }
    if ((st = kvb_engine_create(q->m, &eo, &q->dec, err))) return st;
    if (o->modes[MODE_PREFILL]) {
        kvb_engine_opts po = q->dec_opts;
        po.cache_dtype = o->prefill_cache_type;
        po.rows_hook = kvb_bridge_cpu_rows;
        po.rows_hook_ctx = q->br[MODE_PREFILL];
        if ((st = kvb_engine_create(q->m, &po, &q->pre, err))) return st;
        kvb_bridge_cpu_begin(q->br[MODE_PREFILL], 0, 0, NULL, NULL);
    }
    return KVB_OK;
}

static void bench_free(qbench *q) {
    kvb_engine_free(q->pre);
    kvb_engine_free(q->dec);
    for (int m = 0; m < N_MODES; m++) kvb_bridge_cpu_free(q->br[m]);
    kvb_sampler_free(&q->greedy);
    free(q->native_logits);
    free(q->logits);
    free(q->native_ids);
    free(q->bridged_ids);
    free(q->ctx);
    kvb_tokenizer_free(q->tok);
    kvb_model_free(q->m);
}

static void progress(const qbench *q, uint32_t i, const prompt_result *p) {
    fprintf(stderr, "[%u/%lld] %u tokens (ship %u): native %.1f s, needle %s", i + 1, q->o->n_prompts, p->tokens,
            p->ship, p->native_s, p->needle_native ? "yes" : "no");
    for (int m = 0; m < N_MODES; m++) {
        if (!q->o->modes[m]) continue;
        const mode_result *r = &p->m[m];
        char a[32], b[32];
        fmt_kl(a, sizeof a, r->kl_mean);
        fmt_kl(b, sizeof b, r->kl_max);
        fprintf(stderr, " | %s: agree %u/%u, same %.1f%%, KL %s (max %s), needle %s, %.1f s", k_mode_names[m],
                r->agree, q->gen, 100.0 * r->same / q->gen, a, b, r->needle ? "yes" : "no", r->seconds);
    }
    fprintf(stderr, "\n");
}

/* Decoder mode's claim, checked on every prompt of pr[0, n) (the prompts present): logits
 * bit-identical at every step. */
static bool decoder_claim(uint32_t gen, const prompt_result *pr, uint32_t n) {
    uint32_t ok = 0, steps = 0, exact = 0, first_bad = UINT32_MAX;
    for (uint32_t i = 0; i < n; i++) {
        const mode_result *r = &pr[i].m[MODE_DECODER];
        const bool good = r->exact == gen && r->agree == gen && r->same == gen && r->kl_max == 0 &&
                          r->kl_mean == 0 && r->needle == pr[i].needle_native;
        ok += good;
        if (!good && first_bad == UINT32_MAX) first_bad = i;
        steps += gen;
        exact += r->exact;
    }
    if (ok == n) {
        printf("\ndecoder mode, checked: on %u/%u prompts the bridged decoder's next-token logits were bit-identical "
               "to the native ones at every step (%u/%u steps), so KL = 0 exactly and %u/%u generated tokens agree: "
               "decoder-exact holds.\n",
               ok, n, exact, steps, gen, gen);
        return true;
    }
    const mode_result *r = &pr[first_bad].m[MODE_DECODER];
    printf("\ndecoder mode FAILED its claim: %u/%u prompts bit-exact (%u/%u steps with identical logits); first "
           "failure: prompt %u (%u tokens): %u/%u steps identical, agreement %u/%u, max KL %.3g. The bridge no "
           "longer reproduces the decoder's own cache (run kvbridge verify).\n",
           ok, n, exact, steps, pr[first_bad].index + 1, pr[first_bad].tokens, r->exact, gen, r->agree, gen, r->kl_max);
    return false;
}

/* The "modes" and "prompts" lines of the header. */
static void print_settings(const qopts *o) {
    printf("modes     ");
    if (o->modes[MODE_DECODER])
        printf(" decoder (the bridge on the decoder's own forward%s)", o->perturb ? "; PERTURBED bridge: test-only" : "");
    if (o->modes[MODE_PREFILL])
        printf("%s prefill (prefill engine cache %s, rows re-encoded to %s)", o->modes[MODE_DECODER] ? ";" : "",
               kvb_type_name(o->prefill_cache_type), kvb_type_name(o->cache_type));
    printf("\nprompts    %lld needle-in-a-document prompts, %lld-%lld tokens, seed %llu; greedy, %lld tokens per path\n",
           o->n_prompts, o->min_tok, o->max_tok, (unsigned long long)o->seed, o->gen);
}

/* Computes the prompts of [o->first, --prompts) that have[] does not hold yet, appending each to
 * the results file when there is one (from `keep`: see results_load); *computed of them. */
static kvb_status compute(qbench *q, prompt_result *pr, bool *have, long keep, uint32_t *computed, kvb_err *err) {
    const qopts *o = q->o;
    int fd = -1;
    cJSON *run = NULL;
    kvb_status st = KVB_OK;
    bool todo = false;
    for (uint32_t i = (uint32_t)o->first; i < (uint32_t)o->n_prompts; i++) todo = todo || !have[i];
    if (o->results && todo) {
        if (!(run = run_json(o, &q->m->fingerprint))) st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        else if ((fd = results_open(o->results, keep, err)) < 0) st = err->code;
    }
    for (uint32_t i = (uint32_t)o->first; i < (uint32_t)o->n_prompts && !st; i++) {
        if (have[i]) continue;
        int32_t *ids = NULL;
        uint32_t n = 0;
        char *answer = NULL;
        st = make_prompt(q, i, &ids, &n, &answer, err);
        if (!st) st = run_prompt(q, ids, n, answer, &pr[i], err);
        free(ids);
        free(answer);
        if (st) {
            kvb_err_prefix(err, "prompt %u: ", i + 1);
            break;
        }
        pr[i].index = i;
        progress(q, i, &pr[i]);
        if (fd >= 0 && (st = results_append(fd, o->results, run, o->modes, &pr[i], err))) break;
        have[i] = true;
        (*computed)++;
    }
    if (fd >= 0) close(fd);
    cJSON_Delete(run);
    return st;
}

/* The decoder the prompts run on. */
static void print_decoder(const qbench *q) {
    char desc[512];
    kvb_model_describe(q->m, desc, sizeof desc);
    printf("bench quality: %s\n", q->o->model);
    printf("model      %s\n", desc);
    printf("decoder    CPU engine, %d threads, %s kernels, cache %s, %u-token blocks\n", kvb_engine_threads(q->dec),
           kvb_simd_name(), kvb_type_name(q->o->cache_type), BLOCK_TOKENS);
}

/* What a run takes from --results FILE and what --first leaves out, before it computes. */
static void print_resume(const qopts *o, const bool *have, uint32_t resumed, bool existed) {
    const uint32_t n_prompts = (uint32_t)o->n_prompts;
    if (o->results && existed) {
        printf("resumed %u prompts from %s", resumed, o->results);
        if (resumed) {
            printf(" (prompts ");
            print_ranges(have, 0, n_prompts, true);
            printf(": not computed again)");
        }
        printf("\n");
    } else if (o->results) {
        printf("results    %s (a new file): one line per prompt as it finishes\n", o->results);
    }
    bool before = false;
    for (uint32_t i = 0; i < (uint32_t)o->first; i++) before = before || !have[i];
    if (before) {
        printf("prompts ");
        print_ranges(have, 0, (uint32_t)o->first, false);
        printf(" are before --first %lld%s%s: absent from the tables\n", o->first, o->results ? " and not in " : "",
               o->results ? o->results : "");
    }
}

/* The tables by prompt length for each mode, over the prompts present (gathered at pr's front). */
static void print_tables(const qopts *o, const prompt_result *pr, uint32_t present, const bool *have) {
    const uint32_t n_prompts = (uint32_t)o->n_prompts, gen = (uint32_t)o->gen;
    if (o->results || o->first) {
        printf("\n%u of %u prompts present", present, n_prompts);
        if (present < n_prompts) {
            printf(" (absent: ");
            print_ranges(have, 0, n_prompts, false);
            printf("); the tables and the claim are over the present ones");
        }
        printf("\n");
    }
    for (int m = 0; m < N_MODES; m++) {
        if (!o->modes[m]) continue;
        printf("\nmode %s: %s\n", k_mode_names[m],
               m == MODE_DECODER ? "the bridge runs the decoder's arithmetic on the prefill engine's attention inputs"
                                 : "the prefill engine's own K/V rows re-encoded into the decoder's format");
        print_table(pr, present, m, gen);
    }
    printf("\nagree run: generated tokens before the first divergence / %u; same tokens: positions with the same "
           "token; identical: prompts with all %u the same; KL(native || bridged) per step, teacher-forced on the "
           "native tokens (mean of prompt means; max over all steps); needle: the answer in the %u generated "
           "tokens.\n",
           gen, gen, gen);
}

int kvb_bench_quality(int argc, char **argv) {
    qopts o = {0};
    char model_buf[1024];
    int prc = parse_args(argc, argv, &o, model_buf, sizeof model_buf);
    if (prc != KVB_CLI_GO) return prc;
    FILE *mf = o.table_only ? NULL : fopen(o.model, "rb");
    if (!o.table_only && !mf) {
        fprintf(stderr, "kvbridge bench quality: %s does not exist; run tools/fetch_gemma3.sh for the Gemma 3 270M "
                        "file, or give -m MODEL\n", o.model);
        return 1;
    }
    if (mf) fclose(mf);
    qbench q = {.o = &o};
    kvb_err err = {0};
    const uint32_t n_prompts = (uint32_t)o.n_prompts, gen = (uint32_t)o.gen;
    prompt_result *pr = calloc(n_prompts, sizeof *pr);
    bool *have = calloc(n_prompts, sizeof *have), existed = false;
    uint32_t resumed = 0, computed = 0, present = 0;
    long keep = -1;
    int rc = 1;
    const double t_start = kvb_now_s();
    if (!pr || !have) {
        kvb_err_set(&err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (o.table_only) {
        printf("bench quality: tables from %s (--table-only: nothing computed)\n", o.results);
        printf("model      %s\n", base_name(o.model));
    } else {
        if (bench_setup(&q, &err)) goto fail;
        print_decoder(&q);
    }
    print_settings(&o);
    if (o.results &&
        results_load(&o, o.table_only ? NULL : &q.m->fingerprint, pr, have, &resumed, &existed, &keep, &err))
        goto fail;
    if (o.table_only && !existed) {
        kvb_err_set(&err, KVB_ERR_NOT_FOUND, "%s does not exist: --table-only tabulates the file that runs with "
                    "--results FILE (and without --table-only) write", o.results);
        goto fail;
    }
    if (!o.table_only) {
        print_resume(&o, have, resumed, existed);
        fflush(stdout);
        if (compute(&q, pr, have, keep, &computed, &err)) goto fail;
    }
    /* the tables and the claim are over the prompts present, gathered at the front of pr */
    for (uint32_t i = 0; i < n_prompts; i++)
        if (have[i]) pr[present++] = pr[i];
    if (!present) {
        kvb_err_set(&err, KVB_ERR_NOT_FOUND, "%s holds none of prompts 1-%u of these settings: nothing to tabulate",
                    o.results, n_prompts);
        goto fail;
    }
    print_tables(&o, pr, present, have);
    rc = 0;
    if (o.modes[MODE_DECODER] && !decoder_claim(gen, pr, present)) rc = 1;
    if (o.table_only) printf("\nbench quality: %u of %u prompts, tabulated from %s\n", present, n_prompts, o.results);
    else {
        printf("\nbench quality: %u prompts in %.1f s", computed, kvb_now_s() - t_start);
        if (resumed) printf(", %u resumed from %s", resumed, o.results);
        printf("\n");
    }
    goto done;
fail:
    fprintf(stderr, "kvbridge bench quality: %s\n", err.msg);
done:
    bench_free(&q);
    free(pr);
    free(have);
    return rc;
}
