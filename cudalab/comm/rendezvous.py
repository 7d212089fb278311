"""Carrying NCCL's unique id from rank 0 to the other ranks of a multi-process job.

An NCCL communicator across processes starts from a 128-byte ``ncclUniqueId`` that one
process (rank 0 here) creates and every rank passes to :class:`cudalab.comm.Communicator`.
The id embeds the address of a bootstrap socket served by a thread of the process that
created it, so that process must stay alive until every rank has joined, and an id from an
earlier job is useless (the ranks would try to reach a socket nobody serves): use a fresh
id, and a fresh file path, per job.

Three carriers:

* MPI (:func:`unique_id_from_mpi`, with :func:`launch_info_from_mpi` for the rank, the world
  size and the node-local rank): ``mpirun -n 2 python train.py``. Needs mpi4py (``pip
  install 'cudalab[mpi]'``), imported on first use.
* A file on a filesystem every rank sees (:func:`unique_id_from_file`): rank 0 writes it
  atomically, the others wait for it (with a timeout).
* An environment variable (:func:`unique_id_from_env`) holding the id as 256 hex digits, for
  launchers where a parent process creates the id (:func:`unique_id_hex`) and starts the
  ranks with :func:`launch_env`; :func:`launch_info_from_env` reads ``RANK``,
  ``WORLD_SIZE`` and ``LOCAL_RANK`` as torchrun sets them.

docs/comm_multiprocess.md shows each launch.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from cudalab import _internal
from cudalab._driver.base import NCCL_UNIQUE_ID_SIZE
from cudalab.errors import NcclError

__all__ = [
    "UNIQUE_ID_ENV",
    "DEFAULT_FILE_TIMEOUT",
    "LaunchInfo",
    "new_unique_id",
    "unique_id_hex",
    "unique_id_to_hex",
    "unique_id_from_hex",
    "unique_id_from_env",
    "unique_id_from_file",
    "unique_id_from_mpi",
    "launch_env",
    "launch_info_from_env",
    "launch_info_from_mpi",
]

#: The environment variable :func:`unique_id_from_env` reads by default.
UNIQUE_ID_ENV = "CUDALAB_NCCL_UNIQUE_ID"
#: How long (seconds) :func:`unique_id_from_file` waits for rank 0's file by default.
DEFAULT_FILE_TIMEOUT = 300.0
#: The first and the longest pause (seconds) between two looks at the file (it doubles).
FILE_POLL_FIRST = 0.01
FILE_POLL_LONGEST = 0.5
#: torchrun's variables: the rank, the number of ranks, the rank within its node.
RANK_ENV, WORLD_SIZE_ENV, LOCAL_RANK_ENV = "RANK", "WORLD_SIZE", "LOCAL_RANK"
#: How many hex digits spell a unique id.
UNIQUE_ID_HEX_DIGITS = 2 * NCCL_UNIQUE_ID_SIZE

_HEX = re.compile(r"[0-9a-fA-F]*")


class LaunchInfo(NamedTuple):
    """Where this process stands in its job."""

    rank: int  # 0 <= rank < world_size
    world_size: int  # >= 1
    local_rank: int | None  # the rank among the processes of this node (None: not known)


# ----------------------------------------------------------------------------- the id itself
def new_unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes) from this process's NCCL.

    This process serves the id's bootstrap socket: keep it alive until every rank has
    created its :class:`~cudalab.comm.Communicator`.

    Raises
    ------
    cudalab.NcclError
        NCCL cannot be loaded (e.g. ``nccl4py`` is missing) or fails.
    """
    uid = bytes(_internal.backend().nccl().unique_id())
    if len(uid) != NCCL_UNIQUE_ID_SIZE:
        raise NcclError(f"NCCL returned a unique id of {len(uid)} bytes, expected "
                        f"{NCCL_UNIQUE_ID_SIZE}")
    return uid


def unique_id_to_hex(unique_id: bytes) -> str:
    """``unique_id`` (128 bytes) as the 256 lower-case hex digits :func:`unique_id_from_env`
    reads."""
    return check_unique_id(unique_id, "unique_id_to_hex()").hex()


def unique_id_hex() -> str:
    """A fresh unique id (:func:`new_unique_id`) as hex, for :data:`UNIQUE_ID_ENV`.

    The process that calls this serves the id's bootstrap socket: it must stay alive until
    every rank has joined (a launcher that waits for its children does).
    """
    return new_unique_id().hex()


def unique_id_from_hex(text: str, source: str = "unique_id_from_hex()") -> bytes:
    """The unique id spelled by ``text`` (256 hex digits, surrounding blanks ignored).

    Raises
    ------
    TypeError
        ``text`` is not a str.
    ValueError
        ``text`` is not 256 hex digits (``source`` names where it came from).
    """
    if not isinstance(text, str):
        raise TypeError(f"{source}: the unique id must be a str of hex digits, got "
                        f"{type(text).__name__}")
    digits = text.strip()
    if _HEX.fullmatch(digits) is None:
        bad = next(c for c in digits if c not in "0123456789abcdefABCDEF")
        raise ValueError(f"{source}: {_internal.echo(digits)} is not hex (it holds "
                         f"{bad!r}); an NCCL unique id is {UNIQUE_ID_HEX_DIGITS} hex digits, "
                         f"as cudalab.comm.rendezvous.unique_id_hex() makes it")
    if len(digits) != UNIQUE_ID_HEX_DIGITS:
        raise ValueError(f"{source}: {len(digits)} hex digits; an NCCL unique id is "
                         f"{UNIQUE_ID_HEX_DIGITS} ({NCCL_UNIQUE_ID_SIZE} bytes), as "
                         f"cudalab.comm.rendezvous.unique_id_hex() makes it")
    return bytes.fromhex(digits)


def check_unique_id(unique_id: Any, what: str) -> bytes:
    """``unique_id`` as bytes, or TypeError / ValueError saying why it is not an id.

    Accepts bytes, bytearray, memoryview and objects with ``__bytes__`` (nccl4py's
    ``UniqueId``).
    """
    if isinstance(unique_id, str):
        raise TypeError(f"{what}: the unique id must be {NCCL_UNIQUE_ID_SIZE} bytes, got a str "
                        "(for hex text use cudalab.comm.rendezvous.unique_id_from_hex())")
    if isinstance(unique_id, (bytes, bytearray, memoryview)) or hasattr(unique_id, "__bytes__"):
        data = bytes(unique_id)
    else:
        raise TypeError(f"{what}: the unique id must be {NCCL_UNIQUE_ID_SIZE} bytes, got "
                        f"{type(unique_id).__name__}")
    if len(data) != NCCL_UNIQUE_ID_SIZE:
        raise ValueError(f"{what}: the unique id has {len(data)} bytes; an NCCL unique id has "
                         f"{NCCL_UNIQUE_ID_SIZE}")
    return data


# ----------------------------------------------------------------------------- environment
def unique_id_from_env(name: str = UNIQUE_ID_ENV,
                       environ: Mapping[str, str] | None = None) -> bytes:
    """The unique id a launcher put in the environment variable ``name`` as hex.

    Parameters
    ----------
    name : str
        The variable (default ``CUDALAB_NCCL_UNIQUE_ID``).
    environ : mapping, optional
        Where to read it (default ``os.environ``).

    Raises
    ------
    RuntimeError
        The variable is not set.
    ValueError
        It is not 256 hex digits.
    """
    env = os.environ if environ is None else environ
    text = env.get(name)
    if text is None:
        raise RuntimeError(f"unique_id_from_env(): the environment variable {name} is not set; "
                           f"the launcher sets it to cudalab.comm.rendezvous.unique_id_hex() "
                           f"(see cudalab.comm.rendezvous.launch_env())")
    return unique_id_from_hex(text, f"unique_id_from_env(): {name}")


def _env_int(env: Mapping[str, str], name: str, required: bool) -> int | None:
    text = env.get(name)
    if text is None:
        if required:
            raise RuntimeError(f"launch_info_from_env(): the environment variable {name} is "
                               f"not set (torchrun and cudalab.comm.rendezvous.launch_env() "
                               f"set RANK, WORLD_SIZE and LOCAL_RANK)")
        return None
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"launch_info_from_env(): {name}={_internal.echo(text)} is not an "
                         f"integer") from None
    if value < 0:
        raise ValueError(f"launch_info_from_env(): {name}={value} is negative")
    return value


def launch_info_from_env(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` as torchrun sets them.

    ``LOCAL_RANK`` may be missing (then ``local_rank`` is None); the other two are required.

    Raises
    ------
    RuntimeError
        ``RANK`` or ``WORLD_SIZE`` is not set.
    ValueError
        A value is not a non-negative integer, ``WORLD_SIZE`` is 0, or ``RANK`` is not below
        ``WORLD_SIZE``.
    """
    env = os.environ if environ is None else environ
    rank = _env_int(env, RANK_ENV, True)
    world_size = _env_int(env, WORLD_SIZE_ENV, True)
    local_rank = _env_int(env, LOCAL_RANK_ENV, False)
    assert rank is not None and world_size is not None  # (required above)
    if world_size < 1:
        raise ValueError(f"launch_info_from_env(): {WORLD_SIZE_ENV}={world_size}; a job has at "
                         f"least one rank")
    if rank >= world_size:
        raise ValueError(f"launch_info_from_env(): {RANK_ENV}={rank} is not below "
                         f"{WORLD_SIZE_ENV}={world_size}")
    return LaunchInfo(rank, world_size, local_rank)


def launch_env(unique_id: bytes, rank: int, world_size: int, local_rank: int | None = None,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one rank's process, for :func:`unique_id_from_env` and
    :func:`launch_info_from_env` (and :meth:`Communicator.from_env
    <cudalab.comm.Communicator.from_env>`).

    Parameters
    ----------
    unique_id : bytes
        The job's id (:func:`new_unique_id`, made by the launching process, which must stay
        alive until every rank has joined).
    rank, world_size : int
        The process's rank and the number of ranks.
    local_rank : int, optional
        The rank within its node (default: ``rank``, for a one-node job).
    base : mapping, optional
        The environment to start from (default ``os.environ``), copied; NCCL's settings in
        it (``NCCL_*``) are kept.

    Returns
    -------
    dict
        ``base`` plus ``CUDALAB_NCCL_UNIQUE_ID``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``.
    """
    uid = check_unique_id(unique_id, "launch_env()")
    for name, value in (("rank", rank), ("world_size", world_size), ("local_rank", local_rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"launch_env(): {name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"launch_env(): rank {rank} of world_size {world_size}: need "
                         f"0 <= rank < world_size")
    env = dict(os.environ if base is None else base)
    env[UNIQUE_ID_ENV] = uid.hex()
    env[RANK_ENV] = str(rank)
    env[WORLD_SIZE_ENV] = str(world_size)
    env[LOCAL_RANK_ENV] = str(rank if local_rank is None else local_rank)
    return env


# ----------------------------------------------------------------------------- a shared file
def unique_id_from_file(path: str | os.PathLike, rank: int,
                        timeout: float | None = DEFAULT_FILE_TIMEOUT, *,
                        exist_ok: bool = False) -> bytes:
    """The job's unique id through a file every rank can read (a shared filesystem).

    Rank 0 creates the id and writes it to ``path`` atomically and exclusively (a temporary
    file hard-linked to ``path``, which fails if ``path`` exists: of several rank 0s started
    on one path, exactly one succeeds), so no rank ever reads a partial id. Every other rank waits until ``path``
    exists, then reads it. Use a fresh path per job (e.g. one with the job's id in it): an
    id left by an earlier job names a bootstrap socket nobody serves any more. Rank 0 may
    remove the file once its :class:`~cudalab.comm.Communicator` is created (every rank has
    read it by then).

    Parameters
    ----------
    path : str or os.PathLike
        The file. Its directory must exist.
    rank : int
        This process's rank (0 writes, the others read).
    timeout : float or None
        Seconds a non-zero rank waits for the file (None: for ever).
    exist_ok : bool
        Whether rank 0 may replace a file already at ``path`` (default False: it refuses,
        since the other ranks may already have read the stale id).

    Returns
    -------
    bytes
        The 128-byte id.

    Raises
    ------
    FileExistsError
        Rank 0 found ``path`` already there, or another process created it first (and
        ``exist_ok`` is False).
    TimeoutError
        The file did not appear within ``timeout`` seconds.
    ValueError
        The file at ``path`` is not a unique id (its size is not 128 bytes), or a bad
        argument.
    TypeError
        ``rank`` is not an int, ``timeout`` not a number.
    OSError
        The file cannot be written or read.
    cudalab.NcclError
        Rank 0 cannot create the id (NCCL is missing).
    """
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"unique_id_from_file(): rank must be an int, got {rank!r}")
    if rank < 0:
        raise ValueError(f"unique_id_from_file(): rank must be >= 0, got {rank}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"unique_id_from_file(): timeout must be a number of seconds or "
                            f"None, got {timeout!r}")
        if not timeout > 0 or math.isnan(timeout):
            raise ValueError(f"unique_id_from_file(): timeout must be > 0 seconds, got {timeout}")
    target = os.fspath(path)
    if rank == 0:
        return _write_id_file(target, exist_ok)
    return _wait_for_id_file(target, rank, timeout)


def _write_id_file(target: str, exist_ok: bool) -> bytes:
    if os.path.isdir(target):
        raise IsADirectoryError(f"unique_id_from_file(): {target!r} is a directory; pass the "
                                f"path of a file in it")
    stale = FileExistsError(f"unique_id_from_file(): {target!r} already exists (left by an "
                            f"earlier job, or written by another rank 0?). Other ranks may read "
                            f"that id and hang: use a fresh path per job, remove the file "
                            f"first, or pass exist_ok=True to replace it")
    if exist_ok:
        uid = new_unique_id()
        _internal.write_bytes_atomic(target, uid)
        return uid
    if os.path.lexists(target):  # (early, before making an id; the creation decides)
        raise stale
    uid = new_unique_id()
    try:
        _internal.create_bytes_atomic(target, uid)  # exclusive: one rank 0 of several wins
    except FileExistsError:
        raise stale from None
    return uid


def _wait_for_id_file(target: str, rank: int, timeout: float | None) -> bytes:
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = FILE_POLL_FIRST
    while True:
        data = _read_id_file(target)
        if data is not None:
            return data
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            folder = os.path.dirname(os.path.abspath(target))
            hint = "" if os.path.isdir(folder) else f" (its directory {folder!r} does not exist)"
            raise TimeoutError(f"unique_id_from_file(): rank {rank} waited {timeout:g} s for "
                               f"rank 0 to write the NCCL unique id to {target!r}{hint}; is rank "
                               f"0 running, with the same path, on a filesystem this process "
                               f"sees?")
        time.sleep(pause if deadline is None else min(pause, max(deadline - now, 0.0)))
        pause = min(2 * pause, FILE_POLL_LONGEST)


def _read_id_file(target: str) -> bytes | None:
    """The id in ``target``; None while there is no file yet."""
    try:
        with open(target, "rb") as f:
            data = f.read(NCCL_UNIQUE_ID_SIZE + 1)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise IsADirectoryError(f"unique_id_from_file(): {target!r} is a directory; pass the "
                                f"path of a file in it") from None
    if len(data) != NCCL_UNIQUE_ID_SIZE:
        size = f"{len(data)} bytes" if len(data) <= NCCL_UNIQUE_ID_SIZE else "more than " \
            f"{NCCL_UNIQUE_ID_SIZE} bytes"
        raise ValueError(f"unique_id_from_file(): {target!r} holds {size}, not an NCCL unique "
                         f"id ({NCCL_UNIQUE_ID_SIZE} bytes; rank 0 writes it whole, atomically). "
                         f"Is the path shared with another program or job? Use a fresh path "
                         f"per job")
    return data


# ----------------------------------------------------------------------------- MPI
def _mpi_world(comm: Any) -> Any:
    """``comm``, or MPI's COMM_WORLD (importing mpi4py) when None."""
    if comm is not None:
        return comm
    from cudalab._driver import mpi as _mpi

    return _mpi.mpi().COMM_WORLD


def unique_id_from_mpi(comm: Any = None, root: int = 0) -> bytes:
    """The job's unique id, created by rank ``root`` of an MPI communicator and broadcast.

    Every rank of ``comm`` must call it (it is a collective: ``MPI.Comm.bcast``). If the root
    cannot create the id, every rank raises (none is left waiting).

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        Default ``MPI.COMM_WORLD`` (mpi4py is imported, and MPI initialised, on first use).
    root : int
        The rank that creates the id.

    Raises
    ------
    ImportError
        mpi4py is not installed (the message says ``pip install 'cudalab[mpi]'``).
    ValueError
        ``root`` is not a rank of ``comm``.
    cudalab.NcclError
        The root could not create the id (NCCL is missing or failed); on the other ranks
        the message is the root's.
    """
    world = _mpi_world(comm)
    size = world.Get_size()
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"unique_id_from_mpi(): root must be a rank of the communicator "
                         f"(0 <= root < {size}), got {root!r}")
    payload: tuple[str, Any] | None = None
    failure: BaseException | None = None
    if world.Get_rank() == root:
        try:
            payload = ("id", new_unique_id())
        except Exception as exc:  # the others must hear of it, or they wait in bcast for ever
            failure = exc
            payload = ("error", f"{type(exc).__name__}: {exc}")
    kind, value = world.bcast(payload, root=root)
    if failure is not None:
        raise failure
    if kind != "id":
        raise NcclError(f"unique_id_from_mpi(): rank {root} could not create the NCCL unique "
                        f"id: {value}")
    return check_unique_id(value, "unique_id_from_mpi()")


def launch_info_from_mpi(comm: Any = None) -> LaunchInfo:
    """This process's rank, the number of ranks and its rank within its node, from MPI.

    The node-local rank comes from ``comm.Split_type(MPI.COMM_TYPE_SHARED)`` (the ranks that
    share memory, i.e. one node); use it to pick the device: ``device=local_rank`` with one
    process per GPU. A collective call on ``comm``.

    Raises
    ------
    ImportError
        mpi4py is not installed.
    """
    from cudalab._driver import mpi as _mpi

    module = _mpi.mpi()
    world = module.COMM_WORLD if comm is None else comm
    local = world.Split_type(module.COMM_TYPE_SHARED)
    try:
        local_rank = local.Get_rank()
    finally:
        local.Free()
    return LaunchInfo(world.Get_rank(), world.Get_size(), local_rank)
