/* tests/test_tokenizer_chat.c — chat template families: detection from real template text and
 * rendering against exact strings.
 *
 * How the fixtures were derived: each family's reference Jinja template is quoted below (the
 * template text shipped with the model named). Evaluating it by hand on the conversation
 *   [system "You are a helpful assistant."] user "Hello", assistant " Hi there! ",
 *   user "  What is 2+2?\n", add_generation_prompt=true
 * gives the strings in the tests (we also rendered them with Python's jinja2 once to be sure);
 * bos_token/eos_token are the family's: llama2/mistral/phi3 "<s>"/"</s>", llama3
 * "<|begin_of_text|>"/"<|eot_id|>", gemma "<bos>"/"<eos>", chatml none/"<|im_end|>".
 * kvb_chat_render's documented difference: the template's LEADING bos_token is left out (the
 * tokenizer adds BOS); so every fixture is "Jinja output minus its leading bos_token text".
 * Key points of each derivation:
 *  - llama2: the system message is folded into the first user turn inside <<SYS>>..<</SYS>>;
 *    content.strip() trims; every user turn is bos+"[INST] "+c+" [/INST]", every assistant
 *    turn " "+c+" "+eos; no generation prompt exists in this template.
 *  - llama3: '<|start_header_id|>'+role+'<|end_header_id|>\n\n'+ content|trim +'<|eot_id|>'
 *    (the filter binds tighter than +, so only the content is trimmed); prompt adds the
 *    assistant header.
 *  - chatml (generic, and Qwen3's real template, which renders the same for this conversation:
 *    the only assistant message precedes the last user query, so no <think> block):
 *    '<|im_start|>'+role+'\n'+content+'<|im_end|>\n', no trimming.
 *  - mistral (v0.1/v0.2): bos, '[INST] '+c+' [/INST]', assistant c+eos; no trim; system raises.
 *  - phi3 (the template inside Phi-3-mini's GGUF): bos, user '<|user|>\n'+c+'<|end|>\n<|assistant|>\n',
 *    assistant c+'<|end|>\n'; system messages are dropped by that template.
 *  - gemma (gemma-7b-it): bos, '<start_of_turn>'+(assistant->model)+'\n'+ c|trim
 *    +'<end_of_turn>\n', prompt '<start_of_turn>model\n'; system raises.
 *  - gemma 3 (T_GEMMA3, Google's Gemma 3 template): the same turns, and a system message is
 *    allowed: its content + '\n\n' goes in front of the first user turn (test_render_gemma3).
 * Families whose template rejects or drops a system message get our documented extension
 * (tested separately): mistral/gemma prepend it to the first user message with "\n\n", phi3
 * renders "<|system|>\n...<|end|>\n" as Phi-3's later template does. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_gguf.h"
#include "kvb_tokenizer.h"
#include "kvbt.h"

/* The reference templates (Jinja text as stored in tokenizer_config.json / GGUF). */
static const char T_LLAMA2[] =
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif "
    "%}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if "
    "loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if "
    "message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] "
    "== 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";
static const char T_LLAMA3[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
static const char T_CHATML[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
static const char T_MISTRAL[] =
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if "
    "message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles "
    "are supported!') }}{% endif %}{% endfor %}";
static const char T_PHI3[] =
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}{{'<|user|>' + '\n' + "
    "message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}{% elif (message['role'] == 'assistant') "
    "%}{{message['content'] + '<|end|>' + '\n'}}{% endif %}{% endfor %}";
static const char T_GEMMA[] =
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% "
    "endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if "
    "(message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif "
    "%}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if "
    "add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}";

/* Gemma 3's official template: "chat_template" of Google's Gemma 3 instruction-tuned
 * tokenizer_config.json (google/gemma-3-*-it; the GGUF we test with, gemma-3-270m-q4_k_m.gguf,
 * carries no tokenizer.chat_template). Whitespace and the \n escapes inside the Jinja string
 * literals as stored there; rendering does not depend on either (every tag is {%- -%}). Unlike
 * gemma-7b-it's it takes a system message: its content, untrimmed, + "\n\n" is put in front of
 * the first (user) turn's trimmed content. The fixtures in test_render_gemma3 are this template
 * rendered with jinja2 as transformers' apply_chat_template does (trim_blocks, lstrip_blocks;
 * bos_token "<bos>"), minus the leading "<bos>". */
static const char T_GEMMA3[] =
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n";

static const kvb_chat_msg CONV_SYS[] = {
    {"system", "You are a helpful assistant."},
    {"user", "Hello"},
    {"assistant", " Hi there! "},
    {"user", "  What is 2+2?\n"},
};
static const kvb_chat_msg *CONV = CONV_SYS + 1; /* without the system message */

static void check(kvb_chat_family f, const kvb_chat_msg *m, size_t n, const char *want) {
    char *out = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_chat_render(f, m, n, true, &out, &err), KVB_OK);
    if (strcmp(out, want) != 0) fail_msg("%s rendered\n[%s]\nwanted\n[%s]", kvb_chat_family_name(f), out, want);
    free(out);
}

static void detect_is(const char *tmpl, kvb_chat_family want) {
    kvb_chat_family f = KVB_CHAT_COUNT_;
    kvb_err err = {0};
    assert_int_equal(kvb_chat_family_detect(tmpl, &f, &err), KVB_OK);
    assert_int_equal(f, want);
}

static void test_detect(void **state) {
    (void)state;
    detect_is(T_LLAMA2, KVB_CHAT_LLAMA2);
    detect_is(T_LLAMA3, KVB_CHAT_LLAMA3);
    detect_is(T_CHATML, KVB_CHAT_CHATML);
    detect_is(T_MISTRAL, KVB_CHAT_MISTRAL);
    detect_is(T_PHI3, KVB_CHAT_PHI3);
    detect_is(T_GEMMA, KVB_CHAT_GEMMA);
    kvb_chat_family f;
    kvb_err err = {0};
    assert_int_equal(kvb_chat_family_detect("{{ messages }}", &f, &err), KVB_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "llama2, llama3, chatml"));
    assert_non_null(strstr(err.msg, "--chat-template"));
    assert_int_equal(kvb_chat_family_detect(NULL, &f, &err), KVB_ERR_UNSUPPORTED);
    /* names */
    for (int i = 0; i < KVB_CHAT_COUNT_; i++) {
        assert_int_equal(kvb_chat_family_from_name(kvb_chat_family_name((kvb_chat_family)i), &f, &err), KVB_OK);
        assert_int_equal(f, i);
    }
    assert_int_equal(kvb_chat_family_from_name("qwen", &f, &err), KVB_OK);
    assert_int_equal(f, KVB_CHAT_CHATML);
    assert_int_equal(kvb_chat_family_from_name("vicuna", &f, &err), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "gemma"));
}

/* The templates that ship with our test data. */
static void test_detect_real_templates(void **state) {
    (void)state;
    char path[1024];
    kvbt_require_vocab("phi-3.gguf", path, sizeof path);
    kvb_gguf *g = NULL;
    kvb_err err = {0};
    if (kvb_gguf_open(path, &g, &err) != KVB_OK) fail_msg("%s", err.msg);
    const kvb_gguf_kv *kv = kvb_gguf_find(g, "tokenizer.chat_template");
    assert_non_null(kv);
    char *t = strndup(kv->str.ptr, kv->str.len);
    assert_string_equal(t, T_PHI3); /* the phi3 fixture's template is this file's */
    detect_is(t, KVB_CHAT_PHI3);
    free(t);
    kvb_gguf_close(g);
}

static void test_render_llama2(void **state) {
    (void)state;
    check(KVB_CHAT_LLAMA2, CONV_SYS, 4,
          "[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\n\nHello [/INST] Hi there! </s><s>[INST] What is "
          "2+2? [/INST]");
    check(KVB_CHAT_LLAMA2, CONV, 3, "[INST] Hello [/INST] Hi there! </s><s>[INST] What is 2+2? [/INST]");
}

static void test_render_llama3(void **state) {
    (void)state;
    check(KVB_CHAT_LLAMA3, CONV_SYS, 4,
          "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
          "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
          "<|start_header_id|>assistant<|end_header_id|>\n\nHi there!<|eot_id|>"
          "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
          "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

static void test_render_chatml(void **state) {
    (void)state;
    check(KVB_CHAT_CHATML, CONV_SYS, 4,
          "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
          "<|im_start|>assistant\n Hi there! <|im_end|>\n<|im_start|>user\n  What is 2+2?\n<|im_end|>\n"
          "<|im_start|>assistant\n");
    /* without the generation prompt */
    char *out = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_chat_render(KVB_CHAT_CHATML, CONV, 1, false, &out, &err), KVB_OK);
    assert_string_equal(out, "<|im_start|>user\nHello<|im_end|>\n");
    free(out);
}

static void test_render_mistral(void **state) {
    (void)state;
    check(KVB_CHAT_MISTRAL, CONV, 3, "[INST] Hello [/INST] Hi there! </s>[INST]   What is 2+2?\n [/INST]");
}

static void test_render_phi3(void **state) {
    (void)state;
    check(KVB_CHAT_PHI3, CONV, 3,
          "<|user|>\nHello<|end|>\n<|assistant|>\n Hi there! <|end|>\n<|user|>\n  What is 2+2?\n<|end|>\n"
          "<|assistant|>\n");
}

static void test_render_gemma(void **state) {
    (void)state;
    check(KVB_CHAT_GEMMA, CONV, 3,
          "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\nHi there!<end_of_turn>\n"
          "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n");
}

static void check_gen(kvb_chat_family f, const kvb_chat_msg *m, size_t n, bool gen, const char *want) {
    char *out = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_chat_render(f, m, n, gen, &out, &err), KVB_OK);
    if (strcmp(out, want) != 0)
        fail_msg("%s (generation prompt %d) rendered\n[%s]\nwanted\n[%s]", kvb_chat_family_name(f), gen, out, want);
    free(out);
}

/* Gemma 3 (T_GEMMA3): a single user turn, system + user, user/assistant/user, each with and
 * without the generation prompt; and whitespace: system content kept as it is, turns trimmed. */
static void test_render_gemma3(void **state) {
    (void)state;
    detect_is(T_GEMMA3, KVB_CHAT_GEMMA);
    static const struct {
        const kvb_chat_msg *m;
        size_t n;
        const char *want; /* with the generation prompt; without it, the same minus "<start_of_turn>model\n" */
    } cases[] = {
        {CONV_SYS + 1, 1, "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"},
        {CONV_SYS, 2,
         "<start_of_turn>user\nYou are a helpful assistant.\n\nHello<end_of_turn>\n<start_of_turn>model\n"},
        {CONV_SYS + 1, 3,
         "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\nHi there!<end_of_turn>\n"
         "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"},
        {CONV_SYS, 4,
         "<start_of_turn>user\nYou are a helpful assistant.\n\nHello<end_of_turn>\n<start_of_turn>model\nHi "
         "there!<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"},
    };
    static const char prompt[] = "<start_of_turn>model\n";
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        check_gen(KVB_CHAT_GEMMA, cases[i].m, cases[i].n, true, cases[i].want);
        size_t len = strlen(cases[i].want) - strlen(prompt);
        assert_string_equal(cases[i].want + len, prompt);
        char *want = strndup(cases[i].want, len);
        assert_non_null(want);
        check_gen(KVB_CHAT_GEMMA, cases[i].m, cases[i].n, false, want);
        free(want);
    }
    const kvb_chat_msg ws[] = {{"system", "  Be brief.\n"}, {"user", "\tHi\t"}};
    check_gen(KVB_CHAT_GEMMA, ws, 2, true, "<start_of_turn>user\n  Be brief.\n\n\nHi<end_of_turn>\n<start_of_turn>model\n");
}

/* `| trim` and .strip() are Python's str.strip(): Unicode whitespace goes too (U+00A0, U+3000,
 * U+2028, U+0085, U+001C ...; jinja2 renders T_GEMMA3 with content "\u00a0\u3000 Hi\x1c\u2028\x85"
 * as "Hi"); other characters and ill-formed UTF-8 stay. */
static void test_trim_unicode(void **state) {
    (void)state;
    const kvb_chat_msg m[] = {{"user", "\xc2\xa0\xe3\x80\x80 Hi\x1c\xe2\x80\xa8\xc2\x85"}};
    check_gen(KVB_CHAT_GEMMA, m, 1, false, "<start_of_turn>user\nHi<end_of_turn>\n");
    check_gen(KVB_CHAT_LLAMA3, m, 1, false, "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
    const kvb_chat_msg keep[] = {{"user", "\xe2\x80\x8b x \xe2\x80\xa8\xe2\x80"}}; /* ZWSP is not whitespace; a cut char */
    check_gen(KVB_CHAT_GEMMA, keep, 1, false, "<start_of_turn>user\n\xe2\x80\x8b x \xe2\x80\xa8\xe2\x80<end_of_turn>\n");
    const kvb_chat_msg all[] = {{"user", " \xe2\x80\x83\xe1\x9a\x80\xe2\x81\x9f\xe2\x80\xaf\t"}};
    check_gen(KVB_CHAT_GEMMA, all, 1, false, "<start_of_turn>user\n<end_of_turn>\n");
}

/* Our documented handling of system messages where the reference template has none. */
static void test_system_extensions(void **state) {
    (void)state;
    check(KVB_CHAT_MISTRAL, CONV_SYS, 4,
          "[INST] You are a helpful assistant.\n\nHello [/INST] Hi there! </s>[INST]   What is 2+2?\n [/INST]");
    check(KVB_CHAT_GEMMA, CONV_SYS, 4,
          "<start_of_turn>user\nYou are a helpful assistant.\n\nHello<end_of_turn>\n<start_of_turn>model\nHi "
          "there!<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n");
    check(KVB_CHAT_PHI3, CONV_SYS, 4,
          "<|system|>\nYou are a helpful assistant.<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\n Hi there! "
          "<|end|>\n<|user|>\n  What is 2+2?\n<|end|>\n<|assistant|>\n");
}

/* The Qwen3 template in the test vocabularies' qwen2-tokenizer_config.json is detected as chatml,
 * and a single user message renders exactly as that template does. */
static void test_qwen_config_template(void **state) {
    (void)state;
    char path[1024];
    kvbt_require_vocab("qwen2-tokenizer_config.json", path, sizeof path);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    char *buf = malloc(1 << 16);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    fclose(f);
    buf[n] = 0;
    assert_non_null(strstr(buf, "<|im_start|>"));
    detect_is(buf, KVB_CHAT_CHATML); /* the raw JSON contains the template text */
    free(buf);
    kvb_chat_msg m = {"user", "Hello"};
    check(KVB_CHAT_CHATML, &m, 1, "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_detect),          cmocka_unit_test(test_detect_real_templates),
        cmocka_unit_test(test_render_llama2),   cmocka_unit_test(test_render_llama3),
        cmocka_unit_test(test_render_chatml),   cmocka_unit_test(test_render_mistral),
        cmocka_unit_test(test_render_phi3),     cmocka_unit_test(test_render_gemma),
        cmocka_unit_test(test_system_extensions), cmocka_unit_test(test_qwen_config_template),
        cmocka_unit_test(test_render_gemma3),
        cmocka_unit_test(test_trim_unicode),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
