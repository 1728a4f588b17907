/* engine/cuda/tp_comm.h — private to the CUDA engine (not a contract): the all-reduce of a
 * tensor-parallel engine. n ranks (1..8), each driven by its own host thread on its own device and
 * stream, sum a buffer of f32 in place; either through NCCL (libnccl.so.2, loaded with dlopen: the
 * binary runs without it) or through the engine's own all-reduce (LOCAL: host barriers between the
 * ranks' threads, CUDA events between their streams, and on each rank one kernel that reads every
 * rank's buffer in rank order — so ranks may share one device, which is how tensor parallelism is
 * tested on a one-GPU host). Plain C, no CUDA header: streams are void * (the cudaStream_t of the
 * rank's device). Every CUDA and NCCL call is checked; failures come back as kvb_status + message.
 *
 * Failure is final: once any rank's call fails (or kvb_tp_comm_abort is called), every rank's call
 * returns KVB_ERR_IO ("the communicator was aborted" / "failed at rank r: ...") without blocking.
 * After a failure, kernels already enqueued by the other ranks may still read a rank's buffer:
 * synchronise every rank's stream before freeing or reusing the buffers. */
#ifndef KVB_TP_COMM_H
#define KVB_TP_COMM_H

#include <stddef.h>

#include "kvb_core.h"

typedef enum { KVB_TP_COMM_NCCL = 1, KVB_TP_COMM_LOCAL = 2 } kvb_tp_comm_kind;
typedef struct kvb_tp_comm kvb_tp_comm;

/* Creates a communicator for n ranks (1..8) on devices[0..n-1], from one thread; leaves the calling
 * thread's current device as it found it. max_count: the most floats one all-reduce carries (>= 1).
 * NCCL: libnccl.so.2 loaded with dlopen (first the default search path, then $KVB_NCCL_LIB if set
 *   (a full path), then the pip wheel layouts: nvidia/nccl/lib in the dist-packages of
 *   /usr/local/lib/python3* and /usr/lib/python3, and in the site-packages of /usr/local/lib/
 *   python3.*, /usr/lib/python3.*, $VIRTUAL_ENV, $CONDA_PREFIX, ~/.local and each $PATH entry's
 *   ../lib (a virtual environment's bin on PATH)), then
 *   ncclCommInitAll over the devices; devices must be distinct. Before loading it sets
 *   NCCL_NVLS_ENABLE=0 in the process environment (overwriting; NVLink multicast must stay off on
 *   these hosts, for child processes too). The library stays loaded for the life of the process.
 *   A build without nccl.h refuses with KVB_ERR_UNSUPPORTED.
 * LOCAL: the engine's own all-reduce (no library): ranks may share one device; ranks on distinct
 *   devices need peer access, which is enabled here (refused with KVB_ERR_UNSUPPORTED naming the
 *   two devices when cudaDeviceCanAccessPeer says no; it stays enabled after free). Allocates per
 *   rank, on its device, a scratch of max_count floats and two events. */
kvb_status kvb_tp_comm_create(kvb_tp_comm_kind kind, int n, const int *devices, size_t max_count, kvb_tp_comm **out,
                              kvb_err *err);

/* Sums buf (count floats on the rank's device) over all ranks in place, in stream order on `stream`.
 * Every rank calls it from its own host thread (whose current device is the rank's; checked), the
 * same number of times with the same count, count <= max_count (count 0: nothing to do). The result
 * is bit-identical on every rank. LOCAL sums in rank order, ((b0 + b1) + b2) + ..., with plain f32
 * adds; n == 1 returns at once. LOCAL reuses the rank's scratch from call to call in stream order:
 * a rank that changes streams between calls must order the new stream after the old one itself.
 * Host side, LOCAL returns once every rank has enqueued its part (two barriers); NCCL once its own
 * part is enqueued. A failed or aborted communicator returns KVB_ERR_IO with a message and does not
 * block; a call that fails here (bad argument on one rank, a CUDA or NCCL error) fails the
 * communicator, so the other ranks return too instead of waiting for it. */
kvb_status kvb_tp_comm_allreduce(kvb_tp_comm *c, int rank, float *buf, size_t count, void *stream, kvb_err *err);

/* Marks the communicator failed: ranks blocked in (or later entering) kvb_tp_comm_allreduce return an
 * error at once; NCCL communicators are aborted (ncclCommAbort). Safe from any thread, more than once. */
void kvb_tp_comm_abort(kvb_tp_comm *c);
/* NULL ok. No rank may be inside kvb_tp_comm_allreduce. Frees the scratch buffers and events
 * (cudaFree waits for the work using them) or destroys the NCCL communicators. */
void kvb_tp_comm_free(kvb_tp_comm *c);

/* e.g. "NCCL 2.27.3 all-reduce, 2 ranks on devices 0,1" or "in-engine all-reduce, 2 ranks on device 0" */
const char *kvb_tp_comm_describe(const kvb_tp_comm *c);
int kvb_tp_comm_size(const kvb_tp_comm *c);

/* ---- test entry points ------------------------------------------------------------------------
 * (Here rather than in kvb_engine_cuda.h with the others.) Not for production paths: they allocate
 * and synchronise. */

/* host_out (count) f32 = kvb_cu_sum_f32 of host_in[0 .. n_in) (count f32 each, n_in 1..8), run on
 * the current device. The caller's host_out (poison) is copied to the device first, so an element
 * the kernel leaves unwritten comes back as it was. misalign: bit i (i < n_in) starts in[i] one
 * float past a 16-byte boundary, bit 8 does so for out; the others start on one. Floats around out
 * are poisoned and checked: a write outside out[0 .. count) fails with KVB_ERR_INTERNAL. */
kvb_status kvb_cuda_test_sum_f32(const float *const *host_in, int n_in, size_t count, size_t misalign,
                                 float *host_out, kvb_err *err);

#endif
