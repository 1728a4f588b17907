/* tests/test_node_fleet.c — one decode node with two prefill peers, A and B, on loopback (a tiny
 * generated model, CPU engines, every node in this process): 8 conversations of 4 turns from 4
 * concurrent clients are placed on the prefill node that produced their history ("history"),
 * new conversations spread over both ("new"); a prefill node stopped between turns has its
 * conversations' next turns moved to the other ("moved"); a prefill node dropping its lanes
 * mid-stream has the missing blocks shipped by the other, the verdict naming both. Every reply
 * equals, byte for byte, the reply of a decode node without peers (native). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvbt.h"
#include "node_client.h"

#define PSK "fleet-key-0123456789abcdef"
#define CONVS 8
#define TURNS 4    /* in the first phase; one more after a peer stopped */
#define CLIENTS 4
#define FIRST 200  /* prompt tokens of a conversation's first turn */
#define STEP 100   /* tokens each later turn adds (above the bridge threshold of 64) */
#define MAX_IDS (FIRST + STEP * TURNS)

static char g_model[512];

static int setup(void **state) {
    (void)state;
    kvb_err err = {0};
    kvbt_tmp_path(g_model, sizeof g_model, "fleet.gguf");
    kvb_gen_opts o = {.preset = "tiny", .type = KVB_TYPE_Q8_0, .seed = 31, .n_threads = 2};
    if (kvb_gen_model(&o, g_model, &err)) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static kvb_prefill_node *start_prefill(const char *fault) {
    kvb_prefill_config c = {.listen = "127.0.0.1:0", .model_path = g_model, .psk = PSK, .n_threads = 1,
                            .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096, .fault = fault};
    kvb_prefill_node *n = NULL;
    kvb_err err = {0};
    if (kvb_prefill_node_start(&c, &n, &err)) fail_msg("prefill node: %s", err.msg);
    return n;
}

/* A decode node with peers A and B (a_port 0: none at all, the native reference). */
static kvb_decode_node *start_decode(uint16_t a_port, uint16_t b_port) {
    const uint16_t ports[2] = {a_port, b_port};
    return kvbt_start_decode(g_model, PSK, ports, a_port ? 2 : 0, NULL, 0);
}

/* One turn's outcome, recorded by a client thread and checked by the test's own. */
typedef struct {
    char verdict[160], peer[128], placement[16];
    bool same_as_native;
    int attempts;
} turn_result;

typedef struct {
    int32_t ids[MAX_IDS]; /* turn t's prompt: ids[0 .. FIRST + t * STEP) */
    turn_result turn[TURNS + 1];
} conversation;

typedef struct {
    uint16_t dp, np; /* the fleet's decode node, the native one */
    conversation *convs;
    int client, t0, t1; /* this client's conversations (i % CLIENTS == client), turns [t0, t1) */
} client_arg;

/* The peer that produced a turn's last block: the last name of "A" or "A then B". */
static const char *last_peer(const turn_result *r) {
    const char *p = strrchr(r->peer, ' ');
    return p ? p + 1 : r->peer;
}

static void *client_main(void *arg) {
    client_arg *a = arg;
    for (int t = a->t0; t < a->t1; t++)
        for (int i = a->client; i < CONVS; i += CLIENTS) {
            conversation *c = &a->convs[i];
            turn_result *r = &c->turn[t];
            kvbt_reply f, n;
            kvbt_complete_ids(a->dp, c->ids, FIRST + t * STEP, &f);
            kvbt_complete_ids(a->np, c->ids, FIRST + t * STEP, &n);
            snprintf(r->verdict, sizeof r->verdict, "%s", f.verdict);
            snprintf(r->peer, sizeof r->peer, "%s", f.peer);
            snprintf(r->placement, sizeof r->placement, "%s", f.placement);
            r->same_as_native = !strcmp(f.content, n.content) && f.completion == n.completion;
            r->attempts = f.attempts;
            free(f.content);
            free(n.content);
        }
    return NULL;
}

/* Turns [t0, t1) of every conversation from CLIENTS concurrent clients. */
static void run_turns(uint16_t dp, uint16_t np, conversation *convs, int t0, int t1) {
    pthread_t th[CLIENTS];
    client_arg args[CLIENTS];
    for (int k = 0; k < CLIENTS; k++) {
        args[k] = (client_arg){.dp = dp, .np = np, .convs = convs, .client = k, .t0 = t0, .t1 = t1};
        assert_int_equal(pthread_create(&th[k], NULL, client_main, &args[k]), 0);
    }
    for (int k = 0; k < CLIENTS; k++) pthread_join(th[k], NULL);
}

static double metric(uint16_t port, const char *fmt, const char *label) {
    char series[160];
    snprintf(series, sizeof series, fmt, label);
    return kvbt_metric(port, series);
}

/* Every turn equal to native and complete, via the peer and placement the rules give: a first turn
 * "new"; a later one "history" on the peer that produced the turn before, unless that was `gone`
 * (then "moved" to the other, the verdict saying why). */
static void check_turn(const conversation *c, int i, int t, const char *gone) {
    const turn_result *r = &c->turn[t];
    printf("conversation %d turn %d: %s [%s, %s]\n", i, t, r->verdict, r->peer, r->placement);
    if (!r->same_as_native) fail_msg("conversation %d turn %d: the reply differs from the native one", i, t);
    if (strncmp(r->verdict, "complete (via ", 14)) fail_msg("conversation %d turn %d: '%s'", i, t, r->verdict);
    if (strcmp(r->peer, "A") && strcmp(r->peer, "B")) fail_msg("turn %d bridged by '%s'", t, r->peer);
    if (t == 0) {
        assert_string_equal(r->placement, "new");
        return;
    }
    const char *before = last_peer(&c->turn[t - 1]);
    if (gone && !strcmp(before, gone)) {
        char why[96];
        snprintf(why, sizeof why, "history on %s, %s down", gone, gone);
        assert_string_equal(r->placement, "moved");
        if (!strcmp(r->peer, gone) || !strstr(r->verdict, why)) fail_msg("'%s' via %s", r->verdict, r->peer);
    } else {
        assert_string_equal(r->placement, "history");
        assert_string_equal(r->peer, before);
    }
}

static void test_fleet_places_by_history(void **state) {
    (void)state;
    kvb_prefill_node *pa = start_prefill(NULL), *pb = start_prefill(NULL);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pa), kvb_prefill_node_port(pb));
    kvb_decode_node *nat = start_decode(0, 0);
    const uint16_t dp = kvb_decode_node_port(dn), np = kvb_decode_node_port(nat);
    assert_true(metric(dp, "kvbridge_peer_up{peer=\"%s\"} ", "A") == 1);
    assert_true(metric(dp, "kvbridge_peer_up{peer=\"%s\"} ", "B") == 1);
    conversation *convs = calloc(CONVS, sizeof *convs);
    assert_non_null(convs);
    for (int i = 0; i < CONVS; i++) kvbt_prompt_ids(convs[i].ids, MAX_IDS, 500 + (uint64_t)i);

    run_turns(dp, np, convs, 0, TURNS);
    int first_on_a = 0;
    for (int i = 0; i < CONVS; i++) {
        for (int t = 0; t < TURNS; t++) check_turn(&convs[i], i, t, NULL);
        first_on_a += !strcmp(convs[i].turn[0].peer, "A");
    }
    printf("new conversations: %d on A, %d on B\n", first_on_a, CONVS - first_on_a);
    assert_true(first_on_a > 0 && first_on_a < CONVS); /* both peers used */
    assert_true(metric(dp, "kvbridge_placements_total{result=\"%s\"} ", "new") == CONVS);
    assert_true(metric(dp, "kvbridge_placements_total{result=\"%s\"} ", "history") == CONVS * (TURNS - 1));
    double served = 0;
    for (int p = 0; p < 2; p++) {
        const char *name = p ? "B" : "A";
        assert_true(metric(dp, "kvbridge_peer_slab_bytes_total{peer=\"%s\"} ", name) > 0);
        served += metric(dp, "kvbridge_peer_requests_total{peer=\"%s\",verdict=\"complete\"} ", name);
    }
    assert_true(served == CONVS * TURNS);

    /* A stops between turns: the link's heartbeat finds it gone, and its conversations move to B */
    kvb_prefill_node_stop(pa);
    for (int i = 0; i < 1500 && metric(dp, "kvbridge_peer_up{peer=\"%s\"} ", "A") != 0; i++) usleep(10 * 1000);
    assert_true(metric(dp, "kvbridge_peer_up{peer=\"%s\"} ", "A") == 0);
    run_turns(dp, np, convs, TURNS, TURNS + 1);
    int moved = 0;
    for (int i = 0; i < CONVS; i++) {
        check_turn(&convs[i], i, TURNS, "A");
        moved += !strcmp(convs[i].turn[TURNS].placement, "moved");
    }
    assert_true(moved > 0);
    assert_true(metric(dp, "kvbridge_placements_total{result=\"%s\"} ", "moved") == moved);
    free(convs);
    kvb_decode_node_stop(dn);
    kvb_decode_node_stop(nat);
    kvb_prefill_node_stop(pb);
}

/* A drops its lanes at its third slab of every request: the resumed attempt asks B for the blocks
 * still missing; the verdict names both; the next turn is placed on B, which produced its history. */
static void test_fleet_peer_dies_mid_stream(void **state) {
    (void)state;
    kvb_prefill_node *pa = start_prefill("die:3"), *pb = start_prefill(NULL);
    kvb_decode_node *dn = start_decode(kvb_prefill_node_port(pa), kvb_prefill_node_port(pb));
    kvb_decode_node *nat = start_decode(0, 0);
    const uint16_t dp = kvb_decode_node_port(dn), np = kvb_decode_node_port(nat);
    int32_t ids[800];
    kvbt_prompt_ids(ids, 800, 4711);
    kvbt_reply f, n;
    kvbt_complete_ids(dp, ids, 600, &f); /* new: the least-loaded peer, A first on a tie */
    kvbt_complete_ids(np, ids, 600, &n);
    printf("turn 0: %s [%s] faults: %s\n", f.verdict, f.peer, f.faults);
    assert_string_equal(f.content, n.content);
    assert_string_equal(f.peer, "A then B");
    if (strncmp(f.verdict, "complete (via A then B, resumed: new)", 37)) fail_msg("verdict '%s'", f.verdict);
    assert_int_equal(f.attempts, 2);
    if (strncmp(f.faults, "A: ", 3)) fail_msg("faults '%s'", f.faults);
    assert_true(f.bridged >= 576); /* every whole block bridged, by one peer or the other */
    free(f.content);
    free(n.content);
    kvbt_complete_ids(dp, ids, 800, &f);
    kvbt_complete_ids(np, ids, 800, &n);
    printf("turn 1: %s [%s]\n", f.verdict, f.peer);
    assert_string_equal(f.content, n.content);
    assert_string_equal(f.placement, "history");
    if (strncmp(f.verdict, "complete (via B: history)", 25)) fail_msg("verdict '%s'", f.verdict);
    assert_true(metric(dp, "kvbridge_peer_requests_total{peer=\"%s\",verdict=\"complete\"} ", "A") == 1);
    assert_true(metric(dp, "kvbridge_peer_requests_total{peer=\"%s\",verdict=\"complete\"} ", "B") == 2);
    free(f.content);
    free(n.content);
    kvb_decode_node_stop(dn);
    kvb_decode_node_stop(nat);
    kvb_prefill_node_stop(pa);
    kvb_prefill_node_stop(pb);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fleet_places_by_history),
        cmocka_unit_test(test_fleet_peer_dies_mid_stream),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
