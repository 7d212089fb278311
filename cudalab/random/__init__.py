"""Random numbers on the GPU with ``torch.cuda``'s generator: the same seed gives the same bits.

Each device has a default :class:`Generator` (Philox4x32-10: a 64-bit seed and a 64-bit
offset), seeded non-deterministically when first used unless :func:`manual_seed` or
:func:`set_rng_state` said otherwise. Generation follows torch's CUDA kernels (grid, per-thread
subsequences, offset increments, curand's uint->float and Box-Muller math), so
``cudalab.manual_seed(s); cudalab.rand(n)`` equals ``torch.cuda.manual_seed(s);
torch.rand(n, device="cuda")`` bit for bit on the same GPU model (the grid depends on the
SM count and max threads per SM, as in torch). Kernels run on the current stream.

State API (torch's names and semantics):

* :func:`manual_seed`, :func:`manual_seed_all`, :func:`seed`, :func:`seed_all`,
  :func:`set_rng_state`, :func:`set_rng_state_all` never initialise CUDA: before cudalab is
  initialised they are queued and applied at the first use of a generator afterwards; with
  no GPU they are silently ignored (as in torch).
* :func:`get_rng_state` returns 16 bytes (little-endian uint64 seed, int64 offset) as a numpy
  uint8 array; :func:`set_rng_state` also takes the 8-byte seed-only form. Offsets must be
  multiples of 4. A bad state raises :class:`RandomStateError` (a ValueError and a
  RuntimeError) and changes nothing. None of these functions creates a CUDA context.

CUDA graphs: every generator's state (:attr:`Generator.graph_state`, a :class:`PhiloxState`)
implements torch's graph-safe protocol (``register_graph``, ``capture_prologue``,
``capture_epilogue``, ``replay_prologue``): kernels captured into a graph read the seed and
base offset from device memory plus an offset reserved inside the graph, and each replay
advances the generator by the whole graph's increment, so every replay draws fresh numbers.
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from cudalab import array as _array
from cudalab import devices as _devices
from cudalab import kernels as _kernels
from cudalab import streams as _streams

__all__ = [
    "Generator",
    "PhiloxState",
    "RandomStateError",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
    "initial_seed",
    "get_rng_state",
    "get_rng_state_all",
    "set_rng_state",
    "set_rng_state_all",
    "fork_rng",
    "default_generators",  # noqa: F822 - a module attribute made on access (__getattr__)
    "rand",
    "randn",
    "randint",
    "normal",
    "uniform_",
    "normal_",
    "bernoulli_",
]

#: The seed of a new ``Generator`` (torch's ``default_rng_seed_val``); default generators are
#: seeded non-deterministically instead.
DEFAULT_SEED = 67280421310721
_MASK64 = (1 << 64) - 1
_INT32_MAX = (1 << 31) - 1
_BLOCK_THREADS = 256  # torch's block size (fixes the grid formula)

_lock = threading.Lock()  # guards every PhiloxState and the queue below


class RandomStateError(ValueError, RuntimeError):
    """An invalid seed, RNG state or offset (nothing was changed)."""


def _nondeterministic_seed() -> int:
    """53 random bits, like torch's ``getNonDeterministicRandom(is_cuda=true)``."""
    return int.from_bytes(os.urandom(8), "little") & ((1 << 53) - 1)


def _as_seed(seed: Any, what: str) -> int:
    if isinstance(seed, bool):
        seed = int(seed)
    try:
        s = operator.index(seed)
    except TypeError:
        raise TypeError(f"{what}: the seed must be an integer, got {type(seed).__name__}") from None
    if not -(1 << 63) <= s <= _MASK64:
        raise RandomStateError(f"{what}: seed {s} is out of range; seeds are 64-bit: "
                               "[-2**63, 2**64 - 1] (negative seeds wrap)")
    return s & _MASK64


def _as_offset(offset: Any, what: str) -> int:
    try:
        o = operator.index(offset)
    except TypeError:
        raise TypeError(f"{what}: the offset must be an integer, got "
                        f"{type(offset).__name__}") from None
    if not 0 <= o <= _MASK64:
        raise RandomStateError(f"{what}: offset {o} is out of range [0, 2**64 - 1]")
    if o % 4:
        raise RandomStateError(f"{what}: offset must be a multiple of 4, got {o}")
    return o


def _parse_state(new_state: Any, what: str) -> tuple[int, int]:
    """(seed, offset) from a 16-byte (or 8-byte, seed only) uint8 host state."""
    if isinstance(new_state, _array.DeviceArray):
        raise TypeError(f"{what}: the RNG state must be a host uint8 array (numpy, bytes or a "
                        "CPU torch.ByteTensor), not a DeviceArray; copy it with .numpy()")
    if isinstance(new_state, (bytes, bytearray)):
        data = bytes(new_state)
    else:
        try:
            arr = np.asarray(new_state)
        except Exception as exc:
            raise TypeError(f"{what}: the RNG state must be a uint8 array, got "
                            f"{type(new_state).__name__} ({exc})") from None
        if arr.dtype != np.uint8:
            raise TypeError(f"{what}: the RNG state must be a uint8 array (like torch's "
                            f"ByteTensor), got dtype {arr.dtype}")
        data = arr.tobytes()
    if len(data) == 16:
        seed = int.from_bytes(data[:8], "little")
        offset = int.from_bytes(data[8:], "little")
    elif len(data) == 8:
        seed, offset = int.from_bytes(data, "little"), 0
    else:
        raise RandomStateError(f"{what}: RNG state is wrong size: expected 16 bytes (uint64 "
                               f"seed, int64 offset) or 8 bytes (seed only), got {len(data)}")
    if offset % 4:
        raise RandomStateError(f"{what}: the state's offset must be a multiple of 4, got "
                               f"{offset}")
    return seed, offset


def _state_bytes(seed: int, offset: int) -> np.ndarray:
    return np.frombuffer(seed.to_bytes(8, "little") + offset.to_bytes(8, "little"),
                         dtype=np.uint8).copy()


# --------------------------------------------------------------------------- graph capture
_capturing_states = 0  # PhiloxStates between capture_prologue and capture_epilogue


def _stream_capturing(stream: _streams.Stream) -> bool:
    return bool(stream._b.stream_is_capturing(stream._handle))


def _assert_not_capturing(what: str, device: int) -> None:
    """torch's ``assertNotCapturing``: only checked while some generator is capturing."""
    if _capturing_states and _devices.is_initialized():
        if _stream_capturing(_streams.current_stream(device)):
            raise RuntimeError(f"{what} is not allowed while the current stream is being "
                               "captured into a CUDA graph")


def _set_graph_words(state: PhiloxState, seed: int, offset: int, stream: Any) -> None:
    from cudalab._kernels.philox import SET_STATE

    if stream is None:
        stream = _streams.current_stream(state.device)
    _launch(SET_STATE, state.device, stream, (1, 1, 1), (1, 1, 1),
            (state._graph_buf._ptr, seed, offset))


class PhiloxState:
    """The state behind a :class:`Generator` (torch's ``CUDAGeneratorState``): ``seed``,
    ``offset`` (Philox offset per thread, a multiple of 4) and the CUDA-graph bookkeeping.

    Graph protocol, for cudalab's graph capture (torch's ``CUDAGraph`` calls the same steps):

    1. ``register_graph(graph)`` before capture (allocates two device words the first time);
    2. ``capture_prologue(stream)`` just before the capture begins: writes (seed, 0) to the
       device words and starts counting offsets inside the graph;
    3. generation during capture (on a capturing stream) launches kernels that read the seed
       and base offset from the device words, at offsets reserved inside the graph;
    4. ``capture_epilogue()`` after the capture ends: returns the whole-graph increment;
    5. ``replay_prologue(increment, stream)`` before every replay, on the replay stream:
       writes (seed, offset) to the device words, then advances the offset by the increment.
    6. ``unregister_graph(graph)`` when the graph is destroyed.
    """

    __slots__ = ("device", "seed", "offset", "capturing", "offset_intragraph", "_graph_buf",
                 "_graphs")

    def __init__(self, device: int, seed: int, offset: int = 0):
        self.device = device
        self.seed = seed
        self.offset = offset
        self.capturing = False
        self.offset_intragraph = 0
        self._graph_buf: Any = None  # DeviceArray of 2 uint64: seed, base offset
        self._graphs: dict[int, Any] = {}

    def __repr__(self) -> str:
        cap = f", capturing (+{self.offset_intragraph})" if self.capturing else ""
        return f"<PhiloxState cuda:{self.device} seed={self.seed} offset={self.offset}{cap}>"

    def clone(self) -> PhiloxState:
        with _lock:
            other = PhiloxState(self.device, self.seed, self.offset)
            other.offset_intragraph = self.offset_intragraph
        return other

    # ----------------------------------------------------------------- graph protocol
    def register_graph(self, graph: Any) -> None:
        """Tie this state to ``graph`` (allocates the device words on first registration)."""
        _assert_not_capturing("PhiloxState.register_graph()", self.device)
        if self._graph_buf is None:
            self._graph_buf = _array.zeros((2,), np.uint64, device=self.device)
        self._graphs[id(graph)] = graph

    def unregister_graph(self, graph: Any) -> None:
        """Forget ``graph``; the device words are released with the last graph."""
        if self._graphs.pop(id(graph), None) is None:
            raise RuntimeError("PhiloxState.unregister_graph(): the graph is not registered")
        if not self._graphs:
            self._graph_buf = None

    def capture_prologue(self, stream: Any = None) -> None:
        """Before capture: device words := (seed, 0); offsets now count inside the graph."""
        global _capturing_states
        if self._graph_buf is None:
            raise RuntimeError("PhiloxState.capture_prologue(): call register_graph() first")
        _set_graph_words(self, self.seed, 0, stream)
        with _lock:
            if not self.capturing:
                self.capturing = True
                _capturing_states += 1
            self.offset_intragraph = 0

    def capture_epilogue(self) -> int:
        """After capture: the whole-graph offset increment (what each replay consumes)."""
        global _capturing_states
        with _lock:
            if self.capturing:
                self.capturing = False
                _capturing_states -= 1
            return self.offset_intragraph

    def replay_prologue(self, wholegraph_increment: int, stream: Any = None) -> None:
        """Before a replay, on the replay stream: device words := (seed, offset), then the
        offset advances by the (4-rounded) whole-graph increment."""
        _assert_not_capturing("PhiloxState.replay_prologue()", self.device)
        if self._graph_buf is None:
            raise RuntimeError("PhiloxState.replay_prologue(): no graph is registered")
        inc = operator.index(wholegraph_increment)
        if inc < 0:
            raise ValueError(f"wholegraph_increment must be >= 0, got {inc}")
        with _lock:
            seed, offset = self.seed, self.offset
            self.offset = (offset + ((inc + 3) // 4) * 4) & _MASK64
        _set_graph_words(self, seed, offset, stream)


# --------------------------------------------------------------------------- Generator
class Generator:
    """A Philox4x32-10 generator on one device (``torch.Generator(device="cuda")``).

    A new generator has torch's fixed default seed 67280421310721 and offset 0; pass it as
    ``generator=`` to the sampling functions for a stream of numbers independent of the
    default generator. Creating one does not create a CUDA context.
    """

    __slots__ = ("_device", "_state", "__weakref__")

    def __init__(self, device: Any = "cuda"):
        self._device = _devices._device_index(device)
        self._state = PhiloxState(self._device, DEFAULT_SEED)

    @classmethod
    def _wrap(cls, device: int, state: PhiloxState) -> Generator:
        g = object.__new__(cls)
        g._device = device
        g._state = state
        return g

    def __repr__(self) -> str:
        return f"<cudalab.Generator cuda:{self._device}>"

    @property
    def device(self) -> _devices.Device:
        """The generator's device (``Device('cuda:N')``)."""
        return _devices.Device("cuda", self._device)

    @property
    def graph_state(self) -> PhiloxState:
        """The state object (seed, offset, CUDA-graph protocol) this generator uses now."""
        return self._state

    def manual_seed(self, seed: int) -> Generator:
        """Seed with ``seed`` (64-bit; negative values wrap) and reset the offset to 0."""
        s = _as_seed(seed, "Generator.manual_seed()")
        _assert_not_capturing("Generator.manual_seed()", self._device)
        with _lock:
            self._state.seed = s
            self._state.offset = 0
        return self

    def seed(self) -> int:
        """Seed non-deterministically (53 random bits); returns the seed."""
        s = _nondeterministic_seed()
        self.manual_seed(s)
        return s

    def initial_seed(self) -> int:
        """The seed the generator was last seeded with."""
        return self._state.seed

    def get_state(self) -> np.ndarray:
        """16 bytes: little-endian uint64 seed, int64 offset (a new numpy uint8 array)."""
        _assert_not_capturing("Generator.get_state()", self._device)
        with _lock:
            seed, offset = self._state.seed, self._state.offset
        return _state_bytes(seed, offset)

    def set_state(self, new_state: Any) -> Generator:
        """Restore a state from :meth:`get_state` (or the 8-byte seed-only form). A bad state
        raises :class:`RandomStateError` or TypeError and leaves the generator unchanged."""
        seed, offset = _parse_state(new_state, "Generator.set_state()")
        self._set(seed, offset)
        return self

    def _set(self, seed: int, offset: int) -> None:
        _assert_not_capturing("Generator.set_state()", self._device)
        with _lock:
            self._state.seed = seed
            self._state.offset = offset

    def get_offset(self) -> int:
        """The Philox offset (per thread; advances by 4 * iterations per kernel)."""
        _assert_not_capturing("Generator.get_offset()", self._device)
        return self._state.offset

    def set_offset(self, offset: int) -> Generator:
        """Set the Philox offset (a multiple of 4)."""
        o = _as_offset(offset, "Generator.set_offset()")
        _assert_not_capturing("Generator.set_offset()", self._device)
        with _lock:
            self._state.offset = o
        return self

    def clone_state(self) -> Generator:
        """A new generator on the same device with a copy of this one's state."""
        return Generator._wrap(self._device, self._state.clone())

    def graphsafe_get_state(self) -> Generator:
        """A generator sharing this one's state object (for CUDA graphs, like torch)."""
        return Generator._wrap(self._device, self._state)

    def graphsafe_set_state(self, other: Generator) -> Generator:
        """Use ``other``'s state object from now on (shared, not copied)."""
        if not isinstance(other, Generator):
            raise TypeError(f"graphsafe_set_state expects a cudalab.Generator, got "
                            f"{type(other).__name__}")
        if other._device != self._device:
            raise ValueError(f"graphsafe_set_state: the state belongs to cuda:{other._device}, "
                             f"this generator to cuda:{self._device}")
        self._state = other._state
        return self


# --------------------------------------------------------------------------- defaults
_defaults: list[Generator | None] = []
_queued: list[Callable[[], None]] = []          # set_rng_state, seed, seed_all (in order)
_seed_calls: list[Callable[[], None] | None] = []  # latest manual_seed / manual_seed_all


def _default_generator(idx: int) -> Generator:
    """Device ``idx``'s default generator (CUDA initialised; index valid)."""
    if _queued or _seed_calls:
        _run_queued()
    gens = _defaults
    if idx < len(gens):
        g = gens[idx]
        if g is not None:
            return g
    with _lock:
        n = _devices.device_count()
        if len(_defaults) < n:
            _defaults.extend([None] * (n - len(_defaults)))
        g = _defaults[idx]
        if g is None:
            g = Generator._wrap(idx, PhiloxState(idx, _nondeterministic_seed()))
            _defaults[idx] = g
    return g


def _run_queued() -> None:
    """Apply the state calls made before CUDA was initialised (torch's ``_lazy_call`` order:
    queued calls first, then the latest manual_seed / manual_seed_all)."""
    global _seed_cb, _seed_all_cb
    if not _devices.is_initialized():
        return
    with _lock:
        calls = list(_queued) + [c for c in _seed_calls if c is not None]
        _queued.clear()
        _seed_calls.clear()
        _seed_cb = _seed_all_cb = None
    for call in calls:
        call()


def _lazy_call(call: Callable[[], None], kind: str | None = None) -> None:
    """Run ``call`` now if CUDA is initialised, else queue it (torch's ``_lazy_call``: only
    the latest manual_seed and manual_seed_all are kept, and they run last)."""
    global _seed_cb, _seed_all_cb
    if _devices.is_initialized():
        if _queued or _seed_calls:
            _run_queued()
        call()
        return
    with _lock:
        if kind is None:
            _queued.append(call)
            return
        if kind == "seed":
            _seed_cb = call
            order = [_seed_all_cb, _seed_cb]
        else:
            _seed_all_cb = call
            order = [_seed_cb, _seed_all_cb]
        _seed_calls[:] = order


_seed_cb: Callable[[], None] | None = None
_seed_all_cb: Callable[[], None] | None = None


def _pending_device(device: Any) -> int:
    """The device index a queued call applies to, without initialising CUDA."""
    if device is None:
        return _devices._tls.device
    if isinstance(device, bool):
        raise TypeError(f"expected a device index, got {device!r}")
    if isinstance(device, int):
        idx = device
    elif isinstance(device, (str, _devices.Device)):
        idx = _devices.Device(device).index
        if idx is None:
            return _devices._tls.device
    else:
        try:
            idx = operator.index(device)
        except TypeError:
            raise TypeError(f"expected a device index, 'cuda', 'cuda:N' or Device, got "
                            f"{device!r}") from None
    if idx < 0:
        raise ValueError(f"device index must be non-negative, got {idx}")
    return idx


def _target_device(device: Any) -> int | None:
    """Index for a state call: validated now when CUDA is up, else when the call runs.
    None when there is no GPU at all (the call is then ignored, as in torch)."""
    if _devices.is_initialized():
        return _devices._device_index(device)
    idx = _pending_device(device)
    n = _devices.device_count()  # no CUDA context: NVML and CUDA_VISIBLE_DEVICES
    if n == 0:
        return None
    if idx >= n:
        raise ValueError(f"Invalid device index {idx}: cudalab sees {n} CUDA device(s)")
    return idx


def manual_seed(seed: int) -> None:
    """Seed the current device's default generator (offset 0). Safe without a GPU: ignored."""
    s = _as_seed(int(seed), "manual_seed()")
    idx = _target_device(None)
    if idx is None:
        return
    _lazy_call(lambda: _default_generator(idx).manual_seed(s), "seed")


def manual_seed_all(seed: int) -> None:
    """Seed every device's default generator. Safe without a GPU: ignored."""
    s = _as_seed(int(seed), "manual_seed_all()")

    def call() -> None:
        for i in range(_devices.device_count()):
            _default_generator(i).manual_seed(s)

    _lazy_call(call, "seed_all")


def seed() -> None:
    """Seed the current device's default generator non-deterministically."""
    idx = _target_device(None)
    if idx is None:
        return
    _lazy_call(lambda: _default_generator(idx).seed())


def seed_all() -> None:
    """Seed every device with one non-deterministic seed."""

    def call() -> None:
        s = None
        for i in range(_devices.device_count()):
            g = _default_generator(i)
            if s is None:
                s = g.seed()
            else:
                g.manual_seed(s)

    _lazy_call(call)


def initial_seed() -> int:
    """The current device's default seed (initialises CUDA, without a context)."""
    return _default_generator(_devices.current_device()).initial_seed()


def get_rng_state(device: Any = None) -> np.ndarray:
    """The default generator's state of ``device`` (default: current) as 16 uint8 values:
    little-endian uint64 seed then int64 offset. Initialises CUDA (no context)."""
    return _default_generator(_devices._device_index(device)).get_state()


def get_rng_state_all() -> list[np.ndarray]:
    """:func:`get_rng_state` of every device."""
    return [get_rng_state(i) for i in range(_devices.device_count())]


def set_rng_state(new_state: Any, device: Any = None) -> None:
    """Restore the default generator of ``device`` (default: current) from a 16-byte (or 8-byte
    seed-only) uint8 state. Bad states raise :class:`RandomStateError`/TypeError and change
    nothing. Before CUDA is initialised the call is queued; without a GPU it is ignored."""
    seed_, offset = _parse_state(new_state, "set_rng_state()")
    idx = _target_device(device)
    if idx is None:
        return
    _lazy_call(lambda: _default_generator(idx)._set(seed_, offset))


def set_rng_state_all(new_states: Iterable[Any]) -> None:
    """:func:`set_rng_state` for devices 0, 1, ...; every state is checked before any is set."""
    parsed = [_parse_state(s, f"set_rng_state_all() state {i}")
              for i, s in enumerate(new_states)]
    targets = [_target_device(i) for i in range(len(parsed))]
    for idx, (seed_, offset) in zip(targets, parsed):
        if idx is not None:
            _lazy_call(lambda idx=idx, s=seed_, o=offset: _default_generator(idx)._set(s, o))


@contextlib.contextmanager
def fork_rng(devices: Iterable[Any] | None = None, enabled: bool = True) -> Iterator[None]:
    """Save the default generators' states of ``devices`` (default: all) and restore them on
    exit, like ``torch.random.fork_rng`` for CUDA (cudalab has no CPU generator to fork)."""
    if not enabled:
        yield
        return
    if devices is None:
        idxs = list(range(_devices.device_count()))
    else:
        idxs = [_devices._device_index(d) for d in devices]
    states = [(i, get_rng_state(i)) for i in idxs]
    try:
        yield
    finally:
        for i, st in states:
            set_rng_state(st, i)


def __getattr__(name: str) -> Any:
    if name == "default_generators":
        n = _devices.device_count()
        if n == 0:
            return ()
        _devices.init()
        return tuple(_default_generator(i) for i in range(n))
    raise AttributeError(f"module 'cudalab.random' has no attribute {name!r}")


# --------------------------------------------------------------------------- launching
_tls = threading.local()  # .cache: (kernel, device) -> (backend, function, args)
_plans: dict[tuple, tuple] = {}
_max_blocks: dict[int, int] = {}
#: Launch shape of cudalab's kernels (not torch's: values do not depend on it). Change with
#: :func:`_set_launch_tuning` (benchmarks sweep it).
_block = 256
_k_per_thread = 1
_tpt = 4  # torch threads per CUDA thread: philox.TPT (CL_TPT) of the kernels launched


def _set_launch_tuning(block: int | None = None, k_per_thread: int | None = None,
                       tpt: int | None = None) -> None:
    """Threads per block (32 to 256), Philox iterations per thread, and torch threads per
    CUDA thread (only with kernels built for it: ``philox.variant``) of the launches."""
    global _block, _k_per_thread, _tpt
    if tpt is not None:
        if tpt not in (1, 2, 4):
            raise ValueError("tpt must be 1, 2 or 4")
        _tpt = tpt
    if block is not None:
        if block not in (32, 64, 128, 256):
            raise ValueError("block must be 32, 64, 128 or 256")
        _block = block
    if k_per_thread is not None:
        if k_per_thread < 1:
            raise ValueError("k_per_thread must be >= 1")
        _k_per_thread = k_per_thread
    _plans.clear()


def _device_max_blocks(dev: int) -> int:
    mb = _max_blocks.get(dev)
    if mb is None:
        p = _devices.get_device_properties(dev)
        mb = _max_blocks[dev] = max(
            1, p.multi_processor_count * (p.max_threads_per_multi_processor // _BLOCK_THREADS))
    return mb


def torch_launch_plan(n: int, itemsize: int, unroll: int, max_blocks: int) -> list[tuple]:
    """torch's offset reservations for one ``n``-element fill: a list of ``(increment, chunk)``
    in order, ``chunk = (first element, count, S, K)`` or None for the reservation torch makes
    before splitting a tensor that needs 64-bit indexing into halves (each half then
    reserves its own increment, recursively, first half first)."""
    out: list[tuple] = []

    def rec(base: int, m: int) -> None:
        G = min((m + _BLOCK_THREADS - 1) // _BLOCK_THREADS, max_blocks)
        S = _BLOCK_THREADS * G
        K = (m - 1) // (S * unroll) + 1
        inc = K * 4
        if m <= _INT32_MAX and 1 + (m - 1) * itemsize <= _INT32_MAX:
            out.append((inc, (base, m, S, K)))
        else:
            out.append((inc, None))
            half = m // 2
            rec(base, half)
            rec(base + half, m - half)

    if n > 0:
        rec(0, n)
    return out


def _plan(dev: int, n: int, itemsize: int, unroll: int) -> tuple:
    """(total increment, steps) for one fill; a step is (increment, launch or None) with
    ``launch = (byte offset, count, S, K, grid, block)``. Cached."""
    key = (dev, n, itemsize, unroll)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    steps = []
    for inc, chunk in torch_launch_plan(n, itemsize, unroll, _device_max_blocks(dev)):
        launch = None
        if chunk is not None:
            base, m, S, K = chunk
            quads = S // _tpt
            blk = min(_block, quads)
            gx = -(-quads // blk)
            gy = min(-(-K // _k_per_thread), 65535)
            launch = (base * itemsize, m, S, K, (gx, gy, 1), (blk, 1, 1))
        steps.append((inc, launch))
    plan = (sum(inc for inc, _ in steps), tuple(steps))
    if len(_plans) >= 4096:
        _plans.clear()
    _plans[key] = plan
    return plan


def _launch(kernel: Any, device: int, stream: _streams.Stream, grid: tuple, block: tuple,
            args: tuple) -> None:
    """Launch with a per-thread cached function handle and argument pack (the values are
    built here, so Kernel.launch's conversions and checks are skipped)."""
    backend = stream._b
    try:
        cache = _tls.cache
    except AttributeError:
        cache = _tls.cache = {}
    entry = cache.get((kernel, device))
    if entry is None or entry[0] is not backend:
        entry = (backend, kernel.get_function(device, backend), backend.make_args(kernel.signature))
        cache[(kernel, device)] = entry
    handle = stream._handle
    if handle is None:
        raise RuntimeError(f"{stream!r} was closed")
    _ensure_context(device)
    entry[2].set(*args)
    backend.launch(entry[1], grid, block, 0, handle, entry[2])
    if _kernels._launch_blocking:
        backend.stream_synchronize(handle)
    if _kernels._launch_observers:
        for observer in tuple(_kernels._launch_observers):
            observer(kernel.name, device, stream, grid, block)


def _state_for(generator: Any, dev: int) -> PhiloxState:
    if generator is None:
        if dev < len(_defaults) and not (_queued or _seed_calls):
            g = _defaults[dev]
            if g is not None:
                return g._state
        return _default_generator(dev)._state
    if not isinstance(generator, Generator):
        raise TypeError(f"generator must be a cudalab.Generator, got {type(generator).__name__}")
    if generator._device != dev:
        raise ValueError(f"the generator is on cuda:{generator._device} but the output is on "
                         f"cuda:{dev}; use a generator of the output's device")
    return generator._state


def _reserve_in_graph(st: PhiloxState, total: int) -> tuple[int, int]:
    """Offsets inside a CUDA graph being captured: (offset, device words pointer)."""
    if not st.capturing:
        raise RuntimeError(
            "random generation on a stream that is being captured into a CUDA graph, with a "
            "generator not in capture mode: register the generator's graph_state with the "
            "graph (register_graph, capture_prologue) before capturing")
    if st.offset_intragraph + total > 0xFFFFFFFF:
        raise RuntimeError("the random offsets reserved inside this CUDA graph exceed 2**32 - 1")
    off = st.offset_intragraph
    st.offset_intragraph = off + total
    return off, st._graph_buf._ptr


def _generate(arr: _array.DeviceArray, kernel: Any, unroll: int, params: tuple,
              generator: Any, stream: Any = None) -> None:
    """Fill ``arr`` (contiguous, writable) with torch's values for ``kernel`` and ``params``,
    on the current stream of its device, advancing the generator like torch."""
    n = arr._size
    if not n:
        return
    dev = arr._device
    if generator is None and dev < len(_defaults) and not (_queued or _seed_calls):
        g = _defaults[dev]
        st = g._state if g is not None else _state_for(None, dev)
    else:
        st = _state_for(generator, dev)
    if stream is None:  # (a new array passes its allocation stream: the current one)
        stream = _current_stream(dev)
    plan = _plans.get((dev, n, arr._dtype.itemsize, unroll))
    if plan is None:
        plan = _plan(dev, n, arr._dtype.itemsize, unroll)
    total, steps = plan
    gstate = 0
    with _lock:
        seed_ = st.seed
        if _capturing_states and _stream_capturing(stream):
            off, gstate = _reserve_in_graph(st, total)
        else:
            if st.capturing:
                raise RuntimeError("random generation outside graph capture with a generator "
                                   "in capture mode (capture_prologue without "
                                   "capture_epilogue)")
            off = st.offset
            st.offset = (off + total) & _MASK64
    ptr = arr._ptr
    if len(steps) == 1:
        byte_off, m, S, K, grid, block = steps[0][1]
        _launch(kernel, dev, stream, grid, block, (ptr, m, S, K, seed_, off, gstate) + params)
        return
    for inc, launch in steps:
        if launch is not None:
            byte_off, m, S, K, grid, block = launch
            _launch(kernel, dev, stream, grid, block,
                    (ptr + byte_off, m, S, K, seed_, off, gstate) + params)
        off = (off + inc) & _MASK64


_current_stream = _streams.current_stream
_ensure_context = _devices._ensure_context


# --------------------------------------------------------------------------- dtypes, args
_FLOAT_TAGS = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64",
               np.dtype(np.float16): "f16"}
_INT_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8,
                                          np.uint16, np.uint32, np.uint64))


def _float_tag(dt: np.dtype, what: str) -> str:
    tag = _FLOAT_TAGS.get(dt)
    if tag is None:
        if dt.name == "bfloat16" and dt.itemsize == 2:
            return "bf16"
        raise TypeError(f"{what}: dtype must be a floating type (float16, bfloat16, float32, "
                        f"float64), got {dt}")
    return tag


def _size(size: tuple, what: str) -> Any:
    """``f(2, 3)``, ``f((2, 3))``, ``f([2, 3])``, ``f(5)``, ``f()`` -> a shape DeviceArray
    accepts (it checks the values)."""
    if len(size) == 1:
        size = size[0]
        if size is None:
            raise TypeError(f"{what}: a size is required")
    return size


def _float_out(size: tuple, dtype: Any, device: Any, what: str) -> tuple:
    """(new array, kernel tag) for rand/randn."""
    if dtype is None:
        return _array.DeviceArray(_size(size, what), _F32, device), "f32"
    dt = _array._normalize_dtype(dtype)
    tag = _float_tag(dt, what)
    return _array.DeviceArray(_size(size, what), dt, device), tag


_F32 = np.dtype(np.float32)


def _as_target(array: Any, what: str) -> _array.DeviceArray:
    if not isinstance(array, _array.DeviceArray):
        foreign = _array._foreign_cuda_array(array)
        if foreign is None:
            raise TypeError(f"{what} needs a cudalab.DeviceArray (or a CUDA array of another "
                            f"library), got {type(array).__name__}")
        array = foreign
    array._require_writable(what)
    return array


_kernel_table: dict[str, Any] | None = None


def _kernel(suffix: str) -> Any:
    global _kernel_table
    table = _kernel_table
    if table is None:
        from cudalab._kernels.philox import KERNELS

        table = _kernel_table = KERNELS
    return table[suffix]


def _to_half(x: float) -> np.float16:
    return np.float16(np.float32(x))  # static_cast<Half>(double): via float, like c10


def _to_bf16_float(x: float) -> np.float32:
    from cudalab._kernels.philox import _bfloat16_bits_to_float, float_to_bfloat16_bits

    return _bfloat16_bits_to_float(float_to_bfloat16_bits(np.array([np.float32(x)])))[0]


_FINFO = {"f32": (float(np.finfo(np.float32).min), float(np.finfo(np.float32).max)),
          "f64": (float(np.finfo(np.float64).min), float(np.finfo(np.float64).max)),
          "f16": (-65504.0, 65504.0),
          "bf16": (-3.3895313892515355e38, 3.3895313892515355e38)}


def _uniform_params(tag: str, low: float, high: float, what: str) -> tuple:
    """torch's uniform_ checks and (range, from, to) as the kernel receives them."""
    low, high = float(low), float(high)
    lo, hi = _FINFO[tag]
    for name, v in (("from", low), ("to", high)):
        if not lo <= v <= hi:
            raise ValueError(f"{what}: {name}={v} is out of bounds for the dtype")
    if not low <= high:
        raise ValueError(f"{what} expects to return a [from, to) range, but found from={low} "
                         f"> to={high}")
    if not high - low <= hi:
        raise ValueError(f"{what} expects to-from <= the dtype's max, but found to={high} and "
                         f"from={low}")
    if tag == "f64":
        return (high - low, low, high)
    if tag == "f32":
        f, t = np.float32(low), np.float32(high)
        return (float(np.float32(t - f)), float(f), float(t))
    if tag == "f16":
        f, t = _to_half(low), _to_half(high)
        rng = np.float16(np.float32(t) - np.float32(f))  # Half - Half returns a Half
        return (float(rng), float(f), float(t))
    f, t = _to_bf16_float(low), _to_bf16_float(high)
    return (float(_to_bf16_float(float(np.float32(t) - np.float32(f)))), float(f), float(t))


def _normal_params(tag: str, mean: float, std: float, what: str) -> tuple:
    mean, std = float(mean), float(std)
    if not std >= 0.0:
        raise ValueError(f"{what} expects std >= 0.0, but found std {std}")
    if tag == "f64":
        return (std, mean)
    return (float(np.float32(std)), float(np.float32(mean)))


def _scalar_param(value: Any, name: str, what: str) -> float:
    if isinstance(value, _array.DeviceArray) or hasattr(value, "__cuda_array_interface__"):
        raise TypeError(f"{what}: {name} must be a Python number (tensor-valued parameters "
                        "are not supported)")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: {name} must be a real number, got {type(value).__name__}") from None


# --------------------------------------------------------------------------- sampling API
_RAND_PARAMS = {"f32": (1.0, 0.0, 1.0), "f64": (1.0, 0.0, 1.0), "f16": (1.0, 0.0, 1.0),
                "bf16": (1.0, 0.0, 1.0)}
_RANDN_PARAMS = {"f32": (1.0, 0.0), "f64": (1.0, 0.0), "f16": (1.0, 0.0), "bf16": (1.0, 0.0)}
_UNROLL = {"f32": 4, "f16": 4, "bf16": 4, "f64": 2}


def rand(*size: Any, dtype: Any = None, device: Any = None,
         generator: Generator | None = None) -> _array.DeviceArray:
    """Uniform samples in [0, 1): ``torch.rand(*size, dtype=, device="cuda")``.

    float32 (default), float64, float16 and bfloat16 follow torch's ``uniform_`` kernel
    (curand_uniform4, or curand_uniform2_double for float64), so with the same seed and
    offset the result equals torch's bit for bit on the same GPU model.
    """
    arr, tag = _float_out(size, dtype, device, "rand()")
    _generate(arr, _kernel("uniform_" + tag), _UNROLL[tag], _RAND_PARAMS[tag], generator,
              arr._stream)
    return arr


def randn(*size: Any, dtype: Any = None, device: Any = None,
          generator: Generator | None = None) -> _array.DeviceArray:
    """Standard normal samples: ``torch.randn(*size, dtype=, device="cuda")``.

    torch's ``normal_`` kernel: curand's Box-Muller (``curand_normal4``; float64:
    ``curand_normal2_double``), bit-exact with torch on the same GPU model. The simulator
    computes log/sin/cos with numpy: its normals match the GPU's to a few ulps only.
    """
    arr, tag = _float_out(size, dtype, device, "randn()")
    _generate(arr, _kernel("normal_" + tag), _UNROLL[tag], _RANDN_PARAMS[tag], generator,
              arr._stream)
    return arr


def normal(mean: float = 0.0, std: float = 1.0, size: Any = None, *, dtype: Any = None,
           device: Any = None, generator: Generator | None = None) -> _array.DeviceArray:
    """Normal samples with scalar ``mean`` and ``std``: ``torch.normal(mean, std, size)``
    (same kernel as :func:`randn`, ``value * std + mean`` in float32 for the 2-byte types and
    float32, float64 for float64). Tensor-valued mean/std are not supported."""
    mean = _scalar_param(mean, "mean", "normal()")
    std = _scalar_param(std, "std", "normal()")
    if size is None:
        raise TypeError("normal(): a size is required with scalar mean and std")
    shape = size
    dt = _array._normalize_dtype(dtype, _F32)
    tag = _float_tag(dt, "normal()")
    params = _normal_params(tag, mean, std, "normal()")
    arr = _array.DeviceArray(shape, dt, device)
    _generate(arr, _kernel("normal_" + tag), _UNROLL[tag], params, generator)
    return arr


def uniform_(array: Any, from_: float = 0.0, to: float = 1.0, *,
             generator: Generator | None = None) -> Any:
    """Fill ``array`` with uniform samples in [from_, to) (``Tensor.uniform_``), in place on
    the current stream; returns ``array``. Floating dtypes; bit-exact with torch."""
    target = _as_target(array, "uniform_()")
    tag = _float_tag(target._dtype, "uniform_()")
    params = _uniform_params(tag, _scalar_param(from_, "from", "uniform_()"),
                             _scalar_param(to, "to", "uniform_()"), "uniform_()")
    _generate(target, _kernel("uniform_" + tag), _UNROLL[tag], params, generator)
    return array


def normal_(array: Any, mean: float = 0.0, std: float = 1.0, *,
            generator: Generator | None = None) -> Any:
    """Fill ``array`` with normal samples (``Tensor.normal_``) in place; returns ``array``."""
    target = _as_target(array, "normal_()")
    tag = _float_tag(target._dtype, "normal_()")
    params = _normal_params(tag, _scalar_param(mean, "mean", "normal_()"),
                            _scalar_param(std, "std", "normal_()"), "normal_()")
    _generate(target, _kernel("normal_" + tag), _UNROLL[tag], params, generator)
    return array


_BERNOULLI_ONE = {"float32": ("u32", 0x3F800000), "float16": ("u16", 0x3C00),
                  "bfloat16": ("u16", 0x3F80), "bool": ("u8", 1)}


def bernoulli_(array: Any, p: float = 0.5, *, generator: Generator | None = None) -> Any:
    """Set each element to 1 with probability ``p``, else 0 (``Tensor.bernoulli_(p)`` with a
    float ``p``), in place; returns ``array``. Any real, integer or bool dtype; the same
    kernel and offsets as torch (uniform float < p; float64 uses double uniforms).
    Tensor-valued ``p`` is not supported."""
    target = _as_target(array, "bernoulli_()")
    p = _scalar_param(p, "p", "bernoulli_()")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    dt = target._dtype
    if dt == np.float64:
        suffix, one, params = "bernoulli_f64", 0x3FF0000000000000, (p,)
        unroll = 2
    else:
        entry = _BERNOULLI_ONE.get(dt.name)
        if entry is None:
            if dt not in _INT_DTYPES:
                raise TypeError(f"bernoulli_(): unsupported dtype {dt}")
            entry = (f"u{8 * dt.itemsize}", 1)
        suffix, one = "bernoulli_" + entry[0], entry[1]
        params = (float(np.float32(p)),)
        unroll = 4
    _generate(target, _kernel(suffix), unroll, params + (one,), generator)
    return array


def randint(low: int, high: int | None = None, size: Any = None, *, dtype: Any = np.int64,
            device: Any = None, generator: Generator | None = None) -> _array.DeviceArray:
    """Integers uniform in [low, high): ``torch.randint(low, high, size)`` (or
    ``randint(high, size)``). Integer dtypes (default int64). torch's ``random_(from, to)``
    kernel: ``bits % range + low`` with 32-bit draws when ``range < 2**28``, else 64-bit draws
    (two per Philox block), so the values equal torch's bit for bit."""
    if size is None:
        if high is None:
            raise TypeError("randint(): a size is required: randint(high, size) or "
                            "randint(low, high, size)")
        low, high, size = 0, low, high
    elif high is None:  # randint(high, size=...)
        low, high = 0, low
    try:
        lo, hi = operator.index(low), operator.index(high)
    except TypeError:
        raise TypeError("randint(): low and high must be integers") from None
    shape = size
    dt = _array._normalize_dtype(dtype, np.dtype(np.int64))
    if dt not in _INT_DTYPES:
        raise TypeError(f"randint(): dtype must be an integer type, got {dt}")
    for name, v in (("low", lo), ("high", hi)):
        if not -(1 << 63) <= v <= (1 << 63) - 1:
            raise ValueError(f"randint(): {name}={v} does not fit in int64")
    if not lo < hi:
        raise ValueError(f"random_ expects 'from' to be less than 'to', but got from={lo} >= "
                         f"to={hi}")
    if dt == np.uint64:
        tmin, tmax = 0, (1 << 63) - 1
    else:
        info = np.iinfo(dt)
        tmin, tmax = int(info.min), int(info.max)
    if not tmin <= lo <= tmax:
        raise ValueError(f"randint(): from={lo} is out of bounds for {dt}")
    if not tmin <= hi - 1 <= tmax:
        raise ValueError(f"randint(): to - 1={hi - 1} is out of bounds for {dt}")
    rng = (hi - lo) & _MASK64
    width = 8 * dt.itemsize
    if rng >= 1 << 28:
        suffix, unroll = f"randint64_u{width}", 2
    else:
        suffix, unroll = f"randint32_u{width}", 4
    arr = _array.DeviceArray(shape, dt, device)
    _generate(arr, _kernel(suffix), unroll, (rng, lo & _MASK64), generator)
    return arr
