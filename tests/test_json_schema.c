/* tests/test_json_schema.c — response_format json_schema's recognizer (src/grammar with a compiled
 * schema): every refused keyword and limit gives a message naming the keyword and its path, hostile
 * schemas (deep, huge, wrongly typed) are refused quickly; tables of texts and prefixes for each
 * supported construct (accepted whole, or refused at exactly the byte where they go wrong); a
 * property check over random small schemas and random valid instances (every prefix accepted, only
 * the whole complete), their random byte mutations and random byte walks (complete exactly when an
 * independent validator written here over the raw text says valid; every accepted prefix completes
 * to a text the validator accepts: no dead ends); and the masker over a small vocabulary (the mask
 * is each token's feed, never empty while the reply is unfinished, and random walks through it end
 * in schema-valid texts). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar_internal.h" /* json_state_mask_key */
#include "json_gen.h"
#include "kvb_grammar.h"

/* The schema text compiled, or a failed test. */
static kvb_json_schema *compile_ok(const char *text) {
    cJSON *j = cJSON_Parse(text);
    if (!j) fail_msg("test schema does not parse: %s", text);
    kvb_json_schema *s = NULL;
    kvb_err err = {0};
    if (kvb_json_schema_compile(j, "schema", &s, &err) != KVB_OK) fail_msg("schema %s refused: %s", text, err.msg);
    cJSON_Delete(j);
    return s;
}

/* ---- refusals ------------------------------------------------------------------------------- */

static void expect_refused_schema(const char *text, const char *words) {
    cJSON *j = cJSON_Parse(text);
    if (!j) fail_msg("test schema does not parse: %s", text);
    kvb_json_schema *s = (kvb_json_schema *)1;
    kvb_err err = {0};
    const kvb_status st = kvb_json_schema_compile(j, "schema", &s, &err);
    cJSON_Delete(j);
    if (st == KVB_OK) fail_msg("schema %s compiled; expected a refusal with '%s'", text, words);
    assert_null(s);
    if (!strstr(err.msg, words)) fail_msg("schema %s: message '%s' lacks '%s'", text, err.msg, words);
}

#define OBJ(props) "{\"type\":\"object\",\"properties\":{" props "}}"

static void test_refused_keywords(void **state) {
    (void)state;
    static const char *const refused[] = {"pattern", "format", "oneOf", "allOf",
                                          "not", "if", "then", "else", "minimum",
                                          "maximum", "multipleOf", "uniqueItems", "prefixItems",
                                          "patternProperties", "propertyNames", "contains", "dependentRequired",
                                          "unevaluatedProperties", "minProperties", "nullable", "x-foo"};
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        char text[256], words[256];
        /* at the root, and inside a property: the path names where */
        snprintf(text, sizeof text, "{\"type\":\"object\",\"%s\":{}}", refused[i]);
        snprintf(words, sizeof words, "schema: keyword '%s' is not supported by this server (supported: type,", refused[i]);
        expect_refused_schema(text, words);
        snprintf(text, sizeof text, OBJ("\"age\":{\"type\":\"integer\",\"%s\":1}"), refused[i]);
        snprintf(words, sizeof words, "schema.properties.age: keyword '%s' is not supported", refused[i]);
        expect_refused_schema(text, words);
    }
    /* paths through items, anyOf and odd property names */
    expect_refused_schema(OBJ("\"l\":{\"type\":\"array\",\"items\":{\"anyOf\":[{\"type\":\"null\"},{\"pattern\":\"x\"}]}}"),
                          "schema.properties.l.items.anyOf[1]: keyword 'pattern'");
    expect_refused_schema(OBJ("\"a b\":{\"format\":\"date\"}"), "schema.properties[\"a b\"]: keyword 'format'");
    /* metadata is accepted and ignored */
    kvb_json_schema_free(compile_ok("{\"type\":\"object\",\"title\":\"T\",\"description\":\"d\",\"$schema\":\"x\","
                                    "\"$comment\":\"c\",\"default\":{},\"examples\":[{}],\"properties\":{\"a\":{\"title\":\"A\","
                                    "\"type\":\"string\",\"default\":\"z\"}}}"));
}

/* $ref into the root's $defs, as the openai client's parse helper sends a Pydantic model with a
 * nested model, a list of them, an optional one and an enum class. */
static void test_refs_into_defs(void **state) {
    (void)state;
    static const char *const pydantic =
        "{\"$defs\":{\"Color\":{\"enum\":[\"red\",\"green\"],\"title\":\"Color\",\"type\":\"string\"},\"Inner\":"
        "{\"properties\":{\"x\":{\"title\":\"X\",\"type\":\"integer\"},\"tag\":{\"const\":\"a\",\"title\":\"Tag\","
        "\"type\":\"string\"}},\"required\":[\"x\",\"tag\"],\"title\":\"Inner\",\"type\":\"object\","
        "\"additionalProperties\":false}},\"properties\":{\"name\":{\"title\":\"Name\",\"type\":\"string\"},"
        "\"inner\":{\"$ref\":\"#/$defs/Inner\"},\"items\":{\"items\":{\"$ref\":\"#/$defs/Inner\"},\"title\":\"Items\","
        "\"type\":\"array\"},\"maybe\":{\"anyOf\":[{\"$ref\":\"#/$defs/Inner\"},{\"type\":\"null\"}]},\"color\":"
        "{\"$ref\":\"#/$defs/Color\"},\"score\":{\"title\":\"Score\",\"type\":\"number\"}},\"required\":[\"name\","
        "\"inner\",\"items\",\"maybe\",\"color\",\"score\"],\"title\":\"Outer\",\"type\":\"object\","
        "\"additionalProperties\":false}";
    kvb_json_schema *sch = compile_ok(pydantic);
    static const char *const valid[] = {
        "{\"name\":\"n\",\"inner\":{\"x\":1,\"tag\":\"a\"},\"items\":[],\"maybe\":null,\"color\":\"red\",\"score\":2.5}",
        "{\"name\":\"\",\"inner\":{\"x\":-3,\"tag\":\"a\"},\"items\":[{\"x\":0,\"tag\":\"a\"},{\"x\":7,\"tag\":\"a\"}],"
        "\"maybe\":{\"x\":2,\"tag\":\"a\"},\"color\":\"green\",\"score\":1e3}",
    };
    for (size_t i = 0; i < sizeof valid / sizeof *valid; i++) {
        kvb_json_state st;
        kvb_json_init_schema(&st, sch);
        if (!kvb_json_feed(&st, valid[i], strlen(valid[i])) || !kvb_json_complete(&st))
            fail_msg("refused or incomplete: %s", valid[i]);
    }
    /* the shared definition holds wherever it is referenced: a wrong tag, a fraction, a colour */
    static const char *const invalid[] = {
        "{\"name\":\"n\",\"inner\":{\"x\":1,\"tag\":\"b\"",
        "{\"name\":\"n\",\"inner\":{\"x\":1,\"tag\":\"a\"},\"items\":[{\"x\":1.5",
        "{\"name\":\"n\",\"inner\":{\"x\":1,\"tag\":\"a\"},\"items\":[],\"maybe\":{\"tag\"",
        "{\"name\":\"n\",\"inner\":{\"x\":1,\"tag\":\"a\"},\"items\":[],\"maybe\":null,\"color\":\"blue",
        "{\"name\":\"n\",\"inner\":{\"x\":1,\"tag\":\"a\"},\"items\":[],\"maybe\":null,\"color\":\"red\",\"score\":\"",
    };
    for (size_t i = 0; i < sizeof invalid / sizeof *invalid; i++) {
        kvb_json_state st;
        kvb_json_init_schema(&st, sch);
        if (kvb_json_feed(&st, invalid[i], strlen(invalid[i]))) fail_msg("accepted: %s", invalid[i]);
    }
    kvb_json_schema_free(sch);
    /* draft-07's "definitions", a name with JSON Pointer escapes, a $ref beside metadata */
    kvb_json_schema_free(compile_ok("{\"type\":\"object\",\"definitions\":{\"a/b~c\":{\"type\":\"integer\"}},"
                                    "\"properties\":{\"v\":{\"$ref\":\"#/definitions/a~1b~0c\",\"description\":\"d\"}}}"));
    /* refused: recursion (direct and through another definition), references elsewhere, unknown names,
     * $defs below the root, $ref beside constraints, both spellings at once */
    expect_refused_schema("{\"type\":\"object\",\"$defs\":{\"N\":{\"type\":\"object\",\"properties\":{\"next\":"
                          "{\"$ref\":\"#/$defs/N\"}}}},\"properties\":{\"head\":{\"$ref\":\"#/$defs/N\"}}}",
                          "schema.$defs.N.properties.next: '$ref' \"#/$defs/N\" refers to itself");
    expect_refused_schema("{\"type\":\"object\",\"$defs\":{\"A\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/B\"}},"
                          "\"B\":{\"anyOf\":[{\"$ref\":\"#/$defs/A\"},{\"type\":\"null\"}]}},\"properties\":{\"a\":"
                          "{\"$ref\":\"#/$defs/A\"}}}", "schema.$defs.B.anyOf[0]: '$ref' \"#/$defs/A\" refers to itself");
    expect_refused_schema("{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#\"}}}",
                          "schema.properties.a: '$ref' \"#\" is not supported by this server");
    expect_refused_schema("{\"type\":\"object\",\"$defs\":{},\"properties\":{\"a\":{\"$ref\":\"http://x/s.json\"}}}",
                          "'$ref' \"http://x/s.json\" is not supported");
    expect_refused_schema("{\"type\":\"object\",\"$defs\":{\"A\":{}},\"properties\":{\"a\":{\"$ref\":\"#/$defs/B\"}}}",
                          "schema.properties.a: '$ref' \"#/$defs/B\": no such definition");
    expect_refused_schema("{\"type\":\"object\",\"$defs\":{\"A\":{}},\"properties\":{\"a\":{\"$ref\":\"#/$defs/A/x\"}}}",
                          "does not name one definition");
    expect_refused_schema("{\"type\":\"object\",\"$defs\":{\"A\":{}},\"properties\":{\"a\":{\"$ref\":\"#/$defs/A\","
                          "\"type\":\"string\"}}}", "schema.properties.a: '$ref' beside 'type' is not supported");
    expect_refused_schema("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"object\",\"$defs\":{}}}}",
                          "schema.properties.a: '$defs' is supported by this server only at the schema's root");
    expect_refused_schema("{\"type\":\"object\",\"$defs\":{},\"definitions\":{}}", "'$defs' and 'definitions' together");
    expect_refused_schema("{\"type\":\"object\",\"$defs\":[]}", "'$defs' must be an object of schemas, not an array");
    expect_refused_schema("{\"type\":\"object\",\"$defs\":{\"A\":{}},\"properties\":{\"a\":{\"$ref\":7}}}",
                          "'$ref' must be a string, not a number");
    /* an error inside a definition names the definition's place */
    expect_refused_schema("{\"type\":\"object\",\"$defs\":{\"A\":{\"type\":\"string\",\"pattern\":\"x\"}},\"properties\":"
                          "{\"a\":{\"$ref\":\"#/$defs/A\"}}}", "schema.$defs.A: keyword 'pattern' is not supported");
}

static void test_wrong_values(void **state) {
    (void)state;
    static const struct {
        const char *schema, *words;
    } cases[] = {
        {"{\"type\":\"string\"}", "schema: the root schema must be {\"type\": \"object\"}"},
        {"{}", "the root schema must be"},
        {"{\"type\":[\"object\",\"null\"]}", "the root schema must be"},
        {"{\"anyOf\":[{\"type\":\"object\"},{\"type\":\"array\"}]}", "the root schema must be"},
        {"[]", "schema: a schema must be a JSON object, not an array"},
        {"true", "a schema must be a JSON object, not a boolean"},
        {OBJ("\"a\":true"), "schema.properties.a: a schema must be a JSON object, not a boolean"},
        {OBJ("\"a\":5"), "schema.properties.a: a schema must be a JSON object, not a number"},
        {"{\"type\":5}", "'type' must be a type name or a non-empty array of them, not a number"},
        {"{\"type\":[]}", "'type' must be a type name or a non-empty array"},
        {"{\"type\":\"obj\"}", "unknown type 'obj'"},
        {"{\"type\":[\"object\",1]}", "'type' holds a number"},
        {"{\"type\":\"object\",\"properties\":[]}", "'properties' must be an object, not an array"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":\"a\"}", "'required' must be an array"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[1]}", "'required' holds a number"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"b\"]}", "'required' names 'b', which is not in 'properties'"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{},\"a\":{}}}", "property 'a' is declared twice"},
        {"{\"type\":\"object\",\"additionalProperties\":{}}", "'additionalProperties' must be true or false"},
        {"{\"type\":\"object\",\"additionalProperties\":\"no\"}", "'additionalProperties' must be true or false"},
        {OBJ("\"a\":{\"type\":\"array\",\"items\":[{}]}"), "schema.properties.a: 'items' must be one schema object"},
        {OBJ("\"a\":{\"type\":\"array\",\"items\":true}"), "'items' must be one schema object"},
        {OBJ("\"a\":{\"minItems\":-1}"), "'minItems' must be an integer in [0, 255]"},
        {OBJ("\"a\":{\"minItems\":1.5}"), "'minItems' must be an integer"},
        {OBJ("\"a\":{\"maxItems\":\"2\"}"), "'maxItems' must be an integer"},
        {OBJ("\"a\":{\"maxItems\":256}"), "'maxItems' must be an integer in [0, 255]"},
        {OBJ("\"a\":{\"minItems\":3,\"maxItems\":2}"), "'minItems' (3) is more than 'maxItems' (2)"},
        {OBJ("\"a\":{\"enum\":[]}"), "'enum' must be a non-empty array, not an empty one"},
        {OBJ("\"a\":{\"enum\":\"x\"}"), "'enum' must be a non-empty array, not a string"},
        {OBJ("\"a\":{\"enum\":[{}]}"), "'enum' values must be strings, numbers, booleans or null"},
        {OBJ("\"a\":{\"enum\":[1,[2]]}"), "'enum' values must be"},
        {OBJ("\"a\":{\"const\":{\"x\":1}}"), "'const' values must be"},
        {OBJ("\"a\":{\"enum\":[1],\"const\":1}"), "'enum' and 'const' together"},
        {OBJ("\"a\":{\"type\":\"string\",\"enum\":[1,true]}"), "no value of 'enum' is of the schema's 'type'"},
        {OBJ("\"a\":{\"type\":\"integer\",\"const\":1.5}"), "no value of 'const'"},
        {OBJ("\"a\":{\"anyOf\":[]}"), "'anyOf' must be a non-empty array of schemas, not an empty one"},
        {OBJ("\"a\":{\"anyOf\":{}}"), "'anyOf' must be a non-empty array of schemas, not an object"},
        {OBJ("\"a\":{\"type\":\"string\",\"anyOf\":[{}]}"), "'anyOf' beside other constraining keywords"},
        {OBJ("\"a\":{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"number\"}]}"), "alternatives 0 and 1 may both be a number"},
        {OBJ("\"a\":{\"anyOf\":[{\"type\":\"null\"},{}]}"), "alternatives 0 and 1 may both be null"},
        {OBJ("\"a\":{\"anyOf\":[{\"enum\":[\"x\"]},{\"type\":\"string\"}]}"), "may both be a string"},
        {OBJ("\"a\":{\"anyOf\":[{\"type\":\"object\"},{\"type\":\"object\",\"properties\":{}}]}"), "may both be an object"},
        {"{\"type\":\"object\",\"type\":\"object\"}", "keyword 'type' appears twice"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) expect_refused_schema(cases[i].schema, cases[i].words);
}

/* A text of n copies of `unit` between head and tail (malloc'd). */
static char *repeat(const char *head, const char *unit, int n, const char *tail) {
    const size_t hl = strlen(head), ul = strlen(unit), tl = strlen(tail);
    char *s = malloc(hl + ul * (size_t)n + tl + 1);
    memcpy(s, head, hl);
    for (int i = 0; i < n; i++) memcpy(s + hl + ul * (size_t)i, unit, ul);
    memcpy(s + hl + ul * (size_t)n, tail, tl + 1);
    return s;
}

/* Nested objects {"type":"object","properties":{"a": ...}}, `levels` schemas deep. */
static char *nested_schema(int levels) {
    char *open = repeat("", "{\"type\":\"object\",\"properties\":{\"a\":", levels - 1, "{\"type\":\"object\"");
    char *all = repeat(open, "}}", levels - 1, "}");
    free(open);
    return all;
}

static void test_limits_and_hostile_schemas(void **state) {
    (void)state;
    /* depth: 64 schemas deep compile, and 64 objects deep are a valid reply; 65 do not */
    char *s64 = nested_schema(KVB_JSON_MAX_DEPTH), *s65 = nested_schema(KVB_JSON_MAX_DEPTH + 1);
    kvb_json_schema *sch = compile_ok(s64);
    char *open = repeat("", "{\"a\":", KVB_JSON_MAX_DEPTH - 1, "{");
    char *doc = repeat(open, "}", KVB_JSON_MAX_DEPTH, "");
    kvb_json_state js;
    kvb_json_init_schema(&js, sch);
    assert_true(kvb_json_feed(&js, doc, strlen(doc)));
    assert_true(kvb_json_complete(&js));
    kvb_json_schema_free(sch);
    free(open);
    free(doc);
    expect_refused_schema(s65, "the schema nests deeper than 64 levels");
    free(s64);
    free(s65);
    /* 400 levels (800 for cJSON, which parses up to 1000): refused at the 65th, no deep recursion */
    char *s400 = nested_schema(400);
    expect_refused_schema(s400, "deeper than 64");
    free(s400);
    /* an anyOf nest counts too */
    char *any = repeat("{\"type\":\"object\",\"properties\":{\"a\":", "{\"anyOf\":[", 70, "{\"type\":\"null\"}");
    char *any_all = repeat(any, "]}", 70, "}}");
    expect_refused_schema(any_all, "deeper than 64");
    free(any);
    free(any_all);
    /* 64 properties, not 65 */
    char *props = malloc(1 << 16);
    size_t n = (size_t)sprintf(props, "{\"type\":\"object\",\"properties\":{");
    for (int i = 0; i < KVB_JSON_SCHEMA_MAX_PROPS; i++) n += (size_t)sprintf(props + n, "%s\"p%d\":{}", i ? "," : "", i);
    strcpy(props + n, "}}");
    kvb_json_schema_free(compile_ok(props));
    sprintf(props + n, ",\"p%d\":{}}}", KVB_JSON_SCHEMA_MAX_PROPS);
    expect_refused_schema(props, "'properties' declares 65 properties; at most 64");
    /* required: at most 64 names */
    char *req = repeat("{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"a\"", ",\"a\"", 64, "]}");
    expect_refused_schema(req, "'required' has 65 names");
    free(req);
    /* a huge enum: refused by its size */
    char *big_enum = repeat("{\"type\":\"object\",\"properties\":{\"e\":{\"enum\":[0", ",1", 100000, "]}}}");
    expect_refused_schema(big_enum, "schema.properties.e: 'enum' has 100001 values; at most 64");
    free(big_enum);
    char *e64 = repeat("{\"type\":\"object\",\"properties\":{\"e\":{\"enum\":[0", ",1", 63, "]}}}");
    kvb_json_schema_free(compile_ok(e64));
    free(e64);
    /* subschemas: 1024 in all (node 0, "any value", is one); 17 objects of 63 properties are more */
    n = (size_t)sprintf(props, "{\"type\":\"object\",\"properties\":{");
    for (int o = 0; o < 17; o++) {
        n += (size_t)sprintf(props + n, "%s\"o%d\":{\"type\":\"object\",\"properties\":{", o ? "," : "", o);
        for (int i = 0; i < 63; i++) n += (size_t)sprintf(props + n, "%s\"p%d\":{}", i ? "," : "", i);
        n += (size_t)sprintf(props + n, "}}");
    }
    strcpy(props + n, "}}");
    expect_refused_schema(props, "more than 1024 subschemas");
    /* a name of more than 1024 bytes as JSON; and 256 KiB of names and values in all */
    char *long_name = repeat("{\"type\":\"object\",\"properties\":{\"", "x", 1100, "\":{}}}");
    expect_refused_schema(long_name, "at most 1024");
    free(long_name);
    char *value = repeat("\"", "v", 1000, "\"");
    size_t cap = 64 * 1024 * 8, at = 0;
    char *huge = malloc(cap + 1000);
    at += (size_t)sprintf(huge + at, "{\"type\":\"object\",\"properties\":{");
    for (int p = 0; p < 6; p++) {
        at += (size_t)sprintf(huge + at, "%s\"e%d\":{\"enum\":[", p ? "," : "", p);
        for (int v = 0; v < 64; v++) {
            at += (size_t)sprintf(huge + at, "%s%s", v ? "," : "", value);
            huge[at - 2] = (char)('a' + v % 26); /* distinct enough; duplicates are allowed anyway */
        }
        at += (size_t)sprintf(huge + at, "]}");
    }
    strcpy(huge + at, "}}");
    expect_refused_schema(huge, "more than 262144 bytes");
    free(huge);
    free(value);
    /* 17 anyOf alternatives */
    char *alts = repeat("{\"type\":\"object\",\"properties\":{\"a\":{\"anyOf\":[{\"type\":\"null\"}", ",{\"type\":\"null\"}", 16,
                        "]}}}");
    expect_refused_schema(alts, "schema.properties.a: 'anyOf' has 17 alternatives; at most 16");
    free(alts);
    free(props);
}

/* ---- texts and prefixes ------------------------------------------------------------------------- */

/* Every prefix of doc accepted, only the whole complete. */
static void expect_valid(const kvb_json_schema *sch, const char *doc) {
    const size_t n = strlen(doc);
    kvb_json_state s;
    kvb_json_init_schema(&s, sch);
    for (size_t i = 0; i < n; i++) {
        if (!kvb_json_feed(&s, doc + i, 1)) fail_msg("'%s' refused at byte %zu", doc, i);
        if (kvb_json_complete(&s) != (i + 1 == n)) fail_msg("'%s': complete after %zu bytes", doc, i + 1);
    }
}

/* `ok` accepted (and not complete), then the first byte of `bad` refused. */
static void expect_refused(const kvb_json_schema *sch, const char *ok, const char *bad) {
    kvb_json_state s;
    kvb_json_init_schema(&s, sch);
    if (!kvb_json_feed(&s, ok, strlen(ok))) fail_msg("'%s' refused before '%s'", ok, bad);
    if (kvb_json_complete(&s)) fail_msg("'%s' complete", ok);
    if (kvb_json_feed(&s, bad, 1)) fail_msg("'%s' accepted '%c' (of '%s')", ok, bad[0], bad);
}

typedef struct {
    const char *ok, *bad; /* bad NULL: ok is a valid whole text */
} text_case;

static void run_cases(const char *schema, const text_case *cases, size_t n) {
    kvb_json_schema *sch = compile_ok(schema);
    for (size_t i = 0; i < n; i++) {
        if (cases[i].bad) expect_refused(sch, cases[i].ok, cases[i].bad);
        else expect_valid(sch, cases[i].ok);
    }
    kvb_json_schema_free(sch);
}
#define RUN(schema, cases) run_cases(schema, cases, sizeof cases / sizeof *cases)

static void test_objects_and_scalars(void **state) {
    (void)state;
    /* properties in declared order: name, age, tags, kind, ok, x; name and kind required */
    static const char *const person =
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
        "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":2},"
        "\"kind\":{\"enum\":[\"cat\",\"dog\",null,1,10,2.5,true]},\"ok\":{\"type\":\"boolean\"},"
        "\"x\":{\"type\":[\"number\",\"null\"]}},\"required\":[\"name\",\"kind\"],\"additionalProperties\":false}";
    static const text_case cases[] = {
        {"{\"name\":\"a\",\"kind\":\"cat\"}", NULL},
        {"{ \"name\" : \"a\\\"b\\u00e9\" , \"age\" : -12 , \"tags\" : [ \"x\" , \"y\" ] , \"kind\" : null , \"ok\" : false ,"
         " \"x\" : 1.5e3 }", NULL},
        {"{\n  \"name\": \"\",\n  \"kind\": 10\n}", NULL},
        {"{\"name\":\"\",\"kind\":1}", NULL},
        {"{\"name\":\"\",\"kind\":true,\"x\":null}", NULL},
        {"{\"name\":\"\",\"age\":0,\"tags\":[],\"kind\":2.5,\"ok\":true,\"x\":-0.5E-2}", NULL},
        {"{", "}"},                                          /* name is required */
        {"{\"", "age\""},                                    /* and comes first */
        {"{\"name\":\"a\",\"", "x\":1}"},                    /* kind is required before x */
        {"{\"name\":\"a\",\"kind\":\"c", "ow\"}"},           /* an enum value diverges */
        {"{\"name\":\"a\",\"kind\":\"cat", "s\"}"},
        {"{\"name\":\"a\",\"kind\":1", "1}"},                /* "11" is none of 1, 10 */
        {"{\"name\":\"a\",\"kind\":1", ".5}"},
        {"{\"name\":\"a\",\"kind\":2", "}"},                 /* "2" is no value: 2.5 is */
        {"{\"name\":\"a\",\"kind\":\"", "Cat\"}"},
        {"{\"name\":\"a\",\"kind\":", "false}"},
        {"{\"name\":\"a\",\"kind\":\"", "\\u0063at\"}"},    /* enum strings are written canonically */
        {"{\"name\":\"a\",\"age\":1", ".5}"},                /* an integer */
        {"{\"name\":\"a\",\"age\":1", "e5}"},
        {"{\"name\":\"a\",\"age\":", "\"1\"}"},
        {"{\"name\":\"a\",\"age\":-", "a}"},
        {"{\"name\":\"a\",\"tags\":[\"x\",\"y\"", ",\"z\"]}"}, /* maxItems 2 */
        {"{\"name\":\"a\",\"tags\":[", "1]}"},
        {"{\"name\":\"a\",\"kind\":\"cat\",\"ok\":true,\"x\":1", ",}"}, /* no property left after x */
        {"{\"name\":\"a\",\"kind\":\"cat\",\"", "name\":\"b\"}"},        /* each property once, in order */
        {"{\"name\":\"a\",\"kind\":\"cat\",\"", "age\":1}"},
        {"{\"name\":\"a\",\"kind\":\"cat\",", "}"},
        {"{\"name\":\"a\",\"kind\":\"cat\",\"x\":", "true}"},
        {"{\"name\":\"a\",\"kind\":\"cat\",\"ok\":", "null}"},
        {"{\"", "\\u006eame\":\"a\"}"},                      /* names are written canonically too */
        {"{\"nam", "\"}"},
        {"{\"na", " me\":\"a\"}"},                          /* no blank inside a name, only around it */
        {"{\"name\":\"a\",\"kind\":\"cat\",\"ok\":true,\"", "ok\":true}"},
    };
    RUN(person, cases);
    kvb_json_schema *sch = compile_ok(person);
    kvb_json_state s;
    kvb_json_init_schema(&s, sch);
    const char *whole = "{\"name\":\"a\",\"kind\":\"cat\"}";
    assert_true(kvb_json_feed(&s, whole, strlen(whole)) && kvb_json_complete(&s));
    assert_false(kvb_json_feed(&s, " ", 1)); /* nothing after the object, not even a blank */
    kvb_json_schema_free(sch);

    /* optional properties around a required one: a (optional), b (required), c (optional) */
    static const text_case order[] = {
        {"{\"b\":1}", NULL}, {"{\"a\":1,\"b\":2}", NULL}, {"{\"a\":1,\"b\":2,\"c\":3}", NULL}, {"{\"b\":2,\"c\":3}", NULL},
        {"{\"", "c\":1}"}, {"{\"b\":2,\"a", "\":1}"}, {"{\"a\":1", "}"}, {"{\"a\":1,\"", "c\":1}"},
        {"{\"a", "b\":true}"}, {"{\"a\":1,\"b\":2,\"ab\":false}", NULL}, {"{\"b\":2,\"ab\":false,\"", "ab\""},
    };
    RUN("{\"type\":\"object\",\"properties\":{\"a\":{},\"b\":{},\"ab\":{\"type\":\"boolean\"},\"c\":{}},\"required\":[\"b\"]}", order);
    /* odd names: escapes, a name that is another's prefix, UTF-8, the empty name */
    static const text_case names[] = {
        {"{\"q\\\"t\":1,\"x\\\\y\":2,\"n\\n\":3,\"c\\u0001\":4,\"\xc3\xa9/\":5,\"\":6,\"ab\":7,\"abc\":8}", NULL},
        {"{\"q\\\"t\":1,\"x\\", "/y\":2}"},
        {"{\"\xc3\xa9", "\\/\":5}"},
        {"{\"", "\\u00e9/\":5}"},
        {"{\"ab\":7,\"abc\":8}", NULL},
        {"{\"abc\":8}", NULL},
        {"{\"ab\":7,\"ab", "\":8}"},
        {"{\"c", "\x01\":4}"}, {"{\"c\\u000", "2\":4}"},
    };
    RUN("{\"type\":\"object\",\"properties\":{\"q\\\"t\":{},\"x\\\\y\":{},\"n\\n\":{},\"c\\u0001\":{},\"\xc3\xa9/\":{},"
        "\"\":{},\"ab\":{},\"abc\":{}}}", names);
}

static void test_free_objects_and_any(void **state) {
    (void)state;
    static const text_case any_object[] = { /* {"type": "object"}: json_object's language */
        {"{}", NULL}, {"{\"a\":[1,{\"b\":null}],\"c\":\"x\",\"a\":true}", NULL}, {"", "[]"}, {"{\"a\":1,", "}"},
    };
    RUN("{\"type\":\"object\"}", any_object);
    RUN("{\"type\":\"object\",\"additionalProperties\":true}", any_object);
    kvb_json_schema *sch = compile_ok("{\"type\":\"object\",\"additionalProperties\":false}");
    expect_valid(sch, "{}");
    expect_valid(sch, "{ \n}");
    expect_refused(sch, "{", "\"a\":1}");
    kvb_json_schema_free(sch);
    static const text_case empty_props[] = {{"{}", NULL}, {"{", "\"a\":1}"}};
    RUN("{\"type\":\"object\",\"properties\":{}}", empty_props);
    /* {} and metadata-only schemas are any value, nested containers included */
    static const text_case any[] = {
        {"{\"meta\":{\"x\":[1,2,{\"y\":null}],\"z\":\"s\"},\"list\":[1,\"a\",[],{}],\"m2\":-0.0e0}", NULL},
        {"{\"meta\":[[[[]]]]}", NULL}, {"{\"meta\":\"\\ud83d\\ude00\"}", NULL},
        {"{\"meta\":", "}"}, {"{\"list\":", "{}}"}, {"{\"list\":[1,", "]}"}, {"{\"meta\":{\"x\":1", "]}"},
    };
    RUN("{\"type\":\"object\",\"properties\":{\"meta\":{},\"list\":{\"type\":\"array\",\"title\":\"L\"},\"m2\":{\"description\":\"d\"}}}", any);
}

/* minLength / maxLength count code points: raw UTF-8 of 1 to 4 bytes, escapes, an escaped
 * surrogate pair (one), a lone surrogate (one); refused at the first byte past the bound, and
 * only a pairing low surrogate's escape may follow a full count that ends in a high one. */
static void test_string_lengths(void **state) {
    (void)state;
    static const char *const lens =
        "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"maxLength\":2},\"b\":{\"type\":\"string\","
        "\"minLength\":2,\"maxLength\":3},\"c\":{\"type\":[\"string\",\"null\"],\"minLength\":1},\"z\":{\"type\":"
        "\"string\",\"maxLength\":0}}}";
    static const text_case cases[] = {
        {"{\"a\":\"\"}", NULL},
        {"{\"a\":\"xy\"}", NULL},
        {"{\"a\":\"\xc3\xa9\xf0\x9f\x98\x80\"}", NULL},                 /* 2 and 4 bytes: two characters */
        {"{\"a\":\"\\n\\u00e9\"}", NULL},
        {"{\"a\":\"x\\ud83d\\ude00\"}", NULL},                          /* a pair is one */
        {"{\"a\":\"\\uD83D\\uDE00\\u0041\"}", NULL},                      /* upper-case hex: two */
        {"{\"a\":\"xy", "z\"}"},
        {"{\"a\":\"xy", "\\n\"}"},
        {"{\"a\":\"xy", "\xc3\xa9\"}"},
        {"{\"a\":\"x\\ud83d\\", "n\"}"},                                  /* full after a high: only \u... */
        {"{\"a\":\"x\\ud83d\\u", "0041\"}"},                              /* ... d */
        {"{\"a\":\"x\\ud83d\\ud", "800\"}"},                              /* ... dc-df */
        {"{\"a\":\"xy", "\\ude00\"}"},                                     /* no high before: no escape at all */
        {"{\"a\":\"x\\udc00", "y\"}"},                                     /* a lone low surrogate is one */
        {"{\"b\":\"x", "\"}"},                                             /* minLength 2 */
        {"{\"b\":\"\\ud83d\\ude00", "\"}"},                                /* one character */
        {"{\"b\":\"\\ud83d\\ude00\xc3\xa9\"}", NULL},
        {"{\"b\":\"abc", "d\"}"},
        {"{\"c\":null}", NULL},
        {"{\"c\":\"", "\"}"},
        {"{\"z\":\"\"}", NULL},
        {"{\"z\":\"", "a\"}"},
    };
    RUN(lens, cases);
    static const struct { const char *schema, *words; } bad[] = {
        {OBJ("\"a\":{\"minLength\":-1}"), "'minLength' must be an integer in [0, 65535]"},
        {OBJ("\"a\":{\"maxLength\":65536}"), "'maxLength' must be an integer in [0, 65535]"},
        {OBJ("\"a\":{\"maxLength\":1.5}"), "'maxLength' must be an integer"},
        {OBJ("\"a\":{\"minLength\":3,\"maxLength\":2}"), "'minLength' (3) is more than 'maxLength' (2)"},
        {OBJ("\"a\":{\"enum\":[\"x\"],\"maxLength\":2}"), "'maxLength' beside 'enum' is not supported"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) expect_refused_schema(bad[i].schema, bad[i].words);
}

static void test_arrays(void **state) {
    (void)state;
    static const char *const points =
        "{\"type\":\"object\",\"properties\":{\"pts\":{\"type\":\"array\",\"minItems\":2,\"maxItems\":3,\"items\":"
        "{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\"},\"y\":{\"type\":\"integer\"}},"
        "\"required\":[\"x\",\"y\"],\"additionalProperties\":false}},\"e\":{\"type\":\"array\",\"maxItems\":0},"
        "\"m\":{\"type\":\"array\",\"minItems\":1,\"items\":{\"enum\":[1,2]}}},\"required\":[\"pts\"]}";
    static const text_case cases[] = {
        {"{\"pts\":[{\"x\":1,\"y\":2},{\"x\":-3,\"y\":0}]}", NULL},
        {"{\"pts\":[ {\"x\":1,\"y\":2} , {\"x\":3,\"y\":4} , {\"x\":5,\"y\":6} ],\"e\":[ ],\"m\":[1,2,2,1,1,1,1,1,1,1,1,2]}", NULL},
        {"{\"pts\":[", "]}"},
        {"{\"pts\":[{\"x\":1,\"y\":2}", "]}"},                                          /* minItems 2 */
        {"{\"pts\":[{\"x\":1,\"y\":2},{\"x\":1,\"y\":2},{\"x\":1,\"y\":2}", ",{}]}"},    /* maxItems 3 */
        {"{\"pts\":[{\"", "y\":1}]}"},
        {"{\"pts\":[{\"x\":1", "}]}"},
        {"{\"pts\":[{\"x\":1,\"y\":2", ",\"z\":3}]}"},
        {"{\"pts\":[{\"x\":1,\"y\":2},{\"x\":1,\"y\":2}],\"e\":[", "1]}"},              /* maxItems 0 */
        {"{\"pts\":[{\"x\":1,\"y\":2},{\"x\":1,\"y\":2}],\"m\":[", "]}"},               /* minItems 1 */
        {"{\"pts\":[{\"x\":1,\"y\":2},{\"x\":1,\"y\":2}],\"m\":[", "3]}"},
        {"{\"pts\":[{\"x\":1,\"y\":2},{\"x\":1,\"y\":2}],\"m\":[1", "0]}"},
    };
    RUN(points, cases);
    /* maxItems 255 */
    kvb_json_schema *sch = compile_ok("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"minItems\":255,"
                                      "\"maxItems\":255,\"items\":{\"type\":\"null\"}}}}");
    char *full = repeat("{\"a\":[null", ",null", 254, "]}");
    expect_valid(sch, full);
    full[strlen(full) - 2] = '\0';
    expect_refused(sch, full, ",null]}");
    char *less = repeat("{\"a\":[null", ",null", 253, "");
    expect_refused(sch, less, "]}");
    kvb_json_schema_free(sch);
    free(full);
    free(less);
}

static void test_enum_const_any_of(void **state) {
    (void)state;
    static const text_case consts[] = {
        {"{\"k\":\"a\\\"b\\\\c\\n\\u0001\xc3\xa9/\",\"n\":100,\"f\":0.1,\"big\":1e+300,\"neg\":-2,\"t\":true}", NULL},
        {"{\"k\":\"a\\\"b\\\\c\\n\\u0001\xc3\xa9", "\\/\"}"},
        {"{\"k\":\"a\\\"b\\\\c\\n\\u000", "2\xc3\xa9/\"}"},
        {"{\"k\":\"a\\\"b\\\\c\\n\\u0001\xc3\xa9/\",\"n\":1", "e2}"},
        {"{\"k\":\"a\\\"b\\\\c\\n\\u0001\xc3\xa9/\",\"n\":10", "}"},
        {"{\"k\":\"a\\\"b\\\\c\\n\\u0001\xc3\xa9/\",\"n\":100", "0}"},
        {"{\"k\":\"a\\\"b\\\\c\\n\\u0001\xc3\xa9/\",\"f\":", ".1}"},
        {"{\"k\":\"a\\\"b\\\\c\\n\\u0001\xc3\xa9/\",\"t\":t", "x}"},
    };
    RUN("{\"type\":\"object\",\"properties\":{\"k\":{\"const\":\"a\\\"b\\\\c\\n\\u0001\xc3\xa9\\/\"},\"n\":{\"const\":100},"
        "\"f\":{\"const\":0.1},\"big\":{\"const\":1e300},\"neg\":{\"const\":-2.0},\"t\":{\"const\":true}},\"required\":[\"k\"]}",
        consts);
    kvb_json_schema *sch = compile_ok("{\"type\":\"object\",\"properties\":{\"t\":{\"const\":true}}}");
    expect_refused(sch, "{\"t\":tru", "}");
    kvb_json_schema_free(sch);
    /* enum with type: only the values of the type remain */
    static const text_case typed[] = {
        {"{\"i\":1,\"s\":\"x\"}", NULL}, {"{\"i\":", "2.5}"}, {"{\"i\":1,\"s\":", "1}"}, {"{\"i\":", "\"x\"}"},
    };
    RUN("{\"type\":\"object\",\"properties\":{\"i\":{\"type\":\"integer\",\"enum\":[1,2.5,\"x\"]},"
        "\"s\":{\"type\":[\"string\",\"boolean\"],\"enum\":[1,\"x\"]}}}", typed);
    /* anyOf: the first byte picks the alternative */
    static const text_case alts[] = {
        {"{\"v\":\"s\"}", NULL}, {"{\"v\":-1}", NULL}, {"{\"v\":[true,false]}", NULL}, {"{\"v\":null}", NULL},
        {"{\"v\":{\"w\":\"b\"}}", NULL}, {"{\"v\":\"a\"}", NULL},
        {"{\"v\":1", ".5}"}, {"{\"v\":", "true}"}, {"{\"v\":[", "1]}"}, {"{\"v\":{\"w\":\"", "c\"}}"},
        {"{\"v\":{", "}}"},
    };
    RUN("{\"type\":\"object\",\"properties\":{\"v\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"integer\"},"
        "{\"type\":\"array\",\"items\":{\"type\":\"boolean\"}},{\"type\":\"null\"},{\"anyOf\":[{\"type\":\"object\","
        "\"properties\":{\"w\":{\"enum\":[\"a\",\"b\"]}},\"required\":[\"w\"]}]}]}},\"required\":[\"v\"]}", alts);
    /* enum values that are prefixes of one another, of every kind */
    static const text_case prefixes[] = {
        {"{\"e\":1}", NULL}, {"{\"e\":10}", NULL}, {"{\"e\":100}", NULL}, {"{\"e\":-1}", NULL}, {"{\"e\":1.5}", NULL},
        {"{\"e\":\"a\"}", NULL}, {"{\"e\":\"ab\"}", NULL}, {"{\"e\":\"\"}", NULL},
        {"{\"e\":10", "1}"}, {"{\"e\":1.", "}"}, {"{\"e\":-1", "0}"}, {"{\"e\":\"a", "c\"}"},
        {"{\"e\":1 ", "0}"}, /* a blank ends a number */
    };
    RUN("{\"type\":\"object\",\"properties\":{\"e\":{\"enum\":[1,10,100,-1,1.5,\"a\",\"ab\",\"\"]}},\"required\":[\"e\"]}", prefixes);
}

/* ---- an independent validator over the raw text ----------------------------------------------------
 * A recursive descent that reads the text as the schema's subset says (schemas taken from cJSON as
 * written, anyOf by trying each alternative, names and enum values compared with their canonical
 * text), with the recognizer's limits: no blank before the object or after it, at most 32 in a row,
 * at most 64 levels. */

static void canonical(const cJSON *v, char *out) {
    if (cJSON_IsString(v)) {
        size_t n = 0;
        out[n++] = '"';
        for (const unsigned char *c = (const unsigned char *)v->valuestring; *c; c++) {
            if (*c == '"' || *c == '\\') { out[n++] = '\\'; out[n++] = (char)*c; }
            else if (*c == '\n') n += (size_t)sprintf(out + n, "\\n");
            else if (*c == '\t') n += (size_t)sprintf(out + n, "\\t");
            else if (*c == '\r') n += (size_t)sprintf(out + n, "\\r");
            else if (*c == '\b') n += (size_t)sprintf(out + n, "\\b");
            else if (*c == '\f') n += (size_t)sprintf(out + n, "\\f");
            else if (*c < 0x20) n += (size_t)sprintf(out + n, "\\u%04x", *c);
            else out[n++] = (char)*c;
        }
        out[n++] = '"';
        out[n] = 0;
    } else if (cJSON_IsNumber(v)) {
        const double d = v->valuedouble;
        if (d == floor(d) && fabs(d) < 1e21) sprintf(out, "%.0f", d);
        else
            for (int p = 1; p <= 17; p++) {
                sprintf(out, "%.*g", p, d);
                if (strtod(out, NULL) == d) break;
            }
    } else strcpy(out, cJSON_IsTrue(v) ? "true" : cJSON_IsFalse(v) ? "false" : "null");
}

typedef struct {
    const char *s;
    size_t n, i;
    int depth;
} vtext;

static int peek(const vtext *t) { return t->i < t->n ? (unsigned char)t->s[t->i] : -1; }
static bool v_ws(vtext *t) {
    int run = 0;
    while (peek(t) == ' ' || peek(t) == '\n' || peek(t) == '\t' || peek(t) == '\r') t->i++, run++;
    return run <= KVB_JSON_MAX_WS;
}
/* A JSON string; *chars: its length as JSON Schema counts it, in code points (a UTF-8 character,
 * an escape, and an escaped surrogate pair each one). */
static bool v_string_chars(vtext *t, unsigned *chars) {
    if (peek(t) != '"') return false;
    t->i++;
    unsigned count = 0;
    bool after_high = false;
    for (;;) {
        const int c = peek(t);
        if (c < 0x20) return false; /* the end (-1) or a control byte */
        t->i++;
        if (c == '"') break;
        if (c != '\\') {
            if ((c & 0xC0) != 0x80) count++, after_high = false; /* not a continuation byte */
            continue;
        }
        const int e = peek(t);
        t->i++;
        if (e == 'u') {
            unsigned v = 0;
            for (int k = 0; k < 4; k++, t->i++) {
                const int h = peek(t);
                if (h <= 0 || !strchr("0123456789abcdefABCDEF", h)) return false;
                v = v * 16 + (unsigned)(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
            }
            const bool low = v >= 0xDC00 && v <= 0xDFFF;
            if (!(low && after_high)) count++;
            after_high = v >= 0xD800 && v <= 0xDBFF;
        } else if (e < 0 || !strchr("\"\\/bfnrt", e)) return false;
        else count++, after_high = false;
    }
    if (chars) *chars = count;
    return true;
}
static bool v_string(vtext *t) { return v_string_chars(t, NULL); }
static bool digit(int c) { return c >= '0' && c <= '9'; }
static bool v_number(vtext *t, bool *integer) {
    *integer = true;
    if (peek(t) == '-') t->i++;
    if (peek(t) == '0') t->i++;
    else if (digit(peek(t))) while (digit(peek(t))) t->i++;
    else return false;
    if (peek(t) == '.') {
        *integer = false;
        t->i++;
        if (!digit(peek(t))) return false;
        while (digit(peek(t))) t->i++;
    }
    if (peek(t) == 'e' || peek(t) == 'E') {
        *integer = false;
        t->i++;
        if (peek(t) == '+' || peek(t) == '-') t->i++;
        if (!digit(peek(t))) return false;
        while (digit(peek(t))) t->i++;
    }
    return true;
}
static bool v_word(vtext *t, const char *w) {
    const size_t k = strlen(w);
    if (t->n - t->i < k || memcmp(t->s + t->i, w, k) != 0) return false;
    t->i += k;
    return true;
}

enum { VT_OBJ = 1, VT_ARR = 2, VT_STR = 4, VT_NUM = 8, VT_INT = 16, VT_BOOL = 32, VT_NULL = 64, VT_ALL = 127 };
static unsigned v_types(const cJSON *sch) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(sch, "type");
    if (!t) return VT_ALL;
    static const char *const names[] = {"object", "array", "string", "number", "integer", "boolean", "null"};
    unsigned m = 0;
    const cJSON *one = cJSON_IsString(t) ? t : t->child;
    for (; one; one = cJSON_IsString(t) ? NULL : one->next)
        for (unsigned i = 0; i < 7; i++)
            if (strcmp(one->valuestring, names[i]) == 0) m |= 1u << i;
    return m;
}

static bool v_value(vtext *t, const cJSON *sch);

static bool v_object(vtext *t, const cJSON *sch) {
    if (++t->depth > KVB_JSON_MAX_DEPTH) return false;
    t->i++; /* '{' */
    const cJSON *props = sch ? cJSON_GetObjectItemCaseSensitive(sch, "properties") : NULL;
    const cJSON *add = sch ? cJSON_GetObjectItemCaseSensitive(sch, "additionalProperties") : NULL;
    const bool closed = props || cJSON_IsFalse(add);
    int last = -1;
    uint64_t seen = 0;
    if (!v_ws(t)) return false;
    if (peek(t) == '}') t->i++;
    else
        for (;;) {
            const size_t k0 = t->i;
            if (!v_string(t)) return false;
            const cJSON *value_schema = NULL;
            if (closed) {
                int found = -1, j = 0;
                char name[4096];
                for (const cJSON *p = props ? props->child : NULL; p && found < 0; p = p->next, j++) {
                    cJSON tmp = {.type = cJSON_String, .valuestring = p->string};
                    canonical(&tmp, name);
                    if (strlen(name) == t->i - k0 && memcmp(name, t->s + k0, t->i - k0) == 0) found = j, value_schema = p;
                }
                if (found <= last) return false; /* undeclared, repeated or out of order */
                last = found;
                seen |= (uint64_t)1 << found;
            }
            if (!v_ws(t) || peek(t) != ':') return false;
            t->i++;
            if (!v_ws(t) || !v_value(t, value_schema) || !v_ws(t)) return false;
            if (peek(t) == '}') { t->i++; break; }
            if (peek(t) != ',') return false;
            t->i++;
            if (!v_ws(t)) return false;
        }
    const cJSON *req = sch ? cJSON_GetObjectItemCaseSensitive(sch, "required") : NULL;
    for (const cJSON *r = req ? req->child : NULL; r; r = r->next) {
        int j = 0;
        for (const cJSON *p = props ? props->child : NULL; p; p = p->next, j++)
            if (strcmp(p->string, r->valuestring) == 0 && !((seen >> j) & 1)) return false;
    }
    t->depth--;
    return true;
}

static bool v_array(vtext *t, const cJSON *sch) {
    if (++t->depth > KVB_JSON_MAX_DEPTH) return false;
    t->i++; /* '[' */
    const cJSON *items = sch ? cJSON_GetObjectItemCaseSensitive(sch, "items") : NULL;
    const cJSON *lo = sch ? cJSON_GetObjectItemCaseSensitive(sch, "minItems") : NULL;
    const cJSON *hi = sch ? cJSON_GetObjectItemCaseSensitive(sch, "maxItems") : NULL;
    int count = 0;
    if (!v_ws(t)) return false;
    if (peek(t) == ']') t->i++;
    else
        for (;;) {
            if (!v_value(t, items) || !v_ws(t)) return false;
            count++;
            if (peek(t) == ']') { t->i++; break; }
            if (peek(t) != ',') return false;
            t->i++;
            if (!v_ws(t)) return false;
        }
    t->depth--;
    return (!lo || count >= lo->valueint) && (!hi || count <= hi->valueint);
}

/* A value under sch (NULL: any value). */
static bool v_value(vtext *t, const cJSON *sch) {
    const cJSON *any_of = sch ? cJSON_GetObjectItemCaseSensitive(sch, "anyOf") : NULL;
    if (any_of) {
        for (const cJSON *alt = any_of->child; alt; alt = alt->next) {
            vtext save = *t;
            if (v_value(t, alt)) return true;
            *t = save;
        }
        return false;
    }
    const unsigned types = sch ? v_types(sch) : VT_ALL;
    const cJSON *en = sch ? cJSON_GetObjectItemCaseSensitive(sch, "enum") : NULL;
    const cJSON *co = sch ? cJSON_GetObjectItemCaseSensitive(sch, "const") : NULL;
    const int c = peek(t);
    if (en || co) { /* one scalar token, compared with the values of the types */
        const size_t k0 = t->i;
        bool integer;
        if (c == '"') { if (!v_string(t)) return false; }
        else if (c == '-' || digit(c)) { if (!v_number(t, &integer)) return false; }
        else if (!v_word(t, "true") && !v_word(t, "false") && !v_word(t, "null")) return false;
        for (const cJSON *v = co ? co : en->child; v; v = co ? NULL : v->next) {
            const bool fits = cJSON_IsString(v) ? types & VT_STR
                            : cJSON_IsNumber(v) ? (types & VT_NUM) || ((types & VT_INT) && v->valuedouble == floor(v->valuedouble))
                            : cJSON_IsBool(v) ? types & VT_BOOL : types & VT_NULL;
            char text[4096];
            canonical(v, text);
            if (fits && strlen(text) == t->i - k0 && memcmp(text, t->s + k0, t->i - k0) == 0) return true;
        }
        return false;
    }
    bool integer;
    switch (c) {
    case '{': return (types & VT_OBJ) && v_object(t, sch);
    case '[': return (types & VT_ARR) && v_array(t, sch);
    case '"': {
        unsigned chars;
        if (!(types & VT_STR) || !v_string_chars(t, &chars)) return false;
        const cJSON *lo = sch ? cJSON_GetObjectItemCaseSensitive(sch, "minLength") : NULL,
                    *hi = sch ? cJSON_GetObjectItemCaseSensitive(sch, "maxLength") : NULL;
        return (!lo || chars >= (unsigned)lo->valueint) && (!hi || chars <= (unsigned)hi->valueint);
    }
    case 't': return (types & VT_BOOL) && v_word(t, "true");
    case 'f': return (types & VT_BOOL) && v_word(t, "false");
    case 'n': return (types & VT_NULL) && v_word(t, "null");
    default:
        if (c != '-' && !digit(c)) return false;
        if (!(types & (VT_NUM | VT_INT)) || !v_number(t, &integer)) return false;
        return (types & VT_NUM) || integer;
    }
}

static bool validate(const cJSON *schema, const char *text, size_t n) {
    vtext t = {.s = text, .n = n};
    return n > 0 && text[0] == '{' && v_value(&t, schema) && t.i == n;
}

/* ---- random schemas and instances ----------------------------------------------------------- */

static const char *const g_names[] = {"a", "ab", "abc", "b c", "q\"t", "x\\y", "n\nl", "\xc3\xa9", "", "k1", "k2", "z/"};
#define N_NAMES (sizeof g_names / sizeof *g_names)

static cJSON *gen_scalar_value(void) {
    static const double nums[] = {0, 1, 10, -1, 2.5, -0.25, 1e-7, 123456789, 100, 0.1};
    static const char *const strs[] = {"a", "ab", "abc", "x y", "q\"", "back\\slash", "nl\n", "\xc3\xa9", "", "c\x01"};
    switch (kvbt_rnd(5)) {
    case 0: return cJSON_CreateNumber(nums[kvbt_rnd(10)]);
    case 1: return cJSON_CreateBool(kvbt_rnd(2));
    case 2: return cJSON_CreateNull();
    default: return cJSON_CreateString(strs[kvbt_rnd(10)]);
    }
}

static cJSON *gen_schema(int depth);

/* A closed object of up to 4 properties (names in a random order), some required. */
static cJSON *gen_closed_object(int depth) {
    cJSON *o = cJSON_CreateObject(), *props = cJSON_CreateObject(), *req = cJSON_CreateArray();
    cJSON_AddStringToObject(o, "type", "object");
    bool used[N_NAMES] = {0};
    for (uint32_t k = kvbt_rnd(5), i = 0; i < k; i++) {
        uint32_t j = kvbt_rnd(N_NAMES);
        if (used[j]) continue;
        used[j] = true;
        cJSON_AddItemToObject(props, g_names[j], gen_schema(depth + 1));
        if (kvbt_rnd(2)) cJSON_AddItemToArray(req, cJSON_CreateString(g_names[j]));
    }
    cJSON_AddItemToObject(o, "properties", props);
    cJSON_AddItemToObject(o, "required", req);
    if (kvbt_rnd(2)) cJSON_AddBoolToObject(o, "additionalProperties", false);
    return o;
}

static cJSON *gen_typed(const char *type) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", type);
    return o;
}

static cJSON *gen_schema(int depth) {
    const uint32_t kind = depth >= 3 ? 3 + kvbt_rnd(10) : kvbt_rnd(13);
    cJSON *o;
    switch (kind) {
    case 0: return gen_closed_object(depth);
    case 1: return gen_typed("object");
    case 2: {
        o = gen_typed("array");
        if (kvbt_rnd(3)) cJSON_AddItemToObject(o, "items", gen_schema(depth + 1));
        const int lo = (int)kvbt_rnd(3);
        if (kvbt_rnd(2)) cJSON_AddNumberToObject(o, "minItems", lo);
        if (kvbt_rnd(2)) cJSON_AddNumberToObject(o, "maxItems", lo + (int)kvbt_rnd(3));
        return o;
    }
    case 3: {
        o = gen_typed("string");
        const int lo = (int)kvbt_rnd(3);
        if (kvbt_rnd(3) == 0) cJSON_AddNumberToObject(o, "minLength", lo);
        if (kvbt_rnd(3) == 0) cJSON_AddNumberToObject(o, "maxLength", lo + (int)kvbt_rnd(3));
        return o;
    }
    case 4: return gen_typed("number");
    case 5: return gen_typed("integer");
    case 6: return gen_typed("boolean");
    case 7: return gen_typed("null");
    case 8: {
        o = cJSON_CreateObject();
        cJSON *e = cJSON_AddArrayToObject(o, "enum");
        for (uint32_t k = 1 + kvbt_rnd(5); k > 0; k--) cJSON_AddItemToArray(e, gen_scalar_value());
        return o;
    }
    case 9:
        o = cJSON_CreateObject();
        cJSON_AddItemToObject(o, "const", gen_scalar_value());
        return o;
    case 10: { /* alternatives of distinct types */
        o = cJSON_CreateObject();
        cJSON *alts = cJSON_AddArrayToObject(o, "anyOf");
        static const char *const kinds[] = {"string", "integer", "null", "boolean", "array", "object"};
        bool used[6] = {0};
        for (uint32_t k = 2 + kvbt_rnd(2), i = 0; i < k; i++) {
            const uint32_t j = kvbt_rnd(6);
            if (used[j]) continue;
            used[j] = true;
            cJSON *alt = j == 5 ? gen_closed_object(depth + 1) : gen_typed(kinds[j]);
            if (j == 4 && depth < 3) cJSON_AddItemToObject(alt, "items", gen_schema(depth + 2));
            cJSON_AddItemToArray(alts, alt);
        }
        return o;
    }
    case 11: o = cJSON_CreateObject(); cJSON_AddStringToObject(o, "title", "anything"); return o;
    default: {
        static const char *const pairs[][3] = {{"string", "null", NULL}, {"integer", "boolean", NULL}, {"number", "string", "null"}};
        const uint32_t p = kvbt_rnd(3);
        o = cJSON_CreateObject();
        cJSON *t = cJSON_AddArrayToObject(o, "type");
        for (int i = 0; i < 3 && pairs[p][i]; i++) cJSON_AddItemToArray(t, cJSON_CreateString(pairs[p][i]));
        return o;
    }
    }
}

static void gen_instance(char *buf, size_t *n, const cJSON *sch, int depth);

static void gen_instance(char *buf, size_t *n, const cJSON *sch, int depth) {
    const cJSON *any_of = cJSON_GetObjectItemCaseSensitive(sch, "anyOf");
    if (any_of) {
        gen_instance(buf, n, cJSON_GetArrayItem(any_of, (int)kvbt_rnd((uint32_t)cJSON_GetArraySize(any_of))), depth);
        return;
    }
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(sch, "enum"), *co = cJSON_GetObjectItemCaseSensitive(sch, "const");
    if (en || co) {
        char text[4096];
        canonical(co ? co : cJSON_GetArrayItem(en, (int)kvbt_rnd((uint32_t)cJSON_GetArraySize(en))), text);
        kvbt_put(buf, n, text);
        return;
    }
    const unsigned types = v_types(sch);
    unsigned pick[7], k = 0;
    for (unsigned i = 0; i < 7; i++)
        if (types & (1u << i)) pick[k++] = 1u << i;
    const unsigned type = types == VT_ALL ? 0 : pick[kvbt_rnd(k)];
    switch (type) {
    case 0: kvbt_gen_json_value(buf, n, depth, 4); break;
    case VT_OBJ: {
        const cJSON *props = cJSON_GetObjectItemCaseSensitive(sch, "properties");
        if (!props && !cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(sch, "additionalProperties"))) {
            kvbt_gen_json_object(buf, n, depth, 4);
            break;
        }
        kvbt_put(buf, n, "{");
        kvbt_blanks(buf, n);
        bool first = true;
        const cJSON *req = cJSON_GetObjectItemCaseSensitive(sch, "required");
        for (const cJSON *p = props ? props->child : NULL; p; p = p->next) {
            bool required = false;
            for (const cJSON *r = req ? req->child : NULL; r; r = r->next) required = required || strcmp(r->valuestring, p->string) == 0;
            if (!required && kvbt_rnd(2)) continue;
            if (!first) {
                kvbt_put(buf, n, ",");
                kvbt_blanks(buf, n);
            }
            first = false;
            char name[4096];
            cJSON tmp = {.type = cJSON_String, .valuestring = p->string};
            canonical(&tmp, name);
            kvbt_put(buf, n, name);
            kvbt_blanks(buf, n);
            kvbt_put(buf, n, ":");
            kvbt_blanks(buf, n);
            gen_instance(buf, n, p, depth + 1);
            kvbt_blanks(buf, n);
        }
        kvbt_put(buf, n, "}");
        break;
    }
    case VT_ARR: {
        const cJSON *items = cJSON_GetObjectItemCaseSensitive(sch, "items");
        const cJSON *lo = cJSON_GetObjectItemCaseSensitive(sch, "minItems"), *hi = cJSON_GetObjectItemCaseSensitive(sch, "maxItems");
        const int min = lo ? lo->valueint : 0, max = hi ? hi->valueint : min + 3;
        const int count = min + (int)kvbt_rnd((uint32_t)(max - min + 1));
        kvbt_put(buf, n, "[");
        for (int i = 0; i < count; i++) {
            if (i) kvbt_put(buf, n, ",");
            kvbt_blanks(buf, n);
            if (items) gen_instance(buf, n, items, depth + 1);
            else kvbt_gen_json_value(buf, n, depth + 1, 4);
            kvbt_blanks(buf, n);
        }
        kvbt_put(buf, n, "]");
        break;
    }
    case VT_STR: {
        const cJSON *lo = cJSON_GetObjectItemCaseSensitive(sch, "minLength"), *hi = cJSON_GetObjectItemCaseSensitive(sch, "maxLength");
        if (!lo && !hi) {
            kvbt_gen_json_string(buf, n);
            break;
        }
        /* characters of one code point each: raw UTF-8 of 1..4 bytes, escapes, an escaped pair */
        static const char *const chars[] = {"a", " ", "\\n", "\\\"", "\\u00e9", "\xc3\xa9", "\xe2\x82\xac",
                                            "\xf0\x9f\x98\x80", "\\ud83d\\ude00", "\\uD83D\\uDE00", "\\udc00"};
        const int min = lo ? lo->valueint : 0, max = hi ? hi->valueint : min + 3;
        kvbt_put(buf, n, "\"");
        for (int k = min + (int)kvbt_rnd((uint32_t)(max - min + 1)); k > 0; k--)
            kvbt_put(buf, n, chars[kvbt_rnd(sizeof chars / sizeof *chars)]);
        kvbt_put(buf, n, "\"");
        break;
    }
    case VT_NUM: kvbt_gen_json_number(buf, n, false); break;
    case VT_INT: kvbt_gen_json_number(buf, n, true); break;
    case VT_BOOL: kvbt_put(buf, n, kvbt_rnd(2) ? "true" : "false"); break;
    default: kvbt_put(buf, n, "null");
    }
}

/* The root: an object with properties, or (one in eight) a free object. */
static cJSON *gen_root(void) {
    if (kvbt_rnd(8) == 0) return gen_typed("object");
    return gen_closed_object(0);
}

/* Completes an accepted prefix byte by byte (closing bytes first, then any that fits): a dead end
 * (no byte fits, the text not complete) fails the test. Returns the completed length. */
static size_t complete_greedily(const kvb_json_schema *sch, char *buf, size_t n, size_t cap) {
    static const char first[] = "\"}],:0tfn[{"; /* (after a digit: what ends the number) */
    kvb_json_state s;
    kvb_json_init_schema(&s, sch);
    if (!kvb_json_feed(&s, buf, n)) fail_msg("not a prefix: %.*s", (int)n, buf);
    while (!kvb_json_complete(&s)) {
        bool moved = false;
        for (int k = 0; k < 256 + (int)sizeof first - 1 && !moved; k++) {
            const char c = k < (int)sizeof first - 1 ? first[k] : (char)(k - ((int)sizeof first - 1));
            kvb_json_state t = s;
            if (kvb_json_feed(&t, &c, 1)) {
                s = t;
                buf[n++] = c;
                moved = true;
            }
        }
        if (!moved) fail_msg("dead end after '%.*s'", (int)n, buf);
        if (n + 1 >= cap) fail_msg("no end in sight after '%.*s'", (int)n, buf);
    }
    buf[n] = 0;
    return n;
}

/* Random schemas, random instances: the validator agrees with the generator, every prefix is
 * accepted and only the whole is complete; every single-byte mutation is complete exactly when the
 * validator says valid, and its longest accepted prefix completes to a valid text. */
static void test_random_schemas_and_instances(void **state) {
    (void)state;
    enum { CAP = 1 << 16 };
    char *buf = malloc(CAP), *mut = malloc(CAP);
    static const char alphabet[] = "{}[]\":,0123456789.eE+-tfnulrs \\abcxyz/\n";
    int schemas = 0, texts = 0, mutants_valid = 0, mutants = 0;
    for (int t = 0; t < 400; t++) {
        cJSON *js = gen_root();
        kvb_json_schema *sch = NULL;
        kvb_err err = {0};
        if (kvb_json_schema_compile(js, "schema", &sch, &err) != KVB_OK) {
            char *p = cJSON_PrintUnformatted(js);
            fail_msg("random schema %s refused: %s", p, err.msg);
        }
        schemas++;
        for (int k = 0; k < 10; k++) {
            size_t n = 0;
            gen_instance(buf, &n, js, 0);
            buf[n] = 0;
            texts++;
            if (!validate(js, buf, n)) {
                char *p = cJSON_PrintUnformatted(js);
                fail_msg("the validator refuses generated %s under %s", buf, p);
            }
            expect_valid(sch, buf);
            for (int m = 0; m < 8; m++) { /* replace, insert or delete one byte */
                const size_t at = kvbt_rnd((uint32_t)n);
                const char c = alphabet[kvbt_rnd(sizeof alphabet - 1)];
                size_t mn = 0;
                const uint32_t op = kvbt_rnd(3);
                memcpy(mut, buf, at);
                mn = at;
                if (op != 2) mut[mn++] = c;
                memcpy(mut + mn, buf + at + (op == 1 ? 0 : 1), n - at - (op == 1 ? 0 : 1));
                mn += n - at - (op == 1 ? 0 : 1);
                kvb_json_state s;
                kvb_json_init_schema(&s, sch);
                size_t acc = 0;
                while (acc < mn && kvb_json_feed(&s, mut + acc, 1)) acc++;
                const bool complete = acc == mn && kvb_json_complete(&s);
                const bool valid = validate(js, mut, mn);
                if (complete != valid) {
                    char *p = cJSON_PrintUnformatted(js);
                    fail_msg("'%.*s' under %s: recognizer %s, validator %s", (int)mn, mut, p,
                             complete ? "complete" : "not complete", valid ? "valid" : "invalid");
                }
                mutants++;
                mutants_valid += valid;
                if (!complete) { /* the accepted prefix still completes to a valid text */
                    const size_t cn = complete_greedily(sch, mut, acc, CAP);
                    if (!validate(js, mut, cn)) {
                        char *p = cJSON_PrintUnformatted(js);
                        fail_msg("completed '%.*s' is invalid under %s", (int)cn, mut, p);
                    }
                }
            }
        }
        kvb_json_schema_free(sch);
        cJSON_Delete(js);
    }
    print_message("%d schemas, %d texts, %d mutants (%d still valid)\n", schemas, texts, mutants, mutants_valid);
    assert_true(mutants_valid > 50);
    free(buf);
    free(mut);
}

/* Random walks: from the start, a random byte among those the recognizer accepts, up to 40 of them;
 * then completed greedily: the validator accepts every completion. */
static void test_random_walks(void **state) {
    (void)state;
    enum { CAP = 1 << 14 };
    char *buf = malloc(CAP);
    static const char alphabet[] = "{}[]\":,0123456789.eE+-tfnulrs \\abcqxyz/\n\x01\xc3\xa9";
    int completed_early = 0;
    for (int t = 0; t < 300; t++) {
        cJSON *js = gen_root();
        kvb_json_schema *sch = NULL;
        kvb_err err = {0};
        assert_int_equal(kvb_json_schema_compile(js, "schema", &sch, &err), KVB_OK);
        for (int w = 0; w < 10; w++) {
            kvb_json_state s;
            kvb_json_init_schema(&s, sch);
            size_t n = 0;
            for (int step = 0, len = (int)kvbt_rnd(40); step < len && !kvb_json_complete(&s); step++) {
                char ok[sizeof alphabet];
                int n_ok = 0;
                for (size_t a = 0; a < sizeof alphabet - 1; a++) {
                    kvb_json_state c = s;
                    if (kvb_json_feed(&c, &alphabet[a], 1)) ok[n_ok++] = alphabet[a];
                }
                if (!n_ok) break; /* only bytes outside the alphabet fit: the completion finds them */
                buf[n] = ok[kvbt_rnd((uint32_t)n_ok)];
                assert_true(kvb_json_feed(&s, &buf[n], 1));
                n++;
            }
            completed_early += kvb_json_complete(&s);
            const size_t cn = complete_greedily(sch, buf, n, CAP);
            if (!validate(js, buf, cn)) {
                char *p = cJSON_PrintUnformatted(js);
                fail_msg("walk '%.*s' completed as '%s' is invalid under %s", (int)n, buf, buf, p);
            }
        }
        kvb_json_schema_free(sch);
        cJSON_Delete(js);
    }
    print_message("%d walks complete before the greedy end\n", completed_early);
    free(buf);
}

/* ---- the masker with a schema ---------------------------------------------------------------- */

/* The masker's key for a counted string: one state wherever the count is at least T = (longest
 * token) + 1 from both bounds, the real count near them. */
static void test_counted_string_mask_key(void **state) {
    (void)state;
    kvb_json_schema *sch = compile_ok("{\"type\":\"object\",\"properties\":{\"s\":{\"type\":\"string\",\"minLength\":10,"
                                      "\"maxLength\":30}}}");
    kvb_json_state s, key, first_far_below, first_far_above;
    kvb_json_init_schema(&s, sch);
    assert_true(kvb_json_feed(&s, "{\"s\":\"", 6));
    int moved = 0;
    for (unsigned off = 0; off <= 30; off++) { /* T = 5: 0..5 below, 10..25 above and far from 30 */
        json_state_mask_key(&s, 4, &key);
        const bool far_below = off + 5 <= 10, far_above = off >= 10 && 30 - off >= 5;
        if (far_below || far_above) {
            kvb_json_state *first = far_below ? &first_far_below : &first_far_above;
            if (off == 0 || off == 10) *first = key;
            else if (memcmp(first, &key, sizeof key) != 0) fail_msg("count %u: another key than its region's", off);
            moved += key.off != s.off;
        } else if (memcmp(&s, &key, sizeof key) != 0)
            fail_msg("count %u: near a bound the key must be the state", off);
        if (off < 30) assert_true(kvb_json_feed(&s, "a", 1));
    }
    assert_true(memcmp(&first_far_below, &first_far_above, sizeof key) != 0); /* may close, or not */
    assert_true(moved > 0);
    kvb_json_schema_free(sch);
}

static void test_masker_walks(void **state) {
    (void)state;
    /* every printable byte, a newline, some longer pieces, control tokens */
    static const char *const pieces[] = {"\"", "}", "]", "{\"", "\":", "\",\"", "\"}", "null", "true", "false", "12",
                                         "-0.5", "e+3", "  ", "\n ", "[]", "{}", "\\\"", "\\u00e9", "\xc3\xa9", "\"a\"",
                                         "ab", "abc", "\"ab", "c\":", "k1", "q\\\"t", "x\\\\y", "n\\nl", ",\"", "},{", ""};
    enum { N_PRINT = 0x7f - 0x20, N_PIECES = sizeof pieces / sizeof *pieces, N = N_PRINT + 1 + N_PIECES + 3 };
    const char *bytes[N];
    uint32_t lens[N];
    uint8_t kinds[N];
    char singles[N_PRINT + 1];
    for (int i = 0; i < N_PRINT; i++) {
        singles[i] = (char)(0x20 + i);
        bytes[i] = &singles[i];
        lens[i] = 1;
        kinds[i] = KVB_VOCAB_TEXT;
    }
    singles[N_PRINT] = '\n';
    bytes[N_PRINT] = &singles[N_PRINT];
    lens[N_PRINT] = 1;
    kinds[N_PRINT] = KVB_VOCAB_TEXT;
    for (int i = 0; i < N_PIECES; i++) {
        bytes[N_PRINT + 1 + i] = pieces[i];
        lens[N_PRINT + 1 + i] = (uint32_t)strlen(pieces[i]);
        kinds[N_PRINT + 1 + i] = KVB_VOCAB_TEXT;
    }
    const int EOG0 = N - 3;
    bytes[N - 3] = bytes[N - 2] = bytes[N - 1] = "";
    lens[N - 3] = lens[N - 2] = lens[N - 1] = 0;
    kinds[N - 3] = KVB_VOCAB_EOG;
    kinds[N - 2] = KVB_VOCAB_OTHER;
    kinds[N - 1] = KVB_VOCAB_EOG;
    kvb_vocab_bytes *v = NULL;
    kvb_err err = {0};
    assert_int_equal(kvb_vocab_bytes_from_lists(bytes, lens, kinds, N, &v, &err), KVB_OK);
    char *text = malloc(1 << 16);
    int walks = 0, ended = 0;
    /* after the random schemas, long counted strings: their masks are remembered by a key that
     * moves the count while it is far from both bounds (json_state_mask_key) */
    static const char *const counted =
        "{\"type\":\"object\",\"properties\":{\"s\":{\"type\":\"string\",\"minLength\":10,\"maxLength\":24},"
        "\"u\":{\"type\":\"string\",\"minLength\":9},\"w\":{\"type\":\"array\",\"items\":{\"type\":\"string\","
        "\"maxLength\":20}}},\"required\":[\"s\"]}";
    for (int t = 0; t < 70; t++) {
        cJSON *js = t < 60 ? gen_root() : cJSON_Parse(counted);
        kvb_json_schema *sch = NULL;
        assert_int_equal(kvb_json_schema_compile(js, "schema", &sch, &err), KVB_OK);
        kvb_json_masker *m = NULL; /* one per schema: it remembers masks across its walks */
        assert_int_equal(kvb_json_masker_create(v, NULL, &m, &err), KVB_OK);
        for (int w = 0; w < 4; w++, walks++) {
            kvb_json_state s;
            kvb_json_init_schema(&s, sch);
            size_t n = 0;
            for (int step = 0; step < 400; step++) {
                float logits[N];
                for (int i = 0; i < N; i++) { /* closing pieces drawn more often: walks end */
                    logits[i] = (float)kvbt_rnd(1000) / 1000.0f;
                    if (lens[i] && strchr("\"}]0,", bytes[i][0])) logits[i] += 0.6f;
                }
                const uint32_t allowed = kvb_json_masker_apply(m, &s, logits);
                if (!allowed) fail_msg("stuck after '%.*s'", (int)n, text);
                /* the mask is each token fed to a whole copy of the state */
                uint32_t count = 0;
                for (int i = 0; i < N; i++) {
                    kvb_json_state c = s;
                    const bool ok = kinds[i] == KVB_VOCAB_EOG ? kvb_json_complete(&s) : kvb_json_feed_token(&c, v, i);
                    if (ok != (logits[i] != -INFINITY))
                        fail_msg("after '%.*s': token %d ('%s') %s", (int)n, text, i, bytes[i], ok ? "masked" : "allowed");
                    count += ok;
                }
                assert_int_equal(count, allowed);
                int best = -1;
                for (int i = 0; i < N; i++)
                    if (logits[i] != -INFINITY && (best < 0 || logits[i] > logits[best])) best = i;
                if (kinds[best] == KVB_VOCAB_EOG) {
                    assert_true(best == EOG0 || best == N - 1);
                    assert_true(kvb_json_complete(&s));
                    if (!validate(js, text, n)) {
                        char *p = cJSON_PrintUnformatted(js);
                        fail_msg("walk ended in '%.*s', invalid under %s", (int)n, text, p);
                    }
                    ended++;
                    break;
                }
                assert_true(kvb_json_feed_token(&s, v, best));
                memcpy(text + n, bytes[best], lens[best]);
                n += lens[best];
            }
        }
        kvb_json_masker_free(m);
        kvb_json_schema_free(sch);
        cJSON_Delete(js);
    }
    print_message("%d of %d masked walks ended in a complete, valid text\n", ended, walks);
    assert_true(ended * 2 > walks);
    free(text);
    kvb_vocab_bytes_free(v);
}

int main(void) {
    kvbt_rnd_seed(0x9E3779B97F4A7C15ull); /* this file's own stream of random texts */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refused_keywords),
        cmocka_unit_test(test_refs_into_defs),
        cmocka_unit_test(test_string_lengths),
        cmocka_unit_test(test_counted_string_mask_key),
        cmocka_unit_test(test_wrong_values),
        cmocka_unit_test(test_limits_and_hostile_schemas),
        cmocka_unit_test(test_objects_and_scalars),
        cmocka_unit_test(test_free_objects_and_any),
        cmocka_unit_test(test_arrays),
        cmocka_unit_test(test_enum_const_any_of),
        cmocka_unit_test(test_random_schemas_and_instances),
        cmocka_unit_test(test_random_walks),
        cmocka_unit_test(test_masker_walks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
