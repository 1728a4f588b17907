/* tests/test_tokenizer_spm_cut.c — the SentencePiece encoder cuts the text between two characters
 * that no mergeable token holds side by side (the pair filter, tok_internal.h) and merges each
 * piece on its own. White box: the ids must equal those of the uncut merge (the filter swapped for
 * one that says "every pair may join") on texts built from the vocabulary's own tokens, spaces,
 * newlines, multi-byte characters and invalid bytes. Vocabularies: a small one whose tokens cross
 * word starts and hold invalid and truncated UTF-8; the llama-spm and phi-3 test vocabularies;
 * the real Gemma 3 one when its file is there. A filter that cuts everywhere must change some of those ids
 * (so the comparison can fail). */
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
#include "tok_internal.h"

#define TEXTS 300
#define TEXT_CAP 3000

typedef struct {
    int32_t *ids;
    size_t n;
} ids_t;

static ids_t encode(const kvb_tokenizer *t, const char *s, size_t n) {
    ids_t r = {0};
    kvb_err err = {0};
    if (kvb_tokenize(t, s, n, false, false, &r.ids, &r.n, &err)) fail_msg("tokenize: %s", err.msg);
    return r;
}

static bool same(ids_t a, ids_t b) { return a.n == b.n && (a.n == 0 || !memcmp(a.ids, b.ids, a.n * sizeof *a.ids)); }

/* A text of the vocabulary's own pieces (so that long merges happen) and awkward characters. */
static size_t make_text(const kvb_tokenizer *t, kvb_rng *r, char *buf, size_t cap) {
    static const char *odd[] = {" ", "  ", "\n", "\n\n", "\xc3\xa9", "\xe4\xb8\xad", "\xf0\x9f\x99\x82", "\xff",
                                "\xe2\x96", "\xe2\x96\x81", "a", "the", ".", ", "};
    const uint32_t nv = kvb_tokenizer_n_vocab(t);
    size_t n = 0, want = 50 + kvb_rng_u64(r) % (cap - 100);
    while (n < want) {
        char piece[128];
        int l;
        if (kvb_rng_u64(r) % 3) {
            l = kvb_token_to_bytes(t, (int32_t)(kvb_rng_u64(r) % nv), piece, sizeof piece);
            if (l < 0) l = 0;
        } else {
            const char *o = odd[kvb_rng_u64(r) % KVB_ARRAY_LEN(odd)];
            l = (int)strlen(o);
            memcpy(piece, o, (size_t)l);
        }
        if (n + (size_t)l > cap) break;
        memcpy(buf + n, piece, (size_t)l);
        n += (size_t)l;
    }
    return n;
}

/* Every text encodes to the same ids cut as uncut; returns how many differ with cuts everywhere. */
static int check_vocab(kvb_tokenizer *t, uint64_t seed) {
    assert_non_null(t->spm_inner_pairs);
    uint64_t *built = t->spm_inner_pairs;
    uint64_t *all = malloc(KVB_SPM_PAIR_WORDS * sizeof *all), *none = calloc(KVB_SPM_PAIR_WORDS, sizeof *none);
    assert_non_null(all);
    assert_non_null(none);
    memset(all, 0xff, KVB_SPM_PAIR_WORDS * sizeof *all);
    static char text[TEXT_CAP];
    kvb_rng r;
    kvb_rng_seed(&r, seed);
    int differ_everywhere = 0;
    for (int i = 0; i < TEXTS; i++) {
        const size_t n = make_text(t, &r, text, sizeof text);
        t->spm_inner_pairs = built;
        ids_t cut = encode(t, text, n);
        t->spm_inner_pairs = all;
        ids_t whole = encode(t, text, n);
        t->spm_inner_pairs = none;
        ids_t shredded = encode(t, text, n);
        t->spm_inner_pairs = built;
        if (!same(cut, whole)) fail_msg("text %d (%zu bytes): %zu ids cut, %zu uncut", i, n, cut.n, whole.n);
        differ_everywhere += !same(shredded, whole);
        free(cut.ids);
        free(whole.ids);
        free(shredded.ids);
    }
    free(all);
    free(none);
    return differ_everywhere;
}

static kvb_tokenizer *load(const char *path, kvb_gguf **g) {
    kvb_err err = {0};
    kvb_tokenizer *t = NULL;
    if (kvb_gguf_open(path, g, &err) || kvb_tokenizer_load(*g, &t, &err)) fail_msg("%s: %s", path, err.msg);
    return t;
}

/* Tokens across word starts ("a▁b"), with invalid bytes and a truncated character. */
static void test_small_vocab_with_odd_tokens(void **state) {
    (void)state;
    kvb_gguf_str toks[] = {{"<unk>", 5}, {"a", 1}, {"b", 1}, {"\xe2\x96\x81", 3}, {"\xe2\x96\x81" "a", 4},
                           {"a\xe2\x96\x81", 4}, {"a\xe2\x96\x81" "b", 5}, {"\xff", 1}, {"a\xff", 2},
                           {"\xff\xe2\x96", 3}, {"\xe2\x96", 2}, {"\n", 1}, {"\n\n", 2}, {"\xc3\xa9", 2},
                           {"b\xc3\xa9", 3}, {"t", 1}, {"h", 1}, {"e", 1}, {"th", 2}, {"the", 3},
                           {"\xe2\x96\x81the", 6}, {".", 1}, {",", 1}, {".\n", 2}};
    float sc[KVB_ARRAY_LEN(toks)];
    int32_t ty[KVB_ARRAY_LEN(toks)];
    for (size_t i = 0; i < KVB_ARRAY_LEN(toks); i++) {
        sc[i] = -(float)(i % 7);
        ty[i] = i ? 1 : 2;
    }
    kvb_err err = {0};
    kvb_gguf_writer *w = NULL;
    assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_str(w, "general.architecture", "llama", &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "llama", &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", toks, KVB_ARRAY_LEN(toks), &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, ty, KVB_ARRAY_LEN(ty), &err),
                     KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVB_GGUF_F32, sc, KVB_ARRAY_LEN(sc), &err),
                     KVB_OK);
    char path[512];
    kvbt_tmp_path(path, sizeof path, "spm_cut.gguf");
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(kvb_gguf_writer_write_header(w, f, &err), KVB_OK);
    fclose(f);
    kvb_gguf_writer_destroy(w);
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = load(path, &g);
    assert_true(check_vocab(t, 11) > 0);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
}

static void check_file(const char *path, uint64_t seed) {
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = load(path, &g);
    assert_true(check_vocab(t, seed) > 0);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
}

static void test_llama_spm_and_phi3(void **state) {
    (void)state;
    static const char *names[] = {"llama-spm.gguf", "phi-3.gguf"};
    char paths[KVB_ARRAY_LEN(names)][1024];
    for (size_t i = 0; i < KVB_ARRAY_LEN(names); i++) kvbt_require_vocab(names[i], paths[i], sizeof paths[i]);
    for (size_t i = 0; i < KVB_ARRAY_LEN(names); i++) check_file(paths[i], 100 + i);
}

static void test_gemma3_vocabulary(void **state) {
    (void)state;
    const char *path = kvbt_gemma3_path();
    if (!path) kvbt_skip("no Gemma 3 270M file (KVB_GEMMA3_GGUF; tools/fetch_gemma3.sh fetches it into the cache)");
    check_file(path, 7);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_vocab_with_odd_tokens),
        cmocka_unit_test(test_llama_spm_and_phi3),
        cmocka_unit_test(test_gemma3_vocabulary),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
