/* tests/test_svg_chart.c — the time-to-first-token chart (src/cli/svg_chart.c) that `bench ladder
 * --svg` and `demo --svg` write: the file is well-formed XML (read back by Python's own XML parser,
 * an independent reader), its root an <svg>; every measured point is there with its series, its
 * length and its seconds exactly (%.17g), unmeasured ones (NaN, 0) are not; labels with markup
 * characters are escaped; a chart with nothing to draw or a length that is not positive is refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvbt.h"
#include "svg_chart.h"

/* Python's ElementTree over the file: "svg" (the root's tag), the title's and the legend's texts,
 * then one line "point SERIES X Y" per <circle class="point">, in document order. */
static const char k_reader[] =
    "import sys, xml.etree.ElementTree as E\n"
    "ns = '{http://www.w3.org/2000/svg}'\n"
    "r = E.parse(sys.argv[1]).getroot()\n"
    "print(r.tag[len(ns):])\n"
    "for t in r.iter(ns + 'text'):\n"
    "    if t.get('class') in ('title', 'legend'): print(t.get('class'), t.text)\n"
    "for c in r.iter(ns + 'circle'):\n"
    "    if c.get('class') == 'point': print('point', c.get('data-series'), c.get('data-x'), c.get('data-y'))\n";

/* What the reader prints for the chart written to path, or NULL when it refused the file. */
static char *read_back(const char *path) {
    char script[256], cmd[1024];
    kvbt_tmp_path(script, sizeof script, "svg_reader.py");
    FILE *f = fopen(script, "w");
    assert_non_null(f);
    fputs(k_reader, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "python3 '%s' '%s' 2>&1", script, path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char *out = calloc(1, 65536);
    size_t n = fread(out, 1, 65535, p);
    out[n] = 0;
    const int rc = pclose(p);
    if (rc != 0) {
        printf("reader: %s\n", out);
        free(out);
        return NULL;
    }
    return out;
}

static void test_points_and_xml(void **state) {
    (void)state;
    const double x[] = {1024, 4096, 16384, 131072};
    const double alone[] = {0.9, 3.75, 16.125, NAN}; /* the longest not run */
    const double bridged[] = {0.0625, 0.1875, 0.6, 4.25};
    const double gpu[] = {0.05, 0.15, 0.5, 0}; /* 0: not measured */
    const kvb_svg_series s[] = {{"decoder alone", alone}, {"bridged <&> \"x\"", bridged}, {"GPU prefill alone", gpu}};
    const kvb_svg_chart c = {.title = "ladder & friends", .note = "tiny <model>", .x_label = "prompt tokens",
                             .y_label = "time to first token", .x = x, .n = 4, .series = s, .n_series = 3};
    char path[256];
    kvbt_tmp_path(path, sizeof path, "ladder.svg");
    kvb_err err = {0};
    assert_int_equal(kvb_svg_chart_write(&c, path, &err), KVB_OK);
    char *out = read_back(path);
    assert_non_null(out);
    printf("%s", out);
    const char *want =
        "svg\n"
        "title ladder & friends\n"
        "legend decoder alone\n"
        "legend bridged <&> \"x\"\n"
        "legend GPU prefill alone\n"
        "point decoder alone 1024 0.90000000000000002\n"
        "point decoder alone 4096 3.75\n"
        "point decoder alone 16384 16.125\n"
        "point bridged <&> \"x\" 1024 0.0625\n"
        "point bridged <&> \"x\" 4096 0.1875\n"
        "point bridged <&> \"x\" 16384 0.59999999999999998\n"
        "point bridged <&> \"x\" 131072 4.25\n"
        "point GPU prefill alone 1024 0.050000000000000003\n"
        "point GPU prefill alone 4096 0.14999999999999999\n"
        "point GPU prefill alone 16384 0.5\n";
    assert_string_equal(out, want);
    free(out);
    /* the values read back are the doubles given, bit for bit */
    assert_true(strtod("0.59999999999999998", NULL) == 0.6 && strtod("0.90000000000000002", NULL) == 0.9);
}

static void test_axis_labels(void **state) {
    (void)state;
    const double x[] = {1024, 1048576}, y[] = {0.05, 177};
    const kvb_svg_series s[] = {{"bridged", y}};
    const kvb_svg_chart c = {.title = "t", .x_label = "prompt tokens", .y_label = "seconds", .x = x, .n = 2,
                             .series = s, .n_series = 1};
    kvb_strbuf b = {0};
    kvb_err err = {0};
    assert_int_equal(kvb_svg_chart_render(&c, &b, &err), KVB_OK);
    /* ticks at the measured lengths, and 1-2-5 steps of seconds from 10 ms to 1000 s */
    assert_non_null(strstr(b.p, ">1K</text>"));
    assert_non_null(strstr(b.p, ">1M</text>"));
    assert_non_null(strstr(b.p, ">10 ms</text>"));
    assert_non_null(strstr(b.p, ">200 s</text>"));
    assert_non_null(strstr(b.p, ">1000 s</text>"));
    assert_null(strstr(b.p, ">2000 s</text>"));
    assert_non_null(strstr(b.p, ">prompt tokens</text>"));
    free(b.p);
}

static void test_refused(void **state) {
    (void)state;
    const double x[] = {1024, 2048}, none[] = {NAN, 0}, y[] = {1, 2}, bad_x[] = {1024, -5};
    kvb_svg_series s[] = {{"a", none}};
    kvb_svg_chart c = {.title = "t", .x_label = "x", .y_label = "y", .x = x, .n = 2, .series = s, .n_series = 1};
    kvb_strbuf b = {0};
    kvb_err err = {0};
    assert_int_equal(kvb_svg_chart_render(&c, &b, &err), KVB_ERR_INVALID); /* nothing measured */
    s[0].y = y;
    c.x = bad_x;
    assert_int_equal(kvb_svg_chart_render(&c, &b, &err), KVB_ERR_INVALID);
    c.x = x;
    c.n = 0;
    assert_int_equal(kvb_svg_chart_render(&c, &b, &err), KVB_ERR_INVALID);
    c.n = 2;
    c.n_series = KVB_SVG_MAX_SERIES + 1;
    assert_int_equal(kvb_svg_chart_render(&c, &b, &err), KVB_ERR_INVALID);
    c.n_series = 1;
    assert_int_equal(kvb_svg_chart_write(&c, "/nonexistent-dir/x.svg", &err), KVB_ERR_IO);
    free(b.p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_points_and_xml),
        cmocka_unit_test(test_axis_labels),
        cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
