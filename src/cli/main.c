/* cli/main.c — `kvbridge SUBCOMMAND ...`: the table of subcommands and the top-level help. */
#include <stdio.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_core.h"

typedef struct {
    const char *name;
    int (*fn)(int, char **);
    const char *summary;
} kvb_subcommand;

static const kvb_subcommand k_commands[] = {
    {"demo", kvb_cmd_demo, "a prefill and a decode node on loopback, a 4-turn conversation, bridged vs native"},
    {"gen-model", kvb_cmd_gen_model, "write a GGUF with a real architecture and seeded weights"},
    {"serve", kvb_cmd_serve, "run a prefill node or a decode node (OpenAI API)"},
    {"doctor", kvb_cmd_doctor, "check that this decode-node setup and a prefill node are compatible"},
    {"run", kvb_cmd_run, "generate text or token ids from a GGUF model on this machine"},
    {"bench", kvb_cmd_bench, "measure prefill and decode speed against the machine's limits"},
    {"verify", kvb_cmd_verify, "prove the bridge writes the decoder's own cache bytes (N/N table)"},
    {"tokenize", kvb_cmd_tokenize, "text on stdin to token ids (or --decode ids to text)"},
    {"inspect", kvb_cmd_inspect, "print a GGUF file's metadata and tensors, validating it"},
};

static void usage(FILE *f) {
    fprintf(f,
            "kvbridge — heterogeneous prefill/decode disaggregation for LLM inference\n\n"
            "usage: kvbridge SUBCOMMAND [options]   (kvbridge SUBCOMMAND --help for its options)\n\n"
            "subcommands:\n");
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        fprintf(f, "  %-10s %s\n", k_commands[i].name, k_commands[i].summary);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("kvbridge 0.1.0\n");
        return 0;
    }
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        if (strcmp(argv[1], k_commands[i].name) == 0) {
            kvb_trace_init_from_env(); /* KVB_TRACE=FILE: a timeline of this run, written at its end */
            int rc = k_commands[i].fn(argc - 1, argv + 1);
            kvb_err err = {0};
            if (kvb_trace_write(&err)) fprintf(stderr, "kvbridge: %s\n", err.msg);
            return rc;
        }
    fprintf(stderr, "kvbridge: unknown subcommand '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
