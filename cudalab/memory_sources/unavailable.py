"""Why a memory source cannot be used: :class:`SourceUnavailableError`.

Its own module, so that every source module and :func:`cudalab.memory_sources.resolve_sources`
raise the one class (and ``%cuda_memory`` turns it into a UsageError that says which).
"""

from __future__ import annotations

__all__ = ["SourceUnavailableError"]


class SourceUnavailableError(RuntimeError):
    """A memory source was asked for that this process cannot give: its library is not
    installed or not imported, or has not initialised CUDA, or it went away.

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
