/* tests/test_engine_interface.c — the prefill-engine interface (engine/kvb_prefill_engine.h) on the
 * CPU: the factory's CPU engine gives the CPU engine's own logits bit for bit; its bridge ships
 * exactly the begun positions, the same slabs (bytes and order) as the CPU bridge hooked on the
 * engine directly, in both bridge modes, and nothing while idle; what only a GPU engine has is
 * refused with KVB_ERR_UNSUPPORTED; and the CUDA device, where this build or host lacks it, is
 * refused with a status, never a crash. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_engine_cpu.h"
#include "kvb_prefill_engine.h"
#include "kvb_quant.h"
#include "kvbt.h"

static kvb_model *g_model;

static int setup(void **state) {
    (void)state;
    return (g_model = kvbt_gen_load("tiny-interface.gguf", "tiny", KVB_TYPE_Q8_0, 11)) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    kvb_model_free(g_model);
    return 0;
}

static void random_tokens(int32_t *t, uint32_t n, uint64_t seed) { kvbt_random_tokens(t, n, g_model->d.n_vocab, seed); }

#define N_TOK 77
#define BT 16

static void test_cpu_logits_are_the_engines(void **state) {
    (void)state;
    int32_t tok[N_TOK];
    random_tokens(tok, N_TOK, 3);
    const uint32_t V = g_model->d.n_vocab;
    float *direct = malloc(sizeof(float) * V), *via = malloc(sizeof(float) * V);
    assert_non_null(direct);
    assert_non_null(via);
    kvb_err err = {0};
    kvb_engine_opts eo = {.n_threads = 2, .cache_dtype = KVB_TYPE_F16, .block_tokens = BT, .max_ctx = 128,
                          .max_batch = 32};
    kvb_engine *e = NULL;
    kvb_seq *s = NULL;
    assert_int_equal(kvb_engine_create(g_model, &eo, &e, &err), KVB_OK);
    assert_int_equal(kvb_seq_create(e, &s, &err), KVB_OK);
    assert_int_equal(kvb_engine_forward(e, s, tok, N_TOK, direct, false, &err), KVB_OK);
    kvb_seq_free(s);
    kvb_engine_free(e);

    kvb_prefill_opts po = {.device = KVB_DEVICE_CPU, .n_threads = 2, .cache_dtype = KVB_TYPE_F16,
                           .block_tokens = BT, .max_ctx = 128, .max_batch = 32};
    kvb_prefill_engine *pe = NULL;
    kvb_prefill_seq *ps = NULL;
    assert_int_equal(kvb_prefill_engine_create(g_model, &po, &pe, &err), KVB_OK);
    assert_string_equal(kvb_prefill_engine_name(pe), "cpu");
    assert_int_equal(kvb_prefill_seq_create(pe, &ps, &err), KVB_OK);
    memset(via, 0xff, sizeof(float) * V); /* poison: every logit must be written */
    assert_int_equal(kvb_prefill_forward(pe, ps, tok, N_TOK, via, false, &err), KVB_OK);
    assert_memory_equal(direct, via, sizeof(float) * V);
    kvb_prefill_seq_free(ps);

    /* a second sequence adopts the first one's full blocks and gives the same logits */
    uint32_t cached = 0;
    assert_int_equal(kvb_prefill_seq_create(pe, &ps, &err), KVB_OK);
    assert_int_equal(kvb_prefill_seq_attach_cached(ps, tok, N_TOK, &cached, &err), KVB_OK);
    assert_int_equal(cached, (N_TOK - 1) / BT * BT);
    assert_int_equal(kvb_prefill_forward(pe, ps, tok + cached, N_TOK - cached, via, false, &err), KVB_OK);
    assert_memory_equal(direct, via, sizeof(float) * V);
    kvb_prefill_seq_free(ps);

    kvb_prefill_stats st;
    kvb_prefill_engine_stats(pe, &st);
    assert_int_equal(st.host_threads, 2);
    assert_int_equal(st.dev_total_bytes, 0);
    assert_int_equal(st.staging_bytes, 0);
    assert_true(st.last_forward_s > 0);
    assert_non_null(kvb_prefill_engine_pool(pe));
    assert_false(kvb_prefill_rows_stay_put(pe));
    double med = 1, best = 1;
    assert_int_equal(kvb_prefill_engine_gemm_ceiling(pe, 1, &med, &best, &err), KVB_ERR_UNSUPPORTED);
    assert_true(med == 0 && best == 0);
    assert_int_equal(kvb_prefill_engine_gate_next(pe, 10, &err), KVB_ERR_UNSUPPORTED);
    assert_int_equal(kvb_prefill_engine_set_attention(pe, KVB_PREFILL_ATTN_OWN, &err), KVB_ERR_UNSUPPORTED);
    kvb_prefill_engine_free(pe);
    free(direct);
    free(via);
}

/* Every slab a bridge shipped, in order: (layer, pos0, n) and the K/V bytes, back to back. */
typedef struct {
    uint8_t *bytes;
    size_t len, cap;
    uint32_t slabs;
    uint32_t lo, hi; /* the positions seen */
} slab_log;

static kvb_status log_slab(void *ctx, const kvb_slab *s, kvb_err *err) {
    (void)err;
    slab_log *l = ctx;
    const size_t need = l->len + 3 * sizeof(uint32_t) + s->k_bytes + s->v_bytes;
    if (need > l->cap) {
        l->cap = need * 2;
        l->bytes = realloc(l->bytes, l->cap);
        assert_non_null(l->bytes);
    }
    const uint32_t head[3] = {s->layer, s->pos0, s->n};
    memcpy(l->bytes + l->len, head, sizeof head);
    memcpy(l->bytes + l->len + sizeof head, s->k, s->k_bytes);
    memcpy(l->bytes + l->len + sizeof head + s->k_bytes, s->v, s->v_bytes);
    l->len = need;
    if (!l->slabs || s->pos0 < l->lo) l->lo = s->pos0;
    if (s->pos0 + s->n > l->hi) l->hi = s->pos0 + s->n;
    l->slabs++;
    return KVB_OK;
}

/* The slabs of positions [from, to) of tok: through the interface (via) or with the CPU bridge on
 * the CPU engine's hook directly; engine_rows: bridge mode `prefill` (the engine's own rows). */
static void bridge_run(const int32_t *tok, uint32_t from, uint32_t to, bool via, bool engine_rows, slab_log *out) {
    kvb_err err = {0};
    kvb_kvformat fmt;
    kvb_bridge_cpu *br = NULL;
    assert_int_equal(kvb_model_kvformat(&g_model->d, KVB_TYPE_Q8_0, BT, &fmt, &err), KVB_OK);
    assert_int_equal(kvb_bridge_cpu_create(g_model, &fmt, NULL, 32, &br, &err), KVB_OK);
    memset(out, 0, sizeof *out);
    if (via) {
        kvb_prefill_opts po = {.device = KVB_DEVICE_CPU, .n_threads = 2, .cache_dtype = KVB_TYPE_Q8_0,
                               .block_tokens = BT, .max_ctx = 128, .max_batch = 32, .bridge = br,
                               .bridge_fmt = &fmt, .bridge_engine_rows = engine_rows};
        kvb_prefill_engine *pe = NULL;
        kvb_prefill_seq *ps = NULL;
        assert_int_equal(kvb_prefill_engine_create(g_model, &po, &pe, &err), KVB_OK);
        kvb_prefill_bridge_begin(pe, from, to, log_slab, out);
        assert_int_equal(kvb_prefill_seq_create(pe, &ps, &err), KVB_OK);
        assert_int_equal(kvb_prefill_forward(pe, ps, tok, N_TOK, NULL, false, &err), KVB_OK);
        kvb_prefill_seq_free(ps);
        kvb_prefill_engine_free(pe);
    } else {
        kvb_engine_opts eo = {.n_threads = 2, .cache_dtype = KVB_TYPE_Q8_0, .block_tokens = BT, .max_ctx = 128,
                              .max_batch = 32};
        if (engine_rows) eo.rows_hook = kvb_bridge_cpu_rows, eo.rows_hook_ctx = br;
        else eo.layer_hook = kvb_bridge_cpu_layer, eo.layer_hook_ctx = br;
        kvb_engine *e = NULL;
        kvb_seq *s = NULL;
        assert_int_equal(kvb_engine_create(g_model, &eo, &e, &err), KVB_OK);
        kvb_bridge_cpu_begin(br, from, to, log_slab, out);
        assert_int_equal(kvb_seq_create(e, &s, &err), KVB_OK);
        assert_int_equal(kvb_engine_forward(e, s, tok, N_TOK, NULL, false, &err), KVB_OK);
        kvb_seq_free(s);
        kvb_engine_free(e);
    }
    kvb_bridge_cpu_free(br);
}

static void test_bridge_ships_the_begun_positions(void **state) {
    (void)state;
    int32_t tok[N_TOK];
    random_tokens(tok, N_TOK, 4);
    for (int mode = 0; mode < 2; mode++) {
        slab_log direct, via;
        bridge_run(tok, BT, N_TOK - 1, false, mode, &direct);
        bridge_run(tok, BT, N_TOK - 1, true, mode, &via);
        assert_true(via.slabs > 0);
        assert_int_equal(via.lo, BT);
        assert_int_equal(via.hi, N_TOK - 1);
        assert_int_equal(via.slabs, direct.slabs);
        assert_int_equal(via.len, direct.len);
        assert_memory_equal(via.bytes, direct.bytes, via.len);
        free(direct.bytes);
        free(via.bytes);
        bridge_run(tok, 0, 0, true, mode, &via); /* idle */
        assert_int_equal(via.slabs, 0);
        free(via.bytes);
    }
}

static void test_what_is_refused(void **state) {
    (void)state;
    kvb_err err = {0};
    kvb_prefill_engine *pe = NULL;
    kvb_prefill_opts tp_on_cpu = {.device = KVB_DEVICE_CPU, .gpus = 2};
    assert_int_equal(kvb_prefill_engine_create(g_model, &tp_on_cpu, &pe, &err), KVB_ERR_UNSUPPORTED);
    assert_null(pe);
    kvb_prefill_opts too_many = {.device = KVB_DEVICE_CUDA, .gpus = KVB_PREFILL_MAX_GPUS + 1};
    assert_int_equal(kvb_prefill_engine_create(g_model, &too_many, &pe, &err), KVB_ERR_INVALID);
    kvb_kvformat fmt;
    kvb_bridge_cpu *br = NULL;
    assert_int_equal(kvb_model_kvformat(&g_model->d, KVB_TYPE_F16, BT, &fmt, &err), KVB_OK);
    assert_int_equal(kvb_bridge_cpu_create(g_model, &fmt, NULL, 32, &br, &err), KVB_OK);
    kvb_prefill_opts no_fmt = {.device = KVB_DEVICE_CPU, .bridge = br}; /* a bridge without the decoder's format */
    assert_int_equal(kvb_prefill_engine_create(g_model, &no_fmt, &pe, &err), KVB_ERR_INVALID);
    assert_null(pe);
    kvb_device_bridge *db = NULL;
    assert_int_equal(kvb_device_bridge_attach(KVB_DEVICE_CPU, g_model, &fmt, 32, 1, false, br, &db, &err),
                     KVB_ERR_INVALID);
    assert_null(db);

    char why[256] = "";
    if (kvb_prefill_device_available(KVB_DEVICE_CUDA, why, sizeof why)) {
        print_message("a CUDA device is usable here: the refusals without one are not checked\n");
        kvb_bridge_cpu_free(br);
        return;
    }
    assert_true(why[0] != 0);
    kvb_prefill_opts cuda = {.device = KVB_DEVICE_CUDA, .max_ctx = 64};
    kvb_status st = kvb_prefill_engine_create(g_model, &cuda, &pe, &err);
    assert_int_not_equal(st, KVB_OK);
    assert_null(pe);
#ifndef KVB_HAVE_CUDA /* a build without CUDA says so, and how to build with it */
    assert_int_equal(st, KVB_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "-DKVB_CUDA=ON"));
    assert_int_equal(kvb_device_bridge_attach(KVB_DEVICE_CUDA, g_model, &fmt, 32, 1, false, br, &db, &err),
                     KVB_ERR_UNSUPPORTED);
    assert_null(db);
#endif
    kvb_device_bridge_free(db);
    kvb_bridge_cpu_free(br);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cpu_logits_are_the_engines),
        cmocka_unit_test(test_bridge_ships_the_begun_positions),
        cmocka_unit_test(test_what_is_refused),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
