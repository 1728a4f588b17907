/* engine/cuda/cudnn_attention.c — causal chunk attention through cuDNN's fused flash attention:
 * the backend graph API from C, cuDNN loaded with dlopen. See cudnn_attention.h for the contract.
 *
 * The graph is the one cuDNN's frontend lowers its SDPA node to (inference, no dropout), which its
 * fused attention engines recognise:
 *   S = Q . K^T (f32) -> S * scale -> causal mask aligned bottom right (row + s_kv - s_q >= col,
 *   else -inf) -> softmax (max, sub, exp, sum, log/add as virtual stats, div; P in bf16) -> O = P . V
 * Q and O are the engine's (token, head, head_dim) buffers addressed with strides; K and V come
 * from the gather scratch, (kv_head, token, head_dim). Tensors (b = 1):
 *   Q (1, H, s_q, D)   KT (1, Hkv, D, s_kv)   V (1, Hkv, s_kv, D)   O (1, H, s_q, D)
 *   S and the masked/softmax stages (1, H, s_q, s_kv), virtual; row statistics (1, H, s_q, 1). */
#include "cudnn_attention.h"

#include <dlfcn.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

#if defined(__has_include)
#if __has_include(<cudnn_graph.h>)
#define KVB_HAVE_CUDNN_HEADERS 1
#endif
#endif

#ifndef KVB_HAVE_CUDNN_HEADERS

struct kvb_cudnn_attn {
    int unused;
};
kvb_status kvb_cudnn_attn_create(cudaStream_t st, int Hkv, int D, uint32_t max_q, uint32_t max_kv, kvb_cudnn_attn **out,
                                 size_t *scratch_bytes, kvb_err *err) {
    (void)st, (void)Hkv, (void)D, (void)max_q, (void)max_kv, (void)scratch_bytes;
    *out = NULL;
    return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "cuDNN attention: this build had no cuDNN headers (cudnn_graph.h)");
}
void kvb_cudnn_attn_free(kvb_cudnn_attn *a) { (void)a; }
bool kvb_cudnn_attn_take(kvb_cudnn_attn *a, int H, int n, int pos0, int layers) {
    (void)a, (void)H, (void)n, (void)pos0, (void)layers;
    return false;
}
uint32_t kvb_cudnn_attn_plans_built(const kvb_cudnn_attn *a) {
    (void)a;
    return 0;
}
const char *kvb_cudnn_attn_describe(kvb_cudnn_attn *a) {
    (void)a;
    return "cuDNN: not built";
}
kvb_status kvb_cudnn_attn_run(kvb_cudnn_attn *a, const kvb_cu_attn_args *args, kvb_err *err) {
    (void)a, (void)args;
    return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "cuDNN attention: not built");
}

#else

#include <cudnn_graph.h>

typedef cudnnBackendDescriptor_t bdesc;

/* The cuDNN entry points this file uses, resolved from libcudnn.so.9. */
typedef struct {
    void *lib;
    size_t (*GetVersion)(void);
    const char *(*GetErrorString)(cudnnStatus_t);
    void (*GetLastErrorString)(char *, size_t);
    cudnnStatus_t (*Create)(cudnnHandle_t *);
    cudnnStatus_t (*Destroy)(cudnnHandle_t);
    cudnnStatus_t (*SetStream)(cudnnHandle_t, cudaStream_t);
    cudnnStatus_t (*CreateDescriptor)(cudnnBackendDescriptorType_t, bdesc *);
    cudnnStatus_t (*DestroyDescriptor)(bdesc);
    cudnnStatus_t (*Finalize)(bdesc);
    cudnnStatus_t (*SetAttribute)(bdesc, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t, int64_t,
                                  const void *);
    cudnnStatus_t (*GetAttribute)(bdesc const, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t, int64_t,
                                  int64_t *, void *);
    cudnnStatus_t (*Execute)(cudnnHandle_t, bdesc, bdesc);
} cudnn_api;

enum { PLAN_CACHE = 48, GRAPH_DESCS = 96, SEEN_CAP = 256 };

typedef struct {
    int H, Hkv, D, s_q, s_kv; /* the shape the plan was built for; H == 0: empty slot */
    bdesc plan;
    bdesc made[GRAPH_DESCS]; /* every descriptor of its graph, kept while the plan lives */
    int n_made;
    int64_t ws_bytes;
    uint64_t last_use;
    bool unsupported; /* no engine for this shape: remembered so it is not rebuilt every layer */
} plan_slot;

struct kvb_cudnn_attn {
    cudnn_api api;
    cudnnHandle_t h;
    cudaStream_t st;
    int Hkv, D;
    uint32_t max_q, max_kv; /* query rows the caller's Q/O buffers hold; key rows of the scratch */
    void *k, *v; /* scratch (Hkv, max_kv, D) bf16 each */
    void *ws;
    size_t ws_cap;
    plan_slot slots[PLAN_CACHE];
    uint64_t clock;
    uint32_t plans_built;  /* plans built so far, and the host seconds they took */
    double build_s;
    bool eager;            /* KVB_CUDNN_PLANS=eager: every new shape gets its plan at once */
    struct {
        int H, s_q, s_kv;
    } seen[SEEN_CAP];      /* shapes declined once (no plan yet), the newest SEEN_CAP; H == 0: empty */
    uint32_t seen_next;
    uint64_t declined;     /* calls of kvb_cudnn_attn_take that said no */
    char version[48];
    char describe[160];
};

/* Tensor ids in the variant pack and the graph. */
enum {
    UID_Q = 1, UID_K, UID_V, UID_O, UID_SCALE, UID_NEG_INF, UID_S_KV, UID_S_Q,
    UID_VIRTUAL = 100
};

static kvb_status dnn_fail(const kvb_cudnn_attn *a, kvb_err *err, cudnnStatus_t s, const char *what, int line) {
    char last[512] = "";
    if (a->api.GetLastErrorString) a->api.GetLastErrorString(last, sizeof last);
    return kvb_err_set(err, s == CUDNN_STATUS_NOT_SUPPORTED ? KVB_ERR_UNSUPPORTED : KVB_ERR_INTERNAL,
                       "cuDNN: %s failed: %s (%d) at cudnn_attention.c:%d%s%s", what, a->api.GetErrorString(s), (int)s,
                       line, last[0] ? ": " : "", last);
}

/* A cuDNN call in a function with kvb_cudnn_attn *a, kvb_err *err, kvb_status st and a done:
 * label: on failure st says what failed and control goes to done. */
#define DNN(call)                                                                                              \
    do {                                                                                                       \
        cudnnStatus_t dnn_s_ = (call);                                                                         \
        if (dnn_s_ != CUDNN_STATUS_SUCCESS) {                                                                  \
            st = dnn_fail(a, err, dnn_s_, #call, __LINE__);                                                    \
            goto done;                                                                                         \
        }                                                                                                      \
    } while (0)

static kvb_status load_api(cudnn_api *p, kvb_err *err) {
    memset(p, 0, sizeof *p);
    p->lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (!p->lib)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "cuDNN attention: cannot load libcudnn.so.9 (%s); put cuDNN 9's lib directory on "
                           "LD_LIBRARY_PATH, or use --attention own",
                           dlerror());
    struct {
        void **fn;
        const char *name;
    } want[] = {
        {(void **)&p->GetVersion, "cudnnGetVersion"},
        {(void **)&p->GetErrorString, "cudnnGetErrorString"},
        {(void **)&p->GetLastErrorString, "cudnnGetLastErrorString"},
        {(void **)&p->Create, "cudnnCreate"},
        {(void **)&p->Destroy, "cudnnDestroy"},
        {(void **)&p->SetStream, "cudnnSetStream"},
        {(void **)&p->CreateDescriptor, "cudnnBackendCreateDescriptor"},
        {(void **)&p->DestroyDescriptor, "cudnnBackendDestroyDescriptor"},
        {(void **)&p->Finalize, "cudnnBackendFinalize"},
        {(void **)&p->SetAttribute, "cudnnBackendSetAttribute"},
        {(void **)&p->GetAttribute, "cudnnBackendGetAttribute"},
        {(void **)&p->Execute, "cudnnBackendExecute"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        void *f = dlsym(p->lib, want[i].name);
        if (!f) {
            dlclose(p->lib);
            p->lib = NULL;
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "cuDNN attention: libcudnn.so.9 lacks %s", want[i].name);
        }
        memcpy(want[i].fn, &f, sizeof f); /* object pointer -> function pointer, as dlsym requires */
    }
    if (p->GetVersion() < 90000) {
        size_t v = p->GetVersion();
        dlclose(p->lib);
        p->lib = NULL;
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "cuDNN attention: cuDNN %zu is older than 9.0", v);
    }
    return KVB_OK;
}

/* ---- graph building: every descriptor made is recorded so one call frees them all --------------- */

typedef struct {
    kvb_cudnn_attn *a;
    plan_slot *slot; /* its made[] records every descriptor created */
    int64_t next_virtual;
} graph_b;

static cudnnStatus_t make(graph_b *g, cudnnBackendDescriptorType_t t, bdesc *out) {
    *out = NULL;
    if (g->slot->n_made >= GRAPH_DESCS) return CUDNN_STATUS_INTERNAL_ERROR;
    cudnnStatus_t s = g->a->api.CreateDescriptor(t, out);
    if (s == CUDNN_STATUS_SUCCESS) g->slot->made[g->slot->n_made++] = *out;
    return s;
}

/* Destroys a slot's plan and its graph's descriptors (newest first). */
static void slot_clear(kvb_cudnn_attn *a, plan_slot *p) {
    if (p->plan) a->api.DestroyDescriptor(p->plan);
    for (int i = p->n_made - 1; i >= 0; i--) a->api.DestroyDescriptor(p->made[i]);
    memset(p, 0, sizeof *p);
}

#define SET(d, name, type, count, ptr) g->a->api.SetAttribute((d), (name), (type), (count), (ptr))

/* A 4-d tensor; uid < 0 takes the next virtual id. */
static cudnnStatus_t tensor(graph_b *g, int64_t uid, cudnnDataType_t dt, const int64_t dims[4],
                            const int64_t strides[4], bool is_virtual, bool by_value, bdesc *out) {
    cudnnStatus_t s = make(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, out);
    if (s) return s;
    if (uid < 0) uid = g->next_virtual++;
    const int64_t align = 16;
    if ((s = SET(*out, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid)) ||
        (s = SET(*out, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt)) ||
        (s = SET(*out, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align)) ||
        (s = SET(*out, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims)) ||
        (s = SET(*out, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides)) ||
        (s = SET(*out, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual)) ||
        (s = SET(*out, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value)))
        return s;
    return g->a->api.Finalize(*out);
}

static cudnnStatus_t scalar(graph_b *g, int64_t uid, cudnnDataType_t dt, bdesc *out) {
    static const int64_t one[4] = {1, 1, 1, 1};
    return tensor(g, uid, dt, one, one, false, true, out);
}

/* A pointwise operation y = mode(x [, b [, t]]) computed in `prec`; axis >= 0 for GEN_INDEX. */
static cudnnStatus_t pointwise(graph_b *g, cudnnPointwiseMode_t mode, cudnnDataType_t prec, int64_t axis, bdesc x,
                               bdesc b, bdesc t, bdesc y, bdesc *op) {
    bdesc pw;
    cudnnStatus_t s = make(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, &pw);
    if (s || (s = SET(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode)) ||
        (s = SET(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec)) ||
        (axis >= 0 && (s = SET(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis))) ||
        (s = g->a->api.Finalize(pw)))
        return s;
    if ((s = make(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, op)) ||
        (s = SET(*op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw)) ||
        (s = SET(*op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x)) ||
        (b && (s = SET(*op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b))) ||
        (t && (s = SET(*op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t))) ||
        (s = SET(*op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y)))
        return s;
    return g->a->api.Finalize(*op);
}

static cudnnStatus_t reduction(graph_b *g, cudnnReduceTensorOp_t red, bdesc x, bdesc y, bdesc *op) {
    bdesc rd;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnStatus_t s = make(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, &rd);
    if (s || (s = SET(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red)) ||
        (s = SET(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32)) || (s = g->a->api.Finalize(rd)))
        return s;
    if ((s = make(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, op)) ||
        (s = SET(*op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd)) ||
        (s = SET(*op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x)) ||
        (s = SET(*op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y)))
        return s;
    return g->a->api.Finalize(*op);
}

static cudnnStatus_t matmul(graph_b *g, bdesc A, bdesc B, bdesc C, bdesc *op) {
    bdesc md;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnStatus_t s = make(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, &md);
    if (s || (s = SET(md, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32)) || (s = g->a->api.Finalize(md)))
        return s;
    if ((s = make(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, op)) ||
        (s = SET(*op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &A)) ||
        (s = SET(*op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &B)) ||
        (s = SET(*op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &C)) ||
        (s = SET(*op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &md)))
        return s;
    return g->a->api.Finalize(*op);
}

/* The attention graph's operations for slot's shape into ops[0..*n_ops): S = Q K^T * scale, the
 * bottom-right causal mask, softmax with its statistics, O = P V. */
static kvb_status graph_ops(graph_b *g, bdesc ops[16], int *n_ops, kvb_err *err) {
    kvb_status st = KVB_OK;
    kvb_cudnn_attn *a = g->a;
    const plan_slot *slot = g->slot;
    const int64_t H = slot->H, Hkv = slot->Hkv, D = slot->D, sq = slot->s_q, skv = slot->s_kv;
    const cudnnDataType_t BF = CUDNN_DATA_BFLOAT16, F32 = CUDNN_DATA_FLOAT, I32 = CUDNN_DATA_INT32,
                          BOOL = CUDNN_DATA_BOOLEAN;
    /* Q, O: the engine's (token, head, D) rows; K, V: scratch (kv_head, token, D) */
    const int64_t q_dim[4] = {1, H, sq, D}, q_str[4] = {sq * H * D, D, H * D, 1};
    const int64_t kt_dim[4] = {1, Hkv, D, skv}, kt_str[4] = {Hkv * skv * D, skv * D, 1, D};
    const int64_t v_dim[4] = {1, Hkv, skv, D}, v_str[4] = {Hkv * skv * D, skv * D, D, 1};
    const int64_t s_dim[4] = {1, H, sq, skv}, s_str[4] = {H * sq * skv, sq * skv, skv, 1};
    const int64_t r_dim[4] = {1, H, sq, 1}, r_str[4] = {H * sq, sq, 1, 1};
    bdesc tq, tk, tv, to, tscale, tneg, tskv, tsq;
    bdesc s0, s1, row, col, row1, row2, mask, s2, mx, sub, ex, sum, lg, stats, p;
    int n = 0;
    DNN(tensor(g, UID_Q, BF, q_dim, q_str, false, false, &tq));
    DNN(tensor(g, UID_K, BF, kt_dim, kt_str, false, false, &tk));
    DNN(tensor(g, UID_V, BF, v_dim, v_str, false, false, &tv));
    DNN(tensor(g, UID_O, BF, q_dim, q_str, false, false, &to));
    DNN(scalar(g, UID_SCALE, F32, &tscale));
    DNN(scalar(g, UID_NEG_INF, F32, &tneg));
    DNN(scalar(g, UID_S_KV, I32, &tskv));
    DNN(scalar(g, UID_S_Q, I32, &tsq));
    /* S = Q K^T; S * scale */
    DNN(tensor(g, -1, F32, s_dim, s_str, true, false, &s0));
    DNN(matmul(g, tq, tk, s0, &ops[n++]));
    DNN(tensor(g, -1, F32, s_dim, s_str, true, false, &s1));
    DNN(pointwise(g, CUDNN_POINTWISE_MUL, F32, -1, s0, tscale, NULL, s1, &ops[n++]));
    /* causal, bottom right: keep where row + s_kv - s_q >= col */
    DNN(tensor(g, -1, I32, s_dim, s_str, true, false, &row));
    DNN(pointwise(g, CUDNN_POINTWISE_GEN_INDEX, F32, 2, s1, NULL, NULL, row, &ops[n++]));
    DNN(tensor(g, -1, I32, s_dim, s_str, true, false, &col));
    DNN(pointwise(g, CUDNN_POINTWISE_GEN_INDEX, F32, 3, s1, NULL, NULL, col, &ops[n++]));
    DNN(tensor(g, -1, I32, s_dim, s_str, true, false, &row1));
    DNN(pointwise(g, CUDNN_POINTWISE_ADD, I32, -1, row, tskv, NULL, row1, &ops[n++]));
    DNN(tensor(g, -1, I32, s_dim, s_str, true, false, &row2));
    DNN(pointwise(g, CUDNN_POINTWISE_SUB, I32, -1, row1, tsq, NULL, row2, &ops[n++]));
    DNN(tensor(g, -1, BOOL, s_dim, s_str, true, false, &mask));
    DNN(pointwise(g, CUDNN_POINTWISE_CMP_GE, BOOL, -1, row2, col, NULL, mask, &ops[n++]));
    DNN(tensor(g, -1, F32, s_dim, s_str, true, false, &s2));
    DNN(pointwise(g, CUDNN_POINTWISE_BINARY_SELECT, F32, -1, s1, tneg, mask, s2, &ops[n++]));
    /* softmax with its (virtual) statistics, as the frontend lowers it */
    DNN(tensor(g, -1, F32, r_dim, r_str, true, false, &mx));
    DNN(reduction(g, CUDNN_REDUCE_TENSOR_MAX, s2, mx, &ops[n++]));
    DNN(tensor(g, -1, F32, s_dim, s_str, true, false, &sub));
    DNN(pointwise(g, CUDNN_POINTWISE_SUB, F32, -1, s2, mx, NULL, sub, &ops[n++]));
    DNN(tensor(g, -1, F32, s_dim, s_str, true, false, &ex));
    DNN(pointwise(g, CUDNN_POINTWISE_EXP, F32, -1, sub, NULL, NULL, ex, &ops[n++]));
    DNN(tensor(g, -1, F32, r_dim, r_str, true, false, &sum));
    DNN(reduction(g, CUDNN_REDUCE_TENSOR_ADD, ex, sum, &ops[n++]));
    DNN(tensor(g, -1, F32, r_dim, r_str, true, false, &lg));
    DNN(pointwise(g, CUDNN_POINTWISE_LOG, F32, -1, sum, NULL, NULL, lg, &ops[n++]));
    DNN(tensor(g, -1, F32, r_dim, r_str, true, false, &stats));
    DNN(pointwise(g, CUDNN_POINTWISE_ADD, F32, -1, mx, lg, NULL, stats, &ops[n++]));
    DNN(tensor(g, -1, BF, s_dim, s_str, true, false, &p));
    DNN(pointwise(g, CUDNN_POINTWISE_DIV, F32, -1, ex, sum, NULL, p, &ops[n++]));
    /* O = P V */
    DNN(matmul(g, p, tv, to, &ops[n++]));
done:
    *n_ops = n;
    return st;
}

/* The finalized operation graph of ops[0..n_ops) and the heuristics query over it, in *heur. */
static kvb_status graph_heuristics(graph_b *g, bdesc *ops, int n_ops, bdesc *heur, kvb_err *err) {
    kvb_status st = KVB_OK;
    kvb_cudnn_attn *a = g->a;
    bdesc graph;
    DNN(make(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &graph));
    DNN(SET(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n_ops, ops));
    DNN(SET(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &a->h));
    DNN(a->api.Finalize(graph));
    DNN(make(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, heur));
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    DNN(SET(*heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph));
    DNN(SET(*heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode));
    DNN(a->api.Finalize(*heur));
done:
    return st;
}

/* The first of the heuristics' engine configurations that finalizes into an execution plan:
 * slot->plan and slot->ws_bytes. */
static kvb_status pick_plan(graph_b *g, bdesc heur, kvb_err *err) {
    kvb_status st = KVB_OK;
    kvb_cudnn_attn *a = g->a;
    plan_slot *slot = g->slot;
    enum { MAX_CFG = 8 };
    bdesc cfgs[MAX_CFG];
    int64_t n_cfg = 0;
    for (int i = 0; i < MAX_CFG; i++) DNN(make(g, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &cfgs[i]));
    DNN(a->api.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, MAX_CFG, &n_cfg, cfgs));
    cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
    char why[512] = "";
    for (int64_t i = 0; i < n_cfg && i < MAX_CFG; i++) {
        bdesc plan = NULL;
        cudnnStatus_t s = a->api.CreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan);
        if (s == CUDNN_STATUS_SUCCESS) s = a->api.SetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                                                               CUDNN_TYPE_HANDLE, 1, &a->h);
        if (s == CUDNN_STATUS_SUCCESS)
            s = a->api.SetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                    &cfgs[i]);
        if (s == CUDNN_STATUS_SUCCESS) s = a->api.Finalize(plan);
        int64_t ws = 0, got = 0;
        if (s == CUDNN_STATUS_SUCCESS)
            s = a->api.GetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got, &ws);
        if (s == CUDNN_STATUS_SUCCESS) {
            slot->plan = plan;
            slot->ws_bytes = ws;
            return KVB_OK;
        }
        last = s;
        a->api.GetLastErrorString(why, sizeof why);
        if (plan) a->api.DestroyDescriptor(plan);
    }
    st = kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                     "cuDNN: no engine for attention H %lld/%lld D %lld, %lld queries over %lld keys "
                     "(%lld configurations tried, last: %s%s%s)",
                     (long long)slot->H, (long long)slot->Hkv, (long long)slot->D, (long long)slot->s_q,
                     (long long)slot->s_kv, (long long)n_cfg, a->api.GetErrorString(last), why[0] ? ": " : "", why);
done:
    return st;
}

/* Builds the execution plan for one shape into slot (plan and workspace size). The descriptors
 * stay with the slot (freed by slot_clear). */
static kvb_status build_plan(kvb_cudnn_attn *a, plan_slot *slot, kvb_err *err) {
    graph_b g = {a, slot, UID_VIRTUAL};
    bdesc ops[16], heur;
    int n_ops = 0;
    kvb_status st = graph_ops(&g, ops, &n_ops, err);
    if (!st) st = graph_heuristics(&g, ops, n_ops, &heur, err);
    if (!st) st = pick_plan(&g, heur, err);
    return st;
}

/* ---- the contract ---------------------------------------------------------------------------- */

kvb_status kvb_cudnn_attn_create(cudaStream_t stream, int Hkv, int D, uint32_t max_q, uint32_t max_kv,
                                 kvb_cudnn_attn **out, size_t *scratch_bytes, kvb_err *err) {
    *out = NULL;
    if (scratch_bytes) *scratch_bytes = 0;
    if (Hkv <= 0 || D <= 0 || D % 8 || max_kv == 0 || max_q == 0)
        return kvb_err_set(err, KVB_ERR_INVALID, "cuDNN attention: bad shape (Hkv %d, D %d, max_kv %u)", Hkv, D, max_kv);
    const char *plans = getenv("KVB_CUDNN_PLANS");
    if (plans && *plans && strcmp(plans, "eager") && strcmp(plans, "deferred"))
        return kvb_err_set(err, KVB_ERR_INVALID, "KVB_CUDNN_PLANS must be eager or deferred, got '%s'", plans);
    const bool eager = plans && !strcmp(plans, "eager");
    kvb_cudnn_attn *a = calloc(1, sizeof *a);
    if (!a) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    kvb_status st = load_api(&a->api, err);
    if (st) {
        free(a);
        return st;
    }
    a->st = stream;
    a->Hkv = Hkv;
    a->D = D;
    a->max_kv = max_kv;
    a->max_q = max_q;
    a->eager = eager;
    const size_t bytes = (size_t)Hkv * max_kv * (size_t)D * 2;
    {
        cudnnStatus_t s = a->api.Create(&a->h);
        if (s != CUDNN_STATUS_SUCCESS) {
            a->h = NULL;
            st = dnn_fail(a, err, s, "cudnnCreate", __LINE__);
            goto fail;
        }
        if ((s = a->api.SetStream(a->h, stream)) != CUDNN_STATUS_SUCCESS) {
            st = dnn_fail(a, err, s, "cudnnSetStream", __LINE__);
            goto fail;
        }
    }
    KVB_CU_GOTO(cudaMalloc(&a->k, bytes));
    KVB_CU_GOTO(cudaMalloc(&a->v, bytes));
    {
        const size_t v = a->api.GetVersion();
        snprintf(a->version, sizeof a->version, "cuDNN %zu.%zu.%zu", v / 10000, v / 100 % 100, v % 100);
    }
    if (scratch_bytes) *scratch_bytes = 2 * bytes;
    *out = a;
    return KVB_OK;
fail:
    kvb_cudnn_attn_free(a);
    return st;
}

void kvb_cudnn_attn_free(kvb_cudnn_attn *a) {
    if (!a) return;
    if (a->st) cudaStreamSynchronize(a->st);
    if (a->api.lib)
        for (int i = 0; i < PLAN_CACHE; i++) slot_clear(a, &a->slots[i]);
    if (a->h) a->api.Destroy(a->h);
    cudaFree(a->k);
    cudaFree(a->v);
    cudaFree(a->ws);
    if (a->api.lib) dlclose(a->api.lib);
    free(a);
}

uint32_t kvb_cudnn_attn_plans_built(const kvb_cudnn_attn *a) { return a ? a->plans_built : 0; }

const char *kvb_cudnn_attn_describe(kvb_cudnn_attn *a) {
    if (!a) return "cuDNN: not loaded";
    snprintf(a->describe, sizeof a->describe,
             "%s fused attention (%u execution plans built, %.3f s; %llu calls on a new shape left to the engine's "
             "kernel)",
             a->version, a->plans_built, a->build_s, (unsigned long long)a->declined);
    return a->describe;
}

bool kvb_cudnn_attn_take(kvb_cudnn_attn *a, int H, int n, int pos0, int layers) {
    if (!a || n <= 0) return false;
    const int s_kv = pos0 + n;
    for (int i = 0; i < PLAN_CACHE; i++) {
        const plan_slot *p = &a->slots[i];
        if (p->H == H && p->s_q == n && p->s_kv == s_kv) return true; /* built (or refused: run says why) */
    }
    /* the call's attention work: 2 matmuls x 2 flops x H x D per (query, key) pair, a query at p
     * reading p + 1 keys, over `layers` layers */
    const double work = 4.0 * H * a->D * (double)n * ((double)pos0 + (n + 1) / 2.0) * layers;
    if (a->eager || work >= KVB_CUDNN_EAGER_FLOPS) return true;
    for (uint32_t i = 0; i < SEEN_CAP; i++)
        if (a->seen[i].H == H && a->seen[i].s_q == n && a->seen[i].s_kv == s_kv) {
            a->seen[i].H = 0; /* the second time: it recurs, so its plan pays */
            return true;
        }
    a->seen[a->seen_next].H = H;
    a->seen[a->seen_next].s_q = n;
    a->seen[a->seen_next].s_kv = s_kv;
    a->seen_next = (a->seen_next + 1) % SEEN_CAP;
    a->declined++;
    return false;
}

/* The slot holding this shape's plan, built now if absent (the least recently used slot is
 * replaced). */
static kvb_status get_plan(kvb_cudnn_attn *a, int H, int s_q, int s_kv, plan_slot **out, kvb_err *err) {
    plan_slot *victim = &a->slots[0];
    for (int i = 0; i < PLAN_CACHE; i++) {
        plan_slot *p = &a->slots[i];
        if (p->H == H && p->Hkv == a->Hkv && p->D == a->D && p->s_q == s_q && p->s_kv == s_kv) {
            p->last_use = ++a->clock;
            if (p->unsupported)
                return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "cuDNN: no plan for attention H %d/%d D %d, %d x %d (see "
                                   "the first refusal's message)", H, a->Hkv, a->D, s_q, s_kv);
            *out = p;
            return KVB_OK;
        }
        if (p->last_use < victim->last_use) victim = p;
    }
    slot_clear(a, victim);
    victim->H = H;
    victim->Hkv = a->Hkv;
    victim->D = a->D;
    victim->s_q = s_q;
    victim->s_kv = s_kv;
    victim->last_use = ++a->clock;
    const double t0 = kvb_now_s();
    kvb_status st = build_plan(a, victim, err);
    a->build_s += kvb_now_s() - t0;
    a->plans_built += st == KVB_OK;
    if (st) { /* whatever the reason, this shape has no plan: remembered, and the caller falls back */
        const plan_slot keep = {.H = victim->H, .Hkv = victim->Hkv, .D = victim->D, .s_q = victim->s_q, .s_kv = victim->s_kv};
        slot_clear(a, victim);
        *victim = keep;
        victim->last_use = a->clock;
        victim->unsupported = true;
        err->code = KVB_ERR_UNSUPPORTED;
        return KVB_ERR_UNSUPPORTED;
    }
    *out = victim;
    return KVB_OK;
}

kvb_status kvb_cudnn_attn_run(kvb_cudnn_attn *a, const kvb_cu_attn_args *args, kvb_err *err) {
    if (args->n <= 0) return KVB_OK;
    if (args->window > 0)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "cuDNN attention: sliding-window layers use the engine's kernel");
    if (args->Hkv != a->Hkv || args->D != a->D || args->H % args->Hkv || args->pos0 < 0)
        return kvb_err_set(err, KVB_ERR_INVALID, "cuDNN attention: shape differs from the one it was created for");
    const long long s_kv = (long long)args->pos0 + args->n;
    if (s_kv > a->max_kv || (uint32_t)args->n > a->max_q)
        return kvb_err_set(err, KVB_ERR_RANGE, "cuDNN attention: %d queries over %lld keys exceed the buffers' %u x %u",
                           args->n, s_kv, a->max_q, a->max_kv);
    /* The plan's shape is the exact (queries, keys). Padding the shapes so that nearby lengths
     * share plans, with the true lengths passed to the mask, was tried on the H200 (2026-12-03)
     * and was wrong (rel-L2 3.8 at the first query): the fused engine evidently places the
     * causal diagonal from the tensors' dimensions, not from the s_q / s_kv values. */
    plan_slot *p = NULL;
    kvb_status st = get_plan(a, args->H, args->n, (int)s_kv, &p, err);
    if (st) return st;
    if (!p) return kvb_err_set(err, KVB_ERR_INTERNAL, "cuDNN attention: no plan");
    if ((size_t)p->ws_bytes > a->ws_cap) {
        cudaFree(a->ws);
        a->ws = NULL;
        a->ws_cap = 0;
        KVB_CU(cudaMalloc(&a->ws, (size_t)p->ws_bytes));
        a->ws_cap = (size_t)p->ws_bytes;
    }
    /* K/V of positions 0 .. s_kv-1 into the scratch, laid out (kv_head, s_kv, D): the plan's
     * strides for this shape */
    KVB_CU(kvb_cu_gather_kv(&args->cache, args->layer, (int)s_kv, a->k, a->v, a->st));
    float scale = args->scale > 0 ? args->scale : 1.0f / sqrtf((float)args->D), neg_inf = -INFINITY;
    int32_t skv32 = (int32_t)s_kv, sq32 = args->n;
    int64_t uids[8] = {UID_Q, UID_K, UID_V, UID_O, UID_SCALE, UID_NEG_INF, UID_S_KV, UID_S_Q};
    void *ptrs[8] = {(void *)args->q, a->k, a->v, args->out, &scale, &neg_inf, &skv32, &sq32};
    bdesc vp = NULL;
    {
        cudnnStatus_t s = a->api.CreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
        if (s) return dnn_fail(a, err, s, "create variant pack", __LINE__);
    }
    DNN(a->api.SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 8, uids));
    DNN(a->api.SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 8, ptrs));
    DNN(a->api.SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &a->ws));
    DNN(a->api.Finalize(vp));
    DNN(a->api.Execute(a->h, p->plan, vp));
done:
    a->api.DestroyDescriptor(vp);
    return st;
}

#endif
