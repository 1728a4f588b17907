/* node — the two roles of a kvbridge deployment. The PREFILL node listens for authenticated
 * decode nodes, prefills what a decode node lacks (reusing its own prefix cache, recomputing
 * whatever it needs attention inputs for), runs the bridge after every (chunk, layer) and streams
 * the decoder's cache as SLABs through a fixed ring of staging buffers (memory independent of the
 * prompt length; a slow link applies back-pressure), then DONE. The DECODE node is the front door:
 * an OpenAI-compatible HTTP API; per request it tokenizes, looks up its prefix cache, decides to
 * bridge or not, commits arriving slabs through the store's one block writer, computes the rest
 * natively (always the last prompt token), decodes and streams — and reports honestly what
 * happened (complete / partial B/T / declined: reason). Requests on a decode node are served one
 * at a time on its engine (a FIFO queue: concurrent HTTP requests wait their turn). */
#ifndef KVB_NODE_H
#define KVB_NODE_H

#include <stdbool.h>
#include <stdint.h>

#include "kvb_core.h"

/* ---- prefill node ---------------------------------------------------------------------------- */

typedef struct {
    const char *listen;        /* "HOST:PORT" (port 0 = ephemeral) */
    const char *http_listen;   /* NULL, or "HOST:PORT" for /health and /metrics (probes, scrapers) */
    const char *model_path;    /* the decoder's GGUF: decoder mode needs its K/V weights */
    const char *psk;           /* pre-shared key, >= 16 bytes */
    const struct kvb_wire_backend *backend; /* the listener's wire backend; NULL: TCP */
    const char *name;          /* node name in HELLO (default "prefill") */
    int n_threads;             /* 0 = all CPUs */
    uint32_t cache_dtype;      /* the DECODER's cache dtype the bridge produces (kvb_type) */
    uint32_t block_tokens;     /* the decoder's block size (default 32) */
    uint32_t max_ctx;          /* longest prompt (default 32768) */
    uint32_t chunk_tokens;     /* prefill chunk (default 512 on the CPU, 8192 on CUDA and with bench_filler_rows) */
    bool cuda;                 /* prefill on the CUDA engine (bf16) with the CUDA bridge kernel fed
                                  from its layer hook; decoder mode only */
    int gpus;                  /* cuda: tensor-parallel ranks (0/1 = one GPU); see kvb_engine_cuda.h */
    bool tp_one_device;        /* cuda, gpus > 1: every rank on one GPU (testing the split) */
    int gpu_weights;           /* cuda: kvb_cuda_weights (0 auto: bf16 when it fits, else packed) */
    uint32_t ring_slots;       /* staging slots (default 16) */
    bool prefill_mode;         /* bridge mode `prefill`: ship this engine's own K/V re-encoded (cheaper,
                                  not exact) instead of the decoder's arithmetic (mode `decoder`) */
    uint32_t engine_cache_dtype; /* this node's own cache dtype in prefill mode (0 = the decoder's) */
    bool kv_ggml;              /* CPU: the K/V (and every RMSNorm and RoPE) in ggml's CPU arithmetic, the
                                  fidelity level for a llama.cpp decoder (kvb_prefill_opts.ggml_arith) */
    /* cuda: before listening, prefill this many random tokens twice with the bridge computing and
     * its rows dropped (at most max_ctx - 1), so the first request does not pay for loading the
     * kernels, initialising the GPU libraries (~0.2 s on the H200) and cuDNN's plans for these
     * shapes; 0 = none */
    uint32_t warmup_tokens;
    /* Test-only fault injection, at the Nth slab of every request ("corrupt:N" flips a byte of it
     * after its checksum; "die:N" drops its connection before it; "stall:N" stops sending before
     * it for 30 s; "pause:N" waits 2 s before it, a slow link but no fault), or only of the first K
     * requests that reach it ("corrupt:NxK", ...). NULL in production. */
    const char *fault;
    /* Bench-only (`kvbridge bench ladder --slab-path-only`): ship rows without computing them —
     * every (chunk, layer) of the request gets deterministic filler rows in the decoder's dtype,
     * cut, checksummed, staged and sent exactly as computed rows are, a chunk's layer at a time
     * (as the CUDA bridge hands over its pinned slot). Measures the slab path (staging,
     * transport, the decoder's verification and commit) with no engine in the way: none is made,
     * and the filler is made at start. The decoder's cache then holds filler, so such a node
     * announces a model fingerprint of its own (kvb_filler_fingerprint): a decode node refuses it
     * as another model unless it set bench_filler_peer. */
    bool bench_filler_rows;
    /* Admission: PREFILLs wait for the engine in a queue served round robin between decode nodes
     * (HELLO name @ host), in arrival order within one; beyond max_queue waiting in all (default 8)
     * or max_queue_per_decoder from one decode node (default 4) a PREFILL is refused at once with an
     * ERROR of code BUSY saying which bound and the queue's length. */
    uint32_t max_queue, max_queue_per_decoder;
    /* CPU engine: blocks of this node's own prefix cache (default 2 contexts' worth; at least one
     * context's); when full, the least recently used conversations' blocks are evicted */
    uint32_t cache_blocks;
} kvb_prefill_config;

/* The model fingerprint a bench_filler_rows prefill node (and a bench_filler_peer decode node)
 * puts in its HELLO instead of the model's: filler rows never reach a decoder that serves answers. */
uint64_t kvb_filler_fingerprint(uint64_t model_fingerprint);

typedef struct kvb_prefill_node kvb_prefill_node;
kvb_status kvb_prefill_node_start(const kvb_prefill_config *cfg, kvb_prefill_node **out, kvb_err *err);
uint16_t kvb_prefill_node_port(const kvb_prefill_node *n);
/* The start's warm-up (warmup_tokens): the tokens it prefilled (0: none) and its seconds. */
uint32_t kvb_prefill_node_warmup(const kvb_prefill_node *n, double *seconds);
/* Peak bytes of staging memory a request used: the ring's slots in use, plus on CUDA the bridge's
 * pinned row slots (two, or KVB_BRIDGE_SLOTS; fixed at start). Never grows with the prompt. */
uint64_t kvb_prefill_node_peak_capture_bytes(const kvb_prefill_node *n);
/* Peak GPU memory in use while this node ran (cudaMemGetInfo, every process on the device), or 0
 * on the CPU engine. */
uint64_t kvb_prefill_node_peak_gpu_bytes(kvb_prefill_node *n);
/* The last request's staging ring. */
typedef struct {
    double full_s;  /* the producer (the engine's hook, or the CUDA bridge's shipper) idled on a full
                       ring, or on a layer's views not yet sent: the link or the decoder was slower */
    double empty_s; /* a sender waited on an empty ring (mean over the lanes): the producer was */
    uint32_t slabs; /* sent, over every lane */
    uint32_t checksums_by_producer; /* of those, checksummed by the producer while it waited for its
                                       views to be sent (the senders hashed the rest) */
} kvb_staging_stats;
void kvb_prefill_node_last_staging(kvb_prefill_node *n, kvb_staging_stats *out);
/* Times a cold prefill of n_tokens random tokens (seeded) on this node's engine. with_bridge
 * false: the bridge idle — nothing computed for or shipped to a decoder, and the last token's
 * logits computed, as a server on this engine alone would to answer with a first token: "the
 * prefill engine alone", the yardstick for a bridged time to first token. with_bridge true: the
 * bridge also computes and cuts the decoder's rows for tokens [0, n_tokens - 1), as a request
 * would, and they are dropped instead of sent; no logits (a prefill node computes none) — the
 * node's whole share of a bridged request, without the link. Waits for any request in flight. */
kvb_status kvb_prefill_node_time_alone(kvb_prefill_node *n, uint32_t n_tokens, uint64_t seed, bool with_bridge,
                                       double *seconds, kvb_err *err);
/* A graceful stop's first half: a PREFILL that arrives from now on is refused with an ERROR
 * saying the node is draining (its decoder computes that prompt itself); those already accepted
 * (computing, or waiting for the engine) go on. kvb_prefill_node_in_flight says how many are
 * left. Then kvb_prefill_node_stop. */
void kvb_prefill_node_quiesce(kvb_prefill_node *n);
/* The port of /health and /metrics (kvb_prefill_config.http_listen), 0 without. */
uint16_t kvb_prefill_node_http_port(const kvb_prefill_node *n);
unsigned kvb_prefill_node_in_flight(kvb_prefill_node *n);
/* The decode nodes ("NAME@HOST") the engine was given to, oldest first (the last 128), separated by
 * spaces, into buf; returns the text's length. */
size_t kvb_prefill_node_served(kvb_prefill_node *n, char *buf, size_t cap);
void kvb_prefill_node_stop(kvb_prefill_node *n);

/* ---- decode node ------------------------------------------------------------------------------ */

#define KVB_MAX_LANES 8
#define KVB_MAX_PEERS 16 /* prefill nodes of one decode node */
#define KVB_DEFAULT_LANES 4

typedef struct {
    const char *http_listen;   /* "HOST:PORT" for the OpenAI API (port 0 = ephemeral) */
    const char *peer;          /* a prefill node "HOST:PORT" (or "NAME=HOST:PORT": its name in verdicts and
                                  metrics), or NULL; with peers: the first of them */
    const char *const *peers;  /* (n_peers) more prefill nodes; none at all: always native */
    uint32_t n_peers;
    const char *name;          /* this node's name in its HELLO (default "decode"): a prefill node tells
                                  decode nodes apart by name and host, for fair turns and its metrics */
    uint32_t peer_max_queue;   /* several peers: a conversation's next turn goes to the peer that produced
                                  its longest cached prefix unless that one's queue is above this
                                  (0: 2), or it is down; then to the least-loaded peer that is up */
    const char *model_path;
    const char *model_id;      /* name in the API (default: the file's base name) */
    const char *psk;
    const struct kvb_wire_backend *backend; /* the peer link's wire backend; NULL: TCP */
    const char *api_key;       /* NULL or "": an open API; else /v1/ needs "Authorization: Bearer KEY" */
    const char *allow_origins; /* NULL or "": no CORS; else browser origins allowed to call the API
                                  (comma-separated, or "*"): kvb_http_config.allow_origins */
    const char *chat_template; /* family override, NULL = from the model */
    int n_threads;
    uint32_t cache_dtype;      /* this node's cache format (default f16) */
    uint32_t block_tokens;     /* default 32 */
    uint32_t max_ctx;          /* context limit per request (default min(training ctx, 32768)) */
    uint32_t cache_blocks;     /* prefix-cache size in blocks (default 4 contexts' worth) */
    uint32_t bridge_min_tokens;/* bridge only when at least this many uncached tokens (default 2 blocks) */
    uint32_t default_max_tokens; /* when a request names none (default 256) */
    int peer_timeout_ms;       /* per frame while bridging (default 10000); a lane waits up to lanes x this
                                  for its next frame, since it carries about one frame in `lanes` */
    uint32_t lanes;            /* connections to the peer a bridged request's slabs are striped over
                                  (1..KVB_MAX_LANES; 0 = KVB_DEFAULT_LANES) */
    uint32_t parallel;         /* requests served at once, their decode steps batched (default 4, at
                                  most KVB_DECODE_MAX_PARALLEL); each is admitted in arrival order
                                  once the cache blocks its prompt and max_tokens can fill fit
                                  beside the others' reservations in cache_blocks; a request that
                                  could never fit is refused (400) */
    int bridge_resumes;        /* after a link fault (corrupt slab, dropped connection) with at least
                                  bridge_min_tokens still missing, ask again for only the missing
                                  blocks, at most this many times per request (default 2; negative: never) */
    bool prefill_mode;         /* ask for bridge mode `prefill` (the prefill node must run it too) */
    bool tail_after_transfer;  /* run the last prompt token after the transfer, not pipelined with
                                  it (also KVB_DECODE_PIPELINED_TAIL=0); bench ladder
                                  --slab-path-only, so the link's ceiling is measured alone */
    bool bench_filler_peer;    /* bench-only: the peer ships filler rows (kvb_prefill_config.
                                  bench_filler_rows), which this node then takes into its cache;
                                  without it, such a peer is refused as another model */
} kvb_decode_config;

#define KVB_DECODE_MAX_PARALLEL 64
typedef struct kvb_decode_node kvb_decode_node;
kvb_status kvb_decode_node_start(const kvb_decode_config *cfg, kvb_decode_node **out, kvb_err *err);
uint16_t kvb_decode_node_port(const kvb_decode_node *n);
/* The last bridged request's receiving stages (bench ladder's diagnosis): seconds its reading
 * thread waited for a free buffer (verification and commit were the slower stage) and its
 * verifying thread waited for a frame (the link or the prefill node was). */
void kvb_decode_node_last_receive_waits(kvb_decode_node *n, double *reader_s, double *consumer_s);
void kvb_decode_node_stop(kvb_decode_node *n);
/* A graceful stop's first half (kvb_http_server_quiesce): new requests get 503, those in flight go on;
 * kvb_decode_node_in_flight says how many are left. Then kvb_decode_node_stop. */
void kvb_decode_node_quiesce(kvb_decode_node *n);
unsigned kvb_decode_node_in_flight(kvb_decode_node *n);

/* ---- a minimal HTTP/1.1 client (demo, ladder benchmark, tests) --------------------------------- */

typedef struct {
    int status;
    char verdict[160]; /* the X-KVBridge header, "" if absent */
    char *body;        /* malloc'd, NUL-terminated */
    size_t body_len;
} kvb_http_reply;

/* A plain blocking TCP connection to host:port (name or address); the socket, or -1. For
 * kvbridge's own tools, not for the wire protocol (which has its own backend). */
int kvb_tcp_dial(const char *host, const char *port);

/* POSTs a JSON body to http://host:port/path and reads the whole reply (Content-Length or
 * close-delimited). timeout_ms bounds the call. */
kvb_status kvb_http_post(const char *host, uint16_t port, const char *path, const char *json, int timeout_ms,
                         kvb_http_reply *out, kvb_err *err);
/* The same with GET and no body. */
kvb_status kvb_http_get(const char *host, uint16_t port, const char *path, int timeout_ms, kvb_http_reply *out,
                        kvb_err *err);
void kvb_http_reply_free(kvb_http_reply *r);

#endif
