/* tests/test_llama_door.c — the front door for a stock llama-server (node/kvb_llama_door.h), end to
 * end on loopback: a real llama-server (kvbt_require_llama_server; the case skips without it) with
 * two slots, a CPU prefill node and the door in front, for a generated tiny-llama3 (q8_0). A
 * conversation of three turns: each turn is `complete`, the prefill node ships only the turn's new
 * whole blocks (usage.kvbridge: cached = what the slot held, bridged = the rest up to the last
 * block before the last prompt token, native = llama-server's timings.prompt_n = the tail), every
 * greedy reply equals llama-server's own for the same prompt computed from nothing, and the slot
 * file the door restored holds, bit for bit, the rows kvbridge's own engine computes for those
 * tokens (the random model's greedy replies alone would hardly tell a wrong row). A door for another
 * model of the same shapes refuses to start. A second conversation takes the other slot and leaves
 * the first one's rows alone. llama-server restarted with flash attention refuses the door's file
 * (V transposed): that turn is `declined`, the reply the same. A turn streamed through the door comes
 * in chunks, equal to the whole reply; a streaming client that hangs up stops llama-server's
 * generation. Then the prefill node stops, and the next turn is `declined` with the same reply. More
 * slots than llama-server's -np are refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <cJSON.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvb_core.h"
#include "kvb_engine_cpu.h"
#include "kvb_foreign.h"
#include "kvb_llama_door.h"
#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvbt.h"

#define PSK "llama-door-test-key-0123"
#define BT 32
#define N_PREDICT 12

static char g_out[1 << 16];

/* One turn through the door and the same prompt through llama-server alone. */
typedef struct {
    char verdict[160];
    char text[4096], alone[4096];
    long long prompt, cached, bridged, native;
} turn;

static const char *json_str(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItem(o, k);
    return cJSON_IsString(v) ? v->valuestring : "";
}

static long long json_int(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItem(o, k);
    return cJSON_IsNumber(v) ? (long long)v->valuedouble : -1;
}

/* A /v1/completions request for prompt: greedy, max_tokens (caller deletes). */
static cJSON *completion_request(const char *prompt, int max_tokens) {
    cJSON *q = cJSON_CreateObject();
    cJSON_AddStringToObject(q, "model", "tiny");
    cJSON_AddStringToObject(q, "prompt", prompt);
    cJSON_AddNumberToObject(q, "max_tokens", max_tokens);
    cJSON_AddNumberToObject(q, "temperature", 0);
    return q;
}

static void run_turn(int door_port, int server_port, const char *prompt, turn *t) {
    cJSON *q = completion_request(prompt, N_PREDICT);
    char *body = cJSON_PrintUnformatted(q);
    kvb_http_reply r = {0};
    kvb_err err = {0};
    assert_int_equal(kvb_http_post("127.0.0.1", (uint16_t)door_port, "/v1/completions", body, 120000, &r, &err), KVB_OK);
    if (r.status != 200) fail_msg("the door answered %d: %s", r.status, r.body);
    cJSON *j = cJSON_Parse(r.body);
    assert_non_null(j);
    snprintf(t->verdict, sizeof t->verdict, "%s", r.verdict);
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    const cJSON *u = cJSON_GetObjectItem(j, "usage"), *kb = cJSON_GetObjectItem(u, "kvbridge");
    snprintf(t->text, sizeof t->text, "%s", json_str(ch, "text"));
    t->prompt = json_int(u, "prompt_tokens");
    t->cached = json_int(kb, "cached_tokens");
    t->bridged = json_int(kb, "bridged_tokens");
    t->native = json_int(kb, "native_tokens");
    assert_string_equal(json_str(kb, "verdict"), t->verdict);
    cJSON_Delete(j);
    kvb_http_reply_free(&r);
    free(body);
    /* llama-server alone: a fresh computation of the whole prompt */
    cJSON *a = cJSON_CreateObject();
    cJSON_AddStringToObject(a, "prompt", prompt);
    cJSON_AddNumberToObject(a, "n_predict", N_PREDICT);
    cJSON_AddNumberToObject(a, "temperature", 0);
    cJSON_AddBoolToObject(a, "cache_prompt", 0);
    body = cJSON_PrintUnformatted(a);
    assert_int_equal(kvb_http_post("127.0.0.1", (uint16_t)server_port, "/completion", body, 120000, &r, &err), KVB_OK);
    assert_int_equal(r.status, 200);
    j = cJSON_Parse(r.body);
    assert_non_null(j);
    snprintf(t->alone, sizeof t->alone, "%s", json_str(j, "content"));
    assert_int_equal(json_int(cJSON_GetObjectItem(j, "timings"), "prompt_n"), t->prompt);
    cJSON_Delete(j);
    cJSON_Delete(a);
    cJSON_Delete(q);
    kvb_http_reply_free(&r);
    free(body);
    print_message("  %-60s prompt %lld: cached %lld, bridged %lld, native %lld; reply %s\n", t->verdict, t->prompt,
                  t->cached, t->bridged, t->native, strcmp(t->text, t->alone) ? "DIFFERS" : "the same");
}

static void append(char *buf, size_t cap, const char *a, const char *b);

/* The same prompt as the turn before (its rows all in the slot), streamed through the door: the verdict
 * in the header before the first chunk, the text in several chunks as llama-server produces it, all of
 * it equal to that turn's reply, and usage with the verdict in the last chunk. */
static void expect_streamed(int door_port, const char *prompt, const turn *before) {
    cJSON *q = completion_request(prompt, N_PREDICT);
    cJSON_AddBoolToObject(q, "stream", 1);
    cJSON *so = cJSON_AddObjectToObject(q, "stream_options");
    cJSON_AddBoolToObject(so, "include_usage", 1);
    char *body = cJSON_PrintUnformatted(q);
    kvb_http_reply r = {0};
    kvb_err err = {0};
    assert_int_equal(kvb_http_post("127.0.0.1", (uint16_t)door_port, "/v1/completions", body, 120000, &r, &err), KVB_OK);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.verdict, "complete");
    static char text[4096];
    text[0] = 0;
    int chunks = 0, done = 0;
    char usage_verdict[160] = "";
    for (char *line = strtok(r.body, "\r\n"); line; line = strtok(NULL, "\r\n")) { /* chunk sizes skipped */
        if (strncmp(line, "data: ", 6)) continue;
        if (!strcmp(line + 6, "[DONE]")) {
            done++;
            continue;
        }
        cJSON *ev = cJSON_Parse(line + 6);
        assert_non_null(ev);
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(ev, "choices"), 0);
        const char *piece = ch ? json_str(ch, "text") : "";
        if (piece[0]) {
            chunks++;
            append(text, sizeof text, piece, "");
        }
        const cJSON *kb = cJSON_GetObjectItem(cJSON_GetObjectItem(ev, "usage"), "kvbridge");
        if (kb) snprintf(usage_verdict, sizeof usage_verdict, "%s", json_str(kb, "verdict"));
        cJSON_Delete(ev);
    }
    print_message("  streamed: %d chunks, verdict in usage '%s', reply %s\n", chunks, usage_verdict,
                  strcmp(text, before->text) ? "DIFFERS" : "the same");
    assert_true(chunks >= 2);
    assert_int_equal(done, 1);
    assert_string_equal(usage_verdict, "complete");
    assert_string_equal(text, before->text);
    kvb_http_reply_free(&r);
    free(body);
    cJSON_Delete(q);
}

/* Streams `asked` tokens (EOS ignored) of prompt through the door on a raw socket and reads until the
 * first chunk's text; then hangs up, or reads to the end. Seconds from that first text on. */
static double stream_raw(int door_port, const char *prompt, int asked, bool hang_up) {
    cJSON *q = completion_request(prompt, asked);
    cJSON_AddBoolToObject(q, "ignore_eos", 1);
    cJSON_AddBoolToObject(q, "stream", 1);
    char *body = cJSON_PrintUnformatted(q), head[256], port[16];
    static char buf[1 << 20];
    cJSON_Delete(q);
    snprintf(port, sizeof port, "%d", door_port);
    const int fd = kvb_tcp_dial("127.0.0.1", port);
    assert_true(fd >= 0);
    const int hl = snprintf(head, sizeof head, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                            "application/json\r\nConnection: close\r\nContent-Length: %zu\r\n\r\n", strlen(body));
    assert_int_equal(send(fd, head, (size_t)hl, MSG_NOSIGNAL), hl);
    assert_int_equal(send(fd, body, strlen(body), MSG_NOSIGNAL), (ssize_t)strlen(body));
    free(body);
    size_t got = 0;
    double t_first = 0;
    for (;;) {
        const ssize_t k = recv(fd, buf + got, sizeof buf - 1 - got, 0);
        if (k <= 0) break;
        got += (size_t)k;
        buf[got] = 0;
        if (!t_first && strstr(buf, "\"text\":\"")) {
            t_first = kvb_now_s();
            if (hang_up) break;
        }
        if (got > sizeof buf / 2) got = 0; /* only the first text matters */
    }
    close(fd);
    assert_true(t_first > 0);
    return kvb_now_s() - t_first;
}

/* A streamed request whose client hangs up after the first chunk: the door drops its transfer from
 * llama-server, which stops generating: its slots are idle again well before the same request read to
 * its end took after its first chunk. The door then serves the next request (the turns after). */
static void expect_hangup_stops(int door_port, int server_port, const char *prompt) {
    enum { ASKED = 700 };
    const double rest = stream_raw(door_port, prompt, ASKED, false);
    (void)stream_raw(door_port, prompt, ASKED, true);
    const double t0 = kvb_now_s();
    bool busy = true;
    while (busy && kvb_now_s() - t0 < 10) {
        kvb_http_reply r = {0};
        kvb_err err = {0};
        assert_int_equal(kvb_http_get("127.0.0.1", (uint16_t)server_port, "/slots", 10000, &r, &err), KVB_OK);
        cJSON *j = cJSON_Parse(r.body);
        busy = false;
        for (int k = 0; k < cJSON_GetArraySize(j); k++)
            if (cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetArrayItem(j, k), "is_processing"))) busy = true;
        cJSON_Delete(j);
        kvb_http_reply_free(&r);
        if (busy) usleep(5000);
    }
    const double idle = kvb_now_s() - t0;
    print_message("  %d tokens streamed: %.3f s after the first chunk read to the end; hung up after it: llama-server "
                  "idle %.3f s later\n", ASKED, rest, idle);
    assert_false(busy);
    assert_true(idle < rest / 2);
}

/* A bridged turn: complete, the slot's rows (held) reused, only the new whole blocks shipped. */
static void expect_bridged(const turn *t, long long held) {
    const long long target = (t->prompt - 1) / BT * BT;
    assert_string_equal(t->verdict, "complete");
    assert_int_equal(t->cached, held);
    assert_int_equal(t->bridged, target - held);
    assert_true(t->bridged > 0);
    assert_int_equal(t->native, t->prompt - target);
}

/* ... and its greedy reply is llama-server's own. */
static void expect_complete(const turn *t, long long held) {
    expect_bridged(t, held);
    assert_string_equal(t->text, t->alone);
}


/* K/V rows kvbridge's own CPU engine computes for the file's tokens, (layer, position, row) f16. */
typedef struct {
    uint32_t n_pos;
    size_t row;
    uint8_t *k, *v;
} engine_rows;

static kvb_status gather(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n, const uint8_t *k, const uint8_t *v,
                         uint32_t dtype, kvb_err *err) {
    engine_rows *e = ctx;
    (void)err;
    assert_int_equal(dtype, KVB_TYPE_F16);
    memcpy(e->k + ((size_t)layer * e->n_pos + pos0) * e->row, k, n * e->row);
    memcpy(e->v + ((size_t)layer * e->n_pos + pos0) * e->row, v, n * e->row);
    return KVB_OK;
}

/* Whether a row is all zero bytes. */
static bool zero_row(const uint8_t *r, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (r[i]) return false;
    return true;
}

/* K/V rows kvbridge's own CPU engine computes for n tokens (released with free_rows). */
static engine_rows compute_rows(const kvb_model *m, const int32_t *tokens, uint32_t n) {
    engine_rows e = {.n_pos = n, .row = (size_t)m->d.n_head_kv * m->d.head_dim * 2};
    e.k = malloc((size_t)m->d.n_layer * e.n_pos * e.row);
    e.v = malloc((size_t)m->d.n_layer * e.n_pos * e.row);
    kvb_engine_opts o = {.n_threads = 2, .cache_dtype = KVB_TYPE_F16, .block_tokens = BT, .max_ctx = 2048,
                         .rows_hook = gather, .rows_hook_ctx = &e};
    kvb_engine *eng = NULL;
    kvb_seq *q = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_engine_create(m, &o, &eng, &err), KVB_OK);
    assert_int_equal(kvb_seq_create(eng, &q, &err), KVB_OK);
    assert_int_equal(kvb_engine_forward(eng, q, tokens, n, NULL, false, &err), KVB_OK);
    kvb_seq_free(q);
    kvb_engine_free(eng);
    return e;
}

/* The door's slot file for `slot`, parsed. */
static kvb_llama_state load_slot_file(const char *slots, int slot) {
    char path[1024];
    snprintf(path, sizeof path, "%s/kvb-door-slot%d.bin", slots, slot);
    kvb_llama_state s;
    kvb_err err = {0};
    assert_int_equal(kvb_llama_state_load(path, &s, &err), KVB_OK);
    return s;
}

/* A slot file the door restored holds the prompt's first s->n_tokens tokens and, every row bit for
 * bit, what kvbridge's own engine computes for them (e: rows of those tokens or of a longer prompt
 * they begin; the bridged increments appended). One cache of every cell; or, with sliding-window
 * layers, the global layers' every cell, then the local layers' last window + 1 cells, of which
 * those the next query reads (the last window - 1) are kvbridge's and the older ones kvbridge's or
 * zero (no later position attends them). The random model's greedy replies alone would hardly
 * tell a wrong row. */
static void check_slot_state(const kvb_llama_state *s, const kvb_model *m, const engine_rows *e, int slot) {
    const uint32_t window = m->d.swa_window, rows = s->n_tokens;
    assert_int_equal(s->n_cache, kvb_model_has_local_layers(&m->d) ? 2 : 1);
    assert_true(rows <= e->n_pos);
    uint32_t differ = 0, zero = 0;
    for (uint32_t ci = 0; ci < s->n_cache; ci++) {
        const kvb_llama_cache *c = &s->cache[ci];
        const uint32_t first = ci == 1 && rows > window + 1 ? rows - window - 1 : 0;
        const uint32_t keep = ci == 1 && rows > window - 1 ? rows - (window - 1) : 0;
        assert_int_equal(c->seq_id, slot);
        assert_int_equal(c->n_cells, rows - first);
        assert_int_equal(c->k_row_bytes, e->row);
        uint32_t li = 0;
        for (uint32_t l = 0; l < m->d.n_layer; l++) {
            if (s->n_cache == 2 && kvb_layer_is_local(&m->d, l) != (ci == 1)) continue;
            for (uint32_t t = 0; t < c->n_cells; t++) {
                const uint32_t p = first + t;
                assert_int_equal(c->pos[t], p);
                const uint8_t *k = kvb_llama_k_row(c, li, t), *v = kvb_llama_v_row(c, li, t);
                const size_t at = ((size_t)l * e->n_pos + p) * e->row;
                const bool k_same = !memcmp(k, e->k + at, e->row), v_same = !memcmp(v, e->v + at, e->row);
                if (p < keep && !k_same && zero_row(k, e->row) && zero_row(v, e->row)) zero++;
                else differ += !k_same + !v_same;
            }
            li++;
        }
        assert_int_equal(li, c->n_layer);
    }
    print_message("  slot %d's file: %u tokens in %u cache(s), %u K/V rows differ from kvbridge's own engine, "
                  "%u unread local cells zero\n", slot, rows, s->n_cache, differ, zero);
    assert_int_equal(differ, 0);
}

static void expect_slot_file(const char *slots, int slot, const char *model, long long rows) {
    kvb_llama_state s = load_slot_file(slots, slot);
    assert_int_equal(s.n_tokens, rows);
    kvb_model *m = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_model_load(model, &m, &err), KVB_OK);
    engine_rows e = compute_rows(m, s.tokens, s.n_tokens);
    check_slot_state(&s, m, &e, slot);
    kvb_model_free(m);
    free(e.k), free(e.v);
    kvb_llama_state_free(&s);
}

static void append(char *buf, size_t cap, const char *a, const char *b) {
    const size_t n = strlen(buf);
    snprintf(buf + n, cap - n, "%s%s", a, b);
}

/* llama-server (n_slots, -fa off, one more flag extra or NULL) on model with its slots in `slots`,
 * and a CPU prefill node for the same model, both on loopback. */
typedef struct {
    pid_t server;
    int server_port;
    kvb_prefill_node *pn;
    char peer[64], url[64];
} rig;

static void rig_start(rig *r, const char *bin, const char *model, const char *slots, int port, int n_slots,
                      const char *extra) {
    r->server_port = port;
    r->server = kvbt_llama_server_start(bin, model, slots, port, n_slots, "off", extra);
    kvb_err err = {0};
    kvb_prefill_config pc = {.listen = "127.0.0.1:0", .model_path = model, .psk = PSK, .n_threads = 2,
                             .cache_dtype = KVB_TYPE_F16, .block_tokens = BT, .max_ctx = 2048};
    r->pn = NULL;
    assert_int_equal(kvb_prefill_node_start(&pc, &r->pn, &err), KVB_OK);
    snprintf(r->peer, sizeof r->peer, "127.0.0.1:%u", kvb_prefill_node_port(r->pn));
    snprintf(r->url, sizeof r->url, "http://127.0.0.1:%d", port);
}

/* llama-server (pid) restarted with flash attention (V row-major) behind the door's back: the next
 * turn (the reply `last` and a question appended to conv) arrives, llama-server refuses the door's
 * file (V transposed) and computes the prompt itself: `declined`, its reply. The new pid. */
static pid_t refused_turn(pid_t pid, const char *bin, const char *model, const char *slots, int n_slots,
                          int door_port, int server_port, char *conv, size_t cap, const char *last, turn *t) {
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    pid = kvbt_llama_server_start(bin, model, slots, server_port, n_slots, "on", NULL);
    append(conv, cap, last, " And what did the server say after it came back?");
    run_turn(door_port, server_port, conv, t);
    assert_non_null(strstr(t->verdict, "declined: llama-server refused the restore"));
    assert_int_equal(t->bridged, 0);
    assert_int_equal(t->cached + t->native, t->prompt);
    assert_string_equal(t->text, t->alone);
    return pid;
}

static void test_conversation_bridged_then_declined(void **state) {
    (void)state;
    char bin[1024], model[512], slots[512], cmd[2048];
    kvbt_require_llama_server(bin, sizeof bin);
    kvbt_tmp_path(model, sizeof model, "tiny-llama3-door-q8_0.gguf");
    kvbt_tmp_path(slots, sizeof slots, "llama-door-slots");
    mkdir(slots, 0755);
    snprintf(cmd, sizeof cmd, "[ -f '%s' ] || '%s' gen-model --preset tiny-llama3 --type q8_0 --out '%s' --quiet",
             model, kvbt_bin(), model);
    assert_int_equal(kvbt_sh(cmd, g_out, sizeof g_out, 1), 0);
    rig r;
    rig_start(&r, bin, model, slots, 22000 + getpid() % 20000, 2, NULL);
    const int server_port = r.server_port;
    pid_t pid = r.server;
    kvb_prefill_node *pn = r.pn;
    kvb_err err = {0};
    kvb_llama_door *d = NULL;
    char other_model[512];
    kvbt_tmp_path(other_model, sizeof other_model, "tiny-llama3-door-seed7.gguf");
    snprintf(cmd, sizeof cmd, "'%s' gen-model --preset tiny-llama3 --type q8_0 --seed 7 --out '%s' --quiet",
             kvbt_bin(), other_model);
    assert_int_equal(kvbt_sh(cmd, g_out, sizeof g_out, 1), 0);
    kvb_llama_door_config dc = {.http_listen = "127.0.0.1:0", .server_url = r.url, .slot_dir = slots,
                                .peer = r.peer, .psk = PSK, .model_path = other_model, .slots = 2,
                                .block_tokens = BT, .max_ctx = 2048};
    /* a door for another model (same shapes, other weights) refuses to start: it would restore wrong rows */
    assert_int_equal(kvb_llama_door_start(&dc, &d, &err), KVB_ERR_MISMATCH);
    print_message("  another model: %s\n", err.msg);
    dc.model_path = model;
    dc.slots = 3; /* more slots than llama-server's -np: refused (it would restore into a slot it lacks) */
    assert_int_equal(kvb_llama_door_start(&dc, &d, &err), KVB_ERR_INVALID);
    print_message("  three slots: %s\n", err.msg);
    dc.slots = 2;
    if (kvb_llama_door_start(&dc, &d, &err)) fail_msg("the door did not start: %s", err.msg);
    const int door_port = kvb_llama_door_port(d);
    static char conv[8192], other[2048];
    snprintf(conv, sizeof conv, "Once upon a time there was a prefill node and a decode node, and they shared one "
             "cache. The prefill node computed the long prompts and the decoder only read them back.");
    turn t[7];
    long long held = 0;
    for (int i = 0; i < 3; i++) { /* three turns: each ships only its increment */
        run_turn(door_port, server_port, conv, &t[i]);
        expect_complete(&t[i], held);
        held = t[i].cached + t[i].bridged;
        expect_slot_file(slots, 0, model, held);
        append(conv, sizeof conv, t[i].text, " And then the user asked about the next chapter of the story, which "
               "was about slots and rows and the files that carry them.");
    }
    snprintf(other, sizeof other, "A different conversation entirely: a recipe for bread with flour, water, salt and "
             "yeast, kneaded for ten minutes and left to rise overnight in a cool kitchen.");
    run_turn(door_port, server_port, other, &t[3]); /* the other slot, from nothing */
    expect_complete(&t[3], 0);
    expect_slot_file(slots, 1, model, t[3].bridged);
    run_turn(door_port, server_port, conv, &t[4]); /* the first conversation's slot kept its rows */
    expect_complete(&t[4], held);
    expect_slot_file(slots, 0, model, t[4].cached + t[4].bridged);
    expect_streamed(door_port, conv, &t[4]);
    expect_hangup_stops(door_port, server_port, other);
    pid = refused_turn(pid, bin, model, slots, 2, door_port, server_port, conv, sizeof conv, t[4].text, &t[5]);
    append(conv, sizeof conv, t[5].text, " One more question, after the prefill node went away.");
    kvb_prefill_node_stop(pn);
    run_turn(door_port, server_port, conv, &t[6]);
    assert_non_null(strstr(t[6].verdict, "declined: "));
    assert_int_equal(t[6].bridged, 0);
    assert_int_equal(t[6].cached + t[6].native, t[6].prompt);
    assert_string_equal(t[6].text, t[6].alone);
    kvb_llama_door_stop(d);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
}

/* POSTs a JSON body to llama-server; the parsed 200 reply (caller deletes). */
static cJSON *server_json(int port, const char *path, const char *body) {
    kvb_http_reply r = {0};
    kvb_err err = {0};
    assert_int_equal(kvb_http_post("127.0.0.1", (uint16_t)port, path, body, 120000, &r, &err), KVB_OK);
    if (r.status != 200) fail_msg("llama-server %s answered %d: %s", path, r.status, r.body);
    cJSON *j = cJSON_Parse(r.body);
    assert_non_null(j);
    kvb_http_reply_free(&r);
    return j;
}

/* A /completion in slot 0 with prompt caching: ids (n of them) or text, greedy; its content in out. */
static long long slot0_complete(int port, const int32_t *ids, uint32_t n, const char *text, int n_predict,
                                char *out, size_t cap) {
    cJSON *q = cJSON_CreateObject();
    if (text) cJSON_AddStringToObject(q, "prompt", text);
    else {
        cJSON *arr = cJSON_AddArrayToObject(q, "prompt");
        for (uint32_t i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    }
    cJSON_AddNumberToObject(q, "n_predict", n_predict);
    cJSON_AddNumberToObject(q, "temperature", 0);
    cJSON_AddNumberToObject(q, "id_slot", 0);
    cJSON_AddBoolToObject(q, "cache_prompt", 1);
    char *body = cJSON_PrintUnformatted(q);
    cJSON *j = server_json(port, "/completion", body);
    if (out) snprintf(out, cap, "%s", json_str(j, "content"));
    const long long pn = json_int(cJSON_GetObjectItem(j, "timings"), "prompt_n");
    cJSON_Delete(j), cJSON_Delete(q);
    free(body);
    return pn;
}

/* The control for the door's sliding-window layout, in slot 0 of llama-server: it computes the prefix
 * the door restored (its own rows), saves it and computes the whole prompt with that prefix held in
 * memory (its reply in `split`); its saved file, with the zero local cell the door adds below the
 * window cells (past the window), restored (reply in `own`). llama-server must compute only the tail both
 * times. The two replies need not agree: ggml's sums group a row's elements by their cell index, and
 * the restored cells sit at other indices than those computed in place. */
static void own_rows_restored(const char *slots, int port, const char *prompt, const turn *t, uint32_t window,
                              char *split, char *own_reply, size_t cap) {
    char path[1024];
    kvb_llama_state door, own;
    kvb_err err = {0};
    snprintf(path, sizeof path, "%s/kvb-door-slot0.bin", slots);
    assert_int_equal(kvb_llama_state_load(path, &door, &err), KVB_OK);
    cJSON_Delete(server_json(port, "/slots/0?action=erase", "{}"));
    slot0_complete(port, door.tokens, door.n_tokens, NULL, 1, NULL, 0);
    cJSON_Delete(server_json(port, "/slots/0?action=save", "{\"filename\":\"own.bin\"}"));
    const long long pn_mem = slot0_complete(port, NULL, 0, prompt, N_PREDICT, split, cap);
    snprintf(path, sizeof path, "%s/own.bin", slots);
    assert_int_equal(kvb_llama_state_load(path, &own, &err), KVB_OK);
    kvb_llama_cache *c = &own.cache[1];
    assert_int_equal(own.n_cache, 2);
    const uint32_t n = door.n_tokens, own_first = n > window ? n - window : 0;
    const uint32_t extra = own_first - (n > window + 1 ? n - window - 1 : 0); /* zero cells the door adds */
    assert_int_equal(c->n_cells, n - own_first); /* llama.cpp's own: positions n - window .. n - 1 */
    assert_int_equal(c->pos[0], (int32_t)own_first);
    const size_t cells = c->n_cells + (size_t)extra;
    int32_t *pos = malloc(cells * sizeof *pos);
    uint8_t *k = calloc(c->n_layer * cells, c->k_row_bytes), *v = calloc(c->n_layer * cells, c->v_row_bytes);
    for (uint32_t i = 0; i < extra; i++) pos[i] = (int32_t)(own_first - extra + i);
    memcpy(pos + extra, c->pos, c->n_cells * sizeof *pos);
    for (uint32_t l = 0; l < c->n_layer; l++) { /* (layer, cell, row): the zero cells first in each layer */
        memcpy(k + (l * cells + extra) * c->k_row_bytes, kvb_llama_k_row(c, l, 0), c->n_cells * c->k_row_bytes);
        memcpy(v + (l * cells + extra) * c->v_row_bytes, kvb_llama_v_row(c, l, 0), c->n_cells * c->v_row_bytes);
    }
    free(c->pos), free(c->k), free(c->v);
    c->pos = pos, c->k = k, c->v = v, c->n_cells = (uint32_t)cells;
    snprintf(path, sizeof path, "%s/own-door-layout.bin", slots);
    assert_int_equal(kvb_llama_state_save(&own, path, &err), KVB_OK);
    cJSON_Delete(server_json(port, "/slots/0?action=erase", "{}"));
    cJSON_Delete(server_json(port, "/slots/0?action=restore", "{\"filename\":\"own-door-layout.bin\"}"));
    const long long pn = slot0_complete(port, NULL, 0, prompt, N_PREDICT, own_reply, cap);
    print_message("  llama-server's own rows for the first %u tokens: it then computed %lld prompt tokens with them "
                  "in memory, %lld restored in the door's layout\n", door.n_tokens, pn_mem, pn);
    assert_int_equal(pn_mem, t->prompt - door.n_tokens);
    assert_int_equal(pn, t->prompt - door.n_tokens);
    kvb_llama_state_free(&own);
    kvb_llama_state_free(&door);
}

/* The number of leading bytes two replies share. */
static size_t common_chars(const char *a, const char *b) {
    size_t i = 0;
    while (a[i] && a[i] == b[i]) i++;
    return i;
}

/* The real Gemma 3 270M (sliding-window layers: two caches in llama.cpp's file) through the door,
 * llama-server as it runs by default (no --swa-full). A first turn shorter than the window is
 * declined before anything is asked (llama-server would recompute such a restored prefix); the
 * conversation then grows past the window: two turns, each shipping only its increment, llama-server
 * computing only the tail, the file holding the global layers' every cell and the local layers' last
 * window + 1, bit for bit kvbridge's rows. Greedy replies are printed, not asserted: on this model
 * llama-server's own reply changes with how its cache came about (computed in one batch, a prefix
 * then the tail, restored from a file: ggml's sums group elements by batch and cell index), and
 * kvbridge's rows are not ggml's (f32 against Q8_K-rounded activations), so the first bridged reply
 * is set beside llama-server's alone, its split in memory and its own rows restored in the door's
 * layout (own_rows_restored, which asserts that layout reused). Then llama-server restarted with
 * flash attention refuses the door's file: that turn is `declined`, the reply llama-server's alone.
 * Last, llama-server with --swa-full: a new door's probe finds it reusing a short restored prefix,
 * and the first (short) turn is bridged. */
static void test_gemma3_conversation(void **state) {
    (void)state;
    char bin[1024], slots[512], split[4096], own[4096];
    kvbt_require_llama_server(bin, sizeof bin);
    const char *model = kvbt_require_gemma3();
    kvbt_tmp_path(slots, sizeof slots, "llama-door-gemma3-slots");
    mkdir(slots, 0755);
    rig r;
    rig_start(&r, bin, model, slots, 23000 + getpid() % 20000, 1, NULL);
    const int server_port = r.server_port;
    pid_t pid = r.server;
    kvb_err err = {0};
    kvb_llama_door *d = NULL;
    kvb_llama_door_config dc = {.http_listen = "127.0.0.1:0", .server_url = r.url, .slot_dir = slots,
                                .peer = r.peer, .psk = PSK, .model_path = model, .slots = 1, .block_tokens = BT,
                                .max_ctx = 2048};
    if (kvb_llama_door_start(&dc, &d, &err)) fail_msg("the door did not start: %s", err.msg);
    const int door_port = kvb_llama_door_port(d);
    static char conv[16384];
    static const char *const chapter[] = {
        "The prefill node sat in a rack full of graphics cards and computed long prompts for anyone who asked. ",
        "The decode node lived on a small machine in an office and wrote the answers one word at a time. ",
        "Between them ran a cable, and over that cable went the rows of a cache, block after block, checked twice. ",
        "Every block had a key made from the tokens before it, so the decoder always knew where it belonged. ",
    };
    snprintf(conv, sizeof conv, "Here is a story about two computers. %s%s", chapter[0], chapter[1]);
    turn t[4];
    run_turn(door_port, server_port, conv, &t[0]); /* under the window: declined, nothing asked */
    assert_non_null(strstr(t[0].verdict, "declined: llama-server recomputes a restored prefix of 32 tokens"));
    assert_int_equal(t[0].bridged, 0);
    assert_string_equal(t[0].text, t[0].alone);
    for (int i = 2; i < 25; i++) append(conv, sizeof conv, chapter[i % 4], "");
    run_turn(door_port, server_port, conv, &t[1]); /* past the window: bridged from nothing */
    assert_true(t[1].prompt > 545);
    expect_bridged(&t[1], 0);
    kvb_llama_state first = load_slot_file(slots, 0);
    own_rows_restored(slots, server_port, conv, &t[1], 512, split, own, sizeof own);
    print_message("  replies, characters in common with llama-server's own restored in the same layout / computed "
                  "alone / split in memory: bridged %zu/%zu/%zu of %zu; its own restored vs alone %zu, vs split %zu\n",
                  common_chars(t[1].text, own), common_chars(t[1].text, t[1].alone), common_chars(t[1].text, split),
                  strlen(t[1].text), common_chars(own, t[1].alone), common_chars(own, split));
    append(conv, sizeof conv, t[1].text, " Then the user asked what happened next, and the story went on. ");
    append(conv, sizeof conv, chapter[2], chapter[3]);
    run_turn(door_port, server_port, conv, &t[2]); /* only the increment */
    expect_bridged(&t[2], t[1].bridged);
    kvb_llama_state second = load_slot_file(slots, 0);
    kvb_model *m = NULL;
    assert_int_equal(kvb_model_load(model, &m, &err), KVB_OK);
    engine_rows e = compute_rows(m, second.tokens, second.n_tokens);
    check_slot_state(&first, m, &e, 0);
    check_slot_state(&second, m, &e, 0);
    assert_memory_equal(first.tokens, second.tokens, first.n_tokens * sizeof *first.tokens);
    kvb_model_free(m);
    free(e.k), free(e.v);
    kvb_llama_state_free(&first), kvb_llama_state_free(&second);
    pid = refused_turn(pid, bin, model, slots, 1, door_port, server_port, conv, sizeof conv, t[2].text, &t[3]);
    kvb_llama_door_stop(d);
    kill(pid, SIGTERM); /* --swa-full: the door's probe finds a short restored prefix reused, and bridges it */
    waitpid(pid, NULL, 0);
    pid = kvbt_llama_server_start(bin, model, slots, server_port, 1, "off", "--swa-full");
    if (kvb_llama_door_start(&dc, &d, &err)) fail_msg("the door did not start: %s", err.msg);
    snprintf(conv, sizeof conv, "Here is a story about two computers. %s%s", chapter[0], chapter[1]);
    run_turn(kvb_llama_door_port(d), server_port, conv, &t[0]);
    expect_bridged(&t[0], 0);
    own_rows_restored(slots, server_port, conv, &t[0], 512, split, own, sizeof own);
    print_message("  replies, characters in common with llama-server's own restored / alone / split: bridged "
                  "%zu/%zu/%zu of %zu\n", common_chars(t[0].text, own), common_chars(t[0].text, t[0].alone),
                  common_chars(t[0].text, split), strlen(t[0].text));
    kvb_llama_door_stop(d);
    kvb_prefill_node_stop(r.pn);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conversation_bridged_then_declined),
        cmocka_unit_test(test_gemma3_conversation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
