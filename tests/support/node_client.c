/* tests/support/node_client.c — see node_client.h. */
#include "node_client.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_core.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvbt.h"

kvb_decode_node *kvbt_start_decode(const char *model_path, const char *psk, const uint16_t *ports, uint32_t n_ports,
                                   const char *name, uint32_t peer_max_queue) {
    char spec[KVB_MAX_PEERS][48];
    const char *peers[KVB_MAX_PEERS];
    for (uint32_t i = 0; i < n_ports && i < KVB_MAX_PEERS; i++) {
        snprintf(spec[i], sizeof spec[i], "%c=127.0.0.1:%u", 'A' + (int)i, ports[i]);
        peers[i] = spec[i];
    }
    kvb_decode_config c = {.http_listen = "127.0.0.1:0", .peers = peers, .n_peers = n_ports, .name = name,
                           .peer_max_queue = peer_max_queue, .model_path = model_path, .psk = psk, .n_threads = 1,
                           .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096,
                           .peer_timeout_ms = 10000};
    kvb_decode_node *n = NULL;
    kvb_err err = {0};
    if (kvb_decode_node_start(&c, &n, &err)) fail_msg("decode node: %s", err.msg);
    return n;
}

void kvbt_complete_ids(uint16_t port, const int32_t *ids, int n, kvbt_reply *r) {
    kvbt_complete_ids_n(port, ids, n, 8, r);
}

char *kvbt_completion_json(const int32_t *ids, int n, int max_tokens, bool ignore_eos) {
    cJSON *req = cJSON_CreateObject();
    cJSON_AddStringToObject(req, "model", "m");
    cJSON_AddItemToObject(req, "prompt", cJSON_CreateIntArray(ids, n));
    cJSON_AddNumberToObject(req, "max_tokens", max_tokens);
    if (ignore_eos) cJSON_AddBoolToObject(req, "ignore_eos", true);
    cJSON_AddNumberToObject(req, "temperature", 0);
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    assert_non_null(body);
    return body;
}

void kvbt_post_ids(uint16_t port, const int32_t *ids, int n, int max_tokens, bool ignore_eos, kvb_http_reply *h) {
    char *body = kvbt_completion_json(ids, n, max_tokens, ignore_eos);
    kvb_err err = {0};
    assert_int_equal(kvb_http_post("127.0.0.1", port, "/v1/completions", body, 120000, h, &err), KVB_OK);
    free(body);
}

static void complete_ids(uint16_t port, const int32_t *ids, int n, int max_tokens, bool ignore_eos, kvbt_reply *r) {
    kvb_http_reply h;
    kvbt_post_ids(port, ids, n, max_tokens, ignore_eos, &h);
    if (h.status != 200) fail_msg("HTTP %d: %s", h.status, h.body);
    cJSON *root = cJSON_Parse(h.body);
    cJSON *kb = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "usage"), "kvbridge");
    assert_non_null(kb);
    snprintf(r->verdict, sizeof r->verdict, "%s", h.verdict);
    assert_string_equal(cJSON_GetObjectItem(kb, "verdict")->valuestring, h.verdict);
    r->prompt = (int)cJSON_GetObjectItem(cJSON_GetObjectItem(root, "usage"), "prompt_tokens")->valuedouble;
    r->cached = (int)cJSON_GetObjectItem(kb, "cached_tokens")->valuedouble;
    r->bridged = (int)cJSON_GetObjectItem(kb, "bridged_tokens")->valuedouble;
    r->native = (int)cJSON_GetObjectItem(kb, "native_tokens")->valuedouble;
    r->pipelined = cJSON_IsTrue(cJSON_GetObjectItem(kb, "native_pipelined"));
    r->attempts = (int)cJSON_GetObjectItem(kb, "bridge_attempts")->valuedouble;
    snprintf(r->faults, sizeof r->faults, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(kb, "bridge_faults")));
    snprintf(r->peer, sizeof r->peer, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(kb, "peer")));
    snprintf(r->placement, sizeof r->placement, "%s", cJSON_GetStringValue(cJSON_GetObjectItem(kb, "placement")));
    cJSON *text = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0), "text");
    r->completion = (int)cJSON_GetObjectItem(cJSON_GetObjectItem(root, "usage"), "completion_tokens")->valuedouble;
    r->content = strdup(text->valuestring);
    cJSON_Delete(root);
    kvb_http_reply_free(&h);
    assert_int_equal(r->cached + r->bridged + r->native, r->prompt);
}

void kvbt_complete_ids_n(uint16_t port, const int32_t *ids, int n, int max_tokens, kvbt_reply *r) {
    complete_ids(port, ids, n, max_tokens, false, r);
}

void kvbt_complete_ids_all(uint16_t port, const int32_t *ids, int n, int tokens, kvbt_reply *r) {
    complete_ids(port, ids, n, tokens, true, r);
}

void kvbt_prompt_ids(int32_t *ids, int n, uint64_t seed) {
    kvb_rng r;
    kvb_rng_seed(&r, seed);
    for (int i = 0; i < n; i++) ids[i] = 3 + (int32_t)(kvb_rng_u64(&r) % 250);
}

double kvbt_metric(uint16_t port, const char *series) {
    char cmd[256], out[65536];
    snprintf(cmd, sizeof cmd, "curl -s http://127.0.0.1:%u/metrics", port);
    if (kvbt_sh(cmd, out, sizeof out, 0) != 0) return -1;
    for (const char *p = out; (p = strstr(p, series)) != NULL; p++)
        if (p == out || p[-1] == '\n') return atof(p + strlen(series)); /* a sample line, not # HELP */
    return 0;
}
