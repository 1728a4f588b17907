/* tests/test_verify.c — the CPU rows of `kvbridge verify` hold N/N for every architecture
 * (tiny-gemma3's local layers, with their own RoPE base, included) and cache format; a perturbed bridge (one reordered addition in the K projection) makes rows
 * short, so the check can fail; and the verify command exits non-zero when it does. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "kvb_bridge.h"
#include "kvb_quant.h"
#include "kvbt.h"

static const char *k_presets[] = {"tiny", "tiny-qwen2", "tiny-qwen3", "tiny-llama3", "tiny-gemma3"};
static const uint32_t k_formats[] = {KVB_TYPE_F32, KVB_TYPE_F16, KVB_TYPE_BF16, KVB_TYPE_Q8_0};

static kvb_model *load_preset(const char *preset, uint32_t wtype) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s-%u.gguf", kvbt_tmpdir(), preset, wtype);
    kvb_gen_opts o = {.preset = preset, .type = wtype, .seed = 11, .n_threads = 2};
    kvb_err err = {0};
    kvb_model *m = NULL;
    if (kvb_gen_model(&o, path, &err) || kvb_model_load(path, &m, &err)) fail_msg("%s", err.msg);
    return m;
}

static void test_rows_full(void **state) {
    (void)state;
    const uint32_t wtypes[] = {KVB_TYPE_Q8_0, KVB_TYPE_F16};
    int rows = 0;
    for (size_t p = 0; p < sizeof k_presets / sizeof k_presets[0]; p++)
        for (size_t w = 0; w < 2; w++) {
            kvb_model *m = load_preset(k_presets[p], wtypes[w]);
            for (size_t f = 0; f < 4; f++) {
                kvb_verify_opts o = {.cache_dtype = k_formats[f], .block_tokens = 16, .prompt_tokens = 71,
                                     .seed = 100 + f, .n_threads = 2};
                kvb_verify_result r;
                kvb_err err = {0};
                assert_int_equal(kvb_verify_cpu(m, &o, &r, &err), KVB_OK);
                assert_int_equal(r.arrays_total, 2 * m->d.n_layer);
                assert_int_equal(r.arrays_ok, r.arrays_total);
                assert_int_equal(r.blocks_total, 4);
                assert_int_equal(r.blocks_ok, 4);
                assert_int_equal(r.chunked_ok, r.chunked_total);
                rows += 3;
            }
            kvb_model_free(m);
        }
    printf("verify: %d/%d rows N/N (5 presets x 2 weight types x 4 cache formats)\n", rows, rows);
}

static void test_perturbed_bridge_fails(void **state) {
    (void)state;
    kvb_model *m = load_preset("tiny", KVB_TYPE_Q8_0);
    kvb_verify_opts o = {.cache_dtype = KVB_TYPE_F16, .block_tokens = 16, .prompt_tokens = 71, .seed = 1,
                         .n_threads = 2, .perturb = true};
    kvb_verify_result r;
    kvb_err err = {0};
    assert_int_equal(kvb_verify_cpu(m, &o, &r, &err), KVB_OK);
    assert_true(r.arrays_ok < r.arrays_total);
    assert_true(r.blocks_ok < r.blocks_total);
    kvb_model_free(m);

    char cmd[1024], out[16384];
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' verify --preset tiny --perturb", kvbt_tmpdir(), kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 1);
    assert_non_null(strstr(out, "SHORT"));
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' verify --preset tiny", kvbt_tmpdir(), kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    assert_non_null(strstr(out, "PASS"));
    assert_non_null(strstr(out, "CUDA rows: not run"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_full),
        cmocka_unit_test(test_perturbed_bridge_fails),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
