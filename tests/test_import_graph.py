"""cudalab's import graph has no cycle, and no layer imports a layer above it.

import-linter checks both (the ``layers`` and ``acyclic`` contracts in ``pyproject.toml``),
but it skips imports under ``TYPE_CHECKING`` (``exclude_type_checking_imports``) and works on
packages as wholes. This test builds its own graph, module by module, from every ``import``
and ``from ... import`` anywhere in every file of ``cudalab`` (inside functions, classes and
``TYPE_CHECKING`` blocks too; relative imports resolved; ``from package import name`` is an
edge to the submodule ``package.name`` when there is one, else to the package), and fails

* on any cycle between two or more modules (the cycle is named, edge by edge, with lines);
* on any import from a module in a lower layer to one in a higher layer (the layers are the
  ``layers`` contract of ``pyproject.toml``, read here, not copied). An import of the
  ``cudalab`` package itself (``import cudalab`` to reach the public API) counts as an
  import of every module that ``cudalab/__init__.py`` imports;
* on any read through the package's names from a lower layer to a higher one: after
  ``import cudalab``, ``cudalab.memory_stats(...)`` or ``cudalab.memory.private_pools(...)``
  (and ``from cudalab import memory_stats``) uses the module the name comes from, though
  ``__init__`` imports it lazily (its ``_LAZY`` names and ``_SUBMODULES``, read from its text);
  the excused reads are listed in ``PACKAGE_READS_EXCUSED``, each with its reason.

Compiled extension modules (``fastcall``, ...) are nodes with no imports, named as
``setup.py`` declares them (built or not).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project's interpreter is 3.11+
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "cudalab"

#: Edges excused here while another part of issue 35 removes them (each is
#: ``(importer, imported)``); empty now that the DeviceArray mixins no longer import
#: array.py. ``test_every_pending_edge_is_still_needed`` fails on an entry that is gone or
#: that hides nothing any more, so the set can only shrink.
PENDING: frozenset[tuple[str, str]] = frozenset()


# ----------------------------------------------------------------------------- the graph
def extension_names(setup: Path = ROOT / "setup.py") -> list[str]:
    """The compiled extension modules that ``setup.py`` declares (``Extension("name", ...)``),
    read from its text: they are modules whether or not they are built here."""
    names = []
    for node in ast.walk(ast.parse(setup.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension"
                and node.args and isinstance(node.args[0], ast.Constant)):
            names.append(str(node.args[0].value))
    return names


def module_names(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``root`` (sources and the compiled extensions that
    ``setup.py`` declares), by dotted name; a package is named by its ``__init__.py``."""
    modules: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    if (root / "setup.py").exists():
        for name in extension_names(root / "setup.py"):
            modules.setdefault(name, root / "setup.py")
    return modules


def imports_of(module: str, source: str, is_package: bool,
               known: Iterable[str]) -> dict[str, list[int]]:
    """The modules of ``known`` that ``source`` (the text of ``module``) imports anywhere,
    each with the lines that import it. A name that is not a known module stands for the
    nearest known package above it."""
    known = set(known)
    here = module if is_package else module.rpartition(".")[0]
    found: dict[str, list[int]] = {}

    def nearest(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.append(full if full in known else base)
        for target in targets:
            hit = nearest(target)
            if hit is not None and hit != module:
                found.setdefault(hit, []).append(node.lineno)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, list[int]]]:
    """importer -> {imported: [lines]} over every module of ``package``."""
    modules = module_names(root, package)
    graph: dict[str, dict[str, list[int]]] = {}
    for name, path in modules.items():
        if path.name == "setup.py":  # a compiled extension: no Python imports
            graph[name] = {}
            continue
        graph[name] = imports_of(name, path.read_text(encoding="utf-8"),
                                 path.name == "__init__.py", modules)
    return graph


def cycles(graph: Mapping[str, Mapping[str, object]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative),
    each sorted; sorted by their first member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def describe_cycle(component: list[str], graph: Mapping[str, Mapping[str, list[int]]]) -> str:
    """One closed path through ``component`` (``a -> b (l.3) -> a (l.9)``) and its size."""
    members = set(component)
    start = component[0]
    # breadth-first from start back to start, inside the component
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in previous:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child in members and child not in previous:
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    path = [start]
    node = previous[start]
    while node != start:
        path.append(node)
        node = previous[node]
    path.append(start)
    path.reverse()
    steps = [path[0]] + [f"{b} (l.{graph[a][b][0]})" for a, b in zip(path, path[1:])]
    return f"{len(component)} modules, e.g. " + " -> ".join(steps)


# ---------------------------------------------------------------------------- the layers
def layer_ranks(pyproject: Path = ROOT / "pyproject.toml", package: str = PACKAGE) -> dict[str, int]:
    """Top-level module -> its layer's position in the ``layers`` contract (0 = top)."""
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c.get("type") == "layers"]
    ranks: dict[str, int] = {}
    for position, layer in enumerate(layers):
        for name in layer.replace(":", "|").split("|"):
            ranks[f"{package}.{name.strip()}"] = position
    return ranks


def top_level(module: str, package: str = PACKAGE) -> str | None:
    """``cudalab.x`` for any module at or under ``cudalab.x``; None for the package."""
    parts = module.split(".")
    return None if len(parts) < 2 else ".".join(parts[:2])


def upward_imports(graph: Mapping[str, Mapping[str, list[int]]], ranks: Mapping[str, int],
                   package: str = PACKAGE) -> list[str]:
    """Every import from a lower layer to a higher one, as ``a -> b (l.N): layer i -> j``.

    Modules in the same layer (e.g. inside one package) may import each other; the cycle
    check covers them. An import of ``package`` itself stands for the imports of its
    ``__init__``."""
    root_imports = graph.get(package, {})
    out = []
    for importer, imported in graph.items():
        source = top_level(importer, package)
        if source is None:
            continue
        for target, lines in imported.items():
            targets = root_imports if target == package else {target: lines}
            for real in targets:
                destination = top_level(real, package)
                if destination is None or destination == source:
                    continue
                if ranks[destination] < ranks[source]:
                    via = f" (via {package})" if target == package else ""
                    out.append(f"{importer} -> {real}{via} (l.{lines[0]}): "
                               f"layer {ranks[source]} -> {ranks[destination]}")
    return sorted(out)


# ------------------------------------------------------ reads through the package's names
def package_names(init: Path = ROOT / PACKAGE / "__init__.py",
                  package: str = PACKAGE) -> dict[str, str]:
    """Each public name of ``package`` -> the module it comes from, read from the text of its
    ``__init__.py``: the names it imports at module level, its lazy names (the ``_LAZY``
    table: ``"name": "module"`` items and ``**{name: "module" for name in (...)}`` spreads)
    and its lazily imported submodules (``_SUBMODULES``)."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = (
                    f"{node.module}.{alias.name}" if node.module == package else node.module)
            continue
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        target = [t.id for t in targets if isinstance(t, ast.Name)]
        if target == ["_SUBMODULES"]:
            for name in ast.literal_eval(node.value):
                names[name] = f"{package}.{name}"
        elif target == ["_LAZY"] and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                if key is not None:  # "name": "module"
                    names[ast.literal_eval(key)] = ast.literal_eval(value)
                    continue
                assert isinstance(value, ast.DictComp), ast.dump(value)  # **{n: "m" for n in (...)}
                module = ast.literal_eval(value.value)
                for name in ast.literal_eval(value.generators[0].iter):
                    names[name] = module
    return names


def reads_through_package(module: str, source: str, names: Mapping[str, str],
                          known: Iterable[str], package: str = PACKAGE) -> dict[str, list[int]]:
    """The modules that ``source`` (the text of ``module``) reaches through the package's
    public names rather than by importing them: ``cudalab.memory_stats(...)`` or
    ``cudalab.memory.private_pools(...)`` after ``import cudalab`` (any name the package is
    bound to), and ``from cudalab import memory_stats``; each with the lines. ``names`` is
    :func:`package_names`; an attribute that is a module of ``known`` is that module."""
    known = set(known)
    tree = ast.parse(source)
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or (alias.asname is None
                                             and alias.name.startswith(package + ".")):
                    bound.add(alias.asname or package)
    found: dict[str, list[int]] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != module:
            found.setdefault(target, []).append(line)

    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound):
            sub = f"{package}.{node.attr}"
            add(sub if sub in known else names.get(node.attr), node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == package:
            for alias in node.names:
                if f"{package}.{alias.name}" not in known:
                    add(names.get(alias.name), node.lineno)
    return found


def package_read_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, list[int]]]:
    """reader -> {module reached through the package's names: [lines]} over ``package``."""
    modules = module_names(root, package)
    names = package_names(root / package / "__init__.py", package)
    return {name: reads_through_package(name, path.read_text(encoding="utf-8"), names, modules,
                                        package)
            for name, path in modules.items() if path.name != "setup.py"}


#: Reads through the package's names that go up a layer, each excused with its reason
#: (``(reader, module reached)``). ``test_every_excused_package_read_is_still_needed`` fails
#: on an entry that no longer reads up, so the table can only shrink.
PACKAGE_READS_EXCUSED: dict[tuple[str, str], str] = {
    ("cudalab.memory_tools.export", "cudalab.memory"):
        "stats_frame() is a frame of cudalab.memory.memory_stats() per device, torch's 122 "
        "keys for a device without an allocator too (the zero figures, max_split_size and "
        "the syncs counted before creation live in memory.py only); it is re-exported as "
        "cudalab.memory.stats_frame and moves up with the other frames' readers later",
}


def without(graph: Mapping[str, Mapping[str, list[int]]],
            edges: Iterable[tuple[str, str]]) -> dict[str, dict[str, list[int]]]:
    """A copy of ``graph`` without ``edges``."""
    drop = set(edges)
    return {a: {b: lines for b, lines in targets.items() if (a, b) not in drop}
            for a, targets in graph.items()}


# ----------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, list[int]]]:
    return import_graph()


def test_the_import_graph_has_no_cycle(graph):
    found = cycles(without(graph, PENDING))
    assert not found, "import cycles:\n" + "\n".join(describe_cycle(c, graph) for c in found)


def test_no_layer_imports_a_layer_above_it(graph):
    found = upward_imports(without(graph, PENDING), layer_ranks())
    assert not found, "imports from a lower layer up:\n" + "\n".join(found)


def test_no_layer_reads_a_layer_above_through_the_package():
    """``import cudalab`` then ``cudalab.memory_stats()`` in a lower layer is an upward reach
    hidden behind the package (its lazy names import the module on first use): it counts as
    an import of the module the name comes from."""
    reads = without(package_read_graph(), PACKAGE_READS_EXCUSED)
    found = upward_imports(reads, layer_ranks())
    assert not found, ("reads through the cudalab package from a lower layer up (import "
                       "the module from a layer at or above it, or excuse it in "
                       "PACKAGE_READS_EXCUSED with a reason):\n" + "\n".join(found))


def test_every_excused_package_read_is_still_needed():
    """An excused read that is gone, or no longer goes up a layer, must leave the table."""
    ranks = layer_ranks()
    reads = package_read_graph()
    stale = []
    for (reader, module), reason in PACKAGE_READS_EXCUSED.items():
        assert reason.strip(), f"give the reason for excusing {reader} -> {module}"
        lines = reads.get(reader, {}).get(module)
        if not lines or not upward_imports({reader: {module: lines}}, ranks):
            stale.append((reader, module))
    assert not stale, f"remove from PACKAGE_READS_EXCUSED (no longer read up): {stale}"


def test_every_top_level_module_has_a_layer(graph):
    ranks = layer_ranks()
    missing = sorted({top_level(m) for m in graph} - set(ranks) - {None})
    assert not missing, f"modules in no layer of pyproject.toml: {missing}"


def test_every_pending_edge_is_still_needed(graph):
    """An excused edge that is gone, or whose excuse no longer hides a cycle or an upward
    import, must leave PENDING (the set only shrinks)."""
    ranks = layer_ranks()
    gone = sorted(edge for edge in PENDING if edge[1] not in graph.get(edge[0], {}))
    assert not gone, f"remove from PENDING (these imports are gone): {gone}"
    unneeded = []
    for edge in sorted(PENDING):
        rest = without(graph, PENDING - {edge})
        if not cycles(rest) and not upward_imports(rest, ranks):
            unneeded.append(edge)
    assert not unneeded, f"remove from PENDING (nothing wrong is left without them): {unneeded}"


def test_the_graph_sees_every_kind_of_import(graph):
    # a top-level import, one inside a function, one under TYPE_CHECKING, a relative one
    # and a compiled extension: each is an edge (or a node) of the real graph
    assert "cudalab.devices" in graph["cudalab.streams"]  # module level
    assert "cudalab._internal" in graph["cudalab.streams"]  # inside functions only
    assert "cudalab._driver.base" in graph["cudalab.events"]  # also under TYPE_CHECKING
    assert "cudalab._driver.fastcall" in graph["cudalab._driver.cuda"]  # an extension
    assert graph["cudalab._driver.fastcall"] == {}
    assert len(graph) > 100


# ------------------------------------------------------------------- planted cases: it fails
def _graph_of(sources: dict[str, str]) -> dict[str, dict[str, list[int]]]:
    names = set(sources)
    return {name: imports_of(name, text, name.count(".") == 0 or name.endswith(".pkg"), names)
            for name, text in sources.items()}


@pytest.mark.parametrize("sources, cycle", [
    # module level both ways
    ({"cudalab": "", "cudalab.a": "import cudalab.b\n", "cudalab.b": "from cudalab import a\n"},
     ["cudalab.a", "cudalab.b"]),
    # one side inside a function, the other under TYPE_CHECKING
    ({"cudalab": "", "cudalab.a": "def f():\n    from cudalab.b import x\n",
      "cudalab.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from cudalab.a import Y\n"},
     ["cudalab.a", "cudalab.b"]),
    # three modules, one relative import, inside a package
    ({"cudalab": "", "cudalab.pkg": "", "cudalab.pkg.a": "from .b import x\n",
      "cudalab.pkg.b": "from cudalab.pkg import c\n", "cudalab.pkg.c": "import cudalab.pkg.a\n"},
     ["cudalab.pkg.a", "cudalab.pkg.b", "cudalab.pkg.c"]),
])
def test_a_planted_cycle_is_found(sources, cycle):
    graph = _graph_of(sources)
    assert cycles(graph) == [cycle]
    message = describe_cycle(cycle, graph)
    assert message.startswith(f"{len(cycle)} modules, e.g. {cycle[0]} -> ")
    assert message.endswith(f"-> {cycle[0]} (l.{message.rsplit('(l.', 1)[1]}")


def test_an_acyclic_graph_has_no_cycle():
    graph = _graph_of({"cudalab": "", "cudalab.a": "import cudalab.b\n",
                       "cudalab.b": "import cudalab.c\n", "cudalab.c": "import os\n"})
    assert cycles(graph) == []


RANKS = {"cudalab.top": 0, "cudalab.mid": 1, "cudalab.low": 2}


@pytest.mark.parametrize("sources, expected", [
    ({"cudalab.low": "def f():\n    from cudalab import mid\n"}, "cudalab.low -> cudalab.mid"),
    ({"cudalab.low": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    import cudalab.top\n"}, "cudalab.low -> cudalab.top"),
    ({"cudalab.mid": "def f():\n    import cudalab\n"},
     "cudalab.mid -> cudalab.top (via cudalab)"),
])
def test_a_planted_upward_import_is_found(sources, expected):
    sources = {"cudalab": "import cudalab.top\n", "cudalab.top": "", "cudalab.mid": "",
               "cudalab.low": "", **sources}
    found = upward_imports(_graph_of(sources), RANKS)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_downward_and_same_layer_imports_pass():
    sources = {"cudalab": "", "cudalab.top": "import cudalab.mid\nfrom cudalab import low\n",
               "cudalab.mid": "def f():\n    import cudalab.low\n", "cudalab.low": ""}
    assert upward_imports(_graph_of(sources), RANKS) == []


def test_the_real_layers_are_read_from_pyproject():
    ranks = layer_ranks()
    assert ranks["cudalab.__main__"] == 0
    assert ranks["cudalab.events"] < ranks["cudalab.streams"] < ranks["cudalab._driver"]
    assert ranks["cudalab._units"] == max(ranks.values())


# --------------------------------------------------- planted reads through the package
PLANTED_INIT = """\
from cudalab.low import low_name
_LAZY = {
    **{name: "cudalab.top" for name in ("top_stat", "top_reset")},
    "mid_name": "cudalab.mid",
}
_SUBMODULES = {"top", "mid"}
"""


def test_package_names_are_read_from_the_init(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text(PLANTED_INIT, encoding="utf-8")
    assert package_names(init) == {"low_name": "cudalab.low", "top_stat": "cudalab.top",
                                   "top_reset": "cudalab.top", "mid_name": "cudalab.mid",
                                   "top": "cudalab.top", "mid": "cudalab.mid"}


def test_the_real_package_names_include_the_lazy_memory_api():
    names = package_names()
    assert names["memory_stats"] == "cudalab.memory"
    assert names["memory"] == "cudalab.memory"
    assert names["device_count"] == "cudalab.devices"  # imported at module level


@pytest.mark.parametrize("source, expected", [
    # the case of memory_tools.samples before it moved: a lazy name of a higher layer
    ("def f():\n    import cudalab\n    return cudalab.top_stat(0)\n",
     "cudalab.low -> cudalab.top (l.3)"),
    # a submodule read as an attribute of the package
    ("import cudalab\ndef f():\n    return cudalab.top.private_pools(0)\n",
     "cudalab.low -> cudalab.top (l.3)"),
    # the package under another name
    ("import cudalab as cl\nx = cl.mid_name\n", "cudalab.low -> cudalab.mid (l.2)"),
    # a from-import of a lazy name
    ("from cudalab import top_reset\n", "cudalab.low -> cudalab.top (l.1)"),
])
def test_a_planted_read_up_through_the_package_is_found(tmp_path, source, expected):
    init = tmp_path / "__init__.py"
    init.write_text(PLANTED_INIT, encoding="utf-8")
    known = {"cudalab", "cudalab.top", "cudalab.mid", "cudalab.low"}
    reads = {"cudalab.low": reads_through_package("cudalab.low", source, package_names(init),
                                                  known)}
    found = upward_imports(reads, RANKS)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_reads_down_or_of_unrelated_names_through_the_package_pass(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text(PLANTED_INIT, encoding="utf-8")
    known = {"cudalab", "cudalab.top", "cudalab.mid", "cudalab.low"}
    source = ("import cudalab\nimport numpy\n"
              "a = cudalab.low_name\nb = numpy.top_stat\ncudalab = None\n")
    reads = {"cudalab.mid": reads_through_package("cudalab.mid", source, package_names(init),
                                                  known)}
    assert reads["cudalab.mid"] == {"cudalab.low": [3]}
    assert upward_imports(reads, RANKS) == []
    top = {"cudalab.top": reads_through_package(
        "cudalab.top", "import cudalab\nx = cudalab.mid_name\n", package_names(init), known)}
    assert upward_imports(top, RANKS) == []
