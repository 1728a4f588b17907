/* tests/test_cuda_bridge.c — contract 3 on the GPU: the CUDA bridge kernel's K and V rows are
 * bit-identical to the CPU's kvb_kv_produce (the decoder's own arithmetic, fed each layer's own
 * RoPE table exactly as the CPU engine feeds it: kvb_rope_tables) on fresh random attention
 * inputs, for every architecture (llama, qwen2 bias, qwen3 k-norm, llama3 rope scaling, gemma3
 * k-norm with local layers rotating with their own base, deepseek2's latent row: attn_kv_a_mqa,
 * the latent normed with attn_kv_a_norm, the rope part rotated in pairs with YaRN frequencies, no
 * V), every weight type (Q8_0, Q4_0, Q5_0, F16, BF16, F32) and every cache dtype (f32, f16, bf16,
 * q8_0), every layer, over two chunks in a row at positions past 0 (the second reusing the
 * bridge's buffers with a new RoPE table). The test-only perturbation is reproduced bit for bit
 * too and changes the f32 rows, so the comparison can fail.
 * K/V weights of a type the kernels do not reproduce (the K-quants) are refused at creation (that
 * check needs no device). Label `gpu`; the others skip without a device. */
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
#ifdef KVB_HAVE_CUDA
#include "kvb_bridge_cuda.h"
#include "kvb_engine_cuda.h"

static void need_device(void) {
    char why[256];
    if (!kvb_cuda_device_available(why, sizeof why)) {
        print_message("%s: skipping\n", why);
        skip();
    }
}

/* Compares CPU kv_produce and the CUDA bridge on every layer of two chunks (37 tokens from 5, 21
 * from 42); returns identical (chunk x layer x K/V) row sets (K alone for a latent cache), and
 * *total. */
static int compare(kvb_model *m, uint32_t dtype, bool perturb, uint64_t seed, int *total) {
    const uint32_t n_max = 37, chunks[2][2] = {{5, 37}, {42, 21}}, E = m->d.n_embd; /* (pos0, n) */
    const size_t rows = (size_t)n_max * m->d.n_head_kv * kvb_row_bytes(dtype, m->d.head_dim);
    float *h = malloc(sizeof(float) * n_max * E);
    uint8_t *ck = malloc(rows), *cv = malloc(rows), *gk = malloc(rows), *gv = malloc(rows);
    void *scratch = kvb_aligned_alloc(64, kvb_kv_produce_scratch_bytes(m, n_max));
    kvb_rng r;
    kvb_rng_seed(&r, seed);
    kvb_err err = {0};
    kvb_rope_tables rope; /* the CPU engine's per-layer-kind tables, filled as its forward fills them */
    if (kvb_rope_tables_init(&rope, m, n_max, &err)) fail_msg("%s", err.msg);
    kvb_bridge_cuda *b = NULL;
    if (kvb_bridge_cuda_create(m, dtype, n_max, &b, &err)) fail_msg("%s", err.msg);
    kvb_bridge_cuda_set_perturbed(b, perturb);
    int same = 0;
    *total = 0;
    for (int c = 0; c < 2; c++) {
        const uint32_t pos0 = chunks[c][0], n = chunks[c][1];
        const size_t rows_c = (size_t)n * m->d.n_head_kv * kvb_row_bytes(dtype, m->d.head_dim);
        for (size_t i = 0; i < (size_t)n * E; i++) h[i] = kvb_rng_normal(&r);
        kvb_rope_tables_fill(&rope, pos0, n);
        for (uint32_t l = 0; l < m->d.n_layer; l++) {
            const float *cs, *sn;
            kvb_rope_tables_layer(&rope, l, &cs, &sn);
            kvb_kv_produce_args a = {m, l, dtype, NULL, cs, sn, perturb, false};
            kvb_kv_produce(&a, h, n, scratch, ck, cv);
            memset(gk, 0xA5, rows); /* poisoned: an unwritten byte fails */
            memset(gv, 0xA5, rows);
            if (kvb_bridge_cuda_layer(b, l, pos0, n, h, gk, gv, &err)) fail_msg("%s", err.msg);
            same += memcmp(ck, gk, rows_c) == 0;
            *total += 1;
            if (m->d.mla) { /* a latent row has no V: nothing may be written there */
                bool untouched = true;
                for (size_t i = 0; i < rows; i++) untouched &= gv[i] == 0xA5;
                same += untouched;
            } else {
                same += memcmp(cv, gv, rows_c) == 0;
            }
            *total += 1;
        }
    }
    kvb_bridge_cuda_free(b);
    free(h);
    free(ck);
    free(cv);
    free(gk);
    free(gv);
    kvb_aligned_free(scratch);
    kvb_rope_tables_free(&rope);
    return same;
}

/* Generates preset in weight type wtype (seed) into the temp dir as file, and loads it. */
static kvb_model *gen_load(const char *preset, uint32_t wtype, uint64_t seed, const char *file) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", kvbt_tmpdir(), file);
    kvb_gen_opts o = {.preset = preset, .type = wtype, .seed = seed, .n_threads = 2};
    kvb_model *m = NULL;
    kvb_err err = {0};
    if (kvb_gen_model(&o, path, &err) || kvb_model_load(path, &m, &err)) fail_msg("%s: %s", preset, err.msg);
    return m;
}

static void test_bridge_bit_exact(void **state) {
    (void)state;
    need_device();
    const char *presets[] = {"tiny", "tiny-qwen2", "tiny-qwen3", "tiny-llama3", "tiny-gemma3", "tiny-mla"};
    const uint32_t wtypes[] = {KVB_TYPE_Q8_0, KVB_TYPE_Q4_0, KVB_TYPE_Q5_0, KVB_TYPE_F16, KVB_TYPE_BF16, KVB_TYPE_F32};
    const uint32_t dtypes[] = {KVB_TYPE_F32, KVB_TYPE_F16, KVB_TYPE_BF16, KVB_TYPE_Q8_0};
    uint64_t seed = (uint64_t)time(NULL);
    int rows = 0, ok = 0;
    for (size_t p = 0; p < KVB_ARRAY_LEN(presets); p++)
        for (size_t w = 0; w < sizeof wtypes / sizeof wtypes[0]; w++) {
            char file[128];
            snprintf(file, sizeof file, "%s-%zu.gguf", presets[p], w);
            kvb_model *m = gen_load(presets[p], wtypes[w], seed + w, file);
            if (kvb_model_has_local_layers(&m->d)) {
                /* tiny-gemma3: layer 0 local (base 10000), the last global (1e6): two different tables,
                 * so a bridge rotating every layer with one of them fails the comparison */
                double g[64], lo[64];
                assert_true(m->d.n_rot / 2 <= 64 && m->d.n_rot >= 4);
                kvb_rope_inv_freq_layer(m, m->d.n_layer - 1, g);
                kvb_rope_inv_freq_layer(m, 0, lo);
                assert_true(kvb_layer_is_local(&m->d, 0) && !kvb_layer_is_local(&m->d, m->d.n_layer - 1));
                assert_true(g[1] != lo[1]);
            }
            for (size_t c = 0; c < 4; c++) {
                int total, same = compare(m, dtypes[c], false, seed + 100 * p + 10 * w + c, &total);
                if (same != total)
                    print_error("%s %s weights, %s cache: %d/%d (chunk x layer x K/V) identical (seed %llu)\n", presets[p],
                                kvb_type_name(wtypes[w]), kvb_type_name(dtypes[c]), same, total,
                                (unsigned long long)seed);
                rows += total;
                ok += same;
            }
            kvb_model_free(m);
        }
    print_message("cuda bridge vs cpu kv_produce: %d/%d (chunk x layer x K/V) row sets bit-identical\n", ok, rows);
    assert_int_equal(ok, rows);
}

static void test_bridge_perturbation(void **state) {
    (void)state;
    need_device();
    const char *presets[] = {"tiny", "tiny-mla"};
    for (size_t p = 0; p < KVB_ARRAY_LEN(presets); p++) {
        char file[64];
        snprintf(file, sizeof file, "pert-%s.gguf", presets[p]);
        kvb_model *m = gen_load(presets[p], KVB_TYPE_F16, 3, file);
        int total = 0;
        /* the perturbed GPU kernel equals the perturbed CPU arithmetic... */
        const int same = compare(m, KVB_TYPE_F32, true, 9, &total);
        assert_true(total > 0);
        assert_int_equal(same, total);
        kvb_model_free(m);
    }
}
/* K-quant K/V weights: refused with a message at creation (the kernels would not reproduce them) */
static void test_bridge_refuses_kquants(void **state) {
    (void)state;
    kvb_model *m = gen_load("tiny-gemma3", KVB_TYPE_Q4_K, 5, "q4k.gguf");
    kvb_err err = {0};
    kvb_bridge_cuda *b = NULL;
    assert_int_equal(kvb_bridge_cuda_create(m, KVB_TYPE_F16, 8, &b, &err), KVB_ERR_UNSUPPORTED);
    assert_null(b);
    print_message("Q4_K K/V weights: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "Q4_K"));
    kvb_model_free(m);
}
#else
static void test_bridge_bit_exact(void **state) {
    (void)state;
    kvbt_require_gpu(); /* skips, saying why: this build has no CUDA engine */
}
static void test_bridge_perturbation(void **state) { test_bridge_bit_exact(state); }
static void test_bridge_refuses_kquants(void **state) { test_bridge_bit_exact(state); }
#endif

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bridge_bit_exact),
        cmocka_unit_test(test_bridge_perturbation),
        cmocka_unit_test(test_bridge_refuses_kquants),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
