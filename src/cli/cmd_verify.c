/* cli/cmd_verify.c — `kvbridge verify`: prints the validation table (decoder-exact cache arrays,
 * identical blocks, chunked == one-shot) as N/N rows per preset and cache format, and exits
 * non-zero if any row is short. Rows a machine cannot run are named as not run. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kvb_bridge.h"
#include "kvb_cli.h"
#include "kvb_quant.h"
#include "kvb_prefill_engine.h"

static const uint32_t k_formats[] = {KVB_TYPE_F32, KVB_TYPE_F16, KVB_TYPE_BF16, KVB_TYPE_Q8_0};

/* Bytes per token by layer kind for prompts of the given lengths, bridged from position 0 into a
 * decoder with the CLI's default cache (f16, 32-token blocks): global layers ship every position,
 * local layers only the positions the decoder keeps (kvb_kvformat_ship_bytes, the rule the bridge
 * and the receiver follow, checked against the shipped bytes by the "bytes" rows). */
static void print_bytes_table(const char *label, const kvb_model *m, const uint32_t *lens, int n_lens) {
    const char *slash = strrchr(label, '/');
    if (slash) label = slash + 1;
    kvb_kvformat f;
    kvb_err err = {0};
    if (kvb_model_kvformat(&m->d, KVB_TYPE_F16, 32, &f, &err)) return;
    uint64_t tg, tl;
    kvb_kvformat_token_bytes(&f, &tg, &tl);
    printf("  bytes per token, %s (f16 cache, 32-token blocks): %u global layer(s) %llu B/position, "
           "%u local layer(s) %llu B/position",
           label, f.n_layer - f.n_local, (unsigned long long)tg, f.n_local, (unsigned long long)tl);
    if (f.window)
        printf(" (window %u: kept for at most the last %u positions)\n", f.window, f.window + f.block_tokens - 1);
    else
        printf("\n");
    printf("  %-14s %8s %12s %12s %12s %12s %12s %8s\n", "model", "prompt", "global B/tok", "local B/tok",
           "total B/tok", "all rows B/t", "shipped MB", "saved");
    for (int i = 0; i < n_lens; i++) {
        uint64_t g, l;
        const uint32_t n = lens[i], shipped = n > 1 ? n - 1 : 0;
        kvb_kvformat_ship_bytes(&f, 0, shipped, &g, &l);
        const double per = n ? 1.0 / n : 0, all = (double)(tg + tl) * shipped;
        printf("  %-14s %8u %12.1f %12.1f %12.1f %12.1f %12.2f %7.1f%%\n", label, n, g * per, l * per, (g + l) * per,
               all * per, (g + l) / 1e6, all > 0 ? 100.0 * (1.0 - (double)(g + l) / all) : 0.0);
    }
}

/* cuda: 0 = the CPU bridge; N >= 1: the CUDA bridge, as N tensor-parallel rank bridges when N > 1 */
static int verify_model(const char *label, const char *path, int threads, bool perturb, int cuda, int *short_rows,
                        const uint32_t *lens, int n_lens) {
    kvb_err err = {0};
    kvb_model *m = NULL;
    if (kvb_model_load(path, &m, &err)) {
        fprintf(stderr, "kvbridge verify: %s\n", err.msg);
        return 1;
    }
    for (size_t i = 0; i < sizeof k_formats / sizeof k_formats[0]; i++) {
        kvb_verify_opts o = {.cache_dtype = k_formats[i], .block_tokens = 16, .prompt_tokens = 4 * 16 + 7,
                             .seed = 0x5eed + i, .n_threads = threads, .perturb = perturb, .cuda = cuda > 0, .gpus = cuda};
        char dev[16];
        snprintf(dev, sizeof dev, cuda > 1 ? "cudax%d" : cuda ? "cuda" : "cpu", cuda);
        kvb_verify_result r;
        if (kvb_verify_cpu(m, &o, &r, &err)) {
            fprintf(stderr, "kvbridge verify: %s (%s): %s\n", label, kvb_type_name(k_formats[i]), err.msg);
            kvb_model_free(m);
            return 1;
        }
        const char *fmt = kvb_type_name(k_formats[i]);
        struct {
            const char *name;
            uint32_t ok, total;
        } rows[] = {{"arrays", r.arrays_ok, r.arrays_total},
                    {"blocks", r.blocks_ok, r.blocks_total},
                    {"chunked", r.chunked_ok, r.chunked_total},
                    {"bytes", 0, 1}};
        /* bytes: what the bridge shipped, by layer kind, equals the rule (local rows only where kept) */
        kvb_kvformat f;
        uint64_t g = 0, l = 0;
        if (!kvb_model_kvformat(&m->d, k_formats[i], o.block_tokens, &f, &err)) {
            kvb_kvformat_ship_bytes(&f, 0, r.ship_tokens, &g, &l);
            rows[3].ok = r.slab_bytes_local == l && r.slab_bytes - r.slab_bytes_local == g;
        }
        for (size_t k = 0; k < (perturb ? 3u : 4u); k++) { /* bytes are no arithmetic: not a perturbed row */
            bool good = rows[k].ok == rows[k].total && rows[k].total > 0;
            printf("  %-14s %-5s %-5s %-8s %4u/%-4u %s\n", label, fmt, dev, rows[k].name, rows[k].ok,
                   rows[k].total, good ? "ok" : "SHORT");
            if (!good) (*short_rows)++;
        }
        if (f.window)
            printf("  %-14s %-5s %-5s local rows shipped from position %u of %u (window %u): %llu B global + %llu B "
                   "local\n",
                   label, fmt, dev, r.local_keep_from, r.ship_tokens, f.window,
                   (unsigned long long)(r.slab_bytes - r.slab_bytes_local), (unsigned long long)r.slab_bytes_local);
    }
    if (n_lens && !cuda) print_bytes_table(label, m, lens, n_lens);
    kvb_model_free(m);
    return 0;
}

/* --bytes-at LIST: up to 8 prompt lengths into lens (*n_lens of them), or none for 'none'. */
static bool parse_bytes_at(const char *v, uint32_t *lens, int *n_lens) {
    *n_lens = 0;
    if (!strcmp(v, "none")) return true;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", v);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        long long n;
        if (*n_lens == 8) {
            fprintf(stderr, "kvbridge verify: --bytes-at takes at most 8 lengths\n");
            return false;
        }
        if (!kvb_arg_int("verify", "--bytes-at", tok, 2, 1 << 30, &n)) return false;
        lens[(*n_lens)++] = (uint32_t)n;
    }
    return true;
}

int kvb_cmd_verify(int argc, char **argv) {
    const char *presets[16], *model = NULL, *bytes_at = "1024,8192,30720";
    char *paths[16] = {0};
    int n_presets = 0, n_lens = 0, device_index = 0;
    uint32_t lens[8];
    bool perturb = false, restore = false;
    long long gpus = 1, threads_arg = 0, n_predict = 16;
    kvb_opt_list preset_list = {0};
    static const char *const targets[] = {"kvbridge", "llama.cpp", NULL};
    int target = 0, kv_arith = 0;
    const char *server = NULL, *slot_dir = NULL, *slot_file = NULL, *prompt = "The capital of France is";
    const kvb_opt opts[] = {
        {.long_name = "target", .kind = KVB_OPT_ENUM, .dst = &target, .choices = targets, .def = "kvbridge",
         .help = "the decoder whose cache is verified: kvbridge's own, or a stock llama-server (llama.cpp's "
                 "state format; needs --model and --server or --slot-file)"},
        {.long_name = "server", .kind = KVB_OPT_STRING, .dst = &server, .meta = "URL",
         .help = "llama.cpp: http://HOST:PORT of a llama-server run with --slot-save-path DIR -np 1"},
        {.long_name = "slot-dir", .kind = KVB_OPT_STRING, .dst = &slot_dir, .meta = "DIR",
         .help = "llama.cpp: that server's --slot-save-path (kvbridge's file is written there too)"},
        {.long_name = "slot-file", .kind = KVB_OPT_STRING, .dst = &slot_file, .meta = "FILE",
         .help = "llama.cpp, without --server: a slot file llama-server saved"},
        {.long_name = "prompt", .kind = KVB_OPT_STRING, .dst = &prompt, .meta = "TEXT",
         .def = "The capital of France is", .help = "llama.cpp: the prompt llama-server computes"},
        {.long_name = "restore", .kind = KVB_OPT_FLAG, .dst = &restore,
         .help = "llama.cpp: restore kvbridge's file into slot 0, decode, compare with llama-server alone; "
                 "then a refused restore must fall back to llama-server computing the prompt"},
        {.long_name = "n-predict", .kind = KVB_OPT_INT, .dst = &n_predict, .meta = "N", .lo = 1, .hi = 4096,
         .def = "16", .help = "llama.cpp with --restore: greedy tokens compared"},
        {.long_name = "preset", .kind = KVB_OPT_LIST, .dst = &preset_list, .meta = "NAME",
         .help = "generate (once, into models/) and verify this preset (default: tiny, tiny-qwen2, tiny-qwen3, "
                 "tiny-llama3, tiny-gemma3)"},
        KVB_CLI_OPT_MODEL(&model, "verify this GGUF instead", false),
        KVB_CLI_OPT_DEVICE(&device_index, "cuda needs the CUDA bridge (said plainly when absent)"),
        {.long_name = "gpus", .kind = KVB_OPT_INT, .dst = &gpus, .meta = "N", .lo = 1, .hi = KVB_CLI_MAX_GPUS,
         .def = "1",
         .help = "with cuda: N tensor-parallel rank bridges, each computing its share of the KV heads into the "
                 "same rows (GPUs 0..N-1 when the host has them, else all on GPU 0)"},
        KVB_CLI_OPT_THREADS(&threads_arg, "CPU threads (default: all)"),
        KVB_CLI_OPT_KV_ARITH(&kv_arith, "--target llama.cpp: kvbridge's rows in its engine's arithmetic or in ggml's "
                                        "(every RMSNorm, RoPE and the K/V projections as llama.cpp's CPU backend)"),
        {.long_name = "perturb", .kind = KVB_OPT_FLAG, .dst = &perturb,
         .help = "test-only: perturb the bridge by one reordered addition; every row must fail"},
        {.long_name = "bytes-at", .kind = KVB_OPT_STRING, .dst = &bytes_at, .meta = "LIST",
         .def = "1024,8192,30720",
         .help = "prompt lengths for the bytes-per-token table by layer kind ('none' to leave it out)"},
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "verify", .opts = opts,
        .usage = "[--preset NAME]... [--model FILE] [--device cpu|cuda [--gpus N]] [--threads T] [--perturb]\n"
                 "--target llama.cpp --model FILE (--server URL --slot-dir DIR [--restore] | --slot-file FILE) "
                 "[--prompt TEXT]",
        .about = "Proves the bridge computes the decoder's own cache: for each model and each cache format (f32, "
                 "f16, bf16, q8_0) it compares, bit for bit,\n"
                 "  arrays   every layer's K and V written by the bridge vs by the decoder's own forward\n"
                 "  blocks   blocks committed from bridge slabs vs blocks the decoder committed itself\n"
                 "  chunked  bridge output computed in odd 5-token chunks vs in one shot\n"
                 "  bytes    the slab bytes shipped, by layer kind, equal the rule: global layers every position,\n"
                 "           local (sliding-window) layers only the positions the decoder keeps\n"
                 "and exits 1 if any row is short. With --target llama.cpp it compares, per layer and K/V, the cache a "
                 "stock llama-server saves for a prompt with the same cache kvbridge computes and writes in "
                 "llama.cpp's state format (identical cells, or the largest absolute difference)."};
    int prc = kvb_cli_parse(&spec, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    if (preset_list.n > 16) return kvb_cli_usage_error(&spec, "at most 16 presets");
    for (int i = 0; i < preset_list.n; i++) {
        if (!kvb_preset_find(preset_list.v[i]))
            return kvb_cli_usage_error(&spec, "unknown preset '%s' (kvbridge gen-model --help lists them)",
                                       preset_list.v[i]);
        presets[n_presets++] = preset_list.v[i];
    }
    if (target == 1) {
        if (!model || (!server == !slot_file) || (server && !slot_dir))
            return kvb_cli_usage_error(&spec, "--target llama.cpp needs --model and either --server with "
                                              "--slot-dir or --slot-file");
        char dir[4096];
        if (!slot_dir) { /* kvbridge's file goes beside the one given */
            snprintf(dir, sizeof dir, "%s", slot_file);
            char *slash = strrchr(dir, '/');
            if (slash)
                *slash = 0;
            else
                snprintf(dir, sizeof dir, ".");
            slot_dir = dir;
        }
        const kvb_verify_llamacpp_opts lo = {.model = model, .prompt = prompt, .server = server,
                                             .slot_dir = slot_dir, .slot_file = slot_file,
                                             .threads = (int)threads_arg, .restore = restore,
                                             .n_predict = (int)n_predict, .kv_ggml = kv_arith == 1};
        return kvb_verify_llamacpp(&lo);
    }
    if (!parse_bytes_at(bytes_at, lens, &n_lens)) return 2;
    const char *device = kvb_cli_device_names[device_index];
    const int threads = (int)threads_arg;
    if (!model && n_presets == 0) {
        static const char *dflt[] = {"tiny", "tiny-qwen2", "tiny-qwen3", "tiny-llama3", "tiny-gemma3"};
        for (size_t i = 0; i < sizeof dflt / sizeof dflt[0]; i++) presets[n_presets++] = dflt[i];
    }
    printf("kvbridge verify%s: bridge (decoder mode) vs the decoder's own cache, bit for bit\n",
           perturb ? " (PERTURBED bridge: every row must be short)" : "");
    printf("  %-14s %-5s %-5s %-8s %9s\n", "model", "cache", "dev", "row", "identical");
    int short_rows = 0;
    if (model) {
        if (verify_model(model, model, threads, perturb, 0, &short_rows, lens, n_lens)) return 1;
    }
    for (int i = 0; i < n_presets; i++) {
        char path[512];
        snprintf(path, sizeof path, "models/%s-q8_0.gguf", presets[i]);
        struct stat st;
        if (stat(path, &st) != 0) {
            mkdir("models", 0755);
            fprintf(stderr, "verify: generating %s\n", path);
            kvb_gen_opts o = {.preset = presets[i], .type = KVB_TYPE_Q8_0, .seed = 1, .n_threads = threads};
            kvb_err err = {0};
            if (kvb_gen_model(&o, path, &err)) {
                fprintf(stderr, "kvbridge verify: %s\n", err.msg);
                return 1;
            }
        }
        paths[i] = strdup(path);
        if (!paths[i] || verify_model(presets[i], path, threads, perturb, 0, &short_rows, lens, n_lens)) return 1;
    }
    /* the CUDA rows: the bridge kernel on the GPU against the same decoder's own cache */
    char why[256] = "";
    if (!strcmp(device, "cuda") && kvb_prefill_device_available(KVB_DEVICE_CUDA, why, sizeof why)) {
        if (model && verify_model(model, model, threads, perturb, (int)gpus, &short_rows, lens, n_lens)) return 1;
        for (int i = 0; i < n_presets; i++)
            if (verify_model(presets[i], paths[i], threads, perturb, (int)gpus, &short_rows, lens, n_lens)) return 1;
    } else if (!strcmp(device, "cuda")) {
        printf("  CUDA rows: not run — %s.\n", why);
    } else {
        printf("  CUDA rows: not run — pass --device cuda on a GPU host.\n");
    }
    for (int i = 0; i < n_presets; i++) free(paths[i]);
    printf("%s: %d short row(s)\n", short_rows ? "FAIL" : "PASS", short_rows);
    return short_rows ? 1 : 0;
}
