"""The explanation of an out-of-memory error as an HTML panel and as text.

:func:`render` is :meth:`OOMExplanation._repr_html_ <cudalab.oom.explain.OOMExplanation>`:
the summary sentence, a stacked bar of the device's memory by category, the accounting table,
the holders of the largest arrays (disposable ones marked), the allocation sites, the
counterfactual replays and what the explanation cannot tell. :func:`text` is the same for a
terminal. Everything shown is escaped; a simulated device is labelled.
"""

from __future__ import annotations

import html
from typing import Any

from cudalab._internal import format_bytes

__all__ = ["render", "text"]

_COLOURS = {
    "live": "#4878cf", "cached free (small pool)": "#f0a030", "cached free (large pool)": "#e07b20",
    "private pools": "#9c6ad0", "pending frees": "#d04a4a", "CUDA context (estimate)": "#777777",
    "this process outside any allocator": "#aa5577", "other processes": "#3a9a5a",
    "free": "#dddddd", "unattributed": "#bbbbbb",
}


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _bar(acc: Any, total: int) -> str:
    parts = []
    for r in acc.itertuples(index=False):
        if r.bytes <= 0 or not total:
            continue
        pct = 100.0 * r.bytes / total
        colour = _COLOURS.get(r.category, "#999999")
        label = f"{r.category} ({r.source}): {format_bytes(r.bytes)}"
        parts.append(f"<div title='{_esc(label)}' style='width:{pct:.3f}%;background:{colour};"
                     "height:14px;display:inline-block'></div>")
    return ("<div style='width:100%;border:1px solid #888;line-height:0;white-space:nowrap;"
            f"overflow:hidden'>{''.join(parts)}</div>")


def _table(rows: list[list[str]], header: list[str]) -> str:
    head = "".join(f"<th style='text-align:left'>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{c}</td>" for c in row)
                   + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render(expl: Any) -> str:
    """The HTML panel of an :class:`~cudalab.oom.explain.OOMExplanation`."""
    acc = expl.accounting
    total = int(acc.attrs.get("total", 0))
    sim = " (SIMULATED device)" if expl.state.simulated else ""
    out = [f"<div class='cudalab-oom'><h4>Why cuda:{expl.device} ran out of memory{sim}</h4>",
           f"<p><b>{_esc(expl.verdict)}</b>: {_esc(expl.summary())}</p>", _bar(acc, total)]
    rows = [[_esc(r.category), _esc(r.source), _esc(format_bytes(r.bytes)), _esc(r.detail)]
            for r in acc.itertuples(index=False) if r.bytes or r.category == "free"]
    out.append("<details open><summary>accounting (sums to "
               f"{_esc(format_bytes(total))})</summary>"
               + _table(rows, ["category", "source", "bytes", "detail"]) + "</details>")
    if len(expl.referrers):
        rows = [[_esc(r.array), _esc(r.holder), _esc(r.kind),
                 "yes" if r.disposable else "no"] for r in expl.referrers.rows]
        held = expl.referrers.held_by_python
        title = "who holds the largest arrays"
        if held:
            title += (f" ({_esc(format_bytes(held))} only through disposable references: "
                      "explanation.release() drops them)")
        out.append(f"<details open><summary>{title}</summary>"
                   + _table(rows, ["array", "held by", "kind", "disposable"]) + "</details>")
    if expl.sites is not None and len(expl.sites):
        rows = [[_esc(r.site), _esc(format_bytes(int(r.bytes))), _esc(r.blocks)]
                for r in expl.sites.head(10).itertuples(index=False)]
        out.append("<details><summary>live bytes by allocation site</summary>"
                   + _table(rows, ["site", "bytes", "blocks"]) + "</details>")
    cf = expl.counterfactuals
    if cf is not None and len(cf):
        rows = [[_esc(r.setting), _esc(format_bytes(int(r.peak_reserved))),
                 "yes" if r.fits else "no", _esc(r.retries)] for r in cf.itertuples(index=False)]
        out.append("<details open><summary>would another allocator setting have fit? "
                   f"(replays on {_esc(format_bytes(int(cf.attrs.get('capacity', 0))))})"
                   "</summary>" + _table(rows, ["setting", "peak reserved", "fits", "retries"])
                   + "</details>")
    if expl.unknown:
        items = "".join(f"<li>{_esc(u)}</li>" for u in expl.unknown)
        out.append(f"<details><summary>what this cannot tell</summary><ul>{items}</ul></details>")
    items = "".join(f"<li>{_esc(r)}</li>" for r in expl.reasons)
    out.append(f"<details><summary>checks</summary><ul>{items}</ul></details></div>")
    return "".join(out)


def text(expl: Any) -> str:
    """The explanation as text."""
    lines = [expl.summary()]
    if expl.state.simulated:
        lines.append("(a simulated device: every figure is the simulator's)")
    lines.append("accounting:")
    for r in expl.accounting.itertuples(index=False):
        if r.bytes or r.category == "free":
            lines.append(f"  {r.category:<36} {r.source:<8} {format_bytes(r.bytes):>12}  "
                         f"{r.detail}")
    if len(expl.referrers):
        lines.append("who holds the largest arrays:")
        for r in expl.referrers.rows:
            mark = " (disposable)" if r.disposable else ""
            lines.append(f"  {r.array}: {r.holder}{mark}")
    if expl.sites is not None and len(expl.sites):
        lines.append("live bytes by allocation site:")
        for r in expl.sites.head(5).itertuples(index=False):
            lines.append(f"  {format_bytes(int(r.bytes)):>12}  {r.site}")
    cf = expl.counterfactuals
    if cf is not None and len(cf):
        lines.append("replays of the history under other settings:")
        for r in cf.itertuples(index=False):
            lines.append(f"  {r.setting:<60} {format_bytes(int(r.peak_reserved)):>12}  "
                         f"{'fits' if r.fits else 'runs out'}")
    for u in expl.unknown:
        lines.append(f"cannot tell: {u}")
    return "\n".join(lines)
