"""``CudaTimedResult``: what ``%%cuda_timed -o`` returns.

Times are in seconds **per loop** (a repeat of ``n`` loops contributes its time divided by
``n``), like IPython's ``TimeitResult``. ``gpu_times`` has one row per timed device and one
column per repeat; ``times`` (the series every statistic reads) is, per repeat, the
slowest device's time, which is the elapsed GPU time of the whole cell when several
devices work in parallel. ``cpu_times`` is the host's time per loop: how long Python took to
run (enqueue) the body, which is the launch overhead when the GPU is faster than the host.

numpy is imported when a result is made (the magic needs it anyway); pandas only by
:meth:`CudaTimedResult.to_frame`.
"""

from __future__ import annotations

import html
from typing import Any

import numpy as np

from cudalab._internal import format_bytes, format_time
from cudalab.magics.timed_bandwidth import bandwidth_line

# format_time stays importable from here (it was public API of this module); the one
# implementation is cudalab._units.format_time, so the two cannot drift.
__all__ = ["CudaTimedResult", "format_time"]


#: The text report shows kernel names up to this many characters (demangled C++ template
#: names run to hundreds); the HTML table and ``kernels`` keep the full name.
NAME_WIDTH = 90


def _short_name(name: str) -> str:
    """``name`` cut to :data:`NAME_WIDTH` characters (an ellipsis marks the cut)."""
    return name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 1] + "…"


def _stats(values: np.ndarray) -> dict[str, float]:
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    if v.size == 0:
        nan = float("nan")
        return {"median": nan, "iqr": nan, "p25": nan, "p75": nan, "min": nan, "max": nan,
                "mean": nan, "std": nan, "count": 0}
    p25, med, p75 = np.percentile(v, [25, 50, 75])
    return {
        "median": float(med),
        "iqr": float(p75 - p25),
        "p25": float(p25),
        "p75": float(p75),
        "min": float(v.min()),
        "max": float(v.max()),
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
        "count": int(v.size),
    }


class CudaTimedResult:
    """The measurement of one ``%%cuda_timed`` run (see the module documentation).

    Attributes:
        mode: ``"single"`` (the cell ran once, like ``%%time``) or ``"repeat"``.
        loops: loops per repeat (``-n``, or what auto-ranging chose).
        repeats: repeats measured (fewer than asked when ``--max-time`` stopped early).
        warmup: warm-up runs before measuring (auto-ranging runs not counted).
        devices: the CUDA ordinals timed, in the order of ``gpu_times``' rows.
        gpu_times: ``(len(devices), repeats)`` GPU seconds per loop, from CUDA events.
        cpu_times: ``(repeats,)`` host seconds per loop (the Python body, without the sync).
        wall_time: single mode: seconds from the start of the cell to the end of its GPU work.
        cold: whether L2 was flushed before each repeat (``--cold``).
        flush_bytes: bytes written per flush, by device.
        kernels: per kernel name and device: ``{"name", "device", "count", "gpu_time",
            "grid", "block", "source", "kind", "bytes"}`` (``--kernels``); ``gpu_time`` in
            seconds or None; ``kind`` is "kernel", or "memcpy"/"memset" (CUPTI only, named
            ``[memcpy HtoD]``/``[memset]``, with their ``bytes``); CUPTI rows also carry the
            kernel's recorded ``symbol`` (``name`` is its demangled C++ name).
        kernels_note: how ``kernels`` was obtained (CUPTI, or cudalab's own launches).
        nvml_before, nvml_after: ``{device: {"clock_rate", "temperature", "power_draw",
            ...}}`` NVML readings around the measurement.
        warnings, hints: the lines printed under the report.
        simulated: measured on cudalab's simulator (times are host times).
        value: single mode: the value of the cell's last expression.
        compile_time: seconds spent compiling the cell.
        collective: when the timed code ran collectives (``cudalab.nccl``, ``cudalab.comm``):
            their algorithm and bus bandwidth (see :mod:`cudalab.magics.timed_bandwidth`), or
            ``{"note": ...}`` saying why none is given; None when no collective ran.
    """

    def __init__(
        self,
        *,
        mode: str,
        loops: int,
        repeats: int,
        warmup: int,
        devices: tuple[int, ...],
        gpu_times: Any,
        cpu_times: Any,
        wall_time: float | None = None,
        cold: bool = False,
        flush_bytes: dict[int, int] | None = None,
        kernels: list[dict] | None = None,
        kernels_note: str = "",
        nvml_before: dict[int, dict] | None = None,
        nvml_after: dict[int, dict] | None = None,
        warnings: list[str] | None = None,
        hints: list[str] | None = None,
        simulated: bool = False,
        device_names: dict[int, str] | None = None,
        value: Any = None,
        compile_time: float = 0.0,
        precision: int = 3,
        iqr_warning: float = 0.10,
        spread_warning: float = 4.0,
    ):
        self.mode = mode
        self.loops = int(loops)
        self.repeats = int(repeats)
        self.warmup = int(warmup)
        self.devices = tuple(int(d) for d in devices)
        g = np.asarray(gpu_times, dtype=np.float64)
        if g.ndim == 1:
            g = g.reshape(1, -1)
        self.gpu_times = g
        self.cpu_times = np.asarray(cpu_times, dtype=np.float64).reshape(-1)
        self.wall_time = wall_time
        self.cold = bool(cold)
        self.flush_bytes = dict(flush_bytes or {})
        self.kernels = list(kernels or [])
        self.kernels_note = kernels_note
        self.nvml_before = dict(nvml_before or {})
        self.nvml_after = dict(nvml_after or {})
        self.warnings = list(warnings or [])
        self.hints = list(hints or [])
        self.simulated = bool(simulated)
        self.device_names = dict(device_names or {})
        self.value = value
        self.compile_time = float(compile_time)
        self.precision = int(precision)
        self.iqr_warning = float(iqr_warning)
        self.spread_warning = float(spread_warning)
        self.collective: dict | None = None  # set by the magic after timing

    # ------------------------------------------------------------------ series and stats
    @property
    def times(self) -> np.ndarray:
        """Per repeat, the GPU seconds per loop of the slowest device (what stats read)."""
        if self.gpu_times.size == 0:
            return np.zeros(0)
        with np.errstate(all="ignore"):
            if np.isnan(self.gpu_times).all(axis=0).any():
                return np.array([np.nan if np.isnan(col).all() else np.nanmax(col)
                                 for col in self.gpu_times.T])
            return np.nanmax(self.gpu_times, axis=0)

    @property
    def all_runs(self) -> np.ndarray:
        """GPU seconds of each whole repeat (``times * loops``), like ``TimeitResult``."""
        return self.times * self.loops

    @property
    def stats(self) -> dict[str, float]:
        """median, iqr (p75 - p25), p25, p75, min, max, mean, std, count of :attr:`times`."""
        return _stats(self.times)

    @property
    def cpu_stats(self) -> dict[str, float]:
        """The same statistics of :attr:`cpu_times`."""
        return _stats(self.cpu_times)

    def device_stats(self, device: int) -> dict[str, float]:
        """Statistics of one device's row of :attr:`gpu_times`."""
        return _stats(self.gpu_times[self.devices.index(device)])

    median = property(lambda self: self.stats["median"], doc="Median GPU seconds per loop.")
    iqr = property(lambda self: self.stats["iqr"], doc="Interquartile range of the GPU times.")
    min = property(lambda self: self.stats["min"], doc="Fastest repeat, GPU seconds per loop.")
    max = property(lambda self: self.stats["max"], doc="Slowest repeat, GPU seconds per loop.")
    mean = property(lambda self: self.stats["mean"], doc="Mean GPU seconds per loop.")
    count = property(lambda self: self.stats["count"], doc="Number of repeats measured.")
    best = min
    worst = max

    @property
    def cpu_median(self) -> float:
        """Median host seconds per loop."""
        return self.cpu_stats["median"]

    # ------------------------------------------------------------------ exports
    def to_frame(self):
        """A pandas DataFrame, one row per (repeat, device): ``repeat``, ``device``,
        ``gpu_time`` and ``cpu_time`` (seconds per loop), ``loops``."""
        import pandas as pd

        rows = []
        for k, d in enumerate(self.devices):
            for j in range(self.gpu_times.shape[1]):
                rows.append((j, d, float(self.gpu_times[k, j]),
                             float(self.cpu_times[j]) if j < self.cpu_times.size else np.nan,
                             self.loops))
        return pd.DataFrame(rows, columns=["repeat", "device", "gpu_time", "cpu_time", "loops"])

    to_pandas = to_frame

    def to_dict(self) -> dict:
        """Plain data (JSON-friendly apart from ``value``, which is left out)."""
        return {
            "mode": self.mode, "loops": self.loops, "repeats": self.repeats,
            "warmup": self.warmup, "devices": list(self.devices),
            "gpu_times": self.gpu_times.tolist(), "cpu_times": self.cpu_times.tolist(),
            "wall_time": self.wall_time, "cold": self.cold,
            "flush_bytes": {str(k): v for k, v in self.flush_bytes.items()},
            "stats": self.stats, "cpu_stats": self.cpu_stats, "kernels": self.kernels,
            "kernels_note": self.kernels_note,
            "nvml_before": {str(k): v for k, v in self.nvml_before.items()},
            "nvml_after": {str(k): v for k, v in self.nvml_after.items()},
            "warnings": self.warnings, "hints": self.hints, "simulated": self.simulated,
            "collective": self.collective,
        }

    # ------------------------------------------------------------------ text
    def _t(self, s: float | None) -> str:
        return format_time(s, self.precision)

    def _where(self) -> str:
        devs = ", ".join(f"cuda:{d}" for d in self.devices)
        return devs + (" [simulated]" if self.simulated else "")

    def headline(self) -> str:
        """One line: the GPU time and what it is."""
        if self.mode == "single":
            wall = f" | wall {self._t(self.wall_time)} (until the GPU finished)" \
                if self.wall_time is not None else ""
            return (f"GPU time {self._t(self.median)} | CPU {self._t(self.cpu_median)} "
                    f"(host, until the cell returned){wall} - {self._where()}")
        st = self.stats
        return (f"{self._t(st['median'])} ± {self._t(st['iqr'])} IQR per loop (GPU median of "
                f"{st['count']} repeat{'s' if st['count'] != 1 else ''} × {self.loops} "
                f"loop{'s' if self.loops != 1 else ''}{', cold L2' if self.cold else ''}) "
                f"- {self._where()}")

    def _nvml_lines(self) -> list[str]:
        lines = []
        for d in self.devices:
            b, a = self.nvml_before.get(d), self.nvml_after.get(d)
            if not b and not a:
                continue
            b, a = b or {}, a or {}

            def pair(key: str, unit: str, scale: float = 1.0, b=b, a=a) -> str | None:
                x, y = b.get(key), a.get(key)
                if x is None and y is None:
                    return None
                fx = "?" if x is None else f"{x / scale:.0f}"
                fy = "?" if y is None else f"{y / scale:.0f}"
                return f"{fx} → {fy} {unit}"

            parts = [p for p in (pair("clock_rate", "MHz SM"), pair("temperature", "°C"),
                                 pair("power_draw", "W", 1000.0)) if p]
            if parts:
                sim = " (simulated NVML)" if (a.get("simulated") or b.get("simulated")) else ""
                lines.append(f"cuda:{d}: " + ", ".join(parts) + sim)
        return lines

    def _kernel_rows(self) -> list[tuple[str, str, str, str, str]]:
        rows = []
        for k in self.kernels:
            n = k.get("count", 0)
            t = k.get("gpu_time")
            name = str(k.get("name"))
            if k.get("kind") in ("memcpy", "memset"):
                name += f" {format_bytes(k.get('bytes', 0))}"
            rows.append((name, f"cuda:{k.get('device')}", str(n),
                         self._t(t) if t is not None else "n/a",
                         self._t(t / n) if (t is not None and n) else "n/a"))
        return rows

    def report(self) -> str:
        """The full text report (what the magic prints)."""
        lines = [self.headline()]
        if self.mode == "repeat":
            st, cst = self.stats, self.cpu_stats
            lines.append(f"  GPU  median {self._t(st['median'])}  IQR {self._t(st['iqr'])}  "
                         f"min {self._t(st['min'])}  max {self._t(st['max'])}  n={st['count']}")
            lines.append(f"  CPU  median {self._t(cst['median'])} per loop (host time to run the "
                         "body; launch overhead when the GPU is faster)")
            if len(self.devices) > 1:
                for d in self.devices:
                    ds = self.device_stats(d)
                    lines.append(f"  cuda:{d}  median {self._t(ds['median'])}  "
                                 f"IQR {self._t(ds['iqr'])}  min {self._t(ds['min'])}")
        elif len(self.devices) > 1:
            for k, d in enumerate(self.devices):
                lines.append(f"  cuda:{d}  GPU {self._t(float(self.gpu_times[k, 0]))}")
        if self.cold and self.flush_bytes:
            sizes = ", ".join(f"cuda:{d} {format_bytes(b)}" for d, b in self.flush_bytes.items())
            lines.append(f"  L2 flushed before each repeat, outside the timed events ({sizes})")
        if self.collective:
            lines.append("  " + bandwidth_line(self.collective, self._t))
        lines += ["  " + x for x in self._nvml_lines()]
        if self.kernels or self.kernels_note:
            lines.append(f"  kernels: {self.kernels_note}" if self.kernels_note else "  kernels:")
            rows = self._kernel_rows()
            if rows:
                short = [_short_name(r[0]) for r in rows]
                w = max(len(n) for n in short)
                lines.append(f"    {'name':<{w}}  device  count  GPU total   per launch")
                for n, r in zip(short, rows):
                    lines.append(f"    {n:<{w}}  {r[1]:<6}  {r[2]:>5}  {r[3]:>10}  {r[4]:>10}")
        if self.compile_time > 0.1:
            lines.append(f"  compile time {self._t(self.compile_time)}")
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  hint: {h}" for h in self.hints]
        return "\n".join(lines)

    __str__ = report

    def __repr__(self) -> str:
        return f"<CudaTimedResult {self.headline()}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text("<CudaTimedResult ...>" if cycle else self.report())

    # ------------------------------------------------------------------ HTML
    def _repr_html_(self) -> str:
        e = html.escape
        st, cst = self.stats, self.cpu_stats
        title = "cuda_timed" + (" (simulated)" if self.simulated else "")
        out = [f'<div class="cudalab-timed"><b>{e(title)}</b>: {e(self.headline())}',
               '<table style="border-collapse:collapse;font-family:monospace">',
               "<tr><th></th><th>median</th><th>IQR</th><th>min</th><th>max</th><th>count</th></tr>"]

        def row(label: str, s: dict) -> str:
            return (f"<tr><td>{e(label)}</td><td>{e(self._t(s['median']))}</td>"
                    f"<td>{e(self._t(s['iqr']))}</td><td>{e(self._t(s['min']))}</td>"
                    f"<td>{e(self._t(s['max']))}</td><td>{s['count']}</td></tr>")

        out.append(row("GPU per loop", st))
        if len(self.devices) > 1:
            for d in self.devices:
                out.append(row(f"  cuda:{d}", self.device_stats(d)))
        out.append(row("CPU per loop", cst))
        if self.wall_time is not None:
            out.append(f"<tr><td>wall</td><td colspan=5>{e(self._t(self.wall_time))} "
                       "(until the GPU finished)</td></tr>")
        out.append("</table>")
        if self.collective:
            out.append(f"<div>{e(bandwidth_line(self.collective, self._t))}</div>")
        nv = self._nvml_lines()
        if nv:
            out.append("<div>" + "<br>".join(e(x) for x in nv) + "</div>")
        if self.kernels or self.kernels_note:
            out.append(f"<div>kernels: {e(self.kernels_note)}</div>")
            rows = self._kernel_rows()
            if rows:
                out.append('<table style="border-collapse:collapse;font-family:monospace">'
                           "<tr><th>name</th><th>device</th><th>count</th><th>GPU total</th>"
                           "<th>per launch</th></tr>")
                for r in rows:
                    out.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>")
                out.append("</table>")
        for w in self.warnings:
            out.append(f'<div style="color:#b45309">warning: {e(w)}</div>')
        for h in self.hints:
            out.append(f'<div style="color:#555">hint: {e(h)}</div>')
        out.append("</div>")
        return "\n".join(out)
