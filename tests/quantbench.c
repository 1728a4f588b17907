/* tests/quantbench.c — a micro-benchmark of kvb_matmul_tile (not a test: it prints, asserts
 * nothing, and is not built by CMake). For each kernel set this CPU runs, on one thread: decode
 * (n_tok = 1) as GB/s of weight bytes streamed through a rows x n matrix far larger than the
 * caches, and prefill (n_tok = 16) as GFLOP/s (2 flops per weight per token). The matrix is
 * walked in tiles of `chunk` rows, the way an engine splits a weight matrix across tasks.
 * Build against the library, e.g.:
 *   gcc -O2 -std=c11 -D_GNU_SOURCE -Isrc/core -Isrc/quant tests/quantbench.c \
 *       build/libkvbridge.a -lxxhash -lcjson -lm -lpthread -o quantbench
 *   ./quantbench [rows] [n] [chunk] [kernel-set] */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_core.h"
#include "kvb_quant.h"

static double bench(uint32_t type, const uint8_t *w, size_t ws, int rows, const uint8_t *a,
                    size_t as, int n_tok, float *y, int64_t n, int chunk, double min_s) {
    double best = 1e30;
    double t_end = kvb_now_s() + min_s;
    int reps = 0;
    while (reps < 3 || kvb_now_s() < t_end) {
        const double t0 = kvb_now_s();
        for (int r = 0; r < rows; r += chunk)
            kvb_matmul_tile(type, w + (size_t)r * ws, ws, KVB_MIN(chunk, rows - r), a, as, n_tok,
                            y + r, (size_t)rows, n);
        const double dt = kvb_now_s() - t0;
        if (dt < best) best = dt;
        reps++;
    }
    return best;
}

int main(int argc, char **argv) {
    const int rows = argc > 1 ? atoi(argv[1]) : 4096;
    const int64_t n = argc > 2 ? atoll(argv[2]) : 4096;
    const int chunk = argc > 3 ? atoi(argv[3]) : 64;
    const uint32_t types[] = {KVB_TYPE_Q8_0, KVB_TYPE_Q4_0, KVB_TYPE_Q5_0, KVB_TYPE_Q4_K, KVB_TYPE_Q5_K,
                              KVB_TYPE_Q6_K, KVB_TYPE_F16,  KVB_TYPE_BF16, KVB_TYPE_F32};
    const char *sets[] = {"scalar", "avx2", "avx512-vnni", "neon"};
    kvb_rng rng;
    kvb_rng_seed(&rng, 1);
    float *xf = malloc((size_t)n * 16 * sizeof(float));   /* [16][n] activations */
    float *y = malloc((size_t)rows * 16 * sizeof(float)); /* [16][rows] */
    float *row = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n * 16; i++) xf[i] = kvb_rng_normal(&rng);
    printf("matrix %d x %" PRId64 ", tiles of %d rows, one thread\n", rows, n, chunk);
    for (size_t ti = 0; ti < KVB_ARRAY_LEN(types); ti++) {
        const uint32_t type = types[ti], at = kvb_act_type(type);
        const size_t ws = kvb_row_bytes(type, n), as = kvb_row_bytes(at, n);
        uint8_t *w = kvb_aligned_alloc(64, ws * (size_t)rows), *a = malloc(as * 16);
        for (int r = 0; r < rows; r++) {
            for (int64_t i = 0; i < n; i++) row[i] = kvb_rng_normal(&rng) * 0.05f;
            kvb_f32_to_row(type, row, w + (size_t)r * ws, n);
        }
        for (int t = 0; t < 16; t++) kvb_quantize_act(type, xf + (size_t)t * n, a + (size_t)t * as, n);
        for (size_t s = 0; s < KVB_ARRAY_LEN(sets); s++) {
            kvb_err err;
            if (argc > 4 && strcmp(argv[4], sets[s]) != 0) continue;
            if (kvb_simd_force(sets[s], &err) != KVB_OK) continue;
            const int slow = strcmp(sets[s], "scalar") == 0;
            const double t1 = bench(type, w, ws, rows, a, as, 1, y, n, chunk, slow ? 0.5 : 1.0);
            const double t16 = bench(type, w, ws, rows, a, as, 16, y, n, chunk, slow ? 0.5 : 1.0);
            printf("%-5s %-12s n_tok=1: %7.2f GB/s (%6.1f ns/row)   n_tok=16: %7.1f GFLOP/s\n",
                   kvb_type_name(type), sets[s], (double)ws * rows / t1 / 1e9, t1 / rows * 1e9,
                   2.0 * (double)rows * (double)n * 16 / t16 / 1e9);
            fflush(stdout);
        }
        kvb_aligned_free(w);
        free(a);
    }
    free(xf);
    free(y);
    free(row);
    return 0;
}
