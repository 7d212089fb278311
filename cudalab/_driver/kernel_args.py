"""Kernel parameters across the seam: :class:`KernelArgs` (:meth:`Backend.make_args`) and
:data:`SimKernel`, the signature of a simulator kernel."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

__all__ = ["KernelArgs", "SimKernel"]


class KernelArgs(abc.ABC):
    """A packed kernel parameter list: set values, then pass to :meth:`Backend.launch`.

    Packing once and reusing the pack keeps the launch hot path free of per-call encoding.
    """

    signature: tuple[str, ...]

    @abc.abstractmethod
    def set(self, *values: Any) -> KernelArgs:
        """Store one value per parameter (in signature order); returns self."""

    @property
    @abc.abstractmethod
    def values(self) -> tuple[Any, ...]:
        """The values last stored, as Python numbers."""


#: Signature of a simulator kernel: impl(sim_backend, grid, block, shared_mem, *arg_values).
SimKernel = Callable[..., None]
