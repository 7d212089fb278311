"""Sphinx configuration of cudalab's documentation site.

Build it (the README's test command runs exactly this, with warnings as errors)::

    .venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

and open ``docs/_build/html/index.html``.

Where the pages come from
-------------------------
* Markdown pages under ``docs/`` (myst-parser), reStructuredText-free.
* The API reference: autodoc + autosummary over the docstrings (NumPy style, read by
  napoleon). autosummary writes one stub page per name into ``docs/api/generated/``, which
  git ignores: the stubs are build products, regenerated on every build.
* The notebooks: ``notebooks/*.ipynb`` are committed *executed on the simulator*
  (``tests/test_notebooks.py`` keeps them so), so the site renders their stored outputs and
  never runs them (``nb_execution_mode = "off"``). Sphinx reads sources only from under its
  source directory, and a symlink would not survive a checkout on every platform, so
  :func:`copy_notebooks` copies them into ``docs/notebooks/`` (git-ignored) when the build
  starts. It copies a notebook only when its bytes changed and keeps its modification time,
  so an incremental build re-reads only the notebooks that changed. ``notebooks/`` stays the
  one place to edit them.
* The "Differences from torch.cuda" table: ``docs/torch_cuda_names.csv``, rendered by the
  ``torch-cuda-names`` directive of ``docs/_ext/torch_names.py`` (``tests/test_docs.py``
  checks the file).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent

# autodoc imports cudalab; the simulator keeps that (and anything a docstring example may
# touch) off the real driver, so the site builds the same on a machine with no GPU.
os.environ.setdefault("CUDALAB_SIMULATOR", "1")
sys.path.insert(0, str(DOCS / "_ext"))

project = "cudalab"
author = "the cudalab developers"
copyright = "the cudalab developers"  # noqa: A001 (Sphinx's name)
release = version = "0.1.0"

extensions = [
    "myst_nb",  # Markdown (myst-parser) and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "torch_names",
]

# .rst first: autosummary names its stubs with the first suffix, and writes reStructuredText.
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints", "README.md"]
templates_path: list[str] = []

# ------------------------------------------------------------------------------ MyST and notebooks
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # the committed outputs are the simulator's; see the module doc
nb_merge_streams = True

# ---------------------------------------------------------------------------- API reference
autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_numpy_docstring = True
napoleon_google_docstring = True  # some classes document their arguments Google-style (Args:)
napoleon_use_rtype = False

# No intersphinx: CI builds offline, and a failed inventory fetch is a warning (-W: an error).

# ---------------------------------------------------------------------------------- HTML
html_theme = "pydata_sphinx_theme"
html_title = "cudalab"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    # The names table needs the width: no right-hand sidebar on its page.
    "secondary_sidebar_items": {"**": ["page-toc"], "torch_differences": []},
}
# The left sidebar lists a section's pages: only the API reference has a section; elsewhere it
# would be an empty "Section Navigation".
html_sidebars = {
    **{page: [] for page in ("index", "install", "quickstart", "troubleshooting", "magics",
                             "widgets", "random", "torch_differences", "architecture",
                             "changelog")},
    "concepts/*": [],
    "notebooks/*": [],
}
html_static_path = ["_static"]
html_css_files = ["cudalab.css"]


def copy_notebooks(source: pathlib.Path, target: pathlib.Path) -> None:
    """Copy ``source/*.ipynb`` into ``target`` (see the module doc) and drop stale copies.

    A notebook is copied only when its bytes differ from the copy, with its modification
    time, so an incremental build re-reads only the notebooks that changed.
    """
    target.mkdir(exist_ok=True)
    sources = {path.name: path for path in sorted(source.glob("*.ipynb"))}
    for stale in target.glob("*.ipynb"):
        if stale.name not in sources:
            stale.unlink()
    for name, notebook in sources.items():
        copy = target / name
        if not copy.exists() or copy.read_bytes() != notebook.read_bytes():
            shutil.copy2(notebook, copy)


copy_notebooks(ROOT / "notebooks", DOCS / "notebooks")
