"""torch and CuPy as the user's process has them: read from ``sys.modules`` (imported only when
the user names one), with :class:`SourceUnavailableError` saying why one cannot be used, and
:func:`source_snapshot`, the snapshot (with its trace) a memory tool reads for a source name.

It sits in :mod:`cudalab.memory_tools` so that the tools below the memory API
(``history_frame``, ``what_if``) take ``source=`` too; the sample sources over these libraries
are :mod:`cudalab.memory_sources`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from cudalab.identity import Identity

__all__ = ["CUPY_BACKED_BY_CUDALAB", "CUPY_NOT_RECORDING", "PROCESS_NO_RECORDS", "SourceUnavailableError",
           "auto_snapshot_source", "cupy_backing", "cupy_with_cuda", "cupy_history_snapshot", "cupy_module",
           "cupy_pool_figures", "cupy_recording", "source_snapshot", "torch_history_enabled",
           "torch_module", "torch_ready", "torch_snapshot"]

#: The names a source may have (:data:`cudalab.memory_sources.SOURCE_NAMES` is this tuple).
SOURCE_NAMES: tuple[str, ...] = ("cudalab", "torch", "cupy", "process", "auto")


class SourceUnavailableError(RuntimeError):
    """A memory source was asked for that this process cannot give: its library is not
    installed or not imported, has not initialised CUDA, keeps no such record, or went away.

    Attributes
    ----------
    source : str
        The source's name (``"torch"``, ``"cupy"``, ...).
    reason : str
        Why, as a sentence that says what to do (e.g. ``"torch has not initialised CUDA
        yet (torch.cuda.is_initialized() is False): run some torch CUDA work first"``).
    """

    def __init__(self, source: str, reason: str):
        super().__init__(f"the memory source {source!r} is not available: {reason}")
        self.source = source
        self.reason = reason


def _module(name: str, label: str, explicit: bool) -> Any:
    module = sys.modules.get(name)
    if module is not None or not explicit:
        return module
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise SourceUnavailableError(
            name, f"this process has no {label}: it is not installed in this Python ({exc})"
        ) from None


def torch_module(explicit: bool = False) -> Any:
    """The user's torch module, or None (only when ``explicit`` is False and torch is not
    imported: ``auto`` reads ``sys.modules`` only). ``explicit`` (the user named torch):
    import it when it is installed but not imported yet; SourceUnavailableError when it is
    not installed."""
    return _module("torch", "torch", explicit)


def cupy_module(explicit: bool = False) -> Any:
    """The user's CuPy module, or None (as :func:`torch_module`)."""
    return _module("cupy", "CuPy", explicit)


def cupy_with_cuda(cupy: Any = None) -> Any:
    """``cupy`` (default: :func:`cupy_module` with ``explicit=True``) when it can use CUDA
    here; SourceUnavailableError saying why not (what the CuPy source and the CuPy
    recording both need)."""
    cupy = cupy_module(explicit=True) if cupy is None else cupy
    try:
        available = bool(cupy.cuda.is_available())
    except Exception:
        available = False
    if not available:
        raise SourceUnavailableError("cupy", "CuPy cannot use CUDA here "
                                             "(cupy.cuda.is_available() is False)")
    return cupy


def cupy_backing(cupy: Any) -> str:
    """Which allocator CuPy allocates device memory from now: ``"pool"`` (its default
    ``MemoryPool``), ``"cudalab"`` (:func:`cudalab.interop.cupy_allocator`) or ``"other"``
    (RMM, a user's own ``MemoryPool``, ...)."""
    try:
        current = cupy.cuda.get_allocator()
        if current == cupy.get_default_memory_pool().malloc:
            return "pool"
    except Exception:  # an older CuPy without get_allocator: the default pool
        return "pool"
    interop = sys.modules.get("cudalab.interop")  # (a layer above: read, never imported)
    ours = getattr(interop, "cupy_allocator", None)
    if ours is not None and (current is ours or getattr(current, "__wrapped__", None) is ours):
        return "cudalab"
    return "other"


def cupy_pool_figures(cupy: Any, device: int, free_blocks: bool = True
                      ) -> tuple[int, int, int]:
    """``(used_bytes, total_bytes, n_free_blocks)`` of CuPy's default ``MemoryPool`` on
    ``device`` (CuPy's pool answers for the calling thread's current device: ``device`` is
    made current for the call when it is another). ``free_blocks=False`` leaves out
    ``n_free_blocks()`` (0), which takes the pool's lock: the two byte counters are atomic
    reads, safe from inside CuPy's memory hooks."""
    pool = cupy.get_default_memory_pool()

    def read() -> tuple[int, int, int]:
        return (int(pool.used_bytes()), int(pool.total_bytes()),
                int(pool.n_free_blocks()) if free_blocks else 0)

    if cupy.cuda.runtime.getDevice() == device:
        return read()
    with cupy.cuda.Device(device):
        return read()


#: Why the ``process`` source has no snapshot, history nor what-if, and what to use instead.
PROCESS_NO_RECORDS = (
    "the process source is NVML's figure for the whole process less what the allocators "
    "hold: NVML keeps no per-allocation records, so it has no snapshot, history nor what-if; "
    "use the allocator's source for those (cudalab, torch, or cupy after '%cuda_memory "
    "history start --source cupy'), and --source process in watch and dashboard")

#: Why the ``cupy`` source has no snapshot or trace yet, and what to do.
CUPY_NOT_RECORDING = (
    "CuPy's pool keeps no per-block state nor trace of its own: start a recording first "
    "('%cuda_memory history start --source cupy', or cudalab.memory.record_cupy_history()), "
    "which records CuPy's allocations with CuPy's memory hooks from then on")


#: Why a CuPy backed by cudalab's allocator is the ``cudalab`` source's, not ``cupy``'s.
CUPY_BACKED_BY_CUDALAB = (
    "cudalab's allocator backs CuPy (cudalab.interop.cupy_allocator): CuPy's arrays are "
    "cudalab's allocations, which the 'cudalab' source sees and cudalab's own history records "
    "('%cuda_memory history start', cudalab.memory.record_history()): use --source cudalab")


def cupy_recording() -> Any:
    """The CuPy recording started last (:class:`cudalab.memory_tools.cupy_history.
    CupyRecording`, running or stopped), or None when none was started in this process."""
    module = sys.modules.get("cudalab.memory_tools.cupy_history")  # (loaded by a start)
    return None if module is None else module.current_recording()


def cupy_history_snapshot() -> dict[str, Any]:
    """The snapshot of the CuPy recording (:func:`cupy_recording`): the segments and blocks
    it saw, its trace and CuPy's pool totals; SourceUnavailableError when none was started."""
    recording = cupy_recording()
    if recording is None:
        cupy = cupy_module()
        if cupy is not None and cupy_backing(cupy) == "cudalab":
            raise SourceUnavailableError("cupy", CUPY_BACKED_BY_CUDALAB)
        raise SourceUnavailableError("cupy", CUPY_NOT_RECORDING)
    snap: dict[str, Any] = recording.snapshot()
    return snap


def torch_ready(torch: Any) -> str:
    """Why torch's allocator cannot be read now ("" when it can): torch has no CUDA, or has
    not initialised it (reading ``torch.cuda.is_initialized()`` and ``is_available()``,
    which initialise nothing)."""
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not callable(getattr(cuda, "is_initialized", None)):
        return "this torch has no torch.cuda module"
    if cuda.is_initialized():
        return ""
    if not cuda.is_available():
        return "this torch cannot use CUDA (torch.cuda.is_available() is False)"
    return ("torch has not initialised CUDA yet (torch.cuda.is_initialized() is False): run "
            "some torch CUDA work first, e.g. torch.zeros(1, device='cuda')")


def torch_history_enabled(torch: Any) -> bool | None:
    """Whether torch records its memory history now (``torch._C._cuda_isHistoryEnabled()``;
    None when this torch cannot say)."""
    probe = getattr(getattr(torch, "_C", None), "_cuda_isHistoryEnabled", None)
    if not callable(probe):
        return None
    try:
        return bool(probe())
    except Exception:
        return None


def torch_snapshot(torch: Any) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()`` (torch's schema: segments, device_traces, ...) with
    cudalab's ``identity`` key added (allocator ``"torch"``); SourceUnavailableError while
    torch cannot be read (:func:`torch_ready`)."""
    why = torch_ready(torch)
    if why:
        raise SourceUnavailableError("torch", why)
    snap = dict(torch.cuda.memory._snapshot())
    snap["identity"] = Identity.current(allocator="torch").to_dict()
    return snap


def auto_snapshot_source() -> str:
    """Which allocator's snapshot (or trace) ``auto`` means: a snapshot is one allocator's,
    so ``"torch"`` when torch is imported, has initialised CUDA and cudalab's own allocator
    holds no memory (the process runs torch), else ``"cupy"`` when a CuPy recording runs
    and cudalab's allocator holds no memory, else ``"cudalab"``."""
    torch = torch_module()
    torch_on = torch is not None and not torch_ready(torch)
    recording = cupy_recording()
    cupy_on = recording is not None and bool(recording.active)
    if not torch_on and not cupy_on:
        return "cudalab"
    from cudalab.allocator import registry

    held = any(a.memory_stats().get("reserved_bytes.all.current", 0)
               for a in list(registry.active))
    if held:
        return "cudalab"
    return "torch" if torch_on else "cupy"


def source_snapshot(source: Any) -> dict[str, Any] | None:
    """The snapshot (with its trace) a memory tool reads for ``source``.

    Parameters
    ----------
    source : str or SampleSource
        ``"cudalab"`` (None is returned: the caller reads cudalab's own, as without a
        source), ``"torch"`` (torch's ``_snapshot()``), ``"auto"`` (torch's when the process
        runs torch and cudalab's allocator holds nothing, see :func:`auto_snapshot_source`),
        ``"cupy"`` (the CuPy recording's snapshot: :func:`cupy_history_snapshot`), or an
        object with a ``snapshot()`` method (a
        :class:`~cudalab.memory_tools.samples.SampleSource`).

    Returns
    -------
    dict or None

    Raises
    ------
    SourceUnavailableError
        torch cannot be read; ``"cupy"`` before a CuPy recording was started;
        ``"process"`` (NVML keeps no per-allocation records: :data:`PROCESS_NO_RECORDS`).
    ValueError
        An unknown name.
    """
    if not isinstance(source, str):
        if callable(getattr(source, "snapshot", None)):
            return source.snapshot()
        raise TypeError(f"source is a {type(source).__name__}, expected one of "
                        f"{', '.join(SOURCE_NAMES)} or a SampleSource")
    name = source.strip().lower()
    if name == "auto":
        name = auto_snapshot_source()
    if name == "cudalab":
        return None
    if name == "torch":
        return torch_snapshot(torch_module(explicit=True))
    if name == "cupy":
        return cupy_history_snapshot()
    if name == "process":
        raise SourceUnavailableError(name, PROCESS_NO_RECORDS)
    raise ValueError(f"unknown memory source {source!r:.60}; use one of "
                     f"{', '.join(SOURCE_NAMES)}")
