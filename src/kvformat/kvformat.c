/* kvformat/kvformat.c — cache block geometry (per-head K/V or one latent row), description and
 * fingerprint. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#if defined(KVB_X86)
#include <emmintrin.h>
#endif

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

kvb_status kvb_kvformat_init_mla(kvb_kvformat *f, uint32_t dtype, uint32_t block_tokens, uint32_t n_layer,
                                 uint32_t latent_dim, uint32_t rope_dim, kvb_err *err) {
    if (latent_dim == 0 || rope_dim == 0 || latent_dim > 65536 || rope_dim > 65536) {
        memset(f, 0, sizeof *f);
        return kvb_err_set(err, KVB_ERR_INVALID, "latent cache format: latent %u and rope %u dims out of range",
                           latent_dim, rope_dim);
    }
    kvb_status st = kvb_kvformat_init(f, dtype, block_tokens, n_layer, 1, latent_dim + rope_dim, err);
    if (st) return st;
    f->kind = KVB_KVFORMAT_MLA;
    f->latent_dim = latent_dim;
    f->rope_dim = rope_dim;
    return KVB_OK;
}

uint32_t kvb_kvformat_parts(const kvb_kvformat *f) { return f->kind == KVB_KVFORMAT_MLA ? 1 : 2; }

size_t kvb_kvformat_row_bytes(const kvb_kvformat *f) { return kvb_row_bytes(f->dtype, f->head_dim); }

size_t kvb_kvformat_block_bytes(const kvb_kvformat *f) {
    return (size_t)f->n_layer * kvb_kvformat_parts(f) * f->n_head_kv * f->block_tokens * kvb_kvformat_row_bytes(f);
}

/* local layers strictly before `layer` */
static uint32_t locals_before(const kvb_kvformat *f, uint32_t layer) {
    uint32_t n = 0;
    for (uint32_t w = 0; w < layer / 64; w++) n += (uint32_t)__builtin_popcountll(f->local_mask[w]);
    if (layer % 64) n += (uint32_t)__builtin_popcountll(f->local_mask[layer / 64] & (((uint64_t)1 << (layer % 64)) - 1));
    return n;
}

/* Where layer `layer`'s rows sit in a block: the layer itself without local layers; with them the
 * global layers come first (in order), then the local layers (in order), so a block's local rows
 * are one contiguous tail (kvb_kvformat_local_part). */
static uint32_t layer_slot(const kvb_kvformat *f, uint32_t layer) {
    if (!f->window) return layer;
    const uint32_t before = locals_before(f, layer);
    return kvb_kvformat_layer_local(f, layer) ? f->n_layer - f->n_local + before : layer - before;
}

size_t kvb_kvformat_row_offset(const kvb_kvformat *f, uint32_t layer, uint32_t kv, uint32_t head, uint32_t token) {
    size_t rows = (((size_t)layer_slot(f, layer) * kvb_kvformat_parts(f) + kv) * f->n_head_kv + head) * f->block_tokens +
                  token;
    return rows * kvb_kvformat_row_bytes(f);
}

size_t kvb_kvformat_local_part(const kvb_kvformat *f, size_t *bytes) {
    const size_t per_layer = (size_t)kvb_kvformat_parts(f) * f->n_head_kv * f->block_tokens * kvb_kvformat_row_bytes(f);
    *bytes = per_layer * f->n_local;
    return per_layer * (f->n_layer - f->n_local);
}

#if defined(KVB_X86)
/* One row with non-temporal stores: d 16-byte aligned, row a multiple of 16. */
static inline void copy_row_stream(uint8_t *d, const uint8_t *s, size_t row) {
    for (size_t i = 0; i < row; i += 16)
        _mm_stream_si128((__m128i *)(void *)(d + i), _mm_loadu_si128((const __m128i *)(const void *)(s + i)));
}
#endif

static void scatter_rows(const kvb_kvformat *f, uint8_t *block, uint32_t layer, uint32_t token0, uint32_t n,
                         const uint8_t *k_rows, const uint8_t *v_rows, bool stream) {
    const size_t row = kvb_kvformat_row_bytes(f), tok_bytes = (size_t)f->n_head_kv * row;
#if defined(KVB_X86)
    /* whole cache lines only: every row starts on a line when rows are multiples of 64 bytes */
    stream = stream && row % 64 == 0 && ((uintptr_t)block & 63) == 0;
#else
    stream = false;
#endif
    /* head by head, part by part (K, then V where the format has one): a head's rows of consecutive
     * tokens are adjacent in the block, so the destination walks forward by one row */
    const uint8_t *src[2] = {k_rows, v_rows};
    for (uint32_t part = 0; part < kvb_kvformat_parts(f); part++)
        for (uint32_t h = 0; h < f->n_head_kv; h++) {
            uint8_t *dst = block + kvb_kvformat_row_offset(f, layer, part, h, token0);
            const uint8_t *s = src[part] + (size_t)h * row;
            for (uint32_t t = 0; t < n; t++, dst += row, s += tok_bytes) {
#if defined(KVB_X86)
                if (stream) {
                    copy_row_stream(dst, s, row);
                    continue;
                }
#endif
                memcpy(dst, s, row);
            }
        }
#if defined(KVB_X86)
    if (stream) _mm_sfence(); /* the rows are in memory before anyone is told they arrived */
#endif
}

void kvb_kvformat_scatter_rows(const kvb_kvformat *f, uint8_t *block, uint32_t layer, uint32_t token0, uint32_t n,
                               const uint8_t *k_rows, const uint8_t *v_rows) {
    scatter_rows(f, block, layer, token0, n, k_rows, v_rows, false);
}

void kvb_kvformat_scatter_rows_stream(const kvb_kvformat *f, uint8_t *block, uint32_t layer, uint32_t token0,
                                      uint32_t n, const uint8_t *k_rows, const uint8_t *v_rows) {
    scatter_rows(f, block, layer, token0, n, k_rows, v_rows, true);
}

kvb_status kvb_kvformat_set_window(kvb_kvformat *f, uint32_t window, const bool *local, kvb_err *err) {
    f->window = 0;
    f->n_local = 0;
    memset(f->local_mask, 0, sizeof f->local_mask);
    if (window == 0 || !local) return KVB_OK;
    if (f->n_layer > KVB_KVFORMAT_MAX_LAYERS)
        return kvb_err_set(err, KVB_ERR_INVALID, "cache format: %u layers exceed the %d a window can describe",
                           f->n_layer, KVB_KVFORMAT_MAX_LAYERS);
    for (uint32_t l = 0; l < f->n_layer; l++)
        if (local[l]) {
            f->local_mask[l / 64] |= (uint64_t)1 << (l % 64);
            f->n_local++;
        }
    if (f->n_local) f->window = window;
    return KVB_OK;
}

bool kvb_kvformat_layer_local(const kvb_kvformat *f, uint32_t layer) {
    if (!f->window || layer >= f->n_layer || layer >= KVB_KVFORMAT_MAX_LAYERS) return false;
    return (f->local_mask[layer / 64] >> (layer % 64)) & 1;
}

uint32_t kvb_kvformat_local_keep_from(const kvb_kvformat *f, uint32_t ship_to) {
    if (!f->window) return 0;
    const uint32_t e = ship_to / f->block_tokens * f->block_tokens;
    return e > f->window - 1 ? e - (f->window - 1) : 0;
}

uint32_t kvb_kvformat_block_local_lo(const kvb_kvformat *f, uint32_t keep_from, uint32_t block) {
    const uint64_t b0 = (uint64_t)block * f->block_tokens;
    if (keep_from <= b0) return 0;
    return keep_from - b0 < f->block_tokens ? (uint32_t)(keep_from - b0) : f->block_tokens;
}

void kvb_kvformat_token_bytes(const kvb_kvformat *f, uint64_t *global_bytes, uint64_t *local_bytes) {
    const uint64_t per_layer = (uint64_t)kvb_kvformat_parts(f) * f->n_head_kv * kvb_kvformat_row_bytes(f);
    *global_bytes = per_layer * (f->n_layer - f->n_local);
    *local_bytes = per_layer * f->n_local;
}

void kvb_kvformat_ship_bytes(const kvb_kvformat *f, uint32_t ship_from, uint32_t ship_to, uint64_t *global_bytes,
                             uint64_t *local_bytes) {
    uint64_t g, l;
    kvb_kvformat_token_bytes(f, &g, &l);
    if (ship_to < ship_from) ship_to = ship_from;
    uint32_t keep = kvb_kvformat_local_keep_from(f, ship_to);
    if (keep < ship_from) keep = ship_from;
    *global_bytes = g * (ship_to - ship_from);
    *local_bytes = l * (ship_to - keep);
}

uint64_t kvb_kvformat_fingerprint(const kvb_kvformat *f) {
    uint32_t v[6] = {f->version, f->dtype, f->block_tokens, f->n_layer, f->n_head_kv, f->head_dim};
    uint64_t h = kvb_hash64(v, sizeof v, 0x6b76622d6b76666dULL);
    if (f->kind != KVB_KVFORMAT_KV) { /* a latent format: its kind and split are part of what must agree */
        uint32_t k[3] = {f->kind, f->latent_dim, f->rope_dim};
        h = kvb_hash64(k, sizeof k, h);
    }
    if (!f->window) return h; /* a format without local layers: the fingerprint it always had */
    uint64_t w[2 + KVB_KVFORMAT_MAX_LAYERS / 64] = {f->window, f->n_local};
    memcpy(w + 2, f->local_mask, sizeof f->local_mask);
    return kvb_hash64(w, sizeof w, h);
}

void kvb_kvformat_describe(const kvb_kvformat *f, char *buf, size_t cap) {
    char t[16];
    snprintf(t, sizeof t, "%s", kvb_type_name(f->dtype));
    for (char *c = t; *c; c++)
        if (*c >= 'A' && *c <= 'Z') *c = (char)(*c - 'A' + 'a');
    if (f->kind == KVB_KVFORMAT_MLA)
        snprintf(buf, cap, "%s/%utok/%uL/mla%u+%u", t, f->block_tokens, f->n_layer, f->latent_dim, f->rope_dim);
    else if (f->window)
        snprintf(buf, cap, "%s/%utok/%uL/%uh/%ud/%ulocal@%u", t, f->block_tokens, f->n_layer, f->n_head_kv,
                 f->head_dim, f->n_local, f->window);
    else
        snprintf(buf, cap, "%s/%utok/%uL/%uh/%ud", t, f->block_tokens, f->n_layer, f->n_head_kv, f->head_dim);
}
