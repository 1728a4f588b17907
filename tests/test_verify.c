/* tests/test_verify.c — the CPU rows of `kvbridge verify` hold N/N for every architecture
 * (tiny-gemma3's local layers, with their own RoPE base, and tiny-mla's latent cache included) and
 * cache format; a perturbed
 * bridge (one reordered addition in the K projection) makes rows short, so the check can fail; the
 * verify command exits non-zero when it does. And the one receiver the decode node, verify and
 * bench quality commit through: its range check, its commit (the bytes put are the bytes the
 * store holds), its DONE check against every field a sender's DONE carries, and the fault kinds'
 * names. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "kvb_bridge.h"
#include "kvb_quant.h"
#include "kvb_store.h"
#include "kvbt.h"

/* tiny-moe, tiny-qwen2moe: the bridge computes attention's cache; the mixture of experts between
 * layers (qwen2moe's shared expert too) must reach it bit for bit as the decoder's own forward
 * computes it. tiny-mla: the cache is one latent row per token and layer (no V part): one array per
 * layer */
static const char *k_presets[] = {"tiny",        "tiny-qwen2", "tiny-qwen3",    "tiny-llama3",
                                  "tiny-gemma3", "tiny-moe",   "tiny-qwen2moe", "tiny-mla"};
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
                assert_int_equal(r.arrays_total, (m->d.mla ? 1 : 2) * m->d.n_layer);
                assert_int_equal(r.arrays_ok, r.arrays_total);
                assert_int_equal(r.blocks_total, 4);
                assert_int_equal(r.blocks_ok, 4);
                assert_int_equal(r.chunked_ok, r.chunked_total);
                rows += 3;
            }
            kvb_model_free(m);
        }
    printf("verify: %d/%d rows N/N (%zu presets x 2 weight types x 4 cache formats)\n", rows, rows,
           sizeof k_presets / sizeof k_presets[0]);
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

/* `kvbridge verify --preset tiny-moe` on the CPU: every row N/N, and the perturbed bridge short. */
static void test_cli_tiny_moe(void **state) {
    (void)state;
    char cmd[1024], out[16384];
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' verify --preset tiny-moe --threads 2 --bytes-at none", kvbt_tmpdir(),
             kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    assert_non_null(strstr(out, "tiny-moe"));
    assert_non_null(strstr(out, "PASS: 0 short row(s)"));
    assert_null(strstr(out, "SHORT"));
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' verify --preset tiny-moe --threads 2 --bytes-at none --perturb",
             kvbt_tmpdir(), kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 1);
    assert_non_null(strstr(out, "SHORT"));
}

/* `kvbridge verify --preset tiny-mla` on the CPU: every row N/N; the slabs carry the latent rows
 * alone (kv_lora_rank + rope dims per token and layer, what the format says a token costs); a
 * perturbed bridge (one reordered addition in the latent's down-projection) makes rows short. */
static void test_mla_rows(void **state) {
    (void)state;
    kvb_model *m = load_preset("tiny-mla", KVB_TYPE_Q8_0);
    for (int perturb = 0; perturb < 2; perturb++) {
        kvb_verify_opts o = {.cache_dtype = KVB_TYPE_F16, .block_tokens = 16, .prompt_tokens = 71, .seed = 3,
                             .n_threads = 2, .perturb = perturb};
        kvb_verify_result r;
        kvb_err err = {0};
        assert_int_equal(kvb_verify_cpu(m, &o, &r, &err), KVB_OK);
        assert_int_equal(r.arrays_total, m->d.n_layer);
        assert_int_equal(r.ship_tokens, 64);
        /* 64 positions x 3 layers x (64 + 32) f16 values: no V part */
        assert_int_equal(r.slab_bytes, (uint64_t)64 * m->d.n_layer * (m->d.n_lora_kv + m->d.n_rot) * 2);
        if (perturb) {
            assert_true(r.arrays_ok < r.arrays_total);
            assert_true(r.blocks_ok < r.blocks_total);
        } else {
            assert_int_equal(r.arrays_ok, r.arrays_total);
            assert_int_equal(r.blocks_ok, r.blocks_total);
            assert_int_equal(r.chunked_ok, r.chunked_total);
        }
    }
    kvb_model_free(m);
    char cmd[1024], out[16384];
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' verify --preset tiny-mla --threads 2 --bytes-at none", kvbt_tmpdir(),
             kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    assert_non_null(strstr(out, "PASS: 0 short row(s)"));
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' verify --preset tiny-mla --threads 2 --bytes-at none --perturb",
             kvbt_tmpdir(), kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 1);
    assert_non_null(strstr(out, "SHORT"));
}

/* ---- the receiver ---------------------------------------------------------------------------- */

enum { RX_BT = 16, RX_LAYERS = 2, RX_HEADS = 2, RX_DIM = 32 };

/* A store in an f16 format of RX_LAYERS layers, RX_HEADS kv heads of RX_DIM, RX_BT-token blocks. */
static kvb_store *rx_store(void) {
    kvb_kvformat f;
    kvb_err err = {0};
    kvb_store *st = NULL;
    assert_int_equal(kvb_kvformat_init(&f, KVB_TYPE_F16, RX_BT, RX_LAYERS, RX_HEADS, RX_DIM, &err), KVB_OK);
    assert_int_equal(kvb_store_create(&f, 0x5eed, 16, &st, &err), KVB_OK);
    return st;
}

/* A slab of layer `layer` over tokens [pos0, pos0 + n), its bytes a pattern of (layer, pos0),
 * checksummed. k and v hold (n, RX_HEADS, row_bytes) each. */
static kvb_slab rx_slab(kvb_store *store, uint32_t layer, uint32_t pos0, uint32_t n, uint8_t *k, uint8_t *v) {
    const size_t bytes = (size_t)n * RX_HEADS * kvb_kvformat_row_bytes(kvb_store_kvformat(store));
    for (size_t i = 0; i < bytes; i++) {
        k[i] = (uint8_t)(i * 7 + layer * 31 + pos0);
        v[i] = (uint8_t)(i * 13 + layer * 17 + pos0 + 1);
    }
    return (kvb_slab){.layer = layer, .pos0 = pos0, .n = n, .k = k, .v = v, .k_bytes = bytes, .v_bytes = bytes,
                      .checksum = kvb_slab_checksum(k, bytes, v, bytes)};
}

/* Receives blocks [1, 3) and a 5-token tail of a 3-block prompt (block 0 cached): slabs outside
 * the range are refused as KVB_ERR_FORMAT; every in-range slab is taken; the committed blocks hold
 * the very bytes put; the DONE check passes for the DONE a sender sends and fails (MISMATCH) when
 * any of its fields, or a lane's slab count, differs; nothing missing, the tail's page is taken. */
static void test_receiver_range_commit_done(void **state) {
    (void)state;
    kvb_store *store = rx_store();
    const uint32_t from = RX_BT, to = 3 * RX_BT + 5;
    int32_t toks[4 * RX_BT];
    for (uint32_t i = 0; i < 4 * RX_BT; i++) toks[i] = (int32_t)(i * 3 + 1);
    kvb_bridge_receiver *r = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_bridge_receiver_create(store, toks, from, to, &r, &err), KVB_OK);
    assert_int_equal(kvb_bridge_receiver_blocks(r), 2);
    assert_int_equal(kvb_bridge_receiver_tail_tokens(r), 5);
    assert_int_equal(kvb_bridge_receiver_missing(r), 3);
    static uint8_t k[RX_BT * RX_HEADS * RX_DIM * 4], v[sizeof k];
    const uint32_t outside[] = {0, RX_BT - 1, 4 * RX_BT}; /* before ship_from, and past the tail's block */
    for (size_t i = 0; i < sizeof outside / sizeof outside[0]; i++) {
        kvb_slab s = rx_slab(store, 0, outside[i], 1, k, v);
        assert_int_equal(kvb_bridge_receiver_put(r, &s, &err), KVB_ERR_FORMAT);
    }
    uint32_t slabs = 0;
    for (uint32_t l = 0; l < RX_LAYERS; l++)
        for (uint32_t b = 1; b <= 3; b++) {
            kvb_slab s = rx_slab(store, l, b * RX_BT, b == 3 ? 5 : RX_BT, k, v);
            assert_int_equal(kvb_bridge_receiver_put(r, &s, &err), KVB_OK);
            slabs++;
        }
    assert_int_equal(kvb_bridge_receiver_missing(r), 0);
    assert_int_equal(kvb_bridge_receiver_slabs(r), slabs);
    /* the commit: block 2's layer-1 K rows are the bytes put */
    kvb_block_id ids[3];
    uint32_t n_ids = 0;
    assert_int_equal(kvb_store_lookup(store, toks + 0, 3 * RX_BT, ids, &n_ids, &err), KVB_OK);
    assert_int_equal(n_ids, 0); /* block 0 was never committed: the chain starts there */
    kvb_slab want = rx_slab(store, 1, 2 * RX_BT, RX_BT, k, v);
    const kvb_kvformat *f = kvb_store_kvformat(store);
    kvb_slab_pending *const *pend = kvb_bridge_receiver_pending(r, &n_ids);
    assert_int_equal(n_ids, 3);
    const uint8_t *blk = kvb_store_block_data(store, kvb_store_slab_block(pend[1]));
    const size_t rb = kvb_kvformat_row_bytes(f);
    for (uint32_t t = 0; t < RX_BT; t++)
        for (uint32_t h = 0; h < RX_HEADS; h++)
            assert_memory_equal(blk + kvb_kvformat_row_offset(f, 1, 0, h, t), want.k + ((size_t)t * RX_HEADS + h) * rb,
                                rb);
    /* the DONE check */
    kvb_msg_done d;
    assert_int_equal(kvb_bridge_done_for(store, toks, from, to, slabs, &d, &err), KVB_OK);
    assert_int_equal(kvb_bridge_receiver_check_done(r, &d, &slabs, 1, &err), KVB_OK);
    kvb_msg_done bad[4] = {d, d, d, d};
    bad[0].tokens_covered++;
    bad[1].blocks--;
    bad[2].chain_digest ^= 1;
    bad[3].slabs++;
    for (int i = 0; i < 4; i++)
        assert_int_equal(kvb_bridge_receiver_check_done(r, &bad[i], &slabs, 1, &err), KVB_ERR_MISMATCH);
    const uint32_t fewer = slabs - 1; /* the lane accepted one fewer than its DONE counts */
    assert_int_equal(kvb_bridge_receiver_check_done(r, &d, &fewer, 1, &err), KVB_ERR_MISMATCH);
    kvb_msg_done two[2] = {d, d}; /* two lanes: each DONE counts its own lane's slabs */
    const uint32_t split[2] = {slabs - 2, 2};
    two[0].slabs = split[0];
    two[1].slabs = split[1];
    assert_int_equal(kvb_bridge_receiver_check_done(r, two, split, 2, &err), KVB_OK);
    two[1].chain_digest ^= 2; /* a lane that disagrees */
    assert_int_equal(kvb_bridge_receiver_check_done(r, two, split, 2, &err), KVB_ERR_MISMATCH);
    kvb_block_id tail = kvb_bridge_receiver_take_tail(r);
    assert_true(tail != KVB_BLOCK_NONE);
    assert_int_equal(kvb_store_release(store, &tail, 1, &err), KVB_OK);
    kvb_bridge_receiver_free(r);
    kvb_store_free(store);
}

/* Nothing arrived: the sender's DONE does not match (blocks missing), and no tail is there. */
static void test_receiver_done_with_blocks_missing(void **state) {
    (void)state;
    kvb_store *store = rx_store();
    int32_t toks[3 * RX_BT];
    for (uint32_t i = 0; i < 3 * RX_BT; i++) toks[i] = (int32_t)i;
    kvb_bridge_receiver *r = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_bridge_receiver_create(store, toks, 0, 2 * RX_BT + 3, &r, &err), KVB_OK);
    kvb_msg_done d;
    const uint32_t none = 0;
    assert_int_equal(kvb_bridge_done_for(store, toks, 0, 2 * RX_BT + 3, 0, &d, &err), KVB_OK);
    assert_int_equal(kvb_bridge_receiver_check_done(r, &d, &none, 1, &err), KVB_ERR_MISMATCH);
    assert_non_null(strstr(err.msg, "3 blocks missing"));
    assert_int_equal(kvb_bridge_receiver_take_tail(r), KVB_BLOCK_NONE);
    kvb_bridge_receiver_free(r);
    kvb_store_free(store);
}

/* The fault kinds: one name each, as the metrics label them; a receive's timeout is a timeout, a
 * frame corrupt in flight a corrupt slab, any other receive failure a lost peer; only link faults
 * are resumable. */
static void test_fault_kinds(void **state) {
    (void)state;
    static const char *const want[] = {"none", "timeout", "peer_lost", "corrupt_slab", "peer_error", "done_mismatch",
                                       "cache_full", "client_gone", "peer_down", "internal", "peer_busy"};
    assert_int_equal(sizeof want / sizeof want[0], KVB_BRIDGE_FAULT_COUNT);
    for (int f = 0; f < KVB_BRIDGE_FAULT_COUNT; f++)
        assert_string_equal(kvb_bridge_fault_name((kvb_bridge_fault)f), want[f]);
    assert_int_equal(kvb_bridge_fault_of_receive(KVB_ERR_TIMEOUT), KVB_BRIDGE_FAULT_TIMEOUT);
    assert_int_equal(kvb_bridge_fault_of_receive(KVB_ERR_PEER_GONE), KVB_BRIDGE_FAULT_PEER_LOST);
    assert_int_equal(kvb_bridge_fault_of_receive(KVB_ERR_CHECKSUM), KVB_BRIDGE_FAULT_CORRUPT_SLAB);
    assert_int_equal(kvb_bridge_fault_of_receive(KVB_ERR_IO), KVB_BRIDGE_FAULT_PEER_LOST);
    for (int f = 0; f < KVB_BRIDGE_FAULT_COUNT; f++)
        assert_int_equal(kvb_bridge_fault_resumable((kvb_bridge_fault)f),
                         f == KVB_BRIDGE_FAULT_CORRUPT_SLAB || f == KVB_BRIDGE_FAULT_PEER_LOST);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_full),
        cmocka_unit_test(test_perturbed_bridge_fails),
        cmocka_unit_test(test_cli_tiny_moe),
        cmocka_unit_test(test_mla_rows),
        cmocka_unit_test(test_receiver_range_commit_done),
        cmocka_unit_test(test_receiver_done_with_blocks_missing),
        cmocka_unit_test(test_fault_kinds),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
