/* engine/cpu — the CPU engine: batched multi-threaded prefill and single-token decode over a
 * paged KV cache (blocks of tokens in the decoder's cache format; every layer keeps every
 * position, local sliding-window layers only read their window), and sampling (greedy,
 * temperature, top-k, top-p, seeded). Results do not depend on the thread count: every output
 * element is computed by one task in a fixed order, using quant's canonical dot products. */
#ifndef KVB_ENGINE_CPU_H
#define KVB_ENGINE_CPU_H

#include <stdbool.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_kvformat.h"
#include "kvb_model.h"
#include "kvb_store.h"

/* Called for every (chunk, layer) with the layer's attention inputs h (n, n_embd) — the
 * attention-normed hidden states — at positions pos0 .. pos0+n-1, before the layer's attention.
 * A non-OK return aborts the forward pass with that error. The bridge hooks here. */
typedef kvb_status (*kvb_layer_hook)(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n, const float *h,
                                     kvb_err *err);

/* Called for every (chunk, layer) with the rows the engine just encoded into its own cache:
 * k_rows, v_rows (n, n_head_kv, row_bytes) in the engine's cache dtype. Bridge mode `prefill`
 * hooks here (re-encoding the prefill engine's own K/V into the decoder's format). */
typedef kvb_status (*kvb_kv_rows_hook)(void *ctx, uint32_t layer, uint32_t pos0, uint32_t n, const uint8_t *k_rows,
                                       const uint8_t *v_rows, uint32_t dtype, kvb_err *err);

typedef struct {
    int n_threads;          /* 0 = all CPUs */
    uint32_t cache_dtype;   /* kvb_type for the KV cache (F32 = 0, F16, BF16, Q8_0); the CLI defaults to F16 */
    uint32_t block_tokens;  /* tokens per cache block; default 32 */
    uint32_t max_ctx;       /* max tokens per sequence; 0 = the model's training context, capped at 8192 */
    uint32_t n_blocks;      /* blocks in the engine's own store; 0 = enough for one max_ctx sequence */
    kvb_store *store;       /* a shared store to use instead of its own (its format must match) */
    kvb_layer_hook layer_hook; /* optional */
    void *layer_hook_ctx;
    kvb_kv_rows_hook rows_hook; /* optional */
    void *rows_hook_ctx;
    uint32_t max_batch;     /* tokens per forward chunk; 0 = 512 */
    /* The llama.cpp fidelity level: every RMSNorm, the K/V projections and RoPE in ggml's CPU
     * arithmetic (kvb_kv_produce_args.ggml; the RoPE tables kvb_rope_tables_set_ggml), so the
     * cache rows are llama.cpp's own where the layer's input is; the other projections stay
     * canonical (ggml's K-quant and f16 products cannot be matched: Q8_K activations, build-
     * dependent vector widths). Refused for deepseek2 and YaRN models. */
    bool ggml_arith;
} kvb_engine_opts;

typedef struct kvb_engine kvb_engine;
typedef struct kvb_seq kvb_seq;

kvb_status kvb_engine_create(const kvb_model *m, const kvb_engine_opts *o, kvb_engine **out, kvb_err *err);
void kvb_engine_free(kvb_engine *e);
const kvb_kvformat *kvb_engine_kvformat(const kvb_engine *e);
int kvb_engine_threads(const kvb_engine *e);
uint32_t kvb_engine_max_batch(const kvb_engine *e); /* tokens per forward chunk */
/* The engine's thread pool, idle between forwards (a sampler may use it there). */
kvb_pool *kvb_engine_pool(kvb_engine *e);

kvb_store *kvb_engine_store(const kvb_engine *e);

/* A sequence: its tokens and their K/V in blocks of the engine's store. Every block the forward
 * pass fills completely is committed to the store through kvb_store_commit_block (the one block
 * writer) under its chain key, so later sequences with the same prefix find it. */
kvb_status kvb_seq_create(kvb_engine *e, kvb_seq **out, kvb_err *err);
/* Releases its blocks (committed ones stay cached). With sliding-window layers, committed blocks
 * wholly before the window of a continuation give up their local-layer rows (their memory goes
 * back to the system; see kvb_store_drop_local_rows): the windows kept are the one ending at the
 * committed chain's end and, if named, the one ending at kvb_seq_keep_window_at's position. */
void kvb_seq_free(kvb_seq *s);
/* A later prompt may resume this sequence's chain at pos (the decode node passes its prompt's
 * length: a next turn whose reply tokenizes differently matches up to there): keep that window's
 * local rows too when the sequence is freed. */
void kvb_seq_keep_window_at(kvb_seq *s, uint32_t pos);
uint32_t kvb_seq_len(const kvb_seq *s);
/* On an empty sequence: adopts the longest committed chain of blocks for tokens[0 .. n-2] (the
 * last token is always computed, so its logits exist). *n_cached = tokens now in the sequence
 * (a multiple of block_tokens); the caller forwards tokens[*n_cached .. n). */
kvb_status kvb_seq_attach_cached(kvb_seq *s, const int32_t *tokens, uint32_t n, uint32_t *n_cached, kvb_err *err);
/* Appends a block whose K/V for tokens (n, 1 <= n <= block_tokens) are already in `page` (a
 * WRITING page of the engine's store, e.g. a bridged tail from kvb_store_slab_take_tail) to a
 * sequence that ends on a block boundary. On success the sequence owns the page: a partial block
 * is filled by the forward pass and committed, full, through the one block writer; a full one
 * (the pipelined tail's page with the last token's row) is committed here. On error the caller
 * still owns it. */
kvb_status kvb_seq_adopt_tail(kvb_seq *s, kvb_block_id page, const int32_t *tokens, uint32_t n, kvb_err *err);

/* ---- the decoder's pipelined tail -----------------------------------------------------------
 * A bridged prompt's last token can run while the bridged blocks are still arriving: layer L of
 * its forward needs only layer L of every earlier position. The decode node builds a provisional
 * sequence: the cached prefix (kvb_seq_attach_cached), then the pages of the blocks still being
 * assembled and of the tail, BORROWED (kvb_seq_borrow_pages), and a gate the forward calls before
 * each layer's attention, which waits until that layer has arrived everywhere. The forward then
 * writes the last token's own K/V row into the borrowed tail page and returns the logits: the
 * same arithmetic on the same bytes as running that token after the transfer. */

/* Called by the forward before layer `layer`'s attention; a non-OK return aborts the forward.
 * A gate that will block parks the engine's threads first (kvb_engine_park_threads). While it
 * waits, the gate may run other forwards on this engine, on its own thread (kvb_engine_forward of
 * another sequence, kvb_engine_forward_batch): the gated chunk's state is kept across the call,
 * so its result is the same bit for bit. */
typedef kvb_status (*kvb_layer_gate)(void *ctx, uint32_t layer, kvb_err *err);
void kvb_seq_set_layer_gate(kvb_seq *s, kvb_layer_gate gate, void *ctx);
/* The engine's worker threads stop spinning for work and sleep until its next parallel step, so
 * a forward waiting at a gate leaves the CPUs to the threads receiving what it waits for. */
void kvb_engine_park_threads(kvb_engine *e);
/* The engine's next parallel steps run on its first n threads (0, or more than it has: all of
 * them); results never depend on it. From the thread running the forward, between forwards or at
 * a gate. */
void kvb_engine_set_threads(kvb_engine *e, int n);
/* Appends pages to a sequence that ends on a block boundary: n_tokens tokens (their K/V are or
 * will be in the pages, block_tokens per page) and n_pages >= ceil(n_tokens / block_tokens) pages,
 * the ones past the tokens left for the next forward to write into. The sequence never releases,
 * commits or gives up local rows of anything while it holds borrowed pages (free it without
 * harm to them); the caller keeps them alive until the sequence is freed. */
kvb_status kvb_seq_borrow_pages(kvb_seq *s, const kvb_block_id *pages, uint32_t n_pages, const int32_t *tokens,
                                uint32_t n_tokens, kvb_err *err);

/* Runs tokens[0..n) at positions seq_len .. seq_len+n-1 (chunked by max_batch), appending their
 * K/V to the sequence. logits: NULL, or (n_vocab) floats for the last token, or when all_logits
 * (n, n_vocab) for every token. */
kvb_status kvb_engine_forward(kvb_engine *e, kvb_seq *s, const int32_t *tokens, uint32_t n, float *logits,
                              bool all_logits, kvb_err *err);
/* One decode step of n distinct sequences at once (n <= max_batch): seqs[i] takes tokens[i] at
 * its next position; logits (n, n_vocab), row i for seqs[i]. The weights are read once for the
 * batch; each row is bit for bit what kvb_engine_forward(e, seqs[i], &tokens[i], 1, row, false)
 * gives. Not with the engine's layer/rows hooks or a sequence's layer gate. On an error some
 * sequences may have advanced: free them. */
kvb_status kvb_engine_forward_batch(kvb_engine *e, kvb_seq *const *seqs, const int32_t *tokens, uint32_t n,
                                    float *logits, kvb_err *err);
/* The general form: seg_n[i] >= 1 tokens appended to each of n_seg distinct sequences seqs[i] in one
 * forward (a slice of one request's prompt beside other requests' decode steps); tokens: the
 * segments' tokens back to back, at most max_batch in all. logits (n_seg, n_vocab): row i for
 * segment i's last token, bit for bit what kvb_engine_forward(e, seqs[i], its tokens, seg_n[i],
 * row, false) gives; blocks fill and commit as they do there. Same limits as the batch. */
kvb_status kvb_engine_forward_segments(kvb_engine *e, kvb_seq *const *seqs, const uint32_t *seg_n, uint32_t n_seg,
                                       const int32_t *tokens, float *logits, kvb_err *err);

/* ---- the decoder's cache-producing arithmetic ----------------------------------------------
 * For one layer, attention inputs h (n, n_embd) (the attention-normed hidden states) at
 * positions pos0 .. pos0+n-1 become cache rows, in this fixed order of IEEE operations:
 *   k = Wk h, v = Wv h       quant's canonical dot (activations quantised as kvb_quantize_act)
 *   k += bk, v += bv         (qwen2) one f32 add per element
 *   k_head = rmsnorm(k_head) * k_norm   (qwen3, gemma3) ss = canonical f32 dot(k, k); r = 1.0f/sqrtf(ss/hd + eps);
 *                            y = (k * r) * w, each product rounded
 *   k = rope(k, pos)         pairs (2i,2i+1) (llama) or (i,i+n_rot/2) (neox); c, s from THE LAYER'S OWN
 *                            table: kvb_rope_table over kvb_rope_inv_freq_layer(m, layer) (local
 *                            sliding-window layers rotate with their own base; kvb_rope_tables_layer
 *                            hands out the right one); x0' = x0*c - x1*s; x1' = x0*s + x1*c,
 *                            products rounded, no fma
 *   encode                   kvb_f32_to_row(cache dtype, row, head_dim) per (token, kv head)
 * Output rows: k_rows, v_rows (n, n_head_kv, row_bytes) in the cache dtype. deepseek2 (mla):
 *   c = W_kv_a h             (R + P) f32, the engine's matmul
 *   c[0:R] = rmsnorm(c[0:R]) * attn_kv_a_norm
 *   c[R:R+P] = rope          pairs (2i, 2i+1), the layer's table (YaRN in its frequencies)
 *   encode                   kvb_f32_to_row(cache dtype, c, R + P): k_rows (n, row_bytes); v_rows unused
 * This is the one CPU
 * implementation: the CPU engine fills its own cache with it, and the bridge reproduces it. */
typedef struct {
    const kvb_model *m;
    uint32_t layer;
    uint32_t cache_dtype;
    kvb_pool *pool;        /* may be NULL */
    const float *rope_cos; /* (n, n_rot/2) for these positions, from this layer's frequencies
                              (kvb_rope_inv_freq_layer; kvb_rope_tables_layer) */
    const float *rope_sin; /* (n, n_rot/2) likewise */
    bool test_perturb;     /* test-only: K projection as dot(first half) + dot(second half) — one
                              reordered addition — so verification can prove it detects a change */
    bool ggml;             /* the llama.cpp fidelity level (kvb_engine_opts.ggml_arith): K and V
                              projected with ggml's quantiser and dot where the weight type has them
                              (kvb_ggml_dot_type), the k-norm and the rotation as ggml computes them
                              (kvb_cpu_rmsnorm_arith, kvb_cpu_rope_arith); the tables must come
                              from ggml-mode kvb_rope_tables. Not for deepseek2's latent row. */
} kvb_kv_produce_args;
/* scratch: >= kvb_kv_produce_scratch_bytes(m, n) bytes, 64-byte aligned. */
size_t kvb_kv_produce_scratch_bytes(const kvb_model *m, uint32_t n);
void kvb_kv_produce(const kvb_kv_produce_args *a, const float *h, uint32_t n, void *scratch, uint8_t *k_rows,
                    uint8_t *v_rows);

/* ---- sampling ---------------------------------------------------------------------------- */

/* Temperature sampling, exactly: p_i = expf((logit_i - max) / temperature) as floats, ranked by p
 * descending then id ascending. top-k keeps the first k; top-p then keeps the shortest prefix whose
 * mass, summed in double in rank order, reaches top_p times the kept mass (with top-k: the k's sum
 * in rank order; without: the sum of every p_i in id order). One uniform draw r (24 bits) times the
 * kept mass picks the first kept token whose running sum (rank order; id order when nothing is cut)
 * exceeds it. Only the candidates that can be kept are ranked (a histogram of the p_i by power of
 * two finds them), not the whole vocabulary: the result is the same as ranking all of them. The
 * p_i may be computed on a pool's threads (kvb_sampler_use_pool): each p_i is the same expf, and
 * every sum keeps its order, so the picks do not change. */
typedef struct {
    float temperature; /* <= 0: greedy (argmax, lowest id on ties) */
    int top_k;         /* <= 0: off */
    float top_p;       /* >= 1: off */
    uint64_t seed;
    /* OpenAI's repetition penalties, over the tokens this sampler has picked so far (vLLM's reading:
     * the reply's tokens, not the prompt's): kvb_sample_penalized subtracts count * frequency, then
     * presence once the count is >= 1, from each such token's logit. 0, 0: off. */
    float frequency_penalty, presence_penalty;
    /* OpenAI's logit_bias: bias_values[i] added to token bias_ids[i]'s logit (ids < n_vocab) before
     * the penalties, by kvb_sample_penalized; copied at init. n_bias 0: none. */
    const int32_t *bias_ids;
    const float *bias_values;
    uint32_t n_bias;
    /* OpenAI's logprobs: when on, every pick of kvb_sample_penalized records its own log
     * probability and the top_logprobs (<= KVB_MAX_TOP_LOGPROBS) most likely tokens' in `last`. They
     * are the model's: log_softmax of the logits as given, before the bias, the penalties and the
     * temperature (vLLM's default "raw" logprobs), so they do not depend on how the pick was made. */
    bool logprobs;
    uint32_t top_logprobs;
    /* A constraint (response_format's JSON mode): kvb_sample_penalized calls it on the logits after
     * the bias and the penalties, before the pick; it sets the tokens that may not come to -inf
     * and must leave at least one finite. NULL: none. */
    void (*constrain)(void *ctx, float *logits);
    void *constrain_ctx;
} kvb_sampler_opts;

#define KVB_MAX_TOP_LOGPROBS 20
typedef struct {
    int32_t id;
    float logprob; /* natural log; -inf for a token whose probability underflows */
} kvb_id_logprob;

/* One pick's logprobs: the picked token's, and the n_top most likely tokens' (logprob descending,
 * id ascending on ties). */
typedef struct {
    kvb_id_logprob picked;
    kvb_id_logprob top[KVB_MAX_TOP_LOGPROBS];
    uint32_t n_top;
} kvb_pick_logprobs;

typedef struct {
    float p;
    int32_t id;
} kvb_prob_id;

typedef struct {
    kvb_sampler_opts o;
    kvb_rng rng;
    uint32_t n_vocab;
    kvb_prob_id *cand; /* scratch (n_vocab) */
    kvb_pool *pool;    /* NULL: one thread (kvb_sampler_use_pool) */
    uint32_t *bin_count; /* (vocab chunk, bin): each chunk's histogram of its probabilities */
    double *bin_mass;    /* (vocab chunk, bin) */
    int32_t *bias_ids;   /* (n_bias) a copy of the options' */
    float *bias_values;
    uint32_t n_bias;
    uint32_t *picked;    /* (n_vocab) times each token was picked, with penalties on; else NULL */
    int32_t *picked_ids; /* (n_picked) the distinct tokens picked, in first-pick order */
    uint32_t n_picked;
    float *raw;          /* (n_vocab) the logits as given, with logprobs and a bias or penalties on */
    kvb_pick_logprobs last; /* the last pick of kvb_sample_penalized's, with logprobs on */
} kvb_sampler;

kvb_status kvb_sampler_init(kvb_sampler *s, const kvb_sampler_opts *o, uint32_t n_vocab, kvb_err *err);
/* The probabilities are then computed by pool's threads (fixed chunks of the vocabulary; the same
 * picks as with one thread). Use it only while nothing else runs on the pool (between forwards). */
void kvb_sampler_use_pool(kvb_sampler *s, kvb_pool *pool);
void kvb_sampler_free(kvb_sampler *s);
int32_t kvb_sample(kvb_sampler *s, const float *logits);
/* With the logit bias, then the repetition penalties, then the constraint applied to logits first
 * (in place: only the biased, the picked and the constrained tokens' entries change), then
 * kvb_sample; the pick is counted. Without any of them, kvb_sample. With logprobs on, s->last then holds this pick's (from the logits as given). */
int32_t kvb_sample_penalized(kvb_sampler *s, float *logits);
/* log_softmax of logits (n) at the n_top (<= KVB_MAX_TOP_LOGPROBS) most likely tokens into top
 * (logprob descending, id ascending on ties) and at token `id` into *picked (when id >= 0): the max,
 * then sum(expf(l - max)) in id order in double, then l - max - log(sum) in double, as float. */
void kvb_logprobs_of(const float *logits, uint32_t n, int32_t id, uint32_t n_top, kvb_pick_logprobs *out);

#endif
