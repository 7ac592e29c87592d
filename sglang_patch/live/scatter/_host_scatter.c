/* Live apply's host writes, compiled: the pause's scatter into a CPU parameter and its read-back
 * (sglang_patch/live/scatter/host_scatter.py is the Python side).
 *
 * Why compiled: the pause writes a few million scattered elements, each a cache miss, and then
 * reads every one back to compare it with the staged value. Through numpy the read-back is a
 * gather into a buffer, a compare into another and a scan (three passes and a call each), about
 * half the write's own cost; here it is one loop over lines the write brought into cache a
 * moment before, a few percent of it.
 *
 * The caller owns the memory: every pointer is the data of a contiguous CPU tensor it keeps
 * alive for the call, aligned to its elements, and the element width is 1, 2, 4 or 8 bytes.
 * Positions are checked against the destination's length before each write (a position out of
 * range is an error, never a write outside the parameter). The GIL is released in the loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

/* dst[index[i]] = src[i] for i in [start, stop); returns the first i whose position is out of
 * range (nothing written from it on), or -1 */
#define SCATTER(T)                                                                    \
    static Py_ssize_t scatter_##T(void *dst, Py_ssize_t numel, const int64_t *index,  \
                                  const void *src, Py_ssize_t start, Py_ssize_t stop) { \
        T *d = (T *)dst;                                                              \
        const T *s = (const T *)src;                                                  \
        for (Py_ssize_t i = start; i < stop; i++) {                                   \
            int64_t j = index[i];                                                     \
            if ((uint64_t)j >= (uint64_t)numel) return i;                             \
            d[j] = s[i];                                                              \
        }                                                                             \
        return -1;                                                                    \
    }

/* the first i in [start, stop) whose element reads back other bits than src[i] (or whose
 * position is out of range), or -1. volatile: the compiler must not assume the bits it stored;
 * the point is what the parameter's memory holds now */
#define DIFFERING(T)                                                                  \
    static Py_ssize_t differing_##T(const void *dst, Py_ssize_t numel, const int64_t *index, \
                                    const void *src, Py_ssize_t start, Py_ssize_t stop) { \
        const volatile T *d = (const volatile T *)dst;                                \
        const T *s = (const T *)src;                                                  \
        for (Py_ssize_t i = start; i < stop; i++) {                                   \
            int64_t j = index[i];                                                     \
            if ((uint64_t)j >= (uint64_t)numel || d[j] != s[i]) return i;             \
        }                                                                             \
        return -1;                                                                    \
    }

/* scatter [start, stop) and read each element back LAG entries later in the same loop, the rest
 * at the end: the read-back's loads overlap the writes after them (a read right after its own
 * store would wait for it; a separate pass after a block costs a pass). Returns the first i whose
 * element differs, or -1; *oob the first i out of range (nothing written from it on), or -1 */
#define FUSED(T)                                                                      \
    static Py_ssize_t fused_##T(void *dst, Py_ssize_t numel, const int64_t *index,    \
                                const void *src, Py_ssize_t start, Py_ssize_t stop,   \
                                Py_ssize_t *oob) {                                    \
        T *d = (T *)dst;                                                              \
        const volatile T *v = (const volatile T *)dst;                                \
        const T *s = (const T *)src;                                                  \
        *oob = -1;                                                                    \
        for (Py_ssize_t i = start; i < stop; i++) {                                   \
            int64_t j = index[i];                                                     \
            if ((uint64_t)j >= (uint64_t)numel) { *oob = i; return -1; }              \
            d[j] = s[i];                                                              \
            Py_ssize_t k = i - LAG;                                                   \
            if (k >= start && v[index[k]] != s[k]) return k;                          \
        }                                                                             \
        for (Py_ssize_t k = stop - LAG > start ? stop - LAG : start; k < stop; k++)   \
            if (v[index[k]] != s[k]) return k;                                        \
        return -1;                                                                    \
    }

/* measured on 100M bf16 elements (medians of 31): lags of 16-64 add 7% to a 1% write and
 * nothing measurable to a 5% one; 256, 14% and 2% */
#define LAG 32

SCATTER(uint8_t) SCATTER(uint16_t) SCATTER(uint32_t) SCATTER(uint64_t)
DIFFERING(uint8_t) DIFFERING(uint16_t) DIFFERING(uint32_t) DIFFERING(uint64_t)
FUSED(uint8_t) FUSED(uint16_t) FUSED(uint32_t) FUSED(uint64_t)

typedef Py_ssize_t (*fused_fn)(void *, Py_ssize_t, const int64_t *, const void *, Py_ssize_t, Py_ssize_t, Py_ssize_t *);

static fused_fn fused_of(int width) {
    return width == 1 ? fused_uint8_t : width == 2 ? fused_uint16_t : width == 4 ? fused_uint32_t : fused_uint64_t;
}

typedef Py_ssize_t (*range_fn)(void *, Py_ssize_t, const int64_t *, const void *, Py_ssize_t, Py_ssize_t);
typedef Py_ssize_t (*check_fn)(const void *, Py_ssize_t, const int64_t *, const void *, Py_ssize_t, Py_ssize_t);

static range_fn scatter_of(int width) {
    return width == 1 ? scatter_uint8_t : width == 2 ? scatter_uint16_t : width == 4 ? scatter_uint32_t : scatter_uint64_t;
}

static check_fn differing_of(int width) {
    return width == 1 ? differing_uint8_t : width == 2 ? differing_uint16_t : width == 4 ? differing_uint32_t
                                                                                        : differing_uint64_t;
}

typedef struct {
    void *dst;
    Py_ssize_t numel;
    const int64_t *index;
    const void *src;
    Py_ssize_t start, stop;
    int width;
} Job;

static int parse_job(PyObject *args, Job *job, Py_ssize_t *block, Py_ssize_t *time_every) {
    unsigned long long d, ix, s;
    int ok = block ? PyArg_ParseTuple(args, "KnKKnninn", &d, &job->numel, &ix, &s, &job->start, &job->stop,
                                      &job->width, block, time_every)
                   : PyArg_ParseTuple(args, "KnKKnni", &d, &job->numel, &ix, &s, &job->start, &job->stop, &job->width);
    if (!ok)
        return -1;
    int w = job->width;
    if (w != 1 && w != 2 && w != 4 && w != 8) {
        PyErr_Format(PyExc_ValueError, "element width must be 1, 2, 4 or 8 bytes, got %d", w);
        return -1;
    }
    if (job->start < 0 || job->stop < job->start || job->numel < 0 || (block && (*block < 1 || *time_every < 1))) {
        PyErr_Format(PyExc_ValueError, "bad range %zd:%zd of a destination of %zd elements, or block/time_every < 1",
                     job->start, job->stop, job->numel);
        return -1;
    }
    if ((d == 0 || ix == 0 || s == 0) && job->stop > job->start) {
        PyErr_SetString(PyExc_ValueError, "null data pointer");
        return -1;
    }
    if (d % (unsigned)w || ix % 8 || s % (unsigned)w) {
        PyErr_SetString(PyExc_ValueError, "a data pointer is not aligned to its elements");
        return -1;
    }
    job->dst = (void *)(uintptr_t)d;
    job->index = (const int64_t *)(uintptr_t)ix;
    job->src = (const void *)(uintptr_t)s;
    return 0;
}

static PyObject *out_of_range(const Job *job, Py_ssize_t i) {
    PyErr_Format(PyExc_IndexError, "position %lld (entry %zd) is outside the destination's %zd elements",
                 (long long)job->index[i], i, job->numel);
    return NULL;
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

PyDoc_STRVAR(scatter_doc,
"scatter(dst, numel, index, src, start, stop, width) -> None\n\n"
"dst[index[i]] = src[i] for i in start..stop (data pointers; width: bytes per element).\n"
"IndexError at the first position outside 0..numel-1 (the ones before it are written).");

static PyObject *scatter(PyObject *self, PyObject *args) {
    Job job;
    if (parse_job(args, &job, NULL, NULL) < 0)
        return NULL;
    Py_ssize_t oob;
    range_fn write = scatter_of(job.width);
    Py_BEGIN_ALLOW_THREADS
    oob = write(job.dst, job.numel, job.index, job.src, job.start, job.stop);
    Py_END_ALLOW_THREADS
    if (oob >= 0)
        return out_of_range(&job, oob);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(scatter_checked_doc,
"scatter_checked(dst, numel, index, src, start, stop, width, chunk, probe_every)\n"
"    -> (first_differing, fused_ns, fused_elements, plain_ns, plain_elements, probe_check_ns)\n\n"
"scatter, every element read back from the destination and compared bit for bit with src, chunk\n"
"by chunk. Most chunks are written and read back in one loop (each element read a few entries\n"
"after its write). The first chunk and every probe_every-th one after are probes: written alone,\n"
"then read back in a pass of their own, each part timed, so the caller can tell what the\n"
"read-back costs (the fused chunks' time against the probes' write rate, plus the probes' own\n"
"read-back). first_differing: the first entry whose element reads back other bits, or -1 (it\n"
"stops there). IndexError as scatter.");

static PyObject *scatter_checked(PyObject *self, PyObject *args) {
    Job job;
    Py_ssize_t chunk, probe_every;
    if (parse_job(args, &job, &chunk, &probe_every) < 0)
        return NULL;
    range_fn write = scatter_of(job.width);
    check_fn check = differing_of(job.width);
    fused_fn both = fused_of(job.width);
    Py_ssize_t bad = -1, oob = -1, fused_n = 0, plain_n = 0;
    double fused_ns = 0.0, plain_ns = 0.0, probe_ns = 0.0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t c = 0;
    for (Py_ssize_t a = job.start; a < job.stop; c++) {
        Py_ssize_t b = a + chunk < job.stop ? a + chunk : job.stop;
        double t0 = now_ns();
        if (c % probe_every == 0) {
            oob = write(job.dst, job.numel, job.index, job.src, a, b);
            double t1 = now_ns();
            if (oob >= 0)
                break;
            bad = check(job.dst, job.numel, job.index, job.src, a, b);
            plain_ns += t1 - t0;
            probe_ns += now_ns() - t1;
            plain_n += b - a;
        } else {
            bad = both(job.dst, job.numel, job.index, job.src, a, b, &oob);
            fused_ns += now_ns() - t0;
            fused_n += b - a;
            if (oob >= 0)
                break;
        }
        if (bad >= 0)
            break;
        a = b;
    }
    Py_END_ALLOW_THREADS
    if (oob >= 0)
        return out_of_range(&job, oob);
    return Py_BuildValue("ndndnd", bad, fused_ns, fused_n, plain_ns, plain_n, probe_ns);
}

static PyMethodDef methods[] = {
    {"scatter", scatter, METH_VARARGS, scatter_doc},
    {"scatter_checked", scatter_checked, METH_VARARGS, scatter_checked_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_host_scatter", "Live apply's compiled host scatter and read-back.", -1, methods,
};

PyMODINIT_FUNC PyInit__host_scatter(void) { return PyModule_Create(&module); }
