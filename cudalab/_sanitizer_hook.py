"""The stream sanitizer's switch: a read-only view of the observer bus's memory-access family.

:mod:`cudalab.sanitizer` sits high in the layers; the places it observes (events, streams,
kernel launches, copies, fills, the RNG, frees) sit low. They reach it through the observer
bus (:mod:`cudalab._observe`), which imports nothing of cudalab: each site reads the flag
``_observe.access_on`` first and calls ``_observe.access_tracker`` only when it is set::

    if _observe.access_on:
        _observe.access_tracker.access(stream, reads, writes, "my_kernel")

This module keeps the old names as views of those two: :data:`on` is the bus's flag and
:data:`tracker` its tracker (None while nobody listens); both are read-only here (subscribe
with :func:`cudalab._observe.subscribe_access`, or :func:`cudalab.sanitizer.enable`).

so with the sanitizer off a site costs one module-global read and no function call
(docs/sanitizer.md, "Off means free"). The tracker is a
:class:`cudalab.sanitizer.tracking.Tracker`; the methods the sites call are its hook
protocol (:class:`cudalab._observe.MemoryAccessObserver`):

``allocated(ptr, nbytes, stream)``, ``freed(ptr)``, ``stream_recorded(ptr, stream)``
    an allocation, its free request, ``record_stream``;
``kernel_launch(kernel, stream, values)``
    a :class:`cudalab.kernels.Kernel` launch (its ``access`` annotation says which pointer
    arguments it reads and writes);
``access(stream, reads, writes, name)``
    any other device work: ``reads`` and ``writes`` are sequences of ``(ptr, nbytes)``
    (jiterator functions and array operators report here, as
    :func:`cudalab.sanitizer.record_launch` does for user code);
``transfer(stream, device_ptr, nbytes, to_host, waited)``
    a host transfer: to the host (a read the host then sees, ``DeviceArray.numpy()``) or
    from it (a write); ``waited``: the host waited for it;
``stream_created(stream)``, ``event_record(event, stream)``, ``event_wait(event, stream)``, ``event_synchronize(event)``,
``stream_synchronize(stream)``, ``device_synchronize(device)``
    the happens-before edges.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from cudalab import _observe

__all__: list[str] = []


class _View(types.ModuleType):
    """This module's class: ``on`` and ``tracker`` read the bus (nothing stored here)."""

    @property
    def on(self) -> bool:
        """True while a memory-access observer listens (the bus's ``access_on``)."""
        return _observe.access_on

    @property
    def tracker(self) -> Any:
        """The bus's ``access_tracker``: the sanitizer's tracker while it is enabled (or a
        fan-out when several observers listen); None while nobody listens."""
        return _observe.access_tracker


sys.modules[__name__].__class__ = _View
