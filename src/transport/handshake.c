/* transport/handshake.c — listeners, and the handshake that is the only way to obtain a usable
 * kvb_conn: HELLO exchange, mutual HMAC-SHA256 proof of the pre-shared key over both nonces and both
 * HELLO payloads (OpenSSL libcrypto; constant-time comparison), built-in checks (protocol version,
 * complementary roles) and the compatibility check (default: model fingerprint, cache format, bridge
 * mode). Every refusal is told to the peer in an ERROR frame and the connection is closed. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "kvb_quant.h"
#include "transport_internal.h"

#define AUTH_LABEL "kvbridge-auth-v1"
#define AUTH_LABEL_BYTES 16
#define HELLO_MAX_BYTES (KVB_HELLO_FIXED_BYTES + KVB_WIRE_NAME_MAX)
#define BIT(t) (1u << (t))

/* ---- listeners -------------------------------------------------------------------------------- */

kvb_status kvb_transport_listen(const char *addr, const kvb_wire_backend *backend, kvb_listener **out, kvb_err *err) {
    if (!backend) backend = &kvb_wire_backend_tcp;
    kvb_listener *l = calloc(1, sizeof *l);
    if (!l) return kvb_err_set(err, KVB_ERR_NOMEM, "listen: out of memory");
    kvb_status st = backend->listen(addr, &l->link_listener, err);
    if (st) {
        free(l);
        return st;
    }
    l->backend = backend;
    *out = l;
    return KVB_OK;
}

uint16_t kvb_listener_port(const kvb_listener *l) { return l->link_listener->port; }

kvb_handshake_reason kvb_handshake_reason_of(kvb_status st) {
    switch (st) {
    case KVB_ERR_AUTH: return KVB_HANDSHAKE_AUTH;
    case KVB_ERR_MISMATCH: return KVB_HANDSHAKE_MISMATCH;
    case KVB_ERR_TIMEOUT: return KVB_HANDSHAKE_TIMEOUT;
    case KVB_ERR_FORMAT:
    case KVB_ERR_RANGE:
    case KVB_ERR_CHECKSUM: return KVB_HANDSHAKE_PROTOCOL;
    case KVB_ERR_REFUSED: return KVB_HANDSHAKE_REFUSED;
    case KVB_ERR_PEER_GONE: return KVB_HANDSHAKE_GONE;
    default: return KVB_HANDSHAKE_OTHER;
    }
}

const char *kvb_handshake_reason_name(kvb_handshake_reason r) {
    static const char *const names[KVB_HANDSHAKE_REASONS] = {"auth",    "mismatch", "timeout", "protocol",
                                                             "refused", "gone",     "other"};
    return (unsigned)r < KVB_HANDSHAKE_REASONS ? names[r] : "other";
}

void kvb_listener_get_stats(const kvb_listener *l, kvb_listener_stats *out) {
    kvb_listener *m = (kvb_listener *)l; /* atomics are read-only here */
    out->accepted = atomic_load_explicit(&m->accepted, memory_order_relaxed);
    for (int r = 0; r < KVB_HANDSHAKE_REASONS; r++)
        out->failed[r] = atomic_load_explicit(&m->failed[r], memory_order_relaxed);
}

void kvb_listener_close(kvb_listener *l) {
    if (!l) return;
    l->backend->listener_close(l->link_listener);
    free(l);
}

/* ---- compatibility ---------------------------------------------------------------------------- */

static void appendf(char *buf, size_t cap, size_t *off, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void appendf(char *buf, size_t cap, size_t *off, const char *fmt, ...) {
    if (*off >= cap) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(buf + *off, cap - *off, fmt, ap);
    va_end(ap);
    if (w > 0) *off = KVB_MIN(cap, *off + (size_t)w);
}

bool kvb_hello_check_default(void *ctx, const kvb_hello *mine, const kvb_hello *peer, uint32_t *code, char *why,
                             size_t why_cap) {
    (void)ctx;
    size_t off = 0;
    if (mine->model_fingerprint != peer->model_fingerprint) {
        *code = KVB_WIRE_ERR_MODEL;
        appendf(why, why_cap, &off,
                "model fingerprint differs: '%s' has %016llx, '%s' has %016llx (the nodes load different models, "
                "weights or builds)",
                mine->name, (unsigned long long)mine->model_fingerprint, peer->name,
                (unsigned long long)peer->model_fingerprint);
        return false;
    }
    const kvb_kvformat *a = &mine->format, *b = &peer->format;
    struct {
        const char *name;
        uint32_t x, y;
    } fields[] = {{"version", a->version, b->version},       {"dtype", a->dtype, b->dtype},
                  {"block_tokens", a->block_tokens, b->block_tokens}, {"n_layer", a->n_layer, b->n_layer},
                  {"n_head_kv", a->n_head_kv, b->n_head_kv},  {"head_dim", a->head_dim, b->head_dim}};
    bool differs = false;
    for (size_t i = 0; i < KVB_ARRAY_LEN(fields); i++) {
        if (fields[i].x == fields[i].y) continue;
        if (i == 1)
            appendf(why, why_cap, &off, "%sdtype %s vs %s", differs ? ", " : "cache format differs: ",
                    kvb_type_name(fields[i].x), kvb_type_name(fields[i].y));
        else
            appendf(why, why_cap, &off, "%s%s %u vs %u", differs ? ", " : "cache format differs: ", fields[i].name,
                    fields[i].x, fields[i].y);
        differs = true;
    }
    if (!differs && mine->format_fingerprint != peer->format_fingerprint) {
        appendf(why, why_cap, &off,
                "cache format fingerprint differs (%016llx vs %016llx) although every field is equal (different "
                "builds?)",
                (unsigned long long)mine->format_fingerprint, (unsigned long long)peer->format_fingerprint);
        differs = true;
    } else if (differs) {
        char da[64], db[64];
        kvb_kvformat_describe(a, da, sizeof da);
        kvb_kvformat_describe(b, db, sizeof db);
        appendf(why, why_cap, &off, " ('%s' uses %s, '%s' uses %s)", mine->name, da, peer->name, db);
    }
    if (differs) {
        *code = KVB_WIRE_ERR_FORMAT;
        return false;
    }
    if (mine->bridge_mode != peer->bridge_mode) {
        *code = KVB_WIRE_ERR_MODE;
        appendf(why, why_cap, &off, "bridge mode differs: '%s' runs %s mode, '%s' runs %s mode", mine->name,
                kvb_bridge_mode_name(mine->bridge_mode), peer->name, kvb_bridge_mode_name(peer->bridge_mode));
        return false;
    }
    return true;
}

/* ---- the proof -------------------------------------------------------------------------------- */

typedef struct {
    uint8_t client[HELLO_MAX_BYTES], server[HELLO_MAX_BYTES];
    size_t client_len, server_len;
    uint8_t client_nonce[KVB_WIRE_NONCE_BYTES], server_nonce[KVB_WIRE_NONCE_BYTES];
} transcript;

static kvb_status compute_proof(const kvb_transport_config *cfg, const transcript *t, char direction,
                                uint8_t mac[KVB_WIRE_MAC_BYTES], kvb_err *err) {
    uint8_t buf[AUTH_LABEL_BYTES + 1 + 2 * KVB_WIRE_NONCE_BYTES + 16 + 2 * HELLO_MAX_BYTES];
    size_t n = 0;
    memcpy(buf + n, AUTH_LABEL, AUTH_LABEL_BYTES);
    n += AUTH_LABEL_BYTES;
    buf[n++] = (uint8_t)direction;
    memcpy(buf + n, t->client_nonce, KVB_WIRE_NONCE_BYTES);
    n += KVB_WIRE_NONCE_BYTES;
    memcpy(buf + n, t->server_nonce, KVB_WIRE_NONCE_BYTES);
    n += KVB_WIRE_NONCE_BYTES;
    wire_put_u64(buf + n, t->client_len);
    n += 8;
    memcpy(buf + n, t->client, t->client_len);
    n += t->client_len;
    wire_put_u64(buf + n, t->server_len);
    n += 8;
    memcpy(buf + n, t->server, t->server_len);
    n += t->server_len;
    unsigned int mac_len = 0;
    if (!HMAC(EVP_sha256(), cfg->psk, (int)cfg->psk_len, buf, n, mac, &mac_len) || mac_len != KVB_WIRE_MAC_BYTES)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "handshake: HMAC-SHA256 failed (OpenSSL)");
    return KVB_OK;
}

/* ---- handshake plumbing ----------------------------------------------------------------------- */

static kvb_status check_config(const kvb_transport_config *cfg, const kvb_hello *mine, kvb_err *err) {
    if (!cfg || !cfg->psk) return kvb_err_set(err, KVB_ERR_INVALID, "handshake: no pre-shared key configured");
    if (cfg->psk_len < KVB_WIRE_PSK_MIN || cfg->psk_len > KVB_WIRE_PSK_MAX)
        return kvb_err_set(err, KVB_ERR_INVALID, "handshake: the pre-shared key has %zu bytes (needs %d..%d)",
                           cfg->psk_len, KVB_WIRE_PSK_MIN, KVB_WIRE_PSK_MAX);
    if (cfg->max_payload > KVB_WIRE_MAX_PAYLOAD_LIMIT)
        return kvb_err_set(err, KVB_ERR_INVALID, "handshake: max payload %llu exceeds %llu",
                           (unsigned long long)cfg->max_payload, (unsigned long long)KVB_WIRE_MAX_PAYLOAD_LIMIT);
    if (!mine || mine->protocol_version != KVB_WIRE_VERSION ||
        (mine->role != KVB_ROLE_PREFILL && mine->role != KVB_ROLE_DECODE) ||
        (mine->bridge_mode != KVB_BRIDGE_MODE_DECODER && mine->bridge_mode != KVB_BRIDGE_MODE_PREFILL))
        return kvb_err_set(err, KVB_ERR_INVALID, "handshake: this node's HELLO is not initialised (kvb_hello_init)");
    return KVB_OK;
}

/* Encodes my HELLO with a fresh nonce into the transcript side. */
static kvb_status make_hello(const kvb_hello *in, kvb_hello *out, uint8_t *buf, size_t *len, uint8_t *nonce_out,
                             kvb_err *err) {
    *out = *in;
    if (RAND_bytes(out->nonce, KVB_WIRE_NONCE_BYTES) != 1)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "handshake: no random bytes for the nonce (OpenSSL RAND_bytes)");
    memcpy(nonce_out, out->nonce, KVB_WIRE_NONCE_BYTES);
    return kvb_msg_hello_encode(out, buf, HELLO_MAX_BYTES, len, err);
}

static uint32_t wire_code_for(kvb_status st) {
    return st == KVB_ERR_MISMATCH ? KVB_WIRE_ERR_VERSION : KVB_WIRE_ERR_PROTOCOL;
}

/* The status a refusal by the peer (its ERROR frame's code) is returned as. */
static kvb_status status_for_wire_code(uint32_t code) {
    switch (code) {
    case KVB_WIRE_ERR_AUTH: return KVB_ERR_AUTH;
    case KVB_WIRE_ERR_VERSION:
    case KVB_WIRE_ERR_ROLE:
    case KVB_WIRE_ERR_MODEL:
    case KVB_WIRE_ERR_FORMAT:
    case KVB_WIRE_ERR_MODE:
    case KVB_WIRE_ERR_INCOMPATIBLE: return KVB_ERR_MISMATCH;
    }
    return KVB_ERR_REFUSED; /* busy, draining, or it found our frames malformed */
}

/* Tells the peer why (best effort, bounded by the deadline and at most 500 ms), whatever state the
 * connection is in, and marks it broken. */
static void refuse(kvb_conn *c, uint32_t code, const char *why, double deadline) {
    kvb_msg_error m;
    kvb_msg_error_set(&m, code, why);
    uint8_t buf[8 + KVB_WIRE_ERROR_MSG_MAX];
    size_t len;
    if (kvb_msg_error_encode(&m, buf, sizeof buf, &len, NULL) == KVB_OK) {
        kvb_iov iov = {buf, len};
        kvb_frame_header h = {.type = KVB_FRAME_ERROR, .payload_len = len, .payload_hash = kvb_wire_payload_hash(&iov, 1)};
        uint8_t hdr[KVB_WIRE_HEADER_BYTES];
        kvb_wire_header_encode(&h, hdr);
        double until = KVB_MIN(deadline, kvb_now_s() + 0.5);
        if (c->backend->send_frame(c->link, hdr, &iov, 1, until, NULL) == KVB_OK) {
            atomic_fetch_add_explicit(&c->bytes_sent, KVB_WIRE_HEADER_BYTES + len, memory_order_relaxed);
            atomic_fetch_add_explicit(&c->frames_sent, 1, memory_order_relaxed);
        }
    }
    kvb_err e;
    kvb_err_set(&e, KVB_ERR_REFUSED, "handshake refused: %s", why);
    wire_conn_break(c, &e);
}

/* A failure of ours: tell the peer, then return err (prefixed with the peer). */
static kvb_status refuse_with(kvb_conn *c, uint32_t code, kvb_status st, double deadline, kvb_err *err) {
    refuse(c, code, err->msg, deadline);
    atomic_fetch_add_explicit(&c->protocol_errors, code == KVB_WIRE_ERR_PROTOCOL || code == KVB_WIRE_ERR_VERSION,
                              memory_order_relaxed);
    err->code = st;
    return st;
}

/* Receives one handshake frame: `want` or an ERROR from the peer (returned as a failure with the
 * peer's message). Any other frame is refused. */
static kvb_status recv_handshake(kvb_conn *c, uint16_t want, double deadline, kvb_frame *f, kvb_err *err) {
    uint32_t allowed = BIT(KVB_FRAME_HELLO) | BIT(KVB_FRAME_AUTH) | BIT(KVB_FRAME_AUTH_OK) | BIT(KVB_FRAME_ERROR) |
                       BIT(KVB_FRAME_PREFILL) | BIT(KVB_FRAME_SLAB) | BIT(KVB_FRAME_DONE) | BIT(KVB_FRAME_CANCEL) |
                       BIT(KVB_FRAME_PING) | BIT(KVB_FRAME_PONG) | BIT(KVB_FRAME_LANE);
    kvb_status st = wire_conn_recv(c, allowed, KVB_WIRE_HANDSHAKE_MAX_PAYLOAD, deadline, NULL, NULL, f, err);
    if (st) {
        /* A frame we could not accept (wrong version, corrupt, too large) is answered; a timeout or a
         * closed connection is not. */
        if (st == KVB_ERR_FORMAT || st == KVB_ERR_MISMATCH || st == KVB_ERR_RANGE || st == KVB_ERR_CHECKSUM)
            refuse(c, wire_code_for(st), err->msg, deadline);
        return st;
    }
    if (f->type == want) return KVB_OK;
    if (f->type == KVB_FRAME_ERROR) {
        kvb_msg_error m;
        kvb_err derr;
        if (kvb_msg_error_decode(f->payload, (size_t)f->payload_len, &m, &derr) != KVB_OK)
            return refuse_with(c, KVB_WIRE_ERR_PROTOCOL, kvb_err_set(err, KVB_ERR_FORMAT, "malformed ERROR frame: %s", derr.msg),
                               deadline, err);
        kvb_err e;
        kvb_err_set(&e, status_for_wire_code(m.code), "the peer refused: %s", m.msg);
        wire_conn_break(c, &e);
        return kvb_err_set(err, status_for_wire_code(m.code), "the peer refused the connection: [%s] %s",
                           kvb_wire_error_name(m.code), m.msg);
    }
    kvb_err_set(err, KVB_ERR_FORMAT, "expected %s, got %s (a peer must complete the handshake first)",
                kvb_frame_type_name(want), kvb_frame_type_name(f->type));
    return refuse_with(c, KVB_WIRE_ERR_PROTOCOL, KVB_ERR_FORMAT, deadline, err);
}

static kvb_status send_handshake(kvb_conn *c, uint16_t type, const uint8_t *buf, size_t len, double deadline,
                                 kvb_err *err) {
    kvb_iov iov = {buf, len};
    return wire_conn_send(c, type, 0, &iov, 1, deadline, err);
}

/* Built-in and caller checks of the peer's HELLO (after the proofs): refuses on failure. */
static kvb_status check_peer(kvb_conn *c, const kvb_transport_config *cfg, double deadline, kvb_err *err) {
    const kvb_hello *mine = &c->mine, *peer = &c->peer;
    if (peer->role == mine->role) {
        kvb_err_set(err, KVB_ERR_MISMATCH, "both nodes are %s nodes ('%s' and '%s'): one must be prefill, one decode",
                    kvb_wire_role_name(mine->role), mine->name, peer->name);
        return refuse_with(c, KVB_WIRE_ERR_ROLE, KVB_ERR_MISMATCH, deadline, err);
    }
    uint32_t code = KVB_WIRE_ERR_INCOMPATIBLE;
    char why[sizeof err->msg - 64];
    why[0] = 0;
    kvb_hello_check_fn check = cfg->check ? cfg->check : kvb_hello_check_default;
    if (!check(cfg->check_ctx, mine, peer, &code, why, sizeof why)) {
        why[sizeof why - 1] = 0;
        kvb_err_set(err, KVB_ERR_MISMATCH, "%s", why[0] ? why : "the compatibility check refused the peer");
        return refuse_with(c, code, KVB_ERR_MISMATCH, deadline, err);
    }
    return KVB_OK;
}

static void set_authenticated(kvb_conn *c, const kvb_transport_config *cfg) {
    c->max_payload = cfg->max_payload ? cfg->max_payload : KVB_WIRE_DEFAULT_MAX_PAYLOAD;
    uint32_t common = BIT(KVB_FRAME_ERROR) | BIT(KVB_FRAME_PING) | BIT(KVB_FRAME_PONG);
    if (c->mine.role == KVB_ROLE_DECODE) {
        c->recv_allowed = common | BIT(KVB_FRAME_SLAB) | BIT(KVB_FRAME_DONE);
        c->send_allowed = common | BIT(KVB_FRAME_PREFILL) | BIT(KVB_FRAME_CANCEL) | BIT(KVB_FRAME_LANE);
    } else {
        c->recv_allowed = common | BIT(KVB_FRAME_PREFILL) | BIT(KVB_FRAME_CANCEL) | BIT(KVB_FRAME_LANE);
        c->send_allowed = common | BIT(KVB_FRAME_SLAB) | BIT(KVB_FRAME_DONE);
    }
    c->authenticated = true;
}

static kvb_status decode_peer_hello(kvb_conn *c, const kvb_frame *f, uint8_t *copy, size_t *copy_len,
                                    const uint8_t *my_nonce, double deadline, kvb_err *err) {
    kvb_status st = kvb_msg_hello_decode(f->payload, (size_t)f->payload_len, &c->peer, err);
    if (st) return refuse_with(c, KVB_WIRE_ERR_PROTOCOL, st, deadline, err);
    if (c->peer.protocol_version != KVB_WIRE_VERSION) {
        kvb_err_set(err, KVB_ERR_MISMATCH, "node '%s' speaks kvbridge protocol version %u, this node speaks %u",
                    c->peer.name, c->peer.protocol_version, KVB_WIRE_VERSION);
        return refuse_with(c, KVB_WIRE_ERR_VERSION, KVB_ERR_MISMATCH, deadline, err);
    }
    if (my_nonce && memcmp(my_nonce, c->peer.nonce, KVB_WIRE_NONCE_BYTES) == 0) {
        kvb_err_set(err, KVB_ERR_FORMAT, "node '%s' sent back this node's own nonce", c->peer.name);
        return refuse_with(c, KVB_WIRE_ERR_PROTOCOL, KVB_ERR_FORMAT, deadline, err);
    }
    memcpy(copy, f->payload, (size_t)f->payload_len);
    *copy_len = (size_t)f->payload_len;
    return KVB_OK;
}

static kvb_status recv_proof(kvb_conn *c, uint16_t type, double deadline, kvb_msg_auth *proof, kvb_err *err) {
    kvb_frame f;
    kvb_status st = recv_handshake(c, type, deadline, &f, err);
    if (st) return st;
    st = kvb_msg_auth_decode(f.payload, (size_t)f.payload_len, proof, err);
    if (st) return refuse_with(c, KVB_WIRE_ERR_PROTOCOL, st, deadline, err);
    return KVB_OK;
}

static kvb_status finish(kvb_conn *c, kvb_status st, kvb_conn **out, kvb_hello *peer_hello, kvb_err *err) {
    if (st) {
        kvb_err_prefix(err, "handshake with %s%s%s%s: ", c->link->peer_addr, c->peer.name[0] ? " (node '" : "",
                       c->peer.name, c->peer.name[0] ? "')" : "");
        kvb_conn_close(c);
        return st;
    }
    *out = c;
    if (peer_hello) *peer_hello = c->peer;
    return KVB_OK;
}

/* ---- connecting side -------------------------------------------------------------------------- */

static kvb_status client_handshake(kvb_conn *c, const kvb_transport_config *cfg, double deadline, kvb_err *err) {
    transcript t;
    kvb_status st = make_hello(&c->mine, &c->mine, t.client, &t.client_len, t.client_nonce, err);
    if (st) return st;
    st = send_handshake(c, KVB_FRAME_HELLO, t.client, t.client_len, deadline, err);
    if (st) return st;
    kvb_frame f;
    st = recv_handshake(c, KVB_FRAME_HELLO, deadline, &f, err);
    if (st) return st;
    st = decode_peer_hello(c, &f, t.server, &t.server_len, t.client_nonce, deadline, err);
    if (st) return st;
    memcpy(t.server_nonce, c->peer.nonce, KVB_WIRE_NONCE_BYTES);

    kvb_msg_auth mine, theirs, expect;
    st = compute_proof(cfg, &t, 'C', mine.mac, err);
    if (st) return st;
    st = send_handshake(c, KVB_FRAME_AUTH, mine.mac, KVB_WIRE_MAC_BYTES, deadline, err);
    if (st) return st;
    st = recv_proof(c, KVB_FRAME_AUTH_OK, deadline, &theirs, err);
    if (st) return st;
    st = compute_proof(cfg, &t, 'S', expect.mac, err);
    if (st) return st;
    if (CRYPTO_memcmp(expect.mac, theirs.mac, KVB_WIRE_MAC_BYTES) != 0) {
        kvb_err_set(err, KVB_ERR_AUTH,
                    "authentication failed: node '%s' could not prove it holds this node's pre-shared key "
                    "(different keys, or an impostor); nothing will be accepted from it",
                    c->peer.name);
        return refuse_with(c, KVB_WIRE_ERR_AUTH, KVB_ERR_AUTH, deadline, err);
    }
    return check_peer(c, cfg, deadline, err);
}

kvb_status kvb_transport_connect(const char *addr, const kvb_hello *mine, const kvb_transport_config *cfg,
                                 int timeout_ms, kvb_conn **out, kvb_hello *peer_hello, kvb_err *err) {
    kvb_err local_err;
    if (!err) err = &local_err;
    *out = NULL;
    double deadline;
    kvb_status st = wire_deadline(timeout_ms, &deadline, err);
    if (st) return st;
    st = check_config(cfg, mine, err);
    if (st) return st;
    const kvb_wire_backend *backend = cfg->backend ? cfg->backend : &kvb_wire_backend_tcp;
    kvb_link *link;
    st = backend->connect(addr, deadline, &link, err);
    if (st) return st;
    kvb_conn *c;
    st = wire_conn_new(backend, link, &c, err);
    if (st) return st;
    c->mine = *mine;
    st = client_handshake(c, cfg, deadline, err);
    if (!st && backend->authenticated) st = backend->authenticated(link, deadline, err);
    if (!st) set_authenticated(c, cfg);
    return finish(c, st, out, peer_hello, err);
}

/* ---- accepting side --------------------------------------------------------------------------- */

static kvb_status server_handshake(kvb_conn *c, const kvb_transport_config *cfg, double deadline, kvb_err *err) {
    transcript t;
    kvb_frame f;
    kvb_status st = recv_handshake(c, KVB_FRAME_HELLO, deadline, &f, err);
    if (st) return st;
    st = decode_peer_hello(c, &f, t.client, &t.client_len, NULL, deadline, err);
    if (st) return st;
    memcpy(t.client_nonce, c->peer.nonce, KVB_WIRE_NONCE_BYTES);
    st = make_hello(&c->mine, &c->mine, t.server, &t.server_len, t.server_nonce, err);
    if (st) return st;
    if (memcmp(t.client_nonce, t.server_nonce, KVB_WIRE_NONCE_BYTES) == 0) {
        kvb_err_set(err, KVB_ERR_FORMAT, "node '%s' sent a nonce equal to this node's", c->peer.name);
        return refuse_with(c, KVB_WIRE_ERR_PROTOCOL, KVB_ERR_FORMAT, deadline, err);
    }
    st = send_handshake(c, KVB_FRAME_HELLO, t.server, t.server_len, deadline, err);
    if (st) return st;

    kvb_msg_auth theirs, expect, mine;
    st = recv_proof(c, KVB_FRAME_AUTH, deadline, &theirs, err);
    if (st) return st;
    st = compute_proof(cfg, &t, 'C', expect.mac, err);
    if (st) return st;
    if (CRYPTO_memcmp(expect.mac, theirs.mac, KVB_WIRE_MAC_BYTES) != 0) {
        kvb_err_set(err, KVB_ERR_AUTH,
                    "authentication failed: node '%s' did not prove it holds the pre-shared key of node '%s' "
                    "(the two nodes use different keys, or the peer is not trusted)",
                    c->peer.name, c->mine.name);
        return refuse_with(c, KVB_WIRE_ERR_AUTH, KVB_ERR_AUTH, deadline, err);
    }
    st = check_peer(c, cfg, deadline, err);
    if (st) return st;
    st = compute_proof(cfg, &t, 'S', mine.mac, err);
    if (st) return st;
    return send_handshake(c, KVB_FRAME_AUTH_OK, mine.mac, KVB_WIRE_MAC_BYTES, deadline, err);
}

kvb_status kvb_transport_accept(kvb_listener *l, const kvb_hello *mine, const kvb_transport_config *cfg,
                                int timeout_ms, kvb_conn **out, kvb_hello *peer_hello, kvb_err *err) {
    kvb_err local_err;
    if (!err) err = &local_err;
    *out = NULL;
    double deadline;
    kvb_status st = wire_deadline(timeout_ms, &deadline, err);
    if (st) return st;
    st = check_config(cfg, mine, err);
    if (st) return st;
    kvb_link *link;
    st = l->backend->accept(l->link_listener, deadline, &link, err);
    if (st) return st;
    kvb_conn *c;
    st = wire_conn_new(l->backend, link, &c, err);
    if (st) return st;
    c->mine = *mine;
    /* a peer that connected late in the wait still gets the whole time for its handshake */
    deadline = kvb_now_s() + timeout_ms / 1000.0;
    st = server_handshake(c, cfg, deadline, err);
    if (!st && l->backend->authenticated) st = l->backend->authenticated(link, deadline, err);
    if (!st) set_authenticated(c, cfg);
    if (st) atomic_fetch_add_explicit(&l->failed[kvb_handshake_reason_of(st)], 1, memory_order_relaxed);
    else atomic_fetch_add_explicit(&l->accepted, 1, memory_order_relaxed);
    return finish(c, st, out, peer_hello, err);
}
