/* tests/support/kvbt.c — the shared test helpers declared in kvbt.h (paths, the temp directory,
 * running commands, a GPU check); the ctest reporting is in kvbt_run.c. */
#include "kvbt.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char g_tmp[256];

static void cleanup_tmp(void) {
    if (!g_tmp[0]) return;
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", g_tmp);
}

const char *kvbt_tmpdir(void) {
    if (!g_tmp[0]) {
        const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
        snprintf(g_tmp, sizeof g_tmp, "%s/kvbt-XXXXXX", base);
        if (!mkdtemp(g_tmp)) {
            perror("mkdtemp");
            abort();
        }
        atexit(cleanup_tmp);
    }
    return g_tmp;
}

void kvbt_tmp_path(char *buf, size_t cap, const char *name) { snprintf(buf, cap, "%s/%s", kvbt_tmpdir(), name); }

int kvbt_sh(const char *cmdline, char *out, size_t cap, int merge_stderr) {
    char full[8192];
    snprintf(full, sizeof full, "%s%s", cmdline, merge_stderr ? " 2>&1" : "");
    FILE *p = popen(full, "r");
    if (!p) return -1;
    size_t n = 0;
    if (out && cap) {
        size_t k;
        while (n + 1 < cap && (k = fread(out + n, 1, cap - 1 - n, p)) > 0) n += k;
        out[n] = 0;
    }
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0) {
    }
    int st = pclose(p);
    if (st == -1 || !WIFEXITED(st)) return -1;
    return WEXITSTATUS(st);
}

const char *kvbt_bin(void) { return getenv("KVB_BIN") ? getenv("KVB_BIN") : "kvbridge"; }

void *kvbt_read_file(const char *path, size_t *n) {
    *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    void *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        const long bytes = ftell(f);
        buf = bytes > 0 && fseek(f, 0, SEEK_SET) == 0 ? malloc((size_t)bytes) : NULL;
        if (buf && fread(buf, 1, (size_t)bytes, f) == (size_t)bytes) *n = (size_t)bytes;
        else free(buf), buf = NULL;
    }
    fclose(f);
    return buf;
}

/* The cache the fetch scripts fill (tools/fetch_common.sh): ${KVB_CACHE_DIR:-$HOME/.cache/kvbridge}. */
static void cache_path(char *buf, size_t cap, const char *name) {
    const char *cache = getenv("KVB_CACHE_DIR"), *home = getenv("HOME");
    if (cache && *cache) snprintf(buf, cap, "%s/%s", cache, name);
    else snprintf(buf, cap, "%s/.cache/kvbridge/%s", home ? home : "", name);
}

/* Where the test vocabularies are looked for, whether or not the directory exists. */
static const char *vocab_dir_path(void) {
    static char dir[1024];
    const char *vocab = getenv("KVB_VOCAB_DIR"), *shared = getenv("KVB_SHARED_DIR");
    if (vocab && *vocab) snprintf(dir, sizeof dir, "%s", vocab);
    else if (shared && *shared) snprintf(dir, sizeof dir, "%s/vocab", shared);
    else cache_path(dir, sizeof dir, "vocab");
    return dir;
}

const char *kvbt_vocab_file(const char *name, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/%s", vocab_dir_path(), name);
    struct stat st;
    return stat(buf, &st) == 0 && S_ISREG(st.st_mode) ? buf : NULL;
}

const char *kvbt_require_vocab(const char *name, char *buf, size_t cap) {
    if (kvbt_vocab_file(name, buf, cap)) return buf;
    kvbt_skip("no vocabulary: %s is not in %s (tools/fetch_vocab.sh fetches the test vocabularies there; "
              "KVB_VOCAB_DIR names another directory)",
              name, vocab_dir_path());
}

const char *kvbt_gemma3_path(void) {
    static char path[1024];
    const char *env = getenv("KVB_GEMMA3_GGUF");
    if (env && *env) snprintf(path, sizeof path, "%s", env);
    else cache_path(path, sizeof path, "gemma-3-270m-q4_k_m.gguf");
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) ? path : NULL;
}

double kvbt_rel_l2(const float *a, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

#include "kvb_core.h"
#include "kvb_model.h"
#include "kvb_node.h"

struct kvb_model *kvbt_gen_load(const char *name, const char *preset, uint32_t type, uint64_t seed) {
    char path[512];
    kvbt_tmp_path(path, sizeof path, name);
    kvb_gen_opts o = {.preset = preset, .type = type, .seed = seed, .n_threads = 2};
    kvb_err err = {0};
    kvb_model *m = NULL;
    if (kvb_gen_model(&o, path, &err) || kvb_model_load(path, &m, &err)) {
        fprintf(stderr, "%s: %s\n", name, err.msg);
        return NULL;
    }
    return m;
}

const char *kvbt_require_llama_server(char *buf, size_t cap) {
    const char *env = getenv("KVB_LLAMA_SERVER"), *src = getenv("KVB_SOURCE_DIR");
    if (env && *env) snprintf(buf, cap, "%s", env);
    else snprintf(buf, cap, "%s/build-peer/llama-server-bin/llama-server", src ? src : ".");
    if (access(buf, X_OK) != 0)
        kvbt_skip("no llama-server at %s (tools/peer/build_llama_server.sh build-peer/llama-server-bin, or set "
                  "KVB_LLAMA_SERVER)", buf);
    return buf;
}

const char *kvbt_require_gemma3(void) {
    const char *path = kvbt_gemma3_path();
    if (!path) kvbt_skip("no Gemma 3 270M file (KVB_GEMMA3_GGUF; tools/fetch_gemma3.sh fetches it into the cache)");
    return path;
}

int kvbt_llama_server_start(const char *bin, const char *model, const char *slots, int port, int n_slots,
                            const char *fa, const char *extra) {
    char port_s[16], np[16], log[512];
    snprintf(port_s, sizeof port_s, "%d", port);
    snprintf(np, sizeof np, "%d", n_slots);
    kvbt_tmp_path(log, sizeof log, "llama-server.log");
    const pid_t pid = fork();
    if (pid == 0) {
        FILE *f = freopen(log, "a", stderr);
        (void)f;
        dup2(2, 1);
        execl(bin, bin, "-m", model, "--host", "127.0.0.1", "--port", port_s, "-np", np, "-c", "2048", "-t", "2",
              "--slot-save-path", slots, "-fa", fa, "--cache-ram", "0", "--no-webui", "--no-warmup", extra, (char *)NULL);
        _exit(127);
    }
    assert_true(pid > 0);
    for (int i = 0; i < 600; i++) {
        kvb_http_reply r = {0};
        kvb_err err = {0};
        const bool up = !kvb_http_post("127.0.0.1", (uint16_t)port, "/tokenize", "{\"content\":\"a\"}", 2000, &r, &err) &&
                        r.status == 200;
        kvb_http_reply_free(&r);
        if (up) return pid;
        if (waitpid(pid, NULL, WNOHANG) == pid) fail_msg("llama-server exited; its log: %s", log);
        usleep(100000);
    }
    kill(pid, SIGTERM);
    fail_msg("llama-server did not come up in 60 s; its log: %s", log);
    return -1;
}

void kvbt_random_tokens(int32_t *tokens, uint32_t n, uint32_t n_vocab, uint64_t seed) {
    kvb_rng r;
    kvb_rng_seed(&r, seed);
    for (uint32_t i = 0; i < n; i++) tokens[i] = (int32_t)(kvb_rng_u64(&r) % n_vocab);
}

#ifdef KVB_HAVE_CUDA
#include "kvb_engine_cuda.h"
#endif

void kvbt_require_gpu(void) {
#ifdef KVB_HAVE_CUDA
    char why[256];
    if (kvb_cuda_device_available(why, sizeof why)) return;
    kvbt_skip("no GPU: %s", why);
#else
    kvbt_skip("no GPU: this build has no CUDA engine (KVB_CUDA=OFF)");
#endif
}
