/* node/decode_node.c — the decode role, the front door: the OpenAI API handler. A request runs
 * as stages over one decode_request: admit (tokenize with the chat template, check the context
 * and the cache blocks it can need), look up the prefix cache, decide (an enum: enough uncached
 * tokens and a reachable peer -> bridge; else why not), bridge (the bridge's receiver over the
 * peer's lanes, src/bridge/rx_lanes.c: slabs striped over several connections, one receiving and
 * one committing thread per lane, committed through the store's slab path and one block writer;
 * the last prompt token computed while the blocks arrive, layer by layer, on the pipelined tail's
 * thread — KVB_DECODE_PIPELINED_TAIL=0 runs it after the transfer instead), native fill (the
 * rest), decode and emit; the verdict, printed from the decision and the outcome, says what
 * actually happened. Up to cfg.parallel requests are served at once, admitted in arrival order:
 * prompts take their turn in a FIFO (whose holder borrows a peer link's lanes; each link's own
 * thread dials them, src/transport/peer_link.c; with several prefill peers, decode_peers.c places
 * the request on the one holding its history, and a resume may go to another), and the decode
 * steps of all of them run as batches whenever no prompt computes, before each prompt and between
 * its slices (decode_batch.c), the weights read once per step for every request. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_engine_cpu.h"
#include "kvb_http.h"
#include "kvb_quant.h"
#include "kvb_store.h"
#include "kvb_tokenizer.h"
#include "kvb_transport.h"
#include "node_internal.h"

/* The bridge in flight as the status snapshot sees it. */
typedef struct {
    kvb_bridge_receiver *rx;        /* NULL: none */
    uint64_t id;                    /* the PREFILL's request id */
    uint32_t prompt, cached, ship_to; /* the prompt's tokens; those cached; shipped up to here */
    double t0;                      /* when the bridge began (kvb_now_s) */
} live_bridge;

struct kvb_decode_node {
    kvb_decode_config cfg;
    char *psk, *model_id;
    kvb_model *m;
    kvb_tokenizer *tok;
    kvb_vocab_bytes *vocab_bytes; /* every token's bytes, for response_format's JSON mode */
    int32_t *eog_ids;             /* (n_eog) the vocabulary's end-of-generation tokens (min_tokens bars them) */
    size_t n_eog;
    kvb_chat_family fam;
    kvb_status fam_status;
    char fam_error[sizeof(((kvb_err *)0)->msg)];
    kvb_engine *e;
    kvb_store *store;
    kvb_http_server *http;
    /* FIFO ticket queue of prompt phases (the engine's compute is the decode batch's to share) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t next_ticket, serving;
    /* FIFO admission: at most cfg.parallel requests are served at once (their decode steps batched),
     * each with the cache blocks it can need reserved, within cfg.cache_blocks */
    uint64_t slot_next, slot_admit; /* tickets handed out; the next ticket to admit */
    uint32_t n_served;              /* admitted, not yet done */
    uint64_t blocks_reserved;       /* by them */
    kvb_decode_batch *batch;
    /* the prefill peers, each link dialled and kept up by its own thread; the lanes one of them
     * (lanes_peer, -1: none) lent to the prompt FIFO's holder (n_lanes of them, valid while it
     * holds the FIFO): lane 0 carries PREFILL and CANCEL */
    kvb_peer_set *peers;
    uint32_t n_peers;
    int lanes_peer;
    kvb_conn *const *lanes;
    uint32_t n_lanes;
    uint64_t chain_root; /* the chain keys' root (placement looks up the prompt's block keys) */
    kvb_hello hello;
    kvb_transport_config tcfg;
    uint64_t next_request_id;
    /* metrics */
    kvb_metric *m_requests, *m_tokens, *m_faults, *m_resumes, *m_slab_bytes, *m_queue;
    kvb_metric *m_phase; /* kvbridge_request_phase_seconds{phase} */
    kvb_metric *m_batches, *m_steps, *m_in_prompts;
    kvb_metric *m_reserved, *m_cache_waits; /* admission by cache blocks */
    kvb_metric *m_abandoned; /* requests whose client went away before their prompt was in */
    kvb_metrics *metrics; /* the registry /metrics renders (the server's families too) */
    double last_reader_wait_s, last_consumer_wait_s; /* the last bridge's receiving stages */
    /* the bridge in flight (at most one: the prompt FIFO's holder runs it), for the status snapshot;
     * live_mu guards these and keeps the receiver alive while a snapshot reads it */
    pthread_mutex_t live_mu;
    live_bridge live;
};

/* ---- the bridge, decode side ----------------------------------------------------------------- */

/* One bridge attempt: what the receiver reports, and the attempt's time from setup to the last DONE. */
typedef struct {
    kvb_bridge_rx_outcome rx;
    double transfer_s;
} bridge_outcome;

/* One whole dial of the peer link (connect, handshake and grouping of every lane); also how long
 * the node's start, and a resume after a dropped lane, wait for the link. */
#define PEER_DIAL_TIMEOUT_MS 5000
/* An idle link's lanes are pinged this often: a silent peer is found within about two of these
 * plus KVB_HEARTBEAT_TIMEOUT_MS, and each PONG reports the peer's queue for placement. */
#define PEER_HEARTBEAT_MS 1000

static bool pipelined_tail_on(const kvb_decode_node *n) {
    const char *v = getenv("KVB_DECODE_PIPELINED_TAIL");
    return !n->cfg.tail_after_transfer && (!v || !*v || *v != '0');
}

/* The lanes can no longer be trusted: the link closes them and dials again. */
static void drop_peer(kvb_decode_node *n) {
    kvb_peer_set_drop(n->peers, n->lanes_peer);
    n->lanes = NULL;
    n->n_lanes = 0;
    n->lanes_peer = -1;
}

/* The lanes go back to their link (they stay up; its heartbeat may use them again). */
static void release_peer(kvb_decode_node *n) {
    kvb_peer_set_release(n->peers, n->lanes_peer);
    n->lanes = NULL;
    n->n_lanes = 0;
    n->lanes_peer = -1;
}

/* After a fault mid-stream on `peer`'s lanes: the link dials again; waits a bounded time for it
 * with the engine lent to the decode batches, so other requests' streams go on meanwhile. */
static kvb_status peer_lanes_again(kvb_decode_node *n, int peer, kvb_err *err) {
    kvb_decode_batch_exec_lend(n->batch);
    const kvb_status st = kvb_peer_set_lanes_again(n->peers, peer, PEER_DIAL_TIMEOUT_MS, &n->lanes, &n->n_lanes, err);
    kvb_decode_batch_exec_reclaim(n->batch);
    if (!st) n->lanes_peer = peer;
    return st;
}

/* ---- the bridge, through the bridge's receiver over the peer's lanes --------------------------- */

/* The decode batch as the bridge's receiver drives it (kvb_bridge_batch_hooks). */
static uint32_t batch_run_pending(void *ctx) { return kvb_decode_batch_run_pending(ctx); }
static void batch_on_step(void *ctx, void (*fn)(void *), void *fn_ctx) { kvb_decode_batch_on_step(ctx, fn, fn_ctx); }
static void batch_lend(void *ctx) { kvb_decode_batch_exec_lend(ctx); }
static void batch_reclaim(void *ctx) { kvb_decode_batch_exec_reclaim(ctx); }
static bool client_gone(void *ctx) { return kvb_completion_cancelled(ctx); }

/* The bridge in flight as the status snapshot sees it, from its receiver's creation to
 * live_bridge_end (before the receiver is freed, so a snapshot never reads a freed one). */
static void live_bridge_set(kvb_decode_node *n, live_bridge lb) {
    pthread_mutex_lock(&n->live_mu);
    n->live = lb;
    pthread_mutex_unlock(&n->live_mu);
}

/* The bridge's bytes join the link's total as it leaves the snapshot (one step: the total never dips). */
static void live_bridge_end(kvb_decode_node *n, uint64_t bytes) {
    pthread_mutex_lock(&n->live_mu);
    kvb_metric_add(n->m_slab_bytes, NULL, (double)bytes);
    n->live.rx = NULL;
    pthread_mutex_unlock(&n->live_mu);
}

/* Asks the peer for blocks [cached, ship) and the tail [ship, ship + tail) (the partial block
 * before the last prompt token) and commits what arrives through the bridge's receiver; the store
 * keeps any block that completed and verified, lookups see only the contiguous committed chain.
 * A complete tail comes back as o->rx.tail_page for the sequence to adopt. Meanwhile the pipelined
 * tail may compute the last token into logits (n_vocab): o->rx.last_ready says whether it did. */
static void bridge_blocks(kvb_decode_node *n, const int32_t *toks, uint32_t n_tok, uint32_t cached, uint32_t ship,
                          uint32_t tail, float *logits, kvb_completion_out *out, bridge_outcome *o) {
    memset(o, 0, sizeof *o);
    o->rx.tail_page = o->rx.last_page = KVB_BLOCK_NONE;
    const double t0 = kvb_now_s();
    kvb_bridge_receiver *r = NULL;
    kvb_err err = {0};
    const kvb_status st = kvb_bridge_receiver_create(n->store, toks, cached, ship + tail, &r, &err);
    if (st) { /* the pages for the blocks: the store's KVB_ERR_RANGE says it is full */
        o->rx.fault = st == KVB_ERR_RANGE ? KVB_BRIDGE_FAULT_CACHE_FULL : KVB_BRIDGE_FAULT_INTERNAL;
        snprintf(o->rx.fault_msg, sizeof o->rx.fault_msg, "%s: %.120s",
                 st == KVB_ERR_RANGE ? "cache full" : "internal", err.msg);
    } else {
        kvb_trace_span("decode.bridge_setup", t0, kvb_now_s(), kvb_bridge_receiver_blocks(r)); /* keys, pages */
        live_bridge_set(n, (live_bridge){.rx = r, .id = n->next_request_id + 1, .prompt = n_tok, .cached = cached,
                                         .ship_to = ship + tail, .t0 = t0});
        const kvb_msg_prefill p = {.request_id = ++n->next_request_id, .bridge_mode = n->hello.bridge_mode,
                                   .n_tokens = n_tok, .cached_tokens = cached, .ship_tokens = ship + tail,
                                   .last_cached_key = kvb_bridge_receiver_parent_key(r), .tokens = (int32_t *)toks};
        /* a lane carries about one frame in n_lanes, so its wait for the next one may be n_lanes
         * times the per-frame timeout before the peer counts as stalled (the last frames of a
         * request, DONE on every lane, come after the whole prefill) */
        const long long lane_timeout = (long long)n->cfg.peer_timeout_ms * n->n_lanes;
        /* while slabs arrive, one CPU per receiving and per committing thread is theirs */
        const int in_transfer = kvb_engine_threads(n->e) - 2 * (int)n->n_lanes;
        const kvb_bridge_rx_opts ro = {
            .lanes = n->lanes, .n_lanes = n->n_lanes, .prefill = &p, .send_timeout_ms = n->cfg.peer_timeout_ms,
            .lane_timeout_ms = lane_timeout > 24LL * 3600 * 1000 ? 24 * 3600 * 1000 : (int)lane_timeout,
            .tail_engine = pipelined_tail_on(n) ? n->e : NULL, .toks = toks, .n_tok = n_tok, .cached = cached,
            .logits = logits, .tail_threads = in_transfer > 1 ? in_transfer : 1,
            .batch = {.ctx = n->batch, .run_pending = batch_run_pending, .on_step = batch_on_step,
                      .lend = batch_lend, .reclaim = batch_reclaim},
            .cancelled = client_gone, .cancelled_ctx = out};
        kvb_bridge_rx_run(r, &ro, &o->rx);
        n->last_reader_wait_s = o->rx.reader_wait_s;
        n->last_consumer_wait_s = o->rx.consumer_wait_s;
        kvb_peer_set_count_bytes(n->peers, n->lanes_peer, o->rx.bytes);
        if (o->rx.drop_link) drop_peer(n);
    }
    o->transfer_s = (o->rx.t_end > 0 ? o->rx.t_end : kvb_now_s()) - t0;
    live_bridge_end(n, o->rx.bytes);
    kvb_bridge_receiver_free(r); /* uncommitted pages go back */
    if (o->rx.fault) kvb_metric_add(n->m_faults, KVB_LABELS(kvb_bridge_fault_name(o->rx.fault)), 1);
}

/* Appends "; " (unless buf is empty), then label and text, to the faults list in buf (cut at cap). */
static void faults_append(char *buf, size_t cap, const char *label, const char *text) {
    const size_t len = strlen(buf);
    snprintf(buf + len, cap - len, "%s%s%.140s", len ? "; " : "", label, text);
}

/* ---- the completion handler ------------------------------------------------------------------- */

/* A prompt phase: the FIFO of prompts (and of the peer link), then the engine to compute on (the
 * decode batches' steps waiting now run first, and between the prompt's slices). */
static void engine_acquire(kvb_decode_node *n) {
    pthread_mutex_lock(&n->mu);
    uint64_t t = n->next_ticket++;
    while (n->serving != t) pthread_cond_wait(&n->cv, &n->mu);
    pthread_mutex_unlock(&n->mu);
    kvb_decode_batch_exec_begin(n->batch);
}

static void engine_release(kvb_decode_node *n) {
    kvb_decode_batch_exec_end(n->batch);
    pthread_mutex_lock(&n->mu);
    n->serving++;
    pthread_cond_broadcast(&n->cv);
    pthread_mutex_unlock(&n->mu);
}

/* The cache blocks a request of n_tok prompt tokens and up to max_new more can hold at once: its
 * sequence's, plus a page for the pipelined tail's last row and one for a bridge's partial block
 * (pages a failed attempt held go back before the next). Blocks it shares with others (a cached
 * prefix) are counted by each: the budget errs on the safe side. */
static uint64_t blocks_needed(const kvb_decode_node *n, uint64_t n_tok, uint64_t max_new) {
    return (n_tok + max_new + n->cfg.block_tokens - 1) / n->cfg.block_tokens + 2;
}

/* A request's turn to be served, in arrival order, once fewer than cfg.parallel are and its blocks
 * fit beside theirs in the cache: whatever the others hold, its own allocations then succeed (the
 * store evicts unreferenced cached blocks for them). */
static void slot_acquire(kvb_decode_node *n, uint64_t need) {
    pthread_mutex_lock(&n->mu);
    const uint64_t t = n->slot_next++;
    kvb_metric_set(n->m_queue, NULL, (double)(n->slot_next - n->slot_admit + n->n_served));
    bool waited_for_cache = false;
    for (;;) {
        if (t == n->slot_admit && n->n_served < n->cfg.parallel) {
            if (n->blocks_reserved + need <= n->cfg.cache_blocks) break;
            waited_for_cache = true;
        }
        pthread_cond_wait(&n->cv, &n->mu);
    }
    n->slot_admit++;
    n->n_served++;
    n->blocks_reserved += need;
    kvb_metric_set(n->m_reserved, NULL, (double)n->blocks_reserved);
    pthread_cond_broadcast(&n->cv); /* the next ticket may fit too */
    pthread_mutex_unlock(&n->mu);
    if (waited_for_cache) kvb_metric_add(n->m_cache_waits, NULL, 1);
}

static void slot_release(kvb_decode_node *n, uint64_t need) {
    pthread_mutex_lock(&n->mu);
    n->n_served--;
    n->blocks_reserved -= need;
    kvb_metric_set(n->m_reserved, NULL, (double)n->blocks_reserved);
    kvb_metric_set(n->m_queue, NULL, (double)(n->slot_next - n->slot_admit + n->n_served));
    pthread_cond_broadcast(&n->cv);
    pthread_mutex_unlock(&n->mu);
}

/* The prompt tokens this node computes itself: while other requests are decoding, PROMPT_SLICE at
 * a time, each slice in one forward with the steps they handed in meanwhile, so their streams do
 * not stall until the whole prompt is in, and the weights are read once for both (the same bits:
 * chunked == one shot, segments == apart); with nobody decoding, in the engine's full chunks. A
 * request decoding joins before its prompt phase ends, so none starts mid-prompt unseen. The
 * prompt keeps the engine: a request queued behind it still finds its blocks committed. Logits
 * (n_vocab) of the last token. Before each slice or chunk it looks whether the client went away
 * (KVB_ERR_IO then: the blocks computed so far stay cached). Holding the engine. On the 1B shape
 * (2 cores) a slice of 128 halved a stream's longest pause against 256 (1.9 -> 1.0 s) at about
 * the same prompt time; 64 cost the prompt ~8 % (bench/history/2026-12-05.md). */
#define PROMPT_SLICE 128
static kvb_status forward_prompt_sliced(kvb_decode_node *n, kvb_seq *s, const int32_t *toks, uint32_t n_toks,
                                          float *logits, kvb_completion_out *out, kvb_err *err) {
    for (uint32_t done = 0; done < n_toks;) {
        if (kvb_completion_cancelled(out)) return kvb_err_set(err, KVB_ERR_IO, "the client went away");
        const uint32_t slice = kvb_decode_batch_decoding(n->batch) ? PROMPT_SLICE : kvb_engine_max_batch(n->e);
        const uint32_t c = KVB_MIN(slice, n_toks - done);
        const bool last = done + c == n_toks;
        kvb_status st = kvb_decode_batch_forward_slice(n->batch, s, toks + done, c, last ? logits : NULL, err);
        if (st) return st;
        done += c;
    }
    return KVB_OK;
}

/* The index of the first of ids[0 .. k) outside the model's vocabulary (its logits' rows), or k. */
static size_t first_outside_vocab(const kvb_decode_node *n, const int32_t *ids, size_t k) {
    for (size_t i = 0; i < k; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= n->m->d.n_vocab) return i;
    return k;
}

/* Builds the prompt's token ids. Returns an HTTP status (0 = ok) with a message in err. */
static int prompt_tokens(kvb_decode_node *n, const kvb_completion_req *req, int32_t **ids, size_t *n_ids, kvb_err *err) {
    char *text = NULL;
    if (req->api == KVB_API_CHAT_COMPLETIONS) {
        if (n->fam_status) { /* the request cannot be rendered here: what to do, not a server fault */
            kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s", n->fam_error);
            return 400;
        }
        if (kvb_chat_render(n->fam, req->messages, req->n_messages, true, &text, err)) return 400;
    } else if (req->prompt_tokens) {
        const size_t bad = first_outside_vocab(n, req->prompt_tokens, req->n_prompt_tokens);
        if (bad < req->n_prompt_tokens) {
            kvb_err_set(err, KVB_ERR_INVALID, "prompt token %d is outside the vocabulary (0..%u)",
                        req->prompt_tokens[bad], n->m->d.n_vocab - 1);
            return 400;
        }
        *ids = malloc(sizeof(int32_t) * req->n_prompt_tokens);
        if (!*ids) return 500;
        memcpy(*ids, req->prompt_tokens, sizeof(int32_t) * req->n_prompt_tokens);
        *n_ids = req->n_prompt_tokens;
        return 0;
    }
    const char *t = text ? text : req->prompt;
    const bool chat = req->api == KVB_API_CHAT_COMPLETIONS;
    kvb_status st = kvb_tokenize(n->tok, t, strlen(t), chat || req->add_special_tokens, chat, ids, n_ids, err);
    free(text);
    return st ? 400 : 0;
}

/* Streams text while holding back anything that could still become a stop string. With match
 * false (the reply is still short of min_tokens, as vLLM reads it) stop strings are not looked
 * for: what is emitted then stays, and only a stop string that ends once the reply has min_tokens
 * tokens ends it. */
typedef struct {
    char *buf;
    size_t len, cap, emitted;
    bool stopped;
} stop_filter;

static kvb_status emit_filtered(kvb_completion_out *out, stop_filter *f, const kvb_completion_req *req, const char *piece,
                                bool match, bool flush) {
    size_t k = strlen(piece);
    if (f->len + k + 1 > f->cap) {
        size_t cap = (f->len + k + 1) * 2;
        char *nb = realloc(f->buf, cap);
        if (!nb) return KVB_ERR_NOMEM;
        f->buf = nb;
        f->cap = cap;
    }
    memcpy(f->buf + f->len, piece, k + 1);
    f->len += k;
    size_t safe = f->len;
    for (size_t s = 0; match && s < req->n_stop; s++) {
        const char *hit = strstr(f->buf + f->emitted, req->stop[s]);
        if (hit && (size_t)(hit - f->buf) < safe) {
            safe = (size_t)(hit - f->buf);
            f->stopped = true;
        }
    }
    if (!f->stopped && !flush)
        for (size_t s = 0; s < req->n_stop; s++) { /* keep a possible partial stop string back */
            size_t L = strlen(req->stop[s]);
            for (size_t j = L - 1; j > 0; j--)
                if (f->len >= j && f->len - j >= f->emitted && !memcmp(f->buf + f->len - j, req->stop[s], j)) {
                    if (f->len - j < safe) safe = f->len - j;
                    break;
                }
        }
    if (safe <= f->emitted) return KVB_OK;
    char save = f->buf[safe];
    f->buf[safe] = 0;
    kvb_status st = kvb_completion_emit(out, f->buf + f->emitted);
    f->buf[safe] = save;
    f->emitted = safe;
    return st;
}

/* A served completion's phases into kvbridge_request_phase_seconds: the bridge's only when it was
 * asked for (a declined request has none to report). */
static void observe_phases(kvb_decode_node *n, const kvb_usage *u) {
    kvb_metric_observe(n->m_phase, KVB_LABELS("tokenize"), u->tokenize_s);
    kvb_metric_observe(n->m_phase, KVB_LABELS("queue"), u->queue_s);
    kvb_metric_observe(n->m_phase, KVB_LABELS("lookup"), u->lookup_s);
    if (u->transfer_s > 0) {
        kvb_metric_observe(n->m_phase, KVB_LABELS("prefill"), u->prefill_s);
        kvb_metric_observe(n->m_phase, KVB_LABELS("transfer"), u->transfer_s);
    }
    kvb_metric_observe(n->m_phase, KVB_LABELS("native"), u->native_s);
    kvb_metric_observe(n->m_phase, KVB_LABELS("decode"), u->decode_s);
}

static bool is_stop_id(const kvb_completion_req *req, int32_t id) {
    for (size_t i = 0; i < req->n_stop_token_ids; i++)
        if (req->stop_token_ids[i] == id) return true;
    return false;
}

/* One choice of a reply, from the prompt's logits (n_vocab) in sequence s: with the engine held
 * (a prompt phase), its first token sampled; then the engine released and the rest decoded in the
 * batch with the other requests' steps, sampled (seed + c), checked against the JSON mode, stop
 * strings and max_new, and emitted with its logprobs; choice 0 echoes the prompt first when asked.
 * *reason: how it ended; *gone: the client went away; u->completion_tokens grows. */
static kvb_status decode_choice(kvb_decode_node *n, const kvb_completion_req *req, kvb_completion_out *out, kvb_seq *s,
                                float *logits, int64_t max_new, uint32_t c, const int32_t *toks, size_t n_tok,
                                char *lp_scratch, kvb_usage *u, kvb_finish_reason *reason, bool *gone, kvb_err *err) {
    kvb_sampler smp = {0};
    stop_filter sf = {0};
    kvb_reply_rules rules = {.min_tokens = req->min_tokens, .eog_ids = n->eog_ids, .n_eog = n->n_eog,
                             .stop_ids = req->stop_token_ids, .n_stop = req->n_stop_token_ids}; /* the sampler's constraint */
    kvb_status st = KVB_OK;
    kvb_sampler_opts so = {.temperature = (float)req->temperature, .top_k = req->top_k, .top_p = (float)req->top_p,
                           .seed = (req->has_seed ? (uint64_t)req->seed : (uint64_t)(kvb_now_s() * 1e6)) + c,
                           .frequency_penalty = (float)req->frequency_penalty,
                           .presence_penalty = (float)req->presence_penalty,
                           .bias_ids = req->logit_bias_ids, .bias_values = req->logit_bias_values,
                           .n_bias = (uint32_t)req->n_logit_bias,
                           .logprobs = req->logprobs, .top_logprobs = req->top_logprobs,
                           .constrain = req->json_object || req->min_tokens ? kvb_reply_constrain : NULL,
                           .constrain_ctx = &rules};
    kvb_json_init_schema(&rules.s, req->json_schema); /* NULL: any object (json_object) */
    if (req->json_object) st = kvb_json_masker_create(n->vocab_bytes, kvb_engine_pool(n->e), &rules.masker, err);
    if (!st) st = kvb_sampler_init(&smp, &so, n->m->d.n_vocab, err);
    /* the engine's pool is the sampler's only while the engine is held: here, for the first token,
     * then by the decode batch's leader, which samples each step's next token */
    kvb_sampler_use_pool(&smp, kvb_engine_pool(n->e));
    int32_t id = !st && max_new > 0 ? kvb_sample_penalized(&smp, logits) : 0;
    kvb_decode_batch_join(n->batch); /* before the next prompt phase can begin: it slices for us */
    engine_release(n);
    if (!st && c == 0 && req->echo && kvb_reply_emit_echo(n->tok, req, toks, n_tok, out)) {
        max_new = 0;
        *gone = true;
    }
    kvb_detok dt;
    kvb_detok_init(&dt, n->tok);
    char piece[1024];
    *reason = KVB_FINISH_LENGTH;
    kvb_decode_step step = {.s = s, .smp = &smp};
    for (int64_t i = 0; !st && i < max_new; i++) {
        if ((!req->ignore_eos && kvb_tokenizer_is_eog(n->tok, id)) || is_stop_id(req, id)) {
            *reason = KVB_FINISH_STOP;
            break;
        }
        u->completion_tokens++;
        if (req->json_object) { /* the mask let only tokens through that keep the reply a JSON prefix */
            if (!kvb_json_feed_token(&rules.s, n->vocab_bytes, id)) {
                st = kvb_err_set(err, KVB_ERR_INVALID, "JSON mode: token %d does not continue the JSON reply", id);
                break;
            }
        }
        if (req->logprobs && kvb_reply_send_logprobs(n->tok, out, &smp.last, false, lp_scratch)) {
            st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory recording the logprobs");
            break;
        }
        kvb_detok_push(&dt, id, piece, sizeof piece);
        if (emit_filtered(out, &sf, req, piece, i + 1 >= req->min_tokens, false)) { /* client gone */
            *gone = true;
            break;
        }
        if (sf.stopped || (req->json_object && kvb_json_complete(&rules.s))) { /* a stop string, or the object closed */
            *reason = KVB_FINISH_STOP;
            break;
        }
        if (i + 1 < max_new && kvb_seq_len(s) + 1 < n->cfg.max_ctx) { /* with the other requests' steps */
            rules.generated = i + 1;
            step.token = id;
            if ((st = kvb_decode_batch_step(n->batch, &step))) *err = step.err;
            id = step.next;
        } else if (i + 1 < max_new)
            break; /* context end */
    }
    kvb_decode_batch_leave(n->batch);
    if (!sf.stopped && !*gone) {
        kvb_detok_flush(&dt, piece, sizeof piece);
        emit_filtered(out, &sf, req, piece, true, true); /* the reply is over: min_tokens was reached or max_new */
    }
    kvb_sampler_free(&smp);
    free(sf.buf);
    kvb_json_masker_free(rules.masker);
    return st;
}

/* ---- a completion as stages over one request: admit -> lookup -> decide -> bridge -> native fill
 * -> decode -> emit ---------------------------------------------------------------------------- */

/* What the node decided for a prompt's uncached part: bridge it, or why not (the verdict's reason). */
typedef enum {
    DECIDE_BRIDGE,          /* ship the uncached whole blocks (and the tail) from the prefill node */
    DECIDE_PROMPT_LOGPROBS, /* echo with logprobs: every prompt row's logits are this node's own */
    DECIDE_TURNED_OFF,      /* the request turned bridging off */
    DECIDE_NO_PEER,         /* no prefill node configured */
    DECIDE_NOTHING_TO_SHIP, /* every whole block before the last token is cached */
    DECIDE_BELOW_THRESHOLD, /* fewer uncached tokens than the bridge threshold */
    DECIDE_PEER_DOWN,       /* the prefill node is unavailable */
} decode_decision;

typedef struct {
    kvb_decode_node *n;
    const kvb_completion_req *req;
    kvb_completion_out *out;
    int32_t *toks; /* (n_tok) the prompt */
    size_t n_tok;
    int64_t max_new;
    uint64_t need;        /* cache blocks reserved while it is served */
    double t_req, t_tok;  /* arrival; tokenized */
    kvb_usage u;
    kvb_seq *s;
    float *logits;        /* (n_vocab) the prompt's last token's */
    char *lp_scratch;     /* with logprobs: the tokens' bytes (kvb_reply_send_logprobs) */
    bool prompt_lp;       /* echo with logprobs: computed natively, row by row */
    uint32_t cached;      /* prompt tokens cached before */
    uint32_t adopted;     /* prompt tokens in the sequence before the native fill */
    uint32_t ship, tail;  /* whole blocks before the last prompt token end at ship; the partial block after */
    decode_decision decision;
    bool last_done;       /* the pipelined tail computed the last token (logits hold it) */
    double tail_wait_s;
    kvb_bridge_fault fault;  /* the last bridge attempt's (NONE: it delivered everything asked) */
    char fault_msg[160];
    uint32_t got, blocks_total; /* whole blocks bridged, of those asked for */
    bool tail_ok;            /* the bridged tail continues the sequence */
    char peer_msg[160];      /* DECIDE_PEER_DOWN: why, as the links say it (their kind first, whole words) */
    uint64_t *keys;          /* (ship / block_tokens) chain keys of the prompt's whole blocks (placement) */
    kvb_placement place;     /* DECIDE_BRIDGE: the peer chosen and why */
    int via[4];              /* the peers that bridged, in order (a resume may go to another) */
    uint32_t n_via;
    char peers_text[96];     /* their names, "A" or "A then B": usage.kvbridge.peer */
    char faults[3 * KVB_VERDICT_MAX]; /* the bridge attempts' faults, "; "-separated */
    kvb_err err;
} decode_request;

/* The verdict, from the decision and what the bridge did; *kind: its requests_total label. */
static void request_verdict(const decode_request *rq, char *verdict, const char **kind) {
    *kind = "declined";
    switch (rq->decision) {
    case DECIDE_PROMPT_LOGPROBS:
        kvb_verdict_format(verdict,
                           "declined: prompt logprobs (echo) need this node's own logits for every prompt token");
        return;
    case DECIDE_TURNED_OFF: kvb_verdict_format(verdict, "declined: bridging turned off for this request"); return;
    case DECIDE_NO_PEER: kvb_verdict_format(verdict, "declined: no prefill node configured"); return;
    case DECIDE_NOTHING_TO_SHIP:
        kvb_verdict_format(verdict, "declined: nothing to ship (%u of %zu prompt tokens cached)", rq->cached, rq->n_tok);
        return;
    case DECIDE_BELOW_THRESHOLD:
        kvb_verdict_format(verdict, "declined: %u uncached tokens are below the bridge threshold of %u",
                       rq->ship - rq->cached, rq->n->cfg.bridge_min_tokens);
        return;
    case DECIDE_PEER_DOWN: /* the link's short reason: its kind first, whole words */
        kvb_verdict_format(verdict, "declined: prefill node unavailable: %s", rq->peer_msg);
        return;
    case DECIDE_BRIDGE: break;
    }
    /* with several peers the verdict names the one(s) that bridged and why that one */
    char via[240] = ""; /* " (via " + peers (100) + ", resumed" + ": " + why (112) */
    if (rq->n->n_peers > 1 && rq->n_via)
        snprintf(via, sizeof via, " (via %s%s: %s)", rq->peers_text, rq->n_via > 1 ? ", resumed" : "",
                 rq->place.why);
    if (rq->got == rq->blocks_total && (rq->tail == 0 || rq->tail_ok) && !rq->fault) {
        *kind = "complete";
        kvb_verdict_format(verdict, "complete%s", via);
    } else if (rq->got == 0 && !rq->tail_ok &&
               (rq->fault == KVB_BRIDGE_FAULT_PEER_ERROR || rq->fault == KVB_BRIDGE_FAULT_PEER_BUSY)) {
        /* the prefill node said no (busy, draining, a prompt past its context, ...): nothing was bridged */
        kvb_verdict_format(verdict, "declined%s: %s", via, rq->fault_msg);
    } else {
        *kind = "partial";
        kvb_verdict_format(verdict, "partial %u/%u%s: %s", rq->got, rq->blocks_total, via,
                       rq->fault ? rq->fault_msg : "blocks missing");
    }
}

/* Admit, part 1: the prompt's tokens. False when the request was answered with an error. */
static bool request_tokenize(decode_request *rq) {
    const kvb_completion_req *req = rq->req;
    rq->t_req = kvb_now_s();
    int status = prompt_tokens(rq->n, req, &rq->toks, &rq->n_tok, &rq->err);
    rq->t_tok = kvb_now_s();
    kvb_trace_span("decode.prompt_tokens", rq->t_req, rq->t_tok, rq->n_tok);
    if (status) {
        kvb_completion_fail(rq->out, status, NULL, req->api == KVB_API_CHAT_COMPLETIONS ? "messages" : "prompt", "%s",
                            rq->err.msg[0] ? rq->err.msg : "out of memory");
        return false;
    }
    if (rq->n_tok == 0) {
        kvb_completion_fail(rq->out, 400, NULL, "prompt", "the prompt is empty after tokenization");
        return false;
    }
    return true;
}

/* Admit, part 2: the context, the token ids the request names and the cache blocks it can need.
 * False when the request was answered with an error. */
static bool request_admit(decode_request *rq) {
    kvb_decode_node *n = rq->n;
    const kvb_completion_req *req = rq->req;
    const uint32_t ctx_max = n->cfg.max_ctx;
    rq->max_new = req->max_tokens;
    if (rq->max_new < 0) rq->max_new = req->api == KVB_API_CHAT_COMPLETIONS ? n->cfg.default_max_tokens : 16;
    if (rq->n_tok + (uint64_t)rq->max_new > ctx_max) {
        if (req->max_tokens >= 0 || rq->n_tok >= ctx_max) {
            kvb_completion_fail(rq->out, 400, "context_length_exceeded", "messages",
                                "this model's context is %u tokens; the prompt has %zu and %lld more were asked for "
                                "(the prompt is never truncated)",
                                ctx_max, rq->n_tok, (long long)rq->max_new);
            return false;
        }
        rq->max_new = ctx_max - (int64_t)rq->n_tok;
    }
    const size_t bad_stop = first_outside_vocab(n, req->stop_token_ids, req->n_stop_token_ids);
    if (bad_stop < req->n_stop_token_ids) {
        kvb_completion_fail(rq->out, 400, NULL, "stop_token_ids",
                            "Invalid token %d in 'stop_token_ids': this model's vocabulary has %u tokens.",
                            req->stop_token_ids[bad_stop], n->m->d.n_vocab);
        return false;
    }
    const size_t bad_bias = first_outside_vocab(n, req->logit_bias_ids, req->n_logit_bias);
    if (bad_bias < req->n_logit_bias) {
        kvb_completion_fail(rq->out, 400, NULL, "logit_bias",
                            "Invalid key %d in 'logit_bias': this model's vocabulary has %u tokens (0..%u).",
                            req->logit_bias_ids[bad_bias], n->m->d.n_vocab, n->m->d.n_vocab - 1);
        return false;
    }
    rq->need = blocks_needed(n, rq->n_tok, (uint64_t)rq->max_new);
    if (rq->need > n->cfg.cache_blocks) {
        kvb_completion_fail(rq->out, 400, "context_length_exceeded", "max_tokens",
                            "the prompt (%zu tokens) and max_tokens (%lld) need %llu blocks of this node's cache, "
                            "which holds %u; lower max_tokens, or start the node with a larger --cache-blocks",
                            rq->n_tok, (long long)rq->max_new, (unsigned long long)rq->need, n->cfg.cache_blocks);
        return false;
    }
    return true;
}

/* Look up the prefix cache (holding the engine): the request's sequence with the cached prefix,
 * and where the shipped range ends. */
static kvb_status request_lookup(decode_request *rq) {
    kvb_decode_node *n = rq->n;
    const double t_lookup = kvb_now_s();
    rq->logits = malloc(sizeof(float) * n->m->d.n_vocab);
    kvb_status st = rq->logits ? kvb_seq_create(n->e, &rq->s, &rq->err)
                               : kvb_err_set(&rq->err, KVB_ERR_NOMEM, "out of memory");
    /* echo with logprobs: every prompt token's logprob needs the row before it, which only this
     * node's own forward has (neither a cached nor a bridged prefix keeps logits) */
    rq->prompt_lp = rq->req->echo && rq->req->logprobs;
    if (!st && rq->req->logprobs) {
        rq->lp_scratch = malloc((size_t)(1 + KVB_MAX_TOP_LOGPROBS) * kvb_tokenizer_max_token_len(n->tok));
        if (!rq->lp_scratch) st = kvb_err_set(&rq->err, KVB_ERR_NOMEM, "out of memory for the logprobs");
    }
    if (!st && !rq->prompt_lp) st = kvb_seq_attach_cached(rq->s, rq->toks, (uint32_t)rq->n_tok, &rq->cached, &rq->err);
    rq->adopted = rq->cached;
    rq->u.lookup_s = kvb_now_s() - t_lookup;
    /* ship: whole blocks before the last prompt token; tail: the partial block after them, also
     * before the last prompt token, whose logits the decoder always computes itself */
    const uint32_t bt = n->cfg.block_tokens;
    rq->ship = (uint32_t)((rq->n_tok - 1) / bt * bt);
    rq->tail = (uint32_t)(rq->n_tok - 1) - rq->ship;
    return st;
}

/* Decide: bridge the uncached part, or why not (the link's lanes are asked for only when all else
 * says yes; the link answers at once, up or not). */
static decode_decision request_decide(decode_request *rq) {
    kvb_decode_node *n = rq->n;
    if (rq->prompt_lp) return DECIDE_PROMPT_LOGPROBS;
    if (rq->req->bridge == KVB_BRIDGE_OFF) return DECIDE_TURNED_OFF;
    if (!n->n_peers) return DECIDE_NO_PEER;
    if (rq->ship <= rq->cached) return DECIDE_NOTHING_TO_SHIP;
    if (rq->ship - rq->cached < n->cfg.bridge_min_tokens && rq->req->bridge != KVB_BRIDGE_FORCE)
        return DECIDE_BELOW_THRESHOLD;
    kvb_err perr = {0};
    const uint32_t bt = n->cfg.block_tokens, nb = rq->ship / bt;
    rq->keys = malloc(sizeof(uint64_t) * (nb ? nb : 1));
    if (!rq->keys) {
        snprintf(rq->peer_msg, sizeof rq->peer_msg, "out of memory placing the request");
        return DECIDE_PEER_DOWN;
    }
    uint64_t key = n->chain_root;
    for (uint32_t b = 0; b < nb; b++) rq->keys[b] = key = kvb_chain_next(key, rq->toks + (size_t)b * bt, bt);
    if (kvb_peer_set_place(n->peers, rq->keys, nb, &rq->place, &n->lanes, &n->n_lanes, &perr)) {
        snprintf(rq->peer_msg, sizeof rq->peer_msg, "%.150s", perr.msg);
        kvb_metric_add(n->m_faults, KVB_LABELS(kvb_bridge_fault_name(KVB_BRIDGE_FAULT_PEER_DOWN)), 1);
        return DECIDE_PEER_DOWN;
    }
    n->lanes_peer = rq->place.peer;
    return DECIDE_BRIDGE;
}

/* Whether a bridge attempt that stopped short is worth resuming: a link fault a resumed attempt
 * can repair (kvb_bridge_fault_resumable), at least the bridge threshold of tokens still missing,
 * and the node's resume budget not spent. The store keeps every block that arrived and verified,
 * so a resumed attempt asks only for the rest. */
static bool resume_worth_it(const decode_request *rq, const bridge_outcome *o) {
    return kvb_bridge_fault_resumable(o->rx.fault) && rq->adopted < rq->ship &&
           rq->ship - rq->adopted >= rq->n->cfg.bridge_min_tokens && rq->u.bridge_attempts <= rq->n->cfg.bridge_resumes;
}

/* Adopts the bridged tail after the whole blocks (with the pipelined tail's result, its page also
 * holds the last token's row), or gives its page back. */
static void request_adopt_tail(decode_request *rq, const bridge_outcome *o, kvb_status st) {
    const kvb_block_id tail_pg = o->rx.last_ready ? o->rx.last_page : o->rx.tail_page;
    const uint32_t tail_n = o->rx.last_ready ? rq->tail + 1 : rq->tail;
    /* the tail continues the chain only when every block before it is there */
    if (!st && tail_pg != KVB_BLOCK_NONE && rq->adopted == rq->ship &&
        !kvb_seq_adopt_tail(rq->s, tail_pg, rq->toks + rq->ship, tail_n, &rq->err)) {
        rq->tail_ok = true;
        rq->adopted += tail_n;
        rq->last_done = o->rx.last_ready;
    } else if (tail_pg != KVB_BLOCK_NONE) {
        kvb_block_id unused = tail_pg;
        kvb_store_release(rq->n->store, &unused, 1, NULL); /* its page goes back */
        memset(&rq->err, 0, sizeof rq->err);
    }
}

/* A peer joins the request's list of those that bridged (its names: "A", "A then B"). */
static void via_add(decode_request *rq, int peer) {
    if (peer < 0 || (rq->n_via && rq->via[rq->n_via - 1] == peer) || rq->n_via >= KVB_ARRAY_LEN(rq->via)) return;
    rq->via[rq->n_via++] = peer;
    const size_t len = strlen(rq->peers_text);
    snprintf(rq->peers_text + len, sizeof rq->peers_text - len, "%s%s", len ? " then " : "",
             kvb_peer_set_name(rq->n->peers, peer));
}

/* The lanes for a resumed attempt after a fault on `failed`'s: when its link was dropped, another
 * peer that is up (any prefill node computes the missing blocks; the first may be gone); else the
 * same peer once it has dialled again. False (the fault noted) when there is none. */
static bool resume_lanes(decode_request *rq, int failed, bool dropped) {
    kvb_decode_node *n = rq->n;
    if (dropped && n->n_peers > 1) {
        const int other = kvb_peer_set_other(n->peers, failed, &n->lanes, &n->n_lanes);
        if (other >= 0) {
            n->lanes_peer = other;
            return true;
        }
    }
    kvb_err perr = {0};
    if (peer_lanes_again(n, failed, &perr)) { /* the peer is gone: the verdict keeps the attempt's fault */
        kvb_metric_add(n->m_faults, KVB_LABELS(kvb_bridge_fault_name(KVB_BRIDGE_FAULT_PEER_DOWN)), 1);
        faults_append(rq->faults, sizeof rq->faults, "not resumed: ", perr.msg);
        return false;
    }
    return true;
}

/* A peer refused the request as busy (nothing was sent): with several peers, the next one by
 * placement that has not refused it yet, its lanes lent, and the placement's reason names the busy
 * one. False when there is none (the lanes of one taken stay lent until the caller releases them). */
static bool busy_elsewhere(decode_request *rq, int busy, uint32_t *refused) {
    kvb_decode_node *n = rq->n;
    *refused |= 1u << busy;
    if (n->n_peers < 2) return false;
    release_peer(n);
    const int other = kvb_peer_set_other(n->peers, busy, &n->lanes, &n->n_lanes);
    if (other < 0) return false;
    n->lanes_peer = other;
    if (*refused & (1u << other)) return false;
    snprintf(rq->place.why, sizeof rq->place.why, "%.90s busy", kvb_peer_set_name(n->peers, busy));
    return true;
}

/* Bridge: attempts until the blocks are in or a fault is not worth resuming (a resumed attempt
 * asks only for the blocks still missing, of another peer when the first dropped), then the
 * sequence adopts what arrived, and the peer that produced its last block is remembered. */
static kvb_status request_bridge(decode_request *rq) {
    kvb_decode_node *n = rq->n;
    const uint32_t bt = n->cfg.block_tokens;
    kvb_seq_free(rq->s); /* the cached prefix is re-adopted below, with what arrived */
    rq->s = NULL;
    rq->blocks_total = (rq->ship - rq->cached) / bt;
    bridge_outcome o;
    kvb_status st;
    int producer = -1; /* the peer whose attempt last added blocks */
    uint32_t refused_busy = 0; /* peers that refused it as busy */
    for (;;) {
        const int peer = n->lanes_peer;
        const uint32_t before = rq->adopted;
        const double t_br = kvb_now_s();
        bridge_blocks(n, rq->toks, (uint32_t)rq->n_tok, rq->adopted, rq->ship, rq->tail, rq->logits, rq->out, &o);
        kvb_trace_span("decode.bridge", t_br, kvb_now_s(), rq->ship - rq->adopted);
        rq->u.bridge_attempts++;
        rq->u.transfer_s += o.transfer_s;
        rq->u.prefill_s += o.rx.prefill_s;
        rq->tail_wait_s = o.rx.tail_wait_s;
        if (o.rx.fault) { /* for usage.kvbridge, named by peer when there are several */
            char label[80] = "";
            if (n->n_peers > 1) snprintf(label, sizeof label, "%.70s: ", kvb_peer_set_name(n->peers, peer));
            faults_append(rq->faults, sizeof rq->faults, label, o.rx.fault_msg);
        }
        st = kvb_seq_create(n->e, &rq->s, &rq->err);
        if (!st) st = kvb_seq_attach_cached(rq->s, rq->toks, (uint32_t)rq->n_tok, &rq->adopted, &rq->err);
        if (!st && o.rx.fault == KVB_BRIDGE_FAULT_PEER_BUSY && busy_elsewhere(rq, peer, &refused_busy)) {
            kvb_seq_free(rq->s); /* nothing arrived: the next peer by placement is asked */
            rq->s = NULL;
            continue;
        }
        if (o.rx.fault != KVB_BRIDGE_FAULT_PEER_BUSY) via_add(rq, peer);
        if (!st && rq->adopted > before) producer = peer;
        if (st || !resume_worth_it(rq, &o) || !resume_lanes(rq, peer, o.rx.drop_link)) break;
        kvb_seq_free(rq->s); /* adopted again after the next attempt */
        rq->s = NULL;
        kvb_metric_add(n->m_resumes, NULL, 1);
    }
    release_peer(n); /* the lanes a fault did not drop */
    rq->got = rq->adopted > rq->cached ? (rq->adopted - rq->cached) / bt : 0;
    if (producer >= 0 && rq->adopted / bt > rq->cached / bt && rq->adopted / bt <= rq->ship / bt)
        kvb_peer_set_record(n->peers, rq->keys[rq->adopted / bt - 1], producer);
    request_adopt_tail(rq, &o, st);
    rq->fault = o.rx.fault;
    snprintf(rq->fault_msg, sizeof rq->fault_msg, "%s", o.rx.fault_msg);
    rq->u.bridged_tokens = (int64_t)rq->got * bt + (rq->tail_ok ? rq->tail : 0);
    rq->u.bridge_faults = rq->faults;
    return st;
}

/* Native fill: the prompt tokens this node computes itself (all of them with prompt logprobs;
 * none when the pipelined tail computed the last one). */
static kvb_status request_native_fill(decode_request *rq) {
    kvb_decode_node *n = rq->n;
    rq->u.cached_tokens = rq->cached;
    rq->u.native_tokens = (int64_t)rq->n_tok - (int64_t)rq->adopted + (rq->last_done ? 1 : 0); /* the decoder's own */
    const double t_native = kvb_now_s();
    kvb_status st = KVB_OK;
    if (!rq->last_done)
        st = rq->prompt_lp ? kvb_reply_prompt_logprobs(n->e, n->batch, n->tok, n->m->d.n_vocab, rq->s, rq->toks,
                                                       (uint32_t)rq->n_tok, rq->req->top_logprobs, rq->logits, rq->out,
                                                       rq->lp_scratch, &rq->err)
                           : forward_prompt_sliced(n, rq->s, rq->toks + rq->adopted, (uint32_t)rq->n_tok - rq->adopted,
                                                   rq->logits, rq->out, &rq->err);
    rq->u.native_s = rq->last_done ? rq->tail_wait_s : kvb_now_s() - t_native; /* pipelined: what ran on after DONE */
    kvb_trace_span("decode.native", t_native, kvb_now_s(), rq->u.native_tokens);
    rq->u.native_pipelined = rq->last_done;
    return st;
}

/* Decode: the choices, one after another (n > 1), the engine released by the first token of each.
 * *reason: how the last one ended. */
static kvb_status request_decode(decode_request *rq, kvb_finish_reason *reason) {
    kvb_decode_node *n = rq->n;
    const double t_decode = kvb_now_s();
    kvb_status st;
    for (uint32_t c = 0;; c++) {
        bool gone = false;
        st = decode_choice(n, rq->req, rq->out, rq->s, rq->logits, rq->max_new, c, rq->toks, rq->n_tok,
                           rq->lp_scratch, &rq->u, reason, &gone, &rq->err);
        if (st || gone || c + 1 >= rq->req->n) break;
        if ((st = kvb_completion_next_choice(rq->out, *reason))) break;
        /* the next choice's sequence: the prompt's blocks from the cache, its tail computed again */
        kvb_seq_keep_window_at(rq->s, (uint32_t)rq->n_tok);
        kvb_seq_free(rq->s);
        rq->s = NULL;
        engine_acquire(n);
        uint32_t again = 0;
        st = kvb_seq_create(n->e, &rq->s, &rq->err);
        if (!st) st = kvb_seq_attach_cached(rq->s, rq->toks, (uint32_t)rq->n_tok, &again, &rq->err);
        if (!st)
            st = forward_prompt_sliced(n, rq->s, rq->toks + again, (uint32_t)rq->n_tok - again, rq->logits, rq->out,
                                       &rq->err);
        if (st) {
            engine_release(n);
            break;
        }
    }
    rq->u.decode_s = kvb_now_s() - t_decode;
    kvb_trace_span("decode.sample_emit", t_decode, kvb_now_s(), rq->u.completion_tokens);
    return st;
}

/* The prompt phase, holding the engine: lookup, decide, bridge, native fill; then the verdict and
 * the token counts. KVB_ERR_IO: the client went away. On failure the engine is released. */
static kvb_status request_prompt(decode_request *rq) {
    kvb_decode_node *n = rq->n;
    kvb_status st = request_lookup(rq);
    if (!st) {
        rq->decision = request_decide(rq);
        if (rq->decision == DECIDE_BRIDGE) st = request_bridge(rq);
    }
    if (!st) st = request_native_fill(rq);
    if (st) {
        engine_release(n);
        return st;
    }
    char verdict[KVB_VERDICT_MAX];
    const char *kind;
    request_verdict(rq, verdict, &kind);
    kvb_completion_set_verdict(rq->out, verdict);
    kvb_metric_add(n->m_requests, KVB_LABELS(kind), 1);
    for (uint32_t i = 0; i < rq->n_via; i++) kvb_peer_set_count_request(n->peers, rq->via[i], kind);
    rq->u.peer = rq->peers_text;
    rq->u.placement = rq->decision == DECIDE_BRIDGE ? kvb_placement_names[rq->place.result] : "";
    kvb_metric_add(n->m_tokens, KVB_LABELS("cached"), (double)rq->u.cached_tokens);
    kvb_metric_add(n->m_tokens, KVB_LABELS("bridged"), (double)rq->u.bridged_tokens);
    kvb_metric_add(n->m_tokens, KVB_LABELS("native"), (double)rq->u.native_tokens);
    return KVB_OK;
}

static void handle_completion(void *ctx, const kvb_completion_req *req, kvb_completion_out *out) {
    decode_request rq = {.n = ctx, .req = req, .out = out};
    kvb_decode_node *n = rq.n;
    if (!request_tokenize(&rq) || !request_admit(&rq)) {
        free(rq.toks);
        return;
    }
    const double t_acq = kvb_now_s();
    slot_acquire(n, rq.need);
    engine_acquire(n);
    kvb_trace_span("decode.engine_acquire", t_acq, kvb_now_s(), 0);
    rq.u = (kvb_usage){.prompt_tokens = (int64_t)rq.n_tok, .tokenize_s = rq.t_tok - rq.t_req,
                       .queue_s = kvb_now_s() - t_acq};
    kvb_status st = KVB_OK;
    if (kvb_completion_cancelled(out)) { /* gone while it waited its turn: nothing to compute for */
        engine_release(n);
        kvb_metric_add(n->m_abandoned, NULL, 1);
    } else if ((st = request_prompt(&rq))) {
        if (st == KVB_ERR_IO) kvb_metric_add(n->m_abandoned, NULL, 1); /* a client gone: nobody to answer */
        else kvb_completion_fail(out, st == KVB_ERR_RANGE ? 503 : 500, NULL, NULL, "%s", rq.err.msg);
    } else {
        kvb_finish_reason reason = KVB_FINISH_LENGTH;
        st = request_decode(&rq, &reason);
        if (st && st != KVB_ERR_IO) kvb_completion_fail(out, 500, NULL, NULL, "%s", rq.err.msg);
        else { /* emit (a client gone: the finish goes nowhere) */
            kvb_completion_finish(out, reason, &rq.u);
            observe_phases(n, &rq.u);
        }
        kvb_trace_span("decode.request", rq.t_req, kvb_now_s(), rq.n_tok); /* to the reply's end */
    }
    free(rq.lp_scratch);
    if (rq.s) kvb_seq_keep_window_at(rq.s, (uint32_t)rq.n_tok); /* a next turn may diverge where the reply began */
    kvb_seq_free(rq.s); /* its blocks stay cached for the next turn */
    slot_release(n, rq.need);
    free(rq.logits);
    free(rq.keys);
    free(rq.toks);
}

/* POST /tokenize: the ids a completion with this prompt or these messages computes. */
static int handle_tokenize(void *ctx, const kvb_completion_req *req, int32_t **ids, size_t *n_ids, uint32_t *max_model_len,
                           kvb_http_error *e) {
    kvb_decode_node *n = ctx;
    kvb_err err = {0};
    const int status = prompt_tokens(n, req, ids, n_ids, &err);
    if (status) {
        kvb_http_error_set(e, status, NULL, req->api == KVB_API_CHAT_COMPLETIONS ? "messages" : "prompt", "%s",
                           err.msg[0] ? err.msg : "out of memory");
        return status;
    }
    *max_model_len = n->cfg.max_ctx;
    return 0;
}

/* POST /detokenize: the text of the ids, special tokens shown (the inverse of /tokenize). */
static int handle_detokenize(void *ctx, const kvb_completion_req *req, char **text, kvb_http_error *e) {
    kvb_decode_node *n = ctx;
    const size_t bad = first_outside_vocab(n, req->prompt_tokens, req->n_prompt_tokens);
    if (bad < req->n_prompt_tokens) {
        char param[32];
        snprintf(param, sizeof param, "tokens[%zu]", bad);
        kvb_http_error_set(e, 400, NULL, param, "Token %d is outside the vocabulary (0..%u).", req->prompt_tokens[bad],
                           n->m->d.n_vocab - 1);
        return 400;
    }
    const size_t piece_cap = kvb_tokenizer_max_token_len(n->tok) + 8;
    char *out = malloc((req->n_prompt_tokens + 1) * piece_cap + 1); /* every piece fits its slot */
    if (!out) {
        kvb_http_error_set(e, 500, NULL, NULL, "out of memory");
        return 500;
    }
    kvb_detok dt;
    kvb_detok_init(&dt, n->tok);
    dt.show_special = true;
    size_t len = 0;
    for (size_t i = 0; i < req->n_prompt_tokens; i++) len += kvb_detok_push(&dt, req->prompt_tokens[i], out + len, piece_cap);
    len += kvb_detok_flush(&dt, out + len, piece_cap);
    out[len] = 0;
    *text = out;
    return 0;
}

static void handle_health(void *ctx, cJSON *body) {
    kvb_decode_node *n = ctx;
    char why[sizeof(((kvb_err *)0)->msg) + 64] = ""; /* the link's whole story, while not up */
    const kvb_peer_state ps = kvb_peer_set_summary(n->peers, why, sizeof why);
    cJSON_AddStringToObject(body, "peer", n->n_peers ? kvb_peer_state_name(ps) : "none");
    if (why[0]) cJSON_AddStringToObject(body, "peer_reason", why);
    if (n->n_peers > 1) cJSON_AddItemToObject(body, "peers", kvb_peer_set_json(n->peers));
    kvb_store_stats st;
    kvb_store_get_stats(n->store, &st);
    cJSON_AddNumberToObject(body, "cache_blocks_committed", st.committed);
    cJSON_AddNumberToObject(body, "cache_blocks_free", st.free);
    pthread_mutex_lock(&n->mu);
    const uint64_t served = n->n_served, waiting = n->slot_next - n->slot_admit, reserved = n->blocks_reserved;
    pthread_mutex_unlock(&n->mu);
    cJSON_AddNumberToObject(body, "cache_blocks_reserved", (double)reserved);
    cJSON_AddNumberToObject(body, "parallel", (double)n->cfg.parallel);
    cJSON_AddNumberToObject(body, "requests_served", (double)served);
    cJSON_AddNumberToObject(body, "requests_waiting", (double)waiting);
}

/* The bridge in flight, if any, as {"request_id", "prompt_tokens", "cached_tokens", "ship_tokens",
 * "elapsed_s", "slabs", "bytes", "bytes_per_s", "layers": [share of the shipped tokens arrived, one
 * per layer], "layers_complete"}: what the page draws as progress by layer. */
static cJSON *live_bridge_json(kvb_decode_node *n) {
    cJSON *arr = cJSON_CreateArray();
    pthread_mutex_lock(&n->live_mu);
    const live_bridge *lb = &n->live;
    kvb_bridge_receiver *r = lb->rx;
    cJSON *b = r && arr ? cJSON_CreateObject() : NULL;
    cJSON *layers = b ? cJSON_AddArrayToObject(b, "layers") : NULL;
    if (layers) {
        const double elapsed = kvb_now_s() - lb->t0;
        const uint64_t bytes = kvb_bridge_receiver_bytes(r);
        cJSON_AddNumberToObject(b, "request_id", (double)lb->id);
        cJSON_AddNumberToObject(b, "prompt_tokens", lb->prompt);
        cJSON_AddNumberToObject(b, "cached_tokens", lb->cached);
        cJSON_AddNumberToObject(b, "ship_tokens", lb->ship_to - lb->cached);
        cJSON_AddNumberToObject(b, "elapsed_s", elapsed);
        cJSON_AddNumberToObject(b, "slabs", kvb_bridge_receiver_slabs(r));
        cJSON_AddNumberToObject(b, "bytes", (double)bytes);
        cJSON_AddNumberToObject(b, "bytes_per_s", elapsed > 0 ? (double)bytes / elapsed : 0);
        uint32_t n_p = 0, complete = 0;
        kvb_slab_pending *const *p = kvb_bridge_receiver_pending(r, &n_p);
        const uint32_t nb = kvb_bridge_receiver_blocks(r), bt = n->cfg.block_tokens;
        const double total = (double)nb * bt + kvb_bridge_receiver_tail_tokens(r);
        for (uint32_t l = 0; l < n->m->d.n_layer; l++) { /* (layer): tokens arrived / shipped */
            double missing = 0;
            for (uint32_t i = 0; i < n_p; i++) missing += kvb_store_slab_layer_missing(p[i], l);
            complete += missing == 0;
            cJSON_AddItemToArray(layers, cJSON_CreateNumber(total > 0 ? (total - missing) / total : 1));
        }
        cJSON_AddNumberToObject(b, "layers_complete", complete);
        cJSON_AddItemToArray(arr, b);
    } else {
        cJSON_Delete(b);
    }
    pthread_mutex_unlock(&n->live_mu);
    return arr;
}

/* GET /v1/kvbridge/status: the peer, the bridge in flight, the link's bytes, the cache, the queue
 * and the prompt tokens by source so far: what /health and /metrics tell, as one object. */
static void handle_status(void *ctx, cJSON *body) {
    kvb_decode_node *n = ctx;
    char why[sizeof(((kvb_err *)0)->msg) + 64] = "";
    const kvb_peer_state ps = kvb_peer_set_summary(n->peers, why, sizeof why);
    cJSON *peer = cJSON_AddObjectToObject(body, "peer"); /* the first peer, or the summary of several */
    if (peer) {
        cJSON_AddStringToObject(peer, "addr", n->n_peers ? kvb_peer_set_addr(n->peers, 0) : "");
        cJSON_AddStringToObject(peer, "state", n->n_peers ? kvb_peer_state_name(ps) : "none");
        cJSON_AddStringToObject(peer, "reason", why);
        cJSON_AddNumberToObject(peer, "lanes", n->cfg.lanes);
    }
    cJSON_AddItemToObject(body, "peers", kvb_peer_set_json(n->peers));
    cJSON_AddItemToObject(body, "bridges", live_bridge_json(n));
    cJSON *link = cJSON_AddObjectToObject(body, "link");
    pthread_mutex_lock(&n->live_mu); /* the bytes of the finished bridges, then the one in flight */
    const double bytes = kvb_metric_value(n->m_slab_bytes, NULL) + (n->live.rx ? kvb_bridge_receiver_bytes(n->live.rx) : 0);
    pthread_mutex_unlock(&n->live_mu);
    if (link) cJSON_AddNumberToObject(link, "bytes_total", bytes);
    kvb_store_stats st;
    kvb_store_get_stats(n->store, &st);
    pthread_mutex_lock(&n->mu);
    const uint64_t served = n->n_served, waiting = n->slot_next - n->slot_admit, reserved = n->blocks_reserved;
    pthread_mutex_unlock(&n->mu);
    cJSON *cache = cJSON_AddObjectToObject(body, "cache");
    if (cache) {
        cJSON_AddNumberToObject(cache, "blocks", st.n_blocks);
        cJSON_AddNumberToObject(cache, "block_tokens", n->cfg.block_tokens);
        cJSON_AddNumberToObject(cache, "committed", st.committed);
        cJSON_AddNumberToObject(cache, "in_use", st.referenced + st.writing);
        cJSON_AddNumberToObject(cache, "free", st.free);
        cJSON_AddNumberToObject(cache, "reserved", (double)reserved);
    }
    cJSON *req = cJSON_AddObjectToObject(body, "requests");
    if (req) {
        cJSON_AddNumberToObject(req, "served", (double)served);
        cJSON_AddNumberToObject(req, "waiting", (double)waiting);
        cJSON_AddNumberToObject(req, "parallel", n->cfg.parallel);
    }
    cJSON *tok = cJSON_AddObjectToObject(body, "prompt_tokens");
    for (int i = 0; tok && i < 3; i++) {
        static const char *const src[] = {"cached", "bridged", "native"};
        cJSON_AddNumberToObject(tok, src[i], kvb_metric_value(n->m_tokens, KVB_LABELS(src[i])));
    }
}

/* The tokenizer's end-of-generation tokens that are rows of the logits (min_tokens bars them). */
static kvb_status collect_eog(kvb_decode_node *n, kvb_err *err) {
    size_t k = 0;
    const int32_t *eog = kvb_tokenizer_eog_ids(n->tok, &k);
    n->eog_ids = malloc(sizeof *n->eog_ids * (k + 1));
    if (!n->eog_ids) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < k; i++)
        if (eog[i] >= 0 && (uint32_t)eog[i] < n->m->d.n_vocab) n->eog_ids[n->n_eog++] = eog[i];
    return KVB_OK;
}

/* The chat family: the --chat-template override, or recognised from the model's template; a
 * model without one, or with one not recognised, keeps serving completions and answers chat
 * requests with a 400 that says what to do (n->fam_status, n->fam_error). */
static kvb_status chat_family(kvb_decode_node *n, const char *override, kvb_err *err) {
    if (override) return kvb_chat_family_from_name(override, &n->fam, err);
    const kvb_gguf_kv *kv = kvb_gguf_find(n->m->gguf, "tokenizer.chat_template");
    kvb_err why = {0};
    char *tmpl = kv && kv->type == KVB_GGUF_STRING ? strndup(kv->str.ptr, kv->str.len) : NULL;
    n->fam_status = tmpl ? kvb_chat_family_detect(tmpl, &n->fam, &why) : KVB_ERR_NOT_FOUND;
    if (!tmpl)
        snprintf(why.msg, sizeof why.msg,
                 "this model has no chat template: send the prompt to /v1/completions, or start the node with "
                 "--chat-template NAME (llama2, llama3, chatml, mistral, phi3 or gemma)");
    snprintf(n->fam_error, sizeof n->fam_error, "%s", why.msg);
    free(tmpl);
    return KVB_OK;
}

/* The node's metric families: type, name, help, label names, and the field that holds it. */
typedef struct {
    kvb_metric_type type;
    const char *name, *help, *label;
    size_t field; /* offsetof(kvb_decode_node, its kvb_metric *) */
} node_metric;

static const node_metric k_node_metrics[] = {
    {KVB_METRIC_COUNTER, "kvbridge_requests_total",
     "Completions served, by bridge verdict",
     "verdict", offsetof(kvb_decode_node, m_requests)},
    {KVB_METRIC_COUNTER, "kvbridge_prompt_tokens_total",
     "Prompt tokens by source: cached, bridged, native",
     "source", offsetof(kvb_decode_node, m_tokens)},
    {KVB_METRIC_COUNTER, "kvbridge_bridge_faults_total",
     "Bridging stopped short or declined by a fault, by kind",
     "kind", offsetof(kvb_decode_node, m_faults)},
    {KVB_METRIC_COUNTER, "kvbridge_bridge_resumes_total",
     "Bridge attempts resumed after a link fault, asking only for the blocks still "
     "missing",
     NULL, offsetof(kvb_decode_node, m_resumes)},
    {KVB_METRIC_COUNTER, "kvbridge_slab_bytes_total",
     "Cache bytes received as slabs",
     NULL, offsetof(kvb_decode_node, m_slab_bytes)},
    {KVB_METRIC_GAUGE, "kvbridge_queue_depth",
     "Completions waiting for their turn or being served (at most --parallel at once)",
     NULL, offsetof(kvb_decode_node, m_queue)},
    {KVB_METRIC_HISTOGRAM, "kvbridge_request_phase_seconds",
     "Where a served completion's time went, by phase (as in usage.kvbridge): tokenize, "
     "queue (waiting for the engine), lookup, prefill (the prefill node's own clock) "
     "and transfer (request to DONE) when bridged, native, decode",
     "phase", offsetof(kvb_decode_node, m_phase)},
    {KVB_METRIC_COUNTER, "kvbridge_decode_batches_total",
     "Batches of decode steps run (steps / batches: requests decoding together)",
     NULL, offsetof(kvb_decode_node, m_batches)},
    {KVB_METRIC_COUNTER, "kvbridge_decode_steps_total",
     "Decode steps run, one token of one request each, in batches",
     NULL, offsetof(kvb_decode_node, m_steps)},
    {KVB_METRIC_COUNTER, "kvbridge_prompts_abandoned_total",
     "Requests whose client went away while they waited their turn or before their "
     "native prompt was in: the rest was not computed (what was stays cached)",
     NULL, offsetof(kvb_decode_node, m_abandoned)},
    {KVB_METRIC_GAUGE, "kvbridge_cache_blocks_reserved",
     "Cache blocks reserved by the requests being served (each reserves what its "
     "prompt and max_tokens can fill; at most --cache-blocks)",
     NULL, offsetof(kvb_decode_node, m_reserved)},
    {KVB_METRIC_COUNTER, "kvbridge_cache_waits_total",
     "Requests that waited for cache blocks to be released before being served "
     "(often: a larger --cache-blocks would serve them at once)",
     NULL, offsetof(kvb_decode_node, m_cache_waits)},
    {KVB_METRIC_COUNTER, "kvbridge_decode_steps_in_prompts_total",
     "Of the decode steps, those run while another request's prompt held the engine: "
     "between slices of its native prefill and while its bridged layers arrived",
     NULL, offsetof(kvb_decode_node, m_in_prompts)},
};

/* The metrics registry /metrics renders and the node's families in it. */
static kvb_status register_metrics(kvb_decode_node *n, kvb_err *err) {
    kvb_status st = kvb_metrics_create(&n->metrics, err);
    for (size_t i = 0; !st && i < KVB_ARRAY_LEN(k_node_metrics); i++) {
        const node_metric *m = &k_node_metrics[i];
        st = kvb_metrics_register(n->metrics, m->type, m->name, m->help, m->label, NULL, 0,
                                  (kvb_metric **)((char *)n + m->field), err);
    }
    return st;
}

kvb_status kvb_decode_node_start(const kvb_decode_config *cfg, kvb_decode_node **out, kvb_err *err) {
    *out = NULL;
    kvb_decode_node *n = calloc(1, sizeof *n);
    if (!n) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    n->cfg = *cfg;
    kvb_decode_config *c = &n->cfg;
    pthread_mutex_init(&n->mu, NULL);
    pthread_cond_init(&n->cv, NULL);
    pthread_mutex_init(&n->live_mu, NULL);
    kvb_status st = kvb_model_load(cfg->model_path, &n->m, err);
    /* the engine reads the weights in place: every page now, not on the first request */
    if (!st) st = kvb_gguf_prefault(n->m->gguf, err);
    if (!st) st = kvb_tokenizer_load(n->m->gguf, &n->tok, err);
    if (!st) st = kvb_vocab_bytes_create(n->tok, &n->vocab_bytes, err);
    if (!st) st = collect_eog(n, err);
    if (st) goto fail;
    if (!c->block_tokens) c->block_tokens = 32;
    if (!c->max_ctx) c->max_ctx = n->m->d.n_ctx_train < 32768 ? n->m->d.n_ctx_train : 32768;
    if (!c->cache_blocks) c->cache_blocks = 4 * ((c->max_ctx + c->block_tokens - 1) / c->block_tokens);
    if (!c->bridge_min_tokens) c->bridge_min_tokens = 2 * c->block_tokens;
    if (!c->default_max_tokens) c->default_max_tokens = 256;
    if (!c->peer_timeout_ms) c->peer_timeout_ms = 10000;
    if (!c->bridge_resumes) c->bridge_resumes = 2;
    if (c->bridge_resumes < 0) c->bridge_resumes = 0;
    if (!c->lanes) c->lanes = KVB_DEFAULT_LANES;
    if (c->lanes > KVB_MAX_LANES) {
        st = kvb_err_set(err, KVB_ERR_INVALID, "--lanes %u: at most %d connections to the prefill node", c->lanes,
                         KVB_MAX_LANES);
        goto fail;
    }
    n->lanes_peer = -1;
    if (cfg->peer) n->n_peers = 1; /* the one-peer case, then the list */
    n->n_peers += cfg->n_peers;
    if (n->n_peers > KVB_MAX_PEERS) {
        st = kvb_err_set(err, KVB_ERR_INVALID, "%u prefill peers: at most %d", n->n_peers, KVB_MAX_PEERS);
        goto fail;
    }
    if (!c->peer_max_queue) c->peer_max_queue = 2;
    const char *base = strrchr(cfg->model_path, '/');
    n->model_id = strdup(cfg->model_id ? cfg->model_id : base ? base + 1 : cfg->model_path);
    if (!n->model_id) {
        st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if ((st = chat_family(n, cfg->chat_template, err))) goto fail;
    kvb_engine_opts eo = {.n_threads = cfg->n_threads, .cache_dtype = c->cache_dtype, .block_tokens = c->block_tokens,
                          .max_ctx = c->max_ctx, .n_blocks = c->cache_blocks};
    if ((st = kvb_engine_create(n->m, &eo, &n->e, err))) goto fail;
    n->store = kvb_engine_store(n->e);
    /* up to `parallel` served at once, each admitted when the blocks it can need fit the cache */
    if (!c->parallel) c->parallel = 4;
    if (c->parallel > KVB_DECODE_MAX_PARALLEL) {
        st = kvb_err_set(err, KVB_ERR_INVALID, "--parallel %u: at most %d requests are served at once", c->parallel,
                         KVB_DECODE_MAX_PARALLEL);
        goto fail;
    }

    kvb_store_prefault(n->store); /* page faults at start, not while the first prompts arrive */
    n->chain_root = kvb_chain_root(n->m->fingerprint, kvb_kvformat_fingerprint(kvb_engine_kvformat(n->e)));
    if (n->n_peers) {
        if (!cfg->psk || strlen(cfg->psk) < KVB_WIRE_PSK_MIN) {
            st = kvb_err_set(err, KVB_ERR_INVALID, "--peer needs a pre-shared key of at least %d bytes (--psk)",
                             KVB_WIRE_PSK_MIN);
            goto fail;
        }
        n->psk = strdup(cfg->psk);
        n->tcfg = (kvb_transport_config){.psk = (const uint8_t *)n->psk, .psk_len = strlen(n->psk),
                                         .backend = cfg->backend};
        if ((st = kvb_hello_init(&n->hello, KVB_ROLE_DECODE,
                                 cfg->prefill_mode ? KVB_BRIDGE_MODE_PREFILL : KVB_BRIDGE_MODE_DECODER,
                                 cfg->name && *cfg->name ? cfg->name : "decode",
                                 cfg->bench_filler_peer ? kvb_filler_fingerprint(n->m->fingerprint) : n->m->fingerprint,
                                 kvb_engine_kvformat(n->e), err)))
            goto fail;
    }
    /* the registry, its families and the decode batch before the server takes a request */
    if ((st = register_metrics(n, err))) goto fail;
    if ((st = kvb_decode_batch_create(n->e, c->parallel, n->m->d.n_vocab, n->m_batches, n->m_steps, n->m_in_prompts,
                                      &n->batch, err)))
        goto fail;
    kvb_http_config hc = {.listen = cfg->http_listen, .model_id = n->model_id, .accept_any_model = true,
                          .metrics = n->metrics, .api_key = cfg->api_key, .max_model_len = c->max_ctx,
                          .allow_origins = cfg->allow_origins};
    kvb_http_handlers hh = {.ctx = n, .completion = handle_completion, .health = handle_health, .status = handle_status,
                            .tokenize = handle_tokenize, .detokenize = handle_detokenize};
    { /* every link's thread dials now, before a request can ask for it */
        const char *specs[KVB_MAX_PEERS];
        uint32_t k = 0;
        if (cfg->peer) specs[k++] = cfg->peer;
        for (uint32_t i = 0; i < cfg->n_peers; i++) specs[k++] = cfg->peers[i];
        kvb_peer_set_config pc = {.peers = specs, .n_peers = k, .hello = &n->hello, .tcfg = &n->tcfg,
                                  .lanes = c->lanes, .connect_timeout_ms = PEER_DIAL_TIMEOUT_MS,
                                  .heartbeat_ms = PEER_HEARTBEAT_MS, .max_queue = c->peer_max_queue,
                                  .metrics = n->metrics};
        if ((st = kvb_peer_set_start(&pc, &n->peers, err))) goto fail;
    }
    if ((st = kvb_http_server_start(&hc, &hh, &n->http, err))) goto fail;
    /* the first attempts' outcomes are waited for here, not by a request (a peer not up by then is
     * passed over, or declined at once with the reason, and dialled again with back-off) */
    kvb_peer_set_wait_first(n->peers, PEER_DIAL_TIMEOUT_MS + 1000);
    *out = n;
    return KVB_OK;
fail:
    kvb_decode_node_stop(n);
    return st;
}

uint16_t kvb_decode_node_port(const kvb_decode_node *n) { return kvb_http_server_port(n->http); }
void kvb_decode_node_quiesce(kvb_decode_node *n) { kvb_http_server_quiesce(n->http); }
unsigned kvb_decode_node_in_flight(kvb_decode_node *n) { return kvb_http_server_in_flight(n->http); }

void kvb_decode_node_last_receive_waits(kvb_decode_node *n, double *reader_s, double *consumer_s) {
    engine_acquire(n); /* between requests */
    *reader_s = n->last_reader_wait_s;
    *consumer_s = n->last_consumer_wait_s;
    engine_release(n);
}

void kvb_decode_node_stop(kvb_decode_node *n) {
    if (!n) return;
    kvb_http_server_stop(n->http);
    kvb_peer_set_stop(n->peers); /* before the metrics their threads update */
    kvb_decode_batch_free(n->batch);
    kvb_metrics_free(n->metrics); /* after the server, whose families live in it */
    kvb_engine_free(n->e);
    kvb_tokenizer_free(n->tok);
    kvb_vocab_bytes_free(n->vocab_bytes);
    free(n->eog_ids);
    kvb_model_free(n->m);
    pthread_mutex_destroy(&n->mu);
    pthread_cond_destroy(&n->cv);
    pthread_mutex_destroy(&n->live_mu);
    free(n->psk);
    free(n->model_id);
    free(n);
}
