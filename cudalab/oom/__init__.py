"""Why a device ran out of memory: :func:`explain_oom` and the session's last error.

==============  ================================================================================
module          what it holds
==============  ================================================================================
``state``       :func:`capture_state`: every allocator's bytes on a device, NVML, the driver
``verdict``     the byte accounting and :func:`judge`, the cause of an out-of-memory error
``referrers``   :func:`find_referrers`: which Python names keep the largest arrays alive
``session``     the out-of-memory observers and the IPython hook: :func:`last_oom`
``explain``     :func:`explain_oom` and :class:`OOMExplanation`; counterfactual replays
``panel``       the explanation's HTML panel and text
==============  ================================================================================

``cudalab.memory.explain_oom`` is :func:`explain_oom`; ``%cuda_memory why`` shows it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cudalab.oom.explain import (
        COUNTERFACTUAL_SETTINGS,
        OOMExplanation,
        counterfactuals,
        explain_oom,
    )
    from cudalab.oom.referrers import Holder, Referrers, find_referrers
    from cudalab.oom.session import OOMEvent, is_oom_error, last_oom, note_error, watch
    from cudalab.oom.state import AllocatorFigures, DeviceState, capture_state
    from cudalab.oom.verdict import CATEGORIES, VERDICTS, judge

__all__ = [
    "CATEGORIES",
    "COUNTERFACTUAL_SETTINGS",
    "VERDICTS",
    "AllocatorFigures",
    "DeviceState",
    "Holder",
    "OOMEvent",
    "OOMExplanation",
    "Referrers",
    "capture_state",
    "counterfactuals",
    "explain_oom",
    "find_referrers",
    "is_oom_error",
    "judge",
    "last_oom",
    "note_error",
    "watch",
]

# Loaded on first use (``%load_ext cudalab`` imports only ``session``, which is light).
_LAZY = {
    **{n: "explain" for n in ("COUNTERFACTUAL_SETTINGS", "OOMExplanation", "counterfactuals",
                              "explain_oom")},
    **{n: "referrers" for n in ("Holder", "Referrers", "find_referrers")},
    **{n: "session" for n in ("OOMEvent", "is_oom_error", "last_oom", "note_error", "watch")},
    **{n: "state" for n in ("AllocatorFigures", "DeviceState", "capture_state")},
    **{n: "verdict" for n in ("CATEGORIES", "VERDICTS", "judge")},
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cudalab.oom' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"cudalab.oom.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
