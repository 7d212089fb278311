"""Allocator configuration: torch's ``PYTORCH_ALLOC_CONF`` grammar under cudalab's own name.

The settings string is read from the first of these environment variables that is set:
``CUDALAB_ALLOC_CONF``, ``PYTORCH_ALLOC_CONF``, ``PYTORCH_CUDA_ALLOC_CONF`` (so a torch user's
settings carry over). The grammar is torch's (``c10/core/AllocatorConfig.{h,cpp}`` and
``c10/cuda/CUDAAllocatorConfig.cpp``): ``key:value`` pairs separated by commas, list values
in brackets (``roundup_power2_divisions:[256:1,512:2,>:8]``), whitespace ignored.

Where torch is lax (``stoull`` accepts ``"20abc"``, a missing ``:`` is silently skipped) this
parser is strict: every malformed item raises :class:`~cudalab.errors.AllocatorSettingsError`
(a ValueError, and a RuntimeError as torch raises) naming the option, the bad value and the
accepted form. Parsing is pure: nothing changes until a whole string has
parsed, so a bad string leaves the running allocator exactly as it was.

``CUDALAB_NO_MEMORY_CACHING`` (or torch's ``PYTORCH_NO_CUDA_MEMORY_CACHING``) set to anything
but ``""``/``0`` turns caching off: every allocation is a plain device allocation.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cudalab._units import KiB, MiB, echo
from cudalab.errors import AllocatorSettingsError

__all__ = [
    "AllocatorConfig",
    "parse_alloc_conf",
    "merge_settings",
    "NATIVE_ONLY_KEYS",
    "config_from_env",
    "no_caching_from_env",
    "ENV_VARS",
    "KB",
    "MB",
    "UNLIMITED",
    "MIN_BLOCK_SIZE",
    "SMALL_SIZE",
    "SMALL_BUFFER",
    "MIN_LARGE_ALLOC",
    "LARGE_BUFFER",
    "ROUND_LARGE",
    "ROUNDUP_POWER2_INTERVALS",
]

#: torch's names for 2**10 and 2**20 bytes (its ``*_mb`` options are MiB): :mod:`cudalab._units`'s.
KB = KiB
MB = MiB
#: torch's ``SIZE_MAX``: "no limit" for ``max_split_size`` (reported as -1 in memory_stats).
UNLIMITED = (1 << 64) - 1

# torch's constants (c10/core/AllocatorConfig.h, CUDACachingAllocator.cpp).
MIN_BLOCK_SIZE = 512  # every request is rounded to a multiple of this
SMALL_SIZE = 1 * MB  # requests <= this go to the small pool
SMALL_BUFFER = 2 * MB  # segment size of the small pool
MIN_LARGE_ALLOC = 10 * MB  # large requests below this get a LARGE_BUFFER segment
LARGE_BUFFER = 20 * MB  # default large segment size and max_non_split_rounding
ROUND_LARGE = 2 * MB  # larger segments are rounded to this
ROUNDUP_POWER2_INTERVALS = 16  # roundup table covers 1 MiB .. 64 GiB

#: Environment variables holding the settings string, first set one wins.
ENV_VARS = ("CUDALAB_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
NO_CACHING_VARS = ("CUDALAB_NO_MEMORY_CACHING", "PYTORCH_NO_CUDA_MEMORY_CACHING")

# Upper bound of the pinned register thread count (torch: pinned_max_register_threads()).
_PINNED_MAX_REGISTER_THREADS = 128


@dataclass(frozen=True)
class AllocatorConfig:
    """Parsed allocator settings (defaults are torch's)."""

    #: The settings string as given (torch's ``last_allocator_settings``), "" when unset.
    text: str = ""
    #: Where it came from: an environment variable name, "parse_alloc_conf" or "".
    source: str = ""
    backend: str = "native"
    max_split_size: int = UNLIMITED
    max_non_split_rounding_size: int = LARGE_BUFFER
    large_segment_size: int = LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_POWER2_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    release_lock_on_cudamalloc: bool = False
    per_process_memory_fraction: float | None = None
    throw_on_cudamalloc_oom: bool = False
    graph_capture_record_stream_reuse: bool = False
    # Pinned (host) allocator knobs: parsed, validated and stored for the pinned allocator.
    pinned_use_cuda_host_register: bool = False
    pinned_num_register_threads: int = 1
    pinned_use_background_threads: bool = False
    pinned_reserve_segment_size_mb: int = 0
    pinned_max_round_threshold_mb: int = 0
    pinned_max_cached_size_mb: int = 0
    #: Keys explicitly given, in order (for messages and snapshots).
    keys: tuple[str, ...] = field(default=(), compare=False)

    def divisions_for(self, size: int) -> int:
        """torch's ``roundup_power2_divisions(size)``: the table entry for ``size`` bytes."""
        index = size.bit_length() - 1 - 20
        if index < 0:
            index = 0
        elif index >= ROUNDUP_POWER2_INTERVALS:
            index = ROUNDUP_POWER2_INTERVALS - 1
        return self.roundup_power2_divisions[index]

    def divisions_dict(self) -> dict[str, int]:
        """The table as torch's snapshot shows it: {"1": d, "2": d, ... "32768": d} (MiB)."""
        return {str(1 << i): d for i, d in enumerate(self.roundup_power2_divisions)}


# --------------------------------------------------------------------------- tokenizer
_SEPARATORS = frozenset(",:[]")


def _tokenize(text: str) -> list[str]:
    """torch's ConfigTokenizer: split on , : [ ] (kept as tokens), drop whitespace."""
    tokens: list[str] = []
    buf: list[str] = []
    for ch in text:
        if ch in _SEPARATORS:
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


class _Parser:
    def __init__(self, text: str, source: str):
        self.text = text
        self.source = source or "allocator settings"
        self.tokens = _tokenize(text)
        self.i = 0

    # errors ---------------------------------------------------------------
    def error(self, key: str | None, bad: str, form: str,
              torch_text: str = "") -> AllocatorSettingsError:
        """The error for ``bad`` where ``form`` was expected (echoing a readable prefix
        of it and of the settings); ``torch_text``, torch's own message for the same
        mistake, leads when given (cudalab's explanation follows)."""
        where = f"{self.source}={echo(self.text)}"
        lead = f"{torch_text} (" if torch_text else ""
        tail = ")" if torch_text else ""
        if key is None:
            return AllocatorSettingsError(f"{lead}{where}: {bad}; expected {form}{tail}")
        return AllocatorSettingsError(
            f"{lead}{where}: invalid {key} value {echo(bad)}; expected {form}{tail}")

    # token access ---------------------------------------------------------
    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str | None:
        tok = self.peek()
        self.i += 1
        return tok

    def expect_colon(self, key: str, form: str) -> None:
        tok = self.take()
        if tok != ":":
            raise self.error(key, "" if tok is None else tok, f"'{key}:<value>' ({form})")

    def value(self, key: str, form: str) -> str:
        tok = self.take()
        if tok is None or tok in _SEPARATORS:
            raise self.error(key, "" if tok is None else tok, form)
        return tok

    # typed values ---------------------------------------------------------
    def uint(self, key: str, form: str) -> int:
        tok = self.value(key, form)
        if not tok.isdigit() or not tok.isascii():
            raise self.error(key, tok, form)
        try:
            return int(tok)
        except ValueError:  # over Python's limit on digits (sys.get_int_max_str_digits)
            raise self.error(key, tok, form) from None

    def boolean(self, key: str) -> bool:
        """torch's boolean values: exactly ``True`` or ``False`` (torch 2.11's parser takes
        no other spelling: not ``true``, ``1`` nor ``yes``)."""
        torch_text = f"Expected a single True/False argument for {key}"
        tok = self.take()
        if tok == "True":
            return True
        if tok == "False":
            return False
        raise self.error(key, "" if tok is None else tok,
                         "True or False (capitalised, as torch spells them)", torch_text)

    def number(self, key: str, form: str) -> float:
        tok = self.value(key, form)
        try:
            val = float(tok)
        except ValueError:
            raise self.error(key, tok, form) from None
        if not math.isfinite(val):
            raise self.error(key, tok, form)
        return val


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _parse_mb_at_least(p: _Parser, key: str, minimum_mb: int, strict: bool = False) -> int:
    rel = ">" if strict else ">="
    form = f"a whole number of MiB {rel} {minimum_mb} (e.g. {key}:{max(minimum_mb + 1, 128)})"
    p.expect_colon(key, form)
    mb = p.uint(key, form)
    if (mb <= minimum_mb) if strict else (mb < minimum_mb):
        raise p.error(key, str(mb), form)
    mb = min(mb, UNLIMITED // MB)  # torch clamps to SIZE_MAX / 1 MiB
    return mb * MB


def _parse_divisions(p: _Parser, key: str) -> tuple[int, ...]:
    form = (
        "a power of 2 (e.g. roundup_power2_divisions:4) or a list "
        "[<MiB, power of 2>:<0 or power of 2>, ..., >:<0 or power of 2>] "
        "(e.g. roundup_power2_divisions:[256:1,512:2,1024:4,>:8])"
    )
    p.expect_colon(key, form)
    table = [0] * ROUNDUP_POWER2_INTERVALS
    tok = p.peek()
    if tok != "[":
        value = p.uint(key, form)
        if not _is_pow2(value):
            raise p.error(key, str(value), form)
        return (value,) * ROUNDUP_POWER2_INTERVALS
    p.take()  # "["
    first = True
    last_index = 0
    while True:
        tok = p.take()
        if tok is None:
            raise p.error(key, "[" + p.text.split("[", 1)[-1], form + " with a closing ']'")
        if tok == "]":
            break
        boundary = tok
        if boundary in _SEPARATORS:
            raise p.error(key, boundary, form)
        if p.take() != ":":
            raise p.error(key, boundary, form)
        value = p.uint(key, form)
        if value != 0 and not _is_pow2(value):
            raise p.error(key, f"{boundary}:{value}", form)
        if boundary == ">":
            # torch >= 2.9: fills every entry after the last interval given.
            for j in range(last_index + 1, ROUNDUP_POWER2_INTERVALS):
                table[j] = value
        else:
            if (not boundary.isdigit() or not boundary.isascii()
                    or len(boundary) > 30):  # (past any size; int() refuses 4300 digits)
                raise p.error(key, f"{boundary}:{value}", form)
            b = int(boundary)
            if not _is_pow2(b):
                raise p.error(key, f"{boundary}:{value}", form)
            index = min(b.bit_length() - 1, ROUNDUP_POWER2_INTERVALS - 1)
            if first:
                for j in range(index):
                    table[j] = value
                first = False
            table[index] = value
            last_index = index
        nxt = p.peek()
        if nxt == ",":
            p.take()
        elif nxt != "]":
            raise p.error(key, "" if nxt is None else nxt, form + " with items separated by ','")
    return tuple(table)


_BOOL_KEYS = {
    "expandable_segments": "expandable_segments",
    "release_lock_on_cudamalloc": "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc": "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register": "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register": "pinned_use_cuda_host_register",
    "pinned_use_background_threads": "pinned_use_background_threads",
    "graph_capture_record_stream_reuse": "graph_capture_record_stream_reuse",
    "throw_on_cudamalloc_oom": "throw_on_cudamalloc_oom",
}

# Options that only the native caching allocator uses (torch warns about them under
# backend:cudaMallocAsync).
_NATIVE_ONLY = frozenset((
    "max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
    "roundup_power2_divisions", "garbage_collection_threshold", "expandable_segments",
    "release_lock_on_cudamalloc",
))

#: The keys only the native caching allocator uses (public name of the set above).
NATIVE_ONLY_KEYS = _NATIVE_ONLY

#: Every key the parser accepts.
KNOWN_KEYS = (
    "backend",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "large_segment_size_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "per_process_memory_fraction",
    *_BOOL_KEYS,
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
)


def parse_alloc_conf(text: str | None, source: str = "parse_alloc_conf") -> AllocatorConfig:
    """Parse an allocator settings string (torch's grammar) into an :class:`AllocatorConfig`.

    Parameters
    ----------
    text : str or None
        The settings, e.g. ``"max_split_size_mb:128,expandable_segments:True"``; ``None``
        or ``""`` gives the defaults.
    source : str, optional
        Where the text came from (an environment variable name), named in error messages.

    Returns
    -------
    AllocatorConfig
        The parsed settings; nothing else changes (parsing is pure).

    Raises
    ------
    AllocatorSettingsError
        For an unknown key or a malformed value, naming the option, the bad value and the
        accepted form (a ValueError, and a RuntimeError as torch raises).
    TypeError
        When ``text`` is not a str.
    """
    if text is None:
        return AllocatorConfig()
    if not isinstance(text, str):
        raise TypeError(f"allocator settings must be a str, got {type(text).__name__}")
    p = _Parser(text, source)
    values: dict[str, Any] = {}  # AllocatorConfig field -> parsed value (typed by its parser)
    keys: list[str] = []
    # large_segment_size_mb first: the minimum of max_split_size_mb and
    # max_non_split_rounding_mb follows it (torch parses it in a first pass too).
    large_segment = LARGE_BUFFER
    for j, tok in enumerate(p.tokens):
        if tok == "large_segment_size_mb" and (j == 0 or p.tokens[j - 1] == ","):
            p.i = j + 1
            large_segment = _parse_mb_at_least(p, tok, MIN_LARGE_ALLOC // MB, strict=True)
    values["large_segment_size"] = large_segment
    values["max_non_split_rounding_size"] = large_segment
    p.i = 0
    while p.peek() is not None:
        key = p.take()
        assert key is not None
        if key in _SEPARATORS:
            raise p.error(None, f"unexpected {echo(key)} where an option name should be",
                          "key:value pairs separated by ',' (e.g. max_split_size_mb:128)")
        keys.append(key)
        if key == "backend":
            form = "native or cudaMallocAsync"
            p.expect_colon(key, form)
            name = p.value(key, form)
            if name not in ("native", "cudaMallocAsync"):
                raise p.error(key, name, form)
            values["backend"] = name
        elif key == "max_split_size_mb":
            values["max_split_size"] = _parse_mb_at_least(p, key, large_segment // MB)
        elif key == "max_non_split_rounding_mb":
            values["max_non_split_rounding_size"] = _parse_mb_at_least(p, key, large_segment // MB)
        elif key == "large_segment_size_mb":
            _parse_mb_at_least(p, key, MIN_LARGE_ALLOC // MB, strict=True)  # already applied
        elif key == "roundup_power2_divisions":
            values["roundup_power2_divisions"] = _parse_divisions(p, key)
        elif key == "garbage_collection_threshold":
            form = "a number strictly between 0 and 1 (e.g. garbage_collection_threshold:0.6)"
            p.expect_colon(key, form)
            threshold = p.number(key, form)
            if not 0.0 < threshold < 1.0:
                raise p.error(key, str(threshold), form)
            values["garbage_collection_threshold"] = threshold
        elif key == "per_process_memory_fraction":
            form = "a number in [0, 1] (e.g. per_process_memory_fraction:0.5)"
            p.expect_colon(key, form)
            fraction = p.number(key, form)
            if not 0.0 <= fraction <= 1.0:
                raise p.error(key, str(fraction), form,
                              "per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
            values["per_process_memory_fraction"] = fraction
        elif key in _BOOL_KEYS:
            p.expect_colon(key, "True or False")
            values[_BOOL_KEYS[key]] = p.boolean(key)
        elif key == "pinned_num_register_threads":
            form = f"a power of 2 <= {_PINNED_MAX_REGISTER_THREADS} (e.g. {key}:8)"
            p.expect_colon(key, form)
            threads = p.uint(key, form)
            if not _is_pow2(threads) or threads > _PINNED_MAX_REGISTER_THREADS:
                raise p.error(key, str(threads), form)
            values[key] = threads
        elif key == "pinned_reserve_segment_size_mb":
            form = f"a whole number of MiB > 0 (e.g. {key}:64)"
            p.expect_colon(key, form)
            mb = p.uint(key, form)
            if mb <= 0:
                raise p.error(key, str(mb), form)
            values[key] = mb
        elif key in ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb"):
            form = f"a whole number of MiB (e.g. {key}:64)"
            p.expect_colon(key, form)
            values[key] = p.uint(key, form)
        else:
            raise AllocatorSettingsError(
                f"{p.source}={echo(p.text)}: unknown option {echo(key)}; accepted options are "
                + ", ".join(KNOWN_KEYS)
            )
        nxt = p.peek()
        if nxt is not None:
            if nxt != ",":
                raise p.error(key, nxt, "options separated by ',' (e.g. "
                                        "max_split_size_mb:128,garbage_collection_threshold:0.6)")
            p.take()  # a trailing ',' is accepted, as torch does
    if values.get("backend") == "cudaMallocAsync":
        native_only = [k for k in keys if k in _NATIVE_ONLY]
        if native_only:
            warnings.warn(
                f"{p.source}: backend:cudaMallocAsync ignores {', '.join(native_only)}",
                stacklevel=3,
            )
    return replace(AllocatorConfig(text=text, source=source), keys=tuple(keys), **values)


#: The AllocatorConfig fields each settings key sets (merge_settings).
_KEY_FIELDS: dict[str, tuple[str, ...]] = {
    "backend": ("backend",),
    "max_split_size_mb": ("max_split_size",),
    "max_non_split_rounding_mb": ("max_non_split_rounding_size",),
    "large_segment_size_mb": ("large_segment_size",),
    "roundup_power2_divisions": ("roundup_power2_divisions",),
    "garbage_collection_threshold": ("garbage_collection_threshold",),
    "per_process_memory_fraction": ("per_process_memory_fraction",),
    **{key: (name,) for key, name in _BOOL_KEYS.items()},
    "pinned_num_register_threads": ("pinned_num_register_threads",),
    "pinned_reserve_segment_size_mb": ("pinned_reserve_segment_size_mb",),
    "pinned_max_round_threshold_mb": ("pinned_max_round_threshold_mb",),
    "pinned_max_cached_size_mb": ("pinned_max_cached_size_mb",),
}


#: The keys torch's ``parseArgs`` resets to their defaults on every parse, so a settings
#: string applied at run time that leaves one out sets it back to its default (torch's
#: test_allocator_settings: "should have reset the power2 divisions now"); every other key
#: keeps its value when not named.
RESET_ON_EACH_PARSE = ("max_split_size_mb", "roundup_power2_divisions",
                       "garbage_collection_threshold")


def merge_settings(base: AllocatorConfig, update: AllocatorConfig) -> AllocatorConfig:
    """``base`` with the settings string ``update`` applied, as torch's ``parseArgs``
    applies one at run time: the keys of :data:`RESET_ON_EACH_PARSE` take ``update``'s
    values (their defaults when it does not name them); other keys not named keep theirs.

    Parameters
    ----------
    base : AllocatorConfig
        The settings in force.
    update : AllocatorConfig
        A parsed settings string (:func:`parse_alloc_conf`); only its ``keys`` count.

    Returns
    -------
    AllocatorConfig
        The merged settings; ``text`` and ``source`` are ``update``'s (torch's
        ``last_allocator_settings`` is the last string applied).
    """
    values: dict[str, Any] = {}
    for key in (*RESET_ON_EACH_PARSE, *update.keys):
        for name in _KEY_FIELDS[key]:
            values[name] = getattr(update, name)
    if "large_segment_size_mb" in update.keys and "max_non_split_rounding_mb" not in update.keys:
        # the parser ties the default rounding slack to the segment size
        values["max_non_split_rounding_size"] = update.max_non_split_rounding_size
    kept = tuple(k for k in base.keys if k not in RESET_ON_EACH_PARSE)
    keys = tuple(dict.fromkeys(kept + update.keys))
    return replace(base, text=update.text, source=update.source, keys=keys, **values)


def _env_conf(environ: Mapping[str, str]) -> tuple[str, str] | None:
    for name in ENV_VARS:
        value = environ.get(name)
        if value is not None:
            return name, value
    return None


def config_from_env(environ: Mapping[str, str] | None = None) -> AllocatorConfig:
    """The configuration from the first of :data:`ENV_VARS` that is set.

    Parameters
    ----------
    environ : mapping, optional
        The environment to read (default: ``os.environ``).

    Returns
    -------
    AllocatorConfig
        The parsed settings, or the defaults when none of the variables is set.

    Raises
    ------
    ValueError
        When the variable's value does not parse (see :func:`parse_alloc_conf`).
    """
    env = os.environ if environ is None else environ
    found = _env_conf(env)
    if found is None:
        return AllocatorConfig()
    name, value = found
    return parse_alloc_conf(value, source=name)


def no_caching_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether caching is turned off (``CUDALAB_NO_MEMORY_CACHING`` / torch's variable).

    torch treats *any* value of ``PYTORCH_NO_CUDA_MEMORY_CACHING`` as "on"; cudalab also
    accepts the explicit off values ``""``, ``0``, ``false``, ``no``, ``off``.

    Parameters
    ----------
    environ : mapping, optional
        The environment to read (default: ``os.environ``).

    Returns
    -------
    bool
        True when the first of :data:`NO_CACHING_VARS` that is set holds an "on" value.
    """
    env = os.environ if environ is None else environ
    for name in NO_CACHING_VARS:
        value = env.get(name)
        if value is not None:
            return value.strip().lower() not in ("", "0", "false", "no", "off")
    return False
