/* model/presets.c — the shapes `kvbridge gen-model` knows: tiny test models for CI (one per
 * architecture) and the real shapes of models users run (Qwen3-0.6B, Qwen3-30B-A3B and
 * Qwen3-235B-A22B (mixtures of experts), Qwen2.5-0.5B,
 * Llama-3.2-1B, Llama-3.1-8B and -70B, Llama-2-7B, TinyLlama-1.1B, Gemma-3-270M, DeepSeek-V2-Lite and
 * DeepSeek-V3 (latent attention, mixtures of experts with shared experts)), with their RoPE, norm,
 * (Gemma 3) sliding-window and (DeepSeek) YaRN constants. */
#include <string.h>

#include "kvb_model.h"

#define LLAMA3_ROPE .rope_freq_base = 500000.0f, .rope_low_freq_factor = 1.0f, .rope_high_freq_factor = 4.0f, \
                    .rope_orig_ctx = 8192

static const kvb_preset k_presets[] = {
    {"tiny", "llama, 4 layers, embd 256, 4/2 heads x 64, ff 768 (CI)",
     {.arch = KVB_ARCH_LLAMA, .arch_name = "llama", .n_vocab = 0, .n_ctx_train = 4096, .n_embd = 256,
      .n_layer = 4, .n_ff = 768, .n_head = 4, .n_head_kv = 2, .head_dim = 64, .n_rot = 64,
      .rope_freq_base = 10000.0f, .norm_eps = 1e-5f}},
    {"tiny-qwen2", "qwen2 (q/k/v bias), 3 layers, embd 256, 4/2 heads x 64, ff 640 (CI)",
     {.arch = KVB_ARCH_QWEN2, .arch_name = "qwen2", .n_ctx_train = 4096, .n_embd = 256, .n_layer = 3,
      .n_ff = 640, .n_head = 4, .n_head_kv = 2, .head_dim = 64, .n_rot = 64, .rope_freq_base = 1000000.0f,
      .norm_eps = 1e-6f, .rope_neox = true, .has_qkv_bias = true, .tied_output = true}},
    {"tiny-qwen3", "qwen3 (q/k norm), 3 layers, embd 256, 4/2 heads x 64, ff 640 (CI)",
     {.arch = KVB_ARCH_QWEN3, .arch_name = "qwen3", .n_ctx_train = 4096, .n_embd = 256, .n_layer = 3,
      .n_ff = 640, .n_head = 4, .n_head_kv = 2, .head_dim = 64, .n_rot = 64, .rope_freq_base = 1000000.0f,
      .norm_eps = 1e-6f, .rope_neox = true, .has_qk_norm = true, .tied_output = true}},
    {"tiny-llama3", "llama with Llama-3 rope scaling, 2 layers, embd 256, 4/1 heads x 64, ff 512 (CI)",
     {.arch = KVB_ARCH_LLAMA, .arch_name = "llama", .n_ctx_train = 131072, .n_embd = 256, .n_layer = 2,
      .n_ff = 512, .n_head = 4, .n_head_kv = 1, .head_dim = 64, .n_rot = 64, LLAMA3_ROPE,
      .rope_scale_factor = 32.0f, .norm_eps = 1e-5f, .tied_output = true}},
    /* 6 layers with the Gemma 3 pattern: layers 0-4 local (window 16 tokens), layer 5 global, so a
     * 40-token test prompt crosses both layer kinds and the window boundary */
    {"tiny-gemma3", "gemma3 (5 local + 1 global layers, window 16), embd 256, 4/1 heads x 64, ff 512 (CI)",
     {.arch = KVB_ARCH_GEMMA3, .arch_name = "gemma3", .n_ctx_train = 4096, .n_embd = 256, .n_layer = 6,
      .n_ff = 512, .n_head = 4, .n_head_kv = 1, .head_dim = 64, .n_rot = 64, .rope_freq_base = 1000000.0f,
      .norm_eps = 1e-6f, .rope_neox = true, .has_qk_norm = true, .tied_output = true, .has_post_norms = true,
      .mlp_gelu = true, .swa_window = 16, .swa_pattern = 6, .rope_freq_base_local = 10000.0f}},
    /* 8 experts, top 2: a 40-token prompt routes to every expert in every layer; the expert inner size is
     * one K-quant block so every weight type applies */
    {"tiny-moe", "qwen3moe, 3 layers, embd 256, 4/2 heads x 64, 8 experts top-2 x ff 256 (CI)",
     {.arch = KVB_ARCH_QWEN3MOE, .arch_name = "qwen3moe", .n_ctx_train = 4096, .n_embd = 256, .n_layer = 3,
      .n_ff = 512, .n_head = 4, .n_head_kv = 2, .head_dim = 64, .n_rot = 64, .rope_freq_base = 1000000.0f,
      .norm_eps = 1e-6f, .rope_neox = true, .has_qk_norm = true, .n_expert = 8, .n_expert_used = 2,
      .n_ff_exp = 256, .expert_weights_norm = true}},
    /* deepseek2 for CI: q_lora present, 1 leading dense layer then 2 MoE layers, 8 experts top-2 in 4 groups
     * (2 kept), 1 shared expert, sigmoid gating with V3's selection bias, weights renormalised and scaled, YaRN;
     * the cache row is latent 64 + rope 32 = 96 values (q8_0 blocks fit); every deepseek2 preset has
     * n_ff_shexp = n_ff_exp * n_expert_shared, the width llama.cpp gives its ffn_*_shexp */
    {"tiny-mla", "deepseek2 (MLA latent 64 + rope 32, q_lora 128), 3 layers (1 dense), embd 256, 4 heads x (32+32 / "
                 "v 32), 8 experts top-2 in 4 groups + 1 shared x ff 256, sigmoid, YaRN (CI)",
     {.arch = KVB_ARCH_DEEPSEEK2, .arch_name = "deepseek2", .n_ctx_train = 4096, .n_embd = 256, .n_layer = 3,
      .n_ff = 512, .n_head = 4, .n_head_kv = 1, .head_dim = 96, .n_rot = 32, .rope_freq_base = 10000.0f,
      .norm_eps = 1e-6f, .mla = true, .n_lora_q = 128, .n_lora_kv = 64, .head_dim_k_mla = 64, .head_dim_v_mla = 32,
      .n_layer_dense_lead = 1, .n_expert = 8, .n_expert_used = 2, .n_ff_exp = 256, .n_expert_shared = 1,
      .n_ff_shexp = 256, .expert_weights_norm = true, .expert_weights_scale = 2.5f,
      .expert_gating = KVB_GATING_SIGMOID,
      .n_expert_groups = 4, .n_group_used = 2, .rope_yarn_factor = 4.0f, .rope_orig_ctx = 1024,
      .rope_yarn_log_mul = 1.0f, .rope_attn_factor = 1.0f, .yarn_beta_fast = 32.0f, .yarn_beta_slow = 1.0f}},
    /* deepseek-ai/DeepSeek-V2-Lite config.json: hidden_size 2048, num_hidden_layers 27, num_attention_heads 16,
     * q_lora_rank null, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128,
     * n_routed_experts 64, num_experts_per_tok 6, n_shared_experts 2, first_k_dense_replace 1,
     * moe_intermediate_size 1408, intermediate_size 10944, vocab_size 102400, norm_topk_prob false,
     * routed_scaling_factor 1.0, scoring softmax, n_group 1, rope_theta 10000, rms_norm_eps 1e-6,
     * max_position_embeddings 163840, rope_scaling yarn factor 40, original 4096, mscale = mscale_all_dim 0.707 */
    {"deepseek-v2-lite", "DeepSeek-V2-Lite shape: 27 layers (1 dense), embd 2048, 16 heads, MLA latent 512 + rope 64, "
                         "64 experts top-6 + 2 shared x ff 1408, vocab 102400",
     {.arch = KVB_ARCH_DEEPSEEK2, .arch_name = "deepseek2", .n_vocab = 102400, .n_ctx_train = 163840,
      .n_embd = 2048, .n_layer = 27, .n_ff = 10944, .n_head = 16, .n_head_kv = 1, .head_dim = 576, .n_rot = 64,
      .rope_freq_base = 10000.0f, .norm_eps = 1e-6f, .mla = true, .n_lora_q = 0, .n_lora_kv = 512,
      .head_dim_k_mla = 192, .head_dim_v_mla = 128, .n_layer_dense_lead = 1, .n_expert = 64, .n_expert_used = 6,
      .n_ff_exp = 1408, .n_expert_shared = 2, .n_ff_shexp = 2816, .expert_weights_norm = false,
      .expert_weights_scale = 1.0f, .expert_gating = KVB_GATING_SOFTMAX, .rope_yarn_factor = 40.0f,
      .rope_orig_ctx = 4096, .rope_yarn_log_mul = 0.707f, .rope_attn_factor = 1.0f, .yarn_beta_fast = 32.0f,
      .yarn_beta_slow = 1.0f}},
    /* deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, num_hidden_layers 61, num_attention_heads 128,
     * q_lora_rank 1536, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128,
     * n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, first_k_dense_replace 3,
     * moe_intermediate_size 2048, intermediate_size 18432, vocab_size 129280, n_group 8, topk_group 4,
     * routed_scaling_factor 2.5, norm_topk_prob true, scoring sigmoid (e_score_correction_bias),
     * rope_theta 10000, rope_scaling yarn factor 40, original 4096, mscale = mscale_all_dim 1.0.
     * 671B: generate a layer subset with gen-model --layers N (N >= 4 has both layer kinds). */
    {"deepseek-v3", "DeepSeek-V3 shape: 61 layers (3 dense), embd 7168, 128 heads, MLA latent 512 + rope 64, "
                    "q_lora 1536, 256 experts top-8 in 8 groups (4 kept) + 1 shared x ff 2048, vocab 129280 "
                    "(671B: use --layers)",
     {.arch = KVB_ARCH_DEEPSEEK2, .arch_name = "deepseek2", .n_vocab = 129280, .n_ctx_train = 163840,
      .n_embd = 7168, .n_layer = 61, .n_ff = 18432, .n_head = 128, .n_head_kv = 1, .head_dim = 576, .n_rot = 64,
      .rope_freq_base = 10000.0f, .norm_eps = 1e-6f, .mla = true, .n_lora_q = 1536, .n_lora_kv = 512,
      .head_dim_k_mla = 192, .head_dim_v_mla = 128, .n_layer_dense_lead = 3, .n_expert = 256, .n_expert_used = 8,
      .n_ff_exp = 2048, .n_expert_shared = 1, .n_ff_shexp = 2048, .expert_weights_norm = true,
      .expert_weights_scale = 2.5f, .expert_gating = KVB_GATING_SIGMOID, .n_expert_groups = 8, .n_group_used = 4,
      .rope_yarn_factor = 40.0f, .rope_orig_ctx = 4096, .rope_yarn_log_mul = 1.0f, .rope_attn_factor = 1.0f,
      .yarn_beta_fast = 32.0f, .yarn_beta_slow = 1.0f}},
    /* qwen2moe as Qwen1.5-MoE-A2.7B is built (q/k/v bias, top-k not renormalised, a shared expert behind
     * a sigmoid gate, an untied output head llama.cpp requires), at tiny-moe's size */
    {"tiny-qwen2moe", "qwen2moe, 3 layers, embd 256, 4/2 heads x 64, 8 experts top-2 x ff 256 + shared ff 512 (CI)",
     {.arch = KVB_ARCH_QWEN2MOE, .arch_name = "qwen2moe", .n_ctx_train = 4096, .n_embd = 256, .n_layer = 3,
      .n_ff = 512, .n_head = 4, .n_head_kv = 2, .head_dim = 64, .n_rot = 64, .rope_freq_base = 1000000.0f,
      .norm_eps = 1e-6f, .rope_neox = true, .has_qkv_bias = true, .n_expert = 8, .n_expert_used = 2,
      .n_ff_exp = 256, .n_ff_shexp = 512}},
    {"qwen3-0.6b", "Qwen3-0.6B shape: 28 layers, embd 1024, 16/8 heads x 128, ff 3072, vocab 151936",
     {.arch = KVB_ARCH_QWEN3, .arch_name = "qwen3", .n_vocab = 151936, .n_ctx_train = 40960, .n_embd = 1024,
      .n_layer = 28, .n_ff = 3072, .n_head = 16, .n_head_kv = 8, .head_dim = 128, .n_rot = 128,
      .rope_freq_base = 1000000.0f, .norm_eps = 1e-6f, .rope_neox = true, .has_qk_norm = true,
      .tied_output = true}},
    /* Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48, intermediate_size 6144,
     * moe_intermediate_size 768, num_experts 128, num_experts_per_tok 8, norm_topk_prob true, 32/4 heads,
     * head_dim 128, rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960, untied embeddings */
    {"qwen3-30b-a3b", "Qwen3-30B-A3B shape: 48 layers, embd 2048, 32/4 heads x 128, 128 experts top-8 x ff 768, "
                      "vocab 151936",
     {.arch = KVB_ARCH_QWEN3MOE, .arch_name = "qwen3moe", .n_vocab = 151936, .n_ctx_train = 40960, .n_embd = 2048,
      .n_layer = 48, .n_ff = 6144, .n_head = 32, .n_head_kv = 4, .head_dim = 128, .n_rot = 128,
      .rope_freq_base = 1000000.0f, .norm_eps = 1e-6f, .rope_neox = true, .has_qk_norm = true, .n_expert = 128,
      .n_expert_used = 8, .n_ff_exp = 768, .expert_weights_norm = true}},
    /* Qwen/Qwen3-235B-A22B config.json: hidden_size 4096, 94 layers, intermediate_size 12288,
     * moe_intermediate_size 1536, 128 experts, top 8, 64/4 heads x 128 */
    {"qwen3-235b-a22b", "Qwen3-235B-A22B shape: 94 layers, embd 4096, 64/4 heads x 128, 128 experts top-8 x ff 1536, "
                        "vocab 151936 (470 GB in bf16)",
     {.arch = KVB_ARCH_QWEN3MOE, .arch_name = "qwen3moe", .n_vocab = 151936, .n_ctx_train = 40960, .n_embd = 4096,
      .n_layer = 94, .n_ff = 12288, .n_head = 64, .n_head_kv = 4, .head_dim = 128, .n_rot = 128,
      .rope_freq_base = 1000000.0f, .norm_eps = 1e-6f, .rope_neox = true, .has_qk_norm = true, .n_expert = 128,
      .n_expert_used = 8, .n_ff_exp = 1536, .expert_weights_norm = true}},
    {"qwen2.5-0.5b", "Qwen2.5-0.5B shape: 24 layers, embd 896, 14/2 heads x 64, ff 4864, vocab 151936",
     {.arch = KVB_ARCH_QWEN2, .arch_name = "qwen2", .n_vocab = 151936, .n_ctx_train = 32768, .n_embd = 896,
      .n_layer = 24, .n_ff = 4864, .n_head = 14, .n_head_kv = 2, .head_dim = 64, .n_rot = 64,
      .rope_freq_base = 1000000.0f, .norm_eps = 1e-6f, .rope_neox = true, .has_qkv_bias = true,
      .tied_output = true}},
    {"llama3.2-1b", "Llama-3.2-1B shape: 16 layers, embd 2048, 32/8 heads x 64, ff 8192, vocab 128256",
     {.arch = KVB_ARCH_LLAMA, .arch_name = "llama", .n_vocab = 128256, .n_ctx_train = 131072, .n_embd = 2048,
      .n_layer = 16, .n_ff = 8192, .n_head = 32, .n_head_kv = 8, .head_dim = 64, .n_rot = 64, LLAMA3_ROPE,
      .rope_scale_factor = 32.0f, .norm_eps = 1e-5f, .tied_output = true}},
    {"llama3.1-8b", "Llama-3.1-8B shape: 32 layers, embd 4096, 32/8 heads x 128, ff 14336, vocab 128256",
     {.arch = KVB_ARCH_LLAMA, .arch_name = "llama", .n_vocab = 128256, .n_ctx_train = 131072, .n_embd = 4096,
      .n_layer = 32, .n_ff = 14336, .n_head = 32, .n_head_kv = 8, .head_dim = 128, .n_rot = 128, LLAMA3_ROPE,
      .rope_scale_factor = 8.0f, .norm_eps = 1e-5f}},
    {"llama3.1-70b", "Llama-3.1-70B shape: 80 layers, embd 8192, 64/8 heads x 128, ff 28672, vocab 128256 (141 GB in "
                     "bf16: across GPUs, or on one H200 with packed weights)",
     {.arch = KVB_ARCH_LLAMA, .arch_name = "llama", .n_vocab = 128256, .n_ctx_train = 131072, .n_embd = 8192,
      .n_layer = 80, .n_ff = 28672, .n_head = 64, .n_head_kv = 8, .head_dim = 128, .n_rot = 128, LLAMA3_ROPE,
      .rope_scale_factor = 8.0f, .norm_eps = 1e-5f}},
    {"llama2-7b", "Llama-2-7B shape: 32 layers, embd 4096, 32/32 heads x 128, ff 11008, vocab 32000",
     {.arch = KVB_ARCH_LLAMA, .arch_name = "llama", .n_vocab = 32000, .n_ctx_train = 4096, .n_embd = 4096,
      .n_layer = 32, .n_ff = 11008, .n_head = 32, .n_head_kv = 32, .head_dim = 128, .n_rot = 128,
      .rope_freq_base = 10000.0f, .norm_eps = 1e-5f}},
    {"tinyllama-1.1b", "TinyLlama-1.1B shape: 22 layers, embd 2048, 32/4 heads x 64, ff 5632, vocab 32000",
     {.arch = KVB_ARCH_LLAMA, .arch_name = "llama", .n_vocab = 32000, .n_ctx_train = 2048, .n_embd = 2048,
      .n_layer = 22, .n_ff = 5632, .n_head = 32, .n_head_kv = 4, .head_dim = 64, .n_rot = 64,
      .rope_freq_base = 10000.0f, .norm_eps = 1e-5f}},
    {"gemma3-270m", "Gemma-3-270M shape: 18 layers (15 local, window 512), embd 640, 4/1 heads x 256, ff 2048, "
                    "vocab 262144",
     {.arch = KVB_ARCH_GEMMA3, .arch_name = "gemma3", .n_vocab = 262144, .n_ctx_train = 32768, .n_embd = 640,
      .n_layer = 18, .n_ff = 2048, .n_head = 4, .n_head_kv = 1, .head_dim = 256, .n_rot = 256,
      .rope_freq_base = 1000000.0f, .norm_eps = 1e-6f, .rope_neox = true, .has_qk_norm = true, .tied_output = true,
      .has_post_norms = true, .mlp_gelu = true, .swa_window = 512, .swa_pattern = 6,
      .rope_freq_base_local = 10000.0f}},
};

size_t kvb_preset_count(void) { return sizeof k_presets / sizeof k_presets[0]; }
const kvb_preset *kvb_preset_at(size_t i) { return i < kvb_preset_count() ? &k_presets[i] : NULL; }

const kvb_preset *kvb_preset_find(const char *name) {
    for (size_t i = 0; i < kvb_preset_count(); i++)
        if (strcmp(k_presets[i].name, name) == 0) return &k_presets[i];
    return NULL;
}
