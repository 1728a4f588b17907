/* tests/test_engine_prefix.c — the CPU engine's prefix cache: blocks a sequence fills are
 * committed to the store under chain keys; a later prompt with the same prefix adopts them and
 * computes only the rest, and its logits are bit-identical to computing everything (the cache
 * bytes and the per-token arithmetic are the same). Also: prefill == token-by-token decode bit
 * for bit, referenced blocks survive store pressure, and the pipelined tail's borrowed pages and
 * layer gate. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#include "kvb_engine_cpu.h"
#include "kvb_quant.h"
#include "kvbt.h"

static kvb_model *g_model;

static int setup(void **state) {
    (void)state;
    char path[512];
    kvbt_tmp_path(path, sizeof path, "tiny-prefix.gguf");
    kvb_gen_opts o = {.preset = "tiny-qwen3", .type = KVB_TYPE_Q8_0, .seed = 5, .n_threads = 2};
    kvb_err err = {0};
    if (kvb_gen_model(&o, path, &err) || kvb_model_load(path, &g_model, &err)) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    kvb_model_free(g_model);
    return 0;
}

static void random_tokens(int32_t *t, uint32_t n, uint64_t seed) {
    kvb_rng r;
    kvb_rng_seed(&r, seed);
    for (uint32_t i = 0; i < n; i++) t[i] = (int32_t)(kvb_rng_u64(&r) % g_model->d.n_vocab);
}

static void test_prefix_reuse_is_exact(void **state) {
    (void)state;
    kvb_err err = {0};
    kvb_engine *e;
    kvb_engine_opts o = {.n_threads = 2, .cache_dtype = KVB_TYPE_Q8_0, .block_tokens = 16, .max_ctx = 512,
                         .n_blocks = 64};
    assert_int_equal(kvb_engine_create(g_model, &o, &e, &err), KVB_OK);
    const uint32_t V = g_model->d.n_vocab, n = 150;
    int32_t toks[160];
    random_tokens(toks, n, (uint64_t)time(NULL));
    float *cold = malloc(sizeof(float) * V), *warm = malloc(sizeof(float) * V);

    kvb_seq *s1;
    assert_int_equal(kvb_seq_create(e, &s1, &err), KVB_OK);
    assert_int_equal(kvb_engine_forward(e, s1, toks, n, cold, false, &err), KVB_OK);
    kvb_seq_free(s1);
    kvb_store_stats st;
    kvb_store_get_stats(kvb_engine_store(e), &st);
    assert_int_equal(st.committed, n / 16); /* 9 full blocks committed, partial one discarded */

    /* same prompt: adopts 9 blocks (144 tokens; the last token is always computed) */
    kvb_seq *s2;
    uint32_t cached = 0;
    assert_int_equal(kvb_seq_create(e, &s2, &err), KVB_OK);
    assert_int_equal(kvb_seq_attach_cached(s2, toks, n, &cached, &err), KVB_OK);
    assert_int_equal(cached, 144);
    assert_int_equal(kvb_engine_forward(e, s2, toks + cached, n - cached, warm, false, &err), KVB_OK);
    assert_memory_equal(cold, warm, sizeof(float) * V);
    kvb_seq_free(s2);

    /* a prompt sharing only the first 40 tokens adopts 2 blocks */
    int32_t other[160];
    memcpy(other, toks, sizeof toks);
    other[40] = (other[40] + 1) % (int32_t)V;
    kvb_seq *s3;
    assert_int_equal(kvb_seq_create(e, &s3, &err), KVB_OK);
    assert_int_equal(kvb_seq_attach_cached(s3, other, n, &cached, &err), KVB_OK);
    assert_int_equal(cached, 32);
    kvb_seq_free(s3);

    /* prompt of exactly 2 blocks: the last token is computed, so only 1 block is adopted */
    kvb_seq *s4;
    assert_int_equal(kvb_seq_create(e, &s4, &err), KVB_OK);
    assert_int_equal(kvb_seq_attach_cached(s4, toks, 32, &cached, &err), KVB_OK);
    assert_int_equal(cached, 16);
    kvb_seq_free(s4);

    free(cold);
    free(warm);
    kvb_engine_free(e);
}

static void test_prefill_equals_decode_bitwise(void **state) {
    (void)state;
    kvb_err err = {0};
    const uint32_t V = g_model->d.n_vocab, n = 70;
    int32_t toks[70];
    random_tokens(toks, n, (uint64_t)time(NULL) + 1);
    float *a = malloc(sizeof(float) * V * n), *b = malloc(sizeof(float) * V * n);
    for (int threads = 1; threads <= 2; threads++) {
        kvb_engine *e;
        kvb_engine_opts o = {.n_threads = threads, .cache_dtype = KVB_TYPE_F16, .max_batch = 32};
        assert_int_equal(kvb_engine_create(g_model, &o, &e, &err), KVB_OK);
        kvb_seq *s;
        assert_int_equal(kvb_seq_create(e, &s, &err), KVB_OK);
        assert_int_equal(kvb_engine_forward(e, s, toks, n, threads == 1 ? a : b, true, &err), KVB_OK);
        kvb_seq_free(s);
        if (threads == 2) assert_memory_equal(a, b, sizeof(float) * V * n);
        assert_int_equal(kvb_seq_create(e, &s, &err), KVB_OK);
        for (uint32_t i = 0; i < n; i++)
            assert_int_equal(kvb_engine_forward(e, s, &toks[i], 1, b + (size_t)i * V, false, &err), KVB_OK);
        assert_memory_equal(a, b, sizeof(float) * V * n);
        kvb_seq_free(s);
        kvb_engine_free(e);
    }
    free(a);
    free(b);
}

/* Attention reduces keys in fixed segments of 64 blocks merged in order (attention.c). With
 * 2-token blocks a 400-token prompt spans 4 segments: prefill with 1 or 3 threads, and
 * token-by-token decode (where 3 threads compute the segments side by side) give the same bits;
 * and the segmented reduction agrees with one segment (64-token blocks) to f32 rounding. F32
 * weights: with Q8_0 weights the activations' 8-bit rounding turns those last-bit differences into
 * ~1e-2 on this random-weight model, which would hide a wrong merge. */
static void test_segmented_attention(void **state) {
    (void)state;
    kvb_err err = {0};
    char path[512];
    kvbt_tmp_path(path, sizeof path, "tiny-prefix-f32.gguf");
    kvb_gen_opts go = {.preset = "tiny-qwen3", .type = KVB_TYPE_F32, .seed = 5, .n_threads = 2};
    kvb_model *m = NULL;
    assert_int_equal(kvb_gen_model(&go, path, &err), KVB_OK);
    assert_int_equal(kvb_model_load(path, &m, &err), KVB_OK);
    const uint32_t V = m->d.n_vocab, n = 400;
    int32_t toks[400];
    random_tokens(toks, n, (uint64_t)time(NULL) + 3);
    float *ref = malloc(sizeof(float) * V * n), *x = malloc(sizeof(float) * V * n);
    assert_non_null(ref);
    assert_non_null(x);
    const struct {
        int threads;
        uint32_t bt;
        bool decode;
    } runs[] = {{1, 2, false}, {3, 2, false}, {3, 2, true}, {1, 2, true}, {2, 64, false}};
    for (size_t r = 0; r < KVB_ARRAY_LEN(runs); r++) {
        kvb_engine *e;
        kvb_engine_opts o = {.n_threads = runs[r].threads, .cache_dtype = KVB_TYPE_F16, .block_tokens = runs[r].bt,
                             .max_ctx = 512, .max_batch = 64};
        assert_int_equal(kvb_engine_create(m, &o, &e, &err), KVB_OK);
        kvb_seq *s;
        assert_int_equal(kvb_seq_create(e, &s, &err), KVB_OK);
        float *out = r == 0 ? ref : x;
        if (runs[r].decode)
            for (uint32_t i = 0; i < n; i++)
                assert_int_equal(kvb_engine_forward(e, s, &toks[i], 1, out + (size_t)i * V, false, &err), KVB_OK);
        else
            assert_int_equal(kvb_engine_forward(e, s, toks, n, out, true, &err), KVB_OK);
        kvb_seq_free(s);
        kvb_engine_free(e);
        if (r == 0) continue;
        if (runs[r].bt == 2) {
            assert_memory_equal(ref, x, sizeof(float) * V * n);
        } else {
            double worst = 0;
            for (uint32_t t = 0; t < n; t++) {
                double d2 = 0, r2 = 0;
                for (uint32_t i = 0; i < V; i++) {
                    double a = ref[(size_t)t * V + i], b = x[(size_t)t * V + i];
                    d2 += (a - b) * (a - b);
                    r2 += a * a;
                }
                if (sqrt(d2 / r2) > worst) worst = sqrt(d2 / r2);
            }
            printf("segmented (4 segments) vs one segment: worst token rel-L2 %.2e (limit 1e-4: f32 rounding of the "
                   "merges, carried through the layers)\n",
                   worst);
            assert_true(worst < 1e-4);
        }
    }
    free(ref);
    free(x);
    kvb_model_free(m);
}

static void test_cache_full_is_an_error(void **state) {
    (void)state;
    kvb_err err = {0};
    kvb_engine *e;
    kvb_engine_opts o = {.n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 16, .max_ctx = 256,
                         .n_blocks = 4};
    assert_int_equal(kvb_engine_create(g_model, &o, &e, &err), KVB_OK);
    int32_t toks[100];
    random_tokens(toks, 100, 3);
    kvb_seq *s;
    assert_int_equal(kvb_seq_create(e, &s, &err), KVB_OK);
    assert_int_equal(kvb_engine_forward(e, s, toks, 100, NULL, false, &err), KVB_ERR_RANGE);
    assert_non_null(strstr(err.msg, "KV cache"));
    kvb_seq_free(s);
    kvb_engine_free(e);
}

/* ---- the pipelined tail's engine side: borrowed pages and a layer gate ------------------------ */

typedef struct {
    kvb_store *store;
    const kvb_kvformat *fmt;
    const kvb_block_id *pages; /* where positions p land: pages[p / block_tokens] */
} page_filler;

/* rows_hook of a second engine on the same store: its rows go into the test's own pages, as a
 * bridge receiver would put them */
static kvb_status fill_pages(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n, const uint8_t *k_rows,
                             const uint8_t *v_rows, uint32_t dtype, kvb_err *err) {
    (void)dtype, (void)err;
    page_filler *f = ctx;
    const uint32_t bt = f->fmt->block_tokens;
    const size_t tok_bytes = (size_t)f->fmt->n_head_kv * kvb_kvformat_row_bytes(f->fmt);
    for (uint32_t t = 0; t < n;) {
        const uint32_t p = pos0 + t, cnt = n - t < bt - p % bt ? n - t : bt - p % bt;
        kvb_kvformat_scatter_rows(f->fmt, kvb_store_block_data(f->store, f->pages[p / bt]), layer, p % bt, cnt,
                                  k_rows + t * tok_bytes, v_rows + t * tok_bytes);
        t += cnt;
    }
    return KVB_OK;
}

typedef struct {
    uint32_t calls, abort_at; /* abort_at: the layer whose gate fails (UINT32_MAX: none) */
} gate_count;

static kvb_status count_gate(void *ctx, uint32_t layer, kvb_err *err) {
    gate_count *g = ctx;
    assert_int_equal(layer, g->calls); /* once per layer, in order */
    g->calls++;
    return layer == g->abort_at ? kvb_err_set(err, KVB_ERR_INTERNAL, "gate closed at layer %u", layer) : KVB_OK;
}

/* A gate that computes while it waits, as the decode node's does: one decode step of two other
 * sequences as a batch and a 20-token chunk of a third, on the gate's own thread. */
typedef struct {
    kvb_engine *e;
    kvb_seq *ab[2], *c;
    int32_t ab_toks[2][64]; /* each sequence's tokens so far */
    uint32_t calls;
    float *logits; /* (2, n_vocab): the last batch's */
} busy_gate;

static kvb_status compute_in_gate(void *ctx, uint32_t layer, kvb_err *err) {
    busy_gate *g = ctx;
    assert_int_equal(layer, g->calls);
    g->calls++;
    int32_t step[2], chunk[20];
    for (int i = 0; i < 2; i++) {
        const uint32_t len = kvb_seq_len(g->ab[i]);
        step[i] = g->ab_toks[i][len] = (int32_t)((layer * 7 + (uint32_t)i * 13 + len) % g_model->d.n_vocab);
    }
    kvb_status st = kvb_engine_forward_batch(g->e, g->ab, step, 2, g->logits, err);
    random_tokens(chunk, 20, layer + 99);
    return st ? st : kvb_engine_forward(g->e, g->c, chunk, 20, NULL, false, err);
}

/* The last token's forward over borrowed pages (filled by another engine's rows, as a bridge would)
 * gives logits bit-identical to one forward over the whole prompt; the gate runs once per layer;
 * a gate that fails aborts the forward, and freeing the sequence leaves the borrowed pages (still
 * the test's) and the store consistent. */
static void test_borrowed_pages_and_gate(void **state) {
    (void)state;
    kvb_err err = {0};
    const uint32_t V = g_model->d.n_vocab, n = 150, bt = 16;
    kvb_engine *e, *fill;
    kvb_engine_opts o = {.n_threads = 2, .cache_dtype = KVB_TYPE_F16, .block_tokens = bt, .max_ctx = 512,
                         .n_blocks = 64};
    assert_int_equal(kvb_engine_create(g_model, &o, &e, &err), KVB_OK);
    kvb_store *store = kvb_engine_store(e);
    int32_t toks[150];
    random_tokens(toks, n, (uint64_t)time(NULL) ^ 0x5eed);
    float *ref = malloc(sizeof(float) * V), *got = malloc(sizeof(float) * V);
    assert_true(ref && got);
    kvb_seq *s;
    assert_int_equal(kvb_seq_create(e, &s, &err), KVB_OK);
    assert_int_equal(kvb_engine_forward(e, s, toks, n, ref, false, &err), KVB_OK);
    kvb_seq_free(s);

    /* pages for positions 0 .. n-1: the first n-1 filled by the other engine, the last left for the forward */
    const uint32_t n_pages = (n - 1) / bt + 1;
    kvb_block_id pages[16];
    assert_int_equal(kvb_store_alloc(store, n_pages, pages, &err), KVB_OK);
    page_filler pf = {store, kvb_engine_kvformat(e), pages};
    kvb_engine_opts fo = o;
    fo.store = store;
    fo.rows_hook = fill_pages;
    fo.rows_hook_ctx = &pf;
    assert_int_equal(kvb_engine_create(g_model, &fo, &fill, &err), KVB_OK);
    assert_int_equal(kvb_seq_create(fill, &s, &err), KVB_OK);
    assert_int_equal(kvb_engine_forward(fill, s, toks, n - 1, NULL, false, &err), KVB_OK);
    kvb_seq_free(s); /* its own blocks; the copies in pages stay */

    for (int abort = 0; abort < 2; abort++) {
        gate_count g = {0, abort ? 1u : UINT32_MAX};
        assert_int_equal(kvb_seq_create(e, &s, &err), KVB_OK);
        assert_int_equal(kvb_seq_borrow_pages(s, pages, n_pages, toks, n - 1, &err), KVB_OK);
        assert_int_equal(kvb_seq_borrow_pages(s, pages, n_pages, toks, 1, &err), KVB_ERR_INVALID); /* once */
        kvb_seq_set_layer_gate(s, count_gate, &g);
        kvb_status st = kvb_engine_forward(e, s, toks + n - 1, 1, got, false, &err);
        if (abort) {
            assert_int_equal(st, KVB_ERR_INTERNAL);
            assert_int_equal(g.calls, 2);
        } else {
            assert_int_equal(st, KVB_OK);
            assert_int_equal(g.calls, g_model->d.n_layer);
            assert_memory_equal(got, ref, sizeof(float) * V);
        }
        kvb_seq_free(s);
        kvb_store_stats stats;
        kvb_store_get_stats(store, &stats);
        assert_true(stats.writing >= n_pages); /* the borrowed pages are still the test's */
        assert_int_equal(kvb_store_check(store, &err), KVB_OK);
    }
    /* the gate computing on the engine meanwhile: the same logits, and the batch it ran gives each
     * sequence what a forward of that sequence alone gives */
    busy_gate bg = {.e = e, .logits = malloc(sizeof(float) * 2 * V)};
    assert_non_null(bg.logits);
    for (int i = 0; i < 2; i++) {
        random_tokens(bg.ab_toks[i], 5, 40 + (uint64_t)i);
        assert_int_equal(kvb_seq_create(e, &bg.ab[i], &err), KVB_OK);
        assert_int_equal(kvb_engine_forward(e, bg.ab[i], bg.ab_toks[i], 5, NULL, false, &err), KVB_OK);
    }
    assert_int_equal(kvb_seq_create(e, &bg.c, &err), KVB_OK);
    assert_int_equal(kvb_seq_create(e, &s, &err), KVB_OK);
    assert_int_equal(kvb_seq_borrow_pages(s, pages, n_pages, toks, n - 1, &err), KVB_OK);
    kvb_seq_set_layer_gate(s, compute_in_gate, &bg);
    memset(got, 0, sizeof(float) * V);
    assert_int_equal(kvb_engine_forward(e, s, toks + n - 1, 1, got, false, &err), KVB_OK);
    assert_int_equal(bg.calls, g_model->d.n_layer);
    assert_memory_equal(got, ref, sizeof(float) * V);
    kvb_seq_free(s);
    for (int i = 0; i < 2; i++) {
        kvb_seq *alone;
        const uint32_t len = kvb_seq_len(bg.ab[i]);
        assert_int_equal(kvb_seq_create(e, &alone, &err), KVB_OK);
        assert_int_equal(kvb_engine_forward(e, alone, bg.ab_toks[i], len, got, false, &err), KVB_OK);
        assert_memory_equal(got, bg.logits + (size_t)i * V, sizeof(float) * V);
        kvb_seq_free(alone);
        kvb_seq_free(bg.ab[i]);
    }
    kvb_seq_free(bg.c);
    free(bg.logits);
    assert_int_equal(kvb_store_release(store, pages, n_pages, &err), KVB_OK);
    assert_int_equal(kvb_store_check(store, &err), KVB_OK);
    kvb_engine_free(fill);
    kvb_engine_free(e);
    free(ref);
    free(got);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefix_reuse_is_exact),
        cmocka_unit_test(test_prefill_equals_decode_bitwise),
        cmocka_unit_test(test_segmented_attention),
        cmocka_unit_test(test_cache_full_is_an_error),
        cmocka_unit_test(test_borrowed_pages_and_gate),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
