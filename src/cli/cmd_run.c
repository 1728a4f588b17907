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

static void help(FILE *f) {
    fprintf(f,
            "usage: kvbridge run -m MODEL (--tokens 1,2,3 | -p TEXT) [-n N] [options]\n\n"
            "Runs the model on this machine's CPU (or GPU with --device cuda): prefills the prompt, then\n"
            "generates N tokens.\n\n"
            "  -m, --model FILE     GGUF model (llama, qwen2, qwen3, gemma3; F32/F16/BF16/Q8_0/Q4_0/Q5_0/Q4_K/Q5_K/Q6_K)\n"
            "  --tokens LIST        prompt as comma-separated token ids\n"
            "  -p, --prompt TEXT    prompt as text (tokenized with the model's own vocabulary)\n"
            "  --chat               wrap -p TEXT as a user message in the model's chat template\n"
            "  --chat-template NAME override the template family (llama2, llama3, chatml, mistral, phi3, gemma)\n"
            "  -n N                 tokens to generate (default 32)\n"
            "  --seed S             sampler seed (default 0: runs repeat exactly)\n"
            "  --temp T             temperature (default 0.8; 0 = greedy)\n"
            "  --top-k K            keep the K most likely tokens (default 40; 0 = off)\n"
            "  --top-p P            nucleus sampling threshold (default 0.95; 1 = off)\n"
            "  --threads T          CPU threads (default: all)\n"
            "  --device cpu|cuda    where the model runs (default cpu; cuda: bf16 weights and KV cache)\n"
            "  --gpus N             (cuda) tensor-parallel over GPUs 0..N-1 (NCCL all-reduce)\n"
            "  --tp-one-device      (cuda) with --gpus N: every rank on one GPU (tests the split)\n"
            KVB_CLI_GPU_WEIGHTS_HELP
            "  --cache-type T       KV cache dtype: f16 (default), f32, bf16, q8_0\n"
            "  --ctx N              context limit in tokens (default: min(training context, 8192))\n"
            "  --ignore-eos         keep generating past end-of-generation tokens\n"
            "  --output text|ids    print decoded text (default) or the generated ids on one line\n"
            "  --verbose            print timings to stderr\n"
            "  --logits-out FILE    write the last prompt token's logits (n_vocab little-endian f32) to FILE,\n"
            "                       for comparison with another implementation\n");
}

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

/* What `run` was asked (its options, parsed). */
typedef struct {
    const char *model_path, *tokens_arg, *prompt, *tmpl_name, *logits_out;
    long long n_gen, threads, ctx, gpus;
    int gpu_weights;
    bool ids_out, ignore_eos, verbose, chat, cuda, tp_one_device;
    kvb_sampler_opts so;
    uint32_t cache_type;
} run_opts;

/* The prompt's token ids: --tokens as given, or -p's text (rendered with the chat template under
 * --chat) tokenized. 0, or 2 (said) for a prompt that gives none, or 1 with err. */
static int prompt_ids(const run_opts *o, const kvb_model *m, kvb_tokenizer *tok, int32_t **ids, uint32_t *n_ids,
                      kvb_err *err) {
    if (o->tokens_arg) {
        if (parse_ids(o->tokens_arg, ids, n_ids)) return 0;
        fprintf(stderr, "kvbridge run: --tokens expects comma-separated token ids, got '%s'\n", o->tokens_arg);
        return 2;
    }
    const char *text = o->prompt;
    char *rendered = NULL;
    if (o->chat) {
        kvb_chat_family fam;
        if (o->tmpl_name) {
            if (kvb_chat_family_from_name(o->tmpl_name, &fam, err) != KVB_OK) return 1;
        } else {
            const kvb_gguf_kv *kv = kvb_gguf_find(m->gguf, "tokenizer.chat_template");
            if (!kv || kv->type != KVB_GGUF_STRING) {
                kvb_err_set(err, KVB_ERR_NOT_FOUND, "%s has no tokenizer.chat_template; pass --chat-template NAME",
                            o->model_path);
                return 1;
            }
            char *tmpl = strndup(kv->str.ptr, kv->str.len);
            kvb_status st = tmpl ? kvb_chat_family_detect(tmpl, &fam, err) : KVB_ERR_NOMEM;
            free(tmpl);
            if (st) return 1;
        }
        kvb_chat_msg msg = {"user", o->prompt};
        if (kvb_chat_render(fam, &msg, 1, true, &rendered, err) != KVB_OK) return 1;
        text = rendered;
    }
    size_t nt = 0;
    kvb_status st = kvb_tokenize(tok, text, strlen(text), true, o->chat, ids, &nt, err);
    free(rendered);
    if (st) return 1;
    *n_ids = (uint32_t)nt;
    if (nt) return 0;
    fprintf(stderr, "kvbridge run: the prompt tokenized to nothing; give a non-empty prompt\n");
    return 2;
}

/* The engine --device names, with one sequence, for a context of n_ids prompt tokens plus the
 * reply. 0, or 2 (said) when they do not fit, or 1 with err. */
static int run_engine_open(const run_opts *o, const kvb_model *m, uint32_t n_ids, run_engine *re, kvb_err *err) {
    kvb_prefill_opts eo = {.device = o->cuda ? KVB_DEVICE_CUDA : KVB_DEVICE_CPU, .n_threads = (int)o->threads,
                           .cache_dtype = o->cache_type, .gpus = (int)o->gpus, .tp_one_device = o->tp_one_device,
                           .weights = (kvb_prefill_weights)o->gpu_weights};
    if (o->ctx) eo.max_ctx = (uint32_t)o->ctx;
    else {
        uint32_t need = n_ids + (uint32_t)o->n_gen;
        eo.max_ctx = m->d.n_ctx_train < 8192 ? m->d.n_ctx_train : 8192;
        if (need > eo.max_ctx && need <= m->d.n_ctx_train) eo.max_ctx = need;
    }
    if ((uint64_t)n_ids + (uint64_t)o->n_gen > eo.max_ctx) {
        fprintf(stderr,
                "kvbridge run: prompt (%u tokens) + %lld generated tokens exceed the context limit of %u tokens; "
                "shorten the prompt, lower -n or raise --ctx\n",
                n_ids, o->n_gen, eo.max_ctx);
        return 2;
    }
    if (kvb_prefill_engine_create(m, &eo, &re->e, err) != KVB_OK) return 1;
    return kvb_prefill_seq_create(re->e, &re->s, err) != KVB_OK;
}

/* Prefills ids, then samples up to n_gen tokens, printing them as text (streamed) or ids. */
static kvb_status run_generate(const run_opts *o, run_engine *re, const kvb_model *m, kvb_tokenizer *tok,
                               const int32_t *ids, uint32_t n_ids, kvb_err *err) {
    kvb_sampler smp = {0};
    float *logits = malloc(sizeof(float) * m->d.n_vocab);
    int32_t *out_ids = malloc(sizeof(int32_t) * (size_t)(o->n_gen + 1));
    kvb_status st = logits && out_ids ? kvb_sampler_init(&smp, &o->so, m->d.n_vocab, err)
                                      : kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    kvb_pool *pool = kvb_prefill_engine_pool(re->e); /* the CPU engine's, idle between the forwards */
    if (!st && pool) kvb_sampler_use_pool(&smp, pool);
    if (!st && o->verbose) {
        char desc[256], ed[512], ad[768];
        kvb_model_describe(m, desc, sizeof desc);
        kvb_prefill_engine_describe(re->e, ed, sizeof ed);
        kvb_prefill_engine_attention_describe(re->e, ad, sizeof ad);
        fprintf(stderr, "run: %s; %s engine: %s; attention: %s; prompt %u tokens\n", desc,
                kvb_prefill_engine_name(re->e), ed, ad, n_ids);
    }
    const double t0 = kvb_now_s();
    if (!st) st = re_forward(re, ids, n_ids, logits, err);
    const double t1 = kvb_now_s();
    if (!st && o->logits_out) {
        FILE *lf = fopen(o->logits_out, "wb");
        bool ok = lf && fwrite(logits, sizeof(float), m->d.n_vocab, lf) == m->d.n_vocab;
        if (lf && fclose(lf) != 0) ok = false;
        if (!ok) st = kvb_err_set(err, KVB_ERR_IO, "cannot write the logits to %s", o->logits_out);
    }
    kvb_detok dt;
    if (tok) kvb_detok_init(&dt, tok);
    char piece[512];
    uint32_t n_out = 0;
    for (long long i = 0; !st && i < o->n_gen; i++) {
        int32_t id = kvb_sample(&smp, logits);
        out_ids[n_out++] = id;
        if (!o->ids_out) {
            size_t k = kvb_detok_push(&dt, id, piece, sizeof piece);
            fwrite(piece, 1, k, stdout);
            fflush(stdout);
        }
        if (!o->ignore_eos && tok && kvb_tokenizer_is_eog(tok, id)) break;
        if (i + 1 < o->n_gen) st = re_forward(re, &id, 1, logits, err);
    }
    const double t2 = kvb_now_s();
    if (!st && o->ids_out) {
        for (uint32_t i = 0; i < n_out; i++) printf(i ? " %d" : "%d", out_ids[i]);
        printf("\n");
    } else if (!st) {
        size_t k = kvb_detok_flush(&dt, piece, sizeof piece);
        fwrite(piece, 1, k, stdout);
        printf("\n");
    }
    if (!st && o->verbose)
        fprintf(stderr, "run: prefill %u tokens in %.3f s (%.1f tok/s); decode %u tokens in %.3f s (%.1f tok/s)\n",
                n_ids, t1 - t0, n_ids / (t1 - t0), n_out, t2 - t1, n_out > 1 ? (n_out - 1) / (t2 - t1) : 0.0);
    kvb_sampler_free(&smp);
    free(logits);
    free(out_ids);
    return st;
}

/* Loads the model (and its tokenizer), then prompt, engine, reply. Returns the exit code. */
static int run_main(const run_opts *o) {
    kvb_err err = {0};
    kvb_model *m = NULL;
    run_engine re = {0};
    kvb_tokenizer *tok = NULL;
    int32_t *ids = NULL;
    uint32_t n_ids = 0;
    int rc = kvb_model_load(o->model_path, &m, &err) != KVB_OK;
    if (!rc && (o->prompt || !o->ids_out)) rc = kvb_tokenizer_load(m->gguf, &tok, &err) != KVB_OK;
    if (!rc) rc = prompt_ids(o, m, tok, &ids, &n_ids, &err);
    if (!rc) rc = run_engine_open(o, m, n_ids, &re, &err);
    if (!rc) rc = run_generate(o, &re, m, tok, ids, n_ids, &err) != KVB_OK;
    if (rc == 1) fprintf(stderr, "kvbridge run: %s\n", err.msg);
    free(ids);
    re_free(&re);
    kvb_tokenizer_free(tok);
    kvb_model_free(m);
    return rc;
}

int kvb_cmd_run(int argc, char **argv) {
    const char *cmd = "run", *model_path = NULL, *tokens_arg = NULL, *prompt = NULL, *tmpl_name = NULL;
    long long n_gen = 32, threads = 0, ctx = 0, gpus = 1;
    int gpu_weights = 0;
    bool ids_out = false, ignore_eos = false, verbose = false, chat = false, cuda = false, tp_one_device = false;
    const char *logits_out = NULL;
    kvb_sampler_opts so = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .seed = 0};
    uint32_t cache_type = KVB_TYPE_F16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        double f;
        long long n;
        if (kvb_arg_is_help(a)) {
            help(stdout);
            return 0;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            if (!(model_path = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--tokens")) {
            if (!(tokens_arg = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            if (!(prompt = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--chat")) {
            chat = true;
        } else if (!strcmp(a, "--chat-template")) {
            if (!(tmpl_name = kvb_arg_value(cmd, argc, argv, &i))) return 2;
            chat = true;
        } else if (!strcmp(a, "-n")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 0, 1 << 24, &n_gen)) return 2;
        } else if (!strcmp(a, "--seed")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_u64(cmd, a, v, &so.seed)) return 2;
        } else if (!strcmp(a, "--temp")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_float(cmd, a, v, 0, 100, &f)) return 2;
            so.temperature = (float)f;
        } else if (!strcmp(a, "--top-k")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 0, 1 << 24, &n)) return 2;
            so.top_k = (int)n;
        } else if (!strcmp(a, "--top-p")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_float(cmd, a, v, 0, 1, &f)) return 2;
            so.top_p = (float)f;
        } else if (!strcmp(a, "--threads")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 1024, &threads)) return 2;
        } else if (!strcmp(a, "--ctx")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 1 << 24, &ctx)) return 2;
        } else if (!strcmp(a, "--cache-type")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_type(cmd, a, v, &cache_type)) return 2;
        } else if (!strcmp(a, "--device")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i))) return 2;
            if (!strcmp(v, "cuda")) cuda = true;
            else if (!strcmp(v, "cpu")) cuda = false;
            else {
                fprintf(stderr, "kvbridge run: --device expects 'cpu' or 'cuda', got '%s'\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--ignore-eos")) {
            ignore_eos = true;
        } else if (!strcmp(a, "--gpus")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, KVB_CLI_MAX_GPUS, &gpus)) return 2;
        } else if (!strcmp(a, "--tp-one-device")) {
            tp_one_device = true;
        } else if (!strcmp(a, "--gpu-weights")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_gpu_weights("run", v, &gpu_weights)) return 2;
        } else if (!strcmp(a, "--logits-out")) {
            if (!(logits_out = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--verbose") || !strcmp(a, "-v")) {
            verbose = true;
        } else if (!strcmp(a, "--output")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i))) return 2;
            if (!strcmp(v, "ids")) ids_out = true;
            else if (!strcmp(v, "text")) ids_out = false;
            else {
                fprintf(stderr, "kvbridge run: --output expects 'text' or 'ids', got '%s'\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "kvbridge run: unknown option '%s' (see kvbridge run --help)\n", a);
            return 2;
        }
    }
    if (!model_path || (!tokens_arg == !prompt)) {
        fprintf(stderr, "kvbridge run: give -m MODEL and exactly one of --tokens or -p (see kvbridge run --help)\n");
        return 2;
    }
    if (!kvb_arg_gpus_ok("run", gpus, tp_one_device, cuda) || !kvb_arg_gpu_weights_ok("run", gpu_weights, cuda))
        return 2;

    const run_opts ro = {.model_path = model_path, .tokens_arg = tokens_arg, .prompt = prompt, .tmpl_name = tmpl_name,
                         .logits_out = logits_out, .n_gen = n_gen, .threads = threads, .ctx = ctx, .gpus = gpus,
                         .gpu_weights = gpu_weights, .ids_out = ids_out, .ignore_eos = ignore_eos, .verbose = verbose,
                         .chat = chat, .cuda = cuda, .tp_one_device = tp_one_device, .so = so,
                         .cache_type = cache_type};
    return run_main(&ro);
}
