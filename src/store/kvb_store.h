/* store — the decoder's block store: one arena of fixed-size pages (each page holds one cache
 * block in the decoder's kvformat, block ids are page indexes), a chain-hash prefix index whose
 * root folds in the model and cache-format fingerprints, reference counts for the sequences that
 * use blocks, LRU eviction of unreferenced committed blocks, and the ONE block writer,
 * kvb_store_commit_block, through which both the decoder's native prefill and the bridge receiver
 * (slab assembly, below) publish blocks. A block is visible to lookups only after commit, so a
 * partially written or partially assembled block is never returned. A block is in one of three
 * states: FREE (on the free list), WRITING (allocated, private to the one owner that fills it; not
 * in the index) or COMMITTED (in the index, immutable, refcount >= 0; at refcount 0 it is on the
 * LRU list and may be evicted by an allocation that finds no free page). Locking: one mutex per
 * store guards all metadata (states, refcounts, index, LRU, free list, stats); every function
 * below may be called from any thread. Block BYTES are not guarded: a WRITING block is written by
 * its owner without the lock, a COMMITTED block is read without the lock by any holder of a
 * reference (commit and lookup pass through the mutex, which orders the writes before the reads).
 * Slab validation, checksumming and scattering run outside the lock on the pending block's
 * private page. */
#ifndef KVB_STORE_H
#define KVB_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvb_core.h"
#include "kvb_kvformat.h"

typedef uint32_t kvb_block_id;          /* page index in [0, n_blocks) */
#define KVB_BLOCK_NONE ((kvb_block_id)UINT32_MAX)

typedef struct kvb_store kvb_store;

/* ---- chain keys (usable without a store: the prefill node and the wire protocol need them) -- *
 * root = H(model fingerprint, format fingerprint); key(i) = H(key(i-1), token ids of block i).
 * H is XXH3-64: root = XXH3-64(16 bytes: model_fp, format_fp as little-endian u64, seed
 * KVB_CHAIN_ROOT_SEED); key(i) = XXH3-64(block_tokens token ids as little-endian i32, seed key(i-1)). */
#define KVB_CHAIN_ROOT_SEED 0x6b76622d63686169ULL /* "kvb-chai" */
uint64_t kvb_chain_root(uint64_t model_fingerprint, uint64_t format_fingerprint);
uint64_t kvb_chain_next(uint64_t parent_key, const int32_t *tokens, uint32_t n_tokens);

/* ---- lifetime --------------------------------------------------------------------------- */

/* An arena of n_blocks (>= 1) pages of kvb_kvformat_block_bytes(fmt) bytes each (64-byte aligned,
 * OS-page aligned with local layers; the memory is not cleared). With local layers, a committed
 * block that keeps none of its local rows gives the OS pages wholly inside its local part (the
 * page's tail, kvb_kvformat_local_part) back to the system (stats: local_released); they return
 * as zero pages when written again. The root chain key folds in model_fingerprint and
 * kvb_kvformat_fingerprint(fmt). KVB_ERR_RANGE if the arena would exceed 1 TiB. */
kvb_status kvb_store_create(const kvb_kvformat *fmt, uint64_t model_fingerprint, uint32_t n_blocks, kvb_store **out,
                            kvb_err *err);
/* Touches every page of the arena once, so the operating system commits the memory now: a
 * server pays its page faults at start (and learns there whether the memory exists) rather than
 * on the hot path of its first requests. Optional; a fresh store works without it. */
void kvb_store_prefault(kvb_store *s);
/* Frees the arena and everything in it. No block may be in use; outstanding pending slab blocks
 * must be closed first. NULL is a no-op. */
void kvb_store_free(kvb_store *s);

const kvb_kvformat *kvb_store_kvformat(const kvb_store *s);
uint32_t kvb_store_n_blocks(const kvb_store *s);
size_t kvb_store_block_bytes(const kvb_store *s);
uint64_t kvb_store_root_key(const kvb_store *s);

/* keys_out (n_tokens / block_tokens): the chain key of every FULL block of tokens; a trailing
 * partial block has no key. Returns the number of keys written. */
uint32_t kvb_store_chain_keys(const kvb_store *s, const int32_t *tokens, uint32_t n_tokens, uint64_t *keys_out);

/* The bytes of block `id`: (layer, k_or_v, kv_head, token, head_dim), each (token, head_dim) row in
 * the cache dtype (see kvb_kvformat_row_offset). Write only while you own it WRITING; read only
 * while you hold a reference to it COMMITTED. No lock is taken. */
uint8_t *kvb_store_block_data(kvb_store *s, kvb_block_id id);

/* ---- allocation, commit, lookup, references ------------------------------------------- */

/* Takes n pages for writing, all or nothing: ids_out (n) become WRITING blocks owned by the caller.
 * Free pages are used first; then unreferenced committed blocks are evicted, least recently used
 * first (the evicted block leaves the index and its page is handed out). Referenced and WRITING
 * blocks are never evicted. When fewer than n pages can be had, nothing changes and the call fails
 * at once with KVB_ERR_RANGE (it never blocks). */
kvb_status kvb_store_alloc(kvb_store *s, uint32_t n, kvb_block_id *ids_out, kvb_err *err);

/* THE block writer. Publishes a WRITING block `id` that the caller allocated and filled with every
 * layer of every token, as the block whose chain key is `key`, whose parent key is `parent_key`
 * (kvb_store_root_key for the first block) and whose token ids are tokens (block_tokens); the key
 * must equal kvb_chain_next(parent_key, tokens), else KVB_ERR_INVALID and nothing changes.
 * On success the caller's ownership becomes one reference to *committed_out (release it later):
 * - new key: the block joins the index, *committed_out = id;
 * - DEDUP: a block with this key is already committed (someone committed the same content first):
 *   the caller's page `id` is freed, the existing block is referenced and *committed_out is ITS id;
 *   the caller must use *committed_out from now on (the first committed bytes win).
 * If a committed block has this key but other tokens or another parent key (a 64-bit hash
 * collision), the commit is refused with KVB_ERR_INVALID and the caller still owns `id`.
 * Blocks whose parent is not (or no longer) committed are accepted but unreachable by lookup until
 * the parent is committed. */
kvb_status kvb_store_commit_block(kvb_store *s, kvb_block_id id, uint64_t key, uint64_t parent_key,
                                  const int32_t *tokens, kvb_block_id *committed_out, kvb_err *err);

/* The longest committed chain for tokens (n_tokens; only full blocks count): walks keys from the
 * root and stops at the first block that is not committed (or whose stored parent key or tokens do
 * not match). With local layers the chain is then shortened to the longest c blocks whose window
 * (positions max(0, c*bt - window + 1) .. c*bt - 1, what the adopter's next query reads) kept its
 * local rows (see kvb_store_slab_keep_local_from); a format without them is never shortened. ids_out (n_tokens / block_tokens) receives the block ids in chain order, each with a
 * new reference held by the caller; *n_blocks_out how many. A caller that must compute the last
 * prompt token itself passes n_tokens - 1. Never fails for a miss (0 blocks). */
kvb_status kvb_store_lookup(kvb_store *s, const int32_t *tokens, uint32_t n_tokens, kvb_block_id *ids_out,
                            uint32_t *n_blocks_out, kvb_err *err);

/* Adds one reference to each COMMITTED block in ids (n) (e.g. a forked sequence). All or nothing:
 * KVB_ERR_INVALID if any id is out of range or not committed. */
kvb_status kvb_store_retain(kvb_store *s, const kvb_block_id *ids, uint32_t n, kvb_err *err);

/* Drops the caller's hold on each block in ids (n): a reference to a COMMITTED block (at refcount
 * 0 it joins the LRU list as most recently used), or the ownership of a WRITING block (discarded:
 * its page is freed). Pass a sequence's blocks in chain order: they are released last to first,
 * so a chain's first blocks stay in the cache longer than its extensions. Ids that are out of
 * range, free, or committed with refcount 0 are skipped and reported with KVB_ERR_INVALID (the
 * others are still released). Pending slab blocks are given up with kvb_store_slab_close, not
 * here. */
kvb_status kvb_store_release(kvb_store *s, const kvb_block_id *ids, uint32_t n, kvb_err *err);
/* Sliding-window layers: a finished sequence's committed blocks ids[0 .. n) that lie wholly before
 * its last window stop keeping their local-layer rows (as a bridged block cut by the window does:
 * their memory goes back to the system), unless someone else holds them (refs > 1: a live sequence
 * may be reading them). A continuation of the sequence adopts its whole chain (its window is
 * kept); a prompt that diverges earlier gets a chain shortened by the lookup rule and recomputes
 * the rest (a dedup fills the rows back in). Call before releasing the blocks. A no-op without
 * local layers. Returns how many blocks gave up their local rows. */
uint32_t kvb_store_drop_local_rows(kvb_store *s, const kvb_block_id *ids, uint32_t n);

/* ---- slab assembly (the bridge receiver) -------------------------------------------------
 * A slab is (token range inside one block, layer, K and V bytes for those tokens of that layer,
 * checksum). Slab K and V bytes are each (n_tokens, n_head_kv, row_bytes) for that layer, token
 * major, as the cache-producing arithmetic emits them; the assembler scatters them into the block
 * layout (layer, kv, kv_head, token, head_dim). Slabs are hostile input: every field is checked and
 * the checksum verified BEFORE a byte is copied; a rejected slab writes nothing and leaves the
 * pending block as it was (a valid retransmission may follow). When every (layer, token) of the
 * block has arrived, the block is committed through kvb_store_commit_block.
 * Threads: each pending block has its own mutex (taken before the store's lock, never after it).
 * - kvb_store_slab_put may run on several threads at once on the same pending block (a request's
 *   slabs striped over several connections): one put's checks and its claim on the slab's
 *   (layer, token) cells are atomic, so a duplicate or overlapping slab that races with another is
 *   rejected exactly as it would be after it; checksum and scatter run outside the lock (slabs of
 *   distinct cells write distinct bytes); exactly one put, the one that completes the block,
 *   commits it. Puts on distinct pending blocks are independent.
 * - kvb_store_slab_missing, _layer_missing, _committed and _block may be called from any thread at
 *   any time before close. A cell counts as missing until its bytes are in the page: once a reader
 *   sees a layer with nothing missing (or the block committed), the bytes of those puts are visible
 *   to it (the pending's mutex orders them).
 * - begin, begin_tail, keep_local_from (before any put), take_tail and close belong to the owner;
 *   take_tail and close are called after every put has returned (join the receiving threads
 *   first): close frees the handle. */
typedef struct kvb_slab_pending kvb_slab_pending;

/* The slab checksum: XXH3-64 (seed 0) over the bytes K || V. */
uint64_t kvb_slab_checksum(const void *k, size_t k_bytes, const void *v, size_t v_bytes);

/* Starts assembling the block (key, parent_key, tokens (block_tokens)): checks that key ==
 * kvb_chain_next(parent_key, tokens) (else KVB_ERR_INVALID), then takes a page with
 * kvb_store_alloc (so it may evict, and fails with KVB_ERR_RANGE when the store is full). The
 * block stays invisible until complete. */
kvb_status kvb_store_slab_begin(kvb_store *s, uint64_t key, uint64_t parent_key, const int32_t *tokens,
                                kvb_slab_pending **out, kvb_err *err);

/* Accepts one slab for tokens [token0, token0 + n_tokens) of `layer`. Rejected (KVB_ERR_FORMAT,
 * nothing written, counted in slabs_rejected) when: layer >= n_layer; n_tokens == 0 or the range
 * leaves the block; k_bytes or v_bytes != n_tokens * n_head_kv * row_bytes (v_bytes 0 and v unused for a
 * latent (mla) format, which has no V part); k or v is NULL; any
 * (layer, token) of the range has already arrived or is being put by another thread right now
 * (duplicate or overlap; the message says "duplicate"); the checksum of K || V differs (the range
 * is free again for a retransmission); any slab once the block is complete (a duplicate).
 * KVB_ERR_INVALID (also counted) after a refused commit (the pending block has failed) or once
 * the tail was taken.
 * When this slab completes the block, it is committed (with dedup, as kvb_store_commit_block) and
 * *committed_out (may be NULL only if the caller never wants the block: then the reference is
 * dropped at once) receives the committed id with one reference held by the caller; otherwise
 * *committed_out = KVB_BLOCK_NONE. If that commit is refused, the error is returned and the
 * pending block is failed (close it). */
kvb_status kvb_store_slab_put(kvb_slab_pending *p, uint32_t layer, uint32_t token0, uint32_t n_tokens,
                              const void *k, size_t k_bytes, const void *v, size_t v_bytes, uint64_t checksum,
                              kvb_block_id *committed_out, kvb_err *err);

/* The prompt's TAIL: the tokens after its last full block, up to (never including) the last
 * prompt token. Assembled like a block (same checks, same scatter) but into a private page that
 * is never committed here and has no key: tokens [0, n_tokens) of it, 1 <= n_tokens <
 * block_tokens. Once complete (kvb_store_slab_missing == 0) the caller takes the page
 * (kvb_store_slab_take_tail) and hands it to a sequence, which finishes the block with its own
 * tokens and commits it through the one block writer when full. Partial blocks stay invisible. */
kvb_status kvb_store_slab_begin_tail(kvb_store *s, uint32_t n_tokens, kvb_slab_pending **out, kvb_err *err);
/* A complete tail's page, WRITING and now owned by the caller (released with kvb_store_release
 * like any writing page); KVB_BLOCK_NONE when the tail is not complete or was taken. */
kvb_block_id kvb_store_slab_take_tail(kvb_slab_pending *p);

/* Sliding-window layers (a format with kvb_kvformat.window): the decoder keeps this block's
 * local-layer rows only for tokens [token0, block_tokens) (kvb_kvformat_local_keep_from tells
 * which positions; token0 = keep_from - the block's first position, clamped to 0..block_tokens).
 * Those local cells of earlier tokens are not expected: the block completes without them, and a
 * slab carrying one is rejected (KVB_ERR_FORMAT, nothing written). The committed block records
 * token0, and kvb_store_lookup hands the block out only to adopters whose window never reads the
 * rows it lacks. Call before the first slab; KVB_ERR_INVALID on a tail (a tail is always whole), a
 * format without local layers with token0 > 0, token0 > block_tokens, or after a slab. */
kvb_status kvb_store_slab_keep_local_from(kvb_slab_pending *p, uint32_t token0, kvb_err *err);

/* (layer, token) cells still missing: 0 once complete. */
uint32_t kvb_store_slab_missing(const kvb_slab_pending *p);
/* Tokens of `layer` still missing (0 once that layer has arrived, and for local-layer rows the
 * block does not keep): lets a reader wait for one layer of a block (the decoder's pipelined tail
 * reads a layer as soon as every block has it). Any thread, while puts run: a token counts as
 * missing until its put has scattered it, so on 0 that layer's bytes are visible to the caller. */
uint32_t kvb_store_slab_layer_missing(const kvb_slab_pending *p, uint32_t layer);
/* True once the block was committed by kvb_store_slab_put. */
bool kvb_store_slab_committed(const kvb_slab_pending *p);
/* The page being assembled (its bytes are private until commit; diagnostics and tests); once
 * committed, the committed block's id. */
kvb_block_id kvb_store_slab_block(const kvb_slab_pending *p);

/* Ends assembly and frees the handle. If the block was not committed (cancel, timeout, dropped
 * peer, corrupt stream) its page goes back to the free list and nothing becomes visible; if it was
 * committed, the caller keeps the reference put returned. NULL is a no-op. */
void kvb_store_slab_close(kvb_slab_pending *p);

/* ---- stats and checks ---------------------------------------------------------------------- */

typedef struct {
    uint32_t n_blocks;
    uint32_t free;        /* on the free list */
    uint32_t writing;     /* allocated, not committed (engine writers and pending slab blocks) */
    uint32_t committed;   /* in the index = referenced + evictable */
    uint32_t referenced;  /* committed with refcount > 0 */
    uint32_t evictable;   /* committed with refcount 0 (on the LRU list) */
    uint32_t pending_slab_blocks; /* slab assemblies open */
    uint64_t commits;     /* successful kvb_store_commit_block calls that added a block */
    uint64_t dedups;      /* commits that found the key already committed */
    uint64_t commit_refusals; /* commits refused (bad key, collision, bad id) */
    uint64_t evictions;
    uint64_t alloc_failures;  /* allocations refused because the store was full */
    uint64_t lookups;
    uint64_t lookup_hit_blocks; /* blocks returned by lookups */
    uint64_t slabs_accepted;
    uint64_t slabs_rejected;    /* malformed or corrupt slabs */
    uint64_t local_completions; /* dedups that filled in local-layer rows the committed block had not kept */
    uint64_t local_drops;       /* committed blocks that gave up their local rows when a sequence ended */
    uint64_t lookup_window_cuts;/* lookups shortened because a block in the window had not kept its local rows */
    uint32_t local_released;    /* pages whose local-layer part is given back to the system (a committed block
                                   that keeps none of its local rows; memory returns when the page is reused) */
    uint64_t local_released_bytes; /* the memory those parts no longer hold */
} kvb_store_stats;

void kvb_store_get_stats(kvb_store *s, kvb_store_stats *out);

/* Verifies every internal invariant (states, counts, free list, LRU list, index chains, keys)
 * under the lock; KVB_ERR_INTERNAL with the first broken one. For tests and debug builds. */
kvb_status kvb_store_check(kvb_store *s, kvb_err *err);

#endif
