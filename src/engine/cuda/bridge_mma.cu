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
// Tiling: see k_project_i8 below (lane-major order, 64 x 64 CTA tiles).
#include <cuda_runtime.h>

#include "bridge_kernels.h"
#include "bridge_quant.cuh"
#include "kvb_quant_scalar.h"

#define MMA_QK 32

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

// (float)c for a block sum |c| < 2^22 (here < 2^19), exactly, with one full-rate operation: an mma
// whose accumulator starts at MMA_F32_BIAS_BITS leaves 0x4B400000 + c, the bits of the float
// 1.5 * 2^23 + c, and subtracting 1.5 * 2^23 is exact. The same value __int2float_rn gives, which
// runs at a quarter of the rate and bounded the epilogue; adding the bias after the mma cost one
// more integer operation per output and block.
#define MMA_F32_BIAS_BITS 0x4B400000
__device__ static __forceinline__ float mma_f_from_biased(int biased) {
    return __fsub_rn(__int_as_float(biased), 12582912.0f);
}

// ---- the projection in lane-major order ----------------------------------------------------------
// The canonical dot's 16 lanes are independent fma chains (lane l: blocks l, l+16, l+32, ... in
// order) joined by a fixed tree. Taking the lanes one after another in bit-reversed order
// (0, 8, 4, 12, 2, 10, 6, 14, 1, 9, ...) lets the tree be summed as it goes, like a binary counter:
// after the lane at position p, its chain is added to the pending partial of each level whose bit
// p has set, so the sums are exactly the tree's (acc[i] + acc[i + h], same pairs, same nesting)
// while an output needs 5 live floats (the chain and 4 levels) instead of 16. That frees the
// registers for 64 x 64 CTA tiles (8 warps of 32 tokens x 16 rows), which halves the operand
// traffic of 32 x 32 tiles, the most that 16 live lanes per output allowed (H200, 1B shape, one
// 8K-token layer's K projection: 308 us with those, 184 us with these; ncu). A stage holds up to
// PJ_SB blocks of one lane (strided by 16 blocks in memory), double-buffered with cp.async. Two
// CTAs per SM (128 registers, a few spilled) measured faster than one (162 registers): 184 vs 237 us.
#define PJ_TM 64
#define PJ_TN 64
#define PJ_SB 4
#define PJ_THREADS 256
#define PJ_ROW (PJ_SB * MMA_QK + 16) // shared row bytes: 4 blocks + 16 of padding

__device__ __forceinline__ static void pj_cp16(void *dst, const void *src, int src_bytes) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ static void pj_cp4(void *dst, const void *src, int src_bytes) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ static int pj_bitrev4(int p) {
    return ((p & 1) << 3) | ((p & 2) << 1) | ((p & 4) >> 1) | ((p & 8) >> 3);
}

// Stage s of the lane-major walk: lane pj_bitrev4(pos), its blocks q0 .. q0 + PJ_SB - 1 (those
// that exist). Queues the copies into buffer buf; returns how many blocks it holds.
__device__ __forceinline__ static int pj_stage(const int8_t *__restrict__ wq, const float *__restrict__ wsc, int rows,
                                               const int8_t *__restrict__ aq, const float *__restrict__ asc, int n,
                                               int E, int nb, int lane, int q0, int tok0, int row0,
                                               int8_t (*sA)[PJ_ROW], int8_t (*sB)[PJ_ROW], float (*sdA)[PJ_SB],
                                               float (*sdB)[PJ_SB]) {
    const int have = (nb - lane + 15) / 16 - q0, cnt = have < PJ_SB ? have : PJ_SB;
    const int tid = threadIdx.x;
    // 64 rows x PJ_SB blocks x 2 pieces of 16 bytes per operand: 2 pieces per thread each
    for (int it = tid; it < PJ_TM * PJ_SB * 2; it += PJ_THREADS) {
        const int i = it / (PJ_SB * 2), k = it % (PJ_SB * 2), blk = k >> 1, b = lane + 16 * (q0 + blk);
        const int t = tok0 + i, r = row0 + i;
        const bool okb = blk < cnt;
        const size_t off = (size_t)b * MMA_QK + (k & 1) * 16;
        pj_cp16(&sA[i][k * 16], okb && t < n ? aq + (size_t)t * E + off : aq, okb && t < n ? 16 : 0);
        pj_cp16(&sB[i][k * 16], okb && r < rows ? wq + (size_t)r * E + off : wq, okb && r < rows ? 16 : 0);
    }
    for (int it = tid; it < PJ_TM * PJ_SB; it += PJ_THREADS) {
        const int i = it / PJ_SB, blk = it % PJ_SB, b = lane + 16 * (q0 + blk);
        const int t = tok0 + i, r = row0 + i;
        const bool okb = blk < cnt;
        pj_cp4(&sdA[i][blk], okb && t < n ? asc + (size_t)t * nb + b : asc, okb && t < n ? 4 : 0);
        pj_cp4(&sdB[i][blk], okb && r < rows ? wsc + (size_t)r * nb + b : wsc, okb && r < rows ? 4 : 0);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    return cnt;
}

__global__ static void __launch_bounds__(PJ_THREADS, 2)
k_project_i8(const int8_t *__restrict__ wq, const float *__restrict__ wsc, int rows,
                   const int8_t *__restrict__ aq, const float *__restrict__ asc, int n, int E, float *__restrict__ y) {
    // two buffers of (token or row, PJ_SB blocks) int8 and their (token or row, block) scales
    __shared__ __align__(16) int8_t sA[2][PJ_TM][PJ_ROW];
    __shared__ __align__(16) int8_t sB[2][PJ_TN][PJ_ROW];
    __shared__ float sdA[2][PJ_TM][PJ_SB], sdB[2][PJ_TN][PJ_SB];
    const int tid = threadIdx.x, warp = tid >> 5, lane_id = tid & 31, g = lane_id >> 2, tig = lane_id & 3;
    const int wm = warp >> 2, wn = warp & 3, nb = E / MMA_QK; // warp: tokens wm*32 .. +32, rows wn*16 .. +16
    const int tok0 = blockIdx.y * PJ_TM, row0 = blockIdx.x * PJ_TN;

    // per output (m-tile mt, n-tile nt, c): the lane's chain and the tree's pending partials
    float cur[2][2][4], p1[2][2][4], p2[2][2][4], p3[2][2][4], p4[2][2][4];
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int b = 0; b < 2; b++)
#pragma unroll
            for (int c = 0; c < 4; c++) cur[a][b][c] = p1[a][b][c] = p2[a][b][c] = p3[a][b][c] = p4[a][b][c] = 0.0f;

    // the walk: (pos, q0) stages; stage k+1 is in flight while stage k is computed
    int pos = 0, q0 = 0, buf = 0;
    int cnt = pj_stage(wq, wsc, rows, aq, asc, n, E, nb, pj_bitrev4(0), 0, tok0, row0, sA[0], sB[0], sdA[0], sdB[0]);
    for (;;) {
        // the next stage: more blocks of this lane, or the next lane
        const int lane = pj_bitrev4(pos), lane_blocks = (nb - lane + 15) / 16;
        int npos = pos, nq0 = q0 + PJ_SB;
        if (nq0 >= lane_blocks) npos = pos + 1, nq0 = 0;
        int ncnt = 0;
        if (npos < 16)
            ncnt = pj_stage(wq, wsc, rows, aq, asc, n, E, nb, pj_bitrev4(npos), nq0, tok0, row0, sA[buf ^ 1],
                            sB[buf ^ 1], sdA[buf ^ 1], sdB[buf ^ 1]);
        if (npos < 16) asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        else asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        __syncthreads();
        for (int kb = 0; kb < cnt; kb++) { // this lane's blocks, in order
            uint32_t a[2][4];
            float dx[2][2];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                const int ra = wm * 32 + mt * 16 + g, k0 = kb * MMA_QK + tig * 4;
                a[mt][0] = *(const uint32_t *)&sA[buf][ra][k0];
                a[mt][1] = *(const uint32_t *)&sA[buf][ra + 8][k0];
                a[mt][2] = *(const uint32_t *)&sA[buf][ra][k0 + 16];
                a[mt][3] = *(const uint32_t *)&sA[buf][ra + 8][k0 + 16];
                dx[mt][0] = sdA[buf][ra][kb];
                dx[mt][1] = sdA[buf][ra + 8][kb];
            }
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const int rb = wn * 16 + nt * 8, k0 = kb * MMA_QK + tig * 4;
                const uint32_t b0 = *(const uint32_t *)&sB[buf][rb + g][k0];
                const uint32_t b1 = *(const uint32_t *)&sB[buf][rb + g][k0 + 16];
                const float dw0 = sdB[buf][rb + 2 * tig][kb], dw1 = sdB[buf][rb + 2 * tig + 1][kb];
                // the accumulators start at the bits of 1.5 * 2^23: each mma leaves 0x4B400000 + s_b,
                // the float 1.5 * 2^23 + s_b, so (float)s_b is one exact subtraction (mma_f_from_biased)
                int c[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    c[mt][0] = c[mt][1] = c[mt][2] = c[mt][3] = MMA_F32_BIAS_BITS;
                    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                        "{%8,%9}, {%0,%1,%2,%3};\n"
                        : "+r"(c[mt][0]), "+r"(c[mt][1]), "+r"(c[mt][2]), "+r"(c[mt][3])
                        : "r"(a[mt][0]), "r"(a[mt][1]), "r"(a[mt][2]), "r"(a[mt][3]), "r"(b0), "r"(b1));
                }
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    // c0: (token ra, row rb + 2 tig), c1: (ra, rb + 2 tig + 1), c2/c3: token ra + 8
                    float *o = cur[mt][nt];
                    o[0] = __fmaf_rn(mma_f_from_biased(c[mt][0]), __fmul_rn(dw0, dx[mt][0]), o[0]);
                    o[1] = __fmaf_rn(mma_f_from_biased(c[mt][1]), __fmul_rn(dw1, dx[mt][0]), o[1]);
                    o[2] = __fmaf_rn(mma_f_from_biased(c[mt][2]), __fmul_rn(dw0, dx[mt][1]), o[2]);
                    o[3] = __fmaf_rn(mma_f_from_biased(c[mt][3]), __fmul_rn(dw1, dx[mt][1]), o[3]);
                }
            }
        }
        if (npos != pos) { // the lane's chain is done: into the tree, as a binary counter at position pos
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        float s = cur[mt][nt][c];
                        cur[mt][nt][c] = 0.0f;
                        if (!(pos & 1)) { p1[mt][nt][c] = s; continue; }
                        s = __fadd_rn(p1[mt][nt][c], s);
                        if (!(pos & 2)) { p2[mt][nt][c] = s; continue; }
                        s = __fadd_rn(p2[mt][nt][c], s);
                        if (!(pos & 4)) { p3[mt][nt][c] = s; continue; }
                        s = __fadd_rn(p3[mt][nt][c], s);
                        if (!(pos & 8)) { p4[mt][nt][c] = s; continue; }
                        p4[mt][nt][c] = __fadd_rn(p4[mt][nt][c], s); // pos 15: the whole tree
                    }
        }
        __syncthreads(); // buffer buf is free for the stage after next
        if (npos >= 16) break;
        pos = npos, q0 = nq0, cnt = ncnt, buf ^= 1;
    }
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int t = tok0 + wm * 32 + mt * 16 + g + (c >= 2 ? 8 : 0);
                const int r = row0 + wn * 16 + nt * 8 + 2 * tig + (c & 1);
                if (t < n && r < rows) y[(size_t)t * rows + r] = p4[mt][nt][c];
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
// 8 lanes per 32-element block, 4 elements each (kvb_bq_quantize32_oct): 16-byte loads, 4-byte
// stores. One thread per block took 228 us per 8K-token layer of the 1B shape (H200, ncu), a warp
// per block (one element per lane) 90 us.
__global__ static void k_quantize_act_i8(const float *x, int n, int E, int8_t *aq, float *asc) {
    const int nb = E / MMA_QK;
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long blk = gid >> 3; // uniform over each group of 8 lanes
    const int part = (int)(gid & 7);
    const bool live = blk < (long long)n * nb; // dead lanes still join the group's shuffles
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (live) v = *(const float4 *)(x + (size_t)blk * MMA_QK + part * 4); // (t * nb + b) * 32 = t * E + b * 32
    const float xs[4] = {v.x, v.y, v.z, v.w};
    int8_t q[4];
    const float d = kvb_bq_quantize32_oct(xs, q);
    if (!live) return;
    const uint32_t packed = (uint32_t)(uint8_t)q[0] | ((uint32_t)(uint8_t)q[1] << 8) |
                            ((uint32_t)(uint8_t)q[2] << 16) | ((uint32_t)(uint8_t)q[3] << 24);
    *(uint32_t *)(aq + (size_t)blk * MMA_QK + part * 4) = packed;
    if (part == 0) asc[blk] = kvb_fp16_to_f32_inl(kvb_f32_to_fp16_inl(d));
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
    if (((uintptr_t)x & 15u) || ((uintptr_t)aq & 3u)) return (int)cudaErrorMisalignedAddress; // 16-byte loads, 4-byte stores
    k_quantize_act_i8<<<mma_grid1((long long)n * (E / MMA_QK) * 8), 128, 0, (cudaStream_t)stream>>>(x, n, E, aq, asc);
    return (int)cudaGetLastError();
}

extern "C" int kvb_bk_project_i8(const int8_t *wq, const float *wsc, int rows, const int8_t *aq, const float *asc,
                                 int n, int E, float *y, void *stream) {
    dim3 grid((unsigned)((rows + PJ_TN - 1) / PJ_TN), (unsigned)((n + PJ_TM - 1) / PJ_TM));
    k_project_i8<<<grid, PJ_THREADS, 0, (cudaStream_t)stream>>>(wq, wsc, rows, aq, asc, n, E, y);
    return (int)cudaGetLastError();
}
