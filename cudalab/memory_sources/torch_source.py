"""The ``torch`` source: :class:`TorchSource`, samples of PyTorch's CUDA caching allocator.

torch is read from ``sys.modules`` only: cudalab never imports it, except when the user names
the source explicitly (:func:`cudalab.memory_tools.libraries.torch_module`). A sample reads
``torch.cuda.memory_stats_as_nested_dict(device)`` (the dict ``memory_stats()`` flattens; a
fifth of its cost), whose keys are cudalab's (:data:`~cudalab.memory_tools.samples.ALLOCATOR_FIGURES`),
so every figure is exactly torch's. Nothing here resets torch's peaks except
:meth:`TorchSource.reset_peaks` (the dashboard's button, which says it is global), and nothing
initialises torch's CUDA: a sample is refused (:class:`SourceUnavailableError`) while
``torch.cuda.is_initialized()`` is False.
"""

from __future__ import annotations

import time
from typing import Any

from cudalab.memory_sources.cudalab_source import DeviceFacts
from cudalab.memory_tools.libraries import (
    SourceUnavailableError,
    torch_module,
    torch_ready,
    torch_snapshot,
)
from cudalab.memory_tools.samples import ALLOCATOR_FIGURES, DeviceSample

#: ``torch_module`` and ``torch_ready`` live in :mod:`cudalab.memory_tools.libraries` (so the
#: tools below the memory API read torch too) and stay importable from here.
__all__ = ["TorchSource", "torch_module", "torch_ready"]

#: The figures' keys split once: ``"allocated_bytes.all.current"`` -> its three parts.
_PATHS = tuple((name, tuple(key.split("."))) for name, key in ALLOCATOR_FIGURES)


def _figure(stats: dict, path: tuple[str, ...]) -> int:
    """``stats[a][b][c]`` (a nested dict of torch's), 0 when a level is missing."""
    value: Any = stats
    for part in path:
        if not isinstance(value, dict):
            return 0
        value = value.get(part, 0)
    return int(value) if isinstance(value, int) else 0


class TorchSource:
    """Samples of torch's CUDA caching allocator, for every memory view.

    Parameters
    ----------
    torch : module, optional
        The torch module (default: :func:`torch_module` with ``explicit=True``).
    nvml : bool, optional
        Add the device's NVML figures to each sample (default True).

    Raises
    ------
    SourceUnavailableError
        torch is not installed, has no CUDA, or has not initialised it.
    """

    name = "torch"

    def __init__(self, torch: Any = None, nvml: bool = True):
        torch = torch_module(explicit=True) if torch is None else torch
        why = torch_ready(torch)
        if why:
            raise SourceUnavailableError("torch", why)
        self._torch = torch
        self._nvml = bool(nvml)
        self._facts = DeviceFacts("torch")
        self._note = ""
        backend = getattr(torch.cuda, "get_allocator_backend", None)
        try:
            if callable(backend) and backend() == "cudaMallocAsync":
                self._note = ("torch uses cudaMallocAsync: torch reports some of its figures "
                              "as 0, and its peak reserved is a bound")
        except Exception:  # an older torch: the native allocator
            pass

    @property
    def torch(self) -> Any:
        """The torch module read."""
        return self._torch

    def stats(self, device: int) -> dict:
        """torch's nested ``memory_stats`` dict of ``device`` (SourceUnavailableError once
        torch's CUDA is no longer initialised, e.g. in a forked child)."""
        cuda = self._torch.cuda
        if not cuda.is_initialized():
            raise SourceUnavailableError("torch", "torch's CUDA is no longer initialised")
        nested = getattr(cuda, "memory_stats_as_nested_dict", None)
        if nested is not None:
            return dict(nested(device))
        flat = cuda.memory_stats(device)  # (a torch without the nested form)
        out: dict = {}
        for key, value in flat.items():
            parts = key.split(".")
            node = out
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
        return out

    def sample(self, device: int, now: float | None = None) -> DeviceSample:
        """A :class:`DeviceSample` of torch's allocator on ``device``: exactly torch's
        ``memory_stats()`` figures (its peaks are torch's own, read, never reset), NVML's."""
        stats = self.stats(device)
        identity, capacity, _ = self._facts.get(device)
        figures: dict[str, Any] = {name: _figure(stats, path) for name, path in _PATHS}
        if self._nvml:
            figures.update(self._facts.nvml(device))
        return DeviceSample(time=time.time() if now is None else now, source=self.name,
                            identity=identity, capacity=capacity, note=self._note, **figures)

    def reserved(self, device: int) -> int:
        """Bytes torch's allocator holds on ``device`` now (``memory_reserved``)."""
        return _figure(self.stats(device), ("reserved_bytes", "all", "current"))

    def reset_peaks(self, device: int) -> None:
        """``torch.cuda.reset_peak_memory_stats(device)``: global, as the user's own call
        (every reader's ``max_memory_allocated()`` starts again)."""
        self._torch.cuda.reset_peak_memory_stats(device)

    def release_cache(self) -> None:
        """``torch.cuda.empty_cache()``."""
        self._torch.cuda.empty_cache()

    def snapshot(self) -> dict[str, Any]:
        """``torch.cuda.memory._snapshot()`` (torch's schema, which the snapshot viewer and
        memory_viz read) with cudalab's ``identity`` key added (allocator ``"torch"``)."""
        return torch_snapshot(self._torch)
