"""Fixtures shared by the allocator tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def hold(backend):
    """hold(stream) keeps work queued on ``stream`` from completing until release()."""
    paused = []

    class Holder:
        def __call__(self, stream):
            if hasattr(backend, "pause_stream"):
                backend.pause_stream(stream.handle)
            else:  # a real GPU: keep the stream busy for a while
                from cudalab._kernels.spin import gpu_sleep

                gpu_sleep(500_000_000, stream=stream)
            paused.append(stream)

        def release(self):
            while paused:
                s = paused.pop()
                if hasattr(backend, "resume_stream"):
                    backend.resume_stream(s.handle)
                s.synchronize()

    h = Holder()
    yield h
    h.release()
