/* cli/cmd_bench_fleet.c — `kvbridge bench fleet`: a whole fleet of real processes of this binary
 * (P prefill nodes, D decode nodes each with every prefill node as a peer, one router in front of
 * the decode nodes; a generated model and a PSK shared by all, ephemeral ports read back from each
 * node's first line), and one native decode node in this process as the reference. C conversations
 * of T turns go through the router from K client threads (turn t's messages: the conversation so
 * far and a new user message of a few blocks; greedy, streamed, so the time to the first token is
 * the client's own). Every reply is then asked of the native node and compared byte for byte.
 * --kill SIGKILLs a prefill and/or a decode node after so many answered requests; a stream cut by
 * a dead decode node is sent again by its client (counted), as an OpenAI client would. --netns puts
 * every node in its own network namespace, each joined to a bridge by a veth pair shaped to
 * 10 Gbit/s (tc tbf, as tests/netns_loop.sh). The table (fleet_print) says what was answered, what
 * equalled native, what was lost or computed twice, the verdicts, where turns were placed on both
 * sides, TTFT, and with kills what each fault cost. Exit 0 only when every reply equals native and
 * none was lost or doubled; tests/bench_fleet_check.sh asserts the printed table. */
#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvb_cli.h"
#include "kvb_model.h"
#include "kvb_node.h"
#include "kvb_quant.h"

extern char **environ;

#define FLEET_MAX_NODES 8
#define FLEET_MAX_CLIENTS 64
#define FLEET_PSK "fleet-bench-key-0123456789abcdef"
#define FLEET_CLIENT_TRIES 4 /* a request cut or refused is sent again by its client up to this often */
#define FLEET_PHASES 3       /* before any kill, after the first, after the second */

typedef struct {
    pid_t pid;
    char name[16];  /* p0, d1, router */
    char host[32];  /* where it listens: 127.0.0.1, or its namespace's address */
    char ns[40];    /* its network namespace, "" on loopback */
    uint16_t port;  /* its API (decode, router) or link (prefill) port */
    char log[300];
    bool killed;
    double served_at_kill; /* a decode node's kvbridge_requests_total just before SIGKILL */
} fleet_proc;

typedef struct {
    int conv, turn;
    char *body;               /* the streamed request (malloc'd) */
    char *content;            /* the fleet's reply text (malloc'd), NULL: none */
    char *native;             /* the native node's (malloc'd) */
    char finish[16], verdict[160], peer[64], pplace[16], backend[64], rplace[16];
    double ttft;              /* seconds from the first send to the first content event */
    int tries, phase;         /* phase: kills seen when it started; tries: client sends */
    bool in_flight_at_kill;   /* a kill came while it was in flight */
} fleet_req;

typedef struct {
    long long P, D, C, T, K, max_tokens, threads, kill_prefill, kill_decode;
    bool netns;
    const char *model;
    char exe[512], dir[256], model_buf[300];
    fleet_proc prefill[FLEET_MAX_NODES], decode[FLEET_MAX_NODES], router;
    kvb_decode_node *native;
    fleet_req *reqs;          /* (C, T) */
    pthread_mutex_t mu;       /* kills, phases */
    atomic_int answered;
    int phase;
    const char *phase_name[FLEET_PHASES];
    double router_retries, router_cut;
} fleet;

/* ---- processes ------------------------------------------------------------------------------- */

/* Runs argv (argv[0] a path or a name on PATH) with stdout and stderr into log (NULL: /dev/null);
 * its pid, or -1. */
static pid_t spawn_logged(char *const *argv, const char *log) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log ? log : "/dev/null", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = -1;
    if (posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ) != 0) pid = -1;
    posix_spawn_file_actions_destroy(&fa);
    return pid;
}

/* A shell command line (the namespace plumbing); 0 when it exited 0. */
static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
    char cmd[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char *const argv[] = {"/bin/sh", "-c", cmd, NULL};
    const pid_t pid = spawn_logged(argv, NULL);
    int ws = 0;
    if (pid < 0 || waitpid(pid, &ws, 0) != pid) return -1;
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

/* Starts `kvbridge serve ARGS...` as p (in its namespace, if any) and reads its port back from its
 * first line ("... port N ..."); false, said, when it does not come within 60 s. */
static bool proc_start(fleet *f, fleet_proc *p, const char *const *args) {
    char *argv[48];
    int n = 0;
    if (p->ns[0]) {
        argv[n++] = "ip", argv[n++] = "netns", argv[n++] = "exec", argv[n++] = p->ns;
    }
    argv[n++] = f->exe, argv[n++] = "serve";
    for (int i = 0; args[i] && n < 47; i++) argv[n++] = (char *)args[i];
    argv[n] = NULL;
    snprintf(p->log, sizeof p->log, "%s/%s.log", f->dir, p->name);
    p->pid = spawn_logged(argv, p->log);
    if (p->pid < 0) {
        fprintf(stderr, "kvbridge bench fleet: cannot start %s: %s\n", p->name, strerror(errno));
        return false;
    }
    for (double t0 = kvb_now_s(); kvb_now_s() - t0 < 60; usleep(20000)) {
        char line[1024] = "";
        FILE *fp = fopen(p->log, "r");
        while (fp && fgets(line, sizeof line, fp)) {
            const char *at = strstr(line, " port ");
            unsigned port = 0;
            if (at && sscanf(at, " port %u", &port) == 1 && port > 0 && port < 65536) {
                p->port = (uint16_t)port;
                fclose(fp);
                return true;
            }
        }
        if (fp) fclose(fp);
        int ws;
        if (waitpid(p->pid, &ws, WNOHANG) == p->pid) break;
    }
    fprintf(stderr, "kvbridge bench fleet: %s did not start (its log: %s)\n", p->name, p->log);
    return false;
}

/* The sum of the /metrics samples of the family `name` (every label set), or -1 when /metrics
 * cannot be read. */
static double metric_sum(const fleet_proc *p, const char *name) {
    const char *prefix = name;
    kvb_http_reply r;
    kvb_err err = {0};
    if (kvb_http_get(p->host, p->port, "/metrics", 5000, &r, &err) || r.status != 200) {
        if (!err.code) kvb_http_reply_free(&r);
        return -1;
    }
    double sum = 0;
    const size_t n = strlen(prefix);
    for (const char *line = r.body; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL)
        if (!strncmp(line, prefix, n) && (line[n] == ' ' || line[n] == '{'))
            sum += atof(strchr(line, ' ') ? strchr(line, ' ') + 1 : "0");
    kvb_http_reply_free(&r);
    return sum;
}

/* Waits until every decode node has every peer up and the router answers /health. */
static bool fleet_wait_ready(fleet *f) {
    for (double t0 = kvb_now_s(); kvb_now_s() - t0 < 60; usleep(50000)) {
        bool ready = true;
        for (int d = 0; d < f->D && ready; d++) ready = metric_sum(&f->decode[d], "kvbridge_peer_up") == (double)f->P;
        kvb_http_reply r;
        kvb_err err = {0};
        if (ready && !kvb_http_get(f->router.host, f->router.port, "/health", 2000, &r, &err)) {
            ready = r.status == 200;
            kvb_http_reply_free(&r);
            if (ready) return true;
        }
    }
    fprintf(stderr, "kvbridge bench fleet: the fleet did not come up in 60 s (logs in %s)\n", f->dir);
    return false;
}

/* ---- network namespaces ---------------------------------------------------------------------- */

/* Node i's namespace, its address 10.213.9.(i+1) on a bridge in this namespace (10.213.9.254),
 * joined by a veth pair shaped to 10 Gbit/s both ways. */
static bool netns_add(fleet_proc *p, int i) {
    const int id = (int)getpid() % 100000;
    snprintf(p->ns, sizeof p->ns, "kvbf%d-%d", id, i);
    snprintf(p->host, sizeof p->host, "10.213.9.%d", i + 1);
    char a[32], b[32]; /* under 16 bytes: id < 100000, i < 17 */
    snprintf(a, sizeof a, "kf%da%d", id, i);
    snprintf(b, sizeof b, "kf%db%d", id, i);
    return !sh("ip netns add %s && ip link add %s type veth peer name %s && ip link set %s netns %s && "
               "ip link set %s master kvbf%d && ip link set %s up && ip -n %s addr add %s/24 dev %s && "
               "ip -n %s link set %s up && ip -n %s link set lo up && "
               "tc -n %s qdisc add dev %s root tbf rate 10gbit burst 4mb latency 10ms && "
               "tc qdisc add dev %s root tbf rate 10gbit burst 4mb latency 10ms",
               p->ns, a, b, a, p->ns, b, id, b, p->ns, p->host, a, p->ns, a, p->ns, p->ns, a, b);
}

static void netns_cleanup(void) {
    const int id = (int)getpid() % 100000;
    sh("for n in $(ip netns list | grep -o '^kvbf%d-[0-9]*'); do ip netns del $n; done; ip link del kvbf%d "
       "2>/dev/null; true", id, id);
}

static bool netns_setup(fleet *f) {
    if (geteuid() != 0) {
        fprintf(stderr, "kvbridge bench fleet: --netns needs root (network namespaces, veth, tc)\n");
        return false;
    }
    const int id = (int)getpid() % 100000;
    if (sh("ip link add kvbf%d type bridge && ip addr add 10.213.9.254/24 dev kvbf%d && ip link set kvbf%d up",
           id, id, id)) {
        fprintf(stderr, "kvbridge bench fleet: --netns: cannot make a bridge here (iproute2, root)\n");
        return false;
    }
    int i = 0;
    for (int k = 0; k < f->P; k++)
        if (!netns_add(&f->prefill[k], i++)) goto fail;
    for (int k = 0; k < f->D; k++)
        if (!netns_add(&f->decode[k], i++)) goto fail;
    if (!netns_add(&f->router, i)) goto fail;
    return true;
fail:
    fprintf(stderr, "kvbridge bench fleet: --netns: cannot make the namespaces and shaped veth links\n");
    return false;
}

/* ---- the fleet ------------------------------------------------------------------------------- */

static bool fleet_start(fleet *f) {
    char ctx[16], thr[16], listen[64];
    snprintf(ctx, sizeof ctx, "%d", 4096);
    snprintf(thr, sizeof thr, "%lld", f->threads);
    for (int k = 0; k < f->P; k++) {
        fleet_proc *p = &f->prefill[k];
        snprintf(listen, sizeof listen, "%s:0", p->host);
        const char *args[] = {"--role", "prefill", "--listen", listen, "-m", f->model, "--psk", FLEET_PSK,
                              "--threads", thr, "--ctx", ctx, NULL};
        if (!proc_start(f, p, args)) return false;
    }
    char peers[FLEET_MAX_NODES][64], backends[FLEET_MAX_NODES][64];
    for (int k = 0; k < f->P; k++)
        snprintf(peers[k], sizeof peers[k], "%s=%s:%u", f->prefill[k].name, f->prefill[k].host, f->prefill[k].port);
    for (int k = 0; k < f->D; k++) {
        fleet_proc *p = &f->decode[k];
        snprintf(listen, sizeof listen, "%s:0", p->host);
        /* a name of its own: a prefill node's round robin tells decode nodes apart by name and host */
        const char *args[48] = {"--role", "decode", "--http", listen, "-m", f->model, "--psk", FLEET_PSK,
                                "--threads", thr, "--ctx", ctx, "--name", p->name};
        int n = 14;
        for (int j = 0; j < f->P; j++) args[n++] = "--peer", args[n++] = peers[j];
        args[n] = NULL;
        if (!proc_start(f, p, args)) return false;
        snprintf(backends[k], sizeof backends[k], "%s:%u", p->host, p->port);
    }
    snprintf(listen, sizeof listen, "%s:0", f->router.host);
    const char *args[48] = {"--role", "router", "--http", listen};
    int n = 4;
    for (int k = 0; k < f->D; k++) args[n++] = "--backend", args[n++] = backends[k];
    args[n] = NULL;
    if (!proc_start(f, &f->router, args)) return false;
    kvb_decode_config c = {.http_listen = "127.0.0.1:0", .model_path = f->model, .n_threads = (int)f->threads,
                           .cache_dtype = KVB_TYPE_F16, .block_tokens = 32, .max_ctx = 4096};
    kvb_err err = {0};
    if (kvb_decode_node_start(&c, &f->native, &err)) {
        fprintf(stderr, "kvbridge bench fleet: the native node: %s\n", err.msg);
        return false;
    }
    return fleet_wait_ready(f);
}

static void proc_stop(fleet_proc *p) {
    if (p->pid <= 0) return;
    if (!p->killed) kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = 0;
}

static void fleet_stop(fleet *f) {
    proc_stop(&f->router);
    for (int k = 0; k < f->D; k++) proc_stop(&f->decode[k]);
    for (int k = 0; k < f->P; k++) proc_stop(&f->prefill[k]);
    kvb_decode_node_stop(f->native);
    f->native = NULL;
    if (f->netns) netns_cleanup();
}

/* SIGKILLs p (a decode node's served count read first: what it computed is still counted). */
static void fleet_kill(fleet *f, fleet_proc *p, const char *what) {
    pthread_mutex_lock(&f->mu);
    if (!strncmp(p->name, "d", 1)) p->served_at_kill = metric_sum(p, "kvbridge_requests_total");
    kill(p->pid, SIGKILL);
    p->killed = true;
    f->phase_name[++f->phase] = what;
    pthread_mutex_unlock(&f->mu);
    fprintf(stderr, "bench fleet: SIGKILL %s (pid %d) after %d answered requests\n", p->name, (int)p->pid,
            atomic_load(&f->answered));
}

/* ---- a streamed request ---------------------------------------------------------------------- */

/* A header's value (up to the line's end) into dst, "" when absent. */
static void head_value(const char *head, const char *name, char *dst, size_t cap) {
    dst[0] = 0;
    const size_t nl = strlen(name);
    for (const char *l = strstr(head, "\r\n"); l; l = strstr(l + 2, "\r\n"))
        if (!strncasecmp(l + 2, name, nl) && l[2 + nl] == ':') {
            const char *v = l + 3 + nl;
            while (*v == ' ') v++;
            snprintf(dst, cap, "%.*s", (int)strcspn(v, "\r\n"), v);
            return;
        }
}

/* The SSE events of a whole body into r: the text (deltas joined), finish_reason, the usage's
 * kvbridge verdict, peer and placement. False unless it ended with [DONE] and no error event. */
static bool parse_events(char *body, fleet_req *r) {
    size_t len = 0, cap = 256;
    char *text = malloc(cap);
    bool done = false, bad = !text;
    for (char *ev = strstr(body, "data: "); ev && !bad; ev = strstr(ev, "data: ")) {
        ev += 6;
        char *end = strstr(ev, "\n\n");
        if (end) *end = 0;
        if (!strcmp(ev, "[DONE]")) done = true;
        cJSON *root = done ? NULL : cJSON_Parse(ev);
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0);
        const cJSON *c = cJSON_GetObjectItem(cJSON_GetObjectItem(ch, "delta"), "content");
        const cJSON *fin = cJSON_GetObjectItem(ch, "finish_reason"), *kb = cJSON_GetObjectItem(
                                                                          cJSON_GetObjectItem(root, "usage"), "kvbridge");
        if (!done && (!root || cJSON_GetObjectItem(root, "error"))) bad = true;
        if (cJSON_IsString(c)) {
            const size_t n = strlen(c->valuestring);
            while (len + n + 1 > cap) {
                char *nt = realloc(text, cap *= 2);
                if (!nt) { bad = true; break; }
                text = nt;
            }
            if (!bad) memcpy(text + len, c->valuestring, n), len += n;
        }
        if (cJSON_IsString(fin)) snprintf(r->finish, sizeof r->finish, "%s", fin->valuestring);
        const char *keys[3] = {"verdict", "peer", "placement"};
        char *dst[3] = {r->verdict, r->peer, r->pplace};
        const size_t caps[3] = {sizeof r->verdict, sizeof r->peer, sizeof r->pplace};
        for (int k = 0; k < 3 && kb; k++)
            if (cJSON_IsString(cJSON_GetObjectItem(kb, keys[k])))
                snprintf(dst[k], caps[k], "%s", cJSON_GetObjectItem(kb, keys[k])->valuestring);
        cJSON_Delete(root);
        if (!end) break;
        ev = end + 2;
    }
    if (bad || !done) {
        free(text);
        return false;
    }
    text[len] = 0;
    free(r->content);
    r->content = text;
    return true;
}

/* Sends r's body to the router once, reading the stream as it comes: TTFT (from t_send) when the
 * first content arrives. True when a whole reply came. */
static bool stream_once(const fleet *f, fleet_req *r, double t_send) {
    char port[8], head[512];
    snprintf(port, sizeof port, "%u", f->router.port);
    const int fd = kvb_tcp_dial(f->router.host, port);
    if (fd < 0) return false;
    const size_t bl = strlen(r->body);
    const int hl = snprintf(head, sizeof head, "POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: "
                            "application/json\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n", f->router.host, port, bl);
    bool ok = send(fd, head, (size_t)hl, MSG_NOSIGNAL) == hl && send(fd, r->body, bl, MSG_NOSIGNAL) == (ssize_t)bl;
    size_t len = 0, cap = 1 << 14;
    char *buf = malloc(cap);
    const double deadline = kvb_now_s() + 600;
    double first = 0;
    while (ok && buf) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, 1000) < 0 || kvb_now_s() > deadline) { ok = false; break; }
        if (len + 4096 > cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) { ok = false; break; }
            buf = nb;
        }
        const ssize_t k = (pf.revents & (POLLIN | POLLHUP | POLLERR)) ? recv(fd, buf + len, cap - len - 1, 0) : -2;
        if (k == -2) continue;
        if (k <= 0) break;
        len += (size_t)k;
        buf[len] = 0;
        const char *body = strstr(buf, "\r\n\r\n"), *c = body ? strstr(body, "\"content\":\"") : NULL;
        while (!first && c) { /* the first event with text (the role's own event has "") */
            if (c[11] != '"') first = kvb_now_s();
            c = strstr(c + 11, "\"content\":\"");
        }
    }
    close(fd);
    char *body = ok && buf ? strstr(buf, "\r\n\r\n") : NULL;
    int status = 0;
    if (body && sscanf(buf, "HTTP/1.%*d %d", &status) == 1 && status == 200) {
        *body = 0;
        head_value(buf, "X-KVBridge-Backend", r->backend, sizeof r->backend);
        head_value(buf, "X-KVBridge-Placement", r->rplace, sizeof r->rplace);
        ok = parse_events(body + 4, r);
    } else
        ok = false;
    free(buf);
    if (ok) r->ttft = first ? first - t_send : -1;
    return ok;
}

/* ---- the clients ----------------------------------------------------------------------------- */

static const char *const k_words[] = {"granite", "harbour", "evening", "tide", "lantern", "copper", "orchard",
                                      "river", "signal", "meadow", "ledger", "window", "quiet", "north",
                                      "engine", "paper", "bridge", "winter", "salt", "garden"};

/* A new user message of about `chars` bytes (a few cache blocks: the tokenizer of a generated model
 * is byte-level), the same for the same (conversation, turn) on every run. */
static char *user_message(int conv, int turn, int chars) {
    kvb_rng rng;
    kvb_rng_seed(&rng, 1000003ull * (uint64_t)conv + (uint64_t)turn + 17);
    char *s = malloc((size_t)chars + 32);
    if (!s) return NULL;
    int n = snprintf(s, 32, "c%d t%d:", conv, turn);
    while (n < chars) n += sprintf(s + n, " %s", k_words[kvb_rng_u64(&rng) % KVB_ARRAY_LEN(k_words)]);
    return s;
}

typedef struct {
    fleet *f;
    int client;
} client_arg;

/* The request of turn t: every message so far (cJSON array, kept by the caller) and the new one. */
static char *turn_body(cJSON *msgs, const char *user, long long max_tokens) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "user");
    cJSON_AddStringToObject(m, "content", user);
    cJSON_AddItemToArray(msgs, m);
    cJSON *req = cJSON_CreateObject();
    cJSON_AddStringToObject(req, "model", "m");
    cJSON_AddItemReferenceToObject(req, "messages", msgs);
    cJSON_AddNumberToObject(req, "max_tokens", (double)max_tokens);
    cJSON_AddNumberToObject(req, "temperature", 0);
    cJSON_AddBoolToObject(req, "stream", true);
    cJSON_AddBoolToObject(cJSON_AddObjectToObject(req, "stream_options"), "include_usage", true);
    char *s = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    return s;
}

/* One request through the router, sent again by the client when no whole reply came (a refused
 * connection, a 5xx, a stream cut by a node that died), up to FLEET_CLIENT_TRIES times. Then the
 * kills whose turn it is. */
static void client_request(fleet *f, fleet_req *r) {
    pthread_mutex_lock(&f->mu);
    r->phase = f->phase;
    pthread_mutex_unlock(&f->mu);
    const double t0 = kvb_now_s();
    for (r->tries = 1; r->tries <= FLEET_CLIENT_TRIES; r->tries++) {
        if (stream_once(f, r, t0)) break;
        usleep(200000);
    }
    if (r->tries > FLEET_CLIENT_TRIES) r->tries = FLEET_CLIENT_TRIES;
    pthread_mutex_lock(&f->mu);
    r->in_flight_at_kill = f->phase != r->phase;
    pthread_mutex_unlock(&f->mu);
    const int done = atomic_fetch_add(&f->answered, 1) + 1;
    if (f->kill_prefill && done == f->kill_prefill) fleet_kill(f, &f->prefill[0], "after the prefill node's kill");
    if (f->kill_decode && done == f->kill_decode) fleet_kill(f, &f->decode[0], "after the decode node's kill");
}

/* A client's conversations (c % K == client), turn by turn across them. */
static void *client_main(void *arg) {
    const client_arg *a = arg;
    fleet *f = a->f;
    cJSON *msgs[FLEET_MAX_CLIENTS * 16] = {0};
    int n = 0;
    for (long long c = a->client; c < f->C; c += f->K, n++) {
        msgs[n] = cJSON_CreateArray();
        cJSON *sys = cJSON_CreateObject();
        cJSON_AddStringToObject(sys, "role", "system");
        cJSON_AddStringToObject(sys, "content", "You answer in a few words.");
        cJSON_AddItemToArray(msgs[n], sys);
    }
    for (long long t = 0; t < f->T; t++) {
        n = 0;
        for (long long c = a->client; c < f->C; c += f->K, n++) {
            fleet_req *r = &f->reqs[c * f->T + t];
            char *user = user_message((int)c, (int)t, 100);
            r->conv = (int)c, r->turn = (int)t;
            r->body = user && msgs[n] ? turn_body(msgs[n], user, f->max_tokens) : NULL;
            free(user);
            if (!r->body) continue;
            client_request(f, r);
            cJSON *m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "role", "assistant");
            cJSON_AddStringToObject(m, "content", r->content ? r->content : "");
            cJSON_AddItemToArray(msgs[n], m);
        }
    }
    for (int k = 0; k < n; k++) cJSON_Delete(msgs[k]);
    return NULL;
}

/* The native node's reply text to r's request (the same body, not streamed); NULL on a failure. */
static char *native_reply(fleet *f, const fleet_req *r) {
    cJSON *req = cJSON_Parse(r->body);
    cJSON_DeleteItemFromObject(req, "stream");
    cJSON_DeleteItemFromObject(req, "stream_options");
    char *body = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    kvb_http_reply h;
    kvb_err err = {0};
    char *text = NULL;
    if (body && !kvb_http_post("127.0.0.1", kvb_decode_node_port(f->native), "/v1/chat/completions", body, 600000,
                               &h, &err)) {
        cJSON *root = h.status == 200 ? cJSON_Parse(h.body) : NULL;
        const cJSON *c = cJSON_GetObjectItem(
            cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(root, "choices"), 0), "message"), "content");
        if (cJSON_IsString(c)) text = strdup(c->valuestring);
        cJSON_Delete(root);
        kvb_http_reply_free(&h);
    }
    cJSON_free(body);
    return text;
}

static void *native_main(void *arg) {
    const client_arg *a = arg;
    for (long long i = a->client; i < a->f->C * a->f->T; i += a->f->K)
        if (a->f->reqs[i].body) a->f->reqs[i].native = native_reply(a->f, &a->f->reqs[i]);
    return NULL;
}

/* K threads of fn at once. */
static bool run_clients(fleet *f, void *(*fn)(void *)) {
    pthread_t th[FLEET_MAX_CLIENTS];
    client_arg args[FLEET_MAX_CLIENTS];
    int started = 0;
    for (int k = 0; k < f->K; k++) {
        args[k] = (client_arg){.f = f, .client = k};
        if (pthread_create(&th[k], NULL, fn, &args[k])) break;
        started++;
    }
    for (int k = 0; k < started; k++) pthread_join(th[k], NULL);
    return started == f->K;
}

/* ---- the table ------------------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median and 95th percentile of the TTFTs of answered requests in phase (-1: all); n of them. */
static int ttft_stats(const fleet *f, int phase, double *med, double *p95) {
    const long long N = f->C * f->T;
    double *v = malloc((size_t)N * sizeof *v);
    int n = 0;
    for (long long i = 0; v && i < N; i++)
        if (f->reqs[i].content && f->reqs[i].ttft >= 0 && (phase < 0 || f->reqs[i].phase == phase))
            v[n++] = f->reqs[i].ttft;
    *med = *p95 = 0;
    if (n) {
        qsort(v, (size_t)n, sizeof *v, cmp_double);
        *med = v[n / 2];
        *p95 = v[(int)(0.95 * (n - 1) + 0.5)];
    }
    free(v);
    return n;
}

/* Requests computed by a decode node more often than their replies came from it, summed. */
static long long fleet_doubled(const fleet *f) {
    long long doubled = 0;
    for (int d = 0; d < f->D; d++) {
        const fleet_proc *p = &f->decode[d];
        const double served = p->killed ? p->served_at_kill : metric_sum(p, "kvbridge_requests_total");
        char name[64];
        snprintf(name, sizeof name, "%s:%u", p->host, p->port);
        long long replies = 0;
        for (long long i = 0; i < f->C * f->T; i++) replies += f->reqs[i].content && !strcmp(f->reqs[i].backend, name);
        if (served > (double)replies) doubled += (long long)(served - (double)replies);
    }
    return doubled;
}

static bool starts(const char *s, const char *prefix) { return !strncmp(s, prefix, strlen(prefix)); }

/* The cost of each fault: one line per phase (requests by the kills seen when they started): how
 * many were in flight at a kill, sent again by their client, moved on either side, the prefill
 * side's history share among later bridged turns (recovering after a kill), verdicts, TTFT. */
static void print_phases(const fleet *f) {
    printf("faults      phase                          reqs  in-flight  client-retry  moved(dec)  moved(pre)  history(pre)  partial  declined  TTFT med   p95   extra\n");
    double base = 0, p95;
    for (int ph = 0; ph <= f->phase; ph++) {
        int n = 0, hit = 0, retry = 0, mdec = 0, mpre = 0, hist = 0, later = 0, part = 0, decl = 0;
        for (long long i = 0; i < f->C * f->T; i++) {
            const fleet_req *r = &f->reqs[i];
            if (!r->body || r->phase != ph) continue;
            n++, hit += r->in_flight_at_kill, retry += r->tries > 1;
            mdec += !strcmp(r->rplace, "moved"), mpre += !strcmp(r->pplace, "moved");
            hist += r->turn > 0 && !strcmp(r->pplace, "history"), later += r->turn > 0 && r->pplace[0];
            part += starts(r->verdict, "partial"), decl += starts(r->verdict, "declined");
        }
        double med;
        ttft_stats(f, ph, &med, &p95);
        if (!ph) base = med;
        printf("            %-30s %5d  %9d  %12d  %10d  %10d  %11.1f%%  %7d  %8d  %7.3f s %5.3f %+6.3f s\n",
               ph ? f->phase_name[ph] : "before any kill", n, hit, retry, mdec, mpre, later ? 100.0 * hist / later : 0,
               part, decl, med, p95, med - base);
    }
}

/* The table; returns true when every reply equals native and none was lost or doubled. */
static bool fleet_print(const fleet *f, double wall) {
    const long long N = f->C * f->T;
    long long answered = 0, equal = 0, bytes = 0, verd[4] = {0}, dec[3] = {0}, pre[3] = {0}, later = 0, bridged_later = 0;
    const char *places[3] = {"history", "new", "moved"};
    for (long long i = 0; i < N; i++) {
        const fleet_req *r = &f->reqs[i];
        if (!r->content) continue;
        answered++;
        equal += r->native && !strcmp(r->content, r->native);
        bytes += (long long)strlen(r->content);
        verd[starts(r->verdict, "complete") ? 0 : starts(r->verdict, "partial") ? 1 : starts(r->verdict, "declined") ? 2 : 3]++;
        for (int k = 0; k < 3; k++) {
            dec[k] += r->turn > 0 && !strcmp(r->rplace, places[k]);
            pre[k] += r->turn > 0 && !strcmp(r->pplace, places[k]);
        }
        later += r->turn > 0;
        bridged_later += r->turn > 0 && r->pplace[0];
    }
    const long long doubled = fleet_doubled(f);
    double med, p95;
    ttft_stats(f, -1, &med, &p95);
    printf("fleet       %lld prefill x %lld decode nodes, a router (%s); %lld client threads, %.1f s\n", f->P, f->D,
           f->netns ? "each node in its own network namespace, veth shaped to 10 Gbit/s" : "loopback", f->K, wall);
    printf("requests    %lld (%lld conversations x %lld turns)\n", N, f->C, f->T);
    printf("equal       %lld of %lld replies equal to the native reference, byte for byte (%lld bytes of text)\n",
           equal, N, bytes);
    printf("lost        %lld (no whole reply after %d client tries)\n", N - answered, FLEET_CLIENT_TRIES);
    printf("doubled     %lld (decode nodes' kvbridge_requests_total above the replies each gave)\n", doubled);
    printf("verdicts    complete %lld, partial %lld, declined %lld, other %lld\n", verd[0], verd[1], verd[2], verd[3]);
    printf("decode side %lld of %lld later turns on the decode node of their history (%.1f %%); new %lld, moved %lld (router)\n",
           dec[0], later, later ? 100.0 * dec[0] / later : 0, dec[1], dec[2]);
    printf("prefill side %lld of %lld later bridged turns on the prefill node of their history (%.1f %%); new %lld, moved %lld\n",
           pre[0], bridged_later, bridged_later ? 100.0 * pre[0] / bridged_later : 0, pre[1], pre[2]);
    printf("ttft        median %.3f s, p95 %.3f s (client side, streamed, through the router)\n", med, p95);
    printf("router      retries %.0f (before any byte), replies cut %.0f\n", f->router_retries, f->router_cut);
    if (f->phase) print_phases(f);
    const bool ok = equal == N && answered == N && doubled == 0;
    printf("result      %s\n", ok ? "PASS: every request answered, equal to native, none doubled" : "FAIL");
    return ok;
}

/* ---- the command ----------------------------------------------------------------------------- */

/* --kill prefill:N,decode:M (either or both) into a long long[2]. */
static kvb_status parse_kill(const char *val, void *dst, kvb_err *err) {
    long long *k = dst;
    k[0] = k[1] = 0;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", val);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        const int which = starts(tok, "prefill:") ? 0 : starts(tok, "decode:") ? 1 : -1;
        char *end = NULL;
        const long long n = which < 0 ? 0 : strtoll(strchr(tok, ':') + 1, &end, 10);
        if (which < 0 || !end || *end || n < 1 || n > 1000000)
            return kvb_err_set(err, KVB_ERR_RANGE, "expects prefill:N,decode:M (N, M >= 1 answered requests), got '%s'", val);
        k[which] = n;
    }
    return KVB_OK;
}

/* Names, hosts and (with --netns) namespaces of every node. */
static bool fleet_layout(fleet *f) {
    for (int k = 0; k < f->P; k++) snprintf(f->prefill[k].name, sizeof f->prefill[k].name, "p%d", k);
    for (int k = 0; k < f->D; k++) snprintf(f->decode[k].name, sizeof f->decode[k].name, "d%d", k);
    snprintf(f->router.name, sizeof f->router.name, "router");
    fleet_proc *all[2 * FLEET_MAX_NODES + 1];
    int n = 0;
    for (int k = 0; k < f->P; k++) all[n++] = &f->prefill[k];
    for (int k = 0; k < f->D; k++) all[n++] = &f->decode[k];
    all[n++] = &f->router;
    for (int i = 0; i < n; i++) snprintf(all[i]->host, sizeof all[i]->host, "127.0.0.1");
    return !f->netns || netns_setup(f);
}

/* The whole run once the options are read: 0 pass, 1 fail. */
static int fleet_run(fleet *f) {
    char tmpl[] = "/tmp/kvbfleet.XXXXXX";
    if (!mkdtemp(tmpl)) return 1;
    snprintf(f->dir, sizeof f->dir, "%s", tmpl);
    const ssize_t el = readlink("/proc/self/exe", f->exe, sizeof f->exe - 1);
    if (el <= 0) return 1;
    f->exe[el] = 0;
    if (!f->model) {
        snprintf(f->model_buf, sizeof f->model_buf, "%s/tiny.gguf", f->dir);
        kvb_gen_opts o = {.preset = "tiny", .type = KVB_TYPE_Q8_0, .seed = 37, .n_threads = 2};
        kvb_err err = {0};
        if (kvb_gen_model(&o, f->model_buf, &err)) {
            fprintf(stderr, "kvbridge bench fleet: %s\n", err.msg);
            return 1;
        }
        f->model = f->model_buf;
    }
    f->reqs = calloc((size_t)(f->C * f->T), sizeof *f->reqs);
    pthread_mutex_init(&f->mu, NULL);
    int rc = 1;
    if (!f->reqs || !fleet_layout(f) || !fleet_start(f)) goto done;
    fprintf(stderr, "bench fleet: up (logs in %s); %lld conversations x %lld turns from %lld clients\n", f->dir, f->C,
            f->T, f->K);
    const double t0 = kvb_now_s();
    if (!run_clients(f, client_main)) goto done;
    const double wall = kvb_now_s() - t0;
    f->router_retries = metric_sum(&f->router, "kvbridge_router_retries_total");
    f->router_cut = metric_sum(&f->router, "kvbridge_router_replies_cut_total");
    fprintf(stderr, "bench fleet: %d answered in %.1f s; asking the native node\n", atomic_load(&f->answered), wall);
    if (!run_clients(f, native_main)) goto done;
    printf("command     kvbridge bench fleet --prefill %lld --decode %lld --conversations %lld --turns %lld "
           "--clients %lld%s", f->P, f->D, f->C, f->T, f->K, f->netns ? " --netns" : "");
    if (f->kill_prefill || f->kill_decode) printf(" --kill prefill:%lld,decode:%lld", f->kill_prefill, f->kill_decode);
    printf("\n");
    rc = fleet_print(f, wall) ? 0 : 1;
done:
    fleet_stop(f);
    if (rc) fprintf(stderr, "kvbridge bench fleet: the nodes' logs are in %s\n", f->dir);
    else sh("rm -rf '%s'", f->dir);
    for (long long i = 0; f->reqs && i < f->C * f->T; i++) {
        free(f->reqs[i].body);
        free(f->reqs[i].content);
        free(f->reqs[i].native);
    }
    free(f->reqs);
    pthread_mutex_destroy(&f->mu);
    return rc;
}

int kvb_bench_fleet(int argc, char **argv) {
    fleet f = {.phase_name = {"before any kill"}};
    long long kills[2] = {0, 0};
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&f.model, "the GGUF every node loads (default: a generated tiny model)", false),
        KVB_CLI_INT("prefill", &f.P, "P", 1, FLEET_MAX_NODES, "2", "prefill nodes"),
        KVB_CLI_INT("decode", &f.D, "D", 1, FLEET_MAX_NODES, "3", "decode nodes, each with every prefill node as a peer"),
        KVB_CLI_INT("conversations", &f.C, "C", 1, 1024, "32", "conversations"),
        KVB_CLI_INT("turns", &f.T, "T", 1, 64, "6", "turns of each (a new user message of ~100 bytes each)"),
        KVB_CLI_INT("clients", &f.K, "K", 1, FLEET_MAX_CLIENTS, "8", "concurrent client threads"),
        KVB_CLI_INT("max-tokens", &f.max_tokens, "N", 1, 256, "8", "max_tokens of each reply, greedy"),
        KVB_CLI_INT("threads", &f.threads, "T", 1, 64, "1", "CPU threads of each node"),
        {.long_name = "kill", .kind = KVB_OPT_CUSTOM, .dst = kills, .meta = "prefill:N,decode:M", .parse = parse_kill,
         .help = "SIGKILL prefill node p0 after N answered requests and decode node d0 after M (either or both); "
                 "the table then says what each fault cost"},
        KVB_CLI_FLAG("netns", &f.netns, "every node in its own network namespace, joined by veth links shaped to "
                                        "10 Gbit/s (tc tbf); needs root"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "bench fleet", .opts = opts,
        .usage = "[-m MODEL] [--prefill P] [--decode D] [--conversations C] [--turns T] [--clients K] "
                 "[--kill prefill:N,decode:M] [--netns]",
        .about = "Starts a fleet of processes of this binary (P prefill nodes, D decode nodes with every prefill node "
                 "as a peer, a router in front of the decode nodes) and a native decode node as the reference, "
                 "sends C conversations of T turns from K clients through the router (streamed, greedy), asks the "
                 "native node the same requests, and prints: replies equal to native (byte for byte), lost, "
                 "doubled, verdicts, placement on the decode side (the router) and the prefill side (the decode "
                 "nodes), TTFT, and with --kill what each fault cost. Exits 0 only when every reply equals native "
                 "and none was lost or doubled."};
    const int prc = kvb_cli_parse(&spec, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    f.kill_prefill = kills[0], f.kill_decode = kills[1];
    if (f.netns && geteuid() != 0) {
        fprintf(stderr, "kvbridge bench fleet: --netns needs root (network namespaces, veth links, tc); run it as root "
                        "or without --netns\n");
        return 2;
    }
    if (f.kill_decode && f.D < 2) return kvb_cli_usage_error(&spec, "--kill decode:M needs --decode 2 or more");
    if (f.kill_prefill && f.P < 2) return kvb_cli_usage_error(&spec, "--kill prefill:N needs --prefill 2 or more");
    signal(SIGPIPE, SIG_IGN);
    return fleet_run(&f);
}
