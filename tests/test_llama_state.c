/* tests/test_llama_state.c — llama.cpp's sequence state file (foreign/kvb_foreign.h): a tiny state
 * is written and compared with bytes laid out here by hand from the pinned llama.cpp source (magic,
 * version, llama-server's packed token list, n_stream, cell count, (pos, 1, seq) per cell, v_trans,
 * n_layer, K type / row size / rows, V transposed element by element), and the same state with V
 * row-major; a minimal two-cache (iSWA) file, global cells then the sliding-window layers' last
 * cells, also against bytes by hand, with its cuts, caches of two sequences and a third cache; a
 * larger two-cache state (the interleaved-SWA shape, one cache in stream 1 of 2)
 * survives write, parse and save/load bit for bit; and hostile files are refused with the right
 * code: another magic or version (UNSUPPORTED, naming the supported build), a truncation at every
 * byte, a trailing byte, a bad packed-token version, media chunks, a cell with two sequence ids,
 * layers whose rows differ, a transposed V of a block type. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvb_foreign.h"
#include "kvb_quant.h"

/* (layer, cell, row) for a 1-layer, 2-cell f16 cache with 2 elements per row */
static const uint8_t k_k[8] = {0x10, 0x11, 0x12, 0x13, 0x20, 0x21, 0x22, 0x23};
static const uint8_t k_v[8] = {0xa0, 0xa1, 0xa2, 0xa3, 0xb0, 0xb1, 0xb2, 0xb3};
static int32_t k_pos[2] = {0, 1};
static int32_t k_tokens[2] = {7, 300};

static kvb_llama_state tiny_state(bool v_trans) {
    kvb_llama_state s = {.n_tokens = 2, .tokens = k_tokens, .server_packed = true, .n_cache = 1};
    s.cache[0] = (kvb_llama_cache){.n_stream = 1, .n_cells = 2, .seq_id = 0, .pos = k_pos, .v_trans = v_trans,
                                   .n_layer = 1, .k_type = KVB_TYPE_F16, .v_type = KVB_TYPE_F16,
                                   .k_row_bytes = 4, .v_row_bytes = 4, .k = (uint8_t *)k_k, .v = (uint8_t *)k_v};
    return s;
}

static size_t put32(uint8_t *b, size_t o, uint32_t v) {
    for (int i = 0; i < 4; i++) b[o + i] = (uint8_t)(v >> (8 * i));
    return o + 4;
}

/* The file by hand; V transposed: element 0 of both cells, then element 1. */
static size_t tiny_bytes(uint8_t *b, bool v_trans) {
    size_t o = 0;
    o = put32(b, o, 0x67677371u);
    o = put32(b, o, 3);
    o = put32(b, o, 6);          /* packed words: -1, 1, n, 7, 300, 0 */
    o = put32(b, o, 0xffffffffu);
    o = put32(b, o, 1);
    o = put32(b, o, 2);
    o = put32(b, o, 7);
    o = put32(b, o, 300);
    o = put32(b, o, 0);
    o = put32(b, o, 1); /* n_stream */
    o = put32(b, o, 2); /* cells */
    for (uint32_t t = 0; t < 2; t++) {
        o = put32(b, o, t);
        o = put32(b, o, 1);
        o = put32(b, o, 0);
    }
    o = put32(b, o, v_trans);
    o = put32(b, o, 1); /* layers */
    o = put32(b, o, 1); /* f16 */
    o = put32(b, o, 4);
    o = put32(b, o, 0); /* u64 high half */
    memcpy(b + o, k_k, 8);
    o += 8;
    o = put32(b, o, 1);
    if (!v_trans) {
        o = put32(b, o, 4);
        o = put32(b, o, 0);
        memcpy(b + o, k_v, 8);
        return o + 8;
    }
    o = put32(b, o, 2); /* element size */
    o = put32(b, o, 2); /* row width */
    const uint8_t vt[8] = {0xa0, 0xa1, 0xb0, 0xb1, 0xa2, 0xa3, 0xb2, 0xb3};
    memcpy(b + o, vt, 8);
    return o + 8;
}

static void test_tiny_file_matches_hand_layout(void **state) {
    (void)state;
    for (int trans = 0; trans < 2; trans++) {
        kvb_llama_state s = tiny_state(trans);
        uint8_t want[256], got[256];
        const size_t n_want = tiny_bytes(want, trans);
        size_t n_got = 0, n_size = 0;
        kvb_err err = {0};
        assert_int_equal(kvb_llama_state_size(&s, &n_size, &err), KVB_OK);
        assert_int_equal(n_size, n_want);
        assert_int_equal(kvb_llama_state_write(&s, got, sizeof got, &n_got, &err), KVB_OK);
        assert_int_equal(n_got, n_want);
        assert_memory_equal(got, want, n_want);
        assert_int_equal(kvb_llama_state_write(&s, got, n_want - 1, &n_got, &err), KVB_ERR_RANGE);
        kvb_llama_state p;
        assert_int_equal(kvb_llama_state_parse(want, n_want, &p, &err), KVB_OK);
        assert_true(p.server_packed);
        assert_int_equal(p.n_tokens, 2);
        assert_int_equal(p.tokens[1], 300);
        assert_int_equal(p.cache[0].v_trans, trans);
        assert_memory_equal(p.cache[0].k, k_k, 8);
        assert_memory_equal(p.cache[0].v, k_v, 8);
        kvb_llama_state_free(&p);
    }
}

static uint8_t *filled(size_t n, uint32_t seed) {
    uint8_t *b = malloc(n);
    assert_non_null(b);
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)((i * 2654435761u + seed) >> 13);
    return b;
}

/* Two caches like Gemma 3 270M's: 3 global layers, then 15 local ones (8 cells of a 5-cell window
 * in the local one here), 1 KV head of 256, f16; the local cache in stream 1 of 2, V transposed. */
static kvb_llama_state big_state(int32_t *tokens, int32_t *pos) {
    kvb_llama_state s = {.n_tokens = 12, .tokens = tokens, .server_packed = false, .n_cache = 2};
    for (int i = 0; i < 12; i++) tokens[i] = 1000 + i, pos[i] = i;
    s.cache[0] = (kvb_llama_cache){.n_stream = 1, .n_cells = 12, .seq_id = 3, .pos = pos, .v_trans = false,
                                   .n_layer = 3, .k_type = KVB_TYPE_F16, .v_type = KVB_TYPE_F16,
                                   .k_row_bytes = 512, .v_row_bytes = 512};
    s.cache[0].k = filled(3 * 12 * 512, 1), s.cache[0].v = filled(3 * 12 * 512, 2);
    s.cache[1] = (kvb_llama_cache){.n_stream = 2, .stream = 1, .n_cells = 5, .seq_id = 3, .pos = pos + 7,
                                   .v_trans = true, .n_layer = 15, .k_type = KVB_TYPE_F16,
                                   .v_type = KVB_TYPE_F16, .k_row_bytes = 512, .v_row_bytes = 512};
    s.cache[1].k = filled(15 * 5 * 512, 3), s.cache[1].v = filled(15 * 5 * 512, 4);
    return s;
}

static void free_big(kvb_llama_state *s) {
    for (int i = 0; i < 2; i++) free(s->cache[i].k), free(s->cache[i].v);
}

static void assert_same_state(const kvb_llama_state *a, const kvb_llama_state *b) {
    assert_int_equal(a->n_tokens, b->n_tokens);
    assert_memory_equal(a->tokens, b->tokens, a->n_tokens * 4);
    assert_int_equal(a->server_packed, b->server_packed);
    assert_int_equal(a->n_cache, b->n_cache);
    for (uint32_t i = 0; i < a->n_cache; i++) {
        const kvb_llama_cache *x = &a->cache[i], *y = &b->cache[i];
        assert_int_equal(x->n_stream, y->n_stream);
        assert_int_equal(x->stream, y->stream);
        assert_int_equal(x->n_cells, y->n_cells);
        assert_int_equal(x->seq_id, y->seq_id);
        assert_memory_equal(x->pos, y->pos, x->n_cells * 4);
        assert_int_equal(x->v_trans, y->v_trans);
        assert_int_equal(x->n_layer, y->n_layer);
        assert_int_equal(x->k_row_bytes, y->k_row_bytes);
        assert_int_equal(x->v_row_bytes, y->v_row_bytes);
        assert_memory_equal(x->k, y->k, x->n_layer * x->n_cells * x->k_row_bytes);
        assert_memory_equal(x->v, y->v, x->n_layer * x->n_cells * x->v_row_bytes);
    }
}

static void test_two_caches_round_trip(void **state) {
    (void)state;
    int32_t tokens[12], pos[12];
    kvb_llama_state s = big_state(tokens, pos), p;
    kvb_err err = {0};
    size_t n, len;
    assert_int_equal(kvb_llama_state_size(&s, &n, &err), KVB_OK);
    uint8_t *buf = malloc(n);
    assert_int_equal(kvb_llama_state_write(&s, buf, n, &len, &err), KVB_OK);
    assert_int_equal(kvb_llama_state_parse(buf, len, &p, &err), KVB_OK);
    assert_same_state(&s, &p);
    kvb_llama_state_free(&p);

    char path[] = "/tmp/kvb_llama_stateXXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(kvb_llama_state_save(&s, path, &err), KVB_OK);
    assert_int_equal(kvb_llama_state_load(path, &p, &err), KVB_OK);
    assert_same_state(&s, &p);
    kvb_llama_state_free(&p);
    unlink(path);
    free(buf);
    free_big(&s);
}

/* A minimal iSWA file: 3 tokens; cache 0 (global) 1 layer, cells 0..2, rows of 1 f16, V row-major;
 * cache 1 (sliding window of 2) 2 layers, cells 1..2 only, rows of 2 f16, V transposed. */
static const uint8_t s_gk[6] = {1, 2, 3, 4, 5, 6}, s_gv[6] = {7, 8, 9, 10, 11, 12};
static const uint8_t s_lk[16] = {20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35};
static const uint8_t s_lv[16] = {40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55};
static int32_t s_tok[3] = {2, 9, 77}, s_pos[3] = {0, 1, 2};

static kvb_llama_state swa_state(void) {
    kvb_llama_state s = {.n_tokens = 3, .tokens = s_tok, .server_packed = true, .n_cache = 2};
    s.cache[0] = (kvb_llama_cache){.n_stream = 1, .n_cells = 3, .seq_id = 1, .pos = s_pos, .n_layer = 1,
                                   .k_type = KVB_TYPE_F16, .v_type = KVB_TYPE_F16, .k_row_bytes = 2,
                                   .v_row_bytes = 2, .k = (uint8_t *)s_gk, .v = (uint8_t *)s_gv};
    s.cache[1] = (kvb_llama_cache){.n_stream = 1, .n_cells = 2, .seq_id = 1, .pos = s_pos + 1, .v_trans = true,
                                   .n_layer = 2, .k_type = KVB_TYPE_F16, .v_type = KVB_TYPE_F16,
                                   .k_row_bytes = 4, .v_row_bytes = 4, .k = (uint8_t *)s_lk, .v = (uint8_t *)s_lv};
    return s;
}

/* Its bytes by hand; *cache1 = where the second cache's section begins. */
static size_t swa_bytes(uint8_t *b, size_t *cache1) {
    size_t o = 0;
    const uint32_t head[] = {0x67677371u, 3, 7, 0xffffffffu, 1, 3, 2, 9, 77, 0, /* packed tokens */
                             1, 3, 0, 1, 1, 1, 1, 1, 2, 1, 1, /* cache 0: 1 stream, 3 cells (pos, 1, seq 1) */
                             0, 1, 1, 2, 0};                  /* row-major, 1 layer, K f16, row 2 (u64) */
    for (size_t i = 0; i < sizeof head / 4; i++) o = put32(b, o, head[i]);
    memcpy(b + o, s_gk, 6), o += 6;
    o = put32(b, o, 1), o = put32(b, o, 2), o = put32(b, o, 0); /* V f16, row 2 */
    memcpy(b + o, s_gv, 6), o += 6;
    *cache1 = o;
    const uint32_t mid[] = {1, 2, 1, 1, 1, 2, 1, 1, /* cache 1: 1 stream, cells at 1 and 2 */
                            1, 2};                  /* V transposed, 2 layers */
    for (size_t i = 0; i < sizeof mid / 4; i++) o = put32(b, o, mid[i]);
    for (int l = 0; l < 2; l++) {
        o = put32(b, o, 1), o = put32(b, o, 4), o = put32(b, o, 0);
        memcpy(b + o, s_lk + 8 * l, 8), o += 8;
    }
    for (int l = 0; l < 2; l++) { /* element 0 of both cells, then element 1 */
        o = put32(b, o, 1), o = put32(b, o, 2), o = put32(b, o, 2);
        const uint8_t *v = s_lv + 8 * l;
        const uint8_t t[8] = {v[0], v[1], v[4], v[5], v[2], v[3], v[6], v[7]};
        memcpy(b + o, t, 8), o += 8;
    }
    return o;
}

static void test_swa_file_matches_hand_layout(void **state) {
    (void)state;
    uint8_t want[512], got[512];
    size_t cache1, n_got = 0;
    const size_t n_want = swa_bytes(want, &cache1);
    kvb_llama_state s = swa_state(), p;
    kvb_err err = {0};
    assert_int_equal(kvb_llama_state_write(&s, got, sizeof got, &n_got, &err), KVB_OK);
    assert_int_equal(n_got, n_want);
    assert_memory_equal(got, want, n_want);
    assert_int_equal(kvb_llama_state_parse(want, n_want, &p, &err), KVB_OK);
    assert_int_equal(p.n_cache, 2);
    assert_int_equal(p.cache[0].n_layer, 1);
    assert_int_equal(p.cache[1].n_layer, 2);
    assert_int_equal(p.cache[1].n_cells, 2);
    assert_int_equal(p.cache[1].pos[0], 1);
    assert_memory_equal(p.cache[1].v, s_lv, 16);
    kvb_llama_state_free(&p);
    /* cut at the boundary, the file is a valid one-cache file (the door and verify check the count
     * against the model); every other cut is malformed */
    for (size_t cut = 8; cut < n_want; cut++) {
        kvb_status st = kvb_llama_state_parse(want, cut, &p, &err);
        if (cut == cache1) {
            assert_int_equal(st, KVB_OK);
            assert_int_equal(p.n_cache, 1);
            kvb_llama_state_free(&p);
        } else if (st != KVB_ERR_FORMAT) {
            fail_msg("cut at %zu of %zu: %s", cut, n_want, kvb_status_name(st));
        }
    }
    /* the caches of two sequences: refused both ways */
    s.cache[1].seq_id = 0;
    assert_int_equal(kvb_llama_state_write(&s, got, sizeof got, &n_got, &err), KVB_ERR_INVALID);
    uint8_t bad[512];
    memcpy(bad, want, n_want);
    put32(bad, cache1 + 16, 0), put32(bad, cache1 + 28, 0); /* both cells' sequence id */
    assert_int_equal(kvb_llama_state_parse(bad, n_want, &p, &err), KVB_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "sequences 1 and 0"));
    /* a third cache: the file ends after two */
    memcpy(bad, want, n_want);
    memcpy(bad + n_want, want + cache1, n_want - cache1);
    assert_int_equal(kvb_llama_state_parse(bad, n_want + (n_want - cache1), &p, &err), KVB_ERR_FORMAT);
}

static kvb_status parse_code(const uint8_t *b, size_t n, kvb_err *err) {
    kvb_llama_state p;
    kvb_status st = kvb_llama_state_parse(b, n, &p, err);
    if (!st) kvb_llama_state_free(&p);
    return st;
}

static void test_hostile_files_refused(void **state) {
    (void)state;
    uint8_t b[256];
    kvb_err err = {0};
    const size_t n = tiny_bytes(b, true);
    for (size_t cut = 0; cut < n; cut++) { /* every truncation; the first 8 bytes are the header */
        kvb_status st = parse_code(b, cut, &err);
        assert_int_equal(st, KVB_ERR_FORMAT);
    }
    uint8_t c[257];
    memcpy(c, b, n);
    c[n] = 0;
    assert_int_equal(parse_code(c, n + 1, &err), KVB_ERR_FORMAT);
    struct { size_t off; uint32_t val; kvb_status want; } cases[] = {
        {4, 4, KVB_ERR_UNSUPPORTED},           /* file version */
        {0, 0x6767736e, KVB_ERR_UNSUPPORTED},  /* a whole-context session file */
        {16, 2, KVB_ERR_UNSUPPORTED},          /* packed-token version */
        {20, 3, KVB_ERR_FORMAT},               /* packed count disagrees with the word count */
        {32, 1, KVB_ERR_UNSUPPORTED},          /* a media chunk */
        {36, 0, KVB_ERR_FORMAT},               /* no streams */
        {48, 2, KVB_ERR_UNSUPPORTED},          /* two sequence ids in a cell */
        {68, 2, KVB_ERR_FORMAT},               /* v_trans 2 */
        {72, 0, KVB_ERR_FORMAT},               /* no layers */
        {80, 3, KVB_ERR_FORMAT},               /* K row of 3 bytes for f16 */
        {84, 1, KVB_ERR_FORMAT},               /* K row size beyond the file */
        {96, 8, KVB_ERR_FORMAT},               /* transposed V of q8_0 */
        {100, 4, KVB_ERR_FORMAT},              /* element size 4 for f16 */
        {64, 1, KVB_ERR_FORMAT},               /* cells of two sequences */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        memcpy(c, b, n);
        put32(c, cases[i].off, cases[i].val);
        kvb_status st = parse_code(c, n, &err);
        if (st != cases[i].want) fail_msg("case %zu: %s (%s)", i, kvb_status_name(st), err.msg);
        if (st == KVB_ERR_UNSUPPORTED && i < 3) assert_non_null(strstr(err.msg, "llama-cpp-python 0.3.36"));
    }
}

static void test_layers_must_agree(void **state) {
    (void)state;
    int32_t tokens[12], pos[12];
    kvb_llama_state s = big_state(tokens, pos);
    s.n_cache = 1;
    kvb_err err = {0};
    size_t n, len;
    assert_int_equal(kvb_llama_state_size(&s, &n, &err), KVB_OK);
    uint8_t *buf = malloc(n);
    assert_int_equal(kvb_llama_state_write(&s, buf, n, &len, &err), KVB_OK);
    /* layer 1's K type: header 12 + 4*12 tokens, n_stream 4, cells 4, meta 12*12, v_trans/n_layer 8,
     * layer 0: 4 + 8 + 12*512 */
    const size_t off = 12 + 48 + 8 + 144 + 8 + 12 + 12 * 512;
    put32(buf, off, KVB_TYPE_BF16);
    assert_int_equal(parse_code(buf, len, &err), KVB_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "layer 1"));
    s.cache[0].v_type = KVB_TYPE_Q8_0, s.cache[0].v_trans = true, s.cache[0].v_row_bytes = 34 * 16;
    assert_int_equal(kvb_llama_state_size(&s, &n, &err), KVB_ERR_INVALID);
    free(buf);
    free_big(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_file_matches_hand_layout),
        cmocka_unit_test(test_two_caches_round_trip),
        cmocka_unit_test(test_swa_file_matches_hand_layout),
        cmocka_unit_test(test_hostile_files_refused),
        cmocka_unit_test(test_layers_must_agree),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
