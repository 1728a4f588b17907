/* tests/test_tokenizer_qwen.c — Qwen's real vocabulary (qwen2-tokenizer.json + its
 * tokenizer_config.json in the test vocabularies, kvbt_vocab_file()) converted into a GGUF by
 * kvb_vocab_from_hf_json and loaded back:
 *  - cross-check against Hugging Face `tokenizers` on >= 10,000 generated strings (code,
 *    whitespace runs, numbers, Unicode incl. NFC cases, emoji, CJK, invalid UTF-8), produced by
 *    tools/tokenizer_crosscheck.py in the repo's .venv (skips when .venv/bin/python is absent);
 *    the same strings are also checked under the llama-bpe, gpt-2 and deepseek-coder
 *    pre-tokenizers on this vocabulary (references from the same script);
 *  - the converted file carries the real chat template, which is detected as chatml;
 *  - decode(encode(x)) == x on random NFC text; the encoder survives random bytes;
 *  - encode speed on English prose, printed (not asserted), with HF's for comparison when the
 *    venv is there;
 *  - `kvbridge gen-model --vocab qwen2-tokenizer.json` then `kvbridge run -p Hello` end to end. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kvb_gguf.h"
#include "kvb_tokenizer.h"
#include "kvbt.h"

static char g_json[1024], g_gguf[1024];
static bool g_have_data;

static bool exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

/* The setup converts the tokenizer.json when it is there; each case then needs it (need_data). */
static int setup(void **state) {
    (void)state;
    if (!kvbt_vocab_file("qwen2-tokenizer.json", g_json, sizeof g_json)) return 0;
    kvbt_tmp_path(g_gguf, sizeof g_gguf, "qwen-vocab.gguf");
    kvb_err err = {0};
    kvb_gguf_writer *w = NULL;
    uint32_t n = 0;
    if (kvb_gguf_writer_create(&w, &err) || kvb_vocab_from_hf_json(w, g_json, 0, &n, &err) ||
        kvb_gguf_writer_add_str(w, "general.architecture", "qwen3", &err)) {
        fprintf(stderr, "converting %s: %s\n", g_json, err.msg);
        kvb_gguf_writer_destroy(w);
        return -1;
    }
    FILE *f = fopen(g_gguf, "wb");
    kvb_status st = f ? kvb_gguf_writer_write_header(w, f, &err) : KVB_ERR_IO;
    if (f) fclose(f);
    kvb_gguf_writer_destroy(w);
    if (st) {
        fprintf(stderr, "writing %s: %s\n", g_gguf, err.msg);
        return -1;
    }
    printf("converted %s: %u tokens\n", g_json, n);
    g_have_data = true;
    return 0;
}

static void need_data(void) {
    char path[1024];
    if (!g_have_data) kvbt_require_vocab("qwen2-tokenizer.json", path, sizeof path);
}

static void load(kvb_gguf **g, kvb_tokenizer **t) {
    kvb_err err = {0};
    if (kvb_gguf_open(g_gguf, g, &err) || kvb_tokenizer_load(*g, t, &err)) fail_msg("%s", err.msg);
}

static const char *venv_python(char *buf, size_t cap) {
    const char *src = getenv("KVB_SOURCE_DIR");
    if (!src) return NULL;
    snprintf(buf, cap, "%s/.venv/bin/python", src);
    return exists(buf) ? buf : NULL;
}

static int hexval(char c) { return c <= '9' ? c - '0' : (c | 32) - 'a' + 10; }

/* ---- cross-check against Hugging Face ------------------------------------------------------------ */

static void test_crosscheck_hf(void **state) {
    (void)state;
    need_data();
    char py[1024], ref[1024], cmd[4096], out[8192];
    if (!venv_python(py, sizeof py))
        kvbt_skip("no venv: no .venv/bin/python in the source tree (tools/install.sh makes it)");
    kvbt_tmp_path(ref, sizeof ref, "hf-ref.tsv");
    snprintf(cmd, sizeof cmd, "'%s' '%s/tools/tokenizer_crosscheck.py' --tokenizer '%s' --out '%s' --n 12000", py,
             getenv("KVB_SOURCE_DIR"), g_json, ref);
    int rc = kvbt_sh(cmd, out, sizeof out, 1);
    if (rc == 77) kvbt_skip("no venv package: %s", out);
    if (rc != 0) fail_msg("tokenizer_crosscheck.py failed (%d): %s", rc, out);

    kvb_gguf *g = NULL;
    kvb_tokenizer *t = NULL;
    load(&g, &t);
    FILE *f = fopen(ref, "r");
    assert_non_null(f);
    size_t cap = 1 << 20;
    char *line = malloc(cap);
    uint8_t *bytes = malloc(cap);
    int32_t *want = malloc(cap * sizeof *want);
    char cur[32] = "";
    int n_case = 0, n_pass = 0, failures = 0, shown = 0;
    kvb_err err = {0};
    for (;;) {
        char *l = fgets(line, (int)cap, f);
        char variant[32] = "";
        if (l) {
            char *tab = strchr(line, '\t');
            assert_non_null(tab);
            snprintf(variant, sizeof variant, "%.*s", (int)(tab - line), line);
        }
        if (!l || strcmp(variant, cur) != 0) {
            if (cur[0]) {
                printf("crosscheck %s (Qwen vocabulary): %d/%d strings match Hugging Face tokenizers\n", cur, n_pass,
                       n_case);
                fflush(stdout);
                failures += n_case - n_pass;
                if (n_case < 10000) failures++;
            }
            if (!l) break;
            snprintf(cur, sizeof cur, "%s", variant);
            n_case = n_pass = 0;
            assert_int_equal(kvb_tokenizer_set_pre(t, cur, &err), KVB_OK);
        }
        char *hex = strchr(line, '\t') + 1;
        char *ids_s = strchr(hex, '\t');
        assert_non_null(ids_s);
        size_t nb = (size_t)(ids_s - hex) / 2;
        for (size_t i = 0; i < nb; i++) bytes[i] = (uint8_t)(hexval(hex[2 * i]) * 16 + hexval(hex[2 * i + 1]));
        size_t nw = 0;
        for (char *q = ids_s + 1; *q && *q != '\n';) {
            while (*q == ' ') q++;
            if (!*q || *q == '\n') break;
            want[nw++] = (int32_t)strtol(q, &q, 10);
        }
        int32_t *ids = NULL;
        size_t n = 0;
        assert_int_equal(kvb_tokenize(t, (const char *)bytes, nb, false, true, &ids, &n, &err), KVB_OK);
        n_case++;
        if (n == nw && (n == 0 || memcmp(ids, want, n * sizeof *ids) == 0)) {
            n_pass++;
        } else if (shown++ < 12) {
            fprintf(stderr, "[%s] mismatch for bytes %.*s\n  hf: ", cur, (int)(2 * nb), hex);
            for (size_t i = 0; i < nw && i < 40; i++) fprintf(stderr, " %d", want[i]);
            fprintf(stderr, "\n  us: ");
            for (size_t i = 0; i < n && i < 40; i++) fprintf(stderr, " %d", ids[i]);
            fprintf(stderr, "\n");
        }
        free(ids);
    }
    fclose(f);
    free(line);
    free(bytes);
    free(want);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
    assert_int_equal(failures, 0);
}

/* ---- the converted file ---------------------------------------------------------------------------- */

static void test_converted_keys(void **state) {
    (void)state;
    need_data();
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = NULL;
    load(&g, &t);
    assert_int_equal(kvb_tokenizer_n_vocab(t), 151669);
    assert_string_equal(kvb_tokenizer_pre_name(t), "qwen2");
    assert_int_equal(kvb_tokenizer_bos(t), -1);
    assert_false(kvb_tokenizer_add_bos(t));
    int32_t im_end = kvb_tokenizer_find(t, "<|im_end|>", 10), eot = kvb_tokenizer_find(t, "<|endoftext|>", 13);
    assert_int_equal(im_end, 151645);
    assert_int_equal(kvb_tokenizer_eos(t), im_end); /* eos_token of tokenizer_config.json */
    assert_true(kvb_tokenizer_is_eog(t, im_end));
    assert_true(kvb_tokenizer_is_eog(t, eot));
    assert_false(kvb_tokenizer_is_eog(t, 9707));
    const kvb_gguf_kv *kv = kvb_gguf_find(g, "tokenizer.chat_template");
    assert_non_null(kv);
    char *tmpl = strndup(kv->str.ptr, kv->str.len);
    kvb_chat_family f;
    kvb_err err = {0};
    assert_int_equal(kvb_chat_family_detect(tmpl, &f, &err), KVB_OK);
    assert_int_equal(f, KVB_CHAT_CHATML);
    free(tmpl);
    /* a rendered chat tokenizes with the special tokens recognised */
    kvb_chat_msg msgs[] = {{"user", "Hello"}};
    char *text = NULL;
    assert_int_equal(kvb_chat_render(f, msgs, 1, true, &text, &err), KVB_OK);
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(kvb_tokenize(t, text, strlen(text), true, true, &ids, &n, &err), KVB_OK);
    /* <|im_start|> user \n Hello <|im_end|> \n <|im_start|> assistant \n */
    const int32_t want[] = {151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198};
    assert_int_equal(n, KVB_ARRAY_LEN(want));
    assert_memory_equal(ids, want, sizeof want);
    free(ids);
    /* with parse_special off the markers are plain text */
    assert_int_equal(kvb_tokenize(t, text, strlen(text), false, false, &ids, &n, &err), KVB_OK);
    for (size_t i = 0; i < n; i++) assert_true(ids[i] < 151643);
    free(ids);
    free(text);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
}

/* ---- round trip and hostile bytes ---------------------------------------------------------------- */

static size_t put_cp(uint32_t cp, char *o) {
    if (cp < 0x80) return o[0] = (char)cp, 1;
    if (cp < 0x800) return o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 63)), 2;
    if (cp < 0x10000)
        return o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | (cp >> 6 & 63)), o[2] = (char)(0x80 | (cp & 63)), 3;
    o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | (cp >> 12 & 63)), o[2] = (char)(0x80 | (cp >> 6 & 63)),
    o[3] = (char)(0x80 | (cp & 63));
    return 4;
}

static void test_roundtrip_and_garbage(void **state) {
    (void)state;
    need_data();
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = NULL;
    load(&g, &t);
    kvb_rng r;
    kvb_rng_seed(&r, 7);
    /* NFC-stable ranges: ASCII, Latin-1 letters, Cyrillic, CJK, Hangul syllables, emoji */
    static const uint32_t ranges[][2] = {{0x20, 0x7E}, {0x09, 0x0D}, {0xC0, 0xFF}, {0x410, 0x44F},
                                         {0x4E00, 0x9FFF}, {0xAC00, 0xD7A3}, {0x1F600, 0x1F64F}, {0x3000, 0x3003}};
    char *buf = malloc(8192), *dec = malloc(8192 + 64), piece[1024];
    kvb_err err = {0};
    int bad = 0;
    for (int it = 0; it < 2000; it++) {
        size_t n = 0, len = kvb_rng_u64(&r) % 200;
        for (size_t i = 0; i < len; i++) {
            size_t k = kvb_rng_u64(&r) % KVB_ARRAY_LEN(ranges);
            uint32_t cp = ranges[k][0] + (uint32_t)(kvb_rng_u64(&r) % (ranges[k][1] - ranges[k][0] + 1));
            n += put_cp(cp, buf + n);
        }
        int32_t *ids = NULL;
        size_t ni = 0;
        assert_int_equal(kvb_tokenize(t, buf, n, false, false, &ids, &ni, &err), KVB_OK);
        kvb_detok d;
        kvb_detok_init(&d, t);
        size_t m = 0;
        for (size_t i = 0; i < ni; i++) {
            size_t k = kvb_detok_push(&d, ids[i], piece, sizeof piece);
            memcpy(dec + m, piece, k);
            m += k;
        }
        m += kvb_detok_flush(&d, dec + m, 64);
        if (m != n || memcmp(dec, buf, n) != 0) bad++;
        free(ids);
    }
    printf("qwen2 round trip: %d/2000 random NFC strings decode back exactly\n", 2000 - bad);
    assert_int_equal(bad, 0);
    /* random bytes: no crash, every id in range */
    for (int it = 0; it < 2000; it++) {
        size_t len = kvb_rng_u64(&r) % 300;
        for (size_t i = 0; i < len; i++) buf[i] = (char)kvb_rng_u64(&r);
        int32_t *ids = NULL;
        size_t ni = 0;
        assert_int_equal(kvb_tokenize(t, buf, len, it & 1, it & 2, &ids, &ni, &err), KVB_OK);
        for (size_t i = 0; i < ni; i++) assert_true(ids[i] >= 0 && (uint32_t)ids[i] < kvb_tokenizer_n_vocab(t));
        free(ids);
    }
    free(buf);
    free(dec);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
}

/* ---- speed ------------------------------------------------------------------------------------------- */

static const char *const prose[] = {
    "The committee met on a grey Tuesday morning to decide what should be done about the old bridge. ",
    "Nobody could remember when it had last been painted, and the river beneath it had risen twice that spring. ",
    "\"We cannot simply close it,\" said the chairwoman, tapping her pen against the table. ",
    "Half the town crosses it every day, and the nearest alternative is eleven miles upstream. ",
    "The engineer, a quiet man who had driven in from the city, unrolled a set of drawings. ",
    "He explained that the supports were sound but the deck would need to be replaced within five years. ",
    "It was not the answer anyone wanted, although it was better than the rumours had suggested. ",
    "After an hour of discussion they agreed to ask the county for funds and to publish the report in full. ",
    "Outside, the rain had stopped; children were already running across the bridge toward the school. ",
    "Later that week the local paper printed the drawings, and letters began to arrive from every street. ",
    "Some writers were angry, others were simply curious, and a few offered to help with the painting. ",
    "By the end of the month a small group of volunteers had formed, calling themselves the Friends of the Bridge.\n\n",
    "History, of course, is rarely so tidy. Records from 1874 show that a ferry operated here for decades, ",
    "carrying farmers, their animals, and on one famous occasion a piano bound for the new music hall. ",
    "The ferryman's diary, now kept in the library, describes floods, fog, and the long winter of 1881. ",
    "It's a remarkable document: practical, funny, and occasionally heartbreaking in its plain honesty.\n\n",
};

static void test_encode_speed(void **state) {
    (void)state;
    need_data();
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = NULL;
    load(&g, &t);
#if defined(__SANITIZE_ADDRESS__)
    size_t target = 1u << 20, n = 0; /* sanitizer builds: the number means little, keep it short */
#else
    size_t target = 8u << 20, n = 0;
#endif
    char *text = malloc(target + 4096);
    kvb_rng r;
    kvb_rng_seed(&r, 11);
    while (n < target) {
        const char *s = prose[kvb_rng_u64(&r) % KVB_ARRAY_LEN(prose)];
        size_t l = strlen(s);
        memcpy(text + n, s, l);
        n += l;
    }
    kvb_err err = {0};
    int32_t *ids = NULL;
    size_t ni = 0;
    double best = 1e9;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = kvb_now_s();
        assert_int_equal(kvb_tokenize(t, text, n, false, false, &ids, &ni, &err), KVB_OK);
        double dt = kvb_now_s() - t0;
        if (dt < best) best = dt;
        free(ids);
    }
    /* the same text in request-sized calls (4 KiB each: no cache reuse across calls) */
    double t0 = kvb_now_s();
    for (size_t off = 0; off < n; off += 4096) {
        assert_int_equal(kvb_tokenize(t, text + off, KVB_MIN((size_t)4096, n - off), false, false, &ids, &ni, &err),
                         KVB_OK);
        free(ids);
    }
    double dt4k = kvb_now_s() - t0;
    printf("encode speed (Qwen vocabulary, English prose, one core): %.1f MB/s in one call of %.1f MB; "
           "%.1f MB/s in 4 KiB calls\n",
           n / best / 1e6, n / 1e6, n / dt4k / 1e6);
    char py[1024], path[1024], cmd[4096], out[4096];
    if (venv_python(py, sizeof py)) {
        kvbt_tmp_path(path, sizeof path, "prose.txt");
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        size_t hf_n = KVB_MIN(n, (size_t)2 << 20);
        assert_int_equal(fwrite(text, 1, hf_n, f), hf_n);
        fclose(f);
        snprintf(cmd, sizeof cmd, "'%s' '%s/tools/tokenizer_crosscheck.py' --tokenizer '%s' --bench '%s'", py,
                 getenv("KVB_SOURCE_DIR"), g_json, path);
        if (kvbt_sh(cmd, out, sizeof out, 1) == 0) printf("for comparison, %s", out);
    }
    fflush(stdout);
    free(text);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
}

/* ---- end to end --------------------------------------------------------------------------------------- */

static void test_gen_model_and_run(void **state) {
    (void)state;
    need_data();
    char model[1024], cmd[4096], out[16384];
    kvbt_tmp_path(model, sizeof model, "tiny-qwen3-qwenvocab.gguf");
    snprintf(cmd, sizeof cmd, "'%s' gen-model --preset tiny-qwen3 --vocab '%s' --out '%s' --quiet", kvbt_bin(), g_json,
             model);
    int rc = kvbt_sh(cmd, out, sizeof out, 1);
    if (rc != 0) fail_msg("gen-model --vocab failed (%d): %s", rc, out);
    snprintf(cmd, sizeof cmd, "printf 'Hello' | '%s' tokenize -m '%s'", kvbt_bin(), model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_string_equal(out, "9707\n");
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' -p Hello -n 8 --threads 1", kvbt_bin(), model);
    rc = kvbt_sh(cmd, out, sizeof out, 1);
    if (rc != 0) fail_msg("run -p Hello failed (%d): %s", rc, out);
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' -p Hello -n 8 --threads 1 --chat", kvbt_bin(), model);
    rc = kvbt_sh(cmd, out, sizeof out, 1);
    if (rc != 0) fail_msg("run -p Hello --chat failed (%d): %s", rc, out);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_converted_keys),
        cmocka_unit_test(test_crosscheck_hf),
        cmocka_unit_test(test_roundtrip_and_garbage),
        cmocka_unit_test(test_encode_speed),
        cmocka_unit_test(test_gen_model_and_run),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
