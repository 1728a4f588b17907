/* kvformat — the decoder's KV cache format: what one cache block holds and how its bytes are
 * laid out and encoded (dtype f32/f16/bf16/q8_0, tokens per block), serialisable and
 * fingerprinted so two nodes can prove they agree; plus the row encode/decode every engine uses
 * to write and read its cache. The cache-producing arithmetic itself (K/V projection, bias,
 * k-norm, RoPE, encoding) is kvb_kv_produce in engine/cpu, and is specified there. */
#ifndef KVB_KVFORMAT_H
#define KVB_KVFORMAT_H

#include <stdint.h>

#include "kvb_core.h"

#define KVB_KVFORMAT_VERSION 1

typedef struct {
    uint32_t version;       /* KVB_KVFORMAT_VERSION */
    uint32_t dtype;         /* kvb_type: F32, F16, BF16 or Q8_0 */
    uint32_t block_tokens;  /* tokens per cache block (multiple of 1; q8_0 needs head_dim % 32 == 0) */
    uint32_t n_layer;
    uint32_t n_head_kv;
    uint32_t head_dim;
} kvb_kvformat;

/* Block layout: (layer, k_or_v, kv_head, token, head_dim) with each (token, head_dim) row
 * encoded in dtype; one row = kvb_row_bytes(dtype, head_dim) bytes. */
kvb_status kvb_kvformat_init(kvb_kvformat *f, uint32_t dtype, uint32_t block_tokens, uint32_t n_layer,
                             uint32_t n_head_kv, uint32_t head_dim, kvb_err *err);
size_t kvb_kvformat_row_bytes(const kvb_kvformat *f);
size_t kvb_kvformat_block_bytes(const kvb_kvformat *f);
/* Byte offset of row (layer, kv, head, token) inside a block. kv: 0 = K, 1 = V. */
size_t kvb_kvformat_row_offset(const kvb_kvformat *f, uint32_t layer, uint32_t kv, uint32_t head,
                               uint32_t token);
/* Writes n tokens' rows, given token-major as the cache-producing arithmetic emits them —
 * k_rows, v_rows (n, n_head_kv, row_bytes) — into block positions token0 .. token0+n-1 of one
 * layer of a block (token0 + n <= block_tokens). The one place that knows the block layout: the
 * engine's own writes and slab assembly both go through it. */
void kvb_kvformat_scatter_rows(const kvb_kvformat *f, uint8_t *block, uint32_t layer, uint32_t token0, uint32_t n,
                               const uint8_t *k_rows, const uint8_t *v_rows);
uint64_t kvb_kvformat_fingerprint(const kvb_kvformat *f);
/* "q8_0/32tok/16L/8h/64d" */
void kvb_kvformat_describe(const kvb_kvformat *f, char *buf, size_t cap);

#endif
