/* node/decode_batch.c — the decode node's decode steps, batched across requests, and who computes
 * on the engine when. Computing on the engine (its scratch and its thread pool) is one holder at a
 * time: a request's prompt phase (kvb_decode_batch_exec_begin .. _end, inside the node's FIFO of
 * prompts) or one batch of decode steps.
 *
 * Each request that is decoding hands in its next token (kvb_decode_batch_step) and sleeps. The
 * first of them that finds no batch being led leads one: it waits (at most GATHER_WAIT_S) until
 * every decoding request has handed in its step (the others are only emitting their last token,
 * and a batch that left them out would run them next alone), waits for the engine to be free,
 * takes every step handed in by then (up to the batch's capacity), runs them as one
 * kvb_engine_forward_batch, samples each request's next token with that request's own sampler,
 * and wakes them. The weights are read once per step for all of them.
 *
 * A prompt phase runs the steps handed in so far when it begins, between two slices of the prompt
 * it computes itself, and while its pipelined tail waits for a bridged prompt's layers
 * (kvb_decode_batch_run_pending; the tail learns of a step through kvb_decode_batch_on_step), so
 * the others' streams go on while a long prompt is computed or arrives, and the prompt keeps its
 * place: a request queued behind it still finds its blocks committed. A leader whose step such a
 * phase ran returns without the engine. A bridged prompt without a pipelined tail computes nothing
 * during its transfer: it lends the engine to the batches meanwhile (kvb_decode_batch_exec_lend
 * .. _reclaim).
 *
 * A batch that fails before any sequence advanced (a full store, say) is run again one sequence
 * at a time, so only the request at fault gets the error. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "node_internal.h"

/* A slow emitter (a streaming client more than the server's buffer behind) holds back a batch
 * by at most this: the steps handed in by then go on without it. */
#define GATHER_WAIT_S 0.002

struct kvb_decode_batch {
    kvb_engine *e;
    uint32_t cap, n_vocab;
    pthread_mutex_t mu;
    pthread_cond_t cv;            /* a step handed in or done, a request left, the engine freed */
    bool busy;                    /* someone computes on the engine (a prompt phase or a batch) */
    bool lent;                    /* a prompt phase lent it to the batches (kvb_decode_batch_exec_lend) */
    uint32_t prompts_waiting;     /* prompt phases waiting for the engine: they go before a batch */
    kvb_decode_step *head, *tail; /* handed in, not yet taken: FIFO through ->link */
    uint32_t n_pending;           /* of them */
    uint32_t n_active;            /* requests decoding (kvb_decode_batch_join .. _leave) */
    bool leading;                 /* a request leads the next batch */
    void (*on_step)(void *);      /* called as a step is handed in, or NULL (kvb_decode_batch_on_step) */
    void *on_step_ctx;
    /* the engine holder's: (cap) each, seqs and seg_n (cap + 1): a prompt slice first */
    kvb_decode_step **taken;
    kvb_seq **seqs;
    uint32_t *seg_n;
    int32_t *tokens;
    uint32_t *len_before;
    float *logits;       /* (cap + 1, n_vocab) */
    int32_t *mix_tokens; /* (mix_cap) a prompt slice's tokens, then the steps' */
    uint32_t mix_cap;
    kvb_metric *m_batches, *m_steps, *m_in_prompts; /* counters, or NULL */
};

kvb_status kvb_decode_batch_create(kvb_engine *e, uint32_t cap, uint32_t n_vocab, kvb_metric *m_batches,
                                   kvb_metric *m_steps, kvb_metric *m_in_prompts, kvb_decode_batch **out,
                                   kvb_err *err) {
    *out = NULL;
    kvb_decode_batch *b = calloc(1, sizeof *b);
    if (b) {
        b->taken = calloc(cap, sizeof *b->taken);
        b->seqs = calloc(cap + 1, sizeof *b->seqs);
        b->seg_n = calloc(cap + 1, sizeof *b->seg_n);
        b->tokens = calloc(cap, sizeof *b->tokens);
        b->len_before = calloc(cap, sizeof *b->len_before);
        b->logits = malloc(sizeof(float) * n_vocab * (cap + 1));
    }
    if (!b || !b->taken || !b->seqs || !b->seg_n || !b->tokens || !b->len_before || !b->logits) {
        kvb_decode_batch_free(b);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for a decode batch of %u", cap);
    }
    b->e = e;
    b->cap = cap;
    b->n_vocab = n_vocab;
    b->m_batches = m_batches;
    b->m_steps = m_steps;
    b->m_in_prompts = m_in_prompts;
    pthread_mutex_init(&b->mu, NULL);
    if (kvb_cond_init_monotonic(&b->cv)) {
        pthread_mutex_destroy(&b->mu);
        b->e = NULL; /* not initialised: free only the memory */
        kvb_decode_batch_free(b);
        return kvb_err_set(err, KVB_ERR_INTERNAL, "could not create the decode batch's condition variable");
    }
    *out = b;
    return KVB_OK;
}

void kvb_decode_batch_free(kvb_decode_batch *b) {
    if (!b) return;
    if (b->e) { /* initialised */
        pthread_mutex_destroy(&b->mu);
        pthread_cond_destroy(&b->cv);
    }
    free(b->taken);
    free(b->seqs);
    free(b->seg_n);
    free(b->mix_tokens);
    free(b->tokens);
    free(b->len_before);
    free(b->logits);
    free(b);
}

/* The leader's work, holding the engine: the forward, then each step's sample. */
static void run_batch(kvb_decode_batch *b, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        b->seqs[i] = b->taken[i]->s;
        b->tokens[i] = b->taken[i]->token;
        b->len_before[i] = kvb_seq_len(b->seqs[i]);
    }
    kvb_err err = {0};
    if (kvb_engine_forward_batch(b->e, b->seqs, b->tokens, n, b->logits, &err)) {
        for (uint32_t i = 0; i < n; i++) { /* one at a time: only the step at fault fails */
            kvb_decode_step *s = b->taken[i];
            if (kvb_seq_len(s->s) != b->len_before[i]) /* it advanced, then the batch failed */
                s->st = kvb_err_set(&s->err, err.code ? err.code : KVB_ERR_INTERNAL, "%s", err.msg);
            else
                s->st = kvb_engine_forward(b->e, s->s, &s->token, 1, b->logits + (size_t)i * b->n_vocab, false,
                                           &s->err);
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        kvb_decode_step *s = b->taken[i];
        if (!s->st) s->next = kvb_sample_penalized(s->smp, b->logits + (size_t)i * b->n_vocab);
    }
}

void kvb_decode_batch_join(kvb_decode_batch *b) {
    pthread_mutex_lock(&b->mu);
    b->n_active++;
    pthread_mutex_unlock(&b->mu);
}

bool kvb_decode_batch_decoding(kvb_decode_batch *b) {
    pthread_mutex_lock(&b->mu);
    const bool any = b->n_active > 0;
    pthread_mutex_unlock(&b->mu);
    return any;
}

void kvb_decode_batch_leave(kvb_decode_batch *b) {
    pthread_mutex_lock(&b->mu);
    b->n_active--;
    pthread_cond_broadcast(&b->cv); /* a leader may be waiting for its step */
    pthread_mutex_unlock(&b->mu);
}

/* Holding mu: until every decoding request has handed in a step (or `want` have), for at most
 * GATHER_WAIT_S. */
static void gather(kvb_decode_batch *b, uint32_t want) {
    const double until = kvb_now_s() + GATHER_WAIT_S;
    while (b->n_pending < b->n_active && b->n_pending < want)
        if (kvb_cond_wait_until(&b->cv, &b->mu, until) == ETIMEDOUT) break;
}

/* How take_steps waits for the decoding requests' steps before taking (gather). */
typedef enum { GATHER_NEVER, GATHER_IF_ANY, GATHER_ALWAYS } gather_mode;

/* Computing on the engine (busy, by the caller; not holding mu): takes the steps handed in so far,
 * up to max; returns how many, in taken[0 ..). *lent: whether a prompt phase had lent the engine. */
static uint32_t take_steps(kvb_decode_batch *b, uint32_t max, gather_mode g, bool *lent) {
    pthread_mutex_lock(&b->mu);
    if (g == GATHER_ALWAYS || (g == GATHER_IF_ANY && b->n_pending)) gather(b, max);
    if (lent) *lent = b->lent;
    uint32_t n = 0;
    while (b->head && n < max) {
        b->taken[n++] = b->head;
        b->head = b->head->link;
    }
    if (!b->head) b->tail = NULL;
    b->n_pending -= n;
    pthread_mutex_unlock(&b->mu);
    return n;
}

/* The n steps taken are done: counted (in_prompt: as run within a prompt phase), their requests
 * woken. */
static void steps_done(kvb_decode_batch *b, uint32_t n, bool in_prompt) {
    kvb_metric_add(b->m_batches, NULL, 1);
    kvb_metric_add(b->m_steps, NULL, n);
    if (in_prompt) kvb_metric_add(b->m_in_prompts, NULL, n);
    pthread_mutex_lock(&b->mu);
    for (uint32_t i = 0; i < n; i++) b->taken[i]->done = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

/* Takes the steps handed in so far (see take_steps), runs them as one batch and wakes their
 * requests; returns how many. */
static uint32_t take_and_run(kvb_decode_batch *b, gather_mode g, bool in_prompt) {
    bool lent = false;
    const uint32_t n = take_steps(b, b->cap, g, &lent);
    if (!n) return 0;
    run_batch(b, n);
    steps_done(b, n, in_prompt || lent);
    return n;
}

kvb_status kvb_decode_batch_step(kvb_decode_batch *b, kvb_decode_step *step) {
    step->st = KVB_OK;
    step->done = false;
    step->link = NULL;
    pthread_mutex_lock(&b->mu);
    if (b->tail) b->tail->link = step;
    else b->head = step;
    b->tail = step;
    b->n_pending++;
    pthread_cond_broadcast(&b->cv); /* a leader may be gathering */
    if (b->on_step) b->on_step(b->on_step_ctx); /* a prompt phase computing meanwhile may run it */
    while (!step->done) {
        if (b->leading) {
            pthread_cond_wait(&b->cv, &b->mu);
            continue;
        }
        b->leading = true;
        gather(b, b->cap);
        /* a waiting prompt goes first (and runs this step as it begins): the leader, already
         * awake, would otherwise win the engine every time */
        while ((b->busy || b->prompts_waiting) && !step->done) pthread_cond_wait(&b->cv, &b->mu);
        if (!step->done) {
            b->busy = true; /* steps handed in while it waited join this batch */
            pthread_mutex_unlock(&b->mu);
            take_and_run(b, GATHER_NEVER, false); /* gathered above */
            pthread_mutex_lock(&b->mu);
            b->busy = false;
        }
        b->leading = false;
        pthread_cond_broadcast(&b->cv);
    }
    pthread_mutex_unlock(&b->mu);
    return step->st;
}

void kvb_decode_batch_exec_begin(kvb_decode_batch *b) {
    pthread_mutex_lock(&b->mu);
    b->prompts_waiting++;
    while (b->busy) pthread_cond_wait(&b->cv, &b->mu);
    b->prompts_waiting--;
    b->busy = true;
    pthread_mutex_unlock(&b->mu);
    take_and_run(b, GATHER_NEVER, false); /* the steps waiting now go first: prompts never starve them */
}

void kvb_decode_batch_exec_end(kvb_decode_batch *b) {
    pthread_mutex_lock(&b->mu);
    b->busy = false;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

void kvb_decode_batch_exec_lend(kvb_decode_batch *b) {
    pthread_mutex_lock(&b->mu);
    b->lent = true;
    pthread_mutex_unlock(&b->mu);
    kvb_decode_batch_exec_end(b);
}

void kvb_decode_batch_exec_reclaim(kvb_decode_batch *b) {
    pthread_mutex_lock(&b->mu);
    b->lent = false;
    pthread_mutex_unlock(&b->mu);
    kvb_decode_batch_exec_begin(b);
}

kvb_status kvb_decode_batch_forward_slice(kvb_decode_batch *b, kvb_seq *s, const int32_t *toks, uint32_t n,
                                          float *logits, kvb_err *err) {
    const uint32_t max_batch = kvb_engine_max_batch(b->e);
    const uint32_t room = n < max_batch ? KVB_MIN(b->cap, max_batch - n) : 0;
    if (room && n + room > b->mix_cap) {
        int32_t *p = realloc(b->mix_tokens, sizeof(int32_t) * (n + room));
        if (p) {
            b->mix_tokens = p;
            b->mix_cap = n + room;
        }
    }
    /* the requests this phase's last slice woke are handing in their next steps right now: a slice
     * that went without them would leave them for the one after */
    const uint32_t k = room && n + room <= b->mix_cap ? take_steps(b, room, GATHER_ALWAYS, NULL) : 0;
    if (!k) return kvb_engine_forward(b->e, s, toks, n, logits, false, err);
    const uint32_t len0 = kvb_seq_len(s);
    b->seqs[0] = s;
    b->seg_n[0] = n;
    memcpy(b->mix_tokens, toks, sizeof(int32_t) * n);
    for (uint32_t i = 0; i < k; i++) {
        b->seqs[1 + i] = b->taken[i]->s;
        b->seg_n[1 + i] = 1;
        b->mix_tokens[n + i] = b->taken[i]->token;
        b->len_before[i] = kvb_seq_len(b->taken[i]->s);
        b->taken[i]->st = KVB_OK;
    }
    kvb_status st = kvb_engine_forward_segments(b->e, b->seqs, b->seg_n, 1 + k, b->mix_tokens, b->logits, err);
    if (!st) {
        if (logits) memcpy(logits, b->logits, sizeof(float) * b->n_vocab);
        for (uint32_t i = 0; i < k; i++)
            b->taken[i]->next =
                kvb_sample_penalized(b->taken[i]->smp, b->logits + (size_t)(1 + i) * b->n_vocab);
    } else {
        bool advanced = kvb_seq_len(s) != len0;
        for (uint32_t i = 0; i < k; i++) advanced |= kvb_seq_len(b->taken[i]->s) != b->len_before[i];
        if (!advanced) { /* apart, so that only the one at fault fails */
            memset(err, 0, sizeof *err);
            st = kvb_engine_forward(b->e, s, toks, n, logits, false, err);
            run_batch(b, k);
        } else {
            for (uint32_t i = 0; i < k; i++)
                b->taken[i]->st =
                    kvb_err_set(&b->taken[i]->err, err->code ? err->code : KVB_ERR_INTERNAL, "%s", err->msg);
        }
    }
    steps_done(b, k, true);
    return st;
}

uint32_t kvb_decode_batch_run_pending(kvb_decode_batch *b) {
    return take_and_run(b, GATHER_IF_ANY, true); /* the others' steps are moments away: one batch */
}

void kvb_decode_batch_on_step(kvb_decode_batch *b, void (*fn)(void *ctx), void *ctx) {
    pthread_mutex_lock(&b->mu);
    b->on_step = fn;
    b->on_step_ctx = ctx;
    pthread_mutex_unlock(&b->mu);
}
