/* engine/cpu/sample.c — sampling: greedy (argmax, lowest id on ties), or temperature with
 * optional top-k and top-p (nucleus), drawing from the seeded RNG so runs repeat exactly. */
#include <math.h>
#include <stdlib.h>

#include "kvb_engine_cpu.h"

kvb_status kvb_sampler_init(kvb_sampler *s, const kvb_sampler_opts *o, uint32_t n_vocab, kvb_err *err) {
    s->o = *o;
    s->n_vocab = n_vocab;
    kvb_rng_seed(&s->rng, o->seed);
    s->cand = malloc(sizeof(kvb_prob_id) * n_vocab);
    if (!s->cand) {
        kvb_sampler_free(s);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the sampler");
    }
    return KVB_OK;
}

void kvb_sampler_free(kvb_sampler *s) {
    free(s->cand);
    s->cand = NULL;
}

static int by_prob_desc(const void *a, const void *b) {
    const kvb_prob_id *x = a, *y = b;
    if (x->p > y->p) return -1;
    if (x->p < y->p) return 1;
    return x->id - y->id;
}

int32_t kvb_sample(kvb_sampler *s, const float *logits) {
    const uint32_t n = s->n_vocab;
    int32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = (int32_t)i;
    if (s->o.temperature <= 0.0f) return best;

    /* softmax at temperature; candidates sorted by probability when top-k/top-p cut them */
    const float mx = logits[best];
    kvb_prob_id *c = s->cand;
    double sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        c[i].p = expf((logits[i] - mx) / s->o.temperature);
        c[i].id = (int32_t)i;
        sum += c[i].p;
    }
    uint32_t m = n;
    if ((s->o.top_k > 0 && (uint32_t)s->o.top_k < n) || s->o.top_p < 1.0f) {
        qsort(c, n, sizeof *c, by_prob_desc);
        if (s->o.top_k > 0 && (uint32_t)s->o.top_k < m) m = (uint32_t)s->o.top_k;
        sum = 0;
        for (uint32_t i = 0; i < m; i++) sum += c[i].p;
        if (s->o.top_p < 1.0f) {
            double acc = 0;
            for (uint32_t i = 0; i < m; i++) {
                acc += c[i].p;
                if (acc >= s->o.top_p * sum) {
                    m = i + 1;
                    break;
                }
            }
            sum = acc;
        }
    }
    double r = (double)kvb_rng_uniform(&s->rng) * sum, acc = 0;
    for (uint32_t i = 0; i < m; i++) {
        acc += c[i].p;
        if (r < acc) return c[i].id;
    }
    return c[m - 1].id;
}
