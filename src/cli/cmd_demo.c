/* cli/cmd_demo.c — `kvbridge demo`, the README's main command: generates the tiny model if
 * absent, starts a prefill node and a decode node on loopback (plus a second, native-only decode
 * node as the baseline), holds a 4-turn conversation through the OpenAI API, and prints the
 * multi-turn table beside the same conversation served natively. `--model gemma3` is the real
 * Gemma 3 270M file tools/fetch_gemma3.sh fetches. A model without a chat template (a base,
 * pretrained model such as that one: chat markup is only echoed back) holds the conversation as
 * a transcript it continues through /v1/completions instead of chat messages: an interview with
 * one example exchange, one line per reply, each turn's prompt the previous one plus the reply
 * and the next question. */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kvb_cli.h"
#include "kvb_gguf.h"
#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_quant.h"
#include "kvb_prefill_engine.h"
#include "svg_chart.h"

static const char *k_document =
    "The harbour at Kestrel Point was built in 1887 to ship granite from the quarries on the ridge. "
    "Each morning the stone came down on a cable railway, and each evening the barges left on the tide. ";

static const char *k_questions[] = {
    "When was the harbour built, and what did it ship?",
    "Describe the cable railway in a few words.",
    "What happened to the barges each evening?",
    "Summarise the whole document in one sentence.",
    "What is the ridge made of?",
    "Thank you. Anything else worth knowing?",
};

/* For a base model: an interview it continues, one example exchange, then the visitor's questions. */
static const char *k_interview =
    "The following is an interview with the harbour master of Kestrel Point, a small granite port. The harbour "
    "master answers each question in one or two sentences, using the history below.\n\n"
    "History of the harbour\n"
    "Kestrel Point harbour was built in 1887 to ship granite from the quarries on the ridge above the town. Each "
    "morning the stone came down to the quay on a cable railway, two wagons at a time, and each evening the barges "
    "left on the tide for the cities of the south coast. At its busiest, in 1912, the harbour shipped forty "
    "thousand tons of granite a year and employed three hundred men. The quarries closed in 1958, when concrete "
    "replaced stone in most new buildings, and the cable railway was taken down two years later. Today the harbour "
    "is used by fishing boats and sailing yachts, and the old stone warehouse on the quay is a museum of the "
    "granite trade.\n\n"
    "Visitor: Good morning. Who are you?\n"
    "Harbour master: Good morning. I am the harbour master of Kestrel Point, and I have worked here for twenty "
    "years.\n";

static const char *k_visitor_questions[] = {
    "I arrived on the morning ferry and walked up from the station, past the old sheds and the fish market, "
    "and everyone in the town seems to talk about the granite. When was the harbour built, and what did it ship?",
    "From the end of the quay I can see the ridge and the scars of the old quarries high above the town, but no "
    "road climbs up there from the water. How did the stone get down to the quay?",
    "It must have been a hard and noisy place to work, with the wagons coming down every morning and the barges "
    "leaving every evening, in every season of the year. Why did the quarries close?",
    "On my way here I passed a long stone building on the quay with a new sign over its door and a queue of "
    "schoolchildren waiting outside it. What is the old warehouse used for today?",
    "My grandfather used to tell me that half the town once worked down here, loading stone from dawn until the "
    "evening tide. How many men worked here in 1912?",
    "Thank you, this has been very helpful, and I still have the whole afternoon before my ferry leaves. What "
    "should I see first?",
};

typedef struct {
    int prompt, cached, bridged, native, completion;
    double prefill_s, transfer_s, reply_s, decode_s; /* decode_s: usage.kvbridge's decoding phase */
    char verdict[160];
    char *content;
} turn_result;

/* One request (req: its JSON body, consumed) to `path`; the reply is choices[0].message.content
 * (chat) or choices[0].text (completions). */
static int post_turn(uint16_t port, const char *path, cJSON *req, turn_result *r) {
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    kvb_http_reply rep;
    kvb_err err = {0};
    double t0 = kvb_now_s();
    kvb_status st = body ? kvb_http_post("127.0.0.1", port, path, body, 600000, &rep, &err) : KVB_ERR_NOMEM;
    r->reply_s = kvb_now_s() - t0;
    free(body);
    if (st) {
        fprintf(stderr, "kvbridge demo: %s\n", body ? err.msg : "out of memory");
        return -1;
    }
    cJSON *root = cJSON_Parse(rep.body);
    cJSON *usage = cJSON_GetObjectItem(root, "usage"), *kb = cJSON_GetObjectItem(usage, "kvbridge");
    cJSON *choice = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
    cJSON *msg = cJSON_GetObjectItem(choice, "message");
    cJSON *content = msg ? cJSON_GetObjectItem(msg, "content") : cJSON_GetObjectItem(choice, "text");
    if (rep.status != 200 || !kb || !cJSON_IsString(content)) {
        fprintf(stderr, "kvbridge demo: HTTP %d: %s\n", rep.status, rep.body);
        cJSON_Delete(root);
        kvb_http_reply_free(&rep);
        return -1;
    }
#define NUM(obj, k) (cJSON_GetObjectItem(obj, k) ? cJSON_GetObjectItem(obj, k)->valuedouble : 0)
    r->prompt = (int)NUM(usage, "prompt_tokens");
    r->completion = (int)NUM(usage, "completion_tokens");
    r->cached = (int)NUM(kb, "cached_tokens");
    r->bridged = (int)NUM(kb, "bridged_tokens");
    r->native = (int)NUM(kb, "native_tokens");
    r->prefill_s = NUM(kb, "prefill_s");
    r->transfer_s = NUM(kb, "transfer_s");
    r->decode_s = NUM(kb, "decode_s");
#undef NUM
    snprintf(r->verdict, sizeof r->verdict, "%s", rep.verdict);
    r->content = strdup(content->valuestring);
    cJSON_Delete(root);
    kvb_http_reply_free(&rep);
    return r->content ? 0 : -1;
}

static int chat_turn(uint16_t port, cJSON *messages, turn_result *r) {
    cJSON *req = cJSON_CreateObject();
    cJSON_AddStringToObject(req, "model", "demo");
    cJSON_AddItemReferenceToObject(req, "messages", messages);
    cJSON_AddNumberToObject(req, "max_tokens", 24);
    cJSON_AddNumberToObject(req, "temperature", 0);
    return post_turn(port, "/v1/chat/completions", req, r);
}

/* A base model's turn: the transcript so far, continued greedily up to the end of the line. */
static int transcript_turn(uint16_t port, const char *transcript, turn_result *r) {
    cJSON *req = cJSON_CreateObject();
    cJSON_AddStringToObject(req, "model", "demo");
    cJSON_AddStringToObject(req, "prompt", transcript);
    cJSON_AddNumberToObject(req, "max_tokens", 40);
    cJSON_AddNumberToObject(req, "temperature", 0);
    cJSON_AddStringToObject(req, "stop", "\n");
    return post_turn(port, "/v1/completions", req, r);
}

/* One interview against one decode node: each turn appends the question, the model continues the
 * harbour master's line, and its reply stays in the transcript. */
static int interview(uint16_t port, int turns, turn_result *out) {
    kvb_strbuf t = {0};
    kvb_strbuf_put(&t, k_interview);
    int rc = 0;
    for (int i = 0; i < turns && !rc; i++) {
        kvb_strbuf_put(&t, "\nVisitor: ");
        kvb_strbuf_put(&t, k_visitor_questions[i % 6]);
        kvb_strbuf_put(&t, "\nHarbour master:");
        if (t.oom) {
            rc = -1;
            break;
        }
        rc = transcript_turn(port, t.p, &out[i]);
        if (!rc) {
            kvb_strbuf_put(&t, out[i].content);
            kvb_strbuf_put(&t, "\n");
        }
    }
    free(t.p);
    return rc;
}

/* One conversation against one decode node; results per turn. */
static int converse(uint16_t port, int turns, turn_result *out) {
    cJSON *messages = cJSON_CreateArray();
    char doc[8192] = "Read this document, then answer my questions.\n\n";
    for (int i = 0; i < 12; i++) strncat(doc, k_document, sizeof doc - strlen(doc) - 1);
    int rc = 0;
    for (int t = 0; t < turns && !rc; t++) {
        char user[9000];
        snprintf(user, sizeof user, "%s%s", t == 0 ? doc : "", k_questions[t % 6]);
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", user);
        cJSON_AddItemToArray(messages, m);
        rc = chat_turn(port, messages, &out[t]);
        if (!rc) {
            cJSON *a = cJSON_CreateObject();
            cJSON_AddStringToObject(a, "role", "assistant");
            cJSON_AddStringToObject(a, "content", out[t].content);
            cJSON_AddItemToArray(messages, a);
        }
    }
    cJSON_Delete(messages);
    return rc;
}

static const char *const k_demo_devices[] = {"auto", "cpu", "cuda", NULL};

/* What the command line asks of the demo. */
typedef struct {
    const char *model;
    long long threads, turns, gpus;
    const char *svg; /* --svg FILE */
    int device; /* k_demo_devices */
    bool tp_one_device;
} demo_args;

/* Fills *a from argv; KVB_CLI_GO, or the code the command returns. */
static int demo_parse(demo_args *a, int argc, char **argv) {
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&a->model,
                          "use this GGUF instead of the generated tiny model; `gemma3` is the real Gemma 3 270M "
                                   "(~/.cache/kvbridge/gemma-3-270m-q4_k_m.gguf, fetched by tools/fetch_gemma3.sh). A "
                          "model without a chat template (a base model, like that one) holds the conversation as "
                          "an interview transcript it continues (/v1/completions, one line per reply) and the "
                          "replies are printed",
                          false),
        {.long_name = "threads", .kind = KVB_OPT_INT, .dst = &a->threads, .meta = "T", .help = "CPU threads per node",
         .def = "1", .lo = 1, .hi = 1024},
        {.long_name = "turns", .kind = KVB_OPT_INT, .dst = &a->turns, .meta = "N", .help = "conversation turns",
         .def = "4", .lo = 1, .hi = 6},
        {.long_name = "device", .kind = KVB_OPT_ENUM, .dst = &a->device, .meta = "D", .def = "auto",
         .choices = k_demo_devices,
         .help = "the prefill node's engine: auto (cuda when a GPU is usable, else cpu), cpu or cuda"},
        {.long_name = "gpus", .kind = KVB_OPT_INT, .dst = &a->gpus, .meta = "N", .def = "1", .lo = 1,
         .hi = KVB_CLI_MAX_GPUS, .help = "cuda: tensor-parallel prefill over GPUs 0..N-1 (NCCL)"},
        {.long_name = "tp-one-device", .kind = KVB_OPT_FLAG, .dst = &a->tp_one_device,
         .help = "cuda, --gpus N: every rank on one GPU (tests the split)"},
        KVB_CLI_STR("svg", &a->svg, "FILE",
                    "also write a chart: each turn's time to first token (its reply time less the decoding phase "
                    "usage.kvbridge reports) by the turn's prompt length, bridged and on the decode node alone (SVG)"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "demo", .usage = "[--model FILE|gemma3] [--threads T] [--turns N]", .opts = opts,
        .about = "Starts a prefill node and a decode node on loopback (CPU -> CPU here; the prefill node computes "
                 "the decode node's own cache), holds a multi-turn conversation through the OpenAI API, and prints "
                 "per turn: prompt tokens, tokens already cached, tokens bridged, prefill and transfer seconds, "
                 "reply seconds and the verdict — beside the same conversation on a decode node without a prefill "
                 "node. The decode node bridges any whole uncached block (threshold one block of 32 tokens; "
                 "serve's default is two), so turns with short increments are bridged too. The default model is "
                 "generated (models/tiny-q8_0.gguf, random weights: the replies are noise; the demo shows the "
                 "machinery, and that bridged and native replies are identical)."};
    int rc = kvb_cli_parse(&spec, argc, argv);
    if (rc != KVB_CLI_GO) return rc;
    return kvb_arg_gpus_ok("demo", a->gpus, a->tp_one_device, a->device == 2) ? KVB_CLI_GO : 2;
}

/* What the table means, what the run proved on this machine and what it cannot show. Every number
 * quoted here is the run's own or its configuration's. br: the bridged conversation's turns. */
static void explain(const turn_result *br, int same, int complete, int turns, bool cuda, uint32_t block_tokens,
                    double capture_bytes) {
    printf("\ncolumns: prompt = the turn's prompt tokens. cached = the leading tokens of the prompt that the\n"
           "  decode node already held: what earlier turns left in its store, in whole %u-token blocks only,\n"
           "  and only where this prompt's tokens are the same (a reply that the chat template encodes again\n"
           "  can come out as other tokens). The partial block after them is computed and shipped again.\n",
           block_tokens);
    if (turns > 1)
        printf("  Turn 2 here: %d cached (%d whole blocks) of turn 1's %d tokens (%d prompt + %d reply).\n",
               br[1].cached, br[1].cached / (int)block_tokens, br[0].prompt + br[0].completion, br[0].prompt,
               br[0].completion);
    printf("  bridged = tokens whose cache came from the prefill node; native = tokens the decode node\n"
           "  computed itself (the last prompt token: its logits start the reply). prefill s = the prefill\n"
           "  node's time from the request's arrival to its last slab sent; transfer s = the decode node's\n"
           "  from sending the request to the last slab received. Slabs stream out while later blocks are\n"
           "  computed, so both cover the same work and differ only by the request's and the last slab's\n"
           "  trips (milliseconds on loopback): the transfer hides in the prefill. reply s = the whole HTTP\n"
           "  request, reply generated; native reply s = the same request on the decode node that has no\n"
           "  prefill node. verdict: complete = every block the decode node asked for arrived.\n");
    printf("\ndemo: %d/%d replies identical to the native ones. Turn 1 ships the whole prompt; later turns ship only\n"
           "their increment (the decode node keeps the conversation cached). Capture memory on the prefill node:\n"
           "%.1f KiB of staging ring, whatever the prompt length.\n",
           same, turns, capture_bytes / 1024.0);
    /* A CPU prefill node computes the decoder's own cache bit for bit: its replies must be the
     * native ones. A GPU prefill node runs the decoder's arithmetic on the GPU's bf16 hidden
     * states, which differ from the decoder's by bf16 rounding: the cache is close, not equal, and
     * a model with near-tied logits (the generated one has random weights) can part from the
     * native reply. There every turn must be bridged `complete`, and agreement is reported. */
    if (cuda) {
        printf("demo: the prefill node ran on the GPU (bf16 forward): its cache is the decoder's arithmetic on the\n"
               "GPU's hidden states, close to the native cache but not bit-identical, so on this model's near-tied\n"
               "logits replies may part (--device cpu bridges bit for bit). %d/%d turns bridged `complete`.\n",
               complete, turns);
        printf("demo: what the bridge buys on a long prompt is measured by `kvbridge bench ladder -m MODEL\n"
               "--device cuda` (time to first token bridged vs the decode node alone, at 1K-16K tokens).\n");
        return;
    }
    if (same == turns)
        printf("demo: proved here: a separate prefill node computed the decode node's own KV cache and\n"
               "streamed it over TCP, and the decode node's replies from it are the native ones token for\n"
               "token (`kvbridge verify` compares the caches themselves, bit for bit).\n");
    else
        printf("demo: NOT proved: %d of %d replies differ from the native ones, where a CPU prefill node must\n"
               "reproduce the decode node's cache bit for bit (`kvbridge verify` compares the caches).\n",
               turns - same, turns);
    printf("demo: not shown here: speed. Both nodes share this machine's CPU, so the times show the machinery,\n"
           "not a gain; the gain comes from a GPU prefill node feeding a CPU decode node. On a GPU host,\n"
           "`kvbridge bench ladder -m MODEL --device cuda` measures it (time to first token, bridged vs alone).\n");
}

/* Resolves --model (`gemma3`, a file, or the default tiny model, generated here when absent) into
 * *model, which may point into buf; 0, or the code the command returns. */
static int demo_model_path(const char **model, char *buf, size_t cap) {
    struct stat sb;
    kvb_err err = {0};
    if (!strcmp(*model, "gemma3")) {
        kvb_gemma3_path(buf, cap);
        *model = buf;
        if (stat(*model, &sb) != 0) {
            fprintf(stderr, "kvbridge demo: --model gemma3: the Gemma 3 270M file is not at %s; run "
                            "tools/fetch_gemma3.sh to fetch it (or give --model FILE)\n", *model);
            return 1;
        }
    }
    if (stat(*model, &sb) != 0) {
        if (strcmp(*model, "models/tiny-q8_0.gguf") != 0) {
            fprintf(stderr, "kvbridge demo: %s does not exist\n", *model);
            return 1;
        }
        mkdir("models", 0755);
        printf("demo: generating the tiny model (llama architecture, Q8_0 weights, seed 1) -> %s\n", *model);
        kvb_gen_opts o = {.preset = "tiny", .type = KVB_TYPE_Q8_0, .seed = 1};
        if (kvb_gen_model(&o, *model, &err)) {
            fprintf(stderr, "kvbridge demo: %s\n", err.msg);
            return 1;
        }
    }
    return 0;
}

/* Reads the model's general.name ("?" without one) and whether it is a base model: one without a
 * chat template, which would only echo chat markup, so it continues a transcript. 0, or 1. */
static int demo_model_info(const char *model, bool *base, char *name, size_t cap) {
    kvb_err err = {0};
    kvb_gguf *g = NULL;
    if (kvb_gguf_open(model, &g, &err)) {
        fprintf(stderr, "kvbridge demo: %s\n", err.msg);
        return 1;
    }
    *base = !kvb_gguf_find(g, "tokenizer.chat_template");
    if (kvb_gguf_get_str(g, "general.name", name, cap, &err)) snprintf(name, cap, "?");
    kvb_gguf_close(g);
    return 0;
}

/* Prints the bridged conversation's replies (show) and the per-turn table beside the native one;
 * returns how many replies are the native ones. br, nat: (turn) of each conversation. */
static int demo_table(const turn_result *br, const turn_result *nat, int turns, bool base, bool show) {
    if (show) {
        for (int t = 0; t < turns; t++) {
            const char *reply = br[t].content + (br[t].content[0] == ' ');
            if (base) printf("  Visitor:        %s\n  Harbour master: %s\n", k_visitor_questions[t % 6], reply);
            else printf("  user:      %s\n  assistant: %s\n", k_questions[t % 6], reply);
        }
        printf("  (the bridged conversation; the native one is compared below)\n\n");
    }

    printf("turn  prompt  cached  bridged  native  prefill s  transfer s  reply s | native reply s  same reply  verdict\n");
    int same = 0;
    for (int t = 0; t < turns; t++) {
        bool eq = !strcmp(br[t].content, nat[t].content);
        same += eq;
        printf("%4d  %6d  %6d  %7d  %6d  %9.3f  %10.3f  %7.3f | %14.3f  %10s  %s\n", t + 1, br[t].prompt, br[t].cached,
               br[t].bridged, br[t].native, br[t].prefill_s, br[t].transfer_s, br[t].reply_s, nat[t].reply_s,
               eq ? "yes" : "NO", br[t].verdict);
    }
    return same;
}

/* --svg: each turn's time to first token (reply time less decoding) by its prompt length. */
static int demo_chart(const char *path, const turn_result *br, const turn_result *nat, int turns, const char *model,
                      bool cuda) {
    double x[6], yb[6], yn[6];
    for (int t = 0; t < turns; t++) {
        x[t] = br[t].prompt;
        yb[t] = br[t].reply_s - br[t].decode_s;
        yn[t] = nat[t].reply_s - nat[t].decode_s;
    }
    char note[1536];
    snprintf(note, sizeof note, "%s; %d turns of one conversation (each prompt holds the turns before it); prefill "
             "node on the %s", model, turns, cuda ? "GPU" : "CPU");
    const kvb_svg_series series[] = {{"decoder alone", yn}, {"bridged", yb}};
    const kvb_svg_chart c = {.title = "kvbridge demo: time to first token by prompt length", .note = note,
                             .x_label = "prompt tokens of the turn", .y_label = "time to first token",
                             .x = x, .n = (size_t)turns, .series = series, .n_series = 2};
    kvb_err err = {0};
    if (kvb_svg_chart_write(&c, path, &err)) {
        fprintf(stderr, "kvbridge demo: %s\n", err.msg);
        return -1;
    }
    printf("demo: chart written to %s\n", path);
    return 0;
}

/* The three nodes of the demo: the prefill node, the decode node it feeds, the native baseline. */
typedef struct {
    kvb_prefill_node *pn;
    kvb_decode_node *dn, *native;
    char peer[32];
    uint32_t block_tokens;
} demo_nodes;

/* Starts the nodes on loopback, authenticated by a fresh random key; on failure the caller still
 * stops those started. */
static kvb_status demo_start(demo_nodes *n, const demo_args *a, const char *model, bool cuda, kvb_err *err) {
    /* a fresh random key per demo: the nodes authenticate each other with it */
    kvb_rng rng;
    kvb_rng_seed(&rng, (uint64_t)(kvb_now_s() * 1e9));
    char psk[40];
    snprintf(psk, sizeof psk, "%016llx%016llx", (unsigned long long)kvb_rng_u64(&rng),
             (unsigned long long)kvb_rng_u64(&rng));
    kvb_prefill_config pc = {.listen = "127.0.0.1:0", .model_path = model, .psk = psk, .n_threads = (int)a->threads,
                             .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 8192, .cuda = cuda,
                             .gpus = (int)a->gpus, .tp_one_device = a->tp_one_device, .warmup_tokens = 8192 + 64};
    kvb_status st = kvb_prefill_node_start(&pc, &n->pn, err);
    if (st) return st;
    snprintf(n->peer, sizeof n->peer, "127.0.0.1:%u", kvb_prefill_node_port(n->pn));
    kvb_decode_config dc = {.http_listen = "127.0.0.1:0", .peer = n->peer, .model_path = model, .psk = psk,
                            .n_threads = (int)a->threads, .cache_dtype = KVB_TYPE_F16, .block_tokens = 32,
                            .max_ctx = 8192, .bridge_min_tokens = 32 /* any whole block: short turns bridge too */};
    n->block_tokens = dc.block_tokens;
    if ((st = kvb_decode_node_start(&dc, &n->dn, err))) return st;
    kvb_decode_config nc = dc;
    nc.peer = NULL;
    return kvb_decode_node_start(&nc, &n->native, err);
}

int kvb_cmd_demo(int argc, char **argv) {
    demo_args a = {.model = "models/tiny-q8_0.gguf"};
    int prc = demo_parse(&a, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    const char *model = a.model, *device = k_demo_devices[a.device];
    const int turns = (int)a.turns;
    kvb_err err = {0};
    char gemma3[1024];
    if (demo_model_path(&model, gemma3, sizeof gemma3)) return 1;
    bool base = false;
    char name[128] = "";
    if (demo_model_info(model, &base, name, sizeof name)) return 1;
    const bool show = base || strcmp(model, "models/tiny-q8_0.gguf") != 0; /* the tiny model's replies are noise */
    demo_nodes n = {0};
    turn_result br[6] = {0}, nat[6] = {0};
    int rc = 1;
    bool cuda = !strcmp(device, "cuda");
    char why[256] = "";
    if (!strcmp(device, "auto")) cuda = kvb_prefill_device_available(KVB_DEVICE_CUDA, why, sizeof why);
    if (demo_start(&n, &a, model, cuda, &err)) goto fail;
    printf("demo: prefill node (%s engine) on %s; decode node (OpenAI API) on 127.0.0.1:%u; native-only decode node on "
           "127.0.0.1:%u\n",
           cuda ? "CUDA" : "CPU", n.peer, kvb_decode_node_port(n.dn), kvb_decode_node_port(n.native));
    if (base)
        printf("demo: %s (general.name \"%s\") has no chat template: a base (pretrained) model, not instruction-tuned,\n"
               "      which only echoes chat markup. The conversation is an interview transcript it continues through\n"
               "      /v1/completions (one example exchange, greedy, each reply up to the end of its line, at most 40\n"
               "      tokens); each turn's prompt is the previous one plus the reply and the next question.\n",
               model, name);
    printf("demo: a %lld-turn conversation (greedy, %d tokens per reply at most), bridged and natively...\n\n", a.turns,
           base ? 40 : 24);
    fflush(stdout);
    if (base ? interview(kvb_decode_node_port(n.dn), turns, br) || interview(kvb_decode_node_port(n.native), turns, nat)
             : converse(kvb_decode_node_port(n.dn), turns, br) || converse(kvb_decode_node_port(n.native), turns, nat))
        goto done;
    int same = demo_table(br, nat, turns, base, show);
    int complete = 0;
    for (int t = 0; t < turns; t++) complete += !strcmp(br[t].verdict, "complete");
    explain(br, same, complete, turns, cuda, n.block_tokens, kvb_prefill_node_peak_capture_bytes(n.pn));
    rc = (cuda ? complete == turns : same == turns) ? 0 : 1;
    if (a.svg && demo_chart(a.svg, br, nat, turns, model, cuda)) rc = 1;
    goto done;
fail:
    fprintf(stderr, "kvbridge demo: %s\n", err.msg);
done:
    for (int t = 0; t < 6; t++) {
        free(br[t].content);
        free(nat[t].content);
    }
    kvb_decode_node_stop(n.native);
    kvb_decode_node_stop(n.dn);
    kvb_prefill_node_stop(n.pn);
    return rc;
}
