/* tokenizer/unicode.c — lookups into the generated Unicode tables, UTF-8 validation with the
 * maximal-subpart replacement rule (Unicode 3.9, Table 3-7: each maximal prefix of a well-formed
 * sequence, or a single bad byte, becomes one U+FFFD — what Python's errors='replace' does, so
 * byte input matches what the Hugging Face reference sees), and NFC normalization (full canonical
 * decomposition incl. Hangul, canonical reordering, canonical composition per UAX #15) used by
 * vocabularies whose tokenizer normalizes (Qwen2). A quick check skips all of it for text that
 * is already NFC (every code point below U+0300 or flagged safe), which is the hot path. */
#include "tok_unicode.h"

#include <stdlib.h>
#include <string.h>

static uint32_t range_lookup(const uint32_t *tab, size_t n, uint32_t cp) {
    /* last entry whose start <= cp; entry 0 starts at 0 */
    size_t lo = 0, hi = n;
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if ((tab[mid] >> 8) <= cp)
            lo = mid;
        else
            hi = mid;
    }
    return tab[lo] & 0xFF;
}

uint32_t kvb_u_flags_slow(uint32_t cp) {
    if (cp > 0x10FFFF) return 0;
    return range_lookup(kvb_u_flag_ranges, kvb_u_flag_ranges_n, cp);
}

uint32_t kvb_u_ccc(uint32_t cp) {
    if (cp < 0x300 || cp > 0x10FFFF) return 0;
    return range_lookup(kvb_u_ccc_ranges, kvb_u_ccc_ranges_n, cp);
}

size_t kvb_utf8_valid_len(const uint8_t *s, size_t n, size_t *bad) {
    uint8_t c = s[0];
    *bad = 1;
    if (c < 0x80) return 1;
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) {
        need = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else {
        return 0; /* 80..C1, F5..FF: never valid */
    }
    for (size_t i = 1; i < need; i++) {
        if (i >= n) {
            *bad = i;
            return 0;
        }
        uint8_t b = s[i];
        uint8_t l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
        if (b < l || b > h) {
            *bad = i;
            return 0;
        }
    }
    return need;
}

size_t kvb_u_encode(uint32_t cp, uint8_t *out) {
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

/* ---- NFC ------------------------------------------------------------------------------------- */

enum { SBASE = 0xAC00, LBASE = 0x1100, VBASE = 0x1161, TBASE = 0x11A7, LCOUNT = 19, VCOUNT = 21,
       TCOUNT = 28, NCOUNT = VCOUNT * TCOUNT, SCOUNT = LCOUNT * NCOUNT };

static const uint32_t *decomp_find(uint32_t cp) {
    size_t lo = 0, hi = kvb_u_decomp_n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        uint32_t c = kvb_u_decomp[mid][0] & 0x7FFFFFFFu;
        if (c == cp) return kvb_u_decomp[mid];
        if (c < cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static uint32_t compose_pair(uint32_t a, uint32_t b) {
    if (a >= LBASE && a < LBASE + LCOUNT && b >= VBASE && b < VBASE + VCOUNT)
        return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT;
    if (a >= SBASE && a < SBASE + SCOUNT && (a - SBASE) % TCOUNT == 0 && b > TBASE && b < TBASE + TCOUNT)
        return a + (b - TBASE);
    size_t lo = 0, hi = kvb_u_comp_n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const uint32_t *e = kvb_u_comp[mid];
        if (e[0] == a && e[1] == b) return e[2];
        if (e[0] < a || (e[0] == a && e[1] < b))
            lo = mid + 1;
        else
            hi = mid;
    }
    return 0;
}

/* Appends the full canonical decomposition of cp to buf (capacity checked by caller: at most
 * 4 code points per input code point, the Unicode maximum for canonical decompositions is 4). */
static size_t decompose(uint32_t cp, uint32_t *buf, int depth) {
    if (cp >= SBASE && cp < SBASE + SCOUNT) {
        uint32_t si = cp - SBASE;
        buf[0] = LBASE + si / NCOUNT;
        buf[1] = VBASE + (si % NCOUNT) / TCOUNT;
        uint32_t t = TBASE + si % TCOUNT;
        if (t == TBASE) return 2;
        buf[2] = t;
        return 3;
    }
    const uint32_t *d = depth < 8 ? decomp_find(cp) : NULL;
    if (!d) {
        buf[0] = cp;
        return 1;
    }
    size_t k = decompose(d[1], buf, depth + 1);
    if (d[2]) k += decompose(d[2], buf + k, depth + 1);
    return k;
}

static kvb_status nfc(const uint32_t *in, size_t n, uint32_t **out, size_t *out_n, kvb_err *err) {
    /* canonical decompositions expand a code point to at most 4 (e.g. U+1F82) */
    uint32_t *d = malloc((n * 4 + 1) * sizeof *d);
    uint8_t *cc = malloc(n * 4 + 1);
    if (!d || !cc) {
        free(d);
        free(cc);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory normalizing %zu code points", n);
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t tmp[16];
        size_t k = decompose(in[i], tmp, 0);
        if (k > 4) k = 4; /* cannot happen with real data; keeps the bound */
        for (size_t j = 0; j < k; j++) {
            d[m] = tmp[j];
            cc[m] = (uint8_t)kvb_u_ccc(tmp[j]);
            m++;
        }
    }
    /* canonical ordering: stable insertion sort of each run of non-starters by ccc */
    for (size_t i = 1; i < m; i++) {
        if (cc[i] == 0) continue;
        size_t j = i;
        while (j > 0 && cc[j - 1] > cc[j]) {
            uint32_t t = d[j];
            d[j] = d[j - 1];
            d[j - 1] = t;
            uint8_t tc = cc[j];
            cc[j] = cc[j - 1];
            cc[j - 1] = tc;
            j--;
        }
    }
    /* canonical composition */
    size_t w = 0;
    if (m > 0) {
        size_t starter = 0;
        int last_cc = cc[0] == 0 ? 0 : 256;
        w = 1;
        for (size_t i = 1; i < m; i++) {
            uint32_t ch = d[i];
            int c = cc[i];
            uint32_t comp = last_cc == 256 ? 0 : compose_pair(d[starter], ch);
            if (comp && (last_cc < c || last_cc == 0)) {
                d[starter] = comp;
                continue;
            }
            if (c == 0) starter = w;
            last_cc = c;
            d[w++] = ch;
        }
    }
    free(cc);
    *out = d;
    *out_n = w;
    return KVB_OK;
}

kvb_status kvb_u_clean(const uint8_t *s, size_t n, bool want_nfc, uint8_t **out, size_t *out_n,
                       kvb_err *err) {
    *out = NULL;
    *out_n = 0;
    /* pass 1: is the input already valid (and NFC-safe)? */
    bool valid = true, unsafe = false;
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t bad;
        size_t l = kvb_utf8_valid_len(s + i, n - i, &bad);
        if (!l) {
            valid = false;
            break;
        }
        if (want_nfc && !unsafe) {
            size_t dl;
            uint32_t cp = kvb_u_decode(s + i, n - i, &dl);
            if (cp >= 0x300 && (kvb_u_flags(cp) & KVB_U_NFC)) unsafe = true;
        }
        i += l;
    }
    if (valid && !unsafe) return KVB_OK;

    /* pass 2: decode to code points with replacement */
    uint32_t *cps = malloc((n + 1) * sizeof *cps);
    if (!cps) return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory cleaning %zu bytes of text", n);
    size_t m = 0;
    unsafe = false;
    for (i = 0; i < n;) {
        size_t bad;
        size_t l = kvb_utf8_valid_len(s + i, n - i, &bad);
        if (!l) {
            cps[m++] = 0xFFFD;
            i += bad;
            continue;
        }
        size_t dl;
        uint32_t cp = kvb_u_decode(s + i, n - i, &dl);
        if (cp >= 0x300 && (kvb_u_flags(cp) & KVB_U_NFC)) unsafe = true;
        cps[m++] = cp;
        i += l;
    }
    if (want_nfc && unsafe) {
        uint32_t *nc = NULL;
        size_t nn = 0;
        kvb_status st = nfc(cps, m, &nc, &nn, err);
        free(cps);
        if (st) return st;
        cps = nc;
        m = nn;
    }
    uint8_t *o = malloc(m * 4 + 1);
    if (!o) {
        free(cps);
        return kvb_err_set(err, KVB_ERR_NOMEM, "out of memory cleaning %zu bytes of text", n);
    }
    size_t w = 0;
    for (size_t k = 0; k < m; k++) w += kvb_u_encode(cps[k], o + w);
    free(cps);
    *out = o;
    *out_n = w;
    return KVB_OK;
}
