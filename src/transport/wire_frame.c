/* transport/wire_frame.c — the frame header (encode, validate, decode), payload hashing, whole
 * frames in memory, the growable receive buffer, deadline arithmetic and a thread's cancel flag
 * (which the backends' waits look at). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "transport_internal.h"

#define HEADER_HASHED_BYTES 36

const char *kvb_frame_type_name(uint32_t type) {
    switch (type) {
    case KVB_FRAME_HELLO: return "HELLO";
    case KVB_FRAME_AUTH: return "AUTH";
    case KVB_FRAME_AUTH_OK: return "AUTH_OK";
    case KVB_FRAME_PREFILL: return "PREFILL";
    case KVB_FRAME_SLAB: return "SLAB";
    case KVB_FRAME_DONE: return "DONE";
    case KVB_FRAME_ERROR: return "ERROR";
    case KVB_FRAME_CANCEL: return "CANCEL";
    case KVB_FRAME_PING: return "PING";
    case KVB_FRAME_PONG: return "PONG";
    case KVB_FRAME_LANE: return "LANE";
    }
    return "unknown";
}

void kvb_wire_header_encode(const kvb_frame_header *h, uint8_t out[KVB_WIRE_HEADER_BYTES]) {
    memcpy(out, KVB_WIRE_MAGIC, 4);
    wire_put_u16(out + 4, KVB_WIRE_VERSION);
    wire_put_u16(out + 6, h->type);
    wire_put_u32(out + 8, 0);
    wire_put_u64(out + 12, h->request_id);
    wire_put_u64(out + 20, h->payload_len);
    wire_put_u64(out + 28, h->payload_hash);
    wire_put_u64(out + 36, XXH3_64bits(out, HEADER_HASHED_BYTES));
}

kvb_status kvb_wire_header_decode(const uint8_t in[KVB_WIRE_HEADER_BYTES], uint64_t max_payload, kvb_frame_header *h,
                                  kvb_err *err) {
    if (memcmp(in, KVB_WIRE_MAGIC, 4) != 0)
        return kvb_err_set(err, KVB_ERR_FORMAT,
                           "frame header: bad magic %02x %02x %02x %02x (expected \"KVB1\"; not a kvbridge peer?)",
                           in[0], in[1], in[2], in[3]);
    uint16_t version = wire_get_u16(in + 4);
    if (version != KVB_WIRE_VERSION)
        return kvb_err_set(err, KVB_ERR_MISMATCH,
                           "frame header: peer speaks kvbridge protocol version %u, this node speaks version %u",
                           version, KVB_WIRE_VERSION);
    uint64_t want = wire_get_u64(in + 36), got = XXH3_64bits(in, HEADER_HASHED_BYTES);
    if (want != got)
        return kvb_err_set(err, KVB_ERR_CHECKSUM,
                           "frame header: checksum mismatch (header says %016llx, bytes hash to %016llx)",
                           (unsigned long long)want, (unsigned long long)got);
    uint16_t type = wire_get_u16(in + 6);
    if (type < 1 || type > KVB_FRAME_TYPE_MAX)
        return kvb_err_set(err, KVB_ERR_FORMAT, "frame header: unknown frame type %u", type);
    uint32_t flags = wire_get_u32(in + 8);
    if (flags != 0)
        return kvb_err_set(err, KVB_ERR_FORMAT, "frame header: unknown flags 0x%x (no flag is defined in version %u)",
                           flags, KVB_WIRE_VERSION);
    uint64_t len = wire_get_u64(in + 20);
    if (len > max_payload)
        return kvb_err_set(err, KVB_ERR_RANGE, "frame header: %s payload of %llu bytes exceeds the limit of %llu bytes",
                           kvb_frame_type_name(type), (unsigned long long)len, (unsigned long long)max_payload);
    h->version = version;
    h->type = type;
    h->flags = flags;
    h->request_id = wire_get_u64(in + 12);
    h->payload_len = len;
    h->payload_hash = wire_get_u64(in + 28);
    return KVB_OK;
}

kvb_status kvb_wire_frame_encode(uint16_t type, uint64_t request_id, const kvb_iov *payload, int n_iov, uint8_t *out,
                                 size_t cap, size_t *written, kvb_err *err) {
    if (n_iov < 0 || (n_iov > 0 && !payload)) return kvb_err_set(err, KVB_ERR_INVALID, "frame encode: bad pieces");
    uint64_t total = 0;
    for (int i = 0; i < n_iov; i++)
        if (kvb_add_overflow_u64(total, payload[i].len, &total))
            return kvb_err_set(err, KVB_ERR_RANGE, "frame encode: payload size overflows");
    uint64_t need;
    if (kvb_add_overflow_u64(total, KVB_WIRE_HEADER_BYTES, &need) || need > SIZE_MAX)
        return kvb_err_set(err, KVB_ERR_RANGE, "frame encode: payload size overflows");
    *written = (size_t)need;
    if (need > cap)
        return kvb_err_set(err, KVB_ERR_RANGE, "frame encode: %llu bytes needed, buffer holds %zu",
                           (unsigned long long)need, cap);
    kvb_frame_header h = {.type = type, .request_id = request_id, .payload_len = total};
    h.payload_hash = kvb_wire_frame_payload_hash(type, payload, n_iov);
    kvb_wire_header_encode(&h, out);
    size_t off = KVB_WIRE_HEADER_BYTES;
    for (int i = 0; i < n_iov; i++) {
        if (payload[i].len) memcpy(out + off, payload[i].data, payload[i].len);
        off += payload[i].len;
    }
    return KVB_OK;
}

kvb_status kvb_wire_frame_parse(const uint8_t *bytes, size_t n, uint64_t max_payload, kvb_frame *out, kvb_err *err) {
    if (n < KVB_WIRE_HEADER_BYTES)
        return kvb_err_set(err, KVB_ERR_FORMAT, "frame: %zu bytes is shorter than the %d-byte header", n,
                           KVB_WIRE_HEADER_BYTES);
    kvb_frame_header h;
    kvb_status st = kvb_wire_header_decode(bytes, max_payload, &h, err);
    if (st) return st;
    if (h.payload_len != n - KVB_WIRE_HEADER_BYTES)
        return kvb_err_set(err, KVB_ERR_FORMAT, "frame: header announces %llu payload bytes, %zu are present",
                           (unsigned long long)h.payload_len, n - KVB_WIRE_HEADER_BYTES);
    uint64_t got = kvb_xxh3(bytes + KVB_WIRE_HEADER_BYTES, (size_t)kvb_wire_hashed_len(h.type, h.payload_len));
    if (got != h.payload_hash)
        return kvb_err_set(err, KVB_ERR_CHECKSUM, "%s payload: checksum mismatch (header says %016llx, bytes hash to %016llx)",
                           kvb_frame_type_name(h.type), (unsigned long long)h.payload_hash, (unsigned long long)got);
    out->type = h.type;
    out->flags = h.flags;
    out->request_id = h.request_id;
    out->payload = bytes + KVB_WIRE_HEADER_BYTES;
    out->payload_len = h.payload_len;
    return KVB_OK;
}

kvb_status kvb_wire_buf_reserve(kvb_wire_buf *buf, size_t n, kvb_err *err) {
    if (n <= buf->cap && buf->data) return KVB_OK;
    size_t cap = buf->cap ? buf->cap : 4096;
    while (cap < n) cap = cap > SIZE_MAX / 2 ? n : cap * 2;
    uint8_t *p = malloc(cap);
    if (!p) return kvb_err_set(err, KVB_ERR_NOMEM, "receive buffer: cannot allocate %zu bytes", cap);
    free(buf->data);
    buf->data = p;
    buf->cap = cap;
    return KVB_OK;
}

uint64_t kvb_wire_chain_digest(const uint64_t *keys, uint32_t n_keys) {
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_64bits_reset(&st);
    uint8_t le[8 * 64];
    uint32_t i = 0;
    while (i < n_keys) {
        uint32_t m = KVB_MIN(n_keys - i, 64u);
        for (uint32_t j = 0; j < m; j++) wire_put_u64(le + 8 * j, keys[i + j]);
        XXH3_64bits_update(&st, le, (size_t)m * 8);
        i += m;
    }
    return XXH3_64bits_digest(&st);
}

kvb_status wire_deadline(int timeout_ms, double *deadline, kvb_err *err) {
    if (timeout_ms < 1) return kvb_err_set(err, KVB_ERR_INVALID, "timeout of %d ms: must be >= 1 ms", timeout_ms);
    *deadline = kvb_now_s() + timeout_ms / 1000.0;
    return KVB_OK;
}

int wire_ms_left(double deadline) {
    double left = (deadline - kvb_now_s()) * 1000.0;
    if (left <= 0) return 0;
    if (left > 1e9) return 1000000000;
    return (int)ceil(left);
}

static _Thread_local const atomic_bool *thread_cancel;
void wire_set_thread_cancel(const atomic_bool *flag) { thread_cancel = flag; }
const atomic_bool *wire_thread_cancel(void) { return thread_cancel; }
