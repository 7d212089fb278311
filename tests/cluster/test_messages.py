"""cudalab.cluster's pieces without processes: signing, connection files, message decoding,
rank records (bounded, checked, never a plain unpickle)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

import pytest

import cudalab
from cudalab.cluster import connection, records, signing, wire
from cudalab.identity import Identity
from cudalab.memory_sources import CudalabSource
from cudalab.memory_tools.safe_pickle import SnapshotLoadError


# ----------------------------------------------------------------------------- signing
def test_a_signature_checks_only_the_frames_it_signed():
    key = signing.new_key()
    frames = [b"header", b"payload"]
    sig = signing.sign(key, frames)
    assert len(sig) == signing.SIGNATURE_LENGTH
    assert signing.verify(key, sig, frames)
    assert not signing.verify(key, sig, [b"header", b"payloaD"])
    assert not signing.verify(signing.new_key(), sig, frames)
    # the frames' boundaries are signed: the same bytes cut elsewhere differ
    assert not signing.verify(key, sig, [b"headerp", b"ayload"])
    assert not signing.verify(key, sig[:-1], frames)  # wrong length: refused, no error
    with pytest.raises(ValueError, match="key is empty"):
        signing.sign(b"", frames)


def test_the_signer_counts_what_it_refuses():
    signer = signing.Signer(b"k" * 32)
    message = signer.wrap([b"a", b"b"])
    assert signer.unwrap(message) == [b"a", b"b"] and signer.rejected == 0
    assert signer.unwrap([b"0" * 64, b"a", b"b"]) is None
    assert signer.unwrap([b"lonely"]) is None
    assert signer.rejected == 2
    with pytest.raises(ValueError, match="non-empty bytes"):
        signing.Signer(b"")


def test_the_prepared_key_signs_as_the_hmac_module():
    """The signer's prepared inner and outer states give hmac's HMAC-SHA256 of each frame's
    length and bytes, in order, for small and large messages and any key length."""
    import hashlib
    import hmac

    key = signing.new_key()

    def reference(frames):
        mac = hmac.new(key, digestmod=hashlib.sha256)
        for f in frames:
            mac.update(len(f).to_bytes(8, "little"))
            mac.update(f)
        return mac.hexdigest().encode()

    big = os.urandom(1 << 20)
    signer = signing.Signer(key)
    for frames in ([b"h", b""], [b"header", b"x" * 1000], [b"header", big], [big[:10], big]):
        assert signing.sign(key, frames) == reference(frames)
        message = signer.wrap(frames)
        assert message[0] == reference(frames) and signer.unwrap(message) == frames
        assert signer.unwrap([message[0], *frames[:-1], frames[-1] + b"!"]) is None
    assert signer.rejected == 4
    for length in (1, 63, 64, 65, 200):  # (a key longer than a block is hashed first)
        key = os.urandom(length)
        assert signing.sign(key, [b"a", big]) == reference([b"a", big])


def test_a_preformatted_samples_header_is_the_header():
    prefix = wire.samples_header_prefix('job "7"', 3, 1234)
    for time_, error in ((1700000000.123456, ""), (0.5, 'bad "thing"\n'), (3.0, "é")):
        head = wire.samples_header(prefix, 12, time_, 2, 1, wire.encode_json(error))
        expect = wire.header("samples", job='job "7"', rank=3, pid=1234, seq=12, time=time_,
                             dropped=2, rejected=1, error=error)
        assert wire.decode_header(head, "samples", "t") == wire.decode_header(expect, "samples",
                                                                              "t")


# ----------------------------------------------------------------------------- connection files
def _info(**changes):
    identity = Identity(host="h", pid=os.getpid(), version="0", allocator="cudalab", rank=2,
                        world_size=4)
    values = dict(job="j", rank=2, address="127.0.0.1", publish_port=5000, request_port=5001,
                  key=b"k" * 32, identity=identity, started=time.time())
    values.update(changes)
    return connection.ConnectionInfo(**values)


def test_a_connection_file_round_trips_privately(tmp_path):
    info = _info()
    path = info.write(tmp_path / "new")
    assert (os.stat(path).st_mode & 0o777) == 0o600
    back = connection.read_connection(path)
    assert back.path == path and back.key == info.key and back.identity == info.identity
    assert (back.job, back.rank, back.publish_port, back.request_port) == ("j", 2, 5000, 5001)
    assert back.endpoint(5000) == "tcp://127.0.0.1:5000"
    assert _info(address="::1").endpoint(1) == "tcp://[::1]:1"
    assert not list((tmp_path / "new").glob(".*.tmp"))  # the atomic write left nothing


@pytest.mark.parametrize("content, message", [
    (b"{oops", "not JSON"),
    (b"[1]", "not a cudalab cluster connection file"),
    (b'{"kind": "cudalab.cluster", "version": 9}', "version 9"),
    (b"[" * 60_000, "nested more than 32 levels"),
    (b" " * (connection.MAX_FILE_BYTES + 1), "larger than"),
])
def test_a_bad_connection_file_gets_a_clear_error(tmp_path, content, message):
    path = tmp_path / "rank-0-x-1.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        connection.read_connection(path)


def test_a_connection_file_with_a_bad_field_names_it(tmp_path):
    path = _info().write(tmp_path)
    text = open(path).read()
    for old, new, message in (('"publish_port": 5000', '"publish_port": 0', "publish_port"),
                              ('"key": "6b', '"key": "zz', "key is not hex"),
                              ('"rank": 2,', '"rank": -1,', "rank")):
        with open(path, "w") as f:
            f.write(text.replace(old, new, 1))
        with pytest.raises(ValueError, match=message):
            connection.read_connection(path)


def test_scan_sorts_live_stale_and_bad(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    import socket

    host = socket.gethostname()
    live = _info(identity=Identity(host=host, pid=os.getpid(), version="0", allocator="c"))
    dead = _info(rank=3, identity=Identity(host=host, pid=int(done.stdout), version="0",
                                           allocator="c"))
    elsewhere = _info(rank=4, identity=Identity(host="another-host", pid=int(done.stdout),
                                                version="0", allocator="c"))
    paths = [i.write(tmp_path) for i in (live, dead, elsewhere)]
    (tmp_path / "junk.json").write_text("{")
    (tmp_path / "notes.txt").write_text("ignored")
    found = connection.scan(tmp_path)
    assert sorted(i.path for i in found.live) == sorted([paths[0], paths[2]])
    assert [i.path for i in found.stale] == [paths[1]]
    assert [os.path.basename(p) for p, _ in found.bad] == ["junk.json"]
    assert connection.scan(tmp_path / "missing") == ([], [], [])


@pytest.mark.parametrize("env, expected", [
    ({"CUDALAB_CLUSTER_JOB": "mine", "PMIX_NAMESPACE": "x"}, "mine"),
    ({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "a", "MASTER_PORT": "29500"},
     "torchrun:none:a:29500"),
    ({"PMIX_NAMESPACE": "prterun-h-12@1"}, "mpi:prterun-h-12@1"),
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}, "slurm:77.0"),
])
def test_the_job_comes_from_the_launcher(env, expected):
    assert connection.job_id(env) == expected


def test_without_a_launcher_the_job_is_the_parent_process():
    assert connection.job_id({}).endswith(f":{os.getppid()}")


def test_the_rank_falls_back_to_the_pid():
    assert connection.rank_number(Identity(host="h", pid=321, version="0",
                                           allocator="c")) == 321
    assert connection.rank_number(Identity(host="h", pid=321, version="0", allocator="c",
                                           rank=5)) == 5


# ----------------------------------------------------------------------------- messages
def test_headers_are_bounded_and_checked():
    head = wire.header("request", id="a", what=["stats"], tail=3)
    assert wire.decode_header(head, "request", "r")["tail"] == 3
    with pytest.raises(wire.MessageError, match="expected version 1 'reply'"):
        wire.decode_header(head, "reply", "r")
    with pytest.raises(wire.MessageError, match=r"header\['tail'\] is '3'"):
        wire.decode_header(wire.header("request", id="a", what=[], tail="3"), "request", "r")
    with pytest.raises(wire.MessageError, match="more than the limit"):
        wire.decode_header(b" " * (wire.MAX_HEADER_BYTES + 1), "request", "r")
    with pytest.raises(wire.MessageError, match="nested more than"):
        wire.decode_header(b"[" * 40 + b"]" * 40, "request", "r")
    # brackets inside strings do not count
    assert wire.decode_json(b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', "x", 100)


def test_samples_round_trip_and_a_bad_one_is_named():
    cudalab.zeros(10)
    import dataclasses

    from cudalab.memory_sources import CudalabSource

    # (private pools travel as JSON: a pool dict holding tuples comes back with lists; the
    # pools are the memory tooling's own plain data, compared here without them)
    sample = dataclasses.replace(CudalabSource().sample(0), pools=())
    data = wire.encode_samples([sample])
    assert wire.decode_samples(data, "rank 1") == [sample]
    bad = data.replace(b'"allocated":', b'"allocated":"1",  "x":', 1)
    with pytest.raises(wire.MessageError, match=r"rank 1: samples\[0\]\['allocated'\]"):
        wire.decode_samples(bad, "rank 1")
    with pytest.raises(wire.MessageError, match="expected a list"):
        wire.decode_samples(b"{}", "rank 1")


# ----------------------------------------------------------------------------- records
def test_records_round_trip_with_every_part():
    kept = cudalab.zeros(1 << 18)
    # (cudalab's own allocator: in a process where torch runs CUDA, rank_source is torch's)
    got = records.decode(records.encode(records.collect(records.WHAT, CudalabSource())),
                         "mine")
    stats = cudalab.memory.memory_stats(0)
    assert got.identity.pid == os.getpid()
    assert got.stats[0]["allocated_bytes.all.peak"] == stats["allocated_bytes.all.peak"]
    assert got.peaks()[0] == stats["allocated_bytes.all.peak"]
    # a sample per device with an allocator (device 0 here, others if earlier tests used them)
    assert [s.device for s in got.samples] == records.source_devices(CudalabSource())
    assert got.samples[0].device == 0 and got.samples[0].allocated == stats[
        "allocated_bytes.all.current"]
    assert got.snapshot is not None and got.snapshot["segments"]
    del kept


def test_records_refuse_code_and_malformed_parts():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(SnapshotLoadError, match="refusing to load rank 3's records"):
        records.decode(pickle.dumps({"identity": {}, "x": Evil()}), "rank 3's records")
    identity = Identity.current().to_dict()
    for part, message in (({"stats": {0: {"a": "1"}}}, r"stats\[0\]\['a'\]"),
                          ({"stats": {"0": {}}}, "device key '0'"),
                          ({"history_tail": {0: [{"action": 3, "size": 1}]}}, "action"),
                          ({"snapshot": {"segments": 3}}, "segments"),
                          ({"samples": [{}]}, r"samples\[0\]")):
        with pytest.raises(SnapshotLoadError, match=message):
            records.decode(pickle.dumps({"identity": identity, **part}), "r")
    with pytest.raises(SnapshotLoadError, match="identity"):
        records.decode(pickle.dumps({"stats": {}}), "r")
    with pytest.raises(SnapshotLoadError, match="more than the limit"):
        records.decode(pickle.dumps({"identity": identity, "pad": b"x" * 2000}), "r",
                       max_bytes=1000)


def test_bad_parts_and_tails_are_refused():
    with pytest.raises(ValueError, match="unknown part 'stat'"):
        records.check_what(("stat",), "gather()")
    with pytest.raises(ValueError, match="names no part"):
        records.check_what((), "gather()")
    with pytest.raises(TypeError, match="tail must be an int"):
        records.check_tail(1.5, "gather()")
    with pytest.raises(ValueError, match="tail is -1"):
        records.check_tail(-1, "gather()")


def test_the_package_names_stay_functions_after_every_submodule_is_imported():
    import importlib

    import cudalab.cluster as cluster

    for name in ("signing", "connection", "wire", "records", "publisher", "watching",
                 "gathering"):
        importlib.import_module(f"cudalab.cluster.{name}")
    assert callable(cluster.watch) and callable(cluster.gather) and callable(cluster.serve)
    assert cluster.watch.__module__ == "cudalab.cluster.watching"


# ----------------------------------------------------------------------------- trace columns
def _history_records(n: int = 50):
    from cudalab import memory

    memory.record_history(max_entries=1000)
    try:
        kept = [cudalab.zeros(256 + 16 * i) for i in range(n)]
        del kept
        return records.collect(("history_tail", "snapshot"), CudalabSource(), tail=20)
    finally:
        memory.record_history(None)


def test_trace_entries_travel_as_columns_and_come_back_equal():
    sent = _history_records()
    got = records.decode(records.encode(sent), "r")
    assert got.trace_columns  # columns, numpy for the integer keys
    cols = got.trace_columns[0]
    assert cols.n == len(sent["snapshot"]["device_traces"][0])
    assert type(cols.columns["addr"]).__name__ == "ndarray"
    assert got.snapshot == sent["snapshot"]  # dicts built on first access, equal
    assert got.history_tail == sent["history_tail"]
    assert got.history_tail[0][-1] is got.snapshot["device_traces"][0][-1]
    # an entry lacking a key (an oom entry has device_free, not addr) travels too
    oom = dict(sent["snapshot"]["device_traces"][0][-1], action="oom", device_free=7)
    del oom["addr"]
    sent["snapshot"]["device_traces"][0].append(oom)
    got = records.decode(records.encode(sent), "r")
    assert got.snapshot == sent["snapshot"] and "addr" not in got.snapshot["device_traces"][0][-1]


@pytest.mark.parametrize("forge, message", [
    (lambda c: c["columns"].__setitem__("action", [3] * c["n"]),
     r"device_traces\[0\]\[0\]\['action'\] is 3"),
    (lambda c: c["columns"].__setitem__("size", ("int64", (b"\xff" * 8) * c["n"])),
     r"\['size'\] is -1, out of range"),
    (lambda c: c["columns"]["cell"].__setitem__(5, True), r"device_traces\[0\]\[5\]\['cell'\]"),
    (lambda c: c["columns"].__setitem__("size", ("int64", b"\0" * 3)), "packed integers"),
    (lambda c: c["columns"].__setitem__("frames", [[{"line": 1}]] * c["n"]), "frames"),
    (lambda c: c.__setitem__("keys", c["keys"] + ["extra"]), "do not match the keys"),
    (lambda c: c["missing"].__setitem__("action", [0]), "names entries that hold the key"),
])
def test_forged_trace_columns_are_refused_naming_the_entry(forge, message):
    sent = _history_records()
    data = pickle.loads(records.encode(sent))
    forge(data["trace_columns"][0])
    with pytest.raises(SnapshotLoadError, match=message):
        records.decode(pickle.dumps(data), "r")


def test_a_history_count_beyond_the_trace_is_refused():
    data = pickle.loads(records.encode(_history_records()))
    data["history_tail"][0] = 10**6
    with pytest.raises(SnapshotLoadError, match="counts 1000000 entries"):
        records.decode(pickle.dumps(data), "r")
