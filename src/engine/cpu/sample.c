/* engine/cpu/sample.c — sampling: greedy (argmax, lowest id on ties), or temperature with
 * optional top-k and top-p (nucleus), drawing from the seeded RNG so runs repeat exactly. With a
 * cut, only the probabilities that can be kept are ranked (kvb_engine_cpu.h says how): ranking a
 * 128K vocabulary took ~19 ms per token. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

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

#define P_BINS 64

/* A probability's power-of-two bin: 0 holds 1.0, b holds [2^-b, 2^-(b-1)), the last everything
 * below 2^-62 (and 0). Every p in a bin is larger than every p in a later one. */
static inline uint32_t prob_bin(float p) {
    uint32_t bits;
    memcpy(&bits, &p, sizeof bits);
    const uint32_t e = (bits >> 23) & 0xff; /* 127 for [1, 2) */
    const uint32_t b = e >= 127 ? 0 : 127 - e;
    return b < P_BINS - 1 ? b : P_BINS - 1;
}

/* Moves the candidates of bins 0..last to the front of c (n) and ranks them (p descending, id
 * ascending): they are the first entries of the whole ranking. Returns how many there are. */
static uint32_t rank_prefix(kvb_prob_id *c, uint32_t n, uint32_t last) {
    uint32_t kept = 0;
    for (uint32_t i = 0; i < n; i++)
        if (prob_bin(c[i].p) <= last) {
            const kvb_prob_id t = c[kept];
            c[kept++] = c[i];
            c[i] = t;
        }
    qsort(c, kept, sizeof *c, by_prob_desc);
    return kept;
}

int32_t kvb_sample(kvb_sampler *s, const float *logits) {
    const uint32_t n = s->n_vocab;
    int32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = (int32_t)i;
    if (s->o.temperature <= 0.0f) return best;

    /* softmax at temperature; with top-k/top-p, a histogram of the probabilities by power of two */
    const float mx = logits[best];
    kvb_prob_id *c = s->cand;
    const bool top_k = s->o.top_k > 0 && (uint32_t)s->o.top_k < n, top_p = s->o.top_p < 1.0f;
    uint32_t count[P_BINS] = {0};
    double mass[P_BINS] = {0}, sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        const float p = expf((logits[i] - mx) / s->o.temperature);
        c[i].p = p;
        c[i].id = (int32_t)i;
        sum += p;
        if (top_k || top_p) {
            const uint32_t b = prob_bin(p);
            count[b]++;
            mass[b] += p;
        }
    }
    uint32_t m = n;
    if (top_k || top_p) {
        /* rank only the bins that can hold a kept token: down to the k-th one, or to where the
         * mass reaches top_p of the whole (one bin further: the bins' sums round differently
         * from the ranked sum, which decides) */
        uint32_t last = P_BINS - 1, have = 0;
        double have_mass = 0;
        for (uint32_t b = 0; b < P_BINS; b++) {
            have += count[b];
            have_mass += mass[b];
            if (top_k ? have >= (uint32_t)s->o.top_k : have_mass >= s->o.top_p * sum) {
                last = top_k || b + 1 == P_BINS ? b : b + 1;
                break;
            }
        }
        uint32_t ranked = rank_prefix(c, n, last);
        if (top_k) {
            m = (uint32_t)s->o.top_k;
            sum = 0;
            for (uint32_t i = 0; i < m; i++) sum += c[i].p;
        } else {
            m = ranked;
        }
        if (top_p) {
            const double want = s->o.top_p * sum;
            double acc = 0;
            uint32_t i = 0;
            for (bool reached = false; !reached;) {
                while (i < m && !reached) {
                    acc += c[i++].p;
                    reached = acc >= want;
                }
                if (reached || top_k || ranked == n) break; /* (with top-k the k's own sum is reached) */
                m = ranked = rank_prefix(c, n, P_BINS - 1); /* not reached in those bins: rank them all */
                acc = 0;
                i = 0;
            }
            m = i;
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
