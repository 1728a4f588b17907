/* tests/test_sampler.c — kvb_sample against a plain reference written from its specification
 * (kvb_engine_cpu.h): every probability computed, the whole vocabulary ranked by (p descending, id
 * ascending), top-k, then top-p against the kept mass, one draw. The sampler ranks only the bins
 * of probabilities that can be kept; it must pick the same token as the reference on every draw,
 * over vocabularies of 1 to 128K entries, logits spread narrowly and widely, ties, masked (-inf)
 * logits, and top-k/top-p settings from none to extreme, on one thread and on a pool of three.
 * Also: greedy is the first maximum exactly as a plain scan finds it (NaNs, signed zeros, ties),
 * top-k 1 and a tiny top-p are greedy, and a small vocabulary's draw frequencies follow its
 * probabilities. Logprobs: log_softmax against long double on random logits of 1 to 128K entries,
 * the top ones ranked (ties by id, NaN skipped, -inf last), and taken from the logits before any
 * bias or penalty changed them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_engine_cpu.h"

static int by_p_then_id(const void *a, const void *b) {
    const kvb_prob_id *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->id - y->id;
}

/* The specification, done the slow way (rng: the same stream the sampler draws from). */
static int32_t reference_sample(const kvb_sampler_opts *o, const float *logits, uint32_t n, kvb_rng *rng) {
    int32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = (int32_t)i;
    if (o->temperature <= 0) return best;
    kvb_prob_id *c = malloc(n * sizeof *c);
    double total = 0;
    for (uint32_t i = 0; i < n; i++) {
        c[i].p = expf((logits[i] - logits[best]) / o->temperature);
        c[i].id = (int32_t)i;
        total += c[i].p;
    }
    const bool cut = (o->top_k > 0 && (uint32_t)o->top_k < n) || o->top_p < 1.0f;
    uint32_t m = n;
    double kept = total;
    if (cut) {
        qsort(c, n, sizeof *c, by_p_then_id);
        if (o->top_k > 0 && (uint32_t)o->top_k < n) {
            m = (uint32_t)o->top_k;
            kept = 0;
            for (uint32_t i = 0; i < m; i++) kept += c[i].p;
        }
        if (o->top_p < 1.0f) {
            const double want = o->top_p * kept;
            double acc = 0;
            for (uint32_t i = 0; i < m; i++) {
                acc += c[i].p;
                if (acc >= want) {
                    m = i + 1;
                    break;
                }
            }
            kept = acc;
        }
    }
    const double r = (double)kvb_rng_uniform(rng) * kept;
    double acc = 0;
    int32_t id = c[m - 1].id;
    for (uint32_t i = 0; i < m; i++) {
        acc += c[i].p;
        if (r < acc) {
            id = c[i].id;
            break;
        }
    }
    free(c);
    return id;
}

static void fill_logits(kvb_rng *r, float *l, uint32_t n, int shape) {
    for (uint32_t i = 0; i < n; i++) {
        switch (shape) {
        case 0: l[i] = kvb_rng_normal(r); break;                              /* narrow: many kept */
        case 1: l[i] = 8 * kvb_rng_normal(r); break;                          /* wide: few kept */
        case 2: l[i] = (float)(kvb_rng_u64(r) % 4); break;                    /* ties everywhere */
        case 3: l[i] = kvb_rng_u64(r) % 3 ? -INFINITY : kvb_rng_normal(r); break; /* masked */
        default: l[i] = 0; break;                                             /* flat */
        }
    }
    if (shape == 3) l[n / 2] = 1; /* one finite logit at least */
}

static void test_matches_the_full_ranking(void **state) {
    (void)state;
    static const uint32_t sizes[] = {1, 2, 7, 1000, 32000, 128256};
    static const struct {
        float t, p;
        int k;
    } opts[] = {{1, 1, 0}, {0.8f, 0.95f, 0}, {1, 1, 40}, {0.7f, 0.9f, 50}, {1.3f, 0.5f, 0}, {1, 0.999999f, 0},
                {0.5f, 0.0f, 0}, {1, 1, 1}, {2, 0.99f, 5000}, {1, 0.3f, 3}, {0.01f, 0.9f, 0}};
    kvb_rng gen;
    kvb_rng_seed(&gen, 42);
    int checked = 0;
    kvb_pool *pool = NULL;
    kvb_err perr = {0};
    assert_int_equal(kvb_pool_create(3, &pool, &perr), KVB_OK);
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        const uint32_t n = sizes[si];
        float *l = malloc(n * sizeof *l);
        assert_non_null(l);
        for (int shape = 0; shape < 5; shape++) {
            fill_logits(&gen, l, n, shape);
            for (size_t oi = 0; oi < 2 * (sizeof opts / sizeof *opts); oi++) {
                const size_t k = oi / 2; /* each setting on one thread, then on the pool's three */
                const kvb_sampler_opts o = {.temperature = opts[k].t, .top_k = opts[k].k, .top_p = opts[k].p,
                                            .seed = 1000 + oi};
                kvb_sampler s;
                kvb_err err = {0};
                assert_int_equal(kvb_sampler_init(&s, &o, n, &err), KVB_OK);
                if (oi & 1) kvb_sampler_use_pool(&s, pool);
                kvb_rng ref;
                kvb_rng_seed(&ref, o.seed);
                const int draws = n > 32000 ? 1 : n > 1000 ? 5 : 20;
                for (int d = 0; d < draws; d++) {
                    const int32_t got = kvb_sample(&s, l), want = reference_sample(&o, l, n, &ref);
                    if (got != want)
                        fail_msg("n %u, shape %d, T %g top_p %g top_k %d, draw %d: sampled %d, reference %d", n, shape,
                                 (double)o.temperature, (double)o.top_p, o.top_k, d, got, want);
                    checked++;
                }
                kvb_sampler_free(&s);
            }
        }
        free(l);
    }
    kvb_pool_destroy(pool);
    assert_true(checked > 1000);
}

static void test_greedy_and_degenerate_cuts(void **state) {
    (void)state;
    const float l[6] = {0.5f, 2, -1, 2, 1.9f, -INFINITY};
    kvb_err err = {0};
    const kvb_sampler_opts opts[] = {{.temperature = 0}, {.temperature = 1, .top_k = 1}, {.temperature = 1, .top_p = 1e-6f}};
    for (size_t i = 0; i < 3; i++) {
        kvb_sampler s;
        assert_int_equal(kvb_sampler_init(&s, &opts[i], 6, &err), KVB_OK);
        for (int d = 0; d < 50; d++) assert_int_equal(kvb_sample(&s, l), 1); /* lowest id of the two maxima */
        kvb_sampler_free(&s);
    }
}

/* Greedy is the scan "keep i when logits[i] > the best so far": the first maximum, NaN never
 * winning unless it comes first, +0 and -0 tying. */
static int32_t scan_argmax(const float *l, uint32_t n) {
    int32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (l[i] > l[best]) best = (int32_t)i;
    return best;
}

static void test_greedy_is_the_first_maximum(void **state) {
    (void)state;
    static const struct {
        float l[5];
        uint32_t n;
        int32_t want;
    } cases[] = {{{NAN, 5, 6, 7, 8}, 5, 0}, {{-0.0f, 0.0f}, 2, 0}, {{-1, 0.0f, -0.0f}, 3, 1},
                 {{1, NAN, 3, 3, NAN}, 5, 2}, {{-INFINITY, NAN, -INFINITY}, 3, 0}, {{2}, 1, 0}};
    kvb_err err = {0};
    const kvb_sampler_opts o = {.temperature = 0};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        kvb_sampler s;
        assert_int_equal(kvb_sampler_init(&s, &o, cases[c].n, &err), KVB_OK);
        assert_int_equal(kvb_sample(&s, cases[c].l), cases[c].want);
        assert_int_equal(scan_argmax(cases[c].l, cases[c].n), cases[c].want);
        kvb_sampler_free(&s);
    }
    kvb_rng r; /* long vectors with many ties, signed zeros and NaNs, against the scan */
    kvb_rng_seed(&r, 3);
    float *l = malloc(5000 * sizeof *l);
    assert_non_null(l);
    for (int it = 0; it < 300; it++) {
        const uint32_t n = 1 + (uint32_t)(kvb_rng_u64(&r) % 5000);
        for (uint32_t i = 0; i < n; i++) {
            const uint64_t u = kvb_rng_u64(&r) % 16;
            l[i] = u == 0 ? NAN : u == 1 ? -0.0f : u == 2 ? 0.0f : (float)(kvb_rng_u64(&r) % 9) - 6;
        }
        kvb_sampler s;
        assert_int_equal(kvb_sampler_init(&s, &o, n, &err), KVB_OK);
        assert_int_equal(kvb_sample(&s, l), scan_argmax(l, n));
        kvb_sampler_free(&s);
    }
    free(l);
}

static void test_frequencies_follow_probabilities(void **state) {
    (void)state;
    const float l[4] = {0, logf(2), logf(3), logf(4)}; /* p = 1:2:3:4 at temperature 1 */
    kvb_sampler s;
    kvb_err err = {0};
    const kvb_sampler_opts o = {.temperature = 1, .top_p = 0.75f, .seed = 9}; /* keeps 4, 3, 2: 9/10 >= 0.75 */
    assert_int_equal(kvb_sampler_init(&s, &o, 4, &err), KVB_OK);
    int hits[4] = {0};
    const int draws = 90000;
    for (int d = 0; d < draws; d++) hits[kvb_sample(&s, l)]++;
    kvb_sampler_free(&s);
    assert_int_equal(hits[0], 0); /* cut by top-p */
    for (int i = 1; i < 4; i++) { /* (i + 1) / 9 of the draws, within 5 standard deviations */
        const double want = draws * (i + 1) / 9.0, sd = sqrt(want * (1 - (i + 1) / 9.0));
        if (fabs(hits[i] - want) > 5 * sd) fail_msg("token %d: %d draws, expected %.0f", i, hits[i], want);
    }
}

/* Repetition penalties (OpenAI's frequency_penalty, presence_penalty) over the sampler's own
 * picks: greedy on fixed logits, each pick lowers that token's logit by count * frequency +
 * presence, in place, and only the picked tokens' entries change; off, the logits are untouched. */
static void test_repetition_penalties(void **state) {
    (void)state;
    enum { N = 8 };
    const float base[N] = {0.0f, 5.0f, 4.5f, 4.25f, 1.0f, 0.5f, 3.9f, 0.0f};
    float l[N];
    kvb_err err = {0};
    kvb_sampler s;
    /* presence only (once, whatever the count): 1; 2 (1 is at 4 < 4.5); 3 (4.25); then 1 for good
     * (4 beats 2 at 3.5, 3 at 3.25 and 6 at 3.9) */
    kvb_sampler_opts o = {.temperature = 0, .presence_penalty = 1.0f};
    assert_int_equal(kvb_sampler_init(&s, &o, N, &err), KVB_OK);
    const int32_t want_presence[5] = {1, 2, 3, 1, 1};
    for (int i = 0; i < 5; i++) {
        memcpy(l, base, sizeof l);
        assert_int_equal(kvb_sample_penalized(&s, l), want_presence[i]);
        for (int j = 0; j < N; j++) /* only the tokens picked before were lowered */
            if (j != 1 && j != 2 && j != 3) assert_true(l[j] == base[j]);
    }
    assert_true(l[1] == 4.0f && l[2] == 3.5f && l[3] == 3.25f);
    kvb_sampler_free(&s);
    /* frequency (per pick): 1 (5); 1 (4.6 > 4.5); 2 (1 at 4.2); 3 (4.25 beats 1 at 4.2, 2 at 4.1) */
    o = (kvb_sampler_opts){.temperature = 0, .frequency_penalty = 0.4f};
    assert_int_equal(kvb_sampler_init(&s, &o, N, &err), KVB_OK);
    const int32_t want_frequency[4] = {1, 1, 2, 3};
    for (int i = 0; i < 4; i++) {
        memcpy(l, base, sizeof l);
        assert_int_equal(kvb_sample_penalized(&s, l), want_frequency[i]);
    }
    assert_true(l[1] == 5.0f - 0.4f * 2.0f); /* the last draw saw two picks of 1 */
    kvb_sampler_free(&s);
    /* a logit bias moves the pick, before the penalties: 2 at 4.5 + 1 beats 1 at 5; then 1 banned */
    const int32_t bias_ids[2] = {2, 1};
    const float bias_up[2] = {1.0f, 0.0f}, bias_ban[2] = {0.0f, -100.0f};
    o = (kvb_sampler_opts){.temperature = 0, .bias_ids = bias_ids, .bias_values = bias_up, .n_bias = 2};
    assert_int_equal(kvb_sampler_init(&s, &o, N, &err), KVB_OK);
    memcpy(l, base, sizeof l);
    assert_int_equal(kvb_sample_penalized(&s, l), 2);
    assert_true(l[2] == 5.5f && l[1] == 5.0f && l[3] == base[3]);
    kvb_sampler_free(&s);
    o.bias_values = bias_ban;
    assert_int_equal(kvb_sampler_init(&s, &o, N, &err), KVB_OK);
    memcpy(l, base, sizeof l);
    assert_int_equal(kvb_sample_penalized(&s, l), 2);
    kvb_sampler_free(&s);
    const int32_t outside[1] = {N};
    o = (kvb_sampler_opts){.temperature = 0, .bias_ids = outside, .bias_values = bias_up, .n_bias = 1};
    assert_int_equal(kvb_sampler_init(&s, &o, N, &err), KVB_ERR_INVALID);
    /* off: the same pick every time, the logits untouched */
    o = (kvb_sampler_opts){.temperature = 0};
    assert_int_equal(kvb_sampler_init(&s, &o, N, &err), KVB_OK);
    for (int i = 0; i < 3; i++) {
        memcpy(l, base, sizeof l);
        assert_int_equal(kvb_sample_penalized(&s, l), 1);
        assert_memory_equal(l, base, sizeof l);
    }
    kvb_sampler_free(&s);
}

/* A constraint that bars one token (ctx: its id). */
static void bar_token(void *ctx, float *logits) { logits[*(const int32_t *)ctx] = -INFINITY; }

/* log p_i the slow way: long double, max first. */
static long double reference_logprob(const float *l, uint32_t n, uint32_t i) {
    long double mx = -INFINITY, sum = 0;
    for (uint32_t j = 0; j < n; j++)
        if (l[j] == l[j] && l[j] > mx) mx = l[j];
    for (uint32_t j = 0; j < n; j++)
        if (l[j] == l[j]) sum += expl((long double)l[j] - mx);
    return (long double)l[i] - mx - logl(sum);
}

static void test_logprobs(void **state) {
    (void)state;
    kvb_rng rng;
    kvb_rng_seed(&rng, 77);
    const uint32_t sizes[4] = {1, 7, 1000, 128256};
    for (int k = 0; k < 4; k++) {
        const uint32_t n = sizes[k];
        float *l = malloc(n * sizeof *l);
        for (uint32_t i = 0; i < n; i++) l[i] = (kvb_rng_uniform(&rng) - 0.5f) * (k == 3 ? 30.0f : 8.0f);
        if (n > 5) {
            l[3] = l[5]; /* a tie: 3 ranks before 5 */
            l[4] = -INFINITY;
        }
        kvb_pick_logprobs lp;
        const int32_t pick = (int32_t)(n - 1);
        kvb_logprobs_of(l, n, pick, KVB_MAX_TOP_LOGPROBS, &lp);
        assert_int_equal(lp.n_top, n < KVB_MAX_TOP_LOGPROBS ? n : KVB_MAX_TOP_LOGPROBS);
        assert_int_equal(lp.picked.id, pick);
        /* float rounding of a value of magnitude < 64 (|l - max| < 30, log(n) < 12): 2^-18 */
        assert_true(fabsl(lp.picked.logprob - reference_logprob(l, n, (uint32_t)pick)) < 1e-5L);
        for (uint32_t j = 0; j < lp.n_top; j++) {
            const kvb_id_logprob *t = &lp.top[j];
            const long double ref = reference_logprob(l, n, (uint32_t)t->id);
            if (isinf(ref)) assert_true(t->logprob == -INFINITY);
            else assert_true(fabsl(t->logprob - ref) < 1e-5L);
            if (j) { /* logit descending, id ascending on ties */
                const kvb_id_logprob *p = &lp.top[j - 1];
                assert_true(l[p->id] > l[t->id] || (l[p->id] == l[t->id] && p->id < t->id));
            }
        }
        uint32_t better = 0; /* nobody outside the top beats the last kept */
        const kvb_id_logprob *last = &lp.top[lp.n_top - 1];
        for (uint32_t i = 0; i < n; i++) better += l[i] > l[last->id] || (l[i] == l[last->id] && (int32_t)i <= last->id);
        assert_int_equal(better, lp.n_top);
        if (n == 7) { /* every token kept: -inf last, at -inf; a tie in id order */
            assert_int_equal(lp.top[6].id, 4);
            assert_true(isinf(lp.top[6].logprob) && lp.top[6].logprob < 0);
            uint32_t at3 = 0, at5 = 0;
            for (uint32_t j = 0; j < 7; j++) {
                if (lp.top[j].id == 3) at3 = j;
                if (lp.top[j].id == 5) at5 = j;
            }
            assert_int_equal(at5, at3 + 1);
        }
        free(l);
    }
    /* NaN is never a candidate; no top asked: only the pick */
    const float nan_l[4] = {NAN, 1.0f, 2.0f, NAN};
    kvb_pick_logprobs lp;
    kvb_logprobs_of(nan_l, 4, 1, 3, &lp);
    assert_int_equal(lp.n_top, 2);
    assert_int_equal(lp.top[0].id, 2);
    assert_int_equal(lp.top[1].id, 1);
    assert_true(fabsf(lp.picked.logprob - (float)(-log1p(exp(1.0)))) < 1e-6f);
    kvb_logprobs_of(nan_l, 4, 2, 0, &lp);
    assert_int_equal(lp.n_top, 0);
    assert_int_equal(lp.picked.id, 2);

    /* through the sampler: the logits as given, though a bias and a penalty changed the pick */
    enum { N = 8 };
    const float base[N] = {0.0f, 5.0f, 4.5f, 4.25f, 1.0f, 0.5f, 3.9f, 0.0f};
    const int32_t bias_ids[1] = {2};
    const float bias_up[1] = {1.0f};
    kvb_sampler_opts o = {.temperature = 0, .bias_ids = bias_ids, .bias_values = bias_up, .n_bias = 1,
                          .presence_penalty = 2.0f, .logprobs = true, .top_logprobs = 3};
    kvb_sampler s;
    kvb_err err = {0};
    assert_int_equal(kvb_sampler_init(&s, &o, N, &err), KVB_OK);
    const int32_t want[2] = {2, 1}; /* 5.5 beats 5; then 2 at 3.5 loses to 1 */
    for (int i = 0; i < 2; i++) {
        float l[N];
        memcpy(l, base, sizeof l);
        assert_int_equal(kvb_sample_penalized(&s, l), want[i]);
        assert_int_equal(s.last.picked.id, want[i]);
        assert_true(fabsl(s.last.picked.logprob - reference_logprob(base, N, (uint32_t)want[i])) < 1e-6L);
        assert_int_equal(s.last.n_top, 3);
        assert_int_equal(s.last.top[0].id, 1); /* the model's ranking, not the biased one */
        assert_int_equal(s.last.top[1].id, 2);
        assert_int_equal(s.last.top[2].id, 3);
    }
    kvb_sampler_free(&s);
    /* a constraint (JSON mode's hook) runs after the bias and penalties: it bars the best, the pick
     * moves on; the logprobs stay the model's */
    o = (kvb_sampler_opts){.temperature = 0, .logprobs = true, .top_logprobs = 1, .constrain = bar_token,
                           .constrain_ctx = &(int32_t){1}};
    assert_int_equal(kvb_sampler_init(&s, &o, N, &err), KVB_OK);
    for (int i = 0; i < 2; i++) {
        float l[N];
        memcpy(l, base, sizeof l);
        assert_int_equal(kvb_sample_penalized(&s, l), 2);
        assert_true(isinf(l[1]) && l[2] == base[2]);
        assert_int_equal(s.last.top[0].id, 1);
        assert_true(fabsl(s.last.picked.logprob - reference_logprob(base, N, 2)) < 1e-6L);
    }
    kvb_sampler_free(&s);
    o = (kvb_sampler_opts){.temperature = 0.7f, .seed = 3, .logprobs = true, .top_logprobs = 21};
    assert_int_equal(kvb_sampler_init(&s, &o, N, &err), KVB_ERR_INVALID);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_the_full_ranking),
        cmocka_unit_test(test_greedy_and_degenerate_cuts),
        cmocka_unit_test(test_greedy_is_the_first_maximum),
        cmocka_unit_test(test_frequencies_follow_probabilities),
        cmocka_unit_test(test_repetition_penalties),
        cmocka_unit_test(test_logprobs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
