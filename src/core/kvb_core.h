/* core — the contract every module builds on: status codes with a message (library code never
 * exits), logging, monotonic time, a seeded RNG, XXH3 hashing, a fixed thread pool for parallel
 * loops, and small checked-arithmetic helpers for hostile sizes. Nothing here knows about models. */
#ifndef KVB_CORE_H
#define KVB_CORE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- status ---------------------------------------------------------------------------- */

typedef enum {
    KVB_OK = 0,
    KVB_ERR_IO,          /* open/read/write/mmap failed */
    KVB_ERR_FORMAT,      /* input bytes are malformed (hostile-input checks) */
    KVB_ERR_INVALID,     /* caller passed something invalid (bad flag, bad argument) */
    KVB_ERR_UNSUPPORTED, /* well-formed but not something we implement */
    KVB_ERR_NOMEM,       /* allocation failed */
    KVB_ERR_RANGE,       /* a number or size out of the allowed range / overflow */
    KVB_ERR_NOT_FOUND,   /* key, tensor, file not present */
    KVB_ERR_INTERNAL,    /* a broken invariant: a bug */
    /* the peer and the link: decided on by code, never by a message's text */
    KVB_ERR_TIMEOUT,     /* a deadline passed: the peer or the client said nothing in time */
    KVB_ERR_CANCELLED,   /* stopped on purpose: the client went away, a CANCEL, a drain */
    KVB_ERR_CHECKSUM,    /* bytes arrived but their checksum does not match (corrupt in flight) */
    KVB_ERR_AUTH,        /* the peer failed authentication (wrong pre-shared key) */
    KVB_ERR_PEER_GONE,   /* the peer closed the connection, or none can be made */
    KVB_ERR_MISMATCH,    /* the peers disagree: model or cache-format fingerprint, protocol version */
    KVB_ERR_REFUSED,     /* the peer answered with a refusal of its own (ERROR frame: draining, too long) */
} kvb_status;

/* An error: code plus a human message that says what is wrong and, where it can, what to do. */
typedef struct {
    kvb_status code;
    char msg[512];
} kvb_err;

/* Sets *err (when err != NULL) and returns code. The message is printf-formatted. */
kvb_status kvb_err_set(kvb_err *err, kvb_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Prefixes an existing message with context ("loading x.gguf: " + old message). */
kvb_status kvb_err_prefix(kvb_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *kvb_status_name(kvb_status s);

/* ---- logging (stderr) ------------------------------------------------------------------- */

typedef enum { KVB_LOG_ERROR = 0, KVB_LOG_WARN, KVB_LOG_INFO, KVB_LOG_DEBUG } kvb_log_level;
void kvb_log_set_level(kvb_log_level level);
kvb_log_level kvb_log_get_level(void);
void kvb_log(kvb_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Where log lines go instead of stderr (NULL: stderr again): called for each line at or below the
 * level, from the logging thread, with the message (no level prefix, no newline, at most 2047
 * bytes). Set it before starting anything that logs. */
typedef void (*kvb_log_sink)(kvb_log_level level, const char *line, void *ctx);
void kvb_log_set_sink(kvb_log_sink sink, void *ctx);

/* ---- time ------------------------------------------------------------------------------- */

double kvb_now_s(void); /* monotonic seconds */
/* A condition variable whose timed waits count on kvb_now_s's clock (CLOCK_MONOTONIC): 0 or an
 * errno from pthread_cond_init. */
int kvb_cond_init_monotonic(pthread_cond_t *cv);
/* Waits on cv (initialised by kvb_cond_init_monotonic; mu held) until signalled or the time
 * kvb_now_s() reaches deadline_s: 0, or ETIMEDOUT. */
int kvb_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, double deadline_s);

/* ---- RNG: splitmix64-seeded xoshiro256**, deterministic on every platform --------------- */

typedef struct {
    uint64_t s[4];
} kvb_rng;
void kvb_rng_seed(kvb_rng *r, uint64_t seed);
uint64_t kvb_rng_u64(kvb_rng *r);
float kvb_rng_uniform(kvb_rng *r); /* [0, 1), 24 random bits */
float kvb_rng_normal(kvb_rng *r);  /* standard normal (Box-Muller) */
uint64_t kvb_splitmix64(uint64_t x); /* one mixing step: derive independent seeds */

/* ---- hashing (XXH3, libxxhash) ---------------------------------------------------------- */

uint64_t kvb_hash64(const void *data, size_t n, uint64_t seed);

/* A piece of bytes (payload pieces, K and V of a slab). */
typedef struct {
    const void *data;
    size_t len;
} kvb_bytes;
/* XXH3-64, seed 0, of the pieces back to back (the same bits as one call over their
 * concatenation), with the fastest kernel this CPU runs (AVX2 where it has it). */
uint64_t kvb_xxh3_pieces(const kvb_bytes *pieces, int n);
uint64_t kvb_xxh3(const void *data, size_t n);

/* ---- checked arithmetic for sizes from hostile input ------------------------------------ */

static inline bool kvb_mul_overflow_u64(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_mul_overflow(a, b, out);
}
static inline bool kvb_add_overflow_u64(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_add_overflow(a, b, out);
}

/* ---- thread pool: fixed workers, one parallel-for at a time ----------------------------- */

/* A growable NUL-terminated string: zero-initialise, append, free(p). After an allocation failure
 * (or a size overflow) `oom` is set and further appends do nothing. */
typedef struct {
    char *p;
    size_t n, cap;
    bool oom;
} kvb_strbuf;
void kvb_strbuf_putn(kvb_strbuf *b, const char *s, size_t n);
void kvb_strbuf_put(kvb_strbuf *b, const char *s);

typedef struct kvb_pool kvb_pool;
/* Task body: called once for each task index in [0, n_tasks), on some worker. `worker` is in
 * [0, kvb_pool_size(pool)). Which worker runs a task must never change a result: split work so
 * that each output element is computed by exactly one task in a fixed order. */
typedef void (*kvb_task_fn)(void *ctx, int task, int worker);

/* n_threads >= 1 (the calling thread is worker 0; n_threads-1 helper threads are started). */
kvb_status kvb_pool_create(int n_threads, kvb_pool **out, kvb_err *err);
void kvb_pool_destroy(kvb_pool *pool);
int kvb_pool_size(const kvb_pool *pool);
/* Workers spinning after a job (they spin a moment for the next one) go to sleep now: call before
 * a long wait, so they leave the CPUs to other threads. The next parallel_for wakes them. */
void kvb_pool_park(kvb_pool *pool);
/* Only workers [0, width) take the next jobs (1..size; anything else: all of them); the others
 * sleep without spinning until the width grows again. For a forward that shares the CPUs with
 * other busy threads. Results never depend on it (kvb_pool_size stays the pool's size). Call from
 * the thread that runs parallel_for, between jobs. */
void kvb_pool_set_width(kvb_pool *pool, int width);
int kvb_pool_width(const kvb_pool *pool);
/* Runs fn(ctx, t, w) for t in [0, n_tasks) and returns when all are done. Tasks are handed out
 * dynamically. Not reentrant: one parallel_for per pool at a time. pool == NULL runs serially. */
void kvb_pool_parallel_for(kvb_pool *pool, int n_tasks, kvb_task_fn fn, void *ctx);
/* Number of online CPUs (>= 1). */
int kvb_cpu_count(void);

/* Memory read bandwidth in GB/s (1e9 bytes/s) with the pool's threads each streaming a slice
 * of a `bytes`-sized buffer; best of `reps` passes after a warm-up. 0 if allocation failed. */
double kvb_measure_read_bw(kvb_pool *pool, size_t bytes, int reps);

/* ---- timeline trace (opt-in) --------------------------------------------------------------
 * With KVB_TRACE=FILE in the environment, spans recorded by any thread (name, start and end in
 * kvb_now_s seconds, one number) are kept in memory and written to FILE as Chrome trace-event JSON
 * (chrome://tracing, ui.perfetto.dev, tools/trace_report.py) by kvb_trace_write. Off, a span costs
 * one atomic load. `name` must be a string literal of letters, digits and ". _ -" (not escaped).
 * Nodes of one host share the monotonic clock, so two processes' files line up. */
void kvb_trace_init_from_env(void);   /* reads KVB_TRACE and KVB_TRACE_MAX_SPANS (default 4M) */
bool kvb_trace_enabled(void);
void kvb_trace_span(const char *name, double t0, double t1, uint64_t arg);
/* Writes and drops what was recorded (a no-op when off); spans past the cap are counted, not kept. */
kvb_status kvb_trace_write(kvb_err *err);

/* ---- aligned allocation ------------------------------------------------------------------ */

void *kvb_aligned_alloc(size_t alignment, size_t size); /* free with kvb_aligned_free; NULL on fail */
void kvb_aligned_free(void *p);

#define KVB_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define KVB_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KVB_MAX(a, b) ((a) > (b) ? (a) : (b))

#endif
