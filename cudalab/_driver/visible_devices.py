"""The one ``CUDA_VISIBLE_DEVICES`` parser of the driver seam (torch's rules).

Lives in the seam so that every layer can share it: :mod:`cudalab.devices` counts devices
with it before CUDA is initialised (NVML + this parser, no context), and a backend that
emulates the variable can read it the same way, so the two cannot drift. Pure text
processing: imports nothing.
"""

from __future__ import annotations

__all__ = ["parse_visible_devices"]


def parse_visible_devices(value: str) -> list[int] | list[str]:
    """Parse ``CUDA_VISIBLE_DEVICES`` the way the driver does (torch's ``_parse_visible_devices``).

    Integer entries are read until the first invalid or negative one; ``GPU-``/``MIG-``
    prefixed entries are returned as strings for UUID matching. Duplicates make the list
    empty (the driver then sees no device).

    Parameters
    ----------
    value : str
        The ``CUDA_VISIBLE_DEVICES`` text.

    Returns
    -------
    list of int or list of str
        Device ordinals in order, or the ``GPU-``/``MIG-`` UUID prefixes as written.
    """
    items = [x.strip() for x in value.split(",")]
    if items and items[0].startswith(("GPU-", "MIG-")):
        out_s: list[str] = []
        for item in items:
            if not item.startswith(("GPU-", "MIG-")):
                break
            if item in out_s:
                return []
            out_s.append(item)
        return out_s
    out: list[int] = []
    for item in items:
        digits = ""
        for ch in item:
            if ch.isdigit() or (ch in "+-" and not digits):
                digits += ch
            else:
                break
        try:
            idx = int(digits)
        except ValueError:
            break
        if idx < 0:
            break
        if idx in out:
            return []
        out.append(idx)
    return out
