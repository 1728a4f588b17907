/* foreign/llamacpp_state.c — llama.cpp's sequence state file (what llama-server's slot save
 * writes and its slot restore reads), written from K/V rows in memory and parsed back. The
 * layout follows llama_context::state_seq_save_file, llama_kv_cache::state_write_meta /
 * state_write_data and llama_kv_cache_iswa::state_write of the pinned build (see kvb_foreign.h).
 * One writer serves both the size computation (a counting pass with no buffer) and the write, so
 * the two cannot disagree. The parser is a bounds-checked cursor: every count is checked against
 * the bytes left before anything is allocated or copied, so no allocation exceeds the input. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvb_foreign.h"
#include "kvb_quant.h"

#define LLAMA_TOKEN_NULL (-1)
#define MAX_LAYERS 4096u

/* ---- writing ------------------------------------------------------------------------------- */

typedef struct {
    uint8_t *p; /* NULL: count only */
    size_t len;
} wcur;

static void w_bytes(wcur *w, const void *src, size_t n) {
    if (w->p && n) memcpy(w->p + w->len, src, n);
    w->len += n;
}
static void w_u32(wcur *w, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    w_bytes(w, b, 4);
}
static void w_u64(wcur *w, uint64_t v) {
    w_u32(w, (uint32_t)v);
    w_u32(w, (uint32_t)(v >> 32));
}

/* Element size of a type V can be transposed in (one element per block), else 0. */
static uint32_t scalar_size(uint32_t type) {
    const kvb_type_info *ti = kvb_type_get(type);
    return ti && ti->block_elems == 1 ? (uint32_t)ti->block_bytes : 0;
}

static bool row_fits_type(uint32_t type, uint64_t row_bytes) {
    const kvb_type_info *ti = kvb_type_get(type);
    return ti && ti->block_elems > 0 && row_bytes > 0 && row_bytes % (uint64_t)ti->block_bytes == 0;
}

static kvb_status check_cache(const kvb_llama_cache *c, uint32_t i, kvb_err *err) {
    if (c->n_stream == 0 || c->n_stream > KVB_LLAMA_MAX_STREAMS || c->stream >= c->n_stream)
        return kvb_err_set(err, KVB_ERR_INVALID, "llama.cpp state: cache %u: stream %u of %u", i, c->stream,
                           c->n_stream);
    if (c->n_cells == 0) return KVB_OK;
    if (!c->pos || !c->k || !c->v || c->n_layer == 0 || c->n_layer > MAX_LAYERS)
        return kvb_err_set(err, KVB_ERR_INVALID, "llama.cpp state: cache %u: %u cells need positions, %s",
                           i, c->n_cells, "1..4096 layers and K/V rows");
    if (!row_fits_type(c->k_type, c->k_row_bytes) || !row_fits_type(c->v_type, c->v_row_bytes))
        return kvb_err_set(err, KVB_ERR_INVALID, "llama.cpp state: cache %u: row bytes %llu/%llu do not fit "
                           "types %s/%s", i, (unsigned long long)c->k_row_bytes,
                           (unsigned long long)c->v_row_bytes, kvb_type_name(c->k_type), kvb_type_name(c->v_type));
    if (c->v_trans && (scalar_size(c->v_type) == 0 || c->v_row_bytes / scalar_size(c->v_type) > UINT32_MAX))
        return kvb_err_set(err, KVB_ERR_INVALID, "llama.cpp state: cache %u: V of type %s cannot be transposed "
                           "(llama.cpp needs flash attention for a block type)", i, kvb_type_name(c->v_type));
    const uint64_t rows = (uint64_t)c->n_layer * c->n_cells;
    if (c->k_row_bytes > SIZE_MAX / 4 / rows || c->v_row_bytes > SIZE_MAX / 4 / rows)
        return kvb_err_set(err, KVB_ERR_RANGE, "llama.cpp state: cache %u too large", i);
    return KVB_OK;
}

static void write_cache_data(wcur *w, const kvb_llama_cache *c) {
    w_u32(w, c->v_trans ? 1u : 0u);
    w_u32(w, c->n_layer);
    for (uint32_t l = 0; l < c->n_layer; l++) {
        w_u32(w, c->k_type);
        w_u64(w, c->k_row_bytes);
        w_bytes(w, kvb_llama_k_row(c, l, 0), (size_t)c->n_cells * c->k_row_bytes);
    }
    for (uint32_t l = 0; l < c->n_layer; l++) {
        w_u32(w, c->v_type);
        if (!c->v_trans) {
            w_u64(w, c->v_row_bytes);
            w_bytes(w, kvb_llama_v_row(c, l, 0), (size_t)c->n_cells * c->v_row_bytes);
            continue;
        }
        const uint32_t el = scalar_size(c->v_type), n_embd = (uint32_t)(c->v_row_bytes / el);
        w_u32(w, el);
        w_u32(w, n_embd);
        if (!w->p) {
            w->len += (size_t)n_embd * c->n_cells * el;
            continue;
        }
        for (uint32_t j = 0; j < n_embd; j++) /* file: (element j, cell) */
            for (uint32_t t = 0; t < c->n_cells; t++) w_bytes(w, kvb_llama_v_row(c, l, t) + (size_t)j * el, el);
    }
}

static void write_cache(wcur *w, const kvb_llama_cache *c) {
    w_u32(w, c->n_stream);
    for (uint32_t s = 0; s < c->n_stream; s++) {
        const uint32_t n = s == c->stream ? c->n_cells : 0;
        w_u32(w, n);
        if (n == 0) continue;
        for (uint32_t t = 0; t < n; t++) {
            w_u32(w, (uint32_t)c->pos[t]);
            w_u32(w, 1);
            w_u32(w, (uint32_t)c->seq_id);
        }
        write_cache_data(w, c);
    }
}

static kvb_status write_all(const kvb_llama_state *s, wcur *w, kvb_err *err) {
    if (s->n_cache == 0 || s->n_cache > KVB_LLAMA_MAX_CACHES || (s->n_tokens && !s->tokens) ||
        s->n_tokens > UINT32_MAX - 4)
        return kvb_err_set(err, KVB_ERR_INVALID, "llama.cpp state: %u caches (1..%u) and %u tokens", s->n_cache,
                           KVB_LLAMA_MAX_CACHES, s->n_tokens);
    for (uint32_t i = 0; i < s->n_cache; i++) {
        kvb_status st = check_cache(&s->cache[i], i, err);
        if (st) return st;
    }
    if (s->n_cache == 2 && s->cache[0].n_cells && s->cache[1].n_cells && s->cache[0].seq_id != s->cache[1].seq_id)
        return kvb_err_set(err, KVB_ERR_INVALID, "llama.cpp state: caches of sequences %d and %d (a sequence "
                           "file holds one)", s->cache[0].seq_id, s->cache[1].seq_id);
    w_u32(w, KVB_LLAMA_STATE_SEQ_MAGIC);
    w_u32(w, KVB_LLAMA_STATE_SEQ_VERSION);
    if (s->server_packed) { /* [-1, version, n, tokens, 0 media chunks] */
        w_u32(w, s->n_tokens + 4);
        w_u32(w, (uint32_t)LLAMA_TOKEN_NULL);
        w_u32(w, KVB_LLAMA_SERVER_TOKENS_VERSION);
    }
    w_u32(w, s->n_tokens);
    for (uint32_t t = 0; t < s->n_tokens; t++) w_u32(w, (uint32_t)s->tokens[t]);
    if (s->server_packed) w_u32(w, 0);
    for (uint32_t i = 0; i < s->n_cache; i++) write_cache(w, &s->cache[i]);
    return KVB_OK;
}

kvb_status kvb_llama_state_size(const kvb_llama_state *s, size_t *out, kvb_err *err) {
    wcur w = {0};
    kvb_status st = write_all(s, &w, err);
    if (!st) *out = w.len;
    return st;
}

kvb_status kvb_llama_state_write(const kvb_llama_state *s, uint8_t *buf, size_t cap, size_t *len, kvb_err *err) {
    size_t need;
    kvb_status st = kvb_llama_state_size(s, &need, err);
    if (st) return st;
    if (cap < need)
        return kvb_err_set(err, KVB_ERR_RANGE, "llama.cpp state: %zu bytes needed, buffer has %zu", need, cap);
    wcur w = {.p = buf};
    st = write_all(s, &w, err);
    if (!st) *len = w.len;
    return st;
}

kvb_status kvb_llama_state_save(const kvb_llama_state *s, const char *path, kvb_err *err) {
    size_t n, len = 0;
    kvb_status st = kvb_llama_state_size(s, &n, err);
    if (st) return st;
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) return kvb_err_set(err, KVB_ERR_NOMEM, "llama.cpp state: %zu bytes", n);
    st = kvb_llama_state_write(s, buf, n, &len, err);
    char tmp[4096];
    if (!st && snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long)getpid()) >= (int)sizeof tmp)
        st = kvb_err_set(err, KVB_ERR_INVALID, "llama.cpp state: path too long: %s", path);
    if (!st) {
        FILE *f = fopen(tmp, "wb");
        bool ok = f && fwrite(buf, 1, len, f) == len;
        if (f && fclose(f)) ok = false;
        if (!ok || rename(tmp, path)) {
            st = kvb_err_set(err, KVB_ERR_IO, "writing %s: %s", path, strerror(errno));
            unlink(tmp);
        }
    }
    free(buf);
    return st;
}

/* ---- parsing ------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *b;
    size_t len, off;
} rcur;

static size_t r_left(const rcur *r) { return r->len - r->off; }

static kvb_status r_need(const rcur *r, uint64_t n, const char *what, kvb_err *err) {
    if (n > r_left(r))
        return kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: truncated at byte %zu (%s: %llu bytes, %zu left)",
                           r->off, what, (unsigned long long)n, r_left(r));
    return KVB_OK;
}

static kvb_status r_u32(rcur *r, uint32_t *v, const char *what, kvb_err *err) {
    kvb_status st = r_need(r, 4, what, err);
    if (st) return st;
    const uint8_t *p = r->b + r->off;
    *v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    r->off += 4;
    return KVB_OK;
}

static kvb_status r_u64(rcur *r, uint64_t *v, const char *what, kvb_err *err) {
    uint32_t lo, hi;
    kvb_status st = r_u32(r, &lo, what, err);
    if (!st) st = r_u32(r, &hi, what, err);
    if (!st) *v = (uint64_t)hi << 32 | lo;
    return st;
}

static kvb_status r_copy(rcur *r, uint8_t *dst, uint64_t n, const char *what, kvb_err *err) {
    kvb_status st = r_need(r, n, what, err);
    if (st) return st;
    if (n) memcpy(dst, r->b + r->off, (size_t)n);
    r->off += (size_t)n;
    return KVB_OK;
}

static kvb_status parse_tokens(rcur *r, kvb_llama_state *s, kvb_err *err) {
    uint32_t words, first = 0;
    kvb_status st = r_u32(r, &words, "token count", err);
    if (st) return st;
    if (words > r_left(r) / 4)
        return kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: %u token words, the file has %zu bytes left",
                           words, r_left(r));
    if (words) first = (uint32_t)r->b[r->off] | (uint32_t)r->b[r->off + 1] << 8 |
                       (uint32_t)r->b[r->off + 2] << 16 | (uint32_t)r->b[r->off + 3] << 24;
    uint32_t n = words;
    if (words && first == (uint32_t)LLAMA_TOKEN_NULL) { /* llama-server's packed token state */
        uint32_t marker = 0, version = 0, media;
        s->server_packed = true;
        if (words < 4) return kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: packed token list of %u words", words);
        r_u32(r, &marker, "", err);
        r_u32(r, &version, "", err);
        r_u32(r, &n, "", err);
        if (version != KVB_LLAMA_SERVER_TOKENS_VERSION)
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "llama.cpp state: llama-server token state version %u; "
                               "supported: %s", version, KVB_LLAMA_SUPPORTED_BUILD);
        if (n != words - 4)
            return kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: %u packed tokens in %u words", n, words);
        media = r->b[r->off + 4 * (size_t)n] | (uint32_t)r->b[r->off + 4 * (size_t)n + 1] << 8 |
                (uint32_t)r->b[r->off + 4 * (size_t)n + 2] << 16 | (uint32_t)r->b[r->off + 4 * (size_t)n + 3] << 24;
        if (media != 0)
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "llama.cpp state: %u media chunks in the token list "
                               "(multimodal slots are not supported)", media);
    }
    s->n_tokens = n;
    s->tokens = malloc(n ? (size_t)n * 4 : 4);
    if (!s->tokens) return kvb_err_set(err, KVB_ERR_NOMEM, "llama.cpp state: %u tokens", n);
    for (uint32_t t = 0; t < n; t++) r_u32(r, (uint32_t *)&s->tokens[t], "", err);
    if (s->server_packed) r->off += 4; /* the media count, checked above */
    return KVB_OK;
}

static kvb_status parse_meta(rcur *r, kvb_llama_cache *c, uint32_t n, kvb_err *err) {
    if (n > r_left(r) / 12)
        return kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: %u cells, the file has %zu bytes left", n,
                           r_left(r));
    c->n_cells = n;
    c->pos = malloc((size_t)n * sizeof *c->pos);
    if (!c->pos) return kvb_err_set(err, KVB_ERR_NOMEM, "llama.cpp state: %u cells", n);
    for (uint32_t t = 0; t < n; t++) {
        uint32_t pos = 0, n_seq = 0, seq = 0;
        r_u32(r, &pos, "", err);
        r_u32(r, &n_seq, "", err);
        r_u32(r, &seq, "", err);
        if (n_seq != 1)
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "llama.cpp state: cell %u has %u sequence ids (a sequence "
                               "file has 1; cell extensions are not supported: %s)", t, n_seq,
                               KVB_LLAMA_SUPPORTED_BUILD);
        if ((int32_t)pos < 0 || (int32_t)seq < 0 || (t && (int32_t)seq != c->seq_id))
            return kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: cell %u: position %d, sequence %d", t,
                               (int32_t)pos, (int32_t)seq);
        c->pos[t] = (int32_t)pos;
        c->seq_id = (int32_t)seq;
    }
    return KVB_OK;
}

/* One layer's K or V header; *row_bytes the first layer's, the others must equal it. For a
 * transposed V, *el is its element size (0 otherwise). */
static kvb_status parse_layer_head(rcur *r, bool trans, uint32_t l, uint32_t *type, uint64_t *row_bytes,
                                   kvb_err *err) {
    uint32_t t;
    uint64_t rb;
    kvb_status st = r_u32(r, &t, "layer type", err);
    if (st) return st;
    if (!trans) {
        st = r_u64(r, &rb, "row size", err);
    } else {
        uint32_t el, n_embd;
        st = r_u32(r, &el, "element size", err);
        if (!st) st = r_u32(r, &n_embd, "row width", err);
        if (!st && (scalar_size(t) == 0 || el != scalar_size(t)))
            return kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: layer %u: transposed V of type %s with "
                               "element size %u", l, kvb_type_name(t), el);
        rb = (uint64_t)el * n_embd;
    }
    if (st) return st;
    if (!row_fits_type(t, rb))
        return kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: layer %u: row of %llu bytes for type %u (%s)", l,
                           (unsigned long long)rb, t, kvb_type_name(t));
    if (l > 0 && (t != *type || rb != *row_bytes))
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "llama.cpp state: layer %u's rows (%s, %llu B) differ from "
                           "layer 0's (%s, %llu B)", l, kvb_type_name(t), (unsigned long long)rb,
                           kvb_type_name(*type), (unsigned long long)*row_bytes);
    *type = t;
    *row_bytes = rb;
    return KVB_OK;
}

/* K (trans false) or V of every layer into *dst (layer, cell, row), allocated once the first
 * layer's header says its size and the bytes for all layers are known to be there. */
static kvb_status parse_rows(rcur *r, kvb_llama_cache *c, bool v, kvb_err *err) {
    const bool trans = v && c->v_trans;
    uint32_t *type = v ? &c->v_type : &c->k_type;
    uint64_t *rb = v ? &c->v_row_bytes : &c->k_row_bytes;
    uint8_t **dst = v ? &c->v : &c->k;
    for (uint32_t l = 0; l < c->n_layer; l++) {
        kvb_status st = parse_layer_head(r, trans, l, type, rb, err);
        if (st) return st;
        if (*rb > r_left(r) / c->n_cells) return r_need(r, UINT64_MAX, v ? "V rows" : "K rows", err);
        const uint64_t layer_bytes = *rb * c->n_cells;
        if (l == 0) {
            if (layer_bytes > r_left(r) / c->n_layer) return r_need(r, UINT64_MAX, "every layer's rows", err);
            *dst = malloc((size_t)(layer_bytes * c->n_layer));
            if (!*dst) return kvb_err_set(err, KVB_ERR_NOMEM, "llama.cpp state: %llu bytes of rows",
                                          (unsigned long long)(layer_bytes * c->n_layer));
        }
        uint8_t *out = *dst + layer_bytes * l;
        if (!trans) {
            st = r_copy(r, out, layer_bytes, "rows", err);
            if (st) return st;
            continue;
        }
        const uint32_t el = scalar_size(*type), n_embd = (uint32_t)(*rb / el);
        st = r_need(r, layer_bytes, "transposed V", err);
        if (st) return st;
        const uint8_t *in = r->b + r->off; /* (element j, cell) */
        for (uint32_t j = 0; j < n_embd; j++)
            for (uint32_t t = 0; t < c->n_cells; t++)
                memcpy(out + (size_t)t * *rb + (size_t)j * el, in + ((size_t)j * c->n_cells + t) * el, el);
        r->off += (size_t)layer_bytes;
    }
    return KVB_OK;
}

static kvb_status parse_cache(rcur *r, kvb_llama_cache *c, kvb_err *err) {
    kvb_status st = r_u32(r, &c->n_stream, "stream count", err);
    if (st) return st;
    if (c->n_stream == 0 || c->n_stream > KVB_LLAMA_MAX_STREAMS)
        return kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: %u streams (1..%u)", c->n_stream,
                           KVB_LLAMA_MAX_STREAMS);
    for (uint32_t s = 0; s < c->n_stream; s++) {
        uint32_t n, vt;
        st = r_u32(r, &n, "cell count", err);
        if (st) return st;
        if (n == 0) continue;
        if (c->n_cells)
            return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "llama.cpp state: cells in streams %u and %u (a "
                               "sequence lives in one)", c->stream, s);
        c->stream = s;
        st = parse_meta(r, c, n, err);
        if (!st) st = r_u32(r, &vt, "v_trans", err);
        if (!st) st = r_u32(r, &c->n_layer, "layer count", err);
        if (st) return st;
        if (vt > 1 || c->n_layer == 0 || c->n_layer > MAX_LAYERS)
            return kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: v_trans %u, %u layers", vt, c->n_layer);
        c->v_trans = vt == 1;
        st = parse_rows(r, c, false, err);
        if (!st) st = parse_rows(r, c, true, err);
        if (st) return st;
    }
    return KVB_OK;
}

kvb_status kvb_llama_state_parse(const uint8_t *buf, size_t len, kvb_llama_state *out, kvb_err *err) {
    memset(out, 0, sizeof *out);
    rcur r = {.b = buf, .len = buf ? len : 0};
    uint32_t magic, version;
    kvb_status st = r_u32(&r, &magic, "magic", err);
    if (!st) st = r_u32(&r, &version, "version", err);
    if (st) return st;
    if (magic != KVB_LLAMA_STATE_SEQ_MAGIC || version != KVB_LLAMA_STATE_SEQ_VERSION)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "llama.cpp state: magic %08x version %u is not a supported "
                           "sequence state file; supported: %s", magic, version, KVB_LLAMA_SUPPORTED_BUILD);
    st = parse_tokens(&r, out, err);
    while (!st && r_left(&r)) {
        if (out->n_cache == KVB_LLAMA_MAX_CACHES) {
            st = kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: %zu bytes after %u caches", r_left(&r),
                             KVB_LLAMA_MAX_CACHES);
            break;
        }
        st = parse_cache(&r, &out->cache[out->n_cache++], err);
    }
    if (!st && out->n_cache == 0) st = kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: no KV cache section");
    if (!st && out->n_cache == 2 && out->cache[0].n_cells && out->cache[1].n_cells &&
        out->cache[0].seq_id != out->cache[1].seq_id)
        st = kvb_err_set(err, KVB_ERR_FORMAT, "llama.cpp state: caches of sequences %d and %d (a sequence file "
                         "holds one)", out->cache[0].seq_id, out->cache[1].seq_id);
    if (st) kvb_llama_state_free(out);
    return st;
}

kvb_status kvb_llama_state_load(const char *path, kvb_llama_state *out, kvb_err *err) {
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "rb");
    if (!f) return kvb_err_set(err, KVB_ERR_IO, "%s: %s", path, strerror(errno));
    uint8_t *buf = NULL;
    long n = -1;
    if (!fseek(f, 0, SEEK_END)) n = ftell(f);
    kvb_status st = KVB_OK;
    if (n < 0 || fseek(f, 0, SEEK_SET))
        st = kvb_err_set(err, KVB_ERR_IO, "%s: cannot size it", path);
    else if (!(buf = malloc(n ? (size_t)n : 1)))
        st = kvb_err_set(err, KVB_ERR_NOMEM, "%s: %ld bytes", path, n);
    else if (fread(buf, 1, (size_t)n, f) != (size_t)n)
        st = kvb_err_set(err, KVB_ERR_IO, "%s: short read", path);
    fclose(f);
    if (!st) {
        st = kvb_llama_state_parse(buf, (size_t)n, out, err);
        if (st) kvb_err_prefix(err, "%s: ", path);
    }
    free(buf);
    return st;
}

void kvb_llama_state_free(kvb_llama_state *s) {
    if (!s) return;
    free(s->tokens);
    for (uint32_t i = 0; i < KVB_LLAMA_MAX_CACHES; i++) {
        free(s->cache[i].pos);
        free(s->cache[i].k);
        free(s->cache[i].v);
    }
    memset(s, 0, sizeof *s);
}
