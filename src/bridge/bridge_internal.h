/* bridge/bridge_internal.h — private to the bridge's decode side: the receiving thread of one lane
 * (recv_pipe.c) and the decoder's pipelined tail (tail_pipe.c), both driven by the lanes'
 * receiver (rx_lanes.c). */
#ifndef KVB_BRIDGE_INTERNAL_H
#define KVB_BRIDGE_INTERNAL_H

#include "kvb_bridge.h"

/* The receiving thread of one lane for one request (recv_pipe.c). */
typedef struct kvb_recv_pipe kvb_recv_pipe;
kvb_status kvb_recv_pipe_start(kvb_conn *c, uint64_t request_id, int timeout_ms, kvb_recv_pipe **out, kvb_err *err);
/* The oldest unreleased message (waits for it); a receive failure is returned with its error, and
 * nothing follows it. */
kvb_status kvb_recv_pipe_next(kvb_recv_pipe *p, kvb_msg *m, kvb_err *err);
/* Done with the message next returned: its buffer may be reused. */
void kvb_recv_pipe_release(kvb_recv_pipe *p);
/* Ends the thread (shutting the connection down if it is still receiving this request's stream:
 * that stream can no longer be trusted) and frees everything. NULL is a no-op. */
void kvb_recv_pipe_stop(kvb_recv_pipe *p);
/* The first half of stop, safe from any thread while another consumes: the reader ends (shutting
 * the connection down if it is still receiving), and next returns what is buffered, then fails.
 * NULL is a no-op. */
void kvb_recv_pipe_abort(kvb_recv_pipe *p);
/* Seconds the reader waited for a free buffer (the verifying thread is the slower stage) and the
 * verifying thread waited for a frame (the link or the sender is). Call before stop. */
void kvb_recv_pipe_waits(kvb_recv_pipe *p, double *reader_s, double *consumer_s);

/* The decoder's pipelined tail (tail_pipe.c): the prompt's last token runs on a thread while the
 * bridged blocks arrive, each layer once every pending block holds it. Start it after the pending
 * blocks are begun: pend (n_pend) in position order, the tail last when has_tail (pages of
 * positions cached .. n_tok - 2; without a tail it takes a page for the last token's row itself);
 * `cached` must be what kvb_seq_attach_cached finds for toks now. The engine is the thread's until
 * finish; logits (n_vocab) is written by it. While later layers are still arriving the forward
 * runs on `threads_in_transfer` of the engine's threads (the rest of the CPUs receive and commit
 * the slabs), then on all of them. With batch->run_pending, the other requests' decode steps handed
 * in while the forward waits for a layer run at its gate run there, as batches on the same width
 * (batch->on_step tells the gate when one is handed in). */
typedef struct kvb_tail_pipe kvb_tail_pipe;
kvb_status kvb_tail_pipe_start(kvb_engine *e, const int32_t *toks, uint32_t n_tok, uint32_t cached,
                               kvb_slab_pending *const *pend, uint32_t n_pend, bool has_tail, float *logits,
                               int threads_in_transfer, const kvb_bridge_batch_hooks *batch, kvb_tail_pipe **out,
                               kvb_err *err);
/* After an accepted slab of pend[i], layer `layer`, on any thread that puts slabs. NULL: no-op. */
void kvb_tail_pipe_slab(kvb_tail_pipe *t, uint32_t i, uint32_t layer);
/* Ends it (abort: the bridge stopped short; a waiting forward gives up, as it does when any layer
 * never arrived everywhere, so finish never waits for what cannot come) and frees it; call before
 * closing the pending blocks. True when logits hold the last token's logits over exactly what
 * was committed: every block committed on the page the forward read, and the tail complete and
 * taken as tail_page (KVB_BLOCK_NONE without a tail). Then *last_page is the page holding the
 * tail's rows and the last token's row (the taken tail page, or the one it took: now the
 * caller's, WRITING). *wait_s: how long finish waited for the forward. NULL: false. */
bool kvb_tail_pipe_finish(kvb_tail_pipe *t, bool abort, kvb_block_id tail_page, kvb_block_id *last_page,
                          double *wait_s);

/* The receiver tells tp of every slab it accepts (kvb_tail_pipe_slab); NULL: nobody. Set before
 * the first put. */
void kvb_bridge_receiver_set_tail_pipe(kvb_bridge_receiver *r, kvb_tail_pipe *tp);

#endif
