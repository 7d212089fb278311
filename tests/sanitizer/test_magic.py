"""``%%cuda_sanitize``: one cell under the sanitizer, its findings as HTML (text in a
terminal), or the all-clear line with the number of accesses checked."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp
from IPython.utils.capture import capture_output

import cudalab
from cudalab import sanitizer
from cudalab.magics.sanitize import parse_sanitize_options

RACY = """\
a = cudalab.empty(64)
s1, s2 = cudalab.Stream(), cudalab.Stream()
with cudalab.stream(s1):
    a.fill_(1)
with cudalab.stream(s2):
    a.fill_(2)
cudalab.synchronize()
"""

CLEAN = """\
a = cudalab.empty(64)
s1 = cudalab.Stream()
with cudalab.stream(s1):
    a.fill_(1)
cudalab.current_stream().wait_stream(s1)
a.numpy().sum()
"""


@pytest.fixture(scope="module")
def shell():
    sh = globalipapp.get_ipython()
    sh.run_cell("import cudalab", store_history=False)
    return sh


@pytest.fixture
def ip(shell):
    """The test shell with the extension loaded, formatting HTML as a notebook does."""
    cudalab.init()
    formatter = shell.display_formatter
    types = list(formatter.active_types)
    formatter.active_types = [*types, "text/html"]
    shell.run_line_magic("load_ext", "cudalab")
    yield shell
    shell.run_line_magic("unload_ext", "cudalab")
    formatter.active_types = types


def run(sh, src):
    with capture_output() as cap:
        r = sh.run_cell(src, store_history=True)
    return r, [o.data.get("text/plain", "") for o in cap.outputs], \
        [o.data.get("text/html", "") for o in cap.outputs]


def test_a_racy_cell_shows_the_findings_table(ip):
    r, texts, htmls = run(ip, "%%cuda_sanitize\n" + RACY)
    assert r.success
    assert len(htmls) == 1
    assert "<table>" in htmls[0] and "possible data race (write after write)" in htmls[0]
    assert texts[0].startswith("1 finding (")
    assert "a.fill_(2)" in texts[0] and "a.fill_(1)" in texts[0]  # the cell's lines
    assert "  Cell In[" in texts[0] and "File" not in texts[0]  # the cell, not the kernel
    assert not sanitizer.is_enabled()


def test_stacks_name_the_cell_as_ipython_numbers_it_with_the_line_in_text_and_html(ip):
    """Issue 36 items 9-10: the running cell is In[N] for the cell IPython numbers N (IPython
    9 has already advanced ``shell.execution_count`` to N+1 while it runs), and the HTML
    table names it as the text does, with the line and its source (not the kernel's file)."""
    r, texts, htmls = run(ip, "%%cuda_sanitize\n" + RACY)
    n = r.execution_count
    assert f"  Cell In[{n}], line 4, in <module>\n    a.fill_(1)\n" in texts[0]
    assert f"Cell In[{n + 1}]" not in texts[0]
    html = htmls[0]
    assert f"Cell In[{n}], line 4" in html and f"Cell In[{n}], line 6" in html
    assert "<code>a.fill_(1)</code>" in html and "<code>a = cudalab.empty(64)</code>" in html
    assert "ipython-input" not in html and f"Cell In[{n + 1}]" not in html


def test_a_clean_cell_says_so_and_keeps_its_output(ip):
    r, texts, htmls = run(ip, "%%cuda_sanitize\n" + CLEAN)
    assert r.success and r.result == 64.0  # the cell's last expression
    assert "no unsynchronized access found</b> (" in htmls[0]
    assert "accesses checked" in htmls[0]
    assert texts[0].startswith("no unsynchronized access found (")


def test_store_in_a_variable_quietly(ip):
    r, texts, htmls = run(ip, "%%cuda_sanitize -q -v found\n" + RACY)
    assert r.success and texts == [] and htmls == []
    session = ip.user_ns["found"]
    assert isinstance(session, sanitizer.Session) and len(session.reports) == 1


def test_an_exception_propagates_after_the_findings(ip):
    r, texts, htmls = run(ip, "%%cuda_sanitize\n" + RACY + "raise KeyError('boom')\n")
    assert isinstance(r.error_in_exec, KeyError)
    assert "possible data race" in htmls[0]
    assert not sanitizer.is_enabled()


@pytest.mark.parametrize("line", ["-x", "-v", "-v 1abc", "'unclosed"])
def test_bad_options(line):
    with pytest.raises(UsageError, match="cuda_sanitize"):
        parse_sanitize_options(line)
