// engine/cuda/bridge_mma.cu — the bridge's K/V projection for quantised weights (Q8_0, Q4_0, Q5_0)
// against Q8_0 activations on the integer tensor cores. mma.sync m16n8k32 (s8 x s8 -> s32) gives
// each 32-element block sum s_b = sum_j wq_j * xq_j exactly (integers, |s_b| < 2^19, no
// saturation), one mma per block; the float epilogue is the canonical dot's (kvb_quant.h) to the
// bit: acc[b % 16] = fmaf((float)s_b, fp16(w.d) * fp16(x.d), acc[b % 16]) in block order, then the
// fixed 16-lane tree. So the result equals canon_dot in bridge.cu and kvb_dot on the CPU, only
// faster: the naive kernel does one whole dot per thread.
//
// Operands are unpacked once into plain int8 rows plus f32 block scales: the weights at bridge
// creation (k_unpack_weights, from the file's Q8_0/Q4_0/Q5_0 blocks), the activations per layer
// by the canonical activation quantiser writing that layout (k_quantize_act_i8), so the tile
// loads are 16-byte vector loads.
//
// Tiling: a CTA of 4 warps computes 32 tokens x 32 weight rows; warp (wm, wn) owns 16 tokens x 16
// rows (two m16n8 tiles), so each thread carries 8 outputs x 16 lanes of accumulators. K runs in
// stages of 16 blocks (512 elements) staged in shared memory; inside a stage, block kb feeds lane
// kb (stages start at multiples of 16 blocks), and blocks past the row's end never touch their
// lane (the canonical rule for idle lanes).
#include <cuda_runtime.h>

#include "bridge_kernels.h"
#include "bridge_quant.cuh"
#include "kvb_quant_scalar.h"

#define MMA_QK 32
#define MMA_TILE 32     // tokens and rows per CTA
#define MMA_STAGE 16    // blocks per shared-memory stage (= the 16 canonical lanes)
#define MMA_THREADS 128

__device__ static inline uint16_t mma_ld_u16(const uint8_t *p) { return *(const uint16_t *)p; } // 2-byte aligned

// One weight block (wtype) of row r -> 32 int8 values and the f32 scale.
__device__ static inline void mma_unpack_weight(uint32_t wtype, const uint8_t *blk, int8_t *q, float *d) {
    *d = kvb_fp16_to_f32_inl(mma_ld_u16(blk));
    if (wtype == 8u) { // Q8_0: d, qs[32]
        for (int j = 0; j < 16; j++) {
            const uint16_t v = mma_ld_u16(blk + 2 + 2 * j);
            q[2 * j] = (int8_t)(v & 0xff);
            q[2 * j + 1] = (int8_t)(v >> 8);
        }
    } else if (wtype == 2u) { // Q4_0: d, qs[16]; element j low nibble of qs[j], j+16 high nibble; q-8
        for (int j = 0; j < 8; j++) {
            const uint16_t v = mma_ld_u16(blk + 2 + 2 * j);
            const uint8_t b0 = (uint8_t)(v & 0xff), b1 = (uint8_t)(v >> 8);
            q[2 * j] = (int8_t)((b0 & 15) - 8);
            q[2 * j + 1] = (int8_t)((b1 & 15) - 8);
            q[2 * j + 16] = (int8_t)((b0 >> 4) - 8);
            q[2 * j + 17] = (int8_t)((b1 >> 4) - 8);
        }
    } else { // Q5_0: d, qh[4] (bit j = 5th bit of element j), qs[16] as Q4_0; q-16
        const uint32_t qh = (uint32_t)mma_ld_u16(blk + 2) | ((uint32_t)mma_ld_u16(blk + 4) << 16);
        for (int j = 0; j < 8; j++) {
            const uint16_t v = mma_ld_u16(blk + 6 + 2 * j);
            const uint8_t b[2] = {(uint8_t)(v & 0xff), (uint8_t)(v >> 8)};
            for (int h = 0; h < 2; h++) {
                const int e = 2 * j + h;
                q[e] = (int8_t)(((b[h] & 15) | (((qh >> e) & 1u) << 4)) - 16);
                q[e + 16] = (int8_t)(((b[h] >> 4) | (((qh >> (e + 16)) & 1u) << 4)) - 16);
            }
        }
    }
}

// The canonical 16-lane tree (h = 8, 4, 2, 1: acc[i] += acc[i + h]), spelled out so every index
// is a constant and the accumulators stay in registers.
#define MMA_TREE_STEP(a, h)                                                                                  \
    _Pragma("unroll") for (int i = 0; i < (h); i++)(a)[i] = __fadd_rn((a)[i], (a)[i + (h)])
__device__ static __forceinline__ float mma_tree16(float (&acc)[16]) {
    MMA_TREE_STEP(acc, 8);
    MMA_TREE_STEP(acc, 4);
    MMA_TREE_STEP(acc, 2);
    MMA_TREE_STEP(acc, 1);
    return acc[0];
}

#define MMA_ROW (MMA_STAGE * MMA_QK + 16) // shared row: 512 bytes + 16 of padding (no bank conflicts)

// (float)c for a block sum |c| < 2^22 (here < 2^19), exactly, in two full-rate operations: the bits
// 0x4B400000 + c are the float 1.5 * 2^23 + c, and subtracting 1.5 * 2^23 is exact. The same value
// __int2float_rn gives, which runs at a quarter of the rate and bounded the epilogue.
__device__ static __forceinline__ float mma_i2f_exact(int c) {
    return __fsub_rn(__int_as_float(0x4B400000 + c), 12582912.0f);
}

__global__ static void __launch_bounds__(MMA_THREADS)
k_project_i8(const int8_t *__restrict__ wq, const float *__restrict__ wsc, int rows, const int8_t *__restrict__ aq,
             const float *__restrict__ asc, int n, int E, float *__restrict__ y) {
    // (token or row, stage bytes) int8 and (token or row, stage block) scales
    __shared__ __align__(16) int8_t sA[MMA_TILE][MMA_ROW];
    __shared__ __align__(16) int8_t sB[MMA_TILE][MMA_ROW];
    __shared__ float sdA[MMA_TILE][MMA_STAGE], sdB[MMA_TILE][MMA_STAGE];
    const int tid = threadIdx.x, warp = tid >> 5, lane_id = tid & 31, g = lane_id >> 2, tig = lane_id & 3;
    const int wm = warp >> 1, wn = warp & 1, nb = E / MMA_QK;
    const int tok0 = blockIdx.y * MMA_TILE, row0 = blockIdx.x * MMA_TILE;

    float acc[8][16]; // (output: n-tile j * 4 + c, canonical lane)
#pragma unroll
    for (int o = 0; o < 8; o++)
#pragma unroll
        for (int l = 0; l < 16; l++) acc[o][l] = 0.0f;

    for (int b0 = 0; b0 < nb; b0 += MMA_STAGE) {
        // 32 rows x 32 16-byte pieces of each operand: 8 pieces per thread per operand
        for (int it = tid; it < MMA_TILE * 32; it += MMA_THREADS) {
            const int i = it >> 5, c = it & 31, b = b0 + (c >> 1);
            const int t = tok0 + i, r = row0 + i;
            int4 va = make_int4(0, 0, 0, 0), vb = make_int4(0, 0, 0, 0);
            if (b < nb) {
                if (t < n) va = *(const int4 *)(aq + (size_t)t * E + (size_t)b0 * MMA_QK + c * 16);
                if (r < rows) vb = *(const int4 *)(wq + (size_t)r * E + (size_t)b0 * MMA_QK + c * 16);
            }
            *(int4 *)&sA[i][c * 16] = va;
            *(int4 *)&sB[i][c * 16] = vb;
        }
        for (int it = tid; it < MMA_TILE * MMA_STAGE; it += MMA_THREADS) {
            const int i = it / MMA_STAGE, kb = it % MMA_STAGE, b = b0 + kb;
            const int t = tok0 + i, r = row0 + i;
            sdA[i][kb] = b < nb && t < n ? asc[(size_t)t * nb + b] : 0.0f;
            sdB[i][kb] = b < nb && r < rows ? wsc[(size_t)r * nb + b] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kb = 0; kb < MMA_STAGE; kb++) {
            if (b0 + kb < nb) { // uniform: idle lanes are never touched
                const int ra = wm * 16 + g, k0 = kb * MMA_QK + tig * 4;
                const uint32_t a0 = *(const uint32_t *)&sA[ra][k0];
                const uint32_t a1 = *(const uint32_t *)&sA[ra + 8][k0];
                const uint32_t a2 = *(const uint32_t *)&sA[ra][k0 + 16];
                const uint32_t a3 = *(const uint32_t *)&sA[ra + 8][k0 + 16];
                const float dx0 = sdA[ra][kb], dx1 = sdA[ra + 8][kb];
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int rb = wn * 16 + j * 8;
                    const uint32_t bb0 = *(const uint32_t *)&sB[rb + g][k0];
                    const uint32_t bb1 = *(const uint32_t *)&sB[rb + g][k0 + 16];
                    int c0 = 0, c1 = 0, c2 = 0, c3 = 0;
                    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                                 "{%8,%9}, {%0,%1,%2,%3};\n"
                                 : "+r"(c0), "+r"(c1), "+r"(c2), "+r"(c3)
                                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(bb0), "r"(bb1));
                    // c0: (token ra, row rb + 2 tig), c1: (ra, rb + 2 tig + 1), c2/c3: token ra + 8
                    const float dw0 = sdB[rb + 2 * tig][kb], dw1 = sdB[rb + 2 * tig + 1][kb];
                    acc[j * 4 + 0][kb] = __fmaf_rn(mma_i2f_exact(c0), __fmul_rn(dw0, dx0), acc[j * 4 + 0][kb]);
                    acc[j * 4 + 1][kb] = __fmaf_rn(mma_i2f_exact(c1), __fmul_rn(dw1, dx0), acc[j * 4 + 1][kb]);
                    acc[j * 4 + 2][kb] = __fmaf_rn(mma_i2f_exact(c2), __fmul_rn(dw0, dx1), acc[j * 4 + 2][kb]);
                    acc[j * 4 + 3][kb] = __fmaf_rn(mma_i2f_exact(c3), __fmul_rn(dw1, dx1), acc[j * 4 + 3][kb]);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int t = tok0 + wm * 16 + g + (c >= 2 ? 8 : 0);
            const int r = row0 + wn * 16 + j * 8 + 2 * tig + (c & 1);
            const float v = mma_tree16(acc[j * 4 + c]);
            if (t < n && r < rows) y[(size_t)t * rows + r] = v;
        }
}

// One thread per (row, block): the file's block -> 32 int8 values and the f32 scale.
__global__ static void k_unpack_weights(uint32_t wtype, const uint8_t *w, size_t w_row_bytes, int w_block_bytes,
                                        int rows, int nb, int8_t *wq, float *wsc) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)rows * nb) return;
    const int r = (int)(idx / nb), b = (int)(idx % nb);
    mma_unpack_weight(wtype, w + (size_t)r * w_row_bytes + (size_t)b * w_block_bytes, wq + (size_t)r * nb * MMA_QK + (size_t)b * MMA_QK,
                      wsc + (size_t)r * nb + b);
}

// The canonical activation quantiser (kvb_quant.h, as k_quantize_act in bridge.cu) writing int8
// rows (n, E) and f32 scales (n, E/32): the scale stored is fp16(d) widened, the value the dot uses.
// One warp per 32-element block, lane j on element j (kvb_bq_quantize32_warp), so the loads and
// stores are coalesced: with one thread per block they were 128 bytes apart, and the kernel took
// 228 us per 8K-token layer of the 1B shape (H200, ncu), 20 % of the bridge's GPU time.
__global__ static void k_quantize_act_i8(const float *x, int n, int E, int8_t *aq, float *asc) {
    const int nb = E / MMA_QK;
    const long long blk = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; // warp-uniform
    const int lane = (int)(threadIdx.x & 31);
    if (blk >= (long long)n * nb) return;
    int8_t q;
    const float d = kvb_bq_quantize32_warp(x[(size_t)blk * MMA_QK + lane], &q); // (t * nb + b) * 32 = t * E + b * 32
    aq[(size_t)blk * MMA_QK + lane] = q;
    if (lane == 0) asc[blk] = kvb_fp16_to_f32_inl(kvb_f32_to_fp16_inl(d));
}

static unsigned mma_grid1(long long threads) { return (unsigned)((threads + 127) / 128); }

extern "C" int kvb_bk_unpack_weights(uint32_t wtype, const uint8_t *w, size_t w_row_bytes, int rows, int E, int8_t *wq,
                                     float *wsc, void *stream) {
    const int wbb = wtype == 8u ? 34 : wtype == 2u ? 18 : 22, nb = E / MMA_QK;
    k_unpack_weights<<<mma_grid1((long long)rows * nb), 128, 0, (cudaStream_t)stream>>>(wtype, w, w_row_bytes, wbb,
                                                                                         rows, nb, wq, wsc);
    return (int)cudaGetLastError();
}

extern "C" int kvb_bk_quantize_act_i8(const float *x, int n, int E, int8_t *aq, float *asc, void *stream) {
    k_quantize_act_i8<<<mma_grid1((long long)n * (E / MMA_QK) * 32), 128, 0, (cudaStream_t)stream>>>(x, n, E, aq, asc);
    return (int)cudaGetLastError();
}

extern "C" int kvb_bk_project_i8(const int8_t *wq, const float *wsc, int rows, const int8_t *aq, const float *asc,
                                 int n, int E, float *y, void *stream) {
    dim3 grid((unsigned)((rows + MMA_TILE - 1) / MMA_TILE), (unsigned)((n + MMA_TILE - 1) / MMA_TILE));
    k_project_i8<<<grid, MMA_THREADS, 0, (cudaStream_t)stream>>>(wq, wsc, rows, aq, asc, n, E, y);
    return (int)cudaGetLastError();
}
