/* tests/support/kvbt.h — small helpers shared by the tests: a private temp directory, running
 * the kvbridge binary and capturing its output and exit code, reading test environment paths,
 * a relative L2 distance, skipping a test that needs a GPU. */
#ifndef KVBT_H
#define KVBT_H

#include <stddef.h>
#include <stdint.h>

/* Creates (once per process) and returns a fresh temp directory; removed at exit. */
const char *kvbt_tmpdir(void);
/* Joins the temp dir and name into a static-lifetime-free buffer. */
void kvbt_tmp_path(char *buf, size_t cap, const char *name);
/* Runs a shell command line; captures stdout (and stderr if merge_stderr) into out (NUL-terminated,
 * truncated to cap-1). Returns the exit status (or -1 if it could not run / was signalled). */
int kvbt_sh(const char *cmdline, char *out, size_t cap, int merge_stderr);
/* The kvbridge binary under test (KVB_BIN), or "kvbridge". */
const char *kvbt_bin(void);
/* The shared data directory (KVB_SHARED_DIR) or NULL if unset/absent. */
const char *kvbt_shared_dir(void);
/* The real Gemma 3 270M file: $KVB_GEMMA3_GGUF, else ~/.cache/kvbridge/gemma-3-270m-q4_k_m.gguf
 * (tools/fetch_gemma3.sh); NULL when it is not there. */
const char *kvbt_gemma3_path(void);
/* |a - ref| / |ref| in double (|a - ref| when ref is all zero). */
double kvbt_rel_l2(const float *a, const float *ref, size_t n);
/* Writes a preset (kvb_gen_model: its shapes, weights of `type`, seeded) to name in the temp dir
 * and loads it; NULL (said on stderr) when either fails. For a group's setup. */
struct kvb_model;
struct kvb_model *kvbt_gen_load(const char *name, const char *preset, uint32_t type, uint64_t seed);
/* n token ids below n_vocab, from seed. */
void kvbt_random_tokens(int32_t *tokens, uint32_t n, uint32_t n_vocab, uint64_t seed);
/* In a cmocka test: skips it, saying why, when no CUDA device can be used (always in a build
 * without the CUDA engine). */
void kvbt_require_gpu(void);

#endif
