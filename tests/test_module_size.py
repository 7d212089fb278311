"""No module of ``cudalab/`` is over 800 lines (``docs/architecture.md``: one concept per file).

:data:`DEBT` names the modules that issue 35 is splitting; each must still be over the limit
(a stale entry fails, so it is removed as soon as its file fits), and no other may be.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 800

#: Modules over the limit while they are being split (issue 35 split ``_driver/base.py`` and
#: ``array.py``); must be empty. A stale entry fails.
DEBT: frozenset[str] = frozenset({
})


def long_modules(root: Path, limit: int = LIMIT) -> dict[str, int]:
    """The ``*.py`` files under ``root`` with more than ``limit`` lines: path (relative to
    ``root``'s parent, POSIX) -> line count."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out[path.relative_to(root.parent).as_posix()] = n
    return out


def test_no_module_is_over_800_lines():
    over = long_modules(ROOT / "cudalab")
    assert {k: n for k, n in over.items() if k not in DEBT} == {}


def test_the_debt_is_not_stale():
    """A module that fits now must leave :data:`DEBT`."""
    assert sorted(DEBT - set(long_modules(ROOT / "cudalab"))) == []


@pytest.mark.parametrize("lines, found", [(800, False), (801, True)])
def test_the_count_can_fail(tmp_path, lines, found):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "big.py").write_text("x = 1\n" * lines)
    (package / "small.py").write_text("x = 1\n")
    assert long_modules(package) == ({"pkg/sub/big.py": lines} if found else {})
