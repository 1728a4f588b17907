/* tokenizer/vocab_write.c — the vocabularies `kvbridge gen-model` puts into generated models:
 * a minimal byte-level vocabulary (256 byte tokens in GPT-2's byte mapping, no merges, BOS/EOS
 * and ChatML control tokens and a ChatML template), a verbatim copy of another GGUF's
 * tokenizer.* keys (validated by loading it first), and a conversion of a Hugging Face
 * tokenizer.json (byte-level BPE: Qwen2/3, Llama 3, GPT-2, deepseek-coder) into the keys
 * llama.cpp's converter would write, including tokenizer.chat_template and the BOS/EOS/pad
 * tokens from a tokenizer_config.json found next to it. The JSON is untrusted: types, id
 * ranges and duplicates are checked. */
#include <cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"
#include "tok_unicode.h"

#define MAX_JSON_BYTES (1u << 30)
#define MAX_HF_VOCAB (1u << 24)

/* ---- padding ------------------------------------------------------------------------------------ */

#define RESERVED_PREFIX "<|reserved_special_token_"

/* Extends (toks, types) of n entries to pad_to entries with control tokens
 * "<|reserved_special_token_K|>", K continuing after any such token already present. The new
 * arrays and the text storage are malloc'd (*text_buf); with pad_to <= n they are plain copies. */
static kvb_status pad_vocab(const kvb_gguf_str *toks, const int32_t *types, uint32_t n, uint32_t pad_to,
                            kvb_gguf_str **out_toks, int32_t **out_types, uint32_t *out_n, char **text_buf,
                            kvb_err *err) {
    uint32_t m = pad_to > n ? pad_to : n;
    if (m > (1u << 24)) return kvb_err_set(err, KVB_ERR_RANGE, "vocabulary padded to %u tokens is too large", m);
    *out_toks = malloc((size_t)m * sizeof **out_toks);
    *out_types = malloc((size_t)m * sizeof **out_types);
    *text_buf = malloc((size_t)(m - n) * 48 + 1);
    if (!*out_toks || !*out_types || !*text_buf) {
        free(*out_toks);
        free(*out_types);
        free(*text_buf);
        *out_toks = NULL, *out_types = NULL, *text_buf = NULL;
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory padding the vocabulary");
    }
    memcpy(*out_toks, toks, (size_t)n * sizeof *toks);
    memcpy(*out_types, types, (size_t)n * sizeof *types);
    uint64_t k = 0;
    size_t pl = sizeof RESERVED_PREFIX - 1;
    for (uint32_t i = 0; i < n; i++) {
        if (toks[i].len <= pl || memcmp(toks[i].ptr, RESERVED_PREFIX, pl) != 0) continue;
        uint64_t v = 0;
        size_t j = pl;
        while (j < toks[i].len && toks[i].ptr[j] >= '0' && toks[i].ptr[j] <= '9' && v < (1u << 30))
            v = v * 10 + (uint64_t)(toks[i].ptr[j++] - '0');
        if (j > pl && v + 1 > k) k = v + 1;
    }
    char *p = *text_buf;
    for (uint32_t i = n; i < m; i++, k++) {
        int l = snprintf(p, 48, RESERVED_PREFIX "%llu|>", (unsigned long long)k);
        (*out_toks)[i].ptr = p;
        (*out_toks)[i].len = (uint64_t)l;
        (*out_types)[i] = KVB_TT_CONTROL;
        p += l + 1;
    }
    *out_n = m;
    return KVB_OK;
}

/* ---- byte-level ---------------------------------------------------------------------------------- */

static const char chatml_template[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

kvb_status kvb_vocab_write_bytelevel(kvb_gguf_writer *w, uint32_t pad_to, uint32_t *n_vocab, kvb_err *err) {
    static const char *const extra[] = {"<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"};
    enum { N = 256 + 4 };
    char bytes[256][4];
    kvb_gguf_str toks[N];
    int32_t types[N];
    for (int b = 0; b < 256; b++) {
        size_t l = kvb_u_encode(kvb_bytelevel_cp((uint8_t)b), (uint8_t *)bytes[b]);
        toks[b].ptr = bytes[b];
        toks[b].len = l;
        types[b] = KVB_TT_NORMAL;
    }
    for (int i = 0; i < 4; i++) {
        toks[256 + i].ptr = extra[i];
        toks[256 + i].len = strlen(extra[i]);
        types[256 + i] = KVB_TT_CONTROL;
    }
    kvb_gguf_str *pt = NULL;
    int32_t *ptypes = NULL;
    char *pbuf = NULL;
    uint32_t m = 0;
    kvb_status st = pad_vocab(toks, types, N, pad_to, &pt, &ptypes, &m, &pbuf, err);
    if (st) return st;
    if ((st = kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "gpt2", err)) ||
        (st = kvb_gguf_writer_add_str(w, "tokenizer.ggml.pre", "default", err)) ||
        (st = kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", pt, m, err)) ||
        (st = kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, ptypes, m, err)) ||
        (st = kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.merges", NULL, 0, err)) ||
        (st = kvb_gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", 256, err)) ||
        (st = kvb_gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", 257, err)) ||
        (st = kvb_gguf_writer_add_bool(w, "tokenizer.ggml.add_bos_token", true, err)) ||
        (st = kvb_gguf_writer_add_bool(w, "tokenizer.ggml.add_eos_token", false, err)) ||
        (st = kvb_gguf_writer_add_str(w, "tokenizer.chat_template", chatml_template, err)))
        goto done;
    *n_vocab = m;
done:
    free(pt);
    free(ptypes);
    free(pbuf);
    return st;
}

/* ---- copy from a GGUF ---------------------------------------------------------------------------- */

kvb_status kvb_vocab_copy_from_gguf(kvb_gguf_writer *w, const char *gguf_path, uint32_t pad_to, uint32_t *n_vocab,
                                    kvb_err *err) {
    kvb_gguf *g = NULL;
    kvb_tokenizer *t = NULL;
    kvb_gguf_str *views = NULL, *pt = NULL;
    int32_t *types = NULL, *ptypes = NULL;
    float *scores = NULL;
    char *pbuf = NULL;
    uint32_t m = 0;
    kvb_status st = kvb_gguf_open(gguf_path, &g, err);
    if (st) return st;
    if ((st = kvb_tokenizer_load(g, &t, err))) goto done;
    uint32_t n = t->n_vocab;
    bool pad = pad_to > n;
    if (pad) {
        /* the token list, types and scores are rewritten with the padding; the rest is copied */
        const kvb_gguf_kv *kv = kvb_gguf_find(g, "tokenizer.ggml.tokens");
        views = malloc((size_t)n * sizeof *views);
        types = malloc((size_t)n * sizeof *types);
        if (!views || !types) {
            st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory copying a vocabulary");
            goto done;
        }
        if ((st = kvb_gguf_arr_strings(kv, views, err))) goto done;
        for (uint32_t i = 0; i < n; i++) types[i] = t->type[i];
        if ((st = pad_vocab(views, types, n, pad_to, &pt, &ptypes, &m, &pbuf, err))) goto done;
        if ((st = kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", pt, m, err)) ||
            (st = kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, ptypes, m, err)))
            goto done;
        if (t->score && kvb_gguf_find(g, "tokenizer.ggml.scores")) {
            scores = calloc(m, sizeof *scores);
            if (!scores) {
                st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory copying a vocabulary");
                goto done;
            }
            memcpy(scores, t->score, (size_t)n * sizeof *scores);
            if ((st = kvb_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVB_GGUF_F32, scores, m, err))) goto done;
        }
    }
    for (uint64_t i = 0; i < kvb_gguf_n_kv(g); i++) {
        const kvb_gguf_kv *kv = kvb_gguf_kv_at(g, i);
        if (kv->key.len < 10 || memcmp(kv->key.ptr, "tokenizer.", 10) != 0) continue;
        if (pad && (kvb_gguf_str_eq(kv->key, "tokenizer.ggml.tokens") || kvb_gguf_str_eq(kv->key, "tokenizer.ggml.token_type") ||
                    kvb_gguf_str_eq(kv->key, "tokenizer.ggml.scores")))
            continue;
        if ((st = kvb_gguf_writer_copy_kv(w, kv, err))) goto done;
    }
    *n_vocab = pad ? m : n;
done:
    if (st) kvb_err_prefix(err, "copying the vocabulary of %s: ", gguf_path);
    free(views);
    free(types);
    free(pt);
    free(ptypes);
    free(pbuf);
    free(scores);
    kvb_tokenizer_free(t);
    kvb_gguf_close(g);
    return st;
}

/* ---- Hugging Face tokenizer.json ---------------------------------------------------------------- */

static kvb_status read_file(const char *path, char **out, size_t *n, kvb_err *err) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return kvb_err_set(err, KVB_ERR_IO, "cannot open %s", path);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    if (!buf) {
        fclose(f);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory reading %s", path);
    }
    for (;;) {
        if (len == cap) {
            if (cap >= MAX_JSON_BYTES) {
                free(buf);
                fclose(f);
                return kvb_err_set(err, KVB_ERR_RANGE, "%s is larger than %u bytes", path, MAX_JSON_BYTES);
            }
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                fclose(f);
                return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory reading %s", path);
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + len, 1, cap - len, f);
        len += r;
        if (r == 0) break;
    }
    bool bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return kvb_err_set(err, KVB_ERR_IO, "error reading %s", path);
    }
    *out = buf;
    *n = len;
    return KVB_OK;
}

static cJSON *parse_json(const char *path, kvb_err *err, kvb_status *st) {
    char *buf = NULL;
    size_t n = 0;
    *st = read_file(path, &buf, &n, err);
    if (*st) return NULL;
    cJSON *j = cJSON_ParseWithLength(buf, n);
    free(buf);
    if (!j) *st = kvb_err_set(err, KVB_ERR_FORMAT, "%s is not valid JSON", path);
    return j;
}

/* The pre-tokenizer regexes we implement, as they appear in tokenizer.json files. */
static const char re_gpt2[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char re_llama3[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                                "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char re_qwen2[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
                               "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char *const re_deepseek_coder[] = {"[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+",
                                                "[\xe4\xb8\x80-\xe9\xbe\xa5\xe0\xa0\x80-\xe4\xb8\x80\xea\xb0\x80-\xed\x9f\xbf]+",
                                                "\\p{N}"};

static const char *split_regex(const cJSON *pt) {
    if (!cJSON_IsObject(pt)) return NULL;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(pt, "type");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "Split") != 0) return NULL;
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(pt, "pattern");
    const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
    return cJSON_IsString(re) ? re->valuestring : NULL;
}

/* Names the pre-tokenizer (llama.cpp's tokenizer.ggml.pre) from the pre_tokenizer section. */
static kvb_status detect_pre(const cJSON *root, const char *path, const char **pre, kvb_err *err) {
    const cJSON *pt = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(pt, "type");
    if (cJSON_IsString(type) && strcmp(type->valuestring, "ByteLevel") == 0) {
        const cJSON *ur = cJSON_GetObjectItemCaseSensitive(pt, "use_regex");
        if (!cJSON_IsFalse(ur)) {
            *pre = "gpt-2";
            return KVB_OK;
        }
    }
    if (cJSON_IsString(type) && strcmp(type->valuestring, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(pt, "pretokenizers");
        const char *res[8];
        int n = 0;
        bool bytelevel = false;
        const cJSON *it;
        cJSON_ArrayForEach(it, list) {
            const char *re = split_regex(it);
            if (re && n < 8) res[n++] = re;
            const cJSON *ty = cJSON_GetObjectItemCaseSensitive(it, "type");
            if (cJSON_IsString(ty) && strcmp(ty->valuestring, "ByteLevel") == 0) bytelevel = true;
        }
        if (bytelevel && n == 1 && strcmp(res[0], re_qwen2) == 0) *pre = "qwen2";
        else if (bytelevel && n == 1 && strcmp(res[0], re_llama3) == 0) *pre = "llama-bpe";
        else if (bytelevel && n == 1 && strcmp(res[0], re_gpt2) == 0) *pre = "gpt-2";
        else if (bytelevel && n == 5) {
            bool same = true;
            for (int i = 0; i < 5; i++) same = same && strcmp(res[i], re_deepseek_coder[i]) == 0;
            if (!same) goto unknown;
            *pre = "deepseek-coder";
        } else {
            goto unknown;
        }
        return KVB_OK;
    }
unknown:
    return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                       "%s: the pre_tokenizer is not one we implement (byte-level BPE with the GPT-2, "
                       "Llama 3, Qwen2 or deepseek-coder split)",
                       path);
}

/* tokenizer_config.json next to tokenizer.json ("X-tokenizer.json" -> "X-tokenizer_config.json") */
static char *config_path(const char *path) {
    size_t n = strlen(path);
    const char suffix[] = "tokenizer.json";
    size_t sl = sizeof suffix - 1;
    char *p;
    if (n >= sl && strcmp(path + n - sl, suffix) == 0) {
        p = malloc(n + 8);
        if (!p) return NULL;
        memcpy(p, path, n - sl);
        strcpy(p + n - sl, "tokenizer_config.json");
        return p;
    }
    const char *slash = strrchr(path, '/');
    size_t d = slash ? (size_t)(slash - path + 1) : 0;
    p = malloc(d + 32);
    if (!p) return NULL;
    memcpy(p, path, d);
    strcpy(p + d, "tokenizer_config.json");
    return p;
}

/* "<|im_end|>" or {"content": "<|im_end|>", ...} */
static const char *token_text(const cJSON *v) {
    if (cJSON_IsString(v)) return v->valuestring;
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(v, "content");
    return cJSON_IsString(c) ? c->valuestring : NULL;
}

typedef struct {
    kvb_gguf_str *toks;
    int32_t *types;
    uint32_t n;
} hf_vocab;

static int32_t find_token(const hf_vocab *v, const char *s) {
    if (!s) return -1;
    size_t l = strlen(s);
    for (uint32_t i = v->n; i-- > 0;) /* added tokens sit at the end */
        if (v->toks[i].len == l && v->toks[i].ptr && memcmp(v->toks[i].ptr, s, l) == 0) return (int32_t)i;
    return -1;
}

static bool id_of(const cJSON *j, uint32_t *out) {
    if (!cJSON_IsNumber(j)) return false;
    double d = j->valuedouble;
    if (!(d >= 0 && d < MAX_HF_VOCAB) || d != (double)(uint32_t)d) return false;
    *out = (uint32_t)d;
    return true;
}

/* A tokenizer.json being converted: what the later keys are made of. The strings point into the
 * parsed JSON (root and cfg) or into the buffers here. */
typedef struct {
    hf_vocab v;
    char *pad_buf;       /* the "[PADn]" texts of the holes */
    kvb_gguf_str *merges; /* (n_merges) "a b" */
    char *merge_buf;     /* the "a b" texts of the merges given as pairs */
    int n_merges;
    cJSON *cfg; /* tokenizer_config.json, or NULL */
    int32_t bos, eos, pad;
    bool add_bos, add_eos;
    const char *tmpl; /* the chat template, or NULL */
} hf_conv;

/* What we cannot reproduce is refused rather than converted into a vocabulary that would
 * tokenize differently: a normalizer other than Qwen2's NFC, a ByteLevel prefix space. */
static kvb_status hf_check_supported(const cJSON *root, const char *path, const char *pre, kvb_err *err) {
    const cJSON *norm = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
    const cJSON *nt = cJSON_GetObjectItemCaseSensitive(norm, "type");
    bool nfc = cJSON_IsString(nt) && strcmp(nt->valuestring, "NFC") == 0;
    if (norm && !cJSON_IsNull(norm) && !(nfc && strcmp(pre, "qwen2") == 0))
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: normalizer '%s' is not supported with the %s pre-tokenizer",
                           path, cJSON_IsString(nt) ? nt->valuestring : "?", pre);
    if (!nfc && strcmp(pre, "qwen2") == 0)
        kvb_log(KVB_LOG_WARN, "%s: Qwen2 split without its NFC normalizer; kvbridge normalizes to NFC", path);
    const char *txt = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"));
    bool prefix = txt && strstr(txt, "\"add_prefix_space\":true");
    cJSON_free((void *)txt);
    if (prefix) return kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: ByteLevel add_prefix_space=true is not supported", path);
    return KVB_OK;
}

/* Unused "[PADn]" tokens for the ids that neither the vocab nor the added tokens give. */
static kvb_status hf_fill_holes(hf_conv *c, const char *path, kvb_err *err) {
    uint32_t holes = 0;
    for (uint32_t i = 0; i < c->v.n; i++) holes += !c->v.toks[i].ptr;
    if (!holes) return KVB_OK;
    c->pad_buf = malloc((size_t)holes * 20);
    if (!c->pad_buf) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory converting %s", path);
    char *p = c->pad_buf;
    for (uint32_t i = 0; i < c->v.n; i++) {
        if (c->v.toks[i].ptr) continue;
        int l = snprintf(p, 20, "[PAD%" PRIu32 "]", i);
        c->v.toks[i].ptr = p;
        c->v.toks[i].len = (uint64_t)l;
        c->v.types[i] = KVB_TT_UNUSED;
        p += l + 1;
    }
    return KVB_OK;
}

/* model.vocab and added_tokens into c->v: as many tokens as the largest id + 1, an id given twice
 * in the vocab refused, holes padded. */
static kvb_status hf_read_vocab(hf_conv *c, const cJSON *vocab, const cJSON *added, const char *path, kvb_err *err) {
    uint32_t n = 0, id;
    const cJSON *it;
    cJSON_ArrayForEach(it, vocab) {
        if (!id_of(it, &id))
            return kvb_err_set(err, KVB_ERR_FORMAT, "%s: vocab entry '%.40s' has no valid id", path,
                               it->string ? it->string : "");
        if (id + 1 > n) n = id + 1;
    }
    cJSON_ArrayForEach(it, added) {
        if (!id_of(cJSON_GetObjectItemCaseSensitive(it, "id"), &id) ||
            !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(it, "content")))
            return kvb_err_set(err, KVB_ERR_FORMAT, "%s: an added_tokens entry lacks a valid id or content", path);
        if (id + 1 > n) n = id + 1;
    }
    if (n == 0) return kvb_err_set(err, KVB_ERR_FORMAT, "%s: empty vocabulary", path);
    c->v.n = n;
    c->v.toks = calloc(n, sizeof *c->v.toks);
    c->v.types = calloc(n, sizeof *c->v.types);
    if (!c->v.toks || !c->v.types) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory converting %s", path);
    cJSON_ArrayForEach(it, vocab) {
        id_of(it, &id);
        if (c->v.toks[id].ptr)
            return kvb_err_set(err, KVB_ERR_FORMAT, "%s: id %" PRIu32 " appears twice in the vocab", path, id);
        c->v.toks[id].ptr = it->string ? it->string : "";
        c->v.toks[id].len = strlen(c->v.toks[id].ptr);
        c->v.types[id] = KVB_TT_NORMAL;
    }
    cJSON_ArrayForEach(it, added) {
        id_of(cJSON_GetObjectItemCaseSensitive(it, "id"), &id);
        const char *s = cJSON_GetObjectItemCaseSensitive(it, "content")->valuestring;
        /* added tokens are matched in raw text, so stored raw (llama.cpp's converter does the same) */
        c->v.toks[id].ptr = s;
        c->v.toks[id].len = strlen(s);
        c->v.types[id] = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(it, "special")) ? KVB_TT_CONTROL
                                                                                       : KVB_TT_USER_DEFINED;
    }
    return hf_fill_holes(c, path, err);
}

/* model.merges into c->merges: "a b" strings or ["a", "b"] pairs, both stored as "a b". */
static kvb_status hf_read_merges(hf_conv *c, const cJSON *jmerges, const char *path, kvb_err *err) {
    const cJSON *it;
    c->n_merges = cJSON_GetArraySize(jmerges);
    size_t mbytes = 0;
    cJSON_ArrayForEach(it, jmerges) {
        if (cJSON_IsString(it)) {
            mbytes += strlen(it->valuestring) + 1;
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 && cJSON_IsString(cJSON_GetArrayItem(it, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 1))) {
            mbytes += strlen(cJSON_GetArrayItem(it, 0)->valuestring) + strlen(cJSON_GetArrayItem(it, 1)->valuestring) + 2;
        } else {
            return kvb_err_set(err, KVB_ERR_FORMAT, "%s: a merge is neither \"a b\" nor [\"a\", \"b\"]", path);
        }
    }
    c->merges = calloc(c->n_merges > 0 ? (size_t)c->n_merges : 1, sizeof *c->merges);
    c->merge_buf = malloc(mbytes + 1);
    if (!c->merges || !c->merge_buf) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory converting %s", path);
    size_t off = 0;
    int k = 0;
    cJSON_ArrayForEach(it, jmerges) {
        if (cJSON_IsString(it)) {
            c->merges[k].ptr = it->valuestring;
            c->merges[k].len = strlen(it->valuestring);
        } else {
            const char *a = cJSON_GetArrayItem(it, 0)->valuestring, *b = cJSON_GetArrayItem(it, 1)->valuestring;
            size_t la = strlen(a), lb = strlen(b);
            memcpy(c->merge_buf + off, a, la);
            c->merge_buf[off + la] = ' ';
            memcpy(c->merge_buf + off + la + 1, b, lb);
            c->merges[k].ptr = c->merge_buf + off;
            c->merges[k].len = la + 1 + lb;
            off += la + lb + 2;
        }
        k++;
    }
    return KVB_OK;
}

/* The chat template of tokenizer_config.json: a string, or the "default" (else the last) of a
 * [{"name": ..., "template": ...}] list; NULL without one. */
static const char *hf_chat_template(const cJSON *cfg) {
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    if (cJSON_IsString(ct)) return ct->valuestring;
    const char *tmpl = NULL;
    if (cJSON_IsArray(ct)) {
        const cJSON *e;
        cJSON_ArrayForEach(e, ct) {
            const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name");
            const cJSON *tt = cJSON_GetObjectItemCaseSensitive(e, "template");
            if (!cJSON_IsString(tt)) continue;
            if (!tmpl || (cJSON_IsString(nm) && strcmp(nm->valuestring, "default") == 0)) tmpl = tt->valuestring;
        }
    }
    return tmpl;
}

/* tokenizer_config.json next to path, when there: BOS/EOS/pad, add_bos/add_eos and the chat
 * template; EOS guessed as <|endoftext|> without one. */
static kvb_status hf_read_config(hf_conv *c, const char *path, kvb_err *err) {
    c->bos = c->eos = c->pad = -1;
    char *cpath = config_path(path);
    if (!cpath) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory converting %s", path);
    FILE *cf = fopen(cpath, "rb");
    if (cf) {
        fclose(cf);
        kvb_status st;
        c->cfg = parse_json(cpath, err, &st);
        free(cpath);
        if (!c->cfg) return st;
        c->bos = find_token(&c->v, token_text(cJSON_GetObjectItemCaseSensitive(c->cfg, "bos_token")));
        c->eos = find_token(&c->v, token_text(cJSON_GetObjectItemCaseSensitive(c->cfg, "eos_token")));
        c->pad = find_token(&c->v, token_text(cJSON_GetObjectItemCaseSensitive(c->cfg, "pad_token")));
        c->add_bos = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c->cfg, "add_bos_token"));
        c->add_eos = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c->cfg, "add_eos_token"));
        c->tmpl = hf_chat_template(c->cfg);
    } else {
        kvb_log(KVB_LOG_INFO, "%s not found: BOS/EOS guessed, no chat template", cpath);
        free(cpath);
    }
    if (c->eos < 0) c->eos = find_token(&c->v, "<|endoftext|>");
    if (c->bos < 0) c->add_bos = false;
    return KVB_OK;
}

/* The tokenizer.* keys of the converted vocabulary, padded to pad_to tokens; *n_vocab = its size. */
static kvb_status hf_write_keys(kvb_gguf_writer *w, const hf_conv *c, const char *pre, uint32_t pad_to,
                                uint32_t *n_vocab, kvb_err *err) {
    kvb_gguf_str *pt = NULL;
    int32_t *ptypes = NULL;
    char *rbuf = NULL;
    uint32_t m = 0;
    kvb_status st = pad_vocab(c->v.toks, c->v.types, c->v.n, pad_to, &pt, &ptypes, &m, &rbuf, err);
    if (st) goto done;
    if ((st = kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "gpt2", err)) ||
        (st = kvb_gguf_writer_add_str(w, "tokenizer.ggml.pre", pre, err)) ||
        (st = kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", pt, m, err)) ||
        (st = kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, ptypes, m, err)) ||
        (st = kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.merges", c->merges,
                                          (uint64_t)(c->n_merges > 0 ? c->n_merges : 0), err)))
        goto done;
    if (c->bos >= 0 && (st = kvb_gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)c->bos, err))) goto done;
    if (c->eos >= 0 && (st = kvb_gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)c->eos, err))) goto done;
    if (c->pad >= 0 && (st = kvb_gguf_writer_add_u32(w, "tokenizer.ggml.padding_token_id", (uint32_t)c->pad, err)))
        goto done;
    if ((st = kvb_gguf_writer_add_bool(w, "tokenizer.ggml.add_bos_token", c->add_bos, err)) ||
        (st = kvb_gguf_writer_add_bool(w, "tokenizer.ggml.add_eos_token", c->add_eos, err)))
        goto done;
    if (c->tmpl && (st = kvb_gguf_writer_add_str(w, "tokenizer.chat_template", c->tmpl, err))) goto done;
    *n_vocab = m;
done:
    free(pt);
    free(ptypes);
    free(rbuf);
    return st;
}

kvb_status kvb_vocab_from_hf_json(kvb_gguf_writer *w, const char *path, uint32_t pad_to, uint32_t *n_vocab,
                                  kvb_err *err) {
    kvb_status st = KVB_OK;
    cJSON *root = parse_json(path, err, &st);
    if (!root) return st;
    hf_conv c = {0};
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    const cJSON *mtype = cJSON_GetObjectItemCaseSensitive(model, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *jmerges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    const char *pre = NULL;
    if (!cJSON_IsString(mtype) || strcmp(mtype->valuestring, "BPE") != 0 || !cJSON_IsObject(vocab) ||
        !cJSON_IsArray(jmerges))
        st = kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: not a BPE tokenizer.json (model.type \"BPE\" with vocab and merges)",
                         path);
    if (!st && !(st = detect_pre(root, path, &pre, err)) && !(st = hf_check_supported(root, path, pre, err)) &&
        !(st = hf_read_vocab(&c, vocab, added, path, err)) && !(st = hf_read_merges(&c, jmerges, path, err)) &&
        !(st = hf_read_config(&c, path, err)))
        st = hf_write_keys(w, &c, pre, pad_to, n_vocab, err);
    cJSON_Delete(root);
    cJSON_Delete(c.cfg);
    free(c.v.toks);
    free(c.v.types);
    free(c.merges);
    free(c.merge_buf);
    free(c.pad_buf);
    return st;
}
