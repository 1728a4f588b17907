/* tests/test_staging_ring.c — the prefill node's staging ring (white box, kvb_bridge.h): copies
 * go through at most `slots` staging slots, in order, with their bytes intact, whatever the number
 * of senders; a request of views holds a whole layer's slabs at once (view_slots pushed with no
 * sender running must not block) and counts no staging memory; kvb_ring_wait_sent returns only
 * once every slab was sent; a copy pushed into a ring reset for views is refused; a failed ring
 * fails a producer blocked on it; a reset ring starts over. While kvb_ring_wait_sent waits it
 * checksums the slabs no sender took yet: every checksum a sender is handed is the slab's, and a
 * layer pushed before any sender runs is checksummed whole by the producer. kvb_ring_wait_sent_to
 * returns once the slabs before its mark were sent, not waiting for those pushed after it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvb_bridge.h"

#define SLOT_BYTES 256
#define SLOTS 4
#define VIEW_SLOTS 40
#define SENDERS 3

typedef struct {
    kvb_ring *r;
    atomic_uint taken, bytes_bad, order_bad;
    atomic_uint sums_known, sums_bad; /* checksums handed to a sender; of those, wrong ones */
    _Atomic uint32_t last_pos[SENDERS]; /* per sender: positions come in increasing order */
    int delay_us;
    uint32_t gate_from;          /* nonzero: a slab at or past this position waits for gate_open */
    atomic_bool gate_open;
    atomic_uchar done[2 * VIEW_SLOTS + 2]; /* by position: the slab was sent (before kvb_ring_done) */
} senders_ctx;

typedef struct {
    senders_ctx *c;
    int id;
} sender_arg;

/* A slab's bytes: a function of its position, so a sender can check what it got. */
static void fill(uint8_t *p, size_t n, uint32_t pos) {
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(pos * 31 + i * 7);
}

static void *sender_main(void *arg) {
    sender_arg *a = arg;
    senders_ctx *c = a->c;
    uint32_t slot;
    kvb_slab s;
    bool known;
    while (kvb_ring_take(c->r, &slot, &s, &known)) {
        if (known) {
            atomic_fetch_add(&c->sums_known, 1);
            if (s.checksum != kvb_slab_checksum(s.k, s.k_bytes, s.v, s.v_bytes)) atomic_fetch_add(&c->sums_bad, 1);
        }
        uint8_t want[SLOT_BYTES];
        fill(want, s.k_bytes, s.pos0);
        if (memcmp(want, s.k, s.k_bytes)) atomic_fetch_add(&c->bytes_bad, 1);
        fill(want, s.v_bytes, s.pos0 + 1000000);
        if (memcmp(want, s.v, s.v_bytes)) atomic_fetch_add(&c->bytes_bad, 1);
        const uint32_t prev = atomic_load(&c->last_pos[a->id]);
        if (prev && s.pos0 <= prev) atomic_fetch_add(&c->order_bad, 1);
        atomic_store(&c->last_pos[a->id], s.pos0);
        if (c->delay_us) usleep((useconds_t)c->delay_us);
        while (c->gate_from && s.pos0 >= c->gate_from && !atomic_load(&c->gate_open)) usleep(200);
        if (s.pos0 < 2 * VIEW_SLOTS + 2) atomic_store(&c->done[s.pos0], 1);
        atomic_fetch_add(&c->taken, 1);
        kvb_ring_done(c->r, slot);
    }
    return NULL;
}

static void start_senders(senders_ctx *c, pthread_t *th, sender_arg *args) {
    for (int i = 0; i < SENDERS; i++) {
        args[i] = (sender_arg){c, i};
        assert_int_equal(pthread_create(&th[i], NULL, sender_main, &args[i]), 0);
    }
}

static void join_senders(pthread_t *th) {
    for (int i = 0; i < SENDERS; i++) pthread_join(th[i], NULL);
}

static void test_copies_through_few_slots(void **state) {
    (void)state;
    kvb_ring r;
    kvb_err err = {0};
    assert_int_equal(kvb_ring_init(&r, SLOTS, VIEW_SLOTS, SLOT_BYTES, &err), KVB_OK);
    kvb_ring_reset(&r, false);
    senders_ctx c = {.r = &r};
    pthread_t th[SENDERS];
    sender_arg args[SENDERS];
    start_senders(&c, th, args);
    uint8_t k[SLOT_BYTES / 2], v[SLOT_BYTES / 2]; /* reused at once: the ring must have copied them */
    const uint32_t n = 2000;
    for (uint32_t i = 1; i <= n; i++) {
        fill(k, sizeof k, i);
        fill(v, sizeof v, i + 1000000);
        kvb_slab s = {.layer = 0, .pos0 = i, .n = 1, .k = k, .v = v, .k_bytes = sizeof k, .v_bytes = sizeof v};
        assert_int_equal(kvb_ring_push(&r, &s, &err), KVB_OK);
    }
    assert_int_equal(kvb_ring_wait_sent(&r, &err), KVB_OK);
    assert_int_equal(atomic_load(&c.taken), n); /* every slab sent before wait_sent returned */
    kvb_ring_close(&r);
    join_senders(th);
    assert_int_equal(atomic_load(&c.bytes_bad), 0);
    assert_int_equal(atomic_load(&c.order_bad), 0);
    assert_true(r.peak >= 1 && r.peak <= SLOTS); /* staging memory never grew past the ring */
    /* a slab larger than a slot is refused */
    uint8_t big[SLOT_BYTES];
    kvb_slab s = {.pos0 = 1, .n = 1, .k = big, .v = big, .k_bytes = sizeof big, .v_bytes = 1};
    assert_int_equal(kvb_ring_push(&r, &s, &err), KVB_ERR_INTERNAL);
    kvb_ring_destroy(&r);
}

static void test_views_hold_a_whole_layer(void **state) {
    (void)state;
    kvb_ring r;
    kvb_err err = {0};
    assert_int_equal(kvb_ring_init(&r, SLOTS, VIEW_SLOTS, SLOT_BYTES, &err), KVB_OK);
    static uint8_t rows[VIEW_SLOTS + 1][2][SLOT_BYTES / 2]; /* (slab, K|V, bytes): they stay put */
    for (int round = 0; round < 3; round++) { /* a reset ring starts over */
        kvb_ring_reset(&r, true);
        alarm(30); /* a push that blocks with nobody to free a slot would hang: fail instead */
        for (uint32_t i = 1; i <= VIEW_SLOTS; i++) { /* no sender runs yet: none of these may wait */
            fill(rows[i][0], SLOT_BYTES / 2, i);
            fill(rows[i][1], SLOT_BYTES / 2, i + 1000000);
            kvb_slab s = {.pos0 = i, .n = 1, .k = rows[i][0], .v = rows[i][1], .k_bytes = SLOT_BYTES / 2,
                          .v_bytes = SLOT_BYTES / 2};
            assert_int_equal(kvb_ring_push_view(&r, &s, &err), KVB_OK);
        }
        alarm(0);
        assert_int_equal(r.count, VIEW_SLOTS);
        senders_ctx c = {.r = &r, .delay_us = 200};
        pthread_t th[SENDERS];
        sender_arg args[SENDERS];
        start_senders(&c, th, args);
        assert_int_equal(kvb_ring_wait_sent(&r, &err), KVB_OK);
        assert_int_equal(atomic_load(&c.taken), VIEW_SLOTS); /* all sent, with slow senders */
        assert_int_equal(r.count, 0);
        /* the producer hashed while it waited: each checksum it made reached a sender */
        const uint32_t known = atomic_load(&c.sums_known);
        assert_int_equal(known, r.hashed_by_producer);
        /* a second layer's views while the senders work: pushes go on as slots are freed */
        for (uint32_t i = 1; i <= VIEW_SLOTS; i++) {
            kvb_slab s = {.pos0 = VIEW_SLOTS + i, .n = 1, .k = rows[i][0], .v = rows[i][1], .k_bytes = 0, .v_bytes = 0};
            assert_int_equal(kvb_ring_push_view(&r, &s, &err), KVB_OK);
        }
        kvb_ring_close(&r);
        join_senders(th);
        assert_int_equal(atomic_load(&c.taken), 2 * VIEW_SLOTS);
        assert_int_equal(atomic_load(&c.sums_known), known); /* no wait_sent for the second layer */
        assert_int_equal(atomic_load(&c.sums_bad), 0);       /* and every one was the slab's */
        assert_int_equal(atomic_load(&c.bytes_bad), 0);
        assert_int_equal(atomic_load(&c.order_bad), 0);
        assert_int_equal(r.peak, 0); /* views are not staging memory */
        /* a copy into a ring reset for views is refused (its slot could lie past the staging memory) */
        uint8_t k[8] = {0};
        kvb_slab s = {.pos0 = 1, .n = 1, .k = k, .v = k, .k_bytes = 4, .v_bytes = 4};
        kvb_ring_reset(&r, true);
        assert_int_equal(kvb_ring_push(&r, &s, &err), KVB_ERR_INTERNAL);
    }
    kvb_ring_destroy(&r);
}

typedef struct {
    kvb_ring *r;
    kvb_status st;
} producer_arg;

static void *waiting_producer(void *arg) {
    producer_arg *a = arg;
    kvb_err err = {0};
    a->st = kvb_ring_wait_sent(a->r, &err);
    return NULL;
}

static uint32_t hashed_by_producer(kvb_ring *r) {
    pthread_mutex_lock(&r->mu);
    const uint32_t n = r->hashed_by_producer;
    pthread_mutex_unlock(&r->mu);
    return n;
}

/* A layer of views pushed before any sender runs: the waiting producer checksums every one of
 * them (newest first, nobody takes any meanwhile), and the senders that start then only send. */
static void test_waiting_producer_checksums_untaken_views(void **state) {
    (void)state;
    kvb_ring r;
    kvb_err err = {0};
    assert_int_equal(kvb_ring_init(&r, SLOTS, VIEW_SLOTS, SLOT_BYTES, &err), KVB_OK);
    static uint8_t rows[VIEW_SLOTS + 1][2][SLOT_BYTES / 2];
    for (int round = 0; round < 2; round++) {
        kvb_ring_reset(&r, true);
        for (uint32_t i = 1; i <= VIEW_SLOTS; i++) {
            fill(rows[i][0], SLOT_BYTES / 2, 100 * round + i);
            fill(rows[i][1], SLOT_BYTES / 2, 100 * round + i + 1000000);
            kvb_slab s = {.pos0 = 100 * round + i, .n = 1, .k = rows[i][0], .v = rows[i][1],
                          .k_bytes = SLOT_BYTES / 2, .v_bytes = SLOT_BYTES / 2};
            assert_int_equal(kvb_ring_push_view(&r, &s, &err), KVB_OK);
        }
        producer_arg a = {.r = &r};
        pthread_t prod;
        assert_int_equal(pthread_create(&prod, NULL, waiting_producer, &a), 0);
        alarm(30);
        while (hashed_by_producer(&r) < VIEW_SLOTS) usleep(1000);
        alarm(0);
        senders_ctx c = {.r = &r};
        pthread_t th[SENDERS];
        sender_arg args[SENDERS];
        start_senders(&c, th, args);
        pthread_join(prod, NULL);
        assert_int_equal(a.st, KVB_OK);
        kvb_ring_close(&r);
        join_senders(th);
        assert_int_equal(atomic_load(&c.taken), VIEW_SLOTS);
        assert_int_equal(atomic_load(&c.sums_known), VIEW_SLOTS);
        assert_int_equal(atomic_load(&c.sums_bad), 0);
        assert_int_equal(atomic_load(&c.bytes_bad), 0);
        assert_int_equal(r.hashed_by_producer, VIEW_SLOTS);
    }
    kvb_ring_destroy(&r);
}

/* Two batches of views, the second held back by its senders: waiting for the first batch's mark
 * returns with every slab of it sent (were it to wait for the second, it would hang: alarm). */
static void test_wait_sent_to_a_mark(void **state) {
    (void)state;
    kvb_ring r;
    kvb_err err = {0};
    assert_int_equal(kvb_ring_init(&r, SLOTS, 2 * VIEW_SLOTS, SLOT_BYTES, &err), KVB_OK);
    static uint8_t rows[2][2][SLOT_BYTES / 2];
    fill(rows[0][0], SLOT_BYTES / 2, 0);
    fill(rows[0][1], SLOT_BYTES / 2, 0);
    for (int round = 0; round < 2; round++) {
        kvb_ring_reset(&r, true);
        senders_ctx c = {.r = &r, .delay_us = 100, .gate_from = VIEW_SLOTS + 1};
        pthread_t th[SENDERS];
        sender_arg args[SENDERS];
        if (round) start_senders(&c, th, args); /* senders running while pushed, or only after */
        uint64_t marks[2];
        for (int b = 0; b < 2; b++) {
            for (uint32_t i = 1; i <= VIEW_SLOTS; i++) {
                kvb_slab s = {.pos0 = (uint32_t)b * VIEW_SLOTS + i, .n = 1, .k = rows[0][0], .v = rows[0][1]};
                assert_int_equal(kvb_ring_push_view(&r, &s, &err), KVB_OK);
            }
            marks[b] = kvb_ring_mark(&r);
        }
        assert_int_equal(marks[0], VIEW_SLOTS);
        assert_int_equal(marks[1], 2 * VIEW_SLOTS);
        if (!round) start_senders(&c, th, args);
        alarm(30);
        assert_int_equal(kvb_ring_wait_sent_to(&r, marks[0], &err), KVB_OK);
        alarm(0);
        for (uint32_t i = 1; i <= VIEW_SLOTS; i++) assert_int_equal(atomic_load(&c.done[i]), 1);
        for (uint32_t i = VIEW_SLOTS + 1; i <= 2 * VIEW_SLOTS; i++) assert_int_equal(atomic_load(&c.done[i]), 0);
        atomic_store(&c.gate_open, true);
        assert_int_equal(kvb_ring_wait_sent_to(&r, marks[1], &err), KVB_OK);
        for (uint32_t i = 1; i <= 2 * VIEW_SLOTS; i++) assert_int_equal(atomic_load(&c.done[i]), 1);
        assert_int_equal(kvb_ring_wait_sent_to(&r, 0, &err), KVB_OK); /* nothing before mark 0 */
        kvb_ring_close(&r);
        join_senders(th);
        assert_int_equal(atomic_load(&c.taken), 2 * VIEW_SLOTS);
        assert_int_equal(atomic_load(&c.order_bad), 0);
    }
    kvb_ring_destroy(&r);
}

static void *blocked_producer(void *arg) {
    producer_arg *a = arg;
    kvb_err err = {0};
    uint8_t k[4] = {0};
    kvb_slab s = {.pos0 = 1, .n = 1, .k = k, .v = k, .k_bytes = 4, .v_bytes = 4};
    for (int i = 0; i <= SLOTS && !a->st; i++) a->st = kvb_ring_push(a->r, &s, &err); /* the last one blocks */
    return NULL;
}

static void test_fail_releases_a_blocked_producer(void **state) {
    (void)state;
    kvb_ring r;
    kvb_err err = {0};
    assert_int_equal(kvb_ring_init(&r, SLOTS, VIEW_SLOTS, SLOT_BYTES, &err), KVB_OK);
    kvb_ring_reset(&r, false);
    producer_arg a = {.r = &r};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, blocked_producer, &a), 0);
    for (uint32_t filled = 0; filled < SLOTS; usleep(1000)) { /* until the ring is full */
        pthread_mutex_lock(&r.mu);
        filled = r.count;
        pthread_mutex_unlock(&r.mu);
    }
    usleep(20000);
    kvb_ring_fail(&r);
    pthread_join(th, NULL);
    assert_int_equal(a.st, KVB_ERR_IO);
    assert_int_equal(kvb_ring_wait_sent(&r, &err), KVB_ERR_IO);
    kvb_ring_destroy(&r);
    assert_int_equal(kvb_ring_init(&r, 0, 0, SLOT_BYTES, &err), KVB_ERR_INVALID);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_copies_through_few_slots),
        cmocka_unit_test(test_views_hold_a_whole_layer),
        cmocka_unit_test(test_waiting_producer_checksums_untaken_views),
        cmocka_unit_test(test_wait_sent_to_a_mark),
        cmocka_unit_test(test_fail_releases_a_blocked_producer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
