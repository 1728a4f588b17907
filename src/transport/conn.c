/* transport/conn.c — the connection object: one frame in and out through the backend, payload
 * hash verification, role-based admission of frame types, message decoding, the typed senders,
 * counters, and the rule that a connection is unusable after its first failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport_internal.h"

#define BIT(t) (1u << (t))

kvb_status wire_conn_new(const kvb_wire_backend *backend, kvb_link *link, kvb_conn **out, kvb_err *err) {
    kvb_conn *c = calloc(1, sizeof *c);
    if (!c) {
        backend->close(link);
        return kvb_err_set(err, KVB_ERR_NOMEM, "connection: out of memory");
    }
    c->backend = backend;
    c->link = link;
    c->max_payload = KVB_WIRE_HANDSHAKE_MAX_PAYLOAD;
    atomic_init(&c->broken, false);
    pthread_mutex_init(&c->broken_lock, NULL);
    atomic_init(&c->bytes_sent, 0);
    atomic_init(&c->frames_sent, 0);
    atomic_init(&c->bytes_received, 0);
    atomic_init(&c->frames_received, 0);
    atomic_init(&c->checksum_failures, 0);
    atomic_init(&c->protocol_errors, 0);
    atomic_init(&c->timeouts, 0);
    *out = c;
    return KVB_OK;
}

void wire_conn_break(kvb_conn *c, const kvb_err *why) {
    pthread_mutex_lock(&c->broken_lock);
    if (!atomic_load(&c->broken)) {
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", why ? why->msg : "closed");
        c->broken_code = why && why->code ? why->code : KVB_ERR_PEER_GONE;
        atomic_store(&c->broken, true);
        /* After the handshake, a thread blocked in the other direction wakes up. During it there is
         * one thread, and the socket stays open so the refusal can still be sent. */
        if (c->authenticated) c->backend->shutdown(c->link);
    }
    pthread_mutex_unlock(&c->broken_lock);
}

void wire_count_failure(kvb_conn *c, const kvb_err *e) {
    if (e->code == KVB_ERR_CHECKSUM)
        atomic_fetch_add_explicit(&c->checksum_failures, 1, memory_order_relaxed);
    else if (e->code == KVB_ERR_TIMEOUT)
        atomic_fetch_add_explicit(&c->timeouts, 1, memory_order_relaxed);
    else if (e->code == KVB_ERR_FORMAT || e->code == KVB_ERR_RANGE || e->code == KVB_ERR_MISMATCH)
        atomic_fetch_add_explicit(&c->protocol_errors, 1, memory_order_relaxed);
}

/* A call on a broken connection: the first failure's code, and its message. */
static kvb_status fail_fast(kvb_conn *c, kvb_err *err) {
    pthread_mutex_lock(&c->broken_lock);
    const kvb_status st = c->broken_code;
    kvb_err_set(err, st, "connection to %s is unusable after an earlier failure (%s)", c->link->peer_addr,
                c->broken_msg);
    pthread_mutex_unlock(&c->broken_lock);
    return st;
}

static kvb_status fail(kvb_conn *c, kvb_status st, kvb_err *err) {
    kvb_err local = {0};
    if (!err) err = &local;
    if (atomic_load(&c->broken)) {
        /* Another thread broke or shut the connection down while this call waited: say so rather
         * than report the socket-level symptom. */
        return fail_fast(c, err);
    }
    err->code = st;
    wire_count_failure(c, err);
    wire_conn_break(c, err);
    return st;
}

kvb_status wire_conn_send(kvb_conn *c, uint16_t type, uint64_t request_id, const kvb_iov *iov, int n_iov,
                          double deadline, kvb_err *err) {
    if (atomic_load(&c->broken)) return fail_fast(c, err);
    uint64_t total = 0;
    for (int i = 0; i < n_iov; i++) total += iov[i].len;
    kvb_frame_header h = {.type = type, .request_id = request_id, .payload_len = total};
    h.payload_hash = kvb_wire_frame_payload_hash(type, iov, n_iov);
    uint8_t hdr[KVB_WIRE_HEADER_BYTES];
    kvb_wire_header_encode(&h, hdr);
    kvb_status st = c->backend->send_frame(c->link, hdr, iov, n_iov, deadline, err);
    if (st) return fail(c, st, err);
    atomic_fetch_add_explicit(&c->bytes_sent, KVB_WIRE_HEADER_BYTES + total, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->frames_sent, 1, memory_order_relaxed);
    return KVB_OK;
}

static const char *allowed_list(uint32_t allowed, char *buf, size_t cap) {
    size_t off = 0;
    buf[0] = 0;
    for (uint32_t t = 1; t <= KVB_FRAME_TYPE_MAX; t++)
        if (allowed & BIT(t)) {
            int w = snprintf(buf + off, cap - off, "%s%s", off ? ", " : "", kvb_frame_type_name(t));
            if (w < 0 || (size_t)w >= cap - off) break;
            off += (size_t)w;
        }
    return buf;
}

kvb_status wire_conn_recv(kvb_conn *c, uint32_t allowed, uint64_t max_payload, double deadline, kvb_wire_buf *buf,
                          kvb_wire_loan *loan, kvb_frame *out, kvb_err *err) {
    if (loan) *loan = (kvb_wire_loan){0};
    if (atomic_load(&c->broken)) return fail_fast(c, err);
    if (!buf) buf = &c->rbuf;
    kvb_frame_header h;
    kvb_status st = c->backend->recv_frame(c->link, max_payload, &h, buf, loan, deadline, err);
    if (st) return fail(c, st, err);
    const uint8_t *payload = !h.payload_len ? (const uint8_t *)"" : loan && loan->data ? loan->data : buf->data;
    uint64_t got = kvb_xxh3(payload, (size_t)kvb_wire_hashed_len(h.type, h.payload_len));
    if (got != h.payload_hash) {
        kvb_err_set(err, KVB_ERR_CHECKSUM,
                    "%s payload from %s: checksum mismatch (header says %016llx, %llu bytes hash to %016llx)",
                    kvb_frame_type_name(h.type), c->link->peer_addr, (unsigned long long)h.payload_hash,
                    (unsigned long long)kvb_wire_hashed_len(h.type, h.payload_len), (unsigned long long)got);
        kvb_wire_loan_return(loan);
        return fail(c, KVB_ERR_CHECKSUM, err);
    }
    atomic_fetch_add_explicit(&c->bytes_received, KVB_WIRE_HEADER_BYTES + h.payload_len, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->frames_received, 1, memory_order_relaxed);
    if (!(allowed & BIT(h.type))) {
        char list[128];
        kvb_err_set(err, KVB_ERR_FORMAT, "unexpected %s frame from %s (expected %s)", kvb_frame_type_name(h.type),
                    c->link->peer_addr, allowed_list(allowed, list, sizeof list));
        kvb_wire_loan_return(loan);
        return fail(c, KVB_ERR_FORMAT, err);
    }
    out->type = h.type;
    out->flags = h.flags;
    out->request_id = h.request_id;
    out->payload = payload;
    out->payload_len = h.payload_len;
    return KVB_OK;
}

void kvb_msg_free(kvb_msg *m) {
    if (m && m->type == KVB_FRAME_PREFILL) kvb_msg_prefill_free(&m->u.prefill);
}

kvb_status kvb_msg_decode(const kvb_frame *f, kvb_msg *out, kvb_err *err) {
    memset(out, 0, sizeof *out);
    out->type = f->type;
    out->request_id = f->request_id;
    const uint8_t *p = f->payload;
    size_t n = (size_t)f->payload_len;
    kvb_status st;
    uint64_t inner_id;
    switch (f->type) {
    case KVB_FRAME_PREFILL:
        st = kvb_msg_prefill_decode(p, n, &out->u.prefill, err);
        inner_id = out->u.prefill.request_id;
        break;
    case KVB_FRAME_CANCEL:
        st = kvb_msg_cancel_decode(p, n, &out->u.cancel, err);
        inner_id = out->u.cancel.request_id;
        break;
    case KVB_FRAME_SLAB: return kvb_msg_slab_decode(p, n, &out->u.slab, err);
    case KVB_FRAME_DONE: return kvb_msg_done_decode(p, n, &out->u.done, err);
    case KVB_FRAME_ERROR: return kvb_msg_error_decode(p, n, &out->u.error, err);
    case KVB_FRAME_PING: return kvb_msg_ping_decode(p, n, &out->u.ping, err);
    case KVB_FRAME_PONG: return kvb_msg_pong_decode(p, n, &out->u.ping, err);
    case KVB_FRAME_LANE: return kvb_msg_lane_decode(p, n, &out->u.lane, err);
    default:
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s frame is not a message after the handshake",
                           kvb_frame_type_name(f->type));
    }
    if (st) return st;
    if (inner_id != f->request_id) {
        kvb_msg_free(out);
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: payload request id %llu differs from the header's %llu",
                           kvb_frame_type_name(f->type), (unsigned long long)inner_id,
                           (unsigned long long)f->request_id);
    }
    return KVB_OK;
}

kvb_status kvb_conn_recv(kvb_conn *c, int timeout_ms, kvb_msg *out, kvb_err *err) {
    return kvb_conn_recv_into(c, timeout_ms, NULL, out, err);
}

kvb_status kvb_conn_recv_into(kvb_conn *c, int timeout_ms, kvb_wire_buf *buf, kvb_msg *out, kvb_err *err) {
    return kvb_conn_recv_lend(c, timeout_ms, buf, NULL, out, err);
}

kvb_status kvb_conn_recv_lend(kvb_conn *c, int timeout_ms, kvb_wire_buf *buf, kvb_wire_loan *loan, kvb_msg *out,
                              kvb_err *err) {
    memset(out, 0, sizeof *out);
    if (loan) *loan = (kvb_wire_loan){0};
    if (!c || !c->authenticated) return kvb_err_set(err, KVB_ERR_INVALID, "receive: no authenticated connection");
    double deadline;
    kvb_status st = wire_deadline(timeout_ms, &deadline, err);
    if (st) return st;
    kvb_frame f;
    st = wire_conn_recv(c, c->recv_allowed, c->max_payload, deadline, buf, loan, &f, err);
    if (st) return st;
    st = kvb_msg_decode(&f, out, err);
    if (st) {
        kvb_wire_loan_return(loan);
        kvb_err_prefix(err, "from %s: ", c->link->peer_addr);
        return fail(c, st, err);
    }
    return KVB_OK;
}

void kvb_wire_loan_return(kvb_wire_loan *loan) {
    if (!loan || !loan->give_back) return;
    loan->give_back(loan->owner, loan->id);
    *loan = (kvb_wire_loan){0};
}

/* ---- typed senders ---------------------------------------------------------------------------- */

static kvb_status send_check(kvb_conn *c, uint16_t type, int timeout_ms, double *deadline, kvb_err *err) {
    if (!c || !c->authenticated) return kvb_err_set(err, KVB_ERR_INVALID, "send: no authenticated connection");
    if (!(c->send_allowed & BIT(type)))
        return kvb_err_set(err, KVB_ERR_INVALID, "send: a %s node does not send %s frames",
                           kvb_wire_role_name(c->mine.role), kvb_frame_type_name(type));
    return wire_deadline(timeout_ms, deadline, err);
}

kvb_status kvb_conn_send_prefill(kvb_conn *c, const kvb_msg_prefill *m, int timeout_ms, kvb_err *err) {
    double deadline;
    kvb_status st = send_check(c, KVB_FRAME_PREFILL, timeout_ms, &deadline, err);
    if (st) return st;
    size_t len = 0;
    kvb_msg_prefill_encode(m, NULL, 0, &len, NULL); /* size query (or the argument error, below) */
    if (len > c->max_payload)
        return kvb_err_set(err, KVB_ERR_RANGE, "send PREFILL: %zu bytes exceeds the frame limit of %llu", len,
                           (unsigned long long)c->max_payload);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) return kvb_err_set(err, KVB_ERR_NOMEM, "send PREFILL: out of memory");
    st = kvb_msg_prefill_encode(m, buf, len, &len, err);
    if (!st) {
        kvb_iov iov = {buf, len};
        st = wire_conn_send(c, KVB_FRAME_PREFILL, m->request_id, &iov, 1, deadline, err);
    }
    free(buf);
    return st;
}

kvb_status kvb_conn_send_slab(kvb_conn *c, uint64_t request_id, const kvb_msg_slab *m, int timeout_ms, kvb_err *err) {
    double deadline;
    kvb_status st = send_check(c, KVB_FRAME_SLAB, timeout_ms, &deadline, err);
    if (st) return st;
    if (m->n < 1 || m->n > UINT32_MAX - m->pos0 || (m->k_bytes && !m->k) || (m->v_bytes && !m->v))
        return kvb_err_set(err, KVB_ERR_INVALID, "send SLAB: bad slab (layer %u, tokens %u+%u)", m->layer, m->pos0, m->n);
    uint8_t head[KVB_SLAB_HEAD_BYTES];
    kvb_msg_slab_encode_head(m, head);
    kvb_iov iov[3] = {{head, sizeof head}, {m->k, (size_t)m->k_bytes}, {m->v, (size_t)m->v_bytes}};
    return wire_conn_send(c, KVB_FRAME_SLAB, request_id, iov, 3, deadline, err);
}

/* A small message already encoded into buf: the role check, then one frame. */
static kvb_status send_small(kvb_conn *c, uint16_t type, uint64_t request_id, const uint8_t *buf, size_t len,
                             int timeout_ms, kvb_err *err) {
    double deadline;
    kvb_status st = send_check(c, type, timeout_ms, &deadline, err);
    if (st) return st;
    kvb_iov iov = {buf, len};
    return wire_conn_send(c, type, request_id, &iov, 1, deadline, err);
}

kvb_status kvb_conn_send_done(kvb_conn *c, uint64_t request_id, const kvb_msg_done *m, int timeout_ms, kvb_err *err) {
    uint8_t buf[KVB_DONE_BYTES];
    size_t len;
    kvb_status st = kvb_msg_done_encode(m, buf, sizeof buf, &len, err);
    return st ? st : send_small(c, KVB_FRAME_DONE, request_id, buf, len, timeout_ms, err);
}

kvb_status kvb_conn_send_error(kvb_conn *c, uint64_t request_id, uint32_t code, const char *msg, int timeout_ms,
                               kvb_err *err) {
    kvb_msg_error m;
    kvb_msg_error_set(&m, code, msg);
    uint8_t buf[8 + KVB_WIRE_ERROR_MSG_MAX];
    size_t len;
    kvb_status st = kvb_msg_error_encode(&m, buf, sizeof buf, &len, err);
    return st ? st : send_small(c, KVB_FRAME_ERROR, request_id, buf, len, timeout_ms, err);
}

kvb_status kvb_conn_send_cancel(kvb_conn *c, uint64_t request_id, int timeout_ms, kvb_err *err) {
    kvb_msg_cancel m = {request_id};
    uint8_t buf[8];
    size_t len;
    kvb_msg_cancel_encode(&m, buf, sizeof buf, &len, NULL);
    return send_small(c, KVB_FRAME_CANCEL, request_id, buf, len, timeout_ms, err);
}

kvb_status kvb_conn_send_ping(kvb_conn *c, uint64_t token, int timeout_ms, kvb_err *err) {
    const kvb_msg_ping m = {.token = token};
    uint8_t buf[8];
    size_t len;
    kvb_msg_ping_encode(&m, buf, sizeof buf, &len, NULL);
    return send_small(c, KVB_FRAME_PING, 0, buf, len, timeout_ms, err);
}

kvb_status kvb_conn_send_pong_load(kvb_conn *c, const kvb_msg_ping *m, int timeout_ms, kvb_err *err) {
    uint8_t buf[KVB_PONG_BYTES];
    size_t len;
    kvb_status st = kvb_msg_pong_encode(m, buf, sizeof buf, &len, err);
    return st ? st : send_small(c, KVB_FRAME_PONG, 0, buf, len, timeout_ms, err);
}

kvb_status kvb_conn_send_pong(kvb_conn *c, uint64_t token, int timeout_ms, kvb_err *err) {
    const kvb_msg_ping m = {.token = token};
    return kvb_conn_send_pong_load(c, &m, timeout_ms, err);
}

kvb_status kvb_conn_send_lane(kvb_conn *c, const kvb_msg_lane *m, int timeout_ms, kvb_err *err) {
    uint8_t buf[KVB_LANE_BYTES];
    size_t len;
    kvb_status st = kvb_msg_lane_encode(m, buf, sizeof buf, &len, err);
    return st ? st : send_small(c, KVB_FRAME_LANE, 0, buf, len, timeout_ms, err);
}

/* ---- state ------------------------------------------------------------------------------------ */

void kvb_conn_get_stats(const kvb_conn *c, kvb_conn_stats *out) {
    kvb_conn *m = (kvb_conn *)c; /* atomics are read-only here */
    out->bytes_sent = atomic_load_explicit(&m->bytes_sent, memory_order_relaxed);
    out->frames_sent = atomic_load_explicit(&m->frames_sent, memory_order_relaxed);
    out->bytes_received = atomic_load_explicit(&m->bytes_received, memory_order_relaxed);
    out->frames_received = atomic_load_explicit(&m->frames_received, memory_order_relaxed);
    out->checksum_failures = atomic_load_explicit(&m->checksum_failures, memory_order_relaxed);
    out->protocol_errors = atomic_load_explicit(&m->protocol_errors, memory_order_relaxed);
    out->timeouts = atomic_load_explicit(&m->timeouts, memory_order_relaxed);
}

const kvb_hello *kvb_conn_peer_hello(const kvb_conn *c) { return &c->peer; }
const char *kvb_conn_peer_addr(const kvb_conn *c) { return c->link->peer_addr; }
bool kvb_conn_usable(const kvb_conn *c) { return !atomic_load(&((kvb_conn *)c)->broken); }

void kvb_conn_shutdown(kvb_conn *c) {
    if (!c) return;
    kvb_err e;
    kvb_err_set(&e, KVB_ERR_CANCELLED, "shut down by this node");
    wire_conn_break(c, &e);
}

void kvb_conn_close(kvb_conn *c) {
    if (!c) return;
    c->backend->close(c->link);
    pthread_mutex_destroy(&c->broken_lock);
    free(c->rbuf.data);
    free(c);
}
