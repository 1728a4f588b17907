/* tokenizer/pretok.c — the byte-level BPE pre-tokenizers, written as explicit matchers over code
 * points instead of a regex engine. Each matcher answers "how long is the match at position i",
 * trying the pattern's alternatives in order exactly as a backtracking (Oniguruma) regex does,
 * including the (?!\S) look-ahead and the backtracking of \s*[\r\n]+. A Hugging Face "Split,
 * Isolated" step is modelled by split(): leftmost matches become pieces and the gaps between
 * them stay pieces too; a Sequence of splits (deepseek-coder) applies each to the previous
 * level's pieces. Patterns (from the vocabularies' tokenizer.json / llama.cpp):
 *   gpt-2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *   llama3:  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *            ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *   qwen2:   the same with \p{N} (one digit)
 *   deepseek-coder: [\r\n] | \s?\p{L}+ | \s?\p{P}+ | [一-龥ࠀ-一가-퟿]+ | \p{N}  (a sequence)
 * The input is valid UTF-8 (the caller cleans it). */
#include <string.h>

#include "tok_internal.h"
#include "tok_unicode.h"

#define END_CP 0xFFFFFFFFu

/* code point at byte i (END_CP at the end) and its length */
static inline uint32_t cp_at(const uint8_t *s, size_t n, size_t i, size_t *len) {
    if (i >= n) {
        *len = 0;
        return END_CP;
    }
    if (s[i] < 0x80) {
        *len = 1;
        return s[i];
    }
    return kvb_u_decode(s + i, n - i, len);
}

static inline uint32_t fl(uint32_t cp) { return cp == END_CP ? 0 : kvb_u_flags(cp); }
static inline bool is_l(uint32_t cp) { return fl(cp) & KVB_U_L; }
static inline bool is_n(uint32_t cp) { return fl(cp) & KVB_U_N; }
static inline bool is_ws(uint32_t cp) { return fl(cp) & KVB_U_WS; }
/* [^\s\p{L}\p{N}] */
static inline bool is_other(uint32_t cp) {
    return cp != END_CP && !(kvb_u_flags(cp) & (KVB_U_L | KVB_U_N | KVB_U_WS));
}

/* consume while pred from byte i; returns the end */
#define RUN(pred, i)                                                                         \
    do {                                                                                     \
        for (;;) {                                                                           \
            size_t l_;                                                                       \
            uint32_t c_ = cp_at(s, n, (i), &l_);                                             \
            if (!(pred(c_))) break;                                                          \
            (i) += l_;                                                                       \
        }                                                                                    \
    } while (0)

/* 's 't 're 've 'm 'll 'd at i (s[i] == '\''); case-insensitive when ci (with U+017F ſ folding
 * to s, as Unicode case folding does). Returns the match end or 0. */
static size_t contraction(const uint8_t *s, size_t n, size_t i, bool ci) {
    size_t l1, l2;
    uint32_t a = cp_at(s, n, i + 1, &l1);
    if (a == END_CP) return 0;
    uint32_t b = cp_at(s, n, i + 1 + l1, &l2);
    if (ci) {
        if (a >= 'A' && a <= 'Z') a += 32;
        if (b >= 'A' && b <= 'Z') b += 32;
        if (a == 0x17F) a = 's';
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 1 + l1;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 1 + l1 + l2;
    return 0;
}

/* \s+(?!\S) then \s+, at i where s[i] is whitespace: the run, minus its last character when a
 * non-space follows and the run is longer than one character. */
static size_t ws_tail(const uint8_t *s, size_t n, size_t i) {
    size_t j = i, last = i;
    for (;;) {
        size_t l;
        uint32_t c = cp_at(s, n, j, &l);
        if (!is_ws(c)) break;
        last = j;
        j += l;
    }
    if (j >= n) return j;      /* run reaches the end: (?!\S) holds */
    if (last > i) return last; /* give back the last whitespace */
    return j;                  /* \s+ */
}

static size_t match_gpt2(const uint8_t *s, size_t n, size_t i) {
    size_t l;
    uint32_t c = cp_at(s, n, i, &l);
    if (c == '\'') {
        size_t e = contraction(s, n, i, false);
        if (e) return e;
    }
    size_t j = c == ' ' ? i + 1 : i;
    size_t lj;
    uint32_t cj = cp_at(s, n, j, &lj);
    if (is_l(cj)) {
        RUN(is_l, j);
        return j;
    }
    if (is_n(cj)) {
        RUN(is_n, j);
        return j;
    }
    if (is_other(cj)) {
        RUN(is_other, j);
        return j;
    }
    if (is_ws(c)) return ws_tail(s, n, i);
    return i + l; /* unreachable: every character is L, N, whitespace or other */
}

static inline bool is_crlf(uint32_t c) { return c == '\r' || c == '\n'; }

static size_t match_llama3(const uint8_t *s, size_t n, size_t i, int max_digits) {
    size_t l;
    uint32_t c = cp_at(s, n, i, &l);
    /* (?i:'s|'t|'re|'ve|'m|'ll|'d) */
    if (c == '\'') {
        size_t e = contraction(s, n, i, true);
        if (e) return e;
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (is_l(c)) {
        size_t j = i;
        RUN(is_l, j);
        return j;
    }
    if (!is_crlf(c) && !is_n(c)) {
        size_t l2;
        if (is_l(cp_at(s, n, i + l, &l2))) {
            size_t j = i + l;
            RUN(is_l, j);
            return j;
        }
    }
    /* \p{N}{1,max} */
    if (is_n(c)) {
        size_t j = i;
        for (int k = 0; k < max_digits; k++) {
            size_t lk;
            if (!is_n(cp_at(s, n, j, &lk))) break;
            j += lk;
        }
        return j;
    }
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    {
        size_t j = c == ' ' ? i + 1 : i;
        size_t lj;
        if (is_other(cp_at(s, n, j, &lj))) {
            RUN(is_other, j);
            RUN(is_crlf, j);
            return j;
        }
    }
    if (is_ws(c)) {
        /* \s*[\r\n]+ : up to the last newline of the whitespace run */
        size_t j = i, after_nl = 0;
        for (;;) {
            size_t lj;
            uint32_t cj = cp_at(s, n, j, &lj);
            if (!is_ws(cj)) break;
            j += lj;
            if (is_crlf(cj)) after_nl = j;
        }
        if (after_nl) return after_nl;
        return ws_tail(s, n, i);
    }
    return i + l;
}

/* ---- deepseek-coder: a sequence of isolated splits ------------------------------------------ */

static size_t ds_newline(const uint8_t *s, size_t n, size_t i) {
    (void)n;
    return (s[i] == '\r' || s[i] == '\n') ? i + 1 : 0;
}

static size_t ds_space_class(const uint8_t *s, size_t n, size_t i, uint32_t cls) {
    size_t l, l2;
    uint32_t c = cp_at(s, n, i, &l);
    size_t j = i;
    if (fl(c) & cls) {
        /* \s? fails to consume a non-space; fine */
    } else if (is_ws(c) && (fl(cp_at(s, n, i + l, &l2)) & cls)) {
        j = i + l;
    } else {
        return 0;
    }
    for (;;) {
        size_t lk;
        uint32_t ck = cp_at(s, n, j, &lk);
        if (!(fl(ck) & cls)) break;
        j += lk;
    }
    return j;
}
static size_t ds_letters(const uint8_t *s, size_t n, size_t i) { return ds_space_class(s, n, i, KVB_U_L); }
static size_t ds_punct(const uint8_t *s, size_t n, size_t i) { return ds_space_class(s, n, i, KVB_U_P); }
static inline bool ds_is_cjk(uint32_t c) {
    return (c >= 0x4E00 && c <= 0x9FA5) || (c >= 0x0800 && c <= 0x4E00) || (c >= 0xAC00 && c <= 0xD7FF);
}
static size_t ds_cjk(const uint8_t *s, size_t n, size_t i) {
    size_t j = i;
    RUN(ds_is_cjk, j);
    return j > i ? j : 0;
}
static size_t ds_digit(const uint8_t *s, size_t n, size_t i) {
    size_t l;
    return is_n(cp_at(s, n, i, &l)) ? i + l : 0;
}

typedef size_t (*matcher_fn)(const uint8_t *s, size_t n, size_t i);

static size_t m_gpt2(const uint8_t *s, size_t n, size_t i) { return match_gpt2(s, n, i); }
static size_t m_llama3(const uint8_t *s, size_t n, size_t i) { return match_llama3(s, n, i, 3); }
static size_t m_qwen2(const uint8_t *s, size_t n, size_t i) { return match_llama3(s, n, i, 1); }

typedef struct {
    const matcher_fn *levels;
    int n_levels;
    const uint8_t *s;
    kvb_piece_fn emit;
    void *ctx;
} split_ctx;

/* Splits s[a..b) with level lv's pattern (matches see s[a..b) as the whole string), passing
 * every match and every gap to the next level. */
static kvb_status split(split_ctx *c, int lv, size_t a, size_t b) {
    if (lv == c->n_levels) return c->emit(c->ctx, a, b);
    const uint8_t *s = c->s + a;
    size_t n = b - a, gap = 0, i = 0;
    kvb_status st;
    while (i < n) {
        size_t e = c->levels[lv](s, n, i);
        if (e > i) {
            if (gap < i && (st = split(c, lv + 1, a + gap, a + i))) return st;
            if ((st = split(c, lv + 1, a + i, a + e))) return st;
            i = gap = e;
        } else {
            size_t l;
            cp_at(s, n, i, &l);
            i += l;
        }
    }
    if (gap < n) return split(c, lv + 1, a + gap, a + n);
    return KVB_OK;
}

/* The single-regex pre-tokenizers match at every position, so pieces are back to back. */
static kvb_status split_total(const uint8_t *s, size_t n, matcher_fn m, kvb_piece_fn emit, void *ctx) {
    size_t i = 0;
    while (i < n) {
        size_t e = m(s, n, i);
        if (e <= i || e > n) e = i + 1; /* cannot happen; guarantees progress */
        kvb_status st = emit(ctx, i, e);
        if (st) return st;
        i = e;
    }
    return KVB_OK;
}

kvb_status kvb_pretokenize(kvb_pre_type pre, const uint8_t *s, size_t n, kvb_piece_fn emit, void *ctx) {
    switch (pre) {
    case KVB_PRE_GPT2: return split_total(s, n, m_gpt2, emit, ctx);
    case KVB_PRE_LLAMA3: return split_total(s, n, m_llama3, emit, ctx);
    case KVB_PRE_QWEN2: return split_total(s, n, m_qwen2, emit, ctx);
    case KVB_PRE_DEEPSEEK_CODER: {
        static const matcher_fn lv[] = {ds_newline, ds_letters, ds_punct, ds_cjk, ds_digit};
        split_ctx c = {lv, 5, s, emit, ctx};
        return split(&c, 0, 0, n);
    }
    case KVB_PRE_NONE:
    default:
        return n ? emit(ctx, 0, n) : KVB_OK;
    }
}

static const struct {
    const char *name;
    kvb_pre_type pre;
} pre_names[] = {
    {"default", KVB_PRE_GPT2},       {"gpt-2", KVB_PRE_GPT2},        {"gpt2", KVB_PRE_GPT2},
    {"llama-bpe", KVB_PRE_LLAMA3},   {"llama3", KVB_PRE_LLAMA3},     {"llama-v3", KVB_PRE_LLAMA3},
    {"smaug-bpe", KVB_PRE_LLAMA3},   {"qwen2", KVB_PRE_QWEN2},       {"deepseek-coder", KVB_PRE_DEEPSEEK_CODER},
};

kvb_pre_type kvb_pre_from_name(const char *name, bool *known) {
    for (size_t i = 0; i < KVB_ARRAY_LEN(pre_names); i++)
        if (strcmp(name, pre_names[i].name) == 0) {
            *known = true;
            return pre_names[i].pre;
        }
    *known = false;
    return KVB_PRE_GPT2;
}

const char *kvb_pre_supported_list(void) {
    return "default, gpt-2, llama-bpe (llama3, llama-v3, smaug-bpe), qwen2, deepseek-coder";
}
