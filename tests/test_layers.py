"""The Jupyter layer uses only cudalab's public names and :mod:`cudalab._internal`.

An AST scan of every module of ``cudalab/magics`` and ``cudalab/widgets`` (imports inside
functions included). It fails on

* an import of a ``_``-prefixed cudalab module other than ``cudalab._internal``
  (``import cudalab._driver``, ``from cudalab._driver.base import X``,
  ``from cudalab import _driver``);
* an import of a ``_``-prefixed name from a cudalab module outside the scanned package
  (``from cudalab.nvml import _nvml``); the package's own privates are fine;
* an attribute access ``X._name`` where ``X`` was bound by importing a cudalab module or
  class from outside the package (``devices._backend()``, ``Event._handle``,
  ``cudalab.devices._tls``).

The import-linter contract in pyproject.toml checks the module imports too; this test also
sees names and attributes, which import-linter does not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cudalab.magics", "cudalab.widgets")
ALLOWED = "cudalab._internal"


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _own(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(source: str, package: str, filename: str = "<string>") -> list[str]:
    """Every reach into another cudalab module's privates in ``source`` (a module of
    ``package``), as ``"file:line: what"`` strings."""
    tree = ast.parse(source, filename)
    out: list[str] = []
    bound: set[str] = set()  # names bound to cudalab modules/classes from outside the package

    def bad(node: ast.AST, what: str) -> None:
        out.append(f"{filename}:{getattr(node, 'lineno', '?')}: {what}")

    def check_module(node: ast.AST, module: str) -> None:
        if module == ALLOWED or module.startswith(ALLOWED + "."):
            return
        if any(_private(p) for p in module.split(".")) and not _own(module, package):
            bad(node, f"imports the private module {module}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "cudalab":
                    continue
                check_module(node, alias.name)
                if not _own(alias.name, package):
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            if module.split(".")[0] != "cudalab":
                continue
            check_module(node, module)
            if _own(module, package):
                continue
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if full == ALLOWED:
                    continue
                if _private(alias.name):
                    bad(node, f"imports the private name {full}")
                    continue
                bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        root: ast.AST = node.value
        chain = [node.attr]
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if not (isinstance(root, ast.Name) and root.id in bound):
            continue
        dotted = ".".join([root.id, *reversed(chain)])
        if dotted == ALLOWED or dotted.startswith(ALLOWED + "."):
            continue
        # the first private step of the chain is the reach-in (cudalab._internal.x is fine)
        bad(node, f"reaches into the private attribute {dotted}")
    return out


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package in PACKAGES:
        folder = ROOT.joinpath(*package.split("."))
        for path in sorted(folder.rglob("*.py")):
            found.append((package, path))
    return found


@pytest.mark.parametrize("package,path", _modules(), ids=lambda x: str(x).rsplit("/", 1)[-1])
def test_jupyter_layer_uses_only_public_names_and_internal(package, path):
    found = violations(path.read_text(encoding="utf-8"), package, str(path.relative_to(ROOT)))
    assert not found, "\n".join(found)


def test_the_scan_covers_both_packages():
    names = {p.parent.name for _pkg, p in _modules()}
    assert names == {"magics", "widgets"}
    assert len(_modules()) >= 6


@pytest.mark.parametrize("source", [
    "from cudalab._driver.base import STATUS_NOT_READY\n",
    "import cudalab._driver\n",
    "from cudalab import _driver\n",
    "def f():\n    from cudalab.nvml import _nvml\n",
    "from cudalab import devices\ndevices._backend()\n",
    "def f():\n    from cudalab import devices\n    return devices._tls.device\n",
    "import cudalab.memory as cm\ncm._snapshot()\n",
    "import cudalab\ncudalab.devices._fast\n",
    "from cudalab.events import Event\ndef f(e):\n    return Event._handle\n",
    "from cudalab.memory_tools import history as hist\nhist._stop(clear=False)\n",
    "from cudalab.memory_tools.plot import _human\n",
])
def test_the_scan_catches_planted_reach_ins(source):
    assert violations(source, "cudalab.magics"), source


@pytest.mark.parametrize("source", [
    "from cudalab import _internal\n_internal.backend()\n",
    "from cudalab._internal import STATUS_NOT_READY, format_bytes\n",
    "import cudalab._internal\n",
    "from cudalab.magics.event_timer import _EventTimer\n",
    "from cudalab.magics import timed as tm\ntm._nice_ceil(3)\n",
    "from cudalab import devices\ndevices.current_device()\n",
    "class A:\n    def f(self):\n        return self._x\n",
    "from cudalab.events import Event\nEvent.__name__\n",
])
def test_the_scan_allows_public_names_internal_and_own_privates(source):
    assert violations(source, "cudalab.magics") == []


# ------------------------------------------------------------------ the import contracts
def _contracts() -> dict[str, dict]:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def _top_level_modules() -> set[str]:
    pkg = ROOT / "cudalab"
    names = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return names


def test_the_layers_contract_names_every_top_level_module_once():
    """A new module must be given its layer: one the contract does not name is unchecked."""
    layers = _contracts()["layers"]["layers"]
    named = [m.strip() for layer in layers for m in layer.replace(":", "|").split("|")]
    assert sorted(named) == sorted(set(named)), "a module is named in two layers"
    assert set(named) == _top_level_modules()


def test_the_seam_contract_covers_every_module_but_the_driver():
    sources = set(_contracts()["seam"]["source_modules"])
    assert sources == {f"cudalab.{m}" for m in _top_level_modules() - {"_driver"}}


def test_the_jupyter_contract_forbids_every_private_module_but_internal():
    forbidden = set(_contracts()["jupyter-internal-api"]["forbidden_modules"])
    private = {m for m in _top_level_modules() if m.startswith("_") and not m.startswith("__")}
    assert forbidden == {f"cudalab.{m}" for m in private - {"_internal"}}


def test_every_package_of_cudalab_is_a_regular_package():
    """import-linter (grimp) sees only regular packages: a folder without __init__.py
    (a namespace package) would silently drop out of every contract."""
    for folder in (ROOT / "cudalab").rglob("*"):
        if folder.is_dir() and any(folder.glob("*.py")) and folder.name != "__pycache__":
            assert (folder / "__init__.py").exists(), folder
