"""How matmuls may trade precision for speed: torch's TF32 and reduced-precision switches.

One settings record, :data:`SETTINGS`, read by ``cudalab.matmul`` on every call and written
through ``cudalab.backends.cuda.matmul`` and :func:`set_float32_matmul_precision`, with
torch's names, values and defaults (torch 2.11):

* ``float32_matmul_precision``: ``"highest"`` (default: float32 and complex64 matmuls in
  full float32, ``CUBLAS_COMPUTE_32F``), ``"high"`` or ``"medium"`` (TensorFloat-32 tensor
  cores, ``CUBLAS_COMPUTE_32F_FAST_TF32`` and the TF32 math mode: cuBLAS has no bfloat16
  mode for float32, so on CUDA "medium" acts as "high", as in torch).
  ``backends.cuda.matmul.allow_tf32`` is the same setting seen as a bool: it reads True
  unless the precision is "highest"; setting it True means "high", False "highest".
* ``allow_fp16_reduced_precision_reduction`` / ``allow_bf16_reduced_precision_reduction``
  (default True): False adds ``CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION`` to the
  math mode of float16 / bfloat16 matmuls (no split-K reductions in half precision).
* ``allow_fp16_accumulation`` (default False): float16 matmuls accumulate in float16
  (``CUBLAS_COMPUTE_16F``) instead of float32.

This module imports nothing of cudalab, so every layer may read it.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PRECISIONS", "SETTINGS", "MatmulSettings", "MatmulState",
           "get_float32_matmul_precision", "set_float32_matmul_precision"]

#: The values of ``set_float32_matmul_precision``, most precise first.
PRECISIONS = ("highest", "high", "medium")


class MatmulState(NamedTuple):
    """The settings at one moment (replaced whole, never changed: see :class:`MatmulSettings`)."""

    float32_precision: str  # one of PRECISIONS
    allow_fp16_reduced_precision_reduction: bool  # a bool
    allow_bf16_reduced_precision_reduction: bool  # a bool
    allow_fp16_accumulation: bool  # a bool


class MatmulSettings:
    """The process's matmul settings (torch's are process-wide too).

    Every setting lives in one :class:`MatmulState`, :attr:`state`, which each setter
    replaces whole (one store: a Ctrl-C or another thread never sees half a change), so
    ``cudalab.matmul`` keeps what it resolved for a state while ``SETTINGS.state`` is that
    very object (one identity check per call instead of reading every flag).
    """

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = MatmulState("highest", True, True, False)

    @property
    def float32_precision(self) -> str:
        """One of :data:`PRECISIONS` (set through :func:`set_float32_matmul_precision`)."""
        return self.state.float32_precision

    @property
    def tf32(self) -> bool:
        """Whether float32 matmuls may use TF32: the precision is not "highest"."""
        return self.state.float32_precision != "highest"

    @property
    def allow_fp16_reduced_precision_reduction(self) -> bool:
        return self.state.allow_fp16_reduced_precision_reduction

    @allow_fp16_reduced_precision_reduction.setter
    def allow_fp16_reduced_precision_reduction(self, value: bool) -> None:
        self.state = self.state._replace(allow_fp16_reduced_precision_reduction=value)

    @property
    def allow_bf16_reduced_precision_reduction(self) -> bool:
        return self.state.allow_bf16_reduced_precision_reduction

    @allow_bf16_reduced_precision_reduction.setter
    def allow_bf16_reduced_precision_reduction(self, value: bool) -> None:
        self.state = self.state._replace(allow_bf16_reduced_precision_reduction=value)

    @property
    def allow_fp16_accumulation(self) -> bool:
        return self.state.allow_fp16_accumulation

    @allow_fp16_accumulation.setter
    def allow_fp16_accumulation(self, value: bool) -> None:
        self.state = self.state._replace(allow_fp16_accumulation=value)


#: The one settings record.
SETTINGS = MatmulSettings()


def set_float32_matmul_precision(precision: str) -> None:
    """Set the internal precision of float32 (and complex64) matmuls, as torch's.

    Parameters
    ----------
    precision
        ``"highest"`` (full float32, the default), ``"high"`` or ``"medium"``
        (TensorFloat-32 tensor cores on Ampere and later).

    Raises
    ------
    ValueError
        ``precision`` is not one of those three strings (the message names the argument).
    """
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"set_float32_matmul_precision: precision must be 'highest', 'high' "
                         f"or 'medium', got {precision!r}")
    SETTINGS.state = SETTINGS.state._replace(float32_precision=precision)


def get_float32_matmul_precision() -> str:
    """The current float32 matmul precision: ``"highest"``, ``"high"`` or ``"medium"``."""
    return SETTINGS.float32_precision
