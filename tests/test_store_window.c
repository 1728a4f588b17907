/* tests/test_store_window.c — sliding-window layers in the cache format and the store (issue 7):
 * a format without local layers keeps its fingerprint; the keep-from rule; a pending block whose
 * local rows are kept from token t completes without the earlier ones and rejects a slab carrying
 * one (nothing written); a lookup hands a chain out only as far as the adopter's window kept its
 * local rows; a later commit of the same key with more local rows completes the committed block
 * (dedup) without touching a row a holder may read. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_quant.h"
#include "kvb_store.h"

/* f32 rows of 4 values, 4 tokens per block, 3 layers (0 and 1 local, 2 global), 1 kv head, window 6 */
#define BT 4
#define NL 3
#define NKV 1
#define HD 4
#define W 6
static const uint64_t MODEL_FP = 0x77696e646f772d31ULL;

static kvb_kvformat make_fmt(bool window) {
    kvb_kvformat f;
    kvb_err e = {0};
    assert_int_equal(kvb_kvformat_init(&f, KVB_TYPE_F32, BT, NL, NKV, HD, &e), KVB_OK);
    const bool local[NL] = {true, true, false};
    if (window) assert_int_equal(kvb_kvformat_set_window(&f, W, local, &e), KVB_OK);
    return f;
}

static void test_format(void **state) {
    (void)state;
    kvb_kvformat plain = make_fmt(false), win = make_fmt(true), again = make_fmt(false);
    kvb_err e = {0};
    /* no local layer: nothing changes (fingerprint as before the extension) */
    const bool none[NL] = {false, false, false};
    assert_int_equal(kvb_kvformat_set_window(&again, W, none, &e), KVB_OK);
    assert_int_equal(again.window, 0);
    assert_true(kvb_kvformat_fingerprint(&again) == kvb_kvformat_fingerprint(&plain));
    uint32_t v[6] = {plain.version, plain.dtype, plain.block_tokens, plain.n_layer, plain.n_head_kv, plain.head_dim};
    assert_true(kvb_kvformat_fingerprint(&plain) == kvb_hash64(v, sizeof v, 0x6b76622d6b76666dULL));
    assert_true(kvb_kvformat_fingerprint(&win) != kvb_kvformat_fingerprint(&plain));
    assert_int_equal(kvb_kvformat_local_keep_from(&plain, 100), 0);
    assert_int_equal(win.n_local, 2);
    assert_true(kvb_kvformat_layer_local(&win, 0) && kvb_kvformat_layer_local(&win, 1));
    assert_false(kvb_kvformat_layer_local(&win, 2) || kvb_kvformat_layer_local(&win, 3));
    /* E = ship_to rounded down to a block; keep from E - (W - 1) */
    assert_int_equal(kvb_kvformat_local_keep_from(&win, 3), 0);
    assert_int_equal(kvb_kvformat_local_keep_from(&win, 4), 0);
    assert_int_equal(kvb_kvformat_local_keep_from(&win, 8), 3);
    assert_int_equal(kvb_kvformat_local_keep_from(&win, 11), 3);
    assert_int_equal(kvb_kvformat_local_keep_from(&win, 12), 7);
    uint64_t g, l;
    kvb_kvformat_token_bytes(&win, &g, &l);
    assert_int_equal(g, 2 * HD * 4);
    assert_int_equal(l, 2 * 2 * HD * 4);
    kvb_kvformat_ship_bytes(&win, 4, 12, &g, &l); /* global 8 positions, local 12 - 7 */
    assert_int_equal(g, 8 * 2 * HD * 4);
    assert_int_equal(l, 5 * 2 * 2 * HD * 4);
    char d[64];
    kvb_kvformat_describe(&win, d, sizeof d);
    assert_string_equal(d, "f32/4tok/3L/1h/4d/2local@6");
}

/* rows of layer `layer`, tokens [t0, t0+n): value = key-ish pattern */
static void rows(float *k, float *v, uint32_t layer, uint32_t t0, uint32_t n, float salt) {
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t i = 0; i < HD; i++) {
            k[t * HD + i] = salt + (float)(layer * 100 + (t0 + t) * 10 + i);
            v[t * HD + i] = -k[t * HD + i];
        }
}

static kvb_status put(kvb_slab_pending *p, uint32_t layer, uint32_t t0, uint32_t n, float salt, kvb_block_id *out,
                      kvb_err *e) {
    float k[BT * HD], v[BT * HD];
    rows(k, v, layer, t0, n, salt);
    const size_t b = (size_t)n * HD * sizeof(float);
    return kvb_store_slab_put(p, layer, t0, n, k, b, v, b, kvb_slab_checksum(k, b, v, b), out, e);
}

/* Assembles block i of `toks` with local rows kept from token lo; returns the committed id. */
static kvb_block_id assemble(kvb_store *s, const int32_t *toks, const uint64_t *keys, uint32_t i, uint32_t lo) {
    kvb_err e = {0};
    kvb_slab_pending *p;
    assert_int_equal(kvb_store_slab_begin(s, keys[i], i ? keys[i - 1] : kvb_store_root_key(s), toks + i * BT, &p, &e),
                     KVB_OK);
    if (lo) assert_int_equal(kvb_store_slab_keep_local_from(p, lo, &e), KVB_OK);
    kvb_block_id id = KVB_BLOCK_NONE;
    for (uint32_t l = 0; l < NL; l++) {
        const uint32_t from = l < 2 ? lo : 0;
        /* a local layer waits only for the rows it keeps (the pipelined tail's gate counts this) */
        assert_int_equal(kvb_store_slab_layer_missing(p, l), from < BT ? BT - from : 0);
        if (from < BT) assert_int_equal(put(p, l, from, BT - from, (float)i, &id, &e), KVB_OK);
        assert_int_equal(kvb_store_slab_layer_missing(p, l), 0);
    }
    assert_true(kvb_store_slab_committed(p));
    kvb_store_slab_close(p);
    return id;
}

static void test_cut_block(void **state) {
    (void)state;
    kvb_kvformat f = make_fmt(true), plain = make_fmt(false);
    kvb_store *s = NULL, *ps = NULL;
    kvb_err e = {0};
    assert_int_equal(kvb_store_create(&f, MODEL_FP, 8, &s, &e), KVB_OK);
    assert_int_equal(kvb_store_create(&plain, MODEL_FP, 8, &ps, &e), KVB_OK);
    int32_t toks[4 * BT];
    for (int i = 0; i < 4 * BT; i++) toks[i] = 100 + i;
    uint64_t keys[4];
    kvb_store_chain_keys(s, toks, 4 * BT, keys);
    kvb_slab_pending *p, *tail;
    /* refusals: out of range, after a slab, on a tail, on a format without local layers */
    assert_int_equal(kvb_store_slab_begin(s, keys[0], kvb_store_root_key(s), toks, &p, &e), KVB_OK);
    assert_int_equal(kvb_store_slab_keep_local_from(p, BT + 1, &e), KVB_ERR_INVALID);
    assert_int_equal(kvb_store_slab_keep_local_from(p, 2, &e), KVB_OK);
    assert_int_equal(kvb_store_slab_missing(p), (NL - 2) * BT + 2 * (BT - 2));
    /* a local layer's row the decoder does not keep: rejected, nothing written */
    kvb_block_id id = 7;
    assert_int_equal(put(p, 0, 1, 2, 0, &id, &e), KVB_ERR_FORMAT);
    assert_non_null(strstr(e.msg, "not kept"));
    assert_int_equal(put(p, 1, 0, 1, 0, &id, &e), KVB_ERR_FORMAT);
    assert_int_equal(kvb_store_slab_missing(p), (NL - 2) * BT + 2 * (BT - 2));
    /* a global layer's early rows are still expected */
    assert_int_equal(put(p, 2, 0, BT, 0, &id, &e), KVB_OK);
    assert_int_equal(kvb_store_slab_keep_local_from(p, 3, &e), KVB_ERR_INVALID); /* after a slab */
    assert_int_equal(put(p, 0, 2, 2, 0, &id, &e), KVB_OK);
    assert_int_equal(put(p, 1, 2, 2, 0, &id, &e), KVB_OK);
    assert_true(kvb_store_slab_committed(p)); /* complete without the rows it does not keep */
    assert_int_not_equal(id, KVB_BLOCK_NONE);
    kvb_store_slab_close(p);
    assert_int_equal(kvb_store_release(s, &id, 1, &e), KVB_OK);
    assert_int_equal(kvb_store_slab_begin_tail(s, 2, &tail, &e), KVB_OK);
    assert_int_equal(kvb_store_slab_keep_local_from(tail, 1, &e), KVB_ERR_INVALID);
    kvb_store_slab_close(tail);
    kvb_store_chain_keys(ps, toks, BT, keys);
    assert_int_equal(kvb_store_slab_begin(ps, keys[0], kvb_store_root_key(ps), toks, &p, &e), KVB_OK);
    assert_int_equal(kvb_store_slab_keep_local_from(p, 1, &e), KVB_ERR_INVALID);
    kvb_store_slab_close(p);
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.slabs_rejected, 2);
    assert_int_equal(kvb_store_check(s, &e), KVB_OK);
    kvb_store_free(s);
    kvb_store_free(ps);
}

static uint32_t lookup(kvb_store *s, const int32_t *toks, uint32_t n) {
    kvb_block_id ids[8];
    uint32_t got = 0;
    kvb_err e = {0};
    assert_int_equal(kvb_store_lookup(s, toks, n, ids, &got, &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, ids, got, &e), KVB_OK);
    return got;
}

static void test_lookup_and_completion(void **state) {
    (void)state;
    kvb_kvformat f = make_fmt(true);
    kvb_store *s = NULL;
    kvb_err e = {0};
    assert_int_equal(kvb_store_create(&f, MODEL_FP, 8, &s, &e), KVB_OK);
    int32_t toks[4 * BT];
    for (int i = 0; i < 4 * BT; i++) toks[i] = 7 + 3 * i;
    uint64_t keys[4];
    kvb_store_chain_keys(s, toks, 4 * BT, keys);
    /* a bridge shipped [0, 13): keep from 12 - 5 = 7; blocks 0, 1, 2 with local rows kept from
     * token 4 (none), 3, 0 */
    const uint32_t keep = kvb_kvformat_local_keep_from(&f, 13);
    assert_int_equal(keep, 7);
    assert_int_equal(kvb_kvformat_block_local_lo(&f, keep, 0), BT);
    assert_int_equal(kvb_kvformat_block_local_lo(&f, keep, 1), 3);
    assert_int_equal(kvb_kvformat_block_local_lo(&f, keep, 2), 0);
    kvb_block_id b[3];
    for (uint32_t i = 0; i < 3; i++) {
        const uint32_t lo = kvb_kvformat_block_local_lo(&f, keep, i);
        b[i] = assemble(s, toks, keys, i, lo);
    }
    assert_int_equal(kvb_store_release(s, b, 3, &e), KVB_OK);
    /* the whole chain: the adopter computes 12 next, reads local keys 7..11: kept */
    assert_int_equal(lookup(s, toks, 4 * BT), 3);
    /* two blocks: it would compute 8 next and read keys 3..7, which block 0 and block 1 did not keep */
    assert_int_equal(lookup(s, toks, 3 * BT - 1), 0);
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.lookup_window_cuts, 1);
    /* another prompt sharing blocks 0 and 1 only: never handed the cut blocks */
    int32_t other[3 * BT];
    memcpy(other, toks, sizeof other);
    other[2 * BT] = 99999;
    assert_int_equal(lookup(s, other, 3 * BT), 0);
    /* the decoder computes blocks 0 and 1 itself (every row) and commits them: dedup fills in the
     * local rows the bridged blocks lacked, rows kept before are untouched */
    float before[HD];
    memcpy(before, kvb_store_block_data(s, b[1]) + kvb_kvformat_row_offset(&f, 0, 0, 0, 3), sizeof before);
    for (uint32_t i = 0; i < 2; i++) {
        kvb_block_id page, got;
        assert_int_equal(kvb_store_alloc(s, 1, &page, &e), KVB_OK);
        uint8_t *d = kvb_store_block_data(s, page);
        for (uint32_t l = 0; l < NL; l++) {
            float k[BT * HD], v[BT * HD];
            rows(k, v, l, 0, BT, 1000.0f + (float)i); /* other values than the slabs' */
            kvb_kvformat_scatter_rows(&f, d, l, 0, BT, (const uint8_t *)k, (const uint8_t *)v);
        }
        assert_int_equal(kvb_store_commit_block(s, page, keys[i], i ? keys[i - 1] : kvb_store_root_key(s),
                                                toks + i * BT, &got, &e),
                         KVB_OK);
        assert_int_equal(got, b[i]); /* the first committed copy wins */
        const float *row0 = (const float *)(kvb_store_block_data(s, b[i]) + kvb_kvformat_row_offset(&f, 1, 1, 0, 0));
        assert_true(row0[0] == -(1000.0f + (float)i + 100.0f)); /* filled in from the new copy */
        assert_int_equal(kvb_store_release(s, &got, 1, &e), KVB_OK);
    }
    assert_memory_equal(kvb_store_block_data(s, b[1]) + kvb_kvformat_row_offset(&f, 0, 0, 0, 3), before, sizeof before);
    const float *g0 = (const float *)(kvb_store_block_data(s, b[0]) + kvb_kvformat_row_offset(&f, 2, 0, 0, 0));
    assert_true(g0[0] == 0.0f + 200.0f); /* a global row: the first copy's bytes */
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.local_completions, 2);
    assert_int_equal(lookup(s, toks, 3 * BT - 1), 2);
    assert_int_equal(lookup(s, other, 3 * BT), 2);
    assert_int_equal(kvb_store_check(s, &e), KVB_OK);
    kvb_store_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_format),
        cmocka_unit_test(test_cut_block),
        cmocka_unit_test(test_lookup_and_completion),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
