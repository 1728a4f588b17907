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
            "  --peer HOST:PORT     use a running prefill node instead of one in this process (needs --psk)\n"
            "  --psk KEY            its pre-shared key (or env KVB_PSK)\n"
            "  --cache-type T       the decoder's cache dtype (default f16)\n");
}


typedef struct {
    double ttft;
    int bridged;
    double transfer_s;
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
    cJSON_Delete(root);
    kvb_http_reply_free(&h);
    return 0;
}

int kvb_bench_ladder(int argc, char **argv) {
    const char *model = NULL, *lengths = "1024,4096", *peer = NULL, *psk = getenv("KVB_PSK");
    long long seeds = 3, threads = 0;
    uint32_t cache_type = KVB_TYPE_F16;
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
        } else if (!strcmp(a, "--psk")) {
            if (!(psk = kvb_arg_value("bench", argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--seeds")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 1, 100, &seeds)) return 2;
        } else if (!strcmp(a, "--threads")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_int("bench", a, v, 1, 1024, &threads)) return 2;
        } else if (!strcmp(a, "--cache-type")) {
            if (!(v = kvb_arg_value("bench", argc, argv, &i)) || !kvb_arg_type("bench", a, v, &cache_type)) return 2;
        } else {
            fprintf(stderr, "kvbridge bench ladder: unknown option '%s' (see kvbridge bench ladder --help)\n", a);
            return 2;
        }
    }
    if (!model) {
        fprintf(stderr, "kvbridge bench ladder: -m MODEL is required\n");
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
    if (threads == 0) threads = kvb_cpu_count() / 2 > 0 ? kvb_cpu_count() / 2 : 1;
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
                                 .cache_dtype = cache_type, .max_ctx = ctx};
        if (kvb_prefill_node_start(&pc, &pn, &err)) goto fail;
        snprintf(peer_addr, sizeof peer_addr, "127.0.0.1:%u", kvb_prefill_node_port(pn));
        peer = peer_addr;
    }
    kvb_decode_config dc = {.http_listen = "127.0.0.1:0", .peer = peer, .model_path = model, .psk = psk,
                            .n_threads = (int)threads, .cache_dtype = cache_type, .max_ctx = ctx,
                            .peer_timeout_ms = 600000};
    if (kvb_decode_node_start(&dc, &dn, &err)) goto fail;
    kvb_decode_config ac = dc;
    ac.peer = NULL;
    if (kvb_decode_node_start(&ac, &alone, &err)) goto fail;
    printf("ladder: %s, %lld threads per node, prefill node %s, decoder cache %s\n", model, threads, peer,
           kvb_type_name(cache_type));
    printf("%8s  %12s  %12s  %6s  %10s  %9s  %s\n", "tokens", "alone TTFT s", "bridged s", "ratio", "bytes/tok",
           "GB/s", "verdicts (bridged)");
    size_t rb = kvb_row_bytes(cache_type, m->d.head_dim);
    double bytes_per_tok = 2.0 * m->d.n_layer * m->d.n_head_kv * (double)rb;
    uint64_t seed = (uint64_t)(kvb_now_s() * 1e3);
    for (int li = 0; li < n_lens; li++) {
        double a[100], b[100], gbs[100];
        char verdicts[512] = "";
        for (int s = 0; s < seeds; s++) {
            leg la, lb;
            /* a fresh prompt for each leg: neither node has seen it */
            if (one_leg(kvb_decode_node_port(alone), lens[li], seed++, m->d.n_vocab, &la) ||
                one_leg(kvb_decode_node_port(dn), lens[li], seed++, m->d.n_vocab, &lb))
                goto done;
            a[s] = la.ttft;
            b[s] = lb.ttft;
            gbs[s] = lb.transfer_s > 0 ? lb.bridged * bytes_per_tok / lb.transfer_s / 1e9 : 0;
            fprintf(stderr, "ladder %d tokens, seed %d: alone %.3f s, bridged %.3f s (%s)\n", lens[li], s, la.ttft,
                    lb.ttft, lb.verdict);
            strncat(verdicts, s ? ", " : "", sizeof verdicts - strlen(verdicts) - 1);
            strncat(verdicts, lb.verdict, sizeof verdicts - strlen(verdicts) - 1);
        }
        double ma = kvb_median_sort(a, (int)seeds), mb = kvb_median_sort(b, (int)seeds);
        double mg = kvb_median_sort(gbs, (int)seeds);
        printf("%8d  %12.3f  %12.3f  %5.2fx  %10.0f  %9.2f  %s\n", lens[li], ma, mb, ma / mb, bytes_per_tok,
               mg, verdicts);
        printf("          runs alone:");
        for (int s = 0; s < seeds; s++) printf(" %.3f", a[s]);
        printf("; bridged:");
        for (int s = 0; s < seeds; s++) printf(" %.3f", b[s]);
        printf(" (sorted)\n");
        fflush(stdout);
    }
    if (pn) printf("capture    peak staging memory on the prefill node: %.1f KiB (a fixed ring)\n",
                   kvb_prefill_node_peak_capture_bytes(pn) / 1024.0);
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
