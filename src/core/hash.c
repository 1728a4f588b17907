/* core/hash.c — XXH3-64 (seed 0) of byte pieces laid back to back, with a run-time choice of
 * kernel: AVX-512 or AVX2 where the CPU has it (hash_avx512.c, hash_avx2.c; x86 builds only), else
 * the baseline (SSE2 on x86-64). Every kernel gives the same bits; AVX2 is about 3x faster than
 * SSE2 on 64 KiB pieces.
 * The wire protocol's payload hash and the slab checksum (K || V) both go through here. */
#define XXH_INLINE_ALL
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "hash_impl.h"

uint64_t kvb_xxh3_pieces_avx2(const kvb_bytes *pieces, int n);
uint64_t kvb_xxh3_pieces_avx512(const kvb_bytes *pieces, int n);

enum { HASH_BASE, HASH_AVX2, HASH_AVX512 };

/* The widest kernel the CPU has, or KVB_HASH_KERNEL=sse2|avx2|avx512 (for benchmarks; a kernel
 * the CPU lacks falls back to the widest it has). */
static int hash_kernel(void) {
#if defined(KVB_X86)
    static _Atomic int choice = -1; /* -1 unknown; a racing first call computes it twice */
    int c = atomic_load_explicit(&choice, memory_order_relaxed);
    if (c < 0) {
        __builtin_cpu_init();
        const int best = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
                             ? HASH_AVX512
                         : __builtin_cpu_supports("avx2")  ? HASH_AVX2
                                                           : HASH_BASE;
        const char *env = getenv("KVB_HASH_KERNEL");
        c = best;
        if (env && !strcmp(env, "sse2")) c = HASH_BASE;
        else if (env && !strcmp(env, "avx2") && best >= HASH_AVX2) c = HASH_AVX2;
        atomic_store_explicit(&choice, c, memory_order_relaxed);
    }
    return c;
#else
    return HASH_BASE;
#endif
}

uint64_t kvb_xxh3_pieces(const kvb_bytes *pieces, int n) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += pieces[i].len;
#if defined(KVB_X86)
    if (total >= 1024) {
        const int k = hash_kernel();
        if (k == HASH_AVX512) return kvb_xxh3_pieces_avx512(pieces, n);
        if (k == HASH_AVX2) return kvb_xxh3_pieces_avx2(pieces, n);
    }
#endif
    (void)hash_kernel;
    return kvb_xxh3_pieces_body(pieces, n);
}

uint64_t kvb_xxh3(const void *data, size_t n) {
    const kvb_bytes one = {data, n};
    return kvb_xxh3_pieces(&one, 1);
}
