"""The simulator's numpy evaluator of jiterator bodies: C's rules, and nothing but parsing."""

from __future__ import annotations

import numpy as np
import pytest

from cudalab._kernels.c_expression import UnsupportedExpression, c_common_type, parse_body

F32 = np.dtype(np.float32)


def run(body: str, compute=F32, **env):
    return parse_body(body, ["T"]).run(dict(env), np.dtype(compute))


def test_usual_arithmetic_conversions():
    assert c_common_type(np.dtype(np.int8), np.dtype(np.int8)) == np.int32  # promotion to int
    assert c_common_type(F32, np.dtype(np.int64)) == np.float32  # float * long is float
    assert c_common_type(F32, np.dtype(np.float64)) == np.float64
    assert c_common_type(np.dtype(np.int32), np.dtype(np.uint32)) == np.uint32
    assert c_common_type(np.dtype(np.int64), np.dtype(np.uint32)) == np.int64


def test_integer_division_truncates_and_percent_is_fmod():
    a = np.array([-7, 7, -7], np.int32)
    b = np.array([2, -2, -2], np.int32)
    np.testing.assert_array_equal(run("{ return a / b; }", np.int32, a=a, b=b), [-3, -3, 3])
    np.testing.assert_array_equal(run("{ return a % b; }", np.int32, a=a, b=b), [-1, 1, -1])


def test_float_literals_and_casts_follow_c():
    x = np.array([1.0, 2.0], np.float32)
    assert run("{ return x * 2.0f; }", x=x).dtype == np.float32
    assert run("{ return x * 2.0; }", x=x).dtype == np.float64  # a double literal
    assert run("{ return T(x * 2.0); }", x=x).dtype == np.float32
    assert run("{ return static_cast<int>(x) + 1; }", x=x).dtype == np.int32


def test_ternary_logic_locals_and_math_functions():
    x = np.array([-1.0, 0.5, 4.0], np.float32)
    got = run("{ const T y = sqrt(fabs(x)); T z = x > 0 && !(x > 3) ? y : -y; return z; }", x=x)
    np.testing.assert_allclose(got, [-1.0, np.sqrt(0.5), -2.0], rtol=1e-6)


def test_out_parameters_are_assigned():
    env = {"x": np.array([1.0, 2.0], np.float32)}
    parse_body("{ lo = x - 1; hi = x + 1; }", ["T"]).run(env, F32)
    np.testing.assert_array_equal(env["lo"], [0, 1])
    np.testing.assert_array_equal(env["hi"], [2, 3])


@pytest.mark.parametrize("body,reason", [
    ("{ for (int i = 0; i < 3; ++i) x += 1; return x; }", "statement starting with 'for'"),
    ("{ return helper(x); }", "calls helper()"),
    ("{ return __import__('os').system('true'); }", "unexpected character"),
    ("{ return x +; }", "unexpected ';'"),
])
def test_unsupported_bodies_say_why(body, reason):
    with pytest.raises(UnsupportedExpression, match=reason):
        parse_body(body, ["T"]).run({"x": np.ones(2, np.float32)}, F32)
