"""``%cuda_memory`` (the summary) and ``%cuda_memory mark`` / ``diff``: the allocator's
statistics as plain data, text and HTML."""

from __future__ import annotations

import html
import time
from typing import Any

from cudalab._internal import format_bytes, format_time
from cudalab.magics.memory_args import device_label, devices_module, is_simulated
from cudalab.magics.memory_pools import pools_data, pools_html, pools_text

__all__ = ["MemoryMark", "diff_data", "diff_html", "diff_text", "summary_data", "summary_html",
           "summary_text"]


_ROWS = (
    ("Allocated memory", "allocated_bytes", True),
    ("Active memory", "active_bytes", True),
    ("Requested memory", "requested_bytes", True),
    ("GPU reserved memory", "reserved_bytes", True),
    ("Non-releasable memory", "inactive_split_bytes", True),
    ("Allocations", "allocation", False),
    ("Active allocs", "active", False),
    ("GPU reserved segments", "segment", False),
    ("Non-releasable allocs", "inactive_split", False),
)
_COLS = (("current", "Cur Usage"), ("peak", "Peak Usage"), ("allocated", "Tot Alloc"),
         ("freed", "Tot Freed"))
_POOLS = (("all", ""), ("large_pool", "  from large pool"), ("small_pool", "  from small pool"))


def summary_data(device: int) -> dict[str, Any]:
    """Everything the summary shows, as plain data (also used by the tests)."""
    import cudalab.memory as cm

    stats = cm.memory_stats(device)
    free, total = devices_module().mem_get_info(device)
    alloc = stats.get("allocated_bytes.all.current", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    return {
        "device": device,
        "stats": stats,
        "allocated": alloc,
        "reserved": reserved,
        "gap": reserved - alloc,
        "num_ooms": stats.get("num_ooms", 0),
        "num_alloc_retries": stats.get("num_alloc_retries", 0),
        "num_sync_all_streams": stats.get("num_sync_all_streams", 0),
        "device_free": free,
        "device_total": total,
        "backend": cm.get_allocator_backend(),
        "simulated": is_simulated(),
        "pools": pools_data(device),  # private pools: a section of their own when any
    }


def _cell(key: str, col: str, stats: dict, is_bytes: bool) -> str:
    v = stats.get(f"{key}.{col}", 0)
    return format_bytes(v) if is_bytes else str(v)


def summary_text(data: dict) -> str:
    st = data["stats"]
    d = data["device"]
    head = (f"cudalab memory summary, {device_label(d)} ({data['backend']} allocator) | OOMs: "
            f"{data['num_ooms']} | cudaMalloc retries: {data['num_alloc_retries']}")
    lines = [head, f"{'':<28}" + "".join(f"{title:>12}" for _c, title in _COLS)]
    for title, key, is_bytes in _ROWS:
        for pool, suffix in _POOLS:
            label = title if pool == "all" else suffix
            lines.append(f"{label:<28}" + "".join(
                f"{_cell(f'{key}.{pool}', col, st, is_bytes):>12}" for col, _t in _COLS))
    gap, res = data["gap"], data["reserved"]
    pct = f" ({gap / res:.0%} of reserved)" if res else ""
    lines.append(f"reserved - allocated (cached, fragmentation): {format_bytes(gap)}{pct}")
    free, total = data["device_free"], data["device_total"]
    warn = "   <- less than 10% free" if total and free < 0.1 * total else ""
    lines.append(f"device free / total (driver, all processes): {format_bytes(free)} / "
                 f"{format_bytes(total)}{warn}")
    if data["pools"]["pools"]:
        lines.append(pools_text(data["pools"]))
    return "\n".join(lines)


def summary_html(data: dict) -> str:
    e = html.escape
    st = data["stats"]
    d = data["device"]
    out = ['<div class="cudalab-memory">',
           f"<b>cudalab memory summary</b>, {e(device_label(d))}, {e(data['backend'])} allocator | "
           f"OOMs: {data['num_ooms']} | cudaMalloc retries: {data['num_alloc_retries']}",
           '<table style="border-collapse:collapse;font-family:monospace;font-size:12px">',
           "<tr><th></th>" + "".join(f"<th style='text-align:right'>{e(t)}</th>"
                                     for _c, t in _COLS) + "</tr>"]
    for title, key, is_bytes in _ROWS:
        for pool, suffix in _POOLS:
            label = title if pool == "all" else suffix.strip()
            style = "" if pool == "all" else " style='color:#666;padding-left:1.5em'"
            out.append(f"<tr><td{style}>{e(label)}</td>" + "".join(
                f"<td style='text-align:right'>{e(_cell(f'{key}.{pool}', col, st, is_bytes))}</td>"
                for col, _t in _COLS) + "</tr>")
    out.append("</table>")
    alloc, res, gap = data["allocated"], data["reserved"], data["gap"]
    free, total = data["device_free"], data["device_total"]
    other = max(0, total - free - res)
    if total:
        def seg(nbytes: int, color: str, title: str) -> str:
            w = 100.0 * nbytes / total
            return (f"<div title='{e(title)}' style='width:{w:.3f}%;background:{color};"
                    "height:100%;display:inline-block'></div>")

        out.append("<div style='width:100%;max-width:600px;height:14px;border:1px solid #999;"
                   "font-size:0;white-space:nowrap;margin-top:4px'>"
                   + seg(alloc, "#2563eb", f"allocated {format_bytes(alloc)}")
                   + seg(gap, "#93c5fd", f"cached (reserved - allocated) {format_bytes(gap)}")
                   + seg(other, "#9ca3af", f"used outside this allocator {format_bytes(other)}")
                   + "</div>")
        out.append("<div style='font-size:11px;color:#555'>blue: allocated, light blue: cached "
                   "by the allocator, grey: other device memory in use, white: free</div>")
    pct = f" ({gap / res:.0%} of reserved)" if res else ""
    out.append(f"<div>reserved − allocated (cached, fragmentation): {e(format_bytes(gap))}{pct}</div>")
    color = " style='color:#b91c1c;font-weight:bold'" if total and free < 0.1 * total else ""
    out.append(f"<div{color}>device free / total (driver, all processes): "
               f"{e(format_bytes(free))} / {e(format_bytes(total))}</div>")
    if data["pools"]["pools"]:
        out.append(pools_html(data["pools"]))
    out.append("</div>")
    return "\n".join(out)


# =============================================================================== diff
_DIFF_KEYS = (
    ("allocated", "allocated_bytes.all.current", True),
    ("reserved", "reserved_bytes.all.current", True),
    ("active", "active_bytes.all.current", True),
    ("requested", "requested_bytes.all.current", True),
    ("non-releasable", "inactive_split_bytes.all.current", True),
    ("allocations (live)", "allocation.all.current", False),
    ("segments", "segment.all.current", False),
    ("bytes allocated (total)", "allocated_bytes.all.allocated", True),
    ("bytes freed (total)", "allocated_bytes.all.freed", True),
    ("allocation calls", "allocation.all.allocated", False),
    ("cudaMalloc calls", "num_device_alloc", False),
    ("cudaFree calls", "num_device_free", False),
    ("cudaMalloc retries", "num_alloc_retries", False),
    ("OOMs", "num_ooms", False),
)


class MemoryMark:
    __slots__ = ("device", "stats", "scope", "t")

    def __init__(self, device: int, stats: dict, scope: Any):
        self.device = device
        self.stats = stats
        self.scope = scope
        self.t = time.perf_counter()


def diff_data(mark: MemoryMark) -> dict[str, Any]:
    import cudalab.memory as cm

    now = cm.memory_stats(mark.device)
    rows = []
    for label, key, is_bytes in _DIFF_KEYS:
        a, b = mark.stats.get(key, 0), now.get(key, 0)
        rows.append({"what": label, "key": key, "at_mark": a, "now": b, "delta": b - a,
                     "bytes": is_bytes})
    start = mark.stats.get("allocated_bytes.all.current", 0)
    peak = mark.scope.peak_allocated if mark.scope is not None else None
    return {"device": mark.device, "rows": rows, "peak": peak,
            "peak_above_mark": None if peak is None else peak - start,
            "elapsed": time.perf_counter() - mark.t}


def diff_text(data: dict) -> str:
    lines = [f"cudalab memory diff since the mark, {device_label(data['device'])} "
             f"({format_time(data['elapsed'])} ago)"]
    lines.append(f"{'':<26}{'at mark':>14}{'now':>14}{'change':>14}")
    for r in data["rows"]:
        f = (lambda v, s=False: format_bytes(v, signed=s)) if r["bytes"] else (
            lambda v, s=False: (f"{v:+d}" if s else str(v)))
        lines.append(f"{r['what']:<26}{f(r['at_mark']):>14}{f(r['now']):>14}"
                     f"{f(r['delta'], True):>14}")
    if data["peak"] is not None:
        lines.append(f"peak allocated since the mark: {format_bytes(data['peak'])} "
                     f"({format_bytes(data['peak_above_mark'], signed=True)} above the mark; scoped, "
                     "no peak statistic was reset)")
    return "\n".join(lines)


def diff_html(data: dict) -> str:
    e = html.escape
    out = [f"<div><b>cudalab memory diff</b> since the mark, {e(device_label(data['device']))} "
           f"({e(format_time(data['elapsed']))} ago)",
           '<table style="border-collapse:collapse;font-family:monospace;font-size:12px">'
           "<tr><th></th><th>at mark</th><th>now</th><th>change</th></tr>"]
    for r in data["rows"]:
        if r["bytes"]:
            a, b, c = (format_bytes(r["at_mark"]), format_bytes(r["now"]),
                       format_bytes(r["delta"], signed=True))
        else:
            a, b, c = str(r["at_mark"]), str(r["now"]), f"{r['delta']:+d}"
        color = "" if r["delta"] == 0 else (" style='color:#b91c1c'" if r["delta"] > 0
                                            else " style='color:#15803d'")
        out.append(f"<tr><td>{e(r['what'])}</td><td style='text-align:right'>{e(a)}</td>"
                   f"<td style='text-align:right'>{e(b)}</td>"
                   f"<td style='text-align:right'{color}>{e(c)}</td></tr>")
    out.append("</table>")
    if data["peak"] is not None:
        out.append(f"<div>peak allocated since the mark: {e(format_bytes(data['peak']))} "
                   f"({e(format_bytes(data['peak_above_mark'], signed=True))} above the mark)</div>")
    out.append("</div>")
    return "\n".join(out)

