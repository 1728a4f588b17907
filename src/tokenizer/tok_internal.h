/* tokenizer/tok_internal.h — the tokenizer's private data structures shared by its files: the
 * loaded vocabulary (token texts in GGUF form and as raw bytes, types, scores, a text->id hash),
 * the byte-level BPE merge table keyed by token-id pairs, the special-token matcher, and the
 * entry points of each encoder stage (pre-tokenizers, SPM, byte-level BPE). */
#ifndef KVB_TOK_INTERNAL_H
#define KVB_TOK_INTERNAL_H

#include "kvb_tokenizer.h"

/* GGUF / llama.cpp token types */
enum {
    KVB_TT_UNDEFINED = 0,
    KVB_TT_NORMAL = 1,
    KVB_TT_UNKNOWN = 2,
    KVB_TT_CONTROL = 3,
    KVB_TT_USER_DEFINED = 4,
    KVB_TT_UNUSED = 5,
    KVB_TT_BYTE = 6,
};

typedef enum { KVB_TOKM_SPM = 0, KVB_TOKM_BPE } kvb_tok_model;

typedef enum {
    KVB_PRE_GPT2 = 0,   /* "default", "gpt-2": the GPT-2 regex */
    KVB_PRE_LLAMA3,     /* "llama-bpe", "llama3", "llama-v3", "smaug-bpe" */
    KVB_PRE_QWEN2,      /* "qwen2": Llama 3's regex with single digits, plus NFC */
    KVB_PRE_DEEPSEEK_CODER,
    KVB_PRE_NONE,       /* SPM: no pre-tokenizer */
} kvb_pre_type;

/* open-addressing hash: text -> id (slots hold id + 1; 0 = empty) */
typedef struct {
    uint32_t *slots;
    uint32_t mask;
} kvb_tok_hash;

/* (left id, right id) -> (rank, merged id) */
typedef struct {
    uint64_t *keys; /* (left << 32 | right) + 1; 0 = empty */
    uint32_t *rank;
    int32_t *out;
    uint64_t mask;
} kvb_merge_table;

struct kvb_tokenizer {
    kvb_tok_model model;
    kvb_pre_type pre;
    char pre_name[64];
    uint32_t n_vocab;
    /* GGUF text of each token (what tokenizer.ggml.tokens holds) */
    char *text_blob;
    uint32_t *text_off, *text_len;
    /* the bytes a token stands for: byte mapping / ▁ / <0xXX> undone */
    char *raw_blob;
    uint32_t *raw_off, *raw_len;
    uint8_t *type;
    float *score;          /* SPM only */
    kvb_tok_hash by_text;  /* GGUF text -> id (SPM lookups; merge parsing) */
    kvb_tok_hash by_raw;   /* raw bytes -> id for NORMAL tokens (BPE piece lookups) */
    int32_t byte_tok[256]; /* token of each single byte (BPE: mapped char; SPM: <0xXX>) or -1 */
    kvb_merge_table merges;
    uint32_t n_merges;
    /* special tokens matched in raw text: CONTROL (only with parse_special) and USER_DEFINED
     * (always); sorted by first byte, then longest first */
    int32_t *special;
    uint32_t n_special;
    uint32_t special_start[257]; /* index range in special[] per first byte */
    bool can_start[2][256];      /* [parse_special][byte]: some matchable special starts with it */
    int32_t bos, eos, unk, eot, eom;
    int32_t *eog;
    uint32_t n_eog;
    bool add_bos, add_eos, add_space_prefix, ignore_merges, nfc;
    uint64_t *spm_inner_pairs; /* SPM: (KVB_SPM_PAIR_WORDS) a bit per hashed pair of characters
                                  that stand side by side inside some mergeable token; a pair whose
                                  bit is clear is never merged across (kvb_spm_pairs_build) */
    uint32_t max_token_len; /* longest raw token, bytes */
};

/* hash helpers (vocab.c) */
int32_t kvb_tok_hash_find(const kvb_tok_hash *h, const char *blob, const uint32_t *off,
                          const uint32_t *len, const char *s, size_t n);
static inline int32_t kvb_tok_find_text(const kvb_tokenizer *t, const char *s, size_t n) {
    return kvb_tok_hash_find(&t->by_text, t->text_blob, t->text_off, t->text_len, s, n);
}
static inline int32_t kvb_tok_find_raw(const kvb_tokenizer *t, const char *s, size_t n) {
    return kvb_tok_hash_find(&t->by_raw, t->raw_blob, t->raw_off, t->raw_len, s, n);
}

/* A growable id vector used while encoding. */
typedef struct {
    int32_t *v;
    size_t n, cap;
} kvb_idvec;
kvb_status kvb_idvec_push(kvb_idvec *v, int32_t id, kvb_err *err);
kvb_status kvb_idvec_append(kvb_idvec *v, const int32_t *ids, size_t n, kvb_err *err);

/* GPT-2 byte <-> unicode mapping (bpe.c) */
uint32_t kvb_bytelevel_cp(uint8_t b);       /* the code point byte b is written as */
int kvb_bytelevel_byte(uint32_t cp);        /* inverse; -1 if cp is not a mapped byte */

/* Pre-tokenizer (pretok.c): calls emit(ctx, start, end) for each piece of the valid UTF-8 text
 * s[0..n), in order, covering all of it. Returns the first non-OK status emit returned. */
typedef kvb_status (*kvb_piece_fn)(void *ctx, size_t start, size_t end);
kvb_status kvb_pretokenize(kvb_pre_type pre, const uint8_t *s, size_t n, kvb_piece_fn emit, void *ctx);
kvb_pre_type kvb_pre_from_name(const char *name, bool *known);
const char *kvb_pre_supported_list(void);

/* Byte-level BPE of one raw text fragment (bpe.c): clean, pre-tokenize, merge, append ids. */
typedef struct kvb_bpe_ctx kvb_bpe_ctx;
kvb_status kvb_bpe_ctx_create(const kvb_tokenizer *t, kvb_bpe_ctx **out, kvb_err *err);
void kvb_bpe_ctx_free(kvb_bpe_ctx *c);
kvb_status kvb_bpe_encode_fragment(kvb_bpe_ctx *c, const uint8_t *s, size_t n, kvb_idvec *out,
                                   kvb_err *err);

/* SPM: the filter of character pairs that merging may join (t->spm_inner_pairs), from every
 * token that merging can form; with n tokens loaded (spm.c). */
#define KVB_SPM_PAIR_BITS 20
#define KVB_SPM_PAIR_WORDS ((size_t)1 << (KVB_SPM_PAIR_BITS - 6))
kvb_status kvb_spm_pairs_build(kvb_tokenizer *t, uint32_t n, kvb_err *err);
/* SentencePiece-style BPE of one raw text fragment (spm.c). */
kvb_status kvb_spm_encode_fragment(const kvb_tokenizer *t, const uint8_t *s, size_t n,
                                   bool space_prefix, kvb_idvec *out, kvb_err *err);

/* Byte-level merge table (bpe.c) */
kvb_status kvb_merge_table_build(kvb_tokenizer *t, const kvb_gguf_kv *merges, kvb_err *err);
void kvb_merge_table_free(kvb_merge_table *m);

#endif
