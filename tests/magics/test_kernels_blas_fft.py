# ruff: noqa: F811 - the shell fixtures come from test_magics and are taken as arguments
"""``%%cuda_timed --kernels`` over cudalab.matmul and cudalab.fft (issue 42): without CUPTI
(and on the simulator) each library call is one launch named after the call; with CUPTI on a
GPU, cuBLAS's and cuFFT's own kernels are listed by name."""

from __future__ import annotations

import pytest

from cudalab import _array_matmul
from tests.magics.test_kernels import _real_cupti
from tests.magics.test_magics import _magics, _sim, ip, run, shell, timed  # noqa: F401 - fixtures

CELL = ("%%cuda_timed --kernels\n"
        "mm_ = mx_ @ mx_\n"
        "bm_ = bx_ @ bx_\n"
        "f_ = cudalab.fft.fft(cx_)\n"
        "r_ = cudalab.fft.rfft(rx_)\n")
SETUP = ("import cudalab\n"
         "mx_ = cudalab.ones((512, 512))\n"
         "bx_ = cudalab.ones((4, 128, 128))\n"
         "cx_ = cudalab.ones((1 << 16,), dtype='complex64')\n"
         "rx_ = cudalab.ones((1 << 16,))\n"
         "mx_ @ mx_; bx_ @ bx_; cudalab.fft.fft(cx_); cudalab.fft.rfft(rx_)\n"
         "cudalab.synchronize()\n")


def test_without_cupti_each_library_call_is_one_launch(ip, monkeypatch):
    monkeypatch.setattr(_magics(ip), "cupti", False)
    assert ip.run_cell(SETUP, store_history=False).success
    res = timed(ip, CELL)
    names = {k["name"]: k["count"] for k in res.kernels}
    assert names.get("cublasSgemm_v2") == 1, names
    assert names.get("cublasSgemmStridedBatched") == 1, names
    assert names.get("cufftExecC2C") == 1 and names.get("cufftExecR2C") == 1, names


@pytest.mark.gpu
def test_gpu_cupti_lists_cublas_and_cufft_kernels(ip):
    _real_cupti()
    assert ip.run_cell(SETUP, store_history=False).success
    res = timed(ip, CELL)
    assert "CUPTI activity records" in res.kernels_note, res.kernels_note
    names = [k["name"] for k in res.kernels]
    assert any("gemm" in n.lower() for n in names), names  # cuBLAS's own kernels
    assert any("fft" in n.lower() for n in names), names  # cuFFT's own kernels
    print("cuBLAS / cuFFT kernels listed:", sorted(set(names)))


@pytest.fixture(autouse=True)
def _workspaces_back():
    """The cuBLAS workspaces these tests make go back to the allocator after each."""
    yield
    _array_matmul.clear_workspaces()
