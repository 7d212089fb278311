"""``%cuda_memory history ... --source cupy``: CuPy's pool allocations recorded with CuPy's own
memory hooks (:mod:`cudalab.memory_tools.cupy_history`), driven from the magic.

* ``start``: :func:`~cudalab.memory_tools.cupy_history.record_cupy_history` with
  ``--context`` / ``--stacks`` / ``--max-entries`` (``none`` is None). CuPy's hooks are per
  thread: the thread that runs the magic (the notebook's main thread, where the cells run)
  is the one recorded.
* ``stop``: leaves CuPy's hooks; the trace stays readable for ``save``, ``frame`` and the
  other views (``snapshot``, what-if) until the next ``start``.
* ``save PATH``: as torch's (``.pickle`` torch's snapshot pickle, which memory_viz and
  cudalab's loaders read, with the ``identity`` key; ``.csv`` / ``.parquet``
  ``history_frame``; ``.json`` / ``.json.gz`` Perfetto), atomically.
* ``frame``: :func:`cudalab.memory.history_frame` of the trace; ``status``: the counts.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

from cudalab import _internal
from cudalab.magics.memory_args import MemoryArgs

__all__ = ["CupyHistory"]

_WHAT = "%cuda_memory history --source cupy"


def _settings(recording: Any) -> str:
    cap = recording.max_entries
    cap_text = "unbounded" if cap >= 2**62 else f"{cap:,}"
    return f"context={recording.context}, stacks={recording.stacks}, max_entries={cap_text}"


class CupyHistory:
    """The CuPy recording as ``%cuda_memory history --source cupy`` drives it."""

    def __init__(self) -> None:
        self.started: Any = None  # the recording this magic started (stopped at unload)

    @staticmethod
    def _cupy() -> Any:
        from cudalab.memory_tools.libraries import SourceUnavailableError, cupy_module

        try:
            cupy = cupy_module(explicit=True)
        except SourceUnavailableError as exc:
            raise UsageError(f"{_WHAT}: {exc.reason}") from None
        return cupy

    @staticmethod
    def _recording() -> Any:
        from cudalab.memory_tools.libraries import cupy_recording

        return cupy_recording()

    def _require(self) -> Any:
        from cudalab.memory_tools.libraries import CUPY_NOT_RECORDING

        recording = self._recording()
        if recording is None:
            raise UsageError(f"{_WHAT}: no CuPy recording in this process: {CUPY_NOT_RECORDING}")
        return recording

    def run(self, sub: str, args: MemoryArgs) -> Any:
        if sub == "start":
            return self._start(args)
        recording = self._recording()
        if sub == "stop":
            if recording is None or not recording.active:
                print("cudalab history: CuPy is not being recorded")
                return None
            try:
                recording.stop()
            except RuntimeError as exc:  # another thread started it
                raise UsageError(f"{_WHAT} stop: {exc}") from None
            print(f"cudalab history: CuPy's recording stopped; {recording.entry_count()} trace "
                  "entries kept ('%cuda_memory history save PATH --source cupy' or 'frame')")
            return None
        if sub == "status":
            if recording is None:
                print("cudalab history: CuPy not recorded (start it with '%cuda_memory history "
                      "start --source cupy')")
                return None
            state = (f"recording on thread {recording.thread_name!r} ({_settings(recording)})"
                     if recording.active else "stopped")
            print(f"cudalab history: CuPy {state}; {recording.entry_count()} trace entries held")
            return None
        if sub == "save":
            from cudalab.magics.memory_torch_history import write_snapshot

            path = args.words[1] if len(args.words) > 1 and args.words[1].strip() else None
            if path is None:
                raise UsageError("%cuda_memory history save PATH --source cupy (.pickle for "
                                 "memory_viz, .csv, .parquet, .json for Perfetto)")
            snap = self._require().snapshot()
            try:
                kind = write_snapshot(snap, path)
            except (OSError, ValueError, TypeError, ImportError) as exc:
                raise UsageError(f"%cuda_memory history save: cannot write '{path}': {exc}"
                                 ) from None
            n = sum(len(t) for t in snap["device_traces"])
            print(f"cudalab history: wrote {n} CuPy trace entries to {path}: {kind}")
            return None
        if sub == "frame":
            from cudalab.magics.memory_args import resolve_device
            from cudalab.memory_tools.export import history_frame

            snap = self._require().snapshot()
            return history_frame(snap, device=None if args.device is None
                                 else resolve_device(args.device))
        raise UsageError(f"%cuda_memory history: unknown action {_internal.echo(sub)}; use "
                         "start, stop, status, save PATH or frame")

    def _start(self, args: MemoryArgs) -> None:
        from cudalab.memory_tools.cupy_history import record_cupy_history
        from cudalab.memory_tools.libraries import SourceUnavailableError

        cupy = self._cupy()
        running = self._recording()
        if running is not None and running.active:
            print(f"cudalab history: CuPy is being recorded already ({_settings(running)})")
            return None
        try:
            recording = record_cupy_history(cupy, **args.record_kwargs())
        except SourceUnavailableError as exc:
            raise UsageError(f"%cuda_memory history start --source cupy: {exc.reason}") from None
        except (ValueError, RuntimeError) as exc:
            raise UsageError(f"%cuda_memory history start --source cupy: {exc}") from None
        self.started = recording
        print(f"cudalab history: recording CuPy's pool allocations with CuPy's memory hooks "
              f"({_settings(recording)}) on thread {recording.thread_name!r} only (CuPy's "
              "hooks are per thread); '%cuda_memory history stop --source cupy' keeps the "
              "trace readable")
        return None

    def close(self) -> None:
        """Stop the recording this magic started (``%unload_ext``), keeping its trace;
        never fails."""
        recording, self.started = self.started, None
        if recording is not None and recording.active:
            try:
                recording.stop()
            except Exception:  # (unloading never fails on CuPy's account)
                pass
