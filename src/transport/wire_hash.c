/* transport/wire_hash.c — the payload hash (XXH3-64, seed 0) with a run-time choice of kernel:
 * AVX2 where the CPU has it (wire_hash_avx2.c, x86 builds only), else the baseline one. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "transport_internal.h"

static uint64_t hash_base(const void *p, size_t n) { return XXH3_64bits(p, n); }

static uint64_t hash_iov_base(const kvb_iov *iov, int n_iov) {
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    for (int i = 0; i < n_iov; i++)
        if (iov[i].len) XXH3_64bits_update(&st, iov[i].data, iov[i].len);
    return XXH3_64bits_digest(&st);
}

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

uint64_t wire_hash(const void *p, size_t n) {
#if defined(KVB_X86)
    if (n >= 1024 && use_avx2()) return wire_hash_avx2(p, n);
#endif
    (void)use_avx2;
    return hash_base(p, n);
}

uint64_t kvb_wire_hashed_len(uint16_t type, uint64_t payload_len) {
    if (type == KVB_FRAME_SLAB && payload_len > KVB_SLAB_HEAD_BYTES) return KVB_SLAB_HEAD_BYTES;
    return payload_len;
}

uint64_t kvb_wire_frame_payload_hash(uint16_t type, const kvb_iov *iov, int n_iov) {
    uint64_t total = 0;
    for (int i = 0; i < n_iov; i++) total += iov[i].len;
    uint64_t hashed = kvb_wire_hashed_len(type, total);
    if (hashed == total) return kvb_wire_payload_hash(iov, n_iov);
    kvb_iov cut[8]; /* the hashed prefix: whole pieces, the last one cut */
    int n = 0;
    for (uint64_t left = hashed; n < n_iov && n < 8 && left; n++) {
        cut[n] = iov[n];
        if (cut[n].len > left) cut[n].len = (size_t)left;
        left -= cut[n].len;
    }
    return kvb_wire_payload_hash(cut, n);
}

uint64_t kvb_wire_payload_hash(const kvb_iov *iov, int n_iov) {
    if (n_iov == 1) return wire_hash(iov[0].data, iov[0].len);
#if defined(KVB_X86)
    if (use_avx2()) return wire_hash_iov_avx2(iov, n_iov);
#endif
    return hash_iov_base(iov, n_iov);
}
