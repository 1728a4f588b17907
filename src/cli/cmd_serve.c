/* cli/cmd_serve.c — `kvbridge serve --role prefill|decode|router`: runs one node (or the router in front of
 * several decode nodes) until SIGINT/SIGTERM. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvb_cli.h"
#include "kvb_llama_door.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvb_router.h"
#include "kvb_transport.h"

/* Requests the node in this process has in flight (the role it runs; the llama-server front door
 * does not count its own: a stop waits for the one it serves). */
static unsigned in_flight(kvb_decode_node *dn, kvb_prefill_node *pn) {
    return dn ? kvb_decode_node_in_flight(dn) : pn ? kvb_prefill_node_in_flight(pn) : 0;
}

static volatile sig_atomic_t g_stop; /* signals received: the first drains, the second stops */
static void on_signal(int sig) {
    (void)sig;
    g_stop = g_stop + 1;
}

/* What the command line asks of a node. */
typedef struct {
    const char *model, *listen, *http, *psk, *tmpl, *model_id, *fault, *api_key, *allow_origin, *decoder, *slot_dir,
        *name, *backend_key;
    long long threads, bt, ctx, bridge_min, max_tokens, chunk, cache_blocks, lanes, warmup, resumes, parallel,
        drain_s, slots, peer_max_queue, max_inflight, health_ms, retries, connect_ms, first_byte_ms, max_queue,
        max_queue_dec;
    kvb_opt_list peers;    /* --peer, repeatable */
    kvb_opt_list backends; /* router: the decode nodes */
    int role, mode, device, transport; /* k_roles, kvb_cli_{bridge_mode,device,transport}_names */
    int kv_arith;                      /* kvb_cli_kv_arith_names */
    kvb_cli_gpu gpu;
    bool tail_after, filler, quiet, verbose;
    uint32_t cache_type, engine_type;
} serve_args;

static const char *const k_roles[] = {"prefill", "decode", "router", NULL};
enum { ROLE_ROUTER = 2 };

/* Checks that span several options; 2 after a message, else KVB_CLI_GO. */
static int serve_check(const kvb_cli_spec *spec, serve_args *a) {
    const bool prefill = a->role == 0, cuda = a->device == 1;
    if (!prefill && (a->gpu.gpus > 1 || a->gpu.tp_one_device))
        return kvb_cli_usage_error(spec, "--gpus and --tp-one-device are the prefill node's (--role prefill "
                                         "--device cuda); a decode node decodes on its CPU");
    if (a->filler && (!prefill || cuda))
        return kvb_cli_usage_error(spec, "--bench-filler-rows is for --role prefill on the CPU (it computes nothing)");
    if (prefill && a->allow_origin)
        return kvb_cli_usage_error(spec, "--allow-origin is for --role decode (the HTTP API)");
    if (prefill && a->api_key)
        return kvb_cli_usage_error(spec, "--api-key is for --role decode (it guards the HTTP API); the prefill "
                                         "node's link is authenticated by --psk");
    if (!prefill && !a->api_key) a->api_key = getenv("KVB_API_KEY");
    if (!kvb_cli_gpu_ok("serve", &a->gpu, cuda)) return 2;
    if ((a->role == ROLE_ROUTER) != (a->backends.n > 0) || (a->role == ROLE_ROUTER) == (a->model != NULL))
        return kvb_cli_usage_error(spec, a->role == ROLE_ROUTER ? "--role router needs --backend HOST:PORT (one per "
                                   "decode node) and loads no model (no -m)" : "--role %s needs -m MODEL; --backend "
                                   "is for --role router", k_roles[a->role]);
    if (a->role == ROLE_ROUTER && (a->peers.n || a->listen || a->decoder))
        return kvb_cli_usage_error(spec, "--role router takes --http and --backend; --peer, --listen and --decoder "
                                         "are the nodes'");
    if (a->decoder && (prefill || strncmp(a->decoder, "llama-server=", 13) || !a->slot_dir))
        return kvb_cli_usage_error(spec, "--decoder llama-server=URL is for --role decode and needs --slot-dir DIR");
    if (a->decoder && a->peers.n > 1)
        return kvb_cli_usage_error(spec, "--decoder llama-server=URL takes one --peer");
    if (a->peers.n > KVB_MAX_PEERS)
        return kvb_cli_usage_error(spec, "--peer is given %d times: at most %d prefill nodes", a->peers.n,
                                   KVB_MAX_PEERS);
    if (prefill ? !a->listen : !a->http)
        return kvb_cli_usage_error(spec, "--role %s needs %s HOST:PORT", k_roles[a->role],
                                   prefill ? "--listen" : "--http");
    return KVB_CLI_GO;
}

/* Fills *a from argv; KVB_CLI_GO, or the code the command returns. */
static int serve_parse(serve_args *a, int argc, char **argv) {
    const kvb_opt opts[] = {
        {.long_name = "role", .kind = KVB_OPT_ENUM, .dst = &a->role, .choices = k_roles, .required = true,
         .help = "the node this process runs (above)"},
        KVB_CLI_OPT_MODEL(&a->model, "prefill, decode: the decoder's GGUF (both roles load the same file)", false),
        {.long_name = "backend", .kind = KVB_OPT_LIST, .dst = &a->backends, .meta = "HOST:PORT",
         .help = "router: a decode node's HTTP API"},
        KVB_CLI_STR("backend-api-key", &a->backend_key, "KEY",
                  "router: the decode nodes' --api-key, sent with every relayed request (or env KVB_BACKEND_API_KEY)"),
        KVB_CLI_INT("backend-max-inflight", &a->max_inflight, "N", 1, 1 << 20, "8",
                  "router: a backend with N requests in flight takes no more conversations"),
        KVB_CLI_INT("health-interval-ms", &a->health_ms, "MS", 10, 3600000, "1000", "router: /health polls"),
        KVB_CLI_INT("retries", &a->retries, "N", 0, KVB_ROUTER_MAX_BACKENDS, "2",
                  "router: other backends tried when one fails before a byte of its reply went out"),
        KVB_CLI_INT("connect-timeout-ms", &a->connect_ms, "MS", 1, 600000, "1000", "router: connect to a backend"),
        KVB_CLI_INT("first-byte-timeout-ms", &a->first_byte_ms, "MS", 1, 86400000, "60000",
                  "router: a backend's reply head must come this soon (a non-streamed reply's comes at its end)"),
        KVB_CLI_STR("listen", &a->listen, "HOST:PORT", "prefill: where decode nodes connect"),
        KVB_CLI_STR("http", &a->http, "HOST:PORT",
                  "decode: the HTTP API address; prefill (optional): /health and /metrics for probes and scrapers"),
        KVB_CLI_STR("decoder", &a->decoder, "llama-server=URL",
                  "decode: front a stock llama-server (http://HOST:PORT, run with --slot-save-path) instead of "
                  "decoding here: prompts are bridged into its slots through its slot API"),
        KVB_CLI_STR("slot-dir", &a->slot_dir, "DIR", "decode, --decoder: llama-server's --slot-save-path (same host)"),
        KVB_CLI_INT("slots", &a->slots, "N", 1, KVB_DOOR_MAX_SLOTS, NULL,
                  "decode, --decoder: llama-server's slots (its -np; default 1)"),
        {.long_name = "peer", .kind = KVB_OPT_LIST, .dst = &a->peers, .meta = "[NAME=]HOST:PORT",
         .help = "decode: a prefill node (omit to always compute natively); several: each conversation's next turn "
                 "goes to the one holding its history, else to the least loaded (NAME: its name in verdicts and "
                 "metrics; default HOST:PORT)"},
        KVB_CLI_INT("peer-max-queue", &a->peer_max_queue, "N", 1, 1 << 20, "2",
                    "decode, several peers: pass over the peer holding a conversation's history when its queue "
                    "(PREFILLs in flight, from every decode node) is above N"),
        KVB_CLI_STR("name", &a->name, "NAME",
                  "prefill, decode: this node's name in the handshake (default: its role); a prefill node tells decode "
                  "nodes apart by name and the host they connect from (fair turns, per-decoder metrics), so give two "
                  "decode nodes on one host different names"),
        KVB_CLI_OPT_PSK(&a->psk, "pre-shared key, >= 16 bytes (or env KVB_PSK); both nodes need the same"),
        KVB_CLI_OPT_TRANSPORT(&a->transport, "the link between the nodes: tcp (kvbridge's own) or ucx (UCX: shared "
                                             "memory, TCP or RDMA as it selects; the log names its lanes); both "
                                             "nodes need the same"),
        KVB_CLI_STR("api-key", &a->api_key, "KEY",
                  "decode: /v1/* require 'Authorization: Bearer KEY' (clients: their OpenAI api_key), >= 8 bytes "
                  "(or env KVB_API_KEY); /health and /metrics stay open"),
        KVB_CLI_STR("allow-origin", &a->allow_origin, "LIST",
                  "decode: browser pages from these origins may call the API (CORS): "
                  "https://ui.example[,https://other.example], or * for any"),
        KVB_CLI_OPT_CACHE_TYPE(&a->cache_type, "the decoder's cache dtype: f16, f32, bf16, q8_0"),
        KVB_CLI_OPT_BLOCK_TOKENS(&a->bt, "tokens per cache block"),
        KVB_CLI_INT("ctx", &a->ctx, "N", 16, 1 << 24, NULL, "context limit in tokens"),
        KVB_CLI_OPT_THREADS(&a->threads, "CPU threads (default: all)"),
        KVB_CLI_INT("bridge-min", &a->bridge_min, "N", 1, 1 << 24, NULL,
                  "decode: bridge only when at least N tokens are uncached (default 2 blocks)"),
        KVB_CLI_INT("max-tokens", &a->max_tokens, "N", 1, 1 << 24, NULL,
                  "decode: completion length when a request names none (default 256)"),
        KVB_CLI_STR("chat-template", &a->tmpl, "NAME", "decode: override the chat template family"),
        KVB_CLI_STR("model-id", &a->model_id, "NAME", "decode: the model name the API reports"),
        KVB_CLI_OPT_BRIDGE_MODE(&a->mode),
        KVB_CLI_OPT_KV_ARITH(&a->kv_arith, "prefill, cpu: engine (its own arithmetic) or ggml (every RMSNorm, RoPE and "
                                           "the K/V projections as llama.cpp's CPU backend computes them: the closer "
                                           "fidelity level for a llama-server decoder)"),
        {.long_name = "engine-cache-type", .kind = KVB_OPT_CUSTOM, .dst = &a->engine_type, .meta = "T",
         .parse = kvb_opt_parse_type,
         .help = "prefill, bridge mode prefill: this node's own cache dtype (default: the decoder's)"},
        KVB_CLI_OPT_DEVICE(&a->device, "prefill: the engine that prefills; cuda prefills in bf16 on the GPU and "
                                       "runs the bridge kernel there (decoder mode)"),
        KVB_CLI_INT("chunk", &a->chunk, "N", 16, 1 << 20, NULL,
                  "prefill: tokens per forward chunk (default 512 on cpu, 8192 on cuda)"),
        KVB_CLI_OPTS_GPU(&a->gpu),
        KVB_CLI_INT("warmup", &a->warmup, "N", 0, 1 << 24, NULL,
                  "prefill, cuda: before listening, prefill N random tokens twice with the bridge's kernels (rows "
                  "dropped) so the first request does not pay for loading the GPU kernels and libraries and "
                  "cuDNN's plan for a full first chunk (default: one chunk and 64 tokens; 0 = none)"),
        KVB_CLI_INT("cache-blocks", &a->cache_blocks, "N", 16, 1LL << 31, NULL,
                  "prefix-cache size in blocks (decode: default 4 contexts' worth; prefill, cpu: its own, default "
                  "2 contexts' worth, at least one; full: the least recently used conversations' blocks evicted)"),
        KVB_CLI_INT("max-queue", &a->max_queue, "N", 1, 1 << 20, "8",
                    "prefill: PREFILLs that may wait for the engine (served round robin between decode nodes, in "
                    "arrival order within one); beyond N one is refused at once as BUSY (the decoder tries its "
                    "next prefill node, or computes the prompt itself)"),
        KVB_CLI_INT("max-queue-per-decoder", &a->max_queue_dec, "N", 1, 1 << 20, "4",
                    "prefill: of those, at most N from one decode node (its HELLO name and host); beyond, BUSY"),
        {.long_name = "tail-after-transfer", .kind = KVB_OPT_FLAG, .dst = &a->tail_after,
         .help = "decode: compute the prompt's last token after the bridged cache has arrived, not layer by "
                 "layer while it arrives (the default, same answer)"},
        KVB_CLI_INT("lanes", &a->lanes, "N", 1, KVB_MAX_LANES, NULL,
                  "decode: connections to the prefill node that each bridged request's slabs are striped over, "
                  "each with its own receiving thread (default 4)"),
        KVB_CLI_INT("parallel", &a->parallel, "N", 1, KVB_DECODE_MAX_PARALLEL, NULL,
                  "decode: requests served at once, their decode steps run as one batch (the weights read once "
                  "per step for all; default 4). Each is admitted, in arrival order, once the cache blocks its "
                  "prompt and max_tokens can fill fit beside the others' in --cache-blocks"),
        KVB_CLI_INT("bridge-resumes", &a->resumes, "N", 0, 100, NULL,
                  "decode: after a corrupt slab or a dropped connection, ask the prefill node again for only the "
                  "blocks still missing, at most N times per request (default 2; 0 = compute what is missing "
                  "natively at once)"),
        KVB_CLI_STR("fault", &a->fault, "SPEC",
                  "prefill, test-only: corrupt:N, die:N, stall:N (30 s) or pause:N (2 s) at the Nth slab of every "
                  "request, or of the first K with corrupt:NxK (...)"),
        {.long_name = "bench-filler-rows", .kind = KVB_OPT_FLAG, .dst = &a->filler,
         .help = "prefill, bench-only: ship filler rows without computing them, to time the slab path across a "
                 "real link (kvbridge bench ladder --peer ADDR --slab-path-only). The node then announces a model "
                 "fingerprint of its own, so a decode node serving answers refuses it as another model"},
        {.long_name = "drain-seconds", .kind = KVB_OPT_INT, .dst = &a->drain_s, .meta = "N", .lo = 0, .hi = 86400,
         .def = "30",
         .help = "on SIGINT/SIGTERM let the requests in flight finish for up to N s (0: stop at once) while "
                 "refusing new ones (decode: HTTP 503; prefill: the decoder is told to compute the prompt itself); "
                 "a second signal stops"},
        {.long_name = "quiet", .short_name = 'q', .kind = KVB_OPT_FLAG, .dst = &a->quiet,
         .help = "log warnings and errors only (by default also one line per completion, connections and faults)"},
        {.long_name = "verbose", .short_name = 'v', .kind = KVB_OPT_FLAG, .dst = &a->verbose,
         .help = "also log every other request (probes, scrapes) and the HTTP library's notes"},
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "serve", .opts = opts,
        .usage = "--role prefill --listen ADDR -m MODEL [options]\n--role decode --http ADDR -m MODEL "
                 "[--peer ADDR ...] [options]\n--role router --http ADDR --backend ADDR [--backend ADDR ...] [options]",
        .about = "prefill  computes the decode node's own KV cache for the prompts it is sent and streams it\n"
                 "decode   the front door: an OpenAI-compatible API (/v1/chat/completions, /v1/completions,\n"
                 "         /v1/models, /health, /metrics) that bridges long prompts through the prefill node\n"
                 "router   the same API in front of several decode nodes (loads no model): keeps each conversation\n"
                 "         on the node that holds its prefix, retries elsewhere only before a byte went out"};
    int rc = kvb_cli_parse(&spec, argc, argv);
    return rc != KVB_CLI_GO ? rc : serve_check(&spec, a);
}

/* --role router: serves until a signal; the first lets the replies in flight end (--drain-seconds). */
static int serve_router(const serve_args *a) {
    kvb_err err = {0};
    const kvb_router_config c = {.http_listen = a->http, .backends = a->backends.v, .n_backends = (size_t)a->backends.n,
                                 .api_key = a->api_key, .allow_origins = a->allow_origin,
                                 .backend_api_key = a->backend_key ? a->backend_key : getenv("KVB_BACKEND_API_KEY"),
                                 .backend_max_inflight = (uint32_t)a->max_inflight,
                                 .health_interval_ms = (uint32_t)a->health_ms, .retries = a->retries ? (int)a->retries : -1,
                                 .connect_timeout_ms = (uint32_t)a->connect_ms,
                                 .first_byte_timeout_ms = (uint32_t)a->first_byte_ms};
    kvb_router *r = NULL;
    if (kvb_router_start(&c, &r, &err)) {
        fprintf(stderr, "kvbridge serve: %s\n", err.msg);
        return 1;
    }
    printf("kvbridge router: OpenAI API on port %u in front of %d decode node(s)\n", kvb_router_port(r), a->backends.n);
    fflush(stdout);
    while (!g_stop) usleep(100000);
    const double t0 = kvb_now_s();
    kvb_router_quiesce(r);
    while (g_stop == 1 && kvb_router_in_flight(r) > 0 && kvb_now_s() - t0 < (double)a->drain_s) usleep(50000);
    kvb_router_stop(r);
    return 0;
}

int kvb_cmd_serve(int argc, char **argv) {
    serve_args a = {.psk = getenv("KVB_PSK"), .warmup = -1, .resumes = -1};
    int prc = serve_parse(&a, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    signal(SIGPIPE, SIG_IGN);
    kvb_log_set_level(a.verbose ? KVB_LOG_DEBUG : a.quiet ? KVB_LOG_WARN : KVB_LOG_INFO);
    if (a.role == ROLE_ROUTER) return serve_router(&a);
    const char *peer = a.peers.n ? a.peers.v[0] : NULL; /* the first; the llama-server door takes one */
    const char *model = a.model, *listen = a.listen, *http = a.http, *psk = a.psk, *tmpl = a.tmpl,
               *model_id = a.model_id, *fault = a.fault, *api_key = a.api_key, *allow_origin = a.allow_origin;
    const long long threads = a.threads, bt = a.bt, ctx = a.ctx, bridge_min = a.bridge_min,
                    max_tokens = a.max_tokens, chunk = a.chunk, cache_blocks = a.cache_blocks, lanes = a.lanes,
                    warmup = a.warmup, resumes = a.resumes, parallel = a.parallel, drain_s = a.drain_s;
    const bool prefill = a.role == 0, prefill_mode = a.mode == 1, cuda = a.device == 1, tail_after = a.tail_after,
               filler = a.filler;
    const kvb_log_level log_level = a.verbose ? KVB_LOG_DEBUG : a.quiet ? KVB_LOG_WARN : KVB_LOG_INFO;
    const uint32_t cache_type = a.cache_type, engine_type = a.engine_type;
    kvb_log_set_level(log_level);
    kvb_err err = {0};
    const kvb_wire_backend *backend = NULL;
    if (kvb_wire_backend_by_name(kvb_cli_transport_names[a.transport], &backend, &err)) {
        fprintf(stderr, "kvbridge serve: %s\n", err.msg);
        return 2;
    }
    kvb_prefill_node *pn = NULL;
    kvb_decode_node *dn = NULL;
    kvb_llama_door *door = NULL;
    if (prefill) {
        kvb_prefill_config c = {.listen = listen, .http_listen = http, .model_path = model, .psk = psk, .backend = backend,
                                .n_threads = (int)threads, .cache_dtype = cache_type, .block_tokens = (uint32_t)bt, .max_ctx = (uint32_t)ctx,
                                .fault = fault, .prefill_mode = prefill_mode, .engine_cache_dtype = engine_type,
                                .kv_ggml = a.kv_arith == 1,
                                .cuda = cuda, .chunk_tokens = (uint32_t)chunk,
                                .gpus = (int)a.gpu.gpus, .tp_one_device = a.gpu.tp_one_device, .gpu_weights = a.gpu.gpu_weights,
                                .warmup_tokens = (uint32_t)(warmup >= 0 ? warmup : (chunk ? chunk : 8192) + 64),
                                .bench_filler_rows = filler, .name = a.name, .cache_blocks = (uint32_t)cache_blocks,
                                .max_queue = (uint32_t)a.max_queue, .max_queue_per_decoder = (uint32_t)a.max_queue_dec};
        if (kvb_prefill_node_start(&c, &pn, &err)) goto fail;
        double wu_s = 0;
        const uint32_t wu = kvb_prefill_node_warmup(pn, &wu_s);
        printf("kvbridge prefill node: listening on port %u (model %s", kvb_prefill_node_port(pn), model);
        if (wu) printf("; GPU warmed up on %u tokens in %.2f s", wu, wu_s);
        if (filler) printf("; FILLER ROWS, bench only: only a decoder started for filler accepts this node");
        if (kvb_prefill_node_http_port(pn)) printf("; /health and /metrics on port %u", kvb_prefill_node_http_port(pn));
        printf(")\n");
    } else if (a.decoder) {
        kvb_llama_door_config c = {.http_listen = http, .server_url = a.decoder + 13, .slot_dir = a.slot_dir,
                                   .peer = peer, .psk = psk, .backend = backend, .model_path = model,
                                   .model_id = model_id, .slots = (uint32_t)a.slots, .block_tokens = (uint32_t)bt,
                                   .max_ctx = (uint32_t)ctx, .default_max_tokens = (uint32_t)max_tokens,
                                   .lanes = (uint32_t)lanes};
        if (kvb_llama_door_start(&c, &door, &err)) goto fail;
        printf("kvbridge decode node: OpenAI API on port %u in front of llama-server %s, prefill node %s\n",
               kvb_llama_door_port(door), a.decoder + 13, peer ? peer : "none (llama-server computes every prompt)");
    } else {
        kvb_decode_config c = {.http_listen = http, .peers = a.peers.v, .n_peers = (uint32_t)a.peers.n,
                               .peer_max_queue = (uint32_t)a.peer_max_queue, .name = a.name, .model_path = model, .model_id = model_id,
                               .psk = psk, .backend = backend, .chat_template = tmpl, .n_threads = (int)threads, .cache_dtype = cache_type,
                               .block_tokens = (uint32_t)bt, .max_ctx = (uint32_t)ctx,
                               .bridge_min_tokens = (uint32_t)bridge_min, .default_max_tokens = (uint32_t)max_tokens,
                               .prefill_mode = prefill_mode, .cache_blocks = (uint32_t)cache_blocks,
                               .tail_after_transfer = tail_after, .lanes = (uint32_t)lanes,
                               .bridge_resumes = resumes < 0 ? 0 : resumes == 0 ? -1 : (int)resumes,
                               .parallel = (uint32_t)parallel, .api_key = api_key,
                               .allow_origins = allow_origin};
        if (kvb_decode_node_start(&c, &dn, &err)) goto fail;
        printf("kvbridge decode node: OpenAI API on port %u, prefill node%s %s", kvb_decode_node_port(dn),
               a.peers.n > 1 ? "s" : "", peer ? peer : "none (native only)");
        for (int i = 1; i < a.peers.n; i++) printf(", %s", a.peers.v[i]);
        printf("\n");
    }
    fflush(stdout);
    while (!g_stop) usleep(100000);
    if (drain_s > 0 && g_stop == 1) { /* a graceful stop: the requests in flight finish */
        if (dn) kvb_decode_node_quiesce(dn);
        if (pn) kvb_prefill_node_quiesce(pn);
        const double t0 = kvb_now_s();
        kvb_log(KVB_LOG_WARN, "serve: draining %u request(s), up to %lld s (signal again to stop at once)",
                in_flight(dn, pn), drain_s);
        while (g_stop == 1 && in_flight(dn, pn) > 0 && kvb_now_s() - t0 < (double)drain_s) usleep(50000);
        if (in_flight(dn, pn)) kvb_log(KVB_LOG_WARN, "serve: stopping with %u request(s) unfinished", in_flight(dn, pn));
    }
    kvb_prefill_node_stop(pn);
    kvb_decode_node_stop(dn);
    kvb_llama_door_stop(door);
    return 0;
fail:
    fprintf(stderr, "kvbridge serve: %s\n", err.msg);
    return 1;
}
