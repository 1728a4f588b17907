/* transport/transport_internal.h — little-endian byte access, the connection object shared by the
 * framing, connection and handshake files, and deadline helpers. Not part of the contract. */
#ifndef KVB_TRANSPORT_INTERNAL_H
#define KVB_TRANSPORT_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "kvb_transport.h"

static inline void wire_put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void wire_put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void wire_put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t wire_get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t wire_get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t wire_get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

struct sockaddr;
/* Splits "HOST:PORT" / "[V6]:PORT" into host ("" for none or "*") and port (tcp.c). */
kvb_status wire_parse_addr(const char *addr, char *host, size_t host_cap, char *port, size_t port_cap, kvb_err *err);
/* "IP:PORT" / "[IP6]:PORT" of an AF_INET / AF_INET6 address, "?" for others (tcp.c). */
void wire_format_sockaddr(const struct sockaddr *sa, char *buf, size_t cap);

/* Absolute deadline from a timeout; KVB_ERR_INVALID for timeout_ms < 1. */
kvb_status wire_deadline(int timeout_ms, double *deadline, kvb_err *err);
/* Milliseconds left until deadline for poll(): >= 0 (0 = expired), rounded up. */
int wire_ms_left(double deadline);

/* A thread's cancel flag (NULL: none), looked at by the backends' waits at least every
 * WIRE_CANCEL_POLL_MS: once it reads true, the wait fails with KVB_ERR_CANCELLED. The peer link's
 * thread sets it, so a dial to a silent peer is cut short when the link stops. */
#define WIRE_CANCEL_POLL_MS 20
void wire_set_thread_cancel(const atomic_bool *flag);
const atomic_bool *wire_thread_cancel(void);

struct kvb_listener {
    const kvb_wire_backend *backend;
    kvb_link_listener *link_listener;
    atomic_uint_fast64_t accepted, failed[KVB_HANDSHAKE_REASONS]; /* kvb_listener_stats */
};

struct kvb_conn {
    const kvb_wire_backend *backend;
    kvb_link *link;
    bool authenticated; /* set by the handshake, the only producer of kvb_conn for callers */
    kvb_hello mine, peer;
    uint64_t max_payload;
    uint32_t recv_allowed; /* bit (1 << type) for each frame type this node may receive */
    uint32_t send_allowed;
    kvb_wire_buf rbuf;
    atomic_bool broken;
    pthread_mutex_t broken_lock;
    char broken_msg[sizeof(((kvb_err *)0)->msg)];
    kvb_status broken_code; /* the first failure's, which later calls fail fast with */
    atomic_uint_fast64_t bytes_sent, frames_sent, bytes_received, frames_received;
    atomic_uint_fast64_t checksum_failures, protocol_errors, timeouts;
};

/* Connection object around a link (handshake state: nothing allowed yet). */
kvb_status wire_conn_new(const kvb_wire_backend *backend, kvb_link *link, kvb_conn **out, kvb_err *err);
/* Sends one frame of the given type (no role check); marks the connection broken on failure. */
kvb_status wire_conn_send(kvb_conn *c, uint16_t type, uint64_t request_id, const kvb_iov *iov, int n_iov,
                          double deadline, kvb_err *err);
/* Receives one frame whose type is in `allowed` (bits), payload <= max_payload, into buf (NULL:
 * the connection's own) or, with loan (NULL: never), lent by the backend (kvb_conn_recv_lend);
 * marks the connection broken (and counts) on any failure, a loan then returned. */
kvb_status wire_conn_recv(kvb_conn *c, uint32_t allowed, uint64_t max_payload, double deadline, kvb_wire_buf *buf,
                          kvb_wire_loan *loan, kvb_frame *out, kvb_err *err);
/* Records the first failure; later calls fail fast with it. */
void wire_conn_break(kvb_conn *c, const kvb_err *why);
void wire_count_failure(kvb_conn *c, const kvb_err *e);

#endif
