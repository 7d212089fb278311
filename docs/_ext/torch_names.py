"""The ``torch-cuda-names`` directive: the table of "Differences from torch.cuda".

It reads ``docs/torch_cuda_names.csv`` (columns ``torch_name``, ``cudalab``, ``pending``,
``listed_in``, ``note``; one row per torch name) and renders one table row per line: the torch
name, the cudalab equivalent as a cross-reference (empty when there is none) and the note.
The page never repeats the list by hand, so the table and ``tests/test_docs.py`` (which
checks that every equivalent resolves and that no torch name is listed twice) read the same
file. ``listed_in`` says where torch lists the name: ``torch.cuda.__all__``,
``torch.cuda.memory.__all__``, both, a private name, or an attribute of a class.
"""

from __future__ import annotations

import csv
import pathlib

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

CSV_NAME = "torch_cuda_names.csv"
COLUMNS = ("torch_name", "cudalab", "pending", "listed_in", "note")


def read_rows(path: pathlib.Path) -> list[dict[str, str]]:
    """The rows of the names file, each a dict keyed by :data:`COLUMNS`.

    Raises
    ------
    ValueError
        If the header is not :data:`COLUMNS`.
    """
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path}: header {reader.fieldnames}, expected {list(COLUMNS)}")
        return list(reader)


def _paragraph(*children: nodes.Node) -> nodes.entry:
    entry = nodes.entry()
    entry += nodes.paragraph("", "", *children)
    return entry


def _equivalent(name: str) -> nodes.entry:
    if not name:
        return _paragraph(nodes.Text("\u2014"))
    ref = addnodes.pending_xref("", refdomain="py", reftype="obj", reftarget=name,
                                refexplicit=False, refwarn=False)
    ref += nodes.literal(name, name, classes=["xref", "py", "py-obj"])
    return _paragraph(ref)


class TorchCudaNames(SphinxDirective):
    """Render the names file as a table (see the module doc)."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        path = pathlib.Path(self.env.srcdir) / CSV_NAME
        self.env.note_dependency(str(path))
        table = nodes.table(classes=["torch-names"])
        group = nodes.tgroup(cols=3)
        table += group
        for width in (30, 30, 40):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        head += nodes.row("", *(_paragraph(nodes.Text(title)) for title in ("torch", "cudalab", "note")))
        group += head
        body = nodes.tbody()
        for row in read_rows(path):
            note: list[nodes.Node] = [nodes.Text(row["note"])] if row["note"] else []
            if row["listed_in"] != "torch.cuda.__all__":
                note.append(nodes.emphasis("", f" ({row['listed_in']})"))
            body += nodes.row("", _paragraph(nodes.literal(row["torch_name"], row["torch_name"])),
                              _equivalent(row["cudalab"]), _paragraph(*note))
        group += body
        return [table]


def setup(app: Sphinx) -> dict[str, object]:
    app.add_directive("torch-cuda-names", TorchCudaNames)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
