"""``%%cuda_timed --graph``: the cell eagerly and as CUDA graph replays, with the launches per
replay, the host time saved and the verdict; a cell that cannot be captured names why."""

from __future__ import annotations

import numpy as np
import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp

import cudalab
from cudalab.magics.timed_graph import GraphTimedResult, check_options
from cudalab.magics.timed_options import parse_options
from tests.helpers.shell import run_cell as run


@pytest.fixture(scope="module")
def shell():
    sh = globalipapp.get_ipython()
    sh.run_cell("import cudalab, numpy as np", store_history=False)
    return sh


@pytest.fixture
def ip(shell):
    cudalab.init()
    shell.run_line_magic("load_ext", "cudalab")
    shell.user_ns["buf"] = cudalab.array.zeros((1024,), np.uint8)
    yield shell
    shell.run_line_magic("unload_ext", "cudalab")


def test_graph_option_is_parsed_and_checked():
    assert parse_options("--graph -r 5").graph
    assert not parse_options("-r 5").graph
    with pytest.raises(UsageError, match="--graph cannot be combined with --cold"):
        check_options(parse_options("--graph --cold"))


def test_graph_mode_times_eager_and_replays(ip):
    cell = "%%cuda_timed --graph -r 10 -w 1 -o\nfor v in range(20):\n    buf.fill_(v)\n"
    r, texts = run(ip, cell)
    assert r.success, r.error_in_exec
    res = r.result
    assert isinstance(res, GraphTimedResult)
    assert res.capture_error is None
    assert res.nodes == 20 and res.launches == 20  # a fill in a capture is a kernel node
    assert res.repeats == 10 and res.warmup == 1
    assert res.eager_time > 0 and res.graph_time > 0 and res.graph_host > 0
    assert res.host_saved == pytest.approx(res.eager_host - res.graph_host)
    text = texts[0]
    assert "eager:" in text and "graph:" in text and "per replay" in text
    assert "host time" in text and ("pays off" in text)
    assert ("simulated" in text) == cudalab.get_device_properties(0).simulated
    assert ip.user_ns["buf"].numpy()[0] == 19  # the cell's effect


def test_graph_mode_counts_kernel_launches(ip):
    ip.user_ns["f32"] = cudalab.array.zeros((256,), np.float32)
    r, _ = run(ip, "%%cuda_timed --graph -r 3 -w 1 -o -q\nfor _ in range(7):\n"
                   "    cudalab.random.uniform_(f32)\n")
    assert r.success, r.error_in_exec
    assert r.result.launches == 7 and r.result.nodes == 7


def test_graph_mode_names_the_operation_that_breaks_the_capture(ip):
    r, texts = run(ip, "%%cuda_timed --graph -r 3 -w 1 -o\nbuf.fill_(1)\ncudalab.synchronize()\n")
    assert r.success, r.error_in_exec
    assert r.result.graph_time is None
    assert "cudalab.synchronize()" in r.result.capture_error
    assert "cannot be captured: cudalab.synchronize()" in texts[0]
    assert not cudalab.is_current_stream_capturing()


def test_graph_mode_verdict():
    common = dict(repeats=10, warmup=1, eager_host=2e-4, launches=100, nodes=100,
                  capture_error=None, device_name="cuda:0 (x)", simulated=False, precision=3)
    fast = GraphTimedResult(eager_time=1e-3, graph_time=1e-4, graph_host=1e-5, **common)
    assert fast.pays_off and fast.speedup == pytest.approx(10)
    assert "the graph pays off: 10x faster per iteration" in fast.report()
    slow = GraphTimedResult(eager_time=1e-3, graph_time=1e-3, graph_host=1e-5, **common)
    assert not slow.pays_off and "does not pay off" in slow.report()


def test_no_verdict_from_simulated_times():
    """Issue 36 item 14: simulated device times say nothing of a GPU (they flipped between
    2.41x and 0.87x from run to run): the simulator's report gives no verdict and no ratio."""
    common = dict(repeats=10, warmup=1, eager_host=2e-4, launches=100, nodes=100,
                  capture_error=None, device_name="cuda:0 (x)", simulated=True, precision=3)
    for graph_time in (1e-4, 1e-3):
        res = GraphTimedResult(eager_time=1e-3, graph_time=graph_time, graph_host=1e-5,
                               **common)
        text = res.report()
        assert res.pays_off is None and res.speedup is None
        assert "the graph pays off" not in text and "does not pay off" not in text
        assert "x faster" not in text and "no verdict" in text and "simulated" in text


def test_graph_mode_on_the_simulator_gives_no_verdict(ip):
    r, texts = run(ip, "%%cuda_timed --graph -r 5 -w 1\nfor v in range(5):\n    buf.fill_(v)\n")
    assert r.success, r.error_in_exec
    if cudalab.get_device_properties(0).simulated:
        assert "no verdict" in texts[0] and "pays off:" not in texts[0]
    else:
        assert "pays off" in texts[0] and "no verdict" not in texts[0]


def test_graph_needs_a_cell(ip):
    r, _ = run(ip, "%cuda_timed --graph 1 + 1")
    assert not r.success and "use %%cuda_timed --graph" in str(r.error_in_exec)
