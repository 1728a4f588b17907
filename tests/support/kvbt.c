/* tests/support/kvbt.c — see kvbt.h. */
#include "kvbt.h"

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

const char *kvbt_shared_dir(void) {
    const char *d = getenv("KVB_SHARED_DIR");
    struct stat st;
    if (!d || stat(d, &st) != 0 || !S_ISDIR(st.st_mode)) return NULL;
    return d;
}

const char *kvbt_gemma3_path(void) {
    static char path[1024];
    const char *env = getenv("KVB_GEMMA3_GGUF"), *home = getenv("HOME");
    if (env && *env) snprintf(path, sizeof path, "%s", env);
    else snprintf(path, sizeof path, "%s/.cache/kvbridge/gemma-3-270m-q4_k_m.gguf", home ? home : "");
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) ? path : NULL;
}
