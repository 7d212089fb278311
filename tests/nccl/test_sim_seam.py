"""The simulator's NCCL seam (:class:`cudalab._driver.sim.nccl.SimulatedNccl`), on private
simulator backends (never the session's): cliques, groups and their matching rules, values,
send/receive, stream order with a paused stream, and handle lifetimes."""

from __future__ import annotations

import numpy as np
import pytest

from cudalab._driver.base import (
    NCCL_AVG,
    NCCL_BFLOAT16,
    NCCL_CALL_ALL_REDUCE,
    NCCL_CALL_BROADCAST,
    NCCL_CALL_REDUCE,
    NCCL_FLOAT32,
    NCCL_INT32,
    NCCL_MAX,
    NCCL_SUM,
    NCCL_UNIQUE_ID_SIZE,
)
from cudalab._driver.sim import SimulatorBackend, SimulatorConfig
from cudalab._driver.sim.nccl import SIMULATED_VERSION
from cudalab.errors import NcclError


def _backend(devices: int = 2) -> SimulatorBackend:
    b = SimulatorBackend(SimulatorConfig.from_env({"CUDALAB_SIMULATOR_DEVICES": str(devices),
                                                   "CUDALAB_SIMULATOR_MEMORY": "64MiB"}))
    b.init()
    return b


@pytest.fixture
def b():
    return _backend(2)


def _put(b, device, values, dtype=np.float32):
    host = np.asarray(values, dtype=dtype)
    ptr = b.mem_alloc(device, max(host.nbytes, 1))
    b.array(ptr, host.dtype, host.size)[:] = host
    return ptr


def _get(b, ptr, count, dtype=np.float32):
    return b.array(ptr, dtype, count).copy()


def test_version_and_unique_id(b):
    n = b.nccl()
    assert n.simulated and n.version() == SIMULATED_VERSION == 22805
    a, c = n.unique_id(), n.unique_id()
    assert isinstance(a, bytes) and len(a) == NCCL_UNIQUE_ID_SIZE and a != c


def test_comm_init_all_ranks_and_devices(b):
    n = b.nccl()
    comms = n.comm_init_all([1, 0])
    assert [n.comm_rank(c) for c in comms] == [0, 1]
    assert [n.comm_device(c) for c in comms] == [1, 0]
    assert [n.comm_count(c) for c in comms] == [2, 2]
    assert n.comm_async_error(comms[0]) == 0


@pytest.mark.parametrize("devices, text", [([0, 0], "pairwise distinct"),
                                           ([0, 5], "does not exist"), ([], "no devices")])
def test_comm_init_all_refuses_bad_devices(b, devices, text):
    with pytest.raises(NcclError, match=text) as info:
        b.nccl().comm_init_all(devices)
    assert info.value.code == 4 and info.value.name == "ncclInvalidArgument"


def test_comm_init_rank_needs_the_real_nccl(b):
    n = b.nccl()
    with pytest.raises(NcclError, match="multi-process communicators need the real NCCL") as info:
        n.comm_init_rank(0, 2, n.unique_id(), 0)
    assert info.value.name == "ncclInvalidUsage"


def test_all_reduce_in_a_group_and_in_place(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    x = [_put(b, d, [1, 2, 3]) for d in (0, 1)]
    y = [_put(b, d, [0, 0, 0]) for d in (0, 1)]
    n.group_start()
    for d in (0, 1):
        n.all_reduce(x[d], y[d], 3, NCCL_FLOAT32, NCCL_SUM, comms[d], b.null_stream(d))
    n.group_end()
    for d in (0, 1):
        assert _get(b, y[d], 3).tolist() == [2, 4, 6]
    n.group_start()
    for d in (0, 1):  # in place, max
        n.all_reduce(y[d], y[d], 3, NCCL_FLOAT32, NCCL_MAX, comms[d], b.null_stream(d))
    n.group_end()
    assert _get(b, y[1], 3).tolist() == [2, 4, 6]


def test_nested_groups_launch_at_the_outermost_end(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    x = [_put(b, d, [d + 1.0]) for d in (0, 1)]
    n.group_start()
    n.group_start()
    n.all_reduce(x[0], x[0], 1, NCCL_FLOAT32, NCCL_SUM, comms[0], b.null_stream(0))
    n.group_end()
    assert _get(b, x[0], 1).tolist() == [1.0]  # not yet: the outer group is open
    n.all_reduce(x[1], x[1], 1, NCCL_FLOAT32, NCCL_SUM, comms[1], b.null_stream(1))
    n.group_end()
    assert _get(b, x[0], 1).tolist() == _get(b, x[1], 1).tolist() == [3.0]


def test_multi_rank_collective_outside_a_group_is_refused(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    x = _put(b, 0, [1.0])
    with pytest.raises(NcclError, match="outside ncclGroupStart/ncclGroupEnd.*waits forever"):
        n.all_reduce(x, x, 1, NCCL_FLOAT32, NCCL_SUM, comms[0], b.null_stream(0))


def test_single_rank_clique_runs_outside_a_group(b):
    n = b.nccl()
    (comm,) = n.comm_init_all([1])
    x = _put(b, 1, [5.0, 6.0])
    n.all_reduce(x, x, 2, NCCL_FLOAT32, NCCL_AVG, comm, b.null_stream(1))
    assert _get(b, x, 2).tolist() == [5.0, 6.0]


def test_group_with_a_missing_rank_would_hang(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    x = _put(b, 0, [1.0])
    n.group_start()
    n.all_reduce(x, x, 1, NCCL_FLOAT32, NCCL_SUM, comms[0], b.null_stream(0))
    with pytest.raises(NcclError, match=r"rank 0 .* posted 1 .* rank 1 .* posted 0.*wait "
                                        "forever") as info:
        n.group_end()
    assert info.value.name == "ncclInvalidUsage"
    assert _get(b, x, 1).tolist() == [1.0]  # nothing of the group ran


@pytest.mark.parametrize("second", [dict(count=2), dict(op=NCCL_MAX), dict(dtype=NCCL_INT32)])
def test_group_with_mismatched_collectives(b, second):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    x = [_put(b, d, [1.0, 2.0]) for d in (0, 1)]
    n.group_start()
    n.all_reduce(x[0], x[0], 1, NCCL_FLOAT32, NCCL_SUM, comms[0], b.null_stream(0))
    args = dict(count=1, dtype=NCCL_FLOAT32, op=NCCL_SUM) | second
    n.all_reduce(x[1], x[1], args["count"], args["dtype"], args["op"], comms[1],
                 b.null_stream(1))
    with pytest.raises(NcclError, match="differs across ranks: rank 0 posted all_reduce"):
        n.group_end()


def test_group_with_collectives_in_different_orders(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    x = [_put(b, d, [1.0]) for d in (0, 1)]
    n.group_start()
    n.all_reduce(x[0], x[0], 1, NCCL_FLOAT32, NCCL_SUM, comms[0], b.null_stream(0))
    n.broadcast(x[0], x[0], 1, NCCL_FLOAT32, 0, comms[0], b.null_stream(0))
    n.broadcast(x[1], x[1], 1, NCCL_FLOAT32, 0, comms[1], b.null_stream(1))
    n.all_reduce(x[1], x[1], 1, NCCL_FLOAT32, NCCL_SUM, comms[1], b.null_stream(1))
    with pytest.raises(NcclError, match="collective #1 of the group differs"):
        n.group_end()


def test_group_end_without_start(b):
    with pytest.raises(NcclError, match="without a matching ncclGroupStart"):
        b.nccl().group_end()


def test_send_recv_pairs(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    src = _put(b, 0, [7, 8, 9], np.int32)
    dst = _put(b, 1, [0, 0, 0], np.int32)
    n.group_start()
    n.send(src, 3, NCCL_INT32, 1, comms[0], b.null_stream(0))
    n.recv(dst, 3, NCCL_INT32, 0, comms[1], b.null_stream(1))
    n.group_end()
    assert _get(b, dst, 3, np.int32).tolist() == [7, 8, 9]


def test_unmatched_send_would_hang(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    src = _put(b, 0, [1.0])
    n.group_start()
    n.send(src, 1, NCCL_FLOAT32, 1, comms[0], b.null_stream(0))
    with pytest.raises(NcclError, match="1 send.* 0 matching receive"):
        n.group_end()
    n.group_start()
    n.send(src, 1, NCCL_FLOAT32, 1, comms[0], b.null_stream(0))
    n.recv(_put(b, 1, [0.0, 0.0]), 2, NCCL_FLOAT32, 0, comms[1], b.null_stream(1))
    with pytest.raises(NcclError, match="count and type must match"):
        n.group_end()


def test_buffers_and_streams_are_checked_before_anything_runs(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    on_1 = _put(b, 1, [1.0])
    with pytest.raises(NcclError, match="allocated on device 1 mismatches with NCCL device 0"):
        n.all_reduce(on_1, on_1, 1, NCCL_FLOAT32, NCCL_SUM, comms[0], b.null_stream(0))
    on_0 = _put(b, 0, [1.0])
    with pytest.raises(NcclError, match="not on the communicator's device 0"):
        n.all_reduce(on_0, on_0, 1, NCCL_FLOAT32, NCCL_SUM, comms[0], b.null_stream(1))
    with pytest.raises(NcclError, match="runs|not inside|live"):
        n.all_reduce(on_0, on_0, 1 << 20, NCCL_FLOAT32, NCCL_SUM, comms[0], b.null_stream(0))
    for bad in (dict(count=-1), dict(dtype=12), dict(op=5)):
        args = dict(count=1, dtype=NCCL_FLOAT32, op=NCCL_SUM) | bad
        with pytest.raises(NcclError) as info:
            n.all_reduce(on_0, on_0, args["count"], args["dtype"], args["op"], comms[0],
                         b.null_stream(0))
        assert info.value.code == 4
    with pytest.raises(NcclError, match="root 2 is not a rank"):
        n.broadcast(on_0, on_0, 1, NCCL_FLOAT32, 2, comms[0], b.null_stream(0))


def test_finalize_destroy_abort_invalidate_the_handle(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    x = _put(b, 0, [1.0])
    n.group_start()
    for c in comms:
        n.comm_finalize(c)
    n.group_end()
    with pytest.raises(NcclError, match="finalized") as info:
        n.all_reduce(x, x, 1, NCCL_FLOAT32, NCCL_SUM, comms[0], b.null_stream(0))
    assert info.value.name == "ncclInvalidArgument"
    n.comm_destroy(comms[0])
    n.comm_abort(comms[1])
    for c in comms:
        with pytest.raises(NcclError, match="destroyed or aborted"):
            n.comm_rank(c)
        with pytest.raises(NcclError, match="destroyed or aborted"):
            n.comm_destroy(c)


def test_a_paused_stream_delays_the_collective(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    s0, s1 = b.stream_create(0), b.stream_create(1)
    x = [_put(b, d, [d + 1.0, 10.0]) for d in (0, 1)]
    b.pause_stream(s1)
    b.memset_d32_async(1, x[1], 0x40000000, 1, s1)  # 2.0, queued before the collective on s1
    n.group_start()
    n.all_reduce(x[0], x[0], 2, NCCL_FLOAT32, NCCL_SUM, comms[0], s0)
    n.all_reduce(x[1], x[1], 2, NCCL_FLOAT32, NCCL_SUM, comms[1], s1)
    n.group_end()
    assert not b.stream_query(s0)  # rank 0 waits for rank 1's stream
    assert _get(b, x[0], 2).tolist() == [1.0, 10.0]
    with pytest.raises(RuntimeError, match="would wait forever.*paused"):
        b.stream_synchronize(s0)
    b.resume_stream(s1)
    b.stream_synchronize(s0)
    b.stream_synchronize(s1)
    # rank 1's earlier fill (2.0) was seen: the inputs were read after it
    assert _get(b, x[0], 2).tolist() == _get(b, x[1], 2).tolist() == [3.0, 20.0]


def test_later_work_on_any_stream_sees_the_result(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    s0, s1 = b.stream_create(0), b.stream_create(1)
    x = [_put(b, d, [1.0]) for d in (0, 1)]
    out = _put(b, 0, [0.0])
    b.pause_stream(s0)
    n.group_start()
    n.all_reduce(x[0], x[0], 1, NCCL_FLOAT32, NCCL_SUM, comms[0], s0)
    n.all_reduce(x[1], x[1], 1, NCCL_FLOAT32, NCCL_SUM, comms[1], s1)
    n.group_end()
    b.memcpy_async(0, out, x[0], 4, s0)  # after the collective on rank 0's stream
    b.resume_stream(s0)
    b.stream_synchronize(s0)
    assert _get(b, out, 1).tolist() == [2.0]


def test_reduce_scatter_all_gather_broadcast_reduce_on_four_devices():
    b = _backend(4)
    n = b.nccl()
    comms = n.comm_init_all([0, 1, 2, 3])
    data = [np.arange(8, dtype=np.float32) * (r + 1) for r in range(4)]
    src = [_put(b, r, data[r]) for r in range(4)]
    part = [_put(b, r, np.zeros(2)) for r in range(4)]
    whole = [_put(b, r, np.zeros(8)) for r in range(4)]
    n.group_start()
    for r in range(4):
        n.reduce_scatter(src[r], part[r], 2, NCCL_FLOAT32, NCCL_SUM, comms[r], b.null_stream(r))
    n.group_end()
    total = sum(data)
    for r in range(4):
        assert _get(b, part[r], 2).tolist() == total[2 * r:2 * r + 2].tolist()
    n.group_start()
    for r in range(4):
        n.all_gather(part[r], whole[r], 2, NCCL_FLOAT32, comms[r], b.null_stream(r))
    n.group_end()
    for r in range(4):
        assert _get(b, whole[r], 8).tolist() == total.tolist()
    n.group_start()
    for r in range(4):
        n.broadcast(src[r], src[r], 8, NCCL_FLOAT32, 2, comms[r], b.null_stream(r))
    n.group_end()
    for r in range(4):
        assert _get(b, src[r], 8).tolist() == data[2].tolist()
    n.group_start()
    for r in range(4):
        n.reduce(whole[r], part[r] if r == 3 else 0, 2, NCCL_FLOAT32, NCCL_MAX, 3, comms[r],
                 b.null_stream(r))
    n.group_end()
    assert _get(b, part[3], 2).tolist() == total[:2].tolist()


def test_bfloat16_and_integer_avg(b):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    x = [_put(b, d, [1.5, -2.0], ml_dtypes.bfloat16) for d in (0, 1)]
    n.group_start()
    for d in (0, 1):
        n.all_reduce(x[d], x[d], 2, NCCL_BFLOAT16, NCCL_SUM, comms[d], b.null_stream(d))
    n.group_end()
    assert _get(b, x[1], 2, ml_dtypes.bfloat16).astype(np.float32).tolist() == [3.0, -4.0]
    y = [_put(b, d, [-3, 5] if d == 0 else [0, 0], np.int32) for d in (0, 1)]
    n.group_start()
    for d in (0, 1):
        n.all_reduce(y[d], y[d], 2, NCCL_INT32, NCCL_AVG, comms[d], b.null_stream(d))
    n.group_end()
    assert _get(b, y[0], 2, np.int32).tolist() == [-1, 2]  # truncated toward zero


def test_a_failed_call_poisons_its_group(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    x = [_put(b, d, [1.0]) for d in (0, 1)]
    n.group_start()
    n.all_reduce(x[0], x[0], 1, NCCL_FLOAT32, NCCL_SUM, comms[0], b.null_stream(0))
    with pytest.raises(NcclError, match="unknown datatype"):
        n.all_reduce(x[1], x[1], 1, 99, NCCL_SUM, comms[1], b.null_stream(1))
    with pytest.raises(NcclError, match="a call of this group failed.*nothing of the group "
                                        "was launched") as info:
        n.group_end()
    assert info.value.name == "ncclInvalidArgument"
    assert _get(b, x[0], 1).tolist() == [1.0]
    n.group_start()  # the next group starts clean
    for d in (0, 1):
        n.all_reduce(x[d], x[d], 1, NCCL_FLOAT32, NCCL_SUM, comms[d], b.null_stream(d))
    n.group_end()
    assert _get(b, x[1], 1).tolist() == [2.0]


@pytest.mark.parametrize("call, root, expected", [
    (NCCL_CALL_ALL_REDUCE, 0, ([3, 3], [3, 3])),
    (NCCL_CALL_BROADCAST, 1, ([2, 2], [2, 2])),
    (NCCL_CALL_REDUCE, 1, ([1, 1], [3, 3])),
])
def test_group_call_issues_one_collective_per_rank_in_one_group(b, call, root, expected):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    x = [_put(b, d, [d + 1.0] * 2) for d in (0, 1)]
    n.group_call(call, 2, NCCL_FLOAT32, NCCL_SUM, root, x, x, comms,
                 [b.null_stream(0), b.null_stream(1)])
    assert (_get(b, x[0], 2).tolist(), _get(b, x[1], 2).tolist()) == expected


def test_group_call_closes_its_group_when_a_rank_fails(b):
    n = b.nccl()
    comms = n.comm_init_all([0, 1])
    x = [_put(b, d, [1.0]) for d in (0, 1)]
    streams = [b.null_stream(0), b.null_stream(1)]
    with pytest.raises(NcclError, match="unknown datatype"):
        n.group_call(NCCL_CALL_ALL_REDUCE, 1, 99, NCCL_SUM, 0, x, x, comms, streams)
    with pytest.raises(ValueError, match="unknown collective"):
        n.group_call(7, 1, NCCL_FLOAT32, NCCL_SUM, 0, x, x, comms, streams)
    assert _get(b, x[0], 1).tolist() == [1.0]  # nothing of the failed group ran
    n.group_call(NCCL_CALL_ALL_REDUCE, 1, NCCL_FLOAT32, NCCL_SUM, 0, x, x, comms, streams)
    assert _get(b, x[1], 1).tolist() == [2.0]  # ... and no group was left open
