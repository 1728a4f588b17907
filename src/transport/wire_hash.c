/* transport/wire_hash.c — the payload hash (XXH3-64, seed 0, core's kvb_xxh3_pieces: AVX2 where
 * the CPU has it) and which bytes of a frame it covers (a SLAB frame's head; the slab checksum
 * covers its K and V). */
#include "transport_internal.h"

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

uint64_t kvb_wire_payload_hash(const kvb_iov *iov, int n_iov) { return kvb_xxh3_pieces(iov, n_iov); }
