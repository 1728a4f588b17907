/* tests/test_node_loop.c — the closed loop on loopback (CPU -> CPU): a prefill node and decode
 * nodes in this process, talking through the real transport and HTTP API. Multi-turn: each turn
 * ships only its increment (bridged tokens and slab bytes asserted); replies equal the native
 * ones; every fault (corrupt slab, peer killed mid-stream, stalled peer, peer down, wrong key,
 * other model, a slab before or past the range asked for, a DONE for blocks never sent) still yields the native answer with an honest verdict and a counted fault — with
 * the slabs striped over the default 4 lanes; one lane and 3 lanes carry the multi-turn run too,
 * and a lane group is checked on the wire (slabs spread over every lane, each lane's DONE counting
 * its own, an incomplete group refused); the official openai client streams a chat completion
 * from the real node. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvb_bridge.h"
#include "kvb_engine_cpu.h"
#include "kvb_grammar.h"
#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_store.h"
#include "kvb_tokenizer.h"
#include "kvb_transport.h"
#include "node_internal.h"
#include "kvb_quant.h"
#include "kvbt.h"
#include "node_client.h"

#define PSK "test-key-0123456789abcdef"
static char g_model[512], g_other[512], g_gemma[512];
static uint32_t g_lanes; /* decode nodes' lanes (0: the default) */
static int g_resumes;    /* decode nodes' bridge_resumes (0: the default, 2; -1: none) */
static uint32_t g_parallel; /* decode nodes' parallel (0: the default, 4) */
static bool g_tail_after;   /* decode nodes' tail_after_transfer */
static bool g_filler_peer;  /* decode nodes' bench_filler_peer */
static uint32_t g_cache_blocks; /* decode nodes' cache_blocks (0: the default) */
static const kvb_wire_backend *g_backend; /* both nodes' wire backend (NULL: TCP) */

static int setup(void **state) {
    (void)state;
    kvb_err err = {0};
    kvbt_tmp_path(g_model, sizeof g_model, "loop.gguf");
    kvbt_tmp_path(g_other, sizeof g_other, "other.gguf");
    kvbt_tmp_path(g_gemma, sizeof g_gemma, "loop-gemma3.gguf");
    kvb_gen_opts o = {.preset = "tiny", .type = KVB_TYPE_Q8_0, .seed = 21, .n_threads = 2};
    kvb_gen_opts o2 = o, o3 = o;
    o2.seed = 22;
    o3.preset = "tiny-gemma3";
    if (kvb_gen_model(&o, g_model, &err) || kvb_gen_model(&o2, g_other, &err) || kvb_gen_model(&o3, g_gemma, &err)) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static kvb_prefill_node *start_prefill_mode(const char *model, const char *psk, const char *fault, bool prefill_mode,
                                            uint32_t engine_dtype) {
    kvb_prefill_config c = {.listen = "127.0.0.1:0", .model_path = model, .psk = psk, .n_threads = 1,
                            .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096, .fault = fault,
                            .prefill_mode = prefill_mode, .engine_cache_dtype = engine_dtype, .backend = g_backend};
    kvb_prefill_node *n = NULL;
    kvb_err err = {0};
    if (kvb_prefill_node_start(&c, &n, &err)) fail_msg("prefill node: %s", err.msg);
    return n;
}

static kvb_prefill_node *start_prefill(const char *model, const char *psk, const char *fault) {
    return start_prefill_mode(model, psk, fault, false, 0);
}

static kvb_decode_node *start_decode_mode(uint16_t peer_port, const char *psk, int timeout_ms, bool prefill_mode) {
    char peer[32];
    snprintf(peer, sizeof peer, "127.0.0.1:%u", peer_port);
    kvb_decode_config c = {.http_listen = "127.0.0.1:0", .peer = peer_port ? peer : NULL, .model_path = g_model,
                           .psk = psk, .n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32,
                           .max_ctx = 4096, .peer_timeout_ms = timeout_ms, .prefill_mode = prefill_mode,
                           .lanes = g_lanes, .bridge_resumes = g_resumes, .parallel = g_parallel,
                           .tail_after_transfer = g_tail_after, .cache_blocks = g_cache_blocks,
                           .bench_filler_peer = g_filler_peer, .backend = g_backend};
    kvb_decode_node *n = NULL;
    kvb_err err = {0};
    if (kvb_decode_node_start(&c, &n, &err)) fail_msg("decode node: %s", err.msg);
    return n;
}

static kvb_decode_node *start_decode(uint16_t peer_port, const char *psk, int timeout_ms) {
    return start_decode_mode(peer_port, psk, timeout_ms, false);
}

/* kvbridge_peer_up of the decode node's one peer, 127.0.0.1:peer_port. */
static double peer_up(kvb_decode_node *dn, uint16_t peer_port) {
    char series[96];
    snprintf(series, sizeof series, "kvbridge_peer_up{peer=\"127.0.0.1:%u\"} ", peer_port);
    return kvbt_metric(kvb_decode_node_port(dn), series);
}

static void multiturn_ships_only_increments(uint32_t lanes) {
    g_lanes = lanes;
    kvb_prefill_node *pn = start_prefill(g_model, PSK, NULL);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    kvb_decode_node *nat = start_decode(0, PSK, 10000);
    /* the lanes were connected at start, before any request */
    assert_true(peer_up(dn, kvb_prefill_node_port(pn)) == 1);
    /* what carries the link shows: tcp, or ucx and the lanes UCX selected */
    char carried[400], ucx_lanes[256] = "";
    if (g_backend) kvb_ucx_last_lanes(ucx_lanes, sizeof ucx_lanes);
    snprintf(carried, sizeof carried, "kvbridge_peer_transport{peer=\"127.0.0.1:%u\",carried_by=\"%s%s\"} ",
             kvb_prefill_node_port(pn), g_backend ? "ucx " : "tcp", ucx_lanes);
    if (kvbt_metric(kvb_decode_node_port(dn), carried) != 1) fail_msg("no sample %s1 in /metrics", carried);
    int32_t ids[1200];
    kvbt_prompt_ids(ids, 1200, 7);
    const int lens[] = {700, 900, 1200}; /* each turn extends the previous prompt */
    int prev_ship = 0;
    for (int t = 0; t < 3; t++) {
        kvbt_reply b, n;
        double bytes0 = kvbt_metric(kvb_decode_node_port(dn), "kvbridge_slab_bytes_total ");
        kvbt_complete_ids(kvb_decode_node_port(dn), ids, lens[t], &b);
        kvbt_complete_ids(kvb_decode_node_port(nat), ids, lens[t], &n);
        /* shipped: whole blocks and the tail, everything before the last prompt token */
        int ship = (lens[t] - 1) / 32 * 32, shipped = lens[t] - 1;
        assert_string_equal(b.verdict, "complete");
        assert_int_equal(b.cached, prev_ship);            /* the previous turn's blocks were cached */
        assert_int_equal(b.bridged, shipped - prev_ship); /* only the increment was shipped */
        assert_int_equal(b.native, 1);                    /* the decoder computed the last token only */
        assert_true(b.pipelined);                         /* ... while the blocks arrived */
        assert_false(n.pipelined);
        double bytes = kvbt_metric(kvb_decode_node_port(dn), "kvbridge_slab_bytes_total ") - bytes0;
        /* tiny: 4 layers x K,V x 2 kv heads x 64 dims x f16 = 2048 bytes per token */
        assert_true(bytes == (double)(shipped - prev_ship) * 2048.0);
        assert_string_equal(b.content, n.content); /* same answer as computing everything natively */
        assert_true(strncmp(n.verdict, "declined: no prefill node", 25) == 0);
        prev_ship = ship;
        free(b.content);
        free(n.content);
    }
    /* three bridged completions: each phase observed once per request, transfer and prefill too */
    assert_true(kvbt_metric(kvb_decode_node_port(dn), "kvbridge_request_phase_seconds_count{phase=\"tokenize\"} ") == 3);
    assert_true(kvbt_metric(kvb_decode_node_port(dn), "kvbridge_request_phase_seconds_count{phase=\"transfer\"} ") == 3);
    assert_true(kvbt_metric(kvb_decode_node_port(dn), "kvbridge_request_phase_seconds_count{phase=\"decode\"} ") == 3);
    assert_true(kvbt_metric(kvb_decode_node_port(dn), "kvbridge_request_phase_seconds_sum{phase=\"transfer\"} ") > 0);
    assert_true(kvbt_metric(kvb_decode_node_port(nat), "kvbridge_request_phase_seconds_count{phase=\"transfer\"} ") == 0);
    /* capture memory on the prefill node is the ring, not the prompt */
    assert_true(kvb_prefill_node_peak_capture_bytes(pn) <= 16 * 2 * 32 * 2 * 4 * 2 * 64 * 2);
    kvb_decode_node_stop(nat);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
    g_lanes = 0;
}

static void test_multiturn_ships_only_increments(void **state) {
    (void)state;
    multiturn_ships_only_increments(0); /* the default: 4 lanes */
}
static void test_multiturn_one_lane(void **state) {
    (void)state;
    multiturn_ships_only_increments(1); /* one connection, no LANE frame (protocol 2's way) */
}
/* The same loop with both nodes on the UCX backend (--transport ucx): replies equal native. */
static void test_multiturn_over_ucx(void **state) {
    (void)state;
    kvb_err err = {0};
    if (kvb_wire_backend_by_name("ucx", &g_backend, &err)) skip();
    char lanes[256];
    kvb_ucx_last_lanes(lanes, sizeof lanes);
    assert_string_equal(lanes, "none yet");
    multiturn_ships_only_increments(0);
    g_backend = NULL;
    kvb_ucx_last_lanes(lanes, sizeof lanes); /* the nodes' lanes did go through UCX */
    print_message("    UCX lanes: %s\n", lanes);
    assert_non_null(strchr(lanes, '/'));
}

static void test_multiturn_three_lanes(void **state) {
    (void)state;
    multiturn_ships_only_increments(3);
}

/* Dials the prefill node as a decode node would (decoder mode, f16, 32-token blocks). */
static kvb_conn *dial_as_decoder(uint16_t port, const kvb_model *m, kvb_kvformat *f) {
    kvb_err err = {0};
    kvb_hello h;
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    assert_int_equal(kvb_model_kvformat(&m->d, KVB_TYPE_F16, 32, f, &err), KVB_OK);
    assert_int_equal(kvb_hello_init(&h, KVB_ROLE_DECODE, KVB_BRIDGE_MODE_DECODER, "t", m->fingerprint, f, &err), KVB_OK);
    kvb_transport_config tc = {.psk = (const uint8_t *)PSK, .psk_len = strlen(PSK)};
    kvb_conn *c = NULL;
    if (kvb_transport_connect(addr, &h, &tc, 5000, &c, NULL, &err)) fail_msg("connect: %s", err.msg);
    return c;
}

static void lane_and_ping(kvb_conn *c, uint64_t group, uint32_t lane, uint32_t lanes) {
    kvb_err err = {0};
    kvb_msg_lane l = {.group = group, .lane = lane, .lanes = lanes};
    assert_int_equal(kvb_conn_send_lane(c, &l, 5000, &err), KVB_OK);
    assert_int_equal(kvb_conn_send_ping(c, 7, 5000, &err), KVB_OK);
    kvb_msg m;
    assert_int_equal(kvb_conn_recv(c, 5000, &m, &err), KVB_OK);
    assert_int_equal(m.type, KVB_FRAME_PONG);
}

/* The lane group on the wire: a PREFILL on lane 0 of a 3-lane group is answered over all three —
 * more than one lane carries slabs, each lane's DONE counts exactly that lane's slabs, the sum is the
 * whole request's (4 layers x 20 blocks) — and the same PREFILL on lane 0 of a group whose other
 * lanes never connected is refused with a message, not answered on one lane. */
static void test_lane_group_on_the_wire(void **state) {
    (void)state;
    kvb_prefill_node *pn = start_prefill(g_model, PSK, NULL);
    kvb_model *m = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_model_load(g_model, &m, &err), KVB_OK);
    kvb_kvformat f;
    kvb_conn *c[3];
    for (int l = 0; l < 3; l++) c[l] = dial_as_decoder(kvb_prefill_node_port(pn), m, &f);
    for (int l = 0; l < 3; l++) lane_and_ping(c[l], 0x1234, (uint32_t)l, 3);
    int32_t ids[641];
    kvbt_prompt_ids(ids, 641, 11);
    kvb_msg_prefill p = {.request_id = 5, .bridge_mode = KVB_BRIDGE_MODE_DECODER, .n_tokens = 641,
                         .cached_tokens = 0, .ship_tokens = 640,
                         .last_cached_key = kvb_chain_root(m->fingerprint, kvb_kvformat_fingerprint(&f)),
                         .tokens = ids};
    assert_int_equal(kvb_conn_send_prefill(c[0], &p, 5000, &err), KVB_OK);
    uint32_t total = 0, lanes_used = 0;
    for (int l = 0; l < 3; l++) {
        uint32_t slabs = 0;
        for (;;) {
            kvb_msg r;
            if (kvb_conn_recv(c[l], 20000, &r, &err)) fail_msg("lane %d: %s", l, err.msg);
            assert_int_equal(r.request_id, 5);
            if (r.type == KVB_FRAME_SLAB) {
                slabs++;
                continue;
            }
            assert_int_equal(r.type, KVB_FRAME_DONE);
            assert_int_equal(r.u.done.slabs, slabs); /* this lane's own */
            assert_int_equal(r.u.done.blocks, 20);
            break;
        }
        lanes_used += slabs > 0;
        total += slabs;
    }
    /* striped: the senders take slabs as they come free, so more than one lane carries them; not
     * necessarily every lane — on a loaded 2-core machine (CI under ASan) one lane's sender once
     * found all 80 slabs of this short request taken by the other two */
    assert_true(lanes_used >= 2);
    assert_int_equal(total, 4 * 20);
    for (int l = 0; l < 3; l++) kvb_conn_close(c[l]);

    /* lane 0 of 2, lane 1 never connected: refused on lane 0 with the reason */
    kvb_conn *solo = dial_as_decoder(kvb_prefill_node_port(pn), m, &f);
    lane_and_ping(solo, 0x5678, 0, 2);
    assert_int_equal(kvb_conn_send_prefill(solo, &p, 5000, &err), KVB_OK);
    kvb_msg r;
    assert_int_equal(kvb_conn_recv(solo, 20000, &r, &err), KVB_OK);
    assert_int_equal(r.type, KVB_FRAME_ERROR);
    assert_non_null(strstr(r.u.error.msg, "lane 1 of the 2"));
    kvb_conn_close(solo);
    kvb_model_free(m);
    kvb_prefill_node_stop(pn);
}

/* The pipelined tail at the block edges, against the same prompts computed natively (greedy
 * replies equal; a second turn then reuses the block holding the last token's row):
 *   - the last token first in a fresh block (no tail: the pipe takes a page for it);
 *   - the last token filling the tail's block (the block is committed as the sequence adopts it);
 *   - a tail in between; and the same with KVB_DECODE_PIPELINED_TAIL=0 (run after the transfer). */
static void test_pipelined_tail_edges(void **state) {
    (void)state;
    kvb_prefill_node *pn = start_prefill(g_model, PSK, NULL);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    kvb_decode_node *nat = start_decode(0, PSK, 10000);
    int32_t ids[1400];
    static const struct {
        int len, next; /* a first turn and a longer second one sharing its prefix */
        bool pipelined, env_off;
    } cases[] = {{641, 900, true, false}, {640, 800, true, false}, {650, 1000, true, false},
                 {650, 1000, false, true}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        kvbt_prompt_ids(ids, 1400, 500 + c);
        if (cases[c].env_off) setenv("KVB_DECODE_PIPELINED_TAIL", "0", 1);
        for (int turn = 0; turn < 2; turn++) {
            const int len = turn ? cases[c].next : cases[c].len;
            kvbt_reply b, n;
            kvbt_complete_ids(kvb_decode_node_port(dn), ids, len, &b);
            kvbt_complete_ids(kvb_decode_node_port(nat), ids, len, &n);
            if (strcmp(b.verdict, "complete") != 0) fail_msg("case %zu turn %d: verdict %s", c, turn, b.verdict);
            const bool want = turn ? !cases[c].env_off : cases[c].pipelined;
            if (b.pipelined != want) fail_msg("case %zu turn %d (%d tokens): pipelined %d", c, turn, len, b.pipelined);
            assert_int_equal(b.native, 1);
            if (strcmp(b.content, n.content) != 0)
                fail_msg("case %zu turn %d: bridged '%s' vs native '%s'", c, turn, b.content, n.content);
            free(b.content);
            free(n.content);
        }
        unsetenv("KVB_DECODE_PIPELINED_TAIL");
    }
    kvb_decode_node_stop(nat);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

/* Sliding-window layers (tiny-gemma3: 5 local layers, window 16, then 1 global): every turn ships
 * its increment's global rows and only the local rows the decoder keeps (from the last shipped
 * block's position - 15 on), the answers equal the native ones on the same decoder, and a prompt
 * that shares only blocks whose local rows were never kept is not handed them: it is bridged again
 * from 0, still equal to native. */
static void test_gemma3_window_multiturn(void **state) {
    (void)state;
    kvb_model *m = NULL;
    kvb_kvformat f;
    kvb_err err = {0};
    if (kvb_model_load(g_gemma, &m, &err) || kvb_model_kvformat(&m->d, KVB_TYPE_F16, 32, &f, &err))
        fail_msg("%s", err.msg);
    assert_int_equal(f.window, 16);
    assert_int_equal(f.n_local, 5);
    kvb_prefill_node *pn = start_prefill(g_gemma, PSK, NULL);
    char peer[32];
    snprintf(peer, sizeof peer, "127.0.0.1:%u", kvb_prefill_node_port(pn));
    kvb_decode_config c = {.http_listen = "127.0.0.1:0", .peer = peer, .model_path = g_gemma, .psk = PSK,
                           .n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096,
                           .peer_timeout_ms = 10000};
    kvb_decode_config cn = c;
    cn.peer = NULL;
    kvb_decode_node *dn = NULL, *nat = NULL;
    if (kvb_decode_node_start(&c, &dn, &err) || kvb_decode_node_start(&cn, &nat, &err)) fail_msg("%s", err.msg);
    int32_t ids[600];
    kvbt_prompt_ids(ids, 600, 77);
    const int lens[] = {300, 420, 600};
    uint32_t prev_ship = 0;
    for (int t = 0; t < 3; t++) {
        kvbt_reply b, n;
        double bytes0 = kvbt_metric(kvb_decode_node_port(dn), "kvbridge_slab_bytes_total ");
        kvbt_complete_ids(kvb_decode_node_port(dn), ids, lens[t], &b);
        kvbt_complete_ids(kvb_decode_node_port(nat), ids, lens[t], &n);
        const uint32_t shipped = (uint32_t)lens[t] - 1, ship = shipped / 32 * 32;
        assert_string_equal(b.verdict, "complete");
        assert_int_equal(b.cached, prev_ship); /* the previous turn's blocks, their window kept */
        assert_int_equal(b.bridged, shipped - prev_ship);
        assert_int_equal(b.native, 1);
        uint64_t g, l;
        kvb_kvformat_ship_bytes(&f, prev_ship, shipped, &g, &l);
        double bytes = kvbt_metric(kvb_decode_node_port(dn), "kvbridge_slab_bytes_total ") - bytes0;
        uint64_t per_g, per_l;
        kvb_kvformat_token_bytes(&f, &per_g, &per_l);
        assert_true(l <= (uint64_t)(16 + 32 - 1) * per_l); /* local rows: the window only (< 47 positions) */
        assert_true(g == (uint64_t)(shipped - prev_ship) * per_g);
        assert_true(bytes == (double)(g + l));       /* what was shipped: global all, local the kept rows */
        assert_string_equal(b.content, n.content);   /* the native answer on the same decoder */
        prev_ship = ship;
        free(b.content);
        free(n.content);
    }
    /* shares blocks 0..5 only, whose local rows were never kept: not adopted, bridged again */
    int32_t other[350];
    memcpy(other, ids, sizeof(int32_t) * 200);
    kvbt_prompt_ids(other + 200, 150, 78);
    kvbt_reply b, n;
    kvbt_complete_ids(kvb_decode_node_port(dn), other, 350, &b);
    kvbt_complete_ids(kvb_decode_node_port(nat), other, 350, &n);
    assert_string_equal(b.verdict, "complete");
    assert_int_equal(b.cached, 0);
    assert_int_equal(b.bridged, 349);
    assert_string_equal(b.content, n.content);
    free(b.content);
    free(n.content);
    kvb_decode_node_stop(nat);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
    kvb_model_free(m);
}

/* A fault during bridging: the answer equals the native one; the verdict is honest; a link fault
 * is resumed (up to the decode node's budget, g_resumes) by asking only for the missing blocks,
 * and `attempts` PREFILLs went out. */
static void check_fault(const char *fault, const char *model, const char *psk_prefill, bool start_peer,
                        int timeout_ms, const char *verdict_prefix, int attempts, const char *fault_series) {
    kvb_prefill_node *pn = start_peer ? start_prefill(model, psk_prefill, fault) : NULL;
    uint16_t port = pn ? kvb_prefill_node_port(pn) : 1; /* port 1: nothing listens */
    kvb_decode_node *dn = start_decode(port, PSK, timeout_ms);
    kvb_decode_node *nat = start_decode(0, PSK, timeout_ms);
    /* a peer that refused the lanes at start (down, wrong key, other model) is not dialled by the
     * request below: the link's own thread dials it with back-off, and the verdict says why */
    if (!start_peer || strcmp(psk_prefill, PSK) || model != g_model)
        assert_true(peer_up(dn, port) == 0);
    int32_t ids[600];
    kvbt_prompt_ids(ids, 600, 99);
    kvbt_reply b, n;
    kvbt_complete_ids(kvb_decode_node_port(dn), ids, 600, &b);
    kvbt_complete_ids(kvb_decode_node_port(nat), ids, 600, &n);
    if (strncmp(b.verdict, verdict_prefix, strlen(verdict_prefix)) != 0)
        fail_msg("fault %s: verdict '%s', expected '%s...'", fault ? fault : "-", b.verdict, verdict_prefix);
    assert_string_equal(b.content, n.content);
    if (b.attempts != attempts) fail_msg("fault %s: %d bridge attempts, expected %d", fault, b.attempts, attempts);
    assert_true(kvbt_metric(kvb_decode_node_port(dn), "kvbridge_bridge_resumes_total ") ==
                (attempts > 1 ? attempts - 1 : 0));
    if (!strcmp(verdict_prefix, "complete")) { /* resumed: every block bridged in the end */
        assert_int_equal(b.bridged, 599);
        assert_int_equal(b.native, 1);
        assert_true(b.faults[0] != '\0'); /* the fault it recovered from is reported */
        /* the resumed attempt asked only for what was missing: a fault late in the prompt leaves
         * far fewer slabs than the whole prompt's (tiny: 4 layers x (18 blocks + the tail) = 76) */
        kvb_staging_stats last = {0};
        kvb_prefill_node_last_staging(pn, &last);
        if (last.slabs >= 76 / 2) fail_msg("fault %s: the resumed attempt sent %u slabs", fault, last.slabs);
    } else {
        assert_true(b.bridged < 599); /* never reported as fully bridged */
        assert_false(b.pipelined);    /* the pipelined tail's result is never used after a fault */
        if (attempts) assert_true(b.faults[0] != '\0');
    }
    if (fault_series) assert_true(kvbt_metric(kvb_decode_node_port(dn), fault_series) >= (attempts > 1 ? attempts - 1 : 1));
    free(b.content);
    free(n.content);
    kvb_decode_node_stop(nat);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

#define FAULT_CORRUPT "kvbridge_bridge_faults_total{kind=\"corrupt_slab\"} "
#define FAULT_LOST "kvbridge_bridge_faults_total{kind=\"peer_lost\"} "
#define FAULT_DONE "kvbridge_bridge_faults_total{kind=\"done_mismatch\"} "

static void test_fault_corrupt_slab(void **state) { /* resumes off: what arrived stays, the rest is native */
    (void)state;
    g_resumes = -1;
    check_fault("corrupt:30", g_model, PSK, true, 10000, "partial ", 1, FAULT_CORRUPT);
    g_resumes = 0;
}
static void test_fault_corrupt_slab_resumed(void **state) { /* once, late: the resumed attempt completes */
    (void)state;
    check_fault("corrupt:70x1", g_model, PSK, true, 10000, "complete", 2, FAULT_CORRUPT);
}
static void test_fault_corrupt_every_attempt(void **state) { /* block 0 never arrives: 1 + 2 resumes */
    (void)state;
    check_fault("corrupt:1", g_model, PSK, true, 10000, "partial 0/18", 3, FAULT_CORRUPT);
}
static void test_fault_peer_killed(void **state) {
    (void)state;
    g_resumes = -1;
    check_fault("die:40", g_model, PSK, true, 10000, "partial ", 1, FAULT_LOST);
    g_resumes = 0;
}
static void test_fault_peer_killed_resumed(void **state) { /* reconnects, asks for the rest */
    (void)state;
    check_fault("die:70x1", g_model, PSK, true, 10000, "complete", 2, FAULT_LOST);
}
static void test_fault_peer_stalls(void **state) { /* a stall is not resumed: it would cost another timeout */
    (void)state;
    check_fault("stall:10", g_model, PSK, true, 400, "partial ", 1, "kvbridge_bridge_faults_total{kind=\"timeout\"} ");
}
static void test_fault_peer_down(void **state) {
    (void)state;
    check_fault(NULL, g_model, PSK, false, 10000, "declined: prefill node unavailable", 0,
                "kvbridge_bridge_faults_total{kind=\"peer_down\"} ");
}
static void test_fault_wrong_key(void **state) {
    (void)state;
    check_fault(NULL, g_model, "another-key-0123456789", true, 10000, "declined: prefill node unavailable", 0, NULL);
}
static void test_fault_other_model(void **state) {
    (void)state;
    check_fault(NULL, g_other, PSK, true, 10000, "declined: prefill node unavailable", 0, NULL);
}

/* The link faults with both nodes on the UCX backend, payloads of 4 KiB and more through the
 * decode node's receive ring (KVB_UCX_TAG_MIN: the tiny model's slabs are 16 KiB): a corrupt slab
 * and a killed peer resumed to complete, a stall, a wrong key; the same verdicts and answers as
 * over TCP. */
static void test_faults_over_ucx(void **state) {
    (void)state;
    kvb_err err = {0};
    if (kvb_wire_backend_by_name("ucx", &g_backend, &err)) skip();
    setenv("KVB_UCX_TAG_MIN", "4096", 1);
    check_fault("corrupt:70x1", g_model, PSK, true, 10000, "complete", 2, FAULT_CORRUPT);
    check_fault("die:70x1", g_model, PSK, true, 10000, "complete", 2, FAULT_LOST);
    check_fault("stall:10", g_model, PSK, true, 400, "partial ", 1, "kvbridge_bridge_faults_total{kind=\"timeout\"} ");
    check_fault(NULL, g_model, "another-key-0123456789", true, 10000, "declined: prefill node unavailable", 0, NULL);
    unsetenv("KVB_UCX_TAG_MIN");
    g_backend = NULL;
}

static void reference_engine(kvb_model **m, kvb_engine **e, kvb_seq **s);
static void reference_engine_free(kvb_model *m, kvb_engine *e, kvb_seq *s);

/* A prefill peer of its own that answers every PREFILL with one well-formed, checksummed slab for
 * a block outside the range asked for: the block before the cached prefix ends (position 0). */
typedef struct {
    kvb_listener *l;
    kvb_hello hello;
    kvb_transport_config tc;
    size_t slab_bytes; /* K (and V) of one block of one layer */
    int prefills;      /* PREFILLs answered */
    const kvb_store *done_store; /* non-NULL: answer with no slab and a DONE that is right in every
                                    field but the blocks it claims were never sent */
    bool past_end;               /* the slab is for the block just past the range asked for */
} stray_peer;

static void *stray_peer_main(void *arg) {
    stray_peer *p = arg;
    kvb_conn *c = NULL;
    kvb_err err = {0};
    if (kvb_transport_accept(p->l, &p->hello, &p->tc, 30000, &c, NULL, &err)) return NULL;
    uint8_t *k = calloc(1, p->slab_bytes), *v = calloc(1, p->slab_bytes);
    kvb_msg m = {0};
    while (k && v && !kvb_conn_recv(c, 60000, &m, &err)) { /* until the decode node closes the lane */
        if (m.type == KVB_FRAME_PREFILL && p->done_store) {
            const kvb_msg_prefill *q = &m.u.prefill;
            kvb_msg_done d;
            p->prefills++;
            if (!kvb_bridge_done_for(p->done_store, q->tokens, q->cached_tokens, q->ship_tokens, 0, &d, &err))
                kvb_conn_send_done(c, m.request_id, &d, 5000, &err);
        } else if (m.type == KVB_FRAME_PREFILL) {
            kvb_msg_slab sl = {.layer = 0, .pos0 = p->past_end ? m.u.prefill.ship_tokens : 0, .n = 32, .k = k,
                               .v = v, .k_bytes = p->slab_bytes, .v_bytes = p->slab_bytes};
            sl.checksum = kvb_slab_checksum(k, p->slab_bytes, v, p->slab_bytes);
            /* position 0 is outside what was asked once a prefix is cached; past the end always */
            p->prefills += p->past_end || m.u.prefill.cached_tokens > 0;
            kvb_conn_send_slab(c, m.request_id, &sl, 5000, &err);
        } else if (m.type == KVB_FRAME_PING) { /* the link's heartbeat: alive, only its slabs are wrong */
            kvb_conn_send_pong(c, m.u.ping.token, 5000, &err);
        }
        kvb_msg_free(&m);
    }
    free(k);
    free(v);
    kvb_conn_close(c);
    return NULL;
}

/* A slab outside the range the decode node asked for (a block of its cached prefix) is refused by
 * the receiver before the store sees it: a corrupt_slab fault, the verdict partial, nothing
 * bridged, the answer the native one. */
static void test_fault_slab_outside_range(void **state) {
    (void)state;
    kvb_model *m;
    kvb_engine *e;
    kvb_seq *s;
    reference_engine(&m, &e, &s); /* the decoder's model and cache format, for the peer's HELLO */
    stray_peer p = {.tc = {.psk = (const uint8_t *)PSK, .psk_len = strlen(PSK)}};
    const kvb_kvformat *f = kvb_engine_kvformat(e);
    p.slab_bytes = 32 * (size_t)m->d.n_head_kv * kvb_kvformat_row_bytes(f);
    kvb_err err = {0};
    assert_int_equal(kvb_hello_init(&p.hello, KVB_ROLE_PREFILL, KVB_BRIDGE_MODE_DECODER, "stray", m->fingerprint, f,
                                    &err), KVB_OK);
    assert_int_equal(kvb_transport_listen("127.0.0.1:0", NULL, &p.l, &err), KVB_OK);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, stray_peer_main, &p), 0);
    g_lanes = 1;
    g_resumes = -1;
    kvb_decode_node *dn = start_decode(kvb_listener_port(p.l), PSK, 10000);
    kvb_decode_node *nat = start_decode(0, PSK, 10000);
    g_lanes = 0;
    g_resumes = 0;
    int32_t ids[400];
    kvbt_prompt_ids(ids, 400, 4242);
    kvbt_reply a, b, n;
    kvbt_complete_ids(kvb_decode_node_port(dn), ids, 40, &a); /* under the threshold: native, block 0 cached */
    assert_int_equal(a.bridged, 0);
    kvbt_complete_ids(kvb_decode_node_port(dn), ids, 400, &b);
    kvbt_complete_ids(kvb_decode_node_port(nat), ids, 400, &n);
    assert_int_equal(b.cached, 32);
    if (strncmp(b.verdict, "partial 0/", 10)) fail_msg("verdict '%s'", b.verdict);
    assert_int_equal(b.bridged, 0);
    assert_string_equal(b.content, n.content);
    assert_true(kvbt_metric(kvb_decode_node_port(dn), FAULT_CORRUPT) == 1);
    assert_int_equal(p.prefills, 1);
    free(a.content);
    free(b.content);
    free(n.content);
    kvb_decode_node_stop(nat);
    kvb_decode_node_stop(dn); /* closes the lane: the peer's thread ends */
    pthread_join(th, NULL);
    kvb_listener_close(p.l);
    reference_engine_free(m, e, s);
}

/* Runs prompts of 385 tokens (12 whole blocks shipped, no tail: the last token is the decoder's
 * own) and, with n_prompts 2, 400 (12 blocks and a 15-token tail) against the stray peer p, which
 * serves one connection: nothing bridged, verdict partial, the native answer, one more fault of
 * kind `fault` each, and the receiver's own reason (`why`) in the reply's bridge faults. */
static void stray_peer_run(stray_peer *p, const kvb_model *m, const kvb_kvformat *f, const char *fault,
                           const char *why, int n_prompts) {
    kvb_err err = {0};
    p->tc = (kvb_transport_config){.psk = (const uint8_t *)PSK, .psk_len = strlen(PSK)};
    p->slab_bytes = 32 * (size_t)m->d.n_head_kv * kvb_kvformat_row_bytes(f);
    assert_int_equal(kvb_hello_init(&p->hello, KVB_ROLE_PREFILL, KVB_BRIDGE_MODE_DECODER, "stray", m->fingerprint, f,
                                    &err), KVB_OK);
    assert_int_equal(kvb_transport_listen("127.0.0.1:0", NULL, &p->l, &err), KVB_OK);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, stray_peer_main, p), 0);
    g_lanes = 1;
    g_resumes = -1;
    kvb_decode_node *dn = start_decode(kvb_listener_port(p->l), PSK, 10000);
    kvb_decode_node *nat = start_decode(0, PSK, 10000);
    g_lanes = 0;
    g_resumes = 0;
    const int lens[2] = {385, 400};
    for (int i = 0; i < n_prompts; i++) {
        int32_t ids[400];
        kvbt_prompt_ids(ids, lens[i], 4343 + i);
        kvbt_reply b, n;
        kvbt_complete_ids(kvb_decode_node_port(dn), ids, lens[i], &b);
        kvbt_complete_ids(kvb_decode_node_port(nat), ids, lens[i], &n);
        if (strncmp(b.verdict, "partial 0/", 10)) fail_msg("%d tokens: verdict '%s'", lens[i], b.verdict);
        assert_int_equal(b.bridged, 0);
        assert_string_equal(b.content, n.content);
        assert_int_equal(p->prefills, i + 1);
        assert_true(kvbt_metric(kvb_decode_node_port(dn), fault) == i + 1);
        if (!strstr(b.faults, why)) fail_msg("%d tokens: faults '%s' lack '%s'", lens[i], b.faults, why);
        free(b.content);
        free(n.content);
    }
    kvb_decode_node_stop(nat);
    kvb_decode_node_stop(dn);
    pthread_join(th, NULL);
    kvb_listener_close(p->l);
}

/* A peer whose DONE is right in every field (tokens covered, blocks, chain digest, its slab
 * count) but that never sent the blocks it claims: the receiver counts what was committed, not
 * what DONE says, and refuses that DONE (a done_mismatch fault), whole blocks and a tail alike. */
static void test_fault_done_without_blocks(void **state) {
    (void)state;
    kvb_model *m;
    kvb_engine *e;
    kvb_seq *s;
    reference_engine(&m, &e, &s);
    stray_peer p = {.done_store = kvb_engine_store(e)};
    stray_peer_run(&p, m, kvb_engine_kvformat(e), FAULT_DONE, "DONE does not match what arrived", 2);
    reference_engine_free(m, e, s);
}

/* A slab for the block just past the range asked for (12 whole blocks, no tail) is refused by the
 * receiver's range check like one before it (the link is then dropped: one prompt). */
static void test_fault_slab_past_range(void **state) {
    (void)state;
    kvb_model *m;
    kvb_engine *e;
    kvb_seq *s;
    reference_engine(&m, &e, &s);
    stray_peer p = {.past_end = true};
    stray_peer_run(&p, m, kvb_engine_kvformat(e), FAULT_CORRUPT, "outside the shipped range", 1);
    reference_engine_free(m, e, s);
}

/* Ingest without decoding: a completion with max_tokens 0 warms the decoder's cache with a
 * document (bridged, nothing generated); the next request that starts with it ships only the
 * rest. */
static void test_ingest_without_decoding(void **state) {
    (void)state;
    kvb_prefill_node *pn = start_prefill(g_model, PSK, NULL);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    int32_t ids[900];
    kvbt_prompt_ids(ids, 900, 77);
    kvbt_reply a, b;
    kvbt_complete_ids_n(kvb_decode_node_port(dn), ids, 700, 0, &a);
    assert_string_equal(a.verdict, "complete");
    assert_int_equal(a.bridged, 699);
    assert_string_equal(a.content, "");
    kvbt_complete_ids_n(kvb_decode_node_port(dn), ids, 900, 4, &b);
    assert_string_equal(b.verdict, "complete");
    assert_int_equal(b.cached, 699 / 32 * 32); /* the document's whole blocks */
    assert_int_equal(b.bridged, 899 - 699 / 32 * 32);
    free(a.content);
    free(b.content);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

/* Concurrent requests: served two at a time with their decode steps batched (and prompts over
 * 256 tokens computed in slices between batches), five clients at once (so three wait their turn)
 * get exactly the replies a one-at-a-time node gives, and the steps did run in batches of more
 * than one. */
typedef struct {
    uint16_t port;
    int32_t ids[600];
    int n, max_tokens; /* 0: 32 */
    bool ignore_eos;
    kvbt_reply r;
} client_job;

static void complete_job(uint16_t port, client_job *j, kvbt_reply *r) {
    if (j->ignore_eos) kvbt_complete_ids_all(port, j->ids, j->n, j->max_tokens, r);
    else kvbt_complete_ids_n(port, j->ids, j->n, j->max_tokens ? j->max_tokens : 32, r);
}

static void *client_main(void *arg) {
    client_job *j = arg;
    complete_job(j->port, j, &j->r);
    return NULL;
}

static void test_concurrent_requests_batch_exactly(void **state) {
    (void)state;
    enum { CLIENTS = 5 };
    g_parallel = 2;
    kvb_decode_node *par = start_decode(0, PSK, 10000);
    g_parallel = 1;
    kvb_decode_node *one = start_decode(0, PSK, 10000);
    g_parallel = 0;
    client_job jobs[CLIENTS];
    memset(jobs, 0, sizeof jobs);
    pthread_t th[CLIENTS];
    for (int c = 0; c < CLIENTS; c++) {
        jobs[c].port = kvb_decode_node_port(par);
        jobs[c].n = 100 + 120 * c; /* different positions in one batch; the longer prompts yield the
                                      engine to the others' steps between slices */
        kvbt_prompt_ids(jobs[c].ids, jobs[c].n, 300 + (uint64_t)c);
        assert_int_equal(pthread_create(&th[c], NULL, client_main, &jobs[c]), 0);
    }
    for (int c = 0; c < CLIENTS; c++) pthread_join(th[c], NULL);
    for (int c = 0; c < CLIENTS; c++) {
        kvbt_reply seq;
        kvbt_complete_ids_n(kvb_decode_node_port(one), jobs[c].ids, jobs[c].n, 32, &seq);
        if (strcmp(seq.content, jobs[c].r.content))
            fail_msg("client %d: batched '%s' != one at a time '%s'", c, jobs[c].r.content, seq.content);
        free(seq.content);
        free(jobs[c].r.content);
    }
    const uint16_t pp = kvb_decode_node_port(par), op = kvb_decode_node_port(one);
    const double steps = kvbt_metric(pp, "kvbridge_decode_steps_total "),
                 batches = kvbt_metric(pp, "kvbridge_decode_batches_total ");
    printf("parallel 2: %.0f steps in %.0f batches\n", steps, batches);
    assert_true(steps > batches && batches > 0); /* some steps ran together */
    assert_true(kvbt_metric(op, "kvbridge_decode_steps_total ") == kvbt_metric(op, "kvbridge_decode_batches_total "));
    assert_true(kvbt_metric(pp, "kvbridge_queue_depth ") == 0);
    char cmd[128], health[1024];
    snprintf(cmd, sizeof cmd, "curl -s http://127.0.0.1:%u/health", pp);
    assert_int_equal(kvbt_sh(cmd, health, sizeof health, 0), 0);
    if (!strstr(health, "\"parallel\":2") || !strstr(health, "\"requests_served\":0") ||
        !strstr(health, "\"requests_waiting\":0"))
        fail_msg("/health: %s", health);
    kvb_decode_node_stop(one);
    kvb_decode_node_stop(par);
}

/* A bridged prompt's transfer does not stop the others' streams: while its layers arrive (the
 * prefill node pauses 2 s before the first slab), the request already decoding goes on, its steps
 * run at the pipelined tail's gate (or, with the tail after the transfer, as batches on the engine
 * the prompt lent them). Both replies equal a one-at-a-time node's, and the bridged one is still
 * complete. */
static void decode_during_bridge(bool tail_after) {
    kvb_prefill_node *pn = start_prefill(g_model, PSK, "pause:1x1");
    g_parallel = 2;
    g_tail_after = tail_after;
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    g_tail_after = false;
    g_parallel = 1;
    kvb_decode_node *one = start_decode(0, PSK, 10000);
    g_parallel = 0;
    const uint16_t dp = kvb_decode_node_port(dn);
    client_job a = {.port = dp, .n = 40, .max_tokens = 300, .ignore_eos = true},
               b = {.port = dp, .n = 600, .max_tokens = 8};
    kvbt_prompt_ids(a.ids, a.n, 901); /* under the bridge threshold: native, then a long reply */
    kvbt_prompt_ids(b.ids, b.n, 902);
    pthread_t ta, tb;
    assert_int_equal(pthread_create(&ta, NULL, client_main, &a), 0);
    while (kvbt_metric(dp, "kvbridge_decode_steps_total ") < 1) usleep(1000); /* a is decoding */
    const double t0 = kvb_now_s();
    assert_int_equal(pthread_create(&tb, NULL, client_main, &b), 0);
    pthread_join(tb, NULL);
    const double in_transfer = kvbt_metric(dp, "kvbridge_decode_steps_in_prompts_total ");
    pthread_join(ta, NULL);
    printf("bridged prompt took %.2f s; the other request ran %.0f decode steps meanwhile (%.0f in all)\n",
           kvb_now_s() - t0, in_transfer, kvbt_metric(dp, "kvbridge_decode_steps_total "));
    assert_string_equal(b.r.verdict, "complete");
    assert_true(b.r.pipelined == !tail_after);
    assert_true(in_transfer > 0);
    assert_int_equal(a.r.completion, a.max_tokens);
    client_job *jobs[] = {&a, &b};
    for (int c = 0; c < 2; c++) {
        kvbt_reply alone;
        complete_job(kvb_decode_node_port(one), jobs[c], &alone);
        if (strcmp(alone.content, jobs[c]->r.content))
            fail_msg("client %d: '%.80s' != one at a time '%.80s'", c, jobs[c]->r.content, alone.content);
        free(alone.content);
        free(jobs[c]->r.content);
    }
    kvb_decode_node_stop(one);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

static void test_concurrent_decode_during_bridge(void **state) {
    (void)state;
    decode_during_bridge(false);
}

static void test_concurrent_decode_during_bridge_tail_after(void **state) {
    (void)state;
    decode_during_bridge(true);
}

/* Admission by cache blocks: a node whose cache (100 blocks of 32 tokens) holds less than one full
 * context (128 blocks) serves four short requests at once (each reserves what its prompt and
 * max_tokens can fill), makes the second of two long ones wait until the first is done (cache_waits
 * 1), refuses one that could never fit with a 400 that names --cache-blocks, and every reply is the
 * one a one-at-a-time node gives. */
static void run_clients(client_job *jobs, int n) {
    pthread_t th[8];
    for (int c = 0; c < n; c++) assert_int_equal(pthread_create(&th[c], NULL, client_main, &jobs[c]), 0);
    for (int c = 0; c < n; c++) pthread_join(th[c], NULL);
}

static void check_against(uint16_t port, client_job *jobs, int n) {
    for (int c = 0; c < n; c++) {
        kvbt_reply seq;
        complete_job(port, &jobs[c], &seq);
        if (strcmp(seq.content, jobs[c].r.content))
            fail_msg("client %d: '%.60s' != one at a time '%.60s'", c, jobs[c].r.content, seq.content);
        free(seq.content);
        free(jobs[c].r.content);
    }
}

static void test_cache_budget_admission(void **state) {
    (void)state;
    g_cache_blocks = 30; /* a request reserves ceil((prompt + max_tokens) / 32) + 2 blocks */
    kvb_decode_node *par = start_decode(0, PSK, 10000); /* parallel 4 (the default) */
    g_parallel = 1;
    kvb_decode_node *one = start_decode(0, PSK, 10000);
    g_parallel = 0;
    g_cache_blocks = 0;
    const uint16_t pp = kvb_decode_node_port(par);
    client_job small[4], big[2];
    memset(small, 0, sizeof small);
    memset(big, 0, sizeof big);
    for (int c = 0; c < 4; c++) { /* 100 + 32 tokens: 7 blocks each, 28 together */
        small[c] = (client_job){.port = pp, .n = 100, .max_tokens = 32, .ignore_eos = true};
        kvbt_prompt_ids(small[c].ids, small[c].n, 500 + (uint64_t)c);
    }
    run_clients(small, 4);
    const double steps = kvbt_metric(pp, "kvbridge_decode_steps_total "),
                 batches = kvbt_metric(pp, "kvbridge_decode_batches_total ");
    printf("four short requests: %.0f steps in %.0f batches\n", steps, batches);
    assert_true(steps > batches);                                          /* served together */
    assert_true(kvbt_metric(pp, "kvbridge_cache_waits_total ") == 0);
    for (int c = 0; c < 2; c++) { /* 100 + 350 tokens: 17 blocks each, 34 together */
        big[c] = (client_job){.port = pp, .n = 100, .max_tokens = 350, .ignore_eos = true};
        for (int i = 0; i < 100; i++) big[c].ids[i] = 3 + (int32_t)((i * 7 + c * 13) % 250);
    }
    run_clients(big, 2);
    assert_true(kvbt_metric(pp, "kvbridge_cache_waits_total ") == 1);
    assert_true(kvbt_metric(pp, "kvbridge_cache_blocks_reserved ") == 0);
    /* 100 + 900 tokens: 34 blocks, more than the cache holds */
    kvb_http_reply h;
    kvbt_post_ids(pp, big[0].ids, 100, 900, false, &h);
    assert_int_equal(h.status, 400);
    if (!strstr(h.body, "--cache-blocks") || !strstr(h.body, "context_length_exceeded")) fail_msg("%s", h.body);
    kvb_http_reply_free(&h);
    char cmd[128], health[1024];
    snprintf(cmd, sizeof cmd, "curl -s http://127.0.0.1:%u/health", pp);
    assert_int_equal(kvbt_sh(cmd, health, sizeof health, 0), 0);
    if (!strstr(health, "\"cache_blocks_reserved\":0") || !strstr(health, "\"parallel\":4")) fail_msg("/health: %s", health);
    check_against(kvb_decode_node_port(one), small, 4);
    check_against(kvb_decode_node_port(one), big, 2);
    kvb_decode_node_stop(one);
    kvb_decode_node_stop(par);
}

/* Sends ids as a completion with curl, which hangs up after 0.5 s. */
static void post_and_hang_up(uint16_t port, const int32_t *ids, int n, const char *name) {
    char *body = kvbt_completion_json(ids, n, 4, false), path[512], cmd[1024], out[256];
    kvbt_tmp_path(path, sizeof path, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(body, f);
    fclose(f);
    free(body);
    snprintf(cmd, sizeof cmd, "curl -s -m 0.5 -H 'Content-Type: application/json' -d @'%s' "
             "http://127.0.0.1:%u/v1/completions; echo rc=$?", path, port);
    kvbt_sh(cmd, out, sizeof out, 1);
    assert_non_null(strstr(out, "rc=28")); /* curl's timeout: it hung up */
}

/* A client that goes away costs little: a bridged prompt holds the FIFO for 2 s (the prefill node
 * pauses), a second client sends its prompt and hangs up after 0.5 s; when its turn comes the node
 * counts it abandoned and computes none of it. A third client's own bridged prompt is paused the
 * same way and it hangs up mid-transfer: the node stops the bridge then. Neither prompt is found
 * cached later. */
static void test_abandoned_request_is_not_computed(void **state) {
    (void)state;
    kvb_prefill_node *pn = start_prefill(g_model, PSK, "pause:1x2");
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    const uint16_t dp = kvb_decode_node_port(dn);
    client_job c = {.port = dp, .n = 600, .max_tokens = 4};
    kvbt_prompt_ids(c.ids, c.n, 920);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, client_main, &c), 0);
    usleep(300000); /* its prompt phase is waiting for the paused slabs */
    int32_t ids[300], mid[700];
    kvbt_prompt_ids(ids, 300, 921);
    post_and_hang_up(dp, ids, 300, "abandoned.json");
    pthread_join(th, NULL);
    assert_string_equal(c.r.verdict, "complete");
    free(c.r.content);
    for (int i = 0; i < 100 && kvbt_metric(dp, "kvbridge_prompts_abandoned_total ") < 1; i++) usleep(20000);
    assert_true(kvbt_metric(dp, "kvbridge_prompts_abandoned_total ") == 1);
    kvbt_prompt_ids(mid, 700, 922); /* its own bridge pauses 2 s; it hangs up at 0.5 s */
    const double t0 = kvb_now_s();
    post_and_hang_up(dp, mid, 700, "abandoned-mid.json");
    for (int i = 0; i < 100 && kvbt_metric(dp, "kvbridge_prompts_abandoned_total ") < 2; i++) usleep(20000);
    assert_true(kvbt_metric(dp, "kvbridge_prompts_abandoned_total ") == 2);
    assert_true(kvbt_metric(dp, "kvbridge_bridge_faults_total{kind=\"client_gone\"} ") == 1);
    printf("the mid-transfer hang-up was noticed %.2f s after the request\n", kvb_now_s() - t0);
    kvbt_reply again;
    kvbt_complete_ids_n(dp, ids, 300, 4, &again);
    assert_int_equal(again.cached, 0); /* none of it was computed */
    free(again.content);
    kvbt_complete_ids_n(dp, mid, 700, 4, &again);
    assert_int_equal(again.cached, 0); /* the transfer stopped before any block arrived */
    free(again.content);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

/* The request's repetition penalties reach the sampler: greedy, the same prompt gives another reply
 * with presence_penalty 2 (the generated model repeats itself), and the same one with 0. */
static char *penalized_reply(uint16_t port, const char *penalty) {
    char cmd[512], out[4096];
    snprintf(cmd, sizeof cmd, "curl -s -H 'Content-Type: application/json' -d '{\"model\":\"m\",\"prompt\":[5,9,"
             "13,200,31,7,77,12],\"max_tokens\":24,\"temperature\":0,\"ignore_eos\":true%s}' "
             "http://127.0.0.1:%u/v1/completions", penalty, port);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    cJSON *root = cJSON_Parse(out);
    cJSON *text = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0), "text");
    if (!cJSON_IsString(text)) fail_msg("%s", out);
    char *r = strdup(text->valuestring);
    cJSON_Delete(root);
    return r;
}

static void test_penalties_reach_the_sampler(void **state) {
    (void)state;
    kvb_decode_node *dn = start_decode(0, PSK, 10000);
    const uint16_t dp = kvb_decode_node_port(dn);
    char *plain = penalized_reply(dp, ""), *zero = penalized_reply(dp, ",\"presence_penalty\":0"),
         *pres = penalized_reply(dp, ",\"presence_penalty\":2"),
         *freq = penalized_reply(dp, ",\"frequency_penalty\":2");
    printf("greedy: '%.60s'\npresence 2: '%.60s'\nfrequency 2: '%.60s'\n", plain, pres, freq);
    char *biased = penalized_reply(dp, ",\"logit_bias\":{\"70\":100}");
    assert_string_equal(plain, zero);
    assert_string_not_equal(plain, pres);
    assert_string_not_equal(plain, freq);
    assert_string_not_equal(plain, biased);
    free(biased);
    char cmd[512], out[2048]; /* a token id outside the vocabulary: 400, naming logit_bias */
    snprintf(cmd, sizeof cmd, "curl -s -w ' %%{http_code}' -H 'Content-Type: application/json' -d '{\"model\":\"m\","
             "\"prompt\":[5,9],\"max_tokens\":2,\"logit_bias\":{\"999999\":5}}' http://127.0.0.1:%u/v1/completions", dp);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    if (!strstr(out, " 400") || !strstr(out, "logit_bias")) fail_msg("%s", out);
    free(plain);
    free(zero);
    free(pres);
    free(freq);
    kvb_decode_node_stop(dn);
}

/* A greedy completion of ids with `extra` fields ("\"logprobs\":5", ...), bridging forced: the
 * parsed reply (cJSON_Delete it); *verdict (may be NULL) gets the X-KVBridge header. */
static cJSON *completion_with(uint16_t port, const int32_t *ids, int n, int max_tokens, const char *extra,
                              char *verdict, size_t verdict_cap) {
    char *body = kvbt_completion_json(ids, n, max_tokens, true);
    const size_t cap = strlen(body) + strlen(extra) + 64;
    char *req = malloc(cap);
    snprintf(req, cap, "%.*s,%s,\"kvbridge\":{\"bridge\":\"force\"}}", (int)strlen(body) - 1, body, extra);
    kvb_http_reply h;
    kvb_err err = {0};
    assert_int_equal(kvb_http_post("127.0.0.1", port, "/v1/completions", req, 120000, &h, &err), KVB_OK);
    if (h.status != 200) fail_msg("HTTP %d: %s", h.status, h.body);
    if (verdict) snprintf(verdict, verdict_cap, "%s", h.verdict);
    cJSON *root = cJSON_Parse(h.body);
    assert_non_null(root);
    kvb_http_reply_free(&h);
    free(req);
    free(body);
    return root;
}

static const cJSON *choice_field(const cJSON *root, const char *name) {
    return cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0), name);
}

/* The completion's "logprobs" object of a greedy request for ids with logprobs N (malloc'd JSON). */
static char *logprobs_reply(uint16_t port, const int32_t *ids, int n, int max_tokens, int top) {
    char extra[32];
    snprintf(extra, sizeof extra, "\"logprobs\":%d", top);
    cJSON *root = completion_with(port, ids, n, max_tokens, extra, NULL, 0);
    const cJSON *lp = choice_field(root, "logprobs");
    assert_true(cJSON_IsObject(lp));
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "tokens")),
                     (int)cJSON_GetObjectItem(cJSON_GetObjectItem(root, "usage"), "completion_tokens")->valuedouble);
    char *out = cJSON_PrintUnformatted(lp);
    cJSON_Delete(root);
    return out;
}

/* log_softmax of logits (n) at i, the slow way: long double. */
static long double ref_logprob(const float *l, uint32_t n, uint32_t i) {
    long double mx = l[0], sum = 0;
    for (uint32_t j = 1; j < n; j++) mx = l[j] > mx ? l[j] : mx;
    for (uint32_t j = 0; j < n; j++) sum += expl((long double)l[j] - mx);
    return (long double)l[i] - mx - logl(sum);
}

/* The decode nodes' model, engine settings and a fresh sequence, to compute what a node should. */
static void reference_engine(kvb_model **m, kvb_engine **e, kvb_seq **s) {
    kvb_err err = {0};
    assert_int_equal(kvb_model_load(g_model, m, &err), KVB_OK);
    kvb_engine_opts eo = {.n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 1024, .n_blocks = 64};
    assert_int_equal(kvb_engine_create(*m, &eo, e, &err), KVB_OK);
    assert_int_equal(kvb_seq_create(*e, s, &err), KVB_OK);
}

static void reference_engine_free(kvb_model *m, kvb_engine *e, kvb_seq *s) {
    kvb_seq_free(s);
    kvb_engine_free(e);
    kvb_model_free(m);
}

static int by_value_desc(const void *a, const void *b) {
    const long double x = *(const long double *)a, y = *(const long double *)b;
    return x > y ? -1 : x < y;
}

/* logprobs from a real node are the model's: at each reply position the reply token's logprob and
 * the top 5 equal a log_softmax of this test's own greedy run of the engine (long double; the
 * float result is within 1e-5 of it: values of magnitude < 32 rounded once to 24 bits), and a
 * bridged reply's logprobs are a native one's, bit for bit. */
static void test_logprobs_are_the_models(void **state) {
    (void)state;
    enum { N = 400, GEN = 6, TOP = 5 };
    int32_t ids[N];
    kvbt_prompt_ids(ids, N, 31);
    kvb_prefill_node *pn = start_prefill(g_model, PSK, NULL);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    kvb_decode_node *nat = start_decode(0, PSK, 10000);
    char *bridged = logprobs_reply(kvb_decode_node_port(dn), ids, N, GEN, TOP);
    char *native = logprobs_reply(kvb_decode_node_port(nat), ids, N, GEN, TOP);
    assert_string_equal(bridged, native);
    assert_true(kvbt_metric(kvb_decode_node_port(dn), "kvbridge_requests_total{verdict=\"complete\"} ") == 1);
    kvb_decode_node_stop(nat);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);

    kvb_model *m = NULL;
    kvb_engine *e = NULL;
    kvb_seq *s = NULL;
    kvb_err err = {0};
    reference_engine(&m, &e, &s);
    const uint32_t nv = m->d.n_vocab;
    float *logits = malloc(sizeof(float) * nv);
    long double *sorted = malloc(sizeof(long double) * nv);
    cJSON *lp = cJSON_Parse(native);
    assert_int_equal(kvb_engine_forward(e, s, ids, N, logits, false, &err), KVB_OK);
    for (int t = 0; t < GEN; t++) {
        uint32_t best = 0;
        for (uint32_t j = 1; j < nv; j++) best = logits[j] > logits[best] ? j : best;
        for (uint32_t j = 0; j < nv; j++) sorted[j] = ref_logprob(logits, nv, j);
        const long double want = sorted[best];
        qsort(sorted, nv, sizeof *sorted, by_value_desc);
        const double got = cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "token_logprobs"), t)->valuedouble;
        if (fabsl((long double)got - want) > 1e-5L) fail_msg("token %d: logprob %.9g, the model's %.9Lg", t, got, want);
        /* the top dict: the 5 most likely values (texts may repeat, so compare the values it holds) */
        const cJSON *top = cJSON_GetArrayItem(cJSON_GetObjectItem(lp, "top_logprobs"), t), *it;
        int k = 0;
        cJSON_ArrayForEach(it, top) {
            bool found = false;
            for (int j = 0; j < TOP && !found; j++) found = fabsl((long double)it->valuedouble - sorted[j]) <= 1e-5L;
            if (!found) fail_msg("token %d: top logprob %.9g is not among the model's top %d", t, it->valuedouble, TOP);
            k++;
        }
        assert_true(k >= 1 && k <= TOP + 1);
        assert_int_equal(kvb_engine_forward(e, s, (int32_t *)&best, 1, logits, false, &err), KVB_OK);
    }
    cJSON_Delete(lp);
    free(sorted);
    free(logits);
    free(bridged);
    free(native);
    reference_engine_free(m, e, s);
}

/* echo with logprobs, as lm-eval-harness asks for a loglikelihood: every prompt token's logprob
 * (the first null) then the reply's, the prompt's computed here though its blocks are cached and a
 * prefill node is there (declined, with the reason), each within 1e-5 of a long-double
 * log_softmax of the engine's own rows; the reply part equal to a plain request's; the text the
 * echoed prompt's followed by the plain reply's. */
static void test_echo_prompt_logprobs(void **state) {
    (void)state;
    enum { N = 90, GEN = 4 };
    int32_t ids[N];
    kvbt_prompt_ids(ids, N, 41);
    kvb_prefill_node *pn = start_prefill(g_model, PSK, NULL);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    const uint16_t dp = kvb_decode_node_port(dn);
    char verdict[160];
    cJSON *plain = completion_with(dp, ids, N, GEN, "\"logprobs\":2", verdict, sizeof verdict);
    assert_string_equal(verdict, "complete"); /* the prompt's blocks are cached now */
    cJSON *echo = completion_with(dp, ids, N, GEN, "\"logprobs\":2,\"echo\":true", verdict, sizeof verdict);
    assert_true(strncmp(verdict, "declined: prompt logprobs (echo)", 32) == 0);
    const cJSON *usage = cJSON_GetObjectItem(echo, "usage"), *kb = cJSON_GetObjectItem(usage, "kvbridge");
    assert_true(cJSON_GetObjectItem(kb, "cached_tokens")->valuedouble == 0);
    assert_true(cJSON_GetObjectItem(kb, "native_tokens")->valuedouble == N);
    cJSON *text_only = completion_with(dp, ids, N, 0, "\"echo\":true", NULL, 0);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);

    /* the text: the prompt's, then the reply's */
    const char *t_echo = choice_field(echo, "text")->valuestring, *t_plain = choice_field(plain, "text")->valuestring,
               *t_prompt = choice_field(text_only, "text")->valuestring;
    assert_true(strlen(t_prompt) > 0);
    assert_int_equal(strlen(t_echo), strlen(t_prompt) + strlen(t_plain));
    assert_memory_equal(t_echo, t_prompt, strlen(t_prompt));
    assert_string_equal(t_echo + strlen(t_prompt), t_plain);
    assert_true(cJSON_IsNull(choice_field(text_only, "logprobs")));

    /* the entries: N prompt tokens, then the reply's, equal to the plain request's */
    const cJSON *lp = choice_field(echo, "logprobs"), *plp = choice_field(plain, "logprobs");
    const cJSON *vals = cJSON_GetObjectItem(lp, "token_logprobs"), *tops = cJSON_GetObjectItem(lp, "top_logprobs");
    const int n_gen = (int)cJSON_GetObjectItem(usage, "completion_tokens")->valuedouble;
    assert_int_equal(cJSON_GetArraySize(vals), N + n_gen);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(lp, "tokens")), N + n_gen);
    assert_true(cJSON_IsNull(cJSON_GetArrayItem(vals, 0)) && cJSON_IsNull(cJSON_GetArrayItem(tops, 0)));
    const char *arrays[3] = {"tokens", "token_logprobs", "top_logprobs"};
    for (int a = 0; a < 3; a++)
        for (int i = 0; i < n_gen; i++) {
            char *x = cJSON_PrintUnformatted(cJSON_GetArrayItem(cJSON_GetObjectItem(lp, arrays[a]), N + i));
            char *y = cJSON_PrintUnformatted(cJSON_GetArrayItem(cJSON_GetObjectItem(plp, arrays[a]), i));
            assert_string_equal(x, y);
            free(x);
            free(y);
        }

    /* the prompt's values against the engine's rows */
    kvb_model *m = NULL;
    kvb_engine *e = NULL;
    kvb_seq *s = NULL;
    kvb_err err = {0};
    reference_engine(&m, &e, &s);
    const uint32_t nv = m->d.n_vocab;
    float *rows = malloc(sizeof(float) * nv * N); // (token, n_vocab)
    assert_int_equal(kvb_engine_forward(e, s, ids, N, rows, true, &err), KVB_OK);
    for (int i = 1; i < N; i++) {
        const long double want = ref_logprob(rows + (size_t)(i - 1) * nv, nv, (uint32_t)ids[i]);
        const double got = cJSON_GetArrayItem(vals, i)->valuedouble;
        if (fabsl((long double)got - want) > 1e-5L) fail_msg("prompt token %d: logprob %.9g, the model's %.9Lg", i, got, want);
        const cJSON *top = cJSON_GetArrayItem(tops, i);
        assert_true(cJSON_GetArraySize(top) >= 1 && cJSON_GetArraySize(top) <= 3); /* 2 and the token's own */
    }
    free(rows);
    reference_engine_free(m, e, s);
    cJSON_Delete(plain);
    cJSON_Delete(echo);
    cJSON_Delete(text_only);
}

/* POST to the decode node: the parsed reply (cJSON_Delete it); fails unless the status is `want`. */
static cJSON *post_node(uint16_t port, const char *path, const char *body, int want) {
    kvb_http_reply h;
    kvb_err err = {0};
    assert_int_equal(kvb_http_post("127.0.0.1", port, path, body, 60000, &h, &err), KVB_OK);
    if (h.status != want) fail_msg("%s: HTTP %d, not %d: %s", path, h.status, want, h.body);
    cJSON *root = cJSON_Parse(h.body);
    assert_non_null(root);
    kvb_http_reply_free(&h);
    return root;
}

/* /tokenize counts what a completion's usage.prompt_tokens counts, for a text prompt and for chat
 * messages; /detokenize inverts it (without the BOS it adds, and with it shown). */
static void test_tokenize_matches_completions(void **state) {
    (void)state;
    kvb_decode_node *dn = start_decode(0, PSK, 10000);
    const uint16_t dp = kvb_decode_node_port(dn);
    static const char text[] = "Tokens, counted the same way: caf\xc3\xa9 \xe2\x82\xac 42.";
    char body[512];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\"}", text);
    cJSON *tk = post_node(dp, "/tokenize", body, 200);
    snprintf(body, sizeof body, "{\"model\":\"m\",\"prompt\":\"%s\",\"max_tokens\":1}", text);
    cJSON *cm = post_node(dp, "/v1/completions", body, 200);
    const double count = cJSON_GetObjectItem(tk, "count")->valuedouble;
    assert_true(count == cJSON_GetObjectItem(cJSON_GetObjectItem(cm, "usage"), "prompt_tokens")->valuedouble);
    assert_true(count == cJSON_GetArraySize(cJSON_GetObjectItem(tk, "tokens")));
    assert_true(cJSON_GetObjectItem(tk, "max_model_len")->valuedouble == 4096);
    cJSON_Delete(cm);
    /* the same text without the BOS: one fewer, and it decodes back to the text */
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"add_special_tokens\":false}", text);
    cJSON *plain = post_node(dp, "/tokenize", body, 200);
    assert_true(cJSON_GetObjectItem(plain, "count")->valuedouble == count - 1);
    char *ids = cJSON_PrintUnformatted(cJSON_GetObjectItem(plain, "tokens"));
    snprintf(body, sizeof body, "{\"tokens\":%s}", ids);
    cJSON *back = post_node(dp, "/detokenize", body, 200);
    assert_string_equal(cJSON_GetObjectItem(back, "prompt")->valuestring, text);
    cJSON_Delete(back);
    free(ids);
    ids = cJSON_PrintUnformatted(cJSON_GetObjectItem(tk, "tokens")); /* with the BOS: shown before the text */
    snprintf(body, sizeof body, "{\"tokens\":%s}", ids);
    back = post_node(dp, "/detokenize", body, 200);
    const char *with_bos = cJSON_GetObjectItem(back, "prompt")->valuestring;
    assert_true(strlen(with_bos) > strlen(text) && strcmp(with_bos + strlen(with_bos) - strlen(text), text) == 0);
    cJSON_Delete(back);
    free(ids);
    cJSON_Delete(plain);
    cJSON_Delete(tk);
    /* chat messages: the chat completion's prompt tokens */
    const char *msgs = "\"messages\":[{\"role\":\"system\",\"content\":\"be brief\"},{\"role\":\"user\",\"content\":\"hello\"}]";
    snprintf(body, sizeof body, "{%s}", msgs);
    tk = post_node(dp, "/tokenize", body, 200);
    snprintf(body, sizeof body, "{\"model\":\"m\",%s,\"max_tokens\":1}", msgs);
    cm = post_node(dp, "/v1/chat/completions", body, 200);
    assert_true(cJSON_GetObjectItem(tk, "count")->valuedouble ==
                cJSON_GetObjectItem(cJSON_GetObjectItem(cm, "usage"), "prompt_tokens")->valuedouble);
    cJSON_Delete(cm);
    cJSON_Delete(tk);
    /* /v1/models names the same context */
    char cmd[256], models[2048];
    snprintf(cmd, sizeof cmd, "curl -s http://127.0.0.1:%u/v1/models", dp);
    assert_int_equal(kvbt_sh(cmd, models, sizeof models, 0), 0);
    cJSON *ml = cJSON_Parse(models);
    assert_true(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(ml, "data"), 0), "max_model_len")->valuedouble == 4096);
    cJSON_Delete(ml);
    /* a token outside the vocabulary */
    cJSON *bad = post_node(dp, "/detokenize", "{\"tokens\":[1,99999999]}", 400);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(bad, "error"), "param")->valuestring, "tokens[1]");
    cJSON_Delete(bad);
    kvb_decode_node_stop(dn);
}

/* response_format json_object on a real node: every reply is a JSON prefix that starts at '{', and
 * one that ends by itself (finish_reason stop) is an object cJSON parses; without the field the
 * same request does not answer in JSON. '}' gets a small bias so that random weights close
 * objects within max_tokens. */
static void test_json_mode(void **state) {
    (void)state;
    kvb_decode_node *dn = start_decode(0, PSK, 10000);
    const uint16_t dp = kvb_decode_node_port(dn);
    cJSON *tk = post_node(dp, "/tokenize", "{\"prompt\":\"}\",\"add_special_tokens\":false}", 200);
    assert_true(cJSON_GetObjectItem(tk, "count")->valuedouble == 1);
    const int close_id = (int)cJSON_GetArrayItem(cJSON_GetObjectItem(tk, "tokens"), 0)->valuedouble;
    cJSON_Delete(tk);
    int stopped = 0;
    for (int seed = 1; seed <= 8; seed++) {
        char body[512];
        snprintf(body, sizeof body, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a JSON object, "
                 "please\"}],\"max_tokens\":40,\"temperature\":1,\"seed\":%d,\"logit_bias\":{\"%d\":3},"
                 "\"response_format\":{\"type\":\"json_object\"}%s}", seed, close_id, seed == 1 ? ",\"logprobs\":true" : "");
        cJSON *r = post_node(dp, "/v1/chat/completions", body, 200);
        const cJSON *choice = cJSON_GetArrayItem(cJSON_GetObjectItem(r, "choices"), 0);
        const char *text = cJSON_GetObjectItem(cJSON_GetObjectItem(choice, "message"), "content")->valuestring;
        const char *finish = cJSON_GetObjectItem(choice, "finish_reason")->valuestring;
        kvb_json_state js;
        kvb_json_init(&js);
        if (!kvb_json_feed(&js, text, strlen(text))) fail_msg("seed %d: not a JSON prefix: '%s'", seed, text);
        assert_int_equal(kvb_json_complete(&js), strcmp(finish, "stop") == 0);
        if (kvb_json_complete(&js)) {
            cJSON *obj = cJSON_Parse(text);
            if (!cJSON_IsObject(obj)) fail_msg("seed %d: '%s' is not an object", seed, text);
            cJSON_Delete(obj);
            stopped++;
        }
        if (seed == 1) /* one logprobs entry per token, JSON mode or not */
            assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetObjectItem(choice, "logprobs"), "content")),
                             (int)cJSON_GetObjectItem(cJSON_GetObjectItem(r, "usage"), "completion_tokens")->valuedouble);
        printf("json mode, seed %d (%s): %s\n", seed, finish, text);
        if (seed == 2) { /* the same request without the field */
            char plain[512];
            snprintf(plain, sizeof plain, "%.*s}", (int)(strstr(body, ",\"response_format\"") - body), body);
            cJSON *p = post_node(dp, "/v1/chat/completions", plain, 200);
            const char *ptext = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(p, "choices"), 0),
                                                                        "message"), "content")->valuestring;
            kvb_json_init(&js);
            assert_false(kvb_json_feed(&js, ptext, strlen(ptext)));
            cJSON_Delete(p);
        }
        cJSON_Delete(r);
    }
    assert_true(stopped >= 1);
    kvb_decode_node_stop(dn);
}

/* response_format json_schema on a real node: every reply is a prefix of an object valid under the
 * schema, and one that ends by itself (finish_reason stop) is complete: cJSON parses it, the
 * required keys are there with their types and values. The schema bounds its instances (a boolean,
 * an enum, a short array of an enum), so random weights end most replies within max_tokens; an
 * unsupported keyword is a 400 that names it. */
static void test_json_schema_mode(void **state) {
    (void)state;
    kvb_decode_node *dn = start_decode(0, PSK, 10000);
    const uint16_t dp = kvb_decode_node_port(dn);
    static const char *const schema =
        "{\"type\":\"object\",\"properties\":{\"ok\":{\"type\":\"boolean\"},\"tag\":{\"enum\":[\"red\",\"green\"]},"
        "\"list\":{\"type\":\"array\",\"items\":{\"enum\":[1,2]},\"maxItems\":3}},\"required\":[\"ok\",\"tag\"],"
        "\"additionalProperties\":false}";
    cJSON *sj = cJSON_Parse(schema);
    kvb_json_schema *sch = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_json_schema_compile(sj, "schema", &sch, &err), KVB_OK);
    cJSON_Delete(sj);
    int stopped = 0;
    for (int seed = 1; seed <= 2; seed++) {
        char body[1024];
        snprintf(body, sizeof body, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a colour, please\"}],"
                 "\"max_tokens\":400,\"temperature\":1,\"seed\":%d,\"response_format\":{\"type\":\"json_schema\","
                 "\"json_schema\":{\"name\":\"colour\",\"strict\":true,\"schema\":%s}}}", seed, schema);
        cJSON *r = post_node(dp, "/v1/chat/completions", body, 200);
        const cJSON *choice = cJSON_GetArrayItem(cJSON_GetObjectItem(r, "choices"), 0);
        const char *text = cJSON_GetObjectItem(cJSON_GetObjectItem(choice, "message"), "content")->valuestring;
        const char *finish = cJSON_GetObjectItem(choice, "finish_reason")->valuestring;
        printf("json schema, seed %d (%s, %d tokens): %s\n", seed, finish,
               (int)cJSON_GetObjectItem(cJSON_GetObjectItem(r, "usage"), "completion_tokens")->valuedouble, text);
        kvb_json_state js;
        kvb_json_init_schema(&js, sch);
        if (!kvb_json_feed(&js, text, strlen(text))) fail_msg("seed %d: not a prefix under the schema: '%s'", seed, text);
        assert_int_equal(kvb_json_complete(&js), strcmp(finish, "stop") == 0);
        if (kvb_json_complete(&js)) {
            cJSON *obj = cJSON_Parse(text);
            const cJSON *ok = cJSON_GetObjectItem(obj, "ok"), *tag = cJSON_GetObjectItem(obj, "tag");
            const cJSON *list = cJSON_GetObjectItem(obj, "list");
            if (!cJSON_IsObject(obj) || !cJSON_IsBool(ok) || !cJSON_IsString(tag) ||
                (strcmp(tag->valuestring, "red") != 0 && strcmp(tag->valuestring, "green") != 0) ||
                (list && !(cJSON_IsArray(list) && cJSON_GetArraySize(list) <= 3)) ||
                cJSON_GetArraySize(obj) != 2 + (list != NULL))
                fail_msg("seed %d: '%s' is not valid under the schema", seed, text);
            const cJSON *it;
            cJSON_ArrayForEach(it, list) assert_true(cJSON_IsNumber(it) && (it->valuedouble == 1 || it->valuedouble == 2));
            cJSON_Delete(obj);
            stopped++;
        }
        cJSON_Delete(r);
    }
    assert_true(stopped >= 1);
    kvb_json_schema_free(sch);
    /* outside the subset: a 400 naming the keyword and where it is */
    cJSON *bad = post_node(dp, "/v1/chat/completions", "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                           "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\",\"schema\":"
                           "{\"type\":\"object\",\"properties\":{\"age\":{\"type\":\"integer\",\"minimum\":0}}}}}}", 400);
    const cJSON *e = cJSON_GetObjectItem(bad, "error");
    assert_string_equal(cJSON_GetObjectItem(e, "param")->valuestring, "response_format");
    assert_non_null(strstr(cJSON_GetObjectItem(e, "message")->valuestring,
                           "response_format.json_schema.schema.properties.age: keyword 'minimum' is not supported"));
    cJSON_Delete(bad);
    kvb_decode_node_stop(dn);
}

/* A completion body for ids: temperature t, seed, n choices, max_tokens (ignore_eos), bridging forced. */
static char *sampled_body(const int32_t *ids, int n_ids, double t, int seed, int n, int max_tokens) {
    cJSON *req = cJSON_CreateObject();
    cJSON_AddStringToObject(req, "model", "m");
    cJSON_AddItemToObject(req, "prompt", cJSON_CreateIntArray(ids, n_ids));
    cJSON_AddNumberToObject(req, "max_tokens", max_tokens);
    cJSON_AddBoolToObject(req, "ignore_eos", true);
    cJSON_AddNumberToObject(req, "temperature", t);
    cJSON_AddNumberToObject(req, "seed", seed);
    cJSON_AddNumberToObject(req, "n", n);
    cJSON_AddItemToObject(cJSON_AddObjectToObject(req, "kvbridge"), "bridge", cJSON_CreateString("force"));
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    return body;
}

/* n > 1 on a real node: choice i is what a request of its own with seed + i gives (the prompt
 * bridged once, the later choices from the cache), and at temperature 0 every choice is the
 * greedy reply. */
static void test_choices_are_single_requests(void **state) {
    (void)state;
    enum { N = 300, GEN = 8 };
    int32_t ids[N];
    kvbt_prompt_ids(ids, N, 53);
    kvb_prefill_node *pn = start_prefill(g_model, PSK, NULL);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    const uint16_t dp = kvb_decode_node_port(dn);
    char *body = sampled_body(ids, N, 1.0, 7, 3, GEN);
    kvb_http_reply h;
    kvb_err err = {0};
    assert_int_equal(kvb_http_post("127.0.0.1", dp, "/v1/completions", body, 60000, &h, &err), KVB_OK);
    assert_int_equal(h.status, 200);
    assert_string_equal(h.verdict, "complete");
    cJSON *many = cJSON_Parse(h.body);
    kvb_http_reply_free(&h);
    free(body);
    const cJSON *choices = cJSON_GetObjectItem(many, "choices");
    assert_int_equal(cJSON_GetArraySize(choices), 3);
    assert_true(cJSON_GetObjectItem(cJSON_GetObjectItem(many, "usage"), "completion_tokens")->valuedouble == 3 * GEN);
    int distinct = 0;
    for (int c = 0; c < 3; c++) {
        body = sampled_body(ids, N, 1.0, 7 + c, 1, GEN);
        cJSON *one = post_node(dp, "/v1/completions", body, 200);
        free(body);
        const char *want = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(one, "choices"), 0), "text")->valuestring;
        const char *got = cJSON_GetObjectItem(cJSON_GetArrayItem(choices, c), "text")->valuestring;
        assert_string_equal(got, want);
        assert_true(cJSON_GetObjectItem(cJSON_GetArrayItem(choices, c), "index")->valuedouble == c);
        if (c) distinct += strcmp(got, cJSON_GetObjectItem(cJSON_GetArrayItem(choices, 0), "text")->valuestring) != 0;
        cJSON_Delete(one);
    }
    assert_true(distinct >= 1); /* sampled: the choices are not all one text */
    cJSON_Delete(many);
    body = sampled_body(ids, N, 0.0, 1, 2, GEN);
    cJSON *greedy = post_node(dp, "/v1/completions", body, 200);
    free(body);
    const cJSON *g = cJSON_GetObjectItem(greedy, "choices");
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetArrayItem(g, 0), "text")->valuestring,
                        cJSON_GetObjectItem(cJSON_GetArrayItem(g, 1), "text")->valuestring);
    cJSON_Delete(greedy);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

/* The completion of ids (greedy) with extra fields: its text's length in tokens and finish reason. */
static void complete_with_text(uint16_t port, const int32_t *ids, int n, const char *extra, int *tokens, char *finish,
                               size_t cap, char *text, size_t text_cap) {
    char *body = kvbt_completion_json(ids, n, 12, false);
    const size_t len = strlen(body) + strlen(extra) + 8;
    char *req = malloc(len);
    snprintf(req, len, "%.*s,%s}", (int)strlen(body) - 1, body, extra);
    cJSON *r = post_node(port, "/v1/completions", req, 200);
    *tokens = (int)cJSON_GetObjectItem(cJSON_GetObjectItem(r, "usage"), "completion_tokens")->valuedouble;
    const cJSON *choice = cJSON_GetArrayItem(cJSON_GetObjectItem(r, "choices"), 0);
    snprintf(finish, cap, "%s", cJSON_GetObjectItem(choice, "finish_reason")->valuestring);
    if (text) snprintf(text, text_cap, "%s", cJSON_GetObjectItem(choice, "text")->valuestring);
    cJSON_Delete(r);
    free(req);
    free(body);
}

static void complete_with(uint16_t port, const int32_t *ids, int n, const char *extra, int *tokens, char *finish,
                          size_t cap) {
    complete_with_text(port, ids, n, extra, tokens, finish, cap, NULL, 0);
}

/* vLLM's min_tokens and stop_token_ids: a reply the bias ends at once (its end-of-generation token,
 * a stop token id, or a stop string) runs min_tokens tokens first when asked; an id outside the
 * vocabulary is a 400. */
static void test_min_tokens_and_stop_ids(void **state) {
    (void)state;
    kvb_model *m = NULL;
    kvb_tokenizer *tok = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_model_load(g_model, &m, &err), KVB_OK);
    assert_int_equal(kvb_tokenizer_load(m->gguf, &tok, &err), KVB_OK);
    const int eos = kvb_tokenizer_eos(tok);
    assert_true(eos >= 0 && kvb_tokenizer_is_eog(tok, eos));
    kvb_tokenizer_free(tok);
    kvb_model_free(m);
    kvb_decode_node *dn = start_decode(0, PSK, 10000);
    const uint16_t dp = kvb_decode_node_port(dn);
    int32_t ids[40];
    kvbt_prompt_ids(ids, 40, 61);
    char extra[160], finish[16];
    int got;
    snprintf(extra, sizeof extra, "\"logit_bias\":{\"%d\":100}", eos);
    complete_with(dp, ids, 40, extra, &got, finish, sizeof finish);
    assert_int_equal(got, 0); /* the end at once */
    assert_string_equal(finish, "stop");
    snprintf(extra, sizeof extra, "\"logit_bias\":{\"%d\":100},\"min_tokens\":5", eos);
    complete_with(dp, ids, 40, extra, &got, finish, sizeof finish);
    assert_int_equal(got, 5); /* barred for five tokens, then the end */
    assert_string_equal(finish, "stop");
    /* a stop token id: token 70 favoured ends the reply at once, or after min_tokens */
    complete_with(dp, ids, 40, "\"logit_bias\":{\"70\":100},\"stop_token_ids\":[70]", &got, finish, sizeof finish);
    assert_int_equal(got, 0);
    assert_string_equal(finish, "stop");
    complete_with(dp, ids, 40, "\"logit_bias\":{\"70\":100},\"stop_token_ids\":[9,70],\"min_tokens\":3,\"ignore_eos\":true",
                  &got, finish, sizeof finish);
    assert_int_equal(got, 3); /* ignore_eos does not keep a stop token id from stopping */
    assert_string_equal(finish, "stop");
    complete_with(dp, ids, 40, "\"logit_bias\":{\"70\":100}", &got, finish, sizeof finish);
    assert_int_equal(got, 12); /* without the stop id: to max_tokens */
    assert_string_equal(finish, "length");
    /* a stop string: "aa" ends a reply of a's at once, but only once min_tokens tokens are out */
    cJSON *tk = post_node(dp, "/tokenize", "{\"prompt\":\"a\",\"add_special_tokens\":false}", 200);
    const cJSON *tks = cJSON_GetObjectItem(tk, "tokens");
    assert_int_equal(cJSON_GetArraySize(tks), 1);
    const int a_id = (int)cJSON_GetArrayItem(tks, 0)->valuedouble;
    cJSON_Delete(tk);
    char text[64];
    snprintf(extra, sizeof extra, "\"logit_bias\":{\"%d\":100},\"stop\":[\"aa\"]", a_id);
    complete_with_text(dp, ids, 40, extra, &got, finish, sizeof finish, text, sizeof text);
    assert_int_equal(got, 2);
    assert_string_equal(text, "");
    assert_string_equal(finish, "stop");
    snprintf(extra, sizeof extra, "\"logit_bias\":{\"%d\":100},\"stop\":[\"aa\"],\"min_tokens\":5", a_id);
    complete_with_text(dp, ids, 40, extra, &got, finish, sizeof finish, text, sizeof text);
    assert_int_equal(got, 5); /* the "aa" of tokens 1-4 did not count: the one ending at token 5 did */
    assert_string_equal(text, "aaa");
    assert_string_equal(finish, "stop");
    cJSON *bad = post_node(dp, "/v1/completions", "{\"model\":\"m\",\"prompt\":[5,6],\"stop_token_ids\":[99999999]}", 400);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(bad, "error"), "param")->valuestring, "stop_token_ids");
    cJSON_Delete(bad);
    kvb_decode_node_stop(dn);
}

/* Bridge mode `prefill`: the prefill engine's own K/V re-encoded. In the decoder's own format it
 * is exact (same answer as native); from an f32 engine it still completes (not claimed exact);
 * nodes that disagree on the mode refuse each other at the handshake. */
static void test_prefill_mode(void **state) {
    (void)state;
    int32_t ids[500];
    kvbt_prompt_ids(ids, 500, 5);
    const uint32_t engine_types[] = {0, KVB_TYPE_F32};
    for (int i = 0; i < 2; i++) {
        kvb_prefill_node *pn = start_prefill_mode(g_model, PSK, NULL, true, engine_types[i]);
        kvb_decode_node *dn = start_decode_mode(kvb_prefill_node_port(pn), PSK, 10000, true);
        kvb_decode_node *nat = start_decode(0, PSK, 10000);
        kvbt_reply b, n;
        kvbt_complete_ids(kvb_decode_node_port(dn), ids, 500, &b);
        kvbt_complete_ids(kvb_decode_node_port(nat), ids, 500, &n);
        assert_string_equal(b.verdict, "complete");
        assert_int_equal(b.bridged, 499);
        if (i == 0) assert_string_equal(b.content, n.content);
        free(b.content);
        free(n.content);
        kvb_decode_node_stop(nat);
        kvb_decode_node_stop(dn);
        kvb_prefill_node_stop(pn);
    }
    kvb_prefill_node *pn = start_prefill_mode(g_model, PSK, NULL, true, 0);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000); /* decoder mode */
    kvbt_reply b;
    kvbt_complete_ids(kvb_decode_node_port(dn), ids, 500, &b);
    assert_true(strncmp(b.verdict, "declined: prefill node unavailable", 34) == 0);
    free(b.content);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

/* Many cold prompts through a small prefix cache: bridged blocks are cached for later turns but
 * hold no reference once the kvbt_reply is done, so least-recently-used ones are evicted and every
 * request still bridges `complete` (2026-12-03: the decode node kept a reference per bridged
 * block, and the third cold prompt found the store full). */
static void test_bridged_blocks_are_evictable(void **state) {
    (void)state;
    kvb_prefill_node *pn = start_prefill(g_model, PSK, NULL);
    char peer[32];
    snprintf(peer, sizeof peer, "127.0.0.1:%u", kvb_prefill_node_port(pn));
    kvb_decode_config c = {.http_listen = "127.0.0.1:0", .peer = peer, .model_path = g_model, .psk = PSK,
                           .n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096,
                           .peer_timeout_ms = 10000, .cache_blocks = 48}; /* room for one 31-block prompt */
    kvb_decode_node *dn = NULL;
    kvb_err err = {0};
    if (kvb_decode_node_start(&c, &dn, &err)) fail_msg("decode node: %s", err.msg);
    int32_t ids[1000];
    for (int i = 0; i < 4; i++) {
        kvbt_prompt_ids(ids, 1000, 1000 + (uint64_t)i); /* a fresh prompt: nothing cached */
        kvbt_reply b;
        kvbt_complete_ids(kvb_decode_node_port(dn), ids, 1000, &b);
        assert_string_equal(b.verdict, "complete");
        assert_int_equal(b.bridged, 999);
        free(b.content);
    }
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

/* The slab path's benchmark node (bench ladder --slab-path-only): filler rows, no engine, a
 * chunk's layer at a time as views. A cold prompt spanning two chunks and a partial third arrives
 * complete with every byte counted, twice in a row (the filler is made once, at start), and the
 * node refuses to time an engine it does not have. */
static void test_filler_rows_slab_path(void **state) {
    (void)state;
    kvb_prefill_config c = {.listen = "127.0.0.1:0", .model_path = g_model, .psk = PSK, .n_threads = 1,
                            .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096,
                            .chunk_tokens = 256, .bench_filler_rows = true};
    kvb_prefill_node *pn = NULL;
    kvb_err err = {0};
    if (kvb_prefill_node_start(&c, &pn, &err)) fail_msg("prefill node: %s", err.msg);
    g_filler_peer = true; /* this decoder knows the peer ships filler */
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    int32_t ids[700];
    for (int i = 0; i < 2; i++) {
        kvbt_prompt_ids(ids, 700, 500 + (uint64_t)i); /* fresh: nothing cached */
        kvbt_reply b;
        double bytes0 = kvbt_metric(kvb_decode_node_port(dn), "kvbridge_slab_bytes_total ");
        kvbt_complete_ids(kvb_decode_node_port(dn), ids, 700, &b);
        assert_string_equal(b.verdict, "complete");
        assert_int_equal(b.bridged, 699);
        /* tiny: 2048 bytes per token (4 layers x K,V x 2 kv heads x 64 dims x f16) */
        assert_true(kvbt_metric(kvb_decode_node_port(dn), "kvbridge_slab_bytes_total ") - bytes0 == 699.0 * 2048.0);
        free(b.content);
    }
    assert_int_equal(kvb_prefill_node_peak_capture_bytes(pn), 0); /* views only: no staging copies */
    /* a decoder that did not ask for filler refuses the node as another model: native, no filler */
    g_filler_peer = false;
    kvb_decode_node *plain = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    g_filler_peer = true;
    kvbt_reply b;
    kvbt_prompt_ids(ids, 700, 600);
    kvbt_complete_ids(kvb_decode_node_port(plain), ids, 700, &b);
    assert_non_null(strstr(b.verdict, "declined: prefill node unavailable"));
    if (!strstr(b.verdict, "model")) fail_msg("verdict: %s", b.verdict);
    assert_int_equal(b.bridged, 0);
    assert_true(kvbt_metric(kvb_decode_node_port(plain), "kvbridge_slab_bytes_total ") == 0);
    free(b.content);
    kvb_decode_node_stop(plain);
    double secs = -1;
    assert_int_equal(kvb_prefill_node_time_alone(pn, 64, 1, false, &secs, &err), KVB_ERR_UNSUPPORTED);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
    g_filler_peer = false;
}

/* A decode node connects to a prefill node while that one computes a prompt (paused 2 s at its 3rd
 * slab): the connection table is not the engine's lock. Told to drain then (kvb_prefill_node_quiesce,
 * serve's first SIGTERM), the prefill node finishes that prompt and refuses the next one, which
 * the new decode node then computes itself, with a verdict that says so and the native answer. */
static void test_prefill_node_drains(void **state) {
    (void)state;
    kvb_prefill_node *pn = start_prefill(g_model, PSK, "pause:3x1");
    kvb_decode_node *da = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    kvb_decode_node *nat = start_decode(0, PSK, 10000);
    client_job a = {.port = kvb_decode_node_port(da), .n = 600, .max_tokens = 8},
               b = {.n = 600, .max_tokens = 8};
    kvbt_prompt_ids(a.ids, a.n, 911);
    kvbt_prompt_ids(b.ids, b.n, 912);
    pthread_t ta, tb;
    assert_int_equal(pthread_create(&ta, NULL, client_main, &a), 0);
    while (kvb_prefill_node_in_flight(pn) == 0) usleep(1000); /* a's PREFILL is being served */
    const double t_connect = kvb_now_s();
    kvb_decode_node *db = start_decode(kvb_prefill_node_port(pn), PSK, 10000); /* connects, groups its lanes */
    const double connect_s = kvb_now_s() - t_connect;
    printf("a decode node connected in %.3f s while a prompt was in flight\n", connect_s);
    assert_true(peer_up(db, kvb_prefill_node_port(pn)) == 1);
    assert_int_equal(kvb_prefill_node_in_flight(pn), 1); /* before a's prompt ended */
    b.port = kvb_decode_node_port(db);
    kvb_prefill_node_quiesce(pn);
    assert_int_equal(pthread_create(&tb, NULL, client_main, &b), 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    printf("drain: a '%s', b '%s'\n", a.r.verdict, b.r.verdict);
    assert_string_equal(a.r.verdict, "complete"); /* accepted before the drain: finished */
    assert_non_null(strstr(b.r.verdict, "declined: peer refused: "));
    assert_non_null(strstr(b.r.verdict, "draining"));
    assert_int_equal(b.r.bridged, 0);
    /* the node counts a request out after its last frame (DONE, or the refusal) is sent, so the
     * client may have its answer a moment before the count falls: wait for it, bounded */
    for (int i = 0; i < 2000 && kvb_prefill_node_in_flight(pn) != 0; i++) usleep(1000);
    assert_int_equal(kvb_prefill_node_in_flight(pn), 0);
    client_job *jobs[] = {&a, &b};
    for (int c = 0; c < 2; c++) { /* both answers are the native ones */
        kvbt_reply alone;
        complete_job(kvb_decode_node_port(nat), jobs[c], &alone);
        assert_string_equal(alone.content, jobs[c]->r.content);
        free(alone.content);
        free(jobs[c]->r.content);
    }
    kvb_decode_node_stop(nat);
    kvb_decode_node_stop(db);
    kvb_decode_node_stop(da);
    kvb_prefill_node_stop(pn);
}

/* A prefill node's /health and /metrics (serve --role prefill --http): what it shipped equals what
 * the decoder received, byte for byte; a refusal is counted as one; completions are 404s there;
 * and draining shows as a 503 on /health. */
static void test_prefill_node_ops(void **state) {
    (void)state;
    kvb_prefill_config c = {.listen = "127.0.0.1:0", .http_listen = "127.0.0.1:0", .model_path = g_model,
                            .psk = PSK, .n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32,
                            .max_ctx = 4096};
    kvb_prefill_node *pn = NULL;
    kvb_err err = {0};
    if (kvb_prefill_node_start(&c, &pn, &err)) fail_msg("prefill node: %s", err.msg);
    const uint16_t hp = kvb_prefill_node_http_port(pn);
    assert_true(hp != 0);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    const uint16_t dp = kvb_decode_node_port(dn);
    assert_true(kvbt_metric(hp, "kvbridge_prefill_connections ") == (g_lanes ? g_lanes : KVB_DEFAULT_LANES));
    int32_t ids[700];
    kvbt_prompt_ids(ids, 700, 1300);
    kvbt_reply b;
    kvbt_complete_ids(dp, ids, 700, &b);
    assert_string_equal(b.verdict, "complete");
    free(b.content);
    assert_true(kvbt_metric(hp, "kvbridge_prefill_requests_total{outcome=\"served\"} ") == 1);
    assert_true(kvbt_metric(hp, "kvbridge_prefill_tokens_total{kind=\"shipped\"} ") == b.bridged);
    assert_true(kvbt_metric(hp, "kvbridge_prefill_tokens_total{kind=\"computed\"} ") == b.bridged);
    assert_true(kvbt_metric(hp, "kvbridge_prefill_slab_bytes_total ") == kvbt_metric(dp, "kvbridge_slab_bytes_total "));
    assert_true(kvbt_metric(hp, "kvbridge_prefill_slab_bytes_total ") == 699.0 * 2048.0); /* tiny: 2 KiB a token */
    assert_true(kvbt_metric(hp, "kvbridge_prefill_request_seconds_count ") == 1);
    assert_true(kvbt_metric(hp, "kvbridge_prefill_in_flight ") == 0);
    char cmd[256], out[2048];
    snprintf(cmd, sizeof cmd, "curl -s -w ' %%{http_code}' http://127.0.0.1:%u/health", hp);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    if (!strstr(out, "\"role\":\"prefill\"") || !strstr(out, "\"in_flight\":0") || !strstr(out, " 200"))
        fail_msg("prefill /health: %s", out);
    snprintf(cmd, sizeof cmd,
             "curl -s -w ' %%{http_code}' -H 'Content-Type: application/json' -d '{\"model\":\"m\",\"prompt\":\"hi\"}' "
             "http://127.0.0.1:%u/v1/completions", hp);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    if (!strstr(out, "not_a_decode_node") || !strstr(out, " 404")) fail_msg("prefill completions: %s", out);
    kvb_prefill_node_quiesce(pn); /* draining: the next prompt is refused, and counted so */
    kvbt_prompt_ids(ids, 700, 1301);
    kvbt_complete_ids(dp, ids, 700, &b);
    assert_non_null(strstr(b.verdict, "declined: peer refused: "));
    free(b.content);
    assert_true(kvbt_metric(hp, "kvbridge_prefill_requests_total{outcome=\"refused\"} ") == 1);
    assert_true(kvbt_metric(hp, "kvbridge_prefill_draining ") == 1);
    snprintf(cmd, sizeof cmd, "curl -s -w ' %%{http_code}' http://127.0.0.1:%u/health", hp);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    if (!strstr(out, "draining") || !strstr(out, " 503")) fail_msg("draining prefill /health: %s", out);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
}

static void test_openai_client_streams(void **state) {
    (void)state;
    const char *src = getenv("KVB_SOURCE_DIR");
    if (!src) src = "."; /* run by hand from the checkout */
    char py[600];
    snprintf(py, sizeof py, "%s/.venv/bin/python", src);
    if (access(py, X_OK) != 0) skip();
    kvb_prefill_node *pn = start_prefill(g_model, PSK, NULL);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pn), PSK, 10000);
    char cmd[1400], out[8192];
    snprintf(cmd, sizeof cmd, "'%s' '%s/tests/openai_node_check.py' %u", py, src, kvb_decode_node_port(dn));
    int rc = kvbt_sh(cmd, out, sizeof out, 1);
    printf("%s", out);
    kvb_decode_node_stop(dn);
    kvb_prefill_node_stop(pn);
    if (rc == 77) skip();
    assert_int_equal(rc, 0);
}

/* KVB_TEST_SHARD=i/k keeps every k-th test from the i-th: ctest runs the file as two shards at once
 * (it is the suite's long pole, ~5 min under ASan on two cores). Returns how many are kept. */
static size_t shard_tests(struct CMUnitTest *t, size_t n) {
    const char *s = getenv("KVB_TEST_SHARD");
    unsigned i = 0, k = 0;
    if (!s || sscanf(s, "%u/%u", &i, &k) != 2 || k == 0 || i >= k) return n;
    size_t m = 0;
    for (size_t j = 0; j < n; j++)
        if (j % k == i) t[m++] = t[j];
    return m;
}

/* A model without a chat template: /v1/chat/completions is a 400 that says what to do (start the
 * node with --chat-template NAME), not a server error; /v1/completions still answers. The model is
 * the loop's own with its tokenizer.chat_template key renamed in place (same length). */
static void test_chat_without_template(void **state) {
    (void)state;
    char path[512];
    kvbt_tmp_path(path, sizeof path, "loop-no-template.gguf");
    FILE *f = fopen(g_model, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    const long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *bytes = malloc((size_t)size);
    assert_true(bytes && fread(bytes, 1, (size_t)size, f) == (size_t)size);
    fclose(f);
    static const char key[] = "tokenizer.chat_template";
    char *hit = NULL;
    for (long i = 0; !hit && i + (long)sizeof key - 1 <= size; i++)
        if (!memcmp(bytes + i, key, sizeof key - 1)) hit = bytes + i;
    assert_non_null(hit);
    hit[sizeof key - 2] = 'X'; /* tokenizer.chat_templatX: no template */
    f = fopen(path, "wb");
    assert_true(f && fwrite(bytes, 1, (size_t)size, f) == (size_t)size);
    fclose(f);
    free(bytes);
    kvb_decode_config c = {.http_listen = "127.0.0.1:0", .model_path = path, .n_threads = 1,
                           .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096};
    kvb_decode_node *dn = NULL;
    kvb_err err = {0};
    if (kvb_decode_node_start(&c, &dn, &err)) fail_msg("decode node: %s", err.msg);
    const uint16_t dp = kvb_decode_node_port(dn);
    cJSON *r = post_node(dp, "/v1/chat/completions",
                         "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1}",
                         400);
    const cJSON *msg = cJSON_GetObjectItem(cJSON_GetObjectItem(r, "error"), "message");
    assert_true(cJSON_IsString(msg));
    if (!strstr(msg->valuestring, "--chat-template")) fail_msg("the 400 does not say what to do: %s", msg->valuestring);
    cJSON_Delete(r);
    r = post_node(dp, "/v1/completions", "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":1}", 200);
    cJSON_Delete(r);
    kvb_decode_node_stop(dn);
    remove(path);
}

/* A verdict too long for KVB_VERDICT_MAX is cut at a word boundary with "...", never mid-word; a
 * short one is kept as it is; one long word is cut whole bytes of UTF-8 only. */
static void test_verdict_cut_at_a_word(void **state) {
    (void)state;
    char v[KVB_VERDICT_MAX], reason[400] = "";
    kvb_verdict_format(v, "partial %u/%u: %s", 3u, 8u, "peer lost");
    assert_string_equal(v, "partial 3/8: peer lost");
    for (int i = 0; strlen(reason) < 300; i++) /* words of varying length */
        snprintf(reason + strlen(reason), sizeof reason - strlen(reason), "%sword%d", i ? " " : "", i * 37);
    char full[512];
    snprintf(full, sizeof full, "declined: prefill node unavailable: %s", reason);
    kvb_verdict_format(v, "declined: prefill node unavailable: %s", reason);
    const size_t len = strlen(v);
    assert_true(len < KVB_VERDICT_MAX && len > KVB_VERDICT_MAX / 2);
    assert_string_equal(v + len - 3, "...");
    const size_t kept = len - 3;
    assert_memory_equal(v, full, kept);
    assert_true(full[kept] == ' ' && v[kept - 1] != ' '); /* the kept text ends where a word ends */
    char word[300];
    memset(word, 'a', sizeof word - 1);
    memcpy(word + KVB_VERDICT_MAX - 6, "\xe2\x82\xac", 3); /* a euro sign across the cut */
    word[sizeof word - 1] = 0;
    kvb_verdict_format(v, "%s", word);
    assert_int_equal(strlen(v), KVB_VERDICT_MAX - 6 + 3); /* the euro sign left out whole, then "..." */
    assert_string_equal(v + strlen(v) - 3, "...");
}

int main(void) {
    struct CMUnitTest tests[] = {
        cmocka_unit_test(test_multiturn_ships_only_increments),
        cmocka_unit_test(test_multiturn_one_lane),
        cmocka_unit_test(test_multiturn_over_ucx),
        cmocka_unit_test(test_faults_over_ucx),
        cmocka_unit_test(test_multiturn_three_lanes),
        cmocka_unit_test(test_lane_group_on_the_wire),
        cmocka_unit_test(test_pipelined_tail_edges),
        cmocka_unit_test(test_gemma3_window_multiturn),
        cmocka_unit_test(test_fault_corrupt_slab),
        cmocka_unit_test(test_fault_corrupt_slab_resumed),
        cmocka_unit_test(test_fault_corrupt_every_attempt),
        cmocka_unit_test(test_fault_peer_killed),
        cmocka_unit_test(test_fault_peer_killed_resumed),
        cmocka_unit_test(test_fault_peer_stalls),
        cmocka_unit_test(test_fault_peer_down),
        cmocka_unit_test(test_fault_wrong_key),
        cmocka_unit_test(test_fault_other_model),
        cmocka_unit_test(test_fault_slab_outside_range),
        cmocka_unit_test(test_fault_done_without_blocks),
        cmocka_unit_test(test_fault_slab_past_range),
        cmocka_unit_test(test_ingest_without_decoding),
        cmocka_unit_test(test_concurrent_requests_batch_exactly),
        cmocka_unit_test(test_concurrent_decode_during_bridge),
        cmocka_unit_test(test_concurrent_decode_during_bridge_tail_after),
        cmocka_unit_test(test_cache_budget_admission),
        cmocka_unit_test(test_abandoned_request_is_not_computed),
        cmocka_unit_test(test_penalties_reach_the_sampler),
        cmocka_unit_test(test_logprobs_are_the_models),
        cmocka_unit_test(test_echo_prompt_logprobs),
        cmocka_unit_test(test_tokenize_matches_completions),
        cmocka_unit_test(test_json_mode),
        cmocka_unit_test(test_json_schema_mode),
        cmocka_unit_test(test_choices_are_single_requests),
        cmocka_unit_test(test_min_tokens_and_stop_ids),
        cmocka_unit_test(test_prefill_mode),
        cmocka_unit_test(test_bridged_blocks_are_evictable),
        cmocka_unit_test(test_filler_rows_slab_path),
        cmocka_unit_test(test_prefill_node_drains),
        cmocka_unit_test(test_prefill_node_ops),
        cmocka_unit_test(test_openai_client_streams),
        cmocka_unit_test(test_chat_without_template),
        cmocka_unit_test(test_verdict_cut_at_a_word),
    };
    if (getenv("KVB_TEST_FILTER")) cmocka_set_test_filter(getenv("KVB_TEST_FILTER")); /* e.g. CI's TSan pass */
    const size_t n = shard_tests(tests, sizeof tests / sizeof tests[0]);
    return _cmocka_run_group_tests("test_node_loop", tests, n, setup, NULL);
}
