/* cli — the `kvbridge` subcommands. Each cmd_*.c implements one subcommand as
 * int kvb_cmd_NAME(int argc, char **argv) (argv[0] is the subcommand name): it declares its options
 * as a table (kvb_opt, below) that kvb_cli_parse reads and that its --help is generated from.
 * Only this module (and tests) may exit the process. */
#ifndef KVB_CLI_H
#define KVB_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvb_core.h"

int kvb_cmd_gen_model(int argc, char **argv);
int kvb_cmd_run(int argc, char **argv);
int kvb_cmd_bench(int argc, char **argv);
int kvb_cmd_demo(int argc, char **argv);
int kvb_cmd_tokenize(int argc, char **argv);
int kvb_cmd_inspect(int argc, char **argv);
int kvb_cmd_verify(int argc, char **argv);
/* `verify --target llama.cpp` (cmd_verify_llamacpp.c): a stock llama-server's saved slot vs the
 * same cache computed by kvbridge in llama.cpp's state format. */
typedef struct {
    const char *model, *prompt;
    const char *server;    /* http://HOST:PORT of a llama-server run with --slot-save-path slot_dir; or NULL */
    const char *slot_dir;  /* where llama-server saves slots (kvbridge's file goes there too) */
    const char *slot_file; /* without a server: a slot file llama-server saved before */
    int threads;
    bool restore;          /* with a server: restore kvbridge's file and decode, and a refused restore */
    int n_predict;
    bool kv_ggml;          /* kvbridge's rows at the ggml fidelity level (kvb_engine_opts.ggml_arith) */
} kvb_verify_llamacpp_opts;
int kvb_verify_llamacpp(const kvb_verify_llamacpp_opts *o);
int kvb_cmd_serve(int argc, char **argv);
int kvb_cmd_doctor(int argc, char **argv);
/* `kvbridge bench ladder` (cmd_bench_ladder.c), dispatched by kvb_cmd_bench, which hands each
 * benchmark argv from its own name on (argv[0] = "ladder"), like a subcommand's. */
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
/* `kvbridge bench fleet` (cmd_bench_fleet.c). */
int kvb_bench_fleet(int argc, char **argv);
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

/* ---- The option parser (cli/args.c) ----------------------------------------------------------
 * A subcommand declares its options as a table of kvb_opt (ended by an entry whose long_name and
 * short_name are both unset) and one kvb_cli_spec; kvb_cli_parse fills the destinations and
 * kvb_cli_help prints the usage, the description and one entry per option, all from that table.
 * Accepted forms: --name VALUE, --name=VALUE, -x VALUE, bare flags, `--` (the rest are operands).
 * A destination keeps what the caller put there unless the option has a default (.def, parsed as
 * if given first) or appears on the command line; a repeated option's last value wins (a list
 * collects every one). */
typedef enum {
    KVB_OPT_FLAG,   /* bool: true when given; takes no value */
    KVB_OPT_STRING, /* const char *: the value itself (argv's storage) */
    KVB_OPT_INT,    /* long long: a whole decimal number in [lo, hi] */
    KVB_OPT_UINT,   /* uint64_t: a whole decimal (or 0x hex) number in [ulo, uhi]; uhi 0 = UINT64_MAX */
    KVB_OPT_DOUBLE, /* double: a finite decimal number in [dlo, dhi] */
    KVB_OPT_SIZE,   /* uint64_t bytes: a whole number with an optional K, M, G or T (x1024^n) in [ulo, uhi] */
    KVB_OPT_ENUM,   /* int: the index of the value in .choices (NULL-terminated) */
    KVB_OPT_LIST,   /* kvb_opt_list: every occurrence's value, in order (a repeatable option) */
    KVB_OPT_CUSTOM, /* .parse(value, dst, err) converts, or says what is wrong */
} kvb_opt_kind;

/* The values of a repeatable option (KVB_OPT_LIST), pointing into argv. */
#define KVB_OPT_LIST_MAX 32
typedef struct {
    const char *v[KVB_OPT_LIST_MAX];
    int n;
} kvb_opt_list;

/* The converter of a KVB_OPT_CUSTOM option: KVB_OK with *dst set, or a status and what is wrong
 * with val in err (the parser puts the option's name in front). */
typedef kvb_status (*kvb_opt_parse_fn)(const char *val, void *dst, kvb_err *err);

typedef struct {
    const char *long_name; /* "model" for --model; NULL when the option has a short name only */
    char short_name;       /* 'm' for -m; 0 when none */
    kvb_opt_kind kind;
    void *dst;         /* where the value goes (the C type the kind names) */
    const char *meta;  /* the value's name in help ("FILE"); enums default to their choices a|b|c */
    const char *help;  /* what it does, one line (the help wraps it) */
    const char *def;   /* the default, as it would be written on the command line; NULL: none */
    bool required;     /* the command refuses to run without it */
    long long lo, hi;  /* KVB_OPT_INT's range */
    uint64_t ulo, uhi; /* KVB_OPT_UINT's and KVB_OPT_SIZE's range (uhi 0: no upper limit) */
    double dlo, dhi;   /* KVB_OPT_DOUBLE's range */
    const char *const *choices; /* KVB_OPT_ENUM's names, NULL-terminated */
    kvb_opt_parse_fn parse;     /* KVB_OPT_CUSTOM's converter */
} kvb_opt;

typedef struct {
    const char *name;  /* "run", "bench ladder": messages read "kvbridge NAME: ..." */
    const char *usage; /* what follows "usage: kvbridge NAME "; a '\n' starts another usage line */
    const char *about; /* the one-paragraph description (wrapped; a '\n' breaks the line) */
    const kvb_opt *opts;
    const char *epilog; /* printed after the options as it is (lists, examples); NULL: nothing */
    /* Operands (arguments that are not options): at most max_operands of them go to operands[],
     * their count to *n_operands; with max_operands 0 an operand is an error. */
    int max_operands;
    const char **operands;
    int *n_operands;
} kvb_cli_spec;

/* What kvb_cli_parse's caller does next: go on, or return the code it gave (0 after --help,
 * 2 after a usage error, already explained on stderr). */
#define KVB_CLI_GO (-1)
/* Parses argv[1..argc-1] (argv[0] is the subcommand's name) by spec. Returns KVB_CLI_GO with
 * every destination filled; 0 after printing the help on stdout (-h, --help); 2 after printing
 * "kvbridge NAME: <what is wrong> (see kvbridge NAME --help)" on stderr. */
int kvb_cli_parse(const kvb_cli_spec *spec, int argc, char **argv);
/* The same without printing: KVB_OK with *help_asked set when -h/--help came; KVB_ERR_INVALID
 * (an unknown option, an operand too many, a missing value or option) or KVB_ERR_RANGE (a number
 * out of range or with trailing junk, an unknown choice), or a custom converter's status, with
 * the message in err. */
kvb_status kvb_cli_parse_args(const kvb_cli_spec *spec, int argc, char **argv, bool *help_asked, kvb_err *err);
/* The help generated from spec: usage lines, the description, one entry per option, the epilog. */
void kvb_cli_help(const kvb_cli_spec *spec, FILE *f);
/* Prints "kvbridge NAME: <fmt> (see kvbridge NAME --help)" on stderr and returns 2: for checks
 * that span several options, after parsing. */
int kvb_cli_usage_error(const kvb_cli_spec *spec, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Shorthands for the commonest entries (long name only; def_ may be NULL). */
#define KVB_CLI_INT(name_, dst_, meta_, lo_, hi_, def_, help_)                                                \
    {.long_name = (name_), .kind = KVB_OPT_INT, .dst = (dst_), .meta = (meta_), .lo = (lo_), .hi = (hi_),    \
     .def = (def_), .help = (help_)}
#define KVB_CLI_STR(name_, dst_, meta_, help_)                                                                \
    {.long_name = (name_), .kind = KVB_OPT_STRING, .dst = (dst_), .meta = (meta_), .help = (help_)}
#define KVB_CLI_FLAG(name_, dst_, help_) {.long_name = (name_), .kind = KVB_OPT_FLAG, .dst = (dst_), .help = (help_)}

/* Shared option groups: declared here once, placed in any command's table. */
extern const char *const kvb_cli_device_names[];     /* cpu, cuda (index 1 = cuda) */
extern const char *const kvb_cli_gpu_weights_names[]; /* auto, bf16, packed (kvb_cuda_weights' order) */
kvb_status kvb_opt_parse_type(const char *val, void *dst, kvb_err *err); /* into a uint32_t kvb_type */
/* -m/--model MODEL, a GGUF file. */
#define KVB_CLI_OPT_MODEL(dst_, help_, required_)                                                              \
    {.long_name = "model", .short_name = 'm', .kind = KVB_OPT_STRING, .dst = (dst_), .meta = "MODEL",          \
     .help = (help_), .required = (required_)}
/* --threads T, CPU threads (1..1024); what 0 (unset) means is the command's (help_). */
#define KVB_CLI_OPT_THREADS(dst_, help_)                                                                       \
    {.long_name = "threads", .kind = KVB_OPT_INT, .dst = (dst_), .meta = "T", .help = (help_), .lo = 1,         \
     .hi = 1024}
/* --psk KEY, the link's pre-shared key. */
#define KVB_CLI_OPT_PSK(dst_, help_)                                                                           \
    {.long_name = "psk", .kind = KVB_OPT_STRING, .dst = (dst_), .meta = "KEY", .help = (help_)}
/* --cache-type T (uint32_t kvb_type), default f16. */
#define KVB_CLI_OPT_CACHE_TYPE(dst_, help_)                                                                    \
    {.long_name = "cache-type", .kind = KVB_OPT_CUSTOM, .dst = (dst_), .meta = "T", .help = (help_),            \
     .def = "f16", .parse = kvb_opt_parse_type}
/* --device cpu|cuda into an int (1 = cuda), default cpu. */
#define KVB_CLI_OPT_DEVICE(dst_, help_)                                                                        \
    {.long_name = "device", .kind = KVB_OPT_ENUM, .dst = (dst_), .help = (help_), .def = "cpu",                \
     .choices = kvb_cli_device_names}
/* --bridge-mode decoder|prefill into an int (1 = prefill), default decoder; both nodes must agree. */
extern const char *const kvb_cli_bridge_mode_names[];
#define KVB_CLI_OPT_BRIDGE_MODE(dst_)                                                                         \
    {.long_name = "bridge-mode", .kind = KVB_OPT_ENUM, .dst = (dst_), .meta = "M", .def = "decoder",          \
     .choices = kvb_cli_bridge_mode_names,                                                                   \
     .help = "decoder (the decoder's own arithmetic, exact) or prefill (the prefill engine's own K/V "        \
             "re-encoded: cheaper, not exact); both nodes must agree"}
/* --kv-arith engine|ggml into an int (1 = ggml), default engine: the fidelity level of the K/V a
 * llama.cpp decoder gets (kvb_engine_opts.ggml_arith). */
extern const char *const kvb_cli_kv_arith_names[];
#define KVB_CLI_OPT_KV_ARITH(dst_, help_)                                                                     \
    {.long_name = "kv-arith", .kind = KVB_OPT_ENUM, .dst = (dst_), .meta = "A", .def = "engine",              \
     .choices = kvb_cli_kv_arith_names, .help = (help_)}
/* --transport tcp|ucx into an int (1 = ucx), default tcp; kvb_wire_backend_by_name of
 * kvb_cli_transport_names[i] gives the backend (a build without UCX refuses ucx, saying why). */
extern const char *const kvb_cli_transport_names[];
#define KVB_CLI_OPT_TRANSPORT(dst_, help_)                                                                    \
    {.long_name = "transport", .kind = KVB_OPT_ENUM, .dst = (dst_), .def = "tcp",                              \
     .choices = kvb_cli_transport_names, .help = (help_)}
/* --block-tokens N (1..4096, default 32), the decoder's cache block. */
#define KVB_CLI_OPT_BLOCK_TOKENS(dst_, help_)                                                                 \
    KVB_CLI_INT("block-tokens", (dst_), "N", 1, 4096, "32", (help_))
/* The most GPUs --gpus takes (the CUDA engine's KVB_CUDA_MAX_GPUS, checked where both are seen). */
#define KVB_CLI_MAX_GPUS 8
/* The CUDA engine's placement: --gpus N, --tp-one-device, --gpu-weights W (into a kvb_cli_gpu). */
typedef struct {
    long long gpus;     /* 1..KVB_CLI_MAX_GPUS */
    bool tp_one_device; /* every rank on one GPU */
    int gpu_weights;    /* kvb_cuda_weights: 0 auto, 1 bf16, 2 packed */
} kvb_cli_gpu;
#define KVB_CLI_OPTS_GPU(g)                                                                                   \
    {.long_name = "gpus", .kind = KVB_OPT_INT, .dst = &(g)->gpus, .meta = "N", .def = "1", .lo = 1,           \
     .hi = KVB_CLI_MAX_GPUS,                                                                                 \
     .help = "(cuda) tensor-parallel over GPUs 0..N-1 (NCCL all-reduce): heads and the MLP width divide by " \
             "N, and a decoder receives the same slabs as from one GPU"},                                    \
    {.long_name = "tp-one-device", .kind = KVB_OPT_FLAG, .dst = &(g)->tp_one_device,                          \
     .help = "(cuda) with --gpus N: every rank on one GPU (tests the split; not faster)"},                    \
    {.long_name = "gpu-weights", .kind = KVB_OPT_ENUM, .dst = &(g)->gpu_weights, .meta = "W", .def = "auto",  \
     .choices = kvb_cli_gpu_weights_names,                                                                   \
     .help = "(cuda) auto (bf16 when the model's bf16 form fits the GPU with the cache, else packed), bf16 "  \
             "(every matrix converted at load) or packed (matrices kept in the file's type, a layer expanded " \
             "to bf16 just before it runs; same results)"}
/* --gpus, --tp-one-device and --gpu-weights only mean something with the CUDA engine (cuda): false
 * after a message otherwise (kvb_arg_gpus_ok, and --gpu-weights checked likewise). */
bool kvb_cli_gpu_ok(const char *cmd, const kvb_cli_gpu *g, bool cuda);

/* Small shared helpers for option parsing (cli/args.c). */
bool kvb_arg_is_help(const char *a); /* -h or --help */
/* Parses a whole decimal integer in [lo, hi] (an element of a list option); prints "kvbridge CMD:
 * --OPT expects ..." and returns false on error. */
bool kvb_arg_int(const char *cmd, const char *opt, const char *val, long long lo, long long hi,
                 long long *out);
/* --gpus N (> 1) and --tp-one-device need the CUDA engine (cuda): false, with a message, otherwise. */
bool kvb_arg_gpus_ok(const char *cmd, long long gpus, bool tp_one_device, bool cuda);
/* Where the real Gemma 3 270M file is (tools/fetch_gemma3.sh puts it there): $KVB_GEMMA3_GGUF,
 * else ${KVB_CACHE_DIR:-$HOME/.cache/kvbridge}/gemma-3-270m-q4_k_m.gguf. It may not exist. */
void kvb_gemma3_path(char *buf, size_t cap);
/* Sorts v (n >= 1) ascending and returns its median (benchmarks list the runs sorted). */
double kvb_median_sort(double *v, int n);

#endif
