"""cudalab.jiterator: torch's API and semantics, run on the simulator (numpy twins) and on a GPU.

Ports of torch's test/test_jiterator.py (extra args, bool extra args, multiple functors,
various numbers of inputs and outputs, invalid function names, non-contiguous inputs), plus
cudalab's own: twins, the simulator's error, the caches, the stream and the allocator.
"""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab import _internal
from cudalab import jiterator as jit
from tests.helpers.strided import CudaArrayInterface, strided

FUSED = "template <typename T> T my_fused_kernel(T x, T y, T alpha, T beta) " \
        "{ return alpha * x + beta * y; }"


def _up(a):
    return cudalab.asarray(a)


def test_fused_kernel_with_default_and_overridden_extras():
    f = jit._create_jit_fn(FUSED, alpha=1, beta=1)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    out = f(_up(x), _up(y))
    assert isinstance(out, cudalab.DeviceArray) and out.dtype == np.float32
    np.testing.assert_allclose(out.numpy(), x + y, rtol=1e-6)
    out = f(_up(x), _up(y), alpha=2.0, beta=-4.2)
    np.testing.assert_allclose(out.numpy(), 2.0 * x - 4.2 * y, rtol=1e-5)
    # torch copies the declared defaults on every call: an override lasts one call
    assert f.kwargs_dict == {"alpha": 1, "beta": 1}
    np.testing.assert_allclose(f(_up(x), _up(y)).numpy(), x + y, rtol=1e-6)


def test_overrides_last_one_call_as_torchs_test_extra_args():
    """torch's test_extra_args: each call's keywords start again from the declared defaults."""
    f = jit._create_jit_fn(FUSED, alpha=1, beta=1)
    x = np.arange(4, dtype=np.float32)
    y = np.full(4, 10, dtype=np.float32)
    f(_up(x), _up(y), alpha=3)
    np.testing.assert_allclose(f(_up(x), _up(y)).numpy(), x + y)
    f(_up(x), _up(y), beta=-1)
    np.testing.assert_allclose(f(_up(x), _up(y), alpha=2).numpy(), 2 * x + y)
    assert f.kwargs_dict == {"alpha": 1, "beta": 1}


def test_broadcasting_promotion_and_python_scalars():
    f = jit._create_jit_fn("template <typename T> T add3(T a, T b, T c) { return a + b + c; }")
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = np.array([10, 20, 30], dtype=np.int8)
    out = f(_up(a), _up(b), 5)
    assert out.shape == (2, 3) and out.dtype == np.int32
    np.testing.assert_array_equal(out.numpy(), a + b + 5)
    out = f(_up(a), _up(b), 0.5)  # a Python float with ints: torch's default dtype
    assert out.dtype == np.float32
    np.testing.assert_allclose(out.numpy(), a + b + 0.5)
    h = np.array([1.5, 2.5], dtype=np.float16)
    out = f(_up(h), 2.5, 1)  # float16 stays float16 with Python scalars
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out.numpy(), (h.astype(np.float32) + 3.5).astype(np.float16))


@pytest.mark.parametrize("layout", ["transposed", "offset", "every_other", "broadcast_row"])
def test_noncontiguous_inputs(layout):
    f = jit._create_jit_fn(FUSED, alpha=1, beta=1)
    host = np.arange(64, dtype=np.float32)
    if layout == "transposed":
        x, xt, keep = strided(host, (4, 4), (4, 16))
    elif layout == "offset":
        x, xt, keep = strided(host, (3, 5), (20, 4), offset=3)
    elif layout == "every_other":
        x, xt, keep = strided(host, (16,), (8,), offset=1)
    else:
        x, xt, keep = strided(host, (4, 4), (0, 4))
    assert not x.is_contiguous() or layout == "offset"
    y = np.full(xt.shape, 0.25, dtype=np.float32)
    out = f(x, _up(y), alpha=2, beta=1)
    assert out.shape == xt.shape and out.is_contiguous()
    np.testing.assert_array_equal(out.numpy(), 2 * xt + y)


def test_bool_extra_args():
    f = jit._create_jit_fn("template <typename T> T conditional(T x, T mask, bool is_train) "
                           "{ return is_train ? x * mask : x; }", is_train=False)
    x = np.arange(5, dtype=np.float32)
    mask = np.array([1, 0, 1, 0, 1], dtype=np.float32)
    np.testing.assert_array_equal(f(_up(x), _up(mask)).numpy(), x)
    np.testing.assert_array_equal(f(_up(x), _up(mask), is_train=True).numpy(), x * mask)


@pytest.mark.parametrize("num_inputs", [1, 5, 8])
def test_various_num_inputs(num_inputs):
    names = [f"i{k}" for k in range(num_inputs)]
    code = (f"template <typename T> T sum_{num_inputs}({', '.join('T ' + n for n in names)}) "
            f"{{ return {' + '.join(names)}; }}")
    f = jit._create_jit_fn(code)
    hosts = [np.arange(10, dtype=np.float64) * (k + 1) for k in range(num_inputs)]
    np.testing.assert_array_equal(f(*[_up(h) for h in hosts]).numpy(), sum(hosts))


@pytest.mark.parametrize("num_outputs", [1, 4, 8])
def test_various_num_outputs(num_outputs):
    outs = ", ".join(f"T& out{k}" for k in range(num_outputs))
    body = " ".join(f"out{k} = x + {k};" for k in range(num_outputs))
    f = jit._create_multi_output_jit_fn(
        f"template <typename T> void multi(T x, {outs}) {{ {body} }}", num_outputs)
    x = np.arange(6, dtype=np.float32)
    result = f(_up(x))
    if num_outputs == 1:  # torch: one output is returned as is, even by reference
        assert isinstance(result, cudalab.DeviceArray)
        result = (result,)
    assert isinstance(result, tuple) and len(result) == num_outputs
    for k, r in enumerate(result):
        np.testing.assert_array_equal(r.numpy(), x + k)


def test_return_by_value_needs_one_output():
    with pytest.raises(AssertionError, match="Return by value only works for single output"):
        jit._JittedFunction(FUSED, return_by_ref=False, num_outputs=2)


def test_too_many_inputs_and_undeclared_kwargs():
    f = jit._create_jit_fn(FUSED, alpha=1, beta=1)
    x = _up(np.ones(3, np.float32))
    with pytest.raises(AssertionError, match="up to 8 tensor inputs, got 9"):
        f(*[x] * 9)
    with pytest.raises(KeyError, match="gamma is not declared in function definition"):
        f(x, x, gamma=2)


@pytest.mark.parametrize("code", [
    "template <typename T> T my _kernel(T x) { return x; }",
    "template <typename T> Tmy_kernel(T x) { return x; }",
    "T my_kernel(T x) { return x; }",
])
def test_invalid_function_name(code):
    with pytest.raises(Exception, match="Couldn't parse code"):
        jit._create_jit_fn(code)


def test_multiple_functors_need_a_twin_on_the_simulator():
    code = """
    template <typename T> T fn(T x, T mask) { return x * mask; }
    template <typename T> T main_fun(T x, T mask, T y) { return fn(x, mask) + y; }
    """
    f = jit._create_jit_fn(code)
    assert f.kernel_name == "main_fun"  # the last templated function is the entry point
    x, m, y = (_up(np.arange(4, dtype=np.float32) + k) for k in range(3))
    if _internal.backend().simulated:
        with pytest.raises(RuntimeError, match=r"calls fn\(\).*Pass a numpy twin: sim="):
            f(x, m, y)
    out = f(x, m, y, sim=lambda x, mask, y: x * mask + y)
    ref = np.arange(4) * (np.arange(4) + 1) + np.arange(4) + 2
    np.testing.assert_array_equal(out.numpy(), ref)


def test_twin_receives_extras_by_name():
    seen = {}

    def twin(x, alpha, beta):
        seen.update(alpha=alpha, beta=beta, dtype=x.dtype)
        return alpha * x + beta

    f = jit._create_jit_fn("template <typename T> T g(T x, T alpha, T beta) "
                           "{ return alpha * x + beta; }", sim=twin, alpha=2, beta=0.5)
    out = f(_up(np.arange(3, dtype=np.float16)))
    np.testing.assert_array_equal(out.numpy(), (2 * np.arange(3) + 0.5).astype(np.float16))
    if _internal.backend().simulated:
        assert seen["alpha"] == 2 and seen["beta"] == 0.5 and seen["dtype"] == np.float32


def test_foreign_inputs_through_the_cuda_array_interface():
    f = jit._create_jit_fn("template <typename T> T sq(T x) { return x * x; }")
    base = _up(np.arange(5, dtype=np.int64))
    foreign = CudaArrayInterface(**base.__cuda_array_interface__)
    np.testing.assert_array_equal(f(foreign).numpy(), np.arange(5) ** 2)
    with pytest.raises(TypeError, match="argument 0: expected a CUDA device but found cpu"):
        f(np.arange(5))


def test_outputs_come_from_the_caching_allocator_on_the_current_stream():
    f = jit._create_jit_fn("template <typename T> T twice(T x) { return x + x; }")
    x = _up(np.arange(1024, dtype=np.float32))
    launches = []
    _internal.launch_observers.append(lambda name, dev, stream, g, b: launches.append(stream))
    try:
        s = cudalab.Stream()
        before = cudalab.memory_allocated()
        with cudalab.stream(s):
            out = f(x)
        assert cudalab.memory_allocated() == before + 4096
        assert out.stream == s and launches == [s]
        s.synchronize()
        np.testing.assert_array_equal(out.numpy(), 2 * np.arange(1024))
    finally:
        _internal.launch_observers.pop()


def test_one_plan_per_call_shape():
    f = jit._create_jit_fn("template <typename T> T inc(T x) { return x + T(1); }")
    a = _up(np.zeros(8, np.float32))
    for _ in range(3):
        f(a)
    f(_up(np.zeros(8, np.int32)))
    assert len(f._function._plans) == 2


def test_empty_inputs_launch_nothing():
    f = jit._create_jit_fn("template <typename T> T inc(T x) { return x + T(1); }")
    launches = []
    _internal.launch_observers.append(lambda *args: launches.append(args))
    try:
        out = f(cudalab.empty((0, 3), dtype=np.float32))
    finally:
        _internal.launch_observers.pop()
    assert out.shape == (0, 3) and launches == []


def test_mismatched_shapes_refused_and_complex_promoted():
    f = jit._create_jit_fn(FUSED, alpha=1, beta=1)
    with pytest.raises(RuntimeError, match="must match the size"):
        f(_up(np.ones(3, np.float32)), _up(np.ones(4, np.float32)))
    z = f(_up(np.full(3, 1j, np.complex64)), _up(np.ones(3, np.float32)))
    assert z.dtype == np.complex64
    np.testing.assert_array_equal(z.numpy(), np.full(3, 1 + 1j, np.complex64))


def test_contiguous_inputs_get_the_vectorised_kernel_and_a_grid_that_fills_the_gpu():
    f = jit._create_jit_fn("template <typename T> T neg(T x) { return -x; }")
    n = 1 << 22
    x = cudalab.empty(n, dtype=np.float32)
    launches = []
    _internal.launch_observers.append(lambda name, dev, s, grid, block: launches.append(
        (name, grid, block)))
    try:
        f(x)
        f(x[1:])  # a 4-byte offset: the unaligned twin
    finally:
        _internal.launch_observers.pop()
    (name, grid, block), (name_unaligned, grid_unaligned, _) = launches
    vec = 1 if _internal.backend().simulated else 4  # (the simulator has no vector loads)
    assert name.startswith(f"neg_v{vec}_") and name_unaligned.startswith("neg_v1_")
    assert block == (256, 1, 1)
    assert grid == (n // vec // 256, 1, 1)  # one thread per vector: one pass over the data
    assert grid_unaligned == (-(-(n - 1) // 256), 1, 1)  # one per element


# --------------------------------------------------------------------------- arity and outputs
def test_too_few_or_too_many_inputs_fail_with_the_compiler_log():
    """torch compiles ``name<T>(inputs..., extras...)``: a wrong count fails to compile, with
    NVRTC's log (cudalab compiles on the simulator too), never a launch failure or silence."""
    f = jit._create_jit_fn(FUSED, alpha=1, beta=1)
    x = _up(np.ones(3, np.float32))
    with pytest.raises(cudalab.KernelCompileError, match="no instance of function template"):
        f(x)
    with pytest.raises(cudalab.KernelCompileError, match="no instance of function template"):
        f(x, x, x)
    np.testing.assert_array_equal(f(x, x).numpy(), np.full(3, 2, np.float32))  # still works


def test_at_most_8_outputs_as_torch():
    with pytest.raises(ValueError, match="up to 8 outputs, got 9"):
        jit._create_multi_output_jit_fn(
            "template <typename T> void f(T x, T& a) { a = x; }", num_outputs=9)
    with pytest.raises(ValueError, match="up to 8 outputs"):
        jit._create_multi_output_jit_fn(
            "template <typename T> void f(T x, T& a) { a = x; }", num_outputs=10**6)


def test_an_extra_argument_named_sim_is_an_extra_argument():
    f = jit._create_jit_fn("template <typename T> T scaled(T x, T sim) { return sim * x; }",
                           sim=2.0)
    assert f.kwargs_dict == {"sim": 2.0} and f.sim is None
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(f(_up(x)).numpy(), 2 * x)
    np.testing.assert_array_equal(f(_up(x), sim=3.0).numpy(), 3 * x)
    np.testing.assert_array_equal(f(_up(x)).numpy(), 2 * x)
    # a callable is still the numpy twin, here given to one call
    np.testing.assert_array_equal(f(_up(x), sim=lambda x, sim: sim * x).numpy(), 2 * x)
    # without an extra named sim, sim=None still means "no twin for this call"
    g = jit._create_jit_fn("template <typename T> T twice(T x) { return x + x; }")
    np.testing.assert_array_equal(g(_up(x), sim=None).numpy(), 2 * x)


@pytest.mark.parametrize("value", ["2.0", b"2", "x"])
def test_a_string_extra_argument_raises_type_error(value):
    with pytest.raises(TypeError, match="must be a number"):
        jit._create_jit_fn(FUSED, alpha=value, beta=1)
    f = jit._create_jit_fn(FUSED, alpha=1, beta=1)
    x = _up(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="must be a number"):
        f(x, x, alpha=value)


def test_simulator_compiles_the_body_with_nvrtc_and_shows_its_log():
    """A body that does not compile fails with NVRTC's log on the simulator as on a GPU."""
    x = _up(np.ones(3, np.float32))
    bad_syntax = jit._create_jit_fn("template <typename T> T f(T x) { return x +; }")
    with pytest.raises(cudalab.KernelCompileError,
                       match=r"(?s)jiterator_code\(1\): error: expected an expression"):
        bad_syntax(x)
    undefined = jit._create_jit_fn("template <typename T> T g(T x) { return x + y; }")
    with pytest.raises(cudalab.KernelCompileError, match='identifier "y" is undefined'):
        undefined(x)
    # code that compiles, with a twin for the simulator, still runs
    loops = jit._create_jit_fn("template <typename T> T h(T x) { T s = 0; for (int i = 0; "
                               "i < 3; ++i) s += x; return s; }", sim=lambda x: 3 * x)
    np.testing.assert_array_equal(loops(x).numpy(), np.full(3, 3, np.float32))
