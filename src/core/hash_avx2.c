/* core/hash_avx2.c — XXH3-64 of byte pieces with the AVX2 kernel (this file is compiled with AVX2
 * flags; hash.c calls it only when the CPU has AVX2). Same bits as every other XXH3
 * implementation: only the speed differs (about 3x the SSE2 kernel, which would otherwise cost a
 * quarter of the loopback transfer time). */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "hash_impl.h"

uint64_t kvb_xxh3_pieces_avx2(const kvb_bytes *pieces, int n);

uint64_t kvb_xxh3_pieces_avx2(const kvb_bytes *pieces, int n) { return kvb_xxh3_pieces_body(pieces, n); }
