"""``%%cuda_timed`` / ``%cuda_timed``: GPU time from CUDA events, next to host time.

How a measurement is built (the pitfalls it avoids are in ``docs/magics.md``):

* **Compile once.** The cell goes through IPython's input transforms and AST transformers and
  is compiled once, as ``%%time``/``%%timeit`` do. In repeat mode the body is placed in a
  loop inside one function (IPython's timeit template), and the repeats loop inside that
  function too, so it is never re-executed from source (CuPy's ``%gpu_timeit`` re-``exec``s
  the cell every repeat and inflates small times by several x) and a repeat costs no
  Python call of its own beyond the ``end`` hook.
* **Events on the streams that did the work.** A start event is recorded on the current
  stream of every timed device before the body and an end event after it. Streams other
  than the current one that cudalab kernels were launched on (seen through
  :data:`cudalab.kernels._launch_observers`) get events too, and a device's time is the
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
  completion (an empty body) may have up to 32 in flight (see ``_EventTimer``). The
  per-repeat cost of an empty body is one event record, one ``elapsed_time`` and two
  clock reads.
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
import copy
import gc
import itertools
import math
import time
from typing import Any

import numpy as np
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
    """Put the setup and statement bodies in place of the template's ``setup`` and ``stmt``
    placeholders (IPython's approach)."""

    def __init__(self, setup: list[ast.stmt], stmt: list[ast.stmt]):
        self.parts = {"setup": setup, "stmt": stmt}

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field in ("body", "orelse"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                out: list[ast.stmt] = []
                for st in stmts:
                    if (isinstance(st, ast.Expr) and isinstance(st.value, ast.Name)
                            and st.value.id in self.parts):
                        out.extend(self.parts[st.value.id])
                    else:
                        out.append(self.visit(st))
                setattr(node, field, out)
        return node


#: The timing function. The repeats loop inside it, so a repeat costs no call of its own:
#: ``begin()`` (``time.perf_counter`` itself in the shared-boundary mode) before the loops,
#: ``end(j, t0)`` after them, which records the end events and returns ``j + 1``, or
#: ``~(j + 1)`` to stop. ``setup`` runs before every repeat, untimed; its names stay local.
_TEMPLATE = (
    "def __cudalab_timed_inner(_cl_n, _cl_j, _cl_begin, _cl_end, _cl_repeat):\n"
    "    while _cl_j >= 0:\n"
    "        setup\n"
    "        _cl_t0 = _cl_begin()\n"
    "        for _cl_i in _cl_repeat(None, _cl_n):\n"
    "            stmt\n"
    "        _cl_j = _cl_end(_cl_j, _cl_t0)\n"
    "    return ~_cl_j\n"
)
#: The same for one loop per repeat (``-n 1``): the statement is not wrapped in a loop of
#: one, which saves an iterator per repeat. ``_cl_n`` must be 1.
_TEMPLATE_ONCE = _TEMPLATE.replace(
    "        for _cl_i in _cl_repeat(None, _cl_n):\n            stmt\n", "        stmt\n")
assert _TEMPLATE_ONCE != _TEMPLATE


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


def compile_repeat(shell: Any, setup: str, stmt: str, glob: dict) -> tuple[Any, float, bool]:
    """The timing function ``inner(n, j, begin, end, repeat)`` built around the body (it
    returns the number of repeats run), the seconds it took, and whether there is a setup
    statement (something untimed between repeats). ``inner.once`` is the same function
    for ``n == 1``, without the inner loop."""
    t0 = _perf()
    setup_tree, setup_name = _parse(shell, setup or "pass")
    stmt_tree, stmt_name = _parse(shell, stmt or "pass")
    # Compile each part alone first: code valid only inside the template (a bare "return")
    # must be refused with the user's line numbers (IPython issue 10636).
    shell.compile(setup_tree, setup_name, "exec")
    shell.compile(stmt_tree, stmt_name, "exec")
    setup_body = setup_tree.body or [ast.Pass()]
    stmt_body = stmt_tree.body or [ast.Pass()]
    has_setup = not all(isinstance(st, ast.Pass) for st in setup_body)
    fns = []
    for template in (_TEMPLATE, _TEMPLATE_ONCE):
        filler = _Filler(copy.deepcopy(setup_body), copy.deepcopy(stmt_body))
        tree = ast.fix_missing_locations(filler.visit(ast.parse(template)))
        code = shell.compile(tree, stmt_name, "exec")
        ns: dict = {}
        exec(code, glob, ns)  # noqa: S102 - the user's own cell, as %timeit does
        fns.append(ns["__cudalab_timed_inner"])
    inner, inner.once = fns
    return inner, _perf() - t0, has_setup


# =============================================================================== GPU helpers
class _EventPool:
    """Timing events per device, reused across runs (creating events costs driver calls).

    Each device has a list of events and the parallel list of their driver handles (the hot
    path records by handle). :meth:`take` hands out the next ``n`` events and creates only
    what the pool lacks, so a run takes all it needs before its timed loop and a later run
    of the same length creates none."""

    def __init__(self) -> None:
        self._events: dict[int, list[Any]] = {}
        self._handles: dict[int, list[Any]] = {}
        self._missing: dict[int, bool] = {}  # a handle of the device's list may be None
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
        """The next ``n`` events of ``device`` (a handle may still be missing: the driver
        refused to create it earlier, and :meth:`cudalab.Event.record` creates it)."""
        have, _handles, start = self._take(device, n)
        return have[start:start + n]

    def take_handles(self, device: int, n: int) -> tuple[list[Any], list[Any]]:
        """The next ``n`` events of ``device`` and their driver handles, all created (the
        driver's error is raised here, before any timed loop)."""
        have, handles, start = self._take(device, n)
        if self._missing.get(device):
            for i in range(len(have)):
                if handles[i] is None:
                    ev = have[i]
                    if ev._handle is None and start <= i < start + n:
                        ev._create(device)
                    handles[i] = ev._handle
            self._missing[device] = any(h is None for h in handles)
        return have[start:start + n], handles[start:start + n]

    def _take(self, device: int, n: int) -> tuple[list[Any], list[Any], int]:
        from cudalab.events import Event

        have = self._events.setdefault(device, [])
        handles = self._handles.setdefault(device, [])
        start = self._used.get(device, 0)
        while len(have) < start + n:
            ev = Event(enable_timing=True)
            try:
                ev._create(device)  # now, not at the first record inside a timed repeat
            except Exception:
                self._missing[device] = True
            have.append(ev)
            handles.append(ev._handle)
        self._used[device] = start + n
        return have, handles, start

    def trim(self, keep: int = 1 << 15) -> None:
        for events in self._events.values():
            del events[keep:]
        for handles in self._handles.values():
            del handles[keep:]


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
class _Group:
    """One (device, stream) a timer records on, with the events taken for it."""

    __slots__ = ("device", "stream", "events", "handles")

    def __init__(self, device: int, stream: Any):
        self.device = device
        self.stream = stream
        self.events: list[Any] = []
        self.handles: list[Any] = []


class _EventTimer:
    """Events on every timed (device, stream) for up to ``capacity`` repeats, and host clocks.

    * **Shared boundaries** (``shared``: nothing untimed runs between repeats, i.e. no setup
      statement and no --cold flush): repeat j runs from boundary event ``b[j]`` to
      ``b[j + 1]``, so R repeats record R + 1 events per stream: one record per repeat.
    * **Split** (a setup statement or an L2 flush runs before every repeat): repeat j has its
      own start event (slot 2j, recorded after them) and end event (slot 2j + 1).

    The events are taken from the pool before the timed loop (for up to ``CHUNK`` repeats;
    longer runs take the next chunk between two repeats, and a shared run then starts the
    next repeat from a fresh event, so the pause is outside every repeat). Nothing is read
    while the repeats run: the host syncs once, on the last end events, then calls
    ``elapsed_time`` once per repeat and stream. To keep at most ``lag`` repeats in flight
    without a driver call per repeat, the end of repeat k - lag is queried only every
    ``stride`` repeats: the stride doubles (up to ``MAX_STRIDE``) while the GPU keeps up
    and drops to 1 (a wait on that event, outside the host clock) when it does not. The lag
    starts at two repeats; a wait shorter than ``LATENCY`` seconds means the GPU was not
    behind, only not there yet (an empty body's repeats take less than the GPU's latency
    from record to completion), so the lag doubles (up to ``MAX_LAG``) instead of waiting
    again and again; a longer wait puts it back to two. The work queued ahead thus stays
    within about two repeats or ``MAX_LAG`` x ``LATENCY``, which bounds how far a run can
    pass ``--max-time``.
    """

    CHUNK = 8192
    MAX_STRIDE = 32
    MAX_LAG = 32
    LATENCY = 50e-6

    def __init__(self, devs: list[int], streams: dict[int, Any], side: dict, pool: _EventPool,
                 capacity: int, flush: Any = None, shared: bool = True):
        from cudalab import devices

        self.devs = devs
        self.pool = pool
        self.capacity = max(1, int(capacity))
        self.flush = flush  # callable run before the start events (--cold)
        self.shared = bool(shared) and flush is None
        self.dev_groups: list[list[_Group]] = []  # per timed device, the current stream first
        for d in devs:
            lst = [streams[d]] + [s for (dd, _sid), s in side.items() if dd == d]
            self.dev_groups.append([_Group(d, s) for s in lst])
        self.groups = [g for gs in self.dev_groups for g in gs]
        # one device, one context: record by handle (a failed record retries through
        # Event.record, which makes the context current and raises the driver's error)
        self.raw = len(devs) == 1
        self.fast = devices._fast
        self.reps = 0  # repeats the events taken so far cover
        self._take(min(self.capacity, self.CHUNK))
        self.cpu = [0.0] * self.capacity  # host seconds per repeat
        self.breaks: dict[int, list[Any]] = {}  # shared: repeat -> fresh start event per group
        self._stride = 1
        self._lag = 2  # repeats allowed in flight
        self._next_check = 2  # the first in-flight check: after repeat 1, on repeat 0's end
        self._nxt = [self._next_limit()]

    # ----------------------------------------------------------------- slots and events
    def _take(self, n: int) -> None:
        """Events for ``n`` more repeats on every group (before the loop, or between two)."""
        slots = (n + (self.reps == 0)) if self.shared else 2 * n
        for g in self.groups:
            evs, hs = self.pool.take_handles(g.device, slots)
            g.events.extend(evs)
            g.handles.extend(hs)
        self.reps += n

    def _next_limit(self) -> int:
        grow = self.reps if self.reps < self.capacity else self.capacity + 1
        return min(self._next_check, grow)

    def _end_slot(self, j: int) -> int:
        return j + 1 if self.shared else 2 * j + 1

    def _start_slot(self, j: int) -> int:
        return j if self.shared else 2 * j

    def _record(self, slot: int) -> None:
        """Record every group's event ``slot`` on its stream."""
        if self.raw:
            rec = self.fast.event_record
            for g in self.groups:
                if rec(g.handles[slot], g.stream._handle)[0]:
                    g.events[slot].record(g.stream)
        else:
            for g in self.groups:
                g.events[slot].record(g.stream)

    def _between(self, k: int) -> None:
        """After repeat k - 1 (every few repeats): take more events when the taken ones run
        out, and keep at most ``lag`` repeats in flight."""
        if k == self.reps and k < self.capacity:
            self._take(min(self.CHUNK, self.capacity - k))
            if self.shared:  # repeat k starts after this pause, from a fresh event
                fresh = [self.pool.take(g.device, 1)[0] for g in self.groups]
                for g, ev in zip(self.groups, fresh):
                    ev.record(g.stream)
                self.breaks[k] = fresh
        if k >= self._next_check and k >= self._lag:
            slot = self._end_slot(k - self._lag)
            query = self.fast.event_query
            waited = -1.0
            for g in self.groups:
                if query(g.handles[slot])[0]:  # not done (or an error, which this raises)
                    if waited < 0:
                        waited = 0.0
                    t0 = _perf()
                    g.events[slot].synchronize()
                    waited += _perf() - t0
            if waited < 0:
                self._stride = min(2 * self._stride, self.MAX_STRIDE)
            else:
                self._stride = 1
                self._lag = (min(2 * self._lag, self.MAX_LAG) if waited < self.LATENCY else 2)
            self._next_check = max(k + self._stride, self._lag)
        self._nxt[0] = self._next_limit()

    # ----------------------------------------------------------------- the timed loop
    def loop_hooks(self, repeat: int, max_time: float = math.inf) -> tuple[Any, Any]:
        """``(begin, end)`` for the timing function, and the clock started: the function
        runs ``t0 = begin()`` before a repeat's loops and ``j = end(j, t0)`` after them;
        ``end`` returns j + 1 to go on, ``~(j + 1)`` to stop (``repeat`` repeats done, or
        ``max_time`` seconds would be passed by one more). Shared mode records the first
        boundary here."""
        repeat = min(int(repeat), self.capacity)
        perf, cpu, between, nxt = _perf, self.cpu, self._between, self._nxt
        if self.shared:
            self._record(0)
        t_start = perf()
        if self.shared and self.raw and len(self.groups) == 1:  # the hot path: one record
            g = self.groups[0]
            hs, sh, evs, s = g.handles, g.stream._handle, g.events, g.stream
            rec = self.fast.event_record

            def end(j: int, t0: float) -> int:
                t = perf()
                cpu[j] = t - t0
                k = j + 1
                if rec(hs[k], sh)[0]:
                    evs[k].record(s)  # makes the context current, or raises the error
                if k >= nxt[0]:
                    between(k)
                if k < repeat and (t - t_start) * (k + 1) <= max_time * k:
                    return k
                return ~k

            return perf, end
        record, flush = self._record, self.flush
        cur = [0]
        step = 1 if self.shared else 2  # repeat j ends at slot step * j + 1 (_end_slot)

        def begin() -> float:
            if flush is not None:
                flush()
            record(2 * cur[0])
            return perf()

        def end(j: int, t0: float) -> int:  # noqa: F811 - every group, either flavour
            t = perf()
            cpu[j] = t - t0
            record(step * j + 1)
            k = cur[0] = j + 1
            if k >= nxt[0]:
                between(k)
            if k < repeat and (t - t_start) * (k + 1) <= max_time * k:
                return k
            return ~k

        return (perf if self.shared else begin), end

    # ----------------------------------------------------------------- single runs
    def begin_single(self) -> float:
        """Single mode: flush (--cold), record the start events; the host clock."""
        if self.flush is not None:
            self.flush()
        self._record(0)
        return _perf()

    def end_single(self) -> None:
        self._record(1)

    # ----------------------------------------------------------------- after the loop
    def finish(self, count: int) -> None:
        """Wait for the end events of repeat ``count - 1`` (the run's one host sync)."""
        if count <= 0:
            return
        slot = self._end_slot(count - 1)
        for g in self.groups:
            g.events[slot].synchronize()

    def abort(self) -> None:
        """After an exception: let the queued work finish before the events are reused."""
        for g in self.groups:
            try:
                g.stream.synchronize()
            except Exception:
                pass

    def _starts_ends(self, gi: int, g: _Group, count: int) -> tuple[list[Any], list[Any]]:
        hs = g.handles
        if self.shared:
            starts, ends = hs[:count], hs[1:count + 1]
            for k, fresh in self.breaks.items():
                if k < count:
                    starts[k] = fresh[gi]._handle
            return starts, ends
        return hs[0:2 * count:2], hs[1:2 * count:2]

    def _device_ms(self, k: int, count: int) -> list[float]:
        """Milliseconds of repeats 0..count-1 on the k-th device: the latest end minus the
        earliest start over its streams (one elapsed_time per repeat and stream)."""
        from cudalab import devices

        eet = devices._backend().event_elapsed_time
        gs = self.dev_groups[k]
        base = self.groups.index(gs[0])
        pairs = [self._starts_ends(base + i, g, count) for i, g in enumerate(gs)]
        starts0, ends0 = pairs[0]
        if len(pairs) == 1:
            # by handle, statuses checked at the end (a checked call per repeat costs two
            # Python frames more); a failure is read again through the checked method
            res = list(map(self.fast.event_elapsed_time, starts0, ends0))
            if not res:
                return []
            status, ms = zip(*res)
            if any(status):
                return list(map(eet, starts0, ends0))  # raises the driver's error
            return list(ms)
        out = []
        for j in range(count):
            ref = starts0[j]
            first = 0.0
            last = eet(ref, ends0[j])
            for st, en in pairs[1:]:
                first = min(first, eet(ref, st[j]))
                last = max(last, eet(ref, en[j]))
            out.append(last - first)
        return out

    def read(self, count: int) -> tuple[list[np.ndarray], np.ndarray]:
        """(GPU seconds per device and repeat, host seconds per repeat) after :meth:`finish`,
        as float64 arrays (converted at once: a run may hold millions of repeats)."""
        gpu = [np.asarray(self._device_ms(k, count), dtype=np.float64) * 1e-3
               for k in range(len(self.devs))]
        return gpu, np.asarray(self.cpu[:count], dtype=np.float64)

    def gpu_seconds(self, k: int, j: int) -> float:
        """GPU seconds of repeat ``j`` on the ``k``-th device."""
        return self._device_ms(k, j + 1)[j] * 1e-3

    def start_event(self, k: int, j: int = 0) -> Any:
        """The start event of repeat ``j`` on the ``k``-th device's current stream."""
        fresh = self.breaks.get(j) if self.shared else None
        if fresh is not None:
            return fresh[self.groups.index(self.dev_groups[k][0])]
        return self.dev_groups[k][0].events[self._start_slot(j)]

    def start_events(self, j: int = 0) -> dict[int, Any]:
        return {d: self.start_event(k, j) for k, d in enumerate(self.devs)}


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

    def timer(self, capacity: int, side: dict, flush: bool = True,
              shared: bool = True) -> _EventTimer:
        return _EventTimer(self.devs, self.streams, side, self.pool, capacity,
                           self.flush if flush else None, shared=shared)

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
        t_cpu0 = timer.begin_single()
        try:
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
        _remove_observer(tracker)
        if cupti is not None:
            cupti.stop()
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
    _clock_hints(nv_before, nv_after, magics, ctx)
    kernels, note = _kernel_report(opts, tracker, cupti, why, timer.start_events(0), gpu_err)
    result = CudaTimedResult(
        mode="single", loops=1, repeats=1, warmup=0, devices=tuple(ctx.devs),
        gpu_times=[[t] for t in gpu_row], cpu_times=[t_cpu1 - t_cpu0],
        wall_time=t_wall1 - t_cpu0, cold=bool(ctx.flush), flush_bytes=ctx.flush_bytes,
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
        inner, tc, has_setup = compile_repeat(shell, setup, stmt, glob)
        _add_observer(tracker)
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
        try:
            begin, end = timer.loop_hooks(repeat, max_time)
            done = (inner.once if number == 1 else inner)(number, 0, begin, end, rep)
        except BaseException:
            timer.abort()
            raise
        finally:
            if gc_was:
                gc.enable()
        timer.finish(done)
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
        gpu_times=[row / number for row in gpu],
        cpu_times=cpu / number, cold=bool(ctx.flush),
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


def _count_to(n: int) -> Any:
    """An ``end`` hook that only counts: ``n`` runs of the timing function (warm-up)."""

    def end(j: int, _t0: float) -> int:
        k = j + 1
        return k if k < n else ~k

    return end


def _autorange(ctx: _Context, inner: Any, tracker: _LaunchTracker, max_time: float,
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


def _instrumented_run(magics: Any, ctx: _Context, opts: TimedOptions, inner: Any,
                      tracker: _LaunchTracker, rep: Any) -> tuple[list[dict], str]:
    """One extra untimed loop with per-launch events (and CUPTI) for ``--kernels``."""
    probe = _LaunchTracker(ctx.streams, record=True)
    probe.side = dict(tracker.side)
    cupti, why = _cupti_for(magics, ctx, opts)
    timer = ctx.timer(1, tracker.side, flush=False, shared=False)  # start right before the body
    _add_observer(probe)
    try:
        if cupti is not None:
            cupti.start()
        begin, end = timer.loop_hooks(1)
        inner(1, 0, begin, end, rep)
        timer.finish(1)
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
