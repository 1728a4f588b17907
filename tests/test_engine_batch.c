/* tests/test_engine_batch.c — kvb_engine_forward_batch: one decode step of several sequences at
 * once gives, for each, the bits of its own one-token forward; kvb_engine_forward_segments (a few
 * tokens of some sequences beside one of others, as a prompt slice beside decode steps) gives each
 * the bits of its own forward of those tokens. Sequences of different lengths
 * (one token, block boundaries, past gemma3's sliding window) join and leave the batch from step
 * to step, in shuffled order, on llama, qwen3 (q/k norms), gemma3 (two RoPE kinds, local
 * layers) and qwen3moe (tokens of several sequences grouped by expert) shapes, with f16 and q8_0 caches and 1 or 2 threads; a reference engine runs the same
 * steps one sequence at a time. Also the batch's refusals. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvb_engine_cpu.h"
#include "kvb_quant.h"
#include "kvbt.h"

#define N_SEQ 5
#define N_STEPS 12

/* tiny-moe: a batch's tokens are grouped by expert across its sequences */
static const char *const g_presets[] = {"tiny", "tiny-qwen3", "tiny-gemma3", "tiny-moe"};
#define N_MODELS (sizeof g_presets / sizeof g_presets[0])
static kvb_model *g_models[N_MODELS];

static int setup(void **state) {
    (void)state;
    kvb_err err = {0};
    for (size_t i = 0; i < N_MODELS; i++) {
        char name[64], path[512];
        snprintf(name, sizeof name, "batch-%s.gguf", g_presets[i]);
        kvbt_tmp_path(path, sizeof path, name);
        kvb_gen_opts o = {.preset = g_presets[i], .type = KVB_TYPE_Q8_0, .seed = 11 + (uint64_t)i, .n_threads = 2};
        if (kvb_gen_model(&o, path, &err) || kvb_model_load(path, &g_models[i], &err)) {
            fprintf(stderr, "setup: %s\n", err.msg);
            return -1;
        }
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    for (size_t i = 0; i < N_MODELS; i++) kvb_model_free(g_models[i]);
    return 0;
}

/* segments: each step gives some sequences 2..6 tokens at once (kvb_engine_forward_segments) */
static void batch_matches_one_by_one(const kvb_model *m, uint32_t cache_dtype, int threads, uint64_t seed,
                                     bool segments) {
    kvb_err err = {0};
    const uint32_t V = m->d.n_vocab;
    /* 1 token; just past a block; a block boundary after the steps; past the window (16) */
    const uint32_t prompt_len[N_SEQ] = {1, 17, 52, 63, 100};
    kvb_engine_opts o = {.n_threads = threads, .cache_dtype = cache_dtype, .block_tokens = 16, .max_ctx = 256,
                         .n_blocks = 128, .max_batch = 32};
    kvb_engine *ref, *bat;
    assert_int_equal(kvb_engine_create(m, &o, &ref, &err), KVB_OK);
    assert_int_equal(kvb_engine_create(m, &o, &bat, &err), KVB_OK);
    kvb_rng r;
    kvb_rng_seed(&r, seed);
    kvb_seq *sr[N_SEQ], *sb[N_SEQ];
    float *want = malloc(sizeof(float) * V * N_SEQ), *got = malloc(sizeof(float) * V * N_SEQ);
    int32_t toks[128];
    for (int i = 0; i < N_SEQ; i++) {
        for (uint32_t t = 0; t < prompt_len[i]; t++) toks[t] = (int32_t)(kvb_rng_u64(&r) % V);
        assert_int_equal(kvb_seq_create(ref, &sr[i], &err), KVB_OK);
        assert_int_equal(kvb_seq_create(bat, &sb[i], &err), KVB_OK);
        assert_int_equal(kvb_engine_forward(ref, sr[i], toks, prompt_len[i], want, false, &err), KVB_OK);
        assert_int_equal(kvb_engine_forward(bat, sb[i], toks, prompt_len[i], got, false, &err), KVB_OK);
        assert_memory_equal(want, got, sizeof(float) * V);
    }
    for (int step = 0; step < N_STEPS; step++) {
        int order[N_SEQ], n = 0;
        for (int i = 0; i < N_SEQ; i++) /* a changing subset: sequences join and leave */
            if ((step + i) % 3 != 0 || step == N_STEPS - 1) order[n++] = i;
        for (int i = n - 1; i > 0; i--) { /* in shuffled order */
            int j = (int)(kvb_rng_u64(&r) % (uint64_t)(i + 1)), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        kvb_seq *batch[N_SEQ];
        int32_t step_toks[N_SEQ * 6];
        uint32_t seg_n[N_SEQ], used = 0;
        for (int k = 0; k < n; k++) {
            seg_n[k] = segments && kvb_rng_u64(&r) % 2 ? 2 + (uint32_t)(kvb_rng_u64(&r) % 5) : 1;
            for (uint32_t t = 0; t < seg_n[k]; t++) step_toks[used + t] = (int32_t)(kvb_rng_u64(&r) % V);
            batch[k] = sb[order[k]];
            assert_int_equal(kvb_engine_forward(ref, sr[order[k]], step_toks + used, seg_n[k], want + (size_t)k * V,
                                                false, &err),
                             KVB_OK);
            used += seg_n[k];
        }
        kvb_status st = segments ? kvb_engine_forward_segments(bat, batch, seg_n, (uint32_t)n, step_toks, got, &err)
                                 : kvb_engine_forward_batch(bat, batch, step_toks, (uint32_t)n, got, &err);
        if (st) fail_msg("batch: %s", err.msg);
        for (int k = 0; k < n; k++) {
            assert_int_equal(kvb_seq_len(sb[order[k]]), kvb_seq_len(sr[order[k]]));
            if (memcmp(want + (size_t)k * V, got + (size_t)k * V, sizeof(float) * V))
                fail_msg("%s, cache %u, %d threads: step %d, sequence %d (length %u, %u tokens) differs from its own "
                         "forward", m->d.arch_name, cache_dtype, threads, step, order[k], kvb_seq_len(sr[order[k]]),
                         seg_n[k]);
        }
    }
    /* the blocks the batch filled were committed like the one-by-one ones */
    kvb_store_stats a, b;
    kvb_store_get_stats(kvb_engine_store(ref), &a);
    kvb_store_get_stats(kvb_engine_store(bat), &b);
    assert_int_equal(a.committed, b.committed);
    for (int i = 0; i < N_SEQ; i++) {
        kvb_seq_free(sr[i]);
        kvb_seq_free(sb[i]);
    }
    free(want);
    free(got);
    kvb_engine_free(ref);
    kvb_engine_free(bat);
}

static void test_batch_is_each_sequences_own_forward(void **state) {
    (void)state;
    const uint64_t seed = (uint64_t)time(NULL);
    printf("seed %llu\n", (unsigned long long)seed);
    for (int mi = 0; mi < (int)N_MODELS; mi++) {
        batch_matches_one_by_one(g_models[mi], KVB_TYPE_F16, 2, seed + (uint64_t)mi, false);
        batch_matches_one_by_one(g_models[mi], KVB_TYPE_Q8_0, 1, seed + 10 + (uint64_t)mi, false);
    }
}

static void test_segments_are_each_sequences_own_forward(void **state) {
    (void)state;
    const uint64_t seed = (uint64_t)time(NULL) ^ 0x5e9;
    printf("seed %llu\n", (unsigned long long)seed);
    for (int mi = 0; mi < (int)N_MODELS; mi++) {
        batch_matches_one_by_one(g_models[mi], KVB_TYPE_F16, 2, seed + (uint64_t)mi, true);
        batch_matches_one_by_one(g_models[mi], KVB_TYPE_Q8_0, 1, seed + 10 + (uint64_t)mi, true);
    }
}

static void test_batch_refusals(void **state) {
    (void)state;
    kvb_err err = {0};
    kvb_engine_opts o = {.n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 16, .max_ctx = 64,
                         .n_blocks = 16, .max_batch = 2};
    kvb_engine *e;
    assert_int_equal(kvb_engine_create(g_models[0], &o, &e, &err), KVB_OK);
    kvb_seq *s[3];
    for (int i = 0; i < 3; i++) assert_int_equal(kvb_seq_create(e, &s[i], &err), KVB_OK);
    const int32_t toks[3] = {1, 2, 3};
    float *lg = malloc(sizeof(float) * g_models[0]->d.n_vocab * 3);
    kvb_seq *twice[2] = {s[0], s[0]};
    assert_int_equal(kvb_engine_forward_batch(e, twice, toks, 2, lg, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "twice"));
    assert_int_equal(kvb_engine_forward_batch(e, s, toks, 3, lg, &err), KVB_ERR_INVALID); /* > max_batch */
    assert_int_equal(kvb_engine_forward_batch(e, s, toks, 0, lg, &err), KVB_ERR_INVALID);
    const int32_t bad[2] = {1, -4};
    assert_int_equal(kvb_engine_forward_batch(e, s, bad, 2, lg, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_seq_len(s[0]) + kvb_seq_len(s[1]), 0); /* a refused token advances nothing */
    /* the context limit */
    int32_t fill[64] = {0};
    if (kvb_engine_forward(e, s[2], fill, 64, NULL, false, &err)) fail_msg("%s", err.msg);
    kvb_seq *full[2] = {s[0], s[2]};
    assert_int_equal(kvb_engine_forward_batch(e, full, toks, 2, lg, &err), KVB_ERR_RANGE);
    assert_int_equal(kvb_engine_forward_batch(e, s, toks, 2, lg, &err), KVB_OK);
    assert_int_equal(kvb_seq_len(s[0]), 1);
    /* segments: none empty, at most max_batch tokens in all */
    const uint32_t zero[2] = {1, 0}, three[2] = {2, 1};
    assert_int_equal(kvb_engine_forward_segments(e, s, zero, 2, toks, lg, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_engine_forward_segments(e, s, three, 2, toks, lg, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "max_batch"));
    assert_int_equal(kvb_engine_forward_segments(e, s, three, 1, toks, lg, &err), KVB_OK);
    assert_int_equal(kvb_seq_len(s[0]), 3);
    for (int i = 0; i < 3; i++) kvb_seq_free(s[i]);
    free(lg);
    kvb_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_is_each_sequences_own_forward),
        cmocka_unit_test(test_segments_are_each_sequences_own_forward),
        cmocka_unit_test(test_batch_refusals),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
