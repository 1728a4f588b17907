/* cli/args.c — strict parsing of numeric option values, with messages that say what to do. */
#include "kvb_cli.h"

#include <errno.h>

#include "kvb_quant.h"
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool kvb_arg_is_help(const char *a) { return strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0; }

const char *kvb_arg_value(const char *cmd, int argc, char **argv, int *i) {
    if (*i + 1 >= argc) {
        fprintf(stderr, "kvbridge %s: %s needs a value (see kvbridge %s --help)\n", cmd, argv[*i], cmd);
        return NULL;
    }
    (*i)++;
    return argv[*i];
}

bool kvb_arg_int(const char *cmd, const char *opt, const char *val, long long lo, long long hi,
                 long long *out) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(val, &end, 10);
    if (errno || !end || *end || end == val || v < lo || v > hi) {
        fprintf(stderr, "kvbridge %s: %s expects a whole number from %lld to %lld, got '%s'\n", cmd, opt, lo,
                hi, val);
        return false;
    }
    *out = v;
    return true;
}

bool kvb_arg_u64(const char *cmd, const char *opt, const char *val, uint64_t *out) {
    char *end = NULL;
    errno = 0;
    if (val[0] == '-') goto bad;
    unsigned long long v = strtoull(val, &end, 0);
    if (errno || !end || *end || end == val) goto bad;
    *out = v;
    return true;
bad:
    fprintf(stderr, "kvbridge %s: %s expects a non-negative whole number, got '%s'\n", cmd, opt, val);
    return false;
}

bool kvb_arg_float(const char *cmd, const char *opt, const char *val, double lo, double hi, double *out) {
    char *end = NULL;
    errno = 0;
    double v = strtod(val, &end);
    if (errno || !end || *end || end == val || !(v >= lo && v <= hi)) {
        fprintf(stderr, "kvbridge %s: %s expects a number from %g to %g, got '%s'\n", cmd, opt, lo, hi, val);
        return false;
    }
    *out = v;
    return true;
}

bool kvb_arg_gpus_ok(const char *cmd, long long gpus, bool tp_one_device, bool cuda) {
    if ((gpus > 1 || tp_one_device) && !cuda) {
        fprintf(stderr, "kvbridge %s: --gpus and --tp-one-device split the CUDA engine over GPUs; add --device cuda\n",
                cmd);
        return false;
    }
    if (tp_one_device && gpus < 2) {
        fprintf(stderr, "kvbridge %s: --tp-one-device puts the ranks of --gpus N (N >= 2) on one GPU; give --gpus\n",
                cmd);
        return false;
    }
    return true;
}

bool kvb_arg_gpu_weights_ok(const char *cmd, int gpu_weights, bool cuda) {
    if (gpu_weights && !cuda) {
        fprintf(stderr, "kvbridge %s: --gpu-weights is how the CUDA engine holds the weights; add --device cuda\n",
                cmd);
        return false;
    }
    return true;
}

bool kvb_arg_gpu_weights(const char *cmd, const char *val, int *out) {
    static const char *const names[] = {"auto", "bf16", "packed"}; /* kvb_cuda_weights' order */
    for (int i = 0; i < 3; i++)
        if (!strcmp(val, names[i])) {
            *out = i;
            return true;
        }
    fprintf(stderr, "kvbridge %s: --gpu-weights expects auto, bf16 or packed, got '%s'\n", cmd, val);
    return false;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double kvb_median_sort(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

bool kvb_arg_type(const char *cmd, const char *opt, const char *val, uint32_t *out) {
    kvb_type t;
    kvb_err err = {0};
    if (kvb_type_from_name(val, &t, &err) != KVB_OK) {
        fprintf(stderr, "kvbridge %s: %s: %s\n", cmd, opt, err.msg);
        return false;
    }
    *out = t;
    return true;
}

void kvb_gemma3_path(char *buf, size_t cap) {
    const char *env = getenv("KVB_GEMMA3_GGUF"), *dir = getenv("KVB_CACHE_DIR"), *home = getenv("HOME");
    if (env && *env) snprintf(buf, cap, "%s", env);
    else if (dir && *dir) snprintf(buf, cap, "%s/gemma-3-270m-q4_k_m.gguf", dir);
    else snprintf(buf, cap, "%s/.cache/kvbridge/gemma-3-270m-q4_k_m.gguf", home ? home : "");
}

char *kvb_cli_read_all(FILE *f, size_t *n) {
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    if (!buf) return NULL;
    for (;;) {
        if (len == cap) {
            char *nb = cap < ((size_t)1 << 40) ? realloc(buf, cap * 2) : NULL;
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + len, 1, cap - len, f);
        len += r;
        if (r == 0) break;
    }
    if (ferror(f)) {
        free(buf);
        return NULL;
    }
    *n = len;
    return buf;
}
