/* node/verdict.c — a reply's bridge verdict ("complete", "partial 3/8: ...", "declined: ...") as
 * the X-KVBridge header and usage.kvbridge carry it: at most KVB_VERDICT_MAX bytes, a reason too
 * long for that shortened at a word boundary so it never ends mid-word. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "node_internal.h"

/* Formats the verdict into verdict (KVB_VERDICT_MAX): a text that does not fit is cut at the last
 * space that leaves room for "...", never inside a word (a single word longer than that is cut
 * before a UTF-8 sequence it would split). Plain ASCII dots: the verdict is also an HTTP header. */
void kvb_verdict_format(char *verdict, const char *fmt, ...) {
    char full[4 * KVB_VERDICT_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(full, sizeof full, fmt, ap);
    va_end(ap);
    static const char more[] = "...";
    const size_t len = strlen(full), room = KVB_VERDICT_MAX - sizeof more; /* text before "..." and the 0 */
    if (len < KVB_VERDICT_MAX) {
        memcpy(verdict, full, len + 1);
        return;
    }
    size_t cut = room;
    while (cut > 0 && full[cut] != ' ') cut--; /* full[cut] is the space after the last whole word */
    while (cut > 0 && strchr(" ,;:", full[cut - 1])) cut--;
    if (cut == 0)
        for (cut = room; cut > 0 && ((unsigned char)full[cut] & 0xC0) == 0x80;) cut--;
    memcpy(verdict, full, cut);
    memcpy(verdict + cut, more, sizeof more);
}
