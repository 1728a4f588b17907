/* tests/test_decode_batch.c — the decode node's batcher (node/decode_batch.c) on its own, with a
 * tiny model's engine: a prompt phase has the engine to itself (no step runs between
 * exec_begin and exec_end), runs the steps waiting when it begins, and a prompt waiting to begin
 * goes before the next batch of a request that decodes without a pause (before that rule, an
 * awake leader won the engine every time); two requests stepping together get the tokens they
 * get alone; and a prompt computed in slices beside a decoding request's steps (one forward for
 * both) gets the logits of computing it in one piece, while the request gets its own tokens. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvb_quant.h"
#include "kvbt.h"
#include "node_internal.h"

#define STEPS 300

static kvb_model *g_model;

static int setup(void **state) {
    (void)state;
    char path[512];
    kvbt_tmp_path(path, sizeof path, "batcher.gguf");
    kvb_gen_opts o = {.preset = "tiny", .type = KVB_TYPE_Q8_0, .seed = 8, .n_threads = 2};
    kvb_err err = {0};
    if (kvb_gen_model(&o, path, &err) || kvb_model_load(path, &g_model, &err)) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    kvb_model_free(g_model);
    return 0;
}

typedef struct {
    kvb_decode_batch *b;
    kvb_seq *s;
    int32_t first;       /* the token after the prompt */
    int32_t out[STEPS];  /* the tokens sampled */
    int n_steps;
    atomic_int done;     /* steps returned so far */
    kvb_status st;
} decoder;

/* A request decoding without a pause: hands in its next step as soon as the last returns. */
static void *decode_main(void *arg) {
    decoder *d = arg;
    kvb_sampler smp;
    kvb_sampler_opts so = {.temperature = 0};
    kvb_err err = {0};
    d->st = kvb_sampler_init(&smp, &so, g_model->d.n_vocab, &err);
    kvb_decode_step step = {.s = d->s, .smp = &smp, .token = d->first};
    kvb_decode_batch_join(d->b);
    for (int i = 0; !d->st && i < d->n_steps; i++) {
        d->st = kvb_decode_batch_step(d->b, &step);
        d->out[i] = step.next;
        step.token = step.next;
        atomic_fetch_add(&d->done, 1);
    }
    kvb_decode_batch_leave(d->b);
    kvb_sampler_free(&smp);
    return NULL;
}

static kvb_engine *make_engine(void) {
    kvb_engine_opts o = {.n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = 16, .max_ctx = 512,
                         .n_blocks = 128};
    kvb_engine *e = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_engine_create(g_model, &o, &e, &err), KVB_OK);
    return e;
}

static void prefill(kvb_engine *e, kvb_seq **s, uint64_t seed, int32_t *first) {
    kvb_err err = {0};
    int32_t toks[8];
    for (int i = 0; i < 8; i++) toks[i] = (int32_t)((seed * 31 + (uint64_t)i * 7) % g_model->d.n_vocab);
    assert_int_equal(kvb_seq_create(e, s, &err), KVB_OK);
    assert_int_equal(kvb_engine_forward(e, *s, toks, 8, NULL, false, &err), KVB_OK);
    *first = toks[7];
}

static void test_prompt_phase_goes_first_and_alone(void **state) {
    (void)state;
    kvb_engine *e = make_engine();
    kvb_decode_batch *b = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_decode_batch_create(e, 4, g_model->d.n_vocab, NULL, NULL, NULL, &b, &err), KVB_OK);
    decoder d = {.b = b, .n_steps = STEPS};
    prefill(e, &d.s, 1, &d.first);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, decode_main, &d), 0);
    while (atomic_load(&d.done) < 20) usleep(100);
    for (int round = 0; round < 5; round++) { /* prompt phases while it decodes flat out */
        const int before = atomic_load(&d.done);
        kvb_decode_batch_exec_begin(b);
        usleep(20000); /* the prompt computes for 20 ms (~100 of this model's steps): nobody else may */
        const int during = atomic_load(&d.done);
        kvb_decode_batch_exec_end(b);
        /* at most the batch in flight when it asked and the step the phase ran as it began, plus
         * one step's count that lands late (the counter moves after a step returns); without the
         * rule the decoder kept the engine for all its remaining ~280 steps */
        if (during - before > 3)
            fail_msg("round %d: %d steps ran from a prompt's asking to its end", round, during - before);
        usleep(2000);
    }
    pthread_join(th, NULL);
    assert_int_equal(d.st, KVB_OK);
    assert_int_equal(atomic_load(&d.done), STEPS);
    kvb_seq_free(d.s);
    kvb_decode_batch_free(b);
    kvb_engine_free(e);
}

static void test_two_requests_batched_get_their_own_tokens(void **state) {
    (void)state;
    int32_t alone[2][STEPS];
    for (int pass = 0; pass < 2; pass++) {
        kvb_engine *e = make_engine();
        kvb_decode_batch *b = NULL;
        kvb_err err = {0};
        assert_int_equal(kvb_decode_batch_create(e, 4, g_model->d.n_vocab, NULL, NULL, NULL, &b, &err), KVB_OK);
        decoder d[2] = {{.b = b, .n_steps = 40}, {.b = b, .n_steps = 40}};
        pthread_t th[2];
        for (int i = 0; i < 2; i++) prefill(e, &d[i].s, 5 + (uint64_t)i, &d[i].first);
        if (pass == 0) /* each alone */
            for (int i = 0; i < 2; i++) {
                assert_int_equal(pthread_create(&th[i], NULL, decode_main, &d[i]), 0);
                pthread_join(th[i], NULL);
                memcpy(alone[i], d[i].out, sizeof d[i].out);
            }
        else { /* together */
            for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&th[i], NULL, decode_main, &d[i]), 0);
            for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
            for (int i = 0; i < 2; i++) assert_memory_equal(alone[i], d[i].out, sizeof(int32_t) * 40);
        }
        for (int i = 0; i < 2; i++) {
            assert_int_equal(d[i].st, KVB_OK);
            kvb_seq_free(d[i].s);
        }
        kvb_decode_batch_free(b);
        kvb_engine_free(e);
    }
}

static void test_prompt_slices_carry_the_steps(void **state) {
    (void)state;
    enum { PROMPT = 200, SLICE = 8, STEPS_HERE = 120 };
    const uint32_t V = g_model->d.n_vocab;
    int32_t prompt[PROMPT], alone[STEPS_HERE];
    for (int i = 0; i < PROMPT; i++) prompt[i] = (int32_t)((uint64_t)i * 2654435761u % V);
    float *want = malloc(sizeof(float) * V), *got = malloc(sizeof(float) * V);
    assert_true(want && got);
    kvb_err err = {0};
    for (int pass = 0; pass < 2; pass++) {
        kvb_engine *e = make_engine();
        kvb_decode_batch *b = NULL;
        assert_int_equal(kvb_decode_batch_create(e, 4, V, NULL, NULL, NULL, &b, &err), KVB_OK);
        decoder d = {.b = b, .n_steps = STEPS_HERE};
        prefill(e, &d.s, 9, &d.first);
        kvb_seq *ps;
        assert_int_equal(kvb_seq_create(e, &ps, &err), KVB_OK);
        if (pass == 0) { /* the request alone, then the prompt in one piece */
            decode_main(&d);
            memcpy(alone, d.out, sizeof alone);
            assert_int_equal(kvb_engine_forward(e, ps, prompt, PROMPT, want, false, &err), KVB_OK);
        } else { /* the prompt in slices while the request decodes flat out */
            pthread_t th;
            assert_int_equal(pthread_create(&th, NULL, decode_main, &d), 0);
            while (atomic_load(&d.done) < 5) usleep(100);
            kvb_decode_batch_exec_begin(b);
            const int before = atomic_load(&d.done);
            for (int done = 0; done < PROMPT; done += SLICE)
                if (kvb_decode_batch_forward_slice(b, ps, prompt + done, SLICE, done + SLICE == PROMPT ? got : NULL,
                                                   &err))
                    fail_msg("slice at %d: %s", done, err.msg);
            const int during = atomic_load(&d.done) - before;
            kvb_decode_batch_exec_end(b);
            pthread_join(th, NULL);
            printf("%d of the request's steps ran in the prompt's %d slices\n", during, PROMPT / SLICE);
            /* within the prompt phase, so in its slices' forwards: more than the one step that
             * exec_begin ran and whose count can land late */
            assert_true(during > 1);
            assert_memory_equal(want, got, sizeof(float) * V);
            assert_memory_equal(alone, d.out, sizeof alone);
        }
        assert_int_equal(d.st, KVB_OK);
        assert_int_equal(kvb_seq_len(ps), PROMPT);
        kvb_seq_free(ps);
        kvb_seq_free(d.s);
        kvb_decode_batch_free(b);
        kvb_engine_free(e);
    }
    free(want);
    free(got);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prompt_phase_goes_first_and_alone),
        cmocka_unit_test(test_two_requests_batched_get_their_own_tokens),
        cmocka_unit_test(test_prompt_slices_carry_the_steps),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
