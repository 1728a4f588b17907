/* grammar/json_schema.c — a JSON schema (hostile input: the request's) into the node table the
 * recognizer walks (grammar_internal.h), or a message that names the first keyword or value it
 * cannot honour and where it stands in the schema ("response_format.json_schema.schema.properties
 * .age: keyword 'pattern' is not supported ..."). One recursive pass, at most KVB_JSON_MAX_DEPTH
 * deep; every table grows by doubling up to its limit, so a schema costs memory in proportion to
 * its own size and no more than the limits allow. Property names and enum values are stored as the
 * canonical JSON text the reply must write. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar_internal.h"

#define PATH_MAX_BYTES 256

#define SUPPORTED "type, properties, required, additionalProperties (true or false), items, minItems, maxItems, " \
                  "minLength, maxLength, enum, const, anyOf, $ref to the root's $defs (not recursive); ignored: title, description, " \
                  "$schema, $comment, default, examples"

typedef struct {
    kvb_json_schema *sch;
    uint32_t cap_nodes, cap_props, cap_prop_nodes, cap_values, cap_text;
    kvb_err *err;
    char path[PATH_MAX_BYTES]; /* where the subschema being compiled stands */
    size_t path_len, root_path_len; /* root_path_len: the root schema's own path */
    const cJSON *defs;              /* the root's "$defs" (or "definitions") object, or NULL */
    const char *defs_key;           /* which of the two it is */
    uint32_t n_refs;                /* definitions met through $ref so far: */
    const cJSON *ref_target[KVB_JSON_SCHEMA_MAX_NODES]; /* (n_refs) each one's schema */
    uint16_t ref_node[KVB_JSON_SCHEMA_MAX_NODES];       /* (n_refs) its node, or REF_OPEN while compiling */
} compiler;

#define REF_OPEN 0xFFFFu /* a definition being compiled: a $ref to it from inside is a cycle */

static kvb_status fail(compiler *k, kvb_status code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static kvb_status fail(compiler *k, kvb_status code, const char *fmt, ...) {
    char what[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return kvb_err_set(k->err, code, "%s: %s", k->path, what);
}

static kvb_status no_memory(compiler *k) {
    return kvb_err_set(k->err, KVB_ERR_NOMEM, "out of memory compiling the JSON schema");
}

/* ---- the path in messages ------------------------------------------------------------------- */

/* Appends a segment (".items", "[2]"); returns the length to restore. Too long a path is cut. */
static size_t path_push(compiler *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static size_t path_push(compiler *k, const char *fmt, ...) {
    const size_t before = k->path_len;
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(k->path + before, sizeof k->path - before, fmt, ap);
    va_end(ap);
    k->path_len = n < 0 ? before : KVB_MIN(before + (size_t)n, sizeof k->path - 1);
    return before;
}

static void path_pop(compiler *k, size_t len) {
    k->path_len = len;
    k->path[len] = '\0';
}

/* ".name" for a plain name, else ["name"] (at most 40 bytes of it). */
static size_t path_push_name(compiler *k, const char *prefix, const char *name) {
    bool plain = name[0] != '\0' && strlen(name) <= 40;
    for (const char *c = name; plain && *c; c++)
        plain = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '_' ||
                *c == '-' || *c == '$';
    if (plain) return path_push(k, "%s.%s", prefix, name);
    char shown[48];
    size_t n = 0;
    for (const char *c = name; *c && n < 40; c++) shown[n++] = (unsigned char)*c < 0x20 || *c == '"' ? '?' : *c;
    shown[n] = '\0';
    return path_push(k, "%s[\"%s%s\"]", prefix, shown, strlen(name) > 40 ? "..." : "");
}

const char *kvb_json_value_kind(const cJSON *v) {
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    if (cJSON_IsNull(v)) return "null";
    return "an invalid value";
}

/* ---- tables ---------------------------------------------------------------------------------- */

/* Room for `more` entries of `size` bytes in the array *arr_ptr points to (holding n of cap), up
 * to `limit` entries. arr_ptr: the address of any object pointer (read and written as bytes). */
static bool grow(void *arr_ptr, uint32_t *cap, uint32_t n, uint32_t more, uint32_t limit, size_t size) {
    if (more > limit || n > limit - more) return false;
    if (n + more <= *cap) return true;
    uint32_t c = *cap ? *cap : 16;
    while (c < n + more) c = c > limit / 2 ? limit : 2 * c;
    void *arr;
    memcpy(&arr, arr_ptr, sizeof arr);
    void *p = realloc(arr, (size_t)c * size);
    if (!p) return false;
    memcpy(arr_ptr, &p, sizeof p);
    *cap = c;
    return true;
}

static kvb_status new_node(compiler *k, uint16_t *out) {
    kvb_json_schema *s = k->sch;
    if (s->n_nodes >= KVB_JSON_SCHEMA_MAX_NODES)
        return fail(k, KVB_ERR_RANGE, "the schema has more than %d subschemas", KVB_JSON_SCHEMA_MAX_NODES);
    if (!grow(&s->nodes, &k->cap_nodes, s->n_nodes, 1, KVB_JSON_SCHEMA_MAX_NODES, sizeof *s->nodes))
        return no_memory(k);
    js_node *n = &s->nodes[s->n_nodes];
    memset(n, 0, sizeof *n);
    for (int c = 0; c < JC_N; c++) n->first[c] = JS_NONE;
    *out = (uint16_t)s->n_nodes++;
    return KVB_OK;
}

/* Appends bytes to the text pool as one js_text. */
static kvb_status add_text(compiler *k, const char *bytes, size_t len, js_text *out) {
    kvb_json_schema *s = k->sch;
    if (len > KVB_JSON_SCHEMA_MAX_STRING)
        return fail(k, KVB_ERR_RANGE, "a property name or enum value of %zu bytes (as JSON); at most %d", len,
                    KVB_JSON_SCHEMA_MAX_STRING);
    if (s->n_text + len > KVB_JSON_SCHEMA_MAX_TEXT)
        return fail(k, KVB_ERR_RANGE, "the schema's property names and enum values come to more than %d bytes",
                    KVB_JSON_SCHEMA_MAX_TEXT);
    if (!grow(&s->text, &k->cap_text, s->n_text, (uint32_t)len, KVB_JSON_SCHEMA_MAX_TEXT, 1))
        return no_memory(k);
    memcpy(s->text + s->n_text, bytes, len);
    *out = (js_text){.off = s->n_text, .len = (uint16_t)len};
    s->n_text += (uint32_t)len;
    return KVB_OK;
}

/* The canonical JSON text of a string: quoted, only '"', '\' and control bytes escaped. */
static kvb_status add_string_text(compiler *k, const char *str, js_text *out) {
    const size_t n = strlen(str);
    if (n > KVB_JSON_SCHEMA_MAX_STRING)
        return fail(k, KVB_ERR_RANGE, "a property name or enum value of %zu bytes; at most %d", n,
                    KVB_JSON_SCHEMA_MAX_STRING);
    char *buf = malloc(6 * n + 2); /* (6 bytes a byte at most, the quotes) */
    if (!buf) return no_memory(k);
    size_t len = 0;
    buf[len++] = '"';
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = (unsigned char)str[i];
        const char *esc = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\b' ? "\\b" : c == '\f' ? "\\f"
                        : c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t" : NULL;
        if (esc) len += (size_t)sprintf(buf + len, "%s", esc);
        else if (c < 0x20) len += (size_t)sprintf(buf + len, "\\u%04x", c);
        else buf[len++] = (char)c;
    }
    buf[len++] = '"';
    const kvb_status st = add_text(k, buf, len, out);
    free(buf);
    return st;
}

/* The canonical JSON text of a number: an integral one's digits, else the shortest %.17g that
 * reads back as the same double. */
static kvb_status add_number_text(compiler *k, double d, js_text *out) {
    char buf[64];
    if (!isfinite(d)) return fail(k, KVB_ERR_INVALID, "an enum value is not a finite number");
    if (d == floor(d) && fabs(d) < 1e21) snprintf(buf, sizeof buf, "%.0f", d);
    else
        for (int p = 1; p <= 17; p++) {
            snprintf(buf, sizeof buf, "%.*g", p, d);
            if (strtod(buf, NULL) == d) break;
        }
    return add_text(k, buf, strlen(buf), out);
}

/* ---- keywords --------------------------------------------------------------------------------- */

enum { KW_TYPE = 0, KW_PROPERTIES, KW_REQUIRED, KW_ADDITIONAL, KW_ITEMS, KW_MIN_ITEMS, KW_MAX_ITEMS, KW_ENUM,
       KW_CONST, KW_ANYOF, KW_REF, KW_DEFS, KW_DEFINITIONS, KW_MIN_LENGTH, KW_MAX_LENGTH, KW_N };
static const char *const keywords[KW_N] = {"type", "properties", "required", "additionalProperties", "items",
                                           "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "$defs",
                                           "definitions", "minLength", "maxLength"};
static const char *const ignored[] = {"title", "description", "$schema", "$comment", "default", "examples"};

/* Types a node allows. */
enum { T_OBJ = 1, T_ARR = 2, T_STR = 4, T_NUM = 8, T_INT = 16, T_BOOL = 32, T_NULL = 64, T_ALL = 127 };
static const char *const type_names[] = {"object", "array", "string", "number", "integer", "boolean", "null"};

static kvb_status parse_type(compiler *k, const cJSON *v, unsigned *out) {
    if (!v) {
        *out = T_ALL;
        return KVB_OK;
    }
    if (!cJSON_IsString(v) && !(cJSON_IsArray(v) && v->child))
        return fail(k, KVB_ERR_INVALID, "'type' must be a type name or a non-empty array of them, not %s", kvb_json_value_kind(v));
    unsigned types = 0;
    const cJSON *one = cJSON_IsString(v) ? v : v->child;
    for (; one; one = cJSON_IsString(v) ? NULL : one->next) {
        unsigned t = 0;
        for (unsigned i = 0; cJSON_IsString(one) && i < sizeof type_names / sizeof *type_names; i++)
            if (strcmp(one->valuestring, type_names[i]) == 0) t = 1u << i;
        if (!t) {
            if (!cJSON_IsString(one))
                return fail(k, KVB_ERR_INVALID, "'type' holds %s; expected type names", kvb_json_value_kind(one));
            return fail(k, KVB_ERR_INVALID, "unknown type '%.40s' (expected object, array, string, number, integer, "
                        "boolean or null)", one->valuestring);
        }
        types |= t;
    }
    *out = types;
    return KVB_OK;
}

/* A count keyword's value: an integer in [0, limit]. */
static kvb_status parse_count(compiler *k, const cJSON *v, const char *name, unsigned limit, unsigned *out) {
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble != floor(v->valuedouble) ||
        v->valuedouble < 0 || v->valuedouble > limit)
        return fail(k, KVB_ERR_INVALID, "'%s' must be an integer in [0, %u]", name, limit);
    *out = (unsigned)v->valuedouble;
    return KVB_OK;
}

/* A pair of count keywords (minItems/maxItems, minLength/maxLength; NULL when absent) into *lo
 * (0 without one) and *hi, with lo <= hi when both are given. what: "array", "string". */
static kvb_status parse_bounds(compiler *k, const cJSON *min, const cJSON *max, const char *min_name,
                               const char *max_name, unsigned limit, const char *what, unsigned *lo, unsigned *hi) {
    *lo = *hi = 0;
    kvb_status st = KVB_OK;
    if (min && (st = parse_count(k, min, min_name, limit, lo))) return st;
    if (max && (st = parse_count(k, max, max_name, limit, hi))) return st;
    if (max && *lo > *hi)
        return fail(k, KVB_ERR_INVALID, "'%s' (%u) is more than '%s' (%u): no %s could be written", min_name, *lo,
                    max_name, *hi, what);
    return KVB_OK;
}

/* minLength, maxLength: a string's characters, counted while it is written. */
static kvb_status compile_lengths(compiler *k, uint16_t at, const cJSON *const kw[KW_N]) {
    unsigned lo, hi;
    const kvb_status st = parse_bounds(k, kw[KW_MIN_LENGTH], kw[KW_MAX_LENGTH], "minLength", "maxLength",
                                       KVB_JSON_SCHEMA_MAX_LENGTH, "string", &lo, &hi);
    if (st) return st;
    js_node *n = &k->sch->nodes[at];
    n->counted = kw[KW_MIN_LENGTH] || kw[KW_MAX_LENGTH];
    n->has_max_len = kw[KW_MAX_LENGTH] != NULL;
    n->min_len = (uint16_t)lo;
    n->max_len = (uint16_t)hi;
    return KVB_OK;
}

static kvb_status compile_node(compiler *k, const cJSON *js, int depth, uint16_t *out);

/* enum / const: each value's text, those of the node's types only. */
static kvb_status compile_enum(compiler *k, uint16_t at, const cJSON *list, bool is_const, unsigned types) {
    const char *kw = is_const ? "const" : "enum";
    if (!is_const) {
        if (!cJSON_IsArray(list) || !list->child)
            return fail(k, KVB_ERR_INVALID, "'enum' must be a non-empty array, not %s",
                        cJSON_IsArray(list) ? "an empty one" : kvb_json_value_kind(list));
        if (cJSON_GetArraySize(list) > KVB_JSON_SCHEMA_MAX_ENUM)
            return fail(k, KVB_ERR_RANGE, "'enum' has %d values; at most %d", cJSON_GetArraySize(list),
                        KVB_JSON_SCHEMA_MAX_ENUM);
    }
    kvb_json_schema *s = k->sch;
    const uint32_t first = s->n_values;
    uint16_t firsts[JC_N] = {0};
    for (const cJSON *v = is_const ? list : list->child; v; v = is_const ? NULL : v->next) {
        int cls;
        bool fits;
        if (cJSON_IsString(v)) cls = JC_STR, fits = types & T_STR;
        else if (cJSON_IsNumber(v)) cls = JC_NUM, fits = (types & T_NUM) || ((types & T_INT) && v->valuedouble == floor(v->valuedouble));
        else if (cJSON_IsBool(v)) cls = cJSON_IsTrue(v) ? JC_TRUE : JC_FALSE, fits = types & T_BOOL;
        else if (cJSON_IsNull(v)) cls = JC_NULL, fits = types & T_NULL;
        else
            return fail(k, KVB_ERR_UNSUPPORTED, "'%s' values must be strings, numbers, booleans or null (%s is not "
                        "supported by this server)", kw, kvb_json_value_kind(v));
        if (!fits) continue; /* not of the node's type: no value may be it */
        js_text t;
        kvb_status st = cls == JC_STR ? add_string_text(k, v->valuestring, &t)
                      : cls == JC_NUM ? add_number_text(k, v->valuedouble, &t)
                                      : add_text(k, cls == JC_TRUE ? "true" : cls == JC_FALSE ? "false" : "null",
                                                 cls == JC_TRUE ? 4 : cls == JC_FALSE ? 5 : 4, &t);
        if (st) return st;
        if (!grow(&s->values, &k->cap_values, s->n_values, 1, KVB_JSON_SCHEMA_MAX_NODES * KVB_JSON_SCHEMA_MAX_ENUM,
                  sizeof *s->values))
            return no_memory(k);
        s->values[s->n_values++] = t;
        firsts[cls] = 1;
    }
    if (s->n_values == first)
        return fail(k, KVB_ERR_INVALID, "no value of '%s' is of the schema's 'type': nothing could be written", kw);
    js_node *n = &s->nodes[at];
    n->kind = JS_ENUM;
    n->values = first;
    n->n_values = (uint8_t)(s->n_values - first);
    for (int c = 0; c < JC_N; c++) n->first[c] = firsts[c] ? at : JS_NONE;
    return KVB_OK;
}

/* anyOf: the alternatives' first[] tables merged; two that begin alike are refused. */
static kvb_status compile_any_of(compiler *k, uint16_t at, const cJSON *list, int depth) {
    if (!cJSON_IsArray(list) || !list->child)
        return fail(k, KVB_ERR_INVALID, "'anyOf' must be a non-empty array of schemas, not %s",
                    cJSON_IsArray(list) ? "an empty one" : kvb_json_value_kind(list));
    if (cJSON_GetArraySize(list) > KVB_JSON_SCHEMA_MAX_ANYOF)
        return fail(k, KVB_ERR_RANGE, "'anyOf' has %d alternatives; at most %d", cJSON_GetArraySize(list),
                    KVB_JSON_SCHEMA_MAX_ANYOF);
    static const char *const begins[JC_N] = {"an object", "an array", "a string", "a number", "true", "false", "null"};
    int owner[JC_N];
    for (int c = 0; c < JC_N; c++) owner[c] = -1;
    int i = 0;
    for (const cJSON *alt = list->child; alt; alt = alt->next, i++) {
        const size_t back = path_push(k, ".anyOf[%d]", i);
        uint16_t a;
        kvb_status st = compile_node(k, alt, depth + 1, &a);
        path_pop(k, back);
        if (st) return st;
        for (int c = 0; c < JC_N; c++) {
            const uint16_t to = k->sch->nodes[a].first[c];
            if (to == JS_NONE) continue;
            if (owner[c] >= 0)
                return fail(k, KVB_ERR_UNSUPPORTED, "'anyOf' alternatives %d and %d may both be %s: this server "
                            "supports anyOf only over alternatives of different types", owner[c], i, begins[c]);
            owner[c] = i;
            k->sch->nodes[at].first[c] = to;
        }
    }
    k->sch->nodes[at].kind = JS_ANYOF;
    return KVB_OK;
}

/* properties, required, additionalProperties. */
static kvb_status compile_object(compiler *k, uint16_t at, const cJSON *const kw[KW_N], int depth) {
    kvb_json_schema *s = k->sch;
    const cJSON *props = kw[KW_PROPERTIES], *req = kw[KW_REQUIRED], *add = kw[KW_ADDITIONAL];
    if (add && !cJSON_IsBool(add))
        return fail(k, KVB_ERR_UNSUPPORTED, "'additionalProperties' must be true or false (%s is not supported by "
                    "this server)", kvb_json_value_kind(add));
    if (props && !cJSON_IsObject(props))
        return fail(k, KVB_ERR_INVALID, "'properties' must be an object, not %s", kvb_json_value_kind(props));
    const int n_props = props ? cJSON_GetArraySize(props) : 0;
    if (n_props > KVB_JSON_SCHEMA_MAX_PROPS)
        return fail(k, KVB_ERR_RANGE, "'properties' declares %d properties; at most %d", n_props, KVB_JSON_SCHEMA_MAX_PROPS);
    /* the properties' slots first, side by side; then each one's schema (which may add its own) */
    if (s->n_props + (uint32_t)n_props > KVB_JSON_SCHEMA_MAX_NODES) /* each will have a node */
        return fail(k, KVB_ERR_RANGE, "the schema has more than %d subschemas", KVB_JSON_SCHEMA_MAX_NODES);
    const uint32_t first = s->n_props;
    if (!grow(&s->prop_key, &k->cap_props, s->n_props, (uint32_t)n_props, KVB_JSON_SCHEMA_MAX_NODES,
              sizeof *s->prop_key) ||
        !grow(&s->prop_node, &k->cap_prop_nodes, s->n_props, (uint32_t)n_props, KVB_JSON_SCHEMA_MAX_NODES,
              sizeof *s->prop_node))
        return no_memory(k);
    s->n_props += (uint32_t)n_props;
    int i = 0;
    for (const cJSON *p = props ? props->child : NULL; p; p = p->next, i++) {
        for (const cJSON *q = props->child; q != p; q = q->next)
            if (strcmp(q->string, p->string) == 0)
                return fail(k, KVB_ERR_INVALID, "property '%.40s' is declared twice", p->string);
        kvb_status st = add_string_text(k, p->string, &s->prop_key[first + (uint32_t)i]);
        if (st) return st;
        const size_t back = path_push_name(k, ".properties", p->string);
        uint16_t v;
        st = compile_node(k, p, depth + 1, &v);
        path_pop(k, back);
        if (st) return st;
        s->prop_node[first + (uint32_t)i] = v;
    }
    uint64_t required = 0;
    if (req) {
        if (!cJSON_IsArray(req))
            return fail(k, KVB_ERR_INVALID, "'required' must be an array of property names, not %s", kvb_json_value_kind(req));
        if (cJSON_GetArraySize(req) > KVB_JSON_SCHEMA_MAX_PROPS)
            return fail(k, KVB_ERR_RANGE, "'required' has %d names; at most %d", cJSON_GetArraySize(req),
                        KVB_JSON_SCHEMA_MAX_PROPS);
        for (const cJSON *r = req->child; r; r = r->next) {
            if (!cJSON_IsString(r))
                return fail(k, KVB_ERR_INVALID, "'required' holds %s; expected property names", kvb_json_value_kind(r));
            int found = -1, j = 0;
            for (const cJSON *p = props ? props->child : NULL; p && found < 0; p = p->next, j++)
                if (strcmp(p->string, r->valuestring) == 0) found = j;
            if (found < 0)
                return fail(k, KVB_ERR_UNSUPPORTED, "'required' names '%.40s', which is not in 'properties' (this server "
                            "requires only declared properties)", r->valuestring);
            required |= (uint64_t)1 << found;
        }
    }
    js_node *n = &s->nodes[at];
    n->props = first;
    n->n_props = (uint8_t)n_props;
    n->required = required;
    n->closed = props != NULL || cJSON_IsFalse(add);
    return KVB_OK;
}

/* items, minItems, maxItems. */
static kvb_status compile_array(compiler *k, uint16_t at, const cJSON *const kw[KW_N], int depth) {
    unsigned lo, hi;
    kvb_status st = parse_bounds(k, kw[KW_MIN_ITEMS], kw[KW_MAX_ITEMS], "minItems", "maxItems", KVB_JSON_SCHEMA_MAX_ITEMS,
                                 "array", &lo, &hi);
    if (st) return st;
    uint16_t items = JS_ANY;
    if (kw[KW_ITEMS]) {
        if (!cJSON_IsObject(kw[KW_ITEMS]))
            return fail(k, KVB_ERR_UNSUPPORTED, "'items' must be one schema object (%s is not supported by this server)",
                        kvb_json_value_kind(kw[KW_ITEMS]));
        const size_t back = path_push(k, ".items");
        st = compile_node(k, kw[KW_ITEMS], depth + 1, &items);
        path_pop(k, back);
        if (st) return st;
    }
    js_node *n = &k->sch->nodes[at];
    n->items = items;
    n->min_items = (uint8_t)lo;
    n->max_items = (uint8_t)hi;
    n->has_max = kw[KW_MAX_ITEMS] != NULL;
    n->item_cap = (uint8_t)(n->has_max ? hi : lo);
    return KVB_OK;
}

/* "$ref": a local reference into the root's definitions ("#/$defs/NAME" or "#/definitions/NAME",
 * NAME with JSON Pointer's ~0 and ~1), as Pydantic writes nested models and enums. Each definition
 * is compiled once, where it is first referenced, and every $ref to it shares its node; a $ref
 * back into a definition still being compiled (a recursive schema) is refused. Messages inside a
 * definition name its own place: "SCHEMA.$defs.NAME". */
static kvb_status compile_ref(compiler *k, const cJSON *ref, int depth, uint16_t *out) {
    if (!cJSON_IsString(ref)) return fail(k, KVB_ERR_INVALID, "'$ref' must be a string, not %s", kvb_json_value_kind(ref));
    const char *r = ref->valuestring;
    char prefix[32];
    snprintf(prefix, sizeof prefix, "#/%s/", k->defs_key ? k->defs_key : "$defs");
    if (!k->defs || strncmp(r, prefix, strlen(prefix)) != 0)
        return fail(k, KVB_ERR_UNSUPPORTED, "'$ref' \"%.60s\" is not supported by this server (only references to "
                    "the root's %s: \"%sNAME\")", r, k->defs_key ? k->defs_key : "$defs", prefix);
    char name[KVB_JSON_SCHEMA_MAX_STRING + 1]; /* JSON Pointer's ~1 (/) and ~0 (~) decoded */
    size_t n = 0;
    for (const char *c = r + strlen(prefix); *c; c++) {
        if (*c == '/' || n == sizeof name - 1 || (*c == '~' && c[1] != '0' && c[1] != '1'))
            return fail(k, KVB_ERR_UNSUPPORTED, "'$ref' \"%.60s\" does not name one definition", r);
        name[n++] = *c == '~' ? (*++c == '1' ? '/' : '~') : *c;
    }
    name[n] = '\0';
    const cJSON *target = NULL;
    for (const cJSON *d = k->defs->child; d && !target; d = d->next)
        if (strcmp(d->string, name) == 0) target = d;
    if (!target) return fail(k, KVB_ERR_INVALID, "'$ref' \"%.60s\": no such definition", r);
    uint32_t i = 0;
    while (i < k->n_refs && k->ref_target[i] != target) i++;
    if (i < k->n_refs) {
        if (k->ref_node[i] == REF_OPEN)
            return fail(k, KVB_ERR_UNSUPPORTED, "'$ref' \"%.60s\" refers to itself (recursive schemas are not "
                        "supported by this server)", r);
        *out = k->ref_node[i];
        return KVB_OK;
    }
    if (k->n_refs == KVB_JSON_SCHEMA_MAX_NODES)
        return fail(k, KVB_ERR_RANGE, "the schema has more than %d subschemas", KVB_JSON_SCHEMA_MAX_NODES);
    k->ref_target[k->n_refs] = target;
    k->ref_node[k->n_refs++] = REF_OPEN;
    char here[PATH_MAX_BYTES]; /* compiled at its own place in the schema, then back here */
    memcpy(here, k->path, sizeof here);
    const size_t here_len = k->path_len;
    path_pop(k, k->root_path_len);
    path_push_name(k, k->defs_key[0] == '$' ? ".$defs" : ".definitions", name);
    const kvb_status st = compile_node(k, target, depth + 1, out);
    memcpy(k->path, here, sizeof here);
    k->path_len = here_len;
    if (st) return st;
    k->ref_node[i] = *out;
    return KVB_OK;
}

static kvb_status compile_node(compiler *k, const cJSON *js, int depth, uint16_t *out) {
    if (depth > KVB_JSON_MAX_DEPTH)
        return fail(k, KVB_ERR_RANGE, "the schema nests deeper than %d levels", KVB_JSON_MAX_DEPTH);
    if (!cJSON_IsObject(js))
        return fail(k, KVB_ERR_UNSUPPORTED, "a schema must be a JSON object, not %s", kvb_json_value_kind(js));
    const cJSON *kw[KW_N] = {0};
    bool constrains = false;
    for (const cJSON *e = js->child; e; e = e->next) {
        int found = -1;
        for (int i = 0; i < KW_N && found < 0; i++)
            if (strcmp(e->string, keywords[i]) == 0) found = i;
        if (found >= 0) {
            if (kw[found]) return fail(k, KVB_ERR_INVALID, "keyword '%s' appears twice", keywords[found]);
            kw[found] = e;
            constrains = constrains || (found != KW_ANYOF && found != KW_DEFS && found != KW_DEFINITIONS);
            continue;
        }
        bool skip = false;
        for (size_t i = 0; i < sizeof ignored / sizeof *ignored && !skip; i++) skip = strcmp(e->string, ignored[i]) == 0;
        if (!skip)
            return fail(k, KVB_ERR_UNSUPPORTED, "keyword '%.40s' is not supported by this server (supported: " SUPPORTED ")",
                        e->string);
    }
    if (kw[KW_DEFS] || kw[KW_DEFINITIONS]) { /* read by kvb_json_schema_compile, at the root only */
        if (depth != 1)
            return fail(k, KVB_ERR_UNSUPPORTED, "'%s' is supported by this server only at the schema's root",
                        kw[KW_DEFS] ? "$defs" : "definitions");
    }
    if (kw[KW_REF]) {
        for (int i = 0; i < KW_N; i++)
            if (kw[i] && i != KW_REF && i != KW_DEFS && i != KW_DEFINITIONS)
                return fail(k, KVB_ERR_UNSUPPORTED, "'$ref' beside '%s' is not supported by this server", keywords[i]);
        return compile_ref(k, kw[KW_REF], depth, out);
    }
    uint16_t at;
    kvb_status st = new_node(k, &at);
    if (st) return st;
    *out = at;
    if (kw[KW_ANYOF]) {
        if (constrains)
            return fail(k, KVB_ERR_UNSUPPORTED, "'anyOf' beside other constraining keywords is not supported by this "
                        "server (put them in each alternative)");
        return compile_any_of(k, at, kw[KW_ANYOF], depth);
    }
    if (kw[KW_ENUM] && kw[KW_CONST])
        return fail(k, KVB_ERR_UNSUPPORTED, "'enum' and 'const' together are not supported by this server");
    if ((kw[KW_ENUM] || kw[KW_CONST]) && (kw[KW_MIN_LENGTH] || kw[KW_MAX_LENGTH]))
        return fail(k, KVB_ERR_UNSUPPORTED, "'%s' beside '%s' is not supported by this server (list only the values "
                    "that fit)", kw[KW_MIN_LENGTH] ? "minLength" : "maxLength", kw[KW_ENUM] ? "enum" : "const");
    unsigned types = T_ALL;
    if ((st = parse_type(k, kw[KW_TYPE], &types))) return st;
    /* the object's and the array's keywords, compiled whether or not the type lets such a value be */
    if ((st = compile_object(k, at, kw, depth))) return st;
    if ((st = compile_array(k, at, kw, depth))) return st;
    if ((st = compile_lengths(k, at, kw))) return st;
    if (kw[KW_ENUM] || kw[KW_CONST]) return compile_enum(k, at, kw[KW_ENUM] ? kw[KW_ENUM] : kw[KW_CONST], !kw[KW_ENUM], types);
    js_node *n = &k->sch->nodes[at];
    static const unsigned class_types[JC_N] = {T_OBJ, T_ARR, T_STR, T_NUM | T_INT, T_BOOL, T_BOOL, T_NULL};
    for (int c = 0; c < JC_N; c++) n->first[c] = types & class_types[c] ? at : JS_NONE;
    n->integer = (types & T_INT) && !(types & T_NUM);
    return KVB_OK;
}

void kvb_json_schema_free(kvb_json_schema *schema) {
    if (!schema) return;
    free(schema->nodes);
    free(schema->prop_key);
    free(schema->prop_node);
    free(schema->values);
    free(schema->text);
    free(schema);
}

kvb_status kvb_json_schema_compile(const cJSON *schema, const char *path, kvb_json_schema **out, kvb_err *err) {
    *out = NULL;
    compiler k = {.err = err};
    k.sch = calloc(1, sizeof *k.sch);
    if (!k.sch) return no_memory(&k);
    path_push(&k, "%s", path ? path : "schema");
    k.root_path_len = k.path_len;
    kvb_status st = KVB_OK;
    if (cJSON_IsObject(schema)) {
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(schema, "$defs"),
                    *dd = cJSON_GetObjectItemCaseSensitive(schema, "definitions");
        if (d && dd) st = kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: '$defs' and 'definitions' together are not "
                                       "supported by this server", k.path);
        else if ((d || dd) && !cJSON_IsObject(d ? d : dd))
            st = kvb_err_set(err, KVB_ERR_INVALID, "%s: '%s' must be an object of schemas, not %s", k.path,
                              d ? "$defs" : "definitions", kvb_json_value_kind(d ? d : dd));
        k.defs = d ? d : dd;
        k.defs_key = d ? "$defs" : dd ? "definitions" : NULL;
    }
    uint16_t any, root;
    if (!st) st = new_node(&k, &any); /* node 0: any value */
    if (!st) {
        js_node *n = &k.sch->nodes[any];
        for (int c = 0; c < JC_N; c++) n->first[c] = any;
        st = compile_node(&k, schema, 1, &root);
    }
    if (!st) {
        const js_node *r = &k.sch->nodes[root];
        bool object_only = r->first[JC_OBJ] != JS_NONE;
        for (int c = 0; c < JC_N; c++) object_only = object_only && (c == JC_OBJ || r->first[c] == JS_NONE);
        if (!object_only)
            st = kvb_err_set(err, KVB_ERR_UNSUPPORTED, "%s: the root schema must be {\"type\": \"object\"} (the reply "
                             "is a JSON object, as OpenAI's structured outputs require)", path ? path : "schema");
        else
            k.sch->root = r->first[JC_OBJ];
    }
    if (st) {
        kvb_json_schema_free(k.sch);
        return st;
    }
    *out = k.sch;
    return KVB_OK;
}
