"""Capture queries on the legacy null stream need a current context (issue 36 item 2).

The null stream (handle 0) names the current context's stream, so the driver answers
``cuStreamIsCapturing(0)`` with ``CUDA_ERROR_INVALID_CONTEXT`` on a thread where no context
is current; the simulator models that, and cudalab makes the stream's context current
before asking (as torch allows ``torch.cuda.init(); torch.cuda.empty_cache()``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

import pytest

import cudalab
from cudalab.errors import CudaError


def _in_fresh_thread(fn: Callable[[], object]) -> list[BaseException]:
    """Run ``fn`` in a new thread (no context is current there); the exceptions it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return errors


def test_the_simulator_refuses_a_null_stream_capture_query_without_a_context(backend):
    if not backend.simulated:
        pytest.skip("models the driver on the simulator")
    null = backend.null_stream(0)
    errors = _in_fresh_thread(lambda: backend.stream_is_capturing(null))
    assert len(errors) == 1 and isinstance(errors[0], CudaError), errors
    assert errors[0].code == 201 and "CUDA_ERROR_INVALID_CONTEXT" in str(errors[0])
    # with the context current it answers
    backend.set_context(0)
    assert backend.stream_is_capturing(null) is False


@pytest.mark.parametrize("call", [
    cudalab.empty_cache,
    cudalab.memory.memory_snapshot,
    cudalab.is_current_stream_capturing,
], ids=["empty_cache", "memory_snapshot", "is_current_stream_capturing"])
def test_capture_checks_work_on_a_thread_with_no_current_context(call):
    cudalab.init()
    assert _in_fresh_thread(call) == []


def test_init_then_empty_cache_in_a_fresh_process():
    code = "import cudalab; cudalab.init(); cudalab.empty_cache(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
