/* Live apply's host writes, compiled: the pause's scatter into a CPU parameter and its
 * read-back (sglang_patch/live/host_scatter.py is the Python side and its fallback).
 *
 * Why compiled: the pause writes a few million scattered elements, each a cache miss, and then
 * reads every one back to compare it with the staged value. Through numpy the read-back is a
 * gather into a buffer, a compare into another and a scan (three passes and a call each), about
 * half the write's own cost; here it is one loop over the lines the write just brought into
 * cache, a few percent of it.
 *
 * The caller owns the memory: every pointer is the data of a contiguous CPU tensor it keeps
 * alive for the call, and the element width is 1, 2, 4 or 8 bytes. Positions are checked
 * against the destination's length before each write (a position out of range is an error,
 * never a write outside the parameter). The GIL is released inside the loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

#define SCATTER(T)                                                          \
    do {                                                                    \
        T *d = (T *)dst;                                                    \
        const T *s = (const T *)src;                                        \
        for (Py_ssize_t i = start; i < stop; i++) {                         \
            int64_t j = index[i];                                           \
            if ((uint64_t)j >= (uint64_t)numel) { bad = i; break; }         \
            d[j] = s[i];                                                    \
        }                                                                   \
    } while (0)

/* volatile: the compiler knows what it just stored and would drop the load; the point is to
 * read what the parameter's memory holds now */
#define FIRST_DIFFERING(T)                                                  \
    do {                                                                    \
        const volatile T *d = (const volatile T *)dst;                      \
        const T *s = (const T *)src;                                        \
        for (Py_ssize_t i = start; i < stop; i++) {                         \
            int64_t j = index[i];                                           \
            if ((uint64_t)j >= (uint64_t)numel || d[j] != s[i]) { bad = i; break; }  \
        }                                                                   \
    } while (0)

static int parse(PyObject *args, void **dst, Py_ssize_t *numel, const int64_t **index, const void **src,
                 Py_ssize_t *start, Py_ssize_t *stop, int *width) {
    unsigned long long d, ix, s;
    if (!PyArg_ParseTuple(args, "KnKKnni", &d, numel, &ix, &s, start, stop, width))
        return -1;
    if (*width != 1 && *width != 2 && *width != 4 && *width != 8) {
        PyErr_Format(PyExc_ValueError, "element width must be 1, 2, 4 or 8 bytes, got %d", *width);
        return -1;
    }
    if (*start < 0 || *stop < *start || *numel < 0) {
        PyErr_Format(PyExc_ValueError, "bad range %zd:%zd (destination of %zd elements)", *start, *stop, *numel);
        return -1;
    }
    if ((d == 0 || ix == 0 || s == 0) && *stop > *start) {
        PyErr_SetString(PyExc_ValueError, "null data pointer");
        return -1;
    }
    *dst = (void *)(uintptr_t)d;
    *index = (const int64_t *)(uintptr_t)ix;
    *src = (const void *)(uintptr_t)s;
    return 0;
}

PyDoc_STRVAR(scatter_doc,
"scatter(dst, numel, index, src, start, stop, width) -> None\n\n"
"dst[index[i]] = src[i] for i in start..stop (data pointers; width: bytes per element).\n"
"IndexError at the first position outside 0..numel-1 (the ones before it are written).");

static PyObject *scatter(PyObject *self, PyObject *args) {
    void *dst; Py_ssize_t numel, start, stop; const int64_t *index; const void *src; int width;
    if (parse(args, &dst, &numel, &index, &src, &start, &stop, &width) < 0)
        return NULL;
    Py_ssize_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    switch (width) {
        case 1: SCATTER(uint8_t); break;
        case 2: SCATTER(uint16_t); break;
        case 4: SCATTER(uint32_t); break;
        default: SCATTER(uint64_t); break;
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "position %lld (entry %zd) is outside the destination's %zd elements",
                     (long long)index[bad], bad, numel);
        return NULL;
    }
    Py_RETURN_NONE;
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

PyDoc_STRVAR(scatter_checked_doc,
"scatter_checked(dst, numel, index, src, start, stop, width, block, time_every) -> (int, float)\n\n"
"scatter, block by block, each block read back from the destination right after its write\n"
"(its lines still in cache) and compared bit for bit with src. Returns (the first entry i\n"
"whose element reads back other bits, or -1; the read-back's nanoseconds). The read-back is\n"
"timed on the first block and every time_every-th one after, and scaled to all blocks (a clock\n"
"read per block would cost more than the read-back of a small block). IndexError as scatter.");

static PyObject *scatter_checked(PyObject *self, PyObject *args) {
    unsigned long long d, ix, s;
    Py_ssize_t numel, start0, stop0, block, time_every;
    int width;
    if (!PyArg_ParseTuple(args, "KnKKnninn", &d, &numel, &ix, &s, &start0, &stop0, &width, &block, &time_every))
        return NULL;
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_Format(PyExc_ValueError, "element width must be 1, 2, 4 or 8 bytes, got %d", width);
        return NULL;
    }
    if (block < 1 || time_every < 1 || start0 < 0 || stop0 < start0 || numel < 0) {
        PyErr_Format(PyExc_ValueError, "bad range %zd:%zd, block %zd or time_every %zd", start0, stop0, block, time_every);
        return NULL;
    }
    if ((d == 0 || ix == 0 || s == 0) && stop0 > start0) {
        PyErr_SetString(PyExc_ValueError, "null data pointer");
        return NULL;
    }
    void *dst = (void *)(uintptr_t)d;
    const int64_t *index = (const int64_t *)(uintptr_t)ix;
    const void *src = (const void *)(uintptr_t)s;
    Py_ssize_t bad = -1, oob = -1, blocks = 0, timed = 0;
    double timed_ns = 0.0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t a = start0; a < stop0; a += block) {
        Py_ssize_t start = a, stop = a + block < stop0 ? a + block : stop0;
        switch (width) {
            case 1: SCATTER(uint8_t); break;
            case 2: SCATTER(uint16_t); break;
            case 4: SCATTER(uint32_t); break;
            default: SCATTER(uint64_t); break;
        }
        if (bad >= 0) { oob = bad; break; }
        int timing = blocks % time_every == 0;
        double t0 = timing ? now_ns() : 0.0;
        switch (width) {
            case 1: FIRST_DIFFERING(uint8_t); break;
            case 2: FIRST_DIFFERING(uint16_t); break;
            case 4: FIRST_DIFFERING(uint32_t); break;
            default: FIRST_DIFFERING(uint64_t); break;
        }
        if (timing) { timed_ns += now_ns() - t0; timed++; }
        blocks++;
        if (bad >= 0) break;
    }
    Py_END_ALLOW_THREADS
    if (oob >= 0) {
        PyErr_Format(PyExc_IndexError, "position %lld (entry %zd) is outside the destination's %zd elements",
                     (long long)index[oob], oob, numel);
        return NULL;
    }
    double estimate = timed ? timed_ns * (double)blocks / (double)timed : 0.0;
    return Py_BuildValue("nd", bad, estimate);
}

static PyMethodDef methods[] = {
    {"scatter_checked", scatter_checked, METH_VARARGS, scatter_checked_doc},
    {"scatter", scatter, METH_VARARGS, scatter_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_host_scatter", "Live apply's compiled host scatter and read-back.", -1, methods,
};

PyMODINIT_FUNC PyInit__host_scatter(void) { return PyModule_Create(&module); }
