/* cli — the `kvbridge` subcommands. Each cmd_*.c implements one subcommand as
 * int kvb_cmd_NAME(int argc, char **argv) (argv[0] is the subcommand name) and prints its own
 * --help. Only this module (and tests) may exit the process. */
#ifndef KVB_CLI_H
#define KVB_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

int kvb_cmd_gen_model(int argc, char **argv);
int kvb_cmd_run(int argc, char **argv);
int kvb_cmd_bench(int argc, char **argv);
int kvb_cmd_demo(int argc, char **argv);
int kvb_cmd_tokenize(int argc, char **argv);
int kvb_cmd_inspect(int argc, char **argv);
int kvb_cmd_verify(int argc, char **argv);
int kvb_cmd_serve(int argc, char **argv);
int kvb_cmd_doctor(int argc, char **argv);
/* `kvbridge bench ladder` (cmd_bench_ladder.c), dispatched by kvb_cmd_bench. */
int kvb_bench_ladder(int argc, char **argv);
/* `kvbridge bench link` (cmd_bench_link.c). */
int kvb_bench_link(int argc, char **argv);
/* GB/s of `bytes` sent over `streams` (1..KVB_MAX_LANES) plain TCP connections on 127.0.0.1 at
 * once, bytes / streams on each in pieces of `piece` bytes, each connection with its own sending
 * and its own receiving thread of this process, all started together; timed from the start to the
 * last receiver's acknowledgement. 0 on failure (or a stream count out of range). The yardstick
 * for the slab path striped over as many lanes, on the same machine, in the same run. */
double kvb_bench_raw_loopback_gbs(uint64_t bytes, size_t piece, uint32_t streams);
/* The same over a real link: `bytes` over `streams` plain TCP connections to a `kvbridge bench link
 * --listen ADDR` server (a raw-only round), timed to the server's acknowledgements. 0 on failure
 * (the reason printed on stderr). */
double kvb_bench_raw_remote_gbs(const char *addr, uint64_t bytes, size_t piece, uint32_t streams);
/* `kvbridge bench slab` (cmd_bench_slab.c). */
int kvb_bench_slab(int argc, char **argv);
/* `kvbridge bench tokenize` (cmd_bench_tokenize.c). */
int kvb_bench_tokenize(int argc, char **argv);
/* `kvbridge bench parallel` (cmd_bench_parallel.c). */
int kvb_bench_parallel(int argc, char **argv);
/* `kvbridge bench json` (cmd_bench_json.c). */
int kvb_bench_json(int argc, char **argv);
/* `kvbridge bench quality` (cmd_bench_quality.c). */
int kvb_bench_quality(int argc, char **argv);

/* A deterministic long-context prompt for a quality benchmark (cli/quality_prompts.c): a readable
 * English document (company report, travel journal or facts about fictional cities, from word
 * lists and sentence templates) of about target_tokens_approx tokens (~4 characters per token),
 * with one needle sentence ("The secret code of the blue lighthouse is 48217.") at a depth chosen
 * from the seed; *needle_question asks for it ("What is the secret code of the blue lighthouse?")
 * and *needle_answer is the code ("48217"), whose digits occur exactly once in *text. The same
 * seed and size give the same bytes on every machine. Returns 0, or -1 (bad arguments:
 * target 0 or above 2^26, NULL outputs; out of memory) with the outputs NULL. Caller frees all three. */
int kvb_quality_prompt(uint64_t seed, uint32_t target_tokens_approx, char **text, char **needle_question,
                       char **needle_answer);

/* All of a stream (a file, stdin) into a buffer the caller frees; *n its length. NULL on a read
 * error or when memory runs out (cli/args.c). */
char *kvb_cli_read_all(FILE *f, size_t *n);

/* Small shared helpers for option parsing (cli/args.c). */
bool kvb_arg_is_help(const char *a);
/* Parses a whole decimal integer in [lo, hi]; prints "kvbridge CMD: --OPT expects ..." and
 * returns false on error. */
bool kvb_arg_int(const char *cmd, const char *opt, const char *val, long long lo, long long hi,
                 long long *out);
bool kvb_arg_u64(const char *cmd, const char *opt, const char *val, uint64_t *out);
bool kvb_arg_float(const char *cmd, const char *opt, const char *val, double lo, double hi, double *out);
/* Returns the value of an option that takes one (argv[*i + 1]) and advances *i, or prints
 * "kvbridge CMD: OPT needs a value" and returns NULL. */
const char *kvb_arg_value(const char *cmd, int argc, char **argv, int *i);
/* Parses a tensor/cache type name ("f16", "q8_0", ...) into *out, or prints what is wrong. */
bool kvb_arg_type(const char *cmd, const char *opt, const char *val, uint32_t *out);
/* The most GPUs --gpus takes (the CUDA engine's KVB_CUDA_MAX_GPUS, checked where both are seen). */
#define KVB_CLI_MAX_GPUS 8
/* --gpus N (> 1) and --tp-one-device need the CUDA engine (cuda): false, with a message, otherwise. */
bool kvb_arg_gpus_ok(const char *cmd, long long gpus, bool tp_one_device, bool cuda);
/* --gpu-weights auto|bf16|packed: *out = 0, 1 or 2 (kvb_cuda_weights); false after a message. */
bool kvb_arg_gpu_weights_ok(const char *cmd, int gpu_weights, bool cuda); /* false (said) without cuda */
bool kvb_arg_gpu_weights(const char *cmd, const char *val, int *out);
/* The help line of --gpu-weights, shared by every command that takes it. */
#define KVB_CLI_GPU_WEIGHTS_HELP                                                                                \
    "  --gpu-weights W      (cuda) auto (default: bf16 when the model's bf16 form fits the GPU with the cache,\n" \
    "                       else packed), bf16 (every matrix converted at load) or packed (matrices kept in\n"   \
    "                       the file's type, a layer expanded to bf16 just before it runs; same results)\n"
/* Where the real Gemma 3 270M file is (tools/fetch_gemma3.sh puts it there): $KVB_GEMMA3_GGUF,
 * else ${KVB_CACHE_DIR:-$HOME/.cache/kvbridge}/gemma-3-270m-q4_k_m.gguf. It may not exist. */
void kvb_gemma3_path(char *buf, size_t cap);
/* Sorts v (n >= 1) ascending and returns its median (benchmarks list the runs sorted). */
double kvb_median_sort(double *v, int n);

#endif
