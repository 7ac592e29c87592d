/* sparse-v2 bitstream 3: one segment's changes, range coded with adaptive binary contexts
 * (spec: docs/FORMAT.md, "sparse-v2", "Bitstream 3").
 *
 * Why compiled: the coder makes one binary decision per element of the segment (was this
 * element changed?), with a probability that follows the old element's key and how many of
 * the previous 64 elements changed. numpy can only run such a decoder across interleaved
 * lanes, at 50-150 ns an element; here it is a few ns.
 *
 * The coder is the classic range coder with a 32-bit range and byte output, whose encoder
 * caches its top byte until a carry can no longer reach it (as LZMA's does). A context's probability is kept in 32 bits (16 would floor a
 * rare change's probability near 2^s / 2^16, 1.6% at s = 10: that cost 7% of a sparse step's
 * bytes) and coded at 16, with a count-driven adaptation rate.
 * Every loop is bounded by the segment's element count (at most one decision per element for
 * the mask, and at most 3 + 2 (8 width) per change), and the decoder never reads past the
 * declared part, so work on bad input is tied to the segment. The decoder writes nothing
 * until the whole segment decoded cleanly: exactly the declared changes, and exactly the
 * declared bytes consumed. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PROB_BITS 16
#define TOP (1u << 24)
#define NB 8        /* neighbourhood buckets */
#define NKEYS 256
#define NLEN 16     /* unary length contexts per key */

typedef struct {
    uint32_t p0; /* P(bit == 0) in 1/2^32 */
    uint32_t n;  /* observations, saturating: sets the adaptation rate */
} Prob;

/* The adaptation rate: 1/2^s with s = min(floor(log2(n + 2)), 12) after n observations, about a
 * running average at first (n + 2 ~ 2^s), then a window of ~2^12 observations. */
#define MAX_COUNT 4096
static uint8_t SHIFT_OF_COUNT[MAX_COUNT + 1];

static void shift_init(void) {
    for (unsigned n = 0; n <= MAX_COUNT; n++) {
        unsigned s = 0;
        while ((n + 2) >> (s + 1)) s++;
        SHIFT_OF_COUNT[n] = (uint8_t)(s < 12 ? s : 12);
    }
}

static inline uint32_t prob16(const Prob *p) {
    uint32_t q = p->p0 >> 16;
    return q ? q : 1;
}

static inline void adapt(Prob *p, int bit) {
    unsigned s = SHIFT_OF_COUNT[p->n];
    if (bit)
        p->p0 -= p->p0 >> s;
    else
        p->p0 += (uint32_t)((0x100000000ull - p->p0) >> s);
    p->n += p->n < MAX_COUNT;
}

/* The bucket of the number of changes among the previous 64 elements of the segment. */
static const uint8_t BUCKET[65] = {0, 1, 2, 3, 3, 4, 4, 4, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6,
                                   7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
                                   7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7};

typedef struct {
    Prob mask[NKEYS * NB];
    Prob sign[NKEYS];
    Prob large[NKEYS];
    Prob len[NKEYS * NLEN];
    Prob top[NLEN];
    Prob low[NLEN * NLEN];
} Model;

static void model_init(Model *m) {
    Prob *all = (Prob *)m;
    size_t count = sizeof(Model) / sizeof(Prob);
    for (size_t i = 0; i < count; i++) {
        all[i].p0 = 0x80000000u;
        all[i].n = 0;
    }
}

/* --- encoder ------------------------------------------------------------------------------ */

typedef struct {
    uint64_t low;
    uint32_t range;
    uint8_t cache;
    uint64_t cache_size;
    uint8_t *out;
    size_t len, cap;
    int failed;
} Enc;

static void enc_put(Enc *e, uint8_t b) {
    if (e->len == e->cap) {
        size_t cap = e->cap ? 2 * e->cap : 4096;
        uint8_t *grown = realloc(e->out, cap);
        if (!grown) {
            e->failed = 1;
            return;
        }
        e->out = grown;
        e->cap = cap;
    }
    e->out[e->len++] = b;
}

static void enc_shift_low(Enc *e) {
    if ((uint32_t)e->low < 0xFF000000u || (e->low >> 32) != 0) {
        uint8_t carry = (uint8_t)(e->low >> 32);
        uint8_t temp = e->cache;
        do {
            enc_put(e, (uint8_t)(temp + carry));
            temp = 0xFF;
        } while (--e->cache_size != 0);
        e->cache = (uint8_t)((uint32_t)e->low >> 24);
    }
    e->cache_size++;
    e->low = (uint32_t)e->low << 8;
}

static inline void enc_bit(Enc *e, Prob *p, int bit) {
    uint32_t bound = (e->range >> PROB_BITS) * prob16(p);
    if (bit) {
        e->low += bound;
        e->range -= bound;
    } else {
        e->range = bound;
    }
    adapt(p, bit);
    while (e->range < TOP) {
        e->range <<= 8;
        enc_shift_low(e);
    }
}

static void enc_flush(Enc *e) {
    for (int i = 0; i < 5; i++) enc_shift_low(e);
}

/* --- decoder ------------------------------------------------------------------------------ */

typedef struct {
    uint32_t code;
    uint32_t range;
    const uint8_t *in, *end;
    int overrun;
} Dec;

static inline uint8_t dec_byte(Dec *d) {
    if (d->in == d->end) {
        d->overrun = 1;
        return 0;
    }
    return *d->in++;
}

static inline int dec_bit(Dec *d, Prob *p) {
    uint32_t bound = (d->range >> PROB_BITS) * prob16(p);
    int bit;
    if (d->code < bound) {
        d->range = bound;
        bit = 0;
    } else {
        d->code -= bound;
        d->range -= bound;
        bit = 1;
    }
    adapt(p, bit);
    while (d->range < TOP) {
        d->range <<= 8;
        d->code = (d->code << 8) | dec_byte(d);
    }
    return bit;
}

/* --- the element code, one function per width ------------------------------------------------
 * The order map T of sparse-v1 (transform 1): negative values are inverted, positive ones get
 * the top bit, so a weight crossing zero moves a few steps. d = T(new) - T(old) mod 2^b. */

static inline unsigned capped(int i) { return (unsigned)(i < NLEN ? i : NLEN - 1); }

/* The changed bits of the segment's previous 64 elements, and their count. */
typedef struct {
    uint64_t hist;
    unsigned recent;
} Neighbours;

static inline Prob *mask_prob(Model *m, unsigned key, const Neighbours *nb) {
    return &m->mask[key * NB + BUCKET[nb->recent]];
}

static inline void neighbours_push(Neighbours *nb, int changed) {
    nb->recent += (unsigned)changed - (unsigned)(nb->hist >> 63);
    nb->hist = (nb->hist << 1) | (uint64_t)changed;
}

/* |d| >= 2 as v = |d| - 1 >= 1: its bit length - 1 in unary (no terminator at the longest a
 * width allows, so |d| <= 2^(bits - 1)), then the bit below its leading one, then the rest. */
static inline void enc_magnitude(Enc *e, Model *m, unsigned key, uint64_t v, int bits) {
    int len = 63 - __builtin_clzll(v);
    for (int j = 0; j < len; j++) enc_bit(e, &m->len[key * NLEN + capped(j)], 1);
    if (len < bits - 2) enc_bit(e, &m->len[key * NLEN + capped(len)], 0);
    if (len > 0) enc_bit(e, &m->top[capped(len)], (int)((v >> (len - 1)) & 1));
    for (int b = len - 2; b >= 0; b--) enc_bit(e, &m->low[capped(len) * NLEN + capped(len - 1 - b)], (int)((v >> b) & 1));
}

static inline uint64_t dec_magnitude(Dec *d, Model *m, unsigned key, int bits) {
    int len = 0;
    while (len < bits - 2 && dec_bit(d, &m->len[key * NLEN + capped(len)])) len++;
    uint64_t v = 1;
    if (len > 0) v = (v << 1) | (uint64_t)dec_bit(d, &m->top[capped(len)]);
    for (int b = len - 2; b >= 0; b--) v = (v << 1) | (uint64_t)dec_bit(d, &m->low[capped(len) * NLEN + capped(len - 1 - b)]);
    return v + 1;
}

#define DEFINE_WIDTH(T, B, KEY_SHIFT)                                                            \
    static inline T order_##B(T x) {                                                             \
        T top = (T)((T)1 << (B - 1));                                                            \
        return (x & top) ? (T)~x : (T)(x | top);                                                 \
    }                                                                                            \
    static inline T unorder_##B(T y) {                                                           \
        T top = (T)((T)1 << (B - 1));                                                            \
        return (y & top) ? (T)(y & (T)~top) : (T)~y;                                             \
    }                                                                                            \
    static inline unsigned key_##B(T x) {                                                        \
        return (unsigned)((x & (T)~((T)1 << (B - 1))) >> KEY_SHIFT);                            \
    }                                                                                            \
    /* Element i of a tensor's bytes: our writer packs tensors back to back, so an element may  \
     * sit at any byte offset; memcpy is the defined unaligned access (one load at -O2). */    \
    static inline T load_##B(const uint8_t *base, size_t i) {                                    \
        T x;                                                                                     \
        memcpy(&x, base + i * sizeof(T), sizeof(T));                                             \
        return x;                                                                                \
    }                                                                                            \
    static inline void store_##B(uint8_t *base, size_t i, T x) {                                 \
        memcpy(base + i * sizeof(T), &x, sizeof(T));                                             \
    }                                                                                            \
    static void encode_##B(Enc *e, Model *m, const uint8_t *old, const uint8_t *new_, size_t n,  \
                           size_t *k, size_t *changed_bytes) {                                   \
        Neighbours nb = {0, 0};                                                                  \
        for (size_t i = 0; i < n; i++) {                                                         \
            T o = load_##B(old, i), w = load_##B(new_, i);                                       \
            unsigned key = key_##B(o);                                                           \
            int changed = o != w;                                                                \
            enc_bit(e, mask_prob(m, key, &nb), changed);                                         \
            neighbours_push(&nb, changed);                                                       \
            if (!changed) continue;                                                              \
            (*k)++;                                                                              \
            T x = o ^ w;                                                                         \
            for (int byte = 0; byte < B / 8; byte++) *changed_bytes += ((x >> (8 * byte)) & 0xFF) != 0; \
            T d = (T)(order_##B(w) - order_##B(o));                                              \
            int negative = (d >> (B - 1)) & 1;                                                   \
            T mag = negative ? (T)(0 - d) : d; /* 2^(B-1) stays itself: right, read unsigned */  \
            enc_bit(e, &m->sign[key], negative);                                                 \
            enc_bit(e, &m->large[key], mag > 1);                                                 \
            if (mag > 1) enc_magnitude(e, m, key, (uint64_t)mag - 1, B);                         \
        }                                                                                        \
    }                                                                                            \
    /* NULL on success, else the reason; pos/val receive at most cap changes. */              \
    static const char *decode_##B(Dec *dc, Model *m, const uint8_t *old, size_t n, size_t cap,   \
                                  uint32_t *pos, T *val, size_t *k) {                           \
        Neighbours nb = {0, 0};                                                                  \
        for (size_t i = 0; i < n; i++) {                                                         \
            T o = load_##B(old, i);                                                              \
            unsigned key = key_##B(o);                                                           \
            int changed = dec_bit(dc, mask_prob(m, key, &nb));                                   \
            neighbours_push(&nb, changed);                                                       \
            if (!changed) continue;                                                              \
            if (*k == cap) return "more changes than the segment table declares";               \
            if (dc->overrun) return "the coded part ends before its segment does";              \
            int negative = dec_bit(dc, &m->sign[key]);                                           \
            uint64_t mag = dec_bit(dc, &m->large[key]) ? dec_magnitude(dc, m, key, B) : 1;       \
            T d = negative ? (T)(0 - (T)mag) : (T)mag;                                           \
            pos[*k] = (uint32_t)i;                                                               \
            val[*k] = unorder_##B((T)(order_##B(o) + d));                                        \
            (*k)++;                                                                              \
        }                                                                                        \
        return NULL;                                                                             \
    }                                                                                            \
    static void scatter_##B(uint8_t *seg, const uint32_t *pos, const T *val, size_t k) {         \
        for (size_t j = 0; j < k; j++) store_##B(seg, pos[j], val[j]);                           \
    }

DEFINE_WIDTH(uint8_t, 8, 0)
DEFINE_WIDTH(uint16_t, 16, 7)
DEFINE_WIDTH(uint32_t, 32, 23)
DEFINE_WIDTH(uint64_t, 64, 55)

/* --- Python glue -------------------------------------------------------------------------- */

#define MAX_SEGMENT (1u << 20)

static int width_ok(int width) { return width == 1 || width == 2 || width == 4 || width == 8; }

/* encode_segment(old, new, width) -> (coded bytes, changes, changed bytes); the coded bytes
 * mean nothing when no element changed. */
static PyObject *py_encode_segment(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer old, new_;
    int width;
    if (!PyArg_ParseTuple(args, "y*y*i", &old, &new_, &width)) return NULL;
    PyObject *result = NULL;
    if (!width_ok(width) || old.len != new_.len || old.len % width != 0 ||
        (size_t)(old.len / width) > MAX_SEGMENT) {
        PyErr_SetString(PyExc_ValueError, "encode_segment: old and new must be one segment of equal size");
        goto done;
    }
    size_t n = (size_t)(old.len / width), k = 0, changed_bytes = 0;
    Model *m = malloc(sizeof(Model));
    Enc e = {0, 0xFFFFFFFFu, 0, 1, NULL, 0, 0, 0};
    if (!m) {
        PyErr_NoMemory();
        goto done;
    }
    model_init(m);
    Py_BEGIN_ALLOW_THREADS
    switch (width) {
    case 1: encode_8(&e, m, old.buf, new_.buf, n, &k, &changed_bytes); break;
    case 2: encode_16(&e, m, old.buf, new_.buf, n, &k, &changed_bytes); break;
    case 4: encode_32(&e, m, old.buf, new_.buf, n, &k, &changed_bytes); break;
    default: encode_64(&e, m, old.buf, new_.buf, n, &k, &changed_bytes); break;
    }
    enc_flush(&e);
    Py_END_ALLOW_THREADS
    free(m);
    if (e.failed) {
        free(e.out);
        PyErr_NoMemory();
        goto done;
    }
    result = Py_BuildValue("(y#nn)", (const char *)e.out, (Py_ssize_t)e.len, (Py_ssize_t)k, (Py_ssize_t)changed_bytes);
    free(e.out);
done:
    PyBuffer_Release(&old);
    PyBuffer_Release(&new_);
    return result;
}

/* decode_segment(segment, coded, width, changes) -> None: segment (writable, the old bytes)
 * receives the new bytes, or nothing when the coded part is bad (ValueError: the reason). */
static PyObject *py_decode_segment(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer seg, coded;
    int width;
    Py_ssize_t declared;
    if (!PyArg_ParseTuple(args, "w*y*in", &seg, &coded, &width, &declared)) return NULL;
    PyObject *result = NULL;
    uint32_t *pos = NULL;
    void *val = NULL;
    Model *m = NULL;
    if (!width_ok(width) || seg.len % width != 0 || (size_t)(seg.len / width) > MAX_SEGMENT ||
        declared < 1 || (size_t)declared > (size_t)(seg.len / width)) {
        PyErr_SetString(PyExc_ValueError, "decode_segment: a segment of at most 2^20 elements and 1..its length changes");
        goto done;
    }
    size_t n = (size_t)(seg.len / width), k = 0;
    pos = malloc((size_t)declared * sizeof(uint32_t));
    val = malloc((size_t)declared * (size_t)width);
    m = malloc(sizeof(Model));
    if (!pos || !val || !m) {
        PyErr_NoMemory();
        goto done;
    }
    model_init(m);
    const char *err = NULL;
    const uint8_t *in = coded.buf;
    Py_BEGIN_ALLOW_THREADS
    if (coded.len < 5) {
        err = "the coded part is shorter than the coder's 5 start bytes";
    } else if (in[0] != 0) {
        err = "the coded part's first byte is not 0";
    } else {
        Dec dc = {0, 0xFFFFFFFFu, in, in + coded.len, 0};
        for (int i = 0; i < 5; i++) dc.code = (dc.code << 8) | dec_byte(&dc);
        switch (width) {
        case 1: err = decode_8(&dc, m, seg.buf, n, (size_t)declared, pos, val, &k); break;
        case 2: err = decode_16(&dc, m, seg.buf, n, (size_t)declared, pos, val, &k); break;
        case 4: err = decode_32(&dc, m, seg.buf, n, (size_t)declared, pos, val, &k); break;
        default: err = decode_64(&dc, m, seg.buf, n, (size_t)declared, pos, val, &k); break;
        }
        if (!err && dc.overrun) err = "the coded part ends before its segment does";
        if (!err && k != (size_t)declared) err = "fewer changes than the segment table declares";
        if (!err && dc.in != dc.end) err = "bytes follow the end of the coded part";
        if (!err) {
            switch (width) {
            case 1: scatter_8(seg.buf, pos, val, k); break;
            case 2: scatter_16(seg.buf, pos, val, k); break;
            case 4: scatter_32(seg.buf, pos, val, k); break;
            default: scatter_64(seg.buf, pos, val, k); break;
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    free(pos);
    free(val);
    free(m);
    PyBuffer_Release(&seg);
    PyBuffer_Release(&coded);
    return result;
}

static PyMethodDef METHODS[] = {
    {"encode_segment", py_encode_segment, METH_VARARGS, "encode_segment(old, new, width) -> (coded, changes, changed_bytes)"},
    {"decode_segment", py_decode_segment, METH_VARARGS, "decode_segment(segment, coded, width, changes) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_sparse2_rc", "sparse-v2 bitstream 3: the range coder", -1, METHODS, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sparse2_rc(void) { shift_init(); return PyModule_Create(&MODULE); }
