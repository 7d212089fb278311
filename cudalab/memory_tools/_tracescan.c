/* cudalab.memory_tools._tracescan: a snapshot pickle read into columns, safely, in steps.
 *
 * Why: a 10M-entry trace (about 1 GB of pickle) unpickled as Python dicts takes ~650 B per
 * entry (6.5 GB) and a minute; the explorer (cudalab/memory_tools/trace_index.py) needs the
 * entries as numpy columns and the first view drawn before the whole file is read.
 *
 * What: a pickle machine for the opcodes that build plain data (protocol 2-5 binary
 * opcodes: dict, list, tuple, set, frozenset, str, bytes, int, float, bool, None, the memo,
 * marks and frames). Everything but the trace entries is built as the stdlib unpickler
 * builds it. The list that is the value of the key "device_traces" is recognised as it is
 * made; the lists made inside it are the devices' traces, and the dicts appended to those
 * (the entries) are not kept: each is checked (the keys and types of
 * snapshot_check._ENTRY_KEYS) and written as one row of caller-owned numpy arrays (time,
 * address, size, stream, device_free, action code, device, stack id, cell id, nvtx id,
 * private pool id),
 * then dropped, memo slot included (an entry's frames list becomes a small StackRef there,
 * so a later entry that refers to the same list gets the same stack id). Frames are
 * interned by content (filename, name, line) and stacks by their frame ids.
 *
 * Safety: no opcode that names a class or function, calls one or reads a persistent id is
 * run (SnapshotLoadError names it); the text opcodes of protocols 0-1 raise
 * NotImplementedError (the caller falls back to safe_pickle's restricted unpickler); every
 * length and memo index is checked against the bytes left / the file size; containers
 * nest at most max_nesting deep (the depth rule of safe_pickle.check_nesting); the
 * process's peak RSS is checked every 65,536 opcodes against a limit given by the caller.
 * Stack underflow (the mark fence of CPython's _pickle.c included), truncation and
 * corruption are SnapshotLoadError naming the byte offset.
 *
 * Steps: scan(budget) runs until about `budget` more bytes are read, the STOP opcode, or
 * the column arrays are full (returns 0, 1 or 2); set_columns() hands bigger arrays.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/resource.h>

#define NCOL 11
enum { C_TIME, C_ADDR, C_SIZE, C_STREAM, C_DFREE, C_ACTION, C_DEVICE, C_STACK, C_CELL, C_NVTX,
       C_POOL };
static const Py_ssize_t COL_ITEMSIZE[NCOL] = {8, 8, 8, 8, 8, 1, 2, 4, 4, 4, 4};
enum { K_ACTION, K_ADDR, K_SIZE, K_STREAM, K_TIME, K_DFREE, K_FRAMES, K_CELL, K_NVTX, K_POOL,
       K_FILENAME, K_LINE, K_NAME, NKEYS };
static const char *KEY_NAMES[NKEYS] = {"action", "addr", "size", "stream", "time_us",
                                       "device_free", "frames", "cell", "nvtx_range",
                                       "segment_pool_id", "filename", "line", "name"};

typedef struct { PyObject *o; int d; } Item;
typedef struct { PyObject *key; int32_t val; } PtrSlot;

/* ---------------------------------------------------------------- StackRef */
typedef struct { PyObject_HEAD int32_t sid; } StackRef;
static PyTypeObject StackRefType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cudalab.memory_tools._tracescan.StackRef",
    .tp_basicsize = sizeof(StackRef),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An interned stack standing in the memo for a consumed entry's frames list.",
};

/* ---------------------------------------------------------------- Entry
 * A trace entry being read: the values of the keys the columns take (K_ACTION..K_NVTX),
 * set by SETITEM(S) in place of a dict's (other keys are dropped), so no dict is made. */
#define NENTRY (K_POOL + 1)
typedef struct { PyObject_HEAD PyObject *slot[NENTRY]; } Entry;
static void Entry_dealloc(Entry *e) {
    for (int k = 0; k < NENTRY; k++) Py_XDECREF(e->slot[k]);
    PyObject_Free(e);
}
static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cudalab.memory_tools._tracescan.Entry",
    .tp_basicsize = sizeof(Entry),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Entry_dealloc,
    .tp_doc = "A trace entry being read (its columns' values only).",
};
#define IS_ENTRY(o) Py_IS_TYPE((o), &EntryType)
/* Objects met again and again (the pickler memoizes a chunk's key and action strings),
 * mapped to a value by their address: PCACHE slots, linear probing over PPROBE of them (a
 * full probe replaces the home slot; no slot is ever emptied, so chains stay whole). Each
 * key is kept alive while cached, so its address stays its own. */
#define PCACHE 256  /* a power of two */
#define PPROBE 8
typedef struct { PyObject *key[PCACHE]; int32_t val[PCACHE]; } PtrCache;
/* frame dicts cached by address at most (each is kept alive while cached): a file whose
 * frames are not shared objects costs a content lookup per frame past this many */
#define FMAP_MAX (1 << 20)

typedef struct {
    PyObject_HEAD
    Py_buffer buf; int have_buf;
    Py_ssize_t pos;
    PyObject *what, *err, *on_bad;
    Item *stack; Py_ssize_t sp, scap;
    Py_ssize_t *marks; char *mark_trace; Py_ssize_t nm, mcap; Py_ssize_t ntrace_marks;
    PyObject **memo; uint8_t *memo_d; Py_ssize_t msize, memo_len;  /* objects, depths */
    PyObject **bf_ptr; int32_t *bf_sid; Py_ssize_t bf_n, bf_cap;  /* this batch's frames lists */
    Py_ssize_t *recent; Py_ssize_t nrecent, rcap;
    PyObject *outer;
    PyObject **tlists; Py_ssize_t ntl, tlcap;
    Py_ssize_t *dev_count;
    PyObject *result; int done;
    long rss_limit_kb; unsigned long ops; int max_nesting;
    Py_buffer col[NCOL]; int have_cols; Py_ssize_t cap, n;
    int addr_unsigned, stream_unsigned;
    PyObject *keys[NKEYS];
    PyObject *action_codes, *action_names, *strings, *string_names, *pool_ids, *pool_names;
    PyObject *frame_content, *frames, *frame_objs;
    PtrSlot *fmap; Py_ssize_t fcap, fcount;
    int32_t *spool; Py_ssize_t spn, spcap;
    Py_ssize_t *soff; Py_ssize_t nstacks, socap;
    int32_t *shtab; Py_ssize_t shcap;
    uint64_t *shash;
    PyObject **stackrefs;
    int32_t *tmp; Py_ssize_t tmpcap;
    PtrCache key_cache, action_cache, string_cache;  /* key -> slot, action -> code, text -> id */
} Scanner;

/* ---------------------------------------------------------------- errors */
static int fail(Scanner *s, const char *fmt, ...) {
    va_list va; va_start(va, fmt);
    PyObject *text = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    if (!text) return -1;
    PyObject *msg = PyUnicode_FromFormat("cannot read %U: %U", s->what, text);
    Py_DECREF(text);
    if (msg) { PyErr_SetObject(s->err, msg); Py_DECREF(msg); }
    return -1;
}
static int corrupt(Scanner *s, Py_ssize_t at) {
    return fail(s, "truncated or corrupt pickle (at byte %zd of %zd)", at, s->buf.len);
}
/* a malformed entry: the caller's on_bad_entry(device, index, entry) makes the exception
 * (the schema check's own message, so both readers say the same) */
static int entry_fail(Scanner *s, Py_ssize_t d, Py_ssize_t j, PyObject *e) {
    PyObject *shown = e;
    if (IS_ENTRY(e)) {  /* the schema check reads a dict of the values kept */
        shown = PyDict_New();
        if (!shown) return -1;
        for (int k = 0; k < NENTRY; k++)
            if (((Entry *)e)->slot[k] && PyDict_SetItem(shown, s->keys[k], ((Entry *)e)->slot[k]) < 0) {
                Py_DECREF(shown); return -1;
            }
    } else Py_INCREF(shown);
    PyObject *exc = PyObject_CallFunction(s->on_bad, "nnO", d, j, shown);
    Py_DECREF(shown);
    if (!exc) return -1;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return -1;
}

/* ---------------------------------------------------------------- growable arrays */
static int grow(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = PyMem_Realloc(*p, (size_t)c * item);
    if (!q) { PyErr_NoMemory(); return -1; }
    *p = q; *cap = c;
    return 0;
}

static inline Py_ssize_t fence(Scanner *s) { return s->nm ? s->marks[s->nm - 1] : 0; }

static int push(Scanner *s, PyObject *o, int d) {  /* steals o */
    if (!o) return -1;
    if (s->sp >= s->scap && grow((void **)&s->stack, &s->scap, s->sp + 1, sizeof(Item)) < 0) {
        Py_DECREF(o); return -1;
    }
    s->stack[s->sp].o = o; s->stack[s->sp].d = d; s->sp++;
    return 0;
}

/* ---------------------------------------------------------------- interning */
static inline size_t ptr_hash(PyObject *p);

/* the value cached for the object at k's address, or INT32_MIN */
static inline int32_t pc_get(PtrCache *c, PyObject *k) {
    size_t h = ptr_hash(k);
    for (int q = 0; q < PPROBE; q++) {
        size_t i = (h + (size_t)q) & (PCACHE - 1);
        if (c->key[i] == k) return c->val[i];
        if (!c->key[i]) break;
    }
    return INT32_MIN;
}

static void pc_put(PtrCache *c, PyObject *k, int32_t v) {
    size_t h = ptr_hash(k), slot = h & (PCACHE - 1);
    for (int q = 0; q < PPROBE; q++) {
        size_t i = (h + (size_t)q) & (PCACHE - 1);
        if (!c->key[i]) { slot = i; break; }
    }
    PyObject *old = c->key[slot];
    Py_INCREF(k);
    c->key[slot] = k; c->val[slot] = v;
    Py_XDECREF(old);
}

static void pc_clear(PtrCache *c) {
    for (int i = 0; i < PCACHE; i++) Py_CLEAR(c->key[i]);
}

static int32_t intern_str(Scanner *s, PyObject *names, PyObject *table, PyObject *v) {
    PyObject *got = PyDict_GetItemWithError(table, v);
    if (got) return (int32_t)PyLong_AsLong(got);
    if (PyErr_Occurred()) return -2;
    Py_ssize_t id = PyList_GET_SIZE(names);
    PyObject *idobj = PyLong_FromSsize_t(id);
    if (!idobj || PyDict_SetItem(table, v, idobj) < 0 || PyList_Append(names, v) < 0) {
        Py_XDECREF(idobj); return -2;
    }
    Py_DECREF(idobj);
    return (int32_t)id;
}

/* intern_str of a str, through a cache by address (a str never changes: the same id) */
static int32_t intern_cached(Scanner *s, PtrCache *c, PyObject *names, PyObject *table,
                             PyObject *v) {
    int32_t id = pc_get(c, v);
    if (id != INT32_MIN) return id;
    id = intern_str(s, names, table, v);
    if (id >= 0) pc_put(c, v, id);
    return id;
}

static inline size_t ptr_hash(PyObject *p) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33;
    return (size_t)x;
}

/* frame dict -> frame id (-1: not a frame dict, no exception; -2: error) */
static int32_t frame_id(Scanner *s, PyObject *f) {
    if (s->fcap) {
        size_t m = (size_t)s->fcap - 1, i = ptr_hash(f) & m;
        while (s->fmap[i].key) {
            if (s->fmap[i].key == f) return s->fmap[i].val;
            i = (i + 1) & m;
        }
    }
    if (!PyDict_CheckExact(f)) return -1;
    PyObject *fn = PyDict_GetItemWithError(f, s->keys[K_FILENAME]);
    PyObject *ln = PyDict_GetItemWithError(f, s->keys[K_LINE]);
    PyObject *nm = PyDict_GetItemWithError(f, s->keys[K_NAME]);
    if (PyErr_Occurred()) return -2;
    if (!fn || !ln || !nm || !PyUnicode_Check(fn) || !PyUnicode_Check(nm) || !PyLong_Check(ln)
            || PyBool_Check(ln))
        return -1;
    PyObject *key = PyTuple_Pack(3, fn, nm, ln);
    if (!key) return -2;
    PyObject *got = PyDict_GetItemWithError(s->frame_content, key);
    int32_t id;
    if (got) id = (int32_t)PyLong_AsLong(got);
    else {
        if (PyErr_Occurred()) { Py_DECREF(key); return -2; }
        id = (int32_t)PyList_GET_SIZE(s->frames);
        PyObject *idobj = PyLong_FromLong(id);
        if (!idobj || PyDict_SetItem(s->frame_content, key, idobj) < 0
                || PyList_Append(s->frames, key) < 0 || PyList_Append(s->frame_objs, f) < 0) {
            Py_XDECREF(idobj); Py_DECREF(key); return -2;
        }
        Py_DECREF(idobj);
    }
    Py_DECREF(key);
    if (s->fcount >= FMAP_MAX) return id;  /* (frames that are not shared: no more cached) */
    if ((s->fcount + 1) * 2 > s->fcap) {  /* rehash */
        Py_ssize_t nc = s->fcap ? s->fcap * 2 : 1024;
        PtrSlot *nt = PyMem_Calloc((size_t)nc, sizeof(PtrSlot));
        if (!nt) { PyErr_NoMemory(); return -2; }
        for (Py_ssize_t k = 0; k < s->fcap; k++) if (s->fmap[k].key) {
            size_t j = ptr_hash(s->fmap[k].key) & (size_t)(nc - 1);
            while (nt[j].key) j = (j + 1) & (size_t)(nc - 1);
            nt[j] = s->fmap[k];
        }
        PyMem_Free(s->fmap); s->fmap = nt; s->fcap = nc;
    }
    size_t m = (size_t)s->fcap - 1, i = ptr_hash(f) & m;
    while (s->fmap[i].key) i = (i + 1) & m;
    Py_INCREF(f);  /* kept alive: its address stays its own */
    s->fmap[i].key = f; s->fmap[i].val = id; s->fcount++;
    return id;
}

static uint64_t ids_hash(const int32_t *ids, Py_ssize_t k) {
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)k;
    for (Py_ssize_t i = 0; i < k; i++) { h ^= (uint32_t)ids[i]; h *= 1099511628211ULL; }
    return h;
}

/* the stack id of frame ids tmp[0:k] (interned) or -2 on error */
static int32_t stack_of_ids(Scanner *s, Py_ssize_t k) {
    uint64_t h = ids_hash(s->tmp, k);
    if (s->shcap) {
        size_t m = (size_t)s->shcap - 1, i = (size_t)h & m;
        while (s->shtab[i] >= 0) {
            int32_t sid = s->shtab[i];
            if (s->shash[sid] == h && s->soff[sid + 1] - s->soff[sid] == k) {
                const int32_t *a = s->spool + s->soff[sid];
                Py_ssize_t q = 0;
                while (q < k && a[q] == s->tmp[q]) q++;  /* (stacks are short: no memcmp call) */
                if (q == k) return sid;
            }
            i = (i + 1) & m;
        }
    }
    Py_ssize_t sid = s->nstacks;
    if (sid >= INT32_MAX - 1) { fail(s, "more than 2**31 distinct stacks"); return -2; }
    if (grow((void **)&s->spool, &s->spcap, s->spn + k, 4) < 0) return -2;
    if (sid + 2 > s->socap) {
        Py_ssize_t c = s->socap;
        if (grow((void **)&s->soff, &c, sid + 2, sizeof(Py_ssize_t)) < 0) return -2;
        void *h2 = PyMem_Realloc(s->shash, (size_t)c * 8);
        if (!h2) { PyErr_NoMemory(); return -2; }
        s->shash = h2;
        void *r2 = PyMem_Realloc(s->stackrefs, (size_t)c * sizeof(PyObject *));
        if (!r2) { PyErr_NoMemory(); return -2; }
        s->stackrefs = r2;
        s->socap = c;
    }
    s->stackrefs[sid] = NULL;
    memcpy(s->spool + s->spn, s->tmp, (size_t)k * 4);
    s->spn += k;
    s->soff[sid] = s->spn - k; s->soff[sid + 1] = s->spn;
    s->shash[sid] = h;
    s->nstacks = sid + 1;
    if (s->nstacks * 2 > s->shcap) {
        Py_ssize_t nc = s->shcap ? s->shcap * 2 : 1024;
        int32_t *nt = PyMem_Malloc((size_t)nc * 4);
        if (!nt) { PyErr_NoMemory(); return -2; }
        memset(nt, 0xff, (size_t)nc * 4);
        for (Py_ssize_t q = 0; q < s->nstacks; q++) {
            size_t j = (size_t)s->shash[q] & (size_t)(nc - 1);
            while (nt[j] >= 0) j = (j + 1) & (size_t)(nc - 1);
            nt[j] = (int32_t)q;
        }
        PyMem_Free(s->shtab); s->shtab = nt; s->shcap = nc;
    } else {
        size_t m = (size_t)s->shcap - 1, i = (size_t)h & m;
        while (s->shtab[i] >= 0) i = (i + 1) & m;
        s->shtab[i] = (int32_t)sid;
    }
    return (int32_t)sid;
}

/* frames list -> stack id; -1: no frames; -3: not a frames list (no exception); -2: error */
static int32_t stack_id(Scanner *s, PyObject *fr) {
    if (Py_IS_TYPE(fr, &StackRefType)) return ((StackRef *)fr)->sid;
    if (!PyList_CheckExact(fr)) return -3;
    Py_ssize_t k = PyList_GET_SIZE(fr);
    if (k == 0) return -1;
    if (grow((void **)&s->tmp, &s->tmpcap, k, 4) < 0) return -2;
    for (Py_ssize_t i = 0; i < k; i++) {
        int32_t f = frame_id(s, PyList_GET_ITEM(fr, i));
        if (f < 0) return f == -1 ? -3 : -2;
        s->tmp[i] = f;
    }
    return stack_of_ids(s, k);
}

/* ---------------------------------------------------------------- entries */
static int get_int(PyObject *v, int64_t *out, int *unsig, int allow_unsigned) {
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (!overflow) { *out = (int64_t)x; return 0; }
    if (overflow > 0 && allow_unsigned) {
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return 1; }
        *out = (int64_t)u; *unsig = 1; return 0;
    }
    return 1;
}

#define COLP(s, c, T) ((T *)(s)->col[c].buf)

/* an entry's value for a key (borrowed; NULL: absent, or an error is set) */
static inline PyObject *eget(Scanner *s, PyObject *e, int key) {
    if (IS_ENTRY(e)) return ((Entry *)e)->slot[key];
    return PyDict_GetItemWithError(e, s->keys[key]);
}

static int take_int(Scanner *s, PyObject *e, int key, Py_ssize_t d, Py_ssize_t j, int64_t dflt,
                    int64_t lo, int allow_unsigned, int *unsig, int64_t *out) {
    PyObject *v = eget(s, e, key);
    if (!v) {
        if (PyErr_Occurred()) return -1;
        if (key == K_SIZE) return entry_fail(s, d, j, e);
        *out = dflt; return 0;
    }
    if (!PyLong_Check(v) || PyBool_Check(v))
        return entry_fail(s, d, j, e);
    int r = get_int(v, out, unsig, allow_unsigned);
    if (r < 0) return -1;
    if (r > 0 || (!*unsig && *out < lo))
        return entry_fail(s, d, j, e);
    return 0;
}

static int32_t take_text_id(Scanner *s, PyObject *e, int key, Py_ssize_t d, Py_ssize_t j) {
    PyObject *v = eget(s, e, key);
    if (!v) return PyErr_Occurred() ? -2 : -1;
    if (v == Py_None) return -1;
    if (!PyUnicode_Check(v)) {
        entry_fail(s, d, j, e);
        return -2;
    }
    return intern_cached(s, &s->string_cache, s->string_names, s->strings, v);
}

static int consume_entry(Scanner *s, PyObject *e, Py_ssize_t d) {
    Py_ssize_t j = s->dev_count[d];
    Py_ssize_t r = s->n;
    if (!PyDict_CheckExact(e) && !IS_ENTRY(e)) return entry_fail(s, d, j, e);
    PyObject *a = eget(s, e, K_ACTION);
    if (!a) return PyErr_Occurred() ? -1 : entry_fail(s, d, j, e);
    if (!PyUnicode_Check(a)) return entry_fail(s, d, j, e);
    int32_t code = intern_cached(s, &s->action_cache, s->action_names, s->action_codes, a);
    if (code == -2) return -1;
    if (code > 255) return fail(s, "more than 256 distinct trace actions");
    int unsig = 0, dummy = 0;
    int64_t v;
    if (take_int(s, e, K_SIZE, d, j, 0, 0, 0, &dummy, &v) < 0) return -1;
    COLP(s, C_SIZE, int64_t)[r] = v;
    if (take_int(s, e, K_ADDR, d, j, 0, 0, 1, &unsig, &v) < 0) return -1;
    if (unsig) s->addr_unsigned = 1;
    COLP(s, C_ADDR, int64_t)[r] = v;
    unsig = 0;
    if (take_int(s, e, K_STREAM, d, j, 0, 0, 1, &unsig, &v) < 0) return -1;
    if (unsig) s->stream_unsigned = 1;
    COLP(s, C_STREAM, int64_t)[r] = v;
    if (take_int(s, e, K_TIME, d, j, 0, INT64_MIN, 0, &dummy, &v) < 0) return -1;
    COLP(s, C_TIME, int64_t)[r] = v;
    if (take_int(s, e, K_DFREE, d, j, -1, INT64_MIN, 0, &dummy, &v) < 0) return -1;
    COLP(s, C_DFREE, int64_t)[r] = v;
    PyObject *fr = eget(s, e, K_FRAMES);
    int32_t sid = -1;
    if (fr) {
        sid = stack_id(s, fr);
        if (sid == -2) return -1;
        if (sid == -3) return entry_fail(s, d, j, e);
        if (sid >= 0 && PyList_CheckExact(fr)) {  /* (prune_recent needs not intern it again) */
            if (s->bf_n >= s->bf_cap) {
                Py_ssize_t c = s->bf_cap;
                if (grow((void **)&s->bf_ptr, &c, s->bf_n + 1, sizeof(PyObject *)) < 0) return -1;
                void *q = PyMem_Realloc(s->bf_sid, (size_t)c * sizeof(int32_t));
                if (!q) { PyErr_NoMemory(); return -1; }
                s->bf_sid = q; s->bf_cap = c;
            }
            s->bf_ptr[s->bf_n] = fr; s->bf_sid[s->bf_n++] = sid;
        }
    } else if (PyErr_Occurred()) return -1;
    COLP(s, C_STACK, int32_t)[r] = sid;
    int32_t c = take_text_id(s, e, K_CELL, d, j);
    if (c == -2) return -1;
    COLP(s, C_CELL, int32_t)[r] = c;
    c = take_text_id(s, e, K_NVTX, d, j);
    if (c == -2) return -1;
    COLP(s, C_NVTX, int32_t)[r] = c;
    PyObject *pool = eget(s, e, K_POOL);  /* cudalab's tag of a private pool's entries */
    c = -1;
    if (pool && pool != Py_None) {
        if (PyList_CheckExact(pool)) pool = PyList_AsTuple(pool); else Py_INCREF(pool);
        if (!pool) return -1;
        c = intern_str(s, s->pool_names, s->pool_ids, pool);
        Py_DECREF(pool);
        if (c == -2) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) return -1;
            PyErr_Clear();  /* (not hashable: not a pool id, no pool) */
            c = -1;
        }
    } else if (!pool && PyErr_Occurred()) return -1;
    COLP(s, C_POOL, int32_t)[r] = c;
    COLP(s, C_ACTION, uint8_t)[r] = (uint8_t)code;
    COLP(s, C_DEVICE, int16_t)[r] = (int16_t)d;
    s->n = r + 1;
    s->dev_count[d] = j + 1;
    return 0;
}

static PyObject *stackref(Scanner *s, int32_t sid) {
    if (!s->stackrefs[sid]) {
        StackRef *r = PyObject_New(StackRef, &StackRefType);
        if (!r) return NULL;
        r->sid = sid;
        s->stackrefs[sid] = (PyObject *)r;
    }
    Py_INCREF(s->stackrefs[sid]);
    return s->stackrefs[sid];
}

/* drop the memo's references to the entries just consumed (and their frames lists) */
static int prune_recent(Scanner *s) {
    Py_ssize_t cursor = 0;  /* the batch's frames lists come in the order they were memoized */
    for (Py_ssize_t q = 0; q < s->nrecent; q++) {
        Py_ssize_t idx = s->recent[q];
        PyObject *o = s->memo[idx];
        if (!o) continue;
        if (IS_ENTRY(o)) { Py_INCREF(Py_None); s->memo[idx] = Py_None; Py_DECREF(o); }
        else if (PyDict_CheckExact(o)) {
            int has = PyDict_Contains(o, s->keys[K_ACTION]);
            if (has < 0) return -1;
            if (has) { Py_INCREF(Py_None); s->memo[idx] = Py_None; Py_DECREF(o); }
        } else if (PyList_CheckExact(o) && PyList_GET_SIZE(o) > 0) {
            int32_t sid;
            if (cursor < s->bf_n && s->bf_ptr[cursor] == o) sid = s->bf_sid[cursor++];
            else sid = stack_id(s, o);  /* (a list no entry took as its frames) */
            if (sid == -2) return -1;
            if (sid >= 0) {
                PyObject *ref = stackref(s, sid);
                if (!ref) return -1;
                s->memo[idx] = ref; Py_DECREF(o);
            }
        }
    }
    s->nrecent = 0;
    s->bf_n = 0;
    return 0;
}

static Py_ssize_t trace_index(Scanner *s, PyObject *o) {
    for (Py_ssize_t i = 0; i < s->ntl; i++) if (s->tlists[i] == o) return i;
    return -1;
}

/* ---------------------------------------------------------------- the machine */
static PyObject *materialize(Scanner *s, int32_t sid) {
    Py_ssize_t a = s->soff[sid], b = s->soff[sid + 1];
    PyObject *l = PyList_New(b - a);
    if (!l) return NULL;
    for (Py_ssize_t i = a; i < b; i++) {
        PyObject *f = PyList_GET_ITEM(s->frame_objs, s->spool[i]);
        Py_INCREF(f); PyList_SET_ITEM(l, i - a, f);
    }
    return l;
}

static int memo_put(Scanner *s, Py_ssize_t idx, Item it) {
    if (idx < 0 || idx > s->buf.len + 16) return corrupt(s, s->pos);
    if (idx >= s->msize) {
        Py_ssize_t old = s->msize, cap = s->msize;
        if (grow((void **)&s->memo, &cap, idx + 1, sizeof(PyObject *)) < 0) return -1;
        memset(s->memo + old, 0, (size_t)(cap - old) * sizeof(PyObject *));
        uint8_t *d = PyMem_Realloc(s->memo_d, (size_t)cap);
        if (!d) { PyErr_NoMemory(); return -1; }
        s->memo_d = d;
        s->msize = cap;
    }
    Py_INCREF(it.o);
    PyObject *old = s->memo[idx];
    s->memo[idx] = it.o;
    s->memo_d[idx] = (uint8_t)it.d;
    if (old) Py_DECREF(old); else s->memo_len++;
    if (s->ntrace_marks && (IS_ENTRY(it.o) || PyDict_CheckExact(it.o) || PyList_CheckExact(it.o))) {
        if (grow((void **)&s->recent, &s->rcap, s->nrecent + 1, sizeof(Py_ssize_t)) < 0) return -1;
        s->recent[s->nrecent++] = idx;
    }
    return 0;
}

static inline int need(Scanner *s, Py_ssize_t k) {
    if (s->pos + k > s->buf.len) return fail(s, "truncated pickle (it ends inside an opcode, at "
                                             "byte %zd of %zd)", s->pos, s->buf.len);
    return 0;
}
static inline uint64_t le(const unsigned char *p, int k) {
    uint64_t x = 0;
    for (int i = 0; i < k; i++) x |= (uint64_t)p[i] << (8 * i);
    return x;
}

static int check_depth(Scanner *s, int d) {
    if (d > s->max_nesting)
        return fail(s, "nested too deeply (more than %d levels of containers, at byte %zd); "
                    "snapshots nest a few levels deep", s->max_nesting, s->pos);
    return 0;
}

/* items stack[x:sp] go into stack[x-1] (APPEND(S)); 2: no room for entries (nothing done) */
static int do_append(Scanner *s, Py_ssize_t x, Py_ssize_t at, int had_mark) {
    (void)had_mark;
    if (x <= fence(s) || x > s->sp) return corrupt(s, at);
    PyObject *target = s->stack[x - 1].o;
    if (!PyList_CheckExact(target) && !PyAnySet_CheckExact(target)) return corrupt(s, at);
    Py_ssize_t dev = PyList_CheckExact(target) ? trace_index(s, target) : -1;
    if (dev >= 0) {
        if (s->n + (s->sp - x) > s->cap) return 2;
        for (Py_ssize_t i = x; i < s->sp; i++)
            if (consume_entry(s, s->stack[i].o, dev) < 0) return -1;
    } else {
        int dmax = 0;
        for (Py_ssize_t i = x; i < s->sp; i++) {
            if (s->stack[i].d > dmax) dmax = s->stack[i].d;
            int r = PyList_CheckExact(target) ? PyList_Append(target, s->stack[i].o)
                                              : PySet_Add(target, s->stack[i].o);
            if (r < 0) { PyErr_Clear(); return corrupt(s, at); }
        }
        if (s->stack[x - 1].d < dmax + 1) s->stack[x - 1].d = dmax + 1;
        if (check_depth(s, s->stack[x - 1].d) < 0) return -1;
    }
    for (Py_ssize_t i = x; i < s->sp; i++) Py_DECREF(s->stack[i].o);
    s->sp = x;
    if (dev >= 0 && s->nrecent && prune_recent(s) < 0) return -1;
    s->bf_n = 0;
    return 0;
}

/* the slot of a key object (-1: a key the columns do not take), cached by the key's address
 * (the pickler memoizes key strings: a few objects, met again and again) */
static int key_slot(Scanner *s, PyObject *k) {
    int32_t idx = pc_get(&s->key_cache, k);
    if (idx != INT32_MIN) return (int)idx;
    idx = -1;
    if (PyUnicode_Check(k))
        for (int q = 0; q < NENTRY; q++)
            if (PyUnicode_CompareWithASCIIString(k, KEY_NAMES[q]) == 0) { idx = q; break; }
    pc_put(&s->key_cache, k, idx);
    return (int)idx;
}

static int entry_setitems(Scanner *s, Entry *e, Py_ssize_t x) {
    for (Py_ssize_t i = x; i < s->sp; i += 2) {
        int k = key_slot(s, s->stack[i].o);
        if (k >= 0) {
            PyObject *old = e->slot[k];
            e->slot[k] = s->stack[i + 1].o;  /* (the stack's reference moves over) */
            s->stack[i + 1].o = NULL;
            Py_XDECREF(old);
        }
    }
    for (Py_ssize_t i = x; i < s->sp; i++) Py_XDECREF(s->stack[i].o);
    s->sp = x;
    return 0;
}

static int do_setitems(Scanner *s, Py_ssize_t x, Py_ssize_t at) {
    if (x <= fence(s) || x > s->sp || (s->sp - x) % 2) return corrupt(s, at);
    PyObject *target = s->stack[x - 1].o;
    if (IS_ENTRY(target)) return entry_setitems(s, (Entry *)target, x);
    if (!PyDict_CheckExact(target)) return corrupt(s, at);
    int dmax = 0;
    for (Py_ssize_t i = x; i < s->sp; i += 2) {
        if (s->stack[i].d > dmax) dmax = s->stack[i].d;
        if (s->stack[i + 1].d > dmax) dmax = s->stack[i + 1].d;
        if (PyDict_SetItem(target, s->stack[i].o, s->stack[i + 1].o) < 0) {
            PyErr_Clear(); return corrupt(s, at);
        }
    }
    for (Py_ssize_t i = x; i < s->sp; i++) Py_DECREF(s->stack[i].o);
    s->sp = x;
    if (s->stack[x - 1].d < dmax + 1) s->stack[x - 1].d = dmax + 1;
    return check_depth(s, s->stack[x - 1].d);
}

static Py_ssize_t pop_mark(Scanner *s, Py_ssize_t at) {
    if (!s->nm) { corrupt(s, at); return -1; }
    s->nm--;
    if (s->mark_trace[s->nm]) s->ntrace_marks--;
    return s->marks[s->nm];
}

static int make_from(Scanner *s, Py_ssize_t x, char kind, Py_ssize_t at) {
    /* stack[x:sp] -> one container (tuple, list, dict, frozenset) at x */
    Py_ssize_t k = s->sp - x;
    int dmax = 0;
    for (Py_ssize_t i = x; i < s->sp; i++) if (s->stack[i].d > dmax) dmax = s->stack[i].d;
    PyObject *o = NULL;
    if (kind == 't' || kind == 'l') {
        o = kind == 't' ? PyTuple_New(k) : PyList_New(k);
        if (!o) return -1;
        for (Py_ssize_t i = 0; i < k; i++) {
            PyObject *v = s->stack[x + i].o;
            if (kind == 't') PyTuple_SET_ITEM(o, i, v); else PyList_SET_ITEM(o, i, v);
        }
    } else if (kind == 'd') {
        if (k % 2) return corrupt(s, at);
        o = PyDict_New();
        if (!o) return -1;
        for (Py_ssize_t i = x; i < s->sp; i += 2)
            if (PyDict_SetItem(o, s->stack[i].o, s->stack[i + 1].o) < 0) {
                Py_DECREF(o); PyErr_Clear(); return corrupt(s, at);
            }
        for (Py_ssize_t i = x; i < s->sp; i++) Py_DECREF(s->stack[i].o);
    } else {
        o = PyFrozenSet_New(NULL);
        if (!o) return -1;
        for (Py_ssize_t i = x; i < s->sp; i++)
            if (PySet_Add(o, s->stack[i].o) < 0) { Py_DECREF(o); PyErr_Clear(); return corrupt(s, at); }
        for (Py_ssize_t i = x; i < s->sp; i++) Py_DECREF(s->stack[i].o);
    }
    s->sp = x;
    if (check_depth(s, dmax + 1) < 0) { Py_DECREF(o); return -1; }
    return push(s, o, dmax + 1);
}

static int refused(Scanner *s, const char *what_it_does) {
    PyObject *msg = PyUnicode_FromFormat("refusing to load %U: the pickle %s; snapshots contain "
                                         "only plain data", s->what, what_it_does);
    if (msg) { PyErr_SetObject(s->err, msg); Py_DECREF(msg); }
    return -1;
}

static int check_rss(Scanner *s) {
    if (s->rss_limit_kb <= 0) return 0;
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0 && ru.ru_maxrss > s->rss_limit_kb)
        return fail(s, "reading it takes more memory than its limit (the process's peak "
                    "resident memory passed %ld MiB): a corrupt or hostile pickle",
                    s->rss_limit_kb / 1024);
    return 0;
}

/* one opcode; 1: STOP; 2: no room for entries (position unchanged) */
static int step(Scanner *s) {
    const unsigned char *p = (const unsigned char *)s->buf.buf;
    Py_ssize_t at = s->pos;
    if (at >= s->buf.len)
        return fail(s, "truncated pickle (it ends before its STOP opcode)");
    unsigned char op = p[s->pos++];
    Py_ssize_t len, x;
    uint64_t u;
    switch (op) {
    case 0x80: if (need(s, 1)) return -1;  /* PROTO */
        if (p[s->pos] > 5) return fail(s, "unsupported pickle protocol %d", (int)p[s->pos]);
        s->pos++; return 0;
    case 0x95: if (need(s, 8)) return -1;  /* FRAME */
        u = le(p + s->pos, 8); s->pos += 8;
        if (u > (uint64_t)(s->buf.len - s->pos))
            return fail(s, "truncated pickle (a frame at byte %zd claims %llu bytes, %zd are "
                        "left)", at, (unsigned long long)u, s->buf.len - s->pos);
        return 0;
    case '.': /* STOP */
        if (s->sp != 1 || s->nm) return corrupt(s, at);
        s->sp--; s->result = s->stack[0].o; s->done = 1; return 1;
    case '(': /* MARK */
        if (s->nm + 1 > s->mcap) {
            if (grow((void **)&s->marks, &s->mcap, s->nm + 1, sizeof(Py_ssize_t)) < 0) return -1;
            char *mt = PyMem_Realloc(s->mark_trace, (size_t)s->mcap);
            if (!mt) { PyErr_NoMemory(); return -1; }
            s->mark_trace = mt;
        }
        s->mark_trace[s->nm] = s->sp > 0 && PyList_CheckExact(s->stack[s->sp - 1].o)
                               && trace_index(s, s->stack[s->sp - 1].o) >= 0;
        s->ntrace_marks += s->mark_trace[s->nm];
        s->marks[s->nm++] = s->sp; return 0;
    case '0': /* POP */
        if (s->nm && s->marks[s->nm - 1] == s->sp) { pop_mark(s, at); return 0; }
        if (s->sp <= fence(s)) return corrupt(s, at);
        s->sp--; Py_DECREF(s->stack[s->sp].o); return 0;
    case '1': /* POP_MARK */
        if ((x = pop_mark(s, at)) < 0) return -1;
        while (s->sp > x) { s->sp--; Py_DECREF(s->stack[s->sp].o); }
        return 0;
    case '2': /* DUP */
        if (s->sp <= fence(s)) return corrupt(s, at);
        Py_INCREF(s->stack[s->sp - 1].o);
        return push(s, s->stack[s->sp - 1].o, s->stack[s->sp - 1].d);
    case 'N': Py_INCREF(Py_None); return push(s, Py_None, 0);
    case 0x88: Py_INCREF(Py_True); return push(s, Py_True, 0);
    case 0x89: Py_INCREF(Py_False); return push(s, Py_False, 0);
    case 'J': if (need(s, 4)) return -1;
        { int32_t v = (int32_t)(uint32_t)le(p + s->pos, 4); s->pos += 4;
          return push(s, PyLong_FromLong(v), 0); }
    case 'K': if (need(s, 1)) return -1; return push(s, PyLong_FromLong(p[s->pos++]), 0);
    case 'M': if (need(s, 2)) return -1; s->pos += 2;
        return push(s, PyLong_FromLong((long)le(p + s->pos - 2, 2)), 0);
    case 0x8a: case 0x8b: /* LONG1, LONG4 */
        { int w = op == 0x8a ? 1 : 4;
          if (need(s, w)) return -1;
          u = le(p + s->pos, w); s->pos += w;
          if (op == 0x8b && (int32_t)u < 0) return corrupt(s, at);
          if (need(s, (Py_ssize_t)u)) return -1;
          PyObject *v;
          if (u >= 1 && u <= 8) {  /* (addresses, times: one int64, no byte-array parse) */
              uint64_t x = le(p + s->pos, (int)u);
              if (u < 8 && (x >> (8 * u - 1)) & 1) x |= ~0ULL << (8 * u);  /* sign */
              v = PyLong_FromLongLong((long long)(int64_t)x);
          } else
              v = u ? _PyLong_FromByteArray(p + s->pos, (size_t)u, 1, 1) : PyLong_FromLong(0);
          s->pos += (Py_ssize_t)u;
          return push(s, v, 0); }
    case 'G': if (need(s, 8)) return -1;
        { double v = PyFloat_Unpack8((const char *)p + s->pos, 0); s->pos += 8;
          if (v == -1.0 && PyErr_Occurred()) return -1;
          return push(s, PyFloat_FromDouble(v), 0); }
    case 0x8c: case 'X': case 0x8d: case 'C': case 'B': case 0x8e: case 0x96:
        { int w = (op == 0x8c || op == 'C') ? 1 : (op == 'X' || op == 'B') ? 4 : 8;
          if (need(s, w)) return -1;
          u = le(p + s->pos, w); s->pos += w;
          if (u > (uint64_t)(s->buf.len - s->pos))
              return fail(s, "truncated pickle (a string at byte %zd claims %llu bytes, %zd "
                          "are left)", at, (unsigned long long)u, s->buf.len - s->pos);
          len = (Py_ssize_t)u;
          PyObject *v;
          if (op == 0x8c || op == 'X' || op == 0x8d) {
              v = PyUnicode_DecodeUTF8((const char *)p + s->pos, len, "surrogatepass");
              if (!v) { PyErr_Clear(); return corrupt(s, at); }
          } else if (op == 0x96) v = PyByteArray_FromStringAndSize((const char *)p + s->pos, len);
          else v = PyBytes_FromStringAndSize((const char *)p + s->pos, len);
          s->pos += len;
          return push(s, v, 0); }
    case '}':
        if (s->nm && s->mark_trace[s->nm - 1] && s->sp >= s->marks[s->nm - 1]) {
            Entry *e = PyObject_New(Entry, &EntryType);  /* an item of a trace list */
            if (!e) return -1;
            memset(e->slot, 0, sizeof(e->slot));
            return push(s, (PyObject *)e, 1);
        }
        return push(s, PyDict_New(), 1);
    case ')': return push(s, PyTuple_New(0), 1);
    case 0x8f: return push(s, PySet_New(NULL), 1);
    case ']': {
        PyObject *l = PyList_New(0);
        if (!l) return -1;
        if (!s->outer && s->sp > 0 && PyUnicode_Check(s->stack[s->sp - 1].o)
                && PyUnicode_CompareWithASCIIString(s->stack[s->sp - 1].o, "device_traces") == 0) {
            Py_INCREF(l); s->outer = l;
        } else if (s->outer && ((s->sp > 0 && s->stack[s->sp - 1].o == s->outer)
                   || (s->nm && s->marks[s->nm - 1] > 0
                       && s->stack[s->marks[s->nm - 1] - 1].o == s->outer))) {
            if (grow((void **)&s->tlists, &s->tlcap, s->ntl + 1, sizeof(PyObject *)) < 0) return -1;
            Py_ssize_t c = s->ntl;
            if (grow((void **)&s->dev_count, &c, s->ntl + 1, sizeof(Py_ssize_t)) < 0) return -1;
            if (s->ntl >= 32767) return fail(s, "more than 32,767 device traces");
            Py_INCREF(l); s->tlists[s->ntl] = l;
            s->dev_count[s->ntl++] = 0;
        }
        return push(s, l, 1); }
    case 't': case 'l': case 'd': case 0x91:
        if ((x = pop_mark(s, at)) < 0) return -1;
        return make_from(s, x, op == 0x91 ? 'f' : (char)op, at);
    case 0x85: case 0x86: case 0x87: {
        Py_ssize_t k = op - 0x84;
        if (s->sp - fence(s) < k) return corrupt(s, at);
        return make_from(s, s->sp - k, 't', at); }
    case 'a': {
        int r = do_append(s, s->sp - 1, at, 0);
        if (r == 2) s->pos = at;
        return r; }
    case 'e': case 0x90: {
        if (!s->nm) return corrupt(s, at);
        x = s->marks[s->nm - 1];
        /* (room is checked before the mark goes) */
        if (x > 0 && x <= s->sp && PyList_CheckExact(s->stack[x - 1].o)
                && trace_index(s, s->stack[x - 1].o) >= 0 && s->n + (s->sp - x) > s->cap) {
            s->pos = at; return 2;
        }
        pop_mark(s, at);
        return do_append(s, x, at, 1); }
    case 's': return do_setitems(s, s->sp - 2, at);
    case 'u': if ((x = pop_mark(s, at)) < 0) return -1; return do_setitems(s, x, at);
    case 0x94: if (s->sp <= fence(s)) return corrupt(s, at);
        return memo_put(s, s->memo_len, s->stack[s->sp - 1]);
    case 'q': case 'r': {
        int w = op == 'q' ? 1 : 4;
        if (need(s, w)) return -1;
        u = le(p + s->pos, w); s->pos += w;
        if (s->sp <= fence(s)) return corrupt(s, at);
        return memo_put(s, (Py_ssize_t)u, s->stack[s->sp - 1]); }
    case 'h': case 'j': {
        int w = op == 'h' ? 1 : 4;
        if (need(s, w)) return -1;
        u = le(p + s->pos, w); s->pos += w;
        if ((Py_ssize_t)u >= s->msize || !s->memo[u])
            return fail(s, "truncated or corrupt pickle (memo key %llu not found, at byte %zd)",
                        (unsigned long long)u, at);
        PyObject *o = s->memo[u];
        if (Py_IS_TYPE(o, &StackRefType) && !s->ntrace_marks) {
            PyObject *l = materialize(s, ((StackRef *)o)->sid);
            return push(s, l, 2);
        }
        Py_INCREF(o);
        return push(s, o, s->memo_d[u]); }
    case 'c': case 0x93: case 'i': return refused(s, "references a class or function (GLOBAL)");
    case 'R': case 'o': case 0x81: case 0x92: case 'b':
        return refused(s, "calls a class or function (REDUCE/OBJ/NEWOBJ/BUILD)");
    case 'P': case 'Q': return refused(s, "uses a persistent id");
    case 0x82: case 0x83: case 0x84: return refused(s, "uses the extension registry (EXT)");
    case 0x97: case 0x98: return refused(s, "uses out-of-band buffers");
    case 'I': case 'L': case 'S': case 'V': case 'F': case 'g': case 'p': case 'T': case 'U':
        PyErr_SetString(PyExc_NotImplementedError, "a protocol 0/1 text opcode");
        return -1;
    default:
        return fail(s, "truncated or corrupt pickle (unknown opcode 0x%02x at byte %zd)",
                    (int)op, at);
    }
}

/* ---------------------------------------------------------------- the Python type */
static void release_cols(Scanner *s) {
    if (!s->have_cols) return;
    for (int c = 0; c < NCOL; c++) PyBuffer_Release(&s->col[c]);
    s->have_cols = 0;
}

static PyObject *Scanner_set_columns(Scanner *s, PyObject *args) {
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "O", &seq)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "columns must be a sequence");
    if (!fast) return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != NCOL) {
        Py_DECREF(fast); PyErr_SetString(PyExc_ValueError, "need 10 column arrays"); return NULL;
    }
    Py_buffer nb[NCOL];
    Py_ssize_t cap = -1;
    int c;
    for (c = 0; c < NCOL; c++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, c), &nb[c],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) break;
        Py_ssize_t k = nb[c].len / COL_ITEMSIZE[c];
        if (cap < 0 || k < cap) cap = k;
    }
    Py_DECREF(fast);
    if (c < NCOL) { while (c-- > 0) PyBuffer_Release(&nb[c]); return NULL; }
    if (cap < s->n) {
        for (c = 0; c < NCOL; c++) PyBuffer_Release(&nb[c]);
        PyErr_SetString(PyExc_ValueError, "the new columns are smaller than the rows read");
        return NULL;
    }
    for (c = 0; c < NCOL; c++)  /* rows read so far move over */
        if (s->have_cols && s->n) memcpy(nb[c].buf, s->col[c].buf, (size_t)(s->n * COL_ITEMSIZE[c]));
    release_cols(s);
    memcpy(s->col, nb, sizeof(nb));
    s->have_cols = 1; s->cap = cap;
    Py_RETURN_NONE;
}

static PyObject *Scanner_scan(Scanner *s, PyObject *args) {
    Py_ssize_t budget;
    if (!PyArg_ParseTuple(args, "n", &budget)) return NULL;
    if (s->done) return PyLong_FromLong(1);
    if (!s->have_cols) { PyErr_SetString(PyExc_RuntimeError, "set_columns first"); return NULL; }
    Py_ssize_t stop = s->pos + budget;
    while (s->pos < stop || budget <= 0) {
        int r = step(s);
        if (r < 0) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
                PyErr_Clear();
                fail(s, "out of memory while reading it (a corrupt or hostile pickle, or a "
                     "file larger than this process may hold)");
            }
            return NULL;
        }
        if (r) return PyLong_FromLong(r);
        if ((++s->ops & 0xffff) == 0 && check_rss(s) < 0) return NULL;
    }
    return PyLong_FromLong(0);
}

static PyObject *Scanner_tables(Scanner *s, PyObject *Py_UNUSED(a)) {
    PyObject *off = PyBytes_FromStringAndSize(NULL, (s->nstacks + 1) * 8);
    PyObject *pool = PyBytes_FromStringAndSize((const char *)s->spool, s->spn * 4);
    if (!off || !pool) { Py_XDECREF(off); Py_XDECREF(pool); return NULL; }
    int64_t *o = (int64_t *)PyBytes_AS_STRING(off);
    o[0] = 0;
    for (Py_ssize_t i = 0; i < s->nstacks; i++) o[i + 1] = s->soff[i + 1];
    return Py_BuildValue("{s:O,s:O,s:O,s:O,s:N,s:N,s:n,s:i,s:i}", "actions", s->action_names,
                         "strings", s->string_names, "pools", s->pool_names,
                         "frames", s->frames, "stack_offsets", off,
                         "stack_frames", pool, "devices", s->ntl, "addr_unsigned",
                         s->addr_unsigned, "stream_unsigned", s->stream_unsigned);
}

static PyObject *Scanner_get(Scanner *s, void *which) {
    switch ((intptr_t)which) {
    case 0: return PyLong_FromSsize_t(s->n);
    case 1: return PyLong_FromSsize_t(s->pos);
    case 2: if (s->result) { Py_INCREF(s->result); return s->result; } Py_RETURN_NONE;
    default: return PyLong_FromSsize_t(s->buf.len);
    }
}

static int Scanner_init(Scanner *s, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"data", "what", "error", "on_bad_entry", "actions", "max_nesting",
                             "rss_limit_kb", NULL};
    PyObject *data, *actions;
    long rss = 0;
    int maxn = 200;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OUOOO|il", kwlist, &data, &s->what, &s->err,
                                     &s->on_bad, &actions, &maxn, &rss))
        return -1;
    if (PyObject_GetBuffer(data, &s->buf, PyBUF_SIMPLE) < 0) return -1;
    s->have_buf = 1;
    Py_INCREF(s->what); Py_INCREF(s->err); Py_INCREF(s->on_bad);
    s->max_nesting = maxn; s->rss_limit_kb = rss;
    for (int k = 0; k < NKEYS; k++)
        if (!(s->keys[k] = PyUnicode_InternFromString(KEY_NAMES[k]))) return -1;
    s->action_codes = PyDict_New(); s->action_names = PyList_New(0);
    s->strings = PyDict_New(); s->string_names = PyList_New(0);
    s->pool_ids = PyDict_New(); s->pool_names = PyList_New(0);
    s->frame_content = PyDict_New(); s->frames = PyList_New(0); s->frame_objs = PyList_New(0);
    if (!s->action_codes || !s->action_names || !s->strings || !s->string_names
            || !s->frame_content || !s->frames || !s->frame_objs || !s->pool_ids
            || !s->pool_names) return -1;
    PyObject *it = PyObject_GetIter(actions), *a;
    if (!it) return -1;
    while ((a = PyIter_Next(it))) {
        int32_t c = intern_str(s, s->action_names, s->action_codes, a);
        Py_DECREF(a);
        if (c == -2) { Py_DECREF(it); return -1; }
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return -1;
    s->soff = PyMem_Malloc(64 * sizeof(Py_ssize_t));
    s->shash = PyMem_Malloc(64 * 8);
    s->stackrefs = PyMem_Malloc(64 * sizeof(PyObject *));
    if (!s->soff || !s->shash || !s->stackrefs) { PyErr_NoMemory(); return -1; }
    s->socap = 64;
    s->soff[0] = 0;
    return 0;
}

static void Scanner_dealloc(Scanner *s) {
    for (Py_ssize_t i = 0; i < s->sp; i++) Py_XDECREF(s->stack[i].o);
    for (Py_ssize_t i = 0; i < s->msize; i++) Py_XDECREF(s->memo[i]);
    for (Py_ssize_t i = 0; i < s->ntl; i++) Py_XDECREF(s->tlists[i]);
    for (Py_ssize_t i = 0; i < s->fcap; i++) Py_XDECREF(s->fmap[i].key);
    for (Py_ssize_t i = 0; i < s->nstacks; i++) Py_XDECREF(s->stackrefs[i]);
    PyMem_Free(s->stack); PyMem_Free(s->marks); PyMem_Free(s->mark_trace); PyMem_Free(s->memo); PyMem_Free(s->memo_d);
    PyMem_Free(s->bf_ptr); PyMem_Free(s->bf_sid);
    PyMem_Free(s->recent); PyMem_Free(s->tlists); PyMem_Free(s->dev_count); PyMem_Free(s->fmap);
    PyMem_Free(s->spool); PyMem_Free(s->soff); PyMem_Free(s->shtab); PyMem_Free(s->shash);
    PyMem_Free(s->stackrefs); PyMem_Free(s->tmp);
    Py_XDECREF(s->outer); Py_XDECREF(s->result); Py_XDECREF(s->what); Py_XDECREF(s->err); Py_XDECREF(s->on_bad);
    for (int k = 0; k < NKEYS; k++) Py_XDECREF(s->keys[k]);
    pc_clear(&s->key_cache); pc_clear(&s->action_cache); pc_clear(&s->string_cache);
    Py_XDECREF(s->action_codes); Py_XDECREF(s->action_names); Py_XDECREF(s->strings);
    Py_XDECREF(s->string_names); Py_XDECREF(s->frame_content); Py_XDECREF(s->frames);
    Py_XDECREF(s->pool_ids); Py_XDECREF(s->pool_names);
    Py_XDECREF(s->frame_objs);
    release_cols(s);
    if (s->have_buf) PyBuffer_Release(&s->buf);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMethodDef Scanner_methods[] = {
    {"scan", (PyCFunction)Scanner_scan, METH_VARARGS,
     "scan(budget) -> 0 (more to read), 1 (done), 2 (the columns are full: set_columns)"},
    {"set_columns", (PyCFunction)Scanner_set_columns, METH_VARARGS,
     "set_columns(arrays): the 11 writable column arrays (rows read so far are copied over)"},
    {"tables", (PyCFunction)Scanner_tables, METH_NOARGS,
     "the interned tables: actions, strings, frames, stacks"},
    {NULL}};
static PyGetSetDef Scanner_getset[] = {
    {"rows", (getter)Scanner_get, NULL, "entries read", (void *)0},
    {"pos", (getter)Scanner_get, NULL, "bytes read", (void *)1},
    {"result", (getter)Scanner_get, NULL, "the unpickled object (its traces empty)", (void *)2},
    {"size", (getter)Scanner_get, NULL, "bytes in all", (void *)3},
    {NULL}};
static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cudalab.memory_tools._tracescan.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A snapshot pickle read into trace columns, in steps (see the module).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Scanner_init,
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_methods = Scanner_methods,
    .tp_getset = Scanner_getset,
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_tracescan",
    "Snapshot pickles read into trace columns (see cudalab/memory_tools/trace_index.py).", -1};

PyMODINIT_FUNC PyInit__tracescan(void) {
    if (PyType_Ready(&ScannerType) < 0 || PyType_Ready(&StackRefType) < 0
            || PyType_Ready(&EntryType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&ScannerType);
    if (PyModule_AddObject(m, "Scanner", (PyObject *)&ScannerType) < 0) return NULL;
    Py_INCREF(&StackRefType);
    if (PyModule_AddObject(m, "StackRef", (PyObject *)&StackRefType) < 0) return NULL;
    return m;
}
