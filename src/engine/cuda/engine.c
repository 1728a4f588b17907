/* engine/cuda/engine.c — the CUDA engine's host side: device checks, weights converted to bf16 and
 * uploaded (fused Q|K|V and gate|up matrices), the RoPE tables (kvb_rope_table, computed once on
 * the host for every position up to max_ctx: one per kind of layer, so gemma3's local layers
 * rotate with their own base), the GPU block pool with its host bookkeeping (free list,
 * refcounts, chain-key index, LRU of cached blocks nobody holds), sequences, and the forward pass:
 * embed (gemma3: times sqrt(n_embd)), then per chunk of at most max_batch tokens, per layer
 *   rmsnorm -> GEMM Q|K|V (f32) -> qkv_post (bias, q/k-norm, RoPE with the layer's table, q out,
 *   K/V into the cache) -> flash attention over the cache (a sliding window on local layers)
 *   -> GEMM O (x +=, f32; gemma3: to f32, post-attention norm, x +=) -> rmsnorm
 *   -> GEMM gate|up (bf16) -> SwiGLU or GeGLU -> GEMM down (x +=, f32; gemma3: post-MLP norm);
 * then the final norm and the output head for the rows whose logits are wanted. Everything is
 * queued on one stream; the host waits once, when the logits are copied back. */
#include <math.h>
#include <pthread.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "cudnn_attention.h"
#include "kvb_quant.h"
#include "tp_comm.h"
#include "tp_group.h"
#include "kvb_store.h"

#define BLK_NONE UINT32_MAX

kvb_status kvb_cu_fail(kvb_err *err, cudaError_t e, const char *what, const char *file, int line) {
    const char *base = strrchr(file, '/');
    return kvb_err_set(err, e == cudaErrorMemoryAllocation ? KVB_ERR_NOMEM : KVB_ERR_INTERNAL,
                       "CUDA: %s failed: %s (%s) at %s:%d", what, cudaGetErrorName(e), cudaGetErrorString(e),
                       base ? base + 1 : file, line);
}

kvb_status kvb_cublas_fail(kvb_err *err, cublasStatus_t s, const char *what, const char *file, int line) {
    const char *base = strrchr(file, '/');
    return kvb_err_set(err, s == CUBLAS_STATUS_ALLOC_FAILED ? KVB_ERR_NOMEM : KVB_ERR_INTERNAL,
                       "cuBLAS: %s failed: %s at %s:%d", what, cublasGetStatusString(s), base ? base + 1 : file, line);
}

kvb_status kvb_cu_gemm_ldx(cublasHandle_t h, const void *W, int rows, int cols, const void *X, int ldx, int n,
                           float beta, void *Y, bool y_bf16, kvb_err *err) {
    const float alpha = 1.0f;
    cublasStatus_t s = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &alpha, W, CUDA_R_16BF, cols, X,
                                    CUDA_R_16BF, ldx, &beta, Y, y_bf16 ? CUDA_R_16BF : CUDA_R_32F, rows,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) {
        char what[96];
        snprintf(what, sizeof what, "cublasGemmEx(%d x %d x %d)", rows, n, cols);
        return kvb_cublas_fail(err, s, what, __FILE__, __LINE__);
    }
    return KVB_OK;
}

kvb_status kvb_cu_gemm(cublasHandle_t h, const void *W, int rows, int cols, const void *X, int n, float beta, void *Y,
                       bool y_bf16, kvb_err *err) {
    return kvb_cu_gemm_ldx(h, W, rows, cols, X, cols, n, beta, Y, y_bf16, err);
}

bool kvb_cuda_device_available(char *why, size_t cap) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        if (why && cap)
            snprintf(why, cap, "no CUDA device: %s", e != cudaSuccess ? cudaGetErrorString(e) : "none found");
        cudaGetLastError(); /* clear */
        return false;
    }
    if (why && cap) why[0] = 0;
    return true;
}

/* ---- block bookkeeping (host) -------------------------------------------------------------- */

typedef struct {
    uint32_t n;
    uint32_t *free_ids, n_free;
    uint32_t *refs;
    uint8_t *indexed;
    uint64_t *key, *parent;
    uint32_t *prev, *next; /* LRU list of indexed blocks with refs == 0; head = oldest */
    uint32_t lru_head, lru_tail, n_lru;
    uint64_t *ht_key;      /* open addressing, linear probing; ht_val == BLK_NONE marks empty */
    uint32_t *ht_val, ht_mask;
} blockmgr;

static void bm_free(blockmgr *b) {
    free(b->free_ids);
    free(b->refs);
    free(b->indexed);
    free(b->key);
    free(b->parent);
    free(b->prev);
    free(b->next);
    free(b->ht_key);
    free(b->ht_val);
    memset(b, 0, sizeof *b);
}

static kvb_status bm_init(blockmgr *b, uint32_t n, kvb_err *err) {
    memset(b, 0, sizeof *b);
    uint32_t cap = 16;
    while (cap < 2 * (uint64_t)n) cap *= 2;
    b->n = n;
    b->free_ids = malloc(sizeof(uint32_t) * n);
    b->refs = calloc(n, sizeof(uint32_t));
    b->indexed = calloc(n, 1);
    b->key = calloc(n, sizeof(uint64_t));
    b->parent = calloc(n, sizeof(uint64_t));
    b->prev = malloc(sizeof(uint32_t) * n);
    b->next = malloc(sizeof(uint32_t) * n);
    b->ht_key = calloc(cap, sizeof(uint64_t));
    b->ht_val = malloc(sizeof(uint32_t) * cap);
    if (!b->free_ids || !b->refs || !b->indexed || !b->key || !b->parent || !b->prev || !b->next || !b->ht_key ||
        !b->ht_val) {
        bm_free(b);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of host memory for the bookkeeping of %u cache blocks", n);
    }
    for (uint32_t i = 0; i < n; i++) b->free_ids[i] = n - 1 - i;
    b->n_free = n;
    for (uint32_t i = 0; i < cap; i++) b->ht_val[i] = BLK_NONE;
    b->ht_mask = cap - 1;
    b->lru_head = b->lru_tail = BLK_NONE;
    return KVB_OK;
}

static uint32_t ht_home(const blockmgr *b, uint64_t key) { return (uint32_t)(key ^ (key >> 29)) & b->ht_mask; }

static uint32_t ht_find_slot(const blockmgr *b, uint64_t key) {
    for (uint32_t i = ht_home(b, key);; i = (i + 1) & b->ht_mask) {
        if (b->ht_val[i] == BLK_NONE) return BLK_NONE;
        if (b->ht_key[i] == key) return i;
    }
}

static void ht_insert(blockmgr *b, uint64_t key, uint32_t val) {
    uint32_t i = ht_home(b, key);
    while (b->ht_val[i] != BLK_NONE) i = (i + 1) & b->ht_mask;
    b->ht_key[i] = key;
    b->ht_val[i] = val;
}

static void ht_remove(blockmgr *b, uint64_t key) {
    uint32_t i = ht_find_slot(b, key);
    if (i == BLK_NONE) return;
    /* backward-shift deletion keeps every probe chain unbroken */
    for (uint32_t j = (i + 1) & b->ht_mask; b->ht_val[j] != BLK_NONE; j = (j + 1) & b->ht_mask) {
        uint32_t k = ht_home(b, b->ht_key[j]);
        bool move = (i <= j) ? (k <= i || k > j) : (k <= i && k > j);
        if (move) {
            b->ht_key[i] = b->ht_key[j];
            b->ht_val[i] = b->ht_val[j];
            i = j;
        }
    }
    b->ht_val[i] = BLK_NONE;
}

static void lru_unlink(blockmgr *b, uint32_t id) {
    uint32_t p = b->prev[id], n = b->next[id];
    if (p != BLK_NONE) b->next[p] = n;
    else b->lru_head = n;
    if (n != BLK_NONE) b->prev[n] = p;
    else b->lru_tail = p;
    b->n_lru--;
}

static void lru_push(blockmgr *b, uint32_t id) {
    b->prev[id] = b->lru_tail;
    b->next[id] = BLK_NONE;
    if (b->lru_tail != BLK_NONE) b->next[b->lru_tail] = id;
    else b->lru_head = id;
    b->lru_tail = id;
    b->n_lru++;
}

/* Whether n blocks can be had (free, or cached ones nobody holds). */
static kvb_status bm_check(const blockmgr *b, uint32_t n, kvb_err *err) {
    if ((uint64_t)b->n_free + b->n_lru < n)
        return kvb_err_set(err, KVB_ERR_RANGE,
                           "GPU KV cache is full: %u blocks needed, %u free and %u cached blocks can be reused (of "
                           "%u); raise n_blocks or free sequences",
                           n, b->n_free, b->n_lru, b->n);
    return KVB_OK;
}

/* n blocks, all or nothing: free ones first, then the least recently used cached ones. */
static kvb_status bm_alloc(blockmgr *b, uint32_t n, uint32_t *ids, kvb_err *err) {
    kvb_status st = bm_check(b, n, err);
    if (st) return st;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id;
        if (b->n_free) id = b->free_ids[--b->n_free];
        else {
            id = b->lru_head;
            lru_unlink(b, id);
            ht_remove(b, b->key[id]);
            b->indexed[id] = 0;
        }
        b->refs[id] = 1;
        ids[i] = id;
    }
    return KVB_OK;
}

static void bm_release(blockmgr *b, uint32_t id) {
    if (id >= b->n || b->refs[id] == 0) return;
    if (--b->refs[id]) return;
    if (b->indexed[id]) lru_push(b, id);
    else b->free_ids[b->n_free++] = id;
}

static uint32_t bm_lookup(blockmgr *b, uint64_t key, uint64_t parent) {
    uint32_t slot = ht_find_slot(b, key);
    if (slot == BLK_NONE) return BLK_NONE;
    uint32_t id = b->ht_val[slot];
    return b->parent[id] == parent ? id : BLK_NONE;
}

static void bm_retain(blockmgr *b, uint32_t id) {
    if (b->refs[id]++ == 0 && b->indexed[id]) lru_unlink(b, id);
}

/* Indexes a filled block the caller holds; false when the key is already indexed (the caller's
 * block stays private and returns to the free list when released). */
static bool bm_publish(blockmgr *b, uint32_t id, uint64_t key, uint64_t parent) {
    if (b->indexed[id] || ht_find_slot(b, key) != BLK_NONE) return false;
    ht_insert(b, key, id);
    b->indexed[id] = 1;
    b->key[id] = key;
    b->parent[id] = parent;
    return true;
}

/* ---- engine --------------------------------------------------------------------------------- */

/* A matrix slice kept in its file's type on the device (packed weights): rows of row_bytes, each
 * cols elements in the file's block layout. */
typedef struct {
    uint8_t *d;
    uint32_t type;
    size_t row_bytes;
    int64_t rows, cols;
} cu_packed;

/* A layer's matrices as the packed form holds them, and where each expands to in the bf16 set:
 * Q, K, V into qkv, gate and up into gu (a mixture of experts: the whole stacks, each expert's
 * gate and up rows expanded next to each other), the router (MoE only) into router. */
enum { PK_Q, PK_K, PK_V, PK_O, PK_GATE, PK_UP, PK_DOWN, PK_ROUTER, PK_COUNT };

/* One layer's GEMM operands in bf16: qkv (S, E), o (E, Q), gu (2 FF, E), down (E, FF), this
 * rank's shard (bf16_set_alloc); a mixture of experts' layer (kvb_cu_moe_weights' layout): gu (X 2F,
 * E) expert by expert [gate_x; up_x], down (X E, F), router (X, E), empty for a dense layer; its
 * shared expert (deepseek2): sh_gu (2 FS, E) [gate; up], sh_down (E, FS), else empty. A latent
 * attention (deepseek2) layer has no qkv and o: its attention weights are kvb_cu_mla_weights. */
enum { BF_QKV, BF_O, BF_GU, BF_DOWN, BF_ROUTER, BF_SH_GU, BF_SH_DOWN, BF_COUNT };
typedef struct {
    void *m[BF_COUNT];
} cu_bf16_set;

typedef struct {
    cu_bf16_set w;          /* bf16 weights; all NULL when packed */
    cu_packed pk[PK_COUNT]; /* the packed form (packed weights), else all NULL */
    float *attn_norm, *ffn_norm, *b_qkv, *q_norm, *k_norm;
    float *post_attn_norm, *post_ffw_norm; /* gemma3, else NULL */
    uint32_t rope_kind; /* which RoPE table (kvb_rope_tables_kind) */
    int window;         /* local layer: its sliding window; 0 = global */
    kvb_cu_mla_weights mla; /* deepseek2's attention weights, else all NULL */
    float *exp_probs_b;     /* (n_expert) f32 the router's selection bias (DeepSeek-V3), or NULL */
    bool moe;               /* the layer's MLP is its experts (false: the dense MLP, nff wide) */
} cu_layer;

struct kvb_cuda_engine {
    const kvb_model *m;
    kvb_cuda_opts o;
    /* tensor parallelism: a leader (grp set) only dispatches to its ranks; a rank (or the one
     * engine of a one-GPU run) computes its shard: nh heads, nkv KV heads, nff MLP columns */
    bool leader;
    kvb_tp_group *grp;
    kvb_tp_comm *comm; /* a rank's all-reduce (NULL with one GPU) */
    int tp_rank, tp_size;
    uint32_t nh, nkv, nff;
    uint32_t kv_first; /* the first of this rank's KV heads */
    kvb_err hook_err;  /* a rank's first layer-hook error in this forward (tensor parallel) */
    kvb_status hook_st;
    bool group_wants_logits; /* a rank: whether rank 0 was asked for logits in this forward (the
                                ranks skip or run the last layer's attention and MLP together) */
    kvb_kvformat fmt;
    int bt_shift;
    char dev_name[256];
    int n_sm, cc_major, cc_minor;
    size_t dev_total;
    cudaStream_t st;
    cudaStream_t comm_st;        /* tp_overlap: the all-reduces' stream, else NULL */
    cudaEvent_t ev_rows, ev_comm; /* tp_overlap: rows ready for the all-reduce; all-reduces done */
    cublasHandle_t cublas;
    void *cublas_ws;
    /* weights */
    void *tok_embd, *output;
    bool output_shared;
    float *output_norm;
    cu_layer *L;
    bool packed;                      /* matrices packed; each layer's expanded into xw before it runs */
    cu_bf16_set xw;                   /* (packed) the set each layer is expanded into before it runs */
    size_t xw_bytes;
    float *rope_cos[2], *rope_sin[2]; /* per kind of layer (global, local): (max_ctx, n_rot/2) */
    /* cache */
    uint8_t *kv_pool;
    size_t block_bytes;
    blockmgr bm;
    uint64_t chain_root;
    /* activations */
    float *x, *qkv, *logits_d;
    float *o32; /* (max_batch, n_embd) f32 branch output before a post norm (gemma3), or NULL */
    void *h, *q, *att, *gu, *act;
    float *h32; /* (max_batch, n_embd) f32 attention inputs for the layer hook, or NULL */
    int32_t *d_tok;
    uint32_t logit_rows;
    /* accounting */
    size_t weight_bytes, kv_bytes, act_bytes, peak_used;
    uint64_t prefix_hit_tokens;
    /* attention on global layers: cuDNN's when dnn is loaded and o.attention says so */
    kvb_cudnn_attn *dnn;
    char dnn_why[512];   /* why cuDNN is not in use, or the first shape it refused */
    uint64_t dnn_fallbacks; /* calls cuDNN refused (no engine for the shape): run by the engine's kernel */
    /* diagnostics (kvb_cuda_engine_gate_next) */
    int gate_ms;            /* > 0: the next forward is gated */
    volatile int *gate_host; /* host-mapped flag, and its device view */
    int *gate_dev;
    cudaEvent_t gate_ev[2];
    double last_gated_gpu_s;
    double last_forward_s, last_enqueue_s;
    /* mixture of experts (qwen3moe, deepseek2): the MLP's scratch, how its expert GEMMs run, how its
     * router routes */
    bool moe;
    kvb_cu_moe_scratch moe_s;
    kvb_cu_moe_gemm moe_gemm;
    kvb_moe_route_cfg moe_route;
    uint32_t nff_act; /* width of the gu/act buffers: the dense MLP's or the shared expert's, the wider */
    /* latent attention (deepseek2): its scratch */
    bool mla;
    kvb_cu_mla_scratch mla_s;
};

struct kvb_cuda_seq {
    kvb_cuda_engine *e;
    kvb_tp_seq *tps;   /* a leader's sequence: one per rank */
    uint32_t len;
    uint32_t *blocks; /* host block table (cap entries) */
    uint32_t n_blocks, n_dev_blocks, cap;
    int32_t *d_blocks; /* device copy */
    int32_t *tokens;   /* host: every token in the sequence */
    uint32_t tok_cap;
    uint64_t *keys;    /* chain key of each full block */
    uint32_t n_keyed;
};

static kvb_status dev_alloc(kvb_cuda_engine *e, void **p, size_t bytes, size_t *acct, const char *what,
                            kvb_err *err) {
    (void)e;
    *p = NULL;
    if (bytes == 0) bytes = 16;
    cudaError_t ce = cudaMalloc(p, bytes);
    if (ce != cudaSuccess) {
        *p = NULL;
        cudaGetLastError();
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        return kvb_err_set(err, KVB_ERR_NOMEM, "GPU memory: cannot allocate %.3f GiB for %s (%.3f GiB free of %.3f): %s",
                           bytes / 1073741824.0, what, fr / 1073741824.0, tot / 1073741824.0, cudaGetErrorString(ce));
    }
    if (acct) *acct += bytes;
    return KVB_OK;
}

/* ---- weight upload ------------------------------------------------------------------------------ */

typedef struct {
    const kvb_mat *w;
    int64_t r0, c0, nc; /* rows r0 + task, columns c0 .. c0+nc-1 */
    uint16_t *stage;    /* (rows, nc) bf16 */
    float **tmp;        /* per worker (cols floats) */
} conv_job;

static void conv_task(void *ctx, int task, int worker) {
    const conv_job *j = ctx;
    const kvb_mat *w = j->w;
    const int64_t r = j->r0 + task;
    float *t = j->tmp[worker];
    kvb_row_to_f32(w->type, (const uint8_t *)w->data + (size_t)r * w->row_bytes, t, w->cols);
    uint16_t *dst = j->stage + (size_t)task * j->nc;
    for (int64_t i = 0; i < j->nc; i++) dst[i] = kvb_f32_to_bf16(t[j->c0 + i]);
}

typedef struct {
    kvb_pool *pool;
    uint16_t *stage; /* pinned or plain host staging */
    size_t stage_elems;
    float **tmp;
    int n_tmp;
} uploader;

/* Writes rows [row0, row0+nrows) x columns [col0, col0+ncols) of W as bf16 rows of ncols at dst
 * (device); nrows or ncols 0 = all of them (a tensor-parallel rank takes a slice). */
static kvb_status upload_mat(uploader *u, const kvb_mat *w, int64_t row0, int64_t nrows, int64_t col0, int64_t ncols,
                             void *dst, const char *name, kvb_err *err) {
    const kvb_type_info *ti = kvb_type_get(w->type);
    if (!ti || !ti->supported)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: weight type %s cannot be converted for the GPU", name,
                           kvb_type_name(w->type));
    if (!nrows) nrows = w->rows - row0;
    if (!ncols) ncols = w->cols - col0;
    if (row0 < 0 || col0 < 0 || nrows < 0 || ncols < 0 || row0 + nrows > w->rows || col0 + ncols > w->cols)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "%s: slice outside the %lldx%lld matrix", name,
                           (long long)w->rows, (long long)w->cols);
    if (w->type == KVB_TYPE_BF16 && w->row_bytes == (size_t)w->cols * 2 && ncols == w->cols) {
        KVB_CU(cudaMemcpy(dst, (const uint8_t *)w->data + (size_t)row0 * w->row_bytes, (size_t)nrows * w->row_bytes,
                          cudaMemcpyHostToDevice));
        return KVB_OK;
    }
    int64_t rows_per = (int64_t)(u->stage_elems / (size_t)ncols);
    if (rows_per < 1) return kvb_err_set(err, KVB_ERR_INTERNAL, "%s: staging buffer too small", name);
    for (int64_t r0 = 0; r0 < nrows; r0 += rows_per) {
        int64_t nr = nrows - r0 < rows_per ? nrows - r0 : rows_per;
        conv_job j = {w, row0 + r0, col0, ncols, u->stage, u->tmp};
        kvb_pool_parallel_for(u->pool, (int)nr, conv_task, &j);
        KVB_CU(cudaMemcpy((uint16_t *)dst + (size_t)r0 * ncols, u->stage, (size_t)nr * ncols * 2,
                          cudaMemcpyHostToDevice));
    }
    return KVB_OK;
}

/* Elements of each matrix of this rank's cu_bf16_set for `layer`. */
static void bf16_set_elems(const kvb_cuda_engine *e, uint32_t layer, size_t elems[BF_COUNT]) {
    const kvb_model_desc *d = &e->m->d;
    const size_t E = d->n_embd, D = d->head_dim, Q = (size_t)e->nh * D, S = Q + 2 * (size_t)e->nkv * D;
    const size_t FF = e->nff;
    memset(elems, 0, sizeof(size_t) * BF_COUNT);
    if (!e->mla) {
        elems[BF_QKV] = S * E;
        elems[BF_O] = E * Q;
    }
    if (kvb_layer_is_dense(d, layer)) {
        elems[BF_GU] = 2 * FF * E;
        elems[BF_DOWN] = E * FF;
        return;
    }
    const size_t X = d->n_expert, F = d->n_ff_exp, FS = d->n_ff_shexp;
    elems[BF_GU] = X * 2 * F * E;
    elems[BF_DOWN] = X * E * F;
    elems[BF_ROUTER] = X * E;
    elems[BF_SH_GU] = 2 * FS * E;
    elems[BF_SH_DOWN] = E * FS;
}

/* Allocates a cu_bf16_set for `layer` on the device, its bytes added to *acct. */
static kvb_status bf16_set_alloc(kvb_cuda_engine *e, uint32_t layer, cu_bf16_set *w, size_t *acct, const char *what,
                                 kvb_err *err) {
    size_t elems[BF_COUNT];
    bf16_set_elems(e, layer, elems);
    for (int i = 0; i < BF_COUNT; i++) {
        kvb_status st = dev_alloc(e, &w->m[i], elems[i] * 2, acct, what, err);
        if (st) return st;
    }
    return KVB_OK;
}

/* Packed weights: rows [row0, row0+nrows) x columns [col0, col0+ncols) of W copied to the device
 * as they lie in the file (nrows or ncols 0 = all); the columns must be whole blocks. */
static kvb_status upload_packed(kvb_cuda_engine *e, const kvb_mat *w, int64_t row0, int64_t nrows, int64_t col0,
                                int64_t ncols, cu_packed *p, const char *name, kvb_err *err) {
    const kvb_type_info *ti = kvb_type_get(w->type);
    if (!ti || !kvb_cu_expand_type_ok(w->type))
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "%s: weight type %s cannot stay packed on the GPU (F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K, "
                           "Q5_K and Q6_K can); use bf16 weights (--gpu-weights bf16)",
                           name, kvb_type_name(w->type));
    if (!nrows) nrows = w->rows - row0;
    if (!ncols) ncols = w->cols - col0;
    const int64_t be = ti->block_elems;
    if (row0 < 0 || col0 < 0 || nrows < 0 || ncols < 0 || row0 + nrows > w->rows || col0 + ncols > w->cols)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "%s: slice outside the %lldx%lld matrix", name,
                           (long long)w->rows, (long long)w->cols);
    if (ncols % 32 || col0 % be || ncols % be)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "%s: columns %lld..%lld are not whole %s blocks of 32 elements or more; packed weights need "
                           "them (use --gpu-weights bf16)",
                           name, (long long)col0, (long long)(col0 + ncols), ti->name);
    const size_t slice = (size_t)(ncols / be) * (size_t)ti->block_bytes;
    kvb_status st = dev_alloc(e, (void **)&p->d, (size_t)nrows * slice, &e->weight_bytes, name, err);
    if (st) return st;
    const uint8_t *from =
        (const uint8_t *)w->data + (size_t)row0 * w->row_bytes + (size_t)(col0 / be) * ti->block_bytes;
    KVB_CU(cudaMemcpy2D(p->d, slice, from, w->row_bytes, slice, (size_t)nrows, cudaMemcpyHostToDevice));
    *p = (cu_packed){p->d, w->type, slice, nrows, ncols};
    return KVB_OK;
}

/* Packed weights: layer L's matrices expanded into the engine's bf16 set (xw), in stream order. */
static kvb_status expand_layer(kvb_cuda_engine *e, const cu_layer *L, kvb_err *err) {
    void *dst[PK_COUNT];
    const cu_packed *pk = L->pk;
    dst[PK_Q] = e->xw.m[BF_QKV];
    dst[PK_K] = (uint16_t *)dst[PK_Q] + (size_t)pk[PK_Q].rows * pk[PK_Q].cols;
    dst[PK_V] = (uint16_t *)dst[PK_K] + (size_t)pk[PK_K].rows * pk[PK_K].cols;
    dst[PK_O] = e->xw.m[BF_O];
    dst[PK_GATE] = e->xw.m[BF_GU];
    dst[PK_UP] = (uint16_t *)dst[PK_GATE] + (size_t)pk[PK_GATE].rows * pk[PK_GATE].cols;
    dst[PK_DOWN] = e->xw.m[BF_DOWN];
    dst[PK_ROUTER] = e->xw.m[BF_ROUTER];
    for (int i = 0; i < PK_COUNT; i++) {
        if (!pk[i].d || (e->moe && (i == PK_GATE || i == PK_UP))) continue;
        KVB_CU(kvb_cu_expand_bf16(pk[i].type, pk[i].d, pk[i].row_bytes, pk[i].rows, pk[i].cols, dst[i], e->st));
    }
    if (e->moe) { /* expert x's gate rows, then its up rows, at x 2F of gu (kvb_cu_moe_weights) */
        const int64_t X = e->m->d.n_expert, F = e->m->d.n_ff_exp, E = e->m->d.n_embd;
        for (int64_t x = 0; x < X; x++)
            for (int i = PK_GATE; i <= PK_UP; i++)
                KVB_CU(kvb_cu_expand_bf16(pk[i].type, pk[i].d + (size_t)(x * F) * pk[i].row_bytes, pk[i].row_bytes,
                                          F, pk[i].cols,
                                          (uint16_t *)e->xw.m[BF_GU] + (size_t)(x * 2 + (i == PK_UP)) * F * E, e->st));
    }
    return KVB_OK;
}

static kvb_status upload_f32(const float *src, size_t n, float **dst, size_t *acct, const char *what, kvb_err *err) {
    kvb_status st = dev_alloc(NULL, (void **)dst, n * sizeof(float), acct, what, err);
    if (st) return st;
    KVB_CU(cudaMemcpy(*dst, src, n * sizeof(float), cudaMemcpyHostToDevice));
    return KVB_OK;
}

/* A mixture of experts' layer in bf16 (kvb_cu_moe_weights' layout): the router, each expert's gate
 * and up rows next to each other, the down stack as it is (expert x's rows already at x E). */
static kvb_status upload_experts(kvb_cuda_engine *e, uploader *u, const kvb_layer_weights *w, cu_bf16_set *set,
                                 kvb_err *err) {
    const int64_t X = e->m->d.n_expert, F = e->m->d.n_ff_exp, E = e->m->d.n_embd;
    kvb_status st;
    if (w->gate_exps.rows != X * F || w->up_exps.rows != X * F || w->down_exps.rows != X * E ||
        w->ffn_gate_inp.rows != X)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "expert stacks of %lld/%lld/%lld rows for %lld experts",
                           (long long)w->gate_exps.rows, (long long)w->up_exps.rows, (long long)w->down_exps.rows,
                           (long long)X);
    if ((st = upload_mat(u, &w->ffn_gate_inp, 0, 0, 0, 0, set->m[BF_ROUTER], "ffn_gate_inp", err)) ||
        (st = upload_mat(u, &w->down_exps, 0, 0, 0, 0, set->m[BF_DOWN], "ffn_down_exps", err)))
        return st;
    for (int64_t x = 0; x < X; x++) {
        uint16_t *gu = (uint16_t *)set->m[BF_GU] + (size_t)(x * 2 * F * E);
        if ((st = upload_mat(u, &w->gate_exps, x * F, F, 0, 0, gu, "ffn_gate_exps", err)) ||
            (st = upload_mat(u, &w->up_exps, x * F, F, 0, 0, gu + (size_t)(F * E), "ffn_up_exps", err)))
            return st;
    }
    return KVB_OK;
}

static kvb_status upload_weights(kvb_cuda_engine *e, kvb_pool *pool, kvb_err *err) {
    const kvb_model *m = e->m;
    const kvb_model_desc *d = &m->d;
    /* this rank's shard: Q/K/V and gate/up rows from q0/kv0/f0, O and down columns likewise */
    const size_t E = d->n_embd, D = d->head_dim, Q = (size_t)e->nh * D, KV = (size_t)e->nkv * D;
    const size_t FF = e->nff, S = Q + 2 * KV;
    const int64_t q0 = (int64_t)(e->tp_rank * Q), f0 = (int64_t)(e->tp_rank * FF), kv0 = (int64_t)(e->kv_first * D);
    kvb_status st = KVB_OK;
    uploader u = {pool, NULL, (size_t)32 << 20, NULL, kvb_pool_size(pool)};
    size_t max_cols = E > (size_t)d->n_head * D ? E : (size_t)d->n_head * D; /* whole rows are converted */
    if (d->n_ff > max_cols) max_cols = d->n_ff;
    if (d->n_ff_exp > max_cols) max_cols = d->n_ff_exp;
    if (d->n_ff_shexp > max_cols) max_cols = d->n_ff_shexp;
    u.stage = malloc(u.stage_elems * sizeof(uint16_t));
    u.tmp = calloc((size_t)u.n_tmp, sizeof(float *));
    if (!u.stage || !u.tmp) {
        st = kvb_err_set(err, KVB_ERR_NOMEM, "out of host memory for weight conversion");
        goto done;
    }
    for (int i = 0; i < u.n_tmp; i++)
        if (!(u.tmp[i] = malloc(max_cols * sizeof(float)))) {
            st = kvb_err_set(err, KVB_ERR_NOMEM, "out of host memory for weight conversion");
            goto done;
        }

    if ((st = dev_alloc(e, &e->tok_embd, (size_t)d->n_vocab * E * 2, &e->weight_bytes, "token embeddings", err)) ||
        (st = upload_mat(&u, &m->tok_embd, 0, 0, 0, 0, e->tok_embd, "token_embd", err)))
        goto done;
    e->output_shared = m->output.data == m->tok_embd.data && m->output.type == m->tok_embd.type;
    if (e->output_shared) e->output = e->tok_embd;
    else if (e->tp_rank == 0 && /* the logits are rank 0's */
             ((st = dev_alloc(e, &e->output, (size_t)d->n_vocab * E * 2, &e->weight_bytes, "output head", err)) ||
              (st = upload_mat(&u, &m->output, 0, 0, 0, 0, e->output, "output", err))))
        goto done;
    if ((st = upload_f32(m->output_norm, E, &e->output_norm, &e->weight_bytes, "output norm", err))) goto done;

    e->L = calloc(d->n_layer, sizeof(cu_layer));
    if (!e->L) {
        st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        goto done;
    }
    float *bias = NULL;
    for (uint32_t l = 0; l < d->n_layer && !st; l++) {
        const kvb_layer_weights *w = &m->layers[l];
        cu_layer *L = &e->L[l];
        char nm[64];
        snprintf(nm, sizeof nm, "layer %u weights", l);
        L->moe = !kvb_layer_is_dense(d, l);
        if (e->packed) {
            if ((st = upload_packed(e, &w->wq, q0, (int64_t)Q, 0, 0, &L->pk[PK_Q], "attn_q", err)) ||
                (st = upload_packed(e, &w->wk, kv0, (int64_t)KV, 0, 0, &L->pk[PK_K], "attn_k", err)) ||
                (st = upload_packed(e, &w->wv, kv0, (int64_t)KV, 0, 0, &L->pk[PK_V], "attn_v", err)) ||
                (st = upload_packed(e, &w->wo, 0, 0, q0, (int64_t)Q, &L->pk[PK_O], "attn_output", err)))
                break;
            if (e->moe) {
                if ((st = upload_packed(e, &w->ffn_gate_inp, 0, 0, 0, 0, &L->pk[PK_ROUTER], "ffn_gate_inp", err)) ||
                    (st = upload_packed(e, &w->gate_exps, 0, 0, 0, 0, &L->pk[PK_GATE], "ffn_gate_exps", err)) ||
                    (st = upload_packed(e, &w->up_exps, 0, 0, 0, 0, &L->pk[PK_UP], "ffn_up_exps", err)) ||
                    (st = upload_packed(e, &w->down_exps, 0, 0, 0, 0, &L->pk[PK_DOWN], "ffn_down_exps", err)))
                    break;
            } else if ((st = upload_packed(e, &w->w_gate, f0, (int64_t)FF, 0, 0, &L->pk[PK_GATE], "ffn_gate", err)) ||
                       (st = upload_packed(e, &w->w_up, f0, (int64_t)FF, 0, 0, &L->pk[PK_UP], "ffn_up", err)) ||
                       (st = upload_packed(e, &w->w_down, 0, 0, f0, (int64_t)FF, &L->pk[PK_DOWN], "ffn_down", err)))
                break;
        } else {
            if ((st = bf16_set_alloc(e, l, &L->w, &e->weight_bytes, nm, err))) break;
            if (e->mla) {
                if ((st = kvb_cu_mla_weights_upload(d, w, pool, &L->mla, &e->weight_bytes, err))) break;
            } else if ((st = upload_mat(&u, &w->wq, q0, (int64_t)Q, 0, 0, L->w.m[BF_QKV], "attn_q", err)) ||
                (st = upload_mat(&u, &w->wk, kv0, (int64_t)KV, 0, 0, (uint16_t *)L->w.m[BF_QKV] + Q * E, "attn_k",
                                 err)) ||
                (st = upload_mat(&u, &w->wv, kv0, (int64_t)KV, 0, 0, (uint16_t *)L->w.m[BF_QKV] + (Q + KV) * E,
                                 "attn_v", err)) ||
                (st = upload_mat(&u, &w->wo, 0, 0, q0, (int64_t)Q, L->w.m[BF_O], "attn_output", err)))
                break;
            if (L->moe) {
                if ((st = upload_experts(e, &u, w, &L->w, err))) break;
                if (w->exp_probs_b && (st = upload_f32(w->exp_probs_b, d->n_expert, &L->exp_probs_b,
                                                       &e->weight_bytes, "exp_probs_b", err)))
                    break;
                if (d->n_ff_shexp && /* the shared expert, [gate; up] then down */
                    ((st = upload_mat(&u, &w->gate_shexp, 0, 0, 0, 0, L->w.m[BF_SH_GU], "ffn_gate_shexp", err)) ||
                     (st = upload_mat(&u, &w->up_shexp, 0, 0, 0, 0,
                                      (uint16_t *)L->w.m[BF_SH_GU] + (size_t)d->n_ff_shexp * E, "ffn_up_shexp", err)) ||
                     (st = upload_mat(&u, &w->down_shexp, 0, 0, 0, 0, L->w.m[BF_SH_DOWN], "ffn_down_shexp", err))))
                    break;
            } else if ((st = upload_mat(&u, &w->w_gate, f0, (int64_t)FF, 0, 0, L->w.m[BF_GU], "ffn_gate", err)) ||
                       (st = upload_mat(&u, &w->w_up, f0, (int64_t)FF, 0, 0, (uint16_t *)L->w.m[BF_GU] + FF * E,
                                        "ffn_up", err)) ||
                       (st = upload_mat(&u, &w->w_down, 0, 0, f0, (int64_t)FF, L->w.m[BF_DOWN], "ffn_down", err)))
                break;
        }
        if ((st = upload_f32(w->attn_norm, E, &L->attn_norm, &e->weight_bytes, "attn_norm", err)) ||
            (st = upload_f32(w->ffn_norm, E, &L->ffn_norm, &e->weight_bytes, "ffn_norm", err)))
            break;
        if (w->bq || w->bk || w->bv) {
            if (!bias && !(bias = calloc(S, sizeof(float)))) {
                st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
                break;
            }
            memset(bias, 0, S * sizeof(float));
            if (w->bq) memcpy(bias, w->bq + q0, Q * sizeof(float));
            if (w->bk) memcpy(bias + Q, w->bk + kv0, KV * sizeof(float));
            if (w->bv) memcpy(bias + Q + KV, w->bv + kv0, KV * sizeof(float));
            if ((st = upload_f32(bias, S, &L->b_qkv, &e->weight_bytes, "qkv bias", err))) break;
        }
        if (w->q_norm && (st = upload_f32(w->q_norm, D, &L->q_norm, &e->weight_bytes, "q_norm", err))) break;
        if (w->k_norm && (st = upload_f32(w->k_norm, D, &L->k_norm, &e->weight_bytes, "k_norm", err))) break;
        if (w->post_attn_norm &&
            (st = upload_f32(w->post_attn_norm, E, &L->post_attn_norm, &e->weight_bytes, "post_attention_norm", err)))
            break;
        if (w->post_ffw_norm &&
            (st = upload_f32(w->post_ffw_norm, E, &L->post_ffw_norm, &e->weight_bytes, "post_ffw_norm", err)))
            break;
        L->window = kvb_layer_is_local(d, l) ? (int)d->swa_window : 0;
    }
    free(bias);
done:
    if (u.tmp)
        for (int i = 0; i < u.n_tmp; i++) free(u.tmp[i]);
    free(u.tmp);
    free(u.stage);
    return st;
}

/* One table per kind of layer (kvb_rope_tables: global, and local when local layers rotate with
 * their own base), each for every position up to max_ctx; each layer notes its kind. */
static kvb_status upload_rope(kvb_cuda_engine *e, kvb_pool *pool, kvb_err *err) {
    const kvb_model_desc *d = &e->m->d;
    const uint32_t half = d->n_rot / 2, max_ctx = e->o.max_ctx;
    const size_t n = (size_t)max_ctx * (half ? half : 1);
    kvb_rope_tables kinds; /* only its inverse frequencies and kinds are used (no positions) */
    kvb_status st = kvb_rope_tables_init(&kinds, e->m, 0, err);
    if (st) return st;
    float *cs = malloc(n * sizeof(float)), *sn = malloc(n * sizeof(float));
    if (!cs || !sn) {
        st = kvb_err_set(err, KVB_ERR_NOMEM, "out of host memory for the RoPE table (%u positions)", max_ctx);
        goto done;
    }
    for (uint32_t k = 0; k < kinds.n_kinds && k < 2; k++) {
        if (half) {
            kvb_rope_table_pool(pool, kinds.inv_freq + (size_t)k * half, d->n_rot, 0, max_ctx, cs, sn);
        } else {
            memset(cs, 0, n * sizeof(float));
            memset(sn, 0, n * sizeof(float));
        }
        if ((st = upload_f32(cs, n, &e->rope_cos[k], &e->act_bytes, "RoPE cos table", err)) ||
            (st = upload_f32(sn, n, &e->rope_sin[k], &e->act_bytes, "RoPE sin table", err)))
            goto done;
    }
    for (uint32_t l = 0; l < d->n_layer; l++) {
        e->L[l].rope_kind = kvb_rope_tables_kind(&kinds, l);
        if (e->L[l].rope_kind >= kinds.n_kinds || e->L[l].rope_kind >= 2) {
            st = kvb_err_set(err, KVB_ERR_INTERNAL, "layer %u: RoPE table kind %u of %u", l, e->L[l].rope_kind,
                             kinds.n_kinds);
            goto done;
        }
    }
done:
    kvb_rope_tables_free(&kinds);
    free(cs);
    free(sn);
    return st;
}

/* Resolves o.attention (AUTO: the environment's KVB_CUDA_ATTENTION, else cuDNN when it loads) and
 * loads cuDNN's attention unless OWN was asked for. */
static kvb_status attention_setup(kvb_cuda_engine *e, kvb_err *err) {
    kvb_cuda_attention want = e->o.attention;
    const char *env = getenv("KVB_CUDA_ATTENTION");
    if (want == KVB_CUDA_ATTN_AUTO && env && *env) {
        if (!strcmp(env, "own")) want = KVB_CUDA_ATTN_OWN;
        else if (!strcmp(env, "cudnn")) want = KVB_CUDA_ATTN_CUDNN;
        else if (strcmp(env, "auto"))
            return kvb_err_set(err, KVB_ERR_INVALID, "KVB_CUDA_ATTENTION must be own, cudnn or auto, got '%s'", env);
    }
    e->o.attention = KVB_CUDA_ATTN_OWN;
    if (want == KVB_CUDA_ATTN_OWN) {
        snprintf(e->dnn_why, sizeof e->dnn_why, "not asked for");
        return KVB_OK;
    }
    if (e->mla) { /* expanded keys of N + P and values padded to it: the engine's kernel */
        if (want == KVB_CUDA_ATTN_CUDNN)
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "latent attention runs the engine's own attention kernel");
        snprintf(e->dnn_why, sizeof e->dnn_why, "latent attention (expanded keys and values) runs the own kernel");
        return KVB_OK;
    }
    const kvb_model_desc *d = &e->m->d;
    if (d->head_dim != 64 && d->head_dim != 128) { /* what test_cuda_kernels checks cuDNN on */
        if (want == KVB_CUDA_ATTN_CUDNN)
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                               "cuDNN attention is checked here for head sizes 64 and 128 only (this model: %u); "
                               "use the engine's own attention",
                               d->head_dim);
        snprintf(e->dnn_why, sizeof e->dnn_why, "head size %u (cuDNN's attention is checked for 64 and 128 only)",
                 d->head_dim);
        return KVB_OK;
    }
    kvb_err de = {0};
    size_t scratch = 0;
    if (kvb_cudnn_attn_create(e->st, (int)e->nkv, (int)d->head_dim, e->o.max_batch, e->o.max_ctx, &e->dnn,
                              &scratch, &de)) {
        if (want == KVB_CUDA_ATTN_CUDNN) {
            *err = de;
            return de.code ? de.code : KVB_ERR_UNSUPPORTED;
        }
        snprintf(e->dnn_why, sizeof e->dnn_why, "%s", de.msg);
        return KVB_OK;
    }
    e->act_bytes += scratch;
    e->o.attention = KVB_CUDA_ATTN_CUDNN;
    return KVB_OK;
}

kvb_status kvb_cuda_engine_set_attention(kvb_cuda_engine *e, kvb_cuda_attention a, kvb_err *err) {
    if (e->leader) {
        for (int r = 0; r < e->tp_size; r++) {
            kvb_status st = kvb_cuda_engine_set_attention(kvb_tp_group_rank(e->grp, r), a, err);
            if (st) return st;
        }
        e->o.attention = a;
        return KVB_OK;
    }
    if (a == KVB_CUDA_ATTN_CUDNN && !e->dnn)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "cuDNN attention is not loaded: %s", e->dnn_why);
    if (a != KVB_CUDA_ATTN_CUDNN && a != KVB_CUDA_ATTN_OWN)
        return kvb_err_set(err, KVB_ERR_INVALID, "attention must be own or cudnn");
    e->o.attention = a;
    return KVB_OK;
}

void kvb_cuda_engine_attention_describe(const kvb_cuda_engine *e, char *buf, size_t cap) {
    if (e->leader) {
        kvb_cuda_engine_attention_describe(kvb_tp_group_rank(e->grp, 0), buf, cap);
        return;
    }
    if (e->o.attention == KVB_CUDA_ATTN_CUDNN && e->dnn_fallbacks)
        snprintf(buf, cap, "%s on global layers (gather + fused SDPA); %llu calls fell back to the own kernel: %s",
                 kvb_cudnn_attn_describe(e->dnn), (unsigned long long)e->dnn_fallbacks, e->dnn_why);
    else if (e->o.attention == KVB_CUDA_ATTN_CUDNN)
        snprintf(buf, cap, "%s on global layers (gather + fused SDPA)", kvb_cudnn_attn_describe(e->dnn));
    else
        snprintf(buf, cap, "own flash-attention kernel (cuDNN: %s)", e->dnn ? "loaded, not selected" : e->dnn_why);
}

/* Applies the defaults and checks what every engine (one GPU, a tensor-parallel leader or rank)
 * needs of the options and the model's shape. */
static kvb_status opts_resolve(const kvb_model_desc *d, kvb_cuda_opts *o, kvb_err *err) {
    if (!o->block_tokens) o->block_tokens = 64;
    if (!o->max_ctx) o->max_ctx = d->n_ctx_train < 8192 ? d->n_ctx_train : 8192;
    if (!o->max_batch) o->max_batch = 8192;
    if (o->max_batch > o->max_ctx) o->max_batch = o->max_ctx;
    if (o->n_gpus <= 0) o->n_gpus = 1;
    const char *ov = getenv("KVB_TP_OVERLAP");
    if (ov && !strcmp(ov, "1")) o->tp_overlap = true;
    if (o->block_tokens < 16 || o->block_tokens > 1024 || (o->block_tokens & (o->block_tokens - 1)))
        return kvb_err_set(err, KVB_ERR_INVALID, "block_tokens must be a power of two in [16, 1024], got %u",
                           o->block_tokens);
    if (!o->n_blocks) o->n_blocks = (o->max_ctx + o->block_tokens - 1) / o->block_tokens;
    if (d->mla) { /* deepseek2: latent attention on one GPU, weights in bf16 (mla.c) */
        kvb_status st = kvb_cu_mla_check(d, err);
        if (st) return st;
        if (o->n_gpus > 1 || o->weights == KVB_CUDA_WEIGHTS_PACKED || o->attention == KVB_CUDA_ATTN_CUDNN)
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                               "the CUDA engine runs latent attention (%s) on one GPU, with bf16 weights and its own "
                               "attention kernel (asked: %d GPUs%s%s)",
                               d->arch_name, o->n_gpus, o->weights == KVB_CUDA_WEIGHTS_PACKED ? ", packed weights" : "",
                               o->attention == KVB_CUDA_ATTN_CUDNN ? ", cuDNN attention" : "");
        if (d->n_expert && d->n_expert_groups > 1 &&
            (d->n_expert_groups > KVB_MOE_MAX_GROUPS || d->n_expert % d->n_expert_groups ||
             d->n_expert / d->n_expert_groups < 2 || !d->n_group_used || d->n_group_used > d->n_expert_groups))
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                               "the CUDA router takes up to %d expert groups of 2 experts or more (model: %u experts "
                               "in %u groups, %u used)",
                               KVB_MOE_MAX_GROUPS, d->n_expert, d->n_expert_groups, d->n_group_used);
    }
    if (d->n_ff_shexp && d->arch != KVB_ARCH_DEEPSEEK2) /* qwen2moe's gated shared expert: the CPU engine's only */
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "the CUDA engine does not run a gated shared expert yet (%s: shared expert of %u); use "
                           "--device cpu",
                           d->arch_name, d->n_ff_shexp);
    if (d->n_expert && (o->n_gpus > 1 || d->has_post_norms || d->mlp_gelu || d->n_expert_used > d->n_expert ||
                        !d->n_expert_used || !d->n_ff_exp))
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "the CUDA engine runs a mixture of experts (%s: %u experts top-%u) on one GPU, with SwiGLU "
                           "experts and no post norms (asked: %d GPUs)",
                           d->arch_name, d->n_expert, d->n_expert_used, o->n_gpus);
    if ((!d->mla && (d->head_dim > 256 || d->head_dim % 8)) || d->n_head % d->n_head_kv || d->n_rot > d->head_dim ||
        d->n_ff % 2 || d->n_embd % 8)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "the CUDA engine needs head_dim <= 256 and a multiple of 8, n_ff even, n_embd a multiple "
                           "of 8 (model: head_dim %u, n_ff %u, n_embd %u)",
                           d->head_dim, d->n_ff, d->n_embd);
    const uint32_t N = (uint32_t)o->n_gpus;
    if (N > KVB_TP_MAX_RANKS)
        return kvb_err_set(err, KVB_ERR_INVALID, "--gpus %u: at most %d tensor-parallel ranks", N, KVB_TP_MAX_RANKS);
    /* fewer KV heads than ranks: each KV head is on N / Hkv ranks (their query heads all read it) */
    if (d->n_head % N || (d->n_head_kv % N && N % d->n_head_kv) || d->n_ff % N || (d->n_ff / N) % 2)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "%u tensor-parallel ranks need the heads (%u) and the MLP width (%u, into even parts) to "
                           "divide evenly, and the KV heads (%u) to divide by the ranks or the ranks by them",
                           N, d->n_head, d->n_ff, d->n_head_kv);
    return KVB_OK;
}

/* A leader: the engine callers see when n_gpus > 1; its ranks compute (tp_group.c). */
static kvb_status engine_create_leader(const kvb_model *m, const kvb_cuda_opts *o, kvb_cuda_engine **out,
                                       kvb_err *err) {
    kvb_cuda_engine *e = calloc(1, sizeof *e);
    if (!e) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory creating the CUDA engine");
    e->m = m;
    e->o = *o;
    e->leader = true;
    e->tp_size = o->n_gpus;
    const kvb_model_desc *d = &m->d;
    kvb_status st = kvb_kvformat_init(&e->fmt, KVB_TYPE_BF16, o->block_tokens, d->n_layer, d->n_head_kv,
                                      d->head_dim, err);
    if (!st) st = kvb_tp_group_create(m, &e->o, &e->grp, err);
    if (st) {
        kvb_cuda_engine_free(e);
        return st;
    }
    e->o.attention = kvb_cuda_engine_opts(kvb_tp_group_rank(e->grp, 0))->attention;
    e->o.weights = kvb_cuda_engine_opts(kvb_tp_group_rank(e->grp, 0))->weights;
    *out = e;
    return KVB_OK;
}

kvb_status kvb_cuda_engine_create(const kvb_model *m, const kvb_cuda_opts *opts, kvb_cuda_engine **out, kvb_err *err) {
    *out = NULL;
    char why[256];
    if (!kvb_cuda_device_available(why, sizeof why)) return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s", why);
    kvb_cuda_opts o = opts ? *opts : (kvb_cuda_opts){0};
    kvb_status st = opts_resolve(&m->d, &o, err);
    if (st) return st;
    if (o.n_gpus > 1) return engine_create_leader(m, &o, out, err);
    return kvb_cu_engine_create_rank(m, &o, 0, 1, NULL, out, err);
}

/* This rank's device bytes for its weight matrices in bf16 (the embeddings and output head stay
 * bf16 either way), for the cache, and for the activations created below (a close estimate). */
static void plan_bytes(const kvb_cuda_engine *e, size_t *mats_bf16, size_t *one_layer_bf16, size_t *rest) {
    const kvb_model_desc *d = &e->m->d;
    const size_t E = d->n_embd, D = e->mla ? 0 : d->head_dim, Q = (size_t)e->nh * D, S = Q + 2 * (size_t)e->nkv * D;
    const size_t FF = e->nff_act, B = e->o.max_batch, V = d->n_vocab;
    *one_layer_bf16 = *mats_bf16 = 0;
    for (uint32_t l = 0; l < d->n_layer; l++) {
        size_t elems[BF_COUNT], layer = e->mla ? kvb_cu_mla_weight_bytes(d) : 0;
        bf16_set_elems(e, l, elems);
        for (int i = 0; i < BF_COUNT; i++) layer += elems[i] * 2;
        *one_layer_bf16 = KVB_MAX(*one_layer_bf16, layer);
        *mats_bf16 += layer;
    }
    const bool own_output = !(e->m->output.data == e->m->tok_embd.data) && e->tp_rank == 0;
    *rest = V * E * 2 * (own_output ? 2 : 1) + e->block_bytes * e->o.n_blocks +
            B * (E * 4 * 3 + E * 2 + S * 4 + Q * 2 * 2 + FF * 2 * 3) + (size_t)e->o.max_ctx * 4 +
            (size_t)64 * V * 4 + ((size_t)32 << 20);
    if (e->moe)
        *rest += kvb_cu_moe_scratch_bytes((int)B, (int)d->n_expert, (int)d->n_expert_used, (int)d->n_ff_exp, (int)E);
    if (e->mla) *rest += kvb_cu_mla_scratch_bytes(d, (int)B, (int)e->o.max_ctx, (int)e->o.block_tokens);
}

/* Resolves o.weights (AUTO: bf16 when everything fits the free memory with room to spare). */
static kvb_status choose_weights(kvb_cuda_engine *e, kvb_err *err) {
    if (e->o.weights == KVB_CUDA_WEIGHTS_AUTO) {
        size_t mats, layer, rest, fr = 0, tot = 0;
        plan_bytes(e, &mats, &layer, &rest);
        KVB_CU(cudaMemGetInfo(&fr, &tot));
        /* ranks sharing one device (tp_one_device) are created at once: each counts on its share */
        if (e->o.tp_one_device && e->tp_size > 1) fr /= (size_t)e->tp_size, tot /= (size_t)e->tp_size;
        const size_t spare = tot / 20 > ((size_t)2 << 30) ? tot / 20 : (size_t)2 << 30;
        e->o.weights = mats + rest + spare <= fr ? KVB_CUDA_WEIGHTS_BF16 : KVB_CUDA_WEIGHTS_PACKED;
        if (e->mla && e->o.weights == KVB_CUDA_WEIGHTS_PACKED) /* latent attention: bf16 weights only */
            return kvb_err_set(err, KVB_ERR_NOMEM,
                               "the weights in bf16 (%.2f GiB) with the cache and activations (%.2f GiB) do not fit "
                               "the %.2f GiB free on device %d, and latent attention (%s) runs with bf16 weights only: "
                               "generate a layer subset (gen-model --layers N) or lower --max-ctx",
                               mats / 1073741824.0, rest / 1073741824.0, fr / 1073741824.0, e->o.device,
                               e->m->d.arch_name);
        if (e->o.weights == KVB_CUDA_WEIGHTS_PACKED)
            kvb_log(KVB_LOG_INFO,
                    "CUDA engine: the weights in bf16 (%.2f GiB) with the cache and activations (%.2f GiB) would not "
                    "fit the %.2f GiB free to this engine on device %d with room to spare: keeping them packed, "
                    "expanding a layer (%.2f GiB) at a time",
                    mats / 1073741824.0, rest / 1073741824.0, fr / 1073741824.0, e->o.device, layer / 1073741824.0);
    }
    e->packed = e->o.weights == KVB_CUDA_WEIGHTS_PACKED;
    if (!e->packed) return KVB_OK;
    /* every layer of a model with packed weights has one shape (latent attention, whose leading dense
     * layers differ, is refused packed weights) */
    kvb_status st = bf16_set_alloc(e, 0, &e->xw, &e->xw_bytes, "a layer's expanded weights", err);
    if (st) return st;
    e->act_bytes += e->xw_bytes;
    return KVB_OK;
}

/* The device: its properties (sm_90 required), the streams and events, cuBLAS on the engine's
 * stream with its workspace. */
static kvb_status device_setup(kvb_cuda_engine *e, kvb_err *err) {
    const kvb_cuda_opts *o = &e->o;
    KVB_CU(cudaSetDevice(o->device));
    struct cudaDeviceProp prop;
    KVB_CU(cudaGetDeviceProperties(&prop, o->device));
    snprintf(e->dev_name, sizeof e->dev_name, "%s", prop.name);
    e->n_sm = prop.multiProcessorCount;
    e->cc_major = prop.major;
    e->cc_minor = prop.minor;
    e->dev_total = prop.totalGlobalMem;
    if (prop.major != 9)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "%s has compute capability %d.%d; this build carries GPU code for sm_90 (Hopper) only",
                           prop.name, prop.major, prop.minor);
    KVB_CU(cudaStreamCreateWithFlags(&e->st, cudaStreamNonBlocking));
    if (e->comm && o->tp_overlap) {
        KVB_CU(cudaStreamCreateWithFlags(&e->comm_st, cudaStreamNonBlocking));
        KVB_CU(cudaEventCreateWithFlags(&e->ev_rows, cudaEventDisableTiming));
        KVB_CU(cudaEventCreateWithFlags(&e->ev_comm, cudaEventDisableTiming));
    }
    cublasStatus_t cs = cublasCreate(&e->cublas);
    if (cs != CUBLAS_STATUS_SUCCESS) {
        e->cublas = NULL;
        return kvb_cublas_fail(err, cs, "cublasCreate", __FILE__, __LINE__);
    }
    const size_t ws = (size_t)32 << 20;
    kvb_status st = dev_alloc(e, &e->cublas_ws, ws, &e->act_bytes, "cuBLAS workspace", err);
    if (st) return st;
    if ((cs = cublasSetStream(e->cublas, e->st)) != CUBLAS_STATUS_SUCCESS ||
        (cs = cublasSetWorkspace(e->cublas, e->cublas_ws, ws)) != CUBLAS_STATUS_SUCCESS)
        return kvb_cublas_fail(err, cs, "cublasSetStream/cublasSetWorkspace", __FILE__, __LINE__);
    return KVB_OK;
}

/* The KV cache pool (o->n_blocks blocks) with its block manager, and the activation buffers for
 * o->max_batch tokens. */
static kvb_status alloc_cache_and_activations(kvb_cuda_engine *e, kvb_err *err) {
    const kvb_cuda_opts *o = &e->o;
    const kvb_model_desc *d = &e->m->d;
    kvb_status st;
    uint64_t kvb;
    if (kvb_mul_overflow_u64(e->block_bytes, o->n_blocks, &kvb))
        return kvb_err_set(err, KVB_ERR_RANGE, "KV cache of %u blocks is too large", o->n_blocks);
    if ((st = dev_alloc(e, (void **)&e->kv_pool, kvb, &e->kv_bytes, "the KV cache", err))) return st;
    if ((st = bm_init(&e->bm, o->n_blocks, err))) return st;
    e->chain_root = kvb_chain_root(e->m->fingerprint, kvb_kvformat_fingerprint(&e->fmt));
    /* latent attention has its own scratch (kvb_cu_mla_scratch) in place of qkv, q and att */
    const size_t B = o->max_batch, E = d->n_embd, D = e->mla ? 0 : d->head_dim, Q = (size_t)e->nh * D;
    const size_t S = Q + 2 * (size_t)e->nkv * D, FF = e->nff_act;
    e->logit_rows = o->max_batch < 64 ? o->max_batch : 64;
    if ((st = dev_alloc(e, (void **)&e->x, B * E * 4, &e->act_bytes, "activations", err)) ||
        (st = dev_alloc(e, &e->h, B * E * 2, &e->act_bytes, "activations", err)) ||
        (o->layer_hook && (st = dev_alloc(e, (void **)&e->h32, B * E * 4, &e->act_bytes, "activations", err))) ||
        (d->has_post_norms && (st = dev_alloc(e, (void **)&e->o32, B * E * 4, &e->act_bytes, "activations", err))) ||
        (st = dev_alloc(e, (void **)&e->qkv, B * S * 4, &e->act_bytes, "activations", err)) ||
        (st = dev_alloc(e, &e->q, B * Q * 2, &e->act_bytes, "activations", err)) ||
        (st = dev_alloc(e, &e->att, B * Q * 2, &e->act_bytes, "activations", err)) ||
        (st = dev_alloc(e, &e->gu, B * 2 * FF * 2, &e->act_bytes, "activations", err)) ||
        (st = dev_alloc(e, &e->act, B * FF * 2, &e->act_bytes, "activations", err)) ||
        (st = dev_alloc(e, (void **)&e->d_tok, (size_t)o->max_ctx * 4, &e->act_bytes, "token ids", err)) ||
        (st = dev_alloc(e, (void **)&e->logits_d, (size_t)e->logit_rows * d->n_vocab * 4, &e->act_bytes, "logits",
                        err)))
        return st;
    if (e->moe && (st = kvb_cu_moe_scratch_alloc(&e->moe_s, (int)o->max_batch, (int)d->n_expert, (int)d->n_expert_used,
                                                 (int)d->n_ff_exp, (int)E, &e->act_bytes, err)))
        return st;
    if (e->mla)
        return kvb_cu_mla_scratch_alloc(&e->mla_s, d, (int)o->max_batch, (int)o->max_ctx, (int)o->block_tokens,
                                        &e->act_bytes, err);
    return KVB_OK;
}

kvb_status kvb_cu_engine_create_rank(const kvb_model *m, const kvb_cuda_opts *opts, int rank, int size,
                                     kvb_tp_comm *comm, kvb_cuda_engine **out, kvb_err *err) {
    *out = NULL;
    kvb_cuda_engine *e = calloc(1, sizeof *e);
    if (!e) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory creating the CUDA engine");
    e->m = m;
    e->o = *opts; /* resolved by kvb_cuda_engine_create (opts_resolve) */
    kvb_cuda_opts *o = &e->o;
    const kvb_model_desc *d = &m->d;
    kvb_status st = KVB_OK;
    kvb_pool *pool = NULL;
    e->tp_rank = rank;
    e->tp_size = size;
    e->comm = comm;
    e->nh = d->n_head / (uint32_t)size;
    e->nkv = d->n_head_kv >= (uint32_t)size ? d->n_head_kv / (uint32_t)size : 1; /* replicated when fewer */
    e->kv_first = (uint32_t)((uint64_t)rank * d->n_head_kv / (uint32_t)size);
    e->moe = d->n_expert > 0;
    e->mla = d->mla;
    /* a mixture of experts has no dense MLP, but deepseek2's leading dense layers */
    e->nff = e->moe && d->arch != KVB_ARCH_DEEPSEEK2 ? 0 : d->n_ff / (uint32_t)size;
    e->nff_act = KVB_MAX(e->nff, e->moe ? d->n_ff_shexp : 0);
    e->moe_route = kvb_cu_moe_route_cfg_of(d);
    if (e->moe && (st = kvb_cu_moe_gemm_from_env(&e->moe_gemm, err))) goto fail;
    if (rank != 0 && !o->hook_every_rank) o->layer_hook = NULL, o->layer_hook_ctx = NULL; /* rank 0's */
    while ((1u << e->bt_shift) < o->block_tokens) e->bt_shift++;
    st = d->mla ? kvb_kvformat_init_mla(&e->fmt, KVB_TYPE_BF16, o->block_tokens, d->n_layer, d->n_lora_kv, d->n_rot,
                                        err)
                : kvb_kvformat_init(&e->fmt, KVB_TYPE_BF16, o->block_tokens, d->n_layer, e->nkv, d->head_dim, err);
    if (st) goto fail;
    e->block_bytes = kvb_kvformat_block_bytes(&e->fmt);
    if ((st = device_setup(e, err))) goto fail;
    KVB_CU_GOTO(kvb_cu_attention_init());
    if ((st = attention_setup(e, err))) goto fail;

    if ((st = kvb_pool_create(o->n_threads > 0 ? o->n_threads : kvb_cpu_count(), &pool, err))) goto fail;
    if ((st = choose_weights(e, err))) goto fail;
    if ((st = upload_weights(e, pool, err))) goto fail;
    if ((st = upload_rope(e, pool, err))) goto fail;
    if ((st = alloc_cache_and_activations(e, err))) goto fail;
    KVB_CU_GOTO(cudaDeviceSynchronize());
    kvb_pool_destroy(pool);
    *out = e;
    return KVB_OK;
fail:
    kvb_pool_destroy(pool);
    kvb_cuda_engine_free(e);
    return st;
}

void kvb_cuda_engine_free(kvb_cuda_engine *e) {
    if (!e) return;
    if (e->leader) {
        kvb_tp_group_free(e->grp);
        free(e);
        return;
    }
    if (e->st) cudaStreamSynchronize(e->st);
    if (e->comm_st) cudaStreamSynchronize(e->comm_st);
    if (e->L) {
        for (uint32_t l = 0; l < e->m->d.n_layer; l++) {
            cu_layer *L = &e->L[l];
            void *ps[] = {L->attn_norm, L->ffn_norm, L->b_qkv,         L->q_norm,
                          L->k_norm,    L->post_attn_norm, L->post_ffw_norm};
            for (size_t i = 0; i < KVB_ARRAY_LEN(ps); i++) cudaFree(ps[i]);
            cudaFree(L->exp_probs_b);
            kvb_cu_mla_weights_free(&L->mla);
            for (int i = 0; i < BF_COUNT; i++) cudaFree(L->w.m[i]);
            for (int i = 0; i < PK_COUNT; i++) cudaFree(L->pk[i].d);
        }
        free(e->L);
    }
    if (!e->output_shared) cudaFree(e->output);
    void *ps[] = {e->tok_embd, e->output_norm, e->rope_cos[0], e->rope_sin[0], e->rope_cos[1], e->rope_sin[1],
                  e->kv_pool,  e->x,           e->qkv,         e->logits_d,    e->h,          e->h32,
                  e->o32,      e->q,           e->att,         e->gu,          e->act,        e->d_tok,
                  e->cublas_ws};
    for (size_t i = 0; i < KVB_ARRAY_LEN(ps); i++) cudaFree(ps[i]);
    for (int i = 0; i < BF_COUNT; i++) cudaFree(e->xw.m[i]);
    if (e->moe) kvb_cu_moe_scratch_free(&e->moe_s);
    if (e->mla) kvb_cu_mla_scratch_free(&e->mla_s);
    kvb_cudnn_attn_free(e->dnn);
    if (e->gate_host) {
        cudaFreeHost((void *)e->gate_host);
        cudaEventDestroy(e->gate_ev[0]);
        cudaEventDestroy(e->gate_ev[1]);
    }
    if (e->cublas) cublasDestroy(e->cublas);
    if (e->comm_st) {
        cudaStreamSynchronize(e->comm_st);
        cudaStreamDestroy(e->comm_st);
        cudaEventDestroy(e->ev_rows);
        cudaEventDestroy(e->ev_comm);
    }
    if (e->st) cudaStreamDestroy(e->st);
    bm_free(&e->bm);
    free(e);
}

const kvb_kvformat *kvb_cuda_engine_kvformat(const kvb_cuda_engine *e) { return &e->fmt; }
const kvb_cuda_opts *kvb_cuda_engine_opts(const kvb_cuda_engine *e) { return &e->o; }

void kvb_cuda_engine_describe(const kvb_cuda_engine *e, char *buf, size_t cap) {
    if (e->leader) {
        char r0[512];
        kvb_cuda_engine_describe(kvb_tp_group_rank(e->grp, 0), r0, sizeof r0);
        snprintf(buf, cap, "%d tensor-parallel ranks (%s); rank 0: %s", e->tp_size, kvb_tp_group_describe(e->grp),
                 r0);
        return;
    }
    char wd[128];
    if (e->packed)
        snprintf(wd, sizeof wd, "packed in the file's types (%s), a layer expanded to bf16 at a time (%.2f GiB)",
                 e->L ? kvb_type_name(e->L[0].pk[PK_GATE].type) : "?", e->xw_bytes / 1073741824.0);
    else snprintf(wd, sizeof wd, "bf16");
    char moe[256] = "";
    if (e->moe)
        snprintf(moe, sizeof moe, "; %u experts top-%u, %s (KVB_CUDA_MOE_GEMM)", e->m->d.n_expert,
                 e->m->d.n_expert_used, kvb_cu_moe_gemm_name(e->moe_gemm));
    if (e->mla) /* appended: latent attention's form */
        snprintf(moe + strlen(moe), sizeof moe - strlen(moe),
                 "; latent attention expanded per chunk (keys %u, values %u padded to %u)", e->m->d.head_dim_k_mla,
                 e->m->d.head_dim_v_mla, e->m->d.head_dim_k_mla);
    snprintf(buf, cap,
             "%s (sm_%d%d, %d SMs, %.1f GiB); weights %.2f GiB %s, KV cache %.2f GiB (%u blocks of %u tokens), "
             "activations %.2f GiB (chunks of %u tokens)%s",
             e->dev_name, e->cc_major, e->cc_minor, e->n_sm, e->dev_total / 1073741824.0,
             e->weight_bytes / 1073741824.0, wd, e->kv_bytes / 1073741824.0, e->o.n_blocks, e->o.block_tokens,
             e->act_bytes / 1073741824.0, e->o.max_batch, moe);
}

void kvb_cuda_engine_stats(kvb_cuda_engine *e, kvb_cuda_stats *out) {
    if (e->leader) {
        kvb_cuda_engine_stats(kvb_tp_group_rank(e->grp, 0), out);
        for (int r = 1; r < e->tp_size; r++) {
            kvb_cuda_stats rs;
            kvb_cuda_engine_stats(kvb_tp_group_rank(e->grp, r), &rs);
            out->weight_bytes += rs.weight_bytes;
            out->kv_bytes += rs.kv_bytes;
            out->act_bytes += rs.act_bytes;
        }
        out->last_forward_s = e->last_forward_s;
        out->last_enqueue_s = e->last_forward_s;
        return;
    }
    memset(out, 0, sizeof *out);
    out->weight_bytes = e->weight_bytes;
    out->kv_bytes = e->kv_bytes;
    out->act_bytes = e->act_bytes;
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) {
        out->dev_total_bytes = tot;
        out->dev_used_bytes = tot - fr;
    } else cudaGetLastError();
    out->dev_peak_used_bytes = e->peak_used > out->dev_used_bytes ? e->peak_used : out->dev_used_bytes;
    out->n_blocks = e->bm.n;
    out->free_blocks = e->bm.n_free;
    out->cached_blocks = e->bm.n_lru;
    out->prefix_hit_tokens = e->prefix_hit_tokens;
    out->last_forward_s = e->last_forward_s;
    out->last_enqueue_s = e->last_enqueue_s;
    out->last_gated_gpu_s = e->last_gated_gpu_s;
}

kvb_status kvb_cuda_engine_gate_next(kvb_cuda_engine *e, int gate_ms, kvb_err *err) {
    if (gate_ms <= 0 || gate_ms > 60000) return kvb_err_set(err, KVB_ERR_INVALID, "gate_ms must be in 1..60000");
    if (e->leader) return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "a gated forward is for one GPU (not --gpus > 1)");
    if (!e->gate_host) {
        void *h = NULL;
        KVB_CU(cudaHostAlloc(&h, sizeof(int), cudaHostAllocMapped));
        e->gate_host = h;
        *e->gate_host = 0;
        KVB_CU(cudaHostGetDevicePointer((void **)&e->gate_dev, h, 0));
        KVB_CU(cudaEventCreate(&e->gate_ev[0]));
        KVB_CU(cudaEventCreate(&e->gate_ev[1]));
    }
    e->gate_ms = gate_ms;
    return KVB_OK;
}

static void *gate_opener(void *arg) {
    kvb_cuda_engine *e = arg;
    struct timespec ts = {e->gate_ms / 1000, (long)(e->gate_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    __atomic_store_n((int *)e->gate_host, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

/* ---- sequences -------------------------------------------------------------------------------- */

kvb_status kvb_cuda_seq_create(kvb_cuda_engine *e, kvb_cuda_seq **out, kvb_err *err) {
    *out = NULL;
    kvb_cuda_seq *s = calloc(1, sizeof *s);
    if (!s) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory creating a sequence");
    s->e = e;
    if (e->leader) {
        kvb_status st = kvb_tp_seq_create(e->grp, &s->tps, err);
        if (st) free(s);
        else *out = s;
        return st;
    }
    s->cap = (e->o.max_ctx + e->o.block_tokens - 1) / e->o.block_tokens;
    s->blocks = malloc(sizeof(uint32_t) * s->cap);
    s->keys = malloc(sizeof(uint64_t) * s->cap);
    if (!s->blocks || !s->keys) {
        kvb_cuda_seq_free(s);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory creating a sequence");
    }
    kvb_status st = dev_alloc(e, (void **)&s->d_blocks, sizeof(int32_t) * s->cap, NULL, "a block table", err);
    if (st) {
        kvb_cuda_seq_free(s);
        return st;
    }
    *out = s;
    return KVB_OK;
}

void kvb_cuda_seq_free(kvb_cuda_seq *s) {
    if (!s) return;
    if (s->tps) {
        kvb_tp_seq_free(s->e->grp, s->tps);
        free(s);
        return;
    }
    /* last to first, so a chain's first blocks stay cached longer than its extensions */
    for (uint32_t i = s->n_blocks; i-- > 0;) bm_release(&s->e->bm, s->blocks[i]);
    if (s->d_blocks) {
        cudaStreamSynchronize(s->e->st);
        cudaFree(s->d_blocks);
    }
    free(s->blocks);
    free(s->keys);
    free(s->tokens);
    free(s);
}

uint32_t kvb_cuda_seq_len(const kvb_cuda_seq *s) {
    return s->tps ? kvb_cuda_seq_len(kvb_tp_seq_rank(s->tps, 0)) : s->len;
}

static kvb_status seq_tokens_reserve(kvb_cuda_seq *s, uint32_t n, kvb_err *err) {
    if (n <= s->tok_cap) return KVB_OK;
    uint32_t cap = s->tok_cap ? s->tok_cap : 256;
    while (cap < n) cap = cap > UINT32_MAX / 2 ? n : cap * 2;
    int32_t *t = realloc(s->tokens, sizeof(int32_t) * cap);
    if (!t) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for a sequence's tokens");
    s->tokens = t;
    s->tok_cap = cap;
    return KVB_OK;
}

kvb_status kvb_cuda_seq_attach_cached(kvb_cuda_seq *s, const int32_t *tokens, uint32_t n, uint32_t *n_cached,
                                      kvb_err *err) {
    kvb_cuda_engine *e = s->e;
    *n_cached = 0;
    if (s->tps) return kvb_tp_attach_cached(e->grp, s->tps, tokens, n, n_cached, err);
    if (s->len != 0 || s->n_blocks != 0)
        return kvb_err_set(err, KVB_ERR_INVALID, "attach_cached needs an empty sequence (this one holds %u tokens)",
                           s->len);
    if (n < 2 || e->o.no_prefix_cache) return KVB_OK;
    const uint32_t bt = e->o.block_tokens, max_b = (n - 1) / bt;
    uint64_t parent = e->chain_root;
    uint32_t nb = 0;
    for (; nb < max_b && nb < s->cap; nb++) {
        uint64_t key = kvb_chain_next(parent, tokens + (size_t)nb * bt, bt);
        uint32_t id = bm_lookup(&e->bm, key, parent);
        if (id == BLK_NONE) break;
        bm_retain(&e->bm, id);
        s->blocks[nb] = id;
        s->keys[nb] = key;
        parent = key;
    }
    if (nb == 0) return KVB_OK;
    kvb_status st = seq_tokens_reserve(s, nb * bt, err);
    if (st) {
        for (uint32_t i = nb; i-- > 0;) bm_release(&e->bm, s->blocks[i]);
        return st;
    }
    memcpy(s->tokens, tokens, sizeof(int32_t) * nb * bt);
    s->n_blocks = s->n_keyed = nb;
    s->len = nb * bt;
    e->prefix_hit_tokens += s->len;
    *n_cached = s->len;
    return KVB_OK;
}

/* ---- forward ------------------------------------------------------------------------------------ */

/* Diagnostics only: KVB_CUDA_DEBUG_SKIP_ATTENTION=1 leaves the attention kernel out (the logits are
 * then wrong), so a benchmark can split prefill time into attention and the rest. */
static bool skip_attention(void) {
    static int skip = -1;
    if (skip < 0) {
        const char *v = getenv("KVB_CUDA_DEBUG_SKIP_ATTENTION");
        skip = v && *v && *v != '0';
    }
    return skip != 0;
}

/* Y (n, E) f32 = beta Y + W in (W (E, cols) bf16, in (n, cols) bf16), then under tensor
 * parallelism Y summed over the ranks. With tp_overlap the all-reduce runs on the rank's second
 * stream, and a chunk of 64 rows or more in two halves of rows: the first half's all-reduce beside
 * the second half's GEMM (disjoint rows of Y); the engine's stream waits for both before its next
 * kernel. Each row's product is the whole GEMM's, up to cuBLAS choosing another kernel (another
 * summation order) for the smaller row count: the tolerance of one GPU against itself. */
static kvb_status gemm_allreduce(kvb_cuda_engine *e, const void *W, int E, int cols, const void *in, int n, float beta,
                                 float *Y, kvb_err *err) {
    kvb_status rs;
    if (!e->comm || !e->comm_st) {
        rs = kvb_cu_gemm(e->cublas, W, E, cols, in, n, beta, Y, false, err);
        if (rs || !e->comm) return rs;
        return kvb_tp_comm_allreduce(e->comm, e->tp_rank, Y, (size_t)n * E, e->st, err);
    }
    const int half = n >= 64 ? n / 2 : n; /* rows of the first part */
    for (int r0 = 0; r0 < n; r0 += half) {
        const int rows = n - r0 < half ? n - r0 : half;
        float *y = Y + (size_t)r0 * E;
        if ((rs = kvb_cu_gemm(e->cublas, W, E, cols, (const uint16_t *)in + (size_t)r0 * cols, rows, beta, y, false,
                              err)))
            return rs;
        KVB_CU(cudaEventRecord(e->ev_rows, e->st));
        KVB_CU(cudaStreamWaitEvent(e->comm_st, e->ev_rows, 0));
        if ((rs = kvb_tp_comm_allreduce(e->comm, e->tp_rank, y, (size_t)rows * E, e->comm_st, err))) return rs;
    }
    KVB_CU(cudaEventRecord(e->ev_comm, e->comm_st));
    KVB_CU(cudaStreamWaitEvent(e->st, e->ev_comm, 0));
    return KVB_OK;
}

/* x (n, E) += W in (W (E, cols) bf16, in (n, cols) bf16): with beta = 1 in the GEMM; or, with a
 * post norm (gemma3), the product to o32 (f32) and x += rmsnorm(o32) * post_norm. Tensor parallel:
 * rank 0 adds into x, the others give their product; then the sum. */
static kvb_status residual_branch(kvb_cuda_engine *e, const void *W, int E, int cols, const void *in, int n,
                                  const float *post_norm, kvb_err *err) {
    if (!post_norm) return gemm_allreduce(e, W, E, cols, in, n, e->tp_rank == 0 ? 1.0f : 0.0f, e->x, err);
    if (!e->o32) return kvb_err_set(err, KVB_ERR_INTERNAL, "a post norm without its buffer");
    kvb_status rs = gemm_allreduce(e, W, E, cols, in, n, 0.0f, e->o32, err);
    if (rs) return rs;
    KVB_CU(kvb_cu_rmsnorm_add(e->o32, n, E, post_norm, e->m->d.norm_eps, e->x, e->st));
    return KVB_OK;
}

/* One layer's attention: cuDNN's on a global layer when the chunk was given to it (dnn, from
 * kvb_cudnn_attn_take; a shape it has no engine for runs on the engine's kernel instead, counted),
 * else the engine's kernel. */
static kvb_status run_attention(kvb_cuda_engine *e, const cu_layer *L, const kvb_cu_attn_args *aa, bool dnn,
                                kvb_err *err) {
    if (dnn && !L->window) {
        kvb_err de = {0};
        kvb_status rs = kvb_cudnn_attn_run(e->dnn, aa, &de);
        if (!rs) return KVB_OK;
        if (rs != KVB_ERR_UNSUPPORTED) {
            *err = de;
            return rs;
        }
        if (!e->dnn_fallbacks++) snprintf(e->dnn_why, sizeof e->dnn_why, "%s", de.msg);
    }
    KVB_CU(kvb_cu_attention(aa, 0, e->st));
    return KVB_OK;
}

static kvb_status forward_chunk(kvb_cuda_engine *e, kvb_cuda_seq *s, uint32_t pos0, uint32_t c, float *logits,
                                bool all_logits, bool want_last, kvb_err *err) {
    const kvb_model_desc *d = &e->m->d;
    const int E = (int)d->n_embd, D = (int)d->head_dim, H = (int)e->nh, Hkv = (int)e->nkv; /* this rank's */
    const int Q = H * D, S = Q + 2 * Hkv * D, FF = (int)e->nff, V = (int)d->n_vocab, n = (int)c;
    const float eps = d->norm_eps;
    cudaStream_t st = e->st;
    kvb_status rs;
    /* The last layer's attention and MLP feed only the logits: a chunk that computes none (a
     * prefill node's forward, every chunk but a prompt's last) needs of that layer only its K and V
     * (measured on the H200, 1B shape: ~1/16 of a prefill node's GPU time) */
    const bool wants_logits = e->comm ? e->group_wants_logits : logits != NULL;
    const bool last_layer_out = wants_logits && (all_logits || want_last);

    KVB_CU(kvb_cu_embed(e->tok_embd, e->d_tok + pos0, n, E, d->embd_scale, e->x, st)); /* embd_scale 0: none */
    const kvb_cu_cache cache = {e->kv_pool, e->block_bytes, s->d_blocks, e->bt_shift, Hkv, D};
    const kvb_cu_mla_cache mcache = {e->kv_pool, e->block_bytes, s->d_blocks, e->bt_shift, (int)d->n_lora_kv,
                                     (int)d->n_rot};
    /* cuDNN for this chunk's global layers, or (a new shape whose plan would cost more than it
     * saves here) the engine's kernel for all of them */
    bool dnn = false;
    if (e->o.attention == KVB_CUDA_ATTN_CUDNN) {
        int global = 0;
        for (uint32_t l = 0; l < d->n_layer; l++) global += !e->L[l].window;
        dnn = kvb_cudnn_attn_take(e->dnn, H, n, (int)pos0, global);
    }
    for (uint32_t l = 0; l < d->n_layer; l++) {
        const cu_layer *L = &e->L[l];
        const cu_bf16_set *W = &L->w;
        if (e->packed) { /* the previous layer's GEMMs were queued before: the set is free in stream order */
            if ((rs = expand_layer(e, L, err))) return rs;
            W = &e->xw;
        }
        KVB_CU(kvb_cu_rmsnorm(e->x, (size_t)E, n, E, L->attn_norm, eps, e->h, (size_t)E, e->h32, st));
        if (e->o.layer_hook && !e->hook_st &&
            (rs = e->o.layer_hook(e->o.layer_hook_ctx, e->tp_rank, l, pos0, c, e->h32, st, err))) {
            if (!e->comm) return rs;
            e->hook_st = rs; /* tensor parallel: the ranks stay in lockstep; returned at the end */
            e->hook_err = *err;
        }
        const float *rcos = e->rope_cos[L->rope_kind], *rsin = e->rope_sin[L->rope_kind];
        if (e->mla) { /* latent attention (mla.c): the chunk's latent rows into the cache, then the attention */
            if ((rs = kvb_cu_mla_cache_rows(e->cublas, st, d, &L->mla, e->h, n, (int)pos0, rcos, rsin, mcache, (int)l,
                                            &e->mla_s, err)))
                return rs;
            if (l + 1 == d->n_layer && !last_layer_out) break; /* its rows are in the cache */
            if ((rs = kvb_cu_mla_attend(e->cublas, st, d, &L->mla, e->h, n, (int)pos0, rcos, rsin, mcache, (int)l,
                                        skip_attention(), e->x, &e->mla_s, err)))
                return rs;
        } else {
            if ((rs = kvb_cu_gemm(e->cublas, W->m[BF_QKV], S, E, e->h, n, 0.0f, e->qkv, false, err))) return rs;
            kvb_cu_qkv_post_args qa = {e->qkv, n,    H,    Hkv,          D,   (int)d->n_rot, d->rope_neox ? 1 : 0,
                                       L->b_qkv, L->q_norm, L->k_norm, eps, rcos, rsin, (int)pos0,
                                       e->q,     cache, (int)l};
            KVB_CU(kvb_cu_qkv_post(&qa, st));
            if (l + 1 == d->n_layer && !last_layer_out) break; /* its K and V are in the cache */
            kvb_cu_attn_args aa = {e->q, e->att, cache, (int)l, H, Hkv, D, n, (int)pos0, L->window, d->attn_scale};
            if (!skip_attention() && (rs = run_attention(e, L, &aa, dnn, err))) return rs;
            /* x += W_o att: in the GEMM's epilogue, or (gemma3) through the post-attention norm */
            if ((rs = residual_branch(e, W->m[BF_O], E, Q, e->att, n, L->post_attn_norm, err))) return rs;
        }
        KVB_CU(kvb_cu_rmsnorm(e->x, (size_t)E, n, E, L->ffn_norm, eps, e->h, (size_t)E, NULL, st));
        if (L->moe) { /* x += the routed experts' weighted outputs; then the shared expert's (deepseek2) */
            const kvb_cu_moe_weights mw = {W->m[BF_ROUTER], W->m[BF_GU], W->m[BF_DOWN], L->exp_probs_b};
            if ((rs = kvb_cu_moe_ffn(e->cublas, st, &mw, &e->moe_route, e->h, n, e->x, &e->moe_s, e->moe_gemm, err)))
                return rs;
            const int FS = (int)d->n_ff_shexp;
            if (!FS) continue;
            if ((rs = kvb_cu_gemm(e->cublas, W->m[BF_SH_GU], 2 * FS, E, e->h, n, 0.0f, e->gu, true, err))) return rs;
            KVB_CU(kvb_cu_glu(e->gu, n, FS, 0, e->act, st));
            if ((rs = kvb_cu_gemm(e->cublas, W->m[BF_SH_DOWN], E, FS, e->act, n, 1.0f, e->x, false, err))) return rs;
            continue;
        }
        if ((rs = kvb_cu_gemm(e->cublas, W->m[BF_GU], 2 * FF, E, e->h, n, 0.0f, e->gu, true, err))) return rs;
        KVB_CU(kvb_cu_glu(e->gu, n, FF, d->mlp_gelu ? 1 : 0, e->act, st));
        if ((rs = residual_branch(e, W->m[BF_DOWN], E, FF, e->act, n, L->post_ffw_norm, err))) return rs;
    }
    if (all_logits && logits) {
        for (uint32_t r0 = 0; r0 < c; r0 += e->logit_rows) {
            int nr = (int)(c - r0 < e->logit_rows ? c - r0 : e->logit_rows);
            KVB_CU(kvb_cu_rmsnorm(e->x + (size_t)r0 * E, (size_t)E, nr, E, e->output_norm, eps, e->h, (size_t)E, NULL, st));
            if ((rs = kvb_cu_gemm(e->cublas, e->output, V, E, e->h, nr, 0.0f, e->logits_d, false, err))) return rs;
            KVB_CU(cudaMemcpyAsync(logits + (size_t)r0 * V, e->logits_d, sizeof(float) * (size_t)nr * V,
                                   cudaMemcpyDeviceToHost, st));
        }
    } else if (want_last && logits) {
        KVB_CU(kvb_cu_rmsnorm(e->x + (size_t)(c - 1) * E, (size_t)E, 1, E, e->output_norm, eps, e->h, (size_t)E, NULL, st));
        if ((rs = kvb_cu_gemm(e->cublas, e->output, V, E, e->h, 1, 0.0f, e->logits_d, false, err))) return rs;
        KVB_CU(cudaMemcpyAsync(logits, e->logits_d, sizeof(float) * (size_t)V, cudaMemcpyDeviceToHost, st));
    }
    return KVB_OK;
}

kvb_status kvb_cu_forward_check(kvb_cuda_engine *e, kvb_cuda_seq *s, const int32_t *tokens, uint32_t n,
                                kvb_err *err) {
    if ((uint64_t)s->len + n > e->o.max_ctx)
        return kvb_err_set(err, KVB_ERR_RANGE, "%u + %u tokens exceed the context limit of %u tokens", s->len, n,
                           e->o.max_ctx);
    const uint32_t V = e->m->d.n_vocab, bt = e->o.block_tokens;
    for (uint32_t t = 0; t < n; t++)
        if (tokens[t] < 0 || (uint32_t)tokens[t] >= V)
            return kvb_err_set(err, KVB_ERR_INVALID, "token id %d at position %u is outside the vocabulary (0..%u)",
                               tokens[t], s->len + t, V - 1);
    const uint32_t need = (s->len + n + bt - 1) / bt;
    return need > s->n_blocks ? bm_check(&e->bm, need - s->n_blocks, err) : KVB_OK;
}

kvb_status kvb_cuda_forward(kvb_cuda_engine *e, kvb_cuda_seq *s, const int32_t *tokens, uint32_t n, float *logits,
                            bool all_logits, kvb_err *err) {
    const double t_start = kvb_now_s();
    if (n == 0) return kvb_err_set(err, KVB_ERR_INVALID, "forward called with no tokens");
    if (s->e != e) return kvb_err_set(err, KVB_ERR_INVALID, "sequence belongs to another engine");
    if (e->leader) {
        kvb_status ls = kvb_tp_forward(e->grp, s->tps, tokens, n, logits, all_logits, err);
        e->last_forward_s = kvb_now_s() - t_start;
        return ls;
    }
    e->hook_st = KVB_OK;
    kvb_status st = kvb_cu_forward_check(e, s, tokens, n, err);
    if (st) return st;
    const uint32_t V = e->m->d.n_vocab, bt = e->o.block_tokens;
    const uint32_t need = (s->len + n + bt - 1) / bt;
    if (need > s->n_blocks) {
        if ((st = bm_alloc(&e->bm, need - s->n_blocks, s->blocks + s->n_blocks, err))) return st;
        s->n_blocks = need;
    }
    if (s->n_blocks > s->n_dev_blocks) {
        KVB_CU(cudaMemcpyAsync(s->d_blocks + s->n_dev_blocks, s->blocks + s->n_dev_blocks,
                               sizeof(int32_t) * (s->n_blocks - s->n_dev_blocks), cudaMemcpyHostToDevice, e->st));
        s->n_dev_blocks = s->n_blocks;
    }
    if ((st = seq_tokens_reserve(s, s->len + n, err))) return st;
    memcpy(s->tokens + s->len, tokens, sizeof(int32_t) * n);
    /* one upload for all chunks (a pageable copy waits for the stream: do it once, up front) */
    KVB_CU(cudaMemcpyAsync(e->d_tok + s->len, tokens, sizeof(int32_t) * n, cudaMemcpyHostToDevice, e->st));

    /* diagnostics: a gated forward (kvb_cuda_engine_gate_next) */
    pthread_t opener;
    bool gated = false;
    e->last_gated_gpu_s = 0;
    if (e->gate_ms > 0) {
        *e->gate_host = 0;
        KVB_CU(kvb_cu_gate(e->gate_dev, e->st));
        KVB_CU(cudaEventRecord(e->gate_ev[0], e->st));
        if (pthread_create(&opener, NULL, gate_opener, e)) {
            *e->gate_host = 1;
            return kvb_err_set(err, KVB_ERR_INTERNAL, "cannot start the gate's thread");
        }
        gated = true;
    }
    const uint32_t B = e->o.max_batch;
    for (uint32_t done = 0; done < n;) {
        const uint32_t c = n - done < B ? n - done : B;
        const bool last = done + c == n;
        float *lg = logits && all_logits ? logits + (size_t)done * V : logits;
        if ((st = forward_chunk(e, s, s->len + done, c, lg, all_logits, last, err))) {
            if (gated) pthread_join(opener, NULL), e->gate_ms = 0;
            cudaStreamSynchronize(e->st);
            return st;
        }
        done += c;
    }
    const double t_enq = kvb_now_s();
    if (gated) {
        e->gate_ms = 0;
        cudaError_t ge = cudaEventRecord(e->gate_ev[1], e->st);
        pthread_join(opener, NULL);
        KVB_CU(ge);
    }
    KVB_CU(cudaStreamSynchronize(e->st));
    if (gated) {
        float ms = 0;
        KVB_CU(cudaEventElapsedTime(&ms, e->gate_ev[0], e->gate_ev[1]));
        e->last_gated_gpu_s = ms / 1000.0;
    }
    KVB_CU(cudaGetLastError());
    if (e->hook_st) { /* a tensor-parallel rank finished in lockstep after its hook failed */
        *err = e->hook_err;
        return e->hook_st;
    }
    s->len += n;

    /* index every block that is now full */
    const uint32_t full = s->len / bt;
    for (uint32_t b = s->n_keyed; b < full; b++) {
        const uint64_t parent = b ? s->keys[b - 1] : e->chain_root;
        s->keys[b] = kvb_chain_next(parent, s->tokens + (size_t)b * bt, bt);
        if (!e->o.no_prefix_cache) bm_publish(&e->bm, s->blocks[b], s->keys[b], parent);
    }
    if (full > s->n_keyed) s->n_keyed = full;

    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) {
        if (tot - fr > e->peak_used) e->peak_used = tot - fr;
    } else cudaGetLastError();
    e->last_enqueue_s = t_enq - t_start;
    e->last_forward_s = kvb_now_s() - t_start;
    return KVB_OK;
}

/* ---- GEMM ceiling ----------------------------------------------------------------------------- */

static int cmp_f(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

kvb_status kvb_cuda_gemm_bench(int device, int m, int n, int k, int reps, double *tflops_median, double *tflops_best,
                               kvb_err *err) {
    kvb_status st = KVB_OK;
    void *A = NULL, *B = NULL, *C = NULL, *ws = NULL;
    cudaStream_t s = NULL;
    cublasHandle_t h = NULL;
    cudaEvent_t ev[2] = {NULL, NULL};
    float *ms = NULL;
    if (reps < 1) reps = 1;
    KVB_CU_GOTO(cudaSetDevice(device));
    KVB_CU_GOTO(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    {
        cublasStatus_t cs = cublasCreate(&h);
        if (cs != CUBLAS_STATUS_SUCCESS) {
            h = NULL;
            st = kvb_cublas_fail(err, cs, "cublasCreate", __FILE__, __LINE__);
            goto fail;
        }
        KVB_CU_GOTO(cudaMalloc(&ws, (size_t)32 << 20));
        if ((cs = cublasSetStream(h, s)) != CUBLAS_STATUS_SUCCESS ||
            (cs = cublasSetWorkspace(h, ws, (size_t)32 << 20)) != CUBLAS_STATUS_SUCCESS) {
            st = kvb_cublas_fail(err, cs, "cublasSetStream/cublasSetWorkspace", __FILE__, __LINE__);
            goto fail;
        }
    }
    KVB_CU_GOTO(cudaMalloc(&A, (size_t)m * k * 2));
    KVB_CU_GOTO(cudaMalloc(&B, (size_t)k * n * 2));
    KVB_CU_GOTO(cudaMalloc(&C, (size_t)m * n * 2));
    KVB_CU_GOTO(kvb_cu_fill_random_bf16(A, (size_t)m * k, 1, 1.0f, s));
    KVB_CU_GOTO(kvb_cu_fill_random_bf16(B, (size_t)k * n, 2, 1.0f, s));
    KVB_CU_GOTO(cudaEventCreate(&ev[0]));
    KVB_CU_GOTO(cudaEventCreate(&ev[1]));
    ms = malloc(sizeof(float) * (size_t)reps);
    if (!ms) {
        st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (int i = 0; i < 3; i++)
        if ((st = kvb_cu_gemm(h, A, m, k, B, n, 0.0f, C, true, err))) goto fail;
    for (int r = 0; r < reps; r++) {
        KVB_CU_GOTO(cudaEventRecord(ev[0], s));
        if ((st = kvb_cu_gemm(h, A, m, k, B, n, 0.0f, C, true, err))) goto fail;
        KVB_CU_GOTO(cudaEventRecord(ev[1], s));
        KVB_CU_GOTO(cudaEventSynchronize(ev[1]));
        KVB_CU_GOTO(cudaEventElapsedTime(&ms[r], ev[0], ev[1]));
    }
    qsort(ms, (size_t)reps, sizeof(float), cmp_f);
    {
        const double flop = 2.0 * m * (double)n * k;
        double med = reps % 2 ? ms[reps / 2] : 0.5 * (ms[reps / 2 - 1] + ms[reps / 2]);
        *tflops_median = flop / (med * 1e-3) / 1e12;
        *tflops_best = flop / (ms[0] * 1e-3) / 1e12;
    }
fail:
    free(ms);
    if (ev[0]) cudaEventDestroy(ev[0]);
    if (ev[1]) cudaEventDestroy(ev[1]);
    if (s) cudaStreamSynchronize(s);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
    cudaFree(ws);
    if (h) cublasDestroy(h);
    if (s) cudaStreamDestroy(s);
    return st;
}

bool kvb_cu_engine_hook_failed(const kvb_cuda_engine *e) { return e->hook_st != KVB_OK; }

void kvb_cu_engine_set_group_wants_logits(kvb_cuda_engine *e, bool wants) { e->group_wants_logits = wants; }
