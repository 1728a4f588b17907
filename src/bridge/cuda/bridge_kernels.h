/* bridge/cuda/bridge_kernels.h — private: the C entry points of the bridge kernels (bridge.cu),
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
 * bit-identical, on unpacked operands in fragment order (below):
 *   kvb_bk_unpack_weights   the file's blocks w (rows, row_bytes) -> wq (kvb_bk_wq_bytes) int8
 *                           and wsc (kvb_bk_wsc_count) f32 (once, at creation; pad rows zero)
 *   kvb_bk_quantize_act_i8  x (n, E) f32 -> aq (kvb_bk_aq_bytes) int8, asc (kvb_bk_asc_count)
 *                           f32 by the canonical activation quantiser (the scale is fp16(d),
 *                           widened); x 16-byte and aq 4-byte aligned, else
 *                           cudaErrorMisalignedAddress, nothing launched. Pad tokens untouched.
 *   kvb_bk_project_i8       y (n, rows) = the canonical dots
 *
 * Fragment order: the operands of one m16n8k32 mma for one warp are one contiguous piece, each
 * thread's registers side by side, so a warp loads its A fragment with one 16-byte and its B
 * fragment with one 8-byte shared load per thread, and the stage copies are plain 16-byte runs.
 * Activations: per (16-token tile, 32-element block) 512 bytes = 32 threads x 16 bytes; thread
 * 4g + c holds tokens g and g + 8, elements 4c .. 4c+3 and 16 + 4c .. 19 + 4c, as mma's a0..a3;
 * their scales: per (tile, block) 16 floats, (token g, token g + 8) per g. Weights: per (8-row
 * tile, block) 256 bytes = 32 threads x 8 bytes, thread 4g + c row g, elements 4c .. 4c+3 and
 * 16 + 4c .. 19 + 4c (b0, b1); their scales per (tile, block) 8 floats in row order. Tokens round
 * up to 16 and rows to 8 (the pad is never an output). */
#ifdef __CUDACC__
#define KVB_BK_LAYOUT __host__ __device__ static inline
#else
#define KVB_BK_LAYOUT static inline
#endif
/* Byte of element k (0 .. E-1) of token t's activations; nb = E / 32 blocks per row. */
KVB_BK_LAYOUT size_t kvb_bk_aq_offset(size_t t, size_t k, size_t nb) {
    const size_t r = t % 16, p = (k % 32) / 4;
    return (((t / 16) * nb + k / 32) * 32 + (r % 8) * 4 + p % 4) * 16 + ((p / 4) * 2 + r / 8) * 4 + k % 4;
}
/* Index of token t's block b scale. */
KVB_BK_LAYOUT size_t kvb_bk_asc_index(size_t t, size_t b, size_t nb) {
    return (((t / 16) * nb + b) * 8 + (t % 16) % 8) * 2 + (t % 16) / 8;
}
/* Byte of element k of weight row r. */
KVB_BK_LAYOUT size_t kvb_bk_wq_offset(size_t r, size_t k, size_t nb) {
    const size_t p = (k % 32) / 4;
    return (((r / 8) * nb + k / 32) * 32 + (r % 8) * 4 + p % 4) * 8 + (p / 4) * 4 + k % 4;
}
/* Index of weight row r's block b scale. */
KVB_BK_LAYOUT size_t kvb_bk_wsc_index(size_t r, size_t b, size_t nb) { return ((r / 8) * nb + b) * 8 + r % 8; }
/* Buffer sizes: aq bytes and asc floats for n tokens, wq bytes and wsc floats for rows rows. */
KVB_BK_LAYOUT size_t kvb_bk_aq_bytes(size_t n, size_t E) { return (n + 15) / 16 * 16 * E; }
KVB_BK_LAYOUT size_t kvb_bk_asc_count(size_t n, size_t E) { return (n + 15) / 16 * 16 * (E / 32); }
KVB_BK_LAYOUT size_t kvb_bk_wq_bytes(size_t rows, size_t E) { return (rows + 7) / 8 * 8 * E; }
KVB_BK_LAYOUT size_t kvb_bk_wsc_count(size_t rows, size_t E) { return (rows + 7) / 8 * 8 * (E / 32); }

int kvb_bk_unpack_weights(uint32_t wtype, const uint8_t *w, size_t w_row_bytes, int rows, int E, int8_t *wq,
                          float *wsc, void *stream);
int kvb_bk_quantize_act_i8(const float *x, int n, int E, int8_t *aq, float *asc, void *stream);
/* The projection's opt-in to more than 48 KiB of shared memory, on the current device: once per
 * device before its first kvb_bk_project_i8 there (a function attribute is per device). */
int kvb_bk_project_i8_init(void);
/* y (n, rows) from (wq, wsc) and, when wq2 is not NULL, y2 (n, rows) from (wq2, wsc2) in the same
 * launch (a layer's K and V: one grid instead of two). */
int kvb_bk_project_i8(const int8_t *wq, const float *wsc, float *y, const int8_t *wq2, const float *wsc2, float *y2,
                      int rows, const int8_t *aq, const float *asc, int n, int E, void *stream);
/* Per (token, kv head): bias, k-norm (RMS over elements [0, norm_dim) with knorm (norm_dim)),
 * RoPE of elements [rot0, rot0 + n_rot) (cos/sin (n, n_rot/2)), encode K and V rows into
 * k_rows / v_rows (n, nkv, row_bytes) of dtype. k, v (n, nkv*hd) f32 may be modified in place.
 * A head's k-norm: norm_dim = hd, rot0 = 0. deepseek2's latent row (nkv 1, hd = R + P): v and
 * v_rows NULL (no V), norm_dim R (attn_kv_a_norm), rot0 R. 16 lanes per row where the shape
 * allows (bridge.cu), one thread per row when serial (to test the one against the other) or
 * where it does not; the same bytes either way. cudaErrorInvalidValue, nothing launched, for a
 * norm or rotation outside the row or v without v_rows (or the reverse). */
int kvb_bk_post(float *k, float *v, int n, int nkv, int hd, const float *bk, const float *bv, const float *knorm,
                int norm_dim, float eps, int n_rot, int rot0, int neox, const float *cos_t, const float *sin_t,
                uint32_t dtype, uint8_t *k_rows, uint8_t *v_rows, size_t row_bytes, int serial, void *stream);

#ifdef __cplusplus
}
#endif

#endif
