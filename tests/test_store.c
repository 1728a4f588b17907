/* tests/test_store.c — the block store (issue 5, item 4): chain keys follow the spec; commit
 * publishes, dedups and refuses as documented; LRU eviction takes the least recently used
 * unreferenced block and never a referenced one (contents and ids of held blocks survive full
 * pressure, and a full store fails at once with KVB_ERR_RANGE); a lookup never returns a block
 * that is being written or assembled; hostile slabs (checksum mismatch, wrong lengths, layer or
 * token out of range, duplicates, overlaps, missing bytes) are rejected with a message, write
 * nothing and commit nothing; several threads put the slabs of the same pending blocks at once
 * (shuffled, with a thread polling the getters): each block is committed exactly once with the bytes
 * of a sequential assembly, a racing duplicate is rejected exactly once, a racing corrupt slab
 * leaves its cells free for the good one; 4 threads commit (engine path and slab path) and look up
 * shared prefixes concurrently and every block they read holds the bytes its committer wrote; and 10^6
 * random operations (KVB_STORE_MODEL_OPS overrides) are checked one by one against a plain model of
 * the store (states, refcounts, exact LRU victim, dedup, counters). Block bytes are a function of
 * the chain key, so any reader can verify any block. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_quant.h"
#include "kvb_store.h"
#include "store_internal.h" /* white box, for the simulated key collision only */

/* A small format: f32 rows of 8 values, 4 tokens per block, 3 layers, 2 kv heads: 1536 bytes. */
#define BT 4
#define NL 3
#define NKV 2
#define HD 8
#define BB_MAX 4096
#define MAX_SLABS (NL * BT)
static const uint64_t MODEL_FP = 0x6d6f64656c2d6670ULL;

static kvb_kvformat g_fmt;
static size_t g_row, g_bb;

static void fmt_init(void) {
    kvb_err e = {0};
    assert_int_equal(kvb_kvformat_init(&g_fmt, KVB_TYPE_F32, BT, NL, NKV, HD, &e), KVB_OK);
    g_row = kvb_kvformat_row_bytes(&g_fmt);
    g_bb = kvb_kvformat_block_bytes(&g_fmt);
    assert_int_equal(g_row, HD * 4);
    assert_int_equal(g_bb, (size_t)NL * 2 * NKV * BT * HD * 4);
    assert_true(g_bb <= BB_MAX);
}

static kvb_store *new_store(uint32_t n_blocks) {
    fmt_init();
    kvb_store *s = NULL;
    kvb_err e = {0};
    kvb_status st = kvb_store_create(&g_fmt, MODEL_FP, n_blocks, &s, &e);
    if (st) fail_msg("kvb_store_create: %s", e.msg);
    return s;
}

static void check_store(kvb_store *s) {
    kvb_err e = {0};
    if (kvb_store_check(s, &e) != KVB_OK) fail_msg("store invariant broken: %s", e.msg);
}

/* ---- block contents: a function of the chain key -------------------------------------------- */

static void fill_block(uint8_t *dst, uint64_t key) {
    uint64_t x = key;
    for (size_t i = 0; i < g_bb; i += 8) {
        x = kvb_splitmix64(x);
        memcpy(dst + i, &x, g_bb - i < 8 ? g_bb - i : 8);
    }
}

static bool block_matches(const uint8_t *src, uint64_t key) {
    uint8_t want[BB_MAX];
    fill_block(want, key);
    return memcmp(src, want, g_bb) == 0;
}

/* ---- a universe of prompts sharing prefixes ------------------------------------------------
 * Prompt p's block b holds tokens of group (p mod 2^b): block 0 is shared by all prompts, block 1
 * by half of them, and so on, so chains branch like a binary tree. Each prompt also has a
 * partial tail block. */
typedef struct {
    uint32_t np, lb;
    uint64_t root;
    int32_t *tok; /* (np, (lb + 1) * BT) */
    uint64_t *key; /* (np, lb) */
} universe;

static const int32_t *utok(const universe *u, uint32_t p) { return u->tok + (size_t)p * (u->lb + 1) * BT; }
static uint64_t ukey(const universe *u, uint32_t p, uint32_t b) { return u->key[(size_t)p * u->lb + b]; }
static uint64_t uparent(const universe *u, uint32_t p, uint32_t b) { return b ? ukey(u, p, b - 1) : u->root; }

static void universe_init(universe *u, kvb_store *s, uint32_t np, uint32_t lb) {
    u->np = np;
    u->lb = lb;
    u->root = kvb_store_root_key(s);
    u->tok = malloc(sizeof(int32_t) * np * (lb + 1) * BT);
    u->key = malloc(sizeof(uint64_t) * np * lb);
    assert_non_null(u->tok);
    assert_non_null(u->key);
    for (uint32_t p = 0; p < np; p++) {
        int32_t *t = u->tok + (size_t)p * (lb + 1) * BT;
        for (uint32_t b = 0; b <= lb; b++) {
            uint64_t group = b < lb ? (p & ((1ull << (b < 31 ? b : 31)) - 1)) : p;
            for (uint32_t j = 0; j < BT; j++)
                t[b * BT + j] = (int32_t)(kvb_splitmix64(((uint64_t)b << 40) ^ (group << 20) ^ j) % 50000);
        }
        assert_int_equal(kvb_store_chain_keys(s, t, lb * BT + BT - 1, u->key + (size_t)p * lb), lb);
    }
}

static void universe_free(universe *u) {
    free(u->tok);
    free(u->key);
}

/* ---- the two writers: the engine path and the slab path --------------------------------------- */

static kvb_status engine_commit(kvb_store *s, const universe *u, uint32_t p, uint32_t b, kvb_block_id *out,
                                kvb_err *err) {
    kvb_block_id id;
    kvb_status st = kvb_store_alloc(s, 1, &id, err);
    if (st) return st;
    fill_block(kvb_store_block_data(s, id), ukey(u, p, b));
    st = kvb_store_commit_block(s, id, ukey(u, p, b), uparent(u, p, b), utok(u, p) + b * BT, out, err);
    if (st) kvb_store_release(s, &id, 1, NULL);
    return st;
}

typedef struct {
    uint32_t layer, t0, n;
} slab_desc;

/* Cuts every layer's tokens into random runs, in a random order. */
/* Fisher-Yates over n elements of `size` bytes (at most 1 KiB). */
static void shuffle(void *a, uint32_t n, size_t size, kvb_rng *r) {
    uint8_t *p = a, tmp[1024];
    assert_true(size <= sizeof tmp);
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = (uint32_t)(kvb_rng_u64(r) % i);
        memcpy(tmp, p + (size_t)(i - 1) * size, size);
        memcpy(p + (size_t)(i - 1) * size, p + (size_t)j * size, size);
        memcpy(p + (size_t)j * size, tmp, size);
    }
}

static uint32_t plan_slabs(kvb_rng *r, slab_desc *out) {
    uint32_t n = 0;
    for (uint32_t l = 0; l < NL; l++)
        for (uint32_t t = 0; t < BT;) {
            uint32_t len = 1 + (uint32_t)(kvb_rng_u64(r) % (BT - t));
            out[n++] = (slab_desc){l, t, len};
            t += len;
        }
    shuffle(out, n, sizeof *out, r);
    return n;
}

/* Gathers a slab's K and V, each (n, kv_head, row), token major, from a finished block. */
static void make_slab(const uint8_t *blk, slab_desc d, uint8_t *k, uint8_t *v) {
    for (uint32_t t = 0; t < d.n; t++)
        for (uint32_t h = 0; h < NKV; h++) {
            memcpy(k + ((size_t)t * NKV + h) * g_row, blk + kvb_kvformat_row_offset(&g_fmt, d.layer, 0, h, d.t0 + t),
                   g_row);
            memcpy(v + ((size_t)t * NKV + h) * g_row, blk + kvb_kvformat_row_offset(&g_fmt, d.layer, 1, h, d.t0 + t),
                   g_row);
        }
}

static kvb_status put_slab(kvb_slab_pending *pp, const uint8_t *blk, slab_desc d, kvb_block_id *out, kvb_err *err) {
    uint8_t k[BT * NKV * HD * 4], v[BT * NKV * HD * 4];
    make_slab(blk, d, k, v);
    size_t n = (size_t)d.n * NKV * g_row;
    return kvb_store_slab_put(pp, d.layer, d.t0, d.n, k, n, v, n, kvb_slab_checksum(k, n, v, n), out, err);
}

static kvb_status slab_commit(kvb_store *s, const universe *u, uint32_t p, uint32_t b, kvb_rng *r, kvb_block_id *out,
                              kvb_err *err) {
    kvb_slab_pending *pp;
    kvb_status st = kvb_store_slab_begin(s, ukey(u, p, b), uparent(u, p, b), utok(u, p) + b * BT, &pp, err);
    if (st) return st;
    uint8_t blk[BB_MAX];
    fill_block(blk, ukey(u, p, b));
    slab_desc sl[MAX_SLABS];
    uint32_t n = plan_slabs(r, sl);
    *out = KVB_BLOCK_NONE;
    for (uint32_t i = 0; i < n && !st; i++) {
        st = put_slab(pp, blk, sl[i], out, err);
        if (!st && (i + 1 < n) != (*out == KVB_BLOCK_NONE)) st = kvb_err_set(err, KVB_ERR_INTERNAL, "early commit");
    }
    kvb_store_slab_close(pp);
    return st;
}

/* ---- chain keys, commit, dedup, refusals ---------------------------------------------------- */

static void test_chain_keys_follow_spec(void **state) {
    (void)state;
    kvb_store *s = new_store(8);
    /* root = XXH3-64(model_fp || format_fp, little endian, seeded); key(i) = XXH3-64(tokens, key(i-1)). */
    uint8_t rb[16];
    uint64_t ffp = kvb_kvformat_fingerprint(&g_fmt);
    for (int i = 0; i < 8; i++) {
        rb[i] = (uint8_t)(MODEL_FP >> (8 * i));
        rb[8 + i] = (uint8_t)(ffp >> (8 * i));
    }
    uint64_t root = kvb_hash64(rb, 16, KVB_CHAIN_ROOT_SEED);
    assert_true(kvb_store_root_key(s) == root);
    assert_true(kvb_chain_root(MODEL_FP, ffp) == root);
    assert_true(kvb_chain_root(MODEL_FP ^ 1, ffp) != root);
    assert_true(kvb_chain_root(MODEL_FP, ffp ^ 1) != root);
    int32_t tok[3 * BT + 2];
    for (int i = 0; i < 3 * BT + 2; i++) tok[i] = 1000 + i * 7;
    uint64_t keys[3];
    assert_int_equal(kvb_store_chain_keys(s, tok, 3 * BT + 2, keys), 3);
    assert_int_equal(kvb_store_chain_keys(s, tok, BT - 1, keys + 2), 0);
    uint64_t k = root;
    for (int b = 0; b < 3; b++) {
        k = kvb_hash64(tok + b * BT, BT * sizeof(int32_t), k);
        assert_true(keys[b] == k);
    }
    /* A store for another model has another root: its blocks never match this store's chains. */
    kvb_store *s2 = NULL;
    kvb_err e = {0};
    assert_int_equal(kvb_store_create(&g_fmt, MODEL_FP + 1, 8, &s2, &e), KVB_OK);
    uint64_t keys2[3];
    kvb_store_chain_keys(s2, tok, 3 * BT, keys2);
    assert_true(keys2[0] != keys[0]);
    kvb_store_free(s2);
    /* Bad creation arguments. */
    assert_int_equal(kvb_store_create(&g_fmt, MODEL_FP, 0, &s2, &e), KVB_ERR_RANGE);
    assert_null(s2);
    kvb_store_free(s);
}

static void test_commit_dedup_and_refusals(void **state) {
    (void)state;
    kvb_store *s = new_store(8);
    universe u;
    universe_init(&u, s, 4, 3);
    kvb_err e = {0};
    kvb_block_id a, b, got, got2;
    kvb_block_id two[2];
    assert_int_equal(kvb_store_alloc(s, 2, two, &e), KVB_OK); /* WRITING, then discarded */
    assert_int_equal(kvb_store_release(s, two, 2, &e), KVB_OK);

    assert_int_equal(kvb_store_alloc(s, 1, &a, &e), KVB_OK);
    assert_int_equal(kvb_store_alloc(s, 1, &b, &e), KVB_OK);
    fill_block(kvb_store_block_data(s, a), ukey(&u, 0, 0));
    fill_block(kvb_store_block_data(s, b), ukey(&u, 0, 0));
    /* wrong key, wrong parent: refused, nothing changes, the caller still owns the block */
    e.msg[0] = 0;
    assert_int_equal(kvb_store_commit_block(s, a, ukey(&u, 0, 0) ^ 1, u.root, utok(&u, 0), &got, &e), KVB_ERR_INVALID);
    assert_non_null(strstr(e.msg, "does not match"));
    assert_int_equal(got, KVB_BLOCK_NONE);
    assert_int_equal(kvb_store_commit_block(s, a, ukey(&u, 0, 0), u.root ^ 1, utok(&u, 0), &got, &e), KVB_ERR_INVALID);
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.committed, 0);
    assert_int_equal(st.writing, 2);
    assert_int_equal(st.commit_refusals, 2);

    assert_int_equal(kvb_store_commit_block(s, a, ukey(&u, 0, 0), u.root, utok(&u, 0), &got, &e), KVB_OK);
    assert_int_equal(got, a);
    /* committing a committed or free block is refused */
    assert_int_equal(kvb_store_commit_block(s, a, ukey(&u, 0, 0), u.root, utok(&u, 0), &got2, &e), KVB_ERR_INVALID);
    assert_non_null(strstr(e.msg, "already committed"));
    assert_int_equal(kvb_store_commit_block(s, 7, ukey(&u, 0, 0), u.root, utok(&u, 0), &got2, &e), KVB_ERR_INVALID);
    assert_non_null(strstr(e.msg, "free"));
    assert_int_equal(kvb_store_commit_block(s, 99, ukey(&u, 0, 0), u.root, utok(&u, 0), &got2, &e), KVB_ERR_INVALID);
    /* dedup: the same content again frees the duplicate page and references the existing block */
    assert_int_equal(kvb_store_commit_block(s, b, ukey(&u, 0, 0), u.root, utok(&u, 0), &got2, &e), KVB_OK);
    assert_int_equal(got2, a);
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.commits, 1);
    assert_int_equal(st.dedups, 1);
    assert_int_equal(st.committed, 1);
    assert_int_equal(st.referenced, 1);
    assert_int_equal(st.writing, 0);
    assert_int_equal(st.free, 7);
    /* two references are held (commit + dedup): two releases, a third is a double release */
    assert_int_equal(kvb_store_release(s, &a, 1, &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, &a, 1, &e), KVB_OK);
    e.msg[0] = 0;
    assert_int_equal(kvb_store_release(s, &a, 1, &e), KVB_ERR_INVALID);
    assert_non_null(strstr(e.msg, "double release"));
    assert_int_equal(kvb_store_release(s, &b, 1, &e), KVB_ERR_INVALID); /* b is free again */
    kvb_block_id oob = 1000;
    assert_int_equal(kvb_store_release(s, &oob, 1, &e), KVB_ERR_INVALID);
    assert_int_equal(kvb_store_retain(s, &b, 1, &e), KVB_ERR_INVALID);
    /* retain / lookup / release round trip */
    assert_int_equal(kvb_store_retain(s, &a, 1, &e), KVB_OK);
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.referenced, 1);
    assert_int_equal(st.evictable, 0);
    assert_int_equal(kvb_store_release(s, &a, 1, &e), KVB_OK);
    kvb_block_id ids[4];
    uint32_t n;
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 3 * BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], a);
    assert_true(block_matches(kvb_store_block_data(s, a), ukey(&u, 0, 0)));
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), BT - 1, ids, &n, &e), KVB_OK); /* no full block */
    assert_int_equal(n, 0);
    assert_int_equal(kvb_store_release(s, &a, 1, &e), KVB_OK);
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.lookups, 2);
    assert_int_equal(st.lookup_hit_blocks, 1);
    assert_int_equal(st.evictable, 1);
    check_store(s);
    universe_free(&u);
    kvb_store_free(s);
}

/* A 64-bit chain key collision cannot be produced on purpose, so it is simulated by editing the
 * stored tokens / parent key of a committed block (white box): lookup must treat the block as a
 * miss, and committing the real block under that key must be refused as a collision. */

static void test_key_collision_is_a_miss(void **state) {
    (void)state;
    kvb_store *s = new_store(8);
    universe u;
    universe_init(&u, s, 2, 2);
    kvb_err e = {0};
    kvb_block_id b[2], ids[2], w, got;
    uint32_t n;
    for (uint32_t i = 0; i < 2; i++) assert_int_equal(engine_commit(s, &u, 0, i, &b[i], &e), KVB_OK);
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 2 * BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 2);
    assert_int_equal(kvb_store_release(s, ids, n, &e), KVB_OK);
    for (int what = 0; what < 2; what++) {
        int32_t *tok = s->tokens + (size_t)b[1] * BT + BT - 1;
        if (what == 0) *tok ^= 1; /* same key, other tokens */
        else s->meta[b[1]].parent_key ^= 1; /* same key, other parent */
        assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 2 * BT, ids, &n, &e), KVB_OK);
        assert_int_equal(n, 1);
        assert_int_equal(kvb_store_release(s, ids, n, &e), KVB_OK);
        assert_int_equal(kvb_store_alloc(s, 1, &w, &e), KVB_OK);
        fill_block(kvb_store_block_data(s, w), ukey(&u, 0, 1));
        e.msg[0] = 0;
        assert_int_equal(kvb_store_commit_block(s, w, ukey(&u, 0, 1), ukey(&u, 0, 0), utok(&u, 0) + BT, &got, &e),
                         KVB_ERR_INVALID);
        assert_non_null(strstr(e.msg, "collision"));
        assert_int_equal(kvb_store_release(s, &w, 1, &e), KVB_OK);
        if (what == 0) *tok ^= 1;
        else s->meta[b[1]].parent_key ^= 1;
    }
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 2 * BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 2);
    assert_int_equal(kvb_store_release(s, ids, n, &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, b, 2, &e), KVB_OK);
    check_store(s);
    universe_free(&u);
    kvb_store_free(s);
}

/* ---- eviction ---------------------------------------------------------------------------------- */

static void test_eviction_never_frees_referenced(void **state) {
    (void)state;
    const uint32_t NB = 16;
    kvb_store *s = new_store(NB);
    universe u;
    universe_init(&u, s, 8, 6);
    kvb_err e = {0};
    /* prompt 0: 6 blocks, references kept; prompt 1: blocks 1..3 (it shares block 0), released */
    kvb_block_id held[6], other[3];
    for (uint32_t b = 0; b < 6; b++) assert_int_equal(engine_commit(s, &u, 0, b, &held[b], &e), KVB_OK);
    for (uint32_t b = 1; b < 4; b++) assert_int_equal(engine_commit(s, &u, 1, b, &other[b - 1], &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, other, 3, &e), KVB_OK);
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.free, NB - 9);
    assert_int_equal(st.referenced, 6);
    assert_int_equal(st.evictable, 3);

    /* pressure: take every page that can be had, scribble on it */
    kvb_block_id taken[16];
    uint32_t n_taken = 0;
    for (;;) {
        kvb_block_id id;
        e.msg[0] = 0;
        kvb_status rc = kvb_store_alloc(s, 1, &id, &e);
        if (rc) {
            assert_int_equal(rc, KVB_ERR_RANGE);
            assert_non_null(strstr(e.msg, "full"));
            assert_non_null(strstr(e.msg, "6 referenced"));
            break;
        }
        for (int i = 0; i < 6; i++) assert_int_not_equal(id, held[i]);
        memset(kvb_store_block_data(s, id), 0xEE, g_bb);
        taken[n_taken++] = id;
        assert_true(n_taken <= NB);
    }
    assert_int_equal(n_taken, NB - 6);
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.evictions, 3);
    assert_int_equal(st.alloc_failures, 1);
    assert_int_equal(st.free, 0);
    /* an all-or-nothing request that cannot be met changes nothing */
    kvb_block_id many[4];
    assert_int_equal(kvb_store_alloc(s, 2, many, &e), KVB_ERR_RANGE);
    /* the held chain is intact and still found, with the same ids */
    for (int i = 0; i < 6; i++) assert_true(block_matches(kvb_store_block_data(s, held[i]), ukey(&u, 0, i)));
    kvb_block_id ids[7];
    uint32_t n;
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 6 * BT + 3, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 6);
    assert_memory_equal(ids, held, sizeof held);
    assert_int_equal(kvb_store_release(s, ids, n, &e), KVB_OK);
    /* prompt 1 lost its own blocks to eviction (it still shares block 0) */
    assert_int_equal(kvb_store_lookup(s, utok(&u, 1), 4 * BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], held[0]);
    assert_int_equal(kvb_store_release(s, ids, n, &e), KVB_OK);
    check_store(s);

    /* give everything back: now the held chain is evictable, deepest block first */
    assert_int_equal(kvb_store_release(s, taken, n_taken, &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, held, 6, &e), KVB_OK);
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.free, NB - 6);
    assert_int_equal(st.evictable, 6);
    kvb_block_id all[16];
    assert_int_equal(kvb_store_alloc(s, NB - 6 + 1, all, &e), KVB_OK);
    assert_int_equal(all[NB - 6], held[5]); /* the chain's extension goes before its head */
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 6 * BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 5);
    assert_int_equal(kvb_store_release(s, ids, n, &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, all, NB - 6 + 1, &e), KVB_OK);
    check_store(s);
    universe_free(&u);
    kvb_store_free(s);
}

static void test_lru_order(void **state) {
    (void)state;
    const uint32_t NB = 4;
    kvb_store *s = new_store(NB);
    universe u;
    universe_init(&u, s, 4, 2);
    kvb_err e = {0};
    /* A = block 0 (shared by prompts 0 and 1), B = prompt 0's block 1, C = prompt 1's block 1 */
    kvb_block_id A, B, C, ids[2];
    uint32_t n;
    assert_int_equal(engine_commit(s, &u, 0, 0, &A, &e), KVB_OK); /* shared root block */
    assert_int_equal(engine_commit(s, &u, 0, 1, &B, &e), KVB_OK); /* prompt 0 block 1 */
    assert_int_equal(engine_commit(s, &u, 1, 1, &C, &e), KVB_OK); /* prompt 1 block 1 */
    assert_int_equal(kvb_store_release(s, &A, 1, &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, &B, 1, &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, &C, 1, &e), KVB_OK);
    /* LRU now A, B, C. Touch prompt 0 (A, B): released in chain order -> B older than A. */
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 2 * BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 2);
    assert_int_equal(kvb_store_release(s, ids, n, &e), KVB_OK); /* LRU: C, B, A */
    kvb_block_id x[4];
    assert_int_equal(kvb_store_alloc(s, 1, x, &e), KVB_OK); /* the free page */
    assert_int_equal(kvb_store_alloc(s, 1, x + 1, &e), KVB_OK);
    assert_int_equal(x[1], C);
    assert_int_equal(kvb_store_alloc(s, 1, x + 2, &e), KVB_OK);
    assert_int_equal(x[2], B);
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 2 * BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], A);
    assert_int_equal(kvb_store_alloc(s, 1, x + 3, &e), KVB_ERR_RANGE); /* A is referenced */
    assert_int_equal(kvb_store_release(s, ids, 1, &e), KVB_OK);
    assert_int_equal(kvb_store_alloc(s, 1, x + 3, &e), KVB_OK);
    assert_int_equal(x[3], A);
    assert_int_equal(kvb_store_release(s, x, 4, &e), KVB_OK);
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.evictions, 3);
    assert_int_equal(st.free, NB);
    check_store(s);
    universe_free(&u);
    kvb_store_free(s);
}

/* ---- invisibility of incomplete blocks ----------------------------------------------------------- */

static void test_incomplete_blocks_invisible(void **state) {
    (void)state;
    kvb_store *s = new_store(8);
    universe u;
    universe_init(&u, s, 2, 3);
    kvb_err e = {0};
    kvb_block_id ids[4], got;
    uint32_t n;
    kvb_rng r;
    kvb_rng_seed(&r, 5);
    /* block 0 assembled from slabs, all but the last */
    kvb_slab_pending *pp;
    assert_int_equal(kvb_store_slab_begin(s, ukey(&u, 0, 0), u.root, utok(&u, 0), &pp, &e), KVB_OK);
    uint8_t blk0[BB_MAX];
    fill_block(blk0, ukey(&u, 0, 0));
    slab_desc sl[MAX_SLABS];
    uint32_t ns = plan_slabs(&r, sl);
    for (uint32_t i = 0; i + 1 < ns; i++) {
        assert_int_equal(put_slab(pp, blk0, sl[i], &got, &e), KVB_OK);
        assert_int_equal(got, KVB_BLOCK_NONE);
        assert_false(kvb_store_slab_committed(pp));
        assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 3 * BT, ids, &n, &e), KVB_OK);
        assert_int_equal(n, 0);
    }
    assert_int_equal(kvb_store_slab_missing(pp), sl[ns - 1].n);
    /* block 1 written by the engine path but not committed: invisible */
    kvb_block_id w;
    assert_int_equal(kvb_store_alloc(s, 1, &w, &e), KVB_OK);
    fill_block(kvb_store_block_data(s, w), ukey(&u, 0, 1));
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 3 * BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 0);
    /* committed, but its parent is still being assembled: unreachable */
    kvb_block_id b1;
    assert_int_equal(kvb_store_commit_block(s, w, ukey(&u, 0, 1), ukey(&u, 0, 0), utok(&u, 0) + BT, &b1, &e), KVB_OK);
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 3 * BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 0);
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.committed, 1);
    assert_int_equal(st.pending_slab_blocks, 1);
    /* the last slab completes block 0: the chain of two appears at once */
    assert_int_equal(put_slab(pp, blk0, sl[ns - 1], &got, &e), KVB_OK);
    assert_int_not_equal(got, KVB_BLOCK_NONE);
    assert_true(kvb_store_slab_committed(pp));
    assert_int_equal(kvb_store_slab_block(pp), got);
    assert_int_equal(kvb_store_slab_missing(pp), 0);
    /* nothing more is accepted for a complete block */
    assert_int_equal(put_slab(pp, blk0, sl[0], NULL, &e), KVB_ERR_FORMAT);
    kvb_store_slab_close(pp);
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 3 * BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], got);
    assert_int_equal(ids[1], b1);
    assert_true(block_matches(kvb_store_block_data(s, ids[0]), ukey(&u, 0, 0)));
    assert_true(block_matches(kvb_store_block_data(s, ids[1]), ukey(&u, 0, 1)));
    assert_int_equal(kvb_store_release(s, ids, n, &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, &got, 1, &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, &b1, 1, &e), KVB_OK);
    /* an assembly abandoned half way (peer dropped) never shows and returns its page */
    assert_int_equal(kvb_store_slab_begin(s, ukey(&u, 0, 2), ukey(&u, 0, 1), utok(&u, 0) + 2 * BT, &pp, &e), KVB_OK);
    uint8_t blk2[BB_MAX];
    fill_block(blk2, ukey(&u, 0, 2));
    ns = plan_slabs(&r, sl);
    for (uint32_t i = 0; i < ns / 2; i++) assert_int_equal(put_slab(pp, blk2, sl[i], &got, &e), KVB_OK);
    kvb_store_get_stats(s, &st);
    uint32_t free_before = st.free;
    kvb_store_slab_close(pp);
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.free, free_before + 1);
    assert_int_equal(st.pending_slab_blocks, 0);
    assert_int_equal(st.writing, 0);
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 3 * BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 2);
    assert_int_equal(kvb_store_release(s, ids, n, &e), KVB_OK);
    /* one (layer, token) cell short, for every cell: still invisible; the last cell publishes it */
    for (uint32_t miss = 0; miss < NL * BT; miss++) {
        assert_int_equal(kvb_store_slab_begin(s, ukey(&u, 0, 2), ukey(&u, 0, 1), utok(&u, 0) + 2 * BT, &pp, &e),
                         KVB_OK);
        for (uint32_t c = 0; c < NL * BT; c++) {
            if (c == miss) continue;
            assert_int_equal(put_slab(pp, blk2, (slab_desc){c / BT, c % BT, 1}, &got, &e), KVB_OK);
            assert_int_equal(got, KVB_BLOCK_NONE);
        }
        assert_int_equal(kvb_store_slab_missing(pp), 1);
        assert_false(kvb_store_slab_committed(pp));
        assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 3 * BT, ids, &n, &e), KVB_OK);
        assert_int_equal(n, 2);
        assert_int_equal(kvb_store_release(s, ids, n, &e), KVB_OK);
        if (miss % 2) { /* abandon */
            kvb_store_slab_close(pp);
            continue;
        }
        assert_int_equal(put_slab(pp, blk2, (slab_desc){miss / BT, miss % BT, 1}, &got, &e), KVB_OK);
        assert_int_not_equal(got, KVB_BLOCK_NONE);
        kvb_store_slab_close(pp);
        assert_int_equal(kvb_store_lookup(s, utok(&u, 0), 3 * BT, ids, &n, &e), KVB_OK);
        assert_int_equal(n, 3);
        assert_int_equal(ids[2], got);
        assert_true(block_matches(kvb_store_block_data(s, got), ukey(&u, 0, 2)));
        assert_int_equal(kvb_store_release(s, ids, n, &e), KVB_OK);
        assert_int_equal(kvb_store_release(s, &got, 1, &e), KVB_OK);
        /* evict it again so the next round starts from a chain of two */
        kvb_block_id all[8];
        kvb_store_stats st2;
        kvb_store_get_stats(s, &st2);
        uint32_t take = st2.free + st2.evictable;
        assert_int_equal(kvb_store_alloc(s, take, all, &e), KVB_OK);
        assert_int_equal(kvb_store_release(s, all, take, &e), KVB_OK);
        assert_int_equal(engine_commit(s, &u, 0, 0, &ids[0], &e), KVB_OK);
        assert_int_equal(engine_commit(s, &u, 0, 1, &ids[1], &e), KVB_OK);
        assert_int_equal(kvb_store_release(s, ids, 2, &e), KVB_OK);
    }
    check_store(s);
    universe_free(&u);
    kvb_store_free(s);
}

/* ---- hostile slabs ------------------------------------------------------------------------------- */

static void test_slab_layout_and_checksum(void **state) {
    (void)state;
    kvb_store *s = new_store(4);
    universe u;
    universe_init(&u, s, 1, 1);
    kvb_err e = {0};
    kvb_slab_pending *pp;
    assert_int_equal(kvb_store_slab_begin(s, ukey(&u, 0, 0), u.root, utok(&u, 0), &pp, &e), KVB_OK);
    /* layer 1, tokens 1..2: K row (t, h) = bytes 16*t + h + 1, V = 0x80 | that. Hand-computed
     * destination: ((((layer * 2 + kv) * NKV + h) * BT + token) * row */
    uint8_t k[2 * NKV * HD * 4], v[2 * NKV * HD * 4];
    for (uint32_t t = 0; t < 2; t++)
        for (uint32_t h = 0; h < NKV; h++) {
            memset(k + (t * NKV + h) * g_row, (int)(16 * t + h + 1), g_row);
            memset(v + (t * NKV + h) * g_row, (int)(0x80 | (16 * t + h + 1)), g_row);
        }
    /* the checksum is XXH3-64 (seed 0) of K || V */
    uint8_t kv[sizeof k + sizeof v];
    memcpy(kv, k, sizeof k);
    memcpy(kv + sizeof k, v, sizeof v);
    uint64_t sum = kvb_hash64(kv, sizeof kv, 0);
    assert_true(kvb_slab_checksum(k, sizeof k, v, sizeof v) == sum);
    assert_int_equal(kvb_store_slab_layer_missing(pp, 1), BT);
    assert_int_equal(kvb_store_slab_put(pp, 1, 1, 2, k, sizeof k, v, sizeof v, sum, NULL, &e), KVB_OK);
    /* what the decoder's pipelined tail waits on: the tokens of one layer still missing */
    assert_int_equal(kvb_store_slab_layer_missing(pp, 1), BT - 2);
    assert_int_equal(kvb_store_slab_layer_missing(pp, 0), BT);
    assert_int_equal(kvb_store_slab_missing(pp), (uint32_t)g_fmt.n_layer * BT - 2);
    assert_int_equal(kvb_store_slab_layer_missing(pp, g_fmt.n_layer), 0); /* no such layer */
    const uint8_t *blk = kvb_store_block_data(s, kvb_store_slab_block(pp));
    for (uint32_t kvi = 0; kvi < 2; kvi++)
        for (uint32_t h = 0; h < NKV; h++)
            for (uint32_t t = 0; t < 2; t++) {
                size_t off = ((((size_t)1 * 2 + kvi) * NKV + h) * BT + (1 + t)) * g_row;
                uint8_t want = (uint8_t)((kvi ? 0x80 : 0) | (16 * t + h + 1));
                for (size_t i = 0; i < g_row; i++) assert_int_equal(blk[off + i], want);
            }
    kvb_store_slab_close(pp);
    universe_free(&u);
    kvb_store_free(s);
}

/* The slab path's scatter with non-temporal stores writes exactly the bytes of the plain scatter:
 * fresh random rows, several cache types and head sizes (rows of whole 64-byte lines, which
 * stream on x86, and rows that do not), partial token ranges, every layer, a block on a line
 * boundary and one that is not (which falls back to plain copies). Bytes outside the range stay. */
static void test_scatter_stream_equals_scatter(void **state) {
    (void)state;
    const struct { uint32_t dtype, head_dim; } cases[] = {
        {KVB_TYPE_F16, 64}, {KVB_TYPE_F16, 128}, {KVB_TYPE_BF16, 256}, {KVB_TYPE_F32, 64},
        {KVB_TYPE_Q8_0, 64}, {KVB_TYPE_F16, 40},
    };
    uint64_t rng = 0x5eed5ca77e12ULL;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        kvb_kvformat f;
        kvb_err e = {0};
        assert_int_equal(kvb_kvformat_init(&f, cases[c].dtype, 32, 3, 4, cases[c].head_dim, &e), KVB_OK);
        const size_t bb = kvb_kvformat_block_bytes(&f), tok = 4 * kvb_kvformat_row_bytes(&f);
        uint8_t *k = malloc(32 * tok), *v = malloc(32 * tok); /* (token, kv_head, row) */
        uint8_t *plain = aligned_alloc(64, bb + 64), *streamed = aligned_alloc(64, bb + 64);
        assert_non_null(k);
        assert_non_null(v);
        assert_non_null(plain);
        assert_non_null(streamed);
        for (int misalign = 0; misalign <= 16; misalign += 16) { /* a block on a line, and one off it */
            uint8_t *pb = plain + misalign, *sb = streamed + misalign;
            for (size_t i = 0; i < bb; i++) pb[i] = sb[i] = (uint8_t)(i * 31 + 7);
            for (uint32_t l = 0; l < 3; l++) {
                const uint32_t t0 = (uint32_t)(l * 7 % 20), n = 32 - t0 - (uint32_t)l; /* partial ranges */
                for (size_t i = 0; i < 32 * tok; i++) {
                    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
                    k[i] = (uint8_t)(rng >> 56);
                    v[i] = (uint8_t)(rng >> 48);
                }
                kvb_kvformat_scatter_rows(&f, pb, l, t0, n, k, v);
                kvb_kvformat_scatter_rows_stream(&f, sb, l, t0, n, k, v);
            }
            assert_memory_equal(pb, sb, bb);
        }
        free(k);
        free(v);
        free(plain);
        free(streamed);
    }
}

/* A tail (the partial block before the last prompt token): assembled with the same checks over
 * its own tokens only, never committed or visible, its page taken once complete; a tail that is
 * closed untaken gives its page back. */
static void test_slab_tail(void **state) {
    (void)state;
    kvb_store *s = new_store(4);
    kvb_err e = {0};
    kvb_slab_pending *pp;
    assert_int_equal(kvb_store_slab_begin_tail(s, 0, &pp, &e), KVB_ERR_INVALID);
    assert_int_equal(kvb_store_slab_begin_tail(s, BT, &pp, &e), KVB_ERR_INVALID);
    assert_int_equal(kvb_store_slab_begin_tail(s, 3, &pp, &e), KVB_OK);
    const uint32_t tail = 3;
    uint8_t blk[BB_MAX];
    for (size_t i = 0; i < sizeof blk; i++) blk[i] = (uint8_t)(i * 31 + 7);
    kvb_block_id got = 123;
    /* a token past the tail is refused, nothing written */
    assert_int_equal(put_slab(pp, blk, (slab_desc){0, 2, 2}, &got, &e), KVB_ERR_FORMAT);
    assert_non_null(strstr(e.msg, "tail"));
    assert_int_equal(kvb_store_slab_take_tail(pp), KVB_BLOCK_NONE); /* not complete */
    for (uint32_t l = 0; l < NL; l++) {
        assert_int_equal(put_slab(pp, blk, (slab_desc){l, 0, 1}, &got, &e), KVB_OK);
        assert_int_equal(put_slab(pp, blk, (slab_desc){l, 1, tail - 1}, &got, &e), KVB_OK);
        assert_int_equal(got, KVB_BLOCK_NONE); /* never committed */
    }
    assert_int_equal(kvb_store_slab_missing(pp), 0);
    assert_false(kvb_store_slab_committed(pp));
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.committed, 0);
    kvb_block_id page = kvb_store_slab_take_tail(pp);
    assert_int_not_equal(page, KVB_BLOCK_NONE);
    assert_int_equal(kvb_store_slab_take_tail(pp), KVB_BLOCK_NONE); /* taken once */
    assert_int_equal(put_slab(pp, blk, (slab_desc){0, 0, 1}, &got, &e), KVB_ERR_INVALID); /* taken: nothing more goes in */
    kvb_store_slab_close(pp);
    /* the page survived close, with the tail's rows where a block's would be */
    const uint8_t *d = kvb_store_block_data(s, page);
    for (uint32_t l = 0; l < NL; l++)
        for (uint32_t t = 0; t < tail; t++)
            assert_memory_equal(d + kvb_kvformat_row_offset(&g_fmt, l, 1, 1, t),
                                blk + kvb_kvformat_row_offset(&g_fmt, l, 1, 1, t), g_row);
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.writing, 1);
    assert_int_equal(st.pending_slab_blocks, 0);
    assert_int_equal(kvb_store_release(s, &page, 1, &e), KVB_OK);
    /* closed untaken: the page goes back */
    assert_int_equal(kvb_store_slab_begin_tail(s, 2, &pp, &e), KVB_OK);
    kvb_store_slab_close(pp);
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.free, 4);
    assert_int_equal(st.writing, 0);
    check_store(s);
    kvb_store_free(s);
}

static void test_corrupt_slabs_rejected(void **state) {
    (void)state;
    kvb_store *s = new_store(4);
    universe u;
    universe_init(&u, s, 1, 1);
    kvb_err e = {0};
    kvb_slab_pending *pp;
    /* a mismatched chain key is refused before a page is taken */
    e.msg[0] = 0;
    assert_int_equal(kvb_store_slab_begin(s, ukey(&u, 0, 0) ^ 4, u.root, utok(&u, 0), &pp, &e), KVB_ERR_INVALID);
    assert_null(pp);
    assert_non_null(strstr(e.msg, "does not match"));

    assert_int_equal(kvb_store_slab_begin(s, ukey(&u, 0, 0), u.root, utok(&u, 0), &pp, &e), KVB_OK);
    uint8_t blk[BB_MAX];
    fill_block(blk, ukey(&u, 0, 0));
    /* layer 0 tokens 0..1 first, valid */
    slab_desc d01 = {0, 0, 2};
    assert_int_equal(put_slab(pp, blk, d01, NULL, &e), KVB_OK);

    const size_t one = NKV * g_row; /* one token of one layer, K or V */
    uint8_t k[BT * NKV * HD * 4 + 8], v[BT * NKV * HD * 4 + 8];
    slab_desc d = {1, 1, 2}; /* layer 1 tokens 1..2 */
    make_slab(blk, d, k, v);
    const size_t nb = d.n * one;
    const uint64_t good = kvb_slab_checksum(k, nb, v, nb);
    struct {
        const char *what;
        uint32_t layer, t0, n;
        const void *k, *v;
        size_t kb, vb;
        int flip; /* 1: flip a K byte, 2: flip a V byte */
        uint64_t sum;
        const char *msg;
    } bad[] = {
        {"checksum: K byte flipped", 1, 1, 2, k, v, nb, nb, 1, good, "checksum mismatch"},
        {"checksum: V byte flipped", 1, 1, 2, k, v, nb, nb, 2, good, "checksum mismatch"},
        {"checksum: wrong value", 1, 1, 2, k, v, nb, nb, 0, good ^ 0x100, "checksum mismatch"},
        {"K one row short", 1, 1, 2, k, v, nb - g_row, nb, 0, good, "expected"},
        {"V one byte long", 1, 1, 2, k, v, nb, nb + 1, 0, good, "expected"},
        {"K and V for 1 token, range says 2", 1, 1, 2, k, v, one, one, 0, good, "expected"},
        {"layer out of range", NL, 1, 2, k, v, nb, nb, 0, good, "layer"},
        {"layer huge", UINT32_MAX, 1, 2, k, v, nb, nb, 0, good, "layer"},
        {"token0 past the block", 1, BT, 1, k, v, one, one, 0, good, "not inside"},
        {"range past the block", 1, BT - 1, 2, k, v, nb, nb, 0, good, "not inside"},
        {"range wraps around", 1, 2, UINT32_MAX, k, v, nb, nb, 0, good, "not inside"},
        {"zero tokens", 1, 1, 0, k, v, 0, 0, 0, good, "not inside"},
        {"K missing", 1, 1, 2, NULL, v, nb, nb, 0, good, "missing"},
        {"V missing", 1, 1, 2, k, NULL, nb, nb, 0, good, "missing"},
        {"duplicate of layer 0 tokens 0..1", 0, 0, 2, k, v, nb, nb, 0, good, "already arrived"},
        {"overlap with layer 0 token 1", 0, 1, 2, k, v, nb, nb, 0, good, "already arrived"},
    };
    uint8_t before[BB_MAX];
    const uint8_t *page = kvb_store_block_data(s, kvb_store_slab_block(pp));
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad); i++) {
        make_slab(blk, d, k, v);
        if (bad[i].flip == 1) k[5] ^= 0x20;
        if (bad[i].flip == 2) v[nb - 1] ^= 0x01;
        memcpy(before, page, g_bb);
        uint32_t missing = kvb_store_slab_missing(pp);
        kvb_store_stats st0, st1;
        kvb_store_get_stats(s, &st0);
        e.msg[0] = 0;
        kvb_block_id got = 7;
        kvb_status rc = kvb_store_slab_put(pp, bad[i].layer, bad[i].t0, bad[i].n, bad[i].k, bad[i].kb, bad[i].v,
                                           bad[i].vb, bad[i].sum, &got, &e);
        if (rc != KVB_ERR_FORMAT) fail_msg("%s: status %d, want KVB_ERR_FORMAT", bad[i].what, rc);
        if (!strstr(e.msg, bad[i].msg) || !strstr(e.msg, "slab rejected"))
            fail_msg("%s: message '%s' lacks '%s'", bad[i].what, e.msg, bad[i].msg);
        assert_int_equal(got, KVB_BLOCK_NONE);
        assert_memory_equal(before, page, g_bb); /* nothing written */
        assert_int_equal(kvb_store_slab_missing(pp), missing);
        kvb_store_get_stats(s, &st1);
        assert_int_equal(st1.slabs_rejected, st0.slabs_rejected + 1);
        assert_int_equal(st1.slabs_accepted, st0.slabs_accepted);
        assert_int_equal(st1.committed, 0);
    }
    /* all remaining slabs except layer 1 tokens 1..2 arrive valid; the block stays invisible */
    slab_desc rest[] = {{0, 2, 2}, {1, 0, 1}, {1, 3, 1}, {2, 0, 4}};
    for (size_t i = 0; i < KVB_ARRAY_LEN(rest); i++) {
        kvb_block_id got;
        assert_int_equal(put_slab(pp, blk, rest[i], &got, &e), KVB_OK);
        assert_int_equal(got, KVB_BLOCK_NONE);
    }
    assert_int_equal(kvb_store_slab_missing(pp), 2);
    kvb_block_id ids[2];
    uint32_t n;
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 0);
    /* the corrupt slab is never retransmitted: the assembly is abandoned, nothing committed */
    kvb_store_slab_close(pp);
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.committed, 0);
    assert_int_equal(st.commits, 0);
    assert_int_equal(st.free, 4);
    assert_int_equal(st.slabs_rejected, KVB_ARRAY_LEN(bad));
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 0);

    /* a retransmission of a valid slab after a corrupt one completes the block (resumable) */
    assert_int_equal(kvb_store_slab_begin(s, ukey(&u, 0, 0), u.root, utok(&u, 0), &pp, &e), KVB_OK);
    for (uint32_t l = 0; l < NL; l++) {
        slab_desc full = {l, 0, BT};
        if (l == 1) {
            make_slab(blk, full, k, v);
            size_t fb = BT * one;
            uint64_t sum = kvb_slab_checksum(k, fb, v, fb);
            k[0] ^= 1;
            assert_int_equal(kvb_store_slab_put(pp, 1, 0, BT, k, fb, v, fb, sum, NULL, &e), KVB_ERR_FORMAT);
        }
        kvb_block_id got;
        assert_int_equal(put_slab(pp, blk, full, &got, &e), KVB_OK);
        assert_int_equal(got == KVB_BLOCK_NONE, l + 1 < NL);
    }
    kvb_block_id got = kvb_store_slab_block(pp);
    kvb_store_slab_close(pp);
    assert_true(block_matches(kvb_store_block_data(s, got), ukey(&u, 0, 0)));
    assert_int_equal(kvb_store_lookup(s, utok(&u, 0), BT, ids, &n, &e), KVB_OK);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], got);
    assert_int_equal(kvb_store_release(s, ids, 1, &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, &got, 1, &e), KVB_OK);
    check_store(s);
    universe_free(&u);
    kvb_store_free(s);
}

/* ---- one pending block, several putting threads -------------------------------------------------
 * The decode node stripes a request's slabs over several connections, one receiving thread each:
 * several threads put different slabs of the same pending blocks at once while others read how
 * much is missing. */

#define CP_NB 6 /* blocks of one chain assembled at once */
#define CP_NT 4 /* putting threads */

typedef struct {
    uint32_t b; /* the block (index into the pendings) */
    slab_desc d;
    kvb_status st;    /* the put's result */
    kvb_block_id got; /* its committed_out */
    kvb_err e;
} put_job;

typedef struct {
    kvb_slab_pending **pend;    /* (CP_NB) */
    const uint8_t (*blk)[BB_MAX]; /* (CP_NB, block bytes) what each block must hold */
    put_job *jobs;
    uint32_t first, stride, n_jobs; /* this thread puts jobs first, first + stride, ... */
} putter;

static void *putter_main(void *arg) {
    putter *t = arg;
    kvb_rng r;
    kvb_rng_seed(&r, t->first);
    for (uint32_t i = t->first; i < t->n_jobs; i += t->stride) {
        put_job *j = &t->jobs[i];
        for (volatile uint32_t spin = (uint32_t)(kvb_rng_u64(&r) % 1024); spin; spin--) { /* spread the puts out */
        }
        j->st = put_slab(t->pend[j->b], t->blk[j->b], j->d, &j->got, &j->e);
    }
    return NULL;
}

/* Polls the getters while the putters run: missing counts never grow, a committed block misses
 * nothing, and a layer that misses nothing already holds its bytes (the put that completed it
 * happened before the getter said so). */
typedef struct {
    kvb_store *s;
    kvb_slab_pending **pend;      /* (CP_NB) */
    const uint8_t (*blk)[BB_MAX]; /* (CP_NB, block bytes) */
    pthread_mutex_t mu;
    bool stop; /* guarded by mu: the putters have ended */
    int failures;
    char msg[300];
    uint64_t passes, early; /* polls; layers seen complete (and checked) before their block was */
} watcher;

static void watcher_fail(watcher *w, uint32_t b, uint32_t l, const char *what) {
    if (!w->failures++) snprintf(w->msg, sizeof w->msg, "block %u layer %u: %s", b, l, what);
}

static void *watcher_main(void *arg) {
    watcher *w = arg;
    const size_t layer_bytes = 2 * NKV * BT * g_row; /* a layer of the block layout: (kv, kv_head, token, row) */
    uint32_t last[CP_NB], last_layer[CP_NB][NL];
    bool seen[CP_NB][NL];
    for (uint32_t b = 0; b < CP_NB; b++) {
        last[b] = NL * BT;
        for (uint32_t l = 0; l < NL; l++) {
            last_layer[b][l] = BT;
            seen[b][l] = false;
        }
    }
    for (bool stop = false; !stop && !w->failures; w->passes++) {
        pthread_mutex_lock(&w->mu);
        stop = w->stop; /* read before the pass: the last pass sees every put */
        pthread_mutex_unlock(&w->mu);
        for (uint32_t b = 0; b < CP_NB; b++) {
            kvb_slab_pending *p = w->pend[b];
            const bool committed = kvb_store_slab_committed(p);
            const uint32_t missing = kvb_store_slab_missing(p);
            if (missing > last[b]) watcher_fail(w, b, 0, "the block's missing count grew");
            if (committed && missing) watcher_fail(w, b, 0, "committed with cells missing");
            last[b] = missing;
            for (uint32_t l = 0; l < NL; l++) {
                const uint32_t m = kvb_store_slab_layer_missing(p, l);
                if (m > last_layer[b][l]) watcher_fail(w, b, l, "the layer's missing count grew");
                last_layer[b][l] = m;
                if (m || seen[b][l]) continue;
                seen[b][l] = true;
                w->early += !committed && missing;
                const size_t off = kvb_kvformat_row_offset(&g_fmt, l, 0, 0, 0);
                if (memcmp(kvb_store_block_data(w->s, kvb_store_slab_block(p)) + off, w->blk[b] + off, layer_bytes))
                    watcher_fail(w, b, l, "complete, but its bytes are not in the page");
            }
        }
    }
    for (uint32_t b = 0; b < CP_NB; b++)
        for (uint32_t l = 0; l < NL; l++)
            if (!seen[b][l]) watcher_fail(w, b, l, "never complete");
    return NULL;
}

/* Shared set-up: CP_NB pendings of one chain in each store of ss (n_ss), the blocks' bytes, and
 * every block's slabs (random runs) in one shuffled list. Returns the number of jobs. */
static uint32_t cp_setup(kvb_store *const *ss, uint32_t n_ss, const universe *u, kvb_rng *r,
                         kvb_slab_pending *(*pend)[CP_NB], uint8_t (*blk)[BB_MAX], put_job *jobs) {
    kvb_err e = {0};
    uint32_t nj = 0;
    for (uint32_t b = 0; b < CP_NB; b++) {
        fill_block(blk[b], ukey(u, 0, b));
        for (uint32_t i = 0; i < n_ss; i++)
            if (kvb_store_slab_begin(ss[i], ukey(u, 0, b), uparent(u, 0, b), utok(u, 0) + b * BT, &pend[i][b], &e))
                fail_msg("slab begin: %s", e.msg);
        slab_desc sl[MAX_SLABS];
        const uint32_t n = plan_slabs(r, sl);
        for (uint32_t i = 0; i < n; i++) jobs[nj++] = (put_job){.b = b, .d = sl[i], .got = KVB_BLOCK_NONE};
    }
    shuffle(jobs, nj, sizeof *jobs, r);
    return nj;
}

/* (a) 4 threads put every slab of 6 blocks in a shuffled order while a fifth polls the getters:
 * each block is committed exactly once, by one put, with the same bytes as the same slabs put
 * one by one in another store. */
static void test_slab_puts_from_threads(void **state) {
    (void)state;
    uint64_t accepted = 0, passes = 0, early = 0;
    for (uint32_t round = 0; round < 60; round++) {
        kvb_store *ss[2] = {new_store(CP_NB), new_store(CP_NB)}; /* concurrent, sequential */
        universe u;
        universe_init(&u, ss[0], 1, CP_NB);
        assert_true(kvb_store_root_key(ss[1]) == u.root);
        kvb_rng r;
        kvb_rng_seed(&r, 5000 + round);
        kvb_slab_pending *pend[2][CP_NB];
        static uint8_t blk[CP_NB][BB_MAX];
        static put_job jobs[CP_NB * MAX_SLABS];
        const uint32_t nj = cp_setup(ss, 2, &u, &r, pend, blk, jobs);

        watcher w = {.s = ss[0], .pend = pend[0], .blk = (const uint8_t(*)[BB_MAX])blk};
        assert_int_equal(pthread_mutex_init(&w.mu, NULL), 0);
        pthread_t wt, th[CP_NT];
        putter t[CP_NT];
        assert_int_equal(pthread_create(&wt, NULL, watcher_main, &w), 0);
        for (uint32_t i = 0; i < CP_NT; i++) {
            t[i] = (putter){.pend = pend[0], .blk = (const uint8_t(*)[BB_MAX])blk, .jobs = jobs, .first = i,
                            .stride = CP_NT, .n_jobs = nj};
            assert_int_equal(pthread_create(&th[i], NULL, putter_main, &t[i]), 0);
        }
        for (uint32_t i = 0; i < CP_NT; i++) pthread_join(th[i], NULL);
        pthread_mutex_lock(&w.mu);
        w.stop = true;
        pthread_mutex_unlock(&w.mu);
        pthread_join(wt, NULL);
        pthread_mutex_destroy(&w.mu);
        if (w.failures) fail_msg("round %u: getters: %d failure(s), first: %s", round, w.failures, w.msg);
        passes += w.passes;
        early += w.early;

        /* the same slabs, same order, one by one */
        kvb_block_id seq[CP_NB], got[CP_NB];
        uint32_t commits[CP_NB] = {0};
        for (uint32_t b = 0; b < CP_NB; b++) seq[b] = got[b] = KVB_BLOCK_NONE;
        for (uint32_t i = 0; i < nj; i++) {
            const put_job *j = &jobs[i];
            if (j->st) fail_msg("round %u: concurrent put %u: %s", round, i, j->e.msg);
            if (j->got != KVB_BLOCK_NONE) {
                commits[j->b]++;
                got[j->b] = j->got;
            }
            kvb_err e = {0};
            kvb_block_id id;
            if (put_slab(pend[1][j->b], blk[j->b], j->d, &id, &e)) fail_msg("round %u: put: %s", round, e.msg);
            if (id != KVB_BLOCK_NONE) seq[j->b] = id;
        }
        for (uint32_t b = 0; b < CP_NB; b++) {
            assert_int_equal(commits[b], 1); /* exactly one put committed it */
            assert_true(kvb_store_slab_committed(pend[0][b]));
            assert_int_equal(kvb_store_slab_missing(pend[0][b]), 0);
            assert_int_equal(kvb_store_slab_block(pend[0][b]), got[b]);
            assert_int_not_equal(seq[b], KVB_BLOCK_NONE);
            assert_memory_equal(kvb_store_block_data(ss[0], got[b]), kvb_store_block_data(ss[1], seq[b]), g_bb);
            assert_true(block_matches(kvb_store_block_data(ss[0], got[b]), ukey(&u, 0, b)));
        }
        kvb_store_stats st;
        kvb_store_get_stats(ss[0], &st);
        assert_int_equal(st.slabs_accepted, nj);
        assert_int_equal(st.slabs_rejected, 0);
        assert_int_equal(st.commits, CP_NB);
        assert_int_equal(st.committed, CP_NB);
        assert_int_equal(st.pending_slab_blocks, CP_NB);
        accepted += st.slabs_accepted;
        /* the whole chain is visible */
        kvb_block_id ids[CP_NB];
        uint32_t n;
        kvb_err e = {0};
        assert_int_equal(kvb_store_lookup(ss[0], utok(&u, 0), CP_NB * BT, ids, &n, &e), KVB_OK);
        assert_int_equal(n, CP_NB);
        assert_memory_equal(ids, got, sizeof ids);
        assert_int_equal(kvb_store_release(ss[0], ids, n, &e), KVB_OK);
        for (uint32_t i = 0; i < 2; i++) {
            for (uint32_t b = 0; b < CP_NB; b++) kvb_store_slab_close(pend[i][b]);
            assert_int_equal(kvb_store_release(ss[i], i ? seq : got, CP_NB, &e), KVB_OK);
            check_store(ss[i]);
            kvb_store_free(ss[i]);
        }
        universe_free(&u);
    }
    printf("slab puts from %d threads: %llu slabs accepted; %llu getter passes saw %llu layers complete "
           "before their block\n",
           CP_NT, (unsigned long long)accepted, (unsigned long long)passes, (unsigned long long)early);
}

/* (b) Two threads put the same slabs of one block at the same moment, in the same order: every
 * slab is accepted once and rejected once as a duplicate, one put commits, the block is right.
 * Main is one of the two putters and starts the other with an atomic store; the two are pinned to
 * two CPUs and pause at random before each put, so they meet at every phase: without the
 * pending's lock both copies of a slab soon pass the coverage check together (on a 2-core machine
 * every run without it failed, most within a few dozen iterations). No assertion depends on the
 * timing. */
#define DUP_ITERS 10000

typedef struct {
    kvb_slab_pending *cur;   /* the iteration's pending: set by main before it publishes go */
    const uint8_t *blk;      /* (block bytes) */
    atomic_int go, done;     /* the iteration main started (-1: stop), the last one the helper finished */
    kvb_status st[2][MAX_SLABS]; /* (putter, layer * BT + token) this iteration's results */
    kvb_block_id got[2][MAX_SLABS];
    bool dup[2][MAX_SLABS];  /* the message says "duplicate" */
    cpu_set_t allowed;       /* the CPUs main may run on (restored at the end) */
} dup_race;

/* Puts every single-token slab, starting at the iteration's cell, each after a random pause (the
 * first put of an iteration is the tightest race: later ones are spread by the store's lock). */
static void dup_put_all(dup_race *r, int who, int it, kvb_rng *rng) {
    for (uint32_t i = 0; i < NL * BT; i++) {
        const uint32_t c = (i + (uint32_t)it) % (NL * BT);
        for (volatile uint32_t spin = (uint32_t)(kvb_rng_u64(rng) % 256); spin; spin--) {
        }
        kvb_err e = {0};
        r->st[who][c] = put_slab(r->cur, r->blk, (slab_desc){c / BT, c % BT, 1}, &r->got[who][c], &e);
        r->dup[who][c] = strstr(e.msg, "duplicate") != NULL;
    }
}

/* Spins until *a is want (true) or -1 (false). */
static bool dup_wait(atomic_int *a, int want) {
    for (unsigned spins = 1;; spins++) {
        const int v = atomic_load_explicit(a, memory_order_acquire);
        if (v == want || v == -1) return v == want;
        if (spins % 64 == 0) sched_yield(); /* 2 cores, maybe busy: let the other side run */
    }
}

/* Pins the calling thread to the which-th CPU of allowed, so racing putters run side by side
 * rather than taking turns on one core; a no-op with fewer than two CPUs. */
static void pin_to_cpu(const cpu_set_t *allowed, int which) {
    const int n = CPU_COUNT(allowed);
    if (n < 2) return;
    for (int c = 0, seen = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, allowed) && seen++ == which % n) {
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(c, &one);
            pthread_setaffinity_np(pthread_self(), sizeof one, &one);
            return;
        }
}

static void *dup_helper_main(void *arg) {
    dup_race *r = arg;
    pin_to_cpu(&r->allowed, 1);
    kvb_rng rng;
    kvb_rng_seed(&rng, 2);
    for (int it = 1; it <= DUP_ITERS && dup_wait(&r->go, it); it++) {
        dup_put_all(r, 1, it, &rng);
        atomic_store_explicit(&r->done, it, memory_order_release);
    }
    return NULL;
}

/* The iteration's outcome checked: NULL, or what is wrong (in why). */
static const char *dup_check(const dup_race *r, kvb_store *s, uint64_t key, kvb_block_id *got, char *why, size_t n) {
    uint32_t commits = 0;
    *got = KVB_BLOCK_NONE;
    for (uint32_t c = 0; c < NL * BT; c++) {
        const int ok = (r->st[0][c] == KVB_OK) + (r->st[1][c] == KVB_OK), lost = r->st[0][c] == KVB_OK;
        if (ok != 1) {
            snprintf(why, n, "layer %u token %u accepted %d times (statuses %d, %d)", c / BT, c % BT, ok, r->st[0][c],
                     r->st[1][c]);
            return why;
        }
        if (r->st[lost][c] != KVB_ERR_FORMAT || !r->dup[lost][c]) {
            snprintf(why, n, "layer %u token %u: the second copy got status %d, not a duplicate", c / BT, c % BT,
                     r->st[lost][c]);
            return why;
        }
        for (int i = 0; i < 2; i++)
            if (r->got[i][c] != KVB_BLOCK_NONE) {
                commits++;
                *got = r->got[i][c];
            }
    }
    if (commits != 1) snprintf(why, n, "committed by %u puts", commits);
    else if (!kvb_store_slab_committed(r->cur) || kvb_store_slab_block(r->cur) != *got)
        snprintf(why, n, "the pending does not say it was committed as block %u", *got);
    else if (!block_matches(kvb_store_block_data(s, *got), key))
        snprintf(why, n, "the committed bytes are wrong");
    else
        return NULL;
    return why;
}

static void test_slab_duplicates_race(void **state) {
    (void)state;
    kvb_store *s = new_store(4);
    universe u;
    universe_init(&u, s, 1, 1);
    uint8_t blk[BB_MAX];
    fill_block(blk, ukey(&u, 0, 0));
    dup_race r = {.blk = blk};
    atomic_init(&r.go, 0);
    atomic_init(&r.done, 0);
    kvb_rng rng;
    kvb_rng_seed(&rng, 1);
    assert_int_equal(pthread_getaffinity_np(pthread_self(), sizeof r.allowed, &r.allowed), 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, dup_helper_main, &r), 0);
    pin_to_cpu(&r.allowed, 0);
    kvb_err e = {0};
    char why[200];
    const char *bad = NULL;
    int it;
    for (it = 1; it <= DUP_ITERS; it++) {
        if (kvb_store_slab_begin(s, ukey(&u, 0, 0), u.root, utok(&u, 0), &r.cur, &e)) {
            bad = e.msg;
            break;
        }
        atomic_store_explicit(&r.go, it, memory_order_release);
        dup_put_all(&r, 0, it, &rng);
        dup_wait(&r.done, it);
        kvb_block_id got;
        bad = dup_check(&r, s, ukey(&u, 0, 0), &got, why, sizeof why);
        kvb_store_slab_close(r.cur);
        if (got != KVB_BLOCK_NONE) kvb_store_release(s, &got, 1, NULL);
        if (bad) break;
    }
    atomic_store_explicit(&r.go, -1, memory_order_release); /* the helper waits for the next iteration: stop */
    pthread_join(th, NULL);
    pthread_setaffinity_np(pthread_self(), sizeof r.allowed, &r.allowed);
    if (bad) fail_msg("iteration %d: %s", it, bad);
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.slabs_accepted, (uint64_t)DUP_ITERS * NL * BT);
    assert_int_equal(st.slabs_rejected, (uint64_t)DUP_ITERS * NL * BT);
    assert_int_equal(st.commits, 1); /* then the same key again: dedup */
    assert_int_equal(st.dedups, DUP_ITERS - 1);
    assert_int_equal(st.pending_slab_blocks, 0);
    check_store(s);
    universe_free(&u);
    kvb_store_free(s);
}

/* (c) A corrupt slab racing with good ones gives its cells back: three threads put every slab of
 * 6 blocks but one per block; a fourth puts that one corrupt (K flipped, V flipped, wrong sum),
 * each rejected with nothing written and the cells still missing, then the good one, accepted:
 * every block commits. */
typedef struct {
    kvb_slab_pending **pend;      /* (CP_NB) */
    const uint8_t (*blk)[BB_MAX]; /* (CP_NB, block bytes) */
    kvb_store *s;
    const slab_desc *victim;      /* (CP_NB) the slab of each block that arrives corrupt first */
    int failures;
    char msg[300];
    uint32_t commits;
} corrupter;

static void *corrupter_main(void *arg) {
    corrupter *t = arg;
    const size_t one = NKV * g_row; /* one token of one layer, K or V */
    for (uint32_t b = 0; b < CP_NB && !t->failures; b++) {
        const slab_desc d = t->victim[b];
        const size_t nb = d.n * one;
        uint8_t k[BT * NKV * HD * 4], v[BT * NKV * HD * 4];
        for (int how = 0; how < 3; how++) {
            make_slab(t->blk[b], d, k, v);
            uint64_t sum = kvb_slab_checksum(k, nb, v, nb);
            if (how == 0) k[nb / 2] ^= 0x40;
            if (how == 1) v[nb - 1] ^= 0x01;
            if (how == 2) sum ^= 1;
            kvb_err e = {0};
            kvb_block_id got = 7;
            kvb_status st = kvb_store_slab_put(t->pend[b], d.layer, d.t0, d.n, k, nb, v, nb, sum, &got, &e);
            if (st != KVB_ERR_FORMAT || !strstr(e.msg, "checksum mismatch") || got != KVB_BLOCK_NONE) {
                if (!t->failures++)
                    snprintf(t->msg, sizeof t->msg, "block %u corrupt slab %d: status %d: %.200s", b, how, st, e.msg);
                return NULL;
            }
            /* nothing written (the page was 0xa5 before), and the cells are still missing */
            const uint8_t *page = kvb_store_block_data(t->s, kvb_store_slab_block(t->pend[b]));
            for (uint32_t kv = 0; kv < 2; kv++)
                for (uint32_t h = 0; h < NKV; h++)
                    for (size_t i = 0; i < d.n * g_row; i++)
                        if (page[kvb_kvformat_row_offset(&g_fmt, d.layer, kv, h, d.t0) + i] != 0xa5 && !t->failures++)
                            snprintf(t->msg, sizeof t->msg, "block %u corrupt slab %d: bytes written", b, how);
            if (kvb_store_slab_layer_missing(t->pend[b], d.layer) < d.n && !t->failures++)
                snprintf(t->msg, sizeof t->msg, "block %u corrupt slab %d: its cells count as arrived", b, how);
        }
        kvb_err e = {0};
        kvb_block_id got;
        if (put_slab(t->pend[b], t->blk[b], d, &got, &e)) {
            if (!t->failures++) snprintf(t->msg, sizeof t->msg, "block %u good slab after corrupt: %.200s", b, e.msg);
            return NULL;
        }
        t->commits += got != KVB_BLOCK_NONE;
    }
    return NULL;
}

static void test_slab_corrupt_races_good(void **state) {
    (void)state;
    for (uint32_t round = 0; round < 40; round++) {
        kvb_store *s = new_store(CP_NB);
        universe u;
        universe_init(&u, s, 1, CP_NB);
        kvb_rng r;
        kvb_rng_seed(&r, 9000 + round);
        kvb_slab_pending *pend[1][CP_NB];
        static uint8_t blk[CP_NB][BB_MAX];
        static put_job jobs[CP_NB * MAX_SLABS];
        uint32_t nj = cp_setup(&s, 1, &u, &r, pend, blk, jobs);
        /* each block's first slab in the list is the victim: out of the good threads' list */
        slab_desc victim[CP_NB];
        bool have[CP_NB] = {false};
        uint32_t n_good = 0;
        for (uint32_t i = 0; i < nj; i++) {
            if (!have[jobs[i].b]) {
                have[jobs[i].b] = true;
                victim[jobs[i].b] = jobs[i].d;
            } else {
                jobs[n_good++] = jobs[i];
            }
        }
        for (uint32_t b = 0; b < CP_NB; b++) memset(kvb_store_block_data(s, kvb_store_slab_block(pend[0][b])), 0xa5, g_bb);
        corrupter c = {.pend = pend[0], .blk = (const uint8_t(*)[BB_MAX])blk, .s = s, .victim = victim};
        pthread_t ct, th[CP_NT - 1];
        putter t[CP_NT - 1];
        assert_int_equal(pthread_create(&ct, NULL, corrupter_main, &c), 0);
        for (uint32_t i = 0; i < CP_NT - 1; i++) {
            t[i] = (putter){.pend = pend[0], .blk = (const uint8_t(*)[BB_MAX])blk, .jobs = jobs, .first = i,
                            .stride = CP_NT - 1, .n_jobs = n_good};
            assert_int_equal(pthread_create(&th[i], NULL, putter_main, &t[i]), 0);
        }
        for (uint32_t i = 0; i < CP_NT - 1; i++) pthread_join(th[i], NULL);
        pthread_join(ct, NULL);
        if (c.failures) fail_msg("round %u: corrupt slabs: %d failure(s), first: %s", round, c.failures, c.msg);
        uint32_t commits = c.commits;
        kvb_block_id got[CP_NB];
        for (uint32_t b = 0; b < CP_NB; b++) got[b] = KVB_BLOCK_NONE;
        for (uint32_t i = 0; i < n_good; i++) {
            if (jobs[i].st) fail_msg("round %u: good put %u: %s", round, i, jobs[i].e.msg);
            commits += jobs[i].got != KVB_BLOCK_NONE;
        }
        assert_int_equal(commits, CP_NB);
        for (uint32_t b = 0; b < CP_NB; b++) {
            assert_true(kvb_store_slab_committed(pend[0][b]));
            got[b] = kvb_store_slab_block(pend[0][b]);
            assert_true(block_matches(kvb_store_block_data(s, got[b]), ukey(&u, 0, b)));
        }
        kvb_store_stats st;
        kvb_store_get_stats(s, &st);
        assert_int_equal(st.slabs_accepted, nj);
        assert_int_equal(st.slabs_rejected, 3 * CP_NB);
        assert_int_equal(st.commits, CP_NB);
        kvb_err e = {0};
        for (uint32_t b = 0; b < CP_NB; b++) kvb_store_slab_close(pend[0][b]);
        assert_int_equal(kvb_store_release(s, got, CP_NB, &e), KVB_OK);
        check_store(s);
        kvb_store_free(s);
        universe_free(&u);
    }
}

/* ---- threads ---------------------------------------------------------------------------------- */

typedef struct {
    kvb_store *s;
    const universe *u;
    uint64_t seed;
    int iters;
    int failures;
    uint64_t verified_blocks, engine_commits, slab_commits, full;
    char msg[600];
} worker;

static void worker_fail(worker *w, const char *what, const kvb_err *e) {
    if (!w->failures++) snprintf(w->msg, sizeof w->msg, "%s: %s", what, e ? e->msg : "");
}

static void *worker_main(void *arg) {
    worker *w = arg;
    const universe *u = w->u;
    kvb_rng r;
    kvb_rng_seed(&r, w->seed);
    kvb_block_id ids[32];
    kvb_err e = {0};
    for (int it = 0; it < w->iters && !w->failures; it++) {
        uint32_t p = (uint32_t)(kvb_rng_u64(&r) % u->np);
        uint32_t lb = 1 + (uint32_t)(kvb_rng_u64(&r) % u->lb);
        uint32_t n_tokens = lb * BT + (uint32_t)(kvb_rng_u64(&r) % BT), n = 0;
        /* one time in four, write the whole prompt without looking first (two requests racing on
         * one prompt, or a bridge delivering blocks the decoder already has): commits dedup */
        bool blind = kvb_rng_u64(&r) % 4 == 0;
        if (!blind && (kvb_store_lookup(w->s, utok(u, p), n_tokens, ids, &n, &e) || n > lb)) {
            worker_fail(w, "lookup", &e);
            break;
        }
        for (uint32_t i = 0; i < n; i++)
            if (!block_matches(kvb_store_block_data(w->s, ids[i]), ukey(u, p, i)))
                worker_fail(w, "looked-up bytes", NULL);
        uint32_t have = n;
        for (uint32_t b = n; b < lb; b++) {
            kvb_block_id got;
            bool slab = kvb_rng_u64(&r) & 1;
            kvb_status st = slab ? slab_commit(w->s, u, p, b, &r, &got, &e) : engine_commit(w->s, u, p, b, &got, &e);
            if (st == KVB_ERR_RANGE) {
                w->full++;
                break;
            }
            if (st) {
                worker_fail(w, slab ? "slab commit" : "engine commit", &e);
                break;
            }
            if (slab)
                w->slab_commits++;
            else
                w->engine_commits++;
            ids[have++] = got;
        }
        /* other threads churned the store meanwhile: everything held must still be intact */
        for (uint32_t i = 0; i < have; i++) {
            if (!block_matches(kvb_store_block_data(w->s, ids[i]), ukey(u, p, i))) worker_fail(w, "held bytes", NULL);
            w->verified_blocks++;
        }
        if (kvb_store_release(w->s, ids, have, &e)) worker_fail(w, "release", &e);
    }
    return NULL;
}

static void test_threads_commit_and_lookup(void **state) {
    (void)state;
    enum { NT = 4 };
    kvb_store *s = new_store(64);
    universe u;
    universe_init(&u, s, 64, 8); /* 191 distinct blocks into 64 pages: steady eviction */
    worker w[NT];
    pthread_t th[NT];
    double t0 = kvb_now_s();
    for (int i = 0; i < NT; i++) {
        w[i] = (worker){.s = s, .u = &u, .seed = 1000 + (uint64_t)i, .iters = 6000};
        assert_int_equal(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
    }
    uint64_t verified = 0, ec = 0, sc = 0, full = 0;
    for (int i = 0; i < NT; i++) {
        pthread_join(th[i], NULL);
        if (w[i].failures) fail_msg("thread %d: %d failure(s), first: %s", i, w[i].failures, w[i].msg);
        verified += w[i].verified_blocks;
        ec += w[i].engine_commits;
        sc += w[i].slab_commits;
        full += w[i].full;
    }
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    printf("store threads: %d x %d sequences in %.2fs: %llu blocks verified, %llu engine + %llu slab commits, "
           "%llu new, %llu dedup, %llu evictions, %llu lookup hits, %llu full\n",
           NT, w[0].iters, kvb_now_s() - t0, (unsigned long long)verified, (unsigned long long)ec,
           (unsigned long long)sc, (unsigned long long)st.commits, (unsigned long long)st.dedups,
           (unsigned long long)st.evictions, (unsigned long long)st.lookup_hit_blocks, (unsigned long long)full);
    assert_int_equal(st.referenced, 0);
    assert_int_equal(st.writing, 0);
    assert_int_equal(st.pending_slab_blocks, 0);
    assert_int_equal(st.free + st.committed, 64);
    assert_int_equal(st.commits + st.dedups, ec + sc);
    assert_true(st.evictions > 0);
    assert_true(st.dedups > 0);
    assert_true(st.lookup_hit_blocks > 0);
    assert_true(sc > 0 && ec > 0);
    assert_int_equal(st.slabs_rejected, 0);
    check_store(s);
    universe_free(&u);
    kvb_store_free(s);
}

/* ---- 10^6 random operations against a reference model --------------------------------------------- */

#define M_NB 24
#define M_NP 32
#define M_LB 6
#define M_HELD 64
#define M_WRITING 8
#define M_PEND 3
enum { M_FREE, M_WRITING_ST, M_COMMITTED, M_PENDING };

typedef struct {
    int state[M_NB];
    uint32_t refs[M_NB];
    uint64_t key[M_NB];
    kvb_block_id lru[M_NB]; /* [0] = least recently used */
    uint32_t n_lru, n_free, n_writing, n_committed, n_referenced;
    uint64_t evictions, commits, dedups, refusals, rejected, accepted, alloc_failures, lookups, hits;
} model;

static kvb_block_id m_find(const model *m, uint64_t key) {
    for (kvb_block_id i = 0; i < M_NB; i++)
        if (m->state[i] == M_COMMITTED && m->key[i] == key) return i;
    return KVB_BLOCK_NONE;
}
static void m_lru_remove(model *m, kvb_block_id id) {
    for (uint32_t i = 0; i < m->n_lru; i++)
        if (m->lru[i] == id) {
            memmove(m->lru + i, m->lru + i + 1, (m->n_lru - i - 1) * sizeof(kvb_block_id));
            m->n_lru--;
            return;
        }
    fail_msg("model: block %u not on the LRU list", id);
}
static void m_ref(model *m, kvb_block_id id) {
    if (m->refs[id]++ == 0) {
        m_lru_remove(m, id);
        m->n_referenced++;
    }
}
static void m_unref(model *m, kvb_block_id id) {
    assert_true(m->refs[id] > 0);
    if (--m->refs[id] == 0) {
        m->n_referenced--;
        m->lru[m->n_lru++] = id;
    }
}
/* The store handed out page id: a free page while any is free, else exactly the LRU victim. */
static void m_take(model *m, kvb_block_id id, int new_state) {
    assert_true(id < M_NB);
    if (m->n_free) {
        if (m->state[id] != M_FREE)
            fail_msg("alloc returned block %u which the model has in state %d", id, m->state[id]);
        m->n_free--;
    } else {
        if (m->n_lru == 0 || id != m->lru[0])
            fail_msg("eviction took block %u, the model's LRU victim is %d", id, m->n_lru ? (int)m->lru[0] : -1);
        m_lru_remove(m, id);
        m->n_committed--;
        m->evictions++;
    }
    m->state[id] = new_state;
    m->n_writing++;
}
static void m_free_page(model *m, kvb_block_id id) {
    assert_true(m->state[id] == M_WRITING_ST || m->state[id] == M_PENDING);
    m->state[id] = M_FREE;
    m->n_writing--;
    m->n_free++;
}
static void m_commit(model *m, kvb_block_id page, uint64_t key, kvb_block_id got) {
    kvb_block_id ex = m_find(m, key);
    if (ex != KVB_BLOCK_NONE) {
        assert_int_equal(got, ex);
        m_free_page(m, page);
        m_ref(m, ex);
        m->dedups++;
    } else {
        assert_int_equal(got, page);
        m->state[page] = M_COMMITTED;
        m->key[page] = key;
        m->refs[page] = 1;
        m->n_writing--;
        m->n_committed++;
        m->n_referenced++;
        m->commits++;
    }
}
static void m_compare(kvb_store *s, const model *m, uint32_t n_pend, uint64_t op) {
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    if (st.free != m->n_free || st.writing != m->n_writing || st.committed != m->n_committed ||
        st.referenced != m->n_referenced || st.evictable != m->n_lru || st.pending_slab_blocks != n_pend ||
        st.evictions != m->evictions || st.commits != m->commits || st.dedups != m->dedups ||
        st.commit_refusals != m->refusals || st.slabs_rejected != m->rejected || st.slabs_accepted != m->accepted ||
        st.alloc_failures != m->alloc_failures || st.lookups != m->lookups || st.lookup_hit_blocks != m->hits)
        fail_msg("op %llu: store and model disagree: free %u/%u writing %u/%u committed %u/%u referenced %u/%u "
                 "evictable %u/%u pending %u/%u evictions %llu/%llu commits %llu/%llu dedups %llu/%llu "
                 "refusals %llu/%llu rejected %llu/%llu",
                 (unsigned long long)op, st.free, m->n_free, st.writing, m->n_writing, st.committed, m->n_committed,
                 st.referenced, m->n_referenced, st.evictable, m->n_lru, st.pending_slab_blocks, n_pend,
                 (unsigned long long)st.evictions, (unsigned long long)m->evictions, (unsigned long long)st.commits,
                 (unsigned long long)m->commits, (unsigned long long)st.dedups, (unsigned long long)m->dedups,
                 (unsigned long long)st.commit_refusals, (unsigned long long)m->refusals,
                 (unsigned long long)st.slabs_rejected, (unsigned long long)m->rejected);
}

typedef struct {
    kvb_slab_pending *h;
    uint32_t p, b;
    kvb_block_id page;
    slab_desc sl[MAX_SLABS];
    uint32_t n_sl, next;
    uint8_t blk[BB_MAX];
} pend_state;

enum { OP_ALLOC, OP_COMMIT, OP_LOOKUP, OP_RELEASE, OP_RETAIN, OP_BAD, OP_SLAB_BEGIN, OP_SLAB_PUT, OP_SLAB_BAD,
       OP_SLAB_ABORT, OP_VERIFY, OP_KINDS };
static const char *const op_names[OP_KINDS] = {"alloc", "commit", "lookup", "release", "retain", "bad-call",
                                               "slab-begin", "slab-put", "slab-corrupt", "slab-abort", "verify"};

static uint64_t model_ops(void) {
    const char *env = getenv("KVB_STORE_MODEL_OPS");
    if (env && *env) return strtoull(env, NULL, 10);
    return 1000000; /* about 1 s optimised, 3 s under ASan+UBSan */
}

static void test_random_ops_against_model(void **state) {
    (void)state;
    kvb_store *s = new_store(M_NB);
    universe u;
    universe_init(&u, s, M_NP, M_LB);
    model *m = calloc(1, sizeof *m);
    pend_state *pend = calloc(M_PEND, sizeof *pend);
    assert_non_null(m);
    assert_non_null(pend);
    m->n_free = M_NB;
    kvb_block_id held[M_HELD], writing[M_WRITING];
    uint32_t n_held = 0, n_wr = 0, n_pend = 0;
    uint64_t counts[OP_KINDS] = {0}, lookup_blocks = 0, failed_allocs = 0;
    kvb_rng r;
    kvb_rng_seed(&r, 20240605);
    kvb_err e = {0};
    const uint64_t N = model_ops();
    double t0 = kvb_now_s();
#define RND(n) ((uint32_t)(kvb_rng_u64(&r) % (n)))
    for (uint64_t op = 0; op < N; op++) {
        uint32_t roll = RND(100);
        int kind = roll < 11   ? OP_ALLOC
                   : roll < 24 ? OP_COMMIT
                   : roll < 40 ? OP_LOOKUP
                   : roll < 56 ? OP_RELEASE
                   : roll < 59 ? OP_RETAIN
                   : roll < 62 ? OP_BAD
                   : roll < 68 ? OP_SLAB_BEGIN
                   : roll < 86 ? OP_SLAB_PUT
                   : roll < 89 ? OP_SLAB_BAD
                   : roll < 91 ? OP_SLAB_ABORT
                               : OP_VERIFY;
        /* keep the test's own lists bounded: fall back to a release */
        if ((kind == OP_ALLOC && n_wr + 3 > M_WRITING) || (kind == OP_COMMIT && (!n_wr || n_held >= M_HELD)) ||
            (kind == OP_LOOKUP && n_held + M_LB > M_HELD) || (kind == OP_RETAIN && (!n_held || n_held >= M_HELD)) ||
            (kind == OP_SLAB_BEGIN && n_pend == M_PEND) || ((kind == OP_SLAB_PUT || kind == OP_SLAB_BAD ||
                                                             kind == OP_SLAB_ABORT) && !n_pend) ||
            (kind == OP_SLAB_PUT && n_held >= M_HELD) || (kind == OP_VERIFY && !n_held))
            kind = OP_RELEASE;
        if (kind == OP_RELEASE && !n_held && !n_wr) kind = OP_LOOKUP;
        counts[kind]++;
        switch (kind) {
        case OP_ALLOC: {
            uint32_t n = 1 + RND(3);
            kvb_block_id ids[3];
            kvb_status rc = kvb_store_alloc(s, n, ids, &e);
            if (m->n_free + m->n_lru < n) {
                assert_int_equal(rc, KVB_ERR_RANGE);
                m->alloc_failures++;
                failed_allocs++;
                break;
            }
            if (rc) fail_msg("op %llu: alloc of %u failed: %s", (unsigned long long)op, n, e.msg);
            for (uint32_t i = 0; i < n; i++) {
                m_take(m, ids[i], M_WRITING_ST);
                memset(kvb_store_block_data(s, ids[i]), 0xEE, g_bb); /* a reused live page would show */
                writing[n_wr++] = ids[i];
            }
            break;
        }
        case OP_COMMIT: {
            uint32_t wi = RND(n_wr), p = RND(M_NP), b = RND(M_LB);
            kvb_block_id id = writing[wi], got;
            fill_block(kvb_store_block_data(s, id), ukey(&u, p, b));
            bool wrong = RND(20) == 0;
            kvb_status rc = kvb_store_commit_block(s, id, ukey(&u, p, b) ^ (wrong ? 2 : 0), uparent(&u, p, b),
                                                   utok(&u, p) + b * BT, &got, &e);
            if (wrong) {
                assert_int_equal(rc, KVB_ERR_INVALID);
                m->refusals++;
                break;
            }
            if (rc) fail_msg("op %llu: commit failed: %s", (unsigned long long)op, e.msg);
            writing[wi] = writing[--n_wr];
            m_commit(m, id, ukey(&u, p, b), got);
            held[n_held++] = got;
            break;
        }
        case OP_LOOKUP: {
            uint32_t p = RND(M_NP), n_tokens = RND((M_LB + 1) * BT), n;
            kvb_block_id ids[M_LB + 1];
            assert_int_equal(kvb_store_lookup(s, utok(&u, p), n_tokens, ids, &n, &e), KVB_OK);
            uint32_t want = 0;
            while (want < n_tokens / BT && m_find(m, ukey(&u, p, want)) != KVB_BLOCK_NONE) want++;
            if (n != want) fail_msg("op %llu: lookup found %u blocks, model %u", (unsigned long long)op, n, want);
            for (uint32_t i = 0; i < n; i++) {
                assert_int_equal(ids[i], m_find(m, ukey(&u, p, i)));
                if (!block_matches(kvb_store_block_data(s, ids[i]), ukey(&u, p, i)))
                    fail_msg("op %llu: looked-up block %u holds wrong bytes", (unsigned long long)op, ids[i]);
                m_ref(m, ids[i]);
                held[n_held++] = ids[i];
            }
            m->lookups++;
            m->hits += n;
            lookup_blocks += n;
            break;
        }
        case OP_RELEASE: {
            uint32_t n = 1 + RND(4);
            kvb_block_id ids[4];
            uint32_t k = 0;
            for (; k < n && (n_held || n_wr); k++) {
                bool from_wr = n_wr && (!n_held || RND(4) == 0);
                if (from_wr) {
                    uint32_t i = RND(n_wr);
                    ids[k] = writing[i];
                    writing[i] = writing[--n_wr];
                } else {
                    uint32_t i = RND(n_held);
                    ids[k] = held[i];
                    held[i] = held[--n_held];
                }
            }
            if (kvb_store_release(s, ids, k, &e)) fail_msg("op %llu: release: %s", (unsigned long long)op, e.msg);
            for (uint32_t i = k; i-- > 0;) /* the store releases last to first */
                if (m->state[ids[i]] == M_WRITING_ST)
                    m_free_page(m, ids[i]);
                else
                    m_unref(m, ids[i]);
            break;
        }
        case OP_RETAIN: {
            kvb_block_id id = held[RND(n_held)];
            assert_int_equal(kvb_store_retain(s, &id, 1, &e), KVB_OK);
            m_ref(m, id);
            held[n_held++] = id;
            break;
        }
        case OP_BAD: { /* calls that must be refused and change nothing */
            kvb_block_id id = RND(M_NB + 2);
            bool unheld = id >= M_NB || m->state[id] == M_FREE || (m->state[id] == M_COMMITTED && !m->refs[id]);
            if (unheld) {
                assert_int_equal(kvb_store_release(s, &id, 1, &e), KVB_ERR_INVALID);
            }
            if (id >= M_NB || m->state[id] == M_FREE || m->state[id] == M_COMMITTED) {
                kvb_block_id got;
                uint32_t p = RND(M_NP), b = RND(M_LB);
                assert_int_equal(kvb_store_commit_block(s, id, ukey(&u, p, b), uparent(&u, p, b), utok(&u, p) + b * BT,
                                                        &got, &e),
                                 KVB_ERR_INVALID);
                assert_int_equal(got, KVB_BLOCK_NONE);
                m->refusals++;
            }
            if (id >= M_NB || m->state[id] != M_COMMITTED)
                assert_int_equal(kvb_store_retain(s, &id, 1, &e), KVB_ERR_INVALID);
            break;
        }
        case OP_SLAB_BEGIN: {
            pend_state *ps = &pend[n_pend];
            ps->p = RND(M_NP);
            ps->b = RND(M_LB);
            kvb_status rc = kvb_store_slab_begin(s, ukey(&u, ps->p, ps->b), uparent(&u, ps->p, ps->b),
                                                 utok(&u, ps->p) + ps->b * BT, &ps->h, &e);
            if (m->n_free + m->n_lru < 1) {
                assert_int_equal(rc, KVB_ERR_RANGE);
                m->alloc_failures++;
                failed_allocs++;
                break;
            }
            if (rc) fail_msg("op %llu: slab begin: %s", (unsigned long long)op, e.msg);
            ps->page = kvb_store_slab_block(ps->h);
            m_take(m, ps->page, M_PENDING);
            memset(kvb_store_block_data(s, ps->page), 0xEE, g_bb);
            fill_block(ps->blk, ukey(&u, ps->p, ps->b));
            ps->n_sl = plan_slabs(&r, ps->sl);
            ps->next = 0;
            n_pend++;
            break;
        }
        case OP_SLAB_PUT: {
            uint32_t pi = RND(n_pend);
            pend_state *ps = &pend[pi];
            kvb_block_id got;
            slab_desc d = ps->sl[ps->next];
            uint32_t missing = kvb_store_slab_missing(ps->h);
            if (put_slab(ps->h, ps->blk, d, &got, &e))
                fail_msg("op %llu: slab put: %s", (unsigned long long)op, e.msg);
            m->accepted++;
            if (++ps->next < ps->n_sl) {
                assert_int_equal(got, KVB_BLOCK_NONE);
                assert_int_equal(kvb_store_slab_missing(ps->h), missing - d.n);
                break;
            }
            assert_int_equal(kvb_store_slab_missing(ps->h), 0);
            m_commit(m, ps->page, ukey(&u, ps->p, ps->b), got);
            if (!block_matches(kvb_store_block_data(s, got), ukey(&u, ps->p, ps->b)))
                fail_msg("op %llu: assembled block %u holds wrong bytes", (unsigned long long)op, got);
            held[n_held++] = got;
            kvb_store_slab_close(ps->h);
            pend[pi] = pend[--n_pend];
            break;
        }
        case OP_SLAB_BAD: {
            pend_state *ps = &pend[RND(n_pend)];
            slab_desc d = ps->sl[ps->next];
            uint8_t k[BT * NKV * HD * 4 + 4], v[BT * NKV * HD * 4 + 4];
            make_slab(ps->blk, d, k, v);
            size_t nb = (size_t)d.n * NKV * g_row, kb = nb, vb = nb;
            uint64_t sum = kvb_slab_checksum(k, nb, v, nb);
            uint32_t layer = d.layer, t0 = d.t0, n = d.n;
            switch (RND(6)) {
            case 0: k[RND((uint32_t)nb)] ^= (uint8_t)(1u << RND(8)); break;
            case 1: v[RND((uint32_t)nb)] ^= (uint8_t)(1u << RND(8)); break;
            case 2: kb = nb + 1 + RND(3); break;
            case 3: layer = NL + RND(5); break;
            case 4: n = BT - t0 + 1 + RND(3); break;
            default:
                if (ps->next) { /* an already accepted slab again */
                    slab_desc old = ps->sl[RND(ps->next)];
                    make_slab(ps->blk, old, k, v);
                    layer = old.layer, t0 = old.t0, n = old.n;
                    kb = vb = (size_t)n * NKV * g_row;
                    sum = kvb_slab_checksum(k, kb, v, vb);
                } else {
                    sum ^= 1;
                }
            }
            uint8_t before[BB_MAX];
            memcpy(before, kvb_store_block_data(s, ps->page), g_bb);
            uint32_t missing = kvb_store_slab_missing(ps->h);
            kvb_block_id got;
            assert_int_equal(kvb_store_slab_put(ps->h, layer, t0, n, k, kb, v, vb, sum, &got, &e), KVB_ERR_FORMAT);
            assert_int_equal(got, KVB_BLOCK_NONE);
            assert_int_equal(kvb_store_slab_missing(ps->h), missing);
            assert_memory_equal(before, kvb_store_block_data(s, ps->page), g_bb);
            m->rejected++;
            break;
        }
        case OP_SLAB_ABORT: {
            uint32_t pi = RND(n_pend);
            kvb_store_slab_close(pend[pi].h);
            m_free_page(m, pend[pi].page);
            pend[pi] = pend[--n_pend];
            break;
        }
        case OP_VERIFY: {
            kvb_block_id id = held[RND(n_held)];
            assert_int_equal(m->state[id], M_COMMITTED);
            if (!block_matches(kvb_store_block_data(s, id), m->key[id]))
                fail_msg("op %llu: held block %u changed", (unsigned long long)op, id);
            break;
        }
        }
        m_compare(s, m, n_pend, op);
        if (op % 4096 == 0) check_store(s);
    }
#undef RND
    /* give everything back */
    while (n_pend) {
        kvb_store_slab_close(pend[n_pend - 1].h);
        m_free_page(m, pend[n_pend - 1].page);
        n_pend--;
    }
    assert_int_equal(kvb_store_release(s, writing, n_wr, &e), KVB_OK);
    assert_int_equal(kvb_store_release(s, held, n_held, &e), KVB_OK);
    kvb_store_stats st;
    kvb_store_get_stats(s, &st);
    assert_int_equal(st.referenced, 0);
    assert_int_equal(st.writing, 0);
    assert_int_equal(st.free + st.committed, M_NB);
    check_store(s);
    printf("store model: %llu random operations in %.2fs, all matched the reference model:", (unsigned long long)N,
           kvb_now_s() - t0);
    for (int k = 0; k < OP_KINDS; k++) printf(" %s %llu", op_names[k], (unsigned long long)counts[k]);
    printf("; %llu blocks returned by lookups, %llu commits, %llu dedups, %llu evictions, %llu refused allocations, "
           "%llu rejected slabs\n",
           (unsigned long long)lookup_blocks, (unsigned long long)st.commits, (unsigned long long)st.dedups,
           (unsigned long long)st.evictions, (unsigned long long)failed_allocs,
           (unsigned long long)st.slabs_rejected);
    fflush(stdout);
    assert_true(st.evictions > 1000 || N < 100000);
    assert_true(st.dedups > 100 || N < 100000);
    free(pend);
    free(m);
    universe_free(&u);
    kvb_store_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chain_keys_follow_spec),
        cmocka_unit_test(test_commit_dedup_and_refusals),
        cmocka_unit_test(test_key_collision_is_a_miss),
        cmocka_unit_test(test_eviction_never_frees_referenced),
        cmocka_unit_test(test_lru_order),
        cmocka_unit_test(test_incomplete_blocks_invisible),
        cmocka_unit_test(test_slab_layout_and_checksum),
        cmocka_unit_test(test_scatter_stream_equals_scatter),
        cmocka_unit_test(test_slab_tail),
        cmocka_unit_test(test_corrupt_slabs_rejected),
        cmocka_unit_test(test_slab_puts_from_threads),
        cmocka_unit_test(test_slab_duplicates_race),
        cmocka_unit_test(test_slab_corrupt_races_good),
        cmocka_unit_test(test_threads_commit_and_lookup),
        cmocka_unit_test(test_random_ops_against_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
