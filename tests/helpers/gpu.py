"""Which backend the test session runs on, decided once when this module is imported.

* ``CUDALAB_SIMULATOR=1`` (CI): the simulator.
* otherwise, if a real GPU answers: the real backend.
* otherwise the simulator, selected explicitly (``CUDALAB_SIMULATOR=1`` is set for the
  session, and the pytest header says why), so a laptop runs the same suite as CI. The
  library itself never falls back.
"""

from __future__ import annotations

import os

__all__ = ["BACKEND", "HAS_GPU", "REASON"]

_REASON = ""


def _probe_real_gpu() -> tuple[bool, str]:
    try:
        from cudalab._driver.cuda import CudaBackend

        b = CudaBackend()
        b.init()
        n = b.device_count()
        if n <= 0:
            return False, "no CUDA device"
        return True, f"{n} x {b.device_info(0).name}"
    except Exception as exc:  # no driver, no device, bindings missing
        return False, f"{type(exc).__name__}: {exc}"


if os.environ.get("CUDALAB_SIMULATOR", "").strip().lower() in {"1", "true", "yes", "on"}:
    _BACKEND = "simulator"
    _REASON = "CUDALAB_SIMULATOR=1"
else:
    ok, why = _probe_real_gpu()
    if ok:
        _BACKEND = "cuda"
        _REASON = why
    else:
        os.environ["CUDALAB_SIMULATOR"] = "1"
        _BACKEND = "simulator"
        _REASON = f"no real GPU ({why}); the test harness selected the simulator"

HAS_GPU = _BACKEND == "cuda"

BACKEND = _BACKEND
REASON = _REASON
