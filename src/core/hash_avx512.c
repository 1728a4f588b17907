/* core/hash_avx512.c — XXH3-64 of byte pieces with the AVX-512 kernel (this file is compiled with
 * AVX-512 flags; hash.c calls it only when the CPU has AVX-512F and the choice in hash.c picks it).
 * Same bits as every other XXH3 implementation: only the speed differs. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "hash_impl.h"

uint64_t kvb_xxh3_pieces_avx512(const kvb_bytes *pieces, int n);

uint64_t kvb_xxh3_pieces_avx512(const kvb_bytes *pieces, int n) { return kvb_xxh3_pieces_body(pieces, n); }
