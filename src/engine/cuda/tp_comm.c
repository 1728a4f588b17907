/* engine/cuda/tp_comm.c — the tensor-parallel all-reduce (tp_comm.h): NCCL, loaded with dlopen, or
 * the engine's own (LOCAL). LOCAL, per call, on rank r (host thread r, stream s):
 *   record ev_ready[r] on s; slot[r] = buf; barrier
 *   s waits for every other rank's ev_ready (their buffers hold this call's inputs)
 *   scratch[r] = ((slot[0] + slot[1]) + slot[2]) ... (kvb_cu_sum_f32: fixed order, the same bits on
 *   every rank); record ev_read[r] on s; barrier
 *   s waits for every other rank's ev_read (nobody overwrites its buffer while another rank still
 *   reads it); buf = scratch[r] (a device-to-device copy on s)
 * A rank cannot re-record its events, or rewrite its slot, before every rank has passed the barrier
 * after which the others read them, so each wait sees this call's record. The barrier is a mutex, a
 * condition variable and a generation counter; a failure (any rank's error, or kvb_tp_comm_abort)
 * is sticky and wakes every waiter.
 * NCCL: each rank's ncclAllReduce runs under that rank's lock, so an abort never frees a
 * communicator a rank is using: kvb_tp_comm_abort aborts the ones it can lock, and a rank that held
 * its lock meanwhile aborts its own on the way out. */
#include "tp_comm.h"

#include <dlfcn.h>
#include <errno.h>
#include <glob.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

#if defined(__has_include)
#if __has_include(<nccl.h>)
#define KVB_HAVE_NCCL_HEADERS 1
#endif
#endif

#ifdef KVB_HAVE_NCCL_HEADERS
#include <nccl.h>

/* The NCCL entry points this file uses, resolved from libnccl.so.2. */
typedef struct {
    void *lib;
    int version; /* ncclGetVersion's code */
    ncclResult_t (*GetVersion)(int *);
    const char *(*GetErrorString)(ncclResult_t);
    const char *(*GetLastError)(ncclComm_t); /* optional (NCCL 2.13+): NULL when absent */
    ncclResult_t (*CommInitAll)(ncclComm_t *, int, const int *);
    ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    ncclResult_t (*CommAbort)(ncclComm_t);
} nccl_api;
#endif

#define TP_MAX KVB_CUDA_MAX_GPUS

struct kvb_tp_comm {
    kvb_tp_comm_kind kind;
    int n;
    int dev[TP_MAX];
    size_t max_count;
    /* under mu: the barrier (LOCAL) and the sticky failure */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    unsigned long gen;
    bool failed;
    char why[320]; /* "was aborted" / "failed at rank r: ..." */
    /* LOCAL, per rank, on its device */
    float *scratch[TP_MAX];                    /* (max_count) f32 */
    cudaEvent_t ev_ready[TP_MAX], ev_read[TP_MAX];
    float *slot[TP_MAX];                       /* the buffers of the call in progress */
    /* NCCL */
    pthread_mutex_t rank_mu[TP_MAX]; /* held around rank r's NCCL calls on nccl[r] */
#ifdef KVB_HAVE_NCCL_HEADERS
    nccl_api api;
    ncclComm_t nccl[TP_MAX]; /* NULL once aborted or destroyed */
#endif
    char describe[160];
};

/* ---- failure and the barrier ------------------------------------------------------------------ */

/* Marks c failed (the first reason is kept) and wakes every rank in the barrier. */
static void mark_failed(kvb_tp_comm *c, const char *why) {
    pthread_mutex_lock(&c->mu);
    if (!c->failed) {
        c->failed = true;
        snprintf(c->why, sizeof c->why, "%s", why);
    }
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static bool is_failed(kvb_tp_comm *c) {
    pthread_mutex_lock(&c->mu);
    const bool f = c->failed;
    pthread_mutex_unlock(&c->mu);
    return f;
}

/* What a rank's call returns on a failed communicator. */
static kvb_status dead(kvb_tp_comm *c, int rank, kvb_err *err) {
    char why[sizeof c->why];
    pthread_mutex_lock(&c->mu);
    memcpy(why, c->why, sizeof why);
    pthread_mutex_unlock(&c->mu);
    return kvb_err_set(err, KVB_ERR_IO, "tensor-parallel all-reduce (rank %d): the communicator %s", rank, why);
}

/* Waits until all n ranks have arrived; false, at once, when the communicator fails before or
 * meanwhile. */
static bool barrier(kvb_tp_comm *c) {
    pthread_mutex_lock(&c->mu);
    if (!c->failed) {
        const unsigned long gen = c->gen;
        if (++c->arrived == c->n) {
            c->arrived = 0;
            c->gen++;
            pthread_cond_broadcast(&c->cv);
        } else {
            while (gen == c->gen && !c->failed) pthread_cond_wait(&c->cv, &c->mu);
        }
    }
    const bool ok = !c->failed;
    pthread_mutex_unlock(&c->mu);
    return ok;
}

static void abort_nccl(kvb_tp_comm *c, int rank, bool wait);

/* Rank r's call failed with err (r < 0: a call that named no valid rank): the communicator fails
 * with it, so the other ranks stop too. */
static kvb_status fail_rank(kvb_tp_comm *c, int r, kvb_status st, const kvb_err *err) {
    char why[sizeof c->why];
    if (r >= 0) snprintf(why, sizeof why, "failed at rank %d: %.280s", r, err->msg);
    else snprintf(why, sizeof why, "failed: %.280s", err->msg);
    mark_failed(c, why);
    for (int i = 0; i < c->n; i++) abort_nccl(c, i, i == r);
    return st;
}

/* ---- NCCL --------------------------------------------------------------------------------------- */

#ifndef KVB_HAVE_NCCL_HEADERS

static kvb_status nccl_create(kvb_tp_comm *c, kvb_err *err) {
    (void)c;
    return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                       "NCCL all-reduce: this build had no NCCL headers (nccl.h); use the in-engine all-reduce");
}
static kvb_status nccl_allreduce(kvb_tp_comm *c, int r, float *buf, size_t count, cudaStream_t s, kvb_err *err) {
    (void)c, (void)r, (void)buf, (void)count, (void)s;
    return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "NCCL all-reduce: not built");
}
static void abort_nccl(kvb_tp_comm *c, int rank, bool wait) { (void)c, (void)rank, (void)wait; }
static void nccl_free(kvb_tp_comm *c) { (void)c; }

#else

static pthread_mutex_t g_nccl_mu = PTHREAD_MUTEX_INITIALIZER;
static nccl_api g_nccl; /* loaded once, never unloaded: NCCL keeps process-wide state */

static kvb_status nccl_fail(const nccl_api *a, kvb_err *err, ncclResult_t r, const char *what, ncclComm_t comm) {
    const char *last = a->GetLastError ? a->GetLastError(comm) : NULL;
    const kvb_status code = r == ncclInvalidArgument || r == ncclInvalidUsage ? KVB_ERR_INVALID
                            : r == ncclSystemError || r == ncclRemoteError     ? KVB_ERR_IO
                                                                                : KVB_ERR_INTERNAL;
    return kvb_err_set(err, code, "NCCL: %s failed: %s (%d)%s%.300s", what, a->GetErrorString(r), (int)r,
                       last && last[0] ? ": " : "", last ? last : "");
}

/* dlopen with the message of a failure kept in why. */
static void *try_open(const char *path, char *why, size_t cap) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h && why) {
        const char *e = dlerror();
        snprintf(why, cap, "%s", e ? e : "unknown dlopen error");
    }
    return h;
}

/* Tries <dir>/nvidia/nccl/lib/libnccl.so.2 for each directory matching dir_pattern (a glob). */
static void *try_wheels(const char *dir_pattern, int *n_found, char *why, size_t cap) {
    char pat[1024];
    if ((size_t)snprintf(pat, sizeof pat, "%s/nvidia/nccl/lib/libnccl.so.2", dir_pattern) >= sizeof pat) return NULL;
    glob_t g;
    void *h = NULL;
    memset(&g, 0, sizeof g);
    if (glob(pat, 0, NULL, &g) == 0) {
        for (size_t i = 0; i < g.gl_pathc && !h; i++) {
            (*n_found)++;
            h = try_open(g.gl_pathv[i], why, cap);
        }
    }
    globfree(&g);
    return h;
}

/* The pip wheel layouts: the nvidia-nccl-cu* wheels put the library in nvidia/nccl/lib under a
 * site-packages (or Debian's dist-packages) directory. */
static void *open_wheels(int *n_found, char *why, size_t cap) {
    static const char *const fixed[] = {
        "/usr/local/lib/python3*/dist-packages",
        "/usr/lib/python3/dist-packages",
        "/usr/local/lib/python3.*/site-packages",
        "/usr/lib/python3.*/site-packages",
    };
    void *h = NULL;
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0] && !h; i++) h = try_wheels(fixed[i], n_found, why, cap);
    static const char *const prefixes[][2] = {
        {"VIRTUAL_ENV", "/lib/python3*/site-packages"},
        {"CONDA_PREFIX", "/lib/python3*/site-packages"},
        {"HOME", "/.local/lib/python3*/site-packages"},
    };
    char dir[1024];
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0] && !h; i++) {
        const char *p = getenv(prefixes[i][0]);
        if (p && p[0] && (size_t)snprintf(dir, sizeof dir, "%s%s", p, prefixes[i][1]) < sizeof dir)
            h = try_wheels(dir, n_found, why, cap);
    }
    /* each PATH entry's ../lib: a virtual environment whose bin is on PATH */
    const char *path = getenv("PATH");
    char *copy = path ? strdup(path) : NULL, *save = NULL;
    for (char *e = copy ? strtok_r(copy, ":", &save) : NULL; e && !h; e = strtok_r(NULL, ":", &save))
        if ((size_t)snprintf(dir, sizeof dir, "%s/../lib/python3*/site-packages", e) < sizeof dir)
            h = try_wheels(dir, n_found, why, cap);
    free(copy);
    return h;
}

static kvb_status resolve(nccl_api *p, const char *where, kvb_err *err) {
    struct {
        void **fn;
        const char *name;
        bool optional;
    } want[] = {
        {(void **)&p->GetVersion, "ncclGetVersion", false},
        {(void **)&p->GetErrorString, "ncclGetErrorString", false},
        {(void **)&p->GetLastError, "ncclGetLastError", true},
        {(void **)&p->CommInitAll, "ncclCommInitAll", false},
        {(void **)&p->AllReduce, "ncclAllReduce", false},
        {(void **)&p->CommDestroy, "ncclCommDestroy", false},
        {(void **)&p->CommAbort, "ncclCommAbort", false},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        void *f = dlsym(p->lib, want[i].name);
        if (!f && !want[i].optional)
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "NCCL: %s lacks %s", where, want[i].name);
        memcpy(want[i].fn, &f, sizeof f); /* object pointer -> function pointer, as dlsym requires */
    }
    ncclResult_t r = p->GetVersion(&p->version);
    if (r != ncclSuccess) return nccl_fail(p, err, r, "ncclGetVersion", NULL);
    if (p->version < 2000 || p->version >= 30000)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "NCCL: %s reports version code %d; NCCL 2 is needed", where,
                           p->version);
    return KVB_OK;
}

/* Loads libnccl.so.2 into g_nccl (under g_nccl_mu). */
static kvb_status load_locked(kvb_err *err) {
    char why_default[160] = "", why_env[160] = "", why_wheel[160] = "";
    const char *where = "libnccl.so.2";
    const char *env = getenv("KVB_NCCL_LIB");
    int n_found = 0;
    nccl_api p;
    memset(&p, 0, sizeof p);
    p.lib = try_open("libnccl.so.2", why_default, sizeof why_default);
    if (!p.lib && env && env[0]) {
        p.lib = try_open(env, why_env, sizeof why_env);
        where = env;
    }
    if (!p.lib) {
        p.lib = open_wheels(&n_found, why_wheel, sizeof why_wheel);
        where = "a pip wheel's libnccl.so.2";
    }
    if (!p.lib)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "NCCL: cannot load libnccl.so.2. Looked on the default search path (%.100s); in "
                           "$KVB_NCCL_LIB (%.100s); in the pip wheel layouts (nvidia/nccl/lib in the python3 "
                           "site-/dist-packages of /usr/local/lib, /usr/lib, $VIRTUAL_ENV, $CONDA_PREFIX, ~/.local "
                           "and $PATH's ../lib: %s%.100s). Set KVB_NCCL_LIB to the library's full path",
                           why_default, env && env[0] ? why_env : "unset", n_found ? "found but not loaded: " : "none",
                           why_wheel);
    kvb_status st = resolve(&p, where, err);
    if (st) {
        dlclose(p.lib);
        return st;
    }
    g_nccl = p;
    return KVB_OK;
}

static kvb_status nccl_create(kvb_tp_comm *c, kvb_err *err) {
    /* NVLink multicast stays off (it can take a shared host's GPUs out of service), for NCCL and
     * for any child process */
    if (setenv("NCCL_NVLS_ENABLE", "0", 1) != 0)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "NCCL: cannot set NCCL_NVLS_ENABLE=0: %s", strerror(errno));
    pthread_mutex_lock(&g_nccl_mu);
    kvb_status st = g_nccl.lib ? KVB_OK : load_locked(err);
    if (!st) c->api = g_nccl;
    pthread_mutex_unlock(&g_nccl_mu);
    if (st) return st;
    ncclComm_t comms[TP_MAX] = {0};
    ncclResult_t r = c->api.CommInitAll(comms, c->n, c->dev);
    if (r != ncclSuccess) return nccl_fail(&c->api, err, r, "ncclCommInitAll", NULL);
    for (int i = 0; i < c->n; i++) c->nccl[i] = comms[i];
    return KVB_OK;
}

/* Aborts rank r's NCCL communicator once c has failed. wait: block for the rank's lock (the rank's
 * own thread, or free); else skip a rank whose call holds it (it aborts on its way out). */
static void abort_nccl(kvb_tp_comm *c, int r, bool wait) {
    if (c->kind != KVB_TP_COMM_NCCL) return;
    if (wait) pthread_mutex_lock(&c->rank_mu[r]);
    else if (pthread_mutex_trylock(&c->rank_mu[r]) != 0) return;
    if (c->nccl[r]) {
        int prev = -1;
        const bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
        c->api.CommAbort(c->nccl[r]);
        c->nccl[r] = NULL;
        if (have_prev) cudaSetDevice(prev);
    }
    pthread_mutex_unlock(&c->rank_mu[r]);
}

static kvb_status nccl_allreduce(kvb_tp_comm *c, int r, float *buf, size_t count, cudaStream_t s, kvb_err *err) {
    pthread_mutex_lock(&c->rank_mu[r]);
    ncclComm_t comm = is_failed(c) ? NULL : c->nccl[r];
    ncclResult_t res = comm ? c->api.AllReduce(buf, buf, count, ncclFloat32, ncclSum, comm, s) : ncclSuccess;
    kvb_status st = KVB_OK;
    if (comm && res != ncclSuccess) {
        char what[96];
        snprintf(what, sizeof what, "ncclAllReduce (rank %d, %zu floats)", r, count);
        st = nccl_fail(&c->api, err, res, what, comm);
    }
    pthread_mutex_unlock(&c->rank_mu[r]);
    if (st) return fail_rank(c, r, st, err);
    /* an abort that found this rank's lock taken left its communicator to this rank */
    if (is_failed(c)) {
        abort_nccl(c, r, true);
        return dead(c, r, err);
    }
    return KVB_OK;
}

static void nccl_free(kvb_tp_comm *c) {
    const bool failed = is_failed(c);
    for (int r = 0; r < c->n; r++)
        if (c->nccl[r]) {
            if (failed) c->api.CommAbort(c->nccl[r]);
            else c->api.CommDestroy(c->nccl[r]);
            c->nccl[r] = NULL;
        }
}

#endif

/* ---- LOCAL ------------------------------------------------------------------------------------ */

static kvb_status local_create(kvb_tp_comm *c, kvb_err *err) {
    for (int i = 0; i < c->n; i++)
        for (int j = 0; j < c->n; j++) {
            const int a = c->dev[i], b = c->dev[j];
            if (a == b) continue;
            int can = 0;
            KVB_CU(cudaDeviceCanAccessPeer(&can, a, b));
            if (!can)
                return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                                   "in-engine all-reduce: device %d cannot read device %d's memory "
                                   "(cudaDeviceCanAccessPeer says no); use NCCL, or put the ranks on one device",
                                   a, b);
            KVB_CU(cudaSetDevice(a));
            const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled) {
                cudaGetLastError(); /* clear it: already on is what we want */
            } else if (e != cudaSuccess) {
                char what[64];
                snprintf(what, sizeof what, "cudaDeviceEnablePeerAccess(%d -> %d)", a, b);
                return kvb_cu_fail(err, e, what, __FILE__, __LINE__);
            }
        }
    for (int r = 0; r < c->n; r++) {
        KVB_CU(cudaSetDevice(c->dev[r]));
        KVB_CU(cudaMalloc((void **)&c->scratch[r], c->max_count * sizeof(float)));
        KVB_CU(cudaEventCreateWithFlags(&c->ev_ready[r], cudaEventDisableTiming));
        KVB_CU(cudaEventCreateWithFlags(&c->ev_read[r], cudaEventDisableTiming));
    }
    return KVB_OK;
}

static kvb_status local_allreduce(kvb_tp_comm *c, int r, float *buf, size_t count, cudaStream_t s, kvb_err *err) {
    kvb_status st = KVB_OK;
    if (c->n == 1) return KVB_OK;
    KVB_CU_GOTO(cudaEventRecord(c->ev_ready[r], s));
    c->slot[r] = buf;
    if (!barrier(c)) return dead(c, r, err);
    const float *in[TP_MAX];
    for (int i = 0; i < c->n; i++) {
        in[i] = c->slot[i];
        if (i != r) KVB_CU_GOTO(cudaStreamWaitEvent(s, c->ev_ready[i], 0));
    }
    KVB_CU_GOTO(kvb_cu_sum_f32(c->scratch[r], in, c->n, count, s));
    KVB_CU_GOTO(cudaEventRecord(c->ev_read[r], s));
    if (!barrier(c)) return dead(c, r, err);
    for (int i = 0; i < c->n; i++)
        if (i != r) KVB_CU_GOTO(cudaStreamWaitEvent(s, c->ev_read[i], 0));
    KVB_CU_GOTO(cudaMemcpyAsync(buf, c->scratch[r], count * sizeof(float), cudaMemcpyDeviceToDevice, s));
    return KVB_OK;
fail:
    return fail_rank(c, r, st, err);
}

static void local_free(kvb_tp_comm *c) {
    for (int r = 0; r < c->n; r++) {
        if (!c->scratch[r] && !c->ev_ready[r] && !c->ev_read[r]) continue;
        if (cudaSetDevice(c->dev[r]) != cudaSuccess) continue;
        if (c->ev_ready[r]) cudaEventDestroy(c->ev_ready[r]);
        if (c->ev_read[r]) cudaEventDestroy(c->ev_read[r]);
        if (c->scratch[r]) cudaFree(c->scratch[r]);
    }
}

/* ---- the API ---------------------------------------------------------------------------------- */

static void describe(kvb_tp_comm *c) {
    char *d = c->describe;
    const size_t cap = sizeof c->describe;
    size_t k = 0;
#ifdef KVB_HAVE_NCCL_HEADERS
    if (c->kind == KVB_TP_COMM_NCCL) {
        const int v = c->api.version; /* NCCL_VERSION(): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after */
        const int major = v >= 10000 ? v / 10000 : v / 1000, minor = v >= 10000 ? v % 10000 / 100 : v % 1000 / 100;
        k = (size_t)snprintf(d, cap, "NCCL %d.%d.%d all-reduce", major, minor, v % 100);
    }
#endif
    if (c->kind == KVB_TP_COMM_LOCAL) k = (size_t)snprintf(d, cap, "in-engine all-reduce");
    bool one_device = true;
    for (int i = 1; i < c->n; i++) one_device = one_device && c->dev[i] == c->dev[0];
    if (k < cap)
        k += (size_t)snprintf(d + k, cap - k, ", %d rank%s on device%s ", c->n, c->n == 1 ? "" : "s",
                              one_device ? "" : "s");
    for (int i = 0; i < (one_device ? 1 : c->n) && k < cap; i++)
        k += (size_t)snprintf(d + k, cap - k, "%s%d", i ? "," : "", c->dev[i]);
}

kvb_status kvb_tp_comm_create(kvb_tp_comm_kind kind, int n, const int *devices, size_t max_count, kvb_tp_comm **out,
                              kvb_err *err) {
    if (!out) return kvb_err_set(err, KVB_ERR_INVALID, "kvb_tp_comm_create: out is NULL");
    *out = NULL;
    if (kind != KVB_TP_COMM_NCCL && kind != KVB_TP_COMM_LOCAL)
        return kvb_err_set(err, KVB_ERR_INVALID, "tensor-parallel all-reduce: unknown kind %d", (int)kind);
    if (n < 1 || n > TP_MAX || !devices)
        return kvb_err_set(err, KVB_ERR_INVALID, "tensor-parallel all-reduce: %d ranks (1 to %d, each with a device)",
                           n, TP_MAX);
    if (max_count == 0 || max_count > SIZE_MAX / sizeof(float))
        return kvb_err_set(err, KVB_ERR_RANGE, "tensor-parallel all-reduce: max_count %zu", max_count);
    for (int i = 0; kind == KVB_TP_COMM_NCCL && i < n; i++)
        for (int j = 0; j < i; j++)
            if (devices[i] == devices[j])
                return kvb_err_set(err, KVB_ERR_INVALID, "NCCL all-reduce: ranks %d and %d are both on device %d; "
                                   "NCCL needs one device per rank (the in-engine all-reduce takes shared ones)",
                                   j, i, devices[i]);
    char why[256];
    if (!kvb_cuda_device_available(why, sizeof why)) return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s", why);
    int n_dev = 0, prev = 0;
    KVB_CU(cudaGetDeviceCount(&n_dev));
    for (int i = 0; i < n; i++)
        if (devices[i] < 0 || devices[i] >= n_dev)
            return kvb_err_set(err, KVB_ERR_INVALID, "tensor-parallel all-reduce: rank %d's device %d does not exist "
                               "(this host has %d)", i, devices[i], n_dev);
    KVB_CU(cudaGetDevice(&prev));
    kvb_tp_comm *c = calloc(1, sizeof *c);
    if (!c) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory creating the all-reduce");
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    for (int i = 0; i < TP_MAX; i++) pthread_mutex_init(&c->rank_mu[i], NULL);
    c->kind = kind;
    c->n = n;
    c->max_count = max_count;
    memcpy(c->dev, devices, sizeof(int) * (size_t)n);
    kvb_status st = kind == KVB_TP_COMM_NCCL ? nccl_create(c, err) : local_create(c, err);
    const cudaError_t e = cudaSetDevice(prev);
    if (!st && e != cudaSuccess) st = kvb_cu_fail(err, e, "cudaSetDevice (back to the caller's device)", __FILE__,
                                                  __LINE__);
    if (st) {
        kvb_tp_comm_free(c);
        return st;
    }
    describe(c);
    *out = c;
    return KVB_OK;
}

kvb_status kvb_tp_comm_allreduce(kvb_tp_comm *c, int rank, float *buf, size_t count, void *stream, kvb_err *err) {
    if (!c) return kvb_err_set(err, KVB_ERR_INVALID, "tensor-parallel all-reduce: no communicator");
    kvb_err local_err;
    if (!err) err = &local_err; /* its message goes to the other ranks */
    if (rank < 0 || rank >= c->n) {
        /* no rank to blame, and the ranks that are right still wait for this one: fail them */
        kvb_err_set(err, KVB_ERR_INVALID, "tensor-parallel all-reduce: rank %d of %d", rank, c->n);
        return fail_rank(c, -1, KVB_ERR_INVALID, err);
    }
    if (is_failed(c)) return dead(c, rank, err);
    kvb_status st = KVB_OK;
    int cur = -1;
    KVB_CU_GOTO(cudaGetDevice(&cur));
    if (count > c->max_count || (count && !buf) || cur != c->dev[rank]) {
        st = kvb_err_set(err, KVB_ERR_INVALID,
                         "tensor-parallel all-reduce (rank %d): %zu floats at %p (at most %zu) from a thread on device "
                         "%d (the rank's device is %d)",
                         rank, count, (void *)buf, c->max_count, cur, c->dev[rank]);
        goto fail;
    }
    if (count == 0) return KVB_OK;
    return c->kind == KVB_TP_COMM_NCCL ? nccl_allreduce(c, rank, buf, count, (cudaStream_t)stream, err)
                                       : local_allreduce(c, rank, buf, count, (cudaStream_t)stream, err);
fail:
    return fail_rank(c, rank, st, err);
}

void kvb_tp_comm_abort(kvb_tp_comm *c) {
    if (!c) return;
    mark_failed(c, "was aborted");
    for (int r = 0; r < c->n; r++) abort_nccl(c, r, false);
}

void kvb_tp_comm_free(kvb_tp_comm *c) {
    if (!c) return;
    int prev = -1;
    const bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
    if (c->kind == KVB_TP_COMM_NCCL) nccl_free(c);
    else local_free(c);
    if (have_prev) cudaSetDevice(prev);
    for (int i = 0; i < TP_MAX; i++) pthread_mutex_destroy(&c->rank_mu[i]);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

const char *kvb_tp_comm_describe(const kvb_tp_comm *c) { return c ? c->describe : "no all-reduce"; }

int kvb_tp_comm_size(const kvb_tp_comm *c) { return c ? c->n : 0; }

/* ---- test entry point --------------------------------------------------------------------------- */

kvb_status kvb_cuda_test_sum_f32(const float *const *host_in, int n_in, size_t count, size_t misalign,
                                 float *host_out, kvb_err *err) {
    char why[256];
    if (!kvb_cuda_device_available(why, sizeof why)) return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s", why);
    if (n_in < 1 || n_in > TP_MAX || !host_in || !host_out)
        return kvb_err_set(err, KVB_ERR_INVALID, "kvb_cuda_test_sum_f32: %d inputs (1 to %d)", n_in, TP_MAX);
    /* each buffer: 4 guard floats, the misalignment, count floats, guard floats to pad + 4 */
    enum { PAD = 8 };
    const size_t total = count + PAD, bytes = total * sizeof(float);
    float *dev[TP_MAX + 1] = {0}, *back = malloc(bytes);
    const float *in[TP_MAX] = {0};
    float *out = NULL;
    kvb_status st = KVB_OK;
    if (!back) return kvb_err_set(err, KVB_ERR_NOMEM, "kvb_cuda_test_sum_f32: out of memory");
    for (int i = 0; i <= n_in; i++) {
        const bool is_out = i == n_in;
        float *p;
        KVB_CU_GOTO(cudaMalloc((void **)&dev[i], bytes));
        KVB_CU_GOTO(cudaMemset(dev[i], 0xFF, bytes));
        p = dev[i] + 4 + ((misalign >> (is_out ? 8 : i)) & 1);
        if (count) KVB_CU_GOTO(cudaMemcpy(p, is_out ? host_out : host_in[i], count * sizeof(float),
                                          cudaMemcpyHostToDevice));
        if (is_out) out = p;
        else in[i] = p;
    }
    KVB_CU_GOTO(kvb_cu_sum_f32(out, in, n_in, count, 0));
    KVB_CU_GOTO(cudaDeviceSynchronize());
    KVB_CU_GOTO(cudaMemcpy(back, dev[n_in], bytes, cudaMemcpyDeviceToHost));
    {
        const size_t lo = (size_t)(out - dev[n_in]), hi = lo + count;
        for (size_t i = 0; i < total; i++) {
            uint32_t bits;
            memcpy(&bits, &back[i], sizeof bits);
            if ((i < lo || i >= hi) && bits != 0xFFFFFFFFu) {
                st = kvb_err_set(err, KVB_ERR_INTERNAL, "kvb_cu_sum_f32 wrote float %zd of out (count %zu)",
                                 (ptrdiff_t)i - (ptrdiff_t)lo, count);
                goto fail;
            }
        }
        if (count) memcpy(host_out, back + lo, count * sizeof(float));
    }
fail:
    cudaDeviceSynchronize();
    for (int i = 0; i <= n_in; i++) cudaFree(dev[i]);
    free(back);
    return st;
}
