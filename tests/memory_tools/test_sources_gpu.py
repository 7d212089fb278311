"""The torch and CuPy sources over the real libraries, on a GPU (skipped on the simulator and
where torch or CuPy is not installed; the fakes' tests are tests/memory_tools/test_sources.py)."""

from __future__ import annotations

import pytest

import cudalab
from cudalab.memory_sources import CupySource, TorchSource, resolve_sources
from cudalab.memory_tools.samples import ALLOCATOR_FIGURES

pytestmark = pytest.mark.gpu


@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    torch.zeros(1, device="cuda")  # initialise torch's CUDA
    return torch


@pytest.fixture
def cupy():
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("CuPy has no CUDA here")
    return cupy


def test_torch_sample_is_memory_stats_exactly(torch):
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 3 << 20, 50 << 20)]
    del keep[1]
    peak_before = torch.cuda.max_memory_allocated()
    source = TorchSource(torch)
    s = source.sample(0)
    flat = torch.cuda.memory_stats(0)
    for name, key in ALLOCATOR_FIGURES:
        assert getattr(s, name) == flat.get(key, 0), name
    assert s.allocated == torch.cuda.memory_allocated(0) > 50 << 20
    assert torch.cuda.max_memory_allocated() == peak_before  # never reset
    assert s.capacity == torch.cuda.get_device_properties(0).total_memory
    theirs = str(torch.cuda.get_device_properties(0).uuid).lower().removeprefix("gpu-")
    assert s.identity.device_uuid.lower().endswith(theirs)
    assert s.process_used is not None and s.process_used >= s.reserved
    snap = source.snapshot()
    assert sum(seg["total_size"] for seg in snap["segments"]) == s.reserved
    del keep


def test_cupy_sample_is_the_pool(cupy):
    pool = cupy.get_default_memory_pool()
    a = cupy.empty(4_000_000, dtype=cupy.uint8)
    b = cupy.empty(4000, dtype=cupy.uint8)
    del a
    s = CupySource(cupy).sample(0)
    assert (s.allocated, s.reserved) == (pool.used_bytes(), pool.total_bytes())
    assert dict(s.extra)["free_blocks"] == pool.n_free_blocks()
    del b


def test_cupy_backed_by_cudalab_is_not_counted_twice(cupy):
    import cudalab.memory as cm

    cudalab.init()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before_pool = pool.total_bytes()
    cupy.cuda.set_allocator(cm.cupy_allocator)
    try:
        before = cm.memory_allocated(0)
        x = cupy.ones(1 << 20, dtype=cupy.float32)
        s = CupySource(cupy).sample(0)
        assert "cudalab's allocator backs CuPy" in s.note
        assert s.reserved == before_pool  # CuPy's own pool did not grow
        assert cm.memory_allocated(0) - before >= x.nbytes  # cudalab counts the array
        del x
    finally:
        cupy.cuda.set_allocator(pool.malloc)


def test_auto_with_torch_and_cupy(torch, cupy):
    cudalab.init()
    cupy.empty(1 << 20, dtype=cupy.uint8)
    names = [s.name for s in resolve_sources("auto")]
    assert names == ["cudalab", "torch", "cupy", "process"]
    samples = [s.sample(0) for s in resolve_sources("auto")]
    process = samples[-1]
    held = sum(s.reserved for s in samples[:-1])
    assert process.process_used is not None
    assert process.reserved == max(process.process_used - held, 0)
    assert process.reserved > 100 << 20  # at least the CUDA context


def _workload(torch, steps=5):
    """A small training loop: a linear model, Adam, random batch sizes."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 10)).cuda()
    opt = torch.optim.Adam(model.parameters())
    for i in range(steps):
        x = torch.randn(64 * (i + 1), 512, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return model, opt


def test_history_frame_has_a_row_per_torch_trace_entry(torch):
    from cudalab.memory import history_frame

    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        keep = _workload(torch, 3)
        snap = TorchSource(torch).snapshot()
        n = sum(len(t) for t in snap["device_traces"])
        df = history_frame(snap)
        assert len(df) == n > 20
        assert list(df["action"].astype(str)) == [e["action"] for e in snap["device_traces"][0]]
        assert len(history_frame(source="torch")) >= n
        del keep
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


_WHAT_IF = """
import json, torch
import cudalab.memory as cm
torch.cuda.init()                      # initialised, nothing allocated yet
assert torch.cuda.memory_reserved() == 0
torch.cuda.memory._record_memory_history(max_entries=1_000_000)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                            torch.nn.Linear(2048, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
for i in range(6):
    loss = model(torch.randn(64 * (i + 1), 512, device="cuda")).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
df = cm.what_if(source="torch", configs=["expandable_segments:True"])
default = df[df["config"] == "default"].iloc[0]
print(json.dumps({"torch": torch.cuda.max_memory_reserved(), "allocator": df.attrs["allocator"],
                  "replay": int(default["peak_reserved"])}))
"""


def test_what_if_default_peak_is_torchs_recorded_peak_reserved(torch):
    """In a fresh process (torch holding nothing when the recording starts, so the trace has
    every allocation): what_if's default row is torch's own max_memory_reserved()."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _WHAT_IF], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["allocator"] == "torch"
    assert got["replay"] == got["torch"] > 0, got


def test_viewer_renders_torchs_snapshot_with_stacks(torch):
    W = pytest.importorskip("ipywidgets")  # noqa: N806,F841
    from cudalab.widgets import SnapshotViewer

    torch.cuda.memory._record_memory_history(stacks="python", max_entries=10_000)
    try:
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        v = SnapshotViewer(source="torch")
        blocks = [b for s in v.snapshot["segments"] for b in s["blocks"]
                  if b["state"] == "active_allocated"]
        here = [b for b in blocks if any(f.get("filename", "").endswith("test_sources_gpu.py")
                                         for f in b.get("frames") or ())]
        assert here, "no block carries this test's stack"
        assert v.history is not None and v.history.n > 0
        assert "segment" in v._summary.value
        v.close()
        del x
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
