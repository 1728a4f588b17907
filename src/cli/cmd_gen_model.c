/* cli/cmd_gen_model.c — `kvbridge gen-model`: write a GGUF with a preset's real shapes and
 * seeded random weights. */
#include <stdio.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_model.h"
#include "kvb_quant.h"

int kvb_cmd_gen_model(int argc, char **argv) {
    const char *out = NULL;
    long long threads = 0;
    uint64_t layers = 0;
    bool quiet = false;
    kvb_gen_opts o = {.type = KVB_TYPE_Q8_0};
    const kvb_opt opts[] = {
        {.long_name = "preset", .kind = KVB_OPT_STRING, .dst = &o.preset, .meta = "NAME", .required = true,
         .help = "model shape (list below)"},
        {.long_name = "out", .short_name = 'o', .kind = KVB_OPT_STRING, .dst = &out, .meta = "FILE",
         .required = true, .help = "output path"},
        {.long_name = "type", .kind = KVB_OPT_CUSTOM, .dst = &o.type, .meta = "T", .def = "q8_0",
         .parse = kvb_opt_parse_type, .help = "weight type of the matrices: f32, f16, bf16, q8_0, q4_0"},
        {.long_name = "seed", .kind = KVB_OPT_UINT, .dst = &o.seed, .meta = "S", .def = "1", .help = "random seed"},
        KVB_CLI_STR("vocab", &o.vocab_path, "F",
                    "vocabulary: a GGUF with tokenizer.ggml.* keys, or a Hugging Face tokenizer.json (default: a "
                    "byte-level vocabulary, padded to the preset's real vocabulary size)"),
        {.long_name = "layers", .kind = KVB_OPT_UINT, .dst = &layers, .meta = "N", .def = "0",
         .help = "write only the first N layers of the preset (0: all; a layer subset of a model too large to write)"},
        KVB_CLI_OPT_THREADS(&threads, "generation threads (default: all CPUs)"),
        KVB_CLI_FLAG("quiet", &quiet, "no progress output"),
        {0},
    };
    char presets[4096] = "presets:";
    for (size_t i = 0, len = strlen(presets); i < kvb_preset_count() && len < sizeof presets; i++)
        len += (size_t)snprintf(presets + len, sizeof presets - len, "\n  %-15s %s", kvb_preset_at(i)->name,
                                kvb_preset_at(i)->summary);
    const kvb_cli_spec spec = {
        .name = "gen-model", .opts = opts, .epilog = presets,
        .usage = "--preset NAME --out FILE [--type T] [--seed S] [--vocab F] [--layers N] [--threads N] [--quiet]",
        .about = "Writes a real GGUF file (llama.cpp tensor names and layouts) with the preset's architecture and "
                 "seeded random weights, scaled so activations stay sane and logits are not flat. The same (preset, "
                 "type, seed, vocab) always gives the same file, whatever the thread count."};
    int prc = kvb_cli_parse(&spec, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    o.n_threads = (int)threads;
    o.n_layers = layers > UINT32_MAX ? UINT32_MAX : (uint32_t)layers;
    o.progress = !quiet;
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
