"""IPython extension: ``%load_ext cudalab``, ``%%cuda_timed``, ``%cuda_memory`` and ``%%cuda_sanitize``.

::

    %load_ext cudalab

    %%cuda_timed                      # runs the cell once, like %%time, with GPU time
    y = f(x)
    y

    %%cuda_timed -r 7 x = make_input()    # repeat mode: setup line untimed, auto-ranged loops
    f(x)

    %cuda_memory                      # the allocator's state (HTML in notebooks)
    %cuda_memory watch on --threshold 1MiB

    %%cuda_sanitize                   # unsynchronized cross-stream accesses of the cell

Options of the magics are traitlets of :class:`CudaLabMagics`, settable with
``%config CudaLabMagics.repeat = 10`` or in ``ipython_config.py``
(``c.CudaLabMagics.repeat = 10``). See ``docs/magics.md``.

Loading imports neither numpy nor the driver bindings and does not initialise CUDA (the
extension loads on machines without a GPU); the timing and memory code is imported on the
first use of a magic. ``%unload_ext cudalab`` removes every hook, stops the watch and any
peak scopes, closes the live dashboards (their sampler threads stop), frees the L2 flush
buffers and unregisters the magics; loading twice on one shell is a no-op.
"""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.magic import (
    Magics,
    cell_magic,
    line_cell_magic,
    line_magic,
    magics_class,
    needs_local_scope,
    no_var_expand,
    output_can_be_silenced,
)
from traitlets import Bool, Float, Int

__all__ = ["CudaLabMagics", "load_ipython_extension", "unload_ipython_extension"]


@magics_class
class CudaLabMagics(Magics):
    """cudalab's magics; every trait below is settable with ``%config CudaLabMagics.<name>``."""

    # ----------------------------------------------------------------- %%cuda_timed
    repeat = Int(7, help="Repeats measured in repeat mode when -r is not given.").tag(config=True)
    warmup = Int(1, help="Warm-up runs (untimed) in repeat mode when -w is not given.").tag(config=True)
    min_repeat_time = Float(
        0.2, help="Loops per repeat grow (auto-ranging) until one repeat takes this many "
                  "seconds (when -n is not given).").tag(config=True)
    max_time = Float(
        10.0, help="Seconds the measured repeats may take in all (the default of --max-time); "
                   "repeat mode stops early (after at least one repeat) past it.").tag(config=True)
    precision = Int(3, help="Significant digits of the printed times.").tag(config=True)
    iqr_warning = Float(
        0.10, help="Warn when the interquartile range exceeds this fraction of the median.").tag(config=True)
    spread_warning = Float(
        4.0, help="Warn when the slowest repeat takes more than this many times the fastest.").tag(config=True)
    cold_flush_factor = Float(
        2.0, help="--cold writes a buffer of this many times the device's L2 size before "
                  "each repeat.").tag(config=True)
    nvml = Bool(True, help="Read SM clock, temperature and power from NVML before and after "
                           "timing.").tag(config=True)
    clock_hint_threshold = Float(
        0.05, help="Hint about clock locking when the SM clock moved by more than this "
                   "fraction during the measurement.").tag(config=True)
    disable_gc = Bool(True, help="Disable Python's garbage collector while repeats are "
                                 "measured (as %timeit).").tag(config=True)
    cupti = Bool(True, help="--kernels uses CUPTI (the optional cupti-python package) to list "
                            "every library's kernels, memcpys and memsets when it can; False "
                            "lists cudalab's own launches only.").tag(config=True)

    # ----------------------------------------------------------------- %cuda_memory watch
    watch_threshold = Int(
        0, help="The default --threshold of '%cuda_memory watch on', in bytes; a cell's line is "
                "printed only when the absolute Δallocated, Δreserved or its peak above the "
                "start reaches it, and 0 prints every cell.").tag(config=True)
    watch_sync = Bool(
        True, help="'%cuda_memory watch' waits for the cell's GPU work to report its GPU time; "
                   "when False the time is shown only if the work already finished.").tag(config=True)

    def __init__(self, shell: Any = None, **kwargs: Any):
        super().__init__(shell=shell, **kwargs)
        self._closed = False
        self._event_pool: Any = None  # event_timer.EventPool, made on first use
        self._flush: Any = None  # timed_context._FlushBuffers
        self._memory: Any = None  # memory.MemoryState
        self._dashboards: list[Any] = []
        self._hooks: list[tuple[str, Any]] = []
        if shell is not None:
            self._add_hook("pre_run_cell", self._tag_cell)

    # ----------------------------------------------------------------- hooks
    def _add_hook(self, event: str, fn: Any) -> None:
        shell: Any = self.shell  # set: IPython constructs magics with their shell
        shell.events.register(event, fn)
        self._hooks.append((event, fn))

    def _remove_hook(self, event: str, fn: Any) -> None:
        try:
            shell: Any = self.shell
            shell.events.unregister(event, fn)
        except ValueError:
            pass
        try:
            self._hooks.remove((event, fn))
        except ValueError:
            pass

    def _tag_cell(self, info: Any = None) -> None:
        """pre_run_cell: name the cell in the allocator history (only if it is loaded)."""
        hist = sys.modules.get("cudalab.memory_tools.history")
        if hist is not None:
            cell_id = getattr(info, "cell_id", None)
            if not cell_id:
                from cudalab.magics.timed_compile import running_cell_number

                cell_id = f"In[{running_cell_number(self.shell)}]"
            hist.set_current_cell(cell_id)

    # ----------------------------------------------------------------- magics
    @no_var_expand
    @needs_local_scope
    @line_cell_magic
    @output_can_be_silenced
    def cuda_timed(self, line: str = "", cell: str | None = None, local_ns: Any = None) -> Any:
        """Time GPU work: CUDA events on the current stream(s) next to host time.

        Usage, single-run mode (no -n/-r/-w/--max-time): the cell runs once, exactly like
        ``%%time`` (IPython transforms, compiled once, the last expression is the cell's
        output, exceptions propagate)::

          %%cuda_timed [options] [setup statement]
          %cuda_timed [options] statement

        Repeat mode (any of -n, -r, -w, --max-time): the setup statement (the rest of the
        ``%%`` line) runs untimed before every repeat; the body is compiled once into a
        loop and never re-executed from source; without -n the loops per repeat grow until
        one repeat takes ``CudaLabMagics.min_repeat_time`` (0.2 s)::

          %%cuda_timed -r 7 -w 2 x = cudalab.zeros(1 << 20)
          step(x)

        A trailing ``# comment`` on the magic's line is a comment, not a statement. Ctrl-C
        in repeat mode reports the repeats that finished, then interrupts the cell.

        Options:
          -n N             loops per repeat (default: auto-range)
          -r R             repeats (default CudaLabMagics.repeat = 7)
          -w W             warm-up runs before measuring (default CudaLabMagics.warmup = 1)
          --max-time S     stop measuring after S seconds in all (default 10)
          --cold           flush L2 (a buffer sized from the device's L2) before every
                           repeat, outside the timed events
          -d, --device D   device(s) to time: 0, cuda:1, 0,1 or all (default: current)
          --kernels        list the kernels the cell launched with their GPU times
                           (CUPTI when cupti-python is installed: every library's kernels,
                           memcpys and memsets; cudalab's own kernels otherwise)
          -o               return a CudaTimedResult
          -v VAR           store the CudaTimedResult in VAR
          -q               quiet: print nothing
          -p P             significant digits (default 3)
          --no-raise-error  single mode: report an exception instead of re-raising it
          --graph          run the cell eagerly, then capture it once into a CUDA graph and
                           replay it (-r iterations each, default 50; -w warm-up runs,
                           default 3): both times, the launches per replay, the host time
                           saved per iteration and whether the graph pays off; a cell that
                           cannot be captured names the operation that broke the capture

        Statistics: median, IQR, min, max and count of the GPU time per loop, with warnings
        when IQR/median > 10 % or max > 4x min, and the SM clock, temperature and power
        before and after (NVML), with a hint when the clock moved.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame above the user's
        from cudalab import _internal
        from cudalab.magics.timed import run_cuda_timed

        out = run_cuda_timed(self, line, cell, local_ns)
        # The last safe point, outside the magic's deferring code: a Ctrl-C that came while
        # run_cuda_timed returned (after its own safe point) ends the cell here, inside it,
        # rather than whenever the helper thread next trips SIGINT, which may be in IPython's
        # post-execute callbacks, where IPython catches it ("Error in callback") and the press
        # is lost.
        _internal.deliver_owed_interrupt()
        return out

    @no_var_expand
    @needs_local_scope
    @cell_magic
    def cuda_sanitize(self, line: str = "", cell: str = "", local_ns: Any = None) -> Any:
        """Run the cell under the stream sanitizer (:mod:`cudalab.sanitizer`).

        Usage::

          %%cuda_sanitize [-q] [-v VAR]

        Shows every unsynchronized cross-stream access, host read of unfinished work and
        unsafe reuse the cell made as an HTML table (text in a terminal), or "no
        unsynchronized access found" with the number of accesses checked. The cell's last
        expression is its output; its exceptions propagate after the findings are shown.

        Options:
          -v VAR   store the cudalab.sanitizer.Session in VAR
          -q       show nothing
        """
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame above the user's
        from cudalab.magics.sanitize import run_cuda_sanitize

        return run_cuda_sanitize(self, line, cell, local_ns)

    @line_magic
    def cuda_memory(self, line: str = "") -> Any:
        """GPU memory of cudalab's caching allocator, and of torch's and CuPy's.

        Usage::

          %cuda_memory [summary] [-d DEV]   the allocator state (HTML table in notebooks)
          %cuda_memory stats [-d DEV]       torch's memory_stats() as a DataFrame, one row per device
          %cuda_memory pools [-d DEV]       private pools (CUDA graphs, MemPool): id, kind, use
                                            count, reserved, allocated (also in the summary)
          %cuda_memory mark [-d DEV]        remember the state (and start a scoped peak)
          %cuda_memory diff [-d DEV]        what changed since the mark, with the peak since it
          %cuda_memory reset-peaks [-d DEV] reset the allocator's peak statistics (global!)
          %cuda_memory empty-cache          release cached, unused memory to the driver
          %cuda_memory watch on [--threshold BYTES] [-d DEV] [--source SRC]
                                            after every cell, one line per allocator:
                                            Δallocated, Δreserved, the peak inside the cell
                                            (nobody's max_memory_allocated is reset) and GPU
                                            time
          %cuda_memory watch off
          %cuda_memory history start [--max-entries N] [--context C] [--stacks S]
                                            record every allocator's history; C: state,
                                            alloc, all (default) or none; S: python, all
                                            (default) or none
          %cuda_memory history stop         stop recording (what was recorded stays readable)
          %cuda_memory history save PATH    .csv, .parquet, .json (Perfetto) or a memory_viz
                                            pickle
          %cuda_memory history frame        the recorded history as a DataFrame
          %cuda_memory snapshot             the snapshot viewer of the live allocator
          %cuda_memory snapshot dict        the snapshot dict (torch's _snapshot() schema)
          %cuda_memory snapshot PATH        write the snapshot to PATH (a memory_viz pickle)
          %cuda_memory snapshot view [PATH] the snapshot viewer widget (live, or of a pickle)
          %cuda_memory explore [PATH [PATH2]]
                                            the snapshot explorer (gigabyte traces, the live
                                            set at a moment, search): of the recorded
                                            history, of a pickle, or the diff of two
          %cuda_memory dashboard [-d DEV]   the live dashboard (cudalab.widgets.MemoryDashboard)
          %cuda_memory why [-d DEV]         why the session's last out-of-memory error happened
                                            (cudalab.memory.explain_oom): verdict, accounting,
                                            who holds the largest arrays, allocation sites, and
                                            replays under other settings; without an error,
                                            the device now
          %cuda_memory why release          drop the disposable references it found (Out[...],
                                            _, the last traceback)
          %cuda_memory why forget           forget the last out-of-memory error
          %cuda_memory cluster DIR [JOB]    every rank publishing into DIR (CUDALAB_CLUSTER):
                                            cudalab.widgets.ClusterDashboard

        watch, history, snapshot and dashboard take --source SRC, the allocator the view
        reads: cudalab, torch, cupy, process (the process's memory no allocator accounts
        for, from NVML) or auto (the default: every allocator present in the process, each
        labelled; for a snapshot or trace, torch's when the process runs torch and cudalab
        holds nothing). history records only the allocator named (default cudalab; --source
        torch drives torch's _record_memory_history; --source cupy records CuPy's pool with
        CuPy's memory hooks, on this thread, and snapshot, what-if and frame --source cupy
        read that recording). --source process has no snapshot or history (NVML keeps no
        per-allocation records). torch and CuPy are read only when imported. BYTES accepts units: 1048576, 1MiB, 64 KiB, 1.5GB. Python variables expand as in
        other line magics: %cuda_memory snapshot {path}. A ``#`` that starts a word (outside
        quotes) starts a comment: %cuda_memory snapshot  # the viewer.
        """
        from cudalab.magics.memory import run_cuda_memory

        return run_cuda_memory(self, line)

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        """Remove hooks, stop scopes and recordings the magics started, free buffers and the
        cached NCCL cliques of :mod:`cudalab.nccl` (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for event, fn in list(self._hooks):
            self._remove_hook(event, fn)
        if self._memory is not None:
            try:
                self._memory.close()
            except Exception:
                pass
        for dash in self._dashboards:
            try:
                dash.close()
            except Exception:
                pass
        self._dashboards.clear()
        widgets = sys.modules.get("cudalab.widgets")
        if widgets is not None and hasattr(widgets, "close_all"):
            try:
                widgets.close_all()  # every live dashboard's sampler thread
            except Exception:
                pass
        if self._flush is not None:
            try:
                self._flush.free()
            except Exception:
                pass
        hist = sys.modules.get("cudalab.memory_tools.history")
        if hist is not None:
            hist.set_current_cell(None)
        nccl = sys.modules.get("cudalab.nccl")  # only if the session used collectives
        if nccl is not None and hasattr(nccl, "destroy_communicators"):
            try:
                nccl.destroy_communicators()  # the cached single-process cliques
            except Exception:
                pass


_instances: dict[int, CudaLabMagics] = {}


def _loaded(ip: Any) -> CudaLabMagics | None:
    m = _instances.get(id(ip))
    if m is not None and m.shell is ip and not m._closed:
        return m
    return None


def load_ipython_extension(ipython: Any) -> CudaLabMagics:
    """Register cudalab's magics on ``ipython`` (a second call on the same shell does nothing)."""
    existing = _loaded(ipython)
    if existing is not None:
        return existing
    magics = CudaLabMagics(shell=ipython)
    ipython.register_magics(magics)
    _instances[id(ipython)] = magics
    from cudalab import _internal

    _internal.install_interrupts()  # (once per shell: hooks it if a former unload took it off)
    from cudalab.oom import session

    session.watch(ipython)  # out-of-memory errors of failed cells, for %cuda_memory why
    return magics


def unload_ipython_extension(ipython: Any) -> None:
    """Undo :func:`load_ipython_extension` (idempotent): hooks, watch, peak scopes, history
    started by the magic, flush buffers and the magics themselves. IPython's callbacks end as
    they were before ``%load_ext``: the Ctrl-C wrapper's ``pre_run_cell`` callback goes too
    when loading the extension registered it (``%load_ext cudalab`` in a shell that had not
    imported cudalab), and stays when it was there before."""
    magics = _instances.pop(id(ipython), None)
    if magics is None or magics.shell is not ipython:
        return
    magics.close()
    from cudalab import _internal

    _internal.unhook_interrupts_from(ipython)
    from cudalab.magics.memory_why import forget_magics
    from cudalab.oom import session

    session.unwatch(ipython)
    forget_magics(magics)
    manager = getattr(ipython, "magics_manager", None)
    if manager is not None:
        for kind, table in magics.magics.items():
            live = manager.magics.get(kind, {})
            for name, fn in table.items():
                if live.get(name) == fn:
                    del live[name]
        registry = getattr(manager, "registry", None)
        if registry is not None and dict.get(registry, type(magics).__name__) is magics:
            dict.pop(registry, type(magics).__name__)
    configurables = getattr(ipython, "configurables", None)
    if configurables is not None:
        while magics in configurables:
            configurables.remove(magics)
