"""The :class:`Generator` class, the per-device default generators and the state API.

torch's names and semantics: :func:`manual_seed`, :func:`manual_seed_all`, :func:`seed`,
:func:`seed_all`, :func:`set_rng_state` and :func:`set_rng_state_all` never initialise CUDA:
before cudalab is initialised they are queued (torch's ``_lazy_call``) and applied at the first
use of a generator afterwards; with no GPU they are ignored. :func:`get_rng_state` returns 16
bytes (little-endian uint64 seed, int64 offset). A generator's :attr:`Generator.graph_state`
(a :class:`~cudalab.random.state.PhiloxState`) implements the CUDA-graph protocol of
docs/random.md.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from cudalab import _internal
from cudalab import devices as _devices
from cudalab._units import echo
from cudalab.random.state import (
    DEFAULT_SEED,
    PhiloxState,
    as_offset,
    as_seed,
    assert_not_capturing,
    capturing_now,
    nondeterministic_seed,
    parse_state,
    state_bytes,
    state_lock,
)

__all__ = [
    "Generator",
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
    "all_default_generators",
]


class Generator:
    """A Philox4x32-10 generator on one device (``torch.Generator(device="cuda")``).

    A new generator has torch's fixed default seed 67280421310721 and offset 0; pass it as
    ``generator=`` to the sampling functions for a stream of numbers independent of the
    default generator. Creating one does not create a CUDA context.

    Two plain attributes, read-only to their readers, serve sampling's hot path without a
    call: :attr:`device_index` (the device, set once) and :attr:`philox_state` (the
    :class:`PhiloxState` it advances, the same object as :attr:`graph_state`).
    """

    __slots__ = ("device_index", "philox_state", "__weakref__")

    def __init__(self, device: Any = "cuda"):
        self.device_index = _internal.device_index(device)
        self.philox_state = PhiloxState(self.device_index, DEFAULT_SEED)

    @classmethod
    def _wrap(cls, device: int, state: PhiloxState) -> Generator:
        g = object.__new__(cls)
        g.device_index = device
        g.philox_state = state
        return g

    def __repr__(self) -> str:
        return f"<cudalab.Generator cuda:{self.device_index}>"

    @property
    def device(self) -> _devices.Device:
        """The generator's device (``Device('cuda:N')``)."""
        return _devices.Device("cuda", self.device_index)

    @property
    def graph_state(self) -> PhiloxState:
        """The state object (seed, offset, CUDA-graph protocol) this generator uses now."""
        return self.philox_state

    def manual_seed(self, seed: int) -> Generator:
        """Seed with ``seed`` (64-bit; negative values wrap) and reset the offset to 0.

        During a capture (torch's ``CUDAGeneratorImpl::set_current_seed``): the seed the
        generator already has changes nothing (the offset is kept); another one raises
        RuntimeError.
        """
        s = as_seed(seed, "Generator.manual_seed()")
        if capturing_now(self.device_index):
            if s != self.philox_state.seed:
                raise RuntimeError("CUDAGeneratorImpl::set_current_seed can be called during "
                                   "stream capture only if new seed is the same as the "
                                   "original seed.")
            return self
        with state_lock:
            self.philox_state.seed = s
            self.philox_state.offset = 0
        return self

    def seed(self) -> int:
        """Seed non-deterministically (53 random bits); returns the seed."""
        s = nondeterministic_seed()
        self.manual_seed(s)
        return s

    def initial_seed(self) -> int:
        """The seed the generator was last seeded with."""
        return self.philox_state.seed

    def get_state(self) -> np.ndarray:
        """16 bytes: little-endian uint64 seed, int64 offset (a new numpy uint8 array)."""
        assert_not_capturing("Generator.get_state()", self.device_index)
        with state_lock:
            seed, offset = self.philox_state.seed, self.philox_state.offset
        return state_bytes(seed, offset)

    def set_state(self, new_state: Any) -> Generator:
        """Restore a state from :meth:`get_state` (or the 8-byte seed-only form). A bad state
        raises :class:`RandomStateError` or TypeError and leaves the generator unchanged."""
        seed, offset = parse_state(new_state, "Generator.set_state()")
        self._set(seed, offset)
        return self

    def _set(self, seed: int, offset: int) -> None:
        assert_not_capturing("Generator.set_state()", self.device_index)
        with state_lock:
            self.philox_state.seed = seed
            self.philox_state.offset = offset

    def get_offset(self) -> int:
        """The Philox offset (per thread; advances by 4 * iterations per kernel)."""
        assert_not_capturing("Generator.get_offset()", self.device_index)
        return self.philox_state.offset

    def set_offset(self, offset: int) -> Generator:
        """Set the Philox offset (a multiple of 4)."""
        o = as_offset(offset, "Generator.set_offset()")
        assert_not_capturing("Generator.set_offset()", self.device_index)
        with state_lock:
            self.philox_state.offset = o
        return self

    def clone_state(self) -> Generator:
        """A new generator on the same device with a copy of this one's state."""
        return Generator._wrap(self.device_index, self.philox_state.clone())

    def graphsafe_get_state(self) -> Generator:
        """A generator sharing this one's state object (for CUDA graphs, like torch)."""
        return Generator._wrap(self.device_index, self.philox_state)

    def graphsafe_set_state(self, other: Generator) -> Generator:
        """Use ``other``'s state object from now on (shared, not copied)."""
        if not isinstance(other, Generator):
            raise TypeError(f"graphsafe_set_state expects a cudalab.Generator, got "
                            f"{type(other).__name__}")
        if other.device_index != self.device_index:
            raise ValueError(f"graphsafe_set_state: the state belongs to cuda:{other.device_index}, "
                             f"this generator to cuda:{self.device_index}")
        self.philox_state = other.philox_state
        return self


# --------------------------------------------------------------------------- defaults
# The three lists below are guarded by state.state_lock and mutated in place, never rebound:
# sampling.py binds them at import for its fast path (benchmarks/rng.py, rand(1000)): they
# are this module's friend interface to sampling.py (no underscore, not in __all__).
#: Default generator of each device (None until first used); grows to device_count().
default_generator_slots: list[Generator | None] = []
queued_calls: list[Callable[[], object]] = []          # set_rng_state, seed, seed_all (in order)
seed_calls: list[Callable[[], object] | None] = []  # latest manual_seed / manual_seed_all


def default_generator(idx: int) -> Generator:
    """Device ``idx``'s default generator (CUDA initialised; index valid)."""
    if queued_calls or seed_calls:
        _run_queued()
    gens = default_generator_slots
    if idx < len(gens):
        g = gens[idx]
        if g is not None:
            return g
    with state_lock:
        n = _devices.device_count()
        if len(default_generator_slots) < n:
            default_generator_slots.extend([None] * (n - len(default_generator_slots)))
        g = default_generator_slots[idx]
        if g is None:
            g = Generator._wrap(idx, PhiloxState(idx, nondeterministic_seed()))
            default_generator_slots[idx] = g
    return g


def _run_queued() -> None:
    """Apply the state calls made before CUDA was initialised (torch's ``_lazy_call`` order:
    queued calls first, then the latest manual_seed / manual_seed_all)."""
    global _seed_cb, _seed_all_cb
    if not _devices.is_initialized():
        return
    with state_lock:
        calls = list(queued_calls) + [c for c in seed_calls if c is not None]
        queued_calls.clear()
        seed_calls.clear()
        _seed_cb = _seed_all_cb = None
    for call in calls:
        call()


def _lazy_call(call: Callable[[], object], kind: str | None = None) -> None:
    """Run ``call`` now if CUDA is initialised, else queue it (torch's ``_lazy_call``: only
    the latest manual_seed and manual_seed_all are kept, and they run last)."""
    global _seed_cb, _seed_all_cb
    if _devices.is_initialized():
        if queued_calls or seed_calls:
            _run_queued()
        call()
        return
    with state_lock:
        if kind is None:
            queued_calls.append(call)
            return
        if kind == "seed":
            _seed_cb = call
            order = [_seed_all_cb, _seed_cb]
        else:
            _seed_all_cb = call
            order = [_seed_cb, _seed_all_cb]
        seed_calls[:] = order


_seed_cb: Callable[[], object] | None = None
_seed_all_cb: Callable[[], object] | None = None


def _pending_device(device: Any) -> int:
    """The device index a queued call applies to, without initialising CUDA."""
    if device is None:
        return _internal.thread_state().device
    if isinstance(device, bool):
        raise TypeError(f"expected a device index, got {device!r}")
    idx: int | None
    if isinstance(device, int):
        idx = device
    elif isinstance(device, (str, _devices.Device)):
        idx = _devices.Device(device).index
        if idx is None:
            return _internal.thread_state().device
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
        return _internal.device_index(device)
    idx = _pending_device(device)
    n = _devices.device_count()  # no CUDA context: NVML and CUDA_VISIBLE_DEVICES
    if n == 0:
        return None
    if idx >= n:
        raise ValueError(f"Invalid device index {idx}: cudalab sees {n} CUDA device(s)")
    return idx


def _int_seed(seed: Any, what: str) -> int:
    """``int(seed)``, as torch's ``manual_seed`` converts it (so ``1.0`` and ``"7"`` are seeds),
    with an error that names ``seed`` when the conversion fails.

    Raises
    ------
    TypeError
        ``seed`` has no integer value (None, a list, ...).
    ValueError
        ``seed`` is a str that is not an integer, or a NaN or infinite float.
    """
    try:
        return int(seed)
    except TypeError:
        raise TypeError(f"{what}: seed must be an integer (or convertible with int()), got "
                        f"{type(seed).__name__} {echo(seed)}") from None
    except (ValueError, OverflowError):
        raise ValueError(f"{what}: seed must be an integer (or convertible with int()), got "
                         f"{echo(seed)}") from None


def manual_seed(seed: int) -> None:
    """Seed the current device's default generator (offset 0). Safe without a GPU: ignored.

    Parameters
    ----------
    seed : int
        The seed (converted with ``int()``, as torch does; 64-bit, negative values wrap).

    Raises
    ------
    TypeError, ValueError
        ``seed`` is not an integer and ``int(seed)`` fails (the message names ``seed``).
    RandomStateError
        ``seed`` is outside [-2**63, 2**64 - 1].
    """
    s = as_seed(_int_seed(seed, "manual_seed()"), "manual_seed()")
    idx = _target_device(None)
    if idx is None:
        return
    _lazy_call(lambda: default_generator(idx).manual_seed(s), "seed")


def manual_seed_all(seed: int) -> None:
    """Seed every device's default generator. Safe without a GPU: ignored.

    Parameters
    ----------
    seed : int
        The seed (converted with ``int()``, as torch does).

    Raises
    ------
    TypeError, ValueError
        ``int(seed)`` fails (the message names ``seed``).
    RandomStateError
        ``seed`` is outside [-2**63, 2**64 - 1].
    """
    s = as_seed(_int_seed(seed, "manual_seed_all()"), "manual_seed_all()")

    def call() -> None:
        for i in range(_devices.device_count()):
            default_generator(i).manual_seed(s)

    _lazy_call(call, "seed_all")


def seed() -> None:
    """Seed the current device's default generator non-deterministically."""
    idx = _target_device(None)
    if idx is None:
        return
    _lazy_call(lambda: default_generator(idx).seed())


def seed_all() -> None:
    """Seed every device with one non-deterministic seed."""

    def call() -> None:
        s = None
        for i in range(_devices.device_count()):
            g = default_generator(i)
            if s is None:
                s = g.seed()
            else:
                g.manual_seed(s)

    _lazy_call(call)


def initial_seed() -> int:
    """The current device's default seed (initialises CUDA, without a context)."""
    return default_generator(_devices.current_device()).initial_seed()


def get_rng_state(device: Any = None) -> np.ndarray:
    """The default generator's state of ``device`` (default: current) as 16 uint8 values:
    little-endian uint64 seed then int64 offset. Initialises CUDA (no context)."""
    return default_generator(_internal.device_index(device)).get_state()


def get_rng_state_all() -> list[np.ndarray]:
    """:func:`get_rng_state` of every device."""
    return [get_rng_state(i) for i in range(_devices.device_count())]


def set_rng_state(new_state: Any, device: Any = None) -> None:
    """Restore the default generator of ``device`` (default: current) from a 16-byte (or 8-byte
    seed-only) uint8 state. Bad states raise :class:`RandomStateError`/TypeError and change
    nothing. Before CUDA is initialised the call is queued; without a GPU it is ignored."""
    seed_, offset = parse_state(new_state, "set_rng_state()")
    idx = _target_device(device)
    if idx is None:
        return
    _lazy_call(lambda: default_generator(idx)._set(seed_, offset))


def set_rng_state_all(new_states: Iterable[Any]) -> None:
    """:func:`set_rng_state` for devices 0, 1, ...; every state is checked before any is set."""
    parsed = [parse_state(s, f"set_rng_state_all() state {i}")
              for i, s in enumerate(new_states)]
    targets = [_target_device(i) for i in range(len(parsed))]
    for idx, (seed_, offset) in zip(targets, parsed):
        if idx is not None:
            def call(idx: int = idx, s: int = seed_, o: int = offset) -> None:
                default_generator(idx)._set(s, o)

            _lazy_call(call)


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
        idxs = [_internal.device_index(d) for d in devices]
    states = [(i, get_rng_state(i)) for i in idxs]
    try:
        yield
    finally:
        for i, st in states:
            set_rng_state(st, i)


def all_default_generators() -> tuple[Generator, ...]:
    """Every device's default generator (``torch.cuda.default_generators``); () without a GPU.

    ``cudalab.random.default_generators`` is this tuple (a module attribute computed on
    access); it initialises CUDA when there is a GPU.
    """
    n = _devices.device_count()
    if n == 0:
        return ()
    _devices.init()
    return tuple(default_generator(i) for i in range(n))
