"""CUPTI kernel activity: the seam's only user of the optional ``cupti-python`` package.

:class:`KernelActivity` collects CUPTI ``CONCURRENT_KERNEL`` activity records (every
library's kernels, not only cudalab's) between :meth:`~KernelActivity.start` and
:meth:`~KernelActivity.stop`, decoded into plain tuples (:data:`KernelRecord`). The upper
layers reach it through :func:`cudalab._internal.cupti_kernel_activity`; nothing above
``cudalab._driver`` imports ``cupti``.

* The package is imported lazily, on the first :meth:`~KernelActivity.start`
  (:func:`load`), so importing this module costs nothing.
* When CUPTI cannot be used, :attr:`KernelActivity.note` says why in one clause (the
  package is missing or broken, another profiler holds CUPTI, a version mismatch or a
  permission problem), for the caller to show next to its fallback.
* CUPTI's activity API has one pair of buffer callbacks per process: they are registered
  once (:data:`_registered`) and deliver into the list of the one active tracer
  (:data:`_sink`, None while none is active).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BUFFER_BYTES", "KernelActivity", "KernelRecord", "error_text", "load"]

#: One decoded kernel record: ``(name, device, start_ns, end_ns, stream_id,
#: (grid_x, grid_y, grid_z), (block_x, block_y, block_z))``.
KernelRecord = tuple[str, int, int, int, int, tuple[int, int, int], tuple[int, int, int]]

#: Bytes of each activity buffer handed to CUPTI (no alignment requirement: 0).
BUFFER_BYTES = 8 << 20

#: The active tracer's record list; the buffer-completed callback appends to it. None while
#: no tracer is active (records delivered then are dropped).
_sink: list[KernelRecord] | None = None
#: Whether the buffer callbacks are registered with CUPTI (once per process: CUPTI keeps
#: one pair; registering again would replace them).
_registered = False


def load() -> tuple[Any, str]:
    """The ``cupti.cupti`` module, or ``(None, why not)``.

    Returns
    -------
    tuple
        ``(module, "")`` when the package imports, else ``(None, reason)``: the package
        is not installed, or it is broken / cannot find libcupti.
    """
    try:
        from cupti import cupti
    except ImportError:
        return None, ("CUPTI is not available (the optional cupti-python package is not "
                      "installed: pip install cupti-python)")
    except Exception as exc:  # a broken install, a missing libcupti
        return None, f"cupti-python could not be loaded ({exc})"
    return cupti, ""


def _buffer_requested() -> tuple[int, int]:
    """CUPTI asks for an activity buffer: (its size, its alignment)."""
    return BUFFER_BYTES, 0


def _buffer_completed(activities: list) -> None:
    """CUPTI hands back a full buffer: decode its kernel records into :data:`_sink`."""
    sink = _sink
    if sink is None:
        return
    for a in activities:
        try:
            sink.append((str(a.name), int(a.device_id), int(a.start), int(a.end),
                         int(a.stream_id), (int(a.grid_x), int(a.grid_y), int(a.grid_z)),
                         (int(a.block_x), int(a.block_y), int(a.block_z))))
        except AttributeError:
            continue  # not a kernel record


def error_text(mod: Any, exc: BaseException) -> str:
    """Why a CUPTI call failed, in one clause for people (``mod`` is ``cupti.cupti``)."""
    status = getattr(exc, "status", None)
    name = ""
    try:
        name = mod.Result(status).name if status is not None else ""
    except Exception:
        name = str(status)
    if "MULTIPLE_SUBSCRIBERS" in name:
        return ("CUPTI is held by another profiler in this process (Nsight Systems/Compute, "
                "torch.profiler/kineto, ...)")
    if "NOT_INITIALIZED" in name or "INSUFFICIENT_PRIVILEGES" in name:
        return (f"CUPTI could not start ({name}: a CUPTI/driver version mismatch or missing "
                "profiling permission)")
    return f"CUPTI failed ({name or exc})"


class KernelActivity:
    """CONCURRENT_KERNEL activity records around a region (every library's kernels).

    One tracer is active at a time in a process (CUPTI delivers into one list).
    """

    def __init__(self) -> None:
        #: The decoded records (:data:`KernelRecord`), appended while active and at stop.
        self.records: list[KernelRecord] = []
        #: Why CUPTI could not be used ("" while nothing went wrong).
        self.note = ""
        #: True between a successful :meth:`start` and :meth:`stop`.
        self.active = False
        #: True once :meth:`start` succeeded (stays True after :meth:`stop`).
        self.started = False
        self._mod: Any = None

    def start(self) -> bool:
        """Enable kernel activity records; False (and :attr:`note` set) when CUPTI cannot."""
        global _sink, _registered
        mod, why = load()
        if mod is None:
            self.note = why
            return False
        try:
            if not _registered:
                mod.activity_register_callbacks(_buffer_requested, _buffer_completed)
                _registered = True
            _sink = self.records
            mod.activity_enable(mod.ActivityKind.CONCURRENT_KERNEL)
        except Exception as exc:
            _sink = None
            self.note = error_text(mod, exc)
            return False
        self._mod = mod
        self.active = self.started = True
        return True

    def stop(self) -> None:
        """Flush the buffers into :attr:`records` and disable the records (no-op if not
        active); a failed flush sets :attr:`note`."""
        global _sink
        if not self.active:
            return
        mod = self._mod
        try:
            mod.activity_flush_all(1)
        except Exception as exc:
            self.note = error_text(mod, exc)
        finally:
            try:
                mod.activity_disable(mod.ActivityKind.CONCURRENT_KERNEL)
            except Exception:
                pass
            _sink = None
            self.active = False
