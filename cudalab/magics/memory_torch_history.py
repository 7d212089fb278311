"""``%cuda_memory history ... --source torch`` and the writing of any allocator's snapshot:
torch's own recording (``torch.cuda.memory._record_memory_history``) driven from the magic,
and its trace saved in the formats cudalab's history has.

* ``start``: ``_record_memory_history(enabled="all", context=..., stacks=..., max_entries=...)``
  (``--context`` / ``--stacks`` / ``--max-entries`` passed through; ``none`` is None).
* ``stop``: torch *clears* its trace when recording stops, so the trace is read first
  (``_snapshot()``) and kept for ``save`` and ``frame``.
* ``save PATH``: ``.pickle`` (or any other name) torch's snapshot pickle, protocol 4, which
  torch's ``memory_viz`` reads; ``.csv`` / ``.parquet`` ``history_frame`` (one row per trace
  entry); ``.json`` / ``.json.gz`` Perfetto. Atomically, as cudalab's.
* ``frame``: :func:`cudalab.memory.history_frame` of the trace.

A recording stopped by the user's own call (which clears torch's trace) is reported by
``status`` and ``save``, never raised.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

from cudalab import _internal
from cudalab.magics.memory_args import MemoryArgs

__all__ = ["TorchHistory", "write_snapshot", "snapshot_kind"]


def snapshot_kind(path: str) -> str:
    """How ``save`` writes ``path``: ``"csv"``, ``"parquet"``, ``"perfetto"`` or ``"pickle"``."""
    low = path.lower()
    if low.endswith(".csv"):
        return "csv"
    if low.endswith(".parquet"):
        return "parquet"
    if low.endswith(".json") or low.endswith(".json.gz"):
        return "perfetto"
    return "pickle"


_KIND_TEXT = {
    "csv": "CSV (cudalab.memory.read_history_csv reads it back)",
    "parquet": "parquet (pandas.read_parquet reads it back)",
    "perfetto": "Perfetto/Chrome trace JSON (open in ui.perfetto.dev)",
    "pickle": "torch snapshot pickle (open at https://pytorch.org/memory_viz)",
}


def write_snapshot(snap: dict[str, Any], path: str) -> str:
    """Write ``snap`` (torch's schema) to ``path`` by :func:`snapshot_kind`, atomically;
    returns what was written, in words."""
    kind = snapshot_kind(path)
    if kind in ("csv", "parquet"):
        from cudalab.memory_tools.export import history_frame, save_frame

        save_frame(history_frame(snap), path, kind)
    elif kind == "perfetto":
        from cudalab.memory_tools.perfetto import export_perfetto

        export_perfetto(path, snap)
    else:
        from cudalab.memory_tools.trace_io import dumps_snapshot

        _internal.write_bytes_atomic(path, dumps_snapshot(snap))
    return _KIND_TEXT[kind]


def _entries(snap: dict[str, Any] | None) -> int:
    if not snap:
        return 0
    return sum(len(t) for t in snap.get("device_traces") or ())


class TorchHistory:
    """torch's recording as ``%cuda_memory history --source torch`` drives it."""

    def __init__(self) -> None:
        self.started = False  # this magic started torch's recording
        self.kept: dict[str, Any] | None = None  # the trace read when the magic stopped it

    @staticmethod
    def _torch(explicit: bool = True) -> Any:
        from cudalab.memory_tools.libraries import SourceUnavailableError, torch_module

        try:
            torch = torch_module(explicit=explicit)
        except SourceUnavailableError as exc:
            raise UsageError(f"%cuda_memory history --source torch: {exc.reason}") from None
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_available():
            raise UsageError("%cuda_memory history --source torch: this torch cannot use CUDA "
                             "(torch.cuda.is_available() is False)")
        return torch

    def _live(self, torch: Any) -> dict[str, Any]:
        from cudalab.memory_tools.libraries import SourceUnavailableError, torch_snapshot

        try:
            return torch_snapshot(torch)
        except SourceUnavailableError as exc:
            raise UsageError(f"%cuda_memory history --source torch: {exc.reason}") from None

    def _recording(self, torch: Any) -> bool | None:
        from cudalab.memory_tools.libraries import torch_history_enabled

        return torch_history_enabled(torch)

    def run(self, sub: str, args: MemoryArgs) -> Any:
        torch = self._torch()
        if sub == "start":
            kwargs = args.record_kwargs()
            try:
                torch.cuda.memory._record_memory_history(enabled="all", **kwargs)
            except (ValueError, RuntimeError, TypeError) as exc:
                raise UsageError(f"%cuda_memory history start --source torch: {exc}") from None
            self.started, self.kept = True, None
            settings = ", ".join(f"{k}={v}" for k, v in kwargs.items()) or "torch's defaults"
            print(f"cudalab history: torch is recording its allocator's history ({settings}); "
                  "'%cuda_memory history stop --source torch' keeps the trace readable")
            return None
        if sub == "stop":
            if not self._recording(torch) and not self.started:
                print("cudalab history: torch is not recording")
                return None
            self.kept = self._live(torch)  # torch clears its trace when recording stops
            torch.cuda.memory._record_memory_history(enabled=None)
            self.started = False
            print(f"cudalab history: torch stopped; {_entries(self.kept)} trace entries kept "
                  "('%cuda_memory history save PATH --source torch' or 'frame')")
            return None
        if sub == "status":
            recording = self._recording(torch)
            state = {True: "recording", False: "not recording", None: "unknown"}[recording]
            held = self.kept if recording is False and self.kept is not None else (
                self._live(torch) if not torch_ready_text(torch) else None)
            extra = ""
            if self.started and recording is False:
                extra = (" (stopped outside cudalab: torch clears its trace when recording "
                         "stops)")
            print(f"cudalab history: torch {state}{extra}; {_entries(held)} trace entries held")
            return None
        snap = self.trace(torch)
        if sub == "save":
            path = args.words[1] if len(args.words) > 1 and args.words[1].strip() else None
            if path is None:
                raise UsageError("%cuda_memory history save PATH --source torch (.pickle for "
                                 "memory_viz, .csv, .parquet, .json for Perfetto)")
            try:
                kind = write_snapshot(snap, path)
            except (OSError, ValueError, TypeError, ImportError) as exc:
                raise UsageError(f"%cuda_memory history save: cannot write '{path}': {exc}"
                                 ) from None
            n = _entries(snap)
            gone = ("; torch is not recording (0 entries: a recording stopped outside cudalab "
                    "clears torch's trace)" if n == 0 and self._recording(torch) is False else "")
            print(f"cudalab history: wrote {n} torch trace entries to {path}: {kind}{gone}")
            return None
        if sub == "frame":
            from cudalab.magics.memory_args import resolve_device
            from cudalab.memory_tools.export import history_frame

            return history_frame(snap, device=None if args.device is None
                                 else resolve_device(args.device))
        raise UsageError(f"%cuda_memory history: unknown action {_internal.echo(sub)}; use "
                         "start, stop, status, save PATH or frame")

    def close(self) -> None:
        """Stop the recording this magic started (``%unload_ext``), keeping its trace."""
        if not self.started:
            return
        self.started = False
        try:
            torch = self._torch(explicit=False)
            if self._recording(torch) is not False:
                self.kept = self._live(torch)
                torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:  # (unloading never fails on torch's account)
            pass

    def trace(self, torch: Any) -> dict[str, Any]:
        """The trace ``save`` and ``frame`` read: torch's live one while it records (or has
        entries), else the one kept when the magic stopped it."""
        if self.kept is not None and self._recording(torch) is not True:
            return self.kept
        return self._live(torch)


def torch_ready_text(torch: Any) -> str:
    """Why torch's allocator cannot be read now ("" when it can)."""
    from cudalab.memory_tools.libraries import torch_ready

    return torch_ready(torch)
