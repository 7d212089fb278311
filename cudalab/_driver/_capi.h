/* cudalab/_driver/_capi.h: the argument parsing that cudalab's two C call modules share
 * (fastcall.c, the driver's hot calls, and ncclcall.c, the NCCL group call), so the two
 * cannot drift: driver and NCCL handles, device addresses, arity, setup()'s entry points. Static functions: each
 * module that includes it gets its own copy. Include after <Python.h>. */
#ifndef CUDALAB_DRIVER_CAPI_H
#define CUDALAB_DRIVER_CAPI_H

/* The address held by a handle: None is NULL, an int is itself, anything else goes
 * through int() (cuda.bindings' handle types and nccl4py's Comm define __int__). -1 and an
 * exception on failure (TypeError for an object without __int__, such as a str). */
static int
handle_address(PyObject *handle, void **out)
{
    if (handle == Py_None) {
        *out = NULL;
        return 0;
    }
    if (PyLong_CheckExact(handle)) {
        *out = PyLong_AsVoidPtr(handle);
        return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
    }
    PyNumberMethods *as_number = Py_TYPE(handle)->tp_as_number;
    if (as_number == NULL || as_number->nb_int == NULL) { /* (not int("0x10") on a str) */
        PyErr_Format(PyExc_TypeError, "a driver handle must be an int, None or a handle "
                     "object with __int__, got %.100s", Py_TYPE(handle)->tp_name);
        return -1;
    }
    PyObject *number = PyNumber_Long(handle);
    if (number == NULL) {
        return -1;
    }
    *out = PyLong_AsVoidPtr(number);
    Py_DECREF(number);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

/* A device address (an int: CUdeviceptr). -1 and an exception when it is not one. */
static int
device_address(PyObject *value, unsigned long long *out)
{
    *out = PyLong_AsUnsignedLongLong(value);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int
check_arity(Py_ssize_t nargs, Py_ssize_t expected, const char *name)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected, nargs);
        return -1;
    }
    return 0;
}

/* The entry points a module's setup() takes: args[0..count) as nonzero int addresses into
 * addresses. -1 and an exception (TypeError for a non-int, ValueError for 0) otherwise. */
static int
entry_point_addresses(PyObject *const *args, int count, void **addresses)
{
    for (int i = 0; i < count; i++) {
        if (!PyLong_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "setup() takes the entry points' addresses as ints");
            return -1;
        }
        addresses[i] = PyLong_AsVoidPtr(args[i]);
        if (addresses[i] == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "setup(): an entry point's address is 0");
            }
            return -1;
        }
    }
    return 0;
}

#endif /* CUDALAB_DRIVER_CAPI_H */
