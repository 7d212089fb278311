"""Shared test helpers: imported by test modules as ``tests.helpers.<module>``.

* :mod:`tests.helpers.gpu` — which backend the whole session runs on (``HAS_GPU``).
* :mod:`tests.helpers.privates` — an AST scan for reads of one module's private names.
"""
