/* cli/cmd_gen_model.c — `kvbridge gen-model`: write a GGUF with a preset's real shapes and
 * seeded random weights. */
#include <stdio.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_model.h"
#include "kvb_quant.h"

static void help(FILE *f) {
    fprintf(f,
            "usage: kvbridge gen-model --preset NAME --out FILE [--type T] [--seed S] [--vocab F] [--threads N] [--quiet]\n\n"
            "Writes a real GGUF file (llama.cpp tensor names and layouts) with the preset's architecture and\n"
            "seeded random weights, scaled so activations stay sane and logits are not flat. The same\n"
            "(preset, type, seed, vocab) always gives the same file, whatever the thread count.\n\n"
            "  --preset NAME   model shape (list below)\n"
            "  --out FILE      output path\n"
            "  --type T        weight type of the matrices: f32, f16, bf16, q8_0 (default), q4_0\n"
            "  --seed S        random seed (default 1)\n"
            "  --vocab F       vocabulary: a GGUF with tokenizer.ggml.* keys, or a Hugging Face tokenizer.json;\n"
            "                  default: a byte-level vocabulary (padded to the preset's real vocabulary size)\n"
            "  --threads N     generation threads (default: all CPUs)\n"
            "  --quiet         no progress output\n\npresets:\n");
    for (size_t i = 0; i < kvb_preset_count(); i++)
        fprintf(f, "  %-15s %s\n", kvb_preset_at(i)->name, kvb_preset_at(i)->summary);
}

int kvb_cmd_gen_model(int argc, char **argv) {
    const char *cmd = "gen-model", *out = NULL;
    kvb_gen_opts o = {.type = KVB_TYPE_Q8_0, .seed = 1, .progress = true};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        long long n;
        if (kvb_arg_is_help(a)) {
            help(stdout);
            return 0;
        } else if (strcmp(a, "--preset") == 0) {
            if (!(o.preset = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (strcmp(a, "--out") == 0 || strcmp(a, "-o") == 0) {
            if (!(out = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (strcmp(a, "--type") == 0) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_type(cmd, a, v, &o.type)) return 2;
        } else if (strcmp(a, "--seed") == 0) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_u64(cmd, a, v, &o.seed)) return 2;
        } else if (strcmp(a, "--vocab") == 0) {
            if (!(o.vocab_path = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (strcmp(a, "--threads") == 0) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 1024, &n)) return 2;
            o.n_threads = (int)n;
        } else if (strcmp(a, "--quiet") == 0) {
            o.progress = false;
        } else {
            fprintf(stderr, "kvbridge gen-model: unknown option '%s' (see kvbridge gen-model --help)\n", a);
            return 2;
        }
    }
    if (!o.preset || !out) {
        fprintf(stderr, "kvbridge gen-model: --preset and --out are required (see kvbridge gen-model --help)\n");
        return 2;
    }
    kvb_err err = {0};
    double t0 = kvb_now_s();
    if (kvb_gen_model(&o, out, &err) != KVB_OK) {
        fprintf(stderr, "kvbridge gen-model: %s\n", err.msg);
        return 1;
    }
    if (o.progress)
        fprintf(stderr, "gen-model: wrote %s (preset %s, %s weights, seed %llu) in %.1f s\n", out, o.preset,
                kvb_type_name(o.type), (unsigned long long)o.seed, kvb_now_s() - t0);
    return 0;
}
