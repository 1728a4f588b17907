/* engine/cpu/attention.c — causal attention over the paged cache. One task per (kv head, tile
 * of up to ATT_TILE query tokens): each cache block's K and V rows are decoded from the cache
 * dtype once per task and shared by the GQA group's query heads and the tile's tokens; softmax
 * is computed online block by block (running max, running sum, rescaled accumulator) in a fixed
 * order, so a token's result does not depend on the tile, the chunking or the thread. On a local
 * (sliding-window) layer a query at position p reads keys lo(p) .. p only, lo(p) = max(0,
 * p - window + 1): blocks wholly before the tile's first window are never opened, rows before it
 * never decoded, and each token scores exactly its own window's keys, block by block in the same
 * order whatever the tile. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

#define ATT_TILE 8

size_t kvb_cpu_attn_scratch_floats(const kvb_engine *e) {
    const kvb_model_desc *d = &e->m->d;
    size_t G = d->n_head / d->n_head_kv, hd = d->head_dim, bt = e->o.block_tokens;
    return 2 * bt * hd + G * bt + (size_t)ATT_TILE * G * (hd + 2) + 64;
}

typedef struct {
    kvb_engine *e;
    const kvb_seq *s;
    uint32_t layer, pos0, n;
    const float *q; /* (n, n_head, head_dim) */
    float *out;     /* (n, n_head, head_dim) */
    uint32_t n_tiles;
} attn_job;

static void attn_task(void *ctx, int task, int worker) {
    const attn_job *j = ctx;
    kvb_engine *e = j->e;
    const kvb_model_desc *d = &e->m->d;
    const uint32_t hd = d->head_dim, G = d->n_head / d->n_head_kv, bt = e->o.block_tokens;
    const uint32_t kvh = (uint32_t)task / j->n_tiles, tile = (uint32_t)task % j->n_tiles;
    const uint32_t t0 = tile * ATT_TILE, t1 = t0 + ATT_TILE < j->n ? t0 + ATT_TILE : j->n;
    const float scale = d->attn_scale;
    const bool local = kvb_layer_is_local(d, j->layer);
    const uint32_t W = d->swa_window;
#define WINDOW_LO(p) (local && (p) + 1 > W ? (p) + 1 - W : 0u) /* first key position query p may read */

    float *kbuf = e->attn_scratch[worker];       /* (bt, head_dim) */
    float *vbuf = kbuf + (size_t)bt * hd;        /* (bt, head_dim) */
    float *sc = vbuf + (size_t)bt * hd;          /* (group head, bt) raw scores */
    float *state = sc + (size_t)G * bt;          /* (tile token, group head, [m, l, acc(head_dim)]) */
    const size_t st_stride = hd + 2;
    for (uint32_t i = 0; i < (t1 - t0) * G; i++) {
        state[i * st_stride] = -INFINITY;
        state[i * st_stride + 1] = 0.0f;
        memset(state + i * st_stride + 2, 0, hd * sizeof(float));
    }
    const uint32_t last_pos = j->pos0 + t1 - 1;
    const uint32_t tile_lo = WINDOW_LO(j->pos0 + t0); /* lo(p) grows with p: the tile's smallest */
    for (uint32_t b = tile_lo / bt; b * bt <= last_pos; b++) {
        const uint8_t *blk = kvb_store_block_data(e->store, j->s->blocks[b]);
        const uint32_t j0 = b * bt, j_end = (b + 1) * bt <= last_pos + 1 ? (b + 1) * bt : last_pos + 1;
        const uint32_t nj = j_end - j0;
        const uint32_t first_row = tile_lo > j0 ? tile_lo - j0 : 0; /* rows before it: outside every window */
        const uint8_t *krow = blk + kvb_kvformat_row_offset(&e->fmt, j->layer, 0, kvh, 0);
        const uint8_t *vrow = blk + kvb_kvformat_row_offset(&e->fmt, j->layer, 1, kvh, 0);
        for (uint32_t jj = first_row; jj < nj; jj++) {
            kvb_row_to_f32(e->fmt.dtype, krow + jj * e->row_bytes, kbuf + (size_t)jj * hd, hd);
            kvb_row_to_f32(e->fmt.dtype, vrow + jj * e->row_bytes, vbuf + (size_t)jj * hd, hd);
        }
        for (uint32_t t = t0; t < t1; t++) {
            const uint32_t p = j->pos0 + t, lo = WINDOW_LO(p);
            if (p < j0 || lo >= j_end) continue; /* block after the query, or wholly before its window */
            const uint32_t ks = lo > j0 ? lo - j0 : 0;            /* first row of the block in the window */
            const uint32_t nv = (p + 1 < j_end ? p + 1 - j0 : nj) - ks; /* keys max(j0, lo) .. min(p, j_end-1) */
            const float *kb = kbuf + (size_t)ks * hd, *vb = vbuf + (size_t)ks * hd; /* (nv, head_dim) */
            /* the G query heads of the group against the block's nv keys in one tile call: each
             * score is exactly kvb_dot(q, k) (the tile kernel's contract), at the tile's speed */
            kvb_matmul_tile(KVB_TYPE_F32, kb, hd * sizeof(float), (int)nv,
                            j->q + ((size_t)t * d->n_head + (size_t)kvh * G) * hd, hd * sizeof(float), (int)G, sc, bt,
                            hd);
            for (uint32_t g = 0; g < G; g++) {
                float *stt = state + ((size_t)(t - t0) * G + g) * st_stride;
                float *scg = sc + (size_t)g * bt;
                float mb = -INFINITY;
                for (uint32_t jj = 0; jj < nv; jj++) {
                    scg[jj] = scg[jj] * scale;
                    if (scg[jj] > mb) mb = scg[jj];
                }
                float m_old = stt[0], m_new = m_old > mb ? m_old : mb;
                float corr = expf(m_old - m_new); /* 0 on the first block (m_old = -inf) */
                float l = stt[1] * corr;
                float *acc = stt + 2;
                for (uint32_t i = 0; i < hd; i++) acc[i] = acc[i] * corr;
                for (uint32_t jj = 0; jj < nv; jj++) {
                    float w = expf(scg[jj] - m_new);
                    l = l + w;
                    const float *vj = vb + (size_t)jj * hd;
                    for (uint32_t i = 0; i < hd; i++) acc[i] = acc[i] + w * vj[i];
                }
                stt[0] = m_new;
                stt[1] = l;
            }
        }
    }
    for (uint32_t t = t0; t < t1; t++)
        for (uint32_t g = 0; g < G; g++) {
            const float *stt = state + ((size_t)(t - t0) * G + g) * st_stride;
            float *o = j->out + ((size_t)t * d->n_head + kvh * G + g) * hd;
            const float inv = 1.0f / stt[1];
            for (uint32_t i = 0; i < hd; i++) o[i] = stt[2 + i] * inv;
        }
#undef WINDOW_LO
}

void kvb_cpu_attention(kvb_engine *e, const kvb_seq *s, uint32_t layer, uint32_t pos0, uint32_t n, const float *q,
                       float *out) {
    attn_job j = {e, s, layer, pos0, n, q, out, (n + ATT_TILE - 1) / ATT_TILE};
    kvb_pool_parallel_for(e->pool, (int)(j.n_tiles * e->m->d.n_head_kv), attn_task, &j);
}
