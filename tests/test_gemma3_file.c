/* tests/test_gemma3_file.c — the real Gemma 3 270M (Q4_K_M GGUF: Q5_0, Q4_K, Q6_K and Q8_0
 * matrices, F32 norms) through the CPU engine against the float64 reference: every row of logits
 * of a short plain prompt and of a Gemma chat prompt within a stated relative-L2 tolerance and
 * with the same top-1 token; the model's weights decoded to F32 with the window rewritten to 8
 * tokens, so a 27-token prompt runs past the window on every local layer, within 1e-4 (the
 * arithmetic without activation quantisation); and greedy generation answering factual prompts
 * with the expected words. The file is named by
 * KVB_GEMMA3_GGUF or found at $HOME/.cache/kvbridge/gemma-3-270m-q4_k_m.gguf; without it (or
 * without the quant types it needs) every test skips with a message saying so. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_core.h"
#include "kvb_engine_cpu.h"
#include "kvb_gguf.h"
#include "kvb_model.h"
#include "kvb_quant.h"
#include "kvb_tokenizer.h"
#include "gguf_variant.h"
#include "greedy_text.h"
#include "kvbt.h"
#include "ref_model.h"

static char g_path[1024];
static const char *g_skip; /* why the tests skip, or NULL */

/* ---- tolerances (relative L2 of one token's logits against the float64 reference) -------------
 * The reference decodes the file's stored weights exactly, so what remains is the engine's own
 * arithmetic. Results are the same bits on every machine (the canonical dot), so the figures below
 * are not machine-dependent.
 *  - TOL_F32: the real model's weights decoded to F32 (no activation quantisation): 18 layers of f32
 *    canonical dots, norms with weights up to ~700, softmax, the f32 RoPE table, a 262144-row output
 *    head. Measured on the 27-token prompt with the window rewritten to 8: worst row 5.4e-6. Limit
 *    1e-4: 18x margin, three orders below a wrong fact (no embedding scale, norm weights without
 *    their +1, a wrong RoPE base, pattern or window, SwiGLU for GeGLU each move logits by 0.1 .. 1).
 *  - TOL_Q4KM: the file as it is. Q5_0, Q4_K, Q6_K and Q8_0 weights take Q8_0-quantised activations
 *    (32-element blocks, d = amax/127); Gemma 3's normed activations carry outliers (norm weights up
 *    to 62 before, 741 after the branches), so a block's small elements lose most of their bits and
 *    the error grows with depth: measured worst row 4.7e-2 on the 6-token prompt (last token 2.0e-2)
 *    and 4.3e-2 on the 16-token chat prompt (last token 1.3e-2), up to 0.33 on longer prompts (which
 *    is why the long prompt runs with F32 weights). Limit 0.1 on these two short prompts, plus top-1 agreement on
 *    every row whose reference top-2 margin exceeds 0.25 and on the last row always. */
#define TOL_F32 1e-4
#define TOL_Q4KM 0.1

static int setup(void **state) {
    (void)state;
    const char *env = getenv("KVB_GEMMA3_GGUF"), *home = getenv("HOME");
    if (env && *env) snprintf(g_path, sizeof g_path, "%s", env);
    else snprintf(g_path, sizeof g_path, "%s/.cache/kvbridge/gemma-3-270m-q4_k_m.gguf", home ? home : "");
    FILE *f = fopen(g_path, "rb");
    if (!f) {
        g_skip = "no Gemma 3 270M file (set KVB_GEMMA3_GGUF or put gemma-3-270m-q4_k_m.gguf in ~/.cache/kvbridge)";
        return 0;
    }
    fclose(f);
    const uint32_t needed[] = {KVB_TYPE_Q5_0, KVB_TYPE_Q4_K, KVB_TYPE_Q6_K, KVB_TYPE_Q8_0};
    for (size_t i = 0; i < KVB_ARRAY_LEN(needed); i++)
        if (!kvb_type_get(needed[i])->supported) g_skip = "the quant module does not compute Q5_0/Q4_K/Q6_K yet";
    return 0;
}

#define SKIP_IF_NO_FILE()                                         \
    do {                                                          \
        if (g_skip) {                                             \
            print_message("test_gemma3_file: SKIP: %s\n", g_skip); \
            skip();                                               \
        }                                                         \
    } while (0)

typedef struct {
    kvb_model *m;
    kvb_tokenizer *tok;
} gemma;

static void gemma_open(gemma *g, const char *path) {
    kvb_err err = {0};
    if (kvb_model_load(path, &g->m, &err) != KVB_OK) fail_msg("%s", err.msg);
    if (kvb_tokenizer_load(g->m->gguf, &g->tok, &err) != KVB_OK) fail_msg("%s", err.msg);
}

static void gemma_close(gemma *g) {
    kvb_tokenizer_free(g->tok);
    kvb_model_free(g->m);
}

static int32_t *tokenize(const gemma *g, const char *text, size_t *n) {
    int32_t *ids = NULL;
    kvb_err err = {0};
    if (kvb_tokenize(g->tok, text, strlen(text), true, true, &ids, n, &err) != KVB_OK) fail_msg("%s", err.msg);
    assert_true(*n >= 2);
    assert_int_equal(ids[0], kvb_tokenizer_bos(g->tok)); /* Gemma needs its <bos> */
    return ids;
}

/* All rows of logits (n, n_vocab) of the prompt from a fresh engine sequence. */
static void engine_logits(const kvb_model *m, const int32_t *ids, uint32_t n, uint32_t cache, uint32_t max_batch,
                          float *logits) {
    kvb_engine_opts o = {.cache_dtype = cache, .block_tokens = 16, .max_ctx = 1024, .max_batch = max_batch};
    kvb_engine *e = NULL;
    kvb_seq *s = NULL;
    kvb_err err = {0};
    if (kvb_engine_create(m, &o, &e, &err) || kvb_seq_create(e, &s, &err) ||
        kvb_engine_forward(e, s, ids, n, logits, true, &err))
        fail_msg("engine: %s", err.msg);
    kvb_seq_free(s);
    kvb_engine_free(e);
}

/* Engine (F32 cache) vs reference on every row of the prompt; fails past tol or on a top-1 change
 * with a clear reference margin (and always on the last row); returns the worst rel-L2. */
static double compare_with_reference(ref_model *ref, const gemma *g, const int32_t *ids, uint32_t n, double tol,
                                     const char *what) {
    const size_t V = g->m->d.n_vocab;
    assert_int_equal(ref_model_n_vocab(ref), (int)V);
    double *rl = malloc(sizeof(double) * n * V);
    float *el = malloc(sizeof(float) * n * V);
    assert_non_null(rl);
    assert_non_null(el);
    assert_int_equal(ref_model_forward(ref, ids, (int)n, rl), 0);
    engine_logits(g->m, ids, n, KVB_TYPE_F32, 0, el);
    double worst = 0;
    int agree = 0;
    for (uint32_t t = 0; t < n; t++) {
        const double rel = ref_rel_l2(el + t * V, rl + t * V, V);
        worst = fmax(worst, rel);
        const int et = ref_argmax_f32(el + t * V, (int)V), rt = ref_argmax(rl + t * V, (int)V);
        agree += et == rt;
        if (getenv("KVB_GEMMA3_VERBOSE")) print_message("    %s: token %u rel-L2 %.3g top-1 %d/%d\n", what, t, rel, et, rt);
        if (!(rel <= tol)) fail_msg("%s: token %u: rel-L2 %.3g > %.3g", what, t, rel, tol);
        if (et != rt) {
            /* a near tie may flip; the reference's own margin must then be within the noise */
            double second = -INFINITY;
            for (size_t i = 0; i < V; i++)
                if ((int)i != rt && rl[t * V + i] > second) second = rl[t * V + i];
            const double margin = rl[t * V + rt] - second;
            if (margin > 0.25 || t == n - 1)
                fail_msg("%s: token %u: engine top-1 %d, reference %d (margin %.3g)", what, t, et, rt, margin);
        }
    }
    const int last = ref_argmax(rl + (size_t)(n - 1) * V, (int)V);
    char piece[256];
    int len = kvb_token_to_bytes(g->tok, last, piece, sizeof piece - 1);
    piece[len > 0 ? len : 0] = 0;
    print_message("  %s: %u tokens, worst rel-L2 %.3g (limit %.3g), last token %.3g, top-1 %d/%u, next token %d "
                  "'%s' (both)\n",
                  what, n, worst, tol, ref_rel_l2(el + (size_t)(n - 1) * V, rl + (size_t)(n - 1) * V, V), agree, n,
                  last, piece);
    free(rl);
    free(el);
    return worst;
}

static ref_model *ref_load(const char *path) {
    char rerr[512];
    ref_model *ref = ref_model_load(path, rerr, sizeof rerr);
    if (!ref) fail_msg("ref_model_load: %s", rerr);
    return ref;
}

/* The file as it is, on a plain prompt and on the Gemma chat template's rendering of a question. */
static void test_logits_vs_reference(void **state) {
    (void)state;
    SKIP_IF_NO_FILE();
    gemma g = {0};
    gemma_open(&g, g_path);
    const kvb_model_desc *d = &g.m->d;
    assert_int_equal(d->arch, KVB_ARCH_GEMMA3);
    assert_int_equal(d->swa_window, 512);
    for (uint32_t l = 0; l < d->n_layer; l++) assert_int_equal(kvb_layer_is_local(d, l), (l + 1) % 6 != 0);
    ref_model *ref = ref_load(g_path);
    size_t n;
    int32_t *ids = tokenize(&g, "The capital of France is", &n);
    compare_with_reference(ref, &g, ids, (uint32_t)n, TOL_Q4KM, "Q4_K_M file, plain prompt");
    free(ids);

    /* the chat path: <start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n as special tokens */
    kvb_chat_msg msg = {"user", "What is the capital of France?"};
    char *text = NULL;
    kvb_err err = {0};
    if (kvb_chat_render(KVB_CHAT_GEMMA, &msg, 1, true, &text, &err) != KVB_OK) fail_msg("%s", err.msg);
    ids = tokenize(&g, text, &n);
    const int32_t start = kvb_tokenizer_find(g.tok, "<start_of_turn>", 15),
                  end = kvb_tokenizer_find(g.tok, "<end_of_turn>", 13);
    assert_true(start >= 0 && end >= 0);
    assert_int_equal(ids[1], start);
    assert_int_equal(ids[n - 3], start); /* ... <start_of_turn> model \n */
    int n_end = 0;
    for (size_t i = 0; i < n; i++) n_end += ids[i] == end;
    assert_int_equal(n_end, 1);
    compare_with_reference(ref, &g, ids, (uint32_t)n, TOL_Q4KM, "Q4_K_M file, gemma chat prompt");
    free(ids);
    free(text);
    ref_model_free(ref);
    gemma_close(&g);
}

/* Writes the variant (gguf_variant.h) or fails the test. */
static void write_variant(const char *src_path, const char *dst, uint32_t window, bool to_f32) {
    char e[512];
    if (kvbt_gguf_variant(src_path, dst, window, to_f32, e, sizeof e)) fail_msg("%s", e);
}

/* The real model's weights decoded to F32 and its window rewritten to 8 tokens: a 27-token prompt
 * runs past the window on the 15 local layers (and crosses 16-token cache blocks), engine and
 * reference reading the same rewritten file, within TOL_F32; chunked (7-token) prefill equals
 * one-shot bit for bit. */
static void test_f32_weights_short_window(void **state) {
    (void)state;
    SKIP_IF_NO_FILE();
    char path[600];
    kvbt_tmp_path(path, sizeof path, "gemma3-f32-window8.gguf");
    write_variant(g_path, path, 8, true);
    gemma g = {0};
    gemma_open(&g, path);
    assert_int_equal(g.m->d.swa_window, 8);
    assert_int_equal(g.m->layers[0].wq.type, KVB_TYPE_F32);
    size_t n;
    int32_t *ids = tokenize(&g, "Water boils at one hundred degrees Celsius at sea level. The largest planet in "
                                "the solar system is Jupiter, and the closest star is", &n);
    assert_true(n > 3 * 8);
    ref_model *ref = ref_load(path);
    compare_with_reference(ref, &g, ids, (uint32_t)n, TOL_F32, "F32-decoded weights, window 8");
    ref_model_free(ref);
    const size_t V = g.m->d.n_vocab;
    float *one = malloc(sizeof(float) * n * V), *chunked = malloc(sizeof(float) * n * V);
    assert_non_null(one);
    assert_non_null(chunked);
    engine_logits(g.m, ids, (uint32_t)n, KVB_TYPE_F16, 0, one);
    engine_logits(g.m, ids, (uint32_t)n, KVB_TYPE_F16, 7, chunked);
    assert_memory_equal(one, chunked, sizeof(float) * n * V);
    free(one);
    free(chunked);
    free(ids);
    gemma_close(&g);
    remove(path);
}

typedef struct {
    kvb_engine *e;
    kvb_seq *s;
} cpu_step_ctx;

static int cpu_step(void *ctx, int32_t next, float *logits, char *err, size_t cap) {
    cpu_step_ctx *c = ctx;
    kvb_err e = {0};
    if (kvb_engine_forward(c->e, c->s, &next, 1, logits, false, &e) == KVB_OK) return 0;
    snprintf(err, cap, "engine: %s", e.msg);
    return -1;
}

/* Greedy continuation (F16 cache, the CLI's default) of prompt, n_gen tokens, as text. */
static void greedy(const gemma *g, const char *prompt, int n_gen, char *out, size_t cap) {
    size_t n;
    int32_t *ids = tokenize(g, prompt, &n);
    kvb_engine_opts o = {.cache_dtype = KVB_TYPE_F16, .max_ctx = 512};
    cpu_step_ctx c = {0};
    kvb_err err = {0};
    float *logits = malloc(sizeof(float) * g->m->d.n_vocab);
    assert_non_null(logits);
    if (kvb_engine_create(g->m, &o, &c.e, &err) || kvb_seq_create(c.e, &c.s, &err) ||
        kvb_engine_forward(c.e, c.s, ids, (uint32_t)n, logits, false, &err))
        fail_msg("engine: %s", err.msg);
    char e2[512];
    if (kvbt_greedy_text(g->tok, g->m->d.n_vocab, logits, n_gen, cpu_step, &c, out, cap, e2, sizeof e2))
        fail_msg("%s", e2);
    free(logits);
    free(ids);
    kvb_seq_free(c.s);
    kvb_engine_free(c.e);
}

static void test_greedy_answers(void **state) {
    (void)state;
    SKIP_IF_NO_FILE();
    gemma g = {0};
    gemma_open(&g, g_path);
    const struct {
        const char *prompt, *expect;
    } cases[] = {
        {"The capital of France is Paris. The capital of Germany is", "Berlin"},
        {"The capital of Japan is Tokyo. The capital of Italy is", "Rome"},
        {"Monday, Tuesday, Wednesday,", "Thursday"},
    };
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        char text[1024];
        greedy(&g, cases[i].prompt, 8, text, sizeof text);
        print_message("  greedy: \"%s\" -> \"%s\"\n", cases[i].prompt, text);
        if (!strstr(text, cases[i].expect)) fail_msg("\"%s\": no \"%s\" in \"%s\"", cases[i].prompt, cases[i].expect, text);
    }
    gemma_close(&g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logits_vs_reference),
        cmocka_unit_test(test_f32_weights_short_window),
        cmocka_unit_test(test_greedy_answers),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
