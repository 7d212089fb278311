"""The kernel facility: CUDA C++ source -> CUBIN (NVRTC, cached) -> launch on a stream.

Owns :class:`Kernel`, the CUBIN caches (memory and disk), the argument checks, the launch
path and the launch-blocking switch. :mod:`cudalab.kernels` is its public face (it re-exports
the public names); the runtime's own kernels (``cudalab._kernels.fill``, ``spin``, ``philox``)
import :class:`Kernel` from here, so the facility never depends on the kernels it launches.

* CUBINs are compiled once per device architecture and cached in memory and on disk, keyed by
  the sha256 of (source, options, arch, NVRTC version). The disk cache lives in
  ``$CUDALAB_CACHE_DIR`` (the directory itself), else ``$XDG_CACHE_HOME/cudalab/kernels``,
  else ``~/.cache/cudalab/kernels``. Files are written atomically; a damaged file is ignored
  and rewritten; an unwritable directory leaves the cache memory-only (one warning).
* On the simulator backend a launch compiles nothing (NVRTC may be absent): the kernel's numpy
  ``sim`` implementation is registered with the simulator under the kernel's name.
  :func:`check_compiles` compiles one there anyway (the jiterator's check that user code
  compiles as on a GPU).
* Each (kernel, device, thread) keeps one pre-packed argument list, so a launch is: check
  and convert the arguments, then ``Backend.launch_values`` (``KernelArgs.set`` and
  ``Backend.launch``; one C call on the real backend).
* ``CUDA_LAUNCH_BLOCKING=1`` (read when this module is imported) or
  :func:`set_launch_blocking` synchronises the stream after every launch.
"""

from __future__ import annotations

import hashlib
import operator
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cudalab._atomic_write import write_bytes_atomic
from cudalab._driver import nvrtc as _nvrtc
from cudalab._driver.base import ClosedHandle

if TYPE_CHECKING:
    from cudalab._driver.base import Backend

__all__ = [
    "Kernel",
    "registered_kernels",
    "unregister_kernel",
    "launch_config_1d",
    "register_pointer_type",
    "set_launch_blocking",
    "is_launch_blocking",
    "cache_dir",
    "cache_key",
    "get_cubin",
    "check_compiles",
    "KernelCacheWarning",
]

# --------------------------------------------------------------------------- launch blocking
_TRUE = {"1", "true", "yes", "on"}
launch_blocking = os.environ.get("CUDA_LAUNCH_BLOCKING", "").strip().lower() in _TRUE


def set_launch_blocking(enabled: bool) -> None:
    """Synchronise the stream after every kernel launch (like ``CUDA_LAUNCH_BLOCKING=1``)."""
    global launch_blocking
    launch_blocking = bool(enabled)


def is_launch_blocking() -> bool:
    """Whether launches currently synchronise their stream."""
    return launch_blocking


#: Callables ``observer(kernel_name, device, stream, grid, block)`` run after each launch
#: (grid and block as 3-tuples, ``stream`` the cudalab Stream). Empty: no cost. The list
#: object is owned by :mod:`cudalab._internal` (mutated in place, never rebound), so binding
#: it here keeps the launch path at one global read.
from cudalab import _internal, _observe  # noqa: E402
from cudalab._internal import launch_observers as _launch_observers  # noqa: E402

# --------------------------------------------------------------------------- CUBIN cache
_CACHE_FORMAT = "cudalab-kernel-cache-1"
_ELF_MAGIC = b"\x7fELF"

_cache_lock = threading.Lock()
_memory_cache: dict[str, bytes] = {}
_unwritable_dirs: set[str] = set()  # directories already warned about


class KernelCacheWarning(UserWarning):
    """The on-disk kernel cache cannot be used; kernels are compiled into memory only."""


def cache_dir() -> Path:
    """The on-disk CUBIN cache directory (read from the environment on every call)."""
    env = os.environ.get("CUDALAB_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "cudalab" / "kernels"


def cache_key(source: str, options: Sequence[str], arch: str, nvrtc_version: tuple[int, int]) -> str:
    """sha256 hex digest identifying one compilation."""
    h = hashlib.sha256()
    parts = (_CACHE_FORMAT, source, *options, "\x00", arch, f"{nvrtc_version[0]}.{nvrtc_version[1]}")
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _valid_cubin(data: bytes) -> bool:
    """An ELF64 image whose section header table lies inside the data (catches truncation)."""
    if len(data) < 64 or data[:4] != _ELF_MAGIC or data[4] != 2:
        return False
    shoff = int.from_bytes(data[0x28:0x30], "little")
    shentsize = int.from_bytes(data[0x3A:0x3C], "little")
    shnum = int.from_bytes(data[0x3C:0x3E], "little")
    return shoff + shentsize * shnum <= len(data)


def _read_cached(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if _valid_cubin(data) else None


def _write_cached(directory: Path, path: Path, data: bytes) -> None:
    key = str(directory)
    if key in _unwritable_dirs:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, data)  # (a temporary file beside it, then os.replace)
    except OSError as exc:
        with _cache_lock:
            first = key not in _unwritable_dirs
            _unwritable_dirs.add(key)
        if first:
            warnings.warn(
                f"cudalab: cannot write the kernel cache in {directory} ({exc}); compiled "
                "kernels are kept in memory only (set CUDALAB_CACHE_DIR to a writable "
                "directory to keep them across runs)",
                KernelCacheWarning,
                stacklevel=4,
            )


def get_cubin(source: str, name: str, arch: str, options: Sequence[str] = ()) -> bytes:
    """CUBIN for ``source`` on ``arch``: from memory, else from disk, else compiled (and stored)."""
    options = tuple(options)
    key = cache_key(source, options, arch, _nvrtc.version())
    cubin = _memory_cache.get(key)
    if cubin is not None:
        return cubin
    directory = cache_dir()
    path = directory / f"{key}.cubin"
    cubin = _read_cached(path)
    if cubin is None:
        cubin = _nvrtc.compile_cubin(source, name, arch, options)
        _write_cached(directory, path, cubin)
    _memory_cache[key] = cubin
    return cubin


def check_compiles(kernel: Kernel, device: int) -> bool:
    """Compile ``kernel`` with NVRTC for ``device``'s architecture when NVRTC is installed
    (the simulator's check that code compiles as on a GPU; nothing is loaded).

    Returns
    -------
    bool
        True when it compiled (or came from the caches), False when NVRTC is not installed.

    Raises
    ------
    cudalab.KernelCompileError
        The source does not compile (NVRTC's log).
    """
    if not _nvrtc.available():
        return False
    from cudalab import devices

    props = devices.get_device_properties(device)
    kernel.cubin(f"sm_{props.major}{props.minor}")
    return True


def _reset_caches_for_tests() -> None:
    """Forget the in-memory CUBINs and the directories warned about."""
    with _cache_lock:
        _memory_cache.clear()
        _unwritable_dirs.clear()


# --------------------------------------------------------------------------- arguments
_SIGNATURE_TYPES = ("p", "i4", "u4", "i8", "u8", "f4", "f8")
_INT_RANGES = {
    "p": (0, 2**64 - 1),
    "i4": (-(2**31), 2**31 - 1),
    "u4": (0, 2**32 - 1),
    "i8": (-(2**63), 2**63 - 1),
    "u8": (0, 2**64 - 1),
}
_MAX_GRID = (2**31 - 1, 65535, 65535)
_MAX_BLOCK = (1024, 1024, 64)
_MAX_THREADS_PER_BLOCK = 1024


def _pointer_of(value: Any) -> int:
    """The device address held by a pointer argument."""
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is not None:
        ptr = cai["data"][0]
        return 0 if ptr is None else ptr
    data_ptr = getattr(value, "data_ptr", None)
    if callable(data_ptr):
        return data_ptr()
    ptr = getattr(value, "ptr", None)
    if ptr is not None and not callable(ptr):
        return ptr
    return operator.index(value)  # numpy integers and other int-likes


#: Array types whose device address the launch fast path reads itself: type -> getter
#: (``cudalab.DeviceArray`` registers its ``_ptr``; any other object goes through
#: ``Kernel._convert_args``, which reads ``__cuda_array_interface__``, ``data_ptr()`` or
#: ``ptr``). Exact types only, so a subclass that overrides its address is never misread.
_pointer_getters: dict[type, Callable[[Any], int]] = {}


def register_pointer_type(cls: type, address: Callable[[Any], int]) -> None:
    """Let :meth:`Kernel.launch` read the device address of ``cls`` objects with ``address``
    (a fast path: ``cudalab.array`` registers DeviceArray). The address must be the object's
    first byte on the device, as ``__cuda_array_interface__["data"][0]`` gives it."""
    _pointer_getters[cls] = address


_fast_converters: dict[tuple[str, ...], Callable[[Sequence[Any]], tuple | None]] = {}


def _fast_args_converter(signature: tuple[str, ...]) -> Callable[[Sequence[Any]], tuple | None]:
    """A function returning ``args`` as a tuple of plain in-range values, or None.

    It takes ints and floats as they are and the addresses of registered array types
    (:func:`register_pointer_type`). Generated per signature (like namedtuple's methods)
    because a generic loop costs about a microsecond per launch ("capture, host time per
    launch" of benchmarks/graphs.py); anything it returns None for goes through
    ``Kernel._convert_args``, which converts or raises the detailed error.
    """
    convert = _fast_converters.get(signature)
    if convert is not None:
        return convert
    n = len(signature)
    if n == 0:
        src = "def convert(args):\n    return () if len(args) == 0 else None\n"
    else:
        names = ", ".join(f"a{i}" for i in range(n)) + ","
        lines = [
            "def convert(args):",
            "    try:",
            f"        {names} = args",
            "    except (TypeError, ValueError):",
            "        return None",
        ]
        for i, kind in enumerate(signature):
            if kind in ("f4", "f8"):
                lines.append(f"    if type(a{i}) is not float:")
                lines.append("        return None")
                continue
            lo, hi = _INT_RANGES[kind]
            if kind == "p":
                lines += [
                    f"    if type(a{i}) is not int:",
                    f"        get = getters.get(type(a{i}))",
                    "        if get is None:",
                    "            return None",
                    f"        a{i} = get(a{i})",
                    f"    elif not {lo} <= a{i} <= {hi}:",
                    "        return None",
                ]
            else:
                lines.append(f"    if type(a{i}) is not int or not {lo} <= a{i} <= {hi}:")
                lines.append("        return None")
        lines.append(f"    return ({names})")
        src = "\n".join(lines) + "\n"
    namespace: dict[str, Any] = {"getters": _pointer_getters}
    exec(src, namespace)  # noqa: S102 - source built above from the fixed type table
    convert = _fast_converters[signature] = namespace["convert"]
    return convert


def _dims(value: Any, what: str, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    if type(value) is int:
        dims: tuple = (value, 1, 1)
    else:
        try:
            dims = tuple(value)
        except TypeError:
            raise TypeError(f"{what} must be an int or a tuple of 1 to 3 ints, got {value!r}") from None
        if not 1 <= len(dims) <= 3:
            raise ValueError(f"{what} must have 1 to 3 dimensions, got {value!r}")
        dims = dims + (1,) * (3 - len(dims))
    for d, limit in zip(dims, limits):
        if isinstance(d, bool) or not isinstance(d, int):
            try:
                d = operator.index(d)
            except TypeError:
                raise TypeError(f"{what} dimensions must be ints, got {value!r}") from None
        if not 1 <= d <= limit:
            raise ValueError(f"{what} dimensions must be in [1, {limit}], got {value!r}")
    return (int(dims[0]), int(dims[1]), int(dims[2]))


# --------------------------------------------------------------------------- Kernel
#: Kernels defined inside the cudalab package, by name (a Kernel made by a module whose
#: ``__name__`` is ``cudalab`` or ``cudalab.*`` registers itself). Invariant: one kernel per
#: name, and only cudalab's own; guarded by ``_registry_lock``.
_registry: dict[str, Kernel] = {}
_registry_lock = threading.Lock()


def registered_kernels() -> list[Kernel]:
    """The kernels cudalab's own modules have defined so far (a snapshot list)."""
    with _registry_lock:
        return list(_registry.values())


def unregister_kernel(kernel: Kernel) -> None:
    """Keep ``kernel`` out of :func:`registered_kernels` (benchmark variants, not shipped)."""
    with _registry_lock:
        if _registry.get(kernel.name) is kernel:
            del _registry[kernel.name]
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Kernel:
    """One ``extern "C" __global__`` function of a CUDA C++ source.

    Args:
        name: the kernel's (unmangled) function name in ``source``.
        source: CUDA C++ source text.
        signature: one type code per kernel parameter: "p" (pointer), "i4", "u4", "i8",
            "u8", "f4", "f8".
        options: extra NVRTC options (e.g. ``("--use_fast_math",)``); the architecture is
            chosen from the device.
        sim: numpy implementation for the simulator backend, called as
            ``sim(sim_backend, grid, block, shared_mem, *arg_values)``.
        access: what the kernel does with each pointer parameter, for the stream sanitizer
            (docs/sanitizer.md): one entry per signature entry, ``"r"`` (reads),
            ``"w"`` (writes), ``"rw"`` (both) or ``""`` (not memory it touches, and every
            non-pointer parameter). None (default): every pointer is taken as written.
            A pointer is taken to reach to the end of the allocation holding it.
    """

    def __init__(
        self,
        name: str,
        source: str,
        signature: Sequence[str],
        *,
        options: Sequence[str] = (),
        sim: Callable[..., Any] | None = None,
        access: Sequence[str] | None = None,
    ):
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"kernel name must be a C identifier, got {name!r}")
        if not isinstance(source, str):
            raise TypeError(f"kernel source must be str, got {type(source).__name__}")
        if isinstance(signature, str):
            raise TypeError("signature must be a tuple of type codes such as ('p', 'u4')")
        sig = tuple(signature)
        bad = [t for t in sig if t not in _SIGNATURE_TYPES]
        if bad:
            raise ValueError(f"unknown parameter types {bad} in signature {sig}; use {_SIGNATURE_TYPES}")
        if isinstance(options, str):
            raise TypeError("options must be a tuple of strings")
        opts = tuple(options)
        if not all(isinstance(o, str) for o in opts):
            raise TypeError(f"options must be strings, got {opts!r}")
        if sim is not None and not callable(sim):
            raise TypeError("sim must be callable")
        self.name = name
        self.source = source
        self.signature = sig
        self.options = opts
        self.sim = sim
        #: Indices of the pointer parameters the kernel reads / writes (the sanitizer's view;
        #: a parameter in both is in ``writes`` only, as torch's CSAN counts it).
        self.reads, self.writes = _access_indices(sig, access)
        #: (min, max) per integer/pointer parameter; None for the float ones (never read).
        self._ranges: tuple[tuple[int, int] | None, ...] = tuple(_INT_RANGES.get(t) for t in sig)
        self._fast_args = _fast_args_converter(sig)
        self._lock = threading.Lock()
        self._backend: Backend | None = None  # the backend the entries below belong to
        self._functions: dict[int, Any] = {}  # device -> function handle
        self._tls = threading.local()  # .state: device -> (backend, function, KernelArgs)
        self.module = sys._getframe(1).f_globals.get("__name__", "")
        if self.module == "cudalab" or self.module.startswith("cudalab."):
            with _registry_lock:
                other = _registry.get(name)
                if other is not None and other.module != self.module:
                    raise ValueError(f"cudalab kernel {name!r} is defined twice")
                _registry[name] = self

    def __repr__(self) -> str:
        return f"<cudalab.Kernel {self.name}({', '.join(self.signature)})>"

    # ----------------------------------------------------------------- compile and load
    def cubin(self, arch: str = "sm_90") -> bytes:
        """The CUBIN image for ``arch`` (compiled once, then from the caches).

        Raises
        ------
        TypeError
            ``arch`` is not a string such as ``"sm_90"``.
        """
        if not isinstance(arch, str):
            raise TypeError(f"Kernel.cubin: arch must be an architecture string such as "
                            f"'sm_90', got {arch!r}")
        return get_cubin(self.source, self.name, arch, self.options)

    def get_function(self, device: int, backend: Backend | None = None) -> Any:
        """The loaded function handle on ``device`` (compiling and loading on first use).

        Parameters
        ----------
        device
            A device index.
        backend
            The driver backend (default: the process's, initialising CUDA).

        Returns
        -------
        object
            The backend's opaque function handle.
        """
        if backend is None:
            backend = _internal.backend()
        if self._backend is backend:
            function = self._functions.get(device)
            if function is not None:
                return function
        with self._lock:
            if self._backend is not backend:
                self._backend = backend
                self._functions = {}
            function = self._functions.get(device)
            if function is None:
                function = self._load(backend, device)
                self._functions[device] = function
            return function

    def _load(self, backend: Backend, device: int) -> Any:
        from cudalab import devices

        _internal.ensure_context(device)
        if backend.simulated:
            if self.sim is None:
                raise RuntimeError(
                    f"kernel {self.name!r} has no simulator implementation (pass sim= to Kernel)"
                )
            from cudalab._driver.sim import register_kernel

            register_kernel(self.name, self.sim)
            image = self.source.encode()
        else:
            props = devices.get_device_properties(device)
            image = self.cubin(f"sm_{props.major}{props.minor}")
        module = backend.module_load(device, image)
        try:
            function = backend.module_function(module, self.name)
        except BaseException:
            backend.module_unload(module)
            raise
        return function

    def _thread_state(self, backend: Backend, device: int) -> tuple:
        function = self.get_function(device, backend)
        states = getattr(self._tls, "state", None)
        if states is None:
            states = self._tls.state = {}
        state = states[device] = (backend, function, backend.make_args(self.signature))
        return state

    # ----------------------------------------------------------------- arguments
    def _convert_args(self, args: Sequence[Any]) -> list[Any]:
        """Values ready for ``KernelArgs.set`` (pointers resolved), or a descriptive error."""
        if len(args) != len(self.signature):
            raise TypeError(
                f"kernel {self.name} takes {len(self.signature)} arguments "
                f"{self.signature}, got {len(args)}"
            )
        return [self._convert_one(i, v) for i, v in enumerate(args)]

    def _convert_one(self, i: int, v: Any) -> Any:
        kind = self.signature[i]
        what = f"kernel {self.name} argument {i} ({kind})"
        if kind in ("f4", "f8"):
            if isinstance(v, Real) and not isinstance(v, bool):
                return float(v)
            raise TypeError(f"{what} must be a real number, got {type(v).__name__}")
        if kind == "p" and isinstance(v, bool):
            raise TypeError(f"{what} must be a device address, got bool")
        try:
            value = _pointer_of(v) if kind == "p" else operator.index(v)
        except TypeError:
            if kind == "p":
                raise TypeError(
                    f"{what} must be a device address: an int, an object with "
                    f"__cuda_array_interface__, .data_ptr() or .ptr; got {type(v).__name__}"
                ) from None
            raise TypeError(f"{what} must be an int, got {type(v).__name__}") from None
        bounds = self._ranges[i]
        assert bounds is not None  # integer and pointer kinds all have a range
        lo, hi = bounds
        if not lo <= value <= hi:
            raise OverflowError(f"{what} = {value} is out of range [{lo}, {hi}]")
        return int(value)

    # ----------------------------------------------------------------- launch
    def launch(
        self,
        grid: Any,
        block: Any,
        args: Sequence[Any],
        *,
        stream: Any = None,
        shared_mem: int = 0,
    ) -> None:
        """Launch on ``stream`` (default: the current stream of the current device).

        ``grid`` and ``block`` are ints or tuples of up to 3 ints; ``args`` holds one value
        per signature entry (pointers as ints, or objects exposing a device address).
        """
        if _Stream is None:
            _bind_runtime()
        if stream is None:
            stream = _current_stream()
        elif not isinstance(stream, _Stream):
            raise TypeError(f"stream must be a cudalab Stream, got {stream!r}")
        elif type(stream.handle) is ClosedHandle:  # (the seam would refuse it too, later)
            raise stream.handle.error()
        device = stream.device_index
        if type(grid) is int and 0 < grid <= 0x7FFFFFFF:
            grid3 = (grid, 1, 1)
        else:
            grid3 = _dims(grid, "grid", _MAX_GRID)
        if type(block) is int and 0 < block <= _MAX_THREADS_PER_BLOCK:
            block3 = (block, 1, 1)
        else:
            block3 = _dims(block, "block", _MAX_BLOCK)
            if block3[0] * block3[1] * block3[2] > _MAX_THREADS_PER_BLOCK:
                raise ValueError(f"block {block!r} has more than {_MAX_THREADS_PER_BLOCK} threads")
        if type(shared_mem) is not int or shared_mem < 0:
            raise ValueError(f"shared_mem must be a non-negative int, got {shared_mem!r}")
        values: Sequence[Any] | None = self._fast_args(args)
        if values is None:
            values = self._convert_args(args)

        # cudalab.random.launch._launch is a near-copy of the steps below, kept for the RNG's
        # launch cost (benchmarks/rng.py); tests/random/test_launch_copy.py pins the two.
        backend = stream.backend
        states = getattr(self._tls, "state", None)
        state = None if states is None else states.get(device)
        if state is None or state[0] is not backend:
            state = self._thread_state(backend, device)
        _ensure_context(device)
        backend.launch_values(state[1], grid3, block3, shared_mem, stream.handle, state[2],
                              values)
        if launch_blocking:
            backend.stream_synchronize(stream.handle)
        if _launch_observers:
            for observer in tuple(_launch_observers):
                observer(self.name, device, stream, grid3, block3)
        if _observe.access_on:  # the stream sanitizer (one flag read while it is off)
            _observe.access_tracker.kernel_launch(self, stream, values)

    __call__ = launch

    def launch_prepared(self, grid: tuple[int, int, int], block: tuple[int, int, int],
                        values: Sequence[Any], stream: Any, programmatic: bool = False) -> None:
        """:meth:`launch` for callers that build the arguments themselves (the elementwise
        machinery): no conversion or check of ``values`` (ints and floats in range, pointers
        as ints), ``grid`` and ``block`` (valid 3-tuples) or ``stream`` (a cudalab Stream).

        Parameters
        ----------
        grid, block
            Launch dimensions as 3-tuples.
        values
            One value per signature entry.
        stream
            The cudalab Stream to launch on.
        programmatic
            Allow programmatic dependent launch (``Backend.launch_values_programmatic``): for
            kernels that wait for the previous kernel with ``griddepcontrol.wait`` (the fill
            kernels), on devices of compute capability 9.0+.
        """
        device = stream.device_index
        backend = stream.backend
        try:
            state = self._tls.state.get(device)
        except AttributeError:  # this thread's first launch of this kernel
            state = None
        if state is None or state[0] is not backend:
            state = self._thread_state(backend, device)
        # The stream's backend is the runtime's: what devices.ensure_context calls, a frame
        # fewer (the "fill_ (int64, 1024, fill kernel)" row of benchmarks/house_ab.py).
        backend.set_context(device)
        if programmatic:
            backend.launch_values_programmatic(state[1], grid, block, 0, stream.handle,
                                               state[2], values)
        else:
            backend.launch_values(state[1], grid, block, 0, stream.handle, state[2], values)
        if launch_blocking:
            backend.stream_synchronize(stream.handle)
        if _launch_observers:
            for observer in tuple(_launch_observers):
                observer(self.name, device, stream, grid, block)


def _access_indices(signature: tuple[str, ...],
                    access: Sequence[str] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(read indices, written indices) of a kernel's ``access`` annotation (see Kernel)."""
    pointers = tuple(i for i, t in enumerate(signature) if t == "p")
    if access is None:
        return (), pointers
    if isinstance(access, str):
        raise TypeError("access must be a tuple with one entry per parameter, such as "
                        "('w', '', 'r'), not a string")
    entries = tuple(access)
    if len(entries) != len(signature):
        raise ValueError(f"access has {len(entries)} entries, the signature {signature} has "
                         f"{len(signature)}")
    reads, writes = [], []
    for i, entry in enumerate(entries):
        if entry not in ("", "r", "w", "rw"):
            raise ValueError(f"access entry {i} must be 'r', 'w', 'rw' or '', got {entry!r}")
        if entry and signature[i] != "p":
            raise ValueError(f"access entry {i} is {entry!r} but parameter {i} is not a "
                             f"pointer ({signature[i]!r})")
        if "w" in entry:
            writes.append(i)
        elif entry == "r":
            reads.append(i)
    return tuple(reads), tuple(writes)


# Bound on first launch, not at import: the facility stays importable on its own. The launch
# path reads these module globals directly (no _internal wrapper call): it is the
# "kernel launch" row of benchmarks/timing.py and the RNG launch of benchmarks/rng.py.
_Stream: Any = None
_current_stream: Any = None
_ensure_context: Any = None


def _bind_runtime() -> None:
    global _Stream, _current_stream, _ensure_context
    from cudalab import devices, streams

    _ensure_context = devices.ensure_context
    _current_stream = streams.current_stream
    _Stream = streams.Stream


# --------------------------------------------------------------------------- helpers
def launch_config_1d(n: int, block: int = 256, max_blocks: int | None = None) -> tuple[int, int]:
    """(grid, block) covering ``n`` elements with one thread each, at least one block.

    ``max_blocks`` caps the grid for grid-stride kernels.
    """
    n = operator.index(n)
    block = operator.index(block)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= block <= _MAX_THREADS_PER_BLOCK:
        raise ValueError(f"block must be in [1, {_MAX_THREADS_PER_BLOCK}], got {block}")
    grid = max(1, -(-n // block))
    limit = _MAX_GRID[0]
    if max_blocks is not None:
        max_blocks = operator.index(max_blocks)
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        limit = min(limit, max_blocks)
    return min(grid, limit), block
