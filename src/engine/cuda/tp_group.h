/* engine/cuda/tp_group.h — private to the CUDA engine (not a contract): the ranks of a
 * tensor-parallel engine (kvb_engine_cuda.h, "Tensor parallelism"). A group owns one host thread
 * per rank; each thread keeps its rank's device current and runs the rank's part of every call
 * (create, sequences, forward, free), so the ranks' GPUs work at once and meet only in the
 * all-reduce (tp_comm.h). engine.c's public functions hand a leader's calls to these. */
#ifndef KVB_TP_GROUP_H
#define KVB_TP_GROUP_H

#include <stdbool.h>
#include <stdint.h>

#include "kvb_engine_cuda.h"
#include "tp_comm.h"

#define KVB_TP_MAX_RANKS KVB_CUDA_MAX_GPUS

typedef struct kvb_tp_group kvb_tp_group;
typedef struct kvb_tp_seq kvb_tp_seq; /* one kvb_cuda_seq per rank */

/* o: resolved options with n_gpus > 1. Rank r runs on device o->device + r (NCCL), or on
 * o->device for every rank when o->tp_one_device (the engine's own all-reduce). */
kvb_status kvb_tp_group_create(const kvb_model *m, const kvb_cuda_opts *o, kvb_tp_group **out, kvb_err *err);
void kvb_tp_group_free(kvb_tp_group *g); /* NULL ok; frees the ranks on their threads */
kvb_cuda_engine *kvb_tp_group_rank(kvb_tp_group *g, int r);
const char *kvb_tp_group_describe(const kvb_tp_group *g); /* the all-reduce in use */

kvb_status kvb_tp_seq_create(kvb_tp_group *g, kvb_tp_seq **out, kvb_err *err);
void kvb_tp_seq_free(kvb_tp_group *g, kvb_tp_seq *s);
kvb_cuda_seq *kvb_tp_seq_rank(kvb_tp_seq *s, int r);
/* Every rank adopts the same cached prefix (their caches were filled in lockstep). */
kvb_status kvb_tp_attach_cached(kvb_tp_group *g, kvb_tp_seq *s, const int32_t *tokens, uint32_t n,
                                uint32_t *n_cached, kvb_err *err);
/* kvb_cuda_forward on every rank at once; the logits come from rank 0. */
kvb_status kvb_tp_forward(kvb_tp_group *g, kvb_tp_seq *s, const int32_t *tokens, uint32_t n, float *logits,
                          bool all_logits, kvb_err *err);

/* engine.c, for the group: a rank's engine (rank of size; comm NULL when size is 1; o already
 * resolved by kvb_cuda_engine_create), and whether the rank's last forward failed only in its
 * layer hook (the ranks then finished in lockstep). */
kvb_status kvb_cu_engine_create_rank(const kvb_model *m, const kvb_cuda_opts *o, int rank, int size,
                                     kvb_tp_comm *comm, kvb_cuda_engine **out, kvb_err *err);
bool kvb_cu_engine_hook_failed(const kvb_cuda_engine *e);
/* Before a rank's forward: whether rank 0 computes logits in it (the other ranks get none but must
 * run the same layers, for the all-reduces). */
void kvb_cu_engine_set_group_wants_logits(kvb_cuda_engine *e, bool wants);
/* The checks a forward makes before any work (tokens, context limit, free blocks), without it. */
kvb_status kvb_cu_forward_check(kvb_cuda_engine *e, kvb_cuda_seq *s, const int32_t *tokens, uint32_t n,
                                kvb_err *err);

#endif
