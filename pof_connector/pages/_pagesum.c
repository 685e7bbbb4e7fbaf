/* Fused copy + per-layer checksum of page segments (page format v3), see pof_connector/pages/page_sum.py
 * for the definition and its bound.
 *
 * In short, with keys K[0..257] and a point r (mod p = 2^61 - 1) derived from a 64-bit seed by
 * SplitMix64: each 1 KiB block of 256 little-endian 32-bit words (the segment zero-padded to whole
 * blocks) is hashed by NH with a 2-fold Toeplitz key,
 *     h1 = sum_i ((x_2i + K[2i]) mod 2^32) * ((x_2i+1 + K[2i+1]) mod 2^32)          mod 2^64
 *     h2 = sum_i ((x_2i + K[2i+2]) mod 2^32) * ((x_2i+1 + K[2i+3]) mod 2^32)        mod 2^64
 * and the 32-bit halves lo(h1), hi(h1), lo(h2), hi(h2) of every block, in order, are the
 * coefficients of a polynomial evaluated at r (Horner, mod p): that is the checksum.
 *
 * A copy loads each byte once, stores it and feeds it to NH in the same loop, so the bytes cross
 * the memory bus once and the arithmetic hides behind the memory traffic. The NH state streams
 * (position in the block, lane sums, Horner accumulator), so a segment may be summed in any
 * number of calls of whole 64-byte chunks, in order (the vLLM layouts sum row by row). The GIL is
 * released around large calls.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE           /* CPU_SET and pthread_setaffinity_np, for the copy crew's threads */
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LANES 16                     /* 32-bit words per chunk: 64 bytes, one cache line */
#define BLOCK (4 * LANES)            /* bytes per chunk (the streaming granule) */
#define NH_WORDS 256                 /* words per NH block: 1 KiB */
#define NH_KEYS (NH_WORDS + 2)
#define NH_CHUNKS (NH_WORDS / LANES) /* chunks per NH block */
#define P61 ((1ULL << 61) - 1)
#define RELEASE_GIL_BYTES (64 * 1024)

/* The key material of one seed. */
typedef struct {
    uint32_t k[NH_KEYS];
    uint64_t r[4];                   /* r, r^2, r^3, r^4 mod p */
    uint64_t z1[NH_CHUNKS + 1];      /* h1's terms of zero words from chunk q to the block's end */
    uint64_t z2[NH_CHUNKS + 1];
    uint64_t seed;
} nh_keys;

typedef struct {
    const nh_keys *keys;
    size_t pos;                      /* words of the current NH block summed (a multiple of LANES) */
    uint64_t h1[4], h2[4];           /* the block's lane sums, mod 2^64 */
    uint64_t acc;                    /* the polynomial so far, < 2^61 + 2 (reduced at the end) */
    uint64_t blocks;                 /* NH blocks folded into acc */
} sum_state;

static inline uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

#ifdef __SIZEOF_INT128__
typedef unsigned __int128 u128;
#define MUL128(a, b) ((u128)(a) * (b))
/* x mod p up to a small multiple, for x < 2^125: < 2^61 + 2 */
static inline uint64_t reduce128(u128 x)
{
    uint64_t s = ((uint64_t)x & P61) + ((uint64_t)(x >> 61) & P61) + (uint64_t)(x >> 122);
    return (s & P61) + (s >> 61);
}
#else
#error "the page checksum kernel needs a compiler with 128-bit integers (GCC or Clang on a 64-bit target)"
#endif

static inline uint64_t canonical(uint64_t x)     /* x < 2^62: x mod p */
{
    x = (x & P61) + (x >> 61);
    return x >= P61 ? x - P61 : x;
}

static inline uint64_t mulmod(uint64_t a, uint64_t b)
{
    return canonical(reduce128(MUL128(a, b)));
}

static void derive_keys(nh_keys *k, uint64_t seed)
{
    uint64_t state = seed, v;
    for (int i = 0; i < NH_KEYS; i++)
        k->k[i] = (uint32_t)splitmix64(&state);
    do
        v = splitmix64(&state) & P61;
    while (v < 2 || v >= P61);
    k->r[0] = v;
    for (int i = 1; i < 4; i++)
        k->r[i] = mulmod(k->r[i - 1], v);
    k->z1[NH_CHUNKS] = k->z2[NH_CHUNKS] = 0;
    for (int q = NH_CHUNKS - 1; q >= 0; q--) {
        uint64_t a = 0, b = 0;
        for (int w = q * LANES; w < (q + 1) * LANES; w += 2) {
            a += (uint64_t)k->k[w] * k->k[w + 1];
            b += (uint64_t)k->k[w + 2] * k->k[w + 3];
        }
        k->z1[q] = k->z1[q + 1] + a;
        k->z2[q] = k->z2[q + 1] + b;
    }
    k->seed = seed;
}

/* The keys of `seed`: this thread's last ones, derived again when the seed changed (~1 us). Valid
 * until this thread's next call with another seed. */
static const nh_keys *keys_for(uint64_t seed)
{
    static __thread nh_keys cache;
    static __thread int valid;
    if (!valid || cache.seed != seed) {
        derive_keys(&cache, seed);
        valid = 1;
    }
    return &cache;
}

static inline void state_init(sum_state *s, const nh_keys *keys)
{
    memset(s, 0, sizeof *s);
    s->keys = keys;
}

/* End of an NH block: its four elements into the polynomial, as four Horner steps at once:
 * acc' = (acc + e0) r^4 + e1 r^3 + e2 r^2 + e3 r (independent multiplies, one reduction). */
static inline void fold_block(sum_state *s, uint64_t h1, uint64_t h2)
{
    const uint64_t *r = s->keys->r;
    u128 x = MUL128(s->acc + (h1 & 0xFFFFFFFFu), r[3]) + MUL128(h1 >> 32, r[2]) + MUL128(h2 & 0xFFFFFFFFu, r[1])
             + MUL128(h2 >> 32, r[0]);                 /* < 2^62 * 2^61 + 3 * 2^93 */
    s->acc = reduce128(x);
    s->blocks++;
}

/* Feed `nchunks` whole 64-byte chunks at `p` into the state; with `dst`, also copy them there
 * (one pass: each byte is loaded once, stored once and summed while in a register). `stream`: the
 * copy may bypass the caches (non-temporal stores: no read for ownership of the lines written);
 * only honoured with a 32-byte aligned `dst`. 1: fenced before returning, so stores issued after
 * the call (a tier slot's page header, its generation word last) become visible after these;
 * 2: not fenced, the caller fences once after many calls. */
typedef void (*sum_blocks_fn)(const unsigned char *p, unsigned char *dst, size_t nchunks, sum_state *s, int stream);

static void sum_blocks_generic(const unsigned char *p, unsigned char *dst, size_t nchunks, sum_state *s,
                               int stream)
{
    (void)stream;
    const uint32_t *K = s->keys->k;
    size_t pos = s->pos;
    uint64_t h1[4], h2[4];
    memcpy(h1, s->h1, sizeof h1);
    memcpy(h2, s->h2, sizeof h2);
    for (size_t j = 0; j < nchunks; j++) {
        uint32_t w[LANES];
        memcpy(w, p + j * BLOCK, BLOCK);
        if (dst != NULL)
            memcpy(dst + j * BLOCK, w, BLOCK);
        const uint32_t *k = K + pos;
        for (int i = 0; i < LANES; i += 2) {
            h1[(i >> 1) & 3] += (uint64_t)(uint32_t)(w[i] + k[i]) * (uint32_t)(w[i + 1] + k[i + 1]);
            h2[(i >> 1) & 3] += (uint64_t)(uint32_t)(w[i] + k[i + 2]) * (uint32_t)(w[i + 1] + k[i + 3]);
        }
        pos += LANES;
        if (pos == NH_WORDS) {
            fold_block(s, h1[0] + h1[1] + h1[2] + h1[3], h2[0] + h2[1] + h2[2] + h2[3]);
            memset(h1, 0, sizeof h1);
            memset(h2, 0, sizeof h2);
            pos = 0;
        }
    }
    memcpy(s->h1, h1, sizeof h1);
    memcpy(s->h2, h2, sizeof h2);
    s->pos = pos;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1

__attribute__((target("avx2"))) static inline uint64_t hsum4(__m256i v)
{
    __m128i x = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return (uint64_t)_mm_cvtsi128_si64(x) + (uint64_t)_mm_extract_epi64(x, 1);
}

/* Per 8 words: add the key words (vpaddd, aligned for h1 and shifted by 2 for h2), multiply each
 * 64-bit lane's low word by its high one (vpsrlq 32, vpmuludq) and accumulate (vpaddq). */
#define NH8(x, kp, h1, h2)                                                                             \
    do {                                                                                              \
        __m256i s_ = _mm256_add_epi32((x), _mm256_loadu_si256((const __m256i *)(kp)));                \
        __m256i t_ = _mm256_add_epi32((x), _mm256_loadu_si256((const __m256i *)((kp) + 2)));          \
        h1 = _mm256_add_epi64(h1, _mm256_mul_epu32(s_, _mm256_srli_epi64(s_, 32)));                   \
        h2 = _mm256_add_epi64(h2, _mm256_mul_epu32(t_, _mm256_srli_epi64(t_, 32)));                   \
    } while (0)

__attribute__((target("avx2"))) static void sum_blocks_avx2(const unsigned char *p, unsigned char *dst,
                                                            size_t nchunks, sum_state *s, int stream)
{
    int fence = stream == 1;
    stream = stream && dst != NULL && ((uintptr_t)dst & 31) == 0;
    const uint32_t *K = s->keys->k;
    size_t pos = s->pos;
    __m256i h1 = _mm256_loadu_si256((const __m256i *)s->h1), h2 = _mm256_loadu_si256((const __m256i *)s->h2);
    while (nchunks > 0) {
        size_t run = (NH_WORDS - pos) / LANES;
        if (run > nchunks)
            run = nchunks;
        const uint32_t *k = K + pos;
        for (size_t j = 0; j < run; j++, p += BLOCK, k += LANES) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)p), x1 = _mm256_loadu_si256((const __m256i *)(p + 32));
            if (dst != NULL) {
                if (stream) {
                    _mm256_stream_si256((__m256i *)dst, x0);
                    _mm256_stream_si256((__m256i *)(dst + 32), x1);
                } else {
                    _mm256_storeu_si256((__m256i *)dst, x0);
                    _mm256_storeu_si256((__m256i *)(dst + 32), x1);
                }
                dst += BLOCK;
            }
            NH8(x0, k, h1, h2);
            NH8(x1, k + 8, h1, h2);
        }
        nchunks -= run;
        pos += run * LANES;
        if (pos == NH_WORDS) {
            fold_block(s, hsum4(h1), hsum4(h2));
            h1 = h2 = _mm256_setzero_si256();
            pos = 0;
        }
    }
    _mm256_storeu_si256((__m256i *)s->h1, h1);
    _mm256_storeu_si256((__m256i *)s->h2, h2);
    s->pos = pos;
    if (stream && fence)
        _mm_sfence();
}
#endif

static sum_blocks_fn sum_blocks = sum_blocks_generic;

/* The checksum, given the state after the segment's whole chunks and the `len` bytes after them
 * (< 64, the tail): the tail zero-padded to a chunk, the zero words to the end of the NH block
 * (their terms precomputed per key), then the polynomial reduced mod p. */
static uint64_t finish(sum_state *s, const unsigned char *tail, size_t len)
{
    if (len > 0) {
        unsigned char chunk[BLOCK] = {0};
        memcpy(chunk, tail, len);        /* little-endian hosts only (x86, the tiers' requirement) */
        sum_blocks_generic(chunk, NULL, 1, s, 0);
    }
    if (s->pos > 0 || s->blocks == 0) {  /* a partial block, or no block at all: pad with zero words */
        size_t q = s->pos / LANES;
        fold_block(s, s->h1[0] + s->h1[1] + s->h1[2] + s->h1[3] + s->keys->z1[q],
                   s->h2[0] + s->h2[1] + s->h2[2] + s->h2[3] + s->keys->z2[q]);
        memset(s->h1, 0, sizeof s->h1);
        memset(s->h2, 0, sizeof s->h2);
        s->pos = 0;
    }
    return canonical(s->acc);
}

static uint64_t sum_one(const unsigned char *p, size_t len, const nh_keys *keys)
{
    sum_state s;
    state_init(&s, keys);
    size_t whole = len / BLOCK * BLOCK;
    sum_blocks(p, NULL, len / BLOCK, &s, 0);
    return finish(&s, p + whole, len - whole);
}

static uint64_t copy_sum_one(unsigned char *dst, const unsigned char *src, size_t len, int stream,
                             const nh_keys *keys)
{
    sum_state s;
    state_init(&s, keys);
    size_t whole = len / BLOCK * BLOCK;
    sum_blocks(src, dst, len / BLOCK, &s, stream);
    memcpy(dst + whole, src + whole, len - whole);
    return finish(&s, dst + whole, len - whole);
}

static PyObject *as_tuple(const uint64_t *sums, Py_ssize_t count)
{
    PyObject *out = PyTuple_New(count);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* "O&" converter of a checksum seed: a Python int in [0, 2^64). */
static int seed_arg(PyObject *obj, void *out)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a checksum seed must be an int, not %.100s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "a checksum seed must be a 64-bit unsigned integer");
        return 0;
    }
    *(uint64_t *)out = (uint64_t)v;
    return 1;
}

static int segment_count(Py_ssize_t total, Py_ssize_t seg, Py_ssize_t *count)
{
    if (seg <= 0 || total % seg != 0) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not a whole number of %zd-byte segments", total, seg);
        return -1;
    }
    *count = total / seg;
    return 0;
}

PyDoc_STRVAR(checksums_doc,
             "checksums(buf, segment_bytes, seed) -> tuple: the checksum of each segment of buf under seed.");

static PyObject *py_checksums(PyObject *self, PyObject *args)
{
    Py_buffer src;
    Py_ssize_t seg, count;
    uint64_t seed;
    if (!PyArg_ParseTuple(args, "y*nO&", &src, &seg, seed_arg, &seed))
        return NULL;
    if (segment_count(src.len, seg, &count) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    uint64_t *sums = PyMem_Malloc(sizeof(uint64_t) * (count ? count : 1));
    if (sums == NULL) {
        PyBuffer_Release(&src);
        return PyErr_NoMemory();
    }
    const unsigned char *p = src.buf;
    Py_BEGIN_ALLOW_THREADS
    const nh_keys *keys = keys_for(seed);
    for (Py_ssize_t i = 0; i < count; i++)
        sums[i] = sum_one(p + i * seg, (size_t)seg, keys);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyObject *out = as_tuple(sums, count);
    PyMem_Free(sums);
    return out;
}

PyDoc_STRVAR(copy_checksums_doc,
             "copy_checksums(dst, src, segment_bytes, seed, head=0) -> tuple: copy src into dst (same length) and "
             "return the checksum under seed of each segment of the copy after its first `head` bytes (copied, not "
             "summed).");

static PyObject *py_copy_checksums(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    Py_ssize_t seg, count, head = 0;
    uint64_t seed;
    if (!PyArg_ParseTuple(args, "w*y*nO&|n", &dst, &src, &seg, seed_arg, &seed, &head))
        return NULL;
    PyObject *out = NULL;
    uint64_t *sums = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes into %zd", src.len, dst.len);
        goto done;
    }
    if (head < 0 || head > src.len) {
        PyErr_Format(PyExc_ValueError, "head of %zd bytes in a copy of %zd", head, src.len);
        goto done;
    }
    if (segment_count(src.len - head, seg, &count) < 0)
        goto done;
    sums = PyMem_Malloc(sizeof(uint64_t) * (count ? count : 1));
    if (sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *d = (unsigned char *)dst.buf + head;
    const unsigned char *s = (const unsigned char *)src.buf + head;
    const nh_keys *keys = keys_for(seed);
    if (src.len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst.buf, src.buf, (size_t)head);
        for (Py_ssize_t i = 0; i < count; i++)
            sums[i] = copy_sum_one(d + i * seg, s + i * seg, (size_t)seg, 0, keys);
        Py_END_ALLOW_THREADS
    } else {
        memcpy(dst.buf, src.buf, (size_t)head);
        for (Py_ssize_t i = 0; i < count; i++)
            sums[i] = copy_sum_one(d + i * seg, s + i * seg, (size_t)seg, 0, keys);
    }
    out = as_tuple(sums, count);
done:
    PyMem_Free(sums);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return out;
}

/* Buffers of the first `count` items of `seq` into `views`, each `seg` bytes long; `*got` counts
   the views acquired (the caller releases them, also after a failure). -1 with an exception set. */
static int acquire_segments(PyObject *seq, Py_buffer *views, Py_ssize_t count, Py_ssize_t seg, Py_ssize_t *got)
{
    for (; *got < count; (*got)++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, *got), &views[*got], PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        if (views[*got].len != seg) {
            PyErr_Format(PyExc_ValueError, "segment %zd has %zd bytes, expected %zd", *got, views[*got].len, seg);
            (*got)++;
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(gather_checksums_doc,
             "gather_checksums(dst, srcs, seed, stream=False) -> tuple: copy each buffer of srcs (all of len(dst) // "
             "len(srcs) bytes) into consecutive segments of dst and return the checksum under seed of each copy. "
             "stream: bypass the caches (for a destination nobody reads soon).");

static PyObject *py_gather_checksums(PyObject *self, PyObject *args)
{
    Py_buffer dst;
    PyObject *seq_in;
    int stream = 0;
    uint64_t seed;
    if (!PyArg_ParseTuple(args, "w*OO&|p", &dst, &seq_in, seed_arg, &seed, &stream))
        return NULL;
    PyObject *seq = PySequence_Fast(seq_in, "srcs must be a sequence of buffers");
    if (seq == NULL) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), got = 0, seg = 0;
    PyObject *out = NULL;
    Py_buffer *views = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
    uint64_t *sums = PyMem_Malloc(sizeof(uint64_t) * (count ? count : 1));
    if (views == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (count == 0 || dst.len % count != 0) {
        PyErr_Format(PyExc_ValueError, "%zd bytes cannot hold %zd equal segments", dst.len, count);
        goto done;
    }
    seg = dst.len / count;
    if (acquire_segments(seq, views, count, seg, &got) < 0)
        goto done;
    unsigned char *d = dst.buf;
    const nh_keys *keys = keys_for(seed);
    if (dst.len >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < count; i++)
            sums[i] = copy_sum_one(d + i * seg, views[i].buf, (size_t)seg, stream, keys);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < count; i++)
            sums[i] = copy_sum_one(d + i * seg, views[i].buf, (size_t)seg, stream, keys);
    }
    out = as_tuple(sums, count);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(sums);
    Py_DECREF(seq);
    PyBuffer_Release(&dst);
    return out;
}

/* ---- whole pages: one call per store or load (page format v3) -------------------------------
 *
 * At 64 KiB pages the Python around a fused copy (building and parsing the header, slicing views,
 * comparing tuples) costs as much as the copy itself, so a tier's store and load of a whole page
 * are one call each. Header layout: see pof_connector/pages/layout.py. The header checksum (xxh3-64 of
 * bytes [0, 80) + [88, header_bytes), the checksum seed included) is computed by the xxhash
 * package the Python side already uses, called from here, so both sides agree by construction. */

#define HDR_NS_AT 8
#define HDR_DIGEST_AT 24
#define HDR_GEN_AT 56
#define HDR_GEOMETRY_AT 64       /* num_layers, segment_bytes, page_tokens, reserved: 16 bytes */
#define HDR_CHECKSUM_AT 80
#define HDR_SEED_AT 88
#define HDR_SUMS_AT 96

static PyObject *xxh3_intdigest;        /* xxhash.xxh3_64_intdigest, imported on first use */

static inline uint32_t le32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t le64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* The header checksum of the `hb`-byte header at `h`; -1 with an exception set on failure. */
static int header_checksum(const unsigned char *h, Py_ssize_t hb, uint64_t *out)
{
    if (xxh3_intdigest == NULL) {
        PyObject *mod = PyImport_ImportModule("xxhash");
        if (mod == NULL)
            return -1;
        xxh3_intdigest = PyObject_GetAttrString(mod, "xxh3_64_intdigest");
        Py_DECREF(mod);
        if (xxh3_intdigest == NULL)
            return -1;
    }
    PyObject *joined = PyBytes_FromStringAndSize(NULL, hb - 8);
    if (joined == NULL)
        return -1;
    memcpy(PyBytes_AS_STRING(joined), h, HDR_CHECKSUM_AT);
    memcpy(PyBytes_AS_STRING(joined) + HDR_CHECKSUM_AT, h + HDR_SEED_AT, (size_t)(hb - HDR_SEED_AT));
    PyObject *r = PyObject_CallOneArg(xxh3_intdigest, joined);
    Py_DECREF(joined);
    if (r == NULL)
        return -1;
    *out = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* Geometry of a header template (a v3 header of the tier's spec): -1 with ValueError when the
 * template is not one, or the page does not fit `room` bytes from `offset`. */
static int template_geometry(const Py_buffer *tpl, Py_ssize_t *layers, Py_ssize_t *seg)
{
    const unsigned char *t = tpl->buf;
    if (tpl->len < HDR_SUMS_AT) {
        PyErr_SetString(PyExc_ValueError, "header template shorter than a header");
        return -1;
    }
    *layers = le32(t + HDR_GEOMETRY_AT);
    *seg = le32(t + HDR_GEOMETRY_AT + 4);
    /* The limits of pages.py (MAX_LAYERS, MAX_SEGMENT_BYTES): page sizes cannot overflow. */
    if (*layers < 1 || *layers > 1024 || *seg < 1 || *seg > (1 << 30)
        || tpl->len != (HDR_SUMS_AT + 8 * *layers + 63) / 64 * 64) {
        PyErr_Format(PyExc_ValueError, "header template of %zd bytes for %zd layers", tpl->len, *layers);
        return -1;
    }
    return 0;
}

static int key_parts(const Py_buffer *ns, const Py_buffer *digest)
{
    if (ns->len != HDR_DIGEST_AT - HDR_NS_AT || digest->len != HDR_GEN_AT - HDR_DIGEST_AT) {
        PyErr_Format(PyExc_ValueError, "key of %zd + %zd bytes, expected 16 + 32", ns->len, digest->len);
        return -1;
    }
    return 0;
}

static inline void compiler_barrier(void)
{
#if defined(__GNUC__)
    __asm__ __volatile__("" ::: "memory");
#endif
}

PyDoc_STRVAR(store_page_doc,
             "store_page(region, offset, template, namespace, digest, generation, seed, srcs, stream) -> None: "
             "write a v3 page into region[offset:]: copy each of srcs (one segment per layer) summing it under seed, "
             "then the header (template's fixed fields, the key, the seed, the segment checksums, the header "
             "checksum) with its generation field zero, then the generation word last. stream: bypass the caches "
             "for the segments.");

static PyObject *py_store_page(PyObject *self, PyObject *args)
{
    Py_buffer region, tpl, ns, digest;
    Py_ssize_t offset;
    unsigned long long generation;
    uint64_t seed;
    PyObject *seq_in;
    int stream = 0;
    if (!PyArg_ParseTuple(args, "w*ny*y*y*KO&O|p", &region, &offset, &tpl, &ns, &digest, &generation, seed_arg,
                          &seed, &seq_in, &stream))
        return NULL;
    PyObject *out = NULL, *seq = NULL;
    Py_buffer *views = NULL;
    unsigned char *hdr = NULL;
    Py_ssize_t layers, seg, got = 0, hb = tpl.len;
    if (template_geometry(&tpl, &layers, &seg) < 0 || key_parts(&ns, &digest) < 0)
        goto done;
    if (offset < 0 || offset > region.len - (hb + layers * seg)) {
        PyErr_Format(PyExc_ValueError, "page of %zd bytes at %zd outside a region of %zd", hb + layers * seg,
                     offset, region.len);
        goto done;
    }
    seq = PySequence_Fast(seq_in, "srcs must be a sequence of buffers");
    if (seq == NULL)
        goto done;
    if (PySequence_Fast_GET_SIZE(seq) != layers) {
        PyErr_Format(PyExc_ValueError, "%zd layer segments for %zd layers", PySequence_Fast_GET_SIZE(seq), layers);
        goto done;
    }
    views = PyMem_Calloc((size_t)layers, sizeof(Py_buffer));
    hdr = PyMem_Malloc((size_t)hb);
    if (views == NULL || hdr == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (acquire_segments(seq, views, layers, seg, &got) < 0)
        goto done;
    unsigned char *slot = (unsigned char *)region.buf + offset;
    uint64_t *sums = (uint64_t *)(hdr + HDR_SUMS_AT);     /* hdr is malloc-aligned, HDR_SUMS_AT % 8 == 0 */
    const nh_keys *keys = keys_for(seed);
    if (layers * seg >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < layers; i++)
            sums[i] = copy_sum_one(slot + hb + i * seg, views[i].buf, (size_t)seg, stream, keys);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < layers; i++)
            sums[i] = copy_sum_one(slot + hb + i * seg, views[i].buf, (size_t)seg, stream, keys);
    }
    memcpy(hdr, tpl.buf, HDR_SEED_AT);
    memcpy(hdr + HDR_SEED_AT, &seed, 8);
    memset(hdr + HDR_SUMS_AT + 8 * layers, 0, (size_t)(hb - HDR_SUMS_AT - 8 * layers));
    memcpy(hdr + HDR_NS_AT, ns.buf, 16);
    memcpy(hdr + HDR_DIGEST_AT, digest.buf, 32);
    uint64_t gen = generation, hsum;
    memcpy(hdr + HDR_GEN_AT, &gen, 8);
    if (header_checksum(hdr, hb, &hsum) < 0)
        goto done;
    memcpy(hdr + HDR_CHECKSUM_AT, &hsum, 8);
    /* Readers see generation 0 (set when the slot was prepared) until every other byte is stored:
     * plain stores in program order (x86 TSO; the streaming stores above were fenced). */
    memcpy(slot, hdr, HDR_GEN_AT);
    memcpy(slot + HDR_GEOMETRY_AT, hdr + HDR_GEOMETRY_AT, (size_t)(hb - HDR_GEOMETRY_AT));
    compiler_barrier();
    *(volatile uint64_t *)(slot + HDR_GEN_AT) = gen;
    out = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(hdr);
    Py_XDECREF(seq);
    PyBuffer_Release(&region);
    PyBuffer_Release(&tpl);
    PyBuffer_Release(&ns);
    PyBuffer_Release(&digest);
    return out;
}

PyDoc_STRVAR(load_page_doc,
             "load_page(dst, region, offset, template, namespace, digest, generation) -> (seed, sums) | None: copy "
             "the page at region[offset:] into dst, summing its segments as they are copied under the checksum "
             "seed of the copied header, and return that seed and the segment checksums when the copy is a v3 page "
             "of template's geometry holding this key at this generation, with a valid header checksum and segment "
             "checksums, and the slot's live generation is still `generation` after the copy. None: any check "
             "failed, or dst is too short (the caller finds out which on its slow path).");

static PyObject *py_load_page(PyObject *self, PyObject *args)
{
    Py_buffer dst, region, tpl, ns, digest;
    Py_ssize_t offset;
    unsigned long long generation;
    if (!PyArg_ParseTuple(args, "w*y*ny*y*y*K", &dst, &region, &offset, &tpl, &ns, &digest, &generation))
        return NULL;
    PyObject *out = NULL;
    uint64_t *sums = NULL;
    Py_ssize_t layers, seg, hb = tpl.len;
    if (template_geometry(&tpl, &layers, &seg) < 0 || key_parts(&ns, &digest) < 0)
        goto done;
    Py_ssize_t page = hb + layers * seg;
    if (offset < 0 || offset > region.len - page) {
        PyErr_Format(PyExc_ValueError, "page of %zd bytes at %zd outside a region of %zd", page, offset, region.len);
        goto done;
    }
    if (dst.len < page) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    sums = PyMem_Malloc(sizeof(uint64_t) * (size_t)layers);
    if (sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const unsigned char *slot = (const unsigned char *)region.buf + offset;
    unsigned char *d = dst.buf;
    uint64_t live, seed;
    /* The segments are summed under the seed of the header copied first: a header torn or stale
     * by then fails its own checks below (header checksum, generation), so its seed is trusted
     * only together with the rest of it. */
    if (page >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(d, slot, (size_t)hb);
        seed = le64(d + HDR_SEED_AT);
        const nh_keys *keys = keys_for(seed);
        for (Py_ssize_t i = 0; i < layers; i++)
            sums[i] = copy_sum_one(d + hb + i * seg, slot + hb + i * seg, (size_t)seg, 0, keys);
        compiler_barrier();
        live = *(const volatile uint64_t *)(slot + HDR_GEN_AT);     /* after the copy: x86 keeps loads in order */
        Py_END_ALLOW_THREADS
    } else {
        memcpy(d, slot, (size_t)hb);
        seed = le64(d + HDR_SEED_AT);
        const nh_keys *keys = keys_for(seed);
        for (Py_ssize_t i = 0; i < layers; i++)
            sums[i] = copy_sum_one(d + hb + i * seg, slot + hb + i * seg, (size_t)seg, 0, keys);
        compiler_barrier();
        live = *(const volatile uint64_t *)(slot + HDR_GEN_AT);
    }
    const unsigned char *t = tpl.buf;
    int ok = live == generation && le64(d + HDR_GEN_AT) == generation
             && memcmp(d, t, HDR_NS_AT) == 0                                   /* magic, version 3, kind */
             && memcmp(d + HDR_NS_AT, ns.buf, 16) == 0 && memcmp(d + HDR_DIGEST_AT, digest.buf, 32) == 0
             && memcmp(d + HDR_GEOMETRY_AT, t + HDR_GEOMETRY_AT, 16) == 0;     /* layers, segment, tokens, 0 */
    for (Py_ssize_t i = 0; ok && i < layers; i++)
        ok = le64(d + HDR_SUMS_AT + 8 * i) == sums[i];
    if (ok) {
        uint64_t hsum;
        if (header_checksum(d, hb, &hsum) < 0)
            goto done;
        ok = hsum == le64(d + HDR_CHECKSUM_AT);
    }
    if (ok) {
        PyObject *tuple = as_tuple(sums, layers);
        if (tuple != NULL)
            out = Py_BuildValue("(KN)", (unsigned long long)seed, tuple);
    } else {
        out = Py_NewRef(Py_None);
    }
done:
    PyMem_Free(sums);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&region);
    PyBuffer_Release(&tpl);
    PyBuffer_Release(&ns);
    PyBuffer_Release(&digest);
    return out;
}

/* vLLM's CPU attention cache stores a block per head as K^T [D, N] then V [N, D]; the canonical
 * segment holds K [P, H, D] then V [P, H, D] for a page of P = blocks * N tokens. Copy block b's
 * tokens of head h into it (src rows read in order, stores scattered within the head's K^T, which
 * stays in L1), summing
 * the segment's canonical bytes in the same pass over each block, in the segment's order. */
#define K_LOOPS(T)                                                                                    \
    for (size_t h = 0; h < H; h++) {                                                                  \
        T *kt = (T *)(dst + h * 2 * N * D * sizeof(T));                                               \
        for (size_t n = 0; n < N; n++) {                                                              \
            const T *row = (const T *)k + (n * H + h) * D;                                            \
            for (size_t d = 0; d < D; d++)                                                            \
                kt[d * N + n] = row[d];                                                               \
        }                                                                                             \
    }

#ifdef HAVE_AVX2_PATH
/* An 8x8 tile of 32-bit words transposed in registers: row i of src (at src + i * src_stride) becomes
 * column i of the tile in out (out[j] is row j), eight 32-byte loads. */
__attribute__((target("avx2"))) static inline void tile8x8_avx2_rows(const float *src, size_t src_stride, __m256 out[8])
{
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++)
        r[i] = _mm256_loadu_ps(src + i * src_stride);
    t[0] = _mm256_unpacklo_ps(r[0], r[1]);
    t[1] = _mm256_unpackhi_ps(r[0], r[1]);
    t[2] = _mm256_unpacklo_ps(r[2], r[3]);
    t[3] = _mm256_unpackhi_ps(r[2], r[3]);
    t[4] = _mm256_unpacklo_ps(r[4], r[5]);
    t[5] = _mm256_unpackhi_ps(r[4], r[5]);
    t[6] = _mm256_unpacklo_ps(r[6], r[7]);
    t[7] = _mm256_unpackhi_ps(r[6], r[7]);
    r[0] = _mm256_shuffle_ps(t[0], t[2], 0x44);
    r[1] = _mm256_shuffle_ps(t[0], t[2], 0xEE);
    r[2] = _mm256_shuffle_ps(t[1], t[3], 0x44);
    r[3] = _mm256_shuffle_ps(t[1], t[3], 0xEE);
    r[4] = _mm256_shuffle_ps(t[4], t[6], 0x44);
    r[5] = _mm256_shuffle_ps(t[4], t[6], 0xEE);
    r[6] = _mm256_shuffle_ps(t[5], t[7], 0x44);
    r[7] = _mm256_shuffle_ps(t[5], t[7], 0xEE);
    for (int j = 0; j < 4; j++) {
        out[j] = _mm256_permute2f128_ps(r[j], r[j + 4], 0x20);
        out[j + 4] = _mm256_permute2f128_ps(r[j], r[j + 4], 0x31);
    }
}

/* The same tile stored: row j at dst + j * dst_stride, eight 32-byte stores. */
__attribute__((target("avx2"))) static inline void tile8x8_avx2(const float *src, size_t src_stride, float *dst,
                                                                size_t dst_stride)
{
    __m256 out[8];
    tile8x8_avx2_rows(src, src_stride, out);
    for (int j = 0; j < 8; j++)
        _mm256_storeu_ps(dst + j * dst_stride, out[j]);
}

/* 32-bit elements, N and D multiples of 8: 8x8 tiles transposed in registers, so every store is
 * a whole 32-byte row of K^T instead of eight scattered 4-byte ones. Into a 64-byte aligned block
 * with N a multiple of 16 (vLLM's blocks), two tiles side by side give each row of K^T a whole
 * cache line, written by two back-to-back streaming stores: the line is never read for ownership
 * first, so the copy moves two bytes over the memory bus per byte instead of three (the V rows
 * stream too, see v_block_sum). Measured on the 2-vCPU CI host (AMD EPYC, AVX2), 46 pages of 8 fp32
 * layers (96.5 MB) copied and summed: 7.9-8.3 ms against 15-16.5 ms with plain stores, a memcpy of
 * the same bytes 7.9-8.3 ms, with the other vCPU idle or busy. (An earlier try that streamed 32-byte
 * halves of lines, completed by the next tile, was erratic: 8 ms idle, 20 ms while the other vCPU
 * ran.) */
__attribute__((target("avx2"))) static void k_block_avx2_32(unsigned char *dst, const unsigned char *k, size_t N,
                                                            size_t H, size_t D)
{
    if (((uintptr_t)dst & 63) == 0 && N % 16 == 0) {
        for (size_t h = 0; h < H; h++) {
            float *kt = (float *)(dst + h * 2 * N * D * 4);
            for (size_t d = 0; d < D; d += 8)
                for (size_t n = 0; n < N; n += 16) {
                    __m256 lo[8], hi[8];
                    const float *at = (const float *)k + (n * H + h) * D + d;
                    tile8x8_avx2_rows(at, H * D, lo);
                    tile8x8_avx2_rows(at + 8 * H * D, H * D, hi);
                    for (int j = 0; j < 8; j++) {
                        _mm256_stream_ps(kt + (d + j) * N + n, lo[j]);
                        _mm256_stream_ps(kt + (d + j) * N + n + 8, hi[j]);
                    }
                }
        }
        return;
    }
    for (size_t h = 0; h < H; h++) {
        float *kt = (float *)(dst + h * 2 * N * D * 4);
        for (size_t n = 0; n < N; n += 8)
            for (size_t d = 0; d < D; d += 8)
                tile8x8_avx2((const float *)k + (n * H + h) * D + d, H * D, kt + d * N + n, N);
    }
}

/* 16-bit elements (bf16, fp16): an 8x8 tile of 16-bit words transposed in SSE2 registers (x86-64's
 * baseline): row i of src (at src + i * src_stride) becomes column i of the tile, out[j] its row j. */
static inline void tile8x8_sse2_16_rows(const uint16_t *src, size_t src_stride, __m128i out[8])
{
    __m128i r[8], t[8];
    for (int i = 0; i < 8; i++)
        r[i] = _mm_loadu_si128((const __m128i *)(src + i * src_stride));
    for (int i = 0; i < 4; i++) {            /* pairs of rows, interleaved by word */
        t[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    r[0] = _mm_unpacklo_epi32(t[0], t[2]);   /* columns 0, 1 of rows 0-3 */
    r[1] = _mm_unpackhi_epi32(t[0], t[2]);   /* 2, 3 */
    r[2] = _mm_unpacklo_epi32(t[1], t[3]);   /* 4, 5 */
    r[3] = _mm_unpackhi_epi32(t[1], t[3]);   /* 6, 7 */
    r[4] = _mm_unpacklo_epi32(t[4], t[6]);   /* the same of rows 4-7 */
    r[5] = _mm_unpackhi_epi32(t[4], t[6]);
    r[6] = _mm_unpacklo_epi32(t[5], t[7]);
    r[7] = _mm_unpackhi_epi32(t[5], t[7]);
    for (int j = 0; j < 4; j++) {
        out[2 * j] = _mm_unpacklo_epi64(r[j], r[j + 4]);
        out[2 * j + 1] = _mm_unpackhi_epi64(r[j], r[j + 4]);
    }
}

/* 16-bit elements, N and D multiples of 8: those tiles, each store a 16-byte row of K^T. Into a
 * 64-byte aligned block with N a multiple of 32, four tiles side by side give each row of K^T a
 * whole cache line, streamed (as the 32-bit K^T above). */
static void k_block_sse2_16(unsigned char *dst, const unsigned char *k, size_t N, size_t H, size_t D)
{
    int stream = ((uintptr_t)dst & 63) == 0 && N % 32 == 0;
    for (size_t h = 0; h < H; h++) {
        uint16_t *kt = (uint16_t *)(dst + h * 2 * N * D * 2);
        const uint16_t *kh = (const uint16_t *)k + h * D;
        if (stream) {
            for (size_t d = 0; d < D; d += 8)
                for (size_t n = 0; n < N; n += 32) {
                    __m128i rows[4][8];
                    for (int q = 0; q < 4; q++)
                        tile8x8_sse2_16_rows(kh + (n + 8 * q) * H * D + d, H * D, rows[q]);
                    for (int j = 0; j < 8; j++)
                        for (int q = 0; q < 4; q++)
                            _mm_stream_si128((__m128i *)(kt + (d + j) * N + n + 8 * q), rows[q][j]);
                }
            continue;
        }
        for (size_t n = 0; n < N; n += 8)
            for (size_t d = 0; d < D; d += 8) {
                __m128i rows[8];
                tile8x8_sse2_16_rows(kh + n * H * D + d, H * D, rows);
                for (int j = 0; j < 8; j++)
                    _mm_storeu_si128((__m128i *)(kt + (d + j) * N + n), rows[j]);
            }
    }
}
#endif

static void k_block(unsigned char *dst, const unsigned char *k, size_t N, size_t H, size_t D, size_t isz)
{
#ifdef HAVE_AVX2_PATH
    if (isz == 4 && N % 8 == 0 && D % 8 == 0 && sum_blocks == sum_blocks_avx2) {
        k_block_avx2_32(dst, k, N, H, D);
        return;
    }
    if (isz == 2 && N % 8 == 0 && D % 8 == 0) {
        k_block_sse2_16(dst, k, N, H, D);
        return;
    }
#endif
    if (isz == 4) {
        K_LOOPS(uint32_t)
    } else if (isz == 2) {
        K_LOOPS(uint16_t)
    } else {
        K_LOOPS(uint8_t)
    }
}

/* V rows in the canonical order (token, then head), so the sums run over the source in canonical
 * word order (each word meets its own NH key: the state streams from row to row) while each row
 * is copied into its head's V: one pass over V's bytes, where K needs two (its sum streams it
 * into cache, the transpose then gathers from there). Rows of whole 64-byte chunks, streamed into
 * a 32-byte aligned block (the caller fences once, after the last row). */
static void v_block_sum(unsigned char *dst, const unsigned char *v, size_t N, size_t H, size_t D, size_t isz,
                        sum_state *st)
{
    size_t row = D * isz;
    for (size_t n = 0; n < N; n++)
        for (size_t h = 0; h < H; h++)
            sum_blocks(v + (n * H + h) * row, dst + (2 * h + 1) * N * row + n * row, row / BLOCK, st, 2);
}

static void v_block(unsigned char *dst, const unsigned char *v, size_t N, size_t H, size_t D, size_t isz)
{
    size_t row = D * isz;
    for (size_t h = 0; h < H; h++) {
        unsigned char *vv = dst + (2 * h + 1) * N * row;
        for (size_t n = 0; n < N; n++)
            memcpy(vv + n * row, v + (n * H + h) * row, row);
    }
}

/* vLLM's CPU attention with the amx ISA stores a bf16 block per head as VNNI tiles: K as
 * [N/16, D/2, 16, 2] (each 16-token row group holds, per pair of dimensions, the pair of every
 * token: a 32-bit word per token and pair) and V as [D/16, N/2, 16, 2] (each 16-dimension column
 * group holds, per pair of tokens, the two tokens' values of every dimension, interleaved). So K is
 * a transpose of 32-bit words within each 16-token group, and V an interleave of token pairs. */
static void k_block_vnni_plain(unsigned char *dst, const unsigned char *k, size_t N, size_t H, size_t D)
{
    size_t W = D / 2;                              /* 32-bit words (dimension pairs) per row */
    for (size_t h = 0; h < H; h++) {
        uint32_t *kh = (uint32_t *)(dst + h * 2 * N * D * 2);
        for (size_t n = 0; n < N; n++) {
            const uint32_t *row = (const uint32_t *)k + (n * H + h) * W;
            uint32_t *tile = kh + (n / 16) * 16 * W + n % 16;
            for (size_t w = 0; w < W; w++)
                tile[w * 16] = row[w];
        }
    }
}

#ifdef HAVE_AVX2_PATH
/* The same with 8x8 tiles of 32-bit words transposed in registers (W a multiple of 8): each store
 * is 8 tokens' words of one dimension pair, 32 contiguous bytes. */
__attribute__((target("avx2"))) static void k_block_vnni_avx2(unsigned char *dst, const unsigned char *k, size_t N,
                                                              size_t H, size_t D)
{
    size_t W = D / 2;
    for (size_t h = 0; h < H; h++) {
        float *kh = (float *)(dst + h * 2 * N * D * 2);
        for (size_t n = 0; n < N; n += 8) {
            float *tile = kh + (n / 16) * 16 * W + n % 16;
            for (size_t w = 0; w < W; w += 8)
                tile8x8_avx2((const float *)k + (n * H + h) * W + w, H * W, tile + w * 16, 16);
        }
    }
}

/* V: two tokens' 16-dimension slices interleaved word by word, 64 bytes out per pair and group. */
static void v_block_vnni_sse2(unsigned char *dst, const unsigned char *v, size_t N, size_t H, size_t D)
{
    for (size_t h = 0; h < H; h++) {
        uint16_t *vh = (uint16_t *)(dst + (2 * h + 1) * N * D * 2);
        for (size_t n = 0; n < N; n += 2) {
            const uint16_t *a = (const uint16_t *)v + (n * H + h) * D, *b = a + H * D;
            for (size_t c = 0; c < D; c += 16) {
                __m128i a0 = _mm_loadu_si128((const __m128i *)(a + c)), a1 = _mm_loadu_si128((const __m128i *)(a + c + 8));
                __m128i b0 = _mm_loadu_si128((const __m128i *)(b + c)), b1 = _mm_loadu_si128((const __m128i *)(b + c + 8));
                __m128i *out = (__m128i *)(vh + c * N + n * 16);
                _mm_storeu_si128(out, _mm_unpacklo_epi16(a0, b0));
                _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(a0, b0));
                _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(a1, b1));
                _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(a1, b1));
            }
        }
    }
}
#endif

static void v_block_vnni(unsigned char *dst, const unsigned char *v, size_t N, size_t H, size_t D)
{
#ifdef HAVE_AVX2_PATH
    v_block_vnni_sse2(dst, v, N, H, D);
#else
    for (size_t h = 0; h < H; h++) {
        uint16_t *vh = (uint16_t *)(dst + (2 * h + 1) * N * D * 2);
        for (size_t n = 0; n < N; n++) {
            const uint16_t *row = (const uint16_t *)v + (n * H + h) * D;
            for (size_t d = 0; d < D; d++)
                vh[(d / 16) * N * 16 + (n / 2) * 32 + (d % 16) * 2 + n % 2] = row[d];
        }
    }
#endif
}

static void k_block_vnni(unsigned char *dst, const unsigned char *k, size_t N, size_t H, size_t D)
{
#ifdef HAVE_AVX2_PATH
    if ((D / 2) % 8 == 0 && sum_blocks == sum_blocks_avx2) {
        k_block_vnni_avx2(dst, k, N, H, D);
        return;
    }
#endif
    k_block_vnni_plain(dst, k, N, H, D);
}

#ifdef HAVE_AVX2_PATH
__attribute__((target("avx2"))) static void stream_copy_avx2(unsigned char *dst, const unsigned char *src, size_t n)
{
    for (size_t o = 0; o < n; o += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + o)), b = _mm256_loadu_si256((const __m256i *)(src + o + 32));
        _mm256_stream_si256((__m256i *)(dst + o), a);
        _mm256_stream_si256((__m256i *)(dst + o + 32), b);
    }
}
#endif

/* One page of kt_copy_pages, without the GIL: src (K then V of every block) into dst[b - skip]
 * for b >= skip; returns src's checksum under `keys`. The caller fences the streamed stores. */
static uint64_t kt_copy_page(const unsigned char *src, size_t len, unsigned char *const *dst, size_t skip, size_t N,
                             size_t H, size_t D, size_t isz, int vnni, const nh_keys *keys)
{
    size_t half = N * H * D * isz;
    size_t blocks = len / (2 * half);
    const unsigned char *k = src, *v = src + blocks * half;
    sum_state st;
    state_init(&st, keys);
    /* Sum a block's bytes first: the sequential pass streams them into cache at full speed, and
     * the transposing copy then gathers from cache instead of striding through DRAM. (Both read the
     * same tier bytes; the caller's generation check afterwards proves nobody rewrote them.) */
    for (size_t b = 0; b < blocks; b++) {           /* K of every block, then V: the canonical order */
        sum_blocks(k + b * half, NULL, half / BLOCK, &st, 0);
        if (b < skip)
            continue;
        if (vnni)
            k_block_vnni(dst[b - skip], k + b * half, N, H, D);
        else
            k_block(dst[b - skip], k + b * half, N, H, D, isz);
    }
    for (size_t b = 0; b < blocks; b++) {
        if (b >= skip && !vnni && (D * isz) % BLOCK == 0) {
            v_block_sum(dst[b - skip], v + b * half, N, H, D, isz, &st);
            continue;
        }
        /* otherwise (the VNNI interleave included) the copy reads V from cache after the sum */
        sum_blocks(v + b * half, NULL, half / BLOCK, &st, 0);
        if (b < skip)
            continue;
        if (vnni)
            v_block_vnni(dst[b - skip], v + b * half, N, H, D);
        else
            v_block(dst[b - skip], v + b * half, N, H, D, isz);
    }
    return finish(&st, src + len, 0);          /* len is whole 64-byte chunks: no tail */
}

PyDoc_STRVAR(kt_copy_pages_doc,
             "kt_copy_pages(cache, pages, block_tokens, heads, head_dim, itemsize, vnni=0, threads=1) -> list[int]: "
             "write each canonical segment src (K then V, each [blocks * block_tokens, heads, head_dim]) of pages, "
             "a sequence of (src, block_ids, skip, seed) tuples, into the vLLM CPU cache's blocks: src's block b >= "
             "skip into cache block block_ids[b - skip] (cache: the writable cache as bytes, whole blocks of [heads, "
             "2, block_tokens * head_dim]: K^T then V per head; with vnni, the amx ISA's bf16 tiles, which need "
             "itemsize 2 and block_tokens and head_dim multiples of 16), and return the checksum under seed of each "
             "whole src, summed as it is copied. "
             "threads > 1: up to threads - 1 helper threads copy pages alongside the caller; a helper that is not "
             "running is not waited for (the caller copies its page), and nothing writes into the cache after "
             "the call returned (see crew_run).");

typedef struct {
    Py_buffer src;
    unsigned char **dst;
    size_t skip;
    uint64_t seed;
} page_job;

/* Parses one (src, block_ids, skip, seed) tuple into job; on failure, sets the error and holds nothing. */
static int parse_page(PyObject *item, page_job *job, unsigned char *cache, size_t nblocks, size_t half)
{
    PyObject *ids_in;
    Py_ssize_t skip;
    if (!PyTuple_Check(item)) {
        PyErr_SetString(PyExc_TypeError, "kt_copy_pages: each page must be a (src, block_ids, skip, seed) tuple");
        return -1;
    }
    if (!PyArg_ParseTuple(item, "y*OnO&", &job->src, &ids_in, &skip, seed_arg, &job->seed))
        return -1;
    PyObject *ids = PySequence_Fast(ids_in, "block_ids must be a sequence of ints");
    if (ids == NULL)
        goto fail;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(ids);
    if (skip < 0 || job->src.len % (2 * half) != 0 || (size_t)(skip + count) != (size_t)job->src.len / (2 * half)) {
        PyErr_Format(PyExc_ValueError, "kt_copy_pages: a page of %zd bytes does not fill %zd + %zd blocks of %zu "
                     "bytes", job->src.len, skip, count, 2 * half);
        goto fail;
    }
    job->skip = (size_t)skip;
    job->dst = PyMem_RawMalloc((count ? count : 1) * sizeof(unsigned char *));
    if (job->dst == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t j = 0; j < count; j++) {
        Py_ssize_t b = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(ids, j));
        if (b == -1 && PyErr_Occurred())
            goto fail;
        if (b < 0 || (size_t)b >= nblocks) {
            PyErr_Format(PyExc_IndexError, "kt_copy_pages: block %zd is not in the cache's %zu blocks", b, nblocks);
            goto fail;
        }
        job->dst[j] = cache + (size_t)b * 2 * half;
    }
    Py_DECREF(ids);
    return 0;
fail:
    Py_XDECREF(ids);
    PyMem_RawFree(job->dst);
    job->dst = NULL;
    PyBuffer_Release(&job->src);
    return -1;
}

/* ---- the copy crew ---------------------------------------------------------------------------
 *
 * One core does not fill the memory bandwidth, so kt_copy_pages copies pages side by side on
 * helper threads. Unlike an OpenMP loop, the caller never waits for a helper the OS is not
 * running: each page goes to whoever claims it first, and a page a helper claimed but has not
 * finished soon after the caller ran out of pages is copied again by the caller (the same bytes
 * from the same source into the same blocks). On a busy host, where another process takes a
 * core for milliseconds at a time, an OpenMP barrier waited for that core's thread (measured in
 * vLLM: a layer's copy of 1 ms stalled for 5-14 ms); here the caller copies the rest itself.
 *
 * The blocks a call wrote are checked when it returns and the engine reads them then, so nothing
 * may write into them afterwards. A helper therefore converts its page into a buffer of its own
 * first, and writes the blocks only once it has claimed the write (PAGE_HELPER_WRITING): a page
 * the caller took over before that is never written by the helper, whatever its source holds by
 * then (a slot another node rewrote, a corrupted one). A write the helper claimed is waited for:
 * it is one page's copy from a buffer in its cache, the short end of its work.
 *
 * A helper descheduled before its claim may still read a page's source after the call returned,
 * so a call's pages, buffers and block lists stay alive until its helpers left it ("retired"
 * calls); settle() waits for that. Helpers sleep between calls and run on the cores other than
 * the first caller's own (a CPU engine pins its forward thread). */

#define CREW_MAX 64

enum { PAGE_FREE, PAGE_HELPER, PAGE_HELPER_WRITING, PAGE_HELPER_DONE, PAGE_CALLER, PAGE_CALLER_DONE };

typedef struct copy_task {
    Py_buffer cache;
    page_job *jobs;
    Py_ssize_t held;                 /* jobs parsed: their buffers are held */
    Py_ssize_t n;
    size_t N, H, D, isz;
    int vnni;
    uint64_t *sums;                  /* the caller's result */
    uint64_t *hsums;                 /* a helper's sum of a page, written before it marks it done */
    _Atomic unsigned char *state;    /* per page: PAGE_* */
    _Atomic Py_ssize_t next;         /* the next page nobody claimed yet */
    int inside;                      /* helpers working on it; under crew_mu */
    struct copy_task *retired_next;  /* under crew_mu */
} copy_task;

static pthread_mutex_t crew_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t crew_wake = PTHREAD_COND_INITIALIZER;   /* a call to join */
static pthread_cond_t crew_left = PTHREAD_COND_INITIALIZER;   /* a helper left a call */
static int crew_size;                /* helpers started */
static uint32_t crew_gen;            /* bumped per call */
static copy_task *crew_task;         /* the call helpers may join, or NULL */
static copy_task *crew_retired;      /* calls that returned while a helper was inside */
static _Atomic int crew_nretired;    /* how many: read without the lock, to skip crew_reap */
static atomic_flag crew_busy = ATOMIC_FLAG_INIT;   /* a caller holds the crew */
static _Atomic long long crew_helped, crew_stolen;  /* pages copied by helpers / copied again by callers */
static long crew_stall_us;           /* fault injection (POF_CREW_STALL_US): a helper sleeps this long per page */

/* Copies page i into `dst` (the job's blocks, or a helper's own buffer laid out as blocks). */
static uint64_t copy_item_to(const copy_task *t, Py_ssize_t i, unsigned char *const *dst)
{
    const page_job *job = &t->jobs[i];
    /* keys per thread: a helper derives the page's keys itself (cached while the seed repeats) */
    uint64_t sum = kt_copy_page(job->src.buf, (size_t)job->src.len, dst, job->skip, t->N, t->H, t->D, t->isz,
                                t->vnni, keys_for(job->seed));
#ifdef HAVE_AVX2_PATH
    _mm_sfence();      /* the streamed lines are visible before the page counts as done */
#endif
    return sum;
}

static uint64_t copy_item(const copy_task *t, Py_ssize_t i)
{
    return copy_item_to(t, i, t->jobs[i].dst);
}

/* A helper's own buffer, as blocks (grown as needed; helpers live as long as the process). Its
 * blocks start 16 bytes past a cache line, so the copy kernels' alignment tests pick cached stores
 * (the buffer is read back at once, from cache); the write into the engine's blocks streams. */
#define BOUNCE_SKEW 16
static __thread unsigned char *bounce;
static __thread unsigned char **bounce_blocks;
static __thread size_t bounce_bytes, bounce_count;

/* Bytes of one cache block (K and V). */
static size_t block_bytes(const copy_task *t)
{
    return 2 * t->N * t->H * t->D * t->isz;
}

/* The blocks page i writes. */
static size_t job_blocks(const copy_task *t, Py_ssize_t i)
{
    return (size_t)t->jobs[i].src.len / block_bytes(t) - t->jobs[i].skip;
}

/* A helper's block into the engine's: streamed where the block is aligned (a cache line is never
 * read for ownership first), as the kernels write it. */
static void write_block(unsigned char *dst, const unsigned char *src, size_t n)
{
#ifdef HAVE_AVX2_PATH
    if (((uintptr_t)dst & 31) == 0 && n % 64 == 0 && sum_blocks == sum_blocks_avx2) {
        stream_copy_avx2(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* Room in this helper's buffer for page i's blocks; 0 when memory ran out. */
static int bounce_fit(const copy_task *t, Py_ssize_t i)
{
    size_t block = block_bytes(t), count = job_blocks(t, i);
    if (count * block + BOUNCE_SKEW > bounce_bytes) {
        unsigned char *grown = NULL;
        if (posix_memalign((void **)&grown, 64, count * block + BOUNCE_SKEW) != 0)
            return 0;
        free(bounce);
        bounce = grown;
        bounce_bytes = count * block + BOUNCE_SKEW;
    }
    if (count > bounce_count) {
        unsigned char **grown = realloc(bounce_blocks, count * sizeof *grown);
        if (grown == NULL)
            return 0;
        bounce_blocks = grown;
        bounce_count = count;
    }
    for (size_t j = 0; j < count; j++)
        bounce_blocks[j] = bounce + BOUNCE_SKEW + j * block;
    return 1;
}

static int take(copy_task *t, Py_ssize_t i, unsigned char from, unsigned char to)
{
    unsigned char expect = from;
    return atomic_compare_exchange_strong_explicit(&t->state[i], &expect, to, memory_order_acq_rel,
                                                   memory_order_acquire);
}

static void help(copy_task *t)
{
    Py_ssize_t i;
    while ((i = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed)) < t->n) {
        if (!take(t, i, PAGE_FREE, PAGE_HELPER))
            continue;                /* the caller took it first */
        if (crew_stall_us > 0) {
            struct timespec ts = {crew_stall_us / 1000000, (crew_stall_us % 1000000) * 1000};
            nanosleep(&ts, NULL);    /* a helper the OS descheduled mid-page */
        }
        if (!bounce_fit(t, i)) {      /* no memory for its buffer: the caller copies the page */
            take(t, i, PAGE_HELPER, PAGE_FREE);
            continue;
        }
        uint64_t sum = copy_item_to(t, i, bounce_blocks);
        if (!take(t, i, PAGE_HELPER, PAGE_HELPER_WRITING))
            continue;                /* the caller copied it meanwhile: nothing of this copy lands */
        size_t block = block_bytes(t), count = job_blocks(t, i);
        for (size_t j = 0; j < count; j++)
            write_block(t->jobs[i].dst[j], bounce_blocks[j], block);
#ifdef HAVE_AVX2_PATH
        _mm_sfence();
#endif
        t->hsums[i] = sum;
        atomic_store_explicit(&t->state[i], PAGE_HELPER_DONE, memory_order_release);
        atomic_fetch_add_explicit(&crew_helped, 1, memory_order_relaxed);
    }
}

static void *crew_main(void *arg)
{
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    pthread_mutex_lock(&crew_mu);
    for (;;) {
        while (crew_gen == seen)
            pthread_cond_wait(&crew_wake, &crew_mu);
        seen = crew_gen;
        copy_task *t = crew_task;
        if (t == NULL)
            continue;                /* woke after that call returned */
        t->inside++;
        pthread_mutex_unlock(&crew_mu);
        help(t);
        pthread_mutex_lock(&crew_mu);
        if (--t->inside == 0)
            pthread_cond_broadcast(&crew_left);
    }
    return NULL;
}

/* A helper runs on the cores other than the calling thread's, where the caller is pinned to one
 * (anywhere otherwise); the kernel keeps it within the process's cpuset. */
static void crew_place(pthread_attr_t *attr)
{
#ifdef __linux__
    cpu_set_t mine, other;
    CPU_ZERO(&other);
    if (sched_getaffinity(0, sizeof mine, &mine) != 0 || CPU_COUNT(&mine) > 1)
        return;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (!CPU_ISSET(c, &mine))
            CPU_SET(c, &other);
    pthread_attr_setaffinity_np(attr, sizeof other, &other);
#else
    (void)attr;
#endif
}

static int crew_start(int placed)
{
    pthread_attr_t attr;
    pthread_t th;
    if (pthread_attr_init(&attr) != 0)
        return -1;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (placed)
        crew_place(&attr);
    int rc = pthread_create(&th, &attr, crew_main, (void *)(uintptr_t)crew_gen);
    pthread_attr_destroy(&attr);
    return rc;
}

/* Start helpers until there are `want` (under crew_mu); returns how many there are. */
static int crew_grow(int want)
{
    while (crew_size < want && crew_size < CREW_MAX) {
        if (crew_start(1) != 0 && crew_start(0) != 0)    /* e.g. no core left to place it on */
            break;
        crew_size++;
    }
    return crew_size;
}

/* A child of fork has none of the parent's threads: it starts a crew of its own, and the calls
 * its parent's helpers were inside are nobody's. */
static void crew_after_fork(void)
{
    pthread_mutex_init(&crew_mu, NULL);
    pthread_cond_init(&crew_wake, NULL);
    pthread_cond_init(&crew_left, NULL);
    crew_size = 0;
    crew_task = NULL;
    for (copy_task *t = crew_retired; t != NULL; t = t->retired_next)
        t->inside = 0;
    atomic_flag_clear(&crew_busy);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The caller copies page i if it is still in state `from` (unclaimed, or a helper's); returns 1
 * when it did. */
static int copy_here(copy_task *t, Py_ssize_t i, unsigned char from)
{
    if (!take(t, i, from, PAGE_CALLER))
        return 0;
    t->sums[i] = copy_item(t, i);
    atomic_store_explicit(&t->state[i], PAGE_CALLER_DONE, memory_order_release);
    return 1;
}

/* Copy every page of `t`, on the caller's thread and up to threads - 1 helpers. Without the GIL. */
static void crew_run(copy_task *t, Py_ssize_t threads)
{
    Py_ssize_t i;
    if (threads <= 1 || t->n <= 1 || atomic_flag_test_and_set(&crew_busy)) {
        for (i = 0; i < t->n; i++)     /* one thread, or another caller has the crew */
            t->sums[i] = copy_item(t, i);
        return;
    }
    pthread_mutex_lock(&crew_mu);
    if (crew_grow((int)(threads - 1 < CREW_MAX ? threads - 1 : CREW_MAX)) > 0) {
        crew_task = t;
        crew_gen++;
        pthread_cond_broadcast(&crew_wake);
    }
    pthread_mutex_unlock(&crew_mu);
    double t0 = now_s();
    Py_ssize_t mine = 0;
    while ((i = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed)) < t->n)
        mine += copy_here(t, i, PAGE_FREE);
    /* Left: pages a helper is copying. Give it a few of this thread's page times, then copy here the
     * ones it has not begun to write; a write it began is waited for (nothing writes after we return). */
    double per_page = mine > 0 ? (now_s() - t0) / (double)mine : 0.0;
    double deadline = now_s() + (4 * per_page > 100e-6 ? 4 * per_page : 100e-6);
    for (unsigned spins = 0;; spins++) {
        Py_ssize_t pending = 0;
        for (i = 0; i < t->n; i++) {
            unsigned char st = atomic_load_explicit(&t->state[i], memory_order_acquire);
            pending += st == PAGE_FREE || st == PAGE_HELPER || st == PAGE_HELPER_WRITING;
        }
        if (pending == 0)
            break;
        if ((spins & 63) == 63 && now_s() > deadline) {
            for (i = 0; i < t->n; i++)
                if (copy_here(t, i, PAGE_FREE) || copy_here(t, i, PAGE_HELPER))
                    atomic_fetch_add_explicit(&crew_stolen, 1, memory_order_relaxed);
            if ((spins & 1023) == 1023)
                sched_yield();       /* a helper the OS descheduled mid-write: let it finish */
        }
#ifdef HAVE_AVX2_PATH
        _mm_pause();
#endif
    }
    for (i = 0; i < t->n; i++)
        if (atomic_load_explicit(&t->state[i], memory_order_acquire) == PAGE_HELPER_DONE)
            t->sums[i] = t->hsums[i];
    pthread_mutex_lock(&crew_mu);
    crew_task = NULL;                /* no helper joins it any more */
    pthread_mutex_unlock(&crew_mu);
    atomic_flag_clear(&crew_busy);
}

/* Frees a call's buffers and memory (with the GIL). */
static void task_free(copy_task *t)
{
    if (t == NULL)
        return;
    for (Py_ssize_t i = 0; i < t->held; i++) {
        PyBuffer_Release(&t->jobs[i].src);
        PyMem_RawFree(t->jobs[i].dst);
    }
    PyMem_RawFree(t->jobs);
    PyMem_RawFree(t->sums);
    PyMem_RawFree(t->hsums);
    PyMem_RawFree((void *)t->state);
    if (t->cache.obj != NULL)
        PyBuffer_Release(&t->cache);
    PyMem_RawFree(t);
}

/* Done with a call (with the GIL): freed, or retired while a helper is still inside it. */
static void task_release(copy_task *t)
{
    if (t == NULL)
        return;
    pthread_mutex_lock(&crew_mu);
    int inside = t->inside > 0;
    if (inside) {
        t->retired_next = crew_retired;
        crew_retired = t;
        atomic_fetch_add(&crew_nretired, 1);
    }
    pthread_mutex_unlock(&crew_mu);
    if (!inside)
        task_free(t);
}

/* Frees the retired calls no helper is inside any more (with the GIL); with `wait`, first waits
 * (without the GIL) until no helper is inside one. */
static void crew_reap(int wait)
{
    copy_task *done = NULL;
    if (atomic_load(&crew_nretired) == 0)
        return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&crew_mu);
    for (;;) {
        int busy = 0;
        for (copy_task **p = &crew_retired; *p != NULL;) {
            copy_task *t = *p;
            if (t->inside == 0) {
                *p = t->retired_next;
                t->retired_next = done;
                done = t;
                atomic_fetch_sub(&crew_nretired, 1);
            } else {
                busy = 1;
                p = &t->retired_next;
            }
        }
        if (!busy || !wait)
            break;
        pthread_cond_wait(&crew_left, &crew_mu);
    }
    pthread_mutex_unlock(&crew_mu);
    Py_END_ALLOW_THREADS
    while (done != NULL) {
        copy_task *next = done->retired_next;
        task_free(done);
        done = next;
    }
}

PyDoc_STRVAR(settle_doc,
             "settle() -> None: return once no helper thread of kt_copy_pages still reads a page of an earlier "
             "call (a helper the OS descheduled mid-page may, after the call returned, still read that page's "
             "source; it never writes a page the caller took over). Call it before the sources are unmapped.");

static PyObject *py_settle(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    crew_reap(1);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(crew_stats_doc,
             "crew_stats() -> (helped, stolen, retired): pages kt_copy_pages' helper threads copied, pages a caller "
             "copied again because their helper was late, and calls a late helper is still inside (settle() waits "
             "for those).");

static PyObject *py_crew_stats(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return Py_BuildValue("LLi", (long long)atomic_load(&crew_helped), (long long)atomic_load(&crew_stolen),
                         atomic_load(&crew_nretired));
}

static PyObject *py_kt_copy_pages(PyObject *self, PyObject *args)
{
    PyObject *pages_in;
    Py_ssize_t N, H, D, isz, threads = 1;
    int vnni = 0;
    (void)self;
    crew_reap(0);
    copy_task *t = PyMem_RawCalloc(1, sizeof(copy_task));
    if (t == NULL)
        return PyErr_NoMemory();
    if (!PyArg_ParseTuple(args, "w*Onnnn|pn", &t->cache, &pages_in, &N, &H, &D, &isz, &vnni, &threads)) {
        PyMem_RawFree(t);
        return NULL;
    }
    PyObject *out = NULL, *seq = NULL;
    Py_ssize_t n = 0;
    size_t half = (size_t)N * H * D * isz;
    if (N < 1 || H < 1 || D < 1 || (isz != 1 && isz != 2 && isz != 4) || half % BLOCK != 0
        || t->cache.len % (2 * half) != 0 || (vnni && (isz != 2 || N % 16 != 0 || D % 16 != 0))) {
        PyErr_Format(PyExc_ValueError, "kt_copy_pages: a cache of %zd bytes in blocks of %zd tokens x %zd heads x "
                     "%zd dims x %zd bytes does not fit (each block's K must be a multiple of %d bytes; VNNI "
                     "tiles need 2-byte items and tokens and dims in multiples of 16)",
                     t->cache.len, N, H, D, isz, BLOCK);
        goto done;
    }
    seq = PySequence_Fast(pages_in, "pages must be a sequence of (src, block_ids, skip, seed) tuples");
    if (seq == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(seq);
    size_t slots = n ? (size_t)n : 1;
    t->jobs = PyMem_RawCalloc(slots, sizeof(page_job));
    t->sums = PyMem_RawCalloc(slots, sizeof(uint64_t));
    t->hsums = PyMem_RawCalloc(slots, sizeof(uint64_t));
    t->state = PyMem_RawCalloc(slots, sizeof(*t->state));
    if (t->jobs == NULL || t->sums == NULL || t->hsums == NULL || t->state == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; t->held < n; t->held++)
        if (parse_page(PySequence_Fast_GET_ITEM(seq, t->held), &t->jobs[t->held], t->cache.buf,
                       (size_t)t->cache.len / (2 * half), half) < 0)
            goto done;
    t->n = n;
    t->N = (size_t)N;
    t->H = (size_t)H;
    t->D = (size_t)D;
    t->isz = (size_t)isz;
    t->vnni = vnni;
    Py_BEGIN_ALLOW_THREADS
    crew_run(t, threads);
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(t->sums[i]);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, v);
    }
done:
    task_release(t);
    Py_XDECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"kt_copy_pages", py_kt_copy_pages, METH_VARARGS, kt_copy_pages_doc},
    {"settle", py_settle, METH_NOARGS, settle_doc},
    {"crew_stats", py_crew_stats, METH_NOARGS, crew_stats_doc},
    {"checksums", py_checksums, METH_VARARGS, checksums_doc},
    {"copy_checksums", py_copy_checksums, METH_VARARGS, copy_checksums_doc},
    {"gather_checksums", py_gather_checksums, METH_VARARGS, gather_checksums_doc},
    {"store_page", py_store_page, METH_VARARGS, store_page_doc},
    {"load_page", py_load_page, METH_VARARGS, load_page_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pagesum", "Fused copy + checksum of page segments (format v3).", -1, methods,
};

PyMODINIT_FUNC PyInit__pagesum(void)
{
#ifdef HAVE_AVX2_PATH
    /* POF_PAGESUM_KERNEL=generic: the portable loop even where AVX2 is there (its tests) */
    const char *want = getenv("POF_PAGESUM_KERNEL");
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && (want == NULL || strcmp(want, "generic") != 0))
        sum_blocks = sum_blocks_avx2;
#endif
    pthread_atfork(NULL, NULL, crew_after_fork);
    const char *stall = getenv("POF_CREW_STALL_US");
    crew_stall_us = stall != NULL ? atol(stall) : 0;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "KERNEL", sum_blocks == sum_blocks_generic ? "generic" : "avx2") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
