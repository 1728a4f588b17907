/* transport/ucx.c — the UCX backend (kvb_wire_backend_ucx, built only when CMake finds ucx through
 * pkg-config): the same frames as TCP over whatever UCX picks at run time (shared memory between
 * processes on one host, TCP, RDMA verbs where the host has them; UCX_TLS narrows the choice). One
 * process-wide ucp context; one worker per link, driven by the calling threads under the link's
 * lock (the sending and the receiving thread take turns at ucp_worker_progress), so every wait
 * honours its deadline and the thread's cancel flag. The handshake runs on the ucp stream API of
 * the connection manager's endpoint; once the peer proved the key, each side registers a receive
 * ring once (UCX allocates it, so shared-memory transports map it into the peer) and sends its
 * worker address, the ring's address and rkey; frames then move to an endpoint made from the
 * peer's worker address. Frame headers and small payloads go as IOV stream sends (no copy) and are
 * received with ucp_stream_recv_data_nb (copied once out of UCX's buffer; no receive request is
 * ever left pointing into a caller's buffer when a deadline passes). A payload from 64 KiB up to a
 * quarter of the peer's ring is put one-sided into the ring (ucp_put_nbx and a flush, posted
 * together: it has landed), and its header on the stream is the signal: both sides place payloads
 * in the ring by the same rule. A receiver that takes loans (kvb_conn_recv_lend) gets a view into
 * the ring, verified and committed from there, else a copy; the ring's room up to the oldest loan
 * still out goes back to the sender in credits (small tagged messages, every eighth of the ring,
 * sent without waiting by whichever thread progresses the link). Larger payloads, and every large
 * payload when all lanes are TCP (UCX 1.13 emulates puts there, slower than its rendezvous),
 * follow their header as tagged messages (UCX's rendezvous). Idle waits sleep in poll on the
 * workers' armed event fds. Why puts: a rendezvous completes only once the receiver has posted its
 * receive and pulled the bytes, so a sender whose send must finish before it returns (the backend
 * contract: the caller's K and V are reusable after send_frame) has one slab in flight and waits a
 * round trip per slab; into the ring it has up to a ring of slabs in flight and never waits for the
 * receiver while there is room. bench link on the shared 2-core box, 1 MiB slabs, alternated runs:
 * 22.9-23.3 GB/s through the ring against 20.6-22.0 tagged (over shared memory the rendezvous is
 * the receiver's own cma copy, so the two are close; over RDMA the ring saves the round trips).
 * What bounds it there is CPU: a put over shared memory is the sender's memcpy, and the receiver
 * must read every byte to verify it, which UCX's raw put (the ceiling bench link prints) never
 * does. Endpoints use peer error handling on the connection
 * manager's endpoint, kept open, so a peer that dies or closes is KVB_ERR_PEER_GONE: a killed
 * process at once (the kernel closes its sockets), a vanished host through UCX's keepalive (a
 * round every UCX_KEEPALIVE) and TCP's; a shutdown also sends a notice on the data endpoint. The listener
 * is a ucp_listener on its own worker; each accepted connection request gets a fresh worker. Which
 * transports (lanes) an endpoint actually selected is logged at connect/accept and kept for
 * /metrics and doctor (kvb_ucx_last_lanes): a silent fallback to TCP is visible. A trusted peer on
 * the same host could write anywhere in this process through cma (as it could through ptrace):
 * the ring's bounds are enforced by the rkey only on RDMA; for the same reason a lent view is
 * verified and committed in two reads of memory the peer could write between them (it never does
 * while the loan is out: its credits stop short of it). */
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>

#include "transport_internal.h"

#define UCX_ACCEPT_QUEUE 64
#define UCX_CLOSE_WAIT_S 1.0
#define UCX_ADDR_MAGIC "KVBUCXA1" /* 8 bytes before a worker address (ucx_authenticated) */
#define UCX_ADDR_MAX 65536
#define UCX_DATA_MAGIC "KVBUCXD1" /* the first 8 bytes each way on the data endpoint */
/* A payload this large (after the switch to the data endpoint) follows its header as a tagged
 * message (tag: the direction's count of such payloads), which UCX moves with its rendezvous
 * protocol — over shared memory one copy by the receiver (cma), instead of the stream's copies
 * through small FIFO slots. KVB_UCX_TAG_MIN (bytes; 0: never) overrides it for measurements; the
 * two sides use the larger of their two values (sent with the worker address). */
#define UCX_TAG_MIN_PAYLOAD (64u << 10)
/* The receive ring each side registers (once, at the switch to the data endpoint) and advertises
 * with its rkey: KVB_UCX_RING bytes (0: none, every large payload goes tagged), this by default.
 * Payloads from the tag threshold up to a quarter of the peer's ring are put into it. A ring that
 * stays in the caches is what makes both the put and the verification fast over shared memory:
 * bench link, 1 MiB slabs, the shared 2-core box under load, two runs of 3 rounds each (medians):
 * 4.5-5.1 GB/s with 8 MiB, 3.8-5.6 with 16, 2.4-3.8 with 32 (UCX's raw put into it: 10.8-13.6,
 * 8.4-11.6, 6.2-8.8); with 4 MiB a 1 MiB slab and its head exceed a quarter and go tagged. */
#define UCX_RING_BYTES (8u << 20)
#define UCX_RING_MAX (1u << 30)
#define UCX_CREDIT_TAG (1ull << 63) /* the tag of credit messages (payload tags count up from 0) */
#define UCX_BYE_TAG (UCX_CREDIT_TAG | 1) /* the tag of the 8-byte notice "this side shut the link" */
#define UCX_BYE_WAIT_S 0.2 /* how long ucx_shutdown progresses its workers for its notice and close */
/* Between keepalive rounds on the connection manager's endpoint (UCX's default is 20 s): a peer
 * whose host vanished without closing its sockets is UCS_ERR_ENDPOINT_TIMEOUT within a few rounds
 * rather than after a bridge's whole receive timeout. UCX_KEEPALIVE_INTERVAL set overrides it. */
#define UCX_KEEPALIVE "1s"
#define UCX_RKEY_MAX 65536
#define UCX_CM_PROGRESS_EVERY 64 /* see progress() */

/* Payloads lent out of one ring at once (kvb_conn_recv_lend); a receive past that copies. */
#define UCX_LOANS 64

typedef struct ucx_link ucx_link;
typedef struct {
    uint64_t id, end; /* the loan's id, and the ring's head just past its payload */
    bool back;        /* returned (it stays queued behind older loans still out) */
} ucx_loan;

/* This side's receive ring (allocated and registered by UCX: shared-memory transports can map it
 * into the peer, whose put is then one memcpy), shared by its link and the payloads lent out of
 * it, and freed when the link closed and the last loan came back: a view never dangles. Payloads
 * are placed in order (ring_place); `freed` passes a payload once it and every one before it were
 * copied out or given back, and the room up to `freed` goes back to the peer in credits. */
typedef struct {
    pthread_mutex_t mu;   /* all but freed's reads; taken before a link's lock, never after it */
    ucx_link *link;       /* NULL once the link closed */
    unsigned refs;        /* the link, and each loan out */
    ucp_mem_h mem;
    uint8_t *base;        // (bytes) bytes, written by the peer's puts
    uint64_t bytes;
    uint64_t head;        /* bytes of the ring's laps used so far (offsets mirror the sender's) */
    _Atomic uint64_t freed; /* of head, consumed: the figure the credits carry */
    ucx_loan out[UCX_LOANS];     /* the loans out, oldest first (a ring of out_n from out_first) */
    unsigned out_first, out_n;
    uint64_t next_id;
} ucx_ring;

struct ucx_link {
    kvb_link base;
    pthread_mutex_t lock; /* every ucp call on worker / ep */
    ucp_worker_h worker;    /* the connection manager's endpoint's */
    ucp_worker_h dworker;   /* the data endpoint's, once the worker addresses are exchanged */
    ucp_ep_h ep;            /* the data endpoint: the connection manager's until the worker addresses
                               are exchanged, then one made from the peer's worker address */
    ucp_ep_h cm_ep;         /* the connection manager's, kept open after the switch: it reports a peer
                               that dies or closes at once */
    bool cm_closed;               /* cm_ep closed by ucx_shutdown (its request: cm_close) */
    bool closing;                 /* ucx_close began: no more credits go out */
    unsigned cm_turn;             /* progress() calls, for progressing worker only now and then */
    ucs_status_ptr_t cm_close;
    atomic_bool failed;     /* the endpoint's error callback ran */
    ucs_status_t fail_status;
    atomic_bool shut;       /* shutdown: every wait ends */
    bool dead;              /* a send was abandoned mid-flight: the worker is never progressed again */
    uint8_t *chunk;         /* received stream data being consumed: (chunk_len) bytes, chunk_off used */
    size_t chunk_len, chunk_off;
    uint64_t send_tag, recv_tag; /* large payloads sent / received so far (their tags) */
    uint64_t tag_min;            /* payloads of this many bytes or more go tagged (UINT64_MAX: none) */
    ucx_ring *rx;          /* this side's receive ring, advertised: the peer puts payloads into it (NULL: none) */
    uint64_t rx_credited;  /* rx->freed as last reported to the peer */
    uint8_t credit_out[8]; /* the credit message in flight (credit_send): rx->freed, u64 */
    ucs_status_ptr_t credit_send;
    /* the peer's ring, this side's puts go there */
    ucp_rkey_h peer_rkey;
    uint64_t peer_ring_addr, peer_ring_bytes; /* peer_ring_bytes 0: none */
    uint64_t tx_head;      /* bytes of the peer's ring's laps used so far */
    uint64_t tx_freed;     /* of which the peer has consumed this many (its last credit) */
    bool ring_tx, ring_rx; /* payloads go into the peer's ring / come through this side's: agreed on
                              the data endpoint (not when puts would go over TCP, see ucx_authenticated) */
    ucs_status_ptr_t credit_req; /* the posted receive of the next credit (into credit_in) */
    uint8_t credit_in[8];
    ucs_status_ptr_t bye_req;    /* the posted receive of the peer's shutdown notice (into bye_in) */
    uint8_t bye_in[8], bye_out[8];
    atomic_bool peer_shut;       /* that notice arrived: the peer shut the link down */
    char lanes[256];
};

typedef struct {
    kvb_link_listener base;
    pthread_mutex_t lock;
    ucp_worker_h worker;
    ucp_listener_h listener;
    ucp_conn_request_h queue[UCX_ACCEPT_QUEUE]; /* connection requests not yet accepted */
    int q_head, q_n;
    char addr[96];
} ucx_listener;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static ucp_context_h g_ctx;
static ucs_status_t g_ctx_status;
static pthread_mutex_t g_lanes_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_last_lanes[256];

/* The process-wide context, created once and kept for the process's life (no ucp_cleanup: every
 * worker must be gone first, and a library cannot know when that is). */
static void ctx_init(void) {
    ucp_config_t *config = NULL;
    g_ctx_status = ucp_config_read(NULL, NULL, &config);
    if (g_ctx_status != UCS_OK) return;
    const char *ka = getenv("UCX_KEEPALIVE_INTERVAL");
    if ((!ka || !*ka) && ucp_config_modify(config, "KEEPALIVE_INTERVAL", UCX_KEEPALIVE) != UCS_OK)
        kvb_log(KVB_LOG_WARN, "ucx: this UCX has no KEEPALIVE_INTERVAL: a vanished peer is found by its default");
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                      .features = UCP_FEATURE_STREAM | UCP_FEATURE_TAG | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
                      .mt_workers_shared = 0};
    g_ctx_status = ucp_init(&p, config, &g_ctx);
    ucp_config_release(config);
}

static kvb_status get_ctx(const char *what, kvb_err *err) {
    pthread_once(&g_once, ctx_init);
    if (g_ctx_status != UCS_OK)
        return kvb_err_set(err, KVB_ERR_IO, "%s: UCX could not start: %s", what, ucs_status_string(g_ctx_status));
    return KVB_OK;
}

static kvb_status new_worker(ucp_worker_h *out, const char *what, kvb_err *err) {
    kvb_status st = get_ctx(what, err);
    if (st) return st;
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    ucs_status_t s = ucp_worker_create(g_ctx, &wp, out);
    if (s != UCS_OK) return kvb_err_set(err, KVB_ERR_IO, "%s: ucp_worker_create: %s", what, ucs_status_string(s));
    return KVB_OK;
}

/* Backs off while nothing happens (the listener): spins first, then yields, then sleeps up to
 * 200 us (waiting for a connection costs little CPU). */
static void idle_backoff(unsigned *idle) {
    unsigned n = (*idle)++;
    if (n < 512) return;
    if (n < 4096) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, n < 8192 ? 20000 : 200000};
    nanosleep(&ts, NULL);
}

/* Progresses the link's workers (the caller holds the lock). Once frames moved to the data
 * endpoint, the connection manager's worker only watches for a peer that dies or closes: it is
 * progressed every UCX_CM_PROGRESS_EVERY-th time. Its TCP interface makes each progress an
 * epoll_wait system call: progressed every time it took about 40 % of both sides' CPU time in the
 * slab stream (perf, 1 MiB slabs over shared memory). */
static void credit_maybe(ucx_link *u);
static unsigned progress(ucx_link *u) {
    unsigned n = 0;
    if (!u->cm_ep || u->cm_turn++ % UCX_CM_PROGRESS_EVERY == 0) n += ucp_worker_progress(u->worker);
    if (u->dworker) n += ucp_worker_progress(u->dworker);
    credit_maybe(u);
    return n;
}

/* Waits while nothing happens on the link: spins first (a stream in full flow), then yields, then
 * sleeps in poll on the workers' event fds, armed so that any event on them (a fragment, a
 * completion, a connection event) wakes it at once, at most WIRE_CANCEL_POLL_MS or until the
 * deadline (the caller then looks at its cancel flag and the deadline again). Where a worker cannot
 * be armed it sleeps as idle_backoff. UCX's TCP moves only when progressed: with fixed sleeps a
 * tagged flow over TCP lanes on loopback ran at 0.13-0.18 GB/s, never sleeping 0.35 (all of a
 * core), woken by the fds 0.17-0.19 (same load); over shared memory the two are level. The first
 * UCX_SHORT_SLEEPS sleeps of a wait last at most 1 ms: UCX 1.13's shared-memory transports wake a
 * sleeping peer through an abstract UNIX socket, which does not reach a peer in another network
 * namespace (sendto: ECONNREFUSED, seen between two namespaces sharing /dev/shm), where only the
 * timeout ends a sleep: with 20 ms sleeps some bench link rounds there fell from 20 GB/s to 0.4. */
#define UCX_SHORT_SLEEPS 1000
static void idle_wait(ucx_link *u, unsigned *idle, double deadline) {
    unsigned n = (*idle)++;
    if (n < 512) return;
    if (n < 4096) {
        sched_yield();
        return;
    }
    struct pollfd fds[2];
    nfds_t nf = 0;
    ucs_status_t s = UCS_ERR_UNSUPPORTED;
    pthread_mutex_lock(&u->lock);
    if (!u->dead) {
        ucp_worker_h w[2] = {u->worker, u->dworker};
        s = UCS_OK;
        for (int i = 0; i < 2 && w[i] && s == UCS_OK; i++) {
            int fd = -1;
            s = ucp_worker_get_efd(w[i], &fd);
            if (s == UCS_OK) s = ucp_worker_arm(w[i]);
            if (s == UCS_OK) fds[nf++] = (struct pollfd){.fd = fd, .events = POLLIN};
        }
    }
    pthread_mutex_unlock(&u->lock);
    if (s == UCS_ERR_BUSY) return; /* events are waiting: progress again */
    if (s != UCS_OK) {
        idle_backoff(idle);
        return;
    }
    const int cap = n < 4096 + UCX_SHORT_SLEEPS ? 1 : WIRE_CANCEL_POLL_MS, ms = wire_ms_left(deadline);
    poll(fds, nf, ms < cap ? ms : cap);
}

/* Why a wait must end now (KVB_OK: it may go on). */
static kvb_status wait_check(ucx_link *u, double deadline, const char *what, kvb_err *err) {
    const atomic_bool *cancel = wire_thread_cancel();
    if (atomic_load(&u->shut))
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "%s %s: the connection was shut down", what, u->base.peer_addr);
    if (atomic_load(&u->failed))
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "%s %s: the peer is gone (%s)", what, u->base.peer_addr,
                           ucs_status_string(u->fail_status));
    if (atomic_load(&u->peer_shut))
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "%s %s: the peer shut the connection down", what, u->base.peer_addr);
    if (cancel && atomic_load(cancel)) return kvb_err_set(err, KVB_ERR_CANCELLED, "%s %s: cancelled", what, u->base.peer_addr);
    if (wire_ms_left(deadline) == 0) return kvb_err_set(err, KVB_ERR_TIMEOUT, "%s %s: timed out", what, u->base.peer_addr);
    return KVB_OK;
}

static void ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    ucx_link *u = arg;
    u->fail_status = status;
    atomic_store(&u->failed, true);
}

/* Waits for a request (NULL: done at once; an error pointer: failed) under the link's lock, taken
 * and released around each progress so the other direction's thread gets its turns. On a deadline
 * or a failure the request is released and, for a send, the link is marked dead (the request may
 * still read the caller's memory: the worker is never progressed again). */
static kvb_status wait_request(ucx_link *u, ucs_status_ptr_t req, bool is_send, double deadline, const char *what,
                               kvb_err *err) {
    if (req == NULL) return KVB_OK;
    if (UCS_PTR_IS_ERR(req))
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "%s %s: %s", what, u->base.peer_addr,
                           ucs_status_string(UCS_PTR_STATUS(req)));
    unsigned idle = 0;
    for (;;) {
        pthread_mutex_lock(&u->lock);
        unsigned n = u->dead ? 0 : progress(u);
        ucs_status_t s = ucp_request_check_status(req);
        if (s != UCS_INPROGRESS) {
            ucp_request_free(req);
            pthread_mutex_unlock(&u->lock);
            if (s == UCS_OK) return KVB_OK;
            /* a tagged payload longer than its header said */
            kvb_status code = s == UCS_ERR_MESSAGE_TRUNCATED ? KVB_ERR_FORMAT : KVB_ERR_PEER_GONE;
            return kvb_err_set(err, code, "%s %s: %s", what, u->base.peer_addr, ucs_status_string(s));
        }
        kvb_status st = u->dead ? kvb_err_set(err, KVB_ERR_PEER_GONE, "%s %s: the connection failed earlier", what,
                                              u->base.peer_addr)
                                : wait_check(u, deadline, what, err);
        if (st) {
            if (!is_send && !u->dead) { /* cancelled, and then completed, it writes nothing more */
                ucp_request_cancel(u->dworker ? u->dworker : u->worker, req);
                double until = kvb_now_s() + UCX_CLOSE_WAIT_S;
                while (ucp_request_check_status(req) == UCS_INPROGRESS && kvb_now_s() < until) progress(u);
                if (ucp_request_check_status(req) == UCS_INPROGRESS) u->dead = true;
            } else {
                u->dead = true;
            }
            ucp_request_free(req);
            pthread_mutex_unlock(&u->lock);
            return st;
        }
        pthread_mutex_unlock(&u->lock);
        if (n) idle = 0;
        else idle_wait(u, &idle, deadline);
    }
}

/* "posix/memory sysv/memory cma/memory" — the distinct transport/device pairs of the endpoint's lanes,
 * read from ucp_ep_print_info (UCX has no query for them in 1.13); KVB_UCX_DEBUG set prints that
 * whole report (protocols and thresholds too) on stderr. */
static void describe_lanes(ucp_ep_h ep, char *out, size_t cap) {
    char *text = NULL;
    size_t len = 0;
    out[0] = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return;
    ucp_ep_print_info(ep, f);
    fclose(f);
    if (getenv("KVB_UCX_DEBUG")) fputs(text, stderr);
    size_t off = 0;
    for (char *p = text; p && (p = strstr(p, "lane[")) != NULL; p++) {
        char *colon = strstr(p, "]:");
        if (!colon) break;
        char *s = colon + 2;
        while (*s == ' ') s++;
        while (*s >= '0' && *s <= '9') s++; /* resource index "8:" */
        if (*s == ':') s++;
        size_t n = strcspn(s, " \n");
        if (n == 0 || n >= 64 || !memchr(s, '/', n)) continue; /* "cm rdmacm": the connection manager */
        char tok[64];
        memcpy(tok, s, n);
        tok[n] = 0;
        if (strstr(out, tok)) continue; /* several lanes on one transport */
        int w = snprintf(out + off, cap - off, "%s%s", off ? " " : "", tok);
        if (w < 0 || (size_t)w >= cap - off) break;
        off += (size_t)w;
    }
    free(text);
    if (!out[0]) snprintf(out, cap, "unknown");
}

/* Records the endpoint's lanes (log line, and the last ones for /metrics and doctor). */
static void note_lanes(ucx_link *u, const char *how) {
    pthread_mutex_lock(&u->lock);
    describe_lanes(u->ep, u->lanes, sizeof u->lanes);
    pthread_mutex_unlock(&u->lock);
    pthread_mutex_lock(&g_lanes_lock);
    snprintf(g_last_lanes, sizeof g_last_lanes, "%s", u->lanes);
    pthread_mutex_unlock(&g_lanes_lock);
    kvb_log(KVB_LOG_INFO, "ucx: %s %s over %s", how, u->base.peer_addr, u->lanes);
}

void kvb_ucx_last_lanes(char *buf, size_t cap) {
    pthread_mutex_lock(&g_lanes_lock);
    snprintf(buf, cap, "%s", g_last_lanes[0] ? g_last_lanes : "none yet");
    pthread_mutex_unlock(&g_lanes_lock);
}

static void ucx_describe(kvb_link *base, char *buf, size_t cap) {
    ucx_link *u = (ucx_link *)base;
    pthread_mutex_lock(&u->lock);
    if (!u->dead) describe_lanes(u->ep, u->lanes, sizeof u->lanes);
    pthread_mutex_unlock(&u->lock);
    snprintf(buf, cap, "ucx %s%s", u->lanes, u->ring_tx ? ", large payloads put into the peer's ring" : "");
}

/* A link around a fresh worker; its endpoint is created by the caller with ep_params. */
static kvb_status link_new(ucp_ep_params_t *ep_params, const char *peer, const char *what, ucx_link **out, kvb_err *err) {
    ucx_link *u = calloc(1, sizeof *u);
    if (!u) return kvb_err_set(err, KVB_ERR_NOMEM, "%s: out of memory", what);
    u->base.backend = &kvb_wire_backend_ucx;
    snprintf(u->base.peer_addr, sizeof u->base.peer_addr, "%s", peer);
    pthread_mutex_init(&u->lock, NULL);
    kvb_status st = new_worker(&u->worker, what, err);
    if (st) {
        pthread_mutex_destroy(&u->lock);
        free(u);
        return st;
    }
    ep_params->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params->err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params->err_handler = (ucp_err_handler_t){.cb = ep_error_cb, .arg = u};
    ucs_status_t s = ucp_ep_create(u->worker, ep_params, &u->ep);
    if (s != UCS_OK) {
        ucp_worker_destroy(u->worker);
        pthread_mutex_destroy(&u->lock);
        free(u);
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "%s %s: %s", what, peer, ucs_status_string(s));
    }
    *out = u;
    return KVB_OK;
}

/* Waits until the endpoint is wired up (a flush completes only then): a peer that is not there
 * fails here, not at the first frame. */
static kvb_status wait_wired(ucx_link *u, double deadline, const char *what, kvb_err *err) {
    ucp_request_param_t rp = {.op_attr_mask = 0};
    pthread_mutex_lock(&u->lock);
    ucs_status_ptr_t req = ucp_ep_flush_nbx(u->ep, &rp);
    pthread_mutex_unlock(&u->lock);
    return wait_request(u, req, false, deadline, what, err);
}

static void ucx_close(kvb_link *base);
static void ucx_listener_close(kvb_link_listener *base);

static kvb_status ucx_connect(const char *addr, double deadline, kvb_link **out, kvb_err *err) {
    char host[256], port[8];
    kvb_status st = wire_parse_addr(addr, host, sizeof host, port, sizeof port, err);
    if (st) return st;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int gai = getaddrinfo(host[0] ? host : "localhost", port, &hints, &res);
    if (gai) return kvb_err_set(err, KVB_ERR_PEER_GONE, "connect to %s: %s", addr, gai_strerror(gai));
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR,
                          .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                          .sockaddr = {.addr = res->ai_addr, .addrlen = res->ai_addrlen}};
    ucx_link *u = NULL;
    st = link_new(&ep, addr, "connect to", &u, err);
    freeaddrinfo(res);
    if (st) return st;
    st = wait_wired(u, deadline, "connect to", err);
    if (st) {
        ucx_close(&u->base);
        return st;
    }
    note_lanes(u, "connected to");
    *out = &u->base;
    return KVB_OK;
}

static void conn_handler(ucp_conn_request_h req, void *arg) {
    ucx_listener *l = arg; /* called from progress, under l->lock */
    if (l->q_n == UCX_ACCEPT_QUEUE) {
        ucp_listener_reject(l->listener, req);
        return;
    }
    l->queue[(l->q_head + l->q_n++) % UCX_ACCEPT_QUEUE] = req;
}

static kvb_status ucx_listen(const char *addr, kvb_link_listener **out, kvb_err *err) {
    char host[256], port[8];
    kvb_status st = wire_parse_addr(addr, host, sizeof host, port, sizeof port, err);
    if (st) return st;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *res = NULL;
    int gai = getaddrinfo(host[0] ? host : NULL, port, &hints, &res);
    if (gai) return kvb_err_set(err, KVB_ERR_IO, "listen on %s: %s", addr, gai_strerror(gai));
    ucx_listener *l = calloc(1, sizeof *l);
    if (!l) {
        freeaddrinfo(res);
        return kvb_err_set(err, KVB_ERR_NOMEM, "listen on %s: out of memory", addr);
    }
    pthread_mutex_init(&l->lock, NULL);
    snprintf(l->addr, sizeof l->addr, "%s", addr);
    st = new_worker(&l->worker, "listen on", err);
    ucs_status_t s = UCS_OK;
    if (!st) {
        ucp_listener_params_t lp = {.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
                                    .sockaddr = {.addr = res->ai_addr, .addrlen = res->ai_addrlen},
                                    .conn_handler = {.cb = conn_handler, .arg = l}};
        s = ucp_listener_create(l->worker, &lp, &l->listener);
        if (s != UCS_OK) st = kvb_err_set(err, KVB_ERR_IO, "listen on %s: %s", addr, ucs_status_string(s));
    }
    freeaddrinfo(res);
    ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    if (!st && (s = ucp_listener_query(l->listener, &la)) != UCS_OK)
        st = kvb_err_set(err, KVB_ERR_IO, "listen on %s: ucp_listener_query: %s", addr, ucs_status_string(s));
    if (st) {
        ucx_listener_close(&l->base);
        return st;
    }
    const struct sockaddr *sa = (const struct sockaddr *)&la.sockaddr;
    l->base.port = ntohs(sa->sa_family == AF_INET6 ? ((const struct sockaddr_in6 *)sa)->sin6_port
                                                   : ((const struct sockaddr_in *)sa)->sin_port);
    l->base.backend = &kvb_wire_backend_ucx;
    *out = &l->base;
    return KVB_OK;
}

static kvb_status ucx_accept(kvb_link_listener *base, double deadline, kvb_link **out, kvb_err *err) {
    ucx_listener *l = (ucx_listener *)base;
    const atomic_bool *cancel = wire_thread_cancel();
    unsigned idle = 0;
    for (;;) {
        pthread_mutex_lock(&l->lock);
        unsigned n = ucp_worker_progress(l->worker);
        ucp_conn_request_h req = NULL;
        if (l->q_n) {
            req = l->queue[l->q_head];
            l->q_head = (l->q_head + 1) % UCX_ACCEPT_QUEUE;
            l->q_n--;
        }
        pthread_mutex_unlock(&l->lock);
        if (req) {
            char peer[96] = "?";
            ucp_conn_request_attr_t ca = {.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR};
            if (ucp_conn_request_query(req, &ca) == UCS_OK)
                wire_format_sockaddr((const struct sockaddr *)&ca.client_address, peer, sizeof peer);
            ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST, .conn_request = req};
            ucx_link *u = NULL;
            kvb_status st = link_new(&ep, peer, "accept from", &u, err);
            if (st) return st;
            st = wait_wired(u, deadline, "accept from", err);
            if (st) {
                ucx_close(&u->base);
                return st;
            }
            note_lanes(u, "accepted");
            *out = &u->base;
            return KVB_OK;
        }
        if (cancel && atomic_load(cancel)) return kvb_err_set(err, KVB_ERR_CANCELLED, "accept on %s: cancelled", l->addr);
        if (wire_ms_left(deadline) == 0)
            return kvb_err_set(err, KVB_ERR_TIMEOUT, "waiting for a connection on %s: timed out", l->addr);
        if (n) idle = 0;
        else idle_backoff(&idle);
    }
}

static void ucx_listener_close(kvb_link_listener *base) {
    if (!base) return;
    ucx_listener *l = (ucx_listener *)base;
    if (l->listener) {
        for (; l->q_n; l->q_n--, l->q_head = (l->q_head + 1) % UCX_ACCEPT_QUEUE)
            ucp_listener_reject(l->listener, l->queue[l->q_head]);
        ucp_listener_destroy(l->listener);
    }
    if (l->worker) ucp_worker_destroy(l->worker);
    pthread_mutex_destroy(&l->lock);
    free(l);
}

/* Sends the pieces as one stream send on the data endpoint and waits for it. */
static kvb_status send_iov(ucx_link *u, ucp_dt_iov_t *v, size_t nv, double deadline, kvb_err *err) {
    kvb_status st = wait_check(u, deadline, "send to", err);
    if (st) return st;
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE, .datatype = ucp_dt_make_iov()};
    pthread_mutex_lock(&u->lock);
    if (u->dead) {
        pthread_mutex_unlock(&u->lock);
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "send to %s: the connection failed earlier", u->base.peer_addr);
    }
    ucs_status_ptr_t req = ucp_stream_send_nbx(u->ep, v, nv, &rp);
    pthread_mutex_unlock(&u->lock);
    return wait_request(u, req, true, deadline, "send to", err);
}

/* ---- the receive ring: payloads put by the sender, signalled by their frame header ---- */

/* Where a payload of n bytes goes in a ring of cap bytes whose laps are used up to *head: at *head,
 * or at the start of the next lap when it would not fit before the ring's end (the rest of the lap
 * is skipped). Both sides run it, so the frame header alone tells the receiver where its payload
 * is. Returns the payload's offset counted over all laps and moves *head past it. */
static uint64_t ring_place(uint64_t *head, uint64_t cap, uint64_t n) {
    uint64_t pos = *head % cap;
    if (pos + n > cap) *head += cap - pos;
    uint64_t at = *head;
    *head += n;
    return at;
}

/* Whether a payload of n bytes goes through a ring of ring_bytes: from the tag threshold up to a
 * quarter of the ring. With credits sent every eighth of the ring, a sender whose receiver has
 * consumed everything always finds room (> 7/8 of the ring free, a payload and its skip < 1/2). */
static bool ring_carries(uint64_t ring_bytes, uint64_t tag_min, uint64_t n) {
    return ring_bytes && n >= tag_min && n <= ring_bytes / 4;
}

/* Posts the receive of the next credit (the caller holds the lock). */
static void credit_post(ucx_link *u) {
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL};
    u->credit_req = ucp_tag_recv_nbx(u->dworker, u->credit_in, sizeof u->credit_in, UCX_CREDIT_TAG, UINT64_MAX, &rp);
    if (UCS_PTR_IS_ERR(u->credit_req)) u->credit_req = NULL;
}

/* The peer's shutdown notice arrived (run inside ucp_worker_progress, under the link's lock). */
static void bye_cb(void *req, ucs_status_t status, const ucp_tag_recv_info_t *info, void *arg) {
    (void)req;
    (void)info;
    if (status == UCS_OK) atomic_store(&((ucx_link *)arg)->peer_shut, true);
}

/* Posts the receive of the peer's shutdown notice, once (the caller holds the lock). */
static void bye_post(ucx_link *u) {
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL | UCP_OP_ATTR_FIELD_CALLBACK |
                                              UCP_OP_ATTR_FIELD_USER_DATA,
                              .cb.recv = bye_cb,
                              .user_data = u};
    u->bye_req = ucp_tag_recv_nbx(u->dworker, u->bye_in, sizeof u->bye_in, UCX_BYE_TAG, UINT64_MAX, &rp);
    if (UCS_PTR_IS_ERR(u->bye_req)) u->bye_req = NULL;
}

/* Takes in the credits that have arrived (the caller holds the lock): the peer's consumed mark,
 * which only moves forward and never past what was put. */
static void credit_poll(ucx_link *u) {
    while (u->credit_req) {
        ucs_status_t s = ucp_request_check_status(u->credit_req);
        if (s == UCS_INPROGRESS) return;
        ucp_request_free(u->credit_req);
        u->credit_req = NULL;
        if (s != UCS_OK) return;
        uint64_t c = wire_get_u64(u->credit_in);
        if (c > u->tx_freed && c <= u->tx_head) u->tx_freed = c;
        credit_post(u);
    }
}

/* Tells the peer how far this side has consumed its ring, once an eighth of it was consumed since
 * the last credit and the last credit's send is done (the caller holds the lock). A credit owed
 * while the last one is still on its way goes with a later call: every progress() makes one. */
static void credit_maybe(ucx_link *u) {
    if (!u->rx || !u->ring_rx || !u->cm_ep || u->dead || u->closing) return;
    if (u->credit_send) {
        if (ucp_request_check_status(u->credit_send) == UCS_INPROGRESS) return;
        ucp_request_free(u->credit_send);
        u->credit_send = NULL;
    }
    const uint64_t freed = atomic_load(&u->rx->freed);
    if (freed - u->rx_credited < u->rx->bytes / 8) return;
    wire_put_u64(u->credit_out, freed);
    ucp_request_param_t rp = {.op_attr_mask = 0};
    ucs_status_ptr_t req = ucp_tag_send_nbx(u->ep, u->credit_out, sizeof u->credit_out, UCX_CREDIT_TAG, &rp);
    if (UCS_PTR_IS_ERR(req)) return; /* the endpoint failed: every wait says so */
    u->rx_credited = freed;
    u->credit_send = req;
}

/* The ring's consumed mark moved (the caller holds r->mu): a credit when one is due, and a wake-up
 * for a thread sleeping on the link when it could not go yet. */
static void ring_credit(ucx_ring *r) {
    ucx_link *u = r->link;
    if (!u) return;
    pthread_mutex_lock(&u->lock);
    credit_maybe(u);
    if (u->credit_send && u->dworker && !u->dead) ucp_worker_signal(u->dworker);
    pthread_mutex_unlock(&u->lock);
}

/* Drops a reference (the caller holds r->mu, released here); the last one unmaps the ring. */
static void ring_unref(ucx_ring *r) {
    const bool last = --r->refs == 0;
    pthread_mutex_unlock(&r->mu);
    if (!last) return;
    ucp_mem_unmap(g_ctx, r->mem);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* A payload of the ring up to head `end` is consumed (the caller holds r->mu): behind the loans
 * still out, it is freed with the last of them; else at once. */
static void ring_consumed(ucx_ring *r, uint64_t end) {
    if (r->out_n) r->out[(r->out_first + r->out_n - 1) % UCX_LOANS].end = end;
    else atomic_store(&r->freed, end);
}

/* kvb_wire_loan's give_back: the loan's payload is consumed; the ring's room goes back to the
 * sender once every earlier payload is consumed too. */
static void ring_give_back(void *owner, uint64_t id) {
    ucx_ring *r = owner;
    pthread_mutex_lock(&r->mu);
    for (unsigned i = 0; i < r->out_n; i++)
        if (r->out[(r->out_first + i) % UCX_LOANS].id == id) r->out[(r->out_first + i) % UCX_LOANS].back = true;
    const uint64_t was = atomic_load(&r->freed);
    while (r->out_n && r->out[r->out_first].back) {
        atomic_store(&r->freed, r->out[r->out_first].end);
        r->out_first = (r->out_first + 1) % UCX_LOANS;
        r->out_n--;
    }
    if (atomic_load(&r->freed) != was) ring_credit(r);
    ring_unref(r);
}

/* Waits for room for n bytes in the peer's ring and claims it: *at, counted over all laps. */
static kvb_status ring_claim(ucx_link *u, uint64_t n, uint64_t *at, double deadline, kvb_err *err) {
    unsigned idle = 0;
    for (;;) {
        pthread_mutex_lock(&u->lock);
        unsigned k = u->dead ? 0 : progress(u);
        credit_poll(u);
        uint64_t head = u->tx_head, where = ring_place(&head, u->peer_ring_bytes, n);
        const bool room = head - u->tx_freed <= u->peer_ring_bytes;
        if (room) {
            u->tx_head = head;
            *at = where;
        }
        pthread_mutex_unlock(&u->lock);
        if (room) return KVB_OK;
        kvb_status st = u->dead ? kvb_err_set(err, KVB_ERR_PEER_GONE, "send to %s: the connection failed earlier",
                                              u->base.peer_addr)
                                : wait_check(u, deadline, "send to", err);
        if (st) return kvb_err_prefix(err, "waiting for room in the peer's receive ring: ");
        if (k) idle = 0;
        else idle_wait(u, &idle, deadline);
    }
}

/* Puts the pieces back to back at byte off of the peer's ring and waits until each may be reused;
 * with flush, the flush is posted with them and waited for first (one wait while they are all in
 * flight): then all of them have landed, which the header sent after them promises. */
static kvb_status ring_put(ucx_link *u, const ucp_dt_iov_t *v, size_t nv, uint64_t off, bool flush, double deadline,
                           kvb_err *err) {
    ucs_status_ptr_t req[4], f = NULL;
    ucp_request_param_t rp = {.op_attr_mask = 0};
    if (nv > 4) return kvb_err_set(err, KVB_ERR_INVALID, "put: %zu pieces (at most 4)", nv);
    pthread_mutex_lock(&u->lock);
    for (size_t i = 0; i < nv; off += v[i].length, i++)
        req[i] = u->dead ? UCS_STATUS_PTR(UCS_ERR_CANCELED)
                         : ucp_put_nbx(u->ep, v[i].buffer, v[i].length, u->peer_ring_addr + off, u->peer_rkey, &rp);
    if (flush) f = u->dead ? UCS_STATUS_PTR(UCS_ERR_CANCELED) : ucp_ep_flush_nbx(u->ep, &rp);
    pthread_mutex_unlock(&u->lock);
    kvb_status st = wait_request(u, f, true, deadline, "put to", err);
    for (size_t i = 0; i < nv; i++) {
        if (!st) st = wait_request(u, req[i], true, deadline, "put to", err);
        else if (req[i] && !UCS_PTR_IS_ERR(req[i])) { /* it may still read the caller's memory */
            pthread_mutex_lock(&u->lock);
            u->dead = true;
            ucp_request_free(req[i]);
            pthread_mutex_unlock(&u->lock);
        }
    }
    return st;
}

/* A payload through the peer's ring: claimed room, the pieces put and flushed, then the header
 * on the stream as the signal (the receiver finds the payload where ring_place says). */
static kvb_status send_ring(ucx_link *u, const ucp_dt_iov_t *v, size_t nv, uint64_t total, double deadline,
                            kvb_err *err) {
    uint64_t at = 0;
    kvb_status st = ring_claim(u, total, &at, deadline, err);
    if (!st) st = ring_put(u, v + 1, nv - 1, at % u->peer_ring_bytes, true, deadline, err);
    return st ? st : send_iov(u, (ucp_dt_iov_t *)v, 1, deadline, err);
}

/* The payload of a header just received, out of this side's ring: lent (a view into the ring, its
 * room and everything after it held back from the sender until the loan is returned) when the
 * caller takes loans and fewer than UCX_LOANS are out; else copied into buf, its slot free once
 * the loans before it are back. */
static kvb_status recv_ring(ucx_link *u, uint64_t n, kvb_wire_buf *buf, kvb_wire_loan *loan, kvb_err *err) {
    ucx_ring *r = u->rx;
    pthread_mutex_lock(&r->mu);
    const uint64_t at = ring_place(&r->head, r->bytes, n), end = r->head;
    const uint8_t *src = r->base + at % r->bytes;
    if (loan && r->out_n < UCX_LOANS) {
        const uint64_t id = ++r->next_id;
        r->out[(r->out_first + r->out_n++) % UCX_LOANS] = (ucx_loan){.id = id, .end = end};
        r->refs++;
        *loan = (kvb_wire_loan){.data = src, .give_back = ring_give_back, .owner = r, .id = id};
        pthread_mutex_unlock(&r->mu);
        return KVB_OK;
    }
    pthread_mutex_unlock(&r->mu); /* only this thread places payloads: the slot is this call's */
    kvb_status st = kvb_wire_buf_reserve(buf, (size_t)n, err);
    if (!st) memcpy(buf->data, src, n);
    pthread_mutex_lock(&r->mu);
    ring_consumed(r, end);
    ring_credit(r);
    pthread_mutex_unlock(&r->mu);
    return st;
}

kvb_status kvb_conn_ucx_raw_put(kvb_conn *c, const uint8_t *data, size_t piece, uint64_t bytes, int timeout_ms,
                                kvb_err *err) {
    double deadline;
    kvb_status st = wire_deadline(timeout_ms, &deadline, err);
    if (st) return st;
    if (!c || c->backend != &kvb_wire_backend_ucx || !c->authenticated)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "raw put: not an authenticated UCX connection");
    ucx_link *u = (ucx_link *)c->link;
    if (!u->peer_ring_bytes || piece == 0 || piece > u->peer_ring_bytes)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "raw put: %s advertised no receive ring of %zu bytes or more",
                           u->base.peer_addr, piece);
    uint64_t off = 0;
    for (uint64_t sent = 0; !st && sent < bytes; sent += piece) {
        ucp_dt_iov_t v = {(void *)data, (size_t)KVB_MIN(bytes - sent, piece)};
        if (off + v.length > u->peer_ring_bytes) off = 0;
        st = ring_put(u, &v, 1, off, sent + v.length >= bytes, deadline, err);
        off += v.length;
    }
    return st;
}

static kvb_status ucx_send_frame(kvb_link *base, const uint8_t header[KVB_WIRE_HEADER_BYTES], const kvb_iov *iov,
                                 int n_iov, double deadline, kvb_err *err) {
    if (n_iov < 0 || n_iov > 3) return kvb_err_set(err, KVB_ERR_INVALID, "send: %d payload pieces (at most 3)", n_iov);
    ucx_link *u = (ucx_link *)base;
    ucp_dt_iov_t v[4];
    size_t nv = 0;
    uint64_t total = 0;
    v[nv++] = (ucp_dt_iov_t){.buffer = (void *)header, .length = KVB_WIRE_HEADER_BYTES};
    for (int i = 0; i < n_iov; i++)
        if (iov[i].len) {
            v[nv++] = (ucp_dt_iov_t){.buffer = (void *)iov[i].data, .length = iov[i].len};
            total += iov[i].len;
        }
    if (!u->cm_ep || total < u->tag_min) return send_iov(u, v, nv, deadline, err);
    if (ring_carries(u->ring_tx ? u->peer_ring_bytes : 0, u->tag_min, total))
        return send_ring(u, v, nv, total, deadline, err);
    kvb_status st = send_iov(u, v, 1, deadline, err); /* the header on the stream, then the payload */
    if (st) return st;
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE, .datatype = ucp_dt_make_iov()};
    pthread_mutex_lock(&u->lock);
    ucs_status_ptr_t req = u->dead ? UCS_STATUS_PTR(UCS_ERR_CANCELED)
                                   : ucp_tag_send_nbx(u->ep, v + 1, nv - 1, u->send_tag++, &rp);
    pthread_mutex_unlock(&u->lock);
    return wait_request(u, req, true, deadline, "send to", err);
}

/* Receives a large payload's tagged message into dst (exactly n bytes). */
static kvb_status recv_tagged(ucx_link *u, uint8_t *dst, size_t n, double deadline, const char *what, kvb_err *err) {
    ucp_tag_recv_info_t info = {0};
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO, .recv_info = {.tag_info = &info}};
    pthread_mutex_lock(&u->lock);
    ucs_status_ptr_t req = u->dead ? UCS_STATUS_PTR(UCS_ERR_CANCELED)
                                   : ucp_tag_recv_nbx(u->dworker, dst, n, u->recv_tag++, UINT64_MAX, &rp);
    pthread_mutex_unlock(&u->lock);
    if (req && !UCS_PTR_IS_ERR(req)) { /* learn the length before wait_request frees the request */
        unsigned idle = 0;
        for (;;) {
            pthread_mutex_lock(&u->lock);
            unsigned k = u->dead ? 0 : progress(u);
            ucs_status_t s = ucp_tag_recv_request_test(req, &info);
            pthread_mutex_unlock(&u->lock);
            if (s != UCS_INPROGRESS || wait_check(u, deadline, "receive from", err) != KVB_OK) break;
            if (k) idle = 0;
            else idle_wait(u, &idle, deadline);
        }
    }
    kvb_status st = wait_request(u, req, false, deadline, "receive from", err);
    if (st) {
        kvb_err_prefix(err, "%s payload: ", what);
        return st;
    }
    if (info.length != n)
        return kvb_err_set(err, KVB_ERR_FORMAT, "receive from %s: the %s payload came as %zu bytes, its header says %zu",
                           u->base.peer_addr, what, info.length, n);
    return KVB_OK;
}

/* Copies exactly n received bytes into dst, from the chunk in hand and then from UCX's own
 * buffers as they arrive (data that arrived before the peer went away is still delivered). */
static kvb_status recv_exact(ucx_link *u, uint8_t *dst, size_t n, double deadline, const char *what, kvb_err *err) {
    size_t got = 0;
    unsigned idle = 0;
    while (got < n) {
        pthread_mutex_lock(&u->lock);
        if (u->chunk) {
            size_t take = KVB_MIN(n - got, u->chunk_len - u->chunk_off);
            memcpy(dst + got, u->chunk + u->chunk_off, take);
            got += take;
            u->chunk_off += take;
            if (u->chunk_off == u->chunk_len) {
                ucp_stream_data_release(u->ep, u->chunk);
                u->chunk = NULL;
            }
            pthread_mutex_unlock(&u->lock);
            idle = 0;
            continue;
        }
        unsigned progressed = u->dead ? 0 : progress(u);
        size_t len = 0;
        ucs_status_ptr_t p = u->dead ? NULL : ucp_stream_recv_data_nb(u->ep, &len);
        if (p && !UCS_PTR_IS_ERR(p)) {
            u->chunk = p;
            u->chunk_len = len;
            u->chunk_off = 0;
        }
        pthread_mutex_unlock(&u->lock);
        if (UCS_PTR_IS_ERR(p))
            return kvb_err_set(err, KVB_ERR_PEER_GONE, "receive from %s: %s (%s, %zu of %zu bytes)", u->base.peer_addr,
                               ucs_status_string(UCS_PTR_STATUS(p)), what, got, n);
        if (p) continue;
        if (u->dead)
            return kvb_err_set(err, KVB_ERR_PEER_GONE, "receive from %s: the connection failed earlier", u->base.peer_addr);
        kvb_status st = wait_check(u, deadline, "receive from", err);
        if (st) {
            if (st == KVB_ERR_TIMEOUT || st == KVB_ERR_PEER_GONE) {
                kvb_err e = *err;
                return kvb_err_set(err, st, "%s (%s, %zu of %zu bytes)", e.msg, what, got, n);
            }
            return st;
        }
        if (progressed) idle = 0;
        else idle_wait(u, &idle, deadline);
    }
    return KVB_OK;
}

static kvb_status ucx_recv_frame(kvb_link *base, uint64_t max_payload, kvb_frame_header *hdr, kvb_wire_buf *buf,
                                 kvb_wire_loan *loan, double deadline, kvb_err *err) {
    ucx_link *u = (ucx_link *)base;
    uint8_t h[KVB_WIRE_HEADER_BYTES];
    kvb_status st = recv_exact(u, h, sizeof h, deadline, "frame header", err);
    if (st) return st;
    st = kvb_wire_header_decode(h, max_payload, hdr, err);
    if (st) return st;
    if (hdr->payload_len > SIZE_MAX) return kvb_err_set(err, KVB_ERR_RANGE, "payload does not fit in memory");
    if (u->cm_ep && ring_carries(u->ring_rx ? u->rx->bytes : 0, u->tag_min, hdr->payload_len))
        return recv_ring(u, hdr->payload_len, buf, loan, err);
    st = kvb_wire_buf_reserve(buf, (size_t)hdr->payload_len, err); /* only after the length passed the limit */
    if (st) return st;
    if (u->cm_ep && hdr->payload_len >= u->tag_min)
        return recv_tagged(u, buf->data, (size_t)hdr->payload_len, deadline, kvb_frame_type_name(hdr->type), err);
    return recv_exact(u, buf->data, (size_t)hdr->payload_len, deadline, kvb_frame_type_name(hdr->type), err);
}

/* A byte count from the environment (name unset or empty: def; above max or not a number: def, with
 * a warning). KVB_UCX_TAG_MIN (0: nothing tagged) and KVB_UCX_RING (0: no ring) are for
 * measurements: each path can be timed on its own. */
static uint64_t env_bytes(const char *name, uint64_t def, uint64_t max) {
    const char *e = getenv(name);
    if (!e || !*e) return def;
    char *end = NULL;
    unsigned long long v = strtoull(e, &end, 10);
    if (*end || v > max) {
        kvb_log(KVB_LOG_WARN, "ucx: %s=\"%s\" is not a byte count up to %llu: using %llu", name, e,
                (unsigned long long)max, (unsigned long long)def);
        return def;
    }
    return v;
}

/* This side's receive ring (KVB_UCX_RING bytes, UCX_RING_BYTES unless set; 0: none), allocated and
 * registered by UCX once for the link's life (allocated by UCX so that shared-memory transports can
 * map it into the peer: a put is then one memcpy by the sender); its rkey packed into *rkey
 * (release with ucp_rkey_buffer_release). */
static kvb_status ring_setup(ucx_link *u, void **rkey, size_t *rkey_len, kvb_err *err) {
    *rkey = NULL;
    *rkey_len = 0;
    const uint64_t want = env_bytes("KVB_UCX_RING", UCX_RING_BYTES, UCX_RING_MAX);
    if (!want) return KVB_OK;
    ucx_ring *r = calloc(1, sizeof *r);
    if (!r) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                             UCP_MEM_MAP_PARAM_FIELD_FLAGS,
                               .address = NULL, .length = want, .flags = UCP_MEM_MAP_ALLOCATE};
    ucs_status_t s = ucp_mem_map(g_ctx, &mp, &r->mem);
    if (s != UCS_OK) {
        free(r);
        return kvb_err_set(err, KVB_ERR_NOMEM, "ucp_mem_map of a %llu-byte receive ring: %s", (unsigned long long)want,
                           ucs_status_string(s));
    }
    ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH};
    s = ucp_mem_query(r->mem, &ma);
    if (s == UCS_OK && ma.length < want) s = UCS_ERR_NO_MEMORY;
    if (s == UCS_OK) s = ucp_rkey_pack(g_ctx, r->mem, rkey, rkey_len);
    if (s != UCS_OK) {
        ucp_mem_unmap(g_ctx, r->mem);
        free(r);
        return kvb_err_set(err, KVB_ERR_IO, "the receive ring's key: %s", ucs_status_string(s));
    }
    pthread_mutex_init(&r->mu, NULL);
    r->link = u;
    r->refs = 1;
    r->base = ma.address;
    r->bytes = want;
    atomic_init(&r->freed, 0);
    u->rx = r;
    return KVB_OK;
}

/* What each side sends after the handshake, 32 bytes, then the worker address, then the ring's
 * rkey: magic, address length u32, tag threshold u32 (0: none), ring address u64, ring bytes u32
 * (0: none), rkey length u32. */
#define UCX_INTRO_BYTES 32

/* Sends this side's introduction: the data worker's address, and the ring (set up here). */
static kvb_status intro_send(ucx_link *u, double deadline, kvb_err *err) {
    ucp_address_t *mine = NULL;
    size_t mine_len = 0;
    void *rkey = NULL;
    size_t rkey_len = 0;
    kvb_status st = ring_setup(u, &rkey, &rkey_len, err);
    if (st) return st;
    pthread_mutex_lock(&u->lock);
    ucs_status_t s = ucp_worker_get_address(u->dworker, &mine, &mine_len);
    pthread_mutex_unlock(&u->lock);
    if (s != UCS_OK) st = kvb_err_set(err, KVB_ERR_IO, "ucp_worker_get_address: %s", ucs_status_string(s));
    uint8_t head[UCX_INTRO_BYTES];
    memcpy(head, UCX_ADDR_MAGIC, 8);
    wire_put_u32(head + 8, (uint32_t)mine_len);
    wire_put_u32(head + 12, (uint32_t)env_bytes("KVB_UCX_TAG_MIN", UCX_TAG_MIN_PAYLOAD, UINT32_MAX));
    wire_put_u64(head + 16, u->rx ? (uint64_t)(uintptr_t)u->rx->base : 0);
    wire_put_u32(head + 24, u->rx ? (uint32_t)u->rx->bytes : 0);
    wire_put_u32(head + 28, (uint32_t)rkey_len);
    ucp_dt_iov_t v[3] = {{head, sizeof head}, {mine, mine_len}, {rkey, rkey_len}};
    if (!st) st = send_iov(u, v, rkey_len ? 3 : 2, deadline, err);
    pthread_mutex_lock(&u->lock);
    if (mine) ucp_worker_release_address(u->dworker, mine);
    pthread_mutex_unlock(&u->lock);
    if (rkey) ucp_rkey_buffer_release(rkey);
    return st;
}

/* Receives the peer's introduction, checked: *addr (malloc'd: the worker address, then the rkey). */
static kvb_status intro_recv(ucx_link *u, uint8_t **addr, uint32_t *addr_len, uint32_t *rkey_len, double deadline,
                             kvb_err *err) {
    uint8_t ph[UCX_INTRO_BYTES];
    kvb_status st = recv_exact(u, ph, sizeof ph, deadline, "UCX worker address", err);
    if (st) return st;
    if (memcmp(ph, UCX_ADDR_MAGIC, 8) != 0)
        return kvb_err_set(err, KVB_ERR_REFUSED, "%s sent no UCX worker address after the handshake (a refusal?)",
                           u->base.peer_addr);
    const uint32_t len = wire_get_u32(ph + 8), peer_min = wire_get_u32(ph + 12), ring = wire_get_u32(ph + 24),
                   rlen = wire_get_u32(ph + 28);
    const uint64_t mine_min = env_bytes("KVB_UCX_TAG_MIN", UCX_TAG_MIN_PAYLOAD, UINT32_MAX);
    u->tag_min = !mine_min || !peer_min ? UINT64_MAX : KVB_MAX(mine_min, peer_min);
    if (len == 0 || len > UCX_ADDR_MAX)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: a UCX worker address of %u bytes (1..%d)", u->base.peer_addr, len,
                           UCX_ADDR_MAX);
    if (ring > UCX_RING_MAX || rlen > UCX_RKEY_MAX || !ring != !rlen)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: a receive ring of %u bytes with a key of %u bytes (at most %u, %d)",
                           u->base.peer_addr, ring, rlen, UCX_RING_MAX, UCX_RKEY_MAX);
    u->peer_ring_addr = wire_get_u64(ph + 16);
    u->peer_ring_bytes = ring;
    uint8_t *peer = malloc((size_t)len + rlen);
    if (!peer) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    st = recv_exact(u, peer, (size_t)len + rlen, deadline, "UCX worker address", err);
    if (!st && u->chunk) st = kvb_err_set(err, KVB_ERR_FORMAT, "%s sent more than its worker address", u->base.peer_addr);
    if (st) {
        free(peer);
        return st;
    }
    *addr = peer;
    *addr_len = len;
    *rkey_len = rlen;
    return KVB_OK;
}

/* The data endpoint to the peer's worker address, and the peer's ring key unpacked on it. */
static kvb_status data_ep_create(ucx_link *u, const uint8_t *addr, const uint8_t *rkey, uint32_t rkey_len,
                                 kvb_err *err) {
    /* No peer error handling on this one: UCX 1.13's shared-memory transports cannot detect a dead
     * peer, so asking for it would leave only TCP. The connection manager's endpoint, which does,
     * stays open and reports a peer that dies or closes (u->failed). */
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                          .address = (const ucp_address_t *)addr,
                          .err_mode = UCP_ERR_HANDLING_MODE_NONE};
    ucp_ep_h data = NULL;
    pthread_mutex_lock(&u->lock);
    ucs_status_t s = ucp_ep_create(u->dworker, &ep, &data);
    if (s == UCS_OK) {
        u->cm_ep = u->ep;
        u->ep = data;
        if (rkey_len) s = ucp_ep_rkey_unpack(u->ep, rkey, &u->peer_rkey);
        if (s == UCS_OK && rkey_len) credit_post(u);
        if (s == UCS_OK) bye_post(u);
    }
    pthread_mutex_unlock(&u->lock);
    if (s != UCS_OK) {
        u->peer_rkey = NULL;
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "%s: the data endpoint from its worker address and ring key: %s",
                           u->base.peer_addr, ucs_status_string(s));
    }
    return KVB_OK;
}

/* Whether every lane is TCP ("tcp/lo.0 tcp/eth0.0"): UCX 1.13 emulates puts over TCP with active
 * messages that need the receiver's progress and a flush round trip per payload (measured on
 * loopback with UCX_TLS=tcp: 0.16 GB/s through the ring, 0.35 GB/s tagged), so the ring is not
 * used there. */
static bool lanes_tcp_only(const char *lanes) {
    for (const char *p = lanes; *p;) {
        if (strncmp(p, "tcp/", 4) != 0) return false;
        p += strcspn(p, " ");
        p += strspn(p, " ");
    }
    return lanes[0] != 0;
}

/* Two round trips on the new endpoint while both sides are here to progress it: UCX_DATA_MAGIC
 * each way (its wireup is then complete both ways, so the lanes are final, and a later send
 * completes without waiting for the peer); then the ring agreed, 8 bytes each way: u32 1 when this
 * side will put payloads into the peer's ring (it has one, and the lanes are not TCP only), u32 0. */
static kvb_status data_ep_check(ucx_link *u, double deadline, kvb_err *err) {
    uint8_t token[8], mine[8];
    ucp_dt_iov_t tv = {UCX_DATA_MAGIC, 8};
    kvb_status st = send_iov(u, &tv, 1, deadline, err);
    if (!st) st = recv_exact(u, token, sizeof token, deadline, "UCX data endpoint check", err);
    if (!st && memcmp(token, UCX_DATA_MAGIC, 8) != 0)
        st = kvb_err_set(err, KVB_ERR_FORMAT, "%s: the first bytes on the data endpoint are not its check",
                         u->base.peer_addr);
    if (st) return st;
    pthread_mutex_lock(&u->lock);
    describe_lanes(u->ep, u->lanes, sizeof u->lanes);
    u->ring_tx = u->peer_rkey && !lanes_tcp_only(u->lanes);
    pthread_mutex_unlock(&u->lock);
    wire_put_u32(mine, u->ring_tx);
    wire_put_u32(mine + 4, 0);
    tv = (ucp_dt_iov_t){mine, sizeof mine};
    st = send_iov(u, &tv, 1, deadline, err);
    if (!st) st = recv_exact(u, token, sizeof token, deadline, "UCX ring agreement", err);
    if (st) return st;
    const uint32_t puts = wire_get_u32(token);
    if (puts > 1 || (puts && !u->rx) || wire_get_u32(token + 4))
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s: a ring agreement of %u, %u (this side's ring: %llu bytes)",
                           u->base.peer_addr, puts, wire_get_u32(token + 4),
                           (unsigned long long)(u->rx ? u->rx->bytes : 0));
    u->ring_rx = puts == 1;
    return KVB_OK;
}

/* After the handshake: each side registers its receive ring and sends its worker address and the
 * ring's address and rkey (intro_send) over the connection manager's endpoint, and connects a
 * second endpoint to the peer's, which UCX wires up over every transport the two workers share
 * (shared memory on one host: a connection made from a socket address gets only the lanes of its
 * device, TCP). Frames then flow on that endpoint; nothing of the ring exists before the peer
 * proved the key. */
static kvb_status ucx_authenticated(kvb_link *base, double deadline, kvb_err *err) {
    ucx_link *u = (ucx_link *)base;
    ucp_worker_h dw = NULL;
    kvb_status st = new_worker(&dw, "a data worker for", err);
    if (st) return st;
    pthread_mutex_lock(&u->lock);
    u->dworker = dw;
    pthread_mutex_unlock(&u->lock);
    uint8_t *peer = NULL;
    uint32_t len = 0, rkey_len = 0;
    st = intro_send(u, deadline, err);
    if (!st) st = intro_recv(u, &peer, &len, &rkey_len, deadline, err);
    if (!st) st = data_ep_create(u, peer, peer + len, rkey_len, err);
    free(peer);
    if (!st) st = wait_wired(u, deadline, "connect to the worker of", err);
    if (!st) st = data_ep_check(u, deadline, err);
    if (!st) note_lanes(u, "frames to");
    if (!st)
        kvb_log(KVB_LOG_DEBUG, "ucx: payloads of %llu bytes or more to %s go %s", (unsigned long long)u->tag_min,
                u->base.peer_addr, u->ring_tx ? "into its receive ring (up to a quarter of it), larger ones tagged"
                                                      : "as tagged messages");
    return st;
}

static bool req_pending(ucs_status_ptr_t req) {
    return req && !UCS_PTR_IS_ERR(req) && ucp_request_check_status(req) == UCS_INPROGRESS;
}

/* Every wait ends, and the peer is told at once, as a TCP shutdown's FIN does, rather than when
 * this side gets round to closing the link (its workers destroyed, its sockets closed) or the
 * peer's keepalive finds out: an 8-byte notice goes on the data endpoint (UCX_BYE_TAG; the peer's
 * pending receives end with KVB_ERR_PEER_GONE), and the connection manager's endpoint is closed.
 * Both need this side's progress: a forced close only hands the endpoint to the worker, which
 * tears it down (and so closes its socket, which is what the peer's connection manager sees) in a
 * later ucp_worker_progress, and after a shutdown nothing here may progress that worker again
 * before the link is closed, seconds later. Relying on the close alone, the peer sometimes waited
 * out its whole receive timeout under load. So the workers are progressed here until the notice
 * is sent and the close done, and a few rounds more, bounded by UCX_BYE_WAIT_S. */
static void ucx_shutdown(kvb_link *base) {
    ucx_link *u = (ucx_link *)base;
    atomic_store(&u->shut, true);
    pthread_mutex_lock(&u->lock);
    if (u->cm_ep && !u->cm_closed && !u->dead) {
        ucs_status_ptr_t bye = NULL;
        if (!atomic_load(&u->failed) && !atomic_load(&u->peer_shut)) {
            wire_put_u64(u->bye_out, 0);
            ucp_request_param_t bp = {.op_attr_mask = 0};
            bye = ucp_tag_send_nbx(u->ep, u->bye_out, sizeof u->bye_out, UCX_BYE_TAG, &bp);
        }
        ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
        u->cm_close = ucp_ep_close_nbx(u->cm_ep, &rp);
        u->cm_closed = true;
        const double until = kvb_now_s() + UCX_BYE_WAIT_S;
        for (int round = 0; kvb_now_s() < until; round++) {
            progress(u);
            if (round >= 64 && !req_pending(bye) && !req_pending(u->cm_close)) break;
        }
        if (bye && !UCS_PTR_IS_ERR(bye)) ucp_request_free(bye); /* bye_out lives until ucx_close */
    }
    pthread_mutex_unlock(&u->lock);
}

/* Releases held data, closes the endpoint (flushed when the link is healthy, forced otherwise,
 * bounded by UCX_CLOSE_WAIT_S), then the worker. */
static void ucx_close(kvb_link *base) {
    if (!base) return;
    ucx_link *u = (ucx_link *)base;
    if (u->rx) { /* loans still out keep the ring; their return no longer touches this link */
        pthread_mutex_lock(&u->rx->mu);
        u->rx->link = NULL;
        pthread_mutex_unlock(&u->rx->mu);
    }
    pthread_mutex_lock(&u->lock);
    u->closing = true;
    if (u->chunk) ucp_stream_data_release(u->ep, u->chunk);
    u->chunk = NULL;
    bool force = u->dead || atomic_load(&u->failed) || atomic_load(&u->shut);
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0};
    double until = kvb_now_s() + UCX_CLOSE_WAIT_S;
    if (u->credit_req && !u->dead) /* credits that arrived are taken, none left unmatched */
        for (int round = 0; round < 64 && progress(u); round++) credit_poll(u);
    if (u->credit_req) { /* the posted receive of a credit: cancelled, so it writes nothing more */
        ucp_request_cancel(u->dworker, u->credit_req);
        ucp_request_free(u->credit_req);
        u->credit_req = NULL;
    }
    if (u->bye_req) { /* the posted receive of the peer's notice: likewise */
        ucp_request_cancel(u->dworker, u->bye_req);
        ucp_request_free(u->bye_req);
        u->bye_req = NULL;
    }
    if (u->credit_send) { /* released by UCX once done; credit_out lives until the workers are gone */
        ucp_request_free(u->credit_send);
        u->credit_send = NULL;
    }
    if (u->peer_rkey) ucp_rkey_destroy(u->peer_rkey);
    ucp_ep_h eps[2] = {u->ep, u->cm_closed ? NULL : u->cm_ep};
    for (int i = 0; i < 2; i++) {
        ucs_status_ptr_t req = eps[i] ? ucp_ep_close_nbx(eps[i], &rp) : i == 1 ? u->cm_close : NULL;
        unsigned idle = 0; /* backing off: a close the peer never answers costs no core for its wait */
        while (req && !UCS_PTR_IS_ERR(req) && !u->dead) {
            if (progress(u)) idle = 0;
            else idle_backoff(&idle);
            if (ucp_request_check_status(req) != UCS_INPROGRESS || kvb_now_s() > until) {
                ucp_request_free(req);
                break;
            }
        }
    }
    pthread_mutex_unlock(&u->lock);
    if (u->dworker) ucp_worker_destroy(u->dworker);
    ucp_worker_destroy(u->worker);
    if (u->rx) {
        pthread_mutex_lock(&u->rx->mu);
        ring_unref(u->rx);
    }
    pthread_mutex_destroy(&u->lock);
    free(u);
}

const kvb_wire_backend kvb_wire_backend_ucx = {
    .name = "ucx",
    .listen = ucx_listen,
    .accept = ucx_accept,
    .listener_close = ucx_listener_close,
    .connect = ucx_connect,
    .send_frame = ucx_send_frame,
    .recv_frame = ucx_recv_frame,
    .shutdown = ucx_shutdown,
    .close = ucx_close,
    .describe = ucx_describe,
    .authenticated = ucx_authenticated,
};
