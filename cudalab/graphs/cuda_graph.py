"""The CUDA graph itself (``torch.cuda.CUDAGraph``): capture, instantiate, replay, reset.

:class:`CUDAGraph` captures the work queued on a stream into a driver graph and replays it
with one launch. Pool ids come from :mod:`cudalab.allocator.pools`; the capture-id map
(which graph a capturing stream belongs to) lives here with the class that fills it.

The lifecycle is torch 2.11's (``aten/src/ATen/cuda/CUDAGraph.cpp``):

* ``capture_begin``: registers the current device's default generator state, runs every
  registered state's ``capture_prologue`` (outside the capture), refuses the null stream,
  routes the capture's allocations to the graph's private pool
  (``begin_allocate_to_pool`` with a filter on the allocating stream's capture id, before the
  capture begins), then begins the capture on the current stream;
* ``capture_end``: ends the capture on the stream it began on, stops the routing, stores each
  generator state's whole-graph offset increment, warns on an empty graph, and (unless
  ``keep_graph``) instantiates the graph (flags ``AUTO_FREE_ON_LAUNCH | USE_NODE_PRIORITY``)
  and destroys it (kept in debug mode for :meth:`CUDAGraph.debug_dump`);
* ``replay``: each registered generator state's ``replay_prologue`` on the current stream,
  then one graph launch;
* ``reset`` (and garbage collection): destroys the graph and its executable, unregisters the
  generator states and releases the private pool (its memory becomes releasable by
  ``empty_cache()`` once no other graph shares it).

An operation that the capture does not permit (a synchronize, an event or stream query, a
copy to pageable host memory) raises :class:`cudalab.StreamCaptureError` naming it; the
capture is then invalidated, and ending it (``capture_end()``, or leaving the ``with
cudalab.graph(...)`` block, which always ends it) leaves everything ready for the next one.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import warnings
from typing import Any

from cudalab import _internal, _interrupts
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab._driver.base import (
    CAPTURE_MODE_GLOBAL,
    CAPTURE_MODE_RELAXED,
    CAPTURE_MODE_THREAD_LOCAL,
    CAPTURE_STATUS_NONE,
    EVENT_DISABLE_TIMING,
    GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH,
    GRAPH_INSTANTIATE_USE_NODE_PRIORITY,
)
from cudalab._kernels.fill import ALL_FILL_KERNELS
from cudalab.allocator.pools import check_pool_id, new_graph_pool_id
from cudalab.allocator.registry import get_allocator
from cudalab.errors import CudaError
from cudalab.random import Generator, PhiloxState
from cudalab.random.generator import all_default_generators

__all__ = ["CUDAGraph", "CAPTURE_ERROR_MODES", "INSTANTIATE_FLAGS", "STATE_EMPTY",
           "STATE_CAPTURING", "STATE_CAPTURED", "STATE_READY", "capture_mode"]

#: torch's ``capture_error_mode`` strings -> the driver's capture modes.
CAPTURE_ERROR_MODES = {"global": CAPTURE_MODE_GLOBAL, "thread_local": CAPTURE_MODE_THREAD_LOCAL,
                       "relaxed": CAPTURE_MODE_RELAXED}

#: Instantiation flags, torch's: cudaGraphInstantiateFlagAutoFreeOnLaunch | UseNodePriority.
INSTANTIATE_FLAGS = GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH | GRAPH_INSTANTIATE_USE_NODE_PRIORITY

# CUDAGraph states (its repr shows them).
#: Nothing captured (new, or after reset()).
STATE_EMPTY = "empty"
#: Between capture_begin() and capture_end().
STATE_CAPTURING = "capturing"
#: Captured, kept (keep_graph=True) and not instantiated yet.
STATE_CAPTURED = "captured"
#: Instantiated: replay() launches it.
STATE_READY = "ready"

_EMPTY_GRAPH_WARNING = ("The CUDA Graph is empty. This usually means that the graph was "
                        "attempted to be captured on wrong device or stream.")
_DEBUG_WARNING = "CUDA Graphs debug not enabled, set with [graph].enable_debug_mode()"

# Ctrl-C is deferred while this module's code runs (cudalab._interrupts): capture_begin() and
# capture_end() (the driver's capture, the allocator's routing to the private pool, the
# capture-id map and its lock, the generator states' capture mode), reset() and replay()
# either happen whole or not at all; the KeyboardInterrupt comes in the caller's code.
_interrupts.guard_files([os.path.abspath(__file__)])

_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT

#: (device, pool id) of private pools whose graph was collected while that device's
#: allocator lock was held (the garbage collector can run a finalizer inside the allocator,
#: and the lock is not re-entrant) or while a capture was open (releasing a pool may free
#: segments, and cuMemFree would invalidate the capture): released by ``_release_deferred``
#: once no capture is open (the next capture_begin(), the end of a capture, reset()).
_deferred_releases: list[tuple[int, tuple[int, int]]] = []

#: (backend, executable graph or None, graph or None, event or None) of graphs collected
#: while a capture was open: destroying them then is a "potentially unsafe" call that
#: invalidates the capture (cuGraphExecDestroy during a global capture raises
#: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED on an H200, and the capture's next launch 901).
#: Destroyed by ``_release_deferred`` once no capture is open.
_deferred_destroys: list[tuple[Any, Any, Any, Any]] = []


def _release_pool(device: int, pool_id: tuple[int, int], finalizing: bool) -> None:
    """Give back a graph's use of its pool; from a finalizer only when the allocator's lock
    is free and no capture is open (else deferred, see ``_deferred_releases``)."""
    alloc = get_allocator(device)
    if finalizing and (_capturing or alloc.is_locked()):
        _deferred_releases.append((device, pool_id))
        return
    alloc.release_pool(pool_id)


def _release_deferred() -> None:
    """Destroy what finalizers deferred (``_deferred_destroys``, ``_deferred_releases``),
    unless a capture is open (then it waits for the capture's end). The destroys came from
    finalizers, which never raise: a driver error destroying one is dropped as theirs was."""
    if _capturing:
        return
    while _deferred_destroys:
        backend, graph_exec, graph, event = _deferred_destroys.pop()
        for destroy, handle in ((backend.graph_exec_destroy, graph_exec),
                                (backend.graph_destroy, graph), (backend.event_destroy, event)):
            if handle is not None:
                try:
                    destroy(handle)
                except Exception:  # noqa: BLE001 - a finalizer's destroy, deferred
                    pass
    while _deferred_releases:
        device, pool_id = _deferred_releases.pop()
        get_allocator(device).release_pool(pool_id)


#: Graphs being captured, by capture id (torch's capture-id map; guarded by ``_map_lock``):
#: the streams module's map, whose emptiness the fills read (``cudalab.streams.open_captures``).
_capturing: dict[int, CUDAGraph] = _streams.open_captures
_map_lock = threading.Lock()


def _load_fill_kernels(backend: Any, device: int) -> None:
    """Load the fill kernels on ``device`` before a capture begins: ``fill_`` takes them
    while a graph captures (a kernel node replays far cheaper than a memset node), also for
    the patterns an eager warm-up fills with a memset, and a module load is best kept out of
    the capture (after the first capture on a device: five dictionary reads). A device whose
    kernels cannot load (no NVRTC) still captures what needs none; its fills then fail in
    the capture as any kernel would."""
    for kernel in ALL_FILL_KERNELS:
        try:
            kernel.get_function(device, backend)
        except Exception:  # noqa: BLE001 - see the docstring
            return


def capture_mode(capture_error_mode: Any) -> int:
    """The driver's capture mode for torch's ``capture_error_mode`` string.

    Raises
    ------
    TypeError
        Not a str.
    RuntimeError
        Not one of ``global``, ``thread_local``, ``relaxed`` (torch's message).
    """
    if not isinstance(capture_error_mode, str):
        raise TypeError(f"capture_error_mode must be a str, got "
                        f"{type(capture_error_mode).__name__}")
    mode = CAPTURE_ERROR_MODES.get(capture_error_mode)
    if mode is None:
        raise RuntimeError("Unknown capture error mode. Expected `global`, `thread_local`, or "
                           f"`relaxed`, got {capture_error_mode}")
    return mode


def _pool_id(pool: Any) -> tuple[int, int] | None:
    """A pool id from ``pool=``: a ``(int, int)`` handle or a MemPool (its ``.id``); None for
    ``(0, 0)``, which torch's ``capture_begin`` takes as "no pool" (a new private one)."""
    pid = getattr(pool, "id", pool)
    if isinstance(pid, (tuple, list)) and len(pid) == 2 and all(
            type(x) is int and x == 0 for x in pid):
        return None
    return check_pool_id(pid, "pool")


class CUDAGraph:
    """A CUDA graph: capture once, replay many times (``torch.cuda.CUDAGraph``).

    Parameters
    ----------
    keep_graph : bool, optional
        Keep the captured graph after :meth:`capture_end` instead of instantiating and
        destroying it at once (torch's ``keep_graph``): :meth:`instantiate` (or the first
        :meth:`replay`) then builds the executable, and :meth:`raw_cuda_graph` returns it.

    Notes
    -----
    Capture on a non-default stream (:class:`graph` does it for you). Warm up first: the first
    call of a kernel compiles and loads it, which a capture cannot contain. Replays run the
    captured kernels on the same memory: copy new inputs into the tensors the capture read.
    """

    def __init__(self, keep_graph: bool = False):
        if not isinstance(keep_graph, bool):
            raise TypeError(f"keep_graph must be a bool, got {type(keep_graph).__name__}")
        self._keep_graph = keep_graph
        self._state = STATE_EMPTY
        self._backend: Any = None
        self._graph: Any = None  # the driver graph: kept with keep_graph or in debug mode
        self._exec: Any = None  # the executable graph, once instantiated
        self._device = -1  # the capture's device
        self._stream: _streams.Stream | None = None  # the capture stream
        self._capture_id = 0  # the driver's id of the capture (0 outside)
        self._mode = CAPTURE_MODE_GLOBAL
        self._pool: tuple[int, int] | None = None  # the private pool's id, once captured
        self._routed = False  # allocations are routed to the pool (begin..end_allocate)
        self._holds_pool = False  # this graph counts as a use of the pool (until reset)
        self._debug = False
        #: generator state -> whole-graph offset increment (0 until capture_end)
        self._states: dict[PhiloxState, int] = {}
        self._replay_states: tuple[tuple[PhiloxState, int], ...] = ()
        self._node_count = 0  # nodes of the captured graph (0 before capture_end)
        self._alloc_streams: set[int] = set()  # during capture: streams routed to the pool
        #: (stream key, handle) of the streams that allocated in the capture, and the event
        #: each replay on another stream records for them to wait on (None: no allocation)
        self._join_streams: tuple[tuple[int, Any], ...] = ()
        self._join_event: Any = None

    def __repr__(self) -> str:
        parts = [f"state={self._state}"]
        if self._state != STATE_EMPTY:
            sim = " (simulated)" if self._backend is not None and self._backend.simulated else ""
            parts.append(f"device=cuda:{self._device}{sim}")
            parts.append(f"pool={self._pool}")
        if self._state in (STATE_CAPTURED, STATE_READY):
            parts.append(f"nodes={self._node_count}")
        if self._states:
            parts.append(f"generators={len(self._states)}")
        if self._keep_graph:
            parts.append("keep_graph=True")
        if self._debug:
            parts.append("debug")
        return f"<cudalab.CUDAGraph {' '.join(parts)}>"

    # ------------------------------------------------------------------ capture
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        """Begin capturing the work queued on the current stream.

        Parameters
        ----------
        pool : tuple of (int, int), MemPool or None, optional
            Share the private memory pool of this id (``other_graph.pool()``,
            :func:`graph_pool_handle`, a ``MemPool``) instead of a new one; None or
            ``(0, 0)`` (as torch): a new one.
        capture_error_mode : {"global", "thread_local", "relaxed"}, optional
            Which threads' unsafe calls (synchronize, query, ...) the capture refuses while
            it runs, as the driver's ``cudaStreamCaptureMode`` defines.

        Raises
        ------
        RuntimeError
            This graph already owns a captured graph; the current stream is the default
            stream; unknown ``capture_error_mode``.
        TypeError, ValueError
            A ``pool`` that is not a pool id.
        """
        if self._state != STATE_EMPTY:
            raise RuntimeError("This CUDAGraph instance already owns a captured graph. To "
                               "capture a new graph, create a new instance.")
        mode = capture_mode(capture_error_mode)
        if _deferred_releases:
            _release_deferred()
        pid = None if pool is None else _pool_id(pool)
        b = _internal.backend()
        dev = _devices.current_device()
        stream = _streams.current_stream(dev)
        if stream.is_legacy_null:
            raise RuntimeError("CUDA graphs must be captured on a non-default stream. (However, "
                               "after capture, it's ok to replay them on the default stream.)")
        handle = _internal.stream_handle(stream)
        # RNG: the default generator joins the registered states; prologues run before the
        # capture (their fills are not captured).
        default_state = all_default_generators()[dev].graph_state
        if default_state not in self._states:
            default_state.register_graph(self)
            self._states[default_state] = 0
        for st in self._states:
            st.capture_prologue(stream)
        _load_fill_kernels(b, dev)
        self._backend, self._device, self._stream, self._mode = b, dev, stream, mode
        self._pool = new_graph_pool_id() if pid is None else pid
        capture_id = [0]  # read by the filter: set once the capture has begun
        alloc_streams = self._alloc_streams = set()  # streams whose allocations it routed

        def in_this_capture(stream_key: int) -> bool:
            if not stream_key or not capture_id[0]:
                return False
            try:
                info = b.stream_capture_info(b.stream_from_int(dev, stream_key))
            except Exception:  # noqa: BLE001 - a stream the driver cannot tell about
                return False
            if info[1] == capture_id[0]:
                alloc_streams.add(stream_key)
                return True
            return False

        # Registered under a key no capture id takes before the capture begins (its id is
        # known only after): a finalizer the collector runs in between sees a capture open
        # and defers its driver destroys (_teardown), which would invalidate this capture.
        beginning = -id(self)
        with _map_lock:
            _capturing[beginning] = self
        try:
            try:
                try:
                    get_allocator(dev).begin_allocate_to_pool(self._pool, in_this_capture)
                    self._routed = self._holds_pool = True
                except NotImplementedError:
                    pass  # an allocator without private pools (cudaMallocAsync, pluggable, ...)
                b.stream_begin_capture(handle, mode)
            except BaseException:
                self._abandon()
                raise
            capture_id[0] = self._capture_id = b.stream_capture_info(handle)[1]
            with _map_lock:
                _capturing[self._capture_id] = self
        finally:
            with _map_lock:
                _capturing.pop(beginning, None)
        self._state = STATE_CAPTURING

    def capture_end(self) -> None:
        """End the capture (on the stream it began on) and, unless ``keep_graph``,
        instantiate the graph.

        Raises
        ------
        RuntimeError
            Not capturing, or the current stream is not the capture stream.
        StreamCaptureError
            The capture was invalidated by an operation it does not permit (the graph is
            left empty, ready for a new capture).
        """
        if self._state != STATE_CAPTURING:
            raise RuntimeError("capture_end() called before capture_begin().")
        stream = _streams.current_stream(self._device)
        if stream != self._stream:
            raise RuntimeError("Capture must end on the same stream it began on.")
        b = self._backend
        try:
            g = b.stream_end_capture(_internal.stream_handle(stream))
        except BaseException:
            self._abandon()
            raise
        with _map_lock:
            _capturing.pop(self._capture_id, None)
        self._capture_id = 0
        self._end_routing()
        if _deferred_destroys or _deferred_releases:
            _release_deferred()
        for st in self._states:
            self._states[st] = st.capture_epilogue()
        # A state the graph draws nothing from needs no refresh before a replay (its words
        # are not read, its offset does not move; newer torch skips it too).
        self._replay_states = tuple((st, inc) for st, inc in self._states.items() if inc)
        if self._alloc_streams:
            # Arrays allocated in the capture belong to the capture's streams, where their
            # reads (numpy(), copies) are ordered: each replay on another stream makes them
            # wait for it (one event), so a read never sees a replay half done.
            self._join_event = b.event_create(self._device, EVENT_DISABLE_TIMING)
            self._join_streams = tuple((key, b.stream_from_int(self._device, key))
                                       for key in sorted(self._alloc_streams))
        self._alloc_streams = set()
        self._graph = g
        self._node_count = b.graph_node_count(g)
        if not self._node_count:
            warnings.warn(_EMPTY_GRAPH_WARNING, UserWarning, stacklevel=2)
        self._state = STATE_CAPTURED
        if not self._keep_graph:
            self._instantiate()
            if not self._debug:
                b.graph_destroy(g)
                self._graph = None

    def _end_routing(self) -> None:
        if self._routed:
            self._routed = False
            get_allocator(self._device).end_allocate_to_pool(self._pool)

    def _abandon(self) -> None:
        """Undo a capture that failed: stop routing, release the pool, leave capture mode
        on the generator states, forget the capture; the graph is empty again."""
        with _map_lock:
            _capturing.pop(self._capture_id, None)
        self._capture_id = 0
        try:
            self._end_routing()
        finally:
            for st in self._states:
                st.capture_epilogue()
            self.reset()  # (reset() releases what finalizers deferred, once no capture is open)

    # ------------------------------------------------------------------ executable
    def instantiate(self) -> None:
        """Build the executable graph of a graph kept with ``keep_graph=True`` (again, if it
        was already built).

        Raises
        ------
        RuntimeError
            Before capture_end(), or without ``keep_graph`` (capture_end() instantiates).
        """
        if self._state not in (STATE_CAPTURED, STATE_READY):
            raise RuntimeError("capture_end() must have been called before calling instantiate")
        if not self._keep_graph:
            raise RuntimeError("instantiate() is intended to be called by the user only when "
                               "keep_graph=true")
        self._instantiate()

    def _instantiate(self) -> None:
        b = self._backend
        if self._exec is not None:
            b.graph_exec_destroy(self._exec)
            self._exec = None
        try:
            self._exec = b.graph_instantiate(self._graph, INSTANTIATE_FLAGS)
        except CudaError as exc:
            if exc.code != _INVALID_CONTEXT:
                raise
            # Ended on a thread where no context is current (a relaxed capture ended on
            # another thread): instantiating needs the capture device's (seen on an H200).
            _devices.ensure_context(self._device)
            self._exec = b.graph_instantiate(self._graph, INSTANTIATE_FLAGS)
        self._state = STATE_READY

    def replay(self) -> None:
        """Launch the graph on the current stream (each generator state first advances, so
        every replay draws fresh random numbers).

        Raises
        ------
        RuntimeError
            Nothing was captured.
        """
        ex = self._exec
        if ex is None:
            if self._state == STATE_CAPTURED:  # keep_graph: instantiate on first replay
                self._instantiate()
                ex = self._exec
            else:
                raise RuntimeError("Called CUDAGraph::replay without a preceding successful "
                                   "capture.")
        stream = _streams.current_stream(self._device)
        for st, inc in self._replay_states:
            st.replay_prologue(inc, stream)
        if stream.is_legacy_null:
            _internal.ensure_context(self._device)
        # (the handle read directly, not through _internal.stream_handle: the replay row of
        # benchmarks/graphs.py counts every frame)
        b = self._backend
        b.graph_launch(ex, stream.handle)
        if self._join_streams:
            key = stream.cuda_stream
            ev = self._join_event
            recorded = False
            for skey, handle in self._join_streams:
                if skey != key:
                    if not recorded:
                        b.event_record(ev, stream.handle)
                        recorded = True
                    b.stream_wait_event(handle, ev)

    def reset(self) -> None:
        """Destroy the graph and its executable, unregister the generator states and release
        the private pool; the object can capture again.

        Raises
        ------
        RuntimeError
            During a capture (end it first).
        """
        if self._state == STATE_CAPTURING and self._capture_id:
            raise RuntimeError("CUDAGraph.reset() cannot be called during a capture; call "
                               "capture_end() first")
        _release_deferred()
        self._teardown(finalizing=False)

    def _teardown(self, finalizing: bool) -> None:
        b = self._backend
        # A finalizer that runs while a capture is open (the collector runs anywhere) must
        # not destroy driver objects then: it would invalidate the capture. It hands them to
        # _release_deferred, which destroys them once no capture is open.
        defer = finalizing and bool(_capturing)
        try:
            if defer:
                ex, g, ev = self._exec, self._graph, self._join_event
                self._exec = self._graph = self._join_event = None
                if ex is not None or g is not None or ev is not None:
                    _deferred_destroys.append((b, ex, g, ev))
            if self._exec is not None:
                ex, self._exec = self._exec, None
                b.graph_exec_destroy(ex)
            if self._graph is not None:
                g, self._graph = self._graph, None
                b.graph_destroy(g)
        finally:
            for st in list(self._states):
                st.unregister_graph(self)
            self._states.clear()
            self._replay_states = ()
            self._node_count = 0
            self._join_streams = ()
            if self._join_event is not None:
                ev, self._join_event = self._join_event, None
                b.event_destroy(ev)
            if self._holds_pool:
                self._holds_pool = False
                assert self._pool is not None
                _release_pool(self._device, self._pool, finalizing)
            self._state = STATE_EMPTY

    def __del__(self) -> None:
        if sys.is_finalizing() or getattr(self, "_state", STATE_EMPTY) == STATE_EMPTY:
            return
        if self._state == STATE_CAPTURING:
            return  # a capture still running keeps its stream; nothing safe to do here
        try:
            self._teardown(finalizing=True)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # ------------------------------------------------------------------ accessors
    def pool(self) -> tuple[int, int]:
        """The id of this graph's private memory pool, to share it with a later capture.

        Raises
        ------
        RuntimeError
            Before a successful capture.
        """
        if self._state not in (STATE_CAPTURED, STATE_READY):
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful "
                               "capture.")
        assert self._pool is not None
        return self._pool

    def register_generator_state(self, state: Any) -> None:
        """Register a generator (or its ``graph_state``) so that replays advance it too.

        Parameters
        ----------
        state : cudalab.random.Generator or cudalab.random.PhiloxState

        Raises
        ------
        TypeError
            Neither a Generator nor a PhiloxState.
        """
        if isinstance(state, Generator):
            state = state.graph_state
        if not isinstance(state, PhiloxState):
            raise TypeError(f"register_generator_state expects a cudalab.random.Generator or "
                            f"PhiloxState, got {type(state).__name__}")
        if state not in self._states:
            state.register_graph(self)
            self._states[state] = 0

    def enable_debug_mode(self) -> None:
        """Keep the captured graph after instantiation, for :meth:`debug_dump`."""
        self._debug = True

    def debug_dump(self, path: str | os.PathLike[str]) -> None:
        """Write the graph as the driver's verbose DOT file at ``path`` (atomically).

        Needs :meth:`enable_debug_mode` before capture (else warns and writes nothing).

        Parameters
        ----------
        path : str or os.PathLike
        """
        target = os.fspath(path)
        if not isinstance(target, str):
            raise TypeError(f"debug_dump: path must be a str or os.PathLike of str, got "
                            f"{type(target).__name__}")
        if not self._debug or self._graph is None:
            warnings.warn(_DEBUG_WARNING, UserWarning, stacklevel=2)
            return
        directory = os.path.dirname(os.path.abspath(target))
        fd, tmp = tempfile.mkstemp(prefix=".cudalab-graph-", suffix=".dot", dir=directory)
        os.close(fd)
        try:
            self._backend.graph_debug_dot_print(self._graph, tmp)
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def raw_cuda_graph(self) -> int:
        """The driver's ``CUgraph`` handle as an int (needs ``keep_graph=True``)."""
        if not self._keep_graph:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless CUDAGraph "
                               "was initialized with keep_graph=true")
        if self._graph is None:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance until "
                               "capture_end() has been called")
        return int(self._backend.handle_int(self._graph))

    def raw_cuda_graph_exec(self) -> int:
        """The driver's ``CUgraphExec`` handle as an int (after instantiation)."""
        if self._exec is None:
            raise RuntimeError("You cannot access the raw cudaGraphExec_t instance until "
                               "instantiate() has been called")
        return int(self._backend.handle_int(self._exec))

    def node_kinds(self) -> list[str]:
        """The kind of each node of the captured graph ("kernel", "memcpy", "memset", ...).

        Not in torch (what ``%%cuda_timed --graph`` counts). It reads the graph, which is
        kept only with ``keep_graph=True`` or :meth:`enable_debug_mode` (capture_end
        destroys it otherwise, as torch).

        Raises
        ------
        RuntimeError
            No graph is kept.
        """
        if self._graph is None:
            raise RuntimeError("CUDAGraph.node_kinds() reads the captured graph: create the "
                               "CUDAGraph with keep_graph=True (or call enable_debug_mode() "
                               "before the capture)")
        return self._backend.graph_node_kinds(self._graph)

    @staticmethod
    def get_currently_capturing_graph() -> CUDAGraph:
        """The graph whose capture the current stream belongs to.

        Raises
        ------
        RuntimeError
            The current stream is not capturing, or not into a CUDAGraph.
        """
        b = _internal.backend()
        status, cid = b.stream_capture_info(_internal.stream_handle(_streams.current_stream()))
        if status == CAPTURE_STATUS_NONE:
            raise RuntimeError("The current stream is not currently capturing.")
        with _map_lock:
            g = _capturing.get(cid)
        if g is None:
            raise RuntimeError(
                "get_currently_capturing_graph() can be used only between capture_begin() and "
                "capture_end(). Did you use a stream without making it depend upon the "
                "original stream used for capture?")
        return g
