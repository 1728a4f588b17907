/* core/membw.c — the machine's memory read bandwidth, measured the way decode reads weights:
 * every thread of the pool streams its own slice of a buffer far larger than the caches.
 * Benchmarks print their figures beside this, measured in the same run. */
#include <stdlib.h>
#include <string.h>

#include "kvb_core.h"

typedef struct {
    const uint64_t *buf;
    size_t n_words;
    int n_tasks;
    uint64_t sums[1024];
} bw_job;

/* 32-byte vectors (GCC/clang vector extension: SIMD loads on every ISA), 4 independent
 * accumulators, so the loop is bound by memory, not by load issue. */
typedef uint64_t kvb_u64x4 __attribute__((vector_size(32)));

static void bw_task(void *ctx, int task, int worker) {
    (void)worker;
    bw_job *j = ctx;
    size_t per = j->n_words / (size_t)j->n_tasks / 16 * 16;
    const kvb_u64x4 *p = (const kvb_u64x4 *)(const void *)(j->buf + per * (size_t)task);
    kvb_u64x4 a = {0}, b = {0}, c = {0}, d = {0};
    for (size_t i = 0; i + 4 <= per / 4; i += 4) {
        a ^= p[i];
        b ^= p[i + 1];
        c ^= p[i + 2];
        d ^= p[i + 3];
    }
    kvb_u64x4 x = a ^ b ^ c ^ d;
    j->sums[task & 1023] = x[0] ^ x[1] ^ x[2] ^ x[3];
}

double kvb_measure_read_bw(kvb_pool *pool, size_t bytes, int reps) {
    size_t n_words = bytes / 8;
    uint64_t *buf = kvb_aligned_alloc(4096, n_words * 8);
    if (!buf) return 0;
    int threads = kvb_pool_size(pool);
    /* touch in parallel-ish order so pages are mapped before timing */
    for (size_t i = 0; i < n_words; i += 512) buf[i] = i;
    memset(buf, 1, n_words * 8);
    bw_job *j = calloc(1, sizeof *j);
    if (!j) {
        kvb_aligned_free(buf);
        return 0;
    }
    j->buf = buf;
    j->n_words = n_words;
    j->n_tasks = threads * 8 > 1024 ? 1024 : threads * 8; /* several per thread: balance */
    double best = 0;
    for (int r = 0; r < reps + 1; r++) {
        double t0 = kvb_now_s();
        kvb_pool_parallel_for(pool, j->n_tasks, bw_task, j);
        double dt = kvb_now_s() - t0;
        double gbs = (double)(n_words / (size_t)j->n_tasks / 16 * 16 * (size_t)j->n_tasks) * 8 / dt / 1e9;
        if (r > 0 && gbs > best) best = gbs; /* first pass is a warm-up */
    }
    free(j);
    kvb_aligned_free(buf);
    return best;
}
