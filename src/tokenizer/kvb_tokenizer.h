/* tokenizer — text <-> token ids exactly as the model was trained, built from a GGUF's own
 * tokenizer.ggml.* keys: SentencePiece-style BPE ("llama": scores, byte fallback, leading space)
 * and byte-level BPE ("gpt2": merges, byte mapping) with the pre-tokenizers named by
 * tokenizer.ggml.pre; special tokens, BOS/EOS rules; streaming UTF-8-safe decoding; chat
 * templates recognised from tokenizer.chat_template; and the vocabulary writers gen-model uses
 * (copy from a GGUF, convert a Hugging Face tokenizer.json, or a plain byte-level vocabulary). */
#ifndef KVB_TOKENIZER_H
#define KVB_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_gguf.h"

typedef struct kvb_tokenizer kvb_tokenizer;

kvb_status kvb_tokenizer_load(const kvb_gguf *g, kvb_tokenizer **out, kvb_err *err);
void kvb_tokenizer_free(kvb_tokenizer *t);

uint32_t kvb_tokenizer_n_vocab(const kvb_tokenizer *t);
int32_t kvb_tokenizer_bos(const kvb_tokenizer *t);   /* -1 if none */
int32_t kvb_tokenizer_eos(const kvb_tokenizer *t);   /* -1 if none */
bool kvb_tokenizer_add_bos(const kvb_tokenizer *t);  /* tokenizer.ggml.add_bos_token (or model default) */
bool kvb_tokenizer_is_eog(const kvb_tokenizer *t, int32_t id); /* end of generation (eos, eot, im_end...) */
/* Those tokens: (*n) ids, owned by the tokenizer. */
const int32_t *kvb_tokenizer_eog_ids(const kvb_tokenizer *t, size_t *n);
/* Whether the token stands for text (normal, byte and user-defined tokens), rather than a
 * control, unknown or unused one. */
bool kvb_tokenizer_is_text(const kvb_tokenizer *t, int32_t id);
/* Longest token in bytes (a buffer of this size + 4 always holds one detokenized piece). */
uint32_t kvb_tokenizer_max_token_len(const kvb_tokenizer *t);
/* The pre-tokenizer in use ("qwen2", "llama-bpe", ...; "spm" for SentencePiece vocabularies). */
const char *kvb_tokenizer_pre_name(const kvb_tokenizer *t);
bool kvb_tokenizer_is_spm(const kvb_tokenizer *t);
/* Id of the token whose GGUF text is exactly text[0..len), or -1. */
int32_t kvb_tokenizer_find(const kvb_tokenizer *t, const char *text, size_t len);
/* Replaces a byte-level vocabulary's pre-tokenizer (tests and tools: run one vocabulary under
 * another split). Names as tokenizer.ggml.pre; "qwen2" also turns on NFC, "llama-bpe" ignore_merges. */
kvb_status kvb_tokenizer_set_pre(kvb_tokenizer *t, const char *name, kvb_err *err);

/* Encodes UTF-8 (or arbitrary) bytes. add_special: prepend BOS when the vocabulary asks for it.
 * parse_special: recognise special-token text ("<|im_start|>") in the input as those tokens.
 * *ids is malloc'd (caller frees; NULL when *n_ids is 0); never crashes on any input bytes.
 * Byte-level vocabularies see ill-formed UTF-8 as U+FFFD (one per maximal subpart, like Python's
 * errors='replace'); Qwen2 ("qwen2" pre-tokenizer) normalizes to NFC as its tokenizer.json says,
 * so decode(encode(x)) == x holds for valid UTF-8 that is NFC there and for all valid UTF-8
 * elsewhere. User-defined tokens are always matched in the text, control tokens only with
 * parse_special (longest match at the leftmost position wins). */
kvb_status kvb_tokenize(const kvb_tokenizer *t, const char *text, size_t len, bool add_special,
                        bool parse_special, int32_t **ids, size_t *n_ids, kvb_err *err);

/* Length (1..4) of the well-formed UTF-8 sequence at s[0..n), or 0 if ill-formed; for ill-formed
 * input *bad gets the length of the maximal subpart to replace with one U+FFFD (>= 1: Unicode's
 * Table 3-7, what Python's errors='replace' does). Overlongs, surrogates and code points above
 * U+10FFFF are ill-formed. The one UTF-8 check of the tokenizer and the HTTP server. */
size_t kvb_utf8_valid_len(const uint8_t *s, size_t n, size_t *bad);

/* Raw bytes a token stands for (after undoing byte mapping / ▁ / byte-fallback); returns the
 * byte count written (may be 0), or -(needed) if cap is too small. */
int kvb_token_to_bytes(const kvb_tokenizer *t, int32_t id, char *buf, size_t cap);

/* Streaming decoder: feed ids one at a time, get only complete UTF-8 out (bytes of a character
 * split across tokens are held back until it completes; invalid sequences come out as they are,
 * as soon as they cannot complete or at the latest at flush). Also applies the SentencePiece rule
 * that strips the leading space of the first piece of text. */
typedef struct {
    const kvb_tokenizer *t;
    char pending[16];
    size_t n_pending;
    bool first;
    bool show_special; /* false (init): control tokens (BOS, <|im_end|>) decode to nothing */
} kvb_detok;
void kvb_detok_init(kvb_detok *d, const kvb_tokenizer *t);
/* Writes the decoded text for id to out[0..] (NUL-terminated, at most cap-1 bytes; a piece that
 * does not fit is cut at a character boundary — cap >= kvb_tokenizer_max_token_len() + 8 never
 * cuts); returns the bytes written. */
size_t kvb_detok_push(kvb_detok *d, int32_t id, char *out, size_t cap);
size_t kvb_detok_flush(kvb_detok *d, char *out, size_t cap);

/* ---- chat templates ------------------------------------------------------------------------- */

typedef struct {
    const char *role;    /* "system", "user", "assistant" */
    const char *content;
} kvb_chat_msg;

/* Families we render without a Jinja engine. */
typedef enum {
    KVB_CHAT_LLAMA2 = 0, KVB_CHAT_LLAMA3, KVB_CHAT_CHATML, KVB_CHAT_MISTRAL, KVB_CHAT_PHI3,
    KVB_CHAT_GEMMA, KVB_CHAT_COUNT_
} kvb_chat_family;

const char *kvb_chat_family_name(kvb_chat_family f);
/* By name ("llama3", "chatml", ...); error lists the supported names. */
kvb_status kvb_chat_family_from_name(const char *name, kvb_chat_family *out, kvb_err *err);
/* Recognises the family from the template text (tokenizer.chat_template); an unknown template
 * is KVB_ERR_UNSUPPORTED with a message listing the supported families and --chat-template. */
kvb_status kvb_chat_family_detect(const char *template_text, kvb_chat_family *out, kvb_err *err);
/* Renders messages plus the generation prompt; *out is malloc'd. The text is the family's
 * reference template output without its leading {{ bos_token }}: tokenize it with
 * add_special=true (BOS by the vocabulary's rule) and parse_special=true. */
kvb_status kvb_chat_render(kvb_chat_family f, const kvb_chat_msg *msgs, size_t n_msgs,
                           bool add_generation_prompt, char **out, kvb_err *err);

/* ---- vocabulary writers for gen-model --------------------------------------------------------- */

/* Each adds the tokenizer.ggml.* keys (and tokenizer.chat_template where known) to w and
 * reports the vocabulary size. pad_to > n pads the token list with unused control tokens
 * "<|reserved_special_token_K|>" up to pad_to entries, as real models pad their embedding
 * tables (Qwen: 151669 -> 151936), so generated models keep the real shapes; 0 = no padding. */
kvb_status kvb_vocab_write_bytelevel(kvb_gguf_writer *w, uint32_t pad_to, uint32_t *n_vocab, kvb_err *err);
kvb_status kvb_vocab_copy_from_gguf(kvb_gguf_writer *w, const char *gguf_path, uint32_t pad_to,
                                    uint32_t *n_vocab, kvb_err *err);
kvb_status kvb_vocab_from_hf_json(kvb_gguf_writer *w, const char *tokenizer_json_path, uint32_t pad_to,
                                  uint32_t *n_vocab, kvb_err *err);

#endif
