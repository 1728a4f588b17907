/* node/door_stream.c — llama-server's streamed /completion, read as it arrives, for the front door
 * (llama_door.c): the request goes out with "stream" and "return_progress" on; libcurl delivers the
 * reply's bytes, which are cut into server-sent events ("data: {json}" ended by a blank line). The
 * first prompt-progress event says how many prompt tokens llama-server took from its cache (the
 * restored rows, or its own), which settles the bridge's verdict before any text goes out (the
 * X-KVBridge header leaves with the first byte of a stream); each event's content is passed to the
 * client as a delta at once; the event with "stop" carries the timings and the stop reason. A
 * client that hangs up aborts the transfer, so llama-server stops generating. */
#include <cJSON.h>
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node_internal.h"

#define DOOR_STREAM_EVENT_MAX (16u << 20) /* one event's bytes: llama-server's are far smaller */

typedef struct {
    kvb_completion_out *out;
    kvb_door_stream_start on_start;
    void *ctx;
    kvb_door_stream_end *end;
    char *buf; /* (len) bytes of events not yet ended, NUL-terminated */
    size_t len, cap;
    bool started, client_gone;
    kvb_err *err;
    kvb_status st; /* the first failure seen in an event */
} door_stream;

static int json_int(const cJSON *o, const char *k, int def) {
    const cJSON *v = cJSON_GetObjectItem(o, k);
    return cJSON_IsNumber(v) ? v->valueint : def;
}

/* One event's JSON; false to stop the transfer. */
static bool on_event(door_stream *s, const cJSON *ev) {
    const cJSON *e = cJSON_GetObjectItem(ev, "error");
    if (e) {
        const cJSON *m = cJSON_GetObjectItem(e, "message");
        s->st = kvb_err_set(s->err, KVB_ERR_REFUSED, "llama-server's stream: %s",
                            cJSON_IsString(m) ? m->valuestring : "an error event");
        return false;
    }
    const cJSON *pp = cJSON_GetObjectItem(ev, "prompt_progress");
    if (pp && !s->started) {
        s->started = true;
        s->on_start(s->ctx, json_int(pp, "total", -1), json_int(pp, "cache", -1));
    }
    const cJSON *c = cJSON_GetObjectItem(ev, "content");
    if (cJSON_IsString(c) && c->valuestring[0]) {
        if (!s->started) { /* no progress event came first: the reuse is unknown */
            s->started = true;
            s->on_start(s->ctx, -1, -1);
        }
        if (kvb_completion_emit(s->out, c->valuestring)) {
            s->client_gone = true;
            return false;
        }
    }
    if (cJSON_IsTrue(cJSON_GetObjectItem(ev, "stop"))) {
        const cJSON *tm = cJSON_GetObjectItem(ev, "timings"), *why = cJSON_GetObjectItem(ev, "stop_type");
        s->end->prompt_n = tm ? json_int(tm, "prompt_n", -1) : -1;
        s->end->predicted = json_int(ev, "tokens_predicted", -1);
        s->end->finish = cJSON_IsString(why) && !strcmp(why->valuestring, "limit") ? KVB_FINISH_LENGTH : KVB_FINISH_STOP;
        s->end->done = true;
    }
    return true;
}

/* The events that ended in s->buf, handed on; the unended rest kept. false to stop. */
static bool drain_events(door_stream *s) {
    char *p = s->buf, *sep;
    while ((sep = strstr(p, "\n\n"))) {
        *sep = 0;
        for (char *line = p; line && *line;) { /* an event's "data: " lines; others ("event:", comments) skipped */
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            if (!strncmp(line, "data: ", 6) && strcmp(line + 6, "[DONE]")) {
                cJSON *ev = cJSON_Parse(line + 6);
                const bool go = ev ? on_event(s, ev)
                                   : (s->st = kvb_err_set(s->err, KVB_ERR_FORMAT, "llama-server's stream: an event "
                                                          "that is not JSON: %.120s", line + 6), false);
                cJSON_Delete(ev);
                if (!go) return false;
            }
            line = nl ? nl + 1 : NULL;
        }
        p = sep + 2;
    }
    s->len -= (size_t)(p - s->buf);
    memmove(s->buf, p, s->len + 1);
    return true;
}

static size_t on_body(char *data, size_t size, size_t nmemb, void *ctx) {
    door_stream *s = ctx;
    const size_t n = size * nmemb;
    if (s->len + n + 1 > s->cap) {
        if (s->len + n + 1 > DOOR_STREAM_EVENT_MAX) {
            s->st = kvb_err_set(s->err, KVB_ERR_FORMAT, "llama-server's stream: an event over %u bytes",
                                DOOR_STREAM_EVENT_MAX);
            return 0;
        }
        size_t cap = s->cap ? s->cap : 4096;
        while (cap < s->len + n + 1) cap *= 2;
        char *nb = realloc(s->buf, cap);
        if (!nb) {
            s->st = kvb_err_set(s->err, KVB_ERR_NOMEM, "out of memory");
            return 0;
        }
        s->buf = nb;
        s->cap = cap;
    }
    for (size_t i = 0; i < n; i++) /* CRLF line ends as LF */
        if (data[i] != '\r') s->buf[s->len++] = data[i];
    s->buf[s->len] = 0;
    return drain_events(s) ? n : 0;
}

kvb_status kvb_door_stream_completion(const char *host, uint16_t port, const char *json_body, int timeout_ms,
                                      kvb_completion_out *out, kvb_door_stream_start on_start, void *ctx,
                                      kvb_door_stream_end *end, kvb_err *err) {
    memset(end, 0, sizeof *end);
    door_stream s = {.out = out, .on_start = on_start, .ctx = ctx, .end = end, .err = err};
    char url[300];
    snprintf(url, sizeof url, "http://%s:%u/completion", host, port);
    CURL *easy = curl_easy_init();
    struct curl_slist *hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    if (!easy || !hdrs) {
        curl_slist_free_all(hdrs);
        if (easy) curl_easy_cleanup(easy);
        return kvb_err_set(err, KVB_ERR_NOMEM, "llama-server's stream: cannot set up the HTTP client");
    }
    curl_easy_setopt(easy, CURLOPT_URL, url);
    curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(easy, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, 5000L);
    curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(easy, CURLOPT_HTTPHEADER, hdrs);
    curl_easy_setopt(easy, CURLOPT_POSTFIELDS, json_body);
    curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(easy, CURLOPT_WRITEDATA, &s);
    const CURLcode rc = curl_easy_perform(easy);
    long status = 0;
    curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
    curl_slist_free_all(hdrs);
    curl_easy_cleanup(easy);
    if (status >= 400 && !s.st) { /* its error reply is one JSON object, not events */
        cJSON *j = s.buf ? cJSON_Parse(s.buf) : NULL;
        const cJSON *m = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "error"), "message");
        s.st = kvb_err_set(err, KVB_ERR_REFUSED, "llama-server /completion: HTTP %ld: %.200s", status,
                           cJSON_IsString(m) ? m->valuestring : s.buf ? s.buf : "");
        cJSON_Delete(j);
    }
    free(s.buf);
    end->started = s.started;
    if (s.client_gone) return kvb_err_set(err, KVB_ERR_CANCELLED, "the client went away");
    if (s.st) return s.st;
    if (rc != CURLE_OK)
        return kvb_err_set(err, KVB_ERR_IO, "llama-server %s:%u /completion: %s", host, port, curl_easy_strerror(rc));
    if (!end->done)
        return kvb_err_set(err, KVB_ERR_PEER_GONE, "llama-server %s:%u ended its stream before the last event", host,
                           port);
    return KVB_OK;
}
