/* cli/cmd_serve.c — `kvbridge serve --role prefill|decode`: runs one node until SIGINT/SIGTERM. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvb_cli.h"
#include "kvb_node.h"
#include "kvb_quant.h"

static void help(FILE *f) {
    fprintf(f,
            "usage: kvbridge serve --role prefill --listen ADDR -m MODEL [options]\n"
            "       kvbridge serve --role decode --http ADDR -m MODEL [--peer ADDR] [options]\n\n"
            "prefill  computes the decode node's own KV cache for the prompts it is sent and streams it\n"
            "decode   the front door: an OpenAI-compatible API (/v1/chat/completions, /v1/completions,\n"
            "         /v1/models, /health, /metrics) that bridges long prompts through the prefill node\n\n"
            "  -m, --model FILE     the decoder's GGUF (both roles load the same file)\n"
            "  --listen HOST:PORT   prefill: where decode nodes connect\n"
            "  --http HOST:PORT     decode: the HTTP API address; prefill (optional): /health and /metrics for\n"
            "                       probes and scrapers\n"
            "  --peer HOST:PORT     decode: the prefill node (omit to always compute natively)\n"
            "  --psk KEY            pre-shared key, >= 16 bytes (or env KVB_PSK); both nodes need the same\n"
            "  --api-key KEY        decode: /v1/* require 'Authorization: Bearer KEY' (clients: their OpenAI\n"
            "                       api_key), >= 8 bytes (or env KVB_API_KEY); /health and /metrics stay open\n"
            "  --allow-origin LIST  decode: browser pages from these origins may call the API (CORS):\n"
            "                       https://ui.example[,https://other.example], or * for any\n"
            "  --cache-type T       the decoder's cache dtype: f16 (default), f32, bf16, q8_0\n"
            "  --block-tokens N     tokens per cache block (default 32)\n"
            "  --ctx N              context limit in tokens\n"
            "  --threads T          CPU threads (default: all)\n"
            "  --bridge-min N       decode: bridge only when at least N tokens are uncached (default 2 blocks)\n"
            "  --max-tokens N       decode: completion length when a request names none (default 256)\n"
            "  --chat-template NAME decode: override the chat template family\n"
            "  --model-id NAME      decode: the model name the API reports\n"
            "  --bridge-mode M      decoder (default: the decoder's own arithmetic, exact) or prefill (the prefill\n"
            "                       engine's own K/V re-encoded: cheaper, not exact); both nodes must agree\n"
            "  --engine-cache-type T prefill, bridge mode prefill: this node's own cache dtype (default: the decoder's)\n"
            "  --device cpu|cuda    prefill: the engine that prefills (default cpu); cuda prefills in bf16 on the\n"
            "                       GPU and runs the bridge kernel there (decoder mode)\n"
            "  --chunk N            prefill: tokens per forward chunk (default 512 on cpu, 8192 on cuda)\n"
            "  --gpus N             prefill, cuda: tensor-parallel prefill over GPUs 0..N-1 (NCCL); the decoder\n"
            "                       receives the same slab sequence as from one GPU\n"
            "  --tp-one-device      prefill, cuda, --gpus N: every rank on one GPU (tests the split; not faster)\n"
            "  --warmup N           prefill, cuda: before listening, prefill N random tokens twice with the\n"
            "                       bridge's kernels (rows dropped) so the first request does not pay for loading\n"
            "                       the GPU kernels and libraries and cuDNN's plan for a full first chunk\n"
            "                       (default: one chunk and 64 tokens; 0 = none)\n"
            KVB_CLI_GPU_WEIGHTS_HELP
            "  --cache-blocks N     decode: prefix-cache size in blocks (default: 4 contexts' worth)\n"
            "  --tail-after-transfer  decode: compute the prompt's last token after the bridged cache has\n"
            "                       arrived, not layer by layer while it arrives (the default, same answer)\n"
            "  --lanes N            decode: connections to the prefill node that each bridged request's slabs\n"
            "                       are striped over, each with its own receiving thread (1..8, default 4)\n"
            "  --parallel N         decode: requests served at once, their decode steps run as one batch (the\n"
            "                       weights read once per step for all; default 4, at most 64). Each is\n"
            "                       admitted, in arrival order, once the cache blocks its prompt and\n"
            "                       max_tokens can fill fit beside the others' in --cache-blocks\n"
            "  --bridge-resumes N   decode: after a corrupt slab or a dropped connection, ask the prefill node\n"
            "                       again for only the blocks still missing, at most N times per request\n"
            "                       (default 2; 0 = compute what is missing natively at once)\n"
            "  --fault SPEC         prefill, test-only: corrupt:N, die:N, stall:N (30 s) or pause:N (2 s) at\n"
            "                       the Nth slab of every request, or of the first K with corrupt:NxK (...)\n"
            "  --bench-filler-rows  prefill, bench-only: ship filler rows without computing them, to time the\n"
            "                       slab path across a real link (kvbridge bench ladder --peer ADDR\n"
            "                       --slab-path-only). The node then announces a model fingerprint of its\n"
            "                       own, so a decode node serving answers refuses it as another model\n"
            "  --drain-seconds N    on SIGINT/SIGTERM let the requests in flight finish for up to N s (default\n"
            "                       30; 0: stop at once) while refusing new ones (decode: HTTP 503; prefill: the\n"
            "                       decoder is told to compute the prompt itself); a second signal stops\n"
            "  --quiet              log warnings and errors only (by default also one line per completion,\n"
            "                       connections and faults)\n"
            "  --verbose            also log every other request (probes, scrapes) and the HTTP library's notes\n");
}

/* Requests the node in this process has in flight (the role it runs). */
static unsigned in_flight(kvb_decode_node *dn, kvb_prefill_node *pn) {
    return dn ? kvb_decode_node_in_flight(dn) : kvb_prefill_node_in_flight(pn);
}

static volatile sig_atomic_t g_stop; /* signals received: the first drains, the second stops */
static void on_signal(int sig) {
    (void)sig;
    g_stop = g_stop + 1;
}

int kvb_cmd_serve(int argc, char **argv) {
    const char *cmd = "serve", *role = NULL, *model = NULL, *listen = NULL, *http = NULL, *peer = NULL,
               *psk = getenv("KVB_PSK"), *tmpl = NULL, *model_id = NULL, *fault = NULL, *mode = "decoder",
               *device = "cpu", *api_key = NULL, *allow_origin = NULL;
    long long threads = 0, bt = 32, ctx = 0, bridge_min = 0, max_tokens = 0, chunk = 0, cache_blocks = 0, lanes = 0,
              warmup = -1, resumes = -1, parallel = 0, drain_s = 30;
    long long gpus = 1;
    bool tail_after = false, tp_one_device = false, filler = false;
    kvb_log_level log_level = KVB_LOG_INFO; /* a server's access log is on unless asked off */
    int gpu_weights = 0;
    uint32_t cache_type = KVB_TYPE_F16, engine_type = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (kvb_arg_is_help(a)) {
            help(stdout);
            return 0;
        }
#define STR(opt, var) else if (!strcmp(a, opt)) { if (!(var = kvb_arg_value(cmd, argc, argv, &i))) return 2; }
#define NUM(opt, var, lo, hi)                                                                                   \
    else if (!strcmp(a, opt)) {                                                                                 \
        if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, lo, hi, &var)) return 2;      \
    }
        STR("--role", role) STR("-m", model) STR("--model", model) STR("--listen", listen) STR("--http", http)
        STR("--peer", peer) STR("--psk", psk) STR("--chat-template", tmpl) STR("--model-id", model_id)
        STR("--fault", fault) STR("--bridge-mode", mode) STR("--device", device) STR("--api-key", api_key)
        STR("--allow-origin", allow_origin)
        NUM("--chunk", chunk, 16, 1 << 20) NUM("--cache-blocks", cache_blocks, 16, 1LL << 31)
        NUM("--warmup", warmup, 0, 1 << 24)
        NUM("--threads", threads, 1, 1024) NUM("--block-tokens", bt, 1, 4096) NUM("--ctx", ctx, 16, 1 << 24)
        NUM("--bridge-min", bridge_min, 1, 1 << 24) NUM("--max-tokens", max_tokens, 1, 1 << 24)
        NUM("--lanes", lanes, 1, KVB_MAX_LANES) NUM("--bridge-resumes", resumes, 0, 100)
        NUM("--parallel", parallel, 1, KVB_DECODE_MAX_PARALLEL) NUM("--gpus", gpus, 1, KVB_CLI_MAX_GPUS)
        NUM("--drain-seconds", drain_s, 0, 86400)
        else if (!strcmp(a, "--cache-type")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_type(cmd, a, v, &cache_type)) return 2;
        }
        else if (!strcmp(a, "--engine-cache-type")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_type(cmd, a, v, &engine_type)) return 2;
        }
        else if (!strcmp(a, "--verbose") || !strcmp(a, "-v")) log_level = KVB_LOG_DEBUG;
        else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) log_level = KVB_LOG_WARN;
        else if (!strcmp(a, "--tail-after-transfer")) tail_after = true;
        else if (!strcmp(a, "--tp-one-device")) tp_one_device = true;
        else if (!strcmp(a, "--bench-filler-rows")) filler = true;
        else if (!strcmp(a, "--gpu-weights")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_gpu_weights(cmd, v, &gpu_weights)) return 2;
        }
        else {
            fprintf(stderr, "kvbridge serve: unknown option '%s' (see kvbridge serve --help)\n", a);
            return 2;
        }
#undef STR
#undef NUM
    }
    if (!role || (strcmp(role, "prefill") && strcmp(role, "decode")) || !model) {
        fprintf(stderr, "kvbridge serve: give --role prefill|decode and -m MODEL (see kvbridge serve --help)\n");
        return 2;
    }
    bool prefill = !strcmp(role, "prefill");
    if (strcmp(mode, "decoder") && strcmp(mode, "prefill")) {
        fprintf(stderr, "kvbridge serve: --bridge-mode expects decoder or prefill, got '%s'\n", mode);
        return 2;
    }
    bool prefill_mode = !strcmp(mode, "prefill");
    if (strcmp(device, "cpu") && strcmp(device, "cuda")) {
        fprintf(stderr, "kvbridge serve: --device expects cpu or cuda, got '%s'\n", device);
        return 2;
    }
    if (!prefill && (gpus > 1 || tp_one_device)) {
        fprintf(stderr, "kvbridge serve: --gpus and --tp-one-device are the prefill node's (--role prefill --device "
                        "cuda); a decode node decodes on its CPU\n");
        return 2;
    }
    if (filler && (!prefill || !strcmp(device, "cuda"))) {
        fprintf(stderr, "kvbridge serve: --bench-filler-rows is for --role prefill on the CPU (it computes nothing)\n");
        return 2;
    }
    if (prefill && allow_origin) {
        fprintf(stderr, "kvbridge serve: --allow-origin is for --role decode (the HTTP API)\n");
        return 2;
    }
    if (prefill && api_key) {
        fprintf(stderr, "kvbridge serve: --api-key is for --role decode (it guards the HTTP API); the prefill node's "
                        "link is authenticated by --psk\n");
        return 2;
    }
    if (!prefill && !api_key) api_key = getenv("KVB_API_KEY");
    if (!kvb_arg_gpus_ok("serve", gpus, tp_one_device, !strcmp(device, "cuda")) ||
        !kvb_arg_gpu_weights_ok("serve", gpu_weights, !strcmp(device, "cuda")))
        return 2;
    if (prefill ? !listen : !http) {
        fprintf(stderr, "kvbridge serve: --role %s needs %s HOST:PORT\n", role, prefill ? "--listen" : "--http");
        return 2;
    }
    kvb_log_set_level(log_level);
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    signal(SIGPIPE, SIG_IGN);
    kvb_err err = {0};
    kvb_prefill_node *pn = NULL;
    kvb_decode_node *dn = NULL;
    if (prefill) {
        kvb_prefill_config c = {.listen = listen, .http_listen = http, .model_path = model, .psk = psk, .n_threads = (int)threads,
                                .cache_dtype = cache_type, .block_tokens = (uint32_t)bt, .max_ctx = (uint32_t)ctx,
                                .fault = fault, .prefill_mode = prefill_mode, .engine_cache_dtype = engine_type,
                                .cuda = !strcmp(device, "cuda"), .chunk_tokens = (uint32_t)chunk,
                                .gpus = (int)gpus, .tp_one_device = tp_one_device, .gpu_weights = gpu_weights,
                                .warmup_tokens = (uint32_t)(warmup >= 0 ? warmup : (chunk ? chunk : 8192) + 64),
                                .bench_filler_rows = filler};
        if (kvb_prefill_node_start(&c, &pn, &err)) goto fail;
        double wu_s = 0;
        const uint32_t wu = kvb_prefill_node_warmup(pn, &wu_s);
        printf("kvbridge prefill node: listening on port %u (model %s", kvb_prefill_node_port(pn), model);
        if (wu) printf("; GPU warmed up on %u tokens in %.2f s", wu, wu_s);
        if (filler) printf("; FILLER ROWS, bench only: only a decoder started for filler accepts this node");
        if (kvb_prefill_node_http_port(pn)) printf("; /health and /metrics on port %u", kvb_prefill_node_http_port(pn));
        printf(")\n");
    } else {
        kvb_decode_config c = {.http_listen = http, .peer = peer, .model_path = model, .model_id = model_id,
                               .psk = psk, .chat_template = tmpl, .n_threads = (int)threads, .cache_dtype = cache_type,
                               .block_tokens = (uint32_t)bt, .max_ctx = (uint32_t)ctx,
                               .bridge_min_tokens = (uint32_t)bridge_min, .default_max_tokens = (uint32_t)max_tokens,
                               .prefill_mode = prefill_mode, .cache_blocks = (uint32_t)cache_blocks,
                               .tail_after_transfer = tail_after, .lanes = (uint32_t)lanes,
                               .bridge_resumes = resumes < 0 ? 0 : resumes == 0 ? -1 : (int)resumes,
                               .parallel = (uint32_t)parallel, .api_key = api_key,
                               .allow_origins = allow_origin};
        if (kvb_decode_node_start(&c, &dn, &err)) goto fail;
        printf("kvbridge decode node: OpenAI API on port %u, prefill node %s\n", kvb_decode_node_port(dn),
               peer ? peer : "none (native only)");
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
    return 0;
fail:
    fprintf(stderr, "kvbridge serve: %s\n", err.msg);
    return 1;
}
