/* core/util.c — monotonic time, the deterministic RNG, XXH3 hashing and aligned allocation. */
#define _POSIX_C_SOURCE 200809L
#include "kvb_core.h"

#include <math.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

double kvb_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int kvb_cond_init_monotonic(pthread_cond_t *cv) {
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (rc) return rc;
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    rc = pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
    return rc;
}

int kvb_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, double deadline_s) {
    const double whole = floor(deadline_s);
    struct timespec ts = {.tv_sec = (time_t)whole, .tv_nsec = (long)((deadline_s - whole) * 1e9)};
    if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
    return pthread_cond_timedwait(cv, mu, &ts);
}

uint64_t kvb_splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

void kvb_rng_seed(kvb_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) {
        x = kvb_splitmix64(x);
        r->s[i] = x;
    }
}

static inline uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t kvb_rng_u64(kvb_rng *r) {
    uint64_t *s = r->s;
    const uint64_t result = rotl64(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return result;
}

float kvb_rng_uniform(kvb_rng *r) { return (float)(kvb_rng_u64(r) >> 40) * (1.0f / 16777216.0f); }

float kvb_rng_normal(kvb_rng *r) {
    /* Box-Muller in double for portability of the result across libms is not guaranteed;
     * the weights it makes only need to be deterministic on one build, which they are. */
    double u1 = ((double)(kvb_rng_u64(r) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    double u2 = (double)(kvb_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

uint64_t kvb_hash64(const void *data, size_t n, uint64_t seed) { return XXH3_64bits_withSeed(data, n, seed); }

void *kvb_aligned_alloc(size_t alignment, size_t size) {
    void *p = NULL;
    if (size == 0) size = alignment;
    if (posix_memalign(&p, alignment, size) != 0) return NULL;
    return p;
}

void kvb_aligned_free(void *p) { free(p); }

int kvb_cpu_count(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (int)n;
}
