/* node/llama_door.c — the front door for a stock llama-server (kvb_llama_door.h): per request its
 * token ids, a slot for the conversation, the increment bridged from the prefill node into a local
 * store, the slot's rows restored into llama-server as its own slot file, the completion forwarded
 * and its reply streamed back through the http module as llama-server produces it (door_stream.c),
 * the verdict settled before the first delta, usage.kvbridge at the end. The slot
 * rows are kept here per slot as (token, layer, n_head_kv * head_dim f16) and appended each turn,
 * so a turn ships only its new blocks over the link; restoring costs a local file write and read.
 * A model with sliding-window layers (Gemma 3) is two caches in llama.cpp's file: the global
 * layers' every cell, then the local layers' last cells. The bridge ships local rows only for the
 * window - 1 positions the next query reads (kvb_kvformat_local_keep_from), so each slot tracks
 * from where its local rows are real (local_lo). llama.cpp's own file keeps window cells there
 * (positions past pos_max - window); this build's server reuses a restored slot only when its
 * lowest sliding-window cell lies below n - window (else it recomputes the prompt, having no
 * checkpoint), so the door writes window + 1 cells: the ones below local_lo are zero rows, which
 * no later position attends (a query at p >= n reads keys past p - window only). A prefix of at
 * most window tokens cannot meet that rule; unless the probe finds llama-server reusing such a
 * restored prefix (--swa-full), such a turn is declined without asking the prefill node. */
#include <cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_bridge.h"
#include "kvb_engine_cpu.h"
#include "kvb_foreign.h"
#include "kvb_http.h"
#include "kvb_llama_door.h"
#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvb_store.h"
#include "kvb_transport.h"
#include "node_internal.h"

#define DOOR_HTTP_TIMEOUT_MS 600000
#define DOOR_DIAL_TIMEOUT_MS 5000
#define PROBE_FILE "kvb-door-probe.bin"

/* One llama-server slot as this door last restored it: the rows of its first n prompt tokens. */
typedef struct {
    int32_t *toks;  /* (cap) */
    uint8_t *k, *v; /* (cap, layer, row) */
    uint32_t n, cap;
    uint64_t used;  /* the request count when it last served (least recently used is reused first) */
    uint32_t local_lo; /* local (sliding-window) layers: rows are kvbridge's from this position on */
} door_slot;

struct kvb_llama_door {
    kvb_llama_door_config cfg;
    char host[256];
    uint16_t port;
    char *model_id, *psk, *peer;
    kvb_model *m;
    kvb_kvformat fmt;  /* the model's format in f16: the prefill node's HELLO must match it */
    kvb_store *store;  /* where the receiver commits the increment before it is copied to a slot */
    size_t row;        /* bytes of one token's row in one layer: n_head_kv * head_dim f16 */
    uint32_t n_cache;  /* llama.cpp's caches in the file: 1, or 2 (global, local) with local layers */
    uint32_t n_layers[KVB_LLAMA_MAX_CACHES], *layers[KVB_LLAMA_MAX_CACHES]; /* each cache's model layers */
    uint32_t window;   /* local layers' window (0: none) */
    bool short_reuse;  /* llama-server reuses a restored prefix of at most window tokens (--swa-full) */
    kvb_llama_cache probe[KVB_LLAMA_MAX_CACHES]; /* the layout llama-server's own slot file has (no rows) */
    kvb_peer_link *link;
    kvb_hello hello;
    kvb_transport_config tcfg;
    uint64_t next_request_id, requests;
    door_slot slot[KVB_DOOR_MAX_SLOTS];
    pthread_mutex_t mu; /* one request at a time: the slots, the store and the link's lanes */
    kvb_http_server *http;
};

/* ---- llama-server's HTTP API -------------------------------------------------------------------- */

static bool parse_server_url(const char *url, char *host, size_t cap, uint16_t *port) {
    if (!strncmp(url, "http://", 7)) url += 7;
    const char *colon = strrchr(url, ':');
    if (!colon || colon == url || (size_t)(colon - url) >= cap) return false;
    char *end;
    const long p = strtol(colon + 1, &end, 10);
    if (p <= 0 || p > 65535 || (*end && strcmp(end, "/"))) return false;
    memcpy(host, url, (size_t)(colon - url));
    host[colon - url] = 0;
    *port = (uint16_t)p;
    return true;
}

/* POSTs the JSON object req (deleted here) to path: the parsed 200 reply (caller deletes), or NULL
 * with err saying what llama-server answered. */
static cJSON *server_post(kvb_llama_door *d, const char *path, cJSON *req, kvb_err *err) {
    char *body = req ? cJSON_PrintUnformatted(req) : strdup("{}");
    cJSON_Delete(req);
    if (!body) {
        kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        return NULL;
    }
    kvb_http_reply r = {0};
    cJSON *j = NULL;
    if (!kvb_http_post(d->host, d->port, path, body, DOOR_HTTP_TIMEOUT_MS, &r, err)) {
        j = r.status == 200 ? cJSON_Parse(r.body) : NULL;
        if (!j) kvb_err_set(err, KVB_ERR_REFUSED, "llama-server %s: HTTP %d: %.200s", path, r.status, r.body ? r.body : "");
    }
    kvb_http_reply_free(&r);
    free(body);
    return j;
}

/* llama-server's ids for text, special tokens added and parsed as its completion endpoints do. */
static kvb_status server_tokenize(kvb_llama_door *d, const char *text, int32_t **ids, uint32_t *n, kvb_err *err) {
    cJSON *req = cJSON_CreateObject();
    cJSON_AddStringToObject(req, "content", text);
    cJSON_AddBoolToObject(req, "add_special", 1);
    cJSON_AddBoolToObject(req, "parse_special", 1);
    cJSON *rep = server_post(d, "/tokenize", req, err);
    const cJSON *toks = rep ? cJSON_GetObjectItem(rep, "tokens") : NULL;
    const int nt = cJSON_IsArray(toks) ? cJSON_GetArraySize(toks) : -1;
    kvb_status st = rep ? KVB_OK : err->code;
    *n = 0;
    *ids = NULL;
    if (!st && nt < 1) st = kvb_err_set(err, KVB_ERR_FORMAT, "llama-server's /tokenize gave no tokens");
    if (!st && !(*ids = malloc((size_t)nt * sizeof **ids))) st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    for (int i = 0; !st && i < nt; i++) {
        const cJSON *t = cJSON_GetArrayItem(toks, i);
        if (!cJSON_IsNumber(t) || t->valuedouble < 0 || t->valuedouble >= d->m->d.n_vocab)
            st = kvb_err_set(err, KVB_ERR_FORMAT, "llama-server's /tokenize: token %d is not in the vocabulary", i);
        else (*ids)[(*n)++] = (int32_t)t->valuedouble;
    }
    cJSON_Delete(rep);
    return st;
}

/* The prompt's ids: given, or the text tokenized, or the messages through llama-server's own chat
 * template (/apply-template). 0, or an HTTP status with e filled. */
static int prompt_ids(kvb_llama_door *d, const kvb_completion_req *req, int32_t **ids, uint32_t *n, kvb_http_error *e) {
    kvb_err err = {0};
    if (req->prompt_tokens) {
        *ids = malloc(req->n_prompt_tokens * sizeof **ids);
        if (!*ids) return kvb_http_error_set(e, 500, NULL, NULL, "out of memory"), 500;
        for (size_t i = 0; i < req->n_prompt_tokens; i++) {
            if (req->prompt_tokens[i] >= (int32_t)d->m->d.n_vocab) {
                free(*ids);
                return kvb_http_error_set(e, 400, NULL, "prompt", "token %d is not in the vocabulary",
                                          req->prompt_tokens[i]), 400;
            }
            (*ids)[i] = req->prompt_tokens[i];
        }
        *n = (uint32_t)req->n_prompt_tokens;
        return 0;
    }
    char *text = NULL;
    cJSON *rep = NULL;
    if (req->api == KVB_API_CHAT_COMPLETIONS) {
        cJSON *q = cJSON_CreateObject(), *msgs = cJSON_AddArrayToObject(q, "messages");
        for (size_t i = 0; i < req->n_messages; i++) {
            cJSON *mo = cJSON_CreateObject();
            cJSON_AddStringToObject(mo, "role", req->messages[i].role);
            cJSON_AddStringToObject(mo, "content", req->messages[i].content);
            cJSON_AddItemToArray(msgs, mo);
        }
        rep = server_post(d, "/apply-template", q, &err);
        const cJSON *p = rep ? cJSON_GetObjectItem(rep, "prompt") : NULL;
        if (!cJSON_IsString(p)) {
            cJSON_Delete(rep);
            kvb_http_error_set(e, 400, "chat_unsupported", "messages", "chat needs llama-server's /apply-template, "
                               "which this llama-server refused (%.160s); use /v1/completions", err.msg);
            return 400;
        }
        text = p->valuestring;
    }
    const kvb_status st = server_tokenize(d, text ? text : req->prompt, ids, n, &err);
    cJSON_Delete(rep);
    if (st) return kvb_http_error_set(e, 502, NULL, NULL, "%s", err.msg), 502;
    return 0;
}

/* POST /slots/ID?action=ACTION (with the file name for save and restore). */
static kvb_status slot_action(kvb_llama_door *d, uint32_t slot, const char *action, const char *file, cJSON **rep,
                              kvb_err *err) {
    char path[96];
    snprintf(path, sizeof path, "/slots/%u?action=%s", slot, action);
    cJSON *req = cJSON_CreateObject();
    if (file) cJSON_AddStringToObject(req, "filename", file);
    cJSON *r = server_post(d, path, req, err);
    if (rep) *rep = r;
    else cJSON_Delete(r);
    return r ? KVB_OK : err->code;
}

/* ---- slots: the conversation's rows, kept here and appended each turn ------------------------------ */

static uint32_t common_prefix(const int32_t *a, uint32_t na, const int32_t *b, uint32_t nb) {
    uint32_t i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    return i;
}

/* The slot for this prompt: the one whose rows are its longest prefix, else an empty one, else the
 * least recently used; *held = its rows still valid for the prompt (whole blocks, at most cap). */
static uint32_t slot_pick(kvb_llama_door *d, const int32_t *ids, uint32_t n, uint32_t cap, uint32_t *held) {
    uint32_t best = 0, best_len = 0, empty = UINT32_MAX, lru = 0;
    for (uint32_t s = 0; s < d->cfg.slots; s++) {
        const door_slot *sl = &d->slot[s];
        const uint32_t len = common_prefix(sl->toks, sl->n, ids, n);
        if (len > best_len) best = s, best_len = len;
        if (!sl->n && empty == UINT32_MAX) empty = s;
        if (sl->used < d->slot[lru].used) lru = s;
    }
    const uint32_t bt = d->fmt.block_tokens;
    if (best_len < bt) best = empty != UINT32_MAX ? empty : lru, best_len = 0;
    *held = best_len / bt * bt < cap ? best_len / bt * bt : cap;
    /* local layers: the rows the next query reads (the bridge's rule) must be real, else start over */
    if (d->window && *held && d->slot[best].local_lo > kvb_kvformat_local_keep_from(&d->fmt, *held)) *held = 0;
    d->slot[best].n = *held;
    d->slot[best].used = ++d->requests;
    return best;
}

static kvb_status slot_reserve(kvb_llama_door *d, door_slot *sl, uint32_t n, kvb_err *err) {
    if (n <= sl->cap) return KVB_OK;
    const size_t tok_bytes = (size_t)d->m->d.n_layer * d->row;
    int32_t *t = realloc(sl->toks, n * sizeof *t);
    if (t) sl->toks = t;
    uint8_t *k = t ? realloc(sl->k, n * tok_bytes) : NULL;
    if (k) sl->k = k;
    uint8_t *v = k ? realloc(sl->v, n * tok_bytes) : NULL;
    if (!v) return kvb_err_set(err, KVB_ERR_NOMEM, "slot rows for %u tokens", n);
    sl->v = v;
    sl->cap = n;
    return KVB_OK;
}

/* Appends the committed blocks the receiver assembled (tokens [sl->n, to)) to the slot's rows. */
static kvb_status slot_append(kvb_llama_door *d, door_slot *sl, const kvb_bridge_receiver *r, const int32_t *ids,
                              uint32_t to, kvb_err *err) {
    uint32_t np = 0;
    kvb_slab_pending *const *p = kvb_bridge_receiver_pending(r, &np);
    const uint32_t bt = d->fmt.block_tokens, nl = d->m->d.n_layer, nh = d->fmt.n_head_kv;
    const size_t hb = kvb_row_bytes(KVB_TYPE_F16, d->fmt.head_dim);
    kvb_status st = slot_reserve(d, sl, to, err);
    const uint32_t keep = kvb_kvformat_local_keep_from(&d->fmt, to); /* local rows shipped from here on */
    if (sl->n == 0 || keep > sl->n) sl->local_lo = keep;
    for (uint32_t b = 0; !st && b < np; b++) {
        if (!kvb_store_slab_committed(p[b])) return kvb_err_set(err, KVB_ERR_INTERNAL, "block %u not committed", b);
        const uint8_t *blk = kvb_store_block_data(d->store, kvb_store_slab_block(p[b]));
        for (uint32_t t = 0; t < bt; t++) {
            const size_t at = (size_t)(sl->n + t) * nl * d->row;
            for (uint32_t l = 0; l < nl; l++)
                for (uint32_t h = 0; h < nh; h++) {
                    memcpy(sl->k + at + l * d->row + h * hb, blk + kvb_kvformat_row_offset(&d->fmt, l, 0, h, t), hb);
                    memcpy(sl->v + at + l * d->row + h * hb, blk + kvb_kvformat_row_offset(&d->fmt, l, 1, h, t), hb);
                }
        }
        memcpy(sl->toks + sl->n, ids + sl->n, bt * sizeof *ids);
        sl->n += bt;
    }
    return st;
}

/* The first cell the file holds in cache c for a prefix of n tokens: 0 for global layers; for local
 * ones the window + 1 last positions (see the file comment: llama-server's reuse rule). */
static uint32_t cache_first_cell(const kvb_llama_door *d, uint32_t c, uint32_t n) {
    return c == 1 && n > d->window + 1 ? n - d->window - 1 : 0;
}

/* Cache c of the slot's file: the probed layout, cells [cache_first_cell, n) of its layers, rows
 * (token, layer, row) -> (layer, cell, row); local rows below the slot's local_lo are zero. */
static kvb_status fill_cache(const kvb_llama_door *d, uint32_t s, uint32_t c, kvb_llama_cache *out, kvb_err *err) {
    const door_slot *sl = &d->slot[s];
    const uint32_t nl = d->m->d.n_layer, first = cache_first_cell(d, c, sl->n), cells = sl->n - first;
    const uint32_t lo = c == 1 ? sl->local_lo : 0, n_cl = d->n_layers[c];
    *out = d->probe[c];
    out->stream = out->n_stream > 1 && s < out->n_stream ? s : 0;
    out->n_cells = cells;
    out->seq_id = (int32_t)s;
    out->pos = malloc(cells * sizeof *out->pos);
    out->k = calloc((size_t)n_cl * cells, d->row);
    out->v = calloc((size_t)n_cl * cells, d->row);
    if (!out->pos || !out->k || !out->v) return kvb_err_set(err, KVB_ERR_NOMEM, "slot file of %u tokens", sl->n);
    for (uint32_t i = 0; i < cells; i++) {
        const uint32_t t = first + i;
        out->pos[i] = (int32_t)t;
        if (t < lo) continue;
        for (uint32_t j = 0; j < n_cl; j++) {
            const size_t src = ((size_t)t * nl + d->layers[c][j]) * d->row, dst = ((size_t)j * cells + i) * d->row;
            memcpy(out->k + dst, sl->k + src, d->row);
            memcpy(out->v + dst, sl->v + src, d->row);
        }
    }
    return KVB_OK;
}

/* Writes the slot's rows as llama-server's slot file (the layout its own file has) and restores it. */
static kvb_status slot_restore(kvb_llama_door *d, uint32_t s, kvb_err *err) {
    const door_slot *sl = &d->slot[s];
    kvb_llama_state st = {.n_tokens = sl->n, .tokens = sl->toks, .server_packed = true, .n_cache = d->n_cache};
    kvb_status rc = KVB_OK;
    for (uint32_t c = 0; !rc && c < d->n_cache; c++) rc = fill_cache(d, s, c, &st.cache[c], err);
    char file[64], path[4096];
    snprintf(file, sizeof file, "kvb-door-slot%u.bin", s);
    snprintf(path, sizeof path, "%s/%s", d->cfg.slot_dir, file);
    if (!rc) rc = kvb_llama_state_save(&st, path, err);
    for (uint32_t c = 0; c < d->n_cache; c++) free(st.cache[c].pos), free(st.cache[c].k), free(st.cache[c].v);
    cJSON *rep = NULL;
    if (!rc) rc = slot_action(d, s, "restore", file, &rep, err);
    const cJSON *nr = rep ? cJSON_GetObjectItem(rep, "n_restored") : NULL;
    if (!rc && (!cJSON_IsNumber(nr) || nr->valuedouble != sl->n))
        rc = kvb_err_set(err, KVB_ERR_REFUSED, "llama-server restored %g of %u tokens", nr ? nr->valuedouble : -1.0,
                         sl->n);
    cJSON_Delete(rep);
    return rc;
}

/* ---- the increment over the peer link ------------------------------------------------------------ */

/* Asks the prefill node for tokens [sl->n, to) and appends them to the slot; "" in why when they
 * all arrived and verified, else why not (the slot is unchanged); *asked once a PREFILL went out. */
static void bridge_increment(kvb_llama_door *d, door_slot *sl, const int32_t *ids, uint32_t n, uint32_t to,
                             bool *asked, char *why, size_t cap) {
    kvb_err err = {0};
    kvb_conn *const *lanes = NULL;
    uint32_t n_lanes = 0;
    kvb_bridge_receiver *r = NULL;
    why[0] = 0;
    if (!d->link) {
        snprintf(why, cap, "no prefill node");
        return;
    }
    if (kvb_peer_link_lanes(d->link, &lanes, &n_lanes, &err)) {
        snprintf(why, cap, "prefill node %s", err.msg);
        return;
    }
    if (kvb_bridge_receiver_create(d->store, ids, sl->n, to, &r, &err)) {
        snprintf(why, cap, "internal: %s", err.msg);
        return;
    }
    const kvb_msg_prefill p = {.request_id = ++d->next_request_id, .bridge_mode = d->hello.bridge_mode,
                               .n_tokens = n, .cached_tokens = sl->n, .ship_tokens = to,
                               .last_cached_key = kvb_bridge_receiver_parent_key(r), .tokens = (int32_t *)ids};
    const kvb_bridge_rx_opts ro = {.lanes = lanes, .n_lanes = n_lanes, .prefill = &p,
                                   .send_timeout_ms = d->cfg.peer_timeout_ms,
                                   .lane_timeout_ms = d->cfg.peer_timeout_ms * (int)n_lanes, .toks = ids, .n_tok = n,
                                   .cached = sl->n};
    kvb_bridge_rx_outcome o = {0};
    *asked = true;
    kvb_bridge_rx_run(r, &ro, &o);
    if (o.drop_link) kvb_peer_link_drop(d->link, NULL);
    if (o.fault) snprintf(why, cap, "%s", o.fault_msg[0] ? o.fault_msg : kvb_bridge_fault_name(o.fault));
    else if (slot_append(d, sl, r, ids, to, &err)) snprintf(why, cap, "internal: %s", err.msg);
    kvb_bridge_receiver_free(r);
}

/* ---- the completion, forwarded ------------------------------------------------------------------- */

/* What the verdict is settled from once llama-server says how much of the prompt it reused. */
typedef struct {
    kvb_completion_out *out;
    uint32_t n, restored; /* the prompt's tokens; the rows restored into the slot (0: none) */
    const char *why;      /* why nothing was restored ("" when it was) */
} door_turn;

/* kvb_door_stream_start: total and cached as llama-server's first progress event gives them. */
static void settle_verdict(void *ctx, int total, int cached) {
    const door_turn *t = ctx;
    char verdict[KVB_VERDICT_MAX];
    if (t->why[0]) kvb_verdict_format(verdict, "declined: %s", t->why);
    else if (cached < 0 || total < cached)
        kvb_verdict_format(verdict, "partial: llama-server did not say how much of the %u restored tokens it reused",
                           t->restored);
    else if ((uint32_t)(total - cached) <= t->n - t->restored) kvb_verdict_format(verdict, "complete");
    else kvb_verdict_format(verdict, "partial: llama-server computed %d prompt tokens after %u restored of %u",
                            total - cached, t->restored, t->n);
    kvb_completion_set_verdict(t->out, verdict);
}

/* llama-server's /completion of ids in slot s with prompt caching, under the request's sampling,
 * streamed: each delta goes to the client as it comes (its verdict settled first). */
static kvb_status forward(kvb_llama_door *d, const kvb_completion_req *req, const int32_t *ids, uint32_t n, uint32_t s,
                          door_turn *t, kvb_door_stream_end *end, kvb_err *err) {
    cJSON *q = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(q, "prompt");
    for (uint32_t i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    cJSON_AddNumberToObject(q, "n_predict", (double)(req->max_tokens >= 0 ? req->max_tokens : d->cfg.default_max_tokens));
    cJSON_AddNumberToObject(q, "temperature", req->temperature);
    cJSON_AddNumberToObject(q, "top_p", req->top_p);
    cJSON_AddNumberToObject(q, "top_k", req->top_k > 0 ? req->top_k : 0);
    cJSON_AddNumberToObject(q, "frequency_penalty", req->frequency_penalty);
    cJSON_AddNumberToObject(q, "presence_penalty", req->presence_penalty);
    if (req->has_seed) cJSON_AddNumberToObject(q, "seed", (double)req->seed);
    if (req->ignore_eos) cJSON_AddBoolToObject(q, "ignore_eos", 1);
    cJSON *stop = cJSON_AddArrayToObject(q, "stop");
    for (size_t i = 0; i < req->n_stop; i++) cJSON_AddItemToArray(stop, cJSON_CreateString(req->stop[i]));
    cJSON_AddNumberToObject(q, "id_slot", s);
    cJSON_AddBoolToObject(q, "cache_prompt", 1);
    cJSON_AddBoolToObject(q, "stream", 1);
    cJSON_AddBoolToObject(q, "return_progress", 1);
    char *body = cJSON_PrintUnformatted(q);
    cJSON_Delete(q);
    if (!body) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    const kvb_status st = kvb_door_stream_completion(d->host, d->port, body, DOOR_HTTP_TIMEOUT_MS, t->out,
                                                     settle_verdict, t, end, err);
    free(body);
    if (!st && (end->prompt_n < 0 || end->predicted < 0))
        return kvb_err_set(err, KVB_ERR_FORMAT, "llama-server's last event lacks timings.prompt_n or tokens_predicted");
    return st;
}

/* Bridges what the slot lacks and restores it; the verdict's reason when it was not (then llama-server
 * computes the prompt itself), "" when the slot holds *restored rows in llama-server. */
static void bridge_and_restore(kvb_llama_door *d, uint32_t s, const int32_t *ids, uint32_t n, uint32_t target,
                               uint32_t *restored, bool *asked, char *why, size_t cap) {
    kvb_err err = {0};
    door_slot *sl = &d->slot[s];
    *restored = 0;
    if (target == 0) {
        snprintf(why, cap, "a prompt of %u tokens is under one block", n);
        return;
    }
    if (d->window && !d->short_reuse && target <= d->window) {
        snprintf(why, cap, "llama-server recomputes a restored prefix of %u tokens, not over its sliding "
                 "window of %u (without --swa-full)", target, d->window);
        return;
    }
    if (sl->n < target) bridge_increment(d, sl, ids, n, target, asked, why, cap);
    if (why[0]) return;
    if (slot_restore(d, s, &err)) {
        snprintf(why, cap, "llama-server refused the restore: %s", err.msg);
        return;
    }
    *restored = sl->n;
}

static void handle_completion(void *ctx, const kvb_completion_req *req, kvb_completion_out *out) {
    kvb_llama_door *d = ctx;
    if (req->n != 1 || req->logprobs || req->echo || req->json_object || req->json_schema || req->n_logit_bias ||
        req->n_stop_token_ids || req->min_tokens > 0) {
        kvb_completion_fail(out, 400, "unsupported", NULL, "the llama-server front door forwards n = 1 completions "
                            "without logprobs, echo, response_format, logit_bias, stop_token_ids or min_tokens");
        return;
    }
    kvb_http_error e = {0};
    int32_t *ids = NULL;
    uint32_t n = 0;
    const double t0 = kvb_now_s();
    pthread_mutex_lock(&d->mu);
    const int hs = prompt_ids(d, req, &ids, &n, &e);
    if (hs) {
        pthread_mutex_unlock(&d->mu);
        kvb_completion_fail(out, hs, e.code[0] ? e.code : NULL, e.param[0] ? e.param : NULL, "%s", e.message);
        return;
    }
    const double t_tok = kvb_now_s();
    const uint32_t bt = d->fmt.block_tokens, target = (n - 1) / bt * bt;
    uint32_t held = 0, restored = 0;
    const uint32_t s = slot_pick(d, ids, n, target, &held);
    char why[1024] = "";
    bool asked = false;
    bridge_and_restore(d, s, ids, n, target, &restored, &asked, why, sizeof why);
    const double t_bridge = kvb_now_s();
    door_turn t = {.out = out, .n = n, .restored = restored, .why = why};
    kvb_door_stream_end end = {0};
    kvb_err err = {0};
    const kvb_status st = forward(d, req, ids, n, s, &t, &end, &err);
    pthread_mutex_unlock(&d->mu);
    free(ids);
    if (st == KVB_ERR_CANCELLED) return; /* the client went away: nobody to answer */
    if (st) {
        kvb_completion_fail(out, 502, NULL, NULL, "%s", err.msg);
        return;
    }
    if (!end.started) settle_verdict(&t, -1, -1); /* an empty reply: no event said it */
    kvb_usage u = {.prompt_tokens = n, .completion_tokens = end.predicted, .native_tokens = end.prompt_n,
                   .cached_tokens = restored ? held : (int64_t)n - end.prompt_n,
                   .bridged_tokens = restored ? restored - held : 0, .tokenize_s = t_tok - t0,
                   .transfer_s = t_bridge - t_tok, .decode_s = kvb_now_s() - t_bridge,
                   .bridge_attempts = asked, .bridge_faults = asked && why[0] ? why : NULL};
    kvb_completion_finish(out, end.finish, &u);
}

/* ---- start and stop ---------------------------------------------------------------------------------- */

/* llama-server's /props: it must have at least the slots this door maps conversations to (this
 * build restores a file into a slot id past its -np without a word) and its slot endpoints on. */
static kvb_status check_props(kvb_llama_door *d, kvb_err *err) {
    kvb_http_reply r = {0};
    kvb_status st = kvb_http_get(d->host, d->port, "/props", DOOR_HTTP_TIMEOUT_MS, &r, err);
    cJSON *j = !st && r.status == 200 ? cJSON_Parse(r.body) : NULL;
    const cJSON *ns = j ? cJSON_GetObjectItem(j, "total_slots") : NULL, *ep = j ? cJSON_GetObjectItem(j, "endpoint_slots") : NULL;
    const cJSON *bi = j ? cJSON_GetObjectItem(j, "build_info") : NULL;
    if (!st && !cJSON_IsNumber(ns))
        st = kvb_err_set(err, KVB_ERR_UNSUPPORTED, "llama-server %s:%u: /props (HTTP %d) has no total_slots; "
                         "supported: %s", d->host, d->port, r.status, KVB_LLAMA_SUPPORTED_BUILD);
    else if (!st && ns->valuedouble < d->cfg.slots)
        st = kvb_err_set(err, KVB_ERR_INVALID, "--slots %u, but llama-server runs %g (its -np)", d->cfg.slots,
                         ns->valuedouble);
    else if (!st && cJSON_IsBool(ep) && !cJSON_IsTrue(ep))
        st = kvb_err_set(err, KVB_ERR_INVALID, "llama-server's slot endpoints are off (it needs --slot-save-path)");
    if (!st) kvb_log(KVB_LOG_INFO, "llama door: llama-server build %s, %g slots", cJSON_IsString(bi) ? bi->valuestring : "?",
                     ns->valuedouble);
    cJSON_Delete(j);
    kvb_http_reply_free(&r);
    return st;
}

/* Layer 0's K rows (cell, row) of the probe, as kvbridge's engine computes them (rows_hook). */
typedef struct {
    uint32_t n;
    size_t row;
    uint8_t *k; /* (cell, row) f16 */
} layer0_rows;

static kvb_status keep_layer0(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n, const uint8_t *k_rows,
                              const uint8_t *v_rows, uint32_t dtype, kvb_err *err) {
    layer0_rows *l0 = ctx;
    (void)v_rows;
    if (dtype != KVB_TYPE_F16 || pos0 + n > l0->n)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "rows hook: positions %u+%u of %u", pos0, n, l0->n);
    if (layer == 0) memcpy(l0->k + (size_t)pos0 * l0->row, k_rows, n * l0->row);
    return KVB_OK;
}

/* llama-server runs the model this door bridges for: the K rows its probe computed in layer 0
 * against kvbridge's for the same tokens (relative L2 under 5e-2; equal bits need f32 weights, as
 * ggml rounds activations; another model's rows are about 1.4 apart). */
static kvb_status same_model(kvb_llama_door *d, const kvb_llama_state *s, kvb_err *err) {
    const kvb_llama_cache *c = &s->cache[d->n_layers[0] && d->layers[0][0] == 0 ? 0 : 1]; /* layer 0's, first */
    layer0_rows l0 = {.n = c->n_cells, .row = d->row, .k = malloc((size_t)c->n_cells * d->row)};
    kvb_engine_opts o = {.n_threads = 1, .cache_dtype = KVB_TYPE_F16, .block_tokens = d->fmt.block_tokens,
                         .max_ctx = (c->n_cells / d->fmt.block_tokens + 2) * d->fmt.block_tokens,
                         .rows_hook = keep_layer0, .rows_hook_ctx = &l0};
    kvb_engine *e = NULL;
    kvb_seq *q = NULL;
    kvb_status st = l0.k ? KVB_OK : kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    for (uint32_t t = 0; !st && t < c->n_cells; t++)
        if (c->pos[t] != (int32_t)t || t >= s->n_tokens) st = kvb_err_set(err, KVB_ERR_FORMAT, "probe cell %u", t);
    if (!st) st = kvb_engine_create(d->m, &o, &e, err);
    if (!st) st = kvb_seq_create(e, &q, err);
    if (!st) st = kvb_engine_forward(e, q, s->tokens, c->n_cells, NULL, false, err);
    double num = 0, den = 0;
    for (uint32_t t = 0; !st && t < c->n_cells; t++)
        for (size_t i = 0; i + 1 < d->row; i += 2) {
            const uint8_t *a = kvb_llama_k_row(c, 0, t) + i, *b = l0.k + (size_t)t * d->row + i;
            const double x = kvb_fp16_to_f32((uint16_t)(a[0] | a[1] << 8)), y = kvb_fp16_to_f32((uint16_t)(b[0] | b[1] << 8));
            num += (x - y) * (x - y), den += y * y;
        }
    const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    if (!st && !(rel < 5e-2))
        st = kvb_err_set(err, KVB_ERR_MISMATCH, "llama-server runs another model than %s: its layer-0 keys for a "
                         "probe are %.3g (relative L2) from kvbridge's; start it on the same GGUF",
                         d->cfg.model_path, rel);
    if (!st) kvb_log(KVB_LOG_INFO, "llama door: llama-server's layer-0 keys for a probe of %u tokens are %.3g "
                     "(relative L2) from kvbridge's: the same model", c->n_cells, rel);
    kvb_seq_free(q);
    kvb_engine_free(e);
    free(l0.k);
    return st;
}

/* A completion of ids in slot 0 with prompt caching, one token predicted: llama-server's prompt_n. */
static kvb_status probe_complete(kvb_llama_door *d, const int32_t *ids, uint32_t n, int *prompt_n, kvb_err *err) {
    cJSON *q = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(q, "prompt");
    for (uint32_t i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    cJSON_AddNumberToObject(q, "n_predict", 1);
    cJSON_AddNumberToObject(q, "id_slot", 0);
    cJSON_AddBoolToObject(q, "cache_prompt", 1);
    cJSON *rep = server_post(d, "/completion", q, err);
    const cJSON *pn = cJSON_GetObjectItem(cJSON_GetObjectItem(rep, "timings"), "prompt_n");
    kvb_status st = rep ? KVB_OK : err->code;
    if (!st && !cJSON_IsNumber(pn)) st = kvb_err_set(err, KVB_ERR_FORMAT, "llama-server's reply has no prompt_n");
    if (!st) *prompt_n = pn->valueint;
    cJSON_Delete(rep);
    return st;
}

/* Each cache of llama-server's probe file holds the layers this door writes there, f16 rows. */
static kvb_status check_layout(kvb_llama_door *d, const kvb_llama_state *s, kvb_err *err) {
    for (uint32_t c = 0; c < KVB_LLAMA_MAX_CACHES; c++) {
        const kvb_llama_cache *k = &s->cache[c];
        if (s->n_cache == d->n_cache && (c >= d->n_cache ||
            (k->n_cells && k->n_layer == d->n_layers[c] && k->k_type == KVB_TYPE_F16 &&
             k->v_type == KVB_TYPE_F16 && k->k_row_bytes == d->row && k->v_row_bytes == d->row)))
            continue;
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "llama-server's slot file has %u cache(s), cache %u: %u layers "
                           "of %s/%s rows of %llu B; this front door writes %u (global then sliding-window layers), "
                           "cache %u: %u layers of f16 rows of %zu B (the model %s; run llama-server on the same "
                           "GGUF with -ctk f16 -ctv f16)", s->n_cache, c, k->n_layer, kvb_type_name(k->k_type),
                           kvb_type_name(k->v_type), (unsigned long long)k->k_row_bytes, d->n_cache, c,
                           c < d->n_cache ? d->n_layers[c] : 0, d->row, d->cfg.model_path);
    }
    return KVB_OK;
}

/* llama-server's own slot file for a short prompt in slot 0: the layout this door's files copy. For
 * a sliding-window model, that file restored and one token more asked: whether llama-server reuses a
 * restored prefix shorter than its window (only with --swa-full) or computes it all again. */
static kvb_status probe_layout(kvb_llama_door *d, kvb_err *err) {
    int32_t *ids = NULL;
    uint32_t n = 0;
    int pn = 0;
    kvb_status st = server_tokenize(d, "Hello", &ids, &n, err);
    if (!st) st = slot_action(d, 0, "erase", NULL, NULL, err);
    if (!st) st = probe_complete(d, ids, n, &pn, err);
    if (!st) st = slot_action(d, 0, "save", PROBE_FILE, NULL, err);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", d->cfg.slot_dir, PROBE_FILE);
    kvb_llama_state s = {0};
    if (!st) st = kvb_llama_state_load(path, &s, err);
    if (!st) st = check_layout(d, &s, err);
    if (!st) st = same_model(d, &s, err);
    for (uint32_t c = 0; !st && c < d->n_cache; c++) {
        const kvb_llama_cache *k = &s.cache[c];
        d->probe[c] = (kvb_llama_cache){.n_stream = k->n_stream, .v_trans = k->v_trans, .n_layer = k->n_layer,
                                        .k_type = k->k_type, .v_type = k->v_type, .k_row_bytes = k->k_row_bytes,
                                        .v_row_bytes = k->v_row_bytes};
    }
    kvb_llama_state_free(&s);
    if (!st && d->window) {
        int32_t *more = realloc(ids, (n + 1) * sizeof *ids);
        if (more) ids = more, ids[n] = ids[n - 1];
        if (!more) st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        if (!st) st = slot_action(d, 0, "erase", NULL, NULL, err);
        if (!st) st = slot_action(d, 0, "restore", PROBE_FILE, NULL, err);
        if (!st) st = probe_complete(d, ids, n + 1, &pn, err);
        d->short_reuse = !st && pn == 1;
        if (!st) kvb_log(KVB_LOG_INFO, "llama door: llama-server %s a restored prefix of %u tokens (window %u): "
                         "%s", d->short_reuse ? "reuses" : "recomputes", n, d->window, d->short_reuse ?
                         "every restore is reused" : "only prefixes over the window are bridged (--swa-full for all)");
    }
    free(ids);
    remove(path);
    if (!st) st = slot_action(d, 0, "erase", NULL, NULL, err);
    return st;
}

static void handle_health(void *ctx, cJSON *body) {
    kvb_llama_door *d = ctx;
    char why[256] = "";
    cJSON_AddStringToObject(body, "decoder", "llama-server");
    if (d->link) cJSON_AddStringToObject(body, "peer", kvb_peer_state_name(kvb_peer_link_state(d->link, why, sizeof why)));
}

static kvb_status door_link(kvb_llama_door *d, kvb_err *err) {
    if (!d->cfg.psk || strlen(d->cfg.psk) < KVB_WIRE_PSK_MIN)
        return kvb_err_set(err, KVB_ERR_INVALID, "--peer needs a pre-shared key of at least %d bytes (--psk)",
                           KVB_WIRE_PSK_MIN);
    if (!(d->psk = strdup(d->cfg.psk)) || !(d->peer = strdup(d->cfg.peer)))
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    d->tcfg = (kvb_transport_config){.psk = (const uint8_t *)d->psk, .psk_len = strlen(d->psk),
                                     .backend = d->cfg.backend};
    kvb_status st = kvb_hello_init(&d->hello, KVB_ROLE_DECODE, KVB_BRIDGE_MODE_DECODER, "llama-door", d->m->fingerprint,
                                   &d->fmt, err);
    kvb_peer_link_config lc = {.addr = d->peer, .hello = &d->hello, .tcfg = &d->tcfg, .lanes = d->cfg.lanes,
                               .connect_timeout_ms = DOOR_DIAL_TIMEOUT_MS};
    if (!st) st = kvb_peer_link_start(&lc, &d->link, err);
    kvb_conn *const *lanes;
    uint32_t n_up;
    if (!st) kvb_peer_link_wait_lanes(d->link, DOOR_DIAL_TIMEOUT_MS + 1000, &lanes, &n_up, NULL);
    return st;
}

/* llama.cpp's caches for the model: one of every layer, or the global layers' then the local ones'. */
static kvb_status cache_layers(kvb_llama_door *d, kvb_err *err) {
    d->window = d->fmt.window;
    d->n_cache = d->window ? 2 : 1;
    for (uint32_t c = 0; c < d->n_cache; c++)
        if (!(d->layers[c] = malloc(d->m->d.n_layer * sizeof *d->layers[c])))
            return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    for (uint32_t l = 0; l < d->m->d.n_layer; l++) {
        const uint32_t c = d->window && kvb_kvformat_layer_local(&d->fmt, l) ? 1 : 0;
        d->layers[c][d->n_layers[c]++] = l;
    }
    return KVB_OK;
}

kvb_status kvb_llama_door_start(const kvb_llama_door_config *cfg, kvb_llama_door **out, kvb_err *err) {
    *out = NULL;
    kvb_llama_door *d = calloc(1, sizeof *d);
    if (!d) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&d->mu, NULL);
    d->cfg = *cfg;
    kvb_llama_door_config *c = &d->cfg;
    if (!c->slots) c->slots = 1;
    if (!c->block_tokens) c->block_tokens = 32;
    if (!c->default_max_tokens) c->default_max_tokens = 256;
    if (!c->peer_timeout_ms) c->peer_timeout_ms = 10000;
    if (!c->lanes) c->lanes = 1;
    kvb_status st = KVB_OK;
    if (c->slots > KVB_DOOR_MAX_SLOTS || c->lanes > KVB_MAX_LANES || !c->slot_dir ||
        !parse_server_url(c->server_url, d->host, sizeof d->host, &d->port))
        st = kvb_err_set(err, KVB_ERR_INVALID, "llama-server front door: expected llama-server=http://HOST:PORT, "
                         "--slot-dir, at most %d slots and %d lanes", KVB_DOOR_MAX_SLOTS, KVB_MAX_LANES);
    if (!st) st = kvb_model_load(c->model_path, &d->m, err);
    if (!st) st = kvb_model_kvformat(&d->m->d, KVB_TYPE_F16, c->block_tokens, &d->fmt, err);
    if (!st) st = cache_layers(d, err);
    if (st) goto fail;
    if (!c->max_ctx) c->max_ctx = d->m->d.n_ctx_train < 32768 ? d->m->d.n_ctx_train : 32768;
    d->row = (size_t)d->fmt.n_head_kv * kvb_row_bytes(KVB_TYPE_F16, d->fmt.head_dim);
    const char *base = strrchr(c->model_path, '/');
    if (!(d->model_id = strdup(c->model_id ? c->model_id : base ? base + 1 : c->model_path))) {
        st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if ((st = kvb_store_create(&d->fmt, d->m->fingerprint, c->max_ctx / c->block_tokens + 1, &d->store, err))) goto fail;
    if ((st = check_props(d, err)) || (st = probe_layout(d, err))) goto fail;
    if (c->peer && (st = door_link(d, err))) goto fail;
    kvb_http_config hc = {.listen = c->http_listen, .model_id = d->model_id, .accept_any_model = true,
                          .max_model_len = c->max_ctx};
    kvb_http_handlers hh = {.ctx = d, .completion = handle_completion, .health = handle_health};
    if ((st = kvb_http_server_start(&hc, &hh, &d->http, err))) goto fail;
    *out = d;
    return KVB_OK;
fail:
    kvb_llama_door_stop(d);
    return st;
}

uint16_t kvb_llama_door_port(const kvb_llama_door *d) { return kvb_http_server_port(d->http); }

void kvb_llama_door_stop(kvb_llama_door *d) {
    if (!d) return;
    kvb_http_server_stop(d->http);
    kvb_peer_link_stop(d->link);
    for (uint32_t s = 0; s < KVB_DOOR_MAX_SLOTS; s++) free(d->slot[s].toks), free(d->slot[s].k), free(d->slot[s].v);
    kvb_store_free(d->store);
    kvb_model_free(d->m);
    for (uint32_t c = 0; c < KVB_LLAMA_MAX_CACHES; c++) free(d->layers[c]);
    pthread_mutex_destroy(&d->mu);
    free(d->model_id), free(d->psk), free(d->peer);
    free(d);
}
