"""Happens-before between streams and the host: vector clocks, as torch's CSAN keeps them.

Every access the sanitizer sees gets a sequence number from one global counter. Each stream
has a vector clock ``current[s]``: for every stream ``t``, the last sequence number of ``t``
that work queued on ``s`` from now on is ordered after. An event carries the clock its
stream had when it was recorded; waiting on it merges that clock (pointwise maximum) into
the waiter's. The host has a clock too: what it has waited for. Host waits (stream, event
or device synchronize) merge into every stream, since all work queued later runs after.

Streams are keyed by :data:`StreamKey` ``(device, handle)``, events by ``id(event)`` (a
recorded event is kept alive by its owner while it can be waited on; an event that was never
recorded, or closed, is never waited on, so a reused id never meets a stale clock that
matters: a new record replaces it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["StreamKey", "StreamSynchronizations", "stream_key"]

#: (device index, driver stream handle as an int); the legacy default stream is handle 0.
StreamKey = tuple[int, int]


def stream_key(stream: Any) -> StreamKey:
    """The key of a :class:`cudalab.Stream` (handles 0 and 1 both name the legacy stream)."""
    handle = stream.cuda_stream
    return (stream.device_index, 0 if handle == 1 else handle)


def _merge(into: dict[StreamKey, int], other: dict[StreamKey, int]) -> None:
    """Pointwise maximum of two clocks, into ``into``."""
    for key, seq in other.items():
        if into.get(key, -1) < seq:
            into[key] = seq


class StreamSynchronizations:
    """The vector clocks of every stream seen, of every recorded event, and of the host.

    Invariants: ``current[s][s]`` is the sequence number of the last access on ``s`` (0 if
    none); a clock never decreases; ``seq`` is the largest number handed out.
    """

    __slots__ = ("seq", "current", "recorded", "host")

    def __init__(self) -> None:
        self.seq = 0  # the last sequence number handed out
        self.current: dict[StreamKey, dict[StreamKey, int]] = {}  # stream -> its clock
        self.recorded: dict[int, dict[StreamKey, int]] = {}  # id(event) -> clock at record
        self.host: dict[StreamKey, int] = {}  # stream -> last seq the host waited for

    def _clock(self, s: StreamKey) -> dict[StreamKey, int]:
        """The clock of ``s``, made on first sight: ordered after what the host waited for
        (torch's create_stream; a stream seen late is backfilled the same way)."""
        clock = self.current.get(s)
        if clock is None:
            self.host.setdefault(s, 0)
            clock = self.current[s] = dict(self.host)
        return clock

    def create_stream(self, s: StreamKey) -> None:
        """A new stream ``s`` (its handle may be a destroyed stream's): its clock starts
        from what the host waited for."""
        self.host.setdefault(s, 0)
        self.current[s] = dict(self.host)

    def access(self, s: StreamKey) -> int:
        """A new access on ``s``: its sequence number."""
        clock = self._clock(s)
        self.seq += 1
        clock[s] = self.seq
        return self.seq

    def is_ordered_after(self, s: StreamKey, seq: int, other: StreamKey) -> bool:
        """Whether work queued on ``s`` now runs after access ``seq`` of stream ``other``."""
        return seq <= self._clock(s).get(other, -1)

    def host_waited(self, seq: int, other: StreamKey) -> bool:
        """Whether the host has waited for access ``seq`` of stream ``other``."""
        return seq <= self.host.get(other, -1)

    def record(self, event: int, s: StreamKey) -> None:
        """``event`` recorded on ``s`` (the last record wins)."""
        self.recorded[event] = dict(self._clock(s))

    def wait(self, event: int, s: StreamKey) -> None:
        """``s`` waits for ``event``."""
        clock = self._clock(s)
        recorded = self.recorded.get(event)
        if recorded:
            _merge(clock, recorded)

    def event_synchronize(self, event: int) -> None:
        """The host waited for ``event``: it and every stream are ordered after its clock."""
        recorded = self.recorded.get(event)
        if recorded:
            self._host_waited(recorded)

    def stream_synchronize(self, s: StreamKey) -> None:
        """The host waited for all work queued on ``s``."""
        self._host_waited(dict(self._clock(s)))

    def device_synchronize(self, device: int) -> None:
        """The host waited for all work of ``device``."""
        waited = {key: clock.get(key, 0) for key, clock in self.current.items() if key[0] == device}
        self._host_waited(waited)

    def _host_waited(self, clock: dict[StreamKey, int]) -> None:
        _merge(self.host, clock)
        for other in self.current.values():
            _merge(other, clock)
