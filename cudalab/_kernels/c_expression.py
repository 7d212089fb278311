"""A safe numpy evaluator for the body of a jiterator function (the simulator's twin).

A jiterator function such as ``template <typename T> T f(T x, T y, T a) { return a * x + y; }``
runs on the simulator without a hand-written numpy twin when its body is a short list of
statements this module understands:

* ``return <expression>;``
* ``<out> = <expression>;`` (an output reference parameter of a multi-output function)
* ``[const] <type> <name> = <expression>;`` (a local)

Expressions are C's: literals (``1``, ``2.5f``, ``1e-3``, ``true``), names, ``( )``, calls of
the math functions in :data:`FUNCTIONS`, ``static_cast<T>(e)``, ``T(e)``, unary ``- + ! ~``,
binary ``* / % + - << >> < <= > >= == != & ^ | && ||`` and ``?:``, with C's precedence and
C's usual arithmetic conversions (``float * int`` is float, ``int / int`` truncates). With a
complex compute type, ``T`` is complex: arithmetic, ``==``/``!=`` and the functions work on
it (``abs``, ``arg``, ``norm``, ``real`` and ``imag`` give reals), ordering and ``%`` refuse. The text
is tokenized and parsed here; nothing is passed to Python's ``eval``. Anything else raises
:class:`UnsupportedExpression`, whose message says what was not understood.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["UnsupportedExpression", "FunctionBody", "parse_body", "FUNCTIONS", "C_TYPES"]


class UnsupportedExpression(ValueError):
    """The function body is not something :mod:`c_expression` can evaluate with numpy."""


_TOKEN = re.compile(r"""
    (?P<ws>\s+|//[^\n]*|/\*.*?\*/)
  | (?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[fFuUlL]*|0[xX][0-9a-fA-F]+[uUlL]*)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*|::[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op><<|>>|<=|>=|==|!=|&&|\|\||[-+*/%<>!~&^|?:(),;={}])
""", re.VERBOSE | re.DOTALL)

#: C type names -> numpy dtypes (``T`` and other template parameters map to the compute type).
C_TYPES: dict[str, np.dtype] = {
    name: np.dtype(dt) for name, dt in {
        "bool": np.bool_, "char": np.int8, "short": np.int16, "int": np.int32,
        "long": np.int64, "float": np.float32, "double": np.float64,
        "int8_t": np.int8, "int16_t": np.int16, "int32_t": np.int32, "int64_t": np.int64,
        "uint8_t": np.uint8, "uint16_t": np.uint16, "uint32_t": np.uint32, "uint64_t": np.uint64,
        "unsigned": np.uint32, "size_t": np.uint64,
    }.items()
}

_INT32 = np.dtype(np.int32)


def _np_rsqrt(x: Any) -> Any:
    return 1 / np.sqrt(x)


def _np_norm(z: Any) -> Any:
    return np.real(z) ** 2 + np.imag(z) ** 2


#: Math functions a body may call (C names, their ``f`` forms and ``std::``/``::`` prefixes).
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin, "acos": np.arccos,
    "atan": np.arctan, "atan2": np.arctan2, "sinh": np.sinh, "cosh": np.cosh, "tanh": np.tanh,
    "exp": np.exp, "exp2": np.exp2, "expm1": np.expm1, "log": np.log, "log2": np.log2,
    "log10": np.log10, "log1p": np.log1p, "sqrt": np.sqrt, "rsqrt": _np_rsqrt, "cbrt": np.cbrt,
    "fabs": np.abs, "abs": np.abs, "floor": np.floor, "ceil": np.ceil, "trunc": np.trunc,
    "round": np.round, "rint": np.rint, "pow": np.power, "fmod": np.fmod, "fmin": np.fmin,
    "fmax": np.fmax, "min": np.minimum, "max": np.maximum, "hypot": np.hypot,
    "copysign": np.copysign, "isnan": np.isnan, "isinf": np.isinf, "isfinite": np.isfinite,
    # complex (cudalab_complex's functions):
    "real": np.real, "imag": np.imag, "conj": np.conj, "arg": np.angle, "norm": _np_norm,
}
for _name in list(FUNCTIONS):
    if _name not in ("abs", "min", "max", "isnan", "isinf", "isfinite", "real", "imag",
                     "conj", "arg", "norm"):
        FUNCTIONS[_name + "f"] = FUNCTIONS[_name]

_BINARY_PRECEDENCE = {
    "*": 13, "/": 13, "%": 13, "+": 12, "-": 12, "<<": 11, ">>": 11,
    "<": 10, "<=": 10, ">": 10, ">=": 10, "==": 9, "!=": 9, "&": 8, "^": 7, "|": 6,
    "&&": 5, "||": 4,
}
_TERNARY_PRECEDENCE = 3


def _tokens(text: str) -> list[tuple[str, str]]:
    out = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise UnsupportedExpression(f"unexpected character {text[pos]!r} in {text.strip()!r}")
        pos = m.end()
        kind = m.lastgroup
        assert kind is not None
        if kind != "ws":
            out.append((kind, m.group()))
    return out


def _strip_scope(name: str) -> str:
    return name.rsplit("::", 1)[-1]


# --------------------------------------------------------------------------- C arithmetic
def _integer_promote(dt: np.dtype) -> np.dtype:
    if dt.kind in "biu" and dt.itemsize < 4:
        return _INT32
    return dt


def c_common_type(a: np.dtype, b: np.dtype) -> np.dtype:
    """C's usual arithmetic conversions for two operand types (a complex operand wins with
    its own precision, as cudalab_complex's mixed operators do; two complexes: the wider)."""
    if a.kind == "c" or b.kind == "c":
        if a.kind == b.kind:
            return a if a.itemsize >= b.itemsize else b
        return a if a.kind == "c" else b
    for wide in (np.dtype(np.float64), np.dtype(np.float32)):
        if a == wide or b == wide:
            return wide
    if a.kind == "f" or b.kind == "f":  # float16 never reaches here (opmath), but be safe
        return np.dtype(np.float32)
    a, b = _integer_promote(a), _integer_promote(b)
    if a == b:
        return a
    if a.kind == b.kind:
        return a if a.itemsize >= b.itemsize else b
    signed, unsigned = (a, b) if a.kind == "i" else (b, a)
    if unsigned.itemsize >= signed.itemsize:
        return unsigned
    return signed


def _as(value: Any, dt: np.dtype) -> Any:
    arr = np.asarray(value)
    return arr if arr.dtype == dt else arr.astype(dt)


def _divide(a: Any, b: Any) -> Any:
    if a.dtype.kind in "fc":
        return np.true_divide(a, b)
    safe_b = np.where(b == 0, 1, b)
    q = np.abs(a) // np.abs(safe_b)
    neg = (a < 0) != (safe_b < 0)
    return np.where(neg, -q, q).astype(a.dtype)


_ARITHMETIC: dict[str, Callable[[Any, Any], Any]] = {
    "*": np.multiply, "+": np.add, "-": np.subtract, "/": _divide, "%": np.fmod,
    "&": np.bitwise_and, "|": np.bitwise_or, "^": np.bitwise_xor,
    "<<": np.left_shift, ">>": np.right_shift,
}
_COMPARISON: dict[str, Callable[[Any, Any], Any]] = {
    "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
    "==": np.equal, "!=": np.not_equal,
}


# --------------------------------------------------------------------------- the parser
# An expression node is a callable env -> numpy value (closures built while parsing).
Node = Callable[[dict[str, Any]], Any]


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]], type_names: dict[str, Any]):
        self.tokens = tokens
        self.pos = 0
        self.type_names = type_names  # name -> dtype, or None for the compute type (T)

    def peek(self, offset: int = 0) -> tuple[str, str]:
        i = self.pos + offset
        return self.tokens[i] if i < len(self.tokens) else ("end", "")

    def take(self, expected: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if expected is not None and tok[1] != expected:
            raise UnsupportedExpression(f"expected {expected!r}, found {tok[1] or 'the end'!r}")
        if tok[0] == "end":
            raise UnsupportedExpression("the expression ends too early")
        self.pos += 1
        return tok

    def is_type(self, text: str) -> bool:
        return _strip_scope(text) in self.type_names

    def type_of(self, text: str) -> Callable[[dict[str, Any]], np.dtype]:
        dt = self.type_names[_strip_scope(text)]
        if dt is None:
            return lambda env: env["$T"]
        return lambda env: dt

    # ----------------------------------------------------------------- expressions
    def expression(self, min_precedence: int = 0) -> Node:
        left = self.unary()
        while True:
            kind, text = self.peek()
            if kind != "op":
                return left
            if text == "?" and min_precedence <= _TERNARY_PRECEDENCE:
                self.take()
                then = self.expression()
                self.take(":")
                other = self.expression(_TERNARY_PRECEDENCE)
                left = _ternary(left, then, other)
                continue
            precedence = _BINARY_PRECEDENCE.get(text)
            if precedence is None or precedence < min_precedence:
                return left
            self.take()
            right = self.expression(precedence + 1)
            left = _binary(text, left, right)

    def unary(self) -> Node:
        kind, text = self.peek()
        if kind == "op" and text in ("-", "+", "!", "~"):
            self.take()
            return _unary(text, self.unary())
        if kind == "op" and text == "(" and self.peek(1)[0] == "name" and self.is_type(
                self.peek(1)[1]) and self.peek(2)[1] == ")":  # (type) expr
            self.take()
            to = self.type_of(self.take()[1])
            self.take(")")
            return _cast(to, self.unary())
        return self.primary()

    def primary(self) -> Node:
        kind, text = self.take()
        if kind == "number":
            return _literal(text)
        if kind == "op" and text == "(":
            inner = self.expression()
            self.take(")")
            return inner
        if kind != "name":
            raise UnsupportedExpression(f"unexpected {text!r}")
        if text in ("true", "false"):
            value = np.asarray(text == "true")
            return lambda env: value
        if _strip_scope(text) == "static_cast":
            self.take("<")
            to = self.type_of(self.take()[1])
            self.take(">")
            self.take("(")
            inner = self.expression()
            self.take(")")
            return _cast(to, inner)
        if self.peek()[1] == "(":
            self.take()
            args: list[Node] = []
            if self.peek()[1] != ")":
                args.append(self.expression())
                while self.peek()[1] == ",":
                    self.take()
                    args.append(self.expression())
            self.take(")")
            if self.is_type(text):
                if len(args) != 1:
                    raise UnsupportedExpression(f"{text}(...) takes one value")
                return _cast(self.type_of(text), args[0])
            fn = FUNCTIONS.get(_strip_scope(text))
            if fn is None:
                raise UnsupportedExpression(
                    f"calls {text}(), which is not one of the math functions cudalab can "
                    f"evaluate with numpy ({', '.join(sorted(k for k in FUNCTIONS if not k.endswith('f')))})")
            return _call(fn, args)
        name = text
        return lambda env: _lookup(env, name)


def _lookup(env: dict[str, Any], name: str) -> Any:
    try:
        return env[name]
    except KeyError:
        raise UnsupportedExpression(f"unknown name {name!r}") from None


def _literal(text: str) -> Node:
    body = text.rstrip("fFuUlL")
    suffix = text[len(body):].lower()
    if body.lower().startswith("0x") or not any(c in body for c in ".eE"):
        number = int(body, 0)
        if "u" in suffix:
            dt = np.dtype(np.uint64 if "l" in suffix or number >= 2**32 else np.uint32)
        else:
            dt = np.dtype(np.int64 if "l" in suffix or number >= 2**31 else np.int32)
    else:
        dt = np.dtype(np.float32 if "f" in suffix else np.float64)
        number = float(body)  # type: ignore[assignment]
    value = np.asarray(number, dtype=dt)
    return lambda env: value


def _unary(op: str, operand: Node) -> Node:
    def run(env: dict[str, Any]) -> Any:
        v = np.asarray(operand(env))
        if op == "!":
            return np.logical_not(v)
        v = _as(v, _integer_promote(v.dtype))
        if op == "-":
            return np.negative(v)
        if op == "~":
            return np.invert(v)
        return v
    return run


def _binary(op: str, left: Node, right: Node) -> Node:
    if op == "&&":
        return lambda env: np.logical_and(left(env), right(env))
    if op == "||":
        return lambda env: np.logical_or(left(env), right(env))

    def run(env: dict[str, Any]) -> Any:
        a, b = np.asarray(left(env)), np.asarray(right(env))
        dt = c_common_type(a.dtype, b.dtype)
        a, b = _as(a, dt), _as(b, dt)
        fn = _COMPARISON.get(op)
        if fn is not None:
            return fn(a, b)
        if op in "%&|^<<>>" and dt.kind in "fc":
            raise UnsupportedExpression(f"operator {op} on floating-point values (use fmod)")
        if dt.kind == "c" and op in ("<", "<=", ">", ">="):
            raise UnsupportedExpression(f"operator {op} on complex values (C++ has no order "
                                        "for complex numbers)")
        return _ARITHMETIC[op](a, b)
    return run


def _ternary(cond: Node, then: Node, other: Node) -> Node:
    def run(env: dict[str, Any]) -> Any:
        a, b = np.asarray(then(env)), np.asarray(other(env))
        dt = c_common_type(a.dtype, b.dtype) if a.dtype != b.dtype else a.dtype
        return np.where(np.asarray(cond(env)).astype(bool), _as(a, dt), _as(b, dt))
    return run


def _cast(to: Callable[[dict[str, Any]], np.dtype], operand: Node) -> Node:
    return lambda env: _as(operand(env), to(env))


def _call(fn: Callable[..., Any], args: list[Node]) -> Node:
    def run(env: dict[str, Any]) -> Any:
        values = [np.asarray(a(env)) for a in args]
        if len(values) == 2:
            dt = c_common_type(values[0].dtype, values[1].dtype)
            values = [_as(v, dt) for v in values]
        return fn(*values)
    return run


# --------------------------------------------------------------------------- bodies
class FunctionBody:
    """A parsed function body: statements run in order over numpy values.

    ``run(env, compute_dtype)`` returns the ``return`` value (None when there is none); out
    parameters assigned by the body are left in ``env``.
    """

    def __init__(self, statements: list[tuple[str, str | None, Node]]):
        self.statements = statements  # (kind: "return" | "assign", target name, expression)

    def run(self, env: dict[str, Any], compute_dtype: np.dtype) -> Any:
        env["$T"] = compute_dtype
        with np.errstate(all="ignore"):
            for kind, target, node in self.statements:
                value = node(env)
                if kind == "return":
                    return value
                assert target is not None
                env[target] = value
        return None


def parse_body(body: str, template_params: list[str]) -> FunctionBody:
    """Parse ``{ ... }`` (the braces included) into a :class:`FunctionBody`.

    Parameters
    ----------
    body
        The function body text.
    template_params
        The template's type parameters (``["T"]``): names that mean the compute type.

    Returns
    -------
    FunctionBody

    Raises
    ------
    UnsupportedExpression
        The body uses a statement or an operation this evaluator does not understand.
    """
    type_names: dict[str, Any] = dict(C_TYPES)
    type_names.update({name: None for name in template_params})
    tokens = _tokens(body)
    if not tokens or tokens[0][1] != "{" or tokens[-1][1] != "}":
        raise UnsupportedExpression("the body must be enclosed in braces")
    parser = _Parser(tokens[1:-1], type_names)
    statements: list[tuple[str, str | None, Node]] = []
    while parser.peek()[0] != "end":
        kind, text = parser.peek()
        if text == "return":
            parser.take()
            statements.append(("return", None, parser.expression()))
        else:
            while parser.peek()[1] in ("const", "unsigned", "long", "signed") or (
                    parser.peek()[0] == "name" and parser.peek(1)[0] == "name"
                    and (parser.is_type(parser.peek()[1]) or parser.peek()[1] == "auto")):
                parser.take()  # a declaration's type words
            kind, target = parser.take()
            if kind != "name" or parser.peek()[1] != "=":
                raise UnsupportedExpression(
                    f"statement starting with {target!r}: only 'return <expression>;', "
                    "'<name> = <expression>;' and '<type> <name> = <expression>;' are understood")
            parser.take("=")
            statements.append(("assign", target, parser.expression()))
        parser.take(";")
    if not statements:
        raise UnsupportedExpression("the body is empty")
    return FunctionBody(statements)
