/* foreign — other engines' own cache formats, written from K/V rows kvbridge computed and read
 * back from their files. llama.cpp: the sequence state file `llama_state_seq_save_file` writes and
 * llama-server's slot API saves and restores (`--slot-save-path DIR`, `POST /slots/ID?action=
 * save|restore`), for llama.cpp 0c1e57098 as vendored in llama-cpp-python 0.3.36 (state-seq file version 3,
 * llama-server's packed token list version 1). The file is: magic 'ggsq', version, the token
 * count and tokens (llama-server packs them as [-1, 1, n, tokens, 0 media]), then per KV cache of
 * the model (one; two for interleaved sliding-window models such as Gemma 3, llama.cpp's "iSWA"
 * cache: the global layers' cache, then the sliding-window layers', each with its own layer count;
 * llama_kv_cache::state_write skips a cell masked for the sequence's last position, so the second
 * holds only the last window cells, positions pos_max - window + 1 .. pos_max, and both hold the
 * same one sequence) n_stream and per stream a cell count, the cells' (pos,
 * 1, seq id) and, when it has cells, v_trans, n_layer, every layer's K (type, row bytes, rows) and
 * every layer's V: rows, or when v_trans (llama.cpp without flash attention) the element size,
 * the row width and the rows transposed (element j of every cell, then j+1 ...). All integers are
 * little-endian. Cells carrying M-RoPE or per-token extensions (has_cell_ext) are not supported. In
 * memory K and V are always (layer, cell, row bytes); the writer transposes V where the file
 * does. The parser checks every count, size and offset against the buffer and refuses other
 * versions with a message naming the supported build. */
#ifndef KVB_FOREIGN_H
#define KVB_FOREIGN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvb_core.h"

#define KVB_LLAMA_STATE_SEQ_MAGIC 0x67677371u /* 'ggsq' */
#define KVB_LLAMA_STATE_SEQ_VERSION 3u
#define KVB_LLAMA_SERVER_TOKENS_VERSION 1u
#define KVB_LLAMA_SUPPORTED_BUILD \
    "llama.cpp 0c1e57098 as vendored in llama-cpp-python 0.3.36 (sequence state file v3, llama-server token state v1)"
#define KVB_LLAMA_MAX_CACHES 2u   /* a model's KV caches in the file: 1, or 2 for interleaved SWA */
#define KVB_LLAMA_MAX_STREAMS 256u

/* One of the model's KV caches for one sequence. */
typedef struct {
    uint32_t n_stream;   /* llama.cpp's streams in this cache (1 with a unified cache) */
    uint32_t stream;     /* the stream holding the cells (the others are written empty) */
    uint32_t n_cells;    /* 0: nothing follows the cell count (and the fields below are unused) */
    int32_t seq_id;      /* every cell's one sequence id (llama-server: the slot id) */
    int32_t *pos;        /* (n_cells) each cell's position */
    bool v_trans;        /* V transposed in the file (llama.cpp without flash attention) */
    uint32_t n_layer;    /* layers of this cache, in the model's order */
    uint32_t k_type, v_type;  /* ggml type ids (KVB_TYPE_*: F16 = 1), the same for every layer */
    uint64_t k_row_bytes;     /* bytes of one cell's K row (n_head_kv * head_dim elements) */
    uint64_t v_row_bytes;
    uint8_t *k;          /* (layer, cell, k_row_bytes) */
    uint8_t *v;          /* (layer, cell, v_row_bytes), row-major even when the file transposes */
} kvb_llama_cache;

/* A llama.cpp sequence state file. */
typedef struct {
    uint32_t n_tokens;
    int32_t *tokens;     /* (n_tokens) */
    bool server_packed;  /* the token list in llama-server's packed form (what its slot save writes) */
    uint32_t n_cache;    /* 1 .. KVB_LLAMA_MAX_CACHES */
    kvb_llama_cache cache[KVB_LLAMA_MAX_CACHES];
} kvb_llama_state;

/* Exact size of the file kvb_llama_state_write produces; KVB_ERR_INVALID / _RANGE for a state it
 * cannot write (inconsistent sizes, a V element size that cannot be transposed). */
kvb_status kvb_llama_state_size(const kvb_llama_state *s, size_t *out, kvb_err *err);
/* Writes the file into buf (cap bytes, at least kvb_llama_state_size); *len = bytes written. */
kvb_status kvb_llama_state_write(const kvb_llama_state *s, uint8_t *buf, size_t cap, size_t *len, kvb_err *err);
/* Writes the file at path (replaced atomically: a temporary name, then rename). */
kvb_status kvb_llama_state_save(const kvb_llama_state *s, const char *path, kvb_err *err);

/* Parses a file's bytes into *out (which owns copies; kvb_llama_state_free). Any malformed,
 * truncated or trailing byte is KVB_ERR_FORMAT; another magic or version, or a feature this
 * reader does not take (cell extensions, media in the token list), is KVB_ERR_UNSUPPORTED with a
 * message naming KVB_LLAMA_SUPPORTED_BUILD. */
kvb_status kvb_llama_state_parse(const uint8_t *buf, size_t len, kvb_llama_state *out, kvb_err *err);
kvb_status kvb_llama_state_load(const char *path, kvb_llama_state *out, kvb_err *err);
void kvb_llama_state_free(kvb_llama_state *s);

/* Row-major (layer, cell, row) offsets into a cache's K or V. */
static inline const uint8_t *kvb_llama_k_row(const kvb_llama_cache *c, uint32_t layer, uint32_t cell) {
    return c->k + ((uint64_t)layer * c->n_cells + cell) * c->k_row_bytes;
}
static inline const uint8_t *kvb_llama_v_row(const kvb_llama_cache *c, uint32_t layer, uint32_t cell) {
    return c->v + ((uint64_t)layer * c->n_cells + cell) * c->v_row_bytes;
}

#endif
