"""The unique id's carriers: the shared file (atomic write, waiting, timeout, wrong sizes), the
environment (hex, torchrun's variables, launch_env) and MPI (a fake communicator; mpi4py
missing). The backend's NCCL is replaced by a recorder of unique ids on the simulator."""

from __future__ import annotations

import importlib.util
import os
import threading
import time

import pytest

from cudalab import _internal
from cudalab._driver import mpi as mpi_driver
from cudalab.comm.rendezvous import (
    LaunchInfo,
    launch_env,
    launch_info_from_env,
    launch_info_from_mpi,
    unique_id_from_env,
    unique_id_from_file,
    unique_id_from_hex,
    unique_id_from_mpi,
    unique_id_hex,
    unique_id_to_hex,
)
from cudalab.errors import NcclError

UID = bytes(range(128))


class IdMaker:
    simulated = False

    def __init__(self):
        self.made = []
        self.fail = False

    def unique_id(self):
        if self.fail:
            raise NcclError("NCCL cannot be loaded: nccl4py is not installed")
        uid = os.urandom(128)
        self.made.append(uid)
        return uid


@pytest.fixture
def ids(backend, monkeypatch):
    maker = IdMaker()
    monkeypatch.setattr(backend, "nccl", lambda: maker)
    return maker


# ----------------------------------------------------------------------------- the file
def test_rank_0_writes_the_id_atomically(ids, tmp_path, monkeypatch):
    writes = []
    real = _internal.create_bytes_atomic  # (atomic and exclusive)
    monkeypatch.setattr(_internal, "create_bytes_atomic",
                        lambda path, data: (writes.append((path, data)), real(path, data)))
    path = tmp_path / "job.uid"
    uid = unique_id_from_file(path, 0)
    assert uid == ids.made[0] and path.read_bytes() == uid
    assert writes == [(os.fspath(path), uid)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.uid"]  # no temporary left


def test_other_ranks_read_what_rank_0_wrote(ids, tmp_path):
    path = tmp_path / "job.uid"
    results = {}

    def reader(rank):
        results[rank] = unique_id_from_file(path, rank, timeout=10)

    threads = [threading.Thread(target=reader, args=(r,)) for r in (1, 2, 3)]
    for t in threads:
        t.start()
    time.sleep(0.15)  # the readers are waiting for the file now
    assert not path.exists() and all(t.is_alive() for t in threads)
    uid = unique_id_from_file(str(path), 0)
    for t in threads:
        t.join(10)
    assert results == {1: uid, 2: uid, 3: uid}


def test_a_reader_times_out_with_a_clear_error(tmp_path):
    path = tmp_path / "never.uid"
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 1 waited 0.2 s for rank 0 to write the NCCL "
                                           r"unique id to .*never.uid"):
        unique_id_from_file(path, 1, timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 2


def test_the_timeout_says_when_the_directory_is_missing(tmp_path):
    with pytest.raises(TimeoutError, match="does not exist"):
        unique_id_from_file(tmp_path / "nowhere" / "job.uid", 3, timeout=0.05)


@pytest.mark.parametrize("content", [b"", b"x" * 127, b"x" * 129, b"x" * 4096])
def test_a_file_of_the_wrong_size_is_refused_at_once(tmp_path, content):
    path = tmp_path / "job.uid"
    path.write_bytes(content)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"not an NCCL unique id \(128 bytes"):
        unique_id_from_file(path, 1, timeout=60)
    assert time.monotonic() - start < 5


def test_rank_0_refuses_a_stale_file_unless_told(ids, tmp_path):
    path = tmp_path / "job.uid"
    path.write_bytes(b"s" * 128)
    with pytest.raises(FileExistsError, match="already exists .*fresh path per job"):
        unique_id_from_file(path, 0)
    assert ids.made == [] and path.read_bytes() == b"s" * 128
    uid = unique_id_from_file(path, 0, exist_ok=True)
    assert path.read_bytes() == uid != b"s" * 128


def test_rank_0s_racing_on_one_path_exactly_one_succeeds(ids, tmp_path, monkeypatch):
    """Several rank-0 processes (here threads) started together on one path: the file is
    created exclusively, so exactly one writes its id and the others get FileExistsError,
    even when all of them checked the path before any wrote it."""
    path = tmp_path / "job.uid"
    n = 6
    barrier = threading.Barrier(n)
    make = ids.unique_id

    def slow_id():  # every racer makes its id after all of them found no file
        uid = make()
        time.sleep(0.2)
        return uid

    monkeypatch.setattr(ids, "unique_id", slow_id)
    won, refused, other = [], [], []

    def racer():
        barrier.wait()
        try:
            won.append(unique_id_from_file(path, 0))
        except FileExistsError as exc:
            refused.append(str(exc))
        except BaseException as exc:  # pragma: no cover - reported below
            other.append(exc)

    threads = [threading.Thread(target=racer) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert other == [] and len(ids.made) == n
    assert len(won) == 1 and len(refused) == n - 1, (won, refused)
    assert path.read_bytes() == won[0]
    assert all("already exists" in text for text in refused)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.uid"]  # no temporary left


def test_a_directory_is_not_an_id_file(ids, tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory"):
        unique_id_from_file(tmp_path, 0)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        unique_id_from_file(tmp_path, 1, timeout=1)


def test_rank_0_without_nccl_writes_nothing(ids, tmp_path):
    ids.fail = True
    with pytest.raises(NcclError, match="nccl4py"):
        unique_id_from_file(tmp_path / "job.uid", 0)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, error, match", [
    ({"rank": -1}, ValueError, "rank must be >= 0"),
    ({"rank": "1"}, TypeError, "rank must be an int"),
    ({"rank": True}, TypeError, "rank must be an int"),
    ({"rank": 1, "timeout": 0}, ValueError, "timeout must be > 0"),
    ({"rank": 1, "timeout": float("nan")}, ValueError, "timeout must be > 0"),
    ({"rank": 1, "timeout": "5"}, TypeError, "timeout must be a number"),
])
def test_bad_file_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        unique_id_from_file(tmp_path / "job.uid", **kwargs)


# ----------------------------------------------------------------------------- environment
def test_hex_round_trip_and_a_fresh_hex_id(ids):
    assert unique_id_from_hex(unique_id_to_hex(UID)) == UID
    assert unique_id_from_hex("  " + UID.hex().upper() + "\n") == UID
    text = unique_id_hex()
    assert len(text) == 256 and bytes.fromhex(text) == ids.made[0]


@pytest.mark.parametrize("text, match", [
    ("ab" * 127, r"254 hex digits; an NCCL unique id is 256 \(128 bytes\)"),
    ("ab" * 129, r"258 hex digits"),
    ("", r"0 hex digits"),
    ("zz" + "ab" * 127, r"is not hex \(it holds 'z'\)"),
    ("ab" * 64 + " " + "ab" * 64, r"is not hex \(it holds ' '\)"),
])
def test_bad_hex_in_the_environment(text, match):
    with pytest.raises(ValueError, match=match) as info:
        unique_id_from_env(environ={"CUDALAB_NCCL_UNIQUE_ID": text})
    assert "CUDALAB_NCCL_UNIQUE_ID" in str(info.value)


def test_the_id_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUDALAB_NCCL_UNIQUE_ID", UID.hex())
    assert unique_id_from_env() == UID
    assert unique_id_from_env("MY_ID", {"MY_ID": UID.hex()}) == UID
    with pytest.raises(RuntimeError, match="MY_ID is not set"):
        unique_id_from_env("MY_ID", {})
    with pytest.raises(TypeError, match="must be a str"):
        unique_id_from_hex(UID)


def test_launch_info_from_env():
    assert launch_info_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == \
        LaunchInfo(3, 4, 1)
    assert launch_info_from_env({"RANK": " 0 ", "WORLD_SIZE": "1"}) == LaunchInfo(0, 1, None)


@pytest.mark.parametrize("env, error, match", [
    ({"WORLD_SIZE": "2"}, RuntimeError, "RANK is not set"),
    ({"RANK": "0"}, RuntimeError, "WORLD_SIZE is not set"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, ValueError, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, ValueError, "WORLD_SIZE=0"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, ValueError, "RANK=-1 is negative"),
    ({"RANK": "one", "WORLD_SIZE": "2"}, ValueError, "RANK='one' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, ValueError, "LOCAL_RANK='x'"),
])
def test_bad_launch_variables(env, error, match):
    with pytest.raises(error, match=match):
        launch_info_from_env(env)


def test_launch_env_for_a_child_keeps_the_base_and_reads_back():
    base = {"NCCL_NVLS_ENABLE": "0", "PATH": "/bin", "RANK": "9"}
    env = launch_env(UID, 1, 2, base=base)
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["PATH"] == "/bin"
    assert launch_info_from_env(env) == LaunchInfo(1, 2, 1)
    assert unique_id_from_env(environ=env) == UID
    assert base["RANK"] == "9"  # copied, not changed
    assert launch_env(UID, 0, 2, local_rank=5, base={})["LOCAL_RANK"] == "5"
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        launch_env(UID, 2, 2)
    with pytest.raises(TypeError, match="rank must be an int"):
        launch_env(UID, 1.0, 2)
    with pytest.raises(ValueError, match="has 3 bytes"):
        launch_env(b"abc", 0, 1)


# ----------------------------------------------------------------------------- MPI
class FakeMpiComm:
    """What unique_id_from_mpi uses of an mpi4py communicator; ``sent`` is what the root's
    bcast carries to this rank."""

    def __init__(self, rank, size, sent=None):
        self.rank, self.size, self.sent = rank, size, sent
        self.bcasts = []
        self.freed = False

    def Get_rank(self):  # noqa: N802 - mpi4py's names
        return self.rank

    def Get_size(self):  # noqa: N802
        return self.size

    def bcast(self, obj, root=0):
        self.bcasts.append((obj, root))
        return obj if self.rank == root else self.sent

    def Split_type(self, split_type, key=0):  # noqa: N802
        assert split_type == "shared"
        return FakeMpiComm(self.rank % 2, 2)

    def Free(self):  # noqa: N802
        self.freed = True


def test_the_mpi_root_creates_and_broadcasts(ids):
    root = FakeMpiComm(1, 3)
    uid = unique_id_from_mpi(root, root=1)
    assert uid == ids.made[0] and root.bcasts == [(("id", uid), 1)]
    other = FakeMpiComm(0, 3, sent=("id", uid))
    assert unique_id_from_mpi(other, root=1) == uid and other.bcasts == [(None, 1)]


def test_a_failed_root_fails_every_rank_instead_of_leaving_them_waiting(ids):
    ids.fail = True
    root = FakeMpiComm(0, 2)
    with pytest.raises(NcclError, match="nccl4py is not installed"):
        unique_id_from_mpi(root)
    (payload, _), = root.bcasts
    assert payload[0] == "error"  # the others were told
    other = FakeMpiComm(1, 2, sent=payload)
    with pytest.raises(NcclError, match=r"rank 0 could not create the NCCL unique id: "
                                        r"NcclError: NCCL cannot be loaded"):
        unique_id_from_mpi(other)


def test_a_bad_mpi_root(ids):
    with pytest.raises(ValueError, match=r"0 <= root < 2"):
        unique_id_from_mpi(FakeMpiComm(0, 2), root=2)


def test_launch_info_from_mpi_splits_by_node(monkeypatch):
    module = type("FakeMPI", (), {"COMM_TYPE_SHARED": "shared", "COMM_WORLD": FakeMpiComm(3, 4)})
    monkeypatch.setattr(mpi_driver, "_module", module)
    assert launch_info_from_mpi() == LaunchInfo(3, 4, 1)
    world = FakeMpiComm(2, 4)
    assert launch_info_from_mpi(world) == LaunchInfo(2, 4, 0)


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is not None, reason="mpi4py is installed")
def test_without_mpi4py_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setattr(mpi_driver, "_module", None)
    with pytest.raises(ImportError, match=r"needs mpi4py.*pip install 'cudalab\[mpi\]'"):
        unique_id_from_mpi()
    with pytest.raises(ImportError, match=r"cudalab\[mpi\]"):
        launch_info_from_mpi()
