/* core/log.c — leveled logging to stderr; the level is process-wide. */
#include "kvb_core.h"

#include <stdarg.h>
#include <stdio.h>

static kvb_log_level g_level = KVB_LOG_WARN;

void kvb_log_set_level(kvb_log_level level) { g_level = level; }
kvb_log_level kvb_log_get_level(void) { return g_level; }

void kvb_log(kvb_log_level level, const char *fmt, ...) {
    if (level > g_level) return;
    static const char *names[] = {"error", "warn", "info", "debug"};
    fprintf(stderr, "kvbridge %s: ", names[level]);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}
