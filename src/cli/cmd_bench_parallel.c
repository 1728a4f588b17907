/* cli/cmd_bench_parallel.c — `kvbridge bench parallel`: what serving several requests at once buys.
 * Two native decode nodes on loopback load the same model, one serving a request at a time
 * (--parallel 1) and one serving all the clients at once (their decode steps batched). In each
 * round, N clients send their own prompt at the same moment to one node, then to the other
 * (the order alternates), each asking T tokens greedily; the figure is the tokens of all the
 * replies over the wall time until the last one came back. Every client's reply must be the same
 * text from both nodes. */
#include <cJSON.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_model.h"
#include "kvb_node.h"

#define MAX_CLIENTS KVB_DECODE_MAX_PARALLEL


typedef struct {
    uint16_t port;
    const char *body;
    int tokens;  /* out: completion_tokens */
    char *text;  /* out: malloc'd */
    char err[200];
} client;

static void *client_main(void *arg) {
    client *c = arg;
    kvb_http_reply r;
    kvb_err err = {0};
    c->tokens = -1;
    if (kvb_http_post("127.0.0.1", c->port, "/v1/completions", c->body, 600000, &r, &err)) {
        snprintf(c->err, sizeof c->err, "%.190s", err.msg);
        return NULL;
    }
    cJSON *root = r.status == 200 ? cJSON_Parse(r.body) : NULL;
    const cJSON *usage = cJSON_GetObjectItem(root, "usage");
    const cJSON *text = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0), "text");
    if (cJSON_IsNumber(cJSON_GetObjectItem(usage, "completion_tokens")) && cJSON_IsString(text)) {
        c->tokens = (int)cJSON_GetObjectItem(usage, "completion_tokens")->valuedouble;
        c->text = strdup(text->valuestring);
    } else
        snprintf(c->err, sizeof c->err, "HTTP %d: %.150s", r.status, r.body ? r.body : "");
    cJSON_Delete(root);
    kvb_http_reply_free(&r);
    return NULL;
}

/* One round on one node: every client at once. Returns tokens/s, or -1 (a client failed). */
static double round_on(uint16_t port, char **bodies, int n, char **texts, char *why, size_t why_len) {
    client cs[MAX_CLIENTS];
    pthread_t th[MAX_CLIENTS];
    memset(cs, 0, sizeof cs);
    const double t0 = kvb_now_s();
    int started = 0;
    for (int i = 0; i < n; i++) {
        cs[i] = (client){.port = port, .body = bodies[i]};
        if (pthread_create(&th[i], NULL, client_main, &cs[i])) break;
        started++;
    }
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    const double secs = kvb_now_s() - t0;
    long total = 0;
    bool ok = started == n;
    for (int i = 0; i < n; i++) {
        if (cs[i].tokens < 0) {
            if (ok) snprintf(why, why_len, "client %d: %s", i, cs[i].err);
            ok = false;
        }
        total += cs[i].tokens;
        free(texts[i]);
        texts[i] = cs[i].text;
    }
    if (!ok && !why[0]) snprintf(why, why_len, "could not start the client threads");
    return ok ? total / secs : -1;
}

int kvb_bench_parallel(int argc, char **argv) {
    const char *model = NULL;
    long long clients = 0, tokens = 0, prompt = 0, rounds = 0, threads = 0;
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&model, "GGUF model", true),
        KVB_CLI_INT("clients", &clients, "N", 2, MAX_CLIENTS, "4", "concurrent clients, and the second node's --parallel"),
        KVB_CLI_INT("tokens", &tokens, "T", 1, 4096, "64", "max_tokens of each request, greedy"),
        KVB_CLI_INT("prompt-tokens", &prompt, "P", 1, 16384, "64", "each client's own prompt of random token ids"),
        KVB_CLI_INT("rounds", &rounds, "R", 1, 100, "3", "rounds; the median is reported"),
        KVB_CLI_OPT_THREADS(&threads, "the nodes' CPU threads (default: all)"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "bench parallel", .opts = opts,
        .usage = "-m MODEL [--clients N] [--tokens T] [--prompt-tokens P] [--rounds R]",
        .about = "Starts two native decode nodes on loopback, one serving a request at a time and one serving N at "
                 "once (decode steps batched), sends N clients' requests at the same moment to each in turn, R "
                 "rounds, and prints the tokens per second of all replies together on both, their ratio, and "
                 "whether every reply was the same on both."};
    int prc = kvb_cli_parse(&spec, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    const int n = (int)clients;
    kvb_err err = {0};
    kvb_model *m = NULL;
    if (kvb_model_load(model, &m, &err)) {
        fprintf(stderr, "kvbridge bench parallel: %s\n", err.msg);
        return 1;
    }
    const uint32_t n_vocab = m->d.n_vocab;
    kvb_model_free(m);
    /* each client's own prompt of random ids; every request the same but for them */
    char *bodies[MAX_CLIENTS] = {0}, *texts[2][MAX_CLIENTS] = {{0}};
    kvb_rng rng;
    kvb_rng_seed(&rng, 7);
    for (int c = 0; c < n; c++) {
        cJSON *req = cJSON_CreateObject(), *ids = cJSON_AddArrayToObject(req, "prompt");
        cJSON_AddStringToObject(req, "model", "m");
        for (long long t = 0; t < prompt; t++) cJSON_AddItemToArray(ids, cJSON_CreateNumber((double)(kvb_rng_u64(&rng) % n_vocab)));
        cJSON_AddNumberToObject(req, "max_tokens", (double)tokens);
        cJSON_AddNumberToObject(req, "temperature", 0);
        bodies[c] = cJSON_PrintUnformatted(req);
        cJSON_Delete(req);
    }
    kvb_decode_node *nodes[2] = {NULL, NULL};
    const uint32_t ctx = (uint32_t)(prompt + tokens + 64);
    int rc = 1;
    for (int k = 0; k < 2; k++) {
        kvb_decode_config c = {.http_listen = "127.0.0.1:0", .model_path = model, .n_threads = (int)threads,
                               .max_ctx = ctx, .cache_blocks = (uint32_t)(n + 1) * ((ctx + 31) / 32),
                               .parallel = k ? (uint32_t)n : 1};
        if (kvb_decode_node_start(&c, &nodes[k], &err)) {
            fprintf(stderr, "kvbridge bench parallel: %s\n", err.msg);
            goto done;
        }
    }
    printf("model      %s\n", model);
    printf("clients    %d at once, each its own %lld-token prompt, %lld tokens greedy\n", n, prompt, tokens);
    double tps[2][100];
    bool same = true;
    for (int r = 0; r < rounds; r++) {
        for (int j = 0; j < 2; j++) {
            const int k = (r + j) % 2; /* alternate which node goes first */
            char why[256] = "";
            tps[k][r] = round_on(kvb_decode_node_port(nodes[k]), bodies, n, texts[k], why, sizeof why);
            if (tps[k][r] < 0) {
                fprintf(stderr, "kvbridge bench parallel: %s\n", why);
                goto done;
            }
        }
        for (int c = 0; c < n; c++) same &= !strcmp(texts[0][c], texts[1][c]);
        fprintf(stderr, "bench parallel: round %d/%lld: one at a time %.2f tok/s, %d at once %.2f tok/s\n", r + 1,
                rounds, tps[0][r], n, tps[1][r]);
    }
    for (int k = 0; k < 2; k++) {
        printf("%-10s", k ? "at once" : "one by one");
        for (int r = 0; r < rounds; r++) printf(" %.2f", tps[k][r]);
        printf(" tok/s (all replies together, per round)\n");
    }
    const double one = kvb_median_sort(tps[0], (int)rounds), all = kvb_median_sort(tps[1], (int)rounds);
    printf("median     one at a time %.2f tok/s, %d at once %.2f tok/s = %.2fx\n", one, n, all, all / one);
    printf("replies    %s\n", same ? "the same text from both nodes, every client and round"
                                    : "DIFFERENT between the nodes (a batched step is not its own forward)");
    rc = same ? 0 : 1;
done:
    for (int k = 0; k < 2; k++) kvb_decode_node_stop(nodes[k]);
    for (int c = 0; c < n; c++) {
        cJSON_free(bodies[c]);
        free(texts[0][c]);
        free(texts[1][c]);
    }
    return rc;
}
