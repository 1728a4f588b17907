/* core/strbuf.c — the growable string (kvb_strbuf) the chat templates and the quality-prompt
 * generator build text with: capacity doubles from 256 bytes, overflow and allocation failure
 * set a sticky `oom` flag instead of failing each caller separately. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_core.h"

void kvb_strbuf_putn(kvb_strbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) {
            if (cap > SIZE_MAX / 2) {
                b->oom = true;
                return;
            }
            cap *= 2;
        }
        char *np = realloc(b->p, cap);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void kvb_strbuf_put(kvb_strbuf *b, const char *s) { kvb_strbuf_putn(b, s, strlen(s)); }
