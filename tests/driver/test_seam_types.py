"""The seam's typing (issue 35, item 5): every method of ``Backend`` and ``Nccl`` names its
handles with the types of :mod:`cudalab._driver.handles` (never ``Any``), and both backends
implement each method with the same handle types."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import pytest

from cudalab._driver import handles
from cudalab._driver.base import Backend
from cudalab._driver.nccl_seam import Nccl

HANDLE_TYPES = {getattr(handles, name) for name in handles.__all__
                if name not in ("ClosedHandle", "OpaqueHandle")}


def _seam_methods(cls: type) -> dict[str, Any]:
    return {name: fn for name, fn in vars(cls).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def _handle_hints(fn: Any) -> dict[str, Any]:
    """The parameters and return value of ``fn`` whose type mentions a handle type."""
    hints = typing.get_type_hints(fn)
    return {name: hint for name, hint in hints.items()
            if HANDLE_TYPES & ({hint} | set(_flatten(hint)))}


def _flatten(hint: Any) -> list[Any]:
    """Every type inside ``hint`` (``Sequence[StreamHandle]``, ``Callable[[...], ...]``...)."""
    out = []
    args = hint if isinstance(hint, list) else typing.get_args(hint)
    for arg in args:
        if not isinstance(arg, list):
            out.append(arg)
        out.extend(_flatten(arg))
    return out


@pytest.mark.parametrize("cls", [Backend, Nccl])
def test_no_seam_method_takes_or_returns_any(cls):
    checked = 0
    for name, fn in _seam_methods(cls).items():
        for param, hint in typing.get_type_hints(fn).items():
            assert hint is not Any, f"{cls.__name__}.{name}: {param} is Any"
            checked += 1
    assert checked > 50


def test_the_seam_names_every_kind_of_handle():
    used = set()
    for cls in (Backend, Nccl):
        for fn in _seam_methods(cls).values():
            for hint in _handle_hints(fn).values():
                used |= HANDLE_TYPES & ({hint} | set(_flatten(hint)))
    # ContextHandle and DeviceHandle live inside the real backend only
    assert used == HANDLE_TYPES - {handles.ContextHandle, handles.DeviceHandle}


def _implementations() -> list[tuple[type, type]]:
    from cudalab._driver.cuda import CudaBackend
    from cudalab._driver.nccl import RealNccl
    from cudalab._driver.sim import SimulatorBackend
    from cudalab._driver.sim.nccl import SimulatedNccl

    return [(Backend, CudaBackend), (Backend, SimulatorBackend), (Nccl, RealNccl),
            (Nccl, SimulatedNccl)]


@pytest.mark.parametrize("seam, impl", _implementations(),
                         ids=lambda cls: cls.__name__)
def test_both_backends_use_the_seams_handle_types(seam, impl):
    compared = 0
    for name, fn in _seam_methods(seam).items():
        expected = _handle_hints(fn)
        if not expected:
            continue
        own = getattr(impl, name)
        if not inspect.isfunction(own):  # e.g. a C function bound at init: not annotated
            continue
        hints = typing.get_type_hints(own)
        for param, hint in expected.items():
            assert hints.get(param) == hint, (f"{impl.__name__}.{name}: {param} is "
                                              f"{hints.get(param)}, the seam says {hint}")
            compared += 1
    assert compared >= 10
