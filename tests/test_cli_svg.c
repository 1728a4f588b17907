/* tests/test_cli_svg.c — `kvbridge bench ladder --svg FILE` on the tiny model: the chart it writes
 * is well-formed XML (Python's own parser reads it back) and plots exactly the table's medians:
 * for every prompt length of the run, a point of "decoder alone", "bridged" and "prefill node
 * alone" whose seconds, rounded as the table prints them (%.3f), are the table's columns. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvbt.h"

/* "SERIES|X|Y" for every point of the chart at path, one a line, read by Python's ElementTree. */
static const char k_reader[] =
    "import sys, xml.etree.ElementTree as E\n"
    "ns = '{http://www.w3.org/2000/svg}'\n"
    "for c in E.parse(sys.argv[1]).getroot().iter(ns + 'circle'):\n"
    "    if c.get('class') == 'point': print('%s|%s|%.3f' % (c.get('data-series'), c.get('data-x'), "
    "float(c.get('data-y'))))\n";

static void test_ladder_chart_is_the_table(void **state) {
    (void)state;
    char model[256], svg[256], script[256], cmd[2048];
    static char out[1 << 16], points[8192];
    kvbt_tmp_path(model, sizeof model, "tiny.gguf");
    kvbt_tmp_path(svg, sizeof svg, "ladder.svg");
    kvbt_tmp_path(script, sizeof script, "reader.py");
    snprintf(cmd, sizeof cmd, "'%s' gen-model --preset tiny --out '%s' --quiet", kvbt_bin(), model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    snprintf(cmd, sizeof cmd, "'%s' bench ladder -m '%s' --lengths 128,256 --seeds 1 --threads 1 --svg '%s'",
             kvbt_bin(), model, svg);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    printf("%s", out);
    FILE *f = fopen(script, "w");
    assert_non_null(f);
    fputs(k_reader, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "python3 '%s' '%s'", script, svg);
    assert_int_equal(kvbt_sh(cmd, points, sizeof points, 1), 0);
    printf("%s", points);
    static const char *const series[3] = {"decoder alone", "bridged", "prefill node alone"};
    static const int cols[3] = {1, 2, 4}; /* the table's columns: tokens, alone, bridged, ratio, prefill alone */
    int rows = 0;
    for (const char *l = out; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        int len;
        char c[5][32];
        if (sscanf(l, "%d %31s %31s %31s %31s", &len, c[1], c[2], c[3], c[4]) != 5 || (len != 128 && len != 256))
            continue;
        rows++;
        for (int s = 0; s < 3; s++) {
            char want[128];
            snprintf(want, sizeof want, "%s|%d|%s\n", series[s], len, c[cols[s]]);
            if (!strstr(points, want)) fail_msg("the chart lacks the table's point %s", want);
        }
    }
    assert_int_equal(rows, 2);
    int n_points = 0;
    for (const char *p = points; (p = strchr(p, '\n')); p++) n_points++;
    assert_int_equal(n_points, 6);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ladder_chart_is_the_table),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
