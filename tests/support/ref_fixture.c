/* ref_fixture.c — writes the small random GGUF models tests run the reference and the engines on
 * (see ref_fixture.h). Weights are drawn with the core RNG from one stream per tensor, seeded by
 * hashing the tensor's name with the fixture seed; matrices are scaled by 1/sqrt(cols) so every
 * projection keeps activations near unit size, norm weights are 1 + N(0, 0.1^2) and biases
 * N(0, 0.2^2) so that each of them visibly matters. The f32 values are encoded to the requested
 * type with quant's reference converters (ggml-compatible), so a quantised fixture's stored values
 * are those of the f32 draw rounded the way llama.cpp's quantiser would. */
#include "ref_fixture.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvb_core.h"
#include "kvb_quant.h"

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

static void seterr(char *buf, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void seterr(char *buf, size_t cap, const char *fmt, ...) {
    if (!buf || cap == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
}

void ref_fixture_default(ref_fixture_cfg *c, const char *arch, uint32_t wtype, uint64_t seed) {
    memset(c, 0, sizeof *c);
    c->arch = arch;
    c->wtype = wtype;
    c->seed = seed;
    c->n_vocab = 97;
    c->n_embd = 64;
    c->n_layer = 2;
    c->n_ff = 128;
    c->n_head = 4;
    c->n_head_kv = 2;
    c->head_dim = strcmp(arch, "qwen3") == 0 ? 32 : 16;
    c->n_rot = c->head_dim;
    c->n_ctx_train = 512;
    c->rope_freq_base = 10000.0f;
    c->norm_eps = 1e-5f;
    c->output = REF_FIX_OUTPUT_SEPARATE;
    c->rope = REF_FIX_ROPE_PLAIN;
    c->rope_factor = 8.0f;
    c->rope_low_freq_factor = 1.0f;
    c->rope_high_freq_factor = 4.0f;
    c->rope_orig_ctx = 64; /* small, so that a tiny model's frequencies span all three bands */
    c->write_vocab = true;
    c->embd_scale = 1.0f;
    c->mat_scale = 1.0f;
    c->swa_pattern = -1;
    if (strcmp(arch, "gemma3") == 0) {
        c->n_layer = 7; /* 5 local, 1 global, 1 local: both kinds, and a local layer after the global one */
        c->head_dim = c->n_rot = 32;
        c->swa_window = 5;
        c->rope_freq_base = 1000000.0f;
        c->norm_eps = 1e-6f;
    }
}

float ref_fixture_llama3_factor(double base, int n_rot, int i, double factor, double low, double high,
                                double orig_ctx) {
    /* convert_hf_to_gguf.py (LlamaModel): freqs = 1/(base ** (arange(0, dim, 2, float32) / dim)) in
     * float32, then per frequency in Python floats; the list is stored as an F32 tensor. */
    const float expo = (float)(2 * i) / (float)n_rot;
    const float freq = 1.0f / powf((float)base, expo);
    const double wavelen = 2 * M_PI / (double)freq;
    const double low_wavelen = orig_ctx / low, high_wavelen = orig_ctx / high;
    if (wavelen < high_wavelen) return 1.0f;
    if (wavelen > low_wavelen) return (float)factor;
    const double smooth = (orig_ctx / wavelen - low) / (high - low);
    return (float)(1.0 / ((1 - smooth) / factor + smooth));
}

int ref_fixture_write_tensors(kvb_gguf_writer *w, const ref_fix_tensor *t, size_t n, const char *path,
                              char *errbuf, size_t cap) {
    kvb_err e = {0};
    for (size_t i = 0; i < n; i++) {
        if (kvb_gguf_writer_add_tensor(w, t[i].name, t[i].n_dims, t[i].ne, t[i].type, &e) != KVB_OK) {
            seterr(errbuf, cap, "%s: adding tensor %s: %s", path, t[i].name, e.msg);
            return -1;
        }
    }
    FILE *f = fopen(path, "wb");
    if (!f) {
        seterr(errbuf, cap, "%s: cannot create: %s", path, strerror(errno));
        return -1;
    }
    int rc = -1;
    uint8_t *buf = NULL;
    if (kvb_gguf_writer_write_header(w, f, &e) != KVB_OK) {
        seterr(errbuf, cap, "%s: writing header: %s", path, e.msg);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        const uint64_t cols = t[i].ne[0], rows = t[i].n_dims > 1 ? t[i].ne[1] : 1;
        const size_t rb = kvb_row_bytes(t[i].type, (int64_t)cols);
        if (rb == 0 || rb * rows != kvb_gguf_writer_tensor_bytes(w, i)) {
            seterr(errbuf, cap, "%s: tensor %s: type %u cannot encode rows of %llu", path, t[i].name,
                   (unsigned)t[i].type, (unsigned long long)cols);
            goto out;
        }
        buf = malloc(rb * rows);
        if (!buf) {
            seterr(errbuf, cap, "%s: out of memory", path);
            goto out;
        }
        for (uint64_t r = 0; r < rows; r++) kvb_f32_to_row(t[i].type, t[i].data + r * cols, buf + r * rb, (int64_t)cols);
        if (kvb_gguf_writer_write_tensor_data(w, f, i, buf, rb * rows, &e) != KVB_OK) {
            seterr(errbuf, cap, "%s: writing tensor %s: %s", path, t[i].name, e.msg);
            goto out;
        }
        free(buf);
        buf = NULL;
    }
    rc = 0;
out:
    free(buf);
    if (fclose(f) != 0 && rc == 0) {
        seterr(errbuf, cap, "%s: close: %s", path, strerror(errno));
        rc = -1;
    }
    if (rc != 0) remove(path);
    return rc;
}

/* ---- the random model ------------------------------------------------------------------------ */

#define FIX_MAX_TENSORS 512

typedef struct {
    ref_fix_tensor t[FIX_MAX_TENSORS];
    char names[FIX_MAX_TENSORS][64];
    float *data[FIX_MAX_TENSORS];
    size_t n;
} fix_list;

typedef enum { FILL_MAT, FILL_EMBD, FILL_NORM, FILL_BIAS } fill_kind;

/* Adds a tensor (rows == 0: 1-D of cols) filled from its own RNG stream. Returns its values. */
static float *fix_add(fix_list *L, const ref_fixture_cfg *c, const char *name, uint64_t rows, uint64_t cols,
                      uint32_t type, fill_kind kind) {
    if (L->n == FIX_MAX_TENSORS) return NULL;
    const uint64_t nrows = rows ? rows : 1;
    float *d = malloc(nrows * cols * sizeof *d);
    if (!d) return NULL;
    kvb_rng rng;
    kvb_rng_seed(&rng, kvb_hash64(name, strlen(name), c->seed));
    const double mat_sd = c->mat_scale / sqrt((double)cols);
    for (uint64_t i = 0; i < nrows * cols; i++) {
        const double z = kvb_rng_normal(&rng);
        switch (kind) {
        case FILL_MAT: d[i] = (float)(z * mat_sd); break;
        case FILL_EMBD: d[i] = (float)(z * c->embd_scale); break;
        case FILL_NORM: d[i] = (float)(1.0 + 0.1 * z); break;
        case FILL_BIAS: d[i] = (float)(0.2 * z); break;
        }
    }
    const size_t k = L->n++;
    snprintf(L->names[k], sizeof L->names[k], "%s", name);
    L->data[k] = d;
    L->t[k] = (ref_fix_tensor){.name = L->names[k], .n_dims = rows ? 2 : 1, .ne = {cols, nrows}, .type = type, .data = d};
    return d;
}

static float *fix_add_blk(fix_list *L, const ref_fixture_cfg *c, int layer, const char *suffix, uint64_t rows,
                          uint64_t cols, uint32_t type, fill_kind kind) {
    char name[64];
    snprintf(name, sizeof name, "blk.%d.%s", layer, suffix);
    return fix_add(L, c, name, rows, cols, type, kind);
}

static int add_kvs(kvb_gguf_writer *w, const ref_fixture_cfg *c, kvb_err *e) {
    char key[128];
    const char *a = c->arch;
#define U32(suffix, v)                                                   \
    do {                                                                 \
        snprintf(key, sizeof key, "%s.%s", a, suffix);                   \
        if (kvb_gguf_writer_add_u32(w, key, (v), e) != KVB_OK) return -1; \
    } while (0)
#define F32(suffix, v)                                                   \
    do {                                                                 \
        snprintf(key, sizeof key, "%s.%s", a, suffix);                   \
        if (kvb_gguf_writer_add_f32(w, key, (v), e) != KVB_OK) return -1; \
    } while (0)
    if (kvb_gguf_writer_add_str(w, "general.architecture", a, e) != KVB_OK) return -1;
    if (kvb_gguf_writer_add_str(w, "general.name", "ref-fixture", e) != KVB_OK) return -1;
    U32("context_length", c->n_ctx_train);
    U32("embedding_length", c->n_embd);
    U32("block_count", c->n_layer);
    U32("feed_forward_length", c->n_ff);
    U32("attention.head_count", c->n_head);
    U32("attention.head_count_kv", c->n_head_kv);
    if (c->head_dim != c->n_embd / c->n_head) {
        U32("attention.key_length", c->head_dim);
        U32("attention.value_length", c->head_dim);
    }
    if (c->n_rot != c->head_dim) U32("rope.dimension_count", c->n_rot);
    F32("rope.freq_base", c->rope_freq_base);
    F32("attention.layer_norm_rms_epsilon", c->norm_eps);
    if (strcmp(a, "gemma3") == 0) {
        U32("attention.sliding_window", c->swa_window);
        snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", a);
        if (c->swa_layers) {
            if (kvb_gguf_writer_add_arr(w, key, KVB_GGUF_BOOL, c->swa_layers, c->n_layer, e) != KVB_OK) return -1;
        } else if (c->swa_pattern >= 0) {
            U32("attention.sliding_window_pattern", (uint32_t)c->swa_pattern);
        }
    }
    if (c->rope == REF_FIX_ROPE_LLAMA3_KEYS || c->rope == REF_FIX_ROPE_LINEAR) {
        snprintf(key, sizeof key, "%s.rope.scaling.type", a);
        if (kvb_gguf_writer_add_str(w, key, c->rope == REF_FIX_ROPE_LINEAR ? "linear" : "llama3", e) != KVB_OK)
            return -1;
        F32("rope.scaling.factor", c->rope_factor);
    }
    if (c->rope == REF_FIX_ROPE_LLAMA3_KEYS) {
        F32("rope.scaling.low_freq_factor", c->rope_low_freq_factor);
        F32("rope.scaling.high_freq_factor", c->rope_high_freq_factor);
        U32("rope.scaling.original_context_length", c->rope_orig_ctx);
    }
#undef U32
#undef F32
    if (c->write_vocab) {
        kvb_gguf_str *toks = malloc(c->n_vocab * sizeof *toks);
        char *text = malloc((size_t)c->n_vocab * 16);
        float *scores = malloc(c->n_vocab * sizeof *scores);
        int32_t *types = malloc(c->n_vocab * sizeof *types);
        int rc = -1;
        if (toks && text && scores && types) {
            for (uint32_t i = 0; i < c->n_vocab; i++) {
                int len = snprintf(text + (size_t)i * 16, 16, "<t%u>", i);
                toks[i] = (kvb_gguf_str){.ptr = text + (size_t)i * 16, .len = (uint64_t)len};
                scores[i] = -(float)i;
                types[i] = 1; /* normal */
            }
            if (kvb_gguf_writer_add_str(w, "tokenizer.ggml.model", "llama", e) == KVB_OK &&
                kvb_gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", toks, c->n_vocab, e) == KVB_OK &&
                kvb_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVB_GGUF_F32, scores, c->n_vocab, e) == KVB_OK &&
                kvb_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVB_GGUF_I32, types, c->n_vocab, e) == KVB_OK)
                rc = 0;
        } else {
            kvb_err_set(e, KVB_ERR_NOMEM, "out of memory");
        }
        free(toks);
        free(text);
        free(scores);
        free(types);
        if (rc != 0) return -1;
    }
    return 0;
}

int ref_fixture_write(const ref_fixture_cfg *c, const char *path, char *errbuf, size_t cap) {
    const bool llama = strcmp(c->arch, "llama") == 0, qwen2 = strcmp(c->arch, "qwen2") == 0,
               qwen3 = strcmp(c->arch, "qwen3") == 0, gemma3 = strcmp(c->arch, "gemma3") == 0;
    if (!llama && !qwen2 && !qwen3 && !gemma3) {
        seterr(errbuf, cap, "ref_fixture: unknown arch %s", c->arch);
        return -1;
    }
    if (c->n_head == 0 || c->n_head_kv == 0 || c->n_embd == 0 || c->n_layer * 16 + 8 > FIX_MAX_TENSORS) {
        seterr(errbuf, cap, "ref_fixture: bad shape");
        return -1;
    }
    fix_list *L = calloc(1, sizeof *L);
    kvb_gguf_writer *w = NULL;
    kvb_err e = {0};
    int rc = -1;
    if (!L) {
        seterr(errbuf, cap, "ref_fixture: out of memory");
        return -1;
    }
    if (kvb_gguf_writer_create(&w, &e) != KVB_OK || add_kvs(w, c, &e) != 0) {
        seterr(errbuf, cap, "%s: metadata: %s", path, e.msg);
        goto out;
    }
    const uint64_t E = c->n_embd, F = c->n_ff, QD = (uint64_t)c->n_head * c->head_dim,
                   KD = (uint64_t)c->n_head_kv * c->head_dim;
    const uint32_t wt = c->wtype, f32 = KVB_TYPE_F32;
    bool ok = true;
    float *embd = fix_add(L, c, "token_embd.weight", c->n_vocab, E, wt, FILL_EMBD);
    ok = ok && embd && fix_add(L, c, "output_norm.weight", 0, E, f32, FILL_NORM);
    if (ok && c->output == REF_FIX_OUTPUT_SEPARATE) ok = fix_add(L, c, "output.weight", c->n_vocab, E, wt, FILL_MAT);
    if (ok && c->output == REF_FIX_OUTPUT_COPY) {
        float *out = fix_add(L, c, "output.weight", c->n_vocab, E, wt, FILL_MAT);
        ok = out != NULL;
        if (ok) memcpy(out, embd, c->n_vocab * E * sizeof *out);
    }
    if (ok && c->rope == REF_FIX_ROPE_LLAMA3_TENSOR) {
        float *ff = fix_add(L, c, "rope_freqs.weight", 0, c->n_rot / 2, f32, FILL_NORM);
        ok = ff != NULL;
        for (uint32_t i = 0; ok && i < c->n_rot / 2; i++)
            ff[i] = ref_fixture_llama3_factor(c->rope_freq_base, (int)c->n_rot, (int)i, c->rope_factor,
                                              c->rope_low_freq_factor, c->rope_high_freq_factor, c->rope_orig_ctx);
    }
    for (uint32_t l = 0; ok && l < c->n_layer; l++) {
        ok = fix_add_blk(L, c, (int)l, "attn_norm.weight", 0, E, f32, FILL_NORM) &&
             fix_add_blk(L, c, (int)l, "attn_q.weight", QD, E, wt, FILL_MAT) &&
             fix_add_blk(L, c, (int)l, "attn_k.weight", KD, E, wt, FILL_MAT) &&
             fix_add_blk(L, c, (int)l, "attn_v.weight", KD, E, wt, FILL_MAT) &&
             fix_add_blk(L, c, (int)l, "attn_output.weight", E, QD, wt, FILL_MAT) &&
             fix_add_blk(L, c, (int)l, "ffn_norm.weight", 0, E, f32, FILL_NORM) &&
             fix_add_blk(L, c, (int)l, "ffn_gate.weight", F, E, wt, FILL_MAT) &&
             fix_add_blk(L, c, (int)l, "ffn_up.weight", F, E, wt, FILL_MAT) &&
             fix_add_blk(L, c, (int)l, "ffn_down.weight", E, F, wt, FILL_MAT);
        if (ok && qwen2)
            ok = fix_add_blk(L, c, (int)l, "attn_q.bias", 0, QD, f32, FILL_BIAS) &&
                 fix_add_blk(L, c, (int)l, "attn_k.bias", 0, KD, f32, FILL_BIAS) &&
                 fix_add_blk(L, c, (int)l, "attn_v.bias", 0, KD, f32, FILL_BIAS);
        if (ok && (qwen3 || gemma3))
            ok = fix_add_blk(L, c, (int)l, "attn_q_norm.weight", 0, c->head_dim, f32, FILL_NORM) &&
                 fix_add_blk(L, c, (int)l, "attn_k_norm.weight", 0, c->head_dim, f32, FILL_NORM);
        if (ok && gemma3) /* stored as llama.cpp stores Gemma's, the "+1" included: around 1 */
            ok = fix_add_blk(L, c, (int)l, "post_attention_norm.weight", 0, E, f32, FILL_NORM) &&
                 fix_add_blk(L, c, (int)l, "post_ffw_norm.weight", 0, E, f32, FILL_NORM);
    }
    if (!ok) {
        seterr(errbuf, cap, "ref_fixture: out of memory");
        goto out;
    }
    rc = ref_fixture_write_tensors(w, L->t, L->n, path, errbuf, cap);
out:
    for (size_t i = 0; i < L->n; i++) free(L->data[i]);
    free(L);
    kvb_gguf_writer_destroy(w);
    return rc;
}

/* ---- temporary directories ----------------------------------------------------------------- */

int ref_tmpdir_create(char *buf, size_t cap) {
    const char *base = getenv("TMPDIR");
    if (!base || !*base) base = "/tmp";
    int len = snprintf(buf, cap, "%s/kvb-test-XXXXXX", base);
    if (len < 0 || (size_t)len >= cap) return -1;
    return mkdtemp(buf) ? 0 : -1;
}

void ref_tmpdir_remove(const char *dir) {
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *ent;
        char path[4096];
        while ((ent = readdir(d)) != NULL) {
            if (strcmp(ent->d_name, ".") == 0 || strcmp(ent->d_name, "..") == 0) continue;
            int len = snprintf(path, sizeof path, "%s/%s", dir, ent->d_name);
            struct stat st;
            if (len > 0 && (size_t)len < sizeof path && lstat(path, &st) == 0 && S_ISREG(st.st_mode)) unlink(path);
        }
        closedir(d);
    }
    rmdir(dir);
}
