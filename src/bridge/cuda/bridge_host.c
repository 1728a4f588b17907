/* bridge/cuda/bridge_host.c — host side of the CUDA bridge: uploads the decoder's K/V weights
 * once (and, for Q8_0/Q4_0/Q5_0, unpacks them to int8 rows for the tensor-core projection), and
 * per (chunk, layer) runs quantise -> project K, V -> post and copies the rows back — on the
 * device-input path on a second stream, so the copy overlaps the engine's next kernels. RoPE uses
 * the layer kind's own table (computed on the host, kvb_rope_table, from the inverse frequencies
 * of the layer's kind — gemma3's local layers have their own base — as the CPU's kvb_rope_tables
 * gives kvb_kv_produce); it is computed and uploaded once per (chunk, kind), not per layer: double
 * cos/sin for 8,192 positions take ~5 ms of host time, which on the engine's thread starved the GPU
 * (H200, 1B shape: the prefill node took 0.47 s for a 32K prompt the GPU alone does in 0.28 s).
 * deepseek2 (latent attention) takes the same path with one "KV head" of R + P values: K is the
 * projection through attn_kv_a_mqa, post norms its first R values with attn_kv_a_norm and rotates
 * the last P (pairs), and there is no V (kv_produce.c's mla_produce, step for step). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "bridge_kernels.h"
#include "cuda_internal.h"
#include "kvb_bridge_cuda.h"
#include "kvb_quant.h"

typedef struct {
    kvb_mat wk_m, wv_m;        /* this bridge's rows of the file's K/V weights (its KV heads); deepseek2:
                                * attn_kv_a_mqa (R + P rows) as K, no V (wv_m.rows 0) */
    uint8_t *wk, *wv;          /* raw file bytes (rows, row_bytes); wv NULL without V */
    float *bk, *bv, *knorm;    /* or NULL; deepseek2: knorm is attn_kv_a_norm (R) */
    int8_t *wk_q, *wv_q;       /* tensor-core path: int8 weights in fragment order (bridge_kernels.h), or NULL */
    float *wk_s, *wv_s;        /* their f32 block scales, fragment order */
} bridge_layer;

#define BRIDGE_MAX_SLOTS 8
#define BRIDGE_DEFAULT_SLOTS 2
#define BRIDGE_MAX_RANKS KVB_CUDA_MAX_GPUS

/* One staging slot of the device-input path: rows land here (pinned host memory) and are shipped
 * once its event has fired. */
typedef struct {
    uint8_t *k, *v;      /* (max_tokens, n_head_kv, row_bytes) pinned */
    float *cos, *sin;    /* (max_tokens, n_rot/2) pinned: the RoPE table this slot's copy reads */
    cudaEvent_t done;
    bool made, pending, shipping;
    uint64_t seq;
    uint32_t layer, pos0, n;
    /* tensor parallelism: ranks that have queued their heads' rows for call `seq`, and the last
     * call shipped (or dropped) from this slot; a rank's call c may use it once c - n_slots is */
    uint32_t filled;
    uint64_t shipped_call;
} pinned_slot;

struct kvb_bridge_cuda {
    const kvb_model *m;
    uint32_t dtype, max_tokens;
    /* the KV heads this bridge computes, [h0, h0 + nh) of n_head_kv (all of them but with tensor
     * parallelism); rank r of n_ranks writes them into its leader's (rank 0's) pinned slots */
    uint32_t h0, nh;
    int n_ranks;
    kvb_bridge_cuda *leader;                   /* itself, unless a follower */
    kvb_bridge_cuda *ranks[BRIDGE_MAX_RANKS];  /* the leader's: every rank's bridge */
    uint64_t calls;                            /* tensor parallel: this rank's enqueues since the last reset */
    float *r_cos[BRIDGE_MAX_SLOTS], *r_sin[BRIDGE_MAX_SLOTS]; /* a follower's own RoPE scratch, pinned */
    cudaEvent_t r_done[BRIDGE_MAX_SLOTS];      /* a follower's copy into slot i is done */
    bool r_made;
    size_t row_bytes, act_stride;
    bool perturbed;
    kvb_rope_tables rope;       /* inverse frequencies per kind of layer (no positions: cap 0) */
    kvb_pool *rope_pool;        /* computes the tables (layer_rope_table); NULL: on the calling thread */
    float *h_cos, *h_sin;       /* host (max, n_rot/2) */
    bridge_layer *layers;       /* (n_layer) device */
    float *d_h, *d_k, *d_v;
    float *d_cos[2], *d_sin[2]; /* per kind of layer (kvb_rope_tables_kind): (max_tokens, n_rot/2) ... */
    uint32_t tab_pos0[2], tab_n[2]; /* ... holding positions tab_pos0[k] .. + tab_n[k] - 1 (0: none) */
    uint8_t *d_act;
    int8_t *d_aq;               /* tensor-core path: activations int8 and their f32 scales, in */
    float *d_asc;               /* fragment order (bridge_kernels.h) */
    uint32_t n_slots;           /* staging slots in turn (KVB_BRIDGE_SLOTS, 2 .. BRIDGE_MAX_SLOTS) */
    uint8_t *d_krows[BRIDGE_MAX_SLOTS], *d_vrows[BRIDGE_MAX_SLOTS]; /* (max, n_head_kv, row_bytes), one pair per slot */
    cudaStream_t copy_st;       /* device-input path: rows go down here */
    cudaEvent_t post_ev[BRIDGE_MAX_SLOTS]; /* a slot's rows are ready on the device */
    bool naive;                 /* KVB_BRIDGE_NAIVE=1: one dot per thread (to measure against) */
    pinned_slot slot[BRIDGE_MAX_SLOTS];
    unsigned next_slot;
    uint64_t seq;               /* fill order of the slots */
    size_t pinned_bytes;
    kvb_bridge_rows_ship ship;
    kvb_bridge_rows_sent sent; /* may be NULL: every ship returns with its rows sent */
    void *ship_ctx;
    uint32_t idle_waiters;     /* threads in wait_idle: the shipper hands back the slot it holds */
    /* the shipping thread (absent with KVB_BRIDGE_SYNC_SHIP=1): slots' pending/shipping flags,
     * ship_st and the flags below are guarded by mu */
    bool has_shipper, stop, dropping;
    int device;
    pthread_t shipper;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kvb_status ship_st;         /* the first shipping failure, until a flush/discard reports it */
    kvb_err ship_err;
};

#define BK(call)                                                                                               \
    do {                                                                                                       \
        int kvb_e_ = (call);                                                                                   \
        if (kvb_e_) return kvb_cu_fail(err, (cudaError_t)kvb_e_, #call, __FILE__, __LINE__);                  \
    } while (0)

static bool tensor_core_type(uint32_t t) {
    return t == KVB_TYPE_Q8_0 || t == KVB_TYPE_Q4_0 || t == KVB_TYPE_Q5_0;
}

/* The weight types whose canonical dot the bridge kernels reproduce (bridge.cu's canon_dot). */
static bool bridge_weight_type(uint32_t t) {
    return tensor_core_type(t) || t == KVB_TYPE_F32 || t == KVB_TYPE_F16 || t == KVB_TYPE_BF16;
}

/* The file's blocks (already on the device at raw) -> int8 rows and f32 scales. */
static kvb_status unpack(const kvb_mat *W, const uint8_t *raw, int8_t **q, float **sc, kvb_err *err) {
    const size_t qb = kvb_bk_wq_bytes((size_t)W->rows, (size_t)W->cols);
    const size_t sb = kvb_bk_wsc_count((size_t)W->rows, (size_t)W->cols) * sizeof(float);
    KVB_CU(cudaMalloc((void **)q, qb));
    KVB_CU(cudaMalloc((void **)sc, sb));
    KVB_CU(cudaMemset(*q, 0, qb)); /* the pad rows of the last 8-row tile */
    KVB_CU(cudaMemset(*sc, 0, sb));
    const int e = kvb_bk_unpack_weights(W->type, raw, W->row_bytes, (int)W->rows, (int)W->cols, *q, *sc, NULL);
    if (e) return kvb_cu_fail(err, (cudaError_t)e, "kvb_bk_unpack_weights", __FILE__, __LINE__);
    return KVB_OK;
}

static kvb_status upload(void **dst, const void *src, size_t bytes, kvb_err *err) {
    *dst = NULL;
    if (!src) return KVB_OK;
    KVB_CU(cudaMalloc(dst, bytes));
    KVB_CU(cudaMemcpy(*dst, src, bytes, cudaMemcpyHostToDevice));
    return KVB_OK;
}

/* Layer l's weights that make its K row: attn_k, or deepseek2's attn_kv_a_mqa (latent + rope part). */
static const kvb_mat *k_weights(const kvb_model *m, uint32_t l) {
    return m->d.mla ? &m->layers[l].wkv_a : &m->layers[l].wk;
}

/* Whether the CUDA bridge reproduces m's K/V weights and writes a cache of dtype. */
static kvb_status shard_check(const kvb_model *m, uint32_t dtype, kvb_err *err) {
    for (uint32_t l = 0; l < m->d.n_layer; l++) {
        const kvb_mat *ws[2] = {k_weights(m, l), &m->layers[l].wv};
        for (int i = 0; i < (m->d.mla ? 1 : 2); i++) /* a latent row has no V */
            if (!bridge_weight_type(ws[i]->type))
                return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                                   "layer %u: the CUDA bridge does not reproduce %s K/V weights (it takes F32, F16, "
                                   "BF16, Q8_0, Q4_0 and Q5_0); use the CPU bridge",
                                   l, kvb_type_name(ws[i]->type));
    }
    if (dtype != KVB_TYPE_F32 && dtype != KVB_TYPE_F16 && dtype != KVB_TYPE_BF16 && dtype != KVB_TYPE_Q8_0)
        return kvb_err_set(err, KVB_ERR_INVALID, "cache type %s is not one the bridge writes", kvb_type_name(dtype));
    return KVB_OK;
}

/* b->n_slots: the default, or KVB_BRIDGE_SLOTS (more slots absorb the link's jitter, for pinned
 * memory). */
static kvb_status shard_slots(kvb_bridge_cuda *b, kvb_err *err) {
    b->n_slots = BRIDGE_DEFAULT_SLOTS;
    const char *ns = getenv("KVB_BRIDGE_SLOTS");
    if (ns && *ns) {
        char *end;
        long v = strtol(ns, &end, 10);
        if (*end || v < 2 || v > BRIDGE_MAX_SLOTS)
            return kvb_err_set(err, KVB_ERR_INVALID, "KVB_BRIDGE_SLOTS must be 2..%d, got '%s'", BRIDGE_MAX_SLOTS, ns);
        b->n_slots = (uint32_t)v;
    }
    return KVB_OK;
}

/* Each layer's K/V weight rows of this shard's heads (rows r0 .. r0 + KV), biases and K norm, on
 * the device; then, where tensor cores take the type, the weights unpacked to int8 (*any_i8). */
static kvb_status shard_weights(kvb_bridge_cuda *b, size_t r0, size_t KV, bool *any_i8, kvb_err *err) {
    const kvb_model *m = b->m;
    const kvb_model_desc *d = &m->d;
    kvb_status st = KVB_OK;
    for (uint32_t l = 0; l < d->n_layer && !st; l++) {
        const kvb_layer_weights *w = &m->layers[l];
        const kvb_mat *wk = k_weights(m, l);
        bridge_layer *bl = &b->layers[l];
        bl->wk_m = *wk; /* this bridge's heads: rows r0 .. r0 + KV of each */
        bl->wk_m.data = (const uint8_t *)wk->data + r0 * wk->row_bytes;
        bl->wk_m.rows = (int64_t)KV;
        if (!d->mla) {
            bl->wv_m = w->wv;
            bl->wv_m.data = (const uint8_t *)w->wv.data + r0 * w->wv.row_bytes;
            bl->wv_m.rows = (int64_t)KV;
        }
        if (!KV) continue; /* a rank with no KV head of its own */
        if (!st) st = upload((void **)&bl->wk, bl->wk_m.data, KV * wk->row_bytes, err);
        if (!st && !d->mla) st = upload((void **)&bl->wv, bl->wv_m.data, KV * w->wv.row_bytes, err);
        if (!st) st = upload((void **)&bl->bk, w->bk ? w->bk + r0 : NULL, KV * sizeof(float), err);
        if (!st) st = upload((void **)&bl->bv, w->bv ? w->bv + r0 : NULL, KV * sizeof(float), err);
        if (!st && d->mla) st = upload((void **)&bl->knorm, w->kv_a_norm, d->n_lora_kv * sizeof(float), err);
        else if (!st) st = upload((void **)&bl->knorm, w->k_norm, d->head_dim * sizeof(float), err);
    }
    if (st) return st;
    const char *nv = getenv("KVB_BRIDGE_NAIVE");
    b->naive = nv && *nv && *nv != '0';
    *any_i8 = false;
    for (uint32_t l = 0; l < d->n_layer && !st; l++) {
        bridge_layer *bl = &b->layers[l];
        if (!st && tensor_core_type(bl->wk_m.type) && d->n_embd % 32 == 0 && b->nh) {
            st = unpack(&bl->wk_m, bl->wk, &bl->wk_q, &bl->wk_s, err);
            *any_i8 = true;
        }
        if (!st && bl->wv && tensor_core_type(bl->wv_m.type) && d->n_embd % 32 == 0 && b->nh) {
            st = unpack(&bl->wv_m, bl->wv, &bl->wv_q, &bl->wv_s, err);
            *any_i8 = true;
        }
    }
    return st;
}

/* The device buffers for max_tokens tokens: the int8 activations (any_i8), hidden states, K/V,
 * rope tables, activation rows and each slot's rows. KV: this shard's K/V width. */
static kvb_status shard_buffers(kvb_bridge_cuda *b, size_t KV, bool any_i8, kvb_err *err) {
    const size_t E = b->m->d.n_embd, half = b->m->d.n_rot / 2, max_tokens = b->max_tokens, nh = b->nh;
    if (any_i8) {
        const size_t qb = kvb_bk_aq_bytes(max_tokens, E), sb = kvb_bk_asc_count(max_tokens, E) * sizeof(float);
        KVB_CU((cudaError_t)kvb_bk_project_i8_init()); /* on this bridge's device (an attribute per device) */
        KVB_CU(cudaMalloc((void **)&b->d_aq, qb));
        KVB_CU(cudaMalloc((void **)&b->d_asc, sb));
        KVB_CU(cudaMemset(b->d_aq, 0, qb)); /* the pad tokens of the last 16-token tile: finite */
        KVB_CU(cudaMemset(b->d_asc, 0, sb));
    }
    KVB_CU(cudaMalloc((void **)&b->d_h, max_tokens * E * sizeof(float)));
    KVB_CU(cudaMalloc((void **)&b->d_k, max_tokens * (KV ? KV : 1) * sizeof(float)));
    KVB_CU(cudaMalloc((void **)&b->d_v, max_tokens * (KV ? KV : 1) * sizeof(float)));
    for (uint32_t k = 0; k < b->rope.n_kinds && k < 2; k++) {
        KVB_CU(cudaMalloc((void **)&b->d_cos[k], max_tokens * half * sizeof(float)));
        KVB_CU(cudaMalloc((void **)&b->d_sin[k], max_tokens * half * sizeof(float)));
    }
    KVB_CU(cudaMalloc((void **)&b->d_act, max_tokens * b->act_stride));
    for (uint32_t i = 0; i < b->n_slots; i++) {
        KVB_CU(cudaMalloc((void **)&b->d_krows[i], max_tokens * (nh ? nh : 1) * b->row_bytes));
        KVB_CU(cudaMalloc((void **)&b->d_vrows[i], max_tokens * (nh ? nh : 1) * b->row_bytes));
    }
    KVB_CU(cudaDeviceSynchronize()); /* the unpacking kernels */
    return KVB_OK;
}

/* A bridge for KV heads [h0, h0 + nh) on the current device. */
static kvb_status create_shard(const kvb_model *m, uint32_t dtype, uint32_t max_tokens, uint32_t h0, uint32_t nh,
                               kvb_bridge_cuda **out, kvb_err *err) {
    *out = NULL;
    const kvb_model_desc *d = &m->d;
    kvb_status st = shard_check(m, dtype, err);
    if (st) return st;
    kvb_bridge_cuda *b = calloc(1, sizeof *b);
    if (b) {
        pthread_mutex_init(&b->mu, NULL);
        pthread_cond_init(&b->cv, NULL);
    }
    if (!b) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    b->m = m;
    b->dtype = dtype;
    b->max_tokens = max_tokens;
    b->h0 = h0;
    b->nh = nh;
    b->n_ranks = 1;
    b->leader = b;
    b->ranks[0] = b;
    if ((st = shard_slots(b, err))) {
        kvb_bridge_cuda_free(b);
        return st;
    }
    b->row_bytes = kvb_row_bytes(dtype, d->head_dim);
    const size_t E = d->n_embd, KV = (size_t)nh * d->head_dim, half = d->n_rot / 2, r0 = (size_t)h0 * d->head_dim;
    const uint32_t at = kvb_act_type(k_weights(m, 0)->type);
    b->act_stride = kvb_row_bytes(at == KVB_TYPE_Q8_0 || (!d->mla && kvb_act_type(m->layers[0].wv.type) == KVB_TYPE_Q8_0)
                                      ? KVB_TYPE_F32 : at, (int64_t)E); /* f32 is the widest activation row */
    if ((st = kvb_rope_tables_init(&b->rope, m, 0, err))) {
        free(b);
        return st;
    }
    const int pool_threads = kvb_cpu_count() / 2 < 8 ? kvb_cpu_count() / 2 : 8; /* half the CPUs, at most 8 */
    if (pool_threads > 1 && (st = kvb_pool_create(pool_threads, &b->rope_pool, err))) goto fail;
    b->h_cos = malloc(sizeof(float) * half * max_tokens);
    b->h_sin = malloc(sizeof(float) * half * max_tokens);
    b->layers = calloc(d->n_layer, sizeof *b->layers);
    if (!b->h_cos || !b->h_sin || !b->layers) {
        st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    bool any_i8 = false;
    if ((st = shard_weights(b, r0, KV, &any_i8, err)) || (st = shard_buffers(b, KV, any_i8, err))) goto fail;
    *out = b;
    return KVB_OK;
fail:
    kvb_bridge_cuda_free(b);
    return st;
}

kvb_status kvb_bridge_cuda_create(const kvb_model *m, uint32_t dtype, uint32_t max_tokens, kvb_bridge_cuda **out,
                                  kvb_err *err) {
    return create_shard(m, dtype, max_tokens, 0, m->d.n_head_kv, out, err);
}

static kvb_status alloc_slots(kvb_bridge_cuda *b, kvb_err *err);
static kvb_status alloc_follower(kvb_bridge_cuda *b, kvb_err *err);

kvb_status kvb_bridge_cuda_create_ranks(const kvb_model *m, uint32_t dtype, uint32_t max_tokens, int n_ranks,
                                        const int *devices, kvb_bridge_cuda **out, kvb_err *err) {
    if (n_ranks < 2 || n_ranks > BRIDGE_MAX_RANKS)
        return kvb_err_set(err, KVB_ERR_INVALID, "the CUDA bridge takes 2..%d ranks, got %d", BRIDGE_MAX_RANKS, n_ranks);
    const char *on = getenv("KVB_BRIDGE_SHIPPER");
    if (on && *on == '0')
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "KVB_BRIDGE_SHIPPER=0 (inline shipping) is for one GPU");
    int prev = 0, n_dev = 0, own[BRIDGE_MAX_RANKS];
    KVB_CU(cudaGetDevice(&prev));
    KVB_CU(cudaGetDeviceCount(&n_dev));
    if (!devices) {
        for (int r = 0; r < n_ranks; r++) own[r] = n_dev >= n_ranks ? r : prev;
        devices = own;
    }
    const uint32_t hkv = m->d.n_head_kv;
    kvb_status st = KVB_OK;
    for (int r = 0; r < n_ranks; r++) out[r] = NULL;
    for (int r = 0; r < n_ranks && !st; r++) {
        /* rank r's share of the KV heads; with fewer heads than ranks some ranks have none */
        const uint32_t a = (uint32_t)((uint64_t)r * hkv / (uint32_t)n_ranks);
        const uint32_t z = (uint32_t)((uint64_t)(r + 1) * hkv / (uint32_t)n_ranks);
        cudaError_t ce = cudaSetDevice(devices[r]);
        if (ce != cudaSuccess) st = kvb_cu_fail(err, ce, "cudaSetDevice (a bridge rank)", __FILE__, __LINE__);
        if (!st) st = create_shard(m, dtype, max_tokens, a, z - a, &out[r], err);
        if (st) break;
        out[r]->n_ranks = n_ranks;
        out[r]->leader = out[0];
        out[0]->ranks[r] = out[r];
        st = r == 0 ? alloc_slots(out[r], err) : alloc_follower(out[r], err);
    }
    cudaSetDevice(prev);
    if (st) {
        for (int r = n_ranks; r-- > 0;) {
            if (out[r]) out[r]->n_ranks = 1, out[r]->leader = out[r]; /* freed one by one */
            kvb_bridge_cuda_free(out[r]);
            out[r] = NULL;
        }
    }
    return st;
}

static void stop_shipper(kvb_bridge_cuda *b);

void kvb_bridge_cuda_free(kvb_bridge_cuda *b) {
    if (!b) return;
    if (b->leader != b) return; /* a follower is freed with its leader */
    if (b->n_ranks > 1) {       /* the leader: stop shipping before its followers go */
        kvb_bridge_cuda_discard(b);
        stop_shipper(b);
        for (int r = 1; r < b->n_ranks; r++) {
            kvb_bridge_cuda *f = b->ranks[r];
            if (!f) continue;
            f->leader = f;
            f->n_ranks = 1;
            kvb_bridge_cuda_free(f);
            b->ranks[r] = NULL;
        }
        b->n_ranks = 1;
    }
    for (int i = 0; i < BRIDGE_MAX_SLOTS; i++) { /* a follower's own (none on other bridges) */
        cudaFreeHost(b->r_cos[i]);
        cudaFreeHost(b->r_sin[i]);
        if (b->r_made && (uint32_t)i < b->n_slots) cudaEventDestroy(b->r_done[i]);
    }
    if (b->layers)
        for (uint32_t l = 0; l < b->m->d.n_layer; l++) {
            cudaFree(b->layers[l].wk);
            cudaFree(b->layers[l].wv);
            cudaFree(b->layers[l].bk);
            cudaFree(b->layers[l].bv);
            cudaFree(b->layers[l].knorm);
            cudaFree(b->layers[l].wk_q);
            cudaFree(b->layers[l].wv_q);
            cudaFree(b->layers[l].wk_s);
            cudaFree(b->layers[l].wv_s);
        }
    kvb_bridge_cuda_discard(b);
    stop_shipper(b);
    for (int i = 0; i < BRIDGE_MAX_SLOTS; i++) {
        cudaFreeHost(b->slot[i].k);
        cudaFreeHost(b->slot[i].v);
        cudaFreeHost(b->slot[i].cos);
        cudaFreeHost(b->slot[i].sin);
        if (b->slot[i].made) cudaEventDestroy(b->slot[i].done);
    }
    void *dev[] = {b->d_h,      b->d_k,      b->d_v,   b->d_cos[0], b->d_sin[0],
                   b->d_cos[1], b->d_sin[1], b->d_act, b->d_aq,     b->d_asc};
    for (int i = 0; i < BRIDGE_MAX_SLOTS; i++) {
        cudaFree(b->d_krows[i]);
        cudaFree(b->d_vrows[i]);
    }
    if (b->copy_st) {
        cudaStreamDestroy(b->copy_st);
        for (uint32_t i = 0; i < b->n_slots; i++) cudaEventDestroy(b->post_ev[i]);
    }
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
    free(b->layers);
    kvb_rope_tables_free(&b->rope);
    kvb_pool_destroy(b->rope_pool);
    free(b->h_cos);
    free(b->h_sin);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b);
}

void kvb_bridge_cuda_set_perturbed(kvb_bridge_cuda *b, bool perturbed) { b->perturbed = perturbed; }

/* One projection on the per-thread path, y (n, rows) f32: quantise (or copy) d_h for this weight's
 * activation type and run the per-thread dots (split > 0: the test-only perturbation). */
static kvb_status project_naive(kvb_bridge_cuda *b, const kvb_mat *W, const uint8_t *dw, const float *d_h, uint32_t n,
                                float *dy, int split, cudaStream_t stream, kvb_err *err) {
    const int E = (int)b->m->d.n_embd;
    BK(kvb_bk_quantize_act(d_h, b->d_act, b->act_stride, (int)n, E, kvb_act_type(W->type) == KVB_TYPE_Q8_0, stream));
    BK(kvb_bk_project(W->type, dw, W->row_bytes, (int)W->rows, b->d_act, b->act_stride, (int)n, E, dy, split,
                      stream));
    return KVB_OK;
}

/* A layer's K and V projections of d_h (n, n_embd) into d_k, d_v (n, rows) f32 (K alone when the
 * layer has no V weights: a latent row). On the tensor cores from the unpacked weights where the
 * bridge has them (the activations quantised once for both; K and V in one launch when both go
 * there), else per thread. */
static kvb_status project_kv(kvb_bridge_cuda *b, const bridge_layer *bl, const float *d_h, uint32_t n, int split,
                             cudaStream_t stream, kvb_err *err) {
    const int E = (int)b->m->d.n_embd;
    const bool k_i8 = bl->wk_q && !split && !b->naive, v_i8 = bl->wv_q && !b->naive;
    if (k_i8 || v_i8) BK(kvb_bk_quantize_act_i8(d_h, (int)n, E, b->d_aq, b->d_asc, stream));
    if (k_i8 && v_i8 && bl->wk_m.rows == bl->wv_m.rows) {
        BK(kvb_bk_project_i8(bl->wk_q, bl->wk_s, b->d_k, bl->wv_q, bl->wv_s, b->d_v, (int)bl->wk_m.rows, b->d_aq,
                             b->d_asc, (int)n, E, stream));
        return KVB_OK;
    }
    kvb_status st = KVB_OK;
    if (k_i8)
        BK(kvb_bk_project_i8(bl->wk_q, bl->wk_s, b->d_k, NULL, NULL, NULL, (int)bl->wk_m.rows, b->d_aq, b->d_asc,
                             (int)n, E, stream));
    else st = project_naive(b, &bl->wk_m, bl->wk, d_h, n, b->d_k, split, stream, err);
    if (st || !bl->wv) return st;
    if (v_i8)
        BK(kvb_bk_project_i8(bl->wv_q, bl->wv_s, b->d_v, NULL, NULL, NULL, (int)bl->wv_m.rows, b->d_aq, b->d_asc,
                             (int)n, E, stream));
    else st = project_naive(b, &bl->wv_m, bl->wv, d_h, n, b->d_v, 0, stream, err);
    return st;
}

/* Layer `layer`'s RoPE table for positions pos0 .. pos0+n-1 into cos_t, sin_t (n, n_rot/2) host
 * memory: kvb_rope_table from the inverse frequencies of the layer's kind, the very numbers the CPU
 * engine's and the CPU bridge's kvb_rope_tables_fill hand kvb_kv_produce for that layer (each
 * position is computed by one task, as a whole: the same numbers on any number of threads). On the
 * bridge's rope pool: a chunk of 8,192 positions took ~4 ms on the engine's thread, which the GPU
 * waited for at the start of every chunk after the first (H200, 1B shape: the bridged prefill of
 * a 32K prompt took 35 ms longer than the plain one where its kernels take 23 ms). */
static void layer_rope_table(const kvb_bridge_cuda *b, uint32_t layer, uint32_t pos0, uint32_t n, float *cos_t,
                             float *sin_t) {
    const uint32_t kind = kvb_rope_tables_kind(&b->rope, layer);
    kvb_rope_table_pool(b->rope_pool, b->rope.inv_freq + (size_t)kind * b->rope.half, 2 * b->rope.half, pos0, n,
                        cos_t, sin_t);
    kvb_pool_park(b->rope_pool); /* the helpers sleep until the next chunk: the CPUs are the senders' */
}

/* Makes the device table of `layer`'s kind hold positions pos0 .. pos0+n-1, queued on `stream`:
 * computed into cos_t, sin_t (n, n_rot/2) host memory and copied up only when it holds other
 * positions (the first layer of each kind in a chunk). cos_t/sin_t must stay untouched until the
 * stream has passed the copy (the device-input path hands a free pinned slot's). */
static kvb_status ensure_rope_table(kvb_bridge_cuda *b, uint32_t layer, uint32_t pos0, uint32_t n, float *cos_t,
                                    float *sin_t, cudaStream_t stream, uint32_t *kind_out, kvb_err *err) {
    const uint32_t k = kvb_rope_tables_kind(&b->rope, layer);
    *kind_out = k;
    if (b->tab_n[k] == n && b->tab_pos0[k] == pos0) return KVB_OK; /* n >= 1 (check_call) */
    b->tab_n[k] = 0;
    layer_rope_table(b, layer, pos0, n, cos_t, sin_t);
    const size_t bytes = (size_t)n * (b->m->d.n_rot / 2) * sizeof(float);
    KVB_CU(cudaMemcpyAsync(b->d_cos[k], cos_t, bytes, cudaMemcpyHostToDevice, stream));
    KVB_CU(cudaMemcpyAsync(b->d_sin[k], sin_t, bytes, cudaMemcpyHostToDevice, stream));
    b->tab_pos0[k] = pos0;
    b->tab_n[k] = n;
    return KVB_OK;
}

/* Enqueues one layer's rows of this bridge's KV heads on `stream`: the RoPE table of its kind
 * (ensure_rope_table, with cos_t/sin_t as host scratch), the projections of d_h (n, n_embd) f32
 * device memory, post into device slot `slot` (n, nh, row_bytes). Then the rows go down into
 * their heads' columns of k_rows, v_rows (n, n_head_kv, row_bytes) host memory (deepseek2: the
 * latent rows into k_rows, v_rows untouched): on `stream` when copy_done is NULL, else on the
 * copy stream after the post, recording copy_done there. Nothing waits here. */
static kvb_status enqueue_layer(kvb_bridge_cuda *b, uint32_t layer, uint32_t n, const float *d_h, uint32_t pos0,
                                float *cos_t, float *sin_t, cudaStream_t stream, int slot, uint8_t *k_rows,
                                uint8_t *v_rows, cudaEvent_t copy_done, kvb_err *err) {
    const kvb_model_desc *d = &b->m->d;
    const bridge_layer *bl = &b->layers[layer];
    cudaStream_t cs = copy_done ? b->copy_st : stream;
    if (b->nh) { /* a tensor-parallel rank may have no KV head of its own: then only the event */
        uint32_t kind;
        kvb_status st = ensure_rope_table(b, layer, pos0, n, cos_t, sin_t, stream, &kind, err);
        if (st) return st;
        /* the perturbation splits at the middle block, like the CPU's */
        int split = b->perturbed ? (int)(bl->wk_m.cols / 2 / 32 * 32) : 0;
        if ((st = project_kv(b, bl, d_h, n, split, stream, err))) return st;
        /* deepseek2: the latent c[0:R] normed, c[R:R+P] rotated in pairs (kvb_kv_produce's mla_produce) */
        const int R = (int)d->n_lora_kv, has_v = bl->wv != NULL;
        BK(kvb_bk_post(b->d_k, has_v ? b->d_v : NULL, (int)n, (int)b->nh, (int)d->head_dim, bl->bk, bl->bv, bl->knorm,
                       d->mla ? R : (int)d->head_dim, d->norm_eps, (int)d->n_rot, d->mla ? R : 0,
                       d->mla ? 0 : d->rope_neox, b->d_cos[kind], b->d_sin[kind], b->dtype, b->d_krows[slot],
                       has_v ? b->d_vrows[slot] : NULL, b->row_bytes, 0, stream));
        if (copy_done) { /* the post above is what the copy stream must wait for */
            KVB_CU(cudaEventRecord(b->post_ev[slot], stream));
            KVB_CU(cudaStreamWaitEvent(b->copy_st, b->post_ev[slot], 0));
        }
        const size_t w = (size_t)b->nh * b->row_bytes, off = (size_t)b->h0 * b->row_bytes;
        const size_t pitch = (size_t)d->n_head_kv * b->row_bytes; /* a whole cache row */
        KVB_CU(cudaMemcpy2DAsync(k_rows + off, pitch, b->d_krows[slot], w, w, n, cudaMemcpyDeviceToHost, cs));
        if (has_v)
            KVB_CU(cudaMemcpy2DAsync(v_rows + off, pitch, b->d_vrows[slot], w, w, n, cudaMemcpyDeviceToHost, cs));
    }
    if (copy_done) KVB_CU(cudaEventRecord(copy_done, cs));
    return KVB_OK;
}

static kvb_status check_call(const kvb_bridge_cuda *b, uint32_t layer, uint32_t n, kvb_err *err) {
    if (layer >= b->m->d.n_layer || n == 0 || n > b->max_tokens)
        return kvb_err_set(err, KVB_ERR_INVALID, "bridge call for layer %u with %u tokens is out of range (at most %u)",
                           layer, n, b->max_tokens);
    return KVB_OK;
}

kvb_status kvb_bridge_cuda_layer(kvb_bridge_cuda *b, uint32_t layer, uint32_t pos0, uint32_t n, const float *h,
                                 uint8_t *k_rows, uint8_t *v_rows, kvb_err *err) {
    kvb_status st = check_call(b, layer, n, err);
    if (st) return st;
    KVB_CU(cudaMemcpy(b->d_h, h, (size_t)n * b->m->d.n_embd * sizeof(float), cudaMemcpyHostToDevice));
    kvb_bridge_cuda_discard(b); /* the device slots are shared with the device-input path */
    if ((st = enqueue_layer(b, layer, n, b->d_h, pos0, b->h_cos, b->h_sin, NULL, 0, k_rows, v_rows, NULL, err)))
        return st;
    KVB_CU(cudaDeviceSynchronize());
    return KVB_OK;
}

/* ---- the device-input path: pinned slots used in turn (two; KVB_BRIDGE_SLOTS=N for N) --------
 * A slot is free, pending (its kernels and copy are queued; layer L), or shipping. A shipper thread
 * takes pending slots in the order they were filled, waits for each one's copy, and hands its rows
 * to the ship callback (cut, checksum, staging: milliseconds of host work per (chunk, layer)). The
 * engine's thread only waits when the slot it needs still holds layer L-N. Before the shipper,
 * the engine's thread did that work inside the hook, at the start of each layer, when its stream
 * held little more than the layer's norm and bridge kernels. The GPU then idled for most of it:
 * 0.52 s of 5.55 s on a 128K-token prompt, 1B shape, H200. The shipper is the default since it
 * was measured (H200, 2026-12-03, ladder on the 1B shape with cuDNN attention: bridged time to
 * first token 0.408 / 0.661 / 3.99 s at 8K / 32K / 128K against 0.523 / 0.913 / 5.41 s inline);
 * KVB_BRIDGE_SHIPPER=0 ships inline on the engine's thread instead. */

void kvb_bridge_cuda_set_ship(kvb_bridge_cuda *b, kvb_bridge_rows_ship fn, kvb_bridge_rows_sent sent, void *ctx) {
    b->ship = fn;
    b->sent = sent;
    b->ship_ctx = ctx;
}

/* Waits for a filled slot's rows (every rank's part) and hands them to the ship callback (unless
 * dropping). *ticket: nonzero while the rows are still being sent (see kvb_bridge_rows_ship). */
static kvb_status ship_slot(kvb_bridge_cuda *b, pinned_slot *p, bool drop, uint64_t *ticket, kvb_err *err) {
    *ticket = 0;
    const double t0 = kvb_now_s();
    KVB_CU(cudaEventSynchronize(p->done));
    for (int r = 1; r < b->n_ranks; r++) KVB_CU(cudaEventSynchronize(b->ranks[r]->r_done[p - b->slot]));
    const double t1 = kvb_now_s();
    kvb_trace_span("bridge.rows_wait", t0, t1, p->layer); /* until the GPU's rows are in the pinned slot */
    if (drop || !b->ship) return KVB_OK;
    kvb_status st = b->ship(b->ship_ctx, p->layer, p->pos0, p->n, p->k, p->v, ticket, err);
    if (st || !b->sent) *ticket = 0;
    kvb_trace_span("bridge.ship_rows", t1, kvb_now_s(), p->layer); /* cut and queued (or sent) */
    return st;
}

/* Until a shipped slot's rows have all left (its ticket); 0: nothing to wait for. */
static kvb_status slot_rows_sent(kvb_bridge_cuda *b, const pinned_slot *p, uint64_t ticket, kvb_err *err) {
    if (!ticket) return KVB_OK;
    const double t0 = kvb_now_s();
    kvb_status st = b->sent(b->ship_ctx, ticket, err);
    kvb_trace_span("bridge.rows_sent", t0, kvb_now_s(), p->layer); /* the slot's last slabs left */
    return st;
}

/* The oldest pending slot, or NULL. Caller holds mu. */
static pinned_slot *oldest_pending(kvb_bridge_cuda *b) {
    pinned_slot *o = NULL;
    for (uint32_t i = 0; i < b->n_slots; i++)
        if (b->slot[i].pending && !b->slot[i].shipping && (!o || b->slot[i].seq < o->seq)) o = &b->slot[i];
    return o;
}

/* A shipped slot is free for the engine again; st: how its shipping went. Caller holds mu. */
static void slot_free_locked(kvb_bridge_cuda *b, pinned_slot *p, kvb_status st, const kvb_err *e) {
    if (st && !b->ship_st) {
        b->ship_st = st;
        b->ship_err = *e;
    }
    p->shipping = p->pending = false;
    p->shipped_call = p->seq;
    pthread_cond_broadcast(&b->cv);
}

/* Takes pending slots in fill order and ships each. A slot whose rows are still being sent is held
 * (it stays pending) until the next slot's rows were handed over behind them, or until someone
 * waits for the bridge to go idle, or it stops: then it waits for its rows to leave and frees it. */
static void *shipper_main(void *arg) {
    kvb_bridge_cuda *b = arg;
    cudaError_t dev_e = cudaSetDevice(b->device);
    pthread_mutex_lock(&b->mu);
    if (dev_e != cudaSuccess) { /* nothing can be shipped from here: fail the request, drop its rows */
        b->ship_st = KVB_ERR_INTERNAL;
        kvb_err_set(&b->ship_err, KVB_ERR_INTERNAL, "CUDA bridge shipping thread: cudaSetDevice(%d): %s", b->device,
                    cudaGetErrorString(dev_e));
    }
    pinned_slot *held = NULL; /* shipped, its rows still leaving */
    uint64_t held_ticket = 0;
    for (;;) {
        pinned_slot *p;
        while (!(p = oldest_pending(b)) && !b->stop && !(held && b->idle_waiters)) pthread_cond_wait(&b->cv, &b->mu);
        if (!p && !held) break; /* stopping with nothing pending */
        kvb_status st = KVB_OK;
        kvb_err e = {0};
        uint64_t ticket = 0;
        if (p) {
            p->shipping = true;
            const bool drop = b->dropping || b->ship_st != KVB_OK; /* after a failure nothing more is sent */
            pthread_mutex_unlock(&b->mu);
            st = ship_slot(b, p, drop, &ticket, &e);
            pthread_mutex_lock(&b->mu);
        }
        if (held) { /* p's rows (if any) are queued behind its: wait for them to leave, hand it back */
            kvb_err he = {0};
            pthread_mutex_unlock(&b->mu);
            const kvb_status hs = slot_rows_sent(b, held, held_ticket, &he);
            pthread_mutex_lock(&b->mu);
            slot_free_locked(b, held, hs, &he);
            held = NULL;
        }
        if (p && !st && ticket) {
            held = p;
            held_ticket = ticket;
        } else if (p) {
            slot_free_locked(b, p, st, &e);
        }
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static kvb_status alloc_slots(kvb_bridge_cuda *b, kvb_err *err) {
    const kvb_model_desc *d = &b->m->d;
    const size_t rows = (size_t)b->max_tokens * d->n_head_kv * b->row_bytes, tab = (size_t)b->max_tokens * (d->n_rot / 2);
    /* portable: with tensor parallelism every rank's device copies into them */
    for (uint32_t i = 0; i < b->n_slots; i++) {
        pinned_slot *p = &b->slot[i];
        KVB_CU(cudaHostAlloc((void **)&p->k, rows, cudaHostAllocPortable));
        KVB_CU(cudaHostAlloc((void **)&p->v, rows, cudaHostAllocPortable));
        KVB_CU(cudaHostAlloc((void **)&p->cos, tab * sizeof(float), cudaHostAllocDefault));
        KVB_CU(cudaHostAlloc((void **)&p->sin, tab * sizeof(float), cudaHostAllocDefault));
        KVB_CU(cudaEventCreateWithFlags(&p->done, cudaEventDisableTiming));
        p->made = true;
    }
    KVB_CU(cudaStreamCreateWithFlags(&b->copy_st, cudaStreamNonBlocking));
    for (uint32_t i = 0; i < b->n_slots; i++)
        KVB_CU(cudaEventCreateWithFlags(&b->post_ev[i], cudaEventDisableTiming));
    b->pinned_bytes = b->n_slots * (2 * rows + 2 * tab * sizeof(float));
    const char *on = getenv("KVB_BRIDGE_SHIPPER"); /* default: on; "0" ships inline */
    if (!on || !*on || *on != '0') {
        KVB_CU(cudaGetDevice(&b->device));
        if (pthread_create(&b->shipper, NULL, shipper_main, b) != 0)
            return kvb_err_set(err, KVB_ERR_INTERNAL, "CUDA bridge: could not start the shipping thread");
        b->has_shipper = true;
    }
    return KVB_OK;
}

/* A follower's own pieces, on its device: its copy stream and events, its RoPE scratch per slot. */
static kvb_status alloc_follower(kvb_bridge_cuda *b, kvb_err *err) {
    const kvb_bridge_cuda *l = b->leader;
    const size_t tab = (size_t)b->max_tokens * (b->m->d.n_rot / 2);
    KVB_CU(cudaStreamCreateWithFlags(&b->copy_st, cudaStreamNonBlocking));
    for (uint32_t i = 0; i < l->n_slots; i++) {
        KVB_CU(cudaEventCreateWithFlags(&b->post_ev[i], cudaEventDisableTiming));
        KVB_CU(cudaHostAlloc((void **)&b->r_cos[i], tab * sizeof(float), cudaHostAllocDefault));
        KVB_CU(cudaHostAlloc((void **)&b->r_sin[i], tab * sizeof(float), cudaHostAllocDefault));
    }
    b->n_slots = l->n_slots;
    for (uint32_t i = 0; i < l->n_slots; i++) KVB_CU(cudaEventCreateWithFlags(&b->r_done[i], cudaEventDisableTiming));
    b->r_made = true;
    return KVB_OK;
}

/* Without a shipper: ships the oldest pending slot on this thread (the old inline path). */
static kvb_status ship_inline(kvb_bridge_cuda *b, bool drop, kvb_err *err) {
    pinned_slot *p = oldest_pending(b);
    if (!p) return KVB_OK;
    p->pending = false;
    uint64_t ticket = 0;
    kvb_status st = ship_slot(b, p, drop, &ticket, err);
    return st ? st : slot_rows_sent(b, p, ticket, err);
}

static bool any_pending(const kvb_bridge_cuda *b) {
    for (uint32_t i = 0; i < b->n_slots; i++)
        if (b->slot[i].pending) return true;
    return false;
}

/* Waits until no slot is pending (all shipped, or dropped when drop); returns the first shipping
 * failure since the last wait, and clears it. */
static kvb_status wait_idle(kvb_bridge_cuda *b, bool drop, kvb_err *err) {
    if (!b->has_shipper) {
        kvb_status st = KVB_OK;
        kvb_err later;
        for (uint32_t i = 0; i < b->n_slots; i++) {
            kvb_status s2 = ship_inline(b, drop || st != KVB_OK, st ? &later : err);
            if (!st) st = s2;
        }
        return st;
    }
    pthread_mutex_lock(&b->mu);
    b->dropping = drop;
    b->idle_waiters++; /* the shipper hands back the slot it holds */
    pthread_cond_broadcast(&b->cv);
    while (any_pending(b)) pthread_cond_wait(&b->cv, &b->mu);
    b->idle_waiters--;
    b->dropping = false;
    kvb_status st = b->ship_st;
    if (st) *err = b->ship_err;
    b->ship_st = KVB_OK;
    if (b->n_ranks > 1 && b->leader == b) { /* between forwards (no rank is enqueueing): the ranks start over in step */
        for (uint32_t i = 0; i < b->n_slots; i++) b->slot[i].filled = 0, b->slot[i].shipped_call = 0;
        for (int r = 0; r < b->n_ranks; r++) b->ranks[r]->calls = 0;
    }
    pthread_mutex_unlock(&b->mu);
    return st;
}

/* Tensor parallelism: a rank's failure fails the call for every rank (until the next flush or
 * discard), so none waits for a part that will not come. */
static void fail_ranks(kvb_bridge_cuda *l, kvb_status st, const kvb_err *err) {
    pthread_mutex_lock(&l->mu);
    if (!l->ship_st) l->ship_st = st, l->ship_err = *err;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

/* Tensor parallelism: rank b's part of the leader's next slot. Each rank's c-th call since the last
 * flush uses slot (c - 1) % n_slots once that slot's call c - n_slots has shipped; the last rank
 * to queue its part makes the slot pending. */
static kvb_status enqueue_rank(kvb_bridge_cuda *b, uint32_t layer, uint32_t pos0, uint32_t n, const float *d_h,
                               cudaStream_t stream, kvb_err *err) {
    kvb_bridge_cuda *l = b->leader;
    const uint32_t idx = (uint32_t)(b->calls % l->n_slots);
    const uint64_t call = ++b->calls;
    pinned_slot *p = &l->slot[idx];
    pthread_mutex_lock(&l->mu);
    while (!l->ship_st && p->shipped_call + l->n_slots < call) pthread_cond_wait(&l->cv, &l->mu);
    kvb_status st = l->ship_st;
    if (st) *err = l->ship_err;
    pthread_mutex_unlock(&l->mu);
    if (st) return st;
    st = enqueue_layer(b, layer, n, d_h, pos0, b == l ? p->cos : b->r_cos[idx], b == l ? p->sin : b->r_sin[idx],
                       stream, (int)idx, p->k, p->v, b == l ? p->done : b->r_done[idx], err);
    if (st) {
        fail_ranks(l, st, err);
        return st;
    }
    pthread_mutex_lock(&l->mu);
    if (++p->filled == (uint32_t)l->n_ranks) {
        p->filled = 0;
        p->pending = true;
        p->seq = call;
        p->layer = layer;
        p->pos0 = pos0;
        p->n = n;
    }
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    return st;
}

kvb_status kvb_bridge_cuda_enqueue(kvb_bridge_cuda *b, uint32_t layer, uint32_t pos0, uint32_t n, const float *d_h,
                                   void *stream, kvb_err *err) {
    kvb_status st = check_call(b, layer, n, err);
    if (st && b->n_ranks > 1) fail_ranks(b->leader, st, err); /* the other ranks must not wait for this one */
    if (st) return st;
    if (b->n_ranks > 1) return enqueue_rank(b, layer, pos0, n, d_h, (cudaStream_t)stream, err);
    if (!b->slot[0].made && (st = alloc_slots(b, err))) return st;
    pinned_slot *p = &b->slot[b->next_slot];
    if (b->has_shipper) {
        pthread_mutex_lock(&b->mu);
        const double t_wait = kvb_now_s();
        while (p->pending && !b->ship_st) pthread_cond_wait(&b->cv, &b->mu); /* normally shipped long ago */
        kvb_trace_span("bridge.slot_wait", t_wait, kvb_now_s(), layer);
        st = b->ship_st;
        if (st) *err = b->ship_err; /* the link failed: stop computing for it */
        pthread_mutex_unlock(&b->mu);
        if (st) return st;
    } else if (p->pending && (st = ship_inline(b, false, err))) {
        return st;
    }
    if ((st = enqueue_layer(b, layer, n, d_h, pos0, p->cos, p->sin, (cudaStream_t)stream, (int)b->next_slot, p->k,
                            p->v, p->done, err)))
        return st;
    if (b->has_shipper) pthread_mutex_lock(&b->mu);
    p->pending = true;
    p->seq = ++b->seq;
    p->layer = layer;
    p->pos0 = pos0;
    p->n = n;
    if (b->has_shipper) {
        pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
    }
    b->next_slot = (b->next_slot + 1) % b->n_slots;
    /* inline: ship the previous layer while the GPU runs this one's bridge kernels */
    return b->has_shipper ? KVB_OK : ship_inline(b, false, err);
}

kvb_status kvb_bridge_cuda_flush(kvb_bridge_cuda *b, kvb_err *err) {
    return wait_idle(b, false, err); /* slabs go out in the order they were computed */
}

void kvb_bridge_cuda_discard(kvb_bridge_cuda *b) {
    kvb_err ignored;
    if (b->leader != b) { /* a follower (its own host path): its tables only */
        b->tab_n[0] = b->tab_n[1] = 0;
        return;
    }
    wait_idle(b, true, &ignored);
    for (int r = 0; r < b->n_ranks; r++) /* after a failed forward, trust no queued table upload */
        b->ranks[r]->tab_n[0] = b->ranks[r]->tab_n[1] = 0;
}

static void stop_shipper(kvb_bridge_cuda *b) {
    if (!b->has_shipper) return;
    pthread_mutex_lock(&b->mu);
    b->stop = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    pthread_join(b->shipper, NULL);
    b->has_shipper = false;
}

size_t kvb_bridge_cuda_pinned_bytes(const kvb_bridge_cuda *b) { return b->pinned_bytes; }
