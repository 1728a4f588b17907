/* gguf/gguf_read.c — the GGUF v2/v3 reader. The file is mapped read-only (or a caller's buffer is
 * wrapped) and validated completely before a handle is returned: magic and version, counts that
 * the remaining bytes could hold, every key (non-empty UTF-8 without control bytes, unique),
 * every value (known type, bounded lengths, bools 0/1, no nested arrays, string arrays walked),
 * general.alignment, and every tensor info (unique name, 1-4 dims each >= 1, element count and
 * byte size without overflow, a type known to kvb_type_get whose block divides ne[0], an aligned
 * offset, and data that lies inside the file and overlaps no other tensor). Every byte is treated
 * as hostile: lengths are compared against the bytes that remain before anything is read or
 * allocated, and arrays grow with the entries actually parsed, so a lying header cannot make us
 * allocate more than the file's own size justifies. Errors are KVB_ERR_FORMAT with a message that
 * starts with the file's name and says what is wrong and where. The handle owns the KV and tensor
 * descriptor arrays plus two hash indexes (key -> KV, name -> tensor); strings point into the
 * mapping. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf_internal.h"
#include "kvb_gguf.h"
#include "kvb_quant.h"

/* Smallest possible encodings, used to bound counts before parsing: a KV is a key length (8),
 * a one-byte key, a value type (4) and at least a one-byte value; a tensor info is a name
 * length (8), a one-byte name, n_dims (4), one dim (8), a type (4) and an offset (8). */
#define MIN_KV_BYTES 14u
#define MIN_TENSOR_INFO_BYTES 33u
#define HEADER_BYTES 24u /* magic, version, n_tensors, n_kv */

/* Open-addressing hash index from a name to an entry number (slots hold index + 1; 0 = empty). */
typedef struct {
    uint64_t *slots;
    uint64_t mask;
} name_index;

struct kvb_gguf {
    char *path;
    const uint8_t *base;
    uint64_t size;
    void *map; /* non-NULL when we mapped the file ourselves */
    size_t map_len;
    uint32_t version;
    uint64_t alignment;
    uint64_t data_offset;
    kvb_gguf_kv *kv;
    uint64_t n_kv, cap_kv;
    kvb_gguf_tensor *tensors;
    uint64_t n_tensors, cap_tensors;
    name_index kv_index, tensor_index;
};

/* Parsing state: a position in the bytes, the file's name for messages, and what is being
 * parsed right now ("KV #3 'general.name'") so low-level failures can say where they happened. */
typedef struct {
    const uint8_t *base;
    uint64_t size, pos;
    const char *name;
    kvb_err *err;
    char where[160];
} cursor;

/* ---- small helpers ----------------------------------------------------------------------- */

size_t kvb_gguf_vtype_size(kvb_gguf_vtype t) {
    switch (t) {
    case KVB_GGUF_U8:
    case KVB_GGUF_I8:
    case KVB_GGUF_BOOL: return 1;
    case KVB_GGUF_U16:
    case KVB_GGUF_I16: return 2;
    case KVB_GGUF_U32:
    case KVB_GGUF_I32:
    case KVB_GGUF_F32: return 4;
    case KVB_GGUF_U64:
    case KVB_GGUF_I64:
    case KVB_GGUF_F64: return 8;
    case KVB_GGUF_STRING:
    case KVB_GGUF_ARRAY: return 0;
    }
    return 0;
}

const char *kvb_gguf_vtype_name(kvb_gguf_vtype t) {
    static const char *const names[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                        "bool", "string", "array", "u64", "i64", "f64"};
    return (unsigned)t < KVB_ARRAY_LEN(names) ? names[t] : "?";
}

static bool vtype_known(uint32_t t) { return t <= KVB_GGUF_F64; }

bool kvb_gguf_str_eq(kvb_gguf_str s, const char *cstr) {
    size_t n = strlen(cstr);
    return s.len == n && (n == 0 || memcmp(s.ptr, cstr, n) == 0);
}

static kvb_status fail(cursor *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static kvb_status fail(cursor *c, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvb_err_set(c->err, KVB_ERR_FORMAT, "%s: %s", c->name, msg);
}

static kvb_status fail_nomem(cursor *c, const char *what) {
    return kvb_err_set(c->err, KVB_ERR_NOMEM, "%s: out of memory allocating %s", c->name, what);
}

static uint64_t bytes_left(const cursor *c) { return c->size - c->pos; }

/* Checks that n bytes starting at the cursor lie inside the file. */
static kvb_status need(cursor *c, uint64_t n, const char *what) {
    if (n <= bytes_left(c)) return KVB_OK;
    return fail(c, "%s: %s [offset %" PRIu64 ", %" PRIu64 " bytes] runs past the end of the file (file is %" PRIu64
                   " bytes)",
                c->where, what, c->pos, n, c->size);
}

static kvb_status read_u32(cursor *c, const char *what, uint32_t *out) {
    kvb_status st = need(c, 4, what);
    if (st != KVB_OK) return st;
    *out = kvb_gguf_le32(c->base + c->pos);
    c->pos += 4;
    return KVB_OK;
}

static kvb_status read_u64(cursor *c, const char *what, uint64_t *out) {
    kvb_status st = need(c, 8, what);
    if (st != KVB_OK) return st;
    *out = kvb_gguf_le64(c->base + c->pos);
    c->pos += 8;
    return KVB_OK;
}

/* A (u64 length, bytes) string; the view points into the file. */
static kvb_status read_str(cursor *c, const char *what, kvb_gguf_str *out) {
    uint64_t len = 0;
    kvb_status st = read_u64(c, what, &len);
    if (st != KVB_OK) return st;
    if (len > bytes_left(c)) { /* the message is made only on failure: vocabularies hold ~1M strings */
        char what_bytes[96];
        snprintf(what_bytes, sizeof what_bytes, "%s (length %" PRIu64 ")", what, len);
        return need(c, len, what_bytes);
    }
    out->ptr = (const char *)(c->base + c->pos);
    out->len = len;
    c->pos += len;
    return KVB_OK;
}

/* A key or tensor name: a string that also obeys kvb_gguf_name_problem's rule. */
static kvb_status read_name(cursor *c, const char *what, kvb_gguf_str *out) {
    kvb_status st = read_str(c, what, out);
    if (st != KVB_OK) return st;
    uint64_t bad;
    const char *problem = kvb_gguf_name_problem(out->ptr, out->len, &bad);
    if (!problem) return KVB_OK;
    if (out->len == 0) return fail(c, "%s: empty %s", c->where, what);
    if (out->len > KVB_GGUF_MAX_NAME_BYTES)
        return fail(c, "%s: %s of %" PRIu64 " bytes %s", c->where, what, out->len, problem);
    return fail(c, "%s: %s %s (byte 0x%02x at position %" PRIu64 ")", c->where, what, problem,
                (unsigned char)out->ptr[bad], bad);
}

/* Returns arr grown to hold at least n + 1 entries (amortised doubling), or NULL when out of
 * memory (arr is then still valid and owned by the caller). */
static void *grow_array(void *arr, uint64_t *cap, uint64_t n, size_t elem) {
    if (n < *cap) return arr;
    uint64_t ncap = *cap ? *cap * 2 : 16, bytes;
    if (kvb_mul_overflow_u64(ncap, elem, &bytes) || bytes > SIZE_MAX) return NULL;
    void *p = realloc(arr, (size_t)bytes);
    if (p) *cap = ncap;
    return p;
}

/* ---- values ------------------------------------------------------------------------------ */

/* Reads one fixed-size scalar of type t into kv->v (widened). Bools must be 0 or 1. */
static kvb_status read_scalar(cursor *c, kvb_gguf_vtype t, kvb_gguf_kv *kv) {
    size_t n = kvb_gguf_vtype_size(t);
    kvb_status st = need(c, n, kvb_gguf_vtype_name(t));
    if (st != KVB_OK) return st;
    const uint8_t *p = c->base + c->pos;
    switch (t) {
    case KVB_GGUF_U8: kv->v.u64 = p[0]; break;
    case KVB_GGUF_I8: kv->v.i64 = (int8_t)p[0]; break;
    case KVB_GGUF_U16: kv->v.u64 = kvb_gguf_le16(p); break;
    case KVB_GGUF_I16: kv->v.i64 = (int16_t)kvb_gguf_le16(p); break;
    case KVB_GGUF_U32: kv->v.u64 = kvb_gguf_le32(p); break;
    case KVB_GGUF_I32: kv->v.i64 = (int32_t)kvb_gguf_le32(p); break;
    case KVB_GGUF_U64: kv->v.u64 = kvb_gguf_le64(p); break;
    case KVB_GGUF_I64: kv->v.i64 = (int64_t)kvb_gguf_le64(p); break;
    case KVB_GGUF_F32: {
        uint32_t bits = kvb_gguf_le32(p);
        float f;
        memcpy(&f, &bits, sizeof f);
        kv->v.f64 = f;
        break;
    }
    case KVB_GGUF_F64: {
        uint64_t bits = kvb_gguf_le64(p);
        memcpy(&kv->v.f64, &bits, sizeof kv->v.f64);
        break;
    }
    case KVB_GGUF_BOOL:
        if (p[0] > 1) return fail(c, "%s: bool value %u at offset %" PRIu64 " (must be 0 or 1)", c->where, p[0], c->pos);
        kv->v.b = p[0] != 0;
        break;
    default: return fail(c, "%s: internal error: %u is not a scalar type", c->where, (unsigned)t);
    }
    c->pos += n;
    return KVB_OK;
}

/* Checks that every element of a bool array is 0 or 1. */
static kvb_status check_bool_array(cursor *c, const uint8_t *p, uint64_t n) {
    for (uint64_t i = 0; i < n; i++)
        if (p[i] > 1)
            return fail(c, "%s: bool value %u in array element %" PRIu64 " (must be 0 or 1)", c->where, p[i], i);
    return KVB_OK;
}

/* Walks an array of n strings, checking each record lies inside the file. */
static kvb_status walk_string_array(cursor *c, uint64_t n) {
    if (n > bytes_left(c) / 8)
        return fail(c,
                    "%s: array of %" PRIu64 " strings cannot fit in the %" PRIu64
                    " bytes left in the file (each needs at least 8)",
                    c->where, n, bytes_left(c));
    for (uint64_t i = 0; i < n; i++) {
        const uint64_t len = bytes_left(c) >= 8 ? kvb_gguf_le64(c->base + c->pos) : 0;
        if (bytes_left(c) < 8 || len > bytes_left(c) - 8) { /* named only when it fails */
            char what[64];
            snprintf(what, sizeof what, "array element %" PRIu64, i);
            kvb_gguf_str s;
            return read_str(c, what, &s);
        }
        c->pos += 8 + len;
    }
    return KVB_OK;
}

static kvb_status read_array(cursor *c, kvb_gguf_kv *kv) {
    uint32_t et = 0;
    uint64_t n = 0;
    kvb_status st = read_u32(c, "array element type", &et);
    if (st != KVB_OK) return st;
    if (et == KVB_GGUF_ARRAY) return fail(c, "%s: nested array (arrays of arrays are not supported)", c->where);
    if (!vtype_known(et)) return fail(c, "%s: unknown array element type %" PRIu32, c->where, et);
    if ((st = read_u64(c, "array length", &n)) != KVB_OK) return st;
    kv->arr_type = (kvb_gguf_vtype)et;
    kv->arr_len = n;
    kv->arr_data = c->base + c->pos;
    if (et == KVB_GGUF_STRING) return walk_string_array(c, n);
    uint64_t bytes = 0;
    const char *ename = kvb_gguf_vtype_name((kvb_gguf_vtype)et);
    if (kvb_mul_overflow_u64(n, kvb_gguf_vtype_size((kvb_gguf_vtype)et), &bytes))
        return fail(c, "%s: array length %" PRIu64 " of %s elements overflows a 64-bit byte count", c->where, n, ename);
    char what[64];
    snprintf(what, sizeof what, "array of %" PRIu64 " %s", n, ename);
    if ((st = need(c, bytes, what)) != KVB_OK) return st;
    if (et == KVB_GGUF_BOOL && (st = check_bool_array(c, kv->arr_data, n)) != KVB_OK) return st;
    c->pos += bytes;
    return KVB_OK;
}

static kvb_status read_value(cursor *c, uint32_t type, kvb_gguf_kv *kv) {
    if (!vtype_known(type)) return fail(c, "%s: unknown value type %" PRIu32, c->where, type);
    kv->type = (kvb_gguf_vtype)type;
    if (type == KVB_GGUF_STRING) return read_str(c, "string value", &kv->str);
    if (type == KVB_GGUF_ARRAY) return read_array(c, kv);
    return read_scalar(c, kv->type, kv);
}

/* Describes a name for messages: at most 64 bytes of it, with "..." when cut. */
static void describe_name(char *buf, size_t cap, const char *prefix, uint64_t i, kvb_gguf_str s) {
    int shown = s.len > 64 ? 64 : (int)s.len;
    snprintf(buf, cap, "%s #%" PRIu64 " '%.*s%s'", prefix, i, shown, s.ptr, s.len > 64 ? "..." : "");
}

static kvb_status read_kv(cursor *c, uint64_t i, kvb_gguf_kv *kv) {
    memset(kv, 0, sizeof *kv);
    snprintf(c->where, sizeof c->where, "KV #%" PRIu64, i);
    kvb_status st = read_name(c, "key", &kv->key);
    if (st != KVB_OK) return st;
    describe_name(c->where, sizeof c->where, "KV", i, kv->key);
    uint32_t type = 0;
    if ((st = read_u32(c, "value type", &type)) != KVB_OK) return st;
    return read_value(c, type, kv);
}

/* ---- the name indexes -------------------------------------------------------------------- */

typedef const kvb_gguf_str *(*name_of_fn)(const kvb_gguf *g, uint64_t i);
static const kvb_gguf_str *kv_name(const kvb_gguf *g, uint64_t i) { return &g->kv[i].key; }
static const kvb_gguf_str *tensor_name(const kvb_gguf *g, uint64_t i) { return &g->tensors[i].name; }

static uint64_t hash_name(const char *p, uint64_t len) { return kvb_hash64(p, (size_t)len, 0x6767756621ULL); }

/* Returns the entry whose name is (p, len), or UINT64_MAX. */
static uint64_t index_lookup(const kvb_gguf *g, const name_index *ix, name_of_fn name_of, const char *p,
                             uint64_t len) {
    if (!ix->slots) return UINT64_MAX;
    for (uint64_t h = hash_name(p, len) & ix->mask;; h = (h + 1) & ix->mask) {
        uint64_t s = ix->slots[h];
        if (s == 0) return UINT64_MAX;
        const kvb_gguf_str *name = name_of(g, s - 1);
        if (name->len == len && memcmp(name->ptr, p, (size_t)len) == 0) return s - 1;
    }
}

/* Builds the index over n entries; a repeated name is an error that names it. */
static kvb_status index_build(cursor *c, const kvb_gguf *g, name_index *ix, uint64_t n, name_of_fn name_of,
                              const char *what) {
    uint64_t cap = 16;
    while (cap < 2 * n) cap *= 2; /* n <= file size / 14, so this cannot overflow */
    if (cap > SIZE_MAX / sizeof(uint64_t) || !(ix->slots = calloc((size_t)cap, sizeof(uint64_t))))
        return fail_nomem(c, "a name index");
    ix->mask = cap - 1;
    for (uint64_t i = 0; i < n; i++) {
        const kvb_gguf_str *name = name_of(g, i);
        uint64_t h = hash_name(name->ptr, name->len) & ix->mask;
        for (; ix->slots[h] != 0; h = (h + 1) & ix->mask) {
            const kvb_gguf_str *other = name_of(g, ix->slots[h] - 1);
            if (other->len == name->len && memcmp(other->ptr, name->ptr, (size_t)name->len) == 0) {
                int shown = name->len > 128 ? 128 : (int)name->len;
                return fail(c, "duplicate %s '%.*s' (entries #%" PRIu64 " and #%" PRIu64 ")", what, shown, name->ptr,
                            ix->slots[h] - 1, i);
            }
        }
        ix->slots[h] = i + 1;
    }
    return KVB_OK;
}

/* ---- header, KVs, alignment -------------------------------------------------------------- */

static kvb_status read_magic_and_version(cursor *c, uint32_t *version) {
    snprintf(c->where, sizeof c->where, "header");
    if (c->size < 4 || memcmp(c->base, KVB_GGUF_MAGIC, 4) != 0) {
        if (c->size < 4) return fail(c, "not a GGUF file (only %" PRIu64 " bytes, too short for the magic)", c->size);
        return fail(c, "not a GGUF file (magic bytes %02x %02x %02x %02x, expected \"GGUF\")", c->base[0], c->base[1],
                    c->base[2], c->base[3]);
    }
    c->pos = 4;
    kvb_status st = read_u32(c, "version", version);
    if (st != KVB_OK) return st;
    uint32_t v = *version;
    if (v == 2 || v == 3) return KVB_OK;
    uint32_t swapped = __builtin_bswap32(v);
    if (swapped >= 1 && swapped <= 3)
        return fail(c, "big-endian GGUF (version %" PRIu32 " byte-swapped) is not supported", swapped);
    if (v == 1)
        return fail(c, "GGUF version 1 is not supported (only versions 2 and 3; re-convert the model with a "
                       "current llama.cpp)");
    return fail(c, "GGUF version %" PRIu32 " is not supported (only versions 2 and 3)", v);
}

/* Rejects counts that the remaining bytes could not possibly hold, before anything is allocated. */
static kvb_status check_counts(cursor *c, uint64_t n_tensors, uint64_t n_kv) {
    uint64_t left = bytes_left(c), need_kv, need_t, total;
    if (n_kv > left / MIN_KV_BYTES)
        return fail(c, "KV count %" PRIu64 " cannot fit in the %" PRIu64 " bytes after the header", n_kv, left);
    if (n_tensors > left / MIN_TENSOR_INFO_BYTES)
        return fail(c, "tensor count %" PRIu64 " cannot fit in the %" PRIu64 " bytes after the header", n_tensors, left);
    need_kv = n_kv * MIN_KV_BYTES;
    need_t = n_tensors * MIN_TENSOR_INFO_BYTES;
    if (kvb_add_overflow_u64(need_kv, need_t, &total) || total > left)
        return fail(c,
                    "%" PRIu64 " KVs and %" PRIu64 " tensor infos cannot fit in the %" PRIu64
                    " bytes after the header",
                    n_kv, n_tensors, left);
    return KVB_OK;
}

static kvb_status read_kvs(cursor *c, kvb_gguf *g, uint64_t n_kv) {
    for (uint64_t i = 0; i < n_kv; i++) {
        kvb_gguf_kv *kv = grow_array(g->kv, &g->cap_kv, g->n_kv, sizeof *g->kv);
        if (!kv) return fail_nomem(c, "the KV table");
        g->kv = kv;
        kvb_status st = read_kv(c, i, &g->kv[g->n_kv]);
        if (st != KVB_OK) return st;
        g->n_kv++;
    }
    return index_build(c, g, &g->kv_index, g->n_kv, kv_name, "key");
}

static kvb_status resolve_alignment(cursor *c, kvb_gguf *g) {
    g->alignment = KVB_GGUF_DEFAULT_ALIGNMENT;
    const kvb_gguf_kv *kv = kvb_gguf_find(g, KVB_GGUF_ALIGNMENT_KEY);
    if (!kv) return KVB_OK;
    if (kv->type != KVB_GGUF_U32)
        return fail(c, "general.alignment must be a u32 (it is a %s)", kvb_gguf_vtype_name(kv->type));
    if (!kvb_gguf_is_pow2(kv->v.u64) || kv->v.u64 > KVB_GGUF_MAX_ALIGNMENT)
        return fail(c, "general.alignment must be a power of two from 1 to %u (it is %" PRIu64 ")",
                    KVB_GGUF_MAX_ALIGNMENT, kv->v.u64);
    g->alignment = kv->v.u64;
    return KVB_OK;
}

/* ---- tensor infos ------------------------------------------------------------------------ */

static kvb_status read_dims(cursor *c, kvb_gguf_tensor *t) {
    kvb_status st = read_u32(c, "n_dims", &t->n_dims);
    if (st != KVB_OK) return st;
    if (t->n_dims < 1 || t->n_dims > KVB_GGUF_MAX_DIMS)
        return fail(c, "%s has %" PRIu32 " dimensions (must be 1 to %d)", c->where, t->n_dims, KVB_GGUF_MAX_DIMS);
    for (uint32_t d = 0; d < KVB_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        if ((st = read_u64(c, "dimension", &t->ne[d])) != KVB_OK) return st;
        if (t->ne[d] == 0) return fail(c, "%s dimension %" PRIu32 " is 0", c->where, d);
        if (t->ne[d] > (uint64_t)INT64_MAX)
            return fail(c, "%s dimension %" PRIu32 " is %" PRIu64 " (more than 2^63-1)", c->where, d, t->ne[d]);
    }
    return KVB_OK;
}

/* Computes the tensor's byte size from its type and dims, checking every step. */
static kvb_status compute_tensor_bytes(cursor *c, kvb_gguf_tensor *t) {
    const kvb_type_info *ti = kvb_type_get(t->type);
    if (!ti || ti->block_elems <= 0 || ti->block_bytes <= 0)
        return fail(c, "%s has unknown tensor type %" PRIu32, c->where, t->type);
    uint64_t elems = 1;
    for (uint32_t d = 0; d < KVB_GGUF_MAX_DIMS; d++)
        if (kvb_mul_overflow_u64(elems, t->ne[d], &elems) || elems > (uint64_t)INT64_MAX)
            return fail(c,
                        "%s element count overflows (dims %" PRIu64 " x %" PRIu64 " x %" PRIu64 " x %" PRIu64 ")",
                        c->where, t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
    if (t->ne[0] % (uint64_t)ti->block_elems != 0)
        return fail(c, "%s row length ne[0]=%" PRIu64 " is not a multiple of the %s block size %d", c->where, t->ne[0],
                    ti->name, ti->block_elems);
    uint64_t bytes = t->ne[0] / (uint64_t)ti->block_elems;
    if (kvb_mul_overflow_u64(bytes, (uint64_t)ti->block_bytes, &bytes) ||
        kvb_mul_overflow_u64(bytes, elems / t->ne[0], &bytes))
        return fail(c, "%s byte size overflows 64 bits", c->where);
    t->n_bytes = bytes;
    return KVB_OK;
}

static kvb_status read_tensor_info(cursor *c, uint64_t i, kvb_gguf_tensor *t) {
    memset(t, 0, sizeof *t);
    snprintf(c->where, sizeof c->where, "tensor #%" PRIu64, i);
    kvb_status st = read_name(c, "tensor name", &t->name);
    if (st != KVB_OK) return st;
    describe_name(c->where, sizeof c->where, "tensor", i, t->name);
    if ((st = read_dims(c, t)) != KVB_OK) return st;
    if ((st = read_u32(c, "tensor type", &t->type)) != KVB_OK) return st;
    if ((st = read_u64(c, "tensor data offset", &t->offset)) != KVB_OK) return st;
    return compute_tensor_bytes(c, t);
}

static kvb_status read_tensor_infos(cursor *c, kvb_gguf *g, uint64_t n_tensors) {
    for (uint64_t i = 0; i < n_tensors; i++) {
        kvb_gguf_tensor *t = grow_array(g->tensors, &g->cap_tensors, g->n_tensors, sizeof *g->tensors);
        if (!t) return fail_nomem(c, "the tensor table");
        g->tensors = t;
        kvb_status st = read_tensor_info(c, i, &g->tensors[g->n_tensors]);
        if (st != KVB_OK) return st;
        g->n_tensors++;
    }
    return index_build(c, g, &g->tensor_index, g->n_tensors, tensor_name, "tensor name");
}

/* ---- data section ------------------------------------------------------------------------ */

static kvb_status place_tensor(cursor *c, kvb_gguf *g, uint64_t i) {
    kvb_gguf_tensor *t = &g->tensors[i];
    describe_name(c->where, sizeof c->where, "tensor", i, t->name);
    if (t->offset % g->alignment != 0)
        return fail(c, "%s data offset %" PRIu64 " is not a multiple of the alignment %" PRIu64, c->where, t->offset,
                    g->alignment);
    uint64_t start, end;
    if (kvb_add_overflow_u64(g->data_offset, t->offset, &start) || kvb_add_overflow_u64(start, t->n_bytes, &end) ||
        end > g->size)
        return fail(c,
                    "%s data [offset %" PRIu64 ", %" PRIu64 " bytes] runs past the end of the file (data section "
                    "starts at %" PRIu64 ", file is %" PRIu64 " bytes)",
                    c->where, t->offset, t->n_bytes, g->data_offset, g->size);
    t->data = g->base + start;
    return KVB_OK;
}

typedef struct {
    uint64_t offset, end, index;
} extent;

static int extent_cmp(const void *a, const void *b) {
    const extent *x = a, *y = b;
    return x->offset < y->offset ? -1 : x->offset > y->offset ? 1 : 0;
}

/* Rejects tensors whose data ranges overlap (no file llama.cpp accepts has them). */
static kvb_status check_no_overlap(cursor *c, const kvb_gguf *g) {
    if (g->n_tensors < 2) return KVB_OK;
    extent *ex = malloc((size_t)g->n_tensors * sizeof *ex); /* n_tensors <= size / 33: fits */
    if (!ex) return fail_nomem(c, "the tensor extent table");
    for (uint64_t i = 0; i < g->n_tensors; i++)
        ex[i] = (extent){g->tensors[i].offset, g->tensors[i].offset + g->tensors[i].n_bytes, i};
    qsort(ex, (size_t)g->n_tensors, sizeof *ex, extent_cmp);
    kvb_status st = KVB_OK;
    for (uint64_t i = 1; i < g->n_tensors && st == KVB_OK; i++) {
        if (ex[i].offset >= ex[i - 1].end) continue;
        const kvb_gguf_tensor *a = &g->tensors[ex[i - 1].index], *b = &g->tensors[ex[i].index];
        int la = a->name.len > 64 ? 64 : (int)a->name.len, lb = b->name.len > 64 ? 64 : (int)b->name.len;
        st = fail(c,
                  "tensor '%.*s' data [offset %" PRIu64 ", %" PRIu64 " bytes] overlaps tensor '%.*s' [offset %" PRIu64
                  ", %" PRIu64 " bytes]",
                  lb, b->name.ptr, b->offset, b->n_bytes, la, a->name.ptr, a->offset, a->n_bytes);
    }
    free(ex);
    return st;
}

static kvb_status place_data(cursor *c, kvb_gguf *g) {
    if (!kvb_gguf_align_up(c->pos, g->alignment, &g->data_offset))
        return fail(c, "data section offset overflows");
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        kvb_status st = place_tensor(c, g, i);
        if (st != KVB_OK) return st;
    }
    return check_no_overlap(c, g);
}

/* ---- open / close ------------------------------------------------------------------------ */

static kvb_status parse(kvb_gguf *g, kvb_err *err) {
    cursor c = {.base = g->base, .size = g->size, .pos = 0, .name = g->path, .err = err};
    uint64_t n_tensors = 0, n_kv = 0;
    kvb_status st = read_magic_and_version(&c, &g->version);
    if (st == KVB_OK) st = read_u64(&c, "tensor count", &n_tensors);
    if (st == KVB_OK) st = read_u64(&c, "KV count", &n_kv);
    if (st == KVB_OK) st = check_counts(&c, n_tensors, n_kv);
    if (st == KVB_OK) st = read_kvs(&c, g, n_kv);
    if (st == KVB_OK) st = resolve_alignment(&c, g);
    if (st == KVB_OK) st = read_tensor_infos(&c, g, n_tensors);
    if (st == KVB_OK) st = place_data(&c, g);
    return st;
}

static kvb_gguf *handle_new(const char *name, kvb_err *err) {
    kvb_gguf *g = calloc(1, sizeof *g);
    if (g) g->path = strdup(name);
    if (!g || !g->path) {
        free(g);
        kvb_err_set(err, KVB_ERR_NOMEM, "%s: out of memory opening the file", name);
        return NULL;
    }
    return g;
}

static kvb_status finish_open(kvb_gguf *g, kvb_gguf **out, kvb_err *err) {
    kvb_status st = parse(g, err);
    if (st != KVB_OK) {
        kvb_gguf_close(g);
        return st;
    }
    *out = g;
    return KVB_OK;
}

kvb_status kvb_gguf_open_memory(const void *buf, size_t size, const char *name, kvb_gguf **out, kvb_err *err) {
    *out = NULL;
    if (!name) name = "<memory>";
    if (!buf && size) return kvb_err_set(err, KVB_ERR_INVALID, "%s: NULL buffer of %zu bytes", name, size);
    static const uint8_t empty[1] = {0};
    kvb_gguf *g = handle_new(name, err);
    if (!g) return KVB_ERR_NOMEM;
    g->base = buf ? buf : empty;
    g->size = size;
    return finish_open(g, out, err);
}

/* Maps the file read-only into g (an empty file is reported as not being GGUF). */
static kvb_status map_file(kvb_gguf *g, kvb_err *err) {
    int fd = open(g->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        return kvb_err_set(err, e == ENOENT ? KVB_ERR_NOT_FOUND : KVB_ERR_IO, "%s: cannot open: %s", g->path,
                           strerror(e));
    }
    struct stat sb;
    kvb_status st = KVB_OK;
    if (fstat(fd, &sb) != 0)
        st = kvb_err_set(err, KVB_ERR_IO, "%s: cannot stat: %s", g->path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        st = kvb_err_set(err, KVB_ERR_IO, "%s: not a regular file", g->path);
    else if ((uint64_t)sb.st_size > SIZE_MAX)
        st = kvb_err_set(err, KVB_ERR_IO, "%s: file too large to map", g->path);
    if (st == KVB_OK && sb.st_size == 0)
        st = kvb_err_set(err, KVB_ERR_FORMAT, "%s: not a GGUF file (the file is empty)", g->path);
    if (st == KVB_OK) {
        void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            st = kvb_err_set(err, KVB_ERR_IO, "%s: cannot map %lld bytes: %s", g->path, (long long)sb.st_size,
                             strerror(errno));
        } else {
            g->map = p;
            g->map_len = (size_t)sb.st_size;
            g->base = p;
            g->size = (uint64_t)sb.st_size;
        }
    }
    close(fd);
    return st;
}

kvb_status kvb_gguf_open(const char *path, kvb_gguf **out, kvb_err *err) {
    *out = NULL;
    if (!path) return kvb_err_set(err, KVB_ERR_INVALID, "kvb_gguf_open: NULL path");
    kvb_gguf *g = handle_new(path, err);
    if (!g) return KVB_ERR_NOMEM;
    kvb_status st = map_file(g, err);
    if (st != KVB_OK) {
        kvb_gguf_close(g);
        return st;
    }
    return finish_open(g, out, err);
}

void kvb_gguf_close(kvb_gguf *g) {
    if (!g) return;
    if (g->map) munmap(g->map, g->map_len);
    free(g->kv_index.slots);
    free(g->tensor_index.slots);
    free(g->kv);
    free(g->tensors);
    free(g->path);
    free(g);
}

kvb_status kvb_gguf_prefault(const kvb_gguf *g, kvb_err *err) {
    if (!g->map) return KVB_OK; /* the caller's buffer */
#ifdef MADV_POPULATE_READ
    if (madvise(g->map, g->map_len, MADV_POPULATE_READ) == 0) return KVB_OK;
    if (errno == EFAULT)
        return kvb_err_set(err, KVB_ERR_IO, "%s: cannot read the file into memory: it is shorter than when it was "
                           "opened (changed on disk?)", g->path);
    if (errno != EINVAL)
        return kvb_err_set(err, KVB_ERR_IO, "%s: cannot read the file into memory: %s", g->path, strerror(errno));
#endif
    const long page = sysconf(_SC_PAGESIZE); /* kernels before 5.14: one read per page */
    const volatile uint8_t *p = g->map;
    uint8_t sink = 0;
    for (size_t off = 0; off < g->map_len; off += page > 0 ? (size_t)page : 4096) sink ^= p[off];
    (void)sink;
    return KVB_OK;
}

/* ---- accessors --------------------------------------------------------------------------- */

const char *kvb_gguf_path(const kvb_gguf *g) { return g->path; }
uint32_t kvb_gguf_version(const kvb_gguf *g) { return g->version; }
uint64_t kvb_gguf_alignment(const kvb_gguf *g) { return g->alignment; }
uint64_t kvb_gguf_file_size(const kvb_gguf *g) { return g->size; }
uint64_t kvb_gguf_data_offset(const kvb_gguf *g) { return g->data_offset; }
uint64_t kvb_gguf_n_kv(const kvb_gguf *g) { return g->n_kv; }
uint64_t kvb_gguf_n_tensors(const kvb_gguf *g) { return g->n_tensors; }

const kvb_gguf_kv *kvb_gguf_kv_at(const kvb_gguf *g, uint64_t i) { return i < g->n_kv ? &g->kv[i] : NULL; }

const kvb_gguf_tensor *kvb_gguf_tensor_at(const kvb_gguf *g, uint64_t i) {
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const kvb_gguf_kv *kvb_gguf_find(const kvb_gguf *g, const char *key) {
    uint64_t i = index_lookup(g, &g->kv_index, kv_name, key, strlen(key));
    return i == UINT64_MAX ? NULL : &g->kv[i];
}

const kvb_gguf_tensor *kvb_gguf_find_tensor(const kvb_gguf *g, const char *name) {
    uint64_t i = index_lookup(g, &g->tensor_index, tensor_name, name, strlen(name));
    return i == UINT64_MAX ? NULL : &g->tensors[i];
}

kvb_status kvb_gguf_arr_strings(const kvb_gguf_kv *kv, kvb_gguf_str *out, kvb_err *err) {
    if (kv->type != KVB_GGUF_ARRAY || kv->arr_type != KVB_GGUF_STRING)
        return kvb_err_set(err, KVB_ERR_INVALID, "key '%.*s' is not an array of strings",
                           (int)(kv->key.len > 128 ? 128 : kv->key.len), kv->key.ptr);
    /* The records were bounds-checked when the file was opened. */
    const uint8_t *p = kv->arr_data;
    for (uint64_t i = 0; i < kv->arr_len; i++) {
        uint64_t len = kvb_gguf_le64(p);
        out[i].ptr = (const char *)(p + 8);
        out[i].len = len;
        p += 8 + len;
    }
    return KVB_OK;
}
