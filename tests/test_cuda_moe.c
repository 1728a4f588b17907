/* test_cuda_moe — the CUDA engine's mixture-of-experts MLP (qwen3moe, deepseek2) and DeepSeek's
 * latent attention against CPU twins, on fresh random inputs each run (seed printed; KVB_TEST_SEED
 * repeats one), outputs poisoned before each launch so an element a kernel forgets to write fails:
 *  - moe_math.h's exp against exp() in double over [-87, 0] (host only: runs without a GPU too);
 *  - the router kernel (softmax, top-k, renormalisation) == its twin, bit for bit: probabilities,
 *    experts and weights, with rows holding exact ties (the lower expert index wins);
 *  - the permutation and gather == the CPU engine's counting sort (offsets, slots in slot order,
 *    each slot's position) and the gathered rows, bit for bit, with empty experts;
 *  - the weighted un-permute (f32 and bf16 expert outputs) == the same f32 products and sums in
 *    rank order on the host, bit for bit;
 *  - the whole MoE MLP, expert GEMMs looped per expert and grouped: routing equal to the twin's
 *    wherever the twin's top-k margin exceeds 1e-4 (router logits computed in f32 by cuBLAS and in
 *    double by the twin differ by ~1e-6), and the MLP's output within relative L2 3e-3 of a twin
 *    in double with the GPU's bf16 roundings (gate|up out, SwiGLU out; the grouped path's expert
 *    outputs too) on the GPU's routing: the GPU accumulates in f32 (~1e-6 relative over E = 256
 *    terms), which moves a bf16 rounding of gate|up or SwiGLU by one ulp (2^-8) only for the few
 *    elements within 1e-6 of a rounding boundary; measured values are printed;
 *  - end to end on tiny-moe (bf16 weights, 77 tokens): CUDA logits vs the CPU engine's (F32 cache)
 *    within TOL_CPU 2e-2, the dense presets' limit in test_cuda_engine (the same bf16 roundings of
 *    GEMM operands, q/K/V and P, plus the router's input rounded to bf16), with both GEMM paths;
 *    a token whose float64 reference routing margin (ref_model_forward_gaps) is under twice the
 *    tolerance (MOE_CLOSE_GAP) may take another expert on the GPU than on the CPU (a discontinuity no tolerance
 *    covers), so it is left out and counted, and the tokens after it are held to tol + 5e-2, as
 *    test_engine_vs_ref does for the CPU engine; at least half the tokens are checked. Chunked (7)
 *    vs one-shot on the GPU: 2e-3 (TOL_GPU_GPU of test_cuda_engine). Packed weights (Q8_0 and Q4_K
 *    files, the experts expanded before each layer) == bf16 weights bit for bit;
 *  - DeepSeek's routing (test_route_deepseek): sigmoid with the selection bias in groups (tiny-mla's and
 *    DeepSeek-V3's shapes), softmax without (V2-Lite's): the kernel == moe_math.h's twin bit for bit,
 *    and (host only: test_route_deepseek_twin runs without a GPU too) the twin against the float64
 *    reference's routing (ref_route_deepseek): the same set of experts (two whose f32 scores tie may
 *    swap ranks) wherever the double scores' margins (top-k boundary, kept-group boundary) exceed
 *    1e-5, weights within 1e-5 relative (the twin's exp is within 3 ulp; a softmax's f32 sum over 64 terms may
 *    lose up to 64 half-ulps, 3.8e-6; then a division, the renormalising sum and division, the scale);
 *  - the latent attention's kernels (test_mla_kernels): the cache row store (normed latent as given,
 *    rope part rotated in pairs with the engine's products), the queries' rope, the gather of latent
 *    rows and the assembly of per-head K [k_nope, k_pe] and V [v, zeros] == twins bit for bit;
 *  - one latent attention layer as the engine runs it (test_mla_layer: its weights' bf16 layout, the
 *    cache rows, queries, expansion, attention, W_o): the cache rows within TOL_MLA_ROWS of the CPU
 *    engine's kvb_kv_produce (bf16 cache; both sides round the same f32 values once), the output within
 *    TOL_MLA_LAYER of a float64 twin on the GPU's own rows that rounds to bf16 where the GPU does
 *    (what remains: P in bf16 and f32 accumulation, as test_cuda_kernels' attention limit), chunks of 7
 *    vs one shot within TOL_GPU_GPU;
 *  - end to end on tiny-mla (test_tiny_mla_engine: deepseek2 with q_lora, a leading dense layer, 8
 *    experts top-2 in 4 groups, sigmoid, bias, a shared expert, YaRN): CUDA logits vs the CPU engine's
 *    (F32 cache) within TOL_CPU rel-L2 per token (the dense presets' limit: the GPU rounds to bf16 the
 *    GEMM operands, the latent cache row, the queries and the expanded K and V, as the dense path
 *    rounds q, K, V and P), a max-abs difference within 4 x TOL_CPU x the token's logit RMS, and the
 *    top-1 equal wherever the CPU's top-2 margin exceeds twice that bound; tokens whose float64
 *    routing margin is under MOE_CLOSE_GAP x the tolerance are left out and those after one held to
 *    tol + MOE_FLIP_SPILL, as for tiny-moe, but the margin is not raised with the tolerance after a
 *    close token: tiny-mla's 4-group sigmoid router has about 15 of 77 tokens under 0.04 and 40 under
 *    the raised 0.14 (float64 reference, 5 seeds), while the GPU moves a router logit by ~0.01 at
 *    most. Chunked (7) vs one-shot on the GPU: TOL_GPU_GPU, margins under MOE_GPU_GAP left out;
 *  - with KVB_CUDA_TEST_MOE_MODELS (its own ctest entry, needs_gpu_models): real shapes against the
 *    CPU engine (test_moe_real_shapes says what is held and why; qwen3moe and deepseek2 files).
 * Without a CUDA device the GPU tests skip with "no CUDA device". */
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
#include "kvb_engine_cpu.h"
#include "kvb_engine_cuda.h"
#include "kvb_model.h"
#include "kvbt.h"
#include "moe_math.h"
#include "ref_model.h"

#define TOL_FFN 3e-3
#define TOL_CPU 2e-2
#define TOL_GPU_GPU 2e-3
#define MOE_FLIP_SPILL 5e-2
/* router-logit margin per unit of logit tolerance under which a token may route differently: the
 * GPU's router input is rounded to bf16 (2^-9 relative) after a residual stream that differs by
 * ~0.3 % from the CPU engine's; with tiny-moe's router logits of std ~2 that moves a logit by
 * ~0.01, half of 2 x TOL_CPU */
#define MOE_CLOSE_GAP 2.0
#define MOE_GPU_GAP 2e-2 /* chunked vs one-shot: attention tiles differ, so the same margin as above */
#define BF16_NAN 0xFFC1u

static uint64_t g_seed;
static kvb_rng g_rng;

static float rnd_normal(void) { return kvb_rng_normal(&g_rng); }
static uint16_t to_bf(float f) { return kvb_f32_to_bf16(f); }
static float bf(uint16_t h) { return kvb_bf16_to_f32(h); }

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

static void test_expf(void **state) {
    (void)state;
    double worst = 0;
    for (int i = 0; i <= 200000; i++) {
        const float x = -87.0f * (float)i / 200000.0f;
        const double ref = exp((double)x), got = kvb_moe_expf(x);
        const double rel = fabs(got - ref) / ref;
        if (rel > worst) worst = rel;
    }
    assert_true(kvb_moe_expf(0.0f) == 1.0f);
    assert_true(kvb_moe_expf(-100.0f) == 0.0f);
    print_message("kvb_moe_expf: worst relative error %.3g over [-87, 0] (limit 3 ulp = 3.6e-7)\n", worst);
    assert_true(worst <= 3.6e-7);
}

/* Router rows: normal logits times 2; every fifth row with its values copied in pairs (ties). */
static void test_route(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t shapes[][3] = {{8, 2, 1}, {128, 8, 1}, {16, 4, 0}, {5, 5, 1}};
    for (size_t c = 0; c < KVB_ARRAY_LEN(shapes); c++) {
        const uint32_t X = shapes[c][0], K = shapes[c][1], n = 301;
        const bool norm = shapes[c][2];
        float *lg = xmalloc(sizeof(float) * n * X), *p = xmalloc(sizeof(float) * n * X);
        float *w = xmalloc(sizeof(float) * n * K), *rw = xmalloc(sizeof(float) * n * K);
        int32_t *sel = xmalloc(sizeof(int32_t) * n * K), *rsel = xmalloc(sizeof(int32_t) * n * K);
        for (uint32_t t = 0; t < n; t++)
            for (uint32_t x = 0; x < X; x++)
                lg[t * X + x] = t % 5 == 0 && x % 2 ? lg[t * X + x - 1] : 2.0f * rnd_normal();
        memcpy(p, lg, sizeof(float) * n * X);
        memset(sel, 0xFF, sizeof(int32_t) * n * K);
        memset(w, 0xFF, sizeof(float) * n * K);
        kvb_err err = {0};
        if (kvb_cuda_test_moe_route(p, n, X, K, norm, sel, w, &err)) fail_msg("%s", err.msg);
        for (uint32_t t = 0; t < n; t++) {
            kvb_moe_route_one(lg + (size_t)t * X, (int)X, (int)K, norm, rsel + (size_t)t * K, rw + (size_t)t * K);
            for (uint32_t k = 1; k < K; k++) /* the twin's own order, spelled out */
                assert_true(lg[t * X + rsel[t * K + k - 1]] > lg[t * X + rsel[t * K + k]] ||
                            (lg[t * X + rsel[t * K + k - 1]] == lg[t * X + rsel[t * K + k]] &&
                             rsel[t * K + k - 1] < rsel[t * K + k]));
        }
        if (memcmp(p, lg, sizeof(float) * n * X)) fail_msg("X %u K %u: probabilities differ from the twin", X, K);
        if (memcmp(sel, rsel, sizeof(int32_t) * n * K)) fail_msg("X %u K %u: experts differ from the twin", X, K);
        if (memcmp(w, rw, sizeof(float) * n * K)) fail_msg("X %u K %u: weights differ from the twin", X, K);
        print_message("router X %u top-%u%s: %u tokens bit for bit\n", X, K, norm ? " renormalised" : "", n);
        free(lg), free(p), free(w), free(rw), free(sel), free(rsel);
    }
}

/* K distinct experts per token drawn from the first X - 2 (the last two stay empty). */
static void random_routing(int32_t *sel, uint32_t n, uint32_t K, uint32_t X) {
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t k = 0; k < K; k++) {
            int32_t x;
            bool dup;
            do {
                x = (int32_t)(kvb_rng_u64(&g_rng) % (X - 2));
                dup = false;
                for (uint32_t i = 0; i < k; i++) dup |= sel[t * K + i] == x;
            } while (dup);
            sel[t * K + k] = x;
        }
}

static void test_permute(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t n = 517, K = 4, X = 12, E = 40, S = n * K;
    int32_t *sel = xmalloc(4 * S), *off = xmalloc(4 * (X + 1)), *slot = xmalloc(4 * S), *inv = xmalloc(4 * S);
    int32_t *roff = xmalloc(4 * (X + 2)), *rslot = xmalloc(4 * S), *fill = xmalloc(4 * (X + 1));
    uint16_t *h = xmalloc(2 * (size_t)n * E), *xp = xmalloc(2 * (size_t)S * E);
    random_routing(sel, n, K, X);
    for (size_t i = 0; i < (size_t)n * E; i++) h[i] = to_bf(rnd_normal());
    memset(off, 0xFF, 4 * (X + 1)), memset(slot, 0xFF, 4 * S), memset(inv, 0xFF, 4 * S);
    for (size_t i = 0; i < (size_t)S * E; i++) xp[i] = BF16_NAN;
    kvb_err err = {0};
    if (kvb_cuda_test_moe_permute(sel, n, K, X, h, E, off, slot, inv, xp, &err)) fail_msg("%s", err.msg);
    /* the CPU engine's counting sort (engine/cpu/moe.c) */
    memset(roff, 0, 4 * (X + 2));
    for (uint32_t s = 0; s < S; s++) roff[sel[s] + 1]++;
    for (uint32_t x = 0; x < X; x++) roff[x + 1] += roff[x];
    memcpy(fill, roff, 4 * (X + 1));
    for (uint32_t s = 0; s < S; s++) rslot[fill[sel[s]]++] = (int32_t)s;
    if (memcmp(off, roff, 4 * (X + 1))) fail_msg("expert offsets differ from the counting sort");
    assert_int_equal(off[X - 1], off[X]); /* an empty expert */
    for (uint32_t p = 0; p < S; p++) {
        if (slot[p] != rslot[p]) fail_msg("position %u: slot %d, counting sort %d", p, slot[p], rslot[p]);
        if (inv[slot[p]] != (int32_t)p) fail_msg("slot %d: inverse %d, expected %u", slot[p], inv[slot[p]], p);
        if (memcmp(xp + (size_t)p * E, h + (size_t)(slot[p] / K) * E, 2 * E))
            fail_msg("gathered row %u is not token %d's", p, slot[p] / (int)K);
    }
    print_message("permutation: %u slots over %u experts, gather of %u-wide rows, bit for bit\n", S, X, E);
    free(sel), free(off), free(slot), free(inv), free(roff), free(rslot), free(fill), free(h), free(xp);
}

/* A random permutation of 0 .. n-1 (Fisher-Yates). */
static void random_perm(int32_t *p, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) p[i] = (int32_t)i;
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = (uint32_t)(kvb_rng_u64(&g_rng) % i);
        int32_t t = p[i - 1];
        p[i - 1] = p[j], p[j] = t;
    }
}

static void test_unpermute(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t n = 333, K = 8, E = 72, S = n * K;
    int32_t *inv = xmalloc(4 * S);
    float *w = xmalloc(4 * S), *y = xmalloc(4 * (size_t)S * E), *x0 = xmalloc(4 * (size_t)n * E);
    float *x = xmalloc(4 * (size_t)n * E), *rx = xmalloc(4 * (size_t)n * E);
    uint16_t *yb = xmalloc(2 * (size_t)S * E);
    random_perm(inv, S);
    for (uint32_t i = 0; i < S; i++) w[i] = fabsf(rnd_normal()) / (float)K;
    for (size_t i = 0; i < (size_t)S * E; i++) y[i] = rnd_normal(), yb[i] = to_bf(y[i]);
    for (size_t i = 0; i < (size_t)n * E; i++) x0[i] = 4.0f * rnd_normal();
    for (int b = 0; b < 2; b++) {
        memcpy(x, x0, 4 * (size_t)n * E);
        kvb_err err = {0};
        if (kvb_cuda_test_moe_unpermute(b ? (const void *)yb : (const void *)y, b, inv, w, n, K, E, x, &err))
            fail_msg("%s", err.msg);
        for (uint32_t t = 0; t < n; t++)
            for (uint32_t i = 0; i < E; i++) {
                float acc = 0.0f;
                for (uint32_t k = 0; k < K; k++) {
                    const size_t at = (size_t)inv[t * K + k] * E + i;
                    const float v = w[t * K + k] * (b ? bf(yb[at]) : y[at]);
                    acc = k ? acc + v : v;
                }
                rx[(size_t)t * E + i] = x0[(size_t)t * E + i] + acc;
            }
        if (memcmp(x, rx, 4 * (size_t)n * E)) fail_msg("un-permute (%s outputs) differs from its twin", b ? "bf16" : "f32");
        print_message("un-permute, %s expert outputs: %u tokens x top-%u bit for bit\n", b ? "bf16" : "f32", n, K);
    }
    free(inv), free(w), free(y), free(x0), free(x), free(rx), free(yb);
}

/* The twin of the MLP on the GPU's routing: x += sum_k w_k down_k(bf16(silu(g) u)), g|u = bf16(gu_k h),
 * in double; the expert output rounded to bf16 when y_bf16 (the grouped path). */
static void ffn_twin(const kvb_cuda_test_moe_w *mw, const uint16_t *h, uint32_t n, const int32_t *sel, const float *wts,
                     bool y_bf16, double *out) {
    const uint32_t K = mw->K, F = mw->F, E = mw->E;
    double *gu = xmalloc(sizeof(double) * 2 * F), *y = xmalloc(sizeof(double) * E);
    float *act = xmalloc(sizeof(float) * F);
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t k = 0; k < K; k++) {
            const uint32_t x = (uint32_t)sel[t * K + k];
            for (uint32_t r = 0; r < 2 * F; r++) {
                double acc = 0;
                for (uint32_t c = 0; c < E; c++)
                    acc += (double)bf(mw->gu[((size_t)x * 2 * F + r) * E + c]) * bf(h[(size_t)t * E + c]);
                gu[r] = bf(to_bf((float)acc));
            }
            for (uint32_t i = 0; i < F; i++)
                act[i] = bf(to_bf((float)(gu[i] / (1.0 + exp(-gu[i])) * gu[F + i])));
            for (uint32_t r = 0; r < E; r++) {
                double acc = 0;
                for (uint32_t c = 0; c < F; c++) acc += (double)bf(mw->down[((size_t)x * E + r) * F + c]) * act[c];
                y[r] = y_bf16 ? bf(to_bf((float)acc)) : (double)(float)acc;
            }
            for (uint32_t i = 0; i < E; i++) out[(size_t)t * E + i] += (double)wts[t * K + k] * y[i];
        }
    free(gu), free(y), free(act);
}

/* The twin's router on the same bf16 inputs: logits in double rounded to f32, then moe_math.h; its
 * margin (k-th minus (k+1)-th probability) per token into gap. */
static void route_twin(const kvb_cuda_test_moe_w *mw, const uint16_t *h, uint32_t n, int32_t *sel, float *wts,
                       double *gap) {
    const uint32_t X = mw->X, K = mw->K, E = mw->E;
    float *p = xmalloc(sizeof(float) * X);
    for (uint32_t t = 0; t < n; t++) {
        for (uint32_t x = 0; x < X; x++) {
            double acc = 0;
            for (uint32_t c = 0; c < E; c++) acc += (double)bf(mw->router[(size_t)x * E + c]) * bf(h[(size_t)t * E + c]);
            p[x] = (float)acc;
        }
        kvb_moe_route_one(p, (int)X, (int)K, mw->norm, sel + (size_t)t * K, wts + (size_t)t * K);
        double next = -1;
        for (uint32_t x = 0; x < X; x++) {
            bool taken = false;
            for (uint32_t k = 0; k < K; k++) taken |= sel[t * K + k] == (int32_t)x;
            if (!taken && p[x] > next) next = p[x];
        }
        gap[t] = K < X ? p[sel[t * K + K - 1]] - next : 1.0;
    }
    free(p);
}

static void test_ffn(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t X = 16, K = 4, F = 64, E = 256, n = 97;
    uint16_t *router = xmalloc(2 * (size_t)X * E), *gu = xmalloc(2 * (size_t)X * 2 * F * E);
    uint16_t *down = xmalloc(2 * (size_t)X * E * F), *h = xmalloc(2 * (size_t)n * E);
    for (size_t i = 0; i < (size_t)X * E; i++) router[i] = to_bf(rnd_normal() / 8.0f);
    for (size_t i = 0; i < (size_t)X * 2 * F * E; i++) gu[i] = to_bf(rnd_normal() / 8.0f);
    for (size_t i = 0; i < (size_t)X * E * F; i++) down[i] = to_bf(rnd_normal() / 4.0f);
    for (size_t i = 0; i < (size_t)n * E; i++) h[i] = to_bf(rnd_normal());
    const kvb_cuda_test_moe_w mw = {router, gu, down, X, K, F, E, true};
    int32_t *sel = xmalloc(4 * n * K), *rsel = xmalloc(4 * n * K);
    float *wts = xmalloc(4 * n * K), *rw = xmalloc(4 * n * K), *x = xmalloc(4 * (size_t)n * E);
    double *gap = xmalloc(sizeof(double) * n), *ref = xmalloc(sizeof(double) * n * E);
    route_twin(&mw, h, n, rsel, rw, gap);
    for (int grouped = 0; grouped < 2; grouped++) {
        for (size_t i = 0; i < (size_t)n * E; i++) x[i] = 0.5f * rnd_normal();
        for (size_t i = 0; i < (size_t)n * E; i++) ref[i] = x[i];
        kvb_err err = {0};
        if (kvb_cuda_test_moe_ffn(&mw, h, n, grouped, x, sel, wts, &err))
            fail_msg("MoE MLP (%s): %s", grouped ? "grouped" : "loop", err.msg);
        int clear = 0;
        for (uint32_t t = 0; t < n; t++) {
            if (gap[t] <= 1e-4) continue;
            clear++;
            for (uint32_t k = 0; k < K; k++) {
                if (sel[t * K + k] != rsel[t * K + k])
                    fail_msg("token %u rank %u: expert %d, twin %d (margin %.3g)", t, k, sel[t * K + k],
                             rsel[t * K + k], gap[t]);
                if (!(fabsf(wts[t * K + k] - rw[t * K + k]) <= 1e-4f * rw[t * K + k] + 1e-6f))
                    fail_msg("token %u rank %u: weight %.9g, twin %.9g", t, k, wts[t * K + k], rw[t * K + k]);
            }
        }
        assert_true(clear >= (int)n / 2);
        ffn_twin(&mw, h, n, sel, wts, grouped, ref);
        double num = 0; /* on the MLP's contribution: x against ref, over the size of the MLP's output */
        for (size_t i = 0; i < (size_t)n * E; i++) num += ((double)x[i] - ref[i]) * ((double)x[i] - ref[i]);
        double mag = 0; /* the MLP output alone */
        double *only = xmalloc(sizeof(double) * n * E);
        memset(only, 0, sizeof(double) * n * E);
        ffn_twin(&mw, h, n, sel, wts, grouped, only);
        for (size_t i = 0; i < (size_t)n * E; i++) mag += only[i] * only[i];
        free(only);
        const double rel = sqrt(num / mag);
        print_message("MoE MLP, %s: %d/%u tokens' routing checked against the twin, output rel-L2 %.3g (limit %.3g)\n",
                      grouped ? "grouped GEMMs" : "a GEMM per expert", clear, n, rel, TOL_FFN);
        if (!(rel <= TOL_FFN)) fail_msg("MoE MLP (%s): rel-L2 %.4g > %.3g", grouped ? "grouped" : "loop", rel, TOL_FFN);
    }
    free(router), free(gu), free(down), free(h), free(sel), free(rsel), free(wts), free(rw), free(x), free(gap);
    free(ref);
}

/* ---- end to end on tiny-moe ------------------------------------------------------------------ */

static void cpu_logits(const kvb_model *m, const int32_t *tok, uint32_t n, float *logits) {
    kvb_engine_opts o = {0};
    o.cache_dtype = KVB_TYPE_F32;
    o.block_tokens = 16;
    o.max_ctx = n + 16;
    kvb_engine *e = NULL;
    kvb_seq *s = NULL;
    kvb_err err = {0};
    if (kvb_engine_create(m, &o, &e, &err) || kvb_seq_create(e, &s, &err) ||
        kvb_engine_forward(e, s, tok, n, logits, true, &err))
        fail_msg("CPU engine: %s", err.msg);
    kvb_seq_free(s);
    kvb_engine_free(e);
}

/* Every token's logits from a CUDA engine (weights, chunks of max_batch), or NULL with err set. */
static float *gpu_logits(const kvb_model *m, kvb_cuda_weights weights, uint32_t max_batch, const int32_t *tok,
                         uint32_t n, kvb_err *err) {
    kvb_cuda_opts o = {.max_ctx = 4 * n, .max_batch = max_batch, .block_tokens = 16, .weights = weights,
                       .attention = KVB_CUDA_ATTN_OWN};
    kvb_cuda_engine *e = NULL;
    kvb_cuda_seq *s = NULL;
    float *l = xmalloc(sizeof(float) * n * m->d.n_vocab);
    for (size_t i = 0; i < (size_t)n * m->d.n_vocab; i++) l[i] = NAN;
    if (kvb_cuda_engine_create(m, &o, &e, err) || kvb_cuda_seq_create(e, &s, err) ||
        kvb_cuda_forward(e, s, tok, n, l, true, err)) {
        free(l);
        l = NULL;
    } else {
        char desc[600];
        kvb_cuda_engine_describe(e, desc, sizeof desc);
        print_message("  engine: %s\n", desc);
    }
    kvb_cuda_seq_free(s);
    kvb_cuda_engine_free(e);
    return l;
}

/* Worst per-token rel-L2 of got against ref; a token whose routing margin is under gap_min, or
 * under MOE_CLOSE_GAP x its tolerance, is left out (counted in *close), those after one are held
 * to tol + MOE_FLIP_SPILL; with escalate, that spilled tolerance also sets the margin under which
 * they are left out (else tol does). */
static double compare_moe(const float *got, const float *ref, const double *gaps, uint32_t n, uint32_t V, double tol,
                          double gap_min, bool escalate, int *close, const char *what) {
    double worst = 0;
    *close = 0;
    for (uint32_t t = 0; t < n; t++) {
        const double tol_t = *close ? tol + MOE_FLIP_SPILL : tol;
        if (gaps[t] < gap_min || gaps[t] < MOE_CLOSE_GAP * (escalate ? tol_t : tol)) {
            (*close)++;
            continue;
        }
        const double rel = kvbt_rel_l2(got + (size_t)t * V, ref + (size_t)t * V, V);
        if (!(rel <= tol_t)) fail_msg("%s: token %u: rel-L2 %.4g > %.3g (routing margin %.3g)", what, t, rel, tol_t, gaps[t]);
        if (rel > worst) worst = rel;
    }
    print_message("%s: worst rel-L2 %.4g (limit %.3g), %d/%u tokens too close to call left out\n", what, worst, tol,
                  *close, n);
    if (*close > (int)n / 2) fail_msg("%s: %d of %u tokens too close to call", what, *close, n);
    return worst;
}

static int argmax_f(const float *x, uint32_t n) {
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return (int)b;
}

/* Max-abs and top-1 of every token checked by compare_moe's rule: |got - cpu| <= 4 TOL_CPU x the
 * token's logit RMS, and the top-1 equal wherever the CPU's top-2 margin exceeds twice that. */
static void check_abs_top1(const float *got, const float *cpu, const double *gaps, uint32_t n, uint32_t V,
                           const char *what) {
    double worst = 0; /* in units of the token's RMS */
    int top1 = 0, top1_checked = 0, close = 0;
    for (uint32_t t = 0; t < n; t++) {
        if (gaps[t] < MOE_CLOSE_GAP * TOL_CPU) {
            close++;
            continue;
        }
        const float *g = got + (size_t)t * V, *c = cpu + (size_t)t * V;
        double rms = 0, mx = 0;
        for (uint32_t i = 0; i < V; i++) rms += (double)c[i] * c[i];
        rms = sqrt(rms / V);
        for (uint32_t i = 0; i < V; i++) mx = fmax(mx, fabs((double)g[i] - c[i]));
        const double bound = 4.0 * (close ? TOL_CPU + MOE_FLIP_SPILL : TOL_CPU) * rms;
        if (!(mx <= bound)) fail_msg("%s token %u: max abs %.4g > %.4g", what, t, mx, bound);
        if (mx / rms > worst) worst = mx / rms;
        const int best = argmax_f(c, V);
        float second = -INFINITY;
        for (uint32_t i = 0; i < V; i++)
            if ((int)i != best && c[i] > second) second = c[i];
        top1 += argmax_f(g, V) == best;
        if (c[best] - second > 2.0 * bound) {
            top1_checked++;
            if (argmax_f(g, V) != best) fail_msg("%s token %u: top-1 %d, CPU %d", what, t, argmax_f(g, V), best);
        }
    }
    print_message("%s: max abs %.4g x the logit RMS (limit %.3g); top-1 equal on %d of %u tokens, required on the "
                  "%d with a clear margin\n",
                  what, worst, 4.0 * TOL_CPU, top1, n - close, top1_checked);
}

/* A tiny preset end to end: every token's CUDA logits (bf16 weights, both expert-GEMM paths) against
 * the CPU engine's (compare_moe), chunks of 7 against one shot; tok_salt picks the prompt. mla
 * (tiny-mla): the routing margin is not raised after a close token, and each token's max-abs
 * difference and top-1 are checked too (check_abs_top1). */
static void tiny_engine_vs_cpu(const char *preset, uint64_t tok_salt, bool mla) {
    enum { N = 77 };
    char path[600], name[64];
    snprintf(name, sizeof name, "%s.gguf", preset);
    kvbt_tmp_path(path, sizeof path, name);
    kvb_gen_opts go = {.preset = preset, .type = KVB_TYPE_BF16, .seed = g_seed, .n_threads = 0};
    kvb_err err = {0};
    kvb_model *m = NULL;
    if (kvb_gen_model(&go, path, &err) || kvb_model_load(path, &m, &err)) fail_msg("%s: %s", preset, err.msg);
    char rerr[512];
    ref_model *rm = ref_model_load(path, rerr, sizeof rerr);
    if (!rm) fail_msg("ref_model_load: %s", rerr);
    const uint32_t V = m->d.n_vocab;
    int32_t tok[N];
    kvbt_random_tokens(tok, N, V, g_seed ^ tok_salt);
    double *rl = xmalloc(sizeof(double) * N * V), gaps[N];
    assert_int_equal(ref_model_forward_gaps(rm, tok, N, rl, gaps), 0);
    float *cpu = xmalloc(sizeof(float) * N * V);
    cpu_logits(m, tok, N, cpu);
    int close;
    for (int grouped = 0; grouped < 2; grouped++) {
        setenv("KVB_CUDA_MOE_GEMM", grouped ? "grouped" : "loop", 1);
        float *one = gpu_logits(m, KVB_CUDA_WEIGHTS_BF16, 0, tok, N, &err);
        if (!one) fail_msg("CUDA engine (%s): %s", grouped ? "grouped" : "loop", err.msg);
        char what[128];
        snprintf(what, sizeof what, "%s, %s GEMMs: GPU vs CPU engine", preset, grouped ? "grouped" : "per-expert");
        compare_moe(one, cpu, gaps, N, V, TOL_CPU, 0.0, !mla, &close, what);
        if (mla) check_abs_top1(one, cpu, gaps, N, V, what);
        float *chunked = gpu_logits(m, KVB_CUDA_WEIGHTS_BF16, 7, tok, N, &err);
        if (!chunked) fail_msg("CUDA engine, chunks of 7: %s", err.msg);
        snprintf(what, sizeof what, "%s, %s GEMMs: chunked (7) vs one-shot", preset,
                 grouped ? "grouped" : "per-expert");
        compare_moe(chunked, one, gaps, N, V, TOL_GPU_GPU, MOE_GPU_GAP, !mla, &close, what);
        free(one), free(chunked);
    }
    unsetenv("KVB_CUDA_MOE_GEMM");
    if (mla) { /* packed weights are refused for latent attention, saying so */
        kvb_cuda_opts o = {.max_ctx = 4 * N, .weights = KVB_CUDA_WEIGHTS_PACKED};
        kvb_cuda_engine *e = NULL;
        assert_int_equal(kvb_cuda_engine_create(m, &o, &e, &err), KVB_ERR_UNSUPPORTED);
        print_message("packed weights: refused (%s)\n", err.msg);
    }
    ref_model_free(rm);
    kvb_model_free(m);
    free(rl), free(cpu);
}

static void test_tiny_moe_engine(void **state) {
    (void)state;
    kvbt_require_gpu();
    tiny_engine_vs_cpu("tiny-moe", 0x6d6f65u, false);
}

/* Packed weights (the file's blocks on the GPU, a layer's experts expanded before it runs) ==
 * the same file converted to bf16 at load, bit for bit. */
static void test_tiny_moe_packed(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t types[] = {KVB_TYPE_Q8_0, KVB_TYPE_Q4_K};
    enum { N = 40 };
    for (size_t c = 0; c < KVB_ARRAY_LEN(types); c++) {
        kvb_err err = {0};
        kvb_model *m = kvbt_gen_load("tiny-moe-packed.gguf", "tiny-moe", types[c], g_seed + c);
        if (!m) fail_msg("tiny-moe %s: cannot write or load it", kvb_type_name(types[c]));
        int32_t tok[N];
        kvbt_random_tokens(tok, N, m->d.n_vocab, g_seed + 7 * c);
        float *ref = gpu_logits(m, KVB_CUDA_WEIGHTS_BF16, 0, tok, N, &err);
        if (!ref) fail_msg("bf16 weights: %s", err.msg);
        float *got = gpu_logits(m, KVB_CUDA_WEIGHTS_PACKED, 0, tok, N, &err);
        if (!got) fail_msg("packed weights: %s", err.msg);
        if (memcmp(got, ref, sizeof(float) * N * m->d.n_vocab))
            fail_msg("tiny-moe %s: packed logits differ from bf16 weights'", kvb_type_name(types[c]));
        print_message("tiny-moe %s: packed == bf16 weights, %d tokens bit for bit\n", kvb_type_name(types[c]), N);
        free(ref), free(got);
        kvb_model_free(m);
    }
}

/* A real shape (KVB_CUDA_TEST_MOE_MODELS=a.gguf,..., e.g. gen-model --preset qwen3-30b-a3b): CUDA
 * vs the CPU engine on every token of a 32-token prompt, both GEMM paths. No float64 reference
 * tells the routing margins at this size (48 layers choosing 8 of 128 experts), so a token may
 * take another expert somewhere; with 8 experts a token, such a flip swaps two experts of nearly
 * equal (small) weight and moves that token's logits by far less than a wrong layout, routing or
 * weight does (every token at 1e-1 .. 1). Held: the median token within TOL_CPU_REAL (3e-2,
 * test_cuda_engine's real-shape limit), at least 3/4 of the tokens within it, and the top-1 equal
 * wherever the CPU's top-2 margin is over 1; every token's figure is printed. */
#define TOL_CPU_REAL 3e-2
static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Whether the top-1 of g equals c's wherever c's top-2 margin exceeds 1; fails otherwise. */
static void check_top1(const float *g, const float *c, uint32_t V, const char *path, uint32_t t) {
    const int best = argmax_f(c, V);
    float second = -INFINITY;
    for (uint32_t i = 0; i < V; i++)
        if ((int)i != best && c[i] > second) second = c[i];
    if (c[best] - second > 1.0f && argmax_f(g, V) != best)
        fail_msg("%s token %u: GPU top-1 %d, CPU %d (margin %.3g)", path, t, argmax_f(g, V), best,
                 (double)(c[best] - second));
}

static void real_shape(const char *path) {
    enum { N = 32 };
    kvb_err err = {0};
    kvb_model *m = NULL;
    if (kvb_model_load(path, &m, &err)) fail_msg("%s: %s", path, err.msg);
    if (!m->d.n_expert) fail_msg("%s: not a mixture of experts", path);
    const uint32_t V = m->d.n_vocab;
    int32_t tok[N];
    kvbt_random_tokens(tok, N, V, g_seed ^ 0x7265616cu);
    float *cpu = xmalloc(sizeof(float) * N * V);
    cpu_logits(m, tok, N, cpu);
    for (int grouped = 0; grouped < 2; grouped++) {
        setenv("KVB_CUDA_MOE_GEMM", grouped ? "grouped" : "loop", 1);
        float *gpu = gpu_logits(m, KVB_CUDA_WEIGHTS_AUTO, 0, tok, N, &err);
        if (!gpu) fail_msg("%s: CUDA engine: %s", path, err.msg);
        double sorted[N];
        int within = 0;
        for (uint32_t t = 0; t < N; t++) {
            sorted[t] = kvbt_rel_l2(gpu + (size_t)t * V, cpu + (size_t)t * V, V);
            within += sorted[t] <= TOL_CPU_REAL;
            check_top1(gpu + (size_t)t * V, cpu + (size_t)t * V, V, path, t);
            print_message("  token %2u: rel-L2 %.4g\n", t, sorted[t]);
        }
        qsort(sorted, N, sizeof(double), cmp_double);
        const double median = 0.5 * (sorted[N / 2 - 1] + sorted[N / 2]);
        print_message("%s, %s GEMMs: GPU vs CPU engine median rel-L2 %.4g, worst %.4g, %d/%d within %.3g\n", path,
                      grouped ? "grouped" : "per-expert", median, sorted[N - 1], within, N, TOL_CPU_REAL);
        if (!(median <= TOL_CPU_REAL) || within * 4 < N * 3)
            fail_msg("%s: median rel-L2 %.4g, %d/%d tokens within %.3g", path, median, within, N, TOL_CPU_REAL);
        free(gpu);
    }
    unsetenv("KVB_CUDA_MOE_GEMM");
    free(cpu);
    kvb_model_free(m);
}

static void test_moe_real_shapes(void **state) {
    (void)state;
    kvbt_require_gpu();
    const char *list = getenv("KVB_CUDA_TEST_MOE_MODELS");
    if (!list || !*list) kvbt_skip("KVB_CUDA_TEST_MOE_MODELS is not set (qwen3moe GGUFs, e.g. the qwen3-30b-a3b preset)");
    char *copy = strdup(list);
    assert_non_null(copy);
    for (char *save = NULL, *p = strtok_r(copy, ",", &save); p; p = strtok_r(NULL, ",", &save)) real_shape(p);
    free(copy);
}

/* ---- DeepSeek's routing ---------------------------------------------------------------------- */

/* The routing of one token in float64 by the reference's ref_route_deepseek: sel (K) its experts, w
 * (K) their weights, *margin the smallest score margin of a decision (top-k and kept-group boundaries). */
static void route_double(const float *logit, const float *bias, int X, int K, const kvb_moe_route_cfg *c, int32_t *sel,
                         double *w, double *margin) {
    ref_desc d;
    memset(&d, 0, sizeof d);
    d.n_expert = X, d.n_expert_used = K, d.gating = c->gating, d.n_groups = c->n_groups;
    d.n_group_used = c->n_groups_used, d.expert_weights_norm = c->norm, d.expert_weights_scale = c->scale;
    double p[1024], b[1024];
    int s[16];
    for (int x = 0; x < X; x++) p[x] = logit[x], b[x] = bias ? bias[x] : 0.0;
    assert_int_equal(ref_route_deepseek(&d, p, bias ? b : NULL, s, w, margin), 0);
    for (int k = 0; k < K; k++) sel[k] = s[k];
}

/* DeepSeek's routing shapes: tiny-mla's and V3's sigmoid with bias in groups, V2-Lite's softmax. */
static const struct {
    const char *what;
    uint32_t X, K;
    kvb_moe_route_cfg cfg;
    bool bias;
} ds_cases[] = {
    {"tiny-mla (sigmoid, bias, 4 groups keep 2, norm, x2.5)", 8, 2, {2, 1, 2.5f, 4, 2}, true},
    {"DeepSeek-V3 (sigmoid, bias, 8 groups keep 4, norm, x2.5)", 256, 8, {2, 1, 2.5f, 8, 4}, true},
    {"DeepSeek-V2-Lite (softmax, no norm, x1)", 64, 6, {1, 0, 1.0f, 0, 0}, false},
    {"sigmoid, no bias, 8 groups keep 3", 64, 4, {2, 0, 0.0f, 8, 3}, false},
};

/* ds_cases[c] on fresh random logits: the twin against the float64 reference's routing, and with
 * on_gpu the kernel against the twin bit for bit. */
static void route_deepseek_case(size_t c, bool on_gpu) {
    const uint32_t X = ds_cases[c].X, K = ds_cases[c].K, n = 257;
    const kvb_moe_route_cfg *cfg = &ds_cases[c].cfg;
    const char *what = ds_cases[c].what;
    float *lg = xmalloc(sizeof(float) * n * X), *p = xmalloc(sizeof(float) * n * X), *bias = NULL;
    float *sc = xmalloc(sizeof(float) * X), *rp = xmalloc(sizeof(float) * n * X);
    float *w = xmalloc(sizeof(float) * n * K), *rw = xmalloc(sizeof(float) * n * K);
    int32_t *sel = xmalloc(sizeof(int32_t) * n * K), *rsel = xmalloc(sizeof(int32_t) * n * K);
    if (ds_cases[c].bias) {
        bias = xmalloc(sizeof(float) * X);
        for (uint32_t x = 0; x < X; x++) bias[x] = 0.1f * rnd_normal();
    }
    for (size_t i = 0; i < (size_t)n * X; i++) lg[i] = 2.0f * rnd_normal();
    memcpy(rp, lg, sizeof(float) * n * X);
    int checked = 0;
    double worst_w = 0;
    for (uint32_t t = 0; t < n; t++) {
        float *pt = rp + (size_t)t * X;
        kvb_moe_route_one_cfg(pt, bias || cfg->n_groups > 1 ? sc : pt, bias, (int)X, (int)K, cfg, rsel + (size_t)t * K,
                              rw + (size_t)t * K);
        int32_t dsel[16];
        double dw[16], margin;
        route_double(lg + (size_t)t * X, bias, (int)X, (int)K, cfg, dsel, dw, &margin);
        if (margin <= 1e-5) continue;
        checked++;
        for (uint32_t k = 0; k < K; k++) { /* the same set of experts (two whose f32 scores tie may swap ranks) */
            uint32_t j = 0;
            while (j < K && dsel[j] != rsel[t * K + k]) j++;
            if (j == K)
                fail_msg("%s token %u rank %u: twin expert %d, not among the double's (margin %.3g)", what, t, k,
                         rsel[t * K + k], margin);
            const double rel = fabs(rw[t * K + k] - dw[j]) / fabs(dw[j]);
            if (rel > worst_w) worst_w = rel;
            if (!(rel <= 1e-5))
                fail_msg("%s token %u expert %d: twin weight %.9g, double %.9g", what, t, rsel[t * K + k],
                         rw[t * K + k], dw[j]);
        }
    }
    assert_true(checked >= (int)n / 2);
    print_message("router %s: twin vs float64 on %d of %u tokens: same experts, weights within %.3g relative (limit "
                  "1e-5)\n",
                  what, checked, n, worst_w);
    if (on_gpu) {
        memcpy(p, lg, sizeof(float) * n * X);
        memset(sel, 0xFF, sizeof(int32_t) * n * K);
        memset(w, 0xFF, sizeof(float) * n * K);
        kvb_err err = {0};
        if (kvb_cuda_test_moe_route_cfg(p, bias, n, X, K, cfg, sel, w, &err)) fail_msg("%s: %s", what, err.msg);
        if (memcmp(p, rp, sizeof(float) * n * X)) fail_msg("%s: probabilities differ from the twin", what);
        if (memcmp(sel, rsel, sizeof(int32_t) * n * K)) fail_msg("%s: experts differ from the twin", what);
        if (memcmp(w, rw, sizeof(float) * n * K)) fail_msg("%s: weights differ from the twin", what);
        print_message("router %s: the kernel == the twin on %u tokens, bit for bit\n", what, n);
    }
    free(lg), free(p), free(rp), free(bias), free(sc), free(w), free(rw), free(sel), free(rsel);
}

/* Host only (runs without a GPU too): moe_math.h's routing against the float64 reference's. */
static void test_route_deepseek_twin(void **state) {
    (void)state;
    for (size_t c = 0; c < KVB_ARRAY_LEN(ds_cases); c++) route_deepseek_case(c, false);
}

static void test_route_deepseek(void **state) {
    (void)state;
    kvbt_require_gpu();
    for (size_t c = 0; c < KVB_ARRAY_LEN(ds_cases); c++) route_deepseek_case(c, true);
}

/* ---- latent attention kernels ---------------------------------------------------------------- */

/* x (P) rotated as pairs (2i, 2i+1) with c, s (P/2): each product and sum rounded once, as the
 * kernels and the CPU engine's kvb_cpu_rope (this file builds with -ffp-contract=off). */
static void rope_pairs_twin(const float *x, uint32_t P, const float *c, const float *s, float *out) {
    for (uint32_t i = 0; i < P / 2; i++) {
        const float x0 = x[2 * i], x1 = x[2 * i + 1];
        const float a = x0 * c[i], b = x1 * s[i], e = x0 * s[i], f = x1 * c[i];
        out[2 * i] = a - b;
        out[2 * i + 1] = e + f;
    }
}

static void test_mla_kernels(void **state) {
    (void)state;
    kvbt_require_gpu();
    const uint32_t R = 64, P = 32, RP = R + P, H = 3, N = 32, Vd = 24, bt = 16, n_layer = 3, layer = 1;
    const uint32_t pos0 = 37, n = 45, n_pos = pos0 + n, n_table = (n_pos + bt - 1) / bt, n_pool = n_table + 2;
    const size_t block_bytes = (size_t)n_layer * bt * RP * 2;
    /* the engine's RoPE table for a YaRN-like spread of frequencies */
    double inv_freq[16];
    for (uint32_t i = 0; i < P / 2; i++) inv_freq[i] = pow(10000.0, -2.0 * i / P) / (i % 3 == 0 ? 40.0 : 1.0);
    float *cs = xmalloc(sizeof(float) * n_pos * P / 2), *sn = xmalloc(sizeof(float) * n_pos * P / 2);
    kvb_rope_table(inv_freq, P, 0, n_pos, cs, sn);
    /* a shuffled block table over a pool with spare blocks */
    int32_t *table = xmalloc(4 * n_table), perm[64];
    random_perm(perm, n_pool);
    for (uint32_t i = 0; i < n_table; i++) table[i] = perm[i];
    uint8_t *pool = xmalloc(block_bytes * n_pool), *pool0 = xmalloc(block_bytes * n_pool);
    for (size_t i = 0; i < block_bytes * n_pool / 2; i++) ((uint16_t *)pool)[i] = to_bf(rnd_normal());
    memcpy(pool0, pool, block_bytes * n_pool);
    kvb_cuda_test_mla_cache cache = {pool, n_pool, table, n_table, bt, n_layer, R, P};
    /* the cache rows of positions pos0 .. pos0 + n - 1 */
    float *c = xmalloc(sizeof(float) * n * RP);
    uint16_t *lat = xmalloc(2 * (size_t)n * RP);
    for (size_t i = 0; i < (size_t)n * RP; i++) c[i] = rnd_normal(), lat[i] = to_bf(rnd_normal());
    kvb_err err = {0};
    if (kvb_cuda_test_mla_kv_store(c, lat, n, pos0, cs, sn, layer, &cache, &err)) fail_msg("kv_store: %s", err.msg);
    float pe[64];
    for (uint32_t p = 0; p < n_pos; p++)
        for (uint32_t l = 0; l < n_layer; l++) {
            const size_t at = (size_t)table[p / bt] * block_bytes + ((size_t)l * bt + p % bt) * RP * 2;
            const uint16_t *row = (const uint16_t *)(pool + at), *was = (const uint16_t *)(pool0 + at);
            if (l != layer || p < pos0) {
                if (memcmp(row, was, 2 * RP)) fail_msg("kv_store wrote row (layer %u, pos %u) it does not own", l, p);
                continue;
            }
            const uint32_t t = p - pos0;
            if (memcmp(row, lat + (size_t)t * RP, 2 * R)) fail_msg("kv_store: latent of pos %u differs", p);
            rope_pairs_twin(c + (size_t)t * RP + R, P, cs + (size_t)p * P / 2, sn + (size_t)p * P / 2, pe);
            for (uint32_t i = 0; i < P; i++)
                if (row[R + i] != to_bf(pe[i]))
                    fail_msg("kv_store: pos %u rope element %u: %04x, twin %04x", p, i, row[R + i], to_bf(pe[i]));
        }
    print_message("latent cache rows: %u tokens at %u into layer %u of a paged cache, bit for bit\n", n, pos0, layer);
    /* the queries' rope */
    const uint32_t K = N + P;
    float *q = xmalloc(sizeof(float) * n * H * K);
    uint16_t *qo = xmalloc(2 * (size_t)n * H * K);
    for (size_t i = 0; i < (size_t)n * H * K; i++) q[i] = rnd_normal(), qo[i] = BF16_NAN;
    if (kvb_cuda_test_mla_q_rope(q, n, H, N, P, pos0, cs, sn, qo, &err)) fail_msg("q_rope: %s", err.msg);
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < H; h++) {
            const float *src = q + ((size_t)t * H + h) * K;
            const uint16_t *got = qo + ((size_t)t * H + h) * K;
            rope_pairs_twin(src + N, P, cs + (size_t)(pos0 + t) * P / 2, sn + (size_t)(pos0 + t) * P / 2, pe);
            for (uint32_t i = 0; i < K; i++)
                if (got[i] != to_bf(i < N ? src[i] : pe[i - N]))
                    fail_msg("q_rope: token %u head %u element %u differs from the twin", t, h, i);
        }
    print_message("query rope: %u tokens x %u heads of %u+%u, bit for bit\n", n, H, N, P);
    /* the expansion: gather the rows of positions 0 .. n_pos-1, assemble K and V */
    const uint32_t D = N + P;
    uint16_t *up = xmalloc(2 * (size_t)n_pos * H * (N + Vd)), *glat = xmalloc(2 * (size_t)n_pos * RP);
    uint16_t *ko = xmalloc(2 * (size_t)H * n_pos * D), *vo = xmalloc(2 * (size_t)H * n_pos * D);
    for (size_t i = 0; i < (size_t)n_pos * H * (N + Vd); i++) up[i] = to_bf(rnd_normal());
    for (size_t i = 0; i < (size_t)n_pos * RP; i++) glat[i] = BF16_NAN;
    for (size_t i = 0; i < (size_t)H * n_pos * D; i++) ko[i] = vo[i] = BF16_NAN;
    if (kvb_cuda_test_mla_expand(&cache, layer, n_pos, up, H, N, Vd, glat, ko, vo, &err))
        fail_msg("expand: %s", err.msg);
    for (uint32_t p = 0; p < n_pos; p++) {
        const uint16_t *row =
            (const uint16_t *)(pool + (size_t)table[p / bt] * block_bytes + ((size_t)layer * bt + p % bt) * RP * 2);
        if (memcmp(glat + (size_t)p * RP, row, 2 * RP)) fail_msg("gather: position %u differs from the cache row", p);
        for (uint32_t h = 0; h < H; h++) {
            const uint16_t *k = ko + ((size_t)h * n_pos + p) * D, *v = vo + ((size_t)h * n_pos + p) * D;
            const uint16_t *u = up + (size_t)p * H * (N + Vd);
            for (uint32_t i = 0; i < D; i++) {
                const uint16_t ke = i < N ? u[h * N + i] : row[R + i - N];
                const uint16_t ve = i < Vd ? u[H * N + h * Vd + i] : to_bf(0.0f);
                if (k[i] != ke || v[i] != ve) fail_msg("assemble: position %u head %u element %u differs", p, h, i);
            }
        }
    }
    print_message("expansion: %u positions' latent rows gathered, %u heads' K (%u+%u) and V (%u padded to %u) "
                  "assembled, bit for bit\n", n_pos, H, N, P, Vd, D);
    free(cs), free(sn), free(table), free(pool), free(pool0), free(c), free(lat), free(q), free(qo), free(up);
    free(glat), free(ko), free(vo);
}

/* ---- one latent attention layer ------------------------------------------------------------- */

#define TOL_MLA_ROWS 4e-3  /* cache row vs the CPU engine's (both bf16-rounded: 2 x 2^-9 at worst) */
#define TOL_MLA_LAYER 1e-2 /* the layer's output vs its float64 twin (test_cuda_kernels' attention limit) */

/* Matrix w as f32 (rows, cols), row by row. */
static float *mat_f32(const kvb_mat *w) {
    float *o = xmalloc(sizeof(float) * (size_t)w->rows * (size_t)w->cols);
    for (int64_t r = 0; r < w->rows; r++)
        kvb_row_to_f32(w->type, (const uint8_t *)w->data + (size_t)r * w->row_bytes, o + (size_t)r * w->cols, w->cols);
    return o;
}

/* y (rows) = W (rows, cols) x, in double. */
static void matvec_d(const float *W, size_t rows, size_t cols, const double *x, double *y) {
    for (size_t r = 0; r < rows; r++) {
        double a = 0;
        for (size_t c = 0; c < cols; c++) a += (double)W[r * cols + c] * x[c];
        y[r] = a;
    }
}

static double bf_d(double v) { return bf(to_bf((float)v)); }

/* The twin of one layer's expanded latent attention in double, on the GPU's cache rows (n, R + P)
 * bf16, rounding to bf16 where the GPU does (the normed query latent, the queries, the expanded keys'
 * nope parts and values, the attention output): out (n, E). */
static void mla_layer_twin(const kvb_model *m, uint32_t layer, const uint16_t *h, const uint16_t *rows, uint32_t n,
                           const float *cs, const float *sn, double *out) {
    const kvb_model_desc *d = &m->d;
    const kvb_layer_weights *w = &m->layers[layer];
    const size_t H = d->n_head, K = d->head_dim_k_mla, P = d->n_rot, N = K - P, R = d->n_lora_kv, RP = R + P,
                 Vd = d->head_dim_v_mla, E = d->n_embd, QL = d->n_lora_q;
    float *wq_a = QL ? mat_f32(&w->wq_a) : NULL, *wq = mat_f32(QL ? &w->wq_b : &w->wq), *wk_b = mat_f32(&w->wk_b);
    float *wv_b = mat_f32(&w->wv_b), *wo = mat_f32(&w->wo);
    double *hx = xmalloc(sizeof(double) * E), *qa = xmalloc(sizeof(double) * (QL + 1));
    double *q = xmalloc(sizeof(double) * n * H * K), *k = xmalloc(sizeof(double) * n * H * K);
    double *v = xmalloc(sizeof(double) * n * H * Vd), *o = xmalloc(sizeof(double) * H * Vd);
    double *sc = xmalloc(sizeof(double) * n), *lat = xmalloc(sizeof(double) * RP);
    for (uint32_t t = 0; t < n; t++) {
        for (size_t i = 0; i < E; i++) hx[i] = bf(h[(size_t)t * E + i]);
        double *qt = q + (size_t)t * H * K;
        if (QL) {
            matvec_d(wq_a, QL, E, hx, qa);
            double ss = 0;
            for (size_t i = 0; i < QL; i++) ss += qa[i] * qa[i];
            const double r = 1.0 / sqrt(ss / QL + d->norm_eps);
            for (size_t i = 0; i < QL; i++) qa[i] = bf_d(qa[i] * r * w->q_a_norm[i]);
            matvec_d(wq, H * K, QL, qa, qt);
        } else {
            matvec_d(wq, H * K, E, hx, qt);
        }
        for (size_t hh = 0; hh < H; hh++) {
            double *qp = qt + hh * K + N;
            for (size_t i = 0; i < P / 2; i++) {
                const double c = cs[(size_t)t * (P / 2) + i], s_ = sn[(size_t)t * (P / 2) + i];
                const double x0 = qp[2 * i], x1 = qp[2 * i + 1];
                qp[2 * i] = x0 * c - x1 * s_;
                qp[2 * i + 1] = x0 * s_ + x1 * c;
            }
        }
        for (size_t i = 0; i < H * K; i++) qt[i] = bf_d(qt[i]);
        /* this position's keys and values from its cache row */
        for (size_t i = 0; i < RP; i++) lat[i] = bf(rows[(size_t)t * RP + i]);
        for (size_t hh = 0; hh < H; hh++) {
            double *kt = k + ((size_t)t * H + hh) * K;
            for (size_t j = 0; j < N; j++) {
                double a = 0;
                for (size_t r = 0; r < R; r++) a += (double)wk_b[(hh * R + r) * N + j] * lat[r];
                kt[j] = bf_d(a);
            }
            for (size_t j = 0; j < P; j++) kt[N + j] = lat[R + j];
            for (size_t i = 0; i < Vd; i++) {
                double a = 0;
                for (size_t r = 0; r < R; r++) a += (double)wv_b[(hh * Vd + i) * R + r] * lat[r];
                v[((size_t)t * H + hh) * Vd + i] = bf_d(a);
            }
        }
    }
    for (uint32_t t = 0; t < n; t++) {
        for (size_t hh = 0; hh < H; hh++) {
            const double *qt = q + ((size_t)t * H + hh) * K;
            double mx = -INFINITY, sum = 0;
            for (uint32_t j = 0; j <= t; j++) {
                double a = 0;
                for (size_t i = 0; i < K; i++) a += qt[i] * k[((size_t)j * H + hh) * K + i];
                sc[j] = a * d->attn_scale;
                mx = fmax(mx, sc[j]);
            }
            for (size_t i = 0; i < Vd; i++) o[hh * Vd + i] = 0;
            for (uint32_t j = 0; j <= t; j++) {
                const double p = exp(sc[j] - mx);
                sum += p;
                for (size_t i = 0; i < Vd; i++) o[hh * Vd + i] += p * v[((size_t)j * H + hh) * Vd + i];
            }
            for (size_t i = 0; i < Vd; i++) o[hh * Vd + i] = bf_d(o[hh * Vd + i] / sum);
        }
        matvec_d(wo, E, H * Vd, o, out + (size_t)t * E);
    }
    free(wq_a), free(wq), free(wk_b), free(wv_b), free(wo), free(hx), free(qa), free(q), free(k), free(v), free(o);
    free(sc), free(lat);
}

/* The engine's latent attention of one layer (tiny-mla, bf16 weights; the leading dense layer and an
 * MoE layer): its cache rows against the CPU engine's kvb_kv_produce (bf16 cache), its output against
 * the float64 twin, chunks of 7 against one shot. */
static void test_mla_layer(void **state) {
    (void)state;
    kvbt_require_gpu();
    enum { N_TOK = 53 };
    kvb_model *m = kvbt_gen_load("tiny-mla-layer.gguf", "tiny-mla", KVB_TYPE_BF16, g_seed + 11);
    if (!m) fail_msg("tiny-mla: cannot write or load it");
    const kvb_model_desc *d = &m->d;
    const uint32_t E = d->n_embd, RP = d->n_lora_kv + d->n_rot;
    uint16_t *h = xmalloc(2 * (size_t)N_TOK * E), *rows = xmalloc(2 * (size_t)N_TOK * RP);
    uint16_t *rows7 = xmalloc(2 * (size_t)N_TOK * RP);
    float *x0 = xmalloc(4 * (size_t)N_TOK * E), *x = xmalloc(4 * (size_t)N_TOK * E);
    float *x7 = xmalloc(4 * (size_t)N_TOK * E);
    float *hf = xmalloc(4 * (size_t)N_TOK * E);
    double *ref = xmalloc(sizeof(double) * N_TOK * E);
    kvb_rope_tables rt;
    kvb_err err = {0};
    if (kvb_rope_tables_init(&rt, m, N_TOK, &err)) fail_msg("%s", err.msg);
    kvb_rope_tables_fill(&rt, 0, N_TOK);
    for (uint32_t layer = 0; layer < 2; layer++) {
        for (size_t i = 0; i < (size_t)N_TOK * E; i++) h[i] = to_bf(rnd_normal()), hf[i] = bf(h[i]);
        for (size_t i = 0; i < (size_t)N_TOK * E; i++) x0[i] = 0.5f * rnd_normal();
        memcpy(x, x0, 4 * (size_t)N_TOK * E);
        memcpy(x7, x0, 4 * (size_t)N_TOK * E);
        for (size_t i = 0; i < (size_t)N_TOK * RP; i++) rows[i] = rows7[i] = BF16_NAN;
        if (kvb_cuda_test_mla_layer(m, layer, h, N_TOK, N_TOK, x, rows, &err) ||
            kvb_cuda_test_mla_layer(m, layer, h, N_TOK, 7, x7, rows7, &err))
            fail_msg("layer %u: %s", layer, err.msg);
        /* the cache rows against the CPU engine's */
        const float *cs, *sn;
        kvb_rope_tables_layer(&rt, layer, &cs, &sn);
        kvb_kv_produce_args ka = {m, layer, KVB_TYPE_BF16, NULL, cs, sn, false, false};
        void *scratch = NULL;
        assert_int_equal(posix_memalign(&scratch, 64, kvb_kv_produce_scratch_bytes(m, N_TOK)), 0);
        uint16_t *crow = xmalloc(2 * (size_t)N_TOK * RP);
        kvb_kv_produce(&ka, hf, N_TOK, scratch, (uint8_t *)crow, NULL);
        double worst_row = 0;
        size_t same = 0;
        float *gr = xmalloc(4 * RP), *cr = xmalloc(4 * RP);
        for (uint32_t t = 0; t < N_TOK; t++) {
            for (uint32_t i = 0; i < RP; i++) {
                gr[i] = bf(rows[(size_t)t * RP + i]), cr[i] = bf(crow[(size_t)t * RP + i]);
                same += rows[(size_t)t * RP + i] == crow[(size_t)t * RP + i];
            }
            const double rel = kvbt_rel_l2(gr, cr, RP);
            worst_row = fmax(worst_row, rel);
            if (!(rel <= TOL_MLA_ROWS))
                fail_msg("layer %u token %u: cache row rel-L2 %.3g > %.3g", layer, t, rel, TOL_MLA_ROWS);
        }
        /* the output against the twin on the GPU's own rows; chunked against one shot */
        mla_layer_twin(m, layer, h, rows, N_TOK, cs, sn, ref);
        double num = 0, den = 0, num7 = 0;
        for (size_t i = 0; i < (size_t)N_TOK * E; i++) {
            const double got = (double)x[i] - x0[i], got7 = (double)x7[i] - x0[i];
            num += (got - ref[i]) * (got - ref[i]);
            num7 += (got7 - got) * (got7 - got);
            den += ref[i] * ref[i];
        }
        const double rel = sqrt(num / den), rel7 = sqrt(num7 / den);
        print_message("latent attention layer %u (%s MLP): cache rows vs the CPU engine's worst rel-L2 %.3g (limit "
                      "%.3g, %zu/%u elements bit-equal); output vs float64 twin rel-L2 %.3g (limit %.3g); chunks of 7 "
                      "vs one shot %.3g (limit %.3g)\n",
                      layer, kvb_layer_is_dense(d, layer) ? "dense" : "MoE", worst_row, TOL_MLA_ROWS, same,
                      (unsigned)(N_TOK * RP), rel, TOL_MLA_LAYER, rel7, TOL_GPU_GPU);
        if (!(rel <= TOL_MLA_LAYER)) fail_msg("layer %u: output rel-L2 %.4g > %.3g", layer, rel, TOL_MLA_LAYER);
        if (!(rel7 <= TOL_GPU_GPU))
            fail_msg("layer %u: chunked vs one shot rel-L2 %.4g > %.3g", layer, rel7, TOL_GPU_GPU);
        free(scratch), free(crow), free(gr), free(cr);
    }
    kvb_rope_tables_free(&rt);
    free(h), free(rows), free(rows7), free(x0), free(x), free(x7), free(hf), free(ref);
    kvb_model_free(m);
}

/* ---- end to end on tiny-mla ------------------------------------------------------------------ */

static void test_tiny_mla_engine(void **state) {
    (void)state;
    kvbt_require_gpu();
    tiny_engine_vs_cpu("tiny-mla", 0x6d6c61u, true);
}

int main(void) {
    const char *s = getenv("KVB_TEST_SEED");
    g_seed = s ? strtoull(s, NULL, 0) : (uint64_t)time(NULL);
    kvb_rng_seed(&g_rng, g_seed);
    printf("test_cuda_moe: seed %llu (KVB_TEST_SEED=%llu repeats this run)\n", (unsigned long long)g_seed,
           (unsigned long long)g_seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_expf),          cmocka_unit_test(test_route),
        cmocka_unit_test(test_permute),       cmocka_unit_test(test_unpermute),
        cmocka_unit_test(test_ffn),           cmocka_unit_test(test_tiny_moe_engine),
        cmocka_unit_test(test_tiny_moe_packed), cmocka_unit_test(test_route_deepseek_twin),
        cmocka_unit_test(test_route_deepseek),
        cmocka_unit_test(test_mla_kernels),     cmocka_unit_test(test_mla_layer),
        cmocka_unit_test(test_tiny_mla_engine),
        cmocka_unit_test(test_moe_real_shapes),
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
