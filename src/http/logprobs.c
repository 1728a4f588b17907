/* logprobs.c — a reply's logprobs in OpenAI's two shapes (http_internal.h says which fields):
 * tokens recorded one by one as the handler samples them, taken as a choice's "logprobs" object
 * for a stream's chunk or the whole body. Token text is the token's bytes with invalid UTF-8 as
 * U+FFFD; chat adds the real bytes. A logprob below -9999 (or not a number) is sent as -9999.0;
 * an echoed prompt's first token has none (null), as OpenAI sends it. */
#include <math.h>
#include <stdlib.h>

#include "http_internal.h"

#define LOGPROB_FLOOR (-9999.0)

static double sendable(float lp) { return lp == lp && lp >= LOGPROB_FLOOR ? (double)lp : LOGPROB_FLOOR; }

/* The token's text (U+FFFD for invalid bytes) into b (reset); false on allocation failure. */
static bool token_text(http_buf *b, const kvb_token_logprob *t) {
    b->len = 0;
    if (b->data) b->data[0] = 0;
    http_utf8_sanitize_append(b, t->bytes ? t->bytes : "", t->bytes ? t->n_bytes : 0); /* allocates even for "" */
    return !b->oom;
}

static cJSON *chat_entry(http_buf *text, const kvb_token_logprob *t) {
    cJSON *o = cJSON_CreateObject(), *bytes = cJSON_CreateArray();
    if (!o || !bytes || !token_text(text, t) || !cJSON_AddStringToObject(o, "token", text->data) ||
        !(t->unconditioned ? cJSON_AddNullToObject(o, "logprob") : cJSON_AddNumberToObject(o, "logprob", sendable(t->logprob)))) {
        cJSON_Delete(o);
        cJSON_Delete(bytes);
        return NULL;
    }
    cJSON_AddItemToObject(o, "bytes", bytes);
    for (size_t i = 0; i < t->n_bytes; i++) {
        cJSON *b = cJSON_CreateNumber((unsigned char)t->bytes[i]);
        if (!b) { cJSON_Delete(o); return NULL; }
        cJSON_AddItemToArray(bytes, b);
    }
    return o;
}

static int64_t utf8_chars(const char *s) {
    int64_t n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static bool ensure_arrays(http_logprobs *lp) {
    if (lp->api == KVB_API_CHAT_COMPLETIONS) {
        if (!lp->content) lp->content = cJSON_CreateArray();
        return lp->content != NULL;
    }
    if (!lp->tokens) lp->tokens = cJSON_CreateArray();
    if (!lp->token_logprobs) lp->token_logprobs = cJSON_CreateArray();
    if (!lp->top_logprobs) lp->top_logprobs = cJSON_CreateArray();
    if (!lp->text_offset) lp->text_offset = cJSON_CreateArray();
    return lp->tokens && lp->token_logprobs && lp->top_logprobs && lp->text_offset;
}

static bool add_chat(http_logprobs *lp, http_buf *text, const kvb_token_logprob *token,
                     const kvb_token_logprob *top, size_t n_top) {
    cJSON *e = chat_entry(text, token), *tops = cJSON_CreateArray();
    if (!e || !tops) { cJSON_Delete(e); cJSON_Delete(tops); return false; }
    cJSON_AddItemToObject(e, "top_logprobs", tops);
    for (size_t i = 0; i < n_top; i++) {
        cJSON *t = chat_entry(text, &top[i]);
        if (!t) { cJSON_Delete(e); return false; }
        cJSON_AddItemToArray(tops, t);
    }
    cJSON_AddItemToArray(lp->content, e);
    return true;
}

/* {text: logprob} unless the text is there already (two tokens with one text: the likelier one). */
static bool add_top_key(cJSON *dict, http_buf *text, const kvb_token_logprob *t) {
    if (!token_text(text, t)) return false;
    if (cJSON_GetObjectItemCaseSensitive(dict, text->data)) return true;
    return cJSON_AddNumberToObject(dict, text->data, sendable(t->logprob)) != NULL;
}

static bool add_completions(http_logprobs *lp, http_buf *text, const kvb_token_logprob *token,
                            const kvb_token_logprob *top, size_t n_top) {
    const bool none = token->unconditioned;
    cJSON *dict = none ? cJSON_CreateNull() : cJSON_CreateObject();
    if (!dict) return false;
    bool ok = true;
    for (size_t i = 0; ok && !none && i < n_top; i++) ok = add_top_key(dict, text, &top[i]);
    ok = ok && (none || add_top_key(dict, text, token)); /* the picked token is always there: up to N+1 */
    cJSON *tok = ok && token_text(text, token) ? cJSON_CreateString(text->data) : NULL;
    cJSON *val = none ? cJSON_CreateNull() : cJSON_CreateNumber(sendable(token->logprob));
    cJSON *off = cJSON_CreateNumber((double)lp->chars);
    if (!tok || !val || !off) {
        cJSON_Delete(dict);
        cJSON_Delete(tok);
        cJSON_Delete(val);
        cJSON_Delete(off);
        return false;
    }
    lp->chars += utf8_chars(text->data);
    cJSON_AddItemToArray(lp->tokens, tok);
    cJSON_AddItemToArray(lp->token_logprobs, val);
    cJSON_AddItemToArray(lp->top_logprobs, dict);
    cJSON_AddItemToArray(lp->text_offset, off);
    return true;
}

void http_logprobs_add(http_logprobs *lp, const kvb_token_logprob *token, const kvb_token_logprob *top,
                       size_t n_top) {
    if (lp->oom) return;
    http_buf text = {0};
    bool ok = ensure_arrays(lp) && (lp->api == KVB_API_CHAT_COMPLETIONS ? add_chat(lp, &text, token, top, n_top)
                                                                        : add_completions(lp, &text, token, top, n_top));
    http_buf_free(&text);
    if (ok) lp->n++;
    else lp->oom = true;
}

static void drop_arrays(http_logprobs *lp) {
    cJSON_Delete(lp->content);
    cJSON_Delete(lp->tokens);
    cJSON_Delete(lp->token_logprobs);
    cJSON_Delete(lp->top_logprobs);
    cJSON_Delete(lp->text_offset);
    lp->content = lp->tokens = lp->token_logprobs = lp->top_logprobs = lp->text_offset = NULL;
    lp->n = 0;
}

cJSON *http_logprobs_take(http_logprobs *lp, bool even_empty) {
    if (lp->oom || (lp->n == 0 && !even_empty)) return NULL;
    cJSON *o = cJSON_CreateObject();
    if (!o || !ensure_arrays(lp)) {
        cJSON_Delete(o);
        lp->oom = true;
        return NULL;
    }
    if (lp->api == KVB_API_CHAT_COMPLETIONS) {
        cJSON_AddItemToObject(o, "content", lp->content);
        cJSON_AddNullToObject(o, "refusal");
    } else {
        cJSON_AddItemToObject(o, "tokens", lp->tokens);
        cJSON_AddItemToObject(o, "token_logprobs", lp->token_logprobs);
        cJSON_AddItemToObject(o, "top_logprobs", lp->top_logprobs);
        cJSON_AddItemToObject(o, "text_offset", lp->text_offset);
    }
    lp->content = lp->tokens = lp->token_logprobs = lp->top_logprobs = lp->text_offset = NULL;
    lp->n = 0;
    return o;
}

void http_logprobs_free(http_logprobs *lp) { drop_arrays(lp); }
