/* The chunk index's state and decisions in flat arrays: tierstore.control._compact_index.
 *
 * The same algorithm as tierstore.control.index.ChunkIndex (LRU policy, no replicas),
 * with every per-chunk record in a flat array instead of Python objects:
 *   - chunks and units are found by 64-bit hashes of (namespace id, key) and
 *     (namespace id, boundary) in open-addressing tables (linear probing, deletion by
 *     backward shift); a hit is confirmed against the key bytes stored in the chunk;
 *   - a chunk's shards (one per rank) are a run of 16-byte records;
 *   - the prefix tree's edges, the orphans' waits and the leases are pooled records
 *     linked by 32-bit indices;
 *   - the candidate heaps per (node, tier) hold (rank, unit) pairs, checked when popped,
 *     exactly as ChunkIndex's CandidateQueue; leased or promoting units are parked.
 *
 * Threading: called with the GIL held, never releases it; the caller (one Evictor)
 * serialises every call. Allocation failure is fatal: an index left half way through
 * a change breaks invariants that span its parts, and a restarted Evictor rebuilds
 * from the NodeStores' inventories.
 */
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
    C_REFUSED, C_SKIPPED, N_COUNTS
};
enum { A_DROP, A_DEMOTE, A_PROMOTE, A_PERSIST, N_ACTION_KINDS };

/* Records are packed to 4 bytes: millions of them, and x86 reads a u64 at any offset. */
#pragma pack(push, 4)
/* A free run of shards keeps the next free run's index in ``nbytes``. */
typedef struct { uint64_t nbytes; uint32_t node : 24; uint32_t flags : 8; } Shard;

/* The key's bytes live in the key pool of its length (at ``keyref``); a chunk's hash is
 * recomputed from them when its table grows. */
typedef struct {
    uint32_t ns, unit, shards, next, lease, world, present, keyref;
    uint8_t keylen, alive;
} Chunk;

/* A unit's namespace, boundary and hash are its first chunk's. */
typedef struct {
    uint64_t rank;
    uint32_t chunks, parents, children, waits, cpu_copies, cpu_children, flags;
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
} Node;

/* Slots hold record indices; beside each, 8 bits of its hash (a probe dereferences a
 * record only when those match: 1 in 256 for another key) and its distance from its home
 * slot (255: farther; then its record is read), so moving it never reads its record. */
typedef struct { uint32_t *slots; uint16_t *tags; size_t mask, count; } Table;
#define TAG(h) ((uint16_t)(((h) >> 56) << 8))
#define TAG_OF(meta) ((uint16_t)((meta) & 0xff00u))
#define DIST_OF(meta) ((size_t)((meta) & 0xffu))
typedef struct { uint8_t *a; size_t n, cap; uint32_t free; } KeyPool; /* keys of one length */
enum { T_CHUNK, T_UNIT, T_ORPHAN };

/* Who may not be evicted in one walk: the call's protected units (flagged U_PROT), and
 * one ``extra`` unit (a demotion's own, or a store's last resort's only one). */
typedef struct { int flagged; uint32_t extra; } Prot;

/* A protected boundary, flagged when a walk first needs it (most calls make no walk). */
typedef struct { uint32_t ns; const uint8_t *b; size_t blen; uint64_t h; } PKey;

/* A parsed ShardOffer, its key's, boundary's and parent boundary's hashes computed once. */
typedef struct {
    uint32_t ns; const uint8_t *key; size_t len; long long rank, world; uint64_t nbytes;
    const uint8_t *parent; size_t plen; uint64_t hash, uhash, phash; int valid;
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
    Table ctab, utab, otab;
    KeyPool keys[256];
    Node *nodes; size_t nnodes;
    Wakeup *wk; size_t nwk, capwk; uint64_t tie;
    uint64_t clock;
    int64_t counts[N_COUNTS];
    uint64_t *pset; size_t pcap, pmask; int pset_active; /* the call's protected unit hashes */
    uint32_t *plist; size_t nplist, capplist;    /* the units flagged U_PROT */
    PKey *pkeys; size_t npkeys, cappkeys;        /* protected boundaries not looked up yet */
    PyObject *ns_ids, *ns_list, *node_ids, *node_list, *holder_ids, *holder_list;
    PyObject *shard_id_t, *answer_t, *unit_id_t, *hit, *miss_answer, *pending_answer;
    PyObject *tier_obj[2];
    PyObject *actions; /* node str -> [drop, demote, promote, persist] during a call */
} Core;

/* ---- memory ---------------------------------------------------------------------- */
static void *grow(void *p, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return p;
    size_t n = *cap ? *cap : 16;
    while (n < need) n += n / 2 + 16;
    void *q = PyMem_RawRealloc(p, n * size);
    if (!q) Py_FatalError("tierstore compact index: out of memory");
    *cap = n;
    return q;
}
/* A record from a pool: its free list first (linked through the 32-bit field at
 * ``next_off``), else a new one at the end. */
static uint32_t pool_new(void **arr, size_t *n, size_t *cap, uint32_t *free_head, size_t size, size_t next_off) {
    if (*free_head != NIL) {
        uint32_t i = *free_head;
        memcpy(free_head, (char *)*arr + i * size + next_off, sizeof(uint32_t));
        return i;
    }
    *arr = grow(*arr, cap, *n + 1, size);
    return (uint32_t)(*n)++;
}
#define POOL_NEW(c, arr, n, cap, freehead, T, nextfield) \
    pool_new((void **)&(c)->arr, &(c)->n, &(c)->cap, &(freehead), sizeof(T), offsetof(T, nextfield))

static void fatal_if(int bad) { if (bad) Py_FatalError("tierstore compact index: Python error"); }

/* ---- hashing ---------------------------------------------------------------------- */
static uint64_t mix64(uint64_t x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL; x ^= x >> 27; x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}
static uint64_t hash_bytes(const uint8_t *p, size_t n, uint32_t ns) {
    uint64_t h = mix64(((uint64_t)ns << 32) ^ n ^ 0x9e3779b97f4a7c15ULL);
    while (n >= 8) { uint64_t w; memcpy(&w, p, 8); h = mix64(h ^ w) + 0x9e3779b97f4a7c15ULL; p += 8; n -= 8; }
    if (n) { uint64_t w = 0; memcpy(&w, p, n); h = mix64(h ^ w ^ ((uint64_t)n << 56)); }
    h = mix64(h);
    return h ? h : 1; /* 0 means "none" in a Prot */
}
static size_t boundary_len(size_t keylen) { return keylen > GROUP_BYTES ? keylen - GROUP_BYTES : 0; }

static size_t key_slot(size_t len) { return len < 4 ? 4 : len; } /* a free slot links the next */
static const uint8_t *chunk_key(const Core *c, const Chunk *ch) {
    return c->keys[ch->keylen].a + (size_t)ch->keyref * key_slot(ch->keylen);
}
static uint32_t key_store(Core *c, const uint8_t *key, size_t len) {
    KeyPool *p = &c->keys[len];
    size_t size = key_slot(len);
    uint32_t i;
    if (p->free != NIL) { i = p->free; memcpy(&p->free, p->a + (size_t)i * size, 4); }
    else { p->a = grow(p->a, &p->cap, p->n + 1, size); i = (uint32_t)p->n++; }
    memcpy(p->a + (size_t)i * size, key, len);
    return i;
}
static void key_free(Core *c, size_t len, uint32_t i) {
    KeyPool *p = &c->keys[len];
    memcpy(p->a + (size_t)i * key_slot(len), &p->free, 4);
    p->free = i;
}
static uint64_t chunk_hash(const Core *c, uint32_t ci) {
    const Chunk *ch = &c->chunks[ci];
    return hash_bytes(chunk_key(c, ch), ch->keylen, ch->ns);
}
static uint32_t unit_ns(const Core *c, uint32_t u) { return c->chunks[c->units[u].chunks].ns; }
static uint64_t unit_hash(const Core *c, uint32_t u) {
    const Chunk *ch = &c->chunks[c->units[u].chunks];
    return hash_bytes(chunk_key(c, ch), boundary_len(ch->keylen), ch->ns);
}

/* ---- open addressing -------------------------------------------------------------- */
static uint64_t tab_hash(Core *c, int kind, uint32_t i) {
    return kind == T_CHUNK ? chunk_hash(c, i) : kind == T_UNIT ? unit_hash(c, i) : c->waits[i].phash;
}
static uint16_t meta(uint64_t h, size_t dist) { return TAG(h) | (uint16_t)(dist < 255 ? dist : 255); }
static void tab_put(Table *t, uint64_t h, uint32_t idx) {
    size_t i = h & t->mask;
    while (t->slots[i] != NIL) i = (i + 1) & t->mask;
    t->slots[i] = idx;
    t->tags[i] = meta(h, (i - h) & t->mask);
}
static void tab_insert(Core *c, Table *t, int kind, uint64_t h, uint32_t idx) {
    if (!t->slots || (t->count + 1) * 10 > (t->mask + 1) * 7) {
        size_t old = t->slots ? t->mask + 1 : 0, size = old ? old * 2 : 1024;
        uint32_t *prev = t->slots;
        t->slots = PyMem_RawMalloc(size * sizeof(uint32_t));
        PyMem_RawFree(t->tags);
        t->tags = PyMem_RawMalloc(size * sizeof(uint16_t));
        if (!t->slots || !t->tags) Py_FatalError("tierstore compact index: out of memory");
        memset(t->slots, 0xff, size * sizeof(uint32_t));
        t->mask = size - 1;
        for (size_t i = 0; i < old; i++)
            if (prev[i] != NIL) tab_put(t, tab_hash(c, kind, prev[i]), prev[i]);
        PyMem_RawFree(prev);
    }
    tab_put(t, h, idx);
    t->count++;
}
static size_t tab_slot_of(Table *t, uint64_t h, uint32_t idx) {
    size_t i = h & t->mask;
    while (t->slots[i] != idx) i = (i + 1) & t->mask;
    return i;
}
static void tab_remove(Core *c, Table *t, int kind, uint64_t h, uint32_t idx) {
    size_t i = tab_slot_of(t, h, idx), j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        if (t->slots[j] == NIL) break;
        uint64_t h2 = 0;
        size_t d = DIST_OF(t->tags[j]);
        if (d == 255) { h2 = tab_hash(c, kind, t->slots[j]); d = (j - h2) & t->mask; }
        size_t k = (j - d) & t->mask;
        /* move the entry at j back to i unless its home k lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            size_t nd = (i - k) & t->mask;
            t->slots[i] = t->slots[j];
            t->tags[i] = TAG_OF(t->tags[j]) | (uint16_t)(nd < 255 ? nd : 255);
            i = j;
        }
    }
    t->slots[i] = NIL;
    t->count--;
}

static void prefetch_slot(const Table *t, uint64_t h) {
    if (!t->slots) return;
    __builtin_prefetch(&t->slots[h & t->mask]);
    __builtin_prefetch(&t->tags[h & t->mask]);
}
static uint32_t find_chunk(Core *c, uint32_t ns, const uint8_t *key, size_t len, uint64_t h) {
    if (!c->ctab.slots) return NIL;
    uint16_t tag = TAG(h);
    for (size_t i = h & c->ctab.mask; c->ctab.slots[i] != NIL; i = (i + 1) & c->ctab.mask) {
        if (TAG_OF(c->ctab.tags[i]) != tag) continue;
        Chunk *ch = &c->chunks[c->ctab.slots[i]];
        if (ch->ns == ns && ch->keylen == len && !memcmp(chunk_key(c, ch), key, len))
            return c->ctab.slots[i];
    }
    return NIL;
}
static uint32_t find_unit(Core *c, uint32_t ns, const uint8_t *b, size_t blen, uint64_t h) {
    if (!c->utab.slots) return NIL;
    uint16_t tag = TAG(h);
    for (size_t i = h & c->utab.mask; c->utab.slots[i] != NIL; i = (i + 1) & c->utab.mask) {
        if (TAG_OF(c->utab.tags[i]) != tag) continue;
        Chunk *ch = &c->chunks[c->units[c->utab.slots[i]].chunks];
        if (ch->ns == ns && boundary_len(ch->keylen) == blen && !memcmp(chunk_key(c, ch), b, blen))
            return c->utab.slots[i];
    }
    return NIL;
}
static uint32_t find_orphans(Core *c, uint64_t ph) {
    if (!c->otab.slots) return NIL;
    for (size_t i = ph & c->otab.mask; c->otab.slots[i] != NIL; i = (i + 1) & c->otab.mask)
        if (TAG_OF(c->otab.tags[i]) == TAG(ph) && c->waits[c->otab.slots[i]].phash == ph) return c->otab.slots[i];
    return NIL;
}

/* ---- heaps ------------------------------------------------------------------------ */
static int entry_lt(Entry a, Entry b) { return a.rank < b.rank || (a.rank == b.rank && a.unit < b.unit); }
/* 4-ary: half the depth of a binary heap, a node's children in one or two cache lines. */
#define ARITY 4
static void heap_push(Heap *hp, Entry e) {
    hp->a = grow(hp->a, &hp->cap, hp->n + 1, sizeof(Entry));
    size_t i = hp->n++;
    while (i) { size_t p = (i - 1) / ARITY; if (!entry_lt(e, hp->a[p])) break; hp->a[i] = hp->a[p]; i = p; }
    hp->a[i] = e;
}
static void heap_sift_down(Heap *hp, size_t i) {
    Entry e = hp->a[i];
    for (;;) {
        size_t first = ARITY * i + 1, m = i;
        Entry best = e;
        for (size_t k = first; k < first + ARITY && k < hp->n; k++)
            if (entry_lt(hp->a[k], best)) { m = k; best = hp->a[k]; }
        if (m == i) break;
        hp->a[i] = hp->a[m]; i = m;
    }
    hp->a[i] = e;
}
static Entry heap_pop(Heap *hp) {
    Entry top = hp->a[0];
    hp->a[0] = hp->a[--hp->n];
    if (hp->n) heap_sift_down(hp, 0);
    return top;
}
static int wk_lt(Wakeup a, Wakeup b) { return a.t < b.t || (a.t == b.t && a.tie < b.tie); }
static void wk_push(Core *c, double t, uint32_t unit) {
    Wakeup e = {t, c->tie++, unit};
    c->wk = grow(c->wk, &c->capwk, c->nwk + 1, sizeof(Wakeup));
    size_t i = c->nwk++;
    while (i) { size_t p = (i - 1) / 2; if (!wk_lt(e, c->wk[p])) break; c->wk[i] = c->wk[p]; i = p; }
    c->wk[i] = e;
}
static Wakeup wk_pop(Core *c) {
    Wakeup top = c->wk[0], e = c->wk[--c->nwk];
    size_t i = 0, n = c->nwk;
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        Wakeup best = e;
        if (l < n && wk_lt(c->wk[l], best)) { m = l; best = c->wk[l]; }
        if (l + 1 < n && wk_lt(c->wk[l + 1], best)) m = l + 1;
        if (m == i) break;
        c->wk[i] = c->wk[m]; i = m;
    }
    if (n) c->wk[i] = e;
    return top;
}

/* ---- iteration helpers ------------------------------------------------------------ */
#define SHARD(c, ch, r) (&(c)->shards[(ch)->shards + (r)])
static int has_tier(const Shard *s, int tier) { return (s->flags & (tier == CPU ? S_CPU : S_DISK)) != 0; }

static void account(Core *c, uint32_t node, int tier, uint64_t nbytes, int sign) {
    if (node < c->nnodes && c->nodes[node].registered) {
        c->nodes[node].used[tier] += sign * (int64_t)nbytes;
        c->nodes[node].shards[tier] += sign;
    }
}
static int fits(Core *c, uint32_t node, int tier, uint64_t nbytes) {
    Node *n = &c->nodes[node];
    return n->used[tier] + (int64_t)nbytes <= n->cap[tier];
}

/* ---- candidates ------------------------------------------------------------------- */
static int evictable_from(Core *c, uint32_t u, uint32_t node, int tier) {
    Unit *un = &c->units[u];
    if (tier == CPU ? un->cpu_children != 0 : (un->children != NIL || un->cpu_copies)) return 0;
    for (uint32_t ci = un->chunks; ci != NIL; ci = c->chunks[ci].next) {
        Chunk *ch = &c->chunks[ci];
        for (uint32_t r = 0; r < ch->world; r++) {
            Shard *s = SHARD(c, ch, r);
            if ((s->flags & S_HELD) && s->node == node && has_tier(s, tier)) return 1;
        }
    }
    return 0;
}
static void compact(Core *c, Heap *hp, uint32_t node, int tier) {
    size_t kept = 0;
    for (size_t i = 0; i < hp->n; i++) {
        uint32_t u = hp->a[i].unit;
        Unit *un = &c->units[u];
        if (!(un->flags & U_ALIVE) || (un->flags & (U_PARKED | U_SEEN))) continue;
        if (!evictable_from(c, u, node, tier)) continue;
        un->flags |= U_SEEN;
        hp->a[kept++] = (Entry){un->rank, u};
    }
    hp->n = kept;
    for (size_t i = 0; i < kept; i++) c->units[hp->a[i].unit].flags &= ~U_SEEN;
    for (size_t i = kept / ARITY + 1; i-- > 0;) if (i < kept) heap_sift_down(hp, i);
    hp->compact_at = 2 * kept > COMPACT_MIN ? 2 * kept : COMPACT_MIN;
}
static void push(Core *c, uint32_t u, uint32_t node, int tier) {
    Unit *un = &c->units[u];
    if (!(un->flags & U_ALIVE) || (un->flags & U_DYING) || node >= c->nnodes) return;
    Heap *hp = &c->nodes[node].heap[tier];
    if (!hp->compact_at) hp->compact_at = COMPACT_MIN;
    heap_push(hp, (Entry){un->rank, u});
    if (hp->n > hp->compact_at) compact(c, hp, node, tier);
}
static void queue_tier(Core *c, uint32_t u, int tier) {
    if (c->units[u].flags & U_DYING) return;
    uint32_t last = NIL;
    for (uint32_t ci = c->units[u].chunks; ci != NIL; ci = c->chunks[ci].next) {
        Chunk *ch = &c->chunks[ci];
        for (uint32_t r = 0; r < ch->world; r++) {
            Shard *s = SHARD(c, ch, r);
            if ((s->flags & S_HELD) && has_tier(s, tier) && s->node != last) {
                push(c, u, s->node, tier);
                last = s->node;
            }
        }
    }
}
static void queue_everywhere(Core *c, uint32_t u) {
    if (!(c->units[u].flags & U_ALIVE)) return;
    queue_tier(c, u, CPU);
    queue_tier(c, u, DISK);
}

/* ---- leases and parking ----------------------------------------------------------- */
static double lease_max(Core *c, uint32_t li) {
    double m = -1e308;
    for (; li != NIL; li = c->leases[li].next) if (c->leases[li].expiry > m) m = c->leases[li].expiry;
    return m;
}
static void unpark(Core *c, uint32_t u) {
    if (c->units[u].flags & U_PARKED) {
        c->units[u].flags &= ~U_PARKED;
        queue_everywhere(c, u);
    }
}
static void lease(Core *c, uint32_t ci, uint32_t holder, double until) {
    for (uint32_t li = c->chunks[ci].lease; li != NIL; li = c->leases[li].next) {
        if (c->leases[li].holder != holder) continue;
        double before = c->leases[li].expiry;
        c->leases[li].expiry = until;
        uint32_t u = c->chunks[ci].unit;
        if (until < before && (c->units[u].flags & U_PARKED))
            wk_push(c, lease_max(c, c->chunks[ci].lease), u);
        return;
    }
    uint32_t li = POOL_NEW(c, leases, nleases, capleases, c->lease_free, Lease, next);
    c->leases[li] = (Lease){until, holder, c->chunks[ci].lease};
    c->chunks[ci].lease = li;
}
static void free_leases(Core *c, uint32_t ci) {
    uint32_t li = c->chunks[ci].lease;
    while (li != NIL) { uint32_t nx = c->leases[li].next; c->leases[li].next = c->lease_free; c->lease_free = li; li = nx; }
    c->chunks[ci].lease = NIL;
}
/* Drop ``holder``'s lease on chunk ``ci``; 1 if it had one. */
static int release_one(Core *c, uint32_t ci, uint32_t holder) {
    uint32_t *link = &c->chunks[ci].lease;
    for (uint32_t li = *link; li != NIL; link = &c->leases[li].next, li = *link) {
        if (c->leases[li].holder != holder) continue;
        *link = c->leases[li].next;
        c->leases[li].next = c->lease_free; c->lease_free = li;
        uint32_t u = c->chunks[ci].unit;
        if (c->chunks[ci].lease == NIL) unpark(c, u);
        else if (c->units[u].flags & U_PARKED) wk_push(c, lease_max(c, c->chunks[ci].lease), u);
        return 1;
    }
    return 0;
}
static int is_leased(Core *c, uint32_t ci, double now) {
    uint32_t *link = &c->chunks[ci].lease;
    while (*link != NIL) {
        uint32_t li = *link;
        if (c->leases[li].expiry <= now) { *link = c->leases[li].next; c->leases[li].next = c->lease_free; c->lease_free = li; }
        else link = &c->leases[li].next;
    }
    return c->chunks[ci].lease != NIL;
}
static int pinned(Core *c, uint32_t u, double now) {
    for (uint32_t ci = c->units[u].chunks; ci != NIL; ci = c->chunks[ci].next) {
        Chunk *ch = &c->chunks[ci];
        if (is_leased(c, ci, now)) return 1;
        for (uint32_t r = 0; r < ch->world; r++)
            if ((SHARD(c, ch, r)->flags & (S_HELD | S_PROMOTING)) == (S_HELD | S_PROMOTING)) return 1;
    }
    return 0;
}
static void park(Core *c, uint32_t u) {
    c->units[u].flags |= U_PARKED;
    int any = 0; double end = -1e308;
    for (uint32_t ci = c->units[u].chunks; ci != NIL; ci = c->chunks[ci].next)
        if (c->chunks[ci].lease != NIL) { double m = lease_max(c, c->chunks[ci].lease); if (!any || m > end) end = m; any = 1; }
    if (any) wk_push(c, end, u);
}
static void wake(Core *c, double now) {
    while (c->nwk && c->wk[0].t <= now) {
        Wakeup w = wk_pop(c);
        unpark(c, w.unit);
    }
}

/* ---- actions ---------------------------------------------------------------------- */
static PyObject *make_tuple_of(PyObject *type, PyObject *items) {
    /* A NamedTuple instance without its Python __new__: tuple's own constructor. */
    PyObject *args = PyTuple_Pack(1, items);
    if (!args) return NULL;
    PyObject *r = PyTuple_Type.tp_new((PyTypeObject *)type, args, NULL);
    Py_DECREF(args);
    return r;
}
static PyObject *shard_id(Core *c, uint32_t ns, const uint8_t *key, size_t len, uint32_t rank) {
    PyObject *items = Py_BuildValue("(Oy#I)", PyList_GET_ITEM(c->ns_list, ns), key, (Py_ssize_t)len, rank);
    if (!items) return NULL;
    PyObject *r = make_tuple_of(c->shard_id_t, items);
    Py_DECREF(items);
    return r;
}
static void emit(Core *c, int kind, uint32_t node, uint32_t ci, uint32_t rank) {
    PyObject *name = PyList_GET_ITEM(c->node_list, node);
    PyObject *lists = PyDict_GetItemWithError(c->actions, name);
    if (!lists) {
        fatal_if(PyErr_Occurred() != NULL);
        lists = Py_BuildValue("([][][][])");
        fatal_if(!lists || PyDict_SetItem(c->actions, name, lists) < 0);
        Py_DECREF(lists);
    }
    Chunk *ch = &c->chunks[ci];
    PyObject *sid = shard_id(c, ch->ns, chunk_key(c, ch), ch->keylen, rank);
    fatal_if(!sid || PyList_Append(PyTuple_GET_ITEM(lists, kind), sid) < 0);
    Py_DECREF(sid);
}

/* ---- protection -------------------------------------------------------------------- */
static int set_has(const uint64_t *set, size_t mask, uint64_t h) {
    for (size_t i = h & mask; set[i]; i = (i + 1) & mask) if (set[i] == h) return 1;
    return 0;
}
static int is_prot(Core *c, const Prot *p, uint32_t u) {
    return u == p->extra || (p->flagged && (c->units[u].flags & U_PROT));
}
static void mark_protected(Core *c, uint32_t u) {
    if (u == NIL || (c->units[u].flags & U_PROT)) return;
    c->units[u].flags |= U_PROT;
    c->plist = grow(c->plist, &c->capplist, c->nplist + 1, sizeof(uint32_t));
    c->plist[c->nplist++] = u;
}
static void unprotect(Core *c) {
    for (size_t i = 0; i < c->nplist; i++) c->units[c->plist[i]].flags &= ~U_PROT;
    c->nplist = 0;
    c->npkeys = 0;
    c->pset_active = 0;
}
/* Protect the unit of boundary ``b`` (``blen`` bytes, hash ``h``) if it exists when a
 * walk first runs in this call. Its bytes must outlive the call (the caller's keys). */
static void want_protected(Core *c, uint32_t ns, const uint8_t *b, size_t blen, uint64_t h) {
    c->pkeys = grow(c->pkeys, &c->cappkeys, c->npkeys + 1, sizeof(PKey));
    c->pkeys[c->npkeys++] = (PKey){ns, b, blen, h};
}
static void flag_protected(Core *c) {
    for (size_t i = 0; i < c->npkeys; i++) {
        PKey *k = &c->pkeys[i];
        mark_protected(c, find_unit(c, k->ns, k->b, k->blen, k->h));
    }
    c->npkeys = 0;
}
/* The call's protected set: the units of ``hashes``, whether they exist yet or not (a
 * unit made during the call is flagged when its hash is in the set). The caller flags
 * the units that exist now (mark_protected) and calls unprotect() before returning. */
static Prot protect(Core *c, const uint64_t *hashes, size_t n) {
    size_t cap = 16;
    while (cap < 2 * n + 2) cap *= 2;
    if (cap > c->pcap) {
        PyMem_RawFree(c->pset);
        c->pset = PyMem_RawMalloc(cap * sizeof(uint64_t));
        if (!c->pset) Py_FatalError("tierstore compact index: out of memory");
        c->pcap = cap;
    }
    memset(c->pset, 0, cap * sizeof(uint64_t));
    for (size_t k = 0; k < n; k++) {
        size_t i = hashes[k] & (cap - 1);
        while (c->pset[i] && c->pset[i] != hashes[k]) i = (i + 1) & (cap - 1);
        c->pset[i] = hashes[k];
    }
    c->pset_active = 1;
    c->pmask = cap - 1;
    return (Prot){1, NIL};
}

/* ---- the tree --------------------------------------------------------------------- */
static void add_edge(Core *c, uint32_t p, uint32_t ch) {
    uint32_t e = POOL_NEW(c, edges, nedges, capedges, c->edge_free, Edge, pnext);
    Edge *ed = &c->edges[e];
    ed->parent = p; ed->child = ch;
    ed->pprev = NIL; ed->pnext = c->units[p].children;
    if (ed->pnext != NIL) c->edges[ed->pnext].pprev = e;
    c->units[p].children = e;
    ed->cnext = c->units[ch].parents;
    c->units[ch].parents = e;
    if (c->units[ch].cpu_copies) c->units[p].cpu_children++;
}
static void remove_edge(Core *c, uint32_t e) {
    Edge ed = c->edges[e];
    if (ed.pprev != NIL) c->edges[ed.pprev].pnext = ed.pnext; else c->units[ed.parent].children = ed.pnext;
    if (ed.pnext != NIL) c->edges[ed.pnext].pprev = ed.pprev;
    uint32_t *link = &c->units[ed.child].parents;
    while (*link != e) link = &c->edges[*link].cnext;
    *link = ed.cnext;
    c->edges[e].pnext = c->edge_free; c->edge_free = e;
    Unit *pu = &c->units[ed.parent];
    if (pu->children == NIL) queue_tier(c, ed.parent, DISK);
    if (c->units[ed.child].cpu_copies) {
        pu->cpu_children--;
        if (!pu->cpu_children) queue_tier(c, ed.parent, CPU);
    }
}
static void add_wait(Core *c, uint32_t child, uint64_t ph) {
    uint32_t w = POOL_NEW(c, waits, nwaits, capwaits, c->wait_free, Wait, cnext);
    uint32_t head = find_orphans(c, ph);
    c->waits[w] = (Wait){ph, child, head, NIL, c->units[child].waits};
    c->units[child].waits = w;
    if (head != NIL) {
        c->waits[head].oprev = w;
        c->otab.slots[tab_slot_of(&c->otab, ph, head)] = w; /* the new head */
    } else {
        tab_insert(c, &c->otab, T_ORPHAN, ph, w);
    }
}
/* Unlink wait ``w`` from its parent's orphan list (not from its child's list). */
static void unlink_orphan(Core *c, uint32_t w) {
    Wait wt = c->waits[w];
    if (wt.oprev != NIL) c->waits[wt.oprev].onext = wt.onext;
    else if (wt.onext != NIL) c->otab.slots[tab_slot_of(&c->otab, wt.phash, w)] = wt.onext;
    else tab_remove(c, &c->otab, T_ORPHAN, wt.phash, w);
    if (wt.onext != NIL) c->waits[wt.onext].oprev = wt.oprev;
}
static void remove_child_wait(Core *c, uint32_t child, uint32_t w) {
    uint32_t *link = &c->units[child].waits;
    while (*link != w) link = &c->waits[*link].cnext;
    *link = c->waits[w].cnext;
    c->waits[w].cnext = c->wait_free; c->wait_free = w;
}

static void gain(Core *c, uint32_t u, Shard *s, int tier) {
    if (has_tier(s, tier)) return;
    s->flags |= tier == CPU ? S_CPU : S_DISK;
    if (tier == DISK) s->flags &= ~S_UNVERIFIED;
    account(c, s->node, tier, s->nbytes, +1);
    if (tier == CPU && ++c->units[u].cpu_copies == 1)
        for (uint32_t e = c->units[u].parents; e != NIL; e = c->edges[e].cnext)
            c->units[c->edges[e].parent].cpu_children++;
    push(c, u, s->node, tier);
}
static void lose(Core *c, uint32_t u, Shard *s, int tier) {
    if (!has_tier(s, tier)) return;
    s->flags &= ~(tier == CPU ? S_CPU : S_DISK);
    account(c, s->node, tier, s->nbytes, -1);
    if (tier == CPU && --c->units[u].cpu_copies == 0) {
        for (uint32_t e = c->units[u].parents; e != NIL; e = c->edges[e].cnext) {
            uint32_t p = c->edges[e].parent;
            if (--c->units[p].cpu_children == 0) queue_tier(c, p, CPU);
        }
        queue_tier(c, u, DISK);
    }
}

static void free_chunk(Core *c, uint32_t ci) {
    Chunk *ch = &c->chunks[ci];
    if (ch->world <= MAX_POOLED_WORLD) {
        c->shards[ch->shards].nbytes = c->shard_free[ch->world];
        c->shard_free[ch->world] = ch->shards;
    }
    key_free(c, ch->keylen, ch->keyref);
    ch->alive = 0;
    ch->next = c->chunk_free; c->chunk_free = ci;
    c->live_chunks--;
}

static void drop_unit(Core *c, uint32_t u) {
    uint64_t uh = unit_hash(c, u);
    while (c->units[u].parents != NIL) remove_edge(c, c->units[u].parents);
    while (c->units[u].waits != NIL) {
        uint32_t w = c->units[u].waits;
        unlink_orphan(c, w);
        remove_child_wait(c, u, w);
    }
    while (c->units[u].children != NIL) { /* only when forced (corruption, node loss) */
        uint32_t e = c->units[u].children, child = c->edges[e].child;
        remove_edge(c, e);
        add_wait(c, child, uh); /* re-linked if this boundary comes back */
    }
    for (uint32_t ci = c->units[u].chunks; ci != NIL; ci = c->chunks[ci].next) {
        tab_remove(c, &c->ctab, T_CHUNK, chunk_hash(c, ci), ci);
        free_leases(c, ci);
        for (uint32_t r = 0; r < c->chunks[ci].world; r++) {
            Shard *s = SHARD(c, &c->chunks[ci], r);
            if (!(s->flags & S_HELD)) continue;
            lose(c, u, s, CPU);
            lose(c, u, s, DISK);
            emit(c, A_DROP, s->node, ci, r);
        }
    }
    tab_remove(c, &c->utab, T_UNIT, uh, u); /* while its first chunk still names it */
    for (uint32_t ci = c->units[u].chunks; ci != NIL;) {
        uint32_t next = c->chunks[ci].next;
        free_chunk(c, ci);
        ci = next;
    }
    c->units[u].flags = 0;
    c->units[u].chunks = c->unit_free; c->unit_free = u;
}

/* Put new chunk ``ci`` (offered as ``o``) in its unit, creating the unit and its edges
 * as needed. */
static uint32_t link_chunk(Core *c, uint32_t ci, const Offer *o) {
    size_t blen = boundary_len(o->len);
    uint64_t uh = o->uhash;
    uint32_t u = find_unit(c, o->ns, o->key, blen, uh);
    if (u == NIL) {
        u = POOL_NEW(c, units, nunits, capunits, c->unit_free, Unit, chunks);
        c->units[u] = (Unit){c->clock++, ci, NIL, NIL, NIL, 0, 0, U_ALIVE};
        c->chunks[ci].unit = u;
        tab_insert(c, &c->utab, T_UNIT, uh, u);
        if (c->pset_active && set_has(c->pset, c->pmask, uh)) mark_protected(c, u);
        uint32_t w = find_orphans(c, uh);
        if (w != NIL) {
            tab_remove(c, &c->otab, T_ORPHAN, uh, w);
            while (w != NIL) { /* children that arrived first */
                uint32_t next = c->waits[w].onext, child = c->waits[w].child;
                remove_child_wait(c, child, w);
                add_edge(c, u, child);
                w = next;
            }
        }
    } else {
        uint32_t last = c->units[u].chunks;
        while (c->chunks[last].next != NIL) last = c->chunks[last].next;
        c->chunks[last].next = ci;
        c->chunks[ci].unit = u;
    }
    if (!o->parent) return u;
    size_t pblen = boundary_len(o->plen);
    uint64_t ph = o->phash;
    if (ph == uh && pblen == blen && !memcmp(o->parent, o->key, blen)) return u;
    uint32_t p = find_unit(c, o->ns, o->parent, pblen, ph);
    if (p != NIL) { /* an existing parent: never among the waits, which are for absent ones */
        for (uint32_t e = c->units[u].parents; e != NIL; e = c->edges[e].cnext)
            if (c->edges[e].parent == p) return u;
        add_edge(c, p, u);
    } else {
        for (uint32_t w = c->units[u].waits; w != NIL; w = c->waits[w].cnext)
            if (c->waits[w].phash == ph) return u;
        add_wait(c, u, ph);
    }
    return u;
}

static uint32_t new_chunk(Core *c, uint32_t ns, const uint8_t *key, size_t len, uint64_t h, uint32_t world) {
    uint32_t ci = POOL_NEW(c, chunks, nchunks, capchunks, c->chunk_free, Chunk, next);
    Chunk *ch = &c->chunks[ci];
    memset(ch, 0, sizeof *ch);
    ch->ns = ns; ch->world = world; ch->next = NIL; ch->lease = NIL;
    ch->keylen = (uint8_t)len; ch->alive = 1;
    ch->keyref = key_store(c, key, len);
    uint32_t base;
    if (world <= MAX_POOLED_WORLD && c->shard_free[world] != NIL) {
        base = c->shard_free[world]; c->shard_free[world] = (uint32_t)c->shards[base].nbytes;
    } else {
        c->shards = grow(c->shards, &c->capshards, c->nshards + world, sizeof(Shard));
        base = (uint32_t)c->nshards; c->nshards += world;
    }
    ch = &c->chunks[ci];
    ch->shards = base;
    memset(&c->shards[base], 0, world * sizeof(Shard));
    c->live_chunks++;
    tab_insert(c, &c->ctab, T_CHUNK, h, ci);
    return ci;
}

/* The shard offered as ``o`` held on ``node`` in ``tier``: a new shard of chunk ``ci``
 * (NIL: a new chunk, made here). Returns its unit; its chunk in ``chunk_out``. */
static uint32_t add_shard(Core *c, uint32_t ci, uint32_t node, const Offer *o, int tier, uint32_t *chunk_out) {
    uint32_t u;
    if (ci == NIL) {
        ci = new_chunk(c, o->ns, o->key, o->len, o->hash, (uint32_t)o->world);
        u = link_chunk(c, ci, o);
    } else {
        u = c->chunks[ci].unit;
    }
    Chunk *ch = &c->chunks[ci];
    Shard *s = SHARD(c, ch, o->rank);
    *s = (Shard){o->nbytes, node, S_HELD};
    ch->present++;
    gain(c, u, s, tier);
    if (c->chunks[ci].present == c->chunks[ci].world) c->counts[C_STORED]++;
    *chunk_out = ci;
    return u;
}

/* ---- making room ------------------------------------------------------------------ */
typedef struct { int watermark; uint32_t node; int tier; uint64_t nbytes; double target; } Done;
static int is_done(Core *c, const Done *d) {
    Node *n = &c->nodes[d->node];
    if (d->watermark) return (double)n->used[CPU] <= d->target;
    return n->used[d->tier] + (int64_t)d->nbytes <= n->cap[d->tier];
}
enum { F_CPU, F_DEMOTE, F_DROP };

static int make_disk_room(Core *c, uint32_t node, uint64_t nbytes, const Prot *p, double now);

static int demote(Core *c, uint32_t u, uint32_t node, const Prot *call, double now) {
    uint64_t to_write = 0;
    for (uint32_t ci = c->units[u].chunks; ci != NIL; ci = c->chunks[ci].next)
        for (uint32_t r = 0; r < c->chunks[ci].world; r++) {
            Shard *s = SHARD(c, &c->chunks[ci], r);
            if ((s->flags & (S_HELD | S_CPU)) == (S_HELD | S_CPU) && s->node == node && !(s->flags & S_DISK))
                to_write += s->nbytes;
        }
    if (to_write) {
        Prot q = *call;
        q.extra = u;
        if (!make_disk_room(c, node, to_write, &q, now)) return 0;
    }
    for (uint32_t ci = c->units[u].chunks; ci != NIL; ci = c->chunks[ci].next)
        for (uint32_t r = 0; r < c->chunks[ci].world; r++) {
            Shard *s = SHARD(c, &c->chunks[ci], r);
            if ((s->flags & (S_HELD | S_CPU)) != (S_HELD | S_CPU) || s->node != node) continue;
            gain(c, u, s, DISK);
            lose(c, u, s, CPU);
            emit(c, A_DEMOTE, node, ci, r);
            c->counts[C_DEMOTED]++;
        }
    return 1;
}

static int free_one(Core *c, int mode, uint32_t u, uint32_t node, const Prot *call, double now) {
    if (mode != F_DROP) {
        if (demote(c, u, node, call, now)) return 1;
        if (mode == F_DEMOTE || c->units[u].children != NIL) return 0;
    }
    drop_unit(c, u); /* a tail: safe to drop everywhere */
    c->counts[C_EVICTED]++;
    return 1;
}

static uint32_t next_candidate(Core *c, uint32_t node, int tier, const Prot *p, double now,
                               uint32_t **aside, size_t *naside, size_t *capaside) {
    Heap *hp = &c->nodes[node].heap[tier];
    uint32_t aside_flag = U_ASIDE0 << tier;
    while (hp->n) {
        Entry e = heap_pop(hp);
        Unit *un = &c->units[e.unit];
        if (!(un->flags & U_ALIVE) || (un->flags & aside_flag)) continue;
        if (un->rank != e.rank) { heap_push(hp, (Entry){un->rank, e.unit}); continue; } /* touched since */
        if (!evictable_from(c, e.unit, node, tier)) continue; /* queued again when it is */
        if (is_prot(c, p, e.unit)) {
            *aside = grow(*aside, capaside, *naside + 1, sizeof(uint32_t));
            (*aside)[(*naside)++] = e.unit;
            c->units[e.unit].flags |= aside_flag;
        } else if (pinned(c, e.unit, now)) {
            park(c, e.unit);
        } else {
            return e.unit;
        }
    }
    return NIL;
}

/* Free candidates of (node, tier) in LRU order until ``d``; a unit ``free_one`` cannot
 * free is passed over for the rest of the walk. */
static int walk(Core *c, uint32_t node, int tier, const Prot *p, double now, const Done *d,
                int mode, const Prot *call) {
    if (is_done(c, d)) return 1;
    flag_protected(c);
    wake(c, now);
    uint32_t *aside = NULL;
    size_t naside = 0, capaside = 0;
    uint32_t aside_flag = U_ASIDE0 << tier;
    int ok = 1;
    while (!is_done(c, d)) {
        uint32_t u = next_candidate(c, node, tier, p, now, &aside, &naside, &capaside);
        if (u == NIL) { ok = 0; break; }
        if (!free_one(c, mode, u, node, call, now)) {
            aside = grow(aside, &capaside, naside + 1, sizeof(uint32_t));
            aside[naside++] = u;
            c->units[u].flags |= aside_flag;
        }
    }
    for (size_t i = 0; i < naside; i++) {
        c->units[aside[i]].flags &= ~aside_flag;
        push(c, aside[i], node, tier);
    }
    PyMem_RawFree(aside);
    return ok;
}

static int make_room(Core *c, uint32_t node, int tier, uint64_t nbytes, const Prot *p, double now,
                     int mode, const Prot *call) {
    if ((int64_t)nbytes > c->nodes[node].cap[tier] || nbytes > (uint64_t)INT64_MAX) return 0;
    Done d = {0, node, tier, nbytes, 0.0};
    return walk(c, node, tier, p, now, &d, mode, call);
}
static int make_disk_room(Core *c, uint32_t node, uint64_t nbytes, const Prot *p, double now) {
    if (fits(c, node, DISK, nbytes)) return 1;
    return make_room(c, node, DISK, nbytes, p, now, F_DROP, p);
}
static int make_cpu_room(Core *c, uint32_t node, uint64_t nbytes, const Prot *p, double now) {
    if (fits(c, node, CPU, nbytes)) return 1;
    return make_room(c, node, CPU, nbytes, p, now, F_CPU, p);
}
/* A store's last resort: demote even protected units (never the offer's own unit). */
static int demote_for_store(Core *c, uint32_t node, uint64_t nbytes, uint32_t own, const Prot *p, double now) {
    if (c->nodes[node].cap[DISK] == 0) return 0;
    Prot w = {0, own};
    return make_room(c, node, CPU, nbytes, &w, now, F_DEMOTE, p);
}
static void demote_to_watermark(Core *c, uint32_t node, const Prot *p, double now) {
    Node *n = &c->nodes[node];
    if (n->cap[DISK] == 0) return;
    if ((double)n->used[CPU] <= c->high * (double)n->cap[CPU]) return;
    Done d = {1, node, CPU, 0, c->low * (double)n->cap[CPU]};
    walk(c, node, CPU, p, now, &d, F_DEMOTE, p);
}

/* ---- Python glue: ids --------------------------------------------------------------- */
static long intern(PyObject *ids, PyObject *list, PyObject *name, int create) {
    PyObject *v = PyDict_GetItemWithError(ids, name);
    if (v) return PyLong_AsLong(v);
    if (PyErr_Occurred() || !create) return -1;
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject *id = PyLong_FromSsize_t(n);
    if (!id || PyDict_SetItem(ids, name, id) < 0 || PyList_Append(list, name) < 0) { Py_XDECREF(id); return -2; }
    Py_DECREF(id);
    return (long)n;
}
static long node_of(Core *c, PyObject *name, int create) {
    if (create && (size_t)PyList_GET_SIZE(c->node_list) >= MAX_NODES) {
        PyErr_SetString(PyExc_OverflowError, "the compact index names at most 2**24 nodes");
        return -2;
    }
    long n = intern(c->node_ids, c->node_list, name, create);
    if (n >= 0 && (size_t)n >= c->nnodes) {
        size_t cap = c->nnodes;
        c->nodes = grow(c->nodes, &cap, (size_t)n + 1, sizeof(Node));
        memset(c->nodes + c->nnodes, 0, (cap - c->nnodes) * sizeof(Node));
        c->nnodes = cap;
    }
    return n;
}
static int as_bytes(PyObject *o, const uint8_t **p, size_t *n) {
    if (!PyBytes_Check(o)) { PyErr_SetString(PyExc_TypeError, "a chunk key must be bytes"); return -1; }
    *p = (const uint8_t *)PyBytes_AS_STRING(o);
    *n = (size_t)PyBytes_GET_SIZE(o);
    if (*n > 255) { PyErr_SetString(PyExc_ValueError, "a chunk key is at most 255 bytes"); return -1; }
    return 0;
}

static int parse_offer(Core *c, PyObject *o, Offer *of) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) < 5) { PyErr_SetString(PyExc_TypeError, "not a ShardOffer"); return -1; }
    long ns = intern(c->ns_ids, c->ns_list, PyTuple_GET_ITEM(o, 0), 1);
    if (ns < 0) return -1;
    of->ns = (uint32_t)ns;
    if (as_bytes(PyTuple_GET_ITEM(o, 1), &of->key, &of->len) < 0) return -1;
    int overflow = 0;
    of->rank = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(o, 2), &overflow);
    int overflow2 = 0;
    of->world = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(o, 3), &overflow2);
    unsigned long long nb = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(o, 4));
    if (PyErr_Occurred()) return -1;
    of->nbytes = nb;
    of->valid = !overflow && !overflow2 && of->rank >= 0 && of->rank < of->world && of->world <= UINT32_MAX;
    PyObject *parent = PyTuple_GET_SIZE(o) > 5 ? PyTuple_GET_ITEM(o, 5) : Py_None;
    of->parent = NULL; of->plen = 0; of->phash = 0;
    if (parent != Py_None) {
        if (as_bytes(parent, &of->parent, &of->plen) < 0) return -1;
        of->phash = hash_bytes(of->parent, boundary_len(of->plen), of->ns);
    }
    of->hash = hash_bytes(of->key, of->len, of->ns);
    of->uhash = hash_bytes(of->key, boundary_len(of->len), of->ns);
    return 0;
}
/* The shard (chunk, rank) is held: its chunk index, else NIL. */
static uint32_t held_chunk(Core *c, uint32_t ns, const uint8_t *key, size_t len, uint64_t h, long long rank) {
    uint32_t ci = find_chunk(c, ns, key, len, h);
    if (ci == NIL || rank < 0 || rank >= c->chunks[ci].world) return NIL;
    return (SHARD(c, &c->chunks[ci], rank)->flags & S_HELD) ? ci : NIL;
}
/* A ShardId argument: its chunk if held at that rank. */
static int parse_shard_id(Core *c, PyObject *o, uint32_t *ci, long long *rank) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 3) { PyErr_SetString(PyExc_TypeError, "not a ShardId"); return -1; }
    long ns = intern(c->ns_ids, c->ns_list, PyTuple_GET_ITEM(o, 0), 1);
    const uint8_t *key; size_t len;
    if (ns < 0 || as_bytes(PyTuple_GET_ITEM(o, 1), &key, &len) < 0) return -1;
    int overflow = 0;
    *rank = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(o, 2), &overflow);
    if (PyErr_Occurred()) return -1;
    *ci = overflow ? NIL : held_chunk(c, (uint32_t)ns, key, len, hash_bytes(key, len, (uint32_t)ns), *rank);
    return 0;
}
static uint32_t unit_of_key(Core *c, PyObject *ns_obj, PyObject *key_obj) {
    long ns = intern(c->ns_ids, c->ns_list, ns_obj, 1);
    const uint8_t *key; size_t len;
    if (ns < 0 || as_bytes(key_obj, &key, &len) < 0) return NIL;
    size_t bl = boundary_len(len);
    return find_unit(c, (uint32_t)ns, key, bl, hash_bytes(key, bl, (uint32_t)ns));
}

static PyObject *begin(Core *c) {
    Py_XDECREF(c->actions);
    c->actions = PyDict_New();
    return c->actions;
}
/* The end of a call: its actions handed over (or dropped on an error), its protected
 * units unflagged. */
static PyObject *finish(Core *c) { PyObject *a = c->actions; c->actions = NULL; unprotect(c); return a; }
static void abort_call(Core *c) { Py_CLEAR(c->actions); unprotect(c); }

/* ---- Python methods ----------------------------------------------------------------- */
static PyObject *Core_register_node(Core *c, PyObject *args) {
    PyObject *name; long long cpu, disk;
    if (!PyArg_ParseTuple(args, "OLL", &name, &cpu, &disk)) return NULL;
    long n = node_of(c, name, 1);
    if (n < 0) return NULL;
    Node *nd = &c->nodes[n];
    if (!nd->registered) { memset(nd->used, 0, sizeof nd->used); memset(nd->shards, 0, sizeof nd->shards); }
    nd->registered = 1;
    nd->cap[CPU] = cpu; nd->cap[DISK] = disk; nd->has_parked = 0;
    Py_RETURN_NONE;
}

static PyObject *Core_admit(Core *c, PyObject *args) {
    PyObject *name, *offers; double now;
    if (!PyArg_ParseTuple(args, "OO!d", &name, &PyList_Type, &offers, &now)) return NULL;
    long node = node_of(c, name, 0);
    if (node < 0 || !c->nodes[node].registered) { if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, name); return NULL; }
    Py_ssize_t n = PyList_GET_SIZE(offers);
    Offer *of = PyMem_RawMalloc((n + 1) * sizeof(Offer));
    uint64_t *hs = PyMem_RawMalloc((2 * n + 1) * sizeof(uint64_t));
    PyObject *accepted = PyList_New(n);
    if (!of || !hs || !accepted || !begin(c)) goto fail;
    size_t nh = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_offer(c, PyList_GET_ITEM(offers, i), &of[i]) < 0) goto fail;
        hs[nh++] = of[i].uhash;
        if (of[i].parent) hs[nh++] = of[i].phash;
    }
    Prot p = protect(c, hs, nh);
    for (Py_ssize_t i = 0; i < n; i++) {
        want_protected(c, of[i].ns, of[i].key, boundary_len(of[i].len), of[i].uhash);
        if (of[i].parent) want_protected(c, of[i].ns, of[i].parent, boundary_len(of[i].plen), of[i].phash);
    }
    long invalid = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Offer *o = &of[i];
        PyObject *verdict = Py_False;
        uint32_t existing = o->valid ? find_chunk(c, o->ns, o->key, o->len, o->hash) : NIL;
        if (!o->valid) invalid++;
        else if (existing != NIL && (o->rank >= c->chunks[existing].world ||
                                     (SHARD(c, &c->chunks[existing], o->rank)->flags & S_HELD))) {
        } else if (!make_cpu_room(c, node, o->nbytes, &p, now) &&
                   !demote_for_store(c, node, o->nbytes,
                                     find_unit(c, o->ns, o->key, boundary_len(o->len), o->uhash), &p, now)) {
            c->counts[C_SKIPPED]++;
        } else {
            uint32_t ci;
            /* ``existing`` still stands: its unit is protected from every walk above */
            uint32_t u = add_shard(c, existing, node, o, CPU, &ci);
            verdict = Py_True;
            if (make_disk_room(c, node, o->nbytes, &p, now)) {
                gain(c, u, SHARD(c, &c->chunks[ci], o->rank), DISK);
                emit(c, A_PERSIST, node, ci, (uint32_t)o->rank);
            }
        }
        Py_INCREF(verdict);
        PyList_SET_ITEM(accepted, i, verdict);
    }
    demote_to_watermark(c, node, &p, now);
    PyMem_RawFree(of); PyMem_RawFree(hs);
    return Py_BuildValue("(NNl)", accepted, finish(c), invalid);
fail:
    PyMem_RawFree(of); PyMem_RawFree(hs); Py_XDECREF(accepted); abort_call(c);
    return NULL;
}

static int promote(Core *c, uint32_t u, uint32_t ci, const Prot *p, double now) {
    for (uint32_t r = 0; r < c->chunks[ci].world; r++) {
        Shard *s = SHARD(c, &c->chunks[ci], r);
        if ((s->flags & S_HELD) && !(s->flags & S_CPU) && !make_cpu_room(c, s->node, s->nbytes, p, now)) return 0;
    }
    for (uint32_t r = 0; r < c->chunks[ci].world; r++) {
        Shard *s = SHARD(c, &c->chunks[ci], r);
        if (!(s->flags & S_HELD) || (s->flags & S_CPU)) continue;
        s->flags |= S_PROMOTING;
        gain(c, u, s, CPU); /* the disk copy stays: demoting is free */
        emit(c, A_PROMOTE, s->node, ci, r);
    }
    return 1;
}

static PyObject *answer(Core *c, uint32_t u, uint32_t ci, const Prot *p, double now) {
    int on_disk = 0;
    for (uint32_t r = 0; r < c->chunks[ci].world; r++)
        if (!(SHARD(c, &c->chunks[ci], r)->flags & S_CPU)) on_disk = 1;
    if (on_disk) promote(c, u, ci, p, now);
    int from_disk = 0;
    for (uint32_t r = 0; r < c->chunks[ci].world; r++) {
        uint32_t f = SHARD(c, &c->chunks[ci], r)->flags;
        if ((f & S_PROMOTING) && (f & S_UNVERIFIED)) { Py_INCREF(c->pending_answer); return c->pending_answer; }
        if ((f & S_PROMOTING) || !(f & S_CPU)) from_disk = 1;
    }
    c->counts[C_HITS]++;
    if (from_disk) c->counts[C_DISK_HITS]++;
    PyObject *where = PyDict_New();
    if (!where) return NULL;
    for (uint32_t r = 0; r < c->chunks[ci].world; r++) {
        PyObject *rank = PyLong_FromUnsignedLong(r);
        if (!rank || PyDict_SetItem(where, rank, PyList_GET_ITEM(c->node_list, SHARD(c, &c->chunks[ci], r)->node)) < 0) {
            Py_XDECREF(rank); Py_DECREF(where); return NULL;
        }
        Py_DECREF(rank);
    }
    PyObject *items = PyTuple_Pack(3, c->hit, where, c->tier_obj[from_disk ? DISK : CPU]);
    Py_DECREF(where);
    if (!items) return NULL;
    PyObject *r = make_tuple_of(c->answer_t, items);
    Py_DECREF(items);
    return r;
}

static PyObject *Core_lookup(Core *c, PyObject *args) {
    PyObject *ns_obj, *keys, *holder; double now, ttl;
    if (!PyArg_ParseTuple(args, "OO!Odd", &ns_obj, &PyList_Type, &keys, &holder, &now, &ttl)) return NULL;
    long ns = intern(c->ns_ids, c->ns_list, ns_obj, 1);
    long hid = intern(c->holder_ids, c->holder_list, holder, 1);
    if (ns < 0 || hid < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    uint64_t *hs = PyMem_RawMalloc((2 * n + 1) * sizeof(uint64_t)); /* boundaries', then keys' */
    PyObject *answers = PyList_New(n);
    if (!hs || !answers || !begin(c)) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *key; size_t len;
        if (as_bytes(PyList_GET_ITEM(keys, i), &key, &len) < 0) goto fail;
        hs[i] = hash_bytes(key, boundary_len(len), (uint32_t)ns);
        want_protected(c, (uint32_t)ns, key, boundary_len(len), hs[i]);
        hs[n + i] = hash_bytes(key, len, (uint32_t)ns);
        prefetch_slot(&c->ctab, hs[n + i]); /* the batch's probes overlap their misses */
    }
    Prot p = protect(c, hs, (size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        const uint8_t *key = (const uint8_t *)PyBytes_AS_STRING(k);
        size_t len = (size_t)PyBytes_GET_SIZE(k);
        uint32_t ci = find_chunk(c, (uint32_t)ns, key, len, hs[n + i]);
        PyObject *a;
        if (ci == NIL || c->chunks[ci].present != c->chunks[ci].world) {
            c->counts[C_MISSES]++;
            a = c->miss_answer; Py_INCREF(a);
        } else {
            uint32_t u = c->chunks[ci].unit;
            lease(c, ci, (uint32_t)hid, now + ttl);
            c->units[u].rank = c->clock++; /* touched: the LRU's newest */
            a = answer(c, u, ci, &p, now);
            if (!a) goto fail;
        }
        PyList_SET_ITEM(answers, i, a);
    }
    PyMem_RawFree(hs);
    return Py_BuildValue("(NN)", answers, finish(c));
fail:
    PyMem_RawFree(hs); Py_XDECREF(answers); abort_call(c);
    return NULL;
}

static PyObject *Core_extend_leases(Core *c, PyObject *args) {
    PyObject *ns_obj, *keys, *holder; double now, ttl;
    if (!PyArg_ParseTuple(args, "OO!Odd", &ns_obj, &PyList_Type, &keys, &holder, &now, &ttl)) return NULL;
    long ns = intern(c->ns_ids, c->ns_list, ns_obj, 1);
    long hid = intern(c->holder_ids, c->holder_list, holder, 1);
    if (ns < 0 || hid < 0) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        const uint8_t *key; size_t len;
        if (as_bytes(PyList_GET_ITEM(keys, i), &key, &len) < 0) return NULL;
        uint32_t ci = find_chunk(c, (uint32_t)ns, key, len, hash_bytes(key, len, (uint32_t)ns));
        if (ci != NIL) lease(c, ci, (uint32_t)hid, now + ttl);
    }
    Py_RETURN_NONE;
}

static PyObject *Core_release(Core *c, PyObject *args) {
    PyObject *ns_obj, *keys, *holder;
    if (!PyArg_ParseTuple(args, "OO!O", &ns_obj, &PyList_Type, &keys, &holder)) return NULL;
    long ns = intern(c->ns_ids, c->ns_list, ns_obj, 1);
    long hid = intern(c->holder_ids, c->holder_list, holder, 0);
    if (ns < 0 || hid == -2 || PyErr_Occurred()) return NULL;
    if (hid < 0) Py_RETURN_NONE; /* a holder never seen holds nothing */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        const uint8_t *key; size_t len;
        if (as_bytes(PyList_GET_ITEM(keys, i), &key, &len) < 0) return NULL;
        uint32_t ci = find_chunk(c, (uint32_t)ns, key, len, hash_bytes(key, len, (uint32_t)ns));
        if (ci != NIL) release_one(c, ci, (uint32_t)hid);
    }
    Py_RETURN_NONE;
}

static PyObject *Core_release_holder(Core *c, PyObject *holder) {
    long hid = intern(c->holder_ids, c->holder_list, holder, 0);
    if (hid == -2 || PyErr_Occurred()) return NULL;
    if (hid < 0) Py_RETURN_NONE;
    for (size_t ci = 0; ci < c->nchunks; ci++)
        if (c->chunks[ci].alive && c->chunks[ci].lease != NIL) release_one(c, (uint32_t)ci, (uint32_t)hid);
    Py_RETURN_NONE;
}

static PyObject *Core_is_leased(Core *c, PyObject *args) {
    PyObject *ns_obj, *key_obj; double now;
    if (!PyArg_ParseTuple(args, "OOd", &ns_obj, &key_obj, &now)) return NULL;
    long ns = intern(c->ns_ids, c->ns_list, ns_obj, 1);
    const uint8_t *key; size_t len;
    if (ns < 0 || as_bytes(key_obj, &key, &len) < 0) return NULL;
    uint32_t ci = find_chunk(c, (uint32_t)ns, key, len, hash_bytes(key, len, (uint32_t)ns));
    return PyBool_FromLong(ci != NIL && is_leased(c, ci, now));
}

static PyObject *Core_promoted(Core *c, PyObject *args) {
    PyObject *done, *refused;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &done, &PyList_Type, &refused)) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(done); i++) {
        uint32_t ci; long long rank;
        if (parse_shard_id(c, PyList_GET_ITEM(done, i), &ci, &rank) < 0) return NULL;
        if (ci == NIL) continue;
        SHARD(c, &c->chunks[ci], rank)->flags &= ~(S_PROMOTING | S_UNVERIFIED);
        c->counts[C_PROMOTED]++;
        unpark(c, c->chunks[ci].unit);
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(refused); i++) {
        uint32_t ci; long long rank;
        if (parse_shard_id(c, PyList_GET_ITEM(refused, i), &ci, &rank) < 0) return NULL;
        if (ci == NIL || !(SHARD(c, &c->chunks[ci], rank)->flags & S_PROMOTING)) continue;
        uint32_t u = c->chunks[ci].unit;
        Shard *s = SHARD(c, &c->chunks[ci], rank);
        s->flags &= ~S_PROMOTING;
        lose(c, u, s, CPU);
        c->counts[C_REFUSED]++;
        unpark(c, u);
    }
    Py_RETURN_NONE;
}

static PyObject *Core_forget_shards(Core *c, PyObject *ids) {
    if (!PyList_Check(ids) || !begin(c)) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a list"); return NULL; }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
        PyObject *o = PyList_GET_ITEM(ids, i);
        if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 3) { PyErr_SetString(PyExc_TypeError, "not a ShardId"); abort_call(c); return NULL; }
        uint32_t u = unit_of_key(c, PyTuple_GET_ITEM(o, 0), PyTuple_GET_ITEM(o, 1));
        if (PyErr_Occurred()) { abort_call(c); return NULL; }
        if (u != NIL) drop_unit(c, u);
    }
    return finish(c);
}

static PyObject *Core_disk_writes(Core *c, PyObject *args) {
    PyObject *name, *unwritten; int writable;
    if (!PyArg_ParseTuple(args, "OO!p", &name, &PyList_Type, &unwritten, &writable)) return NULL;
    long node = node_of(c, name, 0);
    if (PyErr_Occurred()) return NULL;
    PyObject *forgotten = PyList_New(0);
    if (!forgotten || node < 0 || !c->nodes[node].registered) return forgotten;
    Node *nd = &c->nodes[node];
    if (!writable && !nd->has_parked) { nd->parked_cap = nd->cap[DISK]; nd->cap[DISK] = 0; nd->has_parked = 1; }
    else if (writable && nd->has_parked) { nd->cap[DISK] = nd->parked_cap; nd->has_parked = 0; }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(unwritten); i++) {
        uint32_t ci; long long rank;
        PyObject *o = PyList_GET_ITEM(unwritten, i);
        if (parse_shard_id(c, o, &ci, &rank) < 0) { Py_DECREF(forgotten); return NULL; }
        if (ci == NIL) continue;
        Shard *s = SHARD(c, &c->chunks[ci], rank);
        if (s->node == (uint32_t)node && (s->flags & S_CPU) && (s->flags & S_DISK)) {
            lose(c, c->chunks[ci].unit, s, DISK);
            if (PyList_Append(forgotten, o) < 0) { Py_DECREF(forgotten); return NULL; }
        }
    }
    return forgotten;
}

static void emit_offer(Core *c, int kind, uint32_t node, const Offer *o) {
    PyObject *name = PyList_GET_ITEM(c->node_list, node);
    PyObject *lists = PyDict_GetItemWithError(c->actions, name);
    if (!lists) {
        fatal_if(PyErr_Occurred() != NULL);
        lists = Py_BuildValue("([][][][])");
        fatal_if(!lists || PyDict_SetItem(c->actions, name, lists) < 0);
        Py_DECREF(lists);
    }
    PyObject *sid = shard_id(c, o->ns, o->key, o->len, (uint32_t)o->rank);
    fatal_if(!sid || PyList_Append(PyTuple_GET_ITEM(lists, kind), sid) < 0);
    Py_DECREF(sid);
}

/* One restored copy; 1 when accepted. */
static int restore_one(Core *c, uint32_t node, const Offer *o, int tier, uint32_t grace_holder,
                       double now, double grace) {
    if (!o->valid) { emit_offer(c, A_DROP, node, o); return 0; }
    uint32_t ci = held_chunk(c, o->ns, o->key, o->len, o->hash, o->rank);
    Shard *s = ci != NIL ? SHARD(c, &c->chunks[ci], o->rank) : NULL;
    int fits_here = fits(c, node, tier, o->nbytes);
    int mine = s && s->node == node;
    if (mine && has_tier(s, tier)) return 1; /* already indexed */
    if (mine && fits_here) {
        gain(c, c->chunks[ci].unit, s, tier);
        if (tier == DISK) s->flags |= S_UNVERIFIED;
        return 1;
    }
    if (!s && fits_here) {
        uint32_t existing = find_chunk(c, o->ns, o->key, o->len, o->hash);
        if (existing != NIL && o->rank >= c->chunks[existing].world) { emit_offer(c, A_DROP, node, o); return 0; }
        uint32_t nci;
        add_shard(c, existing, node, o, tier, &nci);
        if (tier == DISK) SHARD(c, &c->chunks[nci], o->rank)->flags |= S_UNVERIFIED;
        if (grace > 0) lease(c, nci, grace_holder, now + grace);
        return 1;
    }
    if (mine && (s->flags & S_DISK)) emit_offer(c, A_DEMOTE, node, o); /* keep the disk copy */
    else if (mine) drop_unit(c, c->chunks[ci].unit);
    else emit_offer(c, A_DROP, node, o);
    return 0;
}

static PyObject *Core_restore(Core *c, PyObject *args) {
    PyObject *name, *held, *grace_name; double now, grace;
    if (!PyArg_ParseTuple(args, "OO!ddO", &name, &PyList_Type, &held, &now, &grace, &grace_name)) return NULL;
    long node = node_of(c, name, 0);
    long gh = intern(c->holder_ids, c->holder_list, grace_name, 1);
    if (node < 0 || !c->nodes[node].registered) { if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, name); return NULL; }
    if (gh < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(held);
    PyObject *accepted = PyList_New(n);
    if (!accepted || !begin(c)) { Py_XDECREF(accepted); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) { Py_INCREF(Py_False); PyList_SET_ITEM(accepted, i, Py_False); }
    for (int pass = DISK; pass >= CPU; pass--) { /* disk copies first */
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(held, i);
            if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) { PyErr_SetString(PyExc_TypeError, "(offer, tier)"); goto fail; }
            int tier = PyTuple_GET_ITEM(item, 1) == c->tier_obj[DISK] ? DISK : CPU;
            if (tier != pass) continue;
            Offer o;
            if (parse_offer(c, PyTuple_GET_ITEM(item, 0), &o) < 0) goto fail;
            if (restore_one(c, (uint32_t)node, &o, tier, (uint32_t)gh, now, grace)) {
                Py_INCREF(Py_True);
                Py_SETREF(PyList_GET_ITEM(accepted, i), Py_True);
            }
        }
    }
    return Py_BuildValue("(NN)", accepted, finish(c));
fail:
    Py_DECREF(accepted); abort_call(c);
    return NULL;
}

static PyObject *Core_forget_node(Core *c, PyObject *name) {
    long node = node_of(c, name, 0);
    if (PyErr_Occurred() || !begin(c)) return NULL;
    if (node < 0) return finish(c);
    for (int t = CPU; t <= DISK; t++) c->nodes[node].heap[t].n = 0;
    for (size_t u = 0; u < c->nunits; u++) {
        if (!(c->units[u].flags & U_ALIVE)) continue;
        for (uint32_t ci = c->units[u].chunks; ci != NIL; ci = c->chunks[ci].next)
            for (uint32_t r = 0; r < c->chunks[ci].world; r++) {
                Shard *s = SHARD(c, &c->chunks[ci], r);
                if ((s->flags & S_HELD) && s->node == (uint32_t)node) c->units[u].flags |= U_DYING;
            }
    }
    for (size_t u = 0; u < c->nunits; u++)
        if (c->units[u].flags & U_DYING) drop_unit(c, (uint32_t)u);
    Node *nd = &c->nodes[node];
    nd->registered = 0;
    memset(nd->used, 0, sizeof nd->used); memset(nd->shards, 0, sizeof nd->shards);
    nd->cap[CPU] = nd->cap[DISK] = 0; nd->has_parked = 0;
    if (PyDict_DelItem(c->actions, name) < 0) PyErr_Clear();
    return finish(c);
}

static PyObject *Core_nodes(Core *c, PyObject *unused) {
    PyObject *out = PyDict_New();
    for (size_t n = 0; out && n < c->nnodes; n++) {
        Node *nd = &c->nodes[n];
        if (!nd->registered) continue;
        PyObject *tiers = Py_BuildValue("{O(LLL)O(LLL)}", c->tier_obj[CPU], nd->used[CPU], nd->cap[CPU], nd->shards[CPU],
                                        c->tier_obj[DISK], nd->used[DISK], nd->cap[DISK], nd->shards[DISK]);
        if (!tiers || PyDict_SetItem(out, PyList_GET_ITEM(c->node_list, n), tiers) < 0) { Py_XDECREF(tiers); Py_DECREF(out); return NULL; }
        Py_DECREF(tiers);
    }
    return out;
}

static PyObject *Core_shards_on(Core *c, PyObject *name) {
    long node = node_of(c, name, 0);
    if (PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(0);
    if (!out || node < 0) return out;
    for (size_t ci = 0; ci < c->nchunks; ci++) {
        Chunk *ch = &c->chunks[ci];
        if (!ch->alive) continue;
        for (uint32_t r = 0; r < ch->world; r++) {
            Shard *s = SHARD(c, ch, r);
            if (!(s->flags & S_HELD) || s->node != (uint32_t)node) continue;
            for (int t = CPU; t <= DISK; t++) {
                if (!has_tier(s, t)) continue;
                PyObject *sid = shard_id(c, ch->ns, chunk_key(c, ch), ch->keylen, r);
                PyObject *pair = sid ? PyTuple_Pack(2, sid, c->tier_obj[t]) : NULL;
                Py_XDECREF(sid);
                if (!pair || PyList_Append(out, pair) < 0) { Py_XDECREF(pair); Py_DECREF(out); return NULL; }
                Py_DECREF(pair);
            }
        }
    }
    return out;
}

static PyObject *unit_id(Core *c, uint32_t u) {
    Chunk *ch = &c->chunks[c->units[u].chunks];
    PyObject *items = Py_BuildValue("(Oy#)", PyList_GET_ITEM(c->ns_list, unit_ns(c, u)), chunk_key(c, ch),
                                    (Py_ssize_t)boundary_len(ch->keylen));
    if (!items) return NULL;
    PyObject *r = make_tuple_of(c->unit_id_t, items);
    Py_DECREF(items);
    return r;
}
static PyObject *Core_units(Core *c, PyObject *unused) {
    PyObject *out = PyDict_New();
    for (size_t u = 0; out && u < c->nunits; u++) {
        if (!(c->units[u].flags & U_ALIVE)) continue;
        PyObject *parents = PySet_New(NULL), *children = PySet_New(NULL), *uid = unit_id(c, (uint32_t)u);
        int bad = !parents || !children || !uid;
        for (uint32_t e = c->units[u].parents; !bad && e != NIL; e = c->edges[e].cnext) {
            PyObject *p = unit_id(c, c->edges[e].parent);
            bad = !p || PySet_Add(parents, p) < 0; Py_XDECREF(p);
        }
        for (uint32_t e = c->units[u].children; !bad && e != NIL; e = c->edges[e].pnext) {
            PyObject *ch = unit_id(c, c->edges[e].child);
            bad = !ch || PySet_Add(children, ch) < 0; Py_XDECREF(ch);
        }
        PyObject *pair = bad ? NULL : PyTuple_Pack(2, parents, children);
        if (!pair || PyDict_SetItem(out, uid, pair) < 0) bad = 1;
        Py_XDECREF(parents); Py_XDECREF(children); Py_XDECREF(uid); Py_XDECREF(pair);
        if (bad) { Py_DECREF(out); return NULL; }
    }
    return out;
}

static PyObject *Core_locate(Core *c, PyObject *args) {
    PyObject *ns_obj, *keys, *avoid; long long rank;
    if (!PyArg_ParseTuple(args, "OO!LO", &ns_obj, &PyList_Type, &keys, &rank, &avoid)) return NULL;
    long ns = intern(c->ns_ids, c->ns_list, ns_obj, 1);
    long av = node_of(c, avoid, 0);
    if (ns < 0 || PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(PyList_GET_SIZE(keys));
    for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(keys); i++) {
        const uint8_t *key; size_t len;
        if (as_bytes(PyList_GET_ITEM(keys, i), &key, &len) < 0) { Py_DECREF(out); return NULL; }
        uint32_t ci = held_chunk(c, (uint32_t)ns, key, len, hash_bytes(key, len, (uint32_t)ns), rank);
        PyObject *found = Py_None;
        if (ci != NIL) {
            Shard *s = SHARD(c, &c->chunks[ci], rank);
            if ((long)s->node != av && !(s->flags & S_PROMOTING)) found = PyList_GET_ITEM(c->node_list, s->node);
        }
        Py_INCREF(found);
        PyList_SET_ITEM(out, i, found);
    }
    return out;
}

static PyObject *Core_contains(Core *c, PyObject *args) {
    PyObject *ns_obj, *key_obj;
    if (!PyArg_ParseTuple(args, "OO", &ns_obj, &key_obj)) return NULL;
    long ns = intern(c->ns_ids, c->ns_list, ns_obj, 1);
    const uint8_t *key; size_t len;
    if (ns < 0 || as_bytes(key_obj, &key, &len) < 0) return NULL;
    return PyBool_FromLong(find_chunk(c, (uint32_t)ns, key, len, hash_bytes(key, len, (uint32_t)ns)) != NIL);
}

static PyObject *Core_size(Core *c, PyObject *unused) { return PyLong_FromSize_t(c->live_chunks); }

static PyObject *Core_drain_counts(Core *c, PyObject *unused) {
    PyObject *t = PyTuple_New(N_COUNTS);
    for (int i = 0; t && i < N_COUNTS; i++) { PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(c->counts[i])); c->counts[i] = 0; }
    return t;
}

static PyObject *Core_memory_bytes(Core *c, PyObject *unused) {
    size_t b = c->capchunks * sizeof(Chunk) + c->capshards * sizeof(Shard) + c->capunits * sizeof(Unit)
             + c->capedges * sizeof(Edge) + c->capwaits * sizeof(Wait) + c->capleases * sizeof(Lease)
             + c->capwk * sizeof(Wakeup) + c->pcap * sizeof(uint64_t);
    for (int i = 0; i < 256; i++) b += c->keys[i].cap * key_slot((size_t)i);
    Table *ts[3] = {&c->ctab, &c->utab, &c->otab};
    for (int i = 0; i < 3; i++) if (ts[i]->slots) b += (ts[i]->mask + 1) * (sizeof(uint32_t) + sizeof(uint16_t));
    for (size_t n = 0; n < c->nnodes; n++) b += (c->nodes[n].heap[0].cap + c->nodes[n].heap[1].cap) * sizeof(Entry);
    return PyLong_FromSize_t(b);
}

/* ---- type ------------------------------------------------------------------------- */
static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, "ddOOOOOOOO", &c->high, &c->low, &c->shard_id_t, &c->answer_t, &c->unit_id_t,
                          &c->hit, &c->miss_answer, &c->pending_answer, &c->tier_obj[CPU], &c->tier_obj[DISK]))
        return -1;
    PyObject **objs[] = {&c->shard_id_t, &c->answer_t, &c->unit_id_t, &c->hit, &c->miss_answer,
                         &c->pending_answer, &c->tier_obj[CPU], &c->tier_obj[DISK]};
    for (size_t i = 0; i < sizeof objs / sizeof *objs; i++) Py_INCREF(*objs[i]);
    c->ns_ids = PyDict_New(); c->ns_list = PyList_New(0);
    c->node_ids = PyDict_New(); c->node_list = PyList_New(0);
    c->holder_ids = PyDict_New(); c->holder_list = PyList_New(0);
    if (!c->ns_ids || !c->ns_list || !c->node_ids || !c->node_list || !c->holder_ids || !c->holder_list) return -1;
    c->chunk_free = c->unit_free = c->edge_free = c->wait_free = c->lease_free = NIL;
    for (int i = 0; i <= MAX_POOLED_WORLD; i++) c->shard_free[i] = NIL;
    for (int i = 0; i < 256; i++) c->keys[i].free = NIL;
    return 0;
}
static void Core_dealloc(Core *c) {
    for (int i = 0; i < 256; i++) PyMem_RawFree(c->keys[i].a);
    void *arrays[] = {c->chunks, c->shards, c->units, c->edges, c->waits, c->leases, c->wk, c->pset,
                      c->plist, c->pkeys, c->ctab.slots, c->utab.slots, c->otab.slots, c->ctab.tags, c->utab.tags, c->otab.tags};
    for (size_t i = 0; i < sizeof arrays / sizeof *arrays; i++) PyMem_RawFree(arrays[i]);
    for (size_t n = 0; n < c->nnodes; n++) { PyMem_RawFree(c->nodes[n].heap[0].a); PyMem_RawFree(c->nodes[n].heap[1].a); }
    PyMem_RawFree(c->nodes);
    Py_XDECREF(c->ns_ids); Py_XDECREF(c->ns_list); Py_XDECREF(c->node_ids); Py_XDECREF(c->node_list);
    Py_XDECREF(c->holder_ids); Py_XDECREF(c->holder_list); Py_XDECREF(c->actions);
    Py_XDECREF(c->shard_id_t); Py_XDECREF(c->answer_t); Py_XDECREF(c->unit_id_t); Py_XDECREF(c->hit);
    Py_XDECREF(c->miss_answer); Py_XDECREF(c->pending_answer); Py_XDECREF(c->tier_obj[0]); Py_XDECREF(c->tier_obj[1]);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef Core_methods[] = {
    {"register_node", (PyCFunction)Core_register_node, METH_VARARGS, NULL},
    {"admit", (PyCFunction)Core_admit, METH_VARARGS, NULL},
    {"lookup", (PyCFunction)Core_lookup, METH_VARARGS, NULL},
    {"extend_leases", (PyCFunction)Core_extend_leases, METH_VARARGS, NULL},
    {"release", (PyCFunction)Core_release, METH_VARARGS, NULL},
    {"release_holder", (PyCFunction)Core_release_holder, METH_O, NULL},
    {"is_leased", (PyCFunction)Core_is_leased, METH_VARARGS, NULL},
    {"promoted", (PyCFunction)Core_promoted, METH_VARARGS, NULL},
    {"forget_shards", (PyCFunction)Core_forget_shards, METH_O, NULL},
    {"disk_writes", (PyCFunction)Core_disk_writes, METH_VARARGS, NULL},
    {"restore", (PyCFunction)Core_restore, METH_VARARGS, NULL},
    {"forget_node", (PyCFunction)Core_forget_node, METH_O, NULL},
    {"nodes", (PyCFunction)Core_nodes, METH_NOARGS, NULL},
    {"shards_on", (PyCFunction)Core_shards_on, METH_O, NULL},
    {"units", (PyCFunction)Core_units, METH_NOARGS, NULL},
    {"locate", (PyCFunction)Core_locate, METH_VARARGS, NULL},
    {"contains", (PyCFunction)Core_contains, METH_VARARGS, NULL},
    {"size", (PyCFunction)Core_size, METH_NOARGS, NULL},
    {"drain_counts", (PyCFunction)Core_drain_counts, METH_NOARGS, NULL},
    {"memory_bytes", (PyCFunction)Core_memory_bytes, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tierstore.control._compact_index.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_doc = "The compact chunk index's state and decisions (see compact_index.py).",
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_compact_index", .m_size = -1};

PyMODINIT_FUNC PyInit__compact_index(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) { Py_DECREF(&CoreType); Py_DECREF(m); return NULL; }
    return m;
}
