"""Sources of :class:`~cudalab.memory_tools.samples.DeviceSample` records: the allocator a
memory view reads.

==========  ====================================================================================
name        what its samples are
==========  ====================================================================================
cudalab     cudalab's own allocator (:class:`CudalabSource`: ``cudalab.memory.memory_stats``)
torch       PyTorch's caching allocator (:class:`TorchSource`: ``torch.cuda.memory_stats``)
cupy        CuPy's default pools (:class:`CupySource`: ``MemoryPool.used_bytes/total_bytes``)
process     this process's memory no allocator accounts for (:class:`ProcessSource`: NVML's
            figure for the process less every allocator's reserved bytes)
auto        every allocator present in the process, each labelled, then ``process``
==========  ====================================================================================

:func:`resolve_sources` turns a name (or source objects) into the sources a view reads, with a
:class:`SourceUnavailableError` that says why one cannot be had (``%cuda_memory`` turns it
into a UsageError). torch and CuPy are read from ``sys.modules`` only; naming one explicitly
imports it when installed. ``import cudalab`` and ``%load_ext cudalab`` import neither.

This package sits just above :mod:`cudalab.memory` in the layers (``pyproject.toml``): the
record and the :class:`~cudalab.memory_tools.samples.SampleSource` protocol stay in
:mod:`cudalab.memory_tools` (below the memory API), and the sources that read the memory API
or another library's allocator live here, so no lower layer reaches up to ``cudalab.memory``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cudalab.memory_sources.cudalab_source import (
    CudalabSource,
    DeviceFacts,
    NvmlState,
    nvml_figures,
)
from cudalab.memory_sources.cupy_source import CupySource, cupy_backing
from cudalab.memory_sources.process_source import ProcessSource
from cudalab.memory_sources.torch_source import TorchSource
from cudalab.memory_tools.libraries import (
    SOURCE_NAMES,
    SourceUnavailableError,
    cupy_module,
    torch_module,
    torch_ready,
)
from cudalab.memory_tools.samples import SampleSource

__all__ = [
    "SOURCE_NAMES",
    "CudalabSource",
    "CupySource",
    "DeviceFacts",
    "NvmlState",
    "ProcessSource",
    "SourceUnavailableError",
    "TorchSource",
    "allocator_sources",
    "cupy_backing",
    "cupy_module",
    "nvml_figures",
    "resolve_sources",
    "torch_module",
    "torch_ready",
]


def allocator_sources(nvml: bool = True) -> tuple[SampleSource, ...]:
    """A source for every allocator present in the process, in :data:`SOURCE_NAMES` order:
    cudalab's always, torch's when torch is imported and has initialised CUDA, CuPy's when
    CuPy is imported and can use CUDA. Reads ``sys.modules`` only; never raises for a
    library that is absent or not ready (it is left out)."""
    found: list[SampleSource] = [CudalabSource()]
    torch = torch_module()
    if torch is not None and not torch_ready(torch):
        found.append(TorchSource(torch, nvml=nvml))
    cupy = cupy_module()
    if cupy is not None:
        try:
            found.append(CupySource(cupy, nvml=nvml))
        except SourceUnavailableError:
            pass
    return tuple(found)


def resolve_sources(source: Any = "auto") -> tuple[SampleSource, ...]:
    """The sources a memory view reads.

    Parameters
    ----------
    source : str, SampleSource or iterable of SampleSource, optional
        A name of :data:`SOURCE_NAMES` (case-insensitive; default ``"auto"``: every allocator
        present in the process, then the ``process`` remainder), a source object, or several.

    Returns
    -------
    tuple of SampleSource
        One source for a name other than ``"auto"`` (``"process"``: the remainder after
        every allocator present), each source given, or what ``"auto"`` finds.

    Raises
    ------
    SourceUnavailableError
        The named source cannot be had; the message says why (torch not installed, without
        CUDA, or CUDA not initialised by torch yet; CuPy not installed or without CUDA).
    ValueError
        An unknown name, or an empty sequence.
    TypeError
        Neither a name nor source objects.
    """
    if isinstance(source, str):
        name = source.strip().lower()
        if name == "cudalab":
            return (CudalabSource(),)
        if name == "torch":
            return (TorchSource(torch_module(explicit=True)),)
        if name == "cupy":
            return (CupySource(cupy_module(explicit=True)),)
        if name == "process":
            return (ProcessSource(allocator_sources()),)
        if name == "auto":
            found = allocator_sources()
            return (*found, ProcessSource(found))
        raise ValueError(f"unknown memory source {source!r:.60}; use one of "
                         f"{', '.join(SOURCE_NAMES)}")
    if _is_source(source):
        return (source,)
    if isinstance(source, Iterable):
        out = tuple(source)
        if not out:
            raise ValueError("no memory source given (an empty sequence)")
        for s in out:
            if not _is_source(s):
                raise TypeError(f"{type(s).__name__} is not a memory source (a SampleSource: "
                                "name, sample, reset_peaks, release_cache, snapshot)")
        return out
    raise TypeError(f"source is a {type(source).__name__}, expected one of "
                    f"{', '.join(SOURCE_NAMES)} or a SampleSource")


def _is_source(obj: Any) -> bool:
    return (not isinstance(obj, (str, bytes)) and isinstance(getattr(obj, "name", None), str)
            and all(callable(getattr(obj, m, None))
                    for m in ("sample", "reset_peaks", "release_cache", "snapshot")))
