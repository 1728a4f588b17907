/* grammar/json_prefix.c — the JSON prefix recognizer (kvb_grammar.h): one switch per byte over
 * the lexical state, with the open containers as a bit stack. A number has no end byte of its
 * own: in a state where it could be complete, the first byte that cannot continue it ends it and
 * is then read as what follows a value. */
#include "kvb_grammar.h"

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
    J_NUM_MINUS, /* "-" */
    J_NUM_ZERO,  /* "0" (complete) */
    J_NUM_INT,   /* "12" (complete) */
    J_NUM_DOT,   /* "1." */
    J_NUM_FRAC,  /* "1.5" (complete) */
    J_NUM_E,     /* "1e" */
    J_NUM_ESIGN, /* "1e-" */
    J_NUM_EXP,   /* "1e5" (complete) */
    J_LIT,       /* in true/false/null (aux: literal * 8 + bytes matched) */
    J_DONE,      /* the object closed: nothing may follow */
};

#define STR_KEY 0x80

static const char *const literals[3] = {"true", "false", "null"};

void kvb_json_init(kvb_json_state *s) { *s = (kvb_json_state){.state = J_START}; }

bool kvb_json_complete(const kvb_json_state *s) { return s->state == J_DONE; }

static bool is_blank(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static bool is_hex(unsigned char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
static bool top_is_object(const kvb_json_state *s) { return (s->stack >> (s->depth - 1)) & 1; }

static bool open_container(kvb_json_state *s, bool object) {
    if (s->depth == KVB_JSON_MAX_DEPTH) return false;
    if (object) s->stack |= (uint64_t)1 << s->depth;
    else s->stack &= ~((uint64_t)1 << s->depth);
    s->depth++;
    s->state = object ? J_OBJ_FIRST : J_ARR_FIRST;
    return true;
}

static bool close_container(kvb_json_state *s, unsigned char c) {
    if (s->depth == 0 || top_is_object(s) != (c == '}')) return false;
    s->depth--;
    s->state = s->depth ? J_AFTER : J_DONE;
    return true;
}

/* The first byte of a value. */
static bool begin_value(kvb_json_state *s, unsigned char c) {
    switch (c) {
    case '{': return open_container(s, true);
    case '[': return open_container(s, false);
    case '"': s->state = J_STR; s->aux = 0; return true;
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
    if (s->state > J_START && s->state < J_STR && is_blank(c)) return blank(s); /* the reply starts at '{' */
    if (s->state < J_STR) s->ws_run = 0;
    switch (s->state) {
    case J_START: return c == '{' && open_container(s, true);
    case J_VALUE: return begin_value(s, c);
    case J_ARR_FIRST: return c == ']' ? close_container(s, c) : begin_value(s, c);
    case J_OBJ_FIRST:
        if (c == '}') return close_container(s, c);
        __attribute__((fallthrough)); /* a key */
    case J_OBJ_KEY:
        if (c != '"') return false;
        s->state = J_STR;
        s->aux = STR_KEY;
        return true;
    case J_COLON:
        if (c != ':') return false;
        s->state = J_VALUE;
        return true;
    case J_AFTER:
        if (c == ',') {
            s->state = top_is_object(s) ? J_OBJ_KEY : J_VALUE;
            return true;
        }
        return (c == '}' || c == ']') && close_container(s, c);
    case J_STR:
        if (c == '"') {
            s->state = s->aux & STR_KEY ? J_COLON : J_AFTER;
            return true;
        }
        if (c == '\\') s->state = J_STR_ESC;
        return c >= 0x20;
    case J_STR_ESC:
        if (c == 'u') {
            s->state = J_STR_U;
            s->aux &= STR_KEY;
            return true;
        }
        s->state = J_STR;
        return c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't';
    case J_STR_U:
        if (!is_hex(c)) return false;
        if ((++s->aux & 7) == 4) {
            s->state = J_STR;
            s->aux &= STR_KEY;
        }
        return true;
    case J_NUM_MINUS:
        if (c == '0') s->state = J_NUM_ZERO;
        else if (is_digit(c)) s->state = J_NUM_INT;
        else return false;
        return true;
    case J_NUM_INT:
        if (is_digit(c)) return true;
        __attribute__((fallthrough)); /* what may follow an integer */
    case J_NUM_ZERO:
        if (c == '.') { s->state = J_NUM_DOT; return true; }
        if (c == 'e' || c == 'E') { s->state = J_NUM_E; return true; }
        break; /* the number ended */
    case J_NUM_DOT:
        if (!is_digit(c)) return false;
        s->state = J_NUM_FRAC;
        return true;
    case J_NUM_FRAC:
        if (is_digit(c)) return true;
        if (c == 'e' || c == 'E') { s->state = J_NUM_E; return true; }
        break;
    case J_NUM_E:
        if (c == '+' || c == '-') { s->state = J_NUM_ESIGN; return true; }
        __attribute__((fallthrough));
    case J_NUM_ESIGN:
        if (!is_digit(c)) return false;
        s->state = J_NUM_EXP;
        return true;
    case J_NUM_EXP:
        if (is_digit(c)) return true;
        break;
    case J_LIT: {
        const char *lit = literals[s->aux / 8];
        const unsigned pos = s->aux % 8;
        if ((unsigned char)lit[pos] != c) return false;
        s->aux++;
        if (lit[pos + 1] == '\0') s->state = J_AFTER;
        return true;
    }
    default: return false; /* J_DONE */
    }
    /* a complete number ended at c: c is what follows the value */
    s->state = J_AFTER;
    return feed_byte(s, c);
}

bool kvb_json_feed(kvb_json_state *s, const char *bytes, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!feed_byte(s, (unsigned char)bytes[i])) return false;
    return true;
}
