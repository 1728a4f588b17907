/* core/pool.c — a fixed pool of worker threads running one parallel-for at a time. Workers
 * spin briefly then sleep on a condition variable, so decode's many small loops stay cheap. */
#define _POSIX_C_SOURCE 200809L
#include "kvb_core.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

struct kvb_pool {
    int n_threads;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t cv_work;
    pthread_cond_t cv_done;
    /* current job */
    kvb_task_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next_task;
    atomic_int n_active; /* helpers still inside the current job */
    atomic_uint generation;
    bool stop;
};

typedef struct {
    kvb_pool *pool;
    int worker;
} worker_arg;

static void run_tasks(kvb_pool *p, int worker) {
    for (;;) {
        int t = atomic_fetch_add_explicit(&p->next_task, 1, memory_order_relaxed);
        if (t >= p->n_tasks) break;
        p->fn(p->ctx, t, worker);
    }
}

static void *worker_main(void *arg) {
    worker_arg *wa = arg;
    kvb_pool *p = wa->pool;
    int worker = wa->worker;
    free(wa);
    unsigned seen = 0;
    for (;;) {
        /* spin a little before sleeping */
        unsigned g = 0;
        for (int spin = 0; spin < 20000; spin++) {
            g = atomic_load_explicit(&p->generation, memory_order_acquire);
            if (g != seen) break;
        }
        if (g == seen) {
            pthread_mutex_lock(&p->mu);
            while (!p->stop && atomic_load(&p->generation) == seen) pthread_cond_wait(&p->cv_work, &p->mu);
            pthread_mutex_unlock(&p->mu);
            g = atomic_load(&p->generation);
        }
        if (p->stop) return NULL;
        seen = g;
        run_tasks(p, worker);
        if (atomic_fetch_sub_explicit(&p->n_active, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

kvb_status kvb_pool_create(int n_threads, kvb_pool **out, kvb_err *err) {
    *out = NULL;
    if (n_threads < 1 || n_threads > 1024)
        return kvb_err_set(err, KVB_ERR_INVALID, "thread count %d is out of range (1..1024)", n_threads);
    kvb_pool *p = calloc(1, sizeof *p);
    if (!p) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory creating thread pool");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    p->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!p->threads) {
        free(p);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory creating thread pool");
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (wa) *wa = (worker_arg){.pool = p, .worker = i}; /* before the thread can read (and free) it */
        if (!wa || pthread_create(&p->threads[i], NULL, worker_main, wa) != 0) {
            free(wa);
            p->n_threads = i; /* destroy joins the ones started */
            kvb_pool_destroy(p);
            return kvb_err_set(err, KVB_ERR_INTERNAL, "could not start worker thread %d", i);
        }
    }
    *out = p;
    return KVB_OK;
}

void kvb_pool_destroy(kvb_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    atomic_fetch_add(&p->generation, 1);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    free(p->threads);
    free(p);
}

int kvb_pool_size(const kvb_pool *p) { return p ? p->n_threads : 1; }

void kvb_pool_parallel_for(kvb_pool *p, int n_tasks, kvb_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next_task, 0);
    atomic_store(&p->n_active, p->n_threads - 1);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    run_tasks(p, 0);
    /* wait for helpers: spin, then sleep */
    for (int spin = 0; spin < 200000 && atomic_load_explicit(&p->n_active, memory_order_acquire) > 0; spin++) {
    }
    if (atomic_load(&p->n_active) > 0) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->n_active) > 0) pthread_cond_wait(&p->cv_done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}
