/* engine/cuda/bridge_host.c — host side of the CUDA bridge: uploads the decoder's K/V weights
 * once, and per (chunk, layer) copies the attention inputs and the RoPE table (computed on the
 * host, kvb_rope_table) to the device, runs quantise -> project K, V -> post, copies rows back. */
#include <stdlib.h>
#include <string.h>

#include "bridge_kernels.h"
#include "cuda_internal.h"
#include "kvb_bridge_cuda.h"
#include "kvb_quant.h"

typedef struct {
    uint8_t *wk, *wv;          /* raw file bytes (rows, row_bytes) */
    float *bk, *bv, *knorm;    /* or NULL */
} bridge_layer;

struct kvb_bridge_cuda {
    const kvb_model *m;
    uint32_t dtype, max_tokens;
    size_t row_bytes, act_stride;
    bool perturbed;
    double *inv_freq;           /* (n_rot/2) */
    float *h_cos, *h_sin;       /* host (max, n_rot/2) */
    bridge_layer *layers;       /* (n_layer) device */
    float *d_h, *d_k, *d_v, *d_cos, *d_sin;
    uint8_t *d_act, *d_krows, *d_vrows;
};

#define BK(call)                                                                                               \
    do {                                                                                                       \
        int kvb_e_ = (call);                                                                                   \
        if (kvb_e_) return kvb_cu_fail(err, (cudaError_t)kvb_e_, #call, __FILE__, __LINE__);                  \
    } while (0)

static kvb_status upload(void **dst, const void *src, size_t bytes, kvb_err *err) {
    *dst = NULL;
    if (!src) return KVB_OK;
    KVB_CU(cudaMalloc(dst, bytes));
    KVB_CU(cudaMemcpy(*dst, src, bytes, cudaMemcpyHostToDevice));
    return KVB_OK;
}

kvb_status kvb_bridge_cuda_create(const kvb_model *m, uint32_t dtype, uint32_t max_tokens, kvb_bridge_cuda **out,
                                  kvb_err *err) {
    *out = NULL;
    const kvb_model_desc *d = &m->d;
    if (dtype != KVB_TYPE_F32 && dtype != KVB_TYPE_F16 && dtype != KVB_TYPE_BF16 && dtype != KVB_TYPE_Q8_0)
        return kvb_err_set(err, KVB_ERR_INVALID, "cache type %s is not one the bridge writes", kvb_type_name(dtype));
    kvb_bridge_cuda *b = calloc(1, sizeof *b);
    if (!b) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    b->m = m;
    b->dtype = dtype;
    b->max_tokens = max_tokens;
    b->row_bytes = kvb_row_bytes(dtype, d->head_dim);
    const size_t E = d->n_embd, KV = (size_t)d->n_head_kv * d->head_dim, half = d->n_rot / 2;
    const uint32_t at = kvb_act_type(m->layers[0].wk.type);
    b->act_stride = kvb_row_bytes(at == KVB_TYPE_Q8_0 || kvb_act_type(m->layers[0].wv.type) == KVB_TYPE_Q8_0
                                      ? KVB_TYPE_F32 : at, (int64_t)E); /* f32 is the widest activation row */
    kvb_status st = KVB_OK;
    b->inv_freq = malloc(sizeof(double) * half);
    b->h_cos = malloc(sizeof(float) * half * max_tokens);
    b->h_sin = malloc(sizeof(float) * half * max_tokens);
    b->layers = calloc(d->n_layer, sizeof *b->layers);
    if (!b->inv_freq || !b->h_cos || !b->h_sin || !b->layers) {
        st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    kvb_rope_inv_freq(m, b->inv_freq);
    for (uint32_t l = 0; l < d->n_layer && !st; l++) {
        const kvb_layer_weights *w = &m->layers[l];
        bridge_layer *bl = &b->layers[l];
        if (!st) st = upload((void **)&bl->wk, w->wk.data, (size_t)w->wk.rows * w->wk.row_bytes, err);
        if (!st) st = upload((void **)&bl->wv, w->wv.data, (size_t)w->wv.rows * w->wv.row_bytes, err);
        if (!st) st = upload((void **)&bl->bk, w->bk, KV * sizeof(float), err);
        if (!st) st = upload((void **)&bl->bv, w->bv, KV * sizeof(float), err);
        if (!st) st = upload((void **)&bl->knorm, w->k_norm, d->head_dim * sizeof(float), err);
    }
    if (st) goto fail;
#define ALLOC(p, bytes) KVB_CU_GOTO(cudaMalloc((void **)&(p), (bytes)))
    ALLOC(b->d_h, (size_t)max_tokens * E * sizeof(float));
    ALLOC(b->d_k, (size_t)max_tokens * KV * sizeof(float));
    ALLOC(b->d_v, (size_t)max_tokens * KV * sizeof(float));
    ALLOC(b->d_cos, (size_t)max_tokens * half * sizeof(float));
    ALLOC(b->d_sin, (size_t)max_tokens * half * sizeof(float));
    ALLOC(b->d_act, (size_t)max_tokens * b->act_stride);
    ALLOC(b->d_krows, (size_t)max_tokens * d->n_head_kv * b->row_bytes);
    ALLOC(b->d_vrows, (size_t)max_tokens * d->n_head_kv * b->row_bytes);
#undef ALLOC
    *out = b;
    return KVB_OK;
fail:
    kvb_bridge_cuda_free(b);
    return st;
}

void kvb_bridge_cuda_free(kvb_bridge_cuda *b) {
    if (!b) return;
    if (b->layers)
        for (uint32_t l = 0; l < b->m->d.n_layer; l++) {
            cudaFree(b->layers[l].wk);
            cudaFree(b->layers[l].wv);
            cudaFree(b->layers[l].bk);
            cudaFree(b->layers[l].bv);
            cudaFree(b->layers[l].knorm);
        }
    void *dev[] = {b->d_h, b->d_k, b->d_v, b->d_cos, b->d_sin, b->d_act, b->d_krows, b->d_vrows};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
    free(b->layers);
    free(b->inv_freq);
    free(b->h_cos);
    free(b->h_sin);
    free(b);
}

void kvb_bridge_cuda_set_perturbed(kvb_bridge_cuda *b, bool perturbed) { b->perturbed = perturbed; }

/* One projection: quantise (or copy) h for this weight's activation type, then the dots. */
static kvb_status project(kvb_bridge_cuda *b, const kvb_mat *W, const uint8_t *dw, uint32_t n, float *dy, int split,
                          kvb_err *err) {
    const int E = (int)b->m->d.n_embd;
    BK(kvb_bk_quantize_act(b->d_h, b->d_act, b->act_stride, (int)n, E, kvb_act_type(W->type) == KVB_TYPE_Q8_0));
    BK(kvb_bk_project(W->type, dw, W->row_bytes, (int)W->rows, b->d_act, b->act_stride, (int)n, E, dy, split));
    return KVB_OK;
}

kvb_status kvb_bridge_cuda_layer(kvb_bridge_cuda *b, uint32_t layer, uint32_t pos0, uint32_t n, const float *h,
                                 uint8_t *k_rows, uint8_t *v_rows, kvb_err *err) {
    const kvb_model_desc *d = &b->m->d;
    if (layer >= d->n_layer || n == 0 || n > b->max_tokens)
        return kvb_err_set(err, KVB_ERR_INVALID, "bridge call for layer %u with %u tokens is out of range", layer, n);
    const kvb_layer_weights *w = &b->m->layers[layer];
    const bridge_layer *bl = &b->layers[layer];
    const size_t half = d->n_rot / 2;
    kvb_rope_table(b->inv_freq, d->n_rot, pos0, n, b->h_cos, b->h_sin);
    KVB_CU(cudaMemcpy(b->d_h, h, (size_t)n * d->n_embd * sizeof(float), cudaMemcpyHostToDevice));
    KVB_CU(cudaMemcpy(b->d_cos, b->h_cos, (size_t)n * half * sizeof(float), cudaMemcpyHostToDevice));
    KVB_CU(cudaMemcpy(b->d_sin, b->h_sin, (size_t)n * half * sizeof(float), cudaMemcpyHostToDevice));
    /* the perturbation splits at the middle block, like the CPU's */
    int split = b->perturbed ? (int)(w->wk.cols / 2 / 32 * 32) : 0;
    kvb_status st = project(b, &w->wk, bl->wk, n, b->d_k, split, err);
    if (!st) st = project(b, &w->wv, bl->wv, n, b->d_v, 0, err);
    if (st) return st;
    BK(kvb_bk_post(b->d_k, b->d_v, (int)n, (int)d->n_head_kv, (int)d->head_dim, bl->bk, bl->bv, bl->knorm, d->norm_eps,
                   (int)d->n_rot, d->rope_neox, b->d_cos, b->d_sin, b->dtype, b->d_krows, b->d_vrows, b->row_bytes));
    const size_t rows = (size_t)n * d->n_head_kv * b->row_bytes;
    KVB_CU(cudaMemcpy(k_rows, b->d_krows, rows, cudaMemcpyDeviceToHost));
    KVB_CU(cudaMemcpy(v_rows, b->d_vrows, rows, cudaMemcpyDeviceToHost));
    KVB_CU(cudaDeviceSynchronize());
    return KVB_OK;
}
