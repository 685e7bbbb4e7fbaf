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
    for (Py_ssize_t h = 0; h < k; h++) {
        run_buf *r = &runs[h];
        PyObject *inc = PyLong_FromUnsignedLong(heads[h]);
        PyObject *triple = Py_BuildValue("(NNN)", PyByteArray_FromStringAndSize((const char *)r->media, r->len),
                                         PyByteArray_FromStringAndSize((const char *)r->slots, r->len * 8),
                                         PyByteArray_FromStringAndSize((const char *)r->gens, r->len * 8));
        if (inc == NULL || triple == NULL) {
            Py_XDECREF(inc);
            Py_XDECREF(triple);
            goto done;
        }
        PyList_SET_ITEM(out_heads, h, inc);
        PyList_SET_ITEM(out_runs, h, triple);
    }
    result = Py_BuildValue("(nnnOO)", held, (Py_ssize_t)malformed, unknown, out_heads, out_runs);
done:
    Py_XDECREF(out_heads);
    Py_XDECREF(out_runs);
    for (Py_ssize_t h = 0; runs != NULL && h < k; h++) {
        PyMem_Free(runs[h].media);
        PyMem_Free(runs[h].slots);
        PyMem_Free(runs[h].gens);
    }
    PyMem_Free(runs);
    PyMem_Free(heads);
    PyMem_Free(chosen);
    PyMem_Free(active);
    PyMem_Free(best);
    return result;
}

static PyMethodDef methods[] = {
    {"leading_runs", py_leading_runs, METH_VARARGS, leading_runs_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prefix_runs", "Leading runs of a locality-index lookup's reply.", -1, methods,
};

PyMODINIT_FUNC PyInit__prefix_runs(void)
{
    return PyModule_Create(&module);
}
