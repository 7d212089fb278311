"""Sizes and times as people write and read them: the one parser and the one formatter.

Every place in cudalab that reads a size from a person (``%cuda_memory --threshold``,
``cudalab what-if --memory``, ``CUDALAB_SIMULATOR_MEMORY``, ...) calls :func:`parse_size`,
and every place that prints one for a person calls :func:`format_bytes`, so ``"1g"`` means
the same everywhere. The only other byte texts are torch's own, reproduced to the letter
where torch's output is matched (``cudalab.allocator.stats``: the OOM message and
``memory_summary()``).

Units (case-insensitive, optional space between number and unit):

======================  =========================================
``b`` or none           bytes
``k`` ``m`` ``g`` ``t``  binary: 2**10, 2**20, 2**30, 2**40 (as Docker's ``-m 1g``
                        and Java's ``-Xmx1g``)
``kib`` ... ``tib``     binary, spelled out
``kb`` ... ``tb``       decimal (SI): 10**3 ... 10**12
======================  =========================================
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["KiB", "MiB", "GiB", "TiB", "parse_size", "format_bytes", "format_time", "SIZE_UNITS"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

#: Bytes per unit, by lower-case unit name. One table, so the three spellings cannot drift.
SIZE_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": KiB, "m": MiB, "g": GiB, "t": TiB,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}

_SIZE_RE = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
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
        0 when ``allow_zero`` is False. The message names ``what`` and gives examples.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = Fraction(text)
    else:
        m = _SIZE_RE.match(str(text))
        factor = SIZE_UNITS.get(m.group(2).lower()) if m else None
        if m is None or factor is None:
            raise ValueError(f"cannot read the {what} {text!r}: give bytes or a number with a "
                             f"unit ({_EXAMPLES})")
        number = m.group(1)
        value = Fraction(number) * factor if "e" not in number.lower() else \
            Fraction(float(number)) * factor
    if value < 0 or (value == 0 and not allow_zero):
        bound = "at least 0" if allow_zero else "more than 0"
        raise ValueError(f"the {what} must be {bound} bytes, got {text!r} ({_EXAMPLES})")
    return int(value)


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int | float | None, *, signed: bool = False, decimals: int = 1) -> str:
    """A byte count for people: ``1536`` -> ``"1.5 KiB"``, ``-3 << 20`` -> ``"-3.0 MiB"``.

    Parameters
    ----------
    n : int, float or None
        The byte count; None prints ``"n/a"``.
    signed : bool, optional
        Put ``+`` before positive values (deltas).
    decimals : int, optional
        Digits after the point for KiB and above (default 1). Whole bytes print without any.

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
    exponent = min((int(n).bit_length() - 1) // 10, len(_BINARY_UNITS) - 1)
    value = n / (1 << (10 * exponent))
    if round(value, decimals) >= 1024 and exponent < len(_BINARY_UNITS) - 1:
        exponent += 1
        value /= 1024
    return f"{sign}{value:.{decimals}f} {_BINARY_UNITS[exponent]}"


def format_time(seconds: float | None, precision: int = 3) -> str:
    """``0.0012345`` -> ``"1.23 ms"`` (``precision`` significant digits); None or NaN ->
    ``"n/a"``. (Unrolled: the watch formats two times per cell.)"""
    if seconds is None or seconds != seconds:
        return "n/a"
    if seconds < 0:
        return "-" + format_time(-seconds, precision)
    if seconds >= 1.0:
        if seconds >= 60.0:
            minutes, rest = divmod(seconds, 60.0)
            return f"{int(minutes)} min {rest:.{max(precision - 2, 0)}f} s"
        return f"{seconds:.{precision}g} s"
    if seconds >= 1e-3:
        return f"{seconds / 1e-3:.{precision}g} ms"
    if seconds >= 1e-6:
        return f"{seconds / 1e-6:.{precision}g} µs"
    return f"{seconds / 1e-9:.{precision}g} ns"
