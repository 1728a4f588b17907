/* cli/cmd_bench.c — `kvbridge bench prefill|decode`: CPU engine speed beside the machine's
 * measured memory bandwidth (same run, same threads) and, when given, llama.cpp's llama-bench
 * on the same file with the same threads. Benchmarks print; they never assert. */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_engine_cpu.h"
#ifdef KVB_HAVE_CUDA
#include "kvb_bridge_cuda.h"
#include "kvb_engine_cuda.h"
#endif
#include "kvb_quant.h"

/* Decode throughput of `batch` sequences stepped together: each prefilled with its own n_ctx-token
 * prompt (toks shifted by its index mod V, so no two share cache blocks), then n_gen batched steps;
 * *tps = the median over reps of batch * n_gen / seconds. */
static kvb_status bench_decode_batch(kvb_engine *e, uint32_t V, const int32_t *toks, uint32_t n_ctx, uint32_t n_gen,
                                     uint32_t batch, int reps, double *tps, kvb_err *err) {
    kvb_seq **seqs = calloc(batch, sizeof *seqs);
    int32_t *own = malloc(sizeof(int32_t) * (n_ctx + n_gen) * batch), *step = malloc(sizeof(int32_t) * batch);
    float *logits = malloc(sizeof(float) * V * batch);
    double times[100];
    kvb_status st = seqs && own && step && logits ? KVB_OK : kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    for (uint32_t b = 0; !st && b < batch; b++)
        for (uint32_t i = 0; i < n_ctx + n_gen; i++) own[(size_t)b * (n_ctx + n_gen) + i] = (toks[i] + (int32_t)b) % (int32_t)V;
    for (int r = 0; !st && r < reps; r++) {
        for (uint32_t b = 0; !st && b < batch; b++) {
            st = kvb_seq_create(e, &seqs[b], err);
            if (!st) st = kvb_engine_forward(e, seqs[b], own + (size_t)b * (n_ctx + n_gen), n_ctx, logits, false, err);
        }
        const double t0 = kvb_now_s();
        for (uint32_t g = 0; !st && g < n_gen; g++) {
            for (uint32_t b = 0; b < batch; b++) step[b] = own[(size_t)b * (n_ctx + n_gen) + n_ctx + g];
            st = kvb_engine_forward_batch(e, seqs, step, batch, logits, err);
        }
        times[r] = (double)batch * n_gen / (kvb_now_s() - t0);
        for (uint32_t b = 0; b < batch; b++) {
            kvb_seq_free(seqs[b]);
            seqs[b] = NULL;
        }
        if (!st) fprintf(stderr, "bench decode: batch of %u, run %d/%d: %.2f tok/s\n", batch, r + 1, reps, times[r]);
    }
    if (!st) *tps = kvb_median_sort(times, reps);
    free(seqs);
    free(own);
    free(step);
    free(logits);
    return st;
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

#ifdef KVB_HAVE_CUDA
/* ---- prefill on the GPU ---------------------------------------------------------------------- */

/* Reads tools/peer/torch_llama_prefill.py's JSON: {"peer": "...", "results": [{"tokens": N,
 * "tok_s": X}, ...]}; returns tok/s for n tokens, or -1. */
static double peer_tok_s(const cJSON *root, long long n) {
    const cJSON *res = cJSON_GetObjectItem(root, "results"), *it;
    cJSON_ArrayForEach(it, res) {
        const cJSON *t = cJSON_GetObjectItem(it, "tokens"), *v = cJSON_GetObjectItem(it, "tok_s");
        if (cJSON_IsNumber(t) && cJSON_IsNumber(v) && (long long)t->valuedouble == n) return v->valuedouble;
    }
    return -1;
}

static cJSON *read_json(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t n = 0, cap = 0, k;
    char tmp[4096];
    while ((k = fread(tmp, 1, sizeof tmp, f)) > 0) {
        if (n + k + 1 > cap) {
            cap = (n + k + 1) * 2;
            char *nb = realloc(buf, cap);
            if (!nb) break;
            buf = nb;
        }
        memcpy(buf + n, tmp, k);
        n += k;
    }
    fclose(f);
    if (!buf) return NULL;
    buf[n] = 0;
    cJSON *root = cJSON_Parse(buf);
    free(buf);
    return root;
}

/* Effective FLOPs of a prefill of n tokens: 2 x parameters (non-embedding, without the output head:
 * the head runs for the last token only, and the peer runs no head) x n, plus causal attention
 * (QK^T and PV over the causal triangle) 2 x layers x heads x head_dim x n^2. */
static double prefill_flops(const kvb_model_desc *d, double n) {
    double p = (double)kvb_model_n_params_nonembd(d) - (double)d->n_vocab * d->n_embd;
    return 2.0 * p * n + 2.0 * d->n_layer * (double)d->n_head * d->head_dim * n * n;
}

/* --bridge: the hook runs the bridge kernel while `on`; shipped rows are only counted. */
typedef struct {
    kvb_bridge_cuda *b;
    bool on;
    uint64_t bytes;
} bench_bridge;

static kvb_status bench_bridge_hook(void *ctx, int rank, uint32_t layer, uint32_t pos0, uint32_t n, const float *d_h,
                                    void *stream, kvb_err *err) {
    (void)rank; /* rank 0's: the engine calls this hook on rank 0 only */
    bench_bridge *bb = ctx;
    return bb->on ? kvb_bridge_cuda_enqueue(bb->b, layer, pos0, n, d_h, stream, err) : KVB_OK;
}

static kvb_status bench_bridge_ship(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n, const uint8_t *k,
                                    const uint8_t *v, uint64_t *ticket, kvb_err *err) {
    (void)ticket; /* sent when it returns */
    (void)layer, (void)pos0, (void)k, (void)v, (void)err;
    ((bench_bridge *)ctx)->bytes += n;
    return KVB_OK;
}

/* One forward of toks[0..n) on a fresh sequence (last token's logits to the host), then the
 * bridge's flush when flush is set; *seconds: its wall time. */
static kvb_status forward_fresh(kvb_cuda_engine *e, const int32_t *toks, uint32_t n, uint32_t n_vocab,
                                kvb_bridge_cuda *flush, double *seconds, kvb_err *err) {
    kvb_cuda_seq *s = NULL;
    float *lg = malloc(sizeof(float) * n_vocab);
    kvb_status st = !lg ? kvb_err_set(err, KVB_ERR_NOMEM, "out of memory") : kvb_cuda_seq_create(e, &s, err);
    const double a = kvb_now_s();
    if (!st) st = kvb_cuda_forward(e, s, toks, n, lg, false, err);
    if (!st && flush) st = kvb_bridge_cuda_flush(flush, err);
    *seconds = kvb_now_s() - a;
    kvb_cuda_seq_free(s);
    free(lg);
    return st;
}

static int bench_prefill_cuda(const char *model_path, const char *tokens_arg, int reps, int warmup, uint32_t chunk,
                              int ceiling_reps, const char *peer_json, const char *json_path, uint32_t bridge_dtype,
                              const char *attn_arg, bool host_overhead, int gpus, bool tp_one_device,
                              int gpu_weights) {
    /* --attention: the kinds to time side by side (0 = the engine's choice) */
    kvb_cuda_attention kinds[2] = {KVB_CUDA_ATTN_AUTO, KVB_CUDA_ATTN_AUTO};
    int n_kinds = 1;
    if (attn_arg) {
        if (!strcmp(attn_arg, "own")) kinds[0] = KVB_CUDA_ATTN_OWN;
        else if (!strcmp(attn_arg, "cudnn")) kinds[0] = KVB_CUDA_ATTN_CUDNN;
        else if (!strcmp(attn_arg, "both")) kinds[0] = KVB_CUDA_ATTN_OWN, kinds[1] = KVB_CUDA_ATTN_CUDNN, n_kinds = 2;
        else if (strcmp(attn_arg, "auto")) {
            fprintf(stderr, "kvbridge bench: --attention expects own, cudnn, both or auto, got '%s'\n", attn_arg);
            return 2;
        }
    }
    long long sizes[16];
    int n_sizes = 0;
    long long max_n = 0;
    for (const char *p = tokens_arg; *p;) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || v < 1 || v > (1LL << 24) || n_sizes == 16) {
            fprintf(stderr, "kvbridge bench: --tokens expects up to 16 comma-separated sizes in 1..16777216, got '%s'\n",
                    tokens_arg);
            return 2;
        }
        sizes[n_sizes++] = v;
        if (v > max_n) max_n = v;
        p = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') {
            fprintf(stderr, "kvbridge bench: --tokens expects comma-separated sizes, got '%s'\n", tokens_arg);
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    kvb_err err = {0};
    kvb_model *m = NULL;
    kvb_cuda_engine *e = NULL;
    int32_t *toks = NULL;
    double *tps = NULL;
    cJSON *peer = NULL, *out = NULL;
    bench_bridge bb = {0};
    double *tps_bridged = NULL;
    double gated[2][16] = {{0}}; /* --host-overhead: the gated forward's GPU seconds per kind and size */
    int rc = 1;
    if (peer_json && !(peer = read_json(peer_json)))
        fprintf(stderr, "kvbridge bench: could not read peer figures from %s; continuing without them\n", peer_json);

    double t0 = kvb_now_s();
    if (kvb_model_load(model_path, &m, &err)) goto fail;
    kvb_cuda_opts o = {.max_ctx = (uint32_t)max_n, .max_batch = chunk, .no_prefix_cache = true,
                       .attention = n_kinds == 2 ? KVB_CUDA_ATTN_CUDNN : kinds[0], .n_gpus = gpus,
                       .tp_one_device = tp_one_device, .weights = (kvb_cuda_weights)gpu_weights};
    if (bridge_dtype) {
        if (kvb_bridge_cuda_create(m, bridge_dtype, chunk ? chunk : (max_n < 8192 ? (uint32_t)max_n : 8192), &bb.b,
                                   &err))
            goto fail;
        kvb_bridge_cuda_set_ship(bb.b, bench_bridge_ship, NULL, &bb);
        o.layer_hook = bench_bridge_hook;
        o.layer_hook_ctx = &bb;
        if (!(tps_bridged = calloc((size_t)reps * n_sizes * n_kinds, sizeof(double)))) {
            kvb_err_set(&err, KVB_ERR_NOMEM, "out of memory");
            goto fail;
        }
    }
    if (kvb_cuda_engine_create(m, &o, &e, &err)) goto fail;
    double t_load = kvb_now_s() - t0;
    toks = malloc(sizeof(int32_t) * (size_t)max_n);
    tps = malloc(sizeof(double) * (size_t)reps * n_sizes * n_kinds);
    if (!toks || !tps) {
        kvb_err_set(&err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    char desc[512];
    kvb_model_describe(m, desc, sizeof desc);
    printf("model      %s\n           %s\n", model_path, desc);
    kvb_cuda_engine_describe(e, desc, sizeof desc);
    printf("device     %s\n", desc);
    printf("load       %.1f s (mmap, convert, upload)\n", t_load);
    if (getenv("KVB_CUDA_DEBUG_SKIP_ATTENTION"))
        printf("NOTE       KVB_CUDA_DEBUG_SKIP_ATTENTION is set: attention is left out (diagnostic timing only)\n");
    if (getenv("KVB_CUDA_FA_BR")) printf("NOTE       KVB_CUDA_FA_BR=%s\n", getenv("KVB_CUDA_FA_BR"));
    char adesc[2][768];
    for (int ai = 0; ai < n_kinds; ai++) {
        if (n_kinds == 2 && kvb_cuda_engine_set_attention(e, kinds[ai], &err)) goto fail;
        kvb_cuda_engine_attention_describe(e, adesc[ai], sizeof adesc[ai]);
        printf("attention  %s%s\n", n_kinds == 2 ? (ai ? "[B] " : "[A] ") : "", adesc[ai]);
    }

    kvb_rng rng;
    for (int ai = 0; ai < n_kinds; ai++) {
        if (n_kinds == 2 && kvb_cuda_engine_set_attention(e, kinds[ai], &err)) goto fail;
        for (int si = 0; si < n_sizes; si++) {
            const uint32_t n = (uint32_t)sizes[si];
            for (int pass = 0; pass < (bridge_dtype ? 2 : 1); pass++)
            for (int r = -warmup; r < reps; r++) { /* r < 0: warm-up; pass 1: with the bridge */
                bb.on = pass == 1;
                kvb_rng_seed(&rng, 1000003ULL * (uint64_t)n + (uint64_t)(r + 2)); /* fresh tokens every run */
                for (uint32_t i = 0; i < n; i++) toks[i] = (int32_t)(kvb_rng_u64(&rng) % m->d.n_vocab);
                double secs = 0;
                if (forward_fresh(e, toks, n, m->d.n_vocab, bb.on ? bb.b : NULL, &secs, &err)) goto fail;
                if (r == reps - 1 && pass == 0 && host_overhead) { /* one more forward, gated */
                    kvb_cuda_stats cs0;
                    kvb_cuda_engine_stats(e, &cs0);
                    const int gate_ms = (int)(2000.0 * cs0.last_forward_s) + 50;
                    double gated_wall; /* includes the wait at the gate: means nothing */
                    if (kvb_cuda_engine_gate_next(e, gate_ms < 60000 ? gate_ms : 60000, &err) ||
                        forward_fresh(e, toks, n, m->d.n_vocab, NULL, &gated_wall, &err))
                        goto fail;
                    kvb_cuda_engine_stats(e, &cs0);
                    gated[ai][si] = cs0.last_gated_gpu_s;
                }
                if (r >= 0) {
                    double *dst = (pass ? tps_bridged : tps) + (size_t)ai * n_sizes * reps;
                    dst[si * reps + r] = n / secs;
                    fprintf(stderr, "bench prefill cuda: %u tokens%s%s, run %d/%d: %.0f tok/s (%.3f s)\n", n,
                            pass ? " with the bridge" : "", n_kinds == 2 ? (ai ? " [B]" : " [A]") : "", r + 1, reps,
                            dst[si * reps + r], secs);
                }
            }
        }
    }
    { /* the plans built and any fallback counted during the runs show in the description */
        char after[768];
        kvb_cuda_engine_attention_describe(e, after, sizeof after);
        printf("attention  %safter the runs: %s\n", n_kinds == 2 ? "[B] " : "", after);
    }
    double c_med = 0, c_best = 0;
    if (kvb_cuda_gemm_bench(kvb_cuda_engine_opts(e)->device, 8192, 8192, 8192, ceiling_reps, &c_med, &c_best, &err))
        goto fail;
    printf("ceiling    bf16 GEMM 8192x8192x8192, cuBLAS, this run: %.1f TFLOP/s (median of %d; best %.1f)\n", c_med,
           ceiling_reps, c_best);
    printf("flops      2 x %.3g params (non-embedding, no output head) x n + 2 x %u layers x %u heads x %u x n^2\n",
           (double)kvb_model_n_params_nonembd(&m->d) - (double)m->d.n_vocab * m->d.n_embd, m->d.n_layer, m->d.n_head,
           m->d.head_dim);
    if (peer) {
        const cJSON *pn = cJSON_GetObjectItem(peer, "peer");
        printf("peer       %s\n", cJSON_IsString(pn) ? pn->valuestring : peer_json);
    }
    out = cJSON_CreateObject();
    cJSON *arr = cJSON_AddArrayToObject(out, "results");
    for (int ai = 0; ai < n_kinds; ai++) {
        if (n_kinds == 2) printf("%s %s\n", ai ? "[B]" : "[A]", ai ? "cuDNN fused attention" : "own attention kernel");
        printf("%8s %12s %10s %9s %12s %8s   %s\n", "tokens", "tok/s", "TFLOP/s", "%ceiling", "peer tok/s", "vs peer",
               "runs (tok/s)");
        for (int si = 0; si < n_sizes; si++) {
            double runs[100];
            const double *tk = tps + (size_t)ai * n_sizes * reps;
            memcpy(runs, tk + si * reps, sizeof(double) * (size_t)reps);
            double med = kvb_median_sort(runs, reps);
            double tf = prefill_flops(&m->d, (double)sizes[si]) / ((double)sizes[si] / med) / 1e12;
            double pt = peer ? peer_tok_s(peer, sizes[si]) : -1;
            char ps[32] = "-", pr[32] = "-";
            if (pt > 0) {
                snprintf(ps, sizeof ps, "%.0f", pt);
                snprintf(pr, sizeof pr, "%.2fx", med / pt);
            }
            printf("%8lld %12.0f %10.1f %8.1f%% %12s %8s  ", sizes[si], med, tf, 100.0 * tf / c_med, ps, pr);
            for (int r = 0; r < reps; r++) printf(" %.0f", runs[r]);
            printf("\n");
            cJSON *it = cJSON_CreateObject();
            cJSON_AddNumberToObject(it, "tokens", (double)sizes[si]);
            cJSON_AddNumberToObject(it, "tok_s", med);
            cJSON_AddNumberToObject(it, "tflops", tf);
            cJSON_AddNumberToObject(it, "ceiling_fraction", tf / c_med);
            cJSON_AddNumberToObject(it, "peer_tok_s", pt);
            cJSON_AddStringToObject(it, "attention", adesc[ai]);
            cJSON *ra = cJSON_AddArrayToObject(it, "runs_tok_s");
            for (int r = 0; r < reps; r++) cJSON_AddItemToArray(ra, cJSON_CreateNumber(runs[r]));
            cJSON_AddItemToArray(arr, it);
        }
    }
    if (host_overhead) {
        printf("host overhead: the GPU's time for a forward enqueued behind a gate and run back to back, vs the\n"
               "median wall time; the difference is time the GPU waited for the host (launch gaps, host work)\n");
        printf("%8s %6s %12s %12s %10s\n", "tokens", "attn", "wall s", "GPU s", "host share");
        for (int ai = 0; ai < n_kinds; ai++)
            for (int si = 0; si < n_sizes; si++) {
                double rr[100];
                memcpy(rr, tps + ((size_t)ai * n_sizes + si) * reps, sizeof(double) * (size_t)reps);
                const double wall = (double)sizes[si] / kvb_median_sort(rr, reps);
                printf("%8lld %6s %12.4f %12.4f %9.1f%%\n", sizes[si],
                       kinds[ai] == KVB_CUDA_ATTN_OWN ? "own" : kinds[ai] == KVB_CUDA_ATTN_CUDNN ? "cudnn" : "auto", wall,
                       gated[ai][si], 100.0 * (1.0 - gated[ai][si] / wall));
            }
    }
    if (n_kinds == 2) {
        printf("side by side: cuDNN / own kernel, median tok/s\n");
        for (int si = 0; si < n_sizes; si++) {
            double ra[100], rb[100];
            memcpy(ra, tps + si * reps, sizeof(double) * (size_t)reps);
            memcpy(rb, tps + ((size_t)n_sizes + si) * reps, sizeof(double) * (size_t)reps);
            const double ma = kvb_median_sort(ra, reps), mb = kvb_median_sort(rb, reps);
            printf("%8lld %12.0f %12.0f %8.2fx\n", sizes[si], ma, mb, mb / ma);
        }
    }
    if (bridge_dtype) {
        printf("bridge     decoder-mode bridge kernel (this file's K/V weights, %s, cache %s) hooked after every\n"
               "           (chunk, layer); rows copied to pinned host memory; cost = bridged time / plain time - 1\n",
               kvb_type_name(m->layers[0].wk.type), kvb_type_name(bridge_dtype));
        printf("%8s %12s %14s %10s\n", "tokens", "plain tok/s", "bridged tok/s", "cost");
        for (int si = 0; si < n_sizes; si++) {
            double mp = kvb_median_sort(tps + si * reps, reps), mb = kvb_median_sort(tps_bridged + si * reps, reps);
            /* (kind A's figures when two kinds ran) */
            printf("%8lld %12.0f %14.0f %9.1f%%\n", sizes[si], mp, mb, 100.0 * (mp / mb - 1.0));
        }
    }
    kvb_cuda_stats cs;
    kvb_cuda_engine_stats(e, &cs);
    printf("memory     GPU in use at most %.2f GiB of %.1f (weights %.2f, KV cache %.2f, activations+tables %.2f)\n",
           cs.dev_peak_used_bytes / 1073741824.0, cs.dev_total_bytes / 1073741824.0, cs.weight_bytes / 1073741824.0,
           cs.kv_bytes / 1073741824.0, cs.act_bytes / 1073741824.0);
    cJSON_AddNumberToObject(out, "ceiling_tflops", c_med);
    cJSON_AddNumberToObject(out, "ceiling_tflops_best", c_best);
    cJSON_AddNumberToObject(out, "peak_gpu_bytes", (double)cs.dev_peak_used_bytes);
    cJSON_AddStringToObject(out, "model", model_path);
    if (json_path) {
        char *txt = cJSON_PrintUnformatted(out);
        FILE *f = fopen(json_path, "w");
        if (f && txt) fprintf(f, "%s\n", txt);
        if (f) fclose(f);
        free(txt);
    }
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "kvbridge bench: %s\n", err.msg);
done:
    cJSON_Delete(out);
    cJSON_Delete(peer);
    free(toks);
    free(tps);
    free(tps_bridged);
    kvb_cuda_engine_free(e);
    kvb_bridge_cuda_free(bb.b);
    kvb_model_free(m);
    return rc;
}
#endif

/* What the command line asks of `bench prefill|decode`. */
typedef struct {
    const char *model_path, *llama_bench, *json_path, *tokens_arg, *peer_json, *attn_arg;
    long long threads, n_gen, n_ctx, reps, chunk, ceiling_reps, warmup, batch;
    int device; /* kvb_cli_device_names */
    bool host_overhead;
    kvb_cli_gpu gpu;
    uint32_t cache_type, bridge_type;
} bench_args;

static const char *const k_bench_usage =
    "(prefill|decode) -m MODEL [options]\n"
    "ladder -m MODEL [options]   (see kvbridge bench ladder --help)\n"
    "link (--listen|--peer) ADDR (see kvbridge bench link --help)\n"
    "quality [-m MODEL] [options]  (see kvbridge bench quality --help)\n"
    "slab [options]              (see kvbridge bench slab --help)\n"
    "tokenize -m MODEL [options] (see kvbridge bench tokenize --help)\n"
    "parallel -m MODEL [options] (see kvbridge bench parallel --help)\n"
    "json -m MODEL [options]     (see kvbridge bench json --help)";

/* Fills *a from argv (argv[0]: prefill or decode); KVB_CLI_GO, or the code the command returns. */
static int bench_parse(bench_args *a, int argc, char **argv) {
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&a->model_path, "GGUF model", true),
        KVB_CLI_OPT_THREADS(&a->threads, "threads (default: all CPUs)"),
        {.long_name = "tokens", .kind = KVB_OPT_STRING, .dst = &a->tokens_arg, .meta = "N",
         .help = "prefill tokens (default 512; cuda: a list of sizes, default 2048)"},
        {.long_name = "gen", .kind = KVB_OPT_INT, .dst = &a->n_gen, .meta = "N", .help = "decode steps",
         .def = "128", .lo = 1, .hi = 1 << 20},
        {.long_name = "ctx", .kind = KVB_OPT_INT, .dst = &a->n_ctx, .meta = "N",
         .help = "prompt length before decode", .def = "16", .lo = 1, .hi = 1 << 20},
        {.long_name = "batch", .kind = KVB_OPT_INT, .dst = &a->batch, .meta = "B", .def = "1", .lo = 1, .hi = 256,
         .help = "decode: also B sequences stepped together (kvb_engine_forward_batch), each after its own --ctx "
                 "prompt: their tokens/s beside one sequence's, same run"},
        {.long_name = "reps", .kind = KVB_OPT_INT, .dst = &a->reps, .meta = "R",
         .help = "repetitions; the median is reported", .def = "3", .lo = 1, .hi = 100},
        KVB_CLI_OPT_CACHE_TYPE(&a->cache_type, "KV cache dtype"),
        {.long_name = "llama-bench", .kind = KVB_OPT_STRING, .dst = &a->llama_bench, .meta = "PATH",
         .help = "also run llama.cpp's llama-bench on the same file and threads"},
        {.long_name = "json", .kind = KVB_OPT_STRING, .dst = &a->json_path, .meta = "FILE",
         .help = "also write the figures as JSON"},
        KVB_CLI_OPT_DEVICE(&a->device,
                           "cuda: prefill on the GPU (bf16), several sizes (--tokens 2048,8192,32768) in one run, "
                           "each beside the bf16 GEMM ceiling measured in the same run (cuBLAS 8192^3) and, with "
                           "--peer-json, a peer's figures for the same sizes"),
        {.long_name = "chunk", .kind = KVB_OPT_INT, .dst = &a->chunk, .meta = "N", .lo = 1, .hi = 1 << 24,
         .help = "(cuda) tokens per forward chunk (default 8192)"},
        {.long_name = "peer-json", .kind = KVB_OPT_STRING, .dst = &a->peer_json, .meta = "FILE",
         .help = "(cuda) JSON from tools/peer/torch_llama_prefill.py"},
        {.long_name = "bridge", .kind = KVB_OPT_CUSTOM, .dst = &a->bridge_type, .meta = "T",
         .parse = kvb_opt_parse_type,
         .help = "(cuda) also time every size with the CUDA bridge kernel hooked after each (chunk, layer), "
                 "writing a decoder cache of dtype T from this file's K/V weights (use a Q8_0/Q4_0 file: a CPU "
                 "decoder's), and print its cost as a fraction of the prefill time (kernels and copies to pinned "
                 "memory; the slabs are not sent anywhere)"},
        {.long_name = "ceiling-reps", .kind = KVB_OPT_INT, .dst = &a->ceiling_reps, .meta = "N",
         .help = "(cuda) timed GEMMs for the ceiling", .def = "20", .lo = 1, .hi = 1000},
        {.long_name = "warmup", .kind = KVB_OPT_INT, .dst = &a->warmup, .meta = "N", .def = "2", .lo = 0, .hi = 100,
         .help = "(cuda) untimed forwards before each size's timed ones (the first runs a new shape on the "
                 "engine's kernel, the second builds cuDNN's plans)"},
        {.long_name = "attention", .kind = KVB_OPT_STRING, .dst = &a->attn_arg, .meta = "A",
         .help = "(cuda) attention on global layers: own (the engine's flash kernel), cudnn (cuDNN's fused "
                 "attention, libcudnn.so.9 on LD_LIBRARY_PATH), both (each size with each, side by side, and "
                 "their ratio) or auto (default: cuDNN when it loads; KVB_CUDA_ATTENTION=own|cudnn sets the "
                 "default everywhere). cuDNN builds a plan (40-100 ms) for a new shape only when it pays; other "
                 "chunks run on the engine's kernel (KVB_CUDNN_PLANS=eager: a plan for every shape)"},
        {.long_name = "host-overhead", .kind = KVB_OPT_FLAG, .dst = &a->host_overhead,
         .help = "(cuda) after each size, one forward enqueued behind a gate kernel (the GPU waits until the host "
                 "has enqueued everything), timed on the GPU: the share of the wall time the GPU spent waiting "
                 "for the host (launch gaps, host work)"},
        KVB_CLI_OPTS_GPU(&a->gpu),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "bench", .usage = k_bench_usage, .opts = opts,
        .about = "Measures the CPU engine and prints tok/s beside the memory bandwidth measured in the same run.\n"
                 "  prefill   one batch of --tokens random tokens from an empty cache (like llama-bench pp)\n"
                 "  decode    --gen single-token steps after a --ctx-token prompt (like llama-bench tg)\n"
                 "With --gpus N, KVB_TP_OVERLAP=1 runs the all-reduces beside the GEMMs (off by default)."};
    int rc = kvb_cli_parse(&spec, argc, argv);
    if (rc != KVB_CLI_GO) return rc;
    return kvb_cli_gpu_ok("bench", &a->gpu, a->device == 1) ? KVB_CLI_GO : 2;
}

/* The benchmarks `kvbridge bench NAME` dispatches to, each given argv from NAME on. */
static const struct {
    const char *name;
    int (*fn)(int, char **);
} k_bench_kinds[] = {
    {"ladder", kvb_bench_ladder}, {"link", kvb_bench_link},         {"quality", kvb_bench_quality},
    {"slab", kvb_bench_slab},     {"tokenize", kvb_bench_tokenize}, {"parallel", kvb_bench_parallel},
    {"json", kvb_bench_json},
};

/* Times the CPU engine: one short untimed forward (pages the weights in), then --reps runs of a
 * prefill of n_tok tokens, or of --gen single-token steps after a --ctx prompt; times[r] in tok/s. */
static kvb_status bench_cpu_runs(kvb_engine *e, const int32_t *toks, float *logits, const bench_args *a, bool prefill,
                                 long long n_tok, double *times, kvb_err *err) {
    /* warm-up: one short forward pages the weights in */
    {
        kvb_seq *s = NULL;
        if (kvb_seq_create(e, &s, err)) return err->code;
        kvb_status st = kvb_engine_forward(e, s, toks, prefill ? (uint32_t)(n_tok < 32 ? n_tok : 32) : 1, logits,
                                           false, err);
        kvb_seq_free(s);
        if (st) return err->code;
    }
    for (int r = 0; r < a->reps; r++) {
        kvb_seq *s = NULL;
        if (kvb_seq_create(e, &s, err)) return err->code;
        kvb_status st = KVB_OK;
        double t0 = 0, t1 = 0;
        if (prefill) {
            t0 = kvb_now_s();
            st = kvb_engine_forward(e, s, toks, (uint32_t)n_tok, logits, false, err);
            t1 = kvb_now_s();
        } else {
            st = kvb_engine_forward(e, s, toks, (uint32_t)a->n_ctx, logits, false, err);
            t0 = kvb_now_s();
            for (long long g = 0; g < a->n_gen && !st; g++)
                st = kvb_engine_forward(e, s, &toks[a->n_ctx + g], 1, logits, false, err);
            t1 = kvb_now_s();
        }
        kvb_seq_free(s);
        if (st) return err->code;
        times[r] = (prefill ? n_tok : a->n_gen) / (t1 - t0);
        fprintf(stderr, "bench %s: run %d/%lld: %.2f tok/s\n", prefill ? "prefill" : "decode", r + 1, a->reps, times[r]);
    }
    return KVB_OK;
}

/* What a CPU benchmark measured. */
typedef struct {
    const double *runs; /* --reps tok/s figures, in run order */
    double tps, batch_tps, bw, peer; /* median tok/s, --batch's, read GB/s, llama-bench's (<= 0: none) */
    int threads;
    long long n_tok;
} bench_cpu_figures;

/* Prints the CPU benchmark's figures beside the machine's bandwidth (and llama-bench's), and
 * writes --json. */
static void bench_cpu_report(const bench_args *a, const kvb_model *m, const char *what, const bench_cpu_figures *fig) {
    const bool prefill = !strcmp(what, "prefill");
    printf("runs      ");
    for (int r = 0; r < a->reps; r++) printf(" %.2f", fig->runs[r]);
    printf(" tok/s\n");
    uint64_t wbytes = weight_bytes_per_token(m);
    double flops_tok = 2.0 * (double)kvb_model_n_params_nonembd(&m->d);
    if (prefill) {
        /* attention: QK^fig->threads and PV over the causal triangle */
        double att = 2.0 * 2.0 * m->d.n_layer * m->d.n_head * m->d.head_dim * (double)fig->n_tok * (fig->n_tok + 1) / 2.0;
        double gflops = (flops_tok * fig->n_tok + att) / (fig->n_tok / fig->tps) / 1e9;
        printf("prefill    %lld tokens: %.1f tok/s (median of %lld), %.1f GFLOP/s\n", fig->n_tok, fig->tps, a->reps, gflops);
    } else {
        size_t rb = kvb_row_bytes(a->cache_type, m->d.head_dim);
        double kv_avg = (double)m->d.n_layer * 2 * m->d.n_head_kv * rb * (a->n_ctx + a->n_gen / 2.0);
        double bytes = (double)wbytes + kv_avg;
        double achieved = bytes * fig->tps / 1e9;
        printf("decode     %lld steps after %lld tokens: %.2f tok/s (median of %lld)\n", a->n_gen, a->n_ctx, fig->tps, a->reps);
        printf("bytes/tok  %.1f MB (weights %.1f MB + KV %.2f MB)\n", bytes / 1e6, wbytes / 1e6, kv_avg / 1e6);
        printf("bandwidth  %.1f GB/s achieved = %.0f%% of %.1f GB/s measured read bandwidth (same run, %d threads)\n",
               achieved, 100.0 * achieved / fig->bw, fig->bw, fig->threads);
        if (a->batch > 1)
            printf("batch      %lld sequences stepped together: %.2f tok/s in all, %.2f per sequence = %.2fx one "
                   "sequence's %.2f tok/s\n",
                   a->batch, fig->batch_tps, fig->batch_tps / a->batch, fig->batch_tps / fig->tps, fig->tps);
    }
    if (prefill) printf("bandwidth  %.1f GB/s measured read bandwidth (same run, %d threads)\n", fig->bw, fig->threads);
    if (a->llama_bench) {
        if (fig->peer > 0)
            printf("peer       llama.cpp llama-bench %s: %.2f tok/s -> kvbridge/llama.cpp = %.2fx\n",
                   prefill ? "pp" : "tg", fig->peer, fig->tps / fig->peer);
        else printf("peer       llama-bench at %s did not produce a result\n", a->llama_bench);
    }
    if (a->json_path) {
        FILE *f = fopen(a->json_path, "w");
        if (f) {
            fprintf(f,
                    "{\"bench\":\"%s\",\"model\":\"%s\",\"threads\":%d,\"tok_s\":%.4f,\"read_bw_gbs\":%.3f,"
                    "\"weight_bytes\":%llu,\"peer_tok_s\":%.4f}\n",
                    what, a->model_path, fig->threads, fig->tps, fig->bw, (unsigned long long)wbytes, fig->peer);
            fclose(f);
        }
    }
}

/* `bench prefill|decode` on the CPU engine (what: which). */
static int bench_cpu(const bench_args *a, const char *what) {
    long long n_tok = 512;
    if (a->tokens_arg && !kvb_arg_int("bench", "--tokens", a->tokens_arg, 1, 1 << 20, &n_tok)) return 2;
    const bool prefill = !strcmp(what, "prefill");
    kvb_err err = {0};
    kvb_model *m = NULL;
    kvb_engine *e = NULL;
    int rc = 1;
    int32_t *toks = NULL;
    float *logits = NULL;
    double *times = NULL;
    if (kvb_model_load(a->model_path, &m, &err)) goto fail;
    uint32_t need = prefill ? (uint32_t)n_tok : (uint32_t)(a->n_ctx + a->n_gen);
    const uint32_t bt_default = 32; /* the engine's default block size */
    kvb_engine_opts eo = {.n_threads = (int)a->threads, .cache_dtype = a->cache_type, .max_ctx = need + 1,
                          .n_blocks = (uint32_t)(prefill ? 0 : (a->batch + 1) * ((need + 1) / bt_default + 2))};
    if (kvb_engine_create(m, &eo, &e, &err)) goto fail;
    int T = kvb_engine_threads(e);
    toks = malloc(sizeof(int32_t) * need);
    logits = malloc(sizeof(float) * m->d.n_vocab);
    times = malloc(sizeof(double) * (size_t)a->reps);
    if (!toks || !logits || !times) {
        kvb_err_set(&err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    kvb_rng rng;
    kvb_rng_seed(&rng, 42);
    for (uint32_t i = 0; i < need; i++) toks[i] = (int32_t)(kvb_rng_u64(&rng) % m->d.n_vocab);

    char desc[256];
    kvb_model_describe(m, desc, sizeof desc);
    printf("model      %s\n           %s\n", a->model_path, desc);
    printf("machine    %d threads, %s kernels, KV cache %s\n", T, kvb_simd_name(), kvb_type_name(a->cache_type));

    if (bench_cpu_runs(e, toks, logits, a, prefill, n_tok, times, &err)) goto fail;
    double runs[100];
    memcpy(runs, times, sizeof(double) * (size_t)a->reps);
    double tps = kvb_median_sort(times, (int)a->reps);
    double batch_tps = 0;
    if (!prefill && a->batch > 1 && bench_decode_batch(e, m->d.n_vocab, toks, (uint32_t)a->n_ctx, (uint32_t)a->n_gen, (uint32_t)a->batch,
                                                    (int)a->reps, &batch_tps, &err))
        goto fail;
    kvb_pool *pool = NULL;
    if (kvb_pool_create(T, &pool, &err)) goto fail;
    double bw = kvb_measure_read_bw(pool, (size_t)1 << 30, 3);
    kvb_pool_destroy(pool);

    double peer = -1;
    if (a->llama_bench)
        peer = run_llama_bench(a->llama_bench, a->model_path, T, prefill ? (int)n_tok : 0, prefill ? 0 : (int)a->n_gen,
                               (int)a->reps);

    const bench_cpu_figures fig = {.runs = runs, .tps = tps, .batch_tps = batch_tps, .bw = bw, .peer = peer,
                                   .threads = T, .n_tok = n_tok};
    bench_cpu_report(a, m, what, &fig);
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

int kvb_cmd_bench(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "kvbridge bench: name a benchmark: prefill, decode, ladder, link, quality, slab, tokenize, "
                        "parallel or json (see kvbridge bench --help)\n");
        return 2;
    }
    if (kvb_arg_is_help(argv[1])) {
        bench_args unused = {0};
        return bench_parse(&unused, argc, argv);
    }
    const char *what = argv[1];
    for (size_t k = 0; k < sizeof k_bench_kinds / sizeof k_bench_kinds[0]; k++)
        if (!strcmp(what, k_bench_kinds[k].name)) return k_bench_kinds[k].fn(argc - 1, argv + 1);
    bool prefill = !strcmp(what, "prefill");
    if (!prefill && strcmp(what, "decode")) {
        fprintf(stderr, "kvbridge bench: unknown benchmark '%s' (prefill, decode, ladder, link, slab, tokenize, parallel, json or quality; see kvbridge bench --help)\n", what);
        return 2;
    }
    bench_args a = {0};
    int prc = bench_parse(&a, argc - 1, argv + 1);
    if (prc != KVB_CLI_GO) return prc;
    const char *model_path = a.model_path, *json_path = a.json_path, *tokens_arg = a.tokens_arg,
               *peer_json = a.peer_json, *attn_arg = a.attn_arg;
    const long long reps = a.reps, chunk = a.chunk, ceiling_reps = a.ceiling_reps, warmup = a.warmup,
                    gpus = a.gpu.gpus;
    const bool cuda = a.device == 1, host_overhead = a.host_overhead, tp_one_device = a.gpu.tp_one_device;
    const int gpu_weights = a.gpu.gpu_weights;
    const uint32_t bridge_type = a.bridge_type;
    (void)model_path, (void)tokens_arg, (void)reps, (void)peer_json, (void)json_path, (void)chunk, (void)ceiling_reps,
        (void)warmup; /* the CUDA benchmark's */
    if (cuda) {
        if (!prefill) {
            fprintf(stderr, "kvbridge bench: --device cuda supports 'prefill' only for now\n");
            return 2;
        }
#ifdef KVB_HAVE_CUDA
        return bench_prefill_cuda(model_path, tokens_arg ? tokens_arg : "2048", (int)reps, (int)warmup,
                                  (uint32_t)chunk, (int)ceiling_reps, peer_json, json_path, bridge_type,
                                  attn_arg, host_overhead, (int)gpus, tp_one_device, gpu_weights);
#else
        (void)bridge_type, (void)attn_arg, (void)host_overhead, (void)gpus, (void)tp_one_device, (void)gpu_weights;
        fprintf(stderr, "kvbridge bench: --device cuda: this kvbridge was built without the CUDA engine "
                        "(configure with -DKVB_CUDA=ON where nvcc is installed)\n");
        return 2;
#endif
    }
    return bench_cpu(&a, what);
}
