/* tests/test_demo_gemma3.c — `kvbridge demo --model gemma3` on the real Gemma 3 270M file
 * (tools/fetch_gemma3.sh; $KVB_GEMMA3_GGUF overrides where it is): the file has no chat template
 * (a base model, which echoes chat markup), so the demo says so and holds an interview transcript
 * through /v1/completions; every one of the 4 turns is bridged (`complete`), the bridged replies
 * equal the native ones, and the first answer gives the harbour's year from the document. Skips
 * with a message when the file is absent. About 20 s on 2 cores in a Release build, hence `slow`. */
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

static void test_demo_gemma3(void **state) {
    (void)state;
    const char *path = kvbt_gemma3_path();
    char cmd[2048];
    if (!path) {
        print_message("%s: SKIP: no Gemma 3 270M file (run tools/fetch_gemma3.sh or set KVB_GEMMA3_GGUF)\n",
                      "test_demo_gemma3");
        skip();
    }
    snprintf(cmd, sizeof cmd, "KVB_GEMMA3_GGUF='%s' '%s' demo --model gemma3 --device cpu 2>&1", path, kvbt_bin());
    int rc = kvbt_sh(cmd, g_out, sizeof g_out, 1);
    print_message("%s\n", g_out);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(g_out, "has no chat template: a base (pretrained) model"));
    assert_non_null(strstr(g_out, "4/4 replies identical to the native ones"));
    const char *a1 = strstr(g_out, "Harbour master: ");
    assert_non_null(a1);
    assert_true(strstr(a1, "1887") != NULL && strstr(a1, "1887") < strchr(a1, '\n'));
    const char *t = strstr(g_out, "\nturn ");
    assert_non_null(t);
    for (int turn = 1; turn <= 4; turn++) {
        t = strchr(t + 1, '\n');
        assert_non_null(t);
        const char *eol = strchr(t + 1, '\n');
        assert_non_null(eol);
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)(eol - t - 1), t + 1);
        assert_int_equal(atoi(line), turn);
        assert_non_null(strstr(line, " yes  complete"));
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_demo_gemma3)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
