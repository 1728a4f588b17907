/* fuzz/fuzz_gguf.c — libFuzzer target for the GGUF reader. Each input is opened with
 * kvb_gguf_open_memory (libFuzzer's buffer is exactly sized, so ASan sees any over-read). A
 * rejected input must come back with a message that starts with the file's name. An accepted one
 * is walked through everything the API exposes — every key (and its lookup), every typed getter,
 * every numeric array byte, every string of every string array, every tensor's lookup and first
 * and last data byte — checking the invariants the reader promises (views inside the buffer,
 * dims >= 1, aligned offsets). Then it is copied through the writer (copy_kv and add_tensor),
 * and the copy must open again with the same KVs and tensor bytes: the writer must never produce
 * a file the reader rejects, and must accept everything the reader accepts. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_gguf.h"

#define FUZZ_NAME "fuzz.gguf"

static const uint8_t *g_lo, *g_hi; /* the input buffer, for containment checks */
static volatile uint64_t g_sink;   /* keeps the touched bytes observable */

static void check(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "fuzz_gguf: invariant violated: %s\n", what);
        abort();
    }
}

static void touch(const void *p, uint64_t n) {
    const uint8_t *b = p;
    check(n == 0 || (b >= g_lo && b + n <= g_hi && b + n >= b), "view lies inside the input");
    uint64_t s = 0;
    for (uint64_t i = 0; i < n; i++) s += b[i];
    g_sink += s;
}

static void walk_string_array(const kvb_gguf_kv *kv) {
    kvb_err err;
    kvb_gguf_str *strs = malloc((kv->arr_len ? kv->arr_len : 1) * sizeof *strs);
    check(strs != NULL, "string array views allocated");
    check(kvb_gguf_arr_strings(kv, strs, &err) == KVB_OK, "arr_strings on a string array");
    for (uint64_t i = 0; i < kv->arr_len; i++) touch(strs[i].ptr, strs[i].len);
    free(strs);
}

static void call_getters(const kvb_gguf *g, const char *key) {
    kvb_err err;
    uint64_t u64;
    uint32_t u32;
    float f;
    bool b;
    char s[64];
    g_sink += kvb_gguf_get_u64(g, key, &u64, &err) == KVB_OK ? u64 : 0;
    g_sink += kvb_gguf_get_u32(g, key, &u32, &err) == KVB_OK ? u32 : 0;
    g_sink += kvb_gguf_get_f32(g, key, &f, &err) == KVB_OK ? (uint64_t)(f == f) : 0;
    g_sink += kvb_gguf_get_bool(g, key, &b, &err) == KVB_OK ? b : 0;
    g_sink += kvb_gguf_get_str(g, key, s, sizeof s, &err) == KVB_OK ? strlen(s) : 0;
}

static void walk_kvs(const kvb_gguf *g) {
    for (uint64_t i = 0; i < kvb_gguf_n_kv(g); i++) {
        const kvb_gguf_kv *kv = kvb_gguf_kv_at(g, i);
        touch(kv->key.ptr, kv->key.len);
        check(kv->key.len > 0 && memchr(kv->key.ptr, 0, kv->key.len) == NULL, "keys are non-empty C strings");
        char *key = strndup(kv->key.ptr, kv->key.len);
        check(key != NULL, "key copy allocated");
        check(kvb_gguf_find(g, key) == kv, "find(key) returns that KV");
        call_getters(g, key);
        free(key);
        if (kv->type == KVB_GGUF_STRING) {
            touch(kv->str.ptr, kv->str.len);
        } else if (kv->type == KVB_GGUF_ARRAY) {
            check(kv->arr_type != KVB_GGUF_ARRAY, "no nested arrays");
            if (kv->arr_type == KVB_GGUF_STRING)
                walk_string_array(kv);
            else
                touch(kv->arr_data, kv->arr_len * kvb_gguf_vtype_size(kv->arr_type));
        }
    }
    check(kvb_gguf_kv_at(g, kvb_gguf_n_kv(g)) == NULL, "kv_at past the end is NULL");
}

static void walk_tensors(const kvb_gguf *g) {
    for (uint64_t i = 0; i < kvb_gguf_n_tensors(g); i++) {
        const kvb_gguf_tensor *t = kvb_gguf_tensor_at(g, i);
        touch(t->name.ptr, t->name.len);
        char *name = strndup(t->name.ptr, t->name.len);
        check(name != NULL, "name copy allocated");
        check(kvb_gguf_find_tensor(g, name) == t, "find_tensor(name) returns that tensor");
        free(name);
        check(t->n_dims >= 1 && t->n_dims <= KVB_GGUF_MAX_DIMS, "n_dims in 1..4");
        for (int d = 0; d < KVB_GGUF_MAX_DIMS; d++) check(t->ne[d] >= 1, "dims >= 1");
        check(t->offset % kvb_gguf_alignment(g) == 0, "offset aligned");
        check(t->n_bytes > 0, "tensor has bytes");
        const uint8_t *d = t->data;
        touch(d, 1);
        touch(d + t->n_bytes - 1, 1);
    }
}

/* Copies the file through the writer; false if a tensor name is too long for llama.cpp (the
 * writer refuses those; the reader accepts them). */
static bool copy_through_writer(const kvb_gguf *g, char **out, size_t *out_len) {
    kvb_gguf_writer *w;
    kvb_err err;
    check(kvb_gguf_writer_create(&w, &err) == KVB_OK, "writer created");
    for (uint64_t i = 0; i < kvb_gguf_n_kv(g); i++) {
        if (kvb_gguf_writer_copy_kv(w, kvb_gguf_kv_at(g, i), &err) != KVB_OK) {
            fprintf(stderr, "fuzz_gguf: copy_kv refused a KV the reader accepted: %s\n", err.msg);
            abort();
        }
    }
    for (uint64_t i = 0; i < kvb_gguf_n_tensors(g); i++) {
        const kvb_gguf_tensor *t = kvb_gguf_tensor_at(g, i);
        if (t->name.len >= 64) {
            kvb_gguf_writer_destroy(w);
            return false;
        }
        char name[64];
        memcpy(name, t->name.ptr, t->name.len);
        name[t->name.len] = 0;
        if (kvb_gguf_writer_add_tensor(w, name, t->n_dims, t->ne, t->type, &err) != KVB_OK) {
            fprintf(stderr, "fuzz_gguf: add_tensor refused a tensor the reader accepted: %s\n", err.msg);
            abort();
        }
    }
    FILE *f = open_memstream(out, out_len);
    check(f != NULL, "memstream opened");
    check(kvb_gguf_writer_write_header(w, f, &err) == KVB_OK, "header written");
    for (uint64_t i = 0; i < kvb_gguf_n_tensors(g); i++) {
        const kvb_gguf_tensor *t = kvb_gguf_tensor_at(g, i);
        check(kvb_gguf_writer_write_tensor_data(w, f, i, t->data, t->n_bytes, &err) == KVB_OK, "tensor written");
    }
    check(fclose(f) == 0, "memstream closed");
    kvb_gguf_writer_destroy(w);
    return true;
}

static bool same_str(kvb_gguf_str a, kvb_gguf_str b) { return a.len == b.len && memcmp(a.ptr, b.ptr, a.len) == 0; }

static void compare_files(const kvb_gguf *a, const kvb_gguf *b) {
    check(kvb_gguf_n_kv(a) == kvb_gguf_n_kv(b), "copy has the same KV count");
    check(kvb_gguf_n_tensors(a) == kvb_gguf_n_tensors(b), "copy has the same tensor count");
    check(kvb_gguf_alignment(a) == kvb_gguf_alignment(b), "copy has the same alignment");
    for (uint64_t i = 0; i < kvb_gguf_n_kv(a); i++) {
        const kvb_gguf_kv *x = kvb_gguf_kv_at(a, i), *y = kvb_gguf_kv_at(b, i);
        check(same_str(x->key, y->key) && x->type == y->type, "copied KV has the same key and type");
        if (x->type == KVB_GGUF_STRING) check(same_str(x->str, y->str), "copied string is equal");
        if (x->type == KVB_GGUF_ARRAY) check(x->arr_type == y->arr_type && x->arr_len == y->arr_len, "copied array");
        if (x->type != KVB_GGUF_STRING && x->type != KVB_GGUF_ARRAY)
            check(memcmp(&x->v, &y->v, sizeof x->v) == 0 || x->v.f64 != x->v.f64, "copied scalar is equal");
    }
    for (uint64_t i = 0; i < kvb_gguf_n_tensors(a); i++) {
        const kvb_gguf_tensor *x = kvb_gguf_tensor_at(a, i), *y = kvb_gguf_tensor_at(b, i);
        check(same_str(x->name, y->name) && x->type == y->type && x->n_bytes == y->n_bytes, "copied tensor info");
        check(memcmp(x->data, y->data, x->n_bytes) == 0, "copied tensor data");
    }
}

static void roundtrip(const kvb_gguf *g) {
    char *buf = NULL;
    size_t len = 0;
    if (!copy_through_writer(g, &buf, &len)) {
        free(buf);
        return;
    }
    kvb_gguf *copy;
    kvb_err err;
    if (kvb_gguf_open_memory(buf, len, "copy.gguf", &copy, &err) != KVB_OK) {
        fprintf(stderr, "fuzz_gguf: the writer's copy does not open: %s\n", err.msg);
        abort();
    }
    compare_files(g, copy);
    kvb_gguf_close(copy);
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvb_gguf *g = NULL;
    kvb_err err;
    memset(&err, 0, sizeof err);
    g_lo = data;
    g_hi = data + size;
    kvb_status st = kvb_gguf_open_memory(data, size, FUZZ_NAME, &g, &err);
    if (st != KVB_OK) {
        check(g == NULL, "no handle on failure");
        check(memchr(err.msg, 0, sizeof err.msg) != NULL, "message is NUL-terminated");
        check(strncmp(err.msg, FUZZ_NAME ": ", strlen(FUZZ_NAME) + 2) == 0, "message starts with the file name");
        check(st == KVB_ERR_FORMAT || st == KVB_ERR_NOMEM, "rejections are FORMAT (or NOMEM)");
        return 0;
    }
    walk_kvs(g);
    walk_tensors(g);
    roundtrip(g);
    kvb_gguf_close(g);
    return 0;
}
