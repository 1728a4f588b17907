/* tests/test_mla_node.c — DeepSeek's latent cache over the closed loop: a prefill node and a decode
 * node on loopback serve tiny-mla (deepseek2), and a multi-turn conversation is bridged `complete`
 * each turn, shipping only the turn's increment as latent rows (kv_lora_rank + rope dims per token
 * and layer, no V part: what kvb_kvformat_token_bytes says), with the same greedy reply as a decode
 * node computing everything natively. */
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
    kvbt_tmp_path(g_model, sizeof g_model, "mla-loop.gguf");
    kvb_gen_opts o = {.preset = "tiny-mla", .type = KVB_TYPE_Q8_0, .seed = 23, .n_threads = 2};
    if (kvb_gen_model(&o, g_model, &err)) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static kvb_decode_node *start_decode(const char *peer) {
    kvb_decode_config c = {.http_listen = "127.0.0.1:0", .peer = peer, .model_path = g_model, .psk = PSK,
                           .n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096,
                           .peer_timeout_ms = 10000};
    kvb_decode_node *n = NULL;
    kvb_err err = {0};
    if (kvb_decode_node_start(&c, &n, &err)) fail_msg("decode node: %s", err.msg);
    return n;
}

static void test_mla_multiturn(void **state) {
    (void)state;
    kvb_model *m = NULL;
    kvb_kvformat f;
    kvb_err err = {0};
    if (kvb_model_load(g_model, &m, &err) || kvb_model_kvformat(&m->d, KVB_TYPE_F16, 32, &f, &err))
        fail_msg("%s", err.msg);
    uint64_t per_token, local;
    kvb_kvformat_token_bytes(&f, &per_token, &local);
    assert_int_equal(per_token, 3 * (64 + 32) * 2); /* 576 bytes: 3 layers of one f16 latent row */
    kvb_model_free(m);
    kvb_prefill_config pc = {.listen = "127.0.0.1:0", .model_path = g_model, .psk = PSK, .n_threads = 1,
                             .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096};
    kvb_prefill_node *pn = NULL;
    if (kvb_prefill_node_start(&pc, &pn, &err)) fail_msg("prefill node: %s", err.msg);
    char peer[32];
    snprintf(peer, sizeof peer, "127.0.0.1:%u", kvb_prefill_node_port(pn));
    kvb_decode_node *dn = start_decode(peer), *nat = start_decode(NULL);
    int32_t ids[700];
    kvbt_prompt_ids(ids, 700, 5);
    const int lens[] = {300, 500, 700};
    int prev_ship = 0;
    for (int t = 0; t < 3; t++) {
        kvbt_reply b, n;
        const double bytes0 = kvbt_metric(kvb_decode_node_port(dn), "kvbridge_slab_bytes_total ");
        kvbt_complete_ids(kvb_decode_node_port(dn), ids, lens[t], &b);
        kvbt_complete_ids(kvb_decode_node_port(nat), ids, lens[t], &n);
        const int shipped = lens[t] - 1, ship = shipped / 32 * 32;
        assert_string_equal(b.verdict, "complete");
        assert_int_equal(b.cached, prev_ship);
        assert_int_equal(b.bridged, shipped - prev_ship);
        assert_int_equal(b.native, 1);
        const double bytes = kvbt_metric(kvb_decode_node_port(dn), "kvbridge_slab_bytes_total ") - bytes0;
        assert_true(bytes == (double)(shipped - prev_ship) * (double)per_token);
        assert_string_equal(b.content, n.content); /* the native decoder's reply */
        prev_ship = ship;
        free(b.content);
        free(n.content);
    }
    kvb_decode_node_stop(nat);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mla_multiturn),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
