/* quant — ggml's tensor element types (block layouts byte-compatible with GGUF files from the
 * wild), conversion to and from f32, and the canonical dot products the engines use for every
 * matrix-vector and matrix-matrix product. The dot products are specified as a fixed order of
 * IEEE operations (see "canonical dot" below), implemented once portably and again with SIMD
 * (AVX2, AVX-512/VNNI, NEON) chosen at run time; every implementation returns bit-identical
 * results, which is what lets a CUDA kernel reproduce the CPU decoder's arithmetic exactly. */
#ifndef KVB_QUANT_H
#define KVB_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "kvb_core.h"

/* ggml's type numbers, as stored in GGUF tensor infos. */
typedef enum {
    KVB_TYPE_F32 = 0,
    KVB_TYPE_F16 = 1,
    KVB_TYPE_Q4_0 = 2,
    KVB_TYPE_Q4_1 = 3,
    KVB_TYPE_Q5_0 = 6,
    KVB_TYPE_Q5_1 = 7,
    KVB_TYPE_Q8_0 = 8,
    KVB_TYPE_Q8_1 = 9,
    KVB_TYPE_Q2_K = 10,
    KVB_TYPE_Q3_K = 11,
    KVB_TYPE_Q4_K = 12,
    KVB_TYPE_Q5_K = 13,
    KVB_TYPE_Q6_K = 14,
    KVB_TYPE_Q8_K = 15,
    KVB_TYPE_I8 = 24,
    KVB_TYPE_I16 = 25,
    KVB_TYPE_I32 = 26,
    KVB_TYPE_I64 = 27,
    KVB_TYPE_F64 = 28,
    KVB_TYPE_BF16 = 30,
    KVB_TYPE_COUNT_ = 40, /* upper bound of type numbers we know the layout of */
} kvb_type;

/* Block layouts (ggml's, byte-exact). fp16/bf16 stored as uint16_t bit patterns. */
#define KVB_QK8_0 32
typedef struct {
    uint16_t d;              /* fp16 scale */
    int8_t qs[KVB_QK8_0];    /* x = d * qs[i] */
} kvb_block_q8_0;            /* 34 bytes */
#define KVB_QK4_0 32
typedef struct {
    uint16_t d;              /* fp16 scale */
    uint8_t qs[KVB_QK4_0 / 2]; /* element j (j<16): low nibble of qs[j]; element j+16: high nibble; x = d*(q-8) */
} kvb_block_q4_0;            /* 18 bytes */
#define KVB_QK5_0 32
typedef struct {
    uint16_t d;                /* fp16 scale */
    uint8_t qh[4];             /* fifth bits: bit j of the little-endian uint32 qh[0..3] (bit j % 8 of
                                  qh[j / 8]) is bit 4 of element j */
    uint8_t qs[KVB_QK5_0 / 2]; /* low four bits: element j (j<16) low nibble of qs[j], element j+16
                                  high nibble; q = low | fifth << 4 in 0..31, x = d*(q-16) */
} kvb_block_q5_0;            /* 22 bytes */

/* K-quants: super-blocks of 256 elements (KVB_QK_K). Q4_K and Q5_K have 8 sub-blocks of 32
 * elements, each with a 6-bit scale sc_s and a 6-bit min m_s packed into scales[12]
 * (kvb_k_scale_min in kvb_quant_scalar.h spells out the packing):
 *     s < 4:  sc_s = scales[s] & 63                               m_s = scales[s+4] & 63
 *     s >= 4: sc_s = (scales[s+4] & 15) | (scales[s-4] >> 6) << 4  m_s = (scales[s+4] >> 4) | (scales[s] >> 6) << 4
 *   Q4_K element l (0..31) of sub-block s: q = nibble of qs[32*(s/2) + l], the low nibble for even
 *        s, the high one for odd s (0..15);  x = (fp16(d)*sc_s)*q - fp16(dmin)*m_s
 *   Q5_K: the same 4 bits, plus bit s of qh[l] as bit 4 (q in 0..31); same formula
 *   Q6_K has 16 sub-blocks of 16 elements with an int8 scale each. Element e (0..255), with
 *        h = e/128, c = (e%128)/32, l = e%32: the low four bits are the nibble of
 *        ql[64h + 32*(c%2) + l] (low nibble for c < 2, high for c >= 2), the top two bits are
 *        bits 2c, 2c+1 of qh[32h + l]; q in 0..63;  x = (fp16(d)*scales[e/16])*(q-32) */
#define KVB_QK_K 256
typedef struct {
    uint16_t d;               /* fp16 super-scale of the sub-block scales */
    uint16_t dmin;            /* fp16 super-scale of the sub-block mins */
    uint8_t scales[12];       /* 8 x (6-bit scale, 6-bit min), packed as above */
    uint8_t qs[KVB_QK_K / 2]; /* 256 nibbles */
} kvb_block_q4_k;             /* 144 bytes */
typedef struct {
    uint16_t d, dmin;         /* as Q4_K */
    uint8_t scales[12];       /* as Q4_K */
    uint8_t qh[KVB_QK_K / 8]; /* bit s of qh[l]: bit 4 of element l of sub-block s */
    uint8_t qs[KVB_QK_K / 2]; /* low four bits, as Q4_K */
} kvb_block_q5_k;             /* 176 bytes */
typedef struct {
    uint8_t ql[KVB_QK_K / 2]; /* low four bits */
    uint8_t qh[KVB_QK_K / 4]; /* high two bits */
    int8_t scales[16];        /* scale of sub-block t = elements 16t..16t+15 */
    uint16_t d;               /* fp16 super-scale */
} kvb_block_q6_k;             /* 210 bytes */

/* Layout facts; valid for every type whose layout is known (including ones we cannot compute
 * with, so a GGUF reader can check tensor sizes). block_elems==0 means unknown type. */
typedef struct {
    const char *name;     /* "F32", "Q8_0", "Q4_K", "IQ2_XXS", ... (ggml's names, upper case) */
    int block_elems;      /* elements per block (1 for scalars) */
    int block_bytes;      /* bytes per block */
    int supported;        /* 1 if kvb_row_to_f32 / kvb_f32_to_row / dot work on it */
} kvb_type_info;

const kvb_type_info *kvb_type_get(uint32_t type); /* NULL for unknown type numbers */
const char *kvb_type_name(uint32_t type);         /* "?" for unknown */
/* Parses any known type name, case-insensitively ("f32", "F16", "bf16", "q8_0", "Q4_K"...).
 * Returns KVB_ERR_INVALID for unknown names. */
kvb_status kvb_type_from_name(const char *name, kvb_type *out, kvb_err *err);
/* Bytes of a row of n elements; 0 if the type is unknown or n is not a multiple of its block. */
size_t kvb_row_bytes(uint32_t type, int64_t n);

/* fp16 / bf16 scalar conversions: round to nearest even, overflow to inf, no denormal flushing;
 * NaN stays NaN and is made quiet (fp16: sign and top payload bits kept, exactly as x86 F16C
 * vcvtps2ph/vcvtph2ps; bf16: ggml's (bits >> 16) | 0x40). fp16/bf16 -> f32 is exact. */
float kvb_fp16_to_f32(uint16_t h);
uint16_t kvb_f32_to_fp16(float f);
float kvb_bf16_to_f32(uint16_t h);
uint16_t kvb_f32_to_bf16(float f);

/* Whole-row conversions for supported types (F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K).
 * n must be a multiple of the type's block (32, or 256 for the K-quants).
 * kvb_row_to_f32 computes each element as the formulas above with f32 products in the order
 * written: Q8_0 qs*d, Q4_0 (q-8)*d, Q5_0 (q-16)*d, Q4_K/Q5_K ((d*sc)*q) - (dmin*m), Q6_K
 * (d*sc)*(q-32). Every product there is exact in f32 (at most 11+6+5 = 22 significant bits, all
 * multiples of 2^-24), so each element is its exact value, or for Q4_K/Q5_K the exact value rounded
 * once by the subtraction -- the same f32 values as ggml's dequantisers and the gguf Python
 * package's numpy ones. kvb_f32_to_row uses ggml's reference quantisers byte for byte for the
 * 32-element types, so those files are the files llama-quantize writes:
 *   Q8_0 (quantize_row_q8_0_ref): amax = max|x|, d = amax/127, id = d ? 1/d : 0,
 *        q = roundf(x*id) -- halves away from zero, NOT the activation rule below --, stored fp16(d)
 *   Q4_0 (quantize_row_q4_0_ref): max = the x of largest |x| (first one on ties), d = max/-8,
 *        id = d ? 1/d : 0, q = min(15, (int)(x*id + 8.5f)) (truncation), stored fp16(d)
 *   Q5_0 (quantize_row_q5_0_ref): the same with d = max/-16, q = min(31, (int)(x*id + 16.5f))
 * Where ggml is undefined (NaN inputs, 1/d overflowing to inf for |x| < ~1e-37) we define: Q8_0 q
 * clamped to [-127, 127], NaN -> 0; Q4_0/Q5_0 t = x*id + 8.5f (16.5f) < 0 or NaN -> 0.
 * The K-quants use our own simple quantiser (deterministic, plain IEEE f32 arithmetic; NOT
 * llama-quantize's iterative search, so its bytes differ from llama.cpp's, though any reader
 * decodes them the same). fp16_up(v) below is the smallest fp16 >= v, capped at 65504:
 *   Q4_K / Q5_K (L = 15 / 31), per super-block, per sub-block s of 32:
 *        mn_s = -min(0, min x);  dmin = fp16_up(max_s mn_s / 63);  m_s = min(63, ceil(mn_s/dmin))
 *        (0 when dmin == 0);  off_s = dmin*m_s;  step_s = max(0, max x + off_s) / L;
 *        d = fp16_up(max_s step_s / 63);  sc_s = min(63, ceil(step_s/d)) (0 when d == 0);
 *        q = clamp(round_half_even((x + off_s) / (d*sc_s)), 0, L)  (0 when d*sc_s == 0)
 *   Q6_K, per super-block, per sub-block t of 16: step_t = max|x| / 31;
 *        d = fp16_up(max_t step_t / 127);  sc_t = min(127, ceil(step_t/d)) (0 when d == 0);
 *        q = 32 + clamp(round_half_even(x / (d*sc_t)), -32, 31)
 * Every element is then within half a step (d*sc_s) of its input up to f32 rounding (the ceilings
 * make the grid cover the sub-block's range), where the step is at most the sub-block's range / L
 * plus one super-block unit d (~ the largest sub-block range / (63 L)); tests/test_quant.c checks
 * that bound. The bound needs the steps to fit fp16 (|x| up to ~6e7 for Q4_K); beyond that the
 * scales saturate at 65504 and q clamps. NaN inputs are skipped by min/max and give q at the
 * clamp or 0; the blocks stay finite. */
void kvb_row_to_f32(uint32_t type, const void *src, float *dst, int64_t n);
void kvb_f32_to_row(uint32_t type, const float *src, void *dst, int64_t n);

/* Weighted sum of rows into an accumulator (attention's P·V, one query head): for r = 0 ..
 * n_rows-1 in this order, for every i < n:
 *     acc[i] = acc[i] + w[r] * rows[r * row_stride + i]
 * with the product rounded to f32 and then the sum rounded (never a fused multiply-add). Every
 * element is its own chain of operations, so every implementation (SIMD width, dispatch) returns
 * the same bits. acc must not overlap rows. row_stride is in floats. */
void kvb_f32_rows_weighted_add(float *acc, const float *w, const float *rows, size_t row_stride, int n_rows,
                               int64_t n);

/* ---- canonical dot products ----------------------------------------------------------------
 *
 * A weight row of type W is multiplied with an activation row in that type's "activation type":
 *   W in {F32, F16, BF16}                     -> activation F32 (the f32 vector itself)
 *   W in {Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K} -> activation Q8_0 (the vector quantised with
 *                                                kvb_quantize_act)
 *
 * Canonical order (every implementation, scalar or SIMD or CUDA, must produce these bits):
 *   float acc[16] = {+0};
 *   float types : for i in 0..n-1: acc[i % 16] = fmaf(w_i, x_i, acc[i % 16])
 *                 (w_i is the exact f32 value of the f16/bf16 element)
 *   quant types : for each 32-element activation block b in 0..n/32-1 (x = that Q8_0 block,
 *                 xq_j its 32 int8 values, j = 0..31, lane = b % 16):
 *     Q8_0, Q4_0, Q5_0 (weight block w = block b of the row):
 *                   int32 s  = sum over j of wq_j * xq_j   (exact integers; Q4_0's wq_j =
 *                              nibble - 8, Q5_0's wq_j = 5-bit q - 16)
 *                   float d  = fp16(w.d) * fp16(x.d)        (fp16(h) = kvb_fp16_to_f32(h))
 *                   acc[lane] = fmaf((float)s, d, acc[lane])
 *     Q4_K, Q5_K (super-block B = b / 8 of the row, sub-block k = b % 8 of it, whose elements
 *                 j are the block's; q_j in 0..15 / 0..31, 6-bit sc_k and m_k):
 *                   int32 s  = sum over j of q_j * xq_j;  int32 sx = sum over j of xq_j  (exact)
 *                   float dA = (fp16(B.d) * (float)sc_k) * fp16(x.d)     (two products, each
 *                   float dM = (fp16(B.dmin) * (float)m_k) * fp16(x.d)    rounded, in this order)
 *                   acc[lane] = fmaf((float)s, dA, acc[lane])
 *                   acc[lane] = fmaf(-(float)sx, dM, acc[lane])
 *     Q6_K (super-block B = b / 8; the block's elements are sub-blocks t = 2*(b % 8) (j < 16)
 *           and t + 1 (j >= 16); q_j in 0..63):
 *                   int32 S  = B.scales[t]   * sum over j < 16  of (q_j - 32) * xq_j
 *                            + B.scales[t+1] * sum over j >= 16 of (q_j - 32) * xq_j   (exact)
 *                   float d  = fp16(B.d) * fp16(x.d)
 *                   acc[lane] = fmaf((float)S, d, acc[lane])
 *   reduce      : for h in 8, 4, 2, 1: for i < h: acc[i] = acc[i] + acc[i + h];  result acc[0]
 * The K-quants need n to be a multiple of 256; block b still feeds lane b % 16, so a super-block
 * feeds lanes 0-7 or 8-15.
 * No other rounding happens. The integer sums are exact in f32: |s| <= 32*128*128 (Q8_0),
 * 32*16*127 (Q5_0), 32*31*127 (Q5_K), |sx| <= 32*127, and for Q6_K |S| <= 2*128*(16*32*127) =
 * 16646144 < 2^24 (activations are in [-127, 127], |q - 32| <= 32, |scale| <= 128). The product
 * of two fp16 values is exact in f32, so d is in fact exact too, and so is fp16(B.d)*sc (at most
 * 17 significant bits); only dA and dM round. Because of this, results do not depend
 * on the SIMD width, the number of threads, how many rows or tokens a kernel handles at once, or
 * the machine. Rules every implementation must also follow:
 *   - IEEE f32 with denormals kept (no FTZ/DAZ; CUDA: no --use_fast_math, -ftz=false), default
 *     round-to-nearest-even. fmaf means one fused multiply-add with a single rounding.
 *   - A lane that no element/block maps to is never touched: with n % 16 != 0 (float types) or
 *     n/32 % 16 != 0 (quant types) the idle lanes must not receive a padded 0*0 (that would turn
 *     a -0 lane, e.g. from an underflowed product, into +0); use masked fma / blends.
 *   - If the result is NaN, only its NaN-ness is specified (sign and payload may differ between
 *     implementations); every non-NaN result, including the sign of zero, is bit-exact.
 *   - Q8_0 activation rows hold q in [-127, 127] (kvb_quantize_act guarantees it).
 * Invalid arguments (an unsupported type, a quant n that is not a multiple of 32 -- 256 for the
 * K-quants --, n < 0) are a caller bug: kvb_dot returns NaN and kvb_matmul_tile writes NaN to
 * every output. n == 0 gives 0.
 * --------------------------------------------------------------------------------------------- */

uint32_t kvb_act_type(uint32_t weight_type); /* F32 or Q8_0 for supported weight types */
/* Converts an f32 activation row (n elements) into the activation type for weight_type.
 * For F32 activations this is a copy. dst must hold kvb_row_bytes(kvb_act_type(wt), n).
 * Q8_0 activations (every implementation produces these bytes), per block of 32:
 *   amax = max |x_j|, or NaN if any x_j is NaN
 *   d    = amax / 127.0f;  id = (d != 0) ? 1.0f / d : 0.0f     (NaN d gives NaN id)
 *   q_j  = v = x_j * id;  NaN -> 0;  else round-half-even(clamp(v, -127, 127))
 *          (independent of the FPU rounding mode: vcvtps2dq with RNE, vcvtnq_s32_f32, ...)
 *   stored d = kvb_f32_to_fp16(d)
 * So q is always in [-127, 127] (never -128): the SIMD dot kernels rely on that for activation
 * rows (weights may hold any byte). A NaN in a block makes its d NaN and the dot NaN. */
void kvb_quantize_act(uint32_t weight_type, const float *x, void *dst, int64_t n);

/* The canonical dot of one weight row and one activation row (n elements). */
float kvb_dot(uint32_t weight_type, const void *w_row, const void *act_row, int64_t n);

/* Matrix product tile: for r in [0, n_rows), t in [0, n_tok):
 *     y[t * y_stride + r] = kvb_dot(type, w + r * w_stride, act + t * act_stride, n)
 * Bit-identical to calling kvb_dot per pair; faster because weights are read once per tile.
 * Strides are in bytes for w and act, in floats for y; rows must be aligned for their element
 * type (4 bytes for F32 weights and all f32 activations, 2 for the rest). Only the n_rows x n_tok
 * outputs are written. Speed: the AVX-512 quant kernels prepare each activation group once per
 * 16 rows, so decode (n_tok = 1) runs at memory bandwidth with tiles of >= 16 rows; 1-4 row
 * tiles run at roughly two thirds of that. Prefill reuses each weight group for up to 16 tokens.
 * Q5_0 and the K-quants run at 1.2-1.7x Q8_0's time per weight byte (tests/quantbench.c); on
 * aarch64 they use the scalar kernels (not vectorised for NEON yet). */
void kvb_matmul_tile(uint32_t weight_type, const void *w, size_t w_stride, int n_rows,
                     const void *act, size_t act_stride, int n_tok, float *y, size_t y_stride,
                     int64_t n);

/* ---- ggml's arithmetic (the llama.cpp fidelity level) -------------------------------------
 *
 * What ggml's x86 CPU backend (llama.cpp 0c1e57098, builds with AVX2 or AVX-512) computes for a
 * matrix product with a Q8_0 or Q5_0 weight, written as plain loops: llama.cpp's own cache can
 * then be reproduced bit for bit where its inputs are the same. Its activation quantiser
 * (quantize_row_q8_0) differs from kvb_quantize_act only in the inverse scale:
 *   d = amax / 127.0f (stored fp16),  id = amax != 0 ? 127.0f / amax : 0,  q = round-half-even(x*id)
 * Its dot (ggml_vec_dot_q8_0_q8_0 / _q5_0_q8_0 and llamafile's tinyBLAS_Q0_AVX, which agree per
 * element) keeps eight f32 lanes; lane k takes the exact integer sum of elements 4k..4k+3 of each
 * 32-element block b in turn:  lane[k] = fmaf(fp16(w.d) * fp16(x.d), (float)s_bk, lane[k]); the
 * result is ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) (hsum_float_8). Q5_0's values are
 * (5-bit q) - 16 as in the canonical dot. Other weight types are not covered: F16/F32 take tinyBLAS
 * with a vector width that depends on the build, Q4_0 and the K-quants are repacked or take Q8_K
 * activations (per 256 values) on x86; kvb_ggml_dot_type says which are. NaN inputs: as
 * kvb_quantize_act (ggml leaves them undefined). */
int kvb_ggml_dot_type(uint32_t weight_type); /* 1 for Q8_0 and Q5_0 */
/* x (n f32, n a multiple of 32) -> n/32 kvb_block_q8_0 with ggml's quantiser (above). */
void kvb_quantize_act_ggml(const float *x, void *dst, int64_t n);
/* ggml's dot of one Q8_0 / Q5_0 weight row and one activation row from kvb_quantize_act_ggml
 * (NaN for any other weight type or an n that is not a multiple of 32). */
float kvb_dot_ggml(uint32_t weight_type, const void *w_row, const void *act_row, int64_t n);
/* kvb_matmul_tile's contract with kvb_dot_ggml in place of kvb_dot. */
void kvb_matmul_tile_ggml(uint32_t weight_type, const void *w, size_t w_stride, int n_rows, const void *act,
                          size_t act_stride, int n_tok, float *y, size_t y_stride, int64_t n);

/* Which SIMD implementation the run-time dispatch chose ("avx512-vnni", "avx2", "neon",
 * "scalar"), and a switch to force one (for tests and benchmarks): returns KVB_ERR_UNSUPPORTED
 * if the CPU cannot run it. "auto" restores the best. */
const char *kvb_simd_name(void);
kvb_status kvb_simd_force(const char *name, kvb_err *err);

#endif
