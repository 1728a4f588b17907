/* json_strict.c — what cJSON lets through that a request must not: the body's strings checked at
 * the byte level before cJSON decodes them (cJSON turns "\uZZZZ" into a NUL that cuts the string
 * and the rest of a prompt with it), duplicate keys (cJSON keeps both and a lookup sees the first:
 * the second would be silently ignored), and fields no table names. Every refusal is a 400 whose
 * param names the field by its path in the body ("messages[1].content", "kvbridge.bridge"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"

#define SCAN_PATH_DEPTH 16 /* levels named in an error's param; deeper ones are shown as "..." */

typedef struct {
    bool object;
    bool want_key; /* object: the next string is a member's key */
    size_t index;  /* array: the current element's index */
    char key[48];  /* object: the current member's key, as sent (printable bytes, cut) */
    size_t key_len;
} scan_frame;

typedef struct {
    scan_frame frames[SCAN_PATH_DEPTH];
    size_t depth; /* may pass SCAN_PATH_DEPTH: the deeper levels are counted, not named */
} scan_path;

static scan_frame *scan_top(scan_path *p) {
    return p->depth && p->depth <= SCAN_PATH_DEPTH ? &p->frames[p->depth - 1] : NULL;
}

/* "messages[1].content" for the stack; "" at the top level. */
static void scan_path_format(const scan_path *p, char *out, size_t cap) {
    size_t n = 0;
    out[0] = '\0';
    const size_t shown = p->depth < SCAN_PATH_DEPTH ? p->depth : SCAN_PATH_DEPTH;
    for (size_t i = 0; i < shown && n < cap; i++) {
        const scan_frame *f = &p->frames[i];
        int w = f->object ? (f->key_len ? snprintf(out + n, cap - n, "%s%s", n ? "." : "", f->key) : 0)
                          : snprintf(out + n, cap - n, "[%zu]", f->index);
        if (w > 0) n += (size_t)w;
    }
    if (p->depth > SCAN_PATH_DEPTH && n < cap) snprintf(out + n, cap - n, "...");
}

static void scan_key_append(scan_frame *key_frame, char c) {
    if (!key_frame || key_frame->key_len + 1 >= sizeof key_frame->key) return;
    key_frame->key[key_frame->key_len++] = (c > ' ' && c < 0x7f) ? c : '?';
    key_frame->key[key_frame->key_len] = '\0';
}

static int hex4(const char *s) { /* the value of 4 hex digits, or -1 */
    int v = 0;
    for (int i = 0; i < 4; i++) {
        const char c = s[i];
        const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

static kvb_status bad_string(const scan_path *p, const char *body, size_t len, size_t at, const char *what,
                             kvb_http_error *e) {
    char param[96], shown[16];
    scan_path_format(p, param, sizeof param);
    size_t n = len - at < 12 ? len - at : 12;
    char raw[13];
    memcpy(raw, body + at, n);
    raw[n] = '\0';
    http_printable_copy(shown, sizeof shown, raw);
    if (param[0])
        http_error_set(e, 400, NULL, param, "Invalid '%s': the string has %s ('%s' at byte %zu); nothing in a "
                       "request is dropped or cut, so it is refused.", param, what, shown, at);
    else
        http_error_set(e, 400, NULL, NULL, "Invalid JSON string: %s ('%s' at byte %zu).", what, shown, at);
    return KVB_ERR_INVALID;
}

/* One string from its opening quote at *i; on return *i is at its closing quote (or len when it
 * is not closed: cJSON refuses that). key_frame: the object whose key this is, or NULL. */
static kvb_status scan_string(const char *body, size_t len, size_t *i, scan_frame *key_frame,
                              const scan_path *p, kvb_http_error *e) {
    size_t j = *i + 1;
    while (j < len && body[j] != '"') {
        if (body[j] != '\\') { scan_key_append(key_frame, body[j++]); continue; }
        if (j + 1 >= len) break;
        const char esc = body[j + 1];
        if (esc != 'u') {
            if (!strchr("\"\\/bfnrt", esc) || esc == '\0')
                return bad_string(p, body, len, j, "an escape JSON does not have", e);
            scan_key_append(key_frame, esc);
            j += 2;
            continue;
        }
        const int cp = j + 6 <= len ? hex4(body + j + 2) : -1;
        if (cp < 0) return bad_string(p, body, len, j, "a \\u escape without four hex digits", e);
        if (cp == 0) return bad_string(p, body, len, j, "a NUL character (\\u0000)", e);
        if (cp >= 0xDC00 && cp <= 0xDFFF)
            return bad_string(p, body, len, j, "a lone UTF-16 low surrogate", e);
        size_t step = 6;
        if (cp >= 0xD800 && cp <= 0xDBFF) { /* must be followed by its low half */
            const int lo = j + 12 <= len && body[j + 6] == '\\' && body[j + 7] == 'u' ? hex4(body + j + 8) : -1;
            if (lo < 0xDC00 || lo > 0xDFFF) return bad_string(p, body, len, j, "a lone UTF-16 high surrogate", e);
            step = 12;
        }
        scan_key_append(key_frame, '?');
        j += step;
    }
    *i = j;
    return KVB_OK;
}

kvb_status http_json_strings_check(const char *body, size_t len, kvb_http_error *e) {
    scan_path p = {.depth = 0};
    for (size_t i = 0; i < len; i++) {
        scan_frame *top = scan_top(&p);
        switch (body[i]) {
        case '{':
        case '[':
            if (++p.depth <= SCAN_PATH_DEPTH)
                p.frames[p.depth - 1] = (scan_frame){.object = body[i] == '{', .want_key = body[i] == '{'};
            break;
        case '}':
        case ']':
            if (p.depth) p.depth--;
            break;
        case ',':
            if (top && top->object) top->want_key = true, top->key_len = 0, top->key[0] = '\0';
            else if (top) top->index++;
            break;
        case ':':
            if (top && top->object) top->want_key = false;
            break;
        case '"': {
            scan_frame *key_frame = top && top->object && top->want_key ? top : NULL;
            if (key_frame) key_frame->key_len = 0, key_frame->key[0] = '\0';
            kvb_status s = scan_string(body, len, &i, key_frame, &p, e);
            if (s) return s;
            break;
        }
        default: break;
        }
    }
    return KVB_OK;
}

/* ---- duplicate keys --------------------------------------------------------------------------------- */

static int cmp_keys(const void *a, const void *b) {
    return strcmp((*(const cJSON *const *)a)->string, (*(const cJSON *const *)b)->string);
}

/* The second member of obj with a key seen before, or NULL (sorting the keys for a large object). */
static const cJSON *duplicate_member(const cJSON *obj, bool *oom) {
    size_t n = 0;
    for (const cJSON *c = obj->child; c; c = c->next) n++;
    if (n < 2) return NULL;
    if (n <= 32) {
        for (const cJSON *a = obj->child; a; a = a->next)
            for (const cJSON *b = a->next; b; b = b->next)
                if (strcmp(a->string, b->string) == 0) return b;
        return NULL;
    }
    const cJSON **keys = malloc(n * sizeof *keys); /* (n) members, sorted by key */
    if (!keys) { *oom = true; return NULL; }
    size_t k = 0;
    for (const cJSON *c = obj->child; c; c = c->next) keys[k++] = c;
    qsort(keys, n, sizeof *keys, cmp_keys);
    const cJSON *dup = NULL;
    for (size_t i = 1; i < n && !dup; i++)
        if (strcmp(keys[i - 1]->string, keys[i]->string) == 0) dup = keys[i];
    free(keys);
    return dup;
}

/* path: the value's name so far (cut to cap), extended in place for the children and restored. */
static kvb_status unique_keys_walk(const cJSON *v, char *path, size_t used, size_t cap, kvb_http_error *e) {
    if (!cJSON_IsObject(v) && !cJSON_IsArray(v)) return KVB_OK;
    if (cJSON_IsObject(v)) {
        bool oom = false;
        const cJSON *dup = duplicate_member(v, &oom);
        if (oom) return http_error_set(e, 500, NULL, NULL, "out of memory parsing the request"), KVB_ERR_NOMEM;
        if (dup) {
            snprintf(path + used, cap - used, "%s%.40s", used ? "." : "", dup->string);
            http_error_set(e, 400, NULL, path, "Duplicate key '%s' in the request body; send each field once.", path);
            return KVB_ERR_INVALID;
        }
    }
    size_t index = 0;
    for (const cJSON *c = v->child; c; c = c->next, index++) {
        int w = cJSON_IsObject(v) ? snprintf(path + used, cap - used, "%s%.40s", used ? "." : "", c->string)
                                  : snprintf(path + used, cap - used, "[%zu]", index);
        size_t next = w > 0 && used + (size_t)w < cap ? used + (size_t)w : used;
        kvb_status s = unique_keys_walk(c, path, next, cap, e);
        path[used] = '\0';
        if (s) return s;
    }
    return KVB_OK;
}

kvb_status http_json_unique_keys(const cJSON *root, kvb_http_error *e) {
    char path[sizeof e->param] = "";
    return unique_keys_walk(root, path, 0, sizeof path, e);
}

/* ---- unknown fields --------------------------------------------------------------------------------- */

kvb_status http_error_unknown_field(kvb_http_error *e, const char *prefix, const char *key) {
    char param[sizeof e->param];
    snprintf(param, sizeof param, "%s%s%.60s", prefix ? prefix : "", prefix && prefix[0] ? "." : "", key);
    http_error_set(e, 400, "unknown_parameter", param, "Unrecognized request argument supplied: %s", param);
    return KVB_ERR_INVALID;
}

kvb_status http_json_refuse_unknown(const cJSON *obj, const char *prefix, const char *const *known,
                                    size_t n_known, kvb_http_error *e) {
    for (const cJSON *c = obj ? obj->child : NULL; c; c = c->next) {
        bool found = false;
        for (size_t i = 0; i < n_known && !found; i++) found = strcmp(c->string, known[i]) == 0;
        if (!found) return http_error_unknown_field(e, prefix, c->string);
    }
    return KVB_OK;
}
