"""Fixtures of the stream sanitizer's tests: a collecting session and a pool of streams."""

from __future__ import annotations

import pytest

import cudalab
from cudalab import sanitizer


@pytest.fixture
def session():
    """A fresh analysis in "collect" mode for the test (the previous state comes back)."""
    cudalab.init()
    with sanitizer.sanitize("collect") as s:
        yield s


@pytest.fixture
def streams(session):
    """Eleven streams of device 0 (torch's catalogue uses stream ids 0 to 10)."""
    return [cudalab.Stream() for _ in range(11)]


@pytest.fixture
def tensors(session):
    """Ten small device arrays (torch's catalogue's tensors)."""
    return [cudalab.empty(16) for _ in range(10)]
