/* tests/test_window_memory.c — the decoder's memory for sliding-window layers does not grow with
 * a bridged prompt (issue 7): tiny-gemma3 (5 local layers, window 16, 1 global) prompts of
 * 200..1800 tokens are bridged (decoder mode, the bridge on a native engine's forward) into a
 * decoder's store through the in-process receiver; the decoder adopts the blocks and the tail and
 * computes the last token, whose logits are bit-identical to the native ones; every committed
 * block that keeps none of its local rows has given its local part's memory back, so the pages
 * whose local part is resident stay a few per prompt whatever its length. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_bridge.h"
#include "kvb_model.h"
#include "kvb_quant.h"
#include "kvbt.h"

#define BT 32
#define MAX_LEN 1800

static void test_bridged_local_memory_is_bounded(void **state) {
    (void)state;
    char path[512];
    kvbt_tmp_path(path, sizeof path, "window-memory-gemma3.gguf");
    kvb_err err = {0};
    kvb_gen_opts go = {.preset = "tiny-gemma3", .type = KVB_TYPE_Q8_0, .seed = 5, .n_threads = 2};
    kvb_model *m = NULL;
    if (kvb_gen_model(&go, path, &err) || kvb_model_load(path, &m, &err)) fail_msg("%s", err.msg);
    kvb_kvformat f;
    assert_int_equal(kvb_model_kvformat(&m->d, KVB_TYPE_F16, BT, &f, &err), KVB_OK);
    size_t local_bytes, global_bytes = kvb_kvformat_local_part(&f, &local_bytes);
    assert_int_equal(global_bytes, 1 * 2 * BT * 128);
    assert_int_equal(local_bytes, 5 * 2 * BT * 128); /* 40960: ten whole 4 KiB pages */

    kvb_store *ds = NULL; /* the decoder's store */
    const uint32_t n_blocks = 4 * (MAX_LEN / BT) + 16;
    assert_int_equal(kvb_store_create(&f, m->fingerprint, n_blocks, &ds, &err), KVB_OK);
    kvb_bridge_cpu *br = NULL;
    assert_int_equal(kvb_bridge_cpu_create(m, &f, NULL, 512, &br, &err), KVB_OK);
    kvb_engine *pe = NULL, *de = NULL; /* the prefill engine (the decoder's format: decoder mode) and the decoder */
    kvb_engine_opts po = {.n_threads = 2, .cache_dtype = KVB_TYPE_F16, .block_tokens = BT, .max_ctx = MAX_LEN + BT,
                          .max_batch = 512, .layer_hook = kvb_bridge_cpu_layer, .layer_hook_ctx = br};
    kvb_engine_opts dopt = {.n_threads = 2, .cache_dtype = KVB_TYPE_F16, .block_tokens = BT,
                            .max_ctx = MAX_LEN + BT, .max_batch = 512, .store = ds};
    if (kvb_engine_create(m, &po, &pe, &err) || kvb_engine_create(m, &dopt, &de, &err)) fail_msg("%s", err.msg);
    float *native = malloc(sizeof(float) * m->d.n_vocab), *bridged = malloc(sizeof(float) * m->d.n_vocab);
    int32_t *toks = malloc(sizeof(int32_t) * MAX_LEN);
    assert_non_null(native);
    assert_non_null(bridged);
    assert_non_null(toks);
    const uint32_t lens[] = {200, 500, 1000, 1800};
    kvb_rng rng;
    kvb_rng_seed(&rng, 99);
    uint32_t prev_resident = 0, prev_committed = 0;
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        const uint32_t L = lens[li], ship = L - 1;
        for (uint32_t i = 0; i < L; i++) toks[i] = 3 + (int32_t)(kvb_rng_u64(&rng) % 250); /* fresh prompt */
        kvb_bridge_receiver *rcv = NULL;
        assert_int_equal(kvb_bridge_receiver_create(ds, toks, 0, ship, &rcv, &err), KVB_OK);
        kvb_bridge_cpu_begin(br, 0, ship, kvb_bridge_receiver_put, rcv);
        kvb_seq *ps = NULL, *dseq = NULL;
        if (kvb_seq_create(pe, &ps, &err) || kvb_engine_forward(pe, ps, toks, L, native, false, &err))
            fail_msg("native: %s", err.msg);
        assert_int_equal(kvb_bridge_receiver_missing(rcv), 0);
        uint64_t g, l;
        kvb_kvformat_ship_bytes(&f, 0, ship, &g, &l);
        assert_true(kvb_bridge_receiver_bytes(rcv) == g + l); /* local rows: the window only */
        kvb_block_id tail = kvb_bridge_receiver_take_tail(rcv);
        uint32_t cached = 0;
        assert_int_equal(kvb_seq_create(de, &dseq, &err), KVB_OK);
        assert_int_equal(kvb_seq_attach_cached(dseq, toks, L, &cached, &err), KVB_OK);
        assert_int_equal(cached, ship / BT * BT);
        if (tail != KVB_BLOCK_NONE)
            assert_int_equal(kvb_seq_adopt_tail(dseq, tail, toks + cached, ship - cached, &err), KVB_OK);
        if (kvb_engine_forward(de, dseq, toks + ship, 1, bridged, false, &err)) fail_msg("bridged: %s", err.msg);
        assert_memory_equal(native, bridged, sizeof(float) * m->d.n_vocab); /* decoder-exact */

        kvb_store_stats st;
        kvb_store_get_stats(ds, &st);
        const uint32_t keep = kvb_kvformat_local_keep_from(&f, ship);
        /* every block before the one holding `keep` kept no local row and gave its local part back */
        const uint32_t resident = st.committed + st.writing - st.local_released;
        print_message("prompt %u: %u blocks committed, %u with their local part given back (%llu bytes), %u "
                      "resident\n",
                      L, st.committed, st.local_released, (unsigned long long)st.local_released_bytes, resident);
        assert_true(st.committed - prev_committed >= keep / BT);
        assert_true(st.local_released_bytes == (uint64_t)st.local_released * local_bytes);
        /* a prompt adds the blocks of its window (<= (16 + 31) / 32 + 1 of them) and the tail's */
        assert_true(resident - prev_resident <= 3);
        prev_resident = resident;
        prev_committed = st.committed;
        kvb_seq_free(dseq);
        kvb_seq_free(ps);
        kvb_bridge_receiver_free(rcv);
        if (kvb_store_check(ds, &err)) fail_msg("store check: %s", err.msg);
    }
    kvb_store_stats st;
    kvb_store_get_stats(ds, &st);
    assert_true(st.local_released >= (200 + 500 + 1000 + 1800) / BT - 4 * 3);
    free(native);
    free(bridged);
    free(toks);
    kvb_engine_free(de);
    kvb_engine_free(pe);
    kvb_bridge_cpu_free(br);
    kvb_store_free(ds);
    kvb_model_free(m);
}

/* The same for what the decoder computes itself: a native prefill of 1800 tokens, freed with its
 * prompt end named, keeps the local rows of the windows a continuation reads and gives the rest
 * back; a continuation adopts the whole chain and its logits equal a cold computation bit for bit;
 * a prompt diverging in the middle gets a chain cut to where a window is intact (here: nothing)
 * and equals a cold computation too. */
static void test_native_local_memory_is_bounded(void **state) {
    (void)state;
    char path[512];
    kvbt_tmp_path(path, sizeof path, "window-memory-native.gguf");
    kvb_err err = {0};
    kvb_gen_opts go = {.preset = "tiny-gemma3", .type = KVB_TYPE_Q8_0, .seed = 6, .n_threads = 2};
    kvb_model *m = NULL;
    if (kvb_gen_model(&go, path, &err) || kvb_model_load(path, &m, &err)) fail_msg("%s", err.msg);
    const uint32_t L = MAX_LEN, EXTRA = 40, V = m->d.n_vocab;
    kvb_engine *e = NULL, *cold = NULL;
    kvb_engine_opts o = {.n_threads = 2, .cache_dtype = KVB_TYPE_F16, .block_tokens = BT, .max_ctx = L + EXTRA + BT,
                         .max_batch = 512};
    if (kvb_engine_create(m, &o, &e, &err) || kvb_engine_create(m, &o, &cold, &err)) fail_msg("%s", err.msg);
    int32_t *toks = malloc(sizeof(int32_t) * (L + EXTRA)), *other = malloc(sizeof(int32_t) * (L + EXTRA));
    float *a = malloc(sizeof(float) * V), *b = malloc(sizeof(float) * V);
    assert_non_null(toks);
    assert_non_null(other);
    assert_non_null(a);
    assert_non_null(b);
    kvb_rng rng;
    kvb_rng_seed(&rng, 7);
    for (uint32_t i = 0; i < L + EXTRA; i++) toks[i] = 3 + (int32_t)(kvb_rng_u64(&rng) % 250);
    memcpy(other, toks, sizeof(int32_t) * (L + EXTRA));
    for (uint32_t i = 900; i < L + EXTRA; i++) other[i] = 3 + (int32_t)(kvb_rng_u64(&rng) % 250);

    kvb_seq *s = NULL, *twin = NULL;
    if (kvb_seq_create(e, &s, &err) || kvb_engine_forward(e, s, toks, L, a, false, &err)) fail_msg("%s", err.msg);
    /* a second live sequence on the same blocks: the first one's end drops nothing it may read */
    uint32_t twin_cached = 0;
    assert_int_equal(kvb_seq_create(e, &twin, &err), KVB_OK);
    assert_int_equal(kvb_seq_attach_cached(twin, toks, L, &twin_cached, &err), KVB_OK);
    assert_int_equal(twin_cached, L / BT * BT);
    kvb_seq_keep_window_at(s, L);
    kvb_seq_free(s);
    kvb_store_stats st;
    kvb_store_get_stats(kvb_engine_store(e), &st);
    assert_int_equal(st.local_drops, 0); /* every block is still the twin's */
    kvb_seq_keep_window_at(twin, L);
    kvb_seq_free(twin);
    kvb_store_get_stats(kvb_engine_store(e), &st);
    print_message("native %u tokens: %u blocks committed, %llu gave up their local rows, %u resident local parts\n",
                  L, st.committed, (unsigned long long)st.local_drops, st.committed - st.local_released);
    assert_true(st.local_drops >= L / BT - 2);       /* all but the window's blocks */
    assert_true(st.committed - st.local_released <= 2);
    if (kvb_store_check(kvb_engine_store(e), &err)) fail_msg("store check: %s", err.msg);

    const int32_t *prompts[2] = {toks, other};
    const uint32_t want_cached[2] = {L / BT * BT, 0};
    for (int p = 0; p < 2; p++) {
        uint32_t cached = 0;
        kvb_seq *cs = NULL, *ks = NULL;
        assert_int_equal(kvb_seq_create(e, &cs, &err), KVB_OK);
        assert_int_equal(kvb_seq_attach_cached(cs, prompts[p], L + EXTRA, &cached, &err), KVB_OK);
        assert_int_equal(cached, want_cached[p]);
        if (kvb_engine_forward(e, cs, prompts[p] + cached, L + EXTRA - cached, a, false, &err)) fail_msg("%s", err.msg);
        kvb_seq_free(cs);
        if (kvb_seq_create(cold, &ks, &err) || kvb_engine_forward(cold, ks, prompts[p], L + EXTRA, b, false, &err))
            fail_msg("%s", err.msg);
        kvb_seq_free(ks);
        assert_memory_equal(a, b, sizeof(float) * V); /* adopted == cold, bit for bit */
        if (kvb_store_check(kvb_engine_store(e), &err)) fail_msg("store check: %s", err.msg);
    }
    free(toks);
    free(other);
    free(a);
    free(b);
    kvb_engine_free(e);
    kvb_engine_free(cold);
    kvb_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bridged_local_memory_is_bounded),
        cmocka_unit_test(test_native_local_memory_is_bounded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
