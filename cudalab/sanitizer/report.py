"""What the sanitizer reports: :class:`Access`, :class:`Report`, their text and HTML.

A report names the race's kind (:data:`KINDS`), the allocation (address, size, the stack
that allocated it), the two accesses (stream, what ran, read or write, the bytes, the stack:
the user's frames, a notebook cell's line, not cudalab's) and the fix that orders them. The
text follows torch's CSAN ``UnsynchronizedAccessError``; :func:`html_table` renders many
reports for a notebook (``%%cuda_sanitize``).
"""

from __future__ import annotations

import html
import linecache
import os
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cudalab._units import format_bytes
from cudalab.memory_tools.user_frames import is_tool_frame

__all__ = [
    "Access",
    "HOST_READ",
    "KINDS",
    "NOT_SEEN",
    "RACE",
    "READ",
    "Report",
    "StreamRaceError",
    "StreamRaceWarning",
    "UNSAFE_REUSE",
    "WRITE",
    "format_stack",
    "html_table",
    "stream_name",
    "user_frames",
]

#: Access types (torch's AccessType: "reading from" / "writing to").
READ = "read"
WRITE = "write"
#: Report kinds: two streams, unordered, at least one writing; the host reading memory whose
#: writer it has not waited for; memory freed while another stream may still use it.
RACE = "unsynchronized access"
HOST_READ = "host read before the writer finished"
UNSAFE_REUSE = "unsafe reuse"
KINDS = (RACE, HOST_READ, UNSAFE_REUSE)

#: The footer of every report: what the sanitizer cannot see.
NOT_SEEN = ("Not seen by the sanitizer: work that other libraries (CuPy, torch, Numba, raw "
            "cuda-python) queue on this memory, and kernels launched without an access "
            "annotation other than through cudalab.")


def stream_name(key: tuple[int, int]) -> str:
    """How a report names a stream key ``(device, handle)``."""
    device, handle = key
    if handle == 0:
        return f"the default stream of cuda:{device}"
    return f"stream {handle:#x} on cuda:{device}"


#: Where library code lives: the standard library, site-packages, cudalab itself.
_LIBRARY_DIRS = tuple(sorted({os.path.join(os.path.abspath(p), "") for p in (
    *(sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
) if p}))


def _is_library(filename: str) -> bool:
    if filename.startswith("<frozen"):
        return True
    return os.path.abspath(filename).startswith(_LIBRARY_DIRS) if filename[:1] != "<" else False


#: A frame dict (``{"filename", "line", "name"}``, as ``stacks.frames_to_dicts`` makes).
_Frame = TypeVar("_Frame", bound=Mapping[str, Any])


def user_frames(frames: Sequence[_Frame]) -> list[_Frame]:
    """The user's part of a stack (innermost first): its frames up to the first one of a
    library (the standard library, site-packages, cudalab; a notebook's kernel and the
    magic that ran the cell are cut off), at least one frame."""
    out: list[_Frame] = []
    for frame in frames:
        if out and _is_library(frame["filename"]):
            break
        out.append(frame)
    return out


def _where(filename: str) -> str:
    """``File "f"``, or IPython's ``Cell In[n]`` for a notebook cell's code."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    name_of = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if name_of is not None:
        try:
            label = name_of(filename)
        except Exception:
            label = None
        if label:
            return f"{label[0]} {label[1]}"
    return f'File "{filename}"'


def format_stack(frames: Sequence[Mapping[str, Any]]) -> str:
    """torch's frame lines (``  File "f", line n, in name`` and the source), outermost first;
    a notebook cell shows as ``Cell In[n]``."""
    out = []
    for frame in reversed(frames):
        out.append(f'  {_where(frame["filename"])}, line {frame["line"]}, in {frame["name"]}\n')
        source = linecache.getline(frame["filename"], frame["line"]).strip()
        if source:
            out.append(f"    {source}\n")
    return "".join(out)


@dataclass(slots=True)
class Access:
    """One access to device memory, as the sanitizer recorded it.

    Invariants: ``start <= end`` (bytes ``[start, end)``); ``seq`` is the access's number in
    the happens-before order (:class:`cudalab.sanitizer.state.StreamSynchronizations`).
    """

    type: str  # READ or WRITE
    seq: int
    stream: tuple[int, int]  # (device, handle)
    operation: str  # what ran: "kernel cudalab_fill_u32", "copy (device to host)", "free", ...
    start: int
    end: int
    #: The user's frames, innermost first: raw frames in the tracker's records, frame dicts
    #: (``{"filename", "line", "name"}``) in a :class:`Report`.
    stack: Any = ()
    #: In a :class:`Report`, the frames beyond the user's (IPython's, ipykernel's, the
    #: libraries'), innermost first: folded in the HTML, one click away; empty in records.
    folded: Any = ()

    def describe(self) -> str:
        verb = "reading from" if self.type == READ else "writing to"
        return (f"{self.operation}\n{verb} bytes [{self.start:#x}, {self.end:#x}) "
                f"({format_bytes(self.end - self.start)})\nWith stack trace:\n"
                f"{format_stack(self.stack)}")


@dataclass(slots=True)
class Report:
    """One finding: ``kind`` (one of :data:`KINDS`), the allocation, both accesses, the fix."""

    kind: str
    allocation_ptr: int
    allocation_size: int  # bytes (0: unknown, memory allocated before the sanitizer was on)
    allocation_stack: list[Mapping[str, Any]] | None  # None: the allocation was not seen
    current: Access
    previous: Access
    fix: str
    simulated: bool = False  # found on the simulator (the text says so)
    #: The allocation's frames beyond the user's (folded in the HTML), innermost first.
    allocation_folded: list[Mapping[str, Any]] = field(default_factory=list)

    @property
    def title(self) -> str:
        if self.kind == RACE:
            what = {(READ, WRITE): "read after write", (WRITE, READ): "write after read",
                    (WRITE, WRITE): "write after write"}.get((self.current.type, self.previous.type),
                                                             "access")
            return f"possible data race ({what})"
        return self.kind

    def __str__(self) -> str:
        size = format_bytes(self.allocation_size) if self.allocation_size else "size unknown"
        lines = [
            "============================",
            f"cudalab sanitizer detected a {self.title} on allocation "
            f"{self.allocation_ptr:#x} ({size}) of cuda:{self.current.stream[0]}"
            f"{' (simulated)' if self.simulated else ''}",
            f"Access by {stream_name(self.current.stream)} during {self.current.describe()}",
            f"Previous access by {stream_name(self.previous.stream)} during "
            f"{self.previous.describe()}",
        ]
        if self.allocation_stack is None:
            lines.append("Trace for the allocation not found (allocated before the sanitizer "
                         "was enabled, or not by cudalab).\n")
        else:
            lines.append(f"Allocation was made with stack trace:\n"
                         f"{format_stack(self.allocation_stack)}")
        lines.append(f"Fix: {self.fix}")
        lines.append(NOT_SEEN)
        return "\n".join(lines)


class StreamRaceError(RuntimeError):
    """Raised (in ``on_race="raise"`` mode) with the reports of one operation.

    Attributes
    ----------
    reports : list of Report
        What was found; ``str(error)`` is their text.
    """

    def __init__(self, reports: list[Report]):
        self.reports = list(reports)
        super().__init__(f"detected {len(reports)} error{'s' if len(reports) != 1 else ''}\n"
                         + "\n".join(str(r) for r in reports))


class StreamRaceWarning(RuntimeWarning):
    """Warned (in ``on_race="warn"`` mode) with the text of one report."""


def _frame_rows(frames: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = []
    for frame in frames:  # as format_stack: a notebook cell is "Cell In[n]", with the line
        row = (f"{html.escape(_where(frame['filename']))}, line {frame['line']}, in "
               f"<code>{html.escape(frame['name'])}</code>")
        source = linecache.getline(frame["filename"], frame["line"]).strip()
        if source:
            row += f"<br>&nbsp;&nbsp;<code>{html.escape(source)}</code>"
        rows.append(row)
    return rows


def _stack_html(frames: Sequence[Mapping[str, Any]] | None,
                folded: Sequence[Mapping[str, Any]] = ()) -> str:
    """The user's frames (four at most), then the rest (IPython's, ipykernel's, the
    libraries') folded in a ``<details>``: one click away."""
    if not frames:
        return "<i>not seen</i>"
    text = "<br>".join(_frame_rows(frames[:4]))
    rest = [*frames[4:], *folded]
    if rest:
        tool = sum(1 for f in rest if is_tool_frame(f))
        what = f", {tool} of IPython/ipykernel" if tool else ""
        text += (f"<details class='cudalab-folded'><summary>{len(rest)} more frame"
                 f"{'s' if len(rest) != 1 else ''} (folded{what})</summary>"
                 + "<br>".join(_frame_rows(rest[:40])) + "</details>")
    return text


def _access_html(access: Access) -> str:
    verb = "reads" if access.type == READ else "writes"
    return (f"<b>{html.escape(stream_name(access.stream))}</b> {verb}<br>"
            f"{html.escape(access.operation)}<br>{_stack_html(access.stack, access.folded)}")


def html_table(reports: list[Report], accesses: int) -> str:
    """The reports as one HTML table (a notebook's rich output), or the all-clear line.

    Parameters
    ----------
    reports : list of Report
        The findings.
    accesses : int
        How many accesses were checked.

    Returns
    -------
    str
        HTML.
    """
    if not reports:
        return (f"<p><b>no unsynchronized access found</b> ({accesses} accesses checked)</p>"
                f"<p style='font-size:smaller'>{html.escape(NOT_SEEN)}</p>")
    head = ("<tr><th>#</th><th>finding</th><th>allocation</th><th>access</th>"
            "<th>previous access</th><th>fix</th></tr>")
    rows = []
    for i, r in enumerate(reports, 1):
        size = format_bytes(r.allocation_size) if r.allocation_size else "size unknown"
        rows.append(
            f"<tr style='vertical-align:top'><td>{i}</td><td>{html.escape(r.title)}</td>"
            f"<td><code>{r.allocation_ptr:#x}</code> ({size})<br>"
            f"{_stack_html(r.allocation_stack, r.allocation_folded)}</td>"
            f"<td>{_access_html(r.current)}</td><td>{_access_html(r.previous)}</td>"
            f"<td>{html.escape(r.fix)}</td></tr>")
    return (f"<p><b>{len(reports)} finding{'s' if len(reports) != 1 else ''}</b> "
            f"({accesses} accesses checked)</p>"
            f"<table>{head}{''.join(rows)}</table>"
            f"<p style='font-size:smaller'>{html.escape(NOT_SEEN)}</p>")
