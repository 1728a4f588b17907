/* quant internals — shared only by the files of src/quant: the table of SIMD kernels that the
 * run-time dispatch (dispatch.c) chooses from, the portable reference kernels every SIMD set
 * must match bit for bit (dot_scalar.c, types.c), and the fixed lane permutation that the
 * AVX-512 quant kernels use internally. Nothing here is part of the public contract. */
#ifndef KVB_QUANT_IMPL_H
#define KVB_QUANT_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "kvb_quant.h"

/* Same contract as kvb_matmul_tile (types already validated by the caller). */
typedef void (*kvb_matmul_fn)(uint32_t weight_type, const void *w, size_t w_stride, int n_rows,
                              const void *act, size_t act_stride, int n_tok, float *y,
                              size_t y_stride, int64_t n);
/* Q8_0 activation quantiser: x [n] f32 -> dst [n/32] kvb_block_q8_0; n multiple of 32. */
typedef void (*kvb_qact_fn)(const float *x, void *dst, int64_t n);

typedef struct {
    const char *name;          /* "scalar", "avx2", "avx512-vnni", "neon" */
    kvb_matmul_fn matmul;      /* kvb_dot is matmul with n_rows = n_tok = 1 */
    kvb_qact_fn quantize_q8_0; /* the activation quantiser (canonical, see types.c) */
    /* f16 row -> f32 (exact conversion; NULL: the portable loop in types.c). The attention reads
     * f16 cache rows through this. */
    void (*f16_to_f32)(const uint16_t *src, float *dst, int64_t n);
    /* Q8_0 blocks (n_blocks) -> f32, each element (float)q * d rounded once (NULL: the portable
     * loop in types.c). The attention reads q8_0 cache rows through this. */
    void (*q8_0_to_f32)(const void *src, float *dst, int64_t n_blocks);
    /* kvb_f32_rows_weighted_add (NULL: the portable loop in types.c). */
    void (*rows_weighted_add)(float *acc, const float *w, const float *rows, size_t row_stride, int n_rows,
                              int64_t n);
} kvb_quant_kernels;

extern const kvb_quant_kernels kvb_quant_kernels_scalar;
#if defined(KVB_X86)
extern const kvb_quant_kernels kvb_quant_kernels_avx2;
extern const kvb_quant_kernels kvb_quant_kernels_avx512;
#endif
#if defined(KVB_ARM)
extern const kvb_quant_kernels kvb_quant_kernels_neon;
#endif

/* The kernels chosen by dispatch (never NULL; initialises dispatch on first use). */
const kvb_quant_kernels *kvb_quant_active(void);

#if defined(KVB_X86)
/* kvb_matmul_tile_ggml with AVX2 + FMA + F16C (dot_ggml_avx2.c); types already validated. */
void kvb_matmul_tile_ggml_avx2(uint32_t weight_type, const void *w, size_t w_stride, int n_rows, const void *act,
                               size_t act_stride, int n_tok, float *y, size_t y_stride, int64_t n);
#endif

/* Portable reference implementations (dot_scalar.c / types.c). */
float kvb_dot_scalar(uint32_t weight_type, const void *w_row, const void *act_row, int64_t n);
void kvb_quantize_q8_0_act_ref(const float *x, void *dst, int64_t n);

/* 1 for the quantised weight types of 32-element blocks (Q8_0, Q4_0, Q5_0). */
static inline int kvb_is_q32_type(uint32_t t) {
    return t == KVB_TYPE_Q8_0 || t == KVB_TYPE_Q4_0 || t == KVB_TYPE_Q5_0;
}
/* 1 for the K-quants (256-element super-blocks) the dot kernels handle. */
static inline int kvb_is_kquant_type(uint32_t t) {
    return t == KVB_TYPE_Q4_K || t == KVB_TYPE_Q5_K || t == KVB_TYPE_Q6_K;
}
/* 1 for the weight types the dot kernels handle (F32, F16, BF16 and the two groups above). */
static inline int kvb_dot_type_ok(uint32_t t) {
    return t == KVB_TYPE_F32 || t == KVB_TYPE_F16 || t == KVB_TYPE_BF16 || kvb_is_q32_type(t) ||
           kvb_is_kquant_type(t);
}

#endif
