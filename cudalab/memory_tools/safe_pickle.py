"""The one bounded unpickler of cudalab's files: snapshots and trace pickles from strangers.

Three bounds, each refused with a :class:`SnapshotLoadError` that says which:

* **No code.** :class:`RestrictedUnpickler` builds only what pickle opcodes build by
  themselves: any reference to a class or function (GLOBAL, STACK_GLOBAL, INST, OBJ, EXT*)
  and every persistent id is refused, so loading a file cannot execute code.
* **No deep nesting.** CPython hashes a tuple (a dict key, a set element) recursively in C
  with no depth check: a 150 KB pickle of nested tuples used as a key overflows the C stack
  and the interpreter dies of SIGSEGV inside ``pickle.load``. :func:`unpickle` counts the
  tuple opcodes first (a bound on how deep tuples can nest): a pickle with few (every
  snapshot) loads directly; one with many loads on a thread whose stack holds them all and
  is refused if nested deeper than :data:`MAX_NESTING` containers, or, where no such thread
  starts, is checked opcode by opcode (:func:`check_nesting`, no object built) first.
  Real snapshots nest about 7 deep.
* **No endless input.** :func:`read_bounded` reads at most :func:`max_snapshot_bytes` bytes
  (default :data:`DEFAULT_MAX_SNAPSHOT_BYTES`, 4 GiB; the environment variable
  :data:`MAX_SNAPSHOT_BYTES_ENV`, ``CUDALAB_MAX_SNAPSHOT_BYTES``, or a ``max_bytes``
  argument of the loaders changes it), in chunks, so a gzip bomb is refused once the limit
  is passed. A snapshot that does not start with a pickle opcode (``/dev/zero``) is refused
  after its first chunk (:func:`check_pickle_start`), and memory running out before the
  limit (an address-space limit) is a SnapshotLoadError too, never a bare MemoryError.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
from collections.abc import Callable, Iterator
from itertools import compress
from typing import Any

from cudalab._units import GiB, parse_size

__all__ = [
    "DEFAULT_MAX_SNAPSHOT_BYTES",
    "MAX_NESTING",
    "MAX_SNAPSHOT_BYTES_ENV",
    "RestrictedUnpickler",
    "SnapshotLoadError",
    "check_nesting",
    "container_levels",
    "max_snapshot_bytes",
    "read_bounded",
    "read_path_bounded",
    "check_pickle_start",
    "READ_CHUNK",
    "unpickle",
]


class SnapshotLoadError(ValueError):
    """A file is not a loadable memory snapshot (refused, truncated, corrupt, too large,
    too deeply nested, wrong content or malformed entries)."""


#: The environment variable with the largest snapshot or trace file cudalab reads (bytes,
#: or a size such as ``"512MiB"``, ``"8g"``).
MAX_SNAPSHOT_BYTES_ENV = "CUDALAB_MAX_SNAPSHOT_BYTES"
#: The default of :func:`max_snapshot_bytes`: 4 GiB.
DEFAULT_MAX_SNAPSHOT_BYTES = 4 * GiB
#: The deepest container nesting a pickle may have (snapshots nest about 6 deep).
MAX_NESTING = 200
#: Bytes read at a time (the most a stream that does not start like a pickle costs).
READ_CHUNK = 16 << 20


def max_snapshot_bytes(max_bytes: int | str | None = None) -> int:
    """The largest snapshot or trace file to read, in bytes.

    Parameters
    ----------
    max_bytes : int or str, optional
        An explicit limit (bytes, or a size such as ``"64MiB"``). Default: the environment
        variable ``CUDALAB_MAX_SNAPSHOT_BYTES`` if set, else 4 GiB.

    Returns
    -------
    int
        The limit in bytes (at least 1).

    Raises
    ------
    ValueError
        The limit (argument or environment variable, which the message names) is not a size
        of at least one byte.
    """
    if max_bytes is not None:
        return parse_size(max_bytes, what="max_bytes", allow_zero=False)
    text = os.environ.get(MAX_SNAPSHOT_BYTES_ENV)
    if text is None or not text.strip():
        return DEFAULT_MAX_SNAPSHOT_BYTES
    return parse_size(text.strip(), what=MAX_SNAPSHOT_BYTES_ENV, allow_zero=False)


def _too_large(what: str, limit: int) -> SnapshotLoadError:
    return SnapshotLoadError(
        f"cannot read {what}: it is larger than the limit of {limit:,} bytes (set "
        f"{MAX_SNAPSHOT_BYTES_ENV}, or pass max_bytes=, to read larger files)")


def read_bounded(f: Any, what: str, limit: int,
                 head_check: Callable[[bytes], None] | None = None) -> bytes:
    """All of the binary file object ``f``, or SnapshotLoadError once more than ``limit``
    bytes came (read in chunks: an endless stream costs ``limit`` bytes at most), or once
    memory runs out before that (an address-space limit below ``limit``). ``head_check``
    is called with the first chunk (:data:`READ_CHUNK` bytes at most), to refuse a stream
    that cannot be what is read before reading the rest."""
    parts: list[bytes] = []
    total = 0
    try:
        while True:
            chunk = f.read(min(READ_CHUNK, limit + 1 - total))
            if isinstance(chunk, str):
                raise SnapshotLoadError(f"cannot read {what}: open the file in binary mode "
                                        "('rb')")
            if not chunk:
                break
            if head_check is not None and not parts:
                head_check(chunk)
            parts.append(bytes(chunk))
            total += len(chunk)
            if total > limit:
                raise _too_large(what, limit)
        return b"".join(parts)
    except MemoryError:
        parts.clear()  # (the traceback keeps this frame: let the memory go now)
        raise SnapshotLoadError(
            f"cannot read {what}: ran out of memory after {total:,} bytes, below the limit of "
            f"{limit:,} bytes (an endless stream, or a file larger than this process may "
            f"hold; set {MAX_SNAPSHOT_BYTES_ENV}, or pass max_bytes=, to stop sooner)") from None


def read_path_bounded(path: Any, what: str, limit: int,
                      head_check: Callable[[bytes], None] | None = None) -> bytes:
    """The file at ``path`` (checked against ``limit`` by its size first, when it has one);
    ``head_check`` as for :func:`read_bounded`."""
    with open(path, "rb") as f:
        try:
            size = os.fstat(f.fileno()).st_size
        except OSError:
            size = 0
        if size > limit:
            raise _too_large(what, limit)
        return read_bounded(f, what, limit, head_check)


_PICKLE_FIRST_BYTES: frozenset[int] | None = None  # every pickle opcode's byte, built once


def check_pickle_start(what: str) -> Callable[[bytes], None]:
    """A ``head_check`` for :func:`read_bounded`: SnapshotLoadError unless the data starts
    with a pickle opcode (``/dev/zero`` is refused after its first chunk)."""

    def check(head: bytes) -> None:
        global _PICKLE_FIRST_BYTES
        if _PICKLE_FIRST_BYTES is None:
            import pickletools

            _PICKLE_FIRST_BYTES = frozenset(op.code.encode("latin-1")[0]
                                            for op in pickletools.opcodes)
        if head and head[0] not in _PICKLE_FIRST_BYTES:
            raise SnapshotLoadError(f"cannot read {what}: it is not a pickle (it starts with "
                                    f"byte 0x{head[0]:02x}, which no pickle starts with)")

    return check


def gunzip_bounded(data: bytes, what: str, limit: int) -> bytes:
    """``data`` decompressed, or SnapshotLoadError once the output passes ``limit`` bytes
    (a gzip bomb is stopped there); OSError/EOFError for a corrupt stream."""
    import gzip

    with gzip.GzipFile(fileobj=io.BytesIO(data)) as g:
        return read_bounded(g, what, limit)


# --------------------------------------------------------------------------- nesting
# What each opcode does to the unpickler's stack (see pickletools for the opcodes), as one
# small int per opcode byte, so the scan costs one table lookup per opcode.
(_BAD, _SCALAR, _CONTAINER, _MEMOIZE, _GET, _PUT, _MARK, _APPEND, _SETITEM, _BUILD_MARK,
 _ADD_MARK, _TUPLE1, _TUPLE2, _TUPLE3, _POP, _POP_MARK, _DUP, _STOP, _NOTHING,
 _REFUSED) = range(20)
_KIND = [_BAD] * 256
for _c in b"NJKMGIULSVFXTBC\x88\x89\x8a\x8b\x8c\x8d\x8e\x96\x97":
    _KIND[_c] = _SCALAR
for _c in b"]})\x8f":  # empty list, dict, tuple, set
    _KIND[_c] = _CONTAINER
for _c in b"hjg":
    _KIND[_c] = _GET
for _c in b"qrp":
    _KIND[_c] = _PUT
for _c in b"tl\x91d":  # TUPLE, LIST, FROZENSET, DICT: a new container of the items
    _KIND[_c] = _BUILD_MARK
for _c in b"eu\x90":  # APPENDS, SETITEMS, ADDITEMS: the items go into the one below
    _KIND[_c] = _ADD_MARK
for _c in b"\x80\x95\x98":  # PROTO, FRAME, READONLY_BUFFER
    _KIND[_c] = _NOTHING
# a class, a function or a persistent id: the unpickler refuses them (or fails at them)
for _c in b"ciPQRbo\x81\x82\x83\x84\x92\x93":
    _KIND[_c] = _REFUSED
(_KIND[0x94], _KIND[ord("(")], _KIND[ord("a")], _KIND[ord("s")], _KIND[0x85], _KIND[0x86],
 _KIND[0x87], _KIND[ord("0")], _KIND[ord("1")], _KIND[ord("2")], _KIND[ord(".")]) = (
    _MEMOIZE, _MARK, _APPEND, _SETITEM, _TUPLE1, _TUPLE2, _TUPLE3, _POP, _POP_MARK, _DUP, _STOP)
# the arguments: fixed size (bytes), length-prefixed (-size of the length), text (-9)
_ARG = [0] * 256
for _ops, _k in ((b"\x80Khq", 1), (b"M", 2), (b"Jjr", 4), (b"\x95G", 8),
                 (b"\x8cCU\x8a", -1), (b"XTB\x8b", -4), (b"\x8d\x8e\x96", -8),
                 (b"ILSVFgp", -9)):
    for _c in _ops:
        _ARG[_c] = _k
del _c, _k, _ops


def _corrupt(what: str, at: int, n: int) -> SnapshotLoadError:
    return SnapshotLoadError(f"cannot read {what}: truncated or corrupt pickle (at byte {at} "
                             f"of {n})")


def check_nesting(data: bytes, what: str, limit: int = MAX_NESTING) -> None:
    """Refuse a pickle that nests containers deeper than ``limit``, without building it.

    The scan follows the unpickler's stack with one depth per object (0 for a plain value,
    1 + the deepest item for a container; the memo keeps the depth an object had when it was
    stored, which is exact for tuples and frozensets, the containers CPython hashes
    recursively). Opcodes that need a class end the scan: the unpickler refuses them.

    Parameters
    ----------
    data : bytes
        The pickle.
    what : str
        The file, for the messages.
    limit : int, optional
        The deepest nesting accepted (default :data:`MAX_NESTING`).

    Raises
    ------
    SnapshotLoadError
        Nested deeper than ``limit``, or a truncated or corrupt opcode stream (the byte
        offset is named).
    """
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    n = len(data)
    i = 0
    kinds, args = _KIND, _ARG
    from_bytes = int.from_bytes
    try:
        while i < n:
            op = data[i]
            kind = kinds[op]
            k = args[op]
            i += 1
            if kind == _SCALAR:
                if k > 0:
                    i += k
                elif k == -1:
                    i += 1 + data[i]
                elif k == -9:
                    i = data.index(b"\n", i) + 1
                elif k:
                    i += -k + from_bytes(data[i:i - k], "little")
                stack.append(0)
                continue
            if kind == _MEMOIZE:
                memo[len(memo)] = stack[-1]
                continue
            if kind == _GET or kind == _PUT:
                if k == 1:
                    idx = data[i]
                    i += 1
                elif k == 4:
                    idx = from_bytes(data[i:i + 4], "little")
                    i += 4
                else:
                    j = data.index(b"\n", i)
                    idx = int(data[i:j])
                    i = j + 1
                if kind == _GET:
                    stack.append(memo[idx])
                else:
                    memo[idx] = stack[-1]
                continue
            if kind == _CONTAINER:
                stack.append(1)
                continue
            if kind == _MARK:
                marks.append(len(stack))
                continue
            if kind == _BUILD_MARK or kind == _ADD_MARK:
                m = marks.pop()
                depth = 1 + max(stack[m:], default=0)
                del stack[m:]
                if kind == _BUILD_MARK:
                    stack.append(depth)
                elif depth > stack[-1]:
                    stack[-1] = depth
            elif kind == _APPEND:
                depth = 1 + stack.pop()
                if depth > stack[-1]:
                    stack[-1] = depth
            elif kind == _SETITEM:
                depth = 1 + max(stack.pop(), stack.pop())
                if depth > stack[-1]:
                    stack[-1] = depth
            elif kind == _TUPLE1:
                stack[-1] += 1
            elif kind == _TUPLE2 or kind == _TUPLE3:
                c = 2 if kind == _TUPLE2 else 3
                if len(stack) < c:
                    raise IndexError
                depth = 1 + max(stack[-c:])
                del stack[-c:]
                stack.append(depth)
            elif kind == _NOTHING:
                i += k
                continue
            elif kind == _POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()
                else:
                    stack.pop()
                continue
            elif kind == _POP_MARK:
                del stack[marks.pop():]
                continue
            elif kind == _DUP:
                stack.append(stack[-1])
                continue
            elif kind == _STOP:
                if i > n:
                    raise IndexError
                return
            elif kind == _REFUSED:
                return  # the unpickler refuses this opcode (or fails at it) with its message
            else:
                raise SnapshotLoadError(
                    f"cannot read {what}: truncated or corrupt pickle (unknown opcode "
                    f"0x{op:02x} at byte {i - 1})")
            if stack[-1] > limit:
                raise SnapshotLoadError(
                    f"cannot read {what}: nested too deeply (more than {limit} levels of "
                    f"containers, at byte {i - 1}); snapshots nest a few levels deep")
    except (IndexError, KeyError, ValueError) as exc:
        if isinstance(exc, SnapshotLoadError):
            raise
        raise _corrupt(what, min(i, n), n) from None
    raise SnapshotLoadError(f"cannot read {what}: truncated pickle (it ends before its STOP "
                            "opcode)")


# --------------------------------------------------------------------------- unpickling
class RestrictedUnpickler(pickle.Unpickler):
    """Builds only what pickle opcodes build by themselves: no classes, no functions.

    The one unpickler of cudalab's files (snapshots and trace pickles alike): every class or
    function reference and every persistent id raises :class:`SnapshotLoadError` naming
    ``what``. Use :func:`unpickle`, which bounds the nesting first.
    """

    def __init__(self, file: Any, what: str):
        super().__init__(file)
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotLoadError(
            f"refusing to load {self._what}: the pickle references {module}.{name}; "
            "snapshots contain only plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise SnapshotLoadError(
            f"refusing to load {self._what}: the pickle uses a persistent id ({pid!r:.60}); "
            "snapshots contain only plain data")


#: Opcode bytes that build a tuple (TUPLE1-3, TUPLE): their count bounds how deeply tuples
#: nest, which is what CPython hashes recursively in C.
_TUPLE_OPCODES = b"\x85\x86\x87t"
#: Tuples nested this deep hash safely on the main thread's and glibc's default thread stacks
#: (8 MiB hold ~50,000 levels; this many take about 3 MiB).
_SAFE_TUPLE_DEPTH = 20_000
_STACK_PER_LEVEL = 256  # bytes of C stack per level of tuple hashing, with a margin
_MAX_THREAD_STACK = 1 << 30
_stack_lock = threading.Lock()


def container_levels(obj: Any, containers: frozenset[type], limit: int
                     ) -> Iterator[tuple[list[Any], list[type]]]:
    """``obj``'s levels breadth first: for each, the objects the level's containers refer to
    and their types (no recursion; one C-level pass, ``gc.get_referents``, per level).

    Parameters
    ----------
    obj
        The root (level 0 is ``[obj]``).
    containers : frozenset of type
        The types walked into; a container shared by several (a stack's frames) is walked
        once.
    limit : int
        The most levels yielded (a structure that holds itself is endless).
    """
    import gc

    is_container = containers.__contains__
    level = [obj]
    for _ in range(limit):
        if not level:
            return
        refs = gc.get_referents(*level)
        types = list(map(type, refs))
        yield refs, types
        level = list(compress(refs, map(is_container, types)))
        level = list(dict(zip(map(id, level), level)).values())  # shared ones once


_NESTING_CONTAINERS = frozenset({dict, list, tuple, set, frozenset})


def _nesting_levels(obj: Any, limit: int) -> int:
    """How many levels of containers ``obj`` has, or ``limit + 1`` once deeper."""
    return sum(1 for _ in container_levels(obj, _NESTING_CONTAINERS, limit + 1))


def _load_on_big_stack(data: bytes, what: str, stack_bytes: int) -> Any:
    """The restricted unpickler on a thread with ``stack_bytes`` of C stack (None when no
    such thread can be started)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = RestrictedUnpickler(io.BytesIO(data), what).load()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = exc

    with _stack_lock:  # (the size applies to threads started while it is set)
        try:
            old = threading.stack_size(stack_bytes)
        except (ValueError, RuntimeError):
            return None
        try:
            thread = threading.Thread(target=run, name="cudalab-unpickle", daemon=True)
            thread.start()
        except RuntimeError:  # the stack could not be mapped
            return None
        finally:
            threading.stack_size(old)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out


def unpickle(data: bytes, what: str) -> Any:
    """``data`` unpickled by :class:`RestrictedUnpickler`, with its nesting bounded;
    SnapshotLoadError (naming ``what``) for an empty, refused, too deeply nested, truncated
    or corrupt pickle.

    A pickle with few tuple opcodes (every snapshot) is loaded directly: its tuples cannot
    nest deep enough to matter. One with many is loaded on a thread with a C stack that
    holds all of them, and refused afterwards if nested deeper than :data:`MAX_NESTING`
    (or, where no such thread can start, checked by :func:`check_nesting` first), so no
    deeply nested tuple reaches the caller.
    """
    if not data:
        raise SnapshotLoadError(f"cannot read {what}: the file is empty")
    tuples = len(data) - len(data.translate(None, _TUPLE_OPCODES))
    try:
        if tuples <= _SAFE_TUPLE_DEPTH:
            return RestrictedUnpickler(io.BytesIO(data), what).load()
        stack = tuples * _STACK_PER_LEVEL + (32 << 20)
        out = _load_on_big_stack(data, what, stack) if stack <= _MAX_THREAD_STACK else None
        if out is None:  # no big stack: scan first (slower), then load here
            check_nesting(data, what)
            return RestrictedUnpickler(io.BytesIO(data), what).load()
        value = out["value"]
        if _nesting_levels(value, MAX_NESTING) > MAX_NESTING:
            raise SnapshotLoadError(
                f"cannot read {what}: nested too deeply (more than {MAX_NESTING} levels of "
                "containers, or a container that holds itself); snapshots nest a few levels "
                "deep")
        return value
    except SnapshotLoadError:
        raise
    except RecursionError:
        raise SnapshotLoadError(f"cannot read {what}: nested too deeply") from None
    except MemoryError:
        raise SnapshotLoadError(f"cannot read {what}: out of memory while unpickling "
                                "(a corrupt or hostile pickle)") from None
    except Exception as exc:  # noqa: BLE001 - every unpickling failure means the same here
        raise SnapshotLoadError(
            f"cannot read {what}: truncated or corrupt pickle ({type(exc).__name__}: {exc})"
        ) from exc
