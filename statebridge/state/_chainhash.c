/* statebridge.state._chainhash: a prompt's chain of block hashes in one call.
 *
 * chain(root, data, block_bytes) returns the list of h[i] for every full block of ``data``
 * (``len(data) // block_bytes`` of them), where
 *
 *     h[-1] = root (16 bytes),  h[i] = BLAKE2b-128(h[i-1] | data[i*block_bytes:(i+1)*block_bytes])
 *
 * exactly what statebridge/state/prefix.py computes with hashlib (unkeyed BLAKE2b, 16-byte
 * digest, no salt or personalization: RFC 7693), without a Python call and two bytes objects
 * per block. prefix.py falls back to hashlib when this module is not built; the tests compare
 * the two.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define DIGEST 16
#define BLOCK 128

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

/* The message word schedule of each of the 12 rounds (rounds 10 and 11 repeat 0 and 1). */
static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

/* A little-endian word on any host, written out so that compilers make it one load. */
static inline uint64_t load64(const uint8_t *p)
{
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline uint64_t rotr64(uint64_t w, unsigned c) { return (w >> c) | (w << (64 - c)); }

#define G(a, b, c, d, x, y)                 \
    do {                                    \
        a = a + b + (x);                    \
        d = rotr64(d ^ a, 32);              \
        c = c + d;                          \
        b = rotr64(b ^ c, 24);              \
        a = a + b + (y);                    \
        d = rotr64(d ^ a, 16);              \
        c = c + d;                          \
        b = rotr64(b ^ c, 63);              \
    } while (0)

/* One compression of the 128-byte ``block``; ``t``: message bytes so far, this block included
 * (our messages stay far below 2**64 bytes: the high counter word is 0). */
static void compress(uint64_t h[8], const uint8_t *block, uint64_t t, int last)
{
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++)
        m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;
    if (last)
        v[14] = ~v[14];
    /* the rounds written out: with constant schedules the message words stay in registers */
#define ROUND(r)                                                    \
    do {                                                            \
        G(v[0], v[4], v[8], v[12], m[SIGMA[r][0]], m[SIGMA[r][1]]);   \
        G(v[1], v[5], v[9], v[13], m[SIGMA[r][2]], m[SIGMA[r][3]]);   \
        G(v[2], v[6], v[10], v[14], m[SIGMA[r][4]], m[SIGMA[r][5]]);  \
        G(v[3], v[7], v[11], v[15], m[SIGMA[r][6]], m[SIGMA[r][7]]);  \
        G(v[0], v[5], v[10], v[15], m[SIGMA[r][8]], m[SIGMA[r][9]]);  \
        G(v[1], v[6], v[11], v[12], m[SIGMA[r][10]], m[SIGMA[r][11]]); \
        G(v[2], v[7], v[8], v[13], m[SIGMA[r][12]], m[SIGMA[r][13]]);  \
        G(v[3], v[4], v[9], v[14], m[SIGMA[r][14]], m[SIGMA[r][15]]);  \
    } while (0)
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
#undef ROUND
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b-128 of ``prev`` (16 bytes) followed by ``data`` (``n`` bytes), into ``out``. */
static void blake2b_128(uint8_t out[DIGEST], const uint8_t prev[DIGEST], const uint8_t *data,
                        size_t n)
{
    uint64_t h[8];
    uint8_t block[BLOCK];
    memcpy(h, IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ DIGEST;        /* parameter block: digest length, fanout 1, depth 1 */
    size_t total = DIGEST + n, t = 0;
    /* the first block holds prev and the start of data */
    size_t first = total < BLOCK ? total : BLOCK;
    memset(block, 0, BLOCK);
    memcpy(block, prev, DIGEST);
    memcpy(block + DIGEST, data, first - DIGEST);
    const uint8_t *p = data + (first - DIGEST);
    size_t left = total - first;
    t = first;
    compress(h, block, t, left == 0);
    while (left) {                         /* a block holding more than 112 bytes of tokens */
        size_t take = left < BLOCK ? left : BLOCK;
        if (take < BLOCK) {
            memset(block, 0, BLOCK);
            memcpy(block, p, take);
            compress(h, block, t + take, 1);
        } else {
            compress(h, p, t + take, left == BLOCK);
        }
        p += take;
        t += take;
        left -= take;
    }
    for (int i = 0; i < DIGEST; i++)
        out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
}

static PyObject *chain(PyObject *self, PyObject *args)
{
    Py_buffer root, data;
    Py_ssize_t block_bytes;
    if (!PyArg_ParseTuple(args, "y*y*n:chain", &root, &data, &block_bytes))
        return NULL;
    PyObject *out = NULL;
    if (root.len != DIGEST) {
        PyErr_Format(PyExc_ValueError, "root must be %d bytes, got %zd", DIGEST, root.len);
        goto done;
    }
    if (block_bytes < 1) {
        PyErr_Format(PyExc_ValueError, "block_bytes must be >= 1, got %zd", block_bytes);
        goto done;
    }
    Py_ssize_t count = data.len / block_bytes;
    out = PyList_New(count);
    if (out == NULL)
        goto done;
    uint8_t h[DIGEST];
    memcpy(h, root.buf, DIGEST);
    const uint8_t *p = (const uint8_t *)data.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        blake2b_128(h, h, p + i * block_bytes, (size_t)block_bytes);
        PyObject *digest = PyBytes_FromStringAndSize((const char *)h, DIGEST);
        if (digest == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, digest);
    }
done:
    PyBuffer_Release(&root);
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(root, data, block_bytes) -> [h0, h1, ...]: h[i] = blake2b(h[i-1] + block i of "
     "data, digest_size=16), h[-1] = root."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chainhash",
                                    "A prompt's chain of BLAKE2b block hashes in one call.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__chainhash(void) { return PyModule_Create(&module); }
