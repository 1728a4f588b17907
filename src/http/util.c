/* util.c — the byte buffer, UTF-8 validation/sanitizing and the OpenAI error helpers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"

/* ---- byte buffer ---------------------------------------------------------------------------- */

static bool buf_reserve(http_buf *b, size_t extra) {
    if (b->oom) return false;
    if (extra > SIZE_MAX - b->len - 1) { b->oom = true; return false; }
    size_t need = b->len + extra + 1;
    if (need <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need) cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    char *p = realloc(b->data, cap);
    if (!p) { b->oom = true; return false; }
    b->data = p;
    b->cap = cap;
    return true;
}

void http_buf_append(http_buf *b, const void *bytes, size_t n) {
    if (!buf_reserve(b, n)) return;
    if (n) memcpy(b->data + b->len, bytes, n);
    b->len += n;
    b->data[b->len] = '\0';
}

void http_buf_append_str(http_buf *b, const char *s) { http_buf_append(b, s, strlen(s)); }

void http_buf_appendf(http_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n >= 0 && buf_reserve(b, (size_t)n)) {
        vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap2);
        b->len += (size_t)n;
    } else if (n < 0) {
        b->oom = true;
    }
    va_end(ap2);
}

void http_buf_consume(http_buf *b, size_t n) {
    if (n >= b->len) {
        b->len = 0;
        if (b->data) b->data[0] = '\0';
        return;
    }
    memmove(b->data, b->data + n, b->len - n);
    b->len -= n;
    b->data[b->len] = '\0';
}

void http_buf_free(http_buf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

/* ---- UTF-8 ----------------------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s[0..n) (1..4), or 0 if invalid (overlongs, surrogates
 * and code points above U+10FFFF are invalid). */
static size_t utf8_seq_len(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1Fu; }
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0Fu; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07u; }
    else return 0;
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3Fu);
    }
    if (len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) return 0;
    if (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) return 0;
    return len;
}

/* At an invalid sequence: how many bytes one U+FFFD stands for, Unicode's "maximal subpart" (the
 * longest prefix that could still begin a valid sequence, at least 1), as Python's
 * decode(errors='replace') and WHATWG's decoder count them. */
static size_t utf8_maximal_subpart(const unsigned char *s, size_t n) {
    const unsigned char c = s[0];
    size_t len;
    unsigned char lo = 0x80, hi = 0xBF; /* the second byte's range, which the lead narrows */
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else
        return 1;
    size_t i = 1;
    for (; i < len && i < n; i++) {
        const unsigned char b = s[i];
        if (i == 1 ? (b < lo || b > hi) : (b & 0xC0) != 0x80) break;
    }
    return i;
}

bool http_utf8_valid(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        size_t l = utf8_seq_len(p + i, n - i);
        if (!l) return false;
        i += l;
    }
    return true;
}

void http_utf8_sanitize_append(http_buf *b, const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, run = 0; /* run: start of the pending valid span */
    while (i < n) {
        size_t l = utf8_seq_len(p + i, n - i);
        if (l) { i += l; continue; }
        http_buf_append(b, s + run, i - run);
        http_buf_append(b, "\xEF\xBF\xBD", 3);
        i += utf8_maximal_subpart(p + i, n - i);
        run = i;
    }
    http_buf_append(b, s + run, n - run);
}

/* ---- errors ------------------------------------------------------------------------------ */

static void copy_trunc(char *dst, size_t cap, const char *src) {
    if (!src) { dst[0] = '\0'; return; }
    size_t n = strlen(src);
    if (n >= cap) n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

void kvb_http_error_set(kvb_http_error *e, int status, const char *code, const char *param, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    http_error_vset(e, status, code, param, fmt, ap);
    va_end(ap);
}

void http_error_vset(kvb_http_error *e, int status, const char *code, const char *param,
                     const char *fmt, va_list ap) {
    if (!e) return;
    e->status = status;
    copy_trunc(e->type, sizeof e->type, status >= 500 ? "server_error" : "invalid_request_error");
    copy_trunc(e->code, sizeof e->code, code);
    copy_trunc(e->param, sizeof e->param, param);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
}

static cJSON *string_or_null(const char *s) {
    return (s && s[0]) ? cJSON_CreateString(s) : cJSON_CreateNull();
}

static cJSON *error_object(const kvb_http_error *e) {
    cJSON *root = cJSON_CreateObject();
    cJSON *inner = cJSON_CreateObject();
    if (!root || !inner) { cJSON_Delete(root); cJSON_Delete(inner); return NULL; }
    cJSON_AddItemToObject(root, "error", inner);
    http_buf msg = {0};
    http_utf8_sanitize_append(&msg, e->message, strlen(e->message)); /* params may echo bytes */
    cJSON_AddItemToObject(inner, "message", cJSON_CreateString(msg.data ? msg.data : ""));
    http_buf_free(&msg);
    cJSON_AddItemToObject(inner, "type", cJSON_CreateString(e->type[0] ? e->type : "server_error"));
    cJSON_AddItemToObject(inner, "param", string_or_null(e->param));
    cJSON_AddItemToObject(inner, "code", string_or_null(e->code));
    return root;
}

char *http_error_json(const kvb_http_error *e) {
    cJSON *root = error_object(e);
    if (!root) return NULL;
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

void http_sse_error(http_buf *b, const kvb_http_error *e) {
    char *s = http_error_json(e);
    if (!s) { b->oom = true; return; }
    http_buf_appendf(b, "data: %s\n\n", s);
    cJSON_free(s);
}

void http_printable_copy(char *dst, size_t cap, const char *src) {
    size_t n = 0;
    if (src) {
        for (; src[n] && n < cap - 1; n++) {
            unsigned char c = (unsigned char)src[n];
            dst[n] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
        }
    }
    dst[n] = '\0';
}
