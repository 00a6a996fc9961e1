/* A job's copies between the KV cache and its shards' extents in the node's arena, in
 * one pass that also hashes each shard: a same-node load verifies each piece right after
 * copying it out of the arena, while it is still in the core's cache; a store hashes
 * each piece of the KV cache right after copying it in, so its commit needs no second
 * pass over the arena.
 *
 * The job is walked straight from its plan (spans of blocks, each block a slot of
 * pages, one per layer of its group, back to back): no per-page table is built in
 * Python. Slots a job does not fill are zeros in the arena, hashed too.
 *
 * Built as the extension module tierstore.data._fused_copy (setuptools, optional: a
 * machine without a C compiler uses the numpy path); Python calls it through ctypes,
 * which releases the GIL for the call (tierstore/data/fused_copy.py). The hash is the
 * xxhash binding's own XXH3_64bits streaming functions, passed in as pointers, so the
 * digest is the one every other path computes. No Python API is used but the module's
 * (empty) init.
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
 * the hash is about to read), so no line of it is read before it is written. 16 MiB
 * from a cold cache, copy and hash: 0.74x -> 0.88x of memcpy; 4 KiB pages 0.57x ->
 * 0.78x. Callers end with store_fence(). */
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

/* Where the walk is: job bytes below ``pos`` are copied (or zeroed) and hashed into
 * the state of shard ``s``, whose job bytes [lo[s], lo[s + 1]) lie at address at[s]
 * (in the arena, or a fetched object's buffer). */
typedef struct {
    const int64_t *lo, *at;
    uint64_t *digests; /* gather: written; scatter: checked */
    int64_t n_shards, s, pos;
    int gather, streaming, hashing;
    void *state;
    xxh_reset_t reset;
    xxh_update_t update;
    xxh_digest_t digest;
} walk_t;

enum { WALK_OK = -1, WALK_BAD_PLAN = -2 };

static inline uint8_t *in_shard(const walk_t *w, int64_t x)
{
    return (uint8_t *)(intptr_t)(w->at[w->s] + (x - w->lo[w->s]));
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
        w->digests[w->s] = got;
    } else if (got != w->digests[w->s]) {
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
        const int64_t end = to < w->lo[w->s + 1] ? to : w->lo[w->s + 1];
        uint8_t *at = in_shard(w, w->pos);
        if (w->gather) {
            memset(at, 0, (size_t)(end - w->pos));
        }
        if (w->hashing) {
            w->update(w->state, at, (size_t)(end - w->pos));
        }
        w->pos = end;
        if (w->pos == w->lo[w->s + 1] && !finish_shard(w)) {
            return 0;
        }
    }
    return 1;
}

/* One page: job bytes [job_lo, job_lo + n) <-> the KV cache at ``kv``, piece by piece,
 * each piece hashed right after it is copied, from the side it was copied from. */
static int64_t page(walk_t *w, int64_t job_lo, uint8_t *kv, int64_t n)
{
    if (job_lo < w->pos || n <= 0 || job_lo + n > w->lo[w->n_shards]) {
        return WALK_BAD_PLAN;
    }
    if (!skip_to(w, job_lo)) {
        return w->s;
    }
    while (n > 0) {
        int64_t take = w->lo[w->s + 1] - w->pos;
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
        if (w->pos == w->lo[w->s + 1] && !finish_shard(w)) {
            return w->s;
        }
    }
    return WALK_OK;
}

/* Row widths of the plan tables (int64 each). A span: the job offset of its first
 * filled slot, its blocks, where its ids start, its slot's bytes, its group's refs
 * [ref_lo, ref_hi). A ref (one layer's page in a slot): the KV tensor's base address,
 * row stride, rows, the page's bytes, its offset in the slot. */
enum { SPAN_FIRST, SPAN_BLOCKS, SPAN_IDS, SPAN_SLOT, SPAN_REF_LO, SPAN_REF_HI, SPAN_WIDTH };
enum { REF_BASE, REF_STRIDE, REF_ROWS, REF_PAGE, REF_OFFSET, REF_WIDTH };

/* Walk a job's pages in job order between the KV cache and its shards' bytes.
 *
 * The job's bytes [0, lo[n_shards]) are tiled by shards in order: shard s holds job
 * bytes [lo[s], lo[s + 1]) at address at[s]. gather != 0: KV -> shards, bytes no
 * page fills are zeroed, each shard's xxh3-64 is written to digests[s]. gather == 0:
 * shards -> KV, each shard's digest is checked against digests[s]. A gather with
 * hashing == 0 copies only (digests untouched). streaming != 0: the
 * destination is written with non-temporal stores (fenced before returning).
 *
 * Returns WALK_OK; for a scatter, the index of the first shard whose digest differs
 * (its bytes and those before it may already be in the KV cache: the caller fails the
 * load); or WALK_BAD_PLAN if a block id is outside its tensor, the pages go backwards
 * or leave the job (nothing past the bad page is copied). */
int64_t ts_walk(
    const int64_t *lo, const int64_t *at, uint64_t *digests, int64_t n_shards,
    const int64_t *spans, int64_t n_spans, const int64_t *refs, const int64_t *ids,
    int64_t n_ids, int gather, int streaming, int hashing,
    void *state, xxh_reset_t reset, xxh_update_t update, xxh_digest_t digest)
{
    walk_t w = {lo, at, digests, n_shards, 0, lo[0], gather, streaming,
                hashing || !gather, state, reset, update, digest};
    int64_t result = WALK_OK;
    reset(state);
    for (int64_t i = 0; i < n_spans && result == WALK_OK; i++) {
        const int64_t *span = spans + i * SPAN_WIDTH;
        if (span[SPAN_IDS] < 0 || span[SPAN_BLOCKS] < 0
            || span[SPAN_IDS] + span[SPAN_BLOCKS] > n_ids) {
            result = WALK_BAD_PLAN;
        }
        for (int64_t k = 0; k < span[SPAN_BLOCKS] && result == WALK_OK; k++) {
            const int64_t id = ids[span[SPAN_IDS] + k];
            const int64_t slot = span[SPAN_FIRST] + k * span[SPAN_SLOT];
            for (int64_t r = span[SPAN_REF_LO]; r < span[SPAN_REF_HI] && result == WALK_OK; r++) {
                const int64_t *ref = refs + r * REF_WIDTH;
                if (id < 0 || id >= ref[REF_ROWS]) {
                    result = WALK_BAD_PLAN;
                    break;
                }
                uint8_t *kv = (uint8_t *)(intptr_t)(ref[REF_BASE] + id * ref[REF_STRIDE]);
                result = page(&w, slot + ref[REF_OFFSET], kv, ref[REF_PAGE]);
            }
        }
    }
    if (result == WALK_OK && !skip_to(&w, lo[n_shards])) {
        result = w.s;
    }
    if (streaming) {
        store_fence();
    }
    return result;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fused_copy",
    "A job's copies between the KV cache and the arena, hashed in one pass, in C (called through ctypes: see fused_copy.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__fused_copy(void) { return PyModule_Create(&module); }
