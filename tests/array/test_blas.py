"""cudalab.current_blas_handle(): per (device, thread), bound to the current stream, a GEMM
through it (issue 20). The GEMM needs a real GPU with cuBLAS; the simulator refuses."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cudalab
from tests.helpers.gpu import HAS_GPU


@pytest.mark.skipif(HAS_GPU, reason="the simulator's refusal")
def test_the_simulator_has_no_cublas():
    with pytest.raises(cudalab.CublasError, match="simulated backend has no cuBLAS"):
        cudalab.current_blas_handle()


def test_the_name_is_public_and_documented():
    assert "current_blas_handle" in cudalab.__all__ and "CublasError" in cudalab.__all__
    assert cudalab.current_blas_handle.__doc__


@pytest.mark.gpu
def test_handle_per_device_and_thread_bound_to_the_current_stream():
    from cudalab._driver import cublas

    h = cudalab.current_blas_handle()
    assert isinstance(h, int) and h != 0
    assert cudalab.current_blas_handle() == h  # created once per (device, thread)
    s = cudalab.Stream()
    with cudalab.stream(s):
        assert cudalab.current_blas_handle() == h
        assert cublas.get_stream(h) == s.cuda_stream  # rebound on every call
    cudalab.current_blas_handle()
    assert cublas.get_stream(h) == cudalab.current_stream().cuda_stream
    other = []
    t = threading.Thread(target=lambda: other.append(cudalab.current_blas_handle()))
    t.start()
    t.join()
    assert other and other[0] not in (0, h)


@pytest.mark.gpu
def test_sgemm_through_the_handle_matches_numpy():
    from cudalab._driver import cublas

    rng = np.random.default_rng(0)
    m, k, n = 96, 80, 112
    a_host = rng.standard_normal((m, k)).astype(np.float32)
    b_host = rng.standard_normal((k, n)).astype(np.float32)
    a, b = cudalab.asarray(a_host), cudalab.asarray(b_host)
    c = cudalab.zeros((m, n))
    s = cudalab.Stream()
    s.wait_stream(cudalab.current_stream())
    with cudalab.stream(s):
        h = cudalab.current_blas_handle()
        # row-major C = A @ B is column-major C^T = B^T @ A^T
        cublas.sgemm(h, cublas.OP_N, cublas.OP_N, n, m, k, 1.0, b.data_ptr(), n,
                     a.data_ptr(), k, 0.0, c.data_ptr(), n)
    s.synchronize()
    np.testing.assert_allclose(c.cpu(), a_host @ b_host, rtol=1e-4, atol=1e-4)
    # and a reduction of the product agrees too
    np.testing.assert_allclose(c.sum().item(), float((a_host @ b_host).sum()), rtol=1e-3,
                               atol=1e-2)
