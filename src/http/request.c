/* request.c — hostile request bytes -> a validated kvb_completion_req. Every rejection is a 400
 * in OpenAI's shape naming the offending param ("messages[2].content", "stop[1]", ...). The
 * parsed cJSON tree stays alive with the request: strings point into it; only joined content
 * parts, the token id array, the logit bias and a response_format's compiled JSON schema are
 * separate allocations. Nothing a client sent is dropped unseen: the body's strings are checked
 * byte by byte before cJSON decodes them, a key sent twice is refused, and every field must be in
 * request_fields (or a nested object's own list), else a 400 names it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "http_internal.h"

typedef struct {
    kvb_completion_req req;
    cJSON *root;
    kvb_chat_msg *msgs;
    char **owned; /* joined content strings */
    size_t n_owned;
    int32_t *tokens;
    int32_t *bias_ids; /* (n_logit_bias) */
    float *bias_values;
    kvb_json_schema *schema; /* response_format json_schema, compiled */
} req_storage;

#define BAD(e, param, ...) (http_error_set((e), 400, NULL, (param), __VA_ARGS__), KVB_ERR_INVALID)
#define NOMEM(e) (http_error_set((e), 500, NULL, NULL, "out of memory parsing the request"), KVB_ERR_NOMEM)

/* ---- the fields each route takes: one table ------------------------------------------------------ */

enum { ON_CHAT = 1u, ON_COMPLETIONS = 2u, ON_TOKENIZE = 4u, ON_DETOKENIZE = 8u };
#define ON_GENERATE (ON_CHAT | ON_COMPLETIONS)
#define ON_ALL (ON_GENERATE | ON_TOKENIZE | ON_DETOKENIZE)
#define T_NULL cJSON_NULL

/* Every top-level field a route accepts. A field not here, or not for this route ("echo" on chat),
 * is a 400 naming it, as OpenAI answers one ("Unrecognized request argument supplied: temprature").
 * ignored_types != 0: accepted and without effect here, when its JSON type is one of these —
 * what OpenAI's and vLLM's clients send for features this server has no use for (end-user ids,
 * stored-completion and billing options, tool-call parallelism with no tools, prompt-cache hints
 * for OpenAI's cache). Fields that are here but that this server cannot honour by value (tools,
 * suffix, best_of > 1, ...) are refused by value in refuse_unsupported. */
typedef struct {
    const char *name;
    unsigned routes;
    int ignored_types; /* 0: read by the parser */
} request_field;

static const request_field request_fields[] = {
    {"model", ON_ALL, 0},
    {"messages", ON_CHAT | ON_TOKENIZE, 0},
    {"prompt", ON_COMPLETIONS | ON_TOKENIZE, 0},
    {"tokens", ON_DETOKENIZE, 0},
    {"add_special_tokens", ON_COMPLETIONS | ON_TOKENIZE, 0}, /* vLLM's; on completions true only */
    {"add_generation_prompt", ON_TOKENIZE, 0},
    {"max_tokens", ON_GENERATE, 0},
    {"max_completion_tokens", ON_GENERATE, 0},
    {"temperature", ON_GENERATE, 0},
    {"top_p", ON_GENERATE, 0},
    {"top_k", ON_GENERATE, 0},                 /* vLLM's */
    {"frequency_penalty", ON_GENERATE, 0},
    {"presence_penalty", ON_GENERATE, 0},
    {"seed", ON_GENERATE, 0},
    {"n", ON_GENERATE, 0},
    {"stop", ON_GENERATE, 0},
    {"stop_token_ids", ON_GENERATE, 0},        /* vLLM's */
    {"min_tokens", ON_GENERATE, 0},            /* vLLM's */
    {"ignore_eos", ON_GENERATE, 0},            /* vLLM's */
    {"logit_bias", ON_GENERATE, 0},
    {"logprobs", ON_GENERATE, 0},
    {"top_logprobs", ON_GENERATE, 0},          /* chat's; on completions only 0 */
    {"stream", ON_GENERATE, 0},
    {"stream_options", ON_GENERATE, 0},
    {"response_format", ON_GENERATE, 0},
    {"kvbridge", ON_GENERATE, 0},              /* ours */
    {"echo", ON_COMPLETIONS, 0},
    {"suffix", ON_COMPLETIONS, 0},             /* refused */
    {"best_of", ON_COMPLETIONS, 0},            /* 1 only */
    {"tools", ON_CHAT, 0},                     /* [] only */
    {"functions", ON_CHAT, 0},                 /* [] only */
    {"tool_choice", ON_CHAT, 0},               /* "none" / "auto" only */
    {"function_call", ON_CHAT, 0},             /* "none" / "auto" only */
    {"audio", ON_CHAT, 0},                     /* null only */
    {"modalities", ON_CHAT, 0},                /* ["text"] only */
    /* accepted and ignored */
    {"user", ON_GENERATE, cJSON_String | T_NULL},
    {"metadata", ON_CHAT, cJSON_Object | T_NULL},
    {"store", ON_CHAT, cJSON_True | cJSON_False | T_NULL},
    {"service_tier", ON_CHAT, cJSON_String | T_NULL},
    {"parallel_tool_calls", ON_CHAT, cJSON_True | cJSON_False | T_NULL},
    {"prompt_cache_key", ON_CHAT, cJSON_String | T_NULL},
    {"safety_identifier", ON_CHAT, cJSON_String | T_NULL},
};

/* The keys a message object, a content part, stream_options and response_format take. A message's
 * "name" is ignored; the fields of an assistant message as a client sends one back are taken when
 * null or empty (they carry nothing then). */
static const char *const message_fields[] = {"role", "content", "name", "refusal", "tool_calls", "function_call",
                                             "audio", "annotations"};
static const char *const message_empty_only[] = {"refusal", "tool_calls", "function_call", "audio", "annotations"};
static const char *const content_part_fields[] = {"type", "text"};
static const char *const stream_options_fields[] = {"include_usage", "include_obfuscation" /* ignored */};
static const char *const response_format_fields[] = {"type", "json_schema"};

/* Each member of root is in request_fields for this route, an ignored one of its accepted types. */
static kvb_status check_request_fields(const cJSON *root, unsigned route, kvb_http_error *e) {
    for (const cJSON *c = root->child; c; c = c->next) {
        const request_field *f = NULL;
        for (size_t i = 0; i < KVB_ARRAY_LEN(request_fields) && !f; i++)
            if ((request_fields[i].routes & route) && strcmp(c->string, request_fields[i].name) == 0)
                f = &request_fields[i];
        if (!f) return http_error_unknown_field(e, NULL, c->string);
        if (f->ignored_types && !(c->type & f->ignored_types)) {
            const int t = f->ignored_types;
            const char *want = t & cJSON_String ? "a string" : t & cJSON_Object ? "an object" : "a boolean";
            return BAD(e, f->name, "Invalid type for '%s': expected %s, but got %s instead.", f->name, want,
                       kvb_json_value_kind(c));
        }
    }
    return KVB_OK;
}

/* The item, or NULL when absent or JSON null (both mean "use the default"). */
static const cJSON *field(const cJSON *obj, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

static kvb_status get_bool(const cJSON *obj, const char *name, const char *param, bool *out,
                           kvb_http_error *e) {
    const cJSON *v = field(obj, name);
    if (!v) return KVB_OK;
    if (!cJSON_IsBool(v))
        return BAD(e, param, "Invalid type for '%s': expected a boolean, but got %s instead.", param,
                   kvb_json_value_kind(v));
    *out = cJSON_IsTrue(v);
    return KVB_OK;
}

static kvb_status get_number(const cJSON *obj, const char *name, double lo, double hi, double *out,
                             kvb_http_error *e) {
    const cJSON *v = field(obj, name);
    if (!v) return KVB_OK;
    if (!cJSON_IsNumber(v))
        return BAD(e, name, "Invalid type for '%s': expected a number, but got %s instead.", name,
                   kvb_json_value_kind(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d < lo || d > hi)
        return BAD(e, name, "Invalid '%s': %g is out of range; expected a value in [%g, %g].", name, d,
                   lo, hi);
    *out = d;
    return KVB_OK;
}

/* Whether v is an integral JSON number in [lo, hi] (check_integer words why not). */
static bool is_integer_in(const cJSON *v, double lo, double hi) {
    if (!cJSON_IsNumber(v)) return false;
    const double d = v->valuedouble;
    return isfinite(d) && d == floor(d) && d >= lo && d <= hi;
}

/* An integral JSON number in [lo, hi]. */
static kvb_status check_integer(const cJSON *v, const char *param, double lo, double hi,
                                kvb_http_error *e) {
    if (!cJSON_IsNumber(v))
        return BAD(e, param, "Invalid type for '%s': expected an integer, but got %s instead.", param,
                   kvb_json_value_kind(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d))
        return BAD(e, param, "Invalid type for '%s': expected an integer, but got a decimal number "
                   "instead.", param);
    if (d < lo || d > hi)
        return BAD(e, param, "Invalid '%s': %.0f is out of range; expected a value in [%.0f, %.0f].",
                   param, d, lo, hi);
    return KVB_OK;
}

static kvb_status get_string(const cJSON *v, const char *param, bool allow_empty, const char **out,
                             kvb_http_error *e) {
    if (!cJSON_IsString(v) || !v->valuestring)
        return BAD(e, param, "Invalid type for '%s': expected a string, but got %s instead.", param,
                   kvb_json_value_kind(v));
    size_t n = strlen(v->valuestring);
    if (!http_utf8_valid(v->valuestring, n))
        return BAD(e, param, "Invalid '%s': the string is not valid UTF-8.", param);
    if (!allow_empty && n == 0)
        return BAD(e, param, "Invalid '%s': empty string; expected a non-empty string.", param);
    *out = v->valuestring;
    return KVB_OK;
}

static kvb_status own_string(req_storage *st, char *s, kvb_http_error *e) {
    char **grown = realloc(st->owned, (st->n_owned + 1) * sizeof *grown);
    if (!grown) { free(s); return NOMEM(e); }
    st->owned = grown;
    st->owned[st->n_owned++] = s;
    return KVB_OK;
}

/* content: a string, or [{"type": "text", "text": "..."}, ...] joined with "\n". */
static kvb_status parse_content(req_storage *st, const cJSON *content, const char *role, size_t mi,
                                const char **out, kvb_http_error *e) {
    char param[96];
    snprintf(param, sizeof param, "messages[%zu].content", mi);
    if (!content) {
        if (strcmp(role, "assistant") == 0) { *out = ""; return KVB_OK; }
        return BAD(e, param, "Missing required parameter: '%s'.", param);
    }
    if (cJSON_IsString(content)) return get_string(content, param, true, out, e);
    if (!cJSON_IsArray(content))
        return BAD(e, param, "Invalid type for '%s': expected a string or an array of content parts, "
                   "but got %s instead.", param, kvb_json_value_kind(content));
    http_buf joined = {0};
    http_buf_append(&joined, "", 0);
    size_t pi = 0;
    const cJSON *part;
    cJSON_ArrayForEach(part, content) {
        char pparam[128];
        snprintf(pparam, sizeof pparam, "%s[%zu]", param, pi);
        const char *type = NULL, *text = NULL;
        kvb_status s = KVB_OK;
        if (!cJSON_IsObject(part))
            s = BAD(e, pparam, "Invalid type for '%s': expected a content part object, but got %s "
                    "instead.", pparam, kvb_json_value_kind(part));
        if (!s) {
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "type");
            char tparam[140];
            snprintf(tparam, sizeof tparam, "%s.type", pparam);
            if (!t) s = BAD(e, tparam, "Missing required parameter: '%s'.", tparam);
            else s = get_string(t, tparam, false, &type, e);
        }
        if (!s && strcmp(type, "text") != 0)
            s = BAD(e, pparam, "Content part type '%.40s' in '%s' is not supported; only 'text' parts "
                    "are.", type, pparam);
        if (!s) s = http_json_refuse_unknown(part, pparam, content_part_fields, KVB_ARRAY_LEN(content_part_fields), e);
        if (!s) {
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "text");
            char tparam[140];
            snprintf(tparam, sizeof tparam, "%s.text", pparam);
            if (!t) s = BAD(e, tparam, "Missing required parameter: '%s'.", tparam);
            else s = get_string(t, tparam, true, &text, e);
        }
        if (s) { http_buf_free(&joined); return s; }
        if (pi) http_buf_append(&joined, "\n", 1);
        http_buf_append_str(&joined, text);
        pi++;
    }
    if (pi == 0) {
        http_buf_free(&joined);
        return BAD(e, param, "Invalid '%s': empty array; expected at least one content part.", param);
    }
    if (joined.oom) { http_buf_free(&joined); return NOMEM(e); }
    kvb_status s = own_string(st, joined.data, e); /* ownership moves to st */
    if (!s) *out = joined.data;
    return s;
}

/* A message's keys (message_fields); those carried back from a reply must be empty. */
static kvb_status check_message_fields(const cJSON *m, const char *param, kvb_http_error *e) {
    kvb_status s = http_json_refuse_unknown(m, param, message_fields, KVB_ARRAY_LEN(message_fields), e);
    for (size_t i = 0; !s && i < KVB_ARRAY_LEN(message_empty_only); i++) {
        const cJSON *v = field(m, message_empty_only[i]);
        if (!v || (cJSON_IsArray(v) && !v->child)) continue;
        char fparam[128];
        snprintf(fparam, sizeof fparam, "%s.%s", param, message_empty_only[i]);
        s = BAD(e, fparam, "'%s' is not supported by this server (text messages only); send it as null or leave "
                "it out.", fparam);
    }
    const cJSON *name = field(m, "name");
    const char *ignored = NULL;
    if (!s && name) {
        char nparam[112];
        snprintf(nparam, sizeof nparam, "%s.name", param);
        s = get_string(name, nparam, true, &ignored, e);
    }
    return s;
}

static kvb_status parse_messages(req_storage *st, const cJSON *root, kvb_http_error *e) {
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (!msgs || cJSON_IsNull(msgs)) return BAD(e, "messages", "Missing required parameter: 'messages'.");
    if (!cJSON_IsArray(msgs))
        return BAD(e, "messages", "Invalid type for 'messages': expected an array, but got %s instead.",
                   kvb_json_value_kind(msgs));
    size_t n = (size_t)cJSON_GetArraySize(msgs);
    if (n == 0)
        return BAD(e, "messages", "Invalid 'messages': empty array. Expected an array with minimum "
                   "length 1.");
    st->msgs = calloc(n, sizeof *st->msgs);
    if (!st->msgs) return NOMEM(e);
    size_t i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, msgs) {
        char param[96];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!cJSON_IsObject(m))
            return BAD(e, param, "Invalid type for '%s': expected an object, but got %s instead.", param,
                       kvb_json_value_kind(m));
        kvb_status s = check_message_fields(m, param, e);
        if (s) return s;
        char rparam[112];
        snprintf(rparam, sizeof rparam, "%s.role", param);
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "role");
        const char *role = NULL;
        if (!r || cJSON_IsNull(r)) return BAD(e, rparam, "Missing required parameter: '%s'.", rparam);
        s = get_string(r, rparam, false, &role, e);
        if (s) return s;
        if (strcmp(role, "developer") == 0) role = "system";
        if (strcmp(role, "tool") == 0 || strcmp(role, "function") == 0)
            return BAD(e, rparam, "Invalid '%s': role '%s' is not supported (this server does not do "
                       "tool calling).", rparam, role);
        if (strcmp(role, "system") != 0 && strcmp(role, "user") != 0 && strcmp(role, "assistant") != 0)
            return BAD(e, rparam, "Invalid value for '%s': '%.40s'. Supported values are: 'system', "
                       "'developer', 'user' and 'assistant'.", rparam, role);
        const char *content = NULL;
        s = parse_content(st, field(m, "content"), role, i, &content, e);
        if (s) return s;
        st->msgs[i].role = role;
        st->msgs[i].content = content;
        i++;
    }
    st->req.messages = st->msgs;
    st->req.n_messages = i;
    return KVB_OK;
}

/* One walk of the list (a 32K-token prompt is 32K linked items: counting them first cost as
 * much again), into a buffer that doubles as it fills. */
static kvb_status parse_token_ids(req_storage *st, const cJSON *arr, const char *param,
                                  kvb_http_error *e) {
    if (!arr->child) return BAD(e, param, "Invalid '%s': the prompt token list is empty.", param);
    size_t i = 0, cap = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, arr) {
        if (!is_integer_in(t, 0, (double)INT32_MAX)) { /* the element's name only for the error */
            char p[112];
            snprintf(p, sizeof p, "%s[%zu]", param, i);
            kvb_status s = check_integer(t, p, 0, (double)INT32_MAX, e);
            if (s) return s;
        }
        if (i == cap) {
            cap = cap ? 2 * cap : 4096;
            int32_t *grown = realloc(st->tokens, cap * sizeof *st->tokens);
            if (!grown) return NOMEM(e);
            st->tokens = grown;
        }
        st->tokens[i++] = (int32_t)t->valuedouble;
    }
    st->req.prompt_tokens = st->tokens;
    st->req.n_prompt_tokens = i;
    return KVB_OK;
}

/* prompt: "text" | ["text"] | [id, ...] | [[id, ...]] — one prompt per request. */
static kvb_status parse_prompt(req_storage *st, const cJSON *root, kvb_http_error *e) {
    const cJSON *p = field(root, "prompt");
    if (!p) return BAD(e, "prompt", "Missing required parameter: 'prompt'.");
    if (cJSON_IsString(p)) return get_string(p, "prompt", true, &st->req.prompt, e);
    if (!cJSON_IsArray(p))
        return BAD(e, "prompt", "Invalid type for 'prompt': expected a string, an array of one string "
                   "or an array of token ids, but got %s instead.", kvb_json_value_kind(p));
    const cJSON *first = p->child;
    if (!first) return BAD(e, "prompt", "Invalid 'prompt': empty array.");
    if (cJSON_IsNumber(first)) return parse_token_ids(st, p, "prompt", e);
    if (first->next)
        return BAD(e, "prompt", "Invalid 'prompt': %d prompts given; this server takes one prompt per "
                   "request.", cJSON_GetArraySize(p));
    if (cJSON_IsString(first)) return get_string(first, "prompt[0]", true, &st->req.prompt, e);
    if (cJSON_IsArray(first)) return parse_token_ids(st, first, "prompt[0]", e);
    return BAD(e, "prompt[0]", "Invalid type for 'prompt[0]': expected a string or an array of token "
               "ids, but got %s instead.", kvb_json_value_kind(first));
}

static kvb_status parse_stop(req_storage *st, const cJSON *root, kvb_http_error *e) {
    const cJSON *s = field(root, "stop");
    if (!s) return KVB_OK;
    if (cJSON_IsString(s)) {
        st->req.n_stop = 1;
        return get_string(s, "stop", false, &st->req.stop[0], e);
    }
    if (!cJSON_IsArray(s))
        return BAD(e, "stop", "Invalid type for 'stop': expected a string or an array of strings, but "
                   "got %s instead.", kvb_json_value_kind(s));
    int n = cJSON_GetArraySize(s);
    if (n > KVB_HTTP_MAX_STOP)
        return BAD(e, "stop", "Invalid 'stop': array too long. Expected an array with maximum length "
                   "%d, but got an array with length %d instead.", KVB_HTTP_MAX_STOP, n);
    size_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, s) {
        char p[32];
        snprintf(p, sizeof p, "stop[%zu]", i);
        kvb_status r = get_string(it, p, false, &st->req.stop[i], e);
        if (r) return r;
        i++;
    }
    st->req.n_stop = i;
    return KVB_OK;
}

/* stop_token_ids (vLLM's): at most KVB_HTTP_MAX_STOP_IDS token ids (the handler checks them against
 * the vocabulary). */
static kvb_status parse_stop_token_ids(req_storage *st, const cJSON *root, kvb_http_error *e) {
    const cJSON *a = field(root, "stop_token_ids");
    if (!a) return KVB_OK;
    if (!cJSON_IsArray(a))
        return BAD(e, "stop_token_ids", "Invalid type for 'stop_token_ids': expected an array of token ids, but got "
                   "%s instead.", kvb_json_value_kind(a));
    const int n = cJSON_GetArraySize(a);
    if (n > KVB_HTTP_MAX_STOP_IDS)
        return BAD(e, "stop_token_ids", "Invalid 'stop_token_ids': %d ids; at most %d.", n, KVB_HTTP_MAX_STOP_IDS);
    size_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, a) {
        char p[40];
        snprintf(p, sizeof p, "stop_token_ids[%zu]", i);
        kvb_status r = check_integer(it, p, 0, (double)INT32_MAX, e);
        if (r) return r;
        st->req.stop_token_ids[i++] = (int32_t)it->valuedouble;
    }
    st->req.n_stop_token_ids = i;
    return KVB_OK;
}

/* logit_bias: {"token id": bias in [-100, 100], ...}, at most KVB_HTTP_MAX_LOGIT_BIAS entries; the
 * ids are checked against the vocabulary by the handler. */
static kvb_status parse_logit_bias(req_storage *st, const cJSON *root, kvb_http_error *e) {
    const cJSON *b = field(root, "logit_bias");
    if (!b) return KVB_OK;
    if (!cJSON_IsObject(b))
        return BAD(e, "logit_bias", "Invalid type for 'logit_bias': expected an object mapping token ids to "
                   "biases, but got %s instead.", kvb_json_value_kind(b));
    const int n = cJSON_GetArraySize(b);
    if (n > KVB_HTTP_MAX_LOGIT_BIAS)
        return BAD(e, "logit_bias", "Invalid 'logit_bias': %d entries; at most %d.", n, KVB_HTTP_MAX_LOGIT_BIAS);
    if (n == 0) return KVB_OK;
    st->bias_ids = malloc(sizeof *st->bias_ids * (size_t)n);
    st->bias_values = malloc(sizeof *st->bias_values * (size_t)n);
    if (!st->bias_ids || !st->bias_values) return NOMEM(e);
    size_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, b) {
        const char *key = it->string ? it->string : "";
        char *end = NULL;
        const unsigned long long id = strtoull(key, &end, 10);
        if (!*key || *end || key[0] < '0' || key[0] > '9' || id > (unsigned long long)INT32_MAX)
            return BAD(e, "logit_bias", "Invalid key '%.40s' in 'logit_bias': expected a token id.", key);
        if (!cJSON_IsNumber(it) || !(it->valuedouble >= -100.0 && it->valuedouble <= 100.0))
            return BAD(e, "logit_bias", "Invalid bias for token %llu in 'logit_bias': expected a number in "
                       "[-100, 100].", id);
        st->bias_ids[i] = (int32_t)id;
        st->bias_values[i] = (float)it->valuedouble;
        i++;
    }
    st->req.logit_bias_ids = st->bias_ids;
    st->req.logit_bias_values = st->bias_values;
    st->req.n_logit_bias = i;
    return KVB_OK;
}

static kvb_status parse_kvbridge(req_storage *st, const cJSON *root, kvb_http_error *e) {
    const cJSON *k = field(root, "kvbridge");
    if (!k) return KVB_OK;
    if (!cJSON_IsObject(k))
        return BAD(e, "kvbridge", "Invalid type for 'kvbridge': expected an object, but got %s instead.",
                   kvb_json_value_kind(k));
    const cJSON *it;
    cJSON_ArrayForEach(it, k) {
        const char *key = it->string ? it->string : "";
        if (strcmp(key, "bridge") != 0)
            return BAD(e, "kvbridge", "Unknown kvbridge option '%.40s'; supported: 'bridge'.", key);
        if (cJSON_IsNull(it)) continue;
        const char *mode = NULL;
        kvb_status s = get_string(it, "kvbridge.bridge", false, &mode, e);
        if (s) return s;
        if (strcmp(mode, "auto") == 0) st->req.bridge = KVB_BRIDGE_AUTO;
        else if (strcmp(mode, "force") == 0) st->req.bridge = KVB_BRIDGE_FORCE;
        else if (strcmp(mode, "off") == 0) st->req.bridge = KVB_BRIDGE_OFF;
        else
            return BAD(e, "kvbridge.bridge", "Invalid value for 'kvbridge.bridge': '%.40s'. Supported "
                       "values are: 'auto', 'force' and 'off'.", mode);
    }
    return KVB_OK;
}

/* Known OpenAI fields whose meaning this server cannot honour: refuse rather than ignore. */
static kvb_status refuse_unsupported(const cJSON *root, kvb_api api, kvb_http_error *e) {
    const cJSON *v;
    if ((v = field(root, "tools")) && !(cJSON_IsArray(v) && cJSON_GetArraySize(v) == 0))
        return BAD(e, "tools", "'tools' is not supported by this server (no tool calling).");
    if ((v = field(root, "functions")) && !(cJSON_IsArray(v) && cJSON_GetArraySize(v) == 0))
        return BAD(e, "functions", "'functions' is not supported by this server (no tool calling).");
    /* a tool choice that asks for a call: there are no tools to call ("none" and "auto" mean none) */
    static const char *const choices[2] = {"tool_choice", "function_call"};
    for (int i = 0; i < 2; i++)
        if ((v = field(root, choices[i])) &&
            !(cJSON_IsString(v) && (strcmp(v->valuestring, "none") == 0 || strcmp(v->valuestring, "auto") == 0)))
            return BAD(e, choices[i], "'%s' other than \"none\" or \"auto\" is not supported by this server (no tool "
                       "calling).", choices[i]);
    if ((v = field(root, "audio")))
        return BAD(e, "audio", "'audio' is not supported by this server (text only).");
    if ((v = field(root, "modalities"))) {
        const cJSON *m;
        bool text_only = cJSON_IsArray(v);
        cJSON_ArrayForEach(m, v) text_only = text_only && cJSON_IsString(m) && strcmp(m->valuestring, "text") == 0;
        if (!text_only)
            return BAD(e, "modalities", "'modalities' other than [\"text\"] is not supported by this server.");
    }
    if (api == KVB_API_COMPLETIONS) {
        if ((v = field(root, "suffix")))
            return BAD(e, "suffix", "'suffix' is not supported by this server.");
        if ((v = field(root, "best_of")) && !(cJSON_IsNumber(v) && v->valuedouble == 1))
            return BAD(e, "best_of", "Only best_of=1 is supported by this server.");
    }
    return KVB_OK;
}

/* response_format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
 * "json_schema": {"name": 1..64 of [a-zA-Z0-9_-], "description"?, "schema"?, "strict"?}} (OpenAI's
 * shape). The schema is compiled here, so one outside the subset the grammar supports is a 400
 * that names the keyword and its path; without "schema" the reply is any JSON object, as with
 * json_object. "strict" is accepted either way: the reply is always held to the schema. */
static kvb_status parse_response_format(req_storage *st, const cJSON *root, kvb_http_error *e) {
    const cJSON *v = field(root, "response_format");
    if (!v) return KVB_OK;
    kvb_status s = cJSON_IsObject(v) ? http_json_refuse_unknown(v, "response_format", response_format_fields,
                                                                KVB_ARRAY_LEN(response_format_fields), e)
                                     : KVB_OK;
    if (s) return s;
    const cJSON *t = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "type") : NULL;
    const char *type = cJSON_IsString(t) ? t->valuestring : "";
    if (strcmp(type, "text") == 0) return KVB_OK;
    st->req.json_object = true;
    if (strcmp(type, "json_object") == 0) return KVB_OK;
    if (strcmp(type, "json_schema") != 0)
        return BAD(e, "response_format", "'response_format' other than {\"type\": \"text\"}, {\"type\": "
                   "\"json_object\"} or {\"type\": \"json_schema\", ...} is not supported by this server.");
    const cJSON *js = field(v, "json_schema");
    if (!js) return BAD(e, "response_format", "Missing required parameter: 'response_format.json_schema'.");
    if (!cJSON_IsObject(js))
        return BAD(e, "response_format", "Invalid type for 'response_format.json_schema': expected an object, but got "
                   "%s instead.", kvb_json_value_kind(js));
    for (const cJSON *f = js->child; f; f = f->next)
        if (strcmp(f->string, "name") != 0 && strcmp(f->string, "description") != 0 &&
            strcmp(f->string, "schema") != 0 && strcmp(f->string, "strict") != 0)
            return BAD(e, "response_format", "Unknown parameter: 'response_format.json_schema.%.40s'.", f->string);
    const cJSON *name = field(js, "name"), *desc = field(js, "description");
    const char *text = NULL;
    if (!name) return BAD(e, "response_format", "Missing required parameter: 'response_format.json_schema.name'.");
    if ((s = get_string(name, "response_format.json_schema.name", false, &text, e))) return s;
    bool name_ok = strlen(text) <= 64;
    for (const char *c = text; name_ok && *c; c++)
        name_ok = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '_' || *c == '-';
    if (!name_ok)
        return BAD(e, "response_format", "Invalid 'response_format.json_schema.name': '%.64s'. Expected 1 to 64 "
                   "characters of a-z, A-Z, 0-9, '_' and '-'.", text);
    if (desc && (s = get_string(desc, "response_format.json_schema.description", true, &text, e))) return s;
    bool strict = false;
    if ((s = get_bool(js, "strict", "response_format.json_schema.strict", &strict, e))) return s;
    const cJSON *schema = field(js, "schema");
    if (!schema) return KVB_OK; /* any object */
    if (!cJSON_IsObject(schema))
        return BAD(e, "response_format", "Invalid type for 'response_format.json_schema.schema': expected an object, "
                   "but got %s instead.", kvb_json_value_kind(schema));
    kvb_err err = {0};
    s = kvb_json_schema_compile(schema, "response_format.json_schema.schema", &st->schema, &err);
    if (s == KVB_ERR_NOMEM) return NOMEM(e);
    if (s) return BAD(e, "response_format", "%s", err.msg);
    st->req.json_schema = st->schema;
    return KVB_OK;
}

/* chat: "logprobs": bool, "top_logprobs": 0..20 (> 0 only with logprobs true); completions (the
 * legacy form): "logprobs": 0..20 top tokens (false: off), and no top_logprobs. */
static kvb_status parse_logprobs(kvb_completion_req *r, const cJSON *root, kvb_api api, kvb_http_error *e) {
    const cJSON *v = field(root, "logprobs"), *t = field(root, "top_logprobs");
    kvb_status s;
    if (api == KVB_API_CHAT_COMPLETIONS) {
        if ((s = get_bool(root, "logprobs", "logprobs", &r->logprobs, e))) return s;
        if (t) {
            if ((s = check_integer(t, "top_logprobs", 0, KVB_HTTP_MAX_TOP_LOGPROBS, e))) return s;
            if (t->valuedouble > 0 && !r->logprobs)
                return BAD(e, "top_logprobs", "'top_logprobs' requires 'logprobs' to be true.");
            r->top_logprobs = (uint32_t)t->valuedouble;
        }
        return KVB_OK;
    }
    if (t && !(cJSON_IsNumber(t) && t->valuedouble == 0))
        return BAD(e, "top_logprobs", "'top_logprobs' is a chat completions parameter; /v1/completions takes "
                   "the number of top tokens as 'logprobs'.");
    if (!v || cJSON_IsFalse(v)) return KVB_OK;
    if ((s = check_integer(v, "logprobs", 0, KVB_HTTP_MAX_TOP_LOGPROBS, e))) return s;
    r->logprobs = true;
    r->top_logprobs = (uint32_t)v->valuedouble;
    return KVB_OK;
}

static kvb_status parse_root(req_storage *st, const cJSON *root, kvb_http_error *e) {
    kvb_completion_req *r = &st->req;
    const kvb_api api = r->api;
    kvb_status s;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!model || cJSON_IsNull(model))
        return BAD(e, "model", "You must provide a model parameter.");
    if ((s = get_string(model, "model", false, &r->model, e))) return s;

    if (api == KVB_API_CHAT_COMPLETIONS) s = parse_messages(st, root, e);
    else s = parse_prompt(st, root, e);
    if (s) return s;

    const double int32_max = (double)INT32_MAX;
    const double min_tokens = api == KVB_API_CHAT_COMPLETIONS ? 1 : 0;
    const char *tok_fields[2] = {"max_tokens", "max_completion_tokens"};
    for (int i = 0; i < 2; i++) { /* the second wins */
        const cJSON *v = field(root, tok_fields[i]);
        if (!v) continue;
        if ((s = check_integer(v, tok_fields[i], min_tokens, int32_max, e))) return s;
        r->max_tokens = (int64_t)v->valuedouble;
    }
    if ((s = get_number(root, "temperature", 0, 2, &r->temperature, e))) return s;
    if ((s = get_number(root, "top_p", 0, 1, &r->top_p, e))) return s;
    if ((s = get_number(root, "frequency_penalty", -2, 2, &r->frequency_penalty, e))) return s;
    if ((s = get_number(root, "presence_penalty", -2, 2, &r->presence_penalty, e))) return s;
    const cJSON *v;
    if ((v = field(root, "top_k"))) {
        if ((s = check_integer(v, "top_k", -1, int32_max, e))) return s;
        r->top_k = v->valuedouble < 0 ? 0 : (int32_t)v->valuedouble;
    }
    if ((v = field(root, "seed"))) {
        /* doubles in [-2^63, 2^63) convert to int64 exactly */
        if ((s = check_integer(v, "seed", -9223372036854775808.0, 9223372036854774784.0, e))) return s;
        r->has_seed = true;
        r->seed = (int64_t)v->valuedouble;
    }
    if ((v = field(root, "n"))) {
        if ((s = check_integer(v, "n", 1, KVB_HTTP_MAX_N, e))) return s;
        r->n = (uint32_t)v->valuedouble;
    }
    const char *user_ignored = NULL; /* ignored, but a string must be valid UTF-8 */
    if ((v = field(root, "user")) && (s = get_string(v, "user", true, &user_ignored, e))) return s;
    if ((s = parse_stop(st, root, e))) return s;
    if ((s = parse_stop_token_ids(st, root, e))) return s;
    if ((v = field(root, "min_tokens"))) {
        if ((s = check_integer(v, "min_tokens", 0, int32_max, e))) return s;
        r->min_tokens = (int64_t)v->valuedouble;
        if (r->max_tokens >= 0 && r->min_tokens > r->max_tokens)
            return BAD(e, "min_tokens", "Invalid 'min_tokens': %lld is more than max_tokens (%lld).",
                       (long long)r->min_tokens, (long long)r->max_tokens);
    }
    if ((s = parse_logit_bias(st, root, e))) return s;
    if ((s = parse_logprobs(r, root, api, e))) return s;
    if (api == KVB_API_COMPLETIONS && (s = get_bool(root, "echo", "echo", &r->echo, e))) return s;
    if (api == KVB_API_COMPLETIONS &&
        (s = get_bool(root, "add_special_tokens", "add_special_tokens", &r->add_special_tokens, e)))
        return s;
    if (!r->add_special_tokens)
        return BAD(e, "add_special_tokens", "Only add_special_tokens=true is supported on /v1/completions (the "
                   "prompt's tokens are those the tokenizer adds specials to; send token ids for others).");
    if (r->echo && r->n > 1) return BAD(e, "echo", "'echo' is supported with n=1 only.");
    if ((s = get_bool(root, "stream", "stream", &r->stream, e))) return s;
    if ((s = get_bool(root, "ignore_eos", "ignore_eos", &r->ignore_eos, e))) return s;
    if ((v = field(root, "stream_options"))) {
        if (!cJSON_IsObject(v))
            return BAD(e, "stream_options", "Invalid type for 'stream_options': expected an object, but "
                       "got %s instead.", kvb_json_value_kind(v));
        if (!r->stream)
            return BAD(e, "stream_options", "The 'stream_options' parameter is only allowed when "
                       "'stream' is enabled.");
        if ((s = http_json_refuse_unknown(v, "stream_options", stream_options_fields,
                                          KVB_ARRAY_LEN(stream_options_fields), e)))
            return s;
        if ((s = get_bool(v, "include_usage", "stream_options.include_usage", &r->include_usage, e)))
            return s;
        bool obfuscation_ignored = false;
        if ((s = get_bool(v, "include_obfuscation", "stream_options.include_obfuscation", &obfuscation_ignored, e)))
            return s;
    }
    if ((s = parse_kvbridge(st, root, e))) return s;
    if ((s = refuse_unsupported(root, api, e))) return s;
    return parse_response_format(st, root, e);
}

/* A hostile body into a JSON object (*root; cJSON_Delete it), or a 400 saying what is wrong. */
static kvb_status parse_body_object(const char *body, size_t len, cJSON **root, kvb_http_error *e) {
    *root = NULL;
    if (!body) len = 0;
    size_t ws = 0;
    while (ws < len && (body[ws] == ' ' || body[ws] == '\t' || body[ws] == '\r' || body[ws] == '\n')) ws++;
    if (ws == len)
        return BAD(e, NULL, "The request body is empty; expected a JSON object.");
    if (memchr(body, '\0', len))
        return BAD(e, NULL, "The request body contains a NUL byte; expected JSON text.");
    kvb_status s = http_json_strings_check(body, len, e); /* before cJSON decodes (and may cut) them */
    if (s) return s;

    const char *end = NULL;
    cJSON *r = cJSON_ParseWithLengthOpts(body, len, &end, false);
    if (!r) {
        size_t at = (end && end >= body && end <= body + len) ? (size_t)(end - body) : 0;
        return BAD(e, NULL, "We could not parse the JSON body of your request: malformed JSON near "
                   "byte %zu.", at);
    }
    size_t pos = (end && end >= body && end <= body + len) ? (size_t)(end - body) : len;
    while (pos < len && (body[pos] == ' ' || body[pos] == '\t' || body[pos] == '\r' || body[pos] == '\n'))
        pos++;
    if (pos != len) {
        cJSON_Delete(r);
        return BAD(e, NULL, "We could not parse the JSON body of your request: unexpected bytes after "
                   "the JSON value at byte %zu.", pos);
    }
    if (!cJSON_IsObject(r)) s = BAD(e, NULL, "The request body must be a JSON object, but it is %s.", kvb_json_value_kind(r));
    if (!s) s = http_json_unique_keys(r, e);
    if (s) {
        cJSON_Delete(r);
        return s;
    }
    *root = r;
    return KVB_OK;
}

/* A request's storage around a parsed body, with OpenAI's defaults. */
static req_storage *new_storage(cJSON *root, kvb_api api) {
    req_storage *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->root = root;
    st->req.internal_ = st;
    st->req.api = api;
    st->req.max_tokens = -1;
    st->req.temperature = 1.0;
    st->req.top_p = 1.0;
    st->req.add_special_tokens = true;
    st->req.n = 1;
    return st;
}

typedef kvb_status (*fill_fn)(req_storage *st, const cJSON *root, kvb_http_error *e);
#define API_BY_BODY ((kvb_api)-1) /* chat when the body has "messages" (/tokenize) */

/* The body as a JSON object, a request's storage around it, then fill's fields. */
static kvb_status parse_request(const char *body, size_t len, kvb_api api, unsigned route, fill_fn fill,
                                kvb_completion_req **out, kvb_http_error *err) {
    kvb_http_error scratch;
    kvb_http_error *e = err ? err : &scratch;
    *out = NULL;
    cJSON *root = NULL;
    kvb_status s = parse_body_object(body, len, &root, e);
    if (!s) s = check_request_fields(root, route, e);
    if (s) {
        cJSON_Delete(root);
        return s;
    }
    if (api == API_BY_BODY) api = field(root, "messages") ? KVB_API_CHAT_COMPLETIONS : KVB_API_COMPLETIONS;
    req_storage *st = new_storage(root, api);
    if (!st) { cJSON_Delete(root); return NOMEM(e); }
    s = fill(st, root, e);
    if (s) { kvb_completion_req_free(&st->req); return s; }
    *out = &st->req;
    return KVB_OK;
}

kvb_status kvb_completion_req_parse(kvb_api api, const char *body, size_t len,
                                    kvb_completion_req **out, kvb_http_error *err) {
    if (api != KVB_API_CHAT_COMPLETIONS && api != KVB_API_COMPLETIONS) {
        *out = NULL;
        if (err) http_error_set(err, 500, NULL, NULL, "unknown API kind %d", (int)api);
        return KVB_ERR_INVALID;
    }
    return parse_request(body, len, api, api == KVB_API_CHAT_COMPLETIONS ? ON_CHAT : ON_COMPLETIONS, parse_root, out,
                         err);
}

/* "model", when given, names a model (the server checks which). */
static kvb_status parse_optional_model(req_storage *st, const cJSON *root, kvb_http_error *e) {
    const cJSON *m = field(root, "model");
    return m ? get_string(m, "model", false, &st->req.model, e) : KVB_OK;
}

static kvb_status fill_tokenize(req_storage *st, const cJSON *root, kvb_http_error *e) {
    const bool chat = st->req.api == KVB_API_CHAT_COMPLETIONS;
    kvb_status s = KVB_OK;
    if (chat && field(root, "prompt")) s = BAD(e, "prompt", "Send either 'prompt' or 'messages', not both.");
    if (!s) s = parse_optional_model(st, root, e);
    if (!s) s = chat ? parse_messages(st, root, e) : parse_prompt(st, root, e);
    if (!s && chat && field(root, "add_special_tokens"))
        s = BAD(e, "add_special_tokens", "'add_special_tokens' applies to 'prompt' only: the tokens of 'messages' "
                "are those a chat completion computes from them.");
    if (!s) s = get_bool(root, "add_special_tokens", "add_special_tokens", &st->req.add_special_tokens, e);
    bool gen_prompt = true;
    if (!s) s = get_bool(root, "add_generation_prompt", "add_generation_prompt", &gen_prompt, e);
    if (!s && !gen_prompt)
        s = BAD(e, "add_generation_prompt", "Only add_generation_prompt=true is supported by this server (the "
                "tokens a chat completion computes).");
    return s;
}

kvb_status kvb_tokenize_req_parse(const char *body, size_t len, kvb_completion_req **out, kvb_http_error *err) {
    return parse_request(body, len, API_BY_BODY, ON_TOKENIZE, fill_tokenize, out, err);
}

static kvb_status fill_detokenize(req_storage *st, const cJSON *root, kvb_http_error *e) {
    kvb_status s = parse_optional_model(st, root, e);
    const cJSON *toks = field(root, "tokens");
    if (!s && !toks) s = BAD(e, "tokens", "Missing required parameter: 'tokens'.");
    if (!s && !cJSON_IsArray(toks))
        s = BAD(e, "tokens", "Invalid type for 'tokens': expected an array of token ids, but got %s instead.",
                kvb_json_value_kind(toks));
    if (!s && toks->child) s = parse_token_ids(st, toks, "tokens", e); /* [] detokenizes to "" */
    return s;
}

kvb_status kvb_detokenize_req_parse(const char *body, size_t len, kvb_completion_req **out, kvb_http_error *err) {
    return parse_request(body, len, KVB_API_COMPLETIONS, ON_DETOKENIZE, fill_detokenize, out, err);
}

void kvb_completion_req_free(kvb_completion_req *req) {
    if (!req) return;
    req_storage *st = req->internal_;
    if (!st) return;
    for (size_t i = 0; i < st->n_owned; i++) free(st->owned[i]);
    free(st->owned);
    free(st->msgs);
    free(st->tokens);
    free(st->bias_ids);
    free(st->bias_values);
    kvb_json_schema_free(st->schema);
    cJSON_Delete(st->root);
    free(st);
}
