/* fuzz/fuzz_llama_state.c — libFuzzer target for llama.cpp's sequence state file parser
 * (foreign/kvb_foreign.h): each input is parsed from libFuzzer's exactly sized buffer (ASan sees
 * any over-read). A rejected input must carry a message. An accepted one must be written back by
 * the writer to exactly the input's bytes: the format stores nothing the parsed state does not
 * hold, so parse and write are inverse, and the writer never produces a file the parser rejects.
 * Built with FUZZ_LLAMA_STATE_WRITE_SEEDS=1 it writes valid files (one cache and two, V
 * transposed and not, packed tokens and plain, and Gemma 3's iSWA shape: caches of different layer
 * counts, the sliding-window one holding only the last cells) into the directory named by its
 * argument. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_foreign.h"
#include "kvb_quant.h"

static void check(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "fuzz_llama_state: invariant violated: %s\n", what);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvb_llama_state s;
    kvb_err err = {0};
    if (kvb_llama_state_parse(data, size, &s, &err)) {
        check(err.msg[0] != 0, "a refusal says why");
        return 0;
    }
    size_t n = 0, len = 0;
    check(kvb_llama_state_size(&s, &n, &err) == KVB_OK, "a parsed state can be sized");
    check(n == size, "the size of a parsed state is the input's");
    uint8_t *out = malloc(n ? n : 1);
    check(out != NULL, "allocation");
    check(kvb_llama_state_write(&s, out, n, &len, &err) == KVB_OK, "a parsed state can be written");
    check(len == size && memcmp(out, data, size) == 0, "written back byte for byte");
    free(out);
    kvb_llama_state_free(&s);
    return 0;
}

#if FUZZ_LLAMA_STATE_WRITE_SEEDS
static int write_seed(const char *dir, const char *name, const kvb_llama_state *s) {
    char path[4096];
    kvb_err err = {0};
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (kvb_llama_state_save(s, path, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: fuzz_llama_state_seeds DIR\n");
        return 2;
    }
    int32_t tokens[6] = {2, 818, 5279, 529, 7001, 563}, pos[6] = {0, 1, 2, 3, 4, 5};
    uint8_t k[2 * 6 * 8], v[2 * 6 * 8];
    for (size_t i = 0; i < sizeof k; i++) k[i] = (uint8_t)(i * 7), v[i] = (uint8_t)(i * 13 + 1);
    kvb_llama_state s = {.n_tokens = 6, .tokens = tokens, .server_packed = true, .n_cache = 1};
    s.cache[0] = (kvb_llama_cache){.n_stream = 1, .n_cells = 6, .pos = pos, .n_layer = 2, .k_type = KVB_TYPE_F16,
                                   .v_type = KVB_TYPE_F16, .k_row_bytes = 8, .v_row_bytes = 8, .k = k, .v = v};
    int rc = write_seed(argv[1], "one_cache_rows", &s);
    s.cache[0].v_trans = true;
    rc |= write_seed(argv[1], "one_cache_vtrans", &s);
    s.server_packed = false;
    s.n_cache = 2;
    s.cache[1] = s.cache[0];
    s.cache[1].n_stream = 2, s.cache[1].stream = 1, s.cache[1].n_cells = 3, s.cache[1].pos = pos + 3;
    rc |= write_seed(argv[1], "two_caches_plain_tokens", &s);
    /* Gemma 3's shape as llama-server saves it: packed tokens, the global cache of 1 layer with every
     * cell, the sliding-window cache of 2 layers (its own count) with the last 4 cells only */
    s.server_packed = true;
    s.cache[0].n_layer = 1;
    s.cache[1] = s.cache[0];
    s.cache[1].n_layer = 2, s.cache[1].n_cells = 4, s.cache[1].pos = pos + 2;
    rc |= write_seed(argv[1], "iswa_window_cells", &s);
    return rc;
}
#endif
