/* grammar_internal.h — shared inside src/grammar only: a compiled JSON schema as the recognizer
 * reads it (json_schema.c builds it, json_prefix.c walks it). A schema is a table of nodes, each a
 * value's constraint; node 0 is "any JSON value". A node says, for each way a value can begin (its
 * first byte's class: '{', '[', '"', a digit or '-', 't', 'f', 'n'), which node that value is
 * then read under: itself, one of its anyOf alternatives, or none (the value may not begin so).
 * Property names and enum values are kept as the exact bytes the reply must write (their
 * canonical JSON text, quotes included) in one text pool. */
#ifndef KVB_GRAMMAR_INTERNAL_H
#define KVB_GRAMMAR_INTERNAL_H

#include <stddef.h>

#include "kvb_grammar.h"

enum { JC_OBJ = 0, JC_ARR, JC_STR, JC_NUM, JC_TRUE, JC_FALSE, JC_NULL, JC_N }; /* a value's first byte */
#define JS_NONE 0xFFFF /* first[]: a value may not begin with this class here */
#define JS_ANY 0       /* the node of "any JSON value" */

enum { JS_PLAIN = 0, JS_ENUM, JS_ANYOF };

typedef struct {
    uint16_t first[JC_N]; /* the node a value beginning with each class is read under, or JS_NONE */
    uint8_t kind;         /* JS_PLAIN, JS_ENUM (values) or JS_ANYOF (first[] points into its alternatives) */
    bool integer;         /* a number is an integer: no fraction, no exponent */
    bool closed;          /* object: only its declared properties, in their order (else any keys, any values) */
    bool has_max;         /* array: max_items applies */
    uint8_t n_props;      /* object: declared properties (<= KVB_JSON_SCHEMA_MAX_PROPS) */
    uint8_t min_items, max_items;
    uint8_t item_cap;     /* array: items are counted up to this (max_items, or min_items without one) */
    bool counted;         /* string: minLength or maxLength given (its characters are counted) */
    bool has_max_len;     /* string: max_len applies */
    uint16_t min_len, max_len; /* string: characters (code points, an escape or a surrogate pair one) */
    uint16_t items;       /* array: its items' node */
    uint8_t n_values;     /* enum: values (<= KVB_JSON_SCHEMA_MAX_ENUM) */
    uint32_t props;       /* object: its first property in prop_key / prop_node */
    uint32_t values;      /* enum: its first value in values */
    uint64_t required;    /* object: bit i: declared property i must appear */
} js_node;

typedef struct {
    uint32_t off;  /* in text */
    uint16_t len;
} js_text;

struct kvb_json_schema {
    js_node *nodes;       /* (n_nodes) node 0: any value */
    uint32_t n_nodes;
    js_text *prop_key;    /* (n_props) a property's name as the reply writes it: "name" */
    uint16_t *prop_node;  /* (n_props) its value's node */
    uint32_t n_props;
    js_text *values;      /* (n_values) enum and const values as the reply writes them */
    uint32_t n_values;
    char *text;           /* (n_text) the pool js_text points into */
    uint32_t n_text;
    uint16_t root;        /* the reply's object's node */
};

/* A state that every token of at most max_token_bytes bytes continues exactly as it continues s
 * (json_prefix.c): s itself, except inside a string counted for minLength/maxLength whose count
 * is far enough from both bounds that no such token can reach them. There the count is moved to
 * one value per node, so the masker's cache meets one state step after step, as in an uncounted
 * string. */
void json_state_mask_key(const kvb_json_state *s, uint32_t max_token_bytes, kvb_json_state *key);

/* The bytes of s a copy must take to go on feeding it: the frames above its depth are never read. */
static inline size_t json_state_live_bytes(const kvb_json_state *s) {
    return offsetof(kvb_json_state, frame) + (s->schema ? s->depth : 0) * sizeof(kvb_json_frame);
}

#endif
