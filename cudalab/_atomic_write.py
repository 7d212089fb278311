"""Atomic file writes: the one way cudalab writes a file.

:func:`atomic_write` opens a temporary file in the target's directory, yields it, and only
when the body finished without an exception flushes it, fsyncs it and renames it over the
target (``os.replace``, atomic on POSIX and Windows). On any exception, KeyboardInterrupt
included, the temporary file is removed and the target is left as it was: a failed export
never leaves a truncated or empty file where a good one was.

The new file gets the permissions the target had; a new target gets the usual ``0o666``
less the process's umask (a plain ``open(path, "w")`` would give the same), not the
``0o600`` of a temporary file. A target the process may not write (a read-only file) is
refused with PermissionError, as ``open`` would, rather than replaced. A symbolic link as target is followed: the file it points to
is replaced, the link stays.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

__all__ = ["atomic_write", "write_bytes_atomic", "create_bytes_atomic"]

#: The prefix of the temporary files (``.NAME.<random>.tmp`` beside the target).
TEMP_PREFIX = "."
TEMP_SUFFIX = ".tmp"

_MODES = ("w", "wb")


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # (elsewhere: the classic set-and-restore)
    os.umask(mask)
    return mask


def _target_mode(path: str) -> int:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", *,
                 encoding: str | None = None, newline: str | None = None) -> Iterator[IO[Any]]:
    """A file object whose content replaces ``path`` atomically when the block ends.

    Parameters
    ----------
    path : str or os.PathLike
        The file to write (created or replaced). Its directory must exist.
    mode : {"wb", "w"}
        Binary (default) or text.
    encoding, newline : str, optional
        For text mode, as :func:`open` (encoding defaults to UTF-8).

    Yields
    ------
    file object
        The temporary file, in the target's directory.

    Raises
    ------
    ValueError
        ``mode`` is not ``"wb"`` or ``"w"``.
    OSError
        The temporary file cannot be created, written or renamed (the target is unchanged).
    """
    if mode not in _MODES:
        raise ValueError(f"atomic_write: mode must be 'wb' or 'w', got {mode!r}")
    target = os.path.realpath(os.fspath(path))
    directory, name = os.path.split(target)
    if os.path.exists(target) and not os.path.isdir(target) and not os.access(target, os.W_OK):
        # a read-only file stays protected, as with open(path, "w")
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
    if mode == "w" and encoding is None:
        encoding = "utf-8"
    import tempfile  # (lazily: importing cudalab stays cheap)

    tmp = None
    try:
        try:
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{TEMP_PREFIX}{name}.",
                                       suffix=TEMP_SUFFIX)
        except OSError as exc:  # name the target, not the temporary file
            raise type(exc)(exc.errno, exc.strerror, os.fspath(path)) from None
        with os.fdopen(fd, mode, encoding=encoding, newline=newline) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _target_mode(target))
        os.replace(tmp, target)
        tmp = None
    finally:  # any exception, KeyboardInterrupt included: the target stays as it was
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path``'s content with ``data`` atomically (see :func:`atomic_write`).

    Parameters
    ----------
    path : str or os.PathLike
        The file to write.
    data : bytes-like
        Its new content.

    Raises
    ------
    OSError
        The file cannot be written (the target is unchanged).
    """
    with atomic_write(path, "wb") as f:
        f.write(data)


def create_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Create ``path`` holding ``data``, whole, only if nothing is there yet.

    The data is written to a temporary file beside ``path``, which is then hard-linked to
    ``path``: the link fails if ``path`` exists, so of several processes racing to create
    one path exactly one succeeds, and no reader ever sees a partial file. Where the
    filesystem has no hard links, the file is created with ``O_CREAT | O_EXCL`` and written
    in place (still exclusive; a reader may see it short for a moment).

    Parameters
    ----------
    path : str or os.PathLike
        The file to create. Its directory must exist.
    data : bytes-like
        Its content.

    Raises
    ------
    FileExistsError
        Something (a file, a link, a directory) is already at ``path``; it is unchanged.
    OSError
        The file cannot be written (nothing is left at ``path``).
    """
    target = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(target))
    import tempfile  # (lazily: importing cudalab stays cheap)

    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{TEMP_PREFIX}{name}.",
                                   suffix=TEMP_SUFFIX)
    except OSError as exc:  # name the target, not the temporary file
        raise type(exc)(exc.errno, exc.strerror, target) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        try:
            os.link(tmp, target)  # atomic, and fails when target exists
            return
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), target) from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV,
                                 errno.EMLINK, errno.ENOSYS):
                raise
        _create_exclusive_in_place(target, data)
    finally:  # any exception, KeyboardInterrupt included: no temporary file left
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _create_exclusive_in_place(target: str, data: bytes) -> None:
    """``O_CREAT | O_EXCL`` and write (filesystems without hard links); removed on failure."""
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        try:
            os.unlink(target)
        except OSError:
            pass
        raise
