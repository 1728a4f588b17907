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

/* Whole-row conversions for supported types (F32, F16, BF16, Q8_0, Q4_0). n must be a multiple
 * of the type's block. kvb_f32_to_row uses ggml's reference quantisers byte for byte, so files we
 * write are the files llama-quantize writes:
 *   Q8_0 (quantize_row_q8_0_ref): amax = max|x|, d = amax/127, id = d ? 1/d : 0,
 *        q = roundf(x*id) -- halves away from zero, NOT the activation rule below --, stored fp16(d)
 *   Q4_0 (quantize_row_q4_0_ref): max = the x of largest |x| (first one on ties), d = max/-8,
 *        id = d ? 1/d : 0, q = min(15, (int)(x*id + 8.5f)) (truncation), stored fp16(d)
 * Where ggml is undefined (NaN inputs, 1/d overflowing to inf for |x| < ~1e-37) we define: Q8_0 q
 * clamped to [-127, 127], NaN -> 0; Q4_0 t = x*id + 8.5f < 0 or NaN -> 0. */
void kvb_row_to_f32(uint32_t type, const void *src, float *dst, int64_t n);
void kvb_f32_to_row(uint32_t type, const float *src, void *dst, int64_t n);

/* ---- canonical dot products ----------------------------------------------------------------
 *
 * A weight row of type W is multiplied with an activation row in that type's "activation type":
 *   W in {F32, F16, BF16}  -> activation F32 (the f32 vector itself)
 *   W in {Q8_0, Q4_0}      -> activation Q8_0 (the vector quantised with kvb_quantize_act)
 *
 * Canonical order (every implementation, scalar or SIMD or CUDA, must produce these bits):
 *   float acc[16] = {+0};
 *   float types : for i in 0..n-1: acc[i % 16] = fmaf(w_i, x_i, acc[i % 16])
 *                 (w_i is the exact f32 value of the f16/bf16 element)
 *   quant types : for block b in 0..n/32-1:
 *                   int32 s  = sum over the 32 elements of wq_j * xq_j   (exact integers;
 *                              Q4_0's wq_j = nibble - 8)
 *                   float d  = fp16_to_f32(w.d) * fp16_to_f32(x.d)        (one f32 rounding)
 *                   acc[b % 16] = fmaf((float)s, d, acc[b % 16])
 *   reduce      : for h in 8, 4, 2, 1: for i < h: acc[i] = acc[i] + acc[i + h];  result acc[0]
 * No other rounding happens ((float)s is exact: |s| <= 32*128*128 < 2^24; the product of two
 * fp16 values is exact in f32, so d is in fact exact too). Because of this, results do not depend
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
 * Invalid arguments (an unsupported type, a quant n that is not a multiple of 32, n < 0) are a
 * caller bug: kvb_dot returns NaN and kvb_matmul_tile writes NaN to every output. n == 0 gives 0.
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
 * tiles run at roughly two thirds of that. Prefill reuses each weight group for up to 16 tokens. */
void kvb_matmul_tile(uint32_t weight_type, const void *w, size_t w_stride, int n_rows,
                     const void *act, size_t act_stride, int n_tok, float *y, size_t y_stride,
                     int64_t n);

/* Which SIMD implementation the run-time dispatch chose ("avx512-vnni", "avx2", "neon",
 * "scalar"), and a switch to force one (for tests and benchmarks): returns KVB_ERR_UNSUPPORTED
 * if the CPU cannot run it. "auto" restores the best. */
const char *kvb_simd_name(void);
kvb_status kvb_simd_force(const char *name, kvb_err *err);

#endif
