/* model/rope.c — the one RoPE table: inverse frequencies (with Llama-3 scaling or the file's
 * rope_freqs factors, or YaRN; per layer when local layers have their own base) and per-position cos/sin,
 * computed on the host in double and rounded to f32 once, so the CPU engine, the CUDA engine and
 * the bridge rotate with identical numbers; and the per-layer-kind table set the CPU engine and
 * the CPU bridge fill per chunk. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_model.h"

void kvb_llama3_rope_factors(const kvb_model_desc *d, float *out) {
    const uint32_t half = d->n_rot / 2;
    const double lo_wavelen = (double)d->rope_orig_ctx / d->rope_low_freq_factor;
    const double hi_wavelen = (double)d->rope_orig_ctx / d->rope_high_freq_factor;
    for (uint32_t i = 0; i < half; i++) {
        double freq = pow((double)d->rope_freq_base, -2.0 * i / d->n_rot);
        double wavelen = 2.0 * M_PI / freq;
        double f;
        if (d->rope_scale_factor <= 0 || wavelen < hi_wavelen) f = 1.0;
        else if (wavelen > lo_wavelen) f = d->rope_scale_factor;
        else {
            double smooth = ((double)d->rope_orig_ctx / wavelen - d->rope_low_freq_factor) /
                            (d->rope_high_freq_factor - d->rope_low_freq_factor);
            f = 1.0 / ((1.0 - smooth) / d->rope_scale_factor + smooth);
        }
        out[i] = (float)f;
    }
}

/* YaRN (deepseek2) as ggml's rope applies it with ext_factor 1: pair i's angle blends the
 * interpolated (divided by the factor) and the original one, theta = theta / factor * (1 - r) +
 * theta * r, with r = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1) over the correction range
 * lo = floor(c(beta_fast)), hi = ceil(c(beta_slow)) (clamped to 0 .. n_rot - 1), c(b) = n_rot *
 * ln(orig_ctx / (2 pi b)) / (2 ln base); here as a factor on the inverse frequency, in double. The
 * magnitude factor llama.cpp applies to cos/sin cancels to rope.scaling.attn_factor for deepseek2,
 * which the description requires to be 1. */
static double yarn_scale(const kvb_model_desc *d, uint32_t i) {
    const double base = d->rope_freq_base, orig = d->rope_orig_ctx;
    const double c_fast = d->n_rot * log(orig / (2.0 * M_PI * d->yarn_beta_fast)) / (2.0 * log(base));
    const double c_slow = d->n_rot * log(orig / (2.0 * M_PI * d->yarn_beta_slow)) / (2.0 * log(base));
    const double lo = fmax(0.0, floor(c_fast)), hi = fmin((double)d->n_rot - 1, ceil(c_slow));
    const double y = ((double)i - lo) / fmax(0.001, hi - lo);
    const double r = 1.0 - fmin(1.0, fmax(0.0, y));
    return (1.0 - r) / d->rope_yarn_factor + r;
}

void kvb_rope_inv_freq(const kvb_model *m, double *out) {
    const kvb_model_desc *d = &m->d;
    const uint32_t half = d->n_rot / 2;
    float factors[512];
    const float *fac = m->rope_freqs;
    if (!fac && d->rope_scale_factor > 0 && half <= 512) {
        kvb_llama3_rope_factors(d, factors);
        fac = factors;
    }
    for (uint32_t i = 0; i < half; i++) {
        double f = pow((double)d->rope_freq_base, -2.0 * i / d->n_rot);
        if (fac) f = f / fac[i];
        if (d->rope_linear_factor > 0) f = f / d->rope_linear_factor;
        if (d->rope_yarn_factor > 1.0f) f = f * yarn_scale(d, i);
        out[i] = f;
    }
}

void kvb_rope_inv_freq_layer(const kvb_model *m, uint32_t layer, double *out) {
    const kvb_model_desc *d = &m->d;
    if (!kvb_layer_is_local(d, layer)) {
        kvb_rope_inv_freq(m, out);
        return;
    }
    /* local (sliding-window) layers: their own base, never scaled (Gemma 3's rope_local_base_freq) */
    for (uint32_t i = 0; i < d->n_rot / 2; i++) out[i] = pow((double)d->rope_freq_base_local, -2.0 * i / d->n_rot);
}

kvb_status kvb_rope_tables_init(kvb_rope_tables *t, const kvb_model *m, uint32_t cap, kvb_err *err) {
    memset(t, 0, sizeof *t);
    const kvb_model_desc *d = &m->d;
    t->m = m;
    t->half = d->n_rot / 2;
    t->cap = cap;
    t->n_kinds = kvb_model_has_local_layers(d) ? 2 : 1;
    const size_t per_kind = (size_t)cap * t->half;
    t->inv_freq = malloc(sizeof(double) * t->n_kinds * (t->half ? t->half : 1));
    t->cos = malloc(sizeof(float) * t->n_kinds * (per_kind ? per_kind : 1));
    t->sin = malloc(sizeof(float) * t->n_kinds * (per_kind ? per_kind : 1));
    if (!t->inv_freq || !t->cos || !t->sin) {
        kvb_rope_tables_free(t);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for RoPE tables (%u positions)", cap);
    }
    kvb_rope_inv_freq(m, t->inv_freq); /* kind 0: global */
    if (t->n_kinds == 2) {
        uint32_t local = 0;
        while (!kvb_layer_is_local(d, local)) local++;
        kvb_rope_inv_freq_layer(m, local, t->inv_freq + t->half); /* kind 1: local */
    }
    return KVB_OK;
}

kvb_status kvb_rope_tables_set_ggml(kvb_rope_tables *t, kvb_err *err) {
    const kvb_model *m = t->m;
    const kvb_model_desc *d = &m->d;
    if (d->rope_yarn_factor > 1.0f)
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "ggml's RoPE arithmetic is not reproduced for YaRN models");
    if (!t->ggml_factors && (m->rope_freqs || d->rope_scale_factor > 0)) {
        if (!(t->ggml_factors = malloc(sizeof(float) * (t->half ? t->half : 1))))
            return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for RoPE factors");
        if (m->rope_freqs) memcpy(t->ggml_factors, m->rope_freqs, sizeof(float) * t->half);
        else kvb_llama3_rope_factors(d, t->ggml_factors);
    }
    t->ggml_theta_scale[0] = powf(d->rope_freq_base, -2.0f / (float)d->n_rot);
    t->ggml_freq_scale[0] = d->rope_linear_factor > 0 ? 1.0f / d->rope_linear_factor : 1.0f;
    t->ggml_theta_scale[1] = powf(d->rope_freq_base_local, -2.0f / (float)d->n_rot);
    t->ggml_freq_scale[1] = 1.0f;
    t->ggml = true;
    t->n = 0;
    return KVB_OK;
}

/* Row (half) of kind k's table at position pos, as ggml_rope_cache_init computes it. */
static void rope_row_ggml(const kvb_rope_tables *t, uint32_t k, uint32_t pos, float *c, float *s) {
    const float *ff = k == 0 ? t->ggml_factors : NULL;
    float theta = (float)pos;
    for (uint32_t i = 0; i < t->half; i++) {
        const float th = t->ggml_freq_scale[k] * (ff ? theta / ff[i] : theta);
        c[i] = cosf(th);
        s[i] = sinf(th);
        theta = theta * t->ggml_theta_scale[k];
    }
}

void kvb_rope_tables_free(kvb_rope_tables *t) {
    free(t->ggml_factors);
    free(t->inv_freq);
    free(t->cos);
    free(t->sin);
    memset(t, 0, sizeof *t);
}

void kvb_rope_tables_fill(kvb_rope_tables *t, uint32_t pos0, uint32_t n) {
    const size_t per_kind = (size_t)t->cap * t->half;
    for (uint32_t k = 0; k < t->n_kinds; k++)
        if (t->ggml)
            for (uint32_t p = 0; p < n; p++)
                rope_row_ggml(t, k, pos0 + p, t->cos + k * per_kind + (size_t)p * t->half,
                              t->sin + k * per_kind + (size_t)p * t->half);
        else
            kvb_rope_table(t->inv_freq + (size_t)k * t->half, 2 * t->half, pos0, n, t->cos + k * per_kind,
                       t->sin + k * per_kind);
    t->pos0 = pos0;
    t->n = n;
}

void kvb_rope_tables_fill_at(kvb_rope_tables *t, const uint32_t *pos, uint32_t n) {
    const size_t per_kind = (size_t)t->cap * t->half;
    for (uint32_t k = 0; k < t->n_kinds; k++)
        for (uint32_t i = 0; i < n; i++) {
            float *c = t->cos + k * per_kind + (size_t)i * t->half, *s = t->sin + k * per_kind + (size_t)i * t->half;
            if (t->ggml) rope_row_ggml(t, k, pos[i], c, s);
            else kvb_rope_table(t->inv_freq + (size_t)k * t->half, 2 * t->half, pos[i], 1, c, s);
        }
    t->pos0 = UINT32_MAX; /* not one span */
    t->n = n;
}

uint32_t kvb_rope_tables_kind(const kvb_rope_tables *t, uint32_t layer) {
    return t->n_kinds == 2 && kvb_layer_is_local(&t->m->d, layer) ? 1 : 0;
}

void kvb_rope_tables_layer(const kvb_rope_tables *t, uint32_t layer, const float **cos, const float **sin) {
    const size_t k = kvb_rope_tables_kind(t, layer);
    *cos = t->cos + k * (size_t)t->cap * t->half;
    *sin = t->sin + k * (size_t)t->cap * t->half;
}

void kvb_rope_table(const double *inv_freq, uint32_t n_rot, uint32_t pos0, uint32_t n_pos, float *cos_out,
                    float *sin_out) {
    const uint32_t half = n_rot / 2;
    for (uint32_t p = 0; p < n_pos; p++) {
        double pos = (double)pos0 + p;
        for (uint32_t i = 0; i < half; i++) {
            double th = pos * inv_freq[i];
            cos_out[(size_t)p * half + i] = (float)cos(th);
            sin_out[(size_t)p * half + i] = (float)sin(th);
        }
    }
}

/* One task of kvb_rope_table_pool: positions [task * ROPE_TASK_POS, +ROPE_TASK_POS) of the call. */
#define ROPE_TASK_POS 256
typedef struct {
    const double *inv_freq;
    uint32_t n_rot, pos0, n;
    float *cos_t, *sin_t;
} rope_job;

static void rope_task(void *ctx, int task, int worker) {
    (void)worker;
    const rope_job *j = ctx;
    const uint32_t p = (uint32_t)task * ROPE_TASK_POS, cnt = j->n - p < ROPE_TASK_POS ? j->n - p : ROPE_TASK_POS;
    const size_t at = (size_t)p * (j->n_rot / 2);
    kvb_rope_table(j->inv_freq, j->n_rot, j->pos0 + p, cnt, j->cos_t + at, j->sin_t + at);
}

void kvb_rope_table_pool(kvb_pool *pool, const double *inv_freq, uint32_t n_rot, uint32_t pos0, uint32_t n_pos,
                         float *cos_out, float *sin_out) {
    rope_job j = {inv_freq, n_rot, pos0, n_pos, cos_out, sin_out};
    kvb_pool_parallel_for(pool, (int)((n_pos + ROPE_TASK_POS - 1) / ROPE_TASK_POS), rope_task, &j);
}
