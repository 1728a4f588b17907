/* grammar — constrained decoding for OpenAI's response_format {"type": "json_object"}: a JSON
 * prefix recognizer and the vocabulary mask it implies at each step. The recognizer reads a
 * reply byte by byte (a pushdown automaton: the containers open so far as a bit stack, the
 * lexical state beside it) and accepts exactly the prefixes of RFC 8259 texts whose value is an
 * object, starting at its '{' (no blanks before it), nested at most KVB_JSON_MAX_DEPTH deep, with
 * runs of whitespace of at most KVB_JSON_MAX_WS bytes (a model cannot stall in blanks). The mask
 * allows a token when every byte it stands for keeps the reply such a prefix; a token that is not
 * text (a control token) only when it ends generation and the object is complete. Strings are
 * checked as JSON strings (escapes, no control bytes); bytes >= 0x80 inside them are passed
 * through (a token may hold part of a character). */
#ifndef KVB_GRAMMAR_H
#define KVB_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_tokenizer.h"

#define KVB_JSON_MAX_DEPTH 64
#define KVB_JSON_MAX_WS 32

typedef struct {
    uint64_t stack;  /* bit d: container at depth d is an object (1) or an array (0) */
    uint8_t depth;   /* containers open */
    uint8_t state;   /* lexical state (json_prefix.c) */
    uint8_t aux;     /* literal: which and how far; \u escape: hex digits read */
    uint8_t ws_run;  /* whitespace bytes in a row */
} kvb_json_state;

void kvb_json_init(kvb_json_state *s);
/* Feeds bytes[0..n). True when the reply is still a prefix; false, with *s undefined, when not. */
bool kvb_json_feed(kvb_json_state *s, const char *bytes, size_t n);
/* The object is closed: the reply is a complete JSON text (nothing may follow). */
bool kvb_json_complete(const kvb_json_state *s);

/* ---- the vocabulary as the mask reads it ------------------------------------------------ */

typedef enum { KVB_VOCAB_TEXT = 0, KVB_VOCAB_EOG, KVB_VOCAB_OTHER } kvb_vocab_kind;
typedef struct kvb_vocab_bytes kvb_vocab_bytes;

/* Every token's bytes and kind, read once from the tokenizer (text tokens: their bytes; an
 * end-of-generation control token: EOG; other control tokens: OTHER). */
kvb_status kvb_vocab_bytes_create(const kvb_tokenizer *t, kvb_vocab_bytes **out, kvb_err *err);
/* The same from lists (n tokens; bytes[i] of lens[i] bytes, kinds[i]): tests and tools. */
kvb_status kvb_vocab_bytes_from_lists(const char *const *bytes, const uint32_t *lens, const uint8_t *kinds,
                                      uint32_t n, kvb_vocab_bytes **out, kvb_err *err);
void kvb_vocab_bytes_free(kvb_vocab_bytes *v);
uint32_t kvb_vocab_bytes_n(const kvb_vocab_bytes *v);
/* Feeds token id's bytes to s: true when the reply is still a prefix. A token that is not text,
 * or of no bytes, never continues it (false). */
bool kvb_json_feed_token(kvb_json_state *s, const kvb_vocab_bytes *v, int32_t id);

/* The mask a state implies, applied to a reply's logits. One per reply (not thread-safe); v and
 * pool must outlive it. Masks are remembered for the last KVB_JSON_MASK_CACHE states: a reply
 * inside a string, or between the members of one object, meets one state step after step, and a
 * state seen before costs one pass over the logits instead of the vocabulary's bytes. */
#define KVB_JSON_MASK_CACHE 8
typedef struct kvb_json_masker kvb_json_masker;
kvb_status kvb_json_masker_create(const kvb_vocab_bytes *v, kvb_pool *pool, kvb_json_masker **out, kvb_err *err);
void kvb_json_masker_free(kvb_json_masker *m);
/* logits (n_vocab of v): every token that may not follow s set to -inf; returns how many may. A
 * text token of no bytes never may (it would not move the reply on). When none may, the
 * end-of-generation tokens are left as they were (the reply ends there, honestly unfinished).
 * The tokens are tried in fixed chunks of the vocabulary on the pool's threads (NULL: this
 * thread): the same result either way, and the same whether the mask was remembered or not. */
uint32_t kvb_json_masker_apply(kvb_json_masker *m, const kvb_json_state *s, float *logits);

#endif
