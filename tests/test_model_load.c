/* tests/test_model_load.c — loading a model file is hostile-input handling too: a GGUF that is
 * valid as a container but wrong for its architecture (a tensor with other dims, a missing
 * tensor, an absurd head count, an unsupported architecture or tensor type) is refused with a
 * message naming the file and what is wrong, and `kvbridge run` exits 1 with it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_gguf.h"
#include "kvb_model.h"
#include "kvb_quant.h"
#include "kvbt.h"

static char g_src[512];

static int setup(void **state) {
    (void)state;
    kvbt_tmp_path(g_src, sizeof g_src, "src.gguf");
    kvb_gen_opts o = {.preset = "tiny", .type = KVB_TYPE_Q8_0, .seed = 2, .n_threads = 1};
    kvb_err err = {0};
    return kvb_gen_model(&o, g_src, &err) == KVB_OK ? 0 : -1;
}

typedef enum { EDIT_SWAP_DIMS, EDIT_DROP_TENSOR, EDIT_HEADS, EDIT_ARCH, EDIT_TYPE_Q5 } edit_kind;

/* Rewrites the tiny model with one edit applied to `target` (a tensor or key name). */
static void write_edited(const char *out, edit_kind kind, const char *target) {
    kvb_gguf *g;
    kvb_err err = {0};
    assert_int_equal(kvb_gguf_open(g_src, &g, &err), KVB_OK);
    kvb_gguf_writer *w;
    assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
    for (uint64_t i = 0; i < kvb_gguf_n_kv(g); i++) {
        const kvb_gguf_kv *kv = kvb_gguf_kv_at(g, i);
        if (kind == EDIT_HEADS && kvb_gguf_str_eq(kv->key, target))
            assert_int_equal(kvb_gguf_writer_add_u32(w, target, 3, &err), KVB_OK); /* 256/3: not a head size */
        else if (kind == EDIT_ARCH && kvb_gguf_str_eq(kv->key, "general.architecture"))
            assert_int_equal(kvb_gguf_writer_add_str(w, "general.architecture", "mamba", &err), KVB_OK);
        else
            assert_int_equal(kvb_gguf_writer_copy_kv(w, kv, &err), KVB_OK);
    }
    const void *data[256];
    uint64_t sizes[256], n = 0;
    for (uint64_t i = 0; i < kvb_gguf_n_tensors(g); i++) {
        const kvb_gguf_tensor *t = kvb_gguf_tensor_at(g, i);
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        bool hit = !strcmp(name, target);
        if (hit && kind == EDIT_DROP_TENSOR) continue;
        uint64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        uint32_t type = t->type;
        if (hit && kind == EDIT_SWAP_DIMS) { /* same bytes, other shape: (128 x 256) F32 as (256 x 128) */
            uint64_t x = ne[0];
            ne[0] = ne[1];
            ne[1] = x;
        }
        if (hit && kind == EDIT_TYPE_Q5) type = KVB_TYPE_Q5_0; /* a layout we know but do not compute */
        assert_int_equal(kvb_gguf_writer_add_tensor(w, name, t->n_dims, ne, type, &err), KVB_OK);
        data[n] = t->data;
        sizes[n] = t->n_bytes; /* the source bytes available for tensor n */
        n++;
    }
    FILE *f = fopen(out, "wb");
    assert_non_null(f);
    assert_int_equal(kvb_gguf_writer_write_header(w, f, &err), KVB_OK);
    for (uint64_t i = 0; i < n; i++) {
        uint64_t bytes = kvb_gguf_writer_tensor_bytes(w, i);
        void *buf = calloc(1, bytes); /* source bytes, zero-padded where the edit made it larger */
        memcpy(buf, data[i], bytes < sizes[i] ? bytes : sizes[i]);
        assert_int_equal(kvb_gguf_writer_write_tensor_data(w, f, i, buf, bytes, &err), KVB_OK);
        free(buf);
    }
    fclose(f);
    kvb_gguf_writer_destroy(w);
    kvb_gguf_close(g);
}

static void expect_refused(edit_kind kind, const char *target, const char *needle) {
    char path[512], cmd[1200], out[4096];
    kvbt_tmp_path(path, sizeof path, "edited.gguf");
    write_edited(path, kind, target);
    kvb_model *m = NULL;
    kvb_err err = {0};
    assert_int_not_equal(kvb_model_load(path, &m, &err), KVB_OK);
    assert_null(m);
    if (!strstr(err.msg, needle) || !strstr(err.msg, path)) fail_msg("message '%s' lacks '%s' or the path", err.msg, needle);
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' --tokens 1,2 -n 2", kvbt_bin(), path);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 1);
    assert_non_null(strstr(out, needle));
}

static void test_wrong_dims(void **state) {
    (void)state;
    expect_refused(EDIT_SWAP_DIMS, "blk.1.attn_k.weight", "expected [256, 128]");
}
static void test_missing_tensor(void **state) {
    (void)state;
    expect_refused(EDIT_DROP_TENSOR, "blk.3.ffn_down.weight", "'blk.3.ffn_down.weight' is missing");
}
static void test_bad_head_count(void **state) {
    (void)state;
    expect_refused(EDIT_HEADS, "llama.attention.head_count", "head_count");
}
static void test_unsupported_arch(void **state) {
    (void)state;
    expect_refused(EDIT_ARCH, "", "architecture 'mamba' is not supported");
}
static void test_unsupported_type(void **state) {
    (void)state;
    expect_refused(EDIT_TYPE_Q5, "blk.0.attn_q.weight", "Q5_0");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wrong_dims),      cmocka_unit_test(test_missing_tensor),
        cmocka_unit_test(test_bad_head_count),  cmocka_unit_test(test_unsupported_arch),
        cmocka_unit_test(test_unsupported_type),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
