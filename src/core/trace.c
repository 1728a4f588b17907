/* core/trace.c — the opt-in timeline (KVB_TRACE=FILE): threads append spans to one array
 * allocated when tracing starts, claiming slots with an atomic counter (no lock, no allocation on
 * the hot path); kvb_trace_write prints them as Chrome trace-event JSON ("X" complete events,
 * microseconds of CLOCK_MONOTONIC, one track per thread). Spans past the array's end are counted
 * and dropped, never grown into. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kvb_core.h"

typedef struct {
    const char *name; /* a string literal */
    double t0, t1;    /* kvb_now_s seconds */
    uint64_t arg;
    uint32_t tid;
} trace_span;

static trace_span *g_spans; /* (cap) */
static size_t g_cap;
static _Atomic size_t g_next;
static _Atomic int g_on;
static char *g_path;

void kvb_trace_init_from_env(void) {
    const char *path = getenv("KVB_TRACE");
    if (!path || !*path || atomic_load(&g_on)) return;
    const char *cap_env = getenv("KVB_TRACE_MAX_SPANS");
    size_t cap = cap_env && *cap_env ? strtoull(cap_env, NULL, 10) : ((size_t)4 << 20);
    if (cap == 0 || cap > ((size_t)1 << 28)) cap = (size_t)4 << 20;
    g_spans = calloc(cap, sizeof *g_spans);
    g_path = strdup(path);
    if (!g_spans || !g_path) {
        free(g_spans);
        free(g_path);
        g_spans = NULL;
        g_path = NULL;
        kvb_log(KVB_LOG_WARN, "trace: out of memory for %zu spans; KVB_TRACE ignored", cap);
        return;
    }
    g_cap = cap;
    atomic_store(&g_next, 0);
    atomic_store(&g_on, 1);
}

bool kvb_trace_enabled(void) { return atomic_load_explicit(&g_on, memory_order_relaxed) != 0; }

void kvb_trace_span(const char *name, double t0, double t1, uint64_t arg) {
    if (!atomic_load_explicit(&g_on, memory_order_relaxed)) return;
    static _Thread_local uint32_t tid;
    if (!tid) tid = (uint32_t)syscall(SYS_gettid);
    const size_t i = atomic_fetch_add_explicit(&g_next, 1, memory_order_relaxed);
    if (i >= g_cap) return;
    g_spans[i] = (trace_span){.name = name, .t0 = t0, .t1 = t1, .arg = arg, .tid = tid};
}

/* Called when no other thread records any more (at exit: nodes stopped, threads joined). */
kvb_status kvb_trace_write(kvb_err *err) {
    if (!atomic_exchange(&g_on, 0)) return KVB_OK; /* off, or already written */
    const size_t n = atomic_load(&g_next), kept = n < g_cap ? n : g_cap;
    kvb_status st = KVB_OK;
    FILE *f = fopen(g_path, "w");
    if (!f) {
        st = kvb_err_set(err, KVB_ERR_IO, "trace: cannot write %s (KVB_TRACE): check the directory exists", g_path);
    } else {
        const uint32_t pid = (uint32_t)getpid();
        fprintf(f, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"spans\":%zu,\"dropped\":%zu},\"traceEvents\":[\n",
                kept, n - kept);
        bool first = true;
        for (size_t i = 0; i < kept; i++) {
            const trace_span *s = &g_spans[i];
            if (!s->name) continue; /* claimed by a thread that had not filled it yet */
            fprintf(f, "%s{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%u,\"tid\":%u,\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"a\":%llu}}",
                    first ? "" : ",\n", s->name, pid, s->tid, s->t0 * 1e6, (s->t1 - s->t0) * 1e6,
                    (unsigned long long)s->arg);
            first = false;
        }
        fprintf(f, "\n]}\n");
        if (fclose(f) != 0) st = kvb_err_set(err, KVB_ERR_IO, "trace: writing %s failed", g_path);
        else kvb_log(KVB_LOG_INFO, "trace: %zu spans written to %s (%zu dropped)", kept, g_path, n - kept);
    }
    free(g_spans);
    free(g_path);
    g_spans = NULL;
    g_path = NULL;
    return st;
}
