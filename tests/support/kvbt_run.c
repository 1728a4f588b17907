/* tests/support/kvbt_run.c — how a test binary tells ctest what ran and what skipped. Every test
 * links with -Wl,--wrap for cmocka's group runner, its skip() and its test filter (see
 * tests/CMakeLists.txt), so no test's main() changes: the cases to run are chosen by
 * KVB_TEST_FILTER and KVB_TEST_EXCLUDE (comma-separated globs on case names); every case is
 * followed through a setup and a body trampoline, so a skipped case is known by name with its
 * reason (kvbt_skip) or at least its file:line (a bare skip()); the binary closes with
 * "kvbt: N passed, N failed, N skipped" and one line per skipped case; and when a case skipped and
 * none failed it exits $KVB_TEST_SKIP_EXIT, which ctest sets to its SKIP_RETURN_CODE so that it never
 * counts a skipped case as passed (run by hand, without it, the binary exits 0 as cmocka does). */
#include "kvbt.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One selected case of the group being run. */
typedef struct {
    const struct CMUnitTest *test; /* the binary's own entry */
    int started;                   /* its setup trampoline ran */
    int finished;                  /* its body returned (no failed assertion, no skip) */
    int skipped;
    char reason[512];
} kvbt_case;

static kvbt_case *g_cases;      /* [g_ncases] */
static size_t g_ncases, g_next; /* g_next: the next case whose setup cmocka will run */
static kvbt_case *g_current;    /* the case cmocka is running, NULL between groups */
static char g_binary_filter[512];

int __real__cmocka_run_group_tests(const char *group_name, const struct CMUnitTest *const tests,
                                   const size_t num_tests, CMFixtureFunction group_setup,
                                   CMFixtureFunction group_teardown);
void __real__skip(const char *const file, const int line);
void __wrap_cmocka_set_test_filter(const char *pattern);
int __wrap__cmocka_run_group_tests(const char *group_name, const struct CMUnitTest *const tests,
                                   const size_t num_tests, CMFixtureFunction group_setup,
                                   CMFixtureFunction group_teardown);
void __wrap__skip(const char *const file, const int line);

/* A test that filters its own cases (test_node_loop) passes KVB_TEST_FILTER here; kvbt applies it
 * with the same glob syntax as everywhere else instead of cmocka's. */
void __wrap_cmocka_set_test_filter(const char *pattern) {
    snprintf(g_binary_filter, sizeof g_binary_filter, "%s", pattern ? pattern : "");
}

/* Whether name matches one of the comma-separated globs in list (empty pieces are ignored). */
static int matches_any(const char *list, const char *name) {
    char glob[256];
    for (const char *p = list; *p;) {
        size_t n = strcspn(p, ",");
        if (n > 0 && n < sizeof glob) {
            memcpy(glob, p, n);
            glob[n] = '\0';
            if (fnmatch(glob, name, 0) == 0) return 1;
        }
        p += n + (p[n] == ',');
    }
    return 0;
}

static int selected(const char *name) {
    const char *only = g_binary_filter[0] ? g_binary_filter : getenv("KVB_TEST_FILTER");
    const char *except = getenv("KVB_TEST_EXCLUDE");
    if (only && *only && !matches_any(only, name)) return 0;
    return !(except && *except && matches_any(except, name));
}

static int case_setup(void **state) {
    if (g_next >= g_ncases) {
        fprintf(stderr, "kvbt: cmocka ran more cases than it was given\n");
        abort();
    }
    g_current = &g_cases[g_next++];
    g_current->started = 1;
    return g_current->test->setup_func ? g_current->test->setup_func(state) : 0;
}

static void case_body(void **state) {
    g_current->test->test_func(state);
    g_current->finished = 1;
}

void __wrap__skip(const char *const file, const int line) {
    if (g_current) {
        g_current->skipped = 1;
        if (!g_current->reason[0]) snprintf(g_current->reason, sizeof g_current->reason, "skip() at %s:%d", file, line);
    }
    __real__skip(file, line);
}

void kvbt_skip_at(const char *file, int line, const char *fmt, ...) {
    char why[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    print_message("SKIP: %s\n", why);
    if (g_current) snprintf(g_current->reason, sizeof g_current->reason, "%s", why);
    __wrap__skip(file, line);
    abort(); /* not reached: cmocka's skip leaves the case */
}

/* Prints the closing summary; returns the exit status (cmocka's failure count wins). */
static int report(int cmocka_failed) {
    size_t passed = 0, skipped = 0;
    for (size_t i = 0; i < g_ncases; i++) {
        if (g_cases[i].skipped) skipped++;
        else if (g_cases[i].finished) passed++;
    }
    size_t failed = g_ncases - passed - skipped;
    if ((size_t)cmocka_failed > failed) { /* a case's teardown failed after its body passed */
        passed -= (size_t)cmocka_failed - failed;
        failed = (size_t)cmocka_failed;
    }
    printf("kvbt: %zu passed, %zu failed, %zu skipped\n", passed, failed, skipped);
    for (size_t i = 0; i < g_ncases; i++)
        if (g_cases[i].skipped) printf("kvbt: skipped %s: %s\n", g_cases[i].test->name, g_cases[i].reason);
    if (failed > 0) return cmocka_failed > 0 ? cmocka_failed : 1;
    const char *skip_exit = getenv("KVB_TEST_SKIP_EXIT");
    int skip_status = skip_exit ? atoi(skip_exit) : 0;
    if (skipped > 0 && skip_status > 0) {
        printf("kvbt: exit %d (KVB_TEST_SKIP_EXIT): a case skipped, so the run is not reported as passed\n",
               skip_status);
        return skip_status;
    }
    return 0;
}

int __wrap__cmocka_run_group_tests(const char *group_name, const struct CMUnitTest *const tests,
                                   const size_t num_tests, CMFixtureFunction group_setup,
                                   CMFixtureFunction group_teardown) {
    struct CMUnitTest *run = calloc(num_tests ? num_tests : 1, sizeof *run); /* [num_tests], the chosen ones first */
    g_cases = calloc(num_tests ? num_tests : 1, sizeof *g_cases);            /* [num_tests] */
    if (!run || !g_cases) {
        fprintf(stderr, "kvbt: out of memory\n");
        abort();
    }
    g_ncases = g_next = 0;
    for (size_t i = 0; i < num_tests; i++) {
        if (!selected(tests[i].name)) continue;
        g_cases[g_ncases].test = &tests[i];
        run[g_ncases] = tests[i];
        run[g_ncases].setup_func = case_setup;
        run[g_ncases].test_func = case_body;
        g_ncases++;
    }
    int status;
    if (g_ncases == 0) {
        printf("kvbt: no case of %s matches KVB_TEST_FILTER='%s' KVB_TEST_EXCLUDE='%s'\n", group_name,
               g_binary_filter[0] ? g_binary_filter : (getenv("KVB_TEST_FILTER") ? getenv("KVB_TEST_FILTER") : ""),
               getenv("KVB_TEST_EXCLUDE") ? getenv("KVB_TEST_EXCLUDE") : "");
        status = 1;
    } else {
        status = report(__real__cmocka_run_group_tests(group_name, run, g_ncases, group_setup, group_teardown));
    }
    g_current = NULL;
    free(run);
    free(g_cases);
    g_cases = NULL;
    g_ncases = g_next = 0;
    return status;
}
