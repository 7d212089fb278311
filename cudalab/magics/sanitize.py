"""``%%cuda_sanitize``: run one cell under the stream sanitizer and show what it found.

The cell runs once (IPython syntax, the last expression is the cell's output, exceptions
propagate after the findings are shown) inside :func:`cudalab.sanitizer.sanitize` in
``"collect"`` mode; then the findings are displayed as one HTML table (plain text in a
terminal), or "no unsynchronized access found" with the number of accesses checked.

Options: ``-v VAR`` stores the :class:`cudalab.sanitizer.Session` in ``VAR``; ``-q`` shows
nothing (with ``-v``, to inspect the findings in code).
"""

from __future__ import annotations

import shlex
from typing import Any

from IPython.core.error import UsageError

from cudalab import sanitizer
from cudalab.magics.timed_compile import compile_single

__all__ = ["SanitizeOutput", "parse_sanitize_options", "run_cuda_sanitize"]

USAGE = "usage: %%cuda_sanitize [-q] [-v VAR]"


class SanitizeOutput:
    """The rich display of one sanitized cell: HTML in a notebook, text in a terminal."""

    def __init__(self, session: sanitizer.Session):
        self.session = session

    def _repr_html_(self) -> str:
        return sanitizer.html_table(self.session.reports, self.session.accesses)

    def __repr__(self) -> str:
        reports = self.session.reports
        if not reports:
            return (f"no unsynchronized access found ({self.session.accesses} accesses "
                    f"checked)\n{sanitizer.NOT_SEEN}")
        return (f"{len(reports)} finding{'s' if len(reports) != 1 else ''} "
                f"({self.session.accesses} accesses checked)\n"
                + "\n".join(str(r) for r in reports))


def parse_sanitize_options(line: str) -> tuple[bool, str | None]:
    """(quiet, variable name) of the magic's line.

    Raises
    ------
    UsageError
        For an unknown option, a missing or invalid variable name.
    """
    try:
        words = shlex.split(line, comments=True)
    except ValueError as exc:
        raise UsageError(f"%%cuda_sanitize: {exc}; {USAGE}") from None
    quiet, var = False, None
    i = 0
    while i < len(words):
        word = words[i]
        if word == "-q":
            quiet = True
        elif word == "-v":
            if i + 1 >= len(words) or not words[i + 1].isidentifier():
                raise UsageError(f"%%cuda_sanitize: -v needs a variable name; {USAGE}")
            var = words[i + 1]
            i += 1
        else:
            raise UsageError(f"%%cuda_sanitize: unknown argument {word!r}; {USAGE}")
        i += 1
    return quiet, var


def run_cuda_sanitize(magics: Any, line: str, cell: str, local_ns: Any) -> Any:
    """Run ``cell`` under the sanitizer; display the findings; return the cell's value."""
    __tracebackhide__ = True  # noqa: F841 - IPython hides this frame above the user's
    quiet, var = parse_sanitize_options(line)
    shell = magics.shell
    glob = shell.user_ns
    code, expr_code, _ = compile_single(shell, cell)
    out = None
    with sanitizer.sanitize("collect") as session:
        try:
            exec(code, glob, local_ns)  # noqa: S102 - the user's own code, as %time
            if expr_code is not None:
                out = eval(expr_code, glob, local_ns)  # noqa: S307
        finally:
            if var is not None:
                shell.user_ns[var] = session
            if not quiet:
                from IPython.display import display

                display(SanitizeOutput(session))
    return out
