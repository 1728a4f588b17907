/* fuzz/gen_seeds.c — writes a handful of small, valid GGUF files with the project's own writer
 * into a directory, as the fuzzer's starting corpus (no binary blobs live in the repository):
 * a header-only file, every scalar and array type, a tiny llama-shaped model with a vocabulary and
 * F32/F16/Q8_0/Q4_0 tensors, and files with alignment 1 and 256. Usage: gen_seeds DIR. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_gguf.h"
#include "kvb_quant.h"

typedef struct {
    const char *name;
    uint32_t n_dims;
    uint64_t ne[4];
    uint32_t type;
} seed_tensor;

static int fail(const char *what, const kvb_err *err) {
    fprintf(stderr, "gen_seeds: %s: %s\n", what, err->msg);
    return 1;
}

/* Writes the writer's KVs plus the given tensors (filled with a byte pattern) to DIR/NAME. */
static int finish(kvb_gguf_writer *w, const char *dir, const char *name, const seed_tensor *ts, int n) {
    kvb_err err = {0};
    for (int i = 0; i < n; i++)
        if (kvb_gguf_writer_add_tensor(w, ts[i].name, ts[i].n_dims, ts[i].ne, ts[i].type, &err) != KVB_OK)
            return fail(ts[i].name, &err);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        return 1;
    }
    int rc = 0;
    if (kvb_gguf_writer_write_header(w, f, &err) != KVB_OK) rc = fail(path, &err);
    for (int i = 0; i < n && rc == 0; i++) {
        uint64_t nb = kvb_gguf_writer_tensor_bytes(w, (uint64_t)i);
        uint8_t *data = malloc(nb);
        for (uint64_t j = 0; data && j < nb; j++) data[j] = (uint8_t)(j * 37 + (uint64_t)i);
        if (!data || kvb_gguf_writer_write_tensor_data(w, f, (uint64_t)i, data, nb, &err) != KVB_OK)
            rc = fail(path, &err);
        free(data);
    }
    if (fclose(f) != 0) rc = 1;
    kvb_gguf_writer_destroy(w);
    return rc;
}

static int seed_empty(const char *dir) {
    kvb_gguf_writer *w;
    kvb_err err = {0};
    if (kvb_gguf_writer_create(&w, &err) != KVB_OK) return fail("create", &err);
    return finish(w, dir, "empty.gguf", NULL, 0);
}

static int seed_all_types(const char *dir) {
    kvb_gguf_writer *w;
    kvb_err err = {0};
    if (kvb_gguf_writer_create(&w, &err) != KVB_OK) return fail("create", &err);
    uint8_t u8 = 7;
    int8_t i8 = -7;
    uint16_t u16 = 700;
    int16_t i16 = -700;
    int64_t i64 = -70000000000;
    double f64 = 0.125;
    const int32_t i32s[] = {1, -2, 3};
    const float f32s[] = {0.5f, -1.0f};
    const uint8_t bools[] = {0, 1};
    const kvb_gguf_str strs[] = {{"a", 1}, {"", 0}, {"b\0c", 3}};
    kvb_status st = kvb_gguf_writer_add_scalar(w, "s.u8", KVB_GGUF_U8, &u8, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_scalar(w, "s.i8", KVB_GGUF_I8, &i8, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_scalar(w, "s.u16", KVB_GGUF_U16, &u16, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_scalar(w, "s.i16", KVB_GGUF_I16, &i16, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_u32(w, "s.u32", 70000, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_i32(w, "s.i32", -70000, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_f32(w, "s.f32", 1.5f, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_bool(w, "s.bool", true, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_u64(w, "s.u64", 1ull << 40, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_scalar(w, "s.i64", KVB_GGUF_I64, &i64, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_scalar(w, "s.f64", KVB_GGUF_F64, &f64, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_str(w, "s.str", "hello", &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_arr(w, "a.i32", KVB_GGUF_I32, i32s, 3, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_arr(w, "a.f32", KVB_GGUF_F32, f32s, 2, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_arr(w, "a.bool", KVB_GGUF_BOOL, bools, 2, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_arr_str(w, "a.str", strs, 3, &err);
    if (st != KVB_OK) {
        kvb_gguf_writer_destroy(w);
        return fail("all_types", &err);
    }
    return finish(w, dir, "all_types.gguf", NULL, 0);
}

static int seed_tiny_model(const char *dir) {
    kvb_gguf_writer *w;
    kvb_err err = {0};
    if (kvb_gguf_writer_create(&w, &err) != KVB_OK) return fail("create", &err);
    kvb_gguf_str toks[40];
    char text[40][8];
    float scores[40];
    int32_t types[40];
    for (int i = 0; i < 40; i++) {
        snprintf(text[i], sizeof text[i], "t%d", i);
        toks[i] = (kvb_gguf_str){text[i], strlen(text[i])};
        scores[i] = (float)-i;
        types[i] = 1;
    }
    kvb_status st = kvb_gguf_writer_add_str(w, "general.architecture", "llama", &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_u32(w, "general.alignment", 32, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_u32(w, "llama.block_count", 1, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_u32(w, "llama.embedding_length", 32, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_f32(w, "llama.rope.freq_base", 10000.0f, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "gpt2", &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", toks, 40, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVB_GGUF_F32, scores, 40, &err);
    if (st == KVB_OK) st = kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, types, 40, &err);
    if (st != KVB_OK) {
        kvb_gguf_writer_destroy(w);
        return fail("tiny_model", &err);
    }
    static const seed_tensor ts[] = {
        {"token_embd.weight", 2, {32, 4, 1, 1}, KVB_TYPE_Q8_0},
        {"blk.0.attn_norm.weight", 1, {32, 1, 1, 1}, KVB_TYPE_F32},
        {"blk.0.attn_q.weight", 2, {32, 2, 1, 1}, KVB_TYPE_Q4_0},
        {"blk.0.ffn_up.weight", 2, {3, 5, 1, 1}, KVB_TYPE_F16},
        {"output.weight", 3, {2, 2, 2, 1}, KVB_TYPE_F32},
    };
    return finish(w, dir, "tiny_model.gguf", ts, 5);
}

static int seed_alignment(const char *dir, uint32_t alignment, const char *name) {
    kvb_gguf_writer *w;
    kvb_err err = {0};
    if (kvb_gguf_writer_create(&w, &err) != KVB_OK) return fail("create", &err);
    if (kvb_gguf_writer_add_u32(w, "general.alignment", alignment, &err) != KVB_OK) {
        kvb_gguf_writer_destroy(w);
        return fail(name, &err);
    }
    static const seed_tensor ts[] = {
        {"a", 1, {3, 1, 1, 1}, KVB_TYPE_F16},
        {"b", 4, {1, 2, 1, 2}, KVB_TYPE_BF16},
        {"c", 1, {5, 1, 1, 1}, KVB_TYPE_I8},
    };
    return finish(w, dir, name, ts, 3);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: gen_seeds DIR\n");
        return 2;
    }
    int rc = seed_empty(argv[1]);
    rc |= seed_all_types(argv[1]);
    rc |= seed_tiny_model(argv[1]);
    rc |= seed_alignment(argv[1], 1, "align1.gguf");
    rc |= seed_alignment(argv[1], 256, "align256.gguf");
    return rc;
}
