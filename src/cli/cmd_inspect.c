/* cli/cmd_inspect.c — `kvbridge inspect FILE [--tensors] [--kv-full]`: opens a GGUF file with the
 * validating reader (so a successful run means every header field, KV, tensor info and data range
 * checked out) and prints the version, alignment, data offset and every KV pair. Strings are
 * printed quoted with control bytes escaped and, unless --kv-full, cut at 80 bytes (on a UTF-8
 * boundary); arrays show their element type, length and first 8 elements. --tensors lists every
 * tensor with its type, dims, offset and byte size. A model file's cache cost per token is printed
 * beside the same model's per-head K/V cost (for an MLA model, the latent row against K and V of
 * every head); `--preset NAME` prints that line for a preset's shape without a file (DeepSeek-V3's
 * 671B need not be written to be sized). Exit status: 0 valid, 1 invalid or
 * unreadable (the reader's message, which names the file, goes to stderr), 2 usage error. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_gguf.h"
#include "kvb_model.h"
#include "kvb_quant.h"

#define SHORT_STRING_BYTES 80
#define SHORT_ARRAY_ELEMS 8
#define MAX_KEY_COLUMN 40

typedef struct {
    const char *path;
    bool tensors;
    bool kv_full;
    const char *preset;
} inspect_opts;

/* Fills *o from argv; KVB_CLI_GO, or the code the command returns. */
static int parse_args(int argc, char **argv, inspect_opts *o) {
    int n_files = 0;
    char kv_full_help[160];
    snprintf(kv_full_help, sizeof kv_full_help,
             "print strings and arrays in full (default: strings cut at %d bytes, arrays show their first %d "
             "elements)",
             SHORT_STRING_BYTES, SHORT_ARRAY_ELEMS);
    const kvb_opt opts[] = {
        KVB_CLI_FLAG("tensors", &o->tensors, "also list every tensor: name, type, dims, offset and bytes"),
        KVB_CLI_FLAG("kv-full", &o->kv_full, kv_full_help),
        KVB_CLI_STR("preset", &o->preset, "NAME",
                    "instead of a FILE: print a gen-model preset's cache bytes per token (its format beside per-head "
                    "K/V)"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "inspect", .usage = "FILE [--tensors] [--kv-full] | --preset NAME", .opts = opts,
        .about = "Validates a GGUF file (header, every KV pair, every tensor info and that each tensor's data lies "
                 "inside the file) and prints its version, alignment and metadata.",
        .epilog = "exit status: 0 the file is valid, 1 it is not (or cannot be read), 2 usage error",
        .max_operands = 1, .operands = &o->path, .n_operands = &n_files};
    int rc = kvb_cli_parse(&spec, argc, argv);
    if (rc != KVB_CLI_GO) return rc;
    if (o->preset && n_files) return kvb_cli_usage_error(&spec, "give a FILE or --preset, not both");
    return n_files == 1 || o->preset ? KVB_CLI_GO : kvb_cli_usage_error(&spec, "give the GGUF FILE to inspect");
}

/* ---- value printing ------------------------------------------------------------------------- */

static void print_escaped_bytes(const char *p, uint64_t n) {
    for (uint64_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        switch (c) {
        case '"': fputs("\\\"", stdout); break;
        case '\\': fputs("\\\\", stdout); break;
        case '\n': fputs("\\n", stdout); break;
        case '\t': fputs("\\t", stdout); break;
        case '\r': fputs("\\r", stdout); break;
        default:
            if (c < 0x20 || c == 0x7f)
                printf("\\x%02x", c);
            else
                putchar(c);
        }
    }
}

/* Prints a string quoted and escaped; cut at max bytes (on a UTF-8 boundary) unless full. */
static void print_str(kvb_gguf_str s, bool full) {
    uint64_t n = s.len;
    if (!full && n > SHORT_STRING_BYTES) {
        n = SHORT_STRING_BYTES;
        while (n > 0 && ((unsigned char)s.ptr[n] & 0xC0) == 0x80) n--;
    }
    putchar('"');
    print_escaped_bytes(s.ptr, n);
    putchar('"');
    if (n < s.len) printf("... (%" PRIu64 " bytes)", s.len);
}

static void print_scalar(kvb_gguf_vtype t, const kvb_gguf_kv *kv) {
    switch (t) {
    case KVB_GGUF_U8:
    case KVB_GGUF_U16:
    case KVB_GGUF_U32:
    case KVB_GGUF_U64: printf("%" PRIu64, kv->v.u64); break;
    case KVB_GGUF_I8:
    case KVB_GGUF_I16:
    case KVB_GGUF_I32:
    case KVB_GGUF_I64: printf("%" PRId64, kv->v.i64); break;
    case KVB_GGUF_F32: printf("%.9g", kv->v.f64); break;
    case KVB_GGUF_F64: printf("%.17g", kv->v.f64); break;
    case KVB_GGUF_BOOL: fputs(kv->v.b ? "true" : "false", stdout); break;
    default: fputs("?", stdout);
    }
}

/* Decodes element i of a numeric array into a kv's value union (the file is little-endian). */
static void array_element(const kvb_gguf_kv *kv, uint64_t i, kvb_gguf_kv *out) {
    size_t es = kvb_gguf_vtype_size(kv->arr_type);
    const uint8_t *p = kv->arr_data + i * es;
    uint64_t bits = 0;
    for (size_t b = 0; b < es; b++) bits |= (uint64_t)p[b] << (8 * b);
    memset(out, 0, sizeof *out);
    switch (kv->arr_type) {
    case KVB_GGUF_I8: out->v.i64 = (int8_t)bits; break;
    case KVB_GGUF_I16: out->v.i64 = (int16_t)bits; break;
    case KVB_GGUF_I32: out->v.i64 = (int32_t)bits; break;
    case KVB_GGUF_I64: out->v.i64 = (int64_t)bits; break;
    case KVB_GGUF_F32: {
        uint32_t b32 = (uint32_t)bits;
        float f;
        memcpy(&f, &b32, sizeof f);
        out->v.f64 = f;
        break;
    }
    case KVB_GGUF_F64: memcpy(&out->v.f64, &bits, sizeof out->v.f64); break;
    case KVB_GGUF_BOOL: out->v.b = bits != 0; break;
    default: out->v.u64 = bits; break;
    }
}

static void print_array(const kvb_gguf_kv *kv, bool full) {
    printf("[%s x %" PRIu64 "]  [", kvb_gguf_vtype_name(kv->arr_type), kv->arr_len);
    uint64_t shown = full || kv->arr_len <= SHORT_ARRAY_ELEMS ? kv->arr_len : SHORT_ARRAY_ELEMS;
    const uint8_t *rec = kv->arr_data; /* string records, walked in order */
    for (uint64_t i = 0; i < shown; i++) {
        if (i) fputs(", ", stdout);
        if (kv->arr_type == KVB_GGUF_STRING) {
            uint64_t len = 0;
            for (int b = 0; b < 8; b++) len |= (uint64_t)rec[b] << (8 * b);
            print_str((kvb_gguf_str){(const char *)rec + 8, len}, full);
            rec += 8 + len;
        } else {
            kvb_gguf_kv el;
            array_element(kv, i, &el);
            print_scalar(kv->arr_type, &el);
        }
    }
    if (shown < kv->arr_len) printf(", ... (+%" PRIu64 " more)", kv->arr_len - shown);
    putchar(']');
}

static void print_kv(const kvb_gguf_kv *kv, int key_width, bool full) {
    printf("  %-*.*s  ", key_width, (int)kv->key.len, kv->key.ptr);
    if (kv->type == KVB_GGUF_ARRAY) {
        print_array(kv, full);
    } else {
        printf("%-6s  ", kvb_gguf_vtype_name(kv->type));
        if (kv->type == KVB_GGUF_STRING)
            print_str(kv->str, full);
        else
            print_scalar(kv->type, kv);
    }
    putchar('\n');
}

/* ---- sections ------------------------------------------------------------------------------- */

static void print_kvs(const kvb_gguf *g, bool full) {
    int width = 0;
    for (uint64_t i = 0; i < kvb_gguf_n_kv(g); i++) {
        uint64_t len = kvb_gguf_kv_at(g, i)->key.len;
        if (len > (uint64_t)width) width = len > MAX_KEY_COLUMN ? MAX_KEY_COLUMN : (int)len;
    }
    printf("%" PRIu64 " KV pairs:\n", kvb_gguf_n_kv(g));
    for (uint64_t i = 0; i < kvb_gguf_n_kv(g); i++) print_kv(kvb_gguf_kv_at(g, i), width, full);
}

static void print_dims(const kvb_gguf_tensor *t) {
    char buf[128];
    int n = snprintf(buf, sizeof buf, "[");
    for (uint32_t d = 0; d < t->n_dims; d++)
        n += snprintf(buf + n, sizeof buf - (size_t)n, "%s%" PRIu64, d ? ", " : "", t->ne[d]);
    snprintf(buf + n, sizeof buf - (size_t)n, "]");
    printf("%-26s", buf);
}

static void print_tensors(const kvb_gguf *g, bool list) {
    uint64_t total = 0;
    for (uint64_t i = 0; i < kvb_gguf_n_tensors(g); i++) total += kvb_gguf_tensor_at(g, i)->n_bytes;
    if (kvb_gguf_n_tensors(g) == 0) {
        printf("0 tensors\n");
        return;
    }
    printf("%" PRIu64 " tensors, %" PRIu64 " bytes of data%s\n", kvb_gguf_n_tensors(g), total,
           list ? ":" : " (--tensors lists them)");
    if (!list) return;
    printf("  %-5s %-40s %-6s %-26s %14s %14s\n", "#", "name", "type", "dims", "offset", "bytes");
    for (uint64_t i = 0; i < kvb_gguf_n_tensors(g); i++) {
        const kvb_gguf_tensor *t = kvb_gguf_tensor_at(g, i);
        printf("  %-5" PRIu64 " %-40.*s %-6s ", i, (int)t->name.len, t->name.ptr, kvb_type_name(t->type));
        print_dims(t);
        printf(" %14" PRIu64 " %14" PRIu64 "\n", t->offset, t->n_bytes);
    }
}

/* One line per cache dtype: bytes per token over all layers in the model's own cache format, and
 * the same model's cache as per-head K and V. */
static void print_cache_cost(const kvb_model_desc *d) {
    const uint32_t types[] = {KVB_TYPE_F16, KVB_TYPE_BF16, KVB_TYPE_Q8_0};
    printf("cache per token (%u layers, %s):\n", d->n_layer,
           d->mla ? "latent row kv_lora_rank + rope dims, against K and V of every head" : "per-head K and V");
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        uint64_t cache, per_head;
        kvb_model_cache_token_bytes(d, types[i], &cache, &per_head);
        if (!cache || !per_head) continue; /* a row this dtype cannot encode */
        printf("  %-5s %10llu bytes  per-head K/V %10llu bytes  (%.2fx smaller)\n", kvb_type_name(types[i]),
               (unsigned long long)cache, (unsigned long long)per_head, (double)per_head / (double)cache);
    }
}

int kvb_cmd_inspect(int argc, char **argv) {
    inspect_opts o = {0};
    int rc = parse_args(argc, argv, &o);
    if (rc != KVB_CLI_GO) return rc;
    if (o.preset) {
        const kvb_preset *p = kvb_preset_find(o.preset);
        if (!p) {
            fprintf(stderr, "kvbridge inspect: unknown preset '%s' (gen-model --help lists them)\n", o.preset);
            return 1;
        }
        printf("preset %s: %s\n", p->name, p->summary);
        print_cache_cost(&p->d);
        return 0;
    }
    kvb_gguf *g = NULL;
    kvb_err err = {0};
    if (kvb_gguf_open(o.path, &g, &err) != KVB_OK) {
        fprintf(stderr, "kvbridge inspect: %s\n", err.msg);
        return 1;
    }
    printf("%s: GGUF v%" PRIu32 ", %" PRIu64 " bytes, alignment %" PRIu64 ", data section at offset %" PRIu64 "\n",
           kvb_gguf_path(g), kvb_gguf_version(g), kvb_gguf_file_size(g), kvb_gguf_alignment(g),
           kvb_gguf_data_offset(g));
    print_kvs(g, o.kv_full);
    print_tensors(g, o.tensors);
    kvb_model_desc d;
    if (kvb_model_desc_from_gguf(g, &d, NULL) == KVB_OK) print_cache_cost(&d);
    kvb_gguf_close(g);
    return 0;
}
