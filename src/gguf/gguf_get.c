/* gguf/gguf_get.c — typed getters over an open GGUF file's KVs. Integers convert between widths
 * and signedness when the stored value fits the requested type; floats come from F32 or F64;
 * strings are copied out NUL-terminated (a value with an embedded NUL is refused rather than
 * silently cut). Messages name the key and both types but not the file: callers prefix the path
 * (kvb_gguf_path) as they already do for their own context. */
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "kvb_gguf.h"

#define SHOWN_KEY_BYTES 128

static kvb_status missing(const char *key, kvb_err *err) {
    return kvb_err_set(err, KVB_ERR_NOT_FOUND, "key '%.*s' is missing", SHOWN_KEY_BYTES, key);
}

static kvb_status wrong_type(const char *key, const kvb_gguf_kv *kv, const char *want, kvb_err *err) {
    if (kv->type == KVB_GGUF_ARRAY)
        return kvb_err_set(err, KVB_ERR_FORMAT, "key '%.*s' is an array of %s, expected %s", SHOWN_KEY_BYTES, key,
                           kvb_gguf_vtype_name(kv->arr_type), want);
    return kvb_err_set(err, KVB_ERR_FORMAT, "key '%.*s' is a %s, expected %s", SHOWN_KEY_BYTES, key,
                       kvb_gguf_vtype_name(kv->type), want);
}

static bool is_unsigned(kvb_gguf_vtype t) {
    return t == KVB_GGUF_U8 || t == KVB_GGUF_U16 || t == KVB_GGUF_U32 || t == KVB_GGUF_U64;
}
static bool is_signed(kvb_gguf_vtype t) {
    return t == KVB_GGUF_I8 || t == KVB_GGUF_I16 || t == KVB_GGUF_I32 || t == KVB_GGUF_I64;
}

/* Any integer KV as a uint64_t no larger than max. */
static kvb_status get_unsigned(const kvb_gguf *g, const char *key, uint64_t max, const char *want, uint64_t *out,
                               kvb_err *err) {
    const kvb_gguf_kv *kv = kvb_gguf_find(g, key);
    if (!kv) return missing(key, err);
    uint64_t v;
    if (is_unsigned(kv->type)) {
        v = kv->v.u64;
    } else if (is_signed(kv->type)) {
        if (kv->v.i64 < 0)
            return kvb_err_set(err, KVB_ERR_FORMAT, "key '%.*s' is %" PRId64 " (%s), expected a non-negative %s",
                               SHOWN_KEY_BYTES, key, kv->v.i64, kvb_gguf_vtype_name(kv->type), want);
        v = (uint64_t)kv->v.i64;
    } else {
        return wrong_type(key, kv, want, err);
    }
    if (v > max)
        return kvb_err_set(err, KVB_ERR_FORMAT, "key '%.*s' is %" PRIu64 " (%s), which does not fit in a %s",
                           SHOWN_KEY_BYTES, key, v, kvb_gguf_vtype_name(kv->type), want);
    *out = v;
    return KVB_OK;
}

kvb_status kvb_gguf_get_u64(const kvb_gguf *g, const char *key, uint64_t *out, kvb_err *err) {
    return get_unsigned(g, key, UINT64_MAX, "u64", out, err);
}

kvb_status kvb_gguf_get_u32(const kvb_gguf *g, const char *key, uint32_t *out, kvb_err *err) {
    uint64_t v = 0;
    kvb_status st = get_unsigned(g, key, UINT32_MAX, "u32", &v, err);
    if (st == KVB_OK) *out = (uint32_t)v;
    return st;
}

kvb_status kvb_gguf_get_f32(const kvb_gguf *g, const char *key, float *out, kvb_err *err) {
    const kvb_gguf_kv *kv = kvb_gguf_find(g, key);
    if (!kv) return missing(key, err);
    if (kv->type != KVB_GGUF_F32 && kv->type != KVB_GGUF_F64) return wrong_type(key, kv, "f32", err);
    double d = kv->v.f64;
    if (isfinite(d) && fabs(d) > FLT_MAX)
        return kvb_err_set(err, KVB_ERR_FORMAT, "key '%.*s' is %g (f64), which does not fit in an f32", SHOWN_KEY_BYTES,
                           key, d);
    *out = (float)d;
    return KVB_OK;
}

kvb_status kvb_gguf_get_bool(const kvb_gguf *g, const char *key, bool *out, kvb_err *err) {
    const kvb_gguf_kv *kv = kvb_gguf_find(g, key);
    if (!kv) return missing(key, err);
    if (kv->type != KVB_GGUF_BOOL) return wrong_type(key, kv, "bool", err);
    *out = kv->v.b;
    return KVB_OK;
}

kvb_status kvb_gguf_get_str(const kvb_gguf *g, const char *key, char *buf, size_t cap, kvb_err *err) {
    const kvb_gguf_kv *kv = kvb_gguf_find(g, key);
    if (!kv) return missing(key, err);
    if (kv->type != KVB_GGUF_STRING) return wrong_type(key, kv, "string", err);
    if (memchr(kv->str.ptr, 0, (size_t)kv->str.len))
        return kvb_err_set(err, KVB_ERR_FORMAT, "key '%.*s': string value contains a NUL byte", SHOWN_KEY_BYTES, key);
    if (cap == 0 || kv->str.len > cap - 1)
        return kvb_err_set(err, KVB_ERR_RANGE, "key '%.*s': string value of %" PRIu64 " bytes does not fit in %zu",
                           SHOWN_KEY_BYTES, key, kv->str.len, cap);
    if (kv->str.len) memcpy(buf, kv->str.ptr, (size_t)kv->str.len);
    buf[kv->str.len] = 0;
    return KVB_OK;
}
