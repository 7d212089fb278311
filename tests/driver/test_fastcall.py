"""The C twin of the hot driver calls (:mod:`cudalab._driver.fastcall`, setup.py builds it).

Part (a) runs everywhere: the module's argument checks, which come before any driver call, and
its refusal to run before ``setup()``. Part (b) (``@pytest.mark.gpu``) checks on the real
driver that the real backend binds it, that a launch, an event record, a stream wait and a
copy (with its context check) give the same results and the same errors through it as through cuda.bindings
(``CUDALAB_FASTCALL=0``), and that a closed stream is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from cudalab._driver.base import ClosedHandle

fastcall = pytest.importorskip("cudalab._driver.fastcall",
                               reason="the optional C extension is not built here")
ROOT = Path(__file__).resolve().parents[2]


# ============================================================================ (a) everywhere
def test_argument_errors_come_before_the_driver():
    launch = fastcall.launch_kernel
    with pytest.raises(TypeError, match="takes 6 arguments"):
        launch(0, (1, 1, 1), (1, 1, 1), 0, None)
    with pytest.raises(TypeError, match="grid must be a tuple of 3"):
        launch(0, [1, 1, 1], (1, 1, 1), 0, None, 0)
    with pytest.raises(TypeError, match="block must be a tuple of 3"):
        launch(0, (1, 1, 1), (1, 1), 0, None, 0)
    with pytest.raises(OverflowError):
        launch(0, (-1, 1, 1), (1, 1, 1), 0, None, 0)
    with pytest.raises(OverflowError, match="grid does not fit in 32 bits"):
        launch(0, (2**32, 1, 1), (1, 1, 1), 0, None, 0)
    with pytest.raises(OverflowError, match="shared_mem"):
        launch(0, (1, 1, 1), (1, 1, 1), 2**32, None, 0)
    with pytest.raises(TypeError):
        launch("f", (1, 1, 1), (1, 1, 1), 0, None, 0)  # a str is not a handle
    with pytest.raises(TypeError, match="takes 2 arguments"):
        fastcall.event_record(0)
    with pytest.raises(TypeError):
        fastcall.event_record(0, "stream")
    with pytest.raises(TypeError, match="takes 3 arguments"):
        fastcall.stream_wait_event(0, 0)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        fastcall.graph_launch(0)
    with pytest.raises(TypeError):
        fastcall.graph_launch("exec", None)
    with pytest.raises(OverflowError):
        fastcall.stream_wait_event(0, 0, -1)


def test_a_closed_handle_raises_its_own_error():
    closed = ClosedHandle("<cudalab.Stream closed>")
    with pytest.raises(RuntimeError, match="closed"):
        fastcall.launch_kernel(0, (1, 1, 1), (1, 1, 1), 0, closed, 0)
    with pytest.raises(RuntimeError, match="closed"):
        fastcall.event_record(0, closed)
    with pytest.raises(RuntimeError, match="closed"):
        fastcall.stream_wait_event(closed, 0, 0)


def test_elapsed_times_check_their_arguments_first():
    times = fastcall.event_elapsed_times
    with pytest.raises(TypeError, match="takes 2 arguments"):
        times([1])
    with pytest.raises(TypeError, match="starts must be a sequence"):
        times(5, [1])
    with pytest.raises(ValueError, match="differ in length"):
        times([1], [2, 3])
    with pytest.raises(TypeError, match="a driver handle must be"):
        times(["x"], [1])
    with pytest.raises(TypeError, match="addresses as ints"):
        fastcall.bind_event_elapsed_time("a")
    with pytest.raises(ValueError, match="address is 0"):
        fastcall.bind_event_elapsed_time(0)


# cuEventElapsedTime stood in for by a ctypes callback: each pair read in order, the times as
# the driver gives them, and a failure stops there with the times before it; and
# event_record's answers (a fake cuEventRecord).
_FAKE_ELAPSED = textwrap.dedent("""
    import ctypes, json
    from cudalab._driver import fastcall
    calls = []
    def elapsed(out, start, end):
        calls.append([start or 0, end or 0])
        if start == 0x66:
            return 700
        out[0] = ((end or 0) - (start or 0)) / 4.0
        return 0
    f = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p,
                         ctypes.c_void_p)(elapsed)
    try:
        fastcall.event_elapsed_times([1], [2])
    except RuntimeError as exc:
        before = str(exc)
    fastcall.bind_event_elapsed_time(ctypes.cast(f, ctypes.c_void_p).value)
    ok = fastcall.event_elapsed_times([0x10, 0x20, 0x30], [0x12, 0x2A, 0x31])
    n_ok = len(calls)
    failed = fastcall.event_elapsed_times((0x10, 0x66, 0x30), (0x12, 0x70, 0x31))
    empty = fastcall.event_elapsed_times([], [])
    # event_record: (0,) on success (one shared tuple), (CUresult,) on failure
    P = ctypes.c_void_p
    record = ctypes.CFUNCTYPE(ctypes.c_int, P, P)(lambda event, stream: 0 if event else 400)
    unused = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)
    entry = [ctypes.cast(unused, P).value] * 7
    entry[1] = ctypes.cast(record, P).value
    fastcall.setup(*entry, lambda code, call: None)
    records = [fastcall.event_record(1, 2), fastcall.event_record(0, 2)]
    shared = fastcall.event_record(1, 2) is fastcall.event_record(3, 4)
    print("RESULT " + json.dumps([before, ok, n_ok, failed, calls[n_ok:], empty, records,
                                  shared]))
""")


def test_elapsed_times_read_every_pair_and_stop_at_a_failure_and_record_answers():
    out = subprocess.run([sys.executable, "-c", _FAKE_ELAPSED], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    before, ok, n_ok, failed, failed_calls, empty, records, shared = json.loads(
        line[len("RESULT "):])
    assert "setup() has not given" in before
    assert ok == [0, [0.5, 2.5, 0.25]] and n_ok == 3
    assert failed == [700, [0.5]] and failed_calls == [[0x10, 0x12], [0x66, 0x70]]
    assert empty == [0, []]
    assert records == [[0], [400]] and shared


def test_setup_refuses_bad_addresses_without_changing_anything():
    with pytest.raises(TypeError, match="addresses as ints"):
        fastcall.setup("a", 1, 2, 3, 4, 5, 6, print)
    with pytest.raises(ValueError, match="address is 0"):
        fastcall.setup(1, 2, 3, 4, 5, 0, 6, print)
    with pytest.raises(TypeError, match="error_for must be callable"):
        fastcall.setup(1, 2, 3, 4, 5, 6, 7, None)
    with pytest.raises(TypeError, match="takes 8 arguments"):
        fastcall.setup(1, 2, 3, 4, 5, 6, 7)


def test_context_and_copy_calls_check_their_arguments_first():
    with pytest.raises(TypeError, match="takes 0 arguments"):
        fastcall.ctx_get_current(1)
    with pytest.raises(TypeError, match="a driver handle must be"):
        fastcall.ctx_set_current("ctx")
    with pytest.raises(OverflowError):
        fastcall.memcpy_async(-1, 0, 4, None)
    with pytest.raises(TypeError):
        fastcall.memcpy_async(0, "src", 4, None)
    with pytest.raises(OverflowError):
        fastcall.memcpy_async(0, 0, -4, None)
    with pytest.raises(TypeError, match="takes 4 arguments"):
        fastcall.memcpy_async(0, 0, 4)
    ordered = fastcall.ordered_copy
    with pytest.raises(TypeError, match="takes 9 arguments"):
        ordered(0, 0, 4, 0, 0, 0, 0, 0)
    with pytest.raises(OverflowError):
        ordered(-1, 0, 4, 0, 0, 0, 0, 0, 0)
    with pytest.raises(TypeError, match="a driver handle must be"):
        ordered(0, 0, 4, "ctx", 0, 0, 0, 0, 0)
    with pytest.raises(OverflowError):
        ordered(0, 0, -4, 0, 0, 0, 0, 0, 0)


# The driver stood in for by ctypes callbacks (C function pointers into Python that record
# each call): ordered_copy's eight calls, their order and arguments, and what a failure does.
# In a fresh process, because setup() changes the module's global entry points.
_FAKE_DRIVER = textwrap.dedent("""
    import ctypes, json
    from cudalab._driver import fastcall
    log, fail, state = [], {}, {"ctx": 0x99}
    P = ctypes.c_void_p
    def record(event, stream):
        log.append(["record", event or 0, stream or 0, state["ctx"]])
        return fail.get("record " + hex(event or 0), 0)
    def wait(stream, event, flags):
        log.append(["wait", stream or 0, event or 0, state["ctx"]])
        return fail.get("wait", 0)
    def copy(dst, src, nbytes, stream):
        log.append(["copy", dst, src, nbytes, stream or 0, state["ctx"]])
        return fail.get("copy", 0)
    def get(out):
        out[0] = state["ctx"]; return 0
    def set_(ctx):
        state["ctx"] = ctx or 0; return fail.get("set " + hex(ctx or 0), 0)
    def unused(*args):
        raise SystemExit("not expected")
    FUNCTIONS = [
        ctypes.CFUNCTYPE(ctypes.c_int, P, *([ctypes.c_uint] * 7), P, P, P)(unused),
        ctypes.CFUNCTYPE(ctypes.c_int, P, P)(record),
        ctypes.CFUNCTYPE(ctypes.c_int, P, P, ctypes.c_uint)(wait),
        ctypes.CFUNCTYPE(ctypes.c_int, P, P)(unused),
        ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(P))(get),
        ctypes.CFUNCTYPE(ctypes.c_int, P)(set_),
        ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_size_t,
                         P)(copy)]
    fastcall.setup(*[ctypes.cast(f, P).value for f in FUNCTIONS], lambda code, call: None)
    results = []
    for failing in (None, "copy", "set 0x20", "record 0xe1"):
        log.clear()
        fail.clear()
        if failing:
            fail[failing] = 700
        # dst, src, nbytes, copy (context, stream, event), peer (context, stream, event)
        answer = fastcall.ordered_copy(0xD000, 0x5000, 1024, 0x10, 0x51, 0xE1, 0x20, 0x52,
                                        0xE2)
        results.append({"answer": answer, "log": list(log), "ctx": state["ctx"]})
    log.clear(); fail.clear()
    answer = fastcall.ordered_copy(0xD000, 0x5000, 1024, 0x10, 0x51, 0xE1, 0x20, 0x52, 0xE2,
                                    False)  # join=False: the peer's wait is the caller's
    results.append({"answer": answer, "log": list(log), "ctx": state["ctx"]})
    try:
        fastcall.ordered_copy(0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0)
    except TypeError as exc:
        results.append(str(exc))
    print("RESULT " + json.dumps(results))
""")


def test_ordered_copy_makes_torchs_eight_calls_and_restores_the_context():
    out = subprocess.run([sys.executable, "-c", _FAKE_DRIVER], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    ok, copy_failed, set_failed, record_failed, unjoined, too_many = json.loads(
        line[len("RESULT "):])
    # the peer's stream first: its event recorded in its context, waited on by the copy
    # stream, the copy, the copy's event waited on by the peer's stream; then the caller's
    # context again
    assert ok["answer"] is None
    assert ok["log"] == [["record", 0xE2, 0x52, 0x20], ["wait", 0x51, 0xE2, 0x10],
                         ["copy", 0xD000, 0x5000, 1024, 0x51, 0x10],
                         ["record", 0xE1, 0x51, 0x10], ["wait", 0x52, 0xE1, 0x20]]
    assert ok["ctx"] == 0x99
    # a failure stops the sequence there, says which call failed, and still restores
    assert copy_failed["answer"] == ["cuMemcpyAsync", 700]
    assert [e[0] for e in copy_failed["log"]] == ["record", "wait", "copy"]
    assert set_failed["answer"] == ["cuCtxSetCurrent", 700] and set_failed["log"] == []
    assert record_failed["answer"] == ["cuEventRecord", 700]
    assert [e[0] for e in record_failed["log"]] == ["record", "wait", "copy", "record"]
    assert copy_failed["ctx"] == set_failed["ctx"] == record_failed["ctx"] == 0x99
    # without the join: the same calls less the peer stream's wait, the context put back
    assert unjoined["answer"] is None and unjoined["log"] == ok["log"][:4]
    assert unjoined["ctx"] == 0x99
    assert "ordered_copy() takes 9 arguments (11 given)" in too_many


SIGNATURE = ("p", "i4", "u4", "i8", "u8", "f4", "f8")
VALUE_SETS = [
    (0x7F0000001000, -7, 0xFFFFFFFE, -(2**40), 2**64 - 3, 1.5, -0.1),  # plain: packed in C
    (0, -(2**31), 0, -(2**63), 0, -0.0, float("inf")),
    (2**64 - 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, 3.4e38, float("nan")),
    [1, 2, 3, 4, 5, 6.0, 7.0],  # a list
    (np.uint64(9), np.int32(-1), True, np.int64(3), np.uint8(4), 1, np.float32(0.5)),  # set()
]
BAD_VALUE_SETS = [
    (0, 2**31, 0, 0, 0, 0.0, 0.0),  # i4 out of range
    (-1, 0, 0, 0, 0, 0.0, 0.0),  # negative pointer
    (0, 0, 0, 0, 0, 1e300, 0.0),  # beyond float32
    (0, 0, 0, 0, 0, "x", 0.0),  # not a number
    (0, 0, 0, 0, 0, 0.0),  # one missing
]


def _slots(args) -> bytes:
    return bytes(args._buf.tobytes())


def _launch_packed(args, values):
    """launch_packed on a NULL function: the values are packed, then the call fails (not set
    up in this process, or the driver refuses the NULL function)."""
    with pytest.raises(RuntimeError):  # (CudaError is a RuntimeError)
        fastcall.launch_packed(0, (1, 1, 1), (1, 1, 1), 0, None, args, values)


def test_launch_packed_writes_what_set_writes():
    from cudalab._driver.cuda import CudaKernelArgs

    for values in VALUE_SETS:
        ours, theirs = CudaKernelArgs(SIGNATURE), CudaKernelArgs(SIGNATURE)
        _launch_packed(ours, values)
        theirs.set(*values)
        assert _slots(ours) == _slots(theirs), values
    empty = CudaKernelArgs(())
    _launch_packed(empty, ())
    assert empty.native == (0, empty.native[1], b"")


def test_launch_packed_programmatic_writes_what_set_writes():
    """The programmatic launch shares launch_packed's packing (one body in C)."""
    from cudalab._driver.cuda import CudaKernelArgs

    for values in VALUE_SETS:
        ours, theirs = CudaKernelArgs(SIGNATURE), CudaKernelArgs(SIGNATURE)
        with pytest.raises(RuntimeError):
            fastcall.launch_packed_programmatic(0, (1, 1, 1), (1, 1, 1), 0, None, ours, values)
        theirs.set(*values)
        assert _slots(ours) == _slots(theirs), values
    with pytest.raises(TypeError, match="takes 7 arguments"):
        fastcall.launch_packed_programmatic(0, (1, 1, 1), (1, 1, 1), 0, None)
    with pytest.raises(TypeError, match="takes 1 arguments"):
        fastcall.bind_launch_kernel_ex()
    with pytest.raises((TypeError, ValueError)):
        fastcall.bind_launch_kernel_ex(0)


def test_launch_packed_raises_what_set_raises():
    from cudalab._driver.cuda import CudaKernelArgs

    for values in BAD_VALUE_SETS:
        args = CudaKernelArgs(SIGNATURE)
        with pytest.raises(Exception) as expected:
            args.set(*values)
        with pytest.raises(type(expected.value)) as got:
            fastcall.launch_packed(0, (1, 1, 1), (1, 1, 1), 0, None, args, values)
        assert str(got.value) == str(expected.value)
    with pytest.raises(ValueError, match="takes 0 argument"):
        fastcall.launch_packed(0, (1, 1, 1), (1, 1, 1), 0, None, CudaKernelArgs(()), (1,))
    with pytest.raises(AttributeError):  # not a CudaKernelArgs
        fastcall.launch_packed(0, (1, 1, 1), (1, 1, 1), 0, None, object(), ())


def test_calls_before_setup_raise_instead_of_calling_null():
    # In a fresh process nothing has called setup() (cudalab binds it when CUDA initialises).
    code = textwrap.dedent("""
        from cudalab._driver import fastcall
        from cudalab._driver.cuda import CudaKernelArgs
        for call, args in ((fastcall.launch_kernel, (0, (1, 1, 1), (1, 1, 1), 0, None, 0)),
                           (fastcall.event_record, (0, None)),
                           (fastcall.stream_wait_event, (None, 0, 0)),
                           (fastcall.launch_packed, (0, (1, 1, 1), (1, 1, 1), 0, None,
                                                      CudaKernelArgs(("u8",)), (1,))),
                           (fastcall.launch_packed_programmatic,
                            (0, (1, 1, 1), (1, 1, 1), 0, None, CudaKernelArgs(("u8",)), (1,))),
                           (fastcall.graph_launch, (0, None)),
                           (fastcall.ctx_get_current, ()),
                           (fastcall.ctx_set_current, (0,)),
                           (fastcall.memcpy_async, (0, 0, 4, None)),
                           (fastcall.ordered_copy, (0, 0, 4, 0, None, 0, 0, None, 0))):
            try:
                call(*args)
            except RuntimeError as exc:
                print("refused:", exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 10 and all("setup() has not given" in line for line in lines), lines


# ============================================================================ (b) real GPU
@pytest.mark.gpu
def test_the_real_backend_binds_it():
    import cudalab
    from cudalab._driver import cuda as C

    cudalab.init()
    if os.environ.get("CUDALAB_FASTCALL", "1") == "0":
        pytest.skip("CUDALAB_FASTCALL=0 in this environment")
    assert C.FAST.launch_kernel is fastcall.launch_kernel
    assert C.FAST.event_record is fastcall.event_record
    assert C.FAST.stream_wait_event is fastcall.stream_wait_event
    from cudalab import _internal

    assert _internal.backend().launch_values is fastcall.launch_packed
    assert _internal.backend().launch_values_programmatic is fastcall.launch_packed_programmatic
    assert _internal.backend().graph_launch is fastcall.graph_launch
    assert C.FAST.ctx_get_current is fastcall.ctx_get_current
    assert C.FAST.ctx_set_current is fastcall.ctx_set_current
    assert C.FAST.memcpy_async is fastcall.memcpy_async
    assert C.FAST.ordered_copy is fastcall.ordered_copy
    assert C.FAST.event_elapsed_times is fastcall.event_elapsed_times
    ctx = _internal.backend().context_int(0)  # (retained on first use: this test may run first)
    assert fastcall.ctx_set_current(ctx) == 0 and fastcall.ctx_get_current() == ctx


_SAME_RESULTS = textwrap.dedent("""
    import json, os
    import numpy as np
    import cudalab
    from cudalab import _internal
    from cudalab._driver import cuda as C
    from cudalab._kernels.fill import fill_kernel
    from cudalab.errors import CudaError

    x = cudalab.zeros(1000, dtype="uint32")
    s1, s2 = cudalab.Stream(), cudalab.Stream()
    ev = cudalab.Event()
    with cudalab.stream(s1):
        x.fill_(0x1234)                       # the u16 fill kernel (a launch)
        x[10:20].fill_(7)                     # a view's address
        ev.record()                           # cuEventRecord
    s2.wait_event(ev)                         # cuStreamWaitEvent
    with cudalab.stream(s2):
        y = x + 1                             # an elementwise launch, ordered after s1
    kernel = fill_kernel(4)
    kernel.launch(1, 32, (x, 5, 3))           # a DeviceArray argument
    z = cudalab.zeros(4, dtype="int64")
    g = cudalab.CUDAGraph()
    with cudalab.graph(g):
        z.fill_(11)
    z.fill_(0)
    g.replay()                                # cuGraphLaunch
    w = cudalab.empty(1000, dtype="uint32")
    w.copy_(x)                                # cuMemcpyAsync (after a context check)
    error = None
    try:                                      # too many threads: the driver refuses
        state_backend = _internal.backend()
        function = kernel.get_function(0)
        args = state_backend.make_args(kernel.signature).set(x.data_ptr(), 1, 1)
        state_backend.launch(function, (1, 1, 1), (2048, 1, 1), 0,
                             cudalab.current_stream().handle, args)
    except CudaError as exc:
        error = [exc.name, exc.call]
    cudalab.synchronize()
    print(json.dumps({"fast": C.FAST.launch_kernel is not None, "x": x.tolist(), "y": y.tolist(),
                      "z": z.tolist(), "w": w.tolist(), "error": error,
                      "copy_fast": C.FAST.memcpy_async is not None}))
""")


@pytest.mark.gpu
def test_same_results_and_errors_with_and_without_it():
    runs = {}
    for flag in ("1", "0"):
        env = dict(os.environ, CUDALAB_FASTCALL=flag)
        env.pop("CUDALAB_SIMULATOR", None)
        out = subprocess.run([sys.executable, "-c", _SAME_RESULTS], capture_output=True,
                             text=True, timeout=300, cwd=ROOT, env=env)
        assert out.returncode == 0, out.stderr
        import json

        runs[flag] = json.loads(out.stdout.splitlines()[-1])
    assert runs["1"]["fast"] is True and runs["0"]["fast"] is False
    expect = np.full(1000, 0x1234, np.uint32)
    expect[10:20] = 7
    expect[:3] = 5
    for run in runs.values():
        np.testing.assert_array_equal(run["x"], expect)
        np.testing.assert_array_equal(run["y"][20:], expect[20:] + 1)
        assert run["error"] == ["CUDA_ERROR_INVALID_VALUE", "cuLaunchKernel"]
        assert run["z"] == [11] * 4
        np.testing.assert_array_equal(run["w"], expect)
    assert runs["1"]["copy_fast"] is True and runs["0"]["copy_fast"] is False
    assert runs["1"] == dict(runs["0"], fast=True, copy_fast=True)


_TWO_GPUS = textwrap.dedent("""
    import json
    import numpy as np
    import cudalab
    from cudalab import _internal, comm, nccl
    from cudalab._driver import cuda as C

    x = cudalab.asarray(np.arange(6 * 4, dtype=np.float32).reshape(6, 4), device=0)
    y = cudalab.asarray(np.full((6, 4), 2.0, np.float32), device=1)
    s1 = cudalab.Stream(device=1)
    with cudalab.stream(s1):
        y.fill_(3.0)                              # queued on a side stream of device 1
        z = cudalab.empty((6, 4), dtype=np.float32, device=1)
        z.copy_(x)                                # a peer copy, ordered after s1's fill
        z += y                                    # and before this, on s1
    s1.synchronize()
    parts = comm.scatter(x, devices=[1, 0])
    gathered = comm.gather([x, y], destination=1)
    summed = comm.reduce_add([x, y], destination=0)
    copies = comm.broadcast(x, devices=[0, 1])
    a = [cudalab.asarray(np.full(8, float(d + 1), np.float32), device=d) for d in (0, 1)]
    nccl.all_reduce(a)
    nccl.broadcast(a, root=1)
    cudalab.synchronize(0); cudalab.synchronize(1)
    seam = _internal.backend().nccl()
    print(json.dumps({
        "ordered_copy": C.FAST.ordered_copy is not None,
        "group_call": seam._group_call is not None,
        "z": z.tolist(), "parts": [p.tolist() for p in parts], "gathered": gathered.tolist(),
        "summed": summed.tolist(), "copies": [c.tolist() for c in copies],
        "all_reduce": [t.tolist() for t in a]}))
""")


@pytest.mark.gpu
def test_peer_copies_and_nccl_groups_same_with_and_without_it():
    pytest.importorskip("nccl.bindings", reason="needs nccl4py")
    import cudalab

    if cudalab.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    runs = {}
    for flag in ("1", "0"):
        env = dict(os.environ, CUDALAB_FASTCALL=flag, NCCL_NVLS_ENABLE="0")
        env.pop("CUDALAB_SIMULATOR", None)
        out = subprocess.run([sys.executable, "-c", _TWO_GPUS], capture_output=True,
                             text=True, timeout=300, cwd=ROOT, env=env)
        assert out.returncode == 0, out.stderr
        runs[flag] = json.loads(out.stdout.splitlines()[-1])
    assert runs["1"]["ordered_copy"] and runs["1"]["group_call"]
    assert not runs["0"]["ordered_copy"] and not runs["0"]["group_call"]
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    for run in runs.values():
        np.testing.assert_array_equal(run["z"], x + 3.0)
        np.testing.assert_array_equal(run["parts"][0], x[:3])
        np.testing.assert_array_equal(run["parts"][1], x[3:])
        np.testing.assert_array_equal(run["gathered"], np.concatenate([x, np.full((6, 4), 3.0)]))
        np.testing.assert_array_equal(run["summed"], x + 3.0)
        np.testing.assert_array_equal(run["copies"][1], x)
        assert run["all_reduce"] == [[3.0] * 8, [3.0] * 8]
    assert runs["1"] == dict(runs["0"], ordered_copy=True, group_call=True)


@pytest.mark.gpu
def test_elapsed_times_match_the_bindings():
    """The batch gives what cuda.bindings' cuEventElapsedTime gives, pair by pair, and its
    status for an event never recorded."""
    import cudalab
    from cudalab import _internal
    from cudalab._driver import cuda_api as A

    cudalab.init()
    batch = _internal.fast_paths().event_elapsed_times
    if batch is None or os.environ.get("CUDALAB_FASTCALL", "1") == "0":
        pytest.skip("event_elapsed_times is not bound here")
    events = [cudalab.Event(enable_timing=True) for _ in range(5)]
    x = cudalab.zeros(1 << 20, dtype="float32")
    for ev in events:
        x.fill_(1.5)
        ev.record()
    events[-1].synchronize()
    handles = [_internal.event_handle(ev) for ev in events]
    status, times = batch(handles[:-1], handles[1:])
    expected = [A.cuEventElapsedTime(a, b) for a, b in zip(handles[:-1], handles[1:])]
    assert status == 0 and times == [ms for _err, ms in expected]
    never = cudalab.Event(enable_timing=True)
    _internal.create_event(never, 0)
    err, _ms = A.cuEventElapsedTime(handles[0], _internal.event_handle(never))
    status, times = batch([handles[0], handles[0]], [handles[1], _internal.event_handle(never)])
    assert status == int(err) != 0 and times == [expected[0][1]]
