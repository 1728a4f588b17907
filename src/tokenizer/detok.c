/* tokenizer/detok.c — ids back to bytes. kvb_token_to_bytes gives the raw bytes a token stands
 * for (precomputed at load: byte mapping, ▁ and <0xXX> undone; special tokens as their text).
 * The streaming decoder emits only complete UTF-8: a character whose bytes are split across
 * tokens (byte-fallback or byte-level pieces of an emoji) is held back until it completes, and
 * bytes that can never complete come out as they are. It hides control tokens (BOS, <|im_end|>)
 * unless show_special is set, and for SentencePiece vocabularies with the space-prefix rule it
 * drops the one space the encoder added in front of the first piece of text. */
#include <string.h>

#include "tok_internal.h"
#include "tok_unicode.h"

int kvb_token_to_bytes(const kvb_tokenizer *t, int32_t id, char *buf, size_t cap) {
    if (!t || id < 0 || (uint32_t)id >= t->n_vocab) return 0;
    uint32_t n = t->raw_len[id];
    if (n > cap) return -(int)n;
    if (n) memcpy(buf, t->raw_blob + t->raw_off[id], n);
    return (int)n;
}

void kvb_detok_init(kvb_detok *d, const kvb_tokenizer *t) {
    memset(d, 0, sizeof *d);
    d->t = t;
    d->first = true;
}

/* Length of the trailing part of s[0..n) that is a proper prefix of a well-formed character
 * (could still complete), else 0. */
static size_t incomplete_tail(const uint8_t *s, size_t n) {
    for (size_t k = 1; k <= 3 && k <= n; k++) {
        uint8_t c = s[n - k];
        if ((c & 0xC0) == 0x80) continue; /* continuation: look further back */
        size_t need = c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xC2 && c <= 0xDF ? 2 : 1;
        if (need <= k) return 0;
        size_t bad;
        /* a proper prefix is "ill-formed only because it is cut short" */
        size_t l = kvb_utf8_valid_len(s + n - k, k, &bad);
        return (l == 0 && bad == k) ? k : 0;
    }
    return 0;
}

static size_t put(char *out, size_t cap, size_t w, const uint8_t *s, size_t n) {
    if (cap == 0) return w;
    size_t room = cap - 1 - w;
    if (n > room) {
        n = room;
        /* do not cut a character in half */
        size_t cut = incomplete_tail(s, n);
        n -= cut;
    }
    memcpy(out + w, s, n);
    return w + n;
}

size_t kvb_detok_push(kvb_detok *d, int32_t id, char *out, size_t cap) {
    if (cap) out[0] = 0;
    const kvb_tokenizer *t = d->t;
    if (!t || cap == 0 || id < 0 || (uint32_t)id >= t->n_vocab) return 0;
    uint8_t ty = t->type[id];
    if (ty == KVB_TT_CONTROL && !d->show_special) return 0;
    const uint8_t *s = (const uint8_t *)t->raw_blob + t->raw_off[id];
    size_t n = t->raw_len[id];
    if (n == 0) return 0;
    /* the space the encoder put in front of the text: strip it from the first piece of text
     * (control tokens such as BOS, shown or not, do not count as text) */
    if (d->first && ty != KVB_TT_CONTROL) {
        d->first = false;
        if (t->model == KVB_TOKM_SPM && t->add_space_prefix && s[0] == ' ' && d->n_pending == 0) {
            s++;
            n--;
        }
    }
    size_t w = 0;
    /* finish the held-back character first: pending is always a proper prefix of one */
    while (d->n_pending && n) {
        uint8_t tmp[8];
        size_t np = d->n_pending, k = n < 4 ? n : 4, bad;
        memcpy(tmp, d->pending, np);
        memcpy(tmp + np, s, k);
        size_t l = kvb_utf8_valid_len(tmp, np + k, &bad);
        if (!l && bad == np + k && k == n) { /* still incomplete and nothing more to add */
            memcpy(d->pending + np, s, k);
            d->n_pending = np + k;
            s += k;
            n = 0;
            break;
        }
        size_t use = l ? l : bad; /* a whole character, or the bytes that can never complete */
        if (use < np) use = np;
        w = put(out, cap, w, tmp, use);
        s += use - np;
        n -= use - np;
        d->n_pending = 0;
    }
    size_t tail = incomplete_tail(s, n);
    w = put(out, cap, w, s, n - tail);
    if (tail) {
        memcpy(d->pending + d->n_pending, s + n - tail, tail);
        d->n_pending += tail;
    }
    out[w] = 0;
    return w;
}

size_t kvb_detok_flush(kvb_detok *d, char *out, size_t cap) {
    if (cap) out[0] = 0;
    if (cap == 0) return 0;
    size_t w = put(out, cap, 0, (const uint8_t *)d->pending, d->n_pending);
    d->n_pending = 0;
    out[w] = 0;
    return w;
}
