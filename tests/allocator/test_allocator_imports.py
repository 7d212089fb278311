"""The modules of ``cudalab.allocator`` import one another without a cycle.

Every ``import`` / ``from ... import`` statement counts, wherever it is (the whole-package
graph of :mod:`tests.test_import_graph`: module level, inside functions, under ``if
TYPE_CHECKING:``). The caching allocator is one class over several modules (``cache_state``
for the fields, the ``memo`` / ``pools`` / ``slow_path`` / ``inspection`` concerns, the hot
paths in ``caching``): its concerns import the state below them, never the class made from
them, and the pool record lives in ``private_pool`` below both.
"""

from __future__ import annotations

from tests.test_import_graph import cycles, import_graph

PACKAGE = "cudalab.allocator"


def test_the_allocator_package_has_no_import_cycle() -> None:
    graph = {name: {t: lines for t, lines in edges.items() if t.startswith(PACKAGE)}
             for name, edges in import_graph().items() if name.startswith(PACKAGE)}
    assert f"{PACKAGE}.caching" in graph and f"{PACKAGE}.private_pool" in graph
    # The concerns of the caching allocator sit on its state, below the class made of them.
    for concern in ("memo", "pools", "slow_path", "inspection", "cache_state"):
        assert f"{PACKAGE}.caching" not in graph[f"{PACKAGE}.{concern}"], concern
    found = cycles(graph)
    assert found == [], "import cycle: " + " | ".join(" -> ".join(c) for c in found)
