/* cli/cmd_verify_llamacpp.c — `kvbridge verify --target llama.cpp`: the cache a stock llama-server
 * computes for a prompt against the same cache computed by kvbridge's CPU engine and written in
 * llama.cpp's own state format (foreign/kvb_foreign.h). With --server, llama-server tokenizes the
 * prompt (/tokenize; kvbridge's tokenizer is compared with it), computes it in an erased slot 0 and
 * saves the slot (--slot-save-path DIR, given here as --slot-dir); with --slot-file a file saved
 * before is read instead. kvbridge then computes K/V (f16) for the file's tokens, lays them out as
 * the file does (its caches: one, or global then sliding-window layers; its streams, cells and V
 * transposition) and prints one row per cache, layer and K/V: identical rows of cells, or the
 * largest absolute difference. kvbridge's file is written beside the server's; with --restore it is
 * restored into slot 0 and a greedy completion of the same prompt is compared with llama-server's
 * own, checking from the reply's timings that only the tokens past the restored ones were computed. */
#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_engine_cpu.h"
#include "kvb_foreign.h"
#include "kvb_gguf.h"
#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvb_tokenizer.h"

#define SERVER_FILE "kvb-verify-server.bin"
#define OURS_FILE "kvb-verify-kvbridge.bin"
#define HTTP_TIMEOUT_MS 600000

typedef struct {
    char host[256];
    uint16_t port;
} server_addr;

static bool parse_url(const char *url, server_addr *a) {
    if (!strncmp(url, "http://", 7)) url += 7;
    const char *colon = strrchr(url, ':');
    if (!colon || colon == url || (size_t)(colon - url) >= sizeof a->host) return false;
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (p <= 0 || p > 65535 || (*end && strcmp(end, "/"))) return false;
    memcpy(a->host, url, (size_t)(colon - url));
    a->host[colon - url] = 0;
    a->port = (uint16_t)p;
    return true;
}

/* POSTs json to path; the parsed reply (caller deletes), or NULL after printing why (unless quiet:
 * a refusal the caller expects). */
static cJSON *post_json_q(const server_addr *a, const char *path, const char *json, bool quiet) {
    kvb_http_reply r = {0};
    kvb_err err = {0};
    if (kvb_http_post(a->host, a->port, path, json, HTTP_TIMEOUT_MS, &r, &err)) {
        fprintf(stderr, "kvbridge verify: llama-server %s:%u%s: %s\n", a->host, a->port, path, err.msg);
        return NULL;
    }
    cJSON *j = r.status == 200 ? cJSON_Parse(r.body) : NULL;
    if (!j && !quiet)
        fprintf(stderr, "kvbridge verify: llama-server %s: HTTP %d: %.400s\n", path, r.status, r.body ? r.body : "");
    kvb_http_reply_free(&r);
    return j;
}

static cJSON *post_json(const server_addr *a, const char *path, const char *json) {
    return post_json_q(a, path, json, false);
}

/* post_json of a request object, which it deletes. */
static cJSON *post_obj(const server_addr *a, const char *path, cJSON *req) {
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    cJSON *rep = body ? post_json(a, path, body) : NULL;
    free(body);
    return rep;
}

/* K and V rows kvbridge's CPU engine encodes, gathered per (layer, position). */
typedef struct {
    uint32_t n_layer, n_pos;
    size_t row;   /* bytes of one position's row: n_head_kv * head_dim f16 */
    uint8_t *k;   /* (layer, position, row) */
    uint8_t *v;
} kv_rows;

static kvb_status gather_rows(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n, const uint8_t *k_rows,
                              const uint8_t *v_rows, uint32_t dtype, kvb_err *err) {
    kv_rows *kv = ctx;
    if (dtype != KVB_TYPE_F16 || layer >= kv->n_layer || pos0 + n > kv->n_pos)
        return kvb_err_set(err, KVB_ERR_INTERNAL, "rows hook: layer %u, positions %u+%u, %s", layer, pos0, n,
                           kvb_type_name(dtype));
    const size_t off = ((size_t)layer * kv->n_pos + pos0) * kv->row;
    memcpy(kv->k + off, k_rows, n * kv->row);
    memcpy(kv->v + off, v_rows, n * kv->row);
    return KVB_OK;
}

static kvb_status compute_rows(const kvb_model *m, const int32_t *tokens, uint32_t n, int threads, bool ggml,
                               kv_rows *kv, kvb_err *err) {
    const kvb_model_desc *d = &m->d;
    *kv = (kv_rows){.n_layer = d->n_layer, .n_pos = n, .row = (size_t)d->n_head_kv * d->head_dim * 2};
    kv->k = malloc((size_t)d->n_layer * n * kv->row);
    kv->v = malloc((size_t)d->n_layer * n * kv->row);
    if (!kv->k || !kv->v) return kvb_err_set(err, KVB_ERR_NOMEM, "K/V rows of %u tokens", n);
    kvb_engine_opts o = {.n_threads = threads, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32,
                         .max_ctx = (n + 31) / 32 * 32 + 32, .rows_hook = gather_rows, .rows_hook_ctx = kv,
                         .ggml_arith = ggml};
    kvb_engine *e = NULL;
    kvb_seq *s = NULL;
    kvb_status st = kvb_engine_create(m, &o, &e, err);
    if (!st) st = kvb_seq_create(e, &s, err);
    if (!st) st = kvb_engine_forward(e, s, tokens, n, NULL, false, err);
    kvb_seq_free(s);
    kvb_engine_free(e);
    return st;
}

/* The model's layers of file cache c: all of them for one cache, else global (c = 0) then local. */
static uint32_t cache_layers(const kvb_model_desc *d, uint32_t n_cache, uint32_t c, uint32_t *layers) {
    uint32_t n = 0;
    for (uint32_t l = 0; l < d->n_layer; l++)
        if (n_cache == 1 || kvb_layer_is_local(d, l) == (c == 1)) layers[n++] = l;
    return n;
}

/* ours: the server's state with every row replaced by kvbridge's (same tokens, cells, layout). */
static kvb_status mirror_state(const kvb_llama_state *srv, const kvb_model_desc *d, const kv_rows *kv,
                               kvb_llama_state *ours, kvb_err *err) {
    *ours = *srv;
    for (uint32_t c = 0; c < KVB_LLAMA_MAX_CACHES; c++) ours->cache[c].k = ours->cache[c].v = NULL;
    for (uint32_t c = 0; c < srv->n_cache; c++) {
        const kvb_llama_cache *sc = &srv->cache[c];
        kvb_llama_cache *oc = &ours->cache[c];
        uint32_t layers[KVB_MAX_LAYERS];
        const uint32_t nl = cache_layers(d, srv->n_cache, c, layers);
        if (sc->n_cells == 0) continue;
        if (nl != sc->n_layer || sc->k_type != KVB_TYPE_F16 || sc->v_type != KVB_TYPE_F16 ||
            sc->k_row_bytes != kv->row || sc->v_row_bytes != kv->row)
            return kvb_err_set(err, KVB_ERR_MISMATCH, "the server's cache %u holds %u layers of %s/%s rows of "
                               "%llu B; this model has %u such layers of f16 rows of %zu B (run llama-server with "
                               "-ctk f16 -ctv f16)", c, sc->n_layer, kvb_type_name(sc->k_type),
                               kvb_type_name(sc->v_type), (unsigned long long)sc->k_row_bytes, nl, kv->row);
        oc->k = malloc((size_t)nl * sc->n_cells * kv->row);
        oc->v = malloc((size_t)nl * sc->n_cells * kv->row);
        if (!oc->k || !oc->v) return kvb_err_set(err, KVB_ERR_NOMEM, "mirrored cache %u", c);
        for (uint32_t i = 0; i < nl; i++)
            for (uint32_t t = 0; t < sc->n_cells; t++) {
                if ((uint32_t)sc->pos[t] >= kv->n_pos)
                    return kvb_err_set(err, KVB_ERR_FORMAT, "cell %u at position %d past the file's %u tokens", t,
                                       sc->pos[t], kv->n_pos);
                const size_t src = ((size_t)layers[i] * kv->n_pos + (size_t)sc->pos[t]) * kv->row;
                const size_t dst = ((size_t)i * sc->n_cells + t) * kv->row;
                memcpy(oc->k + dst, kv->k + src, kv->row);
                memcpy(oc->v + dst, kv->v + src, kv->row);
            }
    }
    return KVB_OK;
}

static void free_mirror(kvb_llama_state *ours) {
    for (uint32_t c = 0; c < KVB_LLAMA_MAX_CACHES; c++) free(ours->cache[c].k), free(ours->cache[c].v);
}

/* One printed row: cells whose row is identical, f16 elements that are, and the largest |a - b|. */
static bool compare_rows(const char *what, uint32_t model_layer, const char *kind, const uint8_t *a,
                         const uint8_t *b, uint32_t n_cells, size_t row) {
    uint32_t same = 0;
    uint64_t el_same = 0, el_all = (uint64_t)n_cells * (row / 2);
    double maxd = 0;
    for (uint32_t t = 0; t < n_cells; t++) {
        const uint8_t *x = a + (size_t)t * row, *y = b + (size_t)t * row;
        if (!memcmp(x, y, row)) {
            same++;
            el_same += row / 2;
            continue;
        }
        for (size_t i = 0; i + 1 < row; i += 2) {
            const uint16_t hx = (uint16_t)(x[i] | x[i + 1] << 8), hy = (uint16_t)(y[i] | y[i + 1] << 8);
            const double dd = fabs((double)kvb_fp16_to_f32(hx) - (double)kvb_fp16_to_f32(hy));
            el_same += hx == hy;
            if (dd > maxd || isnan(dd)) maxd = isnan(dd) ? INFINITY : dd;
        }
    }
    printf("  layer %2u %-6s %s  %5u/%-5u cells identical", model_layer, kind, what, same, n_cells);
    if (same == n_cells)
        printf("  bytes identical\n");
    else
        printf("  %6.2f%% of elements identical, max |diff| %.6g\n", el_all ? 100.0 * el_same / el_all : 0, maxd);
    return same == n_cells;
}

static uint32_t compare_states(const kvb_llama_state *srv, const kvb_llama_state *ours, const kvb_model_desc *d) {
    uint32_t short_rows = 0;
    for (uint32_t c = 0; c < srv->n_cache; c++) {
        const kvb_llama_cache *sc = &srv->cache[c], *oc = &ours->cache[c];
        uint32_t layers[KVB_MAX_LAYERS];
        cache_layers(d, srv->n_cache, c, layers);
        printf("  cache %u: %u cells (positions %d..%d), stream %u of %u, V %s\n", c, sc->n_cells,
               sc->n_cells ? sc->pos[0] : 0, sc->n_cells ? sc->pos[sc->n_cells - 1] : 0, sc->stream, sc->n_stream,
               sc->v_trans ? "transposed (no flash attention)" : "row-major (flash attention)");
        for (uint32_t l = 0; l < sc->n_layer; l++) {
            const char *kind = srv->n_cache == 1 ? "" : c == 0 ? "global" : "local";
            short_rows += !compare_rows("K", layers[l], kind, kvb_llama_k_row(sc, l, 0), kvb_llama_k_row(oc, l, 0),
                                        sc->n_cells, sc->k_row_bytes);
            short_rows += !compare_rows("V", layers[l], kind, kvb_llama_v_row(sc, l, 0), kvb_llama_v_row(oc, l, 0),
                                        sc->n_cells, sc->v_row_bytes);
        }
    }
    return short_rows;
}

/* llama-server's token ids for the prompt (BOS as the model says), and whether kvbridge's own
 * tokenizer gives the same; *ids malloc'd. */
static bool server_tokens(const server_addr *a, const char *model_path, const char *prompt, int32_t **ids,
                          uint32_t *n) {
    cJSON *req = cJSON_CreateObject();
    cJSON_AddStringToObject(req, "content", prompt);
    cJSON_AddBoolToObject(req, "add_special", 1);
    cJSON *rep = post_obj(a, "/tokenize", req);
    const cJSON *toks = rep ? cJSON_GetObjectItem(rep, "tokens") : NULL;
    const int nt = cJSON_IsArray(toks) ? cJSON_GetArraySize(toks) : 0;
    *n = 0;
    *ids = malloc((size_t)(nt > 0 ? nt : 1) * sizeof **ids);
    for (int i = 0; *ids && i < nt; i++) (*ids)[(*n)++] = (int32_t)cJSON_GetArrayItem(toks, i)->valuedouble;
    cJSON_Delete(rep);
    if (*n == 0) return false;
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = NULL;
    int32_t *ours = NULL;
    size_t n_ours = 0;
    kvb_err err = {0};
    if (kvb_gguf_open(model_path, &g, &err) || kvb_tokenizer_load(g, &t, &err) ||
        kvb_tokenize(t, prompt, strlen(prompt), true, true, &ours, &n_ours, &err))
        printf("  tokens: %u from llama-server's /tokenize; kvbridge's tokenizer: not run (%s)\n", *n, err.msg);
    else if (n_ours == *n && !memcmp(ours, *ids, *n * sizeof *ours))
        printf("  tokens: %u from llama-server's /tokenize; kvbridge's tokenizer gives the same ids\n", *n);
    else
        printf("  tokens: %u from llama-server's /tokenize; kvbridge's tokenizer DIFFERS (%zu ids)\n", *n, n_ours);
    free(ours);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
    return true;
}

/* A completion of ids in slot 0 with prompt caching on: its text and timings.prompt_n. */
static bool complete(const server_addr *a, const int32_t *ids, uint32_t n, int n_predict, char **text,
                     int *prompt_n) {
    cJSON *req = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(req, "prompt");
    for (uint32_t i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    cJSON_AddNumberToObject(req, "n_predict", n_predict);
    cJSON_AddNumberToObject(req, "id_slot", 0);
    cJSON_AddBoolToObject(req, "cache_prompt", 1);
    cJSON_AddNumberToObject(req, "temperature", 0);
    cJSON *rep = post_obj(a, "/completion", req);
    const cJSON *c = rep ? cJSON_GetObjectItem(rep, "content") : NULL;
    const cJSON *tm = rep ? cJSON_GetObjectItem(rep, "timings") : NULL;
    const cJSON *pn = tm ? cJSON_GetObjectItem(tm, "prompt_n") : NULL;
    const bool ok = cJSON_IsString(c) && cJSON_IsNumber(pn);
    if (ok) *text = strdup(c->valuestring), *prompt_n = pn->valueint;
    cJSON_Delete(rep);
    return ok;
}

/* POST /slots/0?action=ACTION; true when llama-server accepted it. */
static bool slot_action_q(const server_addr *a, const char *action, const char *file, bool quiet) {
    char path[64], body[512];
    snprintf(path, sizeof path, "/slots/0?action=%s", action);
    snprintf(body, sizeof body, file ? "{\"filename\":\"%s\"}" : "{}", file ? file : "");
    cJSON *rep = post_json_q(a, path, body, quiet);
    cJSON_Delete(rep);
    return rep != NULL;
}

static bool slot_action(const server_addr *a, const char *action, const char *file) {
    return slot_action_q(a, action, file, false);
}

/* Restores kvbridge's file into slot 0 and decodes; then a refused restore (a copy of another version)
 * must leave llama-server computing the prompt itself with the same reply. Failed checks. */
static int restore_checks(const server_addr *a, const char *dir, const int32_t *ids, uint32_t n, uint32_t n_restored,
                          int n_predict, bool swa) {
    char *alone = NULL, *bridged = NULL, *fallback = NULL, path[4096], bad[4096];
    int pn_alone = -1, pn_bridged = -1, pn_fallback = -1, failed = 0;
    if (!slot_action(a, "erase", NULL) || !complete(a, ids, n, n_predict, &alone, &pn_alone)) return 1;
    if (!slot_action(a, "erase", NULL) || !slot_action(a, "restore", OURS_FILE) ||
        !complete(a, ids, n, n_predict, &bridged, &pn_bridged)) {
        printf("  restore: kvbridge's file was NOT restored\n");
        free(alone);
        return 1;
    }
    const bool reused = pn_bridged >= 1 && (uint32_t)pn_bridged == n - (n_restored < n ? n_restored : n - 1);
    printf("  restore: llama-server computed %d of %u prompt tokens after restoring %u (alone: %d): %s\n", pn_bridged,
           n, n_restored, pn_alone, reused ? "prefix reused" : "NOT REUSED");
    if (!reused && swa)
        printf("  (a sliding-window cache: this llama-server build recomputes a restored prefix unless its lowest "
               "sliding-window cell lies below n - window, which its own file's never does; run it with --swa-full)\n");
    printf("  greedy %d tokens, restored vs llama-server alone: %s\n", n_predict,
           !strcmp(alone, bridged) ? "identical" : "DIFFER");
    failed += !reused + !!strcmp(alone, bridged);
    /* a refused restore: kvbridge's file claiming another version (a truncated file is no test: this
     * llama-server build aborts on one, which is why kvb_llama_state_save renames a finished file) */
    snprintf(path, sizeof path, "%s/%s", dir, OURS_FILE);
    snprintf(bad, sizeof bad, "%s/kvb-verify-refused.bin", dir);
    FILE *in = fopen(path, "rb"), *out = fopen(bad, "wb");
    char buf[65536];
    size_t got, total = 0;
    while (in && out && (got = fread(buf, 1, sizeof buf, in)) > 0) {
        if (total == 0 && got >= 8) buf[4] = 2; /* the version word, little-endian: 3 -> 2 */
        total += fwrite(buf, 1, got, out);
    }
    if (in) fclose(in);
    if (out) fclose(out);
    const bool refused = slot_action(a, "erase", NULL) && !slot_action_q(a, "restore", "kvb-verify-refused.bin", true);
    const bool fell_back = complete(a, ids, n, n_predict, &fallback, &pn_fallback) && pn_fallback == pn_alone &&
                           !strcmp(fallback, alone);
    printf("  refused restore (file version 2): %s; llama-server computed %d tokens itself, reply %s\n",
           refused ? "refused" : "NOT REFUSED", pn_fallback, fell_back ? "the same" : "DIFFERS");
    failed += !refused + !fell_back;
    free(alone), free(bridged), free(fallback);
    return failed;
}

/* The highest cell position of any cache, plus one: the tokens kvbridge must compute. */
static uint32_t cells_end(const kvb_llama_state *s) {
    uint32_t end = 0;
    for (uint32_t c = 0; c < s->n_cache; c++)
        for (uint32_t t = 0; t < s->cache[c].n_cells; t++)
            if ((uint32_t)s->cache[c].pos[t] + 1 > end) end = (uint32_t)s->cache[c].pos[t] + 1;
    return end;
}

/* Whether kvbridge's whole file equals llama-server's, byte for byte. */
static bool same_file_bytes(const kvb_llama_state *ours, const char *srv_path) {
    size_t n = 0, len = 0;
    kvb_err err = {0};
    if (kvb_llama_state_size(ours, &n, &err)) return false;
    uint8_t *a = malloc(n + 1), *b = malloc(n + 1);
    FILE *f = fopen(srv_path, "rb");
    bool same = a && b && f && !kvb_llama_state_write(ours, a, n, &len, &err) && fread(b, 1, n + 1, f) == n &&
                !memcmp(a, b, n);
    if (f) fclose(f);
    free(a), free(b);
    return same;
}

int kvb_verify_llamacpp(const kvb_verify_llamacpp_opts *o) {
    server_addr a = {0};
    char srv_path[4096], our_path[4096];
    int32_t *ids = NULL;
    uint32_t n_ids = 0;
    kvb_err err = {0};
    kvb_model *m = NULL;
    if (o->server && !parse_url(o->server, &a)) {
        fprintf(stderr, "kvbridge verify: --server %s: expected http://HOST:PORT\n", o->server);
        return 2;
    }
    if (kvb_model_load(o->model, &m, &err)) {
        fprintf(stderr, "kvbridge verify: %s\n", err.msg);
        return 1;
    }
    printf("kvbridge verify --target llama.cpp: llama-server's own cache vs kvbridge's, per layer and K/V\n");
    printf("  model %s; supported: %s\n", o->model, KVB_LLAMA_SUPPORTED_BUILD);
    printf("  kvbridge's rows: %s\n", o->kv_ggml ? "ggml's arithmetic (--kv-arith ggml)" : "its engine's arithmetic");
    if (o->server) {
        snprintf(srv_path, sizeof srv_path, "%s/%s", o->slot_dir, SERVER_FILE);
        if (!server_tokens(&a, o->model, o->prompt, &ids, &n_ids) || !slot_action(&a, "erase", NULL)) goto fail;
        char *text = NULL;
        int pn = 0;
        if (!complete(&a, ids, n_ids, 1, &text, &pn) || !slot_action(&a, "save", SERVER_FILE)) goto fail;
        free(text);
    } else {
        snprintf(srv_path, sizeof srv_path, "%s", o->slot_file);
    }
    snprintf(our_path, sizeof our_path, "%s/%s", o->slot_dir, OURS_FILE);
    kvb_llama_state srv, ours;
    if (kvb_llama_state_load(srv_path, &srv, &err)) {
        fprintf(stderr, "kvbridge verify: %s\n", err.msg);
        goto fail;
    }
    const uint32_t end = cells_end(&srv);
    printf("  llama-server's file %s: %u tokens, %u cache(s), cells for positions < %u\n", srv_path, srv.n_tokens,
           srv.n_cache, end);
    kv_rows kv = {0};
    kvb_status st = end > srv.n_tokens ? kvb_err_set(&err, KVB_ERR_FORMAT, "cells past the file's tokens")
                                       : compute_rows(m, srv.tokens, end, o->threads, o->kv_ggml, &kv, &err);
    if (!st) st = mirror_state(&srv, &m->d, &kv, &ours, &err);
    uint32_t short_rows = 0;
    int failed = 0;
    if (!st) {
        short_rows = compare_states(&srv, &ours, &m->d);
        printf("  whole file: %s\n", same_file_bytes(&ours, srv_path) ? "byte-identical to llama-server's"
                                                                        : "differs from llama-server's");
        st = kvb_llama_state_save(&ours, our_path, &err);
        if (!st) printf("  kvbridge's file: %s\n", our_path);
        if (!st && o->server && o->restore)
            failed = restore_checks(&a, o->slot_dir, ids, n_ids, cells_end(&ours), o->n_predict, srv.n_cache == 2);
        free_mirror(&ours);
    }
    if (st) fprintf(stderr, "kvbridge verify: %s\n", err.msg);
    free(kv.k), free(kv.v);
    kvb_llama_state_free(&srv);
    free(ids);
    kvb_model_free(m);
    printf("%s: %u row(s) not identical, %d restore check(s) failed\n", short_rows || failed ? "DIFFERENT" : "PASS",
           short_rows, failed);
    return st ? 1 : short_rows || failed ? 1 : 0;
fail:
    free(ids);
    kvb_model_free(m);
    return 1;
}
