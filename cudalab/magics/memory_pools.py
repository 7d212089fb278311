"""``%cuda_memory pools``: the private memory pools of a device (CUDA graph pools and
``MemPool``\\ s), as plain data, text and HTML; the summary shows the same table when a
device has pools."""

from __future__ import annotations

import html
from typing import Any

from cudalab._internal import format_bytes
from cudalab.magics.memory_args import device_label

__all__ = ["pools_data", "pools_html", "pools_text"]

#: (title, key) of the table's columns.
_COLUMNS = (("pool id", "id"), ("kind", "kind"), ("use count", "use_count"),
            ("segments", "segments"), ("reserved", "reserved_bytes"),
            ("allocated", "allocated_bytes"), ("state", "state"))


def _state_word(pool: dict) -> str:
    if pool["routed"]:
        return "allocating"  # a capture or use_mem_pool routes allocations to it now
    if pool["freeable"]:
        return "released"  # use count 0: empty_cache() gives its free segments back
    return "kept"


def pools_data(device: int) -> dict[str, Any]:
    """The private pools of ``device``: ``{"device", "pools": [row, ...]}``, one row per
    pool (``cudalab.memory.private_pools`` plus ``state``: allocating, kept or released)."""
    import cudalab.memory as cm

    rows = []
    for p in cm.private_pools(device):
        row = dict(p)
        row["state"] = _state_word(p)
        rows.append(row)
    return {"device": device, "pools": rows}


def _cell(row: dict, key: str) -> str:
    v = row[key]
    if key.endswith("_bytes"):
        return format_bytes(v)
    if key == "id":
        return f"({v[0]}, {v[1]})"
    return str(v)


def pools_text(data: dict, title: bool = True) -> str:
    """The table as text (with a heading line unless ``title`` is False)."""
    rows = data["pools"]
    lines = []
    if title:
        lines.append(f"cudalab private memory pools, {device_label(data['device'])}: {len(rows)}")
    if not rows:
        lines.append("no private pools (CUDA graph captures and MemPool make them)")
        return "\n".join(lines)
    cells = [[t for t, _k in _COLUMNS]] + [[_cell(r, k) for _t, k in _COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(_COLUMNS))]
    for c in cells:
        lines.append("  ".join(v.rjust(w) if i >= 2 and i < 6 else v.ljust(w)
                               for i, (v, w) in enumerate(zip(c, widths))).rstrip())
    lines.append("kind: graph = made by a graph capture, user = graph_pool_handle() or MemPool; "
                 "released pools go back to the driver with empty_cache()")
    return "\n".join(lines)


def pools_html(data: dict, title: bool = True) -> str:
    """The table as HTML."""
    e = html.escape
    rows = data["pools"]
    out = ['<div class="cudalab-memory-pools">']
    if title:
        out.append(f"<b>cudalab private memory pools</b>, {e(device_label(data['device']))}: "
                   f"{len(rows)}")
    if not rows:
        out.append("<div>no private pools (CUDA graph captures and MemPool make them)</div>")
        out.append("</div>")
        return "\n".join(out)
    out.append('<table style="border-collapse:collapse;font-family:monospace;font-size:12px">')
    out.append("<tr>" + "".join(f"<th>{e(t)}</th>" for t, _k in _COLUMNS) + "</tr>")
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{e(_cell(r, k))}</td>" for _t, k in _COLUMNS)
                   + "</tr>")
    out.append("</table></div>")
    return "\n".join(out)
