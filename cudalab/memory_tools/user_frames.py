"""User frames first: the notebook machinery's own frames, folded wherever stacks are shown.

A stack recorded in a notebook holds the user's frame (the cell, ``<ipython-input-…>`` or
``/tmp/ipykernel_…/….py``) under about eight frames of IPython and ipykernel
(``run_code``, ``run_ast_nodes``, ``run_cell_async``, ``dispatch_shell``, …) and of the
event loop that drives them (tornado, asyncio, runpy). :func:`is_tool_frame` tells those
apart by file; :func:`fold_frames` splits a stack into the frames to show and the count
folded away, and :func:`frames_html` draws it with the folded ones one click away (an HTML
``<details>``), as the snapshot viewer, the explorer, the sanitizer's report and the
what-if reports do.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["TOOL_FRAME_PATTERN", "fold_frames", "frames_html", "frame_label", "is_tool_frame",
           "first_user_frame"]

#: The files of the notebook machinery: IPython, ipykernel, the kernel's event loop and
#: launchers (a frame whose file matches is folded).
TOOL_FRAME_PATTERN = re.compile(
    r"[/\\](?:IPython|ipykernel|ipykernel_launcher\.py|tornado|traitlets|jupyter_client|zmq)"
    r"(?:[/\\]|$)"
    r"|[/\\]asyncio[/\\](?:base_events|events|runners|tasks)\.py$"
    r"|[/\\](?:runpy|threading|contextlib)\.py$")


def _parts(frame: Any) -> tuple[str, str, int]:
    """``(filename, name, line)`` of a frame dict (torch's keys) or tuple."""
    if isinstance(frame, dict):
        return (str(frame.get("filename", "")), str(frame.get("name", "")),
                int(frame.get("line", 0) or 0))
    filename, name, line = frame
    return str(filename), str(name), int(line)


def is_tool_frame(frame: Any) -> bool:
    """Whether ``frame`` (a dict with ``filename``, or ``(filename, name, line)``) belongs to
    IPython, ipykernel or the event loop that runs them, not to the user's code."""
    return TOOL_FRAME_PATTERN.search(_parts(frame)[0]) is not None


def fold_frames(frames: Sequence[Any]) -> tuple[list[Any], int]:
    """``(the frames to show, how many were folded)``: the machinery's frames left out,
    the user's kept in order. A stack of nothing but machinery is shown whole."""
    shown = [f for f in frames if not is_tool_frame(f)]
    if not shown:
        return list(frames), 0
    return shown, len(frames) - len(shown)


def first_user_frame(frames: Iterable[Any]) -> Any | None:
    """The innermost frame that is not the machinery's (None when there is none)."""
    first = None
    for f in frames:
        if first is None:
            first = f
        if not is_tool_frame(f):
            return f
    return first


def frame_label(frame: Any) -> str:
    """``"train.py:42 (forward)"``: the file's last part, the line and the function."""
    filename, name, line = _parts(frame)
    base = re.split(r"[/\\]", filename)[-1] or filename
    return f"{base}:{line} ({name})"


def frames_html(frames: Sequence[Any], *, limit: int = 12) -> str:
    """A stack as HTML, innermost first: the user's frames, then the folded machinery's in
    a ``<details>`` element (one click away); at most ``limit`` frames of each."""
    shown, folded = fold_frames(frames)

    def rows(fs: Sequence[Any]) -> str:
        out = []
        for f in fs[:limit]:
            filename, name, line = _parts(f)
            out.append(f"<div title='{html.escape(filename)}'>{html.escape(frame_label(f))}"
                       "</div>")
        if len(fs) > limit:
            out.append(f"<div>… {len(fs) - limit} more</div>")
        return "".join(out)

    if not frames:
        return "<i>no frames recorded</i>"
    text = rows(shown)
    if folded:
        hidden = [f for f in frames if is_tool_frame(f)]
        text += (f"<details class='cudalab-folded'><summary>{folded} IPython/ipykernel "
                 f"frame{'s' if folded != 1 else ''} folded</summary>{rows(hidden)}</details>")
    return text
