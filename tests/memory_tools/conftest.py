"""The history's tests start as if no NVTX range had been pushed in this process.

``cudalab.nvtx.ranges_used`` turns True, once and for good, the first time a range is
pushed (the collectives push one per call); from then on the history looks up the innermost
range per entry and the allocator's memo no longer logs pairs as compact stamps. Tests that
check the compact log would depend on which tests ran before them without this.
"""

from __future__ import annotations

import pytest

import cudalab.nvtx


@pytest.fixture(autouse=True)
def _no_nvtx_range_pushed_yet(monkeypatch):
    monkeypatch.setattr(cudalab.nvtx, "ranges_used", False)
