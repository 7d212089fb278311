"""Errors a user can act on: wrong argument types give a TypeError (or ValueError) that names
the parameter, and no message repeats more than a readable prefix of its input."""

from __future__ import annotations

import math

import pytest

import cudalab
from cudalab import _units
from cudalab._driver.sim.config import SimulatorConfig
from cudalab._dtypes import normalize_shape
from cudalab._units import ECHO_LIMIT, echo, parse_size
from cudalab.devices import Device


# --------------------------------------------------------------------------- echo
def test_echo_keeps_short_input_and_cuts_long_input():
    assert echo("abc") == "'abc'" and echo(12) == "12" and echo(None) == "None"
    long = "x" * 10_000
    assert echo(long) == f"{'x' * ECHO_LIMIT!r}… (10,000 characters)"
    assert echo([1] * 10_000).endswith(f"… ({len(repr([1] * 10_000)):,} characters)")
    assert len(echo(list(range(10_000)))) < ECHO_LIMIT + 40
    assert echo("ab'c\"d" * 100, limit=5) == repr("ab'c\"") + "… (600 characters)"


def test_parse_size_echoes_a_prefix():
    with pytest.raises(ValueError, match=r"\(50,001 characters\)") as info:
        parse_size("1" + "z" * 50_000)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("text", ["1" * 5_000, "1" * 5_000 + "g", "1e100000", "2e-100000k"])
def test_parse_size_refuses_numbers_past_any_size(text):
    """Python's int() refuses 4,300 digits with its own message, and an exponent of 10**8
    would take minutes: both are "cannot read" errors that name the setting."""
    with pytest.raises(ValueError, match=r"^cannot read the size '"):
        parse_size(text)


def test_simulator_settings_echo_a_prefix():
    with pytest.raises(ValueError, match=r"CUDALAB_SIMULATOR_DEVICES='.*'… \(20,000 characters\)"):
        SimulatorConfig.from_env({"CUDALAB_SIMULATOR_DEVICES": "9" * 20_000})


def test_device_strings_echo_a_prefix():
    with pytest.raises(ValueError) as info:
        Device("cuda:" + "x" * 50_000)
    assert len(str(info.value)) < 300 and "(50,005 characters)" in str(info.value)
    with pytest.raises(TypeError) as info2:
        cudalab.set_device([0] * 50_000)
    assert len(str(info2.value)) < 300


def test_units_echo_is_the_one_helper():
    """magics and widgets reach it through the internal API, like the other units."""
    from cudalab import _internal

    assert _internal.echo is _units.echo


# --------------------------------------------------------------------------- devices
@pytest.mark.parametrize("spec", ["cuda:-1", "cuda:-12", " cuda:-1 "])
def test_a_negative_device_index_is_called_negative(spec):
    with pytest.raises(ValueError, match="must not be negative"):
        Device(spec)
    with pytest.raises(ValueError, match="must not be negative"):
        cudalab.set_device(spec)


def test_a_negative_device_index_argument_is_called_negative():
    with pytest.raises(ValueError, match="must not be negative"):
        Device("cuda", -1)


def test_other_malformed_device_strings_still_say_number():
    for spec in ("cuda:x", "cuda:-", "cuda:--1", "cuda:1.5"):
        with pytest.raises(ValueError, match="must be a number"):
            Device(spec)


# --------------------------------------------------------------------------- events
def test_elapsed_time_needs_an_event():
    start = cudalab.Event(enable_timing=True)
    for bad in (None, 5, "end", cudalab.current_stream()):
        with pytest.raises(TypeError, match=r"elapsed_time\(\): end_event must be a cudalab.Event"):
            start.elapsed_time(bad)


@pytest.mark.parametrize("bad", [5, "stream", 1.5, object()])
def test_record_needs_a_stream(bad):
    ev = cudalab.Event()
    with pytest.raises(TypeError, match=r"Event.record\(\): stream must be a cudalab.Stream"):
        ev.record(bad)
    ev.record()  # still usable
    ev.synchronize()


def test_record_on_a_stream_still_works():
    s = cudalab.Stream()
    ev = cudalab.Event().record(s)
    ev.synchronize()
    assert ev.query()


# --------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("fn", ["manual_seed", "manual_seed_all"])
@pytest.mark.parametrize("bad, error", [
    (None, TypeError), ([1], TypeError), ("abc", ValueError), (math.nan, ValueError),
    (math.inf, ValueError), ("1" * 50_000, ValueError),
])
def test_a_bad_seed_is_named(fn, bad, error):
    with pytest.raises(error, match=rf"{fn}\(\): seed must be an integer") as info:
        getattr(cudalab, fn)(bad)
    assert len(str(info.value)) < 300


def test_seeds_convertible_with_int_are_accepted_as_in_torch():
    cudalab.manual_seed("12")
    assert cudalab.initial_seed() == 12
    cudalab.manual_seed(7.9)
    assert cudalab.initial_seed() == 7
    cudalab.manual_seed_all(3)
    assert cudalab.initial_seed() == 3


# --------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("shape", [{3: 1}, {3, 5}, frozenset({2}), {}])
def test_sets_and_mappings_are_not_shapes(shape):
    with pytest.raises(TypeError, match="shape must be an int or a sequence of ints"):
        normalize_shape(shape)
    with pytest.raises(TypeError, match="shape must be"):
        cudalab.empty(shape)


def test_sequences_are_still_shapes():
    assert normalize_shape([2, 3]) == (2, 3) and normalize_shape(range(2, 4)) == (2, 3)
    assert cudalab.empty([2, 3]).shape == (2, 3)


def test_magic_options_echo_a_prefix():
    pytest.importorskip("IPython")
    from IPython.core.error import UsageError

    from cudalab.magics.memory_args import parse_memory_args
    from cudalab.magics.timed_options import parse_options

    long = "--" + "x" * 20_000
    with pytest.raises(UsageError, match=r"unknown option '-+x+'… \(20,002 characters\)") as info:
        parse_options(f"{long} pass")
    assert len(str(info.value)) < 300
    with pytest.raises(UsageError, match=r"\(20,002 characters\)") as info:
        parse_memory_args(long)
    assert len(str(info.value)) < 300
