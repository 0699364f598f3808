/* statebridge.connector.data.shared._copy: copy a request's runs out of a peer's shared mapping, GIL released.
 *
 * copy_groups(dst_addr, dst_size, src_addr, src_size, groups) copies, for each group
 * (runs, src_add, dst_add), every row (src_off, dst_off, nbytes) of ``runs`` (a C-contiguous
 * int64 buffer of shape (n, 3)) from src_addr + src_add + src_off to dst_addr + dst_add +
 * dst_off, after checking every shifted row of every group lies inside both spans (ValueError
 * naming the group and row otherwise; nothing is copied then): a rank's cached run tables are
 * passed as they are, only the request's bases change.
 * Runs of NT_MIN bytes or more are copied with non-temporal stores where the CPU has AVX2:
 * a copied state is read by the decode kernels later, not at once, and streaming stores skip
 * the read-for-ownership of the destination (faster per core than process_vm_readv and memcpy:
 * docs/measurements.md, "Reading state out of a shared map"), prefetching the source a few KiB
 * ahead (PREFETCH_AHEAD). Shorter runs use memcpy.
 *
 * answer(addr, size, offset, expected, value) is the reader's "done": a compare-and-swap of
 * one word of the control area in the peer's buffer, from the pending mark the peer wrote for
 * this request to the request's serial. A late answer of an earlier request that used the
 * same slot finds another mark and writes nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define NT_MIN (64 * 1024)
/* How far ahead of the loads the streaming copy prefetches its source, into L2. A source is a
 * peer's memfd in 4 KiB pages (shmem gets no huge pages here) and the hardware prefetchers stop
 * at a page's end, so without it every page starts with demand misses. The distance and the
 * hint are the fastest of those compared (docs/measurements.md, "Prefetching the shared map's
 * source"). */
#ifndef PREFETCH_AHEAD                  /* benchmarks/copy_prefetch.c builds other values */
#define PREFETCH_AHEAD 3072
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T1
#endif

#if defined(__x86_64__)
__attribute__((target("avx2")))
static void nt_copy(char *d, const char *s, size_t n)
{
    size_t head = (32 - ((uintptr_t)d & 31)) & 31;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    size_t i = head;
    for (; i + 256 <= n; i += 256) {
#if PREFETCH_AHEAD > 0
        if (i + PREFETCH_AHEAD + 256 <= n) {       /* never past the run */
            const char *p = s + i + PREFETCH_AHEAD;
            _mm_prefetch(p, PREFETCH_HINT);
            _mm_prefetch(p + 64, PREFETCH_HINT);
            _mm_prefetch(p + 128, PREFETCH_HINT);
            _mm_prefetch(p + 192, PREFETCH_HINT);
        }
#endif
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        __m256i f = _mm256_loadu_si256((const __m256i *)(s + i + 128));
        __m256i g = _mm256_loadu_si256((const __m256i *)(s + i + 160));
        __m256i h = _mm256_loadu_si256((const __m256i *)(s + i + 192));
        __m256i k = _mm256_loadu_si256((const __m256i *)(s + i + 224));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
        _mm256_stream_si256((__m256i *)(d + i + 128), f);
        _mm256_stream_si256((__m256i *)(d + i + 160), g);
        _mm256_stream_si256((__m256i *)(d + i + 192), h);
        _mm256_stream_si256((__m256i *)(d + i + 224), k);
    }
    _mm_sfence();
    if (i < n)
        memcpy(d + i, s + i, n - i);
}
#endif

static int have_avx2(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    return !!__builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static int streaming = 0;

#define MAX_GROUPS 64

typedef struct {
    Py_buffer view;
    const int64_t *rows;
    Py_ssize_t n;
    int64_t src_add, dst_add;
} group_t;

/* Check every row of every group, shifted, against both spans; -1 with ValueError naming the
 * group and row (nothing copied then), else the total bytes in *total. */
static int check_groups(const group_t *g, Py_ssize_t ng, Py_ssize_t src_size,
                        Py_ssize_t dst_size, long long *total)
{
    long long sum = 0;
    for (Py_ssize_t k = 0; k < ng; k++) {
        for (Py_ssize_t i = 0; i < g[k].n; i++) {
            const int64_t *r = g[k].rows + 3 * i;
            int64_t so, d, len = r[2];
            if (__builtin_add_overflow(r[0], g[k].src_add, &so)
                || __builtin_add_overflow(r[1], g[k].dst_add, &d)
                || so < 0 || d < 0 || len < 0 || so > src_size - len || d > dst_size - len) {
                PyErr_Format(PyExc_ValueError,
                             "run %zd of group %zd (src %lld + %lld, dst %lld + %lld, %lld "
                             "bytes) is outside the source (%zd bytes) or the destination "
                             "(%zd bytes)", i, k, (long long)r[0], (long long)g[k].src_add,
                             (long long)r[1], (long long)g[k].dst_add, (long long)len,
                             src_size, dst_size);
                return -1;
            }
            sum += len;
        }
    }
    *total = sum;
    return 0;
}

static void copy_checked(const group_t *g, Py_ssize_t ng, unsigned long long dst_addr,
                         unsigned long long src_addr)
{
    for (Py_ssize_t k = 0; k < ng; k++) {
        char *dbase = (char *)(uintptr_t)dst_addr + g[k].dst_add;
        const char *sbase = (const char *)(uintptr_t)src_addr + g[k].src_add;
        for (Py_ssize_t i = 0; i < g[k].n; i++) {
            const int64_t *r = g[k].rows + 3 * i;
            char *dp = dbase + r[1];
            const char *sp = sbase + r[0];
            size_t len = (size_t)r[2];
#if defined(__x86_64__)
            if (streaming && len >= NT_MIN) {
                nt_copy(dp, sp, len);
                continue;
            }
#endif
            memcpy(dp, sp, len);
        }
    }
}

static int take_rows(PyObject *obj, group_t *g)
{
    if (PyObject_GetBuffer(obj, &g->view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (g->view.len % (Py_ssize_t)(3 * sizeof(int64_t)) != 0) {
        PyErr_Format(PyExc_ValueError, "runs hold %zd bytes, not rows of 3 int64",
                     g->view.len);
        PyBuffer_Release(&g->view);
        return -1;
    }
    g->rows = (const int64_t *)g->view.buf;
    g->n = g->view.len / (Py_ssize_t)(3 * sizeof(int64_t));
    return 0;
}

static PyObject *run_groups(group_t *g, Py_ssize_t ng, unsigned long long dst_addr,
                            Py_ssize_t dst_size, unsigned long long src_addr,
                            Py_ssize_t src_size)
{
    long long total = 0;
    int bad = check_groups(g, ng, src_size, dst_size, &total);
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        copy_checked(g, ng, dst_addr, src_addr);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t k = 0; k < ng; k++)
        PyBuffer_Release(&g[k].view);
    return bad ? NULL : PyLong_FromLongLong(total);
}

static PyObject *copy_groups(PyObject *self, PyObject *args)
{
    unsigned long long dst_addr, src_addr;
    Py_ssize_t dst_size, src_size;
    PyObject *seq;
    group_t g[MAX_GROUPS];
    if (!PyArg_ParseTuple(args, "KnKnO", &dst_addr, &dst_size, &src_addr, &src_size, &seq))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "groups must be a sequence of (runs, src_add, "
                                          "dst_add)");
    if (fast == NULL)
        return NULL;
    Py_ssize_t ng = PySequence_Fast_GET_SIZE(fast);
    if (ng > MAX_GROUPS) {
        PyErr_Format(PyExc_ValueError, "%zd groups, at most %d", ng, MAX_GROUPS);
        Py_DECREF(fast);
        return NULL;
    }
    Py_ssize_t taken = 0;
    for (; taken < ng; taken++) {
        PyObject *runs;
        group_t *gk = &g[taken];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, taken), "OLL;a group is "
                              "(runs, src_add, dst_add)", &runs, &gk->src_add, &gk->dst_add)
            || take_rows(runs, gk) < 0)
            break;
    }
    Py_DECREF(fast);
    if (taken < ng) {
        for (Py_ssize_t k = 0; k < taken; k++)
            PyBuffer_Release(&g[k].view);
        return NULL;
    }
    return run_groups(g, ng, dst_addr, dst_size, src_addr, src_size);
}

static PyObject *answer(PyObject *self, PyObject *args)
{
    unsigned long long addr;
    Py_ssize_t size;
    long long offset, expected, value;
    if (!PyArg_ParseTuple(args, "KnLLL", &addr, &size, &offset, &expected, &value))
        return NULL;
    if (offset < 0 || offset % 8 != 0 || offset > (long long)size - 8) {
        PyErr_Format(PyExc_ValueError, "answer word at offset %lld is not an aligned word of "
                     "the %zd-byte buffer", offset, size);
        return NULL;
    }
    int64_t want = expected;
    int swapped = __atomic_compare_exchange_n((int64_t *)(uintptr_t)(addr + offset), &want,
                                              (int64_t)value, 0, __ATOMIC_SEQ_CST,
                                              __ATOMIC_SEQ_CST);
    return PyBool_FromLong(swapped);
}

static PyObject *set_streaming(PyObject *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    int old = streaming;
    streaming = on && have_avx2();
    return PyBool_FromLong(old);
}

static PyMethodDef methods[] = {
    {"set_streaming", set_streaming, METH_O,
     "set_streaming(on) -> the previous setting: non-temporal stores for large runs (only "
     "where the CPU has AVX2)."},
    {"copy_groups", copy_groups, METH_VARARGS,
     "copy_groups(dst_addr, dst_size, src_addr, src_size, groups) -> bytes copied.\n\n"
     "Copy each (src_off, dst_off, nbytes) row of the int64 buffer ``runs`` of each "
     "(runs, src_add, dst_add) of ``groups`` (at most 64) from src_addr + src_add to "
     "dst_addr + dst_add: every row of every group is checked against both sizes first "
     "(ValueError, nothing copied), then all are copied with the GIL released once; runs of "
     "64 KiB or more use non-temporal stores where the CPU has AVX2."},
    {"answer", answer, METH_VARARGS,
     "answer(addr, size, offset, expected, value) -> bool.\n\n"
     "Atomically replace the int64 word at addr + offset by ``value`` if it holds "
     "``expected`` (compare-and-swap, a full barrier: every read of the copy before it is "
     "done); False when it held anything else. ValueError when the word is not an aligned "
     "word inside ``size`` bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "statebridge.connector.data.shared._copy",
    "Run copies out of a peer's shared mapping (see copy_groups).", -1, methods,
};

PyMODINIT_FUNC PyInit__copy(void)
{
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
    streaming = have_avx2();
    if (PyModule_AddIntConstant(mod, "STREAMING", streaming) < 0
        || PyModule_AddIntConstant(mod, "STREAMING_MIN_BYTES", NT_MIN) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
