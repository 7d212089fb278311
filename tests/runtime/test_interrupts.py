"""Ctrl-C reaches the user's code: never lost in a finalizer, never raised half-way through a
lazy import of cudalab's modules, and a real SIGINT stops an allocation loop (see
:mod:`cudalab._interrupts`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import cudalab
from tests.helpers.interrupts import count_events, frames_of, interrupt_at

CUDALAB_DIR = os.path.dirname(os.path.abspath(cudalab.__file__))
ROOT = os.path.dirname(CUDALAB_DIR)


def _del_frames(frame) -> bool:
    """DeviceArray.__del__ and the allocator's free that it calls."""
    fin = cudalab.DeviceArray.__del__.__code__
    return frame.f_code is fin or (frame.f_back is not None and frame.f_back.f_code is fin)


def test_an_interrupt_in_a_finalizer_reaches_the_caller(backend, deferring):
    """SIGINT at every line of DeviceArray.__del__ (and the free it calls): the interrupt is
    raised in the code that dropped the array, none is reported as "Exception ignored"."""
    unraisable: list = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    before = cudalab.memory_allocated()  # (earlier tests may hold arrays: on a GPU, more)
    try:
        def drop():
            x = cudalab.empty(1000)
            del x

        for _ in range(3):
            drop()  # (the cache holds its block now: a cache-hit pair)
        n = count_events(drop, _del_frames)
        assert n > 10
        sent = 0
        for k in range(1, n + 1):
            returned, exc, tripped = interrupt_at(drop, _del_frames, k)
            sent += tripped
            assert isinstance(exc, KeyboardInterrupt) or not tripped, \
                f"event {k}: the interrupt was lost"
            names = [f.f_code.co_name for f in frames_of(exc.__traceback__)]
            assert "__del__" not in names
        assert not unraisable
        assert sent >= n // 2
    finally:
        sys.unraisablehook = old_hook
    assert cudalab.memory_allocated() == before  # every dropped array's memory went back


def test_without_the_wrapper_a_finalizer_loses_the_interrupt(backend):
    """The injection is real: with Python's own handler, the interrupt raised in __del__ is
    reported as unraisable ("Exception ignored") and never reaches the caller."""
    def drop():
        x = cudalab.empty(1000)
        del x

    import cudalab.memory as cm

    for _ in range(3):
        drop()  # (creating the allocator installs the wrapper: replaced below)
    # blocks of arrays that other tests keep alive (an IPython shell's user namespace):
    # the cleanup below must not free them under their owners
    kept = set(cm.get_allocator(0).live)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    unraisable: list = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        lost = 0
        def in_del(frame) -> bool:  # (not the free: there it would wedge the lock)
            return frame.f_code is cudalab.DeviceArray.__del__.__code__

        for k in range(1, count_events(drop, in_del) + 1):
            _, exc, tripped = interrupt_at(drop, in_del, k, timeout=0.05)
            lost += tripped and exc is None
        assert lost and unraisable
        assert all(u.exc_type is KeyboardInterrupt for u in unraisable)
    finally:
        sys.unraisablehook = old_hook
        signal.signal(signal.SIGINT, old)
    for p in set(cm.get_allocator(0).live) - kept:  # what the lost frees left behind
        cm.caching_allocator_delete(p)


_LOOP = textwrap.dedent("""
    import json, os, random, signal, sys, threading, time
    import cudalab
    from cudalab import memory

    TRIALS = int(sys.argv[1])
    acked = threading.Event()
    lost = []

    def killer():
        rng = random.Random(23)
        for t in range(TRIALS):
            time.sleep(rng.uniform(0.0005, 0.01))
            acked.clear()
            os.kill(os.getpid(), signal.SIGINT)
            if not acked.wait(2.0):
                lost.append(t)
                os.kill(os.getpid(), signal.SIGINT)  # unstick the loop
                acked.wait(5.0)

    x = cudalab.empty(1000)  # first use: imports, the allocator
    del x
    threading.Thread(target=killer, daemon=True).start()
    inner = []
    for t in range(TRIALS):
        try:
            while True:
                x = cudalab.empty(1000)
                y = cudalab.empty(3000)
                del x
                p = memory.caching_allocator_alloc(4096)
                memory.caching_allocator_delete(p)
                del y
        except KeyboardInterrupt as exc:
            tb = exc.__traceback__  # where it was raised: the innermost frame but the handler's
            files = []
            while tb is not None:
                files.append(tb.tb_frame.f_code.co_filename)
                tb = tb.tb_next
            inner.append([f for f in files if not f.endswith("_interrupts.py")][-1])
            acked.set()
    a = memory.get_allocator(0)
    a.check_invariants()
    print(json.dumps({"lost": lost, "inner": inner, "locked": a._lock.locked()}))
""")


def test_sigint_stops_an_allocation_loop_every_time(tmp_path):
    """A real SIGINT, 40 times at random moments, into a process that allocates and drops
    arrays in a loop: each one stops the loop with KeyboardInterrupt raised outside the
    allocator and its finalizers, nothing is reported as "Exception ignored", and the
    allocator is intact afterwards."""
    script = tmp_path / "loop.py"
    script.write_text(_LOOP)
    env = dict(os.environ, CUDALAB_SIMULATOR="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, str(script), "40"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["lost"] == []
    assert len(out["inner"]) == 40
    inside = [f for f in out["inner"] if f.startswith(os.path.join(CUDALAB_DIR, "allocator"))]
    assert not inside
    assert not out["locked"]  # (and the child checked the invariants)


# ------------------------------------------------------------------------ lazy imports
_LAZY_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, {root!r})
    import numpy  # the test is about cudalab's own lazy imports
    import cudalab
    from tests.helpers.interrupts import count_events, interrupt_at

    def traced(frame):
        f = frame.f_code.co_filename
        return f.startswith({cud!r}) or f.startswith("<frozen importlib")

    def first_use():
        import cudalab as c
        x = c.empty(4)
        c.memory_allocated()
        del x

    if sys.argv[1] == "count":
        pid = os.fork()
        if pid == 0:
            print(count_events(first_use, traced), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        sys.exit(0)
    results = []
    for k in map(int, sys.argv[1].split(",")):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            signal.alarm(20)
            out = {{"k": k}}
            returned, exc, _ = interrupt_at(first_use, traced, k)
            out["returned"] = returned
            out["delivered"] = exc is not None
            tb = exc.__traceback__ if exc is not None else None
            inside = []  # frames of an import, or of cudalab's lazy-import functions
            while tb is not None:
                code = tb.tb_frame.f_code
                if ("importlib" in code.co_filename or code.co_name in ("<module>", "__getattr__",
                        "memory_api") or code.co_filename.startswith({alloc!r})):
                    inside.append(f"{{code.co_filename}}:{{code.co_name}}")
                tb = tb.tb_next
            out["inside"] = inside
            try:
                first_use()
                a = cudalab.empty(100)
                del a
                out["retry"] = "ok"
            except BaseException as e:
                out["retry"] = f"{{type(e).__name__}}: {{e}}"
            os.write(w, json.dumps(out).encode())
            os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.close(r)
        os.waitpid(pid, 0)
        results.append(json.loads(data) if data else {{"k": k, "retry": "child died"}})
    print(json.dumps(results))
""")


def test_an_interrupt_during_first_use_imports_is_deferred_and_retryable(tmp_path):
    """SIGINT at sampled lines of cudalab's first use (its lazy imports, importlib's frames
    included), each in a fresh forked process: the imports finish, the KeyboardInterrupt
    comes after them (never inside an import or the allocator), and using cudalab again
    works."""
    script = tmp_path / "lazy.py"
    script.write_text(_LAZY_CHILD.format(root=ROOT, cud=CUDALAB_DIR + os.sep,
                                         alloc=os.path.join(CUDALAB_DIR, "allocator", "")))
    env = dict(os.environ, CUDALAB_SIMULATOR="1")

    def run(arg: str) -> str:
        proc = subprocess.run([sys.executable, str(script), arg], capture_output=True,
                              text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
        return proc.stdout.strip().splitlines()[-1]

    n = int(run("count"))
    assert n > 1000
    ks = sorted({1, 2, 3, n, *range(5, n, max(1, n // 20))})
    for out in json.loads(run(",".join(map(str, ks)))):
        assert out["retry"] == "ok", out
        assert out["delivered"], out
        assert not out["inside"], out  # raised after the imports, never inside one
