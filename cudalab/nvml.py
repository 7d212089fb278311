"""torch.cuda's NVML queries (utilization, temperature, power, clocks, processes).

Same names, units and strings as torch 2.11: ``utilization`` and ``memory_usage`` are
percentages over NVML's last sample period, ``temperature`` is °C, ``power_draw`` mW,
``clock_rate`` the SM clock in MHz, ``device_memory_used`` bytes (NVML's view of the whole
device, all processes). ``list_gpu_processes`` returns torch's text.

Unlike torch, a CUDA device is matched to its NVML device by UUID rather than by re-parsing
``CUDA_VISIBLE_DEVICES``, so ordinals map correctly whatever ``CUDA_DEVICE_ORDER`` says.
Failures raise :class:`cudalab.errors.NvmlError` (a ``RuntimeError``), except in
``list_gpu_processes``, which returns torch's strings when NVML cannot be used at all.

Under the simulator every value is simulated; :func:`device_snapshot` says so in its
``"simulated"`` key and ``list_gpu_processes`` on its first line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cudalab._driver.nvml import NvmlUnavailableError
from cudalab.errors import NvmlError

if TYPE_CHECKING:
    from cudalab._driver.base import Nvml

__all__ = [
    "utilization",
    "memory_usage",
    "temperature",
    "power_draw",
    "clock_rate",
    "device_memory_used",
    "list_gpu_processes",
    "device_snapshot",
    "device_count_nvml",
    "nvml_backend",
    "resolve_device",
]

# torch's strings for "NVML cannot be used" in list_gpu_processes.
_TORCH_NO_PYNVML = "pynvml module not found, please install nvidia-ml-py"
_TORCH_NO_DRIVER = "cuda driver can't be loaded, is cuda enabled?"


def nvml_backend() -> Nvml:
    """The backend's NVML interface, for callers that poll several values (widgets).

    Getting it does not initialise CUDA (creating the backend makes no context).

    Returns
    -------
    cudalab._driver.base.Nvml
        Queries keyed by device UUID (see :func:`resolve_device`).

    Raises
    ------
    cudalab.errors.NvmlError
        When a query fails later; NVML being absent surfaces on the first query.
    """
    from cudalab import _driver

    return _driver.get_backend().nvml()


def resolve_device(device: Any) -> tuple[int, str, Nvml]:
    """The CUDA ordinal, its UUID and :func:`nvml_backend` for a torch-style device argument.

    Parameters
    ----------
    device
        None (the current device), an int, ``"cuda"``, ``"cuda:N"`` or a Device.

    Returns
    -------
    tuple
        ``(index, uuid, nvml)``: NVML queries take the UUID, so ordinals map correctly
        whatever ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` say.

    Raises
    ------
    ValueError, TypeError
        An invalid device argument.
    """
    from cudalab import _internal, devices

    index = _internal.device_index(device)
    uuid = devices.get_device_properties(index).nvml_uuid
    return index, uuid, nvml_backend()


def utilization(device: Any = None) -> int:
    """Percent of time over the past sample period during which one or more kernels ran."""
    _, uuid, nvml = resolve_device(device)
    return nvml.utilization(uuid)[0]


def memory_usage(device: Any = None) -> int:
    """Percent of time over the past sample period during which device memory was read or
    written (a utilization rate like torch's, not bytes; see :func:`device_memory_used`)."""
    _, uuid, nvml = resolve_device(device)
    return nvml.utilization(uuid)[1]


def temperature(device: Any = None) -> int:
    """GPU temperature in degrees Celsius."""
    _, uuid, nvml = resolve_device(device)
    return nvml.temperature(uuid)


def power_draw(device: Any = None) -> int:
    """Power draw in milliwatts."""
    _, uuid, nvml = resolve_device(device)
    return nvml.power_usage(uuid)


def clock_rate(device: Any = None) -> int:
    """Current SM clock in MHz."""
    _, uuid, nvml = resolve_device(device)
    return nvml.clock_sm(uuid)


def device_memory_used(device: Any = None) -> int:
    """Device memory in use, in bytes, as NVML counts it (all processes and driver overhead)."""
    _, uuid, nvml = resolve_device(device)
    return nvml.memory_info(uuid)[2]


def list_gpu_processes(device: Any = None) -> str:
    """A human-readable list of the compute processes on ``device`` and their memory (torch's text).

    The first line is ``GPU:{index}`` with NVML's index for the device, like torch (it equals
    the CUDA ordinal unless ``CUDA_VISIBLE_DEVICES`` reorders devices), followed by
    ``(simulated)`` under the simulator. Where NVML cannot tell a process's memory, the
    amount reads ``n/a``.
    """
    try:
        # Like torch, probe NVML before touching CUDA: no driver gives a string, not an error.
        uuids = nvml_backend().uuids()
    except NvmlUnavailableError as exc:
        return _TORCH_NO_PYNVML if exc.reason == "pynvml" else _TORCH_NO_DRIVER
    index, uuid, nvml = resolve_device(device)
    procs = nvml.processes(uuid)
    if uuid in uuids:
        index = uuids.index(uuid)
    return format_processes(index, procs, simulated=nvml.simulated)


def format_processes(index: int, procs: list[tuple[int, int | None]], simulated: bool = False) -> str:
    """torch's ``list_gpu_processes`` text for ``(pid, used bytes or None)`` pairs."""
    lines = [f"GPU:{index} (simulated)" if simulated else f"GPU:{index}"]
    if not procs:
        lines.append("no processes are running")
    for pid, used in procs:
        if used is None:
            lines.append(f"process {pid:>10d} uses {'n/a':>12} MB GPU memory")
        else:
            lines.append(f"process {pid:>10d} uses {used / (1024 * 1024):>12.3f} MB GPU memory")
    return "\n".join(lines)


def device_snapshot(device: Any = None) -> dict[str, Any]:
    """Every NVML metric of ``device`` at once, None where NVML cannot give one.

    Keys: ``utilization`` and ``memory_utilization`` (%), ``temperature`` (°C),
    ``power_draw`` (mW), ``clock_rate`` (SM MHz), ``memory_used`` and ``memory_total``
    (bytes, NVML's view) and ``simulated`` (bool). Never raises NvmlError.
    """
    _, uuid, nvml = resolve_device(device)
    snap: dict[str, Any] = {
        "utilization": None,
        "memory_utilization": None,
        "temperature": None,
        "power_draw": None,
        "clock_rate": None,
        "memory_used": None,
        "memory_total": None,
        "simulated": bool(nvml.simulated),
    }
    queries: tuple[tuple[tuple[str | None, ...], Callable[[str], Any]], ...] = (
        (("utilization", "memory_utilization"), nvml.utilization),
        (("temperature",), nvml.temperature),
        (("power_draw",), nvml.power_usage),
        (("clock_rate",), nvml.clock_sm),
        (("memory_total", None, "memory_used"), nvml.memory_info),
    )
    for keys, query in queries:
        try:
            value = query(uuid)
        except NvmlUnavailableError:
            break  # NVML is missing altogether: every other query would fail the same way
        except NvmlError:
            continue
        if len(keys) == 1:
            snap[keys[0] or ""] = value  # (a single key is never None)
        else:
            for key, item in zip(keys, value):
                if key is not None:
                    snap[key] = item
    return snap


def device_count_nvml() -> int | None:
    """How many devices NVML sees (all of them, ignoring ``CUDA_VISIBLE_DEVICES``), without
    initialising CUDA; None when NVML cannot be used."""
    try:
        return nvml_backend().device_count()
    except (NvmlError, ImportError):  # ImportError: the CUDA backend's bindings are missing
        return None
