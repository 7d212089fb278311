"""Allocator statistics: flat counters, torch's ``memory_stats`` dict and ``memory_summary`` text.

torch keeps, per device, nine ``StatArray``\\ s (``allocation``, ``segment``, ``active``,
``inactive_split``, ``allocated_bytes``, ``reserved_bytes``, ``active_bytes``,
``inactive_split_bytes``, ``requested_bytes``), each a {current, peak, allocated, freed}
quadruple for the aggregate and for the small and large pools, plus two plain stats
(``oversize_allocations``, ``oversize_segments``) and six scalars: 122 keys once flattened.

Updating 4 × 3 numbers per stat on every allocation would cost more than the rest of the
allocator's hot path together, so the counters are stored in a reduced form from which
torch's values are derived exactly when they are read:

* ``freed`` is never stored: ``freed = allocated - current + base``, where ``base`` is the
  value of ``current`` at the last ``reset_accumulated`` (all three move together).
* the aggregate (``all``) stores only its peaks: its current/allocated/freed values are
  the sums of the two pools'.
* ``active`` is ``allocation`` plus the blocks freed but still awaiting events
  (``record_stream``), so it is derived from ``allocation`` and the pending counters; its
  peak only needs its own bookkeeping while something is pending.

:class:`Counters` holds one pool's (or the aggregate's) numbers; :class:`DeviceStats` one
device's. Each field is declared with what it counts and the invariants it keeps;
:meth:`DeviceStats.check_invariants` checks them all (tests call it after every step). The
allocator updates the fields directly on its hot path; everything else goes through the
helper methods here.

The text formatters at the end (:func:`format_size`, the summary cells) reproduce torch's
text to the letter; sizes for people are printed by :func:`cudalab._units.format_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = [
    "Counters",
    "DeviceStats",
    "STAT_NAMES",
    "POOL_NAMES",
    "METRICS",
    "STAT_KEYS",
    "format_size",
    "render_memory_summary",
]

#: torch's StatArray names, in the order of torch's nested dict.
STAT_NAMES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
#: Pool names in torch's nested dict order.
POOL_NAMES = ("all", "small_pool", "large_pool")
METRICS = ("current", "peak", "allocated", "freed")
_PLAIN = ("oversize_allocations", "oversize_segments")
_SCALARS = (
    "num_alloc_retries",
    "num_ooms",
    "max_split_size",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
)

# The tracked ("primary") counters: n_ = a count, b_ = bytes.
#   n_alloc/b_alloc: allocation / allocated_bytes     n_seg/b_res: segment / reserved_bytes
#   n_split/b_split: inactive_split(_bytes)           b_req: requested_bytes
_CODES = ("n_alloc", "b_alloc", "b_req", "n_seg", "b_res", "n_split", "b_split")
_SLOTS = tuple(
    name for code in _CODES for name in (code, code + "_acc", code + "_peak", code + "_base")
) + ("n_pend", "b_pend", "n_act_peak", "b_act_peak", "n_act_base", "b_act_base")


class Counters:
    """The reduced counters of one pool (the aggregate ``DeviceStats.agg`` uses only the
    ``*_peak`` fields).

    Each tracked code (``n_alloc b_alloc b_req n_seg b_res n_split b_split``) has four
    fields: ``<code>`` (current), ``<code>_acc`` (torch's "allocated": the sum of every
    increase since the last accumulated reset), ``<code>_peak`` and ``<code>_base``
    (``<code>`` at the last accumulated reset). Invariants, for every code:

    * ``<code>_peak >= <code>``: every increase goes through the peak check (on the hot path
      written out, elsewhere :meth:`DeviceStats.increase`), every reset sets it to current;
    * torch's "freed" is ``<code>_acc - <code> + <code>_base`` (>= 0), derived, never stored,
      so "allocated", "freed" and "current" cannot drift apart;
    * the aggregate's current/allocated/freed are the sums of the two pools' (derived), and
      ``agg.<code>_peak >= small.<code> + large.<code>`` (an aggregate peak is not the sum
      of the pools' peaks: they may have peaked at different times).

    The names are declared below with what they count; ``__slots__`` is :data:`_SLOTS`,
    built from the codes (a test pins the declarations to it, so the two cannot drift).
    """

    __slots__ = _SLOTS

    # allocation / allocated_bytes / requested_bytes: blocks handed out to callers.
    #: Blocks handed out now (torch's ``allocation``).
    n_alloc: int
    n_alloc_acc: int
    n_alloc_peak: int
    n_alloc_base: int
    #: Their bytes, rounded sizes (``allocated_bytes``).
    b_alloc: int
    b_alloc_acc: int
    b_alloc_peak: int
    b_alloc_base: int
    #: The bytes callers asked for, before rounding (``requested_bytes``); a pending block's
    #: stay counted until its events complete, as torch's. Invariant:
    #: ``b_req <= b_alloc + b_pend``.
    b_req: int
    b_req_acc: int
    b_req_peak: int
    b_req_base: int
    # segment / reserved_bytes: memory held from the driver.
    #: Segments held (``segment``).
    n_seg: int
    n_seg_acc: int
    n_seg_peak: int
    n_seg_base: int
    #: Their bytes (``reserved_bytes``). Invariant: ``b_alloc + b_pend + b_split <= b_res``
    #: (blocks handed out, pending and inactive split all lie in held segments).
    b_res: int
    b_res_acc: int
    b_res_peak: int
    b_res_base: int
    # inactive_split / inactive_split_bytes: free blocks inside a split segment (these
    # cannot be returned to the driver until their neighbours are freed too).
    #: Free blocks of split segments (``inactive_split``).
    n_split: int
    n_split_acc: int
    n_split_peak: int
    n_split_base: int
    #: Their bytes (``inactive_split_bytes``).
    b_split: int
    b_split_acc: int
    b_split_peak: int
    b_split_base: int
    # active / active_bytes = allocation + pending (derived, see the module doc).
    #: Blocks freed by the caller but still waiting for their ``record_stream`` events:
    #: not handed out, not yet reusable; counted in ``active``, not in ``allocation``.
    n_pend: int
    #: Their bytes.
    b_pend: int
    #: Peaks of ``active`` (``n_alloc + n_pend``) reached while something was pending; the
    #: ``active`` peak is ``max(n_alloc_peak, n_act_peak)`` (and the same for bytes).
    n_act_peak: int
    b_act_peak: int
    #: ``active`` at the last accumulated reset (its "freed" is derived from it).
    n_act_base: int
    b_act_base: int

    def __init__(self) -> None:
        for name in _SLOTS:
            setattr(self, name, 0)

    def reset_peak(self) -> None:
        """Every peak becomes its current value (``active``'s too)."""
        for code in _CODES:
            setattr(self, code + "_peak", getattr(self, code))
        self.n_act_peak = self.n_alloc + self.n_pend
        self.b_act_peak = self.b_alloc + self.b_pend

    def reset_accumulated(self) -> None:
        """"allocated" to 0 and "freed" with it (``base`` takes the current values)."""
        for code in _CODES:
            setattr(self, code + "_acc", 0)
            setattr(self, code + "_base", getattr(self, code))
        self.n_act_base = self.n_alloc + self.n_pend
        self.b_act_base = self.b_alloc + self.b_pend


def _all_keys() -> list[str]:
    keys = [f"{stat}.{pool}.{metric}" for stat in STAT_NAMES for pool in POOL_NAMES
            for metric in METRICS]
    keys += [f"{plain}.{metric}" for plain in _PLAIN for metric in METRICS]
    return keys + list(_SCALARS)


#: torch's 122 ``memory_stats()`` keys, sorted as torch sorts them.
STAT_KEYS: tuple[str, ...] = tuple(sorted(_all_keys()))
assert len(STAT_KEYS) == 122

# --------------------------------------------------------------------------- fast dict build
# memory_stats() must stay well under torch's ~100 us, so the dict is built by a function
# generated once from the derivation rules below: one pass over the counters, values
# written in sorted key order into a copy of a template dict (cheaper than dict(zip(...))).
_TRACKED = {
    "allocation": "n_alloc", "allocated_bytes": "b_alloc", "requested_bytes": "b_req",
    "segment": "n_seg", "reserved_bytes": "b_res", "inactive_split": "n_split",
    "inactive_split_bytes": "b_split",
}


def _value_expr(key: str) -> str:
    """Python expression for one stats key over s (small), l (large), a (agg), st."""
    parts = key.split(".")
    if len(parts) == 1:
        return f"st.{key}"
    if len(parts) == 2:  # oversize_allocations / oversize_segments
        c = "st.ov_alloc" if parts[0] == "oversize_allocations" else "st.ov_seg"
        return {"current": c, "peak": f"{c}_peak", "allocated": f"{c}_acc",
                "freed": f"{c}_acc - {c} + {c}_base"}[parts[1]]
    stat, pool, metric = parts
    if stat in ("active", "active_bytes"):
        k = "n" if stat == "active" else "b"
        code, pend, apeak, abase = f"{k}_alloc", f"{k}_pend", f"{k}_act_peak", f"{k}_act_base"
        if pool == "all":
            cur = f"(s.{code} + s.{pend} + l.{code} + l.{pend})"
            acc = f"(s.{code}_acc + l.{code}_acc)"
            return {"current": cur, "peak": f"max(a.{code}_peak, a.{apeak})", "allocated": acc,
                    "freed": f"{acc} - {cur} + s.{abase} + l.{abase}"}[metric]
        p = "s" if pool == "small_pool" else "l"
        cur = f"({p}.{code} + {p}.{pend})"
        return {"current": cur, "peak": f"max({p}.{code}_peak, {p}.{apeak})",
                "allocated": f"{p}.{code}_acc",
                "freed": f"{p}.{code}_acc - {cur} + {p}.{abase}"}[metric]
    code = _TRACKED[stat]
    if pool == "all":
        cur = f"(s.{code} + l.{code})"
        acc = f"(s.{code}_acc + l.{code}_acc)"
        return {"current": cur, "peak": f"a.{code}_peak", "allocated": acc,
                "freed": f"{acc} - {cur} + s.{code}_base + l.{code}_base"}[metric]
    p = "s" if pool == "small_pool" else "l"
    return {"current": f"{p}.{code}", "peak": f"{p}.{code}_peak", "allocated": f"{p}.{code}_acc",
            "freed": f"{p}.{code}_acc - {p}.{code} + {p}.{code}_base"}[metric]


def _make_builder() -> Callable[[DeviceStats], dict[str, int]]:
    # Each counter is read once into a local; the values are stored into a copy of a
    # template dict (already sized for 122 keys, so no resizing while it fills).
    import re

    ref = re.compile(r"\b(?:s|l|a|st)\.\w+")
    exprs = {k: _value_expr(k) for k in STAT_KEYS}
    attrs = sorted({m for e in exprs.values() for m in ref.findall(e)})

    def local(name: str) -> str:
        return "_" + name.replace(".", "_")

    # Polling readers (dashboards, %cuda_memory watch) mostly find the counters unchanged:
    # the tuple of every counter read is kept with a copy of the dict built from it, and an
    # equal tuple (same values: nothing moved) returns a copy of that dict without rebuilding.
    lines = ["def build(st, _new=_template.copy):", "    s = st.small", "    l = st.large",
             "    a = st.agg"]
    lines += [f"    {local(name)} = {name}" for name in attrs]
    lines.append(f"    sig = ({', '.join(local(name) for name in attrs)},)")
    lines.append("    c = st._cache")
    lines.append("    if c is not None and c[0] == sig:")
    lines.append("        return c[1].copy()")
    lines.append("    d = _new()")
    for k, e in exprs.items():
        e = ref.sub(lambda m: local(m.group(0)), e)
        lines.append(f"    d[{k!r}] = {e}")
    lines.append("    st._cache = (sig, d.copy())")
    lines.append("    return d")
    namespace: dict[str, Any] = {"_template": dict.fromkeys(STAT_KEYS, 0)}
    exec(compile("\n".join(lines), "<cudalab.allocator.stats builder>", "exec"), namespace)
    build: Callable[[DeviceStats], dict[str, int]] = namespace["build"]
    return build


_build_stats_dict = _make_builder()


class DeviceStats:
    """All of one device's allocator statistics (see the module documentation).

    ``small`` and ``large`` are the pools' :class:`Counters`, ``agg`` the aggregate's peaks.
    The allocator updates their fields directly on its hot path, keeping the invariants
    written on :class:`Counters`; everything else goes through the methods here.
    """

    __slots__ = (
        "agg", "small", "large",
        "ov_alloc", "ov_alloc_peak", "ov_alloc_acc", "ov_alloc_base",
        "ov_seg", "ov_seg_peak", "ov_seg_acc", "ov_seg_base",
        "num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
        "num_device_free", "max_split_size", "_cache",
    )

    #: Only the ``*_peak`` fields are used: the aggregate's other values are the pools' sums.
    agg: Counters
    #: The small pool (requests up to 1 MiB) and the large pool.
    small: Counters
    large: Counters
    #: torch's ``oversize_allocations``: blocks handed out that are larger than
    #: ``max_split_size`` (never split); current / peak / allocated / base, with the same
    #: invariants as a :class:`Counters` code ("freed" = ``acc - current + base``).
    ov_alloc: int
    ov_alloc_peak: int
    ov_alloc_acc: int
    ov_alloc_base: int
    #: torch's ``oversize_segments``: segments larger than ``max_split_size`` (same scheme).
    ov_seg: int
    ov_seg_peak: int
    ov_seg_acc: int
    ov_seg_base: int
    #: Scalars since the last accumulated reset: allocations retried after freeing the
    #: cache, out-of-memory errors raised, whole-device synchronisations for frees, and
    #: driver allocations / frees of segments.
    num_alloc_retries: int
    num_ooms: int
    num_sync_all_streams: int
    num_device_alloc: int
    num_device_free: int
    #: torch's ``max_split_size`` stat: the limit in bytes, -1 when unlimited.
    max_split_size: int
    #: (every counter read, the dict built from them) of the last :meth:`as_dict`, or None:
    #: a poll that finds the same counters copies the dict instead of rebuilding it.
    _cache: tuple[tuple[int, ...], dict[str, int]] | None

    def __init__(self, max_split_size: int = -1, small: Counters | None = None,
                 large: Counters | None = None) -> None:
        self.agg = Counters()  # only the peaks are used
        self.small = Counters() if small is None else small
        self.large = Counters() if large is None else large
        for name in self.__slots__[3:]:
            setattr(self, name, 0)
        self.max_split_size = max_split_size
        self._cache = None

    # ------------------------------------------------------------------ slow-path updates
    def current(self, code: str) -> int:
        """The aggregate current value of tracked stat ``code`` (sum of the pools)."""
        return getattr(self.small, code) + getattr(self.large, code)

    def increase(self, pool: Counters, code: str, amount: int) -> None:
        """Increase tracked stat ``code`` of ``pool`` (with the pool's and the total's peaks)."""
        v = getattr(pool, code) + amount
        setattr(pool, code, v)
        peak = code + "_peak"
        if v > getattr(pool, peak):
            setattr(pool, peak, v)
        setattr(pool, code + "_acc", getattr(pool, code + "_acc") + amount)
        v = getattr(self.small, code) + getattr(self.large, code)
        if v > getattr(self.agg, peak):
            setattr(self.agg, peak, v)

    def decrease(self, pool: Counters, code: str, amount: int) -> None:
        """Decrease tracked stat ``code`` of ``pool``."""
        setattr(pool, code, getattr(pool, code) - amount)

    def note_active_peaks(self) -> None:
        """Update the peaks of ``active`` while blocks are pending (active = allocation +
        pending); called after an allocation whenever something is pending."""
        s, l = self.small, self.large  # noqa: E741
        for c in (s, l):
            if c.n_pend:
                v = c.n_alloc + c.n_pend
                if v > c.n_act_peak:
                    c.n_act_peak = v
                v = c.b_alloc + c.b_pend
                if v > c.b_act_peak:
                    c.b_act_peak = v
        a = self.agg
        v = s.n_alloc + s.n_pend + l.n_alloc + l.n_pend
        if v > a.n_act_peak:
            a.n_act_peak = v
        v = s.b_alloc + s.b_pend + l.b_alloc + l.b_pend
        if v > a.b_act_peak:
            a.b_act_peak = v

    def increase_oversize_segments(self) -> None:
        v = self.ov_seg = self.ov_seg + 1
        if v > self.ov_seg_peak:
            self.ov_seg_peak = v
        self.ov_seg_acc += 1

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first invariant (see :class:`Counters`) that does
        not hold (for tests and debugging; works under ``python -O`` too)."""
        def fail(what: str) -> None:
            raise AssertionError(f"allocator statistics: {what} does not hold")

        s, l, a = self.small, self.large, self.agg  # noqa: E741
        for name, c in (("small", s), ("large", l)):
            for code in _CODES:
                cur = getattr(c, code)
                if cur < 0:
                    fail(f"{name}.{code} >= 0")
                if getattr(c, code + "_peak") < cur:
                    fail(f"{name}.{code}_peak >= {name}.{code}")
                if getattr(c, code + "_acc") - cur + getattr(c, code + "_base") < 0:
                    fail(f"freed = {name}.{code}_acc - {name}.{code} + {name}.{code}_base >= 0")
            if c.b_req > c.b_alloc + c.b_pend:
                fail(f"{name}.b_req <= {name}.b_alloc + {name}.b_pend")
            if c.b_alloc + c.b_pend + c.b_split > c.b_res:
                fail(f"{name}.b_alloc + {name}.b_pend + {name}.b_split <= {name}.b_res")
            if max(c.n_alloc_peak, c.n_act_peak) < c.n_alloc + c.n_pend:
                fail(f"the active peak of {name} >= its active count")
            if max(c.b_alloc_peak, c.b_act_peak) < c.b_alloc + c.b_pend:
                fail(f"the active_bytes peak of {name} >= its active bytes")
        for code in _CODES:
            if getattr(a, code + "_peak") < getattr(s, code) + getattr(l, code):
                fail(f"agg.{code}_peak >= small.{code} + large.{code}")
        for ov in ("ov_alloc", "ov_seg"):
            cur = getattr(self, ov)
            if getattr(self, ov + "_peak") < cur:
                fail(f"{ov}_peak >= {ov}")
            if getattr(self, ov + "_acc") - cur + getattr(self, ov + "_base") < 0:
                fail(f"freed = {ov}_acc - {ov} + {ov}_base >= 0")

    # ------------------------------------------------------------------ resets
    def reset_peak(self) -> None:
        """torch's ``resetPeakStats``: every peak becomes its current value."""
        s, l, a = self.small, self.large, self.agg  # noqa: E741
        s.reset_peak()
        l.reset_peak()
        for name in _SLOTS:
            if name.endswith("_peak") and not name.endswith("_act_peak"):
                code = name[:-5]
                setattr(a, name, getattr(s, code) + getattr(l, code))
        a.n_act_peak = s.n_alloc + s.n_pend + l.n_alloc + l.n_pend
        a.b_act_peak = s.b_alloc + s.b_pend + l.b_alloc + l.b_pend
        self.ov_alloc_peak = self.ov_alloc
        self.ov_seg_peak = self.ov_seg

    def reset_accumulated(self) -> None:
        """torch's ``resetAccumulatedStats``: allocated/freed and the num_* counters to 0."""
        self.small.reset_accumulated()  # the aggregate's allocated/freed are derived
        self.large.reset_accumulated()
        self.ov_alloc_acc = 0
        self.ov_alloc_base = self.ov_alloc
        self.ov_seg_acc = 0
        self.ov_seg_base = self.ov_seg
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_sync_all_streams = 0
        self.num_device_alloc = 0
        self.num_device_free = 0

    # ------------------------------------------------------------------ reading
    def as_dict(self) -> dict[str, int]:
        """torch's ``memory_stats()``: exactly the 122 keys, sorted (a plain dict, which keeps
        that order; torch returns an OrderedDict with the same items)."""
        return _build_stats_dict(self)

    def as_nested_dict(self) -> dict[str, Any]:
        """torch's ``memory_stats_as_nested_dict()`` (key order as torch's C++ builds it)."""
        return nested_from_flat(self.as_dict())


def nested_from_flat(flat: Mapping[str, int]) -> dict[str, Any]:
    """Rebuild torch's nested stats dict from the flat one.

    Parameters
    ----------
    flat : mapping of str to int
        A 122-key ``memory_stats()`` dict (or ``{}``).

    Returns
    -------
    dict
        ``memory_stats_as_nested_dict()``'s layout, in torch's key order (``{}`` for ``{}``).
    """
    if not flat:
        return {}
    out: dict[str, Any] = {}
    for name in ("num_alloc_retries", "num_ooms", "max_split_size", "num_sync_all_streams",
                 "num_device_alloc", "num_device_free"):
        out[name] = flat[name]
    for stat in STAT_NAMES:
        out[stat] = {
            pool: {m: flat[f"{stat}.{pool}.{m}"] for m in METRICS} for pool in POOL_NAMES
        }
    for plain in _PLAIN:
        out[plain] = {m: flat[f"{plain}.{m}"] for m in METRICS}
    return out


def zero_stats(max_split_size: int = -1) -> dict[str, int]:
    """The 122-key dict of an allocator that has done nothing.

    Parameters
    ----------
    max_split_size : int, optional
        The ``max_split_size`` value to report (-1: unlimited).

    Returns
    -------
    dict of str to int
        Every key 0 but ``max_split_size``.
    """
    return DeviceStats(max_split_size).as_dict()


# --------------------------------------------------------------------------- text
def format_size(size: int) -> str:
    """torch's C++ ``format_size`` (used in OOM messages): "512 bytes", "2.00 MiB", ...

    torch's text, not a formatter for people: see :mod:`cudalab._units`. It reproduces
    torch to the letter (``1048576`` is ``"1024.00 KiB"``, as in torch's messages), so the
    OOM text matches torch's; everything else prints sizes with
    :func:`cudalab._units.format_bytes`.
    """
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


def _format_bytes_cell(sz: int, pref_sz: float) -> str:
    """One byte cell of ``memory_summary()``: torch's ``_format_size`` (Python), to the letter.

    torch's text, not a formatter for people: see :mod:`cudalab._units`. The unit is chosen
    from ``pref_sz`` (the "all" row's value of the same column, so the pool rows below it
    share its unit), the value is floored, and the cell is 10 characters wide ("   768 KiB").
    """
    prefixes = ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB")
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if pref_sz < 768 * 1024:
            break
        prefix = new_prefix
        sz //= 1024
        pref_sz /= 1024
    return f"{sz:6d} {prefix}"


def _format_count_cell(cnt: int, pref_cnt: float) -> str:
    """One count cell of ``memory_summary()``: torch's ``_format_count``, to the letter
    (decimal K/M steps from 750,000; not a size)."""
    prefixes = (" ", "K", "M")
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if pref_cnt < 750 * 1000:
            break
        prefix = new_prefix
        cnt //= 1000
        pref_cnt /= 1000
    return f"{cnt:7d} {prefix} "


_SUMMARY_METRICS = (
    ("allocated_bytes", "Allocated memory", _format_bytes_cell),
    ("active_bytes", "Active memory", _format_bytes_cell),
    ("requested_bytes", "Requested memory", _format_bytes_cell),
    ("reserved_bytes", "GPU reserved memory", _format_bytes_cell),
    ("inactive_split_bytes", "Non-releasable memory", _format_bytes_cell),
    ("allocation", "Allocations", _format_count_cell),
    ("active", "Active allocs", _format_count_cell),
    ("segment", "GPU reserved segments", _format_count_cell),
    ("inactive_split", "Non-releasable allocs", _format_count_cell),
)


def render_memory_summary(
    stats: Mapping[str, int], device: int, abbreviated: bool = False, title: str = "cudalab",
    simulated: bool = False,
) -> str:
    """torch's ``memory_summary()`` text for a 122-key stats dict, byte for byte.

    The only difference from torch is the header word: "cudalab CUDA memory summary" where
    torch prints "PyTorch CUDA memory summary" (both 7 letters, so the table stays 75
    columns wide); pass ``title="PyTorch"`` to get torch's exact text. On the simulator the
    device field reads "N (simulated)", which still fits torch's 17-character field.

    Parameters
    ----------
    stats : mapping of str to int
        A 122-key ``memory_stats()`` dict.
    device : int
        The device index shown in the header.
    abbreviated : bool, optional
        Leave out the per-pool rows.
    title : str, optional
        The header's first word, 7 characters.
    simulated : bool, optional
        Label the device as simulated.

    Returns
    -------
    str
        The table, ending in a newline.

    Raises
    ------
    ValueError
        When ``title`` is not 7 characters long.
    """
    if len(title) != 7:
        raise ValueError(f"title must be 7 characters to keep torch's layout, got {title!r}")
    lines = [
        "=" * 75,
        " " * 18 + f"{title} CUDA memory summary, device ID "
        + f"{f'{device} (simulated)' if simulated else device:<17} ",
        "-" * 75,
        " " * 12 + f"CUDA OOMs: {stats['num_ooms']:<12d} | " + " " * 7
        + f"cudaMalloc retries: {stats['num_alloc_retries']:<8d}  ",
        "=" * 75,
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
    ]
    for key, name, fmt in _SUMMARY_METRICS:
        lines.append("-" * 75)
        subs: Iterable[tuple[str, str]] = [("all", name)]
        if not abbreviated:
            subs = [("all", name), ("large_pool", "      from large pool"),
                    ("small_pool", "      from small pool")]
        pref = None
        for sub, subname in subs:
            prefix = f"{key}.{sub}."
            cur = stats[prefix + "current"]
            peak = stats[prefix + "peak"]
            alloc = stats[prefix + "allocated"]
            freed = stats[prefix + "freed"]
            if pref is None:
                pref = (cur, peak, alloc, freed)
            lines.append(
                f" {subname:<21} | {fmt(cur, pref[0])} | {fmt(peak, pref[1])} | "
                f"{fmt(alloc, pref[2])} | {fmt(freed, pref[3])} "
            )
    for key, name in (("oversize_allocations", "Oversize allocations"),
                      ("oversize_segments", "Oversize GPU segments")):
        lines.append("-" * 75)
        cur = stats[key + ".current"]
        peak = stats[key + ".peak"]
        alloc = stats[key + ".allocated"]
        freed = stats[key + ".freed"]
        f = _format_count_cell
        lines.append(
            f" {name:<21} | {f(cur, cur)} | {f(peak, peak)} | {f(alloc, alloc)} | {f(freed, freed)} "
        )
    lines.append("=" * 75)
    return "|" + "|\n|".join(lines) + "|\n"
