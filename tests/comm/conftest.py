"""Fixtures of the cudalab.comm tests: collective records, forced code paths, paused streams."""

from __future__ import annotations

import pytest

import cudalab
from cudalab import _internal
from cudalab.comm import _common
from tests.comm.helpers import RecordingNccl


@pytest.fixture
def records():
    """(CollectiveRecord, NVTX ranges open when it was reported) for each ``comm.*``
    collective (cudalab.nccl's own records, on the NCCL path, are left out)."""
    got = []

    def observer(record):
        if record.name.startswith("comm."):
            got.append((record, cudalab.nvtx.current_ranges()))

    _internal.collective_observers.append(observer)
    yield got
    _internal.collective_observers.remove(observer)


@pytest.fixture
def copies(monkeypatch):
    """Force the copy path (as without cudalab.nccl)."""
    monkeypatch.setattr(_common, "nccl_module", lambda: None)


@pytest.fixture
def fake_nccl(monkeypatch):
    """Route the NCCL branch to a recording stand-in with torch.cuda.nccl's API."""
    nccl = RecordingNccl()
    monkeypatch.setattr(_common, "nccl_module", lambda: nccl)
    return nccl


@pytest.fixture(params=["auto", "copies", "nccl"])
def path(request, monkeypatch):
    """Each value test three ways: as installed, forced copies, the NCCL branch (stand-in)."""
    if request.param == "copies":
        monkeypatch.setattr(_common, "nccl_module", lambda: None)
    elif request.param == "nccl":
        nccl = RecordingNccl()
        monkeypatch.setattr(_common, "nccl_module", lambda: nccl)
    return request.param


@pytest.fixture
def sim(backend):
    """The simulator backend (its pause/resume hooks); skips on real hardware."""
    if not backend.simulated:
        pytest.skip("needs the simulator's pause_stream/resume_stream test hooks")
    return backend


@pytest.fixture
def two(two_devices):
    return two_devices
