"""Flame-graph SVGs of a snapshot's memory: torch's ``_save_segment_usage`` and
``_save_memory_usage`` (``torch.cuda._memory_viz.segments`` / ``memory``).

torch writes each block of each segment as a "folded stack" line (Brendan Gregg's format,
``frame;frame;frame weight``) and renders the lines with ``flamegraph.pl``, which it
downloads and runs with Perl. cudalab builds the same lines and renders them itself, so
nothing is downloaded and no Perl is needed:

* :func:`segments`: ``stream_<stream>;seg_<address>;<state>;<frames...> <bytes>``, one
  column per segment, so the plot shows how each segment is used;
* :func:`memory`: ``stream_<stream>;<state>;<frames...> <bytes>``, the segments of a
  stream merged, so the plot shows what holds memory.

A block's weight is its requested size when it is allocated (the rounding shows as a
``<gaps>`` frame beside it) and its size otherwise; frames are ``file:line:function``,
outermost first, ``<non-python>`` when the block has none (record the history with stacks
to get them: ``cudalab.memory._record_memory_history()``).

The picture is an icicle graph (the root on top): each rectangle's width is its bytes,
its tooltip (SVG ``<title>``) names it with its bytes and share.
"""

from __future__ import annotations

import html
import zlib
from typing import Any

from cudalab._atomic_write import write_bytes_atomic
from cudalab._units import format_bytes

__all__ = ["_save_memory_usage", "_save_segment_usage", "folded_memory", "folded_segments",
           "flamegraph_svg", "memory", "segments"]

#: Picture geometry (pixels): total width, row height, margin, and the narrowest rectangle
#: drawn (flamegraph.pl's ``minwidth``).
WIDTH = 1200
ROW_HEIGHT = 17
MARGIN = 10
MIN_WIDTH = 0.1
#: The frame used for a block without a stack, and for a block's rounding (torch's names).
NON_PYTHON = "<non-python>"
GAPS = "<gaps>"


# --------------------------------------------------------------------------- folded stacks
def _frame_text(frame: dict[str, Any]) -> str:
    """``file:line:function`` (the file's base name), as torch's ``_frame_fmt``."""
    filename = str(frame.get("filename", "?")).replace("\\", "/").split("/")[-1]
    return f"{filename}:{frame.get('line', 0)}:{frame.get('name', '?')}"


def _write_blocks(lines: list[str], prefix: str, blocks: list[dict[str, Any]]) -> None:
    for b in blocks:
        size = int(b.get("size", 0))
        state = b.get("state", "inactive")
        frames = b.get("frames") or []
        accounted = int(b.get("requested_size", size)) if state == "active_allocated" else size
        stack = ";".join(_frame_text(f) for f in reversed(frames)) if frames else NON_PYTHON
        stack = stack.replace(" ", "_")  # the weight follows the last space
        if accounted > 0:
            lines.append(f"{prefix};{state};{stack} {accounted}")
        if size - accounted > 0:
            lines.append(f"{prefix};{state};{GAPS} {size - accounted}")


def folded_segments(snapshot: dict[str, Any]) -> str:
    """The folded-stack lines of :func:`segments` (one segment per column).

    Parameters
    ----------
    snapshot : dict
        A snapshot (``cudalab.memory._snapshot()``, :func:`cudalab.memory.load_snapshot`).

    Returns
    -------
    str
        One ``frame;frame;... bytes`` line per block part, newline-separated.
    """
    lines: list[str] = []
    for seg in snapshot.get("segments") or []:
        _write_blocks(lines, f"stream_{seg.get('stream', 0)};seg_{seg.get('address', 0)}",
                      seg.get("blocks") or [])
    return "\n".join(lines)


def folded_memory(snapshot: dict[str, Any]) -> str:
    """The folded-stack lines of :func:`memory` (the segments of a stream merged).

    Parameters
    ----------
    snapshot : dict
        A snapshot.

    Returns
    -------
    str
        One ``frame;frame;... bytes`` line per block part, newline-separated.
    """
    lines: list[str] = []
    for seg in snapshot.get("segments") or []:
        _write_blocks(lines, f"stream_{seg.get('stream', 0)}", seg.get("blocks") or [])
    return "\n".join(lines)


# --------------------------------------------------------------------------- rendering
class _Node:
    __slots__ = ("name", "total", "children")

    def __init__(self, name: str):
        self.name = name
        self.total = 0
        self.children: dict[str, _Node] = {}


def _tree(folded: str) -> _Node:
    root = _Node("all")
    for line in folded.splitlines():
        stack, _, weight = line.rpartition(" ")
        if not stack or not weight.isdigit():
            continue
        n = int(weight)
        node = root
        node.total += n
        for name in stack.split(";"):
            child = node.children.get(name)
            if child is None:
                child = node.children[name] = _Node(name)
            child.total += n
            node = child
    return root


def _depth(node: _Node) -> int:
    return 1 + max((_depth(c) for c in node.children.values()), default=0)


def _color(name: str) -> str:
    """A warm colour that depends only on the name (flamegraph.pl's "hot" palette)."""
    h = zlib.crc32(name.encode())
    return f"rgb({205 + h % 50},{(h >> 8) % 200},{(h >> 16) % 55})"


def flamegraph_svg(folded: str, title: str) -> str:
    """Render folded-stack lines as an icicle graph SVG.

    Parameters
    ----------
    folded : str
        ``frame;frame;... weight`` lines (malformed lines are skipped).
    title : str
        The heading.

    Returns
    -------
    str
        A standalone SVG document (says "no memory" when the lines weigh nothing).
    """
    root = _tree(folded)
    rows = _depth(root)
    height = 2 * MARGIN + 24 + rows * ROW_HEIGHT
    out = [
        '<?xml version="1.0" standalone="no"?>',
        f'<svg version="1.1" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        'xmlns="http://www.w3.org/2000/svg" font-family="Verdana, sans-serif" font-size="11">',
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#f8f8f8"/>',
        f'<text x="{WIDTH // 2}" y="{MARGIN + 12}" text-anchor="middle" font-size="15">'
        f'{html.escape(title)}</text>',
    ]
    if root.total <= 0:
        out.append(f'<text x="{MARGIN}" y="{MARGIN + 40}">no memory</text>')
        out.append("</svg>")
        return "\n".join(out) + "\n"
    scale = (WIDTH - 2 * MARGIN) / root.total
    top = MARGIN + 24

    def draw(node: _Node, x: float, level: int) -> None:
        w = node.total * scale
        if w < MIN_WIDTH:
            return
        y = top + level * ROW_HEIGHT
        label = html.escape(node.name)
        tip = f"{label} ({html.escape(format_bytes(node.total))}, {node.total} bytes, " \
              f"{100.0 * node.total / root.total:.2f}%)"
        out.append(f'<g><title>{tip}</title><rect x="{x:.2f}" y="{y}" width="{w:.2f}" '
                   f'height="{ROW_HEIGHT - 1}" fill="{_color(node.name)}" rx="2" ry="2"/>')
        chars = int((w - 6) / 7)  # ~7 px per character at 11 px
        if chars >= 3:
            text = node.name if len(node.name) <= chars else node.name[:chars - 2] + ".."
            out.append(f'<text x="{x + 3:.2f}" y="{y + ROW_HEIGHT - 5}">{html.escape(text)}'
                       "</text>")
        out.append("</g>")
        cx = x
        for child in node.children.values():
            draw(child, cx, level + 1)
            cx += child.total * scale

    draw(root, float(MARGIN), 0)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def segments(snapshot: dict[str, Any]) -> str:
    """torch's ``_memory_viz.segments``: the SVG of how each segment is used.

    Parameters
    ----------
    snapshot : dict
        A snapshot.

    Returns
    -------
    str
        The SVG document.
    """
    return flamegraph_svg(folded_segments(snapshot), "cudalab segment usage")


def memory(snapshot: dict[str, Any]) -> str:
    """torch's ``_memory_viz.memory``: the SVG of what holds memory, per stream.

    Parameters
    ----------
    snapshot : dict
        A snapshot.

    Returns
    -------
    str
        The SVG document.
    """
    return flamegraph_svg(folded_memory(snapshot), "cudalab memory usage")


# --------------------------------------------------------------------------- files
def _snapshot_or_now(snapshot: dict[str, Any] | None) -> dict[str, Any]:
    if snapshot is None:
        from cudalab.memory_tools.snapshot import take_snapshot

        return take_snapshot()
    if not isinstance(snapshot, dict):
        raise TypeError(f"snapshot must be a snapshot dict (cudalab.memory._snapshot()), got "
                        f"{type(snapshot).__name__}")
    return snapshot


def _save_segment_usage(filename: Any = "output.svg", snapshot: dict[str, Any] | None = None) -> None:
    """Write :func:`segments`'s SVG to ``filename`` (torch's
    ``torch.cuda.memory._save_segment_usage``).

    Parameters
    ----------
    filename : str or os.PathLike, optional
        The file (default ``"output.svg"``), written atomically (a temporary file in the
        same directory, then renamed).
    snapshot : dict, optional
        The snapshot to draw (default: one taken now, ``cudalab.memory._snapshot()``).

    Raises
    ------
    TypeError
        When ``snapshot`` is not a dict.
    OSError
        When the file cannot be written (nothing is left behind).
    """
    write_bytes_atomic(filename, segments(_snapshot_or_now(snapshot)).encode())


def _save_memory_usage(filename: Any = "output.svg", snapshot: dict[str, Any] | None = None) -> None:
    """Write :func:`memory`'s SVG to ``filename`` (torch's
    ``torch.cuda.memory._save_memory_usage``).

    Parameters
    ----------
    filename : str or os.PathLike, optional
        The file (default ``"output.svg"``), written atomically.
    snapshot : dict, optional
        The snapshot to draw (default: one taken now, ``cudalab.memory._snapshot()``).

    Raises
    ------
    TypeError
        When ``snapshot`` is not a dict.
    OSError
        When the file cannot be written (nothing is left behind).
    """
    write_bytes_atomic(filename, memory(_snapshot_or_now(snapshot)).encode())
