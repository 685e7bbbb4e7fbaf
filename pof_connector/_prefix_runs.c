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
 * segment_runs decodes the same runs from a segment lookup's reply (one value per segment field of
 * up to segment_pages pages: 26-byte records u8 offset | u64 tag | then the holder record), as
 * SegmentQuery.decode in pof_connector/index/segments.py does in numpy. A segment value holds its
 * pages' records in any order, so each record is classified once, the known ones of the heads are
 * grouped by head (a counting sort, stable), and each head's run is read off a table of its record
 * per page with the lowest medium code (of one holder's page in two media with one code, the first
 * in the reply wins, as in numpy). It exists for the same
 * reason: a 2,000-page query is 125 values, but numpy's calls over their records cost more than the
 * server's answer.
 *
 * Every length is checked before a byte is read: the values come from a server that a broken or
 * hostile writer may have filled.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

#define SEG_RECORD 26

PyDoc_STRVAR(segment_runs_doc,
"segment_runs(values, first_page, tags, alive, n_media, segment_pages, /)\n"
"    -> (held, malformed, unknown, heads, runs, marked)\n\n"
"values: the segment lookup's HMGET reply, a list of bytes or None per segment field; first_page:\n"
"per segment, the query page at its offset 0 (int64 buffer, one entry per value at least); tags:\n"
"per query page, its tag (uint64 buffer); alive: the live incarnations as a sorted uint32 buffer;\n"
"n_media: how many medium codes this build knows; segment_pages: the pages of a segment.\n"
"held: pages up to the first one without a known record, or the segment of the first malformed\n"
"value; malformed: 1 when a value was empty or not whole records; unknown: the query's records with\n"
"a medium code >= n_media; heads: the live incarnations holding page 0, ascending; runs: per head\n"
"(media u8, slots int64, generations int64) as bytearrays, one entry per page of its run; marked:\n"
"the query pages with a marker record (incarnation 0), ascending, as int64s.");

/* A known-medium record of one of the query's pages: where it is, and its query page. */
typedef struct {
    const unsigned char *r;
    Py_ssize_t q;
} seg_rec;

/* The index of inc in heads[0..k), or -1, remembering the last answer: a reply holds one holder's
 * records together, so most lookups repeat the one before. A known record's incarnation is never 0
 * (those are markers), so *last_inc = 0 starts with nothing remembered. */
static inline Py_ssize_t head_of(const uint32_t *heads, Py_ssize_t k, uint32_t inc, uint32_t *last_inc,
                                 Py_ssize_t *last_h)
{
    if (inc != *last_inc) {
        *last_inc = inc;
        *last_h = find_inc(heads, k, inc);
    }
    return *last_h;
}

static PyObject *py_segment_runs(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *values;
    Py_buffer first, tagbuf, alive;
    int n_media, seg_pages;
    if (!PyArg_ParseTuple(args, "O!y*y*y*ii", &PyList_Type, &values, &first, &tagbuf, &alive, &n_media,
                          &seg_pages))
        return NULL;
    Py_ssize_t n_seg = PyList_GET_SIZE(values), n = tagbuf.len / 8, n_live = alive.len / 4;
    Py_ssize_t nv = 0, limit = n, held = 0, unknown = 0, most = 0, total = 0, n0 = 0, k = 0, n_marked = 0;
    int malformed = 0, failed = 0;
    const unsigned char *fps = first.buf, *tags = tagbuf.buf;
    const uint32_t *live = alive.buf;
    unsigned char *flag = NULL;
    seg_rec *known = NULL, *mine = NULL;
    uint32_t *kinc = NULL;
    Py_ssize_t *at = NULL;
    const unsigned char **tbl = NULL;
    uint32_t *own = NULL;
    uint32_t *heads = NULL;
    run_buf *runs = NULL;
    PyObject *out_heads = NULL, *out_runs = NULL, *out_marked = NULL, *result = NULL;
    if (first.len % 8 != 0 || tagbuf.len % 8 != 0 || alive.len % 4 != 0 || n_media < 0 || n_media > 255
        || seg_pages < 1 || seg_pages > 256) {
        PyErr_SetString(PyExc_ValueError, "first_page must be int64s, tags uint64s, alive uint32s, n_media in "
                        "0..255 and segment_pages in 1..256");
        goto done;
    }
    if (n_seg > first.len / 8) {
        PyErr_SetString(PyExc_ValueError, "more values than segments in first_page");
        goto done;
    }
    /* A malformed value ends every run at its segment's first page: the values after it are not read,
     * and the records before it only count on the pages before it. most: the records of the values
     * read, a bound on the known ones. */
    for (; nv < n_seg; nv++) {
        PyObject *item = PyList_GET_ITEM(values, nv);
        if (item == Py_None)
            continue;
        if (!PyBytes_Check(item) || PyBytes_GET_SIZE(item) == 0 || PyBytes_GET_SIZE(item) % SEG_RECORD != 0) {
            int64_t fp = rd_i64(fps + 8 * nv);
            malformed = 1;
            limit = fp < 0 ? 0 : (fp < (int64_t)n ? (Py_ssize_t)fp : n);
            break;
        }
        Py_ssize_t c = PyBytes_GET_SIZE(item) / SEG_RECORD;
        if (c >= PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(seg_rec) - most) {
            failed = 1;
            goto done;
        }
        most += c;
    }
    /* flag[q]: 1 when page q has a marker, 2 when it has a known record. */
    flag = PyMem_Calloc((size_t)n + 1, 1);
    known = PyMem_Malloc(((size_t)most + 1) * sizeof(seg_rec));
    kinc = PyMem_Malloc(((size_t)most + 1) * sizeof(uint32_t));
    heads = PyMem_Malloc(((size_t)most + 1) * sizeof(uint32_t));
    if (flag == NULL || known == NULL || kinc == NULL || heads == NULL) {
        failed = 1;
        goto done;
    }
    /* Each record is classified once: its page, a marker, a record of unknown medium or a known one,
     * kept in reply order with its incarnation (and those of page 0 in heads, n0 of them). */
    for (Py_ssize_t s = 0; s < nv; s++) {
        PyObject *item = PyList_GET_ITEM(values, s);
        if (item == Py_None)
            continue;
        int64_t fp = rd_i64(fps + 8 * s);
        /* The offsets lo <= off < hi are the query's pages before limit (and in the segment); the
         * bounds are compared before adding: fp is the caller's, but an overflow would be undefined
         * behaviour. */
        if (fp >= (int64_t)limit || fp <= -(int64_t)seg_pages)
            continue;
        int64_t lo = fp < 0 ? -fp : 0;
        int64_t hi = fp <= (int64_t)limit - seg_pages ? (int64_t)seg_pages : (int64_t)limit - fp;
        const unsigned char *r = (const unsigned char *)PyBytes_AS_STRING(item);
        const unsigned char *end = r + PyBytes_GET_SIZE(item);
        for (; r < end; r += SEG_RECORD) {
            int64_t off = r[0];
            if (off < lo || off >= hi)
                continue;
            Py_ssize_t q = (Py_ssize_t)(fp + off);
            if (rd_u32(r + 9) == 0) {
                n_marked += !(flag[q] & 1);
                flag[q] |= 1;
                continue;
            }
            if (rd_u64(r + 1) != rd_u64(tags + 8 * q))   /* another chain's page at this offset */
                continue;
            if (r[13] >= n_media) {
                unknown++;
                continue;
            }
            uint32_t inc = rd_u32(r + 9);
            flag[q] |= 2;
            if (q == 0)
                heads[n0++] = inc;
            known[total].r = r;
            known[total].q = q;
            kinc[total] = inc;
            total++;
        }
    }
    for (held = 0; held < limit && (flag[held] & 2); held++)
        ;
    if (held > 0) {
        /* The heads: the live incarnations among page 0's known records, ascending, once each. */
        for (Py_ssize_t i = 0; i < n0; i++)
            if (find_inc(live, n_live, heads[i]) >= 0)
                heads[k++] = heads[i];
        qsort(heads, (size_t)k, sizeof(uint32_t), cmp_u32);
        Py_ssize_t u = 0;
        for (Py_ssize_t h = 0; h < k; h++)
            if (u == 0 || heads[u - 1] != heads[h])
                heads[u++] = heads[h];
        k = u;
    }
    if (k > 0) {
        /* The heads' records of the held pages, grouped by head (a counting sort, stable: reply
         * order within a head). */
        uint32_t last_inc = 0;
        Py_ssize_t last_h = -1;
        at = PyMem_Calloc((size_t)k + 1, sizeof(Py_ssize_t));
        runs = PyMem_Calloc((size_t)k, sizeof(run_buf));
        tbl = PyMem_Malloc((size_t)held * sizeof(*tbl));
        own = PyMem_Calloc((size_t)held, sizeof(*own));
        if (at == NULL || runs == NULL || tbl == NULL || own == NULL) {
            failed = 1;
            goto done;
        }
        /* kinc[i] becomes record i's head index, or UINT32_MAX: k <= UINT32_MAX (the heads are distinct
         * nonzero uint32s), so every index is below it. */
        for (Py_ssize_t i = 0; i < total; i++) {
            Py_ssize_t h = known[i].q < held ? head_of(heads, k, kinc[i], &last_inc, &last_h) : -1;
            if (h >= 0) {
                at[h + 1]++;
                kinc[i] = (uint32_t)h;
            } else {
                kinc[i] = UINT32_MAX;
            }
        }
        for (Py_ssize_t h = 1; h <= k; h++)
            at[h] += at[h - 1];
        mine = PyMem_Malloc(((size_t)at[k] + 1) * sizeof(seg_rec));
        if (mine == NULL) {
            failed = 1;
            goto done;
        }
        /* One holder's records come together: its cursor stays in a register while they do. */
        uint32_t cur = 0;
        Py_ssize_t pos = at[0];
        for (Py_ssize_t i = 0; i < total; i++) {
            uint32_t h = kinc[i];
            if (h == UINT32_MAX)
                continue;
            if (h != cur) {
                at[cur] = pos;
                cur = h;
                pos = at[h];
            }
            mine[pos++] = known[i];
        }
        at[cur] = pos;
        /* Now mine[at[h - 1] .. at[h]) are head h's (at[-1] being 0). Per head, tbl[q] takes its record
         * of page q with the lowest medium code (strictly lower: the first one of a code), own[q] = h + 1
         * saying tbl[q] is this head's (k <= UINT32_MAX: no overflow), and its run is the pages from 0
         * that have one: at most its records, e - b <= most, so the sizes below do not overflow. */
        for (Py_ssize_t h = 0; h < k; h++) {
            Py_ssize_t b = h > 0 ? at[h - 1] : 0, e = at[h], len = 0;
            uint32_t me = (uint32_t)h + 1;
            for (Py_ssize_t i = b; i < e; i++) {
                const unsigned char *r = mine[i].r;
                Py_ssize_t q = mine[i].q;
                if (own[q] != me || r[13] < tbl[q][13]) {
                    own[q] = me;
                    tbl[q] = r;
                }
            }
            run_buf *run = &runs[h];
            run->media = PyMem_Malloc((size_t)(e - b));
            run->slots = PyMem_Malloc((size_t)(e - b) * 8);
            run->gens = PyMem_Malloc((size_t)(e - b) * 8);
            if (run->media == NULL || run->slots == NULL || run->gens == NULL) {
                failed = 1;
                goto done;
            }
            for (; len < held && own[len] == me; len++) {
                const unsigned char *r = tbl[len];
                run->media[len] = r[13];
                run->slots[len] = (int64_t)rd_u32(r + 14);
                run->gens[len] = rd_i64(r + 18);
            }
            run->len = run->cap = len;
        }
    }
    /* No record is read past here: making objects may run a collection, and any finalizer the values. */
    out_marked = PyBytes_FromStringAndSize(NULL, n_marked * 8);
    out_heads = PyList_New(k);
    out_runs = PyList_New(k);
    if (out_marked == NULL || out_heads == NULL || out_runs == NULL)
        goto done;
    for (Py_ssize_t q = 0, i = 0; q < n && i < n_marked; q++) {
        if (flag[q] & 1) {
            int64_t page = (int64_t)q;
            memcpy(PyBytes_AS_STRING(out_marked) + 8 * i++, &page, 8);
        }
    }
    if (fill_runs(runs, heads, k, out_heads, out_runs) < 0)
        goto done;
    result = Py_BuildValue("(nnnOOO)", held, (Py_ssize_t)malformed, unknown, out_heads, out_runs, out_marked);
done:
    if (failed)
        PyErr_NoMemory();
    PyBuffer_Release(&first);
    PyBuffer_Release(&tagbuf);
    PyBuffer_Release(&alive);
    Py_XDECREF(out_heads);
    Py_XDECREF(out_runs);
    Py_XDECREF(out_marked);
    free_runs(runs, k);
    PyMem_Free(heads);
    PyMem_Free(at);
    PyMem_Free(tbl);
    PyMem_Free(own);
    PyMem_Free(mine);
    PyMem_Free(known);
    PyMem_Free(kinc);
    PyMem_Free(flag);
    return result;
}

static PyMethodDef methods[] = {
    {"leading_runs", py_leading_runs, METH_VARARGS, leading_runs_doc},
    {"segment_runs", py_segment_runs, METH_VARARGS, segment_runs_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prefix_runs", "Leading runs of a locality-index lookup's reply.", -1, methods,
};

PyMODINIT_FUNC PyInit__prefix_runs(void)
{
    return PyModule_Create(&module);
}
