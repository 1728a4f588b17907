/* fuzz/fuzz_http_request.c — libFuzzer target for the decode node's request parser
 * (kvb_completion_req_parse, src/http/request.c): a request body is a client's bytes. The first
 * input byte picks the API (even: /v1/chat/completions, odd: /v1/completions); the rest is the
 * body. A refused body must come back as a 4xx/5xx with a message and no request; an accepted one
 * must keep the contract in kvb_http.h: strings NUL-terminated, valid UTF-8 and NUL-free, at least
 * one message for chat, exactly one of prompt and prompt_tokens for completions, ids in
 * [0, INT32_MAX], numbers in their ranges, non-empty stop strings.
 *
 * Built a second time with FUZZ_HTTP_WRITE_SEEDS as fuzz_http_seeds DIR, which writes a few valid
 * bodies of each API (the shapes the openai client sends) as the seed corpus. */
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
};
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const kvb_api api = data[0] & 1 ? KVB_API_COMPLETIONS : KVB_API_CHAT_COMPLETIONS;
    kvb_completion_req *r = NULL;
    kvb_http_error e;
    memset(&e, 0, sizeof e);
    const kvb_status st = kvb_completion_req_parse(api, (const char *)data + 1, size - 1, &r, &e);
    if (st) {
        check(r == NULL, "a refused body returns no request");
        check(e.status >= 400 && e.status <= 599, "a refused body has an error status");
        check(memchr(e.message, 0, sizeof e.message) != NULL && e.message[0], "a refused body has a message");
        return 0;
    }
    check(r != NULL && r->api == api, "an accepted body returns its request");
    check_string(r->model, "model");
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
        if (kvb_completion_req_parse(seeds[i][0] & 1 ? KVB_API_COMPLETIONS : KVB_API_CHAT_COMPLETIONS, seeds[i] + 1,
                                     n - 1, &r, &e)) {
            fprintf(stderr, "seed %zu refused: %s\n", i, e.message);
            return 1;
        }
        kvb_completion_req_free(r);
        LLVMFuzzerTestOneInput((const uint8_t *)seeds[i], n);
    }
    return 0;
}
#endif
