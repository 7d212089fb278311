"""The stream sanitizer's switch, read by every place where cudalab touches device memory.

:mod:`cudalab.sanitizer` sits high in the layers; the places it observes (events, streams,
kernel launches, copies, fills, the RNG, frees) sit low. They reach it through this module,
which imports nothing: each site reads the flag :data:`on` first and calls :data:`tracker`
only when it is set::

    if _sanitizer_hook.on:
        _sanitizer_hook.tracker.access(stream, reads, writes, "my_kernel")

so with the sanitizer off a site costs one module-global read and no function call
(docs/sanitizer.md, "Off means free"). The tracker is a
:class:`cudalab.sanitizer.tracking.Tracker`; the methods the sites call are its hook
protocol:

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

from typing import Any

__all__: list[str] = []

#: True while the sanitizer is enabled (then :data:`tracker` is set). Invariant: only
#: :mod:`cudalab.sanitizer` writes it, together with :data:`tracker`.
on = False

#: The :class:`cudalab.sanitizer.tracking.Tracker` while :data:`on`; None otherwise.
tracker: Any = None
