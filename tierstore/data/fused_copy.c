/* A job's copies between the KV cache and its shards' bytes (extents in the node's
 * arena, or a fetched object's buffers), in one pass that also hashes each shard: a
 * same-node load verifies each piece right after copying it out of the arena, while it
 * is still in the core's cache; a store hashes each piece of the KV cache right after
 * copying it in, so its commit needs no second pass over the arena.
 *
 * The job is walked straight from its plan (spans of blocks, each block a slot of
 * pages, one per layer of its group, back to back): no per-page table is built in
 * Python. Slots a job does not fill are zeros in the arena, hashed too.
 *
 * The extension module tierstore.data._fused_copy (setuptools, optional: a machine
 * without a C compiler uses the numpy path), one function, walk(), called by
 * tierstore/data/fused_copy.py. It takes the tables' addresses and lengths as integers;
 * every index it reads from them is checked against those lengths before any byte is
 * copied, and a bad table raises ValueError with nothing written. The copy runs with
 * the GIL released: other Python threads run meanwhile, and the caller keeps the
 * tables, shards and KV tensors alive and unchanged until it returns. The hash is the
 * xxhash binding's own XXH3_64bits streaming functions, passed in as addresses with a
 * state the caller owns (one per thread), so the digest is the one every other path
 * computes. What the one pass costs against memcpy: docs/benchmarks.md, "dataplane".
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef int (*xxh_reset_t)(void *state);
typedef int (*xxh_update_t)(void *state, const void *data, size_t len);
typedef uint64_t (*xxh_digest_t)(const void *state);

/* At most this many bytes are copied before they are hashed: fits the L2 cache. */
#define PIECE ((int64_t)64 << 10)

/* Copy ``n`` bytes with non-temporal stores where the CPU has them: the destination
 * bypasses the cache (it is not read here, and a large job would only evict the source
 * the hash is about to read), so no line of it is read before it is written. Callers
 * end with store_fence(). */
static void copy_streaming(uint8_t *dst, const uint8_t *src, size_t n)
{
#if defined(__SSE2__)
    const size_t head = (size_t)(-(uintptr_t)dst & 15);
    if (n < head + 64) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        const __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

/* Non-temporal stores are weakly ordered: make them visible before the caller reports
 * the load done (another thread then reads the blocks). */
static void store_fence(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* Row widths of the plan tables (int64 each). A span: the job offset of its first
 * filled slot, its blocks, where its ids start, its slot's bytes, its group's refs
 * [ref_lo, ref_hi). A ref (one layer's page in a slot): the KV tensor's base address,
 * row stride, rows, the page's bytes, its offset in the slot. */
enum { SPAN_FIRST, SPAN_BLOCKS, SPAN_IDS, SPAN_SLOT, SPAN_REF_LO, SPAN_REF_HI, SPAN_WIDTH };
enum { REF_BASE, REF_STRIDE, REF_ROWS, REF_PAGE, REF_OFFSET, REF_WIDTH };

/* A job's tables as the caller gives them. The job's bytes [0, lo[n_shards]) are tiled
 * by shards in order: shard s holds job bytes [lo[s], lo[s + 1]) at address at[s]. */
typedef struct {
    const int64_t *lo, *at;
    uint64_t *digests; /* gather: written; scatter: checked */
    int64_t n_shards;
    const int64_t *spans, *refs, *ids;
    int64_t n_spans, n_refs, n_ids;
} plan_t;

/* Where the walk is: job bytes below ``pos`` are copied (or zeroed) and hashed into
 * the state of shard ``s``. */
typedef struct {
    const plan_t *p;
    int64_t s, pos;
    int gather, streaming, hashing;
    void *state;
    xxh_reset_t reset;
    xxh_update_t update;
    xxh_digest_t digest;
} walk_t;

enum { WALK_OK = -1, WALK_BAD_PLAN = -2 };

static inline uint8_t *in_shard(const walk_t *w, int64_t x)
{
    return (uint8_t *)(intptr_t)(w->p->at[w->s] + (x - w->p->lo[w->s]));
}

static inline void copy(const walk_t *w, uint8_t *dst, const uint8_t *src, size_t n)
{
    if (w->streaming) {
        copy_streaming(dst, src, n);
    } else {
        memcpy(dst, src, n);
    }
}

/* Shard s is hashed whole: keep (gather) or check (scatter) its digest, go to the next.
 * Returns 0 if a scatter's digest differs. */
static int finish_shard(walk_t *w)
{
    if (!w->hashing) {
        w->s++;
        return 1;
    }
    const uint64_t got = w->digest(w->state);
    if (w->gather) {
        w->p->digests[w->s] = got;
    } else if (got != w->p->digests[w->s]) {
        return 0;
    }
    w->s++;
    w->reset(w->state);
    return 1;
}

/* Hash job bytes [pos, to) that no page fills (zeroed first when gathering). */
static int skip_to(walk_t *w, int64_t to)
{
    while (w->pos < to) {
        const int64_t shard_end = w->p->lo[w->s + 1];
        const int64_t end = to < shard_end ? to : shard_end;
        uint8_t *at = in_shard(w, w->pos);
        if (w->gather) {
            memset(at, 0, (size_t)(end - w->pos));
        }
        if (w->hashing) {
            w->update(w->state, at, (size_t)(end - w->pos));
        }
        w->pos = end;
        if (w->pos == shard_end && !finish_shard(w)) {
            return 0;
        }
    }
    /* Shards of no bytes at ``to`` are whole too. */
    while (w->s < w->p->n_shards && w->pos == w->p->lo[w->s + 1]) {
        if (!finish_shard(w)) {
            return 0;
        }
    }
    return 1;
}

/* One page (checked: within the job, after the pages before it): job bytes
 * [job_lo, job_lo + n) <-> the KV cache at ``kv``, piece by piece, each piece hashed
 * right after it is copied, from the side it was copied from. Returns WALK_OK or the
 * shard whose digest differs. */
static int64_t page(walk_t *w, int64_t job_lo, uint8_t *kv, int64_t n)
{
    if (!skip_to(w, job_lo)) {
        return w->s;
    }
    while (n > 0) {
        int64_t take = w->p->lo[w->s + 1] - w->pos;
        take = take < PIECE ? take : PIECE;
        take = take < n ? take : n;
        uint8_t *at = in_shard(w, w->pos);
        if (w->gather) {
            copy(w, at, kv, (size_t)take);
            if (w->hashing) {
                w->update(w->state, kv, (size_t)take);
            }
        } else {
            copy(w, kv, at, (size_t)take);
            w->update(w->state, at, (size_t)take);
        }
        kv += take;
        n -= take;
        w->pos += take;
        if (!skip_to(w, w->pos)) {
            return w->s;
        }
    }
    return WALK_OK;
}

/* The shard rows: at least one shard, job offsets >= 0 and never going back. Returns
 * NULL, or what is wrong. */
static const char *check_shards(const plan_t *p)
{
    if (p->n_shards < 1 || p->lo[0] < 0) {
        return "a job needs a shard, from a job offset >= 0";
    }
    for (int64_t s = 0; s < p->n_shards; s++) {
        if (p->lo[s + 1] < p->lo[s]) {
            return "the shards' job offsets go backwards";
        }
    }
    return NULL;
}

/* A span's rows: its ids in the id list, its refs in the ref table, each ref's page
 * within one row of its tensor (rows * stride bytes in all) and within the slot. */
static const char *check_span(const plan_t *p, const int64_t *span)
{
    if (span[SPAN_IDS] < 0 || span[SPAN_BLOCKS] < 0
        || span[SPAN_IDS] > p->n_ids - span[SPAN_BLOCKS]) {
        return "a span's block ids lie outside the id list";
    }
    if (span[SPAN_SLOT] < 0) {
        return "a span's slot has a negative size";
    }
    if (span[SPAN_REF_LO] < 0 || span[SPAN_REF_LO] > span[SPAN_REF_HI]
        || span[SPAN_REF_HI] > p->n_refs) {
        return "a span's refs lie outside the ref table";
    }
    for (int64_t r = span[SPAN_REF_LO]; r < span[SPAN_REF_HI]; r++) {
        const int64_t *ref = p->refs + r * REF_WIDTH;
        if (ref[REF_PAGE] <= 0 || ref[REF_PAGE] > ref[REF_STRIDE]) {
            return "a page is empty or wider than its tensor's row stride";
        }
        if (ref[REF_ROWS] < 0 || ref[REF_ROWS] > INT64_MAX / ref[REF_STRIDE]
            || ref[REF_BASE] <= 0 || ref[REF_BASE] > INT64_MAX - ref[REF_ROWS] * ref[REF_STRIDE]) {
            return "a KV tensor's base, rows or stride are out of range";
        }
        if (ref[REF_OFFSET] < 0 || ref[REF_OFFSET] > span[SPAN_SLOT] - ref[REF_PAGE]) {
            return "a page lies outside its slot";
        }
    }
    return NULL;
}

/* Visit the plan's pages in job order, each index checked against the tables' lengths:
 * with w == NULL only checked (nothing but the tables is read), else also copied, until
 * a shard's digest differs (*result: WALK_OK or that shard). Returns NULL, or what is
 * wrong with the plan (w == NULL: found before any byte is touched). */
static const char *visit(const plan_t *p, walk_t *w, int64_t *result)
{
    const int64_t end = p->lo[p->n_shards];
    int64_t pos = p->lo[0];
    for (int64_t i = 0; i < p->n_spans; i++) {
        const int64_t *span = p->spans + i * SPAN_WIDTH;
        const char *bad = check_span(p, span);
        if (bad != NULL) {
            return bad;
        }
        for (int64_t k = 0; k < span[SPAN_BLOCKS]; k++) {
            const int64_t id = p->ids[span[SPAN_IDS] + k];
            int64_t slot;
            if (__builtin_mul_overflow(k, span[SPAN_SLOT], &slot)
                || __builtin_add_overflow(slot, span[SPAN_FIRST], &slot)) {
                return "a span's slots lie outside the job";
            }
            for (int64_t r = span[SPAN_REF_LO]; r < span[SPAN_REF_HI]; r++) {
                const int64_t *ref = p->refs + r * REF_WIDTH;
                int64_t job_lo;
                if (id < 0 || id >= ref[REF_ROWS]) {
                    return "block ids outside the KV cache";
                }
                if (__builtin_add_overflow(slot, ref[REF_OFFSET], &job_lo) || job_lo < pos
                    || ref[REF_PAGE] > end - job_lo) {
                    return "pages go backwards or leave the job";
                }
                pos = job_lo + ref[REF_PAGE];
                if (w != NULL) {
                    uint8_t *kv = (uint8_t *)(intptr_t)(ref[REF_BASE] + id * ref[REF_STRIDE]);
                    *result = page(w, job_lo, kv, ref[REF_PAGE]);
                    if (*result != WALK_OK) {
                        return NULL;
                    }
                }
            }
        }
    }
    return NULL;
}

/* Walk a job's pages in job order between the KV cache and its shards' bytes.
 *
 * gather != 0: KV -> shards, bytes no page fills are zeroed, each shard's xxh3-64 is
 * written to digests[s]. gather == 0: shards -> KV, each shard's digest is checked
 * against digests[s]. A gather with hashing == 0 copies only (digests untouched).
 * streaming != 0: the destination is written with non-temporal stores (fenced before
 * returning). No Python API: called without the GIL.
 *
 * Returns WALK_OK; for a scatter, the index of the first shard whose digest differs
 * (its bytes and those before it may already be in the KV cache: the caller fails the
 * load); or WALK_BAD_PLAN with *bad saying why, before any byte is copied. */
static int64_t ts_walk(
    const plan_t *p, int gather, int streaming, int hashing,
    void *state, xxh_reset_t reset, xxh_update_t update, xxh_digest_t digest, const char **bad)
{
    *bad = check_shards(p);
    if (*bad == NULL) {
        *bad = visit(p, NULL, NULL);
    }
    if (*bad != NULL) {
        return WALK_BAD_PLAN;
    }
    walk_t w = {p, 0, p->lo[0], gather, streaming, hashing || !gather, state, reset, update, digest};
    int64_t result = WALK_OK;
    reset(state);
    visit(p, &w, &result);
    if (result == WALK_OK && !skip_to(&w, p->lo[p->n_shards])) {
        result = w.s;
    }
    if (streaming) {
        store_fence();
    }
    return result;
}

/* An address argument: not 0 unless its table is empty. */
static int address(long long value, long long count, const char *what)
{
    if (value == 0 && count > 0) {
        PyErr_Format(PyExc_ValueError, "walk: %s is a null address", what);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(walk_doc,
    "walk(lo, at, digests, n_shards, spans, n_spans, refs, n_refs, ids, n_ids,\n"
    "     gather, streaming, hashing, state, reset, update, digest) -> int\n\n"
    "Copy a job's pages between the KV cache and its shards, hashing each shard, with\n"
    "the GIL released. Addresses: the shards' int64 job offsets (n_shards + 1, the\n"
    "job's end last), int64 addresses and uint64 digests (n_shards each); the int64\n"
    "span (6 a row), ref (5 a row) and block-id tables; an XXH3 state and the\n"
    "binding's XXH3_64bits_reset/update/digest. gather: KV -> shards, digests\n"
    "written if hashing; else shards -> KV, digests checked. Returns -1 (done) or\n"
    "the first shard whose digest differs. Raises ValueError for a bad table (an\n"
    "index outside the lengths given, a page outside its row, slot or the job) with\n"
    "nothing copied; TypeError or OverflowError for a bad argument.");

static PyObject *walk(PyObject *self, PyObject *args)
{
    long long lo, at, digests, n_shards, spans, n_spans, refs, n_refs, ids, n_ids;
    long long state, reset, update, digest;
    int gather, streaming, hashing;
    (void)self;
    if (!PyArg_ParseTuple(args, "LLLLLLLLLLpppLLLL:walk", &lo, &at, &digests, &n_shards,
                          &spans, &n_spans, &refs, &n_refs, &ids, &n_ids, &gather,
                          &streaming, &hashing, &state, &reset, &update, &digest)) {
        return NULL;
    }
    if (n_shards < 1 || n_spans < 0 || n_refs < 0 || n_ids < 0) {
        return PyErr_Format(PyExc_ValueError, "walk: %lld shards, %lld spans, %lld refs, "
                            "%lld ids", n_shards, n_spans, n_refs, n_ids);
    }
    if (!address(lo, 1, "lo") || !address(at, 1, "at") || !address(digests, 1, "digests")
        || !address(spans, n_spans, "spans") || !address(refs, n_refs, "refs")
        || !address(ids, n_ids, "ids") || !address(state, 1, "state")
        || !address(reset, 1, "reset") || !address(update, 1, "update")
        || !address(digest, 1, "digest")) {
        return NULL;
    }
    const plan_t p = {
        (const int64_t *)(intptr_t)lo, (const int64_t *)(intptr_t)at,
        (uint64_t *)(intptr_t)digests, n_shards, (const int64_t *)(intptr_t)spans,
        (const int64_t *)(intptr_t)refs, (const int64_t *)(intptr_t)ids,
        n_spans, n_refs, n_ids,
    };
    const char *bad = NULL;
    int64_t result;
    Py_BEGIN_ALLOW_THREADS
    result = ts_walk(&p, gather, streaming, hashing, (void *)(intptr_t)state,
                     (xxh_reset_t)(intptr_t)reset, (xxh_update_t)(intptr_t)update,
                     (xxh_digest_t)(intptr_t)digest, &bad);
    Py_END_ALLOW_THREADS
    if (result == WALK_BAD_PLAN) {
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    return PyLong_FromLongLong(result);
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, walk_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fused_copy",
    "A job's copies between the KV cache and the arena, hashed in one pass (walk); "
    "used by tierstore.data.fused_copy.", -1, methods,
};

PyMODINIT_FUNC PyInit__fused_copy(void) { return PyModule_Create(&module); }
