/* test_reference — checks the float64 reference model (tests/support/ref_model) on its own, with
 * no engine involved, against facts that must hold mathematically or by construction: the block
 * decoders on known bytes and against quant's independent decoders for every bit pattern and random
 * rows; a 1-layer, 1-head, n_embd 4 model per architecture whose logits are recomputed here in
 * closed form (explicit per-element formulas, explicit rotation angles, so the RoPE pairing style,
 * the weight orientation, biases and q/k norms are each pinned down); causality (appending tokens
 * never changes earlier logits or K/V); RoPE norm preservation, position-0 identity, the
 * relative-position property, partial rotary and the layer-0 K relation k(p) = rope(k(0), p);
 * GQA mapping (a model with duplicated KV heads gives the same logits); Llama-3 and linear
 * scaling (keys and rope_freqs.weight agree with each other and with a hand formula); tied output;
 * quantised fixtures staying close to their f32 origin; and loader refusals. Fixture files live in
 * a fresh temporary directory removed at the end. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_core.h"
#include "kvb_gguf.h"
#include "kvb_quant.h"
#include "ref_fixture.h"
#include "ref_model.h"

static char g_dir[512];

static void path_in_dir(char *buf, size_t cap, const char *name) { snprintf(buf, cap, "%s/%s", g_dir, name); }

static ref_model *load_ok(const char *path) {
    char err[512];
    ref_model *m = ref_model_load(path, err, sizeof err);
    if (!m) fail_msg("ref_model_load(%s): %s", path, err);
    return m;
}

static void write_fixture(const ref_fixture_cfg *c, const char *path) {
    char err[512];
    if (ref_fixture_write(c, path, err, sizeof err) != 0) fail_msg("ref_fixture_write: %s", err);
}

/* ---- (d) dequantisation --------------------------------------------------------------------- */

static void test_dequant_known_bytes(void **state) {
    (void)state;
    /* fp16 */
    assert_true(ref_fp16_to_double(0x3c00) == 1.0);
    assert_true(ref_fp16_to_double(0xc000) == -2.0);
    assert_true(ref_fp16_to_double(0x7bff) == 65504.0);
    assert_true(ref_fp16_to_double(0x0001) == ldexp(1, -24)); /* smallest subnormal */
    assert_true(ref_fp16_to_double(0x03ff) == ldexp(1023, -24)); /* largest subnormal */
    assert_true(ref_fp16_to_double(0x0400) == ldexp(1, -14));   /* smallest normal */
    assert_true(ref_fp16_to_double(0x3555) == 0.333251953125);
    assert_true(ref_fp16_to_double(0x8000) == 0.0 && signbit(ref_fp16_to_double(0x8000)));
    assert_true(isinf(ref_fp16_to_double(0x7c00)) && ref_fp16_to_double(0xfc00) < 0);
    assert_true(isnan(ref_fp16_to_double(0x7e00)));
    /* bf16 */
    assert_true(ref_bf16_to_double(0x3f80) == 1.0);
    assert_true(ref_bf16_to_double(0x4049) == 3.140625);
    assert_true(ref_bf16_to_double(0xc2f7) == -123.5);
    assert_true(ref_bf16_to_double(0x0001) == ldexp(1, -133));
    assert_true(isinf(ref_bf16_to_double(0x7f80)) && isnan(ref_bf16_to_double(0x7fc0)));

    uint8_t row[4 * 34];
    double out[256];
    /* F16 and BF16 rows are little-endian */
    const uint8_t f16row[] = {0x00, 0x3c, 0x00, 0xc0, 0x55, 0x35};
    assert_int_equal(ref_dequant_row(REF_TYPE_F16, f16row, out, 3), 0);
    assert_true(out[0] == 1.0 && out[1] == -2.0 && out[2] == 0.333251953125);
    const uint8_t bf16row[] = {0x80, 0x3f, 0x49, 0x40};
    assert_int_equal(ref_dequant_row(REF_TYPE_BF16, bf16row, out, 2), 0);
    assert_true(out[0] == 1.0 && out[1] == 3.140625);
    const float f32row[] = {1.5f, -0.1f};
    assert_int_equal(ref_dequant_row(REF_TYPE_F32, f32row, out, 2), 0);
    assert_true(out[0] == 1.5 && out[1] == (double)-0.1f);

    /* Q8_0: d = 0.5 (0x3800), q_j = j - 16 -> x_j = 0.5 (j - 16); second block d = -2 (0xc000), q = -128, 127 */
    memset(row, 0, sizeof row);
    row[0] = 0x00;
    row[1] = 0x38;
    for (int j = 0; j < 32; j++) row[2 + j] = (uint8_t)(int8_t)(j - 16);
    row[34] = 0x00;
    row[35] = 0xc0;
    row[36] = 0x80; /* -128 */
    row[37] = 0x7f; /* 127 */
    assert_int_equal(ref_row_bytes(REF_TYPE_Q8_0, 64), 68);
    assert_int_equal(ref_dequant_row(REF_TYPE_Q8_0, row, out, 64), 0);
    for (int j = 0; j < 32; j++) assert_true(out[j] == 0.5 * (j - 16));
    assert_true(out[32] == 256.0 && out[33] == -254.0 && out[34] == 0.0);

    /* Q4_0: d = 2 (0x4000); byte j = (15 - j%16) << 4 | j: element j = 2 (j - 8), element j+16 = 2 (7 - j) */
    memset(row, 0, sizeof row);
    row[0] = 0x00;
    row[1] = 0x40;
    for (int j = 0; j < 16; j++) row[2 + j] = (uint8_t)(((15 - j) << 4) | j);
    assert_int_equal(ref_row_bytes(REF_TYPE_Q4_0, 32), 18);
    assert_int_equal(ref_dequant_row(REF_TYPE_Q4_0, row, out, 32), 0);
    for (int j = 0; j < 16; j++) {
        assert_true(out[j] == 2.0 * (j - 8));
        assert_true(out[j + 16] == 2.0 * (7 - j));
    }
    /* refusals */
    assert_int_equal(ref_row_bytes(REF_TYPE_Q4_0, 33), 0);
    assert_int_equal(ref_dequant_row(REF_TYPE_Q8_0, row, out, 31), -1);
    assert_int_equal(ref_dequant_row(10 /* Q2_K: a layout the reference does not decode */, row, out, 256), -1);
}

/* Two independent decoders (ours and quant's) must agree bit for bit. */
static void test_dequant_matches_quant(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        const double a = ref_fp16_to_double((uint16_t)h), b = kvb_fp16_to_f32((uint16_t)h);
        if (isnan(a) || isnan(b)) assert_true(isnan(a) && isnan(b));
        else if (a != b) fail_msg("fp16 0x%04x: ref %.17g quant %.17g", h, a, b);
        const double c = ref_bf16_to_double((uint16_t)h), d = kvb_bf16_to_f32((uint16_t)h);
        if (isnan(c) || isnan(d)) assert_true(isnan(c) && isnan(d));
        else if (c != d) fail_msg("bf16 0x%04x: ref %.17g quant %.17g", h, c, d);
    }
    const uint32_t types[] = {REF_TYPE_F32, REF_TYPE_F16, REF_TYPE_BF16, REF_TYPE_Q8_0, REF_TYPE_Q4_0};
    enum { N = 256 };
    float x[N], y[N];
    double z[N];
    uint8_t enc[N * 4];
    kvb_rng rng;
    kvb_rng_seed(&rng, 42);
    for (size_t ti = 0; ti < KVB_ARRAY_LEN(types); ti++) {
        for (int rep = 0; rep < 20; rep++) {
            const float s = rep % 2 ? 0.01f : 3.0f;
            for (int i = 0; i < N; i++) x[i] = kvb_rng_normal(&rng) * s;
            if (rep == 3) memset(x, 0, sizeof x); /* an all-zero block (d = 0) */
            assert_int_equal(ref_row_bytes(types[ti], N), kvb_row_bytes(types[ti], N));
            kvb_f32_to_row(types[ti], x, enc, N);
            kvb_row_to_f32(types[ti], enc, y, N);
            assert_int_equal(ref_dequant_row(types[ti], enc, z, N), 0);
            for (int i = 0; i < N; i++)
                if (z[i] != (double)y[i])
                    fail_msg("type %u element %d: ref %.17g quant %.17g", types[ti], i, z[i], (double)y[i]);
        }
    }
}

/* ---- (c) a hand-computed model -------------------------------------------------------------- */

/* n_vocab 5, n_embd 4, 1 layer, 1 head (head_dim 4, n_rot 4), n_ff 4, rope base 10000. Weight
 * matrices are (rows = outputs, cols = inputs), row-major, as in the GGUF data. */
static const float HE[5][4] = {{0.5f, -1.0f, 0.25f, 2.0f}, {1.5f, 0.75f, -0.5f, -1.25f}, {-0.75f, 0.5f, 1.0f, 0.25f},
                               {0.1f, 0.2f, 0.3f, 0.4f},   {-1.0f, -0.5f, 0.5f, 1.0f}};
static const float H_AN[4] = {1.0f, 0.5f, 2.0f, 1.5f};  /* attn_norm */
static const float H_FN[4] = {0.5f, 1.0f, 1.5f, 1.0f};  /* ffn_norm */
static const float H_ON[4] = {1.0f, 1.0f, 0.5f, 2.0f};  /* output_norm */
static const float H_WQ[4][4] = {{1, 0, 0, 0.5f}, {0, 1, 0, 0}, {0.25f, 0, 1, 0}, {0, 0, 0, 1}};
static const float H_WK[4][4] = {{1, 0, 0, 0}, {0, 1, -0.5f, 0}, {0, 0, 1, 0}, {0, 0, 0, 2}};
static const float H_WV[4][4] = {{1, 2, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0}, {0, 0, 3, 1}};
static const float H_WO[4][4] = {{1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0}, {0.5f, 0, 0, 1}};
static const float H_ID[4][4] = {{1, 0, 0, 0}, {0, 1, 0, 0}, {0, 0, 1, 0}, {0, 0, 0, 1}};
static const float H_UP[4][4] = {{1, 0, 0, 0}, {0, 2, 0, 0}, {0, 0, 3, 0}, {0, 0, 0, 4}};
static const float H_OUT[5][4] = {
    {1, -1, 0.5f, 0}, {0.25f, 0.5f, -2, 1}, {0, 0, 1, 1}, {-1, 0.75f, 0, 0.5f}, {2, 0, 0, -1}};
static const float H_BQ[4] = {0.1f, -0.2f, 0.3f, 0.0f}, H_BK[4] = {0.0f, 0.5f, -0.5f, 0.25f}, H_BV[4] = {1, 0, 0, -1};
static const float H_QN[4] = {1.0f, 2.0f, 0.5f, 1.0f}, H_KN[4] = {0.5f, 1.0f, 1.0f, 2.0f};
static const float H_EPS = 1e-5f;

enum { HAND_PLAIN = 0, HAND_STRAY_QNORM = 1, HAND_NO_BIAS = 2, HAND_BAD_DIMS = 4, HAND_UNKNOWN_ARCH = 8 };

static void write_hand(const char *path, const char *arch, int variant) {
    kvb_gguf_writer *w = NULL;
    kvb_err e = {0};
    char key[96];
    const char *a = variant & HAND_UNKNOWN_ARCH ? "gpt2" : arch;
    assert_int_equal(kvb_gguf_writer_create(&w, &e), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_str(w, "general.architecture", a, &e), KVB_OK);
    const struct {
        const char *k;
        uint32_t v;
    } u32s[] = {{"context_length", 16}, {"embedding_length", 4}, {"block_count", 1}, {"feed_forward_length", 4},
                {"attention.head_count", 1}, {"attention.head_count_kv", 1}};
    for (size_t i = 0; i < KVB_ARRAY_LEN(u32s); i++) {
        snprintf(key, sizeof key, "%s.%s", a, u32s[i].k);
        assert_int_equal(kvb_gguf_writer_add_u32(w, key, u32s[i].v, &e), KVB_OK);
    }
    snprintf(key, sizeof key, "%s.rope.freq_base", a);
    assert_int_equal(kvb_gguf_writer_add_f32(w, key, 10000.0f, &e), KVB_OK);
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", a);
    assert_int_equal(kvb_gguf_writer_add_f32(w, key, H_EPS, &e), KVB_OK);

    ref_fix_tensor t[20];
    size_t n = 0;
#define T1(nm, arr) t[n++] = (ref_fix_tensor){.name = nm, .n_dims = 1, .ne = {4, 1}, .type = KVB_TYPE_F32, .data = arr}
#define T2(nm, arr, rows) \
    t[n++] = (ref_fix_tensor){.name = nm, .n_dims = 2, .ne = {4, rows}, .type = KVB_TYPE_F32, .data = &arr[0][0]}
    T2("token_embd.weight", HE, 5);
    T1("output_norm.weight", H_ON);
    T2("output.weight", H_OUT, 5);
    T1("blk.0.attn_norm.weight", H_AN);
    if (variant & HAND_BAD_DIMS) t[n++] = (ref_fix_tensor){.name = "blk.0.attn_q.weight", .n_dims = 2, .ne = {2, 8},
                                                           .type = KVB_TYPE_F32, .data = &H_WQ[0][0]};
    else T2("blk.0.attn_q.weight", H_WQ, 4);
    T2("blk.0.attn_k.weight", H_WK, 4);
    T2("blk.0.attn_v.weight", H_WV, 4);
    T2("blk.0.attn_output.weight", H_WO, 4);
    T1("blk.0.ffn_norm.weight", H_FN);
    T2("blk.0.ffn_gate.weight", H_ID, 4);
    T2("blk.0.ffn_up.weight", H_UP, 4);
    T2("blk.0.ffn_down.weight", H_ID, 4);
    if (strcmp(arch, "qwen2") == 0 && !(variant & HAND_NO_BIAS)) {
        T1("blk.0.attn_q.bias", H_BQ);
        T1("blk.0.attn_k.bias", H_BK);
        T1("blk.0.attn_v.bias", H_BV);
    }
    if (strcmp(arch, "qwen3") == 0 || (variant & HAND_STRAY_QNORM)) {
        T1("blk.0.attn_q_norm.weight", H_QN);
        T1("blk.0.attn_k_norm.weight", H_KN);
    }
#undef T1
#undef T2
    char err[512];
    if (ref_fixture_write_tensors(w, t, n, path, err, sizeof err) != 0) fail_msg("%s", err);
    kvb_gguf_writer_destroy(w);
}

static double h_rms(const double x[4]) {
    return sqrt((x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3]) / 4 + (double)H_EPS);
}

/* Rotation of one 4-vector at position 1: angles 1 and 10000^(-2/4) = 0.01 for the two pairs.
 * NORM pairs (0,1) and (2,3); NEOX pairs (0,2) and (1,3). */
static void h_rope_pos1(double x[4], bool neox) {
    const double th[2] = {1.0, 0.01};
    const int pairs[2][2] = {{0, neox ? 2 : 1}, {neox ? 1 : 2, 3}};
    for (int p = 0; p < 2; p++) {
        const double a = x[pairs[p][0]], b = x[pairs[p][1]];
        x[pairs[p][0]] = a * cos(th[p]) - b * sin(th[p]);
        x[pairs[p][1]] = a * sin(th[p]) + b * cos(th[p]);
    }
}

/* Logits for tokens tok[0], tok[1] at positions 0, 1 written out by hand. style: -1 = the
 * architecture's RoPE style, 0 = force NORM, 1 = force NEOX. */
static void hand_expected(const char *arch, int style, const int32_t tok[2], double logits[2][5]) {
    const bool neox = style < 0 ? strcmp(arch, "llama") != 0 : style == 1;
    const bool bias = strcmp(arch, "qwen2") == 0, qkn = strcmp(arch, "qwen3") == 0;
    double x[2][4], q[2][4], k[2][4], v[2][4];
    for (int t = 0; t < 2; t++) {
        for (int i = 0; i < 4; i++) x[t][i] = HE[tok[t]][i];
        const double r = h_rms(x[t]);
        double h[4];
        for (int i = 0; i < 4; i++) h[i] = x[t][i] / r * H_AN[i];
        q[t][0] = h[0] + 0.5 * h[3];
        q[t][1] = h[1];
        q[t][2] = 0.25 * h[0] + h[2];
        q[t][3] = h[3];
        k[t][0] = h[0];
        k[t][1] = h[1] - 0.5 * h[2];
        k[t][2] = h[2];
        k[t][3] = 2 * h[3];
        v[t][0] = h[0] + 2 * h[1];
        v[t][1] = h[1];
        v[t][2] = h[2];
        v[t][3] = 3 * h[2] + h[3];
        if (bias)
            for (int i = 0; i < 4; i++) {
                q[t][i] += H_BQ[i];
                k[t][i] += H_BK[i];
                v[t][i] += H_BV[i];
            }
        if (qkn) {
            const double rq = h_rms(q[t]), rk = h_rms(k[t]);
            for (int i = 0; i < 4; i++) {
                q[t][i] = q[t][i] / rq * H_QN[i];
                k[t][i] = k[t][i] / rk * H_KN[i];
            }
        }
    }
    h_rope_pos1(q[1], neox); /* position 0 is not rotated */
    h_rope_pos1(k[1], neox);
    double att[2][4];
    const double s0 = (q[1][0] * k[0][0] + q[1][1] * k[0][1] + q[1][2] * k[0][2] + q[1][3] * k[0][3]) / 2;
    const double s1 = (q[1][0] * k[1][0] + q[1][1] * k[1][1] + q[1][2] * k[1][2] + q[1][3] * k[1][3]) / 2;
    const double w1 = 1 / (1 + exp(s0 - s1)), w0 = 1 - w1;
    for (int i = 0; i < 4; i++) {
        att[0][i] = v[0][i];                    /* token 0 only sees itself */
        att[1][i] = w0 * v[0][i] + w1 * v[1][i];
    }
    for (int t = 0; t < 2; t++) {
        x[t][0] += att[t][0];
        x[t][1] += att[t][1];
        x[t][2] += att[t][2];
        x[t][3] += 0.5 * att[t][0] + att[t][3];
        const double r = h_rms(x[t]);
        double h[4];
        for (int i = 0; i < 4; i++) h[i] = x[t][i] / r * H_FN[i];
        for (int i = 0; i < 4; i++) {
            const double gate = h[i] / (1 + exp(-h[i])), up = (i + 1) * h[i];
            x[t][i] += gate * up;
        }
        const double r2 = h_rms(x[t]);
        double y[4];
        for (int i = 0; i < 4; i++) y[i] = x[t][i] / r2 * H_ON[i];
        for (int o = 0; o < 5; o++)
            logits[t][o] = H_OUT[o][0] * y[0] + H_OUT[o][1] * y[1] + H_OUT[o][2] * y[2] + H_OUT[o][3] * y[3];
    }
}

static void test_hand_model(void **state) {
    (void)state;
    const char *archs[] = {"llama", "qwen2", "qwen3"};
    const int32_t seqs[3][2] = {{3, 1}, {0, 4}, {2, 2}};
    for (size_t a = 0; a < 3; a++) {
        char path[600];
        path_in_dir(path, sizeof path, "hand.gguf");
        write_hand(path, archs[a], HAND_PLAIN);
        ref_model *m = load_ok(path);
        const ref_desc *d = ref_model_desc(m);
        assert_int_equal(d->rope_style, a == 0 ? REF_ROPE_NORM : REF_ROPE_NEOX);
        assert_int_equal(d->n_vocab, 5);
        assert_int_equal(d->head_dim, 4);
        assert_false(d->tied_output);
        for (int s = 0; s < 3; s++) {
            double got[2 * 5], want[2][5];
            assert_int_equal(ref_model_forward(m, seqs[s], 2, got), 0);
            hand_expected(archs[a], -1, seqs[s], want);
            for (int t = 0; t < 2; t++)
                for (int o = 0; o < 5; o++)
                    if (fabs(got[t * 5 + o] - want[t][o]) > 1e-12 * (1 + fabs(want[t][o])))
                        fail_msg("%s seq %d token %d logit %d: ref %.17g hand %.17g", archs[a], s, t, o,
                                 got[t * 5 + o], want[t][o]);
            /* the check can tell the styles apart: the other pairing gives other logits at token 1
             * (except for a repeated token, where v0 == v1 makes the attention weights moot) */
            if (seqs[s][0] == seqs[s][1]) continue;
            double other[2][5], diff = 0;
            hand_expected(archs[a], a == 0 ? 1 : 0, seqs[s], other);
            for (int o = 0; o < 5; o++) diff += fabs(other[1][o] - want[1][o]);
            if (!(diff > 1e-4)) fail_msg("%s seq %d: RoPE style invisible (diff %g)", archs[a], s, diff);
        }
        ref_model_free(m);
    }
}

/* ---- random fixtures ------------------------------------------------------------------------ */

static const char *ARCHS[] = {"llama", "qwen2", "qwen3", "gemma3"};

/* (a) causality: the first k rows of logits and of every layer's K/V do not depend on later tokens. */
static void test_causal(void **state) {
    (void)state;
    const uint32_t types[] = {KVB_TYPE_F32, KVB_TYPE_Q4_0};
    for (size_t a = 0; a < KVB_ARRAY_LEN(ARCHS); a++) {
        for (size_t ti = 0; ti < 2; ti++) {
            ref_fixture_cfg c;
            char path[600];
            ref_fixture_default(&c, ARCHS[a], types[ti], 1000 + a);
            path_in_dir(path, sizeof path, "causal.gguf");
            write_fixture(&c, path);
            ref_model *m = load_ok(path);
            const ref_desc *d = ref_model_desc(m);
            const int V = d->n_vocab, KD = d->n_head_kv * d->head_dim;
            enum { N = 9, K = 4 };
            const int32_t toks[N] = {5, 17, 3, 96, 0, 42, 42, 7, 60};
            double *full = malloc(sizeof(double) * N * V), *pre = malloc(sizeof(double) * K * V);
            double *kf = malloc(sizeof(double) * N * KD), *vf = malloc(sizeof(double) * N * KD);
            double *kp = malloc(sizeof(double) * K * KD), *vp = malloc(sizeof(double) * K * KD);
            assert_int_equal(ref_model_forward(m, toks, N, full), 0);
            assert_int_equal(ref_model_forward(m, toks, K, pre), 0);
            assert_memory_equal(full, pre, sizeof(double) * K * V);
            for (int i = 0; i < N * V; i++) assert_true(isfinite(full[i]));
            /* the logits actually depend on the tokens: row K differs from row K-1 */
            assert_true(fabs(full[K * V] - full[(K - 1) * V]) + fabs(full[K * V + 1] - full[(K - 1) * V + 1]) > 1e-6);
            for (int l = 0; l < d->n_layer; l++) {
                assert_int_equal(ref_model_kv(m, toks, N, l, kf, vf), 0);
                assert_int_equal(ref_model_kv(m, toks, K, l, kp, vp), 0);
                assert_memory_equal(kf, kp, sizeof(double) * K * KD);
                assert_memory_equal(vf, vp, sizeof(double) * K * KD);
            }
            assert_int_equal(ref_model_kv(m, toks, N, d->n_layer, kf, vf), -1);
            const int32_t bad[2] = {1, V};
            assert_int_equal(ref_model_forward(m, bad, 2, full), -1);
            free(full);
            free(pre);
            free(kf);
            free(vf);
            free(kp);
            free(vp);
            ref_model_free(m);
        }
    }
}

static double dot(const double *a, const double *b, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* (b) RoPE properties, on every architecture and on a partial-rotary qwen2. */
static void test_rope(void **state) {
    (void)state;
    for (int variant = 0; variant < 4; variant++) {
        ref_fixture_cfg c;
        char path[600];
        ref_fixture_default(&c, variant < 3 ? ARCHS[variant] : "qwen2", KVB_TYPE_F32, 77 + variant);
        if (variant == 3) c.n_rot = 8; /* of head_dim 16 */
        path_in_dir(path, sizeof path, "rope.gguf");
        write_fixture(&c, path);
        ref_model *m = load_ok(path);
        const ref_desc *d = ref_model_desc(m);
        const int D = d->head_dim, R = d->n_rot;
        assert_int_equal(R, (int)c.n_rot);
        double a[64], b[64], a0[64], b0[64];
        kvb_rng rng;
        kvb_rng_seed(&rng, 5 + variant);
        for (int rep = 0; rep < 20; rep++) {
            for (int i = 0; i < D; i++) {
                a0[i] = kvb_rng_normal(&rng);
                b0[i] = kvb_rng_normal(&rng);
            }
            const int m0 = rep * 37, n0 = rep * 11 + 3, shift = 1 + rep * 101;
            /* position 0 is the identity */
            memcpy(a, a0, sizeof a);
            ref_rope(m, a, 0);
            assert_memory_equal(a, a0, sizeof(double) * D);
            /* norm preserved; dims >= n_rot untouched */
            memcpy(a, a0, sizeof a);
            ref_rope(m, a, m0 + 5);
            assert_true(fabs(sqrt(dot(a, a, D)) - sqrt(dot(a0, a0, D))) < 1e-12 * sqrt(dot(a0, a0, D)));
            for (int i = R; i < D; i++) assert_true(a[i] == a0[i]);
            /* relative position: <rope(a, m), rope(b, n)> == <rope(a, m+s), rope(b, n+s)> */
            memcpy(a, a0, sizeof a);
            memcpy(b, b0, sizeof b);
            ref_rope(m, a, m0);
            ref_rope(m, b, n0);
            const double s1 = dot(a, b, D);
            memcpy(a, a0, sizeof a);
            memcpy(b, b0, sizeof b);
            ref_rope(m, a, m0 + shift);
            ref_rope(m, b, n0 + shift);
            const double s2 = dot(a, b, D);
            assert_true(fabs(s1 - s2) < 1e-9 * (1 + fabs(s1)));
        }
        /* pairing: e_0 at position 1 rotates into index 1 (NORM) or index n_rot/2 (NEOX) */
        memset(a, 0, sizeof a);
        a[0] = 1;
        ref_rope(m, a, 1);
        const int partner = d->rope_style == REF_ROPE_NORM ? 1 : R / 2;
        assert_true(fabs(a[0] - cos(1.0)) < 1e-15 && fabs(a[partner] - sin(1.0)) < 1e-15);
        assert_int_equal(d->rope_style, strcmp(c.arch, "llama") == 0 ? REF_ROPE_NORM : REF_ROPE_NEOX);
        /* inverse frequencies: base^(-2i/n_rot) */
        for (int i = 0; i < R / 2; i++)
            assert_true(fabs(ref_model_inv_freq(m)[i] - pow(10000.0, -2.0 * i / R)) < 1e-15);
        /* Layer 0 sees only the token before attention, so repeating a token gives the same
         * unrotated K at every position: K(p) == rope(K(0), p) per kv head, V(p) == V(0). */
        enum { N = 6 };
        const int32_t toks[N] = {11, 11, 11, 11, 11, 11};
        const int KD = d->n_head_kv * D;
        double *k = malloc(sizeof(double) * N * KD), *v = malloc(sizeof(double) * N * KD);
        assert_int_equal(ref_model_kv(m, toks, N, 0, k, v), 0);
        for (int p = 1; p < N; p++) {
            for (int h = 0; h < d->n_head_kv; h++) {
                memcpy(a, k + h * D, sizeof(double) * D);
                ref_rope(m, a, p);
                for (int i = 0; i < D; i++) assert_true(fabs(a[i] - k[p * KD + h * D + i]) < 1e-12);
                const double *kp = k + p * KD + h * D, *k0 = k + h * D;
                assert_true(fabs(sqrt(dot(kp, kp, D)) - sqrt(dot(k0, k0, D))) < 1e-12);
            }
            assert_memory_equal(v + p * KD, v, sizeof(double) * KD);
        }
        free(k);
        free(v);
        ref_model_free(m);
    }
}

/* Rewrites a GQA fixture as plain multi-head attention (n_head_kv = n_head) by repeating each
 * kv head's rows of attn_k/attn_v (and their biases) for the query heads that share it. */
static void expand_kv_heads(const char *src, const char *dst) {
    kvb_gguf *g = NULL;
    kvb_err e = {0};
    assert_int_equal(kvb_gguf_open(src, &g, &e), KVB_OK);
    char arch[32], key[96];
    assert_int_equal(kvb_gguf_get_str(g, "general.architecture", arch, sizeof arch, &e), KVB_OK);
    uint32_t nh, nhkv, embd, hd;
    snprintf(key, sizeof key, "%s.attention.head_count", arch);
    assert_int_equal(kvb_gguf_get_u32(g, key, &nh, &e), KVB_OK);
    snprintf(key, sizeof key, "%s.attention.head_count_kv", arch);
    assert_int_equal(kvb_gguf_get_u32(g, key, &nhkv, &e), KVB_OK);
    snprintf(key, sizeof key, "%s.embedding_length", arch);
    assert_int_equal(kvb_gguf_get_u32(g, key, &embd, &e), KVB_OK);
    snprintf(key, sizeof key, "%s.attention.key_length", arch);
    if (kvb_gguf_get_u32(g, key, &hd, &e) != KVB_OK) hd = embd / nh;
    const uint32_t group = nh / nhkv;

    kvb_gguf_writer *w = NULL;
    assert_int_equal(kvb_gguf_writer_create(&w, &e), KVB_OK);
    snprintf(key, sizeof key, "%s.attention.head_count_kv", arch);
    for (uint64_t i = 0; i < kvb_gguf_n_kv(g); i++) {
        const kvb_gguf_kv *kv = kvb_gguf_kv_at(g, i);
        if (kvb_gguf_str_eq(kv->key, key)) assert_int_equal(kvb_gguf_writer_add_u32(w, key, nh, &e), KVB_OK);
        else assert_int_equal(kvb_gguf_writer_copy_kv(w, kv, &e), KVB_OK);
    }
    const uint64_t nt = kvb_gguf_n_tensors(g);
    ref_fix_tensor *t = calloc(nt, sizeof *t);
    char(*names)[96] = calloc(nt, sizeof *names);
    float **bufs = calloc(nt, sizeof *bufs);
    for (uint64_t i = 0; i < nt; i++) {
        const kvb_gguf_tensor *s = kvb_gguf_tensor_at(g, i);
        assert_int_equal(s->type, KVB_TYPE_F32);
        snprintf(names[i], sizeof names[i], "%.*s", (int)s->name.len, s->name.ptr);
        const uint64_t cols = s->ne[0], rows = s->n_dims > 1 ? s->ne[1] : 1;
        const bool is_kv = strstr(names[i], "attn_k.") || strstr(names[i], "attn_v.");
        const bool is_bias = strstr(names[i], ".bias") != NULL;
        const float *sd = s->data;
        if (is_kv) {
            /* weight: rows = nhkv*hd -> nh*hd, row (h*hd + r) = src row ((h/group)*hd + r);
             * bias: the same on a 1-D vector */
            const uint64_t out_rows = is_bias ? 1 : (uint64_t)nh * hd, out_cols = is_bias ? (uint64_t)nh * hd : cols;
            bufs[i] = malloc(sizeof(float) * out_rows * out_cols);
            for (uint32_t h = 0; h < nh; h++)
                for (uint32_t r = 0; r < hd; r++) {
                    const uint64_t src_row = (uint64_t)(h / group) * hd + r, dst_row = (uint64_t)h * hd + r;
                    if (is_bias) bufs[i][dst_row] = sd[src_row];
                    else memcpy(bufs[i] + dst_row * cols, sd + src_row * cols, sizeof(float) * cols);
                }
            t[i] = (ref_fix_tensor){.name = names[i], .n_dims = s->n_dims, .ne = {out_cols, out_rows},
                                    .type = KVB_TYPE_F32, .data = bufs[i]};
        } else {
            bufs[i] = malloc(sizeof(float) * rows * cols);
            memcpy(bufs[i], sd, sizeof(float) * rows * cols);
            t[i] = (ref_fix_tensor){.name = names[i], .n_dims = s->n_dims, .ne = {cols, rows}, .type = KVB_TYPE_F32,
                                    .data = bufs[i]};
        }
    }
    char err[512];
    if (ref_fixture_write_tensors(w, t, nt, dst, err, sizeof err) != 0) fail_msg("%s", err);
    for (uint64_t i = 0; i < nt; i++) free(bufs[i]);
    free(bufs);
    free(names);
    free(t);
    kvb_gguf_writer_destroy(w);
    kvb_gguf_close(g);
}

/* GQA: query head h reads kv head h / (n_head / n_head_kv) — the same model with kv heads
 * repeated into plain multi-head attention gives the same logits. */
static void test_gqa(void **state) {
    (void)state;
    for (size_t a = 0; a < KVB_ARRAY_LEN(ARCHS); a++) {
        ref_fixture_cfg c;
        char p1[600], p2[600];
        ref_fixture_default(&c, ARCHS[a], KVB_TYPE_F32, 300 + a);
        c.n_head = 8;
        c.head_dim = a == 2 ? 16 : 8;
        c.n_rot = c.head_dim;
        c.n_head_kv = 2; /* group of 4: h/4 and h%2 differ */
        path_in_dir(p1, sizeof p1, "gqa.gguf");
        path_in_dir(p2, sizeof p2, "mha.gguf");
        write_fixture(&c, p1);
        expand_kv_heads(p1, p2);
        ref_model *m1 = load_ok(p1), *m2 = load_ok(p2);
        assert_int_equal(ref_model_desc(m1)->n_head_kv, 2);
        assert_int_equal(ref_model_desc(m2)->n_head_kv, 8);
        const int V = ref_model_n_vocab(m1);
        enum { N = 7 };
        const int32_t toks[N] = {1, 50, 2, 33, 33, 90, 4};
        double *l1 = malloc(sizeof(double) * N * V), *l2 = malloc(sizeof(double) * N * V);
        assert_int_equal(ref_model_forward(m1, toks, N, l1), 0);
        assert_int_equal(ref_model_forward(m2, toks, N, l2), 0);
        for (int i = 0; i < N * V; i++) assert_true(fabs(l1[i] - l2[i]) <= 1e-12 * (1 + fabs(l1[i])));
        free(l1);
        free(l2);
        ref_model_free(m1);
        ref_model_free(m2);
    }
}

/* Llama-3 scaling from keys, from a rope_freqs tensor, and linear scaling. */
static void test_rope_scaling(void **state) {
    (void)state;
    ref_fixture_cfg c;
    char pk[600], pt[600], pl[600];
    ref_fixture_default(&c, "llama", KVB_TYPE_F32, 9);
    c.head_dim = c.n_rot = 16;
    c.rope_factor = 8;
    c.rope_low_freq_factor = 1;
    c.rope_high_freq_factor = 4;
    c.rope_orig_ctx = 64; /* high_wavelen 16, low_wavelen 64: pairs 0 / 1-2 / 3-7 fall in the three bands */
    path_in_dir(pk, sizeof pk, "l3keys.gguf");
    path_in_dir(pt, sizeof pt, "l3tensor.gguf");
    path_in_dir(pl, sizeof pl, "linear.gguf");
    c.rope = REF_FIX_ROPE_LLAMA3_KEYS;
    write_fixture(&c, pk);
    c.rope = REF_FIX_ROPE_LLAMA3_TENSOR;
    write_fixture(&c, pt);
    c.rope = REF_FIX_ROPE_LINEAR;
    c.rope_factor = 4;
    write_fixture(&c, pl);
    ref_model *mk = load_ok(pk), *mt = load_ok(pt), *ml = load_ok(pl);
    assert_int_equal(ref_model_desc(mk)->rope_scaling, REF_SCALING_LLAMA3);
    assert_int_equal(ref_model_desc(mt)->rope_scaling, REF_SCALING_FREQS_TENSOR);
    assert_int_equal(ref_model_desc(ml)->rope_scaling, REF_SCALING_LINEAR);
    /* hand values: f_i = 10000^(-i/8); wavelen_i = 2 pi / f_i */
    for (int i = 0; i < 8; i++) {
        const double f = pow(10000.0, -i / 8.0), wl = 2 * M_PI / f;
        double want;
        if (i == 0) {
            assert_true(wl < 16);
            want = f;
        } else if (i <= 2) {
            assert_true(wl >= 16 && wl <= 64);
            const double s = (64 / wl - 1) / 3;
            want = (1 - s) * f / 8 + s * f;
        } else {
            assert_true(wl > 64);
            want = f / 8;
        }
        assert_true(fabs(ref_model_inv_freq(mk)[i] - want) <= 1e-14 * want);
        /* the tensor holds f32 factors computed from f32 frequencies: agree to f32 precision */
        assert_true(fabs(ref_model_inv_freq(mt)[i] - want) <= 3e-7 * want);
        assert_true(fabs(ref_model_inv_freq(ml)[i] - f / 4) <= 1e-15 * f);
    }
    /* and the forward passes agree accordingly */
    const int V = ref_model_n_vocab(mk);
    enum { N = 12 };
    int32_t toks[N];
    for (int i = 0; i < N; i++) toks[i] = (i * 31 + 7) % V;
    double *lk = malloc(sizeof(double) * N * V), *lt = malloc(sizeof(double) * N * V);
    assert_int_equal(ref_model_forward(mk, toks, N, lk), 0);
    assert_int_equal(ref_model_forward(mt, toks, N, lt), 0);
    double num = 0, den = 0;
    for (int i = 0; i < N * V; i++) {
        num += (lk[i] - lt[i]) * (lk[i] - lt[i]);
        den += lk[i] * lk[i];
    }
    assert_true(sqrt(num / den) < 1e-5);
    free(lk);
    free(lt);
    ref_model_free(mk);
    ref_model_free(mt);
    ref_model_free(ml);
}

/* (e) tied output: no output.weight behaves exactly like output.weight == token_embd. */
static void test_tied_output(void **state) {
    (void)state;
    for (size_t a = 0; a < KVB_ARRAY_LEN(ARCHS); a++) {
        ref_fixture_cfg c;
        char pt[600], pc[600], ps[600];
        ref_fixture_default(&c, ARCHS[a], KVB_TYPE_Q8_0, 500 + a);
        path_in_dir(pt, sizeof pt, "tied.gguf");
        path_in_dir(pc, sizeof pc, "copy.gguf");
        path_in_dir(ps, sizeof ps, "sep.gguf");
        c.output = REF_FIX_OUTPUT_TIED;
        write_fixture(&c, pt);
        c.output = REF_FIX_OUTPUT_COPY;
        write_fixture(&c, pc);
        c.output = REF_FIX_OUTPUT_SEPARATE;
        write_fixture(&c, ps);
        ref_model *mt = load_ok(pt), *mc = load_ok(pc), *ms = load_ok(ps);
        assert_true(ref_model_desc(mt)->tied_output);
        assert_false(ref_model_desc(mc)->tied_output);
        const int V = ref_model_n_vocab(mt);
        enum { N = 5 };
        const int32_t toks[N] = {9, 8, 7, 6, 5};
        double *lt = malloc(sizeof(double) * N * V), *lc = malloc(sizeof(double) * N * V),
               *ls = malloc(sizeof(double) * N * V);
        assert_int_equal(ref_model_forward(mt, toks, N, lt), 0);
        assert_int_equal(ref_model_forward(mc, toks, N, lc), 0);
        assert_int_equal(ref_model_forward(ms, toks, N, ls), 0);
        assert_memory_equal(lt, lc, sizeof(double) * N * V);
        double diff = 0;
        for (int i = 0; i < N * V; i++) diff += fabs(lt[i] - ls[i]);
        assert_true(diff > 1.0); /* a separate head really is different */
        free(lt);
        free(lc);
        free(ls);
        ref_model_free(mt);
        ref_model_free(mc);
        ref_model_free(ms);
    }
}

/* Quantised fixtures hold the f32 draw rounded per type; decoded right, the model stays close to
 * the f32 one (a wrong nibble order, scale or sign would land near relative error 1). */
static void test_types_close_to_f32(void **state) {
    (void)state;
    const uint32_t types[] = {KVB_TYPE_F16, KVB_TYPE_BF16, KVB_TYPE_Q8_0, KVB_TYPE_Q4_0};
    const double limit[] = {2e-3, 2e-2, 5e-2, 0.4};
    for (size_t a = 0; a < KVB_ARRAY_LEN(ARCHS); a++) {
        ref_fixture_cfg c;
        char p0[600], p1[600];
        ref_fixture_default(&c, ARCHS[a], KVB_TYPE_F32, 700 + a);
        path_in_dir(p0, sizeof p0, "f32.gguf");
        write_fixture(&c, p0);
        ref_model *m0 = load_ok(p0);
        const int V = ref_model_n_vocab(m0);
        enum { N = 8 };
        const int32_t toks[N] = {10, 20, 30, 40, 50, 60, 70, 80};
        double *l0 = malloc(sizeof(double) * N * V), *l1 = malloc(sizeof(double) * N * V);
        float *l1f = malloc(sizeof(float) * N * V);
        assert_int_equal(ref_model_forward(m0, toks, N, l0), 0);
        for (size_t ti = 0; ti < KVB_ARRAY_LEN(types); ti++) {
            c.wtype = types[ti];
            path_in_dir(p1, sizeof p1, "typed.gguf");
            write_fixture(&c, p1);
            ref_model *m1 = load_ok(p1);
            assert_int_equal(ref_model_forward(m1, toks, N, l1), 0);
            for (int i = 0; i < N * V; i++) l1f[i] = (float)l1[i];
            const double rel = ref_rel_l2(l1f, l0, (size_t)N * V);
            print_message("  %s %-5s vs f32: rel-L2 %.3g (limit %.3g)\n", ARCHS[a], kvb_type_name(types[ti]), rel,
                          limit[ti]);
            assert_true(rel > 0 && rel < limit[ti]);
            ref_model_free(m1);
        }
        free(l0);
        free(l1);
        free(l1f);
        ref_model_free(m0);
    }
}

static void test_helpers(void **state) {
    (void)state;
    const double ref[4] = {3, 0, -4, 0};
    const float a[4] = {3, 0, -4, 0}, b[4] = {3, 1, -4, 0};
    assert_true(ref_rel_l2(a, ref, 4) == 0);
    assert_true(fabs(ref_rel_l2(b, ref, 4) - 0.2) < 1e-15);
    assert_true(ref_max_abs(b, ref, 4) == 1);
    const double x[5] = {1, 7, 7, -1, 3};
    assert_int_equal(ref_argmax(x, 5), 1);
    const float xf[3] = {-1, -0.5f, -0.5f};
    assert_int_equal(ref_argmax_f32(xf, 3), 1);
}

/* The loader refuses what llama.cpp would refuse, with a message. */
static void test_load_errors(void **state) {
    (void)state;
    char path[600], err[512];
    path_in_dir(path, sizeof path, "bad.gguf");
    struct {
        const char *arch;
        int variant;
        const char *needle;
    } cases[] = {{"llama", HAND_STRAY_QNORM, "attn_q_norm"},
                 {"qwen2", HAND_NO_BIAS, "attn_q.bias"},
                 {"llama", HAND_BAD_DIMS, "attn_q.weight"},
                 {"llama", HAND_UNKNOWN_ARCH, "gpt2"}};
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        write_hand(path, cases[i].arch, cases[i].variant);
        ref_model *m = ref_model_load(path, err, sizeof err);
        if (m) fail_msg("case %zu loaded", i);
        if (!strstr(err, cases[i].needle)) fail_msg("case %zu: message \"%s\" lacks \"%s\"", i, err, cases[i].needle);
    }
    assert_null(ref_model_load("/nonexistent/x.gguf", err, sizeof err));
    assert_true(err[0] != 0);
}

/* ---- gemma3 ---------------------------------------------------------------------------------- */

/* The hand model as a gemma3 file: the same matrices plus post-attention / post-FFN norms and the
 * q/k norms, rope.freq_base 1e6, attention.sliding_window = window, a separate output head. */
static const float H_PAN[4] = {0.75f, 1.25f, 1.0f, 0.5f}; /* post_attention_norm */
static const float H_PFN[4] = {1.5f, 0.5f, 1.0f, 2.0f};   /* post_ffw_norm */

typedef enum {
    G3_DEFAULT = 0,   /* no pattern key: Gemma 3's pattern, layer 0 is local */
    G3_PERIOD1,       /* sliding_window_pattern = 1 (u32): every layer global */
    G3_BOOL_LOCAL,    /* sliding_window_pattern = [true] */
    G3_BOOL_GLOBAL,   /* sliding_window_pattern = [false] */
    G3_NO_WINDOW,     /* attention.sliding_window missing: refused */
    G3_SOFTCAP,       /* final_logit_softcapping = 30: refused */
    G3_BAD_ARRAY,     /* sliding_window_pattern with 2 entries for 1 layer: refused */
    G3_NO_POST_FFW,   /* blk.0.post_ffw_norm.weight missing: refused */
} g3_variant;

static void write_hand_gemma3(const char *path, g3_variant variant, uint32_t window) {
    kvb_gguf_writer *w = NULL;
    kvb_err e = {0};
    assert_int_equal(kvb_gguf_writer_create(&w, &e), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_str(w, "general.architecture", "gemma3", &e), KVB_OK);
    const struct {
        const char *k;
        uint32_t v;
    } u32s[] = {{"gemma3.context_length", 16}, {"gemma3.embedding_length", 4}, {"gemma3.block_count", 1},
                {"gemma3.feed_forward_length", 4}, {"gemma3.attention.head_count", 1},
                {"gemma3.attention.head_count_kv", 1}};
    for (size_t i = 0; i < KVB_ARRAY_LEN(u32s); i++)
        assert_int_equal(kvb_gguf_writer_add_u32(w, u32s[i].k, u32s[i].v, &e), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_f32(w, "gemma3.rope.freq_base", 1e6f, &e), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_f32(w, "gemma3.attention.layer_norm_rms_epsilon", H_EPS, &e), KVB_OK);
    if (variant != G3_NO_WINDOW)
        assert_int_equal(kvb_gguf_writer_add_u32(w, "gemma3.attention.sliding_window", window, &e), KVB_OK);
    const char *pk = "gemma3.attention.sliding_window_pattern";
    const bool yes[2] = {true, true}, no[1] = {false};
    if (variant == G3_PERIOD1) assert_int_equal(kvb_gguf_writer_add_u32(w, pk, 1, &e), KVB_OK);
    if (variant == G3_BOOL_LOCAL) assert_int_equal(kvb_gguf_writer_add_arr(w, pk, KVB_GGUF_BOOL, yes, 1, &e), KVB_OK);
    if (variant == G3_BOOL_GLOBAL) assert_int_equal(kvb_gguf_writer_add_arr(w, pk, KVB_GGUF_BOOL, no, 1, &e), KVB_OK);
    if (variant == G3_BAD_ARRAY) assert_int_equal(kvb_gguf_writer_add_arr(w, pk, KVB_GGUF_BOOL, yes, 2, &e), KVB_OK);
    if (variant == G3_SOFTCAP)
        assert_int_equal(kvb_gguf_writer_add_f32(w, "gemma3.final_logit_softcapping", 30.0f, &e), KVB_OK);

    ref_fix_tensor t[20];
    size_t n = 0;
#define T1(nm, arr) t[n++] = (ref_fix_tensor){.name = nm, .n_dims = 1, .ne = {4, 1}, .type = KVB_TYPE_F32, .data = arr}
#define T2(nm, arr, rows) \
    t[n++] = (ref_fix_tensor){.name = nm, .n_dims = 2, .ne = {4, rows}, .type = KVB_TYPE_F32, .data = &arr[0][0]}
    T2("token_embd.weight", HE, 5);
    T1("output_norm.weight", H_ON);
    T2("output.weight", H_OUT, 5);
    T1("blk.0.attn_norm.weight", H_AN);
    T2("blk.0.attn_q.weight", H_WQ, 4);
    T2("blk.0.attn_k.weight", H_WK, 4);
    T2("blk.0.attn_v.weight", H_WV, 4);
    T1("blk.0.attn_q_norm.weight", H_QN);
    T1("blk.0.attn_k_norm.weight", H_KN);
    T2("blk.0.attn_output.weight", H_WO, 4);
    T1("blk.0.post_attention_norm.weight", H_PAN);
    T1("blk.0.ffn_norm.weight", H_FN);
    T2("blk.0.ffn_gate.weight", H_ID, 4);
    T2("blk.0.ffn_up.weight", H_UP, 4);
    T2("blk.0.ffn_down.weight", H_ID, 4);
    if (variant != G3_NO_POST_FFW) T1("blk.0.post_ffw_norm.weight", H_PFN);
#undef T1
#undef T2
    char err[512];
    if (ref_fixture_write_tensors(w, t, n, path, err, sizeof err) != 0) fail_msg("%s", err);
    kvb_gguf_writer_destroy(w);
}

/* NEOX rotation of a 4-vector at position pos: pair (0,2) by pos * 1, pair (1,3) by pos * base^(-1/2). */
static void h_rope_neox(double x[4], int pos, double base) {
    const double th[2] = {pos * 1.0, pos * pow(base, -0.5)};
    const int pairs[2][2] = {{0, 2}, {1, 3}};
    for (int p = 0; p < 2; p++) {
        const double a = x[pairs[p][0]], b = x[pairs[p][1]];
        x[pairs[p][0]] = a * cos(th[p]) - b * sin(th[p]);
        x[pairs[p][1]] = a * sin(th[p]) + b * cos(th[p]);
    }
}

/* Logits of the gemma3 hand model for tokens tok[0..3) at positions 0..2, written out: embeddings
 * times sqrt(4) = 2; q/k norms; NEOX RoPE with base 10000 (local) or 1e6 (global); scores times
 * 1/sqrt(head_dim) = 1/2; a local query at t sees keys t - window < j <= t; post-attention norm;
 * GeGLU with tanh GELU; post-FFN norm. */
static void hand_gemma3_expected(const int32_t tok[3], bool local, int window, double logits[3][5]) {
    double x[3][4], q[3][4], k[3][4], v[3][4];
    for (int t = 0; t < 3; t++) {
        for (int i = 0; i < 4; i++) x[t][i] = 2.0 * HE[tok[t]][i];
        const double r = h_rms(x[t]);
        double h[4];
        for (int i = 0; i < 4; i++) h[i] = x[t][i] / r * H_AN[i];
        q[t][0] = h[0] + 0.5 * h[3];
        q[t][1] = h[1];
        q[t][2] = 0.25 * h[0] + h[2];
        q[t][3] = h[3];
        k[t][0] = h[0];
        k[t][1] = h[1] - 0.5 * h[2];
        k[t][2] = h[2];
        k[t][3] = 2 * h[3];
        v[t][0] = h[0] + 2 * h[1];
        v[t][1] = h[1];
        v[t][2] = h[2];
        v[t][3] = 3 * h[2] + h[3];
        const double rq = h_rms(q[t]), rk = h_rms(k[t]);
        for (int i = 0; i < 4; i++) {
            q[t][i] = q[t][i] / rq * H_QN[i];
            k[t][i] = k[t][i] / rk * H_KN[i];
        }
        h_rope_neox(q[t], t, local ? 10000.0 : 1e6);
        h_rope_neox(k[t], t, local ? 10000.0 : 1e6);
    }
    for (int t = 0; t < 3; t++) {
        const int lo = local && t - window + 1 > 0 ? t - window + 1 : 0;
        double s[3], mx = -INFINITY, sum = 0, att[4] = {0, 0, 0, 0};
        for (int j = lo; j <= t; j++) {
            s[j] = (q[t][0] * k[j][0] + q[t][1] * k[j][1] + q[t][2] * k[j][2] + q[t][3] * k[j][3]) / 2;
            mx = fmax(mx, s[j]);
        }
        for (int j = lo; j <= t; j++) sum += exp(s[j] - mx);
        for (int j = lo; j <= t; j++)
            for (int i = 0; i < 4; i++) att[i] += exp(s[j] - mx) / sum * v[j][i];
        double o[4] = {att[0], att[1], att[2], 0.5 * att[0] + att[3]};
        const double ro = h_rms(o);
        for (int i = 0; i < 4; i++) x[t][i] += o[i] / ro * H_PAN[i];
        const double r = h_rms(x[t]);
        double d[4];
        for (int i = 0; i < 4; i++) {
            const double h = x[t][i] / r * H_FN[i];
            const double gelu = 0.5 * h * (1 + tanh(sqrt(2 / M_PI) * (h + 0.044715 * h * h * h)));
            d[i] = gelu * (i + 1) * h;
        }
        const double rd = h_rms(d);
        for (int i = 0; i < 4; i++) x[t][i] += d[i] / rd * H_PFN[i];
        const double r2 = h_rms(x[t]);
        double y[4];
        for (int i = 0; i < 4; i++) y[i] = x[t][i] / r2 * H_ON[i];
        for (int o2 = 0; o2 < 5; o2++)
            logits[t][o2] = H_OUT[o2][0] * y[0] + H_OUT[o2][1] * y[1] + H_OUT[o2][2] * y[2] + H_OUT[o2][3] * y[3];
    }
}

static void test_gemma3_hand_model(void **state) {
    (void)state;
    const struct {
        g3_variant variant;
        bool local;
    } cases[] = {{G3_DEFAULT, true}, {G3_PERIOD1, false}, {G3_BOOL_LOCAL, true}, {G3_BOOL_GLOBAL, false}};
    const int32_t seqs[3][3] = {{3, 1, 4}, {0, 4, 2}, {2, 2, 1}};
    char path[600];
    path_in_dir(path, sizeof path, "hand-gemma3.gguf");
    for (size_t ci = 0; ci < KVB_ARRAY_LEN(cases); ci++)
        for (int window = 1; window <= 3; window++) {
            write_hand_gemma3(path, cases[ci].variant, (uint32_t)window);
            ref_model *m = load_ok(path);
            const ref_desc *d = ref_model_desc(m);
            assert_int_equal(d->arch, REF_ARCH_GEMMA3);
            assert_int_equal(d->swa_window, window);
            assert_int_equal(d->layer_local[0], cases[ci].local);
            assert_true(d->embd_scale == 2.0 && d->attn_scale == 0.5);
            for (int s = 0; s < 3; s++) {
                double got[3 * 5], want[3][5];
                assert_int_equal(ref_model_forward(m, seqs[s], 3, got), 0);
                hand_gemma3_expected(seqs[s], cases[ci].local, window, want);
                for (int t = 0; t < 3; t++)
                    for (int o = 0; o < 5; o++)
                        if (fabs(got[t * 5 + o] - want[t][o]) > 1e-12 * (1 + fabs(want[t][o])))
                            fail_msg("gemma3 case %zu window %d seq %d token %d logit %d: ref %.17g hand %.17g", ci,
                                     window, s, t, o, got[t * 5 + o], want[t][o]);
                /* the window is visible: a local layer with window 1 or 2 changes token 2, not token 0 */
                if (cases[ci].local && window < 3 && seqs[s][0] != seqs[s][2]) {
                    double full[3][5], diff = 0;
                    hand_gemma3_expected(seqs[s], true, 3, full);
                    for (int o = 0; o < 5; o++) {
                        diff += fabs(full[2][o] - want[2][o]);
                        assert_true(full[0][o] == want[0][o]);
                    }
                    if (!(diff > 1e-4)) fail_msg("gemma3 window %d invisible at token 2 (diff %g)", window, diff);
                }
            }
            /* the local and global RoPE bases are told apart */
            double other[3][5], mine[3][5], diff = 0;
            hand_gemma3_expected(seqs[0], cases[ci].local, 3, mine);
            hand_gemma3_expected(seqs[0], !cases[ci].local, 3, other);
            for (int o = 0; o < 5; o++) diff += fabs(other[2][o] - mine[2][o]);
            assert_true(diff > 1e-6);
            ref_model_free(m);
        }
}

/* On random gemma3 fixtures (7 layers: 0-4 and 6 local, 5 global): logits of tokens before the
 * window fills do not depend on the window; later ones do; with every layer global the window key
 * is ignored; the layer pattern is read from the key in both of its forms. */
static void test_gemma3_window(void **state) {
    (void)state;
    enum { N = 12 };
    const int32_t toks[N] = {5, 17, 3, 96, 0, 42, 42, 7, 60, 8, 1, 33};
    char p1[600], p2[600];
    path_in_dir(p1, sizeof p1, "g3a.gguf");
    path_in_dir(p2, sizeof p2, "g3b.gguf");
    for (int all_global = 0; all_global < 2; all_global++) {
        ref_fixture_cfg c;
        ref_fixture_default(&c, "gemma3", KVB_TYPE_F32, 4242);
        if (all_global) c.swa_pattern = 1;
        c.swa_window = 4;
        write_fixture(&c, p1);
        c.swa_window = 1000;
        write_fixture(&c, p2);
        ref_model *ma = load_ok(p1), *mb = load_ok(p2);
        const ref_desc *d = ref_model_desc(ma);
        for (int l = 0; l < d->n_layer; l++) assert_int_equal(d->layer_local[l], !all_global && l != 5);
        const int V = d->n_vocab;
        double *la = malloc(sizeof(double) * N * V), *lb = malloc(sizeof(double) * N * V);
        assert_int_equal(ref_model_forward(ma, toks, N, la), 0);
        assert_int_equal(ref_model_forward(mb, toks, N, lb), 0);
        assert_memory_equal(la, lb, sizeof(double) * 4 * V); /* t < 4: the whole prefix is inside both windows */
        double diff = 0;
        for (int i = 4 * V; i < N * V; i++) diff += fabs(la[i] - lb[i]);
        if (all_global) assert_true(diff == 0);
        else assert_true(diff > 1e-3);
        free(la);
        free(lb);
        ref_model_free(ma);
        ref_model_free(mb);
    }
    /* the pattern as booleans: exactly the listed layers are local */
    ref_fixture_cfg c;
    ref_fixture_default(&c, "gemma3", KVB_TYPE_F32, 4243);
    const bool layers[7] = {false, true, true, false, true, false, false};
    c.swa_layers = layers;
    write_fixture(&c, p1);
    ref_model *m = load_ok(p1);
    for (int l = 0; l < 7; l++) assert_int_equal(ref_model_desc(m)->layer_local[l], layers[l]);
    for (int i = 0; i < ref_model_desc(m)->n_rot / 2; i++) {
        assert_true(ref_model_inv_freq_layer(m, 1)[i] == pow(10000.0, -2.0 * i / ref_model_desc(m)->n_rot));
        assert_true(fabs(ref_model_inv_freq_layer(m, 0)[i] - pow(1e6, -2.0 * i / ref_model_desc(m)->n_rot)) <=
                    1e-15 * ref_model_inv_freq_layer(m, 0)[i]);
    }
    ref_model_free(m);
}

static void test_gemma3_load_errors(void **state) {
    (void)state;
    char path[600], err[512];
    path_in_dir(path, sizeof path, "bad-gemma3.gguf");
    const struct {
        g3_variant variant;
        const char *needle;
    } cases[] = {{G3_NO_WINDOW, "sliding_window"},
                 {G3_SOFTCAP, "final_logit_softcapping"},
                 {G3_BAD_ARRAY, "sliding_window_pattern"},
                 {G3_NO_POST_FFW, "post_ffw_norm"}};
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        write_hand_gemma3(path, cases[i].variant, 2);
        ref_model *m = ref_model_load(path, err, sizeof err);
        if (m) fail_msg("gemma3 case %zu loaded", i);
        if (!strstr(err, cases[i].needle)) fail_msg("case %zu: message \"%s\" lacks \"%s\"", i, err, cases[i].needle);
    }
    write_hand_gemma3(path, G3_DEFAULT, 0); /* a window of 0 tokens */
    assert_null(ref_model_load(path, err, sizeof err));
    assert_non_null(strstr(err, "sliding_window"));
}

static int setup(void **state) {
    (void)state;
    return ref_tmpdir_create(g_dir, sizeof g_dir);
}

static int teardown(void **state) {
    (void)state;
    ref_tmpdir_remove(g_dir);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dequant_known_bytes), cmocka_unit_test(test_dequant_matches_quant),
        cmocka_unit_test(test_helpers),             cmocka_unit_test(test_hand_model),
        cmocka_unit_test(test_causal),              cmocka_unit_test(test_rope),
        cmocka_unit_test(test_gqa),                 cmocka_unit_test(test_rope_scaling),
        cmocka_unit_test(test_tied_output),         cmocka_unit_test(test_types_close_to_f32),
        cmocka_unit_test(test_load_errors),         cmocka_unit_test(test_gemma3_hand_model),
        cmocka_unit_test(test_gemma3_window),       cmocka_unit_test(test_gemma3_load_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
