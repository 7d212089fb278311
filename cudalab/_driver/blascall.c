/* cudalab._driver.blascall: one cuBLAS GEMM call, its arguments resolved once, made from C.
 *
 * Why: a small matmul (64 x 64 float32) is all host time, and ctypes' share of it was the
 * biggest single piece of cudalab's: a call of cublasSgemm_v2's 14 arguments through ctypes
 * costs about 1.1 us (each argument converted, three c_void_p built for the addresses),
 * where this module's call costs about 0.1 us. Rows it exists for: "cudalab a @ b (64x64)"
 * of benchmarks/blas_fft.py, beside torch's a @ b.
 *
 * What: GemmCall(form, function, handle, transa, transb, m, n, k, alpha, lda, stride_a, ldb,
 * stride_b, beta, ldc, stride_c, batch, data_type, compute_type, algo) holds every argument of
 * one kind of GEMM but the three matrices' addresses, checked and converted once (the entry
 * point's address, as cudalab._driver.cublas resolved it from the library cuda.pathfinder
 * loaded; the handle; the host scalars alpha and beta as their bytes, copied in). Calling it
 * with (a, b, c), cuBLAS's A, B and C device addresses, calls the entry point with the
 * prototype of cublas_api.h that `form` names, with the GIL released (as ctypes does), and
 * returns the cublasStatus_t (0: success) for the seam to raise its CublasError with
 * cuBLAS's own message (cudalab/_driver/cublas.py). Nothing is global: each object carries
 * its own entry point, so tests can give it stand-ins (ctypes callbacks) on any machine.
 *
 * Forms (the seam mirrors them, see cublas.py's FORM_*):
 *   0 typed:                  cublas[SDCZ]gemm_v2
 *   1 typed, strided batch:   cublas[SDCZ]gemmStridedBatched
 *   2 cublasGemmEx
 *   3 cublasGemmStridedBatchedEx
 *
 * Optional: setup.py builds it where a compiler is found; without it (or with
 * CUDALAB_FASTCALL=0) the seam makes the same call through ctypes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* handle_address, device_address, check_arity (its entry_point_addresses is not used here) */
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#endif
#include "_capi.h"
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

typedef int status_t; /* cublasStatus_t, cublasOperation_t, cudaDataType_t...: C enums */

typedef status_t (*typed_fn)(void *handle, int transa, int transb, int m, int n, int k,
                             const void *alpha, const void *a, int lda, const void *b, int ldb,
                             const void *beta, void *c, int ldc);
typedef status_t (*typed_batched_fn)(void *handle, int transa, int transb, int m, int n, int k,
                                     const void *alpha, const void *a, int lda,
                                     long long stride_a, const void *b, int ldb,
                                     long long stride_b, const void *beta, void *c, int ldc,
                                     long long stride_c, int batch);
typedef status_t (*ex_fn)(void *handle, int transa, int transb, int m, int n, int k,
                          const void *alpha, const void *a, int a_type, int lda, const void *b,
                          int b_type, int ldb, const void *beta, void *c, int c_type, int ldc,
                          int compute_type, int algo);
typedef status_t (*ex_batched_fn)(void *handle, int transa, int transb, int m, int n, int k,
                                  const void *alpha, const void *a, int a_type, int lda,
                                  long long stride_a, const void *b, int b_type, int ldb,
                                  long long stride_b, const void *beta, void *c, int c_type,
                                  int ldc, long long stride_c, int batch, int compute_type,
                                  int algo);

enum { FORM_TYPED = 0, FORM_TYPED_BATCHED = 1, FORM_EX = 2, FORM_EX_BATCHED = 3, FORM_COUNT = 4 };

/* The most bytes of a host scalar: a complex double. */
#define SCALAR_BYTES 16

/* Invariants (set once by the constructor, never changed): function is not NULL; form is one
 * of FORM_*; alpha and beta hold the scalars' bytes, zero-padded to SCALAR_BYTES. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    void *function;
    void *handle;
    int form;
    int transa, transb, m, n, k, lda, ldb, ldc, batch, data_type, compute_type, algo;
    long long stride_a, stride_b, stride_c;
    double alpha[SCALAR_BYTES / sizeof(double)]; /* (double: aligned for every scalar type) */
    double beta[SCALAR_BYTES / sizeof(double)];
} GemmCall;

static status_t
issue(const GemmCall *g, const void *a, const void *b, void *c)
{
    switch (g->form) {
    case FORM_TYPED:
        return ((typed_fn)g->function)(g->handle, g->transa, g->transb, g->m, g->n, g->k,
                                       g->alpha, a, g->lda, b, g->ldb, g->beta, c, g->ldc);
    case FORM_TYPED_BATCHED:
        return ((typed_batched_fn)g->function)(g->handle, g->transa, g->transb, g->m, g->n, g->k,
                                               g->alpha, a, g->lda, g->stride_a, b, g->ldb,
                                               g->stride_b, g->beta, c, g->ldc, g->stride_c,
                                               g->batch);
    case FORM_EX:
        return ((ex_fn)g->function)(g->handle, g->transa, g->transb, g->m, g->n, g->k, g->alpha,
                                    a, g->data_type, g->lda, b, g->data_type, g->ldb, g->beta, c,
                                    g->data_type, g->ldc, g->compute_type, g->algo);
    default: /* FORM_EX_BATCHED (the constructor checked the range) */
        return ((ex_batched_fn)g->function)(g->handle, g->transa, g->transb, g->m, g->n, g->k,
                                            g->alpha, a, g->data_type, g->lda, g->stride_a, b,
                                            g->data_type, g->ldb, g->stride_b, g->beta, c,
                                            g->data_type, g->ldc, g->stride_c, g->batch,
                                            g->compute_type, g->algo);
    }
}

static PyObject *
gemm_call_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0) {
        PyErr_SetString(PyExc_TypeError, "GemmCall() takes no keyword arguments");
        return NULL;
    }
    if (check_arity(nargs, 3, "GemmCall") < 0) {
        return NULL;
    }
    unsigned long long a, b, c;
    if (device_address(args[0], &a) < 0 || device_address(args[1], &b) < 0 ||
        device_address(args[2], &c) < 0) {
        return NULL;
    }
    const GemmCall *g = (const GemmCall *)self;
    status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = issue(g, (const void *)(uintptr_t)a, (const void *)(uintptr_t)b,
                   (void *)(uintptr_t)c);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong((long)status);
}

static int
copy_scalar(const char *bytes, Py_ssize_t size, double *out, const char *name)
{
    if (size < 1 || size > SCALAR_BYTES) {
        PyErr_Format(PyExc_ValueError, "GemmCall(): %s must be 1 to %d bytes (the host scalar), "
                     "got %zd", name, SCALAR_BYTES, size);
        return -1;
    }
    memset(out, 0, SCALAR_BYTES);
    memcpy(out, bytes, (size_t)size);
    return 0;
}

PyDoc_STRVAR(gemm_call_doc,
"GemmCall(form, function, handle, transa, transb, m, n, k, alpha, lda, stride_a, ldb,\n"
"         stride_b, beta, ldc, stride_c, batch, data_type, compute_type, algo)\n\n"
"One kind of cuBLAS GEMM, every argument but the matrices' addresses given once. form: 0\n"
"cublas[SDCZ]gemm_v2, 1 cublas[SDCZ]gemmStridedBatched, 2 cublasGemmEx, 3\n"
"cublasGemmStridedBatchedEx; function: that entry point's address (an int, not 0); handle:\n"
"the cublasHandle_t; alpha, beta: the host scalars' bytes (bytes of 1 to 16); the rest the\n"
"entry point's ints (strides 64-bit; the ones a form does not take are ignored).\n\n"
"Calling it with (a, b, c), the device addresses of cuBLAS's A, B and C, makes the call with\n"
"the GIL released and returns the cublasStatus_t (0: success).");

static PyObject *
gemm_call_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "GemmCall() takes no keyword arguments");
        return NULL;
    }
    int form, transa, transb, m, n, k, lda, ldb, ldc, batch, data_type, compute_type, algo;
    long long stride_a, stride_b, stride_c;
    PyObject *function, *handle;
    const char *alpha, *beta;
    Py_ssize_t alpha_size, beta_size;
    if (!PyArg_ParseTuple(args, "iOOiiiiiy#iLiLy#iLiiii:GemmCall", &form, &function, &handle,
                          &transa, &transb, &m, &n, &k, &alpha, &alpha_size, &lda, &stride_a,
                          &ldb, &stride_b, &beta, &beta_size, &ldc, &stride_c, &batch,
                          &data_type, &compute_type, &algo)) {
        return NULL;
    }
    if (form < 0 || form >= FORM_COUNT) {
        PyErr_Format(PyExc_ValueError, "GemmCall(): unknown form %d (0 to %d)", form,
                     FORM_COUNT - 1);
        return NULL;
    }
    if (!PyLong_Check(function)) {
        PyErr_SetString(PyExc_TypeError, "GemmCall(): function must be the entry point's "
                        "address (an int)");
        return NULL;
    }
    void *entry = PyLong_AsVoidPtr(function);
    if (entry == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "GemmCall(): the entry point's address is 0");
        }
        return NULL;
    }
    void *handle_ptr;
    if (handle_address(handle, &handle_ptr) < 0) {
        return NULL;
    }
    GemmCall *self = (GemmCall *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    if (copy_scalar(alpha, alpha_size, self->alpha, "alpha") < 0 ||
        copy_scalar(beta, beta_size, self->beta, "beta") < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->vectorcall = gemm_call_vectorcall;
    self->function = entry;
    self->handle = handle_ptr;
    self->form = form;
    self->transa = transa;
    self->transb = transb;
    self->m = m;
    self->n = n;
    self->k = k;
    self->lda = lda;
    self->ldb = ldb;
    self->ldc = ldc;
    self->batch = batch;
    self->data_type = data_type;
    self->compute_type = compute_type;
    self->algo = algo;
    self->stride_a = stride_a;
    self->stride_b = stride_b;
    self->stride_c = stride_c;
    return (PyObject *)self;
}

static PyObject *
gemm_call_repr(PyObject *self)
{
    const GemmCall *g = (const GemmCall *)self;
    return PyUnicode_FromFormat("<cudalab GemmCall form %d m=%d n=%d k=%d batch=%d>", g->form,
                                g->m, g->n, g->k, g->batch);
}

static PyTypeObject GemmCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cudalab._driver.blascall.GemmCall",
    .tp_basicsize = sizeof(GemmCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = gemm_call_doc,
    .tp_new = gemm_call_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(GemmCall, vectorcall),
    .tp_repr = gemm_call_repr,
};

static struct PyModuleDef blascall_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cudalab._driver.blascall",
    .m_doc = "One cuBLAS GEMM call, its arguments resolved once, made from C (GemmCall).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit_blascall(void)
{
    if (PyType_Ready(&GemmCallType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&blascall_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&GemmCallType);
    if (PyModule_AddObject(module, "GemmCall", (PyObject *)&GemmCallType) < 0) {
        Py_DECREF(&GemmCallType);
        Py_DECREF(module);
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "FORM_COUNT", FORM_COUNT) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
