/* cli/cmd_tokenize.c — `kvbridge tokenize -m MODEL [--no-special] [--decode | --jsonl]`: reads
 * stdin and prints the token ids (space-separated, one line), or with --decode reads ids and prints
 * the text, or with --jsonl encodes many texts in one run (one JSON string per input line, one line
 * of ids per text). Uses the vocabulary inside the GGUF (tokenizer.ggml.*); works on vocab-only
 * files. */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_gguf.h"
#include "kvb_tokenizer.h"

/* All of stdin (its length in *n), or NULL after saying so on stderr. */
static char *read_stdin(size_t *n) {
    char *text = kvb_cli_read_all(stdin, n);
    if (!text) fprintf(stderr, "kvbridge tokenize: cannot read stdin\n");
    return text;
}

/* Prints the ids of text[0:n] on one line; 0, or 1 with the tokenizer's error on stderr. */
static int encode_one(const kvb_tokenizer *t, const char *text, size_t n, bool special) {
    int32_t *ids = NULL;
    size_t n_ids = 0;
    kvb_err err = {0};
    if (kvb_tokenize(t, text, n, special, special, &ids, &n_ids, &err)) {
        fprintf(stderr, "kvbridge tokenize: %s\n", err.msg);
        return 1;
    }
    for (size_t i = 0; i < n_ids; i++) printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
    free(ids);
    return 0;
}

static int encode(const kvb_tokenizer *t, bool special) {
    size_t n = 0;
    char *text = read_stdin(&n);
    if (!text) return 1;
    int rc = encode_one(t, text, n, special);
    free(text);
    return rc;
}

/* --jsonl: each stdin line is a JSON string (its bytes may be any, \u escapes included); each gives one
 * output line of ids. A line that is not a JSON string stops the run with its line number (exit 2). */
static int encode_jsonl(const kvb_tokenizer *t, bool special) {
    size_t n = 0;
    char *all = read_stdin(&n);
    if (!all) return 1;
    int rc = 0;
    size_t line_no = 0;
    for (size_t i = 0; i < n && !rc;) {
        size_t e = i;
        while (e < n && all[e] != '\n') e++;
        line_no++;
        cJSON *v = cJSON_ParseWithLength(all + i, e - i);
        if (!cJSON_IsString(v) || !v->valuestring) {
            fprintf(stderr, "kvbridge tokenize: --jsonl: line %zu is not a JSON string\n", line_no);
            rc = 2;
        } else {
            rc = encode_one(t, v->valuestring, strlen(v->valuestring), special);
        }
        cJSON_Delete(v);
        i = e + 1;
    }
    free(all);
    return rc;
}

static int decode(const kvb_tokenizer *t, bool special) {
    size_t n = 0;
    char *text = read_stdin(&n);
    if (!text) return 1;
    size_t cap = kvb_tokenizer_max_token_len(t) + 32;
    char *piece = malloc(cap);
    if (!piece) {
        free(text);
        fprintf(stderr, "kvbridge tokenize: out of memory\n");
        return 1;
    }
    kvb_detok d;
    kvb_detok_init(&d, t);
    d.show_special = special;
    int rc = 0;
    size_t i = 0;
    uint32_t nv = kvb_tokenizer_n_vocab(t);
    while (i < n) {
        char c = text[i];
        if (c == ' ' || c == ',' || c == '\n' || c == '\r' || c == '\t') {
            i++;
            continue;
        }
        size_t j = i;
        while (j < n && text[j] >= '0' && text[j] <= '9' && j - i < 12) j++;
        bool sep = j == n || text[j] == ' ' || text[j] == ',' || text[j] == '\n' || text[j] == '\r' || text[j] == '\t';
        if (j == i || !sep) {
            size_t e = i;
            while (e < n && e - i < 20 && !strchr(" ,\n\r\t", text[e])) e++;
            fprintf(stderr, "kvbridge tokenize: --decode expects token ids (whole numbers), got '%.*s'\n",
                    (int)(e - i), text + i);
            rc = 2;
            break;
        }
        unsigned long long v = 0;
        for (size_t k = i; k < j; k++) v = v * 10 + (unsigned)(text[k] - '0');
        if (v >= nv) {
            fprintf(stderr, "kvbridge tokenize: token id %llu is outside the vocabulary (0 to %u)\n", v, nv - 1);
            rc = 2;
            break;
        }
        size_t k = kvb_detok_push(&d, (int32_t)v, piece, cap);
        fwrite(piece, 1, k, stdout);
        i = j;
    }
    size_t k = kvb_detok_flush(&d, piece, cap);
    fwrite(piece, 1, k, stdout);
    fflush(stdout);
    free(piece);
    free(text);
    return rc;
}

int kvb_cmd_tokenize(int argc, char **argv) {
    const char *model = NULL;
    bool no_special = false, dec = false, jsonl = false;
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&model, "the GGUF file", true),
        KVB_CLI_FLAG("no-special", &no_special,
                     "no BOS/EOS, and special-token text such as <|im_start|> is encoded as ordinary text (default: "
                     "add BOS if the vocabulary asks for it and recognise special tokens in the text)"),
        KVB_CLI_FLAG("decode", &dec,
                     "the other way: read token ids (separated by spaces, commas or newlines) and print the text "
                     "they decode to; special tokens are printed as their text unless --no-special"),
        KVB_CLI_FLAG("jsonl", &jsonl,
                     "many texts in one run: each stdin line a JSON string, each printed as one line of ids (a "
                     "text holding a NUL, \\u0000, ends there)"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "tokenize", .usage = "-m MODEL [--no-special] [--decode | --jsonl]", .opts = opts,
        .about = "Encodes the UTF-8 text on stdin with the vocabulary stored in MODEL (a GGUF file, a vocab-only "
                 "one is fine) and prints the token ids, space-separated, on one line. The input is taken byte for "
                 "byte: a trailing newline is part of the text (use printf '%s').",
        .epilog = "examples:\n"
                  "  printf 'Hello world' | kvbridge tokenize -m model.gguf\n"
                  "  echo '9707 1879' | kvbridge tokenize -m model.gguf --decode\n"
                  "  printf '\"Hello\"\\n\"world\"\\n' | kvbridge tokenize -m model.gguf --jsonl"};
    int prc = kvb_cli_parse(&spec, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    if (dec && jsonl) {
        fprintf(stderr, "kvbridge tokenize: --decode and --jsonl go one at a time\n");
        return 2;
    }
    const bool special = !no_special;
    kvb_err err = {0};
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = NULL;
    if (kvb_gguf_open(model, &g, &err) != KVB_OK || kvb_tokenizer_load(g, &t, &err) != KVB_OK) {
        fprintf(stderr, "kvbridge tokenize: %s\n", err.msg);
        kvb_gguf_close(g);
        return 1;
    }
    int rc = dec ? decode(t, special) : jsonl ? encode_jsonl(t, special) : encode(t, special);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
    return rc;
}
