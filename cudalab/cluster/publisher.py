"""A rank publishing its allocator to whoever watches: :func:`serve` and :class:`Publisher`.

One daemon thread per publishing process owns two ZeroMQ sockets, bound to localhost unless
an address is given, and a connection file in the cluster directory
(:mod:`cudalab.cluster.connection`):

* a PUB socket: every ``interval`` seconds (0.5: 2 Hz) the thread takes a
  :class:`~cudalab.memory_tools.samples.DeviceSample` of each device the rank uses from its
  source (:func:`cudalab.cluster.records.rank_source`) and publishes them, signed. A PUB
  socket drops what nobody reads, the high-water mark is a few messages and every send is
  non-blocking: a slow or absent watcher costs the rank nothing but the sampling. A rank
  that uses no device yet still publishes an empty list, as a heartbeat;
* a ROUTER socket answering signed requests for the rank's records (``stats``, ``samples``,
  ``history_tail``, ``snapshot``: :mod:`cudalab.cluster.records`); a request whose signature
  is wrong is dropped, counted, and nothing in it is decoded. A second daemon thread,
  started at the first request, collects and encodes the answers (a snapshot of a long
  history takes a while), so the samples keep their pace meanwhile.

The thread sleeps in one ``zmq_poll`` until the next tick or a request: it wakes only to
sample, to answer, or when :meth:`Publisher.stop` or the answering thread writes a byte
into its wake pipe (no periodic wake-ups in between, so a rank's main thread is asked for
the interpreter twice a second, not more). A tick's header is preformatted but for its
counters, and the message is signed from the key's prepared HMAC states
(:mod:`cudalab.cluster.signing`).

The thread issues no collective and lets no exception out (a failed tick is counted and
its text published in the next header). It stops, closes its sockets without lingering and
removes its connection file on :meth:`Publisher.stop` and at interpreter exit (a Ctrl-C
that raises KeyboardInterrupt and ends the program runs the exit handlers), and is
forgotten in a forked child. Launchers turn a Ctrl-C into SIGTERM for their ranks (Open
MPI 5's ``mpirun`` and torchrun do), which ends a process without its exit handlers: while
SIGTERM has its default action, :func:`serve` (called in the main thread) installs a handler
that removes the connection files, puts the default action back and sends the signal again,
so the process still ends by SIGTERM, as it would have, and leaves no file behind.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import math
import os
import queue
import threading
import time
from typing import Any

from cudalab.cluster import records as _records
from cudalab.cluster import wire
from cudalab.cluster.connection import (
    CLUSTER_ENV,
    ConnectionInfo,
    job_id,
    pid_alive,
    rank_number,
    read_connection,
)
from cudalab.cluster.signing import Signer, new_key
from cudalab.identity import Identity
from cudalab.memory_tools.samples import SampleSource

__all__ = ["Publisher", "serve", "serve_from_env", "publishers", "stop_all",
           "DEFAULT_INTERVAL", "SEND_HWM", "PUBLISHER_ENV"]

#: The environment variable a rank that publishes from ``CUDALAB_CLUSTER`` sets to its pid, so
#: the processes it starts (which inherit it) do not publish as the same rank.
PUBLISHER_ENV = "CUDALAB_CLUSTER_PUBLISHER"
#: Seconds between two samples (2 Hz).
DEFAULT_INTERVAL = 0.5
#: Messages a PUB socket queues per watcher before it drops (a watcher that does not read).
SEND_HWM = 4
#: Requests waiting for the answering thread at most (more are answered "busy").
MAX_PENDING = 8
#: How many recent request signatures a publisher remembers, to refuse replays.
_SEEN_REQUESTS = 4096
#: Seconds between two looks for the allocators the process uses.
_RESOLVE_SOURCES = 5.0
#: Seconds the thread pauses after a failed turn of its loop (so a persistent error does
#: not spin).
_WAKE = 0.1
#: Per-tick CPU times kept (:attr:`Publisher.tick_seconds`).
_TICKS_KEPT = 4096
_lock = threading.Lock()
_publishers: dict[str, Publisher] = {}  # by directory (realpath)


class Publisher:
    """One process publishing its samples into one cluster directory (see the module
    documentation). Build it with :func:`serve`."""

    def __init__(self, directory: str | os.PathLike[str], address: str = "127.0.0.1",
                 interval: float = DEFAULT_INTERVAL, source: SampleSource | None = None,
                 job: str | None = None):
        if not isinstance(address, str) or not address:
            raise ValueError(f"serve(): address must be a non-empty str, got {address!r:.40}")
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (
                0.01 <= interval <= 3600):
            raise ValueError(f"serve(): interval is {interval!r:.40}, expected seconds in "
                             "[0.01, 3600]")
        #: The cluster directory.
        self.directory = os.path.realpath(os.fspath(directory))
        #: The address the sockets are bound to.
        self.address = address
        #: Seconds between two samples.
        self.interval = float(interval)
        #: The job's name (:func:`~cudalab.cluster.connection.job_id`).
        self.job = job if job is not None else job_id()
        self._source = source
        self._signer = Signer(new_key())
        self._identity = Identity.current()
        #: The connection file's record (None until started).
        self.info: ConnectionInfo | None = None
        #: Sample messages published, and ticks whose sampling or sending failed.
        self.published = 0
        self.failed = 0
        #: Requests answered.
        self.answered = 0
        #: CPU seconds the thread spent taking, encoding and sending samples (what
        #: publishing costs the rank's process; requests answered are not counted).
        self.busy_seconds = 0.0
        #: How often the thread woke (a tick, a request, a reply ready, stop): about twice a
        #: second plus once per request when nothing else happens.
        self.wakes = 0
        #: The CPU seconds of each of the latest ticks (taking, encoding, signing and
        #: sending one sample message), oldest first; at most 4096 kept.
        self.tick_seconds: collections.deque[float] = collections.deque(maxlen=_TICKS_KEPT)
        #: While True no sample is taken nor sent (the sockets stay, requests are still
        #: answered): the rank costs nothing but an idle thread. Set and clear it freely.
        self.paused = False
        self.last_error = ""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._owner = os.getpid()
        # requests handed to the answering thread, and its answers for the socket's thread
        self._requests: queue.Queue[Any] = queue.Queue(MAX_PENDING)
        self._replies: collections.deque[tuple[bytes, str, bytes, str]] = collections.deque()
        self._answering: threading.Thread | None = None
        self._sources: tuple[SampleSource, ...] | None = None
        # the signatures of the latest requests (a request carries a fresh id, so its
        # signature is new; the same signature again is a replay)
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        #: Requests dropped as replays of one already answered.
        self.replayed = 0
        self._sources_due = 0.0
        # the wake pipe: stop() and the answering thread write a byte to end the thread's
        # poll at once (its ends closed, under the lock, when the thread ends)
        self._wake_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # the sample header's fixed part and the last error's JSON (see _publish_one)
        self._head_prefix = b""
        self._error_json = (b'""', "")

    # ------------------------------------------------------------------ control
    @property
    def rejected(self) -> int:
        """Requests dropped for a wrong signature."""
        return self._signer.rejected

    @property
    def running(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 10.0) -> Publisher:
        """Bind the sockets, write the connection file and start publishing; returns self.

        Raises
        ------
        RuntimeError
            pyzmq is missing, or the sockets could not be bound (the message says why).
        """
        try:
            import zmq  # noqa: F401
        except ImportError as exc:
            self._close_wake()
            raise RuntimeError("cudalab.cluster needs pyzmq: pip install 'cudalab[cluster]' "
                               f"({exc})") from None
        self._thread = threading.Thread(target=self._run, name="cudalab-cluster-publisher",
                                        daemon=True)
        self._thread.start()
        self._ready.wait(timeout)
        if self._startup_error is not None:
            raise RuntimeError(f"serve(): cannot publish into {self.directory!r}: "
                               f"{self._startup_error}") from self._startup_error
        if not self._ready.is_set():
            raise RuntimeError(f"serve(): the publisher did not start within {timeout} s")
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop publishing, close the sockets and remove the connection file (idempotent)."""
        self._stop.set()
        self._wake()
        with contextlib.suppress(queue.Full):
            self._requests.put_nowait(None)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._remove_file()

    def _wake(self) -> None:
        """End the thread's poll now (a byte into its wake pipe; nothing once closed)."""
        with self._wake_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(OSError):  # (full: a wake is already pending)
                    os.write(self._wake_w, b"w")

    def _close_wake(self) -> None:
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._wake_r = self._wake_w = -1

    def _remove_file(self) -> None:
        """Remove this publisher's connection file: only if it is still this publisher's
        (a later publisher of the process may have rewritten the same path)."""
        info = self.info
        if info is None or not info.path or os.getpid() != self._owner:
            return
        with contextlib.suppress(OSError, ValueError):
            if read_connection(info.path).key == info.key:
                os.unlink(info.path)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        import zmq

        context = zmq.Context()
        sockets: list[Any] = []
        try:
            try:
                pub = context.socket(zmq.PUB)
                sockets.append(pub)
                pub.setsockopt(zmq.SNDHWM, SEND_HWM)
                pub.setsockopt(zmq.LINGER, 0)
                router = context.socket(zmq.ROUTER)
                sockets.append(router)
                router.setsockopt(zmq.LINGER, 0)
                router.setsockopt(zmq.SNDHWM, SEND_HWM)
                router.setsockopt(zmq.ROUTER_MANDATORY, 0)
                host = f"[{self.address}]" if ":" in self.address else self.address
                if ":" in self.address:
                    pub.setsockopt(zmq.IPV6, 1)
                    router.setsockopt(zmq.IPV6, 1)
                pub_port = pub.bind_to_random_port(f"tcp://{host}")
                req_port = router.bind_to_random_port(f"tcp://{host}")
                info = ConnectionInfo(job=self.job, rank=rank_number(self._identity),
                                      address=self.address, publish_port=pub_port,
                                      request_port=req_port, key=self._signer.key,
                                      identity=self._identity, started=time.time())
                path = info.write(self.directory)
                self.info = dataclasses.replace(info, path=path)
                self._head_prefix = wire.samples_header_prefix(self.job, info.rank, info.pid)
            except BaseException as exc:  # noqa: BLE001 - handed to start()
                self._startup_error = exc
                return
            finally:
                self._ready.set()
            self._loop(zmq, pub, router)
        finally:
            for s in sockets:
                with contextlib.suppress(Exception):
                    s.close(linger=0)
            with contextlib.suppress(Exception):
                context.term()
            self._close_wake()
            self._remove_file()

    def _loop(self, zmq: Any, pub: Any, router: Any) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        wake = self._wake_r
        poller.register(wake, zmq.POLLIN)
        next_tick = time.monotonic()
        while not self._stop.is_set():
            self.wakes += 1
            try:
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = max(next_tick + self.interval, now)
                    if not self.paused:
                        self._publish(zmq, pub)
                # sleep until the next tick, a request, or a wake (stop, an answer ready)
                wait = max(0, math.ceil((next_tick - time.monotonic()) * 1000))
                ready = dict(poller.poll(wait))
                if wake in ready:
                    with contextlib.suppress(OSError):
                        os.read(wake, 4096)
                if router in ready:
                    self._answer(zmq, router)
                while self._replies:  # (made by the answering thread)
                    self._reply(zmq, router, *self._replies.popleft())
            except Exception as exc:  # noqa: BLE001 - nothing escapes the thread
                self.failed += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:200]
                time.sleep(_WAKE)

    def _sample(self) -> list[Any]:
        """One sample per device of every allocator the process uses (each labelled with
        its allocator); the allocators are looked for again every few seconds (torch may
        initialise CUDA after the publisher started)."""
        now = time.monotonic()
        if self._source is not None:
            sources: tuple[SampleSource, ...] = (self._source,)
        else:
            if self._sources is None or now >= self._sources_due:
                # the sources already made are kept (each holds its devices' identity and
                # NVML handles, which cost milliseconds to make); only new ones are added
                known = {s.name: s for s in self._sources or ()}
                self._sources = tuple(known.get(s.name, s) for s in _records.rank_sources())
                self._sources_due = now + _RESOLVE_SOURCES
            sources = self._sources
        when = time.time()
        return [source.sample(d, when) for source in sources
                for d in _records.source_devices(source)]

    def _publish(self, zmq: Any, pub: Any) -> None:
        start = time.thread_time()
        try:
            self._publish_one(zmq, pub)
        finally:
            spent = time.thread_time() - start
            self.busy_seconds += spent
            self.tick_seconds.append(spent)

    def _publish_one(self, zmq: Any, pub: Any) -> None:
        try:
            payload = wire.encode_samples(self._sample())
        except Exception as exc:  # noqa: BLE001 - a heartbeat still goes out
            self.failed += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            payload = b"[]"
        error_json, error = self._error_json
        if error != self.last_error:  # (encoded again only when it changed)
            error = self.last_error
            error_json = wire.encode_json(error)
            self._error_json = (error_json, error)
        head = wire.samples_header(self._head_prefix, self.published, time.time(),
                                   self.failed, self._signer.rejected, error_json)
        try:
            pub.send_multipart(self._signer.wrap([head, payload]), flags=zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:  # nobody reads fast enough: dropped
            self.failed += 1

    def _answer(self, zmq: Any, router: Any) -> None:
        for _ in range(16):  # a bounded batch per wake
            try:
                message = router.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(message) < 2:
                continue
            peer, frames = message[0], self._signer.unwrap(message[1:])
            if frames is None or len(frames) != 2:
                continue  # a wrong signature: dropped (counted by the signer)
            signature = bytes(message[1])
            if signature in self._seen:  # a replay of a request already answered: dropped
                self.replayed += 1
                continue
            self._seen[signature] = None
            if len(self._seen) > _SEEN_REQUESTS:
                self._seen.popitem(last=False)
            try:
                request = wire.decode_header(frames[0], "request", "request")
                what = _records.check_what(request["what"], "request")
                tail = _records.check_tail(request["tail"], "request")
            except (ValueError, TypeError) as exc:
                self._reply(zmq, router, peer, "", b"", f"bad request: {exc}")
                continue
            try:
                self._requests.put_nowait((peer, request["id"], what, tail))
            except queue.Full:
                self._reply(zmq, router, peer, request["id"], b"",
                            f"busy: {MAX_PENDING} requests are waiting")
                continue
            if self._answering is None:
                self._answering = threading.Thread(target=self._answer_requests, daemon=True,
                                                   name="cudalab-cluster-answer")
                self._answering.start()

    def _answer_requests(self) -> None:
        """The answering thread: collects and encodes what each request asks for (a
        snapshot of a long history takes a while), so the samples keep their pace."""
        while not self._stop.is_set():
            item = self._requests.get()
            if item is None:
                return
            peer, request_id, what, tail = item
            try:
                payload = _records.encode(_records.collect(what, self._source, tail))
                error = ""
            except Exception as exc:  # noqa: BLE001 - the watcher hears why
                payload, error = b"", f"{type(exc).__name__}: {exc}"[:1000]
            self._replies.append((peer, request_id, payload, error))
            self._wake()

    def _reply(self, zmq: Any, router: Any, peer: bytes, request_id: str, payload: bytes,
               error: str) -> None:
        head = wire.header("reply", id=request_id, error=error)
        try:
            router.send_multipart([peer, *self._signer.wrap([head, payload])],
                                  flags=zmq.NOBLOCK, copy=False)
            self.answered += 1
        except zmq.ZMQError:  # the watcher left, or does not read: dropped
            self.failed += 1


def serve(directory: str | os.PathLike[str] | None = None, address: str = "127.0.0.1",
          interval: float = DEFAULT_INTERVAL, source: SampleSource | None = None,
          job: str | None = None) -> Publisher:
    """Publish this process's samples into ``directory`` until it exits (one publisher per
    directory and process: a second call returns the running one).

    Parameters
    ----------
    directory : str or os.PathLike, optional
        The cluster directory (created if needed). Default: the environment variable
        ``CUDALAB_CLUSTER``.
    address : str
        The address the sockets bind to (default ``127.0.0.1``: this host only; give the
        host's address, or ``"*"``, to be watched from another host).
    interval : float
        Seconds between samples (default 0.5: 2 Hz).
    source : SampleSource, optional
        Where the samples come from (default :func:`cudalab.cluster.records.rank_source`).
    job : str, optional
        The job's name (default :func:`cudalab.cluster.connection.job_id`).

    Returns
    -------
    Publisher

    Raises
    ------
    ValueError
        No directory given and ``CUDALAB_CLUSTER`` is unset, or a bad argument.
    RuntimeError
        pyzmq is missing or the sockets cannot be bound.
    """
    if directory is None:
        directory = os.environ.get(CLUSTER_ENV, "").strip()
        if not directory:
            raise ValueError("serve(): no directory given and the environment variable "
                             f"{CLUSTER_ENV} is not set")
    key = os.path.realpath(os.fspath(directory))
    with _lock:
        running = _publishers.get(key)
        if running is not None and running.running:
            return running
        publisher = Publisher(key, address, interval, source, job).start()
        _publishers[key] = publisher
    _install_sigterm()
    return publisher


def serve_from_env() -> Publisher | None:
    """``serve()`` into ``$CUDALAB_CLUSTER`` when it is set (``import cudalab`` calls it);
    a failure is a warning, never an exception out of the import.

    A process started by a publishing rank (a DataLoader worker, a compile worker, any
    subprocess inheriting the environment) does not publish: it would show as a second
    process of the same rank. The rank marks its environment with its pid
    (:data:`PUBLISHER_ENV`); a process that finds another live process's pid there stays
    quiet.
    """
    directory = os.environ.get(CLUSTER_ENV, "").strip()
    if not directory:
        return None
    parent = os.environ.get(PUBLISHER_ENV, "")
    if parent.isdigit() and int(parent) != os.getpid() and pid_alive(int(parent)):
        return None
    try:
        publisher = serve(directory,
                          address=os.environ.get("CUDALAB_CLUSTER_ADDRESS", "127.0.0.1"))
    except Exception as exc:  # noqa: BLE001 - never break the import
        import warnings

        warnings.warn(f"cudalab: {CLUSTER_ENV}={directory!r} but this process cannot publish "
                      f"its memory: {exc}", RuntimeWarning, stacklevel=2)
        return None
    os.environ[PUBLISHER_ENV] = str(os.getpid())
    return publisher


def publishers() -> list[Publisher]:
    """The publishers of this process."""
    with _lock:
        return list(_publishers.values())


def stop_all() -> None:
    """Stop every publisher of this process (at exit)."""
    with _lock:
        running = list(_publishers.values())
        _publishers.clear()
    for p in running:
        p.stop()


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM while publishing: remove the connection files, then end by SIGTERM."""
    import signal

    for p in list(_publishers.values()):
        p._stop.set()
        p._remove_file()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm() -> None:
    """Install :func:`_on_sigterm` when SIGTERM has its default action (main thread only)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not allowed here: the exit handlers still clean up
        pass


def _forget_in_child() -> None:
    _publishers.clear()


atexit.register(stop_all)
os.register_at_fork(after_in_child=_forget_in_child)
