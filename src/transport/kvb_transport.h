/* transport — the wire protocol between a decode node and a prefill node: fixed little-endian frame
 * headers (magic, protocol version, type, flags, request id, payload length, XXH3-64 of payload and
 * of header); explicit encode/decode for every message (HELLO, AUTH, AUTH_OK, PREFILL, SLAB, DONE,
 * ERROR, CANCEL, PING, PONG) that checks every length, count and offset from the network against
 * the payload size before use; a handshake (HELLO exchange, mutual pre-shared-key proof, checks of
 * protocol version, roles, model fingerprint, cache format and bridge mode) that is the ONLY way to
 * obtain a kvb_conn, so nothing can be received on an unauthenticated or mismatched connection; and
 * a small backend vtable (connect, accept, send one frame as header + up to 3 payload pieces
 * without copying, receive one frame, close) with a TCP backend (poll-based deadlines on connect,
 * send and receive; TCP_NODELAY; large socket buffers; MSG_NOSIGNAL) and a UCX backend (ucx.c,
 * when the build found UCX) carrying the same frames. Any failure on a connection (timeout, malformed or corrupt frame, peer gone) is a clear
 * error and leaves the connection unusable: the caller drops it and computes natively (DESIGN.md
 * contract 7). One thread may send while another receives on a connection; several threads may
 * accept on one listener. Crypto: OpenSSL libcrypto (Debian libssl-dev) for HMAC-SHA256,
 * CRYPTO_memcmp and RAND_bytes — one well-kept library for all three, on every Debian host already,
 * and the one a later TLS option would use. */
#ifndef KVB_TRANSPORT_H
#define KVB_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_kvformat.h"

/* ==== frames ==================================================================================
 *
 * Frame header: KVB_WIRE_HEADER_BYTES = 44 bytes, every integer little-endian, no padding:
 *   offset size field
 *        0    4 magic             "KVB1" (0x4b 0x56 0x42 0x31)
 *        4    2 version u16       KVB_WIRE_VERSION; magic and version keep these offsets in
 *                                 every protocol version, so a peer of another version is told so
 *        6    2 type u16          kvb_frame_type
 *        8    4 flags u32         no flag is defined in version 1: must be 0
 *       12    8 request_id u64    the request a frame belongs to (0: the connection itself)
 *       20    8 payload_len u64   bytes of payload that follow the header
 *       28    8 payload_hash u64  XXH3-64 (seed 0) of the payload bytes (of nothing when empty);
 *                                 for SLAB frames (version 2) of the payload's 40-byte head only:
 *                                 the head carries the slab checksum, XXH3-64 of K || V, which the
 *                                 receiving store verifies before it commits a byte — one pass
 *                                 over the bulk bytes on each side instead of two
 *                                 (kvb_wire_hashed_len)
 *       36    8 header_hash u64   XXH3-64 (seed 0) of header bytes [0, 36)
 * then payload_len bytes of payload (layouts below). The receiver checks, in this order: magic,
 * version, header_hash, type, flags, payload_len <= its limit (before allocating anything), and,
 * once the payload is in, payload_hash. */

#define KVB_WIRE_MAGIC "KVB1"
#define KVB_WIRE_VERSION 4 /* 2: PREFILL may ship a partial last block (the tail); a SLAB's frame hash
                              covers its head, its K || V the slab checksum in that head.
                              3: LANE groups several connections so one request's slabs are
                              striped over all of them. 4: a PONG carries the prefill node's
                              queue (a decode node with several peers places by it) */
#define KVB_WIRE_HEADER_BYTES 44
#define KVB_WIRE_DEFAULT_MAX_PAYLOAD (64ull << 20) /* per frame, after the handshake */
#define KVB_WIRE_MAX_PAYLOAD_LIMIT (1ull << 30)    /* the largest limit a caller may configure */
#define KVB_WIRE_HANDSHAKE_MAX_PAYLOAD 4096        /* frames before authentication are tiny */
#define KVB_WIRE_NONCE_BYTES 32
#define KVB_WIRE_MAC_BYTES 32 /* HMAC-SHA256 */
#define KVB_WIRE_NAME_MAX 64  /* node name bytes in HELLO */
#define KVB_WIRE_ERROR_MSG_MAX 1024
#define KVB_WIRE_PSK_MIN 16 /* pre-shared key bytes */
#define KVB_WIRE_PSK_MAX 1024

typedef enum {
    KVB_FRAME_HELLO = 1,   /* handshake: who I am (kvb_hello) */
    KVB_FRAME_AUTH = 2,    /* handshake: the connecting side's proof of the key */
    KVB_FRAME_AUTH_OK = 3, /* handshake: the accepting side's proof; the connection is now usable */
    KVB_FRAME_PREFILL = 4, /* decode -> prefill: compute and ship a prompt's blocks */
    KVB_FRAME_SLAB = 5,    /* prefill -> decode: one (layer, token range) of encoded K and V */
    KVB_FRAME_DONE = 6,    /* prefill -> decode: a request's slabs are complete (what was shipped) */
    KVB_FRAME_ERROR = 7,   /* either way: code + message (request id 0: about the connection) */
    KVB_FRAME_CANCEL = 8,  /* decode -> prefill: stop a request */
    KVB_FRAME_PING = 9,    /* either way: health probe; the peer answers PONG with the same token */
    KVB_FRAME_PONG = 10,
    KVB_FRAME_LANE = 11,   /* decode -> prefill: this connection is lane i of n of a lane group */
} kvb_frame_type;
#define KVB_FRAME_TYPE_MAX 11

const char *kvb_frame_type_name(uint32_t type); /* "SLAB"; "unknown" for other values */

/* A decoded, validated frame header. */
typedef struct {
    uint16_t version;
    uint16_t type;
    uint32_t flags;
    uint64_t request_id;
    uint64_t payload_len;
    uint64_t payload_hash;
} kvb_frame_header;

/* One piece of a payload to send (the pieces are sent back to back without copying). */
typedef kvb_bytes kvb_iov;

/* A received frame: payload points into the connection's receive buffer and stays valid until the
 * next receive on that connection or its close. The payload hash has been verified. */
typedef struct {
    uint16_t type;
    uint32_t flags;
    uint64_t request_id;
    const uint8_t *payload;
    uint64_t payload_len;
} kvb_frame;

/* XXH3-64 (seed 0) of the concatenation of the pieces (streamed, no copy). */
uint64_t kvb_wire_payload_hash(const kvb_iov *iov, int n_iov);
/* A frame's payload_hash: kvb_wire_payload_hash over the first kvb_wire_hashed_len bytes. */
uint64_t kvb_wire_frame_payload_hash(uint16_t type, const kvb_iov *iov, int n_iov);
/* Fills h->version = KVB_WIRE_VERSION, flags = 0 and writes the 44 header bytes (header hash
 * included). h->type, request_id, payload_len and payload_hash are the caller's. */
void kvb_wire_header_encode(const kvb_frame_header *h, uint8_t out[KVB_WIRE_HEADER_BYTES]);
/* Validates 44 received header bytes (magic, version, header hash, type, flags, payload_len <=
 * max_payload) and decodes them. KVB_ERR_FORMAT (KVB_ERR_MISMATCH for another protocol version,
 * KVB_ERR_CHECKSUM for a header hash that does not match, KVB_ERR_RANGE for an oversize payload)
 * with a message that names the field. */
kvb_status kvb_wire_header_decode(const uint8_t in[KVB_WIRE_HEADER_BYTES], uint64_t max_payload, kvb_frame_header *h,
                                  kvb_err *err);
/* Whole frame in memory (tests, fuzzing, tools): header + payload written to out (cap bytes);
 * *written = KVB_WIRE_HEADER_BYTES + payload length. */
kvb_status kvb_wire_frame_encode(uint16_t type, uint64_t request_id, const kvb_iov *payload, int n_iov, uint8_t *out,
                                 size_t cap, size_t *written, kvb_err *err);
/* Parses exactly one whole frame of n bytes (no trailing bytes) with every receive-side check
 * (a payload hash that does not match: KVB_ERR_CHECKSUM); out->payload points into bytes. */
kvb_status kvb_wire_frame_parse(const uint8_t *bytes, size_t n, uint64_t max_payload, kvb_frame *out, kvb_err *err);

/* ==== messages ================================================================================
 * Each payload has an explicit layout (little-endian, offsets in bytes, no padding) and a decode
 * that accepts exactly that many bytes: a short or long payload, a length that does not add up,
 * a reserved field that is not 0 or a value out of range is KVB_ERR_FORMAT with a message naming
 * the field. Encoders write into a caller buffer (the *_encode functions return KVB_ERR_RANGE when
 * cap is too small and always set *len to the size needed) and are canonical: decode then encode
 * reproduces the payload byte for byte. */

typedef enum { KVB_ROLE_PREFILL = 1, KVB_ROLE_DECODE = 2 } kvb_wire_role;
/* DECODER: the prefill node computes the decoder's own cache (decoder-exact, the decoder's K/V
 * weights and arithmetic). PREFILL: the prefill engine ships its own K/V (only meaningful when both
 * nodes run the same model in the same format). */
typedef enum { KVB_BRIDGE_MODE_DECODER = 1, KVB_BRIDGE_MODE_PREFILL = 2 } kvb_bridge_mode;
const char *kvb_wire_role_name(uint32_t role);          /* "prefill", "decode", "unknown" */
const char *kvb_bridge_mode_name(uint32_t bridge_mode); /* "decoder", "prefill", "unknown" */

/* HELLO, 78 + name_len bytes:
 *    0  2 protocol_version u16 (== the header's version)
 *    2  1 role u8 (kvb_wire_role)
 *    3  1 bridge_mode u8 (kvb_bridge_mode)
 *    4  8 model_fingerprint u64 (the decoder model's kvb_model fingerprint)
 *   12  4 format.version u32       16  4 format.dtype u32        20  4 format.block_tokens u32
 *   24  4 format.n_layer u32       28  4 format.n_head_kv u32    32  4 format.head_dim u32
 *   36  8 format_fingerprint u64 (kvb_kvformat_fingerprint of the sender's format)
 *   44 32 nonce (fresh random bytes per connection)
 *   76  2 name_len u16 (1..KVB_WIRE_NAME_MAX)
 *   78  name_len bytes of node name, printable ASCII (0x20..0x7e), no terminator */
typedef struct {
    uint16_t protocol_version;
    uint8_t role;        /* kvb_wire_role */
    uint8_t bridge_mode; /* kvb_bridge_mode */
    uint64_t model_fingerprint;
    kvb_kvformat format;
    uint64_t format_fingerprint;
    uint8_t nonce[KVB_WIRE_NONCE_BYTES];
    char name[KVB_WIRE_NAME_MAX + 1]; /* NUL-terminated */
} kvb_hello;
#define KVB_HELLO_FIXED_BYTES 78

/* Fills a HELLO for this node (protocol version, format fingerprint computed; nonce zero — the
 * handshake draws a fresh one). name: 1..64 printable ASCII bytes. */
kvb_status kvb_hello_init(kvb_hello *h, kvb_wire_role role, kvb_bridge_mode bridge_mode, const char *name,
                          uint64_t model_fingerprint, const kvb_kvformat *format, kvb_err *err);
kvb_status kvb_msg_hello_encode(const kvb_hello *h, uint8_t *buf, size_t cap, size_t *len, kvb_err *err);
kvb_status kvb_msg_hello_decode(const uint8_t *p, size_t n, kvb_hello *h, kvb_err *err);

/* AUTH and AUTH_OK, 32 bytes: HMAC-SHA256(psk, transcript) where transcript =
 *   "kvbridge-auth-v1" (16 bytes) || direction (1 byte: 'C' in AUTH, from the connecting side;
 *   'S' in AUTH_OK, from the accepting side) || client nonce (32) || server nonce (32) ||
 *   client HELLO payload length u64 || client HELLO payload || server HELLO payload length u64 ||
 *   server HELLO payload.
 * The direction byte (not in the first sketch) stops reflection: without it the two proofs would
 * be equal and a peer without the key could echo the accepting side's proof back. The length
 * prefixes make the split between the two HELLOs unambiguous. Proofs are compared in constant
 * time (CRYPTO_memcmp). */
typedef struct {
    uint8_t mac[KVB_WIRE_MAC_BYTES];
} kvb_msg_auth;
kvb_status kvb_msg_auth_encode(const kvb_msg_auth *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err);
kvb_status kvb_msg_auth_decode(const uint8_t *p, size_t n, kvb_msg_auth *m, kvb_err *err);

/* PREFILL, 32 + 4 * n_tokens bytes (decode -> prefill):
 *    0 8 request_id u64 (== the header's request id)
 *    8 4 bridge_mode u32 (kvb_bridge_mode)
 *   12 4 n_tokens u32 (>= 1)
 *   16 4 cached_tokens u32: the prefix the decoder already holds (a multiple of block_tokens)
 *   20 4 ship_tokens u32: ship positions [cached_tokens, ship_tokens): whole blocks, and when
 *        ship_tokens is not a multiple of block_tokens, the partial block after them too (the
 *        tail, which then ends before the last prompt token: ship_tokens < n_tokens)
 *   24 8 last_cached_key u64: chain key of block cached_tokens/block_tokens - 1, or
 *        kvb_chain_root(model, format) when cached_tokens == 0 (the parent of the first shipped
 *        block either way)
 *   32 4*n_tokens token ids, i32 each, >= 0
 * Decode checks cached_tokens <= ship_tokens <= n_tokens; kvb_msg_prefill_check adds the
 * block-size rules that need the format. */
typedef struct {
    uint64_t request_id;
    uint32_t bridge_mode;
    uint32_t n_tokens;
    uint32_t cached_tokens;
    uint32_t ship_tokens;
    uint64_t last_cached_key;
    int32_t *tokens; /* encode: the caller's; decode: allocated, free with kvb_msg_prefill_free */
} kvb_msg_prefill;
#define KVB_PREFILL_FIXED_BYTES 32
kvb_status kvb_msg_prefill_encode(const kvb_msg_prefill *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err);
kvb_status kvb_msg_prefill_decode(const uint8_t *p, size_t n, kvb_msg_prefill *m, kvb_err *err);
void kvb_msg_prefill_free(kvb_msg_prefill *m);
/* cached_tokens a multiple of fmt->block_tokens; ship_tokens one too, or < n_tokens (a tail). */
kvb_status kvb_msg_prefill_check(const kvb_msg_prefill *m, const kvb_kvformat *fmt, kvb_err *err);

/* SLAB, 40 + k_bytes + v_bytes (prefill -> decode), the shape of the bridge's kvb_slab:
 *    0 4 layer u32        4 4 pos0 u32        8 4 n u32 (>= 1; pos0 + n <= 2^32 - 1)
 *   12 4 reserved u32 (0)
 *   16 8 k_bytes u64     24 8 v_bytes u64
 *   32 8 checksum u64: kvb_slab_checksum (XXH3-64 of K || V), produced by the bridge and verified
 *        by the store before a byte is copied (the transport does not recompute it: the payload
 *        hash already covers transit)
 *   40 k_bytes of K, then v_bytes of V; k_bytes + v_bytes == payload length - 40. */
typedef struct {
    uint32_t layer, pos0, n;
    const uint8_t *k, *v; /* decode: views into the payload */
    uint64_t k_bytes, v_bytes;
    uint64_t checksum;
} kvb_msg_slab;
#define KVB_SLAB_HEAD_BYTES 40
/* How many leading payload bytes a frame's payload_hash covers: all of them, except for SLAB
 * frames, whose hash covers the head (K || V are covered by the slab checksum in it). A consumer
 * of SLAB frames must verify that checksum (the store's slab assembler does) before using K or V. */
uint64_t kvb_wire_hashed_len(uint16_t type, uint64_t payload_len);
/* Writes the 40-byte head only (K and V follow as separate pieces, see kvb_conn_send_slab). */
void kvb_msg_slab_encode_head(const kvb_msg_slab *m, uint8_t out[KVB_SLAB_HEAD_BYTES]);
kvb_status kvb_msg_slab_decode(const uint8_t *p, size_t n, kvb_msg_slab *m, kvb_err *err);

/* DONE, 32 bytes (prefill -> decode; the header's request id says which request):
 *    0 4 tokens_covered u32: positions [PREFILL.cached_tokens, tokens_covered) were shipped
 *    4 4 blocks u32: full blocks shipped
 *    8 4 slabs u32: SLAB frames sent for the request (the receiver counts them)
 *   12 4 flags u32 (KVB_DONE_* bits; others must be 0)
 *   16 8 chain_digest u64: kvb_wire_chain_digest of the shipped blocks' chain keys, in order
 *   24 8 prefill_seconds f64 (IEEE-754 binary64 bits; finite and >= 0) */
#define KVB_DONE_PARTIAL 1u   /* fewer tokens shipped than PREFILL asked for (see ERROR/log) */
#define KVB_DONE_CANCELLED 2u /* stopped by CANCEL */
#define KVB_DONE_FLAGS_KNOWN (KVB_DONE_PARTIAL | KVB_DONE_CANCELLED)
typedef struct {
    uint32_t tokens_covered;
    uint32_t blocks;
    uint32_t slabs;
    uint32_t flags;
    uint64_t chain_digest;
    double prefill_seconds;
} kvb_msg_done;
#define KVB_DONE_BYTES 32
kvb_status kvb_msg_done_encode(const kvb_msg_done *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err);
kvb_status kvb_msg_done_decode(const uint8_t *p, size_t n, kvb_msg_done *m, kvb_err *err);
/* XXH3-64 (seed 0) over the keys, each written as u64 little-endian, in chain order. */
uint64_t kvb_wire_chain_digest(const uint64_t *keys, uint32_t n_keys);

/* ERROR, 8 + msg_len bytes:
 *    0 4 code u32 (kvb_wire_error_code; unknown codes are kept, not rejected)
 *    4 4 msg_len u32 (0..KVB_WIRE_ERROR_MSG_MAX)
 *    8 msg_len bytes of message: no byte below 0x20 and no 0x7f (UTF-8 above 0x7f is kept).
 * The encoder truncates a longer message and replaces control bytes with '?'. */
typedef enum {
    KVB_WIRE_ERR_PROTOCOL = 1,     /* malformed or unexpected frame */
    KVB_WIRE_ERR_VERSION = 2,      /* protocol version mismatch */
    KVB_WIRE_ERR_AUTH = 3,         /* the pre-shared-key proof failed */
    KVB_WIRE_ERR_ROLE = 4,         /* both nodes have the same role */
    KVB_WIRE_ERR_MODEL = 5,        /* model fingerprint differs */
    KVB_WIRE_ERR_FORMAT = 6,       /* cache format differs */
    KVB_WIRE_ERR_MODE = 7,         /* bridge mode differs / not supported */
    KVB_WIRE_ERR_INCOMPATIBLE = 8, /* a caller-supplied compatibility check refused */
    KVB_WIRE_ERR_REQUEST = 9,      /* a request could not be served (bad PREFILL, busy, failure) */
    KVB_WIRE_ERR_CANCELLED = 10,
    KVB_WIRE_ERR_INTERNAL = 11,
    KVB_WIRE_ERR_BUSY = 12,        /* a PREFILL refused at once: the prefill node's queue is full (the
                                      message says which bound and the queue's length); go elsewhere */
} kvb_wire_error_code;
const char *kvb_wire_error_name(uint32_t code); /* "auth", ...; "unknown" */
typedef struct {
    uint32_t code;
    uint32_t msg_len;
    char msg[KVB_WIRE_ERROR_MSG_MAX + 1]; /* NUL-terminated */
} kvb_msg_error;
kvb_status kvb_msg_error_encode(const kvb_msg_error *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err);
kvb_status kvb_msg_error_decode(const uint8_t *p, size_t n, kvb_msg_error *m, kvb_err *err);
/* Fills m from a code and a C string (truncated, control bytes replaced). */
void kvb_msg_error_set(kvb_msg_error *m, uint32_t code, const char *msg);

/* CANCEL, 8 bytes: 0 8 request_id u64 (== the header's request id). */
typedef struct {
    uint64_t request_id;
} kvb_msg_cancel;
kvb_status kvb_msg_cancel_encode(const kvb_msg_cancel *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err);
kvb_status kvb_msg_cancel_decode(const uint8_t *p, size_t n, kvb_msg_cancel *m, kvb_err *err);

/* PING, 8 bytes: 0 8 token u64. PONG (version 4), 16 bytes: 0 8 token u64 (the PING's, echoed),
 * 8 4 in_flight u32 (PREFILLs the answering node accepted and has not answered yet, from every
 * decode node: computing or waiting for its engine), 12 4 waiting u32 (of those, waiting; <=
 * in_flight). A decode node pings its idle lanes (the heartbeat) and reads the queue from the
 * answer; the node that answers a PING it was sent by a peer that is not a decode node says 0, 0. */
typedef struct {
    uint64_t token;
    uint32_t in_flight, waiting; /* PONG only */
} kvb_msg_ping;
#define KVB_PONG_BYTES 16
kvb_status kvb_msg_ping_encode(const kvb_msg_ping *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err);
kvb_status kvb_msg_ping_decode(const uint8_t *p, size_t n, kvb_msg_ping *m, kvb_err *err);
kvb_status kvb_msg_pong_encode(const kvb_msg_ping *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err);
kvb_status kvb_msg_pong_decode(const uint8_t *p, size_t n, kvb_msg_ping *m, kvb_err *err);

/* LANE, 16 bytes (decode -> prefill, request id 0; sent once, right after the handshake, on each
 * connection of a lane group):
 *    0 8 group u64: a random token the decode node draws for the group (never 0)
 *    8 4 lane u32: this connection's index, < lanes
 *   12 4 lanes u32: connections in the group, 1..KVB_WIRE_MAX_LANES
 * A PREFILL that arrives on lane 0 of a complete group is answered over every lane: its SLABs
 * striped across them in any order, and its final frame (DONE or ERROR) sent on each lane, a
 * DONE's `slabs` counting the SLABs of that lane only. A connection that sent no LANE is a group of
 * one (protocol version 2's behaviour). */
#define KVB_WIRE_MAX_LANES 16
typedef struct {
    uint64_t group;
    uint32_t lane, lanes;
} kvb_msg_lane;
#define KVB_LANE_BYTES 16
kvb_status kvb_msg_lane_encode(const kvb_msg_lane *m, uint8_t *buf, size_t cap, size_t *len, kvb_err *err);
kvb_status kvb_msg_lane_decode(const uint8_t *p, size_t n, kvb_msg_lane *m, kvb_err *err);

/* ==== backends ================================================================================
 * A backend moves whole frames. The framing layer (this header) builds and checks headers and
 * payload hashes; a backend only transports bytes, honouring an absolute deadline (kvb_now_s()
 * seconds) on every call, and reports a stalled peer as KVB_ERR_TIMEOUT, a closed, reset or
 * refused connection as KVB_ERR_PEER_GONE (other socket errors: KVB_ERR_IO). Backends embed
 * kvb_link / kvb_link_listener as their first member.
 *
 * TCP (kvb_wire_backend_tcp): send_frame is one sendmsg of header + pieces (partial writes
 * continued), receive reads the header, validates it (rejecting an oversize length before the
 * buffer grows), then reads the payload into the connection's buffer.
 *
 * UCX (kvb_wire_backend_ucx, ucx.c): connects with a socket address (UCX's connection manager),
 * runs the same handshake over the ucp stream API, then (the `authenticated` hook) moves frames
 * onto an endpoint made from the peer's worker address so UCX may pick shared memory or RDMA. Each
 * side then registers a receive ring once (8 MiB) and advertises its address and rkey: a payload
 * of 64 KiB up to a quarter of the ring is put one-sided into the peer's ring (unless every lane
 * is TCP, where UCX only emulates puts), and its 44-byte frame
 * header, sent on the stream after the put has landed, is the signal (both sides place payloads
 * in the ring the same way); the receiver borrows it (a kvb_wire_loan: the frame's hashes and the
 * slab checksum are checked on the view, as over TCP) or copies it out, and credits (small tagged
 * messages) give the room back once it is returned. Larger payloads follow their header as tagged
 * messages (UCX's rendezvous). The lanes it picked are logged and reported (kvb_conn_describe,
 * kvb_ucx_last_lanes). */

typedef struct kvb_wire_backend kvb_wire_backend;
typedef struct kvb_link {
    const kvb_wire_backend *backend;
    char peer_addr[96]; /* "HOST:PORT" of the other end, for messages */
} kvb_link;
typedef struct kvb_link_listener {
    const kvb_wire_backend *backend;
    uint16_t port; /* the bound port (the ephemeral one when the address said :0) */
} kvb_link_listener;

/* A growable receive buffer owned by a connection. */
typedef struct {
    uint8_t *data;
    size_t cap;
} kvb_wire_buf;
/* Grows buf to at least n bytes (contents not kept). */
kvb_status kvb_wire_buf_reserve(kvb_wire_buf *buf, size_t n, kvb_err *err);

/* A received payload the backend lends instead of copying it into a buffer (UCX: a view into the
 * receive ring the peer put it into). The view stays valid, and its room in the ring is withheld
 * from the sender, until the loan is returned; it outlives a failed, shut or closed connection
 * (the ring is freed with the last loan back), so a dead peer or a timeout never leaves it
 * dangling. Return each loan exactly once (kvb_wire_loan_return; an empty loan is fine), as its
 * message is consumed: the sender cannot put past a loan still out once its ring comes round to
 * it, so a receiver that keeps a loan while it waits for later frames of the connection stalls
 * the sender (which times out). */
typedef struct kvb_wire_loan {
    const uint8_t *data; /* the lent payload; NULL: nothing lent (the payload is in the buffer) */
    void (*give_back)(void *owner, uint64_t id);
    void *owner;
    uint64_t id;
} kvb_wire_loan;
/* Gives a loan's room back (the backend may then tell the sender) and empties it. */
void kvb_wire_loan_return(kvb_wire_loan *loan);

struct kvb_wire_backend {
    const char *name;
    /* addr "HOST:PORT" ("[v6]:PORT"; HOST empty or "*" = every interface; PORT 0 = ephemeral). */
    kvb_status (*listen)(const char *addr, kvb_link_listener **out, kvb_err *err);
    kvb_status (*accept)(kvb_link_listener *l, double deadline, kvb_link **out, kvb_err *err);
    void (*listener_close)(kvb_link_listener *l);
    kvb_status (*connect)(const char *addr, double deadline, kvb_link **out, kvb_err *err);
    /* Sends header + the pieces (n_iov <= 3) as one frame. */
    kvb_status (*send_frame)(kvb_link *link, const uint8_t header[KVB_WIRE_HEADER_BYTES], const kvb_iov *iov,
                             int n_iov, double deadline, kvb_err *err);
    /* Receives one frame: header validated against max_payload (kvb_wire_header_decode), payload
     * into buf (payload hash NOT yet checked: the caller does). loan (NULL: always copy; else
     * empty on entry): the backend may lend the payload instead (sets *loan, leaves buf alone). */
    kvb_status (*recv_frame)(kvb_link *link, uint64_t max_payload, kvb_frame_header *hdr, kvb_wire_buf *buf,
                             kvb_wire_loan *loan, double deadline, kvb_err *err);
    /* Stops both directions now (wakes a thread blocked in send or receive); close still needed. */
    void (*shutdown)(kvb_link *link);
    void (*close)(kvb_link *link);
    /* What carries the link, for logs, /metrics and doctor ("ucx posix/memory cma/memory");
     * NULL: the backend's name says it all. */
    void (*describe)(kvb_link *link, char *buf, size_t cap);
    /* Called on both sides once the handshake passed (the peer proved the key), before the
     * connection is handed out: a backend may move the link onto a faster path with what only a
     * trusted peer may send (UCX: worker addresses). NULL: nothing to do. */
    kvb_status (*authenticated)(kvb_link *link, double deadline, kvb_err *err);
};

extern const kvb_wire_backend kvb_wire_backend_tcp;
#ifdef KVB_HAVE_UCX
/* UCX (ucp stream API): shared memory, TCP or RDMA as UCX selects at run time (UCX_TLS). */
extern const kvb_wire_backend kvb_wire_backend_ucx;
#endif
/* "tcp" or "ucx" (NULL or "" = tcp) to its backend; a build without UCX refuses "ucx" with
 * KVB_ERR_UNSUPPORTED and a message saying why; another name is KVB_ERR_INVALID. */
kvb_status kvb_wire_backend_by_name(const char *name, const kvb_wire_backend **out, kvb_err *err);
/* Whether this build carries the UCX backend. */
bool kvb_wire_have_ucx(void);
/* The transports (lanes) UCX selected for the most recent connection made or accepted in this
 * process ("posix/memory cma/memory", "tcp/lo"), "none yet", or "not built" without UCX. */
void kvb_ucx_last_lanes(char *buf, size_t cap);
/* UCX's own put bandwidth, the ceiling of the slab path (bench link): `bytes` put in pieces of
 * `piece` bytes from data into the receive ring the peer advertised (wrapping; nothing signalled,
 * nothing checked), then flushed; the peer only has to be receiving. KVB_ERR_UNSUPPORTED for a
 * connection not over UCX, a build without it, or a peer whose ring is smaller than a piece. */
struct kvb_conn;
kvb_status kvb_conn_ucx_raw_put(struct kvb_conn *c, const uint8_t *data, size_t piece, uint64_t bytes, int timeout_ms,
                                kvb_err *err);

/* ==== connections ============================================================================
 * Failures are typed, so a caller decides on the code, never on the message:
 *   KVB_ERR_TIMEOUT    a deadline passed (the peer stalled, or said nothing in time)
 *   KVB_ERR_PEER_GONE  the peer closed or reset the connection, or none could be made
 *   KVB_ERR_CHECKSUM   a frame's header or payload hash does not match its bytes
 *   KVB_ERR_AUTH       the key proof failed, either way (or the peer refused ours: [auth])
 *   KVB_ERR_MISMATCH   protocol version, roles, model or cache-format fingerprint, bridge mode
 *                      disagree (found here, or the peer's refusal said so)
 *   KVB_ERR_REFUSED    the peer answered the handshake with an ERROR of another kind (busy, ...)
 *   KVB_ERR_CANCELLED  this node shut the connection down (kvb_conn_shutdown) while a call waited
 *   KVB_ERR_FORMAT / KVB_ERR_RANGE  a malformed, unexpected or oversize frame
 * A call on a connection that already failed fails fast with the first failure's code. */

typedef struct kvb_conn kvb_conn;
typedef struct kvb_listener kvb_listener;

/* A compatibility check run by both sides after the key proofs verified and after the built-in
 * checks (protocol version, complementary roles). Returns true to accept; on refusal fills *code
 * (kvb_wire_error_code) and why (a message naming what differs). NULL: kvb_hello_check_default. */
typedef bool (*kvb_hello_check_fn)(void *ctx, const kvb_hello *mine, const kvb_hello *peer, uint32_t *code,
                                   char *why, size_t why_cap);
/* Model fingerprint, every cache-format field plus the format fingerprint, and bridge mode must be
 * equal; the message names each differing field with both values. */
bool kvb_hello_check_default(void *ctx, const kvb_hello *mine, const kvb_hello *peer, uint32_t *code, char *why,
                             size_t why_cap);

typedef struct {
    const uint8_t *psk; /* the pre-shared key, KVB_WIRE_PSK_MIN..KVB_WIRE_PSK_MAX bytes */
    size_t psk_len;
    kvb_hello_check_fn check; /* NULL: kvb_hello_check_default */
    void *check_ctx;
    uint64_t max_payload;             /* per received frame after the handshake; 0: default */
    const kvb_wire_backend *backend;  /* NULL: TCP */
} kvb_transport_config;

/* Listens on addr ("HOST:PORT", port 0 = ephemeral). */
kvb_status kvb_transport_listen(const char *addr, const kvb_wire_backend *backend, kvb_listener **out, kvb_err *err);
uint16_t kvb_listener_port(const kvb_listener *l);
void kvb_listener_close(kvb_listener *l);

/* Why a handshake failed, as counted on both sides (/metrics: by reason). */
typedef enum {
    KVB_HANDSHAKE_AUTH = 0, /* KVB_ERR_AUTH: a wrong key, either way */
    KVB_HANDSHAKE_MISMATCH, /* KVB_ERR_MISMATCH: version, role, model, cache format, bridge mode */
    KVB_HANDSHAKE_TIMEOUT,  /* KVB_ERR_TIMEOUT: the peer connected and then said nothing in time */
    KVB_HANDSHAKE_PROTOCOL, /* KVB_ERR_FORMAT, _RANGE, _CHECKSUM: garbage, not a kvbridge peer */
    KVB_HANDSHAKE_REFUSED,  /* KVB_ERR_REFUSED: the peer answered with an ERROR of another kind */
    KVB_HANDSHAKE_GONE,     /* KVB_ERR_PEER_GONE: closed, reset, or no connection could be made */
    KVB_HANDSHAKE_OTHER,    /* anything else (out of memory, a socket error) */
    KVB_HANDSHAKE_REASONS
} kvb_handshake_reason;
kvb_handshake_reason kvb_handshake_reason_of(kvb_status st);
/* "auth", "mismatch", "timeout", "protocol", "refused", "gone", "other": a metric label */
const char *kvb_handshake_reason_name(kvb_handshake_reason r);

/* What a listener's accepts came to, since it opened: handshakes completed, and those that
 * failed once a connection had arrived, by reason (a wait in which nobody connected is neither). */
typedef struct {
    uint64_t accepted;
    uint64_t failed[KVB_HANDSHAKE_REASONS];
} kvb_listener_stats;
void kvb_listener_get_stats(const kvb_listener *l, kvb_listener_stats *out);

/* Connects to addr and runs the handshake as the connecting side: sends HELLO (mine, with a fresh
 * nonce), receives the peer's HELLO, sends AUTH, receives AUTH_OK and verifies the peer's proof,
 * then checks compatibility. Only when all of that passed is *out set (and *peer_hello, when not
 * NULL). A failure sends the peer an ERROR frame with the reason (where the peer is owed one),
 * closes the connection and returns an error that names the peer and what failed; a refusal by
 * the peer returns its ERROR message. timeout_ms (>= 1) bounds the whole call. */
kvb_status kvb_transport_connect(const char *addr, const kvb_hello *mine, const kvb_transport_config *cfg,
                                 int timeout_ms, kvb_conn **out, kvb_hello *peer_hello, kvb_err *err);
/* Waits for one connection on the listener and runs the handshake as the accepting side (counted
 * in the listener's stats): receives
 * HELLO, sends HELLO, receives AUTH and verifies it, checks compatibility, sends AUTH_OK with its
 * own proof. Anything else (a PREFILL or SLAB before authentication, a wrong key, a mismatch) is
 * answered with ERROR and the connection is closed; no frame of it is ever delivered.
 * timeout_ms (>= 1) bounds the wait for a connection (KVB_ERR_TIMEOUT, nothing counted), and then
 * the handshake on its own (a peer that connects late in the wait is not cut short). */
kvb_status kvb_transport_accept(kvb_listener *l, const kvb_hello *mine, const kvb_transport_config *cfg,
                                int timeout_ms, kvb_conn **out, kvb_hello *peer_hello, kvb_err *err);

/* A received, decoded message. */
typedef struct {
    uint16_t type; /* kvb_frame_type */
    uint64_t request_id;
    union {
        kvb_msg_prefill prefill; /* tokens allocated: kvb_msg_free */
        kvb_msg_slab slab;       /* k, v point into the connection's receive buffer (valid until the
                                    next receive on the connection or its close) */
        kvb_msg_done done;
        kvb_msg_error error;
        kvb_msg_cancel cancel;
        kvb_msg_ping ping; /* PING and PONG */
        kvb_msg_lane lane;
    } u;
} kvb_msg;
void kvb_msg_free(kvb_msg *m); /* frees what a received PREFILL allocated; other types: nothing */
/* Decodes a parsed frame of type PREFILL, SLAB, DONE, ERROR, CANCEL, PING, PONG or LANE (handshake types
 * are KVB_ERR_FORMAT here); a PREFILL's or CANCEL's payload request id must equal the header's. */
kvb_status kvb_msg_decode(const kvb_frame *f, kvb_msg *out, kvb_err *err);

/* Receives and decodes the next message (frame checks, payload hash, then the message decode).
 * Only what this node's role may receive is accepted: a decode node receives SLAB, DONE, ERROR,
 * PING, PONG; a prefill node PREFILL, CANCEL, ERROR, PING, PONG, LANE; a PREFILL's or CANCEL's request
 * id must equal the header's. An ERROR frame from the peer is returned as a message (type
 * KVB_FRAME_ERROR), not as a failure. timeout_ms >= 1 bounds the call. Any failure (timeout, peer
 * gone, corrupt or malformed frame, unexpected type) leaves the connection unusable. */
kvb_status kvb_conn_recv(kvb_conn *c, int timeout_ms, kvb_msg *out, kvb_err *err);
/* As kvb_conn_recv, but the payload lands in the caller's buffer (grown as needed) instead of the
 * connection's own, so a SLAB's K and V views stay valid until the caller reuses buf: a receiving
 * thread can rotate several buffers while another thread verifies and commits what arrived. One
 * receiving thread per connection; one other thread may send meanwhile (the directions share
 * nothing but the broken flag). */
kvb_status kvb_conn_recv_into(kvb_conn *c, int timeout_ms, kvb_wire_buf *buf, kvb_msg *out, kvb_err *err);
/* As kvb_conn_recv_into, but where the backend can (UCX, a payload that came through its receive
 * ring) the payload is lent rather than copied into buf: *loan is then set and the message's
 * views (a SLAB's K and V) point into the ring until kvb_wire_loan_return, which the caller
 * must call (also after a failed slab check, and it may after the connection closed); the
 * backend holds back the ring's room, so nothing overwrites a view while it is lent. Otherwise
 * (TCP, small frames) *loan is empty and the views point into buf. On failure *loan is empty. */
kvb_status kvb_conn_recv_lend(kvb_conn *c, int timeout_ms, kvb_wire_buf *buf, kvb_wire_loan *loan, kvb_msg *out,
                              kvb_err *err);

/* Typed senders (timeout_ms >= 1 bounds the call; a peer that stops reading makes it time out).
 * Each refuses a frame this node's role may not send (decode: PREFILL, CANCEL, ERROR, PING, PONG, LANE;
 * prefill: SLAB, DONE, ERROR, PING, PONG). */
kvb_status kvb_conn_send_prefill(kvb_conn *c, const kvb_msg_prefill *m, int timeout_ms, kvb_err *err);
/* Header + 40-byte head + K + V, K and V sent from the caller's memory without a copy. */
kvb_status kvb_conn_send_slab(kvb_conn *c, uint64_t request_id, const kvb_msg_slab *m, int timeout_ms, kvb_err *err);
kvb_status kvb_conn_send_done(kvb_conn *c, uint64_t request_id, const kvb_msg_done *m, int timeout_ms, kvb_err *err);
kvb_status kvb_conn_send_error(kvb_conn *c, uint64_t request_id, uint32_t code, const char *msg, int timeout_ms,
                               kvb_err *err);
kvb_status kvb_conn_send_cancel(kvb_conn *c, uint64_t request_id, int timeout_ms, kvb_err *err);
kvb_status kvb_conn_send_ping(kvb_conn *c, uint64_t token, int timeout_ms, kvb_err *err);
kvb_status kvb_conn_send_pong(kvb_conn *c, uint64_t token, int timeout_ms, kvb_err *err); /* queue 0, 0 */
/* A PONG that reports this node's queue (kvb_msg_ping's in_flight and waiting). */
kvb_status kvb_conn_send_pong_load(kvb_conn *c, const kvb_msg_ping *m, int timeout_ms, kvb_err *err);
kvb_status kvb_conn_send_lane(kvb_conn *c, const kvb_msg_lane *m, int timeout_ms, kvb_err *err);

/* Counters (for /metrics), all since the TCP connection opened, handshake included. */
typedef struct {
    uint64_t bytes_sent, frames_sent;
    uint64_t bytes_received, frames_received;
    uint64_t checksum_failures; /* header or payload hash mismatches */
    uint64_t protocol_errors;   /* malformed frames, unexpected types, bad handshakes */
    uint64_t timeouts;
} kvb_conn_stats;
void kvb_conn_get_stats(const kvb_conn *c, kvb_conn_stats *out);
const kvb_hello *kvb_conn_peer_hello(const kvb_conn *c);
const char *kvb_conn_peer_addr(const kvb_conn *c);
/* What carries the connection: "tcp", or "ucx" and the lanes UCX selected. */
void kvb_conn_describe(const kvb_conn *c, char *buf, size_t cap);
/* false once any call failed (the connection must be dropped). */
bool kvb_conn_usable(const kvb_conn *c);
/* Stops both directions (another thread blocked in send/recv returns an error); close still needed. */
void kvb_conn_shutdown(kvb_conn *c);
void kvb_conn_close(kvb_conn *c); /* NULL is fine */

/* ==== a peer link: one peer's lanes, connected and kept up off the request path ================
 * A decode node's connections to its prefill node: n lanes (grouped with LANE frames when n > 1),
 * dialled and handshaken by the link's own thread, never by a request. A request asks for the
 * lanes and gets them at once or is told at once why not (connecting, down with the reason and
 * when the next attempt is); a link that failed is dialled again with exponential back-off, not
 * on every request. One owner uses the lanes at a time (the decode node's prompt FIFO): from
 * kvb_peer_link_lanes until kvb_peer_link_drop or the next kvb_peer_link_lanes. */
typedef struct kvb_peer_link kvb_peer_link;

typedef enum { KVB_PEER_CONNECTING = 0, KVB_PEER_UP, KVB_PEER_DOWN } kvb_peer_state;
const char *kvb_peer_state_name(kvb_peer_state s); /* "connecting", "up", "down" */

typedef struct {
    const char *addr;                 /* "HOST:PORT" */
    const kvb_hello *hello;           /* this node's HELLO (copied) */
    const kvb_transport_config *tcfg; /* copied, its psk too */
    uint32_t lanes;                   /* 1..KVB_WIRE_MAX_LANES */
    int connect_timeout_ms;           /* one whole connect + handshake + grouping; 0: 5000 */
    double backoff_min_s, backoff_max_s; /* after a failure; 0: 0.5 and 30 */
    /* called with the link's lock held (it must not call the link): from the link's thread as
     * each attempt starts (connecting) and ends (up, or down), and from the owner's when it drops
     * the lanes (connecting); NULL: none. For a gauge and a counter by reason: code is KVB_OK
     * when up or connecting, else the failure (kvb_handshake_reason_of gives the reason). */
    void (*on_state)(void *ctx, kvb_peer_state state, kvb_status code, const char *why);
    void *on_state_ctx;
    /* ping the lanes after this long idle (no owner holds them); a missing PONG (within
     * KVB_HEARTBEAT_TIMEOUT_MS) makes the link dial again; 0: no heartbeat */
    int heartbeat_ms;
} kvb_peer_link_config;
#define KVB_HEARTBEAT_TIMEOUT_MS 2000

/* Starts the link's thread, which dials at once (a copy of everything in cfg is kept, the key
 * included). */
kvb_status kvb_peer_link_start(const kvb_peer_link_config *cfg, kvb_peer_link **out, kvb_err *err);
/* Stops the thread (an attempt under way is cut short) and closes the lanes. NULL is fine. */
void kvb_peer_link_stop(kvb_peer_link *l);
/* Never blocks (but for a heartbeat on the lanes, see kvb_peer_link_release): KVB_OK with the
 * lanes (*n of them), lent to the caller, when the link is up and every lane usable; else
 * KVB_ERR_PEER_GONE while connecting, or the last attempt's code while down (KVB_ERR_AUTH,
 * _MISMATCH, _TIMEOUT, _REFUSED, _PEER_GONE, ...), with a short message in whole words that fits
 * a verdict ("connecting (an attempt is under way)", "down (the pre-shared keys differ), next
 * attempt in 1.5 s"); kvb_peer_link_state has the whole story. A lane found unusable drops the
 * link (the thread dials again). */
kvb_status kvb_peer_link_lanes(kvb_peer_link *l, kvb_conn *const **lanes, uint32_t *n, kvb_err *err);
/* The lanes can no longer be trusted (a fault mid-stream): closed now; the thread dials again
 * without waiting out a back-off (the link was up). */
void kvb_peer_link_drop(kvb_peer_link *l, const kvb_err *why);
/* The owner is done with the lanes it got (they stay up): the heartbeat may use them again. A
 * kvb_peer_link_lanes that finds a heartbeat on them waits for it (at most
 * KVB_HEARTBEAT_TIMEOUT_MS, on a peer that stopped answering). */
void kvb_peer_link_release(kvb_peer_link *l);
/* The peer's queue as its last PONG reported it (grouping the lanes, or a heartbeat since the link
 * came up): PREFILLs in flight and, of those, waiting for its engine. False (0, 0) when unknown or
 * not up. */
bool kvb_peer_link_load(kvb_peer_link *l, uint32_t *in_flight, uint32_t *waiting);
/* Waits up to timeout_ms while the link is connecting (at start, or a resume after a dropped lane),
 * then answers as kvb_peer_link_lanes: at once when it is up or down (a down link is not waited
 * through its back-off). */
kvb_status kvb_peer_link_wait_lanes(kvb_peer_link *l, int timeout_ms, kvb_conn *const **lanes, uint32_t *n,
                                    kvb_err *err);
/* The state now, and why (cap bytes): "" when up; the last failure and when the next attempt
 * is while down; while connecting, what it is dialling again after ("" for the first attempt). */
kvb_peer_state kvb_peer_link_state(kvb_peer_link *l, char *why, size_t cap);

#endif
