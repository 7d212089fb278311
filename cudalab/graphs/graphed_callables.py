"""Graphed callables (``torch.cuda.make_graphed_callables`` without autograd): plain
callables over :class:`~cudalab.array.DeviceArray`\\ s, warmed up, captured once each into a
shared private pool, then replayed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cudalab import devices as _devices
from cudalab import streams as _streams
from cudalab.allocator.pools import graph_pool_handle
from cudalab.array import DeviceArray
from cudalab.graphs.capture import graph
from cudalab.graphs.cuda_graph import CUDAGraph

__all__ = ["make_graphed_callables"]


def _arrays(value: Any, what: str) -> tuple[DeviceArray, ...]:
    items = value if isinstance(value, tuple) else (value,)
    for i, item in enumerate(items):
        if not isinstance(item, DeviceArray):
            raise TypeError(f"make_graphed_callables: {what} {i} must be a cudalab DeviceArray, "
                            f"got {type(item).__name__}")
    return items


def make_graphed_callables(callables: Any, sample_args: Any, num_warmup_iters: int = 3,
                           pool: Any = None) -> Any:
    """Graphed versions of plain callables over DeviceArrays (``torch.cuda.make_graphed_callables``
    without autograd).

    Each callable is warmed up ``num_warmup_iters`` times on a side stream, then captured once
    with its sample arguments as the static input buffers, all captures sharing one private
    pool. The returned callable copies its arguments into the static inputs (an argument
    that *is* the static input is not copied), replays the graph and returns the static
    outputs (the same arrays every call: copy them to keep a result past the next call).

    Differences from torch: there is no autograd here, so only the forward pass is captured
    (torch also captures the backward pass and returns ``torch.autograd.Function``\\ s or
    modules); the callables must take and return DeviceArrays (one, or a tuple), with no
    keyword arguments; ``allow_unused_input`` and ``capture_error_mode`` are not offered.
    As in torch, graphs sharing the pool must be replayed in the order they were captured.

    Parameters
    ----------
    callables : callable or tuple of callables
    sample_args : tuple of DeviceArray, or a tuple of such tuples (one per callable)
    num_warmup_iters : int, optional
        Eager calls before the capture (kernels compile and load there), default 3.
    pool : tuple of (int, int), MemPool or None, optional
        The private pool to share (default: a new :func:`graph_pool_handle`).

    Returns
    -------
    callable or tuple of callables
        In the shape of ``callables``.

    Raises
    ------
    TypeError
        A callable that is not callable, an argument or output that is not a DeviceArray.
    ValueError
        ``num_warmup_iters`` negative, or as many argument tuples as callables missing; a
        call of a graphed callable with arguments of other shapes or dtypes.
    """
    single = not isinstance(callables, tuple)
    fns: Sequence[Callable[..., Any]] = (callables,) if single else callables
    args_list = (sample_args,) if single else sample_args
    if not isinstance(args_list, tuple) or len(args_list) != len(fns):
        raise ValueError(f"make_graphed_callables: sample_args must hold one tuple of arguments "
                         f"per callable ({len(fns)})")
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int):
        raise TypeError(f"num_warmup_iters must be an int, got {type(num_warmup_iters).__name__}")
    if num_warmup_iters < 0:
        raise ValueError(f"num_warmup_iters must be >= 0, got {num_warmup_iters}")
    statics = []
    for i, (fn, args) in enumerate(zip(fns, args_list, strict=True)):
        if not callable(fn):
            raise TypeError(f"make_graphed_callables: callables[{i}] is not callable")
        statics.append(_arrays(args, f"sample_args[{i}] item"))
    mempool = graph_pool_handle() if pool is None else pool
    _devices.synchronize()
    side = _streams.Stream()
    side.wait_stream(_streams.current_stream())
    with _streams.stream(side):
        for _ in range(num_warmup_iters):
            for fn, args in zip(fns, statics, strict=True):
                fn(*args)
    _streams.current_stream().wait_stream(side)
    graphed = []
    for fn, args in zip(fns, statics, strict=True):
        g = CUDAGraph()
        with graph(g, pool=mempool, stream=side):
            out = fn(*args)
        outputs = _arrays(out, "output")
        graphed.append(_graphed(g, args, out, outputs))
    return graphed[0] if single else tuple(graphed)


def _graphed(g: CUDAGraph, static_inputs: tuple[DeviceArray, ...], result: Any,
             outputs: tuple[DeviceArray, ...]) -> Callable[..., Any]:
    shapes = [(a.shape, a.dtype) for a in static_inputs]

    def replay(*args: DeviceArray) -> Any:
        if len(args) != len(static_inputs):
            raise ValueError(f"graphed callable takes {len(static_inputs)} arguments, got "
                             f"{len(args)}")
        for i, (a, static) in enumerate(zip(args, static_inputs, strict=True)):
            if a is static:
                continue
            if not isinstance(a, DeviceArray) or (a.shape, a.dtype) != shapes[i]:
                raise ValueError(f"graphed callable: argument {i} must be a DeviceArray of "
                                 f"shape {shapes[i][0]} and dtype {shapes[i][1]}")
            static.copy_(a)
        g.replay()
        return result

    replay.graph = g  # type: ignore[attr-defined]
    replay.outputs = outputs  # type: ignore[attr-defined]
    return replay
