/* tokenizer/vocab.c — builds a kvb_tokenizer from a GGUF's tokenizer.ggml.* keys, treating every
 * value as hostile: the model name, the token array (count, lengths), token types, scores and
 * merges are checked for type and length, special ids for range, and nothing is trusted to be
 * NUL-terminated or aligned. It derives what the encoders need: a text->id hash, each token's raw
 * bytes (GPT-2 byte mapping, SentencePiece ▁ and <0xXX> undone), the byte->token table, the
 * special/user-defined token matcher, BOS/EOS/EOG ids and the add-BOS / space-prefix rules. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_unicode.h"

#define MAX_VOCAB (1u << 24)
#define MAX_TOKEN_BYTES (1u << 16)

/* ---- hash ------------------------------------------------------------------------------------ */

int32_t kvb_tok_hash_find(const kvb_tok_hash *h, const char *blob, const uint32_t *off,
                          const uint32_t *len, const char *s, size_t n) {
    if (!h->slots || n == 0) return -1;
    uint64_t hv = kvb_hash64(s, n, 0);
    for (uint32_t i = (uint32_t)hv & h->mask;; i = (i + 1) & h->mask) {
        uint32_t v = h->slots[i];
        if (!v) return -1;
        uint32_t id = v - 1;
        if (len[id] == n && memcmp(blob + off[id], s, n) == 0) return (int32_t)id;
    }
}

/* Inserts every id for which keep(type) holds; a later duplicate text replaces the earlier id
 * (llama.cpp's rule). */
static kvb_status hash_build(kvb_tok_hash *h, uint32_t n_vocab, const char *blob, const uint32_t *off,
                             const uint32_t *len, const uint8_t *type, uint32_t type_mask, kvb_err *err) {
    uint32_t cap = 16;
    while (cap < 2 * n_vocab) cap <<= 1;
    h->slots = calloc(cap, sizeof *h->slots);
    if (!h->slots) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the token hash");
    h->mask = cap - 1;
    for (uint32_t id = 0; id < n_vocab; id++) {
        if (!len[id] || !(type_mask & (1u << type[id]))) continue;
        uint64_t hv = kvb_hash64(blob + off[id], len[id], 0);
        for (uint32_t i = (uint32_t)hv & h->mask;; i = (i + 1) & h->mask) {
            uint32_t v = h->slots[i];
            if (!v) {
                h->slots[i] = id + 1;
                break;
            }
            uint32_t o = v - 1;
            if (len[o] == len[id] && memcmp(blob + off[o], blob + off[id], len[id]) == 0) {
                h->slots[i] = id + 1;
                break;
            }
        }
    }
    return KVB_OK;
}

/* ---- id vectors -------------------------------------------------------------------------------- */

kvb_status kvb_idvec_append(kvb_idvec *v, const int32_t *ids, size_t n, kvb_err *err) {
    if (v->n + n > v->cap) {
        size_t cap = v->cap ? v->cap : 64;
        while (cap < v->n + n) {
            if (cap > SIZE_MAX / 8) return kvb_err_set(err, KVB_ERR_RANGE, "token output too large");
            cap *= 2;
        }
        int32_t *nv = realloc(v->v, cap * sizeof *nv);
        if (!nv) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for %zu token ids", cap);
        v->v = nv;
        v->cap = cap;
    }
    if (n) memcpy(v->v + v->n, ids, n * sizeof *ids);
    v->n += n;
    return KVB_OK;
}

kvb_status kvb_idvec_push(kvb_idvec *v, int32_t id, kvb_err *err) {
    if (v->n < v->cap) {
        v->v[v->n++] = id;
        return KVB_OK;
    }
    return kvb_idvec_append(v, &id, 1, err);
}

/* ---- loading ------------------------------------------------------------------------------------ */

void kvb_tokenizer_free(kvb_tokenizer *t) {
    if (!t) return;
    free(t->text_blob);
    free(t->text_off);
    free(t->text_len);
    free(t->raw_blob);
    free(t->raw_off);
    free(t->raw_len);
    free(t->type);
    free(t->score);
    free(t->spm_inner_pairs);
    free(t->by_text.slots);
    free(t->by_raw.slots);
    kvb_merge_table_free(&t->merges);
    free(t->special);
    free(t->eog);
    free(t);
}

static bool arr_int_at(const kvb_gguf_kv *kv, uint64_t i, int64_t *out) {
    const uint8_t *p = kv->arr_data + i * kvb_gguf_vtype_size(kv->arr_type);
    switch (kv->arr_type) {
    case KVB_GGUF_I8: { int8_t v; memcpy(&v, p, 1); *out = v; return true; }
    case KVB_GGUF_U8: { uint8_t v; memcpy(&v, p, 1); *out = v; return true; }
    case KVB_GGUF_I16: { int16_t v; memcpy(&v, p, 2); *out = v; return true; }
    case KVB_GGUF_U16: { uint16_t v; memcpy(&v, p, 2); *out = v; return true; }
    case KVB_GGUF_I32: { int32_t v; memcpy(&v, p, 4); *out = v; return true; }
    case KVB_GGUF_U32: { uint32_t v; memcpy(&v, p, 4); *out = v; return true; }
    case KVB_GGUF_I64: { int64_t v; memcpy(&v, p, 8); *out = v; return true; }
    case KVB_GGUF_U64: { uint64_t v; memcpy(&v, p, 8); *out = v > INT64_MAX ? -1 : (int64_t)v; return true; }
    default: return false;
    }
}

static bool is_int_type(kvb_gguf_vtype t) {
    return t == KVB_GGUF_I8 || t == KVB_GGUF_U8 || t == KVB_GGUF_I16 || t == KVB_GGUF_U16 ||
           t == KVB_GGUF_I32 || t == KVB_GGUF_U32 || t == KVB_GGUF_I64 || t == KVB_GGUF_U64;
}

/* Optional token id key: absent leaves *id unchanged; -1 / 0xFFFFFFFF (what some converters
 * write for "none") clears it; anything else must be a token id in range. */
static kvb_status get_id(const kvb_gguf *g, const char *key, uint32_t n_vocab, int32_t *id, kvb_err *err) {
    const kvb_gguf_kv *kv = kvb_gguf_find(g, key);
    if (!kv) return KVB_OK;
    if ((kv->type == KVB_GGUF_I32 || kv->type == KVB_GGUF_I64) && kv->v.i64 == -1) {
        *id = -1;
        return KVB_OK;
    }
    if (kv->type == KVB_GGUF_U32 && kv->v.u64 == UINT32_MAX) {
        *id = -1;
        return KVB_OK;
    }
    uint32_t v;
    kvb_status st = kvb_gguf_get_u32(g, key, &v, err);
    if (st) return st;
    if (v >= n_vocab)
        return kvb_err_set(err, KVB_ERR_FORMAT, "%s is %" PRIu32 ", outside the vocabulary of %" PRIu32 " tokens",
                           key, v, n_vocab);
    *id = (int32_t)v;
    return KVB_OK;
}

static kvb_status get_flag(const kvb_gguf *g, const char *key, bool *out, kvb_err *err) {
    if (!kvb_gguf_find(g, key)) return KVB_OK;
    return kvb_gguf_get_bool(g, key, out, err);
}

/* "<0xAB>" -> 0xAB, or -1 */
static int parse_byte_token(const char *s, uint32_t n) {
    if (n != 6 || s[0] != '<' || s[1] != '0' || s[2] != 'x' || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Raw bytes of token id into dst (capacity >= text length; the raw form is never longer). */
static uint32_t raw_of(const kvb_tokenizer *t, uint32_t id, char *dst) {
    const char *s = t->text_blob + t->text_off[id];
    uint32_t n = t->text_len[id];
    uint8_t ty = t->type[id];
    if (ty == KVB_TT_BYTE) {
        int b = parse_byte_token(s, n);
        if (b >= 0) {
            dst[0] = (char)b;
            return 1;
        }
    }
    if (ty == KVB_TT_CONTROL || ty == KVB_TT_USER_DEFINED || ty == KVB_TT_UNKNOWN || ty == KVB_TT_BYTE) {
        memcpy(dst, s, n);
        return n;
    }
    if (t->model == KVB_TOKM_SPM) {
        uint32_t w = 0;
        for (uint32_t i = 0; i < n;) {
            if (i + 3 <= n && (uint8_t)s[i] == 0xE2 && (uint8_t)s[i + 1] == 0x96 && (uint8_t)s[i + 2] == 0x81) {
                dst[w++] = ' ';
                i += 3;
            } else {
                dst[w++] = s[i++];
            }
        }
        return w;
    }
    /* byte-level: every character must be a mapped byte; otherwise keep the text as it is */
    uint32_t w = 0;
    for (uint32_t i = 0; i < n;) {
        size_t bad, l = kvb_utf8_valid_len((const uint8_t *)s + i, n - i, &bad);
        int b = -1;
        if (l) {
            size_t dl;
            b = kvb_bytelevel_byte(kvb_u_decode((const uint8_t *)s + i, n - i, &dl));
        }
        if (b < 0) {
            memcpy(dst, s, n);
            return n;
        }
        dst[w++] = (char)b;
        i += (uint32_t)l;
    }
    return w;
}

typedef struct {
    uint8_t first;
    uint32_t len;
    int32_t id;
} special_ent;

static int special_cmp(const void *a, const void *b) {
    const special_ent *x = a, *y = b;
    if (x->first != y->first) return x->first < y->first ? -1 : 1;
    if (x->len != y->len) return x->len > y->len ? -1 : 1; /* longest first */
    return x->id < y->id ? -1 : x->id > y->id;
}

static kvb_status build_special(kvb_tokenizer *t, kvb_err *err) {
    uint32_t n = 0;
    for (uint32_t id = 0; id < t->n_vocab; id++) {
        uint8_t ty = t->type[id];
        if ((ty == KVB_TT_CONTROL || ty == KVB_TT_USER_DEFINED || ty == KVB_TT_UNKNOWN) && t->text_len[id]) n++;
    }
    special_ent *e = calloc(n ? n : 1, sizeof *e);
    t->special = calloc(n ? n : 1, sizeof *t->special);
    if (!e || !t->special) {
        free(e);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for special tokens");
    }
    uint32_t k = 0;
    for (uint32_t id = 0; id < t->n_vocab; id++) {
        uint8_t ty = t->type[id];
        if ((ty == KVB_TT_CONTROL || ty == KVB_TT_USER_DEFINED || ty == KVB_TT_UNKNOWN) && t->text_len[id]) {
            e[k].first = (uint8_t)t->text_blob[t->text_off[id]];
            e[k].len = t->text_len[id];
            e[k].id = (int32_t)id;
            k++;
        }
    }
    qsort(e, n, sizeof *e, special_cmp);
    uint32_t j = 0;
    for (uint32_t b = 0; b < 256; b++) {
        t->special_start[b] = j;
        while (j < n && e[j].first == b) {
            t->special[j] = e[j].id;
            j++;
        }
    }
    t->special_start[256] = n;
    t->n_special = n;
    for (uint32_t b = 0; b < 256; b++)
        for (uint32_t k = t->special_start[b]; k < t->special_start[b + 1]; k++) {
            t->can_start[1][b] = true;
            if (t->type[t->special[k]] == KVB_TT_USER_DEFINED) t->can_start[0][b] = true;
        }
    free(e);
    return KVB_OK;
}

static bool text_is(const kvb_tokenizer *t, uint32_t id, const char *s) {
    size_t n = strlen(s);
    return t->text_len[id] == n && memcmp(t->text_blob + t->text_off[id], s, n) == 0;
}

static kvb_status add_eog(kvb_tokenizer *t, int32_t id, kvb_err *err) {
    if (id < 0) return KVB_OK;
    for (uint32_t i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return KVB_OK;
    int32_t *n = realloc(t->eog, (t->n_eog + 1) * sizeof *n);
    if (!n) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    t->eog = n;
    t->eog[t->n_eog++] = id;
    return KVB_OK;
}

static kvb_status build_eog(kvb_tokenizer *t, kvb_err *err) {
    static const char *const eog_texts[] = {
        "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>", "<|EOT|>", "<｜end▁of▁sentence｜>", "_<EOT>", "<|return|>",
    };
    kvb_status st;
    if ((st = add_eog(t, t->eos, err)) || (st = add_eog(t, t->eot, err)) || (st = add_eog(t, t->eom, err)))
        return st;
    for (uint32_t k = 0; k < t->n_special; k++) {
        int32_t id = t->special[k];
        if (t->type[id] != KVB_TT_CONTROL && t->type[id] != KVB_TT_USER_DEFINED) continue;
        for (size_t j = 0; j < KVB_ARRAY_LEN(eog_texts); j++)
            if (text_is(t, (uint32_t)id, eog_texts[j]) && (st = add_eog(t, id, err))) return st;
    }
    return KVB_OK;
}

/* tokenizer.ggml.model: which algorithm the vocabulary is for. */
static kvb_status load_model_kind(const kvb_gguf *g, kvb_tokenizer *t, kvb_err *err) {
    const kvb_gguf_kv *kv = kvb_gguf_find(g, "tokenizer.ggml.model");
    if (!kv)
        return kvb_err_set(err, KVB_ERR_NOT_FOUND,
                           "no tokenizer.ggml.model key: this GGUF carries no vocabulary "
                           "(generate one with `kvbridge gen-model --vocab`)");
    if (kv->type != KVB_GGUF_STRING) return kvb_err_set(err, KVB_ERR_FORMAT, "tokenizer.ggml.model is not a string");
    if (kvb_gguf_str_eq(kv->str, "llama")) {
        t->model = KVB_TOKM_SPM;
    } else if (kvb_gguf_str_eq(kv->str, "gpt2")) {
        t->model = KVB_TOKM_BPE;
    } else {
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "tokenizer.ggml.model '%.*s' is not supported (supported: 'llama' = "
                           "SentencePiece BPE, 'gpt2' = byte-level BPE)",
                           (int)KVB_MIN(kv->str.len, 64), kv->str.ptr);
    }
    return KVB_OK;
}

/* tokenizer.ggml.tokens: the token texts, copied into t->text_blob (every table of the vocabulary
 * is allocated here, sized by the count); *max_text = the longest text in bytes. */
static kvb_status load_tokens(const kvb_gguf *g, kvb_tokenizer *t, uint32_t *max_text, kvb_err *err) {
    kvb_status st;
    const kvb_gguf_kv *kv = kvb_gguf_find(g, "tokenizer.ggml.tokens");
    if (!kv) return kvb_err_set(err, KVB_ERR_NOT_FOUND, "tokenizer.ggml.tokens is missing");
    if (kv->type != KVB_GGUF_ARRAY || kv->arr_type != KVB_GGUF_STRING)
        return kvb_err_set(err, KVB_ERR_FORMAT, "tokenizer.ggml.tokens is not an array of strings");
    if (kv->arr_len == 0 || kv->arr_len > MAX_VOCAB)
        return kvb_err_set(err, KVB_ERR_FORMAT, "tokenizer.ggml.tokens has %" PRIu64 " entries (expected 1 to %u)",
                           kv->arr_len, MAX_VOCAB);
    const uint32_t n = (uint32_t)kv->arr_len;
    t->n_vocab = n;
    kvb_gguf_str *views = malloc((size_t)n * sizeof *views);
    if (!views) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for %" PRIu32 " tokens", n);
    if ((st = kvb_gguf_arr_strings(kv, views, err))) {
        free(views);
        return kvb_err_prefix(err, "tokenizer.ggml.tokens: ");
    }
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (views[i].len > MAX_TOKEN_BYTES) {
            uint64_t len = views[i].len;
            free(views);
            return kvb_err_set(err, KVB_ERR_FORMAT, "token %" PRIu32 " is %" PRIu64 " bytes long (limit %u)", i, len,
                               MAX_TOKEN_BYTES);
        }
        total += views[i].len;
    }
    if (total > UINT32_MAX - 1) {
        free(views);
        return kvb_err_set(err, KVB_ERR_FORMAT, "token texts total %" PRIu64 " bytes", total);
    }
    t->text_blob = malloc(total + 1);
    t->raw_blob = malloc(total + 1);
    t->text_off = malloc((size_t)n * sizeof(uint32_t));
    t->text_len = malloc((size_t)n * sizeof(uint32_t));
    t->raw_off = malloc((size_t)n * sizeof(uint32_t));
    t->raw_len = malloc((size_t)n * sizeof(uint32_t));
    t->type = malloc(n);
    if (!t->text_blob || !t->raw_blob || !t->text_off || !t->text_len || !t->raw_off || !t->raw_len || !t->type) {
        free(views);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the vocabulary");
    }
    uint32_t off = 0;
    *max_text = 0;
    for (uint32_t i = 0; i < n; i++) {
        t->text_off[i] = off;
        t->text_len[i] = (uint32_t)views[i].len;
        if (views[i].len) memcpy(t->text_blob + off, views[i].ptr, views[i].len);
        off += (uint32_t)views[i].len;
        if (views[i].len > *max_text) *max_text = (uint32_t)views[i].len;
    }
    free(views);
    return KVB_OK;
}

/* tokenizer.ggml.token_type, optional: every token NORMAL without it. n = t->n_vocab. */
static kvb_status load_types(const kvb_gguf *g, kvb_tokenizer *t, uint32_t n, kvb_err *err) {
    memset(t->type, KVB_TT_NORMAL, n);
    const kvb_gguf_kv *kv = kvb_gguf_find(g, "tokenizer.ggml.token_type");
    if (kv) {
        if (kv->type != KVB_GGUF_ARRAY || !is_int_type(kv->arr_type))
            return kvb_err_set(err, KVB_ERR_FORMAT, "tokenizer.ggml.token_type is not an array of integers");
        if (kv->arr_len != n)
            return kvb_err_set(err, KVB_ERR_FORMAT,
                               "tokenizer.ggml.token_type has %" PRIu64 " entries for %" PRIu32 " tokens", kv->arr_len, n);
        for (uint32_t i = 0; i < n; i++) {
            int64_t v = 0;
            arr_int_at(kv, i, &v);
            if (v < 0 || v > KVB_TT_BYTE)
                return kvb_err_set(err, KVB_ERR_FORMAT, "token %" PRIu32 " has type %" PRId64 " (expected 0..6)", i, v);
            t->type[i] = (uint8_t)(v == KVB_TT_UNDEFINED ? KVB_TT_NORMAL : v);
        }
    }
    return KVB_OK;
}

/* tokenizer.ggml.scores of an SPM vocabulary, optional (all 0 without it); NaN reads as -inf.
 * n = t->n_vocab. */
static kvb_status load_scores(const kvb_gguf *g, kvb_tokenizer *t, uint32_t n, kvb_err *err) {
    if (t->model != KVB_TOKM_SPM) return KVB_OK;
    t->score = calloc(n, sizeof *t->score);
    if (!t->score) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    const kvb_gguf_kv *kv = kvb_gguf_find(g, "tokenizer.ggml.scores");
    if (kv) {
        if (kv->type != KVB_GGUF_ARRAY || (kv->arr_type != KVB_GGUF_F32 && kv->arr_type != KVB_GGUF_F64))
            return kvb_err_set(err, KVB_ERR_FORMAT, "tokenizer.ggml.scores is not an array of floats");
        if (kv->arr_len != n)
            return kvb_err_set(err, KVB_ERR_FORMAT,
                               "tokenizer.ggml.scores has %" PRIu64 " entries for %" PRIu32 " tokens", kv->arr_len, n);
        for (uint32_t i = 0; i < n; i++) {
            float f;
            if (kv->arr_type == KVB_GGUF_F32) {
                memcpy(&f, kv->arr_data + 4 * (size_t)i, 4);
            } else {
                double d;
                memcpy(&d, kv->arr_data + 8 * (size_t)i, 8);
                f = (float)d;
            }
            t->score[i] = isnan(f) ? -INFINITY : f;
        }
    }
    return KVB_OK;
}

/* The tokens' raw bytes, the lookups by text and by raw bytes, each byte's token and the special
 * tokens. max_text: the longest token text in bytes; n = t->n_vocab. */
static kvb_status build_lookups(kvb_tokenizer *t, uint32_t n, uint32_t max_text, kvb_err *err) {
    kvb_status st;
    uint32_t roff = 0;
    t->max_token_len = 0;
    for (uint32_t i = 0; i < n; i++) {
        t->raw_off[i] = roff;
        t->raw_len[i] = raw_of(t, i, t->raw_blob + roff);
        roff += t->raw_len[i];
        if (t->raw_len[i] > t->max_token_len) t->max_token_len = t->raw_len[i];
    }
    if (max_text > t->max_token_len) t->max_token_len = max_text;

    /* lookups */
    uint32_t all = (1u << KVB_TT_NORMAL) | (1u << KVB_TT_UNKNOWN) | (1u << KVB_TT_CONTROL) |
                   (1u << KVB_TT_USER_DEFINED) | (1u << KVB_TT_UNUSED) | (1u << KVB_TT_BYTE);
    if ((st = hash_build(&t->by_text, n, t->text_blob, t->text_off, t->text_len, t->type, all, err))) return st;
    for (int b = 0; b < 256; b++) t->byte_tok[b] = -1;
    if (t->model == KVB_TOKM_BPE) {
        uint32_t normal = (1u << KVB_TT_NORMAL) | (1u << KVB_TT_UNUSED);
        if ((st = hash_build(&t->by_raw, n, t->raw_blob, t->raw_off, t->raw_len, t->type, normal, err))) return st;
        for (int b = 0; b < 256; b++) {
            uint8_t u[4];
            size_t l = kvb_u_encode(kvb_bytelevel_cp((uint8_t)b), u);
            t->byte_tok[b] = kvb_tok_find_text(t, (const char *)u, l);
        }
    } else {
        for (int b = 0; b < 256; b++) {
            char buf[8];
            static const char hex[] = "0123456789ABCDEF";
            buf[0] = '<', buf[1] = '0', buf[2] = 'x', buf[3] = hex[b >> 4], buf[4] = hex[b & 15], buf[5] = '>';
            int32_t id = kvb_tok_find_text(t, buf, 6);
            if (id < 0) {
                char c = (char)b;
                id = kvb_tok_find_text(t, &c, 1);
            }
            t->byte_tok[b] = id;
        }
    }
    return build_special(t, err);
}

/* The special token ids and the add-BOS/EOS/space flags (llama.cpp's defaults, then the file's
 * keys), then the end-of-generation set. n = t->n_vocab. */
static kvb_status load_special_ids(const kvb_gguf *g, kvb_tokenizer *t, uint32_t n, kvb_err *err) {
    kvb_status st;
    t->bos = t->eos = t->unk = t->eot = t->eom = -1;
    t->add_bos = false;
    t->add_eos = false;
    t->add_space_prefix = false;
    if (t->model == KVB_TOKM_SPM) {
        /* llama.cpp's defaults for a "llama" vocabulary */
        if (n > 2) t->unk = 0, t->bos = 1, t->eos = 2;
        t->add_bos = true;
        t->add_space_prefix = true;
    }
    if ((st = get_id(g, "tokenizer.ggml.bos_token_id", n, &t->bos, err)) ||
        (st = get_id(g, "tokenizer.ggml.eos_token_id", n, &t->eos, err)) ||
        (st = get_id(g, "tokenizer.ggml.unknown_token_id", n, &t->unk, err)) ||
        (st = get_id(g, "tokenizer.ggml.eot_token_id", n, &t->eot, err)) ||
        (st = get_id(g, "tokenizer.ggml.eom_token_id", n, &t->eom, err)) ||
        (st = get_flag(g, "tokenizer.ggml.add_bos_token", &t->add_bos, err)) ||
        (st = get_flag(g, "tokenizer.ggml.add_eos_token", &t->add_eos, err)) ||
        (st = get_flag(g, "tokenizer.ggml.add_space_prefix", &t->add_space_prefix, err)))
        return st;
    if (t->bos < 0) t->add_bos = false;
    if (t->eos < 0) t->add_eos = false;
    return build_eog(t, err);
}

/* The pre-tokenizer and the merges of a BPE vocabulary; an SPM one's pairs. n = t->n_vocab. */
static kvb_status load_merges(const kvb_gguf *g, kvb_tokenizer *t, uint32_t n, kvb_err *err) {
    kvb_status st;
    const kvb_gguf_kv *kv;
    if (t->model == KVB_TOKM_BPE) {
        kv = kvb_gguf_find(g, "tokenizer.ggml.pre");
        if (kv) {
            if (kv->type != KVB_GGUF_STRING)
                return kvb_err_set(err, KVB_ERR_FORMAT, "tokenizer.ggml.pre is not a string");
            if (kv->str.len >= sizeof t->pre_name || memchr(kv->str.ptr, 0, kv->str.len))
                return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "tokenizer.ggml.pre '%.*s' is not supported (supported: %s)",
                                   (int)KVB_MIN(kv->str.len, 32), kv->str.ptr, kvb_pre_supported_list());
            memcpy(t->pre_name, kv->str.ptr, kv->str.len);
            t->pre_name[kv->str.len] = 0;
        } else {
            kvb_log(KVB_LOG_WARN, "tokenizer.ggml.pre is missing: using the GPT-2 pre-tokenizer");
            strcpy(t->pre_name, "default");
        }
        bool known = false;
        t->pre = kvb_pre_from_name(t->pre_name, &known);
        if (!known)
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "tokenizer.ggml.pre '%s' is not supported (supported: %s)",
                               t->pre_name, kvb_pre_supported_list());
        t->ignore_merges = t->pre == KVB_PRE_LLAMA3;
        t->nfc = t->pre == KVB_PRE_QWEN2;
        kv = kvb_gguf_find(g, "tokenizer.ggml.merges");
        if (!kv) return kvb_err_set(err, KVB_ERR_NOT_FOUND, "tokenizer.ggml.merges is missing (needed by a 'gpt2' vocabulary)");
        if (kv->type != KVB_GGUF_ARRAY || kv->arr_type != KVB_GGUF_STRING)
            return kvb_err_set(err, KVB_ERR_FORMAT, "tokenizer.ggml.merges is not an array of strings");
        if ((st = kvb_merge_table_build(t, kv, err))) return st;
    } else {
        t->pre = KVB_PRE_NONE;
        strcpy(t->pre_name, "spm");
        if ((st = kvb_spm_pairs_build(t, n, err))) return st;
    }
    return KVB_OK;
}

static kvb_status load(const kvb_gguf *g, kvb_tokenizer *t, kvb_err *err) {
    kvb_status st;
    uint32_t max_text = 0;
    if ((st = load_model_kind(g, t, err)) || (st = load_tokens(g, t, &max_text, err))) return st;
    const uint32_t n = t->n_vocab;
    if ((st = load_types(g, t, n, err)) || (st = load_scores(g, t, n, err)) ||
        (st = build_lookups(t, n, max_text, err)) || (st = load_special_ids(g, t, n, err)))
        return st;
    return load_merges(g, t, n, err);
}

kvb_status kvb_tokenizer_load(const kvb_gguf *g, kvb_tokenizer **out, kvb_err *err) {
    *out = NULL;
    kvb_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    kvb_status st = load(g, t, err);
    if (st) {
        kvb_tokenizer_free(t);
        const char *p = kvb_gguf_path(g);
        return kvb_err_prefix(err, "loading the vocabulary of %s: ", p ? p : "(memory)");
    }
    *out = t;
    return KVB_OK;
}

kvb_status kvb_tokenizer_set_pre(kvb_tokenizer *t, const char *name, kvb_err *err) {
    if (t->model != KVB_TOKM_BPE)
        return kvb_err_set(err, KVB_ERR_INVALID, "only a byte-level ('gpt2') vocabulary has a pre-tokenizer");
    bool known = false;
    kvb_pre_type p = kvb_pre_from_name(name, &known);
    if (!known || strlen(name) >= sizeof t->pre_name)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "pre-tokenizer '%s' is not supported (supported: %s)", name,
                           kvb_pre_supported_list());
    t->pre = p;
    strcpy(t->pre_name, name);
    t->ignore_merges = p == KVB_PRE_LLAMA3;
    t->nfc = p == KVB_PRE_QWEN2;
    return KVB_OK;
}

uint32_t kvb_tokenizer_n_vocab(const kvb_tokenizer *t) { return t->n_vocab; }
int32_t kvb_tokenizer_bos(const kvb_tokenizer *t) { return t->bos; }
int32_t kvb_tokenizer_eos(const kvb_tokenizer *t) { return t->eos; }
bool kvb_tokenizer_add_bos(const kvb_tokenizer *t) { return t->add_bos; }
bool kvb_tokenizer_is_eog(const kvb_tokenizer *t, int32_t id) {
    for (uint32_t i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return true;
    return false;
}
const int32_t *kvb_tokenizer_eog_ids(const kvb_tokenizer *t, size_t *n) {
    *n = t->n_eog;
    return t->eog;
}
bool kvb_tokenizer_is_text(const kvb_tokenizer *t, int32_t id) {
    if (id < 0 || (uint32_t)id >= t->n_vocab) return false;
    const uint8_t k = t->type[id];
    return k == KVB_TT_NORMAL || k == KVB_TT_BYTE || k == KVB_TT_USER_DEFINED || k == KVB_TT_UNDEFINED;
}
uint32_t kvb_tokenizer_max_token_len(const kvb_tokenizer *t) { return t->max_token_len; }
const char *kvb_tokenizer_pre_name(const kvb_tokenizer *t) { return t->pre_name; }
bool kvb_tokenizer_is_spm(const kvb_tokenizer *t) { return t->model == KVB_TOKM_SPM; }
int32_t kvb_tokenizer_find(const kvb_tokenizer *t, const char *text, size_t len) {
    return kvb_tok_find_text(t, text, len);
}
