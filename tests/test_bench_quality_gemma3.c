/* tests/test_bench_quality_gemma3.c — `kvbridge bench quality` on the real Gemma 3 270M file
 * (tools/fetch_gemma3.sh; $KVB_GEMMA3_GGUF overrides where it is) with 4 short prompts: the run
 * succeeds, both modes' tables print, decoder mode is bit-exact (agreement 100 %, KL 0, the
 * checked claim holds), and the native path retrieves the needle on most of them (the model is
 * a base model that continues "Question: ...\nAnswer:" with the code). Skips with a message when
 * the file is absent. About 40 s on 2 cores in a Release build, hence label `slow`. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvbt.h"

static char g_out[65536];

static void test_gemma3_quality(void **state) {
    (void)state;
    const char *path = kvbt_gemma3_path();
    char cmd[2048];
    if (!path) {
        print_message("%s: SKIP: no Gemma 3 270M file (run tools/fetch_gemma3.sh or set KVB_GEMMA3_GGUF)\n",
                      "test_bench_quality_gemma3");
        skip();
    }
    snprintf(cmd, sizeof cmd,
             "'%s' bench quality -m '%s' --prompts 4 --min-tokens 256 --max-tokens 1024 --gen 24 --threads 2 2>&1",
             kvbt_bin(), path);
    int rc = kvbt_sh(cmd, g_out, sizeof g_out, 1);
    print_message("%s\n", g_out);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(g_out, "decoder-exact holds"));
    const char *d = strstr(g_out, "\nmode decoder:"), *p = strstr(g_out, "\nmode prefill:");
    assert_non_null(d);
    assert_non_null(p);
    const char *t = strstr(d, "\ntotal ");
    assert_non_null(t);
    unsigned n = 0, nn = 0, nb = 0, c1 = 0, c2 = 0;
    double tok, agree, same;
    char ident[32], klm[32], klx[32];
    assert_int_equal(sscanf(t, " total %u %lf %lf%% %lf%% %31s %31s %31s %u/%u %u/%u", &n, &tok, &agree, &same, ident,
                            klm, klx, &nn, &c1, &nb, &c2),
                     11);
    assert_int_equal(n, 4);
    assert_true(agree == 100.0 && same == 100.0);
    assert_string_equal(klm, "0");
    assert_string_equal(klx, "0");
    assert_int_equal(nn, nb);
    assert_true(nn >= 3); /* measured: 4/4 */
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_gemma3_quality)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
