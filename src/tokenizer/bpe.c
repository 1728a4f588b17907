/* tokenizer/bpe.c — byte-level BPE (tokenizer.ggml.model "gpt2"): GPT-2's byte<->unicode mapping,
 * the merge table (a hash from a (left id, right id) pair to its rank and merged id, so merging
 * works on token ids instead of strings), and the encoder for one raw text fragment: clean to
 * valid UTF-8 (+NFC for Qwen2), pre-tokenize, then BPE each piece with a binary heap over a
 * linked list of symbols (lowest rank first, leftmost on ties — the order llama.cpp and Hugging
 * Face use). Pieces up to 64 bytes are cached per call, which makes prose fast: most words recur.
 * A byte without a token in a hostile vocabulary is dropped, as llama.cpp does. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_unicode.h"

/* ---- GPT-2 byte mapping ------------------------------------------------------------------------ */

static inline bool byte_is_printable(uint32_t b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

/* The 68 bytes that are not printable map, in order, to U+0100..U+0143: 0x00-0x20, 0x7F-0xA0,
 * 0xAD. */
uint32_t kvb_bytelevel_cp(uint8_t b) {
    if (byte_is_printable(b)) return b;
    if (b <= 0x20) return 256u + b;
    if (b >= 0x7F && b <= 0xA0) return 256u + 33u + (b - 0x7Fu);
    return 256u + 67u; /* 0xAD */
}

int kvb_bytelevel_byte(uint32_t cp) {
    if (cp < 256) return byte_is_printable(cp) ? (int)cp : -1;
    if (cp < 256 + 33) return (int)(cp - 256);
    if (cp < 256 + 67) return (int)(0x7F + (cp - 256 - 33));
    if (cp == 256 + 67) return 0xAD;
    return -1;
}

/* ---- merge table ------------------------------------------------------------------------------ */

static inline uint64_t mix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

static inline bool merge_find(const kvb_merge_table *m, int32_t a, int32_t b, uint32_t *rank, int32_t *out) {
    if (!m->keys) return false;
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    for (uint64_t i = mix64(key) & m->mask;; i = (i + 1) & m->mask) {
        uint64_t k = m->keys[i];
        if (k == key) {
            *rank = m->rank[i];
            *out = m->out[i];
            return true;
        }
        if (!k) return false;
    }
}

void kvb_merge_table_free(kvb_merge_table *m) {
    free(m->keys);
    free(m->rank);
    free(m->out);
    memset(m, 0, sizeof *m);
}

kvb_status kvb_merge_table_build(kvb_tokenizer *t, const kvb_gguf_kv *kv, kvb_err *err) {
    uint64_t n = kv->arr_len;
    if (n > (1u << 26)) return kvb_err_set(err, KVB_ERR_FORMAT, "tokenizer.ggml.merges has %llu entries", (unsigned long long)n);
    kvb_merge_table *m = &t->merges;
    uint64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    m->keys = calloc(cap, sizeof *m->keys);
    m->rank = malloc(cap * sizeof *m->rank);
    m->out = malloc(cap * sizeof *m->out);
    kvb_gguf_str *v = malloc((n ? n : 1) * sizeof *v);
    char *cat = malloc((size_t)kvb_tokenizer_max_token_len(t) * 2 + 2);
    if (!m->keys || !m->rank || !m->out || !v || !cat) {
        free(v);
        free(cat);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for %llu merges", (unsigned long long)n);
    }
    m->mask = cap - 1;
    kvb_status st = kvb_gguf_arr_strings(kv, v, err);
    if (st) {
        free(v);
        free(cat);
        return kvb_err_prefix(err, "tokenizer.ggml.merges: ");
    }
    uint64_t skipped = 0;
    for (uint64_t r = 0; r < n; r++) {
        const char *s = v[r].ptr;
        uint64_t len = v[r].len;
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp) {
            free(v);
            free(cat);
            return kvb_err_set(err, KVB_ERR_FORMAT, "merge %llu is not two tokens separated by a space", (unsigned long long)r);
        }
        size_t ll = (size_t)(sp - s), rl = (size_t)(len - ll - 1);
        int32_t a = kvb_tok_find_text(t, s, ll), b = kvb_tok_find_text(t, sp + 1, rl);
        int32_t o = -1;
        if (a >= 0 && b >= 0 && ll + rl <= (size_t)kvb_tokenizer_max_token_len(t)) {
            memcpy(cat, s, ll);
            memcpy(cat + ll, sp + 1, rl);
            o = kvb_tok_find_text(t, cat, ll + rl);
        }
        if (o < 0) {
            skipped++;
            continue;
        }
        uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
        for (uint64_t i = mix64(key) & m->mask;; i = (i + 1) & m->mask) {
            if (m->keys[i] == key) break; /* first (lowest) rank wins */
            if (!m->keys[i]) {
                m->keys[i] = key;
                m->rank[i] = (uint32_t)r;
                m->out[i] = o;
                break;
            }
        }
    }
    free(v);
    free(cat);
    t->n_merges = (uint32_t)(n - skipped);
    if (skipped)
        kvb_log(KVB_LOG_DEBUG, "tokenizer: %llu of %llu merges name tokens that are not in the vocabulary; ignored",
                (unsigned long long)skipped, (unsigned long long)n);
    return KVB_OK;
}

/* ---- encoder context: scratch buffers and the piece cache ------------------------------------ */

#define CACHE_MAX_KEY 64
#define CACHE_MAX_SLOTS (1u << 17)

typedef struct {
    uint64_t hash;
    uint32_t key_off, ids_off;
    uint16_t key_len, n_ids; /* key_len == 0: empty */
} cache_slot;

typedef struct {
    uint32_t rank;
    int32_t left, right, idl, idr, out;
} bigram;

struct kvb_bpe_ctx {
    const kvb_tokenizer *t;
    /* per fragment */
    const uint8_t *buf;
    kvb_idvec *out;
    kvb_err *err;
    /* word scratch */
    int32_t *id, *prev, *next;
    size_t sym_cap;
    bigram *heap;
    size_t heap_n, heap_cap;
    /* cache */
    cache_slot *slots;
    uint32_t cache_mask, cache_used;
    uint8_t *keys;
    size_t keys_n, keys_cap;
    int32_t *ids;
    size_t ids_n, ids_cap;
};

kvb_status kvb_bpe_ctx_create(const kvb_tokenizer *t, kvb_bpe_ctx **out, kvb_err *err) {
    kvb_bpe_ctx *c = calloc(1, sizeof *c);
    if (!c) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    c->t = t;
    *out = c;
    return KVB_OK;
}

void kvb_bpe_ctx_free(kvb_bpe_ctx *c) {
    if (!c) return;
    free(c->id);
    free(c->prev);
    free(c->next);
    free(c->heap);
    free(c->slots);
    free(c->keys);
    free(c->ids);
    free(c);
}

static bool grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return true;
    size_t nc = *cap ? *cap : 64;
    while (nc < need) nc *= 2;
    void *np = realloc(*p, nc * elem);
    if (!np) return false;
    *p = np;
    *cap = nc;
    return true;
}

static void cache_reset(kvb_bpe_ctx *c) {
    if (c->slots) memset(c->slots, 0, ((size_t)c->cache_mask + 1) * sizeof *c->slots);
    c->cache_used = 0;
    c->keys_n = 0;
    c->ids_n = 0;
}

static const int32_t *cache_get(kvb_bpe_ctx *c, const uint8_t *w, size_t n, uint64_t h, size_t *n_ids) {
    if (!c->slots) return NULL;
    for (uint32_t i = (uint32_t)h & c->cache_mask;; i = (i + 1) & c->cache_mask) {
        cache_slot *s = &c->slots[i];
        if (!s->key_len) return NULL;
        if (s->hash == h && s->key_len == n && memcmp(c->keys + s->key_off, w, n) == 0) {
            *n_ids = s->n_ids;
            return c->ids + s->ids_off;
        }
    }
}

/* Best effort: a cache that cannot grow just stops caching. */
static void cache_put(kvb_bpe_ctx *c, const uint8_t *w, size_t n, uint64_t h, const int32_t *ids, size_t n_ids) {
    if (!c->slots || c->cache_used + 1 > (c->cache_mask + 1) / 4 * 3) {
        uint32_t cap = c->slots ? (c->cache_mask + 1) * 2 : 1024;
        if (cap > CACHE_MAX_SLOTS) {
            cache_reset(c);
        } else {
            cache_slot *ns = calloc(cap, sizeof *ns);
            if (!ns) return;
            if (c->slots) {
                for (uint32_t i = 0; i <= c->cache_mask; i++) {
                    cache_slot *s = &c->slots[i];
                    if (!s->key_len) continue;
                    uint32_t j = (uint32_t)s->hash & (cap - 1);
                    while (ns[j].key_len) j = (j + 1) & (cap - 1);
                    ns[j] = *s;
                }
                free(c->slots);
            }
            c->slots = ns;
            c->cache_mask = cap - 1;
        }
    }
    if (!grow((void **)&c->keys, &c->keys_cap, c->keys_n + n, 1) ||
        !grow((void **)&c->ids, &c->ids_cap, c->ids_n + n_ids, sizeof *c->ids))
        return;
    uint32_t i = (uint32_t)h & c->cache_mask;
    while (c->slots[i].key_len) i = (i + 1) & c->cache_mask;
    cache_slot *s = &c->slots[i];
    s->hash = h;
    s->key_off = (uint32_t)c->keys_n;
    s->key_len = (uint16_t)n;
    s->ids_off = (uint32_t)c->ids_n;
    s->n_ids = (uint16_t)n_ids;
    memcpy(c->keys + c->keys_n, w, n);
    c->keys_n += n;
    if (n_ids) memcpy(c->ids + c->ids_n, ids, n_ids * sizeof *ids);
    c->ids_n += n_ids;
    c->cache_used++;
}

/* ---- BPE of one piece --------------------------------------------------------------------------- */

static inline bool bg_less(const bigram *a, const bigram *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static bool heap_push(kvb_bpe_ctx *c, const bigram *b) {
    if (!grow((void **)&c->heap, &c->heap_cap, c->heap_n + 1, sizeof *c->heap)) return false;
    size_t i = c->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!bg_less(b, &c->heap[p])) break;
        c->heap[i] = c->heap[p];
        i = p;
    }
    c->heap[i] = *b;
    return true;
}

static bigram heap_pop(kvb_bpe_ctx *c) {
    bigram top = c->heap[0];
    bigram last = c->heap[--c->heap_n];
    size_t i = 0, n = c->heap_n;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= n) break;
        size_t m = l + 1 < n && bg_less(&c->heap[l + 1], &c->heap[l]) ? l + 1 : l;
        if (!bg_less(&c->heap[m], &last)) break;
        c->heap[i] = c->heap[m];
        i = m;
    }
    if (n) c->heap[i] = last;
    return top;
}

static bool try_pair(kvb_bpe_ctx *c, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return true;
    int32_t a = c->id[left], b = c->id[right];
    if (a < 0 || b < 0) return true;
    bigram g;
    if (!merge_find(&c->t->merges, a, b, &g.rank, &g.out)) return true;
    g.left = left;
    g.right = right;
    g.idl = a;
    g.idr = b;
    return heap_push(c, &g);
}

#define DEAD (-2)

static kvb_status bpe_piece(kvb_bpe_ctx *c, const uint8_t *w, size_t n) {
    const kvb_tokenizer *t = c->t;
    kvb_err *err = c->err;
    if (n > INT32_MAX - 1) return kvb_err_set(err, KVB_ERR_RANGE, "a pre-tokenized piece of %zu bytes is too long", n);
    if (n > c->sym_cap) {
        size_t cap = c->sym_cap ? c->sym_cap : 64;
        while (cap < n) cap *= 2;
        int32_t *a = realloc(c->id, cap * sizeof *a);
        if (!a) goto nomem;
        c->id = a;
        a = realloc(c->prev, cap * sizeof *a);
        if (!a) goto nomem;
        c->prev = a;
        a = realloc(c->next, cap * sizeof *a);
        if (!a) goto nomem;
        c->next = a;
        c->sym_cap = cap;
    }
    for (size_t i = 0; i < n; i++) {
        c->id[i] = t->byte_tok[w[i]];
        c->prev[i] = (int32_t)i - 1;
        c->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    c->heap_n = 0;
    for (size_t i = 0; i + 1 < n; i++)
        if (!try_pair(c, (int32_t)i, (int32_t)i + 1)) goto nomem;
    while (c->heap_n) {
        bigram g = heap_pop(c);
        if (c->next[g.left] != g.right || c->id[g.left] != g.idl || c->id[g.right] != g.idr) continue;
        c->id[g.left] = g.out;
        c->id[g.right] = DEAD;
        int32_t nx = c->next[g.right];
        c->next[g.left] = nx;
        if (nx >= 0) c->prev[nx] = g.left;
        if (!try_pair(c, c->prev[g.left], g.left) || !try_pair(c, g.left, nx)) goto nomem;
    }
    for (int32_t i = 0; i >= 0; i = c->next[i]) {
        if (c->id[i] >= 0) {
            kvb_status st = kvb_idvec_push(c->out, c->id[i], err);
            if (st) return st;
        }
    }
    return KVB_OK;
nomem:
    return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory encoding a piece of %zu bytes", n);
}

static kvb_status on_piece(void *ctx, size_t a, size_t b) {
    kvb_bpe_ctx *c = ctx;
    const kvb_tokenizer *t = c->t;
    const uint8_t *w = c->buf + a;
    size_t n = b - a;
    if (n == 1) {
        int32_t id = t->byte_tok[w[0]];
        return id >= 0 ? kvb_idvec_push(c->out, id, c->err) : KVB_OK;
    }
    if (t->ignore_merges) {
        int32_t id = kvb_tok_find_raw(t, (const char *)w, n);
        if (id >= 0) return kvb_idvec_push(c->out, id, c->err);
    }
    if (n > CACHE_MAX_KEY) return bpe_piece(c, w, n);
    uint64_t h = kvb_hash64(w, n, 0);
    size_t k;
    const int32_t *hit = cache_get(c, w, n, h, &k);
    if (hit) return kvb_idvec_append(c->out, hit, k, c->err);
    size_t start = c->out->n;
    kvb_status st = bpe_piece(c, w, n);
    if (st) return st;
    cache_put(c, w, n, h, c->out->v + start, c->out->n - start);
    return KVB_OK;
}

kvb_status kvb_bpe_encode_fragment(kvb_bpe_ctx *c, const uint8_t *s, size_t n, kvb_idvec *out, kvb_err *err) {
    uint8_t *clean = NULL;
    size_t cn = 0;
    kvb_status st = kvb_u_clean(s, n, c->t->nfc, &clean, &cn, err);
    if (st) return st;
    c->buf = clean ? clean : s;
    c->out = out;
    c->err = err;
    st = kvb_pretokenize(c->t->pre, c->buf, clean ? cn : n, on_piece, c);
    free(clean);
    c->buf = NULL;
    return st;
}
