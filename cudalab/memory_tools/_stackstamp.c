/* cudalab.memory_tools._stackstamp: the memo's stamp of cudalab/memory_tools/stacks.py in C.
 *
 * Why: recording history with Python stacks stamps every cached allocation and free with
 * (time, stack). The pure-Python stamp (stacks._stamp) spends most of its time skipping
 * cudalab's own frames and making frame objects for them; this one reads CPython's
 * interpreter frames directly (as py-spy, greenlet and Cython do), so cudalab's frames cost
 * a pointer step and a set lookup each, and no frame object is made.
 *
 * What: stamp() does exactly what stacks._stamp's common case does, and nothing else:
 * skip the frames of cudalab's modules (stacks._cud_mods; on 3.11, where frames have no
 * module name to read cheaply, stacks._internal by file name, as stacks.capture_stack does
 * there), then return (time_ns, stack) when the first other frame's mark (its f_trace, a
 * stacks._Mark) knows the stack at its current instruction. Anything else (a module not
 * classified yet, a frame without a frame object or mark, a new instruction) is left to
 * stacks.capture_stack, called as capture_stack(1): called from C, capture_stack's caller is the
 * allocator method itself, so its depth 1 is where the Python stamp's capture_stack(2) starts.
 *
 * One of the two fast copies of the stamp (the other is stacks._stamp), kept for the
 * benchmark row stacks="python" of benchmarks/history.py; tests/memory_tools/
 * test_stackstamp.py pins the two together (same stacks, same fallback) so they cannot drift.
 *
 * Which Pythons: CPython 3.11, 3.12 and 3.13 with the GIL; the interpreter frame layout
 * differs between them and is private, so each is spelled out below and any other version
 * fails to compile (setup.py then leaves the module out; stacks.py uses the Python stamp).
 * The GIL is held throughout: the frames read cannot change under us.
 */
#define PY_SSIZE_T_CLEAN
#ifndef Py_BUILD_CORE
#define Py_BUILD_CORE 1
#endif
#include <Python.h>

#if PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030E0000
#error "cudalab.memory_tools._stackstamp reads the interpreter frames of CPython 3.11-3.13 only"
#endif
#if defined(Py_GIL_DISABLED) || defined(Py_LIMITED_API)
#error "cudalab.memory_tools._stackstamp needs a GIL build and the full C API"
#endif

#include "internal/pycore_frame.h"

/* ---- the frame layout of each version ------------------------------------------------ */
#if PY_VERSION_HEX >= 0x030D0000 /* 3.13 */
#define CURRENT_FRAME(ts) ((ts)->current_frame)
#define FRAME_CODE(f) ((PyCodeObject *)(f)->f_executable)
#define FRAME_HAS_CODE(f) PyCode_Check((f)->f_executable)
#define FRAME_FUNC(f) ((f)->f_funcobj)
#elif PY_VERSION_HEX >= 0x030C0000 /* 3.12 */
#define CURRENT_FRAME(ts) ((ts)->cframe->current_frame)
#define FRAME_CODE(f) ((f)->f_code)
#define FRAME_HAS_CODE(f) 1
#define FRAME_FUNC(f) ((f)->f_funcobj)
#else /* 3.11 */
#define CURRENT_FRAME(ts) ((ts)->cframe->current_frame)
#define FRAME_CODE(f) ((f)->f_code)
#define FRAME_HAS_CODE(f) 1
#endif

/* time.time_ns(), as stacks._now */
static int
now_ns(long long *out)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t;
    if (PyTime_Time(&t) < 0) {
        return -1;
    }
    *out = (long long)t;
#else
    *out = (long long)_PyTime_GetSystemClock();
#endif
    return 0;
}

/* What setup() was given (strong references, kept for the life of the process). */
static PyObject *cud_mods;   /* set: names of cudalab's modules (3.12+) */
static PyObject *other_mods; /* set: names of other modules (3.12+) */
static PyObject *internal;   /* dict: co_filename -> inside the cudalab package (3.11) */
static PyTypeObject *mark_type;
static PyObject *capture;    /* stacks.capture_stack */
static PyObject *one;        /* the int 1 */

/* The frame that called f, skipping incomplete frames as sys._getframe and f_back do. */
static inline _PyInterpreterFrame *
caller_of(_PyInterpreterFrame *f)
{
    f = f->previous;
    while (f != NULL && _PyFrame_IsIncomplete(f)) {
        f = f->previous;
    }
    return f;
}

/* The stamp (time, stack); steals the reference to stack (NULL: an error is set). A stamp
 * cannot be part of a reference cycle: it is new, and a stack holds only code objects and
 * ints. The collector would untrack it at its first pass anyway (as it does all tuples of
 * untracked items); untracking it now spares every young-generation collection the memo's
 * thousands of stamps (~5 % of their cost). */
static PyObject *
make_stamp(PyObject *stack)
{
    if (stack == NULL) {
        return NULL;
    }
    long long t;
    PyObject *time = now_ns(&t) < 0 ? NULL : PyLong_FromLongLong(t);
    PyObject *r = time == NULL ? NULL : PyTuple_New(2);
    if (r == NULL) {
        Py_XDECREF(time);
        Py_DECREF(stack);
        return NULL;
    }
    PyTuple_SET_ITEM(r, 0, time);
    PyTuple_SET_ITEM(r, 1, stack);
    PyObject_GC_UnTrack(r);
    return r;
}

/* The slow path: the stack from stacks.capture_stack(1). */
static PyObject *
slow_stamp(void)
{
    return make_stamp(PyObject_CallOneArg(capture, one));
}

#if PY_VERSION_HEX < 0x030C0000
/* 3.11: the answer of `internal` by code object, so that a frame costs a pointer compare
 * rather than a dictionary lookup of its file name. A code object's file name never
 * changes and `internal` only gains names, so an answer stays true; each slot holds a
 * strong reference to its code, so its address is not reused while it is cached. */
#define CODE_SLOTS 256
static struct {
    PyObject *code; /* NULL or a code object (strong) */
    int flag;       /* internal[code.co_filename] for it: 1 or 0 */
} code_flags[CODE_SLOTS];
#endif

/* 1: f is one of cudalab's frames, 0: it is not, -1: not known here (the slow path decides). */
static inline int
is_cudalab(_PyInterpreterFrame *f)
{
#if PY_VERSION_HEX >= 0x030C0000
    /* sys._getframemodulename's answer: the function's __module__ */
    PyObject *func = FRAME_FUNC(f);
    if (func == NULL || !PyFunction_Check(func)) {
        return -1;
    }
    PyObject *name = ((PyFunctionObject *)func)->func_module;
    if (name == NULL || !PyUnicode_CheckExact(name)) {
        return -1;
    }
    int c = PySet_Contains(cud_mods, name);
    if (c != 0) {
        return c; /* 1, or -1 on an error (cleared by the caller) */
    }
    return PySet_Contains(other_mods, name) == 1 ? 0 : -1;
#else
    if (!FRAME_HAS_CODE(f)) {
        return -1;
    }
    PyObject *code = (PyObject *)FRAME_CODE(f);
    size_t slot = ((uintptr_t)code >> 4) % CODE_SLOTS;
    if (code_flags[slot].code == code) {
        return code_flags[slot].flag;
    }
    PyObject *flag = PyDict_GetItemWithError(internal, FRAME_CODE(f)->co_filename);
    if (flag == NULL) {
        return -1;
    }
    PyObject *old = code_flags[slot].code;
    code_flags[slot].code = Py_NewRef(code);
    code_flags[slot].flag = flag == Py_True ? 1 : 0;
    Py_XDECREF(old); /* (last: the slot is consistent should this free anything) */
    return code_flags[slot].flag;
#endif
}

/* f's instruction offset, as frame.f_lasti gives it (-1 before its first instruction). */
static inline int
lasti_of(_PyInterpreterFrame *f)
{
    int lasti = _PyInterpreterFrame_LASTI(f);
    return lasti < 0 ? -1 : lasti * (int)sizeof(_Py_CODEUNIT);
}

/* mark[key] for an int key, borrowed; NULL when it is not there (an error may be set). */
static inline PyObject *
mark_get(PyObject *mark, int key)
{
    PyObject *k = PyLong_FromLong(key);
    if (k == NULL) {
        return NULL;
    }
    PyObject *v = PyDict_GetItemWithError(mark, k);
    Py_DECREF(k);
    return v;
}

/* The stack of f (a frame with code, outside cudalab) from the mark its caller keeps for
 * the frames of f's code called from its current instruction (stacks._miss's first case),
 * borrowed; NULL when that does not know it (an error may be set). A function called in a
 * loop is a new frame each call, without a frame object or mark of its own: this finds its
 * stack at each of its instructions (the allocation's line, the free's line) with two
 * dictionary lookups and no frame object, where the slow path makes one and walks. */
static PyObject *callers_mark_lookup(PyObject *mc, int cl, PyObject *code, int li);

/* The answers of from_callers_mark by (caller's mark, caller's offset, code, offset), so
 * that a repeated site (a function called in a loop, at its allocation's line and at its
 * free's) costs one compare of four fields. The stack of a frame at an offset is fixed by
 * those four (a mark is shared only by frames whose stacks are equal at every offset), so
 * an answer stays true; each slot holds strong references to its mark, code and stack, so
 * their addresses are not reused while cached (at most SITE_SLOTS of each kept alive). */
#define SITE_SLOTS 64
static struct {
    PyObject *mark;  /* NULL or the caller's mark (strong) */
    PyObject *code;  /* the frame's code (strong) */
    int cli;         /* the caller's offset */
    int li;          /* the frame's offset */
    PyObject *stack; /* the stack found (strong) */
} sites[SITE_SLOTS];

static PyObject *
from_callers_mark(_PyInterpreterFrame *f)
{
    _PyInterpreterFrame *c = caller_of(f);
    if (c == NULL || c->frame_obj == NULL || !FRAME_HAS_CODE(c)) {
        return NULL;
    }
    PyObject *mc = c->frame_obj->f_trace;
    if (mc == NULL || Py_TYPE(mc) != mark_type) {
        return NULL;
    }
    PyObject *code = (PyObject *)FRAME_CODE(f);
    int cl = lasti_of(c), li = lasti_of(f);
    size_t slot = (((uintptr_t)mc >> 4) ^ ((uintptr_t)code >> 4) ^ ((size_t)cl * 31u)
                   ^ ((size_t)li * 131u)) % SITE_SLOTS;
    if (sites[slot].mark == mc && sites[slot].code == code && sites[slot].cli == cl
            && sites[slot].li == li) {
        return sites[slot].stack;
    }
    PyObject *stack = callers_mark_lookup(mc, cl, code, li);
    if (stack != NULL) {
        PyObject *om = sites[slot].mark, *oc = sites[slot].code, *os = sites[slot].stack;
        sites[slot].mark = Py_NewRef(mc);
        sites[slot].code = Py_NewRef(code);
        sites[slot].cli = cl;
        sites[slot].li = li;
        sites[slot].stack = Py_NewRef(stack);
        Py_XDECREF(om); /* (last: the slot is consistent should these free anything) */
        Py_XDECREF(oc);
        Py_XDECREF(os);
    }
    return stack;
}

/* mc[(cl, id(code))][1][li]: the uncached lookup of from_callers_mark, borrowed. */
static PyObject *
callers_mark_lookup(PyObject *mc, int cl, PyObject *code, int li)
{
    /* the key stacks._walk files that mark under: (caller's offset, id(code)) */
    PyObject *cli = PyLong_FromLong(cl);
    PyObject *id = cli == NULL ? NULL : PyLong_FromVoidPtr((void *)code);
    PyObject *key = id == NULL ? NULL : PyTuple_New(2);
    if (key == NULL) {
        Py_XDECREF(cli);
        Py_XDECREF(id);
        return NULL;
    }
    PyTuple_SET_ITEM(key, 0, cli);
    PyTuple_SET_ITEM(key, 1, id);
    PyObject *e = PyDict_GetItemWithError(mc, key); /* (code, shared mark), borrowed */
    Py_DECREF(key);
    if (e == NULL || !PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 2
            || PyTuple_GET_ITEM(e, 0) != code
            || Py_TYPE(PyTuple_GET_ITEM(e, 1)) != mark_type) {
        return NULL;
    }
    return mark_get(PyTuple_GET_ITEM(e, 1), li);
}

PyDoc_STRVAR(stamp_doc,
"stamp() -> (time_ns, stack)\n\n"
"The stamp of an allocation or free for stacks._stamp's callers: the allocator method\n"
"calling it is skipped with the cudalab frames beyond it. Call setup() first.");

static PyObject *
stamp(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    if (capture == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_stackstamp.setup() was not called");
        return NULL;
    }
    PyThreadState *ts = PyThreadState_Get();
    _PyInterpreterFrame *f = CURRENT_FRAME(ts); /* the allocator method calling us */
    while (f != NULL && _PyFrame_IsIncomplete(f)) {
        f = f->previous;
    }
    if (f == NULL) {
        return slow_stamp();
    }
    f = caller_of(f);
    int c = -1;
    while (f != NULL && (c = is_cudalab(f)) == 1) {
        f = caller_of(f);
    }
    if (f == NULL || c != 0 || !FRAME_HAS_CODE(f)) {
        PyErr_Clear();
        return slow_stamp();
    }
    PyObject *stack = NULL;
    PyObject *mark = f->frame_obj != NULL ? f->frame_obj->f_trace : NULL;
    if (mark != NULL && Py_TYPE(mark) == mark_type) {
        stack = mark_get(mark, lasti_of(f));
    }
    if (stack == NULL) {
        stack = from_callers_mark(f);
    }
    if (stack == NULL) {
        PyErr_Clear();
        return slow_stamp();
    }
    return make_stamp(Py_NewRef(stack));
}

PyDoc_STRVAR(setup_doc,
"setup(cud_mods, other_mods, internal, mark_type, capture)\n\n"
"Give the module the state of cudalab.memory_tools.stacks: the sets of module names\n"
"(cudalab's, others'), the co_filename -> bool dict, the _Mark type and capture_stack. The\n"
"objects are kept, not copied: stacks.py fills them in place and never rebinds them.");

static PyObject *
setup(PyObject *module, PyObject *args)
{
    PyObject *cm, *om, *in, *mt, *cap;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O:setup", &PySet_Type, &cm, &PySet_Type, &om,
                          &PyDict_Type, &in, &PyType_Type, &mt, &cap)) {
        return NULL;
    }
    if (!PyCallable_Check(cap)) {
        PyErr_SetString(PyExc_TypeError, "setup: capture must be callable");
        return NULL;
    }
    if ((PyTypeObject *)mt == &PyDict_Type || !PyType_IsSubtype((PyTypeObject *)mt, &PyDict_Type)) {
        PyErr_SetString(PyExc_TypeError, "setup: mark_type must be a dict subclass");
        return NULL;
    }
    Py_XSETREF(cud_mods, Py_NewRef(cm));
    Py_XSETREF(other_mods, Py_NewRef(om));
    Py_XSETREF(internal, Py_NewRef(in));
    Py_XSETREF(mark_type, (PyTypeObject *)Py_NewRef(mt));
    Py_XSETREF(capture, Py_NewRef(cap));
    Py_RETURN_NONE;
}

/* ---- HitLog: the memo's stamp log, with a pure hit's two stamps logged in one call ------ */
/* Why: with history on, every pure memo hit of the caching allocator logs two stamps: its
 * free's (carried on the block) and its own. As a deque that was two appends and a call of
 * the stamp function, three calls from Python on the hot path; HitLog.hit(tfree) makes it
 * one (benchmarks/history.py, rows "stacks=None" and "stacks=python" once the ring holds
 * N entries). Otherwise HitLog is the deque it replaces: append, len, iteration (oldest
 * first), clear, bounded to the newest maxlen stamps. Stamps are logged in pairs, so the
 * bound (even) drops whole pairs.
 * Storage: a list holding at most 2 * maxlen stamps; when it reaches that, the oldest
 * maxlen are deleted at once (amortised O(1) per stamp); readers see the newest maxlen. */
#define HIT_CLOCK 0 /* now is time.time_ns(): read the clock here */
#define HIT_STAMP 1 /* now is this module's stamp(): called here directly */
#define HIT_CALL 2  /* now is any callable */

typedef struct {
    PyObject_HEAD
    PyObject *items;    /* list of stamps, oldest first (invariant: len <= 2 * maxlen) */
    Py_ssize_t maxlen;  /* > 0 and even; PY_SSIZE_T_MAX / 4 for "unbounded" */
    int kind;           /* HIT_CLOCK, HIT_STAMP or HIT_CALL */
    PyObject *now;      /* the stamp function (kept for HIT_CALL and the repr) */
} HitLog;

static PyObject *stamp(PyObject *module, PyObject *Py_UNUSED(ignored));

static int
hitlog_bound(HitLog *self)
{
    Py_ssize_t n = PyList_GET_SIZE(self->items);
    if (n >= 2 * self->maxlen) {
        return PyList_SetSlice(self->items, 0, n - self->maxlen, NULL);
    }
    return 0;
}

static PyObject *
hitlog_append(HitLog *self, PyObject *x)
{
    if (PyList_Append(self->items, x) < 0 || hitlog_bound(self) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
hitlog_hit(HitLog *self, PyObject *tfree)
{
    PyObject *now;
    if (self->kind == HIT_CLOCK) {
        long long t;
        now = now_ns(&t) < 0 ? NULL : PyLong_FromLongLong(t);
    } else if (self->kind == HIT_STAMP) {
        now = stamp(NULL, NULL);
    } else {
        now = PyObject_CallNoArgs(self->now);
    }
    if (now == NULL) {
        return NULL;
    }
    int err = PyList_Append(self->items, tfree) < 0 || PyList_Append(self->items, now) < 0;
    Py_DECREF(now);
    if (err || hitlog_bound(self) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
hitlog_clear(HitLog *self, PyObject *Py_UNUSED(ignored))
{
    if (PyList_SetSlice(self->items, 0, PyList_GET_SIZE(self->items), NULL) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* the newest maxlen stamps, as a new list */
static PyObject *
hitlog_newest(HitLog *self)
{
    Py_ssize_t n = PyList_GET_SIZE(self->items);
    return PyList_GetSlice(self->items, n > self->maxlen ? n - self->maxlen : 0, n);
}

static Py_ssize_t
hitlog_len(HitLog *self)
{
    Py_ssize_t n = PyList_GET_SIZE(self->items);
    return n > self->maxlen ? self->maxlen : n;
}

static PyObject *
hitlog_iter(HitLog *self)
{
    PyObject *items = hitlog_newest(self);
    if (items == NULL) {
        return NULL;
    }
    PyObject *it = PyObject_GetIter(items);
    Py_DECREF(items);
    return it;
}

static PyObject *
hitlog_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"maxlen", "now", "kind", NULL};
    Py_ssize_t maxlen;
    PyObject *now;
    int kind;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nOi:HitLog", kwlist, &maxlen, &now, &kind)) {
        return NULL;
    }
    if (maxlen < 2 || maxlen % 2 || maxlen > PY_SSIZE_T_MAX / 4) {
        PyErr_Format(PyExc_ValueError, "HitLog: maxlen must be even, >= 2 and < %zd, got %zd",
                     PY_SSIZE_T_MAX / 4, maxlen);
        return NULL;
    }
    if (kind != HIT_CLOCK && kind != HIT_STAMP && kind != HIT_CALL) {
        PyErr_Format(PyExc_ValueError, "HitLog: unknown kind %d", kind);
        return NULL;
    }
    if (!PyCallable_Check(now)) {
        PyErr_SetString(PyExc_TypeError, "HitLog: now must be callable");
        return NULL;
    }
    if (kind == HIT_STAMP && capture == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_stackstamp.setup() was not called");
        return NULL;
    }
    HitLog *self = (HitLog *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->items = PyList_New(0);
    if (self->items == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->maxlen = maxlen;
    self->kind = kind;
    self->now = Py_NewRef(now);
    return (PyObject *)self;
}

static int
hitlog_traverse(HitLog *self, visitproc visit, void *arg)
{
    Py_VISIT(self->items);
    Py_VISIT(self->now);
    return 0;
}

static int
hitlog_tp_clear(HitLog *self)
{
    Py_CLEAR(self->items);
    Py_CLEAR(self->now);
    return 0;
}

static void
hitlog_dealloc(HitLog *self)
{
    PyObject_GC_UnTrack(self);
    hitlog_tp_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef hitlog_methods[] = {
    {"append", (PyCFunction)hitlog_append, METH_O, "Log one stamp."},
    {"hit", (PyCFunction)hitlog_hit, METH_O,
     "hit(tfree): log a pure memo hit, its free's stamp tfree then a fresh stamp of its own."},
    {"clear", (PyCFunction)hitlog_clear, METH_NOARGS, "Drop every stamp."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods hitlog_as_sequence = {
    .sq_length = (lenfunc)hitlog_len,
};

static PyTypeObject HitLogType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cudalab.memory_tools._stackstamp.HitLog",
    .tp_basicsize = sizeof(HitLog),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "HitLog(maxlen, now, kind): the memo's stamp log (see the comment in _stackstamp.c).",
    .tp_new = hitlog_new,
    .tp_dealloc = (destructor)hitlog_dealloc,
    .tp_traverse = (traverseproc)hitlog_traverse,
    .tp_clear = (inquiry)hitlog_tp_clear,
    .tp_iter = (getiterfunc)hitlog_iter,
    .tp_methods = hitlog_methods,
    .tp_as_sequence = &hitlog_as_sequence,
};

static PyMethodDef methods[] = {
    {"stamp", stamp, METH_NOARGS, stamp_doc},
    {"setup", setup, METH_VARARGS, setup_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "cudalab.memory_tools._stackstamp",
    "stacks._stamp in C over CPython's interpreter frames (see cudalab/memory_tools/stacks.py).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__stackstamp(void)
{
    if (one == NULL && (one = PyLong_FromLong(1)) == NULL) {
        return NULL;
    }
    if (PyType_Ready(&HitLogType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module_def);
    /* the setup() signature, stamp() and HitLog contract stacks.py expects */
    if (m != NULL && (PyModule_AddIntConstant(m, "API", 2) < 0
                      || PyModule_AddObjectRef(m, "HitLog", (PyObject *)&HitLogType) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
