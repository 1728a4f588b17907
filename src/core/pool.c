/* core/pool.c — a fixed pool of worker threads running one parallel-for at a time. Workers
 * spin for up to KVB_POOL_SPIN_S after a job before sleeping on a condition variable, and the
 * dispatcher only takes the mutex when someone sleeps: decode issues hundreds of small loops
 * per token, and a futex wake-up per loop would cost more than the loop itself. A width below the
 * pool's size (kvb_pool_set_width) leaves the workers past it asleep on a condition of their own,
 * neither spinning nor woken per job, until the width takes them in again. */
#define _POSIX_C_SOURCE 200809L
#include "kvb_core.h"

#include <pthread.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define KVB_POOL_SPIN_S 0.002
#include <stdatomic.h>
#include <sched.h>
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
    _Atomic uint64_t generation; /* see POOL_WIDTH_BITS */
    atomic_int n_sleeping; /* workers waiting on cv_work */
    atomic_uint park;      /* bumped by kvb_pool_park: spinning workers go to sleep */
    atomic_int width;      /* workers [0, width) take the next jobs; set between jobs by the dispatcher */
    pthread_cond_t cv_width; /* workers past the width wait here */
    atomic_bool stop;
};

/* `generation` is one word per job: a sequence number above the job's width (the low bits), so a
 * worker reads the two together. A worker left out of a job is not waited for and may look at
 * the word late: read apart, it could pair an old sequence number with a newer job's width. 64
 * bits: a worker asleep past the width through any number of jobs never sees its last word
 * again. */
#define POOL_WIDTH_BITS 11 /* widths up to 1024 threads */
#define POOL_WIDTH_MASK ((1u << POOL_WIDTH_BITS) - 1)

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
    uint64_t seen = 0;
    for (;;) {
        if (worker >= atomic_load(&p->width)) { /* left out: sleep until the width takes this worker in */
            pthread_mutex_lock(&p->mu);
            while (!atomic_load(&p->stop) && worker >= atomic_load(&p->width)) pthread_cond_wait(&p->cv_width, &p->mu);
            pthread_mutex_unlock(&p->mu);
            /* `seen` stays the last job looked at: a job begun meanwhile with this worker in it runs */
        }
        /* spin (with pause) until a new job or the spin deadline */
        uint64_t g = atomic_load_explicit(&p->generation, memory_order_acquire);
        const unsigned parked = atomic_load_explicit(&p->park, memory_order_relaxed);
        double deadline = kvb_now_s() + KVB_POOL_SPIN_S;
        for (unsigned spin = 1; g == seen && !atomic_load_explicit(&p->stop, memory_order_relaxed) &&
                                atomic_load_explicit(&p->park, memory_order_relaxed) == parked;
             spin++) {
            cpu_relax();
            if ((spin & 255) == 0) {
                if (kvb_now_s() > deadline) break;
                sched_yield(); /* an oversubscribed machine must still run the dispatcher */
            }
            g = atomic_load_explicit(&p->generation, memory_order_acquire);
        }
        if (g == seen) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->n_sleeping, 1); /* seq_cst: pairs with the dispatcher's check */
            while (!atomic_load(&p->stop) && atomic_load(&p->generation) == seen) pthread_cond_wait(&p->cv_work, &p->mu);
            atomic_fetch_sub(&p->n_sleeping, 1);
            pthread_mutex_unlock(&p->mu);
            g = atomic_load(&p->generation);
        }
        if (atomic_load(&p->stop)) return NULL;
        seen = g;
        if ((uint64_t)worker >= (g & POOL_WIDTH_MASK)) continue; /* not counted in this job */
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
    atomic_store(&p->width, n_threads);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    pthread_cond_init(&p->cv_width, NULL);
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
    atomic_store(&p->stop, true);
    atomic_fetch_add(&p->generation, (uint64_t)1 << POOL_WIDTH_BITS); /* wakes them; they see stop */
    pthread_cond_broadcast(&p->cv_work);
    pthread_cond_broadcast(&p->cv_width);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    pthread_cond_destroy(&p->cv_width);
    free(p->threads);
    free(p);
}

int kvb_pool_size(const kvb_pool *p) { return p ? p->n_threads : 1; }

void kvb_pool_park(kvb_pool *p) {
    if (p) atomic_fetch_add_explicit(&p->park, 1, memory_order_relaxed);
}

void kvb_pool_set_width(kvb_pool *p, int width) {
    if (!p) return;
    if (width < 1 || width > p->n_threads) width = p->n_threads;
    const int was = atomic_exchange(&p->width, width);
    if (width > was) { /* wake the workers taken in again */
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_width);
        pthread_mutex_unlock(&p->mu);
    }
}

int kvb_pool_width(const kvb_pool *p) { return p ? atomic_load(&((kvb_pool *)p)->width) : 1; }

void kvb_pool_parallel_for(kvb_pool *p, int n_tasks, kvb_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    const int width = p ? atomic_load(&p->width) : 1;
    if (width == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next_task, 0);
    atomic_store(&p->n_active, width - 1);
    /* the next sequence number and this job's width, in one store (only this thread writes it
     * while the pool lives); seq_cst: pairs with the workers' n_sleeping */
    const uint64_t seq = (atomic_load(&p->generation) >> POOL_WIDTH_BITS) + 1;
    atomic_store(&p->generation, seq << POOL_WIDTH_BITS | (uint64_t)width);
    if (atomic_load(&p->n_sleeping) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv_work);
        pthread_mutex_unlock(&p->mu);
    }
    run_tasks(p, 0);
    /* wait for helpers: spin, then sleep */
    for (unsigned spin = 1; atomic_load_explicit(&p->n_active, memory_order_acquire) > 0 && spin < (1u << 16); spin++) {
        cpu_relax();
        if ((spin & 255) == 0) sched_yield();
    }
    if (atomic_load(&p->n_active) > 0) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->n_active) > 0) pthread_cond_wait(&p->cv_done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}
