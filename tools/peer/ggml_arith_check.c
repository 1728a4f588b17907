/* tools/peer/ggml_arith_check.c — ggml's own CPU backend (linked from the llama.cpp build that
 * tools/peer/build_llama_server.sh makes) against kvbridge's llama.cpp fidelity level, on random
 * inputs of Gemma 3 270M's shapes: a Q5_0 and a Q8_0 matrix product (640 -> 256, 9 tokens through
 * llamafile's tinyBLAS, 1 token through ggml_vec_dot) against kvb_quantize_act_ggml +
 * kvb_dot_ggml, and against the canonical dot; RMSNorm times a weight; NEOX RoPE at two bases.
 * Prints how many outputs are bit-identical. Not part of the build or of CI:
 *   B=WORK/build-0.3.36 S=WORK/src-0.3.36/vendor/llama.cpp   (WORK: build_llama_server.sh --work)
 *   gcc -O1 -std=gnu11 -I$S/ggml/include -Isrc/quant -Isrc/core -Isrc/model -Isrc/gguf -Isrc/kvformat tools/peer/ggml_arith_check.c \
 *       -o /tmp/ggml_arith_check $B/ggml/src/libggml.a $B/ggml/src/libggml-cpu.a \
 *       $B/ggml/src/libggml-base.a build/libkvbridge.a -lxxhash -lstdc++ -fopenmp -lm -lpthread -lcrypto -lssl
 * kvb_cpu_rmsnorm_arith and kvb_cpu_rope_arith are the CPU engine's (engine/cpu/cpu_internal.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <stdbool.h>
#include "ggml.h"
#include "ggml-cpu.h"
#include "kvb_model.h"
#include "kvb_quant.h"
void kvb_cpu_rmsnorm_arith(const float *x, const float *w, uint32_t n, float eps, float *y, bool ggml);
void kvb_cpu_rope_arith(float *v, uint32_t n_rot, bool neox, const float *c, const float *s, bool ggml);

static float rn(void) { float u = (rand() + 1.0f) / (RAND_MAX + 2.0f), v = rand() / (float)RAND_MAX; return sqrtf(-2*logf(u))*cosf(6.2831853f*v); }

int main(void) {
    srand(7);
    struct ggml_init_params ip = { 512u << 20, NULL, false };
    struct ggml_context *ctx = ggml_init(ip);
    const int K = 640, M = 256;
    int types[2] = {GGML_TYPE_Q5_0, GGML_TYPE_Q8_0};
    for (int ti = 0; ti < 4; ti++) {
        const int N = ti < 2 ? 9 : 1;
        struct ggml_tensor *W = ggml_new_tensor_2d(ctx, types[ti % 2], K, M);
        struct ggml_tensor *X = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, N);
        float *wf = malloc(sizeof(float) * K * M);
        for (int i = 0; i < K * M; i++) wf[i] = rn() * 0.05f;
        for (int r = 0; r < M; r++) kvb_f32_to_row(types[ti % 2], wf + r * K, (char *)W->data + r * W->nb[1], K);
        float *x = X->data;
        for (int i = 0; i < K * N; i++) x[i] = rn() * (i % 7 + 1);
        struct ggml_tensor *Y = ggml_mul_mat(ctx, W, X);
        struct ggml_cgraph *g = ggml_new_graph(ctx);
        ggml_build_forward_expand(g, Y);
        ggml_graph_compute_with_ctx(ctx, g, 2);
        int same = 0, same_canon = 0;
        uint8_t act[64 * 34];
        for (int t = 0; t < N; t++) {
            kvb_quantize_act_ggml(x + t * K, act, K);
            for (int r = 0; r < M; r++) {
                float ours = kvb_dot_ggml(types[ti % 2], (char *)W->data + r * W->nb[1], act, K);
                float theirs = ((float *)Y->data)[t * M + r];
                same += !memcmp(&ours, &theirs, 4);
                uint8_t act2[64 * 34];
                kvb_quantize_act(types[ti % 2], x + t * K, act2, K);
                float canon = kvb_dot(types[ti % 2], (char *)W->data + r * W->nb[1], act2, K);
                same_canon += !memcmp(&canon, &theirs, 4);
            }
        }
        printf("%s mul_mat (%d tokens): ggml level %d/%d identical, canonical %d/%d\n", ggml_type_name(types[ti % 2]), N, same, M * N, same_canon, M * N);
    }
    { // rms_norm * w
        const int E = 640, T = 16;
        struct ggml_tensor *X = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, E, T), *Wn = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, E);
        float *x = X->data, *w = Wn->data;
        for (int i = 0; i < E * T; i++) x[i] = rn() * 3;
        for (int i = 0; i < E; i++) w[i] = 1 + rn() * 0.1f;
        struct ggml_tensor *Y = ggml_mul(ctx, ggml_rms_norm(ctx, X, 1e-6f), Wn);
        struct ggml_cgraph *g = ggml_new_graph(ctx);
        ggml_build_forward_expand(g, Y);
        ggml_graph_compute_with_ctx(ctx, g, 2);
        int same = 0, same_c = 0;
        float y[640];
        for (int t = 0; t < T; t++) {
            kvb_cpu_rmsnorm_arith(x + t * E, w, E, 1e-6f, y, true);
            same += !memcmp(y, (float *)Y->data + t * E, sizeof y);
            kvb_cpu_rmsnorm_arith(x + t * E, w, E, 1e-6f, y, false);
            same_c += !memcmp(y, (float *)Y->data + t * E, sizeof y);
        }
        printf("rms_norm*w: ggml level %d/%d rows identical, canonical %d/%d\n", same, T, same_c, T);
    }
    { // rope neox, head_dim 256, base 1e6 / 1e4
        const int D = 256, H = 1, T = 40;
        float bases[2] = {1e6f, 1e4f};
        for (int bi = 0; bi < 2; bi++) {
            struct ggml_tensor *X = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, H, T);
            struct ggml_tensor *P = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
            float *x = X->data;
            int32_t *p = P->data;
            for (int i = 0; i < D * H * T; i++) x[i] = rn();
            for (int t = 0; t < T; t++) p[t] = t * 413 + (t ? 1 : 0);
            struct ggml_tensor *Y = ggml_rope_ext(ctx, X, P, NULL, D, GGML_ROPE_TYPE_NEOX, 32768, bases[bi], 1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
            struct ggml_cgraph *g = ggml_new_graph(ctx);
            ggml_build_forward_expand(g, Y);
            ggml_graph_compute_with_ctx(ctx, g, 2);
            int same = 0;
            kvb_model m = {0}; /* just the RoPE fields kvb_rope_tables reads */
            m.d.n_rot = D, m.d.head_dim = D, m.d.n_layer = 1, m.d.rope_freq_base = bases[bi], m.d.rope_neox = true;
            kvb_rope_tables rt;
            kvb_err err = {0};
            if (kvb_rope_tables_init(&rt, &m, T, &err) || kvb_rope_tables_set_ggml(&rt, &err)) return 1;
            kvb_rope_tables_fill_at(&rt, (const uint32_t *)p, T);
            for (int t = 0; t < T; t++) {
                float v[256];
                memcpy(v, x + t * D, sizeof v);
                kvb_cpu_rope_arith(v, D, true, rt.cos + t * D / 2, rt.sin + t * D / 2, true);
                same += !memcmp(v, (float *)Y->data + t * D, sizeof v);
            }
            printf("rope neox base %g: ggml level %d/%d rows identical\n", bases[bi], same, T);
            kvb_rope_tables_free(&rt);
        }
    }
    return 0;
}
