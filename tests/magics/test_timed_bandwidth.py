"""``%%cuda_timed`` on a cell that runs collectives reports algorithm and bus bandwidth, as
nccl-tests defines them (S / t, times the collective's bus factor)."""

from __future__ import annotations

import math

import pytest
from IPython.testing import globalipapp

import cudalab
from cudalab import _internal
from cudalab.magics.result import CudaTimedResult
from cudalab.magics.timed_bandwidth import CollectiveWatch, bandwidth_line
from tests.helpers.shell import run_cell as run

MiB = 1 << 20


@pytest.fixture(scope="module")
def shell():
    sh = globalipapp.get_ipython()
    sh.run_cell("import cudalab, numpy as np\nfrom cudalab import _internal", store_history=False)
    return sh


@pytest.fixture
def ip(shell):
    cudalab.init()
    shell.run_line_magic("load_ext", "cudalab")
    yield shell
    shell.run_line_magic("unload_ext", "cudalab")


def record(name="all_reduce", nbytes=64 * MiB, nranks=2, factor=1.0):
    return _internal.CollectiveRecord(name, nbytes, nranks, factor, tuple(range(nranks)))


# ----------------------------------------------------------------------------- the watch
def test_one_collective_per_loop_gives_nccl_tests_bandwidths():
    watch = CollectiveWatch()
    for _ in range(10):
        watch(record(nbytes=1_000_000_000, factor=2 * (2 - 1) / 2))
    got = watch.summary(seconds_per_loop=0.01, loops=10)
    assert got["calls_per_loop"] == 1 and got["name"] == "all_reduce"
    assert got["algbw"] == pytest.approx(100.0)  # 1e9 B / 10 ms = 100 GB/s
    assert got["busbw"] == pytest.approx(100.0)  # 2(n-1)/n = 1 for two ranks
    watch = CollectiveWatch()
    for _ in range(8):
        watch(record(nbytes=2_000_000_000, nranks=4, factor=1.5))
    got = watch.summary(seconds_per_loop=0.04, loops=4)  # two calls per loop: 20 ms each
    assert got["calls_per_loop"] == 2
    assert got["time"] == pytest.approx(0.02)
    assert got["algbw"] == pytest.approx(100.0) and got["busbw"] == pytest.approx(150.0)


def test_watch_notes_instead_of_a_wrong_number():
    watch = CollectiveWatch()
    assert watch.summary(1.0, 1) is None  # no collective: nothing to say
    watch(record("all_reduce"))
    watch(record("broadcast"))
    assert "several kinds" in watch.summary(1.0, 1)["note"]
    watch = CollectiveWatch()
    for _ in range(3):
        watch(record())
    assert "not the same number per loop" in watch.summary(1.0, 2)["note"]
    watch = CollectiveWatch()
    watch(record())
    assert "no GPU time" in watch.summary(float("nan"), 1)["note"]


def test_mark_starts_the_measured_phase_and_exit_stops_listening():
    watch = CollectiveWatch()
    with watch:
        assert watch in _internal.collective_observers
        _internal.notify_collective("broadcast", 100, 2, 1.0, (0, 1))
        watch.mark()
        assert watch.total == 0
        _internal.notify_collective("broadcast", 100, 2, 1.0, (0, 1))
    assert watch not in _internal.collective_observers
    _internal.notify_collective("broadcast", 100, 2, 1.0, (0, 1))  # not heard any more
    assert watch.total == 1
    watch.__exit__()  # idempotent


def test_report_line_and_result_export():
    line = bandwidth_line({"name": "all_reduce", "bytes": 1 << 30, "nranks": 2,
                           "calls_per_loop": 1, "time": 0.005, "algbw": 214.7,
                           "busbw": 214.7, "bus_factor": 1.0}, lambda s: f"{s * 1e3:.1f} ms")
    assert "all_reduce of 1.0 GiB over 2 ranks" in line
    assert "algbw 214.70 GB/s, busbw 214.70 GB/s" in line and "5.0 ms each" in line
    result = CudaTimedResult(mode="single", loops=1, repeats=1, warmup=0, devices=(0,),
                             gpu_times=[[0.005]], cpu_times=[0.001])
    result.collective = {"note": "several kinds of collective ran (a, b): ..."}
    assert "collective: several kinds" in result.report()
    assert "collective: several kinds" in result._repr_html_()
    assert result.to_dict()["collective"] == result.collective


# ----------------------------------------------------------------------------- the magic
def test_single_mode_reports_the_bandwidth_of_the_cells_collective(ip):
    cell = ("%%cuda_timed -o\n"
            "_internal.notify_collective('all_reduce', 256 << 20, 2, 1.0, (0, 1))\n")
    r, texts = run(ip, cell)
    assert r.success, r.error_in_exec
    result = r.result
    got = result.collective
    assert got["name"] == "all_reduce" and got["calls_per_loop"] == 1
    assert got["algbw"] == pytest.approx((256 << 20) / result.median / 1e9)
    assert "collective: all_reduce of 256.0 MiB over 2 ranks" in texts[0]


def test_repeat_mode_counts_only_the_measured_loops(ip):
    cell = ("%%cuda_timed -r 5 -n 3 -w 2 -o\n"
            "_internal.notify_collective('all_gather', 3 << 20, 4, 0.75, (0, 1))\n"
            "_internal.notify_collective('all_gather', 3 << 20, 4, 0.75, (0, 1))\n")
    r, texts = run(ip, cell)
    assert r.success, r.error_in_exec
    got = r.result.collective
    assert got["calls_per_loop"] == 2  # warm-up runs are not counted
    assert got["time"] == pytest.approx(r.result.median / 2)
    assert got["busbw"] == pytest.approx(got["algbw"] * 0.75)
    assert math.isfinite(got["busbw"])
    assert not _internal.collective_observers  # the magic stopped listening


def test_a_cell_without_collectives_has_no_bandwidth_line(ip):
    r, texts = run(ip, "%%cuda_timed -o\nx = 1\n")
    assert r.success
    assert r.result.collective is None
    assert "collective:" not in texts[0]


def test_an_inner_collective_is_muted_so_the_outer_one_reports_once():
    watch = CollectiveWatch()
    with watch:
        with _internal.collective_muted():
            _internal.notify_collective("nccl.broadcast", 100, 2, 1.0, (0, 1))  # silent
            with _internal.collective_muted():  # nested: still silent, then still muted
                pass
            _internal.notify_collective("nccl.broadcast", 100, 2, 1.0, (0, 1))
        _internal.notify_collective("comm.broadcast", 100, 2, 1.0, (0, 1))
    assert watch.counts == {("comm.broadcast", 100, 2, 1.0): 1}
