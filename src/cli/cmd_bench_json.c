/* cli/cmd_bench_json.c — `kvbridge bench json`: what constrained decoding costs a reply. One native
 * decode node on loopback; in each round the same prompt is asked for T tokens twice, in turn
 * first: as plain text (ignore_eos) and under a json_schema whose one string property has a
 * minLength no T tokens reach (so the reply runs T tokens, every one drawn through the masker: the
 * schema's recognizer tries each vocabulary token at each step the mask cache has not seen). The
 * figure is each reply's decode tokens per second (usage.kvbridge.decode_s), medians of the rounds,
 * and their ratio. */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_model.h"
#include "kvb_node.h"

/* One request: its decode tokens per second, or -1 with why. text: the reply's first bytes. */
static double one_reply(uint16_t port, const char *body, long long want, char *text, size_t text_len, char *why,
                        size_t why_len) {
    kvb_http_reply r;
    kvb_err err = {0};
    if (kvb_http_post("127.0.0.1", port, "/v1/completions", body, 600000, &r, &err)) {
        snprintf(why, why_len, "%.200s", err.msg);
        return -1;
    }
    double tps = -1;
    cJSON *root = r.status == 200 ? cJSON_Parse(r.body) : NULL;
    const cJSON *usage = cJSON_GetObjectItem(root, "usage"), *kb = cJSON_GetObjectItem(usage, "kvbridge");
    const cJSON *tok = cJSON_GetObjectItem(usage, "completion_tokens"), *dec = cJSON_GetObjectItem(kb, "decode_s");
    const cJSON *t = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0), "text");
    if (cJSON_IsNumber(tok) && cJSON_IsNumber(dec) && cJSON_IsString(t) && tok->valuedouble == (double)want &&
        dec->valuedouble > 0) {
        tps = tok->valuedouble / dec->valuedouble;
        snprintf(text, text_len, "%s", t->valuestring);
    } else if (r.status == 200)
        snprintf(why, why_len, "the reply ran %g tokens, not %lld", cJSON_IsNumber(tok) ? tok->valuedouble : -1.0, want);
    else
        snprintf(why, why_len, "HTTP %d: %.150s", r.status, r.body ? r.body : "");
    cJSON_Delete(root);
    kvb_http_reply_free(&r);
    return tps;
}

int kvb_bench_json(int argc, char **argv) {
    const char *model = NULL;
    long long tokens = 0, rounds = 0, threads = 0;
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&model, "GGUF model", true),
        KVB_CLI_INT("tokens", &tokens, "T", 1, 1024, "64", "tokens of each reply"),
        KVB_CLI_INT("rounds", &rounds, "R", 1, 100, "3", "rounds; the medians are reported"),
        KVB_CLI_OPT_THREADS(&threads, "the node's CPU threads (default: all)"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "bench json", .usage = "-m MODEL [--tokens T] [--rounds R] [--threads N]", .opts = opts,
        .about = "Starts a native decode node on loopback and asks it, R rounds, for T tokens of the same prompt "
                 "twice (the order alternates): as plain text, and under a response_format json_schema whose "
                 "string property has a minLength no T tokens reach (every token drawn through the vocabulary "
                 "mask). Prints both decode speeds (tokens per second of decoding, from usage.kvbridge), their "
                 "ratio, and the schema reply's start."};
    int prc = kvb_cli_parse(&spec, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    kvb_err err = {0};
    kvb_model *m = NULL;
    if (kvb_model_load(model, &m, &err)) {
        fprintf(stderr, "kvbridge bench json: %s\n", err.msg);
        return 1;
    }
    const uint32_t n_vocab = m->d.n_vocab;
    kvb_model_free(m);
    /* the prompt: 16 random ids; the schema's string: longer than any T tokens can write */
    char prompt[16 * 12] = "", *p = prompt;
    kvb_rng rng;
    kvb_rng_seed(&rng, 11);
    for (int t = 0; t < 16; t++) p += sprintf(p, "%s%u", t ? "," : "", (unsigned)(kvb_rng_u64(&rng) % n_vocab));
    char plain[512], schema[768];
    snprintf(plain, sizeof plain, "{\"model\":\"m\",\"prompt\":[%s],\"max_tokens\":%lld,\"temperature\":0,"
             "\"ignore_eos\":true}", prompt, tokens);
    snprintf(schema, sizeof schema, "{\"model\":\"m\",\"prompt\":[%s],\"max_tokens\":%lld,\"temperature\":0,"
             "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"bench\",\"schema\":{\"type\":"
             "\"object\",\"properties\":{\"text\":{\"type\":\"string\",\"minLength\":65535}},\"required\":[\"text\"],"
             "\"additionalProperties\":false}}}}", prompt, tokens);
    kvb_decode_node *node = NULL;
    kvb_decode_config c = {.http_listen = "127.0.0.1:0", .model_path = model, .n_threads = (int)threads,
                           .max_ctx = (uint32_t)(16 + tokens + 64), .parallel = 1};
    if (kvb_decode_node_start(&c, &node, &err)) {
        fprintf(stderr, "kvbridge bench json: %s\n", err.msg);
        return 1;
    }
    printf("model      %s\n", model);
    printf("replies    %lld tokens greedy after a 16-token prompt: plain text, and under a json_schema\n", tokens);
    double tps[2][100];
    char text[2][4096] = {"", ""}, why[256] = "";
    int rc = 1;
    for (int r = 0; r < rounds; r++)
        for (int j = 0; j < 2; j++) {
            const int k = (r + j) % 2; /* alternate which goes first */
            tps[k][r] = one_reply(kvb_decode_node_port(node), k ? schema : plain, tokens, text[k], sizeof text[k], why,
                                  sizeof why);
            if (tps[k][r] < 0) {
                fprintf(stderr, "kvbridge bench json: %s reply: %s\n", k ? "json_schema" : "plain", why);
                goto done;
            }
            fprintf(stderr, "bench json: round %d/%lld: %s %.2f tok/s\n", r + 1, rounds, k ? "json_schema" : "plain",
                    tps[k][r]);
        }
    for (int k = 0; k < 2; k++) {
        printf("%-10s", k ? "schema" : "plain");
        for (int r = 0; r < rounds; r++) printf(" %.2f", tps[k][r]);
        printf(" decode tok/s (per round)\n");
    }
    const double plain_m = kvb_median_sort(tps[0], (int)rounds), schema_m = kvb_median_sort(tps[1], (int)rounds);
    printf("median     plain %.2f tok/s, json_schema %.2f tok/s = %.2fx\n", plain_m, schema_m, schema_m / plain_m);
    printf("reply      %.70s...\n", text[1]);
    rc = 0;
done:
    kvb_decode_node_stop(node);
    return rc;
}
