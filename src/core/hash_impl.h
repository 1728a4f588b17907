/* core/hash_impl.h — private to core/hash.c and core/hash_avx2.c: the one body of XXH3-64 over
 * byte pieces, compiled once per kernel (baseline flags there, AVX2 flags here). Include after
 * <xxhash.h> with XXH_INLINE_ALL defined, so the body inlines the kernel of its file's flags. */
#ifndef KVB_HASH_IMPL_H
#define KVB_HASH_IMPL_H

#include "kvb_core.h"

static inline uint64_t kvb_xxh3_pieces_body(const kvb_bytes *pieces, int n) {
    if (n == 1) return XXH3_64bits(pieces[0].data, pieces[0].len);
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    for (int i = 0; i < n; i++)
        if (pieces[i].len) XXH3_64bits_update(&st, pieces[i].data, pieces[i].len);
    return XXH3_64bits_digest(&st);
}

#endif
