/* cli/cmd_bench.c — `kvbridge bench prefill|decode`: CPU engine speed beside the machine's
 * measured memory bandwidth (same run, same threads) and, when given, llama.cpp's llama-bench
 * on the same file with the same threads. Benchmarks print; they never assert. */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_engine_cpu.h"
#include "kvb_quant.h"

static void help(FILE *f) {
    fprintf(f,
            "usage: kvbridge bench (prefill|decode) -m MODEL [options]\n\n"
            "Measures the CPU engine and prints tok/s beside the memory bandwidth measured in the same run.\n"
            "  prefill   one batch of --tokens random tokens from an empty cache (like llama-bench pp)\n"
            "  decode    --gen single-token steps after a --ctx-token prompt (like llama-bench tg)\n\n"
            "  -m FILE              GGUF model\n"
            "  --threads T          threads (default: all CPUs)\n"
            "  --tokens N           prefill tokens (default 512)\n"
            "  --gen N              decode steps (default 128)\n"
            "  --ctx N              prompt length before decode (default 16)\n"
            "  --reps R             repetitions; the median is reported (default 3)\n"
            "  --cache-type T       KV cache dtype (default f16)\n"
            "  --llama-bench PATH   also run llama.cpp's llama-bench on the same file and threads\n"
            "  --json FILE          also write the figures as JSON\n");
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static uint64_t mat_bytes(const kvb_mat *w) { return (uint64_t)w->rows * w->row_bytes; }

/* Bytes of weights one decode step reads: every matrix once, the output head, the embedding row. */
static uint64_t weight_bytes_per_token(const kvb_model *m) {
    uint64_t b = mat_bytes(&m->output) + m->tok_embd.row_bytes;
    for (uint32_t l = 0; l < m->d.n_layer; l++) {
        const kvb_layer_weights *w = &m->layers[l];
        b += mat_bytes(&w->wq) + mat_bytes(&w->wk) + mat_bytes(&w->wv) + mat_bytes(&w->wo) + mat_bytes(&w->w_gate) +
             mat_bytes(&w->w_up) + mat_bytes(&w->w_down) + 2 * 4 * (uint64_t)m->d.n_embd;
    }
    return b;
}

/* Runs llama-bench and returns its average tok/s for the test (pp or tg); < 0 on failure. */
static double run_llama_bench(const char *path, const char *model, int threads, int pp, int tg, int reps) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' -m '%s' -t %d -p %d -n %d -r %d -o json 2>/dev/null", path, model, threads, pp, tg,
             reps);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf) {
        pclose(p);
        return -1;
    }
    size_t k;
    while ((k = fread(buf + n, 1, cap - n - 1, p)) > 0) {
        n += k;
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) break;
            buf = nb;
        }
    }
    buf[n] = 0;
    pclose(p);
    double ts = -1;
    cJSON *root = cJSON_Parse(buf);
    cJSON *it;
    cJSON_ArrayForEach(it, root) {
        cJSON *np = cJSON_GetObjectItem(it, "n_prompt"), *ng = cJSON_GetObjectItem(it, "n_gen"),
              *avg = cJSON_GetObjectItem(it, "avg_ts");
        if (!cJSON_IsNumber(np) || !cJSON_IsNumber(ng) || !cJSON_IsNumber(avg)) continue;
        if ((pp > 0 && np->valueint == pp && ng->valueint == 0) || (tg > 0 && ng->valueint == tg && np->valueint == 0))
            ts = avg->valuedouble;
    }
    cJSON_Delete(root);
    free(buf);
    return ts;
}

int kvb_cmd_bench(int argc, char **argv) {
    const char *cmd = "bench", *model_path = NULL, *llama_bench = NULL, *json_path = NULL;
    if (argc < 2 || kvb_arg_is_help(argv[1])) {
        help(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *what = argv[1];
    bool prefill = !strcmp(what, "prefill");
    if (!prefill && strcmp(what, "decode")) {
        fprintf(stderr, "kvbridge bench: unknown benchmark '%s' (prefill or decode; see kvbridge bench --help)\n", what);
        return 2;
    }
    long long threads = 0, n_tok = 512, n_gen = 128, n_ctx = 16, reps = 3;
    uint32_t cache_type = KVB_TYPE_F16;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v;
        if (kvb_arg_is_help(a)) {
            help(stdout);
            return 0;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            if (!(model_path = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--threads")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 1024, &threads)) return 2;
        } else if (!strcmp(a, "--tokens")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 1 << 20, &n_tok)) return 2;
        } else if (!strcmp(a, "--gen")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 1 << 20, &n_gen)) return 2;
        } else if (!strcmp(a, "--ctx")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 1 << 20, &n_ctx)) return 2;
        } else if (!strcmp(a, "--reps")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 100, &reps)) return 2;
        } else if (!strcmp(a, "--cache-type")) {
            kvb_type t;
            kvb_err err = {0};
            if (!(v = kvb_arg_value(cmd, argc, argv, &i))) return 2;
            if (kvb_type_from_name(v, &t, &err)) {
                fprintf(stderr, "kvbridge bench: --cache-type: %s\n", err.msg);
                return 2;
            }
            cache_type = t;
        } else if (!strcmp(a, "--llama-bench")) {
            if (!(llama_bench = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--json")) {
            if (!(json_path = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else {
            fprintf(stderr, "kvbridge bench: unknown option '%s' (see kvbridge bench --help)\n", a);
            return 2;
        }
    }
    if (!model_path) {
        fprintf(stderr, "kvbridge bench: -m MODEL is required (see kvbridge bench --help)\n");
        return 2;
    }
    kvb_err err = {0};
    kvb_model *m = NULL;
    kvb_engine *e = NULL;
    int rc = 1;
    int32_t *toks = NULL;
    float *logits = NULL;
    double *times = NULL;
    if (kvb_model_load(model_path, &m, &err)) goto fail;
    uint32_t need = prefill ? (uint32_t)n_tok : (uint32_t)(n_ctx + n_gen);
    kvb_engine_opts eo = {.n_threads = (int)threads, .cache_dtype = cache_type, .max_ctx = need + 1};
    if (kvb_engine_create(m, &eo, &e, &err)) goto fail;
    int T = kvb_engine_threads(e);
    toks = malloc(sizeof(int32_t) * need);
    logits = malloc(sizeof(float) * m->d.n_vocab);
    times = malloc(sizeof(double) * (size_t)reps);
    if (!toks || !logits || !times) {
        kvb_err_set(&err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    kvb_rng rng;
    kvb_rng_seed(&rng, 42);
    for (uint32_t i = 0; i < need; i++) toks[i] = (int32_t)(kvb_rng_u64(&rng) % m->d.n_vocab);

    char desc[256];
    kvb_model_describe(m, desc, sizeof desc);
    printf("model      %s\n           %s\n", model_path, desc);
    printf("machine    %d threads, %s kernels, KV cache %s\n", T, kvb_simd_name(), kvb_type_name(cache_type));

    /* warm-up: one short forward pages the weights in */
    {
        kvb_seq *s = NULL;
        if (kvb_seq_create(e, &s, &err)) goto fail;
        kvb_status st = kvb_engine_forward(e, s, toks, prefill ? (uint32_t)(n_tok < 32 ? n_tok : 32) : 1, logits,
                                           false, &err);
        kvb_seq_free(s);
        if (st) goto fail;
    }
    for (int r = 0; r < reps; r++) {
        kvb_seq *s = NULL;
        if (kvb_seq_create(e, &s, &err)) goto fail;
        kvb_status st = KVB_OK;
        double t0 = 0, t1 = 0;
        if (prefill) {
            t0 = kvb_now_s();
            st = kvb_engine_forward(e, s, toks, (uint32_t)n_tok, logits, false, &err);
            t1 = kvb_now_s();
        } else {
            st = kvb_engine_forward(e, s, toks, (uint32_t)n_ctx, logits, false, &err);
            t0 = kvb_now_s();
            for (long long g = 0; g < n_gen && !st; g++)
                st = kvb_engine_forward(e, s, &toks[n_ctx + g], 1, logits, false, &err);
            t1 = kvb_now_s();
        }
        kvb_seq_free(s);
        if (st) goto fail;
        times[r] = (prefill ? n_tok : n_gen) / (t1 - t0);
        fprintf(stderr, "bench %s: run %d/%lld: %.2f tok/s\n", what, r + 1, reps, times[r]);
    }
    double runs[100];
    memcpy(runs, times, sizeof(double) * (size_t)reps);
    double tps = median(times, (int)reps);
    kvb_pool *pool = NULL;
    if (kvb_pool_create(T, &pool, &err)) goto fail;
    double bw = kvb_measure_read_bw(pool, (size_t)1 << 30, 3);
    kvb_pool_destroy(pool);

    double peer = -1;
    if (llama_bench)
        peer = run_llama_bench(llama_bench, model_path, T, prefill ? (int)n_tok : 0, prefill ? 0 : (int)n_gen,
                               (int)reps);

    printf("runs      ");
    for (int r = 0; r < reps; r++) printf(" %.2f", runs[r]);
    printf(" tok/s\n");
    uint64_t wbytes = weight_bytes_per_token(m);
    double flops_tok = 2.0 * (double)kvb_model_n_params_nonembd(&m->d);
    if (prefill) {
        /* attention: QK^T and PV over the causal triangle */
        double att = 2.0 * 2.0 * m->d.n_layer * m->d.n_head * m->d.head_dim * (double)n_tok * (n_tok + 1) / 2.0;
        double gflops = (flops_tok * n_tok + att) / (n_tok / tps) / 1e9;
        printf("prefill    %lld tokens: %.1f tok/s (median of %lld), %.1f GFLOP/s\n", n_tok, tps, reps, gflops);
    } else {
        size_t rb = kvb_row_bytes(cache_type, m->d.head_dim);
        double kv_avg = (double)m->d.n_layer * 2 * m->d.n_head_kv * rb * (n_ctx + n_gen / 2.0);
        double bytes = (double)wbytes + kv_avg;
        double achieved = bytes * tps / 1e9;
        printf("decode     %lld steps after %lld tokens: %.2f tok/s (median of %lld)\n", n_gen, n_ctx, tps, reps);
        printf("bytes/tok  %.1f MB (weights %.1f MB + KV %.2f MB)\n", bytes / 1e6, wbytes / 1e6, kv_avg / 1e6);
        printf("bandwidth  %.1f GB/s achieved = %.0f%% of %.1f GB/s measured read bandwidth (same run, %d threads)\n",
               achieved, 100.0 * achieved / bw, bw, T);
    }
    if (prefill) printf("bandwidth  %.1f GB/s measured read bandwidth (same run, %d threads)\n", bw, T);
    if (llama_bench) {
        if (peer > 0)
            printf("peer       llama.cpp llama-bench %s: %.2f tok/s -> kvbridge/llama.cpp = %.2fx\n",
                   prefill ? "pp" : "tg", peer, tps / peer);
        else printf("peer       llama-bench at %s did not produce a result\n", llama_bench);
    }
    if (json_path) {
        FILE *f = fopen(json_path, "w");
        if (f) {
            fprintf(f,
                    "{\"bench\":\"%s\",\"model\":\"%s\",\"threads\":%d,\"tok_s\":%.4f,\"read_bw_gbs\":%.3f,"
                    "\"weight_bytes\":%llu,\"peer_tok_s\":%.4f}\n",
                    what, model_path, T, tps, bw, (unsigned long long)wbytes, peer);
            fclose(f);
        }
    }
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "kvbridge bench: %s\n", err.msg);
done:
    free(toks);
    free(logits);
    free(times);
    kvb_engine_free(e);
    kvb_model_free(m);
    return rc;
}
