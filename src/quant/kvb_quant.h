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
    const char *name;     /* "F32", "Q8_0", ... as ggml names them */
    int block_elems;      /* elements per block (1 for scalars) */
    int block_bytes;      /* bytes per block */
    int supported;        /* 1 if kvb_row_to_f32 / kvb_f32_to_row / dot work on it */
} kvb_type_info;

const kvb_type_info *kvb_type_get(uint32_t type); /* NULL for unknown type numbers */
const char *kvb_type_name(uint32_t type);         /* "?" for unknown */
/* Parses "f32", "F16", "bf16", "q8_0", "Q4_0"... Returns KVB_ERR_INVALID for unknown names. */
kvb_status kvb_type_from_name(const char *name, kvb_type *out, kvb_err *err);
/* Bytes of a row of n elements; 0 if the type is unknown or n is not a multiple of its block. */
size_t kvb_row_bytes(uint32_t type, int64_t n);

/* fp16 / bf16 scalar conversions: round to nearest even, NaN preserved. */
float kvb_fp16_to_f32(uint16_t h);
uint16_t kvb_f32_to_fp16(float f);
float kvb_bf16_to_f32(uint16_t h);
uint16_t kvb_f32_to_bf16(float f);

/* Whole-row conversions for supported types (F32, F16, BF16, Q8_0, Q4_0). n must be a multiple
 * of the type's block. kvb_f32_to_row uses ggml's reference quantisers (Q8_0: d = amax/127,
 * q = round-half-even(x * (1/d)); Q4_0: ggml's max-magnitude rule, d = max/-8,
 * q = min(15, (int8)(x*(1/d) + 8.5))), so files we write load in llama.cpp and vice versa. */
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
 * No other rounding happens. Because of this, results do not depend on the SIMD width, the
 * number of threads, how many rows or tokens a kernel handles at once, or the machine.
 * --------------------------------------------------------------------------------------------- */

uint32_t kvb_act_type(uint32_t weight_type); /* F32 or Q8_0 for supported weight types */
/* Converts an f32 activation row (n elements) into the activation type for weight_type.
 * For F32 activations this is a copy. dst must hold kvb_row_bytes(kvb_act_type(wt), n). */
void kvb_quantize_act(uint32_t weight_type, const float *x, void *dst, int64_t n);

/* The canonical dot of one weight row and one activation row (n elements). */
float kvb_dot(uint32_t weight_type, const void *w_row, const void *act_row, int64_t n);

/* Matrix product tile: for r in [0, n_rows), t in [0, n_tok):
 *     y[t * y_stride + r] = kvb_dot(type, w + r * w_stride, act + t * act_stride, n)
 * Bit-identical to calling kvb_dot per pair; faster because weights are read once per tile.
 * Strides are in bytes for w and act, in floats for y. */
void kvb_matmul_tile(uint32_t weight_type, const void *w, size_t w_stride, int n_rows,
                     const void *act, size_t act_stride, int n_tok, float *y, size_t y_stride,
                     int64_t n);

/* Which SIMD implementation the run-time dispatch chose ("avx512-vnni", "avx2", "neon",
 * "scalar"), and a switch to force one (for tests and benchmarks): returns KVB_ERR_UNSUPPORTED
 * if the CPU cannot run it. "auto" restores the best. */
const char *kvb_simd_name(void);
kvb_status kvb_simd_force(const char *name, kvb_err *err);

#endif
