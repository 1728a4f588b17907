/* tests/support/greedy_text.h — greedy generation as text for tests, whatever engine computes the
 * logits (the CPU engine, the CUDA engine): argmax, detokenise, feed the token back. */
#ifndef KVBT_GREEDY_TEXT_H
#define KVBT_GREEDY_TEXT_H

#include <stddef.h>
#include <stdint.h>

#include "kvb_tokenizer.h"

/* One decode step of the caller's engine: runs token `next` and writes the logits of what follows
 * into logits (n_vocab). Returns 0, or non-zero on failure (with its message in err, cap bytes). */
typedef int (*kvbt_step_fn)(void *ctx, int32_t next, float *logits, char *err, size_t cap);

/* From logits (n_vocab, the prompt's last token's; overwritten), up to n_gen greedy tokens, stopping
 * before an end-of-generation token; their text into out (cap bytes, NUL-terminated, cut at cap).
 * Returns 0, or the step's failure (its message in err). */
int kvbt_greedy_text(const kvb_tokenizer *tok, uint32_t n_vocab, float *logits, int n_gen, kvbt_step_fn step,
                     void *ctx, char *out, size_t cap, char *err, size_t err_cap);

#endif
