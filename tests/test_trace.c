/* tests/test_trace.c — the opt-in timeline (KVB_TRACE): off, spans are not recorded and nothing
 * is written; on, spans recorded from several threads at once all land in the file, which parses
 * as Chrome trace-event JSON with each span's name, start, duration and argument as recorded; past
 * KVB_TRACE_MAX_SPANS spans are counted as dropped, never written past the array; an unwritable
 * path is an error that names it. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvb_core.h"

#define N_THREADS 4
#define SPANS_PER_THREAD 1000

static char g_path[64];

static cJSON *read_trace(void) {
    FILE *f = fopen(g_path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)len + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)len, f), (size_t)len);
    buf[len] = 0;
    fclose(f);
    cJSON *j = cJSON_Parse(buf);
    free(buf);
    assert_non_null(j);
    return j;
}

static void *record_main(void *arg) {
    const uint64_t id = (uint64_t)(uintptr_t)arg;
    for (uint64_t i = 0; i < SPANS_PER_THREAD; i++) {
        const double t0 = 100.0 + (double)(id * SPANS_PER_THREAD + i) * 1e-3; /* distinct, in ms steps */
        kvb_trace_span("test.span", t0, t0 + 0.25e-3, id * SPANS_PER_THREAD + i);
    }
    return NULL;
}

static int setup(void **state) {
    (void)state;
    snprintf(g_path, sizeof g_path, "/tmp/kvb_test_trace_%d.json", (int)getpid());
    unsetenv("KVB_TRACE");
    unsetenv("KVB_TRACE_MAX_SPANS");
    return 0;
}

static int teardown(void **state) {
    (void)state;
    unlink(g_path);
    unsetenv("KVB_TRACE");
    unsetenv("KVB_TRACE_MAX_SPANS");
    return 0;
}

static void test_off_records_nothing(void **state) {
    (void)state;
    unlink(g_path);
    kvb_trace_init_from_env();
    assert_false(kvb_trace_enabled());
    kvb_trace_span("test.span", 1.0, 2.0, 7);
    kvb_err err = {0};
    assert_int_equal(kvb_trace_write(&err), KVB_OK);
    assert_int_equal(access(g_path, F_OK), -1); /* no file */
}

static void test_spans_from_threads_all_written(void **state) {
    (void)state;
    setenv("KVB_TRACE", g_path, 1);
    kvb_trace_init_from_env();
    assert_true(kvb_trace_enabled());
    pthread_t th[N_THREADS];
    for (uintptr_t t = 0; t < N_THREADS; t++) assert_int_equal(pthread_create(&th[t], NULL, record_main, (void *)t), 0);
    for (int t = 0; t < N_THREADS; t++) pthread_join(th[t], NULL);
    kvb_err err = {0};
    assert_int_equal(kvb_trace_write(&err), KVB_OK);
    assert_false(kvb_trace_enabled()); /* written and dropped */

    cJSON *j = read_trace();
    cJSON *ev = cJSON_GetObjectItem(j, "traceEvents");
    assert_true(cJSON_IsArray(ev));
    assert_int_equal(cJSON_GetArraySize(ev), N_THREADS * SPANS_PER_THREAD);
    static char seen[N_THREADS * SPANS_PER_THREAD];
    memset(seen, 0, sizeof seen);
    cJSON *e;
    cJSON_ArrayForEach(e, ev) {
        assert_string_equal(cJSON_GetObjectItem(e, "name")->valuestring, "test.span");
        assert_string_equal(cJSON_GetObjectItem(e, "ph")->valuestring, "X");
        const double a = cJSON_GetObjectItem(cJSON_GetObjectItem(e, "args"), "a")->valuedouble;
        assert_true(a >= 0 && a < N_THREADS * SPANS_PER_THREAD);
        const int i = (int)a;
        assert_int_equal(seen[i], 0); /* each span once */
        seen[i] = 1;
        const double ts_us = cJSON_GetObjectItem(e, "ts")->valuedouble;
        const double dur_us = cJSON_GetObjectItem(e, "dur")->valuedouble;
        assert_true(fabs(ts_us - (100.0 + i * 1e-3) * 1e6) < 0.01); /* written to the nanosecond */
        assert_true(fabs(dur_us - 250.0) < 0.01);
    }
    cJSON_Delete(j);
}

static void test_cap_drops_and_counts(void **state) {
    (void)state;
    setenv("KVB_TRACE", g_path, 1);
    setenv("KVB_TRACE_MAX_SPANS", "10", 1);
    kvb_trace_init_from_env();
    for (int i = 0; i < 25; i++) kvb_trace_span("test.capped", i, i + 0.5, (uint64_t)i);
    kvb_err err = {0};
    assert_int_equal(kvb_trace_write(&err), KVB_OK);
    cJSON *j = read_trace();
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(j, "traceEvents")), 10); /* the first ten */
    cJSON *other = cJSON_GetObjectItem(j, "otherData");
    assert_int_equal((int)cJSON_GetObjectItem(other, "spans")->valuedouble, 10);
    assert_int_equal((int)cJSON_GetObjectItem(other, "dropped")->valuedouble, 15);
    cJSON_Delete(j);
}

static void test_unwritable_path_is_an_error(void **state) {
    (void)state;
    setenv("KVB_TRACE", "/nonexistent-dir-kvb/trace.json", 1);
    kvb_trace_init_from_env();
    kvb_trace_span("test.span", 1.0, 2.0, 1);
    kvb_err err = {0};
    assert_int_not_equal(kvb_trace_write(&err), KVB_OK);
    assert_non_null(strstr(err.msg, "/nonexistent-dir-kvb/trace.json"));
    assert_false(kvb_trace_enabled());
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_off_records_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_spans_from_threads_all_written, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cap_drops_and_counts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unwritable_path_is_an_error, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
