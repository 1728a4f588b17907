/* tests/test_grammar.c — the JSON prefix recognizer and its vocabulary mask (src/grammar):
 * every prefix of valid objects (hand-written and randomly generated, whitespace and escapes and
 * numbers of every form) is accepted and only the whole is complete; invalid texts are refused at
 * exactly their first wrong byte; random texts the recognizer calls complete are objects cJSON
 * parses (soundness); the depth and whitespace limits; and the mask's allowed set on a small
 * vocabulary, end-of-generation tokens included. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_gen.h"
#include "kvb_grammar.h"

/* Every prefix accepted, only the whole complete. */
static void expect_valid(const char *doc) {
    const size_t n = strlen(doc);
    kvb_json_state s;
    kvb_json_init(&s);
    for (size_t i = 0; i < n; i++) {
        if (!kvb_json_feed(&s, doc + i, 1)) fail_msg("'%s' refused at byte %zu", doc, i);
        if (kvb_json_complete(&s) != (i + 1 == n)) fail_msg("'%s': complete after %zu bytes", doc, i + 1);
    }
}

/* Accepted up to byte `at`, refused there. */
static void expect_refused_at(const char *doc, size_t at) {
    kvb_json_state s;
    kvb_json_init(&s);
    if (!kvb_json_feed(&s, doc, at)) fail_msg("'%s' refused before byte %zu", doc, at);
    if (kvb_json_feed(&s, doc + at, 1)) fail_msg("'%s' accepted byte %zu", doc, at);
}

static void test_valid_objects(void **state) {
    (void)state;
    static const char *const docs[] = {
        "{}",
        "{\"a\":1}",
        "{ \"a\" : [ 1 , -2.5e+3 , 0 , 0.0 , 1E9 , -0 , 3e-2 ] }",
        "{\"s\":\"x\\\"y\\\\z\\/\\b\\f\\n\\r\\t\\u00e9\\uD83D\\uDE00\",\"t\":true,\"f\":false,\"n\":null}",
        "{\"nested\":{\"deeper\":{\"list\":[[],[{}],{\"k\":[true,false,null]}]}}}",
        "{\n  \"pretty\": {\n    \"x\": 10,\n    \"y\": \"caf\xc3\xa9 \xe2\x82\xac\"\n  }\n}",
        "{\"\":\"\",\"0\":0}",
    };
    for (size_t i = 0; i < sizeof docs / sizeof *docs; i++) {
        expect_valid(docs[i]);
        cJSON *j = cJSON_Parse(docs[i]); /* the list itself is right */
        assert_true(cJSON_IsObject(j));
        cJSON_Delete(j);
    }
}

static void test_refused_at_the_first_wrong_byte(void **state) {
    (void)state;
    static const struct {
        const char *doc;
        size_t at;
    } cases[] = {
        {"[1]", 0},           {" {}", 0},            {"\"a\"", 0},          {"{,}", 1},
        {"{\"a\" 1}", 5},     {"{\"a\":}", 5},       {"{\"a\":01}", 6},     {"{\"a\":-}", 6},
        {"{\"a\":1.}", 7},    {"{\"a\":1e}", 7},     {"{\"a\":1e+}", 8},    {"{\"a\":.5}", 5},
        {"{\"a\":+1}", 5},    {"{\"a\":tru}", 8},    {"{\"a\":nul,}", 8},   {"{\"a\":True}", 5},
        {"{\"a\":1,}", 7},    {"{\"a\":[1,]}", 8},   {"{\"a\":[1}", 7},     {"{\"a\":{]}", 6},
        {"{\"a\":\"\x01\"}", 6}, {"{\"a\":\"\\q\"}", 7}, {"{\"a\":\"\\u12g4\"}", 10}, {"{\"a\":1}}", 7},
        {"{\"a\":1} ", 7},    {"{a:1}", 1},          {"{\"a\":1 2}", 7},    {"{\"a\"::1}", 5},
        {"{\"a\":[,1]}", 6},  {"{\"a\":--1}", 6},    {"{\"a\":\"x\"\"y\"}", 8}, {"{}{}", 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) expect_refused_at(cases[i].doc, cases[i].at);
}

static void test_limits(void **state) {
    (void)state;
    char doc[4096];
    size_t n = 0;
    for (int d = 0; d < KVB_JSON_MAX_DEPTH; d++) n += (size_t)sprintf(doc + n, d ? "[" : "{\"a\":");
    /* the object and 63 arrays: 64 containers open; one more is refused */
    expect_refused_at(strcat(doc, "["), n);
    doc[n] = 0;
    for (int d = 1; d < KVB_JSON_MAX_DEPTH; d++) doc[n++] = ']';
    doc[n++] = '}';
    doc[n] = 0;
    expect_valid(doc);
    /* blanks: KVB_JSON_MAX_WS in a row, not one more */
    n = (size_t)sprintf(doc, "{");
    for (int i = 0; i < KVB_JSON_MAX_WS; i++) doc[n++] = i % 2 ? '\n' : ' ';
    sprintf(doc + n, "}");
    expect_valid(doc);
    doc[n] = ' ';
    sprintf(doc + n + 1, "}");
    expect_refused_at(doc, n);
}

/* ---- random valid objects ----------------------------------------------------------------- */

static void test_random_objects(void **state) {
    (void)state;
    char *buf = malloc(1 << 16);
    for (int t = 0; t < 3000; t++) {
        size_t n = 0;
        kvbt_gen_json_object(buf, &n, 0, 3);
        buf[n] = 0;
        cJSON *j = cJSON_ParseWithLength(buf, n);
        if (!cJSON_IsObject(j)) fail_msg("the generator made no object: %s", buf);
        cJSON_Delete(j);
        expect_valid(buf);
    }
    free(buf);
}

/* Random texts over JSON's alphabet: whatever the recognizer calls complete, cJSON parses as an
 * object; and it never accepts a byte after refusing (refusal is final). */
static void test_complete_means_parseable(void **state) {
    (void)state;
    static const char alphabet[] = "{}[]\":,0123456789.eE+-truefalsn \\u";
    char text[24];
    int complete = 0;
    for (int t = 0; t < 400000; t++) {
        const size_t n = 2 + kvbt_rnd(sizeof text - 2);
        text[0] = '{';
        for (size_t i = 1; i < n; i++) text[i] = alphabet[kvbt_rnd(sizeof alphabet - 1)];
        kvb_json_state s;
        kvb_json_init(&s);
        size_t i = 0;
        while (i < n && kvb_json_feed(&s, text + i, 1)) i++;
        if (i == n && kvb_json_complete(&s)) {
            complete++;
            cJSON *j = cJSON_ParseWithLength(text, n);
            if (!cJSON_IsObject(j)) fail_msg("complete but not an object: %.*s", (int)n, text);
            cJSON_Delete(j);
        }
    }
    print_message("%d of 400000 random texts complete, every one an object\n", complete);
    assert_true(complete > 100);
}

/* ---- the mask ------------------------------------------------------------------------------ */

static void test_mask(void **state) {
    (void)state;
    static const char *const bytes[] = {"{", "}", "\"a\"", ":", "1", " ", "{\"", "x", "", "<eot>", "<ctl>",
                                        "\"", "\"\\u00", "}}", "1}"};
    const uint8_t T = KVB_VOCAB_TEXT, E = KVB_VOCAB_EOG, O = KVB_VOCAB_OTHER;
    const uint8_t kinds[] = {T, T, T, T, T, T, T, T, T, E, O, T, T, T, T};
    enum { N = sizeof bytes / sizeof *bytes };
    uint32_t lens[N];
    for (int i = 0; i < N; i++) lens[i] = (uint32_t)strlen(bytes[i]);
    kvb_vocab_bytes *v = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_vocab_bytes_from_lists(bytes, lens, kinds, N, &v, &err), KVB_OK);
    assert_int_equal(kvb_vocab_bytes_n(v), N);
    float l[N];
    static const struct {
        const char *prefix;
        const char *allowed; /* one char per token: '1' may come */
    } cases[] = {
        {"", "100000100000000"},          /* '{' and '{"' start the object; nothing else, not even blanks */
        {"{", "011001000001100"},         /* '}', a key, a blank, '"', '"\u00' */
        {"{\"a\"", "000101000000000"},    /* ':' or a blank */
        {"{\"a\":", "101011100001101"},   /* any value's start, a blank, '1}'; not '}' */
        {"{\"a\":1", "010011000000001"},  /* more digits, '}', a blank, '1}'; not '}}' (one close too many) */
        {"{}", "000000000100000"},        /* complete: only the end of generation */
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        kvb_json_state s;
        kvb_json_init(&s);
        assert_true(kvb_json_feed(&s, cases[c].prefix, strlen(cases[c].prefix)));
        for (int i = 0; i < N; i++) l[i] = (float)i;
        kvb_json_masker *m = NULL;
        assert_int_equal(kvb_json_masker_create(v, NULL, &m, &err), KVB_OK);
        const uint32_t allowed = kvb_json_masker_apply(m, &s, l);
        kvb_json_masker_free(m);
        uint32_t want = 0;
        for (int i = 0; i < N; i++) {
            const bool ok = cases[c].allowed[i] == '1';
            want += ok;
            if (ok != (l[i] == (float)i)) fail_msg("after '%s': token %d ('%s') %s", cases[c].prefix, i, bytes[i],
                                                   ok ? "masked" : "allowed");
        }
        assert_int_equal(allowed, want);
    }
    kvb_vocab_bytes_free(v);
}

/* A 50,000-token vocabulary of random JSON-ish pieces: the mask of a masker on a pool of three
 * threads that remembers masks across the run is, after each of 400 reply prefixes (four of each
 * object, so states repeat), the mask of a fresh one on one thread. */
static void test_mask_on_a_pool(void **state) {
    (void)state;
    enum { N = 50000 };
    static const char alphabet[] = "{}[]\":,0123456789.e-tru \\an";
    char **bytes = malloc(sizeof *bytes * N);
    uint32_t *lens = malloc(sizeof *lens * N);
    uint8_t *kinds = malloc(N);
    for (int i = 0; i < N; i++) {
        lens[i] = kvbt_rnd(5);
        bytes[i] = malloc(lens[i] + 1);
        for (uint32_t k = 0; k < lens[i]; k++) bytes[i][k] = alphabet[kvbt_rnd(sizeof alphabet - 1)];
        kinds[i] = i % 997 == 0 ? KVB_VOCAB_EOG : i % 499 == 0 ? KVB_VOCAB_OTHER : KVB_VOCAB_TEXT;
    }
    kvb_vocab_bytes *v = NULL;
    kvb_pool *pool = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_vocab_bytes_from_lists((const char *const *)bytes, lens, kinds, N, &v, &err), KVB_OK);
    assert_int_equal(kvb_pool_create(3, &pool, &err), KVB_OK);
    float *a = malloc(sizeof *a * N), *b = malloc(sizeof *b * N);
    kvb_json_masker *kept = NULL; /* on the pool, remembering masks across the whole run */
    assert_int_equal(kvb_json_masker_create(v, pool, &kept, &err), KVB_OK);
    char doc[1 << 12];
    size_t n = 0;
    for (int t = 0; t < 400; t++) {
        if (t % 4 == 0) { /* four prefixes of each object: states repeat, the masks are remembered */
            n = 0;
            kvbt_gen_json_object(doc, &n, 0, 3);
        }
        const size_t cut = kvbt_rnd((uint32_t)n + 1); /* a prefix, complete when cut == n */
        kvb_json_state s;
        kvb_json_init(&s);
        assert_true(kvb_json_feed(&s, doc, cut));
        for (int i = 0; i < N; i++) a[i] = b[i] = (float)(i % 17);
        kvb_json_masker *fresh = NULL; /* one thread, nothing remembered */
        assert_int_equal(kvb_json_masker_create(v, NULL, &fresh, &err), KVB_OK);
        const uint32_t one = kvb_json_masker_apply(fresh, &s, a), three = kvb_json_masker_apply(kept, &s, b);
        kvb_json_masker_free(fresh);
        assert_int_equal(one, three);
        assert_memory_equal(a, b, sizeof *a * N);
    }
    kvb_json_masker_free(kept);
    free(a);
    free(b);
    kvb_pool_destroy(pool);
    kvb_vocab_bytes_free(v);
    for (int i = 0; i < N; i++) free(bytes[i]);
    free(bytes);
    free(lens);
    free(kinds);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_objects),
        cmocka_unit_test(test_refused_at_the_first_wrong_byte),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_random_objects),
        cmocka_unit_test(test_complete_means_parseable),
        cmocka_unit_test(test_mask),
        cmocka_unit_test(test_mask_on_a_pool),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
