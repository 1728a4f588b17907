/* cli/cmd_bench_slab.c — `kvbridge bench slab`: the decoder's side of the slab path on one
 * thread, without a network: kvb_store_slab_put (checks, XXH3 of K || V, scatter into the block,
 * commit when a block completes) over every (block, layer) of a prompt, and its two main parts
 * alone (the checksum, the scatter), beside the machine's memory bandwidth measured in the same
 * run. Tells whether the decode node's verifying thread can keep up with a link. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_kvformat.h"
#include "kvb_quant.h" /* kvb_type_name */
#include "kvb_store.h"

/* The shape and the runs `bench slab` times. */
typedef struct {
    long long tokens, layers, heads, hd, bt, reps;
    uint32_t dtype;
} slab_args;

/* Fills *a from argv; KVB_CLI_GO, or the code the command returns. */
static int slab_parse(slab_args *a, int argc, char **argv) {
    const kvb_opt opts[] = {
        KVB_CLI_INT("tokens", &a->tokens, "N", 1, 1 << 22, "8192", "prompt length"),
        KVB_CLI_INT("layers", &a->layers, "L", 1, 256, "16", "layers"),
        KVB_CLI_INT("kv-heads", &a->heads, "H", 1, 256, "8", "KV heads"),
        KVB_CLI_INT("head-dim", &a->hd, "D", 32, 1024, "64", "head dimension"),
        KVB_CLI_OPT_BLOCK_TOKENS(&a->bt, "tokens per cache block"),
        KVB_CLI_OPT_CACHE_TYPE(&a->dtype, "the decoder's cache dtype"),
        KVB_CLI_INT("reps", &a->reps, "R", 1, 100, "3", "repetitions (the best is reported)"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "bench slab", .opts = opts,
        .usage = "[--tokens N] [--layers L] [--kv-heads H] [--head-dim D] [--block-tokens B] [--cache-type T] "
                 "[--reps R]",
        .about = "The decode node's slab commit on one thread, no network: every (block, layer) slab of an "
                 "N-token prompt through kvb_store_slab_put (checks, checksum, scatter, commit), then the checksum "
                 "and the scatter alone. Prints microseconds per slab and GB/s (best of R). The defaults are the "
                 "llama3.2-1b shape."};
    return kvb_cli_parse(&spec, argc, argv);
}

int kvb_bench_slab(int argc, char **argv) {
    slab_args a = {0};
    int prc = slab_parse(&a, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    const long long tokens = a.tokens, layers = a.layers, heads = a.heads, hd = a.hd, bt = a.bt, reps = a.reps;
    const uint32_t dtype = a.dtype;
    kvb_kvformat f;
    kvb_err err = {0};
    if (kvb_kvformat_init(&f, dtype, (uint32_t)bt, (uint32_t)layers, (uint32_t)heads, (uint32_t)hd, &err)) {
        fprintf(stderr, "kvbridge bench slab: %s\n", err.msg);
        return 2;
    }
    const uint32_t nb = (uint32_t)((tokens + bt - 1) / bt);
    const size_t sb = (size_t)bt * heads * kvb_kvformat_row_bytes(&f); /* K (or V) of one slab */
    kvb_store *s = NULL;
    uint8_t *k = malloc(sb), *v = malloc(sb), *blk = NULL;
    int32_t *toks = calloc((size_t)nb * bt, sizeof(int32_t));
    uint64_t *keys = malloc(sizeof(uint64_t) * nb);
    kvb_slab_pending **p = calloc(nb, sizeof *p);
    int rc = 1;
    if (!k || !v || !toks || !keys || !p) goto done;
    for (size_t i = 0; i < sb; i++) k[i] = (uint8_t)(i * 7 + 1), v[i] = (uint8_t)(i * 13 + 5); /* (token, head, row) */
    if (kvb_store_create(&f, 1, nb + 1, &s, &err)) goto fail;
    kvb_store_prefault(s);
    if (!(blk = malloc(kvb_kvformat_block_bytes(&f)))) goto done;
    const uint64_t sum = kvb_slab_checksum(k, sb, v, sb), n_slabs = (uint64_t)nb * layers;
    double best_put = 1e30, best_hash = 1e30, best_scatter = 1e30;
    volatile uint64_t sink = 0;
    for (long long r = 0; r < reps; r++) {
        for (size_t t = 0; t < (size_t)nb * bt; t++) toks[t] = (int32_t)(r * 1000003 + (long long)t); /* fresh keys */
        kvb_store_chain_keys(s, toks, nb * (uint32_t)bt, keys);
        for (uint32_t b = 0; b < nb; b++)
            if (kvb_store_slab_begin(s, keys[b], b ? keys[b - 1] : kvb_store_root_key(s), toks + (size_t)b * bt, &p[b],
                                     &err))
                goto fail;
        double t0 = kvb_now_s();
        for (uint32_t l = 0; l < layers; l++) /* the order a prefill node ships: layer by layer, block by block */
            for (uint32_t b = 0; b < nb; b++) {
                kvb_block_id id;
                if (kvb_store_slab_put(p[b], l, 0, (uint32_t)bt, k, sb, v, sb, sum, &id, &err)) goto fail;
                if (id != KVB_BLOCK_NONE) kvb_store_release(s, &id, 1, NULL);
            }
        const double put = kvb_now_s() - t0;
        for (uint32_t b = 0; b < nb; b++) {
            kvb_store_slab_close(p[b]);
            p[b] = NULL;
        }
        t0 = kvb_now_s();
        for (uint64_t i = 0; i < n_slabs; i++) sink += kvb_slab_checksum(k, sb, v, sb);
        const double hash = kvb_now_s() - t0;
        t0 = kvb_now_s();
        for (uint64_t i = 0; i < n_slabs; i++)
            kvb_kvformat_scatter_rows(&f, blk, (uint32_t)(i % layers), 0, (uint32_t)bt, k, v);
        const double scatter = kvb_now_s() - t0;
        best_put = put < best_put ? put : best_put;
        best_hash = hash < best_hash ? hash : best_hash;
        best_scatter = scatter < best_scatter ? scatter : best_scatter;
    }
    const double bytes = 2.0 * (double)sb * (double)n_slabs;
    printf("slab      %s, %lld layers x %lld kv heads x %lld, %lld-token blocks: %zu KiB per slab (K and V), "
           "%llu slabs for %lld tokens\n",
           kvb_type_name(dtype), layers, heads, hd, bt, 2 * sb / 1024, (unsigned long long)n_slabs, tokens);
    printf("put       %.2f us per slab, %.2f GB/s (checks, checksum, scatter, commit; one thread)\n",
           best_put / n_slabs * 1e6, bytes / best_put / 1e9);
    printf("checksum  %.2f us per slab, %.2f GB/s (XXH3-64 of K || V, cache-hot)\n", best_hash / n_slabs * 1e6,
           bytes / best_hash / 1e9);
    printf("scatter   %.2f us per slab, %.2f GB/s (into one cache-hot block)\n", best_scatter / n_slabs * 1e6,
           bytes / best_scatter / 1e9);
    printf("memory    %.1f GB/s (one thread reading 1 GiB, same run)\n", kvb_measure_read_bw(NULL, (size_t)1 << 30, 3));
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "kvbridge bench slab: %s\n", err.msg);
done:
    if (p)
        for (uint32_t b = 0; b < nb; b++) kvb_store_slab_close(p[b]);
    kvb_store_free(s);
    free(blk);
    free(k);
    free(v);
    free(toks);
    free(keys);
    free(p);
    return rc;
}
