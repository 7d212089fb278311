"""cudalab.cluster on 4 rank processes of the simulator: publishing, watching, fetching and
the faults (a killed rank, a forged message, stale files, two jobs, Ctrl-C)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

zmq = pytest.importorskip("zmq")

from cudalab.cluster import connection, signing, watch  # noqa: E402
from cudalab.identity import Identity  # noqa: E402
from tests.cluster.helpers import Ranks, wait_for  # noqa: E402

MiB = 1 << 20
STEP_MIB = 24  # rank r holds (r + 1) * 24 MiB: reserved grows with the rank too


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cluster")
    ranks = Ranks(directory, "job-a", 4, mib=STEP_MIB)
    yield ranks
    ranks.close()


@pytest.fixture
def watched(job):
    w = watch(job.directory, job="job-a")
    assert wait_for(lambda: len(w.samples()) == 4, 10), w
    yield w
    w.close()


def test_every_rank_is_watched_with_its_own_figures(job, watched):
    samples = watched.samples()
    assert sorted(samples) == [0, 1, 2, 3]
    for rank, per_device in samples.items():
        assert len(per_device) == 1
        s = per_device[0]
        assert s.identity.rank == rank and s.identity.world_size == 4
        assert s.identity.pid == job.processes[rank].pid
        # the worker keeps (rank + 1) * 24 MiB; the scratch array was freed but counts in
        # the peak
        assert s.allocated == (rank + 1) * STEP_MIB * MiB
        assert s.peak_allocated >= s.allocated and s.reserved >= s.allocated
        # torch's spellings, as the cluster view documents them
        assert (s.allocated_bytes, s.reserved_bytes, s.peak_allocated_bytes) == (
            s.allocated, s.reserved, s.peak_allocated)
        assert "simulated" in (s.identity.device_name or "")
        assert abs(s.time - time.time()) < 5
    assert watched.lost() == [] and watched.rejected == 0 and watched.malformed == 0
    rows = watched.peaks()
    assert [(r.rank, r.device) for r in rows] == [(k, 0) for k in range(4)]
    assert [r.peak_allocated for r in rows] == [samples[k][0].peak_allocated for k in range(4)]


def test_connection_files_are_private_and_name_the_job(job):
    files = sorted(job.directory.glob("rank-*.json"))
    assert len(files) == 4
    for path in files:
        assert (path.stat().st_mode & 0o777) == 0o600
        info = connection.read_connection(path)
        assert info.job == "job-a" and info.address == "127.0.0.1"
        assert info.pid in [p.pid for p in job.processes]


def test_least_headroom_follows_a_change(job, watched):
    """The flag moves to the rank that grew (how fast is benchmarks/cluster.py's figure)."""
    first = watched.least_headroom()
    assert first is not None and first.rank == 3  # it holds the most
    job.command(1, f"alloc {200 * MiB}")
    try:
        assert wait_for(lambda: watched.least_headroom().rank == 1, 5.0, 0.02), \
            watched.least_headroom()
        h = watched.least_headroom()
        sample = watched.samples()[1][0]
        assert h.headroom == sample.capacity - sample.reserved and h.device == 0
    finally:
        job.command(1, "free")
    time.sleep(0.6)  # a sample after the free: the freed memory stays cached (reserved)
    assert watched.least_headroom().rank == 1 and watched.samples()[1][0].allocated == 2 * (
        STEP_MIB * MiB)


def test_a_process_a_rank_starts_does_not_publish_as_that_rank(job, watched):
    assert job.command(0, "child") == ["0"]  # the child inherited CUDALAB_CLUSTER: quiet
    time.sleep(0.6)
    assert len(list(job.directory.glob("rank-0-*.json"))) == 1
    assert watched.samples()[0][0].identity.pid == job.processes[0].pid


def test_fetch_snapshots_and_histories(job, watched):
    got = watched.fetch(("snapshot", "stats", "history_tail"))
    assert watched.fetch_errors == {}
    assert sorted(got) == [0, 1, 2, 3]
    for rank, records in got.items():
        assert records.identity.rank == rank
        assert records.snapshot is not None and records.snapshot["segments"]
        assert records.snapshot["identity"]["rank"] == rank
        peak = records.stats[0]["allocated_bytes.all.peak"]
        assert peak >= (rank + 1) * STEP_MIB * MiB
        actions = [e["action"] for e in records.history_tail[0]]
        assert "alloc" in actions and "free_completed" in actions
    tails = watched.histories(tail=1)
    assert all(len(t[0]) == 1 for t in tails.values())
    assert sorted(watched.snapshots()) == [0, 1, 2, 3]


def test_fetch_from_an_unknown_rank_says_so(watched):
    got = watched.fetch("stats", ranks=[0, 17], timeout=5)
    assert sorted(got) == [0]
    assert "not a live rank" in watched.fetch_errors[17]
    with pytest.raises(ValueError, match="unknown part 'everything'"):
        watched.fetch("everything")


def test_a_forged_message_is_dropped_and_counted(job, watched):
    """A request signed with the wrong key gets no answer and is counted by the rank; a
    sample published under the wrong key is counted by the watch and never decoded."""
    info = connection.read_connection(next(job.directory.glob("rank-0-*.json")))
    context = zmq.Context.instance()
    # a forged request to rank 0: no answer
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(info.endpoint(info.request_port))
    forged = signing.Signer(b"x" * 32).wrap([b'{"v":1,"kind":"request","id":"a","what":'
                                             b'["snapshot"],"tail":1}', b""])
    dealer.send_multipart(forged)
    assert dealer.poll(300) == 0
    dealer.close()
    assert wait_for(lambda: watched.refused_by_ranks()[0] == 1, 3), watched.refused_by_ranks()
    assert watched.refused_by_ranks()[1] == 0
    # a genuine request answers once; the same message again (a replay) is dropped
    signer = signing.Signer(info.key)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(info.endpoint(info.request_port))
    genuine = signer.wrap([b'{"v":1,"kind":"request","id":"r1","what":["stats"],"tail":1}', b""])
    dealer.send_multipart(genuine)
    assert dealer.poll(5000) and len(dealer.recv_multipart()) == 3
    dealer.send_multipart(genuine)
    assert dealer.poll(500) == 0
    dealer.close()
    # a forged publisher impersonating rank 2: a watch subscribed to it counts, shows nothing
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    real = connection.read_connection(next(job.directory.glob("rank-2-*.json")))
    w = watch(job.directory, job="job-a")
    try:
        assert wait_for(lambda: len(w.samples()) == 4, 10)
        sub = w._ranks[real.path, real.started].socket  # noqa: SLF001 - aim it at the forger
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)
        evil = b'{"v":1,"kind":"samples","job":"job-a","rank":2,"pid":%d' % real.pid
        for _ in range(5):
            pub.send_multipart([b"0" * 64, evil, b"[{]"])  # not even JSON: never parsed
            time.sleep(0.05)
        assert wait_for(lambda: w.rejected >= 5, 3), w.rejected
        assert w.malformed == 0  # nothing of the forged messages was decoded
        # a replayed genuine sample (same sequence number) is dropped too: it would keep a
        # dead rank alive
        replay = context.socket(zmq.PUB)
        replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
        capture = context.socket(zmq.SUB)
        capture.setsockopt(zmq.SUBSCRIBE, b"")
        capture.connect(real.endpoint(real.publish_port))
        assert capture.poll(3000)
        recorded = capture.recv_multipart()
        capture.close(linger=0)
        sub.connect(f"tcp://127.0.0.1:{replay_port}")
        time.sleep(0.3)
        before = w.replayed
        for _ in range(3):
            replay.send_multipart(recorded)
            time.sleep(0.05)
        assert wait_for(lambda: w.replayed >= before + 3, 3), w.replayed
        replay.close(linger=0)
        assert 2 in w.samples()
    finally:
        w.close()
        pub.close(linger=0)


def test_stale_files_are_ignored(job, tmp_path):
    """A file of a dead process, and one whose rank never answers, are stale."""
    directory = job.directory
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    base = connection.read_connection(next(directory.glob("rank-0-*.json")))
    identity = Identity(host=base.identity.host, pid=dead_pid, version="0", allocator="cudalab",
                        rank=5, world_size=8)
    stale = connection.ConnectionInfo(job="job-a", rank=5, address="127.0.0.1",
                                      publish_port=1, request_port=2, key=b"k" * 32,
                                      identity=identity, started=time.time() + 100)
    stale_path = stale.write(directory)
    # alive (this test's own pid) but nothing publishes there: no answer
    quiet = connection.ConnectionInfo(job="job-a", rank=6, address="127.0.0.1",
                                      publish_port=9, request_port=9, key=b"q" * 32,
                                      identity=Identity(host=base.identity.host, pid=os.getpid(),
                                                        version="0", allocator="cudalab", rank=6),
                                      started=time.time())
    quiet_path = quiet.write(directory)
    garbage = directory / "rank-9-garbage.json"
    garbage.write_text("{not json")
    try:
        found = connection.scan(directory)
        assert stale_path in [i.path for i in found.stale]
        assert garbage.as_posix() in [p for p, _ in found.bad]
        w = watch(directory, job="job-a", stale_after=0.5)
        try:
            assert wait_for(lambda: len(w.samples()) == 4 and quiet_path in w.stale(), 5)
            assert sorted(w.samples()) == [0, 1, 2, 3] and w.lost() == []
            assert stale_path in w.stale()
        finally:
            w.close()
    finally:
        for p in (stale_path, quiet_path, garbage):
            os.unlink(p)


def test_two_jobs_in_one_directory_stay_apart(job):
    other = Ranks(job.directory, "job-b", 2, mib=3)
    try:
        wa = watch(job.directory, job="job-a")
        wb = watch(job.directory, job="job-b")
        newest = watch(job.directory)
        try:
            assert wait_for(lambda: len(wa.samples()) == 4 and len(wb.samples()) == 2, 10)
            assert sorted(wb.samples()) == [0, 1]
            assert wb.samples()[1][0].allocated == 6 * MiB  # job b's rank 1 holds 2 * 3 MiB
            assert wa.samples()[1][0].allocated == 2 * STEP_MIB * MiB
            assert sorted(wa.jobs()) == ["job-a", "job-b"]
            assert wait_for(lambda: newest.job == "job-b", 5)  # the newest job by default
        finally:
            for w in (wa, wb, newest):
                w.close()
    finally:
        other.close()


def test_a_killed_rank_is_lost_within_two_seconds_and_the_others_go_on(tmp_path):
    ranks = Ranks(tmp_path, "job-k", 3)
    w = watch(tmp_path)
    try:
        assert wait_for(lambda: len(w.samples()) == 3, 10)
        ranks.kill(1)
        start = time.monotonic()
        assert wait_for(lambda: w.lost() == [1], 2.0, 0.02), w.lost()
        assert time.monotonic() - start <= 2.0
        before = {k: v[0].time for k, v in w.samples().items()}
        assert sorted(before) == [0, 2]
        assert wait_for(lambda: all(w.samples()[k][0].time > before[k] for k in (0, 2)), 2)
        assert [r.lost for r in w.peaks()] == [False, True, False]
    finally:
        w.close()
        ranks.close()


def test_ctrl_c_stops_every_rank_cleanly(tmp_path):
    ranks = Ranks(tmp_path, "job-c", 2)
    try:
        assert len(list(tmp_path.glob("rank-*.json"))) == 2
        for r in range(2):
            code, out, err = ranks.interrupt(r)
            assert code == 130 and "interrupted" in out, (code, out, err)
            assert "Traceback" not in err and "Exception" not in err, err
        assert list(tmp_path.glob("*.json")) == []  # each removed its connection file
    finally:
        ranks.close()


def test_sigterm_ends_a_rank_as_before_and_removes_its_file(tmp_path):
    """mpirun and torchrun turn Ctrl-C into SIGTERM for their ranks."""
    ranks = Ranks(tmp_path, "job-t", 2)
    try:
        ranks.processes[0].send_signal(signal.SIGTERM)
        assert ranks.processes[0].wait(10) == -signal.SIGTERM  # still ended by the signal
        assert [p.name for p in tmp_path.glob("*.json")] == [
            p.name for p in tmp_path.glob("rank-1-*.json")]
    finally:
        ranks.close()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="lost_after"):
        watch(tmp_path, lost_after=0)
    with pytest.raises(ValueError, match="job"):
        watch(tmp_path, job="")
    from cudalab.cluster import publisher

    with pytest.raises(ValueError, match="interval"):
        publisher.Publisher(tmp_path, interval=0)
    env = {k: v for k, v in os.environ.items() if k != "CUDALAB_CLUSTER"}
    code = ("import os, cudalab.cluster.publisher as p\n"
            "try:\n    p.serve()\nexcept ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "CUDALAB_CLUSTER is not set" in out.stdout


def test_a_rank_never_waits_for_a_reader_that_does_not_read(tmp_path):
    """In this process: a publisher at 20 Hz with a subscriber that never reads keeps its
    pace (the PUB socket drops past its high-water mark), issues no collective, and its
    answers still come while a sample is due."""
    import cudalab
    from cudalab import _internal
    from cudalab.cluster import publisher

    kept = cudalab.zeros(1 << 16)
    heard = []
    _internal.collective_observers.append(heard.append)
    p = publisher.Publisher(tmp_path, interval=0.05, job="in-process").start()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(p.info.endpoint(p.info.publish_port))  # connected, never read
        start = p.published
        time.sleep(1.5)
        assert p.published - start >= 20, p.published  # ~30 at 20 Hz
        assert p.failed == 0 and p.running
        w = watch(tmp_path)
        try:
            assert wait_for(lambda: len(w.samples()) == 1, 5)
            got = w.fetch(("stats", "snapshot"))
            assert list(got) == [connection.rank_number(p.info.identity)]
        finally:
            w.close()
        assert heard == []  # neither the sampling nor the answers issued a collective
        p.paused = True  # no sample while paused; requests still answered
        time.sleep(0.2)
        paused_at = p.published
        time.sleep(0.5)
        assert p.published == paused_at and p.running
        p.paused = False
        assert wait_for(lambda: p.published > paused_at, 2)
    finally:
        _internal.collective_observers.remove(heard.append)
        sub.close(linger=0)
        context.term()
        p.stop()
        del kept
    assert not p.running and list(tmp_path.glob("*.json")) == []


def test_the_publisher_sleeps_between_ticks_and_wakes_at_once_to_stop(tmp_path):
    """The thread sleeps in one poll until its next tick (no wake-ups between samples): a
    request still wakes it (and the answering thread's reply, through its wake pipe), and
    stop() ends it at once, not at the next tick."""
    import cudalab
    from cudalab.cluster import publisher

    kept = cudalab.zeros(1 << 10)
    p = publisher.Publisher(tmp_path, interval=3, job="sleepy").start()
    try:
        assert wait_for(lambda: p.published == 1, 5)  # (the first tick at once)
        assert len(p.tick_seconds) == 1 and 0 < p.tick_seconds[0] < 1
        woke = p.wakes
        w = watch(tmp_path, lost_after=10, stale_after=10)
        try:
            assert wait_for(lambda: len(w.samples()) == 1, 6)  # (the tick at 3 s)
            assert p.published == 2
            # 3 s: the tick, and a wake or two for the watch's subscription; none in between
            assert p.wakes - woke <= 4, p.wakes - woke
            woke = p.wakes
            t0 = time.monotonic()
            got = w.fetch(("stats", "snapshot"), timeout=5)
            assert len(got) == 1 and time.monotonic() - t0 < 1.5  # not at the next tick
            assert p.wakes - woke <= 4  # the request, the reply ready
        finally:
            w.close()
    finally:
        time.sleep(0.2)
        t0 = time.monotonic()
        p.stop()
        took = time.monotonic() - t0
        del kept
    assert not p.running and took < 1.0, took
    assert p.published == 2 and len(p.tick_seconds) == 2
