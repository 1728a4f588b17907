/* tokenizer/tokenize.c — kvb_tokenize: adds BOS/EOS by the vocabulary's rules, splits the input
 * at special-token text (user-defined tokens always, control/unknown tokens only when
 * parse_special; at each position the longest token wins and the leftmost position first —
 * Hugging Face's added-token matching), and hands each raw fragment to the vocabulary's encoder.
 * For SentencePiece a fragment that follows a special token (or starts the text) gets the
 * leading-space prefix, as llama.cpp does. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

/* Longest special token matching at s[i..n), or -1. */
static int32_t special_at(const kvb_tokenizer *t, const uint8_t *s, size_t n, size_t i, bool parse_special) {
    uint8_t b = s[i];
    for (uint32_t k = t->special_start[b]; k < t->special_start[b + 1]; k++) {
        int32_t id = t->special[k];
        uint32_t len = t->text_len[id];
        if (len > n - i) continue;
        if (!parse_special && t->type[id] != KVB_TT_USER_DEFINED) continue;
        if (memcmp(t->text_blob + t->text_off[id], s + i, len) == 0) return id;
    }
    return -1;
}

static kvb_status encode_raw(const kvb_tokenizer *t, kvb_bpe_ctx **bpe, const uint8_t *s, size_t n, bool prev_special,
                             kvb_idvec *out, kvb_err *err) {
    if (n == 0) return KVB_OK;
    if (t->model == KVB_TOKM_SPM) return kvb_spm_encode_fragment(t, s, n, t->add_space_prefix && prev_special, out, err);
    if (!*bpe) {
        kvb_status st = kvb_bpe_ctx_create(t, bpe, err);
        if (st) return st;
    }
    return kvb_bpe_encode_fragment(*bpe, s, n, out, err);
}

kvb_status kvb_tokenize(const kvb_tokenizer *t, const char *text, size_t len, bool add_special, bool parse_special,
                        int32_t **ids, size_t *n_ids, kvb_err *err) {
    *ids = NULL;
    *n_ids = 0;
    if (!t || (!text && len))
        return kvb_err_set(err, KVB_ERR_INVALID, "kvb_tokenize: no tokenizer or no text");
    kvb_idvec out = {0};
    kvb_bpe_ctx *bpe = NULL;
    kvb_status st = KVB_OK;
    const uint8_t *s = (const uint8_t *)text;

    if (add_special && t->add_bos && t->bos >= 0 && (st = kvb_idvec_push(&out, t->bos, err))) goto fail;

    const bool *can_start = t->can_start[parse_special ? 1 : 0]; /* first bytes of special tokens */
    size_t frag = 0;
    /* every raw fragment starts the text or follows a special token: SentencePiece prefixes it */
    const bool prev_special = true;
    for (size_t i = 0; i < len;) {
        if (!can_start[s[i]]) {
            i++;
            continue;
        }
        int32_t id = special_at(t, s, len, i, parse_special);
        if (id < 0) {
            i++;
            continue;
        }
        if ((st = encode_raw(t, &bpe, s + frag, i - frag, prev_special, &out, err))) goto fail;
        if ((st = kvb_idvec_push(&out, id, err))) goto fail;
        i += t->text_len[id];
        frag = i;
    }
    if (frag < len) {
        if ((st = encode_raw(t, &bpe, s + frag, len - frag, prev_special, &out, err))) goto fail;
    }
    if (add_special && t->add_eos && t->eos >= 0 && (st = kvb_idvec_push(&out, t->eos, err))) goto fail;
    kvb_bpe_ctx_free(bpe);
    *ids = out.v;
    *n_ids = out.n;
    return KVB_OK;
fail:
    kvb_bpe_ctx_free(bpe);
    free(out.v);
    return st;
}
