/* tests/test_http_web.c — the decode node's chat page and its status snapshot: every file of web/
 * is compiled in and served at /NAME ("/" is index.html) byte for byte as on disk, with its
 * Content-Type, Cache-Control, the strict Content-Security-Policy and nosniff; the page loads
 * nothing from another origin and has no inline script; unknown files are 404s, other methods 405;
 * the page is open under --api-key while /v1/kvbridge/status needs the key; and the snapshot of a
 * bridge in flight (a prefill node that pauses 2 s before its 20th slab) shows exactly the slabs
 * that arrived, layer by layer, then the link's bytes and the bridged tokens once it is done. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <cJSON.h>
#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "http_internal.h"
#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvbt.h"
#include "node_client.h"

#define PSK "web-test-psk-0123456789"
#define API_KEY "web-test-key-123"

static char g_model[512];
static kvb_prefill_node *g_pn;
static kvb_decode_node *g_keyed, *g_bridged; /* with --api-key and no peer; no key, bridged to g_pn */

typedef struct {
    int status;
    char headers[4096]; /* the response's header lines */
    char *body;
    size_t body_len;
} get_reply;

/* One request (method, path, an optional bearer key) over a fresh connection, read to its close. */
static void http_get(uint16_t port, const char *method, const char *path, const char *key, get_reply *r) {
    char p[16], req[512];
    snprintf(p, sizeof p, "%u", port);
    const int fd = kvb_tcp_dial("127.0.0.1", p);
    assert_true(fd >= 0);
    int n = snprintf(req, sizeof req, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s%s%s\r\n", method,
                     path, key ? "Authorization: Bearer " : "", key ? key : "", key ? "\r\n" : "");
    assert_int_equal(write(fd, req, (size_t)n), n);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (ssize_t k; (k = read(fd, buf + len, cap - len - 1)) > 0;) {
        len += (size_t)k;
        if (len + 1 == cap) buf = realloc(buf, cap *= 2);
    }
    close(fd);
    buf[len] = 0;
    char *end = strstr(buf, "\r\n\r\n");
    assert_non_null(end);
    assert_true(sscanf(buf, "HTTP/1.1 %d", &r->status) == 1);
    snprintf(r->headers, sizeof r->headers, "%.*s", (int)(end - buf), buf);
    r->body_len = len - (size_t)(end + 4 - buf);
    r->body = malloc(r->body_len + 1);
    memcpy(r->body, end + 4, r->body_len + 1);
    free(buf);
}

/* The value of header `name` (case-insensitive) in r, or "" (a static buffer). */
static const char *header(const get_reply *r, const char *name) {
    static char v[1024];
    v[0] = 0;
    const size_t n = strlen(name);
    for (const char *l = strstr(r->headers, "\r\n"); l; l = strstr(l + 2, "\r\n"))
        if (strncasecmp(l + 2, name, n) == 0 && l[2 + n] == ':') {
            const char *s = l + 3 + n, *e = strstr(s, "\r\n");
            while (*s == ' ') s++;
            snprintf(v, sizeof v, "%.*s", (int)(e ? e - s : (long)strlen(s)), s);
            break;
        }
    return v;
}

/* web/NAME from the source tree, malloc'd; *len its length. */
static char *source_file(const char *name, size_t *len) {
    char path[1024];
    const char *src = getenv("KVB_SOURCE_DIR");
    snprintf(path, sizeof path, "%s/web/%s", src ? src : ".", name);
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s (KVB_SOURCE_DIR)", path);
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc(*len + 1);
    assert_int_equal(fread(b, 1, *len, f), *len);
    fclose(f);
    return b;
}

static int setup(void **state) {
    (void)state;
    kvbt_tmp_path(g_model, sizeof g_model, "tiny.gguf");
    kvb_gen_opts o = {.preset = "tiny", .type = KVB_TYPE_Q8_0, .seed = 21, .n_threads = 2};
    kvb_err err = {0};
    if (kvb_gen_model(&o, g_model, &err)) return fprintf(stderr, "gen-model: %s\n", err.msg), -1;
    kvb_prefill_config pc = {.listen = "127.0.0.1:0", .model_path = g_model, .psk = PSK, .n_threads = 1,
                             .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096, .fault = "pause:20"};
    if (kvb_prefill_node_start(&pc, &g_pn, &err)) return fprintf(stderr, "prefill node: %s\n", err.msg), -1;
    char peer[32];
    snprintf(peer, sizeof peer, "127.0.0.1:%u", kvb_prefill_node_port(g_pn));
    kvb_decode_config dc = {.http_listen = "127.0.0.1:0", .model_path = g_model, .psk = PSK, .n_threads = 1,
                            .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096, .api_key = API_KEY};
    if (kvb_decode_node_start(&dc, &g_keyed, &err)) return fprintf(stderr, "decode node: %s\n", err.msg), -1;
    dc.api_key = NULL;
    dc.peer = peer;
    if (kvb_decode_node_start(&dc, &g_bridged, &err)) return fprintf(stderr, "decode node: %s\n", err.msg), -1;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    kvb_decode_node_stop(g_bridged);
    kvb_decode_node_stop(g_keyed);
    kvb_prefill_node_stop(g_pn);
    return 0;
}

/* Every file of web/ (html, js, css, svg) is in the table, and each is served byte for byte. */
static void test_files_served_as_on_disk(void **state) {
    (void)state;
    const char *src = getenv("KVB_SOURCE_DIR");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/web", src ? src : ".");
    DIR *d = opendir(dir);
    assert_non_null(d);
    size_t on_disk = 0;
    for (struct dirent *e; (e = readdir(d));) {
        const char *dot = strrchr(e->d_name, '.');
        if (!dot || (strcmp(dot, ".html") && strcmp(dot, ".js") && strcmp(dot, ".css") && strcmp(dot, ".svg"))) continue;
        on_disk++;
        char url[300];
        snprintf(url, sizeof url, "/%s", e->d_name);
        const http_web_asset *a = http_web_find(url);
        if (!a) fail_msg("web/%s is not compiled in", e->d_name);
        size_t len;
        char *want = source_file(e->d_name, &len);
        get_reply r;
        http_get(kvb_decode_node_port(g_keyed), "GET", url, NULL, &r); /* no key: the page is open */
        assert_int_equal(r.status, 200);
        assert_int_equal(r.body_len, len);
        assert_memory_equal(r.body, want, len);
        assert_int_equal(a->len, len);
        assert_memory_equal(a->data, want, len);
        assert_string_equal(header(&r, "Content-Type"), http_web_content_type(e->d_name));
        assert_string_equal(header(&r, "Content-Security-Policy"), HTTP_WEB_CSP);
        assert_string_equal(header(&r, "Cache-Control"), "no-cache");
        assert_string_equal(header(&r, "X-Content-Type-Options"), "nosniff");
        free(want);
        free(r.body);
    }
    closedir(d);
    assert_int_equal(on_disk, http_web_n_assets);
    assert_true(on_disk >= 4);
    assert_string_equal(http_web_content_type("index.html"), "text/html; charset=utf-8");
    assert_string_equal(http_web_content_type("app.js"), "text/javascript; charset=utf-8");
    /* "/" is index.html */
    get_reply r;
    http_get(kvb_decode_node_port(g_keyed), "GET", "/", NULL, &r);
    assert_int_equal(r.status, 200);
    const http_web_asset *index = http_web_find("/index.html");
    assert_non_null(index);
    assert_int_equal(r.body_len, index->len);
    assert_memory_equal(r.body, index->data, index->len);
    free(r.body);
}

/* Nothing from another origin (no CDN, no external font), and no inline script: every <script>
 * names a file of the page's own, which the CSP's script-src 'self' then allows. */
static void test_page_self_contained(void **state) {
    (void)state;
    for (size_t i = 0; i < http_web_n_assets; i++) {
        const char *t = (const char *)http_web_assets[i].data;
        for (const char *p = t; (p = strstr(p, "http")) != NULL; p++) {
            if (strncmp(p, "https://", 8) && strncmp(p, "http://", 7)) continue;
            if (strncmp(p, "http://www.w3.org/2000/svg", 26))
                fail_msg("%s names another origin: %.60s", http_web_assets[i].name, p);
        }
        assert_null(strstr(t, "@import"));
        assert_null(strstr(t, "url("));
    }
    const char *html = (const char *)http_web_find("/")->data;
    size_t scripts = 0;
    for (const char *p = html; (p = strstr(p, "<script")) != NULL; p++) {
        char src[64];
        if (sscanf(p, "<script src=\"%63[^\"]\"", src) != 1) fail_msg("an inline script: %.60s", p);
        if (!http_web_find(src)) fail_msg("script %s is not a file of the page", src);
        assert_non_null(strstr(p, "</script>"));
        scripts++;
    }
    assert_true(scripts >= 1);
    for (const char *p = html; (p = strstr(p, " on")) != NULL; p++) { /* no inline handlers (onclick=...) */
        size_t k = 3;
        while (p[k] >= 'a' && p[k] <= 'z') k++;
        if (p[k] == '=') fail_msg("an inline event handler: %.40s", p);
    }
}

static void test_refusals(void **state) {
    (void)state;
    const uint16_t port = kvb_decode_node_port(g_keyed);
    static const struct {
        const char *method, *path;
        int status;
    } cases[] = {
        {"GET", "/missing.js", 404}, {"GET", "/web/app.js", 404}, {"GET", "/app.js/", 404},
        {"POST", "/", 405},          {"DELETE", "/app.js", 405},  {"GET", "/v1/kvbridge/status", 401},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        get_reply r;
        http_get(port, cases[i].method, cases[i].path, NULL, &r);
        if (r.status != cases[i].status)
            fail_msg("%s %s: %d, expected %d", cases[i].method, cases[i].path, r.status, cases[i].status);
        assert_non_null(strstr(header(&r, "Content-Type"), "application/json"));
        free(r.body);
    }
    get_reply r;
    http_get(port, "GET", "/v1/kvbridge/status", "wrong-key-0000", &r);
    assert_int_equal(r.status, 401);
    free(r.body);
    http_get(port, "HEAD", "/", NULL, &r);
    assert_int_equal(r.status, 200);
    assert_int_equal(r.body_len, 0);
    free(r.body);
}

/* GET /v1/kvbridge/status with the key: the snapshot's shape on a node without a peer. */
static void test_status_with_key(void **state) {
    (void)state;
    get_reply r;
    http_get(kvb_decode_node_port(g_keyed), "GET", "/v1/kvbridge/status", API_KEY, &r);
    assert_int_equal(r.status, 200);
    assert_string_equal(header(&r, "Cache-Control"), "no-store");
    cJSON *s = cJSON_Parse(r.body);
    assert_non_null(s);
    assert_string_equal(cJSON_GetObjectItem(s, "object")->valuestring, "kvbridge.status");
    assert_string_equal(cJSON_GetObjectItem(s, "model")->valuestring, "tiny.gguf");
    assert_string_equal(cJSON_GetObjectItem(s, "status")->valuestring, "ok");
    assert_true(cJSON_GetObjectItem(s, "uptime_s")->valuedouble > 0);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(s, "peer"), "state")->valuestring, "none");
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(s, "bridges")), 0);
    cJSON *cache = cJSON_GetObjectItem(s, "cache");
    assert_int_equal(cJSON_GetObjectItem(cache, "block_tokens")->valueint, 32);
    assert_true(cJSON_GetObjectItem(cache, "blocks")->valueint > 0);
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(s, "requests"), "parallel")->valueint, 4);
    cJSON_Delete(s);
    free(r.body);
}

typedef struct {
    uint16_t port;
    kvb_http_reply reply;
    kvb_status st;
} post_job;

static void *post_600(void *arg) {
    post_job *j = arg;
    int32_t ids[600];
    kvbt_prompt_ids(ids, 600, 5);
    char *body = kvbt_completion_json(ids, 600, 1, false);
    kvb_err err = {0};
    j->st = kvb_http_post("127.0.0.1", j->port, "/v1/completions", body, 30000, &j->reply, &err);
    free(body);
    return NULL;
}

static cJSON *status_of(uint16_t port) {
    get_reply r;
    http_get(port, "GET", "/v1/kvbridge/status", NULL, &r);
    assert_int_equal(r.status, 200);
    cJSON *s = cJSON_Parse(r.body);
    free(r.body);
    assert_non_null(s);
    return s;
}

/* The bridge in flight in the snapshot, once it holds still (the same slabs 300 ms apart: the
 * prefill node's pause), or NULL. */
static cJSON *bridge_paused(uint16_t port) {
    int last = -1;
    for (int i = 0; i < 100; i++) { /* the pause lasts 2 s */
        cJSON *s = status_of(port);
        cJSON *b = cJSON_GetArrayItem(cJSON_GetObjectItem(s, "bridges"), 0);
        const int slabs = b ? cJSON_GetObjectItem(b, "slabs")->valueint : -1;
        if (slabs > 0 && slabs == last) {
            cJSON *out = cJSON_Duplicate(b, true);
            cJSON_Delete(s);
            return out;
        }
        last = slabs;
        cJSON_Delete(s);
        usleep(slabs > 0 ? 300000 : 10000);
    }
    return NULL;
}

/* A 600-token prompt ships blocks 0..17 and a 23-token tail (599 tokens) of each of the 4 layers of
 * tiny: 76 slabs, each one block of one layer, 512 bytes per token (2 KV heads x 64 dims x K and V
 * x 2 bytes, f16). The prefill node pauses 2 s at its 20th slab; meanwhile the snapshot shows the
 * bridge part way, and what it shows adds up: each layer's share is whole blocks (or the tail) of
 * the 599 tokens, the bytes are those tokens' rows, a complete layer is counted as one. */
static void test_status_bridge_in_flight(void **state) {
    (void)state;
    const uint16_t port = kvb_decode_node_port(g_bridged);
    cJSON *s = status_of(port);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(s, "peer"), "state")->valuestring, "up");
    cJSON_Delete(s);
    post_job j = {.port = port};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, post_600, &j), 0);
    cJSON *b = bridge_paused(port);
    assert_non_null(b);
    char *shown = cJSON_PrintUnformatted(b);
    printf("in flight: %s\n", shown);
    free(shown);
    assert_int_equal(cJSON_GetObjectItem(b, "prompt_tokens")->valueint, 600);
    assert_int_equal(cJSON_GetObjectItem(b, "cached_tokens")->valueint, 0);
    assert_int_equal(cJSON_GetObjectItem(b, "ship_tokens")->valueint, 599);
    const int slabs = cJSON_GetObjectItem(b, "slabs")->valueint;
    assert_true(slabs > 0 && slabs < 76);
    cJSON *layers = cJSON_GetObjectItem(b, "layers");
    assert_int_equal(cJSON_GetArraySize(layers), 4);
    int tokens = 0, complete = 0; /* token rows arrived, over the layers */
    for (int l = 0; l < 4; l++) {
        const double f = cJSON_GetArrayItem(layers, l)->valuedouble;
        const int k = (int)(f * 599 + 0.5);
        assert_true(f == k / 599.0);            /* the share is whole token rows of the 599 */
        assert_true(k % 32 == 0 || k % 32 == 23); /* whole blocks, or with the tail */
        tokens += k;
        complete += k == 599;
    }
    assert_true(tokens > 0 && tokens < 4 * 599);
    assert_int_equal(cJSON_GetObjectItem(b, "layers_complete")->valueint, complete);
    const double bytes_in_flight = cJSON_GetObjectItem(b, "bytes")->valuedouble;
    assert_true(bytes_in_flight == 512.0 * tokens);
    cJSON_Delete(b);
    pthread_join(t, NULL);
    assert_int_equal(j.st, KVB_OK);
    assert_int_equal(j.reply.status, 200);
    assert_string_equal(j.reply.verdict, "complete");
    kvb_http_reply_free(&j.reply);
    /* done: no bridge in flight, the link's bytes are all 76 slabs', the tokens bridged */
    s = status_of(port);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(s, "bridges")), 0);
    const double total = cJSON_GetObjectItem(cJSON_GetObjectItem(s, "link"), "bytes_total")->valuedouble;
    assert_true(total == kvbt_metric(port, "kvbridge_slab_bytes_total "));
    assert_true(total == 512.0 * 599 * 4);
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(s, "prompt_tokens"), "bridged")->valueint, 599);
    cJSON_Delete(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_files_served_as_on_disk),
        cmocka_unit_test(test_page_self_contained),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_status_with_key),
        cmocka_unit_test(test_status_bridge_in_flight),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
