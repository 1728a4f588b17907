/* tests/test_kv_ggml.c — the llama.cpp fidelity level (kvb_engine_opts.ggml_arith): ggml's Q8_0
 * activation quantiser against the canonical one (the same scales, the inverse 127/amax instead of
 * 1/(amax/127): equal but for values next to a rounding tie, about one in 10^5 of random
 * activations, which must exist and differ by one), ggml's dot against an
 * independently written evaluation of its order (eight lanes of four, hsum_float_8's pairing) and
 * against float64; the SIMD tile against those portable loops bit for bit; and the cache rows of both levels from kvb_kv_produce on the same inputs: Q8_0
 * weights give other K and V rows, F32 weights the same V rows (both levels take the canonical
 * dot for float weights) and the same K rows at position 0 (RoPE there is the identity in both)
 * but other K rows past it (ggml's f32 angle recurrence and contracted rotation). An engine for
 * latent attention refuses the level. Random inputs are fresh each run (seed from the clock,
 * printed; KVB_TEST_SEED=N replays one). The bytes llama.cpp itself writes are checked end to end
 * by `kvbridge verify --target llama.cpp --kv-arith ggml` (bench/RESULTS.md). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvb_core.h"
#include "kvb_engine_cpu.h"
#include "kvb_model.h"
#include "kvb_quant.h"
#include "kvbt.h"

static uint64_t g_seed;
static kvb_rng g_rng;

static int setup(void **state) {
    (void)state;
    const char *s = getenv("KVB_TEST_SEED");
    g_seed = s ? strtoull(s, NULL, 10) : (uint64_t)time(NULL);
    print_message("seed %" PRIu64 " (KVB_TEST_SEED=%" PRIu64 " replays)\n", g_seed, g_seed);
    kvb_rng_seed(&g_rng, g_seed);
    return 0;
}

/* n normal values times a per-block magnitude from 1e-3 to 1e3 */
static void random_row(float *x, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float mag = powf(10.0f, 6.0f * kvb_rng_uniform(&g_rng) - 3.0f);
        for (int j = 0; j < 32; j++) x[b * 32 + j] = kvb_rng_normal(&g_rng) * mag;
    }
}

static void test_quantizer_scales_equal_rounding_differs(void **state) {
    (void)state;
    enum { N = 32 * 4096 };
    float *x = malloc(sizeof(float) * N);
    kvb_block_q8_0 *ours = malloc(sizeof(kvb_block_q8_0) * N / 32), *ggml = malloc(sizeof(kvb_block_q8_0) * N / 32);
    random_row(x, N);
    /* every other block near rounding ties: x = (k + 1/2) amax / 127, amax in element 0 */
    for (int b = 0; b < N / 32; b += 2) {
        const float amax = fabsf(x[b * 32]) + 1e-3f;
        x[b * 32] = amax;
        for (int j = 1; j < 32; j++) x[b * 32 + j] = ((float)(int)(kvb_rng_u64(&g_rng) % 253) - 126.0f + 0.5f) * amax / 127.0f;
    }
    kvb_quantize_act(KVB_TYPE_Q8_0, x, ours, N);
    kvb_quantize_act_ggml(x, ggml, N);
    size_t differ = 0;
    for (int b = 0; b < N / 32; b++) {
        assert_int_equal(ours[b].d, ggml[b].d);
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[b * 32 + j]));
        const float id = 127.0f / amax;
        for (int j = 0; j < 32; j++) {
            assert_int_equal(ggml[b].qs[j], (int)nearbyintf(x[b * 32 + j] * id)); /* RNE in the default mode */
            if (ggml[b].qs[j] != ours[b].qs[j]) {
                assert_int_equal(abs(ggml[b].qs[j] - ours[b].qs[j]), 1); /* a rounding case, no more */
                differ++;
            }
        }
    }
    print_message("  %zu of %d activations round the other way\n", differ, N);
    assert_true(differ > 0);
    assert_true(differ < N / 10);
    free(x), free(ours), free(ggml);
}

/* ggml's order written out once more, independently: lane k of block b is the integer dot of
 * elements 4k..4k+3; lanes accumulate blocks in order through fmaf; hsum_float_8 folds the upper
 * four lanes onto the lower, then 0+2, 1+3, then the two. */
static float dot_model(const int8_t *w, const float *wd, const kvb_block_q8_0 *x, int nb) {
    float l[8] = {0};
    for (int b = 0; b < nb; b++)
        for (int k = 0; k < 8; k++) {
            int s = 0;
            for (int j = 0; j < 4; j++) s += w[b * 32 + 4 * k + j] * x[b].qs[4 * k + j];
            l[k] = fmaf(wd[b] * kvb_fp16_to_f32(x[b].d), (float)s, l[k]);
        }
    float h[4];
    for (int i = 0; i < 4; i++) h[i] = l[i + 4] + l[i];
    return (h[0] + h[2]) + (h[1] + h[3]);
}

static void test_dot_order(void **state) {
    (void)state;
    enum { NB = 20, N = NB * 32, ROWS = 400 };
    float x[N], w[N], wd[NB];
    int8_t wq[N];
    kvb_block_q8_0 act[NB], w8[NB];
    kvb_block_q5_0 w5[NB];
    int other_bits = 0;
    for (int r = 0; r < ROWS; r++) {
        const uint32_t type = r % 2 ? KVB_TYPE_Q5_0 : KVB_TYPE_Q8_0;
        random_row(x, N);
        random_row(w, N);
        kvb_quantize_act_ggml(x, act, N);
        void *row = type == KVB_TYPE_Q8_0 ? (void *)w8 : (void *)w5;
        kvb_f32_to_row(type, w, row, N);
        float wf[N];
        kvb_row_to_f32(type, row, wf, N);
        double exact = 0, mag = 0;
        for (int b = 0; b < NB; b++) {
            wd[b] = kvb_fp16_to_f32(type == KVB_TYPE_Q8_0 ? w8[b].d : w5[b].d);
            for (int j = 0; j < 32; j++) {
                /* the weight's integer value: its f32 value over the block scale (exact) */
                wq[b * 32 + j] = (int8_t)(wd[b] != 0 ? wf[b * 32 + j] / wd[b] : 0);
                const double t = (double)wf[b * 32 + j] * act[b].qs[j] * kvb_fp16_to_f32(act[b].d);
                exact += t;
                mag += fabs(t);
            }
        }
        const float got = kvb_dot_ggml(type, row, act, N);
        const float want = dot_model(wq, wd, act, NB);
        if (memcmp(&got, &want, 4)) fail_msg("row %d (%s): %.9g, the model of ggml's order %.9g", r, kvb_type_name(type),
                                             got, want);
        assert_true(fabs(got - exact) <= 1e-5 * mag + 1e-30);
        const float canonical = kvb_dot(type, row, act, N);
        other_bits += memcmp(&got, &canonical, 4) != 0;
    }
    print_message("  %d of %d rows: ggml's order gives other bits than the canonical one\n", other_bits, ROWS);
    assert_true(other_bits > 0);
    assert_true(isnan(kvb_dot_ggml(KVB_TYPE_F32, x, x, N)));
    assert_true(isnan(kvb_dot_ggml(KVB_TYPE_Q8_0, w8, act, 33)));
    assert_false(kvb_ggml_dot_type(KVB_TYPE_Q4_K));
}

/* kvb_matmul_tile_ggml (the AVX2 tile where the dispatch chose SIMD kernels) against kvb_dot_ggml
 * (the portable loops) per output, bit for bit: 13 rows x 11 tokens (a partial token group) of
 * 640 values, padded strides. */
static void test_tile_matches_scalar(void **state) {
    (void)state;
    enum { ROWS = 13, TOK = 11, N = 640, NB = N / 32 };
    const size_t w_stride = sizeof(kvb_block_q8_0) * NB + 6, a_stride = sizeof(kvb_block_q8_0) * NB + 10;
    uint8_t *w = malloc(w_stride * ROWS), *act = malloc(a_stride * TOK);
    float x[N], y[TOK * (ROWS + 3)];
    print_message("  dispatch: %s\n", kvb_simd_name());
    for (int c = 0; c < 2; c++) {
        const uint32_t type = c ? KVB_TYPE_Q5_0 : KVB_TYPE_Q8_0;
        for (int r = 0; r < ROWS; r++) {
            random_row(x, N);
            kvb_f32_to_row(type, x, w + r * w_stride, N);
        }
        for (int t = 0; t < TOK; t++) {
            random_row(x, N);
            kvb_quantize_act_ggml(x, act + t * a_stride, N);
        }
        kvb_matmul_tile_ggml(type, w, w_stride, ROWS, act, a_stride, TOK, y, ROWS + 3, N);
        for (int t = 0; t < TOK; t++)
            for (int r = 0; r < ROWS; r++) {
                const float want = kvb_dot_ggml(type, w + r * w_stride, act + t * a_stride, N);
                if (memcmp(&want, &y[t * (ROWS + 3) + r], 4))
                    fail_msg("%s row %d token %d: tile %.9g, portable %.9g", kvb_type_name(type), r, t,
                             y[t * (ROWS + 3) + r], want);
            }
    }
    free(w), free(act);
}

/* The rows of one layer at both levels for n tokens at positions 0, 997, 2 * 997 ... of random
 * attention inputs: K and V (n, n_head_kv, head_dim) f32 (the cache dtype that hides no difference). */
static void rows_both_levels(const kvb_model *m, uint32_t n, uint8_t *k[2], uint8_t *v[2]) {
    const kvb_model_desc *d = &m->d;
    float *h = malloc(sizeof(float) * n * d->n_embd);
    for (size_t i = 0; i < (size_t)n * d->n_embd; i++) h[i] = kvb_rng_normal(&g_rng);
    void *scratch = kvb_aligned_alloc(64, kvb_kv_produce_scratch_bytes(m, n));
    kvb_err err = {0};
    for (int level = 0; level < 2; level++) {
        kvb_rope_tables rt;
        assert_int_equal(kvb_rope_tables_init(&rt, m, n, &err), KVB_OK);
        if (level) assert_int_equal(kvb_rope_tables_set_ggml(&rt, &err), KVB_OK);
        uint32_t pos[64];
        for (uint32_t t = 0; t < n; t++) pos[t] = 997 * t;
        kvb_rope_tables_fill_at(&rt, pos, n);
        kvb_kv_produce_args a = {.m = m, .layer = 1, .cache_dtype = KVB_TYPE_F32, .ggml = level == 1};
        kvb_rope_tables_layer(&rt, 1, &a.rope_cos, &a.rope_sin);
        kvb_kv_produce(&a, h, n, scratch, k[level], v[level]);
        kvb_rope_tables_free(&rt);
    }
    kvb_aligned_free(scratch);
    free(h);
}

static void test_rows_of_the_two_levels(void **state) {
    (void)state;
    enum { N = 24 };
    const uint32_t types[2] = {KVB_TYPE_Q8_0, KVB_TYPE_F32};
    for (int c = 0; c < 2; c++) {
        char name[64];
        snprintf(name, sizeof name, "kv-ggml-%s.gguf", kvb_type_name(types[c]));
        kvb_model *m = kvbt_gen_load(name, "tiny", types[c], g_seed + (uint64_t)c);
        assert_non_null(m);
        const size_t tok = (size_t)m->d.n_head_kv * m->d.head_dim * 4; /* one token's f32 row bytes */
        uint8_t *k[2] = {malloc(N * tok), malloc(N * tok)}, *v[2] = {malloc(N * tok), malloc(N * tok)};
        rows_both_levels(m, N, k, v);
        const bool v_same = !memcmp(v[0], v[1], N * tok), k0_same = !memcmp(k[0], k[1], tok);
        int k_later_differ = 0;
        for (int t = 1; t < N; t++) k_later_differ += memcmp(k[0] + t * tok, k[1] + t * tok, tok) != 0;
        print_message("  %s weights: V rows %s, K at position 0 %s, K differs at %d of %d later positions\n",
                      kvb_type_name(types[c]), v_same ? "equal" : "differ", k0_same ? "equal" : "differs",
                      k_later_differ, N - 1);
        if (types[c] == KVB_TYPE_Q8_0) {
            assert_false(v_same);
            assert_false(!memcmp(k[0], k[1], N * tok));
        } else {
            assert_true(v_same);
            assert_true(k0_same);
            assert_true(k_later_differ > 0);
        }
        free(k[0]), free(k[1]), free(v[0]), free(v[1]);
        kvb_model_free(m);
    }
}

static void test_latent_attention_refused(void **state) {
    (void)state;
    kvb_model *m = kvbt_gen_load("kv-ggml-mla.gguf", "tiny-mla", KVB_TYPE_F32, 3);
    assert_non_null(m);
    kvb_engine_opts o = {.n_threads = 1, .cache_dtype = KVB_TYPE_F16, .max_ctx = 64, .ggml_arith = true};
    kvb_engine *e = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_engine_create(m, &o, &e, &err), KVB_ERR_UNSUPPORTED);
    assert_null(e);
    kvb_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_quantizer_scales_equal_rounding_differs),
        cmocka_unit_test(test_dot_order),
        cmocka_unit_test(test_tile_matches_scalar),
        cmocka_unit_test(test_rows_of_the_two_levels),
        cmocka_unit_test(test_latent_attention_refused),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
