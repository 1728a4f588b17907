/* model/gen_model.c — `kvbridge gen-model`: writes a real GGUF (llama.cpp's tensor names, keys
 * and block layouts) with a preset's shapes and seeded random weights. Weights are drawn per
 * (tensor, row chunk) from seeds derived from the user's seed, so the file is identical for any
 * thread count. Scales keep the residual stream near unit RMS through every layer (output
 * projections shrink with depth) and make logits spread (std ~3), not flat. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_model.h"
#include "kvb_quant.h"
#include "kvb_tokenizer.h"

#define GEN_CHUNK_ROWS 64

typedef enum { INIT_NORMAL, INIT_ONE_PLUS, INIT_BIAS } init_kind;

typedef struct {
    char name[64];
    uint32_t n_dims;
    uint64_t ne[3];     /* ne[2]: a stack of matrices (experts), else 1 */
    uint32_t type;
    init_kind init;
    float std;
    const float *fixed; /* exact values (rope_freqs), or NULL */
} gen_tensor;

typedef struct {
    const gen_tensor *t;
    uint64_t seed;
    uint8_t *out;       /* (rows, row_bytes) */
    size_t row_bytes;
    float **scratch;    /* per worker: (GEN_CHUNK_ROWS? no: one row) (ne0) */
} gen_job;

/* Approximately normal with unit variance: sum of four 16-bit uniforms (Irwin-Hall), cheap and
 * deterministic; real weights are not Gaussian either. */
static inline float approx_normal(kvb_rng *r) {
    uint64_t u = kvb_rng_u64(r);
    float s = (float)(u & 0xffff) + (float)((u >> 16) & 0xffff) + (float)((u >> 32) & 0xffff) + (float)(u >> 48);
    return (s * (1.0f / 65536.0f) - 2.0f) * 1.7320508f;
}

static void gen_chunk(void *ctx, int task, int worker) {
    gen_job *j = ctx;
    const gen_tensor *t = j->t;
    const uint64_t cols = t->ne[0], rows = t->n_dims > 1 ? t->ne[1] * t->ne[2] : 1;
    uint64_t r0 = (uint64_t)task * GEN_CHUNK_ROWS, r1 = r0 + GEN_CHUNK_ROWS < rows ? r0 + GEN_CHUNK_ROWS : rows;
    kvb_rng rng;
    kvb_rng_seed(&rng, kvb_splitmix64(j->seed ^ ((uint64_t)task * 0x9e3779b97f4a7c15ULL)));
    float *row = j->scratch[worker];
    for (uint64_t r = r0; r < r1; r++) {
        for (uint64_t c = 0; c < cols; c++) {
            float z = approx_normal(&rng);
            switch (t->init) {
            case INIT_NORMAL: row[c] = z * t->std; break;
            case INIT_ONE_PLUS: row[c] = 1.0f + z * t->std; break;
            case INIT_BIAS: row[c] = z * t->std; break;
            }
        }
        if (t->fixed) memcpy(row, t->fixed + r * cols, cols * sizeof(float));
        kvb_f32_to_row(t->type, row, j->out + r * j->row_bytes, (int64_t)cols);
    }
}

static int add_t(gen_tensor *ts, int n, const char *name, uint64_t ne0, uint64_t ne1, uint32_t type, init_kind k,
                 float std) {
    gen_tensor *t = &ts[n];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = ne1 > 1 ? 2 : 1;
    t->ne[0] = ne0;
    t->ne[1] = ne1;
    t->ne[2] = 1;
    t->type = type;
    t->init = k;
    t->std = std;
    return n + 1;
}

/* type, or f16 where a row of cols elements is not whole blocks of it (K-quants on the latent
 * attention's 32- or 128-wide rows; llama.cpp's quantizer falls back likewise) */
static uint32_t fit_type(uint32_t type, uint64_t cols) {
    return kvb_row_bytes(type, (int64_t)cols) ? type : KVB_TYPE_F16;
}

/* Layer l's shared expert (n_ff_shexp > 0: qwen2moe, deepseek2), llama.cpp's names and ggml's shapes:
 * qwen2moe's sigmoid gate ffn_gate_inp_shexp [n_embd] in f32 (a vector: llama.cpp quantises no 1-D
 * tensor), logits of std ~2 (gates spread over (0, 1)); ffn_gate_shexp, ffn_up_shexp [n_embd, S],
 * ffn_down_shexp [S, n_embd], scaled like a dense MLP of S = n_ff_shexp. */
static int add_shexp_tensors(gen_tensor *ts, int n, uint32_t l, const kvb_model_desc *d, uint32_t type,
                             float s_res) {
    if (!d->n_ff_shexp) return n;
    const uint64_t E = d->n_embd, S = d->n_ff_shexp;
    const float s_in = 1.0f / sqrtf((float)E);
    char nm[64];
    if (d->arch == KVB_ARCH_QWEN2MOE) {
        snprintf(nm, sizeof nm, "blk.%u.ffn_gate_inp_shexp.weight", l);
        n = add_t(ts, n, nm, E, 1, KVB_TYPE_F32, INIT_NORMAL, 2.0f * s_in);
    }
    const char *shexp[3] = {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"};
    for (int i = 0; i < 3; i++) {
        snprintf(nm, sizeof nm, "blk.%u.%s.weight", l, shexp[i]);
        n = add_t(ts, n, nm, i < 2 ? E : S, i < 2 ? S : E, fit_type(type, i < 2 ? E : S), INIT_NORMAL,
                  i < 2 ? s_in : 2.0f * s_res / sqrtf((float)S));
    }
    return n;
}

/* Layer l's mixture of experts with llama.cpp's names and ggml's shapes: the router
 * ffn_gate_inp [n_embd, n_expert] in f32 (llama.cpp keeps it f32 in every quantisation), and the
 * expert stacks ffn_gate_exps, ffn_up_exps [n_embd, n_ff_exp, n_expert] and ffn_down_exps
 * [n_ff_exp, n_embd, n_expert] in the file's type. Router logits of std ~4 route decisively
 * (a trained router is peaked; a flat one would leave many tokens near a tie between experts);
 * each expert is scaled like a dense MLP of n_ff_exp (the top-k weights sum to 1). */
static int add_moe_tensors(gen_tensor *ts, int n, uint32_t l, const kvb_model_desc *d, uint32_t type, float s_res) {
    const uint64_t E = d->n_embd, F = d->n_ff_exp;
    const float s_in = 1.0f / sqrtf((float)E), s_ff = 1.0f / sqrtf((float)F);
    const char *names[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    char nm[64];
    snprintf(nm, sizeof nm, "blk.%u.ffn_gate_inp.weight", l);
    /* sigmoid gating (deepseek2) saturates on logits of std 4: experts near probability 1 would tie */
    const float s_router = d->expert_gating == KVB_GATING_SIGMOID ? s_in : 4.0f * s_in;
    n = add_t(ts, n, nm, E, d->n_expert, KVB_TYPE_F32, INIT_NORMAL, s_router);
    for (int i = 0; i < 3; i++) {
        snprintf(nm, sizeof nm, "blk.%u.%s.weight", l, names[i]);
        n = add_t(ts, n, nm, i < 2 ? E : F, i < 2 ? F : E, type, INIT_NORMAL, i < 2 ? s_in : 2.0f * s_res * s_ff);
        ts[n - 1].n_dims = 3;
        ts[n - 1].ne[2] = d->n_expert;
    }
    if (d->expert_gating == KVB_GATING_SIGMOID) { /* V3's selection bias */
        snprintf(nm, sizeof nm, "blk.%u.exp_probs_b.bias", l);
        n = add_t(ts, n, nm, d->n_expert, 1, KVB_TYPE_F32, INIT_BIAS, 0.05f);
    }
    return add_shexp_tensors(ts, n, l, d, type, s_res);
}

/* llama.cpp's general.file_type (LLAMA_FTYPE_MOSTLY_*) for a file whose matrices are all of type t */
static uint32_t llama_file_type(uint32_t t) {
    switch (t) {
    case KVB_TYPE_F32: return 0;
    case KVB_TYPE_F16: return 1;
    case KVB_TYPE_Q4_0: return 2;
    case KVB_TYPE_Q8_0: return 7;
    case KVB_TYPE_Q5_0: return 8;
    case KVB_TYPE_Q4_K: return 14; /* Q4_K_S */
    case KVB_TYPE_Q5_K: return 16; /* Q5_K_S */
    case KVB_TYPE_Q6_K: return 18;
    case KVB_TYPE_BF16: return 32;
    }
    return 0;
}

/* deepseek2's keys as llama.cpp's converter writes them (gguf-py's Keys.Attention.*_LORA_RANK,
 * *_LENGTH_MLA, Keys.LLM.LEADING_DENSE_BLOCK_COUNT, EXPERT_SHARED_COUNT, EXPERT_WEIGHTS_*,
 * EXPERT_GATING_FUNC, EXPERT_GROUP_*, Keys.Rope.SCALING_*): q_lora_rank only when there is one, or
 * when llama.cpp would not take the layer count for a "lite" model (27 or 26 layers) and so reads it;
 * the YaRN log multiplier stored as 0.1 * mscale_all_dim, as the converter stores it. */
static kvb_status write_mla_keys(kvb_gguf_writer *w, const kvb_model_desc *d, kvb_err *err) {
    char key[128];
    const char *a = d->arch_name;
    kvb_status st = KVB_OK;
#define KEY(sfx) (snprintf(key, sizeof key, "%s.%s", a, sfx), key)
    const bool lite = d->n_layer == 27 || d->n_layer == 26;
    if ((d->n_lora_q || !lite) && (st = kvb_gguf_writer_add_u32(w, KEY("attention.q_lora_rank"), d->n_lora_q, err)))
        return st;
    if ((st = kvb_gguf_writer_add_u32(w, KEY("attention.kv_lora_rank"), d->n_lora_kv, err)) ||
        (st = kvb_gguf_writer_add_u32(w, KEY("attention.key_length_mla"), d->head_dim_k_mla, err)) ||
        (st = kvb_gguf_writer_add_u32(w, KEY("attention.value_length_mla"), d->head_dim_v_mla, err)) ||
        (st = kvb_gguf_writer_add_u32(w, KEY("leading_dense_block_count"), d->n_layer_dense_lead, err)) ||
        (st = kvb_gguf_writer_add_u32(w, KEY("expert_shared_count"), d->n_expert_shared, err)) ||
        (st = kvb_gguf_writer_add_f32(w, KEY("expert_weights_scale"), d->expert_weights_scale, err)) ||
        (st = kvb_gguf_writer_add_bool(w, KEY("expert_weights_norm"), d->expert_weights_norm, err)) ||
        (st = kvb_gguf_writer_add_u32(w, KEY("expert_gating_func"), d->expert_gating, err)))
        return st;
    if (d->n_expert_groups > 1 &&
        ((st = kvb_gguf_writer_add_u32(w, KEY("expert_group_count"), d->n_expert_groups, err)) ||
         (st = kvb_gguf_writer_add_u32(w, KEY("expert_group_used_count"), d->n_group_used, err))))
        return st;
    if (d->rope_yarn_factor > 1.0f &&
        ((st = kvb_gguf_writer_add_str(w, KEY("rope.scaling.type"), "yarn", err)) ||
         (st = kvb_gguf_writer_add_f32(w, KEY("rope.scaling.factor"), d->rope_yarn_factor, err)) ||
         (st = kvb_gguf_writer_add_u32(w, KEY("rope.scaling.original_context_length"), d->rope_orig_ctx, err)) ||
         (st = kvb_gguf_writer_add_f32(w, KEY("rope.scaling.yarn_log_multiplier"), 0.1f * d->rope_yarn_log_mul, err))))
        return st;
#undef KEY
    return st;
}

static kvb_status write_keys(kvb_gguf_writer *w, const kvb_model_desc *d, const char *preset, uint32_t type,
                             kvb_err *err) {
    char key[128], name[128];
    const char *a = d->arch_name;
    snprintf(name, sizeof name, "kvbridge-%s-%s", preset, kvb_type_name(type));
    kvb_status st;
#define KEY(sfx) (snprintf(key, sizeof key, "%s.%s", a, sfx), key)
    if ((st = kvb_gguf_writer_add_str(w, "general.architecture", a, err))) return st;
    if ((st = kvb_gguf_writer_add_str(w, "general.name", name, err))) return st;
    if ((st = kvb_gguf_writer_add_u32(w, "general.file_type", llama_file_type(type), err))) return st;
    if ((st = kvb_gguf_writer_add_u32(w, "general.quantization_version", 2, err))) return st;
    if ((st = kvb_gguf_writer_add_u32(w, KEY("context_length"), d->n_ctx_train, err))) return st;
    if ((st = kvb_gguf_writer_add_u32(w, KEY("embedding_length"), d->n_embd, err))) return st;
    if ((st = kvb_gguf_writer_add_u32(w, KEY("block_count"), d->n_layer, err))) return st;
    if ((st = kvb_gguf_writer_add_u32(w, KEY("feed_forward_length"), d->n_ff, err))) return st;
    if ((st = kvb_gguf_writer_add_u32(w, KEY("attention.head_count"), d->n_head, err))) return st;
    if ((st = kvb_gguf_writer_add_u32(w, KEY("attention.head_count_kv"), d->n_head_kv, err))) return st;
    if ((st = kvb_gguf_writer_add_u32(w, KEY("attention.key_length"), d->head_dim, err))) return st;
    if ((st = kvb_gguf_writer_add_u32(w, KEY("attention.value_length"), d->mla ? d->n_lora_kv : d->head_dim, err)))
        return st;
    if ((st = kvb_gguf_writer_add_u32(w, KEY("rope.dimension_count"), d->n_rot, err))) return st;
    if ((st = kvb_gguf_writer_add_f32(w, KEY("rope.freq_base"), d->rope_freq_base, err))) return st;
    if ((st = kvb_gguf_writer_add_f32(w, KEY("attention.layer_norm_rms_epsilon"), d->norm_eps, err))) return st;
    if (d->arch == KVB_ARCH_GEMMA3) {
        /* as llama.cpp's converter writes Gemma 3: the window, no pattern key (the loader's default is
         * Gemma 3's 6) and no local rope base key (10000 is Gemma 3's fixed rope_local_base_freq) */
        if ((st = kvb_gguf_writer_add_u32(w, KEY("attention.sliding_window"), d->swa_window, err))) return st;
        if (d->swa_pattern != 6 &&
            (st = kvb_gguf_writer_add_u32(w, KEY("attention.sliding_window_pattern"), d->swa_pattern, err)))
            return st;
    }
    if (d->mla && (st = write_mla_keys(w, d, err))) return st;
    if (d->n_expert) { /* as llama.cpp's converter writes qwen3moe (no expert_weights_norm key: renormalised) */
        if ((st = kvb_gguf_writer_add_u32(w, KEY("expert_count"), d->n_expert, err))) return st;
        if ((st = kvb_gguf_writer_add_u32(w, KEY("expert_used_count"), d->n_expert_used, err))) return st;
        if ((st = kvb_gguf_writer_add_u32(w, KEY("expert_feed_forward_length"), d->n_ff_exp, err))) return st;
        /* qwen2moe, as llama.cpp's converter writes it; deepseek2 has no such key (n_ff_exp * expert_shared_count) */
        if (d->arch == KVB_ARCH_QWEN2MOE &&
            (st = kvb_gguf_writer_add_u32(w, KEY("expert_shared_feed_forward_length"), d->n_ff_shexp, err)))
            return st;
    }
#undef KEY
    return KVB_OK;
}

/* The preset o names, and o's weight type checked; *out = NULL on failure. */
static kvb_status gen_preset(const kvb_gen_opts *o, const kvb_preset **out, kvb_err *err) {
    const kvb_preset *p = o->preset ? kvb_preset_find(o->preset) : NULL;
    *out = NULL;
    if (!p) {
        char names[512] = "";
        for (size_t i = 0; i < kvb_preset_count(); i++) {
            strncat(names, kvb_preset_at(i)->name, sizeof names - strlen(names) - 1);
            if (i + 1 < kvb_preset_count()) strncat(names, ", ", sizeof names - strlen(names) - 1);
        }
        return kvb_err_set(err, KVB_ERR_INVALID, "unknown preset '%s' (presets: %s)", o->preset ? o->preset : "",
                           names);
    }
    const kvb_type_info *ti = kvb_type_get(o->type);
    if (!ti || !ti->supported)
        return kvb_err_set(err, KVB_ERR_INVALID, "weight type %s is not one gen-model writes (f32, f16, bf16, q8_0, q4_0, "
                           "q5_0, q4_k, q5_k, q6_k)", kvb_type_name(o->type));
    *out = p;
    return KVB_OK;
}

/* Writes the vocabulary keys (byte-level, or from --vocab's tokenizer.json or GGUF, padded to the
 * preset's size) and sets d->n_vocab to the vocabulary's real size. */
static kvb_status gen_vocab(kvb_gguf_writer *w, const char *vocab_path, kvb_model_desc *d, kvb_err *err) {
    uint32_t n_vocab = 0;
    kvb_status st;
    if (!vocab_path) st = kvb_vocab_write_bytelevel(w, d->n_vocab, &n_vocab, err);
    else {
        size_t L = strlen(vocab_path);
        if (L >= 5 && strcmp(vocab_path + L - 5, ".json") == 0)
            st = kvb_vocab_from_hf_json(w, vocab_path, d->n_vocab, &n_vocab, err);
        else st = kvb_vocab_copy_from_gguf(w, vocab_path, d->n_vocab, &n_vocab, err);
    }
    if (st) return st;
    d->n_vocab = n_vocab;
    return KVB_OK;
}

/* Layer l's latent attention (deepseek2), llama.cpp's names and ggml's shapes (see model/load.c's
 * bind_mla); each projection scaled by 1/sqrt(its input), the normed latent and q_a feeding k_b, v_b, q_b. */
static int gen_mla_tensors(gen_tensor *ts, int n, const kvb_model_desc *d, uint32_t l, uint32_t type, float s_res) {
    const uint64_t E = d->n_embd, H = d->n_head, K = d->head_dim_k_mla, R = d->n_lora_kv, P = d->n_rot;
    const uint64_t N = K - P, Vd = d->head_dim_v_mla, QL = d->n_lora_q;
    const float s_in = 1.0f / sqrtf((float)E), s_r = 1.0f / sqrtf((float)R);
    char nm[64];
#define NM(s) (snprintf(nm, sizeof nm, "blk.%u.%s", l, s), nm)
    if (QL) {
        n = add_t(ts, n, NM("attn_q_a.weight"), E, QL, fit_type(type, E), INIT_NORMAL, s_in);
        n = add_t(ts, n, NM("attn_q_a_norm.weight"), QL, 1, KVB_TYPE_F32, INIT_ONE_PLUS, 0.05f);
        n = add_t(ts, n, NM("attn_q_b.weight"), QL, H * K, fit_type(type, QL), INIT_NORMAL, 1.0f / sqrtf((float)QL));
    } else {
        n = add_t(ts, n, NM("attn_q.weight"), E, H * K, fit_type(type, E), INIT_NORMAL, s_in);
    }
    n = add_t(ts, n, NM("attn_kv_a_mqa.weight"), E, R + P, fit_type(type, E), INIT_NORMAL, s_in);
    n = add_t(ts, n, NM("attn_kv_a_norm.weight"), R, 1, KVB_TYPE_F32, INIT_ONE_PLUS, 0.05f);
    n = add_t(ts, n, NM("attn_k_b.weight"), N, R, fit_type(type, N), INIT_NORMAL, s_r);
    ts[n - 1].n_dims = 3;
    ts[n - 1].ne[2] = H;
    n = add_t(ts, n, NM("attn_v_b.weight"), R, Vd, fit_type(type, R), INIT_NORMAL, s_r);
    ts[n - 1].n_dims = 3;
    ts[n - 1].ne[2] = H;
    n = add_t(ts, n, NM("attn_output.weight"), H * Vd, E, fit_type(type, H * Vd), INIT_NORMAL,
              s_res / sqrtf((float)(H * Vd)));
#undef NM
    return n;
}

/* Adds layer l's tensors to ts from index n; returns the new count. */
static int gen_layer_tensors(gen_tensor *ts, int n, const kvb_model_desc *d, uint32_t l, uint32_t type) {
    const uint64_t E = d->n_embd, Q = (uint64_t)d->n_head * d->head_dim, KV = (uint64_t)d->n_head_kv * d->head_dim;
    const float s_in = 1.0f / sqrtf((float)E), s_ff = 1.0f / sqrtf((float)d->n_ff);
    const float s_res = 1.0f / sqrtf(2.0f * (float)d->n_layer); /* residual branches shrink with depth */
    char nm[64];
#define NM(s) (snprintf(nm, sizeof nm, "blk.%u.%s", l, s), nm)
    n = add_t(ts, n, NM("attn_norm.weight"), E, 1, KVB_TYPE_F32, INIT_ONE_PLUS, 0.05f);
    if (d->mla) {
        n = gen_mla_tensors(ts, n, d, l, type, s_res);
        n = add_t(ts, n, NM("ffn_norm.weight"), E, 1, KVB_TYPE_F32, INIT_ONE_PLUS, 0.05f);
        if (!kvb_layer_is_dense(d, l))
            return add_moe_tensors(ts, n, l, d, type, s_res);
        n = add_t(ts, n, NM("ffn_gate.weight"), E, d->n_ff, type, INIT_NORMAL, s_in);
        n = add_t(ts, n, NM("ffn_up.weight"), E, d->n_ff, type, INIT_NORMAL, s_in);
        return add_t(ts, n, NM("ffn_down.weight"), d->n_ff, E, fit_type(type, d->n_ff), INIT_NORMAL,
                     2.0f * s_res * s_ff);
    }
    n = add_t(ts, n, NM("attn_q.weight"), E, Q, type, INIT_NORMAL, s_in);
    n = add_t(ts, n, NM("attn_k.weight"), E, KV, type, INIT_NORMAL, s_in);
    n = add_t(ts, n, NM("attn_v.weight"), E, KV, type, INIT_NORMAL, s_in);
    if (d->has_qkv_bias) {
        n = add_t(ts, n, NM("attn_q.bias"), Q, 1, KVB_TYPE_F32, INIT_BIAS, 0.1f);
        n = add_t(ts, n, NM("attn_k.bias"), KV, 1, KVB_TYPE_F32, INIT_BIAS, 0.1f);
        n = add_t(ts, n, NM("attn_v.bias"), KV, 1, KVB_TYPE_F32, INIT_BIAS, 0.1f);
    }
    if (d->has_qk_norm) {
        n = add_t(ts, n, NM("attn_q_norm.weight"), d->head_dim, 1, KVB_TYPE_F32, INIT_ONE_PLUS, 0.05f);
        n = add_t(ts, n, NM("attn_k_norm.weight"), d->head_dim, 1, KVB_TYPE_F32, INIT_ONE_PLUS, 0.05f);
    }
    n = add_t(ts, n, NM("attn_output.weight"), Q, E, type, INIT_NORMAL, s_res / sqrtf((float)Q));
    /* gemma3's post norms (stored with Gemma's +1 included, like llama.cpp's converter stores them):
     * each residual branch adds RMS ~1 whatever the projection scales */
    if (d->has_post_norms)
        n = add_t(ts, n, NM("post_attention_norm.weight"), E, 1, KVB_TYPE_F32, INIT_ONE_PLUS, 0.05f);
    n = add_t(ts, n, NM("ffn_norm.weight"), E, 1, KVB_TYPE_F32, INIT_ONE_PLUS, 0.05f);
    if (d->n_expert) return add_moe_tensors(ts, n, l, d, type, s_res); /* the router and the stacked experts */
    n = add_t(ts, n, NM("ffn_gate.weight"), E, d->n_ff, type, INIT_NORMAL, s_in);
    n = add_t(ts, n, NM("ffn_up.weight"), E, d->n_ff, type, INIT_NORMAL, s_in);
    n = add_t(ts, n, NM("ffn_down.weight"), d->n_ff, E, type, INIT_NORMAL, 2.0f * s_res * s_ff);
    if (d->has_post_norms)
        n = add_t(ts, n, NM("post_ffw_norm.weight"), E, 1, KVB_TYPE_F32, INIT_ONE_PLUS, 0.05f);
#undef NM
    return n;
}

/* The file's tensors in order, with their initialisations: *ts (calloc'd) and *n; *rope_factors
 * (malloc'd, or NULL) holds Llama 3's exact rope_freqs values that one of them points to. */
static kvb_status gen_tensor_list(const kvb_model_desc *d, uint32_t type, gen_tensor **ts, int *n,
                                  float **rope_factors, kvb_err *err) {
    const uint64_t E = d->n_embd;
    const float s_in = 1.0f / sqrtf((float)E);
    *ts = calloc(8 + (size_t)d->n_layer * 24, sizeof **ts);
    if (!*ts) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
    gen_tensor *t = *ts;
    int k = 0;
    /* gemma3 multiplies embeddings by sqrt(n_embd): rows of std 3/sqrt(E) enter the residual stream at
     * RMS ~3 and, as the tied output head, give logits of std ~3 */
    const float s_embd = d->arch == KVB_ARCH_GEMMA3 ? 3.0f * s_in : 1.0f;
    k = add_t(t, k, "token_embd.weight", E, d->n_vocab, type, INIT_NORMAL, s_embd);
    if (d->rope_scale_factor > 0) {
        *rope_factors = malloc(sizeof(float) * (d->n_rot / 2));
        if (!*rope_factors) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        kvb_llama3_rope_factors(d, *rope_factors);
        k = add_t(t, k, "rope_freqs.weight", d->n_rot / 2, 1, KVB_TYPE_F32, INIT_NORMAL, 0);
        t[k - 1].fixed = *rope_factors;
    }
    k = add_t(t, k, "output_norm.weight", E, 1, KVB_TYPE_F32, INIT_ONE_PLUS, 0.05f);
    if (!d->tied_output) k = add_t(t, k, "output.weight", E, d->n_vocab, type, INIT_NORMAL, 3.0f * s_in);
    for (uint32_t l = 0; l < d->n_layer; l++) k = gen_layer_tensors(t, k, d, l, type);
    *n = k;
    return KVB_OK;
}

/* Declares the n tensors to the writer, each row a whole number of its type's blocks. */
static kvb_status gen_declare(kvb_gguf_writer *w, const char *preset, const gen_tensor *ts, int n, kvb_err *err) {
    for (int i = 0; i < n; i++) {
        if (kvb_row_bytes(ts[i].type, (int64_t)ts[i].ne[0]) == 0)
            return kvb_err_set(err, KVB_ERR_INVALID, "preset %s: %s has rows of %llu elements, not whole %s blocks of %d",
                               preset, ts[i].name, (unsigned long long)ts[i].ne[0], kvb_type_name(ts[i].type),
                               kvb_type_get(ts[i].type)->block_elems);
        kvb_status st = kvb_gguf_writer_add_tensor(w, ts[i].name, ts[i].n_dims, ts[i].ne, ts[i].type, err);
        if (st) return st;
    }
    return KVB_OK;
}

/* Generates the tensors' data on a pool of workers, tensor by tensor in order, and writes it to f
 * (after the header), reporting progress when o->progress. */
static kvb_status gen_write_data(kvb_gguf_writer *w, FILE *f, const kvb_gen_opts *o, const gen_tensor *ts, int n,
                                 kvb_err *err) {
    kvb_pool *pool = NULL;
    uint8_t *buf = NULL; /* one tensor's data */
    int threads = o->n_threads > 0 ? o->n_threads : kvb_cpu_count();
    kvb_status st = kvb_pool_create(threads, &pool, err);
    if (st) return st;
    float **scratch = calloc((size_t)threads, sizeof *scratch); /* per worker: (max_cols) */
    if (!scratch) {
        st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
        goto done;
    }
    uint64_t max_cols = 0, total = 0, written = 0;
    for (int i = 0; i < n; i++) {
        max_cols = ts[i].ne[0] > max_cols ? ts[i].ne[0] : max_cols;
        total += kvb_gguf_writer_tensor_bytes(w, (uint64_t)i);
    }
    for (int i = 0; i < threads; i++)
        if (!(scratch[i] = malloc(max_cols * sizeof(float)))) {
            st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory");
            goto done;
        }
    double t0 = kvb_now_s(), last = t0;
    for (int i = 0; i < n; i++) {
        uint64_t bytes = kvb_gguf_writer_tensor_bytes(w, (uint64_t)i);
        uint8_t *nb = realloc(buf, bytes);
        if (!nb) {
            st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for tensor %s (%llu bytes)", ts[i].name,
                             (unsigned long long)bytes);
            goto done;
        }
        buf = nb;
        gen_job job = {.t = &ts[i],
                       .seed = kvb_splitmix64(o->seed * 0x100000001b3ULL + (uint64_t)i),
                       .out = buf,
                       .row_bytes = kvb_row_bytes(ts[i].type, (int64_t)ts[i].ne[0]),
                       .scratch = scratch};
        uint64_t rows = ts[i].n_dims > 1 ? ts[i].ne[1] * ts[i].ne[2] : 1;
        kvb_pool_parallel_for(pool, (int)((rows + GEN_CHUNK_ROWS - 1) / GEN_CHUNK_ROWS), gen_chunk, &job);
        if ((st = kvb_gguf_writer_write_tensor_data(w, f, (uint64_t)i, buf, bytes, err))) goto done;
        written += bytes;
        double now = kvb_now_s();
        if (o->progress && (now - last > 1.0 || i == n - 1)) {
            fprintf(stderr, "\rgen-model: %5.1f%% (%.2f / %.2f GB, %.1f s)", 100.0 * written / total, written / 1e9,
                    total / 1e9, now - t0);
            last = now;
        }
    }
    if (o->progress) fputc('\n', stderr);
done:
    if (scratch)
        for (int i = 0; i < threads; i++) free(scratch[i]);
    free(scratch);
    free(buf);
    kvb_pool_destroy(pool);
    return st;
}

kvb_status kvb_gen_model(const kvb_gen_opts *o, const char *out_path, kvb_err *err) {
    const kvb_preset *p;
    kvb_status st = gen_preset(o, &p, err);
    if (st) return st;
    kvb_model_desc d = p->d;
    if (o->n_layers > d.n_layer)
        return kvb_err_set(err, KVB_ERR_INVALID, "preset %s has %u layers: --layers %u is more", p->name, d.n_layer,
                           o->n_layers);
    if (o->n_layers) d.n_layer = o->n_layers;
    if (d.n_layer_dense_lead > d.n_layer) d.n_layer_dense_lead = d.n_layer;
    kvb_gguf_writer *w = NULL;
    gen_tensor *ts = NULL;
    FILE *f = NULL;
    float *rope_factors = NULL;
    int n = 0;
    bool created = false;
    if ((st = kvb_gguf_writer_create(&w, err))) return st;
    if ((st = write_keys(w, &d, p->name, o->type, err)) || (st = gen_vocab(w, o->vocab_path, &d, err)) ||
        (st = gen_tensor_list(&d, o->type, &ts, &n, &rope_factors, err)) || (st = gen_declare(w, p->name, ts, n, err)))
        goto done;
    f = fopen(out_path, "wb");
    created = f != NULL;
    if (!f) {
        st = kvb_err_set(err, KVB_ERR_IO, "cannot create %s: %m", out_path);
        goto done;
    }
    if ((st = kvb_gguf_writer_write_header(w, f, err)) || (st = gen_write_data(w, f, o, ts, n, err))) goto done;
    if (fclose(f) != 0) {
        f = NULL;
        st = kvb_err_set(err, KVB_ERR_IO, "writing %s failed: %m", out_path);
        goto done;
    }
    f = NULL;
done:
    if (f) fclose(f);
    if (st && created) remove(out_path); /* only a file this call created: never a path it could not open */
    free(rope_factors);
    free(ts);
    kvb_gguf_writer_destroy(w);
    return st;
}
