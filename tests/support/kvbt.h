/* tests/support/kvbt.h — small helpers shared by the tests: a private temp directory, running
 * the kvbridge binary and capturing its output and exit code, reading test environment paths
 * (the tokenizer vocabularies, the real Gemma 3 file), a relative L2 distance, skipping a case with
 * its reason (a GPU, a vocabulary). How a binary reports passed, failed and skipped cases to ctest
 * is in kvbt_run.c. */
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
/* The whole file at path, malloc'd (*n: its bytes); NULL when it cannot be read or is empty. */
void *kvbt_read_file(const char *path, size_t *n);
/* The tokenizer test vocabularies (llama.cpp's vocab-only GGUFs and their .inp/.out vectors, Qwen's
 * tokenizer.json) are in $KVB_VOCAB_DIR, else $KVB_SHARED_DIR/vocab, else
 * ${KVB_CACHE_DIR:-$HOME/.cache/kvbridge}/vocab, where tools/fetch_vocab.sh puts them.
 * Writes the path of vocabulary file `name` (e.g. "llama-spm.gguf") there into buf; returns buf
 * when the file exists, else NULL (buf then holds where it was looked for). */
const char *kvbt_vocab_file(const char *name, char *buf, size_t cap);
/* In a cmocka test: kvbt_vocab_file, or skips the case saying which file is missing and how to
 * get it. */
const char *kvbt_require_vocab(const char *name, char *buf, size_t cap);
/* The real Gemma 3 270M file: $KVB_GEMMA3_GGUF, else gemma-3-270m-q4_k_m.gguf in
 * ${KVB_CACHE_DIR:-$HOME/.cache/kvbridge}, where tools/fetch_gemma3.sh puts it; NULL when it is not
 * there. */
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

/* In a cmocka test: the llama-server binary ($KVB_LLAMA_SERVER, else
 * build-peer/llama-server-bin/llama-server in $KVB_SOURCE_DIR, where tools/peer/build_llama_server.sh
 * puts it) in buf, or skips the case saying how to get it. */
const char *kvbt_require_llama_server(char *buf, size_t cap);
/* In a cmocka test: starts it on 127.0.0.1:port with the model, n_slots slots (-np), 2 threads,
 * `--slot-save-path slots`, `-fa fa` ("on", "off") and one more flag `extra` (NULL: none; e.g.
 * "--swa-full"), its log in the temp dir; waits (up to 60 s) until it answers /tokenize, else fails
 * the case. Stop it with kill(SIGTERM) and waitpid. */
int kvbt_llama_server_start(const char *bin, const char *model, const char *slots, int port, int n_slots,
                            const char *fa, const char *extra);
/* In a cmocka test: the real Gemma 3 270M file (kvbt_gemma3_path), or skips the case saying how to
 * get it. */
const char *kvbt_require_gemma3(void);

/* In a cmocka test: skips the running case with a printf-style reason, which the binary's closing
 * summary repeats ("kvbt: skipped CASE: REASON"). Does not return. */
#define kvbt_skip(...) kvbt_skip_at(__FILE__, __LINE__, __VA_ARGS__)
void kvbt_skip_at(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), noreturn));

#endif
