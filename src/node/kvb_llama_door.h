/* node/kvb_llama_door.h — the front door for a stock llama-server as the decoder: an OpenAI API
 * (kvb_http) in front of an unmodified llama-server run with --slot-save-path on the same host.
 * Per request it takes llama-server's own token ids (/tokenize; chat through its /apply-template),
 * maps the conversation to the slot whose held rows are the longest prefix of the prompt, asks the
 * prefill node over the peer link for only the increment (whole blocks, never the last token),
 * commits it through the one bridge receiver into a local f16 store of the model's format, appends
 * the rows to the slot's copy in memory, writes llama.cpp's slot file (foreign/kvb_foreign.h),
 * restores it (POST /slots/ID?action=restore) and forwards the completion with id_slot and
 * cache_prompt. The verdict says what happened: complete (llama-server computed only the tokens
 * past the restored rows), partial (it computed more), declined: reason (no restore; llama-server
 * computed the prompt itself). A sliding-window model (Gemma 3): see llama_door.c for the cells of
 * its second cache and the prefixes it declines. Requests are served one at a time. */
#ifndef KVB_LLAMA_DOOR_H
#define KVB_LLAMA_DOOR_H

#include <stdint.h>

#include "kvb_core.h"
#include "kvb_transport.h"

#define KVB_DOOR_MAX_SLOTS 64

typedef struct {
    const char *http_listen;   /* "HOST:PORT" of the OpenAI API (port 0 = ephemeral) */
    const char *server_url;    /* llama-server: http://HOST:PORT */
    const char *slot_dir;      /* llama-server's --slot-save-path (same host) */
    const char *peer;          /* the prefill node "HOST:PORT", or NULL: llama-server always computes */
    const char *psk;
    const struct kvb_wire_backend *backend; /* NULL: TCP */
    const char *model_path;    /* the GGUF llama-server runs */
    const char *model_id;      /* NULL: the file's base name */
    uint32_t slots;            /* llama-server's -np (default 1, at most KVB_DOOR_MAX_SLOTS) */
    uint32_t block_tokens;     /* default 32: the prefill node's too */
    uint32_t max_ctx;          /* default min(training context, 32768) */
    uint32_t default_max_tokens; /* default 256 */
    int peer_timeout_ms;       /* per frame (default 10000) */
    uint32_t lanes;            /* connections to the prefill node (default 1) */
} kvb_llama_door_config;

typedef struct kvb_llama_door kvb_llama_door;
/* Loads the model's description, probes llama-server's slot file (a short prompt computed in slot 0
 * and saved: its version, caches, streams, V layout and dtypes must be what this build writes: f16,
 * one cache, or the global and the sliding-window layers' for a model with local layers, whose probe
 * file is then restored to learn whether llama-server reuses a prefix under its window, as with
 * --swa-full), dials the prefill node and starts the API. */
kvb_status kvb_llama_door_start(const kvb_llama_door_config *cfg, kvb_llama_door **out, kvb_err *err);
uint16_t kvb_llama_door_port(const kvb_llama_door *d);
void kvb_llama_door_stop(kvb_llama_door *d);

#endif
