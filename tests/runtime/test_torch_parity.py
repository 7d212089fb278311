"""Behaviours torch's own CUDA tests assert (test_cuda.py and friends), on both backends.

Each test names the torch behaviour it pins; the torch 2.11 oracle comparisons run in the
GPU-only tests at the end, where torch is importable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

import cudalab
from cudalab.memory_tools import history
from tests.helpers.gpu import HAS_GPU

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _history_off():
    cudalab.memory._record_memory_history(None)
    yield
    cudalab.memory._record_memory_history(None)


# --------------------------------------------------------------------------- events
def test_elapsed_time_errors_are_value_errors_with_torchs_text():
    timed, untimed = cudalab.Event(enable_timing=True), cudalab.Event()
    with pytest.raises(ValueError, match=r"^Both events must be recorded before calculating "
                                         r"elapsed time\.$"):
        timed.elapsed_time(cudalab.Event(enable_timing=True))
    timed.record()
    untimed.record()
    with pytest.raises(ValueError, match=r"^Both events must be created with argument "
                                         r"'enable_timing=True'\.$"):
        timed.elapsed_time(untimed)
    with pytest.raises(ValueError, match="enable_timing"):
        untimed.elapsed_time(timed)


# --------------------------------------------------------------------------- devices
def test_device_properties_uuid_is_a_uuid_object():
    p = cudalab.get_device_properties(0)
    assert isinstance(p.uuid, uuid.UUID)
    assert len(str(p.uuid)) == 36 and len(p.uuid.bytes) == 16
    assert p.nvml_uuid.lower() == f"gpu-{p.uuid}"
    assert str(p.uuid) in repr(p)


def test_device_context_object_is_a_device_argument():
    cudalab.init()
    with cudalab.device(0) as d:
        assert cudalab.memory_allocated(d) == cudalab.memory_allocated(0)
        assert cudalab.memory_stats(d) == cudalab.memory_stats(0)
        s = cudalab.ExternalStream(cudalab.current_stream().cuda_stream, device=d)
        assert s.device_index == 0
    # torch.cuda.device(None) holds idx -1: the current device
    assert cudalab.memory_reserved(cudalab.device(None)) == cudalab.memory_reserved()


@pytest.mark.parametrize("spec", ["cpu", "cpu:0", "mps"])
def test_non_cuda_device_reads_as_torchs_error(spec):
    with pytest.raises(ValueError, match=rf"^Expected a cuda device, but got: {spec} \("):
        cudalab.memory_allocated(spec)


def _count_in_child(backend_env: dict, code: str) -> list:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(backend_env)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


_COUNT_CHANGES = """
    import json, os
    import cudalab
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    hidden = cudalab.device_count()
    del os.environ["CUDA_VISIBLE_DEVICES"]
    shown = cudalab.device_count()
    print(json.dumps([hidden, shown, cudalab.is_initialized()]))
"""


@pytest.mark.gpu
def test_device_count_is_not_cached_before_initialisation():
    """torch: "Do not cache the device count prior to CUDA initialization", because
    CUDA_VISIBLE_DEVICES may still change."""
    hidden, shown, initialised = _count_in_child({}, _COUNT_CHANGES)
    assert hidden == 0 and shown >= 1 and not initialised


def test_device_count_after_init_is_fixed():
    cudalab.init()
    before = cudalab.device_count()
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        assert cudalab.device_count() == before  # the driver no longer reads it
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


# --------------------------------------------------------------------------- allocator
def test_empty_cache_counts_sync_all_streams_on_every_device():
    """torch keeps an allocator per device from initialisation: empty_cache() moves
    num_sync_all_streams on devices nothing was allocated on."""
    cudalab.init()
    n = cudalab.device_count()
    before = [cudalab.memory_stats(d)["num_sync_all_streams"] for d in range(n)]
    cudalab.empty_cache()
    after = [cudalab.memory_stats(d)["num_sync_all_streams"] for d in range(n)]
    assert after == [b + 1 for b in before]
    if n >= 2:  # the unused device's count carries over into its allocator when created
        used_before = cudalab.memory_stats(1)["num_sync_all_streams"]
        with cudalab.device(1):
            x = cudalab.empty(256)
        assert cudalab.memory_stats(1)["num_sync_all_streams"] == used_before
        del x
        cudalab.reset_accumulated_memory_stats(1)
        assert cudalab.memory_stats(1)["num_sync_all_streams"] == 0


def test_per_process_memory_fraction_is_returned_exactly():
    cudalab.init()
    old = cudalab.get_per_process_memory_fraction()
    try:
        for fraction in (0.923936128616333, 0.5, 1 / 3, 1.0):
            cudalab.set_per_process_memory_fraction(fraction)
            assert cudalab.get_per_process_memory_fraction() == fraction
    finally:
        cudalab.set_per_process_memory_fraction(old)


def test_empty_slice_view_points_at_its_offset():
    base = cudalab.empty(5, dtype="float32")
    assert base[5:].data_ptr() == base.data_ptr() + 5 * 4
    assert base[2:2].data_ptr() == base.data_ptr() + 2 * 4
    assert base[3:1].data_ptr() == base.data_ptr() + 3 * 4  # torch clamps stop to start
    assert base[5:].shape == (0,)
    assert base[1:].data_ptr() == base.data_ptr() + 4


# --------------------------------------------------------------------------- snapshots
def test_snapshot_trace_ends_with_the_segment_free_as_torchs():
    cudalab.init()
    cudalab.empty_cache()
    cudalab.memory._record_memory_history(enabled="state")
    x = cudalab.empty(32 << 20, dtype="uint8")  # a segment of its own
    del x
    cudalab.empty_cache()
    snap = cudalab.memory._snapshot()
    assert snap["device_traces"][0][-1]["action"] == "segment_free"
    later = cudalab.memory._snapshot()  # the first snapshot's entry shows from then on
    assert later["device_traces"][0][-1]["action"] == "snapshot"


def _thealloc(box):
    box.append(cudalab.empty((3, 4), dtype="float32"))


def _thefree(box):
    box.pop()


@pytest.mark.parametrize("context", ["alloc", "all", "state"])
def test_free_stacks_as_torchs_memory_plots_free_stack(context):
    """torch's test_memory_plots_free_stack: "thefree" is in the snapshot only with
    context "all", "thealloc" only when stacks outlive the allocation (not "state")."""
    cudalab.init()
    cudalab.empty_cache()
    cudalab.memory._record_memory_history(context=context)
    box: list = []
    _thealloc(box)
    _thefree(box)
    ss = json.dumps(cudalab.memory._snapshot())
    assert ("_thefree" in ss) == (context == "all")
    assert ("_thealloc" in ss) == (context != "state")


@pytest.mark.parametrize("context", ["alloc", "all", "state"])
def test_segment_free_stack_shows_the_api_frame_as_torchs(context):
    """torch's test_memory_plots_free_segment_stack: "empty_cache" is in the snapshot
    exactly with context "all" (the frame of the API function that released the
    segment is kept; only the frames inside it are dropped)."""
    cudalab.init()
    cudalab.empty_cache()
    cudalab.memory._record_memory_history(context=context)
    x = cudalab.empty(32 << 20, dtype="uint8")  # a segment of its own
    del x
    cudalab.empty_cache()
    snap = cudalab.memory._snapshot()
    ss = json.dumps(snap)
    assert ("empty_cache" in ss) == (context == "all")
    if context == "all":
        (free,) = [e for e in snap["device_traces"][0] if e["action"] == "segment_free"]
        top = free["frames"][0]
        assert top["name"] == "empty_cache"
        assert os.path.abspath(top["filename"]) == os.path.abspath(
            sys.modules[cudalab.memory.empty_cache.__module__].__file__)
        assert free["frames"][1]["name"] == "test_segment_free_stack_shows_the_api_frame_as_torchs"
        # no frame from inside the API function (the allocator's own)
        assert not any("allocator" in f["filename"] for f in free["frames"])


def test_state_context_keeps_no_segment_stacks_once_freed():
    cudalab.init()
    cudalab.empty_cache()
    cudalab.memory._record_memory_history(context="state")
    box: list = []
    _thealloc(box)
    live = cudalab.memory._snapshot()
    blocks = [b for s in live["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert any(f["name"] == "_thealloc" for b in blocks for f in b["frames"])
    _thefree(box)
    ss = json.dumps(cudalab.memory._snapshot())
    assert "_thealloc" not in ss
    assert history.is_recording()


# --------------------------------------------------------------------------- torch oracle
torch = pytest.importorskip("torch") if HAS_GPU else None


@pytest.mark.gpu
def test_uuid_matches_torchs():
    tp = torch.cuda.get_device_properties(0)
    cp = cudalab.get_device_properties(0)
    # torch's .bytes is a sequence of 16 byte values; ours is bytes, as uuid.UUID's
    assert str(cp.uuid) == str(tp.uuid) and cp.uuid.bytes == bytes(tp.uuid.bytes)


@pytest.mark.gpu
def test_error_texts_match_torchs():
    t = cudalab.Event(enable_timing=True)
    with pytest.raises(ValueError) as ours:
        t.elapsed_time(cudalab.Event(enable_timing=True))
    te = torch.cuda.Event(enable_timing=True)
    with pytest.raises(ValueError) as theirs:
        te.elapsed_time(torch.cuda.Event(enable_timing=True))
    assert str(ours.value) == str(theirs.value)
