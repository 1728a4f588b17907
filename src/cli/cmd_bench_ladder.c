/* cli/cmd_bench_ladder.c — `kvbridge bench ladder`: time to first token, decoder alone vs
 * bridged, over a ladder of cold prompt lengths. Each leg gets a fresh random prompt (a fresh
 * seed), so neither node's prefix cache helps; several seeds per length; medians with every run
 * listed; a verdict on every row. Both nodes run in this process on loopback unless --peer names
 * a running prefill node. */
#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvb_transport.h"
#include "svg_chart.h"

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

#define STR_(x) #x
#define STR(x) STR_(x)

/* What the command line asks of the ladder. */
typedef struct {
    const char *model, *lengths, *peer, *psk, *raw_peer, *svg;
    long long seeds, threads, chunk, alone_max, pa_max, warmup, block, lanes; /* lanes 0: the decode node's */
    int device;                                                               /* kvb_cli_device_names */
    int transport;                                                            /* kvb_cli_transport_names */
    bool cuda, filler;
    kvb_cli_gpu gpu;
    uint32_t cache_type;
    int lens[32], n_lens, max_len; /* --lengths, parsed */
    char key[40];                  /* a fresh key when none is given */
} ladder_args;

/* --lengths LIST into a->lens; false after a message. */
static bool ladder_lengths(const kvb_cli_spec *spec, ladder_args *a) {
    for (const char *p = a->lengths; *p;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 2 || v > (1 << 24) || a->n_lens == 32 || (*end && *end != ',')) {
            kvb_cli_usage_error(spec, "--lengths expects up to 32 comma-separated token counts (2..16777216), got '%s'",
                                a->lengths);
            return false;
        }
        a->lens[a->n_lens++] = (int)v;
        a->max_len = (int)v > a->max_len ? (int)v : a->max_len;
        p = *end == ',' ? end + 1 : end;
    }
    return true;
}

/* Checks that span options, and the defaults that depend on others. */
static int ladder_check(const kvb_cli_spec *spec, ladder_args *a) {
    a->cuda = a->device == 1;
    if (!kvb_cli_gpu_ok("bench ladder", &a->gpu, a->cuda)) return 2;
    if (a->filler) a->alone_max = a->pa_max = 0;
    if (a->filler && a->peer && !a->raw_peer)
        return kvb_cli_usage_error(spec, "--slab-path-only with --peer needs --raw-peer HOST:PORT (a kvbridge bench "
                                         "link --listen beside the prefill node), so the raw link is timed over the "
                                         "same network");
    if (a->raw_peer && !(a->filler && a->peer))
        return kvb_cli_usage_error(spec, "--raw-peer goes with --peer and --slab-path-only");
    if (!ladder_lengths(spec, a)) return 2;
    /* with a GPU prefilling, the CPUs belong to the decode nodes (one runs at a time) */
    if (a->threads == 0) a->threads = a->cuda ? kvb_cpu_count() : (kvb_cpu_count() / 2 > 0 ? kvb_cpu_count() / 2 : 1);
    if (a->warmup < 0) a->warmup = a->cuda ? 2 : 0; /* the second builds cuDNN's plans (kvb_cudnn_attn_take) */
    if (!a->psk) {
        kvb_rng r;
        kvb_rng_seed(&r, (uint64_t)(kvb_now_s() * 1e9));
        snprintf(a->key, sizeof a->key, "%016llx%016llx", (unsigned long long)kvb_rng_u64(&r),
                 (unsigned long long)kvb_rng_u64(&r));
        a->psk = a->key;
    }
    return KVB_CLI_GO;
}

/* Fills *a from argv; KVB_CLI_GO, or the code the command returns. */
static int ladder_parse(ladder_args *a, int argc, char **argv) {
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&a->model, "GGUF model (both nodes)", true),
        {.long_name = "lengths", .kind = KVB_OPT_STRING, .dst = &a->lengths, .meta = "LIST", .def = "1024,4096",
         .help = "prompt lengths in tokens"},
        KVB_CLI_INT("seeds", &a->seeds, "N", 1, 100, "3", "prompts per length"),
        KVB_CLI_OPT_THREADS(&a->threads, "threads per node (default: half the CPUs each; all with --device cuda)"),
        KVB_CLI_STR("peer", &a->peer, "HOST:PORT",
                    "use a running prefill node instead of one in this process (needs --psk); with "
                    "--slab-path-only, one started with serve --bench-filler-rows"),
        KVB_CLI_OPT_PSK(&a->psk, "its pre-shared key (or env KVB_PSK)"),
        KVB_CLI_STR("raw-peer", &a->raw_peer, "HOST:PORT",
                    "with --peer and --slab-path-only: a `kvbridge bench link --listen HOST:PORT` beside the "
                    "prefill node, so the raw link is timed over the same network"),
        KVB_CLI_OPT_CACHE_TYPE(&a->cache_type, "the decoder's cache dtype"),
        KVB_CLI_OPT_DEVICE(&a->device,
                           "the in-process prefill node's engine; with cuda the column 'prefill alone' is the GPU "
                           "prefilling the same length with the bridge idle, up to the last token's logits (the "
                           "GPU's own time to a first token), and 'vs alone' is bridged TTFT / that time"),
        KVB_CLI_OPT_TRANSPORT(&a->transport, "the link between the decode node and the prefill node (both, in "
                                             "process; with --peer, the remote one must serve the same)"),
        KVB_CLI_OPT_BLOCK_TOKENS(&a->block, "the decoder's cache block in tokens: a slab carries one block's rows "
                                            "of one layer, so this sets how many slabs a prompt takes"),
        KVB_CLI_INT("lanes", &a->lanes, "N", 1, KVB_MAX_LANES, NULL,
                    "connections from the decoder to the prefill node that a bridged request's slabs are striped "
                    "over (default: the decode node's, " STR(KVB_DEFAULT_LANES) "); the raw TCP loopback each row "
                    "is measured against (the link floor, or with --slab-path-only the raw link's GB/s) uses as "
                    "many streams at once"),
        KVB_CLI_INT("chunk", &a->chunk, "N", 16, 1 << 20, NULL,
                    "prefill node chunk in tokens (default 512 on cpu, 8192 on cuda and with --slab-path-only)"),
        KVB_CLI_OPTS_GPU(&a->gpu),
        KVB_CLI_INT("alone-max", &a->alone_max, "N", 0, 1 << 24, "1048576",
                    "run the decoder-alone legs only up to N tokens; longer rows print 'not run'"),
        KVB_CLI_INT("prefill-alone-max", &a->pa_max, "N", 0, 1 << 24, "1048576",
                    "time the in-process prefill node alone only up to N tokens: once with the bridge idle, up to "
                    "the last token's logits ('prefill alone'), and once with the bridge computing and cutting the "
                    "decoder's rows, which are then dropped instead of sent, and no logits ('+bridge'): the prefill "
                    "node's own work for a bridged request, so 'vs +bridge' is what the link and the exchange add "
                    "to it"),
        KVB_CLI_INT("warmup", &a->warmup, "N", 0, 100, NULL,
                    "untimed bridged prompts of each length before its timed ones (default 2 with --device cuda: a "
                    "length's first prompt runs on the engine's kernel, the second gets cuDNN's plans for its "
                    "shapes; 0 on cpu). The in-process CUDA prefill node also warms up at start, as serve --role "
                    "prefill does"),
        KVB_CLI_STR("svg", &a->svg, "FILE",
                    "also write the table as a chart: time to first token by prompt length, the decoder alone, "
                    "bridged and the prefill node alone (the GPU's with --device cuda), medians, log scales (SVG)"),
        KVB_CLI_FLAG("slab-path-only", &a->filler,
                     "the in-process prefill node ships filler rows without computing them: the time and GB/s of "
                     "the slab path alone (cutting, staging, transport, the decoder's verification and commit) — "
                     "its ceiling; the decoder's last token then runs after the transfer, not beside it. The "
                     "decoder's cache holds filler, so no decoder-alone or prefill-alone legs are run. After each "
                     "bridged leg the same bytes also go over plain TCP loopback connections, as many streams at "
                     "once as the decoder has lanes; a row prints the slab path's median GB/s as a share of those "
                     "raw runs' median. The filler goes a chunk's layer at a time (8192 tokens unless --chunk), as "
                     "a CUDA prefill node's bridge hands its rows over"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "bench ladder", .usage = "-m MODEL [--lengths 1024,4096,16384] [--seeds 3] [options]", .opts = opts,
        .about = "Time to first token (a completion of 1 token) for cold prompts: on a decode node alone, and on a "
                 "decode node bridged to a prefill node; prints both, their ratio, bytes per token shipped, "
                 "transfer GB/s and the prefill node's peak capture memory."};
    int rc = kvb_cli_parse(&spec, argc, argv);
    return rc != KVB_CLI_GO ? rc : ladder_check(&spec, a);
}

/* The nodes a ladder runs against, and what each length's legs share. */
typedef struct {
    const ladder_args *a;
    kvb_model *m;
    kvb_prefill_node *pn; /* NULL with --peer */
    kvb_decode_node *dn, *alone;
    const char *peer;
    char peer_addr[64];
    uint32_t lanes_used; /* the raw-link yardsticks stream as many connections at once as the bridge stripes over */
    kvb_kvformat lf;
    uint64_t tok_global, tok_local; /* bytes per position, global and local layers */
    uint64_t seed;
} ladder;

/* Loads the model and starts the prefill node (unless --peer), the bridged and the lone decode node. */
static kvb_status ladder_start(ladder *L, kvb_err *err) {
    const ladder_args *a = L->a;
    const uint32_t ctx = (uint32_t)a->max_len + 64;
    L->peer = a->peer;
    const kvb_wire_backend *backend = NULL;
    if (kvb_wire_backend_by_name(kvb_cli_transport_names[a->transport], &backend, err)) return err->code;
    if (kvb_model_load(a->model, &L->m, err)) return err->code;
    if (!L->peer) {
        kvb_prefill_config pc = {.listen = "127.0.0.1:0", .backend = backend, .model_path = a->model, .psk = a->psk,
                                 .n_threads = (int)a->threads, .cache_dtype = a->cache_type, .max_ctx = ctx,
                                 .cuda = a->cuda, .chunk_tokens = (uint32_t)a->chunk, .bench_filler_rows = a->filler,
                                 .block_tokens = (uint32_t)a->block, .gpus = (int)a->gpu.gpus,
                                 .tp_one_device = a->gpu.tp_one_device, .gpu_weights = a->gpu.gpu_weights,
                                 .warmup_tokens = a->filler ? 0 : (uint32_t)(a->chunk ? a->chunk : 8192) + 64};
        if (kvb_prefill_node_start(&pc, &L->pn, err)) return err->code;
        snprintf(L->peer_addr, sizeof L->peer_addr, "127.0.0.1:%u", kvb_prefill_node_port(L->pn));
        L->peer = L->peer_addr;
    }
    kvb_decode_config dc = {.http_listen = "127.0.0.1:0", .peer = L->peer, .backend = backend,
                            .model_path = a->model, .psk = a->psk,
                            .n_threads = (int)a->threads, .cache_dtype = a->cache_type, .max_ctx = ctx,
                            .peer_timeout_ms = 600000, .block_tokens = (uint32_t)a->block,
                            .lanes = (uint32_t)a->lanes,
                            .tail_after_transfer = a->filler, /* the slab path's ceiling, measured alone */
                            .bench_filler_peer = a->filler,
                            /* one prompt's blocks and some room: legs use fresh prompts, LRU evicts */
                            .cache_blocks = (ctx + (uint32_t)a->block - 1) / (uint32_t)a->block + 64};
    if (kvb_decode_node_start(&dc, &L->dn, err)) return err->code;
    L->lanes_used = a->lanes ? (uint32_t)a->lanes : KVB_DEFAULT_LANES;
    kvb_decode_config ac = dc;
    ac.peer = NULL;
    ac.backend = NULL;
    if (kvb_decode_node_start(&ac, &L->alone, err)) return err->code;
    /* what a leg ships: global layers' rows for every shipped position, local (sliding-window)
     * layers' rows only where the decoder keeps them (the decode node's blocks) */
    if (kvb_model_kvformat(&L->m->d, a->cache_type, (uint32_t)a->block, &L->lf, err)) return err->code;
    kvb_kvformat_token_bytes(&L->lf, &L->tok_global, &L->tok_local);
    L->seed = (uint64_t)(kvb_now_s() * 1e3);
    return KVB_OK;
}

/* One length's legs, every seed's figures (sorted by the medians taken later). */
typedef struct {
    int len;
    uint64_t len_global, len_local; /* the bytes a complete leg ships */
    double a[100], b[100], gbs[100], pa[100], pb[100], ph_pre[100], ph_xfer[100], ph_nat[100];
    double raw_gbs[100]; /* --slab-path-only: the raw link right after each bridged leg */
    int n_piped;         /* bridged legs whose last token ran with the transfer */
    bool run_alone, ran_pa;
    char verdicts[512];
} ladder_row;

/* One seed of a row: the lone and the bridged leg, the prefill node alone, the raw link. -1 after a
 * message. */
static int ladder_seed(ladder *L, ladder_row *r, int s) {
    const ladder_args *a = L->a;
    const int len = r->len;
    leg la = {0}, lb;
    kvb_err err = {0};
    /* a fresh prompt for each leg: neither node has seen it */
    if ((r->run_alone && one_leg(kvb_decode_node_port(L->alone), len, L->seed++, L->m->d.n_vocab, &la)) ||
        one_leg(kvb_decode_node_port(L->dn), len, L->seed++, L->m->d.n_vocab, &lb))
        return -1;
    r->pa[s] = r->pb[s] = 0;
    if (r->ran_pa && (kvb_prefill_node_time_alone(L->pn, (uint32_t)len, L->seed++, false, &r->pa[s], &err) ||
                      kvb_prefill_node_time_alone(L->pn, (uint32_t)len, L->seed++, true, &r->pb[s], &err))) {
        fprintf(stderr, "kvbridge bench ladder: %s\n", err.msg);
        return -1;
    }
    r->a[s] = la.ttft;
    r->b[s] = lb.ttft;
    r->ph_pre[s] = lb.prefill_s;
    r->ph_xfer[s] = lb.transfer_s;
    r->ph_nat[s] = lb.native_s;
    r->n_piped += lb.pipelined;
    uint64_t leg_g, leg_l; /* what this leg shipped (all of it when complete) */
    kvb_kvformat_ship_bytes(&L->lf, 0, (uint32_t)lb.bridged, &leg_g, &leg_l);
    r->gbs[s] = lb.transfer_s > 0 ? (double)(leg_g + leg_l) / lb.transfer_s / 1e9 : 0;
    /* the raw link the same way, beside each leg: the loopback's own speed wanders from run to run
     * (11-19 GB/s over 4 streams on the H100/H200 hosts), so one sample per length made the share
     * swing by tens of percent */
    const uint64_t bytes = r->len_global + r->len_local;
    r->raw_gbs[s] = !a->filler   ? 0
                    : a->raw_peer ? kvb_bench_raw_remote_gbs(a->raw_peer, bytes, 65536, L->lanes_used)
                                  : kvb_bench_raw_loopback_gbs(bytes, 65536, L->lanes_used);
    fprintf(stderr, "ladder %d tokens, seed %d: alone %.3f s, bridged %.3f s (%s), prefill alone %.3f s, +bridge %.3f s\n",
            len, s, la.ttft, lb.ttft, lb.verdict, r->pa[s], r->pb[s]);
    strncat(r->verdicts, s ? ", " : "", sizeof r->verdicts - strlen(r->verdicts) - 1);
    strncat(r->verdicts, lb.verdict, sizeof r->verdicts - strlen(r->verdicts) - 1);
    return 0;
}

/* Runs one length: the warm-up prompts, then every seed. -1 after a message. */
static int ladder_run_row(ladder *L, int len, ladder_row *r) {
    const ladder_args *a = L->a;
    memset(r, 0, sizeof *r);
    r->len = len;
    kvb_kvformat_ship_bytes(&L->lf, 0, (uint32_t)len - 1, &r->len_global, &r->len_local);
    r->run_alone = len <= a->alone_max;
    r->ran_pa = L->pn && len <= a->pa_max;
    for (int w = 0; w < a->warmup; w++) {
        leg lw = {0};
        if (one_leg(kvb_decode_node_port(L->dn), len, L->seed++, L->m->d.n_vocab, &lw)) return -1;
        fprintf(stderr, "ladder %d tokens, warm-up %d: bridged %.3f s (%s)\n", len, w + 1, lw.ttft, lw.verdict);
    }
    for (int s = 0; s < a->seeds; s++)
        if (ladder_seed(L, r, s)) return -1;
    return 0;
}

/* "label: v v v" for the first n of v. */
static void print_runs(const char *label, const double *v, long long n) {
    printf("%s", label);
    for (long long s = 0; s < n; s++) printf(" %.3f", v[s]);
}

/* The row's line of medians and its lines of runs and bytes. */
static void ladder_print_row(const ladder *L, ladder_row *r, double *mb, double *mg, double *mp) {
    const ladder_args *a = L->a;
    const int n = (int)a->seeds, len = r->len;
    const double bytes_per_tok = (double)(r->len_global + r->len_local) / len;
    const double ma = kvb_median_sort(r->a, n), mpb = kvb_median_sort(r->pb, n);
    *mb = kvb_median_sort(r->b, n);
    *mg = kvb_median_sort(r->gbs, n);
    *mp = kvb_median_sort(r->pa, n);
    char ca[16] = "not run", cr[16] = "-", cp[16] = "-", cv[16] = "-", cpb[16] = "-", cvb[16] = "-";
    if (r->run_alone) {
        snprintf(ca, sizeof ca, "%.3f", ma);
        snprintf(cr, sizeof cr, "%.2fx", ma / *mb);
    }
    if (r->ran_pa) {
        snprintf(cp, sizeof cp, "%.3f", *mp);
        snprintf(cv, sizeof cv, "%.2fx", *mb / *mp);
        snprintf(cpb, sizeof cpb, "%.3f", mpb);
        snprintf(cvb, sizeof cvb, "%.2fx", *mb / mpb);
    }
    printf("%8d  %12s  %12.3f  %6s  %13s  %9s  %8s  %10s  %10.0f  %9.2f  %s\n", len, ca, *mb, cr, cp, cv, cpb, cvb,
           bytes_per_tok, *mg, r->verdicts);
    if (r->run_alone) print_runs("          runs alone:", r->a, n);
    else printf("          runs alone: (not run: longer than --alone-max %lld)", a->alone_max);
    print_runs("; bridged:", r->b, n);
    if (r->ran_pa) {
        print_runs("; prefill alone:", r->pa, n);
        print_runs("; +bridge:", r->pb, n);
    }
    printf(" (sorted)\n");
    if (L->lf.window)
        printf("          bytes per prompt token: global layers %.1f + local layers %.1f (window %u: rows kept "
               "for %llu positions) = %.1f; every row of every layer would be %.1f\n",
               (double)r->len_global / len, (double)r->len_local / len, L->lf.window,
               (unsigned long long)(L->tok_local ? r->len_local / L->tok_local : 0), bytes_per_tok,
               (double)(L->tok_global + L->tok_local) * (len - 1) / len);
}

/* The bridged legs' phases and the decoder's tail after DONE; returns the tail's median. */
static double ladder_print_phases(const ladder *L, ladder_row *r) {
    const int n = (int)L->a->seeds;
    const double tail_med = kvb_median_sort(r->ph_nat, n); /* (sorts ph_nat) */
    printf("          bridged phases (medians): prefill node %.3f s, exchange (request to DONE) %.3f s, decoder's "
           "native tail %.3f s (after DONE; pipelined with the transfer in %d of %d)\n",
           kvb_median_sort(r->ph_pre, n), kvb_median_sort(r->ph_xfer, n), tail_med, r->n_piped, n);
    printf("          decoder's tail after DONE, each bridged prompt (sorted):");
    for (int s = 0; s < n; s++) printf(" %.4f", r->ph_nat[s]);
    printf(" s\n");
    return tail_med;
}

/* With --slab-path-only: the raw link the same way in the same run, as many bytes as one leg
 * shipped, after each leg, and the slab path's share of it. */
static void ladder_print_raw(const ladder *L, ladder_row *r, double mg) {
    const int n = (int)L->a->seeds;
    const char *raw_peer = L->a->raw_peer;
    const double raw = kvb_median_sort(r->raw_gbs, n);
    printf("          raw TCP %s%s, %u stream%s, same bytes, after each leg: %.2f GB/s (median; runs",
           raw_peer ? "to " : "loopback", raw_peer ? raw_peer : "", L->lanes_used, L->lanes_used == 1 ? "" : "s", raw);
    for (int s = 0; s < n; s++) printf(" %.2f", r->raw_gbs[s]);
    printf(", sorted); slab path / raw: %.0f %%\n", raw > 0 ? 100.0 * mg / raw : 0.0);
}

/* The floors a bridged time to first token cannot beat: the prefill alone or the raw link's time
 * for the bytes (measured now, as bench link does), and the floor by construction. */
static void ladder_print_floors(const ladder *L, const ladder_row *r, double mb, double mp, double tail_med) {
    const kvb_kvformat *lf = &L->lf;
    const uint64_t leg_bytes = r->len_global + r->len_local;
    const double raw = kvb_bench_raw_loopback_gbs(leg_bytes, 65536, L->lanes_used);
    const double link_s = raw > 0 ? (double)leg_bytes / raw / 1e9 : 0, floor_s = link_s > mp ? link_s : mp;
    printf("          link floor: these %.1f MB over raw TCP loopback (%u stream%s, %.2f GB/s, this run) take "
           "%.3f s; bridged / max(prefill alone, that) = %.2fx\n",
           leg_bytes / 1e6, L->lanes_used, L->lanes_used == 1 ? "" : "s", raw, link_s, floor_s > 0 ? mb / floor_s : 0.0);
    /* the floor no link removes (docs/design.md, "Not yet"): the last layer's rows exist only when
     * the prefill node has computed them, cross the link after that, and only then can the decoder
     * run the last prompt token's last layer and output head (its tail after DONE, measured in
     * these legs). Every other cost (the request, the bridge's own GPU work, the slab path's
     * stages) is taken as zero here. */
    const uint32_t last = lf->n_layer - 1;
    const bool last_local = lf->n_local && ((lf->local_mask[last / 64] >> (last % 64)) & 1);
    const uint64_t last_bytes = last_local ? r->len_local / lf->n_local
                                           : (uint64_t)(r->len - 1) * kvb_kvformat_parts(lf) * lf->n_head_kv *
                                                 kvb_kvformat_row_bytes(lf);
    const double last_s = raw > 0 ? (double)last_bytes / raw / 1e9 : 0;
    const double cfloor = mp + last_s + tail_med;
    printf("          floor by construction: prefill alone %.3f s + the last layer's %.1f MB over that link "
           "%.4f s + the decoder's tail after DONE %.4f s = %.3f s, %.2fx the prefill alone; bridged / that "
           "floor = %.2fx\n",
           mp, last_bytes / 1e6, last_s, tail_med, cfloor, cfloor / mp, mb / cfloor);
}

/* The in-process prefill node's slab path stages and memory after a row. */
static void ladder_print_node(const ladder *L) {
    double rd_s, cons_s;
    kvb_staging_stats sg;
    kvb_prefill_node_last_staging(L->pn, &sg);
    kvb_decode_node_last_receive_waits(L->dn, &rd_s, &cons_s);
    printf("          slab path stages (last bridged leg): staging ring full %.3f s, empty %.3f s, checksums by "
           "the producer %u of %u slabs; decoder's reader waited %.3f s for buffers, its verifier %.3f s for frames\n",
           sg.full_s, sg.empty_s, sg.checksums_by_producer, sg.slabs, rd_s, cons_s);
    if (L->a->cuda)
        printf("          prefill node GPU memory in use, peak so far: %.2f GiB\n",
               kvb_prefill_node_peak_gpu_bytes(L->pn) / 1073741824.0);
    printf("          prefill node capture memory, peak so far: %.1f KiB\n",
           kvb_prefill_node_peak_capture_bytes(L->pn) / 1024.0);
}

/* The header lines and the table's column names. */
static void ladder_print_header(const ladder *L) {
    const ladder_args *a = L->a;
    printf("ladder: %s, %lld decoder threads, prefill node %s (%s), decoder cache %s, %u lanes over %s\n",
           a->model, a->threads, L->peer,
           !L->pn      ? "remote"
           : a->filler ? "filler rows, in process: the slab path alone"
           : a->cuda   ? "CUDA engine, in process"
                       : "CPU engine, in process",
           kvb_type_name(a->cache_type), L->lanes_used, kvb_cli_transport_names[a->transport]);
    if (a->warmup)
        printf("warm-up    %lld untimed bridged prompt(s) of each length first (fresh tokens, no cache hits): the "
               "prefill node's\n           per-shape state (cuDNN execution plans) is then built, as on a server "
               "that has seen this length\n",
               a->warmup);
    printf("%8s  %12s  %12s  %6s  %13s  %9s  %8s  %10s  %10s  %9s  %s\n", "tokens", "alone TTFT s", "bridged s",
           "ratio", "prefill alone", "vs alone", "+bridge", "vs +bridge", "bytes/tok", "GB/s", "verdicts (bridged)");
}

/* The medians of each row as a chart (--svg): time to first token by prompt length. (row) arrays. */
typedef struct {
    double x[32], alone[32], bridged[32], prefill[32];
    int n;
} ladder_chart;

static void ladder_chart_add(ladder_chart *ch, const ladder_args *a, ladder_row *r, double mb, double mp) {
    ch->x[ch->n] = r->len;
    ch->alone[ch->n] = r->run_alone ? kvb_median_sort(r->a, (int)a->seeds) : NAN;
    ch->bridged[ch->n] = mb;
    ch->prefill[ch->n] = r->ran_pa ? mp : NAN;
    ch->n++;
}

static int ladder_chart_write(const ladder *L, const ladder_chart *ch) {
    const ladder_args *a = L->a;
    char note[256];
    snprintf(note, sizeof note, "%s; prefill node %s; decoder %lld threads, cache %s; medians of %lld prompt%s each",
             a->model, !L->pn ? "remote" : a->filler ? "filler rows (slab path only)" : a->cuda ? "CUDA" : "CPU",
             a->threads, kvb_type_name(a->cache_type), a->seeds, a->seeds == 1 ? "" : "s");
    const kvb_svg_series series[] = {
        {"decoder alone", ch->alone},
        {"bridged", ch->bridged},
        {a->cuda ? "GPU prefill alone" : "prefill node alone", ch->prefill},
    };
    const kvb_svg_chart c = {.title = "kvbridge bench ladder: time to first token by prompt length", .note = note,
                             .x_label = "prompt tokens (cold cache)", .y_label = "time to first token",
                             .x = ch->x, .n = (size_t)ch->n, .series = series, .n_series = 3};
    kvb_err err = {0};
    if (kvb_svg_chart_write(&c, a->svg, &err)) {
        fprintf(stderr, "kvbridge bench ladder: %s\n", err.msg);
        return -1;
    }
    printf("chart      %s\n", a->svg);
    return 0;
}

int kvb_bench_ladder(int argc, char **argv) {
    ladder_args a = {.psk = getenv("KVB_PSK"), .warmup = -1};
    int rc = ladder_parse(&a, argc, argv);
    if (rc != KVB_CLI_GO) return rc;
    ladder L = {.a = &a};
    ladder_row r; /* one row at a time */
    ladder_chart chart = {.n = 0};
    kvb_err err = {0};
    rc = 1;
    if (ladder_start(&L, &err)) {
        fprintf(stderr, "kvbridge bench ladder: %s\n", err.msg);
        goto done;
    }
    ladder_print_header(&L);
    for (int li = 0; li < a.n_lens; li++) {
        double mb, mg, mp;
        if (ladder_run_row(&L, a.lens[li], &r)) goto done;
        ladder_print_row(&L, &r, &mb, &mg, &mp);
        ladder_chart_add(&chart, &a, &r, mb, mp);
        const double tail_med = ladder_print_phases(&L, &r);
        if (a.filler) ladder_print_raw(&L, &r, mg);
        else if (L.pn && mp > 0) ladder_print_floors(&L, &r, mb, mp, tail_med);
        if (L.pn) ladder_print_node(&L);
        if (strcmp(kvb_cli_transport_names[a.transport], "tcp") != 0) {
            char lanes[256];
            kvb_ucx_last_lanes(lanes, sizeof lanes);
            printf("          UCX's lanes (the last connection made): %s\n", lanes);
        }
        fflush(stdout);
    }
    if (L.pn)
        printf("capture    peak staging memory on the prefill node: %.1f KiB (a fixed ring%s)\n",
               kvb_prefill_node_peak_capture_bytes(L.pn) / 1024.0, a.cuda ? " + the CUDA bridge's pinned row slots" : "");
    rc = a.svg && ladder_chart_write(&L, &chart) ? 1 : 0;
done:
    kvb_decode_node_stop(L.alone);
    kvb_decode_node_stop(L.dn);
    kvb_prefill_node_stop(L.pn);
    kvb_model_free(L.m);
    return rc;
}
