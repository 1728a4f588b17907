/* test_cuda_interface — the prefill-engine interface (engine/kvb_prefill_engine.h) on a GPU:
 *  - the factory's CUDA engine gives the CUDA engine's own logits bit for bit (the same calls on
 *    the same device), and its tensor-parallel engine (two ranks on one device) the one-GPU logits
 *    within 2e-2 relative L2 (test_cuda_tp's bound for the split on the tiny presets);
 *  - the bridge through the interface, on one GPU and on two ranks: every (layer, position) of the
 *    begun range is shipped exactly once and nothing outside it, the rows stay put until the
 *    release's wait says they were sent (mark and wait are called), nothing ships while the bridge
 *    idles, and the staging memory is reported;
 *  - a GPU engine's capabilities answer (GEMM ceiling > 0, attention switch).
 * Without a CUDA device every test skips with "no CUDA device". */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_core.h"
#include "kvb_prefill_engine.h"
#include "kvb_quant.h"
#include "kvbt.h"
#ifdef KVB_HAVE_CUDA
#include "kvb_engine_cuda.h"
#endif

#define N_TOK 77
#define BT 16

static kvb_model *g_model;

static int setup(void **state) {
    (void)state;
    return (g_model = kvbt_gen_load("tiny-cuda-interface.gguf", "tiny", KVB_TYPE_Q8_0, 21)) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    kvb_model_free(g_model);
    return 0;
}

static void prompt(int32_t *t) { kvbt_random_tokens(t, N_TOK, g_model->d.n_vocab, 9); }

/* The last token's logits through the interface on `gpus` ranks (two: both on one device). */
static void interface_logits(int gpus, float *logits) {
    int32_t tok[N_TOK];
    prompt(tok);
    kvb_err err = {0};
    kvb_prefill_opts po = {.device = KVB_DEVICE_CUDA, .max_ctx = 128, .max_batch = 32, .gpus = gpus,
                           .tp_one_device = gpus > 1, .attention = KVB_PREFILL_ATTN_OWN};
    kvb_prefill_engine *pe = NULL;
    kvb_prefill_seq *s = NULL;
    assert_int_equal(kvb_prefill_engine_create(g_model, &po, &pe, &err), KVB_OK);
    assert_string_equal(kvb_prefill_engine_name(pe), gpus > 1 ? "cuda-tp" : "cuda");
    assert_int_equal(kvb_prefill_seq_create(pe, &s, &err), KVB_OK);
    assert_int_equal(kvb_prefill_forward(pe, s, tok, N_TOK, logits, false, &err), KVB_OK);
    kvb_prefill_seq_free(s);
    kvb_prefill_engine_free(pe);
}

static void test_logits(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t V = g_model->d.n_vocab;
    float *one = malloc(sizeof(float) * V), *two = malloc(sizeof(float) * V), *direct = malloc(sizeof(float) * V);
    assert_true(one && two && direct);
    interface_logits(1, one);
#ifdef KVB_HAVE_CUDA
    int32_t tok[N_TOK];
    prompt(tok);
    kvb_err err = {0};
    kvb_cuda_opts co = {.max_ctx = 128, .max_batch = 32, .n_gpus = 1, .attention = KVB_CUDA_ATTN_OWN};
    kvb_cuda_engine *ce = NULL;
    kvb_cuda_seq *cs = NULL;
    assert_int_equal(kvb_cuda_engine_create(g_model, &co, &ce, &err), KVB_OK);
    assert_int_equal(kvb_cuda_seq_create(ce, &cs, &err), KVB_OK);
    assert_int_equal(kvb_cuda_forward(ce, cs, tok, N_TOK, direct, false, &err), KVB_OK);
    kvb_cuda_seq_free(cs);
    kvb_cuda_engine_free(ce);
    assert_memory_equal(one, direct, sizeof(float) * V);
#endif
    interface_logits(2, two);
    const double rel = kvbt_rel_l2(two, one, V);
    print_message("two ranks vs one GPU: rel-L2 %.3g\n", rel);
    assert_true(rel < 2e-2);
    free(one);
    free(two);
    free(direct);
}

/* What the bridge shipped: slabs per (layer, position), and the release's calls. */
typedef struct {
    uint32_t seen[64][N_TOK]; /* (layer, position) */
    uint32_t slabs, marks, waits;
} ship_log;

static kvb_status log_slab(void *ctx, const kvb_slab *s, kvb_err *err) {
    (void)err;
    ship_log *l = ctx;
    for (uint32_t p = s->pos0; p < s->pos0 + s->n; p++) l->seen[s->layer][p]++;
    l->slabs++;
    return KVB_OK;
}

static uint64_t log_mark(void *ctx) { return ((ship_log *)ctx)->marks++; }

static kvb_status log_wait(void *ctx, uint64_t mark, kvb_err *err) {
    (void)mark, (void)err; /* the sink copied what it kept: sent as it returned */
    ((ship_log *)ctx)->waits++;
    return KVB_OK;
}

static void bridge_on(int gpus) {
    int32_t tok[N_TOK];
    prompt(tok);
    kvb_err err = {0};
    kvb_kvformat fmt;
    kvb_bridge_cpu *br = NULL;
    assert_int_equal(kvb_model_kvformat(&g_model->d, KVB_TYPE_Q8_0, BT, &fmt, &err), KVB_OK);
    assert_int_equal(kvb_bridge_cpu_create(g_model, &fmt, NULL, 32, &br, &err), KVB_OK);
    ship_log *log = calloc(1, sizeof *log);
    assert_non_null(log);
    assert_true(g_model->d.n_layer <= 64);
    kvb_prefill_opts po = {.device = KVB_DEVICE_CUDA, .max_ctx = 128, .max_batch = 32, .gpus = gpus,
                           .tp_one_device = gpus > 1, .bridge = br, .bridge_fmt = &fmt,
                           .release = {.mark = log_mark, .wait_sent = log_wait, .ctx = log}};
    kvb_prefill_engine *pe = NULL;
    kvb_prefill_seq *s = NULL;
    assert_int_equal(kvb_prefill_engine_create(g_model, &po, &pe, &err), KVB_OK);
    assert_true(kvb_prefill_rows_stay_put(pe));
    kvb_prefill_bridge_begin(pe, 0, 0, log_slab, log); /* idle */
    assert_int_equal(kvb_prefill_seq_create(pe, &s, &err), KVB_OK);
    assert_int_equal(kvb_prefill_forward(pe, s, tok, N_TOK, NULL, false, &err), KVB_OK);
    kvb_prefill_seq_free(s);
    assert_int_equal(log->slabs, 0);
    kvb_prefill_bridge_begin(pe, BT, N_TOK - 1, log_slab, log);
    assert_int_equal(kvb_prefill_seq_create(pe, &s, &err), KVB_OK);
    assert_int_equal(kvb_prefill_forward(pe, s, tok, N_TOK, NULL, false, &err), KVB_OK);
    kvb_prefill_seq_free(s);
    for (uint32_t l = 0; l < g_model->d.n_layer; l++)
        for (uint32_t p = 0; p < N_TOK; p++) assert_int_equal(log->seen[l][p], p >= BT && p < N_TOK - 1);
    assert_true(log->marks > 0);
    assert_true(log->waits > 0);
    kvb_prefill_stats st;
    kvb_prefill_engine_stats(pe, &st);
    assert_true(st.staging_bytes > 0);
    assert_true(st.dev_total_bytes > 0 && st.dev_peak_used_bytes > 0);
    print_message("%d rank(s): %u slabs, %u marks, %u waits, %llu staging bytes\n", gpus, log->slabs, log->marks,
                  log->waits, (unsigned long long)st.staging_bytes);
    kvb_prefill_engine_free(pe);
    kvb_bridge_cpu_free(br);
    free(log);
}

static void test_bridge(void **state) {
    (void)state;
    kvbt_require_gpu();
    bridge_on(1);
    bridge_on(2);
}

static void test_capabilities(void **state) {
    (void)state;
    kvbt_require_gpu();
    kvb_err err = {0};
    kvb_prefill_opts po = {.device = KVB_DEVICE_CUDA, .max_ctx = 64, .max_batch = 32};
    kvb_prefill_engine *pe = NULL;
    assert_int_equal(kvb_prefill_engine_create(g_model, &po, &pe, &err), KVB_OK);
    assert_null(kvb_prefill_engine_pool(pe));
    double med = 0, best = 0;
    assert_int_equal(kvb_prefill_engine_gemm_ceiling(pe, 2, &med, &best, &err), KVB_OK);
    assert_true(med > 0 && best >= med);
    assert_int_equal(kvb_prefill_engine_set_attention(pe, KVB_PREFILL_ATTN_OWN, &err), KVB_OK);
    char buf[768];
    kvb_prefill_engine_attention_describe(pe, buf, sizeof buf);
    assert_non_null(strstr(buf, "own"));
    kvb_prefill_engine_free(pe);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logits),
        cmocka_unit_test(test_bridge),
        cmocka_unit_test(test_capabilities),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
