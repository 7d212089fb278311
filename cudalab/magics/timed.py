"""``%%cuda_timed`` / ``%cuda_timed``: GPU time from CUDA events, next to host time.

How a measurement is built (the pitfalls it avoids are in ``docs/magics.md``):

* **Compile once.** The cell goes through IPython's input transforms and AST transformers and
  is compiled once, as ``%%time``/``%%timeit`` do. In repeat mode the body is placed in a
  loop inside one function (IPython's timeit template), and the repeats loop inside that
  function too, so it is never re-executed from source (CuPy's ``%gpu_timeit`` re-``exec``s
  the cell every repeat and inflates small times by several x) and a repeat costs no
  Python call of its own beyond the ``end`` hook.
* **Events on the streams that did the work.** A start event is recorded on the current
  stream of every timed device before the body and an end event after it: cudalab's, or
  torch's (``torch.cuda.current_stream()``) or CuPy's current stream where that is another
  stream (read from ``sys.modules``; see ``timed_context.library_streams``). Streams other
  than the current one that cudalab kernels were launched on (seen through
  :data:`cudalab._internal.launch_observers`) get events too, and a device's time is the
  latest end minus the earliest start: the streams are joined when the events are read,
  without adding any dependency between them.
* **Shared boundaries, one record per repeat.** When nothing untimed runs between repeats
  (no setup statement, no ``--cold``), repeat j runs from boundary event j to boundary
  event j + 1: R repeats record R + 1 events per stream. Otherwise each repeat has its own
  start event, recorded after the setup/flush. The events are taken from a pool (reused
  across runs) before the loop, in chunks of 8192 repeats.
* **No host sync between repeats, no read in the loop.** The host syncs once, on the last
  end events, then calls ``elapsed_time`` once per repeat and stream. At most two repeats
  are kept in flight by querying the end of repeat k - 2 every few repeats (the stride
  doubles up to 32 while the GPU keeps up, and drops to 1, with a wait outside the host
  clock, when it does not); repeats shorter than the GPU's latency from record to
  completion (an empty body) may have up to 32 in flight (see ``EventTimer``). The
  per-repeat cost of an empty body is one event record, one ``elapsed_time`` and two
  clock reads.
* **Warm-up and auto-ranging** before the measured repeats; ``--max-time`` caps the measured
  phase; the setup statement runs untimed before every repeat (as ``%%timeit``).
* **--cold** writes a buffer of ``cold_flush_factor`` x the device's L2 size (a raw driver
  allocation, invisible to the caching allocator's statistics) on the timed stream before
  the start event of every repeat, so the flush is outside the timed region.
* **Context**: NVML SM clock, temperature and power before and after; warnings for a wide
  IQR or a slow outlier; hints for moving clocks and throttling.

``--graph`` is its own mode (:mod:`~cudalab.magics.timed_graph`: the cell eagerly, then
captured once and replayed as a CUDA graph).

The pieces, one concept each: :mod:`~cudalab.magics.timed_options` (the option line),
:mod:`~cudalab.magics.timed_compile` (compiling the cell once),
:mod:`~cudalab.magics.event_timer` (the event pool and the timer loop),
:mod:`~cudalab.magics.kernel_listing` (``--kernels``: launch observer and CUPTI consumer),
:mod:`~cudalab.magics.timed_context` (devices, streams, ``--cold``, NVML, warnings) and
:mod:`~cudalab.magics.result` (the result object and its report). This module runs them.
"""

from __future__ import annotations

import gc
import itertools
import math
import time
from typing import Any

from IPython.core.error import UsageError

from cudalab import _internal
from cudalab.magics import event_timer, kernel_listing, timed_bandwidth, timed_compile, timed_context
from cudalab.magics.kernel_listing import (
    LaunchTracker,
    add_launch_observer,
    cupti_for,
    kernel_report,
    remove_launch_observer,
)
from cudalab.magics.timed_bandwidth import CollectiveWatch
from cudalab.magics.timed_compile import REPEAT_COUNTER, compile_repeat, compile_single
from cudalab.magics.timed_context import TimedContext, clock_hints, nvml_context, stat_warnings
from cudalab.magics.timed_options import TimedOptions, parse_devices, parse_options

__all__ = ["TimedOptions", "parse_options", "run_cuda_timed", "parse_devices"]

_perf = time.perf_counter

# Ctrl-C: the magic's own code (this module and the ones it runs the cell with, whose hooks
# the timing function calls) runs with it deferred, so an interrupt never leaves the event
# pool, the observers or the timer half-updated; the cell's code takes it at once
# (TimedContext.deliver_interrupts_in), so the cell stops where it is.
_internal.defer_interrupts_in([__file__, event_timer.__file__, kernel_listing.__file__,
                               timed_bandwidth.__file__, timed_compile.__file__,
                               timed_context.__file__])


# ------------------------------------------------------------------------------- single
def _run_single(ctx: TimedContext, source: str, setup: str, local_ns: Any) -> Any:
    __tracebackhide__ = True  # noqa: F841 - see run_cuda_timed
    from cudalab.magics.result import CudaTimedResult

    magics, opts = ctx.magics, ctx.opts
    shell = magics.shell
    glob = shell.user_ns
    code, expr_code, tc = compile_single(shell, source)
    ctx.deliver_interrupts_in(code, expr_code)
    if setup:  # cell mode with a statement on the %% line: run it first, untimed
        setup_code, setup_expr, _ = compile_single(shell, setup)
        ctx.deliver_interrupts_in(setup_code, setup_expr)
        exec(setup_code, glob, local_ns)  # noqa: S102 - the user's own code, as %time
        if setup_expr is not None:
            eval(setup_expr, glob, local_ns)  # noqa: S307
    tracker = LaunchTracker(ctx.streams, record=opts.kernels)
    cupti, why = cupti_for(magics, ctx, opts)
    nv_before = nvml_context(ctx.devs) if magics.nvml else {}
    timer = ctx.timer(1, {})
    out = None
    error: BaseException | None = None
    gpu_err: BaseException | None = None
    side_ends: list[tuple[int, Any]] = []
    watch = CollectiveWatch()
    add_launch_observer(tracker)
    watch.__enter__()
    try:
        if cupti is not None and cupti.start():
            tracker.record = False  # CUPTI times every launch: no per-launch events
        t_cpu0 = timer.begin_single()
        try:
            _internal.deliver_owed_interrupt()  # a Ctrl-C that came while setting up
            exec(code, glob, local_ns)  # noqa: S102
            if expr_code is not None:
                out = eval(expr_code, glob, local_ns)  # noqa: S307
        except BaseException as exc:  # KeyboardInterrupt too: report, then re-raise
            error = exc
        t_cpu1 = _perf()
        try:
            timer.end_single()
            for (d, _sid), s in tracker.side.items():
                if d in ctx.streams:
                    ev = ctx.pool.take(d, 1)[0]
                    ev.record(s)
                    side_ends.append((d, ev))
            timer.finish(1)
            for _d, ev in side_ends:
                ev.synchronize()
            for *_launch, ev in tracker.launches:  # --kernels: also on untimed streams
                ev.synchronize()
        except Exception as exc:  # a sticky CUDA error after a failed kernel, a closed stream
            gpu_err = exc
        t_wall1 = _perf()
    finally:
        watch.__exit__()
        remove_launch_observer(tracker)
        if cupti is not None:
            cupti.stop(ctx.devs)
    gpu_row: list[float] = []
    for k, d in enumerate(ctx.devs):
        t = float("nan")
        if gpu_err is None:
            try:
                t = timer.gpu_seconds(k, 0)
                start = timer.start_event(k, 0)
                for dd, ev in side_ends:
                    if dd == d:
                        t = max(t, start.elapsed_time(ev) / 1e3)
            except Exception as exc:
                gpu_err = exc
                t = float("nan")
        gpu_row.append(t)
    if gpu_err is not None:
        ctx.warnings.append(f"the GPU time could not be read: {gpu_err}")
    if tracker.other_devices:
        others = ", ".join(f"cuda:{d}" for d in sorted(tracker.other_devices))
        ctx.warnings.append(f"kernels also ran on {others}, which was not timed (use -d all)")
    nv_after = nvml_context(ctx.devs) if magics.nvml else {}
    clock_hints(nv_before, nv_after, magics, ctx)
    kernels, note = kernel_report(opts, tracker, cupti, why, timer.start_events(0), gpu_err)
    result = CudaTimedResult(
        mode="single", loops=1, repeats=1, warmup=0, devices=tuple(ctx.devs),
        gpu_times=[[t] for t in gpu_row], cpu_times=[t_cpu1 - t_cpu0],
        wall_time=t_wall1 - t_cpu0, cold=bool(ctx.flush), flush_bytes=ctx.flush_bytes,
        kernels=kernels, kernels_note=note, nvml_before=nv_before, nvml_after=nv_after,
        warnings=ctx.warnings, hints=ctx.hints, simulated=ctx.simulated,
        device_names=ctx.device_names(), value=out, compile_time=tc, precision=ctx.precision,
        iqr_warning=magics.iqr_warning, spread_warning=magics.spread_warning)
    result.collective = watch.summary(result.median, 1)
    if error is not None:
        result.warnings.append(f"the cell raised {type(error).__name__}: {error}")
    _publish(magics, opts, result)
    if error is not None and (not opts.no_raise or not isinstance(error, Exception)):
        raise error
    if opts.output:
        return result
    return out



# ------------------------------------------------------------------------------- repeat
def _run_repeat(ctx: TimedContext, setup: str, stmt: str, local_ns: Any, line_mode: bool) -> Any:
    __tracebackhide__ = True  # noqa: F841 - see run_cuda_timed
    from cudalab.magics.result import CudaTimedResult

    magics, opts = ctx.magics, ctx.opts
    shell = magics.shell
    repeat = opts.repeat or magics.repeat
    warmup = magics.warmup if opts.warmup is None else opts.warmup
    max_time = opts.max_time or magics.max_time
    glob = shell.user_ns
    conflict: dict = {}
    if local_ns and line_mode and local_ns is not glob:  # %cuda_timed inside a function
        conflict = {k: glob[k] for k in local_ns if k in glob}
        glob.update(local_ns)
    tracker = LaunchTracker(ctx.streams)
    watch = CollectiveWatch()
    rep = itertools.repeat
    gc_was = gc.isenabled()
    try:
        inner, tc, has_setup = compile_repeat(shell, setup, stmt, glob)
        ctx.deliver_interrupts_in(inner.__code__, inner.once.__code__)
        add_launch_observer(tracker)
        watch.__enter__()
        _internal.deliver_owed_interrupt()  # a Ctrl-C that came while setting up
        if warmup:
            inner.once(1, 0, _perf, _count_to(warmup), rep)
        number = opts.number
        if number is None:
            number = _autorange(ctx, inner, tracker, max_time, magics.min_repeat_time, rep,
                                has_setup)
        # the events of every repeat are taken now, before the loop
        timer = ctx.timer(repeat, tracker.side, shared=not has_setup)
        tracker.new_side = False
        nv_before = nvml_context(ctx.devs) if magics.nvml else {}
        if magics.disable_gc:
            gc.disable()
        interrupted: KeyboardInterrupt | None = None
        timing_fn = inner.once if number == 1 else inner
        try:
            begin, end = timer.loop_hooks(repeat, max_time)
            watch.mark()  # warm-up and auto-ranging calls are not counted
            done = timing_fn(number, 0, begin, end, rep)
        except KeyboardInterrupt as exc:
            timer.abort()
            # Ctrl-C still reports the repeats that finished, then ends the cell as
            # interrupted (as %time does); with no finished repeat there is nothing to report
            done = _repeats_done(exc, timing_fn)
            if not done:
                raise
            interrupted = exc
        except BaseException:
            timer.abort()
            raise
        finally:
            if gc_was:
                gc.enable()
        watch.__exit__()  # the --kernels run below is not counted
        timer.finish(done)
        gpu, cpu = timer.read(done)
        nv_after = nvml_context(ctx.devs) if magics.nvml else {}
        kernels: list[dict] = []
        note = ""
        if opts.kernels and interrupted is None:
            kernels, note = _instrumented_run(magics, ctx, opts, inner, tracker, rep)
    finally:
        watch.__exit__()
        remove_launch_observer(tracker)
        if gc_was and not gc.isenabled():
            gc.enable()
        if conflict:
            glob.update(conflict)
    if interrupted is not None:
        ctx.warnings.append(f"interrupted after {done} repeats (of {repeat}): the statistics "
                            "cover those")
    elif done < repeat:
        ctx.warnings.append(f"stopped after {done} of {repeat} repeats: --max-time "
                            f"{max_time:g} s reached")
    if tracker.new_side:
        ctx.warnings.append("kernels ran on a stream first seen while measuring: its work was "
                            "not timed (give it warm-up runs with -w 1 or more)")
    if tracker.other_devices:
        others = ", ".join(f"cuda:{d}" for d in sorted(tracker.other_devices))
        ctx.warnings.append(f"kernels also ran on {others}, which was not timed (use -d all)")
    result = CudaTimedResult(
        mode="repeat", loops=number, repeats=done, warmup=warmup, devices=tuple(ctx.devs),
        gpu_times=[row / number for row in gpu],
        cpu_times=cpu / number, cold=bool(ctx.flush),
        flush_bytes=ctx.flush_bytes, kernels=kernels, kernels_note=note,
        nvml_before=nv_before, nvml_after=nv_after, warnings=ctx.warnings, hints=ctx.hints,
        simulated=ctx.simulated, device_names=ctx.device_names(), compile_time=tc,
        precision=ctx.precision, iqr_warning=magics.iqr_warning,
        spread_warning=magics.spread_warning)
    result.collective = watch.summary(result.median, done * number)
    stat_warnings(result, magics, ctx)
    clock_hints(nv_before, nv_after, magics, ctx)
    result.warnings, result.hints = list(ctx.warnings), list(ctx.hints)
    _publish(magics, opts, result)
    if interrupted is not None:
        raise interrupted
    if opts.output:
        return result
    return None


def _repeats_done(exc: BaseException, timing_fn: Any) -> int:
    """Measured repeats that finished before ``exc`` left the timing function: its repeat
    counter, read from its frame in the traceback (the loop itself keeps no count)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is timing_fn.__code__:
            j = tb.tb_frame.f_locals.get(REPEAT_COUNTER, 0)
            return max(0, ~j if j < 0 else j)
        tb = tb.tb_next
    return 0


def _count_to(n: int) -> Any:
    """An ``end`` hook that only counts: ``n`` runs of the timing function (warm-up)."""

    def end(j: int, _t0: float) -> int:
        k = j + 1
        return k if k < n else ~k

    return end


def _autorange(ctx: TimedContext, inner: Any, tracker: LaunchTracker, max_time: float,
               target: float, rep: Any, has_setup: bool = False) -> int:
    """Loops per repeat so that one repeat takes >= ``target`` s of wall time (GPU work
    included), doubling at least and growing at most 1000x per step, capped by ``max_time``."""
    target = min(target, max_time / 10.0)
    number = 1
    spent = 0.0
    while True:
        ctx.pool.release(ctx.pool_mark)
        timer = ctx.timer(1, tracker.side, shared=not has_setup)
        t0 = _perf()
        begin, end = timer.loop_hooks(1)
        inner(number, 0, begin, end, rep)
        timer.finish(1)
        took = _perf() - t0
        spent += took
        if took >= target or number >= 10**9 or spent > max_time / 2:
            ctx.pool.release(ctx.pool_mark)
            return number
        guess = number * target / max(took, 1e-9)
        number = _nice_ceil(min(max(guess, number * 2), number * 1000))


def _instrumented_run(magics: Any, ctx: TimedContext, opts: TimedOptions, inner: Any,
                      tracker: LaunchTracker, rep: Any) -> tuple[list[dict], str]:
    """One extra untimed loop with per-launch events (and CUPTI) for ``--kernels``."""
    probe = LaunchTracker(ctx.streams, record=True)
    probe.side = dict(tracker.side)
    cupti, why = cupti_for(magics, ctx, opts)
    timer = ctx.timer(1, tracker.side, flush=False, shared=False)  # start right before the body
    add_launch_observer(probe)
    try:
        if cupti is not None and cupti.start():
            probe.record = False  # CUPTI times every launch: no per-launch events
        begin, end = timer.loop_hooks(1)
        inner(1, 0, begin, end, rep)
        timer.finish(1)
        for *_rest, ev in probe.launches:
            ev.synchronize()
    finally:
        remove_launch_observer(probe)
        if cupti is not None:
            cupti.stop(ctx.devs)
    return kernel_report(opts, probe, cupti, why, timer.start_events(0), None,
                          per=" (one extra run of a single loop)")


def _nice_ceil(x: float) -> int:
    """Smallest 1-2-5 x 10^k number >= x (at least 1)."""
    if x <= 1:
        return 1
    exp = 10 ** int(math.floor(math.log10(x)))
    for m in (1, 2, 5, 10):
        if m * exp >= x:
            return int(m * exp)
    return int(10 * exp)  # pragma: no cover


# ------------------------------------------------------------------------------- output
def _publish(magics: Any, opts: TimedOptions, result: Any) -> None:
    if opts.var:
        magics.shell.user_ns[opts.var] = result
    if opts.quiet:
        return
    from IPython.display import display

    display({"text/plain": result.report(), "text/html": result._repr_html_()}, raw=True)


def run_cuda_timed(magics: Any, line: str, cell: str | None, local_ns: Any) -> Any:
    """The body of ``%cuda_timed`` / ``%%cuda_timed`` (see its docstring)."""
    # IPython's tracebacks skip frames that set this (as its own magics' frames are skipped):
    # an error in the cell shows the user's frames, not the magic's
    __tracebackhide__ = True  # noqa: F841
    opts = parse_options(line or "")
    if cell is None and not opts.stmt:
        raise UsageError("%cuda_timed needs a statement to time (or use %%cuda_timed)")
    if opts.graph:  # its own mode: the cell eagerly next to graph replays
        from cudalab.magics.timed_graph import run_graph_mode

        if cell is None:
            raise UsageError("%cuda_timed --graph times a cell: use %%cuda_timed --graph")
        out = run_graph_mode(magics, opts, cell, opts.stmt, local_ns)
    else:
        ctx = TimedContext(magics, opts)
        try:
            if cell is None:
                if opts.repeat_mode:
                    out = _run_repeat(ctx, "", opts.stmt, local_ns, line_mode=True)
                else:
                    out = _run_single(ctx, opts.stmt, "", local_ns)
            elif opts.repeat_mode:
                out = _run_repeat(ctx, opts.stmt, cell, local_ns, line_mode=False)
            else:
                out = _run_single(ctx, cell, opts.stmt, local_ns)
        finally:
            ctx.close()
    # a Ctrl-C that came while the magic kept its books (deferred there) ends the cell as
    # interrupted, however short its body was
    _internal.deliver_owed_interrupt()
    return out
