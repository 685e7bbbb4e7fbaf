/* The native decoder of a locality-index lookup: each live holder's leading run of pages.
 *
 * Input: the reply of the lookup's HMGET (one value per page of the query, in query order; a value
 * is a run of 17-byte holder records, little-endian u32 incarnation | u8 medium | u32 slot |
 * u64 generation) and the live incarnations. Output: per live holder of page 0, the medium, slot
 * and generation of each page of its run from page 0 (of a page it holds in two media, the lowest
 * medium code). The numpy version in pof_connector/index/record_runs.py defines the same result;
 * this one exists because a 2,000-page reply cost the client more in numpy calls than the server
 * spent answering it.
 *
 * summary_runs decodes the runs and holders of a segment lookup's reply (one summary per segment of
 * up to 16 pages: which tags sit at which offset, and per holder and medium a bitmask per tag
 * layer; pof_connector/index/summary.py), as summary.summary_runs does in Python, without slots:
 * the loader reads those for the holder it picks. The work per segment is the holders' entries
 * (a few bit operations each), and per head only while its run lasts, so a query held by 64 nodes
 * costs about what one held by 4 does.
 *
 * slot_objects makes the lookup's matches (one per holder: PrefixMatch.from_source) without calling
 * their class: from Python each cost more than decoding its holder's entries.
 *
 * Every length is checked before a byte is read: the values come from a server that a broken or
 * hostile writer may have filled.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the index records are little-endian; big-endian hosts use the numpy decoder"
#endif

#define RECORD 17

static inline uint32_t rd_u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline int64_t rd_i64(const unsigned char *p) { int64_t v; memcpy(&v, p, 8); return v; }
static inline uint64_t rd_u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* Index of inc in the sorted array incs[0..n), or -1. */
static Py_ssize_t find_inc(const uint32_t *incs, Py_ssize_t n, uint32_t inc)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (incs[mid] < inc)
            lo = mid + 1;
        else
            hi = mid;
    }
    return (lo < n && incs[lo] == inc) ? lo : -1;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* For each head active at page p, the offset of its chosen record in the page (-1: none). */
static void choose(const unsigned char *v, Py_ssize_t len, const uint32_t *heads, Py_ssize_t k,
                   const unsigned char *active, int n_media, Py_ssize_t *chosen, unsigned char *best)
{
    for (Py_ssize_t h = 0; h < k; h++) {
        chosen[h] = -1;
        best[h] = 255;
    }
    for (Py_ssize_t off = 0; off < len; off += RECORD) {
        unsigned char medium = v[off + 4];
        if (medium >= n_media)
            continue;
        Py_ssize_t h = find_inc(heads, k, rd_u32(v + off));
        if (h >= 0 && active[h] && medium < best[h]) {
            best[h] = medium;
            chosen[h] = off;
        }
    }
}

PyDoc_STRVAR(leading_runs_doc,
"leading_runs(values, alive, n_media, /) -> (held, malformed, unknown, heads, runs)\n\n"
"values: the HMGET reply, a list of bytes or None per page; alive: the live incarnations as a\n"
"sorted little-endian uint32 buffer; n_media: how many medium codes this build knows.\n"
"held: pages up to the first missing or malformed value; malformed: 1 when a value was empty or\n"
"not whole records; unknown: records (of the held pages) with a medium code >= n_media; heads: the\n"
"live incarnations holding page 0, ascending; runs: per head (media u8, slots int64, generations\n"
"int64) as bytearrays, one entry per page of its run.");

/* One holder's run so far: its pages' media, slots and generations, grown by doubling. */
typedef struct {
    unsigned char *media;
    int64_t *slots, *gens;
    Py_ssize_t len, cap;
} run_buf;

/* Frees the k runs (NULL: none) and their array. */
static void free_runs(run_buf *runs, Py_ssize_t k)
{
    for (Py_ssize_t h = 0; runs != NULL && h < k; h++) {
        PyMem_Free(runs[h].media);
        PyMem_Free(runs[h].slots);
        PyMem_Free(runs[h].gens);
    }
    PyMem_Free(runs);
}

/* Fills the new lists out_heads and out_runs (k items each) with the heads' incarnations and their
 * runs as (media, slots, generations) bytearrays; -1 with an exception set when an object could
 * not be made (the lists then hold NULLs, which their deallocation skips). */
static int fill_runs(const run_buf *runs, const uint32_t *heads, Py_ssize_t k, PyObject *out_heads, PyObject *out_runs)
{
    for (Py_ssize_t h = 0; h < k; h++) {
        const run_buf *r = &runs[h];
        PyObject *inc = PyLong_FromUnsignedLong(heads[h]);
        PyObject *triple = Py_BuildValue("(NNN)", PyByteArray_FromStringAndSize((const char *)r->media, r->len),
                                         PyByteArray_FromStringAndSize((const char *)r->slots, r->len * 8),
                                         PyByteArray_FromStringAndSize((const char *)r->gens, r->len * 8));
        if (inc == NULL || triple == NULL) {
            Py_XDECREF(inc);
            Py_XDECREF(triple);
            return -1;
        }
        PyList_SET_ITEM(out_heads, h, inc);
        PyList_SET_ITEM(out_runs, h, triple);
    }
    return 0;
}

static int run_push(run_buf *r, unsigned char medium, int64_t slot, int64_t gen)
{
    if (r->len == r->cap) {
        Py_ssize_t cap = r->cap ? 2 * r->cap : 256;
        unsigned char *m = PyMem_Realloc(r->media, (size_t)cap);
        if (m == NULL)
            return -1;
        r->media = m;
        int64_t *sl = PyMem_Realloc(r->slots, (size_t)cap * 8);
        if (sl == NULL)
            return -1;
        r->slots = sl;
        int64_t *g = PyMem_Realloc(r->gens, (size_t)cap * 8);
        if (g == NULL)
            return -1;
        r->gens = g;
        r->cap = cap;
    }
    r->media[r->len] = medium;
    r->slots[r->len] = slot;
    r->gens[r->len] = gen;
    r->len++;
    return 0;
}

/* The live incarnations among page 0's records (known media), ascending, without repeats. */
static Py_ssize_t page0_heads(const unsigned char *v, Py_ssize_t len, const uint32_t *live, Py_ssize_t n_live,
                              int n_media, uint32_t *heads)
{
    Py_ssize_t k = 0;
    for (Py_ssize_t off = 0; off < len; off += RECORD) {
        uint32_t inc = rd_u32(v + off);
        if (v[off + 4] < n_media && find_inc(live, n_live, inc) >= 0)
            heads[k++] = inc;
    }
    qsort(heads, (size_t)k, sizeof(uint32_t), cmp_u32);
    Py_ssize_t u = 0;
    for (Py_ssize_t h = 0; h < k; h++)
        if (u == 0 || heads[u - 1] != heads[h])
            heads[u++] = heads[h];
    return u;
}

static PyObject *py_leading_runs(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *values;
    Py_buffer alive;
    int n_media;
    if (!PyArg_ParseTuple(args, "O!y*i", &PyList_Type, &values, &alive, &n_media))
        return NULL;
    if (alive.len % 4 != 0 || n_media < 0 || n_media > 255) {
        PyBuffer_Release(&alive);
        PyErr_SetString(PyExc_ValueError, "alive must be uint32s and n_media in 0..255");
        return NULL;
    }
    const uint32_t *live = alive.buf;
    Py_ssize_t n_live = alive.len / 4, n = PyList_GET_SIZE(values), held = 0, unknown = 0, k = 0, running = 0;
    int malformed = 0, failed = 0;
    uint32_t *heads = NULL;
    run_buf *runs = NULL;
    Py_ssize_t *chosen = NULL;
    unsigned char *active = NULL, *best = NULL;
    PyObject *out_heads = NULL, *out_runs = NULL, *result = NULL;
    /* One pass over the values (2,000 separate objects: each is read once, while in cache): check
     * it, count its records of unknown media, and extend the runs of the holders still running. */
    for (; held < n; held++) {
        PyObject *item = PyList_GET_ITEM(values, held);
        if (item == Py_None)
            break;
        if (!PyBytes_Check(item) || PyBytes_GET_SIZE(item) == 0 || PyBytes_GET_SIZE(item) % RECORD != 0) {
            malformed = 1;
            break;
        }
        const unsigned char *v = (const unsigned char *)PyBytes_AS_STRING(item);
        Py_ssize_t len = PyBytes_GET_SIZE(item);
        for (Py_ssize_t off = 4; off < len; off += RECORD)
            unknown += v[off] >= n_media;
        if (held == 0) {
            size_t most = (size_t)(len / RECORD) + 1;
            heads = PyMem_Malloc(most * sizeof(uint32_t));
            runs = PyMem_Calloc(most, sizeof(run_buf));
            chosen = PyMem_Malloc(most * sizeof(Py_ssize_t));
            active = PyMem_Malloc(most);
            best = PyMem_Malloc(most);
            if (heads == NULL || runs == NULL || chosen == NULL || active == NULL || best == NULL) {
                failed = 1;
                break;
            }
            k = running = page0_heads(v, len, live, n_live, n_media, heads);
            memset(active, 1, (size_t)k);
        }
        if (running == 0)
            continue;
        choose(v, len, heads, k, active, n_media, chosen, best);
        for (Py_ssize_t h = 0; h < k; h++) {
            if (!active[h])
                continue;
            if (chosen[h] < 0) {
                active[h] = 0;
                running--;
                continue;
            }
            const unsigned char *rec = v + chosen[h];
            if (run_push(&runs[h], rec[4], (int64_t)rd_u32(rec + 5), rd_i64(rec + 9)) < 0) {
                failed = 1;
                break;
            }
        }
        if (failed)
            break;
    }
    PyBuffer_Release(&alive);
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    out_heads = PyList_New(k);
    out_runs = PyList_New(k);
    if (out_heads == NULL || out_runs == NULL)
        goto done;
    if (fill_runs(runs, heads, k, out_heads, out_runs) < 0)
        goto done;
    result = Py_BuildValue("(nnnOO)", held, (Py_ssize_t)malformed, unknown, out_heads, out_runs);
done:
    Py_XDECREF(out_heads);
    Py_XDECREF(out_runs);
    free_runs(runs, k);
    PyMem_Free(heads);
    PyMem_Free(chosen);
    PyMem_Free(active);
    PyMem_Free(best);
    return result;
}


PyDoc_STRVAR(summary_runs_doc,
"summary_runs(values, first_page, tags, alive, n_media, segment_pages, /)\n"
"    -> (held, malformed, unknown, heads, media, layers, marked)\n\n"
"values: the lookup's HMGET reply, a list of bytes or None per segment summary; first_page: per\n"
"segment, the query page at its offset 0 (int64 buffer, one entry per value at least); tags: per\n"
"query page, its tag (uint64 buffer); alive: the live incarnations as a sorted uint32 buffer;\n"
"n_media: how many medium codes this build knows; segment_pages: the pages of a segment (<= 16).\n"
"held: pages up to the first one no holder has in a known medium, or the segment of the first\n"
"malformed value; malformed: 1 when a value was not a summary; unknown: (holder, query page) pairs\n"
"of a medium code >= n_media up to the segment where the held pages end; heads: the live\n"
"incarnations holding page 0, ascending (uint32s); media: (per head its run's pages (int64s), per\n"
"head where its stretches start in the next two (k + 1 int64s), the stretches' first pages (int64s),\n"
"their medium codes (bytes)): a stretch is pages of one code (of a page in two media, the lowest);\n"
"layers: per query page, the layer of its tag in its summary (bytes, 255: no tag); marked: the\n"
"query pages at an overflowed offset, ascending, as int64s.");

#define LAYERS 4

/* One parsed summary (see pof_connector/index/summary.py): offsets marked, layers in use, per layer
 * the offsets with a tag and where each tag is, and where the holder entries start. */
typedef struct {
    unsigned marks, n_layers, presence[LAYERS];
    const unsigned char *tag[LAYERS][16];
    const unsigned char *holders;
    Py_ssize_t n_holders, width;
} summary;

static inline unsigned rd_u16(const unsigned char *p) { return (unsigned)p[0] | ((unsigned)p[1] << 8); }

/* 0, or -1 when v is not a summary (cut short, padded, too many layers). */
static int parse_summary(const unsigned char *v, Py_ssize_t len, summary *s)
{
    if (len < 3)
        return -1;
    s->marks = rd_u16(v);
    s->n_layers = v[2];
    if (s->n_layers > LAYERS || len < 3 + 2 * (Py_ssize_t)s->n_layers)
        return -1;
    const unsigned char *p = v + 3 + 2 * s->n_layers, *end = v + len;
    for (unsigned l = 0; l < s->n_layers; l++) {
        s->presence[l] = rd_u16(v + 3 + 2 * l);
        for (unsigned o = 0; o < 16; o++) {
            s->tag[l][o] = NULL;
            if (s->presence[l] >> o & 1) {
                if (end - p < 8)
                    return -1;
                s->tag[l][o] = p;
                p += 8;
            }
        }
    }
    s->width = 5 + 2 * (Py_ssize_t)s->n_layers;
    s->holders = p;
    if (s->n_layers == 0)
        return p == end ? (s->n_holders = 0, 0) : -1;
    if ((end - p) % s->width != 0)
        return -1;
    s->n_holders = (end - p) / s->width;
    return 0;
}

/* The offsets of a segment whose first offset is query page fp that are query pages before stop. */
static inline unsigned seg_valid(int64_t fp, int seg_pages, Py_ssize_t stop)
{
    int64_t lo = fp < 0 ? -fp : 0, hi = fp + seg_pages <= (int64_t)stop ? seg_pages : (int64_t)stop - fp;
    return hi <= lo ? 0 : (unsigned)(((1u << hi) - 1) & ~((1u << lo) - 1));
}

/* The offsets of holder entry e that are query pages (qmask[l]: the offsets whose query page's tag
 * is at layer l). */
static inline unsigned held_offsets(const summary *s, const unsigned char *e, const unsigned *qmask)
{
    unsigned got = rd_u16(e + 5) & qmask[0];      /* a linear chain: one layer */
    for (unsigned l = 1; l < s->n_layers; l++)
        got |= rd_u16(e + 5 + 2 * l) & qmask[l];
    return got;
}

/* The heads' indices by incarnation: open addressing in a power-of-two table at least twice as
 * large (a binary search per holder entry cost a third of the decoding at 128 holders). */
typedef struct {
    int32_t *slot;
    unsigned bits;
    size_t mask;
} head_table;

static inline size_t head_hash(const head_table *t, uint32_t inc)
{
    return (size_t)((inc * 2654435761u) >> (32 - t->bits)) & t->mask;
}

static int head_table_make(head_table *t, const uint32_t *heads, Py_ssize_t k)
{
    t->bits = 4;
    while (((Py_ssize_t)1 << t->bits) < 2 * k)
        t->bits++;
    t->mask = ((size_t)1 << t->bits) - 1;
    t->slot = PyMem_Malloc((t->mask + 1) * sizeof(int32_t));
    if (t->slot == NULL)
        return -1;
    memset(t->slot, 0xff, (t->mask + 1) * sizeof(int32_t));
    for (Py_ssize_t h = 0; h < k; h++) {
        size_t i = head_hash(t, heads[h]);
        while (t->slot[i] >= 0)
            i = (i + 1) & t->mask;
        t->slot[i] = (int32_t)h;
    }
    return 0;
}

static inline Py_ssize_t head_find(const head_table *t, const uint32_t *heads, uint32_t inc)
{
    for (size_t i = head_hash(t, inc);; i = (i + 1) & t->mask) {
        int32_t h = t->slot[i];
        if (h < 0)
            return -1;
        if (heads[h] == inc)
            return h;
    }
}

/* A head's run as media runs: the first page of each stretch of one medium code, and the code. */
typedef struct {
    int64_t *starts;
    unsigned char *codes;
    Py_ssize_t n, cap;
} media_runs;

static int runs_push(media_runs *r, int64_t start, unsigned char code)
{
    if (r->n > 0 && r->codes[r->n - 1] == code)
        return 0;
    if (r->n == r->cap) {
        Py_ssize_t cap = r->cap ? 2 * r->cap : 8;
        int64_t *st = PyMem_Realloc(r->starts, (size_t)cap * 8);
        if (st == NULL)
            return -1;
        r->starts = st;
        unsigned char *c = PyMem_Realloc(r->codes, (size_t)cap);
        if (c == NULL)
            return -1;
        r->codes = c;
        r->cap = cap;
    }
    r->starts[r->n] = start;
    r->codes[r->n] = code;
    r->n++;
    return 0;
}

/* A head's state while its run goes on: where it stands, and its entries in the last segment that
 * had one. */
typedef struct {
    Py_ssize_t run_end;           /* the first query page after its run, once it stopped */
    Py_ssize_t through;           /* the last segment its run covers to the end (-1: none yet) */
    Py_ssize_t stamp;             /* the last segment with an entry of it (-1: none yet) */
    unsigned uni;                 /* the offsets its entries there hold */
    unsigned char single;         /* their one medium (255: several: per offset in segmed) */
    unsigned char last;           /* the code of its run's last stretch (255: none yet) */
} head_state;

static PyObject *py_summary_runs(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *values;
    Py_buffer first, tagbuf, alive;
    int n_media, seg_pages;
    if (!PyArg_ParseTuple(args, "O!y*y*y*ii", &PyList_Type, &values, &first, &tagbuf, &alive, &n_media,
                          &seg_pages))
        return NULL;
    Py_ssize_t n_seg = PyList_GET_SIZE(values), n = tagbuf.len / 8, n_live = alive.len / 4;
    Py_ssize_t nv = 0, limit = n, held = 0, unknown = 0, k = 0, n_marked = 0;
    int malformed = 0, failed = 0;
    const unsigned char *fps = first.buf, *tags = tagbuf.buf;
    const uint32_t *live = alive.buf;
    summary *sums = NULL;
    unsigned char *layer = NULL, *marked = NULL, *segmed = NULL;
    uint32_t *heads = NULL;
    Py_ssize_t *active = NULL, *hint_hd = NULL, n_active = 0;
    head_state *hst = NULL;
    uint32_t *hint_inc = NULL;
    media_runs *runs = NULL;
    head_table htab = {NULL, 0, 0};
    unsigned (*qmask)[LAYERS] = NULL;
    PyObject *out_heads = NULL, *out_media = NULL, *out_layers = NULL, *out_marked = NULL, *result = NULL;
    if (first.len % 8 != 0 || tagbuf.len % 8 != 0 || alive.len % 4 != 0 || n_media < 0 || n_media > 255
        || seg_pages < 1 || seg_pages > 16) {
        PyErr_SetString(PyExc_ValueError, "first_page must be int64s, tags uint64s, alive uint32s, n_media in "
                        "0..255 and segment_pages in 1..16");
        goto done;
    }
    if (n_seg > first.len / 8) {
        PyErr_SetString(PyExc_ValueError, "more values than segments in first_page");
        goto done;
    }
    sums = PyMem_Calloc((size_t)n_seg + 1, sizeof(summary));
    layer = PyMem_Malloc((size_t)n + 1);
    marked = PyMem_Calloc((size_t)n + 1, 1);
    if (sums == NULL || layer == NULL || marked == NULL) {
        failed = 1;
        goto done;
    }
    memset(layer, 255, (size_t)n + 1);
    /* Parse every summary first: a malformed one ends every run at its segment's first page, and
     * the values after it are not read. */
    for (; nv < n_seg; nv++) {
        PyObject *item = PyList_GET_ITEM(values, nv);
        if (item == Py_None) {
            sums[nv].n_layers = 0;
            sums[nv].n_holders = 0;
            sums[nv].marks = 0;
            continue;
        }
        if (!PyBytes_Check(item)
            || parse_summary((const unsigned char *)PyBytes_AS_STRING(item), PyBytes_GET_SIZE(item), &sums[nv]) < 0) {
            int64_t fp = rd_i64(fps + 8 * nv);
            malformed = 1;
            limit = fp < 0 ? 0 : (fp < (int64_t)n ? (Py_ssize_t)fp : n);
            break;
        }
    }
    /* Per query page, the layer of its tag, and the marked ones; per segment and layer, the offsets
     * whose query page's tag is at that layer (qmask). */
    qmask = PyMem_Calloc((size_t)nv + 1, sizeof(*qmask));
    if (qmask == NULL) {
        failed = 1;
        goto done;
    }
    for (Py_ssize_t s = 0; s < nv; s++) {
        int64_t fp = rd_i64(fps + 8 * s);
        const summary *sm = &sums[s];
        /* The bounds are compared before adding: fp is the caller's, and an overflow would be
         * undefined behaviour. */
        if (fp >= (int64_t)limit || fp <= -(int64_t)seg_pages)
            continue;
        int64_t lo = fp < 0 ? -fp : 0;
        int64_t hi = fp <= (int64_t)limit - seg_pages ? (int64_t)seg_pages : (int64_t)limit - fp;
        for (int64_t o = lo; o < hi; o++) {
            Py_ssize_t q = (Py_ssize_t)(fp + o);
            if (sm->marks >> o & 1 && !marked[q]) {   /* once: segments a caller made overlap */
                marked[q] = 1;
                n_marked++;
            }
            for (unsigned l = 0; l < sm->n_layers; l++) {
                const unsigned char *t = sm->tag[l][o];
                if (t != NULL && rd_u64(t) == rd_u64(tags + 8 * q)) {
                    layer[q] = (unsigned char)l;
                    qmask[s][l] |= 1u << o;
                    break;
                }
            }
        }
    }
    /* held: the first query page no holder has in a known medium; the scan stops at the segment
     * with the gap. */
    held = limit;
    int64_t expect = 0;           /* the first page after the segments scanned */
    for (Py_ssize_t s = 0; s < nv && held == limit; s++) {
        const summary *sm = &sums[s];
        int64_t fp = rd_i64(fps + 8 * s);
        if (fp >= (int64_t)limit)
            break;
        if (fp > expect) {        /* a page no segment holds */
            held = (Py_ssize_t)expect;
            break;
        }
        if (fp + seg_pages > expect)
            expect = fp + seg_pages;
        /* In the same pass, the (holder, page) pairs in a medium this build does not know, up to
         * the segment where the held pages end: absent pages, counted (what a hostile writer left
         * stops the runs there). */
        unsigned want = seg_valid(fp, seg_pages, limit), all = 0;
        for (Py_ssize_t h = 0; h < sm->n_holders; h++) {
            const unsigned char *e = sm->holders + h * sm->width;
            if (e[4] >= n_media)
                unknown += __builtin_popcount(held_offsets(sm, e, qmask[s]) & want);
            else if (all != want)
                all |= held_offsets(sm, e, qmask[s]);
        }
        if (all != want)
            held = (Py_ssize_t)(fp + __builtin_ctz(~all & want));
    }
    if (held == limit && expect < (int64_t)limit)      /* fewer values than segments */
        held = (Py_ssize_t)expect;
    if (held > 0) {
        /* The heads: the live incarnations holding page 0 (in segment 0) in a known medium. */
        const summary *sm = &sums[0];
        int64_t o0 = -rd_i64(fps);
        heads = PyMem_Malloc(((size_t)sm->n_holders + 1) * sizeof(uint32_t));
        if (heads == NULL) {
            failed = 1;
            goto done;
        }
        for (Py_ssize_t h = 0; h < sm->n_holders; h++) {
            const unsigned char *e = sm->holders + h * sm->width;
            uint32_t inc = rd_u32(e);
            if (e[4] < n_media && (held_offsets(sm, e, qmask[0]) >> o0 & 1) && find_inc(live, n_live, inc) >= 0)
                heads[k++] = inc;
        }
        qsort(heads, (size_t)k, sizeof(uint32_t), cmp_u32);
        Py_ssize_t u = 0;
        for (Py_ssize_t h = 0; h < k; h++)
            if (u == 0 || heads[u - 1] != heads[h])
                heads[u++] = heads[h];
        k = u;
    }
    if (k > 0) {
        /* Per head, its run as media runs (first page, code): segments in order, a head whose run
         * stopped in one is not looked at again, and a head with one entry in a segment (one medium:
         * the usual case) costs a few bit operations there, not one per page: the work follows the
         * holders' entries, a sixteenth of their pages. What a head needs per segment sits in one
         * head_state, and a stretch is pushed only when its code changes (at 64 holders the
         * per-entry and per-head steps were most of the decoding). */
        Py_ssize_t most = 0;
        for (Py_ssize_t s = 0; s < nv; s++)
            if (sums[s].n_holders > most)
                most = sums[s].n_holders;
        runs = PyMem_Calloc((size_t)k, sizeof(media_runs));
        hst = PyMem_Malloc((size_t)k * sizeof(head_state));
        segmed = PyMem_Malloc((size_t)k * 16);
        active = PyMem_Malloc((size_t)k * sizeof(Py_ssize_t));
        hint_inc = PyMem_Malloc(((size_t)most + 1) * sizeof(uint32_t));
        hint_hd = PyMem_Malloc(((size_t)most + 1) * sizeof(Py_ssize_t));
        if (runs == NULL || hst == NULL || segmed == NULL || active == NULL || hint_inc == NULL || hint_hd == NULL) {
            failed = 1;
            goto done;
        }
        for (Py_ssize_t hd = 0; hd < k; hd++) {
            hst[hd].run_end = 0;
            hst[hd].through = -1;
            hst[hd].stamp = -1;
            hst[hd].last = 255;
            active[hd] = hd;           /* the heads whose runs reached this segment, ascending */
        }
        /* Per entry position, the incarnation last seen there and its head (-1: none): a chain's
         * segments list their holders in about the same order, so the hash table is asked only
         * where the order changes. */
        for (Py_ssize_t h = 0; h < most; h++) {
            hint_inc[h] = 0;            /* incarnation 0 is never live: the first look misses */
            hint_hd[h] = -1;
        }
        n_active = k;
        if (head_table_make(&htab, heads, k) < 0) {
            failed = 1;
            goto done;
        }
        Py_ssize_t last_stop = 0;        /* where the runs still going after the last segment end */
        for (Py_ssize_t s = 0; s < nv; s++) {
            const summary *sm = &sums[s];
            int64_t fp = rd_i64(fps + 8 * s);
            if (fp >= (int64_t)held)
                break;
            /* clean: running heads whose first entry here holds the whole segment in the medium
             * their run ends in; when every running head is, and none has a second entry here,
             * every run goes on unchanged and the pass over the heads is skipped. */
            Py_ssize_t clean = 0;
            int twice = 0;
            Py_ssize_t seg_start = fp < 0 ? 0 : (Py_ssize_t)fp;
            Py_ssize_t seg_stop = fp + seg_pages < (int64_t)held ? (Py_ssize_t)(fp + seg_pages) : held;
            unsigned lo = (unsigned)(seg_start - fp), hi = (unsigned)(seg_stop - fp);
            unsigned valid = ((1u << hi) - 1) & ~((1u << lo) - 1);
            if (seg_start != last_stop) {       /* a segment that starts inside the last one: the runs end */
                for (Py_ssize_t a = 0; a < n_active; a++)
                    hst[active[a]].run_end = seg_start;
                n_active = 0;
                break;
            }
            for (Py_ssize_t h = 0; h < sm->n_holders; h++) {
                const unsigned char *e = sm->holders + h * sm->width;
                unsigned char m = e[4];
                if (m >= n_media)
                    continue;
                uint32_t inc = rd_u32(e);
                Py_ssize_t hd;
                if (hint_inc[h] == inc && inc != 0) {
                    hd = hint_hd[h];
                } else {
                    hd = head_find(&htab, heads, inc);
                    hint_inc[h] = inc;
                    hint_hd[h] = hd;
                }
                if (hd < 0)                     /* not a head */
                    continue;
                head_state *st = &hst[hd];
                unsigned got;
                if (st->stamp != s) {
                    if (st->through != s - 1)   /* its run stopped before */
                        continue;
                    got = held_offsets(sm, e, qmask[s]) & valid;
                    st->stamp = s;
                    st->uni = got;
                    st->single = m;
                    if (got == valid && m == st->last) {
                        st->through = s;
                        clean++;
                    }
                    continue;
                }
                twice = 1;                      /* a second entry of a running head */
                got = held_offsets(sm, e, qmask[s]) & valid;
                unsigned char *sm16 = segmed + 16 * hd;
                if (st->single != 255) {        /* a second entry: per offset from here on */
                    memset(sm16, 255, 16);
                    for (unsigned b = st->uni; b; b &= b - 1)
                        sm16[__builtin_ctz(b)] = st->single;
                    st->single = 255;
                }
                for (unsigned b = got; b; b &= b - 1) {
                    unsigned o = (unsigned)__builtin_ctz(b);
                    if (m < sm16[o])
                        sm16[o] = m;
                }
                st->uni |= got;
            }
            if (!twice && clean == n_active) {
                last_stop = seg_stop;
                continue;
            }
            Py_ssize_t still = 0;
            for (Py_ssize_t a = 0; a < n_active; a++) {
                Py_ssize_t hd = active[a];
                head_state *st = &hst[hd];
                if (st->through == s && st->single != 255) {   /* clean, and no second entry */
                    active[still++] = hd;
                    continue;
                }
                unsigned ext = st->stamp == s ? (unsigned)__builtin_ctz(~(st->uni >> lo)) : 0;
                if (ext > hi - lo)
                    ext = hi - lo;
                if (ext > 0 && st->single != 255) {       /* one medium for the whole extension */
                    if (st->single != st->last) {
                        if (runs_push(&runs[hd], fp + lo, st->single) < 0) {
                            failed = 1;
                            goto done;
                        }
                        st->last = st->single;
                    }
                } else {
                    for (unsigned o = lo; o < lo + ext; o++) {
                        unsigned char m = segmed[16 * hd + o];
                        if (m != st->last) {
                            if (runs_push(&runs[hd], fp + o, m) < 0) {
                                failed = 1;
                                goto done;
                            }
                            st->last = m;
                        }
                    }
                }
                st->run_end = seg_start + ext;
                if (st->run_end == seg_stop) {
                    st->through = s;
                    active[still++] = hd;
                }
            }
            n_active = still;
            last_stop = seg_stop;
            if (!n_active)
                break;
        }
        for (Py_ssize_t a = 0; a < n_active; a++)
            hst[active[a]].run_end = last_stop;
    }
    /* No value is read past here: making objects may run a collection, and any finalizer the values. */
    out_marked = PyBytes_FromStringAndSize(NULL, n_marked * 8);
    out_layers = PyBytes_FromStringAndSize((const char *)layer, n);
    /* Flat buffers, not an object per head: a lookup held by 128 nodes made a collection's worth of
     * objects here. heads (uint32s), then per head its pages, where its stretches start in the
     * stretch arrays (k + 1 int64s), and the stretches' first pages (int64s) and codes. */
    Py_ssize_t total = 0;
    for (Py_ssize_t hd = 0; hd < k; hd++)
        total += runs[hd].n;
    out_heads = PyBytes_FromStringAndSize((const char *)heads, k * 4);
    PyObject *pages_b = PyBytes_FromStringAndSize(NULL, k * 8), *offs_b = PyBytes_FromStringAndSize(NULL, (k + 1) * 8);
    PyObject *starts_b = PyBytes_FromStringAndSize(NULL, total * 8), *codes_b = PyBytes_FromStringAndSize(NULL, total);
    if (pages_b != NULL && offs_b != NULL && starts_b != NULL && codes_b != NULL) {
        int64_t at = 0;
        for (Py_ssize_t hd = 0; hd < k; hd++) {
            int64_t pg = (int64_t)hst[hd].run_end;
            memcpy(PyBytes_AS_STRING(pages_b) + 8 * hd, &pg, 8);
            memcpy(PyBytes_AS_STRING(offs_b) + 8 * hd, &at, 8);
            if (runs[hd].n) {
                memcpy(PyBytes_AS_STRING(starts_b) + 8 * at, runs[hd].starts, (size_t)runs[hd].n * 8);
                memcpy(PyBytes_AS_STRING(codes_b) + at, runs[hd].codes, (size_t)runs[hd].n);
            }
            at += runs[hd].n;
        }
        memcpy(PyBytes_AS_STRING(offs_b) + 8 * k, &at, 8);
        out_media = PyTuple_Pack(4, pages_b, offs_b, starts_b, codes_b);
    }
    Py_XDECREF(pages_b);
    Py_XDECREF(offs_b);
    Py_XDECREF(starts_b);
    Py_XDECREF(codes_b);
    if (out_marked == NULL || out_layers == NULL || out_heads == NULL || out_media == NULL)
        goto done;
    for (Py_ssize_t q = 0, i = 0; q < n && i < n_marked; q++) {
        if (marked[q]) {
            int64_t page = (int64_t)q;
            memcpy(PyBytes_AS_STRING(out_marked) + 8 * i++, &page, 8);
        }
    }
    result = Py_BuildValue("(nnnOOOO)", held, (Py_ssize_t)malformed, unknown, out_heads, out_media, out_layers,
                           out_marked);
done:
    if (failed)
        PyErr_NoMemory();
    PyBuffer_Release(&first);
    PyBuffer_Release(&tagbuf);
    PyBuffer_Release(&alive);
    Py_XDECREF(out_heads);
    Py_XDECREF(out_media);
    Py_XDECREF(out_layers);
    Py_XDECREF(out_marked);
    PyMem_Free(sums);
    PyMem_Free(layer);
    PyMem_Free(marked);
    PyMem_Free(heads);
    PyMem_Free(hst);
    PyMem_Free(hint_inc);
    PyMem_Free(hint_hd);
    PyMem_Free(active);
    PyMem_Free(segmed);
    for (Py_ssize_t hd = 0; runs != NULL && hd < k; hd++) {
        PyMem_Free(runs[hd].starts);
        PyMem_Free(runs[hd].codes);
    }
    PyMem_Free(runs);
    PyMem_Free(htab.slot);
    PyMem_Free(qmask);
    return result;
}

PyDoc_STRVAR(record_slots_doc,
"record_slots(values, segments, base, media, layers, slots, gens, /)\n\n"
"Fills a holder's slots and generations from its records (pof_connector/index/summary.py): values\n"
"one per segment read (bytes or None), segments (int64s) which segment each is; a query page q is\n"
"offset (q - base) % 16 of segment (q - base) // 16. For each page whose gens entry is negative and\n"
"whose segment was read, the record of (media[q], layers[q], offset) sets slots[q] and gens[q]\n"
"(int64 buffers, written in place); a page without one keeps -1. A value cut short gives what came\n"
"before the cut.");

static PyObject *py_record_slots(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *values;
    Py_buffer segs, media, layers, slots, gens;
    Py_ssize_t base;
    if (!PyArg_ParseTuple(args, "O!y*ny*y*w*w*", &PyList_Type, &values, &segs, &base, &media, &layers, &slots,
                          &gens))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = media.len, nv = PyList_GET_SIZE(values);
    if (segs.len != nv * 8 || layers.len != n || slots.len != n * 8 || gens.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "segments must be one int64 per value, layers one byte and slots and "
                        "gens one int64 per page of media");
        goto done;
    }
    const unsigned char *md = media.buf, *ly = layers.buf;
    int64_t *sl = slots.buf, *gn = gens.buf;
    for (Py_ssize_t i = 0; i < nv; i++) {
        PyObject *item = PyList_GET_ITEM(values, i);
        if (!PyBytes_Check(item))
            continue;
        const unsigned char *v = (const unsigned char *)PyBytes_AS_STRING(item), *end = v + PyBytes_GET_SIZE(item);
        int64_t s = rd_i64((const unsigned char *)segs.buf + 8 * i);
        while (end - v >= 4) {
            unsigned char gm = v[0], gl = v[1];
            unsigned mask = rd_u16(v + 2);
            v += 4;
            for (unsigned o = 0; o < 16; o++) {
                if (!(mask >> o & 1))
                    continue;
                if (end - v < 12)
                    goto next;
                /* q = base + 16 s + o, compared before adding: s is the caller's. */
                if (s >= 0 && s < (int64_t)(n / 16 + 2)) {
                    int64_t q = (int64_t)base + 16 * s + o;
                    if (q >= 0 && q < (int64_t)n && gn[q] < 0 && md[q] == gm && ly[q] == gl) {
                        sl[q] = (int64_t)rd_u32(v);
                        gn[q] = rd_i64(v + 4);
                    }
                }
                v += 12;
            }
        }
    next:;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&segs);
    PyBuffer_Release(&media);
    PyBuffer_Release(&layers);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&gens);
    return result;
}

PyDoc_STRVAR(slot_objects_doc,
"slot_objects(cls, names, values, /) -> list\n\n"
"New instances of cls made without calling it (neither __new__ nor __init__ runs), their slots set:\n"
"slot names[j] (a str: a writable __slots__ member of cls) of instance i to values[j][i] where\n"
"values[j] is a list, else to values[j]. As many instances as the lists have items (all the same;\n"
"at least one list). A lookup makes one match per holder: from Python each cost more than the\n"
"decoding of its entries.");

#define MAX_SLOTS 16

static PyObject *py_slot_objects(PyObject *self, PyObject *args)
{
    (void)self;
    PyTypeObject *cls;
    PyObject *names, *values;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyType_Type, &cls, &PyTuple_Type, &names, &PyTuple_Type, &values))
        return NULL;
    Py_ssize_t k = PyTuple_GET_SIZE(names), n = -1, off[MAX_SLOTS];
    if (k != PyTuple_GET_SIZE(values) || k > MAX_SLOTS || cls->tp_itemsize != 0 || cls->tp_alloc == NULL) {
        PyErr_SetString(PyExc_ValueError, "slot_objects: one value per name (16 at most), of a class of fixed size");
        return NULL;
    }
    /* Each name must be a writable object slot of cls itself or of a base: a member descriptor whose
     * offset lies inside the instance (anything else, and nothing is written). */
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *name = PyTuple_GET_ITEM(names, j), *v = PyTuple_GET_ITEM(values, j);
        if (!PyUnicode_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "slot_objects: names must be str");
            return NULL;
        }
        PyObject *descr = PyObject_GetAttr((PyObject *)cls, name);
        if (descr == NULL)
            return NULL;
        int ok = Py_TYPE(descr) == &PyMemberDescr_Type
                 && PyType_IsSubtype(cls, ((PyDescrObject *)descr)->d_type);
        PyMemberDef *md = ok ? ((PyMemberDescrObject *)descr)->d_member : NULL;
        ok = ok && md->type == T_OBJECT_EX && !(md->flags & READONLY)
             && md->offset >= (Py_ssize_t)sizeof(PyObject)
             && md->offset + (Py_ssize_t)sizeof(PyObject *) <= cls->tp_basicsize;
        off[j] = ok ? md->offset : 0;
        for (Py_ssize_t i = 0; ok && i < j; i++)
            ok = off[i] != off[j];                  /* a slot named twice would leak its first value */
        Py_DECREF(descr);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "slot_objects: %R is not a writable slot of %s", name, cls->tp_name);
            return NULL;
        }
        if (PyList_Check(v)) {
            if (n >= 0 && PyList_GET_SIZE(v) != n) {
                PyErr_SetString(PyExc_ValueError, "slot_objects: the lists differ in length");
                return NULL;
            }
            n = PyList_GET_SIZE(v);
        }
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "slot_objects: no list of values");
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* An allocation may run a collection, and a finalizer may change a list: checked each time. */
        PyObject *o = cls->tp_alloc(cls, 0);
        if (o == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, o);
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *v = PyTuple_GET_ITEM(values, j);
            if (PyList_Check(v)) {
                if (PyList_GET_SIZE(v) != n) {
                    PyErr_SetString(PyExc_RuntimeError, "slot_objects: a list changed while in use");
                    Py_DECREF(out);
                    return NULL;
                }
                v = PyList_GET_ITEM(v, i);
            }
            Py_INCREF(v);
            *(PyObject **)((char *)o + off[j]) = v;
        }
    }
    return out;
}

static PyMethodDef methods[] = {
    {"leading_runs", py_leading_runs, METH_VARARGS, leading_runs_doc},
    {"summary_runs", py_summary_runs, METH_VARARGS, summary_runs_doc},
    {"record_slots", py_record_slots, METH_VARARGS, record_slots_doc},
    {"slot_objects", py_slot_objects, METH_VARARGS, slot_objects_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prefix_runs", "Leading runs of a locality-index lookup's reply, and its matches.", -1, methods,
};

PyMODINIT_FUNC PyInit__prefix_runs(void)
{
    return PyModule_Create(&module);
}
