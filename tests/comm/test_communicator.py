"""Communicator on the simulator: construction checks, lifetime (close, abort, context
manager, garbage collection, exit, fork), and the argument checks of every operation, which
must raise before anything reaches NCCL. The seam's NCCL is the thread fake of
test_communicator_fake.py (the simulator's own NCCL has no multi-process communicators)."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

import cudalab
from cudalab.comm import communicator as communicator_module
from cudalab.comm.communicator import Communicator, live_communicators
from cudalab.errors import NcclError, StreamDeviceError
from tests.comm.test_communicator_fake import FakeNccl
from tests.helpers.interrupts import count_events, interrupt_at

UID = bytes(range(128))


@pytest.fixture
def fake(backend, monkeypatch):
    """The backend's NCCL replaced by the thread fake (ranks join at once: lonely)."""
    nccl = FakeNccl(backend, lonely=True)
    monkeypatch.setattr(backend, "nccl", lambda: nccl)
    return nccl


@pytest.fixture(autouse=True)
def _abort_leftovers():
    yield
    for comm in live_communicators():
        comm.abort()


PAIR_UID = bytes([9]) * 128  # the lonely rank 0 of 2 (another clique than UID's)


def _rank0_of_2(fake, device=0):
    return Communicator(0, 2, PAIR_UID, device=device)


# ----------------------------------------------------------------------------- construction
@pytest.mark.parametrize("args, error, match", [
    ((2, 2, UID), ValueError, r"rank 2 is not in range\(world_size=2\)"),
    ((-1, 2, UID), ValueError, r"rank -1 is not in range"),
    ((0, 0, UID), ValueError, r"world_size must be >= 1, got 0"),
    ((True, 2, UID), TypeError, r"rank must be an int"),
    ((0, 2.0, UID), TypeError, r"world_size must be an int"),
    ((0, 2, UID[:100]), ValueError, r"unique id has 100 bytes; an NCCL unique id has 128"),
    ((0, 2, UID.hex()), TypeError, r"got a str .*unique_id_from_hex"),
    ((0, 2, 12345), TypeError, r"must be 128 bytes, got int"),
])
def test_bad_construction_arguments_raise_before_nccl(fake, args, error, match):
    with pytest.raises(error, match=match):
        Communicator(*args)
    assert fake.calls == []


def test_a_device_that_does_not_exist_is_refused_before_nccl(fake):
    with pytest.raises(ValueError):
        Communicator(0, 2, UID, device=cudalab.device_count())
    assert fake.calls == []


def test_construction_on_the_simulator_says_nccl_needs_a_gpu(backend, monkeypatch):
    nccl = FakeNccl(backend)
    nccl.simulated = True
    monkeypatch.setattr(backend, "nccl", lambda: nccl)
    with pytest.raises(NcclError, match=r"needs the real NCCL and a GPU.*simulated backend "
                                        r"\(CUDALAB_SIMULATOR=1 or cudalab.use_simulator\(\)\)"):
        Communicator(0, 2, UID)
    assert nccl.calls == []  # refused before comm_init_rank (it would wait for the peers)


def test_construction_with_the_simulators_own_nccl_raises_ncclerror(backend):
    if not backend.simulated:
        pytest.skip("the simulator's own NCCL (this backend is real)")
    try:
        nccl = backend.nccl()
    except (ImportError, AttributeError, NcclError):
        pytest.skip("the simulator's NCCL is not in this checkout yet")
    assert nccl.simulated
    with pytest.raises(NcclError, match="simulated backend"):
        Communicator(0, 1, UID)


def test_nccl_that_cannot_load_raises_its_error(backend, monkeypatch):
    def missing():
        raise NcclError("NCCL cannot be loaded: nccl4py is not installed "
                        "(pip install 'cudalab[nccl]')")

    monkeypatch.setattr(backend, "nccl", missing)
    with pytest.raises(NcclError, match=r"cudalab\[nccl\]"):
        Communicator(0, 1, UID)


def test_construction_passes_device_size_id_and_rank_and_keeps_the_current_device(fake, two):
    cudalab.set_device(0)  # (two: skips where there is no device 1, as on one GPU)
    comm = Communicator(1, 2, bytearray(UID), device=1)
    assert fake.calls[0][:2] == ("comm_init_rank", (1, 2, UID, 1))
    assert (comm.rank, comm.world_size, comm.device, comm.closed) == (1, 2, 1, False)
    assert cudalab.current_device() == 0
    assert repr(comm) == "Communicator(rank=1, world_size=2, device=1)"
    assert comm in live_communicators()


def test_the_device_defaults_to_the_current_device(fake, two):
    with cudalab.device(1):
        comm = Communicator(0, 2, UID)
    assert comm.device == 1
    assert fake.calls[0][1][0] == 1


def test_from_env_reads_torchrun_variables_and_the_hex_id(fake, two):
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDALAB_NCCL_UNIQUE_ID": UID.hex()}
    comm = Communicator.from_env(environ=env)
    assert (comm.rank, comm.world_size, comm.device) == (1, 2, 1)
    assert fake.calls[0][1] == (1, 2, UID, 1)


def test_from_env_without_local_rank_uses_the_current_device(fake, two):
    env = {"RANK": "0", "WORLD_SIZE": "2"}
    with cudalab.device(1):
        comm = Communicator.from_env(unique_id=UID, environ=env)
    assert comm.device == 1


def test_from_env_names_a_missing_variable(fake):
    with pytest.raises(RuntimeError, match="WORLD_SIZE is not set"):
        Communicator.from_env(unique_id=UID, environ={"RANK": "0"})
    assert fake.calls == []


# ----------------------------------------------------------------------------- lifetime
def test_close_finalizes_then_destroys_once(fake):
    comm = _rank0_of_2(fake)
    comm.close()
    comm.close()  # idempotent
    assert fake.names() == ["comm_init_rank", "comm_finalize", "comm_destroy"]
    assert comm.closed and comm not in live_communicators()
    assert repr(comm).endswith(", closed)")


def test_a_closed_communicator_refuses_every_operation(fake):
    comm = _rank0_of_2(fake)
    comm.close()
    x = cudalab.zeros(4)
    for call in (lambda: comm.all_reduce(x), lambda: comm.broadcast(x),
                 lambda: comm.send(x, 1), lambda: comm.async_error()):
        with pytest.raises(NcclError, match=r"Communicator\.\w+\(\): Communicator\(rank=0, "
                                            r"world_size=2, device=0, closed\) is closed"):
            call()
    assert fake.collective_calls() == []


def test_abort_aborts_without_finalize(fake):
    comm = _rank0_of_2(fake)
    comm.abort()
    comm.abort()
    comm.close()
    assert fake.names() == ["comm_init_rank", "comm_abort"]
    with pytest.raises(NcclError, match="is aborted"):
        comm.all_reduce(cudalab.zeros(2))


def test_context_manager_closes_or_aborts_on_an_exception(fake):
    with Communicator(0, 2, UID) as comm:
        pass
    assert comm.closed and fake.names()[-2:] == ["comm_finalize", "comm_destroy"]
    with pytest.raises(KeyError), Communicator(0, 2, UID):
        raise KeyError("boom")
    assert fake.names()[-1] == "comm_abort"


def test_async_error_raises_ncclerror_with_the_result_name(fake):
    comm = _rank0_of_2(fake)
    assert comm.async_error() is None
    comm._comm.error = 6
    with pytest.raises(NcclError, match=r"ncclRemoteError \(6\): remote process exited") as info:
        comm.async_error()
    assert (info.value.code, info.value.name) == (6, "ncclRemoteError")


def test_close_after_an_async_error_aborts_and_raises(fake):
    comm = _rank0_of_2(fake)
    comm._comm.error = 1
    with pytest.raises(NcclError, match="ncclUnhandledCudaError"):
        comm.close()
    assert fake.names()[-1] == "comm_abort" and "comm_finalize" not in fake.names()
    assert comm.closed


def test_a_failed_finalize_aborts_and_raises(fake):
    comm = _rank0_of_2(fake)
    fake.fail_finalize = True
    with pytest.raises(NcclError, match="fake failure"):
        comm.close()
    assert fake.names()[-2:] == ["comm_finalize", "comm_abort"]
    with pytest.raises(NcclError, match=r"aborted \(close\(\) failed\)"):
        comm.all_reduce(cudalab.zeros(1))


def test_garbage_collection_destroys_an_open_communicator_with_a_warning(fake):
    comm = _rank0_of_2(fake)
    with pytest.warns(ResourceWarning, match=r"Communicator\(rank=0, world_size=2, device=0\) "
                                             r"was garbage-collected without close\(\)"):
        del comm
        gc.collect()
    assert fake.names()[-1] == "comm_destroy"
    assert live_communicators() == []


def test_the_exit_handler_closes_every_open_one_and_never_raises(fake, monkeypatch):
    monkeypatch.setattr(communicator_module, "_exiting", False)
    good = _rank0_of_2(fake)
    failed = Communicator(0, 2, bytes(128))
    failed._comm.error = 2
    communicator_module._close_all_at_exit()
    assert good.closed and failed.closed
    finalized = [c[1][0] for c in fake.calls if c[0] in ("comm_finalize", "comm_destroy")]
    assert finalized == [good_handle for good_handle in finalized if good_handle.rank == 0]
    assert fake.names().count("comm_finalize") == 1 and fake.names().count("comm_abort") == 1

    fake.fail_finalize = True  # a finalize that fails: aborted, quietly
    broken = Communicator(0, 2, bytes([1]) * 128)
    communicator_module._close_all_at_exit()
    assert broken.closed and fake.names()[-2:] == ["comm_finalize", "comm_abort"]

    fake.fail_finalize = False
    def fail_destroy(comm):
        raise NcclError("destroy failed at exit")

    monkeypatch.setattr(fake, "comm_destroy", fail_destroy)
    last = Communicator(0, 2, bytes([2]) * 128)
    communicator_module._close_all_at_exit()  # destroy raising: still quiet
    assert last.closed

    before = list(fake.calls)
    victim = Communicator(0, 2, bytes([3]) * 128)
    with warnings.catch_warnings():  # garbage collection once exiting: nothing, not even a warning
        warnings.simplefilter("error")
        victim._finalizer()
    assert fake.calls[len(before):] == fake.calls[-1:]  # only its comm_init_rank
    victim.abort()


def test_a_forked_child_forgets_its_parents_communicators(fake):
    comm = _rank0_of_2(fake)
    communicator_module._forget_after_fork()
    assert comm.closed and live_communicators() == []
    with pytest.raises(NcclError, match="parent of this forked process created it"):
        comm.all_reduce(cudalab.zeros(1))
    assert fake.names() == ["comm_init_rank"]  # nothing was finalized, destroyed or aborted


# ----------------------------------------------------------------------------- argument checks
class _Foreign:
    """Another library's CUDA array, seen only through __cuda_array_interface__."""

    def __init__(self, array):
        self._array = array
        self.__cuda_array_interface__ = array.__cuda_array_interface__


class _Strided:
    """Every other float32 of ``array`` (a strided CUDA array of another library)."""

    def __init__(self, array):
        self._array = array
        self.__cuda_array_interface__ = {"shape": (array.size // 2,), "typestr": "<f4",
                                         "data": (array.ptr, False), "version": 3,
                                         "strides": (8,), "stream": None}


def _cases(comm):
    x = cudalab.zeros(8)
    x16 = cudalab.zeros(16)
    ints = cudalab.zeros(8, dtype="int32")
    flags = cudalab.zeros(8, dtype="bool")
    cplx = cudalab.zeros(8, dtype="complex64")
    shorts = cudalab.zeros(8, dtype="int16")
    strided = _Strided(x16)
    closed_stream = cudalab.Stream(device=0)
    closed_stream.close()
    return [
        (lambda: comm.all_reduce(np.zeros(8, np.float32)), TypeError,
         r"send must be a cudalab.DeviceArray or a CUDA array .* got ndarray; host memory"),
        (lambda: comm.all_reduce([1.0, 2.0]), TypeError, r"got list"),
        (lambda: comm.all_reduce(strided), ValueError, r"send must be C-contiguous"),
        (lambda: comm.all_reduce(x, ints), TypeError, r"send and recv must have the same dtype"),
        (lambda: comm.all_reduce(x, x16), ValueError,
         r"recv must hold send's 8 elements = 8, got 16"),
        (lambda: comm.all_reduce(x, op="mean"), ValueError, r"op must be one of 'sum'"),
        (lambda: comm.all_reduce(x, op=7), ValueError, r"op must be one of"),
        (lambda: comm.all_reduce(x, op=True), ValueError, r"op must be one of"),
        (lambda: comm.all_reduce(flags), TypeError, r"op='sum' on bool"),
        (lambda: comm.all_reduce(cplx, op="max"), TypeError, r"op='max' is not defined on "
                                                             r"complex64"),
        (lambda: comm.all_reduce(shorts), TypeError, r"NCCL cannot reduce int16"),
        (lambda: comm.all_reduce(x16[0:8], x16[4:12]), ValueError,
         r"overlap without being the same buffer"),
        (lambda: comm.all_reduce(x, stream=0), TypeError, r"stream must be a cudalab.Stream"),
        (lambda: comm.all_reduce(x, stream=closed_stream), RuntimeError, r"closed"),
        (lambda: comm.all_gather(x, x), ValueError,
         r"recv must hold world_size \(2\) x send's 8 elements = 16, got 8"),
        (lambda: comm.all_gather(x, cudalab.zeros(16, dtype="float64")), TypeError,
         r"same dtype"),
        (lambda: comm.all_gather(x16[4:12], x16), ValueError,
         r"send overlaps recv but is not this rank's slice"),
        (lambda: comm.reduce_scatter(x16, x16[:4]), ValueError,
         r"send must hold world_size \(2\) x recv's 4 elements = 8, got 16"),
        (lambda: comm.reduce_scatter(x16, x16[4:12]), ValueError,
         r"recv overlaps send but is not this rank's slice"),
        (lambda: comm.broadcast(x, 1), TypeError, r"pass the root by keyword: "
                                                  r"broadcast\(array, root=1\)"),
        (lambda: comm.broadcast(x, root=2), ValueError, r"root 2 is not a rank"),
        (lambda: comm.broadcast(x, root=-1), ValueError, r"root -1 is not a rank"),
        (lambda: comm.broadcast(x, x16), ValueError, r"recv must hold send's 8"),
        (lambda: comm.reduce(x, root=5), ValueError, r"root 5 is not a rank"),
        (lambda: comm.reduce(x, 0), TypeError, r"reduce\(array, root=0\)"),
        (lambda: comm.send(x, 0), ValueError, r"peer 0 is this rank; a send to oneself"),
        (lambda: comm.send(x, 3), ValueError, r"peer 3 is not a rank"),
        (lambda: comm.send(x, "1"), TypeError, r"peer must be an int"),
        (lambda: comm.recv(np.zeros(8), 1), TypeError, r"array must be a cudalab.DeviceArray"),
    ]


def test_every_bad_operation_argument_raises_before_nccl(fake):
    comm = _rank0_of_2(fake)
    for call, error, match in _cases(comm):
        with pytest.raises(error, match=match):
            call()
    assert fake.collective_calls() == []


def _cases_on_another_device(comm):
    """The cases that need a second device: a buffer and a stream of device 1."""
    x = cudalab.zeros(8)
    other = cudalab.zeros(8, device=1)
    side = cudalab.Stream(device=1)
    return [
        (lambda: comm.all_reduce(other), ValueError,
         r"send is on cuda:1, but this rank's communicator is on cuda:0"),
        (lambda: comm.all_reduce(x, stream=side), StreamDeviceError,
         r"^Communicator.all_reduce\(\): the stream is on cuda:1, but this rank's communicator "
         r"is on cuda:0$"),
    ]


def test_a_buffer_or_stream_of_another_device_raises_before_nccl(fake, two):
    comm = _rank0_of_2(fake)
    for call, error, match in _cases_on_another_device(comm):
        with pytest.raises(error, match=match):
            call()
    assert fake.collective_calls() == []


def test_the_checks_can_fail_a_good_call_reaches_nccl(fake):
    comm = Communicator(0, 1, UID)  # one rank: the fake completes every call at once
    x = cudalab.ones(8)
    comm.all_reduce(x)
    assert fake.collective_calls()[0][0] == "all_reduce"


def test_a_foreign_cuda_array_is_used_in_place_without_a_copy(fake):
    comm = Communicator(0, 1, UID)
    x = cudalab.asarray(np.arange(6, dtype=np.float32))
    out = comm.all_reduce(_Foreign(x))
    assert isinstance(out, _Foreign)  # what was passed comes back
    name, args, _ = fake.collective_calls()[0]
    assert args[:5] == (x.ptr, x.ptr, 6, 7, 0)  # send, recv, count, ncclFloat32, ncclSum
    assert x.numpy().tolist() == [0, 1, 2, 3, 4, 5]


def test_a_read_only_dlpack_import_cannot_receive(fake):
    comm = Communicator(0, 1, UID)
    pair = _rank0_of_2(fake)
    x = cudalab.zeros(4)
    ro = cudalab.from_dlpack(x.__dlpack__(max_version=(1, 0)))
    ro_view = cudalab.array.DeviceArray._wrap(ro.ptr, ro.shape, ro.dtype, None, 0, ro.stream, ro,
                                              read_only=True)
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(ro_view)
    with pytest.raises(ValueError, match="read-only"):
        pair.recv(ro_view, 1)
    comm.all_reduce(ro_view, x)  # read-only is fine where NCCL only reads
    assert [c[0] for c in fake.collective_calls()] == ["all_reduce"]


def test_self_send_is_allowed_inside_a_group(fake):
    comm = Communicator(0, 1, UID)
    src = cudalab.asarray(np.arange(5, dtype=np.int64))
    dst = cudalab.zeros(5, dtype="int64")
    with cudalab.comm.group():
        comm.send(src, 0)
        comm.recv(dst, 0)
    assert dst.numpy().tolist() == [0, 1, 2, 3, 4]
    assert fake.names()[-4:] == ["group_start", "send", "recv", "group_end"]


# ----------------------------------------------------------------------------- Ctrl-C
def _consistent(comm):
    """The handle, the registry and the finalizer agree, and no lock is left held."""
    assert not comm._lock.locked()
    is_open = comm._comm is not None
    assert is_open == (comm in live_communicators()) == comm._finalizer.alive


def _in_lifetime_code(frame):
    return frame.f_code in (Communicator._adopt.__code__, Communicator._detach.__code__)


@pytest.mark.parametrize("opcodes", [False, True])
def test_ctrl_c_anywhere_in_close_or_abort_leaves_a_consistent_communicator(fake, deferring,
                                                                             opcodes):
    for end in ("close", "abort"):
        probe = _rank0_of_2(fake)
        n = count_events(getattr(probe, end), _in_lifetime_code, opcodes)
        assert n >= 4
        for k in range(1, n + 1):
            comm = _rank0_of_2(fake)
            returned, exc, tripped = interrupt_at(getattr(comm, end), _in_lifetime_code, k,
                                                  opcodes)
            assert tripped and (returned or isinstance(exc, KeyboardInterrupt))
            _consistent(comm)
            assert comm.closed  # the guarded part ran to its end before Ctrl-C came


@pytest.mark.parametrize("opcodes", [False, True])
def test_ctrl_c_while_a_communicator_adopts_its_handle(fake, deferring, opcodes):
    made = []

    def construct():
        made.append(Communicator(0, 2, PAIR_UID))

    n = count_events(construct, _in_lifetime_code, opcodes)
    assert n >= 4
    for k in range(1, n + 1):
        gc.collect()  # an earlier round's unreferenced communicator is destroyed now, not below
        before = len(fake.names())
        interrupt_at(construct, _in_lifetime_code, k, opcodes)
        assert fake.names()[before:] == ["comm_init_rank"]
        for comm in live_communicators() + made:
            _consistent(comm)
            assert not comm.closed
