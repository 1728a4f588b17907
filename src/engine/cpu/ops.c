/* engine/cpu/ops.c — the elementwise and matrix building blocks of the CPU forward pass, each a
 * fixed order of IEEE operations so results do not depend on threads or batch shape. */
#include <math.h>

#include "cpu_internal.h"

typedef struct {
    const kvb_mat *W;
    const uint8_t *act;
    size_t act_stride;
    uint32_t n_tok;
    float *y;
    int rows_per_task;
    bool ggml;
} matmul_job;

static void matmul_task(void *ctx, int task, int worker) {
    (void)worker;
    const matmul_job *j = ctx;
    int r0 = task * j->rows_per_task;
    int nr = (int)j->W->rows - r0 < j->rows_per_task ? (int)j->W->rows - r0 : j->rows_per_task;
    (j->ggml ? kvb_matmul_tile_ggml : kvb_matmul_tile)(j->W->type,
                                                      (const uint8_t *)j->W->data + (size_t)r0 * j->W->row_bytes,
                                                      j->W->row_bytes, nr, j->act, j->act_stride, (int)j->n_tok,
                                                      j->y + r0, (size_t)j->W->rows, j->W->cols);
}

typedef struct {
    uint32_t type;
    const float *x;
    int64_t cols;
    uint8_t *act;
    size_t act_stride;
    bool ggml;
} quant_job;

static void quant_task(void *ctx, int task, int worker) {
    (void)worker;
    const quant_job *j = ctx;
    const float *x = j->x + (size_t)task * j->cols;
    uint8_t *a = j->act + (size_t)task * j->act_stride;
    if (j->ggml) kvb_quantize_act_ggml(x, a, j->cols);
    else kvb_quantize_act(j->type, x, a, j->cols);
}

uint32_t kvb_cpu_rows_per_task(const kvb_pool *pool, int64_t rows) {
    /* ~8 tasks per thread for balance; multiples of 16 rows: the kernels share one activation
     * preparation across a tile's rows and reach memory bandwidth from 16 rows up */
    const int64_t want = (int64_t)kvb_pool_size(pool) * 8;
    int64_t rpt = (rows + want - 1) / want;
    rpt = (rpt + 15) & ~(int64_t)15;
    return rpt < 16 ? 16 : (uint32_t)rpt;
}

void kvb_cpu_matmul(kvb_pool *pool, const kvb_mat *W, const float *x, uint32_t n_tok, float *y, uint8_t *act) {
    kvb_cpu_matmul_arith(pool, W, x, n_tok, y, act, false);
}

void kvb_cpu_matmul_arith(kvb_pool *pool, const kvb_mat *W, const float *x, uint32_t n_tok, float *y, uint8_t *act,
                          bool ggml) {
    ggml = ggml && kvb_ggml_dot_type(W->type);
    const uint32_t at = kvb_act_type(W->type);
    const size_t act_stride = kvb_row_bytes(at, W->cols);
    quant_job qj = {W->type, x, W->cols, act, act_stride, ggml};
    kvb_pool_parallel_for(n_tok > 1 ? pool : NULL, (int)n_tok, quant_task, &qj);
    const int rpt = (int)kvb_cpu_rows_per_task(pool, W->rows);
    matmul_job j = {W, act, act_stride, n_tok, y, rpt, ggml};
    kvb_pool_parallel_for(pool, (int)((W->rows + rpt - 1) / rpt), matmul_task, &j);
}

void kvb_cpu_rmsnorm(const float *x, const float *w, uint32_t n, float eps, float *y) {
    kvb_cpu_rmsnorm_arith(x, w, n, eps, y, false);
}

void kvb_cpu_rmsnorm_arith(const float *x, const float *w, uint32_t n, float eps, float *y, bool ggml) {
    float r;
    if (ggml) { /* ggml_compute_forward_rms_norm_f32: each square rounded to f32, summed in double */
        double sum = 0.0;
        for (uint32_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
        const float mean = (float)(sum / n);
        r = 1.0f / sqrtf(mean + eps);
    } else {
        const float ss = kvb_dot(KVB_TYPE_F32, x, x, n);
        r = 1.0f / sqrtf(ss / (float)n + eps);
    }
    for (uint32_t i = 0; i < n; i++) y[i] = (x[i] * r) * w[i];
}

void kvb_cpu_rope(float *v, uint32_t n_rot, bool neox, const float *c, const float *s) {
    kvb_cpu_rope_arith(v, n_rot, neox, c, s, false);
}

void kvb_cpu_rope_arith(float *v, uint32_t n_rot, bool neox, const float *c, const float *s, bool ggml) {
    const uint32_t half = n_rot / 2;
    for (uint32_t i = 0; i < half; i++) {
        uint32_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = v[i0], x1 = v[i1];
        if (ggml) { /* rotate_pairs as GCC contracts it in llama.cpp's build (-std=gnu++17 -mfma) */
            v[i0] = fmaf(x0, c[i], -(x1 * s[i]));
            v[i1] = fmaf(x0, s[i], x1 * c[i]);
            continue;
        }
        float a = x0 * c[i], b = x1 * s[i], e = x0 * s[i], f = x1 * c[i];
        v[i0] = a - b;
        v[i1] = e + f;
    }
}

float kvb_cpu_gelu_tanh(float x) {
    const float x3 = (x * x) * x;
    const float inner = 0.7978845608f * (x + 0.044715f * x3); /* sqrt(2/pi) (x + 0.044715 x^3) */
    return (0.5f * x) * (1.0f + tanhf(inner));
}
