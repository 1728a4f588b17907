/* fuzz/fuzz_http_request.c — libFuzzer target for the decode node's request path on a client's raw
 * bytes. An input whose first byte is 0..3 is a request body for that route (/v1/chat/completions,
 * /v1/completions, /tokenize, /detokenize) and goes straight to its parser (kvb_completion_req_parse,
 * kvb_tokenize_req_parse, kvb_detokenize_req_parse in src/http/request.c). Any other input is what
 * a connection sent: the guard's head check (http_head_check, src/http/head.c) must refuse it with
 * a 4xx and a message, or wait for more, or take a whole head whose request line and body framing
 * are consistent; the chunk sizes of a chunked body are checked as the guard does, the body
 * (by Content-Length or de-chunked) then goes to the parser of the route the target names. A
 * refused body must come back as a 4xx/5xx with a message and no request; an accepted one
 * must keep the contract in kvb_http.h: strings NUL-terminated, valid UTF-8 and NUL-free, at least
 * one message for chat, exactly one of prompt and prompt_tokens for completions, ids in
 * [0, INT32_MAX], numbers in their ranges, non-empty stop strings.
 *
 * Built a second time with FUZZ_HTTP_WRITE_SEEDS as fuzz_http_seeds DIR, which writes a few valid
 * bodies of each API (the shapes the openai client sends) as the seed corpus, each also as a whole
 * HTTP request (by Content-Length, and chunked). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"
#include "kvb_http.h"

static void check(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "fuzz_http_request: invariant violated: %s\n", what);
        abort();
    }
}

static void check_string(const char *s, const char *what) {
    check(s != NULL, what);
    const size_t n = strlen(s);
    check(http_utf8_valid(s, n), what);
}

#ifdef FUZZ_HTTP_WRITE_SEEDS
static const char *const seeds[] = {
    "\x00{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\","
    "\"content\":\"Hello\"}],\"max_tokens\":16,\"temperature\":0.7,\"top_p\":0.9,\"stream\":true,"
    "\"stream_options\":{\"include_usage\":true},\"stop\":[\"\\n\\n\",\"END\"],\"seed\":3}",
    "\x00{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
    "{\"type\":\"text\",\"text\":\"\\u00e9\\ud83d\\ude00\"}]},{\"role\":\"assistant\",\"content\":null}],"
    "\"max_completion_tokens\":4,\"kvbridge\":{\"bridge\":\"force\"}}",
    "\x01{\"model\":\"m\",\"prompt\":\"Once upon a time\",\"max_tokens\":8,\"top_k\":40,\"stop\":\"x\"}",
    "\x01{\"model\":\"m\",\"prompt\":[1,2,3,2147483647],\"max_tokens\":0,\"n\":1,\"echo\":false}",
    "\x01{\"model\":\"m\",\"prompt\":[[5,6]],\"stream\":false,\"frequency_penalty\":-2,\"presence_penalty\":2}",
    "\x00{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":3}",
    "\x01{\"model\":\"m\",\"prompt\":\"ab\",\"logprobs\":1,\"echo\":true,\"max_tokens\":1}",
    "\x02{\"prompt\":\"Hello\",\"add_special_tokens\":false}",
    "\x02{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"add_generation_prompt\":true}",
    "\x03{\"tokens\":[1,2,3]}",
    ("\x00{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":3,\"response_format\":"
     "{\"type\":\"json_object\"},\"tool_choice\":\"none\",\"modalities\":[\"text\"]}"),
    "\x01{\"model\":\"m\",\"prompt\":\"x\",\"max_tokens\":8,\"min_tokens\":2,\"stop_token_ids\":[2,7]}",
    /* structured outputs: a schema compiled at parse time (every supported keyword) */
    ("\x00{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":"
     "\"json_schema\",\"json_schema\":{\"name\":\"a_b-1\",\"strict\":true,\"schema\":{\"type\":\"object\","
     "\"title\":\"T\",\"properties\":{\"s\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":5},\"n\":{\"type\":[\"integer\",\"null\"]},"
     "\"e\":{\"enum\":[\"a\\\"b\",1.5,true,null]},\"c\":{\"const\":100},\"l\":{\"type\":\"array\",\"items\":"
     "{\"type\":\"number\"},\"minItems\":1,\"maxItems\":3},\"u\":{\"anyOf\":[{\"type\":\"string\"},"
     "{\"type\":\"object\",\"properties\":{}}]},\"o\":{\"type\":\"object\"}},\"required\":[\"s\",\"l\"],"
     "\"additionalProperties\":false}}}}"),
};
#endif

/* Route 0..3 (chat, completions, tokenize, detokenize): the body through its parser. */
static kvb_status parse_route(unsigned route, const char *body, size_t len, kvb_completion_req **r, kvb_http_error *e) {
    switch (route & 3) {
    case 0: return kvb_completion_req_parse(KVB_API_CHAT_COMPLETIONS, body, len, r, e);
    case 1: return kvb_completion_req_parse(KVB_API_COMPLETIONS, body, len, r, e);
    case 2: return kvb_tokenize_req_parse(body, len, r, e);
    default: return kvb_detokenize_req_parse(body, len, r, e);
    }
}

/* The body through the route's parser, and the contract of what comes back. */
static void check_body(unsigned route, const char *body, size_t len) {
    kvb_completion_req *r = NULL;
    kvb_http_error e;
    memset(&e, 0, sizeof e);
    const kvb_status st = parse_route(route, body, len, &r, &e);
    if (st) {
        check(r == NULL, "a refused body returns no request");
        check(e.status >= 400 && e.status <= 599, "a refused body has an error status");
        check(memchr(e.message, 0, sizeof e.message) != NULL && e.message[0], "a refused body has a message");
        return;
    }
    check(r != NULL, "an accepted body returns its request");
    if (route == 3) { /* detokenize: ids only */
        check(r->model == NULL || http_utf8_valid(r->model, strlen(r->model)), "model");
        check(r->n_prompt_tokens == 0 || r->prompt_tokens != NULL, "token ids");
        for (size_t i = 0; i < r->n_prompt_tokens; i++) check(r->prompt_tokens[i] >= 0, "token id range");
        kvb_completion_req_free(r);
        return;
    }
    const kvb_api api = route == 0 || (route == 2 && r->n_messages) ? KVB_API_CHAT_COMPLETIONS : KVB_API_COMPLETIONS;
    check(r->api == api, "an accepted body has its API");
    if (route == 2) check(r->model == NULL || http_utf8_valid(r->model, strlen(r->model)), "model");
    else check_string(r->model, "model");
    check(r->top_logprobs <= KVB_HTTP_MAX_TOP_LOGPROBS && (r->logprobs || r->top_logprobs == 0), "logprobs");
    check(!r->echo || api == KVB_API_COMPLETIONS, "echo only in completions");
    check(r->n >= 1 && r->n <= KVB_HTTP_MAX_N && (r->n == 1 || !r->echo), "n");
    check(r->min_tokens >= 0 && (r->max_tokens < 0 || r->min_tokens <= r->max_tokens), "min_tokens");
    check(r->n_stop_token_ids <= KVB_HTTP_MAX_STOP_IDS, "stop_token_ids");
    for (size_t i = 0; i < r->n_stop_token_ids; i++) check(r->stop_token_ids[i] >= 0, "stop token id range");
    if (api == KVB_API_CHAT_COMPLETIONS) {
        check(r->n_messages >= 1 && r->messages != NULL, "chat has messages");
        for (size_t i = 0; i < r->n_messages; i++) check_string(r->messages[i].content, "message content");
        check(r->prompt == NULL && r->prompt_tokens == NULL, "chat has no prompt");
        check(r->max_tokens == -1 || r->max_tokens >= 1, "chat max_tokens");
    } else {
        check(r->n_messages == 0, "completions have no messages");
        check((r->prompt != NULL) != (r->prompt_tokens != NULL), "exactly one of prompt and prompt_tokens");
        if (r->prompt) check_string(r->prompt, "prompt");
        if (r->prompt_tokens) {
            check(r->n_prompt_tokens >= 1, "token ids");
            for (size_t i = 0; i < r->n_prompt_tokens; i++) check(r->prompt_tokens[i] >= 0, "token id range");
        }
        check(r->max_tokens >= -1, "completions max_tokens");
    }
    check(r->temperature >= 0 && r->temperature <= 2, "temperature");
    check(r->top_p >= 0 && r->top_p <= 1, "top_p");
    check(r->top_k >= 0, "top_k");
    check(r->frequency_penalty >= -2 && r->frequency_penalty <= 2, "frequency_penalty");
    check(r->presence_penalty >= -2 && r->presence_penalty <= 2, "presence_penalty");
    check(r->n_stop <= KVB_HTTP_MAX_STOP, "stop count");
    for (size_t i = 0; i < r->n_stop; i++) {
        check_string(r->stop[i], "stop");
        check(r->stop[i][0] != 0, "stop strings are not empty");
    }
    check(!r->include_usage || r->stream, "include_usage only with stream");
    kvb_completion_req_free(r);
}

#define FUZZ_MAX_BODY ((size_t)1 << 20)

/* A chunked body's chunks joined into out (as the HTTP library gives them to the server); false
 * when it is not whole or its framing is off. */
static bool dechunk(const char *p, size_t n, http_buf *out) {
    size_t pos = 0;
    for (;;) {
        const char *nl = memchr(p + pos, '\n', n - pos);
        if (!nl) return false;
        char *end = NULL;
        char line[24] = "";
        memcpy(line, p + pos, (size_t)(nl - p) - pos < sizeof line - 1 ? (size_t)(nl - p) - pos : sizeof line - 1);
        const unsigned long long size = strtoull(line, &end, 16);
        if (end == line || size > FUZZ_MAX_BODY) return false;
        pos = (size_t)(nl - p) + 1;
        if (size == 0) return true;
        if (n - pos < size + 2) return false;
        http_buf_append(out, p + pos, (size_t)size);
        pos += (size_t)size + 2;
    }
}

static const char *const route_paths[4] = {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"};

/* What a connection sent: the guard's head check, then the body to its route's parser. */
static void check_connection(const char *buf, size_t n) {
    http_head h;
    kvb_http_error e;
    memset(&e, 0, sizeof e);
    const int verdict = http_head_check(buf, n, &h, &e);
    if (verdict < 0) {
        check(e.status >= 400 && e.status <= 499, "a refused head is a 4xx");
        check(memchr(e.message, 0, sizeof e.message) != NULL && e.message[0], "a refused head has a message");
        return;
    }
    if (verdict == 0) {
        check(n <= HTTP_HEAD_MAX + 1, "a head waited for is within the limit");
        return;
    }
    check(h.head_len <= n && h.head_len <= HTTP_HEAD_MAX + 2, "a whole head is within the bytes");
    check(h.method_len >= 1 && h.target_len >= 1 && h.target_off + h.target_len < h.head_len, "the request line");
    check(!(h.chunked && h.content_length >= 0) && !(h.chunked && h.http10), "one way to frame the body");
    check(h.http10 || h.has_host, "HTTP/1.1 has a Host");
    const char *rest = buf + h.head_len;
    const size_t left = n - h.head_len;
    http_buf body = {0};
    http_buf_append(&body, "", 0);
    if (h.chunked) {
        memset(&e, 0, sizeof e);
        const int c = http_chunks_check(rest, left, FUZZ_MAX_BODY, &e);
        if (c < 0) check(e.status >= 400 && e.status <= 499 && e.message[0], "a refused chunk is a 4xx with a message");
        if (c < 0 || !dechunk(rest, left, &body)) { http_buf_free(&body); return; }
    } else if (h.content_length >= 0) {
        if ((unsigned long long)h.content_length > left) { http_buf_free(&body); return; }
        http_buf_append(&body, rest, (size_t)h.content_length);
    }
    for (unsigned route = 0; route < 4 && !body.oom; route++)
        if (h.target_len == strlen(route_paths[route]) && memcmp(buf + h.target_off, route_paths[route], h.target_len) == 0)
            check_body(route, body.data, body.len);
    http_buf_free(&body);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (data[0] < 4) check_body(data[0], (const char *)data + 1, size - 1);
    else check_connection((const char *)data, size);
    return 0;
}

#ifdef FUZZ_HTTP_WRITE_SEEDS
int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    for (size_t i = 0; i < sizeof seeds / sizeof *seeds; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/seed%zu", argv[1], i);
        FILE *f = fopen(path, "wb");
        if (!f) return 1;
        const size_t n = 1 + strlen(seeds[i] + 1); /* the API byte may be 0 */
        fwrite(seeds[i], 1, n, f);
        fclose(f);
        kvb_completion_req *r = NULL; /* a seed is a body the parser accepts */
        kvb_http_error e;
        if (parse_route((unsigned char)seeds[i][0], seeds[i] + 1, n - 1, &r, &e)) {
            fprintf(stderr, "seed %zu refused: %s\n", i, e.message);
            return 1;
        }
        kvb_completion_req_free(r);
        LLVMFuzzerTestOneInput((const uint8_t *)seeds[i], n);
        for (int chunked = 0; chunked < 2; chunked++) { /* the same body as a whole request */
            const unsigned char route = (unsigned char)seeds[i][0];
            char head[256];
            const int hn = chunked ? snprintf(head, sizeof head, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                              "application/json\r\nTransfer-Encoding: chunked\r\n\r\n%zx\r\n",
                                              route_paths[route], n - 1)
                                   : snprintf(head, sizeof head, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                              "application/json\r\nContent-Length: %zu\r\n\r\n", route_paths[route], n - 1);
            snprintf(path, sizeof path, "%s/request%zu_%d", argv[1], i, chunked);
            f = fopen(path, "wb");
            if (!f) return 1;
            fwrite(head, 1, (size_t)hn, f);
            fwrite(seeds[i] + 1, 1, n - 1, f);
            if (chunked) fwrite("\r\n0\r\n\r\n", 1, 7, f);
            fclose(f);
        }
    }
    return 0;
}
#endif
