/* cli/cmd_demo.c — `kvbridge demo`: the README's main command. Until the prefill/decode loop
 * exists it shows the foundation working end to end: generate the tiny model (if absent), load
 * it, prefill a prompt and generate on the CPU engine, saying what it did at each step. */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "kvb_cli.h"
#include "kvb_model.h"
#include "kvb_quant.h"

static void help(FILE *f) {
    fprintf(f,
            "usage: kvbridge demo [--model FILE] [--threads T]\n\n"
            "Generates the tiny test model (models/tiny-q8_0.gguf, seeded random weights) if it is absent,\n"
            "then runs a prompt through the CPU engine twice — as text and as token ids — with timings.\n"
            "Random weights make random text: the demo shows the machinery, not a trained model.\n\n"
            "  --model FILE   use this GGUF instead of the generated tiny model\n"
            "  --threads T    CPU threads (default: all)\n");
}

int kvb_cmd_demo(int argc, char **argv) {
    const char *model = "models/tiny-q8_0.gguf", *threads = NULL;
    for (int i = 1; i < argc; i++) {
        if (kvb_arg_is_help(argv[i])) {
            help(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--model")) {
            if (!(model = kvb_arg_value("demo", argc, argv, &i))) return 2;
        } else if (!strcmp(argv[i], "--threads")) {
            if (!(threads = kvb_arg_value("demo", argc, argv, &i))) return 2;
        } else {
            fprintf(stderr, "kvbridge demo: unknown option '%s' (see kvbridge demo --help)\n", argv[i]);
            return 2;
        }
    }
    struct stat st;
    if (stat(model, &st) != 0) {
        if (strcmp(model, "models/tiny-q8_0.gguf") != 0) {
            fprintf(stderr, "kvbridge demo: %s does not exist\n", model);
            return 1;
        }
        mkdir("models", 0755);
        printf("demo: generating the tiny model (llama architecture, Q8_0, seed 1) -> %s\n", model);
        kvb_gen_opts o = {.preset = "tiny", .type = KVB_TYPE_Q8_0, .seed = 1, .progress = false};
        kvb_err err = {0};
        double t0 = kvb_now_s();
        if (kvb_gen_model(&o, model, &err) != KVB_OK) {
            fprintf(stderr, "kvbridge demo: %s\n", err.msg);
            return 1;
        }
        printf("demo: wrote it in %.2f s\n", kvb_now_s() - t0);
    } else {
        printf("demo: using %s\n", model);
    }
    char *run_text[] = {"run", "-m", (char *)model, "-p", "The bridge carries the cache", "-n", "48", "--seed", "7",
                        "--verbose", "--threads", (char *)(threads ? threads : "0"), NULL};
    int n = threads ? 12 : 10;
    printf("\ndemo: kvbridge run -m %s -p \"The bridge carries the cache\" -n 48 --seed 7\n", model);
    printf("----\n");
    fflush(stdout);
    int rc = kvb_cmd_run(n, run_text);
    printf("----\n");
    if (rc) return rc;
    char *run_ids[] = {"run", "-m", (char *)model, "--tokens", "1,2,3", "-n", "16", "--seed", "7", "--output", "ids",
                       "--threads", (char *)(threads ? threads : "0"), NULL};
    n = threads ? 13 : 11;
    printf("demo: kvbridge run -m %s --tokens 1,2,3 -n 16 --seed 7 --output ids\n", model);
    fflush(stdout);
    rc = kvb_cmd_run(n, run_ids);
    if (rc) return rc;
    printf("\ndemo: done. The CPU engine prefilled and decoded over its paged KV cache; the same seed gives the\n"
           "same tokens on every run and every thread count. The prefill/decode bridge is not built yet.\n");
    return 0;
}
