/* tests/test_gguf.c — the GGUF module: a file written with the streaming writer (every scalar
 * type, strings with NUL bytes, numeric and string arrays, F32/F16/Q8_0 tensors with odd dims)
 * reads back exactly and copies byte for byte through kvb_gguf_writer_copy_kv; the typed getters
 * convert or refuse as documented; the writer refuses what the reader would reject; and a table
 * of malformed files, built byte by byte in memory (plus a few on disk), is each rejected with
 * KVB_ERR_FORMAT and a message that names the file and the defect. Every prefix of a valid file
 * is opened from an exactly sized heap copy so the sanitizers catch any over-read. Finally the
 * `kvbridge inspect` subcommand is run on valid and malformed files. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvb_gguf.h"
#include "kvb_quant.h"

/* ---- a growable byte buffer for building files by hand ------------------------------------ */

typedef struct {
    uint8_t *p;
    size_t len, cap;
} bytes;

static void bb_put(bytes *b, const void *src, size_t n) {
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    if (n) memcpy(b->p + b->len, src, n);
    b->len += n;
}
static void bb_u8(bytes *b, uint8_t v) { bb_put(b, &v, 1); }
static void bb_u32(bytes *b, uint32_t v) {
    for (int i = 0; i < 4; i++) bb_u8(b, (uint8_t)(v >> (8 * i)));
}
static void bb_u64(bytes *b, uint64_t v) {
    for (int i = 0; i < 8; i++) bb_u8(b, (uint8_t)(v >> (8 * i)));
}
static void bb_strn(bytes *b, const char *s, uint64_t n) {
    bb_u64(b, n);
    bb_put(b, s, (size_t)n);
}
static void bb_str(bytes *b, const char *s) { bb_strn(b, s, strlen(s)); }
static void bb_zeros(bytes *b, size_t n) {
    for (size_t i = 0; i < n; i++) bb_u8(b, 0);
}
static void bb_pad(bytes *b, size_t align) { bb_zeros(b, (align - b->len % align) % align); }

static void hdr(bytes *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    bb_put(b, "GGUF", 4);
    bb_u32(b, version);
    bb_u64(b, n_tensors);
    bb_u64(b, n_kv);
}
static void kv_u32(bytes *b, const char *key, uint32_t v) {
    bb_str(b, key);
    bb_u32(b, KVB_GGUF_U32);
    bb_u32(b, v);
}
static void kv_str(bytes *b, const char *key, const char *v) {
    bb_str(b, key);
    bb_u32(b, KVB_GGUF_STRING);
    bb_str(b, v);
}
static void tinfo(bytes *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type, uint64_t off) {
    bb_str(b, name);
    bb_u32(b, n_dims);
    for (uint32_t d = 0; d < n_dims; d++) bb_u64(b, ne[d]);
    bb_u32(b, type);
    bb_u64(b, off);
}
/* One 1-D F32 tensor of n elements at offset off. */
static void tinfo_f32(bytes *b, const char *name, uint64_t n, uint64_t off) {
    tinfo(b, name, 1, (uint64_t[]){n}, KVB_TYPE_F32, off);
}

/* Opens n bytes from an exactly sized heap copy (so ASan sees any over-read). Used for files
 * that must be rejected: an accepted one is closed again and *g reset, the status tells. */
static kvb_status open_exact(const uint8_t *src, size_t n, const char *name, kvb_gguf **g, kvb_err *err) {
    uint8_t *copy = malloc(n ? n : 1);
    assert_non_null(copy);
    if (n) memcpy(copy, src, n);
    kvb_status st = kvb_gguf_open_memory(n ? copy : NULL, n, name, g, err);
    if (st == KVB_OK) {
        kvb_gguf_close(*g);
        *g = NULL;
    }
    free(copy);
    return st;
}

/* ---- the sample file: every KV type and a handful of tensors ------------------------------ */

typedef struct {
    const char *name;
    uint32_t n_dims;
    uint64_t ne[4];
    uint32_t type;
    uint64_t n_bytes; /* expected, computed by hand */
} tensor_spec;

static const tensor_spec k_tensors[] = {
    {"token_embd.weight", 2, {5, 3, 1, 1}, KVB_TYPE_F32, 5 * 3 * 4},
    {"blk.0.attn_q.weight", 3, {7, 3, 2, 1}, KVB_TYPE_F16, 7 * 3 * 2 * 2},
    {"blk.0.ffn_up.weight", 2, {64, 3, 1, 1}, KVB_TYPE_Q8_0, 2 * 34 * 3},
    {"output_norm.weight", 1, {1, 1, 1, 1}, KVB_TYPE_F32, 4},
    {"blk.0.four_d", 4, {3, 1, 2, 5}, KVB_TYPE_F16, 3 * 2 * 5 * 2},
};
#define N_SAMPLE_TENSORS (sizeof k_tensors / sizeof k_tensors[0])
#define N_TOKENS 1000

static uint8_t tensor_byte(size_t t, size_t j) { return (uint8_t)(t * 31 + j * 7 + 1); }

static void token_text(uint64_t i, char *buf, size_t cap) { snprintf(buf, cap, "tok%llu", (unsigned long long)i); }

static const uint8_t k_u8s[] = {0, 1, 255};
static const int16_t k_i16s[] = {-32768, 0, 32767};
static const uint32_t k_u32s[] = {0, 7, 4000000000u};
static const float k_f32s[] = {1.5f, -0.0f, 3e38f};
static const int64_t k_i64s[] = {INT64_MIN, -1, INT64_MAX};
static const double k_f64s[] = {1e-300, -2.5};
static const bool k_bools[] = {true, false, true};

/* Adds the sample's KVs: each scalar type, strings with NULs, arrays, and alignment 64. */
static void add_sample_kvs(kvb_gguf_writer *w) {
    kvb_err err = {0};
    uint8_t u8 = 200;
    int8_t i8 = -100;
    uint16_t u16 = 60000;
    int16_t i16 = -30000;
    uint64_t u64 = (1ull << 60) + 7;
    int64_t i64 = -(1ll << 60);
    double f64 = -1e300;
    assert_int_equal(kvb_gguf_writer_add_str(w, "general.architecture", "llama", &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_u32(w, "general.alignment", 64, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_scalar(w, "t.u8", KVB_GGUF_U8, &u8, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_scalar(w, "t.i8", KVB_GGUF_I8, &i8, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_scalar(w, "t.u16", KVB_GGUF_U16, &u16, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_scalar(w, "t.i16", KVB_GGUF_I16, &i16, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_u32(w, "t.u32", 4000000000u, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_i32(w, "t.i32", -2000000000, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_f32(w, "t.f32", 3.5f, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_bool(w, "t.bool", true, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_u64(w, "t.u64", u64, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_scalar(w, "t.i64", KVB_GGUF_I64, &i64, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_scalar(w, "t.f64", KVB_GGUF_F64, &f64, &err), KVB_OK);
    /* A string value with NUL bytes goes through copy_kv from a hand-made descriptor. */
    kvb_gguf_kv nul_kv = {.key = {"t.str_nul", 9}, .type = KVB_GGUF_STRING, .str = {"a\0b\0", 4}};
    assert_int_equal(kvb_gguf_writer_copy_kv(w, &nul_kv, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_str(w, "t.empty_str", "", &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr(w, "a.u8", KVB_GGUF_U8, k_u8s, 3, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr(w, "a.i16", KVB_GGUF_I16, k_i16s, 3, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr(w, "a.u32", KVB_GGUF_U32, k_u32s, 3, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr(w, "a.f32", KVB_GGUF_F32, k_f32s, 3, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr(w, "a.i64", KVB_GGUF_I64, k_i64s, 3, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr(w, "a.f64", KVB_GGUF_F64, k_f64s, 2, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr(w, "a.bool", KVB_GGUF_BOOL, k_bools, 3, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr(w, "a.empty", KVB_GGUF_I32, NULL, 0, &err), KVB_OK);
    kvb_gguf_str mixed[] = {{"x", 1}, {"", 0}, {"nul\0in\0it", 10}, {"\xe2\x96\x81hello", 8}};
    assert_int_equal(kvb_gguf_writer_add_arr_str(w, "a.str", mixed, 4, &err), KVB_OK);
    static char texts[N_TOKENS][16];
    static kvb_gguf_str toks[N_TOKENS];
    for (uint64_t i = 0; i < N_TOKENS; i++) {
        token_text(i, texts[i], sizeof texts[i]);
        toks[i] = (kvb_gguf_str){texts[i], strlen(texts[i])};
    }
    assert_int_equal(kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", toks, N_TOKENS, &err), KVB_OK);
}

/* Writes the whole sample to f; returns the number of KVs. */
static void write_sample(FILE *f) {
    kvb_gguf_writer *w;
    kvb_err err = {0};
    assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
    add_sample_kvs(w);
    for (size_t t = 0; t < N_SAMPLE_TENSORS; t++) {
        const tensor_spec *s = &k_tensors[t];
        assert_int_equal(kvb_gguf_writer_add_tensor(w, s->name, s->n_dims, s->ne, s->type, &err), KVB_OK);
        assert_int_equal(kvb_gguf_writer_tensor_bytes(w, t), s->n_bytes);
    }
    assert_int_equal(kvb_gguf_writer_write_header(w, f, &err), KVB_OK);
    for (size_t t = 0; t < N_SAMPLE_TENSORS; t++) {
        uint8_t data[512];
        for (size_t j = 0; j < k_tensors[t].n_bytes; j++) data[j] = tensor_byte(t, j);
        assert_int_equal(kvb_gguf_writer_write_tensor_data(w, f, t, data, k_tensors[t].n_bytes, &err), KVB_OK);
    }
    kvb_gguf_writer_destroy(w);
}

/* The sample as bytes in memory (caller frees). */
static uint8_t *sample_bytes(size_t *len) {
    char *buf = NULL;
    FILE *f = open_memstream(&buf, len);
    assert_non_null(f);
    write_sample(f);
    assert_int_equal(fclose(f), 0);
    return (uint8_t *)buf;
}

static char g_tmpdir[64];

static const char *tmp_path(const char *name) {
    static char path[4][256];
    static int next;
    char *p = path[next++ % 4];
    snprintf(p, 256, "%s/%s", g_tmpdir, name);
    return p;
}

static void write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* ---- round trip ---------------------------------------------------------------------------- */

static const kvb_gguf_kv *must_find(const kvb_gguf *g, const char *key, kvb_gguf_vtype type) {
    const kvb_gguf_kv *kv = kvb_gguf_find(g, key);
    assert_non_null(kv);
    assert_true(kvb_gguf_str_eq(kv->key, key));
    assert_int_equal(kv->type, type);
    return kv;
}

static void check_sample_scalars(const kvb_gguf *g) {
    assert_int_equal(must_find(g, "t.u8", KVB_GGUF_U8)->v.u64, 200);
    assert_int_equal(must_find(g, "t.i8", KVB_GGUF_I8)->v.i64, -100);
    assert_int_equal(must_find(g, "t.u16", KVB_GGUF_U16)->v.u64, 60000);
    assert_int_equal(must_find(g, "t.i16", KVB_GGUF_I16)->v.i64, -30000);
    assert_int_equal(must_find(g, "t.u32", KVB_GGUF_U32)->v.u64, 4000000000u);
    assert_int_equal(must_find(g, "t.i32", KVB_GGUF_I32)->v.i64, -2000000000);
    assert_true(must_find(g, "t.f32", KVB_GGUF_F32)->v.f64 == 3.5);
    assert_true(must_find(g, "t.bool", KVB_GGUF_BOOL)->v.b);
    assert_true(must_find(g, "t.u64", KVB_GGUF_U64)->v.u64 == (1ull << 60) + 7);
    assert_true(must_find(g, "t.i64", KVB_GGUF_I64)->v.i64 == -(1ll << 60));
    assert_true(must_find(g, "t.f64", KVB_GGUF_F64)->v.f64 == -1e300);
    const kvb_gguf_kv *s = must_find(g, "t.str_nul", KVB_GGUF_STRING);
    assert_int_equal(s->str.len, 4);
    assert_memory_equal(s->str.ptr, "a\0b\0", 4);
    assert_int_equal(must_find(g, "t.empty_str", KVB_GGUF_STRING)->str.len, 0);
    assert_true(kvb_gguf_str_eq(must_find(g, "general.architecture", KVB_GGUF_STRING)->str, "llama"));
}

static void check_numeric_array(const kvb_gguf *g, const char *key, kvb_gguf_vtype et, const void *want, uint64_t n) {
    const kvb_gguf_kv *kv = must_find(g, key, KVB_GGUF_ARRAY);
    assert_int_equal(kv->arr_type, et);
    assert_int_equal(kv->arr_len, n);
    if (n) assert_memory_equal(kv->arr_data, want, n * kvb_gguf_vtype_size(et));
}

static void check_sample_arrays(const kvb_gguf *g) {
    kvb_err err = {0};
    check_numeric_array(g, "a.u8", KVB_GGUF_U8, k_u8s, 3);
    check_numeric_array(g, "a.i16", KVB_GGUF_I16, k_i16s, 3);
    check_numeric_array(g, "a.u32", KVB_GGUF_U32, k_u32s, 3);
    check_numeric_array(g, "a.f32", KVB_GGUF_F32, k_f32s, 3);
    check_numeric_array(g, "a.i64", KVB_GGUF_I64, k_i64s, 3);
    check_numeric_array(g, "a.f64", KVB_GGUF_F64, k_f64s, 2);
    check_numeric_array(g, "a.bool", KVB_GGUF_BOOL, k_bools, 3);
    check_numeric_array(g, "a.empty", KVB_GGUF_I32, NULL, 0);
    const kvb_gguf_kv *kv = must_find(g, "a.str", KVB_GGUF_ARRAY);
    assert_int_equal(kv->arr_type, KVB_GGUF_STRING);
    assert_int_equal(kv->arr_len, 4);
    kvb_gguf_str s[4];
    assert_int_equal(kvb_gguf_arr_strings(kv, s, &err), KVB_OK);
    assert_true(kvb_gguf_str_eq(s[0], "x"));
    assert_int_equal(s[1].len, 0);
    assert_int_equal(s[2].len, 10);
    assert_memory_equal(s[2].ptr, "nul\0in\0it", 10);
    assert_true(kvb_gguf_str_eq(s[3], "\xe2\x96\x81hello"));
    kv = must_find(g, "tokenizer.ggml.tokens", KVB_GGUF_ARRAY);
    assert_int_equal(kv->arr_len, N_TOKENS);
    kvb_gguf_str *toks = calloc(N_TOKENS, sizeof *toks);
    assert_int_equal(kvb_gguf_arr_strings(kv, toks, &err), KVB_OK);
    for (uint64_t i = 0; i < N_TOKENS; i++) {
        char want[16];
        token_text(i, want, sizeof want);
        assert_true(kvb_gguf_str_eq(toks[i], want));
    }
    free(toks);
    /* Not an array of strings: refused. */
    assert_int_equal(kvb_gguf_arr_strings(must_find(g, "a.u8", KVB_GGUF_ARRAY), s, &err), KVB_ERR_INVALID);
}

static void check_sample_tensors(const kvb_gguf *g) {
    assert_int_equal(kvb_gguf_n_tensors(g), N_SAMPLE_TENSORS);
    assert_int_equal(kvb_gguf_alignment(g), 64);
    assert_int_equal(kvb_gguf_data_offset(g) % 64, 0);
    for (size_t t = 0; t < N_SAMPLE_TENSORS; t++) {
        const tensor_spec *s = &k_tensors[t];
        const kvb_gguf_tensor *ti = kvb_gguf_tensor_at(g, t);
        assert_non_null(ti);
        assert_ptr_equal(kvb_gguf_find_tensor(g, s->name), ti);
        assert_true(kvb_gguf_str_eq(ti->name, s->name));
        assert_int_equal(ti->n_dims, s->n_dims);
        for (int d = 0; d < 4; d++) assert_int_equal(ti->ne[d], s->ne[d]);
        assert_int_equal(ti->type, s->type);
        assert_int_equal(ti->n_bytes, s->n_bytes);
        assert_int_equal(ti->offset % 64, 0);
        for (size_t j = 0; j < s->n_bytes; j++) assert_int_equal(((const uint8_t *)ti->data)[j], tensor_byte(t, j));
    }
    assert_null(kvb_gguf_tensor_at(g, N_SAMPLE_TENSORS));
    assert_null(kvb_gguf_find_tensor(g, "no.such.tensor"));
    assert_null(kvb_gguf_find(g, "no.such.key"));
}

static void check_sample(const kvb_gguf *g) {
    assert_int_equal(kvb_gguf_version(g), 3);
    assert_int_equal(kvb_gguf_n_kv(g), 25);
    for (uint64_t i = 0; i < kvb_gguf_n_kv(g); i++) {
        const kvb_gguf_kv *kv = kvb_gguf_kv_at(g, i);
        char key[64];
        snprintf(key, sizeof key, "%.*s", (int)kv->key.len, kv->key.ptr);
        assert_ptr_equal(kvb_gguf_find(g, key), kv);
    }
    assert_null(kvb_gguf_kv_at(g, kvb_gguf_n_kv(g)));
    check_sample_scalars(g);
    check_sample_arrays(g);
    check_sample_tensors(g);
}

static void test_roundtrip_memory(void **state) {
    (void)state;
    size_t n;
    uint8_t *buf = sample_bytes(&n);
    kvb_gguf *g;
    kvb_err err = {0};
    assert_int_equal(kvb_gguf_open_memory(buf, n, "sample.gguf", &g, &err), KVB_OK);
    assert_string_equal(kvb_gguf_path(g), "sample.gguf");
    assert_int_equal(kvb_gguf_file_size(g), n);
    check_sample(g);
    kvb_gguf_close(g);
    free(buf);
}

/* The sample written to the temp file `name` and opened from it; *path = the file's path. */
static kvb_gguf *open_sample_file(const char *name, const char **path) {
    *path = tmp_path(name);
    FILE *f = fopen(*path, "wb");
    assert_non_null(f);
    write_sample(f);
    assert_int_equal(fclose(f), 0);
    kvb_gguf *g;
    kvb_err err = {0};
    assert_int_equal(kvb_gguf_open(*path, &g, &err), KVB_OK);
    return g;
}

static void test_roundtrip_file(void **state) {
    (void)state;
    const char *path;
    kvb_gguf *g = open_sample_file("sample.gguf", &path);
    check_sample(g);
    kvb_gguf_close(g);
}

/* kvb_gguf_prefault: the file's pages mapped at once, the handle unchanged; nothing for a memory
 * buffer; a file truncated under the mapping is an I/O error, not a crash (where the kernel has
 * MADV_POPULATE_READ, 5.14 and later). */
static void test_prefault(void **state) {
    (void)state;
    const char *path;
    kvb_gguf *g = open_sample_file("prefault.gguf", &path);
    kvb_err err = {0};
    assert_int_equal(kvb_gguf_prefault(g, &err), KVB_OK);
    check_sample(g);
    bool populate = false;
#ifdef MADV_POPULATE_READ
    void *probe = mmap(NULL, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(probe != MAP_FAILED);
    populate = madvise(probe, 4096, MADV_POPULATE_READ) == 0;
    munmap(probe, 4096);
#endif
    if (populate) {
        assert_int_equal(truncate(path, 0), 0);
        assert_int_equal(kvb_gguf_prefault(g, &err), KVB_ERR_IO);
        print_message("truncated under the mapping: %s\n", err.msg);
    }
    kvb_gguf_close(g);
    size_t n = 0;
    uint8_t *buf = sample_bytes(&n);
    assert_int_equal(kvb_gguf_open_memory(buf, n, "sample.gguf", &g, &err), KVB_OK);
    assert_int_equal(kvb_gguf_prefault(g, &err), KVB_OK);
    kvb_gguf_close(g);
    free(buf);
}

/* Copying every KV and tensor of the sample through a new writer reproduces it byte for byte. */
static void test_copy_kv_reproduces_file(void **state) {
    (void)state;
    size_t n, n2;
    uint8_t *buf = sample_bytes(&n);
    kvb_gguf *g;
    kvb_gguf_writer *w;
    kvb_err err = {0};
    assert_int_equal(kvb_gguf_open_memory(buf, n, "sample.gguf", &g, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
    for (uint64_t i = 0; i < kvb_gguf_n_kv(g); i++)
        assert_int_equal(kvb_gguf_writer_copy_kv(w, kvb_gguf_kv_at(g, i), &err), KVB_OK);
    for (uint64_t i = 0; i < kvb_gguf_n_tensors(g); i++) {
        const kvb_gguf_tensor *t = kvb_gguf_tensor_at(g, i);
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        assert_int_equal(kvb_gguf_writer_add_tensor(w, name, t->n_dims, t->ne, t->type, &err), KVB_OK);
    }
    char *out = NULL;
    FILE *f = open_memstream(&out, &n2);
    assert_int_equal(kvb_gguf_writer_write_header(w, f, &err), KVB_OK);
    for (uint64_t i = 0; i < kvb_gguf_n_tensors(g); i++) {
        const kvb_gguf_tensor *t = kvb_gguf_tensor_at(g, i);
        assert_int_equal(kvb_gguf_writer_write_tensor_data(w, f, i, t->data, t->n_bytes, &err), KVB_OK);
    }
    assert_int_equal(fclose(f), 0);
    assert_int_equal(n2, n);
    assert_memory_equal(out, buf, n);
    kvb_gguf_writer_destroy(w);
    kvb_gguf_close(g);
    free(out);
    free(buf);
}

static void test_typed_getters(void **state) {
    (void)state;
    size_t n;
    uint8_t *buf = sample_bytes(&n);
    kvb_gguf *g;
    kvb_err err = {0};
    uint64_t u64;
    uint32_t u32;
    float f;
    bool b;
    char s[16];
    assert_int_equal(kvb_gguf_open_memory(buf, n, "sample.gguf", &g, &err), KVB_OK);
    assert_int_equal(kvb_gguf_get_u32(g, "t.u8", &u32, &err), KVB_OK);
    assert_int_equal(u32, 200);
    assert_int_equal(kvb_gguf_get_u32(g, "t.u16", &u32, &err), KVB_OK);
    assert_int_equal(u32, 60000);
    assert_int_equal(kvb_gguf_get_u64(g, "t.u64", &u64, &err), KVB_OK);
    assert_true(u64 == (1ull << 60) + 7);
    assert_int_equal(kvb_gguf_get_u32(g, "t.u64", &u32, &err), KVB_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "does not fit in a u32"));
    assert_int_equal(kvb_gguf_get_u64(g, "t.i8", &u64, &err), KVB_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "non-negative"));
    assert_int_equal(kvb_gguf_get_u32(g, "general.architecture", &u32, &err), KVB_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "'general.architecture' is a string, expected u32"));
    assert_int_equal(kvb_gguf_get_u32(g, "tokenizer.ggml.tokens", &u32, &err), KVB_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "array of string"));
    assert_int_equal(kvb_gguf_get_u32(g, "missing.key", &u32, &err), KVB_ERR_NOT_FOUND);
    assert_int_equal(kvb_gguf_get_f32(g, "t.f32", &f, &err), KVB_OK);
    assert_true(f == 3.5f);
    assert_int_equal(kvb_gguf_get_f32(g, "t.f64", &f, &err), KVB_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "does not fit in an f32"));
    assert_int_equal(kvb_gguf_get_f32(g, "t.u32", &f, &err), KVB_ERR_FORMAT);
    assert_int_equal(kvb_gguf_get_bool(g, "t.bool", &b, &err), KVB_OK);
    assert_true(b);
    assert_int_equal(kvb_gguf_get_bool(g, "t.u8", &b, &err), KVB_ERR_FORMAT);
    assert_int_equal(kvb_gguf_get_str(g, "general.architecture", s, sizeof s, &err), KVB_OK);
    assert_string_equal(s, "llama");
    assert_int_equal(kvb_gguf_get_str(g, "general.architecture", s, 5, &err), KVB_ERR_RANGE);
    assert_int_equal(kvb_gguf_get_str(g, "general.architecture", s, 6, &err), KVB_OK);
    assert_int_equal(kvb_gguf_get_str(g, "t.str_nul", s, sizeof s, &err), KVB_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "NUL"));
    assert_int_equal(kvb_gguf_get_str(g, "t.empty_str", s, 1, &err), KVB_OK);
    assert_string_equal(s, "");
    assert_int_equal(kvb_gguf_vtype_size(KVB_GGUF_STRING), 0);
    assert_string_equal(kvb_gguf_vtype_name(KVB_GGUF_F64), "f64");
    assert_string_equal(kvb_gguf_vtype_name((kvb_gguf_vtype)99), "?");
    kvb_gguf_close(g);
    free(buf);
}

/* A file with many keys and tensors: every one is found through the indexes. */
static void test_many_entries_lookup(void **state) {
    (void)state;
    enum { N_KEYS = 1500, N_T = 1200 };
    kvb_gguf_writer *w;
    kvb_err err = {0};
    char name[64];
    assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
    for (uint32_t i = 0; i < N_KEYS; i++) {
        snprintf(name, sizeof name, "k.%u", i);
        assert_int_equal(kvb_gguf_writer_add_u32(w, name, i * 3, &err), KVB_OK);
    }
    for (uint32_t i = 0; i < N_T; i++) {
        snprintf(name, sizeof name, "blk.%u.w", i);
        assert_int_equal(kvb_gguf_writer_add_tensor(w, name, 1, (uint64_t[]){1 + i % 5}, KVB_TYPE_F32, &err), KVB_OK);
    }
    char *buf = NULL;
    size_t n;
    FILE *f = open_memstream(&buf, &n);
    assert_int_equal(kvb_gguf_writer_write_header(w, f, &err), KVB_OK);
    float data[5] = {0};
    for (uint32_t i = 0; i < N_T; i++)
        assert_int_equal(kvb_gguf_writer_write_tensor_data(w, f, i, data, (1 + i % 5) * 4, &err), KVB_OK);
    assert_int_equal(fclose(f), 0);
    kvb_gguf_writer_destroy(w);
    kvb_gguf *g;
    assert_int_equal(kvb_gguf_open_memory(buf, n, "many.gguf", &g, &err), KVB_OK);
    for (uint32_t i = 0; i < N_KEYS; i++) {
        uint32_t v;
        snprintf(name, sizeof name, "k.%u", i);
        assert_int_equal(kvb_gguf_get_u32(g, name, &v, &err), KVB_OK);
        assert_int_equal(v, i * 3);
    }
    for (uint32_t i = 0; i < N_T; i++) {
        snprintf(name, sizeof name, "blk.%u.w", i);
        const kvb_gguf_tensor *t = kvb_gguf_find_tensor(g, name);
        assert_ptr_equal(t, kvb_gguf_tensor_at(g, i));
        assert_int_equal(t->ne[0], 1 + i % 5);
    }
    kvb_gguf_close(g);
    free(buf);
}

/* ---- writer refusals ------------------------------------------------------------------------ */

static void test_writer_refusals(void **state) {
    (void)state;
    kvb_gguf_writer *w;
    kvb_err err = {0};
    uint64_t ne[4] = {33, 2, 1, 1};
    assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_u32(w, "a", 1, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_u32(w, "a", 2, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "duplicate key 'a'"));
    assert_int_equal(kvb_gguf_writer_add_str(w, "", "x", &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_gguf_writer_add_str(w, "bad\nkey", "x", &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_gguf_writer_add_str(w, "bad\xffkey", "x", &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "not valid UTF-8"));
    assert_int_equal(kvb_gguf_writer_add_str(w, "ok.\xe2\x96\x81key", "x", &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_u32(w, "general.alignment", 3, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "power of two"));
    assert_int_equal(kvb_gguf_writer_add_u32(w, "general.alignment", 0, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_gguf_writer_add_u64(w, "general.alignment", 32, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "must be a u32"));
    uint8_t bad_bools[2] = {1, 2};
    assert_int_equal(kvb_gguf_writer_add_arr(w, "b", KVB_GGUF_BOOL, bad_bools, 2, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_gguf_writer_add_arr(w, "b", KVB_GGUF_STRING, bad_bools, 2, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_gguf_writer_add_tensor(w, "q", 2, ne, KVB_TYPE_Q8_0, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "block size 32"));
    assert_int_equal(kvb_gguf_writer_add_tensor(w, "q", 0, ne, KVB_TYPE_F32, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_gguf_writer_add_tensor(w, "q", 5, ne, KVB_TYPE_F32, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_gguf_writer_add_tensor(w, "q", 2, ne, 99, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_gguf_writer_add_tensor(w, "q", 2, (uint64_t[]){4, 0}, KVB_TYPE_F32, &err), KVB_ERR_INVALID);
    char longname[80];
    memset(longname, 'n', 64);
    longname[64] = 0;
    assert_int_equal(kvb_gguf_writer_add_tensor(w, longname, 2, ne, KVB_TYPE_F32, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "llama.cpp"));
    assert_int_equal(kvb_gguf_writer_add_tensor(w, "t0", 2, ne, KVB_TYPE_F32, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_tensor(w, "t0", 2, ne, KVB_TYPE_F32, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "duplicate tensor name"));
    assert_int_equal(kvb_gguf_writer_add_tensor(w, "t1", 1, ne, KVB_TYPE_F32, &err), KVB_OK);
    uint8_t data[264] = {0};
    FILE *f = tmpfile();
    assert_non_null(f);
    assert_int_equal(kvb_gguf_writer_write_tensor_data(w, f, 0, data, 264, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "header"));
    assert_int_equal(kvb_gguf_writer_write_header(w, f, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_u32(w, "late", 1, &err), KVB_ERR_INVALID);
    assert_int_equal(kvb_gguf_writer_write_tensor_data(w, f, 1, data, 132, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "in order"));
    assert_int_equal(kvb_gguf_writer_write_tensor_data(w, f, 0, data, 100, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "needs 264 bytes"));
    assert_int_equal(kvb_gguf_writer_write_tensor_data(w, f, 0, data, 264, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_write_tensor_data(w, f, 1, data, 132, &err), KVB_OK);
    fclose(f);
    kvb_gguf_writer_destroy(w);
}

/* ---- every prefix of a valid file ----------------------------------------------------------- */

static void test_every_prefix(void **state) {
    (void)state;
    /* A small file: two KVs (one string array) and two tensors. */
    kvb_gguf_writer *w;
    kvb_err err = {0};
    kvb_gguf_str strs[] = {{"ab", 2}, {"", 0}, {"c", 1}};
    assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_u32(w, "general.alignment", 16, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_arr_str(w, "v", strs, 3, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_tensor(w, "a", 1, (uint64_t[]){3}, KVB_TYPE_F32, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_add_tensor(w, "b", 1, (uint64_t[]){32}, KVB_TYPE_Q8_0, &err), KVB_OK);
    char *buf = NULL;
    size_t n;
    FILE *f = open_memstream(&buf, &n);
    uint8_t data[34] = {0};
    assert_int_equal(kvb_gguf_writer_write_header(w, f, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_write_tensor_data(w, f, 0, data, 12, &err), KVB_OK);
    assert_int_equal(kvb_gguf_writer_write_tensor_data(w, f, 1, data, 34, &err), KVB_OK);
    assert_int_equal(fclose(f), 0);
    kvb_gguf_writer_destroy(w);
    kvb_gguf *g;
    assert_int_equal(kvb_gguf_open_memory(buf, n, "p.gguf", &g, &err), KVB_OK);
    const kvb_gguf_tensor *last = kvb_gguf_tensor_at(g, 1);
    size_t data_end = (size_t)(kvb_gguf_data_offset(g) + last->offset + last->n_bytes);
    kvb_gguf_close(g);
    assert_true(data_end < n); /* the writer padded the last tensor */
    for (size_t len = 0; len <= n; len++) {
        uint8_t *copy = malloc(len ? len : 1);
        memcpy(copy, buf, len);
        memset(&err, 0, sizeof err);
        kvb_status st = kvb_gguf_open_memory(copy, len, "p.gguf", &g, &err);
        if (len < data_end) {
            if (st == KVB_OK) fail_msg("prefix of %zu bytes (of %zu) was accepted", len, n);
            assert_int_equal(st, KVB_ERR_FORMAT);
            assert_null(g);
            assert_true(strncmp(err.msg, "p.gguf: ", 8) == 0);
        } else {
            if (st != KVB_OK) fail_msg("prefix of %zu bytes: %s", len, err.msg);
            kvb_gguf_close(g);
        }
        free(copy);
    }
    free(buf);
}

/* ---- malformed files ------------------------------------------------------------------------ */

typedef struct {
    const char *name;
    void (*build)(bytes *b);
    const char *want;  /* substring the error message must contain */
    const char *want2; /* and another, or NULL */
} bad_case;

/* A file that is valid: the builders below each change one thing from it. */
static void build_valid(bytes *b) {
    hdr(b, 3, 1, 2);
    kv_str(b, "general.name", "x");
    kv_u32(b, "general.alignment", 32);
    tinfo_f32(b, "a", 4, 0);
    bb_pad(b, 32);
    bb_zeros(b, 16);
}
static void build_bad_magic(bytes *b) {
    bb_put(b, "GGUX", 4);
    bb_u32(b, 3);
    bb_u64(b, 0);
    bb_u64(b, 0);
}
static void build_too_short(bytes *b) { bb_put(b, "GG", 2); }
static void build_version1(bytes *b) { hdr(b, 1, 0, 0); }
static void build_version99(bytes *b) { hdr(b, 99, 0, 0); }
static void build_big_endian(bytes *b) { hdr(b, 0x03000000u, 0, 0); }
static void build_absurd_n_kv(bytes *b) {
    hdr(b, 3, 0, 1ull << 60);
    kv_u32(b, "a", 1);
}
static void build_absurd_n_tensors(bytes *b) {
    hdr(b, 3, 1ull << 60, 0);
    tinfo_f32(b, "a", 4, 0);
}
static void build_counts_together_too_big(bytes *b) {
    hdr(b, 3, 2, 2); /* each fits alone in 80 bytes, not together */
    bb_zeros(b, 80);
}
static void build_string_past_end(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_str(b, "k");
    bb_u32(b, KVB_GGUF_STRING);
    bb_u64(b, 1000);
    bb_put(b, "short", 5);
}
static void build_key_len_past_end(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_u64(b, 1ull << 40);
    bb_zeros(b, 20);
}
static void build_empty_key(bytes *b) {
    hdr(b, 3, 0, 1);
    kv_u32(b, "", 1);
}
static void build_key_with_nul(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_strn(b, "a\0b", 3);
    bb_u32(b, KVB_GGUF_U32);
    bb_u32(b, 1);
}
static void build_key_bad_utf8(bytes *b) {
    hdr(b, 3, 0, 1);
    kv_u32(b, "ab\xc0\xaf", 1); /* overlong '/' */
}
static void build_tensor_name_bad_utf8(bytes *b) {
    hdr(b, 3, 1, 0);
    tinfo_f32(b, "w\xed\xa0\x80", 8, 0); /* a UTF-16 surrogate */
    bb_pad(b, 32);
    bb_zeros(b, 32);
}
static void build_unknown_value_type(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_str(b, "k");
    bb_u32(b, 13);
    bb_u64(b, 0);
}
static void build_nested_array(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_str(b, "k");
    bb_u32(b, KVB_GGUF_ARRAY);
    bb_u32(b, KVB_GGUF_ARRAY);
    bb_u64(b, 1);
    bb_u32(b, KVB_GGUF_U8);
    bb_u64(b, 1);
    bb_u8(b, 0);
}
static void build_unknown_array_type(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_str(b, "k");
    bb_u32(b, KVB_GGUF_ARRAY);
    bb_u32(b, 77);
    bb_u64(b, 0);
}
static void build_array_len_overflow(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_str(b, "k");
    bb_u32(b, KVB_GGUF_ARRAY);
    bb_u32(b, KVB_GGUF_U64);
    bb_u64(b, 1ull << 62);
    bb_zeros(b, 16);
}
static void build_array_past_end(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_str(b, "k");
    bb_u32(b, KVB_GGUF_ARRAY);
    bb_u32(b, KVB_GGUF_U32);
    bb_u64(b, 1000);
    bb_zeros(b, 16);
}
static void build_string_array_absurd(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_str(b, "k");
    bb_u32(b, KVB_GGUF_ARRAY);
    bb_u32(b, KVB_GGUF_STRING);
    bb_u64(b, 1ull << 40);
    bb_zeros(b, 16);
}
static void build_string_array_element_past_end(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_str(b, "k");
    bb_u32(b, KVB_GGUF_ARRAY);
    bb_u32(b, KVB_GGUF_STRING);
    bb_u64(b, 2);
    bb_str(b, "ok");
    bb_u64(b, 50);
    bb_put(b, "abc", 3);
}
static void build_bool_2(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_str(b, "k");
    bb_u32(b, KVB_GGUF_BOOL);
    bb_u8(b, 2);
}
static void build_bool_array_5(bytes *b) {
    hdr(b, 3, 0, 1);
    bb_str(b, "k");
    bb_u32(b, KVB_GGUF_ARRAY);
    bb_u32(b, KVB_GGUF_BOOL);
    bb_u64(b, 3);
    bb_put(b, "\x01\x00\x05", 3);
}
static void build_duplicate_key(bytes *b) {
    hdr(b, 3, 0, 3);
    kv_str(b, "general.name", "x");
    kv_u32(b, "other", 1);
    kv_str(b, "general.name", "y");
}
static void build_alignment(bytes *b, uint32_t type, uint64_t v) {
    hdr(b, 3, 0, 1);
    bb_str(b, "general.alignment");
    bb_u32(b, type);
    if (type == KVB_GGUF_U64)
        bb_u64(b, v);
    else
        bb_u32(b, (uint32_t)v);
}
static void build_alignment_0(bytes *b) { build_alignment(b, KVB_GGUF_U32, 0); }
static void build_alignment_3(bytes *b) { build_alignment(b, KVB_GGUF_U32, 3); }
static void build_alignment_huge(bytes *b) { build_alignment(b, KVB_GGUF_U32, 1u << 21); }
static void build_alignment_u64(bytes *b) { build_alignment(b, KVB_GGUF_U64, 32); }
static void build_alignment_i32(bytes *b) { build_alignment(b, KVB_GGUF_I32, 32); }
static void build_duplicate_tensor(bytes *b) {
    hdr(b, 3, 2, 0);
    tinfo_f32(b, "a", 8, 0);
    tinfo_f32(b, "a", 8, 32);
    bb_pad(b, 32);
    bb_zeros(b, 64);
}
static void build_empty_tensor_name(bytes *b) {
    hdr(b, 3, 1, 0);
    tinfo_f32(b, "", 8, 0);
    bb_pad(b, 32);
    bb_zeros(b, 32);
}
static void build_n_dims(bytes *b, uint32_t n_dims) {
    hdr(b, 3, 1, 0);
    tinfo(b, "a", n_dims, (uint64_t[]){4, 1, 1, 1, 1}, KVB_TYPE_F32, 0);
    bb_pad(b, 32);
    bb_zeros(b, 32);
}
static void build_n_dims_0(bytes *b) { build_n_dims(b, 0); }
static void build_n_dims_5(bytes *b) { build_n_dims(b, 5); }
static void build_dims(bytes *b, uint32_t n_dims, const uint64_t *ne, uint32_t type) {
    hdr(b, 3, 1, 0);
    tinfo(b, "a", n_dims, ne, type, 0);
    bb_pad(b, 32);
    bb_zeros(b, 64);
}
static void build_dim_0(bytes *b) { build_dims(b, 2, (uint64_t[]){4, 0}, KVB_TYPE_F32); }
static void build_dim_huge(bytes *b) { build_dims(b, 1, (uint64_t[]){1ull << 63}, KVB_TYPE_F32); }
static void build_dims_overflow(bytes *b) { build_dims(b, 2, (uint64_t[]){1ull << 32, 1ull << 32}, KVB_TYPE_F32); }
static void build_bytes_overflow(bytes *b) { build_dims(b, 1, (uint64_t[]){1ull << 62}, KVB_TYPE_F32); }
static void build_unknown_tensor_type(bytes *b) { build_dims(b, 1, (uint64_t[]){4}, 99); }
static void build_ne0_not_block_multiple(bytes *b) { build_dims(b, 1, (uint64_t[]){33}, KVB_TYPE_Q8_0); }
static void build_misaligned_offset(bytes *b) {
    hdr(b, 3, 1, 0);
    tinfo_f32(b, "a", 1, 4);
    bb_pad(b, 32);
    bb_zeros(b, 64);
}
static void build_offset_past_end(bytes *b) {
    hdr(b, 3, 1, 0);
    tinfo_f32(b, "a", 1, 1u << 20);
    bb_pad(b, 32);
    bb_zeros(b, 64);
}
static void build_offset_wraps(bytes *b) {
    hdr(b, 3, 1, 0);
    tinfo_f32(b, "a", 16, UINT64_MAX - 31);
    bb_pad(b, 32);
    bb_zeros(b, 64);
}
static void build_data_past_end(bytes *b) {
    hdr(b, 3, 1, 0);
    tinfo_f32(b, "blk.0.w", 16, 0); /* 64 bytes, only 32 present */
    bb_pad(b, 32);
    bb_zeros(b, 32);
}
static void build_overlap(bytes *b) {
    hdr(b, 3, 2, 0);
    tinfo_f32(b, "a", 16, 0);
    tinfo_f32(b, "b", 8, 32);
    bb_pad(b, 32);
    bb_zeros(b, 64);
}
static void build_tensor_info_cut(bytes *b) {
    hdr(b, 3, 1, 1);
    kv_u32(b, "k", 1);
    bb_str(b, "a");
    bb_u32(b, 1);
    bb_u64(b, 4);
    bb_u32(b, KVB_TYPE_F32);
    bb_zeros(b, 7); /* the offset needs 8 */
}

static const bad_case k_bad[] = {
    {"bad_magic", build_bad_magic, "not a GGUF file (magic bytes 47 47 55 58", NULL},
    {"too_short", build_too_short, "too short for the magic", NULL},
    {"version_1", build_version1, "GGUF version 1 is not supported", NULL},
    {"version_99", build_version99, "GGUF version 99 is not supported", NULL},
    {"big_endian", build_big_endian, "big-endian GGUF", NULL},
    {"absurd_n_kv", build_absurd_n_kv, "KV count 1152921504606846976 cannot fit", NULL},
    {"absurd_n_tensors", build_absurd_n_tensors, "tensor count 1152921504606846976 cannot fit", NULL},
    {"counts_together", build_counts_together_too_big, "2 KVs and 2 tensor infos cannot fit", NULL},
    {"string_past_end", build_string_past_end, "string value (length 1000)", "runs past the end of the file"},
    {"key_len_past_end", build_key_len_past_end, "key (length 1099511627776)", "runs past the end"},
    {"empty_key", build_empty_key, "KV #0: empty key", NULL},
    {"key_with_nul", build_key_with_nul, "key contains a control byte (byte 0x00 at position 1)", NULL},
    {"key_bad_utf8", build_key_bad_utf8, "KV #0: key is not valid UTF-8 (byte 0xc0 at position 2)", NULL},
    {"tensor_name_bad_utf8", build_tensor_name_bad_utf8, "tensor #0: tensor name is not valid UTF-8 (byte 0xed", NULL},
    {"unknown_value_type", build_unknown_value_type, "KV #0 'k': unknown value type 13", NULL},
    {"nested_array", build_nested_array, "nested array", NULL},
    {"unknown_array_type", build_unknown_array_type, "unknown array element type 77", NULL},
    {"array_len_overflow", build_array_len_overflow, "array length 4611686018427387904 of u64 elements overflows",
     NULL},
    {"array_past_end", build_array_past_end, "array of 1000 u32", "runs past the end"},
    {"string_array_absurd", build_string_array_absurd, "array of 1099511627776 strings cannot fit", NULL},
    {"string_array_elem_past_end", build_string_array_element_past_end, "array element 1 (length 50)",
     "runs past the end"},
    {"bool_2", build_bool_2, "bool value 2", "(must be 0 or 1)"},
    {"bool_array_5", build_bool_array_5, "bool value 5 in array element 2", NULL},
    {"duplicate_key", build_duplicate_key, "duplicate key 'general.name' (entries #0 and #2)", NULL},
    {"alignment_0", build_alignment_0, "general.alignment must be a power of two", "(it is 0)"},
    {"alignment_3", build_alignment_3, "general.alignment must be a power of two", "(it is 3)"},
    {"alignment_huge", build_alignment_huge, "general.alignment must be a power of two", "(it is 2097152)"},
    {"alignment_u64", build_alignment_u64, "general.alignment must be a u32 (it is a u64)", NULL},
    {"alignment_i32", build_alignment_i32, "general.alignment must be a u32 (it is a i32)", NULL},
    {"duplicate_tensor", build_duplicate_tensor, "duplicate tensor name 'a'", NULL},
    {"empty_tensor_name", build_empty_tensor_name, "tensor #0: empty tensor name", NULL},
    {"n_dims_0", build_n_dims_0, "tensor #0 'a' has 0 dimensions (must be 1 to 4)", NULL},
    {"n_dims_5", build_n_dims_5, "tensor #0 'a' has 5 dimensions (must be 1 to 4)", NULL},
    {"dim_0", build_dim_0, "tensor #0 'a' dimension 1 is 0", NULL},
    {"dim_huge", build_dim_huge, "dimension 0 is 9223372036854775808 (more than 2^63-1)", NULL},
    {"dims_overflow", build_dims_overflow, "element count overflows", NULL},
    {"bytes_overflow", build_bytes_overflow, "byte size overflows", NULL},
    {"unknown_tensor_type", build_unknown_tensor_type, "unknown tensor type 99", NULL},
    {"ne0_not_block_multiple", build_ne0_not_block_multiple, "ne[0]=33 is not a multiple of the Q8_0 block size 32",
     NULL},
    {"misaligned_offset", build_misaligned_offset, "data offset 4 is not a multiple of the alignment 32", NULL},
    {"offset_past_end", build_offset_past_end, "data [offset 1048576, 4 bytes] runs past the end of the file",
     NULL},
    {"offset_wraps", build_offset_wraps, "data [offset 18446744073709551584, 64 bytes] runs past the end", NULL},
    {"data_past_end", build_data_past_end, "tensor #0 'blk.0.w' data [offset 0, 64 bytes] runs past the end",
     "file is 96 bytes"},
    {"overlap", build_overlap, "tensor 'b' data [offset 32, 32 bytes] overlaps tensor 'a' [offset 0, 64 bytes]",
     NULL},
    {"tensor_info_cut", build_tensor_info_cut, "tensor #0 'a': tensor data offset [offset 66, 8 bytes] runs past the end",
     NULL},
};

static void test_valid_base_is_valid(void **state) {
    (void)state;
    bytes b = {0};
    build_valid(&b);
    kvb_gguf *g;
    kvb_err err = {0};
    kvb_status st = kvb_gguf_open_memory(b.p, b.len, "valid.gguf", &g, &err);
    if (st != KVB_OK) fail_msg("%s", err.msg);
    assert_int_equal(kvb_gguf_n_tensors(g), 1);
    assert_int_equal(kvb_gguf_version(g), 3);
    kvb_gguf_close(g);
    b.p[4] = 2; /* version 2 has the same layout */
    st = kvb_gguf_open_memory(b.p, b.len, "valid.gguf", &g, &err);
    if (st != KVB_OK) fail_msg("%s", err.msg);
    assert_int_equal(kvb_gguf_version(g), 2);
    kvb_gguf_close(g);
    free(b.p);
}

static void check_bad_case(const bad_case *c, kvb_status st, const kvb_gguf *g, const kvb_err *err,
                           const char *name) {
    if (st == KVB_OK) fail_msg("case %s: malformed file accepted", c->name);
    assert_null(g);
    if (st != KVB_ERR_FORMAT) fail_msg("case %s: status %d (%s)", c->name, st, err->msg);
    size_t nl = strlen(name);
    if (strncmp(err->msg, name, nl) != 0 || strncmp(err->msg + nl, ": ", 2) != 0)
        fail_msg("case %s: message does not start with the file name: %s", c->name, err->msg);
    if (!strstr(err->msg, c->want)) fail_msg("case %s: message lacks '%s': %s", c->name, c->want, err->msg);
    if (c->want2 && !strstr(err->msg, c->want2))
        fail_msg("case %s: message lacks '%s': %s", c->name, c->want2, err->msg);
}

static void test_malformed_in_memory(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof k_bad / sizeof k_bad[0]; i++) {
        bytes b = {0};
        k_bad[i].build(&b);
        kvb_gguf *g = (kvb_gguf *)&b; /* must be reset to NULL */
        kvb_err err = {0};
        char name[64];
        snprintf(name, sizeof name, "%s.gguf", k_bad[i].name);
        kvb_status st = open_exact(b.p, b.len, name, &g, &err);
        check_bad_case(&k_bad[i], st, g, &err, name);
        free(b.p);
    }
}

/* Some of the same files through the mmap path, plus files that cannot be mapped. */
static void test_malformed_on_disk(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof k_bad / sizeof k_bad[0]; i += 3) {
        bytes b = {0};
        k_bad[i].build(&b);
        char fname[64];
        snprintf(fname, sizeof fname, "%s.gguf", k_bad[i].name);
        const char *path = tmp_path(fname);
        write_file(path, b.p, b.len);
        kvb_gguf *g = NULL;
        kvb_err err = {0};
        kvb_status st = kvb_gguf_open(path, &g, &err);
        check_bad_case(&k_bad[i], st, g, &err, path);
        free(b.p);
    }
    kvb_gguf *g = NULL;
    kvb_err err = {0};
    const char *empty = tmp_path("empty.gguf");
    write_file(empty, "", 0);
    assert_int_equal(kvb_gguf_open(empty, &g, &err), KVB_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "the file is empty"));
    assert_int_equal(kvb_gguf_open(tmp_path("missing.gguf"), &g, &err), KVB_ERR_NOT_FOUND);
    assert_non_null(strstr(err.msg, "missing.gguf: cannot open"));
    assert_int_equal(kvb_gguf_open(g_tmpdir, &g, &err), KVB_ERR_IO);
    assert_non_null(strstr(err.msg, "not a regular file"));
    assert_null(g);
}

/* ---- the CLI -------------------------------------------------------------------------------- */

/* Runs `$KVB_BIN inspect ARGS`, capturing stdout and stderr into files; returns the exit code. */
static int run_inspect(const char *args, char *out, size_t out_cap, char *errtxt, size_t err_cap) {
    const char *bin = getenv("KVB_BIN");
    char cmd[1024];
    const char *o = tmp_path("inspect.out"), *e = tmp_path("inspect.err");
    snprintf(cmd, sizeof cmd, "'%s' inspect %s >'%s' 2>'%s'", bin, args, o, e);
    int rc = system(cmd);
    assert_true(rc != -1 && WIFEXITED(rc));
    const char *paths[2] = {o, e};
    char *bufs[2] = {out, errtxt};
    size_t caps[2] = {out_cap, err_cap};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(paths[i], "rb");
        assert_non_null(f);
        size_t n = fread(bufs[i], 1, caps[i] - 1, f);
        bufs[i][n] = 0;
        fclose(f);
    }
    return WEXITSTATUS(rc);
}

static void test_cli_inspect(void **state) {
    (void)state;
    if (!getenv("KVB_BIN")) {
        print_message("KVB_BIN is not set (run through ctest); skipping the CLI test\n");
        skip();
    }
    static char out[1 << 16], errtxt[4096];
    char args[512];
    const char *good = tmp_path("cli_good.gguf");
    FILE *f = fopen(good, "wb");
    assert_non_null(f);
    write_sample(f);
    assert_int_equal(fclose(f), 0);
    snprintf(args, sizeof args, "'%s' --tensors", good);
    assert_int_equal(run_inspect(args, out, sizeof out, errtxt, sizeof errtxt), 0);
    assert_non_null(strstr(out, "GGUF v3"));
    assert_non_null(strstr(out, "general.architecture"));
    assert_non_null(strstr(out, "blk.0.ffn_up.weight"));
    assert_non_null(strstr(out, "Q8_0"));
    snprintf(args, sizeof args, "'%s' --kv-full", good);
    assert_int_equal(run_inspect(args, out, sizeof out, errtxt, sizeof errtxt), 0);
    assert_non_null(strstr(out, "tok999"));

    bytes b = {0};
    build_data_past_end(&b);
    const char *bad = tmp_path("cli_bad.gguf");
    write_file(bad, b.p, b.len);
    free(b.p);
    snprintf(args, sizeof args, "'%s'", bad);
    assert_int_equal(run_inspect(args, out, sizeof out, errtxt, sizeof errtxt), 1);
    assert_non_null(strstr(errtxt, bad));
    assert_non_null(strstr(errtxt, "runs past the end"));

    snprintf(args, sizeof args, "'%s'", tmp_path("nonexistent.gguf"));
    assert_int_equal(run_inspect(args, out, sizeof out, errtxt, sizeof errtxt), 1);
    assert_non_null(strstr(errtxt, "nonexistent.gguf"));
    assert_int_equal(run_inspect("--help", out, sizeof out, errtxt, sizeof errtxt), 0);
    assert_non_null(strstr(out, "--tensors"));
    assert_int_equal(run_inspect("", out, sizeof out, errtxt, sizeof errtxt), 2);
    assert_int_equal(run_inspect("--bogus x", out, sizeof out, errtxt, sizeof errtxt), 2);
}

/* ---- setup ---------------------------------------------------------------------------------- */

static int make_tmpdir(void **state) {
    (void)state;
    snprintf(g_tmpdir, sizeof g_tmpdir, "/tmp/kvb_test_gguf_XXXXXX");
    return mkdtemp(g_tmpdir) ? 0 : -1;
}

static int remove_tmpdir(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_memory),
        cmocka_unit_test(test_roundtrip_file),
        cmocka_unit_test(test_prefault),
        cmocka_unit_test(test_copy_kv_reproduces_file),
        cmocka_unit_test(test_typed_getters),
        cmocka_unit_test(test_many_entries_lookup),
        cmocka_unit_test(test_writer_refusals),
        cmocka_unit_test(test_every_prefix),
        cmocka_unit_test(test_valid_base_is_valid),
        cmocka_unit_test(test_malformed_in_memory),
        cmocka_unit_test(test_malformed_on_disk),
        cmocka_unit_test(test_cli_inspect),
    };
    return cmocka_run_group_tests(tests, make_tmpdir, remove_tmpdir);
}
