/* engine/cuda/cuda_kernels.h — private to the CUDA engine (not a contract): the kernel launchers
 * the host code calls. Plain C on the host side (the .cu files define them extern "C"); each
 * returns the launch's cudaError_t (cudaGetLastError after the launch). bf16 buffers are void *. */
#ifndef KVB_CUDA_KERNELS_H
#define KVB_CUDA_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "moe_math.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The paged bf16 cache as kernels address it: row (layer, kv, kv_head, pos) lives in block
 * blocks[pos >> bt_shift] at row index ((layer*2 + kv)*n_head_kv + kv_head)*bt + (pos & (bt-1)),
 * rows of head_dim bf16 (kvformat's layout). */
typedef struct {
    uint8_t *pool;
    size_t block_bytes;
    const int32_t *blocks; /* device: the sequence's block table */
    int bt_shift;
    int n_head_kv, head_dim;
} kvb_cu_cache;

/* x (n, E) f32 = widen(table[tok[t]]), table (V, E) bf16; times scale (one f32 product per element)
 * unless scale == 0 (gemma3: sqrtf(n_embd)). */
cudaError_t kvb_cu_embed(const void *table, const int32_t *tok, int n, int E, float scale, float *x, cudaStream_t st);
/* For rows r < n: y[r*y_stride ..] = bf16((x[r*x_stride ..] * (1/sqrtf(ss/E + eps))) * w); when y32
 * is not NULL also y32 (n, E) = the same values before rounding to bf16 (the bridge's attention
 * inputs). */
cudaError_t kvb_cu_rmsnorm(const float *x, size_t x_stride, int n, int E, const float *w, float eps, void *y,
                           size_t y_stride, float *y32, cudaStream_t st);
/* gemma3's post norms: for rows r < n, x[r] (f32) += (src[r] * (1/sqrtf(ss/E + eps))) * w, each sum
 * rounded once (the CPU engine's norm then residual add); src, x (n, E) f32, distinct buffers. */
cudaError_t kvb_cu_rmsnorm_add(const float *src, int n, int E, const float *w, float eps, float *x, cudaStream_t st);

typedef struct {
    const float *qkv; /* (n, (H + 2 Hkv) * D) f32 */
    int n, H, Hkv, D, n_rot, neox;
    const float *bias;           /* ((H + 2 Hkv) * D) or NULL */
    const float *q_norm, *k_norm; /* (D) or NULL */
    float eps;
    const float *rope_cos, *rope_sin; /* (positions, n_rot/2), row = absolute position */
    int pos0;
    void *q_out; /* (n, H * D) bf16 */
    kvb_cu_cache cache;
    int layer;
} kvb_cu_qkv_post_args;
cudaError_t kvb_cu_qkv_post(const kvb_cu_qkv_post_args *a, cudaStream_t st);

/* out (n, FF) bf16 = bf16(silu(g) * u) (SwiGLU), or with gelu bf16(gelu_tanh(g) * u) (gemma3's
 * GeGLU, the CPU engine's formula), gu (n, 2 FF) bf16 rows [g | u]. */
cudaError_t kvb_cu_glu(const void *gu, int n, int FF, int gelu, void *out, cudaStream_t st);

/* Mixtures of experts (moe.cu). The router: for each token t < n, logits (n, X) f32 row t is
 * replaced by its softmax, sel (n, K) gets the K most probable experts (largest first, the lower
 * index on a tie) and w (n, K) their probabilities, divided by their sum when norm (moe_math.h's
 * arithmetic, the CPU engine's order). */
cudaError_t kvb_cu_moe_route(float *logits, int n, int X, int K, int norm, int32_t *sel, float *w, cudaStream_t st);
/* The router of any model (moe_math.h's kvb_moe_route_cfg: softmax or sigmoid, selection bias,
 * group-limited top-k, renormalisation, scale): logits (n, X) f32 replaced by the probabilities,
 * score (n, X) f32 the selection scores (required with a bias or groups, else may be NULL), bias
 * (X) f32 or NULL, sel and w (n, K) as above. kvb_cu_moe_route is this with softmax alone. */
cudaError_t kvb_cu_moe_route_cfg(float *logits, float *score, const float *bias, int n, int X, int K,
                                 const kvb_moe_route_cfg *cfg, int32_t *sel, float *w, cudaStream_t st);
/* The (token, rank) slots s = t*K + k of sel (n, K) grouped by expert, slot order kept: cnt (X) the
 * slots of each expert, off (X + 1) their exclusive prefix sum, slot (n K) the slots in grouped
 * order (expert x's at [off[x], off[x+1])), inv (n K) each slot's position in it. */
cudaError_t kvb_cu_moe_permute(const int32_t *sel, int n, int K, int X, int32_t *cnt, int32_t *off, int32_t *slot,
                               int32_t *inv, cudaStream_t st);
/* xp (n_slots, E) bf16 row p = h (n, E) bf16 row slot[p] / K; E % 8 == 0, both 16-byte aligned. */
cudaError_t kvb_cu_moe_gather(const void *h, const int32_t *slot, int n_slots, int K, int E, void *xp, cudaStream_t st);
/* x (n, E) f32 += sum over k in rank order of w[t,k] * y[inv[t*K + k]] (y (n K, E), f32 or bf16 when
 * y_bf16), each product and sum rounded once: the CPU engine's combine and residual add. */
cudaError_t kvb_cu_moe_unpermute(const void *y, int y_bf16, const int32_t *inv, const float *w, int n, int K, int E,
                                 float *x, cudaStream_t st);

/* DeepSeek's latent attention (mla.cu). The latent cache as kernels address it (kvformat's mla
 * layout): row (layer, pos) of R + P bf16 lives in block blocks[pos >> bt_shift] at row index
 * layer * bt + (pos & (bt - 1)). */
typedef struct {
    uint8_t *pool;
    size_t block_bytes;
    const int32_t *blocks; /* device: the sequence's block table */
    int bt_shift;
    int R, P; /* the latent's width (kv_lora_rank), the roped key part's (n_rot) */
} kvb_cu_mla_cache;
/* For t < n: the cache row (layer, pos0 + t) = [lat[t][0 : R], bf16(rope(c[t][R : R + P]))], lat (n,
 * R + P) bf16 (its first R: the normed latent), c (n, R + P) f32 (the kv_a projection); RoPE on pairs
 * (2i, 2i+1) with rope_cos/sin rows of absolute positions (P/2 columns). */
cudaError_t kvb_cu_mla_kv_store(const float *c, const void *lat, int n, int pos0, const float *rope_cos,
                                const float *rope_sin, kvb_cu_mla_cache cache, int layer, cudaStream_t st);
/* out (n, H, N + P) bf16 = per head [bf16(q_nope), bf16(rope(q_pe))] of q (n, H, N + P) f32, token t
 * at position pos0 + t (pairs, as above). */
cudaError_t kvb_cu_mla_q_rope(const float *q, int n, int H, int N, int P, int pos0, const float *rope_cos,
                              const float *rope_sin, void *out, cudaStream_t st);
/* lat (n_pos, R + P) bf16 = the cache rows of `layer` for positions 0 .. n_pos-1. */
cudaError_t kvb_cu_mla_gather(kvb_cu_mla_cache cache, int layer, int n_pos, void *lat, cudaStream_t st);
/* The expanded keys and values of positions p < n_pos into layer 0 of kv (n_head_kv H, head_dim
 * N + P): head h's K row [up[p][h N : h N + N], lat[p][R : R + P]] and V row [up[p][H N + h Vd :
 * + Vd], zeros to N + P]; up (n_pos, H (N + Vd)) bf16 (keys' nope parts, then values), lat (n_pos,
 * R + P) bf16. */
cudaError_t kvb_cu_mla_assemble(const void *up, const void *lat, int n_pos, int H, int N, int Vd, int R, int P,
                                kvb_cu_cache kv, cudaStream_t st);

/* The tensor-parallel all-reduce's sum (tp_comm.c): out (count) f32 = ((in[0] + in[1]) + in[2]) ...
 * over in[0 .. n_in), n_in in 1..8, one rounded f32 add at a time in that order, so the result is
 * the same bits wherever it runs. in: a HOST array of n_in device pointers (count f32 each; they
 * reach the kernel by value); out may equal none of them. float4 loads and stores when every
 * pointer is 16-byte aligned and count % 4 == 0, else one float at a time. */
cudaError_t kvb_cu_sum_f32(float *out, const float *const *in, int n_in, size_t count, cudaStream_t st);

typedef struct {
    const void *q; /* (n, H * D) bf16 */
    void *out;     /* (n, H * D) bf16 */
    kvb_cu_cache cache;
    int layer, H, Hkv, D, n, pos0;
    int window;    /* > 0: a local layer, the query at p reads keys k with p - k < window (the CPU
                      engine's convention); 0: every key up to p */
    float scale;   /* scores are (q . k) * scale; 0 = 1/sqrtf(D) */
} kvb_cu_attn_args;
/* variant 0: tensor-core flash attention when D is 64, 128 or 192 (128 query rows per CTA, or 64 with
 * KVB_CUDA_FA_BR=64), else generic; 1: generic; 2 / 3: tensor-core with 64 / 128 rows per CTA.
 * Keys before the window of the chunk's first query are never read (neither their cache rows nor
 * their block-table entries). */
cudaError_t kvb_cu_attention(const kvb_cu_attn_args *a, int variant, cudaStream_t st);
/* Copies the K and V rows of `layer` for positions 0 .. n_pos-1 out of the paged cache into
 * k_out, v_out (Hkv, n_pos, D) bf16, contiguous (cuDNN's attention reads them so); D % 8 == 0. */
cudaError_t kvb_cu_gather_kv(const kvb_cu_cache *c, int layer, int n_pos, void *k_out, void *v_out, cudaStream_t st);
/* One-time per-process setup (shared-memory limits); idempotent. */
cudaError_t kvb_cu_attention_init(void);

/* Packed weights (expand.cu): dst (rows, cols) bf16 = src (rows, src_row_bytes) of `type`, a
 * matrix in its file's block layout, decoded and rounded exactly as the CPU converts it at load
 * (kvb_row_to_f32 then kvb_f32_to_bf16). cols % 32 == 0 and dst 16-byte aligned, else
 * cudaErrorInvalidValue, as for a type kvb_cu_expand_type_ok refuses. */
cudaError_t kvb_cu_expand_bf16(uint32_t type, const void *src, size_t src_row_bytes, int64_t rows, int64_t cols,
                               void *dst, cudaStream_t st);
/* True for the types kvb_cu_expand_bf16 takes (F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, Q5_K, Q6_K). */
bool kvb_cu_expand_type_ok(uint32_t type);

/* n bf16 values, uniform in [-scale, scale), from a counter-based hash of (seed, index). */
cudaError_t kvb_cu_fill_random_bf16(void *p, size_t n, uint64_t seed, float scale, cudaStream_t st);

/* Diagnostics: a one-thread kernel that spins until *flag (device view of host-mapped memory)
 * becomes non-zero. */
cudaError_t kvb_cu_gate(volatile int *flag, cudaStream_t st);

#ifdef __cplusplus
}
#endif

#endif
