"""``%%cuda_timed`` / ``%cuda_timed``: GPU time from CUDA events, next to host time.

How a measurement is built (the pitfalls it avoids are in ``docs/magics.md``):

* **Compile once.** The cell goes through IPython's input transforms and AST transformers and
  is compiled once, as ``%%time``/``%%timeit`` do. In repeat mode the body is placed in a
  loop inside one function (IPython's timeit template), so it is never re-executed from
  source (CuPy's ``%gpu_timeit`` re-``exec``s the cell every repeat and inflates small
  times by several x).
* **Events on the streams that did the work.** A start event is recorded on the current
  stream of every timed device before the body and an end event after it. Streams other
  than the current one that cudalab kernels were launched on (seen through
  :data:`cudalab.kernels._launch_observers`) get events too, and a device's time is the
  latest end minus the earliest start: the streams are joined when the events are read,
  without adding any dependency between them.
* **No host sync between repeats.** Each repeat has its own event pair (pooled and reused
  across runs); the host syncs once, on the last end events, then reads every pair. The
  per-repeat cost is two event records and two clock reads.
* **Warm-up and auto-ranging** before the measured repeats; ``--max-time`` caps the measured
  phase; the setup statement runs untimed before every repeat (as ``%%timeit``).
* **--cold** writes a buffer of ``cold_flush_factor`` x the device's L2 size (a raw driver
  allocation, invisible to the caching allocator's statistics) on the timed stream before
  the start event of every repeat, so the flush is outside the timed region.
* **Context**: NVML SM clock, temperature and power before and after; warnings for a wide
  IQR or a slow outlier; hints for moving clocks and throttling.
"""

from __future__ import annotations

import ast
import gc
import itertools
import math
import time
from typing import Any

from IPython.core.error import UsageError

__all__ = ["TimedOptions", "parse_options", "run_cuda_timed", "parse_devices"]

_perf = time.perf_counter


# =============================================================================== options
class TimedOptions:
    """Parsed ``%%cuda_timed`` options; ``stmt`` is the rest of the line (setup or statement)."""

    __slots__ = ("number", "repeat", "warmup", "max_time", "cold", "device", "kernels",
                 "output", "quiet", "precision", "var", "no_raise", "stmt")

    def __init__(self) -> None:
        self.number: int | None = None
        self.repeat: int | None = None
        self.warmup: int | None = None
        self.max_time: float | None = None
        self.cold = False
        self.device: str | None = None
        self.kernels = False
        self.output = False
        self.quiet = False
        self.precision: int | None = None
        self.var: str | None = None
        self.no_raise = False
        self.stmt = ""

    @property
    def repeat_mode(self) -> bool:
        return (self.number is not None or self.repeat is not None or self.warmup is not None
                or self.max_time is not None)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
        return f"TimedOptions({fields})"


_VALUED = {"-n": "number", "--number": "number", "-r": "repeat", "--repeat": "repeat",
           "-w": "warmup", "--warmup": "warmup", "--max-time": "max_time",
           "-d": "device", "--device": "device", "-p": "precision", "--precision": "precision",
           "-v": "var"}
_FLAGS = {"--cold": "cold", "--kernels": "kernels", "-o": "output", "-q": "quiet",
          "--quiet": "quiet", "--no-raise-error": "no_raise"}
_SHORT_FLAGS = {"o": "output", "q": "quiet"}


def _convert(attr: str, opt: str, text: str) -> Any:
    try:
        if attr in ("number", "repeat", "warmup", "precision"):
            value = int(text)
            low = 1 if attr in ("number", "repeat", "precision") else 0
            if value < low:
                raise ValueError
            return value
        if attr == "max_time":
            value = float(text)
            if not value > 0:
                raise ValueError
            return value
    except ValueError:
        kind = "a positive number" if attr == "max_time" else (
            "a non-negative integer" if attr == "warmup" else "a positive integer")
        raise UsageError(f"%cuda_timed: {opt} needs {kind}, got {text!r}") from None
    if attr == "var" and not text.isidentifier():
        raise UsageError(f"%cuda_timed: -v needs a variable name, got {text!r}")
    return text


def parse_options(line: str) -> TimedOptions:
    """Parse the options at the start of ``line``; the first token that is not an option
    starts the statement, which is kept verbatim (``--`` ends the options explicitly)."""
    opts = TimedOptions()
    pos, n = 0, len(line)
    while True:
        while pos < n and line[pos].isspace():
            pos += 1
        if pos >= n or line[pos] != "-":
            break
        end = pos
        while end < n and not line[end].isspace():
            end += 1
        tok = line[pos:end]
        if tok == "--":
            pos = end
            break
        name, eq, inline = tok.partition("=")
        if not eq and tok[:2] in _VALUED and len(tok) > 2 and not tok.startswith("--"):
            name, inline, eq = tok[:2], tok[2:], "="  # -n10
        if name in _VALUED:
            attr = _VALUED[name]
            if eq:
                value, pos = inline, end
            else:
                vs = end
                while vs < n and line[vs].isspace():
                    vs += 1
                ve = vs
                while ve < n and not line[ve].isspace():
                    ve += 1
                if vs >= n:
                    raise UsageError(f"%cuda_timed: option {name} needs a value")
                value, pos = line[vs:ve], ve
            setattr(opts, attr, _convert(attr, name, value))
            continue
        if name in _FLAGS and not eq:
            setattr(opts, _FLAGS[name], True)
            pos = end
            continue
        if (len(tok) > 2 and tok[0] == "-" and tok[1] != "-"
                and all(c in _SHORT_FLAGS for c in tok[1:])):
            for c in tok[1:]:
                setattr(opts, _SHORT_FLAGS[c], True)
            pos = end
            continue
        if len(tok) > 1 and (tok[1].isalpha() or tok[1] == "-"):
            raise UsageError(f"%cuda_timed: unknown option {tok!r} (see %cuda_timed?)")
        break  # "-x + 1", "-1": a statement that starts with a minus sign
    opts.stmt = line[pos:].strip()
    return opts


def parse_devices(spec: str | None) -> list[int]:
    """``None`` -> [current device]; ``"all"``; ``"0"``, ``"cuda:1"``, ``"0,1"``."""
    from cudalab import devices

    if spec is None:
        return [devices.current_device()]
    s = spec.strip().lower()
    if s == "all":
        return list(range(devices.device_count()))
    out: list[int] = []
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            idx = devices._device_index(int(part) if part.isdigit() else part)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"%cuda_timed: bad device {part!r}: {exc}") from None
        if idx not in out:
            out.append(idx)
    if not out:
        raise UsageError(f"%cuda_timed: no device in {spec!r}")
    return out


# =============================================================================== compiling
class _Filler(ast.NodeTransformer):
    """Put the setup and statement bodies into the timing template (IPython's approach)."""

    def __init__(self, setup: list[ast.stmt], stmt: list[ast.stmt]):
        self.setup = setup
        self.stmt = stmt

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:  # noqa: N802 - ast API
        self.generic_visit(node)
        if node.name == "__cudalab_timed_inner":
            node.body[0:1] = self.setup
        return node

    def visit_For(self, node: ast.For) -> ast.AST:  # noqa: N802 - ast API
        self.generic_visit(node)
        if getattr(node.target, "id", None) == "_cl_i":
            node.body = self.stmt
        return node


_TEMPLATE = (
    "def __cudalab_timed_inner(_cl_n, _cl_j, _cl_begin, _cl_end, _cl_repeat):\n"
    "    setup\n"
    "    _cl_begin(_cl_j)\n"
    "    for _cl_i in _cl_repeat(None, _cl_n):\n"
    "        stmt\n"
    "    _cl_end(_cl_j)\n"
)


def _parse(shell: Any, source: str) -> tuple[ast.Module, str]:
    transformed = shell.transform_cell(source)
    name = shell.compile.cache(transformed, shell.execution_count, raw_code=source)
    tree = shell.compile.ast_parse(transformed, filename=name)
    tree = shell.transform_ast(tree)
    return tree, name


def compile_single(shell: Any, source: str) -> tuple[Any, Any, float]:
    """(code for all but a trailing expression, code of that expression or None, seconds)."""
    t0 = _perf()
    tree, name = _parse(shell, source)
    expr = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        expr = ast.Expression(tree.body[-1].value)
        tree.body = tree.body[:-1]
    code = shell.compile(tree, name, "exec")
    expr_code = shell.compile(expr, name, "eval") if expr is not None else None
    return code, expr_code, _perf() - t0


def compile_repeat(shell: Any, setup: str, stmt: str, glob: dict) -> tuple[Any, float]:
    """The timing function ``inner(n, j, begin, end, repeat)`` built around the body."""
    t0 = _perf()
    setup_tree, setup_name = _parse(shell, setup or "pass")
    stmt_tree, stmt_name = _parse(shell, stmt or "pass")
    # Compile each part alone first: code valid only inside the template (a bare "return")
    # must be refused with the user's line numbers (IPython issue 10636).
    shell.compile(setup_tree, setup_name, "exec")
    shell.compile(stmt_tree, stmt_name, "exec")
    tpl = ast.parse(_TEMPLATE)
    setup_body = setup_tree.body or [ast.Pass()]
    stmt_body = stmt_tree.body or [ast.Pass()]
    tree = ast.fix_missing_locations(_Filler(setup_body, stmt_body).visit(tpl))
    code = shell.compile(tree, stmt_name, "exec")
    ns: dict = {}
    exec(code, glob, ns)  # noqa: S102 - the user's own cell, as %timeit does
    return ns["__cudalab_timed_inner"], _perf() - t0


# =============================================================================== GPU helpers
class _EventPool:
    """Timing events per device, reused across runs (creating events costs driver calls)."""

    def __init__(self) -> None:
        self._events: dict[int, list[Any]] = {}
        self._used: dict[int, int] = {}

    def reset(self) -> None:
        self._used.clear()

    def mark(self) -> dict[int, int]:
        """The cursor, to :meth:`release` back to (a nested %cuda_timed takes events beyond
        the outer run's)."""
        return dict(self._used)

    def release(self, mark: dict[int, int]) -> None:
        self._used = dict(mark)

    def take(self, device: int, n: int) -> list[Any]:
        from cudalab.events import Event

        have = self._events.setdefault(device, [])
        start = self._used.get(device, 0)
        while len(have) < start + n:
            ev = Event(enable_timing=True)
            try:
                ev._create(device)  # now, not at the first record inside a timed repeat
            except Exception:
                pass
            have.append(ev)
        self._used[device] = start + n
        return have[start:start + n]

    def trim(self, keep: int = 1 << 15) -> None:
        for events in self._events.values():
            del events[keep:]


class _FlushBuffers:
    """Per-device L2 flush buffers (raw driver allocations, outside the caching allocator)."""

    _SIM_CAP = 4 << 20  # the simulator has no cache: a nominal write keeps tests fast

    def __init__(self) -> None:
        self._bufs: dict[int, tuple[int, int]] = {}  # device -> (ptr, bytes)
        self._value = 0

    def size_for(self, device: int, factor: float) -> int:
        from cudalab import devices

        l2 = int(devices.get_device_properties(device).L2_cache_size or 0)
        if l2 <= 0:
            l2 = 64 << 20
        return max(1 << 20, int(l2 * factor + 4095) // 4096 * 4096)

    def ensure(self, device: int, nbytes: int) -> int:
        from cudalab import devices

        have = self._bufs.get(device)
        if have is not None and have[1] >= nbytes:
            return have[1]
        b = devices._backend()
        if have is not None:
            b.mem_free(device, have[0])
            del self._bufs[device]
        devices._ensure_context(device)
        ptr = b.mem_alloc(device, nbytes)
        self._bufs[device] = (ptr, nbytes)
        return nbytes

    def flush(self, device: int, stream: Any) -> None:
        from cudalab import devices

        ptr, nbytes = self._bufs[device]
        b = devices._backend()
        if b.simulated:
            nbytes = min(nbytes, self._SIM_CAP)
        self._value = (self._value + 1) & 0xFF
        devices._ensure_context(device)
        b.memset_d8_async(device, ptr, self._value, nbytes, stream._handle)

    def free(self) -> None:
        from cudalab import devices

        if not self._bufs or not devices.is_initialized():
            self._bufs.clear()
            return
        b = devices._backend()
        for device, (ptr, _n) in list(self._bufs.items()):
            try:
                b.mem_free(device, ptr)
            except Exception:
                pass
        self._bufs.clear()


class _LaunchTracker:
    """A launch observer: which streams and devices cudalab kernels used, and (``record``)
    an end event after each launch for per-kernel GPU times."""

    def __init__(self, streams: dict[int, Any], record: bool = False, pool: Any = None):
        self.cur = {d: s.cuda_stream for d, s in streams.items()}
        self.side: dict[tuple[int, int], Any] = {}
        self.other_devices: set[int] = set()
        self.new_side = False
        self.record = record
        self.pool = pool
        self.launches: list[tuple] = []

    def __call__(self, name: str, device: int, stream: Any, grid: tuple, block: tuple) -> None:
        cur = self.cur.get(device)
        if cur is None:
            self.other_devices.add(device)
        elif stream.cuda_stream != cur:
            key = (device, stream.cuda_stream)
            if key not in self.side:
                self.side[key] = stream
                self.new_side = True
        if self.record:
            from cudalab.events import Event

            ev = Event(enable_timing=True)
            ev.record(stream)
            self.launches.append((name, device, stream.cuda_stream, grid, block, ev))

    def kernel_table(self, start_events: dict[int, Any]) -> list[dict]:
        """Per (name, device): count and GPU time, each launch timed from the previous marker
        on its stream (the cell's start event on the timed stream, else the previous launch's
        end there; unknown for the first launch on an untimed stream)."""
        prev: dict[tuple[int, int], Any] = {}
        for d, ev in start_events.items():
            prev[(d, self.cur[d])] = ev
        table: dict[tuple[str, int], dict] = {}
        for name, device, sid, grid, block, ev in self.launches:
            key = (device, sid)
            before = prev.get(key)
            t = None
            if before is not None:
                try:
                    t = before.elapsed_time(ev) / 1e3
                except Exception:
                    t = None
            prev[key] = ev
            row = table.setdefault((name, device), {
                "name": name, "device": device, "count": 0, "gpu_time": 0.0,
                "grid": grid, "block": block, "source": "events", "_unknown": 0})
            row["count"] += 1
            if t is None:
                row["_unknown"] += 1
            else:
                row["gpu_time"] += t
        out = []
        for row in table.values():
            if row.pop("_unknown") == row["count"]:
                row["gpu_time"] = None
            out.append(row)
        return out


# ------------------------------------------------------------------------------- CUPTI
_cupti_sink: list | None = None
_cupti_registered = False


def _cupti_module() -> tuple[Any, str]:
    try:
        from cupti import cupti
    except ImportError:
        return None, ("CUPTI is not available (the optional cupti-python package is not "
                      "installed: pip install cupti-python); listing cudalab's own launches only")
    except Exception as exc:  # a broken install, a missing libcupti
        return None, f"cupti-python could not be loaded ({exc}); listing cudalab's own launches only"
    return cupti, ""


def _buffer_requested() -> tuple[int, int]:
    return 8 << 20, 0


def _buffer_completed(activities: list) -> None:
    sink = _cupti_sink
    if sink is None:
        return
    for a in activities:
        try:
            sink.append((str(a.name), int(a.device_id), int(a.start), int(a.end),
                         int(a.stream_id), (int(a.grid_x), int(a.grid_y), int(a.grid_z)),
                         (int(a.block_x), int(a.block_y), int(a.block_z))))
        except AttributeError:
            continue  # not a kernel record


class _CuptiKernels:
    """CONCURRENT_KERNEL activity records around a region (every library's kernels)."""

    def __init__(self) -> None:
        self.records: list[tuple] = []
        self.note = ""
        self.active = False
        self.started = False
        self._mod: Any = None

    def start(self) -> bool:
        global _cupti_sink, _cupti_registered
        mod, why = _cupti_module()
        if mod is None:
            self.note = why
            return False
        try:
            if not _cupti_registered:
                mod.activity_register_callbacks(_buffer_requested, _buffer_completed)
                _cupti_registered = True
            _cupti_sink = self.records
            mod.activity_enable(mod.ActivityKind.CONCURRENT_KERNEL)
        except Exception as exc:
            _cupti_sink = None
            self.note = _cupti_error_text(mod, exc)
            return False
        self._mod = mod
        self.active = self.started = True
        return True

    def stop(self) -> None:
        global _cupti_sink
        if not self.active:
            return
        mod = self._mod
        try:
            mod.activity_flush_all(1)
        except Exception as exc:
            self.note = _cupti_error_text(mod, exc)
        finally:
            try:
                mod.activity_disable(mod.ActivityKind.CONCURRENT_KERNEL)
            except Exception:
                pass
            _cupti_sink = None
            self.active = False

    def kernel_table(self) -> list[dict]:
        table: dict[tuple[str, int], dict] = {}
        for name, dev, start, end, _sid, grid, block in self.records:
            row = table.setdefault((name, dev), {
                "name": name, "device": dev, "count": 0, "gpu_time": 0.0,
                "grid": grid, "block": block, "source": "cupti"})
            row["count"] += 1
            row["gpu_time"] += max(0, end - start) / 1e9
        return list(table.values())


def _cupti_error_text(mod: Any, exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    name = ""
    try:
        name = mod.Result(status).name if status is not None else ""
    except Exception:
        name = str(status)
    if "MULTIPLE_SUBSCRIBERS" in name:
        return ("CUPTI is held by another profiler in this process (Nsight Systems/Compute, "
                "torch.profiler/kineto, ...); listing cudalab's own launches only")
    if "NOT_INITIALIZED" in name or "INSUFFICIENT_PRIVILEGES" in name:
        return (f"CUPTI could not start ({name}: a CUPTI/driver version mismatch or missing "
                "profiling permission); listing cudalab's own launches only")
    return f"CUPTI failed ({name or exc}); listing cudalab's own launches only"


# ------------------------------------------------------------------------------- NVML
_REASONS = ((0x4, "SW power cap"), (0x8, "HW slowdown"), (0x20, "SW thermal slowdown"),
            (0x40, "HW thermal slowdown"), (0x80, "HW power brake"), (0x10, "sync boost"))


def _clock_reasons(device: int) -> list[str] | None:
    """Active clock-limiting reasons (NVML clocks-event reasons) on a real GPU, else None."""
    from cudalab import devices, nvml

    try:
        n = nvml._nvml()
        if getattr(n, "simulated", True) or not hasattr(n, "_call"):
            return None
        uuid = devices.get_device_properties(device).uuid
        mask = int(n._call("clock event reasons", "nvmlDeviceGetCurrentClocksEventReasons",
                           n._handle(uuid)))
    except Exception:
        return None
    return [label for bit, label in _REASONS if mask & bit]


def nvml_context(devs: list[int]) -> dict[int, dict]:
    """SM clock (MHz), temperature (°C), power (mW) and clock-limit reasons per device."""
    from cudalab import nvml

    out: dict[int, dict] = {}
    for d in devs:
        snap: dict[str, Any] = {}
        for key, fn in (("clock_rate", nvml.clock_rate), ("temperature", nvml.temperature),
                        ("power_draw", nvml.power_draw)):
            try:
                snap[key] = fn(d)
            except Exception:
                snap[key] = None
        if all(v is None for v in snap.values()):
            continue
        try:
            snap["simulated"] = bool(nvml._nvml().simulated)
        except Exception:
            snap["simulated"] = False
        snap["reasons"] = _clock_reasons(d)
        out[d] = snap
    return out


# =============================================================================== timing core
class _EventTimer:
    """Start/end events per (device, stream) for ``capacity`` repeats, and host clocks."""

    #: Event pairs cycled by the one-stream timer: repeat j is read when repeat j + 2 begins
    #: (it waits for it anyway), so its events can be reused at once and a run of any length
    #: creates no events after the first.
    RING = 4

    def __init__(self, devs: list[int], streams: dict[int, Any], side: dict, pool: _EventPool,
                 capacity: int, flush: Any = None):
        self.devs = devs
        self.capacity = capacity
        lists = [[streams[d]] + [s for (dd, _sid), s in side.items() if dd == d] for d in devs]
        self.ring = len(devs) == 1 and len(lists[0]) == 1 and flush is None
        n_ev = min(capacity, self.RING) if self.ring else capacity
        # per device: [(stream, starts, ends)], the current stream first
        self.per_dev: list[list[tuple[Any, list, list]]] = []
        for d, lst in zip(devs, lists):
            self.per_dev.append([(s, pool.take(d, n_ev), pool.take(d, n_ev)) for s in lst])
        self._gpu = [0.0] * capacity if self.ring else None
        self._read_upto = [0]  # ring mode: repeats before this one have their GPU time
        self._starts = [(s, st) for group in self.per_dev for (s, st, _e) in group]
        self._ends = [(s, en) for group in self.per_dev for (s, _st, en) in group]
        self.cpu0 = [0.0] * capacity
        self.cpu1 = [0.0] * capacity
        self.flush = flush  # callable run before the start events (--cold)
        self._used = [0]
        self.begin, self.end = self._make_hooks()

    def _make_hooks(self) -> tuple[Any, Any]:
        """``begin(j)``/``end(j)`` closures (specialised for one stream and no flush: a ring of
        event pairs; per repeat two event records, two clock reads, one query and one read)."""
        cpu0, cpu1, used, flush, perf = self.cpu0, self.cpu1, self._used, self.flush, _perf
        starts_all, ends_all = self._starts, self._ends
        if self.ring:
            (s, starts), (_s, ends) = starts_all[0], ends_all[0]
            gpu, upto, R = self._gpu, self._read_upto, self.RING

            def begin(j: int) -> None:
                if j >= 2:  # at most two repeats in flight; the wait is outside the host clock
                    i = j - 2
                    e = ends[i % R]
                    if not e.query():
                        e.synchronize()
                    gpu[i] = starts[i % R].elapsed_time(e) / 1e3
                    upto[0] = j - 1
                starts[j % R].record(s)
                cpu0[j] = perf()

            def end(j: int) -> None:
                cpu1[j] = perf()
                ends[j % R].record(s)
                used[0] = j + 1

            return begin, end

        def begin(j: int) -> None:
            if j >= 2:
                for _s, ends in ends_all:
                    e = ends[j - 2]
                    if not e.query():
                        e.synchronize()
            if flush is not None:
                flush()
            for s, starts in starts_all:
                starts[j].record(s)
            cpu0[j] = perf()

        def end(j: int) -> None:
            cpu1[j] = perf()
            for s, ends in ends_all:
                ends[j].record(s)
            used[0] = j + 1

        return begin, end

    @property
    def used(self) -> int:
        return self._used[0]

    def sync(self) -> None:
        j = self.used - 1
        if j < 0:
            return
        if self.ring:
            (_s, starts, ends), R = self.per_dev[0][0], self.RING
            ends[j % R].synchronize()
            for i in range(self._read_upto[0], j + 1):
                self._gpu[i] = starts[i % R].elapsed_time(ends[i % R]) / 1e3
            self._read_upto[0] = j + 1
            return
        for _s, ends in self._ends:
            ends[j].synchronize()

    def gpu_seconds(self, k: int, j: int) -> float:
        """GPU seconds of repeat ``j`` on the ``k``-th device: latest end - earliest start."""
        if self.ring:
            return self._gpu[j]
        group = self.per_dev[k]
        if len(group) == 1:
            _s, starts, ends = group[0]
            return starts[j].elapsed_time(ends[j]) / 1e3
        ref = group[0][1][j]
        first = min(ref.elapsed_time(st[j]) for (_s, st, _e) in group)
        last = max(ref.elapsed_time(en[j]) for (_s, _st, en) in group)
        return (last - first) / 1e3

    def read(self, count: int) -> tuple[list[list[float]], list[float]]:
        gpu = [[self.gpu_seconds(k, j) for j in range(count)] for k in range(len(self.devs))]
        cpu = [self.cpu1[j] - self.cpu0[j] for j in range(count)]
        return gpu, cpu

    def start_events(self, j: int = 0) -> dict[int, Any]:
        return {d: self.per_dev[k][0][1][j] for k, d in enumerate(self.devs)}


def _nice_ceil(x: float) -> int:
    """Smallest 1-2-5 x 10^k number >= x (at least 1)."""
    if x <= 1:
        return 1
    exp = 10 ** int(math.floor(math.log10(x)))
    for m in (1, 2, 5, 10):
        if m * exp >= x:
            return int(m * exp)
    return int(10 * exp)  # pragma: no cover


class _Context:
    """Everything one %cuda_timed run needs from the magics instance and the runtime."""

    def __init__(self, magics: Any, opts: TimedOptions):
        from cudalab import devices, streams
        from cudalab.errors import CudaUnavailableError

        self.magics = magics
        self.opts = opts
        try:
            devices.init()
        except CudaUnavailableError as exc:
            raise UsageError(f"%cuda_timed: {exc}") from None
        self.backend = devices._backend()
        self.simulated = bool(self.backend.simulated)
        self.devs = parse_devices(opts.device)
        self.streams = {d: streams.current_stream(d) for d in self.devs}
        if magics._event_pool is None:
            magics._event_pool = _EventPool()
        self.pool: _EventPool = magics._event_pool
        self.pool_mark = self.pool.mark()
        self.precision = opts.precision or magics.precision
        self.flush_bytes: dict[int, int] = {}
        self.flush = None
        self.warnings: list[str] = []
        self.hints: list[str] = []
        if opts.cold:
            self._setup_flush()

    def _setup_flush(self) -> None:
        from cudalab.errors import CudaError

        m = self.magics
        if m._flush is None:
            m._flush = _FlushBuffers()
        fb: _FlushBuffers = m._flush
        try:
            for d in self.devs:
                self.flush_bytes[d] = fb.ensure(d, fb.size_for(d, m.cold_flush_factor))
        except (CudaError, MemoryError) as exc:
            self.warnings.append(f"--cold ignored: the L2 flush buffer could not be allocated ({exc})")
            self.flush_bytes = {}
            return
        pairs = [(d, self.streams[d]) for d in self.devs]
        flush = fb.flush

        def flush_all() -> None:
            for d, s in pairs:
                flush(d, s)

        self.flush = flush_all
        if self.simulated:
            self.hints.append("the simulator has no L2 cache: --cold only exercises the flush path")

    def close(self) -> None:
        """Give the events back to the pool (keeping an enclosing run's)."""
        self.pool.release(self.pool_mark)
        if not self.pool_mark:
            self.pool.trim()

    def timer(self, capacity: int, side: dict, flush: bool = True) -> _EventTimer:
        return _EventTimer(self.devs, self.streams, side, self.pool, capacity,
                           self.flush if flush else None)

    def device_names(self) -> dict[int, str]:
        from cudalab import devices

        return {d: devices.get_device_name(d) for d in self.devs}


def _add_observer(obs: Any) -> Any:
    from cudalab import kernels

    kernels._launch_observers.append(obs)
    return kernels


def _remove_observer(obs: Any) -> None:
    from cudalab import kernels

    try:
        kernels._launch_observers.remove(obs)
    except ValueError:
        pass


def _stat_warnings(result: Any, magics: Any, ctx: _Context) -> None:
    st = result.stats
    if st["count"] >= 3 and st["median"] > 0:
        ratio = st["iqr"] / st["median"]
        if ratio > magics.iqr_warning:
            ctx.warnings.append(
                f"the IQR is {ratio:.0%} of the median: the times fluctuate (other work on the "
                "GPU, clock changes, host jitter); more repeats (-r) or longer ones (-n) help")
        if st["min"] > 0 and st["max"] > magics.spread_warning * st["min"]:
            ctx.warnings.append(
                f"the slowest repeat took {st['max'] / st['min']:.1f}x the fastest: a first-run "
                "effect (add warm-up with -w) or an intermediate result being cached")
    cst = result.cpu_stats
    if (not ctx.simulated and result.mode == "repeat" and st["count"] and cst["count"]
            and st["median"] < 100e-6 and cst["median"] >= 0.9 * st["median"]):
        ctx.hints.append(
            "the host needs about as long as the GPU per loop: the loop is probably launch-bound "
            "and the GPU time includes idle gaps waiting for launches")


def _clock_hints(before: dict, after: dict, magics: Any, ctx: _Context) -> None:
    for d in ctx.devs:
        b, a = before.get(d) or {}, after.get(d) or {}
        cb, ca = b.get("clock_rate"), a.get("clock_rate")
        if cb and ca and abs(ca - cb) / max(ca, cb) > magics.clock_hint_threshold:
            ctx.hints.append(
                f"cuda:{d}: the SM clock moved {cb} → {ca} MHz during the measurement (ramping "
                "up from idle, or throttling): add warm-up (-w) or lock the clocks "
                "(nvidia-smi -lgc <MHz>, as root)")
        reasons = a.get("reasons")
        if reasons:
            ctx.hints.append(f"cuda:{d}: clocks limited by {', '.join(reasons)}")


# ------------------------------------------------------------------------------- single
def _run_single(ctx: _Context, source: str, setup: str, local_ns: Any) -> Any:
    from cudalab.magics.result import CudaTimedResult

    magics, opts = ctx.magics, ctx.opts
    shell = magics.shell
    glob = shell.user_ns
    code, expr_code, tc = compile_single(shell, source)
    if setup:  # cell mode with a statement on the %% line: run it first, untimed
        setup_code, setup_expr, _ = compile_single(shell, setup)
        exec(setup_code, glob, local_ns)  # noqa: S102 - the user's own code, as %time
        if setup_expr is not None:
            eval(setup_expr, glob, local_ns)  # noqa: S307
    tracker = _LaunchTracker(ctx.streams, record=opts.kernels)
    cupti, why = _cupti_for(magics, ctx, opts)
    nv_before = nvml_context(ctx.devs) if magics.nvml else {}
    timer = ctx.timer(1, {})
    out = None
    error: BaseException | None = None
    gpu_err: BaseException | None = None
    side_ends: list[tuple[int, Any]] = []
    _add_observer(tracker)
    try:
        if cupti is not None:
            cupti.start()
        timer.begin(0)
        try:
            exec(code, glob, local_ns)  # noqa: S102
            if expr_code is not None:
                out = eval(expr_code, glob, local_ns)  # noqa: S307
        except BaseException as exc:  # KeyboardInterrupt too: report, then re-raise
            error = exc
        t_cpu1 = _perf()
        try:
            timer.end(0)
            for (d, _sid), s in tracker.side.items():
                if d in ctx.streams:
                    ev = ctx.pool.take(d, 1)[0]
                    ev.record(s)
                    side_ends.append((d, ev))
            timer.sync()
            for _d, ev in side_ends:
                ev.synchronize()
            for *_launch, ev in tracker.launches:  # --kernels: also on untimed streams
                ev.synchronize()
        except Exception as exc:  # a sticky CUDA error after a failed kernel, a closed stream
            gpu_err = exc
        t_wall1 = _perf()
    finally:
        _remove_observer(tracker)
        if cupti is not None:
            cupti.stop()
    gpu_row: list[float] = []
    for k, d in enumerate(ctx.devs):
        t = float("nan")
        if gpu_err is None:
            try:
                t = timer.gpu_seconds(k, 0)
                start = timer.per_dev[k][0][1][0]
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
    _clock_hints(nv_before, nv_after, magics, ctx)
    kernels, note = _kernel_report(opts, tracker, cupti, why, timer.start_events(0), gpu_err)
    result = CudaTimedResult(
        mode="single", loops=1, repeats=1, warmup=0, devices=tuple(ctx.devs),
        gpu_times=[[t] for t in gpu_row], cpu_times=[t_cpu1 - timer.cpu0[0]],
        wall_time=t_wall1 - timer.cpu0[0], cold=bool(ctx.flush), flush_bytes=ctx.flush_bytes,
        kernels=kernels, kernels_note=note, nvml_before=nv_before, nvml_after=nv_after,
        warnings=ctx.warnings, hints=ctx.hints, simulated=ctx.simulated,
        device_names=ctx.device_names(), value=out, compile_time=tc, precision=ctx.precision,
        iqr_warning=magics.iqr_warning, spread_warning=magics.spread_warning)
    if error is not None:
        result.warnings.append(f"the cell raised {type(error).__name__}: {error}")
    _publish(magics, opts, result)
    if error is not None and (not opts.no_raise or not isinstance(error, Exception)):
        raise error
    if opts.output:
        return result
    return out


def _cupti_for(magics: Any, ctx: _Context, opts: TimedOptions) -> tuple[Any, str]:
    """A CUPTI kernel tracer for ``--kernels`` when it may be used, else (None, why not)."""
    if not opts.kernels:
        return None, ""
    if ctx.simulated:
        return None, "CUPTI is not used on the simulator"
    if not magics.cupti:
        return None, "CUPTI is off (CudaLabMagics.cupti = False)"
    return _CuptiKernels(), ""


def _kernel_report(opts: TimedOptions, tracker: _LaunchTracker, cupti: Any, why: str,
                   start_events: dict, gpu_err: Any, per: str = "") -> tuple[list[dict], str]:
    if not opts.kernels:
        return [], ""
    if cupti is not None and cupti.records:
        return cupti.kernel_table(), f"CUPTI activity records, every library's kernels{per}"
    if cupti is not None and cupti.started and not cupti.note:
        return [], f"CUPTI recorded no kernel{per}"
    if cupti is not None:
        why = cupti.note
    rows = [] if gpu_err is not None else tracker.kernel_table(start_events)
    note = (f"cudalab's own launches{per}; GPU time from events between launches on each "
            "stream (includes any other work queued in between)")
    if why:
        note += f". {why}"
    if not rows:
        note += ". No cudalab kernel was launched"
    return rows, note


# ------------------------------------------------------------------------------- repeat
def _run_repeat(ctx: _Context, setup: str, stmt: str, local_ns: Any, line_mode: bool) -> Any:
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
    tracker = _LaunchTracker(ctx.streams)
    rep = itertools.repeat
    gc_was = gc.isenabled()
    try:
        inner, tc = compile_repeat(shell, setup, stmt, glob)
        _add_observer(tracker)
        for _ in range(warmup):
            inner(1, 0, _noop, _noop, rep)
        number = opts.number
        if number is None:
            number = _autorange(ctx, inner, tracker, max_time, magics.min_repeat_time, rep)
        timer = ctx.timer(repeat, tracker.side)
        tracker.new_side = False
        nv_before = nvml_context(ctx.devs) if magics.nvml else {}
        begin, end = timer.begin, timer.end
        done = 0
        if magics.disable_gc:
            gc.disable()
        t_start = _perf()
        try:
            for j in range(repeat):
                inner(number, j, begin, end, rep)
                done = j + 1
                if done < repeat and (_perf() - t_start) * (done + 1) / done > max_time:
                    break
        except BaseException:
            try:  # let the queued work finish before the events are reused
                timer.sync()
            except Exception:
                pass
            raise
        finally:
            if gc_was:
                gc.enable()
        timer.sync()
        gpu, cpu = timer.read(done)
        nv_after = nvml_context(ctx.devs) if magics.nvml else {}
        kernels, note = [], ""
        if opts.kernels:
            kernels, note = _instrumented_run(magics, ctx, opts, inner, tracker, rep)
    finally:
        _remove_observer(tracker)
        if gc_was and not gc.isenabled():
            gc.enable()
        if conflict:
            glob.update(conflict)
    if done < repeat:
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
        gpu_times=[[t / number for t in row] for row in gpu],
        cpu_times=[t / number for t in cpu], cold=bool(ctx.flush),
        flush_bytes=ctx.flush_bytes, kernels=kernels, kernels_note=note,
        nvml_before=nv_before, nvml_after=nv_after, warnings=ctx.warnings, hints=ctx.hints,
        simulated=ctx.simulated, device_names=ctx.device_names(), compile_time=tc,
        precision=ctx.precision, iqr_warning=magics.iqr_warning,
        spread_warning=magics.spread_warning)
    _stat_warnings(result, magics, ctx)
    _clock_hints(nv_before, nv_after, magics, ctx)
    result.warnings, result.hints = list(ctx.warnings), list(ctx.hints)
    _publish(magics, opts, result)
    if opts.output:
        return result
    return None


def _noop(_j: int) -> None:
    return None


def _autorange(ctx: _Context, inner: Any, tracker: _LaunchTracker, max_time: float,
               target: float, rep: Any) -> int:
    """Loops per repeat so that one repeat takes >= ``target`` s of wall time (GPU work
    included), doubling at least and growing at most 1000x per step, capped by ``max_time``."""
    target = min(target, max_time / 10.0)
    number = 1
    spent = 0.0
    while True:
        ctx.pool.release(ctx.pool_mark)
        timer = ctx.timer(1, tracker.side)
        t0 = _perf()
        inner(number, 0, timer.begin, timer.end, rep)
        timer.sync()
        took = _perf() - t0
        spent += took
        if took >= target or number >= 10**9 or spent > max_time / 2:
            ctx.pool.release(ctx.pool_mark)
            return number
        guess = number * target / max(took, 1e-9)
        number = _nice_ceil(min(max(guess, number * 2), number * 1000))


def _instrumented_run(magics: Any, ctx: _Context, opts: TimedOptions, inner: Any,
                      tracker: _LaunchTracker, rep: Any) -> tuple[list[dict], str]:
    """One extra untimed loop with per-launch events (and CUPTI) for ``--kernels``."""
    probe = _LaunchTracker(ctx.streams, record=True)
    probe.side = dict(tracker.side)
    cupti, why = _cupti_for(magics, ctx, opts)
    timer = ctx.timer(1, tracker.side, flush=False)
    _add_observer(probe)
    try:
        if cupti is not None:
            cupti.start()
        inner(1, 0, timer.begin, timer.end, rep)
        timer.sync()
        for *_rest, ev in probe.launches:
            ev.synchronize()
    finally:
        _remove_observer(probe)
        if cupti is not None:
            cupti.stop()
    return _kernel_report(opts, probe, cupti, why, timer.start_events(0), None,
                          per=" (one extra run of a single loop)")


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
    opts = parse_options(line or "")
    if cell is None and not opts.stmt:
        raise UsageError("%cuda_timed needs a statement to time (or use %%cuda_timed)")
    ctx = _Context(magics, opts)
    try:
        if cell is None:
            if opts.repeat_mode:
                return _run_repeat(ctx, "", opts.stmt, local_ns, line_mode=True)
            return _run_single(ctx, opts.stmt, "", local_ns)
        if opts.repeat_mode:
            return _run_repeat(ctx, opts.stmt, cell, local_ns, line_mode=False)
        return _run_single(ctx, cell, opts.stmt, local_ns)
    finally:
        ctx.close()
