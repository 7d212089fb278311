"""What ``pip install cudalab`` brings, and what ``import cudalab`` loads.

* pandas, matplotlib and ipykernel are core dependencies (the DataFrame exports and the
  plots work without an extra); pyarrow (``parquet``) and cupti-python (``cupti``) stay
  extras; cuda-bindings is used, not the cuda-python metapackage.
* None of the heavy packages is imported by ``import cudalab`` (a fresh interpreter).
* What ``history_frame()`` and ``plot_timeline()`` import at run time is all provided by
  core dependencies (or the standard library), so a fresh install without extras gives
  DataFrames and plots.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]

#: The packages ``import cudalab`` must not load (each is imported where it is used).
HEAVY = ("pandas", "matplotlib", "ipykernel", "ipywidgets", "cupti", "pyarrow")


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _names(requirements: list[str]) -> set[str]:
    """Distribution names of requirement strings, normalised (PEP 503)."""
    return {re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]).lower()
            for r in requirements}


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("CUDALAB_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full, timeout=180, cwd=ROOT)


def test_core_dependencies_and_extras():
    project = _project()
    core = _names(project["dependencies"])
    assert {"pandas", "matplotlib", "ipykernel", "ipython", "ipywidgets", "numpy"} <= core
    assert "cuda-bindings" in core and "cuda-python" not in core
    assert not core & {"pyarrow", "cupti-python"}  # extras only
    extras = {k: _names(v) for k, v in project["optional-dependencies"].items()}
    assert extras["parquet"] == {"pyarrow"}
    assert extras["pandas"] == {"pyarrow"}  # the alias of earlier releases
    assert extras["cupti"] == {"cupti-python"}
    assert not extras["widgets"] - core  # an alias: adds nothing beyond the core


def test_import_cudalab_loads_no_heavy_package():
    r = _python(f"""
        import sys, cudalab
        print([m for m in sys.modules if m.split('.')[0] in {HEAVY!r}])
    """, CUDALAB_SIMULATOR="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_frames_and_plots_need_no_extra():
    """history_frame() and plot_timeline() on the simulator, with the extras' packages made
    unimportable; every module they load comes from the standard library or a distribution
    that is a core dependency (or one of theirs), never from an extra."""
    r = _python("""
        import json, sys
        for extra in ("pyarrow", "cupti"):
            sys.modules[extra] = None  # import -> ImportError: as if not installed
        before = set(sys.modules)
        import cudalab, cudalab.memory as cm
        from cudalab.memory_tools.export import history_frame
        from cudalab.memory_tools.plot import plot_timeline
        cm._record_memory_history(max_entries=1000)
        x = cudalab.empty((1 << 20,), dtype="uint8"); del x
        df = history_frame()
        fig = plot_timeline(df)
        cm._record_memory_history(None)
        loaded = sorted({m.split('.')[0] for m in set(sys.modules) - before
                         if sys.modules.get(m) is not None})
        print(json.dumps({"frame": type(df).__module__, "rows": len(df),
                          "figure": type(fig).__module__, "loaded": loaded}))
    """, CUDALAB_SIMULATOR="1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["frame"].startswith("pandas") and out["rows"] >= 2
    assert out["figure"].startswith("matplotlib")
    from importlib.metadata import packages_distributions, requires

    dists = packages_distributions()
    allowed: set[str] = set()
    todo = list(_names(_project()["dependencies"]))
    while todo:  # the core dependencies and, transitively, what they bring
        name = todo.pop()
        if name in allowed:
            continue
        allowed.add(name)
        try:
            todo += _names([q for q in requires(name) or [] if "extra ==" not in q])
        except Exception:  # not installed here (a platform-only dependency)
            continue
    stdlib = set(sys.stdlib_module_names)
    checked = 0
    for top in out["loaded"]:
        if top in stdlib or top.startswith("_") or top == "cudalab" or top not in dists:
            continue  # (a module of no distribution: cython_runtime, an interpreter builtin)
        owners = _names(dists[top])
        assert owners & allowed, f"{top} ({owners}) is not brought by a core dependency"
        checked += 1
    assert checked >= 3  # numpy, pandas, matplotlib at least
