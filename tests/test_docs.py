"""The documentation site's checked facts.

* ``examples/quickstart.py``, which the quickstart page includes verbatim, runs (on the
  simulator here, on the GPU on a GPU machine).
* ``docs/torch_cuda_names.csv``, the table of "Differences from torch.cuda": no torch name is
  listed twice, every cudalab equivalent it names really exists (importlib + getattr), and,
  where torch is installed, it lists every name of torch's ``torch.cuda.__all__`` and
  ``torch.cuda.memory.__all__``. Rows marked ``pending=1`` name equivalents that another
  branch adds; they are skipped here (each one shows as a skip naming it) until that lands,
  and fail once the name exists, so the marker cannot outlive its reason.
* ``.ci/run`` runs exactly the README's test command, and that command builds the site with
  warnings as errors.

The site itself is built by the README's test command (``sphinx-build -W --keep-going``),
not by a test: one build serves CI and a reader.
"""

from __future__ import annotations

import collections
import csv
import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES_CSV = ROOT / "docs" / "torch_cuda_names.csv"
COLUMNS = ["torch_name", "cudalab", "pending", "listed_in", "note"]
LISTED_IN = {
    "torch.cuda.__all__",
    "torch.cuda.memory.__all__",
    "torch.cuda.__all__ and torch.cuda.memory.__all__",
    "private (not in __all__)",
    "attribute",
    "CUDA semantics notes",  # torch.backends.cuda, torch.fft, torch.matmul: the notes' sections
}
#: The prefixes of the names the table lists: torch.cuda's, and the switches and functions
#: torch's "CUDA semantics" notes describe beside them (TF32, the cuFFT plan cache).
NAME_PREFIXES = ("torch.cuda.", "torch.backends.cuda.", "torch.fft.")
NOTES_NAMES = {"torch.matmul", "torch.set_float32_matmul_precision",
               "torch.get_float32_matmul_precision"}


def _rows() -> list[dict[str, str]]:
    with NAMES_CSV.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == COLUMNS, f"{NAMES_CSV.name}: header {reader.fieldnames}"
        return list(reader)


ROWS = _rows()


def resolve(dotted: str) -> object:
    """The object a dotted name names: the longest importable module prefix, then getattr.

    Raises
    ------
    ImportError
        If not even the first component imports.
    AttributeError
        If an attribute after the module is missing.
    """
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            if cut == 1:
                raise
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise AssertionError("unreachable")  # pragma: no cover


def test_resolve_finds_and_misses():
    assert resolve("cudalab.memory.memory_allocated") is importlib.import_module(
        "cudalab.memory").memory_allocated
    assert resolve("cudalab.Stream.synchronize") is importlib.import_module("cudalab").Stream.synchronize
    with pytest.raises(AttributeError):
        resolve("cudalab.no_such_name")
    with pytest.raises(AttributeError):
        resolve("cudalab.Stream.no_such_attribute")


def test_names_file_is_well_formed():
    assert ROWS, f"{NAMES_CSV.name} is empty"
    for row in ROWS:
        name = row["torch_name"]
        assert name.startswith(NAME_PREFIXES) or name in NOTES_NAMES, name
        assert row["listed_in"] in LISTED_IN, f"{name}: listed_in {row['listed_in']!r}"
        assert row["pending"] in ("", "1"), f"{name}: pending {row['pending']!r}"
        assert row["cudalab"] or row["note"], f"{name}: no equivalent and no note saying why"
        assert not row["pending"] or row["cudalab"], f"{name}: pending but names no equivalent"
        assert row["cudalab"] == "" or row["cudalab"].startswith("cudalab."), name


def test_no_torch_name_is_listed_twice():
    counts = collections.Counter(row["torch_name"] for row in ROWS)
    assert [name for name, count in counts.items() if count > 1] == []


@pytest.mark.parametrize("row", [row for row in ROWS if row["cudalab"]],
                         ids=[row["torch_name"] for row in ROWS if row["cudalab"]])
def test_cudalab_equivalent_resolves(row):
    if row["pending"]:
        try:
            resolve(row["cudalab"])
        except (ImportError, AttributeError):
            pytest.skip(f"{row['cudalab']} is pending (added by another branch; pending=1 in the CSV)")
        pytest.fail(f"{row['cudalab']} exists now: remove its pending=1 in {NAMES_CSV.name}")
    resolve(row["cudalab"])


def test_names_file_covers_torch():
    torch = pytest.importorskip("torch")
    torch_memory = importlib.import_module("torch.cuda.memory")
    listed = {row["torch_name"] for row in ROWS}
    top = {f"torch.cuda.{name}" for name in torch.cuda.__all__}
    memory_only = {f"torch.cuda.memory.{name}" for name in torch_memory.__all__
                   if name not in torch.cuda.__all__}
    assert sorted((top | memory_only) - listed) == []


def test_quickstart_script_runs():
    env = dict(os.environ)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "after empty_cache: reserved 0 bytes" in result.stdout, result.stdout
    if env.get("CUDALAB_SIMULATOR") == "1":
        assert "simulated" in result.stdout


def test_copy_notebooks_copies_changed_and_drops_stale(tmp_path):
    spec = importlib.util.spec_from_file_location("docs_conf", ROOT / "docs" / "conf.py")
    assert spec is not None and spec.loader is not None
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)  # (also refreshes docs/notebooks/, which git ignores)
    source, target = tmp_path / "notebooks", tmp_path / "site"
    source.mkdir()
    (source / "a.ipynb").write_text("{}")
    (source / "b.ipynb").write_text('{"cells": []}')
    target.mkdir()
    (target / "gone.ipynb").write_text("{}")
    conf.copy_notebooks(source, target)
    assert sorted(path.name for path in target.iterdir()) == ["a.ipynb", "b.ipynb"]
    assert (target / "b.ipynb").read_text() == '{"cells": []}'
    os.utime(target / "a.ipynb", ns=(0, 0))  # a re-copy would restore the source's time
    (source / "b.ipynb").write_text('{"cells": [1]}')
    conf.copy_notebooks(source, target)
    assert (target / "b.ipynb").read_text() == '{"cells": [1]}'
    assert (target / "a.ipynb").stat().st_mtime_ns == 0, "an unchanged notebook was copied again"


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    tests = [command for command in commands if "pytest" in command]
    assert len(tests) == 1, f"README: {len(tests)} bash blocks run pytest, expected one"
    return tests[0].strip()


def test_ci_runs_the_readme_command_which_builds_the_site():
    command = _readme_test_command()
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    assert ci_lines[-1].strip() == command, ".ci/run must run exactly the README's test command"
    build = re.search(r"sphinx-build (.*?) docs docs/_build/html", command)
    assert build is not None, "the README's test command does not build the site"
    assert "-W" in build.group(1).split(), "the site is not built with warnings as errors"
    steps = command.split(" && ")
    sphinx = next(i for i, step in enumerate(steps) if "sphinx-build" in step)
    assert any("mypy" in step for step in steps[:sphinx]), "build the site after mypy"
    assert any("pytest" in step for step in steps[sphinx + 1:]), "build the site before pytest"


# --------------------------------------------------------------------------- issue 36 item 15
def test_magics_limits_do_not_deny_the_graph_mode():
    text = (ROOT / "docs" / "magics.md").read_text(encoding="utf-8")
    limits = text[text.index("## Limits"):]
    assert "### `--graph`" in text
    assert "CUDA-graph mode" not in limits and "No CUDA-graph" not in limits


def test_the_comm_example_runs_without_warnings():
    """docs/comm.md's first example, run as written, warns nothing (``destination=-1`` is
    deprecated, as in torch: a FutureWarning)."""
    import warnings

    import cudalab

    if cudalab.device_count() < 2:
        pytest.skip("the example uses two devices")
    text = (ROOT / "docs" / "comm.md").read_text(encoding="utf-8")
    example = re.findall(r"```python\n(.*?)\n```", text, flags=re.S)[0]
    assert "destination=-1" not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        namespace: dict = {}
        exec(compile(example, "docs/comm.md", "exec"), namespace)  # noqa: S102
    assert namespace["back"].tolist() == list(range(8))


def test_the_readme_extras_table_lists_every_extra():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme.splitlines() if line.startswith("| `.[")]
    listed = {name for row in rows for name in re.findall(r"`\.\[(\w+)\]`", row.split("|")[1])}
    assert sorted(set(extras) - listed) == [], "extras missing from the README's table"


def _documented_modules() -> set[str]:
    modules = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        modules |= set(re.findall(r"\.\. (?:currentmodule|automodule):: (\S+)",
                                  page.read_text(encoding="utf-8")))
    return modules


def test_notebooks_import_only_documented_public_names():
    """Every ``from cudalab... import name`` in the notebooks names a module of the API
    reference (docs/api) and a name in its ``__all__``."""
    import importlib
    import json

    documented = _documented_modules()
    bad = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "code":
                continue
            for line in "".join(cell["source"]).splitlines():
                m = re.match(r"\s*from (cudalab[\w.]*) import ([\w, ]+)", line)
                if not m:
                    continue
                module = importlib.import_module(m.group(1))
                exported = set(getattr(module, "__all__", ()))
                for name in (n.strip() for n in m.group(2).split(",")):
                    if f"{m.group(1)}.{name}" in documented:  # a documented submodule
                        continue
                    if m.group(1) not in documented or name not in exported:
                        bad.append(f"{path.name}: from {m.group(1)} import {name}")
    assert bad == []


def test_the_site_css_wraps_and_pads_the_tables():
    """The site's CSS: the differences table's cells wrap their code (they overlapped), API
    tables wrap and scroll (clipped), notebook output tables have padding and scroll
    sideways (the sanitizer's was cut off on the right)."""
    css = (ROOT / "docs" / "_static" / "cudalab.css").read_text(encoding="utf-8")
    rules: dict[str, str] = collections.defaultdict(str)
    for sels, body in re.findall(r"([^{}]+)\{([^}]*)\}", re.sub(r"/\*.*?\*/", "", css,
                                                                 flags=re.S)):
        for sel in sels.split(","):
            rules[sel.strip()] += body

    def rule(selector: str) -> str:
        assert selector in rules, f"no CSS rule for {selector}"
        return rules[selector]

    assert "overflow-wrap: anywhere" in rule("table.torch-names span.pre")
    assert "white-space: normal" in rule("table.autosummary td:first-child")
    assert "overflow-x: auto" in rule(".bd-content .pst-scrollable-table-container")
    assert "padding" in rule("div.cell_output .output.text_html table td")
    assert "overflow-x: auto" in rule("div.cell_output .output.text_html")
