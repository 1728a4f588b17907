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
 * claim, exit status 1 when it does not hold. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static void help(FILE *f) {
    fprintf(f,
            "usage: kvbridge bench quality [-m MODEL] [--prompts N] [--min-tokens N] [--max-tokens N] [options]\n\n"
            "Bridged vs native cache on the same decoder (the CPU engine, the decoder's cache format), over a\n"
            "fixed, deterministic set of needle-in-a-document prompts: a generated English document with one\n"
            "fact (\"The secret code of the blue lighthouse is 48217.\") at a random depth, then\n"
            "\"Question: ...\\nAnswer:\". For each prompt the decoder computes the cache itself (native), and\n"
            "decodes again from the cache the bridge delivers (bridged: slabs for every position before the\n"
            "last prompt token, assembled into a fresh store through the slab assembler as a decode node does:\n"
            "full blocks committed, the partial tail adopted; the decoder computes only the last prompt token).\n\n"
            "Per prompt and bridge mode: greedy token agreement over the first --gen tokens (tokens before the\n"
            "first divergence, and the fraction of identical tokens), mean next-token KL(native || bridged)\n"
            "teacher-forced on the native tokens (softmax in double), and needle retrieval (the answer in the\n"
            "generated text, case-insensitive) for both paths. Prints a table by prompt length and totals;\n"
            "one progress line per prompt on stderr. Decoder mode is checked to be bit-exact (identical logits\n"
            "at every step: KL 0, agreement 100 %%); the exit status is 1 when it is not.\n\n"
            "Modes:\n"
            "  decoder   the bridge runs the decoder's arithmetic on the attention inputs of a prefill engine\n"
            "            computing in the decoder's cache format; that engine's forward IS the decoder's native\n"
            "            forward, so the bridge hooks on it (the slabs still go through the whole bridge path)\n"
            "  prefill   a prefill engine computes in its own cache dtype (--prefill-engine-cache) and its own\n"
            "            K/V rows are re-encoded into the decoder's format\n\n"
            "  -m, --model FILE         GGUF model (default: the Gemma 3 270M file tools/fetch_gemma3.sh installs,\n"
            "                           ~/.cache/kvbridge/gemma-3-270m-q4_k_m.gguf)\n"
            "  --prompts N              prompts (default 200)\n"
            "  --min-tokens N           shortest prompt in tokens (default 1024)\n"
            "  --max-tokens N           longest prompt in tokens (default 30720); lengths go round-robin over\n"
            "                           the octaves [min, 2 min), [2 min, 4 min), ... and are uniform inside\n"
            "                           one, so prompt i is the same whatever --prompts says\n"
            "  --seed S                 the prompt set (default 1)\n"
            "  --gen N                  greedy tokens per prompt and path (default 64)\n"
            "  --modes LIST             decoder,prefill (default both)\n"
            "  --cache-type T           the decoder's cache dtype: f16 (default), f32, bf16, q8_0\n"
            "  --prefill-engine-cache T the prefill engine's own cache dtype in mode prefill (default f32)\n"
            "  --threads T              CPU threads (default: all)\n"
            "  --verbose                also print each prompt's generated texts (stderr)\n"
            "  --perturb                test-only: perturb the decoder-mode bridge by one reordered addition\n"
            "                           (as kvbridge verify --perturb); the decoder-mode claim must then fail\n\n"
            "Cost: two prefills per prompt with both modes (the native forward with the decoder-mode bridge on\n"
            "it, and the prefill engine's), plus about 3 x --gen decode steps.\n");
}

typedef struct {
    const char *model;
    long long n_prompts, min_tok, max_tok, gen, threads;
    uint64_t seed;
    uint32_t cache_type, prefill_cache_type;
    bool modes[N_MODES];
    bool verbose;
    bool perturb;
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
 * that every shipped block was committed and the tail (the partial block before the last prompt
 * token, if any) arrived whole; *tail receives its page (owned by the caller) or KVB_BLOCK_NONE. */
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
        const uint32_t missing = rcv ? kvb_bridge_receiver_missing(rcv) : 0;
        if (!st && missing)
            st = kvb_err_set(err, KVB_ERR_INTERNAL, "the bridge left %u of its blocks (tail included) incomplete",
                             missing);
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

/* ---- the command ----------------------------------------------------------------------------- */

static int parse_modes(const char *v, bool modes[N_MODES]) {
    modes[MODE_DECODER] = modes[MODE_PREFILL] = false;
    const char *p = v;
    while (*p) {
        size_t len = strcspn(p, ",");
        int m = -1;
        for (int k = 0; k < N_MODES; k++)
            if (len == strlen(k_mode_names[k]) && !strncmp(p, k_mode_names[k], len)) m = k;
        if (m < 0) {
            fprintf(stderr, "kvbridge bench quality: --modes expects decoder, prefill or decoder,prefill, got '%s'\n", v);
            return -1;
        }
        modes[m] = true;
        p += len;
        if (*p == ',') p++;
    }
    if (!modes[MODE_DECODER] && !modes[MODE_PREFILL]) {
        fprintf(stderr, "kvbridge bench quality: --modes names no mode\n");
        return -1;
    }
    return 0;
}

static int parse_args(int argc, char **argv, qopts *o, char *model_buf, size_t cap) {
    const char *cmd = "bench quality";
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v;
        if (kvb_arg_is_help(a)) {
            help(stdout);
            return 1;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            if (!(o->model = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--prompts")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 100000, &o->n_prompts)) return 2;
        } else if (!strcmp(a, "--min-tokens")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 64, 1 << 20, &o->min_tok)) return 2;
        } else if (!strcmp(a, "--max-tokens")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 64, 1 << 20, &o->max_tok)) return 2;
        } else if (!strcmp(a, "--gen")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 4096, &o->gen)) return 2;
        } else if (!strcmp(a, "--threads")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 1024, &o->threads)) return 2;
        } else if (!strcmp(a, "--seed")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_u64(cmd, a, v, &o->seed)) return 2;
        } else if (!strcmp(a, "--modes")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || parse_modes(v, o->modes)) return 2;
        } else if (!strcmp(a, "--cache-type")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_type(cmd, a, v, &o->cache_type)) return 2;
        } else if (!strcmp(a, "--prefill-engine-cache")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_type(cmd, a, v, &o->prefill_cache_type)) return 2;
        } else if (!strcmp(a, "--verbose") || !strcmp(a, "-v")) {
            o->verbose = true;
        } else if (!strcmp(a, "--perturb")) {
            o->perturb = true;
        } else {
            fprintf(stderr, "kvbridge bench quality: unknown option '%s' (see kvbridge bench quality --help)\n", a);
            return 2;
        }
    }
    if (o->min_tok > o->max_tok) {
        fprintf(stderr, "kvbridge bench quality: --min-tokens %lld is above --max-tokens %lld\n", o->min_tok,
                o->max_tok);
        return 2;
    }
    if (!o->model) {
        kvb_gemma3_path(model_buf, cap);
        o->model = model_buf;
    }
    return 0;
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

/* Decoder mode's claim, checked on every prompt: logits bit-identical at every step. */
static bool decoder_claim(const qbench *q, const prompt_result *pr, uint32_t n) {
    uint32_t ok = 0, steps = 0, exact = 0, first_bad = UINT32_MAX;
    for (uint32_t i = 0; i < n; i++) {
        const mode_result *r = &pr[i].m[MODE_DECODER];
        const bool good = r->exact == q->gen && r->agree == q->gen && r->same == q->gen && r->kl_max == 0 &&
                          r->kl_mean == 0 && r->needle == pr[i].needle_native;
        ok += good;
        if (!good && first_bad == UINT32_MAX) first_bad = i;
        steps += q->gen;
        exact += r->exact;
    }
    if (ok == n) {
        printf("\ndecoder mode, checked: on %u/%u prompts the bridged decoder's next-token logits were bit-identical "
               "to the native ones at every step (%u/%u steps), so KL = 0 exactly and %u/%u generated tokens agree: "
               "decoder-exact holds.\n",
               ok, n, exact, steps, q->gen, q->gen);
        return true;
    }
    const mode_result *r = &pr[first_bad].m[MODE_DECODER];
    printf("\ndecoder mode FAILED its claim: %u/%u prompts bit-exact (%u/%u steps with identical logits); first "
           "failure: prompt %u (%u tokens): %u/%u steps identical, agreement %u/%u, max KL %.3g. The bridge no "
           "longer reproduces the decoder's own cache (run kvbridge verify).\n",
           ok, n, exact, steps, first_bad + 1, pr[first_bad].tokens, r->exact, q->gen, r->agree, q->gen, r->kl_max);
    return false;
}

int kvb_bench_quality(int argc, char **argv) {
    qopts o = {.n_prompts = 200, .min_tok = 1024, .max_tok = 30720, .gen = 64, .threads = 0, .seed = 1,
               .cache_type = KVB_TYPE_F16, .prefill_cache_type = KVB_TYPE_F32, .modes = {true, true}};
    char model_buf[1024];
    int prc = parse_args(argc, argv, &o, model_buf, sizeof model_buf);
    if (prc) return prc == 1 ? 0 : prc;
    FILE *mf = fopen(o.model, "rb");
    if (!mf) {
        fprintf(stderr, "kvbridge bench quality: %s does not exist; run tools/fetch_gemma3.sh for the Gemma 3 270M "
                        "file, or give -m MODEL\n", o.model);
        return 1;
    }
    fclose(mf);
    qbench q = {.o = &o};
    kvb_err err = {0};
    prompt_result *pr = calloc((size_t)o.n_prompts, sizeof *pr);
    int rc = 1;
    const double t_start = kvb_now_s();
    if (!pr) {
        kvb_err_set(&err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (bench_setup(&q, &err)) goto fail;
    char desc[512];
    kvb_model_describe(q.m, desc, sizeof desc);
    printf("bench quality: %s\n", o.model);
    printf("model      %s\n", desc);
    printf("decoder    CPU engine, %d threads, %s kernels, cache %s, %u-token blocks\n", kvb_engine_threads(q.dec),
           kvb_simd_name(), kvb_type_name(o.cache_type), BLOCK_TOKENS);
    printf("modes     ");
    if (o.modes[MODE_DECODER])
        printf(" decoder (the bridge on the decoder's own forward%s)", o.perturb ? "; PERTURBED bridge: test-only" : "");
    if (o.modes[MODE_PREFILL])
        printf("%s prefill (prefill engine cache %s, rows re-encoded to %s)", o.modes[MODE_DECODER] ? ";" : "",
               kvb_type_name(o.prefill_cache_type), kvb_type_name(o.cache_type));
    printf("\nprompts    %lld needle-in-a-document prompts, %lld-%lld tokens, seed %llu; greedy, %u tokens per path\n",
           o.n_prompts, o.min_tok, o.max_tok, (unsigned long long)o.seed, q.gen);
    fflush(stdout);
    for (uint32_t i = 0; i < (uint32_t)o.n_prompts; i++) {
        int32_t *ids = NULL;
        uint32_t n = 0;
        char *answer = NULL;
        kvb_status st = make_prompt(&q, i, &ids, &n, &answer, &err);
        if (!st) st = run_prompt(&q, ids, n, answer, &pr[i], &err);
        free(ids);
        free(answer);
        if (st) {
            kvb_err_prefix(&err, "prompt %u: ", i + 1);
            goto fail;
        }
        progress(&q, i, &pr[i]);
    }
    for (int m = 0; m < N_MODES; m++) {
        if (!o.modes[m]) continue;
        printf("\nmode %s: %s\n", k_mode_names[m],
               m == MODE_DECODER ? "the bridge runs the decoder's arithmetic on the prefill engine's attention inputs"
                                 : "the prefill engine's own K/V rows re-encoded into the decoder's format");
        print_table(pr, (uint32_t)o.n_prompts, m, q.gen);
    }
    printf("\nagree run: generated tokens before the first divergence / %u; same tokens: positions with the same "
           "token; identical: prompts with all %u the same; KL(native || bridged) per step, teacher-forced on the "
           "native tokens (mean of prompt means; max over all steps); needle: the answer in the %u generated "
           "tokens.\n",
           q.gen, q.gen, q.gen);
    rc = 0;
    if (o.modes[MODE_DECODER] && !decoder_claim(&q, pr, (uint32_t)o.n_prompts)) rc = 1;
    printf("\nbench quality: %lld prompts in %.1f s\n", o.n_prompts, kvb_now_s() - t_start);
    goto done;
fail:
    fprintf(stderr, "kvbridge bench quality: %s\n", err.msg);
done:
    bench_free(&q);
    free(pr);
    return rc;
}
