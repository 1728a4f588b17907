/* test_cuda_kernels — every CUDA engine kernel against its CPU twin (in double, from the same bf16
 * inputs), on fresh random inputs each run (seed printed; KVB_TEST_SEED repeats one), with the
 * outputs poisoned (NaN bit patterns) before the launch so an element the kernel forgets to write
 * fails. Kernels: embedding gather (plain, and times gemma3's sqrt(n_embd)), RMSNorm, gemma3's
 * post norm added into the f32 residual stream, SwiGLU and GeGLU (tanh GELU), the GEMM call
 * (layout, beta accumulation, bf16 out), the fused QKV epilogue (bias, q/k-norm, RoPE both
 * pairings, partial rotary, cache write; cache bytes it must not touch stay poisoned), and causal
 * attention over a paged cache holding a prefix (tensor-core kernel for D = 64/128/192 with 64 and 128
 * query rows per CTA, and the generic kernel, D up to 256), with and without a sliding window and
 * with scales other than 1/sqrt(D); cache rows past the visible range — and, with a window, every
 * row before the window of the chunk's first query — are NaN, so a kernel that reads them fails.
 * And the tensor-parallel all-reduce's sum (kvb_cu_sum_f32), bit for bit against the same f32 adds
 * in the same order on the host, through its float4 and scalar paths (pointers one float off a
 * 16-byte boundary, counts not a multiple of 4), with the floats around its output checked.
 * And the packed-weight expansion (kvb_cu_expand_bf16) of every type it takes, bit for bit against
 * the CPU's conversion at load, with NaN, infinite, subnormal and zero scales.
 *
 * Tolerances (the GPU rounds each output to bf16 once: relative error <= 2^-8 = 3.9e-3):
 *   embed: exact (the scaled one too: one f32 product, as on the host). rmsnorm, swiglu:
 *   |gpu - ref| <= 4.5e-3 |ref| + 1e-6 (f32 arithmetic before the rounding adds ~1e-6 relative).
 *   geglu: the same plus 2e-7 |g u| (tanhf's absolute error, <= 2 ulp of 1 = 1.2e-7, times 0.5 |g u|,
 *   matters where 1 + tanh cancels). post norm (f32 out, no bf16 rounding): |gpu - ref| <=
 *   1e-5 (|x| + |normed|) + 1e-6. qkv epilogue: as rmsnorm per element, plus 2e-5 x the head's max
 *   |value| for RoPE outputs near cancellation. GEMM f32 out: relative L2 <= 1e-4 (f32 accumulation
 *   of exact bf16 products over <= 300 terms ~1e-6); bf16 out: <= 4e-3. attention: relative L2 of
 *   each (token, head) row <= 1e-2 (P rounded to bf16 before P.V, 2^-9 RMS per weight, plus the
 *   output rounding), max abs <= 3e-2 x row max.
 * Without a CUDA device every test skips with "no CUDA device". */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvb_core.h"
#include "kvb_quant.h"

#ifdef KVB_HAVE_CUDA
#include "cuda_testapi.h"
#include "kvb_engine_cuda.h"
#include "kvbt.h"
#include "tp_comm.h"

static uint64_t g_seed;
static kvb_rng g_rng;

#define BF16_NAN 0xFFC1u
static float rnd_normal(void) { return kvb_rng_normal(&g_rng); }
static uint16_t to_bf(float f) { return kvb_f32_to_bf16(f); }
static double bf(uint16_t h) { return (double)kvb_bf16_to_f32(h); }
static void poison_f32(float *p, size_t n) { memset(p, 0xFF, n * sizeof(float)); }
static void poison_bf16(uint16_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = BF16_NAN;
}
/* ||a - ref|| / ||ref||; NaN anywhere gives NaN (which fails every <= check) */
static double rel_l2_f(const float *a, const double *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void check_close(double got, double ref, double rel, double abs_tol, const char *what, size_t i) {
    if (!(fabs(got - ref) <= rel * fabs(ref) + abs_tol))
        fail_msg("%s[%zu]: got %.9g, reference %.9g (|diff| %.3g > %.3g)", what, i, got, ref, fabs(got - ref),
                 rel * fabs(ref) + abs_tol);
}

static void test_embed(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t V = 1000, Es[] = {384, 130, 77, 640, 640};
    for (size_t c = 0; c < KVB_ARRAY_LEN(Es); c++) {
        const uint32_t E = Es[c], n = 37;
        const float scale = c % 2 ? sqrtf((float)E) : 0.0f; /* gemma3's embedding scale on every other case */
        uint16_t *tab = malloc(sizeof(uint16_t) * V * E);
        int32_t tok[37];
        float *x = malloc(sizeof(float) * n * E);
        assert_non_null(tab);
        assert_non_null(x);
        for (size_t i = 0; i < (size_t)V * E; i++) tab[i] = to_bf(rnd_normal());
        for (uint32_t t = 0; t < n; t++) tok[t] = (int32_t)(kvb_rng_u64(&g_rng) % V);
        poison_f32(x, (size_t)n * E);
        kvb_err err = {0};
        if (kvb_cuda_test_embed(tab, V, E, tok, n, scale, x, &err)) fail_msg("%s", err.msg);
        for (uint32_t t = 0; t < n; t++)
            for (uint32_t i = 0; i < E; i++) {
                const float row = kvb_bf16_to_f32(tab[(size_t)tok[t] * E + i]);
                const float want = scale != 0.0f ? row * scale : row; /* one f32 product (no contraction here) */
                if (memcmp(&x[(size_t)t * E + i], &want, sizeof want) != 0)
                    fail_msg("embed E=%u scale %g: x[%u][%u] = %.9g, want %.9g", E, (double)scale, t, i,
                             x[(size_t)t * E + i], (double)want);
            }
        free(tab);
        free(x);
    }
}

static void test_rmsnorm(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t Es[] = {256, 4096, 1002, 64};
    for (size_t c = 0; c < KVB_ARRAY_LEN(Es); c++) {
        const uint32_t E = Es[c], n = 19;
        const float eps = 1e-5f, scale = (float)(0.01 + 10.0 * kvb_rng_uniform(&g_rng));
        float *x = malloc(sizeof(float) * n * E), *w = malloc(sizeof(float) * E);
        uint16_t *y = malloc(sizeof(uint16_t) * n * E);
        assert_non_null(x);
        assert_non_null(w);
        assert_non_null(y);
        for (size_t i = 0; i < (size_t)n * E; i++) x[i] = rnd_normal() * scale;
        for (uint32_t i = 0; i < E; i++) w[i] = 1.0f + 0.5f * rnd_normal();
        poison_bf16(y, (size_t)n * E);
        kvb_err err = {0};
        if (kvb_cuda_test_rmsnorm(x, n, E, w, eps, y, NULL, &err)) fail_msg("%s", err.msg);
        for (uint32_t t = 0; t < n; t++) {
            double ss = 0;
            for (uint32_t i = 0; i < E; i++) ss += (double)x[t * E + i] * x[t * E + i];
            double r = 1.0 / sqrt(ss / E + eps);
            for (uint32_t i = 0; i < E; i++)
                check_close(bf(y[t * E + i]), x[t * E + i] * r * w[i], 4.5e-3, 1e-6, "rmsnorm", (size_t)t * E + i);
        }
        free(x);
        free(w);
        free(y);
    }
}

/* gemma3's post norm: x += rmsnorm(src) * w, in f32 */
static void test_rmsnorm_add(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t Es[] = {640, 256, 4096, 1002};
    for (size_t c = 0; c < KVB_ARRAY_LEN(Es); c++) {
        const uint32_t E = Es[c], n = 23;
        const float eps = 1e-6f, scale = (float)(0.01 + 100.0 * kvb_rng_uniform(&g_rng));
        float *src = malloc(sizeof(float) * n * E), *w = malloc(sizeof(float) * E);
        float *x = malloc(sizeof(float) * n * E), *x0 = malloc(sizeof(float) * n * E);
        assert_true(src && w && x && x0);
        for (size_t i = 0; i < (size_t)n * E; i++) {
            src[i] = rnd_normal() * scale;
            x0[i] = x[i] = 4.0f * rnd_normal();
        }
        for (uint32_t i = 0; i < E; i++) w[i] = 1.0f + 20.0f * fabsf(rnd_normal()); /* Gemma's stored norm weights reach the hundreds */
        kvb_err err = {0};
        if (kvb_cuda_test_rmsnorm(src, n, E, w, eps, NULL, x, &err)) fail_msg("%s", err.msg);
        for (uint32_t t = 0; t < n; t++) {
            double ss = 0;
            for (uint32_t i = 0; i < E; i++) ss += (double)src[t * E + i] * src[t * E + i];
            const double r = 1.0 / sqrt(ss / E + eps);
            for (uint32_t i = 0; i < E; i++) {
                const size_t k = (size_t)t * E + i;
                const double o = src[k] * r * w[i];
                check_close(x[k], x0[k] + o, 0.0, 1e-5 * (fabs(x0[k]) + fabs(o)) + 1e-6, "rmsnorm_add", k);
            }
        }
        free(src);
        free(w);
        free(x);
        free(x0);
    }
}

static double gelu_tanh_ref(double g) {
    return 0.5 * g * (1.0 + tanh(sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g)));
}

/* SwiGLU (llama, qwen) and GeGLU (gemma3) */
static void test_glu(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t FFs[] = {640, 14336, 7, 2048};
    for (int gelu = 0; gelu < 2; gelu++)
        for (size_t c = 0; c < KVB_ARRAY_LEN(FFs); c++) {
            const uint32_t FF = FFs[c], n = 13;
            uint16_t *gu = malloc(sizeof(uint16_t) * n * 2 * FF), *out = malloc(sizeof(uint16_t) * n * FF);
            assert_non_null(gu);
            assert_non_null(out);
            for (size_t i = 0; i < (size_t)n * 2 * FF; i++) gu[i] = to_bf(3.0f * rnd_normal());
            poison_bf16(out, (size_t)n * FF);
            kvb_err err = {0};
            if (kvb_cuda_test_glu(gu, n, FF, gelu != 0, out, &err)) fail_msg("%s", err.msg);
            for (uint32_t t = 0; t < n; t++)
                for (uint32_t i = 0; i < FF; i++) {
                    double g = bf(gu[(size_t)t * 2 * FF + i]), u = bf(gu[(size_t)t * 2 * FF + FF + i]);
                    if (gelu)
                        check_close(bf(out[(size_t)t * FF + i]), gelu_tanh_ref(g) * u, 4.5e-3, 1e-6 + 2e-7 * fabs(g * u),
                                    "geglu", (size_t)t * FF + i);
                    else
                        check_close(bf(out[(size_t)t * FF + i]), g / (1.0 + exp(-g)) * u, 4.5e-3, 1e-6, "swiglu",
                                    (size_t)t * FF + i);
                }
            free(gu);
            free(out);
        }
}

static void test_gemm(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t rows = 300, cols = 264, n = 45;
    uint16_t *W = malloc(sizeof(uint16_t) * rows * cols), *x = malloc(sizeof(uint16_t) * n * cols);
    float *y = malloc(sizeof(float) * n * rows), *y0 = malloc(sizeof(float) * n * rows);
    uint16_t *yb = malloc(sizeof(uint16_t) * n * rows);
    double *ref = malloc(sizeof(double) * n * rows);
    assert_true(W && x && y && y0 && yb && ref);
    for (size_t i = 0; i < (size_t)rows * cols; i++) W[i] = to_bf(rnd_normal() / 16.0f);
    for (size_t i = 0; i < (size_t)n * cols; i++) x[i] = to_bf(rnd_normal());
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t r = 0; r < rows; r++) {
            double s = 0;
            for (uint32_t k = 0; k < cols; k++) s += bf(W[(size_t)r * cols + k]) * bf(x[(size_t)t * cols + k]);
            ref[(size_t)t * rows + r] = s;
        }
    kvb_err err = {0};
    /* beta 0, f32 out */
    poison_f32(y, (size_t)n * rows);
    if (kvb_cuda_test_gemm(W, rows, cols, x, n, 0.0f, y, false, &err)) fail_msg("%s", err.msg);
    double e = rel_l2_f(y, ref, (size_t)n * rows);
    print_message("gemm f32 out: rel-L2 %.3g\n", e);
    if (!(e <= 1e-4)) fail_msg("gemm f32: rel-L2 %.3g > 1e-4", e);
    /* beta 1: y += W x on top of random y0 */
    for (size_t i = 0; i < (size_t)n * rows; i++) y0[i] = y[i] = rnd_normal();
    if (kvb_cuda_test_gemm(W, rows, cols, x, n, 1.0f, y, false, &err)) fail_msg("%s", err.msg);
    for (size_t i = 0; i < (size_t)n * rows; i++) ref[i] += y0[i];
    e = rel_l2_f(y, ref, (size_t)n * rows);
    print_message("gemm f32 out, beta 1: rel-L2 %.3g\n", e);
    if (!(e <= 1e-4)) fail_msg("gemm beta=1: rel-L2 %.3g > 1e-4", e);
    for (size_t i = 0; i < (size_t)n * rows; i++) ref[i] -= y0[i];
    /* bf16 out */
    poison_bf16(yb, (size_t)n * rows);
    if (kvb_cuda_test_gemm(W, rows, cols, x, n, 0.0f, yb, true, &err)) fail_msg("%s", err.msg);
    for (size_t i = 0; i < (size_t)n * rows; i++) y[i] = (float)bf(yb[i]);
    e = rel_l2_f(y, ref, (size_t)n * rows);
    print_message("gemm bf16 out: rel-L2 %.3g\n", e);
    if (!(e <= 4e-3)) fail_msg("gemm bf16: rel-L2 %.3g > 4e-3", e);
    free(W);
    free(x);
    free(y);
    free(y0);
    free(yb);
    free(ref);
}

/* ---- the paged cache as a host array --------------------------------------------------------- */

typedef struct {
    kvb_cuda_test_cache c;
    size_t block_bytes;
    int32_t *table;
} host_cache;

static void cache_make(host_cache *hc, uint32_t n_layer, uint32_t Hkv, uint32_t D, uint32_t bt, uint32_t n_pos) {
    memset(hc, 0, sizeof *hc);
    hc->c.n_layer = n_layer;
    hc->c.n_head_kv = Hkv;
    hc->c.head_dim = D;
    hc->c.block_tokens = bt;
    hc->c.n_table = (n_pos + bt - 1) / bt;
    hc->c.n_pool_blocks = hc->c.n_table + 3;
    hc->block_bytes = (size_t)n_layer * 2 * Hkv * bt * D * 2;
    hc->c.pool = malloc(hc->block_bytes * hc->c.n_pool_blocks);
    hc->table = malloc(sizeof(int32_t) * hc->c.n_pool_blocks);
    assert_non_null(hc->c.pool);
    assert_non_null(hc->table);
    poison_bf16((uint16_t *)hc->c.pool, hc->block_bytes * hc->c.n_pool_blocks / 2);
    /* a random permutation of the pool: the sequence's blocks are scattered */
    for (uint32_t i = 0; i < hc->c.n_pool_blocks; i++) hc->table[i] = (int32_t)i;
    for (uint32_t i = hc->c.n_pool_blocks; i-- > 1;) {
        uint32_t j = (uint32_t)(kvb_rng_u64(&g_rng) % (i + 1));
        int32_t t = hc->table[i];
        hc->table[i] = hc->table[j];
        hc->table[j] = t;
    }
    hc->c.blocks = hc->table;
}

static uint16_t *cache_row(const host_cache *hc, uint32_t layer, uint32_t kv, uint32_t kvh, uint32_t pos) {
    const kvb_cuda_test_cache *c = &hc->c;
    size_t row = (((size_t)layer * 2 + kv) * c->n_head_kv + kvh) * c->block_tokens + pos % c->block_tokens;
    return (uint16_t *)(c->pool + (size_t)hc->table[pos / c->block_tokens] * hc->block_bytes) + row * c->head_dim;
}

static void cache_free(host_cache *hc) {
    free(hc->c.pool);
    free(hc->table);
}

/* ---- fused QKV epilogue ------------------------------------------------------------------------ */

typedef struct {
    uint32_t H, Hkv, D, n_rot;
    bool neox, bias, norm;
} qkv_cfg;

static void run_qkv_case(const qkv_cfg *k) {
    const uint32_t n = 21, pos0 = 37, bt = 16, n_layer = 2, layer = 1, D = k->D, half = k->n_rot / 2;
    const uint32_t S = (k->H + 2 * k->Hkv) * D;
    const float eps = 1e-6f;
    host_cache hc;
    cache_make(&hc, n_layer, k->Hkv, D, bt, pos0 + n);
    float *qkv = malloc(sizeof(float) * n * S), *bias = malloc(sizeof(float) * S);
    float *qn = malloc(sizeof(float) * D), *kn = malloc(sizeof(float) * D);
    float *cs = malloc(sizeof(float) * (pos0 + n) * (half ? half : 1)), *sn = malloc(sizeof(float) * (pos0 + n) * (half ? half : 1));
    uint16_t *q = malloc(sizeof(uint16_t) * n * k->H * D);
    uint8_t *written = calloc(hc.block_bytes * hc.c.n_pool_blocks / 2, 1);
    double *v = malloc(sizeof(double) * D), *o = malloc(sizeof(double) * D);
    assert_true(qkv && bias && qn && kn && cs && sn && q && written && v && o);
    for (size_t i = 0; i < (size_t)n * S; i++) qkv[i] = 2.0f * rnd_normal();
    for (uint32_t i = 0; i < S; i++) bias[i] = 0.5f * rnd_normal();
    for (uint32_t i = 0; i < D; i++) {
        qn[i] = 1.0f + 0.3f * rnd_normal();
        kn[i] = 1.0f + 0.3f * rnd_normal();
    }
    for (uint32_t p = 0; p < pos0 + n; p++)
        for (uint32_t i = 0; i < half; i++) {
            double th = p * pow(10000.0, -2.0 * i / k->n_rot);
            cs[p * half + i] = (float)cos(th);
            sn[p * half + i] = (float)sin(th);
        }
    poison_bf16(q, (size_t)n * k->H * D);
    kvb_cuda_test_qkv_args a = {qkv, n, k->H, k->Hkv, D, k->n_rot, k->neox, k->bias ? bias : NULL,
                                k->norm ? qn : NULL, k->norm ? kn : NULL, eps, cs, sn, pos0, layer, q, hc.c};
    kvb_err err = {0};
    if (kvb_cuda_test_qkv_post(&a, &err)) fail_msg("%s", err.msg);
    char what[128];
    snprintf(what, sizeof what, "qkv H%u/%u D%u rot%u %s%s%s", k->H, k->Hkv, D, k->n_rot, k->neox ? "neox" : "pairs",
             k->bias ? " bias" : "", k->norm ? " norm" : "");
    for (uint32_t t = 0; t < n; t++) {
        const uint32_t pos = pos0 + t;
        for (uint32_t slot = 0; slot < k->H + 2 * k->Hkv; slot++) {
            const bool is_q = slot < k->H, is_k = !is_q && slot < k->H + k->Hkv;
            double mx = 0, ss = 0;
            for (uint32_t i = 0; i < D; i++) {
                v[i] = (double)qkv[(size_t)t * S + slot * D + i] + (k->bias ? bias[slot * D + i] : 0.0);
                ss += v[i] * v[i];
            }
            if (k->norm && (is_q || is_k)) {
                double r = 1.0 / sqrt(ss / D + eps);
                for (uint32_t i = 0; i < D; i++) v[i] = v[i] * r * (is_q ? qn[i] : kn[i]);
            }
            for (uint32_t i = 0; i < D; i++) {
                o[i] = v[i];
                if (fabs(v[i]) > mx) mx = fabs(v[i]);
            }
            if (is_q || is_k)
                for (uint32_t i = 0; i < half; i++) {
                    uint32_t i0 = k->neox ? i : 2 * i, i1 = k->neox ? i + half : 2 * i + 1;
                    double c = cs[pos * half + i], s = sn[pos * half + i];
                    o[i0] = v[i0] * c - v[i1] * s;
                    o[i1] = v[i0] * s + v[i1] * c;
                }
            const uint16_t *got;
            if (is_q) got = q + (size_t)t * k->H * D + slot * D;
            else {
                uint32_t kv = is_k ? 0 : 1, kvh = is_k ? slot - k->H : slot - k->H - k->Hkv;
                got = cache_row(&hc, layer, kv, kvh, pos);
                for (uint32_t i = 0; i < D; i++) written[(size_t)(got - (const uint16_t *)hc.c.pool) + i] = 1;
            }
            for (uint32_t i = 0; i < D; i++) check_close(bf(got[i]), o[i], 4.5e-3, 2e-5 * mx, what, (size_t)t * S + slot * D + i);
        }
    }
    /* nothing else in the cache was touched */
    const uint16_t *pool = (const uint16_t *)hc.c.pool;
    for (size_t i = 0; i < hc.block_bytes * hc.c.n_pool_blocks / 2; i++)
        if (!written[i] && pool[i] != BF16_NAN) fail_msg("%s: cache element %zu was written but belongs to no row of this chunk", what, i);
    free(qkv);
    free(bias);
    free(qn);
    free(kn);
    free(cs);
    free(sn);
    free(q);
    free(written);
    free(v);
    free(o);
    cache_free(&hc);
}

static void test_qkv_post(void **state) {
    (void)state;
    kvbt_require_gpu();
    const qkv_cfg cfgs[] = {
        {4, 2, 64, 64, false, false, false},  /* llama */
        {4, 2, 64, 64, true, true, false},    /* qwen2 */
        {4, 2, 64, 64, true, false, true},    /* qwen3 */
        {8, 2, 128, 128, false, false, false}, /* llama 8B head */
        {4, 1, 128, 64, false, true, true},   /* partial rotary, everything on */
        {4, 4, 32, 32, true, true, true},     /* small heads, no GQA */
        {2, 1, 16, 0, false, false, false},   /* no rotary at all */
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cfgs); i++) run_qkv_case(&cfgs[i]);
}

/* ---- attention ------------------------------------------------------------------------------- */

typedef struct {
    uint32_t D, H, Hkv, n, pos0, bt;
    int variant;
    uint32_t window; /* 0: plain causal; else a local layer's sliding window */
    float scale;     /* 0: 1/sqrt(D) */
} att_cfg;

/* Fails unless every row of out (n, H*D) bf16 is within rel-L2 1e-2 of the float64 attention of
 * q at positions pos0 .. pos0+n-1 over hc's layer (window W: keys k with p - k < W); the worst. */
static double att_check(const host_cache *hc, uint32_t layer, const uint16_t *q, const uint16_t *out, uint32_t n,
                        uint32_t pos0, uint32_t H, uint32_t Hkv, uint32_t D, uint32_t W, double scale,
                        const char *what) {
#define LO(p) (W && (p) + 1 > W ? (p) + 1 - W : 0u) /* the first key query p reads (the CPU engine's rule) */
    double *sc = malloc(sizeof(double) * (pos0 + n)), *ref = malloc(sizeof(double) * D);
    float *got = malloc(sizeof(float) * D);
    assert_true(sc && ref && got);
    double worst = 0;
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < H; h++) {
            const uint32_t p = pos0 + t, kvh = h / (H / Hkv);
            const uint16_t *qh = q + ((size_t)t * H + h) * D;
            double mx = -INFINITY, sum = 0;
            for (uint32_t j = LO(p); j <= p; j++) {
                const uint16_t *kr = cache_row(hc, layer, 0, kvh, j);
                double s = 0;
                for (uint32_t i = 0; i < D; i++) s += bf(qh[i]) * bf(kr[i]);
                sc[j] = s * scale;
                if (sc[j] > mx) mx = sc[j];
            }
            for (uint32_t i = 0; i < D; i++) ref[i] = 0;
            for (uint32_t j = LO(p); j <= p; j++) {
                double w = exp(sc[j] - mx);
                sum += w;
                const uint16_t *vr = cache_row(hc, layer, 1, kvh, j);
                for (uint32_t i = 0; i < D; i++) ref[i] += w * bf(vr[i]);
            }
            for (uint32_t i = 0; i < D; i++) {
                ref[i] /= sum;
                got[i] = (float)bf(out[((size_t)t * H + h) * D + i]);
            }
            double e = rel_l2_f(got, ref, D);
            if (!(e <= worst)) worst = e;
            if (!(e <= 1e-2)) fail_msg("%s: token %u head %u: rel-L2 %.3g > 1e-2", what, t, h, e);
        }
#undef LO
    free(sc);
    free(ref);
    free(got);
    return worst;
}

/* Random bf16 K/V rows of every layer for positions lo .. hi-1 */
static void cache_fill(host_cache *hc, uint32_t n_layer, uint32_t Hkv, uint32_t D, uint32_t lo, uint32_t hi) {
    for (uint32_t l = 0; l < n_layer; l++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t h = 0; h < Hkv; h++)
                for (uint32_t p = lo; p < hi; p++) {
                    uint16_t *r = cache_row(hc, l, kv, h, p);
                    for (uint32_t i = 0; i < D; i++) r[i] = to_bf(rnd_normal());
                }
}

/* probe: the implementation may refuse the shape (KVB_ERR_UNSUPPORTED): said, not failed. */
static void run_att_case_probe(const att_cfg *k, bool probe) {
    const uint32_t n_layer = 2, layer = 1, D = k->D, pos0 = k->pos0, H = k->H, Hkv = k->Hkv, W = k->window;
    uint32_t n = k->n;
    const double scale = k->scale > 0 ? k->scale : 1.0 / sqrt((double)D);
    host_cache hc;
    cache_make(&hc, n_layer, Hkv, D, k->bt, pos0 + n);
    /* rows before the window of the first query stay NaN: no query may read them */
    cache_fill(&hc, n_layer, Hkv, D, W && pos0 + 1 > W ? pos0 + 1 - W : 0u, pos0 + n);
    uint16_t *q = malloc(sizeof(uint16_t) * n * H * D), *out = malloc(sizeof(uint16_t) * n * H * D);
    assert_true(q && out);
    for (size_t i = 0; i < (size_t)n * H * D; i++) q[i] = to_bf(1.5f * rnd_normal());
    poison_bf16(out, (size_t)n * H * D);
    kvb_err err = {0};
    kvb_status ast = kvb_cuda_test_attention(q, n, H, pos0, layer, W, k->scale, &hc.c, k->variant, out, &err);
    if (ast == KVB_ERR_UNSUPPORTED && probe) {
        print_message("attention D%u H%u/%u variant %d: refused here (%s); the engine keeps its own kernel for it\n", D,
                      H, Hkv, k->variant, err.msg);
        n = 0; /* nothing to compare */
    } else if (ast) {
        fail_msg("%s", err.msg);
    }
    if (n) {
        char what[160];
        snprintf(what, sizeof what, "attention D%u H%u/%u n%u pos0 %u bt%u variant %d window %u", D, H, Hkv, n, pos0,
                 k->bt, k->variant, W);
        const double worst = att_check(&hc, layer, q, out, n, pos0, H, Hkv, D, W, scale, what);
        print_message("%s scale %.4g: worst row rel-L2 %.3g\n", what, scale, worst);
    }
    free(q);
    free(out);
    cache_free(&hc);
}

static void run_att_case(const att_cfg *k) { run_att_case_probe(k, false); }

static void test_attention(void **state) {
    (void)state;
    kvbt_require_gpu();
    const att_cfg cfgs[] = {
        {128, 8, 2, 130, 77, 16, 0, 0, 0},  {128, 8, 2, 1, 300, 64, 0, 0, 0},  {64, 8, 8, 50, 0, 64, 0, 0, 0},
        {64, 4, 1, 200, 33, 32, 0, 0, 0},   {128, 4, 4, 64, 0, 16, 0, 0, 0},   {128, 4, 1, 300, 1000, 64, 0, 0, 0},
        {32, 8, 2, 40, 20, 16, 0, 0, 0},    {80, 4, 2, 30, 10, 16, 1, 0, 0},   {128, 8, 2, 70, 45, 16, 1, 0, 0},
        {64, 2, 1, 129, 63, 1024, 0, 0, 0}, {128, 8, 2, 130, 77, 16, 2, 0, 0}, {64, 4, 1, 200, 33, 32, 2, 0, 0},
        {128, 4, 1, 300, 1000, 64, 3, 0, 0}, {64, 8, 8, 257, 0, 64, 3, 0, 0}, {128, 4, 2, 1, 0, 16, 3, 0, 0},
        /* DeepSeek's latent attention expanded: keys of 128 + 64, one kv head per query head */
        {192, 16, 16, 130, 77, 16, 0, 0, 0.05f}, {192, 4, 4, 300, 1000, 64, 2, 0, 0},
        {192, 8, 8, 257, 0, 64, 3, 0, 0},        {192, 4, 4, 70, 45, 16, 1, 0, 0},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cfgs); i++) run_att_case(&cfgs[i]);
}

/* Local (sliding-window) layers, other scales, and Gemma 3 270M's head size 256 (generic kernel) */
static void test_attention_window(void **state) {
    (void)state;
    kvbt_require_gpu();
    const att_cfg cfgs[] = {
        {64, 4, 1, 200, 33, 32, 0, 16, 0},        /* tiny-gemma3's shape: window 16, 128 rows per CTA */
        {64, 4, 1, 200, 33, 32, 2, 16, 0},        /* ... 64 rows per CTA */
        {64, 4, 1, 100, 0, 16, 1, 16, 0},         /* ... the generic kernel, from position 0 */
        {128, 8, 2, 130, 300, 16, 3, 100, 0.05f}, /* a window that is no multiple of the 64-key tile, prefix past it */
        {128, 8, 2, 130, 300, 16, 2, 100, 0.05f},
        {128, 8, 2, 1, 1000, 64, 0, 512, 0},      /* one-token decode step */
        {64, 8, 8, 257, 0, 64, 3, 64, 0},         /* window == tile */
        {128, 4, 1, 70, 10, 16, 0, 1, 0},         /* window 1: each query reads only itself */
        {64, 2, 1, 50, 5, 16, 0, 4096, 0},        /* window past every position: plain causal */
        {80, 4, 2, 60, 90, 16, 0, 33, 0},         /* generic kernel, odd head size */
        {256, 4, 1, 40, 530, 16, 0, 512, 0.0625f}, /* Gemma 3 270M local layer (D 256: generic kernel) */
        {256, 4, 1, 37, 20, 16, 0, 0, 0.0625f},   /* ... its global layer */
        {256, 4, 1, 1, 700, 64, 0, 512, 0.0625f}, /* ... a decode step past the window */
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cfgs); i++) run_att_case(&cfgs[i]);
}

/* cuDNN's fused attention (variant 4: the K/V gather, then cuDNN's graph), against the same
 * float64 reference and limit as our kernels. cuDNN is required here: the test runs where the
 * GPU tests run, and the engine's default depends on it. Shapes: prefixes (bottom-right causal
 * mask), GQA, one query, odd lengths, Llama-3.1-8B's and Llama-3.2-1B's heads. */
static void test_attention_cudnn(void **state) {
    (void)state;
    kvbt_require_gpu();
    const att_cfg cfgs[] = {
        {128, 8, 2, 130, 77, 16, 4, 0, 0},    {128, 8, 2, 1, 300, 64, 4, 0, 0},  {64, 8, 8, 50, 0, 64, 4, 0, 0},
        {64, 4, 1, 200, 33, 32, 4, 0, 0},     {128, 4, 1, 300, 1000, 64, 4, 0, 0}, {128, 32, 8, 256, 1100, 64, 4, 0, 0},
        {64, 32, 8, 257, 700, 64, 4, 0, 0.05f}, {128, 4, 4, 64, 0, 16, 4, 0, 0},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cfgs); i++) run_att_case(&cfgs[i]);
    /* Gemma 3's head size (4/1 heads x 256): the engine's auto choice keeps our kernel for it; this
     * says whether this host's cuDNN takes it, and checks it when it does */
    const att_cfg d256 = {256, 4, 1, 200, 300, 32, 4, 0, 0};
    run_att_case_probe(&d256, true);
}

/* Which chunks cuDNN takes (kvb_cudnn_attn_take, as the engine asks once per chunk): a new
 * small shape goes to the engine's kernel, the same shape again to cuDNN (its plan then built),
 * a chunk with attention work past KVB_CUDNN_EAGER_FLOPS at first sight; with
 * KVB_CUDNN_PLANS=eager, every chunk. Each call's output checked against the float64 reference,
 * whichever kernel ran it; plans built only for the chunks taken. */
static void test_attention_cudnn_take(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t D = 128, H = 8, Hkv = 2, layer = 1, n_layer = 2, max_q = 512, max_kv = 4096;
    /* (n, pos0, layers the caller has): a conversation turn, the same turn twice more, another
     * turn, a long chunk that pays its plan at once (4 x 8 x 128 x 512 x 3840.5 x 4000 = 3.2e13
     * flops), one query */
    const uint32_t calls[][3] = {{100, 100, 1},  {100, 100, 1},     {100, 100, 1},
                                 {120, 130, 1},  {512, 3584, 4000}, {1, 2047, 1}};
    const bool deferred[] = {false, true, true, false, true, false};
    const uint32_t nc = KVB_ARRAY_LEN(calls);
    host_cache hc;
    cache_make(&hc, n_layer, Hkv, D, 64, max_kv);
    cache_fill(&hc, n_layer, Hkv, D, 0, max_kv);
    uint32_t n[KVB_ARRAY_LEN(calls)], pos0[KVB_ARRAY_LEN(calls)], layers[KVB_ARRAY_LEN(calls)];
    uint16_t *q[KVB_ARRAY_LEN(calls)], *out[KVB_ARRAY_LEN(calls)];
    for (uint32_t i = 0; i < nc; i++) {
        n[i] = calls[i][0];
        pos0[i] = calls[i][1];
        layers[i] = calls[i][2];
        q[i] = malloc(sizeof(uint16_t) * n[i] * H * D);
        out[i] = malloc(sizeof(uint16_t) * n[i] * H * D);
        assert_true(q[i] && out[i]);
        for (size_t j = 0; j < (size_t)n[i] * H * D; j++) q[i][j] = to_bf(1.5f * rnd_normal());
    }
    const double scale = 1.0 / sqrt((double)D);
    for (int eager = 0; eager < 2; eager++) {
        if (eager) setenv("KVB_CUDNN_PLANS", "eager", 1);
        for (uint32_t i = 0; i < nc; i++) poison_bf16(out[i], (size_t)n[i] * H * D);
        bool took[KVB_ARRAY_LEN(calls)];
        uint32_t plans = 0;
        kvb_err err = {0};
        if (kvb_cuda_test_cudnn_sequence(&hc.c, layer, H, max_q, max_kv, nc, n, pos0, layers,
                                         (const uint16_t *const *)q, out, took, &plans, &err))
            fail_msg("%s", err.msg);
        for (uint32_t i = 0; i < nc; i++) {
            char what[128];
            snprintf(what, sizeof what, "%s plans, call %u: %u queries at %u, on %s", eager ? "eager" : "deferred", i,
                     n[i], pos0[i], took[i] ? "cuDNN" : "the engine's kernel");
            att_check(&hc, layer, q[i], out[i], n[i], pos0[i], H, Hkv, D, 0, scale, what);
            if (took[i] != (eager || deferred[i])) fail_msg("%s: the other kernel was expected", what);
        }
        print_message("%s plans: %u calls, %u plans built, every output within 1e-2\n", eager ? "eager" : "deferred", nc,
                      plans);
        assert_int_equal(plans, eager ? 4u : 2u); /* distinct shapes taken */
    }
    unsetenv("KVB_CUDNN_PLANS");
    for (uint32_t i = 0; i < nc; i++) {
        free(q[i]);
        free(out[i]);
    }
    cache_free(&hc);
}

/* The gather that feeds cuDNN: every row bit-exact, from a table of scattered blocks */
static void test_gather_kv(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t shapes[][4] = {{8, 128, 64, 1000}, {2, 64, 16, 77}, {4, 256, 32, 33}, {8, 64, 1024, 1500}};
    for (size_t si = 0; si < KVB_ARRAY_LEN(shapes); si++) {
        const uint32_t Hkv = shapes[si][0], D = shapes[si][1], bt = shapes[si][2], n_pos = shapes[si][3], layer = 1;
        host_cache hc;
        cache_make(&hc, 3, Hkv, D, bt, n_pos);
        for (uint32_t l = 0; l < 3; l++)
            for (uint32_t kv = 0; kv < 2; kv++)
                for (uint32_t h = 0; h < Hkv; h++)
                    for (uint32_t p = 0; p < n_pos; p++) {
                        uint16_t *r = cache_row(&hc, l, kv, h, p);
                        for (uint32_t i = 0; i < D; i++) r[i] = to_bf(rnd_normal());
                    }
        const size_t nb = (size_t)Hkv * n_pos * D;
        uint16_t *k = malloc(nb * 2), *v = malloc(nb * 2);
        assert_true(k && v);
        poison_bf16(k, nb);
        poison_bf16(v, nb);
        kvb_err err = {0};
        if (kvb_cuda_test_gather_kv(&hc.c, layer, n_pos, k, v, &err)) fail_msg("%s", err.msg);
        for (uint32_t h = 0; h < Hkv; h++)
            for (uint32_t p = 0; p < n_pos; p++)
                if (memcmp(k + ((size_t)h * n_pos + p) * D, cache_row(&hc, layer, 0, h, p), D * 2) ||
                    memcmp(v + ((size_t)h * n_pos + p) * D, cache_row(&hc, layer, 1, h, p), D * 2))
                    fail_msg("gather Hkv %u D %u bt %u: head %u position %u differs", Hkv, D, bt, h, p);
        print_message("gather Hkv %u D %u bt %u positions %u: bit-exact\n", Hkv, D, bt, n_pos);
        free(k);
        free(v);
        cache_free(&hc);
    }
}

/* Values whose sums round differently in another order: magnitudes 2^-20 .. 2^20, both signs, a
 * few zeros of each sign and subnormals. */
static float rnd_wide(void) {
    const uint64_t k = kvb_rng_u64(&g_rng) % 64;
    if (k == 0) return 0.0f;
    if (k == 1) return -0.0f;
    if (k == 2) return ldexpf(rnd_normal(), -130); /* subnormal */
    return ldexpf(rnd_normal(), (int)(kvb_rng_u64(&g_rng) % 41) - 20);
}

/* The tensor-parallel all-reduce's sum: out = ((in[0] + in[1]) + in[2]) ..., bit for bit */
static void test_sum_f32(void **state) {
    (void)state;
    kvbt_require_gpu();
    const int ns[] = {1, 2, 3, 5, 8};
    const size_t counts[] = {1, 7, 4096, 1001, 65539, 262144};
    for (size_t ni = 0; ni < KVB_ARRAY_LEN(ns); ni++)
        for (size_t ci = 0; ci < KVB_ARRAY_LEN(counts); ci++) {
            const int n = ns[ni];
            const size_t count = counts[ci];
            /* all aligned; out off; the last input off (the others aligned); a random mix */
            const size_t mis[] = {0, (size_t)1 << 8, (size_t)1 << (n - 1), (size_t)(kvb_rng_u64(&g_rng) & 0x1ff)};
            float *in[8], *out = malloc(sizeof(float) * count), *want = malloc(sizeof(float) * count);
            assert_true(out && want);
            for (int i = 0; i < n; i++) {
                in[i] = malloc(sizeof(float) * count);
                assert_non_null(in[i]);
            }
            for (size_t mi = 0; mi < KVB_ARRAY_LEN(mis); mi++) {
                for (int i = 0; i < n; i++)
                    for (size_t j = 0; j < count; j++) in[i][j] = rnd_wide();
                for (size_t j = 0; j < count; j++) {
                    float acc = in[0][j];
                    for (int i = 1; i < n; i++) acc = acc + in[i][j]; /* one rounded f32 add each */
                    want[j] = acc;
                }
                poison_f32(out, count);
                kvb_err err = {0};
                if (kvb_cuda_test_sum_f32((const float *const *)in, n, count, mis[mi], out, &err))
                    fail_msg("%s", err.msg);
                if (memcmp(out, want, sizeof(float) * count) != 0)
                    for (size_t j = 0; j < count; j++)
                        if (memcmp(&out[j], &want[j], sizeof(float)) != 0)
                            fail_msg("sum of %d, count %zu, misalign 0x%zx: out[%zu] = %a, want %a", n, count, mis[mi],
                                     j, (double)out[j], (double)want[j]);
            }
            print_message("sum of %d buffers, count %zu: bit-exact (misalign 0, 0x100, 0x%zx, 0x%zx)\n", n, count,
                          mis[2], mis[3]);
            for (int i = 0; i < n; i++) free(in[i]);
            free(out);
            free(want);
        }
}

/* Packed weights: the device's expansion of every packable type == the CPU's conversion at load
 * (kvb_row_to_f32, then kvb_f32_to_bf16), bit for bit, on random bytes (every bit pattern is a
 * valid block), with NaN, infinite, subnormal and zero scales planted. */
static void test_expand_bf16(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t types[] = {KVB_TYPE_F32,  KVB_TYPE_F16,  KVB_TYPE_BF16, KVB_TYPE_Q8_0, KVB_TYPE_Q4_0,
                              KVB_TYPE_Q5_0, KVB_TYPE_Q4_K, KVB_TYPE_Q5_K, KVB_TYPE_Q6_K};
    const uint16_t odd_scales[] = {0x7e01, 0xfc00, 0x7c00, 0x0001, 0x8000, 0x0000, 0x7bff, 0x03ff};
    const uint32_t rows = 37, cols = 768;
    float *tmp = malloc(sizeof(float) * cols);
    uint16_t *want = malloc(sizeof(uint16_t) * rows * cols), *got = malloc(sizeof(uint16_t) * rows * cols);
    assert_true(tmp && want && got);
    for (size_t ti = 0; ti < KVB_ARRAY_LEN(types); ti++) {
        const uint32_t type = types[ti];
        const kvb_type_info *info = kvb_type_get(type);
        const size_t rb = kvb_row_bytes(type, cols);
        uint8_t *src = malloc(rows * rb);
        assert_non_null(src);
        for (size_t i = 0; i < rows * rb; i++) src[i] = (uint8_t)kvb_rng_u64(&g_rng);
        if (info->block_elems > 1) { /* the scale fields: d first, except Q6_K's (last two bytes) */
            const size_t nb = rows * rb / (size_t)info->block_bytes;
            const size_t off = type == KVB_TYPE_Q6_K ? offsetof(kvb_block_q6_k, d) : 0;
            for (size_t k = 0; k < KVB_ARRAY_LEN(odd_scales); k++) {
                const size_t blk = (size_t)(kvb_rng_u64(&g_rng) % nb);
                memcpy(src + blk * (size_t)info->block_bytes + off, &odd_scales[k], 2);
            }
        }
        for (uint32_t r = 0; r < rows; r++) {
            kvb_row_to_f32(type, src + r * rb, tmp, cols);
            for (uint32_t c = 0; c < cols; c++) want[(size_t)r * cols + c] = to_bf(tmp[c]);
        }
        poison_bf16(got, (size_t)rows * cols);
        kvb_err err = {0};
        if (kvb_cuda_test_expand_bf16(type, src, rb, rows, cols, got, &err)) fail_msg("%s", err.msg);
        for (size_t i = 0; i < (size_t)rows * cols; i++)
            if (got[i] != want[i])
                fail_msg("expand %s: element (%zu, %zu) = 0x%04x, the CPU's conversion 0x%04x", info->name, i / cols,
                         i % cols, got[i], want[i]);
        print_message("expand %s: %u x %u bit-exact\n", info->name, rows, cols);
        free(src);
    }
    /* a row length that is not whole 32-element units is refused, not half done */
    uint8_t blk[68] = {0};
    kvb_err err = {0};
    assert_int_not_equal(kvb_cuda_test_expand_bf16(KVB_TYPE_F16, blk, sizeof blk, 1, 34, got, &err), KVB_OK);
    free(tmp);
    free(want);
    free(got);
}

int main(void) {
    const char *s = getenv("KVB_TEST_SEED");
    g_seed = s ? strtoull(s, NULL, 0) : ((uint64_t)time(NULL) ^ ((uint64_t)clock() << 32));
    printf("test_cuda_kernels: seed %llu (KVB_TEST_SEED=%llu repeats this run)\n", (unsigned long long)g_seed,
           (unsigned long long)g_seed);
    kvb_rng_seed(&g_rng, g_seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embed),    cmocka_unit_test(test_rmsnorm),   cmocka_unit_test(test_rmsnorm_add),
        cmocka_unit_test(test_glu),      cmocka_unit_test(test_gemm),      cmocka_unit_test(test_qkv_post),
        cmocka_unit_test(test_attention), cmocka_unit_test(test_attention_window),
        cmocka_unit_test(test_attention_cudnn), cmocka_unit_test(test_attention_cudnn_take),
        cmocka_unit_test(test_gather_kv), cmocka_unit_test(test_sum_f32),
        cmocka_unit_test(test_expand_bf16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#else /* built without CUDA */

#include "kvbt.h"

static void test_no_cuda(void **state) {
    (void)state;
    kvbt_require_gpu(); /* skips, saying why: this build has no CUDA engine */
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_no_cuda)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif
