/* test_engine_vs_ref — the CPU engine against the float64 reference (tests/support/ref_model) on
 * random fixture models: every architecture (llama, qwen2, qwen3, gemma3) x every weight type (F32, F16,
 * BF16, Q8_0, Q4_0) x every way of feeding tokens (one prefill call, prefill chunked by a small
 * max_batch, token-by-token decode, prefill then decode) x 1 and 2 threads, with an F32 cache so
 * the weight path is measured alone; then each cache dtype (F16, BF16, Q8_0) on F32 and Q8_0
 * weights; then the cache-producing arithmetic (kvb_kv_produce) against the reference's K and V
 * for the same attention inputs; then the tiny-gemma3 preset on a prompt longer than its sliding
 * window (test_tiny_gemma3), the tiny-moe preset's mixture of experts (test_tiny_moe), tiny-qwen2moe's
 * with its shared expert (test_tiny_qwen2moe) and the tiny-mla preset's latent attention and DeepSeek MoE
 * (test_tiny_mla). Logits are compared by relative L2 over each token's row (the
 * worst row must pass), and greedy argmax must agree where the weights are exact. Results for 1
 * and 2 threads must be bit-identical, as kvb_engine_cpu.h promises. Tolerances are stated and
 * justified next to tol_weights() and tol_cache(). The seed is fixed for reproducibility and can
 * be changed with KVB_TEST_SEED (it is printed). Nothing is skipped. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_core.h"
#include "kvb_engine_cpu.h"
#include "kvb_model.h"
#include "kvb_quant.h"
#include "ref_fixture.h"
#include "ref_model.h"

static char g_dir[512];
static uint64_t g_seed = 20250611;

/* ---- tolerances (relative L2 of one token's logits against the float64 reference) -------------
 *
 * The reference dequantises the file's stored weights exactly, so weight quantisation itself is
 * never an error; what remains is the engine's own arithmetic. Measured values are the worst
 * token row over 30 seeds x 3 architectures x 4 feeding modes (fixture: 2 layers, n_embd 64).
 *
 *  - F32, F16, BF16 weights: every stored value is exact in f32, activations stay f32, and the
 *    canonical dot accumulates in 16 f32 lanes. Each dot over n <= 128 terms carries a relative
 *    error of about sqrt(n/16) * 2^-24 ~ 2e-7, and the matmuls, norms, softmax and RoPE (f32
 *    cos/sin table) of 2 layers keep that near 1e-7 .. 1e-6. Measured: <= 3.7e-7. Limit 1e-5:
 *    ~30x margin, and still three or more orders below a real bug (a wrong RoPE pairing, GQA map,
 *    bias or norm moves logits by 1e-2 .. 1).
 *  - Q8_0, Q4_0 weights: the engine quantises every activation vector to Q8_0 before the dot
 *    (d = amax/127 per 32 elements). The rounding error is uniform in +-d/2, an RMS of
 *    amax/(127*sqrt(12)) ~ 0.5% of a block's RMS for Gaussian-like activations (kv_produce
 *    measures 0.5% on K and V), and it enters each of the 7 projections per layer and the output
 *    head: ~1 .. 2% on the logits. Measured: <= 2.3e-2. Limit 5e-2 (a decoding bug in a quant
 *    kernel lands near 1).
 *  - The cache dtype adds its rounding of K and V: F16 (2^-11 relative, RMS ~2e-4 measured on K/V)
 *    -> measured <= 4e-4 on logits, limit 3e-3; BF16 (2^-8, RMS ~1.7e-3) -> <= 2.4e-3, limit
 *    2e-2; Q8_0 (~0.55%) -> <= 7.4e-3, limit 4e-2. Limits add to the weight limit.
 * ------------------------------------------------------------------------------------------------ */
static double tol_weights(uint32_t wt) {
    /* every weight type whose dot takes Q8_0-quantised activations (Q8_0, Q4_0, and the Q5_0 and
     * K-quant types of real files) carries the activation rounding */
    return kvb_act_type(wt) == KVB_TYPE_Q8_0 ? 5e-2 : 1e-5;
}
static double tol_cache(uint32_t ct) {
    switch (ct) {
    case KVB_TYPE_F32: return 0;
    case KVB_TYPE_F16: return 3e-3;
    case KVB_TYPE_BF16: return 2e-2;
    default: return 4e-2; /* Q8_0 */
    }
}

static const char *ARCHS[] = {"llama", "qwen2", "qwen3", "gemma3"};
static const uint32_t WTYPES[] = {KVB_TYPE_F32, KVB_TYPE_F16, KVB_TYPE_BF16, KVB_TYPE_Q8_0, KVB_TYPE_Q4_0};

typedef enum { MODE_PREFILL = 0, MODE_CHUNKED, MODE_DECODE, MODE_MIXED, MODE_COUNT } feed_mode;
static const char *MODE_NAMES[] = {"prefill", "chunked", "decode", "mixed"};

enum { N_TOK = 13, BLOCK_TOKENS = 4, CHUNK = 3, MIXED_PREFIX = 5 };

/* One fixture, loaded by both sides, with the reference logits for a random token sequence. */
typedef struct {
    char path[600];
    ref_model *ref;
    kvb_model *model;
    int n_vocab;
    int32_t toks[N_TOK];
    double *ref_logits; /* (N_TOK, n_vocab) */
} case_t;

static void case_open(case_t *c, const ref_fixture_cfg *cfg, const char *name) {
    char err[512];
    kvb_err e = {0};
    memset(c, 0, sizeof *c);
    snprintf(c->path, sizeof c->path, "%s/%s", g_dir, name);
    if (ref_fixture_write(cfg, c->path, err, sizeof err) != 0) fail_msg("fixture: %s", err);
    c->ref = ref_model_load(c->path, err, sizeof err);
    if (!c->ref) fail_msg("ref_model_load: %s", err);
    if (kvb_model_load(c->path, &c->model, &e) != KVB_OK) fail_msg("kvb_model_load: %s", e.msg);
    c->n_vocab = ref_model_n_vocab(c->ref);
    assert_int_equal((int)c->model->d.n_vocab, c->n_vocab);
    kvb_rng rng;
    kvb_rng_seed(&rng, kvb_splitmix64(cfg->seed));
    for (int i = 0; i < N_TOK; i++) c->toks[i] = (int32_t)(kvb_rng_u64(&rng) % (uint64_t)c->n_vocab);
    c->ref_logits = malloc(sizeof(double) * N_TOK * c->n_vocab);
    assert_non_null(c->ref_logits);
    assert_int_equal(ref_model_forward(c->ref, c->toks, N_TOK, c->ref_logits), 0);
}

static void case_close(case_t *c) {
    free(c->ref_logits);
    ref_model_free(c->ref);
    kvb_model_free(c->model);
}

/* Runs the engine over c->toks in the given mode; logits: (N_TOK, n_vocab). */
static void engine_run(const case_t *c, uint32_t cache, int threads, feed_mode mode, float *logits) {
    kvb_engine_opts o = {0};
    o.n_threads = threads;
    o.cache_dtype = cache;
    o.block_tokens = BLOCK_TOKENS;
    o.max_ctx = 64;
    o.max_batch = mode == MODE_CHUNKED ? CHUNK : 0;
    kvb_engine *e = NULL;
    kvb_seq *s = NULL;
    kvb_err err = {0};
    if (kvb_engine_create(c->model, &o, &e, &err) != KVB_OK) fail_msg("kvb_engine_create: %s", err.msg);
    assert_int_equal(kvb_engine_threads(e), threads);
    if (kvb_engine_kvformat(e)->dtype != cache)
        fail_msg("asked for a %s cache, the engine made %s (KVB_TYPE_F32 is 0: kvb_engine_opts cannot tell it "
                 "from \"unset\")", kvb_type_name(cache), kvb_type_name(kvb_engine_kvformat(e)->dtype));
    if (kvb_seq_create(e, &s, &err) != KVB_OK) fail_msg("kvb_seq_create: %s", err.msg);
    const size_t V = (size_t)c->n_vocab;
    kvb_status st = KVB_OK;
    switch (mode) {
    case MODE_PREFILL:
    case MODE_CHUNKED: st = kvb_engine_forward(e, s, c->toks, N_TOK, logits, true, &err); break;
    case MODE_DECODE:
        for (int t = 0; t < N_TOK && st == KVB_OK; t++)
            st = kvb_engine_forward(e, s, c->toks + t, 1, logits + t * V, false, &err);
        break;
    case MODE_MIXED:
        st = kvb_engine_forward(e, s, c->toks, MIXED_PREFIX, logits, true, &err);
        for (int t = MIXED_PREFIX; t < N_TOK && st == KVB_OK; t++)
            st = kvb_engine_forward(e, s, c->toks + t, 1, logits + t * V, false, &err);
        break;
    default: fail();
    }
    if (st != KVB_OK) fail_msg("kvb_engine_forward (%s): %s", MODE_NAMES[mode], err.msg);
    assert_int_equal(kvb_seq_len(s), N_TOK);
    kvb_seq_free(s);
    kvb_engine_free(e);
}

/* Worst per-token relative L2 of logits (N_TOK, V) against the reference; checks argmax too when
 * check_argmax (only where the reference's top-2 margin is clear of the tolerance). */
static double compare(const case_t *c, const float *logits, double tol, bool check_argmax, const char *what) {
    const int V = c->n_vocab;
    double worst = 0;
    for (int t = 0; t < N_TOK; t++) {
        const double *r = c->ref_logits + (size_t)t * V;
        const float *g = logits + (size_t)t * V;
        const double rel = ref_rel_l2(g, r, (size_t)V);
        if (!(rel <= worst)) worst = rel;
        if (!(rel <= tol))
            fail_msg("%s: token %d: rel-L2 %.3g > %.3g (max abs %.3g)", what, t, rel, tol, ref_max_abs(g, r, V));
        if (check_argmax) {
            const int best = ref_argmax(r, V);
            double second = -INFINITY, norm = 0;
            for (int i = 0; i < V; i++) {
                norm += r[i] * r[i];
                if (i != best && r[i] > second) second = r[i];
            }
            if (r[best] - second > 10 * tol * sqrt(norm) && ref_argmax_f32(g, V) != best)
                fail_msg("%s: token %d: argmax %d, reference %d", what, t, ref_argmax_f32(g, V), best);
        }
    }
    return worst;
}

/* The model module reads the fixture as the reference does. */
static void check_desc(const case_t *c) {
    const ref_desc *r = ref_model_desc(c->ref);
    const kvb_model_desc *d = &c->model->d;
    assert_int_equal((int)d->n_embd, r->n_embd);
    assert_int_equal((int)d->n_layer, r->n_layer);
    assert_int_equal((int)d->n_ff, r->n_ff);
    assert_int_equal((int)d->n_head, r->n_head);
    assert_int_equal((int)d->n_head_kv, r->n_head_kv);
    assert_int_equal((int)d->head_dim, r->head_dim);
    assert_int_equal((int)d->n_rot, r->n_rot);
    assert_int_equal(d->rope_neox, r->rope_style == REF_ROPE_NEOX);
    assert_int_equal(d->tied_output, r->tied_output);
    assert_int_equal((int)d->swa_window, r->swa_window);
    assert_true(fabs(d->attn_scale - r->attn_scale) <= 1e-7 * r->attn_scale);
    assert_true(fabs((d->embd_scale > 0 ? d->embd_scale : 1.0) - r->embd_scale) <= 1e-7 * r->embd_scale);
    double inv[256];
    assert_true(r->n_rot / 2 <= 256);
    kvb_rope_inv_freq(c->model, inv);
    for (int i = 0; i < r->n_rot / 2; i++) {
        const double want = ref_model_inv_freq(c->ref)[i];
        /* both in double; Llama-3 factors may pass through f32 on one side (~6e-8) */
        if (fabs(inv[i] - want) > 1e-6 * want) fail_msg("inv_freq[%d]: model %.17g reference %.17g", i, inv[i], want);
    }
    for (int l = 0; l < r->n_layer; l++) {
        if (kvb_layer_is_local(d, (uint32_t)l) != r->layer_local[l])
            fail_msg("layer %d: model says %s, reference %s", l, kvb_layer_is_local(d, (uint32_t)l) ? "local" : "global",
                     r->layer_local[l] ? "local" : "global");
        kvb_rope_inv_freq_layer(c->model, (uint32_t)l, inv);
        for (int i = 0; i < r->n_rot / 2; i++) {
            const double want = ref_model_inv_freq_layer(c->ref, l)[i];
            if (fabs(inv[i] - want) > 1e-6 * want)
                fail_msg("layer %d inv_freq[%d]: model %.17g reference %.17g", l, i, inv[i], want);
        }
    }
}

/* Every arch x weight type x feeding mode x thread count, F32 cache. */
static void test_weight_types(void **state) {
    (void)state;
    const size_t V_MAX = 97;
    float *l1 = malloc(sizeof(float) * N_TOK * V_MAX), *l2 = malloc(sizeof(float) * N_TOK * V_MAX);
    assert_non_null(l1);
    assert_non_null(l2);
    for (size_t a = 0; a < KVB_ARRAY_LEN(ARCHS); a++) {
        for (size_t w = 0; w < KVB_ARRAY_LEN(WTYPES); w++) {
            ref_fixture_cfg cfg;
            ref_fixture_default(&cfg, ARCHS[a], WTYPES[w], kvb_splitmix64(g_seed + 100 * a + w));
            case_t c;
            case_open(&c, &cfg, "w.gguf");
            assert_true((size_t)c.n_vocab <= V_MAX);
            check_desc(&c);
            const bool exact_weights = tol_weights(WTYPES[w]) < 1e-3;
            char line[256];
            int len = snprintf(line, sizeof line, "  %-5s %-5s cache F32:", ARCHS[a], kvb_type_name(WTYPES[w]));
            for (int mode = 0; mode < MODE_COUNT; mode++) {
                engine_run(&c, KVB_TYPE_F32, 1, (feed_mode)mode, l1);
                engine_run(&c, KVB_TYPE_F32, 2, (feed_mode)mode, l2);
                char what[128];
                snprintf(what, sizeof what, "%s %s %s", ARCHS[a], kvb_type_name(WTYPES[w]), MODE_NAMES[mode]);
                if (memcmp(l1, l2, sizeof(float) * N_TOK * c.n_vocab) != 0)
                    fail_msg("%s: 1 and 2 threads differ", what);
                const double worst = compare(&c, l1, tol_weights(WTYPES[w]), exact_weights, what);
                len += snprintf(line + len, sizeof line - (size_t)len, " %s %.2g", MODE_NAMES[mode], worst);
            }
            print_message("%s\n", line);
            case_close(&c);
        }
    }
    free(l1);
    free(l2);
}

/* Cache dtypes: head_dim 32 everywhere (Q8_0 rows need whole blocks). */
static void test_cache_types(void **state) {
    (void)state;
    const uint32_t caches[] = {KVB_TYPE_F16, KVB_TYPE_BF16, KVB_TYPE_Q8_0};
    const uint32_t wts[] = {KVB_TYPE_F32, KVB_TYPE_Q8_0};
    const size_t V_MAX = 97;
    float *l1 = malloc(sizeof(float) * N_TOK * V_MAX), *l2 = malloc(sizeof(float) * N_TOK * V_MAX);
    assert_non_null(l1);
    assert_non_null(l2);
    for (size_t a = 0; a < KVB_ARRAY_LEN(ARCHS); a++) {
        for (size_t w = 0; w < KVB_ARRAY_LEN(wts); w++) {
            ref_fixture_cfg cfg;
            ref_fixture_default(&cfg, ARCHS[a], wts[w], kvb_splitmix64(g_seed + 1000 + 10 * a + w));
            cfg.n_head = 4;
            cfg.n_head_kv = 2;
            cfg.head_dim = cfg.n_rot = 32; /* 4 x 32 != n_embd 64: key_length is written */
            case_t c;
            case_open(&c, &cfg, "c.gguf");
            check_desc(&c);
            for (size_t ci = 0; ci < KVB_ARRAY_LEN(caches); ci++) {
                char line[256];
                int len = snprintf(line, sizeof line, "  %-5s %-5s cache %-5s:", ARCHS[a], kvb_type_name(wts[w]),
                                   kvb_type_name(caches[ci]));
                const feed_mode modes[] = {MODE_PREFILL, MODE_DECODE, MODE_MIXED};
                for (size_t mi = 0; mi < KVB_ARRAY_LEN(modes); mi++) {
                    engine_run(&c, caches[ci], 1, modes[mi], l1);
                    engine_run(&c, caches[ci], 2, modes[mi], l2);
                    char what[128];
                    snprintf(what, sizeof what, "%s %s cache %s %s", ARCHS[a], kvb_type_name(wts[w]),
                             kvb_type_name(caches[ci]), MODE_NAMES[modes[mi]]);
                    if (memcmp(l1, l2, sizeof(float) * N_TOK * c.n_vocab) != 0)
                        fail_msg("%s: 1 and 2 threads differ", what);
                    const double worst = compare(&c, l1, tol_weights(wts[w]) + tol_cache(caches[ci]), false, what);
                    len += snprintf(line + len, sizeof line - (size_t)len, " %s %.2g", MODE_NAMES[modes[mi]], worst);
                }
                print_message("%s\n", line);
            }
            case_close(&c);
        }
    }
    free(l1);
    free(l2);
}

/* kvb_kv_produce: the same attention inputs give the reference's K (after RoPE) and V, decoded
 * from the cache rows, within the weight + cache tolerances (measured per layer over all rows). */
static void test_kv_produce(void **state) {
    (void)state;
    const uint32_t caches[] = {KVB_TYPE_F32, KVB_TYPE_F16, KVB_TYPE_BF16, KVB_TYPE_Q8_0};
    for (size_t a = 0; a < KVB_ARRAY_LEN(ARCHS); a++) {
        for (size_t w = 0; w < KVB_ARRAY_LEN(WTYPES); w++) {
            ref_fixture_cfg cfg;
            ref_fixture_default(&cfg, ARCHS[a], WTYPES[w], kvb_splitmix64(g_seed + 5000 + 10 * a + w));
            cfg.head_dim = cfg.n_rot = 32;
            case_t c;
            case_open(&c, &cfg, "kv.gguf");
            const ref_desc *d = ref_model_desc(c.ref);
            const int E = d->n_embd, KD = d->n_head_kv * d->head_dim, half = d->n_rot / 2;
            double *h = malloc(sizeof(double) * N_TOK * E), *rk = malloc(sizeof(double) * N_TOK * KD),
                   *rv = malloc(sizeof(double) * N_TOK * KD);
            float *hf = malloc(sizeof(float) * N_TOK * E), *cs = malloc(sizeof(float) * N_TOK * half),
                  *sn = malloc(sizeof(float) * N_TOK * half), *kf = malloc(sizeof(float) * N_TOK * KD),
                  *vf = malloc(sizeof(float) * N_TOK * KD);
            /* the tables as the engine and the bridge hand them out: each layer's own (gemma3's local
             * layers rotate with another base) */
            kvb_rope_tables rope;
            kvb_err rerr = {0};
            if (kvb_rope_tables_init(&rope, c.model, N_TOK, &rerr) != KVB_OK) fail_msg("%s", rerr.msg);
            kvb_rope_tables_fill(&rope, 0, N_TOK);
            char line[256];
            int len = snprintf(line, sizeof line, "  kv_produce %-5s %-5s:", ARCHS[a], kvb_type_name(WTYPES[w]));
            for (size_t ci = 0; ci < KVB_ARRAY_LEN(caches); ci++) {
                const size_t rb = kvb_row_bytes(caches[ci], d->head_dim);
                uint8_t *krows = malloc(rb * N_TOK * d->n_head_kv), *vrows = malloc(rb * N_TOK * d->n_head_kv);
                void *scratch = kvb_aligned_alloc(64, kvb_kv_produce_scratch_bytes(c.model, N_TOK));
                assert_non_null(scratch);
                double worst = 0;
                for (int l = 0; l < d->n_layer; l++) {
                    assert_int_equal(ref_model_attn_input(c.ref, c.toks, N_TOK, l, h), 0);
                    assert_int_equal(ref_model_kv(c.ref, c.toks, N_TOK, l, rk, rv), 0);
                    for (int i = 0; i < N_TOK * E; i++) hf[i] = (float)h[i];
                    const float *lc, *ls;
                    kvb_rope_tables_layer(&rope, (uint32_t)l, &lc, &ls);
                    /* the table is the one kvb_rope_table makes from the layer's own frequencies */
                    double inv[128];
                    assert_true(half <= 128);
                    kvb_rope_inv_freq_layer(c.model, (uint32_t)l, inv);
                    kvb_rope_table(inv, (uint32_t)d->n_rot, 0, N_TOK, cs, sn);
                    assert_memory_equal(cs, lc, sizeof(float) * N_TOK * half);
                    assert_memory_equal(sn, ls, sizeof(float) * N_TOK * half);
                    kvb_kv_produce_args args = {.m = c.model, .layer = (uint32_t)l, .cache_dtype = caches[ci],
                                                .pool = NULL, .rope_cos = lc, .rope_sin = ls};
                    kvb_kv_produce(&args, hf, N_TOK, scratch, krows, vrows);
                    for (int r = 0; r < N_TOK * d->n_head_kv; r++) {
                        kvb_row_to_f32(caches[ci], krows + (size_t)r * rb, kf + (size_t)r * d->head_dim, d->head_dim);
                        kvb_row_to_f32(caches[ci], vrows + (size_t)r * rb, vf + (size_t)r * d->head_dim, d->head_dim);
                    }
                    const double ek = ref_rel_l2(kf, rk, (size_t)N_TOK * KD), ev = ref_rel_l2(vf, rv, (size_t)N_TOK * KD);
                    const double tol = tol_weights(WTYPES[w]) + tol_cache(caches[ci]);
                    if (!(ek <= tol) || !(ev <= tol))
                        fail_msg("kv_produce %s %s cache %s layer %d: K rel-L2 %.3g, V %.3g > %.3g", ARCHS[a],
                                 kvb_type_name(WTYPES[w]), kvb_type_name(caches[ci]), l, ek, ev, tol);
                    worst = fmax(worst, fmax(ek, ev));
                }
                len += snprintf(line + len, sizeof line - (size_t)len, " %s %.2g", kvb_type_name(caches[ci]), worst);
                free(krows);
                free(vrows);
                kvb_aligned_free(scratch);
            }
            print_message("%s\n", line);
            kvb_rope_tables_free(&rope);
            free(h);
            free(rk);
            free(rv);
            free(hf);
            free(cs);
            free(sn);
            free(kf);
            free(vf);
            case_close(&c);
        }
    }
}

/* Llama-3 scaling (as keys and as rope_freqs.weight) and tied output through the engine. */
static void test_rope_scaling_and_tied(void **state) {
    (void)state;
    const size_t V_MAX = 97;
    float *l = malloc(sizeof(float) * N_TOK * V_MAX);
    assert_non_null(l);
    const ref_fix_rope ropes[] = {REF_FIX_ROPE_LLAMA3_KEYS, REF_FIX_ROPE_LLAMA3_TENSOR};
    for (size_t r = 0; r < KVB_ARRAY_LEN(ropes); r++) {
        ref_fixture_cfg cfg;
        ref_fixture_default(&cfg, "llama", KVB_TYPE_F32, kvb_splitmix64(g_seed + 9000 + r));
        cfg.rope = ropes[r];
        cfg.output = REF_FIX_OUTPUT_TIED;
        case_t c;
        case_open(&c, &cfg, "s.gguf");
        check_desc(&c);
        assert_true(ref_model_desc(c.ref)->tied_output);
        for (int mode = 0; mode < MODE_COUNT; mode++) {
            engine_run(&c, KVB_TYPE_F32, 2, (feed_mode)mode, l);
            char what[96];
            snprintf(what, sizeof what, "llama3 rope (%s) tied %s", r ? "tensor" : "keys", MODE_NAMES[mode]);
            compare(&c, l, tol_weights(KVB_TYPE_F32), true, what);
        }
        case_close(&c);
    }
    free(l);
}

/* tiny-gemma3 (the gen-model preset: 6 layers, 0-4 local with a 16-token window, 5 global) on a
 * 40-token prompt, so every local layer's window slides past its first 24 keys and the cache spans
 * 5 blocks of 8: the engine against the reference in F32, F16, Q8_0, Q4_0 (and Q5_0, Q4_K, Q6_K
 * when quant computes them) weights with F32 and
 * F16 caches; one-shot prefill, prefill chunked by 7 tokens, token-by-token decode and prefill +
 * decode all give bit-identical logits (and 1 and 2 threads too), as kvb_engine_cpu.h promises.
 * Tolerances as in tol_weights() / tol_cache(). */
enum { G3_TOK = 40, G3_BLOCK = 8, G3_CHUNK = 7, G3_PREFIX = 19 };

static void gemma3_engine_run(const kvb_model *m, const int32_t *toks, uint32_t cache, int threads, feed_mode mode,
                              float *logits) {
    kvb_engine_opts o = {.n_threads = threads, .cache_dtype = cache, .block_tokens = G3_BLOCK, .max_ctx = 64,
                         .max_batch = mode == MODE_CHUNKED ? G3_CHUNK : 0};
    kvb_engine *e = NULL;
    kvb_seq *s = NULL;
    kvb_err err = {0};
    if (kvb_engine_create(m, &o, &e, &err) != KVB_OK || kvb_seq_create(e, &s, &err) != KVB_OK)
        fail_msg("engine: %s", err.msg);
    const size_t V = m->d.n_vocab;
    kvb_status st = KVB_OK;
    const uint32_t prefix = mode == MODE_DECODE ? 0 : mode == MODE_MIXED ? G3_PREFIX : G3_TOK;
    if (prefix) st = kvb_engine_forward(e, s, toks, prefix, logits, true, &err);
    for (uint32_t t = prefix; t < G3_TOK && st == KVB_OK; t++)
        st = kvb_engine_forward(e, s, toks + t, 1, logits + t * V, false, &err);
    if (st != KVB_OK) fail_msg("kvb_engine_forward (%s): %s", MODE_NAMES[mode], err.msg);
    kvb_seq_free(s);
    kvb_engine_free(e);
}

/* Generates preset `preset` in weight type wt into the test directory and loads it both ways. */
static void preset_case(const char *preset, uint32_t wt, uint64_t seed, case_t *c) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s.gguf", g_dir, preset);
    kvb_gen_opts go = {.preset = preset, .type = wt, .seed = seed, .n_threads = 2};
    kvb_err err = {0};
    if (kvb_gen_model(&go, path, &err) != KVB_OK) fail_msg("gen-model: %s", err.msg);
    memset(c, 0, sizeof *c);
    char rerr[512];
    c->ref = ref_model_load(path, rerr, sizeof rerr);
    if (!c->ref) fail_msg("ref_model_load: %s", rerr);
    if (kvb_model_load(path, &c->model, &err) != KVB_OK) fail_msg("kvb_model_load: %s", err.msg);
    check_desc(c);
}

/* A G3_TOK-token prompt drawn from seed into toks, and the logit buffers (G3_TOK, V) for the
 * reference (*ref), the one-shot prefill (*one) and the other modes (*l); returns V. */
static int draw_prompt(const case_t *c, uint64_t seed, int32_t *toks, double **ref, float **one, float **l) {
    const int V = ref_model_n_vocab(c->ref);
    kvb_rng rng;
    kvb_rng_seed(&rng, kvb_splitmix64(seed));
    for (int i = 0; i < G3_TOK; i++) toks[i] = (int32_t)(kvb_rng_u64(&rng) % (uint64_t)V);
    *ref = malloc(sizeof(double) * G3_TOK * V);
    *one = malloc(sizeof(float) * G3_TOK * V);
    *l = malloc(sizeof(float) * G3_TOK * V);
    assert_non_null(*ref);
    assert_non_null(*one);
    assert_non_null(*l);
    return V;
}

static void free_case(case_t *c, double *ref, float *one, float *l) {
    free(ref);
    free(one);
    free(l);
    ref_model_free(c->ref);
    kvb_model_free(c->model);
}

/* With exact weights (tol < 1e-3) greedy agrees with the reference `ref` (G3_TOK, V) on every
 * token where the reference's top-2 are clear; and every other feeding mode with 1 and 2 threads
 * gives the one-shot prefill's logits `one` (G3_TOK, V) bit for bit; l: scratch of that size. */
static void argmax_and_modes(case_t *c, const char *preset, uint32_t wt, uint32_t cache, double tol,
                             const int32_t *toks, double *ref, const float *one, float *l) {
    const size_t V = c->model->d.n_vocab;
    if (tol < 1e-3) {
        char what[64];
        snprintf(what, sizeof what, "%s argmax", preset);
        c->n_vocab = (int)V;
        memcpy(c->toks, toks, sizeof c->toks); /* compare() reads N_TOK rows: the first 13 */
        c->ref_logits = ref;
        compare(c, one, tol, true, what);
        c->ref_logits = NULL;
    }
    for (int mode = MODE_CHUNKED; mode < MODE_COUNT; mode++)
        for (int threads = 1; threads <= 2; threads++) {
            gemma3_engine_run(c->model, toks, cache, threads, (feed_mode)mode, l);
            if (memcmp(l, one, sizeof(float) * G3_TOK * V) != 0)
                fail_msg("%s %s cache %s: %s with %d thread(s) differs from one-shot prefill", preset,
                         kvb_type_name(wt), kvb_type_name(cache), MODE_NAMES[mode], threads);
        }
}

static void test_tiny_gemma3(void **state) {
    (void)state;
    /* plus the types of the real Gemma 3 Q4_K_M file (Q5_0, Q4_K, Q6_K) where quant computes them */
    const uint32_t wtypes[] = {KVB_TYPE_F32, KVB_TYPE_F16, KVB_TYPE_Q8_0, KVB_TYPE_Q4_0,
                               KVB_TYPE_Q5_0, KVB_TYPE_Q4_K, KVB_TYPE_Q6_K};
    const uint32_t caches[] = {KVB_TYPE_F32, KVB_TYPE_F16};
    for (size_t w = 0; w < KVB_ARRAY_LEN(wtypes); w++) {
        if (!kvb_type_get(wtypes[w])->supported) {
            print_message("  tiny-gemma3 %s: not computed by quant yet, not run\n", kvb_type_name(wtypes[w]));
            continue;
        }
        case_t c;
        preset_case("tiny-gemma3", wtypes[w], g_seed + w, &c);
        const kvb_model_desc *d = &c.model->d;
        assert_int_equal(d->swa_window, 16);
        assert_true(G3_TOK > 2 * d->swa_window);
        for (uint32_t l = 0; l < d->n_layer; l++) assert_int_equal(kvb_layer_is_local(d, l), l != 5);
        int32_t toks[G3_TOK];
        double *ref;
        float *one, *l;
        const int V = draw_prompt(&c, g_seed + 77 + w, toks, &ref, &one, &l);
        assert_int_equal(ref_model_forward(c.ref, toks, G3_TOK, ref), 0);
        for (size_t ci = 0; ci < KVB_ARRAY_LEN(caches); ci++) {
            const double tol = tol_weights(wtypes[w]) + tol_cache(caches[ci]);
            double worst = 0, worst_late = 0;
            gemma3_engine_run(c.model, toks, caches[ci], 2, MODE_PREFILL, one);
            int top1 = 0;
            for (int t = 0; t < G3_TOK; t++) {
                const double rel = ref_rel_l2(one + (size_t)t * V, ref + (size_t)t * V, (size_t)V);
                if (!(rel <= tol))
                    fail_msg("tiny-gemma3 %s cache %s token %d: rel-L2 %.3g > %.3g", kvb_type_name(wtypes[w]),
                             kvb_type_name(caches[ci]), t, rel, tol);
                worst = fmax(worst, rel);
                if (t >= (int)d->swa_window) worst_late = fmax(worst_late, rel);
                top1 += ref_argmax_f32(one + (size_t)t * V, V) == ref_argmax(ref + (size_t)t * V, V);
            }
            argmax_and_modes(&c, "tiny-gemma3", wtypes[w], caches[ci], tol, toks, ref, one, l);
            print_message("  tiny-gemma3 %-5s cache %-4s: worst rel-L2 %.2g (tokens past the window %.2g), "
                          "top-1 %d/%d, chunked == decode == mixed == one-shot\n",
                          kvb_type_name(wtypes[w]), kvb_type_name(caches[ci]), worst, worst_late, top1, G3_TOK);
        }
        free_case(&c, ref, one, l);
    }
}

/* tiny-moe (the gen-model qwen3moe preset: 3 layers, 8 experts, top-2, renormalised) on the same
 * 40-token prompt and feeding modes as tiny-gemma3: the engine's router, grouped experts and
 * weighted sum against the reference's per-token top-k FFN in every weight type quant computes,
 * with F32 and F16 caches; one-shot prefill, chunked prefill (7 tokens: each chunk groups its own
 * tokens by expert), token-by-token decode (only the routed experts' rows) and prefill + decode
 * give bit-identical logits with 1 and 2 threads. Routing is discontinuous: a token whose reference
 * router logits at the top-k boundary differ by less than the perturbation the tolerance allows
 * (MOE_CLOSE_GAP x tol, in logits) in some layer may take another expert (measured with Q8_0
 * activations and the router of std 2: a flip at a gap of 0.004 gave rel-L2 0.21 on that token,
 * while its neighbours stayed at 0.01); such tokens are left out of the logit check and counted
 * (at most MOE_MAX_CLOSE). A flipped token's K and V reach the later tokens through attention
 * (measured: F16 weights, F16 cache, a flip at a gap of 0.0002 put the next token at rel-L2 0.012
 * against tol 0.003, and a later token with a gap of 0.04 flipped too), so the tokens after one
 * too close to call are held to tol + MOE_FLIP_SPILL, with the gap they must clear widened alike.
 * With exact weights and an F32 cache (tol 1e-5) only ties closer than 1e-5 are left out, so
 * there every routing decision and every token is checked at 1e-5. */
enum { MOE_MAX_CLOSE = G3_TOK / 2 }; /* at least half the tokens are checked */
#define MOE_CLOSE_GAP 1.0   /* router-logit margin per unit of the logit tolerance */
#define MOE_FLIP_SPILL 5e-2 /* added to the tolerance of the tokens after one too close to call */
/* A mixture of experts' one-shot logits `one` against the reference's `ref` (G3_TOK, V) token by token
 * within tol, leaving out (and counting) the tokens routed within MOE_CLOSE_GAP x tol of a tie (gaps)
 * and holding the tokens after one to tol + MOE_FLIP_SPILL; at most MOE_MAX_CLOSE left out. Returns
 * how many were; *worst: the worst rel-L2 checked; *top1: checked tokens whose argmax agrees. */
static int moe_logits_check(const char *preset, uint32_t wt, uint32_t cache, double tol, const double *gaps,
                            const double *ref, const float *one, int V, double *worst, int *top1) {
    int close = 0;
    *worst = 0;
    *top1 = 0;
    for (int t = 0; t < G3_TOK; t++) {
        const double rel = ref_rel_l2(one + (size_t)t * V, ref + (size_t)t * V, (size_t)V);
        const double tol_t = close ? tol + MOE_FLIP_SPILL : tol; /* downstream of a token too close */
        if (gaps[t] < MOE_CLOSE_GAP * tol_t) { /* too close to call at this tolerance */
            close++;
            continue;
        }
        if (!(rel <= tol_t))
            fail_msg("%s %s cache %s token %d: rel-L2 %.3g > %.3g", preset, kvb_type_name(wt), kvb_type_name(cache), t,
                     rel, tol_t);
        *worst = fmax(*worst, rel);
        *top1 += ref_argmax_f32(one + (size_t)t * V, V) == ref_argmax(ref + (size_t)t * V, V);
    }
    if (close > MOE_MAX_CLOSE)
        fail_msg("%s %s cache %s: %d of %d tokens route within %.2g of a tie", preset, kvb_type_name(wt),
                 kvb_type_name(cache), close, G3_TOK, MOE_CLOSE_GAP * tol);
    return close;
}

/* One mixture-of-experts preset (arch / rarch: the engine's and the reference's architecture, norm:
 * whether the top-k is renormalised, shexp: the shared expert's inner size, 0 = none) in every
 * weight type and both caches, as test_tiny_moe describes. */
static void check_moe_preset(const char *preset, kvb_arch arch, ref_arch rarch, bool norm, uint32_t shexp) {
    const uint32_t wtypes[] = {KVB_TYPE_F32, KVB_TYPE_F16, KVB_TYPE_BF16, KVB_TYPE_Q8_0,
                               KVB_TYPE_Q4_0, KVB_TYPE_Q4_K, KVB_TYPE_Q6_K};
    const uint32_t caches[] = {KVB_TYPE_F32, KVB_TYPE_F16};
    for (size_t w = 0; w < KVB_ARRAY_LEN(wtypes); w++) {
        case_t c;
        preset_case(preset, wtypes[w], g_seed + 31 * w, &c);
        const kvb_model_desc *d = &c.model->d;
        const ref_desc *r = ref_model_desc(c.ref);
        assert_int_equal(d->arch, arch);
        assert_int_equal(r->arch, rarch);
        assert_int_equal(d->n_expert, 8);
        assert_int_equal(d->n_expert_used, 2);
        assert_int_equal(d->n_ff_exp, 256);
        assert_true(d->expert_weights_norm == norm && r->expert_weights_norm == norm);
        assert_int_equal(d->n_ff_shexp, shexp);
        assert_int_equal((int)d->n_ff_shexp, r->n_ff_shexp);
        assert_int_equal((int)d->n_expert, r->n_expert);
        assert_int_equal((int)d->n_expert_used, r->n_expert_used);
        assert_int_equal((int)d->n_ff_exp, r->n_ff_exp);
        int32_t toks[G3_TOK];
        double *ref;
        float *one, *l;
        const int V = draw_prompt(&c, g_seed + 91 + w, toks, &ref, &one, &l);
        double gaps[G3_TOK];
        assert_int_equal(ref_model_forward_gaps(c.ref, toks, G3_TOK, ref, gaps), 0);
        for (size_t ci = 0; ci < KVB_ARRAY_LEN(caches); ci++) {
            const double tol = tol_weights(wtypes[w]) + tol_cache(caches[ci]);
            double worst;
            int top1;
            gemma3_engine_run(c.model, toks, caches[ci], 2, MODE_PREFILL, one);
            const int close = moe_logits_check(preset, wtypes[w], caches[ci], tol, gaps, ref, one, V, &worst, &top1);
            argmax_and_modes(&c, preset, wtypes[w], caches[ci], tol, toks, ref, one, l);
            print_message("  %s %-5s cache %-4s: worst rel-L2 %.2g (%d tokens too close to call), top-1 %d/%d, "
                          "chunked == decode == mixed == one-shot\n",
                          preset, kvb_type_name(wtypes[w]), kvb_type_name(caches[ci]), worst, close, top1, G3_TOK);
        }
        free_case(&c, ref, one, l);
    }
}

static void test_tiny_moe(void **state) {
    (void)state;
    check_moe_preset("tiny-moe", KVB_ARCH_QWEN3MOE, REF_ARCH_QWEN3MOE, true, 0);
}

/* tiny-qwen2moe (qwen2moe: q/k/v biases, the top-k not renormalised, a shared expert of 512 behind a
 * sigmoid gate added to the routed experts' sum) held to the same checks. */
static void test_tiny_qwen2moe(void **state) {
    (void)state;
    check_moe_preset("tiny-qwen2moe", KVB_ARCH_QWEN2MOE, REF_ARCH_QWEN2MOE, false, 512);
}

/* Layer `layer`'s cache rows from kvb_kv_produce (the latent row: normed latent, roped key part) for
 * the reference's own attention inputs, decoded, against the reference's rows [latent, k_pe]:
 * worst relative L2 over the G3_TOK rows. */
static double mla_rows_rel(const case_t *c, const int32_t *toks, uint32_t layer, uint32_t cache) {
    const kvb_model_desc *d = &c->model->d;
    const uint32_t E = d->n_embd, RP = d->head_dim;
    double *h = malloc(sizeof(double) * G3_TOK * E), *want = malloc(sizeof(double) * G3_TOK * RP);
    float *hf = malloc(sizeof(float) * G3_TOK * E), *got = malloc(sizeof(float) * RP);
    void *scratch = kvb_aligned_alloc(64, kvb_kv_produce_scratch_bytes(c->model, G3_TOK));
    const size_t rb = kvb_row_bytes(cache, RP);
    uint8_t *rows = malloc(rb * G3_TOK);
    assert_true(h && want && hf && got && scratch && rows);
    assert_int_equal(ref_model_attn_input(c->ref, toks, G3_TOK, (int)layer, h), 0);
    assert_int_equal(ref_model_kv(c->ref, toks, G3_TOK, (int)layer, want, NULL), 0);
    for (size_t i = 0; i < (size_t)G3_TOK * E; i++) hf[i] = (float)h[i];
    kvb_rope_tables t;
    kvb_err err = {0};
    assert_int_equal(kvb_rope_tables_init(&t, c->model, G3_TOK, &err), KVB_OK);
    kvb_rope_tables_fill(&t, 0, G3_TOK);
    kvb_kv_produce_args a = {c->model, layer, cache, NULL, NULL, NULL, false, false};
    kvb_rope_tables_layer(&t, layer, &a.rope_cos, &a.rope_sin);
    kvb_kv_produce(&a, hf, G3_TOK, scratch, rows, NULL);
    double worst = 0;
    for (uint32_t r = 0; r < G3_TOK; r++) {
        kvb_row_to_f32(cache, rows + r * rb, got, RP);
        worst = fmax(worst, ref_rel_l2(got, want + (size_t)r * RP, RP));
    }
    kvb_rope_tables_free(&t);
    free(h), free(want), free(hf), free(got), free(rows);
    kvb_aligned_free(scratch);
    return worst;
}

/* Every layer's cache rows in cache dtype `cache` within the weight + cache tolerance; the worst. */
static double mla_rows_check(const case_t *c, const int32_t *toks, uint32_t wt, uint32_t cache) {
    const double tol = tol_weights(wt) + tol_cache(cache);
    double worst = 0;
    for (uint32_t layer = 0; layer < c->model->d.n_layer; layer++) {
        const double rel = mla_rows_rel(c, toks, layer, cache);
        if (!(rel <= tol))
            fail_msg("tiny-mla %s cache %s layer %u rows: rel-L2 %.3g > %.3g", kvb_type_name(wt), kvb_type_name(cache),
                     layer, rel, tol);
        worst = fmax(worst, rel);
    }
    return worst;
}

/* tiny-mla (the gen-model deepseek2 preset: q_lora, 1 dense layer then 2 MoE layers of 8 experts in 4
 * groups (2 kept), top-2 by sigmoid score plus the selection bias, renormalised and scaled by 2.5, 1
 * shared expert, YaRN) on the 40-token prompt and feeding modes of tiny-gemma3. The engine computes
 * the latent attention in the absorbed form (queries through K_b, attention over the cached latent
 * rows, the output through V_b) for every token; the reference in the expanded form (per-head keys
 * K_b^T latent and values V_b latent) in double: the two agree within the dense tolerances
 * (tol_weights + tol_cache; the absorption only reassociates f32 sums of R = 64 and N = 32 terms,
 * measured below 1e-6 with F32 weights and cache), with routing near-ties handled as for tiny-moe
 * (the gap measured on selection scores, probabilities, which move at most a quarter as much as the
 * logits under sigmoid). Every feeding mode (one shot, chunks of 7, token by token, prefill + decode)
 * gives the one-shot logits bit for bit with 1 and 2 threads: the decoder's absorbed decode of a
 * prefilled cache is its own prefill's arithmetic. The cache rows themselves (latent and roped key
 * part) match the reference's for the same inputs within the weight + cache tolerance in each layer,
 * for the BF16 and Q8_0 caches too (their logits are not compared: at those tolerances most tokens
 * of a 4-group sigmoid router lie within a routing tie, as tiny-moe's caches stop at F16). */
static void test_tiny_mla(void **state) {
    (void)state;
    const uint32_t wtypes[] = {KVB_TYPE_F32, KVB_TYPE_F16, KVB_TYPE_BF16, KVB_TYPE_Q8_0, KVB_TYPE_Q4_0, KVB_TYPE_Q4_K};
    const uint32_t caches[] = {KVB_TYPE_F32, KVB_TYPE_F16}, row_caches[] = {KVB_TYPE_BF16, KVB_TYPE_Q8_0};
    for (size_t w = 0; w < KVB_ARRAY_LEN(wtypes); w++) {
        case_t c;
        preset_case("tiny-mla", wtypes[w], g_seed + 57 * w, &c);
        const kvb_model_desc *d = &c.model->d;
        const ref_desc *r = ref_model_desc(c.ref);
        assert_int_equal(d->arch, KVB_ARCH_DEEPSEEK2);
        assert_true(r->mla && d->mla);
        assert_int_equal((int)d->n_lora_kv, r->n_lora_kv);
        assert_int_equal((int)d->n_lora_q, r->n_lora_q);
        assert_int_equal((int)d->head_dim_k_mla, r->k_mla);
        assert_int_equal((int)d->n_expert_groups, r->n_groups);
        assert_true(r->yarn_factor == 4.0 && d->rope_yarn_factor == 4.0f);
        int32_t toks[G3_TOK];
        double *ref;
        float *one, *l;
        const int V = draw_prompt(&c, g_seed + 131 + w, toks, &ref, &one, &l);
        double gaps[G3_TOK];
        assert_int_equal(ref_model_forward_gaps(c.ref, toks, G3_TOK, ref, gaps), 0);
        for (size_t ci = 0; ci < KVB_ARRAY_LEN(row_caches); ci++) /* the caches checked by their rows alone */
            mla_rows_check(&c, toks, wtypes[w], row_caches[ci]);
        for (size_t ci = 0; ci < KVB_ARRAY_LEN(caches); ci++) {
            const double tol = tol_weights(wtypes[w]) + tol_cache(caches[ci]);
            double worst;
            int top1;
            const double worst_rows = mla_rows_check(&c, toks, wtypes[w], caches[ci]);
            gemma3_engine_run(c.model, toks, caches[ci], 2, MODE_PREFILL, one);
            const int close = moe_logits_check("tiny-mla", wtypes[w], caches[ci], tol, gaps, ref, one, V, &worst, &top1);
            argmax_and_modes(&c, "tiny-mla", wtypes[w], caches[ci], tol, toks, ref, one, l);
            print_message("  tiny-mla %-5s cache %-4s: worst rel-L2 %.2g (%d too close to call), rows %.2g, top-1 %d/%d, "
                          "chunked == decode == mixed == one-shot\n",
                          kvb_type_name(wtypes[w]), kvb_type_name(caches[ci]), worst, close, worst_rows, top1, G3_TOK);
        }
        free_case(&c, ref, one, l);
    }
}

static int setup(void **state) {
    (void)state;
    const char *s = getenv("KVB_TEST_SEED");
    if (s && *s) g_seed = strtoull(s, NULL, 0);
    print_message("test_engine_vs_ref: seed %llu (set KVB_TEST_SEED to change)\n", (unsigned long long)g_seed);
    return ref_tmpdir_create(g_dir, sizeof g_dir);
}

static int teardown(void **state) {
    (void)state;
    ref_tmpdir_remove(g_dir);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_weight_types),
        cmocka_unit_test(test_cache_types),
        cmocka_unit_test(test_kv_produce),
        cmocka_unit_test(test_rope_scaling_and_tied),
        cmocka_unit_test(test_tiny_gemma3),
        cmocka_unit_test(test_tiny_moe),
        cmocka_unit_test(test_tiny_qwen2moe),
        cmocka_unit_test(test_tiny_mla),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
