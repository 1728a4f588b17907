/* completion.c — one completion in flight: the handler-facing API (set_verdict, emit, finish,
 * fail, cancelled) and, for streaming, the hand-off between the handler's worker thread and the
 * connection thread. The worker formats each delta as an SSE chunk into `pending`; the MHD content
 * reader (connection thread) drains it. The connection thread queues the 200 + headers (with
 * X-KVBridge) only once the first delta or the finish arrived, so the verdict header is real and a
 * failure before any output is a real 4xx/5xx. Every wait is sliced (HTTP_WAIT_SLICE_MS) and looks
 * at the server's stop flag and the client's socket (poll POLLRDHUP), so a client that hangs up is
 * seen within a slice even while the handler is computing, and emit then returns KVB_ERR_IO. A
 * relayed completion (handlers.relay, the router) fills `pending` with another server's reply bytes
 * as they are, after a status and headers of its own (relay_begin), through the same hand-off. */
#include <errno.h>
#include <microhttpd.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "http_internal.h"

bool http_peer_closed(int fd) {
    if (fd < 0) return false;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    int r;
    do r = poll(&p, 1, 0);
    while (r < 0 && errno == EINTR);
    return r > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

kvb_completion_out *http_completion_new(kvb_http_server *s, const kvb_completion_req *req, int fd) {
    kvb_completion_out *out = calloc(1, sizeof *out);
    if (!out) return NULL;
    if (kvb_cond_init_monotonic(&out->cv) != 0) {
        free(out);
        return NULL;
    }
    if (pthread_mutex_init(&out->mu, NULL) != 0) {
        pthread_cond_destroy(&out->cv);
        free(out);
        return NULL;
    }
    out->server = s;
    out->req = req;
    out->fd = fd;
    out->streaming = req && req->stream; /* req NULL: a relayed GET */
    out->meta.api = req ? req->api : KVB_API_CHAT_COMPLETIONS;
    out->meta.created = (int64_t)time(NULL);
    out->meta.model = s->model_id;
    out->meta.include_usage = req && req->stream && req->include_usage;
    out->logprobs.api = out->meta.api;
    uint64_t n = atomic_fetch_add(&s->next_id, 1);
    uint64_t a = kvb_splitmix64(s->id_salt ^ n), b = kvb_splitmix64(a + n);
    snprintf(out->meta.id, sizeof out->meta.id, "%s-%016llx%08llx",
             out->meta.api == KVB_API_CHAT_COMPLETIONS ? "chatcmpl" : "cmpl", (unsigned long long)a,
             (unsigned long long)(b >> 32));
    out->t_start = kvb_now_s();
    return out;
}

void http_completion_free(kvb_completion_out *out) {
    if (!out) return;
    http_buf_free(&out->text);
    cJSON_Delete(out->done_choices);
    http_buf_free(&out->pending);
    http_buf_free(&out->relay_headers);
    http_logprobs_free(&out->logprobs);
    pthread_mutex_destroy(&out->mu);
    pthread_cond_destroy(&out->cv);
    free(out);
}

/* ---- helpers (mu held) ------------------------------------------------------------------------ */

static void wait_slice(kvb_completion_out *out) {
    kvb_cond_wait_until(&out->cv, &out->mu, kvb_now_s() + HTTP_WAIT_SLICE_MS * 1e-3);
}

static bool check_cancel_locked(kvb_completion_out *out) {
    if (!out->cancelled) {
        if (atomic_load(&out->server->stopping)) {
            out->cancelled = true;
            pthread_cond_broadcast(&out->cv);
        } else if (http_peer_closed(out->fd)) {
            out->cancelled = out->client_gone = true;
            pthread_cond_broadcast(&out->cv);
        }
    }
    return out->cancelled;
}

static void start_stream_locked(kvb_completion_out *out) {
    if (out->stream_started) return;
    out->stream_started = true;
    if (out->meta.api == KVB_API_CHAT_COMPLETIONS)
        http_sse_chunk(&out->pending, &out->meta, NULL, NULL, true, NULL, NULL, NULL); /* role chunk */
}

/* ---- handler API ------------------------------------------------------------------------------ */

kvb_status kvb_completion_set_verdict(kvb_completion_out *out, const char *verdict) {
    if (!out || !verdict) return KVB_ERR_INVALID;
    char clean[KVB_VERDICT_MAX];
    http_printable_copy(clean, sizeof clean, verdict);
    pthread_mutex_lock(&out->mu);
    kvb_status st = KVB_OK;
    if (out->ended || (out->emitted && strcmp(clean, out->verdict) != 0)) {
        kvb_log(KVB_LOG_WARN, "http: set_verdict('%s') after the first emit or the end is ignored", clean);
        st = KVB_ERR_INVALID;
    } else {
        memcpy(out->verdict, clean, sizeof clean);
        out->has_verdict = true;
    }
    pthread_mutex_unlock(&out->mu);
    return st;
}

kvb_status kvb_completion_emit(kvb_completion_out *out, const char *delta) {
    if (!out || !delta) return KVB_ERR_INVALID;
    http_buf clean = {0};
    http_utf8_sanitize_append(&clean, delta, strlen(delta));
    if (clean.oom) { http_buf_free(&clean); return KVB_ERR_NOMEM; }
    pthread_mutex_lock(&out->mu);
    kvb_status st = KVB_OK;
    if (out->ended) {
        st = KVB_ERR_INVALID;
    } else if (!out->has_verdict) {
        kvb_log(KVB_LOG_WARN, "http: emit before kvb_completion_set_verdict (the verdict must be "
                "known before the first token)");
        st = KVB_ERR_INVALID;
    } else if (check_cancel_locked(out)) {
        st = KVB_ERR_IO;
    } else if (clean.len > 0) {
        const double now = kvb_now_s();
        if (!out->emitted) out->t_first_token = now;
        else {
            const char *api = out->meta.api == KVB_API_CHAT_COMPLETIONS ? "chat" : "completions";
            kvb_metric_observe(out->server->m_gap, KVB_LABELS(api), now - out->t_last_emit);
        }
        out->t_last_emit = now;
        out->emitted = true;
        if (!out->streaming) {
            http_buf_append(&out->text, clean.data, clean.len);
            if (out->text.oom) st = KVB_ERR_NOMEM;
        } else {
            while (out->pending.len - out->pending_off > HTTP_STREAM_BACKLOG_MAX && out->stream_started &&
                   !out->cancelled) {
                wait_slice(out);
                check_cancel_locked(out);
            }
            if (out->cancelled) {
                st = KVB_ERR_IO;
            } else {
                start_stream_locked(out);
                http_sse_chunk(&out->pending, &out->meta, clean.data, http_logprobs_take(&out->logprobs, false),
                               false, NULL, NULL, NULL);
                if (out->pending.oom || out->logprobs.oom) st = KVB_ERR_NOMEM;
                pthread_cond_broadcast(&out->cv);
            }
        }
    }
    pthread_mutex_unlock(&out->mu);
    http_buf_free(&clean);
    return st;
}

kvb_status kvb_completion_add_logprobs(kvb_completion_out *out, const kvb_token_logprob *token,
                                       const kvb_token_logprob *top, size_t n_top) {
    if (!out || !token || (n_top && !top) || !out->req || !out->req->logprobs || n_top > out->req->top_logprobs)
        return KVB_ERR_INVALID;
    pthread_mutex_lock(&out->mu);
    kvb_status st = KVB_OK;
    if (out->ended) st = KVB_ERR_INVALID;
    else {
        http_logprobs_add(&out->logprobs, token, top, n_top);
        if (out->logprobs.oom) st = KVB_ERR_NOMEM;
    }
    pthread_mutex_unlock(&out->mu);
    return st;
}

bool http_completion_close_choice(kvb_completion_out *out, kvb_finish_reason reason) {
    if (!out->done_choices) out->done_choices = cJSON_CreateArray();
    cJSON *lp = out->req->logprobs ? http_logprobs_take(&out->logprobs, true) : NULL;
    cJSON *c = out->done_choices && !out->logprobs.oom
                   ? http_choice_json(out->meta.api, out->meta.index, out->text.data ? out->text.data : "", lp, reason)
                   : (cJSON_Delete(lp), NULL);
    if (!c) return false;
    cJSON_AddItemToArray(out->done_choices, c);
    out->text.len = 0; /* the next choice's text starts afresh */
    if (out->text.data) out->text.data[0] = 0;
    return true;
}

kvb_status kvb_completion_next_choice(kvb_completion_out *out, kvb_finish_reason reason) {
    if (!out || (reason != KVB_FINISH_STOP && reason != KVB_FINISH_LENGTH)) return KVB_ERR_INVALID;
    pthread_mutex_lock(&out->mu);
    kvb_status st = KVB_OK;
    if (out->ended || !out->req || out->meta.index + 1 >= out->req->n) {
        st = KVB_ERR_INVALID;
    } else if (!out->has_verdict) {
        kvb_log(KVB_LOG_WARN, "http: next_choice before kvb_completion_set_verdict");
        st = KVB_ERR_INVALID;
    } else if (check_cancel_locked(out)) {
        st = KVB_ERR_IO;
    } else if (out->streaming) {
        start_stream_locked(out);
        http_sse_chunk(&out->pending, &out->meta, NULL, http_logprobs_take(&out->logprobs, false), false,
                       http_finish_reason_name(reason), NULL, NULL);
        out->meta.index++;
        if (out->meta.api == KVB_API_CHAT_COMPLETIONS) /* the next choice's role chunk */
            http_sse_chunk(&out->pending, &out->meta, NULL, NULL, true, NULL, NULL, NULL);
        if (out->pending.oom || out->logprobs.oom) st = KVB_ERR_NOMEM;
        pthread_cond_broadcast(&out->cv);
    } else if (!http_completion_close_choice(out, reason)) {
        st = KVB_ERR_NOMEM;
    } else {
        out->meta.index++;
    }
    pthread_mutex_unlock(&out->mu);
    return st;
}

kvb_status kvb_completion_finish(kvb_completion_out *out, kvb_finish_reason reason,
                                 const kvb_usage *usage) {
    if (!out || (reason != KVB_FINISH_STOP && reason != KVB_FINISH_LENGTH)) return KVB_ERR_INVALID;
    pthread_mutex_lock(&out->mu);
    const char *v = (usage && usage->verdict) ? usage->verdict : out->has_verdict ? out->verdict : NULL;
    if (out->ended || !v) {
        if (!v) kvb_log(KVB_LOG_WARN, "http: finish without a verdict (set one or pass usage->verdict)");
        pthread_mutex_unlock(&out->mu);
        return KVB_ERR_INVALID;
    }
    http_printable_copy(out->final_verdict, sizeof out->final_verdict, v);
    if (!out->has_verdict) {
        memcpy(out->verdict, out->final_verdict, sizeof out->verdict);
        out->has_verdict = true;
    }
    if (usage) out->usage = *usage;
    out->usage.verdict = out->final_verdict;
    http_printable_copy(out->final_faults, sizeof out->final_faults, usage ? usage->bridge_faults : NULL);
    out->usage.bridge_faults = out->final_faults;
    http_printable_copy(out->final_peer, sizeof out->final_peer, usage ? usage->peer : NULL);
    out->usage.peer = out->final_peer;
    if (!out->usage.placement) out->usage.placement = ""; /* a static name, or none */
    out->finish_reason = reason;
    out->ended = true;
    if (out->streaming && !out->cancelled) {
        start_stream_locked(out);
        http_sse_chunk(&out->pending, &out->meta, NULL, http_logprobs_take(&out->logprobs, false), false,
                       http_finish_reason_name(reason), NULL, NULL);
        if (out->meta.include_usage)
            http_sse_chunk(&out->pending, &out->meta, NULL, NULL, false, NULL, &out->usage, out->final_verdict);
        http_buf_append_str(&out->pending, HTTP_SSE_DONE);
    }
    pthread_cond_broadcast(&out->cv);
    pthread_mutex_unlock(&out->mu);
    return KVB_OK;
}

static void fail_locked(kvb_completion_out *out, int http_status, const char *code, const char *param,
                        const char *fmt, va_list ap) {
    if (http_status < 400 || http_status > 599) http_status = 500;
    http_error_vset(&out->error, http_status, code, param, fmt, ap);
    out->ended = out->failed = true;
    if (out->streaming && out->stream_started && !out->cancelled) http_sse_error(&out->pending, &out->error);
    pthread_cond_broadcast(&out->cv);
}

kvb_status kvb_completion_fail(kvb_completion_out *out, int http_status, const char *code,
                               const char *param, const char *fmt, ...) {
    if (!out || !fmt) return KVB_ERR_INVALID;
    pthread_mutex_lock(&out->mu);
    kvb_status st = KVB_OK;
    if (out->ended) {
        st = KVB_ERR_INVALID;
    } else {
        va_list ap;
        va_start(ap, fmt);
        fail_locked(out, http_status, code, param, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&out->mu);
    return st;
}

bool kvb_completion_cancelled(kvb_completion_out *out) {
    if (!out) return true;
    pthread_mutex_lock(&out->mu);
    bool c = check_cancel_locked(out);
    pthread_mutex_unlock(&out->mu);
    return c;
}

/* ---- relaying another server's reply ------------------------------------------------------------ */

kvb_status kvb_completion_relay_begin(kvb_completion_out *out, int status, const char *const *headers,
                                      size_t n_headers) {
    if (!out || !out->relay || status < 100 || status > 599 || n_headers > KVB_RELAY_MAX_HEADERS ||
        (n_headers && !headers))
        return KVB_ERR_INVALID;
    pthread_mutex_lock(&out->mu);
    kvb_status st = KVB_OK;
    if (out->ended || out->stream_started) {
        st = KVB_ERR_INVALID;
    } else {
        for (size_t i = 0; i < 2 * n_headers; i++) {
            char clean[512];
            http_printable_copy(clean, sizeof clean, headers[i] ? headers[i] : "");
            http_buf_append(&out->relay_headers, clean, strlen(clean) + 1);
        }
        out->relay_n_headers = n_headers;
        out->relay_status = status;
        out->has_verdict = true; /* the relayed reply carries its own */
        out->stream_started = true;
        if (out->relay_headers.oom) st = KVB_ERR_NOMEM;
        pthread_cond_broadcast(&out->cv);
    }
    pthread_mutex_unlock(&out->mu);
    return st;
}

kvb_status kvb_completion_relay_write(kvb_completion_out *out, const void *bytes, size_t n) {
    if (!out || !out->relay || (n && !bytes)) return KVB_ERR_INVALID;
    pthread_mutex_lock(&out->mu);
    kvb_status st = KVB_OK;
    if (out->ended || !out->stream_started) {
        st = KVB_ERR_INVALID;
    } else if (n > 0) {
        while (out->pending.len - out->pending_off > HTTP_STREAM_BACKLOG_MAX && !check_cancel_locked(out))
            wait_slice(out);
        if (check_cancel_locked(out)) {
            st = KVB_ERR_IO;
        } else {
            if (!out->emitted) out->t_first_token = kvb_now_s();
            out->emitted = true;
            http_buf_append(&out->pending, bytes, n);
            if (out->pending.oom) st = KVB_ERR_NOMEM;
            pthread_cond_broadcast(&out->cv);
        }
    }
    pthread_mutex_unlock(&out->mu);
    return st;
}

kvb_status kvb_completion_relay_end(kvb_completion_out *out) {
    if (!out || !out->relay) return KVB_ERR_INVALID;
    pthread_mutex_lock(&out->mu);
    kvb_status st = KVB_OK;
    if (out->ended || !out->stream_started) st = KVB_ERR_INVALID;
    else out->ended = true;
    pthread_cond_broadcast(&out->cv);
    pthread_mutex_unlock(&out->mu);
    return st;
}

/* ---- running the handler ---------------------------------------------------------------------- */

static void fail_unfinished(kvb_completion_out *out, int status, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fail_locked(out, status, code, NULL, fmt, ap);
    va_end(ap);
}

static void mark_handler_returned(kvb_completion_out *out) {
    pthread_mutex_lock(&out->mu);
    out->handler_returned = true;
    if (!out->ended) {
        if (!out->cancelled)
            kvb_log(KVB_LOG_WARN, "http: the completion handler returned without finish or fail");
        if (out->cancelled) /* the server is stopping (or the client gone): a balancer may send it elsewhere */
            fail_unfinished(out, 503, "server_shutting_down", "This server stopped before the reply was done; send "
                            "the request to another one.");
        else
            fail_unfinished(out, 500, NULL, "The completion handler returned without finishing the response.");
    }
    pthread_cond_broadcast(&out->cv);
    pthread_mutex_unlock(&out->mu);
}

void http_completion_run_inline(kvb_completion_out *out) {
    if (out->relay) out->server->handlers.relay(out->server->handlers.ctx, out->relay, out);
    else out->server->handlers.completion(out->server->handlers.ctx, out->req, out);
    mark_handler_returned(out);
}

static void *worker_main(void *arg) {
    http_completion_run_inline(arg);
    return NULL;
}

bool http_completion_start_worker(kvb_completion_out *out) {
    if (pthread_create(&out->thread, NULL, worker_main, out) != 0) return false;
    out->thread_started = true;
    return true;
}

int http_completion_wait_begun(kvb_completion_out *out) {
    pthread_mutex_lock(&out->mu);
    int r;
    for (;;) {
        if (out->stream_started) { r = 1; break; }
        if (out->ended || out->handler_returned) { r = 0; break; }
        if (check_cancel_locked(out)) { r = -1; break; }
        wait_slice(out);
    }
    pthread_mutex_unlock(&out->mu);
    return r;
}

ssize_t http_completion_stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    kvb_completion_out *out = cls;
    pthread_mutex_lock(&out->mu);
    ssize_t r;
    for (;;) {
        if (out->cancelled) { r = MHD_CONTENT_READER_END_WITH_ERROR; break; }
        size_t avail = out->pending.len - out->pending_off;
        if (avail > 0) {
            size_t n = avail < max ? avail : max;
            memcpy(buf, out->pending.data + out->pending_off, n);
            out->pending_off += n;
            if (out->pending_off == out->pending.len) {
                out->pending.len = out->pending_off = 0;
            } else if (out->pending_off > out->pending.len / 2) {
                http_buf_consume(&out->pending, out->pending_off);
                out->pending_off = 0;
            }
            pthread_cond_broadcast(&out->cv); /* an emit may wait for room */
            r = (ssize_t)n;
            break;
        }
        if (out->ended || out->handler_returned) { r = MHD_CONTENT_READER_END_OF_STREAM; break; }
        wait_slice(out);
        check_cancel_locked(out);
    }
    pthread_mutex_unlock(&out->mu);
    return r;
}

void http_completion_abandon(kvb_completion_out *out) {
    pthread_mutex_lock(&out->mu);
    if (!out->handler_returned) out->cancelled = true;
    pthread_cond_broadcast(&out->cv);
    pthread_mutex_unlock(&out->mu);
    if (out->thread_started) {
        pthread_join(out->thread, NULL);
        out->thread_started = false;
    }
}
