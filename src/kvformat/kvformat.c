/* kvformat/kvformat.c — cache block geometry, description and fingerprint. */
#include <stdio.h>
#include <string.h>

#include "kvb_kvformat.h"
#include "kvb_quant.h"

kvb_status kvb_kvformat_init(kvb_kvformat *f, uint32_t dtype, uint32_t block_tokens, uint32_t n_layer,
                             uint32_t n_head_kv, uint32_t head_dim, kvb_err *err) {
    memset(f, 0, sizeof *f);
    if (dtype != KVB_TYPE_F32 && dtype != KVB_TYPE_F16 && dtype != KVB_TYPE_BF16 && dtype != KVB_TYPE_Q8_0)
        return kvb_err_set(err, KVB_ERR_INVALID, "cache type %s is not supported (f32, f16, bf16, q8_0)",
                           kvb_type_name(dtype));
    if (block_tokens < 1 || block_tokens > 4096)
        return kvb_err_set(err, KVB_ERR_INVALID, "cache block size %u tokens is out of range (1..4096)", block_tokens);
    if (kvb_row_bytes(dtype, head_dim) == 0)
        return kvb_err_set(err, KVB_ERR_INVALID, "cache type %s needs head_dim divisible by %d (head_dim is %u)",
                           kvb_type_name(dtype), kvb_type_get(dtype)->block_elems, head_dim);
    f->version = KVB_KVFORMAT_VERSION;
    f->dtype = dtype;
    f->block_tokens = block_tokens;
    f->n_layer = n_layer;
    f->n_head_kv = n_head_kv;
    f->head_dim = head_dim;
    return KVB_OK;
}

size_t kvb_kvformat_row_bytes(const kvb_kvformat *f) { return kvb_row_bytes(f->dtype, f->head_dim); }

size_t kvb_kvformat_block_bytes(const kvb_kvformat *f) {
    return (size_t)f->n_layer * 2 * f->n_head_kv * f->block_tokens * kvb_kvformat_row_bytes(f);
}

size_t kvb_kvformat_row_offset(const kvb_kvformat *f, uint32_t layer, uint32_t kv, uint32_t head, uint32_t token) {
    size_t rows = (((size_t)layer * 2 + kv) * f->n_head_kv + head) * f->block_tokens + token;
    return rows * kvb_kvformat_row_bytes(f);
}

void kvb_kvformat_scatter_rows(const kvb_kvformat *f, uint8_t *block, uint32_t layer, uint32_t token0, uint32_t n,
                               const uint8_t *k_rows, const uint8_t *v_rows) {
    const size_t row = kvb_kvformat_row_bytes(f);
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t h = 0; h < f->n_head_kv; h++) {
            const size_t src = ((size_t)t * f->n_head_kv + h) * row;
            memcpy(block + kvb_kvformat_row_offset(f, layer, 0, h, token0 + t), k_rows + src, row);
            memcpy(block + kvb_kvformat_row_offset(f, layer, 1, h, token0 + t), v_rows + src, row);
        }
}

uint64_t kvb_kvformat_fingerprint(const kvb_kvformat *f) {
    uint32_t v[6] = {f->version, f->dtype, f->block_tokens, f->n_layer, f->n_head_kv, f->head_dim};
    return kvb_hash64(v, sizeof v, 0x6b76622d6b76666dULL);
}

void kvb_kvformat_describe(const kvb_kvformat *f, char *buf, size_t cap) {
    char t[16];
    snprintf(t, sizeof t, "%s", kvb_type_name(f->dtype));
    for (char *c = t; *c; c++)
        if (*c >= 'A' && *c <= 'Z') *c = (char)(*c - 'A' + 'a');
    snprintf(buf, cap, "%s/%utok/%uL/%uh/%ud", t, f->block_tokens, f->n_layer, f->n_head_kv, f->head_dim);
}
