"""The simulator's settings: :class:`SimulatorConfig`, the one reader of its environment.

A :class:`~cudalab._driver.sim.SimulatorBackend` takes a config object, so code that needs a
private simulator of its own (``cudalab.memory_tools.replay``, tests) builds one with
``SimulatorBackend(SimulatorConfig(device_count=1, memory=64 << 20))`` and never touches
``os.environ``. :meth:`SimulatorConfig.from_env` is the only place that reads the variables:

``CUDALAB_SIMULATOR_DEVICES``
    Number of simulated devices, a whole number from 1 to 64 (default 2).
``CUDALAB_SIMULATOR_MEMORY``
    Memory per device, read by :func:`cudalab._units.parse_size` like every size cudalab
    reads: plain bytes (``1073741824``) or a number with a unit, case-insensitive, optional
    space, decimals allowed: ``k``/``m``/``g``/``t`` and ``KiB``/``MiB``/``GiB``/``TiB``
    (powers of 1024), ``KB``/``MB``/``GB``/``TB`` (powers of 1000); e.g. ``16GiB`` (default),
    ``1g``, ``1.5GiB``, ``512 MiB``. Between 1 MiB and 1 TiB.
``CUDA_VISIBLE_DEVICES``
    Honoured like the driver does (see :func:`parse_visible_devices`). NVML ignores it.

This module also owns the simulated devices' identity (:func:`device_uuid`), which
``CUDA_VISIBLE_DEVICES`` may name.
"""

from __future__ import annotations

import operator
import os
import re
import uuid as _uuid
from collections.abc import Mapping
from dataclasses import dataclass

from cudalab._driver.visible_devices import parse_visible_devices as _parse_visible
from cudalab._units import GiB, MiB, TiB, echo, parse_size

__all__ = ["SimulatorConfig", "parse_visible_devices", "visible_devices_from_env", "device_uuid",
           "MAX_DEVICES", "MIN_MEMORY", "MAX_MEMORY"]

#: Most simulated devices (and the most CUDALAB_SIMULATOR_DEVICES accepts).
MAX_DEVICES = 64
#: Smallest memory per simulated device.
MIN_MEMORY = MiB
#: Largest memory per simulated device. It is also the distance between two devices' fake
#: address ranges (``DEVICE_STRIDE`` in :mod:`cudalab._driver.sim.core` is defined as this
#: value, so the two cannot drift).
MAX_MEMORY = TiB

_DEFAULT_DEVICES = 2
_DEFAULT_MEMORY = 16 * GiB

_DEVICES_ENV = "CUDALAB_SIMULATOR_DEVICES"
_MEMORY_ENV = "CUDALAB_SIMULATOR_MEMORY"
_VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"

_UUID_NAMESPACE = _uuid.uuid5(_uuid.NAMESPACE_URL, "https://cudalab.invalid/simulator/gpu")


@dataclass(frozen=True)
class SimulatorConfig:
    """How many simulated devices, how much memory each, and which ones are visible.

    Parameters
    ----------
    device_count : int, optional
        Number of simulated (physical) devices, 1 to :data:`MAX_DEVICES` (default 2).
    memory : int, optional
        Bytes of memory per device, :data:`MIN_MEMORY` (1 MiB) to :data:`MAX_MEMORY` (1 TiB);
        default 16 GiB.
    visible_devices : str or None, optional
        A ``CUDA_VISIBLE_DEVICES`` value selecting the devices this process sees (read by
        :func:`parse_visible_devices`); None (default) shows every device.

    Raises
    ------
    TypeError
        For a field of the wrong type (``bool`` is not taken as an int).
    ValueError
        For a device count or memory size outside its range.
    """

    #: 1 <= device_count <= MAX_DEVICES (NVML sees all of them, whatever is visible)
    device_count: int = _DEFAULT_DEVICES
    #: MIN_MEMORY <= memory <= MAX_MEMORY bytes per device (the capacity mem_get_info reports)
    memory: int = _DEFAULT_MEMORY
    #: None: all devices visible; else a CUDA_VISIBLE_DEVICES value, kept as written
    visible_devices: str | None = None

    def __post_init__(self) -> None:
        for name in ("device_count", "memory"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"SimulatorConfig.{name} must be an int, not "
                                f"{type(value).__name__}")
        if not 1 <= self.device_count <= MAX_DEVICES:
            raise ValueError(f"SimulatorConfig.device_count={echo(self.device_count)} is out of range; "
                             f"give a whole number from 1 to {MAX_DEVICES}")
        if not MIN_MEMORY <= self.memory <= MAX_MEMORY:
            raise ValueError(f"SimulatorConfig.memory={echo(self.memory)} is out of range; give the "
                             "bytes per simulated device, between 1MiB (1048576) and 1TiB "
                             "(1099511627776)")
        if self.visible_devices is not None and not isinstance(self.visible_devices, str):
            raise TypeError("SimulatorConfig.visible_devices must be a str (a "
                            "CUDA_VISIBLE_DEVICES value) or None, not "
                            f"{type(self.visible_devices).__name__}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SimulatorConfig:
        """The configuration the environment asks for (the only reader of these variables).

        Parameters
        ----------
        environ : Mapping[str, str] or None, optional
            Where to read ``CUDALAB_SIMULATOR_DEVICES``, ``CUDALAB_SIMULATOR_MEMORY`` and
            ``CUDA_VISIBLE_DEVICES``; None (default) reads ``os.environ``. Unset or blank
            sizes take the defaults.

        Returns
        -------
        SimulatorConfig

        Raises
        ------
        ValueError
            When a variable is not understood; the message names it and shows valid values.
        """
        env = os.environ if environ is None else environ
        return cls(device_count=_read_device_count(env.get(_DEVICES_ENV)),
                   memory=_read_memory(env.get(_MEMORY_ENV)),
                   visible_devices=visible_devices_from_env(env))

    def visible(self) -> list[int]:
        """Physical indices of the visible devices, in CUDA ordinal order."""
        if self.visible_devices is None:
            return list(range(self.device_count))
        return parse_visible_devices(self.visible_devices, self.device_count)


def visible_devices_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` value in ``environ`` (default ``os.environ``), as
    :attr:`SimulatorConfig.visible_devices` keeps it: a simulator made now would show these
    devices (torch re-reads the variable until CUDA is initialised)."""
    env = os.environ if environ is None else environ
    return env.get(_VISIBLE_ENV)


def _read_device_count(raw: str | None) -> int:
    if raw is None or not raw.strip():
        return _DEFAULT_DEVICES
    text = raw.strip()
    if re.fullmatch(r"\+?\d{1,20}", text):  # (longer: out of range, and int() refuses 4300)
        n = int(text)
        if 1 <= n <= MAX_DEVICES:
            return n
    raise ValueError(
        f"{_DEVICES_ENV}={echo(raw)} is not understood; give the number of simulated "
        f"devices as a whole number from 1 to {MAX_DEVICES}, e.g. {_DEVICES_ENV}=2"
    )


def _read_memory(raw: str | None) -> int:
    if raw is None or not raw.strip():
        return _DEFAULT_MEMORY
    try:
        size = parse_size(raw, what=_MEMORY_ENV, allow_zero=False)
    except ValueError as exc:
        reason = str(exc)
    else:
        if MIN_MEMORY <= size <= MAX_MEMORY:
            return size
        reason = f"{size} bytes is outside 1MiB..1TiB"
    raise ValueError(
        f"{_MEMORY_ENV}={echo(raw)} is not understood ({reason}); give the memory per simulated "
        "device as bytes or a number with a unit (k, m, g, t or KiB, MiB, GiB, TiB: powers "
        "of 1024; KB, MB, GB, TB: powers of 1000), between 1MiB and 1TiB, e.g. 16GiB, 1g, "
        "1.5GiB, 512 MiB, 8GB or 1073741824"
    )


def device_uuid(physical: int) -> str:
    """The deterministic NVML-style UUID of simulated device ``physical``."""
    return "GPU-" + str(_uuid.uuid5(_UUID_NAMESPACE, f"cudalab-simulated-gpu-{physical}"))


def parse_visible_devices(value: str, count: int) -> list[int]:
    """Physical device indices selected by a ``CUDA_VISIBLE_DEVICES`` value.

    The text is read by the seam's one parser,
    :func:`cudalab._driver.visible_devices.parse_visible_devices` (shared with
    :mod:`cudalab.devices`, so the two cannot drift); this function maps its result onto
    the simulated devices. It follows the driver as torch's ``_parse_visible_devices``
    mimics it: a comma list of indices, each read like ``strtoul`` (``"1gpu2"`` reads as
    1, ``"+3"`` as 3); parsing stops at the first entry that is not a non-negative number or not an existing device (index
    ``>= count``); a repeated index makes the whole list empty; an empty string selects no
    device. A value starting with ``GPU-`` is a list of UUIDs or unique UUID prefixes matched
    against the simulated devices' UUIDs (the first unknown or ambiguous one stops parsing);
    ``MIG-`` values select nothing (the simulator has no MIG instances).

    Parameters
    ----------
    value : str
        The ``CUDA_VISIBLE_DEVICES`` text.
    count : int
        Number of simulated (physical) devices.

    Returns
    -------
    list of int
        The selected physical indices, in order.
    """
    count = operator.index(count)
    parsed = _parse_visible(value)
    if parsed and isinstance(parsed[0], str):
        uuids = [device_uuid(i) for i in range(count)]
        chosen: list[int] = []
        for elem in parsed:
            if not isinstance(elem, str) or not elem.startswith("GPU-"):
                break  # MIG- values select nothing: the simulator has no MIG instances
            cand = "GPU-" + elem[4:].lower()
            matches = [i for i, u in enumerate(uuids) if u.startswith(cand)]
            if len(matches) != 1:
                break
            if matches[0] in chosen:
                return []
            chosen.append(matches[0])
        return chosen
    out: list[int] = []
    for x in parsed:
        if not isinstance(x, int) or x >= count:
            break  # stops at the first device that does not exist
        out.append(x)
    return out
