/* head.c — a request head (request line and headers) checked against HTTP/1.1's rules before
 * anything else reads it, and the chunk sizes of a chunked body's start: the guard (guard.c) answers
 * what breaks them with a 4xx at once, and hands only whole, well-formed heads to libmicrohttpd.
 * Strict where HTTP/1.1 allows a server to be: a token method, a target of visible ASCII, HTTP/1.0
 * or HTTP/1.1, token header names with the colon right after, no control bytes in values, no
 * folded lines, one Host (required in 1.1), Content-Length digits only (two must agree), only
 * "chunked" as Transfer-Encoding and never with Content-Length. Pure functions of the bytes. */
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "http_internal.h"

/* ---- the request head ----------------------------------------------------------------------------- */

static bool is_tchar(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

#define HEAD_BAD(e, status, ...) (http_error_set((e), (status), NULL, NULL, __VA_ARGS__), -1)

/* The request line line[0 .. n) (without its line end): METHOD SP TARGET SP HTTP/1.x. complete:
 * the line ended (else only the part sent so far is judged). -1 with e filled when it is wrong. */
static int check_request_line(const char *line, size_t n, bool complete, http_head *h, kvb_http_error *e) {
    size_t i = 0;
    while (i < n && is_tchar((unsigned char)line[i])) i++;
    if (i == n && !complete) return i > 32 ? HEAD_BAD(e, 400, "Malformed request line: the method is too long.") : 0;
    if (i == 0 || i > 32 || line[i] != ' ')
        return HEAD_BAD(e, 400, "Malformed request line: expected 'METHOD /path HTTP/1.1'; this server speaks "
                        "HTTP/1.1 (plain text, no TLS on this port).");
    const size_t target = ++i;
    while (i < n && (unsigned char)line[i] > ' ' && line[i] != 0x7f) i++;
    if (i - target > HTTP_TARGET_MAX) return HEAD_BAD(e, 414, "The request target is over %d bytes.", HTTP_TARGET_MAX);
    if (i == n && !complete) return 0;
    h->method_len = target - 1;
    h->target_off = target;
    h->target_len = i - target;
    if (i == target || i == n || line[i] != ' ')
        return HEAD_BAD(e, 400, "Malformed request line: the target has a space or a control byte, or no "
                        "HTTP version follows it.");
    const char *version = line + i + 1;
    const size_t vn = n - i - 1;
    if (!complete) /* what came of the version so far must start like one */
        return vn <= 8 && memcmp(version, "HTTP/", vn < 5 ? vn : 5) == 0
                   ? 0
                   : HEAD_BAD(e, 400, "Malformed request line: expected HTTP/1.1 after the target.");
    if (vn == 8 && (memcmp(version, "HTTP/1.1", 8) == 0 || memcmp(version, "HTTP/1.0", 8) == 0)) {
        h->http10 = version[7] == '0';
        return 1;
    }
    if (vn == 8 && memcmp(version, "HTTP/", 5) == 0 && version[5] >= '0' && version[5] <= '9' && version[6] == '.' &&
        version[7] >= '0' && version[7] <= '9')
        return HEAD_BAD(e, 400, "HTTP version %.8s is not supported here; use HTTP/1.1.", version);
    return HEAD_BAD(e, 400, "Malformed request line: expected HTTP/1.1 after the target.");
}


/* v[0 .. vn) as an error message quotes it: printable ASCII (else '?'), at most 40 bytes. */
static void quote_value(const char *v, size_t vn, char out[41]) {
    char raw[41];
    memcpy(raw, v, vn < 40 ? vn : 40);
    raw[vn < 40 ? vn : 40] = '\0';
    http_printable_copy(out, 41, raw);
}

/* One header line (without its line end) into h; -1 with e filled when it breaks the rules. */
static int check_header(const char *line, size_t n, http_head *h, kvb_http_error *e) {
    if (line[0] == ' ' || line[0] == '\t')
        return HEAD_BAD(e, 400, "Malformed header: a line folded onto the one before (obsolete, refused).");
    size_t i = 0;
    while (i < n && is_tchar((unsigned char)line[i])) i++;
    if (i == 0 || i == n || line[i] != ':')
        return HEAD_BAD(e, 400, "Malformed header line: expected 'Name: value' with a token name and no space "
                        "before the colon.");
    const size_t name_len = i++;
    while (i < n && (line[i] == ' ' || line[i] == '\t')) i++;
    size_t end = n;
    while (end > i && (line[end - 1] == ' ' || line[end - 1] == '\t')) end--;
    for (size_t k = i; k < end; k++)
        if (((unsigned char)line[k] < ' ' && line[k] != '\t') || line[k] == 0x7f)
            return HEAD_BAD(e, 400, "Malformed header '%.*s': its value has a control byte.", (int)name_len, line);
    const char *v = line + i;
    const size_t vn = end - i;
    if (name_len == 4 && strncasecmp(line, "Host", 4) == 0) {
        if (h->has_host) return HEAD_BAD(e, 400, "More than one Host header.");
        h->has_host = true;
    } else if (name_len == 14 && strncasecmp(line, "Content-Length", 14) == 0) {
        long long cl = 0;
        char shown[41];
        quote_value(v, vn, shown);
        for (size_t k = 0; k < vn; k++) {
            if (v[k] < '0' || v[k] > '9') return HEAD_BAD(e, 400, "Invalid Content-Length: '%s'.", shown);
            if (cl > (LLONG_MAX - 9) / 10) return HEAD_BAD(e, 413, "Content-Length %s is over any body limit.", shown);
            cl = cl * 10 + (v[k] - '0');
        }
        if (vn == 0) return HEAD_BAD(e, 400, "Empty Content-Length.");
        if (h->content_length >= 0 && h->content_length != cl)
            return HEAD_BAD(e, 400, "Two different Content-Length headers.");
        h->content_length = cl;
    } else if (name_len == 17 && strncasecmp(line, "Transfer-Encoding", 17) == 0) {
        char shown[41];
        quote_value(v, vn, shown);
        if (h->chunked || vn != 7 || strncasecmp(v, "chunked", 7) != 0)
            return HEAD_BAD(e, 400, "Unsupported Transfer-Encoding '%s'; only 'chunked' (once) is.", shown);
        h->chunked = true;
    }
    return 0;
}

int http_chunks_check(const char *buf, size_t n, size_t max_body, kvb_http_error *e) {
    size_t pos = 0, total = 0;
    int seen = 0;
    while (pos < n) {
        const char *nl = memchr(buf + pos, '\n', n - pos);
        size_t digits = 0, size = 0;
        while (pos + digits < n && digits <= 16 && strchr("0123456789abcdefABCDEF", buf[pos + digits]) && buf[pos + digits]) {
            const char c = buf[pos + digits];
            size = size * 16 + (size_t)(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
            digits++;
        }
        if (digits > 16 || (digits && size > max_body) || (total += size) > max_body)
            return HEAD_BAD(e, 413, "A chunk of the request body is over the limit of %zu bytes.", max_body);
        if (!nl) return seen;
        if (digits == 0 || (buf[pos + digits] != '\r' && buf[pos + digits] != ';'))
            return HEAD_BAD(e, 400, "Malformed chunked body: a chunk size is not a hex number.");
        seen = 1;
        if (size == 0) return 1; /* the last chunk: trailers are MHD's */
        pos = (size_t)(nl - buf) + 1 + size;
        if (pos + 2 > n) return 1;
        if (buf[pos] != '\r' || buf[pos + 1] != '\n')
            return HEAD_BAD(e, 400, "Malformed chunked body: a chunk's data is longer than its size.");
        pos += 2;
    }
    return seen;
}

int http_head_check(const char *buf, size_t n, http_head *h, kvb_http_error *e) {
    *h = (http_head){.content_length = -1};
    size_t pos = 0, lines = 0;
    while (pos < n) {
        const char *nl = memchr(buf + pos, '\n', n - pos);
        size_t len = (nl ? (size_t)(nl - buf) : n) - pos;
        if (memchr(buf + pos, '\0', len)) return HEAD_BAD(e, 400, "The request head has a NUL byte.");
        if (nl && len && buf[pos + len - 1] == '\r') len--;
        if (!nl && len && buf[pos + len - 1] == '\r') len--; /* its LF may come next */
        int r = lines == 0 ? check_request_line(buf + pos, len, nl != NULL, h, e) : 0;
        if (r < 0) return r;
        if (!nl) return pos + len > HTTP_HEAD_MAX ? HEAD_BAD(e, 431, "The request head is over %d bytes.", HTTP_HEAD_MAX) : 0;
        if (lines > 0 && len == 0) { /* the empty line: the head is whole */
            h->head_len = (size_t)(nl - buf) + 1;
            if (!h->http10 && !h->has_host) return HEAD_BAD(e, 400, "An HTTP/1.1 request needs a Host header.");
            if (h->chunked && h->content_length >= 0)
                return HEAD_BAD(e, 400, "Both Content-Length and Transfer-Encoding: the body's length is ambiguous.");
            if (h->chunked && h->http10) return HEAD_BAD(e, 400, "Transfer-Encoding in an HTTP/1.0 request.");
            return 1;
        }
        if (lines > 0 && check_header(buf + pos, len, h, e) < 0) return -1;
        if (++lines > HTTP_HEADERS_MAX + 1) return HEAD_BAD(e, 431, "More than %d header lines.", HTTP_HEADERS_MAX);
        pos = (size_t)(nl - buf) + 1;
        if (pos > HTTP_HEAD_MAX) return HEAD_BAD(e, 431, "The request head is over %d bytes.", HTTP_HEAD_MAX);
    }
    return 0;
}

