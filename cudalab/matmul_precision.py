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

__all__ = ["PRECISIONS", "SETTINGS", "MatmulSettings", "get_float32_matmul_precision",
           "set_float32_matmul_precision"]

#: The values of ``set_float32_matmul_precision``, most precise first.
PRECISIONS = ("highest", "high", "medium")


class MatmulSettings:
    """The process's matmul settings (torch's are process-wide too)."""

    __slots__ = ("float32_precision", "tf32", "allow_fp16_reduced_precision_reduction",
                 "allow_bf16_reduced_precision_reduction", "allow_fp16_accumulation")

    def __init__(self) -> None:
        self.float32_precision = "highest"  # one of PRECISIONS
        self.tf32 = False  # float32_precision != "highest" (kept in step by the setter)
        self.allow_fp16_reduced_precision_reduction = True  # a bool
        self.allow_bf16_reduced_precision_reduction = True  # a bool
        self.allow_fp16_accumulation = False  # a bool


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
    SETTINGS.float32_precision = precision
    SETTINGS.tf32 = precision != "highest"


def get_float32_matmul_precision() -> str:
    """The current float32 matmul precision: ``"highest"``, ``"high"`` or ``"medium"``."""
    return SETTINGS.float32_precision
