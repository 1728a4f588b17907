/* tests/test_cli_run.c — the foundation's command-line acceptance: gen-model writes the same
 * file for any thread count; `run --output ids` prints N ids, identical on every run and every
 * thread count; bad options fail with exit 2 and a message that says what to do; the batched
 * decode benchmarks and the structured-output benchmark run and pass their own checks; `tokenize
 * --jsonl` gives each text the ids a run of its own gives; `serve` drains on SIGTERM. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvbt.h"

static char g_model[512];

static int setup(void **state) {
    (void)state;
    char cmd[1024], out[4096];
    kvbt_tmp_path(g_model, sizeof g_model, "tiny.gguf");
    snprintf(cmd, sizeof cmd, "'%s' gen-model --preset tiny --out '%s' --seed 3 --quiet", kvbt_bin(), g_model);
    int rc = kvbt_sh(cmd, out, sizeof out, 1);
    if (rc != 0) fprintf(stderr, "gen-model failed (%d): %s\n", rc, out);
    return rc;
}

static void test_gen_model_thread_invariant(void **state) {
    (void)state;
    char a[512], b[512], cmd[2048], out[4096];
    kvbt_tmp_path(a, sizeof a, "g1.gguf");
    kvbt_tmp_path(b, sizeof b, "g2.gguf");
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "'%s' gen-model --preset tiny-qwen3 --type q4_0 --out '%s' --seed 9 --threads %d --quiet",
                 kvbt_bin(), i ? b : a, i ? 2 : 1);
        assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    }
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", a, b);
    assert_int_equal(kvbt_sh(cmd, NULL, 0, 0), 0);
}

static int count_ids(const char *s) {
    int n = 0;
    const char *p = s;
    while (*p) {
        while (*p == ' ') p++;
        if (*p >= '0' && *p <= '9') {
            n++;
            while (*p >= '0' && *p <= '9') p++;
        } else if (*p == '\n' && p[1] == 0) {
            break;
        } else {
            return -1;
        }
    }
    return n;
}

static void test_run_ids_deterministic(void **state) {
    (void)state;
    char cmd[2048], first[4096] = "", out[4096];
    const int threads[] = {1, 2, 3, 1};
    for (size_t i = 0; i < sizeof threads / sizeof threads[0]; i++) {
        snprintf(cmd, sizeof cmd, "'%s' run -m '%s' --tokens 1,2,3 -n 16 --seed 7 --output ids --threads %d", kvbt_bin(),
                 g_model, threads[i]);
        assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
        assert_int_equal(count_ids(out), 16);
        if (i == 0) strcpy(first, out);
        else assert_string_equal(out, first);
    }
    /* greedy decoding is deterministic too, and differs from sampling */
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' --tokens 1,2,3 -n 16 --temp 0 --output ids", kvbt_bin(), g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_int_equal(count_ids(out), 16);
}

static void test_run_bad_options(void **state) {
    (void)state;
    char cmd[2048], out[4096];
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' --tokens 1,x,3", kvbt_bin(), g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 2);
    assert_non_null(strstr(out, "--tokens"));
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' --tokens 1,2 -n -4", kvbt_bin(), g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 2);
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' --tokens 999999 -n 2", kvbt_bin(), g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 1);
    assert_non_null(strstr(out, "outside the vocabulary"));
    snprintf(cmd, sizeof cmd, "'%s' run -m /nonexistent.gguf --tokens 1", kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 1);
    assert_non_null(strstr(out, "/nonexistent.gguf"));
    snprintf(cmd, sizeof cmd, "'%s' gen-model --preset nope --out x.gguf", kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 1);
    assert_non_null(strstr(out, "llama3.2-1b"));
    const char *subs[] = {"run", "gen-model", "bench", "demo", "tokenize", "inspect", "serve", "verify", "doctor"};
    for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
        snprintf(cmd, sizeof cmd, "'%s' %s --help", kvbt_bin(), subs[i]);
        assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
        assert_non_null(strstr(out, "usage: kvbridge"));
    }
}

static void test_run_text_prompt(void **state) {
    (void)state;
    char cmd[2048], out[8192];
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' -p 'Hello there' -n 8 --seed 1", kvbt_bin(), g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_true(strlen(out) > 0);
}

/* `tokenize --jsonl`: one line of ids per JSON-string line, each what `tokenize` gives that text alone
 * (escapes decoded: a newline, a multi-byte character; the empty text); a line that is not a JSON
 * string stops it with exit 2 and its line number. */
static void test_tokenize_jsonl(void **state) {
    (void)state;
    char cmd[2048], out[4096], one[1024], want[4096] = "";
    const char *texts[] = {"Hello there", "a\nb \xc3\xa9", ""};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        snprintf(cmd, sizeof cmd, "printf '%%s' '%s' | '%s' tokenize -m '%s'", texts[i], kvbt_bin(), g_model);
        assert_int_equal(kvbt_sh(cmd, one, sizeof one, 0), 0);
        strcat(want, one);
    }
    snprintf(cmd, sizeof cmd, "printf '\"Hello there\"\\n\"a\\\\nb \\\\u00e9\"\\n\"\"\\n' | '%s' tokenize -m '%s' --jsonl",
             kvbt_bin(), g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_string_equal(out, want);
    snprintf(cmd, sizeof cmd, "printf '\"x\"\\n5\\n' | '%s' tokenize -m '%s' --jsonl", kvbt_bin(), g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 2);
    assert_non_null(strstr(out, "line 2"));
}

/* The batched-decode benchmarks run and keep their own checks (not timed: the figures are theirs). */
static void test_bench_batched_decode_runs(void **state) {
    (void)state;
    char cmd[2048], out[8192];
    snprintf(cmd, sizeof cmd, "'%s' bench parallel -m '%s' --clients 3 --tokens 6 --prompt-tokens 40 --rounds 1 --threads 2",
             kvbt_bin(), g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_non_null(strstr(out, "the same text from both nodes"));
    snprintf(cmd, sizeof cmd, "'%s' bench decode -m '%s' --ctx 8 --gen 4 --reps 1 --batch 3 --threads 2", kvbt_bin(),
             g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_non_null(strstr(out, "3 sequences stepped together"));
    snprintf(cmd, sizeof cmd, "'%s' bench parallel --help", kvbt_bin());
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_non_null(strstr(out, "usage: kvbridge bench parallel"));
    /* structured outputs against plain text: both replies run the full 8 tokens (else it fails) */
    snprintf(cmd, sizeof cmd, "'%s' bench json -m '%s' --tokens 8 --rounds 1 --threads 2", kvbt_bin(), g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_non_null(strstr(out, "median     plain"));
    assert_non_null(strstr(out, "reply      {"));
}

/* "a,b,c": the first n of ids. */
static void join_ids(char *buf, size_t cap, const int *ids, int n) {
    buf[0] = 0;
    for (int i = 0; i < n; i++) snprintf(buf + strlen(buf), cap - strlen(buf), "%s%d", i ? "," : "", ids[i]);
}

/* `run --logits-out F --logits-all` on a mixture of experts (tiny-moe): one row per prompt position,
 * and row i bit for bit the last-token logits of a run over the first i + 1 tokens (what llama.cpp's
 * logits_all is compared with). `bench decode --batch` prints the experts a batch's step reads. */
static void test_run_logits_all(void **state) {
    (void)state;
    static const int ids[] = {3, 17, 99, 5, 250, 7, 61, 128, 33, 2, 200, 45};
    const int n_ids = (int)(sizeof ids / sizeof ids[0]), prefixes[] = {1, 6, n_ids};
    char moe[512], all[512], one[512], cmd[2048], out[8192], list[256];
    kvbt_tmp_path(moe, sizeof moe, "moe.gguf");
    kvbt_tmp_path(all, sizeof all, "logits_all.bin");
    kvbt_tmp_path(one, sizeof one, "logits_one.bin");
    snprintf(cmd, sizeof cmd, "'%s' gen-model --preset tiny-moe --type q8_0 --out '%s' --quiet", kvbt_bin(), moe);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    join_ids(list, sizeof list, ids, n_ids);
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' --tokens %s -n 0 --output ids --logits-out '%s' --logits-all",
             kvbt_bin(), moe, list, all);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    size_t n_all = 0, n_one = 0;
    float *a = kvbt_read_file(all, &n_all); // (position, vocab)
    assert_non_null(a);
    assert_int_equal(n_all % (n_ids * sizeof(float)), 0);
    const size_t V = n_all / sizeof(float) / n_ids;
    for (size_t k = 0; k < sizeof prefixes / sizeof prefixes[0]; k++) {
        const int p = prefixes[k];
        join_ids(list, sizeof list, ids, p);
        snprintf(cmd, sizeof cmd, "'%s' run -m '%s' --tokens %s -n 0 --output ids --logits-out '%s'", kvbt_bin(), moe,
                 list, one);
        assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
        float *o = kvbt_read_file(one, &n_one); // (vocab)
        assert_non_null(o);
        assert_int_equal(n_one, V * sizeof(float));
        assert_memory_equal(o, a + (size_t)(p - 1) * V, V * sizeof(float));
        free(o);
    }
    free(a);
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' --tokens 1,2 -n 0 --logits-all", kvbt_bin(), moe);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 2);
    assert_non_null(strstr(out, "--logits-out"));
    snprintf(cmd, sizeof cmd, "'%s' bench decode -m '%s' --ctx 8 --gen 4 --reps 1 --batch 4 --threads 2", kvbt_bin(),
             moe);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 0), 0);
    assert_non_null(strstr(out, "expected 5.47 of 8 experts per layer")); /* 8 * (1 - (1 - 2/8)^4) */
}

/* `serve` stops gracefully: on SIGTERM a stream in flight runs to its end, a request that comes
 * meanwhile gets a 503, and the process then exits 0. The stream must still run 0.3 s after the
 * signal: 6,000 tokens take seconds in a release build; under ASan a token takes ~25 ms, so 800
 * (~20 s) do (6,000 took 155 s there, the longest test of CI's sanitizer pass). */
#if defined(__SANITIZE_ADDRESS__)
#define DRAIN_TOKENS "800"
#else
#define DRAIN_TOKENS "6000"
#endif
static void test_serve_drains_on_sigterm(void **state) {
    (void)state;
    char dir[512], cmd[4096], out[8192];
    kvbt_tmp_path(dir, sizeof dir, "drain");
    snprintf(cmd, sizeof cmd,
             "set -u; rm -rf '%s'; mkdir -p '%s' && cd '%s' || exit 9\n"
             "'%s' serve --role decode -m '%s' --http 127.0.0.1:0 --ctx 8192 --threads 1 --drain-seconds 300 "
             "  > serve.out 2> serve.err & P=$!\n"
             "for i in $(seq 300); do grep -q 'on port' serve.out && break; sleep 0.1; done\n"
             "PORT=$(sed -n 's/.*OpenAI API on port \\([0-9]*\\).*/\\1/p' serve.out)\n"
             "curl -sN -H 'Content-Type: application/json' -d '{\"model\":\"m\",\"prompt\":[5,6],\"max_tokens\":" DRAIN_TOKENS ","
             "\"ignore_eos\":true,\"stream\":true,\"stream_options\":{\"include_usage\":true}}' "
             "http://127.0.0.1:$PORT/v1/completions > stream.txt & C=$!\n"
             "for i in $(seq 300); do [ -s stream.txt ] && break; sleep 0.05; done\n"
             "kill -TERM $P; sleep 0.3\n"
             "echo late=$(curl -s -o /dev/null -w '%%{http_code}' http://127.0.0.1:$PORT/v1/models)\n"
             "wait $C; wait $P; echo exit=$?\n"
             "echo tokens=$(grep -c '\"completion_tokens\":" DRAIN_TOKENS ",' stream.txt) done=$(grep -c '^data: \\[DONE\\]' stream.txt) "
             "length=$(grep -c 'finish_reason\":\"length' stream.txt)\n",
             dir, dir, dir, kvbt_bin(), g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    printf("%s", out);
    assert_non_null(strstr(out, "late=503"));
    assert_non_null(strstr(out, "exit=0"));
    assert_non_null(strstr(out, "tokens=1 done=1 length=1")); /* all the tokens, the finish and the end */
}

/* `serve --role prefill` stops gracefully too: SIGTERM while it ships a prompt (paused 2 s at its
 * 3rd slab) lets that prompt finish (the decoder's verdict is `complete`), then it exits 0. The
 * signal goes when the prefill node says it paused (a fixed delay raced the request on a loaded
 * machine: the signal then found nothing in flight). */
static void test_serve_prefill_drains_on_sigterm(void **state) {
    (void)state;
    char dir[512], cmd[4096], out[8192];
    kvbt_tmp_path(dir, sizeof dir, "pdrain");
    snprintf(cmd, sizeof cmd,
             "set -u; rm -rf '%s'; mkdir -p '%s' && cd '%s' || exit 9\n"
             "export KVB_PSK=cli-run-drain-key-0123456789\n"
             "'%s' serve --role prefill -m '%s' --listen 127.0.0.1:0 --ctx 8192 --threads 1 --fault pause:3 "
             "  > p.out 2> p.err & P=$!\n"
             "for i in $(seq 300); do grep -q 'on port' p.out && break; sleep 0.1; done\n"
             "PP=$(sed -n 's/.*listening on port \\([0-9]*\\).*/\\1/p' p.out)\n"
             "'%s' serve --role decode -m '%s' --http 127.0.0.1:0 --peer 127.0.0.1:$PP --ctx 8192 --threads 1 "
             "  > d.out 2> d.err & D=$!\n"
             "for i in $(seq 300); do grep -q 'on port' d.out && break; sleep 0.1; done\n"
             "DP=$(sed -n 's/.*OpenAI API on port \\([0-9]*\\).*/\\1/p' d.out)\n"
             "curl -s -D h.txt -H 'Content-Type: application/json' -d \"{\\\"model\\\":\\\"m\\\",\\\"prompt\\\":[$(seq 600 | awk '{printf \"%%s%%d\", (NR > 1 ? \",\" : \"\"), $1 %% 250 + 3}')],"
             "\\\"max_tokens\\\":4}\" http://127.0.0.1:$DP/v1/completions > reply.json & C=$!\n"
             "for i in $(seq 600); do grep -q 'pausing 2 s' p.err && break; sleep 0.05; done; kill -TERM $P\n"
             "wait $C; wait $P; echo exit=$?\n"
             "echo verdict=$(grep -i '^x-kvbridge:' h.txt | tr -d '\\r' | cut -d' ' -f2-)\n"
             "grep -o 'draining [0-9]* request' p.err\n"
             "kill -TERM $D; wait $D\n",
             dir, dir, dir, kvbt_bin(), g_model, kvbt_bin(), g_model);
    assert_int_equal(kvbt_sh(cmd, out, sizeof out, 1), 0);
    printf("%s", out);
    assert_non_null(strstr(out, "exit=0"));
    assert_non_null(strstr(out, "verdict=complete"));
    assert_non_null(strstr(out, "draining 1 request"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gen_model_thread_invariant),
        cmocka_unit_test(test_run_ids_deterministic),
        cmocka_unit_test(test_run_bad_options),
        cmocka_unit_test(test_run_text_prompt),
        cmocka_unit_test(test_tokenize_jsonl),
        cmocka_unit_test(test_bench_batched_decode_runs),
        cmocka_unit_test(test_run_logits_all),
        cmocka_unit_test(test_serve_drains_on_sigterm),
        cmocka_unit_test(test_serve_prefill_drains_on_sigterm),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
