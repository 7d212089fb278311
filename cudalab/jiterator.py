"""``torch.cuda.jiterator``: elementwise kernels written as a C++ string, compiled at run time.

::

    code = "template <typename T> T fma3(T x, T y, T alpha) { return alpha * x + y; }"
    fma3 = cudalab.jiterator._create_jit_fn(code, alpha=1.0)
    out = fma3(x, y)              # DeviceArrays, CuPy/torch/Numba arrays or Python scalars
    out = fma3(x, y, alpha=2.0)   # extra arguments are keywords (for this call only)

As in torch (``torch.cuda.jiterator``, private API):

* the string defines one templated function (the last one is the entry point, called as
  ``name<compute_t>(inputs..., extras...)``); multi-output functions
  (:func:`_create_multi_output_jit_fn`) return ``void`` and write ``T&`` outputs, last;
* up to 8 inputs, broadcast together, with torch's type promotion (Python scalars are
  "wrapped numbers"); the output has the promoted dtype and the broadcast shape;
* keyword arguments of :func:`_create_jit_fn` are the extra scalar parameters, with their
  defaults; a call may override them for that call (each call starts from the declared
  defaults, as torch copies them per call); Python ints are passed as ``long long``, bools
  as ``bool``, other numbers as ``double`` (a string raises TypeError, as in torch);
* up to 8 outputs (:func:`_create_multi_output_jit_fn`), as torch's kernels support;
* non-contiguous and offset inputs (views, transposes) are read through their strides;
* compiled by NVRTC to CUBIN for the device's architecture on first use of each dtype
  combination (too few or too many inputs fail to compile, with NVRTC's log, as in torch), cached in memory and in the kernel disk cache
  (:func:`cudalab.kernels.cache_dir`); a compile error is a
  :class:`cudalab.KernelCompileError` carrying NVRTC's log, whose ``jiterator_code(N)``
  line numbers count lines of your string;
* the kernel runs on the current stream of the inputs' device; outputs come from the
  caching allocator.

On the simulator the code is compiled by NVRTC too (when NVRTC is installed: it needs no
GPU), so code that does not compile fails with NVRTC's log as on a GPU, and code the simulator
runs compiles on a GPU. It then runs when its body is a list of simple statements cudalab can
evaluate with numpy (``return <expression>;``, see :mod:`cudalab._kernels.c_expression`), or
when given a numpy twin: a callable ``sim=`` here or in the call, ``sim(*inputs, **extras)``
receiving the inputs as numpy arrays of the compute dtype and returning the output (a tuple
for several). A ``sim=`` that is not callable is an extra argument named ``sim``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cudalab._kernels.elementwise import (
    MAX_INPUTS,
    MAX_OUTPUTS,
    ElementwiseFunction,
    extra_value,
    kernels_for,
    run,
)
from cudalab.array import DeviceArray, foreign_cuda_array, output_array

__all__: list[str] = []  # torch's jiterator is private API too


class _JittedFunction:
    """The callable :func:`_create_jit_fn` returns (torch's ``_JittedFunction``).

    Attributes: ``code_string``, ``kernel_name`` (the entry function's name), ``kwargs_dict``
    (the extra arguments' current values, in declaration order), ``num_outputs``,
    ``return_by_ref``, ``sim`` (the numpy twin or None).
    """

    def __init__(self, code_string: str, return_by_ref: bool, num_outputs: int,
                 sim: Any = None, **kwargs: Any):
        if not (return_by_ref or num_outputs == 1):
            raise AssertionError("Return by value only works for single output.")
        if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or num_outputs < 1:
            raise ValueError(f"num_outputs must be a positive int, got {num_outputs!r}")
        if num_outputs > MAX_OUTPUTS:
            raise ValueError(f"jiterator only supports up to {MAX_OUTPUTS} outputs, got "
                             f"{num_outputs}")
        if sim is not None and not callable(sim):
            kwargs = {"sim": sim, **kwargs}  # an extra argument named sim (never a twin)
            sim = None
        self._function = ElementwiseFunction(code_string, num_outputs=num_outputs,
                                             return_by_ref=return_by_ref, sim=sim,
                                             compile_on_simulator=True)
        self.code_string = code_string
        self.kernel_name = self._function.parsed(np.dtype(np.float32)).name
        #: The declared extra arguments and their defaults, in declaration order; never
        #: changed by a call (a call's keywords override them for that call only).
        self.kwargs_dict = dict(kwargs)
        self._names = tuple(self.kwargs_dict)
        #: The defaults as kernel parameters, their values and Python types (converted once:
        #: a call without keywords reuses them).
        self._extra_args = [extra_value(v) for v in self.kwargs_dict.values()]
        self._extras = tuple(self.kwargs_dict.values())
        self._extra_types = tuple(map(type, self._extras))
        self.num_outputs = num_outputs
        self.return_by_ref = return_by_ref

    @property
    def sim(self) -> Callable[..., Any] | None:
        """The numpy twin used on the simulator (None: the body is evaluated)."""
        return self._function.sim

    @sim.setter
    def sim(self, twin: Callable[..., Any] | None) -> None:
        if twin is not None and not callable(twin):
            raise TypeError(f"sim must be a callable numpy twin, got {type(twin).__name__}")
        self._function.sim = twin

    def __repr__(self) -> str:
        return (f"<cudalab.jiterator function {self.kernel_name} ({self.num_outputs} "
                f"output{'s' if self.num_outputs > 1 else ''})>")

    def __call__(self, *tensors: Any, **kwargs: Any) -> Any:
        """Run the function elementwise over ``tensors``.

        Parameters
        ----------
        *tensors
            Up to 8 inputs: DeviceArrays, CUDA arrays of other libraries (DLPack or
            ``__cuda_array_interface__``), Python or numpy scalars.
        **kwargs
            Values of declared extra arguments for this call only (the others take their
            declared defaults, as in torch). ``sim=`` a callable: a numpy twin for this call
            (used on the simulator only); a non-callable ``sim=`` is the extra argument
            named ``sim``, if one is declared.

        Returns
        -------
        DeviceArray or tuple of DeviceArray
            One array for a single output, else a tuple.

        Raises
        ------
        AssertionError
            More than 8 inputs (torch's message).
        KeyError
            A keyword that the function did not declare.
        TypeError
            An input that is neither an array on a CUDA device nor a scalar, or an extra
            argument that is not a number or a bool.
        cudalab.KernelCompileError
            The code does not compile (NVRTC's log, lines numbered in the code string),
            among others when the number of inputs does not match the function's parameters.
            On the simulator too, where NVRTC is installed.
        """
        if len(tensors) > MAX_INPUTS:
            raise AssertionError(f"jiterator only supports up to {MAX_INPUTS} tensor inputs, "
                                 f"got {len(tensors)}")
        sim = None
        extras, extra_args, extra_types = self._extras, self._extra_args, self._extra_types
        if kwargs:
            if "sim" in kwargs and (callable(kwargs["sim"]) or (
                    kwargs["sim"] is None and "sim" not in self.kwargs_dict)):
                sim = kwargs.pop("sim")  # a twin for this call (None: the function's own)
            if kwargs:
                for key in kwargs:
                    if key not in self.kwargs_dict:
                        raise KeyError(f"{key} is not declared in function definition")
                values = {**self.kwargs_dict, **kwargs}  # torch: the defaults, copied per call
                extras = tuple(values.values())
                extra_args = [extra_value(v) for v in extras]
                extra_types = tuple(map(type, extras))
        inputs = [t if type(t) is DeviceArray else _operand(i, t) for i, t in enumerate(tensors)]
        outs = run(self._function, inputs, extras, self._names, empty=output_array, sim=sim,
                   extra_args=extra_args, extra_types=extra_types)
        return outs[0] if self.num_outputs == 1 else tuple(outs)

    def kernels(self, *dtypes: Any, strided: bool = False, large: bool = False) -> list[Any]:
        """The CUDA kernels a call with inputs of ``dtypes`` uses (for compiling ahead).

        Parameters
        ----------
        *dtypes
            One per input: a numpy dtype (an array) or ``int``/``float``/``bool`` (a scalar).
        strided
            The non-contiguous variant instead of the vectorised ones.
        large
            The variants for 2**31 elements or more (64-bit indices).

        Returns
        -------
        list of cudalab.kernels.Kernel
            Call ``.cubin(arch)`` on each to compile it with NVRTC (no GPU needed).
        """
        return kernels_for(self._function, dtypes, tuple(self.kwargs_dict.values()), strided,
                           large=large)


def _operand(index: int, value: Any) -> Any:
    if isinstance(value, DeviceArray) or isinstance(value, (bool, int, float, complex, np.generic)):
        return value
    foreign = foreign_cuda_array(value)
    if foreign is not None:
        return foreign
    where = "cpu" if isinstance(value, np.ndarray) or hasattr(value, "__array__") else \
        type(value).__name__
    raise TypeError(f"argument {index}: expected a CUDA device but found {where} (inputs are "
                    "DeviceArrays, CUDA arrays of CuPy/torch/Numba, or Python scalars)")


def _create_jit_fn(code_string: str, sim: Callable[..., Any] | None = None,
                   **kwargs: Any) -> _JittedFunction:
    """Create a jiterator function with one output (``torch.cuda.jiterator._create_jit_fn``).

    Parameters
    ----------
    code_string
        CUDA C++ defining one templated function ``template <typename T> T name(T x, ...)``.
    sim
        Optional numpy twin for the simulator, ``sim(*inputs, **extras)``.
    **kwargs
        The extra scalar arguments the function declares after its inputs, with their
        default values (in declaration order).

    Returns
    -------
    _JittedFunction

    Raises
    ------
    Exception
        The code does not have the form torch parses (torch's message).
    """
    return _JittedFunction(code_string, return_by_ref=False, num_outputs=1, sim=sim, **kwargs)


def _create_multi_output_jit_fn(code_string: str, num_outputs: int,
                                sim: Callable[..., Any] | None = None,
                                **kwargs: Any) -> _JittedFunction:
    """Create a jiterator function with several outputs
    (``torch.cuda.jiterator._create_multi_output_jit_fn``).

    Parameters
    ----------
    code_string
        CUDA C++ defining ``template <typename T> void name(T x, ..., T& out0, T& out1)``.
    num_outputs
        The number of ``T&`` output parameters (last in the list).
    sim
        Optional numpy twin, returning a tuple of ``num_outputs`` arrays.
    **kwargs
        The extra scalar arguments with their defaults.

    Returns
    -------
    _JittedFunction
        Calls return a tuple of ``num_outputs`` DeviceArrays.
    """
    return _JittedFunction(code_string, return_by_ref=True, num_outputs=num_outputs, sim=sim,
                           **kwargs)
