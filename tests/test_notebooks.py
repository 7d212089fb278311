"""Every notebook in notebooks/ runs top to bottom (on the simulator in CI).

Each notebook runs in a fresh interpreter inside an IPython InteractiveShell, cell by cell,
so magics work and a failing cell fails the test with its traceback.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

RUNNER = r"""
import json, sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
nb = json.load(open(sys.argv[1]))
for i, cell in enumerate(nb["cells"]):
    if cell["cell_type"] != "code":
        continue
    src = "".join(cell["source"])
    res = shell.run_cell(src, store_history=True)
    if not res.success:
        print(f"CELL {i} FAILED:\n{src}", file=sys.stderr)
        sys.exit(1)
print("notebook ok")
"""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", RUNNER, str(path)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "notebook ok" in r.stdout
