/* cudalab._driver.fastcall: seven driver calls of the real backend's hot paths, made from C.
 *
 * Why: cuda.bindings' Python wrappers cost about 1.5 us per call on top of the driver (argument
 * conversion, a CUresult enum object, a result tuple). A kernel launch captured into a CUDA
 * graph costs the driver itself well under that, so the wrapper was most of a captured launch.
 * These functions call the driver's own entry points, whose addresses the real backend takes
 * from cuGetProcAddress (cudalab/_driver/cuda.py, _bind_fastcall), and return the plain
 * CUresult as an int. Rows they exist for: "capture, host time per launch" of
 * benchmarks/graphs.py, "host/call" of benchmarks/jiterator.py and the kernel-launch and
 * event-record rows of benchmarks/timing.py.
 *
 * What: launch_kernel (cuLaunchKernel), event_record (cuEventRecord), stream_wait_event
 * (cuStreamWaitEvent), graph_launch (cuGraphLaunch, raising like launch_packed; the
 * "replay() host cost" row of benchmarks/graphs.py), and ctx_get_current, ctx_set_current
 * and memcpy_async (cuCtxGetCurrent, cuCtxSetCurrent, cuMemcpyAsync: every peer copy and
 * context check; the 1 KiB rows of benchmarks/comm.py), with the prototypes of cuda.h.
 * ordered_copy makes the eight calls of a copy between two devices with
 * torch's two-way stream ordering in one C call (the 1 KiB scatter, gather and broadcast
 * rows of benchmarks/comm.py: a third of a small peer copy's host time was Python between
 * those calls). launch_kernel, stream_wait_event, ctx_set_current and memcpy_async
 * return the CUresult as an int; ctx_get_current the context's address (None on failure); event_record returns (CUresult,), the
 * tuple of the bindings' cuEventRecord, because it stands in for that in FastPaths.
 * launch_packed is Backend.launch_values in one C call: it writes the values into a
 * CudaKernelArgs' slots (what its set() does with struct.pack, for plain ints and floats in
 * range; anything else goes through set() itself, which converts or raises its precise
 * error), launches, and raises the backend's CudaError for a failed launch. Handles are anything
 * int() accepts (cuda.bindings' CUfunction / CUstream / CUevent, or ints); None is NULL.
 *
 * launch_packed_programmatic is launch_packed through cuLaunchKernelEx with the launch
 * attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (programmatic dependent
 * launch, compute capability 9.0+: the kernel may start before the previous kernel on the
 * stream has finished, and waits for it with griddepcontrol.wait; the fill kernels in a CUDA
 * graph), bound apart by bind_launch_kernel_ex.
 *
 * event_elapsed_times reads many pairs of events in one call (cuEventElapsedTime, bound apart
 * by bind_event_elapsed_time): %%cuda_timed's GPU times after its loop, one bindings call per
 * repeat before (the "%%cuda_timed per-repeat overhead" rows of benchmarks/timing.py).
 *
 * The GIL is released around each driver call, as cuda.bindings does: a launch can block
 * while the stream's queue is full, and a host function queued on that stream (a Python
 * callback) may need the GIL to drain it.
 *
 * Optional: setup.py builds it where a compiler is found; without it cuda.py calls the same
 * functions through cuda.bindings (tests/driver/test_fastcall.py runs both).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_capi.h" /* handle_address, device_address, check_arity, entry_point_addresses */

typedef int CUresult_t; /* CUresult is a C enum: an int */

typedef CUresult_t (*launch_kernel_fn)(void *function, unsigned int grid_x, unsigned int grid_y,
                                       unsigned int grid_z, unsigned int block_x,
                                       unsigned int block_y, unsigned int block_z,
                                       unsigned int shared_mem, void *stream, void **params,
                                       void **extra);
/* cuEventRecord(event, stream) and cuGraphLaunch(graph_exec, stream): two handles each. */
typedef CUresult_t (*two_handles_fn)(void *first, void *second);
typedef CUresult_t (*stream_wait_event_fn)(void *stream, void *event, unsigned int flags);
typedef CUresult_t (*ctx_get_current_fn)(void **context);
typedef CUresult_t (*ctx_set_current_fn)(void *context);
typedef CUresult_t (*memcpy_async_fn)(unsigned long long dst, unsigned long long src,
                                      size_t nbytes, void *stream);
typedef CUresult_t (*event_elapsed_time_fn)(float *milliseconds, void *start, void *end);

/* cuda.h's CUlaunchAttribute and CUlaunchConfig (CUDA 12+), for cuLaunchKernelEx. */
typedef struct {
    int id; /* CUlaunchAttributeID */
    char pad[8 - sizeof(int)];
    union {
        char pad[64];
        void *align; /* (the union holds pointers: 8-byte aligned) */
        int programmatic_stream_serialization;
    } value;
} launch_attribute;
typedef struct {
    unsigned int grid[3];
    unsigned int block[3];
    unsigned int shared_mem;
    void *stream;
    launch_attribute *attrs;
    unsigned int num_attrs;
} launch_config;
#define LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION 6
typedef CUresult_t (*launch_kernel_ex_fn)(const launch_config *config, void *function,
                                          void **params, void **extra);

/* Set once by setup(); NULL until then (the calls then raise RuntimeError). */
static launch_kernel_fn launch_kernel_ptr = NULL;
static two_handles_fn event_record_ptr = NULL; /* (event, stream) */
static stream_wait_event_fn stream_wait_event_ptr = NULL;
static two_handles_fn graph_launch_ptr = NULL; /* (graph_exec, stream) */
static ctx_get_current_fn ctx_get_current_ptr = NULL;
static ctx_set_current_fn ctx_set_current_ptr = NULL;
static memcpy_async_fn memcpy_async_ptr = NULL;
/* cuEventElapsedTime, given by bind_event_elapsed_time() (apart from setup(): optional). */
static event_elapsed_time_fn event_elapsed_time_ptr = NULL;
/* cuLaunchKernelEx, given by bind_launch_kernel_ex() (optional too). */
static launch_kernel_ex_fn launch_kernel_ex_ptr = NULL;
/* error_for(code, call) -> the exception to raise for a failed call (cuda_api._error); set by
 * setup(), owned here. */
static PyObject *error_for = NULL;
/* Interned attribute names of a CudaKernelArgs (created at import). */
static PyObject *str_native = NULL;
static PyObject *str_set = NULL;
/* (0,): event_record's answer for CUDA_SUCCESS (created at import, immutable, never freed). */
static PyObject *success_tuple = NULL;

static int
unsigned_of(PyObject *value, unsigned int *out, const char *what)
{
    unsigned long v = PyLong_AsUnsignedLong(value);
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
        return -1;
    }
    if (v > 0xFFFFFFFFul) {
        PyErr_Format(PyExc_OverflowError, "%s does not fit in 32 bits", what);
        return -1;
    }
    *out = (unsigned int)v;
    return 0;
}

/* A 3-tuple of unsigned ints (a grid or a block). */
static int
dims_of(PyObject *dims, unsigned int out[3], const char *what)
{
    if (!PyTuple_CheckExact(dims) || PyTuple_GET_SIZE(dims) != 3) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple of 3 ints", what);
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        if (unsigned_of(PyTuple_GET_ITEM(dims, i), &out[i], what) < 0) {
            return -1;
        }
    }
    return 0;
}

static PyObject *
not_set_up(const char *name)
{
    PyErr_Format(PyExc_RuntimeError, "cudalab._driver.fastcall.%s: setup() has not given its "
                 "driver entry point", name);
    return NULL;
}

/* What both launch calls take first: function, grid, block, shared_mem, stream. */
typedef struct {
    void *function;
    unsigned int grid[3];
    unsigned int block[3];
    unsigned int shared_mem;
    void *stream;
} launch_shape;

/* Read args[0..4] into `shape`; -1 and an exception for a bad one. */
static int
parse_launch(PyObject *const *args, launch_shape *shape)
{
    if (handle_address(args[0], &shape->function) < 0 ||
        dims_of(args[1], shape->grid, "grid") < 0 || dims_of(args[2], shape->block, "block") < 0 ||
        unsigned_of(args[3], &shape->shared_mem, "shared_mem") < 0 ||
        handle_address(args[4], &shape->stream) < 0) {
        return -1;
    }
    return 0;
}

/* cuLaunchKernel through `call` with the GIL released; the CUresult. */
static CUresult_t
call_launch(launch_kernel_fn call, const launch_shape *shape, void *params)
{
    CUresult_t result;
    Py_BEGIN_ALLOW_THREADS
    result = call(shape->function, shape->grid[0], shape->grid[1], shape->grid[2],
                  shape->block[0], shape->block[1], shape->block[2], shape->shared_mem,
                  shape->stream, (void **)params, NULL);
    Py_END_ALLOW_THREADS
    return result;
}

/* cuLaunchKernelEx with programmatic stream serialization, the GIL released; the CUresult. */
static CUresult_t
call_launch_programmatic(launch_kernel_ex_fn call, const launch_shape *shape, void *params)
{
    CUresult_t result;
    launch_attribute attribute;
    memset(&attribute, 0, sizeof attribute);
    attribute.id = LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmatic_stream_serialization = 1;
    launch_config config = {{shape->grid[0], shape->grid[1], shape->grid[2]},
                            {shape->block[0], shape->block[1], shape->block[2]},
                            shape->shared_mem, shape->stream, &attribute, 1};
    Py_BEGIN_ALLOW_THREADS
    result = call(&config, shape->function, (void **)params, NULL);
    Py_END_ALLOW_THREADS
    return result;
}

PyDoc_STRVAR(launch_kernel_doc,
"launch_kernel(function, grid, block, shared_mem, stream, params) -> int\n\n"
"cuLaunchKernel(function, *grid, *block, shared_mem, stream, params, NULL); grid and block are\n"
"3-tuples, params the address of the kernel's void*[] (0 for none). Returns the CUresult.");

static PyObject *
launch_kernel(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    launch_shape shape;
    void *params;
    launch_kernel_fn call = launch_kernel_ptr;
    if (check_arity(nargs, 6, "launch_kernel") < 0) {
        return NULL;
    }
    if (parse_launch(args, &shape) < 0 || handle_address(args[5], &params) < 0) {
        return NULL;
    }
    if (call == NULL) {
        return not_set_up("launch_kernel");
    }
    return PyLong_FromLong(call_launch(call, &shape, params));
}

/* A call taking two handles (cuEventRecord, cuGraphLaunch): parses (handle, handle) for
 * `name`, calls `call` with the GIL released and stores its CUresult in `result`. -1 and an
 * exception on a bad argument or before setup(). */
static int
call_two_handles(PyObject *const *args, Py_ssize_t nargs, const char *name,
                 two_handles_fn call, CUresult_t *result)
{
    void *first, *second;
    if (check_arity(nargs, 2, name) < 0) {
        return -1;
    }
    if (handle_address(args[0], &first) < 0 || handle_address(args[1], &second) < 0) {
        return -1;
    }
    if (call == NULL) {
        not_set_up(name);
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    *result = call(first, second);
    Py_END_ALLOW_THREADS
    return 0;
}

PyDoc_STRVAR(event_record_doc,
"event_record(event, stream) -> (int,)\n\n"
"cuEventRecord(event, stream). Returns (CUresult,), the tuple cuda.bindings' cuEventRecord\n"
"returns, so it can stand in for it as the seam's FastPaths.event_record.");

static PyObject *
event_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CUresult_t result;
    if (call_two_handles(args, nargs, "event_record", event_record_ptr, &result) < 0) {
        return NULL;
    }
    if (result == 0) { /* the common answer: one shared (0,), no format parsed, no tuple made */
        return Py_NewRef(success_tuple);
    }
    return Py_BuildValue("(i)", result);
}

PyDoc_STRVAR(stream_wait_event_doc,
"stream_wait_event(stream, event, flags) -> int\n\n"
"cuStreamWaitEvent(stream, event, flags). Returns the CUresult.");

static PyObject *
stream_wait_event(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *stream, *event;
    unsigned int flags;
    stream_wait_event_fn call = stream_wait_event_ptr;
    if (check_arity(nargs, 3, "stream_wait_event") < 0) {
        return NULL;
    }
    if (handle_address(args[0], &stream) < 0 || handle_address(args[1], &event) < 0 ||
        unsigned_of(args[2], &flags, "flags") < 0) {
        return NULL;
    }
    if (call == NULL) {
        return not_set_up("stream_wait_event");
    }
    CUresult_t result;
    Py_BEGIN_ALLOW_THREADS
    result = call(stream, event, flags);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}


/* Write `values` into the 8-byte slots at `slots`, one per kind in `kinds` ('Q' pointer or
 * u8, 'q' i8, 'i' i4, 'I' u4, 'f' f4, 'd' f8: CudaKernelArgs' struct codes), as
 * struct.pack("=" + ...) would, for exact ints and floats in range only. Returns 0 when
 * written, 1 when some value needs CudaKernelArgs.set (no Python error set either way;
 * the slots may then be half written, which set() rewrites). Calls no Python code, so
 * `values` cannot change under it. */
static int
pack_values(char *slots, const char *kinds, Py_ssize_t n, PyObject *values)
{
    PyObject **items;
    Py_ssize_t count;
    if (PyTuple_CheckExact(values)) {
        items = &PyTuple_GET_ITEM(values, 0);
        count = PyTuple_GET_SIZE(values);
    }
    else if (PyList_CheckExact(values)) {
        items = PySequence_Fast_ITEMS(values);
        count = PyList_GET_SIZE(values);
    }
    else {
        return 1;
    }
    if (count != n) {
        return 1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = items[i];
        char *slot = slots + 8 * i;
        switch (kinds[i]) {
        case 'Q': {
            if (!PyLong_CheckExact(v)) {
                return 1;
            }
            unsigned long long u = PyLong_AsUnsignedLongLong(v);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 1;
            }
            memcpy(slot, &u, 8);
            break;
        }
        case 'q': {
            if (!PyLong_CheckExact(v)) {
                return 1;
            }
            long long q = PyLong_AsLongLong(v);
            if (q == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 1;
            }
            memcpy(slot, &q, 8);
            break;
        }
        case 'i': {
            if (!PyLong_CheckExact(v)) {
                return 1;
            }
            long long q = PyLong_AsLongLong(v);
            if ((q == -1 && PyErr_Occurred()) || q < INT32_MIN || q > INT32_MAX) {
                PyErr_Clear();
                return 1;
            }
            int32_t x = (int32_t)q;
            memcpy(slot, &x, 4);
            break;
        }
        case 'I': {
            if (!PyLong_CheckExact(v)) {
                return 1;
            }
            long long q = PyLong_AsLongLong(v);
            if ((q == -1 && PyErr_Occurred()) || q < 0 || q > (long long)UINT32_MAX) {
                PyErr_Clear();
                return 1;
            }
            uint32_t x = (uint32_t)q;
            memcpy(slot, &x, 4);
            break;
        }
        case 'f': {
            if (!PyFloat_CheckExact(v)) {
                return 1;
            }
            double d = PyFloat_AS_DOUBLE(v);
            float f = (float)d;
            if (isinf(f) && !isinf(d)) { /* struct.pack's OverflowError: set() explains it */
                return 1;
            }
            memcpy(slot, &f, 4);
            break;
        }
        case 'd': {
            if (!PyFloat_CheckExact(v)) {
                return 1;
            }
            double d = PyFloat_AS_DOUBLE(v);
            memcpy(slot, &d, 8);
            break;
        }
        default:
            return 1;
        }
    }
    return 0;
}

/* Raise error_for(code, call)'s exception; NULL. */
static PyObject *
raise_driver_error(int code, const char *call)
{
    if (error_for == NULL) {
        return not_set_up("launch_packed");
    }
    PyObject *exc = PyObject_CallFunction(error_for, "is", code, call);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

PyDoc_STRVAR(launch_packed_doc,
"launch_packed(function, grid, block, shared_mem, stream, args, values) -> None\n\n"
"Store `values` in the CudaKernelArgs `args` (as args.set(*values)) and launch with it, as\n"
"CudaBackend.launch(function, grid, block, shared_mem, stream, args.set(*values)); raises\n"
"set()'s error for a bad value and the backend's CudaError for a failed launch.");

/* launch_packed and launch_packed_programmatic: one body, `programmatic` picks the call. */
static PyObject *
launch_packed_with(PyObject *const *args, Py_ssize_t nargs, int programmatic)
{
    launch_shape shape;
    launch_kernel_fn call = launch_kernel_ptr;
    launch_kernel_ex_fn call_ex = launch_kernel_ex_ptr;
    const char *name = programmatic ? "launch_packed_programmatic" : "launch_packed";
    if (check_arity(nargs, 7, name) < 0) {
        return NULL;
    }
    if (parse_launch(args, &shape) < 0) {
        return NULL;
    }
    /* args.native: (address of the void*[] of slot addresses, address of the first slot,
     * kinds as bytes), fixed for the pack's life. */
    PyObject *native = PyObject_GetAttr(args[5], str_native);
    if (native == NULL) {
        return NULL;
    }
    if (!PyTuple_CheckExact(native) || PyTuple_GET_SIZE(native) != 3 ||
        !PyBytes_CheckExact(PyTuple_GET_ITEM(native, 2))) {
        Py_DECREF(native);
        PyErr_SetString(PyExc_TypeError, "launch_packed: args.native must be "
                        "(params address, slots address, kinds bytes)");
        return NULL;
    }
    void *params = PyLong_AsVoidPtr(PyTuple_GET_ITEM(native, 0));
    char *slots = (char *)PyLong_AsVoidPtr(PyTuple_GET_ITEM(native, 1));
    PyObject *kinds = PyTuple_GET_ITEM(native, 2);
    if (PyErr_Occurred()) {
        Py_DECREF(native);
        return NULL;
    }
    if (pack_values(slots, PyBytes_AS_STRING(kinds), PyBytes_GET_SIZE(kinds), args[6])) {
        /* Not plain values: set() converts them (numpy numbers, bools...) or raises its
         * precise error (a wrong count, a value out of range). */
        PyObject *values = PySequence_Tuple(args[6]);
        PyObject *set = values ? PyObject_GetAttr(args[5], str_set) : NULL;
        PyObject *done = set ? PyObject_Call(set, values, NULL) : NULL;
        Py_XDECREF(values);
        Py_XDECREF(set);
        if (done == NULL) {
            Py_DECREF(native);
            return NULL;
        }
        Py_DECREF(done);
    }
    if (programmatic ? call_ex == NULL : call == NULL) {
        Py_DECREF(native);
        return not_set_up(name);
    }
    CUresult_t result = programmatic ? call_launch_programmatic(call_ex, &shape, params)
                                     : call_launch(call, &shape, params);
    Py_DECREF(native); /* (kept until here: it holds the pack's addresses alive) */
    if (result != 0) {
        return raise_driver_error(result, programmatic ? "cuLaunchKernelEx" : "cuLaunchKernel");
    }
    Py_RETURN_NONE;
}

static PyObject *
launch_packed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return launch_packed_with(args, nargs, 0);
}

PyDoc_STRVAR(launch_packed_programmatic_doc,
"launch_packed_programmatic(function, grid, block, shared_mem, stream, args, values) -> None\n\n"
"launch_packed through cuLaunchKernelEx with programmatic stream serialization allowed (the\n"
"kernel may begin before the stream's previous kernel ends; it must wait for it with\n"
"griddepcontrol.wait before touching its data); raises as launch_packed (the CudaError\n"
"names cuLaunchKernelEx).");

static PyObject *
launch_packed_programmatic(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return launch_packed_with(args, nargs, 1);
}

PyDoc_STRVAR(graph_launch_doc,
"graph_launch(graph_exec, stream) -> None\n\n"
"cuGraphLaunch(graph_exec, stream); raises the backend's CudaError when it fails (it stands in\n"
"for CudaBackend.graph_launch).");

static PyObject *
graph_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CUresult_t result;
    if (call_two_handles(args, nargs, "graph_launch", graph_launch_ptr, &result) < 0) {
        return NULL;
    }
    if (result != 0) {
        return raise_driver_error(result, "cuGraphLaunch");
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(ctx_get_current_doc,
"ctx_get_current() -> int or None\n\n"
"cuCtxGetCurrent(): the current context's address (0 when none), or None when the call\n"
"fails. (A context switch is checked on every call that names a device: the 1 KiB rows\n"
"of benchmarks/comm.py.)");

static PyObject *
ctx_get_current(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *context = NULL;
    ctx_get_current_fn call = ctx_get_current_ptr;
    if (check_arity(nargs, 0, "ctx_get_current") < 0) {
        return NULL;
    }
    if (call == NULL) {
        return not_set_up("ctx_get_current");
    }
    if (call(&context) != 0) { /* (a plain query: no GIL release needed) */
        Py_RETURN_NONE;
    }
    return PyLong_FromVoidPtr(context);
}

PyDoc_STRVAR(ctx_set_current_doc,
"ctx_set_current(context) -> int\n\n"
"cuCtxSetCurrent(context). Returns the CUresult.");

static PyObject *
ctx_set_current(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *context;
    ctx_set_current_fn call = ctx_set_current_ptr;
    if (check_arity(nargs, 1, "ctx_set_current") < 0 || handle_address(args[0], &context) < 0) {
        return NULL;
    }
    if (call == NULL) {
        return not_set_up("ctx_set_current");
    }
    return PyLong_FromLong(call(context));
}

PyDoc_STRVAR(memcpy_async_doc,
"memcpy_async(dst, src, nbytes, stream) -> int\n\n"
"cuMemcpyAsync(dst, src, nbytes, stream) (unified addresses, ints). Returns the CUresult.");

static PyObject *
memcpy_async(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *stream;
    memcpy_async_fn call = memcpy_async_ptr;
    if (check_arity(nargs, 4, "memcpy_async") < 0) {
        return NULL;
    }
    unsigned long long dst, src;
    if (device_address(args[0], &dst) < 0 || device_address(args[1], &src) < 0) {
        return NULL;
    }
    size_t nbytes = PyLong_AsSize_t(args[2]);
    if (nbytes == (size_t)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (handle_address(args[3], &stream) < 0) {
        return NULL;
    }
    if (call == NULL) {
        return not_set_up("memcpy_async");
    }
    CUresult_t result;
    Py_BEGIN_ALLOW_THREADS
    result = call(dst, src, nbytes, stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

PyDoc_STRVAR(ordered_copy_doc,
"ordered_copy(dst, src, nbytes, copy_context, copy_stream, copy_event, peer_context,\n"
"             peer_stream, peer_event[, join]) -> None or (call, int)\n\n"
"A copy between two devices with torch's two-way ordering, in one C call: peer_event is\n"
"recorded on peer_stream, copy_stream waits for it, cuMemcpyAsync(dst, src, nbytes) runs on\n"
"copy_stream, copy_event is recorded there and peer_stream waits for it (the last two calls\n"
"only when join is true, the default: else the caller makes peer_stream wait later). Each\n"
"stream's context is made current before its calls (the legacy stream acts on the current\n"
"context) and the caller's context is current again after. Returns None, or the name of the\n"
"driver call that failed and its CUresult (the calls after it are not made).");

static PyObject *
ordered_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long dst, src;
    void *copy_context, *copy_stream, *copy_event, *peer_context, *peer_stream, *peer_event;
    int join = 1;
    if (nargs != 10 && check_arity(nargs, 9, "ordered_copy") < 0) {
        return NULL;
    }
    if (nargs == 10 && (join = PyObject_IsTrue(args[9])) < 0) {
        return NULL;
    }
    if (device_address(args[0], &dst) < 0 || device_address(args[1], &src) < 0) {
        return NULL;
    }
    size_t nbytes = PyLong_AsSize_t(args[2]);
    if (nbytes == (size_t)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (handle_address(args[3], &copy_context) < 0 || handle_address(args[4], &copy_stream) < 0 ||
        handle_address(args[5], &copy_event) < 0 || handle_address(args[6], &peer_context) < 0 ||
        handle_address(args[7], &peer_stream) < 0 || handle_address(args[8], &peer_event) < 0) {
        return NULL;
    }
    if (memcpy_async_ptr == NULL || ctx_get_current_ptr == NULL || ctx_set_current_ptr == NULL ||
        event_record_ptr == NULL || stream_wait_event_ptr == NULL) {
        return not_set_up("ordered_copy");
    }
    const char *failed = NULL;
    CUresult_t result = 0;
    Py_BEGIN_ALLOW_THREADS
    void *saved = NULL;
    if ((result = ctx_get_current_ptr(&saved)) != 0) {
        failed = "cuCtxGetCurrent";
    } else if ((result = ctx_set_current_ptr(peer_context)) != 0) {
        failed = "cuCtxSetCurrent";
    } else if ((result = event_record_ptr(peer_event, peer_stream)) != 0) {
        failed = "cuEventRecord";
    } else if ((result = ctx_set_current_ptr(copy_context)) != 0) {
        failed = "cuCtxSetCurrent";
    } else if ((result = stream_wait_event_ptr(copy_stream, peer_event, 0)) != 0) {
        failed = "cuStreamWaitEvent";
    } else if ((result = memcpy_async_ptr(dst, src, nbytes, copy_stream)) != 0) {
        failed = "cuMemcpyAsync";
    } else if ((result = event_record_ptr(copy_event, copy_stream)) != 0) {
        failed = "cuEventRecord";
    } else if (!join) {
        /* the caller makes peer_stream wait for copy_event later */
    } else if ((result = ctx_set_current_ptr(peer_context)) != 0) {
        failed = "cuCtxSetCurrent";
    } else if ((result = stream_wait_event_ptr(peer_stream, copy_event, 0)) != 0) {
        failed = "cuStreamWaitEvent";
    }
    if (failed == NULL || strcmp(failed, "cuCtxGetCurrent") != 0) {
        CUresult_t put_back = ctx_set_current_ptr(saved); /* also after a failed call */
        if (failed == NULL && put_back != 0) {
            failed = "cuCtxSetCurrent";
            result = put_back;
        }
    }
    Py_END_ALLOW_THREADS
    if (failed == NULL) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(si)", failed, result);
}

PyDoc_STRVAR(setup_doc,
"setup(launch_kernel, event_record, stream_wait_event, graph_launch, ctx_get_current,\n"
"      ctx_set_current, memcpy_async, error_for)\n\n"
"The driver's entry points (addresses from cuGetProcAddress, nonzero), and error_for(code,\n"
"call), which returns the exception for a failed call (launch_packed raises it). Called once\n"
"by cudalab._driver.cuda; a later call replaces them.");

/* The entry points setup() takes, in its order (error_for follows them). */
PyDoc_STRVAR(event_elapsed_times_doc,
"event_elapsed_times(starts, ends) -> (int, list)\n\n"
"cuEventElapsedTime(&ms, starts[i], ends[i]) for every i: two sequences of event handles of\n"
"one length, converted first, then the driver called for each pair with the GIL released\n"
"once. Returns (0, [ms, ...]) or, at the first failed call, (its CUresult, [the times\n"
"before it]). %%cuda_timed reads its repeats' GPU times with it (one call per run, not one\n"
"bindings call per repeat: the \"%%cuda_timed per-repeat overhead\" rows of\n"
"benchmarks/timing.py).");

static PyObject *
event_elapsed_times(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *starts = NULL, *ends = NULL, *list = NULL, *out = NULL;
    void **handles = NULL;
    float *times = NULL;
    Py_ssize_t n, count = 0;
    CUresult_t status = 0;
    event_elapsed_time_fn call = event_elapsed_time_ptr;
    if (check_arity(nargs, 2, "event_elapsed_times") < 0) {
        return NULL;
    }
    starts = PySequence_Fast(args[0], "event_elapsed_times(): starts must be a sequence");
    if (starts == NULL) {
        return NULL;
    }
    ends = PySequence_Fast(args[1], "event_elapsed_times(): ends must be a sequence");
    if (ends == NULL) {
        goto done;
    }
    n = PySequence_Fast_GET_SIZE(starts);
    if (PySequence_Fast_GET_SIZE(ends) != n) {
        PyErr_SetString(PyExc_ValueError, "event_elapsed_times(): starts and ends differ in length");
        goto done;
    }
    handles = PyMem_Malloc(sizeof(void *) * 2 * (size_t)(n ? n : 1));
    times = PyMem_Malloc(sizeof(float) * (size_t)(n ? n : 1));
    if (handles == NULL || times == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (handle_address(PySequence_Fast_GET_ITEM(starts, i), &handles[2 * i]) < 0 ||
            handle_address(PySequence_Fast_GET_ITEM(ends, i), &handles[2 * i + 1]) < 0) {
            goto done;
        }
    }
    if (call == NULL) {
        not_set_up("event_elapsed_times");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (; count < n; count++) {
        status = call(&times[count], handles[2 * count], handles[2 * count + 1]);
        if (status != 0) {
            break;
        }
    }
    Py_END_ALLOW_THREADS
    list = PyList_New(count);
    if (list == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *value = PyFloat_FromDouble((double)times[i]);
        if (value == NULL) {
            Py_CLEAR(list);
            goto done;
        }
        PyList_SET_ITEM(list, i, value);
    }
    out = Py_BuildValue("(iN)", status, list); /* (steals list, even on failure) */
done:
    PyMem_Free(handles);
    PyMem_Free(times);
    Py_XDECREF(starts);
    Py_XDECREF(ends);
    return out;
}

PyDoc_STRVAR(bind_event_elapsed_time_doc,
"bind_event_elapsed_time(cuEventElapsedTime) -> None\n\n"
"Give event_elapsed_times() the driver's entry point (a nonzero int address), apart from\n"
"setup(): a driver without it leaves the other calls bound.");

static PyObject *
bind_event_elapsed_time(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *address;
    if (check_arity(nargs, 1, "bind_event_elapsed_time") < 0) {
        return NULL;
    }
    if (entry_point_addresses(args, 1, &address) < 0) {
        return NULL;
    }
    event_elapsed_time_ptr = (event_elapsed_time_fn)address;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(bind_launch_kernel_ex_doc,
"bind_launch_kernel_ex(cuLaunchKernelEx) -> None\n\n"
"Give launch_packed_programmatic() the driver's entry point (a nonzero int address), apart\n"
"from setup(): a driver without it leaves the other calls bound.");

static PyObject *
bind_launch_kernel_ex(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *address;
    if (check_arity(nargs, 1, "bind_launch_kernel_ex") < 0) {
        return NULL;
    }
    if (entry_point_addresses(args, 1, &address) < 0) {
        return NULL;
    }
    launch_kernel_ex_ptr = (launch_kernel_ex_fn)address;
    Py_RETURN_NONE;
}

#define SETUP_ENTRY_POINTS 7

static PyObject *
setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    void *addresses[SETUP_ENTRY_POINTS];
    if (check_arity(nargs, SETUP_ENTRY_POINTS + 1, "setup") < 0) {
        return NULL;
    }
    if (entry_point_addresses(args, SETUP_ENTRY_POINTS, addresses) < 0) {
        return NULL;
    }
    if (!PyCallable_Check(args[SETUP_ENTRY_POINTS])) {
        PyErr_SetString(PyExc_TypeError, "setup(): error_for must be callable");
        return NULL;
    }
    launch_kernel_ptr = (launch_kernel_fn)addresses[0];
    event_record_ptr = (two_handles_fn)addresses[1];
    stream_wait_event_ptr = (stream_wait_event_fn)addresses[2];
    graph_launch_ptr = (two_handles_fn)addresses[3];
    ctx_get_current_ptr = (ctx_get_current_fn)addresses[4];
    ctx_set_current_ptr = (ctx_set_current_fn)addresses[5];
    memcpy_async_ptr = (memcpy_async_fn)addresses[6];
    Py_INCREF(args[SETUP_ENTRY_POINTS]);
    Py_XSETREF(error_for, args[SETUP_ENTRY_POINTS]);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"launch_kernel", (PyCFunction)(void (*)(void))launch_kernel, METH_FASTCALL, launch_kernel_doc},
    {"event_record", (PyCFunction)(void (*)(void))event_record, METH_FASTCALL, event_record_doc},
    {"stream_wait_event", (PyCFunction)(void (*)(void))stream_wait_event, METH_FASTCALL,
     stream_wait_event_doc},
    {"launch_packed", (PyCFunction)(void (*)(void))launch_packed, METH_FASTCALL, launch_packed_doc},
    {"launch_packed_programmatic", (PyCFunction)(void (*)(void))launch_packed_programmatic,
     METH_FASTCALL, launch_packed_programmatic_doc},
    {"graph_launch", (PyCFunction)(void (*)(void))graph_launch, METH_FASTCALL, graph_launch_doc},
    {"ctx_get_current", (PyCFunction)(void (*)(void))ctx_get_current, METH_FASTCALL,
     ctx_get_current_doc},
    {"ctx_set_current", (PyCFunction)(void (*)(void))ctx_set_current, METH_FASTCALL,
     ctx_set_current_doc},
    {"memcpy_async", (PyCFunction)(void (*)(void))memcpy_async, METH_FASTCALL, memcpy_async_doc},
    {"ordered_copy", (PyCFunction)(void (*)(void))ordered_copy, METH_FASTCALL, ordered_copy_doc},
    {"event_elapsed_times", (PyCFunction)(void (*)(void))event_elapsed_times, METH_FASTCALL,
     event_elapsed_times_doc},
    {"bind_event_elapsed_time", (PyCFunction)(void (*)(void))bind_event_elapsed_time,
     METH_FASTCALL, bind_event_elapsed_time_doc},
    {"bind_launch_kernel_ex", (PyCFunction)(void (*)(void))bind_launch_kernel_ex,
     METH_FASTCALL, bind_launch_kernel_ex_doc},
    {"setup", (PyCFunction)(void (*)(void))setup, METH_FASTCALL, setup_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "cudalab._driver.fastcall",
    "cuLaunchKernel, cuEventRecord, cuStreamWaitEvent, cuGraphLaunch, cuCtxGetCurrent, "
    "cuCtxSetCurrent and cuMemcpyAsync called from C, ordered_copy and event_elapsed_times (see "
    "cudalab/_driver/cuda.py).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit_fastcall(void)
{
    if (str_native == NULL && (str_native = PyUnicode_InternFromString("native")) == NULL) {
        return NULL;
    }
    if (str_set == NULL && (str_set = PyUnicode_InternFromString("set")) == NULL) {
        return NULL;
    }
    if (success_tuple == NULL && (success_tuple = Py_BuildValue("(i)", 0)) == NULL) {
        return NULL;
    }
    return PyModule_Create(&module_def);
}
