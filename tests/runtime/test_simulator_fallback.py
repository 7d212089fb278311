"""The simulator as a fallback, and the "no driver" message (issue 22, defects 1 and 4).

Each test runs in a fresh interpreter without ``CUDALAB_SIMULATOR``, with the real backend's
driver probe forced to fail (``cuInit`` raises the loader's error and NVML is missing, or
answers as configured), so they behave the same on a GPU host and in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

#: Makes the real backend look like a machine without a driver. ``NVML_UUIDS`` None: NVML
#: is missing too; a list: NVML answers with those GPUs (cuInit still fails).
_NO_DRIVER = """
import cudalab
from cudalab._driver import cuda as C
from cudalab.errors import NvmlError

def _no_libcuda(flags):
    raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")

class _Nvml:
    def uuids(self):
        if NVML_UUIDS is None:
            raise NvmlError("NVML is not available")
        return list(NVML_UUIDS)

C.cuInit = _no_libcuda
C.CudaBackend.nvml = lambda self: _Nvml()
"""


def _run(code: str, nvml_uuids: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CUDALAB_") and k != "CUDA_VISIBLE_DEVICES"}
    script = f"NVML_UUIDS = {nvml_uuids!r}\n" + _NO_DRIVER + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)


def test_use_simulator_after_is_available_is_a_fallback():
    r = _run("""
        assert not cudalab.is_initialized()
        assert cudalab.is_available() is False and cudalab.device_count() == 0
        assert not cudalab.is_initialized()
        cudalab.use_simulator()  # the torch user's first check: must not raise
        assert cudalab.is_available() and cudalab.device_count() >= 1
        a = cudalab.zeros(2, 3)
        a.fill_(1.5)
        assert a.numpy().sum() == 9.0
        assert cudalab.get_device_properties(0).simulated
        assert cudalab.is_initialized()
        cudalab.use_simulator()  # same backend again: a no-op
        try:
            cudalab.use_simulator(False)
        except RuntimeError as e:
            print('locked:', e)
    """)
    assert r.returncode == 0, r.stderr
    locked = r.stdout.split("locked:", 1)[1]
    # The error says what is_initialized() says.
    assert "is_initialized() is True" in locked and "'simulator'" in locked


def test_use_simulator_after_a_failed_init():
    r = _run("""
        try:
            cudalab.current_device()
        except cudalab.CudaUnavailableError:
            pass
        else:
            raise SystemExit('no error without a driver')
        assert not cudalab.is_initialized()
        cudalab.use_simulator()
        cudalab.synchronize()
        print(cudalab.get_device_name(0))
    """)
    assert r.returncode == 0, r.stderr
    assert "simulated" in r.stdout


def test_switch_forgets_the_probed_device_count():
    # NVML answers (3 GPUs) but the driver does not: the probe's count must not survive.
    r = _run("""
        assert cudalab.device_count() == 3
        cudalab.use_simulator()
        from cudalab._driver.sim import SimulatorBackend
        n = SimulatorBackend().device_count()
        assert cudalab.device_count() == n != 3, (cudalab.device_count(), n)
        cudalab.init()
        assert cudalab.device_count() == n
    """, nvml_uuids=["GPU-a", "GPU-b", "GPU-c"])
    assert r.returncode == 0, r.stderr


def test_no_switch_in_a_forked_child():
    r = _run("""
        import os
        cudalab.use_simulator()
        cudalab.init()
        pid = os.fork()
        if pid == 0:
            assert not cudalab.is_initialized()
            cudalab.use_simulator()  # the backend it has: still a no-op
            try:
                cudalab.use_simulator(False)
            except RuntimeError as e:
                os._exit(0 if 'forked' in str(e) else 3)
            os._exit(4)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"


def test_no_driver_message_is_short_and_hints_once():
    r = _run("""
        for _ in range(3):
            try:
                cudalab.init()
            except cudalab.CudaUnavailableError as e:
                print(repr(str(e)))
                loader = e.__cause__ and e.__cause__.__cause__
                print('loader:', type(loader).__name__ if loader else None)
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    messages = [eval(line) for line in lines[0::2]]  # noqa: S307 - our own repr() output
    assert len(messages) == 3
    first, second, third = messages
    for m in messages:
        assert len(m) <= 200, m
        assert ".." not in m, m
        assert m.startswith("cudalab cannot use CUDA: no NVIDIA driver found"), m
    assert "CUDALAB_SIMULATOR=1" in first and "use_simulator()" in first
    assert "CUDALAB_SIMULATOR" not in second and "simulator" not in second
    assert third == second
    # The loader's own text is not lost: it is the chained cause of the first error.
    assert lines[1] == "loader: OSError"
