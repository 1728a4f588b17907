/* tests/test_quality_prompts.c — kvb_quality_prompt (src/cli/quality_prompts.c), the
 * needle-in-a-haystack prompts for the quality benchmark: deterministic (same bytes for the same
 * seed, pinned by a hash so that another machine or compiler must agree), about the requested size
 * (within 20 % of target * 4 characters), the needle sentence exactly once, the answer's digits
 * exactly once, needles spread over the depth, plain readable text, bad arguments refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_core.h"

/* kvb_quality_prompt(42, 1000): its length, XXH3 hash (kvb_hash64, seed 0), question and answer. */
#define PINNED_LEN 4029
#define PINNED_HASH 0xbf42bfecac447786ULL
#define PINNED_Q "What is the secret code of the grey observatory?"
#define PINNED_A "60256"

static size_t count_of(const char *hay, const char *needle) {
    size_t n = 0, len = strlen(needle);
    for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += len) n++;
    return n;
}

typedef struct {
    char *text, *q, *a;
} prompt;

static prompt make(uint64_t seed, uint32_t target) {
    prompt p = {0};
    assert_int_equal(kvb_quality_prompt(seed, target, &p.text, &p.q, &p.a), 0);
    assert_non_null(p.text);
    assert_non_null(p.q);
    assert_non_null(p.a);
    return p;
}

static void drop(prompt *p) {
    free(p->text);
    free(p->q);
    free(p->a);
}

/* "What is the secret code of the blue lighthouse?" -> "The secret code of the blue lighthouse is A." */
static void needle_of(const prompt *p, char *out, size_t cap) {
    const char *pre = "What is the secret code of the ";
    size_t lp = strlen(pre), lq = strlen(p->q);
    assert_true(lq > lp + 1 && strncmp(p->q, pre, lp) == 0 && p->q[lq - 1] == '?');
    snprintf(out, cap, "The secret code of the %.*s is %s.", (int)(lq - lp - 1), p->q + lp, p->a);
}

static void test_determinism(void **state) {
    (void)state;
    for (uint64_t seed = 0; seed < 20; seed++) {
        prompt a = make(seed, 2000), b = make(seed, 2000);
        assert_string_equal(a.text, b.text);
        assert_string_equal(a.q, b.q);
        assert_string_equal(a.a, b.a);
        prompt c = make(seed + 1000, 2000);
        assert_true(strcmp(a.text, c.text) != 0);
        drop(&a);
        drop(&b);
        drop(&c);
    }
    /* Pinned bytes: the same seed gives this text on every machine. If the word lists or
     * templates change on purpose, print the new values and update them here. */
    prompt p = make(42, 1000);
    uint64_t h = kvb_hash64(p.text, strlen(p.text), 0);
    printf("seed 42, 1000 tokens: %zu bytes, hash %016llx, question \"%s\", answer %s\n", strlen(p.text),
           (unsigned long long)h, p.q, p.a);
    assert_int_equal(strlen(p.text), PINNED_LEN);
    assert_true(h == PINNED_HASH);
    assert_string_equal(p.q, PINNED_Q);
    assert_string_equal(p.a, PINNED_A);
    drop(&p);
}

static void test_length(void **state) {
    (void)state;
    static const uint32_t targets[] = {100, 128, 300, 1000, 4000, 16000, 32768};
    for (size_t t = 0; t < KVB_ARRAY_LEN(targets); t++) {
        double lo = 1e9, hi = 0;
        for (uint64_t seed = 0; seed < 40; seed++) {
            prompt p = make(seed * 7919 + t, targets[t]);
            double tokens = (double)strlen(p.text) / 4.0, ratio = tokens / targets[t];
            if (ratio < 0.8 || ratio > 1.2)
                fail_msg("seed %llu target %u: %zu bytes = %.0f tokens at 4 bytes/token, %.0f%% of the target",
                         (unsigned long long)(seed * 7919 + t), targets[t], strlen(p.text), tokens, 100 * ratio);
            lo = KVB_MIN(lo, ratio);
            hi = KVB_MAX(hi, ratio);
            drop(&p);
        }
        printf("target %5u tokens: length %.3f..%.3f of the target\n", targets[t], lo, hi);
    }
}

static void test_needle_once(void **state) {
    (void)state;
    int first_third = 0, last_third = 0;
    for (uint64_t seed = 0; seed < 300; seed++) {
        uint32_t target = 200 + (uint32_t)(seed * 37 % 3000);
        prompt p = make(seed, target);
        char needle[256];
        needle_of(&p, needle, sizeof needle);
        if (count_of(p.text, needle) != 1) fail_msg("seed %llu: needle '%s' occurs %zu times", (unsigned long long)seed, needle, count_of(p.text, needle));
        assert_int_equal(count_of(p.text, "secret code"), 1);
        /* the answer: five digits, occurring exactly once */
        assert_int_equal(strlen(p.a), 5);
        for (const char *c = p.a; *c; c++) assert_true(*c >= '0' && *c <= '9');
        if (count_of(p.text, p.a) != 1) fail_msg("seed %llu: answer %s occurs %zu times", (unsigned long long)seed, p.a, count_of(p.text, p.a));
        /* readable: printable ASCII, newlines between paragraphs, sentences end with '.' */
        for (const unsigned char *c = (const unsigned char *)p.text; *c; c++)
            assert_true((*c >= 0x20 && *c < 0x7f) || *c == '\n');
        assert_int_equal(p.text[strlen(p.text) - 1], '.');
        assert_null(strstr(p.text, "  "));
        assert_null(strstr(p.text, "$"));
        double depth = (double)(strstr(p.text, needle) - p.text) / (double)strlen(p.text);
        first_third += depth < 1.0 / 3;
        last_third += depth > 2.0 / 3;
        drop(&p);
    }
    printf("needle depth: %d of 300 in the first third, %d in the last third\n", first_third, last_third);
    assert_true(first_third > 50 && last_third > 50);
}

static void test_small_and_bad(void **state) {
    (void)state;
    prompt p = make(1, 1); /* tiny: the title and the needle */
    char needle[256];
    needle_of(&p, needle, sizeof needle);
    assert_int_equal(count_of(p.text, needle), 1);
    drop(&p);
    char *t = (char *)1, *q = (char *)1, *a = (char *)1;
    assert_int_equal(kvb_quality_prompt(1, 0, &t, &q, &a), -1);
    assert_null(t);
    assert_null(q);
    assert_null(a);
    assert_int_equal(kvb_quality_prompt(1, 100, NULL, &q, &a), -1);
    assert_int_equal(kvb_quality_prompt(1, (1u << 26) + 1, &t, &q, &a), -1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_determinism),
        cmocka_unit_test(test_length),
        cmocka_unit_test(test_needle_once),
        cmocka_unit_test(test_small_and_bad),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
