"""Every notebook in notebooks/ runs top to bottom (on the simulator in CI), and uses only
cudalab's public API.

Each notebook runs in a fresh interpreter inside an IPython InteractiveShell, cell by cell,
so magics work and a failing cell fails the test with its traceback.

The notebooks are what a user copies from, so an AST scan of their code cells (names bound
in one cell count in the later ones) fails on any ``_``-prefixed cudalab module or name:
``import cudalab._x``, ``from cudalab._x import y``, ``from cudalab.x import _y``, and
``X._y`` where ``X`` names something imported from cudalab (``cudalab.devices._backend()``).
The only exceptions are the names torch itself spells with an underscore and cudalab mirrors
as public API (:data:`TORCH_SPELLED`).

The notebooks are committed executed on the simulator, so a reader on a code host sees
their outputs: each has outputs, its code cells ran in order, and every text output that
shows a device says "simulated". A notebook that needs a library CI lacks (its metadata's
``cudalab.requires``, e.g. ``["torch"]``: 09_torch_sources) is skipped where that library is
missing, saying so, and is committed with outputs captured on a GPU (its metadata's
``cudalab.captured_on`` names the device; ``python -m tests.helpers.capture_notebook``
executes it there). A notebook that needs more devices than a real machine has (its
metadata's ``cudalab.devices``: 06_collectives needs 2) runs there on the simulator.
To refresh the simulator's notebooks after editing one::

    CUDALAB_SIMULATOR=1 .venv/bin/python -m tests.test_notebooks --execute

(``jupyter nbconvert --execute --inplace``, then :func:`slim`: no widget state, no timing
metadata, so the files stay small and diffs show only what changed).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
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


def _cudalab_metadata(path: pathlib.Path) -> dict:
    """The notebook's ``metadata.cudalab``: ``requires`` (modules it needs), ``captured_on``
    (the GPU its committed outputs come from; None until captured)."""
    return json.loads(path.read_text()).get("metadata", {}).get("cudalab") or {}


def _missing(path: pathlib.Path) -> list[str]:
    """The modules ``path`` requires that cannot be imported here."""
    import importlib.util

    return [m for m in _cudalab_metadata(path).get("requires", [])
            if importlib.util.find_spec(m) is None]


def _needs_simulator(path: pathlib.Path) -> bool:
    """Whether ``path`` needs more devices (its metadata's ``cudalab.devices``, e.g. 2 for
    06_collectives) than this real machine has: it then runs on the simulator, which has
    two, as CI runs it (its committed outputs are the simulator's)."""
    needed = int(_cudalab_metadata(path).get("devices", 1))
    if os.environ.get("CUDALAB_SIMULATOR") == "1" or needed <= 1:
        return False
    import cudalab

    return cudalab.device_count() < needed


def test_needs_simulator_reads_the_devices_metadata(tmp_path):
    nb = tmp_path / "two.ipynb"
    nb.write_text(json.dumps({"cells": [], "metadata": {"cudalab": {"devices": 2}}}))
    one = tmp_path / "one.ipynb"
    one.write_text(json.dumps({"cells": [], "metadata": {}}))
    import cudalab

    real = os.environ.get("CUDALAB_SIMULATOR") != "1"
    assert _needs_simulator(nb) == (real and cudalab.device_count() < 2)
    assert not _needs_simulator(one)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    missing = _missing(path)
    if missing:
        pytest.skip(f"{path.name} needs {', '.join(missing)}, not installed here (CI has no "
                    "torch): it runs on a GPU, where its outputs are captured")
    env = dict(os.environ)
    if _needs_simulator(path):
        env["CUDALAB_SIMULATOR"] = "1"
    r = subprocess.run([sys.executable, "-c", RUNNER, str(path)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "notebook ok" in r.stdout


#: torch's own public names that it spells with an underscore, which cudalab mirrors as public
#: API under the same names: torch.cuda.memory's documented ``_record_memory_history``,
#: ``_snapshot`` and ``_dump_snapshot`` (cudalab.memory), and torch.cuda.jiterator's
#: ``_create_jit_fn`` and ``_create_multi_output_jit_fn`` (cudalab.jiterator). Any other
#: underscore name stays private (``cudalab.jiterator._JittedFunction`` included).
TORCH_SPELLED = frozenset({"_record_memory_history", "_snapshot", "_dump_snapshot",
                           "_create_jit_fn", "_create_multi_output_jit_fn"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _python_of(cell: str) -> list[str]:
    """The Python of a code cell, as snippets to scan in order: the cell as IPython runs it
    (magics turned into ``get_ipython().run_*_magic(name, line[, body])`` calls), each cell
    magic's body (the magics used here run it as Python), and the Python statement that
    ends a magic's argument line (``%cuda_timed -n 2 gpu_sleep(5)``: its longest tail that
    parses)."""
    from IPython.core.inputtransformer2 import TransformerManager

    out = [TransformerManager().transform_cell(cell)]
    for node in ast.walk(ast.parse(out[0])):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("run_line_magic", "run_cell_magic")):
            continue
        args = [a.value for a in node.args if isinstance(a, ast.Constant)]
        if len(args) >= 2 and isinstance(args[1], str):
            words = args[1].split()
            for k in range(len(words)):
                tail = " ".join(words[k:])
                try:
                    ast.parse(tail)
                except SyntaxError:
                    continue
                out.append(tail)
                break
        if node.func.attr == "run_cell_magic" and len(args) == 3:
            out.extend(_python_of(args[2]))
    return out


def private_uses(cells: list[str], name: str = "<notebook>") -> list[str]:
    """Every use of a private cudalab module or name in ``cells`` (one notebook's code cells,
    in order), as ``"name cell N line L: what"`` strings.

    Raises
    ------
    SyntaxError
        A cell is not Python as IPython runs it (the scan must see every cell).
    """
    out: list[str] = []
    bound: set[str] = set()  # names bound to cudalab modules or objects imported from cudalab
    trees = [(i, ast.parse(src, f"{name} cell {i}"))
             for i, cell in enumerate(cells) for src in _python_of(cell)]
    for i, tree in trees:

        def bad(node: ast.AST, what: str, i: int = i) -> None:
            out.append(f"{name} cell {i} line {getattr(node, 'lineno', '?')}: {what}")

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] != "cudalab":
                        continue
                    if any(_private(p) for p in parts):
                        bad(node, f"imports {alias.name}")
                    bound.add(alias.asname or parts[0])
            elif isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] != "cudalab":
                    continue
                if any(_private(p) for p in parts):
                    bad(node, f"imports from {node.module}")
                for alias in node.names:
                    if _private(alias.name) and alias.name not in TORCH_SPELLED:
                        bad(node, f"imports {node.module}.{alias.name}")
                    bound.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            chain = [node.attr]
            root: ast.AST = node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Call):  # cudalab.f()._x: the object a cudalab call made
                inner = root.func
                while isinstance(inner, ast.Attribute):
                    inner = inner.value
                root = inner
            if not (isinstance(root, ast.Name) and root.id in bound):
                continue
            if _private(node.attr) and node.attr not in TORCH_SPELLED:
                bad(node, f"reads {root.id}...{node.attr}")
    return out


def _code_cells(path: pathlib.Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_uses_only_public_api(path):
    assert private_uses(_code_cells(path), path.name) == []


def test_the_notebooks_are_found():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("cells", [
    ["import cudalab\nprint(cudalab.devices._backend().name)"],
    ["import cudalab\n", "x = cudalab.devices._tls"],
    ["from cudalab._kernels.spin import gpu_sleep"],
    ["import cudalab._internal"],
    ["from cudalab import _internal"],
    ["from cudalab.memory import _LAZY"],
    ["import cudalab.memory as cm\n", "cm._LAZY"],
    ["from cudalab import memory\nmemory._reader(0)"],
    ["import cudalab\ncudalab.get_device_properties(0)._info"],
    ["%load_ext cudalab\nimport cudalab", "%%cuda_timed -n 1\ncudalab.devices._backend()"],
    ["import cudalab", "%%cuda_timed -n 1 x = cudalab._driver\npass"],
    ["import cudalab", "r = %cuda_timed -o -q -n 2 cudalab.devices._tls"],
    ["import cudalab\ncudalab.jiterator._JittedFunction"],
    ["from cudalab.jiterator import _JittedFunction"],
    ["from cudalab import jiterator\njiterator._create_jit_fn('...')._function"],
    ["import cudalab._kernels.elementwise as e\ne._create_jit_fn"],
])
def test_the_scan_catches_planted_private_uses(cells):
    assert len(private_uses(cells)) == 1


@pytest.mark.parametrize("cells", [
    ["import cudalab\nprint(cudalab.get_device_properties(0).simulated)"],
    ["from cudalab.kernels import gpu_sleep\ngpu_sleep(1000)"],
    ["import cudalab.memory as cm\nsnap = cm._snapshot()"],
    ["import cudalab\ncudalab.memory._record_memory_history(context=None)"],
    ["import numpy as np\nnp.random._bit_generator"],  # not cudalab's
    ["import cudalab\nx = cudalab.zeros((4,))\nx.__cuda_array_interface__"],
    ["import cudalab\nf = cudalab.jiterator._create_jit_fn('...', a=2.0)\nf(1.0, a=3.0)"],
    ["import cudalab.jiterator\ncudalab.jiterator._create_multi_output_jit_fn('...', 2)"],
    ["from cudalab.jiterator import _create_jit_fn, _create_multi_output_jit_fn"],
])
def test_the_scan_allows_public_api(cells):
    assert private_uses(cells) == []


# --------------------------------------------------------------------------- committed outputs
#: What a code cell's outputs may weigh once committed (widget state is never committed).
MAX_NOTEBOOK_BYTES = 200_000
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
SHOWS_A_DEVICE = re.compile(r"\bcuda:\d|\bGPU\b")


def _texts(output: dict) -> list[str]:
    """The plain text a reader sees of one output (stream text, ``text/plain``)."""
    if output.get("output_type") == "stream":
        text = output.get("text", "")
        return ["".join(text) if isinstance(text, list) else text]
    plain = output.get("data", {}).get("text/plain")
    if plain is None:
        return []
    return ["".join(plain) if isinstance(plain, list) else plain]


def slim(nb: dict) -> dict:
    """``nb`` as committed: no widget state (it is hundreds of KB; the outputs keep their
    static PNG/HTML/text pictures, so no widget view is left either), no per-cell timing."""
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data and WIDGET_MIME in data and len(data) > 1:
                del data[WIDGET_MIME]
    return nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_executed_on_the_simulator(path):
    if _cudalab_metadata(path).get("requires"):
        pytest.skip(f"{path.name} is captured on a GPU: test_gpu_notebook_is_committed_executed")
    raw = path.read_bytes()
    assert len(raw) <= MAX_NOTEBOOK_BYTES, f"{path.name}: {len(raw):,} bytes (widget state?)"
    nb = json.loads(raw)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), \
        f"{path.name}: not executed top to bottom (execution counts {counts}); see the module doc"
    assert any(c["outputs"] for c in code), f"{path.name} has no outputs"
    assert "widgets" not in nb.get("metadata", {}), f"{path.name} carries widget state"
    shown = 0
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", f"{path.name} cell {i} raised"
            assert WIDGET_MIME not in out.get("data", {}), f"{path.name} cell {i}: widget view"
            for text in _texts(out):
                if SHOWS_A_DEVICE.search(text):
                    shown += 1
                    assert "simulated" in text, \
                        f"{path.name} cell {i} shows a device but not that it is simulated: " \
                        f"{text[:200]!r}"
    assert shown, f"{path.name}: no output shows the (simulated) device"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if _cudalab_metadata(p).get("requires")],
                         ids=lambda p: p.name)
def test_gpu_notebook_is_committed_executed(path):
    """A notebook captured on a GPU: executed top to bottom there, no error, no widget state;
    until its capture is committed (``captured_on`` None) it is skipped, saying so."""
    device = _cudalab_metadata(path).get("captured_on")
    if not device:
        pytest.skip(f"{path.name}: its GPU capture is not committed yet (python -m "
                    "tests.helpers.capture_notebook writes it)")
    raw = path.read_bytes()
    assert len(raw) <= MAX_NOTEBOOK_BYTES, f"{path.name}: {len(raw):,} bytes (widget state?)"
    nb = json.loads(raw)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c.get("execution_count") for c in code] == list(range(1, len(code) + 1))
    assert all(c["outputs"] for c in code[:2]), f"{path.name}: no outputs"
    assert "widgets" not in nb.get("metadata", {}), f"{path.name} carries widget state"
    texts = []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", f"{path.name} cell {i} raised"
            assert WIDGET_MIME not in out.get("data", {}), f"{path.name} cell {i}: widget view"
            texts += _texts(out)
    assert any(device in t for t in texts), f"{path.name}: no output shows {device}"


def _execute() -> None:  # pragma: no cover - a maintenance command, see the module doc
    if os.environ.get("CUDALAB_SIMULATOR") != "1":
        sys.exit("run with CUDALAB_SIMULATOR=1: the committed outputs are the simulator's")
    jupyter = pathlib.Path(sys.executable).with_name("jupyter")
    ours = [p for p in NOTEBOOKS if not _cudalab_metadata(p).get("requires")]
    subprocess.run([str(jupyter), "nbconvert", "--to", "notebook", "--execute", "--inplace",
                    "--ExecutePreprocessor.timeout=300", *map(str, ours)], check=True)
    for path in ours:
        nb = slim(json.loads(path.read_text()))
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        print(f"{path.name}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:] != ["--execute"]:
        sys.exit("usage: python -m tests.test_notebooks --execute")
    _execute()
