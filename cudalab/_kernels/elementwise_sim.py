"""The simulator's side of elementwise kernels: numpy twins behind generated kernel names.

A generated kernel runs on the simulator through :func:`make_sim`, which decodes the same
arguments as the CUDA kernel (sizes, byte strides, host scalars, extras) and calls a numpy
twin chosen per launch by a token passed as one more parameter (simulator only): a user's
``sim=`` callable, or the function body parsed by :mod:`cudalab._kernels.c_expression`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cudalab._kernels import type_promotion as tp
from cudalab._kernels.c_expression import C_TYPES
from cudalab._kernels.elementwise_source import EXTRA_BOOL, EXTRA_INT, ParsedCode

__all__ = ["make_sim", "twin_token"]

#: Twin token (id of the object) -> ("user", callable) or ("body", FunctionBody). Each entry
#: keeps its object alive, so a token is never reused for another twin.
_TWINS: dict[int, tuple[str, Any]] = {}


def twin_token(kind: str, obj: Any) -> int:
    token = id(obj)
    if token not in _TWINS:
        _TWINS[token] = (kind, obj)
    return token


def _sim_views(sim: Any, ptrs: Sequence[int], dtypes: Sequence[np.dtype], sizes: Sequence[int],
               strides: Sequence[Sequence[int]] | None, n: int) -> list[np.ndarray]:
    views = []
    for o, (ptr, dt) in enumerate(zip(ptrs, dtypes)):
        if strides is None:
            views.append(sim.array(ptr, dt, n))
            continue
        st = strides[o]
        low = sum(s * (d - 1) for s, d in zip(st, sizes) if s < 0)
        high = sum(s * (d - 1) for s, d in zip(st, sizes) if s > 0) + dt.itemsize
        buf = sim.host_view(ptr + low, high - low)
        views.append(np.ndarray(tuple(sizes), dt, buffer=buf, offset=-low, strides=tuple(st)))
    return views


def _cast(value: Any, dtype: np.dtype) -> np.ndarray:
    arr = np.asarray(value)
    return arr if arr.dtype == dtype else arr.astype(dtype)


def make_sim(parsed: ParsedCode, in_dtypes: Sequence[np.dtype | None], common: np.dtype,
              out_dtypes: Sequence[np.dtype], extra_kinds: Sequence[tuple[str, str]],
              excluded: frozenset[int], ndim: int | None, extra_names: Sequence[str],
              return_by_ref: bool) -> Callable[..., None]:
    """The numpy implementation of one plan's kernel (decodes the same arguments)."""
    compute = tp.opmath_dtype(common)
    n_out = len(out_dtypes)
    array_inputs = [k for k, dt in enumerate(in_dtypes) if dt is not None]
    n_ops = n_out + len(array_inputs)
    extra_dtypes = [np.dtype(np.int64) if kind == EXTRA_INT else np.dtype(np.bool_)
                    if kind == EXTRA_BOOL else np.dtype(np.float64) for kind in extra_kinds]
    n_in = len(in_dtypes)
    params = parsed.params
    types = dict.fromkeys(parsed.template_params, compute)

    def param_value(i: int, value: Any) -> Any:
        if i >= len(params):
            return value
        word = params[i][2]
        dt = types.get(word) or C_TYPES.get(word)
        return value if dt is None else _cast(value, dt)

    def impl(sim: Any, grid: Any, block: Any, shared_mem: int, *values: Any) -> None:
        n = values[0]
        pos = 1 + n_ops
        ptrs = values[1:pos]
        sizes: Sequence[int] = (n,)
        strides = None
        if ndim is not None:
            sizes = values[pos:pos + ndim]
            flat = values[pos + ndim:pos + ndim + ndim * n_ops]
            strides = [flat[o * ndim:(o + 1) * ndim] for o in range(n_ops)]
            pos += ndim + ndim * n_ops
        op_dtypes = list(out_dtypes) + [in_dtypes[k] for k in array_inputs]
        views = _sim_views(sim, ptrs, op_dtypes, sizes, strides, n)  # type: ignore[arg-type]
        inputs: list[Any] = []
        with np.errstate(all="ignore"):
            for k, dt in enumerate(in_dtypes):
                if dt is None:
                    if compute.kind == "c":  # two parameters: real, imaginary
                        inputs.append(_cast(complex(values[pos], values[pos + 1]), compute))
                        pos += 2
                        continue
                    inputs.append(_cast(values[pos], compute))
                    pos += 1
                    continue
                x = views[n_out + array_inputs.index(k)]
                if k not in excluded:
                    x = _cast(_cast(x, common), compute)
                inputs.append(x)
            extras = [_cast(values[pos + i], extra_dtypes[i]) for i in range(len(extra_kinds))]
            pos += len(extra_kinds)
            kind, twin = _TWINS[values[pos]]
            if kind == "user":
                result = twin(*inputs, **dict(zip(extra_names, extras)))
                results = list(result) if n_out > 1 or return_by_ref else [result]
            else:
                env = {params[i][0]: param_value(i, v) for i, v in enumerate(inputs + extras)
                       if i < len(params)}
                value = twin.run(env, compute)
                if return_by_ref:
                    outs = [p[0] for p in params[n_in + len(extras):]]
                    results = [env.get(name) for name in outs]
                else:
                    results = [value]
            if len(results) != n_out or any(r is None for r in results):
                raise ValueError(f"the simulator twin of {parsed.name} gave {len(results)} "
                                 f"results, expected {n_out}")
            for view, dt, r in zip(views, out_dtypes, results):
                r = np.asarray(r)
                if r.dtype.kind == "c" and dt.kind not in "cb":  # torch keeps the real part
                    r = r.real
                np.copyto(view, np.broadcast_to(_cast(r, dt), view.shape), casting="unsafe")

    return impl
