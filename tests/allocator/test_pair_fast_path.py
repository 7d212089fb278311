"""The torch-style pair's fast path (issue 37, section 3): ``caching_allocator_alloc`` with
the default arguments on a one-device process skips the per-thread device read, and the
native allocators keep their attributes inline, so that method calls on them are
specialised by the interpreter.

CPython keeps an object's attributes inline (in its class's shared keys) up to 30 names;
past that it materialises the object's dict, and then no ``a.malloc(...)`` or ``a.free(...)``
on it can be specialised (cudalab.memory's ``caching_allocator_alloc`` / ``_delete`` make
those calls on every pair). The allocators keep most fields in ``__slots__`` for that.
"""

from __future__ import annotations

import dis
import os
import subprocess
import sys
import textwrap

import pytest

from cudalab.allocator.config import parse_alloc_conf
from cudalab.allocator.registry import native_allocator

#: CPython's bound on the names of an object's inline attributes (SHARED_KEYS_MAX_SIZE).
INLINE_MAX = 30


@pytest.fixture
def sim(monkeypatch):
    import cudalab
    from cudalab._driver.sim import SimulatorBackend

    cudalab.init()
    monkeypatch.setenv("CUDALAB_SIMULATOR_MEMORY", "1GiB")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    backend = SimulatorBackend()
    backend.init()
    return backend


def _used(backend, conf: str):
    a = native_allocator(backend, 0, parse_alloc_conf(conf), stream_resolver=lambda: 0)
    for size in (4096, 4096, 4096, 1 << 20, 700):  # plain paths, the memo, the slow path
        a.free(a.malloc(size))
    return a


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_a_used_allocator_keeps_few_enough_attributes_to_stay_inline(sim, conf):
    a = _used(sim, conf)
    try:
        names = list(a.__dict__)  # (materialises this throwaway allocator's dict)
        assert len(names) <= INLINE_MAX, (type(a).__name__, len(names), names)
    finally:
        a.empty_cache()


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's specialisation")
def test_the_method_calls_of_the_pair_are_specialised(sim):
    a = _used(sim, "")

    def pair(a, n):
        for _ in range(n):
            a.free(a.malloc(4096))

    try:
        pair(a, 200)  # past the interpreter's warm-up
        loads = [i.opname for i in dis.get_instructions(pair, adaptive=True)
                 if i.argval in ("malloc", "free")]
        assert len(loads) == 2, loads
        assert all("WITH_VALUES" in op for op in loads), loads
    finally:
        a.empty_cache()


_SOLE = """
    import os, threading, cudalab, cudalab.memory as cm
    from cudalab import devices
    cudalab.init()
    print("sole", devices.sole_device, cudalab.device_count())
    seen = []

    def work(dev):
        if dev is not None:
            cudalab.set_device(dev)
        p = cm.caching_allocator_alloc(4096)  # the current device's allocator
        seen.append((dev, [a.device for a in cm._active if p in a.live]))
        cm.caching_allocator_delete(p)

    for dev in (None, 0, 1):
        if dev is None or dev < cudalab.device_count():
            t = threading.Thread(target=work, args=(dev,))
            t.start()
            t.join()
    print("seen", sorted(seen, key=repr))
    pid = os.fork()
    if pid == 0:  # a fork's child: no CUDA, and the flag says so
        os._exit(0 if not devices.sole_device and not devices.initialized else 3)
    print("child", os.waitpid(pid, 0)[1])
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("count", [1, 2])
def test_the_sole_device_flag_follows_the_device_count_and_a_fork(count):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDALAB_")}
    env.update(CUDALAB_SIMULATOR="1", CUDALAB_SIMULATOR_DEVICES=str(count))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_SOLE)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"sole {count == 1} {count}"
    want = [(0, [0]), (None, [0])] + ([(1, [1])] if count == 2 else [])
    assert lines[1] == f"seen {sorted(want, key=repr)}"
    assert lines[2] == "child 0"
