/* test_cuda_tp_comm — the tensor-parallel all-reduce (src/engine/cuda/tp_comm.h), one host thread
 * and one non-blocking stream per rank, on fresh random data each run (seed printed; KVB_TEST_SEED
 * repeats one):
 *   - the engine's own all-reduce (LOCAL) with 2, 3 and 4 ranks all on device 0: 20 back-to-back
 *     all-reduces per rank (no host synchronisation between them, so a rank runs ahead of the
 *     others; random host delays, and random stalls on the streams so a rank's upload lands late)
 *     of varying counts (1, odd, multiples of 4, the maximum, 0),
 *     each rank's buffer a random 0-3 floats off a 16-byte boundary: every rank's result equals the
 *     host's rank-order sum ((b0 + b1) + b2) + ... bit for bit (so all ranks agree);
 *   - abort: rank 0 blocked in the barrier (rank 1 never comes) returns an error once the main
 *     thread aborts, 100 ms later; later calls fail at once; abort twice is harmless;
 *   - argument checks (these run without a GPU too);
 *   - NCCL with one rank on device 0 (the buffer comes back unchanged; then abort), when
 *     libnccl.so.2 can be loaded, else it says why it skipped; NCCL (bit for bit: a + b is the same
 *     in either order) and LOCAL over peer access with 2 ranks on devices 0 and 1 when the host has
 *     two devices, else "skipped: one device".
 * Outputs are poisoned (NaN bits) first, so an element nobody writes fails. Without a CUDA device
 * the GPU tests skip with "no CUDA device". */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvb_core.h"

#ifdef KVB_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <math.h>
#include <pthread.h>
#include <unistd.h>

#include "kvb_engine_cuda.h"
#include "kvbt.h"
#include "tp_comm.h"

static uint64_t g_seed;
static kvb_rng g_rng;

static int device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    return n;
}

/* Magnitudes 2^-20 .. 2^20 of both signs: sums in another order round differently. */
static float rnd_wide(kvb_rng *r) {
    return ldexpf(kvb_rng_normal(r), (int)(kvb_rng_u64(r) % 41) - 20);
}

/* ---- a run of all-reduces, one thread per rank ---------------------------------------------- */

enum { ITERS = 20 };

typedef struct {
    kvb_tp_comm *c;
    int rank, device;
    size_t max_count;
    const size_t *counts;   /* (ITERS) */
    const int *offs;        /* (ITERS) floats past the 16-byte-aligned buffer */
    const float *in;        /* pinned (ITERS, max_count): this rank's inputs */
    float *out;             /* pinned (ITERS, max_count): what the buffer held after each */
    uint64_t seed;          /* host delays */
    kvb_status st;
    char msg[512];
} rank_job;

static void job_fail(rank_job *j, kvb_status st, const char *what, cudaError_t e) {
    j->st = st ? st : KVB_ERR_INTERNAL;
    snprintf(j->msg, sizeof j->msg, "rank %d: %s%s%s", j->rank, what, e != cudaSuccess ? ": " : "",
             e != cudaSuccess ? cudaGetErrorString(e) : "");
    kvb_tp_comm_abort(j->c); /* the other ranks would wait for this one forever */
}

/* A host function on a stream: holds the stream back for arg microseconds. */
static void stall(void *arg) { usleep((useconds_t)(uintptr_t)arg); }

static void *rank_main(void *p) {
    rank_job *j = p;
    kvb_rng r;
    kvb_rng_seed(&r, j->seed);
    cudaStream_t s = NULL;
    float *d = NULL;
    cudaError_t e;
    if ((e = cudaSetDevice(j->device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaMalloc((void **)&d, (j->max_count + 4) * sizeof(float))) != cudaSuccess) {
        job_fail(j, KVB_ERR_INTERNAL, "setup", e);
        goto done;
    }
    for (int it = 0; it < ITERS; it++) {
        const size_t n = j->counts[it];
        float *b = d + j->offs[it];
        /* now and then this rank's stream falls behind: its upload lands late, and the other ranks
         * must wait for it */
        if (kvb_rng_u64(&r) % 4 == 0 &&
            (e = cudaLaunchHostFunc(s, stall, (void *)(uintptr_t)(200 + kvb_rng_u64(&r) % 1800))) != cudaSuccess) {
            job_fail(j, KVB_ERR_INTERNAL, "cudaLaunchHostFunc", e);
            break;
        }
        if (n && (e = cudaMemcpyAsync(b, j->in + (size_t)it * j->max_count, n * sizeof(float),
                                      cudaMemcpyHostToDevice, s)) != cudaSuccess) {
            job_fail(j, KVB_ERR_INTERNAL, "upload", e);
            break;
        }
        kvb_err err = {0};
        kvb_status st = kvb_tp_comm_allreduce(j->c, j->rank, b, n, s, &err);
        if (st) {
            j->st = st;
            snprintf(j->msg, sizeof j->msg, "rank %d, all-reduce %d: %.470s", j->rank, it, err.msg);
            break;
        }
        if (n && (e = cudaMemcpyAsync(j->out + (size_t)it * j->max_count, b, n * sizeof(float),
                                      cudaMemcpyDeviceToHost, s)) != cudaSuccess) {
            job_fail(j, KVB_ERR_INTERNAL, "download", e);
            break;
        }
        if (kvb_rng_u64(&r) % 4 == 0) usleep((useconds_t)(kvb_rng_u64(&r) % 2000)); /* shuffle the ranks */
    }
    if (s && (e = cudaStreamSynchronize(s)) != cudaSuccess && !j->st) job_fail(j, KVB_ERR_INTERNAL, "sync", e);
done:
    if (d) cudaFree(d);
    if (s) cudaStreamDestroy(s);
    return NULL;
}

/* ITERS all-reduces over n ranks on devices[] with kind; checks every rank against the host's
 * rank-order sum, bit for bit. Returns false (having said why) when the communicator was refused
 * with KVB_ERR_UNSUPPORTED and may_refuse. */
static bool run_allreduces(kvb_tp_comm_kind kind, int n, const int *devices, bool may_refuse) {
    const size_t max_count = 40003;
    kvb_tp_comm *c = NULL;
    kvb_err err = {0};
    int before = -1, after = -2;
    assert_int_equal(cudaGetDevice(&before), cudaSuccess);
    kvb_status st = kvb_tp_comm_create(kind, n, devices, max_count, &c, &err);
    if (st == KVB_ERR_UNSUPPORTED && may_refuse) {
        print_message("%d ranks: refused: %s\n", n, err.msg);
        return false;
    }
    if (st) fail_msg("kvb_tp_comm_create: %s", err.msg);
    assert_int_equal(cudaGetDevice(&after), cudaSuccess);
    assert_int_equal(before, after); /* the caller's current device is left alone */
    assert_int_equal(kvb_tp_comm_size(c), n);
    print_message("%s\n", kvb_tp_comm_describe(c));

    size_t counts[ITERS];
    int offs[8][ITERS];
    for (int it = 0; it < ITERS; it++) {
        const size_t special[] = {max_count, 1, 3, 4096, 0, max_count - 1};
        counts[it] = it < (int)KVB_ARRAY_LEN(special) ? special[it] : 1 + kvb_rng_u64(&g_rng) % max_count;
        if (it % 3 == 0 && counts[it] > 4) counts[it] &= ~(size_t)3; /* the float4 path, when aligned */
        for (int r = 0; r < n; r++) offs[r][it] = it % 2 ? (int)(kvb_rng_u64(&g_rng) % 4) : 0;
    }
    const size_t per = (size_t)ITERS * max_count;
    float *in[8], *out[8];
    rank_job jobs[8];
    pthread_t th[8];
    for (int r = 0; r < n; r++) {
        assert_int_equal(cudaMallocHost((void **)&in[r], per * sizeof(float)), cudaSuccess);
        assert_int_equal(cudaMallocHost((void **)&out[r], per * sizeof(float)), cudaSuccess);
        for (size_t i = 0; i < per; i++) in[r][i] = rnd_wide(&g_rng);
        memset(out[r], 0xFF, per * sizeof(float));
        jobs[r] = (rank_job){c, r, devices[r], max_count, counts, offs[r], in[r], out[r], kvb_rng_u64(&g_rng),
                             KVB_OK, ""};
    }
    for (int r = 0; r < n; r++) assert_int_equal(pthread_create(&th[r], NULL, rank_main, &jobs[r]), 0);
    for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < n; r++)
        if (jobs[r].st) fail_msg("%s", jobs[r].msg);
    for (int it = 0; it < ITERS; it++) {
        const size_t o = (size_t)it * max_count;
        for (size_t i = 0; i < counts[it]; i++) {
            float want = in[0][o + i];
            for (int r = 1; r < n; r++) want = want + in[r][o + i]; /* rank order, one rounded add each */
            for (int r = 0; r < n; r++)
                if (memcmp(&out[r][o + i], &want, sizeof want) != 0)
                    fail_msg("%s: all-reduce %d (count %zu, offset %d): rank %d [%zu] = %a, want %a",
                             kvb_tp_comm_describe(c), it, counts[it], offs[r][it], r, i, (double)out[r][o + i],
                             (double)want);
        }
    }
    print_message("%d ranks: %d all-reduces, every rank bit-exact\n", n, ITERS);
    for (int r = 0; r < n; r++) {
        cudaFreeHost(in[r]);
        cudaFreeHost(out[r]);
    }
    kvb_tp_comm_free(c);
    return true;
}

static void test_local_one_device(void **state) {
    (void)state;
    kvbt_require_gpu();
    const int dev0[4] = {0, 0, 0, 0};
    for (int n = 2; n <= 4; n++) run_allreduces(KVB_TP_COMM_LOCAL, n, dev0, false);
}

/* ---- abort ---------------------------------------------------------------------------------- */

typedef struct {
    kvb_tp_comm *c;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool entering, returned;
    double t_enter, t_return;
    kvb_status st;
    char msg[512];
} abort_job;

static void *abort_rank0(void *p) {
    abort_job *j = p;
    cudaStream_t s = NULL;
    float *d = NULL;
    kvb_err err = {0};
    j->st = KVB_ERR_INTERNAL;
    if (cudaSetDevice(0) == cudaSuccess && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess &&
        cudaMalloc((void **)&d, 64 * sizeof(float)) == cudaSuccess) {
        pthread_mutex_lock(&j->mu);
        j->entering = true;
        j->t_enter = kvb_now_s();
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);
        j->st = kvb_tp_comm_allreduce(j->c, 0, d, 64, s, &err);
        snprintf(j->msg, sizeof j->msg, "%s", err.msg);
        cudaStreamSynchronize(s);
    } else {
        snprintf(j->msg, sizeof j->msg, "rank 0: setup failed");
    }
    pthread_mutex_lock(&j->mu);
    j->returned = true;
    j->t_return = kvb_now_s();
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (d) cudaFree(d);
    if (s) cudaStreamDestroy(s);
    return NULL;
}

static void test_local_abort(void **state) {
    (void)state;
    kvbt_require_gpu();
    const int dev[2] = {0, 0};
    abort_job j;
    memset(&j, 0, sizeof j);
    kvb_err err = {0};
    if (kvb_tp_comm_create(KVB_TP_COMM_LOCAL, 2, dev, 64, &j.c, &err)) fail_msg("%s", err.msg);
    pthread_mutex_init(&j.mu, NULL);
    pthread_cond_init(&j.cv, NULL);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, abort_rank0, &j), 0);
    pthread_mutex_lock(&j.mu);
    while (!j.entering && !j.returned) pthread_cond_wait(&j.cv, &j.mu);
    pthread_mutex_unlock(&j.mu);
    usleep(100 * 1000); /* rank 1 never comes */
    pthread_mutex_lock(&j.mu);
    const bool early = j.returned;
    pthread_mutex_unlock(&j.mu);
    const double t_abort = kvb_now_s();
    kvb_tp_comm_abort(j.c);
    /* rank 0 must come back at once; give it 10 s before calling it stuck */
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    pthread_mutex_lock(&j.mu);
    int rc = 0;
    while (!j.returned && rc == 0) rc = pthread_cond_timedwait(&j.cv, &j.mu, &until);
    const bool back = j.returned;
    pthread_mutex_unlock(&j.mu);
    if (!back) fail_msg("rank 0 is still in the all-reduce 10 s after the abort");
    pthread_join(th, NULL);
    if (early) fail_msg("rank 0 returned before the abort, with rank 1 absent (%s: %s)", kvb_status_name(j.st), j.msg);
    if (j.st == KVB_OK) fail_msg("rank 0's all-reduce succeeded with rank 1 absent");
    print_message("rank 0 waited %.3f s, returned %.3f s after the abort: %s: %s\n", j.t_return - j.t_enter,
                  j.t_return - t_abort, kvb_status_name(j.st), j.msg);
    assert_non_null(strstr(j.msg, "abort"));
    /* later calls fail at once, on every rank; abort again is harmless */
    cudaStream_t s;
    float *d;
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    assert_int_equal(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaMalloc((void **)&d, 64 * sizeof(float)), cudaSuccess);
    kvb_tp_comm_abort(j.c);
    for (int r = 0; r < 2; r++) {
        const double t0 = kvb_now_s();
        assert_int_not_equal(kvb_tp_comm_allreduce(j.c, r, d, 64, s, &err), KVB_OK);
        assert_true(kvb_now_s() - t0 < 1.0);
    }
    assert_int_equal(cudaStreamSynchronize(s), cudaSuccess);
    cudaFree(d);
    cudaStreamDestroy(s);
    kvb_tp_comm_free(j.c);
    pthread_cond_destroy(&j.cv);
    pthread_mutex_destroy(&j.mu);
}

/* ---- NCCL ----------------------------------------------------------------------------------- */

static void test_nccl_one_rank(void **state) {
    (void)state;
    kvbt_require_gpu();
    const int dev[1] = {0};
    kvb_tp_comm *c = NULL;
    kvb_err err = {0};
    kvb_status st = kvb_tp_comm_create(KVB_TP_COMM_NCCL, 1, dev, 5000, &c, &err);
    if (st == KVB_ERR_UNSUPPORTED) {
        print_message("NCCL, one rank: skipped: %s\n", err.msg);
        skip();
    }
    if (st) fail_msg("kvb_tp_comm_create (NCCL): %s", err.msg);
    const char *nv = getenv("NCCL_NVLS_ENABLE");
    if (!nv || strcmp(nv, "0") != 0)
        fail_msg("NCCL_NVLS_ENABLE is %s after creating a NCCL communicator", nv ? nv : "unset");
    print_message("%s\n", kvb_tp_comm_describe(c));
    assert_non_null(strstr(kvb_tp_comm_describe(c), "NCCL"));
    cudaStream_t s;
    float *d, *h = malloc(5000 * sizeof(float)), *back = malloc(5000 * sizeof(float));
    assert_true(h && back);
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
    assert_int_equal(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaMalloc((void **)&d, 5001 * sizeof(float)), cudaSuccess);
    const size_t counts[] = {1001, 5000, 1};
    for (size_t k = 0; k < KVB_ARRAY_LEN(counts); k++) {
        const size_t n = counts[k];
        float *b = d + (k == 0); /* one float off a 16-byte boundary first */
        for (size_t i = 0; i < n; i++) h[i] = rnd_wide(&g_rng);
        memset(back, 0xFF, n * sizeof(float));
        assert_int_equal(cudaMemcpyAsync(b, h, n * sizeof(float), cudaMemcpyHostToDevice, s), cudaSuccess);
        if (kvb_tp_comm_allreduce(c, 0, b, n, s, &err)) fail_msg("%s", err.msg);
        assert_int_equal(cudaMemcpyAsync(back, b, n * sizeof(float), cudaMemcpyDeviceToHost, s), cudaSuccess);
        assert_int_equal(cudaStreamSynchronize(s), cudaSuccess);
        if (memcmp(back, h, n * sizeof(float)) != 0)
            fail_msg("a one-rank NCCL all-reduce of %zu floats changed the buffer", n);
    }
    print_message("NCCL, one rank: the buffer comes back unchanged\n");
    kvb_tp_comm_abort(c);
    st = kvb_tp_comm_allreduce(c, 0, d, 16, s, &err);
    if (st == KVB_OK) fail_msg("an all-reduce on an aborted NCCL communicator succeeded");
    print_message("after the abort: %s\n", err.msg);
    kvb_tp_comm_abort(c);
    assert_int_equal(cudaStreamSynchronize(s), cudaSuccess);
    cudaFree(d);
    cudaStreamDestroy(s);
    free(h);
    free(back);
    kvb_tp_comm_free(c);
}

/* Two devices: NCCL, and LOCAL over peer access (refused, naming both devices, without it). */
static void test_two_devices(void **state) {
    (void)state;
    kvbt_require_gpu();
    if (device_count() < 2) {
        print_message("skipped: one device\n");
        skip();
    }
    const int dev[2] = {0, 1};
    assert_int_equal(cudaSetDevice(1), cudaSuccess); /* create must leave the caller on device 1 */
    if (run_allreduces(KVB_TP_COMM_NCCL, 2, dev, true)) print_message("NCCL, 2 devices: bit-exact\n");
    else print_message("NCCL, 2 devices: skipped (NCCL refused, above)\n");
    kvb_tp_comm *c = NULL;
    kvb_err err = {0};
    int can = 0;
    assert_int_equal(cudaDeviceCanAccessPeer(&can, 0, 1), cudaSuccess);
    if (can) {
        assert_true(run_allreduces(KVB_TP_COMM_LOCAL, 2, dev, false));
    } else {
        assert_int_equal(kvb_tp_comm_create(KVB_TP_COMM_LOCAL, 2, dev, 16, &c, &err), KVB_ERR_UNSUPPORTED);
        assert_non_null(strstr(err.msg, "device 0"));
        assert_non_null(strstr(err.msg, "device 1"));
        print_message("LOCAL, 2 devices: refused without peer access: %s\n", err.msg);
    }
    assert_int_equal(cudaSetDevice(0), cudaSuccess);
}

/* ---- arguments (no GPU needed: every one is refused before CUDA is asked anything) -------------- */

static void test_args(void **state) {
    (void)state;
    const int dev[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0};
    kvb_tp_comm *c = (kvb_tp_comm *)(uintptr_t)1; /* must come back NULL */
    kvb_err err = {0};
    assert_int_equal(kvb_tp_comm_create(KVB_TP_COMM_LOCAL, 0, dev, 16, &c, &err), KVB_ERR_INVALID);
    assert_null(c);
    assert_int_equal(kvb_tp_comm_create(KVB_TP_COMM_LOCAL, 9, dev, 16, &c, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_tp_comm_create(KVB_TP_COMM_LOCAL, 2, NULL, 16, &c, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_tp_comm_create((kvb_tp_comm_kind)7, 2, dev, 16, &c, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_tp_comm_create(KVB_TP_COMM_LOCAL, 2, dev, 0, &c, &err), KVB_ERR_RANGE);
    assert_int_equal(kvb_tp_comm_create(KVB_TP_COMM_LOCAL, 2, dev, 16, NULL, &err), KVB_ERR_INVALID);
    /* NCCL takes one device per rank */
    assert_int_equal(kvb_tp_comm_create(KVB_TP_COMM_NCCL, 2, dev, 16, &c, &err), KVB_ERR_INVALID);
    print_message("NCCL on devices 0,0: %s\n", err.msg);
    assert_null(c);
    kvb_tp_comm_free(NULL);
    kvb_tp_comm_abort(NULL);
    assert_int_equal(kvb_tp_comm_size(NULL), 0);
    assert_int_equal(kvb_tp_comm_allreduce(NULL, 0, NULL, 0, NULL, &err), KVB_ERR_INVALID);
}

int main(void) {
    const char *s = getenv("KVB_TEST_SEED");
    g_seed = s ? strtoull(s, NULL, 0) : ((uint64_t)time(NULL) ^ ((uint64_t)clock() << 32));
    printf("test_cuda_tp_comm: seed %llu (KVB_TEST_SEED=%llu repeats this run)\n", (unsigned long long)g_seed,
           (unsigned long long)g_seed);
    kvb_rng_seed(&g_rng, g_seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_args),        cmocka_unit_test(test_local_one_device),
        cmocka_unit_test(test_local_abort), cmocka_unit_test(test_nccl_one_rank),
        cmocka_unit_test(test_two_devices),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#else /* built without CUDA */

#include "kvbt.h"

static void test_no_cuda(void **state) {
    (void)state;
    kvbt_require_gpu(); /* skips, saying why: this build has no CUDA engine */
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_no_cuda)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif
