"""The session's last out-of-memory error, caught as it happens.

:func:`watch` (called by ``%load_ext cudalab`` and by the first :func:`explain_oom
<cudalab.oom.explain_oom>`) attaches an out-of-memory observer to cudalab's allocators and,
when torch is imported, to torch's (``torch._C._cuda_attach_out_of_memory_observer``, once
per process: torch has no detach). At the error the observer records an :class:`OOMEvent`:
the device, the bytes asked for, the limit, the driver's free bytes and the device's
:class:`~cudalab.oom.state.DeviceState` at that moment (read with the allocator's lock
released, before the exception propagates and anything is freed).

In IPython, a ``post_run_cell`` callback looks at each failed cell's exception: an
out-of-memory error (cudalab's :class:`~cudalab.errors.OutOfMemoryError`, torch's
``torch.OutOfMemoryError``, CuPy's ``OutOfMemoryError``, also as the cause or context of
another error) becomes the session's last one (:func:`last_oom`), paired with the observer's
event when they match. Outside IPython, :func:`note_error` does the same for an error the
caller caught. Nothing here raises into the user: a failure to capture is kept as text.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cudalab import _observe
from cudalab.errors import OutOfMemoryError

if TYPE_CHECKING:
    from cudalab.oom.state import DeviceState

__all__ = ["OOMEvent", "is_oom_error", "last_oom", "note_error", "parse_oom_text", "watch"]


@dataclass(frozen=True, slots=True)
class OOMEvent:
    """One out-of-memory error as the allocator saw it."""

    #: The device index.
    device: int
    #: Bytes the allocator asked the driver for (torch's ``alloc_size``: the segment size).
    request: int
    #: The per-process limit in bytes when a fraction is set, else None.
    limit: int | None
    #: The driver's free bytes at the error.
    free: int
    #: ``time.time()`` of the error.
    time: float
    #: The allocator that failed: "cudalab", "torch", "cupy" or "unknown".
    source: str
    #: The device at the error (None when it could not be read; then ``note`` says why).
    state: DeviceState | None
    note: str = ""


_lock = threading.Lock()
_pending: list[OOMEvent] = []  # observer events not yet paired with an error (last 8)
_last: list[Any] = [None, None]  # [error, event] of the session's last out-of-memory error
_watching = {"cudalab": False, "torch": False, "ipython": set()}  # type: dict[str, Any]


def _record(event: OOMEvent) -> None:
    with _lock:
        _pending.append(event)
        del _pending[:-8]


def _capture(device: int) -> tuple[DeviceState | None, str]:
    try:
        from cudalab.oom.state import capture_state

        return capture_state(device), ""
    except Exception as exc:  # never hide the out-of-memory error behind ours
        return None, f"the state at the error could not be read ({type(exc).__name__}: {exc})"


def _on_cudalab_oom(device: int, alloc: int, allowed: int, free: int) -> None:
    state, note = _capture(device)
    total = state.total if state is not None else allowed
    limit = allowed if allowed < total else None
    _record(OOMEvent(device, int(alloc), limit, int(free), time.time(), "cudalab", state, note))


def _on_torch_oom(device: int, alloc: int, allowed: int, free: int) -> None:
    try:
        _on_oom_from("torch", device, alloc, allowed, free)
    except Exception:  # pragma: no cover - torch calls this from C++: never raise there
        pass


def _on_oom_from(source: str, device: int, alloc: int, allowed: int, free: int) -> None:
    state, note = _capture(device)
    total = state.total if state is not None else allowed
    limit = allowed if allowed < total else None
    _record(OOMEvent(device, int(alloc), limit, int(free), time.time(), source, state, note))


def watch(shell: Any = None) -> None:
    """Attach the out-of-memory observers (cudalab's; torch's when torch is imported) and,
    in IPython (``shell``, default: the running one), the failed-cell callback. Idempotent; imports nothing heavy (``%load_ext cudalab`` calls it)."""
    if not _watching["cudalab"]:
        # (the observer bus directly: cudalab.memory's attach would import the allocator,
        # and %load_ext imports neither it nor numpy)
        _observe.subscribe_out_of_memory(_on_cudalab_oom)
        _watching["cudalab"] = True
    torch = sys.modules.get("torch")
    if torch is not None and not _watching["torch"]:
        attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer",
                         None)
        if callable(attach):
            try:
                attach(_on_torch_oom)
                _watching["torch"] = True
            except Exception:  # a torch without CUDA
                pass
    if shell is None:
        ipython = sys.modules.get("IPython")
        get = getattr(ipython, "get_ipython", None)
        shell = get() if callable(get) else None
    events = getattr(shell, "events", None)
    if events is not None and id(shell) not in _watching["ipython"]:
        events.register("post_run_cell", _post_run_cell)
        _watching["ipython"].add(id(shell))


def unwatch(shell: Any) -> None:
    """Remove the failed-cell callback from ``shell`` (the observers stay: torch's cannot go)."""
    events = getattr(shell, "events", None)
    if events is not None and id(shell) in _watching["ipython"]:
        try:
            events.unregister("post_run_cell", _post_run_cell)
        except ValueError:
            pass
        _watching["ipython"].discard(id(shell))


def _post_run_cell(result: Any) -> None:
    error = getattr(result, "error_in_exec", None)
    if error is not None:
        try:
            note_error(error)
        except Exception:  # never raise into the user's session
            pass


def is_oom_error(error: BaseException | None) -> BaseException | None:
    """The out-of-memory error in ``error`` or its causes/contexts (None when none is)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OutOfMemoryError) or (
                type(error).__name__ == "OutOfMemoryError"
                and type(error).__module__.split(".")[0] in ("torch", "cupy", "cupy_backends")):
            return error
        error = error.__cause__ or error.__context__
    return None


_SIZE = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_GPU = re.compile(r"GPU (\d+) has a total capacity")
_CUPY = re.compile(r"Out of memory allocating ([\d,]+) bytes")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def parse_oom_text(text: str) -> tuple[int | None, int | None]:
    """(device, bytes asked for) from an out-of-memory message (torch's, cudalab's, CuPy's);
    None where the text does not say. torch prints sizes with two decimals, so the bytes
    are rounded."""
    device = None
    request = None
    m = _GPU.search(text)
    if m:
        device = int(m.group(1))
    m = _SIZE.search(text)
    if m:
        request = int(float(m.group(1)) * _UNITS[m.group(2)])
    else:
        m = _CUPY.search(text)
        if m:
            request = int(m.group(1).replace(",", ""))
    return device, request


def note_error(error: BaseException) -> bool:
    """Make ``error`` the session's last out-of-memory error when it is one (or has one as
    its cause or context), paired with the observer's latest event. Returns whether it was."""
    oom = is_oom_error(error)
    if oom is None:
        return False
    with _lock:
        event = _matching(oom)
        if event is not None:
            _pending.remove(event)
        _last[0] = oom
        _last[1] = event
    return True


def _source_of(error: BaseException) -> str:
    return "cudalab" if isinstance(error, OutOfMemoryError) else \
        type(error).__module__.split(".")[0].replace("cupy_backends", "cupy")


def _matching(error: BaseException) -> OOMEvent | None:
    """The latest unpaired event of ``error``'s allocator whose device and size agree with
    its message (torch's and cudalab's print the size with two decimals); the caller holds
    the lock."""
    source = _source_of(error)
    device, size = parse_oom_text(str(error))
    for e in reversed(_pending):
        if e.source != source or (device is not None and e.device != device):
            continue
        if size is not None and abs(e.request - size) > max(e.request, size) * 0.01 + 1024:
            continue
        return e
    return None


def last_oom() -> tuple[BaseException | None, OOMEvent | None]:
    """The session's last out-of-memory error and its observer event (either may be None)."""
    with _lock:
        return _last[0], _last[1]


def take_event(error: BaseException) -> OOMEvent | None:
    """The observer event of ``error``: the session's when it is the last error, else the
    latest event not yet paired with one."""
    with _lock:
        if _last[0] is error:
            return _last[1]
        return _matching(error)


def forget() -> None:
    """Forget the last error and the unpaired events (tests; ``%cuda_memory why --forget``)."""
    with _lock:
        _pending.clear()
        _last[0] = _last[1] = None
