/* The compact chunk index's records and shared declarations (tierstore.control._compact_index).
 *
 * The same decisions as tierstore.control.index.ChunkIndex (LRU policy, replicas of hot chunks),
 * every per-chunk record in a flat array instead of Python objects:
 *   - chunks are found by a 64-bit hash of (namespace id, boundary) in one
 *     open-addressing table (linear probing, deletion by backward shift; each slot
 *     carries 8 bits of its hash and its probe distance), a hit confirmed against the key
 *     bytes, which live in a pool per key length. A unit is found through any of its
 *     chunks: they share its boundary, so its hash (a unit has no table of its own; a
 *     boundary's chunks, one per KV cache group, lie in one probe run);
 *   - a chunk's shards (one per rank) are 12-byte records: in the chunk's record when it
 *     has one rank, else a run in the shard pool;
 *   - the prefix tree's edges, the orphans' waits and the leases are pooled records
 *     linked by 32-bit indices;
 *   - the candidate heaps per (node, tier) hold (rank, unit) pairs, checked when popped,
 *     as ChunkIndex's CandidateQueue; leased or promoting units are parked.
 *
 * Files: this header (records, the Core object, what the two files share);
 * compact_core.c (the state and the decisions: tables, heaps, leases, the tree, making
 * room); compact_index.c (the Python type: arguments in, answers and actions out).
 *
 * Threading: called with the GIL held, never releases it; the caller (one Evictor)
 * serialises every call. Allocation failure is fatal: an index left half way through
 * a change breaks invariants that span its parts, and a restarted Evictor rebuilds
 * from the NodeStores' inventories.
 */
#ifndef TIERSTORE_COMPACT_INDEX_H
#define TIERSTORE_COMPACT_INDEX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#define NIL UINT32_MAX
#define MAX_NODES (1u << 24) /* a shard's node id has 24 bits */
#define GROUP_BYTES 4
#define CPU 0
#define DISK 1
#define COMPACT_MIN 1024
#define MAX_POOLED_WORLD 256
#define MAX_WORLD ((1u << 24) - 1) /* ranks in a chunk: an offer of a larger world is refused */
#define MAX_NAMESPACES (1u << 24)

/* shard flags */
#define S_HELD 1u
#define S_CPU 2u
#define S_DISK 4u
#define S_PROMOTING 8u
#define S_UNVERIFIED 16u
/* unit flags */
#define U_ALIVE 1u
#define U_PARKED 2u
#define U_DYING 4u
#define U_ASIDE0 8u /* aside in a walk of tier 0 (CPU); tier 1 (DISK) is U_ASIDE0 << 1 */
#define U_SEEN 32u
#define U_PROT 64u /* in the running call's protected set */

enum {
    C_STORED, C_HITS, C_MISSES, C_EVICTED, C_DEMOTED, C_PROMOTED, C_DISK_HITS,
    C_REFUSED, C_SKIPPED, C_ADMIT_CALLS, C_ADMITTED_UNITS, C_REPLICATED,
    C_HITS_SAME_NODE, C_HITS_OTHER_NODE, N_COUNTS
};
enum { A_DROP, A_DEMOTE, A_PROMOTE, A_PERSIST, A_PUSH, N_ACTION_KINDS };

/* Records are packed to 4 bytes: millions of them, and x86 reads a u64 at any offset. */
#pragma pack(push, 4)
/* A free run of shards keeps the next free run's index in ``nbytes``. */
typedef struct { uint64_t nbytes; uint32_t node : 24; uint32_t flags : 8; } Shard;

/* The key's bytes live in the key pool of its length (at ``keyref``); a chunk's hash (its
 * boundary's) is recomputed from them when the table grows. A chunk of one rank holds
 * its shard (most do: TP=1); a wider one the index of its run in the shard pool. */
typedef struct {
    uint32_t ns : 24, keylen : 8;
    uint32_t world : 24, alive : 1, has_replicas : 1, : 6; /* replicas' list head: Core.rheads */
    uint32_t unit, next, lease, present, keyref;
    union { uint32_t run; Shard one; } sh;
} Chunk;

/* A replica of a whole chunk in ``node``'s CPU tier, ``landed`` ranks arrived (ready when
 * that is the chunk's world). A chunk's replicas are a list in the order they were made
 * (``cnext``); a node's are a list in LRU order, oldest first (``lprev``/``lnext``). */
typedef struct { uint32_t chunk, node, landed, cnext, lprev, lnext; } Replica;

/* A unit's namespace, boundary and hash are its first chunk's. */
typedef struct {
    uint64_t rank;
    uint32_t chunks, parents, children, waits, cpu_children;
    uint32_t cpu_copies : 24, flags : 8; /* its shards' CPU copies: at most a few per rank */
} Unit;

/* A child's parents are few (one per chain through it): a singly linked list. */
typedef struct { uint32_t parent, child, pnext, pprev, cnext; } Edge;
typedef struct { uint64_t phash; uint32_t child, onext, oprev, cnext; } Wait;
typedef struct { double expiry; uint32_t holder, next; } Lease;
typedef struct { uint64_t rank; uint32_t unit; } Entry;
#pragma pack(pop)
typedef struct { double t; uint64_t tie; uint32_t unit; } Wakeup;
typedef struct { Entry *a; size_t n, cap, compact_at; } Heap;

typedef struct {
    int registered, has_parked;
    int64_t cap[2], used[2], shards[2], parked_cap;
    Heap heap[2];
    uint32_t rhead, rtail; /* its replicas, least recently used first (NIL: none) */
} Node;

/* Slots hold record indices; beside each, 8 bits of its hash (a probe dereferences a
 * record only when those match: 1 in 256 for another key) and its distance from its home
 * slot (255: farther; then its record is read), so moving it never reads its record. */
typedef struct { uint32_t *slots; uint16_t *tags; size_t mask, count; } Table;
#define TAG(h) ((uint16_t)(((h) >> 56) << 8))
#define TAG_OF(meta) ((uint16_t)((meta) & 0xff00u))
#define DIST_OF(meta) ((size_t)((meta) & 0xffu))
typedef struct { uint8_t *a; size_t n, cap; uint32_t free; } KeyPool; /* keys of one length */
enum { T_CHUNK, T_ORPHAN };

/* Who may not be evicted in one walk: the call's protected units (flagged U_PROT), and
 * one ``extra`` unit (a demotion's own, or a store's last resort's only one). */
typedef struct { int flagged; uint32_t extra; } Prot;

/* A protected boundary, flagged when a walk first needs it (most calls make no walk). */
typedef struct { uint32_t ns; const uint8_t *b; size_t blen; uint64_t h; } PKey;

/* A parsed ShardOffer, its boundary's and parent boundary's hashes computed once (a
 * chunk's hash is its boundary's). */
typedef struct {
    uint32_t ns; const uint8_t *key; size_t len; long long rank, world; uint64_t nbytes;
    const uint8_t *parent; size_t plen; uint64_t hash, phash; int valid;
} Offer;

typedef struct {
    PyObject_HEAD
    double high, low;
    Chunk *chunks; size_t nchunks, capchunks, live_chunks; uint32_t chunk_free;
    Shard *shards; size_t nshards, capshards; uint32_t shard_free[MAX_POOLED_WORLD + 1];
    Unit *units; size_t nunits, capunits; uint32_t unit_free;
    Edge *edges; size_t nedges, capedges; uint32_t edge_free;
    Wait *waits; size_t nwaits, capwaits; uint32_t wait_free;
    Lease *leases; size_t nleases, capleases; uint32_t lease_free;
    Replica *replicas; size_t nreplicas, capreplicas; uint32_t replica_free;
    /* chunk -> its first replica, for the few chunks with one (a field in every chunk
     * record would cost 4 bytes a chunk): linear probing, keys NIL when free. */
    uint32_t *rkeys, *rheads; size_t rmask, rcount;
    Table ctab, otab;
    uint32_t mute; /* a node whose actions are discarded (forget_node's), else NIL */
    KeyPool keys[256];
    Node *nodes; size_t nnodes;
    Wakeup *wk; size_t nwk, capwk; uint64_t tie;
    uint64_t clock;
    int64_t counts[N_COUNTS];
    uint64_t *pset; size_t pcap, pmask; int pset_active; /* the call's protected unit hashes */
    uint32_t *plist; size_t nplist, capplist;    /* the units flagged U_PROT */
    PKey *pkeys; size_t npkeys, cappkeys;        /* protected boundaries not looked up yet */
    PyObject *ns_ids, *ns_list, *node_ids, *node_list, *holder_ids, *holder_list;
    /* Lease holders are per request: an id is freed once its last lease is (sweep). */
    uint32_t *holder_refs; size_t capholder_refs;
    uint32_t *holder_free; size_t nholder_free, capholder_free;
    uint32_t *zero_holders; size_t nzero, capzero; /* ids whose count reached 0 */
    PyObject *shard_id_t, *answer_t, *unit_id_t, *hit, *miss_answer, *pending_answer;
    PyObject *tier_obj[2];
    PyObject *actions; /* node str -> [drop, demote, promote, persist] during a call */
} Core;

/* Shared by compact_core.c (the decisions) and compact_index.c (the Python type), and
 * by nothing else: hidden from the module's exported symbols. */
#define INTERNAL __attribute__((visibility("hidden")))
static inline Shard *shard_at(Core *c, Chunk *ch, uint32_t r) {
    return ch->world == 1 ? &ch->sh.one : &c->shards[ch->sh.run + r];
}
/* A pointer into a chunk's record: valid until the next chunk is made. */
#define SHARD(c, ch, r) shard_at((c), (ch), (uint32_t)(r))

static inline size_t boundary_len(size_t keylen) { return keylen > GROUP_BYTES ? keylen - GROUP_BYTES : 0; }

static inline size_t key_slot(size_t len) { return len < 4 ? 4 : len; }
static inline const uint8_t *chunk_key(const Core *c, const Chunk *ch) {
    return c->keys[ch->keylen].a + (size_t)ch->keyref * key_slot(ch->keylen);
}

static inline int has_tier(const Shard *s, int tier) { return (s->flags & (tier == CPU ? S_CPU : S_DISK)) != 0; }

static inline int fits(Core *c, uint32_t node, int tier, uint64_t nbytes) {
    Node *n = &c->nodes[node];
    return n->used[tier] + (int64_t)nbytes <= n->cap[tier];
}

static inline uint32_t unit_ns(const Core *c, uint32_t u) { return c->chunks[c->units[u].chunks].ns; }

static inline void prefetch_slot(const Table *t, uint64_t h) {
    if (!t->slots) return;
    __builtin_prefetch(&t->slots[h & t->mask]);
    __builtin_prefetch(&t->tags[h & t->mask]);
}

INTERNAL uint32_t add_shard(Core *c, uint32_t ci, uint32_t node, const Offer *o, int tier, int queue,
                            uint32_t *chunk_out);
INTERNAL void gain_q(Core *c, uint32_t u, Shard *s, int tier, int queue);
INTERNAL void push(Core *c, uint32_t u, uint32_t node, int tier);
INTERNAL int demote_for_store(Core *c, uint32_t node, uint64_t nbytes, uint32_t own, const Prot *p, double now);
INTERNAL void demote_to_watermark(Core *c, uint32_t node, const Prot *p, double now);
INTERNAL void drop_unit(Core *c, uint32_t u);
INTERNAL void emit(Core *c, int kind, uint32_t node, uint32_t ci, uint32_t rank);
INTERNAL PyObject *action_list(Core *c, int kind, uint32_t node);
INTERNAL void fatal_if(int bad);
INTERNAL uint32_t find_chunk(Core *c, uint32_t ns, const uint8_t *key, size_t len, uint64_t h);
INTERNAL uint32_t find_unit(Core *c, uint32_t ns, const uint8_t *b, size_t blen, uint64_t h);
INTERNAL void gain(Core *c, uint32_t u, Shard *s, int tier);
INTERNAL void *grow(void *p, size_t *cap, size_t need, size_t size);
INTERNAL uint64_t hash_bytes(const uint8_t *p, size_t n, uint32_t ns);
/* A chunk's hash: its boundary's (what find_chunk takes). */
static inline uint64_t key_hash(const uint8_t *key, size_t len, uint32_t ns) { return hash_bytes(key, boundary_len(len), ns); }
INTERNAL int is_leased(Core *c, uint32_t ci, double now);
INTERNAL void lease(Core *c, uint32_t ci, uint32_t holder, double now, double until);
INTERNAL void lose(Core *c, uint32_t u, Shard *s, int tier);
INTERNAL int make_cpu_room(Core *c, uint32_t node, uint64_t nbytes, const Prot *p, double now);
INTERNAL int make_disk_room(Core *c, uint32_t node, uint64_t nbytes, const Prot *p, double now);
INTERNAL PyObject *make_tuple_of(PyObject *type, PyObject *items);
INTERNAL int promote(Core *c, uint32_t u, uint32_t ci, const Prot *p, double now);
INTERNAL Prot protect(Core *c, const uint64_t *hashes, size_t n);
INTERNAL int release_one(Core *c, uint32_t ci, uint32_t holder);
INTERNAL PyObject *shard_id(Core *c, uint32_t ns, const uint8_t *key, size_t len, uint32_t rank);
INTERNAL void unpark(Core *c, uint32_t u);
INTERNAL void unprotect(Core *c);
/* replicas (compact_core.c) */
INTERNAL uint32_t replica_on(Core *c, uint32_t ci, uint32_t node);
INTERNAL uint32_t replicas_of(Core *c, uint32_t ci);
INTERNAL int replica_ready(Core *c, uint32_t r);
INTERNAL int holds(Core *c, uint32_t ci, uint32_t node);
INTERNAL int start_replica(Core *c, uint32_t ci, uint32_t node);
INTERNAL void drop_replica(Core *c, uint32_t r);
INTERNAL void touch_replica(Core *c, uint32_t r);
INTERNAL void forget_replicas_on(Core *c, uint32_t node);
INTERNAL int rescue(Core *c, uint32_t u, uint32_t lost);
INTERNAL void emit_push(Core *c, uint32_t from, uint32_t ci, uint32_t rank, uint32_t to);
INTERNAL void want_protected(Core *c, uint32_t ns, const uint8_t *b, size_t blen, uint64_t h);

#endif /* TIERSTORE_COMPACT_INDEX_H */
