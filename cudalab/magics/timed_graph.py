"""``%%cuda_timed --graph``: the cell run eagerly and replayed as a CUDA graph, side by side.

The cell is compiled once and warmed up (``-w``, default :data:`GRAPH_WARMUP`) on a side
stream; ``-r`` iterations (default :data:`GRAPH_REPEATS`) run it eagerly, then it is captured
once into a :class:`cudalab.CUDAGraph` (with :class:`cudalab.graph`, on the same stream) and
``-r`` replays run. Each phase is timed with two events around all its iterations (the
device's time per iteration, which includes the gaps while the host is still launching) and
with the host clock around each iteration (the host's cost). The report gives both, the
launches per replay (the graph's kernel nodes), the host time a replay saves per iteration
and whether the graph pays off (on a GPU only: the simulator's device times are simulated,
so it gives no verdict). A cell that cannot be captured is reported with the
operation that broke the capture (its eager timing is still shown).

Only the public API and :mod:`cudalab._internal` are used.
"""

from __future__ import annotations

import html
import statistics
import time
from typing import Any

from IPython.core.error import UsageError

import cudalab
from cudalab import _internal
from cudalab.magics.timed_compile import compile_single

__all__ = ["GRAPH_REPEATS", "GRAPH_WARMUP", "GraphTimedResult", "run_graph_mode"]

#: Iterations per phase (eager, replay) unless ``-r`` says otherwise.
GRAPH_REPEATS = 50
#: Eager warm-up runs before the eager phase and the capture (kernels load there).
GRAPH_WARMUP = 3
#: The graph pays off when a replay takes at most this fraction of an eager iteration.
PAYS_OFF_RATIO = 0.95
#: Options of %%cuda_timed that --graph does not combine with.
_INCOMPATIBLE = {"cold": "--cold", "kernels": "--kernels", "device": "-d", "number": "-n",
                 "max_time": "--max-time", "no_raise": "--no-raise-error"}

_perf = time.perf_counter


class GraphTimedResult:
    """What ``%%cuda_timed --graph`` measured (``-o`` returns it, ``-v VAR`` stores it).

    Times are seconds per iteration: ``eager_time`` / ``graph_time`` on the device (event to
    event over all iterations, divided by their number), ``eager_host`` / ``graph_host`` the
    median host time of one iteration. ``launches`` counts the graph's kernel nodes (the
    launches one replay makes), ``nodes`` all its nodes. When the capture failed,
    ``capture_error`` says why and the graph fields are None.
    """

    def __init__(self, *, repeats: int, warmup: int, eager_time: float, eager_host: float,
                 graph_time: float | None, graph_host: float | None, launches: int | None,
                 nodes: int | None, capture_error: str | None, device_name: str,
                 simulated: bool, precision: int):
        self.repeats = repeats
        self.warmup = warmup
        self.eager_time = eager_time
        self.eager_host = eager_host
        self.graph_time = graph_time
        self.graph_host = graph_host
        self.launches = launches
        self.nodes = nodes
        self.capture_error = capture_error
        self.device_name = device_name
        self.simulated = simulated
        self.precision = precision

    @property
    def host_saved(self) -> float | None:
        """Host seconds a replay saves per iteration (eager host time - replay host time)."""
        if self.graph_host is None:
            return None
        return self.eager_host - self.graph_host

    @property
    def speedup(self) -> float | None:
        """Eager time per iteration / replay time per iteration (device clock); None on the
        simulator (its device times are simulated: no ratio of them means anything)."""
        if self.simulated or self.graph_time is None or self.graph_time <= 0:
            return None
        return self.eager_time / self.graph_time

    @property
    def pays_off(self) -> bool | None:
        """Whether a replay is faster than an eager iteration (by 5 % or more); None on the
        simulator, which gives no verdict from simulated times."""
        if self.simulated:
            return None
        return self.graph_time is not None and \
            self.graph_time <= PAYS_OFF_RATIO * self.eager_time

    def _t(self, seconds: float) -> str:
        return _internal.format_time(seconds, self.precision)

    def report(self) -> str:
        """The text report."""
        where = f"{self.device_name}{', simulated' if self.simulated else ''}"
        lines = [f"%%cuda_timed --graph on {where}: {self.repeats} iterations each "
                 f"(after {self.warmup} warm-up runs)",
                 f"  eager:  {self._t(self.eager_time)} per iteration "
                 f"(host {self._t(self.eager_host)})"]
        if self.capture_error is not None:
            lines.append(f"  graph:  the cell cannot be captured: {self.capture_error}")
            return "\n".join(lines)
        assert self.graph_time is not None and self.graph_host is not None
        saved = self.host_saved or 0.0
        lines += [f"  graph:  {self._t(self.graph_time)} per replay "
                  f"(host {self._t(self.graph_host)}), {self.launches} kernel launches per "
                  f"replay ({self.nodes} nodes)",
                  f"  host time saved per iteration: {self._t(saved)}" if saved >= 0 else
                  f"  host time lost per iteration: {self._t(-saved)}"]
        speed = self.speedup
        if self.simulated:
            lines.append("  no verdict (the device times are simulated): time the cell on "
                         "a GPU to see whether capturing it pays off")
        elif self.pays_off:
            lines.append(f"  the graph pays off: {speed:.3g}x faster per iteration")
        else:
            ratio = f" ({speed:.3g}x)" if speed is not None else ""
            lines.append(f"  the graph does not pay off for this cell{ratio}: a replay is not "
                         "faster than launching the work eagerly")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.report())}</pre>"

    def __repr__(self) -> str:
        return self.report()


def check_options(opts: Any) -> None:
    """Refuse the options ``--graph`` does not combine with."""
    for attr, flag in _INCOMPATIBLE.items():
        if getattr(opts, attr):
            raise UsageError(f"%cuda_timed: --graph cannot be combined with {flag}")


def _time(fn: Any, repeats: int) -> tuple[float, float]:
    """(device seconds per iteration, median host seconds of one iteration) of ``fn``."""
    start = cudalab.Event(enable_timing=True)
    end = cudalab.Event(enable_timing=True)
    host = []
    start.record()
    for _ in range(repeats):
        t0 = _perf()
        fn()
        host.append(_perf() - t0)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats, statistics.median(host)


def _capture_error(exc: BaseException) -> str:
    operation = getattr(exc, "operation", None)
    if operation:
        return f"{operation} is not allowed in a capture ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


def run_graph_mode(magics: Any, opts: Any, cell: str, setup: str, local_ns: Any) -> Any:
    """The body of ``%%cuda_timed --graph`` (see the module docstring)."""
    __tracebackhide__ = True  # noqa: F841 - an error in the cell shows the user's frames
    check_options(opts)
    shell = magics.shell
    glob = shell.user_ns
    code, expr_code, _tc = compile_single(shell, cell)
    if setup:
        setup_code, setup_expr, _ = compile_single(shell, setup)
        exec(setup_code, glob, local_ns)  # noqa: S102 - the user's own code, as %time
        if setup_expr is not None:
            eval(setup_expr, glob, local_ns)  # noqa: S307

    def body() -> Any:
        exec(code, glob, local_ns)  # noqa: S102
        return eval(expr_code, glob, local_ns) if expr_code is not None else None  # noqa: S307

    repeats = opts.repeat or GRAPH_REPEATS
    warmup = GRAPH_WARMUP if opts.warmup is None else opts.warmup
    caller = cudalab.current_stream()
    side = cudalab.Stream()
    side.wait_stream(caller)
    graph_time = graph_host = None
    launches = nodes = None
    error = None
    with cudalab.stream(side):
        for _ in range(warmup):
            body()
        eager_time, eager_host = _time(body, repeats)
        g = cudalab.CUDAGraph(keep_graph=True)  # kept: node_kinds() reads it
        try:
            with cudalab.graph(g, stream=side):
                body()
        except Exception as exc:  # noqa: BLE001 - reported: the cell cannot be captured
            error = _capture_error(exc)
        if error is None:
            kinds = g.node_kinds()
            launches, nodes = kinds.count("kernel"), len(kinds)
            g.instantiate()
            g.replay()  # first replay: uploads the graph
            graph_time, graph_host = _time(g.replay, repeats)
        g.reset()
    caller.wait_stream(side)
    dev = cudalab.current_device()
    result = GraphTimedResult(
        repeats=repeats, warmup=warmup, eager_time=eager_time, eager_host=eager_host,
        graph_time=graph_time, graph_host=graph_host, launches=launches, nodes=nodes,
        capture_error=error, device_name=f"cuda:{dev} ({cudalab.get_device_name(dev)})",
        simulated=_internal.backend().simulated, precision=opts.precision or 3)
    if opts.var:
        glob[opts.var] = result
    if not opts.quiet:
        from IPython.display import display

        display({"text/plain": result.report(), "text/html": result._repr_html_()}, raw=True)
    return result if opts.output else None
