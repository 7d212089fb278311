"""The Philox generator state: seeds, offsets, RNG-state bytes and the CUDA-graph protocol.

A :class:`PhiloxState` is what a :class:`~cudalab.random.Generator` holds (torch's
``CUDAGeneratorState``): a 64-bit seed, a 64-bit Philox offset (per thread, a multiple of 4)
and the graph-capture bookkeeping. This module also parses and checks seeds, offsets and the
16-byte state format of :func:`~cudalab.random.get_rng_state` / ``set_rng_state``, so every
entry point rejects the same bad values with the same :class:`RandomStateError`.

Every state and the pending-call queue of :mod:`cudalab.random.generator` are guarded by the
one lock :data:`state_lock`.
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from typing import Any

import numpy as np

from cudalab import array as _array
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab.random.launch import launch_kernel

__all__ = ["DEFAULT_SEED", "PhiloxState", "RandomStateError"]

#: The seed of a new ``Generator`` (torch's ``default_rng_seed_val``); default generators are
#: seeded non-deterministically instead.
DEFAULT_SEED = 67280421310721
MASK64 = (1 << 64) - 1

state_lock = threading.Lock()  # guards every PhiloxState and generator.py's pending-call queue


class RandomStateError(ValueError, RuntimeError):
    """An invalid seed, RNG state or offset (nothing was changed)."""


def nondeterministic_seed() -> int:
    """53 random bits, like torch's ``getNonDeterministicRandom(is_cuda=true)``."""
    return int.from_bytes(os.urandom(8), "little") & ((1 << 53) - 1)


def as_seed(seed: Any, what: str) -> int:
    if isinstance(seed, bool):
        seed = int(seed)
    try:
        s = operator.index(seed)
    except TypeError:
        raise TypeError(f"{what}: the seed must be an integer, got {type(seed).__name__}") from None
    if not -(1 << 63) <= s <= MASK64:
        raise RandomStateError(f"{what}: seed {s} is out of range; seeds are 64-bit: "
                               "[-2**63, 2**64 - 1] (negative seeds wrap)")
    return s & MASK64


def as_offset(offset: Any, what: str) -> int:
    try:
        o = operator.index(offset)
    except TypeError:
        raise TypeError(f"{what}: the offset must be an integer, got "
                        f"{type(offset).__name__}") from None
    if not 0 <= o <= MASK64:
        raise RandomStateError(f"{what}: offset {o} is out of range [0, 2**64 - 1]")
    if o % 4:
        raise RandomStateError(f"{what}: offset must be a multiple of 4, got {o}")
    return o


def parse_state(new_state: Any, what: str) -> tuple[int, int]:
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


def state_bytes(seed: int, offset: int) -> np.ndarray:
    return np.frombuffer(seed.to_bytes(8, "little") + offset.to_bytes(8, "little"),
                         dtype=np.uint8).copy()


# --------------------------------------------------------------------------- graph capture
#: The PhiloxStates between capture_prologue and capture_epilogue (guarded by ``state_lock``).
#: Mutated in place, never rebound: sampling.py binds it at import and tests its truth on
#: every generation (one global read while nothing captures: benchmarks/rng.py rand(1000)).
capturing_states: set[PhiloxState] = set()


def stream_capturing(stream: _streams.Stream) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph (only asked while some
    generator captures)."""
    return _streams.is_capturing(stream)


def assert_not_capturing(what: str, device: int) -> None:
    """torch's ``assertNotCapturing``: only checked while some generator is capturing."""
    if capturing_states and _devices.is_initialized():
        if stream_capturing(_streams.current_stream(device)):
            raise RuntimeError(f"{what} is not allowed while the current stream is being "
                               "captured into a CUDA graph")


def capturing_now(device: int) -> bool:
    """Whether the current stream of ``device`` is being captured (checked only while some
    generator is capturing: no driver call otherwise)."""
    return bool(capturing_states) and _devices.is_initialized() and \
        stream_capturing(_streams.current_stream(device))


def _set_graph_words(state: PhiloxState, seed: int, offset: int, stream: Any) -> None:
    from cudalab._kernels.philox import SET_STATE

    if stream is None:
        stream = _streams.current_stream(state.device)
    launch_kernel(SET_STATE, state.device, stream, (1, 1, 1), (1, 1, 1),
                  (state.graph_buffer.ptr, seed, offset))


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

    __slots__ = ("device", "seed", "offset", "capturing", "offset_intragraph", "graph_buffer",
                 "_graphs")

    def __init__(self, device: int, seed: int, offset: int = 0):
        self.device = device
        self.seed = seed
        self.offset = offset
        self.capturing = False
        self.offset_intragraph = 0
        self.graph_buffer: Any = None  # DeviceArray of 2 uint64: seed, base offset
        self._graphs: dict[int, Any] = {}  # id(graph) -> a weak reference to it

    def __repr__(self) -> str:
        cap = f", capturing (+{self.offset_intragraph})" if self.capturing else ""
        return f"<PhiloxState cuda:{self.device} seed={self.seed} offset={self.offset}{cap}>"

    def clone(self) -> PhiloxState:
        with state_lock:
            other = PhiloxState(self.device, self.seed, self.offset)
            other.offset_intragraph = self.offset_intragraph
        return other

    # ----------------------------------------------------------------- graph protocol
    def register_graph(self, graph: Any) -> None:
        """Tie this state to ``graph`` (allocates the device words on first registration)."""
        assert_not_capturing("PhiloxState.register_graph()", self.device)
        if self.graph_buffer is None:
            self.graph_buffer = _array.zeros((2,), np.uint64, device=self.device)
        try:  # weakly: the graph holds this state, and its reset()/finalizer unregisters it
            self._graphs[id(graph)] = weakref.ref(graph)
        except TypeError:  # an object without weak references
            self._graphs[id(graph)] = graph

    def unregister_graph(self, graph: Any) -> None:
        """Forget ``graph``; the device words are released with the last graph."""
        if self._graphs.pop(id(graph), None) is None:
            raise RuntimeError("PhiloxState.unregister_graph(): the graph is not registered")
        if not self._graphs:
            self.graph_buffer = None

    def capture_prologue(self, stream: Any = None) -> None:
        """Before capture: device words := (seed, 0); offsets now count inside the graph."""
        if self.graph_buffer is None:
            raise RuntimeError("PhiloxState.capture_prologue(): call register_graph() first")
        _set_graph_words(self, self.seed, 0, stream)
        with state_lock:
            if not self.capturing:
                self.capturing = True
                capturing_states.add(self)
            self.offset_intragraph = 0

    def capture_epilogue(self) -> int:
        """After capture: the whole-graph offset increment (what each replay consumes)."""
        with state_lock:
            if self.capturing:
                self.capturing = False
                capturing_states.discard(self)
            return self.offset_intragraph

    def replay_prologue(self, wholegraph_increment: int, stream: Any = None) -> None:
        """Before a replay, on the replay stream: device words := (seed, offset), then the
        offset advances by the (4-rounded) whole-graph increment."""
        assert_not_capturing("PhiloxState.replay_prologue()", self.device)
        if self.graph_buffer is None:
            raise RuntimeError("PhiloxState.replay_prologue(): no graph is registered")
        inc = operator.index(wholegraph_increment)
        if inc < 0:
            raise ValueError(f"wholegraph_increment must be >= 0, got {inc}")
        with state_lock:
            seed, offset = self.seed, self.offset
            self.offset = (offset + ((inc + 3) // 4) * 4) & MASK64
        _set_graph_words(self, seed, offset, stream)
