"""DeviceArray's elementwise operators, on the jiterator's machinery (torch's semantics).

:class:`OperatorsMixin` gives :class:`cudalab.DeviceArray` ``+ - * / // % **``, unary ``-``,
``abs``, ``~``, the comparisons, ``& | ^`` (integer and bool arrays), their in-place and
reflected forms, :meth:`~OperatorsMixin.where`, :meth:`~OperatorsMixin.astype` and the
converting copy behind ``copy_`` and ``to(dtype)``. Each operation is one
:class:`~cudalab._kernels.elementwise.ElementwiseFunction`: one compiled kernel per
(operation, dtypes, layout), cached, launched on the current stream of the arrays' device,
results from the caching allocator.

dtypes follow ``torch.result_type`` (:mod:`cudalab._kernels.type_promotion`): ``int8 + 1000``
stays int8, ``int / int`` is float32, comparisons give bool, ``//`` and ``%`` floor like
torch (and Python) for negative operands, bool arithmetic stays bool (``+`` is or, ``*`` is
and). Arithmetic is done in float for float16/bfloat16 and rounded once when stored; Python
scalars are converted to that compute type on the host. Complex arrays (and Python complex
scalars: ``x * 1j`` is complex64 for a float32 ``x``) take ``+ - * / **``, unary ``-``,
``==``/``!=``, ``where`` and conversions, with c10::complex's arithmetic; ``abs`` gives the
real dtype; ordering comparisons, ``//``, ``%`` and the bitwise operators refuse them with
torch's "not implemented for 'ComplexFloat'" message; converting complex to a real dtype
keeps the real part and warns as torch does. As torch does, a complex ``** 2`` is
``base * base``, a complex array times a scalar is computed as scalar times array, and a
complex array divided by a scalar is multiplied by its reciprocal (computed on the host).
In-place forms keep the array's dtype and refuse results it cannot hold (``result type
Float can't be cast to the desired output type Long``). Operands are DeviceArrays and Python/numpy scalars; anything else gets
``NotImplemented`` (Python then raises its TypeError).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from cudalab import _array_state
from cudalab._array_state import ArrayState, ArrayT
from cudalab._dtypes import normalize_dtype
from cudalab._kernels import type_promotion as tp
from cudalab._kernels.elementwise import (
    RESULT_BOOL,
    RESULT_COMMON,
    RESULT_FLOAT,
    RESULT_REAL,
    ElementwiseFunction,
    run,
)

__all__ = ["OperatorsMixin", "where", "OPERATIONS", "DISCARD_IMAGINARY", "DtypeNotImplementedError"]


def _code(name: str, params: str, body: str, returns: str = "T") -> str:
    return f"template <typename T> {returns} cudalab_{name}({params}) {{ {body} }}"


def _by_category(float_code: str, int_code: str, complex_code: str | None = None) -> Any:
    def code(common: np.dtype) -> str:
        cat = tp.category(common)
        if cat == tp.COMPLEX and complex_code is not None:
            return complex_code
        return float_code if cat >= tp.FLOATING else int_code
    return code


class DtypeNotImplementedError(NotImplementedError, TypeError):
    """torch's "not implemented for 'ComplexFloat'" error: a NotImplementedError, as torch's
    (its dispatch raises c10::NotImplementedError), and a TypeError, as cudalab's was."""


def _refuse(op: str, kinds: tuple[int, ...]) -> Any:
    """A dtype check raising torch's "not implemented for" error outside ``kinds``."""
    def check(common: np.dtype, dtypes: list[np.dtype]) -> None:
        if tp.category(common) not in kinds:
            raise DtypeNotImplementedError(
                f'"{op}_cuda" not implemented for \'{tp.torch_name(common)}\'')
    return check


def _np_floor_divide(a: Any, b: Any) -> Any:
    return np.floor_divide(a, b)


def _np_pow(a: Any, b: Any) -> Any:
    if a.dtype.kind in "iu":
        neg = b < 0
        r = np.power(a, np.where(neg, 0, b).astype(b.dtype))
        small = np.where(a == 1, 1, np.where(a == -1, np.where(b % 2 == 0, 1, -1), 0))
        return np.where(neg, small.astype(a.dtype), r)
    return np.power(a, b)


def _np_abs(a: Any) -> Any:
    return a if a.dtype == np.bool_ else np.abs(a)


def _np_invert(a: Any) -> Any:
    return np.logical_not(a) if a.dtype == np.bool_ else np.invert(a)


_FLOOR_DIV_FLOAT = _code("floor_divide", "T a, T b", """
    if (b == T(0)) { return a / b; }
    T mod = fmod(a, b);
    T div = (a - mod) / b;
    if ((mod != T(0)) && ((b < T(0)) != (mod < T(0)))) { div -= T(1); }
    T floordiv;
    if (div != T(0)) { floordiv = floor(div); if (div - floordiv > T(0.5)) { floordiv += T(1); } }
    else { floordiv = copysign(T(0), a / b); }
    return floordiv;""")
_FLOOR_DIV_INT = _code("floor_divide", "T a, T b", """
    if (b == T(0)) { return T(0); }
    T q = a / b;
    if ((a % b != T(0)) && ((a < T(0)) != (b < T(0)))) { q -= T(1); }
    return q;""")
_REMAINDER_FLOAT = _code("remainder", "T a, T b", """
    T m = fmod(a, b);
    if ((m != T(0)) && ((b < T(0)) != (m < T(0)))) { m += b; }
    return m;""")
_REMAINDER_INT = _code("remainder", "T a, T b", """
    if (b == T(0)) { return T(0); }
    T r = a % b;
    if ((r != T(0)) && ((r < T(0)) != (b < T(0)))) { r += b; }
    return r;""")
_POW_INT = _code("pow", "T base, T exp", """
    if (exp < T(0)) {
        if (base == T(1)) { return T(1); }
        if (base == T(-1)) { return (exp % T(2) == T(0)) ? T(1) : T(-1); }
        return T(0);
    }
    T result = T(1);
    while (exp != T(0)) { if (exp & T(1)) { result *= base; } exp >>= 1; base *= base; }
    return result;""")

_INTEGRAL = (tp.BOOL, tp.INTEGRAL)
_REAL_KINDS = (tp.BOOL, tp.INTEGRAL, tp.FLOATING)
_NUMBER_KINDS = (tp.BOOL, tp.INTEGRAL, tp.FLOATING, tp.COMPLEX)


def _binary(name: str, expression: str | Any, sim: Any, result: str = RESULT_COMMON,
            check: Any = None, returns: str = "T") -> ElementwiseFunction:
    code = (_code(name, "T a, T b", f"return {expression};", returns)
            if isinstance(expression, str) else expression)
    return ElementwiseFunction(code, result=result, check=check, sim=sim)


#: The operations, by torch name: one ElementwiseFunction each.
OPERATIONS: dict[str, ElementwiseFunction] = {
    "add": _binary("add", "a + b", np.add),
    "sub": _binary("sub", "a - b", np.subtract),
    "mul": _binary("mul", "a * b", np.multiply),
    "div": _binary("div", "a / b", np.true_divide, RESULT_FLOAT),
    "floor_divide": _binary("floor_divide", _by_category(_FLOOR_DIV_FLOAT, _FLOOR_DIV_INT),
                            _np_floor_divide, check=_refuse("floor_divide", (tp.INTEGRAL, tp.FLOATING))),
    "remainder": _binary("remainder", _by_category(_REMAINDER_FLOAT, _REMAINDER_INT),
                         np.remainder, check=_refuse("remainder", (tp.INTEGRAL, tp.FLOATING))),
    "pow": _binary("pow", _by_category(_code("pow", "T a, T b", "return pow(a, b);"), _POW_INT),
                   _np_pow, check=_refuse("pow", (tp.INTEGRAL, tp.FLOATING, tp.COMPLEX))),
    "lt": _binary("lt", "a < b", np.less, RESULT_BOOL, _refuse("lt", _REAL_KINDS), "bool"),
    "le": _binary("le", "a <= b", np.less_equal, RESULT_BOOL, _refuse("le", _REAL_KINDS), "bool"),
    "gt": _binary("gt", "a > b", np.greater, RESULT_BOOL, _refuse("gt", _REAL_KINDS), "bool"),
    "ge": _binary("ge", "a >= b", np.greater_equal, RESULT_BOOL, _refuse("ge", _REAL_KINDS), "bool"),
    "eq": _binary("eq", "a == b", np.equal, RESULT_BOOL, returns="bool"),
    "ne": _binary("ne", "a != b", np.not_equal, RESULT_BOOL, returns="bool"),
    "bitwise_and": _binary("bitwise_and", "a & b", np.bitwise_and, check=_refuse("bitwise_and", _INTEGRAL)),
    "bitwise_or": _binary("bitwise_or", "a | b", np.bitwise_or, check=_refuse("bitwise_or", _INTEGRAL)),
    "bitwise_xor": _binary("bitwise_xor", "a ^ b", np.bitwise_xor, check=_refuse("bitwise_xor", _INTEGRAL)),
    "neg": ElementwiseFunction(_code("neg", "T a", "return -a;"), sim=np.negative),
    "abs": ElementwiseFunction(_by_category(
        _code("abs", "T a", "return fabs(a);"), _code("abs", "T a", "return a < T(0) ? T(-a) : a;"),
        _code("abs", "T a", "return T(abs(a));")),  # complex: |a| as T, its real part stored
        sim=_np_abs, result=RESULT_REAL, check=_refuse("abs", _NUMBER_KINDS)),
    "bitwise_not": ElementwiseFunction(
        lambda common: _code("bitwise_not", "T a", "return !a;" if common == np.bool_ else "return ~a;"),
        sim=_np_invert, check=_refuse("bitwise_not", _INTEGRAL)),
    "where": ElementwiseFunction(_code("where", "bool c, T a, T b", "return c ? a : b;"),
                                 exclude_from_promotion=(0,), sim=np.where),
    "copy": ElementwiseFunction(_code("copy", "T a", "return a;"), sim=lambda a: a),
}

_NEG_BOOL = ("Negation, the `-` operator, on a bool tensor is not supported. If you are trying "
             "to invert a mask, use the `~` or `logical_not()` operator instead.")
_SUB_TWO_BOOLS = ("Subtraction, the `-` operator, with two bool tensors is not supported. Use "
                  "the `^` or `logical_xor()` operator instead.")
_SUB_ONE_BOOL = ("Subtraction, the `-` operator, with a bool tensor is not supported. If you are "
                 "trying to invert a mask, use the `~` or `logical_not()` operator instead.")
_SCALARS = (bool, int, float, complex, np.generic)


def _dtype_of(x: Any) -> np.dtype:
    return x.element_dtype if isinstance(x, OperatorsMixin) else tp.scalar_dtype(x)


def _is_operand(x: Any) -> bool:
    return isinstance(x, _OPERANDS)


def _negative_integer_power(inputs: list[Any]) -> bool:
    """``int_array ** -n``: an integer array to a negative integer scalar (torch refuses it;
    an integer array of exponents is computed, as torch's)."""
    base, exponent = inputs
    return (isinstance(base, OperatorsMixin) and base.element_dtype.kind in "iu"
            and isinstance(exponent, (int, np.integer)) and not isinstance(exponent, bool)
            and bool(exponent < 0))


def _apply(op: str, inputs: list[Any], out: Any = None) -> Any:
    if op == "sub":
        bools = [_dtype_of(x) == np.bool_ for x in inputs]
        if all(bools):
            raise RuntimeError(_SUB_TWO_BOOLS)
        if any(bools):
            raise RuntimeError(_SUB_ONE_BOOL)
    elif op == "neg" and inputs[0].dtype == np.bool_:
        raise RuntimeError(_NEG_BOOL)
    elif op == "pow":
        if _is_complex_square(inputs):
            op, inputs = "mul", [inputs[0], inputs[0]]  # torch: a complex ** 2.0 is base * base
        elif _negative_integer_power(inputs):
            raise RuntimeError("Integers to negative integer powers are not allowed.")
    elif op == "mul" and isinstance(inputs[1], _SCALARS) and isinstance(
            inputs[0], OperatorsMixin) and (inputs[0].element_dtype.kind == "c" or isinstance(inputs[1], (complex, np.complexfloating))):
        # torch multiplies by a scalar as scalar * array (opmath_symmetric_gpu_kernel_with_
        # scalars); complex products differ in the last bits with the operand order
        inputs = [inputs[1], inputs[0]]
    elif op == "div" and isinstance(inputs[1], _SCALARS) and isinstance(inputs[0], OperatorsMixin):
        reciprocal = _complex_reciprocal(inputs[0].element_dtype, inputs[1])
        if reciprocal is not None:  # torch: a complex divided by a scalar is a * (1 / b)
            op, inputs = "mul", [inputs[0], reciprocal]
    if out is not None:
        if out.read_only:
            raise ValueError("in-place operation: this DeviceArray was imported read-only "
                             "(DLPack read-only flag) and cannot be written")
        return run(OPERATIONS[op], inputs, out=[out])[0]
    # (inputs hold a DeviceArray: every operator's self, where's condition)
    return run(OPERATIONS[op], inputs, empty=_array_state.output)[0]


def _is_complex_square(inputs: list[Any]) -> bool:
    base, exponent = inputs
    return (isinstance(base, OperatorsMixin) and base.element_dtype.kind == "c" and isinstance(exponent, _SCALARS)
            and not isinstance(exponent, bool) and exponent == 2)


def _complex_reciprocal(dtype: np.dtype, divisor: Any) -> Any:
    """``1 / divisor`` in the complex compute type of ``array / divisor`` (None when that
    is not complex), divided on the host as c10::complex divides (numpy's algorithm)."""
    common = tp.result_type([(dtype, tp.DIMENSIONED), (tp.scalar_dtype(divisor), tp.WRAPPED)])
    if common.kind != "c":
        return None
    with np.errstate(all="ignore"):
        return common.type(1) / common.type(divisor)


def where(condition: Any, input: Any, other: Any) -> Any:
    """``condition ? input : other`` elementwise (``torch.where``).

    Parameters
    ----------
    condition
        A bool DeviceArray.
    input, other
        DeviceArrays or scalars, broadcast with ``condition``; the result has their promoted
        dtype.

    Returns
    -------
    DeviceArray

    Raises
    ------
    TypeError
        ``condition`` is not a bool DeviceArray, or an operand is not a DeviceArray or scalar.
    """
    if not isinstance(condition, OperatorsMixin) or condition.element_dtype != np.bool_:
        got = tp.torch_name(condition.element_dtype) if isinstance(condition, OperatorsMixin) else \
            type(condition).__name__
        raise TypeError(f"where expected condition to be a boolean tensor, but got a tensor "
                        f"with dtype {got}")
    for name, x in (("input", input), ("other", other)):
        if not _is_operand(x):
            raise TypeError(f"where: {name} must be a DeviceArray or a scalar, got "
                            f"{type(x).__name__}")
    return _apply("where", [condition, input, other])


#: torch's warning (copy_) when a conversion drops imaginary parts.
DISCARD_IMAGINARY = "Casting complex values to real discards the imaginary part"


def _warn_if_discarding(source: np.dtype, target: np.dtype) -> None:
    if source.kind == "c" and target.kind != "c":
        warnings.warn(DISCARD_IMAGINARY, UserWarning, stacklevel=3)


def converting_copy(dst: ArrayT, src: ArrayState) -> ArrayT:
    """Copy ``src`` into ``dst`` converting the dtype and broadcasting (``copy_``'s kernel).

    Both are DeviceArrays on the same device; returns ``dst``. Complex to real keeps the
    real part, with torch's UserWarning.
    """
    _warn_if_discarding(src.dtype, dst.dtype)
    run(OPERATIONS["copy"], [src], out=[dst], out_dtype=dst.dtype)
    return dst


def _binary_method(op: str) -> tuple[Any, Any, Any]:
    def forward(self: ArrayState, other: Any) -> Any:
        if not isinstance(other, _OPERANDS):
            return NotImplemented
        return _apply(op, [self, other])

    def reflected(self: ArrayState, other: Any) -> Any:
        if not isinstance(other, _OPERANDS):
            return NotImplemented
        return _apply(op, [other, self])

    def inplace(self: ArrayState, other: Any) -> Any:
        if not isinstance(other, _OPERANDS):
            return NotImplemented
        return _apply(op, [self, other], out=self)

    for fn, prefix in ((forward, ""), (reflected, "r"), (inplace, "i")):
        fn.__name__ = f"__{prefix}{op}__"
        fn.__doc__ = f"Elementwise ``{op}`` with torch's type promotion (a new array)." \
            if not prefix else f"``{op}`` ({'reflected' if prefix == 'r' else 'in place'})."
    return forward, reflected, inplace


class OperatorsMixin:
    """Elementwise operators of :class:`cudalab.DeviceArray` (see the module notes)."""

    __slots__ = ()
    element_dtype: np.dtype  # (for the type checker: DeviceArray's field, _dtype_of reads it)
    __hash__ = object.__hash__  # __eq__ below is elementwise, as in torch; hashing stays by id

    __add__, __radd__, __iadd__ = _binary_method("add")
    __sub__, __rsub__, __isub__ = _binary_method("sub")
    __mul__, __rmul__, __imul__ = _binary_method("mul")
    __truediv__, __rtruediv__, __itruediv__ = _binary_method("div")
    __floordiv__, __rfloordiv__, __ifloordiv__ = _binary_method("floor_divide")
    __mod__, __rmod__, __imod__ = _binary_method("remainder")
    __pow__, __rpow__, __ipow__ = _binary_method("pow")
    __and__, __rand__, __iand__ = _binary_method("bitwise_and")
    __or__, __ror__, __ior__ = _binary_method("bitwise_or")
    __xor__, __rxor__, __ixor__ = _binary_method("bitwise_xor")
    __lt__ = _binary_method("lt")[0]
    __le__ = _binary_method("le")[0]
    __gt__ = _binary_method("gt")[0]
    __ge__ = _binary_method("ge")[0]
    __eq__ = _binary_method("eq")[0]  # type: ignore[assignment]
    __ne__ = _binary_method("ne")[0]  # type: ignore[assignment]

    def __neg__(self: ArrayT) -> ArrayT:
        """``-a`` (refused for bool arrays, as in torch)."""
        return _apply("neg", [self])

    def __pos__(self: ArrayT) -> ArrayT:
        """``+a``: the array itself, as in torch."""
        return self

    def __abs__(self: ArrayT) -> ArrayT:
        """``abs(a)``."""
        return _apply("abs", [self])

    def abs(self: ArrayT) -> ArrayT:
        """Elementwise absolute value (``torch.Tensor.abs``).

        Returns
        -------
        DeviceArray
        """
        return _apply("abs", [self])

    def __invert__(self: ArrayT) -> ArrayT:
        """``~a``: bitwise not (logical not for bool arrays); integer and bool only."""
        return _apply("bitwise_not", [self])

    def where(self: ArrayT, condition: Any, other: Any) -> ArrayT:
        """``condition ? self : other`` elementwise (``torch.Tensor.where``).

        Parameters
        ----------
        condition
            A bool DeviceArray broadcastable with ``self``.
        other
            A DeviceArray or a scalar.

        Returns
        -------
        DeviceArray
        """
        return where(condition, self, other)

    def astype(self: ArrayT, dtype: Any, copy: bool = True) -> ArrayT:
        """This array converted to ``dtype`` on the device (values cast as torch does).

        Parameters
        ----------
        dtype
            A supported dtype.
        copy
            False returns ``self`` when the dtype already matches.

        Returns
        -------
        DeviceArray

        Raises
        ------
        TypeError
            An unsupported dtype.
        """
        dt = normalize_dtype(dtype, default=None)
        if dt == self.element_dtype and not copy:
            return self
        _warn_if_discarding(self.element_dtype, dt)
        return run(OPERATIONS["copy"], [self], out_dtype=dt, empty=_array_state.output)[0]


#: What an operator takes: DeviceArrays (every one is an OperatorsMixin) and scalars.
_OPERANDS = (OperatorsMixin, *_SCALARS)
