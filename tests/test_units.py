"""cudalab._units: the one size parser and the one byte/time formatter.

The last section checks that the same size text means the same bytes in every input that
takes a size (``%cuda_memory --threshold``, ``cudalab what-if --device-memory``,
``CUDALAB_SIMULATOR_MEMORY``).
"""

from __future__ import annotations

import pytest

from cudalab._units import SIZE_UNITS, GiB, KiB, MiB, TiB, format_bytes, format_time, parse_size


# --------------------------------------------------------------------------- parse_size
@pytest.mark.parametrize("text, expected", [
    # bytes: no unit, b, byte(s)
    ("0", 0), ("1048576", 1 << 20), ("512b", 512), ("512 B", 512), ("1 byte", 1),
    ("3 bytes", 3),
    # one letter: binary (Docker's -m 1g, Java's -Xmx1g)
    ("1k", KiB), ("1m", MiB), ("1g", GiB), ("1t", TiB),
    # binary, spelled out
    ("1kib", KiB), ("1MiB", MiB), ("1GiB", GiB), ("1TiB", TiB),
    # decimal (SI)
    ("1kb", 10**3), ("1MB", 10**6), ("1GB", 10**9), ("1TB", 10**12),
])
def test_every_unit_spelling(text, expected):
    assert parse_size(text) == expected


def test_the_unit_table_is_the_documented_one():
    assert set(SIZE_UNITS) == {"", "b", "byte", "bytes", "k", "m", "g", "t", "kib", "mib",
                               "gib", "tib", "kb", "mb", "gb", "tb"}
    assert all(name == name.lower() for name in SIZE_UNITS)


def test_one_g_is_a_gibibyte_and_one_gb_a_gigabyte():
    assert parse_size("1g") == 2**30 == parse_size("1GiB") == parse_size("1 gib")
    assert parse_size("1GB") == 10**9 == parse_size("1 gb")
    assert parse_size("1g") != parse_size("1GB")


@pytest.mark.parametrize("text", ["1g", "1G", " 1g", "1g ", "1 g", "1\tG", "\n1  GiB\n",
                                  "1Gib", "1gIB", "+1g"])
def test_whitespace_and_case(text):
    assert parse_size(text) == GiB


@pytest.mark.parametrize("text, expected", [
    ("1.5g", 3 << 29), (".5 GiB", 1 << 29), ("1.5 GB", 1_500_000_000), ("2.", 2),
    ("1.5", 1),  # rounded down to a whole byte
    ("2e9", 2 * 10**9), ("1E3k", 1000 * KiB), ("1.5e-3 MB", 1500), ("1e+2", 100),
    ("0.1", 0), ("-0", 0),
    # exact arithmetic: no float rounding on large or fractional values
    ("1.1 TB", 1_100_000_000_000), ("0.1 GiB", GiB // 10), ("123456789012345678901", 123456789012345678901),
])
def test_numbers(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("value", [0, 1, 4096, 1 << 40, 10**30])
def test_ints_are_bytes(value):
    assert parse_size(value) == value


@pytest.mark.parametrize("bad", [
    "-1", "-1g", "1zb", "1 eb", "", "   ", "abc", "g", "1 g b", "1,5g", "1/2", "0x10", "1e",
    "1e1.5", "inf", "nan", "None", None, True, False, -1, "٣g",  # (non-ASCII digit)
])
def test_bad_input_raises_value_error_naming_what(bad):
    with pytest.raises(ValueError, match="--my-option") as info:
        parse_size(bad, what="--my-option")
    assert "e.g." in str(info.value)  # the message shows valid spellings


def test_the_default_what_is_size():
    with pytest.raises(ValueError, match="size"):
        parse_size("1zb")


def test_negative_message_says_at_least_zero():
    with pytest.raises(ValueError, match="at least 0"):
        parse_size("-5k")


@pytest.mark.parametrize("zero", ["0", "0g", "0.0 MiB", 0, "0.4"])
def test_allow_zero(zero):
    assert parse_size(zero) == 0
    with pytest.raises(ValueError, match="at least 1 byte,"):
        parse_size(zero, allow_zero=False, what="memory")
    assert parse_size("1", allow_zero=False) == 1


# --------------------------------------------------------------------------- format_bytes
@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (0.0, "0 B"), (1, "1 B"), (512, "512 B"), (1023, "1023 B"),
    (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (1048524, "1023.9 KiB"),  # 1023.949 KiB
    (1048525, "1.0 MiB"),  # 1023.9502 KiB would print as 1024.0 KiB: the next unit
    (1048575, "1.0 MiB"), (1 << 20, "1.0 MiB"), (3 << 29, "1.5 GiB"), (1 << 40, "1.0 TiB"),
    (1 << 60, "1.0 EiB"), (1 << 70, "1024.0 EiB"),  # no unit above EiB
    (1023.7, "1023 B"), (2048.0, "2.0 KiB"),
    (-512, "-512 B"), (-(3 << 20), "-3.0 MiB"), (-1048575, "-1.0 MiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_format_bytes_signed_and_decimals():
    assert format_bytes(3 << 20, signed=True) == "+3.0 MiB"
    assert format_bytes(-(3 << 20), signed=True) == "-3.0 MiB"
    assert format_bytes(0, signed=True) == "0 B"  # zero has no sign
    assert format_bytes(5, signed=True) == "+5 B"
    assert format_bytes(1536, decimals=3) == "1.500 KiB"
    assert format_bytes(1536, decimals=0) == "2 KiB"
    assert format_bytes(1048575, decimals=3) == "1023.999 KiB"  # no carry at 3 decimals
    assert format_bytes(1048575, decimals=2) == "1.00 MiB"


@pytest.mark.parametrize("n", [None, float("nan"), float("inf"), float("-inf")])
def test_format_bytes_not_a_number(n):
    assert format_bytes(n) == "n/a"


def test_format_and_parse_agree():
    for n in (KiB, 3 * MiB, 5 * GiB, 2 * TiB):
        assert parse_size(format_bytes(n)) == n


# --------------------------------------------------------------------------- format_time
@pytest.mark.parametrize("seconds, text", [
    (0.0012345, "1.23 ms"), (2.5e-6, "2.5 µs"), (3e-9, "3 ns"), (0, "0 ns"), (1e-10, "0.1 ns"),
    (1.0, "1 s"), (12.345, "12.3 s"), (59.5, "59.5 s"),
    (75.0, "1 min 15.0 s"), (119.96, "2 min 0.0 s"),  # rounded before the minutes are taken
    (-0.002, "-2 ms"),
    # rounding up to 1000 of a unit moves to the next unit (never "1e+03 ms")
    (0.99996, "1 s"), (0.0009996, "1 ms"), (999.6e-9, "1 µs"), (999.4e-9, "999 ns"),
])
def test_format_time(seconds, text):
    assert format_time(seconds) == text


def test_format_time_precision():
    assert format_time(0.0012345, 5) == "1.2345 ms"
    assert format_time(3e-9, 2) == "3 ns"
    assert format_time(0.15, 1) == "150 ms"  # 1 digit would need an exponent: whole number
    assert format_time(0.96, 1) == "1 s"
    assert format_time(15.0, 1) == "15 s"
    assert format_time(75.0, 4) == "1 min 15.00 s"
    assert format_time(75.0, 1) == "1 min 15 s"


@pytest.mark.parametrize("seconds", [None, float("nan"), float("inf")])
def test_format_time_not_a_number(seconds):
    assert format_time(seconds) == "n/a"


# --------------------------------------------------------------------------- one meaning
# Every input that takes a size goes through parse_size, so "1g" is 2**30 bytes everywhere.
SAME_TEXTS = [("1g", GiB), ("512MiB", 512 * MiB), ("2GB", 2 * 10**9), ("1.5 GiB", 3 << 29)]


@pytest.mark.parametrize("text, expected", SAME_TEXTS)
def test_same_size_in_cuda_memory_threshold(text, expected):
    pytest.importorskip("IPython")
    from cudalab.magics.memory_args import parse_memory_args

    assert parse_memory_args(f"watch on --threshold {text.replace(' ', '')}").threshold == expected
    number, _, unit = text.partition(" ")
    if unit:  # "--threshold 1.5 GiB": the unit as a separate word
        assert parse_memory_args(f"watch on --threshold {number} {unit}").threshold == expected
    assert parse_memory_args(f"watch on --threshold={text.replace(' ', '')}").threshold == expected


@pytest.mark.parametrize("text, expected", SAME_TEXTS)
def test_same_size_in_cli_what_if_device_memory(text, expected, monkeypatch, capsys):
    from cudalab import cli
    from cudalab.memory_tools import what_if

    seen = []

    def fake_what_if(trace, confs, device_memory=None, **kw):
        seen.append(device_memory)
        raise ValueError("stub")  # the command reports it and returns 2

    monkeypatch.setattr(what_if, "what_if", fake_what_if)
    assert cli.main(["what-if", "trace.pickle", "--device-memory", text]) == 2
    assert "stub" in capsys.readouterr().err
    assert seen == [expected]


@pytest.mark.parametrize("text, expected", SAME_TEXTS)
def test_same_size_in_simulator_memory(text, expected):
    from cudalab._driver.sim.config import SimulatorConfig

    assert SimulatorConfig.from_env({"CUDALAB_SIMULATOR_MEMORY": text}).memory == expected


def test_bad_sizes_are_rejected_by_every_input(monkeypatch, capsys):
    from cudalab import cli
    from cudalab._driver.sim.config import SimulatorConfig

    with pytest.raises(ValueError, match="CUDALAB_SIMULATOR_MEMORY"):
        SimulatorConfig.from_env({"CUDALAB_SIMULATOR_MEMORY": "1zb"})
    assert cli.main(["what-if", "trace.pickle", "--device-memory", "1zb"]) == 2
    assert "1zb" in capsys.readouterr().err
    pytest.importorskip("IPython")
    from IPython.core.error import UsageError

    from cudalab.magics.memory_args import parse_memory_args

    with pytest.raises(UsageError, match="--threshold"):
        parse_memory_args("watch on --threshold 1zb")
