/* cudalab._driver.ncclcall: one NCCL collective on every rank of a single-process clique,
 * inside one NCCL group, made from C.
 *
 * Why: driving a 2-GPU clique from Python costs, per collective, a group start, one call per
 * rank and a group end through nccl4py's wrappers, each rank's context made current, and the
 * caller's context put back: about 30 us of host time at 1 KiB, where torch's C++ loop costs
 * about 25. The collective itself is a few microseconds of GPU work, so the host is the whole
 * cost of a small collective. Rows it exists for: the 1 KiB-4 MiB reduce_add and broadcast rows
 * of benchmarks/comm.py, and nccl.all_reduce in bench_tmp-style layer probes.
 *
 * What: setup() takes the entry points of libnccl that nccl4py resolved (its
 * _inspect_function_pointer: the very functions nccl4py's raw bindings call) and the driver's
 * cuCtxGetCurrent and cuCtxSetCurrent; group_call() then runs
 *
 *     saved = cuCtxGetCurrent()
 *     ncclGroupStart()
 *     for each rank: cuCtxSetCurrent(rank's context); ncclXxx(rank's arguments)
 *     ncclGroupEnd()
 *     cuCtxSetCurrent(saved)
 *
 * with the prototypes of nccl.h and cuda.h, with the GIL released (ncclGroupEnd can block
 * while NCCL connects a new clique). A failed call still closes the group (NCCL launches
 * nothing of a group with a failed call) and still puts the caller's context back.
 *
 * Returns None on success and (stage, rank, code) on failure, for the seam to raise its
 * NcclError with NCCL's own message (cudalab/_driver/nccl.py): stage is one of the STAGE_*
 * values below, which the seam mirrors (so the two cannot drift, tests/driver compares them).
 *
 * Optional: setup.py builds it where a compiler is found; without it (or with
 * CUDALAB_FASTCALL=0) the seam makes the same calls through nccl4py's Python bindings.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "_capi.h" /* handle_address, device_address, check_arity, entry_point_addresses */

typedef int result_t; /* ncclResult_t and CUresult are C enums: ints */

typedef result_t (*group_fn)(void);
typedef result_t (*all_reduce_fn)(const void *send, void *recv, size_t count, int dtype, int op,
                                  void *comm, void *stream);
typedef result_t (*broadcast_fn)(const void *send, void *recv, size_t count, int dtype, int root,
                                 void *comm, void *stream);
typedef result_t (*reduce_fn)(const void *send, void *recv, size_t count, int dtype, int op,
                              int root, void *comm, void *stream);
typedef result_t (*all_gather_fn)(const void *send, void *recv, size_t send_count, int dtype,
                                  void *comm, void *stream);
typedef result_t (*reduce_scatter_fn)(const void *send, void *recv, size_t recv_count, int dtype,
                                      int op, void *comm, void *stream);
typedef result_t (*ctx_get_current_fn)(void **context);
typedef result_t (*ctx_set_current_fn)(void *context);

/* The collectives group_call() issues (its first argument), as the seam numbers them. */
enum { CALL_ALL_REDUCE = 0, CALL_BROADCAST = 1, CALL_REDUCE = 2, CALL_ALL_GATHER = 3,
       CALL_REDUCE_SCATTER = 4, CALL_COUNT = 5 };
/* Where a group_call() failed (the first item of its answer). */
enum { STAGE_SAVE_CONTEXT = 0, STAGE_GROUP_START = 1, STAGE_SET_CONTEXT = 2, STAGE_CALL = 3,
       STAGE_GROUP_END = 4, STAGE_RESTORE_CONTEXT = 5 };

/* Set by setup(); all NULL until then (group_call then raises RuntimeError). Invariant: either
 * all are set or none is (setup() checks every address before storing any). */
static group_fn group_start_ptr = NULL;
static group_fn group_end_ptr = NULL;
static void *collective_ptr[CALL_COUNT] = {NULL}; /* indexed by CALL_* */
static ctx_get_current_fn ctx_get_current_ptr = NULL;
static ctx_set_current_fn ctx_set_current_ptr = NULL;

/* One rank's arguments, parsed before the GIL is released. */
typedef struct {
    void *context;
    unsigned long long send;
    unsigned long long recv;
    void *comm;
    void *stream;
} rank_args;

/* Ranks kept on the stack; a bigger clique takes heap memory (one allocation per call). */
#define STACK_RANKS 16

static int
int_of(PyObject *value, int *out, const char *what)
{
    long v = PyLong_AsLong(value);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (v < -2147483647L - 1 || v > 2147483647L) {
        PyErr_Format(PyExc_OverflowError, "%s does not fit in an int", what);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int
parse_rank(PyObject *item, rank_args *out)
{
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 5) {
        PyErr_SetString(PyExc_TypeError, "group_call(): each rank is a tuple (context, send, "
                        "recv, comm, stream)");
        return -1;
    }
    if (handle_address(PyTuple_GET_ITEM(item, 0), &out->context) < 0 ||
        device_address(PyTuple_GET_ITEM(item, 1), &out->send) < 0 ||
        device_address(PyTuple_GET_ITEM(item, 2), &out->recv) < 0 ||
        handle_address(PyTuple_GET_ITEM(item, 3), &out->comm) < 0 ||
        handle_address(PyTuple_GET_ITEM(item, 4), &out->stream) < 0) {
        return -1;
    }
    if (out->context == NULL || out->comm == NULL) {
        PyErr_SetString(PyExc_ValueError, "group_call(): a rank's context and communicator "
                        "must not be NULL");
        return -1;
    }
    return 0;
}

/* One rank's collective through the entry point of `call`. */
static result_t
issue(int call, const rank_args *rank, size_t count, int dtype, int op, int root)
{
    const void *send = (const void *)(uintptr_t)rank->send;
    void *recv = (void *)(uintptr_t)rank->recv;
    switch (call) {
    case CALL_ALL_REDUCE:
        return ((all_reduce_fn)collective_ptr[call])(send, recv, count, dtype, op, rank->comm,
                                                     rank->stream);
    case CALL_BROADCAST:
        return ((broadcast_fn)collective_ptr[call])(send, recv, count, dtype, root, rank->comm,
                                                    rank->stream);
    case CALL_REDUCE:
        return ((reduce_fn)collective_ptr[call])(send, recv, count, dtype, op, root, rank->comm,
                                                 rank->stream);
    case CALL_ALL_GATHER:
        return ((all_gather_fn)collective_ptr[call])(send, recv, count, dtype, rank->comm,
                                                     rank->stream);
    default: /* CALL_REDUCE_SCATTER (group_call checked the range) */
        return ((reduce_scatter_fn)collective_ptr[call])(send, recv, count, dtype, op, rank->comm,
                                                         rank->stream);
    }
}

PyDoc_STRVAR(group_call_doc,
"group_call(call, count, dtype, op, root, ranks) -> None or (stage, rank, code)\n\n"
"In one NCCL group, the collective `call` (0 all_reduce, 1 broadcast, 2 reduce, 3 all_gather,\n"
"4 reduce_scatter) on every rank of `ranks`, a tuple of (context, send, recv, comm, stream)\n"
"tuples: each rank's context is made current before its call, and the caller's context is put\n"
"back after the group. count is the collective's count (reduce_scatter's receive count,\n"
"all_gather's send count); op is ignored by broadcast and all_gather, root by all but\n"
"broadcast and reduce. Returns None, or where it failed: (stage, rank index or -1, code).");

static PyObject *
group_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_arity(nargs, 6, "group_call") < 0) {
        return NULL;
    }
    int call, dtype, op, root;
    if (int_of(args[0], &call, "call") < 0) {
        return NULL;
    }
    if (call < 0 || call >= CALL_COUNT) {
        PyErr_Format(PyExc_ValueError, "group_call(): unknown collective %d", call);
        return NULL;
    }
    size_t count = PyLong_AsSize_t(args[1]);
    if (count == (size_t)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (int_of(args[2], &dtype, "dtype") < 0 || int_of(args[3], &op, "op") < 0 ||
        int_of(args[4], &root, "root") < 0) {
        return NULL;
    }
    PyObject *ranks = args[5];
    if (!PyTuple_CheckExact(ranks)) {
        PyErr_SetString(PyExc_TypeError, "group_call(): ranks must be a tuple");
        return NULL;
    }
    if (group_start_ptr == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cudalab._driver.ncclcall.group_call: setup() has "
                        "not given NCCL's entry points");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(ranks);
    rank_args on_stack[STACK_RANKS];
    rank_args *parsed = on_stack;
    if (n > STACK_RANKS) {
        parsed = PyMem_Malloc((size_t)n * sizeof(rank_args));
        if (parsed == NULL) {
            return PyErr_NoMemory();
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_rank(PyTuple_GET_ITEM(ranks, i), &parsed[i]) < 0) {
            if (parsed != on_stack) {
                PyMem_Free(parsed);
            }
            return NULL;
        }
    }
    int stage = -1;
    Py_ssize_t failed_rank = -1;
    result_t code = 0;
    Py_BEGIN_ALLOW_THREADS
    void *saved = NULL;
    if ((code = ctx_get_current_ptr(&saved)) != 0) {
        stage = STAGE_SAVE_CONTEXT;
    } else if ((code = group_start_ptr()) != 0) {
        stage = STAGE_GROUP_START;
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            if ((code = ctx_set_current_ptr(parsed[i].context)) != 0) {
                stage = STAGE_SET_CONTEXT;
            } else if ((code = issue(call, &parsed[i], count, dtype, op, root)) != 0) {
                stage = STAGE_CALL;
            }
            if (stage >= 0) {
                failed_rank = i;
                break;
            }
        }
        result_t end = group_end_ptr(); /* closes the group, also after a failed call */
        if (stage < 0 && end != 0) {
            stage = STAGE_GROUP_END;
            code = end;
        }
        result_t put_back = ctx_set_current_ptr(saved);
        if (stage < 0 && put_back != 0) {
            stage = STAGE_RESTORE_CONTEXT;
            code = put_back;
        }
    }
    Py_END_ALLOW_THREADS
    if (parsed != on_stack) {
        PyMem_Free(parsed);
    }
    if (stage < 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(ini)", stage, failed_rank, code);
}

PyDoc_STRVAR(setup_doc,
"setup(group_start, group_end, all_reduce, broadcast, reduce, all_gather, reduce_scatter,\n"
"      ctx_get_current, ctx_set_current)\n\n"
"The entry points (nonzero int addresses): NCCL's ncclGroupStart, ncclGroupEnd, ncclAllReduce,\n"
"ncclBroadcast, ncclReduce, ncclAllGather and ncclReduceScatter, and the driver's\n"
"cuCtxGetCurrent and cuCtxSetCurrent. A later call replaces them.");

#define SETUP_ENTRY_POINTS 9

static PyObject *
setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *addresses[SETUP_ENTRY_POINTS];
    if (check_arity(nargs, SETUP_ENTRY_POINTS, "setup") < 0) {
        return NULL;
    }
    if (entry_point_addresses(args, SETUP_ENTRY_POINTS, addresses) < 0) {
        return NULL;
    }
    group_start_ptr = (group_fn)addresses[0];
    group_end_ptr = (group_fn)addresses[1];
    for (int call = 0; call < CALL_COUNT; call++) {
        collective_ptr[call] = addresses[2 + call];
    }
    ctx_get_current_ptr = (ctx_get_current_fn)addresses[7];
    ctx_set_current_ptr = (ctx_set_current_fn)addresses[8];
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"group_call", (PyCFunction)(void (*)(void))group_call, METH_FASTCALL, group_call_doc},
    {"setup", (PyCFunction)(void (*)(void))setup, METH_FASTCALL, setup_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "cudalab._driver.ncclcall",
    "One NCCL collective on every rank of a single-process clique, in one group, called from C "
    "(see cudalab/_driver/nccl.py).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit_ncclcall(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    /* The numbering the seam mirrors (tests/driver/test_ncclcall.py compares them). */
    if (PyModule_AddIntConstant(module, "CALL_ALL_REDUCE", CALL_ALL_REDUCE) < 0 ||
        PyModule_AddIntConstant(module, "CALL_BROADCAST", CALL_BROADCAST) < 0 ||
        PyModule_AddIntConstant(module, "CALL_REDUCE", CALL_REDUCE) < 0 ||
        PyModule_AddIntConstant(module, "CALL_ALL_GATHER", CALL_ALL_GATHER) < 0 ||
        PyModule_AddIntConstant(module, "CALL_REDUCE_SCATTER", CALL_REDUCE_SCATTER) < 0 ||
        PyModule_AddIntConstant(module, "STAGE_SAVE_CONTEXT", STAGE_SAVE_CONTEXT) < 0 ||
        PyModule_AddIntConstant(module, "STAGE_GROUP_START", STAGE_GROUP_START) < 0 ||
        PyModule_AddIntConstant(module, "STAGE_SET_CONTEXT", STAGE_SET_CONTEXT) < 0 ||
        PyModule_AddIntConstant(module, "STAGE_CALL", STAGE_CALL) < 0 ||
        PyModule_AddIntConstant(module, "STAGE_GROUP_END", STAGE_GROUP_END) < 0 ||
        PyModule_AddIntConstant(module, "STAGE_RESTORE_CONTEXT", STAGE_RESTORE_CONTEXT) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
