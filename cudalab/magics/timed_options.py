"""``%%cuda_timed``'s option line: :class:`TimedOptions`, :func:`parse_options` and the
``-d`` device list (:func:`parse_devices`)."""

from __future__ import annotations

import io
import tokenize
from typing import Any

from IPython.core.error import UsageError

from cudalab import _internal

__all__ = ["TimedOptions", "parse_devices", "parse_options"]


class TimedOptions:
    """Parsed ``%%cuda_timed`` options; ``stmt`` is the rest of the line (setup or statement)."""

    __slots__ = ("number", "repeat", "warmup", "max_time", "cold", "device", "kernels",
                 "output", "quiet", "precision", "var", "no_raise", "graph", "stmt")

    def __init__(self) -> None:
        self.number: int | None = None
        self.repeat: int | None = None
        self.warmup: int | None = None
        self.max_time: float | None = None
        self.cold = False
        self.device: str | None = None
        self.kernels = False
        self.output = False
        self.quiet = False
        self.precision: int | None = None
        self.var: str | None = None
        self.no_raise = False
        self.graph = False  # --graph: eager next to CUDA graph replays (timed_graph)
        self.stmt = ""

    @property
    def repeat_mode(self) -> bool:
        return (self.number is not None or self.repeat is not None or self.warmup is not None
                or self.max_time is not None)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
        return f"TimedOptions({fields})"


_VALUED = {"-n": "number", "--number": "number", "-r": "repeat", "--repeat": "repeat",
           "-w": "warmup", "--warmup": "warmup", "--max-time": "max_time",
           "-d": "device", "--device": "device", "-p": "precision", "--precision": "precision",
           "-v": "var"}
_FLAGS = {"--cold": "cold", "--kernels": "kernels", "-o": "output", "-q": "quiet",
          "--quiet": "quiet", "--no-raise-error": "no_raise", "--graph": "graph"}
_SHORT_FLAGS = {"o": "output", "q": "quiet"}


def _convert(attr: str, opt: str, text: str) -> Any:
    try:
        if attr in ("number", "repeat", "warmup", "precision"):
            value = int(text)
            low = 1 if attr in ("number", "repeat", "precision") else 0
            if value < low:
                raise ValueError
            return value
        if attr == "max_time":
            seconds = float(text)
            if not seconds > 0:
                raise ValueError
            return seconds
    except ValueError:
        kind = "a positive number" if attr == "max_time" else (
            "a non-negative integer" if attr == "warmup" else "a positive integer")
        raise UsageError(f"%cuda_timed: {opt} needs {kind}, got {_internal.echo(text)}") from None
    if attr == "var" and not text.isidentifier():
        raise UsageError(f"%cuda_timed: -v needs a variable name, got {_internal.echo(text)}")
    return text


def parse_options(line: str) -> TimedOptions:
    """Parse the options at the start of ``line``; the first token that is not an option
    starts the statement, which is kept verbatim (``--`` ends the options explicitly)."""
    opts = TimedOptions()
    pos, n = 0, len(line)
    while True:
        while pos < n and line[pos].isspace():
            pos += 1
        if pos >= n or line[pos] != "-":
            break
        end = pos
        while end < n and not line[end].isspace():
            end += 1
        tok = line[pos:end]
        if tok == "--":
            pos = end
            break
        name, eq, inline = tok.partition("=")
        if not eq and tok[:2] in _VALUED and len(tok) > 2 and not tok.startswith("--"):
            name, inline, eq = tok[:2], tok[2:], "="  # -n10
        if name in _VALUED:
            attr = _VALUED[name]
            if eq:
                value, pos = inline, end
            else:
                vs = end
                while vs < n and line[vs].isspace():
                    vs += 1
                ve = vs
                while ve < n and not line[ve].isspace():
                    ve += 1
                if vs >= n:
                    raise UsageError(f"%cuda_timed: option {name} needs a value")
                value, pos = line[vs:ve], ve
            setattr(opts, attr, _convert(attr, name, value))
            continue
        if name in _FLAGS and not eq:
            setattr(opts, _FLAGS[name], True)
            pos = end
            continue
        if (len(tok) > 2 and tok[0] == "-" and tok[1] != "-"
                and all(c in _SHORT_FLAGS for c in tok[1:])):
            for c in tok[1:]:
                setattr(opts, _SHORT_FLAGS[c], True)
            pos = end
            continue
        if len(tok) > 1 and (tok[1].isalpha() or tok[1] == "-"):
            raise UsageError(f"%cuda_timed: unknown option {_internal.echo(tok)} (see %cuda_timed?)")
        break  # "-x + 1", "-1": a statement that starts with a minus sign
    opts.stmt = _strip_comment(line[pos:]).strip()
    return opts


def _strip_comment(stmt: str) -> str:
    """``stmt`` without a trailing Python comment (a ``#`` outside string literals):
    ``%%cuda_timed -r 50  # GPU time`` has no setup statement."""
    if "#" not in stmt:
        return stmt
    if stmt.lstrip().startswith("#"):
        return ""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(stmt).readline):
            if tok.type == tokenize.COMMENT:
                return stmt[:tok.start[1]] if tok.start[0] == 1 else stmt
            if tok.type == tokenize.ERRORTOKEN and tok.string[:1] in ("'", '"'):
                break  # an unterminated string: leave its text as written
    except (tokenize.TokenError, SyntaxError):
        pass  # the statement's own error is reported when it is compiled
    return stmt


def parse_devices(spec: str | None) -> list[int]:
    """``None`` -> [current device]; ``"all"``; ``"0"``, ``"cuda:1"``, ``"0,1"``."""
    from cudalab import devices

    if spec is None:
        return [devices.current_device()]
    s = spec.strip().lower()
    if s == "all":
        return list(range(devices.device_count()))
    out: list[int] = []
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            idx = _internal.device_index(int(part) if part.isdigit() else part)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"%cuda_timed: bad device {_internal.echo(part)}: {exc}") from None
        if idx not in out:
            out.append(idx)
    if not out:
        raise UsageError(f"%cuda_timed: no device in {_internal.echo(spec)}")
    return out

