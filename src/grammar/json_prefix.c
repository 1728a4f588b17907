/* grammar/json_prefix.c — the JSON prefix recognizer (kvb_grammar.h): one switch per byte over
 * the structural state (where a value, a key, ':' or ',' may come), with the open containers as a
 * bit stack, and one shared lexer for what lies inside a token (strings and their escapes, numbers,
 * true/false/null). A schema, when there is one, is consulted at the structural points only: which
 * node a value is read under when it begins (by its first byte), how far an object or array has
 * got (its frame), and which property name or enum value is being written (candidates matched byte
 * by byte against their canonical text). A number has no end byte of its own: in a state where it
 * could be complete, the first byte that cannot continue it ends it and is then read as what
 * follows a value; a numeric enum value ends the same way. */
#include <string.h>

#include "grammar_internal.h"

enum {
    J_START = 0, /* before the object: '{' (a reply does not open with blanks) */
    J_VALUE,     /* a value must come (after ':' or an array's ',') */
    J_ARR_FIRST, /* after '[': a value or ']' */
    J_OBJ_FIRST, /* after '{': a key or '}' */
    J_OBJ_KEY,   /* after an object's ',': a key */
    J_COLON,     /* after a key */
    J_AFTER,     /* after a value inside a container: ',' or the closing bracket */
    J_STR,       /* in a string (aux & STR_KEY: a key) */
    J_STR_ESC,   /* after '\' in a string */
    J_STR_U,     /* in \uXXXX (aux & 7: hex digits read) */
    J_NUM_MINUS, /* "-" (aux & NUM_INT: an integer) */
    J_NUM_ZERO,  /* "0" (complete) */
    J_NUM_INT,   /* "12" (complete) */
    J_NUM_DOT,   /* "1." */
    J_NUM_FRAC,  /* "1.5" (complete) */
    J_NUM_E,     /* "1e" */
    J_NUM_ESIGN, /* "1e-" */
    J_NUM_EXP,   /* "1e5" (complete) */
    J_LIT,       /* in true/false/null (aux: literal * 8 + bytes matched) */
    J_KEY,       /* schema: in a declared property's name (cand, off) */
    J_ENUM,      /* schema: in an enum value (vnode, cand, off) */
    J_DONE,      /* the object closed: nothing may follow */
};

#define STR_KEY 0x80
#define NUM_INT 0x40 /* in a number */
/* in a string whose characters are counted (minLength/maxLength; vnode its node, off its count): */
#define STR_COUNT 0x40      /* it is counted */
#define STR_AFTER_HIGH 0x20 /* the last character was an escaped high surrogate (a low one may pair it) */
#define STR_U_LOW 0x10      /* the \u escape being read is a low surrogate (\uDC00-\uDFFF) */
#define STR_U_D 0x08        /* ... its first digit was d; from its second on: it is a high one (D800-DBFF) */

_Static_assert(sizeof(kvb_json_frame) == 4 && sizeof(kvb_json_state) == 32 + 4 * KVB_JSON_MAX_DEPTH,
               "kvb_json_state has no padding: states compare with memcmp");

static const char *const literals[3] = {"true", "false", "null"};

void kvb_json_init_schema(kvb_json_state *s, const kvb_json_schema *schema) {
    memset(s, 0, sizeof *s);
    s->state = J_START;
    s->schema = schema;
}

void kvb_json_init(kvb_json_state *s) { kvb_json_init_schema(s, NULL); }

bool kvb_json_complete(const kvb_json_state *s) { return s->state == J_DONE; }

static bool is_blank(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static bool is_hex(unsigned char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
static bool top_is_object(const kvb_json_state *s) { return (s->stack >> (s->depth - 1)) & 1; }

/* ---- the lexer: inside a string, a number or a literal (J_STR .. J_LIT) --------------------- */

typedef enum {
    LEX_MORE,         /* c taken; the token goes on */
    LEX_END,          /* c taken and it ended the token (a string's closing quote, a literal's last byte) */
    LEX_ENDED_BEFORE, /* a complete number ended before c: c is what follows it */
    LEX_BAD,          /* c cannot come here */
} lex_step;

static lex_step lex_byte(kvb_json_state *s, unsigned char c) {
    switch (s->state) {
    case J_STR:
        if (c == '"') return LEX_END;
        if (c == '\\') s->state = J_STR_ESC;
        return c >= 0x20 ? LEX_MORE : LEX_BAD;
    case J_STR_ESC:
        if (c == 'u') {
            s->state = J_STR_U;
            s->aux &= (uint8_t)~7u; /* the digits read; the string's flags stay */
            return LEX_MORE;
        }
        s->state = J_STR;
        return c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't'
                   ? LEX_MORE : LEX_BAD;
    case J_STR_U:
        if (!is_hex(c)) return LEX_BAD;
        if ((++s->aux & 7) == 4) {
            s->state = J_STR;
            s->aux &= (uint8_t)~7u;
        }
        return LEX_MORE;
    case J_NUM_MINUS:
        if (c == '0') s->state = J_NUM_ZERO;
        else if (is_digit(c)) s->state = J_NUM_INT;
        else return LEX_BAD;
        return LEX_MORE;
    case J_NUM_INT:
        if (is_digit(c)) return LEX_MORE;
        __attribute__((fallthrough)); /* what may follow an integer */
    case J_NUM_ZERO:
        if (s->aux & NUM_INT) return LEX_ENDED_BEFORE; /* no fraction, no exponent */
        if (c == '.') { s->state = J_NUM_DOT; return LEX_MORE; }
        if (c == 'e' || c == 'E') { s->state = J_NUM_E; return LEX_MORE; }
        return LEX_ENDED_BEFORE;
    case J_NUM_DOT:
        if (!is_digit(c)) return LEX_BAD;
        s->state = J_NUM_FRAC;
        return LEX_MORE;
    case J_NUM_FRAC:
        if (is_digit(c)) return LEX_MORE;
        if (c == 'e' || c == 'E') { s->state = J_NUM_E; return LEX_MORE; }
        return LEX_ENDED_BEFORE;
    case J_NUM_E:
        if (c == '+' || c == '-') { s->state = J_NUM_ESIGN; return LEX_MORE; }
        __attribute__((fallthrough));
    case J_NUM_ESIGN:
        if (!is_digit(c)) return LEX_BAD;
        s->state = J_NUM_EXP;
        return LEX_MORE;
    case J_NUM_EXP: return is_digit(c) ? LEX_MORE : LEX_ENDED_BEFORE;
    case J_LIT: {
        const char *lit = literals[s->aux / 8];
        const unsigned pos = s->aux % 8;
        if ((unsigned char)lit[pos] != c) return LEX_BAD;
        s->aux++;
        return lit[pos + 1] == '\0' ? LEX_END : LEX_MORE;
    }
    default: return LEX_BAD;
    }
}

/* ---- the schema's view ---------------------------------------------------------------------- */

static const js_node *node_at(const kvb_json_state *s, uint16_t i) { return &s->schema->nodes[i]; }
static kvb_json_frame *top(kvb_json_state *s) { return &s->frame[s->depth - 1]; }

/* The candidates among texts[cand bits] whose byte at off is c. */
static uint64_t narrow(const kvb_json_schema *sch, const js_text *texts, uint64_t cand, uint16_t off, unsigned char c) {
    uint64_t next = 0;
    for (uint64_t rest = cand; rest; rest &= rest - 1) {
        const int i = __builtin_ctzll(rest);
        if (texts[i].len > off && (unsigned char)sch->text[texts[i].off + off] == c) next |= (uint64_t)1 << i;
    }
    return next;
}

/* The candidates that are whole after off bytes. */
static uint64_t whole(const js_text *texts, uint64_t cand, uint16_t off) {
    uint64_t done = 0;
    for (uint64_t rest = cand; rest; rest &= rest - 1) {
        const int i = __builtin_ctzll(rest);
        if (texts[i].len == off) done |= (uint64_t)1 << i;
    }
    return done;
}

/* Declared properties at or after `from` that some required one does not stand before. */
static bool required_from(const js_node *n, unsigned from) { return from < 64 && (n->required >> from) != 0; }

/* The properties the next key may be: from the frame's count up to the first required one. */
static uint64_t key_window(const js_node *n, unsigned from) {
    const uint64_t at_or_after = ~(uint64_t)0 << from; /* from < n_props <= 64 */
    const uint64_t req = n->required & at_or_after;
    const unsigned last = req ? (unsigned)__builtin_ctzll(req) : n->n_props - 1u;
    const uint64_t upto = last == 63 ? ~(uint64_t)0 : ((uint64_t)1 << (last + 1)) - 1;
    return at_or_after & upto;
}

/* A counted string's character (J_STR .. J_STR_U, before the lexer reads c): JSON Schema counts
 * code points, so a UTF-8 character counts at its first byte, an escape when it is complete, and a
 * low surrogate's escape right after a high one's counts nothing (the pair is one). False when c
 * would pass maxLength, or close the string short of minLength. Once the count is at maxLength only
 * the closing quote, or the escape of a low surrogate that completes a pair, may come: refused at
 * its first byte that cannot be that, so an accepted prefix can always be finished. */
static bool count_char(kvb_json_state *s, unsigned char c) {
    const js_node *n = node_at(s, s->vnode);
    const bool full = n->has_max_len && s->off >= n->max_len;
    const bool pairs = s->aux & STR_AFTER_HIGH;
    switch (s->state) {
    case J_STR:
        if (c == '"') return s->off >= n->min_len;
        if (c == '\\') return !full || pairs;
        if ((c & 0xC0) == 0x80) return true; /* a UTF-8 continuation byte: its character is counted */
        break;
    case J_STR_ESC:
        if (c == 'u') return true; /* counted when its digits are read */
        break;
    default: { /* J_STR_U: hex digit (aux & 7) */
        const unsigned d = s->aux & 7u;
        if (d == 0) {
            const bool dd = c == 'd' || c == 'D';
            if (dd) s->aux |= STR_U_D;
            return !full || (pairs && dd); /* full: only a low surrogate that pairs may come */
        }
        if (d == 1) {
            const bool dd = s->aux & STR_U_D;
            s->aux &= (uint8_t)~STR_U_D;
            if (dd && ((c >= '8' && c <= '9') || (c >= 'a' && c <= 'b') || (c >= 'A' && c <= 'B'))) s->aux |= STR_U_D;
            if (dd && ((c >= 'c' && c <= 'f') || (c >= 'C' && c <= 'F'))) s->aux |= STR_U_LOW;
            return !full || (pairs && (s->aux & STR_U_LOW));
        }
        if (d < 3 || !is_hex(c)) return true; /* (a wrong digit: the lexer refuses it) */
        const bool pair_end = pairs && (s->aux & STR_U_LOW), high = s->aux & STR_U_D;
        s->aux &= (uint8_t)~(STR_U_D | STR_U_LOW | STR_AFTER_HIGH);
        if (high) s->aux |= STR_AFTER_HIGH;
        if (pair_end) return true;
        if (full) return false;
        s->off++;
        return true;
    }
    }
    if (full) return false; /* a character begins: a raw one, or a one-letter escape */
    s->off++;
    s->aux &= (uint8_t)~STR_AFTER_HIGH;
    return true;
}

void json_state_mask_key(const kvb_json_state *s, uint32_t max_token_bytes, kvb_json_state *key) {
    *key = *s;
    if (s->state < J_STR || s->state > J_STR_U || !(s->aux & STR_COUNT)) return;
    /* a token adds at most max_token_bytes characters: at T or more from a bound it cannot reach it */
    const uint32_t T = max_token_bytes + 1u, off = s->off;
    const js_node *n = node_at(s, s->vnode);
    if (off >= n->min_len) { /* may close; moved to min_len, which stays as far from maxLength */
        if (!n->has_max_len || n->max_len - off >= T) key->off = n->min_len;
    } else if (n->min_len - off >= T) /* may not close within a token; maxLength is farther still */
        key->off = (uint16_t)(n->min_len - T);
}

/* ---- the structure ---------------------------------------------------------------------------- */

/* A value ended: ',' or a closing bracket may come. */
static void value_done(kvb_json_state *s) {
    s->state = J_AFTER;
    s->aux = 0;
    s->vnode = 0;
    s->off = 0;
    s->cand = 0;
}

static bool open_container(kvb_json_state *s, bool object, uint16_t node) {
    if (s->depth == KVB_JSON_MAX_DEPTH) return false;
    if (object) s->stack |= (uint64_t)1 << s->depth;
    else s->stack &= ~((uint64_t)1 << s->depth);
    if (s->schema) s->frame[s->depth] = (kvb_json_frame){.node = node};
    s->depth++;
    s->state = object ? J_OBJ_FIRST : J_ARR_FIRST;
    s->aux = 0;
    s->vnode = 0;
    return true;
}

static bool close_container(kvb_json_state *s, unsigned char c) {
    if (s->depth == 0 || top_is_object(s) != (c == '}')) return false;
    if (s->schema) {
        kvb_json_frame *f = top(s);
        const js_node *n = node_at(s, f->node);
        if (c == '}' ? required_from(n, f->count) : f->count < n->min_items) return false;
        *f = (kvb_json_frame){0};
    }
    s->depth--;
    value_done(s);
    if (!s->depth) s->state = J_DONE;
    return true;
}

static int value_class(unsigned char c) {
    switch (c) {
    case '{': return JC_OBJ;
    case '[': return JC_ARR;
    case '"': return JC_STR;
    case 't': return JC_TRUE;
    case 'f': return JC_FALSE;
    case 'n': return JC_NULL;
    default: return c == '-' || is_digit(c) ? JC_NUM : -1;
    }
}

/* A byte of an enum value (J_ENUM): the values it may still be narrowed to those that go on with c. */
static bool feed_byte(kvb_json_state *s, unsigned char c);
static bool enum_byte(kvb_json_state *s, unsigned char c) {
    const js_text *values = &s->schema->values[node_at(s, s->vnode)->values];
    const uint64_t next = narrow(s->schema, values, s->cand, s->off, c);
    if (!next) {
        if (!whole(values, s->cand, s->off)) return false;
        value_done(s); /* a numeric value ended at c */
        return feed_byte(s, c);
    }
    s->cand = next;
    s->off++;
    if (whole(values, next, s->off) == next) value_done(s); /* nothing longer can follow */
    return true;
}

/* A byte of a declared property's name (J_KEY, from its opening quote on). */
static bool key_byte(kvb_json_state *s, unsigned char c) {
    kvb_json_frame *f = top(s);
    const js_node *n = node_at(s, f->node);
    const js_text *keys = &s->schema->prop_key[n->props];
    const uint64_t next = narrow(s->schema, keys, s->cand, s->off, c);
    if (!next) return false;
    s->cand = next;
    s->off++;
    const uint64_t done = c == '"' ? whole(keys, next, s->off) : 0; /* names differ: one at most */
    if (done) {
        const unsigned p = (unsigned)__builtin_ctzll(done);
        f->count = (uint8_t)(p + 1);
        s->vnode = s->schema->prop_node[n->props + p];
        s->state = J_COLON;
        s->cand = 0;
        s->off = 0;
    }
    return true;
}

/* A key's opening quote. */
static bool begin_key(kvb_json_state *s) {
    const js_node *n = s->schema ? node_at(s, top(s)->node) : NULL;
    if (!n || !n->closed) { /* any key; its value any value */
        s->state = J_STR;
        s->aux = STR_KEY;
        return true;
    }
    if (top(s)->count >= n->n_props) return false;
    s->cand = key_window(n, top(s)->count);
    s->off = 1; /* every name begins with its quote */
    s->state = J_KEY;
    return true;
}

/* One more item in the array on top: false when maxItems has been reached. */
static bool count_item(kvb_json_state *s) {
    kvb_json_frame *f = top(s);
    const js_node *n = node_at(s, f->node);
    if (n->has_max && f->count >= n->max_items) return false;
    if (f->count < n->item_cap) f->count++;
    return true;
}

/* After a value in the container on top: whether ',' may come (another member or item fits). */
static bool may_continue(kvb_json_state *s) {
    if (!s->schema) return true;
    const kvb_json_frame *f = top(s);
    const js_node *n = node_at(s, f->node);
    if (top_is_object(s)) return !n->closed || f->count < n->n_props;
    return !n->has_max || f->count < n->max_items;
}

/* The first byte of a value. */
static bool begin_value(kvb_json_state *s, unsigned char c) {
    uint16_t at = 0;
    s->aux = 0;
    if (s->schema) {
        const int cls = value_class(c);
        if (cls < 0) return false;
        const bool item = s->depth && !top_is_object(s);
        at = node_at(s, item ? node_at(s, top(s)->node)->items : s->vnode)->first[cls];
        if (at == JS_NONE || (item && !count_item(s))) return false;
        const js_node *n = node_at(s, at);
        if (n->kind == JS_ENUM) {
            s->state = J_ENUM;
            s->vnode = at;
            s->cand = n->n_values == 64 ? ~(uint64_t)0 : ((uint64_t)1 << n->n_values) - 1;
            s->off = 0;
            return enum_byte(s, c);
        }
        if (n->integer && cls == JC_NUM) s->aux = NUM_INT;
        if (n->counted && cls == JC_STR) {
            s->aux = STR_COUNT;
            s->vnode = at;
            s->off = 0;
        }
    }
    switch (c) {
    case '{': return open_container(s, true, at);
    case '[': return open_container(s, false, at);
    case '"': s->state = J_STR; return true;
    case '-': s->state = J_NUM_MINUS; return true;
    case '0': s->state = J_NUM_ZERO; return true;
    case 't': s->state = J_LIT; s->aux = 0 * 8 + 1; return true;
    case 'f': s->state = J_LIT; s->aux = 1 * 8 + 1; return true;
    case 'n': s->state = J_LIT; s->aux = 2 * 8 + 1; return true;
    default:
        if (c >= '1' && c <= '9') { s->state = J_NUM_INT; return true; }
        return false;
    }
}

/* Blanks between tokens, at most KVB_JSON_MAX_WS in a row. */
static bool blank(kvb_json_state *s) { return ++s->ws_run <= KVB_JSON_MAX_WS; }

static bool feed_byte(kvb_json_state *s, unsigned char c) {
    if (s->state >= J_STR && s->state <= J_LIT) goto lex; /* inside a token: the common case first */
    if (s->state > J_START && s->state < J_STR && is_blank(c)) return blank(s); /* the reply starts at '{' */
    if (s->state < J_STR) s->ws_run = 0;
    switch (s->state) {
    case J_START: return c == '{' && open_container(s, true, s->schema ? s->schema->root : 0);
    case J_VALUE: return begin_value(s, c);
    case J_ARR_FIRST: return c == ']' ? close_container(s, c) : begin_value(s, c);
    case J_OBJ_FIRST:
        if (c == '}') return close_container(s, c);
        __attribute__((fallthrough)); /* a key */
    case J_OBJ_KEY: return c == '"' && begin_key(s);
    case J_COLON:
        if (c != ':') return false;
        s->state = J_VALUE;
        return true;
    case J_AFTER:
        if (c == ',') {
            if (!may_continue(s)) return false;
            s->state = top_is_object(s) ? J_OBJ_KEY : J_VALUE;
            return true;
        }
        return (c == '}' || c == ']') && close_container(s, c);
    case J_KEY: return key_byte(s, c);
    case J_ENUM: return enum_byte(s, c);
    case J_DONE: return false;
    default: break; /* in a string, a number or a literal */
    }
lex:
    if (s->state <= J_STR_U && (s->aux & STR_COUNT) && !count_char(s, c)) return false;
    switch (lex_byte(s, c)) {
    case LEX_MORE: return true;
    case LEX_END:
        if (s->aux & STR_KEY) { /* a key of an object with any keys: its value is any value */
            s->state = J_COLON;
            s->aux = 0;
            s->vnode = JS_ANY;
        } else
            value_done(s);
        return true;
    case LEX_ENDED_BEFORE: /* a complete number ended at c: c is what follows the value */
        value_done(s);
        return feed_byte(s, c);
    default: return false;
    }
}

bool kvb_json_feed(kvb_json_state *s, const char *bytes, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!feed_byte(s, (unsigned char)bytes[i])) return false;
    return true;
}
