/* tokenizer/tok_unicode.h — internal Unicode helpers for the tokenizer: the generated range tables
 * (unicode_tables.c), character-class lookup for the pre-tokenizers, UTF-8 decoding/encoding,
 * and "cleaning" arbitrary input bytes into valid UTF-8 (ill-formed sequences become U+FFFD by
 * the Unicode "maximal subpart" rule, the same as Python's errors='replace' and WHATWG) with
 * optional NFC normalization. Not part of the public contract. */
#ifndef KVB_TOK_UNICODE_H
#define KVB_TOK_UNICODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_tokenizer.h"

#define KVB_U_L 1u   /* \p{L} */
#define KVB_U_N 2u   /* \p{N} */
#define KVB_U_P 4u   /* \p{P} */
#define KVB_U_WS 8u  /* White_Space (regex \s) */
#define KVB_U_NFC 16u /* may change under NFC (quick-check "not yes" or ccc != 0) */

extern const char kvb_u_version[];
extern const uint32_t kvb_u_flag_ranges[];
extern const size_t kvb_u_flag_ranges_n;
extern const uint32_t kvb_u_ccc_ranges[];
extern const size_t kvb_u_ccc_ranges_n;
extern const uint32_t kvb_u_decomp[][3];
extern const size_t kvb_u_decomp_n;
extern const uint32_t kvb_u_comp[][3];
extern const size_t kvb_u_comp_n;
extern const uint8_t kvb_u_flags_latin1[256];

uint32_t kvb_u_flags_slow(uint32_t cp);
static inline uint32_t kvb_u_flags(uint32_t cp) {
    return cp < 256 ? kvb_u_flags_latin1[cp] : kvb_u_flags_slow(cp);
}
uint32_t kvb_u_ccc(uint32_t cp);

/* Decodes one code point from VALID UTF-8 at s (n > 0 bytes available); *len gets 1..4. */
static inline uint32_t kvb_u_decode(const uint8_t *s, size_t n, size_t *len) {
    uint8_t c = s[0];
    if (c < 0x80 || n < 2) {
        *len = 1;
        return c;
    }
    if (c < 0xE0) {
        *len = 2;
        return ((uint32_t)(c & 0x1F) << 6) | (s[1] & 0x3F);
    }
    if (c < 0xF0 || n < 4) {
        if (n < 3) {
            *len = 1;
            return c;
        }
        *len = 3;
        return ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    }
    *len = 4;
    return ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
           ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
}

/* kvb_utf8_valid_len (kvb_tokenizer.h) is this module's UTF-8 check too. */

/* Writes cp as UTF-8 (cp must be a scalar value); returns 1..4. */
size_t kvb_u_encode(uint32_t cp, uint8_t *out);

/* Makes s[0..n) valid UTF-8, NFC-normalized when nfc. When nothing needs to change, *out is
 * NULL (use the input); otherwise *out is malloc'd with *out_n bytes (caller frees). */
kvb_status kvb_u_clean(const uint8_t *s, size_t n, bool nfc, uint8_t **out, size_t *out_n,
                       kvb_err *err);

#endif
