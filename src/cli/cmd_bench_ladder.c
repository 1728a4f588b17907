/* cli/cmd_bench_ladder.c — `kvbridge bench ladder`: time to first token, decoder alone vs
 * bridged, over a ladder of cold prompt lengths. Each leg gets a fresh random prompt (a fresh
 * seed), so neither node's prefix cache helps; several seeds per length; medians with every run
 * listed; a verdict on every row. Both nodes run in this process on loopback unless --peer names
 * a running prefill node. */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_quant.h"

static void help(FILE *f) {
    fprintf(f,
            "usage: kvbridge bench ladder -m MODEL [--lengths 1024,4096,16384] [--seeds 3] [options]\n\n"
            "Time to first token (a completion of 1 token) for cold prompts: on a decode node alone, and on a\n"
            "decode node bridged to a prefill node; prints both, their ratio, bytes per token shipped, transfer\n"
            "GB/s and the prefill node's peak capture memory.\n\n"
            "  -m FILE              GGUF model (both nodes)\n"
            "  --lengths LIST       prompt lengths in tokens (default 1024,4096)\n"
            "  --seeds N            prompts per length (default 3)\n"
            "  --threads T          threads per node (default: half the CPUs each)\n"
            "  --peer HOST:PORT     use a running prefill node instead of one in this process (needs --psk);\n"
            "                       with --slab-path-only, one started with serve --bench-filler-rows\n"
            "  --psk KEY            its pre-shared key (or env KVB_PSK)\n"
            "  --raw-peer HOST:PORT with --peer and --slab-path-only: a `kvbridge bench link --listen HOST:PORT`\n"
            "                       beside the prefill node, so the raw link is timed over the same network\n"
            "  --cache-type T       the decoder's cache dtype (default f16)\n"
            "  --device cpu|cuda    the in-process prefill node's engine (default cpu); with cuda the column\n"
            "                       'prefill alone' is the GPU prefilling the same length with the bridge idle,\n"
            "                       up to the last token's logits (the GPU's own time to a first token),\n"
            "                       and 'vs alone' is bridged TTFT / that time\n"
            "  --block-tokens N     the decoder's cache block in tokens (default 32): a slab carries one block's\n"
            "                       rows of one layer, so this sets how many slabs a prompt takes\n"
            "  --lanes N            connections from the decoder to the prefill node that a bridged request's\n"
            "                       slabs are striped over (1..%d; default: the decode node's, %d); the raw\n"
            "                       TCP loopback each row is measured against (the link floor, or with\n"
            "                       --slab-path-only the raw link's GB/s) uses as many streams at once\n"
            "  --chunk N            prefill node chunk in tokens (default 512 on cpu, 8192 on cuda and with\n"
            "                       --slab-path-only)\n"
            "  --gpus N             cuda: the prefill node's tensor-parallel ranks (GPUs 0..N-1, NCCL)\n"
            "  --tp-one-device      cuda, --gpus N: every rank on one GPU (tests the split; not faster)\n"
            KVB_CLI_GPU_WEIGHTS_HELP
            "  --alone-max N        run the decoder-alone legs only up to N tokens (default 1048576); longer\n"
            "                       rows print 'not run'\n"
            "  --prefill-alone-max N  time the in-process prefill node alone only up to N tokens (default\n"
            "                       1048576): once with the bridge idle, up to the last token's logits\n"
            "                       ('prefill alone'), and once with the bridge computing and cutting the\n"
            "                       decoder's rows, which are then dropped instead of sent, and no logits\n"
            "                       ('+bridge'): the prefill node's own work for a bridged request, so\n"
            "                       'vs +bridge' is what the link and the exchange add to it\n"
            "  --warmup N           untimed bridged prompts of each length before its timed ones (default 2\n"
            "                       with --device cuda: a length's first prompt runs on the engine's kernel,\n"
            "                       the second gets cuDNN's plans for its shapes; 0 on cpu). The in-process\n"
            "                       CUDA prefill node also warms up at start, as serve --role prefill does\n"
            "  --slab-path-only     the in-process prefill node ships filler rows without computing them: the\n"
            "                       time and GB/s of the slab path alone (cutting, staging, transport, the\n"
            "                       decoder's verification and commit) — its ceiling; the decoder's last\n"
            "                       token then runs after the transfer, not beside it. The decoder's cache\n"
            "                       holds filler, so no decoder-alone or prefill-alone legs are run. After\n"
            "                       each bridged leg the same bytes also go over plain TCP loopback\n"
            "                       connections, as many streams at once as the decoder has lanes; a row\n"
            "                       prints the slab path's median GB/s as a share of those raw runs' median.\n"
            "                       The filler goes a chunk's layer at a time (8192 tokens unless --chunk),\n"
            "                       as a CUDA prefill node's bridge hands its rows over\n",
            KVB_MAX_LANES, KVB_DEFAULT_LANES);
}


typedef struct {
    double ttft;
    int bridged;
    double transfer_s, prefill_s, native_s; /* usage.kvbridge phases */
    bool pipelined;                         /* usage.kvbridge.native_pipelined */
    char verdict[160];
} leg;

static int one_leg(uint16_t port, int len, uint64_t seed, uint32_t n_vocab, leg *out) {
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)len);
    kvb_rng r;
    kvb_rng_seed(&r, seed);
    for (int i = 0; i < len; i++) ids[i] = (int32_t)(kvb_rng_u64(&r) % n_vocab);
    cJSON *req = cJSON_CreateObject();
    cJSON_AddStringToObject(req, "model", "m");
    cJSON_AddItemToObject(req, "prompt", cJSON_CreateIntArray(ids, len));
    cJSON_AddNumberToObject(req, "max_tokens", 1);
    cJSON_AddNumberToObject(req, "temperature", 0);
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    free(ids);
    kvb_http_reply h;
    kvb_err err = {0};
    double t0 = kvb_now_s();
    kvb_status st = kvb_http_post("127.0.0.1", port, "/v1/completions", body, 3600 * 1000, &h, &err);
    out->ttft = kvb_now_s() - t0;
    kvb_trace_span("client.ttft", t0, t0 + out->ttft, (uint64_t)len); /* the HTTP request, sent to answered */
    free(body);
    if (st || h.status != 200) {
        fprintf(stderr, "kvbridge bench ladder: %s\n", st ? err.msg : h.body);
        if (!st) kvb_http_reply_free(&h);
        return -1;
    }
    snprintf(out->verdict, sizeof out->verdict, "%s", h.verdict);
    cJSON *root = cJSON_Parse(h.body);
    cJSON *kb = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "usage"), "kvbridge");
    out->bridged = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(kb, "bridged_tokens"));
    out->transfer_s = cJSON_GetNumberValue(cJSON_GetObjectItem(kb, "transfer_s"));
    out->prefill_s = cJSON_GetNumberValue(cJSON_GetObjectItem(kb, "prefill_s"));
    out->native_s = cJSON_GetNumberValue(cJSON_GetObjectItem(kb, "native_s"));
    out->pipelined = cJSON_IsTrue(cJSON_GetObjectItem(kb, "native_pipelined"));
    cJSON_Delete(root);
    kvb_http_reply_free(&h);
    return 0;
}

int kvb_bench_ladder(int argc, char **argv) {
    const char *model = NULL, *lengths = "1024,4096", *peer = NULL, *psk = getenv("KVB_PSK"), *raw_peer = NULL;
    long long seeds = 3, threads = 0, chunk = 0, alone_max = 1 << 20, pa_max = 1 << 20, warmup = -1, block = 32,
              lanes = 0, /* 0: the decode node's default */
              gpus = 1;
    uint32_t cache_type = KVB_TYPE_F16;
    bool cuda = false, filler = false, tp_one_device = false;
    int gpu_weights = 0;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v;
        if (kvb_arg_is_help(a)) {
            help(stdout);
            return 0;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            if (!(model = kvb_arg_value("bench", argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--lengths")) {
            if (!(lengths = kvb_arg_value("bench", argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--peer")) {
            if (!(peer = kvb_arg_value("bench", argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--raw-peer")) {
            if (!(raw_peer = kvb_arg_value("bench", argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--psk")) {
            if (!(psk = kvb_arg_value("bench", argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--seeds")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 1, 100, &seeds)) return 2;
        } else if (!strcmp(a, "--threads")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 1, 1024, &threads)) return 2;
        } else if (!strcmp(a, "--cache-type")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_type("bench", a, v, &cache_type)) return 2;
        } else if (!strcmp(a, "--block-tokens")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 1, 4096, &block)) return 2;
        } else if (!strcmp(a, "--lanes")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 1, KVB_MAX_LANES, &lanes))
                return 2;
        } else if (!strcmp(a, "--chunk")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 16, 1 << 20, &chunk)) return 2;
        } else if (!strcmp(a, "--alone-max")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 0, 1 << 24, &alone_max))
                return 2;
        } else if (!strcmp(a, "--prefill-alone-max")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 0, 1 << 24, &pa_max))
                return 2;
        } else if (!strcmp(a, "--warmup")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 0, 100, &warmup)) return 2;
        } else if (!strcmp(a, "--slab-path-only")) {
            filler = true;
            alone_max = pa_max = 0;
        } else if (!strcmp(a, "--device")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i))) return 2;
            if (strcmp(v, "cpu") && strcmp(v, "cuda")) {
                fprintf(stderr, "kvbridge bench ladder: --device expects 'cpu' or 'cuda', got '%s'\n", v);
                return 2;
            }
            cuda = !strcmp(v, "cuda");
        } else if (!strcmp(a, "--gpus")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 1, KVB_CLI_MAX_GPUS, &gpus)) return 2;
        } else if (!strcmp(a, "--tp-one-device")) {
            tp_one_device = true;
        } else if (!strcmp(a, "--gpu-weights")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_gpu_weights("bench ladder", v, &gpu_weights))
                return 2;
        } else {
            fprintf(stderr, "kvbridge bench ladder: unknown option '%s' (see kvbridge bench ladder --help)\n", a);
            return 2;
        }
    }
    if (!kvb_arg_gpus_ok("bench ladder", gpus, tp_one_device, cuda) ||
        !kvb_arg_gpu_weights_ok("bench ladder", gpu_weights, cuda))
        return 2;
    if (!model) {
        fprintf(stderr, "kvbridge bench ladder: -m MODEL is required\n");
        return 2;
    }
    if (filler && peer && !raw_peer) {
        fprintf(stderr, "kvbridge bench ladder: --slab-path-only with --peer needs --raw-peer HOST:PORT (a kvbridge "
                        "bench link --listen beside the prefill node), so the raw link is timed over the same network\n");
        return 2;
    }
    if (raw_peer && !(filler && peer)) {
        fprintf(stderr, "kvbridge bench ladder: --raw-peer goes with --peer and --slab-path-only\n");
        return 2;
    }
    int lens[32], n_lens = 0, max_len = 0;
    for (const char *p = lengths; *p && n_lens < 32;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 2 || v > (1 << 24)) {
            fprintf(stderr, "kvbridge bench ladder: --lengths expects comma-separated token counts, got '%s'\n", lengths);
            return 2;
        }
        lens[n_lens++] = (int)v;
        max_len = (int)v > max_len ? (int)v : max_len;
        p = *end == ',' ? end + 1 : end;
    }
    /* with a GPU prefilling, the CPUs belong to the decode nodes (one runs at a time) */
    if (threads == 0) threads = cuda ? kvb_cpu_count() : (kvb_cpu_count() / 2 > 0 ? kvb_cpu_count() / 2 : 1);
    char key[40];
    if (!psk) {
        kvb_rng r;
        kvb_rng_seed(&r, (uint64_t)(kvb_now_s() * 1e9));
        snprintf(key, sizeof key, "%016llx%016llx", (unsigned long long)kvb_rng_u64(&r),
                 (unsigned long long)kvb_rng_u64(&r));
        psk = key;
    }
    kvb_err err = {0};
    kvb_prefill_node *pn = NULL;
    kvb_decode_node *dn = NULL, *alone = NULL;
    kvb_model *m = NULL;
    int rc = 1;
    char peer_addr[64];
    uint32_t ctx = (uint32_t)max_len + 64;
    if (kvb_model_load(model, &m, &err)) goto fail;
    if (!peer) {
        kvb_prefill_config pc = {.listen = "127.0.0.1:0", .model_path = model, .psk = psk, .n_threads = (int)threads,
                                 .cache_dtype = cache_type, .max_ctx = ctx, .cuda = cuda,
                                 .chunk_tokens = (uint32_t)chunk, .bench_filler_rows = filler,
                                 .block_tokens = (uint32_t)block, .gpus = (int)gpus,
                                 .tp_one_device = tp_one_device, .gpu_weights = gpu_weights,
                                 .warmup_tokens = filler ? 0 : (uint32_t)(chunk ? chunk : 8192) + 64};
        if (kvb_prefill_node_start(&pc, &pn, &err)) goto fail;
        snprintf(peer_addr, sizeof peer_addr, "127.0.0.1:%u", kvb_prefill_node_port(pn));
        peer = peer_addr;
    }
    kvb_decode_config dc = {.http_listen = "127.0.0.1:0", .peer = peer, .model_path = model, .psk = psk,
                            .n_threads = (int)threads, .cache_dtype = cache_type, .max_ctx = ctx,
                            .peer_timeout_ms = 600000, .block_tokens = (uint32_t)block, .lanes = (uint32_t)lanes,
                            .tail_after_transfer = filler, /* the slab path's ceiling, measured alone */
                            .bench_filler_peer = filler,
                            /* one prompt's blocks and some room: legs use fresh prompts, LRU evicts */
                            .cache_blocks = (ctx + (uint32_t)block - 1) / (uint32_t)block + 64};
    if (kvb_decode_node_start(&dc, &dn, &err)) goto fail;
    /* the raw-link yardsticks stream as many connections at once as the bridge stripes over */
    const uint32_t lanes_used = lanes ? (uint32_t)lanes : KVB_DEFAULT_LANES;
    kvb_decode_config ac = dc;
    ac.peer = NULL;
    if (kvb_decode_node_start(&ac, &alone, &err)) goto fail;
    printf("ladder: %s, %lld decoder threads, prefill node %s (%s), decoder cache %s, %u lanes\n", model, threads,
           peer,
           !pn ? "remote" : filler ? "filler rows, in process: the slab path alone"
                          : cuda ? "CUDA engine, in process" : "CPU engine, in process",
           kvb_type_name(cache_type), lanes_used);
    if (warmup < 0) warmup = cuda ? 2 : 0; /* the second builds cuDNN's plans (kvb_cudnn_attn_take) */
    if (warmup)
        printf("warm-up    %lld untimed bridged prompt(s) of each length first (fresh tokens, no cache hits): the "
               "prefill node's\n           per-shape state (cuDNN execution plans) is then built, as on a server "
               "that has seen this length\n",
               warmup);
    printf("%8s  %12s  %12s  %6s  %13s  %9s  %8s  %10s  %10s  %9s  %s\n", "tokens", "alone TTFT s", "bridged s",
           "ratio", "prefill alone", "vs alone", "+bridge", "vs +bridge", "bytes/tok", "GB/s", "verdicts (bridged)");
    /* what a leg ships: global layers' rows for every shipped position, local (sliding-window)
     * layers' rows only where the decoder keeps them (the decode node's blocks) */
    kvb_kvformat lf;
    if (kvb_model_kvformat(&m->d, cache_type, (uint32_t)block, &lf, &err)) goto fail;
    uint64_t tok_global, tok_local;
    kvb_kvformat_token_bytes(&lf, &tok_global, &tok_local);
    uint64_t seed = (uint64_t)(kvb_now_s() * 1e3);
    for (int li = 0; li < n_lens; li++) {
        double a[100], b[100], gbs[100], pa[100], pb[100], ph_pre[100], ph_xfer[100], ph_nat[100];
        double raw_gbs[100]; /* --slab-path-only: the raw link right after each bridged leg */
        int n_piped = 0; /* bridged legs whose last token ran with the transfer */
        uint64_t len_global, len_local;
        kvb_kvformat_ship_bytes(&lf, 0, (uint32_t)lens[li] - 1, &len_global, &len_local);
        const double bytes_per_tok = (double)(len_global + len_local) / lens[li];
        char verdicts[512] = "";
        const bool run_alone = lens[li] <= alone_max;
        for (int w = 0; w < warmup; w++) {
            leg lw = {0};
            if (one_leg(kvb_decode_node_port(dn), lens[li], seed++, m->d.n_vocab, &lw)) goto done;
            fprintf(stderr, "ladder %d tokens, warm-up %d: bridged %.3f s (%s)\n", lens[li], w + 1, lw.ttft, lw.verdict);
        }
        for (int s = 0; s < seeds; s++) {
            leg la = {0}, lb;
            /* a fresh prompt for each leg: neither node has seen it */
            if ((run_alone && one_leg(kvb_decode_node_port(alone), lens[li], seed++, m->d.n_vocab, &la)) ||
                one_leg(kvb_decode_node_port(dn), lens[li], seed++, m->d.n_vocab, &lb))
                goto done;
            pa[s] = pb[s] = 0;
            if (pn && lens[li] <= pa_max &&
                (kvb_prefill_node_time_alone(pn, (uint32_t)lens[li], seed++, false, &pa[s], &err) ||
                 kvb_prefill_node_time_alone(pn, (uint32_t)lens[li], seed++, true, &pb[s], &err)))
                goto fail;
            a[s] = la.ttft;
            b[s] = lb.ttft;
            ph_pre[s] = lb.prefill_s;
            ph_xfer[s] = lb.transfer_s;
            ph_nat[s] = lb.native_s;
            n_piped += lb.pipelined;
            uint64_t leg_g, leg_l; /* what this leg shipped (all of it when complete) */
            kvb_kvformat_ship_bytes(&lf, 0, (uint32_t)lb.bridged, &leg_g, &leg_l);
            gbs[s] = lb.transfer_s > 0 ? (double)(leg_g + leg_l) / lb.transfer_s / 1e9 : 0;
            /* the raw link the same way, beside each leg: the loopback's own speed wanders from run
             * to run (11-19 GB/s over 4 streams on the H100/H200 hosts), so one sample per length
             * made the share swing by tens of percent */
            raw_gbs[s] = !filler  ? 0
                         : raw_peer ? kvb_bench_raw_remote_gbs(raw_peer, len_global + len_local, 65536, lanes_used)
                                    : kvb_bench_raw_loopback_gbs(len_global + len_local, 65536, lanes_used);
            fprintf(stderr,
                    "ladder %d tokens, seed %d: alone %.3f s, bridged %.3f s (%s), prefill alone %.3f s, +bridge %.3f s\n",
                    lens[li], s, la.ttft, lb.ttft, lb.verdict, pa[s], pb[s]);
            strncat(verdicts, s ? ", " : "", sizeof verdicts - strlen(verdicts) - 1);
            strncat(verdicts, lb.verdict, sizeof verdicts - strlen(verdicts) - 1);
        }
        double ma = kvb_median_sort(a, (int)seeds), mb = kvb_median_sort(b, (int)seeds);
        double mg = kvb_median_sort(gbs, (int)seeds), mp = kvb_median_sort(pa, (int)seeds);
        const double mpb = kvb_median_sort(pb, (int)seeds);
        char ca[16] = "not run", cr[16] = "-", cp[16] = "-", cv[16] = "-", cpb[16] = "-", cvb[16] = "-";
        if (run_alone) {
            snprintf(ca, sizeof ca, "%.3f", ma);
            snprintf(cr, sizeof cr, "%.2fx", ma / mb);
        }
        const bool ran_pa = pn && lens[li] <= pa_max;
        if (ran_pa) {
            snprintf(cp, sizeof cp, "%.3f", mp);
            snprintf(cv, sizeof cv, "%.2fx", mb / mp);
            snprintf(cpb, sizeof cpb, "%.3f", mpb);
            snprintf(cvb, sizeof cvb, "%.2fx", mb / mpb);
        }
        printf("%8d  %12s  %12.3f  %6s  %13s  %9s  %8s  %10s  %10.0f  %9.2f  %s\n", lens[li], ca, mb, cr, cp, cv, cpb,
               cvb, bytes_per_tok, mg, verdicts);
        printf("          runs alone:");
        if (run_alone)
            for (int s = 0; s < seeds; s++) printf(" %.3f", a[s]);
        else printf(" (not run: longer than --alone-max %lld)", alone_max);
        printf("; bridged:");
        for (int s = 0; s < seeds; s++) printf(" %.3f", b[s]);
        if (ran_pa) {
            printf("; prefill alone:");
            for (int s = 0; s < seeds; s++) printf(" %.3f", pa[s]);
            printf("; +bridge:");
            for (int s = 0; s < seeds; s++) printf(" %.3f", pb[s]);
        }
        printf(" (sorted)\n");
        if (lf.window)
            printf("          bytes per prompt token: global layers %.1f + local layers %.1f (window %u: rows kept "
                   "for %llu positions) = %.1f; every row of every layer would be %.1f\n",
                   (double)len_global / lens[li], (double)len_local / lens[li], lf.window,
                   (unsigned long long)(tok_local ? len_local / tok_local : 0), bytes_per_tok,
                   (double)(tok_global + tok_local) * (lens[li] - 1) / lens[li]);
        const double tail_med = kvb_median_sort(ph_nat, (int)seeds); /* (sorts ph_nat) */
        printf("          bridged phases (medians): prefill node %.3f s, exchange (request to DONE) %.3f s, decoder's "
               "native tail %.3f s (after DONE; pipelined with the transfer in %d of %lld)\n",
               kvb_median_sort(ph_pre, (int)seeds), kvb_median_sort(ph_xfer, (int)seeds), tail_med, n_piped, seeds);
        printf("          decoder's tail after DONE, each bridged prompt (sorted):");
        for (int s = 0; s < seeds; s++) printf(" %.4f", ph_nat[s]);
        printf(" s\n");
        if (filler) {
            /* the raw link the same way in the same run: as many bytes as one leg shipped, after each leg */
            const double raw = kvb_median_sort(raw_gbs, (int)seeds);
            printf("          raw TCP %s%s, %u stream%s, same bytes, after each leg: %.2f GB/s (median; runs",
                   raw_peer ? "to " : "loopback", raw_peer ? raw_peer : "", lanes_used, lanes_used == 1 ? "" : "s", raw);
            for (int s = 0; s < seeds; s++) printf(" %.2f", raw_gbs[s]);
            printf(", sorted); slab path / raw: %.0f %%\n", raw > 0 ? 100.0 * mg / raw : 0.0);
        } else if (pn && mp > 0) {
            /* the floor a link sets: bridged time to first token cannot beat the prefill alone, nor
             * the time the raw link takes for the bytes (measured now, the same way as bench link) */
            const uint64_t leg_bytes = len_global + len_local;
            const double raw = kvb_bench_raw_loopback_gbs(leg_bytes, 65536, lanes_used);
            const double link_s = raw > 0 ? (double)leg_bytes / raw / 1e9 : 0, floor_s = link_s > mp ? link_s : mp;
            printf("          link floor: these %.1f MB over raw TCP loopback (%u stream%s, %.2f GB/s, this run) take "
                   "%.3f s; bridged / max(prefill alone, that) = %.2fx\n",
                   leg_bytes / 1e6, lanes_used, lanes_used == 1 ? "" : "s", raw, link_s,
                   floor_s > 0 ? mb / floor_s : 0.0);
            /* the floor no link removes (docs/design.md, "Not yet"): the last layer's rows exist only
             * when the prefill node has computed them, cross the link after that, and only then can
             * the decoder run the last prompt token's last layer and output head (its tail after
             * DONE, measured in these legs). Every other cost (the request, the bridge's own GPU
             * work, the slab path's stages) is taken as zero here. */
            const uint32_t last = lf.n_layer - 1;
            const bool last_local = lf.n_local && ((lf.local_mask[last / 64] >> (last % 64)) & 1);
            const uint64_t last_bytes = last_local ? len_local / lf.n_local
                                                   : (uint64_t)(lens[li] - 1) * 2u * lf.n_head_kv *
                                                         kvb_kvformat_row_bytes(&lf);
            const double last_s = raw > 0 ? (double)last_bytes / raw / 1e9 : 0;
            const double cfloor = mp + last_s + tail_med;
            printf("          floor by construction: prefill alone %.3f s + the last layer's %.1f MB over that link "
                   "%.4f s + the decoder's tail after DONE %.4f s = %.3f s, %.2fx the prefill alone; bridged / that "
                   "floor = %.2fx\n",
                   mp, last_bytes / 1e6, last_s, tail_med, cfloor, cfloor / mp, mb / cfloor);
        }
        if (pn) {
            double rd_s, cons_s;
            kvb_staging_stats sg;
            kvb_prefill_node_last_staging(pn, &sg);
            kvb_decode_node_last_receive_waits(dn, &rd_s, &cons_s);
            printf("          slab path stages (last bridged leg): staging ring full %.3f s, empty %.3f s, "
                   "checksums by the producer %u of %u slabs; decoder's reader waited %.3f s for buffers, its "
                   "verifier %.3f s for frames\n",
                   sg.full_s, sg.empty_s, sg.checksums_by_producer, sg.slabs, rd_s, cons_s);
        }
        if (pn && cuda) printf("          prefill node GPU memory in use, peak so far: %.2f GiB\n",
                               kvb_prefill_node_peak_gpu_bytes(pn) / 1073741824.0);
        if (pn) printf("          prefill node capture memory, peak so far: %.1f KiB\n",
                       kvb_prefill_node_peak_capture_bytes(pn) / 1024.0);
        fflush(stdout);
    }
    if (pn) printf("capture    peak staging memory on the prefill node: %.1f KiB (a fixed ring%s)\n",
                   kvb_prefill_node_peak_capture_bytes(pn) / 1024.0,
                   cuda ? " + the CUDA bridge's pinned row slots" : "");
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "kvbridge bench ladder: %s\n", err.msg);
done:
    kvb_decode_node_stop(alone);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
    kvb_model_free(m);
    return rc;
}
