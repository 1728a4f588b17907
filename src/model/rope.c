/* model/rope.c — the one RoPE table: inverse frequencies (with Llama-3 scaling or the file's
 * rope_freqs factors) and per-position cos/sin, computed on the host in double and rounded to
 * f32 once, so the CPU engine, the CUDA engine and the bridge rotate with identical numbers. */
#include <math.h>

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
        out[i] = f;
    }
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
