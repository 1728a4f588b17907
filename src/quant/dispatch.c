/* quant/dispatch.c — run-time choice of the dot-product kernels. On first use (thread-safe,
 * pthread_once) it detects the CPU (x86: AVX-512 F/BW/VL/DQ/VNNI, else AVX2+FMA+F16C; aarch64:
 * NEON) and picks the best kernel set, unless the environment variable KVB_SIMD names one
 * ("auto", "scalar", "avx2", "avx512-vnni", "neon"). kvb_simd_force switches at run time (an
 * atomic pointer swap; calls already running finish on the old set, which is harmless because
 * every set returns identical bits). Also the public kvb_dot / kvb_matmul_tile entry points,
 * which validate their arguments and forward to the chosen set. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_quant.h"
#include "quant_impl.h"

#if defined(KVB_X86)
#include <cpuid.h>
/* F16C via CPUID directly: older clang's __builtin_cpu_supports does not know "f16c". */
static int have_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}
#endif

static const kvb_quant_kernels *const g_all[] = {
#if defined(KVB_X86)
    &kvb_quant_kernels_avx512,
    &kvb_quant_kernels_avx2,
#endif
#if defined(KVB_ARM)
    &kvb_quant_kernels_neon,
#endif
    &kvb_quant_kernels_scalar,
};

static _Atomic(const kvb_quant_kernels *) g_active;
static const kvb_quant_kernels *g_best;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static int cpu_can_run(const kvb_quant_kernels *k) {
#if defined(KVB_X86)
    __builtin_cpu_init();
    if (k == &kvb_quant_kernels_avx512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma") && have_f16c();
    if (k == &kvb_quant_kernels_avx2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && have_f16c();
#endif
    (void)k;
    return 1; /* scalar; NEON is part of the aarch64 baseline */
}

static const kvb_quant_kernels *find(const char *name) {
    for (size_t i = 0; i < KVB_ARRAY_LEN(g_all); i++)
        if (strcmp(g_all[i]->name, name) == 0) return g_all[i];
    return NULL;
}

static void init_once(void) {
    g_best = &kvb_quant_kernels_scalar;
    for (size_t i = 0; i < KVB_ARRAY_LEN(g_all); i++) {
        if (cpu_can_run(g_all[i])) {
            g_best = g_all[i];
            break;
        }
    }
    const kvb_quant_kernels *use = g_best;
    const char *env = getenv("KVB_SIMD");
    if (env != NULL && env[0] != '\0' && strcmp(env, "auto") != 0) {
        const kvb_quant_kernels *k = find(env);
        if (k == NULL)
            kvb_log(KVB_LOG_WARN, "KVB_SIMD=%s is not a known kernel set; using %s", env,
                    g_best->name);
        else if (!cpu_can_run(k))
            kvb_log(KVB_LOG_WARN, "KVB_SIMD=%s: this CPU cannot run it; using %s", env,
                    g_best->name);
        else
            use = k;
    }
    atomic_store_explicit(&g_active, use, memory_order_release);
}

const kvb_quant_kernels *kvb_quant_active(void) {
    const kvb_quant_kernels *k = atomic_load_explicit(&g_active, memory_order_acquire);
    if (k != NULL) return k;
    pthread_once(&g_once, init_once);
    return atomic_load_explicit(&g_active, memory_order_acquire);
}

const char *kvb_simd_name(void) { return kvb_quant_active()->name; }

kvb_status kvb_simd_force(const char *name, kvb_err *err) {
    pthread_once(&g_once, init_once);
    if (name == NULL || strcmp(name, "auto") == 0) {
        atomic_store_explicit(&g_active, g_best, memory_order_release);
        return KVB_OK;
    }
    const kvb_quant_kernels *k = find(name);
    if (k == NULL) {
        static const char *const known[] = {"scalar", "avx2", "avx512-vnni", "neon"};
        for (size_t i = 0; i < KVB_ARRAY_LEN(known); i++)
            if (strcmp(name, known[i]) == 0)
                return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                                   "SIMD kernels '%s' are not built for this architecture", name);
        return kvb_err_set(err, KVB_ERR_INVALID,
                           "unknown SIMD kernel set '%s' (auto, scalar, avx2, avx512-vnni, neon)",
                           name);
    }
    if (!cpu_can_run(k))
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "this CPU cannot run the '%s' kernels", name);
    atomic_store_explicit(&g_active, k, memory_order_release);
    return KVB_OK;
}

/* ---- public entry points ------------------------------------------------------------------ */

static int args_ok(uint32_t type, int64_t n) {
    if (!kvb_dot_type_ok(type) || n <= 0) return 0;
    if (kvb_is_q32_type(type) && n % 32 != 0) return 0;
    if (kvb_is_kquant_type(type) && n % 256 != 0) return 0;
    return 1;
}

float kvb_dot(uint32_t weight_type, const void *w_row, const void *act_row, int64_t n) {
    if (n == 0 && kvb_dot_type_ok(weight_type)) return 0.0f;
    if (!args_ok(weight_type, n)) return NAN; /* caller bug: make it visible downstream */
    float y;
    kvb_quant_active()->matmul(weight_type, w_row, 0, 1, act_row, 0, 1, &y, 1, n);
    return y;
}

void kvb_matmul_tile(uint32_t weight_type, const void *w, size_t w_stride, int n_rows,
                     const void *act, size_t act_stride, int n_tok, float *y, size_t y_stride,
                     int64_t n) {
    if (n_rows <= 0 || n_tok <= 0) return;
    if (!args_ok(weight_type, n)) {
        const float v = (n == 0 && kvb_dot_type_ok(weight_type)) ? 0.0f : NAN;
        for (int t = 0; t < n_tok; t++)
            for (int r = 0; r < n_rows; r++) y[(size_t)t * y_stride + (size_t)r] = v;
        return;
    }
    kvb_quant_active()->matmul(weight_type, w, w_stride, n_rows, act, act_stride, n_tok, y,
                               y_stride, n);
}
