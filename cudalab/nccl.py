"""torch.cuda.nccl's single-process list API over NCCL (being written: issue 19)."""

from __future__ import annotations

__all__: list[str] = []
