/* tests/test_tokenizer_vectors.c — llama.cpp's tokenizer test vectors (NAME.gguf.inp/.out in the
 * test vocabulary directory, kvbt_vocab_file(); tools/fetch_vocab.sh fetches them): every case of
 * every vocabulary must encode (no BOS, no special parsing) to exactly the expected ids, and the
 * test prints "NAME: N/N cases pass" for each. llama-spm, phi-3 (SentencePiece), gpt-2,
 * deepseek-coder and llama-bpe (byte-level BPE, Llama 3's pre-tokenizer) come as llama.cpp's
 * vocab-only GGUFs; qwen2's vectors run on Qwen's tokenizer.json converted by
 * kvb_vocab_from_hf_json into a GGUF and loaded back. Each vocabulary also decodes its cases back
 * (decode(encode(x)) == x). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_gguf.h"
#include "kvb_tokenizer.h"
#include "kvbt.h"

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) b[sz] = 0, *n = (size_t)sz;
    return b;
}

/* Writes the vocabulary of a Hugging Face tokenizer.json into a vocab-only GGUF at out. */
static void write_hf_vocab(const char *json, const char *out) {
    kvb_err err = {0};
    kvb_gguf_writer *w = NULL;
    uint32_t n = 0;
    assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
    kvb_status st = kvb_vocab_from_hf_json(w, json, 0, &n, &err);
    if (st) fprintf(stderr, "kvb_vocab_from_hf_json: %s\n", err.msg);
    assert_int_equal(st, KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_str(w, "general.architecture", "qwen3", &err), KVB_OK);
    FILE *f = fopen(out, "wb");
    assert_non_null(f);
    assert_int_equal(kvb_gguf_writer_write_header(w, f, &err), KVB_OK);
    assert_int_equal(fclose(f), 0);
    kvb_gguf_writer_destroy(w);
}

/* Runs NAME.gguf.inp/.out against the vocabulary in gguf_path; returns the number of failures. */
static int run_vectors(const char *name, const char *gguf_path) {
    char inp_name[256], out_name[256], inp_path[1024], out_path[1024];
    snprintf(inp_name, sizeof inp_name, "%s.gguf.inp", name);
    snprintf(out_name, sizeof out_name, "%s.gguf.out", name);
    kvbt_require_vocab(inp_name, inp_path, sizeof inp_path);
    kvbt_require_vocab(out_name, out_path, sizeof out_path);
    size_t ni = 0, no = 0;
    char *inp = slurp(inp_path, &ni), *outp = slurp(out_path, &no);
    assert_non_null(inp);
    assert_non_null(outp);

    kvb_err err = {0};
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = NULL;
    if (kvb_gguf_open(gguf_path, &g, &err) || kvb_tokenizer_load(g, &t, &err)) fail_msg("%s: %s", name, err.msg);

    static const char sep[] = "\n__ggml_vocab_test__\n";
    size_t sl = sizeof sep - 1;
    char *p = inp, *line = outp;
    int total = 0, pass = 0, rt_fail = 0;
    for (;;) {
        char *e = NULL;
        for (char *q = p; q + sl <= inp + ni; q++)
            if (memcmp(q, sep, sl) == 0) {
                e = q;
                break;
            }
        if (!e) break; /* the piece after the last separator is not a case */
        size_t len = (size_t)(e - p);
        char *nl = strchr(line, '\n');
        assert_non_null(nl);
        *nl = 0;
        /* expected ids */
        int32_t want[4096];
        size_t nw = 0;
        for (char *q = line; *q;) {
            while (*q == ' ') q++;
            if (!*q) break;
            want[nw++] = (int32_t)strtol(q, &q, 10);
        }
        int32_t *ids = NULL;
        size_t n = 0;
        if (kvb_tokenize(t, p, len, false, false, &ids, &n, &err)) fail_msg("%s: %s", name, err.msg);
        bool ok = n == nw && (n == 0 || memcmp(ids, want, n * sizeof *ids) == 0);
        total++;
        if (ok) {
            pass++;
        } else {
            fprintf(stderr, "%s case %d mismatch: input '%.*s'\n  want:", name, total, (int)len, p);
            for (size_t i = 0; i < nw; i++) fprintf(stderr, " %d", want[i]);
            fprintf(stderr, "\n  got: ");
            for (size_t i = 0; i < n; i++) fprintf(stderr, " %d", ids[i]);
            fprintf(stderr, "\n");
        }
        /* decode back through the streaming decoder */
        kvb_detok d;
        kvb_detok_init(&d, t);
        char *text = malloc(len * 4 + 64), piece[1024];
        size_t tl = 0;
        for (size_t i = 0; i < n; i++) {
            size_t k = kvb_detok_push(&d, ids[i], piece, sizeof piece);
            memcpy(text + tl, piece, k);
            tl += k;
        }
        size_t k = kvb_detok_flush(&d, piece, sizeof piece);
        memcpy(text + tl, piece, k);
        tl += k;
        if (tl != len || memcmp(text, p, len) != 0) {
            rt_fail++;
            fprintf(stderr, "%s case %d: decode(encode(x)) != x: '%.*s' -> '%.*s'\n", name, total, (int)len, p,
                    (int)tl, text);
        }
        free(text);
        free(ids);
        p = e + sl;
        line = nl + 1;
    }
    printf("%s: %d/%d cases pass (decode round trip: %d/%d)\n", name, pass, total, total - rt_fail, total);
    fflush(stdout);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
    free(inp);
    free(outp);
    return (total - pass) + rt_fail + (total == 0);
}

static void run_named(const char *name) {
    char file[256], path[1024];
    snprintf(file, sizeof file, "%s.gguf", name);
    kvbt_require_vocab(file, path, sizeof path);
    assert_int_equal(run_vectors(name, path), 0);
}

static void test_llama_spm(void **state) { (void)state; run_named("llama-spm"); }
static void test_phi3(void **state) { (void)state; run_named("phi-3"); }
static void test_gpt2(void **state) { (void)state; run_named("gpt-2"); }
static void test_deepseek_coder(void **state) { (void)state; run_named("deepseek-coder"); }

static void test_qwen2(void **state) {
    (void)state;
    char json[1024], gguf[1024];
    kvbt_require_vocab("qwen2-tokenizer.json", json, sizeof json);
    kvbt_tmp_path(gguf, sizeof gguf, "qwen2-vocab.gguf");
    write_hf_vocab(json, gguf);
    assert_int_equal(run_vectors("qwen2", gguf), 0);
}

static void test_llama_bpe(void **state) { (void)state; run_named("llama-bpe"); }

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_spm), cmocka_unit_test(test_phi3),      cmocka_unit_test(test_gpt2),
        cmocka_unit_test(test_deepseek_coder), cmocka_unit_test(test_qwen2), cmocka_unit_test(test_llama_bpe),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
