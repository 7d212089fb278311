"""benchmarks/history.py with the memo's stamp replaced by the compiled one of this folder
(an experiment, see README.md): ``python3 benchmarks/experiments/compiled_stamp/run.py``."""

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path[:0] = [HERE, ROOT]

import stamp312  # noqa: E402  (built by build.sh)

import cudalab.memory.history as h  # noqa: E402

stamp312.setup(h._cud_mods, h._other_mods, h._Mark, h._capture)
h._stamp = stamp312.stamp  # read by the history hook when recording starts
sys.argv = [os.path.join(ROOT, "benchmarks", "history.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
