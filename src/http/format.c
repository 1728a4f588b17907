/* format.c — OpenAI response bodies: chat.completion / text_completion objects, streaming
 * chunks (chat.completion.chunk / text_completion) as SSE lines, and the usage object with our
 * usage.kvbridge block: {"verdict", "cached_tokens", "bridged_tokens", "native_tokens",
 * "tokenize_s", "queue_s", "lookup_s", "prefill_s", "transfer_s", "native_s", "decode_s",
 * "native_pipelined", "bridge_attempts", "bridge_faults", "peer" (the prefill node(s) that bridged),
 * "placement" (history, new or moved)}. The OpenAI-standard
 * usage.prompt_tokens_details.cached_tokens carries the cached count too. */
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"

const char *http_finish_reason_name(kvb_finish_reason r) {
    return r == KVB_FINISH_LENGTH ? "length" : "stop";
}

cJSON *http_usage_json(const kvb_usage *u, const char *verdict) {
    static const kvb_usage zero;
    if (!u) u = &zero;
    cJSON *usage = cJSON_CreateObject();
    if (!usage) return NULL;
    cJSON_AddNumberToObject(usage, "prompt_tokens", (double)u->prompt_tokens);
    cJSON_AddNumberToObject(usage, "completion_tokens", (double)u->completion_tokens);
    cJSON_AddNumberToObject(usage, "total_tokens", (double)(u->prompt_tokens + u->completion_tokens));
    cJSON *details = cJSON_AddObjectToObject(usage, "prompt_tokens_details");
    if (details) cJSON_AddNumberToObject(details, "cached_tokens", (double)u->cached_tokens);
    cJSON *kb = cJSON_AddObjectToObject(usage, "kvbridge");
    if (kb) {
        cJSON_AddStringToObject(kb, "verdict", verdict ? verdict : "");
        cJSON_AddNumberToObject(kb, "cached_tokens", (double)u->cached_tokens);
        cJSON_AddNumberToObject(kb, "bridged_tokens", (double)u->bridged_tokens);
        cJSON_AddNumberToObject(kb, "native_tokens", (double)u->native_tokens);
        cJSON_AddNumberToObject(kb, "tokenize_s", u->tokenize_s);
        cJSON_AddNumberToObject(kb, "queue_s", u->queue_s);
        cJSON_AddNumberToObject(kb, "lookup_s", u->lookup_s);
        cJSON_AddNumberToObject(kb, "prefill_s", u->prefill_s);
        cJSON_AddNumberToObject(kb, "transfer_s", u->transfer_s);
        cJSON_AddNumberToObject(kb, "native_s", u->native_s);
        cJSON_AddNumberToObject(kb, "decode_s", u->decode_s);
        cJSON_AddBoolToObject(kb, "native_pipelined", u->native_pipelined);
        cJSON_AddNumberToObject(kb, "bridge_attempts", u->bridge_attempts);
        char faults[3 * KVB_VERDICT_MAX];
        http_printable_copy(faults, sizeof faults, u->bridge_faults);
        cJSON_AddStringToObject(kb, "bridge_faults", faults);
        http_printable_copy(faults, sizeof faults, u->peer);
        cJSON_AddStringToObject(kb, "peer", faults);
        cJSON_AddStringToObject(kb, "placement", u->placement ? u->placement : "");
    }
    if (!details || !kb) { cJSON_Delete(usage); return NULL; }
    return usage;
}

static cJSON *meta_object(const http_completion_meta *m, bool chunk) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    cJSON_AddStringToObject(root, "id", m->id);
    const char *object = m->api == KVB_API_CHAT_COMPLETIONS
                             ? (chunk ? "chat.completion.chunk" : "chat.completion")
                             : "text_completion";
    cJSON_AddStringToObject(root, "object", object);
    cJSON_AddNumberToObject(root, "created", (double)m->created);
    cJSON_AddStringToObject(root, "model", m->model ? m->model : "");
    return root;
}

static char *print_and_delete(cJSON *root) {
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

/* The choice's "logprobs": the object given, or null. */
static void add_logprobs(cJSON *choice, cJSON *logprobs) {
    if (logprobs) cJSON_AddItemToObject(choice, "logprobs", logprobs);
    else cJSON_AddNullToObject(choice, "logprobs");
}

cJSON *http_choice_json(kvb_api api, uint32_t index, const char *text, cJSON *logprobs, kvb_finish_reason reason) {
    cJSON *choice = cJSON_CreateObject();
    bool ok = choice && cJSON_AddNumberToObject(choice, "index", index);
    if (ok && api == KVB_API_CHAT_COMPLETIONS) {
        cJSON *msg = cJSON_AddObjectToObject(choice, "message");
        ok = msg && cJSON_AddStringToObject(msg, "role", "assistant") &&
             cJSON_AddStringToObject(msg, "content", text ? text : "");
    } else if (ok) {
        ok = cJSON_AddStringToObject(choice, "text", text ? text : "") != NULL;
    }
    if (!ok) { cJSON_Delete(choice); cJSON_Delete(logprobs); return NULL; }
    add_logprobs(choice, logprobs);
    if (!cJSON_AddStringToObject(choice, "finish_reason", http_finish_reason_name(reason))) {
        cJSON_Delete(choice);
        return NULL;
    }
    return choice;
}

char *http_completion_json(const http_completion_meta *m, cJSON *choices, const kvb_usage *u, const char *verdict) {
    cJSON *root = meta_object(m, false);
    cJSON *usage = root ? http_usage_json(u, verdict) : NULL;
    if (!usage) { cJSON_Delete(root); cJSON_Delete(choices); return NULL; }
    cJSON_AddItemToObject(root, "choices", choices);
    cJSON_AddItemToObject(root, "usage", usage);
    return print_and_delete(root);
}

void http_sse_chunk(http_buf *b, const http_completion_meta *m, const char *delta, cJSON *logprobs,
                    bool first_chunk, const char *finish, const kvb_usage *usage_chunk, const char *verdict) {
    cJSON *root = meta_object(m, true);
    cJSON *choices = root ? cJSON_AddArrayToObject(root, "choices") : NULL;
    if (!choices || usage_chunk) cJSON_Delete(logprobs); /* a usage chunk has no choice to hold them */
    if (!choices) { cJSON_Delete(root); b->oom = true; return; }
    if (usage_chunk) {
        cJSON *usage = http_usage_json(usage_chunk, verdict);
        if (!usage) { cJSON_Delete(root); b->oom = true; return; }
        cJSON_AddItemToObject(root, "usage", usage);
    } else {
        cJSON *choice = cJSON_CreateObject();
        if (!choice) { cJSON_Delete(root); cJSON_Delete(logprobs); b->oom = true; return; }
        cJSON_AddItemToArray(choices, choice);
        cJSON_AddNumberToObject(choice, "index", m->index);
        if (m->api == KVB_API_CHAT_COMPLETIONS) {
            cJSON *d = cJSON_AddObjectToObject(choice, "delta");
            if (d && first_chunk) cJSON_AddStringToObject(d, "role", "assistant");
            if (d && (delta || first_chunk)) cJSON_AddStringToObject(d, "content", delta ? delta : "");
        } else {
            cJSON_AddStringToObject(choice, "text", delta ? delta : "");
        }
        add_logprobs(choice, logprobs);
        if (finish) cJSON_AddStringToObject(choice, "finish_reason", finish);
        else cJSON_AddNullToObject(choice, "finish_reason");
        if (m->include_usage) cJSON_AddNullToObject(root, "usage");
    }
    char *s = print_and_delete(root);
    if (!s) { b->oom = true; return; }
    http_buf_append_str(b, "data: ");
    http_buf_append_str(b, s);
    http_buf_append_str(b, "\n\n");
    cJSON_free(s);
}
