"""The stream sanitizer sees cudalab.matmul's and cudalab.fft's library calls (issue 42):
what each reads and writes, on the stream it is queued on."""

from __future__ import annotations

import numpy as np
import pytest

import cudalab
from cudalab import _array_matmul, sanitizer


@pytest.fixture
def reports():
    with sanitizer.sanitize(on_race="collect") as s:
        yield s


@pytest.mark.parametrize("call,shape,dtype,name", [
    (lambda x: x @ x, (64, 64), np.float32, "cublasSgemm_v2"),
    (lambda x: x @ x, (2, 64, 64), np.float32, "cublasSgemmStridedBatched"),
    (lambda x: x @ x, (2, 64, 64), np.float16, "cublasGemmStridedBatchedEx"),
    (lambda x: cudalab.fft.fft(x), (64, 64), np.complex64, "cufftExecC2C"),
    (lambda x: cudalab.fft.rfft(x), (64, 64), np.float32, "cufftExecR2C"),
], ids=["matmul", "batched matmul", "batched half matmul", "fft", "rfft"])
def test_a_library_call_on_a_side_stream_races_with_the_write_it_reads(reports, call, shape,
                                                                        dtype, name):
    x = cudalab.zeros(shape, dtype=dtype)
    side = cudalab.Stream()
    with cudalab.stream(side):
        y = call(x)
    found = [str(r) for r in reports.reports]
    assert found and any(f"during {name}" in r for r in found), found
    del y


def test_ordered_library_calls_are_not_reported(reports):
    x = cudalab.ones((64, 64))
    side = cudalab.Stream()
    side.wait_stream(cudalab.current_stream())
    with cudalab.stream(side):
        y = x @ x
        f = cudalab.fft.fft2(x)
    cudalab.current_stream().wait_stream(side)
    z = y + f.abs()
    assert list(reports.reports) == []
    del z


@pytest.fixture(autouse=True)
def _workspaces_back():
    """The cuBLAS workspaces these tests make go back to the allocator after each."""
    yield
    _array_matmul.clear_workspaces()
