"""Stream capture and CUDA graphs over ``cuda.bindings.driver``: :class:`CudaGraphs`.

The graph concern of the real backend (a mixin of :class:`cudalab._driver.cuda.CudaBackend`):
cuStreamBeginCapture / EndCapture / GetCaptureInfo, cuThreadExchangeStreamCaptureMode,
cuEventRecordWithFlags (external event-record nodes),
cuGraphInstantiate (torch's flags), cuGraphLaunch, the node kinds and cuGraphDebugDotPrint.
Failures of the capture rules arrive as :class:`cudalab.errors.StreamCaptureError`
(``cuda_error`` maps codes 900-908 to it).

While a capture begun here runs, :attr:`CudaMemory._captures_active` is non-zero, so
``cuMemAlloc`` runs under a RELAXED guard the way torch's allocator does it.
"""

from __future__ import annotations

import threading
from typing import Any

from cudalab._driver.base import (
    CAPTURE_MODE_GLOBAL,
    CAPTURE_MODE_RELAXED,
    CAPTURE_STATUS_NONE,
    GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH,
    GRAPH_INSTANTIATE_USE_NODE_PRIORITY,
    GRAPH_NODE_KINDS,
)
from cudalab._driver.cuda_api import (
    CaptureMode,
    check,
    cuda_error,
    cuThreadExchangeStreamCaptureMode,
    drv,
)
from cudalab._driver.cuda_memory import CudaMemory
from cudalab._driver.handles import EventHandle, GraphExecHandle, GraphHandle, StreamHandle

#: cuGraphDebugDotPrint's CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE (torch's cudaGraphDebugDotFlagsVerbose).
_DOT_FLAGS_VERBOSE = 1

_count_lock = threading.Lock()
#: Bound once: CUDAGraph.replay's one driver call (benchmarks/graphs.py, the replay row).
_cuGraphLaunch: Any = drv.cuGraphLaunch if drv is not None else None


def _mode(mode: int) -> Any:
    m = int(mode)
    if m not in (CAPTURE_MODE_GLOBAL, 1, CAPTURE_MODE_RELAXED):
        raise ValueError(f"unknown stream capture mode {m}; expected 0 (global), "
                         "1 (thread_local) or 2 (relaxed)")
    return CaptureMode(m)


class CudaGraphs(CudaMemory):
    """Stream capture and graphs of the real backend (see the module docstring)."""

    def stream_begin_capture(self, stream: StreamHandle, mode: int = CAPTURE_MODE_GLOBAL) -> None:
        m = _mode(mode)
        with _count_lock:
            self._captures_active += 1
        try:
            check(drv.cuStreamBeginCapture(stream, m), "cuStreamBeginCapture")
        except BaseException:
            with _count_lock:
                self._captures_active -= 1
            raise

    def stream_end_capture(self, stream: StreamHandle) -> GraphHandle:
        err, graph = drv.cuStreamEndCapture(stream)
        # Every outcome ends the capture, 908 (another thread ended a GLOBAL or THREAD_LOCAL
        # capture) included: torch sees the stream no longer capturing after it.
        with _count_lock:
            self._captures_active = max(0, self._captures_active - 1)
        return check((err, graph), "cuStreamEndCapture")

    def event_record_with_flags(self, event: EventHandle, stream: StreamHandle,
                                flags: int) -> None:
        check(drv.cuEventRecordWithFlags(event, stream, int(flags)), "cuEventRecordWithFlags")

    def stream_capture_info(self, stream: StreamHandle) -> tuple[int, int]:
        res = check(drv.cuStreamGetCaptureInfo(stream), "cuStreamGetCaptureInfo")
        status = int(res[0])
        return status, (int(res[1]) if status != CAPTURE_STATUS_NONE else 0)

    def thread_exchange_capture_mode(self, mode: int) -> int:
        old = check(cuThreadExchangeStreamCaptureMode(_mode(mode)),
                     "cuThreadExchangeStreamCaptureMode")
        return int(old)

    def graph_instantiate(self, graph: GraphHandle,
                          flags: int = GRAPH_INSTANTIATE_AUTO_FREE_ON_LAUNCH
                          | GRAPH_INSTANTIATE_USE_NODE_PRIORITY) -> GraphExecHandle:
        return check(drv.cuGraphInstantiate(graph, int(flags)), "cuGraphInstantiate")

    def graph_launch(self, graph_exec: GraphExecHandle, stream: StreamHandle) -> None:
        err = _cuGraphLaunch(graph_exec, stream)[0]
        if err:
            raise cuda_error(err, "cuGraphLaunch")

    def graph_destroy(self, graph: GraphHandle) -> None:
        check(drv.cuGraphDestroy(graph), "cuGraphDestroy")

    def graph_exec_destroy(self, graph_exec: GraphExecHandle) -> None:
        check(drv.cuGraphExecDestroy(graph_exec), "cuGraphExecDestroy")

    def graph_node_count(self, graph: GraphHandle) -> int:
        return int(check(drv.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[1])

    def graph_node_kinds(self, graph: GraphHandle) -> list[str]:
        _nodes, count = check(drv.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
        if not count:
            return []
        nodes, count = check(drv.cuGraphGetNodes(graph, int(count)), "cuGraphGetNodes")
        kinds = []
        for node in list(nodes)[:int(count)]:
            t = int(check(drv.cuGraphNodeGetType(node), "cuGraphNodeGetType"))
            kinds.append(GRAPH_NODE_KINDS[t] if 0 <= t < len(GRAPH_NODE_KINDS) else f"type {t}")
        return kinds

    def graph_debug_dot_print(self, graph: GraphHandle, path: str) -> None:
        check(drv.cuGraphDebugDotPrint(graph, str(path).encode(), _DOT_FLAGS_VERBOSE),
               "cuGraphDebugDotPrint")
