"""``%cuda_memory why``: the explanation of the session's last out-of-memory error.

``%cuda_memory why`` shows :func:`cudalab.oom.explain_oom` for the last out-of-memory error
of the session (caught as its cell failed, see :mod:`cudalab.oom.session`) or, without one,
for the device now. The panel is shown first; the counterfactual replays of the recorded
history (the autotuner, in worker processes) then fill it in place. ``%cuda_memory why
release`` drops the disposable references the last explanation found (``Out[...]``, ``_``,
the last traceback) and says how many bytes came back; ``%cuda_memory why forget`` forgets
the last error.
"""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError

from cudalab._internal import format_bytes

__all__ = ["run_why"]

#: The last explanation shown, per magics instance (for ``why release``).
_LAST: dict[int, Any] = {}


def run_why(magics: Any, words: list[str], device: int | None) -> None:
    """The body of ``%cuda_memory why [release|forget]`` (``device``: ``-d``, or None)."""
    from IPython.display import display

    from cudalab import oom
    from cudalab.oom import session

    word = words[0].lower() if words else ""
    if word == "release":
        expl = _LAST.get(id(magics))
        if expl is None:
            raise UsageError("%cuda_memory why release: run '%cuda_memory why' first")
        done = expl.release()
        kept = "; ".join(f"{k}: {v}" for k, v in done["kept"].items())
        print(f"cudalab memory: dropped {len(done['released'])} references "
              f"({', '.join(done['released']) or 'none'}); {format_bytes(done['freed'])} "
              "came back" + (f"; kept {kept}" if kept else ""))
        _LAST.pop(id(magics), None)
        return None
    if word == "forget":
        session.forget()
        _LAST.pop(id(magics), None)
        print("cudalab memory: the last out-of-memory error is forgotten")
        return None
    if word:
        raise UsageError(f"%cuda_memory why: unknown word {word!r}; use '%cuda_memory why', "
                         "'why release' or 'why forget'")
    expl = oom.explain_oom(device, replays=False)
    _LAST[id(magics)] = expl
    handle = display(_bundle(expl), raw=True, display_id=True)
    if expl.request is not None and not _no_history(expl):
        try:
            full = expl.with_counterfactuals()
        except Exception as exc:  # the panel stands; say why the replays are missing
            print(f"cudalab memory: the counterfactual replays failed ({type(exc).__name__}: "
                  f"{exc})")
            return None
        _LAST[id(magics)] = full
        if handle is not None:
            handle.update(_bundle(full), raw=True)
        else:  # pragma: no cover - a display without ids
            display(_bundle(full), raw=True)
    return None


def _no_history(expl: Any) -> bool:
    return any("history is off" in u for u in expl.unknown) or \
        not any(u.startswith("counterfactuals: not run yet") for u in expl.unknown)


def _bundle(expl: Any) -> dict[str, str]:
    return {"text/plain": str(expl), "text/html": expl._repr_html_()}


def forget_magics(magics: Any) -> None:
    """Drop the explanation kept for ``magics`` (the extension unloads)."""
    _LAST.pop(id(magics), None)
