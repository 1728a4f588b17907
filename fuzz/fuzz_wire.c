/* fuzz/fuzz_wire.c — libFuzzer target for the wire protocol's receive side (src/transport). The
 * first input byte picks what the rest is fed to:
 *   0      a whole frame: kvb_wire_frame_parse (header checks, limit, payload hash), then the
 *          payload's message decoder (kvb_msg_decode, or HELLO / AUTH for handshake types);
 *   1..8   one message decoder directly on the bytes (HELLO, AUTH, PREFILL, SLAB, DONE, ERROR,
 *          CANCEL, PING), skipping the hash so the fuzzer reaches the field checks;
 *   9      44 bytes to kvb_wire_header_decode.
 *   10     a PONG payload (a PONG frame also arrives through mode 0).
 * libFuzzer's buffer is exactly sized, so ASan sees any over-read. Every decode that succeeds must
 * keep its promises (views inside the payload, counts consistent, strings terminated) and must
 * re-encode to exactly the input bytes: decode accepts only canonical encodings, and encode never
 * writes something decode would refuse.
 *
 * Built a second time with FUZZ_WIRE_WRITE_SEEDS as fuzz_wire_seeds DIR, which writes one valid
 * input per mode (encoded by the library's own encoders) as the seed corpus. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_quant.h"
#include "kvb_transport.h"

static void check(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "fuzz_wire: invariant violated: %s\n", what);
        abort();
    }
}

static void check_reencoded(const uint8_t *buf, size_t len, const uint8_t *p, size_t n, const char *what) {
    check(len == n, what);
    check(memcmp(buf, p, n) == 0, what);
}

/* Decodes one payload of the given type; on success checks its invariants and the re-encoding. */
static void decode_payload(uint16_t type, const uint8_t *p, size_t n) {
    kvb_err err;
    size_t len;
    switch (type) {
    case KVB_FRAME_HELLO: {
        kvb_hello h;
        if (kvb_msg_hello_decode(p, n, &h, &err) != KVB_OK) return;
        check(strlen(h.name) >= 1 && strlen(h.name) <= KVB_WIRE_NAME_MAX, "hello name length");
        uint8_t buf[KVB_HELLO_FIXED_BYTES + KVB_WIRE_NAME_MAX];
        check(kvb_msg_hello_encode(&h, buf, sizeof buf, &len, &err) == KVB_OK, "hello re-encodes");
        check_reencoded(buf, len, p, n, "hello round trip");
        return;
    }
    case KVB_FRAME_AUTH:
    case KVB_FRAME_AUTH_OK: {
        kvb_msg_auth a;
        if (kvb_msg_auth_decode(p, n, &a, &err) != KVB_OK) return;
        uint8_t buf[KVB_WIRE_MAC_BYTES];
        check(kvb_msg_auth_encode(&a, buf, sizeof buf, &len, &err) == KVB_OK, "auth re-encodes");
        check_reencoded(buf, len, p, n, "auth round trip");
        return;
    }
    case KVB_FRAME_PREFILL: {
        kvb_msg_prefill m;
        if (kvb_msg_prefill_decode(p, n, &m, &err) != KVB_OK) return;
        check(m.n_tokens >= 1 && m.cached_tokens <= m.ship_tokens && m.ship_tokens <= m.n_tokens, "prefill counts");
        uint64_t sum = 0;
        for (uint32_t i = 0; i < m.n_tokens; i++) {
            check(m.tokens[i] >= 0, "prefill token ids are >= 0");
            sum += (uint64_t)m.tokens[i];
        }
        (void)sum;
        uint8_t *buf = malloc(n);
        check(buf != NULL, "alloc");
        check(kvb_msg_prefill_encode(&m, buf, n, &len, &err) == KVB_OK, "prefill re-encodes");
        check_reencoded(buf, len, p, n, "prefill round trip");
        free(buf);
        kvb_msg_prefill_free(&m);
        return;
    }
    case KVB_FRAME_SLAB: {
        kvb_msg_slab s;
        if (kvb_msg_slab_decode(p, n, &s, &err) != KVB_OK) return;
        check(s.n >= 1 && s.pos0 + (uint64_t)s.n <= UINT32_MAX, "slab token range");
        check(s.k == p + KVB_SLAB_HEAD_BYTES && s.v == s.k + s.k_bytes, "slab views in place");
        check(KVB_SLAB_HEAD_BYTES + s.k_bytes + s.v_bytes == n, "slab bytes add up");
        volatile uint8_t touch = 0;
        if (s.k_bytes) touch ^= s.k[0] ^ s.k[s.k_bytes - 1];
        if (s.v_bytes) touch ^= s.v[0] ^ s.v[s.v_bytes - 1];
        (void)touch;
        uint8_t head[KVB_SLAB_HEAD_BYTES];
        kvb_msg_slab_encode_head(&s, head);
        check(memcmp(head, p, KVB_SLAB_HEAD_BYTES) == 0, "slab head round trip");
        return;
    }
    case KVB_FRAME_DONE: {
        kvb_msg_done d;
        if (kvb_msg_done_decode(p, n, &d, &err) != KVB_OK) return;
        check(!(d.flags & ~KVB_DONE_FLAGS_KNOWN), "done flags");
        check(d.prefill_seconds >= 0 && isfinite(d.prefill_seconds), "done seconds finite");
        uint8_t buf[KVB_DONE_BYTES];
        check(kvb_msg_done_encode(&d, buf, sizeof buf, &len, &err) == KVB_OK, "done re-encodes");
        check_reencoded(buf, len, p, n, "done round trip");
        return;
    }
    case KVB_FRAME_ERROR: {
        kvb_msg_error e;
        if (kvb_msg_error_decode(p, n, &e, &err) != KVB_OK) return;
        check(strlen(e.msg) == e.msg_len && e.msg_len <= KVB_WIRE_ERROR_MSG_MAX, "error message terminated");
        uint8_t buf[8 + KVB_WIRE_ERROR_MSG_MAX];
        check(kvb_msg_error_encode(&e, buf, sizeof buf, &len, &err) == KVB_OK, "error re-encodes");
        check_reencoded(buf, len, p, n, "error round trip");
        return;
    }
    case KVB_FRAME_CANCEL: {
        kvb_msg_cancel c;
        if (kvb_msg_cancel_decode(p, n, &c, &err) != KVB_OK) return;
        uint8_t buf[8];
        check(kvb_msg_cancel_encode(&c, buf, sizeof buf, &len, &err) == KVB_OK, "cancel re-encodes");
        check_reencoded(buf, len, p, n, "cancel round trip");
        return;
    }
    case KVB_FRAME_PING: {
        kvb_msg_ping g;
        if (kvb_msg_ping_decode(p, n, &g, &err) != KVB_OK) return;
        uint8_t buf[8];
        check(kvb_msg_ping_encode(&g, buf, sizeof buf, &len, &err) == KVB_OK, "ping re-encodes");
        check_reencoded(buf, len, p, n, "ping round trip");
        return;
    }
    case KVB_FRAME_PONG: {
        kvb_msg_ping g;
        if (kvb_msg_pong_decode(p, n, &g, &err) != KVB_OK) return;
        uint8_t buf[KVB_PONG_BYTES];
        check(kvb_msg_pong_encode(&g, buf, sizeof buf, &len, &err) == KVB_OK, "pong re-encodes");
        check_reencoded(buf, len, p, n, "pong round trip");
        return;
    }
    case KVB_FRAME_LANE: {
        kvb_msg_lane l;
        if (kvb_msg_lane_decode(p, n, &l, &err) != KVB_OK) return;
        check(l.group != 0 && l.lanes >= 1 && l.lanes <= KVB_WIRE_MAX_LANES && l.lane < l.lanes, "lane fields");
        uint8_t buf[KVB_LANE_BYTES];
        check(kvb_msg_lane_encode(&l, buf, sizeof buf, &len, &err) == KVB_OK, "lane re-encodes");
        check_reencoded(buf, len, p, n, "lane round trip");
        return;
    }
    }
}

static void fuzz_frame(const uint8_t *p, size_t n) {
    kvb_frame f;
    kvb_err err;
    if (kvb_wire_frame_parse(p, n, 1 << 16, &f, &err) != KVB_OK) {
        check(err.msg[0] != 0, "a refusal has a message");
        return;
    }
    check(f.type >= 1 && f.type <= KVB_FRAME_TYPE_MAX && f.flags == 0, "frame header fields");
    check(f.payload == p + KVB_WIRE_HEADER_BYTES && f.payload_len == n - KVB_WIRE_HEADER_BYTES, "frame payload view");
    kvb_iov iov = {f.payload, (size_t)f.payload_len};
    check(kvb_wire_payload_hash(&iov, 1) == kvb_wire_payload_hash(&iov, f.payload_len ? 1 : 0), "hash of pieces");
    if (f.type == KVB_FRAME_HELLO || f.type == KVB_FRAME_AUTH || f.type == KVB_FRAME_AUTH_OK) {
        decode_payload(f.type, f.payload, (size_t)f.payload_len);
        return;
    }
    kvb_msg m;
    if (kvb_msg_decode(&f, &m, &err) == KVB_OK) {
        check(m.type == f.type && m.request_id == f.request_id, "message header");
        if (m.type == KVB_FRAME_PREFILL) check(m.u.prefill.request_id == f.request_id, "prefill request id");
        kvb_msg_free(&m);
        decode_payload(f.type, f.payload, (size_t)f.payload_len);
    }
}

static const uint16_t g_mode_type[] = {0, KVB_FRAME_HELLO, KVB_FRAME_AUTH, KVB_FRAME_PREFILL, KVB_FRAME_SLAB,
                                       KVB_FRAME_DONE, KVB_FRAME_ERROR, KVB_FRAME_CANCEL, KVB_FRAME_PING};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint8_t mode = data[0] % 11;
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    if (mode == 0) {
        fuzz_frame(p, n);
    } else if (mode == 9) {
        if (n < KVB_WIRE_HEADER_BYTES) return 0;
        kvb_frame_header h;
        kvb_err err;
        if (kvb_wire_header_decode(p, 1 << 16, &h, &err) == KVB_OK) {
            uint8_t again[KVB_WIRE_HEADER_BYTES];
            kvb_wire_header_encode(&h, again);
            check(memcmp(again, p, KVB_WIRE_HEADER_BYTES) == 0, "header round trip");
        }
    } else if (mode == 10) {
        decode_payload(KVB_FRAME_PONG, p, n);
    } else {
        decode_payload(g_mode_type[mode], p, n);
    }
    return 0;
}

#ifdef FUZZ_WIRE_WRITE_SEEDS
static void write_seed(const char *dir, const char *name, uint8_t mode, const uint8_t *p, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        exit(1);
    }
    fputc(mode, f);
    fwrite(p, 1, n, f);
    fclose(f);
}

/* Writes the payload both as a bare message (its mode) and wrapped in a frame (mode 0). */
static void seed(const char *dir, const char *name, uint8_t mode, uint16_t type, uint64_t req, const uint8_t *p,
                 size_t n) {
    char fname[256];
    snprintf(fname, sizeof fname, "msg-%s", name);
    write_seed(dir, fname, mode, p, n);
    uint8_t *frame = malloc(KVB_WIRE_HEADER_BYTES + n);
    size_t w;
    kvb_err err;
    kvb_iov iov = {p, n};
    if (kvb_wire_frame_encode(type, req, &iov, 1, frame, KVB_WIRE_HEADER_BYTES + n, &w, &err) != KVB_OK) {
        fprintf(stderr, "%s\n", err.msg);
        exit(1);
    }
    snprintf(fname, sizeof fname, "frame-%s", name);
    write_seed(dir, fname, 0, frame, w);
    write_seed(dir, "header", 9, frame, KVB_WIRE_HEADER_BYTES);
    free(frame);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    kvb_err err;
    uint8_t buf[2048];
    size_t n;
    kvb_kvformat fmt;
    kvb_hello h;
    if (kvb_kvformat_init(&fmt, KVB_TYPE_F16, 16, 4, 2, 64, &err) ||
        kvb_hello_init(&h, KVB_ROLE_DECODE, KVB_BRIDGE_MODE_DECODER, "decoder-a", 42, &fmt, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    kvb_msg_hello_encode(&h, buf, sizeof buf, &n, &err);
    seed(dir, "hello", 1, KVB_FRAME_HELLO, 0, buf, n);
    kvb_msg_auth a;
    memset(a.mac, 0xa5, sizeof a.mac);
    kvb_msg_auth_encode(&a, buf, sizeof buf, &n, &err);
    seed(dir, "auth", 2, KVB_FRAME_AUTH, 0, buf, n);
    int32_t tokens[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    kvb_msg_prefill pf = {.request_id = 3, .bridge_mode = 1, .n_tokens = 8, .cached_tokens = 0, .ship_tokens = 4,
                          .last_cached_key = 77, .tokens = tokens};
    kvb_msg_prefill_encode(&pf, buf, sizeof buf, &n, &err);
    seed(dir, "prefill", 3, KVB_FRAME_PREFILL, 3, buf, n);
    kvb_msg_slab s = {.layer = 1, .pos0 = 16, .n = 4, .k_bytes = 8, .v_bytes = 8, .checksum = 9};
    kvb_msg_slab_encode_head(&s, buf);
    memset(buf + KVB_SLAB_HEAD_BYTES, 0x3c, 16);
    seed(dir, "slab", 4, KVB_FRAME_SLAB, 3, buf, KVB_SLAB_HEAD_BYTES + 16);
    kvb_msg_done d = {.tokens_covered = 16, .blocks = 1, .slabs = 4, .flags = KVB_DONE_PARTIAL,
                      .chain_digest = 5, .prefill_seconds = 0.25};
    kvb_msg_done_encode(&d, buf, sizeof buf, &n, &err);
    seed(dir, "done", 5, KVB_FRAME_DONE, 3, buf, n);
    kvb_msg_error e;
    kvb_msg_error_set(&e, KVB_WIRE_ERR_MODEL, "model fingerprint differs");
    kvb_msg_error_encode(&e, buf, sizeof buf, &n, &err);
    seed(dir, "error", 6, KVB_FRAME_ERROR, 0, buf, n);
    kvb_msg_cancel c = {3};
    kvb_msg_cancel_encode(&c, buf, sizeof buf, &n, &err);
    seed(dir, "cancel", 7, KVB_FRAME_CANCEL, 3, buf, n);
    kvb_msg_ping g = {.token = 11};
    kvb_msg_ping_encode(&g, buf, sizeof buf, &n, &err);
    seed(dir, "ping", 8, KVB_FRAME_PING, 0, buf, n);
    kvb_msg_ping q = {.token = 11, .in_flight = 2, .waiting = 1};
    kvb_msg_pong_encode(&q, buf, sizeof buf, &n, &err);
    seed(dir, "pong", 10, KVB_FRAME_PONG, 0, buf, n);
    return 0;
}
#endif
