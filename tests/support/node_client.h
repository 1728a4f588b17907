/* tests/support/node_client.h — a test's side of the closed loop: one /v1/completions request of
 * token ids to a decode node with the reply's verdict and token counts (usage.kvbridge), a
 * deterministic prompt, and one sample of a decode node's /metrics. Shared by the CPU and GPU
 * closed-loop tests; failures are cmocka failures. */
#ifndef KVBT_NODE_CLIENT_H
#define KVBT_NODE_CLIENT_H

#include <stdbool.h>
#include <stdint.h>

#include "kvb_node.h" /* kvb_http_reply */

typedef struct {
    char verdict[160];
    int prompt, cached, bridged, native;
    int completion; /* usage.completion_tokens */
    bool pipelined; /* usage.kvbridge.native_pipelined */
    int attempts;   /* usage.kvbridge.bridge_attempts */
    char faults[400]; /* usage.kvbridge.bridge_faults */
    char peer[128];   /* usage.kvbridge.peer: the prefill node(s) that bridged ("A", "A then B") */
    char placement[16]; /* usage.kvbridge.placement: history, new, moved, or "" */
    char *content;  /* the completion's text (malloc'd: the caller frees it) */
} kvbt_reply;

/* One completion of ids[0 .. n) (greedy, 8 tokens at most) from the decode node on port; fails
 * the test unless the reply is HTTP 200 with X-KVBridge equal to usage.kvbridge.verdict and
 * cached + bridged + native == prompt tokens. */
void kvbt_complete_ids(uint16_t port, const int32_t *ids, int n, kvbt_reply *r);
/* The same with max_tokens tokens at most. */
void kvbt_complete_ids_n(uint16_t port, const int32_t *ids, int n, int max_tokens, kvbt_reply *r);
/* The same with exactly `tokens` tokens (ignore_eos), unless the context ends first. */
void kvbt_complete_ids_all(uint16_t port, const int32_t *ids, int n, int tokens, kvbt_reply *r);
/* The body of such a request (greedy), malloc'd: the caller frees it. */
char *kvbt_completion_json(const int32_t *ids, int n, int max_tokens, bool ignore_eos);
/* The same request (greedy), any answer: the reply as it came (free it with kvb_http_reply_free). */
void kvbt_post_ids(uint16_t port, const int32_t *ids, int n, int max_tokens, bool ignore_eos, kvb_http_reply *h);
/* A decode node on loopback for the fleet tests: model_path, key psk, prefill nodes A, B, ... on
 * ports[0 .. n_ports) (none: the native reference), one CPU thread, an f16 cache of 32-token blocks,
 * 4096 tokens of context; name and peer_max_queue as in kvb_decode_config (NULL, 0: the defaults). */
kvb_decode_node *kvbt_start_decode(const char *model_path, const char *psk, const uint16_t *ports, uint32_t n_ports,
                                   const char *name, uint32_t peer_max_queue);
/* ids[0 .. n) = token ids 3 .. 252 from seed. */
void kvbt_prompt_ids(int32_t *ids, int n, uint64_t seed);
/* The value of the sample line of /metrics that starts with series ("name{labels} "), 0 when
 * absent, -1 when /metrics could not be read. */
double kvbt_metric(uint16_t port, const char *series);

#endif
