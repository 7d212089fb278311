"""Compiling a ``%%cuda_timed`` cell once: the cell as IPython runs it (single mode), or
placed in the timing function whose loops run the repeats (repeat mode, IPython's timeit
template), so no repeat re-executes source."""

from __future__ import annotations

import ast
import copy
import sys
import time
from typing import Any

__all__ = ["compile_repeat", "compile_single", "running_cell_number"]

_perf = time.perf_counter


class _Filler(ast.NodeTransformer):
    """Put the setup and statement bodies in place of the template's ``setup`` and ``stmt``
    placeholders (IPython's approach)."""

    def __init__(self, setup: list[ast.stmt], stmt: list[ast.stmt]):
        self.parts = {"setup": setup, "stmt": stmt}

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field in ("body", "orelse"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                out: list[ast.stmt] = []
                for st in stmts:
                    if (isinstance(st, ast.Expr) and isinstance(st.value, ast.Name)
                            and st.value.id in self.parts):
                        out.extend(self.parts[st.value.id])
                    else:
                        out.append(self.visit(st))
                setattr(node, field, out)
        return node


#: The timing function's repeat counter: ``%%cuda_timed`` reads it from the function's frame
#: after a Ctrl-C to report the repeats that finished (``timed._repeats_done``); the template
#: below is checked to use this name, so the two cannot drift.
REPEAT_COUNTER = "_cl_j"

#: The timing function. The repeats loop inside it, so a repeat costs no call of its own:
#: ``begin()`` (``time.perf_counter`` itself in the shared-boundary mode) before the loops,
#: ``end(j, t0)`` after them, which records the end events and returns ``j + 1``, or
#: ``~(j + 1)`` to stop. ``setup`` runs before every repeat, untimed; its names stay local.
_TEMPLATE = (
    "def __cudalab_timed_inner(_cl_n, _cl_j, _cl_begin, _cl_end, _cl_repeat):\n"
    "    while _cl_j >= 0:\n"
    "        setup\n"
    "        _cl_t0 = _cl_begin()\n"
    "        for _cl_i in _cl_repeat(None, _cl_n):\n"
    "            stmt\n"
    "        _cl_j = _cl_end(_cl_j, _cl_t0)\n"
    "    return ~_cl_j\n"
)
#: The same for one loop per repeat (``-n 1``): the statement is not wrapped in a loop of
#: one, which saves an iterator per repeat. ``_cl_n`` must be 1.
_TEMPLATE_ONCE = _TEMPLATE.replace(
    "        for _cl_i in _cl_repeat(None, _cl_n):\n            stmt\n", "        stmt\n")
assert _TEMPLATE_ONCE != _TEMPLATE
assert f"        {REPEAT_COUNTER} = _cl_end({REPEAT_COUNTER}, _cl_t0)\n" in _TEMPLATE


def running_cell_number(shell: Any) -> int:
    """The number IPython gives the cell that runs now: N for ``In[N]``, as its tracebacks
    and history name it.

    ``shell.execution_count`` is not it in every IPython: IPython 9 (since its
    ipython/ipython#15088) advances it to N+1 *before* cell N runs, older ones after. The
    number IPython itself uses is the running cell's ``ExecutionResult.execution_count``:
    the displayhook holds that result while the cell's code runs, and ``run_cell_async``
    has it as its local ``result`` from before ``pre_run_cell`` (the callback where the
    displayhook does not hold it yet). Failing both (a shell that runs cells another way),
    ``shell.execution_count``.
    """
    count = getattr(getattr(getattr(shell, "displayhook", None), "exec_result", None),
                    "execution_count", None)
    if isinstance(count, int):
        return count
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "run_cell_async" and id(frame.f_locals.get("self")) == id(shell):
            count = getattr(frame.f_locals.get("result"), "execution_count", None)
            if isinstance(count, int):
                return count
            break
        frame = frame.f_back  # type: ignore[assignment]  # (None ends the loop)
    return int(shell.execution_count)


def _parse(shell: Any, source: str) -> tuple[ast.Module, str]:
    transformed = shell.transform_cell(source)
    name = shell.compile.cache(transformed, running_cell_number(shell), raw_code=source)
    tree = shell.compile.ast_parse(transformed, filename=name)
    tree = shell.transform_ast(tree)
    return tree, name


def compile_single(shell: Any, source: str) -> tuple[Any, Any, float]:
    """(code for all but a trailing expression, code of that expression or None, seconds)."""
    t0 = _perf()
    tree, name = _parse(shell, source)
    expr = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        expr = ast.Expression(tree.body[-1].value)
        tree.body = tree.body[:-1]
    code = shell.compile(tree, name, "exec")
    expr_code = shell.compile(expr, name, "eval") if expr is not None else None
    return code, expr_code, _perf() - t0


def compile_repeat(shell: Any, setup: str, stmt: str, glob: dict) -> tuple[Any, float, bool]:
    """The timing function ``inner(n, j, begin, end, repeat)`` built around the body (it
    returns the number of repeats run), the seconds it took, and whether there is a setup
    statement (something untimed between repeats). ``inner.once`` is the same function
    for ``n == 1``, without the inner loop."""
    t0 = _perf()
    setup_tree, setup_name = _parse(shell, setup or "pass")
    stmt_tree, stmt_name = _parse(shell, stmt or "pass")
    # Compile each part alone first: code valid only inside the template (a bare "return")
    # must be refused with the user's line numbers (IPython issue 10636).
    shell.compile(setup_tree, setup_name, "exec")
    shell.compile(stmt_tree, stmt_name, "exec")
    setup_body = setup_tree.body or [ast.Pass()]
    stmt_body = stmt_tree.body or [ast.Pass()]
    has_setup = not all(isinstance(st, ast.Pass) for st in setup_body)
    fns = []
    for template in (_TEMPLATE, _TEMPLATE_ONCE):
        filler = _Filler(copy.deepcopy(setup_body), copy.deepcopy(stmt_body))
        tree = ast.fix_missing_locations(filler.visit(ast.parse(template)))
        code = shell.compile(tree, stmt_name, "exec")
        ns: dict = {}
        exec(code, glob, ns)  # noqa: S102 - the user's own cell, as %timeit does
        fns.append(ns["__cudalab_timed_inner"])
    inner, inner.once = fns
    return inner, _perf() - t0, has_setup

