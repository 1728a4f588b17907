/* tests/test_cuda_node.c — the closed loop with the prefill node on the GPU (CUDA -> CPU), in this
 * process over the real transport and HTTP API: the node warms up before it listens (the tokens
 * and seconds it reports); a three-turn conversation ships only each turn's increment, every turn
 * `complete` with the decoder computing only the last token; a corrupt slab still yields an answer,
 * with an honest `partial` verdict and a counted fault. The GPU computes the decoder's rows from
 * its own bf16 hidden states, so replies are not compared with the native ones here (the CPU test,
 * test_node_loop, does that bit for bit); `kvbridge verify --device cuda` checks the rows. Skips
 * without a CUDA device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvbt.h"
#include "node_client.h"

#define PSK "test-key-0123456789abcdef"
static char g_model[512];

static int setup(void **state) {
    (void)state;
    kvb_err err = {0};
    kvbt_tmp_path(g_model, sizeof g_model, "cuda-loop.gguf");
    kvb_gen_opts o = {.preset = "tiny", .type = KVB_TYPE_Q8_0, .seed = 21, .n_threads = 2};
    if (kvb_gen_model(&o, g_model, &err)) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static kvb_prefill_node *start_gpu_prefill(const char *fault, uint32_t warmup) {
    kvb_prefill_config c = {.listen = "127.0.0.1:0", .model_path = g_model, .psk = PSK, .n_threads = 2,
                            .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096, .fault = fault,
                            .cuda = true, .warmup_tokens = warmup};
    kvb_prefill_node *n = NULL;
    kvb_err err = {0};
    if (kvb_prefill_node_start(&c, &n, &err)) fail_msg("CUDA prefill node: %s", err.msg);
    return n;
}

static kvb_decode_node *start_decode(uint16_t peer_port) {
    char peer[32];
    snprintf(peer, sizeof peer, "127.0.0.1:%u", peer_port);
    kvb_decode_config c = {.http_listen = "127.0.0.1:0", .peer = peer, .model_path = g_model, .psk = PSK,
                           .n_threads = 2, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096,
                           .peer_timeout_ms = 30000};
    kvb_decode_node *n = NULL;
    kvb_err err = {0};
    if (kvb_decode_node_start(&c, &n, &err)) fail_msg("decode node: %s", err.msg);
    return n;
}

static void test_gpu_prefill_multiturn(void **state) {
    (void)state;
    kvbt_require_gpu();
    kvb_prefill_node *pn = start_gpu_prefill(NULL, 300);
    double warm_s = 0;
    assert_int_equal(kvb_prefill_node_warmup(pn, &warm_s), 300); /* before it listened */
    assert_true(warm_s > 0);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn));
    int32_t ids[1200];
    kvbt_prompt_ids(ids, 1200, 7);
    const int lens[] = {700, 900, 1200}; /* each turn extends the previous prompt */
    int prev_ship = 0;
    for (int t = 0; t < 3; t++) {
        kvbt_reply b;
        const double bytes0 = kvbt_metric(kvb_decode_node_port(dn), "kvbridge_slab_bytes_total ");
        kvbt_complete_ids(kvb_decode_node_port(dn), ids, lens[t], &b);
        const int ship = (lens[t] - 1) / 32 * 32, shipped = lens[t] - 1;
        assert_string_equal(b.verdict, "complete");
        assert_int_equal(b.cached, prev_ship);            /* the previous turn's blocks were cached */
        assert_int_equal(b.bridged, shipped - prev_ship); /* only the increment was computed and shipped */
        assert_int_equal(b.native, 1);                    /* the decoder computed the last token only */
        const double bytes = kvbt_metric(kvb_decode_node_port(dn), "kvbridge_slab_bytes_total ") - bytes0;
        /* tiny: 4 layers x K,V x 2 kv heads x 64 dims x f16 = 2048 bytes per token */
        assert_true(bytes == (double)(shipped - prev_ship) * 2048.0);
        print_message("turn %d: %d tokens, %d cached, %d bridged from the GPU, %.0f slab bytes: %s\n", t + 1,
                      lens[t], b.cached, b.bridged, bytes, b.verdict);
        prev_ship = ship;
        free(b.content);
    }
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

static void test_gpu_prefill_corrupt_slab(void **state) {
    (void)state;
    kvbt_require_gpu();
    kvb_prefill_node *pn = start_gpu_prefill("corrupt:30", 0);
    double warm_s = 1;
    assert_int_equal(kvb_prefill_node_warmup(pn, &warm_s), 0); /* none asked for */
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn));
    int32_t ids[600];
    kvbt_prompt_ids(ids, 600, 99);
    kvbt_reply b;
    kvbt_complete_ids(kvb_decode_node_port(dn), ids, 600, &b);
    if (strncmp(b.verdict, "partial ", 8) != 0) fail_msg("verdict '%s', expected 'partial ...'", b.verdict);
    assert_true(b.bridged < 599); /* never reported as fully bridged */
    assert_true(kvbt_metric(kvb_decode_node_port(dn), "kvbridge_bridge_faults_total{kind=\"corrupt_slab\"} ") >= 1);
    free(b.content);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpu_prefill_multiturn),
        cmocka_unit_test(test_gpu_prefill_corrupt_slab),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
