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

The lifecycle is torch 2.11's (``aten/src/ATen/cuda/CUDAGraph.cpp``):

* ``capture_begin``: registers the current device's default generator state, runs every
  registered state's ``capture_prologue`` (outside the capture), refuses the null stream,
  routes the capture's allocations to the graph's private pool
  (``begin_allocate_to_pool`` with a filter on the allocating stream's capture id, before the
  capture begins), then begins the capture on the current stream;
* ``capture_end``: ends the capture on the stream it began on, stops the routing, stores each
  generator state's whole-graph offset increment, warns on an empty graph, and (unless
  ``keep_graph``) instantiates the graph (flags ``AUTO_FREE_ON_LAUNCH | USE_NODE_PRIORITY``)
  and destroys it (kept in debug mode for :meth:`CUDAGraph.debug_dump`);
* ``replay``: each registered generator state's ``replay_prologue`` on the current stream,
  then one graph launch;
* ``reset`` (and garbage collection): destroys the graph and its executable, unregisters the
  generator states and releases the private pool (its memory becomes releasable by
  ``empty_cache()`` once no other graph shares it).

An operation that the capture does not permit (a synchronize, an event or stream query, a
copy to pageable host memory) raises :class:`cudalab.StreamCaptureError` naming it; the
capture is then invalidated, and ending it (``capture_end()``, or leaving the ``with
cudalab.graph(...)`` block, which always ends it) leaves everything ready for the next one.
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
