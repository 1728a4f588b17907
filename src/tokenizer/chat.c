/* tokenizer/chat.c — chat templates without a Jinja engine: the family is recognised from marker
 * strings in tokenizer.chat_template, and each family's rendering is hand-written from that
 * family's reference Jinja template (the derivations are spelled out in tests/test_tokenizer_chat.c).
 * The one deliberate difference from the Jinja output: a template's leading {{ bos_token }} is
 * left out, because callers tokenize the result with add_special=true and the tokenizer adds BOS
 * by the vocabulary's rule (llama.cpp does the same); BOS/EOS text inside the conversation stays.
 * System messages on families whose reference template has none are merged as documented below. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

static const char *const family_names[KVB_CHAT_COUNT_] = {"llama2", "llama3", "chatml", "mistral", "phi3", "gemma"};

const char *kvb_chat_family_name(kvb_chat_family f) {
    return (unsigned)f < KVB_CHAT_COUNT_ ? family_names[f] : "unknown";
}

static const char supported[] =
    "llama2, llama3, chatml (Qwen), mistral, phi3, gemma";

kvb_status kvb_chat_family_from_name(const char *name, kvb_chat_family *out, kvb_err *err) {
    static const struct {
        const char *name;
        kvb_chat_family f;
    } alias[] = {
        {"llama2", KVB_CHAT_LLAMA2}, {"llama-2", KVB_CHAT_LLAMA2}, {"llama3", KVB_CHAT_LLAMA3},
        {"llama-3", KVB_CHAT_LLAMA3}, {"chatml", KVB_CHAT_CHATML}, {"qwen", KVB_CHAT_CHATML},
        {"qwen2", KVB_CHAT_CHATML}, {"qwen3", KVB_CHAT_CHATML}, {"mistral", KVB_CHAT_MISTRAL},
        {"phi3", KVB_CHAT_PHI3}, {"phi-3", KVB_CHAT_PHI3}, {"gemma", KVB_CHAT_GEMMA},
    };
    for (size_t i = 0; name && i < KVB_ARRAY_LEN(alias); i++)
        if (strcmp(name, alias[i].name) == 0) {
            *out = alias[i].f;
            return KVB_OK;
        }
    return kvb_err_set(err, KVB_ERR_INVALID, "unknown chat template '%s' (supported: %s)", name ? name : "", supported);
}

kvb_status kvb_chat_family_detect(const char *tmpl, kvb_chat_family *out, kvb_err *err) {
    if (!tmpl) tmpl = "";
    if (strstr(tmpl, "<|im_start|>")) *out = KVB_CHAT_CHATML;
    else if (strstr(tmpl, "<|start_header_id|>") && strstr(tmpl, "<|end_header_id|>")) *out = KVB_CHAT_LLAMA3;
    else if (strstr(tmpl, "<start_of_turn>")) *out = KVB_CHAT_GEMMA;
    else if (strstr(tmpl, "<|user|>") && strstr(tmpl, "<|end|>")) *out = KVB_CHAT_PHI3;
    else if (strstr(tmpl, "[INST]") && strstr(tmpl, "<<SYS>>")) *out = KVB_CHAT_LLAMA2;
    else if (strstr(tmpl, "[INST]")) *out = KVB_CHAT_MISTRAL;
    else
        return kvb_err_set(err, KVB_ERR_UNSUPPORTED,
                           "the model's chat template is not one we recognise (supported families: %s); "
                           "pass --chat-template NAME to pick one",
                           supported);
    return KVB_OK;
}

/* ---- a small string builder ------------------------------------------------------------------- */

typedef kvb_strbuf sbuf;
static void put_n(sbuf *b, const char *s, size_t n) { kvb_strbuf_putn(b, s, n); }
static void put(sbuf *b, const char *s) { kvb_strbuf_put(b, s); }

/* Length of the whitespace character (Python's str.isspace(): what str.strip() and Jinja's trim
 * remove) that s[0..n) starts with, else 0: U+0009-000D, U+001C-0020, U+0085, U+00A0, U+1680,
 * U+2000-200A, U+2028, U+2029, U+202F, U+205F, U+3000. Exact UTF-8 byte patterns, so any bytes
 * are safe. */
static size_t space_len(const unsigned char *s, size_t n) {
    if (n >= 1 && ((s[0] >= 0x09 && s[0] <= 0x0D) || (s[0] >= 0x1C && s[0] <= 0x20))) return 1;
    if (n >= 2 && s[0] == 0xC2 && (s[1] == 0x85 || s[1] == 0xA0)) return 2;
    if (n >= 3 && s[0] == 0xE1 && s[1] == 0x9A && s[2] == 0x80) return 3;
    if (n >= 3 && s[0] == 0xE2 && s[1] == 0x80 &&
        (s[2] <= 0x8A || s[2] == 0xA8 || s[2] == 0xA9 || s[2] == 0xAF) && s[2] >= 0x80) return 3;
    if (n >= 3 && s[0] == 0xE2 && s[1] == 0x81 && s[2] == 0x9F) return 3;
    if (n >= 3 && s[0] == 0xE3 && s[1] == 0x80 && s[2] == 0x80) return 3;
    return 0;
}

/* Python's str.strip() / Jinja's trim: whitespace as str.isspace() has it, Unicode included */
static void put_trim(sbuf *b, const char *str) {
    const unsigned char *s = (const unsigned char *)str;
    size_t n = strlen(str), a = 0, k;
    while (a < n && (k = space_len(s + a, n - a)) != 0) a += k;
    for (bool more = true; more && n > a;) {
        more = false;
        for (k = 1; k <= 3 && k <= n - a; k++)
            if (space_len(s + n - k, k) == k) {
                n -= k;
                more = true;
                break;
            }
    }
    put_n(b, str + a, n - a);
}

static bool is_role(const kvb_chat_msg *m, const char *r) { return m->role && strcmp(m->role, r) == 0; }
static const char *content(const kvb_chat_msg *m) { return m->content ? m->content : ""; }

/* ---- families ------------------------------------------------------------------------------------
 * Each renders the reference template's output minus its leading bos_token. */

static void render_llama2(sbuf *b, const kvb_chat_msg *m, size_t n) {
    /* system folded into the first turn as <<SYS>>\n...\n<</SYS>>\n\n; each user turn is
     * bos + "[INST] " + strip(content) + " [/INST]", each assistant turn " " + strip + " " + eos */
    size_t i = 0;
    const char *sys = NULL;
    if (n && is_role(&m[0], "system")) sys = content(&m[0]), i = 1;
    bool first = true;
    for (; i < n; i++) {
        if (is_role(&m[i], "user")) {
            if (!first) put(b, "<s>");
            put(b, "[INST] ");
            if (first && sys) {
                sbuf c = {0};
                put(&c, "<<SYS>>\n");
                put(&c, sys);
                put(&c, "\n<</SYS>>\n\n");
                put(&c, content(&m[i]));
                if (c.oom) b->oom = true;
                else put_trim(b, c.p);
                free(c.p);
            } else {
                put_trim(b, content(&m[i]));
            }
            put(b, " [/INST]");
        } else if (is_role(&m[i], "assistant")) {
            put(b, " ");
            put_trim(b, content(&m[i]));
            put(b, " </s>");
        }
        first = false;
    }
}

static void render_llama3(sbuf *b, const kvb_chat_msg *m, size_t n, bool gen) {
    for (size_t i = 0; i < n; i++) {
        put(b, "<|start_header_id|>");
        put(b, m[i].role ? m[i].role : "user");
        put(b, "<|end_header_id|>\n\n");
        put_trim(b, content(&m[i]));
        put(b, "<|eot_id|>");
    }
    if (gen) put(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

static void render_chatml(sbuf *b, const kvb_chat_msg *m, size_t n, bool gen) {
    for (size_t i = 0; i < n; i++) {
        put(b, "<|im_start|>");
        put(b, m[i].role ? m[i].role : "user");
        put(b, "\n");
        put(b, content(&m[i]));
        put(b, "<|im_end|>\n");
    }
    if (gen) put(b, "<|im_start|>assistant\n");
}

/* Mistral-7B-Instruct v0.1/v0.2: "[INST] " + user + " [/INST]", assistant + eos. Its template
 * rejects a system role; we prepend a system message to the next user message with "\n\n"
 * (what later Mistral templates do). */
static void render_mistral(sbuf *b, const kvb_chat_msg *m, size_t n) {
    const char *sys = NULL;
    for (size_t i = 0; i < n; i++) {
        if (is_role(&m[i], "system")) {
            sys = content(&m[i]);
        } else if (is_role(&m[i], "user")) {
            put(b, "[INST] ");
            if (sys) {
                put(b, sys);
                put(b, "\n\n");
                sys = NULL;
            }
            put(b, content(&m[i]));
            put(b, " [/INST]");
        } else if (is_role(&m[i], "assistant")) {
            put(b, content(&m[i]));
            put(b, "</s>");
        }
    }
}

/* Phi-3 (the template in Phi-3-mini's GGUF): user -> "<|user|>\n" + c + "<|end|>\n<|assistant|>\n",
 * assistant -> c + "<|end|>\n"; the generation prompt is part of every user turn. That template
 * drops system messages; we render them as Phi-3's later template does: "<|system|>\n" + c +
 * "<|end|>\n". */
static void render_phi3(sbuf *b, const kvb_chat_msg *m, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (is_role(&m[i], "user")) {
            put(b, "<|user|>\n");
            put(b, content(&m[i]));
            put(b, "<|end|>\n<|assistant|>\n");
        } else if (is_role(&m[i], "assistant")) {
            put(b, content(&m[i]));
            put(b, "<|end|>\n");
        } else if (is_role(&m[i], "system")) {
            put(b, "<|system|>\n");
            put(b, content(&m[i]));
            put(b, "<|end|>\n");
        }
    }
}

/* Gemma: "<start_of_turn>" + (assistant -> "model") + "\n" + trim(c) + "<end_of_turn>\n"; the
 * generation prompt "<start_of_turn>model\n". Gemma (1/2) rejects a system role; we prepend it
 * to the first user turn as system + "\n\n", as Gemma 3's template does. */
static void render_gemma(sbuf *b, const kvb_chat_msg *m, size_t n, bool gen) {
    const char *sys = NULL;
    for (size_t i = 0; i < n; i++) {
        if (is_role(&m[i], "system")) {
            sys = content(&m[i]);
            continue;
        }
        bool asst = is_role(&m[i], "assistant");
        put(b, "<start_of_turn>");
        put(b, asst ? "model" : (m[i].role ? m[i].role : "user"));
        put(b, "\n");
        if (sys && !asst) {
            put(b, sys);
            put(b, "\n\n");
            sys = NULL;
        }
        put_trim(b, content(&m[i]));
        put(b, "<end_of_turn>\n");
    }
    if (gen) put(b, "<start_of_turn>model\n");
}

kvb_status kvb_chat_render(kvb_chat_family f, const kvb_chat_msg *msgs, size_t n_msgs, bool add_generation_prompt,
                           char **out, kvb_err *err) {
    *out = NULL;
    if (n_msgs && !msgs) return kvb_err_set(err, KVB_ERR_INVALID, "kvb_chat_render: no messages");
    sbuf b = {0};
    put(&b, "");
    switch (f) {
    case KVB_CHAT_LLAMA2: render_llama2(&b, msgs, n_msgs); break;
    case KVB_CHAT_LLAMA3: render_llama3(&b, msgs, n_msgs, add_generation_prompt); break;
    case KVB_CHAT_CHATML: render_chatml(&b, msgs, n_msgs, add_generation_prompt); break;
    case KVB_CHAT_MISTRAL: render_mistral(&b, msgs, n_msgs); break;
    case KVB_CHAT_PHI3: render_phi3(&b, msgs, n_msgs); break;
    case KVB_CHAT_GEMMA: render_gemma(&b, msgs, n_msgs, add_generation_prompt); break;
    default:
        free(b.p);
        return kvb_err_set(err, KVB_ERR_INVALID, "unknown chat template family %d (supported: %s)", (int)f, supported);
    }
    if (b.oom) {
        free(b.p);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory rendering a chat");
    }
    *out = b.p;
    return KVB_OK;
}
