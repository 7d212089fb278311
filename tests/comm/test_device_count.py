"""The collectives' tests follow the device count (issue 35, item 7): on a host with one
device, every test of cudalab.comm's Communicator and of cudalab.nccl that needs a second
device skips with its reason instead of failing. Checked on the simulator configured with one
device (``CUDALAB_SIMULATOR_DEVICES=1``), which is what a one-GPU host looks like to them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.gpu import HAS_GPU

ROOT = Path(__file__).resolve().parents[2]

#: The files whose tests assumed device 1 (five failed on a one-GPU host), and the record's.
FILES = ["tests/comm/test_communicator.py", "tests/nccl/test_collective_call.py",
         "tests/nccl/test_nccl.py"]


@pytest.mark.skipif(HAS_GPU, reason="configures the simulator's device count")
def test_on_one_device_the_tests_that_need_two_skip_instead_of_failing():
    env = dict(os.environ, CUDALAB_SIMULATOR="1", CUDALAB_SIMULATOR_DEVICES="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-rs", *FILES], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " failed" not in res.stdout and " error" not in res.stdout
    # the one-device host skips them, saying why
    assert "needs two devices" in res.stdout, res.stdout[-3000:]
