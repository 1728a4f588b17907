/* tests/test_model_load.c — loading a model file is hostile-input handling too: a GGUF that is
 * valid as a container but wrong for its architecture (a tensor with other dims, a missing
 * tensor, an absurd head count, an unsupported architecture or tensor type; for gemma3 a missing
 * or wrong post norm, a window out of range, a malformed layer pattern, a logit soft-cap) is
 * refused with a message naming the file and what is wrong, and `kvbridge run` exits 1 with it.
 * A generated gemma3 file is read back with every Gemma 3 fact in its description (window, layer
 * pattern from the default or from either form of the key, local RoPE base, scales), its
 * fingerprint covers them, and the gguf Python package reads it too (when the venv exists). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <math.h>

#include "kvb_gguf.h"
#include "kvb_model.h"
#include "kvb_quant.h"
#include "kvbt.h"

static char g_src[512], g_gemma[512], g_moe[512], g_mla[512];

static int setup(void **state) {
    (void)state;
    kvbt_tmp_path(g_src, sizeof g_src, "src.gguf");
    kvbt_tmp_path(g_gemma, sizeof g_gemma, "gemma3.gguf");
    kvb_gen_opts o = {.preset = "tiny", .type = KVB_TYPE_Q8_0, .seed = 2, .n_threads = 1};
    kvb_gen_opts og = {.preset = "tiny-gemma3", .type = KVB_TYPE_Q8_0, .seed = 3, .n_threads = 1};
    kvb_gen_opts om = {.preset = "tiny-moe", .type = KVB_TYPE_Q8_0, .seed = 4, .n_threads = 1};
    kvb_gen_opts ol = {.preset = "tiny-mla", .type = KVB_TYPE_Q8_0, .seed = 5, .n_threads = 1};
    kvbt_tmp_path(g_moe, sizeof g_moe, "moe.gguf");
    kvbt_tmp_path(g_mla, sizeof g_mla, "mla.gguf");
    kvb_err err = {0};
    return kvb_gen_model(&o, g_src, &err) == KVB_OK && kvb_gen_model(&og, g_gemma, &err) == KVB_OK &&
                   kvb_gen_model(&om, g_moe, &err) == KVB_OK && kvb_gen_model(&ol, g_mla, &err) == KVB_OK
               ? 0
               : -1;
}

typedef enum {
    EDIT_SWAP_DIMS,
    EDIT_DROP_TENSOR,
    EDIT_HEADS,
    EDIT_ARCH,
    EDIT_TYPE_Q5,
    EDIT_SET_U32,   /* key `target` := value (replaced, or added when absent) */
    EDIT_ADD_F32,   /* key `target` := (float)value, added */
    EDIT_ADD_BOOLS, /* key `target` := value booleans, alternating true, false */
} edit_kind;

/* Rewrites the model at src with one edit applied to `target` (a tensor or key name). */
static void write_edited(const char *src, const char *out, edit_kind kind, const char *target, uint32_t value) {
    kvb_gguf *g;
    kvb_err err = {0};
    assert_int_equal(kvb_gguf_open(src, &g, &err), KVB_OK);
    kvb_gguf_writer *w;
    assert_int_equal(kvb_gguf_writer_create(&w, &err), KVB_OK);
    bool replaced = false;
    for (uint64_t i = 0; i < kvb_gguf_n_kv(g); i++) {
        const kvb_gguf_kv *kv = kvb_gguf_kv_at(g, i);
        if (kind == EDIT_HEADS && kvb_gguf_str_eq(kv->key, target))
            assert_int_equal(kvb_gguf_writer_add_u32(w, target, 3, &err), KVB_OK); /* 256/3: not a head size */
        else if (kind == EDIT_SET_U32 && kvb_gguf_str_eq(kv->key, target)) {
            assert_int_equal(kvb_gguf_writer_add_u32(w, target, value, &err), KVB_OK);
            replaced = true;
        } else if (kind == EDIT_ARCH && kvb_gguf_str_eq(kv->key, "general.architecture"))
            assert_int_equal(kvb_gguf_writer_add_str(w, "general.architecture", "mamba", &err), KVB_OK);
        else
            assert_int_equal(kvb_gguf_writer_copy_kv(w, kv, &err), KVB_OK);
    }
    if (kind == EDIT_SET_U32 && !replaced) assert_int_equal(kvb_gguf_writer_add_u32(w, target, value, &err), KVB_OK);
    if (kind == EDIT_ADD_F32) assert_int_equal(kvb_gguf_writer_add_f32(w, target, (float)value, &err), KVB_OK);
    if (kind == EDIT_ADD_BOOLS) {
        bool flags[64];
        assert_true(value <= 64);
        for (uint32_t i = 0; i < value; i++) flags[i] = i % 2 == 0;
        assert_int_equal(kvb_gguf_writer_add_arr(w, target, KVB_GGUF_BOOL, flags, value, &err), KVB_OK);
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
        if (hit && kind == EDIT_TYPE_Q5) type = KVB_TYPE_Q5_1; /* a layout we know but do not compute */
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

static void expect_refused_from(const char *src, edit_kind kind, const char *target, uint32_t value,
                                const char *needle) {
    char path[512], cmd[1200], out[4096];
    kvbt_tmp_path(path, sizeof path, "edited.gguf");
    write_edited(src, path, kind, target, value);
    kvb_model *m = NULL;
    kvb_err err = {0};
    assert_int_not_equal(kvb_model_load(path, &m, &err), KVB_OK);
    assert_null(m);
    if (!strstr(err.msg, needle) || !strstr(err.msg, path)) fail_msg("message '%s' lacks '%s' or the path", err.msg, needle);
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' --tokens 1,2 -n 2", kvbt_bin(), path);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 1);
    assert_non_null(strstr(out, needle));
}

static void expect_refused(edit_kind kind, const char *target, const char *needle) {
    expect_refused_from(g_src, kind, target, 0, needle);
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
    assert_false(kvb_type_get(KVB_TYPE_Q5_1)->supported);
    expect_refused(EDIT_TYPE_Q5, "blk.0.attn_q.weight", "Q5_1");
}

/* ---- gemma3 -------------------------------------------------------------------------------- */

static void test_gemma3_refusals(void **state) {
    (void)state;
    expect_refused_from(g_gemma, EDIT_DROP_TENSOR, "blk.2.post_ffw_norm.weight", 0,
                        "'blk.2.post_ffw_norm.weight' is missing");
    expect_refused_from(g_gemma, EDIT_DROP_TENSOR, "blk.0.post_attention_norm.weight", 0,
                        "'blk.0.post_attention_norm.weight' is missing");
    expect_refused_from(g_gemma, EDIT_DROP_TENSOR, "blk.4.attn_k_norm.weight", 0, "'blk.4.attn_k_norm.weight' is missing");
    expect_refused_from(g_gemma, EDIT_SWAP_DIMS, "blk.5.attn_k.weight", 0, "expected [256, 64]");
    expect_refused_from(g_gemma, EDIT_SET_U32, "gemma3.attention.sliding_window", 0,
                        "gemma3.attention.sliding_window = 0 is out of range");
    expect_refused_from(g_gemma, EDIT_SET_U32, "gemma3.attention.sliding_window", 1u << 30, "sliding_window");
    expect_refused_from(g_gemma, EDIT_SET_U32, "gemma3.attention.sliding_window_pattern", 5000,
                        "sliding_window_pattern = 5000 is out of range");
    expect_refused_from(g_gemma, EDIT_ADD_BOOLS, "gemma3.attention.sliding_window_pattern", 5,
                        "has 5 entries for 6 layers");
    expect_refused_from(g_gemma, EDIT_ADD_F32, "gemma3.final_logit_softcapping", 30, "soft-capping");
    expect_refused_from(g_gemma, EDIT_ADD_F32, "gemma3.attn_logit_softcapping", 50, "soft-capping");
}

static kvb_model *load_ok(const char *path) {
    kvb_model *m = NULL;
    kvb_err err = {0};
    if (kvb_model_load(path, &m, &err) != KVB_OK) fail_msg("%s", err.msg);
    return m;
}

/* ---- qwen3moe ------------------------------------------------------------------------------- */

/* tiny-moe's description and bound stacks: row r of expert x of a stack is row x * rows + r of
 * the bound matrix, and the file's bytes are where that says. */
static void test_moe_desc(void **state) {
    (void)state;
    kvb_model *m = load_ok(g_moe);
    const kvb_model_desc *d = &m->d;
    assert_int_equal(d->arch, KVB_ARCH_QWEN3MOE);
    assert_true(d->has_qk_norm && d->rope_neox && d->expert_weights_norm);
    assert_int_equal(d->n_expert, 8);
    assert_int_equal(d->n_expert_used, 2);
    assert_int_equal(d->n_ff_exp, 256);
    for (uint32_t l = 0; l < d->n_layer; l++) {
        const kvb_layer_weights *w = &m->layers[l];
        assert_null(w->w_gate.data);
        assert_int_equal(w->ffn_gate_inp.rows, 8);
        assert_int_equal(w->ffn_gate_inp.cols, 256);
        assert_int_equal(w->ffn_gate_inp.type, KVB_TYPE_F32);
        assert_int_equal(w->gate_exps.rows, 8 * 256);
        assert_int_equal(w->down_exps.rows, 8 * 256);
        assert_int_equal(w->down_exps.cols, 256);
        char name[64];
        snprintf(name, sizeof name, "blk.%u.ffn_up_exps.weight", l);
        const kvb_gguf_tensor *t = kvb_gguf_find_tensor(m->gguf, name);
        assert_non_null(t);
        assert_ptr_equal(w->up_exps.data, t->data);
        assert_int_equal((uint64_t)w->up_exps.rows * w->up_exps.row_bytes, t->n_bytes);
    }
    char desc[512];
    kvb_model_describe(m, desc, sizeof desc);
    assert_non_null(strstr(desc, "8 experts (top 2, renormalised"));
    kvb_model_free(m);
}

/* A qwen3moe file whose expert keys or tensors disagree is refused, naming what. */
static void test_moe_refusals(void **state) {
    (void)state;
    expect_refused_from(g_moe, EDIT_SET_U32, "qwen3moe.expert_used_count", 9,
                        "qwen3moe.expert_used_count = 9 is out of range [1, 8]");
    expect_refused_from(g_moe, EDIT_SET_U32, "qwen3moe.expert_count", 0, "qwen3moe.expert_count = 0 is out of range");
    expect_refused_from(g_moe, EDIT_SET_U32, "qwen3moe.expert_gating_func", 2, "expert_gating_func = 2");
    expect_refused_from(g_moe, EDIT_SET_U32, "qwen3moe.expert_count", 4, "expected [256, 4]");
    expect_refused_from(g_moe, EDIT_SET_U32, "qwen3moe.expert_feed_forward_length", 128, "expected [256, 128, 8]");
    expect_refused_from(g_moe, EDIT_DROP_TENSOR, "blk.2.ffn_down_exps.weight", 0,
                        "'blk.2.ffn_down_exps.weight' is missing");
    expect_refused_from(g_moe, EDIT_SWAP_DIMS, "blk.1.ffn_gate_inp.weight", 0, "expected [256, 8]");
}

/* The Qwen3-30B-A3B and -235B-A22B presets against their published sizes (model cards: 30.5B total,
 * 3.3B activated; 235B total, 22B activated), embeddings included: total = non-embedding (with the
 * untied output head) + the embedding matrix. */
static void test_moe_preset_sizes(void **state) {
    (void)state;
    const struct {
        const char *name;
        double total, active;
    } want[] = {{"qwen3-30b-a3b", 30.5e9, 3.3e9}, {"qwen3-235b-a22b", 235e9, 22e9}};
    for (size_t i = 0; i < 2; i++) {
        const kvb_preset *p = kvb_preset_find(want[i].name);
        assert_non_null(p);
        const double emb = (double)p->d.n_vocab * p->d.n_embd;
        const double total = (double)kvb_model_n_params_nonembd(&p->d) + emb;
        const double active = (double)kvb_model_n_params_active(&p->d) + emb;
        print_message("  %s: %.4g total, %.4g active\n", want[i].name, total, active);
        if (fabs(total / want[i].total - 1) > 0.01 || fabs(active / want[i].active - 1) > 0.03)
            fail_msg("%s: %.4g / %.4g parameters, published %.4g / %.4g", want[i].name, total, active, want[i].total,
                     want[i].active);
    }
}

/* ---- deepseek2 ------------------------------------------------------------------------------ */

/* tiny-mla read back: every deepseek2 key in the description (the MLA form's cache row, the
 * ranks, dense lead, shared experts, sigmoid gating with groups, scale, YaRN and the attention scale
 * it implies), every latent-attention matrix bound with its shape, the stacks' rows per head. */
static void test_mla_desc(void **state) {
    (void)state;
    kvb_model *m = load_ok(g_mla);
    const kvb_model_desc *d = &m->d;
    assert_int_equal(d->arch, KVB_ARCH_DEEPSEEK2);
    assert_true(d->mla && !d->rope_neox && d->expert_weights_norm);
    assert_int_equal(d->n_head_kv, 1);
    assert_int_equal(d->head_dim, 96); /* the cache row: latent 64 + rope 32 */
    assert_int_equal(d->n_lora_q, 128);
    assert_int_equal(d->n_lora_kv, 64);
    assert_int_equal(d->head_dim_k_mla, 64);
    assert_int_equal(d->head_dim_v_mla, 32);
    assert_int_equal(d->n_layer_dense_lead, 1);
    assert_int_equal(d->n_expert_shared, 1);
    assert_int_equal(d->expert_gating, KVB_GATING_SIGMOID);
    assert_int_equal(d->n_expert_groups, 4);
    assert_int_equal(d->n_group_used, 2);
    assert_true(d->expert_weights_scale == 2.5f);
    assert_true(d->rope_yarn_factor == 4.0f && d->rope_orig_ctx == 1024);
    assert_true(fabsf(d->rope_yarn_log_mul - 1.0f) < 1e-6f); /* stored as 0.1, read back / 0.1 */
    const float mscale = 1.0f + 0.1f * d->rope_yarn_log_mul * logf(4.0f);
    assert_true(d->attn_scale == mscale * mscale / sqrtf(64.0f));
    assert_true(kvb_layer_is_dense(d, 0) && !kvb_layer_is_dense(d, 1) && !kvb_layer_is_dense(d, 2));
    for (uint32_t l = 0; l < d->n_layer; l++) {
        const kvb_layer_weights *w = &m->layers[l];
        assert_null(w->wq.data);
        assert_null(w->wk.data);
        assert_int_equal(w->wq_a.rows, 128);
        assert_int_equal(w->wq_b.rows, 4 * 64);
        assert_int_equal(w->wkv_a.rows, 64 + 32);
        assert_int_equal(w->wk_b.rows, 4 * 64); /* (H * R, N) */
        assert_int_equal(w->wk_b.cols, 32);
        assert_int_equal(w->wv_b.rows, 4 * 32); /* (H * Vd, R) */
        assert_int_equal(w->wv_b.cols, 64);
        assert_int_equal(w->wo.cols, 4 * 32);
        assert_non_null(w->kv_a_norm);
        assert_non_null(w->q_a_norm);
        if (l == 0) {
            assert_non_null(w->w_gate.data);
            assert_null(w->gate_exps.data);
            continue;
        }
        assert_null(w->w_gate.data);
        assert_int_equal(w->gate_exps.rows, 8 * 256);
        assert_int_equal(w->gate_shexp.rows, 256);
        assert_int_equal(w->down_shexp.cols, 256);
        assert_non_null(w->exp_probs_b);
    }
    char desc[512];
    kvb_model_describe(m, desc, sizeof desc);
    assert_non_null(strstr(desc, "MLA latent 64 + rope 32, q_lora 128"));
    kvb_model_free(m);
}

/* A deepseek2 file that is not the MLA form, disagrees with its latent shapes, asks for a gating we
 * do not have or a YaRN magnitude factor other than 1 is refused, naming what. */
static void test_mla_refusals(void **state) {
    (void)state;
    expect_refused_from(g_mla, EDIT_SET_U32, "deepseek2.attention.key_length", 192, "MLA form needs head_count_kv 1");
    expect_refused_from(g_mla, EDIT_SET_U32, "deepseek2.expert_gating_func", 3, "expert_gating_func = 3");
    expect_refused_from(g_mla, EDIT_SET_U32, "deepseek2.expert_group_used_count", 4, "inconsistent");
    expect_refused_from(g_mla, EDIT_SET_U32, "deepseek2.attention.kv_lora_rank", 32, "MLA form needs");
    expect_refused_from(g_mla, EDIT_DROP_TENSOR, "blk.1.attn_k_b.weight", 0, "'blk.1.attn_k_b.weight' is missing");
    expect_refused_from(g_mla, EDIT_DROP_TENSOR, "blk.2.ffn_up_shexp.weight", 0, "ffn_up_shexp.weight' is missing");
    expect_refused_from(g_mla, EDIT_SWAP_DIMS, "blk.0.attn_kv_a_mqa.weight", 0, "expected [256, 96]");
    expect_refused_from(g_mla, EDIT_ADD_F32, "deepseek2.rope.scaling.attn_factor", 2, "only 1 is implemented");
}

/* The DeepSeek presets against their published sizes (model cards: V2-Lite 15.7B total, 2.4B
 * activated; V3 671B total, 37B activated): totals with the embedding matrix, activated without it
 * (DeepSeek counts the output head, not the embedding lookup: 2.45B for V2-Lite); and a layer subset of V3 as
 * gen-model --layers writes it: its first layers (3 dense, then MoE), every other key the model's. */
static void test_mla_preset_sizes(void **state) {
    (void)state;
    const struct {
        const char *name;
        double total, active;
    } want[] = {{"deepseek-v2-lite", 15.7e9, 2.4e9}, {"deepseek-v3", 671e9, 37e9}};
    for (size_t i = 0; i < 2; i++) {
        const kvb_preset *p = kvb_preset_find(want[i].name);
        assert_non_null(p);
        const double emb = (double)p->d.n_vocab * p->d.n_embd;
        const double total = (double)kvb_model_n_params_nonembd(&p->d) + emb;
        const double active = (double)kvb_model_n_params_active(&p->d);
        print_message("  %s: %.4g total, %.4g active\n", want[i].name, total, active);
        if (fabs(total / want[i].total - 1) > 0.02 || fabs(active / want[i].active - 1) > 0.05)
            fail_msg("%s: %.4g / %.4g parameters, published %.4g / %.4g", want[i].name, total, active, want[i].total,
                     want[i].active);
    }
    char path[512];
    kvbt_tmp_path(path, sizeof path, "v2lite-1.gguf");
    kvb_gen_opts o = {.preset = "deepseek-v2-lite", .type = KVB_TYPE_Q8_0, .seed = 1, .n_layers = 1, .n_threads = 2};
    kvb_err err = {0};
    kvb_gen_opts big = o;
    big.n_layers = 28;
    assert_int_not_equal(kvb_gen_model(&big, path, &err), KVB_OK);
    assert_non_null(strstr(err.msg, "--layers 28"));
    assert_int_equal(kvb_gen_model(&o, path, &err), KVB_OK);
    kvb_model *m = load_ok(path);
    assert_int_equal(m->d.n_layer, 1);
    assert_int_equal(m->d.n_lora_q, 0); /* V2-Lite: q projected directly, attn_q bound */
    assert_int_equal(m->layers[0].wq.rows, 16 * 192);
    assert_int_equal(m->d.head_dim, 576);
    assert_true(m->d.rope_yarn_factor == 40.0f && fabsf(m->d.rope_yarn_log_mul - 0.707f) < 1e-5f);
    kvb_model_free(m);
    remove(path);
}

static void test_gemma3_desc(void **state) {
    (void)state;
    kvb_model *m = load_ok(g_gemma);
    const kvb_model_desc *d = &m->d;
    assert_int_equal(d->arch, KVB_ARCH_GEMMA3);
    assert_int_equal(d->swa_window, 16);
    assert_int_equal(d->swa_pattern, 6);
    assert_false(d->swa_layers_explicit);
    assert_true(d->rope_neox && d->has_qk_norm && d->has_post_norms && d->mlp_gelu && d->tied_output);
    assert_false(d->has_qkv_bias);
    assert_true(d->embd_scale == 16.0f);   /* sqrtf(256) */
    assert_true(d->attn_scale == 0.125f);  /* 1/sqrt(head_dim 64) */
    assert_true(d->rope_freq_base == 1e6f && d->rope_freq_base_local == 1e4f);
    for (uint32_t l = 0; l < 6; l++) assert_int_equal(kvb_layer_is_local(d, l), l != 5);
    assert_false(kvb_layer_is_local(d, 6));
    assert_true(kvb_model_has_local_layers(d));
    for (uint32_t l = 0; l < 6; l++) {
        assert_non_null(m->layers[l].post_attn_norm);
        assert_non_null(m->layers[l].post_ffw_norm);
        assert_non_null(m->layers[l].q_norm);
    }
    double g[32], loc[32], lay[32];
    kvb_rope_inv_freq(m, g);
    kvb_rope_inv_freq_layer(m, 0, loc);
    kvb_rope_inv_freq_layer(m, 5, lay);
    for (int i = 0; i < 32; i++) {
        assert_true(lay[i] == g[i]);
        assert_true(fabs(g[i] - pow(1e6, -2.0 * i / 64)) <= 1e-15 * g[i]);
        assert_true(fabs(loc[i] - pow(1e4, -2.0 * i / 64)) <= 1e-15 * loc[i]);
    }
    /* the per-kind tables hand each layer its own */
    kvb_rope_tables t;
    kvb_err err = {0};
    assert_int_equal(kvb_rope_tables_init(&t, m, 4, &err), KVB_OK);
    assert_int_equal(t.n_kinds, 2);
    kvb_rope_tables_fill(&t, 100, 4);
    float cs[4 * 32], sn[4 * 32];
    for (uint32_t l = 0; l < 6; l++) {
        const float *c, *s;
        kvb_rope_tables_layer(&t, l, &c, &s);
        kvb_rope_table(l == 5 ? g : loc, 64, 100, 4, cs, sn);
        assert_memory_equal(c, cs, sizeof cs);
        assert_memory_equal(s, sn, sizeof sn);
    }
    kvb_rope_tables_free(&t);
    char desc[256];
    kvb_model_describe(m, desc, sizeof desc);
    assert_non_null(strstr(desc, "5 local: window 16"));

    /* the fingerprint covers the window and the pattern */
    char path[512];
    kvbt_tmp_path(path, sizeof path, "g-window.gguf");
    write_edited(g_gemma, path, EDIT_SET_U32, "gemma3.attention.sliding_window", 17);
    kvb_model *m2 = load_ok(path);
    assert_int_equal(m2->d.swa_window, 17);
    assert_true(m2->fingerprint != m->fingerprint);
    kvb_model_free(m2);
    /* the pattern as a period: 2 = layers 0, 2, 4 local */
    write_edited(g_gemma, path, EDIT_SET_U32, "gemma3.attention.sliding_window_pattern", 2);
    m2 = load_ok(path);
    for (uint32_t l = 0; l < 6; l++) assert_int_equal(kvb_layer_is_local(&m2->d, l), l % 2 == 0);
    assert_true(m2->fingerprint != m->fingerprint);
    kvb_model_free(m2);
    /* period 1: every layer global, a single RoPE table */
    write_edited(g_gemma, path, EDIT_SET_U32, "gemma3.attention.sliding_window_pattern", 1);
    m2 = load_ok(path);
    assert_false(kvb_model_has_local_layers(&m2->d));
    assert_int_equal(kvb_rope_tables_init(&t, m2, 4, &err), KVB_OK);
    assert_int_equal(t.n_kinds, 1);
    kvb_rope_tables_free(&t);
    kvb_model_free(m2);
    /* booleans, one per layer (true = local): layers 0, 2, 4 */
    write_edited(g_gemma, path, EDIT_ADD_BOOLS, "gemma3.attention.sliding_window_pattern", 6);
    m2 = load_ok(path);
    assert_true(m2->d.swa_layers_explicit);
    for (uint32_t l = 0; l < 6; l++) assert_int_equal(kvb_layer_is_local(&m2->d, l), l % 2 == 0);
    kvb_model_free(m2);
    kvb_model_free(m);
}

/* The gguf Python package (llama.cpp's gguf-py) reads the generated gemma3 file: its keys and
 * tensor names are the ones llama.cpp's converter writes. */
static void test_gemma3_gguf_py(void **state) {
    (void)state;
    const char *srcdir = getenv("KVB_SOURCE_DIR");
    char py[1024], cmd[4096], out[4096];
    snprintf(py, sizeof py, "%s/.venv/bin/python", srcdir ? srcdir : ".");
    FILE *f = fopen(py, "r");
    if (!f) {
        print_message("gguf-py check skipped: no venv python at %s\n", py);
        skip();
    }
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "'%s' -c \"import gguf,sys; r=gguf.GGUFReader(sys.argv[1]); f=r.fields; "
             "print(f['general.architecture'].contents(), f['gemma3.attention.sliding_window'].contents(), "
             "len(r.tensors), sorted(t.name for t in r.tensors if t.name.startswith('blk.0.')))\" '%s'",
             py, g_gemma);
    int rc = kvbt_sh(cmd, out, sizeof out, 1);
    if (rc != 0) fail_msg("gguf-py could not read %s: %s", g_gemma, out);
    print_message("gguf-py: %s", out);
    assert_non_null(strstr(out, "gemma3 16 80 "));
    const char *names[] = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
                           "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char want[96];
        snprintf(want, sizeof want, "'blk.0.%s.weight'", names[i]);
        if (!strstr(out, want)) fail_msg("gguf-py does not list %s", want);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wrong_dims),      cmocka_unit_test(test_missing_tensor),
        cmocka_unit_test(test_bad_head_count),  cmocka_unit_test(test_unsupported_arch),
        cmocka_unit_test(test_unsupported_type), cmocka_unit_test(test_gemma3_refusals),
        cmocka_unit_test(test_gemma3_desc),      cmocka_unit_test(test_gemma3_gguf_py),
        cmocka_unit_test(test_moe_desc),         cmocka_unit_test(test_moe_refusals),
        cmocka_unit_test(test_moe_preset_sizes), cmocka_unit_test(test_mla_desc),
        cmocka_unit_test(test_mla_refusals),     cmocka_unit_test(test_mla_preset_sizes),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
