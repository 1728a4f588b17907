/* engine/cuda/mla.c — DeepSeek's latent attention (deepseek2) in the CUDA engine's forward, host
 * side, in the expanded form (the cheaper one for prefill). Per chunk of n tokens at pos0 and layer:
 *  - the cache rows (kvb_cu_mla_cache_rows): c = W_kv_a h (f32), the latent c[0:R] RMS-normed with
 *    attn_kv_a_norm (kvb_cu_rmsnorm, bf16), the key's rope part c[R:R+P] rotated (pairs (2i, 2i+1),
 *    the layer's table, YaRN in its frequencies), [latent, k_pe] into the engine's latent cache —
 *    the CPU engine's kvb_kv_produce row, in bf16;
 *  - the queries (kvb_cu_mla_attend): q = W_q_b norm(W_q_a h) (or W_q h), each head's rope part
 *    rotated, bf16 (n, H, K);
 *  - the keys and values of positions 0 .. pos0+n-1 expanded from the cache: their latent rows
 *    gathered, one GEMM through [K_b^T ; V_b] (every head's k_nope and v), assembled with the shared
 *    k_pe into a one-layer paged K/V scratch of head size K = N + P (values padded with zeros
 *    from Vd to K: the engine's attention kernel takes one head size);
 *  - the engine's attention kernel over it, causal, scores times the model's attn_scale (mscale^2 /
 *    sqrt(K) with YaRN, as the CPU engine), then x += W_o' att, W_o' being W_o with zero columns
 *    where the values were padded.
 * Earlier chunks' positions are expanded again each chunk (the cache keeps only the latent). */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "kvb_quant.h"

typedef struct {
    uint32_t H, R, P, K, N, Vd, QL, E, D;
} mla_dims;

static mla_dims dims_of(const kvb_model_desc *d) {
    mla_dims m = {d->n_head, d->n_lora_kv, d->n_rot, d->head_dim_k_mla, 0, d->head_dim_v_mla, d->n_lora_q, d->n_embd,
                  d->head_dim_k_mla};
    m.N = m.K - m.P;
    return m;
}

kvb_status kvb_cu_mla_check(const kvb_model_desc *d, kvb_err *err) {
    const mla_dims m = dims_of(d);
    if (m.K <= m.P || m.P % 2 || m.K > 256 || m.K % 8 || m.R % 8 || (m.R + m.P) % 8 || m.N % 8 || m.Vd % 8 ||
        m.Vd > m.K || m.QL % 8 || m.E % 8)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "the CUDA engine's latent attention needs the query/key head (%u) <= 256, every width "
                           "(latent %u, rope %u, nope %u, value %u, query latent %u, embd %u) a multiple of 8 and the "
                           "value head no wider than the key head",
                           m.K, m.R, m.P, m.N, m.Vd, m.QL, m.E);
    return KVB_OK;
}

size_t kvb_cu_mla_weight_bytes(const kvb_model_desc *d) {
    const mla_dims m = dims_of(d);
    const size_t q = m.QL ? (size_t)m.QL * m.E + (size_t)m.H * m.K * m.QL : (size_t)m.H * m.K * m.E;
    return 2 * (q + (size_t)(m.R + m.P) * m.E + (size_t)m.H * (m.N + m.Vd) * m.R + (size_t)m.E * m.H * m.D) +
           4 * ((size_t)m.QL + m.R);
}

/* Byte sizes of the scratch's buffers, in kvb_cu_mla_scratch's order from qa to kv's pool, and of
 * kv's block table. */
enum { MS_QA, MS_QA_H, MS_Q, MS_QR, MS_C, MS_CN, MS_LAT, MS_UP, MS_ATT, MS_KV, MS_TABLE, MS_COUNT };
static void scratch_sizes(const kvb_model_desc *d, int max_n, int max_ctx, int bt, size_t b[MS_COUNT]) {
    const mla_dims m = dims_of(d);
    const size_t n = (size_t)max_n, L = (size_t)max_ctx, blocks = (L + (size_t)bt - 1) / (size_t)bt;
    b[MS_QA] = n * m.QL * 4;
    b[MS_QA_H] = n * m.QL * 2;
    b[MS_Q] = n * m.H * m.K * 4;
    b[MS_QR] = n * m.H * m.D * 2;
    b[MS_C] = n * (m.R + m.P) * 4;
    b[MS_CN] = n * (m.R + m.P) * 2;
    b[MS_LAT] = L * (m.R + m.P) * 2;
    b[MS_UP] = L * m.H * (m.N + m.Vd) * 2;
    b[MS_ATT] = n * m.H * m.D * 2;
    b[MS_KV] = blocks * 2 * m.H * (size_t)bt * m.D * 2;
    b[MS_TABLE] = blocks * 4;
}

size_t kvb_cu_mla_scratch_bytes(const kvb_model_desc *d, int max_n, int max_ctx, int block_tokens) {
    size_t b[MS_COUNT], t = 0;
    scratch_sizes(d, max_n, max_ctx, block_tokens, b);
    for (int i = 0; i < MS_COUNT; i++) t += b[i];
    return t;
}

kvb_status kvb_cu_mla_scratch_alloc(kvb_cu_mla_scratch *s, const kvb_model_desc *d, int max_n, int max_ctx,
                                    int block_tokens, size_t *acct, kvb_err *err) {
    memset(s, 0, sizeof *s);
    int bt_shift = 0;
    while ((1 << bt_shift) < block_tokens) bt_shift++;
    if (max_n <= 0 || max_ctx <= 0 || block_tokens <= 0 || (1 << bt_shift) != block_tokens)
        return kvb_err_set(err, KVB_ERR_INVALID, "latent attention scratch: bad sizes (chunk %d, context %d, block %d)",
                           max_n, max_ctx, block_tokens);
    const mla_dims m = dims_of(d);
    size_t b[MS_COUNT];
    scratch_sizes(d, max_n, max_ctx, block_tokens, b);
    void **dst[MS_COUNT] = {(void **)&s->qa, &s->qa_h, (void **)&s->q, &s->qr, (void **)&s->c, &s->cn, &s->lat,
                            &s->up,          &s->att, (void **)&s->kv.pool, (void **)&s->kv.blocks};
    for (int i = 0; i < MS_COUNT; i++) {
        cudaError_t ce = cudaMalloc(dst[i], b[i] ? b[i] : 16);
        if (ce != cudaSuccess) {
            *dst[i] = NULL;
            cudaGetLastError();
            kvb_cu_mla_scratch_free(s);
            return kvb_err_set(err, KVB_ERR_NOMEM,
                               "GPU memory: cannot allocate %.3f GiB for the latent attention's scratch: %s",
                               b[i] / 1073741824.0, cudaGetErrorString(ce));
        }
        if (acct) *acct += b[i];
    }
    const int blocks = (int)(b[MS_TABLE] / 4);
    int32_t *ident = malloc(b[MS_TABLE] ? b[MS_TABLE] : 4);
    if (!ident) {
        kvb_cu_mla_scratch_free(s);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of host memory");
    }
    for (int i = 0; i < blocks; i++) ident[i] = i;
    cudaError_t ce = cudaMemcpy((void *)s->kv.blocks, ident, b[MS_TABLE], cudaMemcpyHostToDevice);
    free(ident);
    if (ce != cudaSuccess) {
        kvb_cu_mla_scratch_free(s);
        return kvb_cu_fail(err, ce, "cudaMemcpy (latent attention block table)", __FILE__, __LINE__);
    }
    s->max_n = max_n;
    s->max_ctx = max_ctx;
    s->kv.block_bytes = 2 * (size_t)m.H * (size_t)block_tokens * m.D * 2;
    s->kv.bt_shift = bt_shift;
    s->kv.n_head_kv = (int)m.H;
    s->kv.head_dim = (int)m.D;
    return KVB_OK;
}

void kvb_cu_mla_scratch_free(kvb_cu_mla_scratch *s) {
    void *p[] = {s->qa, s->qa_h, s->q, s->qr, s->c, s->cn, s->lat, s->up, s->att, s->kv.pool, (void *)s->kv.blocks};
    for (size_t i = 0; i < KVB_ARRAY_LEN(p); i++) cudaFree(p[i]);
    memset(s, 0, sizeof *s);
}

void kvb_cu_mla_weights_free(kvb_cu_mla_weights *w) {
    void *p[] = {w->wq_a, w->q_a_norm, w->wq, w->wkv_a, w->kv_a_norm, w->wkv_b, w->wo};
    for (size_t i = 0; i < KVB_ARRAY_LEN(p); i++) cudaFree(p[i]);
    memset(w, 0, sizeof *w);
}

/* Rows of one matrix converted as the engine converts weights (kvb_row_to_f32, then
 * kvb_f32_to_bf16) into a host bf16 layout: PLAIN (rows, cols) as it is; K_T, attn_k_b (H R, N)
 * with head h's (R, N) block transposed to rows h N + j; O_PAD, attn_output (E, H Vd) with head h's
 * Vd columns at h K (the padding stays as the caller zeroed it). */
enum { LAYOUT_PLAIN, LAYOUT_K_T, LAYOUT_O_PAD };
typedef struct {
    const kvb_mat *w;
    int layout;
    mla_dims m;
    uint16_t *dst;
    float **tmp; /* per worker (cols floats) */
} conv_job;

static void conv_row(void *ctx, int task, int worker) {
    const conv_job *j = ctx;
    const kvb_mat *w = j->w;
    const size_t r = (size_t)task, cols = (size_t)w->cols;
    float *t = j->tmp[worker];
    kvb_row_to_f32(w->type, (const uint8_t *)w->data + r * w->row_bytes, t, w->cols);
    if (j->layout == LAYOUT_PLAIN) {
        for (size_t c = 0; c < cols; c++) j->dst[r * cols + c] = kvb_f32_to_bf16(t[c]);
    } else if (j->layout == LAYOUT_K_T) { /* row r = h R + i of attn_k_b: column i of rows h N .. */
        const size_t h = r / j->m.R, i = r % j->m.R;
        for (size_t c = 0; c < cols; c++) j->dst[(h * j->m.N + c) * j->m.R + i] = kvb_f32_to_bf16(t[c]);
    } else {
        const size_t HK = (size_t)j->m.H * j->m.K;
        for (size_t h = 0; h < j->m.H; h++)
            for (size_t i = 0; i < j->m.Vd; i++) j->dst[r * HK + h * j->m.K + i] = kvb_f32_to_bf16(t[h * j->m.Vd + i]);
    }
}

/* Matrix w into the host buffer dst (zeroed by the caller where the layout pads) in `layout`. */
static void convert(kvb_pool *pool, const kvb_mat *w, int layout, mla_dims m, uint16_t *dst, float **tmp) {
    conv_job j = {w, layout, m, dst, tmp};
    kvb_pool_parallel_for(pool, (int)w->rows, conv_row, &j);
}

kvb_status kvb_cu_mla_weights_upload(const kvb_model_desc *d, const kvb_layer_weights *w, kvb_pool *pool,
                                     kvb_cu_mla_weights *mw, size_t *acct, kvb_err *err) {
    const mla_dims m = dims_of(d);
    const size_t H = m.H, K = m.K, N = m.N, R = m.R, P = m.P, Vd = m.Vd, E = m.E, QL = m.QL;
    memset(mw, 0, sizeof *mw);
    const kvb_mat *wq = QL ? &w->wq_b : &w->wq;
    if (w->wk_b.rows != (int64_t)(H * R) || w->wk_b.cols != (int64_t)N || w->wv_b.rows != (int64_t)(H * Vd) ||
        w->wv_b.cols != (int64_t)R || w->wo.rows != (int64_t)E || w->wo.cols != (int64_t)(H * Vd) ||
        w->wkv_a.rows != (int64_t)(R + P) || w->wkv_a.cols != (int64_t)E || wq->rows != (int64_t)(H * K) ||
        wq->cols != (int64_t)(QL ? QL : E) || (QL && (w->wq_a.rows != (int64_t)QL || w->wq_a.cols != (int64_t)E)))
        return kvb_err_set(err, KVB_ERR_INTERNAL, "latent attention weights of unexpected shapes");
    /* (matrix, layout, rows, cols, destination) in kvb_cu_mla_weights' order; wkv_b from two matrices */
    const struct {
        const kvb_mat *w;
        int layout;
        size_t rows, cols, at; /* the device matrix's shape; `at`: first element written */
        void **dst;
    } mats[] = {
        {&w->wq_a, LAYOUT_PLAIN, QL, E, 0, &mw->wq_a},
        {wq, LAYOUT_PLAIN, H * K, QL ? QL : E, 0, &mw->wq},
        {&w->wkv_a, LAYOUT_PLAIN, R + P, E, 0, &mw->wkv_a},
        {&w->wk_b, LAYOUT_K_T, H * (N + Vd), R, 0, &mw->wkv_b},
        {&w->wv_b, LAYOUT_PLAIN, H * (N + Vd), R, H * N * R, &mw->wkv_b},
        {&w->wo, LAYOUT_O_PAD, E, H * K, 0, &mw->wo},
    };
    size_t big = 0, widest = 0;
    for (size_t i = 0; i < KVB_ARRAY_LEN(mats); i++) {
        big = KVB_MAX(big, mats[i].rows * mats[i].cols);
        widest = KVB_MAX(widest, (size_t)mats[i].w->cols);
    }
    const int workers = pool ? kvb_pool_size(pool) : 1;
    uint16_t *host = malloc(big * sizeof(uint16_t));
    float **tmp = calloc((size_t)workers, sizeof(float *));
    kvb_status st = host && tmp ? KVB_OK : kvb_err_set(err, KVB_ERR_NOMEM, "out of host memory for MLA weights");
    for (int i = 0; !st && i < workers; i++)
        if (!(tmp[i] = malloc(widest * sizeof(float))))
            st = kvb_err_set(err, KVB_ERR_NOMEM, "out of host memory for MLA weights");
    for (size_t i = 0; !st && i < KVB_ARRAY_LEN(mats); i++) {
        if (!QL && mats[i].dst == &mw->wq_a) continue; /* no query latent */
        const bool second = i > 0 && mats[i].dst == mats[i - 1].dst; /* wv_b after wk_b: one upload */
        if (!second) memset(host, 0, mats[i].rows * mats[i].cols * sizeof(uint16_t));
        convert(pool, mats[i].w, mats[i].layout, m, host + mats[i].at, tmp);
        const bool last = i + 1 == KVB_ARRAY_LEN(mats) || mats[i + 1].dst != mats[i].dst;
        if (!last) continue;
        const size_t bytes = mats[i].rows * mats[i].cols * 2;
        cudaError_t ce = cudaMalloc(mats[i].dst, bytes);
        if (ce != cudaSuccess) {
            *mats[i].dst = NULL;
            cudaGetLastError();
            st = kvb_err_set(err, KVB_ERR_NOMEM,
                             "GPU memory: cannot allocate %.3f GiB for latent attention weights: %s",
                             bytes / 1073741824.0, cudaGetErrorString(ce));
        } else if ((ce = cudaMemcpy(*mats[i].dst, host, bytes, cudaMemcpyHostToDevice)) != cudaSuccess) {
            st = kvb_cu_fail(err, ce, "cudaMemcpy (latent attention weights)", __FILE__, __LINE__);
        } else if (acct) {
            *acct += bytes;
        }
    }
    if (tmp)
        for (int i = 0; i < workers; i++) free(tmp[i]);
    free(tmp);
    free(host);
    const struct {
        const float *src;
        size_t n;
        float **dst;
    } vecs[] = {{w->q_a_norm, QL, &mw->q_a_norm}, {w->kv_a_norm, R, &mw->kv_a_norm}};
    for (size_t i = 0; !st && i < KVB_ARRAY_LEN(vecs); i++) {
        if (!vecs[i].n) continue;
        cudaError_t ce = cudaMalloc((void **)vecs[i].dst, vecs[i].n * 4);
        if (ce == cudaSuccess) ce = cudaMemcpy(*vecs[i].dst, vecs[i].src, vecs[i].n * 4, cudaMemcpyHostToDevice);
        if (ce != cudaSuccess) {
            cudaGetLastError();
            st = kvb_cu_fail(err, ce, "latent attention norm weights", __FILE__, __LINE__);
        } else if (acct) {
            *acct += vecs[i].n * 4;
        }
    }
    if (st) kvb_cu_mla_weights_free(mw);
    return st;
}

kvb_status kvb_cu_mla_cache_rows(cublasHandle_t cb, cudaStream_t st, const kvb_model_desc *d,
                                 const kvb_cu_mla_weights *w, const void *h, int n, int pos0, const float *rope_cos,
                                 const float *rope_sin, kvb_cu_mla_cache cache, int layer, kvb_cu_mla_scratch *s,
                                 kvb_err *err) {
    const mla_dims m = dims_of(d);
    const int RP = (int)(m.R + m.P);
    if (n > s->max_n)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "latent attention: %d tokens in a chunk, scratch for %d", n,
                           s->max_n);
    kvb_status rs = kvb_cu_gemm(cb, w->wkv_a, RP, (int)m.E, h, n, 0.0f, s->c, false, err); /* (n, R + P) f32 */
    if (rs) return rs;
    KVB_CU(kvb_cu_rmsnorm(s->c, (size_t)RP, n, (int)m.R, w->kv_a_norm, d->norm_eps, s->cn, (size_t)RP, NULL, st));
    KVB_CU(kvb_cu_mla_kv_store(s->c, s->cn, n, pos0, rope_cos, rope_sin, cache, layer, st));
    return KVB_OK;
}

kvb_status kvb_cu_mla_attend(cublasHandle_t cb, cudaStream_t st, const kvb_model_desc *d, const kvb_cu_mla_weights *w,
                             const void *h, int n, int pos0, const float *rope_cos, const float *rope_sin,
                             kvb_cu_mla_cache cache, int layer, bool skip_attention, float *x, kvb_cu_mla_scratch *s,
                             kvb_err *err) {
    const mla_dims m = dims_of(d);
    const int H = (int)m.H, K = (int)m.K, E = (int)m.E, RP = (int)(m.R + m.P), L = pos0 + n;
    kvb_status rs;
    if (n > s->max_n || L > s->max_ctx)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "latent attention: %d tokens at %d, scratch for %d up to %d", n, pos0,
                           s->max_n, s->max_ctx);
    /* the queries (n, H, K) f32, then roped in bf16 */
    if (w->wq_a) {
        const int QL = (int)m.QL;
        if ((rs = kvb_cu_gemm(cb, w->wq_a, QL, E, h, n, 0.0f, s->qa, false, err))) return rs;
        KVB_CU(kvb_cu_rmsnorm(s->qa, (size_t)QL, n, QL, w->q_a_norm, d->norm_eps, s->qa_h, (size_t)QL, NULL, st));
        if ((rs = kvb_cu_gemm(cb, w->wq, H * K, QL, s->qa_h, n, 0.0f, s->q, false, err))) return rs;
    } else if ((rs = kvb_cu_gemm(cb, w->wq, H * K, E, h, n, 0.0f, s->q, false, err))) {
        return rs;
    }
    KVB_CU(kvb_cu_mla_q_rope(s->q, n, H, (int)m.N, (int)m.P, pos0, rope_cos, rope_sin, s->qr, st));
    /* every head's keys and values of positions 0 .. L-1, expanded from the latent rows */
    KVB_CU(kvb_cu_mla_gather(cache, layer, L, s->lat, st));
    if ((rs = kvb_cu_gemm_ldx(cb, w->wkv_b, H * (int)(m.N + m.Vd), (int)m.R, s->lat, RP, L, 0.0f, s->up, true, err)))
        return rs;
    KVB_CU(kvb_cu_mla_assemble(s->up, s->lat, L, H, (int)m.N, (int)m.Vd, (int)m.R, (int)m.P, s->kv, st));
    if (!skip_attention) {
        const kvb_cu_attn_args aa = {s->qr, s->att, s->kv, 0, H, H, (int)m.D, n, pos0, 0, d->attn_scale};
        KVB_CU(kvb_cu_attention(&aa, 0, st));
    }
    return kvb_cu_gemm(cb, w->wo, E, H * (int)m.D, s->att, n, 1.0f, x, false, err); /* x += W_o' att */
}
