/* tests/support/gguf_variant.c — see gguf_variant.h. */
#include "gguf_variant.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_gguf.h"
#include "kvb_quant.h"

static bool is_window_key(kvb_gguf_str key) {
    static const char suffix[] = ".attention.sliding_window";
    const size_t n = sizeof suffix - 1;
    return key.len > n && memcmp(key.ptr + key.len - n, suffix, n) == 0;
}

int kvbt_gguf_variant(const char *src_path, const char *dst, uint32_t window, bool to_f32, char *errbuf, size_t cap) {
    kvb_gguf *src = NULL;
    kvb_gguf_writer *w = NULL;
    kvb_err err = {0};
    FILE *f = NULL;
    float *buf = NULL;
    kvb_status st = kvb_gguf_open(src_path, &src, &err);
    if (!st) st = kvb_gguf_writer_create(&w, &err);
    for (uint64_t i = 0; !st && i < kvb_gguf_n_kv(src); i++) {
        const kvb_gguf_kv *kv = kvb_gguf_kv_at(src, i);
        if (window && is_window_key(kv->key)) {
            char key[256];
            snprintf(key, sizeof key, "%.*s", (int)kv->key.len, kv->key.ptr);
            st = kvb_gguf_writer_add_u32(w, key, window, &err);
        } else if (to_f32 && kvb_gguf_str_eq(kv->key, "general.file_type"))
            st = kvb_gguf_writer_add_u32(w, "general.file_type", 0, &err);
        else st = kvb_gguf_writer_copy_kv(w, kv, &err);
    }
    for (uint64_t i = 0; !st && i < kvb_gguf_n_tensors(src); i++) {
        const kvb_gguf_tensor *t = kvb_gguf_tensor_at(src, i);
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        st = kvb_gguf_writer_add_tensor(w, name, t->n_dims, t->ne, to_f32 ? KVB_TYPE_F32 : t->type, &err);
    }
    if (!st && !(f = fopen(dst, "wb"))) st = kvb_err_set(&err, KVB_ERR_IO, "cannot create %s", dst);
    if (!st) st = kvb_gguf_writer_write_header(w, f, &err);
    for (uint64_t i = 0; !st && i < kvb_gguf_n_tensors(src); i++) {
        const kvb_gguf_tensor *t = kvb_gguf_tensor_at(src, i);
        if (!to_f32 || t->type == KVB_TYPE_F32) {
            st = kvb_gguf_writer_write_tensor_data(w, f, i, t->data, t->n_bytes, &err);
            continue;
        }
        const uint64_t cols = t->ne[0], rb = kvb_row_bytes(t->type, (int64_t)cols), rows = rb ? t->n_bytes / rb : 0;
        free(buf);
        if (!(buf = malloc(sizeof(float) * cols * rows))) { /* (rows, cols) */
            st = kvb_err_set(&err, KVB_ERR_NOMEM, "out of memory decoding %.*s", (int)t->name.len, t->name.ptr);
            break;
        }
        for (uint64_t r = 0; r < rows; r++)
            kvb_row_to_f32(t->type, (const uint8_t *)t->data + r * rb, buf + r * cols, (int64_t)cols);
        st = kvb_gguf_writer_write_tensor_data(w, f, i, buf, sizeof(float) * cols * rows, &err);
    }
    if (f && fclose(f) != 0 && !st) st = kvb_err_set(&err, KVB_ERR_IO, "writing %s failed", dst);
    free(buf);
    kvb_gguf_writer_destroy(w);
    kvb_gguf_close(src);
    if (st) {
        snprintf(errbuf, cap, "%s", err.msg);
        return -1;
    }
    return 0;
}
