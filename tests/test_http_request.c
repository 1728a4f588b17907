/* tests/test_http_request.c — request parsing and validation (issue 6, item 3 and "malformed HTTP
 * or JSON gets a 4xx"): minimal and full valid chat and completion requests give the documented
 * fields and defaults; a table of wrong types, out-of-range values, malformed JSON and unsupported
 * features gives a 400 that names the param; hostile bytes (NUL, "\u0000", invalid UTF-8, deep
 * nesting, trailing garbage, huge numbers) are refused, never truncated; strings are taken exactly
 * as sent (an invalid "\u" escape, a lone surrogate or "\u0000" is a 400 naming the field, valid
 * escapes and pairs decode to the right bytes); every route refuses a field it does not know (and a
 * key sent twice) naming it, and takes the fields OpenAI's and vLLM's clients send; and every
 * prefix of a valid body parses or fails cleanly (run under ASan for memory safety). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h" /* the UTF-8 repair */
#include "kvb_http.h"

static kvb_completion_req *parse_ok(kvb_api api, const char *body) {
    kvb_completion_req *r = NULL;
    kvb_http_error e = {0};
    kvb_status st = kvb_completion_req_parse(api, body, strlen(body), &r, &e);
    if (st != KVB_OK) fail_msg("expected %s to parse, got %d (%s, param %s)", body, e.status, e.message, e.param);
    assert_non_null(r);
    return r;
}

static void test_chat_minimal(void **state) {
    (void)state;
    kvb_completion_req *r =
        parse_ok(KVB_API_CHAT_COMPLETIONS, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}");
    assert_int_equal(r->api, KVB_API_CHAT_COMPLETIONS);
    assert_string_equal(r->model, "m");
    assert_int_equal(r->n_messages, 1);
    assert_string_equal(r->messages[0].role, "user");
    assert_string_equal(r->messages[0].content, "hi");
    assert_null(r->prompt);
    assert_null(r->prompt_tokens);
    assert_true(r->max_tokens == -1);
    assert_true(r->temperature == 1.0);
    assert_true(r->top_p == 1.0);
    assert_int_equal(r->top_k, 0);
    assert_false(r->has_seed);
    assert_int_equal(r->n_stop, 0);
    assert_false(r->stream);
    assert_false(r->include_usage);
    assert_false(r->ignore_eos);
    assert_int_equal(r->n_logit_bias, 0);
    assert_false(r->logprobs);
    assert_int_equal(r->bridge, KVB_BRIDGE_AUTO);
    kvb_completion_req_free(r);
}

static void test_chat_full(void **state) {
    (void)state;
    const char *body =
        "{\"model\":\"tiny\",\"messages\":["
        "{\"role\":\"developer\",\"content\":\"be brief\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"part one\"},{\"type\":\"text\",\"text\":\"part two\"}],\"name\":\"x\"},"
        "{\"role\":\"assistant\",\"content\":null},"
        "{\"role\":\"user\",\"content\":\"caf\xc3\xa9 \xe2\x82\xac\"}],"
        "\"max_tokens\":10,\"max_completion_tokens\":12,\"temperature\":0.5,\"top_p\":0.9,\"top_k\":40,"
        "\"seed\":-7,\"stop\":[\"\\n\\n\",\"END\"],\"stream\":true,\"stream_options\":{\"include_usage\":true},"
        "\"ignore_eos\":true,\"logit_bias\":{\"5\":10,\"70000\":-100.0,\"0\":0.25},\"n\":1,\"user\":\"u1\",\"frequency_penalty\":0.5,\"presence_penalty\":-1,"
        "\"logprobs\":false,\"tools\":[],\"response_format\":{\"type\":\"text\"},\"tool_choice\":\"none\","
        "\"function_call\":\"auto\",\"modalities\":[\"text\"],\"audio\":null,"
        "\"metadata\":{\"k\":\"v\"},\"store\":false,\"service_tier\":\"auto\",\"parallel_tool_calls\":true,"
        "\"kvbridge\":{\"bridge\":\"force\"}}";
    kvb_completion_req *r = parse_ok(KVB_API_CHAT_COMPLETIONS, body);
    assert_string_equal(r->model, "tiny");
    assert_int_equal(r->n_messages, 4);
    assert_string_equal(r->messages[0].role, "system");
    assert_string_equal(r->messages[0].content, "be brief");
    assert_string_equal(r->messages[1].content, "part one\npart two");
    assert_string_equal(r->messages[2].role, "assistant");
    assert_string_equal(r->messages[2].content, "");
    assert_string_equal(r->messages[3].content, "caf\xc3\xa9 \xe2\x82\xac");
    assert_true(r->max_tokens == 12);
    assert_true(r->temperature == 0.5);
    assert_true(r->top_p == 0.9);
    assert_int_equal(r->top_k, 40);
    assert_true(r->has_seed);
    assert_true(r->seed == -7);
    assert_int_equal(r->n_stop, 2);
    assert_string_equal(r->stop[0], "\n\n");
    assert_string_equal(r->stop[1], "END");
    assert_true(r->stream);
    assert_true(r->include_usage);
    assert_true(r->ignore_eos);
    assert_int_equal(r->n_logit_bias, 3);
    assert_int_equal(r->logit_bias_ids[0], 5);
    assert_true(r->logit_bias_values[0] == 10.0f);
    assert_int_equal(r->logit_bias_ids[1], 70000);
    assert_true(r->logit_bias_values[1] == -100.0f);
    assert_int_equal(r->logit_bias_ids[2], 0);
    assert_true(r->logit_bias_values[2] == 0.25f);
    assert_true(r->frequency_penalty == 0.5);
    assert_true(r->presence_penalty == -1);
    assert_int_equal(r->bridge, KVB_BRIDGE_FORCE);
    kvb_completion_req_free(r);

    r = parse_ok(KVB_API_CHAT_COMPLETIONS,
                 "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_k\":-1,"
                 "\"stop\":\"###\",\"kvbridge\":{\"bridge\":\"off\"},\"seed\":null,\"temperature\":null}");
    assert_int_equal(r->top_k, 0);
    assert_int_equal(r->n_stop, 1);
    assert_string_equal(r->stop[0], "###");
    assert_int_equal(r->bridge, KVB_BRIDGE_OFF);
    assert_false(r->has_seed);
    assert_true(r->temperature == 1.0);
    kvb_completion_req_free(r);
}

static void test_logprobs_fields(void **state) {
    (void)state;
    kvb_completion_req *r = parse_ok(KVB_API_CHAT_COMPLETIONS,
                                     "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                     "\"logprobs\":true,\"top_logprobs\":20}");
    assert_true(r->logprobs);
    assert_int_equal(r->top_logprobs, 20);
    kvb_completion_req_free(r);
    r = parse_ok(KVB_API_CHAT_COMPLETIONS, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                           "\"logprobs\":true}");
    assert_true(r->logprobs);
    assert_int_equal(r->top_logprobs, 0);
    kvb_completion_req_free(r);
    r = parse_ok(KVB_API_CHAT_COMPLETIONS, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                           "\"logprobs\":false,\"top_logprobs\":0}");
    assert_false(r->logprobs);
    kvb_completion_req_free(r);
    /* completions: the legacy integer; 0 is the picked token's alone, null and false are off */
    const char *cmpl[4] = {"0", "5", "null", "false"};
    for (int i = 0; i < 4; i++) {
        char body[128];
        snprintf(body, sizeof body, "{\"model\":\"m\",\"prompt\":\"x\",\"logprobs\":%s}", cmpl[i]);
        r = parse_ok(KVB_API_COMPLETIONS, body);
        assert_int_equal(r->logprobs, i < 2);
        assert_int_equal(r->top_logprobs, i == 1 ? 5 : 0);
        kvb_completion_req_free(r);
    }
    r = parse_ok(KVB_API_COMPLETIONS, "{\"model\":\"m\",\"prompt\":[1,2],\"echo\":true,\"logprobs\":1}");
    assert_true(r->echo && r->logprobs);
    kvb_completion_req_free(r);
    r = parse_ok(KVB_API_CHAT_COMPLETIONS, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                                           "\"response_format\":{\"type\":\"json_object\"}}");
    assert_true(r->json_object);
    kvb_completion_req_free(r);
    r = parse_ok(KVB_API_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"response_format\":{\"type\":\"text\"}}");
    assert_false(r->json_object);
    assert_null(r->json_schema);
    kvb_completion_req_free(r);
    /* json_schema: compiled with the request (its text is held to it), json_object with it */
    r = parse_ok(KVB_API_CHAT_COMPLETIONS, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                 "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"person-v1_2\",\"strict\":true,"
                 "\"description\":\"d\",\"schema\":{\"type\":\"object\",\"title\":\"P\",\"properties\":{\"name\":{\"type\":\"string\"},"
                 "\"age\":{\"type\":[\"integer\",\"null\"]}},\"required\":[\"name\",\"age\"],\"additionalProperties\":false}}}}");
    assert_true(r->json_object);
    assert_non_null(r->json_schema);
    kvb_json_state js;
    kvb_json_init_schema(&js, r->json_schema);
    const char *ok = "{\"name\":\"Ann\",\"age\":null}";
    assert_true(kvb_json_feed(&js, ok, strlen(ok)) && kvb_json_complete(&js));
    kvb_json_init_schema(&js, r->json_schema);
    assert_false(kvb_json_feed(&js, "{\"age\"", 6)); /* name is required and comes first */
    kvb_completion_req_free(r);
    /* without "schema": any object, as json_object */
    r = parse_ok(KVB_API_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"response_format\":{\"type\":\"json_schema\","
                 "\"json_schema\":{\"name\":\"any\"}}}");
    assert_true(r->json_object);
    assert_null(r->json_schema);
    kvb_completion_req_free(r);
    r = parse_ok(KVB_API_CHAT_COMPLETIONS, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":16}");
    assert_int_equal(r->n, 16);
    kvb_completion_req_free(r);
    r = parse_ok(KVB_API_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\"}");
    assert_int_equal(r->n, 1);
    assert_true(r->min_tokens == 0 && r->n_stop_token_ids == 0);
    kvb_completion_req_free(r);
    r = parse_ok(KVB_API_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"max_tokens\":9,\"min_tokens\":9,"
                                      "\"stop_token_ids\":[2,128009]}");
    assert_true(r->min_tokens == 9);
    assert_int_equal(r->n_stop_token_ids, 2);
    assert_int_equal(r->stop_token_ids[1], 128009);
    kvb_completion_req_free(r);
}

static void test_tokenize_bodies(void **state) {
    (void)state;
    kvb_completion_req *r = NULL;
    kvb_http_error e = {0};
    const char *b1 = "{\"prompt\":\"hi there\"}";
    assert_int_equal(kvb_tokenize_req_parse(b1, strlen(b1), &r, &e), KVB_OK);
    assert_int_equal(r->api, KVB_API_COMPLETIONS);
    assert_string_equal(r->prompt, "hi there");
    assert_null(r->model);
    assert_true(r->add_special_tokens);
    kvb_completion_req_free(r);
    const char *b2 = "{\"model\":\"m\",\"prompt\":\"hi\",\"add_special_tokens\":false,\"add_generation_prompt\":true}";
    assert_int_equal(kvb_tokenize_req_parse(b2, strlen(b2), &r, &e), KVB_OK);
    assert_string_equal(r->model, "m");
    assert_false(r->add_special_tokens);
    kvb_completion_req_free(r);
    const char *b3 = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    assert_int_equal(kvb_tokenize_req_parse(b3, strlen(b3), &r, &e), KVB_OK);
    assert_int_equal(r->api, KVB_API_CHAT_COMPLETIONS);
    assert_int_equal(r->n_messages, 1);
    assert_string_equal(r->messages[0].content, "hi");
    kvb_completion_req_free(r);
    const char *b4 = "{\"tokens\":[0,7,2147483647]}", *b5 = "{\"tokens\":[],\"model\":\"m\"}";
    assert_int_equal(kvb_detokenize_req_parse(b4, strlen(b4), &r, &e), KVB_OK);
    assert_int_equal(r->n_prompt_tokens, 3);
    assert_int_equal(r->prompt_tokens[2], INT32_MAX);
    kvb_completion_req_free(r);
    assert_int_equal(kvb_detokenize_req_parse(b5, strlen(b5), &r, &e), KVB_OK);
    assert_int_equal(r->n_prompt_tokens, 0);
    kvb_completion_req_free(r);
    /* completions never turn the special tokens off: true is taken, false refused (never ignored) */
    r = parse_ok(KVB_API_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"x\",\"add_special_tokens\":true}");
    assert_true(r->add_special_tokens);
    kvb_completion_req_free(r);
    const char *b6 = "{\"model\":\"m\",\"prompt\":\"x\",\"add_special_tokens\":false}";
    assert_int_equal(kvb_completion_req_parse(KVB_API_COMPLETIONS, b6, strlen(b6), &r, &e), KVB_ERR_INVALID);
    assert_string_equal(e.param, "add_special_tokens");
}

static void test_completion_prompts(void **state) {
    (void)state;
    kvb_completion_req *r = parse_ok(KVB_API_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"Once upon\"}");
    assert_string_equal(r->prompt, "Once upon");
    assert_null(r->prompt_tokens);
    assert_int_equal(r->n_messages, 0);
    kvb_completion_req_free(r);

    r = parse_ok(KVB_API_COMPLETIONS, "{\"model\":\"m\",\"prompt\":[\"one\"],\"max_tokens\":0}");
    assert_string_equal(r->prompt, "one");
    assert_true(r->max_tokens == 0);
    kvb_completion_req_free(r);

    r = parse_ok(KVB_API_COMPLETIONS, "{\"model\":\"m\",\"prompt\":[1, 2, 2147483647]}");
    assert_null(r->prompt);
    assert_int_equal(r->n_prompt_tokens, 3);
    assert_int_equal(r->prompt_tokens[0], 1);
    assert_int_equal(r->prompt_tokens[2], 2147483647);
    kvb_completion_req_free(r);

    r = parse_ok(KVB_API_COMPLETIONS, "{\"model\":\"m\",\"prompt\":[[5,6]],\"echo\":false,\"best_of\":1}");
    assert_int_equal(r->n_prompt_tokens, 2);
    assert_int_equal(r->prompt_tokens[1], 6);
    kvb_completion_req_free(r);

    r = parse_ok(KVB_API_COMPLETIONS, "  {\"model\":\"m\",\"prompt\":\"\"}\r\n ");
    assert_string_equal(r->prompt, "");
    kvb_completion_req_free(r);
}

typedef struct {
    kvb_api api;
    const char *body;
    const char *param; /* expected param, NULL: null */
    const char *msg;   /* substring of the message */
} bad_case;

#define CHAT KVB_API_CHAT_COMPLETIONS
#define CMPL KVB_API_COMPLETIONS
#define TOKZ ((kvb_api)100) /* the table's own tags for /tokenize and /detokenize bodies */
#define DETOK ((kvb_api)101)

/* The parser of the route a bad case is for. */
static kvb_status parse_for(kvb_api api, const char *body, kvb_completion_req **r, kvb_http_error *e) {
    if (api == TOKZ) return kvb_tokenize_req_parse(body, strlen(body), r, e);
    if (api == DETOK) return kvb_detokenize_req_parse(body, strlen(body), r, e);
    return kvb_completion_req_parse(api, body, strlen(body), r, e);
}
#define MSGS "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]"
#define CHATB(extra) "{\"model\":\"m\"," MSGS extra "}"

static const bad_case bad_cases[] = {
    /* malformed / not an object */
    {CHAT, "", NULL, "empty"},
    {CHAT, "   \n", NULL, "empty"},
    {CHAT, "{", NULL, "malformed JSON"},
    {CHAT, "{\"model\":\"m\",}", NULL, "malformed JSON"},
    {CHAT, "{\"model\":'m'}", NULL, "malformed JSON"},
    {CHAT, "[1,2]", NULL, "must be a JSON object"},
    {CHAT, "\"text\"", NULL, "must be a JSON object"},
    {CHAT, "null", NULL, "must be a JSON object"},
    {CHAT, CHATB("") " trailing", NULL, "unexpected bytes after"},
    {CHAT, CHATB("") "{}", NULL, "unexpected bytes after"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]}", "messages[0].content", "NUL"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\\ud800\"}]}", "messages[0].content", "lone UTF-16 high"},
    /* model */
    {CHAT, "{" MSGS "}", "model", "model parameter"},
    {CHAT, "{\"model\":null," MSGS "}", "model", "model parameter"},
    {CHAT, "{\"model\":7," MSGS "}", "model", "expected a string"},
    {CHAT, "{\"model\":\"\"," MSGS "}", "model", "empty string"},
    /* messages */
    {CHAT, "{\"model\":\"m\"}", "messages", "Missing required"},
    {CHAT, "{\"model\":\"m\",\"messages\":{}}", "messages", "expected an array"},
    {CHAT, "{\"model\":\"m\",\"messages\":\"hi\"}", "messages", "expected an array"},
    {CHAT, "{\"model\":\"m\",\"messages\":[]}", "messages", "empty array"},
    {CHAT, "{\"model\":\"m\",\"messages\":[\"hi\"]}", "messages[0]", "expected an object"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"content\":\"hi\"}]}", "messages[0].role", "Missing"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":1,\"content\":\"hi\"}]}", "messages[0].role", "expected a string"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"wizard\",\"content\":\"hi\"}]}", "messages[0].role", "Supported values"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"tool\",\"content\":\"hi\"}]}", "messages[0].role", "tool calling"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"ok\"},{\"role\":\"user\"}]}", "messages[1].content", "Missing"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":5}]}", "messages[0].content", "expected a string or an array"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":{}}]}", "messages[0].content", "expected a string or an array"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[]}]}", "messages[0].content", "empty array"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[\"x\"]}]}", "messages[0].content[0]", "content part object"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"x\"}]}]}", "messages[0].content[0].type", "Missing"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]}", "messages[0].content[0]", "only 'text'"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}", "messages[0].content[0].text", "Missing"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":3}]}]}", "messages[0].content[0].text", "expected a string"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}", "messages[0].content", "UTF-8"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xc0\xaf\"}]}", "messages[0].content", "UTF-8"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xed\xa0\x80\"}]}", "messages[0].content", "UTF-8"},
    /* numbers */
    {CHAT, CHATB(",\"max_tokens\":\"10\""), "max_tokens", "expected an integer"},
    {CHAT, CHATB(",\"max_tokens\":1.5"), "max_tokens", "decimal"},
    {CHAT, CHATB(",\"max_tokens\":0"), "max_tokens", "out of range"},
    {CHAT, CHATB(",\"max_tokens\":-3"), "max_tokens", "out of range"},
    {CHAT, CHATB(",\"max_tokens\":1e300"), "max_tokens", "out of range"},
    {CHAT, CHATB(",\"max_tokens\":1e999"), "max_tokens", "decimal"},
    {CHAT, CHATB(",\"max_completion_tokens\":true"), "max_completion_tokens", "expected an integer"},
    {CHAT, CHATB(",\"temperature\":\"hot\""), "temperature", "expected a number"},
    {CHAT, CHATB(",\"temperature\":2.5"), "temperature", "out of range"},
    {CHAT, CHATB(",\"temperature\":-0.1"), "temperature", "out of range"},
    {CHAT, CHATB(",\"top_p\":1.01"), "top_p", "out of range"},
    {CHAT, CHATB(",\"top_p\":[1]"), "top_p", "expected a number"},
    {CHAT, CHATB(",\"top_k\":-2"), "top_k", "out of range"},
    {CHAT, CHATB(",\"top_k\":3.5"), "top_k", "decimal"},
    {CHAT, CHATB(",\"frequency_penalty\":3"), "frequency_penalty", "out of range"},
    {CHAT, CHATB(",\"presence_penalty\":-2.5"), "presence_penalty", "out of range"},
    {CHAT, CHATB(",\"seed\":\"42\""), "seed", "expected an integer"},
    {CHAT, CHATB(",\"seed\":0.5"), "seed", "decimal"},
    {CHAT, CHATB(",\"seed\":1e19"), "seed", "out of range"},
    {CHAT, CHATB(",\"n\":17"), "n", "out of range"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"n\":2,\"echo\":true}", "echo", "n=1 only"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"max_tokens\":4,\"min_tokens\":5}", "min_tokens", "more than max_tokens"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"min_tokens\":-1}", "min_tokens", "out of range"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"stop_token_ids\":7}", "stop_token_ids", "expected an array"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"stop_token_ids\":[1,-2]}", "stop_token_ids[1]", "out of range"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"stop_token_ids\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}", "stop_token_ids", "at most 16"},
    {CHAT, CHATB(",\"n\":0"), "n", "out of range"},
    {CHAT, CHATB(",\"n\":\"1\""), "n", "expected an integer"},
    /* strings, bools, objects */
    {CHAT, CHATB(",\"user\":5"), "user", "expected a string"},
    {CHAT, CHATB(",\"stop\":5"), "stop", "string or an array"},
    {CHAT, CHATB(",\"stop\":\"\""), "stop", "empty string"},
    {CHAT, CHATB(",\"stop\":[\"a\",1]"), "stop[1]", "expected a string"},
    {CHAT, CHATB(",\"stop\":[\"a\",\"\"]"), "stop[1]", "empty string"},
    {CHAT, CHATB(",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]"), "stop", "maximum length 4"},
    {CHAT, CHATB(",\"stream\":\"true\""), "stream", "expected a boolean"},
    {CHAT, CHATB(",\"stream\":1"), "stream", "expected a boolean"},
    {CHAT, CHATB(",\"ignore_eos\":\"yes\""), "ignore_eos", "expected a boolean"},
    {CHAT, CHATB(",\"logit_bias\":[1,2]"), "logit_bias", "expected an object"},
    {CHAT, CHATB(",\"logit_bias\":{\"abc\":1}"), "logit_bias", "expected a token id"},
    {CHAT, CHATB(",\"logit_bias\":{\"-1\":1}"), "logit_bias", "expected a token id"},
    {CHAT, CHATB(",\"logit_bias\":{\"\":1}"), "logit_bias", "expected a token id"},
    {CHAT, CHATB(",\"logit_bias\":{\"99999999999\":1}"), "logit_bias", "expected a token id"},
    {CHAT, CHATB(",\"logit_bias\":{\"7\":100.5}"), "logit_bias", "[-100, 100]"},
    {CHAT, CHATB(",\"logit_bias\":{\"7\":\"high\"}"), "logit_bias", "[-100, 100]"},
    {CHAT, CHATB(",\"stream\":true,\"stream_options\":true"), "stream_options", "expected an object"},
    {CHAT, CHATB(",\"stream_options\":{\"include_usage\":true}"), "stream_options", "only allowed when"},
    {CHAT, CHATB(",\"stream\":true,\"stream_options\":{\"include_usage\":\"yes\"}"), "stream_options.include_usage", "expected a boolean"},
    {CHAT, CHATB(",\"kvbridge\":\"force\""), "kvbridge", "expected an object"},
    {CHAT, CHATB(",\"kvbridge\":{\"bridge\":\"sometimes\"}"), "kvbridge.bridge", "'auto', 'force' and 'off'"},
    {CHAT, CHATB(",\"kvbridge\":{\"bridge\":1}"), "kvbridge.bridge", "expected a string"},
    {CHAT, CHATB(",\"kvbridge\":{\"brigde\":\"off\"}"), "kvbridge", "Unknown kvbridge option"},
    /* known features we cannot honour */
    {CHAT, CHATB(",\"logprobs\":1"), "logprobs", "expected a boolean"},
    {CHAT, CHATB(",\"top_logprobs\":3"), "top_logprobs", "requires 'logprobs' to be true"},
    {CHAT, CHATB(",\"logprobs\":false,\"top_logprobs\":3"), "top_logprobs", "requires 'logprobs' to be true"},
    {CHAT, CHATB(",\"logprobs\":true,\"top_logprobs\":21"), "top_logprobs", "out of range"},
    {CHAT, CHATB(",\"logprobs\":true,\"top_logprobs\":-1"), "top_logprobs", "out of range"},
    {CHAT, CHATB(",\"logprobs\":true,\"top_logprobs\":2.5"), "top_logprobs", "decimal"},
    {CHAT, CHATB(",\"tools\":[{\"type\":\"function\"}]"), "tools", "not supported"},
    {CHAT, CHATB(",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{}}"), "response_format", "'response_format.json_schema.name'"},
    /* response_format json_schema: OpenAI's shape, then the schema compiled (its path in the message) */
#define RFS(js) CHATB(",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":" js "}")
#define SCH(schema) RFS("{\"name\":\"n\",\"schema\":" schema "}")
    {CHAT, CHATB(",\"response_format\":{\"type\":\"json_schema\"}"), "response_format", "Missing required parameter: 'response_format.json_schema'"},
    {CHAT, RFS("\"x\""), "response_format", "expected an object, but got a string"},
    {CHAT, RFS("{\"name\":5}"), "response_format.json_schema.name", "expected a string"},
    {CHAT, RFS("{\"name\":\"\"}"), "response_format.json_schema.name", "empty string"},
    {CHAT, RFS("{\"name\":\"a b\"}"), "response_format", "1 to 64 characters"},
    {CHAT, RFS("{\"name\":\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"}"), "response_format", "1 to 64 characters"},
    {CHAT, RFS("{\"name\":\"n\",\"strict\":\"yes\"}"), "response_format.json_schema.strict", "expected a boolean"},
    {CHAT, RFS("{\"name\":\"n\",\"description\":1}"), "response_format.json_schema.description", "expected a string"},
    {CHAT, RFS("{\"name\":\"n\",\"shema\":{}}"), "response_format", "Unknown parameter: 'response_format.json_schema.shema'"},
    {CHAT, SCH("[]"), "response_format", "'response_format.json_schema.schema': expected an object, but got an array"},
    {CHAT, SCH("{\"type\":\"array\"}"), "response_format", "response_format.json_schema.schema: the root schema must be {\"type\": \"object\"}"},
    {CHAT, SCH("{}"), "response_format", "the root schema must be"},
    {CHAT, SCH("{\"type\":\"object\",\"properties\":{\"age\":{\"type\":\"integer\",\"pattern\":\"x\"}}}"), "response_format",
     "response_format.json_schema.schema.properties.age: keyword 'pattern' is not supported by this server (supported: type,"},
    {CHAT, SCH("{\"type\":\"object\",\"$defs\":[]}"), "response_format", "schema: '$defs' must be an object of schemas"},
    {CHAT, SCH("{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#\"}}}"), "response_format", "schema.properties.a: '$ref' \"#\" is not supported"},
    {CHAT, SCH("{\"type\":\"object\",\"properties\":{\"a b\":{\"type\":\"array\",\"items\":{\"format\":\"date\"}}}}"),
     "response_format", "schema.properties[\"a b\"].items: keyword 'format' is not supported"},
    {CHAT, SCH("{\"type\":\"object\",\"required\":[\"a\"]}"), "response_format", "'required' names 'a', which is not in 'properties'"},
    {CHAT, SCH("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"enum\":[\"x\"]}}}"), "response_format",
     "schema.properties.a: no value of 'enum' is of the schema's 'type'"},
    {CHAT, SCH("{\"type\":\"object\",\"properties\":{\"a\":{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"number\"}]}}}"),
     "response_format", "'anyOf' alternatives 0 and 1 may both be a number"},
    {CHAT, SCH("{\"type\":\"object\",\"additionalProperties\":{\"type\":\"string\"}}"), "response_format",
     "'additionalProperties' must be true or false"},
    {CHAT, SCH("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"maxItems\":1000}}}"), "response_format",
     "'maxItems' must be an integer in [0, 255]"},

    {CHAT, CHATB(",\"response_format\":\"json_object\""), "response_format", "not supported"},
    {CHAT, CHATB(",\"tool_choice\":\"required\""), "tool_choice", "no tool calling"},
    {CHAT, CHATB(",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"}}"), "tool_choice", "no tool calling"},
    {CHAT, CHATB(",\"function_call\":{\"name\":\"f\"}"), "function_call", "no tool calling"},
    {CHAT, CHATB(",\"audio\":{\"voice\":\"alloy\",\"format\":\"wav\"}"), "audio", "text only"},
    {CHAT, CHATB(",\"modalities\":[\"text\",\"audio\"]"), "modalities", "[\"text\"]"},
    {CHAT, CHATB(",\"modalities\":\"text\""), "modalities", "[\"text\"]"},
    {CHAT, CHATB(",\"response_format\":{\"type\":5}"), "response_format", "not supported"},
    /* completions */
    {CMPL, "{\"model\":\"m\"}", "prompt", "Missing"},
    {CMPL, "{\"model\":\"m\",\"prompt\":null}", "prompt", "Missing"},
    {CMPL, "{\"model\":\"m\",\"prompt\":5}", "prompt", "expected a string"},
    {CMPL, "{\"model\":\"m\",\"prompt\":{}}", "prompt", "expected a string"},
    {CMPL, "{\"model\":\"m\",\"prompt\":[]}", "prompt", "empty array"},
    {CMPL, "{\"model\":\"m\",\"prompt\":[\"a\",\"b\"]}", "prompt", "one prompt per request"},
    {CMPL, "{\"model\":\"m\",\"prompt\":[[1],[2]]}", "prompt", "one prompt per request"},
    {CMPL, "{\"model\":\"m\",\"prompt\":[[]]}", "prompt[0]", "token list is empty"},
    {CMPL, "{\"model\":\"m\",\"prompt\":[1,-1]}", "prompt[1]", "out of range"},
    {CMPL, "{\"model\":\"m\",\"prompt\":[1,2147483648]}", "prompt[1]", "out of range"},
    {CMPL, "{\"model\":\"m\",\"prompt\":[1,2.5]}", "prompt[1]", "decimal"},
    {CMPL, "{\"model\":\"m\",\"prompt\":[1,\"x\"]}", "prompt[1]", "expected an integer"},
    {CMPL, "{\"model\":\"m\",\"prompt\":[[1,\"x\"]]}", "prompt[0][1]", "expected an integer"},
    {CMPL, "{\"model\":\"m\",\"prompt\":[true]}", "prompt[0]", "expected a string or an array"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"max_tokens\":-1}", "max_tokens", "out of range"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"echo\":1}", "echo", "expected a boolean"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"suffix\":\"y\"}", "suffix", "not supported"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"best_of\":3}", "best_of", "best_of=1"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"logprobs\":21}", "logprobs", "out of range"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"logprobs\":true}", "logprobs", "expected an integer"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"top_logprobs\":2}", "top_logprobs", "takes the number of top tokens as 'logprobs'"},
    /* /tokenize and /detokenize */
    {TOKZ, "[]", NULL, "must be a JSON object"},
    {TOKZ, "{}", "prompt", "Missing required parameter"},
    {TOKZ, "{\"prompt\":\"x\"," MSGS "}", "prompt", "not both"},
    {TOKZ, "{" MSGS ",\"add_special_tokens\":true}", "add_special_tokens", "applies to 'prompt' only"},
    {TOKZ, "{\"prompt\":\"x\",\"add_special_tokens\":1}", "add_special_tokens", "expected a boolean"},
    {TOKZ, "{\"prompt\":\"x\",\"add_generation_prompt\":false}", "add_generation_prompt", "Only add_generation_prompt=true"},
    {TOKZ, "{\"prompt\":\"x\",\"model\":5}", "model", "expected a string"},
    {TOKZ, "{\"prompt\":[1,-2]}", "prompt[1]", "out of range"},
    {DETOK, "{}", "tokens", "Missing required parameter"},
    {DETOK, "{\"tokens\":\"1 2\"}", "tokens", "expected an array"},
    {DETOK, "{\"tokens\":[1,-1]}", "tokens[1]", "out of range"},
    {DETOK, "{\"tokens\":[1.5]}", "tokens[0]", "decimal"},
    {DETOK, "{\"tokens\":[2147483648]}", "tokens[0]", "out of range"},
    /* strict strings: nothing decoded differently from what was sent */
    {TOKZ, "{\"prompt\":\"abc\\uZZZZdef\"}", "prompt", "four hex digits"},
    {TOKZ, "{\"prompt\":\"abc\\u12\"}", "prompt", "four hex digits"},
    {TOKZ, "{\"prompt\":\"abc\\u0000def\"}", "prompt", "NUL"},
    {TOKZ, "{\"prompt\":\"x\\\\\\u0000\"}", "prompt", "NUL"}, /* \\ then \u0000 */
    {TOKZ, "{\"prompt\":\"a\\ud83d b\"}", "prompt", "lone UTF-16 high"},
    {TOKZ, "{\"prompt\":\"a\\ud83d\\u0041\"}", "prompt", "lone UTF-16 high"},
    {TOKZ, "{\"prompt\":\"a\\ude00\"}", "prompt", "lone UTF-16 low"},
    {TOKZ, "{\"prompt\":\"a\\x41\"}", "prompt", "escape JSON does not have"},
    {TOKZ, "{\"prompt\":[\"ok\",\"a\\q\"]}", "prompt[1]", "escape JSON does not have"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"ok\"},{\"role\":\"user\","
           "\"content\":[{\"type\":\"text\",\"text\":\"\\uD800\"}]}]}", "messages[1].content[0].text", "lone UTF-16 high"},
    {CHAT, CHATB(",\"stop\":[\"a\",\"\\uZZZZ\"]"), "stop[1]", "four hex digits"},
    {CHAT, CHATB(",\"kvbridge\":{\"bridge\":\"o\\u0000ff\"}"), "kvbridge.bridge", "NUL"},
    {CHAT, CHATB(",\"us\\u0000er\":\"x\""), "us", "NUL"}, /* in a key: named up to the escape */
    {CHAT, "{\"model\":\"m\\uZZZZ\"," MSGS "}", "model", "four hex digits"},
    {DETOK, "{\"model\":\"\\uDFFF\",\"tokens\":[]}", "model", "lone UTF-16 low"},
    /* a key sent twice: the second would be unseen */
    {TOKZ, "{\"prompt\":\"a\",\"prompt\":\"b\"}", "prompt", "Duplicate key"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\",\"content\":\"b\"}]}",
           "messages[0].content", "Duplicate key"},
    {CHAT, CHATB(",\"kvbridge\":{\"bridge\":\"off\",\"bridge\":\"force\"}"), "kvbridge.bridge", "Duplicate key"},
    /* unknown fields, on every route */
    {CHAT, CHATB(",\"temprature\":0.2"), "temprature", "Unrecognized request argument supplied: temprature"},
    {CHAT, CHATB(",\"foo\":1"), "foo", "Unrecognized"},
    {CHAT, CHATB(",\"echo\":true"), "echo", "Unrecognized"},
    {CHAT, CHATB(",\"suffix\":\"x\""), "suffix", "Unrecognized"},
    {CHAT, CHATB(",\"foo\":null"), "foo", "Unrecognized"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"messages\":[]}", "messages", "Unrecognized"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"tools\":[]}", "tools", "Unrecognized"},
    {CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"metadata\":{}}", "metadata", "Unrecognized"},
    {TOKZ, "{\"prompt\":\"x\",\"max_tokens\":3}", "max_tokens", "Unrecognized"},
    {TOKZ, "{\"prompt\":\"x\",\"foo\":1}", "foo", "Unrecognized"},
    {DETOK, "{\"tokens\":[1],\"prompt\":\"x\"}", "prompt", "Unrecognized"},
    {DETOK, "{\"tokens\":[1],\"skip_special_tokens\":true}", "skip_special_tokens", "Unrecognized"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"contnet\":\"y\"}]}",
           "messages[0].contnet", "Unrecognized"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"x\","
           "\"cache_control\":{}}]}]}", "messages[0].content[0].cache_control", "Unrecognized"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"assistant\",\"content\":\"x\",\"tool_calls\":[{}]}]}",
           "messages[0].tool_calls", "not supported"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"assistant\",\"content\":\"x\",\"refusal\":\"no\"}]}",
           "messages[0].refusal", "not supported"},
    {CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"name\":5}]}",
           "messages[0].name", "expected a string"},
    {CHAT, CHATB(",\"stream\":true,\"stream_options\":{\"include_usage\":true,\"x\":1}"), "stream_options.x",
           "Unrecognized"},
    {CHAT, CHATB(",\"response_format\":{\"type\":\"text\",\"schema\":{}}"), "response_format.schema", "Unrecognized"},
    {CHAT, CHATB(",\"metadata\":\"x\""), "metadata", "expected an object"},
    {CHAT, CHATB(",\"store\":1"), "store", "expected a boolean"},
    {CHAT, CHATB(",\"service_tier\":[]"), "service_tier", "expected a string"},
};

static void test_bad_requests_table(void **state) {
    (void)state;
    int failures = 0;
    for (size_t i = 0; i < KVB_ARRAY_LEN(bad_cases); i++) {
        const bad_case *c = &bad_cases[i];
        kvb_completion_req *r = NULL;
        kvb_http_error e;
        memset(&e, 0x5a, sizeof e); /* the parser must fill every field it reports */
        kvb_status st = parse_for(c->api, c->body, &r, &e);
        const char *why = NULL;
        if (st != KVB_ERR_INVALID) why = "status is not KVB_ERR_INVALID";
        else if (r) why = "*out is not NULL";
        else if (e.status != 400) why = "HTTP status is not 400";
        else if (strcmp(e.type, "invalid_request_error") != 0) why = "type is not invalid_request_error";
        else if (strcmp(e.param, c->param ? c->param : "") != 0) why = "wrong param";
        else if (!strstr(e.message, c->msg)) why = "message lacks the expected words";
        if (why) {
            print_error("case %zu %s: %s\n  got status %d param '%s' message '%s'\n", i, c->body, why,
                        st == KVB_ERR_INVALID ? e.status : -1, st == KVB_ERR_INVALID ? e.param : "",
                        st == KVB_ERR_INVALID ? e.message : "");
            failures++;
        }
        kvb_completion_req_free(r);
    }
    assert_int_equal(failures, 0);
}

/* Valid escapes decode to exactly the characters sent (pairs to one 4-byte character, \\u005c to a
 * backslash), and the fields OpenAI's and vLLM's clients send are taken (ignored ones without effect). */
static void test_strict_strings_and_client_fields(void **state) {
    (void)state;
    kvb_completion_req *r = parse_ok(CMPL, "{\"model\":\"m\",\"prompt\":\"a\\ud83d\\ude00b\\u00e9\\u20ac\\u005cu0000"
                                           "\\\"\\/\\b\\f\\n\\r\\t\\\\z\"}");
    assert_string_equal(r->prompt, "a\xf0\x9f\x98\x80" "b\xc3\xa9\xe2\x82\xac\\u0000\"/\b\f\n\r\t\\z");
    kvb_completion_req_free(r);
    r = parse_ok(CHAT, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\",\"name\":\"ann\"},"
                       "{\"role\":\"assistant\",\"content\":\"yo\",\"refusal\":null,\"tool_calls\":[],\"function_call\":null,"
                       "\"audio\":null,\"annotations\":[]},{\"role\":\"user\",\"content\":\"more\"}],"
                       "\"user\":\"u-1\",\"metadata\":{\"a\":\"b\"},\"store\":true,\"service_tier\":\"default\","
                       "\"parallel_tool_calls\":false,\"prompt_cache_key\":\"k\",\"safety_identifier\":\"s\",\"seed\":3,\"n\":2,"
                       "\"stream\":true,\"stream_options\":{\"include_usage\":true,\"include_obfuscation\":false},"
                       "\"tools\":null,\"tool_choice\":\"none\",\"response_format\":{\"type\":\"json_object\"}}");
    assert_int_equal(r->n_messages, 3);
    assert_string_equal(r->messages[1].content, "yo");
    assert_true(r->include_usage && r->has_seed && r->n == 2 && r->json_object);
    kvb_completion_req_free(r);
    /* the completions fields of the openai client */
    r = parse_ok(CMPL, "{\"model\":\"m\",\"prompt\":\"x\",\"best_of\":1,\"echo\":false,\"logprobs\":null,\"suffix\":null,"
                       "\"user\":null,\"stream\":false,\"stop\":null}");
    assert_string_equal(r->prompt, "x");
    kvb_completion_req_free(r);
    /* a key's own escapes are checked too, and a valid escaped key is the field it spells */
    r = parse_ok(CMPL, "{\"model\":\"m\",\"pro\\u006dpt\":\"y\"}");
    assert_string_equal(r->prompt, "y");
    kvb_completion_req_free(r);
    /* a large object (sorted to find duplicates): 1024 logit biases, then one id twice */
    char *big = malloc(32 * 1100);
    assert_non_null(big);
    for (int twice = 0; twice < 2; twice++) {
        size_t n = (size_t)sprintf(big, "{\"model\":\"m\",\"prompt\":\"x\",\"logit_bias\":{");
        for (int i = 0; i < 1024; i++) n += (size_t)sprintf(big + n, "%s\"%d\":1", i ? "," : "", twice && i == 1000 ? 7 : i);
        n += (size_t)sprintf(big + n, "}}");
        kvb_http_error e;
        r = NULL;
        kvb_status st = kvb_completion_req_parse(CMPL, big, n, &r, &e);
        if (!twice) {
            assert_int_equal(st, KVB_OK);
            assert_int_equal(r->n_logit_bias, 1024);
        } else {
            assert_int_equal(st, KVB_ERR_INVALID);
            assert_string_equal(e.param, "logit_bias.7");
        }
        kvb_completion_req_free(r);
    }
    free(big);
}

/* Invalid UTF-8 becomes one U+FFFD per maximal subpart, as Python's decode(errors='replace')
 * gives it (the expected strings are Python's). */
static void test_utf8_replacement(void **state) {
    (void)state;
#define R "\xef\xbf\xbd"
    static const char *const cases[][2] = {
        {"\xe2\x82", R},          {"\xe2\x82" "A", R "A"},   {"\xff\xfe", R R},
        {"\xed\xa0\x80", R R R},   {"\xf0\x9f\x98", R},     {"\xf0\x80\x80\x80", R R R R},
        {"\xc0\xaf", R R},        {"a\xe0\xa0", "a" R},     {"\xf4\x90\x80\x80", R R R R},
        {"\xe0\x80\xaf", R R R},   {"ok \xc3\xa9 \xe2\x82\xac", "ok \xc3\xa9 \xe2\x82\xac"},
    };
#undef R
    for (size_t i = 0; i < KVB_ARRAY_LEN(cases); i++) {
        http_buf b = {0};
        http_utf8_sanitize_append(&b, cases[i][0], strlen(cases[i][0]));
        if (strcmp(b.data, cases[i][1]) != 0) fail_msg("case %zu: got '%s'", i, b.data);
        assert_true(http_utf8_valid(b.data, b.len));
        http_buf_free(&b);
    }
}

static void test_hostile_bytes(void **state) {
    (void)state;
    kvb_completion_req *r = NULL;
    kvb_http_error e;
    /* a raw NUL inside the body */
    const char with_nul[] = "{\"model\":\"m\",\"prompt\":\"a\0b\"}";
    assert_int_equal(kvb_completion_req_parse(CMPL, with_nul, sizeof with_nul - 1, &r, &e), KVB_ERR_INVALID);
    assert_non_null(strstr(e.message, "NUL"));
    /* an escaped backslash followed by u0000 is text, not a NUL escape */
    r = parse_ok(CMPL, "{\"model\":\"m\",\"prompt\":\"a\\\\u0000b\"}");
    assert_string_equal(r->prompt, "a\\u0000b");
    kvb_completion_req_free(r);
    /* a body that is not NUL-terminated: the parser reads only len bytes */
    const char *full = "{\"model\":\"m\",\"prompt\":\"abc\"}XXXX";
    r = NULL;
    assert_int_equal(kvb_completion_req_parse(CMPL, full, strlen(full) - 4, &r, &e), KVB_OK);
    assert_string_equal(r->prompt, "abc");
    kvb_completion_req_free(r);
    /* deep nesting in an ignored field */
    size_t depth = 100000;
    char *deep = malloc(2 * depth + 64);
    assert_non_null(deep);
    size_t n = (size_t)sprintf(deep, "{\"model\":\"m\",\"prompt\":\"x\",\"z\":");
    for (size_t i = 0; i < depth; i++) deep[n++] = '[';
    for (size_t i = 0; i < depth; i++) deep[n++] = ']';
    deep[n++] = '}';
    r = NULL;
    assert_int_equal(kvb_completion_req_parse(CMPL, deep, n, &r, &e), KVB_ERR_INVALID);
    assert_int_equal(e.status, 400);
    assert_null(r);
    free(deep);
    /* a very long token list */
    size_t n_tok = 200000;
    char *big = malloc(n_tok * 8 + 64);
    assert_non_null(big);
    n = (size_t)sprintf(big, "{\"model\":\"m\",\"prompt\":[");
    for (size_t i = 0; i < n_tok; i++) n += (size_t)sprintf(big + n, "%s%zu", i ? "," : "", i % 50000);
    n += (size_t)sprintf(big + n, "]}");
    assert_int_equal(kvb_completion_req_parse(CMPL, big, n, &r, &e), KVB_OK);
    assert_int_equal(r->n_prompt_tokens, n_tok);
    for (size_t i = 0; i < n_tok; i++) /* read in one walk into a growing buffer: every id in place */
        if (r->prompt_tokens[i] != (int32_t)(i % 50000)) fail_msg("token %zu is %d", i, r->prompt_tokens[i]);
    kvb_completion_req_free(r);
    free(big);
    /* NULL body */
    r = NULL;
    assert_int_equal(kvb_completion_req_parse(CHAT, NULL, 5, &r, &e), KVB_ERR_INVALID);
    assert_null(r);
}

/* Every prefix of a valid full request either parses or fails with a 400; never crashes. */
static void test_every_prefix(void **state) {
    (void)state;
    const char *body =
        "{\"model\":\"tiny\",\"messages\":[{\"role\":\"system\",\"content\":\"s\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"p\xc3\xa9\"}]}],\"max_tokens\":10,"
        "\"temperature\":0.5,\"stop\":[\"a\",\"b\"],\"stream\":true,\"stream_options\":{\"include_usage\":true},"
        "\"kvbridge\":{\"bridge\":\"auto\"}}";
    size_t len = strlen(body);
    int ok = 0;
    for (size_t n = 0; n <= len; n++) {
        char *copy = malloc(n ? n : 1); /* exact size so ASan sees any over-read */
        assert_non_null(copy);
        memcpy(copy, body, n);
        kvb_completion_req *r = NULL;
        kvb_http_error e;
        kvb_status st = kvb_completion_req_parse(CHAT, copy, n, &r, &e);
        if (st == KVB_OK) ok++;
        else assert_int_equal(e.status, 400);
        kvb_completion_req_free(r);
        free(copy);
    }
    assert_int_equal(ok, 1); /* only the whole body is valid */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_minimal),
        cmocka_unit_test(test_chat_full),
        cmocka_unit_test(test_logprobs_fields),
        cmocka_unit_test(test_tokenize_bodies),
        cmocka_unit_test(test_utf8_replacement),
        cmocka_unit_test(test_strict_strings_and_client_fields),
        cmocka_unit_test(test_completion_prompts),
        cmocka_unit_test(test_bad_requests_table),
        cmocka_unit_test(test_hostile_bytes),
        cmocka_unit_test(test_every_prefix),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
