/* transport/wire_hash_avx2.c — XXH3-64 of payloads with the AVX2 kernel (this file is compiled
 * with AVX2 flags; wire_hash.c calls it only when the CPU has AVX2). Same bits as every other
 * XXH3 implementation: only the speed differs (about 3x the SSE2 kernel, which would otherwise
 * cost a quarter of the loopback transfer time). */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "transport_internal.h"

uint64_t wire_hash_avx2(const void *p, size_t n) { return XXH3_64bits(p, n); }

uint64_t wire_hash_iov_avx2(const kvb_iov *iov, int n_iov) {
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    for (int i = 0; i < n_iov; i++)
        if (iov[i].len) XXH3_64bits_update(&st, iov[i].data, iov[i].len);
    return XXH3_64bits_digest(&st);
}
