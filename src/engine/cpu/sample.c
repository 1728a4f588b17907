/* engine/cpu/sample.c — sampling: greedy (argmax, lowest id on ties), or temperature with
 * optional top-k and top-p (nucleus), drawing from the seeded RNG so runs repeat exactly. With a
 * cut, only the probabilities that can be kept are ranked (kvb_engine_cpu.h says how): ranking a
 * 128K vocabulary took ~19 ms per token. OpenAI's frequency/presence penalties over the tokens
 * picked so far (kvb_sample_penalized) touch only those tokens' logits. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_engine_cpu.h"

#define P_BINS 64
#define VOCAB_CHUNK 8192 /* the probabilities of one pool task; fixed, so no result depends on threads */

static uint32_t n_chunks(uint32_t n) { return (n + VOCAB_CHUNK - 1) / VOCAB_CHUNK; }

kvb_status kvb_sampler_init(kvb_sampler *s, const kvb_sampler_opts *o, uint32_t n_vocab, kvb_err *err) {
    s->o = *o;
    s->n_vocab = n_vocab;
    s->pool = NULL;
    kvb_rng_seed(&s->rng, o->seed);
    s->cand = malloc(sizeof(kvb_prob_id) * n_vocab);
    s->bin_count = malloc(sizeof *s->bin_count * P_BINS * n_chunks(n_vocab));
    s->bin_mass = malloc(sizeof *s->bin_mass * P_BINS * n_chunks(n_vocab));
    s->picked = NULL;
    s->picked_ids = NULL;
    s->n_picked = 0;
    s->raw = NULL;
    memset(&s->last, 0, sizeof s->last);
    s->n_bias = 0;
    s->bias_ids = NULL;
    s->bias_values = NULL;
    for (uint32_t i = 0; i < o->n_bias; i++)
        if (o->bias_ids[i] < 0 || (uint32_t)o->bias_ids[i] >= n_vocab) {
            kvb_sampler_free(s);
            return kvb_err_set(err, KVB_ERR_INVALID, "logit bias for token %d: the vocabulary has %u tokens",
                               o->bias_ids[i], n_vocab);
        }
    if (o->top_logprobs > KVB_MAX_TOP_LOGPROBS) {
        kvb_sampler_free(s);
        return kvb_err_set(err, KVB_ERR_INVALID, "%u top logprobs asked for; at most %d", o->top_logprobs,
                           KVB_MAX_TOP_LOGPROBS);
    }
    if (o->n_bias) {
        s->bias_ids = malloc(sizeof *s->bias_ids * o->n_bias);
        s->bias_values = malloc(sizeof *s->bias_values * o->n_bias);
        if (s->bias_ids && s->bias_values) {
            memcpy(s->bias_ids, o->bias_ids, sizeof *s->bias_ids * o->n_bias);
            memcpy(s->bias_values, o->bias_values, sizeof *s->bias_values * o->n_bias);
            s->n_bias = o->n_bias;
        }
    }
    s->o.bias_ids = NULL; /* the copies above are the sampler's: the caller's arrays need not outlive it */
    s->o.bias_values = NULL;
    const bool penalties = o->frequency_penalty != 0.0f || o->presence_penalty != 0.0f;
    if (penalties) {
        s->picked = calloc(n_vocab, sizeof *s->picked);
        s->picked_ids = malloc(sizeof *s->picked_ids * n_vocab);
    }
    const bool keep_raw = o->logprobs && (penalties || o->n_bias || o->constrain);
    if (keep_raw) s->raw = malloc(sizeof *s->raw * n_vocab);
    if (!s->cand || !s->bin_count || !s->bin_mass || (penalties && (!s->picked || !s->picked_ids)) ||
        s->n_bias != o->n_bias || (keep_raw && !s->raw)) {
        kvb_sampler_free(s);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the sampler");
    }
    return KVB_OK;
}

void kvb_sampler_use_pool(kvb_sampler *s, kvb_pool *pool) { s->pool = pool; }

void kvb_sampler_free(kvb_sampler *s) {
    free(s->cand);
    free(s->bin_count);
    free(s->bin_mass);
    free(s->picked);
    free(s->picked_ids);
    free(s->bias_ids);
    free(s->bias_values);
    free(s->raw);
    s->raw = NULL;
    s->bias_ids = NULL;
    s->bias_values = NULL;
    s->n_bias = 0;
    s->cand = NULL;
    s->bin_count = NULL;
    s->bin_mass = NULL;
    s->picked = NULL;
    s->picked_ids = NULL;
}

void kvb_logprobs_of(const float *logits, uint32_t n, int32_t id, uint32_t n_top, kvb_pick_logprobs *out) {
    if (n_top > KVB_MAX_TOP_LOGPROBS) n_top = KVB_MAX_TOP_LOGPROBS;
    float mx = -INFINITY;
    uint32_t k = 0; /* top[0 .. k): the best so far, logit descending; a later id wins only when larger */
    float top_l[KVB_MAX_TOP_LOGPROBS];
    for (uint32_t i = 0; i < n; i++) {
        const float l = logits[i];
        if (l != l) continue; /* NaN: never a candidate */
        mx = l > mx ? l : mx;
        if (n_top == 0 || (k == n_top && !(l > top_l[k - 1]))) continue;
        uint32_t j = k < n_top ? k++ : k - 1;
        for (; j > 0 && l > top_l[j - 1]; j--) {
            top_l[j] = top_l[j - 1];
            out->top[j].id = out->top[j - 1].id;
        }
        top_l[j] = l;
        out->top[j].id = (int32_t)i;
    }
    double sum = 0;
    if (mx > -INFINITY)
        for (uint32_t i = 0; i < n; i++)
            if (logits[i] == logits[i]) sum += expf(logits[i] - mx);
    const double lse = (double)mx + log(sum); /* -inf - log(0) never: mx finite when sum > 0 */
    for (uint32_t j = 0; j < k; j++) out->top[j].logprob = sum > 0 ? (float)((double)top_l[j] - lse) : NAN;
    out->n_top = k;
    if (id >= 0 && (uint32_t)id < n) {
        out->picked.id = id;
        out->picked.logprob = sum > 0 ? (float)((double)logits[id] - lse) : NAN;
    }
}

int32_t kvb_sample_penalized(kvb_sampler *s, float *logits) {
    if (s->raw) memcpy(s->raw, logits, sizeof *s->raw * s->n_vocab); /* logprobs, and the logits will change */
    for (uint32_t i = 0; i < s->n_bias; i++) logits[s->bias_ids[i]] = logits[s->bias_ids[i]] + s->bias_values[i];
    for (uint32_t i = 0; i < s->n_picked; i++) { /* vLLM's order: frequency, then presence */
        const int32_t id = s->picked_ids[i];
        logits[id] = logits[id] - (float)s->picked[id] * s->o.frequency_penalty;
        logits[id] = logits[id] - s->o.presence_penalty;
    }
    if (s->o.constrain) s->o.constrain(s->o.constrain_ctx, logits);
    const int32_t id = kvb_sample(s, logits);
    if (s->picked && id >= 0 && (uint32_t)id < s->n_vocab && s->picked[id]++ == 0) s->picked_ids[s->n_picked++] = id;
    if (s->o.logprobs) kvb_logprobs_of(s->raw ? s->raw : logits, s->n_vocab, id, s->o.top_logprobs, &s->last);
    return id;
}

static int by_prob_desc(const void *a, const void *b) {
    const kvb_prob_id *x = a, *y = b;
    if (x->p > y->p) return -1;
    if (x->p < y->p) return 1;
    return x->id - y->id;
}

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

/* The lowest index of the largest logit, as "keep i when logits[i] > the best so far" finds it
 * (a NaN never wins; a NaN first logit wins everything), in two passes that do not wait on each
 * step: the largest value over 8 independent lanes (a maximum is the same in any order), then the
 * first index holding a value equal to it (+0 and -0 compare equal, as they tie in the scan). */
static int32_t argmax_first(const float *l, uint32_t n) {
    if (l[0] != l[0]) return 0;
    float lane[8];
    for (int j = 0; j < 8; j++) lane[j] = l[0];
    uint32_t i = 1;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lane[j] = l[i + j] > lane[j] ? l[i + j] : lane[j];
    float mx = lane[0];
    for (int j = 1; j < 8; j++) mx = lane[j] > mx ? lane[j] : mx;
    for (; i < n; i++) mx = l[i] > mx ? l[i] : mx;
    for (uint32_t k = 0; k < n; k++)
        if (l[k] == mx) return (int32_t)k;
    return 0; /* not reached: mx is one of the logits */
}

typedef struct {
    kvb_sampler *s;
    const float *logits;
    float mx;
    bool bins; /* with a cut: each chunk's histogram too */
} softmax_job;

/* Chunk t of the vocabulary: its probabilities into cand, and its histogram. */
static void softmax_chunk(void *ctx, int t, int worker) {
    (void)worker;
    const softmax_job *j = ctx;
    kvb_sampler *s = j->s;
    const uint32_t i0 = (uint32_t)t * VOCAB_CHUNK, i1 = i0 + VOCAB_CHUNK < s->n_vocab ? i0 + VOCAB_CHUNK : s->n_vocab;
    uint32_t *count = s->bin_count + (size_t)t * P_BINS;
    double *mass = s->bin_mass + (size_t)t * P_BINS;
    if (j->bins) {
        memset(count, 0, P_BINS * sizeof *count);
        memset(mass, 0, P_BINS * sizeof *mass);
    }
    for (uint32_t i = i0; i < i1; i++) {
        const float p = expf((j->logits[i] - j->mx) / s->o.temperature);
        s->cand[i].p = p;
        s->cand[i].id = (int32_t)i;
        if (j->bins) {
            const uint32_t b = prob_bin(p);
            count[b]++;
            mass[b] += p;
        }
    }
}

/* How many of the ranked c[0 .. m) it takes for their mass, summed in rank order, to reach want
 * (all m when it is not reached); *acc gets that mass. */
static uint32_t mass_prefix(const kvb_prob_id *c, uint32_t m, double want, double *acc) {
    double sum = 0;
    uint32_t i = 0;
    while (i < m) {
        sum += c[i++].p;
        if (sum >= want) break;
    }
    *acc = sum;
    return i;
}

int32_t kvb_sample(kvb_sampler *s, const float *logits) {
    const uint32_t n = s->n_vocab;
    const int32_t best = argmax_first(logits, n);
    if (s->o.temperature <= 0.0f) return best;

    /* softmax at temperature, chunk by chunk (on the pool's threads when there is one); with
     * top-k/top-p, each chunk's histogram of the probabilities by power of two */
    kvb_prob_id *c = s->cand;
    const bool top_k = s->o.top_k > 0 && (uint32_t)s->o.top_k < n, top_p = s->o.top_p < 1.0f;
    softmax_job job = {.s = s, .logits = logits, .mx = logits[best], .bins = top_k || top_p};
    kvb_pool_parallel_for(n > VOCAB_CHUNK ? s->pool : NULL, (int)n_chunks(n), softmax_chunk, &job);
    double sum = 0; /* in id order, whatever computed the terms */
    for (uint32_t i = 0; i < n; i++) sum += c[i].p;
    uint32_t count[P_BINS] = {0};
    double mass[P_BINS] = {0};
    for (uint32_t t = 0; job.bins && t < n_chunks(n); t++)
        for (uint32_t b = 0; b < P_BINS; b++) {
            count[b] += s->bin_count[(size_t)t * P_BINS + b];
            mass[b] += s->bin_mass[(size_t)t * P_BINS + b];
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
            double acc;
            uint32_t kept = mass_prefix(c, m, want, &acc);
            /* not reached in those bins: rank them all (with top-k the k's own sum is always reached) */
            if (acc < want && !top_k && ranked < n) kept = mass_prefix(c, rank_prefix(c, n, P_BINS - 1), want, &acc);
            m = kept;
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
