/* cudalab.allocator._pair: the C twins of cudalab.memory's caching_allocator_alloc and
 * caching_allocator_delete for the commonest cache hit, the pair memo's *pure hit*.
 *
 * Why: the torch-style pair (benchmarks/allocator.py "cudalab caching_allocator_alloc+delete",
 * benchmarks/house_ab.py "allocator hit pair") was two Python wrappers over two Python
 * methods, 1.02-1.13x CuPy's Cython pool pair on an H200 host (issue 37, section 3): the
 * frames, the argument handling and the lock were most of it. Here a pure hit is a few
 * pointer reads and one dict update, in one C call each way.
 *
 * What: bind() takes the Python pair (the fallbacks: everything that is not a pure hit goes
 * to them, with the caller's arguments unchanged), the allocator class and the names of its
 * fields, and returns the two twins as builtin functions named and documented as the Python
 * ones (text signature included). The twins read the allocator's __slots__ fields through
 * their member descriptors' offsets (taken once, in bind(), from the class the Python side
 * passes: exactly that class, never a subclass, whose malloc/free may differ).
 *
 * The fast cases, exactly the Python code's pure hit (cudalab/allocator/caching.py, malloc's
 * first branch, and free's lock-free branch) under cudalab.memory's one-device wrapper:
 *   alloc(size) / alloc(size, None, None): the stream sanitizer off (_observe.access_on),
 *     the allocator of the current device (0 with one device: devices.sole_device; else
 *     devices.per_thread.device, as the Python function reads it) of exactly the caching
 *     class, its lock free (its TokenLock's token present), ``size`` an int equal to the memo's
 *     request, the memo's block ready, stream=None naming the memo's stream (_hit_none, no
 *     custom current stream in any thread; or this thread's current Stream object of the
 *     device is the memo's), no pending frees, no history hook;
 *   delete(ptr): the sanitizer off, ``ptr`` an int live in the first active allocator (of
 *     exactly the caching class), its block the memo's, used on no other stream, no history hook.
 * Any other call on that allocator calls its malloc or free (as the Python function would,
 * with the method's frame, which a history hook's stacks count); anything else (arguments,
 * another device's or allocator's pointer, an error) calls the Python function with the
 * same arguments. A pure hit runs with the GIL held and calls no Python
 * code, so each is atomic as the Python code is between its lock operations: a Ctrl-C
 * cannot land inside (cudalab/_interrupts.py's rule: no counter half-updated), and another
 * thread sees the allocator before or after, never between.
 *
 * Optional: setup.py builds it for CPython with the GIL (free-threaded builds take the
 * Python pair); CUDALAB_PURE_PYTHON=1 (or CUDALAB_FASTPAIR=0 at import) keeps the Python pair.
 * tests/allocator/test_pair_c.py runs both and compares them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define API 2

/* The allocator's fields the twins read, in bind()'s order of names. */
enum {
    FIELD_HIT_SIZE, FIELD_READY, FIELD_HIT_NONE, FIELD_PENDING, FIELD_LIVE, FIELD_HITS,
    FIELD_TRACE, FIELD_MEMO, FIELD_LOCK, FIELD_TLS_STREAMS, FIELD_HIT_STREAM, N_FIELDS
};

typedef struct {
    PyTypeObject *allocator_type; /* exactly this class (a strong reference) */
    PyTypeObject *block_type;
    PyTypeObject *lock_type;
    PyTypeObject *deque_type;     /* collections.deque (pending frees) */
    Py_ssize_t field[N_FIELDS];   /* byte offsets of the allocator's slots */
    Py_ssize_t block_ptr, block_uses, lock_box;
    PyObject *allocators;         /* registry.allocators: a list, never rebound */
    PyObject *active;             /* registry.active: a list, never rebound */
    PyObject *devices_globals;    /* cudalab.devices' dict (sole_device, initialized) */
    PyObject *per_thread;         /* devices.per_thread (.device: the thread's current device) */
    PyObject *observe_globals;    /* cudalab._observe's dict (access_on) */
    PyObject *custom;             /* streams.custom_stream_tokens: a list, never rebound */
    PyObject *py_alloc, *py_delete;
    PyObject *str_sole, *str_access, *str_initialized, *str_device, *str_malloc, *str_free;
    PyObject *str_streams;
    PyObject *alloc_doc, *delete_doc; /* their UTF-8 buffers are the twins' ml_doc */
    int bound;
} PairState;

static PairState S;

static PyMethodDef alloc_def = {"caching_allocator_alloc", NULL, METH_FASTCALL | METH_KEYWORDS, NULL};
static PyMethodDef delete_def = {"caching_allocator_delete", NULL, METH_O, NULL};

#define SLOT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

/* A module flag: 1 when it is True, 0 otherwise (absent, False or anything else). */
static inline int
flag_is_true(PyObject *globals, PyObject *name)
{
    return PyDict_GetItemWithError(globals, name) == Py_True; /* (borrowed; no error for str keys) */
}

/* Whether `obj` is an empty collections.deque (the allocator's pending frees): exactly that
 * type (a heap type from 3.12), whose length is C code. */
static inline int
empty_deque(PyObject *obj)
{
    if (Py_TYPE(obj) != S.deque_type) {
        return 0;
    }
    Py_ssize_t n = PyObject_Length(obj);
    if (n < 0) {
        PyErr_Clear();
        return 0;
    }
    return n == 0;
}

/* Whether stream=None names the memo's stream for this thread on `device`: no thread has a
 * custom current stream and the memo's is the default one (_hit_none), or this thread's
 * current stream of the device is the memo's Stream object (as Python's pure hit reads them). */
static inline int
stream_none_is_memos(PyObject *a, Py_ssize_t device)
{
    if (SLOT(a, S.field[FIELD_HIT_NONE]) == Py_True && PyList_GET_SIZE(S.custom) == 0) {
        return 1;
    }
    PyObject *hit_stream = SLOT(a, S.field[FIELD_HIT_STREAM]);
    if (SLOT(a, S.field[FIELD_TLS_STREAMS]) != Py_True || hit_stream == NULL) {
        return 0;
    }
    PyObject *current = PyObject_GetAttr(S.per_thread, S.str_streams); /* this thread's */
    if (current == NULL) {
        PyErr_Clear();
        return 0;
    }
    int same = PyList_CheckExact(current) && device < PyList_GET_SIZE(current) &&
               PyList_GET_ITEM(current, device) == hit_stream;
    Py_DECREF(current);
    return same;
}

/* obj.name(arg): the allocator's own malloc or free, as the Python function calls it (with
 * the method's frame: a history hook's stacks count it). */
static PyObject *
call_method(PyObject *obj, PyObject *name, PyObject *arg)
{
    PyObject *call[2] = {obj, arg};
    Py_INCREF(obj);
    PyObject *out = PyObject_VectorcallMethod(name, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                              NULL);
    Py_DECREF(obj);
    return out;
}

static PyObject *
pair_alloc(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL || nargs < 1 || nargs > 3 ||
        (nargs >= 2 && args[1] != Py_None) || (nargs == 3 && args[2] != Py_None)) {
        goto python;
    }
    PyObject *size = args[0];
    if (!PyLong_CheckExact(size) || flag_is_true(S.observe_globals, S.str_access)) {
        goto python;
    }
    Py_ssize_t device = 0; /* one device: 0 in every thread (cudalab.memory's wrapper) */
    if (!flag_is_true(S.devices_globals, S.str_sole)) {
        if (!flag_is_true(S.devices_globals, S.str_initialized)) {
            goto python;
        }
        PyObject *current = PyObject_GetAttr(S.per_thread, S.str_device); /* this thread's */
        if (current == NULL) {
            PyErr_Clear();
            goto python;
        }
        device = PyLong_CheckExact(current) ? PyLong_AsSsize_t(current) : -1;
        Py_DECREF(current);
        if (device < 0) {
            PyErr_Clear();
            goto python;
        }
    }
    if (device >= PyList_GET_SIZE(S.allocators)) {
        goto python;
    }
    PyObject *a = PyList_GET_ITEM(S.allocators, device);
    if (Py_TYPE(a) != S.allocator_type) {
        goto python;
    }
    PyObject *lock = SLOT(a, S.field[FIELD_LOCK]);
    if (lock == NULL || Py_TYPE(lock) != S.lock_type) {
        goto method;
    }
    PyObject *box = SLOT(lock, S.lock_box);
    PyObject *ready = SLOT(a, S.field[FIELD_READY]);
    PyObject *hit_size = SLOT(a, S.field[FIELD_HIT_SIZE]);
    PyObject *pending = SLOT(a, S.field[FIELD_PENDING]);
    PyObject *live = SLOT(a, S.field[FIELD_LIVE]);
    PyObject *hits = SLOT(a, S.field[FIELD_HITS]);
    if (box == NULL || !PyList_CheckExact(box) || PyList_GET_SIZE(box) == 0 /* lock held */ ||
        ready == NULL || !PyList_CheckExact(ready) || PyList_GET_SIZE(ready) == 0 ||
        hit_size == NULL || !PyLong_CheckExact(hit_size) ||
        !stream_none_is_memos(a, device) ||
        pending == NULL || !empty_deque(pending) ||
        SLOT(a, S.field[FIELD_TRACE]) != Py_None || live == NULL || !PyDict_CheckExact(live) ||
        hits == NULL || !PyLong_CheckExact(hits)) {
        goto method;
    }
    int overflow = 0;
    long long want = PyLong_AsLongLongAndOverflow(hit_size, &overflow);
    if (overflow) {
        goto method;
    }
    long long got = PyLong_AsLongLongAndOverflow(size, &overflow);
    if (overflow || got != want || want <= 0) {
        goto method;
    }
    long long count = PyLong_AsLongLongAndOverflow(hits, &overflow);
    if (overflow || count == -1 || count >= PY_LLONG_MAX) {
        goto method;
    }
    Py_ssize_t last = PyList_GET_SIZE(ready) - 1;
    PyObject *m = PyList_GET_ITEM(ready, last);
    if (Py_TYPE(m) != S.block_type) {
        goto method;
    }
    PyObject *ptr = SLOT(m, S.block_ptr);
    if (ptr == NULL || !PyLong_CheckExact(ptr)) {
        goto method;
    }
    PyObject *next_hits = PyLong_FromLongLong(count + 1);
    if (next_hits == NULL) {
        return NULL;
    }
    /* From here on the hit is made: live[ptr] = m, then m leaves the box, then the count. */
    Py_INCREF(m);
    Py_INCREF(ptr);
    if (PyDict_SetItem(live, ptr, m) < 0) {
        Py_DECREF(m);
        Py_DECREF(ptr);
        Py_DECREF(next_hits);
        return NULL;
    }
    if (PyList_SetSlice(ready, last, last + 1, NULL) < 0) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (PyDict_DelItem(live, ptr) < 0) {
            PyErr_Clear();
        }
        PyErr_Restore(type, value, tb);
        Py_DECREF(m);
        Py_DECREF(ptr);
        Py_DECREF(next_hits);
        return NULL;
    }
    Py_DECREF(m); /* (the dict holds it now) */
    PyObject *old = SLOT(a, S.field[FIELD_HITS]);
    SLOT(a, S.field[FIELD_HITS]) = next_hits;
    Py_XDECREF(old);
    return ptr;
method:
    /* Not a pure hit, on this allocator: its malloc, as the Python function calls it (with
     * its frame: a history hook's stacks count the allocator method's frame). */
    return call_method(a, S.str_malloc, size);
python:
    return PyObject_Vectorcall(S.py_alloc, args, nargsf, kwnames);
}

static PyObject *
pair_delete(PyObject *self, PyObject *ptr)
{
    if (!PyLong_CheckExact(ptr) || flag_is_true(S.observe_globals, S.str_access) ||
        PyList_GET_SIZE(S.active) < 1) {
        goto python;
    }
    PyObject *a = PyList_GET_ITEM(S.active, 0);
    if (Py_TYPE(a) != S.allocator_type) {
        goto python;
    }
    PyObject *live = SLOT(a, S.field[FIELD_LIVE]);
    PyObject *ready = SLOT(a, S.field[FIELD_READY]);
    PyObject *memo = SLOT(a, S.field[FIELD_MEMO]);
    if (live == NULL || !PyDict_CheckExact(live)) {
        goto python;
    }
    PyObject *b = PyDict_GetItemWithError(live, ptr); /* borrowed; an int key: no Python code */
    if (b == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        goto python; /* another allocator's, 0, or not live: the Python function says which */
    }
    if (SLOT(a, S.field[FIELD_TRACE]) != Py_None) {
        /* History: the Python function, whose frame a free's stack shows as torch's shows
         * its caching_allocator_delete (memory_tools.stacks.capture_from_api). */
        goto python;
    }
    if (b != memo || ready == NULL ||
        !PyList_CheckExact(ready) || Py_TYPE(b) != S.block_type ||
        SLOT(b, S.block_uses) != Py_None) {
        goto method;
    }
    /* The memo's block comes back: to the ready box, then out of the live map. */
    if (PyList_Append(ready, b) < 0) {
        return NULL;
    }
    if (PyDict_DelItem(live, ptr) < 0) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        Py_ssize_t n = PyList_GET_SIZE(ready);
        if (PyList_SetSlice(ready, n - 1, n, NULL) < 0) {
            PyErr_Clear();
        }
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    Py_RETURN_NONE;
method:
    /* Live here but not the memo's pure hit: this allocator's free, as the Python function
     * calls it (with its frame, as for malloc above). */
    return call_method(a, S.str_free, ptr);
python:
    return PyObject_CallOneArg(S.py_delete, ptr);
}

/* The byte offset of `owner`'s __slots__ field `name` (an object slot), or -1 and an error. */
static Py_ssize_t
slot_offset(PyTypeObject *owner, PyObject *name)
{
    PyObject *descr = PyObject_GetAttr((PyObject *)owner, name);
    if (descr == NULL) {
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type == T_OBJECT_EX && !(member->flags & READONLY)) {
            offset = member->offset;
        }
    }
    if (offset < 0) {
        PyErr_Format(PyExc_TypeError, "%.100s.%U is not a __slots__ field", owner->tp_name, name);
    }
    Py_DECREF(descr);
    return offset;
}

/* A documentation string for a twin: its text signature, then the Python function's doc. */
static PyObject *
twin_doc(PyObject *function, const char *signature)
{
    PyObject *doc = PyObject_GetAttrString(function, "__doc__");
    if (doc == NULL) {
        return NULL;
    }
    PyObject *out = PyUnicode_FromFormat("%s\n--\n\n%S", signature, doc == Py_None ? Py_None : doc);
    Py_DECREF(doc);
    return out;
}

PyDoc_STRVAR(bind_doc,
"bind(py_alloc, py_delete, allocator_type, field_names, block_type, lock_type, allocators,\n"
"     active, devices_globals, observe_globals, custom, module_name) -> (alloc, delete)\n\n"
"The twins of py_alloc and py_delete (see the module doc). field_names: the allocator's\n"
"slots _hit_size, _ready, _hit_none, pending_frees, live, _memo_hits, _trace, memo_block,\n"
"_lock, _tls_streams, _hit_stream, in that order; the block's ptr and uses and the lock's\n"
"_box are read by those names.\n"
"Binding again replaces the state of the earlier twins.");

static PyObject *
bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "bind() takes 12 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *py_alloc = args[0], *py_delete = args[1], *names = args[3];
    PyObject *allocators = args[6], *active = args[7], *devices_globals = args[8];
    PyObject *observe_globals = args[9], *custom = args[10], *module_name = args[11];
    if (!PyType_Check(args[2]) || !PyType_Check(args[4]) || !PyType_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "bind(): the allocator, block and lock types must be classes");
        return NULL;
    }
    if (!PyTuple_CheckExact(names) || PyTuple_GET_SIZE(names) != N_FIELDS) {
        PyErr_Format(PyExc_TypeError, "bind(): field_names must be a tuple of %d names", N_FIELDS);
        return NULL;
    }
    if (!PyList_CheckExact(allocators) || !PyList_CheckExact(active) || !PyList_CheckExact(custom) ||
        !PyDict_CheckExact(devices_globals) || !PyDict_CheckExact(observe_globals) ||
        !PyCallable_Check(py_alloc) || !PyCallable_Check(py_delete) ||
        !PyUnicode_Check(module_name)) {
        PyErr_SetString(PyExc_TypeError, "bind(): the registry's lists, the stream token list, two "
                        "module dicts, two callables and a module name are required");
        return NULL;
    }
    PairState s = {0};
    s.allocator_type = (PyTypeObject *)args[2];
    s.block_type = (PyTypeObject *)args[4];
    s.lock_type = (PyTypeObject *)args[5];
    for (int i = 0; i < N_FIELDS; i++) {
        if ((s.field[i] = slot_offset(s.allocator_type, PyTuple_GET_ITEM(names, i))) < 0) {
            return NULL;
        }
    }
    PyObject *name;
    if ((name = PyUnicode_InternFromString("ptr")) == NULL) return NULL;
    s.block_ptr = slot_offset(s.block_type, name);
    Py_DECREF(name);
    if ((name = PyUnicode_InternFromString("uses")) == NULL) return NULL;
    s.block_uses = s.block_ptr < 0 ? -1 : slot_offset(s.block_type, name);
    Py_DECREF(name);
    if ((name = PyUnicode_InternFromString("_box")) == NULL) return NULL;
    s.lock_box = s.block_uses < 0 ? -1 : slot_offset(s.lock_type, name);
    Py_DECREF(name);
    if (s.lock_box < 0) {
        return NULL;
    }
    s.str_sole = PyUnicode_InternFromString("sole_device");
    s.str_access = PyUnicode_InternFromString("access_on");
    s.str_initialized = PyUnicode_InternFromString("initialized");
    s.str_device = PyUnicode_InternFromString("device");
    s.str_malloc = PyUnicode_InternFromString("malloc");
    s.str_free = PyUnicode_InternFromString("free");
    s.str_streams = PyUnicode_InternFromString("streams");
    PyObject *collections = PyImport_ImportModule("collections");
    PyObject *deque = collections == NULL ? NULL : PyObject_GetAttrString(collections, "deque");
    Py_XDECREF(collections);
    if (deque == NULL || !PyType_Check(deque)) {
        Py_XDECREF(deque);
        goto fail;
    }
    s.deque_type = (PyTypeObject *)deque; /* (a strong reference) */
    s.per_thread = devices_globals == NULL ? NULL : PyDict_GetItemString(devices_globals, "per_thread");
    if (s.per_thread == NULL) {
        PyErr_SetString(PyExc_TypeError, "bind(): cudalab.devices has no per_thread");
        goto fail;
    }
    s.alloc_doc = twin_doc(py_alloc, "caching_allocator_alloc(size, device=None, stream=None)");
    s.delete_doc = twin_doc(py_delete, "caching_allocator_delete(mem_ptr)");
    if (s.str_sole == NULL || s.str_access == NULL || s.str_initialized == NULL ||
        s.str_device == NULL || s.str_malloc == NULL || s.str_free == NULL ||
        s.str_streams == NULL ||
        s.alloc_doc == NULL || s.delete_doc == NULL) {
        goto fail;
    }
    const char *alloc_text = PyUnicode_AsUTF8(s.alloc_doc);
    const char *delete_text = PyUnicode_AsUTF8(s.delete_doc);
    if (alloc_text == NULL || delete_text == NULL) {
        goto fail;
    }
    PyObject *old_alloc_doc = S.alloc_doc, *old_delete_doc = S.delete_doc;
    /* Take the new references, then swap the state in (the old twins see the new state). */
    Py_INCREF(s.allocator_type);
    Py_INCREF(s.block_type);
    Py_INCREF(s.lock_type);
    s.allocators = Py_NewRef(allocators);
    s.active = Py_NewRef(active);
    s.devices_globals = Py_NewRef(devices_globals);
    Py_INCREF(s.per_thread);
    s.observe_globals = Py_NewRef(observe_globals);
    s.custom = Py_NewRef(custom);
    s.py_alloc = Py_NewRef(py_alloc);
    s.py_delete = Py_NewRef(py_delete);
    s.bound = 1;
    PairState old = S;
    S = s;
    /* The old documentation strings stay alive: earlier twins' ml_doc may point into them. */
    (void)old_alloc_doc;
    (void)old_delete_doc;
    if (old.bound) {
        Py_DECREF(old.allocator_type);
        Py_DECREF(old.block_type);
        Py_DECREF(old.lock_type);
        Py_DECREF(old.allocators);
        Py_DECREF(old.active);
        Py_DECREF(old.devices_globals);
        Py_DECREF(old.per_thread);
        Py_DECREF(old.observe_globals);
        Py_DECREF(old.custom);
        Py_DECREF(old.py_alloc);
        Py_DECREF(old.py_delete);
        Py_XDECREF(old.str_sole);
        Py_XDECREF(old.str_access);
        Py_XDECREF(old.str_initialized);
        Py_XDECREF(old.str_device);
        Py_XDECREF(old.str_malloc);
        Py_XDECREF(old.str_free);
        Py_XDECREF(old.str_streams);
        Py_XDECREF(old.deque_type);
    }
    alloc_def.ml_meth = (PyCFunction)(void (*)(void))pair_alloc;
    alloc_def.ml_doc = alloc_text;
    delete_def.ml_meth = (PyCFunction)pair_delete;
    delete_def.ml_doc = delete_text;
    PyObject *alloc = PyCFunction_NewEx(&alloc_def, NULL, module_name);
    PyObject *delete = alloc == NULL ? NULL : PyCFunction_NewEx(&delete_def, NULL, module_name);
    if (delete == NULL) {
        Py_XDECREF(alloc);
        return NULL;
    }
    return Py_BuildValue("(NN)", alloc, delete);
fail:
    Py_XDECREF(s.str_sole);
    Py_XDECREF(s.str_access);
    Py_XDECREF(s.str_initialized);
    Py_XDECREF(s.str_device);
    Py_XDECREF(s.str_malloc);
    Py_XDECREF(s.str_free);
    Py_XDECREF(s.str_streams);
    Py_XDECREF(s.deque_type);
    Py_XDECREF(s.alloc_doc);
    Py_XDECREF(s.delete_doc);
    return NULL;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL, bind_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cudalab.allocator._pair",
    "C twins of cudalab.memory's caching_allocator_alloc/delete for the pair memo's pure hit.",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__pair(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "API", API) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
