/* cli/cmd_bench_tokenize.c — `kvbridge bench tokenize`: how long the tokenizer of a model takes to
 * encode one long prompt, the work a decode node does for every chat request before anything else:
 * the vocabulary's load time once, then R encodes of the same text (a file, or the readable
 * English document of the quality benchmark at a size asked for), best and median, in MB/s and
 * microseconds per token. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_gguf.h"
#include "kvb_tokenizer.h"

int kvb_bench_tokenize(int argc, char **argv) {
    const char *model = NULL, *file = NULL;
    long long tokens = 0, reps = 0;
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&model, "GGUF file whose vocabulary encodes (a vocab-only one is fine)", true),
        KVB_CLI_STR("file", &file, "TEXT", "the text, byte for byte (default: the quality benchmark's English "
                                           "document)"),
        KVB_CLI_INT("tokens", &tokens, "N", 1, 1 << 24, "32768", "the size of that document, in tokens, approximately"),
        KVB_CLI_INT("reps", &reps, "R", 1, 1000, "5", "encodes to time"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "bench tokenize", .usage = "-m MODEL [--file TEXT | --tokens N] [--reps R]", .opts = opts,
        .about = "Encodes one text R times with MODEL's vocabulary, as a decode node encodes a chat request's "
                 "prompt, and prints the vocabulary's load time, then the best and median encode time, MB/s and "
                 "microseconds per token."};
    int prc = kvb_cli_parse(&spec, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    size_t n = 0;
    char *text = NULL, *question = NULL, *answer = NULL;
    if (file) {
        FILE *f = fopen(file, "rb");
        text = f ? kvb_cli_read_all(f, &n) : NULL;
        if (f) fclose(f);
        if (!text) {
            fprintf(stderr, "kvbridge bench tokenize: cannot read %s\n", file);
            return 1;
        }
    } else {
        if (kvb_quality_prompt(1, (uint32_t)tokens, &text, &question, &answer)) {
            fprintf(stderr, "kvbridge bench tokenize: out of memory for a %lld-token document\n", tokens);
            return 1;
        }
        n = strlen(text);
    }
    int rc = 1;
    kvb_err err = {0};
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = NULL;
    double *times = calloc((size_t)reps, sizeof *times);
    const double t0 = kvb_now_s();
    if (!times || kvb_gguf_open(model, &g, &err) || kvb_tokenizer_load(g, &t, &err)) {
        fprintf(stderr, "kvbridge bench tokenize: %s\n", times ? err.msg : "out of memory");
        goto done;
    }
    const double load_s = kvb_now_s() - t0;
    size_t n_ids = 0;
    for (long long r = 0; r < reps; r++) {
        int32_t *ids = NULL;
        const double a = kvb_now_s();
        if (kvb_tokenize(t, text, n, false, false, &ids, &n_ids, &err)) {
            fprintf(stderr, "kvbridge bench tokenize: %s\n", err.msg);
            goto done;
        }
        times[r] = kvb_now_s() - a;
        free(ids);
    }
    const double med = kvb_median_sort(times, (int)reps), best = times[0]; /* sorted in place */
    printf("tokenize: %s (%u tokens in the vocabulary, loaded in %.1f ms)\n", model, kvb_tokenizer_n_vocab(t),
           load_s * 1e3);
    printf("text      %s: %zu bytes -> %zu tokens\n", file ? file : "the quality benchmark's document", n, n_ids);
    printf("encode    best %.2f ms, median %.2f ms of %lld: %.1f MB/s, %.3f us per token (median)\n", best * 1e3,
           med * 1e3, reps, n / med / 1e6, n_ids ? med * 1e6 / (double)n_ids : 0.0);
    rc = 0;
done:
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
    free(times);
    free(text);
    free(question);
    free(answer);
    return rc;
}
