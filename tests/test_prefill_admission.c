/* tests/test_prefill_admission.c — a prefill node serving several decode nodes (a tiny generated
 * model, CPU engines, every node in this process, loopback): its queue hands the engine over round
 * robin between decode nodes (one that sends many PREFILLs at once does not make another wait
 * behind all of them: the order the node served them in is checked, not times); a full queue
 * refuses at once with an ERROR of code BUSY, which a decode node with one prefill node answers
 * natively (`declined: prefill node busy (...)`) and one with two sends to the other
 * (`complete (via B: A busy)`); a small prefix-cache budget evicts the least recently used
 * conversation, whose next turn the prefill node computes again. Every reply equals, byte for
 * byte, the reply of a decode node without peers (native); /metrics counts what happened. */
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
#include "kvb_store.h"
#include "kvb_transport.h"
#include "kvbt.h"
#include "node_client.h"

#define PSK "admission-key-0123456789abcdef"

static char g_model[512];
static kvb_model *g_m; /* the same file, for the tests' own PREFILLs */

static int setup(void **state) {
    (void)state;
    kvbt_tmp_path(g_model, sizeof g_model, "admission.gguf");
    g_m = kvbt_gen_load("admission.gguf", "tiny", KVB_TYPE_Q8_0, 37);
    return g_m ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    kvb_model_free(g_m);
    return 0;
}

static kvb_prefill_node *start_prefill(const char *fault, uint32_t max_queue, uint32_t per_decoder,
                                       uint32_t cache_blocks, uint32_t max_ctx) {
    kvb_prefill_config c = {.listen = "127.0.0.1:0", .http_listen = "127.0.0.1:0", .model_path = g_model,
                            .psk = PSK, .n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32,
                            .max_ctx = max_ctx, .fault = fault, .max_queue = max_queue,
                            .max_queue_per_decoder = per_decoder, .cache_blocks = cache_blocks};
    kvb_prefill_node *n = NULL;
    kvb_err err = {0};
    if (kvb_prefill_node_start(&c, &n, &err)) fail_msg("prefill node: %s", err.msg);
    return n;
}

/* A decode node named `name` with n_peers of the prefill nodes on ports[] (named A, B; none: the
 * native reference). */
static kvb_decode_node *start_decode(const char *name, const uint16_t *ports, uint32_t n_peers) {
    /* a busy history peer is asked anyway (its queue of 2 is below 100): it answers BUSY */
    return kvbt_start_decode(g_model, PSK, ports, n_peers, name, 100);
}

static double pmetric(kvb_prefill_node *pn, const char *series) {
    return kvbt_metric(kvb_prefill_node_http_port(pn), series);
}

static void wait_in_flight(kvb_prefill_node *pn, unsigned want) {
    for (int i = 0; i < 20000 && kvb_prefill_node_in_flight(pn) != want; i++) usleep(1000);
    assert_int_equal(kvb_prefill_node_in_flight(pn), want);
}

/* ---- a decode node's side on the wire, for sending PREFILLs back to back --------------------- */

typedef struct {
    uint16_t port;
    const char *name; /* its HELLO's */
    int requests;     /* sent one after another on one connection */
    uint64_t seed;
    const kvb_model *m;
    int done, refused; /* DONEs, and ERRORs of code BUSY */
    char why[160];     /* the last BUSY's message */
    pthread_t th;
} raw_decoder;

static kvb_conn *dial_named(uint16_t port, const kvb_model *m, const char *name, kvb_kvformat *f) {
    kvb_err err = {0};
    kvb_hello h;
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    if (kvb_model_kvformat(&m->d, KVB_TYPE_F16, 32, f, &err) ||
        kvb_hello_init(&h, KVB_ROLE_DECODE, KVB_BRIDGE_MODE_DECODER, name, m->fingerprint, f, &err))
        return NULL;
    kvb_transport_config tc = {.psk = (const uint8_t *)PSK, .psk_len = strlen(PSK)};
    kvb_conn *c = NULL;
    return kvb_transport_connect(addr, &h, &tc, 5000, &c, NULL, &err) ? NULL : c;
}

/* Each request: 641 tokens, 640 shipped (20 blocks), read to its DONE or ERROR. */
static void *raw_main(void *arg) {
    raw_decoder *d = arg;
    kvb_kvformat f;
    kvb_conn *c = dial_named(d->port, d->m, d->name, &f);
    for (int i = 0; c && i < d->requests; i++) {
        int32_t ids[641];
        kvbt_prompt_ids(ids, 641, d->seed + (uint64_t)i);
        kvb_msg_prefill p = {.request_id = 100 + (uint64_t)i, .bridge_mode = KVB_BRIDGE_MODE_DECODER, .n_tokens = 641,
                             .ship_tokens = 640, .tokens = ids,
                             .last_cached_key = kvb_chain_root(d->m->fingerprint, kvb_kvformat_fingerprint(&f))};
        kvb_err err = {0};
        if (kvb_conn_send_prefill(c, &p, 5000, &err)) break;
        for (;;) {
            kvb_msg r;
            if (kvb_conn_recv(c, 60000, &r, &err)) goto out;
            const int type = r.type;
            if (type == KVB_FRAME_ERROR && r.u.error.code == KVB_WIRE_ERR_BUSY) {
                d->refused++;
                snprintf(d->why, sizeof d->why, "%.150s", r.u.error.msg);
            }
            kvb_msg_free(&r);
            if (type == KVB_FRAME_DONE) d->done++;
            if (type == KVB_FRAME_DONE || type == KVB_FRAME_ERROR) break;
        }
    }
out:
    kvb_conn_close(c);
    return NULL;
}

static void raw_start(raw_decoder *d) { assert_int_equal(pthread_create(&d->th, NULL, raw_main, d), 0); }

/* A sends 6 PREFILLs from 3 connections (3 threads, 2 each), B 2 from one: B's first is served
 * right after the request computing when it arrived, not behind A's 2 that waited before it, and
 * B's second before A's last. The first request pauses 2 s, so the others queue meanwhile. */
static void test_round_robin_between_decode_nodes(void **state) {
    (void)state;
    kvb_prefill_node *pn = start_prefill("pause:1x1", 0, 0, 0, 4096);
    const kvb_model *m = g_m;
    const uint16_t port = kvb_prefill_node_port(pn);
    raw_decoder a[3], b = {.port = port, .name = "B", .requests = 2, .seed = 900, .m = m};
    for (int k = 0; k < 3; k++) a[k] = (raw_decoder){.port = port, .name = "A", .requests = 2, .seed = 100 * (uint64_t)k, .m = m};
    raw_start(&a[0]);
    wait_in_flight(pn, 1); /* computing, paused */
    raw_start(&a[1]);
    wait_in_flight(pn, 2);
    raw_start(&a[2]);
    wait_in_flight(pn, 3); /* two of A's waiting */
    raw_start(&b);
    wait_in_flight(pn, 4); /* then B's */
    char served[1024];
    kvb_prefill_node_served(pn, served, sizeof served);
    assert_string_equal(served, "A@127.0.0.1"); /* still the first: the others queued while it paused */
    for (int k = 0; k < 3; k++) pthread_join(a[k].th, NULL);
    pthread_join(b.th, NULL);
    for (int k = 0; k < 3; k++) assert_int_equal(a[k].done, 2);
    assert_int_equal(b.done, 2);
    kvb_prefill_node_served(pn, served, sizeof served);
    printf("served: %s\n", served);
    char order[9] = "";
    int n = 0;
    for (char *t = strtok(served, " "); t && n < 8; t = strtok(NULL, " ")) order[n++] = t[0];
    assert_int_equal(n, 8);
    /* FIFO would give AAAB...; round robin gives the engine to B next, and again before A's last */
    assert_int_equal(order[1], 'B');
    const char *b2 = strchr(order + 2, 'B');
    assert_non_null(b2);
    assert_true(b2 - order < 7);
    assert_true(pmetric(pn, "kvbridge_prefill_decoder_requests_total{decoder=\"A@127.0.0.1\",outcome=\"served\"} ") == 6);
    assert_true(pmetric(pn, "kvbridge_prefill_decoder_requests_total{decoder=\"B@127.0.0.1\",outcome=\"served\"} ") == 2);
    assert_true(pmetric(pn, "kvbridge_prefill_queue_wait_seconds_count ") == 8);
    assert_true(pmetric(pn, "kvbridge_prefill_queue ") == 0);
    kvb_prefill_node_stop(pn);
}

/* --max-queue-per-decoder 1: with one of A's requests computing and one waiting, A's third is
 * refused at once as BUSY naming that bound, while B's, from another decode node, still waits its
 * turn and is served. */
static void test_per_decoder_bound(void **state) {
    (void)state;
    kvb_prefill_node *pn = start_prefill("pause:1x1", 0, 1, 0, 4096);
    const uint16_t port = kvb_prefill_node_port(pn);
    raw_decoder a[3], b = {.port = port, .name = "B", .requests = 1, .seed = 900, .m = g_m};
    for (int k = 0; k < 3; k++) a[k] = (raw_decoder){.port = port, .name = "A", .requests = 1, .seed = 10 * (uint64_t)k, .m = g_m};
    raw_start(&a[0]);
    wait_in_flight(pn, 1);
    raw_start(&a[1]);
    wait_in_flight(pn, 2);
    raw_start(&a[2]);
    pthread_join(a[2].th, NULL); /* answered at once, while the first still pauses */
    assert_int_equal(a[2].refused, 1);
    assert_string_equal(a[2].why, "this decoder's share full: 1 of 1 waiting, --max-queue-per-decoder 1");
    raw_start(&b);
    wait_in_flight(pn, 3);
    for (int k = 0; k < 2; k++) pthread_join(a[k].th, NULL);
    pthread_join(b.th, NULL);
    assert_int_equal(a[0].done + a[1].done + b.done, 3);
    assert_true(pmetric(pn, "kvbridge_prefill_decoder_requests_total{decoder=\"A@127.0.0.1\",outcome=\"busy_decoder\"} ") == 1);
    assert_true(pmetric(pn, "kvbridge_prefill_decoder_requests_total{decoder=\"B@127.0.0.1\",outcome=\"served\"} ") == 1);
    kvb_prefill_node_stop(pn);
}

static void same_as_native(uint16_t dp, uint16_t np, const int32_t *ids, int n, kvbt_reply *f) {
    kvbt_reply r;
    kvbt_complete_ids(dp, ids, n, f);
    kvbt_complete_ids(np, ids, n, &r);
    assert_string_equal(f->content, r.content);
    assert_int_equal(f->completion, r.completion);
    free(r.content);
}

/* --max-queue 1 on A: X's request computes (stalled at its 60th slab, a request of 80), Y's waits;
 * then a decode node with A alone is refused BUSY and answers natively, and one with A and B, whose
 * conversation's history A holds, is refused by A and bridged by B. */
static void test_full_queue_refuses_busy(void **state) {
    (void)state;
    kvb_prefill_node *pa = start_prefill("stall:60x1", 1, 0, 0, 4096), *pb = start_prefill(NULL, 0, 0, 0, 4096);
    const uint16_t ports[2] = {kvb_prefill_node_port(pa), kvb_prefill_node_port(pb)};
    kvb_decode_node *one = start_decode("one", ports, 1), *two = start_decode("two", ports, 2);
    kvb_decode_node *nat = start_decode(NULL, NULL, 0);
    const uint16_t np = kvb_decode_node_port(nat);
    int32_t ids[400];
    kvbt_prompt_ids(ids, 400, 77);
    kvbt_reply f;
    same_as_native(kvb_decode_node_port(two), np, ids, 200, &f); /* a new conversation: A first on a tie */
    printf("two, turn 0: %s [%s]\n", f.verdict, f.peer);
    assert_string_equal(f.peer, "A");
    free(f.content);

    const kvb_model *m = g_m;
    raw_decoder x = {.port = ports[0], .name = "X", .requests = 1, .seed = 5, .m = m};
    raw_decoder y = {.port = ports[0], .name = "Y", .requests = 1, .seed = 6, .m = m};
    raw_start(&x);
    wait_in_flight(pa, 1);
    raw_start(&y);
    wait_in_flight(pa, 2);

    int32_t other[300];
    kvbt_prompt_ids(other, 300, 78);
    same_as_native(kvb_decode_node_port(one), np, other, 300, &f);
    printf("one: %s\n", f.verdict);
    if (strcmp(f.verdict, "declined: prefill node busy (queue full: 1 waiting, --max-queue 1)"))
        fail_msg("verdict '%s'", f.verdict);
    assert_int_equal(f.bridged, 0);
    free(f.content);

    same_as_native(kvb_decode_node_port(two), np, ids, 300, &f); /* history on A, which is full */
    printf("two, turn 1: %s [%s]\n", f.verdict, f.peer);
    if (strncmp(f.verdict, "complete (via B: A busy)", 24)) fail_msg("verdict '%s'", f.verdict);
    assert_string_equal(f.peer, "B");
    assert_true(f.bridged > 0);
    free(f.content);
    assert_true(pmetric(pa, "kvbridge_prefill_decoder_requests_total{decoder=\"one@127.0.0.1\",outcome=\"busy_queue\"} ") == 1);
    assert_true(pmetric(pa, "kvbridge_prefill_decoder_requests_total{decoder=\"two@127.0.0.1\",outcome=\"busy_queue\"} ") == 1);
    assert_true(pmetric(pa, "kvbridge_prefill_requests_total{outcome=\"busy\"} ") == 2);
    assert_true(pmetric(pa, "kvbridge_prefill_queue ") == 1);
    assert_true(kvbt_metric(kvb_decode_node_port(one), "kvbridge_bridge_faults_total{kind=\"peer_busy\"} ") == 1);

    kvb_prefill_node_stop(pa); /* ends X's stall; Y, waiting, is refused */
    pthread_join(x.th, NULL);
    pthread_join(y.th, NULL);
    kvb_decode_node_stop(one);
    kvb_decode_node_stop(two);
    kvb_decode_node_stop(nat);
    kvb_prefill_node_stop(pb);
}

/* A prefix cache of 24 blocks on the prefill node, three conversations (turns of 200 then 300
 * tokens: 199 then 299 shipped, the second turn's 107 beyond the 192 the decoder cached): after the
 * three first turns (6 whole blocks each, and a page for the tail) the second turns of the second
 * and third conversations need room, and the third's evicts the least recently used blocks, the
 * first conversation's; that one's second turn is then computed beyond its 107 new tokens. Every
 * turn still complete and equal to native. */
static void test_prefix_cache_budget_evicts(void **state) {
    (void)state;
    kvb_prefill_node *pn = start_prefill(NULL, 0, 0, 24, 512);
    const uint16_t port = kvb_prefill_node_port(pn);
    kvb_decode_node *dn = start_decode("d", &port, 1), *nat = start_decode(NULL, NULL, 0);
    const uint16_t dp = kvb_decode_node_port(dn), np = kvb_decode_node_port(nat);
    int32_t ids[3][300];
    for (int c = 0; c < 3; c++) kvbt_prompt_ids(ids[c], 300, 300 + (uint64_t)c);
    const char *const k_computed = "kvbridge_prefill_tokens_total{kind=\"computed\"} ";
    const char *const k_evicted = "kvbridge_prefill_cache_evictions_total ";
    static const int order[][2] = {{0, 0}, {1, 0}, {2, 0}, {1, 1}, {2, 1}, {0, 1}}; /* (conversation, turn) */
    double computed[3][2], evicted[6];
    for (int k = 0; k < 6; k++) {
        const int c = order[k][0], t = order[k][1];
        const double before = pmetric(pn, k_computed);
        kvbt_reply f;
        same_as_native(dp, np, ids[c], 200 + 100 * t, &f);
        computed[c][t] = pmetric(pn, k_computed) - before;
        evicted[k] = pmetric(pn, k_evicted);
        printf("conversation %d turn %d: %s; the prefill node computed %.0f tokens, %.0f blocks evicted so far\n", c,
               t, f.verdict, computed[c][t], evicted[k]);
        if (strncmp(f.verdict, "complete", 8)) fail_msg("verdict '%s'", f.verdict);
        free(f.content);
    }
    for (int c = 0; c < 3; c++) assert_true(computed[c][0] == 199);
    assert_true(evicted[3] == 0);                              /* 21 blocks held, and a tail page */
    assert_true(computed[1][1] == 107 && computed[2][1] == 107); /* on their own cached history */
    assert_true(evicted[4] > 0);                               /* the third's second turn made room */
    assert_true(computed[0][1] > 107);                         /* the first's history, evicted: computed again */
    assert_true(pmetric(pn, "kvbridge_prefill_tokens_total{kind=\"cached\"} ") >= 2 * 192);
    kvb_decode_node_stop(dn);
    kvb_decode_node_stop(nat);
    kvb_prefill_node_stop(pn);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_robin_between_decode_nodes),
        cmocka_unit_test(test_per_decoder_bound),
        cmocka_unit_test(test_full_queue_refuses_busy),
        cmocka_unit_test(test_prefix_cache_budget_evicts),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
