"""``explain_oom``: why the device ran out of memory, who holds it, and what would have fit.

:func:`explain_oom` reads the device (at the error when an observer caught it, see
:mod:`cudalab.oom.session`; else now), accounts for every byte
(:func:`~cudalab.oom.verdict.accounting_rows`), names the holders of the largest arrays
(:func:`~cudalab.oom.referrers.find_referrers`), the allocation sites of the live bytes
(from the recorded stacks), judges the cause (:func:`~cudalab.oom.verdict.judge`) and, from
the recorded history, replays what other allocator settings would have done with the failed
request (:func:`counterfactuals`, the autotuner on the trace up to the error). The result is
an :class:`OOMExplanation`: ``summary()`` is one sentence, ``_repr_html_`` a panel.

Without a history, the explanation says what it cannot tell (sites, counterfactuals) and how
to turn the history on. Counterfactual replays cost about a second per million entries per
setting (spread over the CPUs): ``counterfactuals="auto"`` runs them when the history is
short enough to stay within about a second, else leaves them for
:meth:`OOMExplanation.with_counterfactuals`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from cudalab import _internal
from cudalab._internal import format_bytes
from cudalab.allocator.registry import existing_allocator
from cudalab.errors import OutOfMemoryError
from cudalab.memory_tools import history as _history
from cudalab.oom import session as _session
from cudalab.oom.referrers import Referrers, find_referrers
from cudalab.oom.state import DeviceState, capture_state, live_blocks, site_of
from cudalab.oom.verdict import FIXES, accounting_rows, judge

__all__ = ["COUNTERFACTUAL_SETTINGS", "OOMExplanation", "counterfactuals", "explain_oom"]

#: The settings the counterfactual replays try (the native defaults are always among them).
COUNTERFACTUAL_SETTINGS: tuple[str, ...] = (
    "expandable_segments:True", "expandable_segments:True,roundup_power2_divisions:8",
    "max_split_size_mb:128", "max_split_size_mb:512", "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:1",
    "backend:cudaMallocAsync")
#: Entries × settings replayed at most by counterfactuals="auto" (about a second).
AUTO_BUDGET = 3_000_000
_HISTORY_HINT = ("history is off: run cudalab.memory.record_history() (torch: "
                 "torch.cuda.memory._record_memory_history()) before the cell that fails")


@dataclass(frozen=True, slots=True)
class OOMExplanation:
    """Why ``device`` ran out of memory (or what its memory is made of, without an error)."""

    #: One of :data:`cudalab.oom.verdict.VERDICTS`.
    verdict: str
    #: The device index.
    device: int
    #: Bytes the failed allocation asked the driver for (None without an error).
    request: int | None
    #: Bytes it was short by (None without an error).
    shortfall: int | None
    #: Byte categories summing to the device's total (columns category, source, bytes,
    #: detail); ``attrs["total"]`` the total, ``attrs["residual"]`` the unattributed bytes.
    accounting: Any
    #: Live bytes by allocation site (columns site, bytes, blocks), None without history.
    sites: Any
    #: The holders of the largest arrays.
    referrers: Referrers
    #: Replays of the recorded history under other settings (columns setting,
    #: peak_reserved, fits, first_oom, retries, reserved_over_allocated); None when not run.
    counterfactuals: Any
    #: The device state explained.
    state: DeviceState
    #: The allocator that failed ("cudalab", "torch", "cupy", "unknown"), None without error.
    source: str | None
    #: The fix, one phrase.
    fix: str
    #: The checks, one line each.
    reasons: tuple[str, ...]
    #: What the explanation cannot tell, one sentence each.
    unknown: tuple[str, ...]
    #: Seconds it took.
    elapsed_s: float
    #: The error explained (kept for release(), which clears its traceback).
    error: BaseException | None = field(default=None, repr=False)

    def summary(self) -> str:
        """One sentence naming the verdict and the fix."""
        fb = format_bytes
        dev = f"cuda:{self.device}" + (" (simulated)" if self.state.simulated else "")
        what = (f"{dev} ran out of memory asking for {fb(self.request)} "
                f"({fb(self.shortfall)} short)" if self.request is not None else
                f"{dev} (no out-of-memory error in this session)")
        text = f"{what}: {self.verdict.replace('_', ' ')}; fix: {self.fix}"
        cf = self.counterfactuals
        if self.request is not None and cf is not None and len(cf):
            fits = cf[cf["fits"] & (cf["setting"] != "default")]
            if len(fits):
                text += f" (a replay says {fits.iloc[0]['setting']} would have fit)"
        return text + "."

    def release(self, choose: Any = "disposable") -> dict[str, Any]:
        """``self.referrers.release(choose)`` (see :meth:`Referrers.release`)."""
        return self.referrers.release(choose)

    def with_counterfactuals(self, settings: Any = None, workers: int | None = None
                             ) -> OOMExplanation:
        """This explanation with the counterfactual replays run (see :func:`counterfactuals`)."""
        cf, note = counterfactuals(self.device, self.request, self.state, self.source,
                                   settings, workers)
        unknown = tuple(u for u in self.unknown if not u.startswith("counterfactuals"))
        if note:
            unknown += (f"counterfactuals: {note}",)
        return replace(self, counterfactuals=cf, unknown=unknown)

    def _repr_html_(self) -> str:
        from cudalab.oom.panel import render

        return render(self)

    def __str__(self) -> str:
        from cudalab.oom.panel import text

        return text(self)


# ============================================================================ sites
def _sites(device: int) -> tuple[Any, str]:
    import pandas as pd

    rows: dict[str, list[int]] = {}
    recording = existing_allocator(device) is not None and \
        _history.recorder_of(existing_allocator(device)) is not None
    if recording:
        for _, nbytes, stack in live_blocks(device):
            site = site_of(stack) if stack else "(allocated before the history began)"
            got = rows.setdefault(f"cudalab: {site}", [0, 0])
            got[0] += nbytes
            got[1] += 1
    torch = sys.modules.get("torch")
    torch_recording = False
    if torch is not None:
        try:
            if torch.cuda.is_initialized() and torch._C._cuda_isHistoryEnabled():
                torch_recording = True
                for seg in torch.cuda.memory_snapshot():
                    if seg.get("device") != device:
                        continue
                    for b in seg.get("blocks", ()):
                        if b.get("state") != "active_allocated":
                            continue
                        frames = [f for f in b.get("frames", ())
                                  if str(f.get("filename", "")).endswith(".py")
                                  and "/torch/" not in str(f.get("filename"))]
                        site = (f"{frames[0]['filename']}:{frames[0]['line']} "
                                f"({frames[0]['name']})" if frames else "(no Python frame)")
                        got = rows.setdefault(f"torch: {site}", [0, 0])
                        got[0] += int(b.get("size", 0))
                        got[1] += 1
        except Exception:
            pass
    if not recording and not torch_recording:
        return None, _HISTORY_HINT
    df = pd.DataFrame([{"site": k, "bytes": v[0], "blocks": v[1]} for k, v in rows.items()],
                      columns=["site", "bytes", "blocks"])
    return df.sort_values("bytes", ascending=False, ignore_index=True), ""


# ============================================================================ counterfactuals
def _history_trace(device: int, source: str | None) -> tuple[list[tuple[str, int, int, int]],
                                                             int | None, str]:
    """(alloc/free entries up to the last out-of-memory entry, its request, note)."""
    if source == "torch":
        torch = sys.modules.get("torch")
        try:
            if torch is None or not torch._C._cuda_isHistoryEnabled():
                return [], None, _HISTORY_HINT
            entries = torch.cuda.memory._snapshot()["device_traces"][device]
        except Exception as exc:
            return [], None, f"torch's history could not be read ({type(exc).__name__})"
        raw = [(e["action"], e.get("addr", e.get("device_free", 0)), e["size"],
                e.get("stream", 0)) for e in entries]
    else:
        a = existing_allocator(device)
        if a is None or _history.recorder_of(a) is None:
            return [], None, _HISTORY_HINT
        raw = [(e[0], e[1], e[2], e[3]) for e in _history.raw_entries(device)]
    last = max((i for i, e in enumerate(raw) if e[0] == "oom"), default=None)
    request = None
    if last is not None:
        request = int(raw[last][2])
        raw = raw[:last]
    trace = [e for e in raw if e[0] in ("alloc", "free_requested", "free")]
    return trace, request, "" if last is not None else \
        "the history has no out-of-memory entry: the replays end with the request appended"


def counterfactuals(device: int, request: int | None, state: DeviceState,
                    source: str | None, settings: Any = None, workers: int | None = None
                    ) -> tuple[Any, str]:
    """Replays of the recorded history up to the error, then the failed request, under
    ``settings`` (default :data:`COUNTERFACTUAL_SETTINGS`) on a device of the memory the
    failing allocator could have had (its reserved bytes plus the free bytes at the error),
    less the blocks still live that the history does not hold (allocated before it began:
    the replays start from an empty allocator, so that memory is not theirs to use;
    ``attrs["before_history"]``).

    Returns
    -------
    (pandas.DataFrame or None, str)
        Columns setting, peak_reserved, fits (the failed request would have fit),
        first_oom (the first entry that ran out), retries, reserved_over_allocated, best
        first; and a note ("" when there is nothing to add). None without a history.
    """
    import pandas as pd

    from cudalab.memory_tools.autotune import autotune

    trace, recorded, note = _history_trace(device, source)
    if not trace:
        return None, note
    want = recorded if recorded is not None else request
    if want is None:
        return None, "no failed request to replay"
    figures = next((a for a in state.allocators if a.source == (source or "cudalab")), None)
    reserved = figures.reserved if figures is not None else 0
    before = _live_before_history(device, source, trace)
    capacity = reserved + state.free - before
    if figures is not None and figures.limit is not None:
        capacity = min(capacity, figures.limit - before)
    capacity = max(capacity, 1 << 20)
    top = max([e[1] for e in trace if e[0] == "alloc"], default=0)
    trace = [*trace, ("alloc", top + (1 << 40), int(want), 0)]
    last = len(trace) - 1
    chosen = list(COUNTERFACTUAL_SETTINGS if settings is None else settings)
    df = autotune(trace, [capacity], chosen, workers=workers)
    rows = []
    for r in df.itertuples(index=False):
        if r.rank == 0:
            continue
        first = None if pd.isna(r.first_oom) else int(r.first_oom)
        rows.append({"setting": r.setting, "peak_reserved": int(r.peak_reserved),
                     "fits": first is None, "first_oom": first, "retries": int(r.retries),
                     "reserved_over_allocated": float(r.reserved_over_allocated)})
    out = pd.DataFrame(rows, columns=["setting", "peak_reserved", "fits", "first_oom",
                                      "retries", "reserved_over_allocated"])
    out = out.sort_values(["fits", "peak_reserved"], ascending=[False, True],
                          ignore_index=True)
    out.attrs["capacity"] = capacity
    out.attrs["before_history"] = before
    out.attrs["entries"] = len(trace)
    out.attrs["request_entry"] = last
    out.attrs["refused"] = df.attrs.get("refused", {})
    default = out[out["setting"] == "default"]
    if len(default) and bool(default["fits"].iloc[0]):
        note = (note + "; " if note else "") + (
            "the replay of the defaults fits where the run did not: memory outside the "
            "history (allocated before it began, or outside the allocator) made the "
            "difference")
    return out, note


def _live_before_history(device: int, source: str | None,
                         trace: list[tuple[str, int, int, int]]) -> int:
    """Bytes of the failing allocator's live blocks that ``trace`` did not allocate (or
    allocated and freed: an address reused since), i.e. held from before the history."""
    live: set[int] = set()
    for action, addr, _, _ in trace:
        if action == "alloc":
            live.add(addr)
        else:
            live.discard(addr)
    blocks: list[tuple[int, int]] = []
    if source == "torch":
        torch = sys.modules.get("torch")
        try:
            for seg in torch.cuda.memory_snapshot() if torch is not None else ():
                if seg.get("device") == device:
                    blocks += [(int(b["address"]), int(b["size"])) for b in seg["blocks"]
                               if b.get("state") == "active_allocated"]
        except Exception:  # (torch's snapshot unavailable: nothing known to subtract)
            return 0
    else:
        blocks = [(addr, nbytes) for addr, nbytes, _ in live_blocks(device)]
    return sum(n for addr, n in blocks if addr not in live)


# ============================================================================ explain_oom
def explain_oom(device: Any = None, *, source: str = "auto", error: BaseException | None = None,
                replays: Any = "auto", top: int = 8) -> OOMExplanation:
    """Why ``device`` ran out of memory: verdict, accounting, sites, referrers, counterfactuals.

    Parameters
    ----------
    device : int, str, Device or None, optional
        The device (default: the error's device, else the current device).
    source : str, optional
        Which allocator failed: ``"auto"`` (from the error; else the one holding the most),
        ``"cudalab"``, ``"torch"`` or ``"cupy"``.
    error : BaseException, optional
        The out-of-memory error (default: the session's last one, :func:`cudalab.oom.last_oom`,
        else ``sys.last_value`` when it is one; without one, the current state is
        explained).
    replays : bool or "auto", optional
        Run the counterfactual replays (``"auto"``: when the history is short enough, see the
        module documentation).
    top : int, optional
        How many of the largest memory groups to name holders for.

    Returns
    -------
    OOMExplanation

    Raises
    ------
    ValueError
        An unknown ``source`` or a bad ``device``.
    """
    start = time.perf_counter()
    if source not in ("auto", "cudalab", "torch", "cupy"):
        raise ValueError(f"source must be 'auto', 'cudalab', 'torch' or 'cupy', got {source!r}")
    _session.watch()
    event = None
    if error is None:
        error, event = _session.last_oom()
        if error is None:  # an uncaught error of a console without the extension
            for last in (getattr(sys, "last_exc", None), getattr(sys, "last_value", None)):
                found = _session.is_oom_error(last) if isinstance(last, BaseException) \
                    else None
                if found is not None:
                    error, event = found, _session.take_event(found)
                    break
    else:
        oom = _session.is_oom_error(error)
        if oom is None:
            raise ValueError(f"error is not an out-of-memory error: {type(error).__name__}: "
                             f"{str(error)[:120]}")
        error = oom
        event = _session.take_event(error)
    text_device, text_request = _session.parse_oom_text(str(error)) if error is not None \
        else (None, None)
    if device is None:
        device = event.device if event is not None else text_device
    device = _internal.device_index(device)
    unknown: list[str] = []
    state = event.state if event is not None and event.device == device else None
    if state is None:
        state = capture_state(device)
        if error is not None:
            unknown.append("the state at the error was not caught (no observer was attached "
                           "then): the state now is explained")
    if event is not None and event.note:
        unknown.append(event.note)
    request = event.request if event is not None else text_request
    failed = event.source if event is not None else (
        None if error is None else ("cudalab" if isinstance(error, OutOfMemoryError)
                                    else type(error).__module__.split(".")[0]))
    if source != "auto":
        failed = source
    limit = event.limit if event is not None else None
    referrers = find_referrers(device, error, top)
    judgement = judge(state, request, failed, limit, referrers.held_by_python)
    import pandas as pd

    accounting = pd.DataFrame(accounting_rows(state),
                              columns=["category", "source", "bytes", "detail"])
    accounting.attrs["total"] = state.total
    accounting.attrs["residual"] = int(accounting["bytes"].iloc[-1])
    if state.process_used is None:
        unknown.append(f"NVML does not list this process ({state.nvml_error or 'no figure'}): "
                       "memory outside the allocators and other processes are unattributed")
    sites, sites_note = _sites(device)
    if sites_note:
        unknown.append(f"sites: {sites_note}")
    cf = None
    if error is not None:
        entries = _history_size(device, failed)
        budget = (entries or 0) * (len(COUNTERFACTUAL_SETTINGS) + 1)
        if replays is True or (replays and entries is not None and 0 < budget <= AUTO_BUDGET):
            cf, note = counterfactuals(device, request, state, failed)
            if note:
                unknown.append(f"counterfactuals: {note}")
        elif entries == 0:
            unknown.append(f"counterfactuals: {_HISTORY_HINT}")
        else:
            size = "torch's history" if entries is None else f"{entries:,} history entries"
            unknown.append(f"counterfactuals: not run yet ({size}: the replays take a few "
                           "seconds): call .with_counterfactuals()")
    return OOMExplanation(
        verdict=judgement.verdict, device=device, request=request,
        shortfall=judgement.shortfall, accounting=accounting, sites=sites,
        referrers=referrers, counterfactuals=cf, state=state, source=failed,
        fix=FIXES[judgement.verdict], reasons=judgement.reasons, unknown=tuple(unknown),
        elapsed_s=time.perf_counter() - start, error=error)


def _history_size(device: int, source: str | None) -> int | None:
    """Entries of the history the replays would read (None: torch's, recording, of a length
    known only by reading it; 0: no history)."""
    if source == "torch":
        torch = sys.modules.get("torch")
        try:
            return None if torch is not None and torch._C._cuda_isHistoryEnabled() else 0
        except Exception:
            return 0
    a = existing_allocator(device)
    if a is None or _history.recorder_of(a) is None:
        return 0
    return _history.entry_count(device)
