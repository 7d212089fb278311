"""The sanitizer sees the array operators, jiterator functions and reductions (issue 20's
kernels), each with the ranges it reads and writes."""

from __future__ import annotations

import pytest

import cudalab
from cudalab import sanitizer
from cudalab.jiterator import _create_jit_fn


@pytest.fixture
def reports():
    with sanitizer.sanitize(on_race="collect") as s:
        yield s


def _found(s) -> list:
    return list(s.reports)


def test_an_operator_on_a_side_stream_races_with_the_write_it_reads(reports):
    x = cudalab.zeros(1024)
    side = cudalab.Stream()
    with cudalab.stream(side):
        y = x + 1  # reads x on the side stream: its zeros were written on the default stream
    found = _found(reports)
    assert len(found) == 1 and "kernel" in str(found[0]), [str(r) for r in found]
    del y


def test_an_ordered_operator_and_concurrent_reads_are_not_reported(reports):
    x = cudalab.zeros(1024)
    side = cudalab.Stream()
    side.wait_stream(cudalab.current_stream())
    with cudalab.stream(side):
        y = x * 2
    z = x - 1  # a read of x on the default stream, concurrent with the side stream's read
    assert _found(reports) == []
    del y, z


def test_writes_to_disjoint_halves_from_two_streams_are_not_a_race(reports):
    x = cudalab.zeros(1024)
    side = cudalab.Stream()
    side.wait_stream(cudalab.current_stream())
    with cudalab.stream(side):
        x[:512] += 1
    x[512:] += 2
    assert _found(reports) == []
    x[256:768] += 3  # overlaps the side stream's half
    assert len(_found(reports)) == 1


def test_a_jit_function_and_a_reduction_report_their_accesses(reports):
    fn = _create_jit_fn("template <typename T> T f(T x) { return x * x; }")
    x = cudalab.ones(256)
    side = cudalab.Stream()
    with cudalab.stream(side):
        y = fn(x)  # reads x unordered after its fill
    assert len(_found(reports)) == 1
    side.synchronize()
    with cudalab.stream(side):
        total = y.sum()  # y was written on side: same stream, ordered
    assert len(_found(reports)) == 1
    assert total.item() == 256.0
