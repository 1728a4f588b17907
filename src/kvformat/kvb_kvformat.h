/* kvformat — the decoder's KV cache format: what one cache block holds and how its bytes are
 * laid out and encoded (dtype f32/f16/bf16/q8_0, tokens per block), serialisable and
 * fingerprinted so two nodes can prove they agree; plus the row encode/decode every engine uses
 * to write and read its cache. Two kinds: per-head K/V (kind kv: a K row and a V row per kv head,
 * token and layer) and DeepSeek's latent cache (kind mla: one row per token and layer, the
 * normalised latent then the roped key part, as llama.cpp's deepseek2 cache holds it); every size
 * and offset goes through this description, never through the architecture. The cache-producing arithmetic itself (K/V projection, bias,
 * k-norm, RoPE, encoding) is kvb_kv_produce in engine/cpu, and is specified there. */
#ifndef KVB_KVFORMAT_H
#define KVB_KVFORMAT_H

#include <stdbool.h>
#include <stdint.h>

#include "kvb_core.h"

#define KVB_KVFORMAT_VERSION 1
#define KVB_KVFORMAT_MAX_LAYERS 1024 /* = KVB_MAX_LAYERS of the model module */

#define KVB_KVFORMAT_KV 0u  /* per-head K and V rows */
#define KVB_KVFORMAT_MLA 1u /* one latent row per token and layer: (latent_dim + rope_dim) values */

typedef struct {
    uint32_t version;       /* KVB_KVFORMAT_VERSION */
    uint32_t dtype;         /* kvb_type: F32, F16, BF16 or Q8_0 */
    uint32_t block_tokens;  /* tokens per cache block (multiple of 1; q8_0 needs head_dim % 32 == 0) */
    uint32_t n_layer;
    uint32_t n_head_kv;
    uint32_t head_dim;
    /* Sliding-window (local) layers: 0 for a model without them (then the fields below are zero,
     * the fingerprint and every layout are exactly those of a format without this extension).
     * A query at position p of a local layer reads keys max(0, p - window + 1) .. p only, so the
     * decoder keeps a local layer's rows only for the positions a later query can still read
     * (kvb_kvformat_local_keep_from); a block whose early local rows were never kept carries that
     * in the store (kvb_store_slab_keep_local_from). Set with kvb_kvformat_set_window. */
    uint32_t window;
    uint32_t n_local;                                 /* how many layers are local */
    uint64_t local_mask[KVB_KVFORMAT_MAX_LAYERS / 64]; /* bit l set: layer l is local */
    /* The kind (kvb_kvformat_init_mla sets mla; a kv format's fields below are zero, its fingerprint
     * and layout exactly those of a format without this extension). mla: n_head_kv 1, head_dim =
     * latent_dim + rope_dim, and only the "K" part exists (kvb_kvformat_parts = 1). */
    uint32_t kind;
    uint32_t latent_dim;    /* mla: kv_lora_rank, the normalised latent's width (first in the row) */
    uint32_t rope_dim;      /* mla: the roped key part's width (last in the row) */
} kvb_kvformat;

/* Block layout: (layer, k_or_v, kv_head, token, head_dim) with each (token, head_dim) row
 * (mla: (layer, token, latent_dim + rope_dim), k_or_v 0 only)
 * encoded in dtype; one row = kvb_row_bytes(dtype, head_dim) bytes. With local layers the layer
 * order in a block is: the global layers, then the local layers (each group in model order), so
 * the local layers' rows are one contiguous tail of the block (kvb_kvformat_local_part); without
 * them the order is the model's, as it always was. */
kvb_status kvb_kvformat_init(kvb_kvformat *f, uint32_t dtype, uint32_t block_tokens, uint32_t n_layer,
                             uint32_t n_head_kv, uint32_t head_dim, kvb_err *err);
/* A latent (mla) format: per token and layer one row of latent_dim + rope_dim values in dtype
 * (q8_0 needs the sum divisible by 32). */
kvb_status kvb_kvformat_init_mla(kvb_kvformat *f, uint32_t dtype, uint32_t block_tokens, uint32_t n_layer,
                                 uint32_t latent_dim, uint32_t rope_dim, kvb_err *err);
/* Rows per (layer, kv head, token): 2 (K, V) for kind kv, 1 for mla (its V part does not exist:
 * scatter_rows takes v_rows NULL, a slab's V bytes are 0). */
uint32_t kvb_kvformat_parts(const kvb_kvformat *f);
size_t kvb_kvformat_row_bytes(const kvb_kvformat *f);
size_t kvb_kvformat_block_bytes(const kvb_kvformat *f);
/* Byte offset of row (layer, kv, head, token) inside a block. kv: 0 = K, 1 = V. */
size_t kvb_kvformat_row_offset(const kvb_kvformat *f, uint32_t layer, uint32_t kv, uint32_t head,
                               uint32_t token);
/* The local layers' part of a block: returns its byte offset (= the global layers' bytes) and sets
 * *bytes to its length (0 without local layers). */
size_t kvb_kvformat_local_part(const kvb_kvformat *f, size_t *bytes);
/* Writes n tokens' rows, given token-major as the cache-producing arithmetic emits them —
 * k_rows, v_rows (n, n_head_kv, row_bytes) — into block positions token0 .. token0+n-1 of one
 * layer of a block (token0 + n <= block_tokens). The one place that knows the block layout: the
 * engine's own writes and slab assembly both go through it. */
void kvb_kvformat_scatter_rows(const kvb_kvformat *f, uint8_t *block, uint32_t layer, uint32_t token0, uint32_t n,
                               const uint8_t *k_rows, const uint8_t *v_rows);
/* The same bytes, written past the caches where the CPU can (x86, rows of whole 64-byte lines):
 * for rows nobody reads soon (a slab committed into the decoder's store), so the write does not
 * first read each line in. Ordered (sfence) before it returns. */
void kvb_kvformat_scatter_rows_stream(const kvb_kvformat *f, uint8_t *block, uint32_t layer, uint32_t token0,
                                      uint32_t n, const uint8_t *k_rows, const uint8_t *v_rows);
/* Declares the local layers (local[l] for l < n_layer) and their window (>= 1). With no local
 * layer (or window 0) the format stays as it was. KVB_ERR_INVALID when n_layer exceeds
 * KVB_KVFORMAT_MAX_LAYERS. */
kvb_status kvb_kvformat_set_window(kvb_kvformat *f, uint32_t window, const bool *local, kvb_err *err);
bool kvb_kvformat_layer_local(const kvb_kvformat *f, uint32_t layer);
/* The first position whose local-layer rows a decoder keeps when it adopts every full block
 * before position ship_to (ship_to: the end of what is shipped, the last prompt token excluded)
 * and computes on from E = ship_to rounded down to a block boundary: max(0, E - (window - 1)), the
 * first key the query at E reads; every later query reads later keys only. 0 without local
 * layers. The bridge ships local-layer rows only from here, the receiver expects only these. */
uint32_t kvb_kvformat_local_keep_from(const kvb_kvformat *f, uint32_t ship_to);
/* The first token of block `block` (positions block*bt ..) whose local rows are kept when they are
 * kept from position keep_from on: keep_from - block*bt clamped to 0 .. block_tokens. */
uint32_t kvb_kvformat_block_local_lo(const kvb_kvformat *f, uint32_t keep_from, uint32_t block);
/* Bytes of one position's rows (K and V, every kv head) over the global layers and over the local
 * layers. */
void kvb_kvformat_token_bytes(const kvb_kvformat *f, uint64_t *global_bytes, uint64_t *local_bytes);
/* Cache bytes a bridge ships (and the decoder keeps) for positions [ship_from, ship_to): global
 * layers' rows for all of them, local layers' rows from kvb_kvformat_local_keep_from(ship_to) on. */
void kvb_kvformat_ship_bytes(const kvb_kvformat *f, uint32_t ship_from, uint32_t ship_to, uint64_t *global_bytes,
                             uint64_t *local_bytes);
uint64_t kvb_kvformat_fingerprint(const kvb_kvformat *f);
/* "q8_0/32tok/16L/8h/64d", with "/15local@512" appended when there are local layers; mla:
 * "q8_0/32tok/27L/mla512+64" */
void kvb_kvformat_describe(const kvb_kvformat *f, char *buf, size_t cap);

#endif
