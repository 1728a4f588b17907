/* core/hash.c — XXH3-64 (seed 0) of byte pieces laid back to back, with a run-time choice of
 * kernel: AVX2 where the CPU has it (hash_avx2.c, x86 builds only), else the baseline (SSE2 on
 * x86-64). Every kernel gives the same bits; the AVX2 one is about 3x faster on 64 KiB pieces.
 * The wire protocol's payload hash and the slab checksum (K || V) both go through here. */
#define XXH_INLINE_ALL
#include <stdatomic.h>
#include <xxhash.h>

#include "hash_impl.h"

uint64_t kvb_xxh3_pieces_avx2(const kvb_bytes *pieces, int n);

static bool use_avx2(void) {
#if defined(KVB_X86)
    static _Atomic int choice = -1; /* -1 unknown, 0 no, 1 yes; a racing first call computes it twice */
    int c = atomic_load_explicit(&choice, memory_order_relaxed);
    if (c < 0) {
        __builtin_cpu_init();
        c = __builtin_cpu_supports("avx2") ? 1 : 0;
        atomic_store_explicit(&choice, c, memory_order_relaxed);
    }
    return c == 1;
#else
    return false;
#endif
}

uint64_t kvb_xxh3_pieces(const kvb_bytes *pieces, int n) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += pieces[i].len;
#if defined(KVB_X86)
    if (total >= 1024 && use_avx2()) return kvb_xxh3_pieces_avx2(pieces, n);
#endif
    (void)use_avx2;
    return kvb_xxh3_pieces_body(pieces, n);
}

uint64_t kvb_xxh3(const void *data, size_t n) {
    const kvb_bytes one = {data, n};
    return kvb_xxh3_pieces(&one, 1);
}
