/* tests/test_kvformat_mla.c — the latent (mla) cache format: one row per token and layer,
 * latent_dim + rope_dim values in the cache dtype, no V part. Its block geometry, offsets, scatter
 * (V absent), per-token and shipped bytes, description and fingerprint (distinct from a per-head
 * format of the same numbers) follow from the format description; a deepseek2 model's format is
 * this kind; the store assembles a block of it from slabs with no V bytes and refuses V bytes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_kvformat.h"
#include "kvb_model.h"
#include "kvb_quant.h"
#include "kvb_store.h"
#include "kvbt.h"

static void test_mla_geometry(void **state) {
    (void)state;
    kvb_kvformat f, kv;
    kvb_err err = {0};
    assert_int_equal(kvb_kvformat_init_mla(&f, KVB_TYPE_F16, 16, 3, 64, 32, &err), KVB_OK);
    assert_int_equal(kvb_kvformat_parts(&f), 1);
    assert_int_equal(f.n_head_kv, 1);
    assert_int_equal(f.head_dim, 96);
    assert_int_equal(kvb_kvformat_row_bytes(&f), 192);
    assert_int_equal(kvb_kvformat_block_bytes(&f), (size_t)3 * 16 * 192);
    for (uint32_t l = 0; l < 3; l++)
        for (uint32_t t = 0; t < 16; t++)
            assert_int_equal(kvb_kvformat_row_offset(&f, l, 0, 0, t), ((size_t)l * 16 + t) * 192);
    uint64_t g, loc;
    kvb_kvformat_token_bytes(&f, &g, &loc);
    assert_int_equal(g, 3 * 192);
    assert_int_equal(loc, 0);
    kvb_kvformat_ship_bytes(&f, 5, 37, &g, &loc);
    assert_int_equal(g, (uint64_t)32 * 3 * 192);
    char desc[64];
    kvb_kvformat_describe(&f, desc, sizeof desc);
    assert_string_equal(desc, "f16/16tok/3L/mla64+32");
    /* a per-head format with the same numbers (1 head of 96) is another format */
    assert_int_equal(kvb_kvformat_init(&kv, KVB_TYPE_F16, 16, 3, 1, 96, &err), KVB_OK);
    assert_int_equal(kvb_kvformat_parts(&kv), 2);
    assert_int_equal(kvb_kvformat_block_bytes(&kv), 2 * kvb_kvformat_block_bytes(&f));
    assert_true(kvb_kvformat_fingerprint(&kv) != kvb_kvformat_fingerprint(&f));
    kvb_kvformat f2;
    assert_int_equal(kvb_kvformat_init_mla(&f2, KVB_TYPE_F16, 16, 3, 32, 64, &err), KVB_OK);
    assert_true(kvb_kvformat_fingerprint(&f2) != kvb_kvformat_fingerprint(&f)); /* the split matters */
    /* q8_0 needs whole blocks of 32: 60 + 30 is not */
    assert_int_not_equal(kvb_kvformat_init_mla(&f2, KVB_TYPE_Q8_0, 16, 3, 60, 30, &err), KVB_OK);
    assert_int_not_equal(kvb_kvformat_init_mla(&f2, KVB_TYPE_F16, 16, 3, 0, 32, &err), KVB_OK);
    assert_int_equal(kvb_kvformat_init_mla(&f2, KVB_TYPE_Q8_0, 16, 3, 64, 32, &err), KVB_OK);
    assert_int_equal(kvb_kvformat_row_bytes(&f2), 3 * 34);
}

/* Rows given token-major land at their offsets with no V part read (v_rows NULL), the rest of the
 * block untouched, by both scatters. */
static void test_mla_scatter(void **state) {
    (void)state;
    kvb_kvformat f;
    kvb_err err = {0};
    assert_int_equal(kvb_kvformat_init_mla(&f, KVB_TYPE_BF16, 8, 2, 64, 32, &err), KVB_OK);
    const size_t row = kvb_kvformat_row_bytes(&f), bb = kvb_kvformat_block_bytes(&f);
    for (int stream = 0; stream < 2; stream++) {
        uint8_t *block = kvb_aligned_alloc(64, bb), rows[5 * 192];
        memset(block, 0xAB, bb);
        for (size_t i = 0; i < sizeof rows; i++) rows[i] = (uint8_t)(i * 7 + 1);
        if (stream) kvb_kvformat_scatter_rows_stream(&f, block, 1, 2, 5, rows, NULL);
        else kvb_kvformat_scatter_rows(&f, block, 1, 2, 5, rows, NULL);
        for (size_t off = 0; off < bb; off++) {
            const size_t lo = kvb_kvformat_row_offset(&f, 1, 0, 0, 2), hi = lo + 5 * row;
            const uint8_t want = off >= lo && off < hi ? rows[off - lo] : 0xAB;
            if (block[off] != want) fail_msg("byte %zu: %02x, expected %02x", off, block[off], want);
        }
        kvb_aligned_free(block);
    }
}

/* A deepseek2 model's cache format is the latent kind, from its description. */
static void test_mla_model_format(void **state) {
    (void)state;
    const kvb_preset *p = kvb_preset_find("deepseek-v2-lite");
    assert_non_null(p);
    kvb_kvformat f;
    kvb_err err = {0};
    assert_int_equal(kvb_model_kvformat(&p->d, KVB_TYPE_Q8_0, 32, &f, &err), KVB_OK);
    assert_int_equal(f.kind, KVB_KVFORMAT_MLA);
    assert_int_equal(f.latent_dim, 512);
    assert_int_equal(f.rope_dim, 64);
    assert_int_equal(f.n_layer, 27);
    uint64_t cache, per_head;
    kvb_model_cache_token_bytes(&p->d, KVB_TYPE_F16, &cache, &per_head);
    assert_int_equal(cache, 27 * 576 * 2);             /* 31,104 bytes: the latent row */
    assert_int_equal(per_head, 27ull * 16 * (192 + 128) * 2); /* 276,480: K and V of every head */
    uint64_t g, l;
    kvb_kvformat_init_mla(&f, KVB_TYPE_F16, 32, 27, 512, 64, &err);
    kvb_kvformat_token_bytes(&f, &g, &l);
    assert_int_equal(g, cache); /* what the format ships per token is what the model says it costs */
}

/* The store assembles a latent block from slabs of K bytes only and refuses V bytes. */
static void test_mla_store_slabs(void **state) {
    (void)state;
    kvb_kvformat f;
    kvb_err err = {0};
    assert_int_equal(kvb_kvformat_init_mla(&f, KVB_TYPE_F16, 4, 2, 64, 32, &err), KVB_OK);
    kvb_store *s = NULL;
    assert_int_equal(kvb_store_create(&f, 77, 4, &s, &err), KVB_OK);
    const int32_t toks[4] = {5, 6, 7, 8};
    const uint64_t root = kvb_store_root_key(s), key = kvb_chain_next(root, toks, 4);
    kvb_slab_pending *pp = NULL;
    assert_int_equal(kvb_store_slab_begin(s, key, root, toks, &pp, &err), KVB_OK);
    const size_t row = kvb_kvformat_row_bytes(&f);
    uint8_t k[4 * 192];
    for (size_t i = 0; i < sizeof k; i++) k[i] = (uint8_t)(i ^ 0x5A);
    assert_int_not_equal(kvb_store_slab_put(pp, 0, 0, 4, k, 4 * row, k, 4 * row, kvb_slab_checksum(k, 4 * row, k, 4 * row),
                                            NULL, &err),
                         KVB_OK);
    assert_non_null(strstr(err.msg, "expected 768 and 0"));
    kvb_block_id id = KVB_BLOCK_NONE;
    for (uint32_t l = 0; l < 2; l++)
        assert_int_equal(kvb_store_slab_put(pp, l, 0, 4, k, 4 * row, NULL, 0, kvb_slab_checksum(k, 4 * row, NULL, 0),
                                            &id, &err),
                         KVB_OK);
    assert_int_not_equal(id, KVB_BLOCK_NONE);
    const uint8_t *data = kvb_store_block_data(s, id);
    for (uint32_t l = 0; l < 2; l++) assert_memory_equal(data + kvb_kvformat_row_offset(&f, l, 0, 0, 0), k, 4 * row);
    kvb_store_slab_close(pp);
    assert_int_equal(kvb_store_release(s, &id, 1, &err), KVB_OK);
    kvb_store_free(s);
}

/* `kvbridge inspect --preset` prints a shape's cache bytes per token beside per-head K/V: V2-Lite's
 * 27 x 576 f16 values (31,104 B) against 27 x 16 x (192 + 128) (276,480 B); V3's 61 layers against
 * 128 heads (70,272 B against 4,997,120 B) — without writing the 671B file. */
static void test_inspect_cache_cost(void **state) {
    (void)state;
    char cmd[1024], out[8192];
    snprintf(cmd, sizeof cmd, "'%s' inspect --preset deepseek-v2-lite", kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    assert_non_null(strstr(out, "F16        31104 bytes  per-head K/V     276480 bytes  (8.89x smaller)"));
    snprintf(cmd, sizeof cmd, "'%s' inspect --preset deepseek-v3", kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    assert_non_null(strstr(out, "F16        70272 bytes  per-head K/V    4997120 bytes  (71.11x smaller)"));
    snprintf(cmd, sizeof cmd, "'%s' inspect --preset no-such-shape", kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mla_geometry),
        cmocka_unit_test(test_mla_scatter),
        cmocka_unit_test(test_mla_model_format),
        cmocka_unit_test(test_mla_store_slabs),
        cmocka_unit_test(test_inspect_cache_cost),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
