/* cli/cmd_bench.c — `kvbridge bench prefill|decode`: prefill speed on whichever engine --device
 * names (one path for every engine: tok/s per size beside a GPU's GEMM ceiling or the host's
 * measured read bandwidth, and a peer's figures), and the CPU engine's decode speed beside the
 * machine's measured memory bandwidth (same run, same threads); with --llama-bench, llama.cpp's
 * llama-bench on the same file with the same threads. Benchmarks print; they never assert. */
#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_engine_cpu.h"
#include "kvb_prefill_engine.h"
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

/* Expected distinct experts of one layer that a step of B tokens reads: n_expert for B tokens
 * routed uniformly and independently (each token's top-k a uniform k-subset, so a given expert is
 * missed by one token with probability 1 - k/E) is E * (1 - (1 - k/E)^B); k for one token, 0 for a
 * dense model. */
static double expected_experts(const kvb_model_desc *d, uint32_t B) {
    if (!d->n_expert) return 0;
    const double E = d->n_expert, k = d->n_expert_used;
    return B == 1 ? k : E * (1.0 - pow(1.0 - k / E, (double)B));
}

/* Bytes of weights one decode step of B tokens reads: every dense matrix once, the output head, B
 * embedding rows; of a mixture of experts the router, the shared expert (qwen2moe, deepseek2) and
 * `experts` of each layer's expert slices (the stacks being n_expert equal slices): the active
 * parameters, for one token its k experts. */
static double weight_bytes_per_step(const kvb_model *m, uint32_t B, double experts) {
    double b = (double)mat_bytes(&m->output) + (double)B * m->tok_embd.row_bytes;
    for (uint32_t l = 0; l < m->d.n_layer; l++) {
        const kvb_layer_weights *w = &m->layers[l];
        b += (double)(mat_bytes(&w->wq) + mat_bytes(&w->wk) + mat_bytes(&w->wv) + mat_bytes(&w->wo) +
                      mat_bytes(&w->w_gate) + mat_bytes(&w->w_up) + mat_bytes(&w->w_down) + 2 * 4 * (uint64_t)m->d.n_embd);
        /* deepseek2's latent attention projections; the shared expert and its gate where present (qwen2moe,
         * deepseek2): every token reads them (0 bytes elsewhere) */
        b += (double)(mat_bytes(&w->wq_a) + mat_bytes(&w->wq_b) + mat_bytes(&w->wkv_a) + mat_bytes(&w->wk_b) +
                      mat_bytes(&w->wv_b));
        b += (double)(mat_bytes(&w->gate_inp_shexp) + mat_bytes(&w->gate_shexp) + mat_bytes(&w->up_shexp) +
                      mat_bytes(&w->down_shexp));
        if (m->d.n_expert)
            b += (double)mat_bytes(&w->ffn_gate_inp) +
                 (double)(mat_bytes(&w->gate_exps) + mat_bytes(&w->up_exps) + mat_bytes(&w->down_exps)) /
                     m->d.n_expert * experts;
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


/* ---- prefill, on any engine ------------------------------------------------------------------ */

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

/* The head size attention's FLOPs count: head_dim, or for latent attention the mean of the
 * expanded key and value heads (QK^T over key_length_mla, PV over value_length_mla). */
static double attn_head_dim(const kvb_model_desc *d) {
    return d->mla ? 0.5 * (d->head_dim_k_mla + d->head_dim_v_mla) : (double)d->head_dim;
}

/* Effective FLOPs of a prefill of n tokens: 2 x parameters (non-embedding, without the output head:
 * the head runs for the last token only, and the peer runs no head) x n, plus causal attention
 * (QK^T and PV over the causal triangle) 2 x layers x heads x head size x n^2. */
static double prefill_flops(const kvb_model_desc *d, double n) {
    double p = (double)kvb_model_n_params_active(d) - (double)d->n_vocab * d->n_embd; /* MoE: routed experts */
    return 2.0 * p * n + 2.0 * d->n_layer * (double)d->n_head * attn_head_dim(d) * n * n;
}

#define PB_MAX_SIZES 16

/* One `bench prefill` run, on whichever engine the factory gives for the options. */
typedef struct {
    /* the options */
    const char *model_path, *peer_json, *json_path, *llama_bench, *device; /* device: "cpu" or "cuda" */
    int reps, warmup, ceiling_reps;
    bool host_overhead;
    uint32_t bridge_dtype; /* --bridge: the decoder cache dtype the bridge writes (0: no bridge) */
    kvb_prefill_opts eo;
    kvb_prefill_attention kinds[2]; /* --attention: the kinds timed side by side */
    int n_kinds;
    long long sizes[PB_MAX_SIZES], max_n;
    int n_sizes;
    /* the run */
    kvb_model *m;
    kvb_prefill_engine *e;
    kvb_kvformat bridge_fmt;
    kvb_bridge_cpu *cutter; /* --bridge: cuts the rows; its sink counts them */
    uint64_t bridged_bytes;
    int32_t *toks;          /* (max_n) */
    float *logits;          /* (n_vocab) */
    double *tps, *tps_bridged; /* (kind, size, rep) tok/s: plain, and with the bridge */
    double gated[2][PB_MAX_SIZES]; /* --host-overhead: the gated forward's device seconds */
    double peer[PB_MAX_SIZES];     /* the peer's tok/s per size (-1: none) */
    char adesc[2][768];
    double c_med, c_best, read_bw; /* the GEMM ceiling (0: none), or the host's read bandwidth */
    int host_threads;
    cJSON *peer_root;
} prefill_bench;

/* --attention's choices, KVB_OPT_ENUM's indices: the first three are kinds, "both" times own and
 * cudnn side by side. */
static const char *const k_bench_attention[] = {"auto", "own", "cudnn", "both", NULL};
enum { BENCH_ATTN_BOTH = 3 };

/* --tokens and --attention (attention: k_bench_attention); false (said) when malformed. */
static bool prefill_parse(prefill_bench *b, const char *tokens_arg, int attention) {
    static const kvb_prefill_attention kinds[] = {KVB_PREFILL_ATTN_AUTO, KVB_PREFILL_ATTN_OWN, KVB_PREFILL_ATTN_CUDNN};
    b->kinds[0] = b->kinds[1] = KVB_PREFILL_ATTN_AUTO;
    b->n_kinds = 1;
    if (attention == BENCH_ATTN_BOTH)
        b->kinds[0] = KVB_PREFILL_ATTN_OWN, b->kinds[1] = KVB_PREFILL_ATTN_CUDNN, b->n_kinds = 2;
    else b->kinds[0] = kinds[attention];
    for (const char *p = tokens_arg; *p;) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || v < 1 || v > (1LL << 24) || b->n_sizes == PB_MAX_SIZES) {
            fprintf(stderr, "kvbridge bench: --tokens expects up to 16 comma-separated sizes in 1..16777216, got '%s'\n",
                    tokens_arg);
            return false;
        }
        b->sizes[b->n_sizes++] = v;
        if (v > b->max_n) b->max_n = v;
        p = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') {
            fprintf(stderr, "kvbridge bench: --tokens expects comma-separated sizes, got '%s'\n", tokens_arg);
            return false;
        }
    }
    if (b->reps < 1) b->reps = 1;
    return true;
}

/* --bridge: the rows are cut into slabs and counted, nothing is sent. */
static kvb_status count_slab(void *ctx, const kvb_slab *s, kvb_err *err) {
    (void)err;
    ((prefill_bench *)ctx)->bridged_bytes += s->k_bytes + s->v_bytes;
    return KVB_OK;
}

/* Loads the model, makes the engine (and the bridge's cutter) and the buffers; prints what runs. */
static kvb_status prefill_setup(prefill_bench *b, kvb_err *err) {
    const double t0 = kvb_now_s();
    kvb_status st = kvb_model_load(b->model_path, &b->m, err);
    b->eo.max_ctx = (uint32_t)b->max_n;
    b->eo.no_prefix_cache = true;
    b->eo.attention = b->n_kinds == 2 ? KVB_PREFILL_ATTN_CUDNN : b->kinds[0];
    if (!st && b->bridge_dtype) { /* this file's K/V weights, in a decoder's cache of that dtype */
        const uint32_t chunk = b->eo.max_batch ? b->eo.max_batch : (b->max_n < 8192 ? (uint32_t)b->max_n : 8192);
        st = kvb_model_kvformat(&b->m->d, b->bridge_dtype, 32, &b->bridge_fmt, err);
        if (!st) st = kvb_bridge_cpu_create(b->m, &b->bridge_fmt, NULL, chunk, &b->cutter, err);
        if (!st) kvb_bridge_cpu_sink_checksums(b->cutter, true); /* nothing is sent: nothing hashed */
        b->eo.bridge = b->cutter;
        b->eo.bridge_fmt = &b->bridge_fmt;
    }
    if (!st) st = kvb_prefill_engine_create(b->m, &b->eo, &b->e, err);
    if (st) return st;
    const double t_load = kvb_now_s() - t0;
    const size_t runs = (size_t)b->reps * b->n_sizes * b->n_kinds;
    b->toks = malloc(sizeof(int32_t) * (size_t)b->max_n);
    b->logits = malloc(sizeof(float) * b->m->d.n_vocab);
    b->tps = calloc(runs, sizeof(double));
    b->tps_bridged = calloc(runs, sizeof(double));
    if (!b->toks || !b->logits || !b->tps || !b->tps_bridged) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    char desc[768];
    kvb_model_describe(b->m, desc, sizeof desc);
    printf("model      %s\n           %s\n", b->model_path, desc);
    kvb_prefill_engine_describe(b->e, desc, sizeof desc);
    printf("device     %s\n", desc);
    printf("load       %.1f s (%s engine: mmap, convert, upload)\n", t_load, kvb_prefill_engine_name(b->e));
    if (getenv("KVB_CUDA_DEBUG_SKIP_ATTENTION"))
        printf("NOTE       KVB_CUDA_DEBUG_SKIP_ATTENTION is set: attention is left out (diagnostic timing only)\n");
    if (getenv("KVB_CUDA_FA_BR")) printf("NOTE       KVB_CUDA_FA_BR=%s\n", getenv("KVB_CUDA_FA_BR"));
    for (int ai = 0; ai < b->n_kinds; ai++) {
        if (b->n_kinds == 2 && (st = kvb_prefill_engine_set_attention(b->e, b->kinds[ai], err))) return st;
        kvb_prefill_engine_attention_describe(b->e, b->adesc[ai], sizeof b->adesc[ai]);
        printf("attention  %s%s\n", b->n_kinds == 2 ? (ai ? "[B] " : "[A] ") : "", b->adesc[ai]);
    }
    return KVB_OK;
}

/* One forward of toks[0..n) on a fresh sequence (last token's logits to the host, the bridge's
 * rows handed over); *seconds: its wall time. */
static kvb_status forward_fresh(prefill_bench *b, uint32_t n, double *seconds, kvb_err *err) {
    kvb_prefill_seq *s = NULL;
    kvb_status st = kvb_prefill_seq_create(b->e, &s, err);
    const double t0 = kvb_now_s();
    if (!st) st = kvb_prefill_forward(b->e, s, b->toks, n, b->logits, false, err);
    *seconds = kvb_now_s() - t0;
    kvb_prefill_seq_free(s);
    return st;
}

/* --host-overhead: one more forward enqueued behind a gate; the device's own seconds for it. */
static kvb_status time_gated(prefill_bench *b, uint32_t n, double *gpu_s, kvb_err *err) {
    kvb_prefill_stats ps;
    kvb_prefill_engine_stats(b->e, &ps);
    const int gate_ms = (int)(2000.0 * ps.last_forward_s) + 50;
    double gated_wall; /* includes the wait at the gate: means nothing */
    kvb_status st = kvb_prefill_engine_gate_next(b->e, gate_ms < 60000 ? gate_ms : 60000, err);
    if (!st) st = forward_fresh(b, n, &gated_wall, err);
    kvb_prefill_engine_stats(b->e, &ps);
    *gpu_s = ps.last_gated_gpu_s;
    return st;
}

/* Size si with attention kind ai: warm-up and timed forwards, plain then (--bridge) bridged,
 * fresh tokens every run. */
static kvb_status time_size(prefill_bench *b, int ai, int si, kvb_err *err) {
    const uint32_t n = (uint32_t)b->sizes[si];
    kvb_rng rng;
    kvb_status st = KVB_OK;
    for (int pass = 0; !st && pass < (b->bridge_dtype ? 2 : 1); pass++) {
        kvb_prefill_bridge_begin(b->e, 0, pass ? n : 0, count_slab, b); /* pass 0: the bridge idles */
        for (int r = -b->warmup; !st && r < b->reps; r++) { /* r < 0: warm-up */
            kvb_rng_seed(&rng, 1000003ULL * (uint64_t)n + (uint64_t)(r + 2));
            for (uint32_t i = 0; i < n; i++) b->toks[i] = (int32_t)(kvb_rng_u64(&rng) % b->m->d.n_vocab);
            double secs = 0;
            st = forward_fresh(b, n, &secs, err);
            if (!st && r == b->reps - 1 && pass == 0 && b->host_overhead) st = time_gated(b, n, &b->gated[ai][si], err);
            if (st || r < 0) continue;
            double *dst = (pass ? b->tps_bridged : b->tps) + (size_t)ai * b->n_sizes * b->reps;
            dst[si * b->reps + r] = n / secs;
            fprintf(stderr, "bench prefill %s: %u tokens%s%s, run %d/%d: %.0f tok/s (%.3f s)\n", b->device, n,
                    pass ? " with the bridge" : "", b->n_kinds == 2 ? (ai ? " [B]" : " [A]") : "", r + 1, b->reps,
                    dst[si * b->reps + r], secs);
        }
    }
    return st;
}

/* Every kind and size timed, then what they are measured against: the device's GEMM ceiling, the
 * host's read bandwidth (a CPU engine's threads), and the peer (its JSON, or llama-bench). */
static kvb_status prefill_measure(prefill_bench *b, kvb_err *err) {
    kvb_status st = KVB_OK;
    for (int ai = 0; !st && ai < b->n_kinds; ai++) {
        if (b->n_kinds == 2) st = kvb_prefill_engine_set_attention(b->e, b->kinds[ai], err);
        for (int si = 0; !st && si < b->n_sizes; si++) st = time_size(b, ai, si, err);
    }
    if (st) return st;
    char after[768]; /* the plans built and any fallback counted during the runs */
    kvb_prefill_engine_attention_describe(b->e, after, sizeof after);
    printf("attention  %safter the runs: %s\n", b->n_kinds == 2 ? "[B] " : "", after);
    st = kvb_prefill_engine_gemm_ceiling(b->e, b->ceiling_reps, &b->c_med, &b->c_best, err);
    if (st == KVB_ERR_UNSUPPORTED) st = KVB_OK; /* a host engine: its read bandwidth instead */
    if (st) return st;
    kvb_prefill_stats ps;
    kvb_prefill_engine_stats(b->e, &ps);
    b->host_threads = ps.host_threads;
    kvb_pool *pool = kvb_prefill_engine_pool(b->e);
    if (pool) b->read_bw = kvb_measure_read_bw(pool, (size_t)1 << 30, 3);
    for (int si = 0; si < b->n_sizes; si++)
        b->peer[si] = b->peer_root ? peer_tok_s(b->peer_root, b->sizes[si])
                      : b->llama_bench ? run_llama_bench(b->llama_bench, b->model_path, b->host_threads,
                                                         (int)b->sizes[si], 0, b->reps)
                                       : -1;
    return KVB_OK;
}

/* The ceiling (or bandwidth), flops and peer lines, then per kind the table of sizes; the JSON's
 * results. */
static void prefill_print_table(const prefill_bench *b, cJSON *arr) {
    if (b->c_med > 0)
        printf("ceiling    bf16 GEMM 8192x8192x8192, cuBLAS, this run: %.1f TFLOP/s (median of %d; best %.1f)\n",
               b->c_med, b->ceiling_reps, b->c_best);
    if (b->read_bw > 0)
        printf("bandwidth  %.1f GB/s measured read bandwidth (same run, %d threads)\n", b->read_bw, b->host_threads);
    const kvb_model_desc *d = &b->m->d;
    printf("flops      2 x %.3g params (non-embedding, no output head%s) x n + 2 x %u layers x %u heads x %g x n^2\n",
           (double)kvb_model_n_params_active(d) - (double)d->n_vocab * d->n_embd,
           d->n_expert ? ", the routed experts only" : "", d->n_layer, d->n_head, attn_head_dim(d));
    if (b->peer_root) {
        const cJSON *pn = cJSON_GetObjectItem(b->peer_root, "peer");
        printf("peer       %s\n", cJSON_IsString(pn) ? pn->valuestring : b->peer_json);
    } else if (b->llama_bench)
        printf("peer       llama.cpp llama-bench pp at %s (same file, %d threads)\n", b->llama_bench, b->host_threads);
    for (int ai = 0; ai < b->n_kinds; ai++) {
        if (b->n_kinds == 2) printf("%s %s\n", ai ? "[B]" : "[A]", ai ? "cuDNN fused attention" : "own attention kernel");
        printf("%8s %12s %10s %9s %12s %8s   %s\n", "tokens", "tok/s", "TFLOP/s", "%ceiling", "peer tok/s", "vs peer",
               "runs (tok/s)");
        for (int si = 0; si < b->n_sizes; si++) {
            double runs[100];
            memcpy(runs, b->tps + ((size_t)ai * b->n_sizes + si) * b->reps, sizeof(double) * (size_t)b->reps);
            const double med = kvb_median_sort(runs, b->reps), pt = b->peer[si];
            const double tf = prefill_flops(d, (double)b->sizes[si]) / ((double)b->sizes[si] / med) / 1e12;
            char cs[32] = "-", ps[32] = "-", pr[32] = "-";
            if (b->c_med > 0) snprintf(cs, sizeof cs, "%.1f%%", 100.0 * tf / b->c_med);
            if (pt > 0) snprintf(ps, sizeof ps, "%.0f", pt), snprintf(pr, sizeof pr, "%.2fx", med / pt);
            printf("%8lld %12.0f %10.*f %9s %12s %8s  ", b->sizes[si], med, tf < 1 ? 4 : 1, tf, cs, ps, pr);
            for (int r = 0; r < b->reps; r++) printf(" %.0f", runs[r]);
            printf("\n");
            cJSON *it = cJSON_CreateObject();
            cJSON_AddNumberToObject(it, "tokens", (double)b->sizes[si]);
            cJSON_AddNumberToObject(it, "tok_s", med);
            cJSON_AddNumberToObject(it, "tflops", tf);
            cJSON_AddNumberToObject(it, "ceiling_fraction", b->c_med > 0 ? tf / b->c_med : 0);
            cJSON_AddNumberToObject(it, "peer_tok_s", pt);
            cJSON_AddStringToObject(it, "attention", b->adesc[ai]);
            cJSON *ra = cJSON_AddArrayToObject(it, "runs_tok_s");
            for (int r = 0; r < b->reps; r++) cJSON_AddItemToArray(ra, cJSON_CreateNumber(runs[r]));
            cJSON_AddItemToArray(arr, it);
        }
    }
}

/* --host-overhead, --attention both and --bridge: their tables. */
static void prefill_print_extras(const prefill_bench *b) {
    const int R = b->reps, S = b->n_sizes;
    double ra[100], rb[100];
    if (b->host_overhead) {
        printf("host overhead: the GPU's time for a forward enqueued behind a gate and run back to back, vs the\n"
               "median wall time; the difference is time the GPU waited for the host (launch gaps, host work)\n");
        printf("%8s %6s %12s %12s %10s\n", "tokens", "attn", "wall s", "GPU s", "host share");
        for (int ai = 0; ai < b->n_kinds; ai++)
            for (int si = 0; si < S; si++) {
                memcpy(ra, b->tps + ((size_t)ai * S + si) * R, sizeof(double) * (size_t)R);
                const double wall = (double)b->sizes[si] / kvb_median_sort(ra, R);
                const kvb_prefill_attention k = b->kinds[ai];
                printf("%8lld %6s %12.4f %12.4f %9.1f%%\n", b->sizes[si],
                       k == KVB_PREFILL_ATTN_OWN ? "own" : k == KVB_PREFILL_ATTN_CUDNN ? "cudnn" : "auto", wall,
                       b->gated[ai][si], 100.0 * (1.0 - b->gated[ai][si] / wall));
            }
    }
    if (b->n_kinds == 2) {
        printf("side by side: cuDNN / own kernel, median tok/s\n");
        for (int si = 0; si < S; si++) {
            memcpy(ra, b->tps + (size_t)si * R, sizeof(double) * (size_t)R);
            memcpy(rb, b->tps + ((size_t)S + si) * R, sizeof(double) * (size_t)R);
            const double ma = kvb_median_sort(ra, R), mb = kvb_median_sort(rb, R);
            printf("%8lld %12.0f %12.0f %8.2fx\n", b->sizes[si], ma, mb, mb / ma);
        }
    }
    if (!b->bridge_dtype) return;
    printf("bridge     decoder-mode bridge (this file's K/V weights, %s, cache %s) hooked after every\n"
           "           (chunk, layer); its rows cut into slabs, nothing sent; cost = bridged time / plain time - 1\n",
           kvb_type_name(b->m->layers[0].wk.type), kvb_type_name(b->bridge_dtype));
    printf("%8s %12s %14s %10s\n", "tokens", "plain tok/s", "bridged tok/s", "cost");
    for (int si = 0; si < S; si++) { /* (kind A's figures when two kinds ran) */
        memcpy(ra, b->tps + (size_t)si * R, sizeof(double) * (size_t)R);
        memcpy(rb, b->tps_bridged + (size_t)si * R, sizeof(double) * (size_t)R);
        const double mp = kvb_median_sort(ra, R), mb = kvb_median_sort(rb, R);
        printf("%8lld %12.0f %14.0f %9.1f%%\n", b->sizes[si], mp, mb, 100.0 * (mp / mb - 1.0));
    }
}

/* The device's memory line, and the JSON file with --json. */
static void prefill_print_memory(prefill_bench *b, cJSON *out) {
    kvb_prefill_stats ps;
    kvb_prefill_engine_stats(b->e, &ps);
    const double G = 1073741824.0;
    if (ps.dev_total_bytes)
        printf("memory     GPU in use at most %.2f GiB of %.1f (weights %.2f, KV cache %.2f, activations+tables %.2f)\n",
               ps.dev_peak_used_bytes / G, ps.dev_total_bytes / G, ps.weight_bytes / G, ps.kv_bytes / G,
               ps.act_bytes / G);
    cJSON_AddStringToObject(out, "bench", "prefill");
    cJSON_AddStringToObject(out, "engine", kvb_prefill_engine_name(b->e));
    cJSON_AddNumberToObject(out, "ceiling_tflops", b->c_med);
    cJSON_AddNumberToObject(out, "ceiling_tflops_best", b->c_best);
    cJSON_AddNumberToObject(out, "read_bw_gbs", b->read_bw);
    cJSON_AddNumberToObject(out, "threads", b->host_threads);
    cJSON_AddNumberToObject(out, "peak_gpu_bytes", (double)ps.dev_peak_used_bytes);
    cJSON_AddStringToObject(out, "model", b->model_path);
    if (!b->json_path) return;
    char *txt = cJSON_PrintUnformatted(out);
    FILE *f = fopen(b->json_path, "w");
    if (f && txt) fprintf(f, "%s\n", txt);
    if (f) fclose(f);
    free(txt);
}

/* `bench prefill` on the engine the options name: every size (and attention kind) timed, then the
 * tables. Returns the exit code. */
static int bench_prefill(prefill_bench *b, const char *tokens_arg, int attention) {
    if (!prefill_parse(b, tokens_arg, attention)) return 2;
    if (b->peer_json && !(b->peer_root = read_json(b->peer_json)))
        fprintf(stderr, "kvbridge bench: could not read peer figures from %s; continuing without them\n", b->peer_json);
    kvb_err err = {0};
    cJSON *out = cJSON_CreateObject();
    kvb_status st = out ? prefill_setup(b, &err) : kvb_err_set(&err, KVB_ERR_NOMEM, "out of memory");
    if (!st) st = prefill_measure(b, &err);
    if (!st) {
        prefill_print_table(b, cJSON_AddArrayToObject(out, "results"));
        prefill_print_extras(b);
        prefill_print_memory(b, out);
    } else fprintf(stderr, "kvbridge bench: %s\n", err.msg);
    cJSON_Delete(out);
    cJSON_Delete(b->peer_root);
    free(b->toks);
    free(b->logits);
    free(b->tps);
    free(b->tps_bridged);
    kvb_prefill_engine_free(b->e);
    kvb_bridge_cpu_free(b->cutter);
    kvb_model_free(b->m);
    return st ? 1 : 0;
}


/* What the command line asks of `bench prefill|decode`. */
typedef struct {
    const char *model_path, *llama_bench, *json_path, *tokens_arg, *peer_json;
    long long threads, n_gen, n_ctx, reps, chunk, ceiling_reps, warmup, batch;
    int device;    /* kvb_cli_device_names */
    int attention; /* k_bench_attention */
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
    "json -m MODEL [options]     (see kvbridge bench json --help)\n"
    "fleet [options]             (see kvbridge bench fleet --help)";

/* Fills *a from argv (argv[0]: prefill or decode); KVB_CLI_GO, or the code the command returns. */
static int bench_parse(bench_args *a, int argc, char **argv) {
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&a->model_path, "GGUF model", true),
        KVB_CLI_OPT_THREADS(&a->threads, "threads (default: all CPUs)"),
        {.long_name = "tokens", .kind = KVB_OPT_STRING, .dst = &a->tokens_arg, .meta = "N",
         .help = "prefill: comma-separated sizes, each timed (default 512; cuda: 2048)"},
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
         .help = "prefill: tokens per forward chunk (default: the engine's, 512 on cpu, 8192 on cuda)"},
        {.long_name = "peer-json", .kind = KVB_OPT_STRING, .dst = &a->peer_json, .meta = "FILE",
         .help = "prefill: a peer's figures, JSON from tools/peer/torch_llama_prefill.py"},
        {.long_name = "bridge", .kind = KVB_OPT_CUSTOM, .dst = &a->bridge_type, .meta = "T",
         .parse = kvb_opt_parse_type,
         .help = "prefill: also time every size with the engine's bridge hooked after each (chunk, layer) (on "
                 "cuda the bridge kernel), writing a decoder cache of dtype T from this file's K/V weights (use a "
                 "Q8_0/Q4_0 file: a CPU decoder's), and print its cost as a fraction of the prefill time (the rows "
                 "are cut into slabs; nothing is sent)"},
        {.long_name = "ceiling-reps", .kind = KVB_OPT_INT, .dst = &a->ceiling_reps, .meta = "N",
         .help = "(cuda) timed GEMMs for the ceiling", .def = "20", .lo = 1, .hi = 1000},
        {.long_name = "warmup", .kind = KVB_OPT_INT, .dst = &a->warmup, .meta = "N", .def = "2", .lo = 0, .hi = 100,
         .help = "prefill: untimed forwards before each size's timed ones (cuda: the first runs a new shape on the "
                 "engine's kernel, the second builds cuDNN's plans)"},
        {.long_name = "attention", .kind = KVB_OPT_ENUM, .dst = &a->attention, .meta = "A", .def = "auto",
         .choices = k_bench_attention,
         .help = "(cuda) attention on global layers: own (the engine's flash kernel), cudnn (cuDNN's fused "
                 "attention, libcudnn.so.9 on LD_LIBRARY_PATH), both (each size with each, side by side, and "
                 "their ratio) or auto (cuDNN when it loads; KVB_CUDA_ATTENTION=own|cudnn sets the default "
                 "everywhere). cuDNN builds a plan (40-100 ms) for a new shape only when it pays; other "
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
        .about = "Measures an engine and prints tok/s beside what bounds it, measured in the same run.\n"
                 "  prefill   on --device's engine: batches of --tokens random tokens from an empty cache (like\n"
                 "            llama-bench pp), beside a GPU's GEMM ceiling or the host's read bandwidth\n"
                 "  decode    on the CPU engine: --gen single-token steps after a --ctx-token prompt (like\n"
                 "            llama-bench tg), beside the memory bandwidth\n"
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
    {"json", kvb_bench_json},     {"fleet", kvb_bench_fleet},
};

/* The batch's line and the bytes a step of B sequences reads: the weights once (of a mixture of
 * experts the expected union of the experts its B tokens route to), B embedding rows, B caches. */
static void decode_batch_report(const bench_args *a, const kvb_model *m, double kv_avg, double tps, double batch_tps,
                                double bw, cJSON *j) {
    const uint32_t B = (uint32_t)a->batch;
    const double x = expected_experts(&m->d, B), w = weight_bytes_per_step(m, B, x), step = w + B * kv_avg;
    const double achieved = step * batch_tps / B / 1e9;
    printf("batch      %u sequences stepped together: %.2f tok/s in all, %.2f per sequence = %.2fx one "
           "sequence's %.2f tok/s\n",
           B, batch_tps, batch_tps / B, batch_tps / tps, tps);
    if (m->d.n_expert)
        printf("batch read a step reads %.1f MB (weights %.1f MB: expected %.2f of %u experts per layer, the union of "
               "%u tokens' top-%u under uniform routing, E(1-(1-k/E)^B); + KV %.2f MB) = %.1f MB per token\n",
               step / 1e6, w / 1e6, x, m->d.n_expert, B, m->d.n_expert_used, B * kv_avg / 1e6, step / B / 1e6);
    else
        printf("batch read a step reads %.1f MB (weights %.1f MB once + KV %.2f MB) = %.1f MB per token\n", step / 1e6,
               w / 1e6, B * kv_avg / 1e6, step / B / 1e6);
    printf("batch bw   %.1f GB/s achieved = %.0f%% of %.1f GB/s measured read bandwidth\n", achieved,
           100.0 * achieved / bw, bw);
    cJSON_AddNumberToObject(j, "batch", B);
    cJSON_AddNumberToObject(j, "batch_tok_s", batch_tps);
    cJSON_AddNumberToObject(j, "batch_step_weight_bytes", w);
    cJSON_AddNumberToObject(j, "batch_experts_per_layer", x);
}

/* `bench decode` on the CPU engine: the figures beside the median tok/s (bytes per token, bandwidth,
 * the batch, the peer), and --json. */
static void decode_report(const bench_args *a, const kvb_model *m, int T, double tps, double batch_tps, double bw,
                          double peer) {
    const double wbytes = weight_bytes_per_step(m, 1, expected_experts(&m->d, 1));
    uint64_t tok_bytes, per_head; /* the cache format's bytes per token (a latent row for an MLA model) */
    kvb_model_cache_token_bytes(&m->d, a->cache_type, &tok_bytes, &per_head);
    const double kv_avg = (double)tok_bytes * (a->n_ctx + a->n_gen / 2.0);
    const double bytes = wbytes + kv_avg, achieved = bytes * tps / 1e9;
    cJSON *j = cJSON_CreateObject(); /* --json: these, the batch's figures, the peer's */
    cJSON_AddStringToObject(j, "bench", "decode");
    cJSON_AddStringToObject(j, "model", a->model_path);
    cJSON_AddNumberToObject(j, "threads", T);
    cJSON_AddNumberToObject(j, "tok_s", tps);
    cJSON_AddNumberToObject(j, "read_bw_gbs", bw);
    cJSON_AddNumberToObject(j, "weight_bytes", wbytes);
    cJSON_AddNumberToObject(j, "experts_per_layer", expected_experts(&m->d, 1));
    printf("decode     %lld steps after %lld tokens: %.2f tok/s (median of %lld)\n", a->n_gen, a->n_ctx, tps, a->reps);
    printf("bytes/tok  %.1f MB (weights %.1f MB%s + KV %.2f MB)\n", bytes / 1e6, wbytes / 1e6,
           m->d.n_ff_shexp ? ", active: the routed and the shared experts"
           : m->d.n_expert ? ", active: the routed experts only"
                           : "",
           kv_avg / 1e6);
    printf("bandwidth  %.1f GB/s achieved = %.0f%% of %.1f GB/s measured read bandwidth (same run, %d threads)\n",
           achieved, 100.0 * achieved / bw, bw, T);
    if (a->batch > 1) decode_batch_report(a, m, kv_avg, tps, batch_tps, bw, j);
    if (a->llama_bench) {
        if (peer > 0)
            printf("peer       llama.cpp llama-bench tg: %.2f tok/s -> kvbridge/llama.cpp = %.2fx\n", peer, tps / peer);
        else printf("peer       llama-bench at %s did not produce a result\n", a->llama_bench);
    }
    FILE *f = a->json_path ? fopen(a->json_path, "w") : NULL;
    if (f) {
        cJSON_AddNumberToObject(j, "peer_tok_s", peer);
        char *txt = cJSON_PrintUnformatted(j);
        if (txt) fprintf(f, "%s\n", txt);
        free(txt);
        fclose(f);
    }
    cJSON_Delete(j);
}

/* `bench decode`: --gen single-token steps on the CPU engine after a --ctx prompt (like llama-bench
 * tg), after one untimed step that pages the weights in. Returns the exit code. */
static int bench_decode(const bench_args *a) {
    kvb_err err = {0};
    kvb_model *m = NULL;
    kvb_engine *e = NULL;
    kvb_pool *pool = NULL;
    const uint32_t n_ctx = (uint32_t)a->n_ctx, n_gen = (uint32_t)a->n_gen, need = n_ctx + n_gen;
    const uint32_t bt_default = 32; /* the engine's default block size */
    int32_t *toks = malloc(sizeof(int32_t) * need);
    double times[100];
    kvb_status st = toks ? kvb_model_load(a->model_path, &m, &err) : kvb_err_set(&err, KVB_ERR_NOMEM, "out of memory");
    float *logits = st ? NULL : malloc(sizeof(float) * m->d.n_vocab);
    if (!st && !logits) st = kvb_err_set(&err, KVB_ERR_NOMEM, "out of memory");
    kvb_engine_opts eo = {.n_threads = (int)a->threads, .cache_dtype = a->cache_type, .max_ctx = need + 1,
                          .n_blocks = (uint32_t)(a->batch + 1) * ((need + 1) / bt_default + 2)};
    if (!st) st = kvb_engine_create(m, &eo, &e, &err);
    const int T = st ? 0 : kvb_engine_threads(e);
    if (!st) {
        kvb_rng rng;
        kvb_rng_seed(&rng, 42);
        for (uint32_t i = 0; i < need; i++) toks[i] = (int32_t)(kvb_rng_u64(&rng) % m->d.n_vocab);
        char desc[256];
        kvb_model_describe(m, desc, sizeof desc);
        printf("model      %s\n           %s\n", a->model_path, desc);
        printf("machine    %d threads, %s kernels, KV cache %s\n", T, kvb_simd_name(), kvb_type_name(a->cache_type));
    }
    for (int r = -1; !st && r < (int)a->reps; r++) { /* r < 0: the warm-up, one step */
        kvb_seq *s = NULL;
        st = kvb_seq_create(e, &s, &err);
        if (!st) st = kvb_engine_forward(e, s, toks, r < 0 ? 1 : n_ctx, logits, false, &err);
        const double t0 = kvb_now_s();
        for (uint32_t g = 0; r >= 0 && g < n_gen && !st; g++)
            st = kvb_engine_forward(e, s, &toks[n_ctx + g], 1, logits, false, &err);
        const double t1 = kvb_now_s();
        kvb_seq_free(s);
        if (st || r < 0) continue;
        times[r] = n_gen / (t1 - t0);
        fprintf(stderr, "bench decode: run %d/%lld: %.2f tok/s\n", r + 1, a->reps, times[r]);
    }
    double tps = 0, batch_tps = 0;
    if (!st) {
        printf("runs      ");
        for (int r = 0; r < a->reps; r++) printf(" %.2f", times[r]);
        printf(" tok/s\n");
        tps = kvb_median_sort(times, (int)a->reps);
    }
    if (!st && a->batch > 1)
        st = bench_decode_batch(e, m->d.n_vocab, toks, n_ctx, n_gen, (uint32_t)a->batch, (int)a->reps, &batch_tps, &err);
    if (!st) st = kvb_pool_create(T, &pool, &err);
    if (!st) {
        const double bw = kvb_measure_read_bw(pool, (size_t)1 << 30, 3);
        const double peer = a->llama_bench ? run_llama_bench(a->llama_bench, a->model_path, T, 0, (int)n_gen, (int)a->reps)
                                           : -1;
        decode_report(a, m, T, tps, batch_tps, bw, peer);
    } else fprintf(stderr, "kvbridge bench: %s\n", err.msg);
    kvb_pool_destroy(pool);
    free(toks);
    free(logits);
    kvb_engine_free(e);
    kvb_model_free(m);
    return st ? 1 : 0;
}

int kvb_cmd_bench(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "kvbridge bench: name a benchmark: prefill, decode, ladder, link, quality, slab, tokenize, "
                        "parallel, json or fleet (see kvbridge bench --help)\n");
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
        fprintf(stderr, "kvbridge bench: unknown benchmark '%s' (prefill, decode, ladder, link, slab, tokenize, parallel, json, fleet or quality; see kvbridge bench --help)\n", what);
        return 2;
    }
    bench_args a = {0};
    int prc = bench_parse(&a, argc - 1, argv + 1);
    if (prc != KVB_CLI_GO) return prc;
    const bool cuda = a.device == 1;
    if (prefill) { /* one path for every engine */
        prefill_bench b = {.model_path = a.model_path, .peer_json = a.peer_json, .json_path = a.json_path,
                           .llama_bench = a.llama_bench, .device = cuda ? "cuda" : "cpu", .reps = (int)a.reps,
                           .warmup = (int)a.warmup, .ceiling_reps = (int)a.ceiling_reps,
                           .host_overhead = a.host_overhead, .bridge_dtype = a.bridge_type,
                           .eo = {.device = cuda ? KVB_DEVICE_CUDA : KVB_DEVICE_CPU, .n_threads = (int)a.threads,
                                  .cache_dtype = a.cache_type, .max_batch = (uint32_t)a.chunk, .gpus = (int)a.gpu.gpus,
                                  .tp_one_device = a.gpu.tp_one_device,
                                  .weights = (kvb_prefill_weights)a.gpu.gpu_weights}};
        return bench_prefill(&b, a.tokens_arg ? a.tokens_arg : cuda ? "2048" : "512", a.attention);
    }
    if (cuda) {
        fprintf(stderr, "kvbridge bench: --device cuda supports 'prefill' only for now\n");
        return 2;
    }
    return bench_decode(&a);
}
