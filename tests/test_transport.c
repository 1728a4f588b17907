/* tests/test_transport.c — the wire format without a network (issue 6, item 1): the frame header
 * round-trips and a change to any one of its 44 bytes (every bit pattern tried: 1-bit, high bit,
 * all bits) is detected; a change to any payload byte is detected; an oversize payload length is
 * refused from the header alone; every message type round-trips through encode -> frame -> parse ->
 * decode -> encode byte for byte; EVERY truncation (and a one-byte extension) of every message's
 * payload fails to decode cleanly (each decode reads from an exactly sized heap copy, so ASan sees
 * any over-read); each decoder refuses hostile field values (overflowing lengths, counts beyond the
 * payload, reserved bits, bad enumerations, control bytes, NaN) with a message naming the field;
 * the chain digest is XXH3 of the little-endian keys in order. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "kvb_quant.h"
#include "kvb_transport.h"

/* ---- helpers ------------------------------------------------------------------------------------ */

static kvb_kvformat test_format(void) {
    kvb_kvformat f;
    kvb_err e = {0};
    assert_int_equal(kvb_kvformat_init(&f, KVB_TYPE_F16, 16, 4, 2, 64, &e), KVB_OK);
    return f;
}

static kvb_hello test_hello(void) {
    kvb_hello h;
    kvb_err e = {0};
    kvb_kvformat f = test_format();
    if (kvb_hello_init(&h, KVB_ROLE_DECODE, KVB_BRIDGE_MODE_DECODER, "decoder-a", 0x1122334455667788ULL, &f, &e))
        fail_msg("kvb_hello_init: %s", e.msg);
    for (int i = 0; i < KVB_WIRE_NONCE_BYTES; i++) h.nonce[i] = (uint8_t)(i * 7 + 1);
    return h;
}

/* A decode attempt on an exactly sized heap copy of p[0..n). */
typedef kvb_status (*decode_fn)(const uint8_t *p, size_t n, void *out, kvb_err *err);

static kvb_status decode_copy(decode_fn fn, const uint8_t *p, size_t n, void *out, kvb_err *err) {
    uint8_t *copy = malloc(n ? n : 1);
    assert_non_null(copy);
    if (n) memcpy(copy, p, n);
    kvb_status st = fn(copy, n, out, err);
    free(copy);
    return st;
}

/* The message decoders as decode_fn (the slab views point into the copy, so only the status is used). */
static kvb_status dec_hello(const uint8_t *p, size_t n, void *o, kvb_err *e) { return kvb_msg_hello_decode(p, n, o, e); }
static kvb_status dec_auth(const uint8_t *p, size_t n, void *o, kvb_err *e) { return kvb_msg_auth_decode(p, n, o, e); }
static kvb_status dec_prefill(const uint8_t *p, size_t n, void *o, kvb_err *e) {
    kvb_status st = kvb_msg_prefill_decode(p, n, o, e);
    if (st == KVB_OK) kvb_msg_prefill_free(o);
    return st;
}
static kvb_status dec_slab(const uint8_t *p, size_t n, void *o, kvb_err *e) { return kvb_msg_slab_decode(p, n, o, e); }
static kvb_status dec_done(const uint8_t *p, size_t n, void *o, kvb_err *e) { return kvb_msg_done_decode(p, n, o, e); }
static kvb_status dec_error(const uint8_t *p, size_t n, void *o, kvb_err *e) { return kvb_msg_error_decode(p, n, o, e); }
static kvb_status dec_cancel(const uint8_t *p, size_t n, void *o, kvb_err *e) { return kvb_msg_cancel_decode(p, n, o, e); }
static kvb_status dec_ping(const uint8_t *p, size_t n, void *o, kvb_err *e) { return kvb_msg_ping_decode(p, n, o, e); }
static kvb_status dec_pong(const uint8_t *p, size_t n, void *o, kvb_err *e) { return kvb_msg_pong_decode(p, n, o, e); }
static kvb_status dec_lane(const uint8_t *p, size_t n, void *o, kvb_err *e) { return kvb_msg_lane_decode(p, n, o, e); }

/* Every strict prefix and a one-byte extension of a valid payload must be refused. */
static void check_truncations(const char *what, decode_fn fn, const uint8_t *p, size_t n) {
    union {
        kvb_hello h;
        kvb_msg_auth a;
        kvb_msg_prefill pf;
        kvb_msg_slab s;
        kvb_msg_done d;
        kvb_msg_error er;
        kvb_msg_cancel c;
        kvb_msg_ping pg;
        kvb_msg_lane ln;
    } out;
    kvb_err e = {0};
    if (decode_copy(fn, p, n, &out, &e) != KVB_OK) fail_msg("%s: the full payload must decode: %s", what, e.msg);
    for (size_t t = 0; t < n; t++) {
        e.msg[0] = 0;
        kvb_status st = decode_copy(fn, p, t, &out, &e);
        if (st == KVB_OK) fail_msg("%s: truncated to %zu of %zu bytes, decode accepted it", what, t, n);
        assert_int_equal(st, KVB_ERR_FORMAT);
        assert_true(strlen(e.msg) > 10);
    }
    uint8_t *longer = calloc(1, n + 1);
    assert_non_null(longer);
    memcpy(longer, p, n);
    if (decode_copy(fn, longer, n + 1, &out, &e) == KVB_OK) fail_msg("%s: one trailing byte was accepted", what);
    free(longer);
}

/* Wraps a payload in a frame, parses it back and returns the parsed frame (bytes in *frame_out). */
static kvb_frame frame_roundtrip(uint16_t type, uint64_t req, const uint8_t *p, size_t n, uint8_t **frame_out) {
    uint8_t *buf = malloc(KVB_WIRE_HEADER_BYTES + n);
    assert_non_null(buf);
    size_t w = 0;
    kvb_err e = {0};
    kvb_iov iov = {p, n};
    assert_int_equal(kvb_wire_frame_encode(type, req, &iov, 1, buf, KVB_WIRE_HEADER_BYTES + n, &w, &e), KVB_OK);
    assert_int_equal(w, KVB_WIRE_HEADER_BYTES + n);
    kvb_frame f;
    if (kvb_wire_frame_parse(buf, w, 1 << 20, &f, &e)) fail_msg("parse: %s", e.msg);
    assert_int_equal(f.type, type);
    assert_int_equal(f.request_id, req);
    assert_int_equal(f.payload_len, n);
    assert_memory_equal(f.payload, p, n);
    *frame_out = buf;
    return f;
}

/* ---- frames ------------------------------------------------------------------------------------- */

static void test_header_roundtrip(void **state) {
    (void)state;
    kvb_frame_header h = {.type = KVB_FRAME_SLAB, .request_id = 0xfedcba9876543210ULL, .payload_len = 123456,
                          .payload_hash = 0x0102030405060708ULL};
    uint8_t b[KVB_WIRE_HEADER_BYTES];
    kvb_wire_header_encode(&h, b);
    assert_memory_equal(b, "KVB1", 4);
    assert_int_equal(b[4], KVB_WIRE_VERSION);
    assert_int_equal(b[5], 0);
    assert_int_equal(b[6], KVB_FRAME_SLAB);
    assert_int_equal(b[12], 0x10); /* little-endian request id */
    assert_int_equal(b[19], 0xfe);
    uint64_t hh = XXH3_64bits(b, 36);
    for (int i = 0; i < 8; i++) assert_int_equal(b[36 + i], (uint8_t)(hh >> (8 * i)));
    kvb_frame_header d;
    kvb_err e = {0};
    assert_int_equal(kvb_wire_header_decode(b, 1 << 20, &d, &e), KVB_OK);
    assert_int_equal(d.version, KVB_WIRE_VERSION);
    assert_int_equal(d.type, KVB_FRAME_SLAB);
    assert_int_equal(d.flags, 0);
    assert_int_equal(d.request_id, h.request_id);
    assert_int_equal(d.payload_len, h.payload_len);
    assert_int_equal(d.payload_hash, h.payload_hash);
    for (uint32_t t = 1; t <= KVB_FRAME_TYPE_MAX; t++) assert_string_not_equal(kvb_frame_type_name(t), "unknown");
    assert_string_equal(kvb_frame_type_name(0), "unknown");
}

static void test_header_corruption_every_byte(void **state) {
    (void)state;
    const uint8_t payload[] = "some payload bytes";
    uint8_t frame[KVB_WIRE_HEADER_BYTES + sizeof payload];
    size_t w;
    kvb_err e = {0};
    kvb_iov iov = {payload, sizeof payload};
    assert_int_equal(kvb_wire_frame_encode(KVB_FRAME_DONE, 42, &iov, 1, frame, sizeof frame, &w, &e), KVB_OK);
    kvb_frame f;
    assert_int_equal(kvb_wire_frame_parse(frame, w, 1 << 20, &f, &e), KVB_OK);
    const uint8_t masks[] = {0x01, 0x02, 0x10, 0x80, 0xff, 0x5a};
    int checksum_detected = 0;
    for (int i = 0; i < KVB_WIRE_HEADER_BYTES; i++)
        for (size_t m = 0; m < sizeof masks; m++) {
            uint8_t bad[sizeof frame];
            memcpy(bad, frame, w);
            bad[i] ^= masks[m];
            kvb_frame_header h;
            e.msg[0] = 0;
            kvb_status st = kvb_wire_header_decode(bad, 1 << 20, &h, &e);
            if (st == KVB_OK) fail_msg("header byte %d ^ 0x%02x went undetected", i, masks[m]);
            assert_true(strstr(e.msg, "frame header") != NULL);
            if (i >= 8) {
                /* past magic and version, only the header checksum can catch it */
                if (st != KVB_ERR_CHECKSUM || e.code != KVB_ERR_CHECKSUM)
                    fail_msg("byte %d: expected a checksum failure, got %s: %s", i, kvb_status_name(st), e.msg);
                checksum_detected++;
            }
            assert_int_not_equal(kvb_wire_frame_parse(bad, w, 1 << 20, &f, &e), KVB_OK);
        }
    assert_int_equal(checksum_detected, (KVB_WIRE_HEADER_BYTES - 8) * (int)sizeof masks);

    /* A header re-hashed after a bad field is still refused by field: type, flags, version, magic. */
    struct {
        int off, val;
        const char *needle;
        kvb_status code;
    } fields[] = {{6, 0, "unknown frame type 0", KVB_ERR_FORMAT},
                  {6, KVB_FRAME_TYPE_MAX + 1, "unknown frame type", KVB_ERR_FORMAT},
                  {8, 1, "unknown flags", KVB_ERR_FORMAT},
                  {11, 0x80, "unknown flags", KVB_ERR_FORMAT},
                  {4, KVB_WIRE_VERSION + 1, "protocol version", KVB_ERR_MISMATCH},
                  {0, 'X', "bad magic", KVB_ERR_FORMAT}};
    for (size_t k = 0; k < KVB_ARRAY_LEN(fields); k++) {
        uint8_t bad[KVB_WIRE_HEADER_BYTES];
        memcpy(bad, frame, sizeof bad);
        bad[fields[k].off] = (uint8_t)fields[k].val;
        uint64_t hh = XXH3_64bits(bad, 36);
        for (int i = 0; i < 8; i++) bad[36 + i] = (uint8_t)(hh >> (8 * i));
        kvb_frame_header h;
        assert_int_equal(kvb_wire_header_decode(bad, 1 << 20, &h, &e), fields[k].code);
        if (!strstr(e.msg, fields[k].needle)) fail_msg("field at %d: message \"%s\" lacks \"%s\"", fields[k].off, e.msg, fields[k].needle);
    }
}

static void test_payload_corruption_every_byte(void **state) {
    (void)state;
    uint8_t payload[200];
    for (size_t i = 0; i < sizeof payload; i++) payload[i] = (uint8_t)(i * 31 + 7);
    uint8_t *frame;
    size_t w = KVB_WIRE_HEADER_BYTES + sizeof payload;
    kvb_err e = {0};
    /* every payload byte of a PREFILL frame; of a SLAB frame its 40-byte head (which carries the
     * slab checksum): K || V after it are the slab checksum's, verified by the store */
    const uint16_t types[] = {KVB_FRAME_PREFILL, KVB_FRAME_SLAB};
    for (int ti = 0; ti < 2; ti++) {
        frame_roundtrip(types[ti], 9, payload, sizeof payload, &frame);
        const size_t hashed = types[ti] == KVB_FRAME_SLAB ? KVB_SLAB_HEAD_BYTES : sizeof payload;
        assert_true(kvb_wire_hashed_len(types[ti], sizeof payload) == hashed);
        for (size_t i = KVB_WIRE_HEADER_BYTES; i < w; i++)
            for (int bit = 0; bit < 8; bit += 3) {
                frame[i] ^= (uint8_t)(1u << bit);
                kvb_frame f;
                kvb_status st = kvb_wire_frame_parse(frame, w, 1 << 20, &f, &e);
                if (i - KVB_WIRE_HEADER_BYTES < hashed) {
                    if (st == KVB_OK)
                        fail_msg("payload byte %zu bit %d went undetected", i - KVB_WIRE_HEADER_BYTES, bit);
                    assert_int_equal(st, KVB_ERR_CHECKSUM);
                    assert_true(strstr(e.msg, kvb_frame_type_name(types[ti])) != NULL);
                } else {
                    assert_int_equal(st, KVB_OK); /* the slab checksum's job */
                }
                frame[i] ^= (uint8_t)(1u << bit);
            }
        if (ti == 0) free(frame);
    }
    /* a frame shorter or longer than its header says */
    kvb_frame f;
    assert_int_equal(kvb_wire_frame_parse(frame, w - 1, 1 << 20, &f, &e), KVB_ERR_FORMAT);
    assert_int_equal(kvb_wire_frame_parse(frame, KVB_WIRE_HEADER_BYTES - 1, 1 << 20, &f, &e), KVB_ERR_FORMAT);
    free(frame);
}

static void test_oversize_refused_from_header(void **state) {
    (void)state;
    kvb_err e = {0};
    kvb_frame_header h = {.type = KVB_FRAME_SLAB, .payload_len = (1ULL << 40)};
    uint8_t b[KVB_WIRE_HEADER_BYTES];
    kvb_wire_header_encode(&h, b);
    kvb_frame_header d;
    assert_int_equal(kvb_wire_header_decode(b, KVB_WIRE_DEFAULT_MAX_PAYLOAD, &d, &e), KVB_ERR_RANGE);
    assert_true(strstr(e.msg, "exceeds the limit") != NULL);
    h.payload_len = UINT64_MAX;
    kvb_wire_header_encode(&h, b);
    assert_int_equal(kvb_wire_header_decode(b, KVB_WIRE_MAX_PAYLOAD_LIMIT, &d, &e), KVB_ERR_RANGE);
    /* exactly at the limit passes, one above does not */
    h.payload_len = 4096;
    kvb_wire_header_encode(&h, b);
    assert_int_equal(kvb_wire_header_decode(b, 4096, &d, &e), KVB_OK);
    assert_int_equal(kvb_wire_header_decode(b, 4095, &d, &e), KVB_ERR_RANGE);
}

/* ---- messages ----------------------------------------------------------------------------------- */

static void test_hello_roundtrip_and_truncations(void **state) {
    (void)state;
    kvb_hello h = test_hello();
    uint8_t buf[256];
    size_t n;
    kvb_err e = {0};
    assert_int_equal(kvb_msg_hello_encode(&h, buf, sizeof buf, &n, &e), KVB_OK);
    assert_int_equal(n, KVB_HELLO_FIXED_BYTES + strlen("decoder-a"));
    uint8_t *frame;
    kvb_frame f = frame_roundtrip(KVB_FRAME_HELLO, 0, buf, n, &frame);
    kvb_hello d;
    assert_int_equal(kvb_msg_hello_decode(f.payload, (size_t)f.payload_len, &d, &e), KVB_OK);
    assert_int_equal(d.protocol_version, KVB_WIRE_VERSION);
    assert_int_equal(d.role, KVB_ROLE_DECODE);
    assert_int_equal(d.bridge_mode, KVB_BRIDGE_MODE_DECODER);
    assert_int_equal(d.model_fingerprint, h.model_fingerprint);
    assert_memory_equal(&d.format, &h.format, sizeof d.format);
    assert_int_equal(d.format_fingerprint, kvb_kvformat_fingerprint(&h.format));
    assert_memory_equal(d.nonce, h.nonce, KVB_WIRE_NONCE_BYTES);
    assert_string_equal(d.name, "decoder-a");
    uint8_t again[256];
    size_t n2;
    assert_int_equal(kvb_msg_hello_encode(&d, again, sizeof again, &n2, &e), KVB_OK);
    assert_int_equal(n2, n);
    assert_memory_equal(again, buf, n);
    free(frame);
    check_truncations("HELLO", dec_hello, buf, n);

    /* hostile fields */
    uint8_t bad[256];
    memcpy(bad, buf, n);
    bad[2] = 3;
    assert_int_equal(kvb_msg_hello_decode(bad, n, &d, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "role") != NULL);
    memcpy(bad, buf, n);
    bad[3] = 0;
    assert_int_equal(kvb_msg_hello_decode(bad, n, &d, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "bridge mode") != NULL);
    memcpy(bad, buf, n);
    bad[78] = '\n';
    assert_int_equal(kvb_msg_hello_decode(bad, n, &d, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "printable") != NULL);
    memcpy(bad, buf, n);
    bad[76] = 0;
    bad[77] = 0; /* name_len 0 */
    assert_int_equal(kvb_msg_hello_decode(bad, n, &d, &e), KVB_ERR_FORMAT);
    memcpy(bad, buf, n);
    bad[76] = 0xff;
    bad[77] = 0xff; /* name_len 65535 */
    assert_int_equal(kvb_msg_hello_decode(bad, n, &d, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "name length") != NULL);

    /* the constructor refuses bad names and roles */
    kvb_kvformat fmt = test_format();
    assert_int_equal(kvb_hello_init(&d, KVB_ROLE_DECODE, KVB_BRIDGE_MODE_DECODER, "", 1, &fmt, &e), KVB_ERR_INVALID);
    assert_int_equal(kvb_hello_init(&d, KVB_ROLE_DECODE, KVB_BRIDGE_MODE_DECODER, "tab\there", 1, &fmt, &e), KVB_ERR_INVALID);
    char longname[KVB_WIRE_NAME_MAX + 2];
    memset(longname, 'a', sizeof longname - 1);
    longname[sizeof longname - 1] = 0;
    assert_int_equal(kvb_hello_init(&d, KVB_ROLE_DECODE, KVB_BRIDGE_MODE_DECODER, longname, 1, &fmt, &e), KVB_ERR_INVALID);
    longname[KVB_WIRE_NAME_MAX] = 0;
    assert_int_equal(kvb_hello_init(&d, KVB_ROLE_DECODE, KVB_BRIDGE_MODE_DECODER, longname, 1, &fmt, &e), KVB_OK);
    assert_int_equal(kvb_hello_init(&d, (kvb_wire_role)7, KVB_BRIDGE_MODE_DECODER, "x", 1, &fmt, &e), KVB_ERR_INVALID);
    /* a too-small buffer reports the size needed */
    assert_int_equal(kvb_msg_hello_encode(&h, buf, 10, &n2, &e), KVB_ERR_RANGE);
    assert_int_equal(n2, n);
}

static void test_auth_roundtrip_and_truncations(void **state) {
    (void)state;
    kvb_msg_auth a, d;
    for (int i = 0; i < KVB_WIRE_MAC_BYTES; i++) a.mac[i] = (uint8_t)(0xa0 ^ i);
    uint8_t buf[64];
    size_t n;
    kvb_err e = {0};
    assert_int_equal(kvb_msg_auth_encode(&a, buf, sizeof buf, &n, &e), KVB_OK);
    assert_int_equal(n, KVB_WIRE_MAC_BYTES);
    uint8_t *frame;
    kvb_frame f = frame_roundtrip(KVB_FRAME_AUTH, 0, buf, n, &frame);
    assert_int_equal(kvb_msg_auth_decode(f.payload, (size_t)f.payload_len, &d, &e), KVB_OK);
    assert_memory_equal(d.mac, a.mac, KVB_WIRE_MAC_BYTES);
    free(frame);
    check_truncations("AUTH", dec_auth, buf, n);
}

static void test_prefill_roundtrip_and_truncations(void **state) {
    (void)state;
    int32_t tokens[37];
    for (int i = 0; i < 37; i++) tokens[i] = i * 1000 + 3;
    tokens[36] = INT32_MAX;
    kvb_msg_prefill m = {.request_id = 77, .bridge_mode = KVB_BRIDGE_MODE_DECODER, .n_tokens = 37,
                         .cached_tokens = 16, .ship_tokens = 32, .last_cached_key = 0xabcdef0123456789ULL,
                         .tokens = tokens};
    uint8_t buf[512];
    size_t n;
    kvb_err e = {0};
    assert_int_equal(kvb_msg_prefill_encode(&m, buf, sizeof buf, &n, &e), KVB_OK);
    assert_int_equal(n, KVB_PREFILL_FIXED_BYTES + 37 * 4);
    uint8_t *frame;
    kvb_frame f = frame_roundtrip(KVB_FRAME_PREFILL, 77, buf, n, &frame);
    kvb_msg msg;
    assert_int_equal(kvb_msg_decode(&f, &msg, &e), KVB_OK);
    kvb_msg_prefill *d = &msg.u.prefill;
    assert_int_equal(msg.type, KVB_FRAME_PREFILL);
    assert_int_equal(d->request_id, 77);
    assert_int_equal(d->bridge_mode, KVB_BRIDGE_MODE_DECODER);
    assert_int_equal(d->n_tokens, 37);
    assert_int_equal(d->cached_tokens, 16);
    assert_int_equal(d->ship_tokens, 32);
    assert_int_equal(d->last_cached_key, m.last_cached_key);
    assert_memory_equal(d->tokens, tokens, sizeof tokens);
    uint8_t again[512];
    size_t n2;
    assert_int_equal(kvb_msg_prefill_encode(d, again, sizeof again, &n2, &e), KVB_OK);
    assert_int_equal(n2, n);
    assert_memory_equal(again, buf, n);
    {
        kvb_kvformat fmt = test_format(); /* 16 tokens per block */
        assert_int_equal(kvb_msg_prefill_check(d, &fmt, &e), KVB_OK);
        d->ship_tokens = 36; /* 2 blocks and a tail of 4, before the last of 37 tokens */
        assert_int_equal(kvb_msg_prefill_check(d, &fmt, &e), KVB_OK);
        d->ship_tokens = 37; /* a tail that swallows the last prompt token */
        assert_int_equal(kvb_msg_prefill_check(d, &fmt, &e), KVB_ERR_FORMAT);
        assert_true(strstr(e.msg, "ship_tokens 37") != NULL);
        d->cached_tokens = 17;
        d->ship_tokens = 32;
        assert_int_equal(kvb_msg_prefill_check(d, &fmt, &e), KVB_ERR_FORMAT);
        assert_true(strstr(e.msg, "cached_tokens 17") != NULL);
    }
    kvb_msg_free(&msg);
    free(frame);
    check_truncations("PREFILL", dec_prefill, buf, n);

    /* the header's request id must match the payload's */
    uint8_t *frame2;
    kvb_frame f2 = frame_roundtrip(KVB_FRAME_PREFILL, 78, buf, n, &frame2);
    assert_int_equal(kvb_msg_decode(&f2, &msg, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "request id") != NULL);
    free(frame2);

    /* hostile fields */
    uint8_t bad[512];
    kvb_msg_prefill d2;
    memcpy(bad, buf, n);
    bad[12] = bad[13] = bad[14] = bad[15] = 0xff; /* n_tokens 2^32-1: no overflow, just a size mismatch */
    assert_int_equal(kvb_msg_prefill_decode(bad, n, &d2, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "4294967295 tokens") != NULL);
    memcpy(bad, buf, n);
    bad[16] = 33; /* cached 33 > ship 32 */
    assert_int_equal(kvb_msg_prefill_decode(bad, n, &d2, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "cached_tokens") != NULL);
    memcpy(bad, buf, n);
    bad[20] = 38; /* ship 38 > n 37 */
    assert_int_equal(kvb_msg_prefill_decode(bad, n, &d2, &e), KVB_ERR_FORMAT);
    memcpy(bad, buf, n);
    bad[KVB_PREFILL_FIXED_BYTES + 4 * 5 + 3] = 0x80; /* token 5 negative */
    assert_int_equal(kvb_msg_prefill_decode(bad, n, &d2, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "token 5") != NULL);
    memcpy(bad, buf, n);
    bad[8] = 9; /* bridge mode */
    assert_int_equal(kvb_msg_prefill_decode(bad, n, &d2, &e), KVB_ERR_FORMAT);
    memset(bad + 12, 0, 4); /* zero tokens */
    bad[8] = 1;
    assert_int_equal(kvb_msg_prefill_decode(bad, KVB_PREFILL_FIXED_BYTES, &d2, &e), KVB_ERR_FORMAT);
    /* the encoder refuses inconsistent requests */
    m.cached_tokens = 33;
    assert_int_equal(kvb_msg_prefill_encode(&m, buf, sizeof buf, &n, &e), KVB_ERR_INVALID);
    m.cached_tokens = 16;
    tokens[3] = -1;
    assert_int_equal(kvb_msg_prefill_encode(&m, buf, sizeof buf, &n, &e), KVB_ERR_INVALID);
    assert_true(strstr(e.msg, "token 3") != NULL);
}

#if defined(KVB_X86)
uint64_t kvb_xxh3_pieces_avx2(const kvb_bytes *pieces, int n); /* core/hash_avx2.c, hash_avx512.c */
uint64_t kvb_xxh3_pieces_avx512(const kvb_bytes *pieces, int n);
#endif

/* core's XXH3 over pieces (the payload hash and the slab checksum): the library's XXH3-64 of the
 * concatenation, for sizes on both sides of the SIMD kernels' 1 KiB threshold and any split, through
 * the dispatch and through each SIMD kernel the CPU has. */
static void test_xxh3_pieces_match_the_library(void **state) {
    (void)state;
    enum { MAX = 70000 };
    uint8_t *buf = malloc(MAX);
    assert_non_null(buf);
    kvb_rng r;
    kvb_rng_seed(&r, 77);
    for (size_t i = 0; i < MAX; i++) buf[i] = (uint8_t)kvb_rng_u64(&r);
    static const size_t lens[] = {0, 1, 17, 240, 1023, 1024, 1025, 4096, 65536, 65536 + 3, MAX};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        const size_t n = lens[li], a = n / 3, b = n / 2;
        const uint64_t want = XXH3_64bits(buf, n);
        assert_true(kvb_xxh3(buf, n) == want);
        const kvb_bytes two[2] = {{buf, a}, {buf + a, n - a}};
        const kvb_bytes three[3] = {{buf, a}, {buf + a, b - a}, {buf + b, n - b}};
        assert_true(kvb_xxh3_pieces(two, 2) == want);
        assert_true(kvb_xxh3_pieces(three, 3) == want);
#if defined(KVB_X86)
        /* each kernel, not only the one this CPU's dispatch picks */
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2")) assert_true(kvb_xxh3_pieces_avx2(three, 3) == want);
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
            assert_true(kvb_xxh3_pieces_avx512(three, 3) == want);
#endif
    }
    free(buf);
}

static void test_slab_roundtrip_and_truncations(void **state) {
    (void)state;
    uint8_t k[96], v[64];
    for (size_t i = 0; i < sizeof k; i++) k[i] = (uint8_t)(i + 1);
    for (size_t i = 0; i < sizeof v; i++) v[i] = (uint8_t)(200 - i);
    kvb_msg_slab s = {.layer = 3, .pos0 = 48, .n = 16, .k = k, .v = v, .k_bytes = sizeof k, .v_bytes = sizeof v,
                      .checksum = 0x1234};
    uint8_t buf[KVB_SLAB_HEAD_BYTES + sizeof k + sizeof v];
    kvb_msg_slab_encode_head(&s, buf);
    memcpy(buf + KVB_SLAB_HEAD_BYTES, k, sizeof k);
    memcpy(buf + KVB_SLAB_HEAD_BYTES + sizeof k, v, sizeof v);
    /* the three-piece frame (what kvb_conn_send_slab sends) equals the one-piece frame */
    kvb_iov pieces[3] = {{buf, KVB_SLAB_HEAD_BYTES}, {k, sizeof k}, {v, sizeof v}};
    kvb_iov whole = {buf, sizeof buf};
    assert_int_equal(kvb_wire_payload_hash(pieces, 3), kvb_wire_payload_hash(&whole, 1));
    assert_int_equal(kvb_wire_payload_hash(&whole, 1), XXH3_64bits(buf, sizeof buf));
    uint8_t *frame;
    kvb_frame f = frame_roundtrip(KVB_FRAME_SLAB, 5, buf, sizeof buf, &frame);
    kvb_msg msg;
    kvb_err e = {0};
    assert_int_equal(kvb_msg_decode(&f, &msg, &e), KVB_OK);
    kvb_msg_slab *d = &msg.u.slab;
    assert_int_equal(d->layer, 3);
    assert_int_equal(d->pos0, 48);
    assert_int_equal(d->n, 16);
    assert_int_equal(d->k_bytes, sizeof k);
    assert_int_equal(d->v_bytes, sizeof v);
    assert_int_equal(d->checksum, 0x1234);
    assert_memory_equal(d->k, k, sizeof k);
    assert_memory_equal(d->v, v, sizeof v);
    assert_ptr_equal(d->k, f.payload + KVB_SLAB_HEAD_BYTES); /* views, not copies */
    uint8_t head2[KVB_SLAB_HEAD_BYTES];
    kvb_msg_slab_encode_head(d, head2);
    assert_memory_equal(head2, buf, KVB_SLAB_HEAD_BYTES);
    free(frame);
    check_truncations("SLAB", dec_slab, buf, sizeof buf);

    uint8_t bad[sizeof buf];
    kvb_msg_slab d2;
    /* k_bytes = 2^64 - 1, v_bytes = 161: the sum wraps to 160 == the bytes present */
    memcpy(bad, buf, sizeof bad);
    memset(bad + 16, 0xff, 8);
    memset(bad + 24, 0, 8);
    bad[24] = 161;
    assert_int_equal(kvb_msg_slab_decode(bad, sizeof bad, &d2, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "k_bytes") != NULL);
    memcpy(bad, buf, sizeof bad);
    bad[16] = 97; /* k 97 + v 64 = 161 != 160 */
    assert_int_equal(kvb_msg_slab_decode(bad, sizeof bad, &d2, &e), KVB_ERR_FORMAT);
    memcpy(bad, buf, sizeof bad);
    bad[12] = 1; /* reserved */
    assert_int_equal(kvb_msg_slab_decode(bad, sizeof bad, &d2, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "reserved") != NULL);
    memcpy(bad, buf, sizeof bad);
    memset(bad + 8, 0, 4); /* n = 0 */
    assert_int_equal(kvb_msg_slab_decode(bad, sizeof bad, &d2, &e), KVB_ERR_FORMAT);
    memcpy(bad, buf, sizeof bad);
    memset(bad + 4, 0xff, 4); /* pos0 = 2^32-1, n = 16: overflows */
    assert_int_equal(kvb_msg_slab_decode(bad, sizeof bad, &d2, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "overflows") != NULL);
}

static void test_done_roundtrip_and_truncations(void **state) {
    (void)state;
    uint64_t keys[5] = {11, 22, 33, 44, 0xffffffffffffffffULL};
    kvb_msg_done m = {.tokens_covered = 96, .blocks = 5, .slabs = 20, .flags = KVB_DONE_PARTIAL,
                      .chain_digest = kvb_wire_chain_digest(keys, 5), .prefill_seconds = 0.125};
    uint8_t buf[64];
    size_t n;
    kvb_err e = {0};
    assert_int_equal(kvb_msg_done_encode(&m, buf, sizeof buf, &n, &e), KVB_OK);
    assert_int_equal(n, KVB_DONE_BYTES);
    uint8_t *frame;
    kvb_frame f = frame_roundtrip(KVB_FRAME_DONE, 5, buf, n, &frame);
    kvb_msg msg;
    assert_int_equal(kvb_msg_decode(&f, &msg, &e), KVB_OK);
    assert_int_equal(msg.u.done.tokens_covered, 96);
    assert_int_equal(msg.u.done.blocks, 5);
    assert_int_equal(msg.u.done.slabs, 20);
    assert_int_equal(msg.u.done.flags, KVB_DONE_PARTIAL);
    assert_int_equal(msg.u.done.chain_digest, m.chain_digest);
    assert_true(msg.u.done.prefill_seconds == 0.125);
    free(frame);
    check_truncations("DONE", dec_done, buf, n);

    uint8_t bad[KVB_DONE_BYTES];
    kvb_msg_done d;
    memcpy(bad, buf, n);
    bad[12] = 0x80; /* unknown flag */
    assert_int_equal(kvb_msg_done_decode(bad, n, &d, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "flags") != NULL);
    double bad_secs[] = {NAN, INFINITY, -1.0};
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad_secs); i++) {
        memcpy(bad, buf, n);
        uint64_t bits;
        memcpy(&bits, &bad_secs[i], 8);
        for (int b = 0; b < 8; b++) bad[24 + b] = (uint8_t)(bits >> (8 * b));
        assert_int_equal(kvb_msg_done_decode(bad, n, &d, &e), KVB_ERR_FORMAT);
        assert_true(strstr(e.msg, "seconds") != NULL);
        m.prefill_seconds = bad_secs[i];
        assert_int_equal(kvb_msg_done_encode(&m, bad, sizeof bad, &n, &e), KVB_ERR_INVALID);
    }
}

static void test_chain_digest(void **state) {
    (void)state;
    uint64_t keys[130];
    uint8_t le[130 * 8];
    for (int i = 0; i < 130; i++) {
        keys[i] = 0x0101010101010101ULL * (uint64_t)(i + 1) ^ ((uint64_t)i << 56);
        for (int b = 0; b < 8; b++) le[8 * i + b] = (uint8_t)(keys[i] >> (8 * b));
    }
    assert_int_equal(kvb_wire_chain_digest(keys, 130), XXH3_64bits(le, sizeof le));
    assert_int_equal(kvb_wire_chain_digest(keys, 0), XXH3_64bits(le, 0));
    uint64_t swapped[130];
    memcpy(swapped, keys, sizeof keys);
    swapped[7] = keys[8];
    swapped[8] = keys[7];
    assert_int_not_equal(kvb_wire_chain_digest(swapped, 130), kvb_wire_chain_digest(keys, 130));
    assert_int_not_equal(kvb_wire_chain_digest(keys, 129), kvb_wire_chain_digest(keys, 130));
}

static void test_error_roundtrip_and_truncations(void **state) {
    (void)state;
    kvb_msg_error m, d;
    kvb_msg_error_set(&m, KVB_WIRE_ERR_MODEL, "model fingerprint differs\n(tab\there) \xc3\xa9");
    assert_string_equal(m.msg, "model fingerprint differs?(tab?here) \xc3\xa9");
    uint8_t buf[8 + KVB_WIRE_ERROR_MSG_MAX];
    size_t n;
    kvb_err e = {0};
    assert_int_equal(kvb_msg_error_encode(&m, buf, sizeof buf, &n, &e), KVB_OK);
    assert_int_equal(n, 8 + m.msg_len);
    uint8_t *frame;
    kvb_frame f = frame_roundtrip(KVB_FRAME_ERROR, 0, buf, n, &frame);
    kvb_msg msg;
    assert_int_equal(kvb_msg_decode(&f, &msg, &e), KVB_OK);
    assert_int_equal(msg.u.error.code, KVB_WIRE_ERR_MODEL);
    assert_string_equal(msg.u.error.msg, m.msg);
    assert_string_equal(kvb_wire_error_name(msg.u.error.code), "model");
    free(frame);
    check_truncations("ERROR", dec_error, buf, n);

    /* an empty message is valid; its only truncations are the fixed bytes */
    kvb_msg_error_set(&m, 12345, "");
    assert_int_equal(kvb_msg_error_encode(&m, buf, sizeof buf, &n, &e), KVB_OK);
    assert_int_equal(n, 8);
    check_truncations("ERROR (empty)", dec_error, buf, n);
    assert_int_equal(kvb_msg_error_decode(buf, n, &d, &e), KVB_OK);
    assert_string_equal(kvb_wire_error_name(d.code), "unknown");

    /* long messages are truncated to the limit by the setter; the decoder refuses longer lengths */
    char *longmsg = malloc(3000);
    memset(longmsg, 'x', 2999);
    longmsg[2999] = 0;
    kvb_msg_error_set(&m, 1, longmsg);
    free(longmsg);
    assert_int_equal(m.msg_len, KVB_WIRE_ERROR_MSG_MAX);
    assert_int_equal(kvb_msg_error_encode(&m, buf, sizeof buf, &n, &e), KVB_OK);
    assert_int_equal(kvb_msg_error_decode(buf, n, &d, &e), KVB_OK);
    uint8_t bad[16] = {1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff};
    assert_int_equal(kvb_msg_error_decode(bad, sizeof bad, &d, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "exceeds") != NULL);
    uint8_t ctl[10] = {1, 0, 0, 0, 2, 0, 0, 0, 'a', 0};
    assert_int_equal(kvb_msg_error_decode(ctl, sizeof ctl, &d, &e), KVB_ERR_FORMAT);
    assert_true(strstr(e.msg, "control byte") != NULL);
}

static void test_cancel_ping_roundtrip_and_truncations(void **state) {
    (void)state;
    uint8_t buf[16];
    size_t n;
    kvb_err e = {0};
    kvb_msg_cancel c = {0x8877665544332211ULL};
    assert_int_equal(kvb_msg_cancel_encode(&c, buf, sizeof buf, &n, &e), KVB_OK);
    assert_int_equal(n, 8);
    assert_int_equal(buf[0], 0x11);
    uint8_t *frame;
    kvb_frame f = frame_roundtrip(KVB_FRAME_CANCEL, c.request_id, buf, n, &frame);
    kvb_msg msg;
    assert_int_equal(kvb_msg_decode(&f, &msg, &e), KVB_OK);
    assert_int_equal(msg.u.cancel.request_id, c.request_id);
    free(frame);
    f = frame_roundtrip(KVB_FRAME_CANCEL, 1, buf, n, &frame); /* header id differs */
    assert_int_equal(kvb_msg_decode(&f, &msg, &e), KVB_ERR_FORMAT);
    free(frame);
    check_truncations("CANCEL", dec_cancel, buf, n);

    kvb_msg_ping p = {.token = 424242};
    assert_int_equal(kvb_msg_ping_encode(&p, buf, sizeof buf, &n, &e), KVB_OK);
    assert_int_equal(n, 8);
    f = frame_roundtrip(KVB_FRAME_PING, 0, buf, n, &frame);
    assert_int_equal(kvb_msg_decode(&f, &msg, &e), KVB_OK);
    assert_int_equal(msg.type, KVB_FRAME_PING);
    assert_int_equal(msg.u.ping.token, 424242);
    free(frame);
    f = frame_roundtrip(KVB_FRAME_PONG, 0, buf, n, &frame); /* a PONG carries the queue (version 4) */
    assert_int_equal(kvb_msg_decode(&f, &msg, &e), KVB_ERR_FORMAT);
    free(frame);
    check_truncations("PING", dec_ping, buf, n);

    /* PONG: the token and the answering node's queue, waiting never above in flight */
    kvb_msg_ping q = {.token = 7, .in_flight = 3, .waiting = 2};
    assert_int_equal(kvb_msg_pong_encode(&q, buf, sizeof buf, &n, &e), KVB_OK);
    assert_int_equal(n, KVB_PONG_BYTES);
    assert_int_equal(buf[8], 3);
    f = frame_roundtrip(KVB_FRAME_PONG, 0, buf, n, &frame);
    assert_int_equal(kvb_msg_decode(&f, &msg, &e), KVB_OK);
    assert_int_equal(msg.u.ping.token, 7);
    assert_int_equal(msg.u.ping.in_flight, 3);
    assert_int_equal(msg.u.ping.waiting, 2);
    free(frame);
    check_truncations("PONG", dec_pong, buf, n);
    buf[12] = 4; /* 4 waiting of 3 in flight */
    assert_int_equal(kvb_msg_pong_decode(buf, n, &q, &e), KVB_ERR_FORMAT);
    q.waiting = 4;
    assert_int_equal(kvb_msg_pong_encode(&q, buf, sizeof buf, &n, &e), KVB_ERR_INVALID);
    n = 8; /* the frames below reuse a PING payload */

    /* handshake frames are not messages after the handshake */
    f = frame_roundtrip(KVB_FRAME_AUTH, 0, buf, n, &frame);
    assert_int_equal(kvb_msg_decode(&f, &msg, &e), KVB_ERR_FORMAT);
    free(frame);
}

/* LANE: round trip, byte layout, and every out-of-range field refused with a message. */
static void test_lane_roundtrip_and_refusals(void **state) {
    (void)state;
    uint8_t buf[KVB_LANE_BYTES];
    size_t n;
    kvb_err e = {0};
    kvb_msg_lane l = {.group = 0x0102030405060708ULL, .lane = 2, .lanes = 3};
    assert_int_equal(kvb_msg_lane_encode(&l, buf, sizeof buf, &n, &e), KVB_OK);
    assert_int_equal(n, KVB_LANE_BYTES);
    assert_int_equal(buf[0], 0x08);
    assert_int_equal(buf[8], 2);
    assert_int_equal(buf[12], 3);
    uint8_t *frame;
    kvb_frame f = frame_roundtrip(KVB_FRAME_LANE, 0, buf, n, &frame);
    kvb_msg msg;
    assert_int_equal(kvb_msg_decode(&f, &msg, &e), KVB_OK);
    assert_int_equal(msg.u.lane.group, l.group);
    assert_int_equal(msg.u.lane.lane, 2);
    assert_int_equal(msg.u.lane.lanes, 3);
    free(frame);
    check_truncations("LANE", dec_lane, buf, n);
    const kvb_msg_lane bad[] = {{0, 0, 1}, {1, 0, 0}, {1, 0, KVB_WIRE_MAX_LANES + 1}, {1, 3, 3}, {1, 5, 2}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(kvb_msg_lane_encode(&bad[i], buf, sizeof buf, &n, &e), KVB_OK); /* encode is canonical */
        kvb_msg_lane out;
        e.msg[0] = 0;
        assert_int_equal(kvb_msg_lane_decode(buf, n, &out, &e), KVB_ERR_FORMAT);
        assert_non_null(strstr(e.msg, "LANE"));
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_header_roundtrip),
        cmocka_unit_test(test_header_corruption_every_byte),
        cmocka_unit_test(test_payload_corruption_every_byte),
        cmocka_unit_test(test_oversize_refused_from_header),
        cmocka_unit_test(test_hello_roundtrip_and_truncations),
        cmocka_unit_test(test_auth_roundtrip_and_truncations),
        cmocka_unit_test(test_prefill_roundtrip_and_truncations),
        cmocka_unit_test(test_xxh3_pieces_match_the_library),
        cmocka_unit_test(test_slab_roundtrip_and_truncations),
        cmocka_unit_test(test_done_roundtrip_and_truncations),
        cmocka_unit_test(test_chain_digest),
        cmocka_unit_test(test_error_roundtrip_and_truncations),
        cmocka_unit_test(test_cancel_ping_roundtrip_and_truncations),
        cmocka_unit_test(test_lane_roundtrip_and_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
