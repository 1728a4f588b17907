/* fuzz/fuzz_tokenize.c — libFuzzer target for the tokenizer's encoder and streaming decoder on
 * arbitrary bytes. At start-up it builds small vocabularies in memory (a byte-level BPE with
 * merges, control and user-defined tokens, run under each pre-tokenizer we implement, and a
 * SentencePiece one with byte fallback) and, when KVB_FUZZ_VOCAB_DIR names a directory like
 * ../shared/vocab, also loads the real GGUF vocabularies there. Input byte 0 picks the vocabulary
 * and the add_special / parse_special flags; the rest is the text. Checked: no crash or
 * sanitizer report, every id in range, and decode(encode(x)) == x where that must hold (valid
 * UTF-8 on byte-level vocabularies without NFC; any bytes without U+2581 on SentencePiece),
 * without special-token parsing. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_gguf.h"
#include "kvb_tokenizer.h"

#define MAX_VOCABS 16

typedef struct {
    kvb_tokenizer *t;
    kvb_gguf *g;
    void *mem;
    int roundtrip; /* 0: none, 1: valid UTF-8 only, 2: any bytes */
} vocab;

static vocab g_v[MAX_VOCABS];
static int g_nv;

/* ---- synthetic vocabularies --------------------------------------------------------------------- */

static const char *const WORDS[] = {"the", " the", "ing", " and", "tion", "  ", "    ", "\n\n", " \n", "er", "in",
                                    "re", "on", " a", " t", "'s", "123", "00", "\xc3\xa9t\xc3\xa9", "\xe6\x97\xa5\xe6\x9c\xac",
                                    "\xf0\x9f\xa6\x99", " (", "()", "==", "\t\t", "\r\n", "Hello", " world"};

typedef struct {
    char **s;
    size_t *len;
    int32_t *type;
    float *score;
    size_t n, cap;
} toklist;

static int32_t tl_find(const toklist *l, const char *s, size_t n) {
    for (size_t i = 0; i < l->n; i++)
        if (l->len[i] == n && memcmp(l->s[i], s, n) == 0) return (int32_t)i;
    return -1;
}

static int32_t tl_add(toklist *l, const char *s, size_t n, int32_t type, float score) {
    int32_t f = tl_find(l, s, n);
    if (f >= 0) return f;
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 512;
        l->s = realloc(l->s, l->cap * sizeof *l->s);
        l->len = realloc(l->len, l->cap * sizeof *l->len);
        l->type = realloc(l->type, l->cap * sizeof *l->type);
        l->score = realloc(l->score, l->cap * sizeof *l->score);
        if (!l->s || !l->len || !l->type || !l->score) abort();
    }
    l->s[l->n] = malloc(n + 1);
    if (!l->s[l->n]) abort();
    memcpy(l->s[l->n], s, n);
    l->len[l->n] = n;
    l->type[l->n] = type;
    l->score[l->n] = score;
    return (int32_t)l->n++;
}

static void tl_free(toklist *l) {
    for (size_t i = 0; i < l->n; i++) free(l->s[i]);
    free(l->s);
    free(l->len);
    free(l->type);
    free(l->score);
}

static size_t bytelevel_char(uint8_t b, char *out) {
    uint32_t cp = b;
    bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    if (!printable) {
        uint32_t k = 0;
        for (uint32_t x = 0; x < b; x++)
            if (!((x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) k++;
        cp = 256 + k;
    }
    if (cp < 0x80) return out[0] = (char)cp, 1;
    out[0] = (char)(0xC0 | cp >> 6);
    out[1] = (char)(0x80 | (cp & 63));
    return 2;
}

static void add_to_memory(kvb_gguf_writer *w, int roundtrip, const char *pre) {
    char *buf = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&buf, &size);
    kvb_err err = {0};
    if (!f || kvb_gguf_writer_write_header(w, f, &err)) abort();
    fclose(f);
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = NULL;
    if (kvb_gguf_open_memory(buf, size, "synthetic", &g, &err) || kvb_tokenizer_load(g, &t, &err)) {
        fprintf(stderr, "fuzz_tokenize: synthetic vocabulary: %s\n", err.msg);
        abort();
    }
    if (pre && kvb_tokenizer_set_pre(t, pre, &err)) abort();
    g_v[g_nv++] = (vocab){t, g, buf, roundtrip};
}

static void build_bpe(void) {
    toklist l = {0};
    for (int b = 0; b < 256; b++) {
        char c[2];
        size_t n = bytelevel_char((uint8_t)b, c);
        tl_add(&l, c, n, 1, 0);
    }
    char **merges = NULL;
    size_t nm = 0;
    for (size_t wi = 0; wi < sizeof WORDS / sizeof WORDS[0]; wi++) {
        const char *w = WORDS[wi];
        char acc[256];
        size_t al = bytelevel_char((uint8_t)w[0], acc);
        for (size_t i = 1; w[i]; i++) {
            char c[2];
            size_t cl = bytelevel_char((uint8_t)w[i], c);
            char m[300];
            memcpy(m, acc, al);
            m[al] = ' ';
            memcpy(m + al + 1, c, cl);
            merges = realloc(merges, (nm + 1) * sizeof *merges);
            if (!merges) abort();
            merges[nm] = malloc(al + cl + 2);
            if (!merges[nm]) abort();
            memcpy(merges[nm], m, al + 1 + cl);
            merges[nm][al + 1 + cl] = 0;
            nm++;
            memcpy(acc + al, c, cl);
            al += cl;
            tl_add(&l, acc, al, 1, 0);
        }
    }
    tl_add(&l, "<|endoftext|>", 13, 3, 0);
    tl_add(&l, "<|im_start|>", 12, 3, 0);
    tl_add(&l, "<tool>", 6, 4, 0);
    static const char *const pres[] = {"gpt-2", "llama-bpe", "qwen2", "deepseek-coder"};
    for (int p = 0; p < 4; p++) {
        kvb_gguf_writer *w = NULL;
        kvb_err err = {0};
        kvb_gguf_str *ts = malloc(l.n * sizeof *ts), *ms = malloc(nm * sizeof *ms);
        if (!ts || !ms || kvb_gguf_writer_create(&w, &err)) abort();
        for (size_t i = 0; i < l.n; i++) ts[i] = (kvb_gguf_str){l.s[i], l.len[i]};
        for (size_t i = 0; i < nm; i++) ms[i] = (kvb_gguf_str){merges[i], strlen(merges[i])};
        if (kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "gpt2", &err) ||
            kvb_gguf_writer_add_str(w, "tokenizer.ggml.pre", pres[p], &err) ||
            kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", ts, l.n, &err) ||
            kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, l.type, l.n, &err) ||
            kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.merges", ms, nm, &err) ||
            kvb_gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)tl_find(&l, "<|endoftext|>", 13), &err) ||
            kvb_gguf_writer_add_bool(w, "tokenizer.ggml.add_bos_token", true, &err))
            abort();
        add_to_memory(w, p == 2 ? 0 : 1, NULL);
        kvb_gguf_writer_destroy(w);
        free(ts);
        free(ms);
    }
    for (size_t i = 0; i < nm; i++) free(merges[i]);
    free(merges);
    tl_free(&l);
}

static void build_spm(void) {
    toklist l = {0};
    tl_add(&l, "<unk>", 5, 2, 0);
    tl_add(&l, "<s>", 3, 3, 0);
    tl_add(&l, "</s>", 4, 3, 0);
    for (int b = 0; b < 256; b++) {
        char s[8];
        snprintf(s, sizeof s, "<0x%02X>", b);
        tl_add(&l, s, 6, 6, 0);
    }
    float score = -1;
    for (size_t wi = 0; wi < sizeof WORDS / sizeof WORDS[0]; wi++) {
        char esc[256];
        size_t n = 0;
        for (const char *p = WORDS[wi]; *p; p++) {
            if (*p == ' ') memcpy(esc + n, "\xe2\x96\x81", 3), n += 3;
            else esc[n++] = *p;
        }
        /* every character-aligned prefix and every single character becomes a piece */
        for (size_t i = 1; i <= n; i++) {
            if (i < n && ((uint8_t)esc[i] & 0xC0) == 0x80) continue;
            tl_add(&l, esc, i, 1, score);
            score -= 1;
        }
        for (size_t i = 0; i < n;) {
            size_t k = 1;
            while (i + k < n && ((uint8_t)esc[i + k] & 0xC0) == 0x80) k++;
            tl_add(&l, esc + i, k, 1, score);
            score -= 0.5f;
            i += k;
        }
    }
    tl_add(&l, "\xe2\x96\x81", 3, 1, -0.25f);
    kvb_gguf_writer *w = NULL;
    kvb_err err = {0};
    kvb_gguf_str *ts = malloc(l.n * sizeof *ts);
    if (!ts || kvb_gguf_writer_create(&w, &err)) abort();
    for (size_t i = 0; i < l.n; i++) ts[i] = (kvb_gguf_str){l.s[i], l.len[i]};
    if (kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "llama", &err) ||
        kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", ts, l.n, &err) ||
        kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, l.type, l.n, &err) ||
        kvb_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVB_GGUF_F32, l.score, l.n, &err))
        abort();
    add_to_memory(w, 2, NULL);
    kvb_gguf_writer_destroy(w);
    free(ts);
    tl_free(&l);
}

static void load_dir(const char *dir) {
    static const struct {
        const char *name;
        int roundtrip;
    } files[] = {{"llama-spm.gguf", 2}, {"phi-3.gguf", 0}, {"gpt-2.gguf", 1}, {"deepseek-coder.gguf", 1}};
    for (size_t i = 0; i < sizeof files / sizeof files[0] && g_nv < MAX_VOCABS; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, files[i].name);
        kvb_err err = {0};
        kvb_gguf *g = NULL;
        kvb_tokenizer *t = NULL;
        if (kvb_gguf_open(path, &g, &err) || kvb_tokenizer_load(g, &t, &err)) {
            fprintf(stderr, "fuzz_tokenize: skipping %s: %s\n", path, err.msg);
            kvb_gguf_close(g);
            continue;
        }
        g_v[g_nv++] = (vocab){t, g, NULL, files[i].roundtrip};
    }
}

static void cleanup(void) {
    for (int i = 0; i < g_nv; i++) {
        kvb_tokenizer_free(g_v[i].t);
        kvb_gguf_close(g_v[i].g);
        free(g_v[i].mem);
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    build_bpe();
    build_spm();
    const char *dir = getenv("KVB_FUZZ_VOCAB_DIR");
    if (dir) load_dir(dir);
    atexit(cleanup);
    return 0;
}

static bool valid_utf8(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint8_t c = s[i];
        size_t need;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            need = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            need = 3;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 4;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else {
            return false;
        }
        if (i + need > n) return false;
        for (size_t k = 1; k < need; k++) {
            uint8_t b = s[i + k];
            if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return false;
        }
        i += need;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || g_nv == 0) return 0;
    uint8_t sel = data[0];
    const vocab *v = &g_v[(sel & 0x0F) % g_nv];
    bool add = sel & 0x10, special = sel & 0x20;
    const char *text = (const char *)data + 1;
    size_t n = size - 1;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    kvb_err err = {0};
    if (kvb_tokenize(v->t, text, n, add, special, &ids, &n_ids, &err) != KVB_OK) abort(); /* never fails on text */
    uint32_t nv = kvb_tokenizer_n_vocab(v->t);
    for (size_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= nv) abort();
    /* stream the ids back, with an occasional tiny buffer */
    size_t cap = kvb_tokenizer_max_token_len(v->t) + 32;
    char *piece = malloc(cap), *out = malloc(n_ids * cap + cap + 1);
    if (!piece || !out) abort();
    kvb_detok d;
    kvb_detok_init(&d, v->t);
    d.show_special = sel & 0x40;
    size_t m = 0;
    for (size_t i = 0; i < n_ids; i++) {
        size_t c = (sel & 0x80) && (i & 1) ? 3 : cap;
        size_t k = kvb_detok_push(&d, ids[i], piece, c);
        if (k >= c || piece[k] != 0) abort();
        memcpy(out + m, piece, k);
        m += k;
    }
    m += kvb_detok_flush(&d, out + m, cap);
    /* SentencePiece writes spaces as U+2581, so an input U+2581 legitimately comes back as ' ' */
    bool has_2581 = n >= 3 && memmem(text, n, "\xe2\x96\x81", 3) != NULL;
    bool check = !special && !(sel & 0xC0) &&
                 ((v->roundtrip == 2 && !has_2581) || (v->roundtrip == 1 && valid_utf8(data + 1, n)));
    if (check && (m != n || memcmp(out, text, n) != 0)) {
        fprintf(stderr, "fuzz_tokenize: decode(encode(x)) != x (%zu bytes in, %zu out)\n", n, m);
        abort();
    }
    free(piece);
    free(out);
    free(ids);
    return 0;
}
