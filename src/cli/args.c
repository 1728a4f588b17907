/* cli/args.c — the option parser every subcommand uses: a command's table of options (kvb_opt)
 * is parsed strictly (unknown options, missing values, numbers out of range or with trailing junk
 * are refused with a message that names the option and what to do) and its --help is generated
 * from the same table; plus the small shared helpers (type names, GPU options, reading a stream). */
#include "kvb_cli.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>

#include "kvb_quant.h"
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const kvb_cli_device_names[] = {"cpu", "cuda", NULL};
const char *const kvb_cli_bridge_mode_names[] = {"decoder", "prefill", NULL}; /* index 1: prefill mode */
const char *const kvb_cli_kv_arith_names[] = {"engine", "ggml", NULL};      /* index 1: ggml's arithmetic */
const char *const kvb_cli_transport_names[] = {"tcp", "ucx", NULL};          /* index 1: UCX */
const char *const kvb_cli_gpu_weights_names[] = {"auto", "bf16", "packed", NULL}; /* kvb_cuda_weights' order */

static bool opt_is_end(const kvb_opt *o) { return !o->long_name && !o->short_name; }

static bool opt_takes_value(const kvb_opt *o) { return o->kind != KVB_OPT_FLAG; }

/* "--name" or "-x", as messages name the option. */
static const char *opt_label(const kvb_opt *o, char *buf, size_t cap) {
    if (o->long_name) snprintf(buf, cap, "--%s", o->long_name);
    else snprintf(buf, cap, "-%c", o->short_name);
    return buf;
}

/* The choices of an enum as "a, b or c" (into buf). */
static void enum_choices_text(const kvb_opt *o, char *buf, size_t cap) {
    size_t len = 0, n = 0;
    buf[0] = 0;
    while (o->choices[n]) n++;
    for (size_t i = 0; i < n && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%s", i == 0 ? "" : i + 1 == n ? " or " : ", ", o->choices[i]);
}

/* The value's name as help and messages show it: .meta, an enum's choices a|b|c, or "" for a flag. */
static const char *opt_meta(const kvb_opt *o, char *buf, size_t cap) {
    buf[0] = 0;
    if (o->kind == KVB_OPT_ENUM && !o->meta) {
        size_t len = 0;
        for (int i = 0; o->choices[i] && len < cap; i++)
            len += (size_t)snprintf(buf + len, cap - len, "%s%s", i ? "|" : "", o->choices[i]);
    } else if (opt_takes_value(o)) snprintf(buf, cap, "%s", o->meta ? o->meta : "VALUE");
    return buf;
}

/* A whole number, decimal or 0x hex, with nothing after it; false on junk or overflow. */
static bool parse_u64_text(const char *val, uint64_t *out, char **end_out) {
    const bool hex = val[0] == '0' && (val[1] == 'x' || val[1] == 'X');
    if (!isdigit((unsigned char)val[0])) return false;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(val, &end, hex ? 16 : 10);
    if (errno || end == val || (hex && end == val + 2)) return false;
    *out = v;
    *end_out = end;
    return true;
}

/* A byte count with an optional binary suffix: 4096, 64K, 1G (x1024^n). */
static bool parse_size_text(const char *val, uint64_t *out) {
    uint64_t v;
    char *end;
    if (!parse_u64_text(val, &v, &end)) return false;
    if (*end) {
        const char *units = "KMGT", *u = strchr(units, toupper((unsigned char)*end));
        if (!u || end[1]) return false;
        for (int shift = (int)(u - units) + 1; shift > 0; shift--) {
            if (v > UINT64_MAX / 1024) return false;
            v *= 1024;
        }
    }
    *out = v;
    return true;
}

/* Converts one value by the option's kind into its destination, or says why not. */
static kvb_status opt_set(const kvb_opt *o, const char *val, kvb_err *err) {
    char name[64];
    opt_label(o, name, sizeof name);
    const uint64_t uhi = o->uhi ? o->uhi : UINT64_MAX;
    switch (o->kind) {
    case KVB_OPT_FLAG: *(bool *)o->dst = true; return KVB_OK;
    case KVB_OPT_STRING: *(const char **)o->dst = val; return KVB_OK;
    case KVB_OPT_INT: {
        char *end = NULL;
        errno = 0;
        long long v = strtoll(val, &end, 10);
        if (errno || end == val || *end || v < o->lo || v > o->hi)
            return kvb_err_set(err, KVB_ERR_RANGE, "%s expects a whole number from %lld to %lld, got '%s'", name,
                               o->lo, o->hi, val);
        *(long long *)o->dst = v;
        return KVB_OK;
    }
    case KVB_OPT_UINT: {
        uint64_t v;
        char *end;
        if (!parse_u64_text(val, &v, &end) || *end || v < o->ulo || v > uhi)
            return kvb_err_set(err, KVB_ERR_RANGE, "%s expects a whole number from %" PRIu64 " to %" PRIu64 ", got '%s'",
                               name, o->ulo, uhi, val);
        *(uint64_t *)o->dst = v;
        return KVB_OK;
    }
    case KVB_OPT_SIZE: {
        uint64_t v;
        if (!parse_size_text(val, &v) || v < o->ulo || v > uhi)
            return kvb_err_set(err, KVB_ERR_RANGE,
                               "%s expects a byte count from %" PRIu64 " to %" PRIu64 " (a number, or with K, M, G "
                               "or T: 64K, 1G), got '%s'",
                               name, o->ulo, uhi, val);
        *(uint64_t *)o->dst = v;
        return KVB_OK;
    }
    case KVB_OPT_DOUBLE: {
        char *end = NULL;
        errno = 0;
        double v = strtod(val, &end);
        if (errno || end == val || *end || !isfinite(v) || v < o->dlo || v > o->dhi)
            return kvb_err_set(err, KVB_ERR_RANGE, "%s expects a number from %g to %g, got '%s'", name, o->dlo,
                               o->dhi, val);
        *(double *)o->dst = v;
        return KVB_OK;
    }
    case KVB_OPT_ENUM: {
        for (int i = 0; o->choices[i]; i++)
            if (!strcmp(val, o->choices[i])) {
                *(int *)o->dst = i;
                return KVB_OK;
            }
        char choices[256];
        enum_choices_text(o, choices, sizeof choices);
        return kvb_err_set(err, KVB_ERR_RANGE, "%s expects %s, got '%s'", name, choices, val);
    }
    case KVB_OPT_LIST: {
        kvb_opt_list *l = o->dst;
        if (l->n >= KVB_OPT_LIST_MAX)
            return kvb_err_set(err, KVB_ERR_RANGE, "%s is given more than %d times", name, KVB_OPT_LIST_MAX);
        l->v[l->n++] = val;
        return KVB_OK;
    }
    case KVB_OPT_CUSTOM: {
        kvb_err why = {0};
        kvb_status st = o->parse(val, o->dst, &why);
        return st ? kvb_err_set(err, st, "%s: %s", name, why.msg) : KVB_OK;
    }
    }
    return kvb_err_set(err, KVB_ERR_INTERNAL, "%s: option kind %d unknown", name, (int)o->kind);
}

/* The table's entry for argv word `a` ("--name", "--name=value" or "-x"); *inline_val is the part
 * after '=' (NULL when none). NULL when no option has that name. */
static const kvb_opt *opt_find(const kvb_opt *opts, const char *a, const char **inline_val) {
    *inline_val = NULL;
    if (a[0] == '-' && a[1] == '-') {
        const char *eq = strchr(a + 2, '=');
        size_t len = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
        for (const kvb_opt *o = opts; !opt_is_end(o); o++)
            if (o->long_name && strlen(o->long_name) == len && !strncmp(o->long_name, a + 2, len)) {
                *inline_val = eq ? eq + 1 : NULL;
                return o;
            }
        return NULL;
    }
    if (a[0] == '-' && a[1] && !a[2])
        for (const kvb_opt *o = opts; !opt_is_end(o); o++)
            if (o->short_name == a[1]) return o;
    return NULL;
}

enum { MAX_OPTS = 128 }; /* entries in one command's table */

/* Applies every default, as if given before the command line. */
static kvb_status opts_apply_defaults(const kvb_cli_spec *spec, kvb_err *err) {
    size_t n = 0;
    for (const kvb_opt *o = spec->opts; !opt_is_end(o); o++, n++)
        if (o->def && o->kind != KVB_OPT_FLAG && o->kind != KVB_OPT_LIST) {
            kvb_status st = opt_set(o, o->def, err);
            if (st) return kvb_err_set(err, KVB_ERR_INTERNAL, "the default of an option is wrong: %s", err->msg);
        }
    if (n > MAX_OPTS) return kvb_err_set(err, KVB_ERR_INTERNAL, "%zu options in one table (at most %d)", n, MAX_OPTS);
    return KVB_OK;
}

/* One word that is not an option: an operand, if the command takes another. */
static kvb_status take_operand(const kvb_cli_spec *spec, const char *a, kvb_err *err) {
    if (*spec->n_operands >= spec->max_operands)
        return kvb_err_set(err, KVB_ERR_INVALID, "unexpected argument '%s'", a);
    spec->operands[(*spec->n_operands)++] = a;
    return KVB_OK;
}

kvb_status kvb_cli_parse_args(const kvb_cli_spec *spec, int argc, char **argv, bool *help_asked, kvb_err *err) {
    bool seen[MAX_OPTS] = {0};
    *help_asked = false;
    if (spec->max_operands > 0) *spec->n_operands = 0;
    kvb_status st = opts_apply_defaults(spec, err);
    bool operands_only = false;
    for (int i = 1; i < argc && !st; i++) {
        const char *a = argv[i], *val = NULL;
        if (operands_only || a[0] != '-' || !a[1]) {
            st = take_operand(spec, a, err);
            continue;
        }
        if (!strcmp(a, "--")) {
            operands_only = true;
            continue;
        }
        if (kvb_arg_is_help(a)) {
            *help_asked = true;
            return KVB_OK;
        }
        const kvb_opt *o = opt_find(spec->opts, a, &val);
        if (!o) return kvb_err_set(err, KVB_ERR_INVALID, "unknown option '%s'", a);
        char name[64], meta[160];
        opt_label(o, name, sizeof name);
        if (!opt_takes_value(o) && val)
            return kvb_err_set(err, KVB_ERR_INVALID, "%s takes no value, got '%s'", name, a);
        if (opt_takes_value(o) && !val) {
            if (i + 1 >= argc)
                return kvb_err_set(err, KVB_ERR_INVALID, "%s needs a value (%s)", name, opt_meta(o, meta, sizeof meta));
            val = argv[++i];
        }
        seen[o - spec->opts] = true;
        st = opt_set(o, val, err);
    }
    if (st) return st;
    for (const kvb_opt *o = spec->opts; !opt_is_end(o); o++)
        if (o->required && !seen[o - spec->opts]) {
            char meta[160];
            opt_meta(o, meta, sizeof meta);
            if (o->short_name && o->long_name) /* as usage lines write it: "-m MODEL (--model) is required" */
                return kvb_err_set(err, KVB_ERR_INVALID, "-%c %s (--%s) is required", o->short_name, meta,
                                   o->long_name);
            char name[64];
            return kvb_err_set(err, KVB_ERR_INVALID, "%s %s is required", opt_label(o, name, sizeof name), meta);
        }
    return KVB_OK;
}

int kvb_cli_parse(const kvb_cli_spec *spec, int argc, char **argv) {
    bool help_asked = false;
    kvb_err err = {0};
    if (kvb_cli_parse_args(spec, argc, argv, &help_asked, &err) != KVB_OK)
        return kvb_cli_usage_error(spec, "%s", err.msg);
    if (help_asked) {
        kvb_cli_help(spec, stdout);
        return 0;
    }
    return KVB_CLI_GO;
}

int kvb_cli_usage_error(const kvb_cli_spec *spec, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "kvbridge %s: %s (see kvbridge %s --help)\n", spec->name, msg, spec->name);
    return 2;
}

enum { HELP_WIDTH = 110, HELP_COLUMN = 23 };

/* Prints text word-wrapped to HELP_WIDTH: the first line continues at column `at` (where the
 * caller left off), the others start at column `indent`; a '\n' in text breaks the line, and the
 * spaces around words are kept where the line does not wrap (aligned lists stay aligned). */
static void help_wrap(FILE *f, const char *text, int at, int indent) {
    int col = at;
    bool line_empty = true; /* no word yet on this line */
    for (const char *p = text; *p;) {
        if (*p == '\n') {
            fprintf(f, "\n%*s", indent, "");
            col = indent;
            line_empty = true;
            p++;
            continue;
        }
        const size_t spaces = strspn(p, " "), word = strcspn(p + spaces, " \n");
        if (word == 0) { /* trailing spaces */
            p += spaces;
            continue;
        }
        if (!line_empty && col + (int)(spaces + word) > HELP_WIDTH) {
            fprintf(f, "\n%*s", indent, "");
            col = indent;
        } else {
            fprintf(f, "%*s", (int)spaces, "");
            col += (int)spaces;
        }
        fwrite(p + spaces, 1, word, f);
        col += (int)word;
        line_empty = false;
        p += spaces + word;
    }
    fputc('\n', f);
}

/* One option's entry: "  -m, --model FILE     what it does (default: X)". */
static void help_option(FILE *f, const kvb_opt *o) {
    char left[192], meta[160], tail[192] = "", text[2048];
    opt_meta(o, meta, sizeof meta);
    int n;
    if (o->short_name && o->long_name) n = snprintf(left, sizeof left, "  -%c, --%s", o->short_name, o->long_name);
    else if (o->short_name) n = snprintf(left, sizeof left, "  -%c", o->short_name);
    else n = snprintf(left, sizeof left, "  --%s", o->long_name);
    if (meta[0] && n < (int)sizeof left) n += snprintf(left + n, sizeof left - (size_t)n, " %s", meta);
    if (o->required) snprintf(tail, sizeof tail, " (required)");
    else if (o->kind == KVB_OPT_LIST) snprintf(tail, sizeof tail, " (may be given several times)");
    else if (o->def && o->kind != KVB_OPT_FLAG) snprintf(tail, sizeof tail, " (default: %s)", o->def);
    snprintf(text, sizeof text, "%s%s", o->help ? o->help : "", tail);
    fputs(left, f);
    if (n + 1 > HELP_COLUMN) fprintf(f, "\n%*s", HELP_COLUMN, "");
    else fprintf(f, "%*s", HELP_COLUMN - n, "");
    help_wrap(f, text, HELP_COLUMN, HELP_COLUMN);
}

void kvb_cli_help(const kvb_cli_spec *spec, FILE *f) {
    const char *u = spec->usage ? spec->usage : "[options]";
    for (int line = 0; *u; line++) {
        size_t len = strcspn(u, "\n");
        fprintf(f, "%s kvbridge %s %.*s\n", line ? "      " : "usage:", spec->name, (int)len, u);
        u += len + (u[len] == '\n');
    }
    if (spec->about) {
        fputc('\n', f);
        help_wrap(f, spec->about, 0, 0);
    }
    fputc('\n', f);
    for (const kvb_opt *o = spec->opts; !opt_is_end(o); o++) help_option(f, o);
    fprintf(f, "  -h, --help           this help\n");
    if (spec->epilog) {
        fprintf(f, "\n%s\n", spec->epilog);
    }
}

kvb_status kvb_opt_parse_type(const char *val, void *dst, kvb_err *err) {
    kvb_type t;
    kvb_status st = kvb_type_from_name(val, &t, err);
    if (st == KVB_OK) *(uint32_t *)dst = t;
    return st;
}

bool kvb_cli_gpu_ok(const char *cmd, const kvb_cli_gpu *g, bool cuda) {
    if (!kvb_arg_gpus_ok(cmd, g->gpus, g->tp_one_device, cuda)) return false;
    if (g->gpu_weights && !cuda) {
        fprintf(stderr, "kvbridge %s: --gpu-weights is how the CUDA engine holds the weights; add --device cuda\n",
                cmd);
        return false;
    }
    return true;
}

bool kvb_arg_is_help(const char *a) { return strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0; }

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

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double kvb_median_sort(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
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
