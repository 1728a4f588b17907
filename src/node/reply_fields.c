/* node/reply_fields.c — the optional parts of a decode node's reply: each token's logprobs (its
 * bytes from the vocabulary beside the sampler's numbers), an echoed prompt with every prompt
 * token's logprob (the whole prompt through the engine with all its rows' logits), and the rules
 * the sampler draws under (min_tokens, the JSON mode with or without a JSON schema: the schema
 * travels in the recognizer's state). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "node_internal.h"

_Static_assert(KVB_HTTP_MAX_TOP_LOGPROBS <= KVB_MAX_TOP_LOGPROBS, "the sampler keeps every top logprob asked for");

kvb_status kvb_reply_send_logprobs(const kvb_tokenizer *tok, kvb_completion_out *out, const kvb_pick_logprobs *lp,
                                   bool unconditioned, char *scratch) {
    const size_t cap = kvb_tokenizer_max_token_len(tok);
    kvb_token_logprob picked, top[KVB_MAX_TOP_LOGPROBS];
    const kvb_id_logprob *src[1 + KVB_MAX_TOP_LOGPROBS];
    kvb_token_logprob *dst[1 + KVB_MAX_TOP_LOGPROBS];
    src[0] = &lp->picked;
    dst[0] = &picked;
    for (uint32_t i = 0; i < lp->n_top; i++) {
        src[1 + i] = &lp->top[i];
        dst[1 + i] = &top[i];
    }
    for (uint32_t i = 0; i <= lp->n_top; i++) {
        char *b = scratch + (size_t)i * cap; // (1 + KVB_MAX_TOP_LOGPROBS, cap)
        const int len = kvb_token_to_bytes(tok, src[i]->id, b, cap);
        *dst[i] = (kvb_token_logprob){.bytes = b, .n_bytes = len > 0 ? (size_t)len : 0, .logprob = src[i]->logprob};
    }
    picked.unconditioned = unconditioned;
    return kvb_completion_add_logprobs(out, &picked, top, lp->n_top);
}

#define PROMPT_LOGPROB_ROWS 64 /* prompt rows whose logits are held at once: (64, n_vocab) floats */

typedef struct {
    const float *rows;       // (row, n_vocab)
    const int32_t *next;     // (row) the token each row predicts
    uint32_t n_vocab, top;
    kvb_pick_logprobs *out;  // (row)
} row_logprobs_job;

static void row_logprobs(void *ctx, int t, int worker) {
    (void)worker;
    const row_logprobs_job *j = ctx;
    kvb_logprobs_of(j->rows + (size_t)t * j->n_vocab, j->n_vocab, j->next[t], j->top, &j->out[t]);
}

kvb_status kvb_reply_prompt_logprobs(kvb_engine *e, kvb_decode_batch *batch, const kvb_tokenizer *tok, uint32_t n_vocab,
                                     kvb_seq *s, const int32_t *toks, uint32_t n_toks, uint32_t top, float *logits,
                                     kvb_completion_out *out, char *scratch, kvb_err *err) {
    float *rows = malloc(sizeof(float) * PROMPT_LOGPROB_ROWS * n_vocab); // (row, n_vocab)
    kvb_pick_logprobs *lps = malloc(sizeof *lps * PROMPT_LOGPROB_ROWS);   // (row)
    if (!rows || !lps) {
        free(rows);
        free(lps);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory for the prompt's logits");
    }
    kvb_pick_logprobs first = {.picked = {.id = toks[0]}};
    kvb_status st = kvb_reply_send_logprobs(tok, out, &first, true, scratch);
    for (uint32_t done = 0; !st && done < n_toks;) {
        if (kvb_completion_cancelled(out)) {
            st = kvb_err_set(err, KVB_ERR_IO, "the client went away");
            break;
        }
        const uint32_t c = KVB_MIN(PROMPT_LOGPROB_ROWS, n_toks - done);
        if ((st = kvb_engine_forward(e, s, toks + done, c, rows, true, err))) break;
        const bool last = done + c == n_toks; /* the last row predicts the reply, not a prompt token */
        const uint32_t scored = last ? c - 1 : c;
        row_logprobs_job job = {.rows = rows, .next = toks + done + 1, .n_vocab = n_vocab, .top = top, .out = lps};
        kvb_pool_parallel_for(kvb_engine_pool(e), (int)scored, row_logprobs, &job);
        for (uint32_t r = 0; !st && r < scored; r++)
            if (kvb_reply_send_logprobs(tok, out, &lps[r], false, scratch))
                st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory recording the prompt's logprobs");
        if (last) memcpy(logits, rows + (size_t)(c - 1) * n_vocab, sizeof(float) * n_vocab);
        done += c;
        kvb_decode_batch_run_pending(batch);
    }
    free(rows);
    free(lps);
    return st;
}

kvb_status kvb_reply_emit_echo(const kvb_tokenizer *tok, const kvb_completion_req *req, const int32_t *toks, size_t n_tok,
                               kvb_completion_out *out) {
    if (req->prompt) return kvb_completion_emit(out, req->prompt);
    kvb_detok dt;
    kvb_detok_init(&dt, tok);
    char piece[1024];
    kvb_status st = KVB_OK;
    for (size_t i = 0; !st && i <= n_tok; i++) {
        if (i < n_tok) kvb_detok_push(&dt, toks[i], piece, sizeof piece);
        else kvb_detok_flush(&dt, piece, sizeof piece);
        st = kvb_completion_emit(out, piece);
    }
    return st;
}

void kvb_reply_constrain(void *ctx, float *logits) {
    kvb_reply_rules *r = ctx;
    if (r->generated < r->min_tokens) {
        for (size_t i = 0; i < r->n_eog; i++) logits[r->eog_ids[i]] = -INFINITY;
        for (size_t i = 0; i < r->n_stop; i++) logits[r->stop_ids[i]] = -INFINITY;
    }
    if (r->masker) kvb_json_masker_apply(r->masker, &r->s, logits);
}
