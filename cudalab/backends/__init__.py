"""``cudalab.backends``: torch.backends' CUDA switches (:mod:`cudalab.backends.cuda`)."""

from __future__ import annotations

from cudalab.backends import cuda

__all__ = ["cuda"]
