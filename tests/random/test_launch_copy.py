"""The RNG's raw launch (:func:`cudalab.random.launch.launch_kernel`) is a near-copy of
:meth:`cudalab._kernels.kernel.Kernel.launch`, kept for the launch-overhead rows of
benchmarks/rng.py ("cudalab rand(1000)", "cudalab uniform_(1000)"). These tests pin the two
together, so the two cannot drift: launched the same way, both paths must make the same
calls in the same order (context switch, the seam's pack-and-launch ``launch_values``, the
launch-blocking synchronise, the launch observers) and reject a closed stream the same way. Dropping or
reordering a step in either copy fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cudalab
from cudalab import _internal, kernels
from cudalab._kernels import kernel as facility
from cudalab._kernels.spin import spin
from cudalab.random import launch as rng_launch

ROOT = Path(__file__).resolve().parents[2]
GRID, BLOCK, ARGS = (1, 1, 1), (1, 1, 1), (0,)


def trace_both(patch) -> dict[str, list[tuple]]:
    """Launch ``spin`` through Kernel.launch and through the RNG's ``launch_kernel`` on a fresh
    stream, recording every step each makes; ``patch(obj, name, value)`` installs the
    recorders (monkeypatch.setattr, or a plain setattr in a subprocess)."""
    s = cudalab.Stream()
    dev = s.device_index
    spin.launch(GRID, BLOCK, ARGS, stream=s)  # bind the facility's runtime names, load
    s.synchronize()
    backend = s.backend
    log: list[tuple] = []
    real_launch, real_sync = backend.launch_values, backend.stream_synchronize
    real_ctx = facility._ensure_context

    def launch(function, grid, block, shared_mem, stream, args, values):
        log.append(("launch", function, tuple(grid), tuple(block), shared_mem, stream,
                    tuple(values)))
        return real_launch(function, grid, block, shared_mem, stream, args, values)

    def sync(stream):
        log.append(("synchronize", stream))
        return real_sync(stream)

    def ctx(device):
        log.append(("ensure_context", device))
        return real_ctx(device)

    patch(backend, "launch_values", launch)
    patch(backend, "stream_synchronize", sync)
    patch(facility, "_ensure_context", ctx)
    patch(rng_launch, "_ensure_context", ctx)
    observer = lambda *a: log.append(("observer", *a))  # noqa: E731
    _internal.launch_observers.append(observer)
    out: dict[str, list[tuple]] = {}
    try:
        for label, go in (
            ("Kernel.launch", lambda v: spin.launch(GRID, BLOCK, (v,), stream=s)),
            ("random.launch_kernel", lambda v: rng_launch.launch_kernel(spin, dev, s, GRID, BLOCK, (v,))),
        ):
            del log[:]
            go(1000)
            go(2000)  # a second launch: the cached argument pack must be refilled
            out[label] = list(log)
    finally:
        _internal.launch_observers.remove(observer)
    s.synchronize()
    return out


@pytest.mark.parametrize("blocking", [False, True])
def test_both_launch_paths_make_the_same_calls(backend, monkeypatch, blocking):
    old = kernels.is_launch_blocking()
    kernels.set_launch_blocking(blocking)
    try:
        got = trace_both(monkeypatch.setattr)
    finally:
        kernels.set_launch_blocking(old)
    a, b = got["Kernel.launch"], got["random.launch_kernel"]
    assert a == b
    steps = [e[0] for e in a]
    one = ["ensure_context", "launch"] + (["synchronize"] if blocking else []) + ["observer"]
    assert steps == one + one
    assert [e[-1] for e in a if e[0] == "launch"] == [(1000,), (2000,)]
    name, device, stream, grid, block = a[-1][1:]
    assert (name, device, grid, block) == ("cudalab_spin", stream.device_index, GRID, BLOCK)
    assert isinstance(stream, cudalab.Stream)


def test_both_launch_paths_honour_cuda_launch_blocking():
    """CUDA_LAUNCH_BLOCKING=1, read at import, makes both paths synchronise."""
    code = ("import cudalab, json\n"
            "from tests.random.test_launch_copy import trace_both\n"
            "cudalab.init()\n"
            "got = trace_both(setattr)\n"
            "print(json.dumps({k: [e[0] for e in v] for k, v in got.items()}))\n")
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", CUDALAB_SIMULATOR="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    one = ["ensure_context", "launch", "synchronize", "observer"]
    assert got == {"Kernel.launch": one + one, "random.launch_kernel": one + one}


def test_both_launch_paths_reject_a_closed_stream(backend, monkeypatch):
    s = cudalab.Stream()
    dev = s.device_index
    spin.launch(GRID, BLOCK, ARGS, stream=s)
    s.synchronize()
    s.close()
    launched = []
    monkeypatch.setattr(s.backend, "launch_values", lambda *a: launched.append(a))
    errors = []
    for go in (lambda: spin.launch(GRID, BLOCK, ARGS, stream=s),
               lambda: rng_launch.launch_kernel(spin, dev, s, GRID, BLOCK, ARGS)):
        with pytest.raises(RuntimeError) as info:
            go()
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    assert errors[0].endswith(f"cuda_stream={s.cuda_stream:#x}> was closed: it can no longer be used")
    assert launched == []
