"""A simulated library call (cuBLAS, cuFFT) as a stream operation: :class:`LibraryCall` and
:func:`library_op`, which a stream runs in order and a capture records as a kernel node
(``sim.graphs`` knows ``library_op`` by its name), so graphs replay it as CUDA's do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LibraryCall", "library_op"]


class LibraryCall:
    """One library call: its name (a graph node's, ``cublasGemmEx``...) and what runs it."""

    __slots__ = ("name", "run", "args")

    def __init__(self, name: str, run: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.name = name  # the library entry point it stands for
        self.run = run  # computes it (numpy), reading and writing simulated device memory
        self.args = args  # run's arguments


def _library_op(call: LibraryCall, grid: tuple[int, int, int],
                block: tuple[int, int, int]) -> None:
    """Run ``call`` (``grid`` and ``block`` are there for a graph node's description)."""
    call.run(*call.args)


#: The stream operation (its name is what ``sim.graphs`` records a node of kind "kernel" by).
library_op = _library_op
