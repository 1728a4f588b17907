/* tests/test_pool.c — the thread pool: every task of a parallel-for runs exactly once, whatever
 * the pool size and task count; with a width below the size only workers [0, width) run tasks;
 * once the width grows back every worker takes part again (a job whose tasks each wait for all
 * workers to arrive finishes only then); thousands of jobs with the width changing between them
 * neither lose a task nor hang; a pool is destroyed cleanly while workers sleep past the width or
 * are parked. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvb_core.h"

#define MAX_TASKS 10000
#define MAX_WORKERS 16

typedef struct {
    atomic_int runs[MAX_TASKS];  /* (task) how many times it ran */
    atomic_int max_worker;       /* the highest worker index that ran a task */
    atomic_uint present;         /* bit per worker that entered a rendezvous task */
    unsigned want;               /* the bits a rendezvous waits for */
    atomic_int timed_out;
} job_ctx;

static void count_task(void *ctx, int task, int worker) {
    job_ctx *j = ctx;
    atomic_fetch_add(&j->runs[task], 1);
    int m = atomic_load(&j->max_worker);
    while (worker > m && !atomic_compare_exchange_weak(&j->max_worker, &m, worker)) {
    }
}

/* Each task waits (up to 10 s) until every worker of the pool is inside one: the job can only end
 * once all of them took a task. */
static void rendezvous_task(void *ctx, int task, int worker) {
    job_ctx *j = ctx;
    (void)task;
    atomic_fetch_or(&j->present, 1u << worker);
    const double deadline = kvb_now_s() + 10;
    while ((atomic_load(&j->present) & j->want) != j->want)
        if (kvb_now_s() > deadline) {
            atomic_store(&j->timed_out, 1);
            return;
        }
}

static void run_counted(kvb_pool *p, int n_tasks, int expect_max_worker_below) {
    job_ctx *j = calloc(1, sizeof *j);
    assert_non_null(j);
    atomic_store(&j->max_worker, -1);
    kvb_pool_parallel_for(p, n_tasks, count_task, j);
    for (int t = 0; t < n_tasks; t++) assert_int_equal(atomic_load(&j->runs[t]), 1);
    assert_true(atomic_load(&j->max_worker) < expect_max_worker_below);
    free(j);
}

static void test_every_task_once(void **state) {
    (void)state;
    const int sizes[] = {1, 2, 7, 16}, counts[] = {1, 3, 100, MAX_TASKS};
    for (size_t i = 0; i < 4; i++) {
        kvb_pool *p = NULL;
        kvb_err err = {0};
        assert_int_equal(kvb_pool_create(sizes[i], &p, &err), KVB_OK);
        assert_int_equal(kvb_pool_size(p), sizes[i]);
        assert_int_equal(kvb_pool_width(p), sizes[i]);
        for (size_t c = 0; c < 4; c++) run_counted(p, counts[c], sizes[i]);
        kvb_pool_destroy(p);
    }
    run_counted(NULL, 100, 1); /* no pool: serial, on worker 0 */
    kvb_pool *p = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_pool_create(0, &p, &err), KVB_ERR_INVALID);
}

static void test_width(void **state) {
    (void)state;
    const int size = 6;
    kvb_pool *p = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_pool_create(size, &p, &err), KVB_OK);
    for (int w = 1; w <= size; w++) {
        kvb_pool_set_width(p, w);
        assert_int_equal(kvb_pool_width(p), w);
        for (int k = 0; k < 20; k++) run_counted(p, 500, w); /* nobody past the width ran a task */
    }
    kvb_pool_set_width(p, 0); /* out of range: all of them */
    assert_int_equal(kvb_pool_width(p), size);
    kvb_pool_set_width(p, size + 5);
    assert_int_equal(kvb_pool_width(p), size);
    /* narrow, then wide again: every worker must come back (each task waits for all of them) */
    for (int round = 0; round < 5; round++) {
        kvb_pool_set_width(p, 2);
        run_counted(p, 200, 2);
        usleep(5000); /* the workers left out are asleep by now */
        kvb_pool_set_width(p, size);
        job_ctx *j = calloc(1, sizeof *j);
        assert_non_null(j);
        j->want = (1u << size) - 1;
        kvb_pool_parallel_for(p, size, rendezvous_task, j);
        assert_int_equal(atomic_load(&j->timed_out), 0);
        assert_int_equal(atomic_load(&j->present), j->want);
        free(j);
    }
    kvb_pool_destroy(p);
}

static void test_width_churn(void **state) {
    (void)state;
    const int size = 8;
    kvb_pool *p = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_pool_create(size, &p, &err), KVB_OK);
    uint64_t x = 12345;
    for (int k = 0; k < 3000; k++) {
        x = kvb_splitmix64(x);
        const int w = 1 + (int)(x % (uint64_t)size);
        kvb_pool_set_width(p, w);
        if (x & 0x100) kvb_pool_park(p);
        run_counted(p, 1 + (int)((x >> 16) % 64), w);
    }
    kvb_pool_set_width(p, 1); /* destroyed with workers asleep past the width */
    run_counted(p, 10, 1);
    kvb_pool_destroy(p);
    assert_int_equal(kvb_pool_create(4, &p, &err), KVB_OK);
    kvb_pool_park(p); /* and with parked ones */
    kvb_pool_destroy(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_task_once),
        cmocka_unit_test(test_width),
        cmocka_unit_test(test_width_churn),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
