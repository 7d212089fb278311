"""MemoryDashboard renders its source's DeviceSamples and nothing else: with a made-up source
it shows the made-up figures, its buttons call the source, and it never reads cudalab's
allocator or NVML. Runs without a kernel (ipywidgets' DummyComm), as test_widgets.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import cudalab
from cudalab.identity import Identity
from cudalab.memory_tools.samples import ALLOCATOR_FIGURES, DeviceSample

W = pytest.importorskip("ipywidgets")

from cudalab.widgets import close_all  # noqa: E402
from cudalab.widgets.dashboard import MemoryDashboard  # noqa: E402

GiB = 1 << 30
WIDGETS = Path(cudalab.__file__).parent / "widgets"


class FakeSource:
    """Figures that no allocator has: 3 GiB allocated of 80, 7 OOMs, NVML not available."""

    name = "fake"

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.n = 0

    def sample(self, device: int, now: float | None = None) -> DeviceSample:
        self.n += 1
        ident = Identity(host="elsewhere", pid=99, version="0", allocator="torch", rank=1,
                         world_size=2, device=device, device_uuid="GPU-x",
                         device_name="Fake GPU")
        figures = {name: 0 for name, _ in ALLOCATOR_FIGURES}
        figures.update(allocated=3 * GiB + self.n, reserved=4 * GiB, peak_allocated=5 * GiB,
                       allocations=11, num_ooms=7)
        return DeviceSample(time=1000.0 + self.n if now is None else now, source=self.name,
                            identity=ident, capacity=80 * GiB,
                            nvml_error="NVML unavailable (fake)", **figures)

    def reset_peaks(self, device: int) -> None:
        self.calls.append(("reset_peaks", device))

    def release_cache(self) -> None:
        self.calls.append(("release_cache",))

    def snapshot(self) -> dict:
        self.calls.append(("snapshot",))
        return {"segments": [], "device_traces": []}


@pytest.fixture(autouse=True)
def _closed():
    yield
    close_all()


def _attrs(html: str, cls: str) -> dict[str, int]:
    m = re.search(rf'class="{cls}"([^>]*)>', html)
    assert m, html
    return {k: int(v) for k, v in re.findall(r'data-([a-z]+)="(-?\d+)"', m.group(1))}


def test_the_dashboard_renders_its_sources_samples(monkeypatch):
    import cudalab.memory as cm
    from cudalab import nvml

    def forbidden(*args, **kwargs):
        raise AssertionError("the dashboard read the allocator or NVML itself")

    monkeypatch.setattr(cm, "memory_stats", forbidden)
    monkeypatch.setattr(cm, "private_pools", forbidden)
    monkeypatch.setattr(nvml, "resolve_device", forbidden)
    source = FakeSource()
    d = MemoryDashboard(devices=[0], start=False, source=source)
    d.refresh()
    assert d.source is source
    mem = _attrs(d._panels[0]["mem"].value, "cudalab-dash-mem")
    assert mem == {"allocated": 3 * GiB + source.n, "reserved": 4 * GiB, "peak": 5 * GiB,
                   "capacity": 80 * GiB}
    counts = _attrs(d._panels[0]["counts"].value, "cudalab-dash-counts")
    assert counts["ooms"] == 7 and counts["allocations"] == 11
    assert "Fake GPU" in d._panels[0]["title"].value
    assert "NVML unavailable (fake)" in d._panels[0]["nvml"].value
    assert d._panels[0]["procs"].value == ""
    assert d.latest[0]["identity"]["host"] == "elsewhere" and d.latest[0]["source"] == "fake"
    assert d.last_samples[0].identity.rank == 1
    h = d.history(0)
    assert list(h["allocated"]) == [3 * GiB + 1, 3 * GiB + 2]
    assert "Fake GPU" in d._text()
    # the buttons act through the source
    d._on_reset()
    d._on_empty()
    assert d._on_snapshot() == {"segments": [], "device_traces": []}
    assert source.calls == [("reset_peaks", 0), ("release_cache",), ("snapshot",)]
    d.close()


def test_the_dashboard_modules_never_reach_the_allocator_or_nvml():
    """An AST scan of the dashboard's modules: no import of the allocator, the memory API's
    readers or NVML, and no call of memory_stats / private_pools / empty_cache /
    reset_peak_memory_stats: the figures come from the source."""
    banned_modules = ("cudalab.memory", "cudalab.nvml", "cudalab.allocator", "cudalab._driver")
    banned_names = {"memory_stats", "private_pools", "empty_cache", "reset_peak_memory_stats",
                    "resolve_device", "memory_allocated", "memory_reserved"}
    for name in ("dashboard.py", "dashboard_device.py", "dashboard_chart.py"):
        tree = ast.parse((WIDGETS / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                mods = []
            for m in mods:
                assert not any(m == b or m.startswith(b + ".") for b in banned_modules), (
                    f"{name}:{node.lineno} imports {m}")
            if isinstance(node, ast.Attribute):
                assert node.attr not in banned_names, f"{name}:{node.lineno} uses .{node.attr}"
            if isinstance(node, ast.Name):
                assert node.id not in banned_names, f"{name}:{node.lineno} uses {node.id}"
