"""The compiled parts of cudalab: six optional accelerators, each with a pure-Python twin.

Everything else is in pyproject.toml. The extensions are optional: without a compiler or
headers the install still succeeds and cudalab uses the Python twin (same results, slower).

* ``cudalab.memory_tools._stackstamp``, history's stack stamps, reads CPython's private
  interpreter frames, so it is built only for CPython 3.11-3.13 with the GIL;
  ``cudalab.memory_tools.stacks`` falls back to its pure-Python stamp.
* ``cudalab._driver.fastcall`` calls the driver's hot entry points (cuLaunchKernel,
  cuEventRecord, cuStreamWaitEvent, ...) from C (public C API only), for CPython with the
  GIL; ``cudalab._driver.cuda`` falls back to cuda.bindings' wrappers.
* ``cudalab._driver.blascall`` makes a cuBLAS GEMM call from C, its arguments resolved once
  (``GemmCall``); ``cudalab._driver.cublas`` falls back to ctypes.
* ``cudalab._driver.ncclcall`` makes a single-process clique's NCCL group (start, one call
  per rank, end) in one C call; ``cudalab._driver.nccl`` falls back to nccl4py's wrappers.

* ``cudalab.allocator._pair`` is the C twin of ``cudalab.memory``'s torch-style pair
  (``caching_allocator_alloc`` / ``caching_allocator_delete``) for the pair memo's pure hit
  (public C API and member descriptors' offsets), for CPython with the GIL; without it the
  Python pair runs.
* ``cudalab.memory_tools._tracescan`` reads a snapshot pickle's trace into numpy columns
  without a dict per entry (public C API only); ``cudalab.memory_tools.trace_index`` falls
  back to the restricted unpickler and a Python loop (same columns, more memory).

``CUDALAB_PURE_PYTHON=1`` builds none.
"""

import os
import platform
import sys
import sysconfig

from setuptools import Extension, setup


def _extensions() -> list:
    pure = os.environ.get("CUDALAB_PURE_PYTHON", "0") not in ("", "0")
    if (pure or platform.python_implementation() != "CPython"
            or sysconfig.get_config_var("Py_GIL_DISABLED")):
        return []
    shared = ["cudalab/_driver/_capi.h"]  # the argument parsing both include
    extensions = [Extension("cudalab._driver.fastcall", ["cudalab/_driver/fastcall.c"],
                            depends=shared, optional=True),
                  Extension("cudalab._driver.blascall", ["cudalab/_driver/blascall.c"],
                            depends=shared, optional=True),
                  Extension("cudalab._driver.ncclcall", ["cudalab/_driver/ncclcall.c"],
                            depends=shared, optional=True),
                  Extension("cudalab.memory_tools._tracescan",
                            ["cudalab/memory_tools/_tracescan.c"], optional=True),
                  Extension("cudalab.allocator._pair", ["cudalab/allocator/_pair.c"],
                            optional=True)]
    if (3, 11) <= sys.version_info[:2] <= (3, 13):
        include = sysconfig.get_paths()["include"]
        extensions.append(Extension("cudalab.memory_tools._stackstamp",
                                    ["cudalab/memory_tools/_stackstamp.c"],
                                    include_dirs=[os.path.join(include, "internal")],
                                    optional=True))
    return extensions


setup(ext_modules=_extensions())
