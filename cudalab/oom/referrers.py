"""Who keeps the largest device arrays alive: Python names, output caches, tracebacks, closures.

:func:`find_referrers` finds the device arrays of one device among Python's objects
(cudalab's :class:`~cudalab.array.DeviceArray`; torch's CUDA tensors and CuPy's arrays when
those libraries are imported), groups them by the memory they share (a view keeps its base's
block), takes the largest, and names what refers to them:

==============  =====================================================================  ===========
kind            holder                                                                 disposable
==============  =====================================================================  ===========
name            a name in the user's namespace (IPython's ``user_ns`` or ``__main__``)  no
output          ``Out[n]``, ``_n``, ``_``, ``__``, ``___`` (IPython's output caches)      yes
last_result     IPython's last execution result                                         yes
traceback       a local of a frame of the last error's traceback (``sys.last_traceback``) yes
closure         a variable a function closed over                                       no
container       a list, tuple, dict or set (named after what holds it, when found)     as its holder
attribute       an attribute of some object                                             no
frame           a local of a running function                                           no
==============  =====================================================================  ===========

An array is *held by Python* when everything that refers to it is disposable: the memory is
reachable only from names the user no longer needs. :meth:`Referrers.release` drops the
holders chosen (by default the disposable ones), collects garbage and says how many bytes
came back. Referrers keep no strong reference to an array (weak references only), so the
record itself never keeps memory alive.

Cost: one pass over ``gc.get_objects()`` to find the arrays, then one ``gc.get_referrers``
call for all of them (and one more for the containers found), each a scan of the heap in C.
"""

from __future__ import annotations

import gc
import re
import sys
import traceback
import types
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cudalab._internal import format_bytes
from cudalab.array import DeviceArray

__all__ = ["Holder", "Referrers", "find_referrers"]

_OUTPUT_NAME = re.compile(r"^_{1,3}$|^_\d+$")
#: How many of the largest memory groups are looked at.
TOP = 8


@dataclass(frozen=True, slots=True)
class Holder:
    """One reference to one of the largest device arrays."""

    #: The array's description (type, dtype, shape, bytes, address).
    array: str
    #: Bytes of device memory the array keeps alive (its base's block, for a view).
    nbytes: int
    #: What refers to it, as the user would write it (``x``, ``Out[3]``, ``cache['k']``...).
    holder: str
    #: One of name, output, last_result, traceback, closure, container, attribute, frame.
    kind: str
    #: Whether dropping this reference loses nothing the user needs (see the module).
    disposable: bool
    #: Whether every reference to this array's memory is disposable.
    held_by_python: bool


class Referrers:
    """The holders of the largest device arrays of one device (see the module).

    Attributes
    ----------
    rows : tuple of Holder
        One per reference, largest memory first.
    held_by_python : int
        Bytes of the arrays that only disposable references keep alive.
    scanned : int
        Device arrays found in the process (all sizes).
    note : str
        What could not be looked at ("" when nothing).
    """

    def __init__(self, rows: list[Holder], actions: list[tuple[Holder, Any]], scanned: int,
                 note: str = ""):
        self.rows: tuple[Holder, ...] = tuple(rows)
        self._actions = actions
        self.scanned = scanned
        self.note = note
        seen: dict[str, int] = {}
        for r in rows:
            if r.held_by_python:
                seen[r.array] = r.nbytes
        self.held_by_python = sum(seen.values())

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Any:
        return iter(self.rows)

    def to_frame(self) -> Any:
        """The rows as a pandas DataFrame (columns: the :class:`Holder` fields)."""
        import pandas as pd

        return pd.DataFrame([{f: getattr(r, f) for f in Holder.__slots__} for r in self.rows],
                            columns=list(Holder.__slots__))

    def release(self, choose: str | Iterable[str] = "disposable", *,
                empty_cache: bool = True) -> dict[str, Any]:
        """Drop the chosen references and collect garbage.

        Parameters
        ----------
        choose : "disposable", "all" or iterable of str
            Which holders: the disposable ones (default), every one that can be dropped
            (names too: ``del x``), or those whose ``holder`` text is given.
        empty_cache : bool, optional
            Then return the cached free memory of cudalab's allocator (and torch's) to the
            driver (default True).

        Returns
        -------
        dict
            ``released`` (holder texts dropped), ``kept`` (holder text -> why not),
            ``freed`` (bytes of cudalab's and torch's allocated memory that came back).
        """
        if isinstance(choose, str) and choose not in ("disposable", "all"):
            choose = [choose]
        before = _allocated()
        released: list[str] = []
        kept: dict[str, str] = {}
        for row, action in self._actions:
            wanted = (row.disposable if choose == "disposable" else True if choose == "all"
                      else row.holder in set(choose))  # type: ignore[arg-type]
            if not wanted:
                continue
            if action is None:
                kept[row.holder] = f"a {row.kind} cannot be dropped from here"
                continue
            try:
                done = action()
            except Exception as exc:  # a namespace that changed since: say so
                kept[row.holder] = f"{type(exc).__name__}: {exc}"
                continue
            if done:
                released.append(row.holder)
            else:
                kept[row.holder] = "it no longer refers to the array"
        gc.collect()
        if empty_cache:
            _empty_caches()
        freed = max(0, before - _allocated())
        return {"released": released, "kept": kept, "freed": freed}

    def _repr_html_(self) -> str:
        import html

        if not self.rows:
            return "<p>no device arrays found in Python's objects</p>"
        body = "".join(
            f"<tr><td>{html.escape(r.array)}</td><td>{html.escape(r.holder)}</td>"
            f"<td>{r.kind}</td><td>{'yes' if r.disposable else 'no'}</td></tr>"
            for r in self.rows)
        return ("<table><tr><th>array</th><th>held by</th><th>kind</th><th>disposable</th>"
                f"</tr>{body}</table>")


def _allocated() -> int:
    from cudalab import memory

    total = memory.memory_allocated()
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            total += int(torch.cuda.memory_allocated())
    except Exception:
        pass
    return total


def _empty_caches() -> None:
    from cudalab import memory

    memory.empty_cache()
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:
        pass


# ============================================================================ finding arrays
def _groups(device: int) -> tuple[dict[int, tuple[int, str, list[Any]]], int]:
    """Device arrays of ``device`` grouped by the memory they keep: key -> (bytes, text,
    objects)."""
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None) if torch is not None else None
    cupy = sys.modules.get("cupy")
    cupy_array = getattr(cupy, "ndarray", None) if cupy is not None else None
    groups: dict[int, tuple[int, str, list[Any]]] = {}
    scanned = 0
    # (type checks only: isinstance would read __class__, which some module-level objects
    # answer with a deprecation warning)
    for o in gc.get_objects():
        kind = type(o)
        if issubclass(kind, DeviceArray):
            if getattr(o, "device_index", None) != device or not hasattr(o, "byte_count"):
                continue  # another device's, or one whose construction failed
            root = o
            while isinstance(getattr(root, "owner", None), DeviceArray):
                root = root.owner
            key = id(root)
            nbytes = root.byte_count
            text = (f"cudalab {root.element_dtype} {tuple(root.dims)} "
                    f"{format_bytes(nbytes)} at {root.ptr:#x}")
        elif tensor is not None and issubclass(kind, tensor):
            try:
                if not o.is_cuda or o.device.index != device:
                    continue
                storage = o.untyped_storage()
                key = int(storage.data_ptr())
                nbytes = int(storage.nbytes())
                text = f"torch {o.dtype} {tuple(o.shape)} {format_bytes(nbytes)} at {key:#x}"
            except Exception:
                continue
        elif cupy_array is not None and issubclass(kind, cupy_array):
            try:
                if o.device.id != device:
                    continue
                mem = o.data.mem
                key = id(mem)
                nbytes = int(mem.size)
                text = f"cupy {o.dtype} {tuple(o.shape)} {format_bytes(nbytes)} at {o.data.ptr:#x}"
            except Exception:
                continue
        else:
            continue
        scanned += 1
        if not nbytes:
            continue
        got = groups.get(key)
        if got is None:
            groups[key] = (nbytes, text, [o])
        else:
            got[2].append(o)
    return groups, scanned


def _traceback_frames(errors: Iterable[BaseException | None]) -> set[int]:
    frames: set[int] = set()
    seen: set[int] = set()
    todo = [e for e in errors if e is not None]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            frames.add(id(tb.tb_frame))
            tb = tb.tb_next
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append(nxt)
    last_tb = getattr(sys, "last_traceback", None)
    while last_tb is not None:
        frames.add(id(last_tb.tb_frame))
        last_tb = last_tb.tb_next
    return frames


def _last_errors(error: BaseException | None) -> list[BaseException]:
    out = [e for e in (error, getattr(sys, "last_value", None), getattr(sys, "last_exc", None))
           if isinstance(e, BaseException)]
    return out


def _shell() -> Any:
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    return get() if callable(get) else None


def _clear_tracebacks(errors: list[BaseException]) -> bool:
    cleared = False
    for e in errors:
        todo = [e]
        seen: set[int] = set()
        while todo:
            x = todo.pop()
            if id(x) in seen:
                continue
            seen.add(id(x))
            if x.__traceback__ is not None:
                traceback.clear_frames(x.__traceback__)
                x.__traceback__ = None
                cleared = True
            todo.extend(n for n in (x.__cause__, x.__context__) if n is not None)
    if getattr(sys, "last_traceback", None) is not None:
        traceback.clear_frames(sys.last_traceback)
        sys.last_traceback = None
        cleared = True
    return cleared


# ============================================================================ naming holders
def find_referrers(device: int, error: BaseException | None = None, top: int = TOP
                   ) -> Referrers:
    """The holders of the ``top`` largest device arrays of ``device`` (see the module).

    Parameters
    ----------
    device : int
        The device whose arrays are looked at.
    error : BaseException, optional
        The out-of-memory error (its traceback's frames count as disposable).
    top : int, optional
        How many of the largest memory groups to name holders for.

    Returns
    -------
    Referrers
    """
    groups, scanned = _groups(device)
    largest = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    del groups
    shell = _shell()
    user_ns: Any = getattr(shell, "user_ns", None)
    main = sys.modules.get("__main__")
    if user_ns is None:
        user_ns = getattr(main, "__dict__", None)
    # every dict a user's name can live in: IPython's namespaces, __main__'s, builtins'
    hidden = getattr(shell, "user_ns_hidden", None)  # IPython copies _, _N there too
    namespaces = {id(d): d for d in (user_ns, getattr(shell, "user_global_ns", None), hidden,
                                     getattr(main, "__dict__", None),
                                     getattr(sys.modules.get("builtins"), "__dict__", None))
                  if isinstance(d, dict)}
    out_cache: Any = user_ns.get("Out") if isinstance(user_ns, dict) else None
    if not isinstance(out_cache, dict):
        out_cache = None
    errors = _last_errors(error)
    tb_frames = _traceback_frames(errors)
    displayhook = getattr(shell, "displayhook", None)
    last_result = getattr(shell, "last_execution_result", None)
    # (their attributes may live in their __dict__, which is what refers to the arrays)
    hook_dict = getattr(displayhook, "__dict__", None) if displayhook is not None else None
    result_dict = getattr(last_result, "__dict__", None) if last_result is not None else None
    targets: list[Any] = []
    owner_of: dict[int, int] = {}  # id(array object) -> group index
    for gi, (_, (_, _, objs)) in enumerate(largest):
        for o in objs:
            targets.append(o)
            owner_of[id(o)] = gi
    internal = {id(targets), id(largest), id(owner_of), id(sys._getframe())}
    for _, (_, _, objs) in largest:
        internal.add(id(objs))
    refs = [r for r in gc.get_referrers(*targets) if id(r) not in internal] if targets else []
    found: list[list[tuple[str, str, bool, Any]]] = [[] for _ in largest]
    containers: list[tuple[Any, int, str]] = []  # (container, group, key text)

    def hit(r: Any) -> list[tuple[int, Any]]:
        """(group index, the target object) for each target ``r`` refers to."""
        return [(owner_of[id(x)], x) for x in gc.get_referents(r) if id(x) in owner_of]

    for r in refs:
        if id(r) in owner_of:  # a view of the same memory (or another group's array)
            continue
        if id(r) in namespaces and r is namespaces[id(r)]:
            where = " (IPython's hidden namespace)" if r is hidden else ""
            for name, value in list(r.items()):
                if id(value) in owner_of:
                    gi = owner_of[id(value)]
                    if _OUTPUT_NAME.match(name) or (r is hidden and name != "_oh"):
                        found[gi].append((name + where, "output", True,
                                          _drop_name(r, name, value)))
                    else:
                        found[gi].append((name, "name", False, _drop_name(r, name, value)))
        elif r is out_cache:
            for k, value in list(r.items()):
                if id(value) in owner_of:
                    found[owner_of[id(value)]].append(
                        (f"Out[{k}]", "output", True, _drop_out(r, k, value, user_ns)))
        elif isinstance(r, types.FrameType):
            names = [(n, v) for n, v in r.f_locals.items() if id(v) in owner_of]
            in_tb = id(r) in tb_frames
            for n, v in names:
                where = f"{r.f_code.co_name}() local {n!r}"
                if in_tb:
                    found[owner_of[id(v)]].append(
                        (f"traceback frame {where}", "traceback", True,
                         lambda errors=errors: _clear_tracebacks(errors)))
                else:
                    found[owner_of[id(v)]].append((f"running frame {where}", "frame", False,
                                                   None))
        elif isinstance(r, types.CellType):
            for gi, _ in hit(r):
                found[gi].append(("a closure variable", "closure", False, None))
        elif r is displayhook or (hook_dict is not None and r is hook_dict):
            for name in ("_", "__", "___"):
                value = getattr(displayhook, name, None)
                if id(value) in owner_of:
                    found[owner_of[id(value)]].append(
                        (f"displayhook.{name}", "output", True,
                         _drop_attr(displayhook, name, value)))
        elif last_result is not None and (r is last_result or r is result_dict):
            for gi, x in hit(r):
                found[gi].append(("the last cell's result", "last_result", True,
                                  _drop_attr(last_result, "result", x)))
        elif isinstance(r, (list, tuple, dict, set, frozenset)):
            for gi, x in hit(r):
                key = _key_in(r, x)
                containers.append((r, gi, key))
        else:
            for gi, x in hit(r):
                attr = next((k for k, v in _attributes(r) if v is x), None)
                text = (f"attribute {attr!r} of a {type(r).__name__}" if attr else
                        f"a {type(r).__module__}.{type(r).__qualname__}")
                found[gi].append((text, "attribute", False, None))
    # containers: named after what holds them (one more heap scan for all of them)
    if containers:
        internal.update({id(containers), id(refs), id(found)})
        parents = [p for p in gc.get_referrers(*[c for c, _, _ in containers])
                   if id(p) not in internal]
        for c, gi, key in containers:
            label, disposable = _container_label(c, key, parents, namespaces, out_cache,
                                                 tb_frames)
            found[gi].append((label, "container", disposable, None))
    rows: list[Holder] = []
    actions: list[tuple[Holder, Any]] = []
    for gi, (_, (nbytes, text, _)) in enumerate(largest):
        holders = found[gi]
        held = bool(holders) and all(d for _, _, d, _ in holders)
        if not holders:
            holders = [("nothing Python can see (held by a C extension or a cycle)", "other",
                        False, None)]
        for label, kind, disposable, action in holders:
            row = Holder(text, nbytes, label, kind, disposable, held)
            rows.append(row)
            actions.append((row, action))
    note = "" if targets else "no device array of this device was found in Python's objects"
    return Referrers(rows, actions, scanned, note)


def _attributes(o: Any) -> list[tuple[str, Any]]:
    try:
        return list(vars(o).items())
    except TypeError:
        out = []
        for name in getattr(type(o), "__slots__", ()):
            try:
                out.append((name, getattr(o, name)))
            except AttributeError:
                pass
        return out


def _key_in(container: Any, x: Any) -> str:
    if isinstance(container, dict):
        for k, v in container.items():
            if v is x:
                return f"[{k!r}]"
        return "[key]"
    if isinstance(container, (list, tuple)):
        for i, v in enumerate(container):
            if v is x:
                return f"[{i}]"
    return ""


def _container_label(c: Any, key: str, parents: list[Any], namespaces: dict[int, Any],
                     out_cache: Any, tb_frames: set[int]) -> tuple[str, bool]:
    kind = type(c).__name__
    for p in parents:
        ns: dict[str, Any] | None = namespaces.get(id(p))
        if ns is not None and ns is p:
            for name, value in ns.items():
                if value is c:
                    return f"{name}{key}", bool(_OUTPUT_NAME.match(name))
        if p is out_cache:
            for k, value in p.items():
                if value is c:
                    return f"Out[{k}]{key}", True
        if isinstance(p, types.FrameType) and c in p.f_locals.values():
            name = next(n for n, v in p.f_locals.items() if v is c)
            where = "traceback" if id(p) in tb_frames else "running"
            return f"{where} frame {p.f_code.co_name}() local {name}{key}", where == "traceback"
    return f"a {kind}{key} (held by something unnamed)", False


def _drop_name(ns: dict[str, Any], name: str, value: Any) -> Any:
    ref = _weak(value)

    def drop() -> bool:
        if ns.get(name) is not None and _same(ns.get(name), ref):
            if _OUTPUT_NAME.match(name) and name in ("_", "__", "___"):
                ns[name] = ""
            else:
                del ns[name]
            return True
        return False
    return drop


def _drop_out(out_cache: dict[Any, Any], k: Any, value: Any, user_ns: Any) -> Any:
    ref = _weak(value)

    def drop() -> bool:
        if k in out_cache and _same(out_cache[k], ref):
            del out_cache[k]
            if isinstance(user_ns, dict) and _same(user_ns.get(f"_{k}"), ref):
                del user_ns[f"_{k}"]
            return True
        return False
    return drop


def _drop_attr(obj: Any, name: str, value: Any) -> Any:
    ref = _weak(value)

    def drop() -> bool:
        if _same(getattr(obj, name, None), ref):
            setattr(obj, name, None)
            return True
        return False
    return drop


def _weak(value: Any) -> Any:
    try:
        return weakref.ref(value)
    except TypeError:  # not weak-referenceable: compare identities (the id only)
        return id(value)


def _same(value: Any, ref: Any) -> bool:
    if value is None:
        return False
    if isinstance(ref, int):
        return id(value) == ref
    return value is ref()
