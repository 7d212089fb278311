"""Test harness: picks the backend for the whole session, the ``gpu`` marker, and ``--shard K/N``.

* ``CUDALAB_SIMULATOR=1`` (CI): the simulator; ``@pytest.mark.gpu`` tests are skipped.
* otherwise, if a real GPU answers: the real backend, and every test runs on it.
* otherwise the harness selects the simulator explicitly (printed in the header), so a
  developer's laptop runs the same suite as CI. The library itself never falls back.

``--shard K/N`` runs a deterministic share of the test files and ``--shard-durations-out``
records what each file took (``tests/helpers/shard.py``; ``bash .ci/gpu-run --shard 1/2``).
Under pytest-xdist ``with run_lock.alone():`` runs a block of a test with no other test
beside it (``tests/helpers/alone.py``).
"""

from __future__ import annotations

import pytest

from tests.helpers.alone import RunLock  # noqa: E402
from tests.helpers.gpu import BACKEND as _BACKEND  # noqa: E402 - decides the backend first
from tests.helpers.gpu import HAS_GPU  # noqa: E402
from tests.helpers.gpu import REASON as _REASON  # noqa: E402
from tests.helpers.interrupts import deferring  # noqa: E402,F401 - the fixture, for every test
from tests.helpers.shard import ShardPlugin, add_options  # noqa: E402


def pytest_addoption(parser):
    add_options(parser)  # --shard K/N, --shard-durations-out PATH


def pytest_configure(config):
    config.pluginmanager.register(ShardPlugin(config), "cudalab-shard")
    config.addinivalue_line("markers", "gpu: needs a real CUDA GPU (skipped on the simulator)")
    config.addinivalue_line("markers", "multigpu: needs at least two real GPUs")


def pytest_report_header(config):
    return f"cudalab backend: {_BACKEND} ({_REASON})"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a real GPU (running on the simulator)")
    for item in items:
        if not HAS_GPU and ("gpu" in item.keywords or "multigpu" in item.keywords):
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def run_lock(tmp_path_factory):
    """The run's lock, held shared by every test; ``with run_lock.alone():`` runs a block with
    no other test beside it under pytest-xdist (tests/helpers/alone.py)."""
    lock = RunLock(tmp_path_factory.getbasetemp().parent)
    try:
        yield lock
    finally:
        lock.release()


@pytest.fixture
def backend():
    """The active Backend (simulator or real), initialised."""
    import cudalab
    from cudalab import devices

    cudalab.init()
    return devices.backend()


@pytest.fixture
def two_devices():
    """Skip unless two devices exist (the simulator has two by default)."""
    import cudalab

    if cudalab.device_count() < 2:
        pytest.skip("needs two devices")
    return (0, 1)


@pytest.fixture(autouse=True)
def _restore_runtime_state():
    """Leave device 0 and the default streams current after each test."""
    yield
    from cudalab import devices

    if devices.is_initialized():
        if devices.per_thread.device != 0:
            devices.set_device(0)
        cur = devices.per_thread.streams
        if cur is not None:
            from cudalab import streams

            for d in range(len(cur)):
                streams._put(cur, d, None)  # keeps streams.custom_stream_tokens in step
