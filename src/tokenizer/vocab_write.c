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

kvb_status kvb_vocab_from_hf_json(kvb_gguf_writer *w, const char *path, uint32_t pad_to, uint32_t *n_vocab,
                                  kvb_err *err) {
    kvb_status st = KVB_OK;
    cJSON *root = parse_json(path, err, &st), *cfg = NULL;
    hf_vocab v = {0};
    kvb_gguf_str *merges = NULL, *pt = NULL;
    int32_t *ptypes = NULL;
    uint32_t m = 0;
    char *merge_buf = NULL, *pad_buf = NULL, *cpath = NULL, *rbuf = NULL;
    if (!root) return st;

    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    const cJSON *mtype = cJSON_GetObjectItemCaseSensitive(model, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *jmerges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (!cJSON_IsString(mtype) || strcmp(mtype->valuestring, "BPE") != 0 || !cJSON_IsObject(vocab) ||
        !cJSON_IsArray(jmerges)) {
        st = kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: not a BPE tokenizer.json (model.type \"BPE\" with vocab and merges)",
                         path);
        goto done;
    }
    const char *pre = NULL;
    if ((st = detect_pre(root, path, &pre, err))) goto done;
    /* what we cannot reproduce is refused rather than converted into a vocabulary that would
     * tokenize differently: a normalizer other than Qwen2's NFC, a ByteLevel prefix space */
    {
        const cJSON *norm = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
        const cJSON *nt = cJSON_GetObjectItemCaseSensitive(norm, "type");
        bool nfc = cJSON_IsString(nt) && strcmp(nt->valuestring, "NFC") == 0;
        if (norm && !cJSON_IsNull(norm) && !(nfc && strcmp(pre, "qwen2") == 0)) {
            st = kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: normalizer '%s' is not supported with the %s pre-tokenizer",
                             path, cJSON_IsString(nt) ? nt->valuestring : "?", pre);
            goto done;
        }
        if (!nfc && strcmp(pre, "qwen2") == 0)
            kvb_log(KVB_LOG_WARN, "%s: Qwen2 split without its NFC normalizer; kvbridge normalizes to NFC", path);
        const char *txt = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"));
        bool prefix = txt && strstr(txt, "\"add_prefix_space\":true");
        cJSON_free((void *)txt);
        if (prefix) {
            st = kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: ByteLevel add_prefix_space=true is not supported", path);
            goto done;
        }
    }

    /* vocabulary size: the largest id + 1 */
    uint32_t n = 0, id;
    const cJSON *it;
    cJSON_ArrayForEach(it, vocab) {
        if (!id_of(it, &id)) {
            st = kvb_err_set(err, KVB_ERR_FORMAT, "%s: vocab entry '%.40s' has no valid id", path, it->string ? it->string : "");
            goto done;
        }
        if (id + 1 > n) n = id + 1;
    }
    cJSON_ArrayForEach(it, added) {
        if (!id_of(cJSON_GetObjectItemCaseSensitive(it, "id"), &id) ||
            !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(it, "content"))) {
            st = kvb_err_set(err, KVB_ERR_FORMAT, "%s: an added_tokens entry lacks a valid id or content", path);
            goto done;
        }
        if (id + 1 > n) n = id + 1;
    }
    if (n == 0) {
        st = kvb_err_set(err, KVB_ERR_FORMAT, "%s: empty vocabulary", path);
        goto done;
    }
    v.n = n;
    v.toks = calloc(n, sizeof *v.toks);
    v.types = calloc(n, sizeof *v.types);
    if (!v.toks || !v.types) goto nomem;
    cJSON_ArrayForEach(it, vocab) {
        id_of(it, &id);
        if (v.toks[id].ptr) {
            st = kvb_err_set(err, KVB_ERR_FORMAT, "%s: id %" PRIu32 " appears twice in the vocab", path, id);
            goto done;
        }
        v.toks[id].ptr = it->string ? it->string : "";
        v.toks[id].len = strlen(v.toks[id].ptr);
        v.types[id] = KVB_TT_NORMAL;
    }
    cJSON_ArrayForEach(it, added) {
        id_of(cJSON_GetObjectItemCaseSensitive(it, "id"), &id);
        const char *c = cJSON_GetObjectItemCaseSensitive(it, "content")->valuestring;
        /* added tokens are matched in raw text, so stored raw (llama.cpp's converter does the same) */
        v.toks[id].ptr = c;
        v.toks[id].len = strlen(c);
        v.types[id] = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(it, "special")) ? KVB_TT_CONTROL : KVB_TT_USER_DEFINED;
    }
    /* holes become unused "[PADn]" tokens */
    uint32_t holes = 0;
    for (uint32_t i = 0; i < n; i++) holes += !v.toks[i].ptr;
    if (holes) {
        pad_buf = malloc((size_t)holes * 20);
        if (!pad_buf) goto nomem;
        char *p = pad_buf;
        for (uint32_t i = 0; i < n; i++) {
            if (v.toks[i].ptr) continue;
            int l = snprintf(p, 20, "[PAD%" PRIu32 "]", i);
            v.toks[i].ptr = p;
            v.toks[i].len = (uint64_t)l;
            v.types[i] = KVB_TT_UNUSED;
            p += l + 1;
        }
    }

    /* merges: "a b" strings or ["a", "b"] pairs */
    int nm = cJSON_GetArraySize(jmerges);
    size_t mbytes = 0;
    cJSON_ArrayForEach(it, jmerges) {
        if (cJSON_IsString(it)) {
            mbytes += strlen(it->valuestring) + 1;
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 && cJSON_IsString(cJSON_GetArrayItem(it, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 1))) {
            mbytes += strlen(cJSON_GetArrayItem(it, 0)->valuestring) + strlen(cJSON_GetArrayItem(it, 1)->valuestring) + 2;
        } else {
            st = kvb_err_set(err, KVB_ERR_FORMAT, "%s: a merge is neither \"a b\" nor [\"a\", \"b\"]", path);
            goto done;
        }
    }
    merges = calloc(nm > 0 ? (size_t)nm : 1, sizeof *merges);
    merge_buf = malloc(mbytes + 1);
    if (!merges || !merge_buf) goto nomem;
    {
        size_t off = 0;
        int k = 0;
        cJSON_ArrayForEach(it, jmerges) {
            if (cJSON_IsString(it)) {
                merges[k].ptr = it->valuestring;
                merges[k].len = strlen(it->valuestring);
            } else {
                const char *a = cJSON_GetArrayItem(it, 0)->valuestring, *b = cJSON_GetArrayItem(it, 1)->valuestring;
                size_t la = strlen(a), lb = strlen(b);
                memcpy(merge_buf + off, a, la);
                merge_buf[off + la] = ' ';
                memcpy(merge_buf + off + la + 1, b, lb);
                merges[k].ptr = merge_buf + off;
                merges[k].len = la + 1 + lb;
                off += la + lb + 2;
            }
            k++;
        }
    }

    /* tokenizer_config.json: BOS/EOS/pad, add_bos/add_eos, chat template */
    int32_t bos = -1, eos = -1, pad = -1;
    bool add_bos = false, add_eos = false;
    const char *tmpl = NULL;
    cpath = config_path(path);
    if (!cpath) goto nomem;
    FILE *cf = fopen(cpath, "rb");
    if (cf) {
        fclose(cf);
        kvb_status cst;
        cfg = parse_json(cpath, err, &cst);
        if (!cfg) {
            st = cst;
            goto done;
        }
        bos = find_token(&v, token_text(cJSON_GetObjectItemCaseSensitive(cfg, "bos_token")));
        eos = find_token(&v, token_text(cJSON_GetObjectItemCaseSensitive(cfg, "eos_token")));
        pad = find_token(&v, token_text(cJSON_GetObjectItemCaseSensitive(cfg, "pad_token")));
        add_bos = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(cfg, "add_bos_token"));
        add_eos = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(cfg, "add_eos_token"));
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
        if (cJSON_IsString(ct)) {
            tmpl = ct->valuestring;
        } else if (cJSON_IsArray(ct)) { /* [{"name": "default", "template": "..."}, ...] */
            const cJSON *e;
            cJSON_ArrayForEach(e, ct) {
                const cJSON *nm2 = cJSON_GetObjectItemCaseSensitive(e, "name");
                const cJSON *tt = cJSON_GetObjectItemCaseSensitive(e, "template");
                if (!cJSON_IsString(tt)) continue;
                if (!tmpl || (cJSON_IsString(nm2) && strcmp(nm2->valuestring, "default") == 0)) tmpl = tt->valuestring;
            }
        }
    } else {
        kvb_log(KVB_LOG_INFO, "%s not found: BOS/EOS guessed, no chat template", cpath);
    }
    if (eos < 0) eos = find_token(&v, "<|endoftext|>");
    if (bos < 0) add_bos = false;

    if ((st = pad_vocab(v.toks, v.types, n, pad_to, &pt, &ptypes, &m, &rbuf, err))) goto done;
    if ((st = kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "gpt2", err)) ||
        (st = kvb_gguf_writer_add_str(w, "tokenizer.ggml.pre", pre, err)) ||
        (st = kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", pt, m, err)) ||
        (st = kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, ptypes, m, err)) ||
        (st = kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.merges", merges, (uint64_t)(nm > 0 ? nm : 0), err)))
        goto done;
    if (bos >= 0 && (st = kvb_gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)bos, err))) goto done;
    if (eos >= 0 && (st = kvb_gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)eos, err))) goto done;
    if (pad >= 0 && (st = kvb_gguf_writer_add_u32(w, "tokenizer.ggml.padding_token_id", (uint32_t)pad, err))) goto done;
    if ((st = kvb_gguf_writer_add_bool(w, "tokenizer.ggml.add_bos_token", add_bos, err)) ||
        (st = kvb_gguf_writer_add_bool(w, "tokenizer.ggml.add_eos_token", add_eos, err)))
        goto done;
    if (tmpl && (st = kvb_gguf_writer_add_str(w, "tokenizer.chat_template", tmpl, err))) goto done;
    *n_vocab = m;
    goto done;
nomem:
    st = kvb_err_set(err, KVB_ERR_NOMEM, "out of memory converting %s", path);
done:
    cJSON_Delete(root);
    cJSON_Delete(cfg);
    free(v.toks);
    free(v.types);
    free(merges);
    free(merge_buf);
    free(pad_buf);
    free(cpath);
    free(pt);
    free(ptypes);
    free(rbuf);
    return st;
}
