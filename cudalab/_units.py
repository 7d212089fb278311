"""Sizes and times as people write and read them: the one parser and the one formatter.

Every place in cudalab that reads a size from a person (``%cuda_memory --threshold``,
``cudalab what-if --memory``, ``CUDALAB_SIMULATOR_MEMORY``, ...) calls :func:`parse_size`,
and every place that prints one for a person calls :func:`format_bytes`, so ``"1g"`` means
the same everywhere. The only other byte texts are torch's own, reproduced to the letter
where torch's output is matched (``cudalab.allocator.stats``: the OOM message and
``memory_summary()``).

Units (case-insensitive, optional space between number and unit):

=========================  =========================================
``b``, ``byte(s)``, none   bytes
``k`` ``m`` ``g`` ``t``    binary: 2**10, 2**20, 2**30, 2**40 (as Docker's ``-m 1g``
                           and Java's ``-Xmx1g``)
``kib`` ... ``tib``        binary, spelled out
``kb`` ... ``tb``          decimal (SI): 10**3 ... 10**12
=========================  =========================================

The number may have a fraction and an exponent (``1.5g``, ``2e9``, ``.5 GiB``); the result is
exact (no float rounding) and rounded down to a whole byte.

Input echoed back in an error message goes through :func:`echo`, which cuts it to a readable
prefix (a 200 KB malformed setting gives a one-line message, not a 200 KB one).
"""

from __future__ import annotations

import re

__all__ = ["KiB", "MiB", "GiB", "TiB", "parse_size", "format_bytes", "format_time", "SIZE_UNITS",
           "ECHO_LIMIT", "echo"]

#: How many characters of a person's input an error message repeats; the rest is counted.
ECHO_LIMIT = 80


def echo(value: object, limit: int = ECHO_LIMIT) -> str:
    """``repr(value)`` for an error message, cut to a readable prefix.

    Every error message that repeats what it was given (a setting, an option, a shape, a
    device string) uses this, so no input, however long, makes a message longer than a line
    or two.

    Parameters
    ----------
    value : object
        What was given (a str is cut before it is quoted, so its quotes stay paired).
    limit : int, optional
        The most characters of ``value`` (of its repr, for other types) repeated.

    Returns
    -------
    str
        ``repr(value)`` when that is short; else the repr of the first ``limit`` characters,
        "…" and the whole length, e.g. ``'max_split_size_mb:1,max_sp'… (200,569 characters)``.
    """
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}… ({len(value):,} characters)"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

#: Bytes per unit, by lower-case unit name. One table, so the three spellings cannot drift.
SIZE_UNITS: dict[str, int] = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": KiB, "m": MiB, "g": GiB, "t": TiB,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}

# ASCII digits only; an optional exponent ("2e9", "1.5E-3"); the unit is matched by the table.
# Compiled on first use by re's own cache (not at import: import cudalab time).
#: (An exponent has at most 3 digits: 10**99999999 would take minutes to compute.)
_SIZE_PATTERN = r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d{1,3})?)\s*([a-z]*)\s*$"
_SIZE_FLAGS = re.IGNORECASE | re.ASCII
_EXAMPLES = "e.g. 1048576, 512MiB, 64 KiB, 1.5GB, 2g"


def parse_size(text: str | int, *, what: str = "size", allow_zero: bool = True) -> int:
    """Bytes from a size a person wrote: ``"1048576"``, ``"512MiB"``, ``"1.5 GB"``, ``"2g"``.

    Parameters
    ----------
    text : str or int
        The size. An ``int`` (not ``bool``) is taken as bytes.
    what : str, optional
        What the size is for, named in the error message (``"--threshold"``,
        ``"CUDALAB_SIMULATOR_MEMORY"``, ...).
    allow_zero : bool, optional
        Whether 0 bytes is accepted (default True).

    Returns
    -------
    int
        The number of bytes, rounded down to a whole byte.

    Raises
    ------
    ValueError
        For anything else: a negative, non-finite or malformed number, an unknown unit, or
        less than one byte when ``allow_zero`` is False. The message names ``what`` and
        gives examples.
    """
    from fractions import Fraction  # here, not at import: it loads decimal (import cudalab time)

    value: Fraction | None
    if isinstance(text, int) and not isinstance(text, bool):
        value = Fraction(text)
    else:
        m = re.match(_SIZE_PATTERN, str(text), _SIZE_FLAGS)
        factor = SIZE_UNITS.get(m.group(2).lower()) if m else None
        try:
            value = Fraction(m.group(1)) * factor if m and factor else None  # exact
        except ValueError:  # over 4300 digits: int() refuses them (sys.get_int_max_str_digits)
            value = None
        if value is None:
            raise ValueError(f"cannot read the {what} {echo(text)}: give bytes or a number with a "
                             f"unit ({_EXAMPLES})")
    assert value is not None  # (for the type checker: both branches set it)
    nbytes = int(value)  # rounded down (toward zero)
    if value < 0 or (nbytes == 0 and not allow_zero):
        bound = "at least 0 bytes" if allow_zero else "at least 1 byte"
        raise ValueError(f"the {what} must be {bound}, got {echo(text)} ({_EXAMPLES})")
    return nbytes


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int | float | None, *, signed: bool = False, decimals: int = 1) -> str:
    """A byte count for people: ``1536`` -> ``"1.5 KiB"``, ``-3 << 20`` -> ``"-3.0 MiB"``.

    Parameters
    ----------
    n : int, float or None
        The byte count; None (and NaN or infinity) prints ``"n/a"``.
    signed : bool, optional
        Put ``+`` before positive values (deltas).
    decimals : int, optional
        Digits after the point for KiB and above (default 1). Whole bytes print without any.

    Returns
    -------
    str
        The count with a binary unit (``B``, ``KiB``, ... ``EiB``).

    Notes
    -----
    The unit is the largest binary unit not above ``|n|``, moved up one when rounding would
    print 1024 of a unit (``1048575`` -> ``"1.0 MiB"``, never ``"1024.0 KiB"``). The
    common cases are written out first: ``%cuda_memory watch`` formats four sizes per cell
    (benchmark row "%%cuda_timed per-repeat overhead" runs the watch).
    """
    if n is None:
        return "n/a"
    if not n:
        return "0 B"
    if n < 0:
        sign, n = "-", -n
    else:
        sign = "+" if signed else ""
    if n < 1024:
        return f"{sign}{int(n)} B"
    if decimals == 1:  # the default written out: the watch formats four sizes per cell
        if n < 1048524.8:  # 1023.95 KiB: from there on it prints as "1.0 MiB"
            return f"{sign}{n / 1024:.1f} KiB"
        if n < 1073689395.2:  # 1023.95 MiB
            return f"{sign}{n / 1048576:.1f} MiB"
        if n < 1099457940684.8:  # 1023.95 GiB
            return f"{sign}{n / 1073741824:.1f} GiB"
    try:
        bits = int(n).bit_length()
    except (ValueError, OverflowError):  # NaN, infinity (off the common path: no test there)
        return "n/a"
    exponent = min((bits - 1) // 10, len(_BINARY_UNITS) - 1)
    value = n / (1 << (10 * exponent))
    if round(value, decimals) >= 1024 and exponent < len(_BINARY_UNITS) - 1:
        exponent += 1
        value /= 1024
    return f"{sign}{value:.{decimals}f} {_BINARY_UNITS[exponent]}"


_TIME_UNITS = ("ns", "µs", "ms", "s")
_TIME_SCALES = (1e-9, 1e-6, 1e-3, 1.0)


def format_time(seconds: float | None, precision: int = 3) -> str:
    """A duration for people: ``0.0012345`` -> ``"1.23 ms"``, ``75.0`` -> ``"1 min 15.0 s"``.

    Parameters
    ----------
    seconds : float or None
        The duration; None, NaN or infinity prints ``"n/a"``.
    precision : int, optional
        Significant digits (default 3), as IPython's ``%timeit``.

    Returns
    -------
    str
        The duration in ns, µs, ms or s (and whole minutes from 60 s).

    Notes
    -----
    A value that rounds up to 1000 of its unit prints in the next one (``0.99996`` ->
    ``"1 s"``, never ``"1e+03 ms"``), and one that ``precision`` digits cannot hold
    without an exponent prints whole (``0.15`` at precision 1 -> ``"150 ms"``). The
    branches are unrolled: the watch formats two times per cell.
    """
    if seconds is None or seconds != seconds:
        return "n/a"
    if seconds < 0:
        return "-" + format_time(-seconds, precision)
    if seconds >= 1.0:
        if seconds >= 60.0:
            if seconds == _INF:
                return "n/a"
            digits = max(precision - 2, 0)
            minutes, rest = divmod(round(seconds, digits), 60.0)
            return f"{int(minutes)} min {rest:.{digits}f} s"
        text = f"{seconds:.{precision}g}"
        if "e" not in text:
            return text + " s"
        return _carried_time(seconds, precision, 3, text)
    if seconds >= 1e-3:
        text = f"{seconds / 1e-3:.{precision}g}"
        if "e" not in text:
            return text + " ms"
        return _carried_time(seconds, precision, 2, text)
    if seconds >= 1e-6:
        text = f"{seconds / 1e-6:.{precision}g}"
        if "e" not in text:
            return text + " µs"
        return _carried_time(seconds, precision, 1, text)
    text = f"{seconds / 1e-9:.{precision}g}"
    if "e" not in text:
        return text + " ns"
    return _carried_time(seconds, precision, 0, text)


def _carried_time(seconds: float, precision: int, unit: int, text: str) -> str:
    """``format_time`` when ``precision`` digits of unit ``_TIME_UNITS[unit]`` need an
    exponent (``text``): the next unit if the value rounded to 1000, else the whole number."""
    value = seconds / _TIME_SCALES[unit]
    if unit < 3 and float(text) >= 1000:
        return f"{value / 1000:.{precision}g} {_TIME_UNITS[unit + 1]}"
    return f"{value:.0f} {_TIME_UNITS[unit]}"


_INF = float("inf")
