/* cli/cmd_run.c — `kvbridge run`: load a GGUF, prefill a prompt (token ids or text), generate
 * N tokens with the chosen sampler, and print text (streamed) or token ids. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_engine_cpu.h"
#include "kvb_prefill_engine.h"
_Static_assert(KVB_CLI_MAX_GPUS == KVB_PREFILL_MAX_GPUS, "the CLI's --gpus limit is the engine's");
_Static_assert(KVB_PREFILL_WEIGHTS_AUTO == 0 && KVB_PREFILL_WEIGHTS_BF16 == 1 && KVB_PREFILL_WEIGHTS_PACKED == 2,
               "kvb_arg_gpu_weights numbers --gpu-weights in kvb_prefill_weights' order");
#include "kvb_quant.h"
#include "kvb_tokenizer.h"

/* The engine a run uses (the CPU's, or with --device cuda the GPU's) and its one sequence. */
typedef struct {
    kvb_prefill_engine *e;
    kvb_prefill_seq *s;
} run_engine;

static kvb_status re_forward(run_engine *r, const int32_t *t, uint32_t n, float *logits, kvb_err *err) {
    return kvb_prefill_forward(r->e, r->s, t, n, logits, false, err);
}

static void re_free(run_engine *r) {
    kvb_prefill_seq_free(r->s);
    kvb_prefill_engine_free(r->e);
}

/* Parses "1,2,3" into a malloc'd array. */
static bool parse_ids(const char *s, int32_t **out, uint32_t *n) {
    size_t cap = 16, k = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) return false;
    const char *p = s;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v > INT32_MAX) {
            free(ids);
            return false;
        }
        if (k == cap) {
            int32_t *ni = realloc(ids, (cap *= 2) * sizeof *ids);
            if (!ni) {
                free(ids);
                return false;
            }
            ids = ni;
        }
        ids[k++] = (int32_t)v;
        p = end;
        if (*p == ',' || *p == ' ') p++;
        else if (*p) {
            free(ids);
            return false;
        }
    }
    *out = ids;
    *n = (uint32_t)k;
    return k > 0;
}

/* What the command line asks of a run. */
typedef struct {
    const char *model_path, *tokens_arg, *prompt, *tmpl_name, *logits_out;
    long long n_gen, threads, ctx;
    int device, output; /* kvb_cli_device_names, k_outputs */
    kvb_cli_gpu gpu;
    bool ignore_eos, verbose, chat, logits_all;
    uint64_t seed;
    double temp, top_p;
    long long top_k;
    uint32_t cache_type;
} run_args;

static const char *const k_outputs[] = {"text", "ids", NULL};

/* Fills *a from argv; KVB_CLI_GO, or the code the command returns. */
static int run_parse(run_args *a, int argc, char **argv) {
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&a->model_path,
                          "GGUF model (llama, qwen2, qwen3, gemma3, qwen3moe, qwen2moe, deepseek2; F32/F16/BF16/Q8_0/"
                          "Q4_0/Q5_0/Q4_K/Q5_K/Q6_K)", true),
        {.long_name = "tokens", .kind = KVB_OPT_STRING, .dst = &a->tokens_arg, .meta = "LIST",
         .help = "prompt as comma-separated token ids"},
        {.long_name = "prompt", .short_name = 'p', .kind = KVB_OPT_STRING, .dst = &a->prompt, .meta = "TEXT",
         .help = "prompt as text (tokenized with the model's own vocabulary)"},
        {.long_name = "chat", .kind = KVB_OPT_FLAG, .dst = &a->chat,
         .help = "wrap -p TEXT as a user message in the model's chat template"},
        {.long_name = "chat-template", .kind = KVB_OPT_STRING, .dst = &a->tmpl_name, .meta = "NAME",
         .help = "override the template family (llama2, llama3, chatml, mistral, phi3, gemma); implies --chat"},
        {.short_name = 'n', .kind = KVB_OPT_INT, .dst = &a->n_gen, .meta = "N", .help = "tokens to generate",
         .def = "32", .lo = 0, .hi = 1 << 24},
        {.long_name = "seed", .kind = KVB_OPT_UINT, .dst = &a->seed, .meta = "S",
         .help = "sampler seed (0: runs repeat exactly)", .def = "0"},
        {.long_name = "temp", .kind = KVB_OPT_DOUBLE, .dst = &a->temp, .meta = "T",
         .help = "temperature (0 = greedy)", .def = "0.8", .dlo = 0, .dhi = 100},
        {.long_name = "top-k", .kind = KVB_OPT_INT, .dst = &a->top_k, .meta = "K",
         .help = "keep the K most likely tokens (0 = off)", .def = "40", .lo = 0, .hi = 1 << 24},
        {.long_name = "top-p", .kind = KVB_OPT_DOUBLE, .dst = &a->top_p, .meta = "P",
         .help = "nucleus sampling threshold (1 = off)", .def = "0.95", .dlo = 0, .dhi = 1},
        KVB_CLI_OPT_THREADS(&a->threads, "CPU threads (default: all)"),
        KVB_CLI_OPT_DEVICE(&a->device, "where the model runs (cuda: bf16 weights and KV cache)"),
        KVB_CLI_OPTS_GPU(&a->gpu),
        KVB_CLI_OPT_CACHE_TYPE(&a->cache_type, "KV cache dtype: f16, f32, bf16, q8_0"),
        {.long_name = "ctx", .kind = KVB_OPT_INT, .dst = &a->ctx, .meta = "N", .lo = 1, .hi = 1 << 24,
         .help = "context limit in tokens (default: min(training context, 8192))"},
        {.long_name = "ignore-eos", .kind = KVB_OPT_FLAG, .dst = &a->ignore_eos,
         .help = "keep generating past end-of-generation tokens"},
        {.long_name = "output", .kind = KVB_OPT_ENUM, .dst = &a->output, .def = "text", .choices = k_outputs,
         .help = "print decoded text or the generated ids on one line"},
        {.long_name = "verbose", .short_name = 'v', .kind = KVB_OPT_FLAG, .dst = &a->verbose,
         .help = "print timings to stderr"},
        {.long_name = "logits-out", .kind = KVB_OPT_STRING, .dst = &a->logits_out, .meta = "FILE",
         .help = "write the last prompt token's logits (n_vocab little-endian f32) to FILE, for comparison with "
                 "another implementation"},
        {.long_name = "logits-all", .kind = KVB_OPT_FLAG, .dst = &a->logits_all,
         .help = "with --logits-out: write every prompt position's logits ((n_prompt, n_vocab) little-endian f32, "
                 "one forward with all logits), as llama.cpp's logits_all gives them"},
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "run", .usage = "-m MODEL (--tokens 1,2,3 | -p TEXT) [-n N] [options]", .opts = opts,
        .about = "Runs the model on this machine's CPU (or GPU with --device cuda): prefills the prompt, then "
                 "generates N tokens."};
    int rc = kvb_cli_parse(&spec, argc, argv);
    if (rc != KVB_CLI_GO) return rc;
    a->chat = a->chat || a->tmpl_name;
    if (!a->tokens_arg == !a->prompt) return kvb_cli_usage_error(&spec, "give exactly one of --tokens or -p");
    if (a->logits_all && !a->logits_out) return kvb_cli_usage_error(&spec, "--logits-all needs --logits-out FILE");
    const bool cuda = a->device == 1;
    char why[256];
    if (cuda && !kvb_prefill_device_available(KVB_DEVICE_CUDA, why, sizeof why)) {
        fprintf(stderr, "kvbridge run: --device cuda: %s\n", why);
        return 2;
    }
    return kvb_cli_gpu_ok("run", &a->gpu, cuda) ? KVB_CLI_GO : 2;
}

/* --logits-out FILE: n_rows rows of n_vocab logits, little-endian f32 (the last prompt token's, or
 * with --logits-all every prompt position's). */
static kvb_status write_logits(const char *path, const float *logits, size_t n_rows, uint32_t n_vocab,
                               kvb_err *err) {
    FILE *lf = fopen(path, "wb");
    const size_t n = n_rows * n_vocab;
    bool ok = lf && fwrite(logits, sizeof(float), n, lf) == n;
    if (lf && fclose(lf) != 0) ok = false;
    return ok ? KVB_OK : kvb_err_set(err, KVB_ERR_IO, "cannot write the logits to %s", path);
}

/* The chat family for --chat: --chat-template NAME, else detected from the model's own template. */
static kvb_status run_chat_family(const char *tmpl_name, const kvb_model *m, const char *model_path,
                                  kvb_chat_family *fam, kvb_err *err) {
    if (tmpl_name) return kvb_chat_family_from_name(tmpl_name, fam, err);
    const kvb_gguf_kv *kv = kvb_gguf_find(m->gguf, "tokenizer.chat_template");
    if (!kv || kv->type != KVB_GGUF_STRING)
        return kvb_err_set(err, KVB_ERR_NOT_FOUND, "%s has no tokenizer.chat_template; pass --chat-template NAME",
                           model_path);
    char *tmpl = strndup(kv->str.ptr, kv->str.len);
    kvb_status st = tmpl ? kvb_chat_family_detect(tmpl, fam, err) : kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    free(tmpl);
    return st;
}

/* The prompt's token ids (*ids malloc'd, *n_ids >= 1): --tokens parsed, or -p TEXT tokenized
 * (wrapped as a user message in the chat template with --chat). *usage_error is set when the
 * command line is at fault (a bad --tokens list, a prompt that tokenizes to nothing). */
static kvb_status run_prompt_ids(const run_args *a, const kvb_model *m, const kvb_tokenizer *tok, int32_t **ids,
                                 uint32_t *n_ids, bool *usage_error, kvb_err *err) {
    if (a->tokens_arg) {
        *usage_error = !parse_ids(a->tokens_arg, ids, n_ids);
        return *usage_error ? kvb_err_set(err, KVB_ERR_INVALID, "--tokens expects comma-separated token ids, got '%s'",
                                          a->tokens_arg)
                            : KVB_OK;
    }
    char *rendered = NULL;
    if (a->chat) {
        kvb_chat_family fam;
        if (run_chat_family(a->tmpl_name, m, a->model_path, &fam, err) != KVB_OK) return err->code;
        kvb_chat_msg msg = {"user", a->prompt};
        if (kvb_chat_render(fam, &msg, 1, true, &rendered, err) != KVB_OK) return err->code;
    }
    const char *text = rendered ? rendered : a->prompt;
    size_t nt = 0;
    kvb_status st = kvb_tokenize(tok, text, strlen(text), true, a->chat, ids, &nt, err);
    free(rendered);
    if (st) return st;
    *n_ids = (uint32_t)nt;
    if (nt == 0) {
        *usage_error = true;
        return kvb_err_set(err, KVB_ERR_INVALID, "the prompt tokenized to nothing; give a non-empty prompt");
    }
    return KVB_OK;
}

/* The context limit: --ctx, else min(training context, 8192) raised to what the run needs when the
 * model allows it. False after saying that the prompt and -n do not fit. */
static bool run_max_ctx(const run_args *a, const kvb_model *m, uint32_t n_ids, uint32_t *max_ctx) {
    if (a->ctx) *max_ctx = (uint32_t)a->ctx;
    else {
        uint32_t need = n_ids + (uint32_t)a->n_gen;
        *max_ctx = m->d.n_ctx_train < 8192 ? m->d.n_ctx_train : 8192;
        if (need > *max_ctx && need <= m->d.n_ctx_train) *max_ctx = need;
    }
    if ((uint64_t)n_ids + (uint64_t)a->n_gen <= *max_ctx) return true;
    fprintf(stderr,
            "kvbridge run: prompt (%u tokens) + %lld generated tokens exceed the context limit of %u tokens; "
            "shorten the prompt, lower -n or raise --ctx\n",
            n_ids, a->n_gen, *max_ctx);
    return false;
}

/* Prefills ids[0..n) into logits (n_vocab: the last token's) and writes --logits-out: the last
 * row, or with --logits-all every row of one forward that returns them all. */
static kvb_status run_prefill(run_engine *re, const run_args *a, const int32_t *ids, uint32_t n, uint32_t n_vocab,
                              float *logits, kvb_err *err) {
    if (!a->logits_all) {
        if (re_forward(re, ids, n, logits, err) != KVB_OK) return err->code;
        return a->logits_out ? write_logits(a->logits_out, logits, 1, n_vocab, err) : KVB_OK;
    }
    float *all = malloc(sizeof(float) * (size_t)n * n_vocab); // (position, vocab)
    if (!all) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for %u x %u logits", n, n_vocab);
    kvb_status st = kvb_prefill_forward(re->e, re->s, ids, n, all, true, err);
    if (st == KVB_OK) st = write_logits(a->logits_out, all, n, n_vocab, err);
    if (st == KVB_OK) memcpy(logits, all + (size_t)(n - 1) * n_vocab, sizeof(float) * n_vocab);
    free(all);
    return st;
}

/* Samples up to -n tokens from logits (the prompt's last), a forward per token, into out_ids
 * (*n_out of them), streaming the text unless --output ids, stopping at end-of-generation unless
 * --ignore-eos; then prints the ids, or the text's last piece. */
static kvb_status run_decode(run_engine *re, kvb_sampler *smp, const kvb_tokenizer *tok, const run_args *a,
                             float *logits, int32_t *out_ids, uint32_t *n_out, kvb_err *err) {
    const bool ids_out = a->output == 1;
    kvb_detok dt;
    if (tok) kvb_detok_init(&dt, tok);
    char piece[512];
    for (long long i = 0; i < a->n_gen; i++) {
        int32_t id = kvb_sample(smp, logits);
        out_ids[(*n_out)++] = id;
        if (!ids_out) {
            size_t k = kvb_detok_push(&dt, id, piece, sizeof piece);
            fwrite(piece, 1, k, stdout);
            fflush(stdout);
        }
        if (!a->ignore_eos && tok && kvb_tokenizer_is_eog(tok, id)) break;
        if (i + 1 < a->n_gen && re_forward(re, &id, 1, logits, err) != KVB_OK) return err->code;
    }
    if (ids_out) {
        for (uint32_t i = 0; i < *n_out; i++) printf(i ? " %d" : "%d", out_ids[i]);
        printf("\n");
    } else {
        size_t k = kvb_detok_flush(&dt, piece, sizeof piece);
        fwrite(piece, 1, k, stdout);
        printf("\n");
    }
    return KVB_OK;
}

int kvb_cmd_run(int argc, char **argv) {
    run_args a = {0};
    int prc = run_parse(&a, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    const char *model_path = a.model_path;
    const long long n_gen = a.n_gen, threads = a.threads, gpus = a.gpu.gpus;
    const int gpu_weights = a.gpu.gpu_weights;
    const bool ids_out = a.output == 1, verbose = a.verbose, cuda = a.device == 1,
               tp_one_device = a.gpu.tp_one_device;
    const kvb_sampler_opts so = {.temperature = (float)a.temp, .top_k = (int)a.top_k, .top_p = (float)a.top_p,
                                 .seed = a.seed};
    const uint32_t cache_type = a.cache_type;

    int rc = 1;
    kvb_err err = {0};
    kvb_model *m = NULL;
    run_engine re = {0};
    kvb_tokenizer *tok = NULL;
    int32_t *ids = NULL, *out_ids = NULL;
    float *logits = NULL;
    uint32_t n_ids = 0;
    kvb_sampler smp = {0};

    if (kvb_model_load(model_path, &m, &err) != KVB_OK) goto fail;
    if (a.prompt || !ids_out) {
        if (kvb_tokenizer_load(m->gguf, &tok, &err) != KVB_OK) goto fail;
    }
    bool usage_error = false;
    if (run_prompt_ids(&a, m, tok, &ids, &n_ids, &usage_error, &err) != KVB_OK) {
        if (!usage_error) goto fail;
        fprintf(stderr, "kvbridge run: %s\n", err.msg);
        rc = 2;
        goto done;
    }

    kvb_prefill_opts eo = {.device = cuda ? KVB_DEVICE_CUDA : KVB_DEVICE_CPU, .n_threads = (int)threads,
                           .cache_dtype = cache_type, .gpus = (int)gpus, .tp_one_device = tp_one_device,
                           .weights = (kvb_prefill_weights)gpu_weights};
    if (!run_max_ctx(&a, m, n_ids, &eo.max_ctx)) {
        rc = 2;
        goto done;
    }
    if (kvb_prefill_engine_create(m, &eo, &re.e, &err) != KVB_OK) goto fail;
    if (kvb_prefill_seq_create(re.e, &re.s, &err) != KVB_OK) goto fail;
    if (kvb_sampler_init(&smp, &so, m->d.n_vocab, &err) != KVB_OK) goto fail;
    kvb_pool *pool = kvb_prefill_engine_pool(re.e); /* the CPU engine's, idle between the forwards */
    if (pool) kvb_sampler_use_pool(&smp, pool);
    logits = malloc(sizeof(float) * m->d.n_vocab);
    out_ids = malloc(sizeof(int32_t) * (size_t)(n_gen + 1));
    if (!logits || !out_ids) {
        kvb_err_set(&err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (verbose) {
        char desc[256], ed[512], ad[768];
        kvb_model_describe(m, desc, sizeof desc);
        kvb_prefill_engine_describe(re.e, ed, sizeof ed);
        kvb_prefill_engine_attention_describe(re.e, ad, sizeof ad);
        fprintf(stderr, "run: %s; %s engine: %s; attention: %s; prompt %u tokens\n", desc,
                kvb_prefill_engine_name(re.e), ed, ad, n_ids);
    }

    double t0 = kvb_now_s();
    if (run_prefill(&re, &a, ids, n_ids, m->d.n_vocab, logits, &err) != KVB_OK) goto fail;
    double t1 = kvb_now_s();
    uint32_t n_out = 0;
    if (run_decode(&re, &smp, tok, &a, logits, out_ids, &n_out, &err)) goto fail;
    double t2 = kvb_now_s();
    if (verbose)
        fprintf(stderr, "run: prefill %u tokens in %.3f s (%.1f tok/s); decode %u tokens in %.3f s (%.1f tok/s)\n",
                n_ids, t1 - t0, n_ids / (t1 - t0), n_out, t2 - t1, n_out > 1 ? (n_out - 1) / (t2 - t1) : 0.0);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "kvbridge run: %s\n", err.msg);
    rc = 1;
done:
    kvb_sampler_free(&smp);
    free(logits);
    free(out_ids);
    free(ids);
    re_free(&re);
    kvb_tokenizer_free(tok);
    kvb_model_free(m);
    return rc;
}
