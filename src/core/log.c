/* core/log.c — leveled logging, one line per call: to stderr in one write (lines from several
 * threads never interleave), or to a sink a program or a test installs. Level and sink are
 * process-wide. */
#include "kvb_core.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>

static _Atomic int g_level = KVB_LOG_WARN; /* read by every thread that logs */
static _Atomic kvb_log_sink g_sink;
static void *_Atomic g_sink_ctx;

void kvb_log_set_level(kvb_log_level level) { atomic_store(&g_level, (int)level); }
kvb_log_level kvb_log_get_level(void) { return (kvb_log_level)atomic_load(&g_level); }

void kvb_log_set_sink(kvb_log_sink sink, void *ctx) {
    atomic_store(&g_sink_ctx, ctx);
    atomic_store(&g_sink, sink);
}

void kvb_log(kvb_log_level level, const char *fmt, ...) {
    if ((int)level > atomic_load(&g_level)) return;
    static const char *names[] = {"error", "warn", "info", "debug"};
    char line[2048]; /* longer messages are cut */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    const kvb_log_sink sink = atomic_load(&g_sink);
    if (sink) {
        sink(level, line, atomic_load(&g_sink_ctx));
        return;
    }
    fprintf(stderr, "kvbridge %s: %s\n", names[level], line);
}
