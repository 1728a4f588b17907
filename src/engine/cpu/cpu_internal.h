/* engine/cpu/cpu_internal.h — private to the CPU engine's files (not a contract): the engine
 * and sequence structures and the parallel kernels the forward pass is built from. */
#ifndef KVB_CPU_INTERNAL_H
#define KVB_CPU_INTERNAL_H

#include "kvb_engine_cpu.h"
#include "kvb_quant.h"

struct kvb_engine {
    const kvb_model *m;
    kvb_engine_opts o;
    kvb_pool *pool;
    kvb_kvformat fmt;
    size_t row_bytes;   /* one cache row (head_dim) in the cache dtype */
    size_t block_bytes; /* one cache block */
    kvb_rope_tables rope; /* per chunk: (layer kind, B, n_rot/2) cos/sin; each layer rotates with its own kind */
    kvb_store *store;   /* blocks: (layer, kv, kv_head, token, head_dim) each */
    bool own_store;
    /* per-chunk scratch, B = max_batch tokens */
    float *x;      /* (B, n_embd) residual stream */
    float *h;      /* (B, n_embd) normed */
    float *q;      /* (B, n_head * head_dim) */
    float *att;    /* (B, n_head * head_dim) attention output */
    float *g, *u;  /* (B, n_ff) */
    uint8_t *act;  /* (B, act row bytes for the widest input) */
    uint8_t *k_rows, *v_rows;   /* (B, n_head_kv, row_bytes) encoded cache rows of this chunk */
    void *kv_scratch;
    float *logit_h;             /* (n_embd) */
    uint32_t *tok_pos;          /* (B) each token's position in its sequence */
    uint32_t *seg_ones;         /* (B) a decode batch's segment lengths, all 1 */
    float **attn_scratch;       /* per worker */
    /* mixture of experts (n_expert > 0; else NULL), K = n_expert_used, F = n_ff_exp */
    float *moe_logits;          /* (B, n_expert) router logits, then probabilities */
    uint32_t *moe_sel;          /* (B, K) each token's experts, largest probability first */
    float *moe_w;               /* (B, K) their weights */
    uint32_t *moe_off, *moe_fill; /* (n_expert + 1) each expert's first slot in moe_slot; a cursor */
    uint32_t *moe_slot;         /* (B * K) slots (token * K + rank) grouped by expert */
    uint32_t *moe_active;       /* (n_expert) the experts a chunk routes to */
    uint8_t *moe_act;           /* (B * K, act row of max(n_embd, F)) the experts' quantised inputs, grouped order */
    float *moe_x;               /* (B * K, n_embd) the experts' outputs, grouped order */
    float *moe_g, *moe_u;       /* (B * K, F) gate and up outputs, grouped order */
    float *moe_y;               /* (B * K, n_embd) each slot's expert output */
    /* the shared expert (n_ff_shexp > 0; else NULL) */
    float *sh_g, *sh_u;         /* (B, n_ff_shexp) its gate and up projections, then SwiGLU */
    float *sh_y;                /* (B, n_embd) its output */
    float *sh_gate;             /* (B) its gate's logit (qwen2moe's ffn_gate_inp_shexp) */
    /* latent attention (deepseek2; else NULL). q holds (B, n_head, R + P) queries against the cache row */
    float *mla_q;               /* (B, n_head, key_length_mla) the projected queries */
    float *mla_t, *mla_u;       /* (B, max(n_lora_q, R, N, Vd)) one head's gathered rows; its projection */
    float *mla_o;               /* (B, n_head * value_length_mla) the heads' values */
};

struct kvb_seq {
    kvb_engine *e;
    uint32_t len;
    int32_t *tokens;    /* (cap * block_tokens) the sequence's token ids */
    uint32_t *blocks;   /* (cap) block ids, one per block_tokens tokens */
    uint32_t n_blocks, cap;
    uint32_t n_committed; /* blocks [0, n_committed) are committed (referenced); the rest WRITING */
    uint64_t last_key;    /* chain key of the last committed block (the root when none) */
    bool commit_refused;  /* a commit hit a key collision: stop publishing this sequence */
    uint32_t keep_window_at; /* 0, or a position a continuation may resume at (kvb_seq_keep_window_at) */
    uint32_t borrowed_from, borrowed_to; /* blocks [from, to) are borrowed; to == 0: none */
    kvb_layer_gate gate;     /* or NULL */
    void *gate_ctx;
    float *gate_saved;       /* (n, n_embd + n_head * head_dim): a gated chunk's x and q across its gate */
    size_t gate_saved_floats;
};

/* y (n_tok, W->rows) = W x for x (n_tok, W->cols) f32; act: scratch for quantised x. */
/* Latent attention (mla.c): the queries of nr rows of e->h into e->q (nr, n_head, R + P); the
 * attention's latent output (e->att) through V_b and W_o into e->h. */
void kvb_cpu_mla_query(kvb_engine *e, uint32_t layer, uint32_t nr, const float *rope_cos, const float *rope_sin);
void kvb_cpu_mla_output(kvb_engine *e, uint32_t layer, uint32_t nr);
/* Rows per pool task when `rows` weight rows are split among the pool's threads for the tile kernel. */
uint32_t kvb_cpu_rows_per_task(const kvb_pool *pool, int64_t rows);
void kvb_cpu_matmul(kvb_pool *pool, const kvb_mat *W, const float *x, uint32_t n_tok, float *y, uint8_t *act);
/* The same, with ggml: ggml's quantiser and dot (kvb_matmul_tile_ggml) where W's type has them. */
void kvb_cpu_matmul_arith(kvb_pool *pool, const kvb_mat *W, const float *x, uint32_t n_tok, float *y, uint8_t *act,
                          bool ggml);
/* y = (x * (1/rms(x))) * w, canonical (see kvb_kv_produce). */
void kvb_cpu_rmsnorm(const float *x, const float *w, uint32_t n, float eps, float *y);
/* The same, with ggml: 1/rms as ggml's rms_norm computes it (each x*x rounded to f32, summed in
 * double in order, the mean rounded to f32, 1.0f / sqrtf(mean + eps)). */
void kvb_cpu_rmsnorm_arith(const float *x, const float *w, uint32_t n, float eps, float *y, bool ggml);
/* Rotates one head vector in place with the table row c, s (n_rot/2). */
void kvb_cpu_rope(float *v, uint32_t n_rot, bool neox, const float *c, const float *s);
/* The same, with ggml: x0' = fmaf(x0, c, -(x1*s)), x1' = fmaf(x0, s, x1*c) (ggml's rotate_pairs as
 * llama.cpp's build compiles it: contracted). */
void kvb_cpu_rope_arith(float *v, uint32_t n_rot, bool neox, const float *c, const float *s, bool ggml);
/* GELU, tanh approximation (PyTorch's gelu(approximate="tanh"), Gemma's gelu_pytorch_tanh), in f32:
 * (0.5 x) (1 + tanh(0.7978845608 (x + 0.044715 x^3))), each operation rounded in this order. */
float kvb_cpu_gelu_tanh(float x);

/* h (nr, n_embd) := the mixture-of-experts MLP of the normed rows h (nr, n_embd) with layer w's
 * router and experts; tok_pool splits per-token work (NULL for one row). */
void kvb_cpu_moe(kvb_engine *e, const kvb_layer_weights *w, uint32_t nr, kvb_pool *tok_pool);

/* Makes room for the sequence to reach new_len tokens (takes whole blocks from the pool). */
kvb_status kvb_cpu_seq_reserve(kvb_seq *s, uint32_t new_len, kvb_err *err);
/* Commits every completely filled, not yet committed block of the sequence. */
kvb_status kvb_cpu_seq_commit_full(kvb_seq *s, kvb_err *err);
/* Floats of per-worker attention scratch the engine must allocate. */
size_t kvb_cpu_attn_scratch_floats(const kvb_engine *e);

/* out (n, n_head, head_dim) = causal attention of q (n, n_head, head_dim) at positions
 * pos0.. over the sequence's cached K/V of this layer (which already hold these positions),
 * scores scaled by the description's attn_scale. On a local layer (kvb_layer_is_local) a query
 * at position p reads only keys k with p - k < swa_window: no block or row before the window is
 * touched. */
void kvb_cpu_attention(kvb_engine *e, const kvb_seq *s, uint32_t layer, uint32_t pos0, uint32_t n, const float *q,
                       float *out);

#endif
