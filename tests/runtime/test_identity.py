"""cudalab.identity.Identity: the launcher's ranks, the device's UUID and name, and the
plain dict that travels in snapshots, traces and samples (checked when read back)."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

import cudalab
from cudalab.identity import Identity, ranks_from_environment

TORCHRUN = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
           "OMPI_COMM_WORLD_SIZE": "4"}
PMI = {"PMI_RANK": "2", "PMI_SIZE": "6", "MPI_LOCALRANKID": "0"}


# ------------------------------------------------------------------ the launcher's environment
@pytest.mark.parametrize("env,expected", [
    ({}, (None, None, None)),
    (TORCHRUN, (5, 1, 8)),
    (OPENMPI, (3, 3, 4)),
    (PMI, (2, 0, 6)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, None, 2)),
    ({"RANK": "0"}, (0, None, None)),
    ({**OPENMPI, **TORCHRUN}, (5, 1, 8)),  # torchrun under mpirun: the worker's own ranks
    ({**PMI, **OPENMPI}, (3, 3, 4)),
    ({"RANK": "x", **OPENMPI}, (3, 3, 4)),  # malformed: the next launcher
    ({"RANK": "9", "WORLD_SIZE": "8", **PMI}, (2, 0, 6)),  # rank beyond the world: likewise
    ({"RANK": "-1"}, (None, None, None)),
    ({"RANK": " 7 ", "WORLD_SIZE": "0"}, (7, None, None)),  # a world of 0: unknown
    ({"RANK": "1", "LOCAL_RANK": "4", "WORLD_SIZE": "2"}, (1, None, 2)),
])
def test_ranks_from_the_launchers_environment(env, expected):
    assert ranks_from_environment(env) == expected


def test_current_reads_os_environ(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", *OPENMPI, *PMI):
        monkeypatch.delenv(name, raising=False)
    for k, v in OPENMPI.items():
        monkeypatch.setenv(k, v)
    ident = Identity.current(allocator="torch")
    assert (ident.rank, ident.local_rank, ident.world_size) == (3, 3, 4)
    assert ident.allocator == "torch"
    assert ident.pid == os.getpid() and ident.host == socket.gethostname()
    assert ident.version == cudalab.__version__
    for k in OPENMPI:
        monkeypatch.delenv(k)
    assert Identity.current().rank is None


# ------------------------------------------------------------------ the device
def test_current_names_the_device_from_the_driver():
    cudalab.init()
    n = cudalab.device_count()
    for d in range(n):
        ident = Identity.current(device=d)
        props = cudalab.get_device_properties(d)
        assert ident.device == d
        assert ident.device_uuid == props.nvml_uuid and ident.device_uuid.startswith(("GPU-", "MIG-"))
        assert ident.device_name == props.name == cudalab.get_device_name(d)
        if props.simulated:
            assert "simulated" in ident.device_name
    assert Identity.current(device=f"cuda:{n - 1}").device == n - 1
    with cudalab.device(n - 1):
        assert Identity.current().device == n - 1  # None: the current device
    # distinct devices, distinct UUIDs; the same device, the same UUID each time
    uuids = [Identity.current(device=d).device_uuid for d in range(n)]
    assert len(set(uuids)) == n
    assert uuids == [Identity.current(device=d).device_uuid for d in range(n)]


def test_the_simulators_uuid_is_stable_across_processes():
    import subprocess
    import sys

    code = ("import cudalab; from cudalab.identity import Identity; "
            "print(Identity.current(device=0).device_uuid)")
    env = dict(os.environ, CUDALAB_SIMULATOR="1")
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, check=True).stdout.strip() for _ in range(2)}
    assert len(out) == 1 and next(iter(out)).startswith("GPU-")


# ------------------------------------------------------------------ the record
def test_it_is_a_frozen_slotted_record():
    ident = Identity(host="h", pid=1, version="0.1.0", allocator="cudalab")
    assert not hasattr(ident, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ident.pid = 2  # type: ignore[misc]


def test_to_dict_from_dict_round_trip():
    full = Identity(host="node7", pid=4242, version="0.1.0", allocator="cudalab", rank=9,
                    local_rank=1, world_size=16, device=1,
                    device_uuid="GPU-f4acf50d-0d79-5f08-8bcc-895c63508791",
                    device_name="NVIDIA H200")
    bare = Identity(host="h", pid=1, version="0", allocator="torch")
    for ident in (full, bare, Identity.current()):
        d = ident.to_dict()
        assert set(d) == {f.name for f in dataclasses.fields(Identity)}
        assert all(v is None or type(v) in (str, int) for v in d.values())
        assert Identity.from_dict(d) == ident
    # a newer writer's extra keys are ignored; missing optional fields read as None
    d = bare.to_dict()
    d["gpu_clock"] = 1
    assert Identity.from_dict(d) == bare
    assert Identity.from_dict({"host": "h", "pid": 1, "version": "0", "allocator": "torch"}) == bare


GOOD = {"host": "h", "pid": 1, "version": "0.1.0", "allocator": "cudalab"}


@pytest.mark.parametrize("data,message", [
    ([1, 2], "identity is a list, expected a dict"),
    ({**GOOD, "pid": "12"}, "identity['pid'] is a str ('12'), expected an int"),
    ({**GOOD, "pid": 0}, "identity['pid'] is 0"),
    ({**GOOD, "pid": True}, "identity['pid'] is a bool"),
    ({**GOOD, "pid": None}, "identity['pid'] is a NoneType"),
    ({**GOOD, "rank": 1.0}, "identity['rank'] is a float (1.0), expected an int or None"),
    ({**GOOD, "rank": -1}, "identity['rank'] is -1"),
    ({**GOOD, "world_size": 0}, "identity['world_size'] is 0"),
    ({**GOOD, "rank": 4, "world_size": 4}, "identity['rank'] is 4, expected below world_size 4"),
    ({**GOOD, "local_rank": 4, "world_size": 2}, "identity['local_rank'] is 4"),
    ({**GOOD, "device": 1 << 40}, "identity['device'] is 1099511627776"),
    ({**GOOD, "host": ""}, "identity['host'] is empty"),
    ({**GOOD, "host": 7}, "identity['host'] is a int (7), expected a str"),
    ({**GOOD, "host": "x" * 5000}, "identity['host'] has 5000 characters"),
    ({**GOOD, "device_uuid": b"GPU-1"}, "identity['device_uuid'] is a bytes, expected a str or None"),
    ({**GOOD, "device_name": ["H200"]}, "identity['device_name'] is a list"),
    ({**GOOD, "allocator": None}, "identity['allocator'] is a NoneType"),
    ({k: v for k, v in GOOD.items() if k != "version"}, "identity lacks the key 'version'"),
])
def test_from_dict_rejects_bad_input_with_a_clear_message(data, message):
    with pytest.raises(ValueError) as info:
        Identity.from_dict(data)
    assert message in str(info.value)


def test_the_constructor_checks_the_invariants_too():
    with pytest.raises(ValueError, match=r"Identity\['pid'\]"):
        Identity(host="h", pid=-3, version="0", allocator="cudalab")
    with pytest.raises(ValueError, match="below world_size"):
        Identity(host="h", pid=3, version="0", allocator="cudalab", rank=2, world_size=2)


def test_from_dict_names_the_record_it_reads():
    with pytest.raises(ValueError, match=r"snapshot 'a\.pickle': identity\['pid'\]"):
        Identity.from_dict({**GOOD, "pid": "1"}, "snapshot 'a.pickle': identity")
