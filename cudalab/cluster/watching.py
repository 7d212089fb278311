"""Watching a running job from a notebook: :func:`watch` and :class:`ClusterWatch`.

A watch reads the connection files of a cluster directory
(:mod:`cudalab.cluster.connection`) every half second, subscribes to each rank of its job
(one ZeroMQ SUB socket per rank, so each message is checked with that rank's key) and keeps
each rank's latest samples. One daemon thread owns the subscriptions; the methods read a
copy of its state under a lock, so they never wait on the network.

* A message whose signature is wrong is dropped and counted (:attr:`ClusterWatch.rejected`)
  before anything in it is decoded; one that is signed but malformed, or whose header names
  another job, rank or process than its connection file, is dropped and counted too
  (:attr:`ClusterWatch.malformed`).
* A rank is *lost* (:meth:`ClusterWatch.lost`) once it has been silent for ``lost_after``
  seconds (1.5), or at once when its process ran on this host and is gone; the others go on.
* A connection file is *stale* (:meth:`ClusterWatch.stale`, never shown as a rank) when its
  process ran on this host and is gone before the watch heard from it, or when its rank never
  answers within ``stale_after`` seconds (3) of being found.
* Two jobs in one directory stay apart: a watch follows one job (``job=``, default the
  newest one found; :meth:`ClusterWatch.jobs` lists them).

:meth:`ClusterWatch.fetch` asks ranks for their records (stats, history tail, snapshot) over
each rank's request socket, signed, and decodes the replies with the bounded loader
(:func:`cudalab.cluster.records.decode`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import uuid
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

from cudalab.cluster import records as _records
from cudalab.cluster import wire
from cudalab.cluster.connection import ConnectionInfo, is_local, pid_alive, scan
from cudalab.cluster.records import RankRecords
from cudalab.cluster.signing import Signer
from cudalab.memory_tools.samples import DeviceSample

__all__ = ["ClusterWatch", "watch", "Headroom", "PeakRow", "RankSource", "DEFAULT_LOST_AFTER",
           "DEFAULT_STALE_AFTER"]

#: Seconds of silence after which a rank is lost.
DEFAULT_LOST_AFTER = 1.5
#: Seconds a rank found in the directory may take to publish before its file is stale.
DEFAULT_STALE_AFTER = 3.0
#: Seconds between two reads of the directory.
RESCAN = 0.5
_POLL_MS = 100
_live: weakref.WeakSet[ClusterWatch] = weakref.WeakSet()


class Headroom(NamedTuple):
    """The rank with the least headroom (:meth:`ClusterWatch.least_headroom`)."""

    rank: int  # the rank
    device: int  # its device with the least headroom
    headroom: int  # capacity - reserved bytes on that device (may be < 0 on oversubscription)
    capacity: int  # the device's capacity, bytes


class PeakRow(NamedTuple):
    """One row of :meth:`ClusterWatch.peaks`: a device of a rank, from its latest sample (one
    row per allocator the rank uses on it)."""

    rank: int
    host: str
    device: int
    allocator: str  # the allocator the figures are of ("cudalab", "torch", "cupy")
    device_name: str  # "" when unknown
    peak_allocated: int  # allocated_bytes.all.peak, bytes
    peak_reserved: int  # reserved_bytes.all.peak, bytes
    allocated: int  # bytes now
    reserved: int  # bytes now
    capacity: int  # bytes
    lost: bool  # the rank stopped answering


class _Rank:
    """The watch thread's state of one connection file (mutated under the watch's lock)."""

    __slots__ = ("info", "signer", "socket", "found", "heard", "samples", "seq", "error",
                 "refused", "gone", "stale")

    def __init__(self, info: ConnectionInfo, socket: Any, now: float):
        self.info = info
        self.signer = Signer(info.key)
        self.socket = socket
        self.found = now  # monotonic time the file was found
        self.heard: float | None = None  # monotonic time of the last good message
        self.samples: list[DeviceSample] = []
        self.seq = -1
        self.error = ""  # the rank's own last error (its header's)
        self.refused = 0  # requests the rank dropped for a wrong signature (its header's)
        self.gone = False  # its process is gone (this host) or its file was removed
        self.stale = False


class ClusterWatch:
    """The live state of one job's ranks (see the module documentation). Build it with
    :func:`watch`; :meth:`close` (or a ``with`` block) stops it."""

    def __init__(self, directory: str | os.PathLike[str], job: str | None = None,
                 lost_after: float = DEFAULT_LOST_AFTER,
                 stale_after: float = DEFAULT_STALE_AFTER):
        for name, value in (("lost_after", lost_after), ("stale_after", stale_after)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"watch(): {name} is {value!r:.40}, expected seconds > 0")
        if job is not None and (not isinstance(job, str) or not job):
            raise ValueError(f"watch(): job is {job!r:.40}, expected a non-empty str")
        try:
            import zmq
        except ImportError as exc:
            raise RuntimeError("cudalab.cluster.watch needs pyzmq: pip install "
                               f"'cudalab[cluster]' ({exc})") from None
        #: The cluster directory.
        self.directory = os.path.realpath(os.fspath(directory))
        self._job = job
        self.lost_after = float(lost_after)
        self.stale_after = float(stale_after)
        self._zmq = zmq
        self._context = zmq.Context()
        self._lock = threading.Lock()
        # by connection: (file path, start time): a process that stops and serves again
        # rewrites its file with new ports and a new key, a new connection
        self._ranks: dict[tuple[str, float], _Rank] = {}
        self._jobs: dict[str, float] = {}  # job -> newest start seen (live files)
        self._dead_files: list[str] = []  # the last scan's files of processes that are gone
        self._fetch_rejected = 0
        #: Signed messages dropped for malformed content or a header that does not match
        #: its connection file.
        self.malformed = 0
        #: Signed samples dropped because their sequence number was not new (a replay): they
        #: neither show nor keep a silent rank from being lost.
        self.replayed = 0
        #: The errors of the last :meth:`fetch`, by rank (``"no answer within 10 s"``...).
        self.fetch_errors: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cudalab-cluster-watch",
                                        daemon=True)
        _live.add(self)
        self._thread.start()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        next_scan = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_scan:
                    next_scan = now + RESCAN
                    self._rescan(poller, now)
                events = poller.poll(_POLL_MS) if self._ranks else None
                if not events:
                    if not self._ranks:
                        self._stop.wait(_POLL_MS / 1000)
                    continue
                by_socket = {r.socket: r for r in list(self._ranks.values())}
                for sock, _ in events:
                    rank = by_socket.get(sock)
                    if rank is not None:
                        self._receive(rank)
            except Exception:  # noqa: BLE001 - the thread never dies of one bad tick
                time.sleep(_POLL_MS / 1000)
        for r in list(self._ranks.values()):
            with contextlib.suppress(Exception):
                r.socket.close(linger=0)
        with contextlib.suppress(Exception):
            self._context.term()

    def _rescan(self, poller: Any, now: float) -> None:
        found = scan(self.directory)
        for info in found.live:
            self._jobs[info.job] = max(self._jobs.get(info.job, 0.0), info.started)
        if self._job is None and self._jobs:
            self._job = max(self._jobs, key=self._jobs.__getitem__)
        paths = {(info.path, info.started) for info in found.live}
        with self._lock:
            self._dead_files = [info.path for info in found.stale]
            for info in found.live:
                if info.job != self._job or (info.path, info.started) in self._ranks:
                    continue
                sock = self._context.socket(self._zmq.SUB)
                sock.setsockopt(self._zmq.LINGER, 0)
                sock.setsockopt(self._zmq.RCVHWM, 16)
                if ":" in info.address:
                    sock.setsockopt(self._zmq.IPV6, 1)
                sock.setsockopt(self._zmq.SUBSCRIBE, b"")
                sock.connect(info.endpoint(info.publish_port))
                poller.register(sock, self._zmq.POLLIN)
                self._ranks[info.path, info.started] = _Rank(info, sock, now)
            for path, r in list(self._ranks.items()):
                if r.gone or r.stale:
                    continue
                if path not in paths or (is_local(r.info) and not pid_alive(r.info.pid)):
                    r.gone = True
                    if r.heard is None:
                        r.stale = True
                elif r.heard is None and now - r.found > self.stale_after:
                    r.stale = True  # never answered: a file nobody serves
                if r.gone or r.stale:
                    with contextlib.suppress(Exception):
                        poller.unregister(r.socket)
                    with contextlib.suppress(Exception):
                        r.socket.close(linger=0)

    def _receive(self, rank: _Rank) -> None:
        zmq = self._zmq
        for _ in range(64):
            try:
                message = rank.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            frames = rank.signer.unwrap(message)
            if frames is None:
                continue  # wrong signature: counted, never decoded
            info = rank.info
            try:
                if len(frames) != 2:
                    raise wire.MessageError(f"{len(frames)} frames, expected 2")
                what = f"rank {info.rank}"
                head = wire.decode_header(frames[0], "samples", what)
                if (head["job"], head["rank"], head["pid"]) != (info.job, info.rank, info.pid):
                    raise wire.MessageError("a header that names another job, rank or pid")
                samples = wire.decode_samples(frames[1], what)
            except ValueError:
                with self._lock:
                    self.malformed += 1
                continue
            with self._lock:
                if head["seq"] <= rank.seq:  # a replayed (or reordered) message: no news
                    self.replayed += 1
                    continue
                rank.seq = head["seq"]
                rank.samples = samples
                rank.error = head["error"]
                rank.refused = head["rejected"]
                rank.heard = time.monotonic()

    # ------------------------------------------------------------------ reading
    @property
    def job(self) -> str | None:
        """The job watched (None until one is found)."""
        return self._job

    def jobs(self) -> list[str]:
        """The jobs whose ranks have live connection files in the directory, newest first."""
        return sorted(self._jobs, key=self._jobs.__getitem__, reverse=True)

    @property
    def rejected(self) -> int:
        """Messages dropped for a wrong signature (samples and fetch replies)."""
        with self._lock:
            return (sum(r.signer.rejected for r in self._ranks.values())
                    + self._fetch_rejected)

    def _current(self, include_lost: bool) -> dict[int, _Rank]:
        """The newest heard connection per rank (lock held)."""
        now = time.monotonic()
        out: dict[int, _Rank] = {}
        for r in self._ranks.values():
            if r.stale or r.heard is None:
                continue
            if not include_lost and self._is_lost(r, now):
                continue
            best = out.get(r.info.rank)
            if best is None or r.info.started > best.info.started:
                out[r.info.rank] = r
        return out

    def _is_lost(self, r: _Rank, now: float) -> bool:
        return r.gone or r.heard is None or now - r.heard > self.lost_after

    def samples(self, include_lost: bool = False) -> dict[int, list[DeviceSample]]:
        """The latest samples of each rank: ``{rank: [sample per device]}``, ranks
        ascending; lost ranks only with ``include_lost`` (their last samples)."""
        with self._lock:
            current = self._current(include_lost)
            return {k: list(current[k].samples) for k in sorted(current)}

    def ranks(self) -> list[int]:
        """Every rank heard from (lost ones too), ascending."""
        with self._lock:
            return sorted(self._current(True))

    def lost(self) -> list[int]:
        """The ranks that stopped answering (see the module documentation), ascending; a
        rank that came back under a new process is not lost."""
        now = time.monotonic()
        with self._lock:
            every = self._current(True)
            return sorted(k for k, r in every.items() if self._is_lost(r, now))

    def stale(self) -> list[str]:
        """The connection files ignored as stale (paths): those of processes of this host
        that are gone, and those of the job whose rank never answered."""
        with self._lock:
            quiet = {r.info.path for r in self._ranks.values() if r.stale}
            return sorted(quiet.union(self._dead_files))

    def errors(self) -> dict[int, str]:
        """Each rank's own last sampling error, when it has one."""
        with self._lock:
            return {k: r.error for k, r in self._current(True).items() if r.error}

    def refused_by_ranks(self) -> dict[int, int]:
        """Requests each rank dropped for a wrong signature (as its last sample says)."""
        with self._lock:
            return {k: r.refused for k, r in self._current(True).items()}

    def least_headroom(self) -> Headroom | None:
        """The live rank and device with the least headroom, or None before any sample: the
        device's capacity less what every allocator of the rank reserved on it (a rank
        using torch and cudalab on one device has one headroom)."""
        best: Headroom | None = None
        for rank, samples in self.samples().items():
            reserved: dict[int, int] = {}
            capacity: dict[int, int] = {}
            for s in samples:
                reserved[s.device] = reserved.get(s.device, 0) + s.reserved
                capacity[s.device] = s.capacity
            for device, taken in reserved.items():
                room = capacity[device] - taken
                if best is None or room < best.headroom:
                    best = Headroom(rank, device, room, capacity[device])
        return best

    def peaks(self) -> list[PeakRow]:
        """Each rank's and device's peaks from its latest sample (lost ranks too, flagged),
        by rank then device."""
        lost = set(self.lost())
        rows = []
        for rank, samples in self.samples(include_lost=True).items():
            for s in samples:
                rows.append(PeakRow(rank, s.identity.host, s.device, s.identity.allocator,
                                    s.identity.device_name or "",
                                    s.peak_allocated, s.peak_reserved, s.allocated, s.reserved,
                                    s.capacity, rank in lost))
        return rows

    def rank_source(self, rank: int, allocator: str | None = None) -> RankSource:
        """A :class:`~cudalab.memory_tools.samples.SampleSource` over ``rank``'s samples
        (of ``allocator``, default the first the rank publishes), for a dashboard."""
        return RankSource(self, rank, allocator)

    # ------------------------------------------------------------------ requests
    def fetch(self, what: Iterable[str] | str = ("snapshot",), ranks: Iterable[int] | None = None,
              timeout: float = 10.0, tail: int = _records.DEFAULT_TAIL,
              max_bytes: int | str | None = None) -> dict[int, RankRecords]:
        """Ask ranks for their records and wait for the answers.

        Parameters
        ----------
        what : str or iterable of str
            The parts (``"stats"``, ``"samples"``, ``"history_tail"``, ``"snapshot"``).
        ranks : iterable of int, optional
            Which ranks (default: every live rank).
        timeout : float
            Seconds to wait for all the answers.
        tail : int
            History entries per device for ``history_tail``.
        max_bytes : int or str, optional
            The largest answer accepted per rank (default: the snapshot loader's limit).

        Returns
        -------
        dict of int to RankRecords
            The ranks that answered, checked. Those that did not, or whose answer was
            refused, are in :attr:`fetch_errors` with the reason.
        """
        parts = _records.check_what(what, "fetch()")
        tail = _records.check_tail(tail, "fetch()")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"fetch(): timeout is {timeout!r:.40}, expected seconds > 0")
        with self._lock:
            current = self._current(False)
        wanted = sorted(current) if ranks is None else sorted(set(ranks))
        errors: dict[int, str] = {}
        targets = {}
        for k in wanted:
            if k not in current:
                errors[k] = "not a live rank of the job"
            else:
                targets[k] = current[k].info
        results = self._request(targets, parts, tail, timeout, max_bytes, errors)
        self.fetch_errors = errors
        return results

    def _request(self, targets: dict[int, ConnectionInfo], parts: tuple[str, ...], tail: int,
                 timeout: float, max_bytes: int | str | None, errors: dict[int, str]
                 ) -> dict[int, RankRecords]:
        zmq = self._zmq
        poller = zmq.Poller()
        waiting: dict[Any, tuple[int, ConnectionInfo, Signer, str]] = {}
        results: dict[int, RankRecords] = {}
        try:
            for k, info in targets.items():
                sock = self._context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if ":" in info.address:
                    sock.setsockopt(zmq.IPV6, 1)
                sock.connect(info.endpoint(info.request_port))
                signer = Signer(info.key)
                request_id = uuid.uuid4().hex
                head = wire.header("request", id=request_id, what=list(parts), tail=tail)
                sock.send_multipart(signer.wrap([head, b""]), flags=zmq.NOBLOCK)
                poller.register(sock, zmq.POLLIN)
                waiting[sock] = (k, info, signer, request_id)
            deadline = time.monotonic() + timeout
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for sock, _ in poller.poll(left * 1000):
                    k, info, signer, request_id = waiting[sock]
                    message = sock.recv_multipart()
                    frames = signer.unwrap(message)
                    if frames is None:
                        with self._lock:
                            self._fetch_rejected += 1
                        continue
                    try:
                        if len(frames) != 2:
                            raise wire.MessageError(f"{len(frames)} frames, expected 2")
                        reply = wire.decode_header(frames[0], "reply", f"rank {k}'s reply")
                        if reply["id"] != request_id:
                            continue  # an answer to an earlier request
                        if reply["error"]:
                            errors[k] = f"rank {k} could not answer: {reply['error']}"
                        else:
                            results[k] = _records.decode(frames[1], f"rank {k}'s records",
                                                         max_bytes)
                    except ValueError as exc:
                        errors[k] = str(exc)
                    poller.unregister(sock)
                    del waiting[sock]
                    sock.close(linger=0)
            for k, *_ in waiting.values():
                errors[k] = f"rank {k} did not answer within {timeout} s"
        finally:
            for sock in waiting:
                sock.close(linger=0)
        return results

    def snapshots(self, ranks: Iterable[int] | None = None, timeout: float = 30.0
                  ) -> dict[int, dict[str, Any]]:
        """Every live rank's snapshot (torch's schema, checked), by rank."""
        return {k: r.snapshot for k, r in self.fetch("snapshot", ranks, timeout).items()
                if r.snapshot is not None}

    def histories(self, tail: int = _records.DEFAULT_TAIL, ranks: Iterable[int] | None = None,
                  timeout: float = 30.0) -> dict[int, dict[int, list[dict[str, Any]]]]:
        """Every live rank's newest ``tail`` history entries per device, by rank."""
        got = self.fetch("history_tail", ranks, timeout, tail=tail)
        return {k: dict(r.history_tail) for k, r in got.items()}

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop watching (idempotent)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def __enter__(self) -> ClusterWatch:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        live = self.samples()
        return (f"<ClusterWatch {self.directory!r} job={self._job!r} ranks={sorted(live)} "
                f"lost={self.lost()}>")


class RankSource:
    """One rank's samples as a :class:`~cudalab.memory_tools.samples.SampleSource` (what
    :class:`cudalab.widgets.ClusterDashboard`'s panels render): each :meth:`sample` is the
    rank's latest sample from the watch (its last one once the rank is lost); the snapshot
    is fetched from the rank. Peaks and the cache belong to the rank's process:
    :meth:`reset_peaks` and :meth:`release_cache` raise NotImplementedError saying so."""

    #: The samples are another process's: a dashboard takes the device indices as given.
    remote = True

    def __init__(self, watch: ClusterWatch, rank: int, allocator: str | None = None):
        self.watch = watch
        self.rank = rank
        mine = watch.samples(include_lost=True).get(rank, [])
        #: The allocator whose samples are shown.
        self.allocator = allocator or (mine[0].identity.allocator if mine else "cudalab")
        self.name = f"rank {rank}"

    def _mine(self) -> list[DeviceSample]:
        return [s for s in self.watch.samples(include_lost=True).get(self.rank, [])
                if s.identity.allocator == self.allocator]

    def devices(self) -> list[int]:
        """The rank's devices (its own numbering), ascending."""
        return sorted({s.device for s in self._mine()})

    def host(self) -> str:
        """The rank's host ("" before its first sample)."""
        mine = self._mine()
        return mine[0].identity.host if mine else ""

    @property
    def simulated(self) -> bool:
        """Whether the rank runs on the simulator (its device's name says so)."""
        return any("simulated" in (s.identity.device_name or "") for s in self._mine())

    def sample(self, device: int, now: float | None = None) -> DeviceSample:
        """The rank's latest sample of ``device`` (LookupError when it has none)."""
        for s in self._mine():
            if s.device == device:
                return s
        raise LookupError(f"rank {self.rank} has published no sample of cuda:{device} "
                          f"({self.allocator})")

    def reset_peaks(self, device: int) -> None:
        raise NotImplementedError(f"the peaks are rank {self.rank}'s: reset them in its "
                                  "process (cudalab.memory.reset_peak_memory_stats)")

    def release_cache(self) -> None:
        raise NotImplementedError(f"the cache is rank {self.rank}'s: empty it in its process "
                                  "(cudalab.memory.empty_cache)")

    def snapshot(self) -> dict[str, Any]:
        """The rank's snapshot, fetched (RuntimeError naming why when it cannot be had)."""
        got = self.watch.fetch("snapshot", ranks=[self.rank], timeout=30.0)
        if self.rank not in got or got[self.rank].snapshot is None:
            raise RuntimeError(self.watch.fetch_errors.get(self.rank, "no snapshot"))
        snap = got[self.rank].snapshot
        assert snap is not None
        return snap


def watch(directory: str | os.PathLike[str], job: str | None = None,
          lost_after: float = DEFAULT_LOST_AFTER,
          stale_after: float = DEFAULT_STALE_AFTER) -> ClusterWatch:
    """Watch the ranks publishing into ``directory`` (see :class:`ClusterWatch`).

    Parameters
    ----------
    directory : str or os.PathLike
        The cluster directory the ranks were started with (``CUDALAB_CLUSTER``).
    job : str, optional
        The job to follow (default: the newest one found).
    lost_after : float
        Seconds of silence after which a rank is lost (default 1.5).
    stale_after : float
        Seconds a found rank may take to publish before its file is stale (default 3).

    Returns
    -------
    ClusterWatch
    """
    return ClusterWatch(directory, job, lost_after, stale_after)


def close_all() -> None:
    """Close every watch of this process (at exit)."""
    for w in list(_live):
        w.close()


atexit.register(close_all)
