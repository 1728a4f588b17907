/* gguf — GGUF v3 files: a reader that maps the file and treats every byte as hostile (each
 * count, length, type, dimension, offset and alignment is checked before use; errors name the
 * file and what is wrong), and a streaming writer that produces files llama.cpp loads. */
#ifndef KVB_GGUF_H
#define KVB_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvb_core.h"

/* GGUF metadata value types (the spec's numbers). */
typedef enum {
    KVB_GGUF_U8 = 0,
    KVB_GGUF_I8 = 1,
    KVB_GGUF_U16 = 2,
    KVB_GGUF_I16 = 3,
    KVB_GGUF_U32 = 4,
    KVB_GGUF_I32 = 5,
    KVB_GGUF_F32 = 6,
    KVB_GGUF_BOOL = 7,
    KVB_GGUF_STRING = 8,
    KVB_GGUF_ARRAY = 9,
    KVB_GGUF_U64 = 10,
    KVB_GGUF_I64 = 11,
    KVB_GGUF_F64 = 12,
} kvb_gguf_vtype;

#define KVB_GGUF_MAX_DIMS 4
#define KVB_GGUF_DEFAULT_ALIGNMENT 32

/* A string inside the mapped file: not NUL-terminated. */
typedef struct {
    const char *ptr;
    uint64_t len;
} kvb_gguf_str;

typedef struct {
    kvb_gguf_str key;
    kvb_gguf_vtype type;
    /* scalar value (for non-array, non-string types), widened */
    union {
        uint64_t u64;
        int64_t i64;
        double f64;
        bool b;
    } v;
    kvb_gguf_str str;          /* for STRING */
    kvb_gguf_vtype arr_type;   /* for ARRAY: element type (never ARRAY: nested arrays are rejected) */
    uint64_t arr_len;          /* for ARRAY */
    const uint8_t *arr_data;   /* for ARRAY of fixed-size elements: start of the packed data;
                                  for ARRAY of STRING: start of the first (len, bytes) record */
} kvb_gguf_kv;

typedef struct {
    kvb_gguf_str name;
    uint32_t n_dims;
    uint64_t ne[KVB_GGUF_MAX_DIMS]; /* ne[0] is the contiguous (row) dimension; unused dims = 1 */
    uint32_t type;                  /* kvb_type number */
    uint64_t offset;                /* relative to the data section, checked aligned */
    uint64_t n_bytes;               /* computed from type and dims, checked to lie in the file */
    const void *data;               /* pointer into the mapping */
} kvb_gguf_tensor;

typedef struct kvb_gguf kvb_gguf;

/* Opens and validates the whole file (header, every KV, every tensor info, data bounds).
 * Everything returned afterwards points into the read-only mapping and lives until close. */
kvb_status kvb_gguf_open(const char *path, kvb_gguf **out, kvb_err *err);
/* Same checks on a caller-owned memory buffer (used by the fuzzer); buf must outlive the handle. */
kvb_status kvb_gguf_open_memory(const void *buf, size_t size, const char *name, kvb_gguf **out,
                                kvb_err *err);
void kvb_gguf_close(kvb_gguf *g);
/* Maps every page of the file now (MADV_POPULATE_READ; one read per page on kernels before 5.14),
 * so that a later first pass over the tensors takes no page fault per page: a server calls it at
 * start rather than have its first request pay (~1.7 s for a 1.3 GB file on the development
 * machine). KVB_ERR_IO when the file cannot be read (a truncated file). A memory buffer: nothing. */
kvb_status kvb_gguf_prefault(const kvb_gguf *g, kvb_err *err);

const char *kvb_gguf_path(const kvb_gguf *g);
uint32_t kvb_gguf_version(const kvb_gguf *g);
uint64_t kvb_gguf_alignment(const kvb_gguf *g);
uint64_t kvb_gguf_file_size(const kvb_gguf *g);   /* bytes of the file or buffer */
uint64_t kvb_gguf_data_offset(const kvb_gguf *g); /* where the data section starts (aligned) */
uint64_t kvb_gguf_n_kv(const kvb_gguf *g);
const kvb_gguf_kv *kvb_gguf_kv_at(const kvb_gguf *g, uint64_t i);
const kvb_gguf_kv *kvb_gguf_find(const kvb_gguf *g, const char *key); /* NULL if absent */
uint64_t kvb_gguf_n_tensors(const kvb_gguf *g);
const kvb_gguf_tensor *kvb_gguf_tensor_at(const kvb_gguf *g, uint64_t i);
const kvb_gguf_tensor *kvb_gguf_find_tensor(const kvb_gguf *g, const char *name);

/* Typed getters: KVB_ERR_NOT_FOUND if absent, KVB_ERR_FORMAT (message names key and types) if
 * the stored type does not convert (integers convert between widths when the value fits). */
kvb_status kvb_gguf_get_u64(const kvb_gguf *g, const char *key, uint64_t *out, kvb_err *err);
kvb_status kvb_gguf_get_u32(const kvb_gguf *g, const char *key, uint32_t *out, kvb_err *err);
kvb_status kvb_gguf_get_f32(const kvb_gguf *g, const char *key, float *out, kvb_err *err); /* F32/F64 */
kvb_status kvb_gguf_get_bool(const kvb_gguf *g, const char *key, bool *out, kvb_err *err);
/* Copies a string value into buf (NUL-terminated); KVB_ERR_RANGE if it does not fit. */
kvb_status kvb_gguf_get_str(const kvb_gguf *g, const char *key, char *buf, size_t cap, kvb_err *err);
bool kvb_gguf_str_eq(kvb_gguf_str s, const char *cstr);

/* Array access. For an ARRAY of STRING, kvb_gguf_arr_strings fills out[0..arr_len) with views
 * (the caller allocates out); for numeric arrays read arr_data with the element type's size. */
kvb_status kvb_gguf_arr_strings(const kvb_gguf_kv *kv, kvb_gguf_str *out, kvb_err *err);
size_t kvb_gguf_vtype_size(kvb_gguf_vtype t); /* 0 for STRING/ARRAY/unknown */
const char *kvb_gguf_vtype_name(kvb_gguf_vtype t); /* "u8", "string", "array"...; "?" if unknown */

/* ---- writer ------------------------------------------------------------------------------
 * Usage: w = kvb_gguf_writer_create(); add KVs; add tensor infos (name, dims, type) in order;
 * kvb_gguf_writer_write_header(w, file) writes header+KVs+infos+padding; then write each tensor's
 * bytes in the same order with kvb_gguf_writer_write_tensor_data (it pads to the alignment).
 * Tensor data can thus be produced and streamed one tensor at a time. */
typedef struct kvb_gguf_writer kvb_gguf_writer;
kvb_status kvb_gguf_writer_create(kvb_gguf_writer **out, kvb_err *err);
void kvb_gguf_writer_destroy(kvb_gguf_writer *w);
kvb_status kvb_gguf_writer_add_u32(kvb_gguf_writer *w, const char *key, uint32_t v, kvb_err *err);
kvb_status kvb_gguf_writer_add_i32(kvb_gguf_writer *w, const char *key, int32_t v, kvb_err *err);
kvb_status kvb_gguf_writer_add_u64(kvb_gguf_writer *w, const char *key, uint64_t v, kvb_err *err);
kvb_status kvb_gguf_writer_add_f32(kvb_gguf_writer *w, const char *key, float v, kvb_err *err);
kvb_status kvb_gguf_writer_add_bool(kvb_gguf_writer *w, const char *key, bool v, kvb_err *err);
/* Any fixed-size scalar type: value points to the C type of t (uint8_t for U8, int64_t for I64,
 * double for F64, bool for BOOL...). */
kvb_status kvb_gguf_writer_add_scalar(kvb_gguf_writer *w, const char *key, kvb_gguf_vtype t,
                                      const void *value, kvb_err *err);
kvb_status kvb_gguf_writer_add_str(kvb_gguf_writer *w, const char *key, const char *v, kvb_err *err);
/* Arrays: elements of type et (fixed-size), n elements copied from data. */
kvb_status kvb_gguf_writer_add_arr(kvb_gguf_writer *w, const char *key, kvb_gguf_vtype et,
                                   const void *data, uint64_t n, kvb_err *err);
/* Array of strings given as (ptr, len) pairs (strings may contain NUL bytes). */
kvb_status kvb_gguf_writer_add_arr_str(kvb_gguf_writer *w, const char *key, const kvb_gguf_str *strs,
                                       uint64_t n, kvb_err *err);
/* Copies a KV from an open file verbatim (used to carry a vocabulary into a generated model). */
kvb_status kvb_gguf_writer_copy_kv(kvb_gguf_writer *w, const kvb_gguf_kv *kv, kvb_err *err);
kvb_status kvb_gguf_writer_add_tensor(kvb_gguf_writer *w, const char *name, uint32_t n_dims,
                                      const uint64_t *ne, uint32_t type, kvb_err *err);
/* f must be positioned at the start of the file (offsets and padding are counted from there). */
kvb_status kvb_gguf_writer_write_header(kvb_gguf_writer *w, FILE *f, kvb_err *err);
/* Writes tensor i's data (size must equal its computed byte size) and alignment padding. */
kvb_status kvb_gguf_writer_write_tensor_data(kvb_gguf_writer *w, FILE *f, uint64_t i, const void *data,
                                             uint64_t size, kvb_err *err);
uint64_t kvb_gguf_writer_tensor_bytes(const kvb_gguf_writer *w, uint64_t i);

#endif
