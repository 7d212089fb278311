"""The one compiled part of cudalab: an optional accelerator for history's stack stamps.

Everything else is in pyproject.toml. ``cudalab.memory_tools._stackstamp`` reads CPython's
private interpreter frames, so it is built only for CPython 3.11-3.13 with the GIL, and
only optionally: without a compiler or headers the install still succeeds and
``cudalab.memory_tools.stacks`` uses its pure-Python stamp (same stacks, slower).
"""

import os
import platform
import sys
import sysconfig

from setuptools import Extension, setup


def _extensions() -> list:
    pure = os.environ.get("CUDALAB_PURE_PYTHON", "0") not in ("", "0")
    if (pure or platform.python_implementation() != "CPython"
            or not (3, 11) <= sys.version_info[:2] <= (3, 13)
            or sysconfig.get_config_var("Py_GIL_DISABLED")):
        return []
    include = sysconfig.get_paths()["include"]
    return [Extension("cudalab.memory_tools._stackstamp", ["cudalab/memory_tools/_stackstamp.c"],
                      include_dirs=[os.path.join(include, "internal")], optional=True)]


setup(ext_modules=_extensions())
