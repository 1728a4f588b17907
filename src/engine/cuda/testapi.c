/* engine/cuda/testapi.c — the kernel entry points for tests (cuda_testapi.h, "kernel entry
 * points for tests"): copy host inputs and the caller's (poisoned) outputs to the device, run one
 * launcher, synchronise, check, and copy the outputs back. */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "cuda_testapi.h"
#include "cudnn_attention.h"

#define NBUF 12

typedef struct {
    void *p[NBUF];
    int n;
} dbufs;

static void dbufs_free(dbufs *b) {
    cudaDeviceSynchronize();
    for (int i = 0; i < b->n; i++) cudaFree(b->p[i]);
    b->n = 0;
}

/* Allocates bytes on the device and copies src there (src may be NULL: left unset). */
static kvb_status dput(dbufs *b, void **out, const void *src, size_t bytes, kvb_err *err) {
    *out = NULL;
    if (b->n == NBUF) return kvb_err_set(err, KVB_ERR_INTERNAL, "too many test buffers");
    KVB_CU(cudaMalloc(out, bytes ? bytes : 16));
    b->p[b->n++] = *out;
    if (src && bytes) KVB_CU(cudaMemcpy(*out, src, bytes, cudaMemcpyHostToDevice));
    return KVB_OK;
}

static kvb_status need_device(kvb_err *err) {
    char why[256];
    if (!kvb_cuda_device_available(why, sizeof why)) return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s", why);
    return KVB_OK;
}

static kvb_status finish(kvb_err *err) {
    KVB_CU(cudaGetLastError());
    KVB_CU(cudaDeviceSynchronize());
    return KVB_OK;
}

/* After one launch (its result ce, the launcher's name what): checks it, waits, and copies the
 * device output dev (bytes) back to host. */
static kvb_status fetch(cudaError_t ce, const char *what, void *host, const void *dev, size_t bytes, kvb_err *err) {
    if (ce != cudaSuccess) return kvb_cu_fail(err, ce, what, __FILE__, __LINE__);
    kvb_status st = finish(err);
    if (st) return st;
    if (cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "%s: copy back failed", what);
    return KVB_OK;
}

kvb_status kvb_cuda_test_embed(const uint16_t *table, uint32_t V, uint32_t E, const int32_t *tok, uint32_t n,
                               float scale, float *x, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    dbufs b = {{0}, 0};
    void *dt, *dk, *dx;
    if ((st = dput(&b, &dt, table, (size_t)V * E * 2, err)) || (st = dput(&b, &dk, tok, (size_t)n * 4, err)) ||
        (st = dput(&b, &dx, x, (size_t)n * E * 4, err)))
        goto done;
    st = fetch(kvb_cu_embed(dt, dk, (int)n, (int)E, scale, dx, 0), "kvb_cu_embed", x, dx, (size_t)n * E * 4, err);
done:
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_rmsnorm(const float *x, uint32_t n, uint32_t E, const float *w, float eps, uint16_t *y,
                                 float *acc, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    if (!y == !acc) return kvb_err_set(err, KVB_ERR_INVALID, "kvb_cuda_test_rmsnorm: give y or acc, not both");
    const size_t out_bytes = (size_t)n * E * (y ? 2 : 4);
    dbufs b = {{0}, 0};
    void *dx, *dw, *dy;
    if ((st = dput(&b, &dx, x, (size_t)n * E * 4, err)) || (st = dput(&b, &dw, w, (size_t)E * 4, err)) ||
        (st = dput(&b, &dy, y ? (const void *)y : (const void *)acc, out_bytes, err)))
        goto done;
    if (y)
        st = fetch(kvb_cu_rmsnorm(dx, E, (int)n, (int)E, dw, eps, dy, E, NULL, 0), "kvb_cu_rmsnorm", y, dy, out_bytes,
                   err);
    else st = fetch(kvb_cu_rmsnorm_add(dx, (int)n, (int)E, dw, eps, dy, 0), "kvb_cu_rmsnorm_add", acc, dy, out_bytes, err);
done:
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_glu(const uint16_t *gu, uint32_t n, uint32_t FF, bool gelu, uint16_t *out, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    dbufs b = {{0}, 0};
    void *dg, *dout;
    if ((st = dput(&b, &dg, gu, (size_t)n * 2 * FF * 2, err)) || (st = dput(&b, &dout, out, (size_t)n * FF * 2, err)))
        goto done;
    st = fetch(kvb_cu_glu(dg, (int)n, (int)FF, gelu ? 1 : 0, dout, 0), "kvb_cu_glu", out, dout, (size_t)n * FF * 2,
               err);
done:
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_gemm(const uint16_t *W, uint32_t rows, uint32_t cols, const uint16_t *x, uint32_t n,
                              float beta, void *y, bool y_bf16, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    dbufs b = {{0}, 0};
    void *dw, *dx, *dy;
    cublasHandle_t h = NULL;
    const size_t yb = (size_t)n * rows * (y_bf16 ? 2 : 4);
    if ((st = dput(&b, &dw, W, (size_t)rows * cols * 2, err)) || (st = dput(&b, &dx, x, (size_t)n * cols * 2, err)) ||
        (st = dput(&b, &dy, y, yb, err)))
        goto done;
    {
        cublasStatus_t cs = cublasCreate(&h);
        if (cs != CUBLAS_STATUS_SUCCESS) {
            h = NULL;
            st = kvb_cublas_fail(err, cs, "cublasCreate", __FILE__, __LINE__);
            goto done;
        }
    }
    if ((st = kvb_cu_gemm(h, dw, (int)rows, (int)cols, dx, (int)n, beta, dy, y_bf16, err))) goto done;
    if ((st = finish(err))) goto done;
    if (cudaMemcpy(y, dy, yb, cudaMemcpyDeviceToHost) != cudaSuccess)
        st = kvb_err_set(err, KVB_ERR_INTERNAL, "copy back failed");
done:
    if (h) cublasDestroy(h);
    dbufs_free(&b);
    return st;
}

static int shift_of(uint32_t bt) {
    int s = 0;
    while ((1u << s) < bt) s++;
    return (1u << s) == bt ? s : -1;
}

static size_t cache_block_bytes(const kvb_cuda_test_cache *c) {
    return (size_t)c->n_layer * 2 * c->n_head_kv * c->block_tokens * c->head_dim * 2;
}

kvb_status kvb_cuda_test_qkv_post(const kvb_cuda_test_qkv_args *a, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    const kvb_cuda_test_cache *c = &a->cache;
    const int bts = shift_of(c->block_tokens);
    if (bts < 0) return kvb_err_set(err, KVB_ERR_INVALID, "block_tokens must be a power of two");
    const size_t S = (size_t)(a->H + 2 * a->Hkv) * a->D, half = a->n_rot / 2 ? a->n_rot / 2 : 1;
    const size_t pool_bytes = cache_block_bytes(c) * c->n_pool_blocks;
    dbufs b = {{0}, 0};
    void *dqkv, *dbias = NULL, *dqn = NULL, *dkn = NULL, *dcos, *dsin, *dq, *dpool, *dtab;
    if ((st = dput(&b, &dqkv, a->qkv, (size_t)a->n * S * 4, err)) ||
        (a->bias && (st = dput(&b, &dbias, a->bias, S * 4, err))) ||
        (a->q_norm && (st = dput(&b, &dqn, a->q_norm, (size_t)a->D * 4, err))) ||
        (a->k_norm && (st = dput(&b, &dkn, a->k_norm, (size_t)a->D * 4, err))) ||
        (st = dput(&b, &dq, a->q_out, (size_t)a->n * a->H * a->D * 2, err)) ||
        (st = dput(&b, &dpool, c->pool, pool_bytes, err)) || (st = dput(&b, &dtab, c->blocks, (size_t)c->n_table * 4, err)))
        goto done;
    /* cos and sin share one buffer (NBUF) */
    {
        const size_t tb = (size_t)(a->pos0 + a->n) * half * 4;
        void *dt;
        if ((st = dput(&b, &dt, NULL, 2 * tb, err))) goto done;
        dcos = dt;
        dsin = (uint8_t *)dt + tb;
        if (a->n_rot) {
            if (cudaMemcpy(dcos, a->rope_cos, tb, cudaMemcpyHostToDevice) != cudaSuccess ||
                cudaMemcpy(dsin, a->rope_sin, tb, cudaMemcpyHostToDevice) != cudaSuccess) {
                st = kvb_err_set(err, KVB_ERR_INTERNAL, "upload of the rope table failed");
                goto done;
            }
        }
    }
    {
        kvb_cu_qkv_post_args ka = {dqkv, (int)a->n, (int)a->H, (int)a->Hkv, (int)a->D, (int)a->n_rot, a->neox ? 1 : 0,
                                   dbias, dqn, dkn, a->eps, dcos, dsin, (int)a->pos0, dq,
                                   {dpool, cache_block_bytes(c), dtab, bts, (int)c->n_head_kv, (int)c->head_dim},
                                   (int)a->layer};
        cudaError_t ce = kvb_cu_qkv_post(&ka, 0);
        if (ce != cudaSuccess) {
            st = kvb_cu_fail(err, ce, "kvb_cu_qkv_post", __FILE__, __LINE__);
            goto done;
        }
    }
    if ((st = finish(err))) goto done;
    if (cudaMemcpy(a->q_out, dq, (size_t)a->n * a->H * a->D * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(c->pool, dpool, pool_bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
        st = kvb_err_set(err, KVB_ERR_INTERNAL, "copy back failed");
done:
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_attention(const uint16_t *q, uint32_t n, uint32_t H, uint32_t pos0, uint32_t layer,
                                   uint32_t window, float scale, const kvb_cuda_test_cache *c, int variant,
                                   uint16_t *out, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    const int bts = shift_of(c->block_tokens);
    if (bts < 0) return kvb_err_set(err, KVB_ERR_INVALID, "block_tokens must be a power of two");
    const size_t pool_bytes = cache_block_bytes(c) * c->n_pool_blocks, qb = (size_t)n * H * c->head_dim * 2;
    dbufs b = {{0}, 0};
    void *dq, *dout, *dpool, *dtab;
    if ((st = dput(&b, &dq, q, qb, err)) || (st = dput(&b, &dout, out, qb, err)) ||
        (st = dput(&b, &dpool, c->pool, pool_bytes, err)) || (st = dput(&b, &dtab, c->blocks, (size_t)c->n_table * 4, err)))
        goto done;
    {
        kvb_cu_attn_args aa = {dq, dout,
                               {dpool, cache_block_bytes(c), dtab, bts, (int)c->n_head_kv, (int)c->head_dim},
                               (int)layer, (int)H, (int)c->n_head_kv, (int)c->head_dim, (int)n, (int)pos0,
                               (int)window, scale};
        if (variant == 4) {
            kvb_cudnn_attn *dnn = NULL;
            if (!(st = kvb_cudnn_attn_create(0, (int)c->n_head_kv, (int)c->head_dim, n, pos0 + n, &dnn, NULL, err)))
                st = kvb_cudnn_attn_run(dnn, &aa, err);
            kvb_cudnn_attn_free(dnn);
            if (!st) st = fetch(cudaSuccess, "cuDNN attention", out, dout, qb, err);
        } else {
            cudaError_t ce = kvb_cu_attention_init();
            if (ce == cudaSuccess) ce = kvb_cu_attention(&aa, variant, 0);
            st = fetch(ce, "kvb_cu_attention", out, dout, qb, err);
        }
    }
done:
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_cudnn_sequence(const kvb_cuda_test_cache *c, uint32_t layer, uint32_t H, uint32_t max_q,
                                        uint32_t max_kv, uint32_t calls, const uint32_t *n, const uint32_t *pos0,
                                        const uint32_t *layers, const uint16_t *const *q, uint16_t *const *out,
                                        bool *took, uint32_t *plans, kvb_err *err) {
    *plans = 0;
    kvb_status st = need_device(err);
    if (st) return st;
    const int bts = shift_of(c->block_tokens);
    if (bts < 0) return kvb_err_set(err, KVB_ERR_INVALID, "block_tokens must be a power of two");
    for (uint32_t i = 0; i < calls; i++)
        if (n[i] == 0 || n[i] > max_q || (uint64_t)pos0[i] + n[i] > max_kv)
            return kvb_err_set(err, KVB_ERR_INVALID, "call %u: %u queries at %u exceed %u x %u", i, n[i], pos0[i], max_q,
                               max_kv);
    const size_t row = (size_t)H * c->head_dim * 2;
    dbufs b = {{0}, 0};
    void *dq, *dout, *dpool, *dtab;
    kvb_cudnn_attn *dnn = NULL;
    if ((st = dput(&b, &dq, NULL, max_q * row, err)) || (st = dput(&b, &dout, NULL, max_q * row, err)) ||
        (st = dput(&b, &dpool, c->pool, cache_block_bytes(c) * c->n_pool_blocks, err)) ||
        (st = dput(&b, &dtab, c->blocks, (size_t)c->n_table * 4, err)) ||
        (st = kvb_cudnn_attn_create(0, (int)c->n_head_kv, (int)c->head_dim, max_q, max_kv, &dnn, NULL, err)))
        goto done;
    if (kvb_cu_attention_init() != cudaSuccess) {
        st = kvb_err_set(err, KVB_ERR_INTERNAL, "kvb_cu_attention_init failed");
        goto done;
    }
    for (uint32_t i = 0; i < calls && !st; i++) {
        if (cudaMemcpy(dq, q[i], n[i] * row, cudaMemcpyHostToDevice) != cudaSuccess) {
            st = kvb_err_set(err, KVB_ERR_INTERNAL, "cuDNN sequence test: upload failed");
            break;
        }
        kvb_cu_attn_args aa = {dq, dout,
                               {dpool, cache_block_bytes(c), dtab, bts, (int)c->n_head_kv, (int)c->head_dim},
                               (int)layer, (int)H, (int)c->n_head_kv, (int)c->head_dim, (int)n[i], (int)pos0[i], 0, 0};
        took[i] = kvb_cudnn_attn_take(dnn, (int)H, (int)n[i], (int)pos0[i], (int)layers[i]);
        if (took[i]) st = kvb_cudnn_attn_run(dnn, &aa, err);
        else if (kvb_cu_attention(&aa, 0, 0) != cudaSuccess) st = kvb_err_set(err, KVB_ERR_INTERNAL, "kvb_cu_attention failed");
        if (!st) st = fetch(cudaSuccess, "attention", out[i], dout, n[i] * row, err);
    }
    *plans = kvb_cudnn_attn_plans_built(dnn);
done:
    kvb_cudnn_attn_free(dnn);
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_gather_kv(const kvb_cuda_test_cache *c, uint32_t layer, uint32_t n_pos, uint16_t *k_out,
                                   uint16_t *v_out, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    const int bts = shift_of(c->block_tokens);
    if (bts < 0) return kvb_err_set(err, KVB_ERR_INVALID, "block_tokens must be a power of two");
    const size_t pool_bytes = cache_block_bytes(c) * c->n_pool_blocks, ob = (size_t)c->n_head_kv * n_pos * c->head_dim * 2;
    dbufs b = {{0}, 0};
    void *dk, *dv, *dpool, *dtab;
    if ((st = dput(&b, &dk, k_out, ob, err)) || (st = dput(&b, &dv, v_out, ob, err)) ||
        (st = dput(&b, &dpool, c->pool, pool_bytes, err)) || (st = dput(&b, &dtab, c->blocks, (size_t)c->n_table * 4, err)))
        goto done;
    {
        const kvb_cu_cache cc = {dpool, cache_block_bytes(c), dtab, bts, (int)c->n_head_kv, (int)c->head_dim};
        if (!(st = fetch(kvb_cu_gather_kv(&cc, (int)layer, (int)n_pos, dk, dv, 0), "kvb_cu_gather_kv", k_out, dk, ob,
                         err)) &&
            cudaMemcpy(v_out, dv, ob, cudaMemcpyDeviceToHost) != cudaSuccess)
            st = kvb_err_set(err, KVB_ERR_INTERNAL, "kvb_cu_gather_kv: copy back failed");
    }
done:
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_expand_bf16(uint32_t type, const void *src, size_t src_row_bytes, uint32_t rows,
                                     uint32_t cols, uint16_t *out, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    const size_t ob = (size_t)rows * cols * 2;
    dbufs b = {{0}, 0};
    void *dsrc, *dout;
    if (!(st = dput(&b, &dsrc, src, (size_t)rows * src_row_bytes, err)) && !(st = dput(&b, &dout, out, ob, err)))
        st = fetch(kvb_cu_expand_bf16(type, dsrc, src_row_bytes, rows, cols, dout, 0), "kvb_cu_expand_bf16", out, dout,
                   ob, err);
    dbufs_free(&b);
    return st;
}

/* ---- mixtures of experts (moe.cu, moe_ffn.c) ------------------------------------------------ */

kvb_status kvb_cuda_test_moe_route(float *logits, uint32_t n, uint32_t X, uint32_t K, bool norm, int32_t *sel,
                                   float *w, kvb_err *err) {
    const kvb_moe_route_cfg cfg = {1, norm ? 1 : 0, 0.0f, 0, 0};
    return kvb_cuda_test_moe_route_cfg(logits, NULL, n, X, K, &cfg, sel, w, err);
}

kvb_status kvb_cuda_test_moe_route_cfg(float *logits, const float *bias, uint32_t n, uint32_t X, uint32_t K,
                                       const kvb_moe_route_cfg *cfg, int32_t *sel, float *w, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    dbufs b = {{0}, 0};
    void *dl, *ds, *dw, *dsc, *db = NULL;
    const size_t lb = (size_t)n * X * 4, kb = (size_t)n * K * 4;
    if ((st = dput(&b, &dl, logits, lb, err)) || (st = dput(&b, &ds, sel, kb, err)) ||
        (st = dput(&b, &dw, w, kb, err)) || (st = dput(&b, &dsc, NULL, lb, err)) ||
        (bias && (st = dput(&b, &db, bias, (size_t)X * 4, err))))
        goto done;
    if ((st = fetch(kvb_cu_moe_route_cfg(dl, dsc, db, (int)n, (int)X, (int)K, cfg, ds, dw, 0), "kvb_cu_moe_route",
                    logits, dl, lb, err)) ||
        (st = fetch(cudaSuccess, "kvb_cu_moe_route", sel, ds, kb, err)))
        goto done;
    st = fetch(cudaSuccess, "kvb_cu_moe_route", w, dw, kb, err);
done:
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_moe_permute(const int32_t *sel, uint32_t n, uint32_t K, uint32_t X, const uint16_t *h,
                                     uint32_t E, int32_t *off, int32_t *slot, int32_t *inv, uint16_t *xp, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    dbufs b = {{0}, 0};
    void *dsel, *dh, *dcnt, *doff, *dslot, *dinv, *dxp;
    const size_t sb = (size_t)n * K * 4;
    if ((st = dput(&b, &dsel, sel, sb, err)) || (st = dput(&b, &dh, h, (size_t)n * E * 2, err)) ||
        (st = dput(&b, &dcnt, NULL, (size_t)X * 4, err)) || (st = dput(&b, &doff, off, ((size_t)X + 1) * 4, err)) ||
        (st = dput(&b, &dslot, slot, sb, err)) || (st = dput(&b, &dinv, inv, sb, err)) ||
        (st = dput(&b, &dxp, xp, sb * E / 2, err)))
        goto done;
    cudaError_t ce = kvb_cu_moe_permute(dsel, (int)n, (int)K, (int)X, dcnt, doff, dslot, dinv, 0);
    if (ce == cudaSuccess) ce = kvb_cu_moe_gather(dh, dslot, (int)(n * K), (int)K, (int)E, dxp, 0);
    if ((st = fetch(ce, "kvb_cu_moe_permute/gather", off, doff, ((size_t)X + 1) * 4, err)) ||
        (st = fetch(cudaSuccess, "kvb_cu_moe_permute", slot, dslot, sb, err)) ||
        (st = fetch(cudaSuccess, "kvb_cu_moe_permute", inv, dinv, sb, err)))
        goto done;
    st = fetch(cudaSuccess, "kvb_cu_moe_gather", xp, dxp, sb * E / 2, err);
done:
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_moe_unpermute(const void *y, bool y_bf16, const int32_t *inv, const float *w, uint32_t n,
                                       uint32_t K, uint32_t E, float *x, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    dbufs b = {{0}, 0};
    void *dy, *dinv, *dw, *dx;
    const size_t kb = (size_t)n * K * 4;
    if ((st = dput(&b, &dy, y, (size_t)n * K * E * (y_bf16 ? 2 : 4), err)) || (st = dput(&b, &dinv, inv, kb, err)) ||
        (st = dput(&b, &dw, w, kb, err)) || (st = dput(&b, &dx, x, (size_t)n * E * 4, err)))
        goto done;
    st = fetch(kvb_cu_moe_unpermute(dy, y_bf16 ? 1 : 0, dinv, dw, (int)n, (int)K, (int)E, dx, 0), "kvb_cu_moe_unpermute",
               x, dx, (size_t)n * E * 4, err);
done:
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_moe_ffn(const kvb_cuda_test_moe_w *w, const uint16_t *h, uint32_t n, bool grouped, float *x,
                                 int32_t *sel, float *wts, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    const size_t X = w->X, K = w->K, F = w->F, E = w->E;
    dbufs b = {{0}, 0};
    void *dr, *dgu, *ddown, *dh, *dx;
    cublasHandle_t hd = NULL;
    kvb_cu_moe_scratch s = {0};
    if ((st = dput(&b, &dr, w->router, X * E * 2, err)) || (st = dput(&b, &dgu, w->gu, X * 2 * F * E * 2, err)) ||
        (st = dput(&b, &ddown, w->down, X * E * F * 2, err)) || (st = dput(&b, &dh, h, (size_t)n * E * 2, err)) ||
        (st = dput(&b, &dx, x, (size_t)n * E * 4, err)))
        goto done;
    if ((st = kvb_cu_moe_scratch_alloc(&s, (int)n, (int)X, (int)K, (int)F, (int)E, NULL, err))) goto done;
    cublasStatus_t cs = cublasCreate(&hd);
    if (cs != CUBLAS_STATUS_SUCCESS) {
        hd = NULL;
        st = kvb_cublas_fail(err, cs, "cublasCreate", __FILE__, __LINE__);
        goto done;
    }
    const kvb_cu_moe_weights mw = {dr, dgu, ddown, NULL};
    const kvb_moe_route_cfg route = {1, w->norm ? 1 : 0, 0.0f, 0, 0};
    if ((st = kvb_cu_moe_ffn(hd, 0, &mw, &route, dh, (int)n, dx, &s, grouped ? KVB_CU_MOE_GROUPED : KVB_CU_MOE_LOOP,
                             err)) ||
        (st = fetch(cudaSuccess, "kvb_cu_moe_ffn", x, dx, (size_t)n * E * 4, err)) ||
        (st = fetch(cudaSuccess, "kvb_cu_moe_ffn", sel, s.sel, (size_t)n * K * 4, err)))
        goto done;
    st = fetch(cudaSuccess, "kvb_cu_moe_ffn", wts, s.w, (size_t)n * K * 4, err);
done:
    if (hd) cublasDestroy(hd);
    cudaDeviceSynchronize();
    kvb_cu_moe_scratch_free(&s);
    dbufs_free(&b);
    return st;
}

/* ---- latent attention (mla.cu) ------------------------------------------------------------ */

static kvb_cu_mla_cache mla_cache_of(const kvb_cuda_test_mla_cache *c, void *pool, void *blocks) {
    int shift = 0;
    while ((1u << shift) < c->block_tokens) shift++;
    const kvb_cu_mla_cache mc = {pool, (size_t)c->n_layer * c->block_tokens * (c->R + c->P) * 2, blocks, shift,
                                 (int)c->R, (int)c->P};
    return mc;
}

kvb_status kvb_cuda_test_mla_kv_store(const float *c, const uint16_t *lat, uint32_t n, uint32_t pos0,
                                      const float *rope_cos, const float *rope_sin, uint32_t layer,
                                      kvb_cuda_test_mla_cache *cache, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    const size_t RP = (size_t)cache->R + cache->P, half = cache->P / 2;
    dbufs b = {{0}, 0};
    void *dc, *dlat, *dcos, *dsin, *dpool, *dblk;
    const kvb_cu_mla_cache probe = mla_cache_of(cache, NULL, NULL);
    const size_t pool_bytes = probe.block_bytes * cache->n_pool_blocks;
    if ((st = dput(&b, &dc, c, (size_t)n * RP * 4, err)) || (st = dput(&b, &dlat, lat, (size_t)n * RP * 2, err)) ||
        (st = dput(&b, &dcos, rope_cos, (pos0 + n) * half * 4, err)) ||
        (st = dput(&b, &dsin, rope_sin, (pos0 + n) * half * 4, err)) ||
        (st = dput(&b, &dpool, cache->pool, pool_bytes, err)) ||
        (st = dput(&b, &dblk, cache->blocks, (size_t)cache->n_table * 4, err)))
        goto done;
    const kvb_cu_mla_cache mc = mla_cache_of(cache, dpool, dblk);
    st = fetch(kvb_cu_mla_kv_store(dc, dlat, (int)n, (int)pos0, dcos, dsin, mc, (int)layer, 0), "kvb_cu_mla_kv_store",
               cache->pool, dpool, pool_bytes, err);
done:
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_mla_q_rope(const float *q, uint32_t n, uint32_t H, uint32_t N, uint32_t P, uint32_t pos0,
                                    const float *rope_cos, const float *rope_sin, uint16_t *out, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    const size_t K = (size_t)N + P, half = P / 2;
    dbufs b = {{0}, 0};
    void *dq, *dcos, *dsin, *dout;
    if ((st = dput(&b, &dq, q, (size_t)n * H * K * 4, err)) ||
        (st = dput(&b, &dcos, rope_cos, (pos0 + n) * half * 4, err)) ||
        (st = dput(&b, &dsin, rope_sin, (pos0 + n) * half * 4, err)) ||
        (st = dput(&b, &dout, out, (size_t)n * H * K * 2, err)))
        goto done;
    st = fetch(kvb_cu_mla_q_rope(dq, (int)n, (int)H, (int)N, (int)P, (int)pos0, dcos, dsin, dout, 0),
               "kvb_cu_mla_q_rope", out, dout, (size_t)n * H * K * 2, err);
done:
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_mla_expand(const kvb_cuda_test_mla_cache *cache, uint32_t layer, uint32_t n_pos,
                                    const uint16_t *up, uint32_t H, uint32_t N, uint32_t Vd, uint16_t *lat,
                                    uint16_t *k_out, uint16_t *v_out, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    const size_t RP = (size_t)cache->R + cache->P, D = (size_t)N + cache->P, bt = cache->block_tokens;
    const size_t n_blk = (n_pos + bt - 1) / bt, kv_block = 2 * (size_t)H * bt * D * 2;
    dbufs b = {{0}, 0};
    void *dpool, *dblk, *dup, *dlat, *dkv, *dident, *dk, *dv;
    int32_t *ident = malloc(n_blk * 4);
    if (!ident) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n_blk; i++) ident[i] = (int32_t)i;
    const kvb_cu_mla_cache probe = mla_cache_of(cache, NULL, NULL);
    if ((st = dput(&b, &dpool, cache->pool, probe.block_bytes * cache->n_pool_blocks, err)) ||
        (st = dput(&b, &dblk, cache->blocks, (size_t)cache->n_table * 4, err)) ||
        (st = dput(&b, &dup, up, (size_t)n_pos * H * (N + Vd) * 2, err)) ||
        (st = dput(&b, &dlat, lat, (size_t)n_pos * RP * 2, err)) ||
        (st = dput(&b, &dkv, NULL, n_blk * kv_block, err)) || (st = dput(&b, &dident, ident, n_blk * 4, err)) ||
        (st = dput(&b, &dk, k_out, (size_t)H * n_pos * D * 2, err)) ||
        (st = dput(&b, &dv, v_out, (size_t)H * n_pos * D * 2, err)))
        goto done;
    int shift = 0;
    while ((1u << shift) < bt) shift++;
    const kvb_cu_cache kv = {dkv, kv_block, dident, shift, (int)H, (int)D};
    cudaError_t ce = cudaMemset(dkv, 0xFF, n_blk * kv_block); /* poison: every element left out shows */
    if (ce == cudaSuccess) ce = kvb_cu_mla_gather(mla_cache_of(cache, dpool, dblk), (int)layer, (int)n_pos, dlat, 0);
    if (ce == cudaSuccess)
        ce = kvb_cu_mla_assemble(dup, dlat, (int)n_pos, (int)H, (int)N, (int)Vd, (int)cache->R, (int)cache->P, kv, 0);
    if (ce == cudaSuccess) ce = kvb_cu_gather_kv(&kv, 0, (int)n_pos, dk, dv, 0);
    if ((st = fetch(ce, "kvb_cu_mla_gather/assemble", lat, dlat, (size_t)n_pos * RP * 2, err)) ||
        (st = fetch(cudaSuccess, "kvb_cu_gather_kv", k_out, dk, (size_t)H * n_pos * D * 2, err)))
        goto done;
    st = fetch(cudaSuccess, "kvb_cu_gather_kv", v_out, dv, (size_t)H * n_pos * D * 2, err);
done:
    free(ident);
    dbufs_free(&b);
    return st;
}

kvb_status kvb_cuda_test_mla_layer(const kvb_model *m, uint32_t layer, const uint16_t *h, uint32_t n, uint32_t chunk,
                                   float *x, uint16_t *rows, kvb_err *err) {
    kvb_status st = need_device(err);
    if (st) return st;
    const kvb_model_desc *d = &m->d;
    if (!d->mla || layer >= d->n_layer || !n || !chunk)
        return kvb_err_set(err, KVB_ERR_INVALID, "kvb_cuda_test_mla_layer: a latent attention layer and tokens");
    const uint32_t E = d->n_embd, RP = d->n_lora_kv + d->n_rot, half = d->n_rot / 2, bt = 16;
    const uint32_t n_blk = (n + bt - 1) / bt;
    dbufs b = {{0}, 0};
    kvb_cu_mla_weights mw = {0};
    kvb_cu_mla_scratch s = {0};
    kvb_rope_tables rt = {0};
    cublasHandle_t hd = NULL;
    void *dh, *dx, *dcos, *dsin, *dpool, *dblk;
    int32_t *ident = malloc(sizeof(int32_t) * n_blk);
    if (!ident) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    for (uint32_t i = 0; i < n_blk; i++) ident[i] = (int32_t)i;
    const size_t block_bytes = (size_t)d->n_layer * bt * RP * 2;
    if ((st = kvb_rope_tables_init(&rt, m, n, err))) goto done;
    kvb_rope_tables_fill(&rt, 0, n);
    const float *cs, *sn;
    kvb_rope_tables_layer(&rt, layer, &cs, &sn);
    if ((st = dput(&b, &dh, h, (size_t)n * E * 2, err)) || (st = dput(&b, &dx, x, (size_t)n * E * 4, err)) ||
        (st = dput(&b, &dcos, cs, (size_t)n * half * 4, err)) ||
        (st = dput(&b, &dsin, sn, (size_t)n * half * 4, err)) ||
        (st = dput(&b, &dpool, NULL, block_bytes * n_blk, err)) ||
        (st = dput(&b, &dblk, ident, (size_t)n_blk * 4, err)))
        goto done;
    cudaError_t ie = kvb_cu_attention_init(); /* the tensor-core kernel's shared memory, as the engine sets it */
    if (ie != cudaSuccess) {
        st = kvb_cu_fail(err, ie, "kvb_cu_attention_init", __FILE__, __LINE__);
        goto done;
    }
    if ((st = kvb_cu_mla_weights_upload(d, &m->layers[layer], NULL, &mw, NULL, err)) ||
        (st = kvb_cu_mla_scratch_alloc(&s, d, (int)chunk, (int)n, (int)bt, NULL, err)))
        goto done;
    cublasStatus_t cst = cublasCreate(&hd);
    if (cst != CUBLAS_STATUS_SUCCESS) {
        hd = NULL;
        st = kvb_cublas_fail(err, cst, "cublasCreate", __FILE__, __LINE__);
        goto done;
    }
    const kvb_cu_mla_cache mc = {dpool, block_bytes, dblk, 4, (int)d->n_lora_kv, (int)d->n_rot};
    for (uint32_t c0 = 0; c0 < n && !st; c0 += chunk) {
        const uint32_t c = n - c0 < chunk ? n - c0 : chunk;
        const uint16_t *hc = (const uint16_t *)dh + (size_t)c0 * E;
        if (!(st = kvb_cu_mla_cache_rows(hd, 0, d, &mw, hc, (int)c, (int)c0, dcos, dsin, mc, (int)layer, &s, err)))
            st = kvb_cu_mla_attend(hd, 0, d, &mw, hc, (int)c, (int)c0, dcos, dsin, mc, (int)layer, false,
                                   (float *)dx + (size_t)c0 * E, &s, err);
    }
    if (st) goto done;
    if ((st = fetch(kvb_cu_mla_gather(mc, (int)layer, (int)n, s.lat, 0), "kvb_cu_mla_gather", rows, s.lat,
                    (size_t)n * RP * 2, err)))
        goto done;
    st = fetch(cudaSuccess, "kvb_cu_mla_attend", x, dx, (size_t)n * E * 4, err);
done:
    if (hd) cublasDestroy(hd);
    cudaDeviceSynchronize();
    kvb_cu_mla_scratch_free(&s);
    kvb_cu_mla_weights_free(&mw);
    kvb_rope_tables_free(&rt);
    free(ident);
    dbufs_free(&b);
    return st;
}
