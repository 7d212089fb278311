"""The C group call of the NCCL seam (:mod:`cudalab._driver.ncclcall`, setup.py builds it).

NCCL and the driver are stood in for by ctypes callbacks (C function pointers into Python
that record each call), so the C logic runs everywhere, CI included: the order of the calls,
each rank's context, the dispatch to the five collectives, what happens on a failure at
each stage (the group is still closed, the caller's context still put back), the argument
checks, and the seam (:class:`cudalab._driver.nccl.RealNccl`) over it with a stand-in for
nccl4py: its checks, its errors with NCCL's own message, and its fallback to nccl4py's Python
calls. Each scenario runs in a fresh process, because ``setup()`` changes the module's global
entry points. The real NCCL path is exercised by tests/nccl/test_gpu.py and tests/comm on GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cudalab._driver import base

ncclcall = pytest.importorskip("cudalab._driver.ncclcall",
                               reason="the optional C extension is not built here")
ROOT = Path(__file__).resolve().parents[2]

# The stand-ins, shared by every scenario: `log` records each call, `fail` says what fails.
_FAKES = textwrap.dedent("""
    import ctypes, json, sys
    from cudalab._driver import ncclcall as nc

    log, fail, state = [], {}, {"ctx": 0x99}
    P = ctypes.c_void_p
    GROUP = ctypes.CFUNCTYPE(ctypes.c_int)
    ALL_REDUCE = ctypes.CFUNCTYPE(ctypes.c_int, P, P, ctypes.c_size_t, ctypes.c_int,
                                  ctypes.c_int, P, P)
    BROADCAST = ALL_REDUCE  # (send, recv, count, dtype, root, comm, stream)
    REDUCE = ctypes.CFUNCTYPE(ctypes.c_int, P, P, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, P, P)
    ALL_GATHER = ctypes.CFUNCTYPE(ctypes.c_int, P, P, ctypes.c_size_t, ctypes.c_int, P, P)
    REDUCE_SCATTER = ALL_REDUCE
    CTX_GET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(P))
    CTX_SET = ctypes.CFUNCTYPE(ctypes.c_int, P)

    def answer(key):
        return fail.get(key, 0)

    def group_start():
        log.append(["start"]); return answer("start")
    def group_end():
        log.append(["end"]); return answer("end")
    def make(name):
        def call(*args):
            args = [a or 0 for a in args]  # (NULL arrives as None)
            log.append([name, *args]); return answer((name, args[-2]))
        return call
    def ctx_get(out):
        log.append(["get"]); out[0] = state["ctx"]; return answer("get")
    def ctx_set(ctx):
        ctx = ctx or 0
        log.append(["set", ctx])
        code = answer(("set", ctx))
        if not code:
            state["ctx"] = ctx
        return code

    FUNCTIONS = [GROUP(group_start), GROUP(group_end), ALL_REDUCE(make("all_reduce")),
                 BROADCAST(make("broadcast")), REDUCE(make("reduce")),
                 ALL_GATHER(make("all_gather")), REDUCE_SCATTER(make("reduce_scatter")),
                 CTX_GET(ctx_get), CTX_SET(ctx_set)]
    ADDRESSES = [ctypes.cast(f, P).value for f in FUNCTIONS]
    NAMES = ["ncclGroupStart", "ncclGroupEnd", "ncclAllReduce", "ncclBroadcast", "ncclReduce",
             "ncclAllGather", "ncclReduceScatter"]

    def rank(i):
        # (context, send, recv, comm, stream) of rank i
        return (0x10 + i, 0x1000 * (i + 1), 0x1000 * (i + 1) + 8, 0xC0 + i, 0x50 + i)

    def emit(**values):
        print("RESULT " + json.dumps(values))
""")


def _run(body: str, env: dict[str, str] | None = None, seam: bool = False) -> dict:
    code = _FAKES + (_SEAM if seam else "") + textwrap.dedent(body)
    full_env = dict(os.environ, **(env or {}))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=full_env)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


# ============================================================================ the C module
def test_the_numbering_is_the_seams():
    assert (ncclcall.CALL_ALL_REDUCE, ncclcall.CALL_BROADCAST, ncclcall.CALL_REDUCE,
            ncclcall.CALL_ALL_GATHER, ncclcall.CALL_REDUCE_SCATTER) == (
        base.NCCL_CALL_ALL_REDUCE, base.NCCL_CALL_BROADCAST, base.NCCL_CALL_REDUCE,
        base.NCCL_CALL_ALL_GATHER, base.NCCL_CALL_REDUCE_SCATTER)
    assert len(base.NCCL_CALL_NAMES) == 5
    stages = [ncclcall.STAGE_SAVE_CONTEXT, ncclcall.STAGE_GROUP_START, ncclcall.STAGE_SET_CONTEXT,
              ncclcall.STAGE_CALL, ncclcall.STAGE_GROUP_END, ncclcall.STAGE_RESTORE_CONTEXT]
    assert len(set(stages)) == 6


def test_before_setup_it_refuses_instead_of_calling_null():
    result = _run("""
        try:
            nc.group_call(0, 1, 7, 0, 0, (rank(0),))
        except RuntimeError as exc:
            emit(error=str(exc))
    """)
    assert "setup() has not given NCCL's entry points" in result["error"]


def test_setup_refuses_bad_addresses_and_keeps_none():
    result = _run("""
        errors = []
        for args in (ADDRESSES[:8], ADDRESSES[:8] + [0], ADDRESSES[:8] + ["x"]):
            try:
                nc.setup(*args)
            except (TypeError, ValueError) as exc:
                errors.append(type(exc).__name__)
        try:
            nc.group_call(0, 1, 7, 0, 0, (rank(0),))
        except RuntimeError:
            errors.append("still not set up")
        emit(errors=errors, log=log)
    """)
    assert result["errors"] == ["TypeError", "ValueError", "TypeError", "still not set up"]
    assert result["log"] == []


def test_one_group_with_each_ranks_context_then_the_callers_back():
    result = _run("""
        nc.setup(*ADDRESSES)
        answer_ = nc.group_call(nc.CALL_ALL_REDUCE, 256, 7, 0, 0, (rank(0), rank(1)))
        emit(answer=answer_, log=log, ctx=state["ctx"])
    """)
    assert result["answer"] is None
    assert result["log"] == [
        ["get"], ["start"],
        ["set", 0x10], ["all_reduce", 0x1000, 0x1008, 256, 7, 0, 0xC0, 0x50],
        ["set", 0x11], ["all_reduce", 0x2000, 0x2008, 256, 7, 0, 0xC1, 0x51],
        ["end"], ["set", 0x99]]
    assert result["ctx"] == 0x99


def test_each_collective_gets_its_own_arguments():
    result = _run("""
        nc.setup(*ADDRESSES)
        for call in range(5):
            nc.group_call(call, 64, 9, 2, 1, (rank(0),))
        emit(calls=[entry for entry in log if entry[0] not in ("get", "set", "start", "end")])
    """)
    send, recv, comm, stream = 0x1000, 0x1008, 0xC0, 0x50
    assert result["calls"] == [
        ["all_reduce", send, recv, 64, 9, 2, comm, stream],   # op
        ["broadcast", send, recv, 64, 9, 1, comm, stream],    # root
        ["reduce", send, recv, 64, 9, 2, 1, comm, stream],    # op, root
        ["all_gather", send, recv, 64, 9, comm, stream],      # neither
        ["reduce_scatter", send, recv, 64, 9, 2, comm, stream]]


def test_a_failed_call_still_closes_the_group_and_restores_the_context():
    result = _run("""
        nc.setup(*ADDRESSES)
        fail[("reduce", 0xC1)] = 5  # rank 1's ncclReduce: ncclInvalidUsage
        answer_ = nc.group_call(nc.CALL_REDUCE, 8, 7, 0, 0, (rank(0), rank(1), rank(2)))
        emit(answer=answer_, log=[e[:2] for e in log], ctx=state["ctx"])
    """)
    assert result["answer"] == [ncclcall.STAGE_CALL, 1, 5]
    assert result["log"] == [["get"], ["start"], ["set", 0x10], ["reduce", 0x1000],
                             ["set", 0x11], ["reduce", 0x2000], ["end"], ["set", 0x99]]
    assert result["ctx"] == 0x99  # rank 2 was never called; the caller's context is back


@pytest.mark.parametrize("failing, stage, rank, expected_log", [
    ('"end"', "STAGE_GROUP_END", -1, ["get", "start", "set", "all_reduce", "end", "set"]),
    ('"start"', "STAGE_GROUP_START", -1, ["get", "start"]),
    ('("set", 0x10)', "STAGE_SET_CONTEXT", 0, ["get", "start", "set", "end", "set"]),
    ('"get"', "STAGE_SAVE_CONTEXT", -1, ["get"]),
])
def test_every_stage_reports_where_it_failed(failing, stage, rank, expected_log):
    result = _run(f"""
        nc.setup(*ADDRESSES)
        fail[{failing}] = 3
        answer_ = nc.group_call(nc.CALL_ALL_REDUCE, 8, 7, 0, 0, (rank(0),))
        emit(answer=answer_, log=[e[0] for e in log], ctx=state["ctx"])
    """)
    assert result["answer"] == [getattr(ncclcall, stage), rank, 3]
    # a group once opened is closed; a context once changed is put back
    assert result["log"] == expected_log
    assert result["ctx"] == 0x99


def test_a_big_clique_and_bad_arguments():
    result = _run("""
        nc.setup(*ADDRESSES)
        big = nc.group_call(0, 1, 7, 0, 0, tuple(rank(i) for i in range(20)))  # heap path
        calls = sum(1 for e in log if e[0] == "all_reduce")
        del log[:]
        errors = []
        for args in ((0, 1, 7, 0, 0), (5, 1, 7, 0, 0, ()), (0, 1, 7, 0, 0, [rank(0)]),
                     (0, 1, 7, 0, 0, (rank(0)[:4],)), (0, 1, 7, 0, 0, ((0, 1, 2, 3, 4),)),
                     (0, 1, 7, 0, 0, ((1, 1, 2, 0, 4),)), (0, -1, 7, 0, 0, (rank(0),)),
                     (0, 1, 2**40, 0, 0, (rank(0),)), (0, 1, 7, 0, 0, (("ctx", 1, 2, 3, 4),))):
            try:
                nc.group_call(*args)
                errors.append(None)
            except (TypeError, ValueError, OverflowError) as exc:
                errors.append(type(exc).__name__)
        emit(big=big, calls=calls, errors=errors, log=log)
    """)
    assert result["big"] is None and result["calls"] == 20
    assert result["errors"] == ["TypeError", "ValueError", "TypeError", "TypeError",
                                "ValueError", "ValueError", "OverflowError", "OverflowError",
                                "TypeError"]
    assert result["log"] == []  # every refusal came before NCCL or the driver was called


# ============================================================================ the seam over it
# A stand-in for nccl4py's raw bindings and its loader, and a backend with the two context
# entry points: RealNccl then binds the C group call to the ctypes stand-ins above.
_SEAM = textwrap.dedent("""
    import types
    bindings = types.ModuleType("nccl.bindings.nccl")
    class NCCLError(Exception):
        def __init__(self, status):
            super().__init__(status); self.status = status
    class Comm:
        def __init__(self, value=0):
            self.value = value
        def __int__(self):
            return self.value
    bindings.NCCLError, bindings.Comm = NCCLError, Comm
    bindings.get_error_string = lambda code: f"text of {code}"
    bindings.get_last_error = lambda comm: "the last error"
    bindings.get_version = lambda: 22805
    def python_call(name):
        def call(*args):
            log.append(["python " + name])
        return call
    for name in ("group_start", "group_end", "all_reduce", "broadcast", "reduce", "all_gather",
                 "reduce_scatter"):
        setattr(bindings, name, python_call(name))
    loader = types.ModuleType("nccl.bindings._internal.nccl")
    loader._inspect_function_pointer = lambda name: dict(zip(NAMES, ADDRESSES))[name]
    for module_name, module in (("nccl", types.ModuleType("nccl")),
                                ("nccl.bindings", types.ModuleType("nccl.bindings")),
                                ("nccl.bindings.nccl", bindings),
                                ("nccl.bindings._internal",
                                 types.ModuleType("nccl.bindings._internal")),
                                ("nccl.bindings._internal.nccl", loader)):
        sys.modules[module_name] = module
    sys.modules["nccl.bindings"].nccl = bindings
    sys.modules["nccl"].bindings = sys.modules["nccl.bindings"]
    sys.modules["nccl.bindings._internal"].nccl = loader
    sys.modules["nccl.bindings"]._internal = sys.modules["nccl.bindings._internal"]

    class Backend:
        def entry_point(self, symbol):
            return {b"cuCtxGetCurrent": ADDRESSES[7], b"cuCtxSetCurrent": ADDRESSES[8]}[symbol]
        def context_int(self, device):
            return 0x10 + device
        def handle_int(self, handle):
            return 0 if handle is None else int(handle)
        def set_context(self, device):
            log.append(["python set_context", device])

    from cudalab._driver import base
    from cudalab._driver.cuda_api import FAST
    if FAST.ctx_get_current is None:  # (no driver here: the Python path's context calls)
        FAST.ctx_get_current = lambda: state["ctx"]
        FAST.ctx_set_current = lambda ctx: state.__setitem__("ctx", ctx) or 0
    from cudalab._driver.nccl import RealComm, RealNccl
    from cudalab.errors import CudaError, NcclError
    seam = RealNccl(Backend())
    comms = [RealComm(Comm(0xC0 + i), i, i, 2, 0x10 + i) for i in range(2)]
    sends, recvs = [0x1000, 0x2000], [0x1008, 0]

    def reduce():
        seam.group_call(base.NCCL_CALL_REDUCE, 8, base.NCCL_FLOAT32, base.NCCL_SUM, 0, sends,
                        recvs, comms, [0x50, 0x51])

    def error_of(fn):
        try:
            fn()
        except (NcclError, CudaError) as exc:
            return [type(exc).__name__, str(exc), getattr(exc, "code", None)]
        return None
""")


#: The seam's 2-rank reduce over the stand-ins: the caller's context saved, each rank's call
#: in its context inside one group, the context put back.
REDUCE_GROUP_LOG = [["get"], ["start"],
                    ["set", 0x10], ["reduce", 0x1000, 0x1008, 8, 7, 0, 0, 0xC0, 0x50],
                    ["set", 0x11], ["reduce", 0x2000, 0, 8, 7, 0, 0, 0xC1, 0x51],
                    ["end"], ["set", 0x99]]


def _assert_ncclss_reduce_error(error):
    """A failed rank-1 reduce (code 4) raised as NcclError with NCCL's own message."""
    kind, message, code = error
    assert kind == "NcclError" and code == 4
    assert message == "ncclReduce: ncclInvalidArgument (4): text of 4 - the last error"


def test_the_seam_binds_it_and_raises_ncclerror_with_ncclss_message():
    result = _run("""
        bound = seam._group_call is nc.group_call
        reduce()
        ok = [e for e in log]
        del log[:]
        fail[("reduce", 0xC1)] = 4
        call_error = error_of(reduce)
        del fail[("reduce", 0xC1)]
        fail[("set", 0x11)] = 201  # CUDA_ERROR_INVALID_CONTEXT on rank 1's context
        context_error = error_of(reduce)
        del fail[("set", 0x11)]
        del log[:]
        bad_count = error_of(lambda: seam.group_call(
            base.NCCL_CALL_REDUCE, -1, base.NCCL_FLOAT32, 0, 0, sends, recvs, comms, [0, 0]))
        bad_root = error_of(lambda: seam.group_call(
            base.NCCL_CALL_REDUCE, 8, base.NCCL_FLOAT32, 0, 2, sends, recvs, comms, [0, 0]))
        refused_log = list(log)
        comms[1].comm = None
        destroyed = error_of(reduce)
        emit(bound=bound, ok=ok, call_error=call_error, context_error=context_error,
             bad_count=bad_count, bad_root=bad_root, refused_log=refused_log,
             destroyed=destroyed)
    """, seam=True)
    assert result["bound"] is True
    assert result["ok"] == REDUCE_GROUP_LOG
    _assert_ncclss_reduce_error(result["call_error"])
    kind, message, _code = result["context_error"]
    assert kind == "CudaError" and "cuCtxSetCurrent" in message
    assert "count must be an int >= 0" in result["bad_count"][1]
    assert "root 2 is not a rank of this 2-rank communicator" in result["bad_root"][1]
    assert result["refused_log"] == []  # refused before NCCL or the driver
    assert "was destroyed or aborted" in result["destroyed"][1]


def test_without_the_c_call_the_seam_makes_nccl4pys_python_calls():
    result = _run("""
        reduce()
        emit(bound=seam._group_call is not None, log=log)
    """, env={"CUDALAB_FASTCALL": "0"}, seam=True)
    assert result["bound"] is False
    assert [entry for entry in result["log"] if entry[0].startswith("python")] == [["python group_start"], ["python set_context", 0],
                             ["python reduce"], ["python set_context", 1], ["python reduce"],
                             ["python group_end"]]


def test_a_group_runner_passes_each_ranks_context_and_comm_read_once():
    result = _run("""
        run = seam.group_runner(comms)
        run(base.NCCL_CALL_REDUCE, 8, base.NCCL_FLOAT32, base.NCCL_SUM, 0, sends, recvs,
            [0x50, 0x51])
        ok = [e for e in log]
        del log[:]
        fail[("reduce", 0xC1)] = 4
        call_error = error_of(lambda: run(base.NCCL_CALL_REDUCE, 8, base.NCCL_FLOAT32,
                                          base.NCCL_SUM, 0, sends, recvs, [0x50, 0x51]))
        del fail[("reduce", 0xC1)]
        failed_log = [e for e in log]
        del log[:]
        comms[1].comm = None  # destroyed after the runner was made
        destroyed = error_of(lambda: run(base.NCCL_CALL_REDUCE, 8, base.NCCL_FLOAT32,
                                         base.NCCL_SUM, 0, sends, recvs, [0x50, 0x51]))
        emit(ok=ok, call_error=call_error, failed_log=failed_log, destroyed=destroyed,
             destroyed_log=log)
    """, seam=True)
    # the same calls as group_call's
    assert result["ok"] == REDUCE_GROUP_LOG
    _assert_ncclss_reduce_error(result["call_error"])
    assert result["failed_log"][-2:] == [["end"], ["set", 0x99]]  # group closed, context back
    assert "was destroyed or aborted" in result["destroyed"][1]
    assert result["destroyed_log"] == []  # a stale ncclComm_t never reaches NCCL


def test_a_group_runner_falls_back_to_the_checked_group_call():
    result = _run("""
        checked = []
        seam.group_call = lambda *args: checked.append(len(args))
        nameless = [RealComm(Comm(0), i, i, 2, 0x10 + i) for i in range(2)]  # no ncclComm_t
        seam.group_runner(nameless)(base.NCCL_CALL_ALL_REDUCE, 8, base.NCCL_FLOAT32,
                                    base.NCCL_SUM, 0, sends, sends, [0, 0])
        seam.group_runner([comms[0], "not a comm"])(base.NCCL_CALL_ALL_REDUCE, 8,
                                                    base.NCCL_FLOAT32, base.NCCL_SUM, 0,
                                                    sends, sends, [0, 0])
        emit(checked=checked, log=log)
    """, seam=True)
    assert result["checked"] == [9, 9]  # group_call(call, ..., comms, streams) both times
    assert result["log"] == []
