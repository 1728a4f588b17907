/* tests/support/greedy_text.c — see greedy_text.h. */
#include "greedy_text.h"

#include <string.h>

int kvbt_greedy_text(const kvb_tokenizer *tok, uint32_t n_vocab, float *logits, int n_gen, kvbt_step_fn step,
                     void *ctx, char *out, size_t cap, char *err, size_t err_cap) {
    kvb_detok dt;
    kvb_detok_init(&dt, tok);
    size_t used = 0;
    if (cap) out[0] = 0;
    for (int i = 0; i < n_gen; i++) {
        int32_t next = 0;
        for (uint32_t k = 1; k < n_vocab; k++)
            if (logits[k] > logits[next]) next = (int32_t)k;
        if (kvb_tokenizer_is_eog(tok, next)) break;
        char piece[512];
        const size_t k = kvb_detok_push(&dt, next, piece, sizeof piece);
        if (used + k < cap) {
            memcpy(out + used, piece, k);
            used += k;
            out[used] = 0;
        }
        if (i + 1 < n_gen) {
            const int rc = step(ctx, next, logits, err, err_cap);
            if (rc) return rc;
        }
    }
    return 0;
}
