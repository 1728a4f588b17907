/* transport/wire_msg.c — explicit encode/decode of every message payload. Decoders treat every
 * byte as hostile: exact sizes, lengths checked against what is present (overflow-safe), reserved
 * fields zero, enumerations in range; nothing is ever cast onto wire bytes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport_internal.h"

const char *kvb_wire_role_name(uint32_t role) {
    switch (role) {
    case KVB_ROLE_PREFILL: return "prefill";
    case KVB_ROLE_DECODE: return "decode";
    }
    return "unknown";
}

const char *kvb_bridge_mode_name(uint32_t bridge_mode) {
    switch (bridge_mode) {
    case KVB_BRIDGE_MODE_DECODER: return "decoder";
    case KVB_BRIDGE_MODE_PREFILL: return "prefill";
    }
    return "unknown";
}

const char *kvb_wire_error_name(uint32_t code) {
    switch (code) {
    case KVB_WIRE_ERR_PROTOCOL: return "protocol";
    case KVB_WIRE_ERR_VERSION: return "version";
    case KVB_WIRE_ERR_AUTH: return "auth";
    case KVB_WIRE_ERR_ROLE: return "role";
    case KVB_WIRE_ERR_MODEL: return "model";
    case KVB_WIRE_ERR_FORMAT: return "format";
    case KVB_WIRE_ERR_MODE: return "mode";
    case KVB_WIRE_ERR_INCOMPATIBLE: return "incompatible";
    case KVB_WIRE_ERR_REQUEST: return "request";
    case KVB_WIRE_ERR_CANCELLED: return "cancelled";
    case KVB_WIRE_ERR_INTERNAL: return "internal";
    case KVB_WIRE_ERR_BUSY: return "busy";
    }
    return "unknown";
}

static kvb_status need_cap(const char *what, size_t need, size_t cap, size_t *len, kvb_err *err) {
    *len = need;
    if (need > cap)
        return kvb_err_set(err, KVB_ERR_RANGE, "%s encode: %zu bytes needed, buffer holds %zu", what, need, cap);
    return KVB_OK;
}

static kvb_status exact_size(const char *what, size_t n, size_t want, kvb_err *err) {
    if (n != want)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s payload: %zu bytes, expected exactly %zu", what, n, want);
    return KVB_OK;
}

static bool name_ok(const char *s, size_t n) {
    if (n < 1 || n > KVB_WIRE_NAME_MAX) return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || (unsigned char)s[i] > 0x7e) return false;
    return true;
}

/* ---- HELLO ----------------------------------------------------------------------------------- */

kvb_status kvb_hello_init(kvb_hello *h, kvb_wire_role role, kvb_bridge_mode bridge_mode, const char *name,
                          uint64_t model_fingerprint, const kvb_kvformat *format, kvb_err *err) {
    memset(h, 0, sizeof *h);
    if (role != KVB_ROLE_PREFILL && role != KVB_ROLE_DECODE)
        return kvb_err_set(err, KVB_ERR_INVALID, "hello: role %d is neither prefill nor decode", (int)role);
    if (bridge_mode != KVB_BRIDGE_MODE_DECODER && bridge_mode != KVB_BRIDGE_MODE_PREFILL)
        return kvb_err_set(err, KVB_ERR_INVALID, "hello: bridge mode %d is neither decoder nor prefill", (int)bridge_mode);
    if (!name || !name_ok(name, strlen(name)))
        return kvb_err_set(err, KVB_ERR_INVALID, "hello: node name must be 1..%d printable ASCII characters",
                           KVB_WIRE_NAME_MAX);
    if (!format) return kvb_err_set(err, KVB_ERR_INVALID, "hello: no cache format");
    h->protocol_version = KVB_WIRE_VERSION;
    h->role = (uint8_t)role;
    h->bridge_mode = (uint8_t)bridge_mode;
    h->model_fingerprint = model_fingerprint;
    h->format = *format;
    h->format_fingerprint = kvb_kvformat_fingerprint(format);
    memcpy(h->name, name, strlen(name) + 1);
    return KVB_OK;
}

kvb_status kvb_msg_hello_encode(const kvb_hello *h, uint8_t *buf, size_t cap, size_t *len, kvb_err *err) {
    size_t name_len = strnlen(h->name, sizeof h->name);
    if (!name_ok(h->name, name_len))
        return kvb_err_set(err, KVB_ERR_INVALID, "hello encode: node name must be 1..%d printable ASCII characters",
                           KVB_WIRE_NAME_MAX);
    kvb_status st = need_cap("hello", KVB_HELLO_FIXED_BYTES + name_len, cap, len, err);
    if (st) return st;
    wire_put_u16(buf + 0, h->protocol_version);
    buf[2] = h->role;
    buf[3] = h->bridge_mode;
    wire_put_u64(buf + 4, h->model_fingerprint);
    wire_put_u32(buf + 12, h->format.version);
    wire_put_u32(buf + 16, h->format.dtype);
    wire_put_u32(buf + 20, h->format.block_tokens);
    wire_put_u32(buf + 24, h->format.n_layer);
    wire_put_u32(buf + 28, h->format.n_head_kv);
    wire_put_u32(buf + 32, h->format.head_dim);
    wire_put_u64(buf + 36, h->format_fingerprint);
    memcpy(buf + 44, h->nonce, KVB_WIRE_NONCE_BYTES);
    wire_put_u16(buf + 76, (uint16_t)name_len);
    memcpy(buf + 78, h->name, name_len);
    return KVB_OK;
}

kvb_status kvb_msg_hello_decode(const uint8_t *p, size_t n, kvb_hello *h, kvb_err *err) {
    if (n < KVB_HELLO_FIXED_BYTES)
        return kvb_err_set(err, KVB_ERR_FORMAT, "HELLO payload: %zu bytes, shorter than its %d fixed bytes", n,
                           KVB_HELLO_FIXED_BYTES);
    size_t name_len = wire_get_u16(p + 76);
    if (name_len < 1 || name_len > KVB_WIRE_NAME_MAX)
        return kvb_err_set(err, KVB_ERR_FORMAT, "HELLO payload: node name length %zu (allowed 1..%d)", name_len,
                           KVB_WIRE_NAME_MAX);
    kvb_status st = exact_size("HELLO", n, KVB_HELLO_FIXED_BYTES + name_len, err);
    if (st) return st;
    if (!name_ok((const char *)p + 78, name_len))
        return kvb_err_set(err, KVB_ERR_FORMAT, "HELLO payload: node name has a byte outside printable ASCII");
    if (p[2] != KVB_ROLE_PREFILL && p[2] != KVB_ROLE_DECODE)
        return kvb_err_set(err, KVB_ERR_FORMAT, "HELLO payload: role %u is neither prefill (1) nor decode (2)", p[2]);
    if (p[3] != KVB_BRIDGE_MODE_DECODER && p[3] != KVB_BRIDGE_MODE_PREFILL)
        return kvb_err_set(err, KVB_ERR_FORMAT, "HELLO payload: bridge mode %u is neither decoder (1) nor prefill (2)",
                           p[3]);
    memset(h, 0, sizeof *h);
    h->protocol_version = wire_get_u16(p);
    h->role = p[2];
    h->bridge_mode = p[3];
    h->model_fingerprint = wire_get_u64(p + 4);
    h->format.version = wire_get_u32(p + 12);
    h->format.dtype = wire_get_u32(p + 16);
    h->format.block_tokens = wire_get_u32(p + 20);
    h->format.n_layer = wire_get_u32(p + 24);
    h->format.n_head_kv = wire_get_u32(p + 28);
    h->format.head_dim = wire_get_u32(p + 32);
    h->format_fingerprint = wire_get_u64(p + 36);
    memcpy(h->nonce, p + 44, KVB_WIRE_NONCE_BYTES);
    memcpy(h->name, p + 78, name_len);
    h->name[name_len] = 0;
    return KVB_OK;
}

/* ---- AUTH / AUTH_OK --------------------------------------------------------------------------- */

kvb_status kvb_msg_auth_encode(const kvb_msg_auth *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err) {
    kvb_status st = need_cap("auth", KVB_WIRE_MAC_BYTES, cap, len, err);
    if (st) return st;
    memcpy(buf, m->mac, KVB_WIRE_MAC_BYTES);
    return KVB_OK;
}

kvb_status kvb_msg_auth_decode(const uint8_t *p, size_t n, kvb_msg_auth *m, kvb_err *err) {
    kvb_status st = exact_size("AUTH", n, KVB_WIRE_MAC_BYTES, err);
    if (st) return st;
    memcpy(m->mac, p, KVB_WIRE_MAC_BYTES);
    return KVB_OK;
}

/* ---- PREFILL ---------------------------------------------------------------------------------- */

kvb_status kvb_msg_prefill_encode(const kvb_msg_prefill *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err) {
    if (m->n_tokens < 1 || !m->tokens)
        return kvb_err_set(err, KVB_ERR_INVALID, "prefill encode: a request needs at least one token");
    if (!(m->cached_tokens <= m->ship_tokens && m->ship_tokens <= m->n_tokens))
        return kvb_err_set(err, KVB_ERR_INVALID, "prefill encode: needs cached (%u) <= ship (%u) <= n_tokens (%u)",
                           m->cached_tokens, m->ship_tokens, m->n_tokens);
    for (uint32_t i = 0; i < m->n_tokens; i++)
        if (m->tokens[i] < 0)
            return kvb_err_set(err, KVB_ERR_INVALID, "prefill encode: token %u has the negative id %d", i, m->tokens[i]);
    kvb_status st = need_cap("prefill", KVB_PREFILL_FIXED_BYTES + (size_t)m->n_tokens * 4, cap, len, err);
    if (st) return st;
    wire_put_u64(buf + 0, m->request_id);
    wire_put_u32(buf + 8, m->bridge_mode);
    wire_put_u32(buf + 12, m->n_tokens);
    wire_put_u32(buf + 16, m->cached_tokens);
    wire_put_u32(buf + 20, m->ship_tokens);
    wire_put_u64(buf + 24, m->last_cached_key);
    for (uint32_t i = 0; i < m->n_tokens; i++) wire_put_u32(buf + KVB_PREFILL_FIXED_BYTES + 4 * (size_t)i, (uint32_t)m->tokens[i]);
    return KVB_OK;
}

kvb_status kvb_msg_prefill_decode(const uint8_t *p, size_t n, kvb_msg_prefill *m, kvb_err *err) {
    memset(m, 0, sizeof *m);
    if (n < KVB_PREFILL_FIXED_BYTES)
        return kvb_err_set(err, KVB_ERR_FORMAT, "PREFILL payload: %zu bytes, shorter than its %d fixed bytes", n,
                           KVB_PREFILL_FIXED_BYTES);
    uint32_t mode = wire_get_u32(p + 8), n_tokens = wire_get_u32(p + 12);
    uint32_t cached = wire_get_u32(p + 16), ship = wire_get_u32(p + 20);
    if (mode != KVB_BRIDGE_MODE_DECODER && mode != KVB_BRIDGE_MODE_PREFILL)
        return kvb_err_set(err, KVB_ERR_FORMAT, "PREFILL payload: bridge mode %u is neither decoder (1) nor prefill (2)",
                           mode);
    if (n_tokens < 1) return kvb_err_set(err, KVB_ERR_FORMAT, "PREFILL payload: zero tokens");
    /* n_tokens <= 2^32-1, so 4 * n_tokens + 32 fits in 64 bits: compare without overflow. */
    uint64_t want = KVB_PREFILL_FIXED_BYTES + 4 * (uint64_t)n_tokens;
    if ((uint64_t)n != want)
        return kvb_err_set(err, KVB_ERR_FORMAT, "PREFILL payload: %zu bytes, but %u tokens need exactly %llu", n,
                           n_tokens, (unsigned long long)want);
    if (!(cached <= ship && ship <= n_tokens))
        return kvb_err_set(err, KVB_ERR_FORMAT,
                           "PREFILL payload: needs cached_tokens (%u) <= ship_tokens (%u) <= n_tokens (%u)", cached,
                           ship, n_tokens);
    int32_t *tokens = malloc((size_t)n_tokens * sizeof *tokens);
    if (!tokens) return kvb_err_set(err, KVB_ERR_NOMEM, "PREFILL payload: cannot allocate %u token ids", n_tokens);
    for (uint32_t i = 0; i < n_tokens; i++) {
        uint32_t t = wire_get_u32(p + KVB_PREFILL_FIXED_BYTES + 4 * (size_t)i);
        if (t > (uint32_t)INT32_MAX) {
            free(tokens);
            return kvb_err_set(err, KVB_ERR_FORMAT, "PREFILL payload: token %u has the negative id %d", i, (int32_t)t);
        }
        tokens[i] = (int32_t)t;
    }
    m->request_id = wire_get_u64(p);
    m->bridge_mode = mode;
    m->n_tokens = n_tokens;
    m->cached_tokens = cached;
    m->ship_tokens = ship;
    m->last_cached_key = wire_get_u64(p + 24);
    m->tokens = tokens;
    return KVB_OK;
}

void kvb_msg_prefill_free(kvb_msg_prefill *m) {
    if (!m) return;
    free(m->tokens);
    m->tokens = NULL;
}

kvb_status kvb_msg_prefill_check(const kvb_msg_prefill *m, const kvb_kvformat *fmt, kvb_err *err) {
    if (fmt->block_tokens == 0) return kvb_err_set(err, KVB_ERR_INVALID, "PREFILL check: format has 0 tokens per block");
    if (m->cached_tokens % fmt->block_tokens)
        return kvb_err_set(err, KVB_ERR_FORMAT, "PREFILL: cached_tokens %u is not a multiple of the block size %u",
                           m->cached_tokens, fmt->block_tokens);
    if (m->ship_tokens % fmt->block_tokens && m->ship_tokens >= m->n_tokens)
        return kvb_err_set(err, KVB_ERR_FORMAT,
                           "PREFILL: ship_tokens %u ends in a partial block but does not stop before the last prompt "
                           "token (%u tokens)",
                           m->ship_tokens, m->n_tokens);
    return KVB_OK;
}

/* ---- SLAB ------------------------------------------------------------------------------------- */

void kvb_msg_slab_encode_head(const kvb_msg_slab *m, uint8_t out[KVB_SLAB_HEAD_BYTES]) {
    wire_put_u32(out + 0, m->layer);
    wire_put_u32(out + 4, m->pos0);
    wire_put_u32(out + 8, m->n);
    wire_put_u32(out + 12, 0);
    wire_put_u64(out + 16, m->k_bytes);
    wire_put_u64(out + 24, m->v_bytes);
    wire_put_u64(out + 32, m->checksum);
}

kvb_status kvb_msg_slab_decode(const uint8_t *p, size_t n, kvb_msg_slab *m, kvb_err *err) {
    if (n < KVB_SLAB_HEAD_BYTES)
        return kvb_err_set(err, KVB_ERR_FORMAT, "SLAB payload: %zu bytes, shorter than its %d-byte head", n,
                           KVB_SLAB_HEAD_BYTES);
    uint32_t layer = wire_get_u32(p), pos0 = wire_get_u32(p + 4), cnt = wire_get_u32(p + 8);
    uint32_t reserved = wire_get_u32(p + 12);
    uint64_t kb = wire_get_u64(p + 16), vb = wire_get_u64(p + 24);
    if (reserved != 0) return kvb_err_set(err, KVB_ERR_FORMAT, "SLAB payload: reserved field is %u, must be 0", reserved);
    if (cnt < 1) return kvb_err_set(err, KVB_ERR_FORMAT, "SLAB payload: zero tokens");
    if (cnt > UINT32_MAX - pos0)
        return kvb_err_set(err, KVB_ERR_FORMAT, "SLAB payload: token range %u + %u overflows", pos0, cnt);
    uint64_t body = (uint64_t)n - KVB_SLAB_HEAD_BYTES, sum;
    if (kvb_add_overflow_u64(kb, vb, &sum) || sum != body)
        return kvb_err_set(err, KVB_ERR_FORMAT, "SLAB payload: k_bytes %llu + v_bytes %llu != the %llu bytes present",
                           (unsigned long long)kb, (unsigned long long)vb, (unsigned long long)body);
    m->layer = layer;
    m->pos0 = pos0;
    m->n = cnt;
    m->k_bytes = kb;
    m->v_bytes = vb;
    m->checksum = wire_get_u64(p + 32);
    m->k = p + KVB_SLAB_HEAD_BYTES;
    m->v = p + KVB_SLAB_HEAD_BYTES + kb;
    return KVB_OK;
}

/* ---- DONE ------------------------------------------------------------------------------------- */

kvb_status kvb_msg_done_encode(const kvb_msg_done *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err) {
    if (m->flags & ~KVB_DONE_FLAGS_KNOWN)
        return kvb_err_set(err, KVB_ERR_INVALID, "done encode: unknown flags 0x%x", m->flags);
    if (!isfinite(m->prefill_seconds) || m->prefill_seconds < 0)
        return kvb_err_set(err, KVB_ERR_INVALID, "done encode: prefill seconds must be finite and >= 0");
    kvb_status st = need_cap("done", KVB_DONE_BYTES, cap, len, err);
    if (st) return st;
    uint64_t bits;
    memcpy(&bits, &m->prefill_seconds, 8);
    wire_put_u32(buf + 0, m->tokens_covered);
    wire_put_u32(buf + 4, m->blocks);
    wire_put_u32(buf + 8, m->slabs);
    wire_put_u32(buf + 12, m->flags);
    wire_put_u64(buf + 16, m->chain_digest);
    wire_put_u64(buf + 24, bits);
    return KVB_OK;
}

kvb_status kvb_msg_done_decode(const uint8_t *p, size_t n, kvb_msg_done *m, kvb_err *err) {
    kvb_status st = exact_size("DONE", n, KVB_DONE_BYTES, err);
    if (st) return st;
    uint32_t flags = wire_get_u32(p + 12);
    if (flags & ~KVB_DONE_FLAGS_KNOWN)
        return kvb_err_set(err, KVB_ERR_FORMAT, "DONE payload: unknown flags 0x%x", flags & ~KVB_DONE_FLAGS_KNOWN);
    uint64_t bits = wire_get_u64(p + 24);
    double secs;
    memcpy(&secs, &bits, 8);
    if (!isfinite(secs) || secs < 0)
        return kvb_err_set(err, KVB_ERR_FORMAT, "DONE payload: prefill seconds (bits %016llx) is not finite and >= 0",
                           (unsigned long long)bits);
    m->tokens_covered = wire_get_u32(p);
    m->blocks = wire_get_u32(p + 4);
    m->slabs = wire_get_u32(p + 8);
    m->flags = flags;
    m->chain_digest = wire_get_u64(p + 16);
    m->prefill_seconds = secs;
    return KVB_OK;
}

/* ---- ERROR ------------------------------------------------------------------------------------ */

static bool error_byte_ok(uint8_t b) { return b >= 0x20 && b != 0x7f; }

void kvb_msg_error_set(kvb_msg_error *m, uint32_t code, const char *msg) {
    memset(m, 0, sizeof *m);
    m->code = code;
    size_t n = msg ? strnlen(msg, KVB_WIRE_ERROR_MSG_MAX) : 0;
    for (size_t i = 0; i < n; i++) m->msg[i] = error_byte_ok((uint8_t)msg[i]) ? msg[i] : '?';
    m->msg[n] = 0;
    m->msg_len = (uint32_t)n;
}

kvb_status kvb_msg_error_encode(const kvb_msg_error *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err) {
    if (m->msg_len > KVB_WIRE_ERROR_MSG_MAX)
        return kvb_err_set(err, KVB_ERR_INVALID, "error encode: message of %u bytes (max %d)", m->msg_len,
                           KVB_WIRE_ERROR_MSG_MAX);
    for (uint32_t i = 0; i < m->msg_len; i++)
        if (!error_byte_ok((uint8_t)m->msg[i]))
            return kvb_err_set(err, KVB_ERR_INVALID, "error encode: control byte in message (use kvb_msg_error_set)");
    kvb_status st = need_cap("error", 8 + (size_t)m->msg_len, cap, len, err);
    if (st) return st;
    wire_put_u32(buf, m->code);
    wire_put_u32(buf + 4, m->msg_len);
    memcpy(buf + 8, m->msg, m->msg_len);
    return KVB_OK;
}

kvb_status kvb_msg_error_decode(const uint8_t *p, size_t n, kvb_msg_error *m, kvb_err *err) {
    if (n < 8) return kvb_err_set(err, KVB_ERR_FORMAT, "ERROR payload: %zu bytes, shorter than its 8 fixed bytes", n);
    uint32_t msg_len = wire_get_u32(p + 4);
    if (msg_len > KVB_WIRE_ERROR_MSG_MAX)
        return kvb_err_set(err, KVB_ERR_FORMAT, "ERROR payload: message length %u exceeds %d", msg_len,
                           KVB_WIRE_ERROR_MSG_MAX);
    kvb_status st = exact_size("ERROR", n, 8 + (size_t)msg_len, err);
    if (st) return st;
    for (uint32_t i = 0; i < msg_len; i++)
        if (!error_byte_ok(p[8 + i]))
            return kvb_err_set(err, KVB_ERR_FORMAT, "ERROR payload: control byte 0x%02x in the message", p[8 + i]);
    m->code = wire_get_u32(p);
    m->msg_len = msg_len;
    memcpy(m->msg, p + 8, msg_len);
    m->msg[msg_len] = 0;
    return KVB_OK;
}

/* ---- CANCEL, PING, PONG ------------------------------------------------------------------------ */

static kvb_status encode_u64(const char *what, uint64_t v, uint8_t *buf, size_t cap, size_t *len, kvb_err *err) {
    kvb_status st = need_cap(what, 8, cap, len, err);
    if (st) return st;
    wire_put_u64(buf, v);
    return KVB_OK;
}

kvb_status kvb_msg_cancel_encode(const kvb_msg_cancel *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err) {
    return encode_u64("cancel", m->request_id, buf, cap, len, err);
}

kvb_status kvb_msg_cancel_decode(const uint8_t *p, size_t n, kvb_msg_cancel *m, kvb_err *err) {
    kvb_status st = exact_size("CANCEL", n, 8, err);
    if (st) return st;
    m->request_id = wire_get_u64(p);
    return KVB_OK;
}

kvb_status kvb_msg_ping_encode(const kvb_msg_ping *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err) {
    return encode_u64("ping", m->token, buf, cap, len, err);
}

kvb_status kvb_msg_ping_decode(const uint8_t *p, size_t n, kvb_msg_ping *m, kvb_err *err) {
    kvb_status st = exact_size("PING", n, 8, err);
    if (st) return st;
    *m = (kvb_msg_ping){.token = wire_get_u64(p)};
    return KVB_OK;
}

/* The 16-byte layout PONG and LANE share: u64, u32, u32. */
static kvb_status encode_u64_u32_u32(const char *what, uint64_t a, uint32_t b, uint32_t c, uint8_t *buf, size_t cap,
                                     size_t *len, kvb_err *err) {
    kvb_status st = need_cap(what, 16, cap, len, err);
    if (st) return st;
    wire_put_u64(buf, a);
    wire_put_u32(buf + 8, b);
    wire_put_u32(buf + 12, c);
    return KVB_OK;
}

kvb_status kvb_msg_pong_encode(const kvb_msg_ping *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err) {
    if (m->waiting > m->in_flight)
        return kvb_err_set(err, KVB_ERR_INVALID, "pong encode: %u waiting of %u in flight", m->waiting, m->in_flight);
    return encode_u64_u32_u32("pong", m->token, m->in_flight, m->waiting, buf, cap, len, err);
}

kvb_status kvb_msg_pong_decode(const uint8_t *p, size_t n, kvb_msg_ping *m, kvb_err *err) {
    kvb_status st = exact_size("PONG", n, KVB_PONG_BYTES, err);
    if (st) return st;
    *m = (kvb_msg_ping){.token = wire_get_u64(p), .in_flight = wire_get_u32(p + 8), .waiting = wire_get_u32(p + 12)};
    if (m->waiting > m->in_flight)
        return kvb_err_set(err, KVB_ERR_FORMAT, "PONG: %u waiting of %u in flight", m->waiting, m->in_flight);
    return KVB_OK;
}

kvb_status kvb_msg_lane_encode(const kvb_msg_lane *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err) {
    return encode_u64_u32_u32("lane", m->group, m->lane, m->lanes, buf, cap, len, err);
}

kvb_status kvb_msg_lane_decode(const uint8_t *p, size_t n, kvb_msg_lane *m, kvb_err *err) {
    kvb_status st = exact_size("LANE", n, KVB_LANE_BYTES, err);
    if (st) return st;
    m->group = wire_get_u64(p);
    m->lane = wire_get_u32(p + 8);
    m->lanes = wire_get_u32(p + 12);
    if (m->group == 0) return kvb_err_set(err, KVB_ERR_FORMAT, "LANE: group 0 is reserved");
    if (m->lanes < 1 || m->lanes > KVB_WIRE_MAX_LANES)
        return kvb_err_set(err, KVB_ERR_FORMAT, "LANE: lanes %u outside 1..%d", m->lanes, KVB_WIRE_MAX_LANES);
    if (m->lane >= m->lanes) return kvb_err_set(err, KVB_ERR_FORMAT, "LANE: lane %u of %u", m->lane, m->lanes);
    return KVB_OK;
}
