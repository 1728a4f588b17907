/* test_cuda_tp — tensor-parallel prefill (kvb_cuda_opts.n_gpus > 1) against one GPU, on one
 * device (tp_one_device: every rank on GPU 0, the engine's own all-reduce), so it runs on any
 * one-GPU host; the NCCL path is the same engine code with NCCL's all-reduce, run where a host
 * has several GPUs (test_cuda_tp_comm checks that all-reduce itself).
 *  - logits of every prompt token, TP 2 and TP 4 vs TP 1, on tiny (GQA 4/2), tiny-qwen2 (q/k/v
 *    bias), tiny-qwen3 (q/k norm) and tiny-gemma3 (post norms, sliding window, GeGLU, one KV head:
 *    replicated on every rank);
 *  - TP runs repeat bit for bit; chunked (7) and prefill + decode == one-shot under TP; a cached
 *    prefix adopted under TP == cold;
 *  - bad input (a token outside the vocabulary) is refused and the engine keeps working;
 *  - all of the above for TP 2 with the all-reduces on a second stream beside the GEMMs
 *    (tp_overlap: the O and down projections of the 77-token chunk in two halves of rows);
 *  - the layer hook runs on one thread, once per (chunk, layer), and its layer-0 input is TP 1's
 *    bit for bit; a hook that fails mid-forward fails that forward, and the next forward is
 *    correct (the ranks stayed in lockstep);
 *  - the tensor-parallel bridge (Q8_0 decoder weights, every cache dtype): rank bridges each
 *    computing their KV heads (some none, when KV heads < ranks) give one bridge's rows bit for bit,
 *    row by row (kvb_bridge_cuda_layer) and as the slab sequence a TP engine's ranks ship through
 *    the pinned slots (hook_every_rank) against one bridge on rank 0 of the same engine; a rank
 *    whose bridge call fails fails the forward, which finishes, and the next one ships in full.
 * Tolerances (relative L2 of a token's logits). TP changes one thing in the arithmetic: the O and
 * down projections' f32 sums are split over ranks and added in rank order (with x added by rank
 * 0's GEMM), so each residual update can move by an ulp, which flips a bf16 rounding of the next
 * GEMM operand now and then — the same kind of difference as cuBLAS choosing another kernel
 * (test_cuda_engine bounds that by 2e-3 for one forward), here in every layer's two sums.
 * Measured on the H200 (2026-12-03, one device): 2.5e-3 .. 4.0e-3 (TP2 and TP4, the four presets;
 * Llama-3.1-8B shape, 3,000 tokens: 4.3e-3). Limit TOL_TP 1e-2, 2.5x the worst seen: a wrong split
 * (a head or column range off by one, a missing all-reduce, a bias slice misplaced) moves logits
 * by 1e-1 or more. Within TP (repeat, chunked, cached): 2e-3, as for one GPU (measured <= 3.5e-7);
 * repeats: bit for bit. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvb_core.h"
#include "kvb_model.h"
#include "kvb_quant.h"

#ifdef KVB_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kvb_bridge_cuda.h"
#include "kvb_engine_cuda.h"
#include "kvbt.h"

#define TOL_TP 1e-2
#define TOL_GPU_GPU 2e-3
#define N_TOK 77u

static uint64_t g_seed;

/* worst row's relative L2; fails above tol */
static double compare_rows(const float *got, const float *ref, uint32_t n, uint32_t V, double tol, const char *what) {
    double worst = 0;
    for (uint32_t t = 0; t < n; t++) {
        for (uint32_t i = 0; i < V; i++)
            if (!isfinite(got[(size_t)t * V + i])) fail_msg("%s: row %u has a non-finite logit", what, t);
        double r = kvbt_rel_l2(got + (size_t)t * V, ref + (size_t)t * V, V);
        if (r > worst) worst = r;
    }
    print_message("%s: worst rel-L2 %.3g (limit %.3g)\n", what, worst, tol);
    if (worst > tol) fail_msg("%s: rel-L2 %.3g above %.3g", what, worst, tol);
    return worst;
}

/* what the hook saw: calls, threads, and layer 0's first chunk input */
typedef struct {
    int calls;
    int fail_at;          /* fail the call with this index (-1: never) */
    pthread_t thread;
    bool other_thread;
    float *h0;            /* (n, E) host copy of layer 0's input at pos0 0 */
    uint32_t h0_n, E;
} hook_log;

static kvb_status log_hook(void *ctx, int rank, uint32_t layer, uint32_t pos0, uint32_t n, const float *d_h,
                           void *stream, kvb_err *err) {
    hook_log *h = ctx;
    if (rank != 0) h->other_thread = true; /* this engine calls the hook on rank 0 only */
    if (h->calls == 0) h->thread = pthread_self();
    else if (!pthread_equal(h->thread, pthread_self())) h->other_thread = true;
    if (h->calls++ == h->fail_at) return kvb_err_set(err, KVB_ERR_IO, "the hook's test failure at call %d", h->fail_at);
    if (layer == 0 && pos0 == 0 && h->h0) {
        if (cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess ||
            cudaMemcpy(h->h0, d_h, sizeof(float) * n * h->E, cudaMemcpyDeviceToHost) != cudaSuccess)
            return kvb_err_set(err, KVB_ERR_INTERNAL, "copying the hook's input failed");
        h->h0_n = n;
    }
    return KVB_OK;
}

/* check_tp's engines overlap their all-reduces with the GEMMs (kvb_cuda_opts.tp_overlap) */
static bool g_overlap;

static kvb_cuda_engine *tp_engine(const kvb_model *m, int gpus, uint32_t max_batch, hook_log *hook) {
    kvb_cuda_opts o = {.max_ctx = 4 * N_TOK, .max_batch = max_batch, .block_tokens = 16, .n_gpus = gpus,
                       .tp_one_device = true, .attention = KVB_CUDA_ATTN_OWN,
                       .tp_overlap = g_overlap && gpus > 1};
    if (hook) o.layer_hook = log_hook, o.layer_hook_ctx = hook;
    kvb_cuda_engine *e = NULL;
    kvb_err err = {0};
    if (kvb_cuda_engine_create(m, &o, &e, &err)) fail_msg("kvb_cuda_engine_create (%d GPUs): %s", gpus, err.msg);
    return e;
}

/* all logits: one forward, or `split` tokens then one at a time */
static void logits_of(kvb_cuda_engine *e, const int32_t *tok, uint32_t n, uint32_t split, float *out, uint32_t V) {
    kvb_cuda_seq *s = NULL;
    kvb_err err = {0};
    if (kvb_cuda_seq_create(e, &s, &err)) fail_msg("%s", err.msg);
    for (size_t i = 0; i < (size_t)n * V; i++) out[i] = NAN;
    if (!split) {
        if (kvb_cuda_forward(e, s, tok, n, out, true, &err)) fail_msg("kvb_cuda_forward: %s", err.msg);
    } else {
        if (kvb_cuda_forward(e, s, tok, split, out, true, &err)) fail_msg("kvb_cuda_forward: %s", err.msg);
        for (uint32_t t = split; t < n; t++)
            if (kvb_cuda_forward(e, s, tok + t, 1, out + (size_t)t * V, false, &err))
                fail_msg("kvb_cuda_forward (decode): %s", err.msg);
    }
    assert_int_equal(kvb_cuda_seq_len(s), n);
    kvb_cuda_seq_free(s);
}

static void check_tp(const kvb_model *m, const char *name, int gpus, const float *ref1, const int32_t *tok,
                     const float *h0_ref) {
    const uint32_t V = m->d.n_vocab, n = N_TOK, E = m->d.n_embd;
    float *got = malloc(sizeof(float) * n * V), *alt = malloc(sizeof(float) * n * V);
    hook_log hook = {.fail_at = -1, .E = E, .h0 = malloc(sizeof(float) * n * E)};
    assert_true(got && alt && hook.h0);
    char what[256];
    kvb_cuda_engine *e = tp_engine(m, gpus, 0, &hook);
    char desc[1024];
    kvb_cuda_engine_describe(e, desc, sizeof desc);
    print_message("%s TP%d: %s\n", name, gpus, desc);
    assert_int_equal(kvb_kvformat_fingerprint(kvb_cuda_engine_kvformat(e)) != 0, 1);
    assert_int_equal(kvb_cuda_engine_kvformat(e)->n_head_kv, m->d.n_head_kv); /* the whole model's cache */

    logits_of(e, tok, n, 0, got, V);
    snprintf(what, sizeof what, "%s: TP%d%s vs TP1", name, gpus, g_overlap ? " (all-reduce overlapped)" : "");
    compare_rows(got, ref1, n, V, TOL_TP, what);
    /* the hook: rank 0's thread only, once per layer (one chunk), layer 0's input = TP1's */
    assert_int_equal(hook.calls, (int)m->d.n_layer);
    assert_false(hook.other_thread);
    assert_int_equal(hook.h0_n, n);
    if (memcmp(hook.h0, h0_ref, sizeof(float) * n * E))
        fail_msg("%s TP%d: the hook's layer-0 input differs from TP1's", name, gpus);

    /* repeat: bit for bit */
    logits_of(e, tok, n, 0, alt, V);
    if (memcmp(alt, got, sizeof(float) * n * V)) fail_msg("%s TP%d: a second run differs", name, gpus);

    /* prefill + decode == one shot */
    logits_of(e, tok, n, n / 3, alt, V);
    snprintf(what, sizeof what, "%s: TP%d prefill %u + decode vs one-shot", name, gpus, n / 3);
    compare_rows(alt, got, n, V, TOL_GPU_GPU, what);

    /* a cached prefix: A computes 40 tokens, B adopts 2 blocks of 16 and computes the rest */
    {
        kvb_cuda_seq *a = NULL, *b = NULL;
        kvb_err err = {0};
        if (kvb_cuda_seq_create(e, &a, &err) || kvb_cuda_forward(e, a, tok, 40, NULL, false, &err))
            fail_msg("%s", err.msg);
        kvb_cuda_seq_free(a);
        uint32_t cached = 0;
        if (kvb_cuda_seq_create(e, &b, &err) || kvb_cuda_seq_attach_cached(b, tok, n, &cached, &err))
            fail_msg("%s", err.msg);
        if (cached < 32) fail_msg("%s TP%d: adopted %u tokens, expected at least 32", name, gpus, cached);
        float *last = malloc(sizeof(float) * V);
        assert_non_null(last);
        if (kvb_cuda_forward(e, b, tok + cached, n - cached, last, false, &err)) fail_msg("%s", err.msg);
        snprintf(what, sizeof what, "%s: TP%d cached %u + %u vs cold", name, gpus, cached, n - cached);
        compare_rows(last, got + (size_t)(n - 1) * V, 1, V, TOL_GPU_GPU, what);
        /* bad input is refused before any rank starts; the engine keeps working */
        int32_t bad = (int32_t)V;
        kvb_status st = kvb_cuda_forward(e, b, &bad, 1, last, false, &err);
        assert_int_not_equal(st, KVB_OK);
        print_message("%s TP%d: a bad token: %s\n", name, gpus, err.msg);
        kvb_cuda_seq_free(b);
        free(last);
    }

    /* a hook that fails at layer 1: the forward fails with its error; the next one is right */
    {
        hook.calls = 0;
        hook.fail_at = 1;
        kvb_cuda_seq *s = NULL;
        kvb_err err = {0};
        if (kvb_cuda_seq_create(e, &s, &err)) fail_msg("%s", err.msg);
        kvb_status st = kvb_cuda_forward(e, s, tok, n, NULL, false, &err);
        assert_int_equal(st, KVB_ERR_IO);
        print_message("%s TP%d: failing hook: %s (after %d calls)\n", name, gpus, err.msg, hook.calls);
        assert_int_equal(hook.calls, 2); /* no call after the failure */
        kvb_cuda_seq_free(s);
        hook.fail_at = -1;
        logits_of(e, tok, n, 0, alt, V);
        if (memcmp(alt, got, sizeof(float) * n * V)) fail_msg("%s TP%d: after a failed hook the logits differ", name, gpus);
    }
    kvb_cuda_engine_free(e);

    /* chunked (7 tokens a chunk) == one shot */
    e = tp_engine(m, gpus, 7, NULL);
    logits_of(e, tok, n, 0, alt, V);
    snprintf(what, sizeof what, "%s: TP%d chunked (7) vs one-shot", name, gpus);
    compare_rows(alt, got, n, V, TOL_GPU_GPU, what);
    kvb_cuda_engine_free(e);
    free(hook.h0);
    free(got);
    free(alt);
}

/* Generates preset with weights of `type` into the temp dir (path, for removing it) and loads it. */
static kvb_model *gen_preset(const char *preset, uint32_t type, char *path, size_t cap) {
    kvbt_tmp_path(path, cap, preset);
    strncat(path, kvb_type_name(type), cap - strlen(path) - 1);
    strncat(path, "-tp.gguf", cap - strlen(path) - 1);
    kvb_gen_opts go = {.preset = preset, .type = type, .seed = g_seed, .n_threads = 0};
    kvb_err err = {0};
    kvb_model *m = NULL;
    if (kvb_gen_model(&go, path, &err) || kvb_model_load(path, &m, &err)) fail_msg("%s: %s", preset, err.msg);
    return m;
}

static void check_preset(const char *preset) {
    char path[600];
    kvb_model *m = gen_preset(preset, KVB_TYPE_BF16, path, sizeof path);
    kvb_err err = {0};
    const uint32_t V = m->d.n_vocab, n = N_TOK, E = m->d.n_embd;
    int32_t *tok = malloc(sizeof(int32_t) * n);
    float *ref = malloc(sizeof(float) * n * V);
    hook_log hook = {.fail_at = -1, .E = E, .h0 = malloc(sizeof(float) * n * E)};
    assert_true(tok && ref && hook.h0);
    kvb_rng r;
    kvb_rng_seed(&r, g_seed ^ kvb_hash64(preset, strlen(preset), 0));
    for (uint32_t i = 0; i < n; i++) tok[i] = (int32_t)(kvb_rng_u64(&r) % V);
    kvb_cuda_engine *e1 = tp_engine(m, 1, 0, &hook);
    logits_of(e1, tok, n, 0, ref, V);
    kvb_cuda_engine_free(e1);
    for (int gpus = 2; gpus <= 4; gpus *= 2) check_tp(m, preset, gpus, ref, tok, hook.h0);
    /* the same checks with the all-reduces beside the GEMMs (77 rows: two halves of 38 and 39) */
    g_overlap = true;
    check_tp(m, preset, 2, ref, tok, hook.h0);
    g_overlap = false;
    /* a split the shape cannot take is refused with a message */
    kvb_cuda_opts o = {.max_ctx = 64, .n_gpus = 3, .tp_one_device = true};
    kvb_cuda_engine *e = NULL;
    assert_int_not_equal(kvb_cuda_engine_create(m, &o, &e, &err), KVB_OK);
    assert_null(e);
    print_message("%s TP3: %s\n", preset, err.msg);
    free(hook.h0);
    free(tok);
    free(ref);
    kvb_model_free(m);
    remove(path);
}

static void test_tp_tiny(void **state) {
    (void)state;
    kvbt_require_gpu();
    check_preset("tiny");
}
static void test_tp_qwen2(void **state) {
    (void)state;
    kvbt_require_gpu();
    check_preset("tiny-qwen2");
}
static void test_tp_qwen3(void **state) {
    (void)state;
    kvbt_require_gpu();
    check_preset("tiny-qwen3");
}
static void test_tp_gemma3(void **state) {
    (void)state;
    kvbt_require_gpu();
    check_preset("tiny-gemma3");
}

/* ---- the tensor-parallel bridge ----------------------------------------------------------- */

/* Every shipped row set, in order: (layer, pos0, n) and the K and V rows. */
typedef struct {
    uint8_t *bytes;
    size_t len, cap;
    uint32_t calls;
    size_t row_set; /* n_head_kv * row_bytes */
} ship_rec;

static kvb_status record_ship(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n, const uint8_t *k,
                              const uint8_t *v, uint64_t *ticket, kvb_err *err) {
    (void)ticket; /* sent when it returns */
    ship_rec *r = ctx;
    const size_t need = 12 + 2 * (size_t)n * r->row_set;
    if (r->len + need > r->cap) {
        size_t cap = r->cap ? r->cap : 1 << 20;
        while (cap < r->len + need) cap *= 2;
        uint8_t *nb = realloc(r->bytes, cap);
        if (!nb) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        r->bytes = nb, r->cap = cap;
    }
    uint32_t hdr[3] = {layer, pos0, n};
    memcpy(r->bytes + r->len, hdr, 12);
    memcpy(r->bytes + r->len + 12, k, (size_t)n * r->row_set);
    memcpy(r->bytes + r->len + 12 + (size_t)n * r->row_set, v, (size_t)n * r->row_set);
    r->len += need;
    r->calls++;
    return KVB_OK;
}

typedef struct {
    kvb_bridge_cuda **b; /* by rank; one bridge: b[0] only */
    int fail_rank, fail_call, calls[8];
} bridge_hook_ctx;

static kvb_status bridge_hook(void *ctx, int rank, uint32_t layer, uint32_t pos0, uint32_t n, const float *d_h,
                              void *stream, kvb_err *err) {
    bridge_hook_ctx *c = ctx;
    if (rank == c->fail_rank && c->calls[rank]++ == c->fail_call) /* a call the bridge refuses: 0 tokens */
        return kvb_bridge_cuda_enqueue(c->b[rank], layer, pos0, 0, d_h, stream, err);
    return kvb_bridge_cuda_enqueue(c->b[rank], layer, pos0, n, d_h, stream, err);
}

/* The slab sequence of one forward of tok through a TP engine (gpus ranks, one device) with the
 * bridge on every rank (ranks) or one bridge on rank 0; with fail_rank >= 0 a forward whose rank
 * fail_rank fails its third bridge call comes first. */
static void bridged_forward(const kvb_model *m, int gpus, bool ranks, uint32_t dtype, const int32_t *tok, uint32_t n,
                            ship_rec *rec, int fail_rank) {
    kvb_err err = {0};
    kvb_bridge_cuda *b[8] = {0};
    int devs[8] = {0};
    if (ranks ? kvb_bridge_cuda_create_ranks(m, dtype, 32, gpus, devs, b, &err)
              : kvb_bridge_cuda_create(m, dtype, 32, &b[0], &err))
        fail_msg("bridge: %s", err.msg);
    rec->row_set = (size_t)m->d.n_head_kv * kvb_row_bytes(dtype, m->d.head_dim);
    kvb_bridge_cuda_set_ship(b[0], record_ship, NULL, rec);
    bridge_hook_ctx hc = {.b = b, .fail_rank = -1};
    kvb_cuda_opts o = {.max_ctx = 4 * N_TOK, .max_batch = 32, .block_tokens = 16, .n_gpus = gpus,
                       .tp_one_device = true, .attention = KVB_CUDA_ATTN_OWN, .layer_hook = bridge_hook,
                       .layer_hook_ctx = &hc, .hook_every_rank = ranks};
    kvb_cuda_engine *e = NULL;
    if (kvb_cuda_engine_create(m, &o, &e, &err)) fail_msg("engine: %s", err.msg);
    kvb_cuda_seq *s = NULL;
    if (fail_rank >= 0) {
        hc.fail_rank = fail_rank, hc.fail_call = 2;
        if (kvb_cuda_seq_create(e, &s, &err)) fail_msg("%s", err.msg);
        kvb_status st = kvb_cuda_forward(e, s, tok, n, NULL, false, &err);
        if (st != KVB_ERR_INVALID) fail_msg("a failing rank bridge: forward returned %d (%s)", st, err.msg);
        print_message("TP%d, rank %d's bridge refusing its third call: %s\n", gpus, fail_rank, err.msg);
        kvb_bridge_cuda_discard(b[0]);
        kvb_cuda_seq_free(s);
        s = NULL;
        hc.fail_rank = -1;
        rec->len = 0, rec->calls = 0;
    }
    if (kvb_cuda_seq_create(e, &s, &err) || kvb_cuda_forward(e, s, tok, n, NULL, false, &err) ||
        kvb_bridge_cuda_flush(b[0], &err))
        fail_msg("bridged forward: %s", err.msg);
    kvb_cuda_seq_free(s);
    kvb_cuda_engine_free(e);
    kvb_bridge_cuda_free(b[0]);
}

static void check_tp_bridge(const char *preset) {
    char path[600];
    kvb_model *m = gen_preset(preset, KVB_TYPE_Q8_0, path, sizeof path);
    kvb_err err = {0};
    const uint32_t V = m->d.n_vocab, n = N_TOK, E = m->d.n_embd, Hkv = m->d.n_head_kv;
    int32_t *tok = malloc(sizeof(int32_t) * n);
    float *h = malloc(sizeof(float) * 32 * E);
    assert_true(tok && h);
    kvb_rng r;
    kvb_rng_seed(&r, g_seed ^ 77);
    for (uint32_t i = 0; i < n; i++) tok[i] = (int32_t)(kvb_rng_u64(&r) % V);
    for (uint32_t i = 0; i < 32 * E; i++) h[i] = (float)((double)(kvb_rng_u64(&r) >> 11) / 9007199254740992.0 * 4 - 2);
    const uint32_t dtypes[] = {KVB_TYPE_F16, KVB_TYPE_Q8_0, KVB_TYPE_F32, KVB_TYPE_BF16};
    for (int gpus = 2; gpus <= 4; gpus *= 2)
        for (size_t di = 0; di < sizeof dtypes / sizeof dtypes[0]; di++) {
            const uint32_t dt = dtypes[di];
            const size_t rows = (size_t)32 * Hkv * kvb_row_bytes(dt, m->d.head_dim);
            /* row by row: each rank writes its heads' columns */
            uint8_t *k1 = malloc(rows), *v1 = malloc(rows), *kn = malloc(rows), *vn = malloc(rows);
            assert_true(k1 && v1 && kn && vn);
            memset(kn, 0xA5, rows), memset(vn, 0x5A, rows);
            kvb_bridge_cuda *one = NULL, *b[8] = {0};
            int devs[8] = {0};
            if (kvb_bridge_cuda_create(m, dt, 32, &one, &err) ||
                kvb_bridge_cuda_create_ranks(m, dt, 32, gpus, devs, b, &err))
                fail_msg("%s: %s", preset, err.msg);
            for (uint32_t l = 0; l < m->d.n_layer; l++) {
                if (kvb_bridge_cuda_layer(one, l, 100, 32, h, k1, v1, &err)) fail_msg("%s", err.msg);
                for (int rk = 0; rk < gpus; rk++)
                    if (kvb_bridge_cuda_layer(b[rk], l, 100, 32, h, kn, vn, &err)) fail_msg("%s", err.msg);
                if (memcmp(k1, kn, rows) || memcmp(v1, vn, rows))
                    fail_msg("%s, %d rank bridges, %s: layer %u rows differ from one bridge's", preset, gpus,
                             kvb_type_name(dt), l);
            }
            kvb_bridge_cuda_free(one);
            kvb_bridge_cuda_free(b[0]);
            free(k1), free(v1), free(kn), free(vn);
            /* the slab sequence through a TP engine: every rank's bridge vs one on rank 0 */
            ship_rec one_seq = {0}, rank_seq = {0};
            bridged_forward(m, gpus, false, dt, tok, n, &one_seq, -1);
            bridged_forward(m, gpus, true, dt, tok, n, &rank_seq, di == 0 ? gpus - 1 : -1);
            const uint32_t want = m->d.n_layer * ((n + 31) / 32);
            if (one_seq.calls != want || rank_seq.calls != want || one_seq.len != rank_seq.len ||
                memcmp(one_seq.bytes, rank_seq.bytes, one_seq.len))
                fail_msg("%s TP%d %s: rank bridges shipped %u row sets (%zu bytes), one bridge %u (%zu); want %u, "
                         "equal", preset, gpus, kvb_type_name(dt), rank_seq.calls, rank_seq.len, one_seq.calls,
                         one_seq.len, want);
            print_message("%s TP%d %s: rank bridges == one bridge: %u row sets, %zu bytes, bit for bit%s\n", preset,
                          gpus, kvb_type_name(dt), rank_seq.calls, rank_seq.len,
                          di == 0 ? " (after a forward whose last rank's bridge failed)" : "");
            free(one_seq.bytes);
            free(rank_seq.bytes);
        }
    free(tok);
    free(h);
    kvb_model_free(m);
    remove(path);
}

static void test_tp_bridge(void **state) {
    (void)state;
    kvbt_require_gpu();
    check_tp_bridge("tiny");        /* 2 KV heads: TP4 gives two ranks none */
    check_tp_bridge("tiny-gemma3"); /* 1 KV head, windowed layers */
}

int main(void) {
    const char *s = getenv("KVB_TEST_SEED");
    g_seed = s ? strtoull(s, NULL, 0) : (uint64_t)time(NULL);
    printf("test_cuda_tp: seed %llu (KVB_TEST_SEED=%llu repeats this run)\n", (unsigned long long)g_seed,
           (unsigned long long)g_seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tp_tiny),
        cmocka_unit_test(test_tp_qwen2),
        cmocka_unit_test(test_tp_qwen3),
        cmocka_unit_test(test_tp_gemma3),
        cmocka_unit_test(test_tp_bridge),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#else /* built without CUDA */

#include "kvbt.h"

static void test_no_cuda(void **state) {
    (void)state;
    kvbt_require_gpu(); /* skips, saying why: this build has no CUDA engine */
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_no_cuda)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif
