/* engine/cpu/attention.c — causal attention over the paged cache. One task per (kv head, tile
 * of up to ATT_TILE query tokens): each cache block's K and V rows are decoded from the cache
 * dtype once per task and shared by the GQA group's query heads and the tile's tokens; softmax
 * is computed online block by block (running max, running sum, rescaled accumulator) in a fixed
 * order, so a token's result does not depend on the tile, the chunking or the thread. On a local
 * (sliding-window) layer a query at position p reads keys lo(p) .. p only, lo(p) = max(0,
 * p - window + 1): blocks wholly before the tile's first window are never opened, rows before it
 * never decoded, and each token scores exactly its own window's keys, block by block in the same
 * order whatever the tile. A latent (mla) cache's single row per token serves as key and value
 * (deepseek2's absorbed attention: multi-query over the latent). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#define ATT_TILE 8
/* Keys are reduced in fixed segments of ATT_SEG_BLOCKS cache blocks (by absolute position): each
 * segment's softmax state starts fresh and runs block by block, and the segments' states are
 * merged in segment order. The same arithmetic whether one task walks the segments in turn or
 * several tasks compute them side by side (a long context with few query tokens: decoding, the
 * last prompt token after a bridge), so results never depend on the split, the thread count, the
 * tile or the chunking. */
#define ATT_SEG_BLOCKS 64
#define ATT_PARALLEL_MAX_FLOATS (16u << 20) /* segment states kept for the side-by-side merge */

size_t kvb_cpu_attn_scratch_floats(const kvb_engine *e) {
    const kvb_model_desc *d = &e->m->d;
    size_t G = d->n_head / d->n_head_kv, hd = d->head_dim, bt = e->o.block_tokens;
    return 2 * bt * hd + G * bt + 2 * (size_t)ATT_TILE * G * (hd + 2) + 64;
}

typedef struct {
    kvb_engine *e;
    const kvb_seq *s;
    uint32_t layer, pos0, n;
    const float *q; /* (n, n_head, head_dim) */
    float *out;     /* (n, n_head, head_dim) */
    uint32_t n_tiles, n_segs;
    uint32_t G, hd;       /* query heads per kv head; head_dim */
    size_t state_floats;  /* one tile's softmax state: (ATT_TILE, G, [m, l, acc(hd)]) */
    float *seg_states;    /* side by side: (tile, kv head, segment, tile state) */
} attn_job;

#define WINDOW_LO(local, W, p) ((local) && (p) + 1 > (W) ? (p) + 1 - (W) : 0u) /* first key query p reads */

/* state (count entries of [m, l, acc(head_dim)]) = the empty softmax */
static void state_init(float *state, uint32_t count, uint32_t hd) {
    for (uint32_t i = 0; i < count; i++) {
        float *st = state + (size_t)i * (hd + 2);
        st[0] = -INFINITY;
        st[1] = 0.0f;
        memset(st + 2, 0, hd * sizeof(float));
    }
}

/* run = run (+) seg, entry by entry, in this order of IEEE operations; an entry of seg that saw
 * no key (m = -inf) leaves run as it is, and an empty run takes seg as it is. */
static void state_merge(float *run, const float *seg, uint32_t count, uint32_t hd) {
    for (uint32_t i = 0; i < count; i++) {
        float *r = run + (size_t)i * (hd + 2);
        const float *g = seg + (size_t)i * (hd + 2);
        if (g[0] == -INFINITY) continue;
        if (r[0] == -INFINITY) {
            memcpy(r, g, (hd + 2) * sizeof(float));
            continue;
        }
        const float m = r[0] > g[0] ? r[0] : g[0];
        const float cr = expf(r[0] - m), cg = expf(g[0] - m);
        r[1] = r[1] * cr + g[1] * cg;
        for (uint32_t k = 0; k < hd; k++) r[2 + k] = r[2 + k] * cr + g[2 + k] * cg;
        r[0] = m;
    }
}

/* Tokens [t0, t1) of the job, kv head kvh, against the cache blocks of segment seg, online
 * softmax block by block into state (tile token, group head, [m, l, acc]), which the caller
 * initialised. Each block's K and V rows are decoded once and shared by the group's heads and
 * the tile's tokens; rows before the tile's first window are never decoded. */
static void attend_segment(const attn_job *j, uint32_t kvh, uint32_t t0, uint32_t t1, uint32_t seg, float *wscratch,
                           float *state) {
    kvb_engine *e = j->e;
    const kvb_model_desc *d = &e->m->d;
    const uint32_t hd = d->head_dim, G = d->n_head / d->n_head_kv, bt = e->o.block_tokens;
    const float scale = d->attn_scale;
    const bool local = kvb_layer_is_local(d, j->layer);
    const uint32_t W = d->swa_window;
    float *kbuf = wscratch;                      /* (bt, head_dim) */
    /* a latent (mla) cache has one part: its rows are the keys and the values (the latent the
     * caller takes of the output) alike, decoded once */
    const bool shared_v = kvb_kvformat_parts(&e->fmt) == 1;
    float *vbuf = shared_v ? kbuf : kbuf + (size_t)bt * hd; /* (bt, head_dim) */
    float *sc = kbuf + 2 * (size_t)bt * hd;      /* (group head, bt) raw scores */
    const size_t st_stride = hd + 2;
    const uint32_t last_pos = j->pos0 + t1 - 1;
    const uint32_t tile_lo = WINDOW_LO(local, W, j->pos0 + t0); /* lo(p) grows with p: the tile's smallest */
    uint32_t b = tile_lo / bt;
    if (b < seg * ATT_SEG_BLOCKS) b = seg * ATT_SEG_BLOCKS;
    for (; b < (seg + 1) * ATT_SEG_BLOCKS && b * bt <= last_pos; b++) {
        const uint8_t *blk = kvb_store_block_data(e->store, j->s->blocks[b]);
        const uint32_t j0 = b * bt, j_end = (b + 1) * bt <= last_pos + 1 ? (b + 1) * bt : last_pos + 1;
        const uint32_t nj = j_end - j0;
        const uint32_t first_row = tile_lo > j0 ? tile_lo - j0 : 0; /* rows before it: outside every window */
        const uint8_t *krow = blk + kvb_kvformat_row_offset(&e->fmt, j->layer, 0, kvh, 0);
        const uint8_t *vrow = shared_v ? krow : blk + kvb_kvformat_row_offset(&e->fmt, j->layer, 1, kvh, 0);
        /* a head's rows of consecutive tokens are adjacent in the block, and the cache format makes
         * a row whole blocks of its dtype (kvb_kvformat_init), so they convert as one run */
        const int64_t cnt = (int64_t)(nj - first_row) * hd;
        kvb_row_to_f32(e->fmt.dtype, krow + first_row * e->row_bytes, kbuf + (size_t)first_row * hd, cnt);
        if (!shared_v) kvb_row_to_f32(e->fmt.dtype, vrow + first_row * e->row_bytes, vbuf + (size_t)first_row * hd, cnt);
        for (uint32_t t = t0; t < t1; t++) {
            const uint32_t p = j->pos0 + t, lo = WINDOW_LO(local, W, p);
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
                for (uint32_t jj = 0; jj < nv; jj++) { /* the weights, in place of the scores */
                    scg[jj] = expf(scg[jj] - m_new);
                    l = l + scg[jj];
                }
                /* acc[i] = acc[i] + w_jj * v_jj[i], key by key in order: the same operations as
                 * one key at a time, at SIMD width */
                kvb_f32_rows_weighted_add(acc, scg, vb, hd, (int)nv, hd);
                stt[0] = m_new;
                stt[1] = l;
            }
        }
    }
}

/* Tokens [t0, t1), kv head kvh: normalises the merged state into the output rows. */
static void write_out(const attn_job *j, uint32_t kvh, uint32_t t0, uint32_t t1, const float *state) {
    const kvb_model_desc *d = &j->e->m->d;
    const uint32_t hd = d->head_dim, G = d->n_head / d->n_head_kv;
    for (uint32_t t = t0; t < t1; t++)
        for (uint32_t g = 0; g < G; g++) {
            const float *stt = state + ((size_t)(t - t0) * G + g) * (hd + 2);
            float *o = j->out + ((size_t)t * d->n_head + kvh * G + g) * hd;
            const float inv = 1.0f / stt[1];
            for (uint32_t i = 0; i < hd; i++) o[i] = stt[2 + i] * inv;
        }
}

/* The tile's tokens [t0, t1); returns its state entries ((t1 - t0) tokens x G heads). */
static uint32_t tile_range(const attn_job *j, uint32_t tile, uint32_t *t0, uint32_t *t1) {
    *t0 = tile * ATT_TILE;
    *t1 = *t0 + ATT_TILE < j->n ? *t0 + ATT_TILE : j->n;
    return (*t1 - *t0) * j->G;
}

/* One task per (kv head, tile): the segments in turn, each merged as it finishes. */
static void attn_task(void *ctx, int task, int worker) {
    const attn_job *j = ctx;
    const uint32_t hd = j->hd, bt = j->e->o.block_tokens;
    const uint32_t kvh = (uint32_t)task / j->n_tiles, tile = (uint32_t)task % j->n_tiles;
    uint32_t t0, t1;
    const uint32_t count = tile_range(j, tile, &t0, &t1);
    float *w = j->e->attn_scratch[worker]; /* attend_segment's (kbuf, vbuf, scores), then two states */
    float *run = w + 2 * (size_t)bt * hd + (size_t)j->G * bt;
    float *seg = run + j->state_floats;
    state_init(run, count, hd);
    for (uint32_t sg = 0; sg < j->n_segs; sg++) {
        state_init(seg, count, hd);
        attend_segment(j, kvh, t0, t1, sg, w, seg);
        state_merge(run, seg, count, hd);
    }
    write_out(j, kvh, t0, t1, run);
}

/* Side by side: one task per (kv head, tile, segment) into its own state ... */
static void attn_segment_task(void *ctx, int task, int worker) {
    const attn_job *j = ctx;
    const uint32_t sg = (uint32_t)task % j->n_segs, kt = (uint32_t)task / j->n_segs;
    const uint32_t kvh = kt / j->n_tiles, tile = kt % j->n_tiles;
    uint32_t t0, t1;
    const uint32_t count = tile_range(j, tile, &t0, &t1);
    float *state = j->seg_states + (size_t)task * j->state_floats;
    state_init(state, count, j->hd);
    attend_segment(j, kvh, t0, t1, sg, j->e->attn_scratch[worker], state);
}

/* ... then one per (kv head, tile) merging them in segment order. */
static void attn_merge_task(void *ctx, int task, int worker) {
    (void)worker;
    const attn_job *j = ctx;
    const uint32_t kvh = (uint32_t)task / j->n_tiles, tile = (uint32_t)task % j->n_tiles;
    uint32_t t0, t1;
    const uint32_t count = tile_range(j, tile, &t0, &t1);
    const size_t one = j->state_floats;
    float *run = j->seg_states + (size_t)task * j->n_segs * one; /* segment 0's state, merged into */
    /* attn_task's empty running state merged with segment 0 is segment 0's state, bit for bit;
     * every later segment is merged in order, as there */
    for (uint32_t sg = 1; sg < j->n_segs; sg++) state_merge(run, run + (size_t)sg * one, count, j->hd);
    write_out(j, kvh, t0, t1, run);
}

void kvb_cpu_attention(kvb_engine *e, const kvb_seq *s, uint32_t layer, uint32_t pos0, uint32_t n, const float *q,
                       float *out) {
    const uint32_t bt = e->o.block_tokens, last_block = (pos0 + n - 1) / bt;
    const kvb_model_desc *d = &e->m->d;
    const uint32_t G = d->n_head / d->n_head_kv;
    attn_job j = {e, s, layer, pos0, n, q, out, (n + ATT_TILE - 1) / ATT_TILE, last_block / ATT_SEG_BLOCKS + 1,
                  G, d->head_dim, (size_t)ATT_TILE * G * (d->head_dim + 2), NULL};
    const size_t tasks = (size_t)j.n_tiles * d->n_head_kv;
    const size_t floats = tasks * j.n_segs * j.state_floats;
    /* few (tile, kv head) tasks for the threads and several segments: compute the segments side
     * by side (same results; see ATT_SEG_BLOCKS) */
    if (j.n_segs > 1 && tasks < (size_t)kvb_pool_size(e->pool) && floats <= ATT_PARALLEL_MAX_FLOATS &&
        (j.seg_states = malloc(floats * sizeof(float))) != NULL) {
        kvb_pool_parallel_for(e->pool, (int)(tasks * j.n_segs), attn_segment_task, &j);
        kvb_pool_parallel_for(e->pool, (int)tasks, attn_merge_task, &j);
        free(j.seg_states);
        return;
    }
    kvb_pool_parallel_for(e->pool, (int)tasks, attn_task, &j);
}
