"""Where a record came from: :class:`Identity`, the host, process, rank and device of a
snapshot, an exported trace or a dashboard sample.

Records that leave the process (snapshot pickles, parquet files, Perfetto JSON, samples
gathered from many ranks) say nothing of their origin by themselves. An :class:`Identity`
travels with each of them as a plain dict (:meth:`Identity.to_dict`; the key is
``"identity"`` everywhere), and :meth:`Identity.from_dict` reads it back, checking every
field, so a loader of files from strangers gets either a valid identity or a clear
ValueError.

The rank, local rank and world size come from the launcher's environment
(:func:`ranks_from_environment`): torchrun's ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``,
Open MPI's ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_LOCAL_RANK`` /
``OMPI_COMM_WORLD_SIZE``, then PMI's ``PMI_RANK`` / ``PMI_SIZE`` (MPICH, Intel MPI, Slurm's
PMI; MPICH's Hydra adds ``MPI_LOCALRANKID``); each is None when unknown. The device's UUID
and name come from the driver through :func:`cudalab.get_device_properties` (the simulator
gives a stable UUID per simulated device, and its name says "simulated").

This module imports only :mod:`cudalab.devices` (``socket`` when an identity is built),
so ``import cudalab`` stays fast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cudalab import devices

__all__ = ["Identity", "ranks_from_environment", "LAUNCHER_VARIABLES"]

#: The environment variables of each launcher, in the order they are tried:
#: ``(launcher, rank, local rank, world size)``. The first launcher whose rank variable
#: holds a valid rank gives all three values (a local rank or world size it lacks, or that
#: is malformed, is None). torchrun comes first: a torchrun started by ``mpirun`` hands its
#: workers their own ranks while they inherit the launcher's MPI variables.
LAUNCHER_VARIABLES: tuple[tuple[str, str, str | None, str], ...] = (
    ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("pmi", "PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
)

#: Bounds of the fields, checked by :meth:`Identity.from_dict` and the constructor: the
#: longest text (characters) per text field, and the integer ranges.
_MAX_TEXT = {"host": 1024, "device_uuid": 128, "device_name": 256, "version": 128,
             "allocator": 64}
_INT_LIMIT = 1 << 31
_PID_LIMIT = 1 << 63
_REQUIRED = ("host", "pid", "version", "allocator")
_OPTIONAL = ("rank", "local_rank", "world_size", "device", "device_uuid", "device_name")


def _env_int(environ: Mapping[str, str], name: str | None, low: int) -> int | None:
    """``environ[name]`` as an int in [low, 2**31), or None (unset, empty or malformed)."""
    if name is None:
        return None
    text = environ.get(name)
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if low <= value < _INT_LIMIT else None


def ranks_from_environment(environ: Mapping[str, str] | None = None
                           ) -> tuple[int | None, int | None, int | None]:
    """``(rank, local_rank, world_size)`` from the launcher's environment.

    Parameters
    ----------
    environ : mapping of str to str, optional
        The environment to read (default: ``os.environ``).

    Returns
    -------
    tuple of (int or None, int or None, int or None)
        From the first launcher of :data:`LAUNCHER_VARIABLES` whose rank variable holds an
        integer in [0, 2**31) (and below its world size, when that is known): its rank, its
        local rank (None when unset or not below the world size) and its world size (None
        when unset or below 1). ``(None, None, None)`` when no launcher is recognised.
    """
    env = os.environ if environ is None else environ
    for _launcher, rank_name, local_name, size_name in LAUNCHER_VARIABLES:
        rank = _env_int(env, rank_name, 0)
        if rank is None:
            continue
        size = _env_int(env, size_name, 1)
        if size is not None and rank >= size:
            continue  # inconsistent: not this launcher's values
        local = _env_int(env, local_name, 0)
        if local is not None and size is not None and local >= size:
            local = None
        return rank, local, size
    return None, None, None


def _show(value: Any) -> str:
    if value is None or isinstance(value, (str, int, float, bool)):
        return f"a {type(value).__name__} ({value!r:.40})"
    return f"a {type(value).__name__}"


def _check_field(name: str, value: Any, where: str) -> None:
    """ValueError naming ``where[name]`` when ``value`` breaks the field's invariant."""
    if name in _MAX_TEXT:
        optional = name not in _REQUIRED
        if value is None and optional:
            return
        if type(value) is not str:
            raise ValueError(f"{where}[{name!r}] is {_show(value)}, expected a str"
                             f"{' or None' if optional else ''}")
        if not value and name in ("host", "allocator"):
            raise ValueError(f"{where}[{name!r}] is empty, expected a non-empty str")
        if len(value) > _MAX_TEXT[name]:
            raise ValueError(f"{where}[{name!r}] has {len(value)} characters, at most "
                             f"{_MAX_TEXT[name]} expected")
        return
    if value is None and name != "pid":
        return
    if type(value) is not int:  # (not bool, not a float: exact integers only)
        raise ValueError(f"{where}[{name!r}] is {_show(value)}, expected an int"
                         f"{'' if name == 'pid' else ' or None'}")
    low, high = {"pid": (1, _PID_LIMIT), "world_size": (1, _INT_LIMIT)}.get(name, (0, _INT_LIMIT))
    if not low <= value < high:
        raise ValueError(f"{where}[{name!r}] is {value}, expected an int in [{low}, {high})")


@dataclass(frozen=True, slots=True)
class Identity:
    """Where a snapshot, a trace or a sample came from.

    Build one with :meth:`current`; travel with :meth:`to_dict` / :meth:`from_dict` (a
    plain dict of these field names). The constructor checks every invariant below
    (ValueError naming the field).
    """

    #: The host's name (``socket.gethostname()``): a non-empty str of at most 1024
    #: characters.
    host: str
    #: The process id: an int >= 1.
    pid: int
    #: The cudalab version that wrote the record (``cudalab.__version__``): a str of at most
    #: 128 characters.
    version: str
    #: Which allocator the data came from: ``"cudalab"`` for cudalab's own (later
    #: ``"torch"``, ``"cupy"``): a non-empty str of at most 64 characters.
    allocator: str
    #: The process's global rank in [0, world_size), None when no launcher says
    #: (:func:`ranks_from_environment`).
    rank: int | None = None
    #: The process's rank on its host, >= 0 (below world_size when both are known), or None.
    local_rank: int | None = None
    #: How many processes the job has, >= 1, or None when unknown.
    world_size: int | None = None
    #: The device index (the process's own numbering, after CUDA_VISIBLE_DEVICES), >= 0, or
    #: None when the record covers no one device or CUDA was not initialised.
    device: int | None = None
    #: The device's UUID in NVML's and nvidia-smi's spelling (``"GPU-…"`` or ``"MIG-…"``,
    #: stable across processes and device numberings; the simulator's is stable per
    #: simulated device), or None without a device.
    device_uuid: str | None = None
    #: The device's name as the driver reports it (the simulator's says "simulated"), or
    #: None without a device.
    device_name: str | None = None

    def __post_init__(self) -> None:
        for name in _REQUIRED + _OPTIONAL:
            _check_field(name, getattr(self, name), "Identity")
        r, lr, n = self.rank, self.local_rank, self.world_size
        if n is not None and r is not None and r >= n:
            raise ValueError(f"Identity['rank'] is {r}, expected below world_size {n}")
        if n is not None and lr is not None and lr >= n:
            raise ValueError(f"Identity['local_rank'] is {lr}, expected below world_size {n}")

    # ------------------------------------------------------------------ building
    @classmethod
    def current(cls, device: Any = None, allocator: str = "cudalab") -> Identity:
        """This process's identity now.

        Parameters
        ----------
        device : int, str, Device or None, optional
            The device the record is about. None: the current device when CUDA is
            initialised (no device fields otherwise: this never initialises CUDA); a given
            device initialises CUDA if needed.
        allocator : str, optional
            The allocator the data came from (default ``"cudalab"``).

        Returns
        -------
        Identity
        """
        import socket

        index = uuid = name = None
        if device is not None or devices.is_initialized():
            props = devices.get_device_properties(device)
            index, uuid, name = int(props.index), str(props.nvml_uuid), str(props.name)
        rank, local_rank, world_size = ranks_from_environment()
        return cls(host=socket.gethostname() or "localhost", pid=os.getpid(),
                   version=_version(), allocator=allocator, rank=rank, local_rank=local_rank,
                   world_size=world_size, device=index, device_uuid=uuid, device_name=name)

    # ------------------------------------------------------------------ travelling
    def to_dict(self) -> dict[str, Any]:
        """The identity as a plain dict (str, int and None values only): the form that
        travels in snapshots, frame attributes, parquet and Perfetto metadata."""
        return {"host": self.host, "pid": self.pid, "rank": self.rank,
                "local_rank": self.local_rank, "world_size": self.world_size,
                "device": self.device, "device_uuid": self.device_uuid,
                "device_name": self.device_name, "version": self.version,
                "allocator": self.allocator}

    @classmethod
    def from_dict(cls, data: Any, what: str = "identity") -> Identity:
        """Read an identity written by :meth:`to_dict`, checking every field.

        Parameters
        ----------
        data : dict
            The plain dict. ``host``, ``pid``, ``version`` and ``allocator`` are required;
            the other fields default to None when missing; keys this version does not know
            (a newer cudalab's) are ignored.
        what : str, optional
            The dict's name in the messages (e.g. ``"snapshot 'a.pickle': identity"``).

        Returns
        -------
        Identity

        Raises
        ------
        ValueError
            ``data`` is not a dict, lacks a required key, or a field has the wrong type or
            is out of range (the message names it, e.g.
            ``identity['pid'] is a str ('12'), expected an int``).
        """
        if not isinstance(data, dict):
            raise ValueError(f"{what} is {_show(data)}, expected a dict")
        for name in _REQUIRED:
            if name not in data:
                raise ValueError(f"{what} lacks the key {name!r}")
        values: dict[str, Any] = {name: data.get(name) for name in _REQUIRED + _OPTIONAL}
        for name, value in values.items():
            _check_field(name, value, what)
        try:
            return cls(**values)
        except ValueError as exc:  # (a rank beyond the world size)
            raise ValueError(str(exc).replace("Identity", what, 1)) from None


def _version() -> str:
    """``cudalab.__version__``, read from the loaded package (importing it here would make
    this low layer import every module ``cudalab/__init__.py`` imports)."""
    return str(sys.modules[__name__.partition(".")[0]].__version__)
