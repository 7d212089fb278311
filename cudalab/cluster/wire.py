"""The messages between a rank and a watcher, after their signature checked out
(:mod:`cudalab.cluster.signing`).

Every message is ``[signature, header, payload]`` (a ROUTER socket adds the peer's routing
id in front). The header is a small JSON object (at most :data:`MAX_HEADER_BYTES`):

* samples (rank -> watchers, PUB): ``{"v": 1, "kind": "samples", "job", "rank", "pid",
  "seq", "time", "dropped", "rejected", "error"}``; payload: the JSON list of the rank's
  :meth:`DeviceSample.to_dict` (at most :data:`MAX_SAMPLES_BYTES`);
* request (watcher -> rank): ``{"v": 1, "kind": "request", "id", "what": [...], "tail"}``;
  payload empty;
* reply (rank -> watcher): ``{"v": 1, "kind": "reply", "id", "error"}``; payload: the
  records of :func:`cudalab.cluster.records.encode` (decoded by the bounded loader), or
  empty with an ``error``.

Decoding is bounded: sizes are checked before parsing, JSON nesting deeper than
:data:`MAX_JSON_DEPTH` is refused before ``json.loads`` sees it, and every field is checked
(a :class:`MessageError`, a ValueError, names it).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

from cudalab.memory_tools.samples import DeviceSample

__all__ = ["MessageError", "MAX_HEADER_BYTES", "MAX_SAMPLES_BYTES", "MAX_JSON_DEPTH",
           "encode_json", "decode_json", "decode_header", "decode_samples"]

#: The largest header accepted (bytes).
MAX_HEADER_BYTES = 16 << 10
#: The largest samples payload accepted (bytes): a sample is about 1 KB.
MAX_SAMPLES_BYTES = 4 << 20
#: The deepest JSON nesting accepted (a sample nests 3 deep).
MAX_JSON_DEPTH = 32
_VERSION = 1
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = re.compile(rb"[^\[\]{}]+")


class MessageError(ValueError):
    """A signed message whose content is malformed (too large, too deep, a field wrong)."""


def encode_json(value: Any) -> bytes:
    """``value`` as compact JSON bytes (values JSON cannot hold become their ``str``)."""
    return json.dumps(value, separators=(",", ":"), default=str).encode()


def _depth(data: bytes) -> int:
    """How deeply ``data``'s JSON nests (strings skipped; one C-level pass per step)."""
    brackets = _BRACKETS.sub(b"", _STRINGS.sub(b"", data))
    depth = deepest = 0
    for b in brackets:
        if b in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
    return deepest


def decode_json(data: bytes, what: str, limit: int) -> Any:
    """``data`` parsed as JSON, bounded to ``limit`` bytes and :data:`MAX_JSON_DEPTH` levels."""
    if len(data) > limit:
        raise MessageError(f"{what}: {len(data):,} bytes, more than the limit of {limit:,}")
    if _depth(bytes(data)) > MAX_JSON_DEPTH:
        raise MessageError(f"{what}: nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise MessageError(f"{what}: not JSON ({exc})") from None


_HEADER_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "samples": {"job": (str,), "rank": (int,), "pid": (int,), "seq": (int,),
                "time": (int, float), "dropped": (int,), "rejected": (int,), "error": (str,)},
    "request": {"id": (str,), "what": (list,), "tail": (int,)},
    "reply": {"id": (str,), "error": (str,)},
}


def decode_header(data: bytes, kind: str, what: str) -> dict[str, Any]:
    """The header ``data`` of a message that must be of ``kind`` (``"samples"``,
    ``"request"``, ``"reply"``), every field of that kind present and typed."""
    header = decode_json(data, f"{what}: header", MAX_HEADER_BYTES)
    if not isinstance(header, dict):
        raise MessageError(f"{what}: header is a {type(header).__name__}, expected an object")
    if header.get("v") != _VERSION or header.get("kind") != kind:
        raise MessageError(f"{what}: header is version {header.get('v')!r:.20} "
                           f"{header.get('kind')!r:.40}, expected version {_VERSION} {kind!r}")
    for name, types in _HEADER_FIELDS[kind].items():
        value = header.get(name)
        if type(value) not in types:
            raise MessageError(f"{what}: header[{name!r}] is {value!r:.40}, expected "
                               f"{' or '.join(t.__name__ for t in types)}")
    return header


def header(kind: str, **fields: Any) -> bytes:
    """A header of ``kind`` with ``fields``, as bytes."""
    return encode_json({"v": _VERSION, "kind": kind, **fields})


def samples_header_prefix(job: str, rank: int, pid: int) -> bytes:
    """The fixed part of a rank's samples headers (:func:`samples_header` adds the rest)."""
    return encode_json({"v": _VERSION, "kind": "samples", "job": job, "rank": rank,
                        "pid": pid})[:-1]


def samples_header(prefix: bytes, seq: int, time: float, dropped: int, rejected: int,
                   error_json: bytes) -> bytes:
    """A samples header: ``prefix`` (:func:`samples_header_prefix`) and the tick's fields,
    formatted without building a dict (the same JSON as :func:`header` makes);
    ``error_json`` is the error text already as JSON."""
    return b'%s,"seq":%d,"time":%s,"dropped":%d,"rejected":%d,"error":%s}' % (
        prefix, seq, repr(float(time)).encode(), dropped, rejected, error_json)


def decode_samples(data: bytes, what: str) -> list[DeviceSample]:
    """The samples payload ``data``: a JSON list of sample dicts, each checked."""
    raw = decode_json(data, f"{what}: samples", MAX_SAMPLES_BYTES)
    if not isinstance(raw, list):
        raise MessageError(f"{what}: samples is a {type(raw).__name__}, expected a list")
    try:
        return [DeviceSample.from_dict(s, f"{what}: samples[{i}]") for i, s in enumerate(raw)]
    except ValueError as exc:
        raise MessageError(str(exc)) from None


def encode_samples(samples: Sequence[DeviceSample]) -> bytes:
    """``samples`` as the JSON payload :func:`decode_samples` reads: each sample's
    :meth:`~DeviceSample.to_dict`, built here from the field names read once and its
    identity's dict kept per identity (a rank's identities do not change), so a tick
    builds one dict per sample and nothing else."""
    out = []
    for s in samples:
        d = {name: getattr(s, name) for name in _SAMPLE_FIELDS}
        identity = _IDENTITY_DICTS.get(s.identity)
        if identity is None:
            if len(_IDENTITY_DICTS) >= 64:
                _IDENTITY_DICTS.clear()
            identity = _IDENTITY_DICTS[s.identity] = s.identity.to_dict()
        d["identity"] = identity
        d["pools"] = [dict(p) for p in s.pools]
        d["extra"] = dict(s.extra)
        d["device"] = identity["device"]
        out.append(d)
    return encode_json(out)


_SAMPLE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DeviceSample))
_IDENTITY_DICTS: dict[Any, dict[str, Any]] = {}
