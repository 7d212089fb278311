"""Capturing into a CUDA graph: the :class:`graph` context manager and
:func:`is_current_stream_capturing` (``torch.cuda.graph``, ``torch.cuda.is_current_stream_capturing``).
"""

from __future__ import annotations

import os as _os
from typing import Any

from cudalab import _interrupts
from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab.graphs.cuda_graph import CUDAGraph, capture_mode

__all__ = ["graph", "is_current_stream_capturing"]

# Ctrl-C is deferred while this module's code runs (cudalab._interrupts): entering and leaving
# ``with cudalab.graph(g):`` is never left half done (a capture begun that the block never
# ends, the capture stream left current); the KeyboardInterrupt comes in the caller's code.
_interrupts.guard_files([_os.path.abspath(__file__)])


def is_current_stream_capturing() -> bool:
    """Whether the current stream of the current device is being captured into a graph.

    Returns False without initialising CUDA when it is not initialised (as torch).

    Returns
    -------
    bool
    """
    if not _devices.is_initialized():
        return False
    return _streams.is_capturing(_streams.current_stream())


class graph:  # noqa: N801 - torch's name
    """Context manager capturing the block into ``cuda_graph`` (``torch.cuda.graph``).

    On entry: synchronize, ``empty_cache()``, make the capture stream current and begin the
    capture; on exit (also when the block raises) end the capture and restore the stream.
    When the block raised, its exception propagates (the failed capture_end is noted on it).
    Ctrl-C is deferred while the entry and the exit run: a KeyboardInterrupt comes before the
    capture begins or in the block (whose exit ends the capture), never half-way.

    Parameters
    ----------
    cuda_graph : CUDAGraph
    pool : tuple of (int, int), MemPool or None, optional
        Share this private memory pool (see :meth:`CUDAGraph.capture_begin`).
    stream : Stream or None, optional
        The capture stream; default: one side stream shared by every ``graph`` of the
        process (:attr:`default_capture_stream`, as torch).
    capture_error_mode : {"global", "thread_local", "relaxed"}, optional

    Raises
    ------
    TypeError
        ``cuda_graph`` is not a CUDAGraph, or ``stream`` not a Stream.
    """

    #: The side stream captures use when no stream is given (created on first use).
    default_capture_stream: _streams.Stream | None = None

    def __init__(self, cuda_graph: CUDAGraph, pool: Any = None,
                 stream: _streams.Stream | None = None, capture_error_mode: str = "global"):
        if not isinstance(cuda_graph, CUDAGraph):
            raise TypeError(f"graph(): cuda_graph must be a cudalab.CUDAGraph, got "
                            f"{type(cuda_graph).__name__}")
        if stream is not None and not isinstance(stream, _streams.Stream):
            raise TypeError(f"graph(): stream must be a cudalab.Stream, got "
                            f"{type(stream).__name__}")
        capture_mode(capture_error_mode)
        if stream is None:
            if graph.default_capture_stream is None:
                graph.default_capture_stream = _streams.Stream()
            stream = graph.default_capture_stream
        self.cuda_graph = cuda_graph
        self.pool: tuple[Any, ...] = () if pool is None else (pool,)
        self.capture_stream = stream
        self.capture_error_mode = capture_error_mode
        self._stream_ctx = _streams.stream(stream)

    def __enter__(self) -> None:
        from cudalab.memory import empty_cache

        _devices.synchronize()
        empty_cache()
        # A safe point: a Ctrl-C that came during the waits above is raised now, before the
        # capture begins (later ones come in the block, whose exit ends the capture).
        _interrupts.deliver_owed()
        self._stream_ctx.__enter__()
        try:
            self.cuda_graph.capture_begin(self.pool[0] if self.pool else None,
                                          capture_error_mode=self.capture_error_mode)
        except BaseException:
            self._stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            self.cuda_graph.capture_end()
        except BaseException as end_error:
            if exc is None:
                raise
            exc.add_note(f"(the capture was abandoned: capture_end() raised {end_error})")
        finally:
            self._stream_ctx.__exit__(None, None, None)
