/* support/json_gen.c — random valid JSON texts for the grammar tests (see json_gen.h). */
#include "json_gen.h"

#include <string.h>

static uint64_t g_rng = 88172645463325252ull;

void kvbt_rnd_seed(uint64_t seed) { g_rng = seed ? seed : 88172645463325252ull; }

uint32_t kvbt_rnd(uint32_t n) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng % n);
}

void kvbt_put(char *buf, size_t *n, const char *s) {
    const size_t k = strlen(s);
    memcpy(buf + *n, s, k);
    *n += k;
}

void kvbt_blanks(char *buf, size_t *n) {
    static const char *const ws[] = {"", "", "", " ", "\n  ", "\t", "\r\n"};
    kvbt_put(buf, n, ws[kvbt_rnd(7)]);
}

void kvbt_gen_json_string(char *buf, size_t *n) {
    static const char *const parts[] = {"a", "key", " ", "\\\"", "\\\\", "\\/", "\\n", "\\t", "\\u00e9", "\\uFFFF",
                                        "\xc3\xa9", "\xe2\x82\xac", "0", "{", "]", ":", ","};
    kvbt_put(buf, n, "\"");
    for (uint32_t k = kvbt_rnd(5); k > 0; k--) kvbt_put(buf, n, parts[kvbt_rnd(sizeof parts / sizeof *parts)]);
    kvbt_put(buf, n, "\"");
}

void kvbt_gen_json_number(char *buf, size_t *n, bool integer) {
    static const char *const ints[] = {"0", "-0", "7", "-12", "120", "10"};
    static const char *const nums[] = {"3.25", "-0.5", "1e5", "2E-3", "6.02e+23", "0.0"};
    kvbt_put(buf, n, integer || kvbt_rnd(2) ? ints[kvbt_rnd(6)] : nums[kvbt_rnd(6)]);
}

void kvbt_gen_json_object(char *buf, size_t *n, int depth, int max_depth) {
    kvbt_put(buf, n, "{");
    for (uint32_t k = depth >= max_depth ? 0 : kvbt_rnd(4), i = 0; i < k; i++) {
        if (i) kvbt_put(buf, n, ",");
        kvbt_blanks(buf, n);
        kvbt_gen_json_string(buf, n);
        kvbt_blanks(buf, n);
        kvbt_put(buf, n, ":");
        kvbt_blanks(buf, n);
        kvbt_gen_json_value(buf, n, depth + 1, max_depth);
        kvbt_blanks(buf, n);
    }
    kvbt_put(buf, n, "}");
}

void kvbt_gen_json_value(char *buf, size_t *n, int depth, int max_depth) {
    switch (depth >= max_depth ? 2 + kvbt_rnd(3) : kvbt_rnd(5)) {
    case 0: kvbt_gen_json_object(buf, n, depth, max_depth); break;
    case 1:
        kvbt_put(buf, n, "[");
        for (uint32_t k = kvbt_rnd(4), i = 0; i < k; i++) {
            if (i) kvbt_put(buf, n, ",");
            kvbt_blanks(buf, n);
            kvbt_gen_json_value(buf, n, depth + 1, max_depth);
            kvbt_blanks(buf, n);
        }
        kvbt_put(buf, n, "]");
        break;
    case 2: kvbt_gen_json_number(buf, n, false); break;
    case 3: kvbt_put(buf, n, kvbt_rnd(3) == 0 ? "true" : kvbt_rnd(2) ? "false" : "null"); break;
    default: kvbt_gen_json_string(buf, n);
    }
}
