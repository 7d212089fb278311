"""CUDA graphs with torch's names and semantics (``torch.cuda.graphs``).

:class:`CUDAGraph` captures the work queued on a stream into a driver graph and replays it
with one launch; :class:`graph` is the context manager around a capture;
:func:`is_current_stream_capturing`; :func:`make_graphed_callables` for plain callables over
:class:`~cudalab.array.DeviceArray`\\ s. Pool ids come from :mod:`cudalab.allocator.pools`
(:func:`graph_pool_handle`).

The package: :mod:`~cudalab.graphs.cuda_graph` (:class:`CUDAGraph`, its lifecycle and the
capture-id map), :mod:`~cudalab.graphs.capture` (:class:`graph`,
:func:`is_current_stream_capturing`) and :mod:`~cudalab.graphs.graphed_callables`
(:func:`make_graphed_callables`); this module re-exports their public names.

The lifecycle (torch 2.11's) and what a capture refuses are written on
:mod:`~cudalab.graphs.cuda_graph`.
"""

from __future__ import annotations

from cudalab.allocator.pools import graph_pool_handle
from cudalab.graphs.capture import graph, is_current_stream_capturing
from cudalab.graphs.cuda_graph import (
    CAPTURE_ERROR_MODES,
    INSTANTIATE_FLAGS,
    STATE_CAPTURED,
    STATE_CAPTURING,
    STATE_EMPTY,
    STATE_READY,
    CUDAGraph,
)
from cudalab.graphs.graphed_callables import make_graphed_callables

__all__ = ["CUDAGraph", "graph", "graph_pool_handle", "is_current_stream_capturing",
           "make_graphed_callables", "CAPTURE_ERROR_MODES", "INSTANTIATE_FLAGS", "STATE_EMPTY",
           "STATE_CAPTURING", "STATE_CAPTURED", "STATE_READY"]
