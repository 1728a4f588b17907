/* tests/test_llama_server.c — kvbridge's cache restored into a stock llama-server (built by
 * tools/peer/build_llama_server.sh; $KVB_LLAMA_SERVER, else build-peer/llama-server-bin/llama-server
 * in the source tree; every case skips without it). For a generated tiny-llama3 model, with and
 * without flash attention (V row-major, V transposed): llama-server computes a prompt and saves
 * its slot, kvbridge computes the same prompt and writes llama.cpp's state file, `kvbridge verify
 * --target llama.cpp --restore` restores it into slot 0 and decodes: llama-server must compute only
 * the last prompt token, its greedy reply must equal llama-server's alone, and a file of another
 * version must be refused with llama-server then computing the whole prompt itself and replying the same.
 * The same on the real Gemma 3 270M (two caches; its own case, needing the file too). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvb_core.h"
#include "kvb_node.h"
#include "kvbt.h"

static char g_out[1 << 17];

static void stop_server(pid_t pid) {
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
}

/* llama-server on the model (one slot, -fa fa, one more flag extra or NULL, its slots in the temp
 * dir's `slots`), `kvbridge verify --target llama.cpp --restore` against it; the output in g_out. */
static void verify_restore(const char *bin, const char *model, const char *slots_name, const char *fa,
                           const char *extra, int port, int n_predict) {
    char slots[512], cmd[4096];
    kvbt_tmp_path(slots, sizeof slots, slots_name);
    mkdir(slots, 0755);
    pid_t pid = kvbt_llama_server_start(bin, model, slots, port, 1, fa, extra);
    snprintf(cmd, sizeof cmd, "'%s' verify --target llama.cpp --model '%s' --server http://127.0.0.1:%d "
             "--slot-dir '%s' --restore --n-predict %d --threads 2 --prompt 'Once upon a time there was a "
             "prefill node and a decode node, and they shared one cache.' 2>&1", kvbt_bin(), model, port, slots,
             n_predict);
    kvbt_sh(cmd, g_out, sizeof g_out, 1);
    stop_server(pid);
    print_message("%s\n", g_out);
}

static void bridged_prompt(const char *fa, int port) {
    char bin[1024], model[512], cmd[4096];
    kvbt_require_llama_server(bin, sizeof bin);
    kvbt_tmp_path(model, sizeof model, "tiny-llama3-q8_0.gguf");
    snprintf(cmd, sizeof cmd, "[ -f '%s' ] || '%s' gen-model --preset tiny-llama3 --type q8_0 --out '%s' --quiet",
             model, kvbt_bin(), model);
    assert_int_equal(kvbt_sh(cmd, g_out, sizeof g_out, 1), 0);
    verify_restore(bin, model, fa, fa, NULL, port, 24);
    assert_non_null(strstr(g_out, !strcmp(fa, "on") ? "V row-major (flash attention)" : "V transposed"));
    assert_non_null(strstr(g_out, "prefix reused"));
    assert_null(strstr(g_out, "NOT REUSED"));
    assert_non_null(strstr(g_out, "restored vs llama-server alone: identical"));
    assert_non_null(strstr(g_out, "refused restore (file version 2): refused"));
    assert_non_null(strstr(g_out, "reply the same"));
}

static void test_restore_flash_attention(void **state) {
    (void)state;
    bridged_prompt("on", 21000 + getpid() % 20000);
}

static void test_restore_v_transposed(void **state) {
    (void)state;
    bridged_prompt("off", 41000 + getpid() % 20000);
}

/* The real Gemma 3 270M (Q4_K_M): two caches in the file, global layers (5, 11, 17) then the 15
 * sliding-window ones; a row per layer and K/V with its largest difference (ggml computes with
 * Q8_K-rounded activations, kvbridge in f32 from the dequantized weights, so no row is identical).
 * llama-server runs with --swa-full: without it, this build recomputes a restored prefix whose
 * sliding-window cache starts at or above n - window (always so for a prompt under the window);
 * restored, it computes only the last token and its greedy reply equals its own alone. */
static void test_gemma3_verify_restore(void **state) {
    (void)state;
    char bin[1024];
    kvbt_require_llama_server(bin, sizeof bin);
    const char *model = kvbt_require_gemma3();
    verify_restore(bin, model, "gemma3-slots", "off", "--swa-full", 24000 + getpid() % 20000, 16);
    assert_non_null(strstr(g_out, "22 tokens, 2 cache(s)"));
    assert_non_null(strstr(g_out, "cache 0: 22 cells (positions 0..21)"));
    assert_non_null(strstr(g_out, "cache 1: 22 cells (positions 0..21)"));
    uint32_t rows = 0;
    for (const char *p = g_out; (p = strstr(p, "  layer ")); p++) rows++;
    assert_int_equal(rows, 36); /* 18 layers, K and V */
    assert_non_null(strstr(g_out, "layer  0 local  K"));
    assert_non_null(strstr(g_out, "layer  5 global V"));
    assert_non_null(strstr(g_out, "layer 17 global K"));
    assert_non_null(strstr(g_out, "max |diff|"));
    assert_non_null(strstr(g_out, "computed 1 of 22 prompt tokens after restoring 22"));
    assert_non_null(strstr(g_out, "prefix reused"));
    assert_non_null(strstr(g_out, "restored vs llama-server alone: identical"));
    assert_non_null(strstr(g_out, "refused restore (file version 2): refused"));
    assert_non_null(strstr(g_out, "reply the same"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_restore_flash_attention),
        cmocka_unit_test(test_restore_v_transposed),
        cmocka_unit_test(test_gemma3_verify_restore),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
