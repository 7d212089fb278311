"""cudalab.lazy_names: the shared PEP 562 loader of cudalab.comm, cluster and widgets."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from cudalab.lazy_names import lazy_names


def _package(owners: dict[str, str]) -> types.ModuleType:
    module = types.ModuleType("fake_package")
    module.__getattr__, module.__dir__ = lazy_names(  # type: ignore[method-assign]
        "fake_package", owners, vars(module))
    return module


def test_a_name_loads_from_its_owner_once_and_is_then_stored():
    module = _package({"dumps": "json", "sqrt": "math"})
    assert "dumps" not in vars(module)
    import json

    assert module.dumps is json.dumps
    assert vars(module)["dumps"] is json.dumps  # stored: later reads skip __getattr__
    assert "dumps" in dir(module) and "sqrt" in dir(module)


def test_an_unknown_name_is_an_attribute_error_naming_the_package():
    module = _package({"dumps": "json"})
    with pytest.raises(AttributeError, match="module 'fake_package' has no attribute 'nope'"):
        module.nope  # noqa: B018
    assert not hasattr(module, "nope")


@pytest.mark.parametrize("package, name, owner", [
    ("cudalab.comm", "Communicator", "cudalab.comm.communicator"),
    ("cudalab.cluster", "watch", "cudalab.cluster.watching"),
    ("cudalab.widgets", "SnapshotViewer", "cudalab.widgets.snapshot_viewer"),
])
def test_cudalabs_packages_load_their_names_on_first_use(package, name, owner):
    code = (f"import sys, {package} as p\n"
            f"assert {owner!r} not in sys.modules\n"
            f"assert {name!r} in dir(p) and getattr(p, {name!r}) is not None\n"
            f"assert {owner!r} in sys.modules\n"
            "try:\n    p.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "CUDALAB_SIMULATOR": "1"})
    assert r.returncode == 0, r.stderr
    assert f"module '{package}' has no attribute 'no_such_name'" in r.stdout
