/* tokenizer/spm.c — SentencePiece-style BPE (tokenizer.ggml.model "llama"), as llama.cpp does it:
 * optionally prefix a space, turn every ' ' into U+2581 (▁), split into characters, then keep
 * merging the adjacent pair whose concatenation is the vocabulary token with the highest score
 * (leftmost on ties) until no pair is a token; a symbol that is not a token falls back to its
 * bytes (<0xXX> tokens, else the single-byte token, else <unk>). Invalid UTF-8 bytes become
 * one-byte symbols, so any input encodes. Only normal, user-defined and unused tokens can be
 * formed by merging (never control tokens such as <s>, as SentencePiece itself behaves). When no
 * two characters never stand side by side inside a token that merging can form (a filter built at
 * load: kvb_spm_pairs_build), no merge can join them, so the text is cut there and each piece is
 * merged on its own: the same ids, with small heaps (Gemma's vocabulary leaves ~1 in 3 boundaries
 * of English prose open, where the older rule, "no token holds x▁", allowed no cut at all). */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_unicode.h"

typedef struct {
    float score;
    int32_t left, right;
    uint32_t size;
} spm_bigram;

typedef struct {
    uint32_t start, n; /* span in the escaped text; n == 0: merged away */
    int32_t prev, next;
} spm_sym;

typedef struct {
    const kvb_tokenizer *t;
    const char *text;
    spm_sym *sym;
    spm_bigram *heap;
    size_t heap_n, heap_cap;
} spm_state;

static inline bool better(const spm_bigram *a, const spm_bigram *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

/* A character as the encoder splits text: a valid UTF-8 sequence, else one byte. */
static size_t char_len(const uint8_t *s, size_t n) {
    size_t bad, l = kvb_utf8_valid_len(s, n, &bad);
    return l ? l : 1;
}

/* The filter's bit for characters a (la bytes) then b (lb bytes). */
static uint64_t pair_bit(const uint8_t *a, size_t la, const uint8_t *b, size_t lb) {
    uint64_t ka = la, kb = lb; /* (bytes, length): distinct for distinct characters */
    for (size_t i = 0; i < la; i++) ka |= (uint64_t)a[i] << (8 * i + 8);
    for (size_t i = 0; i < lb; i++) kb |= (uint64_t)b[i] << (8 * i + 8);
    uint64_t h = ka * 0x9E3779B97F4A7C15ULL ^ kb * 0xC2B2AE3D27D4EB4FULL;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ULL;
    return h >> (64 - KVB_SPM_PAIR_BITS);
}

static bool is_mergeable_type(uint8_t ty) {
    return ty == KVB_TT_NORMAL || ty == KVB_TT_USER_DEFINED || ty == KVB_TT_UNUSED;
}

kvb_status kvb_spm_pairs_build(kvb_tokenizer *t, uint32_t n, kvb_err *err) {
    t->spm_inner_pairs = calloc(KVB_SPM_PAIR_WORDS, sizeof *t->spm_inner_pairs);
    if (!t->spm_inner_pairs) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the SPM pair filter");
    for (uint32_t i = 0; i < n; i++) {
        if (!is_mergeable_type(t->type[i])) continue;
        const uint8_t *s = (const uint8_t *)t->text_blob + t->text_off[i];
        const size_t l = t->text_len[i];
        for (size_t p = 0, lp = l ? char_len(s, l) : 0; p + lp < l;) {
            const size_t q = p + lp, lq = char_len(s + q, l - q);
            const uint64_t b = pair_bit(s + p, lp, s + q, lq);
            t->spm_inner_pairs[b >> 6] |= 1ULL << (b & 63);
            p = q;
            lp = lq;
        }
    }
    return KVB_OK;
}

/* May a merge join these two adjacent characters? false: never (no such token). */
static bool pair_may_join(const kvb_tokenizer *t, const char *text, const spm_sym *a, const spm_sym *b) {
    const uint64_t bit = pair_bit((const uint8_t *)text + a->start, a->n, (const uint8_t *)text + b->start, b->n);
    return (t->spm_inner_pairs[bit >> 6] >> (bit & 63)) & 1;
}

static int32_t mergeable(const kvb_tokenizer *t, const char *s, size_t n) {
    int32_t id = kvb_tok_find_text(t, s, n);
    if (id < 0) return -1;
    return is_mergeable_type(t->type[id]) ? id : -1;
}

static bool push(spm_state *st, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return true;
    uint32_t size = st->sym[left].n + st->sym[right].n;
    if (size > st->t->max_token_len) return true;
    int32_t id = mergeable(st->t, st->text + st->sym[left].start, size);
    if (id < 0) return true;
    if (st->heap_n == st->heap_cap) {
        size_t cap = st->heap_cap ? st->heap_cap * 2 : 64;
        spm_bigram *h = realloc(st->heap, cap * sizeof *h);
        if (!h) return false;
        st->heap = h;
        st->heap_cap = cap;
    }
    spm_bigram b = {st->t->score[id], left, right, size};
    size_t i = st->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!better(&b, &st->heap[p])) break;
        st->heap[i] = st->heap[p];
        i = p;
    }
    st->heap[i] = b;
    return true;
}

static spm_bigram pop(spm_state *st) {
    spm_bigram top = st->heap[0];
    spm_bigram last = st->heap[--st->heap_n];
    size_t i = 0, n = st->heap_n;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= n) break;
        size_t m = l + 1 < n && better(&st->heap[l + 1], &st->heap[l]) ? l + 1 : l;
        if (!better(&st->heap[m], &last)) break;
        st->heap[i] = st->heap[m];
        i = m;
    }
    if (n) st->heap[i] = last;
    return top;
}

kvb_status kvb_spm_encode_fragment(const kvb_tokenizer *t, const uint8_t *s, size_t n, bool space_prefix,
                                   kvb_idvec *out, kvb_err *err) {
    /* escape: optional leading space, ' ' -> ▁ (3 bytes) */
    if (n > (SIZE_MAX - 3) / 3 || n > UINT32_MAX / 4)
        return kvb_err_set(err, KVB_ERR_RANGE, "text fragment of %zu bytes is too long", n);
    size_t cap = 3 * (n + 1);
    char *text = malloc(cap);
    spm_sym *sym = malloc((n + 1) * sizeof *sym);
    if (!text || !sym) {
        free(text);
        free(sym);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory encoding %zu bytes", n);
    }
    size_t m = 0;
    if (space_prefix) {
        memcpy(text, "\xE2\x96\x81", 3);
        m = 3;
    }
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(text + m, "\xE2\x96\x81", 3);
            m += 3;
        } else {
            text[m++] = (char)s[i];
        }
    }
    /* characters */
    int32_t ns = 0;
    for (size_t i = 0; i < m;) {
        const size_t l = char_len((const uint8_t *)text + i, m - i);
        sym[ns].start = (uint32_t)i;
        sym[ns].n = (uint32_t)l;
        sym[ns].prev = ns - 1;
        sym[ns].next = i + l < m ? ns + 1 : -1;
        ns++;
        i += l;
    }
    /* cut between characters that no merge can join: each piece is merged on its own */
    for (int32_t i = 1; i < ns; i++)
        if (!pair_may_join(t, text, &sym[i - 1], &sym[i])) {
            sym[i - 1].next = -1;
            sym[i].prev = -1;
        }
    spm_state st = {t, text, sym, NULL, 0, 0};
    kvb_status rc = KVB_OK;
    for (int32_t a = 0; a < ns;) {
        int32_t b = a + 1;
        while (b < ns && sym[b].prev >= 0) b++; /* [a, b) is one segment */
        for (int32_t i = a + 1; i < b; i++)
            if (!push(&st, i - 1, i)) goto nomem;
        while (st.heap_n) {
            spm_bigram g = pop(&st);
            spm_sym *l = &sym[g.left], *r = &sym[g.right];
            if (l->n == 0 || r->n == 0 || l->n + r->n != g.size) continue;
            l->n += r->n;
            r->n = 0;
            l->next = r->next;
            if (r->next >= 0) sym[r->next].prev = g.left;
            if (!push(&st, l->prev, g.left) || !push(&st, g.left, l->next)) goto nomem;
        }
        a = b;
    }
    /* surviving symbols, in order */
    for (int32_t i = 0; i < ns; i++) {
        if (sym[i].n == 0) continue;
        int32_t id = mergeable(t, text + sym[i].start, sym[i].n);
        if (id >= 0) {
            if ((rc = kvb_idvec_push(out, id, err))) goto done;
            continue;
        }
        for (uint32_t j = 0; j < sym[i].n; j++) {
            int32_t bid = t->byte_tok[(uint8_t)text[sym[i].start + j]];
            if (bid < 0) bid = t->unk;
            if (bid >= 0 && (rc = kvb_idvec_push(out, bid, err))) goto done;
        }
    }
    goto done;
nomem:
    rc = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory encoding %zu bytes", n);
done:
    free(st.heap);
    free(text);
    free(sym);
    return rc;
}
