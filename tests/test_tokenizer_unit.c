/* tests/test_tokenizer_unit.c — the tokenizer module apart from the vector and Qwen tests:
 *  - hostile vocabularies: GGUFs with missing, mistyped, mis-sized or out-of-range tokenizer keys
 *    fail to load with the right status (never crash); odd but legal ones load and encode;
 *  - the byte-level vocabulary gen-model writes (ids, BOS, special tokens, chat template,
 *    padding), NFC and U+FFFD handling, the streaming decoder, kvb_token_to_bytes;
 *  - SentencePiece rules on the llama-spm / phi-3 test vocabularies (BOS, special tokens,
 *    user-defined tokens, leading space), copying a vocabulary from a GGUF (with padding);
 *  - decode(encode(x)) == x on random valid UTF-8 for every vocabulary we have;
 *  - `kvbridge tokenize` (encode, --no-special, --decode, errors). */
#include <math.h>
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

/* ---- helpers ----------------------------------------------------------------------------------- */

typedef kvb_status (*add_fn)(kvb_gguf_writer *w, kvb_err *err);

static void write_gguf(const char *path, add_fn fn, uint32_t pad_bytelevel, bool bytelevel) {
    kvb_err err = {0};
    kvb_gguf_writer *w = NULL;
    assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_str(w, "general.architecture", "llama", &err), KVB_OK);
    if (bytelevel) {
        uint32_t n = 0;
        assert_int_equal(kvb_vocab_write_bytelevel(w, pad_bytelevel, &n, &err), KVB_OK);
    }
    if (fn) {
        kvb_status st = fn(w, &err);
        if (st) fail_msg("building the test GGUF: %s", err.msg);
    }
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(kvb_gguf_writer_write_header(w, f, &err), KVB_OK);
    fclose(f);
    kvb_gguf_writer_destroy(w);
}

/* Loads path; returns the status (and the tokenizer in *out when OK). */
static kvb_status try_load(const char *path, kvb_gguf **g, kvb_tokenizer **out, kvb_err *err) {
    *out = NULL;
    kvb_status st = kvb_gguf_open(path, g, err);
    if (st) return st;
    st = kvb_tokenizer_load(*g, out, err);
    return st;
}

static kvb_tokenizer *load_ok(const char *path, kvb_gguf **g) {
    kvb_err err = {0};
    kvb_tokenizer *t = NULL;
    if (try_load(path, g, &t, &err)) fail_msg("%s: %s", path, err.msg);
    return t;
}

static size_t encode(const kvb_tokenizer *t, const char *s, size_t n, bool add, bool special, int32_t *out,
                     size_t cap) {
    int32_t *ids = NULL;
    size_t k = 0;
    kvb_err err = {0};
    if (kvb_tokenize(t, s, n, add, special, &ids, &k, &err)) fail_msg("tokenize: %s", err.msg);
    assert_true(k <= cap);
    if (k) memcpy(out, ids, k * sizeof *ids);
    free(ids);
    return k;
}

static size_t decode_all(const kvb_tokenizer *t, const int32_t *ids, size_t n, char *out, size_t cap, bool special) {
    kvb_detok d;
    kvb_detok_init(&d, t);
    d.show_special = special;
    char piece[1024];
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = kvb_detok_push(&d, ids[i], piece, sizeof piece);
        assert_true(m + k < cap);
        memcpy(out + m, piece, k);
        m += k;
    }
    size_t k = kvb_detok_flush(&d, piece, sizeof piece);
    assert_true(m + k < cap);
    memcpy(out + m, piece, k);
    m += k;
    out[m] = 0;
    return m;
}

/* ---- hostile vocabularies ------------------------------------------------------------------------ */

static const kvb_gguf_str TOK4[] = {{"a", 1}, {"b", 1}, {"ab", 2}, {"<s>", 3}};

#define ADD(expr)                                                                                           \
    do {                                                                                                    \
        kvb_status st_ = (expr);                                                                            \
        if (st_) return st_;                                                                                \
    } while (0)

static kvb_status k_none(kvb_gguf_writer *w, kvb_err *e) { (void)w, (void)e; return KVB_OK; }
static kvb_status k_model_u32(kvb_gguf_writer *w, kvb_err *e) { return kvb_gguf_writer_add_u32(w, "tokenizer.ggml.model", 1, e); }
static kvb_status k_model_bert(kvb_gguf_writer *w, kvb_err *e) {
    ADD(kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "bert", e));
    return kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", TOK4, 4, e);
}
static kvb_status k_no_tokens(kvb_gguf_writer *w, kvb_err *e) { return kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "llama", e); }
static kvb_status k_tokens_int(kvb_gguf_writer *w, kvb_err *e) {
    int32_t v[3] = {1, 2, 3};
    ADD(kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "llama", e));
    return kvb_gguf_writer_add_arr(w, "tokenizer.ggml.tokens", KVB_GGUF_I32, v, 3, e);
}
static kvb_status k_tokens_empty(kvb_gguf_writer *w, kvb_err *e) {
    ADD(kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "llama", e));
    return kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", NULL, 0, e);
}
static kvb_status spm4(kvb_gguf_writer *w, kvb_err *e) {
    ADD(kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "llama", e));
    return kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", TOK4, 4, e);
}
static kvb_status k_types_len(kvb_gguf_writer *w, kvb_err *e) {
    int32_t ty[3] = {1, 1, 1};
    ADD(spm4(w, e));
    return kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, ty, 3, e);
}
static kvb_status k_types_val(kvb_gguf_writer *w, kvb_err *e) {
    int32_t ty[4] = {1, 1, 42, 3};
    ADD(spm4(w, e));
    return kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, ty, 4, e);
}
static kvb_status k_types_neg(kvb_gguf_writer *w, kvb_err *e) {
    int32_t ty[4] = {1, -1, 1, 3};
    ADD(spm4(w, e));
    return kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, ty, 4, e);
}
static kvb_status k_types_str(kvb_gguf_writer *w, kvb_err *e) {
    ADD(spm4(w, e));
    return kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.token_type", TOK4, 4, e);
}
static kvb_status k_scores_int(kvb_gguf_writer *w, kvb_err *e) {
    int32_t s[4] = {0};
    ADD(spm4(w, e));
    return kvb_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVB_GGUF_I32, s, 4, e);
}
static kvb_status k_scores_len(kvb_gguf_writer *w, kvb_err *e) {
    float s[5] = {0};
    ADD(spm4(w, e));
    return kvb_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVB_GGUF_F32, s, 5, e);
}
static kvb_status k_bos_range(kvb_gguf_writer *w, kvb_err *e) {
    ADD(spm4(w, e));
    return kvb_gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", 99, e);
}
static kvb_status k_eos_str(kvb_gguf_writer *w, kvb_err *e) {
    ADD(spm4(w, e));
    return kvb_gguf_writer_add_str(w, "tokenizer.ggml.eos_token_id", "2", e);
}
static kvb_status k_bos_none(kvb_gguf_writer *w, kvb_err *e) {
    ADD(spm4(w, e));
    ADD(kvb_gguf_writer_add_i32(w, "tokenizer.ggml.bos_token_id", -1, e));
    return kvb_gguf_writer_add_i32(w, "tokenizer.ggml.eos_token_id", -7, e);
}
static kvb_status k_bos_minus1(kvb_gguf_writer *w, kvb_err *e) {
    ADD(spm4(w, e));
    return kvb_gguf_writer_add_i32(w, "tokenizer.ggml.bos_token_id", -1, e);
}
static kvb_status k_add_bos_str(kvb_gguf_writer *w, kvb_err *e) {
    ADD(spm4(w, e));
    return kvb_gguf_writer_add_str(w, "tokenizer.ggml.add_bos_token", "yes", e);
}
static kvb_status k_huge_token(kvb_gguf_writer *w, kvb_err *e) {
    static char big[70000];
    memset(big, 'x', sizeof big);
    kvb_gguf_str toks[2] = {{"a", 1}, {big, sizeof big}};
    ADD(kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "llama", e));
    return kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", toks, 2, e);
}
static kvb_status gpt2_4(kvb_gguf_writer *w, kvb_err *e) {
    ADD(kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "gpt2", e));
    return kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", TOK4, 4, e);
}
static kvb_status k_no_merges(kvb_gguf_writer *w, kvb_err *e) { return gpt2_4(w, e); }
static kvb_status k_merges_int(kvb_gguf_writer *w, kvb_err *e) {
    uint32_t m[1] = {7};
    ADD(gpt2_4(w, e));
    return kvb_gguf_writer_add_arr(w, "tokenizer.ggml.merges", KVB_GGUF_U32, m, 1, e);
}
static kvb_status k_merge_nospace(kvb_gguf_writer *w, kvb_err *e) {
    kvb_gguf_str m[1] = {{"ab", 2}};
    ADD(gpt2_4(w, e));
    return kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.merges", m, 1, e);
}
static kvb_status k_pre_unknown(kvb_gguf_writer *w, kvb_err *e) {
    kvb_gguf_str m[1] = {{"a b", 3}};
    ADD(gpt2_4(w, e));
    ADD(kvb_gguf_writer_add_str(w, "tokenizer.ggml.pre", "klingon", e));
    return kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.merges", m, 1, e);
}
/* legal but odd: merges naming missing tokens, duplicate token texts, most bytes without a
 * token, an empty token string, a merge into a token that is not in the vocabulary */
static kvb_status k_odd_gpt2(kvb_gguf_writer *w, kvb_err *e) {
    kvb_gguf_str toks[] = {{"a", 1}, {"b", 1}, {"ab", 2}, {"a", 1}, {"", 0}, {"\xc4\xa0", 2}, {"\xc4\xa0" "a", 3}};
    kvb_gguf_str m[] = {{"a b", 3}, {"x y", 3}, {"\xc4\xa0 a", 4}, {"b b", 3}, {"a  b", 4}};
    ADD(kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "gpt2", e));
    ADD(kvb_gguf_writer_add_str(w, "tokenizer.ggml.pre", "qwen2", e));
    ADD(kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", toks, KVB_ARRAY_LEN(toks), e));
    return kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.merges", m, KVB_ARRAY_LEN(m), e);
}
/* SPM with NaN/inf scores, no byte tokens and no unknown token */
static kvb_status k_odd_spm(kvb_gguf_writer *w, kvb_err *e) {
    kvb_gguf_str toks[] = {{"a", 1}, {"b", 1}, {"ab", 2}, {"\xe2\x96\x81", 3}, {"\xe2\x96\x81" "a", 4}};
    float sc[] = {0, NAN, INFINITY, -INFINITY, -1};
    ADD(kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "llama", e));
    ADD(kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", toks, KVB_ARRAY_LEN(toks), e));
    ADD(kvb_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVB_GGUF_F32, sc, KVB_ARRAY_LEN(sc), e));
    return kvb_gguf_writer_add_u32(w, "tokenizer.ggml.unknown_token_id", 4, e);
}

/* SPM with a token that spans a word start ("a▁b"): merging must cross it */
static kvb_status k_spm_span(kvb_gguf_writer *w, kvb_err *e) {
    kvb_gguf_str toks[] = {{"<unk>", 5}, {"a", 1}, {"b", 1}, {"\xe2\x96\x81", 3}, {"\xe2\x96\x81" "a", 4},
                           {"a\xe2\x96\x81", 4}, {"a\xe2\x96\x81" "b", 5}, {"\xe2\x96\x81" "a\xe2\x96\x81" "b", 8}};
    float sc[] = {0, -10, -10, -10, -3, -2, -1, -0.5f};
    int32_t ty[] = {2, 1, 1, 1, 1, 1, 1, 1};
    ADD(kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "llama", e));
    ADD(kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", toks, KVB_ARRAY_LEN(toks), e));
    ADD(kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, ty, KVB_ARRAY_LEN(ty), e));
    return kvb_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVB_GGUF_F32, sc, KVB_ARRAY_LEN(sc), e);
}

static void test_hostile_vocabularies(void **state) {
    (void)state;
    static const struct {
        const char *name;
        add_fn fn;
        kvb_status want;
    } cases[] = {
        {"no tokenizer", k_none, KVB_ERR_NOT_FOUND},
        {"model is a u32", k_model_u32, KVB_ERR_FORMAT},
        {"model bert", k_model_bert, KVB_ERR_UNSUPPORTED},
        {"no tokens", k_no_tokens, KVB_ERR_NOT_FOUND},
        {"tokens are ints", k_tokens_int, KVB_ERR_FORMAT},
        {"no token at all", k_tokens_empty, KVB_ERR_FORMAT},
        {"types too short", k_types_len, KVB_ERR_FORMAT},
        {"type 42", k_types_val, KVB_ERR_FORMAT},
        {"type -1", k_types_neg, KVB_ERR_FORMAT},
        {"types are strings", k_types_str, KVB_ERR_FORMAT},
        {"scores are ints", k_scores_int, KVB_ERR_FORMAT},
        {"scores too long", k_scores_len, KVB_ERR_FORMAT},
        {"bos out of range", k_bos_range, KVB_ERR_FORMAT},
        {"eos is a string", k_eos_str, KVB_ERR_FORMAT},
        {"bos -1, eos -7", k_bos_none, KVB_ERR_FORMAT},
        {"bos -1 (none)", k_bos_minus1, KVB_OK},
        {"add_bos is a string", k_add_bos_str, KVB_ERR_FORMAT},
        {"70000-byte token", k_huge_token, KVB_ERR_FORMAT},
        {"gpt2 without merges", k_no_merges, KVB_ERR_NOT_FOUND},
        {"merges are ints", k_merges_int, KVB_ERR_FORMAT},
        {"merge without a space", k_merge_nospace, KVB_ERR_FORMAT},
        {"unknown pre-tokenizer", k_pre_unknown, KVB_ERR_UNSUPPORTED},
        {"odd gpt2", k_odd_gpt2, KVB_OK},
        {"odd spm", k_odd_spm, KVB_OK},
        {"spm token across a word start", k_spm_span, KVB_OK},
    };
    char path[512];
    kvbt_tmp_path(path, sizeof path, "hostile.gguf");
    kvb_rng r;
    kvb_rng_seed(&r, 5);
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        write_gguf(path, cases[i].fn, 0, false);
        kvb_gguf *g = NULL;
        kvb_tokenizer *t = NULL;
        kvb_err err = {0};
        kvb_status st = try_load(path, &g, &t, &err);
        if (st != cases[i].want)
            fail_msg("%s: got %s (%s), want %s", cases[i].name, kvb_status_name(st), err.msg,
                     kvb_status_name(cases[i].want));
        if (st) {
            assert_true(strlen(err.msg) > 0);
            assert_null(t);
        } else {
            /* odd but loadable: encode and decode random bytes and the interesting strings */
            char buf[256], dec[4096];
            int32_t ids[1024];
            for (int it = 0; it < 300; it++) {
                size_t n = kvb_rng_u64(&r) % sizeof buf;
                for (size_t k = 0; k < n; k++) buf[k] = "ab <s>\xc4\xa0\xff"[kvb_rng_u64(&r) % 9];
                size_t m = encode(t, buf, n, it & 1, it & 2, ids, KVB_ARRAY_LEN(ids));
                for (size_t k = 0; k < m; k++) assert_true(ids[k] >= 0 && (uint32_t)ids[k] < kvb_tokenizer_n_vocab(t));
                decode_all(t, ids, m, dec, sizeof dec, true);
            }
            if (strcmp(cases[i].name, "spm token across a word start") == 0) {
                size_t m = encode(t, "a b", 3, false, false, ids, 8); /* ▁a▁b: a▁ (-2), a▁b (-1), ▁a▁b */
                assert_int_equal(m, 1);
                assert_int_equal(ids[0], 7);
            }
            if (strcmp(cases[i].name, "bos -1 (none)") == 0) {
                assert_int_equal(kvb_tokenizer_bos(t), -1);
                assert_false(kvb_tokenizer_add_bos(t));
            }
            if (strcmp(cases[i].name, "odd gpt2") == 0) {
                /* "a b" merges; bytes without a token vanish */
                size_t m = encode(t, "ab", 2, false, false, ids, 8);
                assert_int_equal(m, 1);
                assert_int_equal(ids[0], 2);
                m = encode(t, "zzz", 3, false, false, ids, 8);
                assert_int_equal(m, 0);
            }
            kvb_tokenizer_free(t);
        }
        kvb_gguf_close(g);
    }
}

/* ---- the byte-level vocabulary ------------------------------------------------------------------- */

static void test_bytelevel_vocab(void **state) {
    (void)state;
    char path[512];
    kvbt_tmp_path(path, sizeof path, "bytelevel.gguf");
    write_gguf(path, NULL, 0, true);
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = load_ok(path, &g);
    assert_int_equal(kvb_tokenizer_n_vocab(t), 260);
    assert_int_equal(kvb_tokenizer_bos(t), 256);
    assert_int_equal(kvb_tokenizer_eos(t), 257);
    assert_true(kvb_tokenizer_add_bos(t));
    assert_true(kvb_tokenizer_is_eog(t, 257));
    assert_true(kvb_tokenizer_is_eog(t, 259)); /* <|im_end|> */
    assert_false(kvb_tokenizer_is_eog(t, 258));
    assert_false(kvb_tokenizer_is_eog(t, 'a'));
    int32_t ids[256];
    size_t n = encode(t, "Hi \xc3\xa9", 5, true, true, ids, 256);
    const int32_t want[] = {256, 'H', 'i', ' ', 0xC3, 0xA9};
    assert_int_equal(n, 6);
    assert_memory_equal(ids, want, sizeof want);
    n = encode(t, "<|im_start|>user", 16, false, true, ids, 256);
    assert_int_equal(n, 5);
    assert_int_equal(ids[0], 258);
    n = encode(t, "<|im_start|>", 12, false, false, ids, 256); /* control text is plain text */
    assert_int_equal(n, 12);
    assert_int_equal(ids[0], '<');
    /* every byte value round-trips through kvb_token_to_bytes */
    for (int b = 0; b < 256; b++) {
        char c[4];
        assert_int_equal(kvb_token_to_bytes(t, b, c, sizeof c), 1);
        assert_int_equal((uint8_t)c[0], b);
    }
    char big[32];
    assert_int_equal(kvb_token_to_bytes(t, 258, big, 4), -12);
    assert_int_equal(kvb_token_to_bytes(t, 258, big, sizeof big), 12);
    assert_memory_equal(big, "<|im_start|>", 12);
    assert_int_equal(kvb_token_to_bytes(t, 260, big, sizeof big), 0);
    assert_int_equal(kvb_token_to_bytes(t, -1, big, sizeof big), 0);
    /* chat template */
    const kvb_gguf_kv *kv = kvb_gguf_find(g, "tokenizer.chat_template");
    assert_non_null(kv);
    char *tmpl = strndup(kv->str.ptr, kv->str.len);
    kvb_chat_family f;
    kvb_err err = {0};
    assert_int_equal(kvb_chat_family_detect(tmpl, &f, &err), KVB_OK);
    assert_int_equal(f, KVB_CHAT_CHATML);
    free(tmpl);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);

    /* padded to a real embedding size */
    write_gguf(path, NULL, 300, true);
    t = load_ok(path, &g);
    assert_int_equal(kvb_tokenizer_n_vocab(t), 300);
    assert_int_equal(kvb_tokenizer_find(t, "<|reserved_special_token_0|>", 28), 260);
    assert_int_equal(kvb_tokenizer_find(t, "<|reserved_special_token_39|>", 29), 299);
    n = encode(t, "<|reserved_special_token_5|>", 28, false, true, ids, 256);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 265);
    char dec[64];
    assert_int_equal(decode_all(t, ids, 1, dec, sizeof dec, false), 0); /* control: hidden */
    assert_int_equal(decode_all(t, ids, 1, dec, sizeof dec, true), 28);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
}

/* ---- Unicode handling ------------------------------------------------------------------------------ */

static void expect_bytes(const kvb_tokenizer *t, const char *in, size_t n, const char *want, size_t wn) {
    int32_t ids[256];
    size_t m = encode(t, in, n, false, false, ids, 256);
    char got[256];
    for (size_t i = 0; i < m; i++) {
        assert_true(ids[i] < 256);
        got[i] = (char)ids[i];
    }
    if (m != wn || memcmp(got, want, wn) != 0) {
        char hex[1024] = "";
        for (size_t i = 0; i < m; i++) snprintf(hex + strlen(hex), 8, "%02x ", (uint8_t)got[i]);
        fail_msg("encoding %zu bytes gave %zu bytes: %s", n, m, hex);
    }
}

static void test_unicode(void **state) {
    (void)state;
    char path[512];
    kvbt_tmp_path(path, sizeof path, "bytelevel-u.gguf");
    write_gguf(path, NULL, 0, true);
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = load_ok(path, &g);
    /* ill-formed UTF-8 -> U+FFFD per maximal subpart (Python: b'..'.decode('utf-8', 'replace')) */
#define FFFD "\xef\xbf\xbd"
    expect_bytes(t, "\xc0\x80", 2, FFFD FFFD, 6);
    expect_bytes(t, "\xe2\x82", 2, FFFD, 3);
    expect_bytes(t, "\xe2\x82" "A", 3, FFFD "A", 4);
    expect_bytes(t, "\xed\xa0\x80", 3, FFFD FFFD FFFD, 9);
    expect_bytes(t, "\xf0\x9f\x98", 3, FFFD, 3);
    expect_bytes(t, "\xf4\x90\x80\x80", 4, FFFD FFFD FFFD FFFD, 12);
    expect_bytes(t, "a\xffz", 3, "a" FFFD "z", 5);
    expect_bytes(t, "\0x", 2, "\0x", 2);
    /* default pre-tokenizer: no normalization */
    expect_bytes(t, "e\xcc\x81", 3, "e\xcc\x81", 3);
    /* qwen2 pre-tokenizer: NFC (values from Python's unicodedata.normalize('NFC', ...)) */
    kvb_err err = {0};
    assert_int_equal(kvb_tokenizer_set_pre(t, "qwen2", &err), KVB_OK);
    expect_bytes(t, "e\xcc\x81", 3, "\xc3\xa9", 2);                            /* e + U+0301 -> é */
    expect_bytes(t, "\xe2\x84\xab", 3, "\xc3\x85", 2);                         /* U+212B Angstrom -> Å */
    expect_bytes(t, "\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8", 9, "\xea\xb0\x81", 3); /* jamo -> 각 */
    expect_bytes(t, "a\xcc\x87\xcc\xa3", 5, "\xe1\xba\xa1\xcc\x87", 5);       /* reorder: ạ + U+0307 */
    expect_bytes(t, "\xcd\x84", 2, "\xcc\x88\xcc\x81", 4);                     /* U+0344 -> U+0308 U+0301 */
    expect_bytes(t, "\xe0\xa5\x98", 3, "\xe0\xa4\x95\xe0\xa4\xbc", 6);         /* U+0958 excluded */
    expect_bytes(t, "\xcc\x81" "e", 3, "\xcc\x81" "e", 3);                     /* leading mark */
    expect_bytes(t, "\xc0" "e\xcc\x81", 4, FFFD "\xc3\xa9", 5);
    assert_int_equal(kvb_tokenizer_set_pre(t, "no-such", &err), KVB_ERR_UNSUPPORTED);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
}

/* ---- streaming decoder ------------------------------------------------------------------------------- */

static void test_streaming_detok(void **state) {
    (void)state;
    char path[512];
    kvbt_tmp_path(path, sizeof path, "bytelevel-d.gguf");
    write_gguf(path, NULL, 0, true);
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = load_ok(path, &g);
    kvb_detok d;
    char out[64];
    /* 🦙 = F0 9F A6 99 arrives one byte per token */
    kvb_detok_init(&d, t);
    assert_int_equal(kvb_detok_push(&d, 'a', out, sizeof out), 1);
    assert_int_equal(kvb_detok_push(&d, 0xF0, out, sizeof out), 0);
    assert_int_equal(kvb_detok_push(&d, 0x9F, out, sizeof out), 0);
    assert_int_equal(kvb_detok_push(&d, 0xA6, out, sizeof out), 0);
    assert_int_equal(kvb_detok_push(&d, 0x99, out, sizeof out), 4);
    assert_string_equal(out, "\xf0\x9f\xa6\x99");
    assert_int_equal(kvb_detok_flush(&d, out, sizeof out), 0);
    /* a sequence that cannot complete comes out as it is */
    assert_int_equal(kvb_detok_push(&d, 0xE2, out, sizeof out), 0);
    assert_int_equal(kvb_detok_push(&d, 0x82, out, sizeof out), 0);
    assert_int_equal(kvb_detok_push(&d, 'x', out, sizeof out), 3);
    assert_memory_equal(out, "\xe2\x82x", 3);
    assert_int_equal(kvb_detok_push(&d, 0xC3, out, sizeof out), 0);
    assert_int_equal(kvb_detok_push(&d, 0xC3, out, sizeof out), 1); /* first C3 is stale, second held */
    assert_int_equal((uint8_t)out[0], 0xC3);
    assert_int_equal(kvb_detok_flush(&d, out, sizeof out), 1);
    assert_int_equal(kvb_detok_flush(&d, out, sizeof out), 0);
    /* control tokens hidden unless asked for */
    assert_int_equal(kvb_detok_push(&d, 256, out, sizeof out), 0);
    d.show_special = true;
    assert_int_equal(kvb_detok_push(&d, 256, out, sizeof out), 17);
    assert_string_equal(out, "<|begin_of_text|>");
    /* a small buffer cuts at a character boundary and stays NUL-terminated */
    assert_int_equal(kvb_detok_push(&d, 256, out, 5), 4);
    assert_string_equal(out, "<|be");
    assert_int_equal(kvb_detok_push(&d, 'q', out, 0), 0);
    assert_int_equal(kvb_detok_push(&d, 99999, out, sizeof out), 0);
    assert_int_equal(kvb_detok_push(&d, -5, out, sizeof out), 0);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
}

/* ---- SentencePiece rules on the test vocabularies ----------------------------------------------------- */

static void test_spm_rules(void **state) {
    (void)state;
    char p1[1024], p2[1024];
    kvbt_require_vocab("llama-spm.gguf", p1, sizeof p1);
    kvbt_require_vocab("phi-3.gguf", p2, sizeof p2);
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = load_ok(p1, &g);
    assert_true(kvb_tokenizer_is_spm(t));
    assert_int_equal(kvb_tokenizer_bos(t), 1);
    assert_int_equal(kvb_tokenizer_eos(t), 2);
    assert_true(kvb_tokenizer_add_bos(t));
    int32_t ids[64], ids2[64];
    /* BOS, then "▁Hello" "▁world" */
    size_t n = encode(t, "Hello world", 11, true, false, ids, 64);
    assert_true(n == 3 && ids[0] == 1);
    size_t n2 = encode(t, "Hello world", 11, false, false, ids2, 64);
    assert_true(n2 == 2 && ids2[0] == ids[1] && ids2[1] == ids[2]);
    /* "<s>" is BOS only with parse_special; text after a special token gets the space prefix */
    n = encode(t, "<s>Hello world", 14, false, true, ids, 64);
    assert_true(n == 3 && ids[0] == 1 && ids[1] == ids2[0] && ids[2] == ids2[1]);
    n = encode(t, "<s>", 3, false, false, ids, 64);
    assert_true(n > 1);
    for (size_t i = 0; i < n; i++) assert_true(ids[i] != 1);
    /* byte fallback: a character with no piece becomes <0xXX> tokens and decodes back */
    n = encode(t, "\xf0\x9f\xa6\x99", 4, false, false, ids, 64);
    char dec[256];
    assert_int_equal(decode_all(t, ids, n, dec, sizeof dec, false), 4);
    assert_string_equal(dec, "\xf0\x9f\xa6\x99");
    /* with BOS the decoder hides it and still strips the prefix space */
    n = encode(t, "  two spaces", 12, true, false, ids, 64);
    decode_all(t, ids, n, dec, sizeof dec, false);
    assert_string_equal(dec, "  two spaces");
    decode_all(t, ids, n, dec, sizeof dec, true);
    assert_string_equal(dec, "<s>  two spaces");
    /* invalid bytes encode through byte fallback and come back unchanged */
    n = encode(t, "a\xff\xc3(", 4, false, false, ids, 64);
    assert_int_equal(decode_all(t, ids, n, dec, sizeof dec, false), 4);
    assert_memory_equal(dec, "a\xff\xc3(", 4);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);

    /* phi-3: "</s>" is a user-defined token (always matched); <|user|> is control */
    t = load_ok(p2, &g);
    n = encode(t, "a</s>b", 6, false, false, ids, 64);
    bool found = false;
    for (size_t i = 0; i < n; i++) found |= ids[i] == 2;
    assert_true(found);
    n = encode(t, "<|user|>", 8, false, true, ids, 64);
    assert_true(n == 1 && ids[0] == 32010);
    n = encode(t, "<|user|>", 8, false, false, ids, 64);
    assert_true(n > 1);
    assert_true(kvb_tokenizer_is_eog(t, 32007)); /* <|end|> */
    assert_true(kvb_tokenizer_is_eog(t, 32000)); /* <|endoftext|> = eos */
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
}

/* ---- copying a vocabulary -------------------------------------------------------------------------------- */

static const char *g_copy_src;
static uint32_t g_copy_pad;
static kvb_status k_copy(kvb_gguf_writer *w, kvb_err *e) {
    uint32_t n = 0;
    return kvb_vocab_copy_from_gguf(w, g_copy_src, g_copy_pad, &n, e);
}

static void test_copy_vocab(void **state) {
    (void)state;
    char src[1024], dst[512];
    kvbt_require_vocab("llama-spm.gguf", src, sizeof src);
    kvbt_tmp_path(dst, sizeof dst, "copied.gguf");
    g_copy_src = src;
    static const char text[] = "Copying keeps every id: ünïcödé, 🦙 and <s> too.";
    int32_t a[256], b[256];
    kvb_gguf *g0 = NULL, *g = NULL;
    kvb_tokenizer *t0 = load_ok(src, &g0);
    size_t na = encode(t0, text, strlen(text), true, true, a, 256);
    for (int pad = 0; pad < 2; pad++) {
        g_copy_pad = pad ? 32100 : 0;
        write_gguf(dst, k_copy, 0, false);
        kvb_tokenizer *t = load_ok(dst, &g);
        assert_int_equal(kvb_tokenizer_n_vocab(t), pad ? 32100 : 32000);
        size_t nb = encode(t, text, strlen(text), true, true, b, 256);
        assert_int_equal(na, nb);
        assert_memory_equal(a, b, na * sizeof *a);
        if (pad) assert_int_equal(kvb_tokenizer_find(t, "<|reserved_special_token_0|>", 28), 32000);
        kvb_tokenizer_free(t);
        kvb_gguf_close(g);
    }
    kvb_tokenizer_free(t0);
    kvb_gguf_close(g0);
    /* a missing file is a clear error */
    kvb_gguf_writer *w = NULL;
    kvb_err err = {0};
    uint32_t n = 0;
    assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
    assert_int_not_equal(kvb_vocab_copy_from_gguf(w, "/nonexistent/x.gguf", 0, &n, &err), KVB_OK);
    assert_int_equal(kvb_vocab_from_hf_json(w, "/nonexistent/tokenizer.json", 0, &n, &err), KVB_ERR_IO);
    kvb_gguf_writer_destroy(w);
}

static void test_hf_json_errors(void **state) {
    (void)state;
    static const char *const bad[] = {
        "{not json",
        "{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, \"pre_tokenizer\": {\"type\": "
        "\"Whitespace\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -1}, \"merges\": []}, \"pre_tokenizer\": {\"type\": "
        "\"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 0}, \"merges\": []}, \"pre_tokenizer\": {\"type\": "
        "\"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [3]}, \"pre_tokenizer\": {\"type\": "
        "\"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 1e9}, \"merges\": []}, \"pre_tokenizer\": {\"type\": "
        "\"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, \"added_tokens\": [{\"id\": \"x\"}], "
        "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, \"normalizer\": {\"type\": "
        "\"Lowercase\"}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}",
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, \"pre_tokenizer\": {\"type\": "
        "\"ByteLevel\", \"add_prefix_space\": true}}",
    };
    static const char good[] =
        "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [[\"a\", \"b\"]]},"
        " \"added_tokens\": [{\"id\": 5, \"content\": \"<|x|>\", \"special\": true}],"
        " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"use_regex\": true}}";
    char path[512], gg[512];
    kvbt_tmp_path(path, sizeof path, "t-tokenizer.json");
    kvbt_tmp_path(gg, sizeof gg, "t.gguf");
    for (size_t i = 0; i <= KVB_ARRAY_LEN(bad); i++) {
        const char *s = i < KVB_ARRAY_LEN(bad) ? bad[i] : good;
        FILE *f = fopen(path, "wb");
        fputs(s, f);
        fclose(f);
        kvb_gguf_writer *w = NULL;
        kvb_err err = {0};
        uint32_t n = 0;
        assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
        kvb_status st = kvb_vocab_from_hf_json(w, path, 0, &n, &err);
        if (i < KVB_ARRAY_LEN(bad)) {
            if (st == KVB_OK) fail_msg("bad tokenizer.json %zu was accepted", i);
            assert_true(strlen(err.msg) > 0);
        } else {
            if (st) fail_msg("good tokenizer.json: %s", err.msg);
            assert_int_equal(n, 6); /* ids 3, 4 become [PAD3], [PAD4] */
            FILE *o = fopen(gg, "wb");
            assert_int_equal(kvb_gguf_writer_write_header(w, o, &err), KVB_OK);
            fclose(o);
            kvb_gguf *g = NULL;
            kvb_tokenizer *t = load_ok(gg, &g);
            assert_string_equal(kvb_tokenizer_pre_name(t), "gpt-2");
            assert_int_equal(kvb_tokenizer_find(t, "[PAD3]", 6), 3);
            int32_t ids[8];
            assert_int_equal(encode(t, "ab<|x|>", 7, false, true, ids, 8), 2);
            assert_true(ids[0] == 2 && ids[1] == 5);
            kvb_tokenizer_free(t);
            kvb_gguf_close(g);
        }
        kvb_gguf_writer_destroy(w);
    }
}

/* ---- round trip on every vocabulary ---------------------------------------------------------------------- */

static size_t put_cp(uint32_t cp, char *o) {
    if (cp < 0x80) return o[0] = (char)cp, 1;
    if (cp < 0x800) return o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 63)), 2;
    if (cp < 0x10000)
        return o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | (cp >> 6 & 63)), o[2] = (char)(0x80 | (cp & 63)), 3;
    o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | (cp >> 12 & 63)), o[2] = (char)(0x80 | (cp >> 6 & 63)),
    o[3] = (char)(0x80 | (cp & 63));
    return 4;
}

static uint32_t rand_cp(kvb_rng *r) {
    static const uint32_t common[] = {' ', ' ', '\n', '\t', 'e', 'a', '\'', '1', '.', 0xE9, 0x4E2D, 0x1F600};
    for (;;) {
        uint64_t k = kvb_rng_u64(r) % 10;
        uint32_t cp = k < 3   ? common[kvb_rng_u64(r) % KVB_ARRAY_LEN(common)]
                      : k < 6 ? 0x20 + (uint32_t)(kvb_rng_u64(r) % 0x5F)
                      : k < 8 ? (uint32_t)(kvb_rng_u64(r) % 0x3000)
                              : (uint32_t)(kvb_rng_u64(r) % 0x110000);
        if (cp >= 0xD800 && cp <= 0xDFFF) continue;
        if (cp == '<') continue;    /* keep clear of special-token text ("</s>" is a user token) */
        if (cp == 0x2581) continue; /* SentencePiece's space mark decodes as ' ' by design */
        return cp;
    }
}

static void roundtrip(const char *name, const char *path) {
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = load_ok(path, &g);
    kvb_rng r;
    kvb_rng_seed(&r, 99);
    char buf[2048], dec[8192];
    int32_t ids[2048];
    int ok = 0, total = 1500;
    for (int it = 0; it < total; it++) {
        size_t n = 0, len = kvb_rng_u64(&r) % 120;
        for (size_t i = 0; i < len; i++) n += put_cp(rand_cp(&r), buf + n);
        size_t m = encode(t, buf, n, it & 1, false, ids, KVB_ARRAY_LEN(ids));
        size_t k = decode_all(t, ids, m, dec, sizeof dec, false);
        if (k == n && memcmp(dec, buf, n) == 0) ok++;
        else if (ok + 5 > it) fprintf(stderr, "%s: round trip failed for '%.*s' -> '%s'\n", name, (int)n, buf, dec);
    }
    printf("%s: decode(encode(x)) == x for %d/%d random valid UTF-8 strings\n", name, ok, total);
    assert_int_equal(ok, total);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
}

static void test_roundtrip_bytelevel(void **state) {
    (void)state;
    char path[1024];
    kvbt_tmp_path(path, sizeof path, "bytelevel-rt.gguf");
    write_gguf(path, NULL, 0, true);
    roundtrip("bytelevel", path);
}

static void test_roundtrip_vocabularies(void **state) {
    (void)state;
    static const char *const names[] = {"llama-spm.gguf", "phi-3.gguf", "gpt-2.gguf", "deepseek-coder.gguf"};
    char paths[KVB_ARRAY_LEN(names)][1024];
    for (size_t i = 0; i < KVB_ARRAY_LEN(names); i++) kvbt_require_vocab(names[i], paths[i], sizeof paths[i]);
    for (size_t i = 0; i < KVB_ARRAY_LEN(names); i++) roundtrip(names[i], paths[i]);
}

/* ---- the command line ---------------------------------------------------------------------------------------- */

static void test_cli_tokenize(void **state) {
    (void)state;
    char model[512], cmd[2048], out[4096];
    kvbt_tmp_path(model, sizeof model, "bytelevel-cli.gguf");
    write_gguf(model, NULL, 0, true);
    const char *bin = kvbt_bin();
    snprintf(cmd, sizeof cmd, "printf 'Hi<|im_end|>' | '%s' tokenize -m '%s'", bin, model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_string_equal(out, "256 72 105 259\n");
    snprintf(cmd, sizeof cmd, "printf 'Hi' | '%s' tokenize -m '%s' --no-special", bin, model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_string_equal(out, "72 105\n");
    snprintf(cmd, sizeof cmd, "printf '' | '%s' tokenize -m '%s' --no-special", bin, model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_string_equal(out, "\n");
    snprintf(cmd, sizeof cmd, "echo '256 72, 105\n259' | '%s' tokenize -m '%s' --decode", bin, model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_string_equal(out, "<|begin_of_text|>Hi<|im_end|>");
    snprintf(cmd, sizeof cmd, "echo '256 72 105 259' | '%s' tokenize -m '%s' --decode --no-special", bin, model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_string_equal(out, "Hi");
    snprintf(cmd, sizeof cmd, "echo '72 9999' | '%s' tokenize -m '%s' --decode", bin, model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 2);
    assert_non_null(strstr(out, "outside the vocabulary"));
    snprintf(cmd, sizeof cmd, "echo '72 x' | '%s' tokenize -m '%s' --decode", bin, model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 2);
    assert_non_null(strstr(out, "expects token ids"));
    snprintf(cmd, sizeof cmd, "'%s' tokenize --help", bin);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    assert_non_null(strstr(out, "--decode"));
    snprintf(cmd, sizeof cmd, "'%s' tokenize < /dev/null", bin);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 2);
    assert_non_null(strstr(out, "-m MODEL"));
    snprintf(cmd, sizeof cmd, "'%s' tokenize -m '%s' --frobnicate < /dev/null", bin, model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 2);
    snprintf(cmd, sizeof cmd, "'%s' tokenize -m /nonexistent.gguf < /dev/null", bin);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 1);
    assert_non_null(strstr(out, "nonexistent"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hostile_vocabularies), cmocka_unit_test(test_bytelevel_vocab),
        cmocka_unit_test(test_unicode),              cmocka_unit_test(test_streaming_detok),
        cmocka_unit_test(test_spm_rules),            cmocka_unit_test(test_copy_vocab),
        cmocka_unit_test(test_hf_json_errors),       cmocka_unit_test(test_roundtrip_bytelevel),
        cmocka_unit_test(test_roundtrip_vocabularies),
        cmocka_unit_test(test_cli_tokenize),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
