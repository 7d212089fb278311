"""The sanitizer's HTML shows the user's frames first and folds the rest (IPython's,
ipykernel's, the libraries'), one click away; the text report is unchanged."""

from __future__ import annotations

from cudalab.sanitizer.report import RACE, READ, WRITE, Access, Report, html_table

CELL = {"filename": "/tmp/ipykernel_1/2.py", "line": 4, "name": "<module>"}
IPY = [{"filename": "/venv/lib/python3.12/site-packages/IPython/core/interactiveshell.py",
        "line": 3577, "name": "run_code"},
       {"filename": "/venv/lib/python3.12/site-packages/ipykernel/kernelbase.py", "line": 9,
        "name": "dispatch_shell"}]


def _report(folded):
    cur = Access(WRITE, 2, (0, 0x10), "kernel k", 0x100, 0x200, [CELL], folded)
    prev = Access(READ, 1, (0, 0), "kernel j", 0x100, 0x200, [CELL], ())
    return Report(RACE, 0x100, 256, [CELL], cur, prev, "wait", True,
                  allocation_folded=list(folded))


def test_the_machinery_frames_are_folded_in_the_html():
    text = html_table([_report(IPY)], 2)
    head, _, rest = text.partition("<details")
    assert "2.py" in head and "run_code" not in head
    assert "2 more frames (folded, 2 of IPython/ipykernel)" in rest
    assert "run_code" in rest and "dispatch_shell" in rest
    assert "run_code" not in str(_report(IPY))  # the text keeps the user's frames only


def test_no_details_without_folded_frames():
    assert "<details" not in html_table([_report(())], 2)
