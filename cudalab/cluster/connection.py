"""Connection files: how a notebook finds the ranks of a job, as Jupyter finds a kernel.

Each publishing rank (:mod:`cudalab.cluster.publisher`) writes one JSON file into the
cluster directory, atomically and readable by its owner only (it holds the key)::

    {"kind": "cudalab.cluster", "version": 1, "job": "...", "rank": 3,
     "address": "127.0.0.1", "publish_port": 40123, "request_port": 40124,
     "signature_scheme": "hmac-sha256", "key": "<64 hex digits>", "pid": 4242,
     "started": 1764400000.0, "identity": {...}}

and removes it when it stops. A file left by a process that died (killed, out of memory)
is *stale*: :func:`scan` recognises it when the process ran on this host and its pid is gone;
a watcher also ignores a file whose rank never answers (:mod:`cudalab.cluster.watching`).

The job's name (:func:`job_id`) keeps two jobs in one directory apart: the launcher's job id
when it gives one (``CUDALAB_CLUSTER_JOB``, torchrun's run id and rendezvous endpoint,
PMIx's namespace under Open MPI 5 or another PMIx launcher, Slurm's job and step), else the
host and the parent process (the ranks one launcher started share it).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from cudalab._atomic_write import write_bytes_atomic
from cudalab.cluster.wire import decode_json
from cudalab.identity import Identity

__all__ = ["ConnectionInfo", "Scan", "job_id", "rank_number", "read_connection", "scan",
           "pid_alive", "CLUSTER_ENV", "JOB_ENV", "MAX_FILE_BYTES"]

#: The environment variable naming the cluster directory: a process that imports cudalab
#: with it set publishes there (:func:`cudalab.cluster.serve`).
CLUSTER_ENV = "CUDALAB_CLUSTER"
#: The environment variable that names the job explicitly (wins over the launchers').
JOB_ENV = "CUDALAB_CLUSTER_JOB"
#: The largest connection file read (bytes): a real one is under 2 KiB.
MAX_FILE_BYTES = 64 << 10
_KIND = "cudalab.cluster"
_VERSION = 1
_SUFFIX = ".json"
_MAX_JOB = 256


def job_id(environ: Mapping[str, str] | None = None) -> str:
    """The job this process belongs to (see the module documentation).

    Parameters
    ----------
    environ : mapping, optional
        The environment (default ``os.environ``).

    Returns
    -------
    str
        A non-empty name of at most 256 characters.
    """
    env = os.environ if environ is None else environ
    explicit = env.get(JOB_ENV, "").strip()
    if explicit:
        return explicit[:_MAX_JOB]
    run = env.get("TORCHELASTIC_RUN_ID")
    if run:
        return (f"torchrun:{run}:{env.get('MASTER_ADDR', '')}:"
                f"{env.get('MASTER_PORT', '')}")[:_MAX_JOB]
    for name in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"):
        if env.get(name):
            return f"mpi:{env[name]}"[:_MAX_JOB]
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}"[:_MAX_JOB]
    return f"{socket.gethostname() or 'localhost'}:{os.getppid()}"[:_MAX_JOB]


def rank_number(identity: Identity) -> int:
    """The rank a watcher shows: the launcher's (``identity.rank``), else the pid."""
    return identity.rank if identity.rank is not None else identity.pid


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    """One rank's connection file. The constructor checks every field's invariant."""

    #: The job (:func:`job_id`): a non-empty str of at most 256 characters.
    job: str
    #: The rank shown (:func:`rank_number`): an int >= 0.
    rank: int
    #: The address the rank's sockets are bound to (an IP address or host name), non-empty.
    address: str
    #: The port of the samples (a ZeroMQ PUB socket), in [1, 65535].
    publish_port: int
    #: The port of the requests (a ZeroMQ ROUTER socket), in [1, 65535].
    request_port: int
    #: The HMAC-SHA256 key of every message (16 to 128 bytes).
    key: bytes
    #: The rank's process (host, pid, rank, world size); ``identity.pid`` is the writer's pid.
    identity: Identity
    #: When the rank started publishing: seconds since the epoch, finite.
    started: float
    #: The file it was read from ("" before it is written).
    path: str = ""

    def __post_init__(self) -> None:
        if type(self.job) is not str or not 0 < len(self.job) <= _MAX_JOB:
            raise ValueError(f"connection job is {self.job!r:.60}, expected a non-empty str "
                             f"of at most {_MAX_JOB} characters")
        if type(self.rank) is not int or self.rank < 0:
            raise ValueError(f"connection rank is {self.rank!r:.40}, expected an int >= 0")
        if type(self.address) is not str or not 0 < len(self.address) <= 1024:
            raise ValueError(f"connection address is {self.address!r:.60}, expected a "
                             "non-empty str")
        for name in ("publish_port", "request_port"):
            port = getattr(self, name)
            if type(port) is not int or not 0 < port < 65536:
                raise ValueError(f"connection {name} is {port!r:.40}, expected a port "
                                 "in [1, 65535]")
        if type(self.key) is not bytes or not 16 <= len(self.key) <= 128:
            raise ValueError("connection key is not 16 to 128 bytes")
        if type(self.started) not in (int, float) or not math.isfinite(self.started):
            raise ValueError(f"connection started is {self.started!r:.40}, expected finite "
                             "seconds")

    @property
    def pid(self) -> int:
        """The rank's process id."""
        return self.identity.pid

    def endpoint(self, port: int) -> str:
        """``tcp://address:port`` (IPv6 addresses in brackets)."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"tcp://{host}:{port}"

    def file_name(self) -> str:
        """The file's name in the directory: ``rank-<rank>-<job digest>-<pid>.json``."""
        digest = hashlib.sha256(self.job.encode()).hexdigest()[:12]
        return f"rank-{self.rank}-{digest}-{self.pid}{_SUFFIX}"

    def to_json(self) -> bytes:
        """The file's content."""
        return json.dumps({
            "kind": _KIND, "version": _VERSION, "job": self.job, "rank": self.rank,
            "address": self.address, "publish_port": self.publish_port,
            "request_port": self.request_port, "signature_scheme": "hmac-sha256",
            "key": self.key.hex(), "pid": self.pid, "started": self.started,
            "identity": self.identity.to_dict()}, indent=1).encode()

    def write(self, directory: str | os.PathLike[str]) -> str:
        """Write the file into ``directory`` (created if needed) atomically, readable by
        its owner only; returns its path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(os.fspath(directory), self.file_name())
        try:  # created 0o600 first: the atomic rewrite keeps the target's mode
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            os.chmod(path, 0o600)
        write_bytes_atomic(path, self.to_json())
        return path


def read_connection(path: str | os.PathLike[str]) -> ConnectionInfo:
    """Read and check one connection file.

    Raises
    ------
    ValueError
        Larger than :data:`MAX_FILE_BYTES`, not JSON, not a cudalab cluster file, or a field
        malformed (the message names the file and the field).
    OSError
        It cannot be read.
    """
    name = os.fspath(path)
    with open(name, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"connection file {name!r}: larger than {MAX_FILE_BYTES:,} bytes")
    raw = decode_json(data, f"connection file {name!r}", MAX_FILE_BYTES)
    if not isinstance(raw, dict) or raw.get("kind") != _KIND:
        raise ValueError(f"connection file {name!r}: not a cudalab cluster connection file")
    if raw.get("version") != _VERSION:
        raise ValueError(f"connection file {name!r}: version {raw.get('version')!r:.20}, "
                         f"this cudalab reads version {_VERSION}")
    if raw.get("signature_scheme") != "hmac-sha256":
        raise ValueError(f"connection file {name!r}: signature scheme "
                         f"{raw.get('signature_scheme')!r:.40}, expected 'hmac-sha256'")
    try:
        identity = Identity.from_dict(raw.get("identity"), f"connection file {name!r}: identity")
        key_text = raw.get("key")
        if not isinstance(key_text, str):
            raise ValueError(f"connection file {name!r}: key is not hex text")
        try:
            key = bytes.fromhex(key_text)
        except ValueError:
            raise ValueError(f"connection file {name!r}: key is not hex text") from None
        if raw.get("pid") != identity.pid:
            raise ValueError(f"connection file {name!r}: pid {raw.get('pid')!r:.20} is not "
                             f"the identity's ({identity.pid})")
        return ConnectionInfo(job=raw.get("job"), rank=raw.get("rank"),  # type: ignore[arg-type]
                              address=raw.get("address"),  # type: ignore[arg-type]
                              publish_port=raw.get("publish_port"),  # type: ignore[arg-type]
                              request_port=raw.get("request_port"),  # type: ignore[arg-type]
                              key=key, identity=identity,
                              started=raw.get("started"), path=name)  # type: ignore[arg-type]
    except ValueError as exc:
        text = str(exc)
        raise ValueError(text if name in text else f"connection file {name!r}: {text}") from None


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (``kill(pid, 0)``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    except OSError:
        return False
    return True


def is_local(info: ConnectionInfo) -> bool:
    """Whether ``info``'s rank runs on this host."""
    return info.identity.host == (socket.gethostname() or "localhost")


class Scan(NamedTuple):
    """What :func:`scan` found in a cluster directory."""

    live: list[ConnectionInfo]  # readable files whose process may be alive
    stale: list[ConnectionInfo]  # files of processes of this host that are gone
    bad: list[tuple[str, str]]  # (path, why) of files that are not readable connection files


def scan(directory: str | os.PathLike[str]) -> Scan:
    """Read every connection file (``*.json``) of ``directory`` (none if it does not exist)."""
    live: list[ConnectionInfo] = []
    stale: list[ConnectionInfo] = []
    bad: list[tuple[str, str]] = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return Scan(live, stale, bad)
    for entry in names:
        if not entry.endswith(_SUFFIX) or entry.startswith("."):
            continue
        path = os.path.join(os.fspath(directory), entry)
        try:
            info = read_connection(path)
        except FileNotFoundError:  # removed meanwhile: its rank stopped
            continue
        except (OSError, ValueError) as exc:
            bad.append((path, str(exc)))
            continue
        (live if not is_local(info) or pid_alive(info.pid) else stale).append(info)
    return Scan(live, stale, bad)
