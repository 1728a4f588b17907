/* tests/test_quant.c — the quant module: the type table and row sizes; fp16/bf16 conversions
 * (all 65536 patterns, wide f32 sweeps against an independent float64 rounding model and, where
 * the CPU has it, against F16C hardware); ggml's reference quantisers (known bytes, error bounds
 * vs float64); and the canonical dot: the scalar code against an independently written model of
 * the specification, every SIMD kernel set this CPU can run against the scalar code bit for bit
 * (kvb_dot, kvb_matmul_tile with odd tiles and strides, kvb_quantize_act), and accuracy against a
 * float64 dot. The K-quants and Q5_0 get the same treatment plus: kvb_row_to_f32 against the
 * float64 reference model's own block decoders (tests/support/ref_model.c) on random valid blocks,
 * and error bounds of our K-quant quantisers. Random inputs are fresh each run (seed from the
 * clock, printed; KVB_TEST_SEED=N replays one) and include rounding ties, zero blocks, huge/tiny
 * and subnormal values, -0 and NaN/inf. Output buffers are poisoned with a NaN pattern before each
 * call so an element a kernel forgets to write (or writes out of place) fails. */
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
#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "kvb_core.h"
#include "kvb_quant.h"
#include "ref_model.h"

static uint64_t g_seed;
static kvb_rng g_rng;
static const char *g_initial_simd; /* what dispatch chose at init (KVB_SIMD may force it) */

#define POISON_BITS 0xffa5a5a5u /* a NaN no kernel produces */

static float bits_f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint32_t f_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
/* Bit-identical, except that any two NaNs match (the spec leaves NaN sign/payload open). */
static int same(float a, float b) { return (isnan(a) && isnan(b)) || f_bits(a) == f_bits(b); }

static uint32_t rnd32(void) { return (uint32_t)kvb_rng_u64(&g_rng); }
static int rndint(int lo, int hi) { return lo + (int)(kvb_rng_u64(&g_rng) % (uint64_t)(hi - lo + 1)); }

#define FAILF(...)                                                                                 \
    do {                                                                                           \
        print_error("seed %" PRIu64 " (KVB_TEST_SEED=%" PRIu64 " replays): ", g_seed, g_seed);     \
        print_error(__VA_ARGS__);                                                                  \
        fail();                                                                                    \
    } while (0)

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

/* The kernel sets to compare; those this CPU/architecture cannot run are skipped. */
static const char *const k_simd[] = {"avx512-vnni", "avx2", "neon"};

static int force(const char *name) {
    kvb_err err;
    return kvb_simd_force(name, &err) == KVB_OK;
}

/* ---- type table -------------------------------------------------------------------------- */

static void test_type_table(void **state) {
    (void)state;
    static const struct {
        uint32_t t;
        const char *name;
        int be, bb, sup;
    } want[] = {
        {KVB_TYPE_F32, "F32", 1, 4, 1},      {KVB_TYPE_F16, "F16", 1, 2, 1},
        {KVB_TYPE_Q4_0, "Q4_0", 32, 18, 1},  {KVB_TYPE_Q4_1, "Q4_1", 32, 20, 0},
        {KVB_TYPE_Q5_0, "Q5_0", 32, 22, 1},  {KVB_TYPE_Q5_1, "Q5_1", 32, 24, 0},
        {KVB_TYPE_Q8_0, "Q8_0", 32, 34, 1},  {KVB_TYPE_Q8_1, "Q8_1", 32, 36, 0},
        {KVB_TYPE_Q2_K, "Q2_K", 256, 84, 0}, {KVB_TYPE_Q3_K, "Q3_K", 256, 110, 0},
        {KVB_TYPE_Q4_K, "Q4_K", 256, 144, 1}, {KVB_TYPE_Q5_K, "Q5_K", 256, 176, 1},
        {KVB_TYPE_Q6_K, "Q6_K", 256, 210, 1}, {KVB_TYPE_Q8_K, "Q8_K", 256, 292, 0},
        {16, "IQ2_XXS", 256, 66, 0},          {17, "IQ2_XS", 256, 74, 0},
        {18, "IQ3_XXS", 256, 98, 0},          {19, "IQ1_S", 256, 50, 0},
        {20, "IQ4_NL", 32, 18, 0},            {21, "IQ3_S", 256, 110, 0},
        {22, "IQ2_S", 256, 82, 0},            {23, "IQ4_XS", 256, 136, 0},
        {KVB_TYPE_I8, "I8", 1, 1, 0},         {KVB_TYPE_I16, "I16", 1, 2, 0},
        {KVB_TYPE_I32, "I32", 1, 4, 0},       {KVB_TYPE_I64, "I64", 1, 8, 0},
        {KVB_TYPE_F64, "F64", 1, 8, 0},       {29, "IQ1_M", 256, 56, 0},
        {KVB_TYPE_BF16, "BF16", 1, 2, 1},     {34, "TQ1_0", 256, 54, 0},
        {35, "TQ2_0", 256, 66, 0},            {39, "MXFP4", 32, 17, 0},
    };
    int known = 0;
    for (size_t i = 0; i < KVB_ARRAY_LEN(want); i++) {
        const kvb_type_info *ti = kvb_type_get(want[i].t);
        assert_non_null(ti);
        assert_string_equal(ti->name, want[i].name);
        assert_string_equal(kvb_type_name(want[i].t), want[i].name);
        assert_int_equal(ti->block_elems, want[i].be);
        assert_int_equal(ti->block_bytes, want[i].bb);
        assert_int_equal(ti->supported, want[i].sup);
        kvb_type parsed;
        assert_int_equal(kvb_type_from_name(want[i].name, &parsed, NULL), KVB_OK);
        assert_int_equal((uint32_t)parsed, want[i].t);
        char lower[16];
        snprintf(lower, sizeof lower, "%s", want[i].name);
        for (char *c = lower; *c; c++) *c = (char)((*c >= 'A' && *c <= 'Z') ? *c + 32 : *c);
        assert_int_equal(kvb_type_from_name(lower, &parsed, NULL), KVB_OK);
        assert_int_equal((uint32_t)parsed, want[i].t);
    }
    for (uint32_t t = 0; t < 64; t++)
        if (kvb_type_get(t)) known++;
    assert_int_equal(known, (int)KVB_ARRAY_LEN(want)); /* removed numbers 4, 5, 31-33, 36-38 */
    static const uint32_t unknown[] = {4, 5, 31, 32, 33, 36, 37, 38, 40, 1000, UINT32_MAX};
    for (size_t i = 0; i < KVB_ARRAY_LEN(unknown); i++) {
        const uint32_t t = unknown[i];
        assert_null(kvb_type_get(t));
        assert_string_equal(kvb_type_name(t), "?");
        assert_int_equal(kvb_row_bytes(t, 32), 0);
    }

    kvb_err err;
    kvb_type parsed;
    assert_int_equal(kvb_type_from_name("q9_0", &parsed, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "q9_0"));
    assert_int_equal(kvb_type_from_name(NULL, &parsed, NULL), KVB_ERR_INVALID);
    assert_int_equal(kvb_type_from_name("", &parsed, NULL), KVB_ERR_INVALID);

    assert_int_equal(kvb_row_bytes(KVB_TYPE_F32, 7), 28);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_F16, 7), 14);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_BF16, 0), 0);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_Q8_0, 4096), 4352);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_Q4_0, 4096), 2304);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_Q8_0, 33), 0);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_Q6_K, 512), 420);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_Q6_K, 128), 0);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_F32, -32), 0);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_F64, INT64_MAX), 0); /* overflow */
    assert_int_equal(sizeof(kvb_block_q8_0), 34);
    assert_int_equal(sizeof(kvb_block_q4_0), 18);
    assert_int_equal(sizeof(kvb_block_q5_0), 22);
    assert_int_equal(sizeof(kvb_block_q4_k), 144);
    assert_int_equal(sizeof(kvb_block_q5_k), 176);
    assert_int_equal(sizeof(kvb_block_q6_k), 210);
    assert_int_equal(offsetof(kvb_block_q5_0, qs), 6);
    assert_int_equal(offsetof(kvb_block_q5_k, qs), 48);
    assert_int_equal(offsetof(kvb_block_q6_k, d), 208);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_Q5_0, 640), 440);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_Q4_K, 1024), 576);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_Q5_K, 2304), 9 * 176);
    assert_int_equal(kvb_row_bytes(KVB_TYPE_Q4_K, 640), 0);

    assert_int_equal(kvb_act_type(KVB_TYPE_F32), KVB_TYPE_F32);
    assert_int_equal(kvb_act_type(KVB_TYPE_F16), KVB_TYPE_F32);
    assert_int_equal(kvb_act_type(KVB_TYPE_BF16), KVB_TYPE_F32);
    assert_int_equal(kvb_act_type(KVB_TYPE_Q8_0), KVB_TYPE_Q8_0);
    assert_int_equal(kvb_act_type(KVB_TYPE_Q4_0), KVB_TYPE_Q8_0);
    assert_int_equal(kvb_act_type(KVB_TYPE_Q5_0), KVB_TYPE_Q8_0);
    assert_int_equal(kvb_act_type(KVB_TYPE_Q4_K), KVB_TYPE_Q8_0);
    assert_int_equal(kvb_act_type(KVB_TYPE_Q5_K), KVB_TYPE_Q8_0);
    assert_int_equal(kvb_act_type(KVB_TYPE_Q6_K), KVB_TYPE_Q8_0);
}

/* ---- fp16 / bf16 ------------------------------------------------------------------------- */

/* Independent model: round the exact value v (a float, so exact in double) to a format with
 * `mbits` fraction bits, minimum normal exponent emin and largest finite `maxv`, ties to even. */
static double round_model(double v, int mbits, int emin, double maxv) {
    const double a = fabs(v);
    if (a == 0) return v;
    int e;
    frexp(a, &e); /* a = f * 2^e, f in [0.5, 1) -> exponent of leading bit is e-1 */
    int lead = e - 1;
    if (lead < emin) lead = emin;
    const double ulp = ldexp(1.0, lead - mbits);
    double q = nearbyint(a / ulp) * ulp; /* a/ulp < 2^(mbits+2): exact; nearbyint is RNE */
    const double inf_at = maxv + ldexp(1.0, (int)floor(log2(maxv)) - mbits) / 2; /* half ulp above max */
    if (a >= inf_at) q = INFINITY;
    return v < 0 ? -q : q;
}

static void check_fp16_conv(float f) {
    const uint16_t h = kvb_f32_to_fp16(f);
    if (isnan(f)) {
        if (!((h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0 && (h & 0x0200) != 0 &&
              (h >> 15) == (f_bits(f) >> 31)))
            FAILF("fp16(NaN %08x) = %04x is not a quiet NaN of the same sign\n", f_bits(f), h);
        return;
    }
    const double want = round_model(f, 10, -14, 65504.0);
    const float got = kvb_fp16_to_f32(h);
    if (!((double)got == want && signbit(got) == signbit(f)))
        FAILF("fp16(%a [%08x]) = %04x (%a), model says %a\n", (double)f, f_bits(f), h, (double)got, want);
}

static void check_bf16_conv(float f) {
    const uint16_t h = kvb_f32_to_bf16(f);
    if (isnan(f)) {
        if (!((h & 0x7f80) == 0x7f80 && (h & 0x007f) != 0 && (h & 0x0040) != 0))
            FAILF("bf16(NaN %08x) = %04x is not a quiet NaN\n", f_bits(f), h);
        return;
    }
    const double want = round_model(f, 7, -126, 0x1.fep127);
    const float got = kvb_bf16_to_f32(h);
    if (!((double)got == want && signbit(got) == signbit(f)))
        FAILF("bf16(%a [%08x]) = %04x (%a), model says %a\n", (double)f, f_bits(f), h, (double)got, want);
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) static float hw_h2f(uint16_t h) { return _cvtsh_ss(h); }
__attribute__((target("f16c"))) static uint16_t hw_f2h(float f) {
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static int have_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}
#endif

static void test_fp16_exhaustive(void **state) {
    (void)state;
#if defined(__x86_64__)
    const int hw = have_f16c();
#endif
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = kvb_fp16_to_f32((uint16_t)h);
        const int is_nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
        const uint16_t back = kvb_f32_to_fp16(f);
        if (is_nan) {
            if (!isnan(f) || back != (uint16_t)(h | 0x200)) /* quietened, payload kept */
                FAILF("fp16 NaN %04x -> %08x -> %04x\n", h, f_bits(f), back);
        } else if (back != h) {
            FAILF("fp16 %04x -> %a -> %04x does not round-trip\n", h, (double)f, back);
        }
        if (!is_nan) { /* value check independent of the implementation */
            const int e = (h >> 10) & 31, m = h & 0x3ff;
            double v = e == 31 ? INFINITY : (e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25));
            if (h & 0x8000) v = -v;
            if ((double)f != v || !!signbit(f) != !!(h & 0x8000)) FAILF("fp16 %04x -> %a, want %a\n", h, (double)f, v);
        }
#if defined(__x86_64__)
        if (hw && f_bits(hw_h2f((uint16_t)h)) != f_bits(f))
            FAILF("fp16 %04x -> %08x, F16C says %08x\n", h, f_bits(f), f_bits(hw_h2f((uint16_t)h)));
#endif
    }
}

static void test_fp16_from_f32(void **state) {
    (void)state;
    /* ties and edges, exact expectations */
    static const struct {
        float f;
        uint16_t h;
    } kat[] = {
        {1.0f, 0x3c00},
        {1.0f + 0x1p-11f, 0x3c00},           /* tie -> even (down) */
        {1.0f + 3 * 0x1p-11f, 0x3c02},       /* tie -> even (up) */
        {1.0f + 0x1p-11f + 0x1p-23f, 0x3c01}, /* just above the tie */
        {65504.0f, 0x7bff},
        {65519.996f, 0x7bff},
        {65520.0f, 0x7c00}, /* tie with max odd mantissa -> inf */
        {-65520.0f, 0xfc00},
        {0x1p-14f, 0x0400},
        {0x1p-24f, 0x0001},
        {0x1p-25f, 0x0000},               /* tie between 0 and 2^-24 -> even 0 */
        {0x1p-25f + 0x1p-40f, 0x0001},
        {3 * 0x1p-25f, 0x0002},           /* 1.5 units -> even 2 */
        {0x1p-14f - 0x1p-25f, 0x0400},    /* 1023.5 units -> 1024 = smallest normal */
        {-0.0f, 0x8000},
        {0x1p-126f, 0x0000},
        {-0x1p-149f, 0x8000},
        {INFINITY, 0x7c00},
        {-INFINITY, 0xfc00},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(kat); i++)
        if (kvb_f32_to_fp16(kat[i].f) != kat[i].h)
            FAILF("fp16(%a) = %04x, want %04x\n", (double)kat[i].f, kvb_f32_to_fp16(kat[i].f), kat[i].h);
    assert_int_equal(kvb_f32_to_fp16(bits_f(0x7f800001u)), 0x7e00); /* sNaN -> quiet */
    assert_int_equal(kvb_f32_to_fp16(bits_f(0xffc00000u)), 0xfe00);
    assert_int_equal(kvb_f32_to_fp16(bits_f(0x7fbfe000u)), 0x7fff);

#if defined(__x86_64__)
    const int hw = have_f16c();
#endif
    /* sweep: every exponent and sign, all 1024 top mantissa patterns, low bits at and around the
     * rounding boundary, plus random low bits */
    static const uint32_t lows[] = {0, 1, 0xfff, 0x1000, 0x1001, 0x1fff};
    for (uint32_t se = 0; se < 512; se++) {
        for (uint32_t top = 0; top < 1024; top++) {
            for (size_t k = 0; k < KVB_ARRAY_LEN(lows) + 2; k++) {
                const uint32_t low = k < KVB_ARRAY_LEN(lows) ? lows[k] : (rnd32() & 0x1fff);
                const uint32_t u = (se << 23) | (top << 13) | low;
                const float f = bits_f(u);
                check_fp16_conv(f);
#if defined(__x86_64__)
                if (hw && hw_f2h(f) != kvb_f32_to_fp16(f))
                    FAILF("fp16(%08x) = %04x, F16C says %04x\n", u, kvb_f32_to_fp16(f), hw_f2h(f));
#endif
            }
        }
    }
    /* subnormal fp16 range needs every low bit pattern near the boundary: random fill */
    for (int i = 0; i < 1000000; i++) {
        const uint32_t u = (rnd32() & 0x80000000u) | ((uint32_t)rndint(98, 114) << 23) | (rnd32() & 0x7fffffu);
        check_fp16_conv(bits_f(u));
#if defined(__x86_64__)
        if (hw && hw_f2h(bits_f(u)) != kvb_f32_to_fp16(bits_f(u)))
            FAILF("fp16(%08x) = %04x, F16C says %04x\n", u, kvb_f32_to_fp16(bits_f(u)), hw_f2h(bits_f(u)));
#endif
    }
}

static void test_bf16(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = kvb_bf16_to_f32((uint16_t)h);
        assert_int_equal(f_bits(f), h << 16);
        const int is_nan = (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0;
        const uint16_t back = kvb_f32_to_bf16(f);
        if (is_nan ? back != (uint16_t)(h | 0x40) : back != h)
            FAILF("bf16 %04x -> %08x -> %04x\n", h, f_bits(f), back);
    }
    static const struct {
        uint32_t f;
        uint16_t h;
    } kat[] = {
        {0x3f808000u, 0x3f80}, /* tie -> even down */
        {0x3f818000u, 0x3f82}, /* tie -> even up */
        {0x3f808001u, 0x3f81},
        {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds to inf */
        {0x7f7f7fffu, 0x7f7f},
        {0x00008000u, 0x0000}, /* subnormal tie -> even, no flushing */
        {0x00018000u, 0x0002},
        {0x7f800001u, 0x7fc0}, /* sNaN -> quiet */
        {0xff800000u, 0xff80},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(kat); i++)
        if (kvb_f32_to_bf16(bits_f(kat[i].f)) != kat[i].h)
            FAILF("bf16(%08x) = %04x, want %04x\n", kat[i].f, kvb_f32_to_bf16(bits_f(kat[i].f)), kat[i].h);
    static const uint32_t lows[] = {0, 1, 0x7fff, 0x8000, 0x8001, 0xffff};
    for (uint32_t se = 0; se < 512; se++)
        for (uint32_t top = 0; top < 128; top++)
            for (size_t k = 0; k < KVB_ARRAY_LEN(lows) + 4; k++) {
                const uint32_t low = k < KVB_ARRAY_LEN(lows) ? lows[k] : (rnd32() & 0xffff);
                check_bf16_conv(bits_f((se << 23) | (top << 16) | low));
            }
}

/* ---- quantisers -------------------------------------------------------------------------- */

static void test_quantizer_known_bytes(void **state) {
    (void)state;
    float x[32] = {127.0f, 2.5f, -2.5f, 3.5f, 0.5f, -0.5f, 1.5f, -126.5f, 126.49f};
    kvb_block_q8_0 file, act;
    kvb_f32_to_row(KVB_TYPE_Q8_0, x, &file, 32);
    assert_int_equal(file.d, 0x3c00); /* d = 127/127 = 1 */
    /* llama.cpp's quantize_row_q8_0_ref: roundf, halves away from zero */
    static const int8_t want_file[9] = {127, 3, -3, 4, 1, -1, 2, -127, 126};
    assert_memory_equal(file.qs, want_file, 9);
    for (int j = 9; j < 32; j++) assert_int_equal(file.qs[j], 0);
    for (size_t s = 0; s < KVB_ARRAY_LEN(k_simd) + 1; s++) {
        if (s < KVB_ARRAY_LEN(k_simd) ? !force(k_simd[s]) : !force("scalar")) continue;
        kvb_quantize_act(KVB_TYPE_Q8_0, x, &act, 32); /* activations: halves to even */
        static const int8_t want_act[9] = {127, 2, -2, 4, 0, 0, 2, -126, 126};
        assert_int_equal(act.d, 0x3c00);
        assert_memory_equal(act.qs, want_act, 9);
    }
    force("auto");

    /* Q4_0: d = max / -8 where max is the signed value of largest magnitude */
    float y[32] = {-8.0f, 7.0f, 0.0f, 0.5f, -0.5f, 1.49f, 7.6f, 3.5f};
    for (int j = 8; j < 32; j++) y[j] = (float)(j % 17) - 8.0f;
    kvb_block_q4_0 q4;
    kvb_f32_to_row(KVB_TYPE_Q4_0, y, &q4, 32);
    assert_int_equal(q4.d, 0x3c00); /* -8 / -8 = 1 */
    static const uint8_t want_lo[8] = {0, 15, 8, 9, 8, 9, 15, 12}; /* trunc(x + 8.5), max 15 */
    for (int j = 0; j < 8; j++) assert_int_equal(q4.qs[j] & 15, want_lo[j]);
    for (int j = 16; j < 32; j++) {
        const int q = (int)floorf(y[j] + 8.5f);
        assert_int_equal(q4.qs[j - 16] >> 4, q > 15 ? 15 : q);
    }
    float back[32];
    kvb_row_to_f32(KVB_TYPE_Q4_0, &q4, back, 32);
    assert_true(back[0] == -8.0f && back[1] == 7.0f && back[2] == 0.0f);

    /* zero block, NaN and tiny inputs give defined bytes */
    float z[32] = {0};
    kvb_f32_to_row(KVB_TYPE_Q8_0, z, &file, 32);
    assert_int_equal(file.d, 0);
    for (int j = 0; j < 32; j++) assert_int_equal(file.qs[j], 0);
    z[3] = NAN;
    kvb_quantize_act(KVB_TYPE_Q8_0, z, &act, 32);
    assert_true(isnan(kvb_fp16_to_f32(act.d))); /* NaN propagates through d */
    for (int j = 0; j < 32; j++) assert_int_equal(act.qs[j], 0);
    z[3] = 0x1p-140f; /* 1/d overflows to inf */
    kvb_quantize_act(KVB_TYPE_Q8_0, z, &act, 32);
    assert_int_equal(act.qs[3], 127);
    assert_int_equal(act.qs[0], 0);
}

static void fill_act_floats(float *x, int64_t n, int mode) {
    for (int64_t i = 0; i < n; i++) {
        float v;
        switch (mode) {
        case 0: v = kvb_rng_normal(&g_rng) * ldexpf(1.0f, rndint(-8, 8)); break;
        case 1: v = (float)rndint(-4096, 4096) * ldexpf(1.0f, rndint(0, 6)); break; /* ties */
        case 2: v = kvb_rng_normal(&g_rng) * ldexpf(1.0f, rndint(-150, -120)); break; /* tiny */
        default: v = kvb_rng_normal(&g_rng) * ldexpf(1.0f, rndint(-30, 15)); break;
        }
        if (rndint(0, 15) == 0) v = rndint(0, 1) ? 0.0f : -0.0f;
        x[i] = v;
    }
    /* whole zero blocks and exact-tie blocks (amax = 127 * 2^e, values (k + 1/2) * 2^e) */
    for (int64_t b = 0; b + 32 <= n; b += 32) {
        const int what = rndint(0, 9);
        if (what == 0) memset(x + b, 0, 32 * sizeof(float));
        if (what == 1) {
            const int e = rndint(-20, 10);
            for (int j = 0; j < 32; j++) x[b + j] = ldexpf((float)rndint(-126, 125) + 0.5f, e);
            x[b + rndint(0, 31)] = ldexpf(rndint(0, 1) ? 127.0f : -127.0f, e);
        }
    }
}

static void test_quantize_error_bounds(void **state) {
    (void)state;
    enum { N = 32 * 512 };
    float *x = xmalloc(N * sizeof(float)), *back = xmalloc(N * sizeof(float));
    kvb_block_q8_0 *q8 = xmalloc(N / 32 * sizeof *q8);
    kvb_block_q4_0 *q4 = xmalloc(N / 32 * sizeof *q4);
    for (int round = 0; round < 8; round++) {
        fill_act_floats(x, N, round % 4 == 2 ? 0 : round % 4);
        for (int which = 0; which < 3; which++) {
            const uint32_t type = which == 2 ? KVB_TYPE_Q4_0 : KVB_TYPE_Q8_0;
            if (which == 0) kvb_f32_to_row(type, x, q8, N);
            if (which == 1) kvb_quantize_act(type, x, q8, N);
            if (which == 2) kvb_f32_to_row(type, x, q4, N);
            kvb_row_to_f32(type, which == 2 ? (void *)q4 : (void *)q8, back, N);
            for (int b = 0; b < N / 32; b++) {
                double amax = 0;
                for (int j = 0; j < 32; j++) amax = fmax(amax, fabs((double)x[32 * b + j]));
                /* Q8_0: half a step of d = amax/127, plus the fp16 rounding of d (rel 2^-11 of
                 * |q*d| <= amax), plus subnormal fp16 d (abs 2^-25 per unit of q). Q4_0: one
                 * full step |d| = amax/8 (the clamp at +7), same fp16 terms. */
                const double step = which == 2 ? amax / 8 : amax / 127 / 2;
                const double bound = step * (1 + 1e-6) + amax * 0x1p-11 + 128 * 0x1p-25;
                for (int j = 0; j < 32; j++) {
                    const double err = fabs((double)back[32 * b + j] - (double)x[32 * b + j]);
                    if (!(err <= bound))
                        FAILF("%s quantiser %d: block %d elem %d x=%a back=%a err %g > %g\n",
                              kvb_type_name(type), which, b, j, (double)x[32 * b + j],
                              (double)back[32 * b + j], err, bound);
                }
            }
        }
    }
    /* F16 / BF16 rows: relative error 2^-11 / 2^-8 for normal values in range */
    uint16_t *h = xmalloc(N * 2);
    fill_act_floats(x, N, 0);
    kvb_f32_to_row(KVB_TYPE_F16, x, h, N);
    kvb_row_to_f32(KVB_TYPE_F16, h, back, N);
    for (int i = 0; i < N; i++)
        if (fabsf(x[i]) >= 0x1p-14f && fabsf(x[i]) <= 65504.0f) assert_true(fabs((double)back[i] - x[i]) <= fabs(x[i]) * 0x1p-11);
    kvb_f32_to_row(KVB_TYPE_BF16, x, h, N);
    kvb_row_to_f32(KVB_TYPE_BF16, h, back, N);
    for (int i = 0; i < N; i++) assert_true(fabs((double)back[i] - x[i]) <= fabs(x[i]) * 0x1p-8);
    kvb_f32_to_row(KVB_TYPE_F32, x, back, N);
    assert_memory_equal(back, x, N * sizeof(float));
    free(h);
    free(x);
    free(back);
    free(q8);
    free(q4);
}

static void test_quantize_act_simd(void **state) {
    (void)state;
    enum { N = 32 * 1024 };
    float *x = xmalloc(N * sizeof(float));
    kvb_block_q8_0 *ref = xmalloc(N / 32 * sizeof *ref), *got = xmalloc(N / 32 * sizeof *got);
    int compared = 0;
    for (int round = 0; round < 12; round++) {
        fill_act_floats(x, N, round % 4);
        if (round >= 8) /* specials sprinkled in: NaN, inf, huge (fp16 d overflows), subnormal */
            for (int k = 0; k < 200; k++) {
                static const float sp[] = {NAN, -NAN, INFINITY, -INFINITY, 3e38f, -1e7f, 0x1p-149f, -0x1p-130f};
                x[rndint(0, N - 1)] = sp[rndint(0, (int)KVB_ARRAY_LEN(sp) - 1)];
            }
        static const int64_t lens[] = {32, 64, 96, 512, N};
        for (size_t li = 0; li < KVB_ARRAY_LEN(lens); li++) {
            const int64_t n = lens[li];
            force("scalar");
            kvb_quantize_act(KVB_TYPE_Q8_0, x, ref, n);
            for (size_t s = 0; s < KVB_ARRAY_LEN(k_simd); s++) {
                if (!force(k_simd[s])) continue;
                memset(got, 0xa5, N / 32 * sizeof *got);
                kvb_quantize_act(KVB_TYPE_Q4_0, x, got, n); /* same activation type */
                for (int64_t b = 0; b < n / 32; b++)
                    if (memcmp(&ref[b], &got[b], sizeof ref[b]) != 0)
                        FAILF("%s quantize_act differs from scalar at block %" PRId64 " (n %" PRId64 ", round %d)\n",
                              k_simd[s], b, n, round);
                if (n < N && ((uint8_t *)got)[n / 32 * 34] != 0xa5)
                    FAILF("%s quantize_act wrote past the row (n %" PRId64 ")\n", k_simd[s], n);
                compared++;
            }
        }
    }
    force("auto");
    print_message("quantize_act: %d SIMD comparisons (best kernels here: %s)\n", compared, kvb_simd_name());
    float *f = xmalloc(64 * sizeof(float));
    kvb_quantize_act(KVB_TYPE_F32, x, f, 64);
    assert_memory_equal(f, x, 64 * sizeof(float));
    free(f);
    free(x);
    free(ref);
    free(got);
}

/* ---- the test's own decoding of the quantised weight types ------------------------------
 * Written from the layouts documented in kvb_quant.h (ggml's), without calling src/quant. */

static int is_kquant(uint32_t t) { return t == KVB_TYPE_Q4_K || t == KVB_TYPE_Q5_K || t == KVB_TYPE_Q6_K; }
static int is_quant(uint32_t t) {
    return t == KVB_TYPE_Q8_0 || t == KVB_TYPE_Q4_0 || t == KVB_TYPE_Q5_0 || is_kquant(t);
}
static int block_bytes(uint32_t t) { return kvb_type_get(t)->block_bytes; }
static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* The signed weight integer wq_j (j < 32) of a Q8_0, Q4_0 or Q5_0 block. */
static int t_wq32(uint32_t type, const uint8_t *blk, int j) {
    if (type == KVB_TYPE_Q8_0) return (int8_t)blk[2 + j];
    const uint8_t byte = type == KVB_TYPE_Q4_0 ? blk[2 + j % 16] : blk[6 + j % 16];
    const int nib = j < 16 ? byte & 15 : byte >> 4;
    if (type == KVB_TYPE_Q4_0) return nib - 8;
    return nib + 16 * ((blk[2 + j / 8] >> (j % 8)) & 1) - 16;
}

/* Sub-block s's 6-bit scale and min of a Q4_K / Q5_K super-block (sc: its 12 packed bytes). */
static void t_k_scale(const uint8_t *sc, int s, int *scale, int *min) {
    if (s < 4) {
        *scale = sc[s] & 0x3f;
        *min = sc[4 + s] & 0x3f;
    } else {
        *scale = (sc[s + 4] & 0x0f) + 16 * (sc[s - 4] >> 6);
        *min = (sc[s + 4] >> 4) + 16 * (sc[s] >> 6);
    }
}

/* q (0..15, or 0..31 for Q5_K) of element e (0..255) of a Q4_K / Q5_K super-block. */
static int t_k_q(const uint8_t *sb, int five, int e) {
    const uint8_t *qs = sb + (five ? 48 : 16);
    const int s = e / 32, l = e % 32;
    int q = (s & 1) ? qs[32 * (s / 2) + l] >> 4 : qs[32 * (s / 2) + l] & 15;
    if (five) q += 16 * ((sb[16 + l] >> s) & 1);
    return q;
}

/* q (0..63) of element e of a Q6_K super-block. */
static int t_q6(const uint8_t *sb, int e) {
    const int half = e / 128, c = (e % 128) / 32, l = e % 32;
    const uint8_t lowbyte = sb[64 * half + 32 * (c & 1) + l];
    const int lo = c < 2 ? lowbyte & 15 : lowbyte >> 4;
    return lo + 16 * ((sb[128 + 32 * half + l] >> (2 * c)) & 3);
}

/* ---- canonical dot --------------------------------------------------------------------- */

/* What activation block b contributes to its lane, per the specification: n terms, each an exact
 * integer times an f32 scale (f: as the spec rounds it; exact: the same without rounding). */
typedef struct {
    int n;
    int64_t i[2];
    float f[2];
    double exact[2];
} spec_terms;

static void spec_block(uint32_t type, const uint8_t *w, const kvb_block_q8_0 *xb, int64_t b, spec_terms *t) {
    const float xd = kvb_fp16_to_f32(xb->d);
    t->n = 1;
    if (!is_kquant(type)) {
        const uint8_t *blk = w + b * block_bytes(type);
        int64_t s = 0;
        for (int j = 0; j < 32; j++) s += (int64_t)t_wq32(type, blk, j) * xb->qs[j];
        const float wd = kvb_fp16_to_f32(rd16(blk));
        t->i[0] = s;
        t->f[0] = wd * xd;
        t->exact[0] = (double)wd * (double)xd;
    } else if (type == KVB_TYPE_Q6_K) {
        const uint8_t *sb = w + (b / 8) * 210;
        const int k = (int)(b % 8);
        int64_t half[2] = {0, 0};
        for (int j = 0; j < 32; j++) half[j / 16] += (int64_t)(t_q6(sb, 32 * k + j) - 32) * xb->qs[j];
        const int8_t *sc = (const int8_t *)(sb + 192);
        const float wd = kvb_fp16_to_f32(rd16(sb + 208));
        t->i[0] = sc[2 * k] * half[0] + sc[2 * k + 1] * half[1];
        t->f[0] = wd * xd;
        t->exact[0] = (double)wd * (double)xd;
    } else {
        const int five = type == KVB_TYPE_Q5_K;
        const uint8_t *sb = w + (b / 8) * (five ? 176 : 144);
        const int k = (int)(b % 8);
        int sc, m;
        t_k_scale(sb + 4, k, &sc, &m);
        int64_t s = 0, sx = 0;
        for (int j = 0; j < 32; j++) {
            s += (int64_t)t_k_q(sb, five, 32 * k + j) * xb->qs[j];
            sx += xb->qs[j];
        }
        const float wd = kvb_fp16_to_f32(rd16(sb)), wm = kvb_fp16_to_f32(rd16(sb + 2));
        t->n = 2;
        t->i[0] = s;
        t->f[0] = (wd * (float)sc) * xd;
        t->exact[0] = (double)wd * sc * (double)xd;
        t->i[1] = -sx;
        t->f[1] = (wm * (float)m) * xd;
        t->exact[1] = (double)wm * m * (double)xd;
    }
    for (int k = 0; k < t->n; k++) /* the spec's claim: every integer converts to f32 exactly */
        if (!(t->i[k] > -(1 << 24) && t->i[k] < (1 << 24)))
            FAILF("%s block %" PRId64 ": integer sum %" PRId64 " is not exact in f32\n", kvb_type_name(type), b, t->i[k]);
}

/* The specification written independently of dot_scalar.c: lane-major loops, the test's own
 * block decoding, explicit tree. */
static float spec_dot(uint32_t type, const void *w, const void *a, int64_t n) {
    float acc[16];
    if (is_quant(type)) {
        const kvb_block_q8_0 *x = a;
        for (int l = 0; l < 16; l++) {
            acc[l] = 0.0f;
            for (int64_t b = l; b < n / 32; b += 16) {
                spec_terms t;
                spec_block(type, w, &x[b], b, &t);
                for (int k = 0; k < t.n; k++) acc[l] = fmaf((float)t.i[k], t.f[k], acc[l]);
            }
        }
    } else {
        const float *x = a;
        for (int l = 0; l < 16; l++) {
            acc[l] = 0.0f;
            for (int64_t i = l; i < n; i += 16) {
                float wi;
                if (type == KVB_TYPE_F32) wi = ((const float *)w)[i];
                else if (type == KVB_TYPE_F16) wi = kvb_fp16_to_f32(((const uint16_t *)w)[i]);
                else wi = bits_f((uint32_t)((const uint16_t *)w)[i] << 16);
                acc[l] = fmaf(wi, x[i], acc[l]);
            }
        }
    }
    float a8[8], a4[4], a2[2];
    for (int i = 0; i < 8; i++) a8[i] = acc[i] + acc[i + 8];
    for (int i = 0; i < 4; i++) a4[i] = a8[i] + a8[i + 4];
    for (int i = 0; i < 2; i++) a2[i] = a4[i] + a4[i + 2];
    return a2[0] + a2[1];
}

/* Fills one weight row of n elements (mode as fill_act_floats for float types). */
static int g_tame; /* 1: no huge scales / raw activation blocks (accuracy test: no overflow) */

/* A random fp16 scale: zero, subnormal, huge, or normal of either sign (tame: normal only). */
static uint16_t rand_scale(int *zero_qs) {
    *zero_qs = 0;
    switch (g_tame ? 9 : rndint(0, 9)) {
    case 0: return 0;                                              /* zero scale */
    case 1: return (uint16_t)(rnd32() & 0x83ff);                   /* subnormal */
    case 2: *zero_qs = 1; return kvb_f32_to_fp16(kvb_rng_normal(&g_rng)); /* zero weights */
    case 3: return (uint16_t)((rnd32() & 0x8000) | (uint32_t)rndint(0x5800, 0x7bff)); /* huge */
    default: return kvb_f32_to_fp16(kvb_rng_normal(&g_rng) * ldexpf(1.0f, rndint(-12, 2)));
    }
}

static void fill_weight_row(uint32_t type, uint8_t *row, int64_t n, int mode, float *tmp) {
    if (is_quant(type)) {
        const int bb = block_bytes(type);
        const int64_t nblk = n / kvb_type_get(type)->block_elems;
        for (int64_t b = 0; b < nblk; b++) {
            uint8_t *blk = row + b * bb;
            for (int j = 0; j < bb; j++) blk[j] = (uint8_t)rnd32(); /* any quant/scale bytes are valid */
            int zero_qs;
            const uint16_t d = rand_scale(&zero_qs);
            switch (type) {
            case KVB_TYPE_Q8_0:
                if (zero_qs) memset(blk + 2, 0, 32);
                if (rndint(0, 7) == 0) blk[2 + rndint(0, 31)] = 0x80; /* -128 */
                memcpy(blk, &d, 2);
                break;
            case KVB_TYPE_Q4_0:
                if (zero_qs) memset(blk + 2, 0x88, 16);
                memcpy(blk, &d, 2);
                break;
            case KVB_TYPE_Q5_0: /* value 0 is q = 16: fifth bit set, nibble 0 */
                if (zero_qs) memset(blk + 2, 0xff, 4), memset(blk + 6, 0, 16);
                memcpy(blk, &d, 2);
                break;
            case KVB_TYPE_Q6_K: /* q = 32: nibble 0, top bits 0b10 */
                if (zero_qs) memset(blk, 0, 128), memset(blk + 128, 0xaa, 64);
                memcpy(blk + 208, &d, 2);
                break;
            default: { /* Q4_K, Q5_K: d, dmin drawn independently */
                int unused;
                const uint16_t dmin = rand_scale(&unused);
                memcpy(blk, &d, 2);
                memcpy(blk + 2, &dmin, 2);
                if (zero_qs) memset(blk + 4, 0, 12); /* all scales and mins 0 */
                break;
            }
            }
        }
        return;
    }
    fill_act_floats(tmp, n, mode);
    if (type == KVB_TYPE_F16 && mode == 2) fill_act_floats(tmp, n, 0); /* fp16 can't go tiny */
    if (type == KVB_TYPE_F16)
        for (int64_t i = 0; i < n; i++) tmp[i] = fminf(fmaxf(tmp[i], -6e4f), 6e4f);
    kvb_f32_to_row(type, tmp, row, n);
}

/* Activation rows for the type: f32 (mode) or Q8_0 from kvb_quantize_act / raw random blocks. */
static void fill_act_row(uint32_t type, uint8_t *row, int64_t n, int mode, float *tmp) {
    if (!is_quant(type)) {
        fill_act_floats((float *)(void *)row, n, mode);
        return;
    }
    fill_act_floats(tmp, n, mode == 2 ? 0 : mode);
    force("scalar");
    kvb_quantize_act(type, tmp, row, n);
    kvb_block_q8_0 *x = (kvb_block_q8_0 *)(void *)row;
    for (int64_t b = 0; b < n / 32; b++) {
        if (!g_tame && rndint(0, 5) == 0) { /* raw block: any q in [-127, 127], any finite scale */
            for (int j = 0; j < 32; j++) x[b].qs[j] = (int8_t)rndint(-127, 127);
            x[b].d = (uint16_t)(rnd32() & 0xffff);
            if ((x[b].d & 0x7c00) == 0x7c00) x[b].d &= 0xbfff;
        }
    }
}

/* ---- Q5_0 and K-quant conversions ------------------------------------------------------ */

static const uint32_t k_new_quants[] = {KVB_TYPE_Q5_0, KVB_TYPE_Q4_K, KVB_TYPE_Q5_K, KVB_TYPE_Q6_K};

/* (a) kvb_row_to_f32 on random valid blocks (random quant and scale bytes; zero, subnormal, huge,
 * negative fp16 scales) equals the float64 reference model's own decoder rounded to f32, bit for
 * bit: every element's exact value fits a double, and ours is that value rounded once. */
static void test_dequant_vs_reference(void **state) {
    (void)state;
    static const uint32_t types[] = {KVB_TYPE_Q8_0, KVB_TYPE_Q4_0, KVB_TYPE_Q5_0,
                                     KVB_TYPE_Q4_K, KVB_TYPE_Q5_K, KVB_TYPE_Q6_K};
    int64_t compared = 0;
    for (size_t ti = 0; ti < KVB_ARRAY_LEN(types); ti++) {
        const uint32_t type = types[ti];
        for (int round = 0; round < 40; round++) {
            const int64_t n = (is_kquant(type) ? 256 : 32) * rndint(1, 24);
            const size_t rb = kvb_row_bytes(type, n);
            assert_int_equal(rb, ref_row_bytes(type, n));
            uint8_t *w = xmalloc(rb);
            float *got = xmalloc((size_t)n * sizeof(float));
            double *want = xmalloc((size_t)n * sizeof(double));
            fill_weight_row(type, w, n, 0, NULL);
            for (int64_t i = 0; i < n; i++) got[i] = bits_f(POISON_BITS);
            kvb_row_to_f32(type, w, got, n);
            assert_int_equal(ref_dequant_row(type, w, want, n), 0);
            for (int64_t i = 0; i < n; i++) {
                if (f_bits(got[i]) != f_bits((float)want[i]))
                    FAILF("%s kvb_row_to_f32 element %" PRId64 " of %" PRId64 ": %a [%08x], reference %a\n",
                          kvb_type_name(type), i, n, (double)got[i], f_bits(got[i]), want[i]);
                compared++;
            }
            free(w);
            free(got);
            free(want);
        }
    }
    print_message("dequantisation: %" PRId64 " elements equal to the float64 reference\n", compared);
}

/* Q5_0's quantiser on known values (ggml's rule: d = max/-16, q = min(31, trunc(x/d + 16.5))). */
static void test_q5_0_known_bytes(void **state) {
    (void)state;
    float x[32] = {-16.0f, 15.0f, 0.0f, 0.5f, -0.51f, 15.6f, -15.5f, 7.49f};
    for (int j = 8; j < 32; j++) x[j] = (float)(j % 23) - 11.0f;
    kvb_block_q5_0 b;
    kvb_f32_to_row(KVB_TYPE_Q5_0, x, &b, 32);
    assert_int_equal(b.d, 0x3c00); /* max = -16 (largest |x|), d = -16 / -16 = 1 */
    static const int want_head[8] = {0, 31, 16, 17, 15, 31, 1, 23}; /* trunc(x + 16.5), max 31 */
    for (int j = 0; j < 32; j++) {
        const int want = j < 8 ? want_head[j] : (int)x[j] + 16;
        const int nib = j < 16 ? b.qs[j] & 15 : b.qs[j - 16] >> 4;
        const int fifth = (b.qh[j / 8] >> (j % 8)) & 1;
        if (nib + 16 * fifth != want) FAILF("Q5_0 element %d: q %d, want %d\n", j, nib + 16 * fifth, want);
    }
    float back[32];
    kvb_row_to_f32(KVB_TYPE_Q5_0, &b, back, 32);
    assert_true(back[0] == -16.0f && back[1] == 15.0f && back[2] == 0.0f && back[3] == 1.0f && back[5] == 15.0f);
    /* zero block and NaN give defined bytes */
    float z[32] = {0};
    kvb_f32_to_row(KVB_TYPE_Q5_0, z, &b, 32);
    assert_int_equal(b.d, 0x8000); /* d = 0 / -16 = -0, as in ggml and gguf-py */
    for (int j = 0; j < 16; j++) assert_int_equal(b.qs[j], 0); /* q = trunc(0 * 0 + 16.5) = 16 */
    for (int j = 0; j < 4; j++) assert_int_equal(b.qh[j], 0xff);
    z[7] = NAN;
    kvb_f32_to_row(KVB_TYPE_Q5_0, z, &b, 32);
    kvb_row_to_f32(KVB_TYPE_Q5_0, &b, back, 32);
    for (int j = 0; j < 32; j++) assert_true(back[j] == 0.0f || j == 7);
}

/* (d) Round trip x -> kvb_f32_to_row -> kvb_row_to_f32 within the bounds kvb_quant.h states.
 *   Q5_0 (ggml's rule): one step |d| = amax/16 (the clamp at q = 31), plus the fp16 rounding of d
 *        (rel 2^-11 of |q*d| <= amax) and subnormal fp16 d (2^-25 per unit of q).
 *   Q4_K/Q5_K (L = 15/31): per super-block, with mn_s = -min(0, min x_s), Mn = max mn_s,
 *        R_s = max x_s + mn_s: dmin <= Mn/63 (1+2^-10) + 2^-24; the sub-block's step d*sc_s <=
 *        (R_s + dmin)/L + d with d <= max_s((R_s + dmin)/L)/63 (1+2^-10) + 2^-24; error <= step/2.
 *   Q6_K: step_t = max|x_t|/31, d <= max step/127 (1+2^-10) + 2^-24, step <= step_t + d; error
 *        <= step/2.
 * Plus 2^-20 of the sub-block's magnitude for f32 rounding in the quantiser. */
static void test_new_quantizer_bounds(void **state) {
    (void)state;
    enum { N = 256 * 64 };
    float *x = xmalloc(N * sizeof(float)), *back = xmalloc(N * sizeof(float));
    uint8_t *q = xmalloc((size_t)N / 32 * 22 + (size_t)N / 256 * 210);
    for (int round = 0; round < 16; round++) {
        fill_act_floats(x, N, round % 4);
        if (round >= 8) /* one-signed and constant super-blocks, single outliers */
            for (int sb = 0; sb < N / 256; sb++) {
                float *v = x + 256 * sb;
                const int what = rndint(0, 4);
                for (int i = 0; i < 256; i++) {
                    if (what == 0) v[i] = fabsf(v[i]);
                    if (what == 1) v[i] = -fabsf(v[i]);
                    if (what == 2) v[i] = 0.37f;
                }
                if (what == 3) v[rndint(0, 255)] = ldexpf(1.0f, rndint(4, 12)) * (rndint(0, 1) ? 1 : -1);
            }
        for (size_t ti = 0; ti < KVB_ARRAY_LEN(k_new_quants); ti++) {
            const uint32_t type = k_new_quants[ti];
            kvb_f32_to_row(type, x, q, N);
            kvb_row_to_f32(type, q, back, N);
            for (int sb = 0; sb < N / 256; sb++) {
                const float *v = x + 256 * sb;
                double bound[16]; /* per 16 elements */
                if (type == KVB_TYPE_Q5_0) {
                    for (int b = 0; b < 8; b++) {
                        double amax = 0;
                        for (int j = 0; j < 32; j++) amax = fmax(amax, fabs((double)v[32 * b + j]));
                        bound[2 * b] = bound[2 * b + 1] = amax / 16 * (1 + 1e-6) + amax * 0x1p-11 + 32 * 0x1p-25;
                    }
                } else if (type == KVB_TYPE_Q6_K) {
                    double step[16], smax = 0;
                    for (int t = 0; t < 16; t++) {
                        double a = 0;
                        for (int j = 0; j < 16; j++) a = fmax(a, fabs((double)v[16 * t + j]));
                        step[t] = a / 31;
                        smax = fmax(smax, step[t]);
                    }
                    const double d = smax / 127 * (1 + 0x1p-10) + 0x1p-24;
                    for (int t = 0; t < 16; t++) bound[t] = (step[t] + d) / 2 + step[t] * 31 * 0x1p-20;
                } else {
                    const double L = type == KVB_TYPE_Q4_K ? 15 : 31;
                    double mn[8], hi[8], Mn = 0, smax = 0;
                    for (int s8 = 0; s8 < 8; s8++) {
                        double lo = 0;
                        hi[s8] = -INFINITY;
                        for (int j = 0; j < 32; j++) {
                            lo = fmin(lo, (double)v[32 * s8 + j]);
                            hi[s8] = fmax(hi[s8], (double)v[32 * s8 + j]);
                        }
                        mn[s8] = -lo;
                        Mn = fmax(Mn, mn[s8]);
                    }
                    const double dmin = Mn / 63 * (1 + 0x1p-10) + 0x1p-24;
                    for (int s8 = 0; s8 < 8; s8++) smax = fmax(smax, fmax(0, hi[s8] + mn[s8] + dmin) / L);
                    const double d = smax / 63 * (1 + 0x1p-10) + 0x1p-24;
                    for (int s8 = 0; s8 < 8; s8++) {
                        const double step = fmax(0, hi[s8] + mn[s8] + dmin) / L + d;
                        bound[2 * s8] = bound[2 * s8 + 1] = step / 2 + (fabs(hi[s8]) + mn[s8] + dmin) * 0x1p-20;
                    }
                }
                for (int i = 0; i < 256; i++) {
                    const double err = fabs((double)back[256 * sb + i] - (double)v[i]);
                    if (!(err <= bound[i / 16]))
                        FAILF("%s quantiser round %d: super-block %d elem %d x=%a back=%a err %g > %g\n",
                              kvb_type_name(type), round, sb, i, (double)v[i], (double)back[256 * sb + i], err,
                              bound[i / 16]);
                }
            }
        }
    }
    /* a zero super-block stays exactly zero with zero scales */
    memset(x, 0, 256 * sizeof(float));
    for (size_t ti = 1; ti < KVB_ARRAY_LEN(k_new_quants); ti++) {
        kvb_f32_to_row(k_new_quants[ti], x, q, 256);
        kvb_row_to_f32(k_new_quants[ti], q, back, 256);
        for (int i = 0; i < 256; i++) assert_true(back[i] == 0.0f);
    }
    free(x);
    free(back);
    free(q);
}


typedef struct {
    uint32_t type;
    int64_t n;
    int rows, toks;
    int mode;
} mm_case;

static int64_t g_mm_compared;

/* One tile: scalar kvb_dot per pair is the reference; every SIMD set's kvb_matmul_tile and
 * kvb_dot must match it bit for bit, write every output and nothing in the stride gaps. */
static void run_mm_case(const mm_case *c) {
    const size_t rb = kvb_row_bytes(c->type, c->n);
    const uint32_t at = kvb_act_type(c->type);
    const size_t ab = kvb_row_bytes(at, c->n);
    assert_true(rb > 0 && ab > 0);
    const size_t ws = rb + 4 * (size_t)rndint(0, 3), as = ab + 4 * (size_t)rndint(0, 3);
    const size_t ys = (size_t)c->rows + (size_t)rndint(0, 3);
    uint8_t *w = xmalloc(ws * (size_t)c->rows);  /* [rows][ws bytes] */
    uint8_t *a = xmalloc(as * (size_t)c->toks);  /* [toks][as bytes] */
    float *tmp = xmalloc((size_t)c->n * sizeof(float));
    const size_t ny = ys * (size_t)c->toks;
    float *ref = xmalloc(ny * sizeof(float)), *y = xmalloc(ny * sizeof(float)); /* [toks][ys] */
    memset(w, 0x5a, ws * (size_t)c->rows);
    memset(a, 0x5a, as * (size_t)c->toks);
    for (int r = 0; r < c->rows; r++) fill_weight_row(c->type, w + (size_t)r * ws, c->n, c->mode, tmp);
    for (int t = 0; t < c->toks; t++) fill_act_row(c->type, a + (size_t)t * as, c->n, c->mode, tmp);

    force("scalar");
    for (size_t i = 0; i < ny; i++) ref[i] = bits_f(POISON_BITS);
    for (int t = 0; t < c->toks; t++)
        for (int r = 0; r < c->rows; r++) {
            ref[(size_t)t * ys + (size_t)r] = kvb_dot(c->type, w + (size_t)r * ws, a + (size_t)t * as, c->n);
            if (r < 2 && t < 2) { /* the scalar code against the independent model */
                const float s = spec_dot(c->type, w + (size_t)r * ws, a + (size_t)t * as, c->n);
                if (!same(s, ref[(size_t)t * ys + (size_t)r]))
                    FAILF("scalar %s n=%" PRId64 ": %a but the spec model says %a\n", kvb_type_name(c->type),
                          c->n, (double)ref[(size_t)t * ys + (size_t)r], (double)s);
            }
        }
    for (size_t s = 0; s < KVB_ARRAY_LEN(k_simd) + 1; s++) {
        const char *name = s < KVB_ARRAY_LEN(k_simd) ? k_simd[s] : "scalar";
        if (!force(name)) continue;
        for (size_t i = 0; i < ny; i++) y[i] = bits_f(POISON_BITS);
        kvb_matmul_tile(c->type, w, ws, c->rows, a, as, c->toks, y, ys, c->n);
        for (int t = 0; t < c->toks; t++)
            for (size_t r = 0; r < ys; r++) {
                const size_t k = (size_t)t * ys + r;
                if (r >= (size_t)c->rows) {
                    if (f_bits(y[k]) != POISON_BITS)
                        FAILF("%s matmul %s wrote y[%d][%zu] in the stride gap\n", name, kvb_type_name(c->type), t, r);
                    continue;
                }
                if (f_bits(y[k]) == POISON_BITS || !same(y[k], ref[k]))
                    FAILF("%s matmul %s n=%" PRId64 " tile %dx%d mode %d: y[tok %d][row %zu] = %a [%08x], "
                          "scalar %a [%08x]\n",
                          name, kvb_type_name(c->type), c->n, c->rows, c->toks, c->mode, t, r, (double)y[k],
                          f_bits(y[k]), (double)ref[k], f_bits(ref[k]));
            }
        /* kvb_dot on a few pairs */
        for (int k = 0; k < 3; k++) {
            const int r = rndint(0, c->rows - 1), t = rndint(0, c->toks - 1);
            const float d = kvb_dot(c->type, w + (size_t)r * ws, a + (size_t)t * as, c->n);
            if (!same(d, ref[(size_t)t * ys + (size_t)r]))
                FAILF("%s kvb_dot %s n=%" PRId64 " row %d tok %d: %a, scalar %a\n", name, kvb_type_name(c->type),
                      c->n, r, t, (double)d, (double)ref[(size_t)t * ys + (size_t)r]);
        }
        g_mm_compared++;
    }
    force("auto");
    free(w);
    free(a);
    free(tmp);
    free(ref);
    free(y);
}

static const uint32_t k_dot_types[] = {KVB_TYPE_F32,  KVB_TYPE_F16,  KVB_TYPE_BF16, KVB_TYPE_Q8_0, KVB_TYPE_Q4_0,
                                       KVB_TYPE_Q5_0, KVB_TYPE_Q4_K, KVB_TYPE_Q5_K, KVB_TYPE_Q6_K};
static const int k_tiles[][2] = {{1, 1}, {3, 1}, {7, 1}, {17, 1}, {1, 3}, {3, 7}, {7, 3},
                                 {17, 7}, {1, 17}, {4, 4}, {17, 17}, {16, 16}, {33, 5}};

static void test_matmul_simd_vs_scalar(void **state) {
    (void)state;
    g_mm_compared = 0;
    for (size_t ti = 0; ti < KVB_ARRAY_LEN(k_dot_types); ti++) {
        const uint32_t type = k_dot_types[ti];
        static const int64_t nq[] = {32, 64, 96, 160, 480, 512, 544, 640, 1056, 2304, 4096 + 256};
        static const int64_t nk[] = {256, 512, 2048, 2304, 4096 + 256}; /* 2304: a half 16-block group */
        static const int64_t nf[] = {1, 7, 15, 16, 17, 33, 100, 255, 256, 1000};
        const int64_t *ns = is_kquant(type) ? nk : is_quant(type) ? nq : nf;
        const size_t nn = is_kquant(type) ? KVB_ARRAY_LEN(nk) : is_quant(type) ? KVB_ARRAY_LEN(nq) : KVB_ARRAY_LEN(nf);
        for (size_t ni = 0; ni < nn; ni++)
            for (size_t k = 0; k < KVB_ARRAY_LEN(k_tiles); k++) {
                const mm_case c = {type, ns[ni], k_tiles[k][0], k_tiles[k][1], rndint(0, 3)};
                run_mm_case(&c);
            }
        /* long rows, random lengths */
        static const int64_t nbig[] = {4096, 8192};
        for (size_t ni = 0; ni < 2; ni++)
            for (int mode = 0; mode < 4; mode++) {
                const mm_case c = {type, nbig[ni], mode == 0 ? 17 : 3, mode == 1 ? 7 : 1 + mode, mode};
                run_mm_case(&c);
            }
        for (int k = 0; k < 6; k++) {
            const int64_t n = is_kquant(type) ? 256 * rndint(1, 36) : is_quant(type) ? 32 * rndint(1, 300) : rndint(1, 5000);
            const mm_case c = {type, n, rndint(1, 20), rndint(1, 20), rndint(0, 3)};
            run_mm_case(&c);
        }
    }
    print_message("matmul: %" PRId64 " tile comparisons against scalar\n", g_mm_compared);
}

/* Inf/NaN in the inputs: SIMD must still agree with scalar (NaN-ness only). */
static void test_matmul_specials(void **state) {
    (void)state;
    for (size_t ti = 0; ti < KVB_ARRAY_LEN(k_dot_types); ti++) {
        const uint32_t type = k_dot_types[ti];
        const int64_t n = is_quant(type) ? 512 : 100;
        const size_t rb = kvb_row_bytes(type, n), ab = kvb_row_bytes(kvb_act_type(type), n);
        uint8_t *w = xmalloc(rb * 5), *a = xmalloc(ab * 3);
        float *tmp = xmalloc((size_t)n * sizeof(float)), ref[15], y[15];
        for (int r = 0; r < 5; r++) fill_weight_row(type, w + r * rb, n, 0, tmp);
        for (int t = 0; t < 3; t++) fill_act_row(type, a + t * ab, n, 0, tmp);
        /* row 1: an inf; row 2: a NaN; token 1: inf activation */
        if (is_quant(type)) { /* the (super-)block's d: inf in row 1, NaN in row 2 */
            const uint16_t inf = 0x7c00, nan = 0x7e01;
            const size_t dofs = type == KVB_TYPE_Q6_K ? 208 : 0;
            memcpy(w + rb + (size_t)block_bytes(type) * (is_kquant(type) ? 1 : 3) + dofs, &inf, 2);
            memcpy(w + 2 * rb + dofs, &nan, 2);
            if (type == KVB_TYPE_Q4_K || type == KVB_TYPE_Q5_K) memcpy(w + 3 * rb + 2, &nan, 2); /* dmin */
            memcpy(a + ab + 34 * 5, &inf, 2);
        } else if (type == KVB_TYPE_F32) {
            ((float *)(void *)(w + rb))[7] = INFINITY;
            ((float *)(void *)(w + 2 * rb))[99] = NAN;
        } else {
            ((uint16_t *)(void *)(w + rb))[7] = type == KVB_TYPE_F16 ? 0x7c00 : 0x7f80;
            ((uint16_t *)(void *)(w + 2 * rb))[99] = type == KVB_TYPE_F16 ? 0x7c01 : 0x7f81;
        }
        if (!is_quant(type)) ((float *)(void *)(a + ab))[3] = -INFINITY;
        force("scalar");
        kvb_matmul_tile(type, w, rb, 5, a, ab, 3, ref, 5, n);
        assert_true(isnan(ref[2]) && isnan(ref[5 + 2]));
        for (size_t s = 0; s < KVB_ARRAY_LEN(k_simd); s++) {
            if (!force(k_simd[s])) continue;
            for (int i = 0; i < 15; i++) y[i] = bits_f(POISON_BITS);
            kvb_matmul_tile(type, w, rb, 5, a, ab, 3, y, 5, n);
            for (int i = 0; i < 15; i++)
                if (!same(y[i], ref[i]) || f_bits(y[i]) == POISON_BITS)
                    FAILF("%s %s specials: y[%d] = %a, scalar %a\n", k_simd[s], kvb_type_name(type), i,
                          (double)y[i], (double)ref[i]);
        }
        force("auto");
        free(w);
        free(a);
        free(tmp);
    }
}

/* Accuracy: |dot - exact| <= (K + 5) * 2^-24 * mag + (quant types) 2^-24 * mag, K = fmas per
 * accumulator lane (ceil(n/16) elements, or ceil(n/32/16) blocks times the terms per block: 2 for
 * Q4_K/Q5_K), +4 reduction levels, +1 slack for the bound's higher-order term, + one rounding of
 * each block's scale product (Q4_K/Q5_K's dA, dM). Float types: exact and mag are the float64 sum
 * and sum of |w_i x_i|; quant types: the sum of each block's terms (integer * exact scale) and of
 * their magnitudes (for Q4_K/Q5_K the two terms of a block may cancel, so mag counts both). */
static void test_dot_accuracy(void **state) {
    (void)state;
    g_tame = 1;
    for (size_t ti = 0; ti < KVB_ARRAY_LEN(k_dot_types); ti++) {
        const uint32_t type = k_dot_types[ti];
        for (int trial = 0; trial < 20; trial++) {
            const int64_t n = is_kquant(type) ? 256 * rndint(1, 32) : is_quant(type) ? 32 * rndint(1, 256) : rndint(1, 8192);
            const size_t rb = kvb_row_bytes(type, n), ab = kvb_row_bytes(kvb_act_type(type), n);
            uint8_t *w = xmalloc(rb), *a = xmalloc(ab);
            float *tmp = xmalloc((size_t)n * sizeof(float)), *wf = xmalloc((size_t)n * sizeof(float));
            float *af = xmalloc((size_t)n * sizeof(float));
            fill_weight_row(type, w, n, trial % 2 ? 0 : 3, tmp);
            fill_act_row(type, a, n, trial % 2 ? 0 : 3, tmp);
            kvb_row_to_f32(type, w, wf, n);
            kvb_row_to_f32(kvb_act_type(type), a, af, n);
            double exact = 0, mag = 0;
            int terms = 1;
            if (is_quant(type)) {
                for (int64_t b = 0; b < n / 32; b++) {
                    spec_terms t;
                    spec_block(type, w, (const kvb_block_q8_0 *)(const void *)a + b, b, &t);
                    for (int j = 0; j < t.n; j++) { /* each product exact in double */
                        exact += (double)t.i[j] * t.exact[j];
                        mag += fabs((double)t.i[j] * t.exact[j]);
                    }
                    terms = t.n;
                }
            } else {
                for (int64_t i = 0; i < n; i++) {
                    exact += (double)wf[i] * (double)af[i]; /* each product exact in double */
                    mag += fabs((double)wf[i] * (double)af[i]);
                }
            }
            const int64_t k = is_quant(type) ? terms * ((n / 32 + 15) / 16) : (n + 15) / 16;
            /* the double sum itself errs by <= n * 2^-53 * mag; negligible next to the bound */
            const double bound = (double)(k + 5 + is_quant(type)) * 0x1p-24 * mag + 0x1p-140;
            force("auto");
            const float got = kvb_dot(type, w, a, n);
            if (!(fabs((double)got - exact) <= bound))
                FAILF("%s n=%" PRId64 ": dot %a, float64 %a, error %g > bound %g\n", kvb_type_name(type), n,
                      (double)got, exact, fabs((double)got - exact), bound);
            free(w);
            free(a);
            free(tmp);
            free(wf);
            free(af);
        }
    }
    g_tame = 0;
    /* small exact cases */
    const float w3[3] = {1, 2, 3}, x3[3] = {4, 5, 6};
    assert_true(kvb_dot(KVB_TYPE_F32, w3, x3, 3) == 32.0f);
    /* order matters and is fixed: lane 0 gets elements 0 and 16 */
    float w17[17] = {0}, x17[17] = {0};
    w17[0] = 1.0f, x17[0] = 0x1p24f;  /* lane 0: 2^24 */
    w17[16] = 1.0f, x17[16] = 1.0f;   /* lane 0: 2^24 + 1 -> 2^24 (tie to even) */
    w17[1] = 1.0f, x17[1] = 1.0f;     /* lane 1: 1; reduction 2^24 + 1 -> 2^24 */
    for (size_t s = 0; s < KVB_ARRAY_LEN(k_simd) + 1; s++) {
        if (s < KVB_ARRAY_LEN(k_simd) ? !force(k_simd[s]) : !force("scalar")) continue;
        assert_true(kvb_dot(KVB_TYPE_F32, w17, x17, 17) == 0x1p24f);
        /* products that round to -0 leave lanes at -0; a kernel that pads a tail with zeros
         * and adds them (+0 + -0 = +0) instead of leaving those lanes alone is caught here */
        for (int64_t n = 1; n <= 40; n++) {
            float wt[40], xt[40];
            uint16_t wh[40];
            for (int i = 0; i < 40; i++) wt[i] = 0.25f, xt[i] = -0x1p-149f, wh[i] = 0x3400; /* 0.25 */
            const float r32 = kvb_dot(KVB_TYPE_F32, wt, xt, n), r16 = kvb_dot(KVB_TYPE_F16, wh, xt, n);
            const float rb16 = kvb_dot(KVB_TYPE_BF16, wh, xt, n); /* bf16 0x3400 is tiny positive */
            const int neg = n >= 16; /* every lane got a -0 product; else +0 lanes remain */
            if (!(r32 == 0.0f && !!signbit(r32) == neg && r16 == 0.0f && !!signbit(r16) == neg &&
                  rb16 == 0.0f && !!signbit(rb16) == neg))
                FAILF("%s: -0 lanes not kept (n %" PRId64 "): %a %a %a\n", kvb_simd_name(), n, (double)r32,
                      (double)r16, (double)rb16);
        }
    }
    force("auto");
}

/* Cache rows to f32 (what attention reads): every kernel set gives the scalar loop's bits for
 * Q8_0 (random bytes, scales including fp16 specials) and F16 rows; NaN agrees in NaN-ness. */
static void test_row_to_f32_simd(void **state) {
    (void)state;
    enum { NB = 96 };
    kvb_block_q8_0 *q = xmalloc(sizeof *q * NB);
    uint16_t *h = xmalloc(sizeof(uint16_t) * NB * 32);
    float *ref = xmalloc(sizeof(float) * (NB * 32 + 16)), *got = xmalloc(sizeof(float) * (NB * 32 + 16));
    static const uint16_t sp[] = {0x7c00, 0xfc00, 0x7e00, 0x8000, 0x0000, 0x0001, 0x03ff, 0x7bff};
    static const int64_t lens[] = {32, 64, 96, 32 * 37, NB * 32};
    int compared = 0;
    for (int round = 0; round < 6; round++) {
        for (int b = 0; b < NB; b++) {
            q[b].d = round >= 3 && b % 7 == 0 ? sp[rndint(0, (int)KVB_ARRAY_LEN(sp) - 1)] : (uint16_t)rndint(0, 0x7bff);
            if (rndint(0, 1)) q[b].d |= 0x8000;
            for (int j = 0; j < 32; j++) q[b].qs[j] = (int8_t)rndint(-128, 127);
        }
        for (int i = 0; i < NB * 32; i++) h[i] = (uint16_t)rndint(0, 0xffff);
        for (size_t li = 0; li < KVB_ARRAY_LEN(lens); li++)
            for (int t = 0; t < 2; t++) {
                const uint32_t type = t ? KVB_TYPE_F16 : KVB_TYPE_Q8_0;
                const void *src = t ? (const void *)h : (const void *)q;
                const int64_t n = lens[li];
                force("scalar");
                memset(ref, 0x5a, sizeof(float) * (NB * 32 + 16));
                kvb_row_to_f32(type, src, ref, n);
                for (size_t k = 0; k < KVB_ARRAY_LEN(k_simd); k++) {
                    if (!force(k_simd[k])) continue;
                    memset(got, 0x5a, sizeof(float) * (NB * 32 + 16));
                    kvb_row_to_f32(type, src, got, n);
                    for (int64_t i = 0; i < NB * 32 + 16; i++)
                        if (!(isnan(ref[i]) && isnan(got[i])) && memcmp(&ref[i], &got[i], sizeof(float)) != 0)
                            FAILF("%s %s row to f32: element %" PRId64 " of %" PRId64 ": %a, want %a (round %d)\n",
                                  k_simd[k], t ? "F16" : "Q8_0", i, n, (double)got[i], (double)ref[i], round);
                    compared++;
                }
            }
    }
    force("auto");
    assert_true(compared > 0);
    free(q);
    free(h);
    free(ref);
    free(got);
}

/* ---- weighted sum of rows (attention's P·V) ------------------------------------------------ */

/* Same bits as the contract's loop (computed here, one product and one sum per step), for
 * every kernel set, on random rows with specials; nothing written outside acc[0, n). NaN results
 * must agree only in NaN-ness. */
static void test_rows_weighted_add_simd(void **state) {
    (void)state;
    enum { MAXN = 300, MAXR = 40, STRIDE = 320 };
    float *rows = xmalloc(sizeof(float) * MAXR * STRIDE), *w = xmalloc(sizeof(float) * MAXR);
    float *acc0 = xmalloc(sizeof(float) * (MAXN + 16)), *ref = xmalloc(sizeof(float) * (MAXN + 16));
    float *got = xmalloc(sizeof(float) * (MAXN + 16));
    static const int64_t lens[] = {0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 128, 256, 300};
    static const int nrs[] = {0, 1, 2, 5, 32, 40};
    static const float sp[] = {NAN, INFINITY, -INFINITY, -0.0f, 0x1p-149f, -0x1p-130f, 3e38f, -3e38f};
    int compared = 0;
    for (int round = 0; round < 8; round++) {
        for (int i = 0; i < MAXR * STRIDE; i++) rows[i] = (float)(rndint(-100000, 100000)) * 1e-5f;
        for (int i = 0; i < MAXR; i++) w[i] = (float)rndint(0, 100000) * 1e-5f;
        for (int i = 0; i < MAXN + 16; i++) acc0[i] = (float)rndint(-100000, 100000) * 1e-4f;
        if (round >= 4)
            for (int k = 0; k < 30; k++) {
                rows[rndint(0, MAXR * STRIDE - 1)] = sp[rndint(0, (int)KVB_ARRAY_LEN(sp) - 1)];
                acc0[rndint(0, MAXN - 1)] = sp[rndint(0, (int)KVB_ARRAY_LEN(sp) - 1)];
                if (k < 3) w[rndint(0, MAXR - 1)] = sp[rndint(0, (int)KVB_ARRAY_LEN(sp) - 1)];
            }
        for (size_t li = 0; li < KVB_ARRAY_LEN(lens); li++)
            for (size_t ri = 0; ri < KVB_ARRAY_LEN(nrs); ri++) {
                const int64_t n = lens[li];
                const int nr = nrs[ri];
                memcpy(ref, acc0, sizeof(float) * (MAXN + 16));
                for (int r = 0; r < nr; r++)
                    for (int64_t i = 0; i < n; i++) {
                        const float prod = w[r] * rows[(size_t)r * STRIDE + i];
                        ref[i] = ref[i] + prod;
                    }
                for (size_t k = 0; k < KVB_ARRAY_LEN(k_simd) + 1; k++) {
                    const char *name = k < KVB_ARRAY_LEN(k_simd) ? k_simd[k] : "scalar";
                    if (!force(name)) continue;
                    memcpy(got, acc0, sizeof(float) * (MAXN + 16));
                    kvb_f32_rows_weighted_add(got, w, rows, STRIDE, nr, n);
                    for (int64_t i = 0; i < MAXN + 16; i++) {
                        const bool both_nan = isnan(ref[i]) && isnan(got[i]);
                        if (!both_nan && memcmp(&ref[i], &got[i], sizeof(float)) != 0)
                            FAILF("%s rows_weighted_add: element %" PRId64 " of n %" PRId64 ", %d rows: %a, want %a "
                                  "(round %d)\n",
                                  name, i, n, nr, (double)got[i], (double)ref[i], round);
                    }
                    compared++;
                }
            }
    }
    force("auto");
    assert_true(compared >= 8 * (int)(KVB_ARRAY_LEN(lens) * KVB_ARRAY_LEN(nrs)) * 2);
    free(rows);
    free(w);
    free(acc0);
    free(ref);
    free(got);
}

static void test_dispatch(void **state) {
    (void)state;
    kvb_err err;
    const char *best = kvb_simd_name();
    print_message("best SIMD kernels on this CPU: %s (at init: %s)\n", best, g_initial_simd);
    const char *env = getenv("KVB_SIMD");
    if (env != NULL && strcmp(env, "auto") != 0 && force(env)) assert_string_equal(g_initial_simd, env);
    else assert_string_equal(g_initial_simd, best);
    force("auto");
    assert_int_equal(kvb_simd_force("bogus", &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_simd_force("scalar", &err), KVB_OK);
    assert_string_equal(kvb_simd_name(), "scalar");
    assert_int_equal(kvb_simd_force("auto", &err), KVB_OK);
    assert_string_equal(kvb_simd_name(), best);
#if defined(__x86_64__)
    assert_int_equal(kvb_simd_force("neon", &err), KVB_ERR_UNSUPPORTED);
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"))
        assert_string_equal(best, "avx512-vnni");
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        assert_string_equal(best, "avx2");
#endif
    /* bad arguments: NaN, not a crash */
    float y[4] = {0};
    assert_true(isnan(kvb_dot(KVB_TYPE_Q2_K, y, y, 256)));
    assert_true(isnan(kvb_dot(KVB_TYPE_Q8_0, y, y, 33)));
    assert_true(isnan(kvb_dot(KVB_TYPE_Q5_0, y, y, 48)));
    assert_true(isnan(kvb_dot(KVB_TYPE_Q4_K, y, y, 128)));
    assert_true(isnan(kvb_dot(KVB_TYPE_Q6_K, y, y, 288)));
    assert_true(isnan(kvb_dot(KVB_TYPE_Q5_K, y, y, -256)));
    assert_true(kvb_dot(KVB_TYPE_Q6_K, y, y, 0) == 0.0f);
    assert_true(kvb_dot(KVB_TYPE_F32, y, y, 0) == 0.0f);
    kvb_matmul_tile(KVB_TYPE_Q4_1, y, 0, 2, y, 0, 2, y, 2, 32);
    for (int i = 0; i < 4; i++) assert_true(isnan(y[i]));
}

static int setup(void **state) {
    (void)state;
    const char *s = getenv("KVB_TEST_SEED");
    g_seed = s ? strtoull(s, NULL, 10) : ((uint64_t)time(NULL) * 1000003u) ^ (uint64_t)getpid() ^ (uint64_t)clock();
    kvb_rng_seed(&g_rng, g_seed);
    g_initial_simd = kvb_simd_name();
    print_message("test_quant seed %" PRIu64 ", kernels %s\n", g_seed, g_initial_simd);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_type_table),
        cmocka_unit_test(test_fp16_exhaustive),
        cmocka_unit_test(test_fp16_from_f32),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_quantizer_known_bytes),
        cmocka_unit_test(test_quantize_error_bounds),
        cmocka_unit_test(test_quantize_act_simd),
        cmocka_unit_test(test_dequant_vs_reference),
        cmocka_unit_test(test_q5_0_known_bytes),
        cmocka_unit_test(test_new_quantizer_bounds),
        cmocka_unit_test(test_dispatch),
        cmocka_unit_test(test_matmul_simd_vs_scalar),
        cmocka_unit_test(test_matmul_specials),
        cmocka_unit_test(test_dot_accuracy),
        cmocka_unit_test(test_rows_weighted_add_simd),
        cmocka_unit_test(test_row_to_f32_simd),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
