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

bool http_utf8_valid(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    size_t bad;
    while (i < n) {
        size_t l = kvb_utf8_valid_len(p + i, n - i, &bad);
        if (!l) return false;
        i += l;
    }
    return true;
}

void http_utf8_sanitize_append(http_buf *b, const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0, run = 0; /* run: start of the pending valid span */
    size_t bad;
    while (i < n) {
        size_t l = kvb_utf8_valid_len(p + i, n - i, &bad);
        if (l) { i += l; continue; }
        http_buf_append(b, s + run, i - run);
        http_buf_append(b, "\xEF\xBF\xBD", 3);
        i += bad; /* one U+FFFD per maximal subpart */
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
