"""Fixtures shared by the simulator backend's tests (test_simulator.py, test_simulator_vmm.py):
every test builds its own :class:`SimulatorBackend` from a :class:`SimulatorConfig` read from
a mapping, never from ``os.environ``."""

from __future__ import annotations

import pytest

from cudalab._driver.sim import SimulatorBackend, SimulatorConfig
from cudalab._driver.sim import kernels as sim_kernels


@pytest.fixture
def make():
    """make(devices=None, memory=None, visible=None) -> a fresh, initialised backend, its
    settings given as the environment variables' texts (None: unset)."""

    def _make(devices=None, memory=None, visible=None):
        env = {key: str(value) for key, value in (("CUDALAB_SIMULATOR_DEVICES", devices),
                                                  ("CUDALAB_SIMULATOR_MEMORY", memory),
                                                  ("CUDA_VISIBLE_DEVICES", visible))
               if value is not None}
        b = SimulatorBackend(SimulatorConfig.from_env(env))
        b.init()
        return b

    return _make


@pytest.fixture
def b(make):
    """Two 64 MiB devices: small enough to fill on purpose."""
    return make(devices=2, memory="64MiB")


@pytest.fixture
def kernels(monkeypatch):
    """An isolated kernel registry (registrations vanish after the test)."""
    registry = dict(sim_kernels._KERNELS)
    monkeypatch.setattr(sim_kernels, "_KERNELS", registry)
    return registry
