/* The compact index's state and decisions: pools, tables, heaps, leases and parking,
 * the unit tree, making room. Mirrors tierstore/control/index_*.py step for step (see
 * compact_index.h); tests/control/test_compact_index.py holds the two to the same answers. */
#include "compact_index.h"

/* ---- memory ---------------------------------------------------------------------- */
INTERNAL void *grow(void *p, size_t *cap, size_t need, size_t size) {
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

INTERNAL void fatal_if(int bad) { if (bad) Py_FatalError("tierstore compact index: Python error"); }

/* ---- hashing ---------------------------------------------------------------------- */
static uint64_t mix64(uint64_t x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL; x ^= x >> 27; x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}
INTERNAL uint64_t hash_bytes(const uint8_t *p, size_t n, uint32_t ns) {
    uint64_t h = mix64(((uint64_t)ns << 32) ^ n ^ 0x9e3779b97f4a7c15ULL);
    while (n >= 8) { uint64_t w; memcpy(&w, p, 8); h = mix64(h ^ w) + 0x9e3779b97f4a7c15ULL; p += 8; n -= 8; }
    if (n) { uint64_t w = 0; memcpy(&w, p, n); h = mix64(h ^ w ^ ((uint64_t)n << 56)); }
    h = mix64(h);
    return h ? h : 1; /* 0 means "none" in a Prot */
}

 /* a free slot links the next */
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
_Static_assert(sizeof(Chunk) == 40 && sizeof(Unit) == 32 && sizeof(Shard) == 12, "record sizes");
static uint64_t chunk_hash(const Core *c, uint32_t ci) {
    const Chunk *ch = &c->chunks[ci];
    return key_hash(chunk_key(c, ch), ch->keylen, ch->ns);
}
/* A unit's hash: any of its chunks' (they share its boundary). */
static uint64_t unit_hash(const Core *c, uint32_t u) { return chunk_hash(c, c->units[u].chunks); }

/* ---- open addressing -------------------------------------------------------------- */
static uint64_t tab_hash(Core *c, int kind, uint32_t i) {
    return kind == T_CHUNK ? chunk_hash(c, i) : c->waits[i].phash;
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

INTERNAL uint32_t find_chunk(Core *c, uint32_t ns, const uint8_t *key, size_t len, uint64_t h) {
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
/* The unit of boundary ``b`` (hash ``h``): any of its chunks names it (a chunk made but not
 * yet in a unit, unit NIL, is passed over). */
INTERNAL uint32_t find_unit(Core *c, uint32_t ns, const uint8_t *b, size_t blen, uint64_t h) {
    if (!c->ctab.slots) return NIL;
    uint16_t tag = TAG(h);
    for (size_t i = h & c->ctab.mask; c->ctab.slots[i] != NIL; i = (i + 1) & c->ctab.mask) {
        if (TAG_OF(c->ctab.tags[i]) != tag) continue;
        Chunk *ch = &c->chunks[c->ctab.slots[i]];
        if (ch->unit != NIL && ch->ns == ns && boundary_len(ch->keylen) == blen && !memcmp(chunk_key(c, ch), b, blen))
            return ch->unit;
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

static void account(Core *c, uint32_t node, int tier, uint64_t nbytes, int sign) {
    if (node < c->nnodes && c->nodes[node].registered) {
        c->nodes[node].used[tier] += sign * (int64_t)nbytes;
        c->nodes[node].shards[tier] += sign;
    }
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
INTERNAL void push(Core *c, uint32_t u, uint32_t node, int tier) {
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
INTERNAL void unpark(Core *c, uint32_t u) {
    if (c->units[u].flags & U_PARKED) {
        c->units[u].flags &= ~U_PARKED;
        queue_everywhere(c, u);
    }
}
/* Lease chunk ``ci`` to ``holder`` until ``until``, at ``now``: expired leases of the
 * chunk go first (ChunkIndex keeps them until it next looks; either way they hold
 * nothing, and a request that never released its lease must not keep its holder). */
INTERNAL void lease(Core *c, uint32_t ci, uint32_t holder, double now, double until) {
    is_leased(c, ci, now);
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
    c->holder_refs[holder]++;
}
/* Lease ``li`` (unlinked by the caller) back to its pool; its holder's last one? The
 * holder's id is freed at the end of the call (sweep_holders), never during it. */
static void free_lease(Core *c, uint32_t li) {
    uint32_t h = c->leases[li].holder;
    if (--c->holder_refs[h] == 0) {
        c->zero_holders = grow(c->zero_holders, &c->capzero, c->nzero + 1, sizeof(uint32_t));
        c->zero_holders[c->nzero++] = h;
    }
    c->leases[li].next = c->lease_free;
    c->lease_free = li;
}
static void free_leases(Core *c, uint32_t ci) {
    uint32_t li = c->chunks[ci].lease;
    while (li != NIL) { uint32_t nx = c->leases[li].next; free_lease(c, li); li = nx; }
    c->chunks[ci].lease = NIL;
}
/* Drop ``holder``'s lease on chunk ``ci``; 1 if it had one. */
INTERNAL int release_one(Core *c, uint32_t ci, uint32_t holder) {
    uint32_t *link = &c->chunks[ci].lease;
    for (uint32_t li = *link; li != NIL; link = &c->leases[li].next, li = *link) {
        if (c->leases[li].holder != holder) continue;
        *link = c->leases[li].next;
        free_lease(c, li);
        uint32_t u = c->chunks[ci].unit;
        if (c->chunks[ci].lease == NIL) unpark(c, u);
        else if (c->units[u].flags & U_PARKED) wk_push(c, lease_max(c, c->chunks[ci].lease), u);
        return 1;
    }
    return 0;
}
INTERNAL int is_leased(Core *c, uint32_t ci, double now) {
    uint32_t *link = &c->chunks[ci].lease;
    while (*link != NIL) {
        uint32_t li = *link;
        if (c->leases[li].expiry <= now) { *link = c->leases[li].next; free_lease(c, li); }
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
INTERNAL PyObject *make_tuple_of(PyObject *type, PyObject *items) {
    /* A NamedTuple instance without its Python __new__: tuple's own constructor. */
    PyObject *args = PyTuple_Pack(1, items);
    if (!args) return NULL;
    PyObject *r = PyTuple_Type.tp_new((PyTypeObject *)type, args, NULL);
    Py_DECREF(args);
    return r;
}
INTERNAL PyObject *shard_id(Core *c, uint32_t ns, const uint8_t *key, size_t len, uint32_t rank) {
    PyObject *items = Py_BuildValue("(Oy#I)", PyList_GET_ITEM(c->ns_list, ns), key, (Py_ssize_t)len, rank);
    if (!items) return NULL;
    PyObject *r = make_tuple_of(c->shard_id_t, items);
    Py_DECREF(items);
    return r;
}
/* ``node``'s action list of ``kind`` in the running call (made on first use). */
INTERNAL PyObject *action_list(Core *c, int kind, uint32_t node) {
    PyObject *name = PyList_GET_ITEM(c->node_list, node);
    PyObject *lists = PyDict_GetItemWithError(c->actions, name);
    if (!lists) {
        fatal_if(PyErr_Occurred() != NULL);
        lists = Py_BuildValue("([][][][][])");
        fatal_if(!lists || PyDict_SetItem(c->actions, name, lists) < 0);
        Py_DECREF(lists);
    }
    return PyTuple_GET_ITEM(lists, kind);
}
INTERNAL void emit(Core *c, int kind, uint32_t node, uint32_t ci, uint32_t rank) {
    if (node == c->mute) return;
    Chunk *ch = &c->chunks[ci];
    PyObject *sid = shard_id(c, ch->ns, chunk_key(c, ch), ch->keylen, rank);
    fatal_if(!sid || PyList_Append(action_list(c, kind, node), sid) < 0);
    Py_DECREF(sid);
}
/* ``from`` sends its shard (``ci``, ``rank``) to ``to``'s replica. */
INTERNAL void emit_push(Core *c, uint32_t from, uint32_t ci, uint32_t rank, uint32_t to) {
    Chunk *ch = &c->chunks[ci];
    PyObject *sid = shard_id(c, ch->ns, chunk_key(c, ch), ch->keylen, rank);
    PyObject *pair = sid ? PyTuple_Pack(2, sid, PyList_GET_ITEM(c->node_list, to)) : NULL;
    Py_XDECREF(sid);
    fatal_if(!pair || PyList_Append(action_list(c, A_PUSH, from), pair) < 0);
    Py_DECREF(pair);
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
INTERNAL void unprotect(Core *c) {
    for (size_t i = 0; i < c->nplist; i++) c->units[c->plist[i]].flags &= ~U_PROT;
    c->nplist = 0;
    c->npkeys = 0;
    c->pset_active = 0;
}
/* Protect the unit of boundary ``b`` (``blen`` bytes, hash ``h``) if it exists when a
 * walk first runs in this call. Its bytes must outlive the call (the caller's keys). */
INTERNAL void want_protected(Core *c, uint32_t ns, const uint8_t *b, size_t blen, uint64_t h) {
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
INTERNAL Prot protect(Core *c, const uint64_t *hashes, size_t n) {
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

/* ``s`` gets a copy in ``tier``: accounted, and (``queue``) a candidate there; a caller
 * adding a unit's shards together pushes the unit once instead. */
INTERNAL void gain_q(Core *c, uint32_t u, Shard *s, int tier, int queue) {
    if (has_tier(s, tier)) return;
    s->flags |= tier == CPU ? S_CPU : S_DISK;
    if (tier == DISK) s->flags &= ~S_UNVERIFIED;
    account(c, s->node, tier, s->nbytes, +1);
    if (tier == CPU && ++c->units[u].cpu_copies == 1)
        for (uint32_t e = c->units[u].parents; e != NIL; e = c->edges[e].cnext)
            c->units[c->edges[e].parent].cpu_children++;
    if (queue) push(c, u, s->node, tier);
}
INTERNAL void gain(Core *c, uint32_t u, Shard *s, int tier) { gain_q(c, u, s, tier, 1); }
INTERNAL void lose(Core *c, uint32_t u, Shard *s, int tier) {
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
    if (ch->world > 1 && ch->world <= MAX_POOLED_WORLD) {
        c->shards[ch->sh.run].nbytes = c->shard_free[ch->world];
        c->shard_free[ch->world] = ch->sh.run;
    }
    key_free(c, ch->keylen, ch->keyref);
    ch->alive = 0;
    ch->next = c->chunk_free; c->chunk_free = ci;
    c->live_chunks--;
}

INTERNAL void drop_unit(Core *c, uint32_t u) {
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
        if (!(c->units[child].flags & U_DYING)) add_wait(c, child, uh); /* re-linked if this boundary comes back */
    }
    for (uint32_t ci = c->units[u].chunks; ci != NIL; ci = c->chunks[ci].next) {
        while (c->chunks[ci].has_replicas) drop_replica(c, replicas_of(c, ci)); /* made first, dropped first */
        tab_remove(c, &c->ctab, T_CHUNK, uh, ci); /* a chunk's hash is its unit's */
        free_leases(c, ci);
        for (uint32_t r = 0; r < c->chunks[ci].world; r++) {
            Shard *s = SHARD(c, &c->chunks[ci], r);
            if (!(s->flags & S_HELD)) continue;
            lose(c, u, s, CPU);
            lose(c, u, s, DISK);
            emit(c, A_DROP, s->node, ci, r);
        }
    }
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
    uint64_t uh = o->hash;
    uint32_t u = find_unit(c, o->ns, o->key, blen, uh);
    if (u == NIL) {
        u = POOL_NEW(c, units, nunits, capunits, c->unit_free, Unit, chunks);
        c->units[u] = (Unit){c->clock++, ci, NIL, NIL, NIL, 0, 0, U_ALIVE};
        c->chunks[ci].unit = u;
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
    ch->ns = ns; ch->world = world; ch->next = NIL; ch->lease = NIL; ch->unit = NIL; /* linked next */
    ch->keylen = (uint8_t)len; ch->alive = 1;
    ch->keyref = key_store(c, key, len);
    if (world > 1) {
        uint32_t base;
        if (world <= MAX_POOLED_WORLD && c->shard_free[world] != NIL) {
            base = c->shard_free[world]; c->shard_free[world] = (uint32_t)c->shards[base].nbytes;
        } else {
            if ((size_t)c->nshards + world > NIL) Py_FatalError("tierstore compact index: shard pool full");
            c->shards = grow(c->shards, &c->capshards, c->nshards + world, sizeof(Shard));
            base = (uint32_t)c->nshards; c->nshards += world;
        }
        ch->sh.run = base;
        memset(&c->shards[base], 0, world * sizeof(Shard));
    }
    c->live_chunks++;
    tab_insert(c, &c->ctab, T_CHUNK, h, ci);
    return ci;
}

/* The shard offered as ``o`` held on ``node`` in ``tier``: a new shard of chunk ``ci``
 * (NIL: a new chunk, made here). Returns its unit; its chunk in ``chunk_out``. */
INTERNAL uint32_t add_shard(Core *c, uint32_t ci, uint32_t node, const Offer *o, int tier, int queue,
                            uint32_t *chunk_out) {
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
    gain_q(c, u, s, tier, queue);
    if (c->chunks[ci].present == c->chunks[ci].world) c->counts[C_STORED]++;
    *chunk_out = ci;
    return u;
}

/* ---- replicas (index_replicas.py) ------------------------------------------------- */
/* The slot of chunk ``ci`` in the replica heads' table (its key NIL: not there). */
static size_t rslot(const Core *c, uint32_t ci) {
    size_t i = (size_t)mix64(ci) & c->rmask;
    while (c->rkeys[i] != NIL && c->rkeys[i] != ci) i = (i + 1) & c->rmask;
    return i;
}
/* Chunk ``ci``'s first replica, else NIL. */
INTERNAL uint32_t replicas_of(Core *c, uint32_t ci) {
    return c->chunks[ci].has_replicas ? c->rheads[rslot(c, ci)] : NIL;
}
/* Chunk ``ci``'s first replica is now ``r`` (NIL: it has none). */
static void set_replicas(Core *c, uint32_t ci, uint32_t r) {
    if (r != NIL && !c->chunks[ci].has_replicas && (c->rcount + 1) * 2 > c->rmask + 1) { /* grow */
        size_t old = c->rkeys ? c->rmask + 1 : 0, size = old ? 2 * old : 64;
        uint32_t *keys = c->rkeys, *heads = c->rheads;
        c->rkeys = PyMem_RawMalloc(size * sizeof(uint32_t));
        c->rheads = PyMem_RawMalloc(size * sizeof(uint32_t));
        if (!c->rkeys || !c->rheads) Py_FatalError("tierstore compact index: out of memory");
        memset(c->rkeys, 0xff, size * sizeof(uint32_t));
        c->rmask = size - 1;
        for (size_t i = 0; i < old; i++)
            if (keys[i] != NIL) { size_t j = rslot(c, keys[i]); c->rkeys[j] = keys[i]; c->rheads[j] = heads[i]; }
        PyMem_RawFree(keys); PyMem_RawFree(heads);
    }
    if (r != NIL) {
        size_t i = rslot(c, ci);
        if (c->rkeys[i] == NIL) { c->rkeys[i] = ci; c->rcount++; }
        c->rheads[i] = r;
        c->chunks[ci].has_replicas = 1;
        return;
    }
    if (!c->chunks[ci].has_replicas) return;
    c->chunks[ci].has_replicas = 0;
    size_t i = rslot(c, ci), j = i; /* deletion by backward shift */
    for (;;) {
        j = (j + 1) & c->rmask;
        if (c->rkeys[j] == NIL) break;
        size_t k = (size_t)mix64(c->rkeys[j]) & c->rmask;
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) { c->rkeys[i] = c->rkeys[j]; c->rheads[i] = c->rheads[j]; i = j; }
    }
    c->rkeys[i] = NIL;
    c->rcount--;
}
/* ``node``'s replica of chunk ``ci``, else NIL. */
INTERNAL uint32_t replica_on(Core *c, uint32_t ci, uint32_t node) {
    for (uint32_t r = replicas_of(c, ci); r != NIL; r = c->replicas[r].cnext)
        if (c->replicas[r].node == node) return r;
    return NIL;
}
INTERNAL int replica_ready(Core *c, uint32_t r) {
    return c->replicas[r].landed == c->chunks[c->replicas[r].chunk].world;
}
/* ``node`` holds a shard of chunk ``ci``, or a replica of it (complete or not). */
INTERNAL int holds(Core *c, uint32_t ci, uint32_t node) {
    if (replica_on(c, ci, node) != NIL) return 1;
    Chunk *ch = &c->chunks[ci];
    for (uint32_t k = 0; k < ch->world; k++) {
        Shard *s = SHARD(c, ch, k);
        if ((s->flags & S_HELD) && s->node == node) return 1;
    }
    return 0;
}
static void lru_unlink(Core *c, uint32_t r) {
    Replica *rp = &c->replicas[r];
    Node *n = &c->nodes[rp->node];
    if (rp->lprev != NIL) c->replicas[rp->lprev].lnext = rp->lnext; else n->rhead = rp->lnext;
    if (rp->lnext != NIL) c->replicas[rp->lnext].lprev = rp->lprev; else n->rtail = rp->lprev;
}
static void lru_append(Core *c, uint32_t r) {
    Replica *rp = &c->replicas[r];
    Node *n = &c->nodes[rp->node];
    rp->lnext = NIL; rp->lprev = n->rtail;
    if (n->rtail != NIL) c->replicas[n->rtail].lnext = r; else n->rhead = r;
    n->rtail = r;
}
/* Replica ``r`` out of its chunk's list, its node's list and its pool. */
static void free_replica(Core *c, uint32_t r) {
    uint32_t ci = c->replicas[r].chunk, head = replicas_of(c, ci);
    if (head == r) {
        set_replicas(c, ci, c->replicas[r].cnext);
    } else {
        uint32_t prev = head;
        while (c->replicas[prev].cnext != r) prev = c->replicas[prev].cnext;
        c->replicas[prev].cnext = c->replicas[r].cnext;
    }
    lru_unlink(c, r);
    c->replicas[r].cnext = c->replica_free; c->replica_free = r;
}
/* A replica HIT: its node's most recently used. */
INTERNAL void touch_replica(Core *c, uint32_t r) { lru_unlink(c, r); lru_append(c, r); }
/* Make ``node``'s replica of complete chunk ``ci`` (not held there): room reserved below
 * the low watermark, each holder asked to push its shard. 0: not made (a promotion under
 * way, or no room; a replica never evicts anything). */
INTERNAL int start_replica(Core *c, uint32_t ci, uint32_t node) {
    Chunk *ch = &c->chunks[ci];
    uint64_t nbytes = 0;
    for (uint32_t k = 0; k < ch->world; k++) {
        Shard *s = SHARD(c, ch, k);
        if (!(s->flags & S_HELD)) continue;
        if (s->flags & S_PROMOTING) return 0; /* asked again on a later load */
        nbytes += s->nbytes;
    }
    Node *n = &c->nodes[node];
    if ((double)(n->used[CPU] + (int64_t)nbytes) > c->low * (double)n->cap[CPU]) return 0;
    uint32_t r = POOL_NEW(c, replicas, nreplicas, capreplicas, c->replica_free, Replica, cnext);
    c->replicas[r] = (Replica){ci, node, 0, NIL, NIL, NIL};
    uint32_t last = replicas_of(c, ci);
    if (last == NIL) {
        set_replicas(c, ci, r);
    } else {
        while (c->replicas[last].cnext != NIL) last = c->replicas[last].cnext;
        c->replicas[last].cnext = r;
    }
    lru_append(c, r);
    ch = &c->chunks[ci];
    for (uint32_t k = 0; k < ch->world; k++) {
        Shard *s = SHARD(c, ch, k);
        if (!(s->flags & S_HELD)) continue;
        account(c, node, CPU, s->nbytes, +1);
        emit_push(c, s->node, ci, k, node);
    }
    return 1;
}
/* Drop replica ``r``: its room freed, its node told to drop what landed. */
INTERNAL void drop_replica(Core *c, uint32_t r) {
    uint32_t ci = c->replicas[r].chunk, node = c->replicas[r].node;
    free_replica(c, r);
    Chunk *ch = &c->chunks[ci];
    for (uint32_t k = 0; k < ch->world; k++) {
        Shard *s = SHARD(c, ch, k);
        if (!(s->flags & S_HELD)) continue;
        account(c, node, CPU, s->nbytes, -1);
        emit(c, A_DROP, node, ci, k);
    }
}
/* ``node`` left: its replicas are forgotten (nothing to drop there, no room to free). */
INTERNAL void forget_replicas_on(Core *c, uint32_t node) {
    while (c->nodes[node].rhead != NIL) free_replica(c, c->nodes[node].rhead);
}
typedef struct Done Done;
static int is_done(Core *c, const Done *d);
/* Drop ``node``'s replicas, least recently used first, until ``d``; those being copied or
 * leased stay. */
static int evict_replicas(Core *c, uint32_t node, const Done *d, double now) {
    for (uint32_t r = c->nodes[node].rhead; r != NIL;) {
        if (is_done(c, d)) return 1;
        uint32_t next = c->replicas[r].lnext;
        if (replica_ready(c, r) && !is_leased(c, c->replicas[r].chunk, now)) drop_replica(c, r);
        r = next;
    }
    return is_done(c, d);
}
/* Every rank of chunk ``ci`` (of unit ``u``) is now held by its replica ``r``: in memory,
 * written through to disk where there is room; the other copies are dropped. */
static void adopt_replica(Core *c, uint32_t u, uint32_t ci, uint32_t r) {
    uint32_t target = c->replicas[r].node;
    free_replica(c, r);
    Chunk *ch = &c->chunks[ci];
    for (uint32_t k = 0; k < ch->world; k++) {
        Shard *s = SHARD(c, ch, k);
        if (!(s->flags & S_HELD)) continue;
        lose(c, u, s, DISK); /* disk first, as the reference */
        lose(c, u, s, CPU);
        if (s->node < c->nnodes && c->nodes[s->node].registered && s->node != target) emit(c, A_DROP, s->node, ci, k);
        account(c, target, CPU, s->nbytes, -1); /* the replica's share... */
        *s = (Shard){s->nbytes, target, S_HELD};
        gain(c, u, s, CPU); /* ...is now the chunk's own */
        if (fits(c, target, DISK, s->nbytes)) {
            gain(c, u, s, DISK);
            emit(c, A_PERSIST, target, ci, k);
        }
    }
}
/* Keep unit ``u`` if each of its chunks held on ``lost`` has a complete replica elsewhere
 * (the first made): it becomes the chunk's own copy. 0: the unit must go. */
INTERNAL int rescue(Core *c, uint32_t u, uint32_t lost) {
    for (int apply = 0; apply < 2; apply++) {
        for (uint32_t ci = c->units[u].chunks; ci != NIL; ci = c->chunks[ci].next) {
            Chunk *ch = &c->chunks[ci];
            int on_lost = 0;
            for (uint32_t k = 0; k < ch->world; k++) {
                Shard *s = SHARD(c, ch, k);
                if ((s->flags & S_HELD) && s->node == lost) on_lost = 1;
            }
            if (!on_lost) continue;
            uint32_t r = replicas_of(c, ci);
            while (r != NIL && !replica_ready(c, r)) r = c->replicas[r].cnext;
            if (r == NIL) return 0; /* only in the first pass: the plan is checked whole */
            if (apply) adopt_replica(c, u, ci, r);
        }
    }
    return 1;
}

/* ---- making room ------------------------------------------------------------------ */
struct Done { int watermark; uint32_t node; int tier; uint64_t nbytes; double target; };
static int is_done(Core *c, const Done *d) {
    Node *n = &c->nodes[d->node];
    if (d->watermark) return (double)n->used[CPU] <= d->target;
    return n->used[d->tier] + (int64_t)d->nbytes <= n->cap[d->tier];
}
enum { F_CPU, F_DEMOTE, F_DROP };


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
INTERNAL int make_disk_room(Core *c, uint32_t node, uint64_t nbytes, const Prot *p, double now) {
    if (fits(c, node, DISK, nbytes)) return 1;
    return make_room(c, node, DISK, nbytes, p, now, F_DROP, p);
}
INTERNAL int make_cpu_room(Core *c, uint32_t node, uint64_t nbytes, const Prot *p, double now) {
    if (fits(c, node, CPU, nbytes)) return 1;
    Done d = {0, node, CPU, nbytes, 0.0};
    if (evict_replicas(c, node, &d, now)) return 1; /* replicas go first */
    return make_room(c, node, CPU, nbytes, p, now, F_CPU, p);
}
/* A store's last resort: demote even protected units (never the offer's own unit). */
INTERNAL int demote_for_store(Core *c, uint32_t node, uint64_t nbytes, uint32_t own, const Prot *p, double now) {
    if (c->nodes[node].cap[DISK] == 0) return 0;
    Prot w = {0, own};
    return make_room(c, node, CPU, nbytes, &w, now, F_DEMOTE, p);
}
INTERNAL void demote_to_watermark(Core *c, uint32_t node, const Prot *p, double now) {
    Node *n = &c->nodes[node];
    if (n->cap[DISK] == 0) return;
    if ((double)n->used[CPU] <= c->high * (double)n->cap[CPU]) return;
    Done d = {1, node, CPU, 0, c->low * (double)n->cap[CPU]};
    if (evict_replicas(c, node, &d, now)) return;
    walk(c, node, CPU, p, now, &d, F_DEMOTE, p);
}


/* ---- promotion ---------------------------------------------------------------- */
INTERNAL int promote(Core *c, uint32_t u, uint32_t ci, const Prot *p, double now) {
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

