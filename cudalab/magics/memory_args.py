"""``%cuda_memory``'s command line (:func:`parse_memory_args` into :class:`MemoryArgs`) and its device
argument (:func:`resolve_device`), with the device labels every subcommand prints.

Sizes (``--threshold``) are read by :func:`cudalab._internal.parse_size`, the package's
one size parser: ``"1g"`` is 2**30 bytes here as everywhere.
"""

from __future__ import annotations

import shlex
from typing import Any, Literal, overload

from IPython.core.error import UsageError

from cudalab import _internal

#: The names the other ``%cuda_memory`` modules (memory, memory_report, memory_pools,
#: memory_watch) use.
__all__ = ["MemoryArgs", "device_label", "devices_module", "is_simulated", "parse_memory_args",
           "resolve_device", "resolve_sources", "strip_comment"]


class MemoryArgs:
    __slots__ = ("command", "words", "device", "threshold", "max_entries", "context", "stacks",
                 "source")

    def __init__(self) -> None:
        self.command = "summary"
        self.words: list[str] = []
        self.device: str | None = None
        self.threshold: int | None = None
        self.max_entries: int | None = None
        self.context: str | None = None
        self.stacks: str | None = None
        #: ``--source``: a name of :data:`cudalab.memory_sources.SOURCE_NAMES` (lower case),
        #: or None when not given.
        self.source: str | None = None

    def record_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of a history recording these options give (``max_entries``,
        ``context``, ``stacks``; ``none`` spelled in any case is None), for cudalab's
        ``record_history`` and torch's ``_record_memory_history`` alike."""
        kwargs: dict[str, Any] = {}
        if self.max_entries is not None:
            kwargs["max_entries"] = self.max_entries
        for key in ("context", "stacks"):
            value = getattr(self, key)
            if value is not None:
                kwargs[key] = None if value.lower() == "none" else value
        return kwargs


_COMMANDS = ("summary", "stats", "pools", "diff", "mark", "reset-peaks", "empty-cache", "watch",
             "history", "snapshot", "explore", "dashboard", "why", "cluster")


def strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment: from a ``#`` that starts a word, outside
    quotes, to the end (as a POSIX shell reads it; ``a#b`` and ``"x #y"`` keep theirs).

    Parameters
    ----------
    line : str
        A magic's argument line.

    Returns
    -------
    str
        The line up to the comment (all of it when there is none).
    """
    if "#" not in line:
        return line
    quote = ""
    escaped = False
    space = True  # the start of the line starts a word
    for i, c in enumerate(line):
        word_start, space = space, False
        if escaped:
            escaped = False
        elif quote:
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"':
                escaped = True
        elif c == "\\":
            escaped = True
        elif c in "'\"":
            quote = c
        elif c == "#" and word_start:
            return line[:i]
        else:
            space = c.isspace()
    return line


def parse_memory_args(line: str) -> MemoryArgs:
    try:
        tokens = shlex.split(strip_comment(line or ""))
    except ValueError as exc:
        raise UsageError(f"%cuda_memory: {exc}") from None
    args = MemoryArgs()
    i = 0
    positional: list[str] = []
    while i < len(tokens):
        tok = tokens[i]
        name, eq, inline = tok.partition("=")
        if name in ("-d", "--device", "--threshold", "--max-entries", "--context", "--stacks",
                    "--source"):
            if eq:
                value = inline
            else:
                i += 1
                if i >= len(tokens):
                    raise UsageError(f"%cuda_memory: option {name} needs a value")
                value = tokens[i]
                # "--threshold 64 KiB": a separate unit word
                if name == "--threshold" and i + 1 < len(tokens) and \
                        tokens[i + 1].lower() in _internal.SIZE_UNITS and tokens[i + 1] != "":
                    i += 1
                    value += tokens[i]
            if name in ("-d", "--device"):
                args.device = value
            elif name == "--threshold":
                try:
                    args.threshold = _internal.parse_size(value, what="--threshold")
                except ValueError as exc:
                    raise UsageError(f"%cuda_memory: --threshold: {exc}") from None
            elif name == "--max-entries":
                try:
                    args.max_entries = int(value)
                    if args.max_entries < 1:
                        raise ValueError
                except ValueError:
                    raise UsageError(f"%cuda_memory: --max-entries needs a positive integer, "
                                     f"got {_internal.echo(value)}") from None
            elif name == "--context":
                args.context = value
            elif name == "--source":
                args.source = _source_name(value)
            else:
                args.stacks = value
        elif tok.startswith("-") and len(tok) > 1:
            raise UsageError(f"%cuda_memory: unknown option {_internal.echo(tok)} (see %cuda_memory?)")
        else:
            positional.append(tok)
        i += 1
    if positional:
        cmd = positional[0].lower().replace("_", "-")
        aliases = {"reset-peak": "reset-peaks", "reset_peaks": "reset-peaks",
                   "empty": "empty-cache", "empty_cache": "empty-cache"}
        cmd = aliases.get(cmd, cmd)
        if cmd not in _COMMANDS:
            raise UsageError(f"%cuda_memory: unknown subcommand {positional[0]!r}; use one of "
                             f"{', '.join(_COMMANDS)}")
        args.command = cmd
        args.words = positional[1:]
    return args



def _source_name(value: str) -> str:
    """``--source``'s value, checked against the known names (a UsageError listing them)."""
    from cudalab.memory_sources import SOURCE_NAMES

    name = value.strip().lower()
    if name not in SOURCE_NAMES:
        raise UsageError(f"%cuda_memory: unknown --source {_internal.echo(value)}; use one of "
                         f"{', '.join(SOURCE_NAMES)}")
    return name


def resolve_sources(args: MemoryArgs, what: str, allowed: tuple[str, ...] | None = None) -> Any:
    """The sources ``--source`` names (default ``auto``) for the view ``what`` (e.g.
    ``"%cuda_memory dashboard"``), as :func:`cudalab.memory_sources.resolve_sources` gives
    them; a UsageError saying why a source cannot be had (no torch, torch without CUDA
    initialised, ...) or that ``what`` does not take it (``allowed``)."""
    from cudalab.memory_sources import SourceUnavailableError
    from cudalab.memory_sources import resolve_sources as resolve

    name = args.source or "auto"
    if allowed is not None and name not in allowed:
        raise UsageError(f"{what}: --source {name} is not available here; use one of "
                         f"{', '.join(allowed)}")
    try:
        return resolve(name)
    except SourceUnavailableError as exc:
        raise UsageError(f"{what} --source {name}: {exc.reason}") from None


def devices_module() -> Any:
    """:mod:`cudalab.devices`, imported when first needed."""
    from cudalab import devices

    return devices


@overload
def resolve_device(spec: str | None, init: Literal[True] = ...) -> int: ...
@overload
def resolve_device(spec: str | None, init: bool) -> int | None: ...
def resolve_device(spec: str | None, init: bool = True) -> int | None:
    """Device index for ``spec`` (None: current). ``init=False`` returns None instead of
    initialising CUDA."""
    devices = devices_module()
    if not devices.is_initialized() and not init:
        return None
    from cudalab.errors import CudaUnavailableError

    try:
        devices.init()
    except CudaUnavailableError as exc:
        raise UsageError(f"%cuda_memory: {exc}") from None
    if spec is None:
        return devices.current_device()
    s = spec.strip()
    try:
        return _internal.device_index(int(s) if s.isdigit() else s)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"%cuda_memory: bad device {_internal.echo(spec)}: {exc}") from None


def is_simulated() -> bool:
    return bool(_internal.is_initialized() and _internal.backend().simulated)


def device_label(d: int) -> str:
    return f"cuda:{d}" + (" (simulated)" if is_simulated() else "")

