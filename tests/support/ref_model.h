/* ref_model — the independent float64 reference implementation of every architecture the engines
 * run (llama, qwen2, qwen3, qwen3moe, gemma3), used by tests as the oracle. It is deliberately plain: it reads GGUF
 * metadata and tensor bytes through the GGUF reader only, dequantises every weight to double once
 * at load with its own block decoders written from ggml's layouts (F32, F16, BF16, Q8_0, Q4_0; no
 * call into quant/ or model/), and runs the causal forward pass with naive loops in double. It
 * follows llama.cpp's conventions: RMSNorm sqrt(mean(x^2)+eps); "normal" RoPE (pairs (2i, 2i+1))
 * for llama and NEOX RoPE (pairs (i, i+n_rot/2)) for qwen2/qwen3; inverse frequency
 * base^(-2i/n_rot), divided by rope_freqs.weight when that tensor exists, else by Llama-3 or
 * linear scaling from the rope.scaling.* keys; GQA head h -> kv head h/(n_head/n_head_kv); score
 * scale 1/sqrt(head_dim); SwiGLU FFN; output.weight absent -> tied to token_embd. Gemma 3 (its
 * public description, checked against the 270M GGUF): embeddings times sqrt(n_embd); q/k per-head
 * RMSNorm; NEOX RoPE with base rope.freq_base (and any scaling) on global layers and 10000, never
 * scaled, on local layers; local layers are those with i % 6 < 5 (5 local, then 1 global) unless
 * attention.sliding_window_pattern says otherwise, and a query at position p attends keys k with
 * p - k < attention.sliding_window there; scores scaled by 1/sqrt(query_pre_attn_scalar) (head_dim;
 * n_embd/n_head for the 62-layer 27B); post-attention and post-FFN RMSNorms before each residual
 * add; GeGLU FFN with tanh-approximated GELU; the stored norm weights already hold Gemma's +1.
 * Qwen3-MoE (llama.cpp's build_moe_ffn with softmax gating, Hugging Face's Qwen3MoeSparseMoeBlock):
 * qwen3's attention; the FFN is a router ffn_gate_inp (n_expert, n_embd), softmax over all experts,
 * the expert_used_count largest probabilities (the lower index on a tie), divided by their sum
 * unless expert_weights_norm is false; the output is their weighted sum of each chosen expert's
 * SwiGLU FFN, expert x's rows being rows x*rows .. of ggml's stacked ffn_{gate,up,down}_exps.
 * DeepSeek V2/V3 (deepseek2, the MLA form llama.cpp's converter writes; DeepSeek's modeling code):
 * the query q_b(rmsnorm(q_a h)) (or attn_q h) split per head into a non-rotated part (N) and a
 * rotated one (P); c = kv_a_mqa h, the latent rmsnorm(c[0:R]) * kv_a_norm, the shared key part
 * rope(c[R:R+P]); attention in the EXPANDED form: each head's key [K_b[h]^T latent, k_pe] and
 * value V_b[h] latent (attn_k_b [N, R, H], attn_v_b [R, Vd, H]), scores scaled by mscale^2 /
 * sqrt(N + P) (mscale = 1 + 0.1 mscale_all_dim ln(factor) under YaRN, else 1); RoPE on pairs
 * (2i, 2i+1) with YaRN's blend of interpolated and original frequencies over the correction range
 * of beta_fast 32, beta_slow 1; the first leading_dense_block_count layers have the SwiGLU FFN, the
 * others experts: softmax or sigmoid probabilities, selection by probability plus exp_probs_b.bias
 * (when present) over the n_group_used best groups (a group's score: its two best experts' scores
 * summed), weights the unbiased probabilities, divided by their sum when expert_weights_norm, times
 * expert_weights_scale, plus the shared experts' SwiGLU (ffn_*_shexp, n_ff_exp * expert_shared_count
 * wide, ungated). ref_model_kv gives the cache row [latent, k_pe] (n, 1, R + P) as K; V is not written.
 * Qwen2-MoE (llama.cpp's qwen2moe graph, Hugging Face's Qwen2MoeSparseMoeBlock): qwen2's attention
 * (q/k/v biases); the same routed experts, not renormalised unless expert_weights_norm says so;
 * plus a shared SwiGLU expert ffn_{gate,up,down}_shexp every token runs, multiplied by
 * sigmoid(ffn_gate_inp_shexp . h) and added to the routed experts' sum. */
#ifndef KVB_REF_MODEL_H
#define KVB_REF_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    REF_ARCH_LLAMA = 0,
    REF_ARCH_QWEN2,
    REF_ARCH_QWEN3,
    REF_ARCH_GEMMA3,
    REF_ARCH_QWEN3MOE,
    REF_ARCH_DEEPSEEK2,
    REF_ARCH_QWEN2MOE,
} ref_arch;

#define REF_MAX_LAYERS 4096
typedef enum {
    REF_ROPE_NORM = 0, /* llama.cpp LLAMA_ROPE_TYPE_NORM: rotate (x[2i], x[2i+1]) */
    REF_ROPE_NEOX,     /* llama.cpp LLAMA_ROPE_TYPE_NEOX: rotate (x[i], x[i + n_rot/2]) */
} ref_rope_style;
typedef enum {
    REF_SCALING_NONE = 0,
    REF_SCALING_LINEAR,       /* inverse frequencies divided by rope.scaling.factor (llama.cpp default type) */
    REF_SCALING_LLAMA3,       /* Llama-3 smooth scaling computed from the rope.scaling.* keys */
    REF_SCALING_FREQS_TENSOR, /* inverse frequencies divided by rope_freqs.weight (llama.cpp's way) */
} ref_rope_scaling;

typedef struct {
    ref_arch arch;
    ref_rope_style rope_style;
    int n_vocab, n_embd, n_layer, n_ff;
    int n_head, n_head_kv, head_dim, n_rot;
    double rope_freq_base;
    ref_rope_scaling rope_scaling;
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor; /* as read (LLAMA3/LINEAR) */
    double rope_orig_ctx;
    double norm_eps;
    bool has_qkv_bias;  /* attn_{q,k,v}.bias present (required for qwen2) */
    bool has_o_bias;    /* attn_output.bias present (llama.cpp accepts it for llama) */
    bool has_qk_norm;   /* qwen3 */
    bool tied_output;   /* output.weight absent */
    /* gemma3 */
    double embd_scale;        /* embeddings are multiplied by this (gemma3: sqrt(n_embd)); 1 otherwise */
    double attn_scale;        /* score scale: 1/sqrt(head_dim), gemma3 1/sqrt(query_pre_attn_scalar) */
    bool has_post_norms;      /* post_attention_norm, post_ffw_norm */
    bool ffn_gelu;            /* GeGLU (tanh GELU) instead of SwiGLU */
    int swa_window;           /* 0: no local layers */
    bool layer_local[REF_MAX_LAYERS]; /* (n_layer) local (sliding-window) layers */
    double rope_freq_base_local;      /* base of the local layers' RoPE (unscaled) */
    /* qwen3moe, qwen2moe, deepseek2 (0 / false otherwise) */
    int n_expert, n_expert_used, n_ff_exp;
    bool expert_weights_norm;
    int n_ff_shexp;           /* the shared expert's inner size (qwen2moe, deepseek2; 0: none) */
    /* deepseek2 (0 / false otherwise): the latent attention in its expanded form, see above */
    bool mla;
    int n_lora_q, n_lora_kv;  /* q_lora_rank (0: attn_q), kv_lora_rank R */
    int k_mla, v_mla;         /* key_length_mla (N + P), value_length_mla */
    int n_dense_lead;         /* leading_dense_block_count */
    double expert_weights_scale; /* 0: none */
    int gating;               /* 1 softmax, 2 sigmoid */
    int n_groups, n_group_used; /* expert groups (0/1: none) */
    double yarn_factor, yarn_log_mul; /* YaRN: factor (0: none), mscale_all_dim (the key / 0.1) */
} ref_desc;

typedef struct ref_model ref_model;

/* Loads and dequantises a whole model. NULL on failure with a message in errbuf (may be NULL). */
ref_model *ref_model_load(const char *gguf_path, char *errbuf, size_t cap);
void ref_model_free(ref_model *m);
int ref_model_n_vocab(const ref_model *m);
const ref_desc *ref_model_desc(const ref_model *m);
/* The final angular speed of each rotated pair i in [0, n_rot/2), radians per position,
 * with any scaling applied (global layers). */
const double *ref_model_inv_freq(const ref_model *m);
/* The same for layer `layer` (a local layer's own frequencies for gemma3). */
const double *ref_model_inv_freq_layer(const ref_model *m, int layer);

/* Full causal forward of tokens[0..n) at positions 0..n-1. logits: (n, n_vocab), row t is the
 * prediction after token t. Returns 0, or -1 for bad arguments (n < 1, token out of range) or
 * allocation failure. */
int ref_model_forward(ref_model *m, const int32_t *tokens, int n, double *logits);
/* ref_model_forward that also writes gaps (n): for each token the smallest, over layers, router-logit
 * margin of its routing (the k-th largest logit minus the (k+1)-th); INFINITY for a dense model or
 * when every expert is used. A computation that perturbs the router's input by more than a token's
 * gap may route it differently, a discontinuity no logit tolerance covers. */
int ref_model_forward_gaps(ref_model *m, const int32_t *tokens, int n, double *logits, double *gaps);

/* deepseek2's routing of one token (d's expert fields) in float64: pr (n_expert) holds its router
 * logits and receives the probabilities (softmax or sigmoid); the selection scores (plus bias, NULL
 * or (n_expert)) over the n_group_used best groups (each scored by its two best) when d has groups;
 * sel (n_expert_used) the top experts (largest first, lower index on a tie), w their weights
 * (normalised when d says so, times its scale); *margin the smallest selection-score margin of a
 * decision (the top-k boundary, the kept groups' boundary). Returns 0, or -1 for bad sizes. */
int ref_route_deepseek(const ref_desc *d, double *pr, const double *bias, int *sel, double *w, double *margin);

/* The K and V that layer `layer` computes for tokens[0..n) (positions 0..n-1): K after bias,
 * k-norm and RoPE; V after bias; before any cache encoding. k, v: (n, n_head_kv, head_dim).
 * Returns 0 or -1 as ref_model_forward. */
int ref_model_kv(ref_model *m, const int32_t *tokens, int n, int layer, double *k, double *v);
/* The attention input of layer `layer`: rmsnorm(x) * attn_norm for tokens[0..n), h: (n, n_embd)
 * (what a cache producer multiplies by Wk and Wv). Returns 0 or -1 as ref_model_forward. */
int ref_model_attn_input(ref_model *m, const int32_t *tokens, int n, int layer, double *h);

/* Applies the model's RoPE at position pos to one head vector x: (head_dim); dims >= n_rot are
 * left unchanged. ref_rope uses the global layers' frequencies, ref_rope_layer layer's own. */
void ref_rope(const ref_model *m, double *x, int pos);
void ref_rope_layer(const ref_model *m, int layer, double *x, int pos);

/* ---- plain dequantisation (ggml block layouts; type numbers are ggml's) ----------------------- */

#define REF_TYPE_F32 0u
#define REF_TYPE_F16 1u
#define REF_TYPE_Q4_0 2u
#define REF_TYPE_Q8_0 8u
#define REF_TYPE_BF16 30u
/* quantised types decoded by ref_dequant_row_q5_k_family (ref_model.c) */
#define REF_TYPE_Q5_0 6u
#define REF_TYPE_Q4_K 12u
#define REF_TYPE_Q5_K 13u
#define REF_TYPE_Q6_K 14u

double ref_fp16_to_double(uint16_t h);
double ref_bf16_to_double(uint16_t h);
/* Bytes of a row of n elements, 0 if the type is not one of the nine above or n is not a whole
 * number of blocks (32 elements; 256 for Q4_K, Q5_K, Q6_K). */
size_t ref_row_bytes(uint32_t type, int64_t n);
/* dst: (n). Returns 0, or -1 for an unsupported type or a partial block. */
int ref_dequant_row(uint32_t type, const void *src, double *dst, int64_t n);

/* ---- comparison helpers ------------------------------------------------------------------- */

/* ||a - ref|| / ||ref|| (plain ||a - ref|| when ref is all zeros). */
double ref_rel_l2(const float *a, const double *ref, size_t n);
/* max_i |a_i - ref_i| */
double ref_max_abs(const float *a, const double *ref, size_t n);
/* Index of the largest element, lowest index on ties. */
int ref_argmax(const double *x, int n);
int ref_argmax_f32(const float *x, int n);

#endif
