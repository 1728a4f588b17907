/* gguf/gguf_write.c — the streaming GGUF v3 writer. KVs are serialised into a buffer as they are
 * added (keys checked with the reader's own rule and for duplicates; general.alignment must be a
 * u32 power of two, as the reader demands); tensor infos are recorded with their byte sizes
 * computed from kvb_type_get. write_header then lays the tensors out back to back, each padded to
 * the alignment, and writes magic, counts, KVs, infos and the padding up to the data section, so
 * the data can follow one tensor at a time (write_tensor_data checks order and size and pads).
 * The layout is exactly what llama.cpp and the Python gguf package write and load, including
 * llama.cpp's limit of 63 bytes for tensor names. */
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_internal.h"
#include "kvb_gguf.h"
#include "kvb_quant.h"

typedef struct {
    uint8_t *p;
    size_t len, cap;
} byte_buf;

typedef struct {
    char *name;
    uint32_t n_dims;
    uint64_t ne[KVB_GGUF_MAX_DIMS];
    uint32_t type;
    uint64_t n_bytes;
    uint64_t offset; /* set by write_header */
} writer_tensor;

struct kvb_gguf_writer {
    byte_buf kvs;
    uint64_t n_kv;
    char **keys; /* for duplicate detection */
    size_t cap_keys;
    writer_tensor *tensors;
    uint64_t n_tensors, cap_tensors;
    uint64_t alignment;
    bool header_written;
    uint64_t next_tensor;
};

/* ---- byte buffer ------------------------------------------------------------------------- */

static bool buf_put(byte_buf *b, const void *src, size_t n) {
    if (n > SIZE_MAX - b->len) return false;
    if (b->len + n > b->cap) {
        size_t ncap = b->cap ? b->cap : 256;
        while (ncap < b->len + n) {
            if (ncap > SIZE_MAX / 2) return false;
            ncap *= 2;
        }
        uint8_t *p = realloc(b->p, ncap);
        if (!p) return false;
        b->p = p;
        b->cap = ncap;
    }
    if (n) memcpy(b->p + b->len, src, n);
    b->len += n;
    return true;
}

static bool buf_u32(byte_buf *b, uint32_t v) {
    uint8_t t[4];
    kvb_gguf_put_le32(t, v);
    return buf_put(b, t, 4);
}

static bool buf_u64(byte_buf *b, uint64_t v) {
    uint8_t t[8];
    kvb_gguf_put_le64(t, v);
    return buf_put(b, t, 8);
}

static bool buf_str(byte_buf *b, const char *p, uint64_t len) {
    return len <= SIZE_MAX && buf_u64(b, len) && buf_put(b, p, (size_t)len);
}

/* ---- create / destroy -------------------------------------------------------------------- */

kvb_status kvb_gguf_writer_create(kvb_gguf_writer **out, kvb_err *err) {
    *out = calloc(1, sizeof **out);
    if (!*out) return kvb_err_set(err, KVB_ERR_NOMEM, "gguf writer: out of memory");
    (*out)->alignment = KVB_GGUF_DEFAULT_ALIGNMENT;
    return KVB_OK;
}

void kvb_gguf_writer_destroy(kvb_gguf_writer *w) {
    if (!w) return;
    for (uint64_t i = 0; i < w->n_kv; i++) free(w->keys[i]);
    free(w->keys);
    for (uint64_t i = 0; i < w->n_tensors; i++) free(w->tensors[i].name);
    free(w->tensors);
    free(w->kvs.p);
    free(w);
}

static kvb_status nomem(kvb_err *err) { return kvb_err_set(err, KVB_ERR_NOMEM, "gguf writer: out of memory"); }

/* ---- KVs --------------------------------------------------------------------------------- */

static kvb_status check_alignment_kv(kvb_gguf_vtype t, uint64_t v, kvb_err *err) {
    if (t != KVB_GGUF_U32)
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: general.alignment must be a u32 (got %s)",
                           kvb_gguf_vtype_name(t));
    if (!kvb_gguf_is_pow2(v) || v > KVB_GGUF_MAX_ALIGNMENT)
        return kvb_err_set(err, KVB_ERR_INVALID,
                           "gguf writer: general.alignment must be a power of two from 1 to %u (got %" PRIu64 ")",
                           KVB_GGUF_MAX_ALIGNMENT, v);
    return KVB_OK;
}

/* Validates the key (the reader's rule, not yet present, writer still open) and starts the KV:
 * records the key and serialises it with the value type. */
static kvb_status begin_kv(kvb_gguf_writer *w, const char *key, uint64_t key_len, kvb_gguf_vtype type,
                           kvb_err *err) {
    if (w->header_written)
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: cannot add KVs after the header was written");
    uint64_t bad;
    const char *problem = kvb_gguf_name_problem(key, key_len, &bad);
    if (problem) return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: key %s", problem);
    for (uint64_t i = 0; i < w->n_kv; i++)
        if (strlen(w->keys[i]) == key_len && memcmp(w->keys[i], key, (size_t)key_len) == 0)
            return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: duplicate key '%.*s'", (int)key_len, key);
    if (w->n_kv == w->cap_keys) {
        size_t ncap = w->cap_keys ? w->cap_keys * 2 : 32;
        char **k = realloc(w->keys, ncap * sizeof *k);
        if (!k) return nomem(err);
        w->keys = k;
        w->cap_keys = ncap;
    }
    char *copy = malloc((size_t)key_len + 1);
    if (!copy) return nomem(err);
    memcpy(copy, key, (size_t)key_len);
    copy[key_len] = 0;
    if (!buf_str(&w->kvs, key, key_len) || !buf_u32(&w->kvs, (uint32_t)type)) {
        free(copy);
        return nomem(err);
    }
    w->keys[w->n_kv++] = copy;
    return KVB_OK;
}

/* Undoes a begin_kv whose value could not be serialised (out of memory), so the writer stays
 * consistent: the KV count, the key list and the buffer agree again. */
static kvb_status rollback_kv(kvb_gguf_writer *w, size_t mark, kvb_err *err) {
    w->kvs.len = mark;
    free(w->keys[--w->n_kv]);
    return nomem(err);
}

/* Encodes a widened scalar in its stored width; INVALID if the value does not fit. */
static kvb_status encode_scalar(kvb_gguf_vtype t, const kvb_gguf_kv *kv, uint8_t out[8], kvb_err *err) {
    uint64_t u = kv->v.u64;
    int64_t s = kv->v.i64;
    bool fits = true;
    switch (t) {
    case KVB_GGUF_U8: fits = u <= UINT8_MAX; break;
    case KVB_GGUF_U16: fits = u <= UINT16_MAX; break;
    case KVB_GGUF_U32: fits = u <= UINT32_MAX; break;
    case KVB_GGUF_I8: fits = s >= INT8_MIN && s <= INT8_MAX; break;
    case KVB_GGUF_I16: fits = s >= INT16_MIN && s <= INT16_MAX; break;
    case KVB_GGUF_I32: fits = s >= INT32_MIN && s <= INT32_MAX; break;
    case KVB_GGUF_F32: fits = !isfinite(kv->v.f64) || fabs(kv->v.f64) <= FLT_MAX; break;
    default: break;
    }
    if (!fits) return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: value does not fit in %s", kvb_gguf_vtype_name(t));
    switch (t) {
    case KVB_GGUF_U8:
    case KVB_GGUF_U16:
    case KVB_GGUF_U32:
    case KVB_GGUF_U64: kvb_gguf_put_le64(out, u); break;
    case KVB_GGUF_I8:
    case KVB_GGUF_I16:
    case KVB_GGUF_I32:
    case KVB_GGUF_I64: kvb_gguf_put_le64(out, (uint64_t)s); break; /* two's complement, low bytes */
    case KVB_GGUF_BOOL: out[0] = kv->v.b ? 1 : 0; break;
    case KVB_GGUF_F32: {
        float f = (float)kv->v.f64;
        uint32_t bits;
        memcpy(&bits, &f, 4);
        kvb_gguf_put_le32(out, bits);
        break;
    }
    case KVB_GGUF_F64: {
        uint64_t bits;
        memcpy(&bits, &kv->v.f64, 8);
        kvb_gguf_put_le64(out, bits);
        break;
    }
    default:
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: %s is not a scalar type", kvb_gguf_vtype_name(t));
    }
    return KVB_OK;
}

static kvb_status add_widened_scalar(kvb_gguf_writer *w, const char *key, uint64_t key_len, kvb_gguf_vtype t,
                                     const kvb_gguf_kv *val, kvb_err *err) {
    uint8_t bytes[8] = {0};
    kvb_status st = encode_scalar(t, val, bytes, err);
    if (st != KVB_OK) return st;
    bool is_alignment = key_len == strlen(KVB_GGUF_ALIGNMENT_KEY) && memcmp(key, KVB_GGUF_ALIGNMENT_KEY, key_len) == 0;
    if (is_alignment && (st = check_alignment_kv(t, val->v.u64, err)) != KVB_OK) return st;
    size_t mark = w->kvs.len;
    if ((st = begin_kv(w, key, key_len, t, err)) != KVB_OK) return st;
    if (!buf_put(&w->kvs, bytes, kvb_gguf_vtype_size(t))) return rollback_kv(w, mark, err);
    if (is_alignment) w->alignment = val->v.u64;
    return KVB_OK;
}

/* Widens a C value of type t (as add_scalar takes it) into a kv's value union. */
static kvb_status widen_c_value(kvb_gguf_vtype t, const void *value, kvb_gguf_kv *kv, kvb_err *err) {
    switch (t) {
    case KVB_GGUF_U8: kv->v.u64 = *(const uint8_t *)value; break;
    case KVB_GGUF_U16: kv->v.u64 = *(const uint16_t *)value; break;
    case KVB_GGUF_U32: kv->v.u64 = *(const uint32_t *)value; break;
    case KVB_GGUF_U64: kv->v.u64 = *(const uint64_t *)value; break;
    case KVB_GGUF_I8: kv->v.i64 = *(const int8_t *)value; break;
    case KVB_GGUF_I16: kv->v.i64 = *(const int16_t *)value; break;
    case KVB_GGUF_I32: kv->v.i64 = *(const int32_t *)value; break;
    case KVB_GGUF_I64: kv->v.i64 = *(const int64_t *)value; break;
    case KVB_GGUF_F32: kv->v.f64 = *(const float *)value; break;
    case KVB_GGUF_F64: kv->v.f64 = *(const double *)value; break;
    case KVB_GGUF_BOOL: kv->v.b = *(const bool *)value; break;
    default:
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: %s is not a scalar type", kvb_gguf_vtype_name(t));
    }
    return KVB_OK;
}

kvb_status kvb_gguf_writer_add_scalar(kvb_gguf_writer *w, const char *key, kvb_gguf_vtype t, const void *value,
                                      kvb_err *err) {
    kvb_gguf_kv kv;
    memset(&kv, 0, sizeof kv);
    kvb_status st = widen_c_value(t, value, &kv, err);
    if (st != KVB_OK) return st;
    return add_widened_scalar(w, key, strlen(key), t, &kv, err);
}

kvb_status kvb_gguf_writer_add_u32(kvb_gguf_writer *w, const char *key, uint32_t v, kvb_err *err) {
    return kvb_gguf_writer_add_scalar(w, key, KVB_GGUF_U32, &v, err);
}
kvb_status kvb_gguf_writer_add_i32(kvb_gguf_writer *w, const char *key, int32_t v, kvb_err *err) {
    return kvb_gguf_writer_add_scalar(w, key, KVB_GGUF_I32, &v, err);
}
kvb_status kvb_gguf_writer_add_u64(kvb_gguf_writer *w, const char *key, uint64_t v, kvb_err *err) {
    return kvb_gguf_writer_add_scalar(w, key, KVB_GGUF_U64, &v, err);
}
kvb_status kvb_gguf_writer_add_f32(kvb_gguf_writer *w, const char *key, float v, kvb_err *err) {
    return kvb_gguf_writer_add_scalar(w, key, KVB_GGUF_F32, &v, err);
}
kvb_status kvb_gguf_writer_add_bool(kvb_gguf_writer *w, const char *key, bool v, kvb_err *err) {
    return kvb_gguf_writer_add_scalar(w, key, KVB_GGUF_BOOL, &v, err);
}

static kvb_status add_str_bytes(kvb_gguf_writer *w, const char *key, uint64_t key_len, const char *p, uint64_t len,
                                kvb_err *err) {
    size_t mark = w->kvs.len;
    kvb_status st = begin_kv(w, key, key_len, KVB_GGUF_STRING, err);
    if (st != KVB_OK) return st;
    return buf_str(&w->kvs, p, len) ? KVB_OK : rollback_kv(w, mark, err);
}

kvb_status kvb_gguf_writer_add_str(kvb_gguf_writer *w, const char *key, const char *v, kvb_err *err) {
    return add_str_bytes(w, key, strlen(key), v, strlen(v), err);
}

/* Element bytes must form a valid array of et: for BOOL every byte is 0 or 1. */
static kvb_status add_arr_bytes(kvb_gguf_writer *w, const char *key, uint64_t key_len, kvb_gguf_vtype et,
                                const void *data, uint64_t n, kvb_err *err) {
    size_t es = kvb_gguf_vtype_size(et);
    if (es == 0)
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: arrays of %s need %s",
                           kvb_gguf_vtype_name(et), et == KVB_GGUF_STRING ? "kvb_gguf_writer_add_arr_str" : "a scalar element type");
    uint64_t bytes;
    if (kvb_mul_overflow_u64(n, es, &bytes) || bytes > SIZE_MAX)
        return kvb_err_set(err, KVB_ERR_RANGE, "gguf writer: array of %" PRIu64 " elements is too large", n);
    if (et == KVB_GGUF_BOOL)
        for (uint64_t i = 0; i < n; i++)
            if (((const uint8_t *)data)[i] > 1)
                return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: bool array element %" PRIu64 " is not 0 or 1", i);
    size_t mark = w->kvs.len;
    kvb_status st = begin_kv(w, key, key_len, KVB_GGUF_ARRAY, err);
    if (st != KVB_OK) return st;
    if (!buf_u32(&w->kvs, (uint32_t)et) || !buf_u64(&w->kvs, n) || !buf_put(&w->kvs, data, (size_t)bytes))
        return rollback_kv(w, mark, err);
    return KVB_OK;
}

kvb_status kvb_gguf_writer_add_arr(kvb_gguf_writer *w, const char *key, kvb_gguf_vtype et, const void *data,
                                   uint64_t n, kvb_err *err) {
    return add_arr_bytes(w, key, strlen(key), et, data, n, err);
}

static kvb_status add_arr_str_views(kvb_gguf_writer *w, const char *key, uint64_t key_len, const kvb_gguf_str *strs,
                                    uint64_t n, kvb_err *err) {
    size_t mark = w->kvs.len;
    kvb_status st = begin_kv(w, key, key_len, KVB_GGUF_ARRAY, err);
    if (st != KVB_OK) return st;
    if (!buf_u32(&w->kvs, KVB_GGUF_STRING) || !buf_u64(&w->kvs, n)) return rollback_kv(w, mark, err);
    for (uint64_t i = 0; i < n; i++)
        if (!buf_str(&w->kvs, strs[i].ptr, strs[i].len)) return rollback_kv(w, mark, err);
    return KVB_OK;
}

kvb_status kvb_gguf_writer_add_arr_str(kvb_gguf_writer *w, const char *key, const kvb_gguf_str *strs, uint64_t n,
                                       kvb_err *err) {
    return add_arr_str_views(w, key, strlen(key), strs, n, err);
}

/* Copies an array of strings as its (len, bytes) records, walked as the reader validated them. */
static kvb_status copy_string_array(kvb_gguf_writer *w, const kvb_gguf_kv *kv, kvb_err *err) {
    size_t mark = w->kvs.len;
    kvb_status st = begin_kv(w, kv->key.ptr, kv->key.len, KVB_GGUF_ARRAY, err);
    if (st != KVB_OK) return st;
    if (!buf_u32(&w->kvs, KVB_GGUF_STRING) || !buf_u64(&w->kvs, kv->arr_len)) return rollback_kv(w, mark, err);
    const uint8_t *p = kv->arr_data;
    for (uint64_t i = 0; i < kv->arr_len; i++) {
        uint64_t len = kvb_gguf_le64(p);
        if (len > SIZE_MAX - 8 || !buf_put(&w->kvs, p, (size_t)(8 + len))) return rollback_kv(w, mark, err);
        p += 8 + len;
    }
    return KVB_OK;
}

kvb_status kvb_gguf_writer_copy_kv(kvb_gguf_writer *w, const kvb_gguf_kv *kv, kvb_err *err) {
    switch (kv->type) {
    case KVB_GGUF_STRING: return add_str_bytes(w, kv->key.ptr, kv->key.len, kv->str.ptr, kv->str.len, err);
    case KVB_GGUF_ARRAY:
        if (kv->arr_type == KVB_GGUF_STRING) return copy_string_array(w, kv, err);
        return add_arr_bytes(w, kv->key.ptr, kv->key.len, kv->arr_type, kv->arr_data, kv->arr_len, err);
    default: return add_widened_scalar(w, kv->key.ptr, kv->key.len, kv->type, kv, err);
    }
}

/* ---- tensors ----------------------------------------------------------------------------- */

static kvb_status check_tensor_name(const kvb_gguf_writer *w, const char *name, kvb_err *err) {
    uint64_t bad, len = strlen(name);
    const char *problem = kvb_gguf_name_problem(name, len, &bad);
    if (problem) return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: tensor name %s", problem);
    if (len >= KVB_GGUF_LLAMA_MAX_TENSOR_NAME)
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: tensor name '%s' is %" PRIu64
                           " bytes; llama.cpp accepts at most %u", name, len, KVB_GGUF_LLAMA_MAX_TENSOR_NAME - 1);
    for (uint64_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: duplicate tensor name '%s'", name);
    return KVB_OK;
}

/* Computes a tensor's byte size with the reader's checks; INVALID names the tensor. */
static kvb_status tensor_bytes(const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type, uint64_t *out,
                               kvb_err *err) {
    if (n_dims < 1 || n_dims > KVB_GGUF_MAX_DIMS)
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: tensor '%s' has %" PRIu32 " dims (must be 1 to %d)",
                           name, n_dims, KVB_GGUF_MAX_DIMS);
    const kvb_type_info *ti = kvb_type_get(type);
    if (!ti || ti->block_elems <= 0 || ti->block_bytes <= 0)
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: tensor '%s' has unknown type %" PRIu32, name, type);
    uint64_t elems = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] == 0 || ne[d] > (uint64_t)INT64_MAX)
            return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: tensor '%s' dimension %" PRIu32 " is %" PRIu64, name,
                               d, ne[d]);
        if (kvb_mul_overflow_u64(elems, ne[d], &elems) || elems > (uint64_t)INT64_MAX)
            return kvb_err_set(err, KVB_ERR_RANGE, "gguf writer: tensor '%s' element count overflows", name);
    }
    if (ne[0] % (uint64_t)ti->block_elems != 0)
        return kvb_err_set(err, KVB_ERR_INVALID,
                           "gguf writer: tensor '%s' row length %" PRIu64 " is not a multiple of the %s block size %d",
                           name, ne[0], ti->name, ti->block_elems);
    uint64_t bytes = ne[0] / (uint64_t)ti->block_elems;
    if (kvb_mul_overflow_u64(bytes, (uint64_t)ti->block_bytes, &bytes) ||
        kvb_mul_overflow_u64(bytes, elems / ne[0], &bytes))
        return kvb_err_set(err, KVB_ERR_RANGE, "gguf writer: tensor '%s' byte size overflows", name);
    *out = bytes;
    return KVB_OK;
}

kvb_status kvb_gguf_writer_add_tensor(kvb_gguf_writer *w, const char *name, uint32_t n_dims, const uint64_t *ne,
                                      uint32_t type, kvb_err *err) {
    if (w->header_written)
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: cannot add tensors after the header was written");
    uint64_t n_bytes = 0;
    kvb_status st = check_tensor_name(w, name, err);
    if (st == KVB_OK) st = tensor_bytes(name, n_dims, ne, type, &n_bytes, err);
    if (st != KVB_OK) return st;
    if (w->n_tensors == w->cap_tensors) {
        uint64_t ncap = w->cap_tensors ? w->cap_tensors * 2 : 64;
        writer_tensor *t = realloc(w->tensors, (size_t)ncap * sizeof *t);
        if (!t) return nomem(err);
        w->tensors = t;
        w->cap_tensors = ncap;
    }
    writer_tensor *t = &w->tensors[w->n_tensors];
    memset(t, 0, sizeof *t);
    if (!(t->name = strdup(name))) return nomem(err);
    t->n_dims = n_dims;
    for (uint32_t d = 0; d < KVB_GGUF_MAX_DIMS; d++) t->ne[d] = d < n_dims ? ne[d] : 1;
    t->type = type;
    t->n_bytes = n_bytes;
    w->n_tensors++;
    return KVB_OK;
}

uint64_t kvb_gguf_writer_tensor_bytes(const kvb_gguf_writer *w, uint64_t i) {
    return i < w->n_tensors ? w->tensors[i].n_bytes : 0;
}

/* ---- output ------------------------------------------------------------------------------ */

static kvb_status write_bytes(FILE *f, const void *p, size_t n, const char *what, kvb_err *err) {
    if (n && fwrite(p, 1, n, f) != n)
        return kvb_err_set(err, KVB_ERR_IO, "gguf writer: writing %s failed (%zu bytes)", what, n);
    return KVB_OK;
}

static kvb_status write_zeros(FILE *f, uint64_t n, kvb_err *err) {
    static const uint8_t zeros[256];
    while (n) {
        size_t k = n < sizeof zeros ? (size_t)n : sizeof zeros;
        kvb_status st = write_bytes(f, zeros, k, "padding", err);
        if (st != KVB_OK) return st;
        n -= k;
    }
    return KVB_OK;
}

/* Assigns each tensor its offset in the data section: back to back, each padded. */
static kvb_status lay_out_tensors(kvb_gguf_writer *w, kvb_err *err) {
    uint64_t off = 0;
    for (uint64_t i = 0; i < w->n_tensors; i++) {
        uint64_t padded;
        w->tensors[i].offset = off;
        if (!kvb_gguf_align_up(w->tensors[i].n_bytes, w->alignment, &padded) ||
            kvb_add_overflow_u64(off, padded, &off))
            return kvb_err_set(err, KVB_ERR_RANGE, "gguf writer: tensor data exceeds 2^64 bytes");
    }
    return KVB_OK;
}

static bool serialise_infos(const kvb_gguf_writer *w, byte_buf *b) {
    bool ok = buf_put(b, KVB_GGUF_MAGIC, 4) && buf_u32(b, KVB_GGUF_WRITE_VERSION) && buf_u64(b, w->n_tensors) &&
              buf_u64(b, w->n_kv) && buf_put(b, w->kvs.p, w->kvs.len);
    for (uint64_t i = 0; ok && i < w->n_tensors; i++) {
        const writer_tensor *t = &w->tensors[i];
        ok = buf_str(b, t->name, strlen(t->name)) && buf_u32(b, t->n_dims);
        for (uint32_t d = 0; ok && d < t->n_dims; d++) ok = buf_u64(b, t->ne[d]);
        ok = ok && buf_u32(b, t->type) && buf_u64(b, t->offset);
    }
    return ok;
}

kvb_status kvb_gguf_writer_write_header(kvb_gguf_writer *w, FILE *f, kvb_err *err) {
    if (w->header_written) return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: header already written");
    kvb_status st = lay_out_tensors(w, err);
    if (st != KVB_OK) return st;
    byte_buf b = {0};
    if (!serialise_infos(w, &b)) {
        free(b.p);
        return nomem(err);
    }
    uint64_t padded = 0;
    kvb_gguf_align_up(b.len, w->alignment, &padded); /* b.len is a size_t: cannot overflow */
    st = write_bytes(f, b.p, b.len, "the header", err);
    if (st == KVB_OK) st = write_zeros(f, padded - b.len, err);
    free(b.p);
    if (st == KVB_OK) w->header_written = true;
    return st;
}

kvb_status kvb_gguf_writer_write_tensor_data(kvb_gguf_writer *w, FILE *f, uint64_t i, const void *data,
                                             uint64_t size, kvb_err *err) {
    if (!w->header_written)
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: write the header before tensor data");
    if (i >= w->n_tensors)
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: tensor index %" PRIu64 " out of range (%" PRIu64
                           " tensors)", i, w->n_tensors);
    const writer_tensor *t = &w->tensors[i];
    if (i != w->next_tensor)
        return kvb_err_set(err, KVB_ERR_INVALID,
                           "gguf writer: tensor data must be written in order: expected #%" PRIu64 ", got #%" PRIu64
                           " '%s'", w->next_tensor, i, t->name);
    if (size != t->n_bytes || size > SIZE_MAX)
        return kvb_err_set(err, KVB_ERR_INVALID, "gguf writer: tensor '%s' needs %" PRIu64 " bytes, got %" PRIu64,
                           t->name, t->n_bytes, size);
    uint64_t padded = 0;
    kvb_gguf_align_up(size, w->alignment, &padded); /* checked by lay_out_tensors */
    kvb_status st = write_bytes(f, data, (size_t)size, "tensor data", err);
    if (st == KVB_OK) st = write_zeros(f, padded - size, err);
    if (st == KVB_OK) w->next_tensor++;
    return st;
}
