/* The compact index's Python type, tierstore.control._compact_index.Core: parses each
 * call's arguments (ShardOffers, ShardIds, keys), runs the decisions of compact_core.c,
 * and builds the answers and actions CompactChunkIndex (compact_index.py) hands out. */
#include "compact_index.h"

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
/* A namespace's id (made on first sight): at most MAX_NAMESPACES of them. */
static long ns_of(Core *c, PyObject *name, int create) {
    if (create && (size_t)PyList_GET_SIZE(c->ns_list) >= MAX_NAMESPACES) {
        long n = intern(c->ns_ids, c->ns_list, name, 0);
        if (n == -1 && !PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "the compact index names at most 2**24 namespaces");
        return n < 0 ? -2 : n;
    }
    return intern(c->ns_ids, c->ns_list, name, create);
}
/* A lease holder's id (``create``: a new one if unknown). A new id has no lease yet: it
 * is queued for the sweep, which frees it unless the call leases something to it. */
static long holder_of(Core *c, PyObject *name, int create) {
    PyObject *v = PyDict_GetItemWithError(c->holder_ids, name);
    if (v) return PyLong_AsLong(v);
    if (PyErr_Occurred() || !create) return PyErr_Occurred() ? -2 : -1;
    size_t id;
    if (c->nholder_free) {
        id = c->holder_free[--c->nholder_free];
        Py_INCREF(name);
        PyList_SetItem(c->holder_list, (Py_ssize_t)id, name);
    } else {
        id = (size_t)PyList_GET_SIZE(c->holder_list);
        if (PyList_Append(c->holder_list, name) < 0) return -2;
    }
    PyObject *key = PyLong_FromSize_t(id);
    if (!key || PyDict_SetItem(c->holder_ids, name, key) < 0) { Py_XDECREF(key); return -2; }
    Py_DECREF(key);
    c->holder_refs = grow(c->holder_refs, &c->capholder_refs, id + 1, sizeof(uint32_t));
    c->holder_refs[id] = 0;
    c->zero_holders = grow(c->zero_holders, &c->capzero, c->nzero + 1, sizeof(uint32_t));
    c->zero_holders[c->nzero++] = (uint32_t)id;
    return (long)id;
}
/* The end of a call: free the ids of holders left without a lease. */
static void sweep_holders(Core *c) {
    for (size_t i = 0; i < c->nzero; i++) {
        uint32_t id = c->zero_holders[i];
        PyObject *name = PyList_GET_ITEM(c->holder_list, id);
        if (c->holder_refs[id] || name == Py_None) continue;
        if (PyDict_DelItem(c->holder_ids, name) < 0) PyErr_Clear();
        Py_INCREF(Py_None);
        PyList_SetItem(c->holder_list, id, Py_None);
        c->holder_free = grow(c->holder_free, &c->capholder_free, c->nholder_free + 1, sizeof(uint32_t));
        c->holder_free[c->nholder_free++] = id;
    }
    c->nzero = 0;
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
        for (size_t i = c->nnodes; i < cap; i++) c->nodes[i].rhead = c->nodes[i].rtail = NIL;
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
    long ns = ns_of(c, PyTuple_GET_ITEM(o, 0), 1);
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
    of->valid = !overflow && !overflow2 && of->rank >= 0 && of->rank < of->world && of->world <= MAX_WORLD;
    PyObject *parent = PyTuple_GET_SIZE(o) > 5 ? PyTuple_GET_ITEM(o, 5) : Py_None;
    of->parent = NULL; of->plen = 0; of->phash = 0;
    if (parent != Py_None) {
        if (as_bytes(parent, &of->parent, &of->plen) < 0) return -1;
        of->phash = hash_bytes(of->parent, boundary_len(of->plen), of->ns);
    }
    of->hash = key_hash(of->key, of->len, of->ns);
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
    long ns = ns_of(c, PyTuple_GET_ITEM(o, 0), 1);
    const uint8_t *key; size_t len;
    if (ns < 0 || as_bytes(PyTuple_GET_ITEM(o, 1), &key, &len) < 0) return -1;
    int overflow = 0;
    *rank = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(o, 2), &overflow);
    if (PyErr_Occurred()) return -1;
    *ci = overflow ? NIL : held_chunk(c, (uint32_t)ns, key, len, key_hash(key, len, (uint32_t)ns), *rank);
    return 0;
}
static uint32_t unit_of_key(Core *c, PyObject *ns_obj, PyObject *key_obj) {
    long ns = ns_of(c, ns_obj, 1);
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
static PyObject *finish(Core *c) {
    PyObject *a = c->actions;
    c->actions = NULL;
    unprotect(c);
    sweep_holders(c);
    return a;
}
static void abort_call(Core *c) { Py_CLEAR(c->actions); unprotect(c); sweep_holders(c); }

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

/* An offer's chunk if it is new (valid, rank not held, not earlier in the group):
 * ``*fresh`` set; the chunk (or NIL) in ``*existing``. */
static int new_offer(Core *c, Offer *of, Py_ssize_t i, uint32_t *existing) {
    Offer *o = &of[i];
    *existing = NIL;
    for (Py_ssize_t j = 0; j < i; j++)
        if (of[j].rank == o->rank && of[j].len == o->len && !memcmp(of[j].key, o->key, o->len)) return 0;
    if (!o->valid) return 0;
    *existing = find_chunk(c, o->ns, o->key, o->len, o->hash);
    return *existing == NIL || (o->rank < c->chunks[*existing].world &&
                                !(SHARD(c, &c->chunks[*existing], o->rank)->flags & S_HELD));
}

/* One admission decision (ChunkIndex._admit_unit): which of the ``n`` offers ``of`` (a
 * unit's shards, or one shard) ``node`` keeps. Room is made once for the new ones, CPU
 * then disk (write-through); they are all kept or all refused. */
static void admit_group(Core *c, uint32_t node, Offer *of, Py_ssize_t n, const Prot *p, double now,
                        uint32_t *existing, char *keep) {
    c->counts[C_ADMITTED_UNITS]++;
    uint64_t nbytes = 0;
    long fresh = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        keep[i] = (char)new_offer(c, of, i, &existing[i]);
        if (keep[i]) { nbytes += of[i].nbytes; fresh++; }
    }
    if (!fresh) return;
    const Offer *first = &of[0];
    uint32_t own = find_unit(c, first->ns, first->key, boundary_len(first->len), first->hash);
    if (!make_cpu_room(c, node, nbytes, p, now) && !demote_for_store(c, node, nbytes, own, p, now)) {
        c->counts[C_SKIPPED] += fresh;
        memset(keep, 0, (size_t)n);
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* the chunks found still stand: their units are protected */
        if (!keep[i]) continue;
        uint32_t ci = existing[i] != NIL ? existing[i] : find_chunk(c, of[i].ns, of[i].key, of[i].len, of[i].hash);
        add_shard(c, ci, node, &of[i], CPU, 0, &existing[i]);
    }
    own = find_unit(c, first->ns, first->key, boundary_len(first->len), first->hash);
    if (own != NIL) push(c, own, node, CPU); /* once for the unit, not per shard */
    if (!make_disk_room(c, node, nbytes, p, now)) return;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!keep[i]) continue;
        uint32_t ci = existing[i];
        gain_q(c, c->chunks[ci].unit, SHARD(c, &c->chunks[ci], of[i].rank), DISK, 0);
        emit(c, A_PERSIST, node, ci, (uint32_t)of[i].rank);
    }
    if (own != NIL) push(c, own, node, DISK);
}

/* admit(node, offers, sizes, now): ``sizes`` None, one decision per offer (admit); else
 * one per run of ``sizes[k]`` offers (admit_units). Returns (accepted per offer, actions,
 * invalid offers). */
static PyObject *Core_admit(Core *c, PyObject *args) {
    PyObject *name, *offers, *sizes; double now;
    if (!PyArg_ParseTuple(args, "OO!Od", &name, &PyList_Type, &offers, &sizes, &now)) return NULL;
    long node = node_of(c, name, 0);
    if (node < 0 || !c->nodes[node].registered) { if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, name); return NULL; }
    if (sizes != Py_None && !PyList_Check(sizes)) { PyErr_SetString(PyExc_TypeError, "sizes: a list or None"); return NULL; }
    Py_ssize_t n = PyList_GET_SIZE(offers);
    Offer *of = PyMem_RawMalloc((n + 1) * sizeof(Offer));
    uint64_t *hs = PyMem_RawMalloc((2 * n + 1) * sizeof(uint64_t));
    uint32_t *existing = PyMem_RawMalloc((n + 1) * sizeof(uint32_t));
    char *keep = PyMem_RawMalloc(n + 1);
    PyObject *accepted = PyList_New(n);
    if (!of || !hs || !existing || !keep || !accepted || !begin(c)) goto fail;
    c->counts[C_ADMIT_CALLS]++;
    size_t nh = 0;
    long invalid = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_offer(c, PyList_GET_ITEM(offers, i), &of[i]) < 0) goto fail;
        invalid += !of[i].valid;
        hs[nh++] = of[i].hash;
        want_protected(c, of[i].ns, of[i].key, boundary_len(of[i].len), of[i].hash);
        if (of[i].parent) {
            hs[nh++] = of[i].phash;
            want_protected(c, of[i].ns, of[i].parent, boundary_len(of[i].plen), of[i].phash);
        }
    }
    Prot p = protect(c, hs, nh);
    Py_ssize_t groups = sizes == Py_None ? n : PyList_GET_SIZE(sizes), at = 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        Py_ssize_t size = sizes == Py_None ? 1 : PyLong_AsSsize_t(PyList_GET_ITEM(sizes, g));
        if (size < 0 || at + size > n) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "sizes do not add up to the offers");
            goto fail;
        }
        admit_group(c, (uint32_t)node, of + at, size, &p, now, existing + at, keep + at);
        at += size;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *verdict = i < at && keep[i] ? Py_True : Py_False;
        Py_INCREF(verdict);
        PyList_SET_ITEM(accepted, i, verdict);
    }
    demote_to_watermark(c, node, &p, now);
    PyMem_RawFree(of); PyMem_RawFree(hs); PyMem_RawFree(existing); PyMem_RawFree(keep);
    return Py_BuildValue("(NNl)", accepted, finish(c), invalid);
fail:
    PyMem_RawFree(of); PyMem_RawFree(hs); PyMem_RawFree(existing); PyMem_RawFree(keep);
    Py_XDECREF(accepted); abort_call(c);
    return NULL;
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

/* A HIT from ``node``'s complete replica of chunk ``ci``: every rank there. */
static PyObject *replica_answer(Core *c, uint32_t ci, uint32_t node) {
    c->counts[C_HITS]++;
    PyObject *where = PyDict_New();
    for (uint32_t r = 0; where && r < c->chunks[ci].world; r++) {
        PyObject *rank = PyLong_FromUnsignedLong(r);
        if (!rank || PyDict_SetItem(where, rank, PyList_GET_ITEM(c->node_list, node)) < 0) Py_CLEAR(where);
        Py_XDECREF(rank);
    }
    PyObject *items = where ? PyTuple_Pack(3, c->hit, where, Py_None) : NULL;
    Py_XDECREF(where);
    if (!items) return NULL;
    PyObject *a = make_tuple_of(c->answer_t, items);
    Py_DECREF(items);
    return a;
}

/* Whether every rank of chunk ``ci`` is held on node ``node``. */
static int all_on(Core *c, uint32_t ci, uint32_t node) {
    for (uint32_t r = 0; r < c->chunks[ci].world; r++)
        if (SHARD(c, &c->chunks[ci], r)->node != node) return 0;
    return 1;
}

/* lookup(namespace, keys, holder, now, ttl, node): node None, or the asking engine's
 * (then its HITs are counted by place: every rank on that node, or some elsewhere). */
static PyObject *Core_lookup(Core *c, PyObject *args) {
    PyObject *ns_obj, *keys, *holder, *node_obj; double now, ttl;
    if (!PyArg_ParseTuple(args, "OO!OddO", &ns_obj, &PyList_Type, &keys, &holder, &now, &ttl, &node_obj)) return NULL;
    long ns = ns_of(c, ns_obj, 1);
    long hid = holder_of(c, holder, 1);
    long asking = node_obj == Py_None ? -1 : node_of(c, node_obj, 0); /* -1: not known */
    int placed = node_obj != Py_None;
    if (ns < 0 || hid < 0 || PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    uint64_t *hs = PyMem_RawMalloc((n + 1) * sizeof(uint64_t)); /* the keys' (their boundaries') */
    PyObject *answers = PyList_New(n);
    if (!hs || !answers || !begin(c)) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *key; size_t len;
        if (as_bytes(PyList_GET_ITEM(keys, i), &key, &len) < 0) goto fail;
        hs[i] = key_hash(key, len, (uint32_t)ns);
        want_protected(c, (uint32_t)ns, key, boundary_len(len), hs[i]);
        prefetch_slot(&c->ctab, hs[i]); /* the batch's probes overlap their misses */
    }
    Prot p = protect(c, hs, (size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        const uint8_t *key = (const uint8_t *)PyBytes_AS_STRING(k);
        size_t len = (size_t)PyBytes_GET_SIZE(k);
        uint32_t ci = find_chunk(c, (uint32_t)ns, key, len, hs[i]);
        PyObject *a;
        if (ci == NIL || c->chunks[ci].present != c->chunks[ci].world) {
            c->counts[C_MISSES]++;
            a = c->miss_answer; Py_INCREF(a);
        } else {
            uint32_t u = c->chunks[ci].unit;
            lease(c, ci, (uint32_t)hid, now, now + ttl);
            c->units[u].rank = c->clock++; /* touched: the LRU's newest */
            uint32_t r = asking >= 0 ? replica_on(c, ci, (uint32_t)asking) : NIL;
            if (r != NIL && replica_ready(c, r)) {
                touch_replica(c, r);
                a = replica_answer(c, ci, (uint32_t)asking);
                if (a) c->counts[C_HITS_SAME_NODE]++;
            } else {
                a = answer(c, u, ci, &p, now);
                if (a && a != c->pending_answer && placed)
                    c->counts[asking >= 0 && all_on(c, ci, (uint32_t)asking) ? C_HITS_SAME_NODE : C_HITS_OTHER_NODE]++;
            }
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
    long ns = ns_of(c, ns_obj, 1);
    long hid = holder_of(c, holder, 1);
    if (ns < 0 || hid < 0) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        const uint8_t *key; size_t len;
        if (as_bytes(PyList_GET_ITEM(keys, i), &key, &len) < 0) return NULL;
        uint32_t ci = find_chunk(c, (uint32_t)ns, key, len, key_hash(key, len, (uint32_t)ns));
        if (ci != NIL) lease(c, ci, (uint32_t)hid, now, now + ttl);
    }
    sweep_holders(c);
    Py_RETURN_NONE;
}

static PyObject *Core_release(Core *c, PyObject *args) {
    PyObject *ns_obj, *keys, *holder;
    if (!PyArg_ParseTuple(args, "OO!O", &ns_obj, &PyList_Type, &keys, &holder)) return NULL;
    long ns = ns_of(c, ns_obj, 1);
    long hid = holder_of(c, holder, 0);
    if (ns < 0 || hid == -2 || PyErr_Occurred()) return NULL;
    if (hid < 0) Py_RETURN_NONE; /* a holder never seen holds nothing */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        const uint8_t *key; size_t len;
        if (as_bytes(PyList_GET_ITEM(keys, i), &key, &len) < 0) return NULL;
        uint32_t ci = find_chunk(c, (uint32_t)ns, key, len, key_hash(key, len, (uint32_t)ns));
        if (ci != NIL) release_one(c, ci, (uint32_t)hid);
    }
    sweep_holders(c);
    Py_RETURN_NONE;
}

static PyObject *Core_release_holder(Core *c, PyObject *holder) {
    long hid = holder_of(c, holder, 0);
    if (hid == -2 || PyErr_Occurred()) return NULL;
    if (hid < 0) Py_RETURN_NONE;
    for (size_t ci = 0; ci < c->nchunks; ci++)
        if (c->chunks[ci].alive && c->chunks[ci].lease != NIL) release_one(c, (uint32_t)ci, (uint32_t)hid);
    sweep_holders(c);
    Py_RETURN_NONE;
}

static PyObject *Core_is_leased(Core *c, PyObject *args) {
    PyObject *ns_obj, *key_obj; double now;
    if (!PyArg_ParseTuple(args, "OOd", &ns_obj, &key_obj, &now)) return NULL;
    long ns = ns_of(c, ns_obj, 1);
    const uint8_t *key; size_t len;
    if (ns < 0 || as_bytes(key_obj, &key, &len) < 0) return NULL;
    uint32_t ci = find_chunk(c, (uint32_t)ns, key, len, key_hash(key, len, (uint32_t)ns));
    int leased = ci != NIL && is_leased(c, ci, now);
    sweep_holders(c);
    return PyBool_FromLong(leased);
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

/* ChunkIndex.resize_node: new capacities (a parked disk capacity stays parked), then
 * room made down to them as a store makes it (CPU first, then disk). */
static PyObject *Core_resize_node(Core *c, PyObject *args) {
    PyObject *name; long long cpu, disk; double now;
    if (!PyArg_ParseTuple(args, "OLLd", &name, &cpu, &disk, &now)) return NULL;
    if (cpu < 0 || disk < 0) { PyErr_SetString(PyExc_ValueError, "capacities: expected >= 0"); return NULL; }
    long node = node_of(c, name, 0);
    if (node < 0 || !c->nodes[node].registered) { if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, name); return NULL; }
    if (!begin(c)) return NULL;
    Node *nd = &c->nodes[node];
    nd->cap[CPU] = cpu;
    if (nd->has_parked) nd->parked_cap = disk; else nd->cap[DISK] = disk;
    Prot p = {0, NIL}; /* nothing protected: no store in this call */
    make_cpu_room(c, (uint32_t)node, 0, &p, now);
    make_disk_room(c, (uint32_t)node, 0, &p, now);
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
    PyObject *sid = shard_id(c, o->ns, o->key, o->len, (uint32_t)o->rank);
    fatal_if(!sid || PyList_Append(action_list(c, kind, node), sid) < 0);
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
        add_shard(c, existing, node, o, tier, 1, &nci);
        if (tier == DISK) SHARD(c, &c->chunks[nci], o->rank)->flags |= S_UNVERIFIED;
        if (grace > 0) lease(c, nci, grace_holder, now, now + grace);
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
    long gh = holder_of(c, grace_name, 1);
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

/* UnitId order (namespace, then boundary bytes), as ChunkIndex.forget_node's sorted(). */
static Core *sort_core; /* qsort has no context argument; calls hold the GIL */
static int unit_order(const void *a, const void *b) {
    Core *c = sort_core;
    uint32_t ua = *(const uint32_t *)a, ub = *(const uint32_t *)b;
    uint32_t na = unit_ns(c, ua), nb = unit_ns(c, ub);
    if (na != nb) { /* namespaces are str; others (never sent) in the order first seen */
        int lt = PyObject_RichCompareBool(PyList_GET_ITEM(c->ns_list, na), PyList_GET_ITEM(c->ns_list, nb), Py_LT);
        if (lt < 0) { PyErr_Clear(); return na < nb ? -1 : 1; }
        return lt ? -1 : 1;
    }
    Chunk *ca = &c->chunks[c->units[ua].chunks], *cb = &c->chunks[c->units[ub].chunks];
    size_t la = boundary_len(ca->keylen), lb = boundary_len(cb->keylen);
    int cmp = memcmp(chunk_key(c, ca), chunk_key(c, cb), la < lb ? la : lb);
    return cmp ? cmp : (la > lb) - (la < lb);
}

/* A node left: its replicas go; each unit it held is rescued by replicas elsewhere (in
 * UnitId order: a rescue writes through to disk while there is room) or dropped
 * everywhere. A unit without a replica cannot be rescued and changes nothing by trying,
 * so only units with one are sorted. The node's own actions are discarded, so never made. */
static PyObject *Core_forget_node(Core *c, PyObject *name) {
    long node = node_of(c, name, 0);
    if (PyErr_Occurred() || !begin(c)) return NULL;
    if (node < 0) return finish(c);
    for (int t = CPU; t <= DISK; t++) c->nodes[node].heap[t].n = 0;
    forget_replicas_on(c, (uint32_t)node);
    c->mute = (uint32_t)node;
    uint32_t *held = NULL, *rescuable = NULL; /* units held there: without a replica, with one */
    size_t nheld = 0, capheld = 0, nres = 0, capres = 0;
    for (size_t ci = 0; ci < c->nchunks; ci++) { /* in memory order: one pass, no random reads */
        Chunk *ch = &c->chunks[ci];
        if (!ch->alive) continue;
        int here = 0;
        for (uint32_t r = 0; !here && r < ch->world; r++) {
            Shard *s = SHARD(c, ch, r);
            here = (s->flags & S_HELD) && s->node == (uint32_t)node;
        }
        uint32_t u = ch->unit;
        if (!here || (c->units[u].flags & U_SEEN)) continue;
        c->units[u].flags |= U_SEEN;
        int replicated = 0;
        for (uint32_t k = c->units[u].chunks; !replicated && k != NIL; k = c->chunks[k].next)
            replicated = c->chunks[k].has_replicas;
        if (replicated) {
            rescuable = grow(rescuable, &capres, nres + 1, sizeof(uint32_t));
            rescuable[nres++] = u;
        } else {
            held = grow(held, &capheld, nheld + 1, sizeof(uint32_t));
            held[nheld++] = u;
        }
    }
    for (size_t i = 0; i < nheld; i++) c->units[held[i]].flags &= ~U_SEEN;
    for (size_t i = 0; i < nres; i++) c->units[rescuable[i]].flags &= ~U_SEEN;
    sort_core = c;
    if (nres) qsort(rescuable, nres, sizeof(uint32_t), unit_order);
    for (size_t i = 0; i < nres; i++)
        if (!rescue(c, rescuable[i], (uint32_t)node)) {
            held = grow(held, &capheld, nheld + 1, sizeof(uint32_t));
            held[nheld++] = rescuable[i];
        }
    for (size_t i = 0; i < nheld; i++) c->units[held[i]].flags |= U_DYING; /* not queued as they go */
    for (size_t i = 0; i < nheld; i++) drop_unit(c, held[i]);
    c->mute = NIL;
    PyMem_RawFree(held);
    PyMem_RawFree(rescuable);
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

/* One node's entry of Core_nodes, or None (not registered). */
static PyObject *Core_node(Core *c, PyObject *name) {
    long n = node_of(c, name, 0);
    if (PyErr_Occurred()) return NULL;
    if (n < 0 || !c->nodes[n].registered) Py_RETURN_NONE;
    Node *nd = &c->nodes[n];
    return Py_BuildValue("{O(LLL)O(LLL)}", c->tier_obj[CPU], nd->used[CPU], nd->cap[CPU], nd->shards[CPU],
                         c->tier_obj[DISK], nd->used[DISK], nd->cap[DISK], nd->shards[DISK]);
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
    for (uint32_t rp = c->nodes[node].rhead; rp != NIL; rp = c->replicas[rp].lnext) { /* complete replicas */
        if (!replica_ready(c, rp)) continue;
        Chunk *ch = &c->chunks[c->replicas[rp].chunk];
        for (uint32_t r = 0; r < ch->world; r++) {
            if (!(SHARD(c, ch, r)->flags & S_HELD)) continue;
            PyObject *sid = shard_id(c, ch->ns, chunk_key(c, ch), ch->keylen, r);
            PyObject *pair = sid ? PyTuple_Pack(2, sid, c->tier_obj[CPU]) : NULL;
            Py_XDECREF(sid);
            if (!pair || PyList_Append(out, pair) < 0) { Py_XDECREF(pair); Py_DECREF(out); return NULL; }
            Py_DECREF(pair);
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

/* Per key, a node other than ``avoid`` holding ``rank``'s shard: its holder if that is
 * another node (and not promoting it), else the first complete replica elsewhere. */
static PyObject *Core_locate(Core *c, PyObject *args) {
    PyObject *ns_obj, *keys, *avoid; long long rank;
    if (!PyArg_ParseTuple(args, "OO!LO", &ns_obj, &PyList_Type, &keys, &rank, &avoid)) return NULL;
    long ns = ns_of(c, ns_obj, 1);
    long av = node_of(c, avoid, 0);
    if (ns < 0 || PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(PyList_GET_SIZE(keys));
    for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(keys); i++) {
        const uint8_t *key; size_t len;
        if (as_bytes(PyList_GET_ITEM(keys, i), &key, &len) < 0) { Py_DECREF(out); return NULL; }
        uint32_t ci = find_chunk(c, (uint32_t)ns, key, len, key_hash(key, len, (uint32_t)ns));
        long found = -1;
        if (ci != NIL && rank >= 0 && rank < (long long)c->chunks[ci].world) {
            Shard *s = SHARD(c, &c->chunks[ci], rank);
            if ((s->flags & S_HELD) && (long)s->node != av && !(s->flags & S_PROMOTING)) found = (long)s->node;
            for (uint32_t r = replicas_of(c, ci); found < 0 && r != NIL; r = c->replicas[r].cnext)
                if ((long)c->replicas[r].node != av && replica_ready(c, r)) found = (long)c->replicas[r].node;
        }
        PyObject *o = found >= 0 ? PyList_GET_ITEM(c->node_list, found) : Py_None;
        Py_INCREF(o);
        PyList_SET_ITEM(out, i, o);
    }
    return out;
}

/* The chunk a key argument names (``nsk``: (namespace, key)), else NIL. */
static uint32_t chunk_of(Core *c, PyObject *ns_obj, PyObject *key_obj) {
    long ns = ns_of(c, ns_obj, 1);
    const uint8_t *key; size_t len;
    if (ns < 0 || as_bytes(key_obj, &key, &len) < 0) return NIL;
    return find_chunk(c, (uint32_t)ns, key, len, key_hash(key, len, (uint32_t)ns));
}

/* replica_candidates(namespace, keys, node): per key, whether a load of it by ``node``
 * counts towards a replica (its chunk complete, held nowhere on ``node``). */
static PyObject *Core_replica_candidates(Core *c, PyObject *args) {
    PyObject *ns_obj, *keys, *name;
    if (!PyArg_ParseTuple(args, "OO!O", &ns_obj, &PyList_Type, &keys, &name)) return NULL;
    long node = node_of(c, name, 0);
    if (PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(PyList_GET_SIZE(keys));
    for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(keys); i++) {
        uint32_t ci = chunk_of(c, ns_obj, PyList_GET_ITEM(keys, i));
        if (PyErr_Occurred()) { Py_DECREF(out); return NULL; }
        int ok = node >= 0 && ci != NIL && c->chunks[ci].present == c->chunks[ci].world && !holds(c, ci, (uint32_t)node);
        PyObject *v = ok ? Py_True : Py_False;
        Py_INCREF(v);
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* start_replica(namespace, key, node): (made, actions), for a registered ``node`` and a
 * key replica_candidates accepted in the same call of CompactChunkIndex.record_loads. */
static PyObject *Core_start_replica(Core *c, PyObject *args) {
    PyObject *ns_obj, *key_obj, *name;
    if (!PyArg_ParseTuple(args, "OOO", &ns_obj, &key_obj, &name)) return NULL;
    long node = node_of(c, name, 0);
    uint32_t ci = chunk_of(c, ns_obj, key_obj);
    if (PyErr_Occurred() || !begin(c)) return NULL;
    int made = node >= 0 && c->nodes[node].registered && ci != NIL &&
               c->chunks[ci].present == c->chunks[ci].world && !holds(c, ci, (uint32_t)node) &&
               start_replica(c, ci, (uint32_t)node);
    return Py_BuildValue("(ON)", made ? Py_True : Py_False, finish(c));
}

/* replicated(node, done, failed): ``node``'s replica shards landed, or could not. */
static PyObject *Core_replicated(Core *c, PyObject *args) {
    PyObject *name, *done, *failed;
    if (!PyArg_ParseTuple(args, "OO!O!", &name, &PyList_Type, &done, &PyList_Type, &failed)) return NULL;
    long node = node_of(c, name, 1);
    if (node < 0 || !begin(c)) return NULL;
    for (int pass = 0; pass < 2; pass++) {
        PyObject *ids = pass ? failed : done;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ids); i++) {
            PyObject *o = PyList_GET_ITEM(ids, i);
            if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 3) { PyErr_SetString(PyExc_TypeError, "not a ShardId"); abort_call(c); return NULL; }
            uint32_t ci = chunk_of(c, PyTuple_GET_ITEM(o, 0), PyTuple_GET_ITEM(o, 1));
            if (PyErr_Occurred()) { abort_call(c); return NULL; }
            uint32_t r = ci != NIL ? replica_on(c, ci, (uint32_t)node) : NIL;
            if (pass && r != NIL) drop_replica(c, r);
            else if (!pass && r == NIL) fatal_if(PyList_Append(action_list(c, A_DROP, (uint32_t)node), o) < 0); /* gone meanwhile */
            else if (!pass && ++c->replicas[r].landed == c->chunks[ci].world) c->counts[C_REPLICATED]++;
        }
    }
    return finish(c);
}

/* replicas_on(node): [(namespace, key)] of its complete replicas. */
static PyObject *Core_replicas_on(Core *c, PyObject *name) {
    long node = node_of(c, name, 0);
    if (PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(0);
    for (uint32_t r = node >= 0 && out ? c->nodes[node].rhead : NIL; r != NIL; r = c->replicas[r].lnext) {
        if (!replica_ready(c, r)) continue;
        Chunk *ch = &c->chunks[c->replicas[r].chunk];
        PyObject *pair = Py_BuildValue("(Oy#)", PyList_GET_ITEM(c->ns_list, ch->ns), chunk_key(c, ch), (Py_ssize_t)ch->keylen);
        if (!pair || PyList_Append(out, pair) < 0) { Py_XDECREF(pair); Py_DECREF(out); return NULL; }
        Py_DECREF(pair);
    }
    return out;
}

static PyObject *Core_contains(Core *c, PyObject *args) {
    PyObject *ns_obj, *key_obj;
    if (!PyArg_ParseTuple(args, "OO", &ns_obj, &key_obj)) return NULL;
    long ns = ns_of(c, ns_obj, 1);
    const uint8_t *key; size_t len;
    if (ns < 0 || as_bytes(key_obj, &key, &len) < 0) return NULL;
    return PyBool_FromLong(find_chunk(c, (uint32_t)ns, key, len, key_hash(key, len, (uint32_t)ns)) != NIL);
}

static PyObject *Core_size(Core *c, PyObject *unused) { return PyLong_FromSize_t(c->live_chunks); }

static PyObject *Core_holders(Core *c, PyObject *unused) { return PyDict_Size(c->holder_ids) >= 0 ? PyLong_FromSsize_t(PyDict_Size(c->holder_ids)) : NULL; }

static PyObject *Core_drain_counts(Core *c, PyObject *unused) {
    PyObject *t = PyTuple_New(N_COUNTS);
    for (int i = 0; t && i < N_COUNTS; i++) { PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(c->counts[i])); c->counts[i] = 0; }
    return t;
}

static PyObject *Core_memory_bytes(Core *c, PyObject *unused) {
    size_t b = c->capchunks * sizeof(Chunk) + c->capshards * sizeof(Shard) + c->capunits * sizeof(Unit)
             + c->capedges * sizeof(Edge) + c->capwaits * sizeof(Wait) + c->capleases * sizeof(Lease)
             + c->capreplicas * sizeof(Replica) + (c->rkeys ? 2 * (c->rmask + 1) * sizeof(uint32_t) : 0)
             + c->capwk * sizeof(Wakeup) + c->pcap * sizeof(uint64_t);
    for (int i = 0; i < 256; i++) b += c->keys[i].cap * key_slot((size_t)i);
    Table *ts[2] = {&c->ctab, &c->otab};
    for (int i = 0; i < 2; i++) if (ts[i]->slots) b += (ts[i]->mask + 1) * (sizeof(uint32_t) + sizeof(uint16_t));
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
    c->chunk_free = c->unit_free = c->edge_free = c->wait_free = c->lease_free = c->replica_free = NIL;
    c->mute = NIL;
    for (int i = 0; i <= MAX_POOLED_WORLD; i++) c->shard_free[i] = NIL;
    for (int i = 0; i < 256; i++) c->keys[i].free = NIL;
    return 0;
}
static void Core_dealloc(Core *c) {
    for (int i = 0; i < 256; i++) PyMem_RawFree(c->keys[i].a);
    void *arrays[] = {c->chunks, c->shards, c->units, c->edges, c->waits, c->leases, c->replicas, c->rkeys, c->rheads, c->wk, c->pset,
                      c->plist, c->pkeys, c->ctab.slots, c->otab.slots, c->ctab.tags, c->otab.tags};
    for (size_t i = 0; i < sizeof arrays / sizeof *arrays; i++) PyMem_RawFree(arrays[i]);
    for (size_t n = 0; n < c->nnodes; n++) { PyMem_RawFree(c->nodes[n].heap[0].a); PyMem_RawFree(c->nodes[n].heap[1].a); }
    PyMem_RawFree(c->nodes);
    PyMem_RawFree(c->holder_refs); PyMem_RawFree(c->holder_free); PyMem_RawFree(c->zero_holders);
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
    {"resize_node", (PyCFunction)Core_resize_node, METH_VARARGS, NULL},
    {"restore", (PyCFunction)Core_restore, METH_VARARGS, NULL},
    {"forget_node", (PyCFunction)Core_forget_node, METH_O, NULL},
    {"nodes", (PyCFunction)Core_nodes, METH_NOARGS, NULL},
    {"node", (PyCFunction)Core_node, METH_O, NULL},
    {"shards_on", (PyCFunction)Core_shards_on, METH_O, NULL},
    {"units", (PyCFunction)Core_units, METH_NOARGS, NULL},
    {"locate", (PyCFunction)Core_locate, METH_VARARGS, NULL},
    {"replica_candidates", (PyCFunction)Core_replica_candidates, METH_VARARGS, NULL},
    {"start_replica", (PyCFunction)Core_start_replica, METH_VARARGS, NULL},
    {"replicated", (PyCFunction)Core_replicated, METH_VARARGS, NULL},
    {"replicas_on", (PyCFunction)Core_replicas_on, METH_O, NULL},
    {"contains", (PyCFunction)Core_contains, METH_VARARGS, NULL},
    {"size", (PyCFunction)Core_size, METH_NOARGS, NULL},
    {"holders", (PyCFunction)Core_holders, METH_NOARGS, NULL},
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
