// bridge/cuda/bridge_mma.cu — the bridge's K/V projection for quantised weights (Q8_0, Q4_0, Q5_0)
// against Q8_0 activations on the integer tensor cores. mma.sync m16n8k32 (s8 x s8 -> s32) gives
// each 32-element block sum s_b = sum_j wq_j * xq_j exactly (integers, |s_b| < 2^19, no
// saturation), one mma per block; the float epilogue is the canonical dot's (kvb_quant.h) to the
// bit: acc[b % 16] = fmaf((float)s_b, fp16(w.d) * fp16(x.d), acc[b % 16]) in block order, then the
// fixed 16-lane tree. So the result equals canon_dot in bridge.cu and kvb_dot on the CPU, only
// faster: the naive kernel does one whole dot per thread.
//
// Operands are unpacked into int8 values plus f32 block scales in fragment order (bridge_kernels.h):
// the weights once at bridge creation (k_unpack_weights, from the file's Q8_0/Q4_0/Q5_0 blocks),
// the activations per layer by the canonical activation quantiser (k_quantize_act_i8).
//
// Tiling: see k_project_i8 below (lane-major order, 64 x 64 CTA tiles).
#include <cuda_runtime.h>

#include "bridge_kernels.h"
#include "bridge_quant.cuh"
#include "kvb_quant_scalar.h"

#define MMA_QK 32

__device__ static inline uint16_t mma_ld_u16(const uint8_t *p) { return *(const uint16_t *)p; } // 2-byte aligned

// Four int8 values as one 32-bit word, the first in the low byte (a fragment register's order).
__device__ static inline uint32_t mma_pack4(const int8_t *q) {
    return (uint32_t)(uint8_t)q[0] | ((uint32_t)(uint8_t)q[1] << 8) | ((uint32_t)(uint8_t)q[2] << 16) |
           ((uint32_t)(uint8_t)q[3] << 24);
}

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
// whose accumulator starts at KVB_BQ_INT_MAGIC_BITS leaves those bits + c, the float
// 1.5 * 2^23 + c, and subtracting 1.5 * 2^23 is exact. The same value __int2float_rn gives, which
// runs at a quarter of the rate and bounded the epilogue; adding the bias after the mma cost one
// more integer operation per output and block.
__device__ static __forceinline__ float mma_f_from_biased(int biased) {
    return __fsub_rn(__int_as_float(biased), KVB_BQ_INT_MAGIC);
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
// CTAs per SM (128 registers) measured faster than one (162 registers): 184 vs 237 us.
// The operands are in fragment order (bridge_kernels.h): a stage is 16-byte runs copied as they
// are, and a warp's fragments of one block are one 16-byte (A) or 8-byte (B, scales) shared load
// per thread, where row-major tiles took 12 shared loads and their address arithmetic per block;
// with the copy plan below (pj_plan) one 8K-token layer's K projection takes 129 us, 182 before
// (H200, 1B shape, ncu; 73 M instructions issued instead of ~100 M), and 114 us (67 M) once the
// plan's offsets were 32-bit.
#define PJ_TM 64             // tokens per CTA: 4 tiles of 16
#define PJ_TN 64             // rows per CTA: 8 tiles of 8
#define PJ_SB 4
#define PJ_THREADS 256
#define PJ_AT (PJ_TM / 16)   // token tiles
#define PJ_BT (PJ_TN / 8)    // row tiles

__device__ __forceinline__ static int pj_bitrev4(int p) {
    return ((p & 1) << 3) | ((p & 2) << 1) | ((p & 4) >> 1) | ((p & 8) >> 3);
}

// One stage's shared buffers: per (tile, block of the stage) one operand piece in fragment order.
struct pj_stage_buf {
    uint4 a[PJ_AT][PJ_SB][32];    // (token tile, block, thread) 16 bytes: a0..a3
    uint2 b[PJ_BT][PJ_SB][32];    // (row tile, block, thread) 8 bytes: b0, b1
    float2 da[PJ_AT][PJ_SB][8];   // (token tile, block, g): scales of tokens g, g + 8
    float2 db[PJ_BT][PJ_SB][4];   // (row tile, block, c): scales of rows 2c, 2c + 1
};

// What one thread copies in every stage, fixed for the CTA: two 16-byte runs of A, two of B and
// (threads 0 .. 127) one of the scales, each at its (tile, block of the stage, piece) place.
// A stage of lane l, blocks q0 .. q0 + PJ_SB - 1, moves every source by (l + 16 q0) blocks, so a
// stage costs a few instructions per copy instead of the index arithmetic of each. Offsets are
// 32-bit bytes from the operand's base (the launcher checks the operands fit): 64-bit pointers
// per copy spilled the plan to local memory.
struct pj_plan {
    uint32_t off[5]; // bytes from its operand's base at block 0 of the stage (A 0, A 1, B 0, B 1, scale)
    uint32_t dst[5]; // shared address in buffer 0
    int blk[5];      // block of the stage it copies; PJ_SB: none (a tile past the operand: zero-filled)
    int scale;       // 0: no scale copy, 1: an A scale run (64 bytes per block), 2: a B scale run (32)
};

__device__ __forceinline__ static void pj_make_plan(int r8, int n16, int nb, int tt0, int rt0, pj_stage_buf *sb0,
                                                    pj_plan *pl) {
    static_assert(PJ_AT * PJ_SB * 32 == 2 * PJ_THREADS && PJ_BT * PJ_SB * 16 == 2 * PJ_THREADS, "2 copies each");
    static_assert(PJ_AT * PJ_SB * 4 + PJ_BT * PJ_SB * 2 <= PJ_THREADS, "one scale copy at most");
    const int tid = threadIdx.x;
    for (int j = 0; j < 2; j++) { // A: (tile, block, 16-byte piece of 32)
        const int i = (tid + j * PJ_THREADS) / (PJ_SB * 32), blk = (tid >> 5) % PJ_SB, c = tid & 31;
        const bool live = tt0 + i < n16;
        pl->off[j] = live ? ((uint32_t)(tt0 + i) * nb + 16 * blk) * 512 + c * 16 : 0;
        pl->dst[j] = (uint32_t)__cvta_generic_to_shared(&sb0->a[i][blk][c]);
        pl->blk[j] = live ? blk : PJ_SB;
    }
    for (int j = 0; j < 2; j++) { // B: (tile, block, 16-byte piece of 16)
        const int i = (tid + j * PJ_THREADS) / (PJ_SB * 16), blk = (tid >> 4) % PJ_SB, c = tid & 15;
        const bool live = rt0 + i < r8;
        pl->off[2 + j] = live ? ((uint32_t)(rt0 + i) * nb + 16 * blk) * 256 + c * 16 : 0;
        pl->dst[2 + j] = (uint32_t)__cvta_generic_to_shared((uint8_t *)&sb0->b[i][blk][0] + c * 16);
        pl->blk[2 + j] = live ? blk : PJ_SB;
    }
    pl->off[4] = 0, pl->dst[4] = 0, pl->blk[4] = PJ_SB, pl->scale = 0;
    if (tid < PJ_AT * PJ_SB * 4) { // A scales: (tile, block, 16 bytes of 64)
        const int i = tid / (PJ_SB * 4), blk = (tid / 4) % PJ_SB, c = tid % 4;
        const bool live = tt0 + i < n16;
        pl->off[4] = live ? ((uint32_t)(tt0 + i) * nb + 16 * blk) * 64 + c * 16 : 0;
        pl->dst[4] = (uint32_t)__cvta_generic_to_shared(&sb0->da[i][blk][2 * c]);
        pl->blk[4] = live ? blk : PJ_SB, pl->scale = 1;
    } else if (tid < PJ_AT * PJ_SB * 4 + PJ_BT * PJ_SB * 2) { // B scales: (tile, block, 16 bytes of 32)
        const int u = tid - PJ_AT * PJ_SB * 4, i = u / (PJ_SB * 2), blk = (u / 2) % PJ_SB, c = u % 2;
        const bool live = rt0 + i < r8;
        pl->off[4] = live ? ((uint32_t)(rt0 + i) * nb + 16 * blk) * 32 + c * 16 : 0;
        pl->dst[4] = (uint32_t)__cvta_generic_to_shared(&sb0->db[i][blk][2 * c]);
        pl->blk[4] = live ? blk : PJ_SB, pl->scale = 2;
    }
}

__device__ __forceinline__ static void pj_cp16(uint32_t dst, const int8_t *base, uint32_t off, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(base + (ok ? off : 0u)),
                 "r"(ok ? 16 : 0));
}

// Stage of the lane-major walk: lane `lane`, its blocks q0 .. q0 + PJ_SB - 1 (those that exist),
// into buffer buf. Returns how many blocks it holds; the rest, and tiles past the operands, are
// zero-filled (from the operand's base, which is valid).
template <bool FULL>
__device__ __forceinline__ static int pj_stage(const pj_plan *pl, const int8_t *wq, const float *wsc,
                                               const int8_t *aq, const float *asc, int nb, int lane, int q0,
                                               int buf) {
    const int have = (nb - lane + 15) / 16 - q0, cnt = FULL ? PJ_SB : have < PJ_SB ? have : PJ_SB;
    const uint32_t first = (uint32_t)lane + 16u * (uint32_t)q0; // the stage's first block
    const uint32_t boff = (uint32_t)buf * (uint32_t)sizeof(pj_stage_buf);
    pj_cp16(pl->dst[0] + boff, aq, pl->off[0] + first * 512u, pl->blk[0] < cnt);
    pj_cp16(pl->dst[1] + boff, aq, pl->off[1] + first * 512u, pl->blk[1] < cnt);
    pj_cp16(pl->dst[2] + boff, wq, pl->off[2] + first * 256u, pl->blk[2] < cnt);
    pj_cp16(pl->dst[3] + boff, wq, pl->off[3] + first * 256u, pl->blk[3] < cnt);
    if (pl->scale == 1) pj_cp16(pl->dst[4] + boff, (const int8_t *)asc, pl->off[4] + first * 64u, pl->blk[4] < cnt);
    else if (pl->scale == 2)
        pj_cp16(pl->dst[4] + boff, (const int8_t *)wsc, pl->off[4] + first * 32u, pl->blk[4] < cnt);
    asm volatile("cp.async.commit_group;\n" ::);
    return cnt;
}

// Per output (m-tile mt, n-tile nt, c), o = (mt * 2 + nt) * 4 + c: the lane's chain in cur[o] and
// the tree's pending partials of levels 1..3 in registers, level 4 (written once, at position 7,
// and read once, at 15) in shared memory, which freed the registers for a block's four mma to be
// issued before its epilogue. A lane's end adds the chain into the tree in one pass over the
// outputs whose branches all hang on t, the trailing ones of the position (the same for the whole
// CTA), where a branch chain per output cost more than the sums. FULL: every lane's blocks are a
// whole number of stages (E a multiple of 16 * PJ_SB * 32, e.g. 2048, 4096), so no stage is
// partial and no copy or block needs a count check: K and V together 199 -> 185.5 us, 117.8 M ->
// 105.0 M instructions. H200, 1B shape, one 8K-token layer's K projection (ncu): 113.6 us and
// 66.7 M instructions before, 99.0-100.2 us and 58.7 M with level 4 in shared memory; levels 3
// and 4 there 100.7-101.5 us, 2..4 105-106 us, none 102-105 us.
#define PJ_SMEM_BYTES (2 * sizeof(pj_stage_buf) + 16 * PJ_THREADS * sizeof(float))

template <bool FULL>
__global__ static void __launch_bounds__(PJ_THREADS, 2)
k_project_i8(const int8_t *__restrict__ wq0, const float *__restrict__ wsc0, float *__restrict__ y0,
             const int8_t *__restrict__ wq1, const float *__restrict__ wsc1, float *__restrict__ y1, int rows,
             const int8_t *__restrict__ aq, const float *__restrict__ asc, int n, int E) {
    // blockIdx.z picks the product: 0 (wq0, wsc0 -> y0), 1 (wq1, wsc1 -> y1), e.g. a layer's K and V
    const int8_t *__restrict__ wq = blockIdx.z ? wq1 : wq0;
    const float *__restrict__ wsc = blockIdx.z ? wsc1 : wsc0;
    float *__restrict__ y = blockIdx.z ? y1 : y0;
    extern __shared__ __align__(16) uint8_t pj_smem[];
    pj_stage_buf *sbuf = (pj_stage_buf *)pj_smem;                 // two stages
    float *p4 = (float *)(pj_smem + 2 * sizeof(pj_stage_buf));    // (output, thread): the tree's level 4
    const int tid = threadIdx.x, warp = tid >> 5, lane_id = tid & 31, g = lane_id >> 2, tig = lane_id & 3;
    const int wm = warp >> 2, wn = warp & 3, nb = E / MMA_QK; // warp: tokens wm*32 .. +32, rows wn*16 .. +16
    const int tt0 = blockIdx.y * PJ_AT, rt0 = blockIdx.x * PJ_BT, n16 = (n + 15) / 16, r8 = (rows + 7) / 8;
    const int bias = KVB_BQ_INT_MAGIC_BITS; // the accumulators' start: mma leaves the bits of 1.5 * 2^23 + s_b

    float cur[16], p1[16], p2[16], p3[16];
#pragma unroll
    for (int o = 0; o < 16; o++) cur[o] = p1[o] = p2[o] = p3[o] = 0.0f;

    // the walk: (pos, q0) stages; stage k+1 is in flight while stage k is computed
    pj_plan plan;
    pj_make_plan(r8, n16, nb, tt0, rt0, &sbuf[0], &plan);
    int pos = 0, q0 = 0, buf = 0;
    int cnt = pj_stage<FULL>(&plan, wq, wsc, aq, asc, nb, pj_bitrev4(0), 0, 0);
    for (;;) {
        // the next stage: more blocks of this lane, or the next lane
        const int lane = pj_bitrev4(pos), lane_blocks = FULL ? nb / 16 : (nb - lane + 15) / 16;
        int npos = pos, nq0 = q0 + PJ_SB;
        if (nq0 >= lane_blocks) npos = pos + 1, nq0 = 0;
        int ncnt = 0;
        if (npos < 16) {
            ncnt = pj_stage<FULL>(&plan, wq, wsc, aq, asc, nb, pj_bitrev4(npos), nq0, buf ^ 1);
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        }
        __syncthreads();
        const pj_stage_buf *sb = &sbuf[buf];
#pragma unroll
        for (int kb = 0; kb < PJ_SB; kb++) { // this lane's blocks, in order
            if (!FULL && kb >= cnt) break;
            uint4 a[2];
            uint2 bf[2];
            float2 dx[2], dw[2]; // (token g, token g + 8) of m-tile mt; (row 2 tig, 2 tig + 1) of n-tile nt
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                a[mt] = sb->a[wm * 2 + mt][kb][lane_id];
                dx[mt] = sb->da[wm * 2 + mt][kb][g];
            }
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                bf[nt] = sb->b[wn * 2 + nt][kb][lane_id];
                dw[nt] = sb->db[wn * 2 + nt][kb][tig];
            }
            int c[2][2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
                    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                        "{%8,%9}, {%10,%10,%10,%10};\n"
                        : "=r"(c[mt][nt][0]), "=r"(c[mt][nt][1]), "=r"(c[mt][nt][2]), "=r"(c[mt][nt][3])
                        : "r"(a[mt].x), "r"(a[mt].y), "r"(a[mt].z), "r"(a[mt].w), "r"(bf[nt].x), "r"(bf[nt].y),
                          "r"(bias));
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    // c0: (token g, row 2 tig), c1: (g, 2 tig + 1), c2/c3: token g + 8
                    float *o = &cur[(mt * 2 + nt) * 4];
                    o[0] = __fmaf_rn(mma_f_from_biased(c[mt][nt][0]), __fmul_rn(dw[nt].x, dx[mt].x), o[0]);
                    o[1] = __fmaf_rn(mma_f_from_biased(c[mt][nt][1]), __fmul_rn(dw[nt].y, dx[mt].x), o[1]);
                    o[2] = __fmaf_rn(mma_f_from_biased(c[mt][nt][2]), __fmul_rn(dw[nt].x, dx[mt].y), o[2]);
                    o[3] = __fmaf_rn(mma_f_from_biased(c[mt][nt][3]), __fmul_rn(dw[nt].y, dx[mt].y), o[3]);
                }
        }
        if (npos != pos) { // the lane's chain is done: into the tree, as a binary counter at position pos
            const int t = __ffs(~pos) - 1; // levels to fold (pos's trailing ones); the sum parks at level t + 1
#pragma unroll
            for (int o = 0; o < 16; o++) {
                float s = cur[o];
                if (t >= 1) s = __fadd_rn(p1[o], s);
                if (t >= 2) s = __fadd_rn(p2[o], s);
                if (t >= 3) s = __fadd_rn(p3[o], s);
                if (t >= 4) s = __fadd_rn(p4[o * PJ_THREADS + tid], s); // pos 15: the whole tree
                if (t == 0) p1[o] = s;
                else if (t == 1) p2[o] = s;
                else if (t == 2) p3[o] = s;
                else if (t == 3) p4[o * PJ_THREADS + tid] = s;
                cur[o] = t >= 4 ? s : 0.0f;
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
                const int t = tt0 * 16 + wm * 32 + mt * 16 + g + (c >= 2 ? 8 : 0);
                const int r = rt0 * 8 + wn * 16 + nt * 8 + 2 * tig + (c & 1);
                if (t < n && r < rows) y[(size_t)t * rows + r] = cur[(mt * 2 + nt) * 4 + c];
            }
}

// One thread per (row, block): the file's block -> 32 int8 values and the f32 scale, in fragment
// order (bridge_kernels.h).
__global__ static void k_unpack_weights(uint32_t wtype, const uint8_t *w, size_t w_row_bytes, int w_block_bytes,
                                        int rows, int nb, int8_t *wq, float *wsc) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)rows * nb) return;
    const int r = (int)(idx / nb), b = (int)(idx % nb);
    int8_t q[MMA_QK];
    float d;
    mma_unpack_weight(wtype, w + (size_t)r * w_row_bytes + (size_t)b * w_block_bytes, q, &d);
    for (int p = 0; p < MMA_QK / 4; p++) // 4-byte pieces: each lands whole in one thread's slot
        *(uint32_t *)(wq + kvb_bk_wq_offset((size_t)r, (size_t)b * MMA_QK + 4 * p, (size_t)nb)) = mma_pack4(q + 4 * p);
    wsc[kvb_bk_wsc_index((size_t)r, (size_t)b, (size_t)nb)] = d;
}

// The canonical activation quantiser (kvb_quant.h, as k_quantize_act in bridge.cu) writing int8
// values and f32 scales in fragment order (bridge_kernels.h): the scale stored is fp16(d) widened,
// the value the dot uses.
// 8 lanes per 32-element block, 4 elements each (kvb_bq_quantize32_oct): 16-byte loads, 4-byte
// stores. One thread per block took 228 us per 8K-token layer of the 1B shape (H200, ncu), a warp
// per block (one element per lane) 90 us, 8 lanes 38 us into row-major int8. A warp's four blocks
// are tokens g and g + 8 of a 16-token tile times blocks b and b + 1, whose values fill whole
// 16-byte thread slots of the fragment order: 47.7 us, where four blocks of one token (half of
// each slot) took 49-50 us; 35 us (26.5 M instructions, was 39 M) once kvb_bq_encode and the
// scale's fp16 round trip lost their branches. It is bound by issue.
__global__ static void k_quantize_act_i8(const float *x, int n, int E, int8_t *aq, float *asc) {
    // 32-bit index arithmetic (the launcher checks that the grid fits)
    const unsigned nb = (unsigned)E / MMA_QK, npair = (nb + 1) / 2;
    const unsigned gid = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned unit = gid >> 5;     // (tile, g, block pair): one warp
    const unsigned q = (gid >> 3) & 3u; // the warp's group: bit 0 token g or g + 8, bit 1 block b or b + 1
    const int part = (int)(gid & 7u);
    const unsigned tg = unit / npair;   // tile * 8 + g
    const size_t t = (tg >> 3) * 16 + (tg & 7) + 8 * (q & 1), b = 2 * (unit - tg * npair) + (q >> 1);
    const bool live = t < (size_t)n && b < (size_t)nb; // dead lanes still join the group's shuffles
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (live) v = *(const float4 *)(x + t * (size_t)E + b * MMA_QK + part * 4);
    const float xs[4] = {v.x, v.y, v.z, v.w};
    int8_t qv[4];
    const float d = kvb_bq_quantize32_oct(xs, qv);
    if (!live) return;
    *(uint32_t *)(aq + kvb_bk_aq_offset(t, b * MMA_QK + (size_t)part * 4, (size_t)nb)) = mma_pack4(qv);
    if (part == 0) asc[kvb_bk_asc_index(t, b, (size_t)nb)] = kvb_bq_round_f16(d);
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
    const long long units = (long long)(n + 15) / 16 * 8 * ((E / MMA_QK + 1) / 2); // warps: (tile, g, block pair)
    if (units * 32 > 0x7fffffffLL) return (int)cudaErrorInvalidValue;            // 32-bit thread indices
    k_quantize_act_i8<<<mma_grid1(units * 32), 128, 0, (cudaStream_t)stream>>>(x, n, E, aq, asc);
    return (int)cudaGetLastError();
}

extern "C" int kvb_bk_project_i8_init(void) {
    cudaError_t e = cudaFuncSetAttribute(k_project_i8<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)PJ_SMEM_BYTES);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k_project_i8<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PJ_SMEM_BYTES);
    return (int)e;
}

extern "C" int kvb_bk_project_i8(const int8_t *wq, const float *wsc, float *y, const int8_t *wq2, const float *wsc2,
                                 float *y2, int rows, const int8_t *aq, const float *asc, int n, int E, void *stream) {
    const uintptr_t align = (uintptr_t)wq | (uintptr_t)wsc | (uintptr_t)aq | (uintptr_t)asc |
                            (wq2 ? (uintptr_t)wq2 | (uintptr_t)wsc2 : 0u);
    if (align & 15u) return (int)cudaErrorMisalignedAddress;
    if (kvb_bk_aq_bytes((size_t)n, (size_t)E) > 0xffffffffu || kvb_bk_wq_bytes((size_t)rows, (size_t)E) > 0xffffffffu)
        return (int)cudaErrorInvalidValue; // the copy plan's 32-bit offsets
    // both products in one launch: one grid's tail instead of two
    dim3 grid((unsigned)((rows + PJ_TN - 1) / PJ_TN), (unsigned)((n + PJ_TM - 1) / PJ_TM), wq2 ? 2u : 1u);
    // every lane a whole number of stages (E a multiple of 16 * PJ_SB * 32): no partial stage to test for
    if ((E / MMA_QK) % (16 * PJ_SB) == 0)
        k_project_i8<true><<<grid, PJ_THREADS, PJ_SMEM_BYTES, (cudaStream_t)stream>>>(wq, wsc, y, wq2, wsc2, y2, rows,
                                                                                      aq, asc, n, E);
    else
        k_project_i8<false><<<grid, PJ_THREADS, PJ_SMEM_BYTES, (cudaStream_t)stream>>>(wq, wsc, y, wq2, wsc2, y2, rows,
                                                                                       aq, asc, n, E);
    return (int)cudaGetLastError();
}
