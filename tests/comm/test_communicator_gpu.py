"""Communicator across real processes on real GPUs (skipped without two GPUs and nccl4py).

Each test starts the ranks of tests/comm/multiprocess_worker.py as separate processes (plain
``subprocess``: rendezvous by a file in a fresh temporary directory, device = rank; or
``mpirun`` when ``CUDALAB_MPIRUN`` names one) and asserts that every rank exits 0 in time.
A rank that is still running at the deadline is killed: CI never hangs here. Children keep
``NCCL_NVLS_ENABLE=0`` (set when absent: multicast must stay off on our machines).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.gpu import HAS_GPU

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("multiprocess_worker.py")
WORLD = 2
DEADLINE_SECONDS = 240


def _gpu_count() -> int:
    if not HAS_GPU:
        return 0
    import cudalab

    return cudalab.device_count()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(_gpu_count() < WORLD, reason=f"needs {WORLD} real GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("nccl") is None,
                       reason="needs nccl4py (pip install 'cudalab[nccl]')"),
]


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.pop("CUDALAB_SIMULATOR", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("NCCL_DEBUG", "WARN")
    env.update(extra or {})
    return env


def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A process in its own session, so that it and its children can be killed together."""
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_all(processes: list[subprocess.Popen], what: str) -> None:
    """Every process exits 0 before the deadline; otherwise kill them all and fail with
    their output."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    outputs = []
    timed_out = False
    for proc in processes:
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            for p in processes:
                _kill(p)
            out, _ = proc.communicate()
        outputs.append(out)
    for p in processes:  # (reap any killed ones)
        if p.poll() is None:
            _kill(p)
            p.wait()
    report = "\n".join(f"--- {what} process {i} (exit {p.returncode}) ---\n{out[-6000:]}"
                       for i, (p, out) in enumerate(zip(processes, outputs)))
    assert not timed_out, f"{what}: a rank hung (killed after {DEADLINE_SECONDS} s)\n{report}"
    assert all(p.returncode == 0 for p in processes), report
    assert all("all checks passed" in out for out in outputs), report


@pytest.mark.parametrize("world", [WORLD, 4])
def test_processes_with_a_file_rendezvous(tmp_path, world):
    if _gpu_count() < world:
        pytest.skip(f"needs {world} real GPUs")
    uid_file = tmp_path / "job.uid"  # a fresh path for this job
    processes = [
        _start([sys.executable, str(WORKER), "--rank", str(rank), "--world-size", str(world),
                "--uid-file", str(uid_file)], _child_env())
        for rank in range(world)
    ]
    _wait_all(processes, "file rendezvous")


def _mpirun() -> list[str] | None:
    """The launcher named by CUDALAB_MPIRUN (a command line, e.g. ``/tmp/mpi/bin/mpirun``)."""
    text = os.environ.get("CUDALAB_MPIRUN", "").strip()
    return shlex.split(text) if text else None


@pytest.mark.skipif(_mpirun() is None, reason="set CUDALAB_MPIRUN to an mpirun to run this")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None,
                    reason="needs mpi4py (pip install 'cudalab[mpi]')")
@pytest.mark.parametrize("world", [WORLD, 4])
def test_processes_under_mpirun(world):
    if _gpu_count() < world:
        pytest.skip(f"needs {world} real GPUs")
    launcher = _mpirun()
    assert launcher is not None
    extra = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    prefix = Path(launcher[0]).resolve().parent.parent  # <prefix>/bin/mpirun
    if (prefix / "lib").is_dir():  # an MPI installed outside the system's library path
        extra["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(prefix / "lib"), os.environ.get("LD_LIBRARY_PATH")]))
        extra["OPAL_PREFIX"] = str(prefix)
    command = [*launcher, "-n", str(world), sys.executable, str(WORKER), "--mpi"]
    process = _start(command, _child_env(extra))
    try:
        out, _ = process.communicate(timeout=DEADLINE_SECONDS)
    except subprocess.TimeoutExpired:
        _kill(process)
        out, _ = process.communicate()
        pytest.fail(f"mpirun: a rank hung (killed after {DEADLINE_SECONDS} s)\n{out[-6000:]}")
    assert process.returncode == 0, out[-8000:]
    assert out.count("all checks passed") == world, out[-8000:]
