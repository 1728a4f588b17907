/* gguf/gguf_internal.h — helpers shared by the GGUF reader and writer and by nothing else: the
 * little-endian byte codecs (the format is little-endian whatever the host), the one rule for
 * what a key or tensor name may contain (non-empty, well-formed UTF-8, no control characters;
 * shared so the writer can never produce a file the reader rejects), and the limits both sides
 * enforce. Not part of the module's contract. */
#ifndef KVB_GGUF_INTERNAL_H
#define KVB_GGUF_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "kvb_gguf.h"

#define KVB_GGUF_MAGIC "GGUF"
#define KVB_GGUF_WRITE_VERSION 3u
#define KVB_GGUF_MAX_ALIGNMENT (1u << 20)
#define KVB_GGUF_ALIGNMENT_KEY "general.alignment"
#define KVB_GGUF_MAX_NAME_BYTES 65535u /* keys and tensor names */
#define KVB_GGUF_LLAMA_MAX_TENSOR_NAME 64u /* llama.cpp (GGML_MAX_NAME) rejects names this long */

static inline uint16_t kvb_gguf_le16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t kvb_gguf_le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t kvb_gguf_le64(const uint8_t *p) {
    return (uint64_t)kvb_gguf_le32(p) | ((uint64_t)kvb_gguf_le32(p + 4) << 32);
}
static inline void kvb_gguf_put_le32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kvb_gguf_put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline bool kvb_gguf_is_pow2(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

/* Rounds v up to a multiple of the power of two a; false on overflow. */
static inline bool kvb_gguf_align_up(uint64_t v, uint64_t a, uint64_t *out) {
    uint64_t t;
    if (kvb_add_overflow_u64(v, a - 1, &t)) return false;
    *out = t & ~(a - 1);
    return true;
}

/* Length of the well-formed UTF-8 sequence at p[0..n) (1-4), or 0 if it is malformed: overlong
 * forms, surrogates and code points above U+10FFFF are malformed, as in RFC 3629. */
static inline int kvb_gguf_utf8_seq_len(const unsigned char *p, uint64_t n) {
    unsigned char c = p[0];
    if (c < 0x80) return 1;
    int len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
    if (len == 0 || c > 0xF4 || (uint64_t)len > n) return 0;
    for (int i = 1; i < len; i++)
        if ((p[i] & 0xC0) != 0x80) return 0;
    if (c == 0xE0 && p[1] < 0xA0) return 0; /* overlong */
    if (c == 0xED && p[1] > 0x9F) return 0; /* surrogate */
    if (c == 0xF0 && p[1] < 0x90) return 0; /* overlong */
    if (c == 0xF4 && p[1] > 0x8F) return 0; /* above U+10FFFF */
    return len;
}

/* What is wrong with a key or tensor name of len bytes at p, or NULL if it is acceptable:
 * non-empty, at most KVB_GGUF_MAX_NAME_BYTES, well-formed UTF-8 and no control characters
 * (0x00-0x1f, 0x7f), so names work as C strings and print safely. *bad_pos gets the index of
 * the offending byte. */
static inline const char *kvb_gguf_name_problem(const char *p, uint64_t len, uint64_t *bad_pos) {
    *bad_pos = 0;
    if (len == 0) return "is empty";
    if (len > KVB_GGUF_MAX_NAME_BYTES) return "is longer than 65535 bytes";
    const unsigned char *u = (const unsigned char *)p;
    for (uint64_t i = 0; i < len;) {
        *bad_pos = i;
        if (u[i] < 0x20 || u[i] == 0x7f) return "contains a control byte";
        int n = kvb_gguf_utf8_seq_len(u + i, len - i);
        if (n == 0) return "is not valid UTF-8";
        i += (uint64_t)n;
    }
    *bad_pos = 0;
    return NULL;
}

#endif
