"""cudalab.cluster on the real GPU: ranks under ``mpirun -n 2`` gathering over MPI and
publishing to a watch (then stopped by a Ctrl-C that mpirun forwards), and ranks under
``torchrun --nproc-per-node 2`` gathering over torch.distributed.

The launcher: ``CUDALAB_MPIRUN`` (a command line, e.g. ``/tmp/mpi/bin/mpirun``), else an
``mpirun`` beside this Python or on PATH. Both ranks share the host's GPUs (one H200 is
enough: MPI and gloo move the bytes, not NCCL).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.helpers import ROOT, WORKER, mpi_env, mpi_exports, mpirun, wait_for

pytestmark = pytest.mark.gpu


needs_mpi = pytest.mark.skipif(mpirun() is None or importlib.util.find_spec("mpi4py") is None,
                               reason="needs mpi4py and an mpirun (CUDALAB_MPIRUN)")


def _check_gather_output(out: str, world: int) -> None:
    lines = out.splitlines()
    own = {int(x.split()[1]): int(x.split()[2]) for x in lines if x.startswith("own ")}
    names = [x.split(None, 2)[2] for x in lines if x.startswith("device ")]
    peaks = json.loads(next(x[6:] for x in lines if x.startswith("peaks ")))
    snaps = json.loads(next(x[10:] for x in lines if x.startswith("snapshots ")))
    assert sorted(own) == list(range(world)), out
    assert {int(k): v for k, v in peaks.items()} == own, out  # byte-exact
    assert all(v >= 1 for v in snaps.values()), out
    assert names and not any("simulated" in n for n in names), names


@needs_mpi
def test_mpirun_ranks_gather_over_mpi():
    launcher = mpirun()
    assert launcher is not None
    env = mpi_env(launcher)
    res = subprocess.run([*launcher, *mpi_exports(env), "-n", "2", sys.executable, str(WORKER),
                          "--gather", "--engine", "mpi", "--mib", "64"],
                         env=env, capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    _check_gather_output(res.stdout, 2)


@needs_mpi
def test_mpirun_ranks_publish_and_stop_on_ctrl_c(tmp_path):
    publish_under_mpirun_and_interrupt(tmp_path, simulator=False)


def publish_under_mpirun_and_interrupt(tmp_path: Path, simulator: bool) -> None:
    """Two ranks under mpirun publish to a watch (real devices unless ``simulator``); a
    Ctrl-C to mpirun (which sends its ranks SIGTERM) ends them leaving no file."""
    from cudalab.cluster import watch

    launcher = mpirun()
    assert launcher is not None
    env = mpi_env(launcher, simulator=simulator, CUDALAB_CLUSTER=str(tmp_path))
    job = subprocess.Popen([*launcher, *mpi_exports(env), "-n", "2", sys.executable, str(WORKER),
                            "--hold", "--mib", "32"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    w = watch(tmp_path)
    try:
        # (a rank publishes an empty heartbeat until it has allocated)
        assert wait_for(lambda: [len(v) for v in w.samples().values()] == [1, 1], 30), (
            w, job.poll())
        samples = w.samples()
        assert sorted(samples) == [0, 1]
        for rank, per_device in samples.items():
            s = per_device[0]
            assert s.identity.rank == rank
            assert ("simulated" in (s.identity.device_name or "")) == simulator
            assert s.allocated >= (rank + 1) * 32 << 20
            assert s.nvml_error == "" and s.nvml_used is not None  # NVML (or the simulator's)
        assert w.job is not None and w.job.startswith("mpi:")
        got = w.fetch(("snapshot", "stats"))
        assert sorted(got) == [0, 1], w.fetch_errors
        # the peaks a sample shows are the allocator's own (a sample taken after the fetch:
        # one taken before the worker's last allocation shows the peak of then)
        assert wait_for(lambda: all(
            r.stats[0]["allocated_bytes.all.peak"] == w.samples()[k][0].peak_allocated
            for k, r in got.items()), 3), (got, w.samples())
        time.sleep(0.2)
        os.killpg(job.pid, signal.SIGINT)  # a terminal's Ctrl-C: mpirun sends its ranks SIGTERM
        out, err = job.communicate(timeout=30)
        assert "Traceback" not in err, err
        assert list(tmp_path.glob("*.json")) == [], "a rank left its connection file"
        assert wait_for(lambda: w.lost() == [0, 1], 3)
    finally:
        w.close()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")


def _torchrun_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), NCCL_NVLS_ENABLE="0", **extra)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: gloo on the loopback (no DNS needed)
    env.pop("CUDALAB_SIMULATOR", None)
    env.pop("CUDALAB_CLUSTER_PUBLISHER", None)
    return env


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", str(WORKER)]


@needs_torch
@pytest.mark.parametrize("tensors", [False, True], ids=["cudalab-arrays", "torch-tensors"])
def test_torchrun_ranks_gather_over_torch_distributed(tensors):
    """gloo moves the bytes (two ranks share the one GPU: NCCL would refuse); with torch
    tensors the records are torch's allocator's, byte-exact against torch's memory_stats."""
    res = subprocess.run([*TORCHRUN, "--gather", "--engine", "torch", "--backend", "gloo",
                          "--mib", "64", *(["--torch-tensors"] if tensors else [])],
                         env=_torchrun_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    _check_gather_output(res.stdout, 2)
    allocators = json.loads(next(x[11:] for x in res.stdout.splitlines()
                                 if x.startswith("allocators ")))
    assert set(allocators.values()) == {"torch" if tensors else "cudalab"}, allocators


@needs_torch
def test_torchrun_torch_ranks_publish_and_stop_on_ctrl_c(tmp_path):
    """A torch job watched like a cudalab one: its samples are torch's allocator's."""
    from cudalab.cluster import watch

    job = subprocess.Popen([*TORCHRUN, "--hold", "--torch-tensors", "--mib", "32"],
                           env=_torchrun_env(CUDALAB_CLUSTER=str(tmp_path)),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    w = watch(tmp_path)
    try:
        assert wait_for(lambda: sorted(w.samples()) == [0, 1] and all(
            any(s.identity.allocator == "torch" for s in v) for v in w.samples().values()), 60), (
            w, job.poll())
        assert w.job is not None and w.job.startswith("torchrun:")
        for rank, samples in w.samples().items():
            mine = [s for s in samples if s.identity.allocator == "torch"]
            assert mine[0].allocated >= (rank + 1) * 32 << 20
        os.killpg(job.pid, signal.SIGINT)  # torchrun sends its workers SIGTERM
        out, err = job.communicate(timeout=30)
        assert list(tmp_path.glob("*.json")) == [], "a rank left its connection file"
    finally:
        w.close()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
