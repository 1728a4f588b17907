/* engine/cuda/bridge_kernels.h — private: the C entry points of the bridge kernels (bridge.cu),
 * launched on the stream given (a cudaStream_t; NULL = the default stream) by bridge_host.c.
 * Shapes in each comment. */
#ifndef KVB_BRIDGE_KERNELS_H
#define KVB_BRIDGE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* x (n, E) f32 -> act (n, act_stride): Q8_0 blocks by the canonical activation quantiser when
 * quantized, else the f32 row as is. */
int kvb_bk_quantize_act(const float *x, uint8_t *act, size_t act_stride, int n, int E, int quantized, void *stream);
/* y (n, rows) = canonical dot of each weight row (wtype, row_bytes) with each activation row;
 * split > 0: the test-only perturbation, dot(first split elements) + dot(the rest). */
int kvb_bk_project(uint32_t wtype, const uint8_t *w, size_t w_row_bytes, int rows, const uint8_t *act,
                   size_t act_stride, int n, int E, float *y, int split, void *stream);
/* The same product for Q8_0, Q4_0 and Q5_0 weights on the integer tensor cores (bridge_mma.cu),
 * bit-identical, on unpacked operands:
 *   kvb_bk_unpack_weights   the file's blocks w (rows, row_bytes) -> wq (rows, E) int8 and
 *                           wsc (rows, E/32) f32 (once, at creation)
 *   kvb_bk_quantize_act_i8  x (n, E) f32 -> aq (n, E) int8, asc (n, E/32) f32 by the canonical
 *                           activation quantiser (the scale is fp16(d), widened); x 16-byte and
 *                           aq 4-byte aligned, else cudaErrorMisalignedAddress, nothing launched
 *   kvb_bk_project_i8       y (n, rows) = the canonical dots */
int kvb_bk_unpack_weights(uint32_t wtype, const uint8_t *w, size_t w_row_bytes, int rows, int E, int8_t *wq,
                          float *wsc, void *stream);
int kvb_bk_quantize_act_i8(const float *x, int n, int E, int8_t *aq, float *asc, void *stream);
int kvb_bk_project_i8(const int8_t *wq, const float *wsc, int rows, const int8_t *aq, const float *asc, int n, int E,
                      float *y, void *stream);
/* Per (token, kv head): bias, k-norm, RoPE (cos/sin (n, n_rot/2)), encode K and V rows into
 * k_rows / v_rows (n, nkv, row_bytes) of dtype. k, v (n, nkv*hd) f32 are modified in place. */
int kvb_bk_post(float *k, float *v, int n, int nkv, int hd, const float *bk, const float *bv, const float *knorm,
                float eps, int n_rot, int neox, const float *cos_t, const float *sin_t, uint32_t dtype,
                uint8_t *k_rows, uint8_t *v_rows, size_t row_bytes, void *stream);

#ifdef __cplusplus
}
#endif

#endif
