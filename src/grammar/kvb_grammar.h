/* grammar — constrained decoding for OpenAI's response_format {"type": "json_object"} and
 * {"type": "json_schema"}: a JSON prefix recognizer and the vocabulary mask it implies at each step.
 * The recognizer reads a reply byte by byte (a pushdown automaton: the containers open so far as a
 * bit stack, the lexical state beside it) and accepts exactly the prefixes of RFC 8259 texts whose
 * value is an object, starting at its '{' (no blanks before it), nested at most KVB_JSON_MAX_DEPTH
 * deep, with runs of whitespace of at most KVB_JSON_MAX_WS bytes (a model cannot stall in blanks).
 * The mask allows a token when every byte it stands for keeps the reply such a prefix; a token that
 * is not text (a control token) only when it ends generation and the object is complete. Strings
 * are checked as JSON strings (escapes, no control bytes); bytes >= 0x80 inside them are passed
 * through (a token may hold part of a character).
 *
 * With a compiled JSON schema (kvb_json_init_schema) the object must also be valid under it; the
 * strings, numbers, literals and blanks are read by the same lexer, the schema adds a frame per
 * open container (its node, its progress). The subset, compiled once per request (anything else is
 * refused with a message naming the keyword and its path in the schema):
 *   - type: "object", "array", "string", "number", "integer", "boolean", "null", or an array of
 *     them; absent: any type. A schema with no constraining keyword ({}) is any JSON value. The
 *     root must be {"type": "object"} (as OpenAI's structured outputs require).
 *   - object: properties, required, additionalProperties true or false. With properties (or
 *     additionalProperties false) the object holds only its declared properties, written in the
 *     schema's declared order (as OpenAI's strict mode emits them), each at most once; one not in
 *     required may be left out; additionalProperties true or absent then adds no extra keys (a
 *     closed object either way). With neither properties nor additionalProperties false: any
 *     keys, any values. At most KVB_JSON_SCHEMA_MAX_PROPS properties; required names must be declared.
 *   - array: items (one schema; absent: any values), minItems, maxItems (at most
 *     KVB_JSON_SCHEMA_MAX_ITEMS, minItems <= maxItems).
 *   - string: any JSON string; minLength, maxLength (at most KVB_JSON_SCHEMA_MAX_LENGTH) count its
 *     characters as JSON Schema does, in code points: a UTF-8 character, an escape, or an escaped
 *     surrogate pair ("\ud83d\ude00") is one. number: JSON's number grammar; integer: the same
 *     without fraction or exponent.
 *   - enum (at most KVB_JSON_SCHEMA_MAX_ENUM values) and const: strings, numbers, booleans, null,
 *     filtered by type when both are given. Property names and enum/const values must be written
 *     in their canonical JSON form: a string with only '"', '\' and control bytes escaped (as \",
 *     \\, \b \f \n \r \t, else \u00xx), every other byte as is; an integral number as its
 *     digits ("%.0f" below 1e21), any other number as the shortest "%.17g" that reads back exactly.
 *   - anyOf (at most KVB_JSON_SCHEMA_MAX_ANYOF alternatives, no other constraining keyword
 *     beside it) whose alternatives cannot begin with the same byte (their types differ: e.g.
 *     [{"type": "string"}, {"type": "null"}]): the first byte of the value picks the alternative.
 *   - $ref to a definition in the root's $defs (or draft-07's definitions): "#/$defs/NAME", as
 *     Pydantic writes nested models and enum classes; each definition compiled once and shared
 *     by every $ref to it; a recursive one (a $ref back into a definition being compiled) refused.
 *   - title, description, $schema, $comment, default, examples: accepted and ignored.
 * Refused: other $refs and recursion, pattern, format, oneOf, allOf, not,
 * if/then/else, a schema for additionalProperties, tuple items, unknown keywords, boolean schemas.
 * Limits: KVB_JSON_MAX_DEPTH levels of schema, KVB_JSON_SCHEMA_MAX_NODES subschemas, names and
 * values of at most KVB_JSON_SCHEMA_MAX_STRING bytes, KVB_JSON_SCHEMA_MAX_TEXT bytes of them in all.
 * Every accepted prefix can still be completed (every compiled node has a value; a closed object
 * offers a key only while one is left; maxItems reached leaves only ']'). */
#ifndef KVB_GRAMMAR_H
#define KVB_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cJSON.h>

#include "kvb_core.h"
#include "kvb_tokenizer.h"

#define KVB_JSON_MAX_DEPTH 64
#define KVB_JSON_MAX_WS 32

#define KVB_JSON_SCHEMA_MAX_NODES 1024
#define KVB_JSON_SCHEMA_MAX_PROPS 64  /* per object: a bit each */
#define KVB_JSON_SCHEMA_MAX_ENUM 64   /* per enum: a bit each */
#define KVB_JSON_SCHEMA_MAX_ANYOF 16
#define KVB_JSON_SCHEMA_MAX_ITEMS 255 /* minItems, maxItems */
#define KVB_JSON_SCHEMA_MAX_LENGTH 65535 /* minLength, maxLength */
#define KVB_JSON_SCHEMA_MAX_STRING 1024     /* bytes of one property name or enum value, as written */
#define KVB_JSON_SCHEMA_MAX_TEXT (256 * 1024) /* bytes of all of them */

typedef struct kvb_json_schema kvb_json_schema;

/* A schema: one open container's place in it. */
typedef struct {
    uint16_t node;   /* the container's schema node */
    uint8_t count;   /* object: the declared property the next key may be at the earliest; array:
                        items begun (counted up to the most its bounds need) */
    uint8_t zero;    /* always 0 (no padding: states compare with memcmp) */
} kvb_json_frame;

/* A plain struct without padding: copy it and compare it with memcmp (the masker remembers masks
 * by state). A copy that only goes on feeding may take the first json_state_live_bytes of it. */
typedef struct {
    uint64_t stack;  /* bit d: container at depth d is an object (1) or an array (0) */
    uint8_t depth;   /* containers open */
    uint8_t state;   /* lexical state (json_prefix.c) */
    uint8_t aux;     /* literal: which and how far; \u escape: hex digits read; number: integer */
    uint8_t ws_run;  /* whitespace bytes in a row */
    uint16_t vnode;  /* schema: the node of the member value after ':', or of the enum being matched */
    uint16_t off;    /* schema: bytes of the property name or enum value matched so far */
    uint64_t cand;   /* schema: bit i: the name may still be the object's property i, the value
                        the enum's value i */
    const kvb_json_schema *schema;           /* NULL: any object */
    kvb_json_frame frame[KVB_JSON_MAX_DEPTH]; /* schema: (depth) the open containers; zero above */
} kvb_json_state;

/* Compiles a JSON schema (the subset above) for kvb_json_init_schema. `path` names the schema in
 * messages ("response_format.json_schema.schema"); a schema outside the subset or its limits is
 * KVB_ERR_UNSUPPORTED (a keyword) or KVB_ERR_INVALID (a wrong value), with a message that starts
 * with the path of the offending subschema. */
kvb_status kvb_json_schema_compile(const cJSON *schema, const char *path, kvb_json_schema **out, kvb_err *err);
void kvb_json_schema_free(kvb_json_schema *schema);
/* "a string", "a number", "an object", ...: what a parsed JSON value is, for messages that say what
 * was expected and what came instead. */
const char *kvb_json_value_kind(const cJSON *v);

/* The start of a reply: any JSON object (kvb_json_init), or one valid under schema (which must
 * outlive the state; NULL: any object). */
void kvb_json_init_schema(kvb_json_state *s, const kvb_json_schema *schema);
void kvb_json_init(kvb_json_state *s);
/* Feeds bytes[0..n). True when the reply is still a prefix; false, with *s undefined, when not. */
bool kvb_json_feed(kvb_json_state *s, const char *bytes, size_t n);
/* The object is closed: the reply is a complete JSON text (nothing may follow), valid under the
 * state's schema. */
bool kvb_json_complete(const kvb_json_state *s);

/* ---- the vocabulary as the mask reads it ------------------------------------------------ */

typedef enum { KVB_VOCAB_TEXT = 0, KVB_VOCAB_EOG, KVB_VOCAB_OTHER } kvb_vocab_kind;
typedef struct kvb_vocab_bytes kvb_vocab_bytes;

/* Every token's bytes and kind, read once from the tokenizer (text tokens: their bytes; an
 * end-of-generation control token: EOG; other control tokens: OTHER). */
kvb_status kvb_vocab_bytes_create(const kvb_tokenizer *t, kvb_vocab_bytes **out, kvb_err *err);
/* The same from lists (n tokens; bytes[i] of lens[i] bytes, kinds[i]): tests and tools. */
kvb_status kvb_vocab_bytes_from_lists(const char *const *bytes, const uint32_t *lens, const uint8_t *kinds,
                                      uint32_t n, kvb_vocab_bytes **out, kvb_err *err);
void kvb_vocab_bytes_free(kvb_vocab_bytes *v);
uint32_t kvb_vocab_bytes_n(const kvb_vocab_bytes *v);
/* Feeds token id's bytes to s: true when the reply is still a prefix. A token that is not text,
 * or of no bytes, never continues it (false). */
bool kvb_json_feed_token(kvb_json_state *s, const kvb_vocab_bytes *v, int32_t id);

/* The mask a state implies, applied to a reply's logits. One per reply (not thread-safe); v and
 * pool must outlive it. Masks are remembered for the last KVB_JSON_MASK_CACHE states: a reply
 * inside a string, or between the members of one object, meets one state step after step, and a
 * state seen before costs one pass over the logits instead of the vocabulary's bytes. */
#define KVB_JSON_MASK_CACHE 8
typedef struct kvb_json_masker kvb_json_masker;
kvb_status kvb_json_masker_create(const kvb_vocab_bytes *v, kvb_pool *pool, kvb_json_masker **out, kvb_err *err);
void kvb_json_masker_free(kvb_json_masker *m);
/* logits (n_vocab of v): every token that may not follow s set to -inf; returns how many may. A
 * text token of no bytes never may (it would not move the reply on). When none may, the
 * end-of-generation tokens are left as they were (the reply ends there, honestly unfinished).
 * The tokens are tried in fixed chunks of the vocabulary on the pool's threads (NULL: this
 * thread): the same result either way, and the same whether the mask was remembered or not. */
uint32_t kvb_json_masker_apply(kvb_json_masker *m, const kvb_json_state *s, float *logits);

#endif
