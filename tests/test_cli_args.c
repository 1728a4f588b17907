/* tests/test_cli_args.c — the command-line option parser (src/cli/args.c): every kind of option
 * fills its destination (--name VALUE, --name=VALUE, -x VALUE), defaults apply when an option is
 * absent, bad values (out of range, trailing junk, unknown choices), unknown options, missing
 * values and missing required options are refused with a message naming the option, operands are
 * counted, and --help is generated from the same table; every subcommand of the kvbridge binary
 * prints its generated help and refuses an unknown option naming it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_quant.h"
#include "kvbt.h"

/* Every kind's destination, and the table that fills them. */
typedef struct {
    bool flag;
    const char *model, *name;
    long long count;
    uint64_t seed, bytes;
    double temp;
    int color;
    kvb_opt_list tags;
    uint32_t type;
    const char *operands[2];
    int n_operands;
} values;

static const char *const k_colors[] = {"red", "green", "blue", NULL};

static kvb_status parse(values *v, bool *help, kvb_err *err, int argc, char **argv) {
    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&v->model, "GGUF model", true),
        {.long_name = "flag", .short_name = 'f', .kind = KVB_OPT_FLAG, .dst = &v->flag, .help = "a flag"},
        {.long_name = "name", .kind = KVB_OPT_STRING, .dst = &v->name, .meta = "NAME", .help = "a name"},
        {.short_name = 'n', .kind = KVB_OPT_INT, .dst = &v->count, .meta = "N", .help = "a count", .def = "32",
         .lo = -5, .hi = 100},
        {.long_name = "seed", .kind = KVB_OPT_UINT, .dst = &v->seed, .meta = "S", .help = "a seed"},
        {.long_name = "bytes", .kind = KVB_OPT_SIZE, .dst = &v->bytes, .meta = "B", .help = "a size", .def = "1K",
         .ulo = 1, .uhi = (uint64_t)1 << 40},
        {.long_name = "temp", .kind = KVB_OPT_DOUBLE, .dst = &v->temp, .meta = "T", .help = "a temperature",
         .def = "0.8", .dlo = 0, .dhi = 2},
        {.long_name = "color", .kind = KVB_OPT_ENUM, .dst = &v->color, .help = "a color", .def = "green",
         .choices = k_colors},
        {.long_name = "tag", .kind = KVB_OPT_LIST, .dst = &v->tags, .meta = "TAG", .help = "a tag"},
        KVB_CLI_OPT_CACHE_TYPE(&v->type, "a cache type"),
        {0},
    };
    const kvb_cli_spec spec = {.name = "test", .usage = "-m FILE [options] [IN [OUT]]",
                               .about = "Tests the parser.", .opts = opts, .max_operands = 2,
                               .operands = v->operands, .n_operands = &v->n_operands};
    return kvb_cli_parse_args(&spec, argc, argv, help, err);
}

/* Parses a NULL-terminated list of words after the command name into a fresh *v. */
static kvb_status parse_words(values *v, kvb_err *err, const char *first, ...) {
    char *argv[32] = {"test"};
    int argc = 1;
    va_list ap;
    va_start(ap, first);
    for (const char *w = first; w && argc < 31; w = va_arg(ap, const char *)) argv[argc++] = (char *)w;
    va_end(ap);
    memset(v, 0, sizeof *v);
    bool help = false;
    memset(err, 0, sizeof *err);
    kvb_status st = parse(v, &help, err, argc, argv);
    assert_false(help);
    return st;
}

static void test_every_kind_fills_its_destination(void **state) {
    (void)state;
    values v;
    kvb_err err;
    assert_int_equal(parse_words(&v, &err, "-m", "a.gguf", "-f", "--name=bob", "-n", "-5", "--seed", "0x10",
                                 "--bytes", "64M", "--temp", "1.5", "--color", "blue", "--tag", "x", "--tag=y",
                                 "--cache-type", "q8_0", "in", "--", "-out", NULL),
                     KVB_OK);
    assert_string_equal(v.model, "a.gguf");
    assert_true(v.flag);
    assert_string_equal(v.name, "bob");
    assert_int_equal(v.count, -5);
    assert_int_equal(v.seed, 16);
    assert_int_equal(v.bytes, 64ull << 20);
    assert_true(v.temp == 1.5);
    assert_int_equal(v.color, 2);
    assert_int_equal(v.tags.n, 2);
    assert_string_equal(v.tags.v[0], "x");
    assert_string_equal(v.tags.v[1], "y");
    assert_int_equal(v.type, KVB_TYPE_Q8_0);
    assert_int_equal(v.n_operands, 2);
    assert_string_equal(v.operands[0], "in");
    assert_string_equal(v.operands[1], "-out");
}

static void test_defaults_apply_when_absent(void **state) {
    (void)state;
    values v;
    kvb_err err;
    assert_int_equal(parse_words(&v, &err, "--model", "m.gguf", "--seed", "18446744073709551615", NULL), KVB_OK);
    assert_false(v.flag);
    assert_null(v.name);
    assert_int_equal(v.count, 32);
    assert_int_equal(v.bytes, 1024);
    assert_true(v.temp == 0.8);
    assert_int_equal(v.color, 1);
    assert_int_equal(v.tags.n, 0);
    assert_int_equal(v.type, KVB_TYPE_F16);
    assert_true(v.seed == UINT64_MAX);
    assert_int_equal(v.n_operands, 0);
}

/* The words must be refused with `code`, and the message must contain `says`. */
static void expect_refused(kvb_status code, const char *says, const char *w1, const char *w2, const char *w3) {
    values v;
    kvb_err err;
    kvb_status st = parse_words(&v, &err, "-m", "a.gguf", w1, w2, w3, NULL);
    if (st != code || !strstr(err.msg, says))
        fail_msg("'%s %s %s': status %d, message '%s'; wanted %d and '%s'", w1, w2 ? w2 : "", w3 ? w3 : "", st,
                 err.msg, code, says);
}

static void test_bad_values_are_refused_naming_the_option(void **state) {
    (void)state;
    expect_refused(KVB_ERR_RANGE, "-n expects a whole number from -5 to 100, got '101'", "-n", "101", NULL);
    expect_refused(KVB_ERR_RANGE, "-n expects", "-n", "-6", NULL);
    expect_refused(KVB_ERR_RANGE, "got '12x'", "-n", "12x", NULL);
    expect_refused(KVB_ERR_RANGE, "-n expects", "-n", "", NULL);
    expect_refused(KVB_ERR_RANGE, "--seed expects", "--seed", "-1", NULL);
    expect_refused(KVB_ERR_RANGE, "--seed expects", "--seed", "18446744073709551616", NULL);
    expect_refused(KVB_ERR_RANGE, "--seed expects", "--seed", "0x", NULL);
    expect_refused(KVB_ERR_RANGE, "--bytes expects a byte count from 1", "--bytes", "0", NULL);
    expect_refused(KVB_ERR_RANGE, "--bytes expects", "--bytes", "2T", NULL);
    expect_refused(KVB_ERR_RANGE, "--bytes expects", "--bytes", "4KB", NULL);
    expect_refused(KVB_ERR_RANGE, "--bytes expects", "--bytes", "99999999999999999999K", NULL);
    expect_refused(KVB_ERR_RANGE, "--temp expects a number from 0 to 2, got 'nan'", "--temp", "nan", NULL);
    expect_refused(KVB_ERR_RANGE, "--temp expects", "--temp", "2.5", NULL);
    expect_refused(KVB_ERR_RANGE, "--temp expects", "--temp", "1.0.0", NULL);
    expect_refused(KVB_ERR_RANGE, "--color expects red, green or blue, got 'pink'", "--color", "pink", NULL);
    expect_refused(KVB_ERR_INVALID, "--cache-type", "--cache-type", "q9_9", NULL);
}

static void test_usage_errors_are_refused(void **state) {
    (void)state;
    expect_refused(KVB_ERR_INVALID, "unknown option '--nope'", "--nope", NULL, NULL);
    expect_refused(KVB_ERR_INVALID, "unknown option '-x'", "-x", NULL, NULL);
    expect_refused(KVB_ERR_INVALID, "unknown option '--fla'", "--fla", NULL, NULL);
    expect_refused(KVB_ERR_INVALID, "--name needs a value (NAME)", "--name", NULL, NULL);
    expect_refused(KVB_ERR_INVALID, "--flag takes no value", "--flag=1", NULL, NULL);
    expect_refused(KVB_ERR_INVALID, "unexpected argument 'c'", "a", "b", "c");
    values v;
    kvb_err err;
    assert_int_equal(parse_words(&v, &err, "-n", "3", NULL), KVB_ERR_INVALID);
    assert_non_null(strstr(err.msg, "-m MODEL (--model) is required"));
    char *argv[40] = {"test", "-m", "a"};
    for (int i = 0; i < 34; i++) argv[3 + i] = "--tag=t";
    bool help = false;
    assert_int_equal(parse(&v, &help, &err, 37, argv), KVB_ERR_RANGE);
    assert_non_null(strstr(err.msg, "--tag is given more than 32 times"));
}

static void test_help_is_generated_from_the_table(void **state) {
    (void)state;
    values v = {0};
    kvb_err err = {0};
    bool help = false;
    char *argv[] = {"test", "--nope-later", "--help"};
    /* an unknown option before --help is an error; --help first wins */
    assert_int_equal(parse(&v, &help, &err, 3, argv), KVB_ERR_INVALID);
    char *argv2[] = {"test", "--help", "--nope-later"};
    assert_int_equal(parse(&v, &help, &err, 3, argv2), KVB_OK);
    assert_true(help);

    const kvb_opt opts[] = {
        KVB_CLI_OPT_MODEL(&v.model, "GGUF model", true),
        KVB_CLI_OPT_THREADS(&v.count, "CPU threads (default: all)"),
        {.long_name = "color", .kind = KVB_OPT_ENUM, .dst = &v.color, .help = "a color", .def = "green",
         .choices = k_colors},
        {.long_name = "tag", .kind = KVB_OPT_LIST, .dst = &v.tags, .meta = "TAG", .help = "a tag"},
        {.long_name = "a-very-long-option-name", .kind = KVB_OPT_FLAG, .dst = &v.flag,
         .help = "words words words words words words words words words words words words words words words "
                 "words words words words words words words words end"},
        {0},
    };
    const kvb_cli_spec spec = {.name = "test", .usage = "-m FILE [options]\nother FORM", .about = "Tests the parser.",
                               .opts = opts};
    char buf[4096] = {0};
    FILE *f = fmemopen(buf, sizeof buf - 1, "w");
    assert_non_null(f);
    kvb_cli_help(&spec, f);
    fclose(f);
    printf("%s", buf);
    assert_non_null(strstr(buf, "usage: kvbridge test -m FILE [options]\n       kvbridge test other FORM\n"));
    assert_non_null(strstr(buf, "\nTests the parser.\n"));
    assert_non_null(strstr(buf, "\n  -m, --model MODEL    GGUF model (required)\n"));
    assert_non_null(strstr(buf, "\n  --threads T          CPU threads (default: all)\n"));
    assert_non_null(strstr(buf, "\n  --color red|green|blue a color (default: green)\n") ||
                    strstr(buf, "\n  --color red|green|blue\n                       a color (default: green)\n"));
    assert_non_null(strstr(buf, "\n  --tag TAG            a tag (may be given several times)\n"));
    assert_non_null(strstr(buf, "\n  --a-very-long-option-name\n                       words words"));
    assert_non_null(strstr(buf, " words\n                       words"));
    assert_non_null(strstr(buf, "  -h, --help"));
    for (const char *line = buf; *line;) { /* every line within the width */
        size_t len = strcspn(line, "\n");
        assert_true(len <= 110);
        line += len + (line[len] == '\n');
    }
}

/* Every subcommand of the binary parses through a table: its help is the generated one (usage, the
 * -h line the generator adds) and an unknown option is refused with exit 2, named, with the way to
 * the help. */
static void test_every_subcommand_uses_the_parser(void **state) {
    (void)state;
    static const char *const subs[] = {"run", "verify", "demo", "serve", "doctor", "tokenize", "inspect",
                                       "gen-model", "bench prefill", "bench decode", "bench ladder", "bench link",
                                       "bench quality", "bench slab", "bench tokenize", "bench parallel",
                                       "bench json"};
    for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
        char cmd[512], out[32768], want[256];
        snprintf(cmd, sizeof cmd, "'%s' %s --help", kvbt_bin(), subs[i]);
        assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
        const bool bench_cpu = !strcmp(subs[i], "bench prefill") || !strcmp(subs[i], "bench decode");
        snprintf(want, sizeof want, "usage: kvbridge %s ", bench_cpu ? "bench" : subs[i]);
        if (!strstr(out, want)) fail_msg("%s --help: no '%s' in:\n%s", subs[i], want, out);
        assert_non_null(strstr(out, "\n  -h, --help           this help\n"));
        snprintf(cmd, sizeof cmd, "'%s' %s --no-such-option", kvbt_bin(), subs[i]);
        assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 2);
        snprintf(want, sizeof want, "kvbridge %s: unknown option '--no-such-option' (see kvbridge %s --help)",
                 bench_cpu ? "bench" : subs[i], bench_cpu ? "bench" : subs[i]);
        if (!strstr(out, want)) fail_msg("%s: no '%s' in: %s", subs[i], want, out);
    }
}

/* bench's --attention is an enum of the table: a value outside it is refused by the parser, exit 2,
 * with the choices listed, before anything loads; its help shows the default. */
static void test_bench_attention_is_an_enum(void **state) {
    (void)state;
    char cmd[512], out[32768];
    snprintf(cmd, sizeof cmd, "'%s' bench prefill -m /no/such/model.gguf --attention fast", kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 2);
    if (!strstr(out, "kvbridge bench: --attention expects auto, own, cudnn or both, got 'fast'"))
        fail_msg("--attention fast: %s", out);
    snprintf(cmd, sizeof cmd, "'%s' bench --help", kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    char *h = strstr(out, "--attention A ");
    if (!h) fail_msg("bench --help: no --attention A in:\n%s", out);
    char *next = strstr(h, "\n  -"); /* the next option's entry */
    if (next) *next = 0;
    if (!strstr(h, "(default: auto)")) fail_msg("bench --help: --attention's entry has no (default: auto):\n%s", h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_kind_fills_its_destination),
        cmocka_unit_test(test_defaults_apply_when_absent),
        cmocka_unit_test(test_bad_values_are_refused_naming_the_option),
        cmocka_unit_test(test_usage_errors_are_refused),
        cmocka_unit_test(test_help_is_generated_from_the_table),
        cmocka_unit_test(test_every_subcommand_uses_the_parser),
        cmocka_unit_test(test_bench_attention_is_an_enum),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
