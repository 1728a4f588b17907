/* engine/cuda/tp_group.c — the ranks of a tensor-parallel CUDA engine: one host thread per rank
 * (its device current for its whole life), a job board that runs one function on every rank at
 * once and waits for all of them, and the leader's calls built on it. A rank that fails outside
 * its layer hook may leave the others waiting in an all-reduce: the failing rank aborts the
 * communicator at once, so they return, and the group refuses further work with the first error.
 * See tp_group.h. */
#include "tp_group.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

typedef kvb_status (*rank_job)(kvb_tp_group *g, int r, void *ctx, kvb_err *err);

struct kvb_tp_group {
    int n;
    int device[KVB_TP_MAX_RANKS];
    kvb_cuda_engine *rank[KVB_TP_MAX_RANKS];
    kvb_tp_comm *comm;
    const kvb_model *m;
    kvb_cuda_opts o;
    /* the job board */
    pthread_t th[KVB_TP_MAX_RANKS];
    int n_threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t gen;    /* bumped for each job */
    int n_done;      /* ranks finished with job gen */
    bool quit;
    rank_job job;
    void *job_ctx;
    kvb_status st[KVB_TP_MAX_RANKS];
    kvb_err err[KVB_TP_MAX_RANKS];
    /* a failure that broke lockstep: every later call returns it */
    kvb_status broken;
    kvb_err broken_err;
};

struct kvb_tp_seq {
    kvb_cuda_seq *s[KVB_TP_MAX_RANKS];
};

typedef struct {
    kvb_tp_group *g;
    int r;
} rank_arg;

static void *rank_main(void *arg) {
    rank_arg a = *(rank_arg *)arg;
    free(arg);
    kvb_tp_group *g = a.g;
    const int r = a.r;
    cudaError_t ce = cudaSetDevice(g->device[r]);
    uint64_t seen = 0;
    pthread_mutex_lock(&g->mu);
    for (;;) {
        while (g->gen == seen && !g->quit) pthread_cond_wait(&g->cv, &g->mu);
        if (g->quit) break;
        seen = g->gen;
        rank_job job = g->job;
        void *ctx = g->job_ctx;
        pthread_mutex_unlock(&g->mu);
        kvb_err e = {0};
        kvb_status st = ce != cudaSuccess ? kvb_cu_fail(&e, ce, "cudaSetDevice (a rank's thread)", __FILE__, __LINE__)
                                          : job(g, r, ctx, &e);
        pthread_mutex_lock(&g->mu);
        g->st[r] = st;
        g->err[r] = e;
        g->n_done++;
        pthread_cond_broadcast(&g->cv);
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

/* Runs job on every rank at once and waits for all; returns the lowest rank's error. */
static kvb_status run_all(kvb_tp_group *g, rank_job job, void *ctx, kvb_err *err) {
    if (g->broken) {
        *err = g->broken_err;
        return g->broken;
    }
    pthread_mutex_lock(&g->mu);
    g->job = job;
    g->job_ctx = ctx;
    g->n_done = 0;
    g->gen++;
    pthread_cond_broadcast(&g->cv);
    while (g->n_done < g->n) pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
    for (int r = 0; r < g->n; r++)
        if (g->st[r]) {
            *err = g->err[r];
            return g->st[r];
        }
    return KVB_OK;
}

/* A rank's failure that may leave others in an all-reduce: abort it, and mark the group broken. */
static void rank_failed(kvb_tp_group *g, int r, kvb_status st, const kvb_err *e) {
    if (g->comm) kvb_tp_comm_abort(g->comm);
    pthread_mutex_lock(&g->mu);
    if (!g->broken) {
        g->broken = st;
        g->broken_err = *e;
        size_t len = strlen(g->broken_err.msg);
        snprintf(g->broken_err.msg + len, sizeof g->broken_err.msg - len,
                 " (tensor-parallel rank %d; the engine must be recreated)", r);
    }
    pthread_mutex_unlock(&g->mu);
}

/* ---- create / free ------------------------------------------------------------------------ */

static kvb_status job_create(kvb_tp_group *g, int r, void *ctx, kvb_err *err) {
    (void)ctx;
    kvb_cuda_opts o = g->o;
    o.device = g->device[r];
    return kvb_cu_engine_create_rank(g->m, &o, r, g->n, g->comm, &g->rank[r], err);
}

static kvb_status job_free(kvb_tp_group *g, int r, void *ctx, kvb_err *err) {
    (void)ctx, (void)err;
    kvb_cuda_engine_free(g->rank[r]);
    g->rank[r] = NULL;
    return KVB_OK;
}

kvb_status kvb_tp_group_create(const kvb_model *m, const kvb_cuda_opts *o, kvb_tp_group **out, kvb_err *err) {
    *out = NULL;
    if (o->n_gpus < 2 || o->n_gpus > KVB_TP_MAX_RANKS)
        return kvb_err_set(err, KVB_ERR_INVALID, "a tensor-parallel group needs 2..%d ranks, got %d",
                           KVB_TP_MAX_RANKS, o->n_gpus);
    int n_dev = 0;
    KVB_CU(cudaGetDeviceCount(&n_dev));
    if (!o->tp_one_device && o->device + o->n_gpus > n_dev)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "--gpus %d from device %d needs %d CUDA devices; this host has %d (--tp-one-device "
                           "runs every rank on one GPU, for testing)",
                           o->n_gpus, o->device, o->device + o->n_gpus, n_dev);
    kvb_tp_group *g = calloc(1, sizeof *g);
    if (!g) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    g->n = o->n_gpus;
    g->m = m;
    g->o = *o;
    /* the pool for converting weights is per rank: share the CPUs among them */
    if (g->o.n_threads <= 0) g->o.n_threads = kvb_cpu_count() / g->n > 0 ? kvb_cpu_count() / g->n : 1;
    for (int r = 0; r < g->n; r++) g->device[r] = o->tp_one_device ? o->device : o->device + r;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    kvb_status st = kvb_tp_comm_create(o->tp_one_device ? KVB_TP_COMM_LOCAL : KVB_TP_COMM_NCCL, g->n, g->device,
                                       (size_t)o->max_batch * m->d.n_embd, &g->comm, err);
    for (int r = 0; !st && r < g->n; r++) {
        rank_arg *a = malloc(sizeof *a);
        if (!a) {
            st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
            break;
        }
        *a = (rank_arg){g, r};
        if (pthread_create(&g->th[r], NULL, rank_main, a)) {
            free(a);
            st = kvb_err_set(err, KVB_ERR_INTERNAL, "cannot start the thread of tensor-parallel rank %d", r);
            break;
        }
        g->n_threads++;
    }
    if (!st) st = run_all(g, job_create, NULL, err);
    if (st) {
        kvb_tp_group_free(g);
        return st;
    }
    *out = g;
    return KVB_OK;
}

void kvb_tp_group_free(kvb_tp_group *g) {
    if (!g) return;
    if (g->n_threads == g->n) {
        kvb_err e = {0};
        g->broken = KVB_OK; /* free runs even on a broken group */
        run_all(g, job_free, NULL, &e);
    }
    pthread_mutex_lock(&g->mu);
    g->quit = true;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    for (int r = 0; r < g->n_threads; r++) pthread_join(g->th[r], NULL);
    for (int r = 0; r < g->n; r++) kvb_cuda_engine_free(g->rank[r]); /* only if a thread never ran */
    kvb_tp_comm_free(g->comm);
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

kvb_cuda_engine *kvb_tp_group_rank(kvb_tp_group *g, int r) { return g->rank[r]; }
const char *kvb_tp_group_describe(const kvb_tp_group *g) { return kvb_tp_comm_describe(g->comm); }

/* ---- sequences ---------------------------------------------------------------------------- */

static kvb_status job_seq_create(kvb_tp_group *g, int r, void *ctx, kvb_err *err) {
    kvb_tp_seq *s = ctx;
    return kvb_cuda_seq_create(g->rank[r], &s->s[r], err);
}

static kvb_status job_seq_free(kvb_tp_group *g, int r, void *ctx, kvb_err *err) {
    (void)g, (void)err;
    kvb_tp_seq *s = ctx;
    kvb_cuda_seq_free(s->s[r]);
    s->s[r] = NULL;
    return KVB_OK;
}

kvb_status kvb_tp_seq_create(kvb_tp_group *g, kvb_tp_seq **out, kvb_err *err) {
    *out = NULL;
    kvb_tp_seq *s = calloc(1, sizeof *s);
    if (!s) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory creating a sequence");
    kvb_status st = run_all(g, job_seq_create, s, err);
    if (st) {
        kvb_tp_seq_free(g, s);
        return st;
    }
    *out = s;
    return KVB_OK;
}

void kvb_tp_seq_free(kvb_tp_group *g, kvb_tp_seq *s) {
    if (!s) return;
    kvb_status broken = g->broken;
    g->broken = KVB_OK; /* releasing blocks is host work plus a free: it runs on a broken group too */
    kvb_err e = {0};
    run_all(g, job_seq_free, s, &e);
    g->broken = broken;
    free(s);
}

kvb_cuda_seq *kvb_tp_seq_rank(kvb_tp_seq *s, int r) { return s->s[r]; }

kvb_status kvb_tp_attach_cached(kvb_tp_group *g, kvb_tp_seq *s, const int32_t *tokens, uint32_t n,
                                uint32_t *n_cached, kvb_err *err) {
    *n_cached = 0;
    if (g->broken) {
        *err = g->broken_err;
        return g->broken;
    }
    uint32_t first = 0;
    for (int r = 0; r < g->n; r++) { /* host bookkeeping only: no device work */
        uint32_t got = 0;
        kvb_status st = kvb_cuda_seq_attach_cached(s->s[r], tokens, n, &got, err);
        if (st) return st;
        if (r == 0) first = got;
        else if (got != first)
            return kvb_err_set(err, KVB_ERR_INTERNAL,
                               "tensor-parallel ranks disagree on the cached prefix (rank 0: %u tokens, rank %d: %u)",
                               first, r, got);
    }
    *n_cached = first;
    return KVB_OK;
}

/* ---- forward ------------------------------------------------------------------------------ */

typedef struct {
    kvb_tp_seq *s;
    const int32_t *tokens;
    uint32_t n;
    float *logits;
    bool all_logits;
} fwd_job;

/* Past the leader's checks every rank's forward is in lockstep: a failure other than a hook's
 * breaks it. */
static kvb_status job_forward(kvb_tp_group *g, int r, void *ctx, kvb_err *err) {
    const fwd_job *j = ctx;
    kvb_cu_engine_set_group_wants_logits(g->rank[r], j->logits != NULL);
    kvb_status st = kvb_cuda_forward(g->rank[r], j->s->s[r], j->tokens, j->n, r == 0 ? j->logits : NULL,
                                     j->all_logits, err);
    if (st && !kvb_cu_engine_hook_failed(g->rank[r])) rank_failed(g, r, st, err);
    return st;
}

kvb_status kvb_tp_forward(kvb_tp_group *g, kvb_tp_seq *s, const int32_t *tokens, uint32_t n, float *logits,
                          bool all_logits, kvb_err *err) {
    if (g->broken) {
        *err = g->broken_err;
        return g->broken;
    }
    /* what would fail on every rank alike (bad input, no free blocks) is refused here, before any
     * rank starts, so it leaves the group usable */
    kvb_status st = kvb_cu_forward_check(g->rank[0], s->s[0], tokens, n, err);
    if (st) return st;
    fwd_job j = {s, tokens, n, logits, all_logits};
    return run_all(g, job_forward, &j, err);
}
