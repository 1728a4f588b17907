/* grammar/vocab_mask.c — the vocabulary's bytes in one blob (token i: blob[off[i] .. off[i+1]))
 * and the mask a JSON prefix state implies: each text token's bytes fed to a copy of the state (its
 * live part: a schema's frames up to its depth), in chunks on a pool, into a bitmap that is
 * remembered for the state (compared with memcmp) and applied to the logits. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "grammar_internal.h"

struct kvb_vocab_bytes {
    uint32_t n;
    uint32_t max_token_bytes; /* the longest text token's bytes */
    char *blob;
    uint32_t *off;  // (n + 1)
    uint8_t *kind;  // (n) kvb_vocab_kind
};

void kvb_vocab_bytes_free(kvb_vocab_bytes *v) {
    if (!v) return;
    free(v->blob);
    free(v->off);
    free(v->kind);
    free(v);
}

uint32_t kvb_vocab_bytes_n(const kvb_vocab_bytes *v) { return v->n; }

bool kvb_json_feed_token(kvb_json_state *s, const kvb_vocab_bytes *v, int32_t id) {
    if (id < 0 || (uint32_t)id >= v->n || v->kind[id] != KVB_VOCAB_TEXT) return false;
    const uint32_t len = v->off[id + 1] - v->off[id];
    return len > 0 && kvb_json_feed(s, v->blob + v->off[id], len);
}

static kvb_vocab_bytes *vocab_alloc(uint32_t n, size_t blob_bytes) {
    kvb_vocab_bytes *v = calloc(1, sizeof *v);
    if (!v) return NULL;
    v->n = n;
    v->blob = malloc(blob_bytes ? blob_bytes : 1);
    v->off = malloc(sizeof *v->off * ((size_t)n + 1));
    v->kind = malloc((size_t)n ? n : 1);
    if (!v->blob || !v->off || !v->kind) {
        kvb_vocab_bytes_free(v);
        return NULL;
    }
    return v;
}

/* The blob's end (at: its bytes) closes the offsets; the longest token follows from them. */
static void vocab_seal(kvb_vocab_bytes *v, uint32_t at) {
    v->off[v->n] = at;
    for (uint32_t i = 0; i < v->n; i++) v->max_token_bytes = KVB_MAX(v->max_token_bytes, v->off[i + 1] - v->off[i]);
}

kvb_status kvb_vocab_bytes_from_lists(const char *const *bytes, const uint32_t *lens, const uint8_t *kinds,
                                      uint32_t n, kvb_vocab_bytes **out, kvb_err *err) {
    size_t total = 0;
    for (uint32_t i = 0; i < n; i++) total += lens[i];
    if (total > UINT32_MAX) return kvb_err_set(err, KVB_ERR_RANGE, "vocabulary of %zu bytes is too large", total);
    kvb_vocab_bytes *v = vocab_alloc(n, total);
    if (!v) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the vocabulary's bytes");
    uint32_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        v->off[i] = at;
        if (lens[i]) memcpy(v->blob + at, bytes[i], lens[i]);
        at += lens[i];
        v->kind[i] = kinds[i] <= KVB_VOCAB_OTHER ? kinds[i] : KVB_VOCAB_OTHER;
    }
    vocab_seal(v, at);
    *out = v;
    return KVB_OK;
}

kvb_status kvb_vocab_bytes_create(const kvb_tokenizer *t, kvb_vocab_bytes **out, kvb_err *err) {
    const uint32_t n = kvb_tokenizer_n_vocab(t), cap = kvb_tokenizer_max_token_len(t) + 8;
    char *one = malloc(cap);
    size_t total = 0;
    for (uint32_t i = 0; one && i < n; i++) {
        const int len = kvb_token_to_bytes(t, (int32_t)i, one, cap);
        if (kvb_tokenizer_is_text(t, (int32_t)i) && len > 0) total += (size_t)len;
    }
    kvb_vocab_bytes *v = one && total <= UINT32_MAX ? vocab_alloc(n, total) : NULL;
    if (!v) {
        free(one);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the vocabulary's bytes");
    }
    uint32_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        v->off[i] = at;
        const bool text = kvb_tokenizer_is_text(t, (int32_t)i);
        v->kind[i] = text ? KVB_VOCAB_TEXT : kvb_tokenizer_is_eog(t, (int32_t)i) ? KVB_VOCAB_EOG : KVB_VOCAB_OTHER;
        const int len = text ? kvb_token_to_bytes(t, (int32_t)i, v->blob + at, cap) : 0;
        at += len > 0 ? (uint32_t)len : 0;
    }
    vocab_seal(v, at);
    free(one);
    *out = v;
    return KVB_OK;
}

#define MASK_CHUNK 16384 /* tokens per pool task, at least (a multiple of 64: tasks write whole words) */
#define MASK_MAX_CHUNKS 64

typedef struct {
    const kvb_json_state *s;
    const kvb_vocab_bytes *v;
    uint64_t *bits;                    /* (ceil(n / 64)) bit i: token i may come */
    bool complete;
    uint32_t chunk;                    /* tokens per task */
    uint32_t allowed[MASK_MAX_CHUNKS]; /* per task */
} mask_job;

/* Task t: tokens [t * chunk, (t + 1) * chunk), each one's bit. */
static void mask_chunk(void *ctx, int t, int worker) {
    (void)worker;
    mask_job *j = ctx;
    const kvb_vocab_bytes *v = j->v;
    const uint32_t i0 = (uint32_t)t * j->chunk, i1 = v->n - i0 > j->chunk ? i0 + j->chunk : v->n;
    uint32_t allowed = 0;
    const size_t frames = json_state_live_bytes(j->s) - offsetof(kvb_json_state, frame);
    kvb_json_state st;
    for (uint32_t i = i0; i < i1; i++) {
        /* the live part only (feeding reads no frame above the depth): a fixed-size head, and a
         * schema's open frames */
        memcpy(&st, j->s, offsetof(kvb_json_state, frame));
        if (frames) memcpy(st.frame, j->s->frame, frames);
        const bool ok = v->kind[i] == KVB_VOCAB_EOG ? j->complete : kvb_json_feed_token(&st, v, (int32_t)i);
        if (ok) j->bits[i / 64] |= (uint64_t)1 << (i % 64);
        else j->bits[i / 64] &= ~((uint64_t)1 << (i % 64));
        allowed += ok;
    }
    j->allowed[t] = allowed;
}

/* The tokens that may follow s as bits (ceil(n / 64) words); returns how many. */
static uint32_t mask_bits(const kvb_json_state *s, const kvb_vocab_bytes *v, uint64_t *bits, kvb_pool *pool) {
    mask_job j = {.s = s, .v = v, .bits = bits, .complete = kvb_json_complete(s), .chunk = MASK_CHUNK};
    if (v->n > (uint64_t)MASK_CHUNK * MASK_MAX_CHUNKS)
        j.chunk = ((v->n + MASK_MAX_CHUNKS - 1) / MASK_MAX_CHUNKS + 63) / 64 * 64;
    const uint32_t n_tasks = v->n ? (v->n + j.chunk - 1) / j.chunk : 0;
    kvb_pool_parallel_for(n_tasks > 1 ? pool : NULL, (int)n_tasks, mask_chunk, &j);
    uint32_t allowed = 0;
    for (uint32_t t = 0; t < n_tasks; t++) allowed += j.allowed[t];
    return allowed;
}

/* -inf for every token whose bit is clear; when none may come, the end-of-generation tokens stay. */
static void apply_bits(const kvb_vocab_bytes *v, const uint64_t *bits, uint32_t allowed, float *logits) {
    for (uint32_t i = 0; i < v->n; i++)
        if (!((bits[i / 64] >> (i % 64)) & 1) && (allowed || v->kind[i] != KVB_VOCAB_EOG)) logits[i] = -INFINITY;
}

/* ---- the masker: masks remembered by state ------------------------------------------------ */

struct kvb_json_masker {
    const kvb_vocab_bytes *v;
    kvb_pool *pool;
    uint64_t clock;
    struct {
        kvb_json_state s;
        uint64_t used;   /* clock at the last use; 0: empty */
        uint32_t allowed;
        uint64_t *bits;  /* (ceil(n / 64)) */
    } slot[KVB_JSON_MASK_CACHE];
};

kvb_status kvb_json_masker_create(const kvb_vocab_bytes *v, kvb_pool *pool, kvb_json_masker **out, kvb_err *err) {
    kvb_json_masker *m = calloc(1, sizeof *m);
    bool ok = m != NULL;
    for (int k = 0; ok && k < KVB_JSON_MASK_CACHE; k++) ok = (m->slot[k].bits = malloc(sizeof(uint64_t) * ((size_t)v->n / 64 + 1)));
    if (!ok) {
        kvb_json_masker_free(m);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the JSON mode's masks");
    }
    m->v = v;
    m->pool = pool;
    *out = m;
    return KVB_OK;
}

void kvb_json_masker_free(kvb_json_masker *m) {
    if (!m) return;
    for (int k = 0; k < KVB_JSON_MASK_CACHE; k++) free(m->slot[k].bits);
    free(m);
}

uint32_t kvb_json_masker_apply(kvb_json_masker *m, const kvb_json_state *s, float *logits) {
    kvb_json_state key; /* continues every token as s does; what the cache remembers masks by */
    json_state_mask_key(s, m->v->max_token_bytes, &key);
    int hit = -1, victim = 0;
    for (int k = 0; k < KVB_JSON_MASK_CACHE; k++) {
        if (m->slot[k].used && memcmp(&m->slot[k].s, &key, sizeof key) == 0) hit = k;
        if (m->slot[k].used < m->slot[victim].used) victim = k;
    }
    if (hit < 0) {
        hit = victim;
        m->slot[hit].s = key;
        m->slot[hit].allowed = mask_bits(&key, m->v, m->slot[hit].bits, m->pool);
    }
    m->slot[hit].used = ++m->clock;
    apply_bits(m->v, m->slot[hit].bits, m->slot[hit].allowed, logits);
    return m->slot[hit].allowed;
}
