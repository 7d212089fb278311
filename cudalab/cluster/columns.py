"""Trace entries travelling as columns: :class:`TraceColumns`.

A rank's snapshot of a 100,000-entry history is 100,000 dicts; unpickling them and checking
each costs the receiver about 0.35 s per rank, which for 8 ranks is more than the cluster
view's budget of 2 s. So a rank sends each device's trace entries as columns, one per key:
integer keys as the bytes of a numpy ``int64`` / ``uint64`` array, the other keys (text,
stacks, None) as lists, whose repeated values the pickle carries once. The receiver
(:func:`TraceColumns.from_wire`) checks them with the snapshot check of
:mod:`cudalab.memory_tools.snapshot_check`, run over every *distinct* value of each list
column and over the smallest and largest value of each integer column, which the check's
rules (types and ranges, key by key) accept exactly when they accept every entry; any
failure is then located by checking the entries themselves, so the message names the entry
as the snapshot check does. The dicts are built only when asked for
(:meth:`TraceColumns.entries`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import Any

import numpy as np

from cudalab.memory_tools.safe_pickle import SnapshotLoadError
from cudalab.memory_tools.snapshot_check import check_trace_entries

__all__ = ["TraceColumns", "to_wire"]

_INT_DTYPES = {"int64": np.dtype("<i8"), "uint64": np.dtype("<u8")}
_MAX_KEYS = 64


def to_wire(entries: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """``entries`` (one device's trace-entry dicts) as plain-data columns, or None when
    they are not dicts with str keys (they then travel as they are)."""
    n = len(entries)
    if not n or not all(type(e) is dict for e in entries):
        return None
    first = list(entries[0])
    every = set().union(*map(dict.keys, entries))  # (C-level passes)
    keys = first + sorted(every.difference(first), key=str)
    if len(keys) > _MAX_KEYS or not all(type(k) is str for k in keys):
        return None
    uniform = set(map(len, entries)) == {len(keys)}  # then every entry holds every key
    columns: dict[str, Any] = {}
    missing: dict[str, list[int]] = {}
    for key in keys:
        values = (list(map(operator.itemgetter(key), entries)) if uniform
                  else list(map(dict.get, entries, repeat(key))))
        if not uniform:
            present = list(map(operator.contains, entries, repeat(key)))
            if not all(present):
                missing[key] = list(compress(range(n), map(operator.not_, present)))
                columns[key] = values
                continue
        if set(map(type, values)) == {int}:
            for name, dtype in _INT_DTYPES.items():
                try:
                    columns[key] = (name, np.array(values, dtype=dtype).tobytes())
                    break
                except OverflowError:
                    continue
            if key in columns:
                continue
        columns[key] = values
    return {"n": n, "keys": keys, "columns": columns, "missing": missing}


@dataclass(frozen=True, slots=True)
class TraceColumns:
    """One device's trace entries as checked columns."""

    #: How many entries, >= 0.
    n: int
    #: The keys, in the entries' order.
    keys: tuple[str, ...]
    #: Each key's values: a numpy int64/uint64 array, or a list (None where an entry lacks
    #: the key), each of length :attr:`n`.
    columns: dict[str, Any]
    #: For each key some entries lack: those entries' indices, ascending.
    missing: dict[str, list[int]]
    _built: list[list[dict[str, Any]]] = field(default_factory=list, repr=False, compare=False)

    def entries(self) -> list[dict[str, Any]]:
        """The entries as torch's trace-entry dicts, oldest first (built on the first call,
        then the same list)."""
        if not self._built:
            lists = [self.columns[k].tolist() if isinstance(self.columns[k], np.ndarray)
                     else self.columns[k] for k in self.keys]
            rows = [dict(zip(self.keys, row)) for row in zip(*lists)] if lists else []
            for key, where in self.missing.items():
                for i in where:
                    del rows[i][key]
            self._built.append(rows)
        return self._built[0]

    @classmethod
    def from_wire(cls, data: Any, path: str, what: str) -> TraceColumns:
        """Read and check columns sent by :func:`to_wire` (see the module documentation).

        Raises
        ------
        SnapshotLoadError
            A malformed structure, or an entry the snapshot check refuses (named).
        """
        def bad(text: str) -> SnapshotLoadError:
            return SnapshotLoadError(f"{what}: {path}: {text}")

        if not isinstance(data, dict):
            raise bad(f"is a {type(data).__name__}, expected the columns of a trace")
        n, keys, cols, missing = (data.get("n"), data.get("keys"), data.get("columns"),
                                  data.get("missing"))
        if type(n) is not int or n < 0:
            raise bad(f"n is {n!r:.40}, expected an int >= 0")
        if (not isinstance(keys, list) or len(keys) > _MAX_KEYS
                or not all(type(k) is str for k in keys) or len(set(keys)) != len(keys)):
            raise bad("keys is not a list of distinct str")
        if not isinstance(cols, dict) or set(cols) != set(keys):
            raise bad("columns do not match the keys")
        if not isinstance(missing, dict) or not set(missing) <= set(keys):
            raise bad("missing names unknown keys")
        columns: dict[str, Any] = {}
        for key in keys:
            col = cols[key]
            if isinstance(col, tuple):
                if (len(col) != 2 or col[0] not in _INT_DTYPES or type(col[1]) is not bytes
                        or len(col[1]) != 8 * n):
                    raise bad(f"column {key!r:.40} is not {n} packed integers")
                columns[key] = np.frombuffer(col[1], dtype=_INT_DTYPES[col[0]])
            elif isinstance(col, list) and len(col) == n:
                columns[key] = col
            else:
                raise bad(f"column {key!r:.40} does not hold {n} values")
        for key, where in missing.items():
            if (not isinstance(where, list) or not all(type(i) is int for i in where)
                    or where != sorted(set(where)) or (where and not 0 <= where[0] <= where[-1] < n)
                    or isinstance(columns[key], np.ndarray)):
                raise bad(f"missing[{key!r:.40}] is not ascending entry indices")
            if any(columns[key][i] is not None for i in where):
                raise bad(f"missing[{key!r:.40}] names entries that hold the key")
        out = cls(n=n, keys=tuple(keys), columns=columns, missing=dict(missing))
        try:
            out._check(path, what)
        except SnapshotLoadError:  # locate it: the check over the entries names the entry
            check_trace_entries(out.entries(), path, what)
            raise
        return out

    def _check(self, path: str, what: str) -> None:
        """The snapshot check over rows holding each distinct value of each key (and each
        integer column's extremes), so every value is judged by the check's own rules."""
        if not self.n:
            return
        for required in ("action", "size"):
            if required not in self.columns or self.missing.get(required):
                raise SnapshotLoadError(f"{what}: {path}: an entry lacks the key {required!r}")
        rows: list[dict[str, Any]] = []
        for key in self.keys:
            col = self.columns[key]
            if isinstance(col, np.ndarray):
                values: list[Any] = [int(col.min()), int(col.max())]
            else:
                skip = set(self.missing.get(key, ()))
                present = [v for i, v in enumerate(col) if i not in skip] if skip else col
                try:  # (by type and value: 1, 1.0 and True are distinct here)
                    values = [v for _, v in dict.fromkeys(zip(map(type, present), present))]
                except TypeError:  # unhashable (stacks): distinct objects
                    values = list({id(v): v for v in present}.values())
            for value in values:
                row: dict[str, Any] = {"action": "alloc", "size": 0}
                row[key] = value
                rows.append(row)
        check_trace_entries(rows, path, what)
