"""Running notebook cells in IPython's test shell for the magics' tests."""

from __future__ import annotations

from typing import Any

from IPython.utils.capture import capture_output


def run_cell(shell: Any, source: str) -> tuple[Any, list[str]]:
    """Run ``source`` as a cell (not stored in the history); (ExecutionResult, the
    ``text/plain`` of each display it made)."""
    with capture_output() as cap:
        result = shell.run_cell(source, store_history=False)
    return result, [o.data.get("text/plain", "") for o in cap.outputs]


def run_cell_printing(shell: Any, source: str) -> tuple[Any, str]:
    """Run ``source`` as a cell, stored in the history as a user's is; (ExecutionResult,
    what it printed)."""
    with capture_output() as cap:
        result = shell.run_cell(source, store_history=True)
    return result, cap.stdout
