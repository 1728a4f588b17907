/* engine/cuda/moe_ffn.c — the mixture-of-experts MLP of the CUDA engine (qwen3moe), host side:
 * router logits through the engine's cuBLAS GEMM (f32), the router kernel (the model's gating, selection
 * bias and groups), the permutation of the
 * (token, rank) slots by expert and the gather of their rows (moe.cu), one wait for the experts'
 * offsets (the GEMMs' sizes live on the host), then the experts' gate|up GEMMs (bf16 out), one
 * SwiGLU over every slot, the down GEMMs, and the weighted un-permute into the residual stream.
 * The GEMMs run as a loop of cuBLAS GEMMs, one per non-empty expert, or as one grouped GEMM per
 * projection (cublasGemmGroupedBatchedEx); KVB_CUDA_MOE_GEMM picks, so the two can be timed side
 * by side on the same build. */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

kvb_status kvb_cu_moe_gemm_from_env(kvb_cu_moe_gemm *out, kvb_err *err) {
    const char *v = getenv("KVB_CUDA_MOE_GEMM");
    *out = KVB_CU_MOE_LOOP;
    if (!v || !*v || !strcmp(v, "loop")) return KVB_OK;
    if (!strcmp(v, "grouped")) {
        *out = KVB_CU_MOE_GROUPED;
        return KVB_OK;
    }
    return kvb_err_set(err, KVB_ERR_INVALID, "KVB_CUDA_MOE_GEMM must be loop or grouped, got '%s'", v);
}

const char *kvb_cu_moe_gemm_name(kvb_cu_moe_gemm g) {
    return g == KVB_CU_MOE_GROUPED ? "one grouped cuBLAS GEMM per projection" : "a cuBLAS GEMM per expert";
}

/* Byte sizes of the device buffers, in kvb_cu_moe_scratch's order from logits to d_ptrs. */
enum {
    SB_LOGITS, SB_SCORE, SB_W, SB_SEL, SB_SLOT, SB_INV, SB_CNT, SB_OFF, SB_XP, SB_GUP, SB_ACTP, SB_YP, SB_PTRS, SB_COUNT
};
static void scratch_sizes(int max_n, int X, int K, int F, int E, size_t b[SB_COUNT]) {
    const size_t n = (size_t)max_n, slots = n * (size_t)K;
    b[SB_LOGITS] = b[SB_SCORE] = n * (size_t)X * 4;
    b[SB_W] = slots * 4;
    b[SB_SEL] = b[SB_SLOT] = b[SB_INV] = slots * 4;
    b[SB_CNT] = (size_t)X * 4;
    b[SB_OFF] = ((size_t)X + 1) * 4;
    b[SB_XP] = slots * (size_t)E * 2;
    b[SB_GUP] = slots * 2 * (size_t)F * 2;
    b[SB_ACTP] = slots * (size_t)F * 2;
    b[SB_YP] = slots * (size_t)E * 4;
    b[SB_PTRS] = 6 * (size_t)X * sizeof(void *);
}

size_t kvb_cu_moe_scratch_bytes(int max_n, int X, int K, int F, int E) {
    size_t b[SB_COUNT], t = 0;
    scratch_sizes(max_n, X, K, F, E, b);
    for (int i = 0; i < SB_COUNT; i++) t += b[i];
    return t;
}

kvb_status kvb_cu_moe_scratch_alloc(kvb_cu_moe_scratch *s, int max_n, int X, int K, int F, int E, size_t *acct,
                                    kvb_err *err) {
    memset(s, 0, sizeof *s);
    if (max_n <= 0 || X <= 0 || K <= 0 || K > X || F <= 0 || E <= 0 || E % 8 || (int64_t)max_n * K > INT32_MAX / 2)
        return kvb_err_set(err, KVB_ERR_INVALID, "MoE scratch: bad sizes (tokens %d, experts %d top-%d, ff %d, embd %d)",
                           max_n, X, K, F, E);
    *s = (kvb_cu_moe_scratch){.X = X, .K = K, .F = F, .E = E, .max_n = max_n};
    size_t b[SB_COUNT];
    scratch_sizes(max_n, X, K, F, E, b);
    void **dst[SB_COUNT] = {(void **)&s->logits, (void **)&s->score, (void **)&s->w,   (void **)&s->sel,
                            (void **)&s->slot,   (void **)&s->inv,   (void **)&s->cnt, (void **)&s->off,
                            &s->xp,              &s->gup,            &s->actp,         &s->yp,
                            (void **)&s->d_ptrs};
    for (int i = 0; i < SB_COUNT; i++) {
        cudaError_t ce = cudaMalloc(dst[i], b[i]);
        if (ce != cudaSuccess) {
            *dst[i] = NULL;
            cudaGetLastError();
            kvb_cu_moe_scratch_free(s);
            return kvb_err_set(err, KVB_ERR_NOMEM, "GPU memory: cannot allocate %.3f GiB for the MoE scratch: %s",
                               b[i] / 1073741824.0, cudaGetErrorString(ce));
        }
        if (acct) *acct += b[i];
    }
    cudaError_t ce = cudaHostAlloc((void **)&s->h_off, ((size_t)X + 1) * 4, cudaHostAllocDefault);
    if (ce == cudaSuccess) ce = cudaHostAlloc((void **)&s->h_ptrs, 6 * (size_t)X * sizeof(void *), cudaHostAllocDefault);
    if (ce != cudaSuccess) {
        cudaGetLastError();
        kvb_cu_moe_scratch_free(s);
        return kvb_err_set(err, KVB_ERR_NOMEM, "pinned host memory for the MoE offsets: %s", cudaGetErrorString(ce));
    }
    s->h_dims = malloc(7 * (size_t)X * sizeof(int));
    s->h_scal = malloc(2 * (size_t)X * sizeof(float));
    s->h_ops = malloc(2 * (size_t)X * sizeof(cublasOperation_t));
    if (!s->h_dims || !s->h_scal || !s->h_ops) {
        kvb_cu_moe_scratch_free(s);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of host memory for the MoE scratch");
    }
    return KVB_OK;
}

void kvb_cu_moe_scratch_free(kvb_cu_moe_scratch *s) {
    void *d[] = {s->logits, s->score, s->w,  s->sel, s->slot, s->inv,   s->cnt,
                 s->off,    s->xp,    s->gup, s->actp, s->yp, s->d_ptrs};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) cudaFree(d[i]);
    if (s->h_off) cudaFreeHost(s->h_off);
    if (s->h_ptrs) cudaFreeHost(s->h_ptrs);
    free(s->h_dims);
    free(s->h_scal);
    free(s->h_ops);
    memset(s, 0, sizeof *s);
}

/* The loop path: per non-empty expert x (its slots [off[x], off[x+1])), gup = gu_x xp (bf16), then
 * after one SwiGLU over every slot, yp = down_x actp (f32). */
static kvb_status experts_loop(cublasHandle_t h, cudaStream_t st, const kvb_cu_moe_weights *w, kvb_cu_moe_scratch *s,
                               int n_slots, kvb_err *err) {
    const int X = s->X, F = s->F, E = s->E;
    kvb_status rs;
    for (int x = 0; x < X; x++) {
        const int o = s->h_off[x], c = s->h_off[x + 1] - o;
        if (c <= 0) continue;
        if ((rs = kvb_cu_gemm(h, (const uint16_t *)w->gu + (size_t)x * 2 * F * E, 2 * F, E,
                              (const uint16_t *)s->xp + (size_t)o * E, c, 0.0f, (uint16_t *)s->gup + (size_t)o * 2 * F,
                              true, err)))
            return rs;
    }
    KVB_CU(kvb_cu_glu(s->gup, n_slots, F, 0, s->actp, st));
    for (int x = 0; x < X; x++) {
        const int o = s->h_off[x], c = s->h_off[x + 1] - o;
        if (c <= 0) continue;
        if ((rs = kvb_cu_gemm(h, (const uint16_t *)w->down + (size_t)x * E * F, E, F,
                              (const uint16_t *)s->actp + (size_t)o * F, c, 0.0f, (float *)s->yp + (size_t)o * E,
                              false, err)))
            return rs;
    }
    return KVB_OK;
}

/* One grouped GEMM over the g non-empty experts listed in ex: C_j (c_j, rows) = W_j X_j^T with
 * W_j = Wbase + ex[j] * rows * cols (bf16), X_j and C_j at the expert's slot offset (row strides
 * cols and rows); ptrs: the device A, B, C arrays (3 g), already holding the pointers. */
static kvb_status grouped_gemm(cublasHandle_t h, kvb_cu_moe_scratch *s, int g, const int *ex, int rows, int cols,
                               void **ptrs, kvb_err *err) {
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120500
    int *m = s->h_dims, *nn = m + s->X, *k = nn + s->X, *lda = k + s->X, *ldb = lda + s->X, *ldc = ldb + s->X,
        *gs = ldc + s->X;
    float *alpha = s->h_scal, *beta = alpha + s->X;
    cublasOperation_t *ta = s->h_ops, *tb = ta + s->X;
    for (int j = 0; j < g; j++) {
        m[j] = rows, nn[j] = s->h_off[ex[j] + 1] - s->h_off[ex[j]], k[j] = cols;
        lda[j] = cols, ldb[j] = cols, ldc[j] = rows, gs[j] = 1;
        alpha[j] = 1.0f, beta[j] = 0.0f;
        ta[j] = CUBLAS_OP_T, tb[j] = CUBLAS_OP_N;
    }
    cublasStatus_t cs = cublasGemmGroupedBatchedEx(h, ta, tb, m, nn, k, alpha, (const void *const *)ptrs, CUDA_R_16BF,
                                                   lda, (const void *const *)(ptrs + g), CUDA_R_16BF, ldb, beta,
                                                   ptrs + 2 * g, CUDA_R_16BF, ldc, g, gs, CUBLAS_COMPUTE_32F);
    if (cs != CUBLAS_STATUS_SUCCESS) return kvb_cublas_fail(err, cs, "cublasGemmGroupedBatchedEx", __FILE__, __LINE__);
    return KVB_OK;
#else
    (void)h, (void)s, (void)g, (void)ex, (void)rows, (void)cols, (void)ptrs;
    return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "grouped MoE GEMMs need cuBLAS 12.5 or later");
#endif
}

/* The grouped path: the pointer arrays of both projections staged in pinned memory and copied in
 * one transfer (the staging is free: the previous layer's copy finished before this layer's wait),
 * then gate|up grouped, SwiGLU, down grouped (bf16 outputs). */
static kvb_status experts_grouped(cublasHandle_t h, cudaStream_t st, const kvb_cu_moe_weights *w,
                                  kvb_cu_moe_scratch *s, int n_slots, kvb_err *err) {
    const int X = s->X, F = s->F, E = s->E;
    int *ex = malloc(sizeof(int) * (size_t)X);
    if (!ex) return kvb_err_set(err, KVB_ERR_NOMEM, "out of host memory");
    int g = 0;
    for (int x = 0; x < X; x++)
        if (s->h_off[x + 1] > s->h_off[x]) ex[g++] = x;
    void **hp = s->h_ptrs; /* (A, B, C) of gate|up, then of down, g each */
    for (int j = 0; j < g; j++) {
        const size_t o = (size_t)s->h_off[ex[j]];
        hp[j] = (uint16_t *)w->gu + (size_t)ex[j] * 2 * F * E;
        hp[g + j] = (uint16_t *)s->xp + o * E;
        hp[2 * g + j] = (uint16_t *)s->gup + o * 2 * F;
        hp[3 * g + j] = (uint16_t *)w->down + (size_t)ex[j] * E * F;
        hp[4 * g + j] = (uint16_t *)s->actp + o * F;
        hp[5 * g + j] = (uint16_t *)s->yp + o * E;
    }
    kvb_status rs = KVB_OK;
    cudaError_t ce = cudaMemcpyAsync(s->d_ptrs, hp, 6 * (size_t)g * sizeof(void *), cudaMemcpyHostToDevice, st);
    if (ce != cudaSuccess) rs = kvb_cu_fail(err, ce, "cudaMemcpyAsync (MoE pointer arrays)", __FILE__, __LINE__);
    if (!rs && g) rs = grouped_gemm(h, s, g, ex, 2 * F, E, s->d_ptrs, err);
    if (!rs && (ce = kvb_cu_glu(s->gup, n_slots, F, 0, s->actp, st)) != cudaSuccess)
        rs = kvb_cu_fail(err, ce, "kvb_cu_glu", __FILE__, __LINE__);
    if (!rs && g) rs = grouped_gemm(h, s, g, ex, E, F, s->d_ptrs + 3 * g, err);
    free(ex);
    return rs;
}

kvb_status kvb_cu_moe_ffn(cublasHandle_t h, cudaStream_t st, const kvb_cu_moe_weights *w,
                          const kvb_moe_route_cfg *route, const void *hin,
                          int n, float *x, kvb_cu_moe_scratch *s, kvb_cu_moe_gemm path, kvb_err *err) {
    if (n <= 0) return KVB_OK;
    if (n > s->max_n)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "MoE MLP: %d tokens in a chunk, scratch for %d", n, s->max_n);
    const int X = s->X, K = s->K, E = s->E, n_slots = n * K;
    kvb_status rs = kvb_cu_gemm(h, w->router, X, E, hin, n, 0.0f, s->logits, false, err); /* (n, X) */
    if (rs) return rs;
    KVB_CU(kvb_cu_moe_route_cfg(s->logits, s->score, w->bias, n, X, K, route, s->sel, s->w, st));
    KVB_CU(kvb_cu_moe_permute(s->sel, n, K, X, s->cnt, s->off, s->slot, s->inv, st));
    KVB_CU(cudaMemcpyAsync(s->h_off, s->off, ((size_t)X + 1) * 4, cudaMemcpyDeviceToHost, st));
    KVB_CU(kvb_cu_moe_gather(hin, s->slot, n_slots, K, E, s->xp, st));
    KVB_CU(cudaStreamSynchronize(st));
    if (s->h_off[0] != 0 || s->h_off[X] != n_slots)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "MoE permutation: offsets %d .. %d for %d slots", s->h_off[0],
                           s->h_off[X], n_slots);
    for (int e = 0; e < X; e++)
        if (s->h_off[e + 1] < s->h_off[e])
            return kvb_err_set(err, KVB_ERR_INTERNAL, "MoE permutation: offsets decrease at expert %d", e);
    rs = path == KVB_CU_MOE_GROUPED ? experts_grouped(h, st, w, s, n_slots, err) : experts_loop(h, st, w, s, n_slots, err);
    if (rs) return rs;
    KVB_CU(kvb_cu_moe_unpermute(s->yp, path == KVB_CU_MOE_GROUPED, s->inv, s->w, n, K, E, x, st));
    return KVB_OK;
}

kvb_moe_route_cfg kvb_cu_moe_route_cfg_of(const kvb_model_desc *d) {
    const kvb_moe_route_cfg c = {d->expert_gating == KVB_GATING_SIGMOID ? 2 : 1, d->expert_weights_norm ? 1 : 0,
                                 d->expert_weights_scale, d->n_expert_groups > 1 ? (int)d->n_expert_groups : 0,
                                 d->n_expert_groups > 1 ? (int)d->n_group_used : 0};
    return c;
}
