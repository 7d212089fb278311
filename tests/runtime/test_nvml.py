"""NVML: pynvml error mapping (RealNvml), torch's units and text (cudalab.nvml), UUID mapping."""

from __future__ import annotations

import ctypes
import sys
import threading
import types
from types import SimpleNamespace

import pytest

import cudalab
from cudalab import nvml as cnvml
from cudalab._driver.base import Nvml
from cudalab._driver.nvml import (
    DRIVER_NOT_LOADED,
    LIBRARY_MISSING,
    PYNVML_MISSING,
    NvmlUnavailableError,
    RealNvml,
)
from cudalab.errors import NvmlError

UUID_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
UUID_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
MIB = 1024 * 1024


# ------------------------------------------------------------------------ a fake pynvml
def make_pynvml(devices=None, init_error=None, errors=None, calls=None):
    """A module shaped like nvidia-ml-py's pynvml over ``devices`` (uuid -> dict).

    ``errors`` maps a function name to the NVML error code it raises; ``calls`` collects
    (name, args) of every call.
    """
    devices = devices if devices is not None else {}
    errors = errors or {}
    calls = calls if calls is not None else []
    order = list(devices)
    mod = types.ModuleType("pynvml")

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(value)
            self.value = value

        def __str__(self):
            return {6: "Not Found", 4: "Insufficient Permissions"}.get(self.value, "Unknown Error")

    mod.NVMLError = NVMLError

    def fn(name, body):
        def call(*args):
            calls.append((name, args))
            if name in errors:
                raise NVMLError(errors[name])
            return body(*args)

        setattr(mod, name, call)

    def init():
        if init_error is not None:
            raise NVMLError(init_error)

    def by_uuid(uuid):
        key = uuid.decode() if isinstance(uuid, bytes) else uuid
        if key not in devices:
            raise NVMLError(6)
        return ("handle", key)

    fn("nvmlInit", init)
    fn("nvmlDeviceGetCount", lambda: len(order))
    fn("nvmlDeviceGetHandleByIndex", lambda i: ("handle", order[i]))
    fn("nvmlDeviceGetHandleByUUID", by_uuid)
    fn("nvmlDeviceGetUUID", lambda h: h[1].encode())  # bytes, as old wrappers return
    fn("nvmlDeviceGetUtilizationRates",
       lambda h: SimpleNamespace(gpu=devices[h[1]]["gpu"], memory=devices[h[1]]["mem"]))
    fn("nvmlDeviceGetMemoryInfo",
       lambda h: SimpleNamespace(total=devices[h[1]]["total"], free=devices[h[1]]["free"],
                                 used=devices[h[1]]["used"]))
    fn("nvmlDeviceGetTemperature", lambda h, sensor: devices[h[1]]["temp"] + 1000 * sensor)
    fn("nvmlDeviceGetPowerUsage", lambda h: devices[h[1]]["power"])
    fn("nvmlDeviceGetClockInfo", lambda h, clock: devices[h[1]]["clocks"][clock])
    fn("nvmlDeviceGetComputeRunningProcesses",
       lambda h: [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in devices[h[1]]["procs"]])
    fn("nvmlDeviceGetCurrentClocksEventReasons", lambda h: devices[h[1]]["reasons"])
    return mod


def device_data(**over):
    data = dict(gpu=37, mem=12, total=80 * 1024 * MIB, free=70 * 1024 * MIB,
                used=10 * 1024 * MIB, temp=41, power=123456, clocks={0: 1500, 1: 1980, 2: 2619},
                procs=[], reasons=0)
    data.update(over)
    return data


@pytest.fixture
def fake_pynvml(monkeypatch):
    def install(**kwargs):
        calls = kwargs.setdefault("calls", [])
        mod = make_pynvml(**kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod, calls

    return install


# ------------------------------------------------------------------------ RealNvml: errors
def test_pynvml_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    nv = RealNvml()
    with pytest.raises(NvmlUnavailableError) as info:
        nv.device_count()
    assert str(info.value) == PYNVML_MISSING == "pynvml module not found, please install nvidia-ml-py"
    assert info.value.reason == "pynvml"
    assert isinstance(info.value, NvmlError) and isinstance(info.value, RuntimeError)


@pytest.mark.parametrize(
    "code, reason, message",
    [(12, "library", LIBRARY_MISSING), (9, "driver", DRIVER_NOT_LOADED)],
)
def test_init_failures_are_unavailable_and_cached(fake_pynvml, code, reason, message):
    mod, calls = fake_pynvml(init_error=code)
    nv = RealNvml()
    for _ in range(3):
        with pytest.raises(NvmlUnavailableError) as info:
            nv.temperature(UUID_A)
        assert str(info.value) == message
        assert info.value.reason == reason
        assert info.value.__cause__ is None and info.value.__context__ is None
    assert [c[0] for c in calls] == ["nvmlInit"]  # tried once, not per query
    assert "libnvidia-ml.so.1" in LIBRARY_MISSING and "no NVIDIA driver" in LIBRARY_MISSING


def test_not_supported_function_not_found_and_other_errors(fake_pynvml):
    fake_pynvml(devices={UUID_A: device_data()},
                errors={"nvmlDeviceGetPowerUsage": 3, "nvmlDeviceGetClockInfo": 13,
                        "nvmlDeviceGetTemperature": 4})
    nv = RealNvml()
    with pytest.raises(NvmlError) as info:
        nv.power_usage(UUID_A)
    assert str(info.value) == "power draw (nvmlDeviceGetPowerUsage) is not supported on this device"
    assert not isinstance(info.value, NvmlUnavailableError)
    with pytest.raises(NvmlError, match=r"SM clock \(nvmlDeviceGetClockInfo\) is not available"):
        nv.clock_sm(UUID_A)
    with pytest.raises(NvmlError) as info:
        nv.temperature(UUID_A)
    assert str(info.value) == ("temperature (nvmlDeviceGetTemperature) failed: "
                               "Insufficient Permissions (NVML error 4)")
    # the other queries still work
    assert nv.utilization(UUID_A) == (37, 12)


def test_unknown_uuid(fake_pynvml):
    fake_pynvml(devices={UUID_A: device_data()})
    with pytest.raises(NvmlError, match="NVML has no device with UUID 'GPU-bbbbbbbb"):
        RealNvml().utilization(UUID_B)


def test_real_pynvml_without_driver():
    """On a machine without libnvidia-ml (CI), the real package fails cleanly."""
    pytest.importorskip("pynvml")
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        pass
    else:
        pytest.skip("libnvidia-ml.so.1 is present on this machine")
    nv = RealNvml()
    with pytest.raises(NvmlUnavailableError) as info:
        nv.uuids()
    assert str(info.value) == LIBRARY_MISSING
    assert info.value.reason == "library"


def test_real_pynvml_exception_classes_map(monkeypatch):
    """The real package's NVMLError subclasses carry the codes translate_error reads."""
    pynvml = pytest.importorskip("pynvml")
    from cudalab._driver.nvml import translate_error

    for code, cls_name in [(3, "NVMLError_NotSupported"), (9, "NVMLError_DriverNotLoaded"),
                           (12, "NVMLError_LibraryNotFound"), (13, "NVMLError_FunctionNotFound")]:
        exc = pynvml.NVMLError(code)
        assert type(exc).__name__ == cls_name
        err = translate_error(exc, "x (nvmlX)")
        assert isinstance(err, NvmlError)
    assert isinstance(translate_error(pynvml.NVMLError(12), "x"), NvmlUnavailableError)
    assert str(translate_error(pynvml.NVMLError(3), "x (nvmlX)")) == (
        "x (nvmlX) is not supported on this device")


# ------------------------------------------------------------------------ RealNvml: values
def test_values_and_units(fake_pynvml):
    procs = [(101, 512 * MIB), (202, None), (303, (1 << 64) - 1)]
    mod, calls = fake_pynvml(devices={UUID_B: device_data(procs=procs),
                                      UUID_A: device_data(gpu=5, mem=1)})
    nv = RealNvml()
    assert nv.device_count() == 2
    assert nv.uuids() == [UUID_B, UUID_A]  # NVML index order, decoded from bytes
    assert nv.utilization(UUID_A) == (5, 1)
    assert nv.memory_info(UUID_B) == (80 * 1024 * MIB, 70 * 1024 * MIB, 10 * 1024 * MIB)
    assert nv.temperature(UUID_B) == 41  # NVML_TEMPERATURE_GPU (sensor 0)
    assert nv.power_usage(UUID_B) == 123456  # mW, unchanged
    assert nv.clock_sm(UUID_B) == 1980  # NVML_CLOCK_SM (1), MHz
    assert nv.processes(UUID_B) == [(101, 512 * MIB), (202, None), (303, None)]
    assert nv.processes(UUID_A) == []
    assert nv.simulated is False


def test_handles_cached_per_uuid_and_init_once_across_threads(fake_pynvml):
    mod, calls = fake_pynvml(devices={UUID_A: device_data(), UUID_B: device_data()})
    nv = RealNvml()
    barrier = threading.Barrier(8)
    results = []

    def worker():
        barrier.wait()
        results.append(nv.temperature(UUID_A))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [41] * 8
    for _ in range(5):
        nv.utilization(UUID_A)
        nv.utilization(UUID_B)
    names = [c[0] for c in calls]
    assert names.count("nvmlInit") == 1
    lookups = [c[1][0] for c in calls if c[0] == "nvmlDeviceGetHandleByUUID"]
    # racing threads may each look a handle up once; afterwards the cache answers
    assert set(lookups) == {UUID_A, UUID_B} and lookups.count(UUID_B) == 1


def test_clock_event_reasons(fake_pynvml):
    """The seam's clock_event_reasons: NVML's mask by UUID, an NvmlError on failure, None
    with a pynvml that lacks the call."""
    mod, calls = fake_pynvml(devices={UUID_A: device_data(reasons=0x44), UUID_B: device_data()})
    nv = RealNvml()
    assert nv.clock_event_reasons(UUID_A) == 0x44  # SW power cap | HW thermal slowdown
    assert nv.clock_event_reasons(UUID_B) == 0
    assert ("nvmlDeviceGetCurrentClocksEventReasons", (("handle", UUID_A),)) in calls
    fake_pynvml(devices={UUID_A: device_data()},
                errors={"nvmlDeviceGetCurrentClocksEventReasons": 3})
    with pytest.raises(NvmlError, match=r"clock event reasons .* is not supported"):
        RealNvml().clock_event_reasons(UUID_A)
    old, _ = fake_pynvml(devices={UUID_A: device_data()})
    del old.nvmlDeviceGetCurrentClocksEventReasons
    assert RealNvml().clock_event_reasons(UUID_A) is None


def test_simulated_nvml_has_no_clock_event_reasons(backend):
    if not backend.simulated:
        pytest.skip("the simulator's NVML")
    nv = backend.nvml()
    for uuid in nv.uuids():
        assert nv.clock_event_reasons(uuid) is None
    with pytest.raises(NvmlError, match="no simulated device"):
        nv.clock_event_reasons(UUID_A)


# ------------------------------------------------------------------------ cudalab.nvml over a fake Nvml
class FakeNvml(Nvml):
    def __init__(self, data, order, simulated=False, unavailable=None, unsupported=()):
        self.data, self.order, self.simulated = data, order, simulated
        self.unavailable, self.unsupported = unavailable, set(unsupported)

    def _get(self, uuid, what):
        if self.unavailable:
            raise NvmlUnavailableError("NVML is not available: test", self.unavailable)
        if what in self.unsupported:
            raise NvmlError(f"{what} is not supported on this device")
        if uuid not in self.data:
            raise NvmlError(f"NVML has no device with UUID {uuid!r}")
        return self.data[uuid]

    def device_count(self):
        if self.unavailable:
            raise NvmlUnavailableError("NVML is not available: test", self.unavailable)
        return len(self.order)

    def uuids(self):
        self.device_count()
        return list(self.order)

    def utilization(self, uuid):
        d = self._get(uuid, "utilization")
        return d["gpu"], d["mem"]

    def memory_info(self, uuid):
        d = self._get(uuid, "memory")
        return d["total"], d["free"], d["used"]

    def temperature(self, uuid):
        return self._get(uuid, "temperature")["temp"]

    def power_usage(self, uuid):
        return self._get(uuid, "power")["power"]

    def clock_sm(self, uuid):
        return self._get(uuid, "clock")["clocks"][1]

    def processes(self, uuid):
        return list(self._get(uuid, "processes")["procs"])

    def clock_event_reasons(self, uuid):
        return self._get(uuid, "reasons")["reasons"]


@pytest.fixture
def fake_devices(monkeypatch):
    """CUDA ordinals 0 -> UUID_A, 1 -> UUID_B; NVML enumerates B first (like
    CUDA_VISIBLE_DEVICES=1,0 or FASTEST_FIRST vs PCI order)."""
    from cudalab import devices

    cuda_uuids = {0: UUID_A, 1: UUID_B}
    seen = []

    def device_index(device=None, optional=True):
        seen.append(device)
        if device is None:
            return 0
        if isinstance(device, str):
            return int(device.split(":")[1]) if ":" in device else 0
        return int(device)

    monkeypatch.setattr(devices, "device_index", device_index)
    monkeypatch.setattr(devices, "get_device_properties",
                        lambda d=None: SimpleNamespace(nvml_uuid=cuda_uuids[device_index(d)]))

    def install(nvml):
        monkeypatch.setattr(cnvml, "nvml_backend", lambda: nvml)
        return nvml

    install.seen = seen
    return install


def two_gpu_data():
    a = device_data(gpu=11, mem=22, temp=33, power=44000, clocks={1: 1410},
                    used=5 * MIB, procs=[(4242, 300 * MIB), (17, 1536 * 1024)])
    b = device_data(gpu=91, mem=92, temp=93, power=94000, clocks={1: 1980}, used=7 * MIB)
    return {UUID_A: a, UUID_B: b}


def test_functions_follow_uuid_not_index(fake_devices):
    fake_devices(FakeNvml(two_gpu_data(), order=[UUID_B, UUID_A]))
    assert cnvml.utilization(0) == 11 and cnvml.utilization("cuda:1") == 91
    assert cnvml.memory_usage(0) == 22 and cnvml.memory_usage(1) == 92  # a percentage
    assert cnvml.temperature(0) == 33 and cnvml.temperature(1) == 93
    assert cnvml.power_draw(0) == 44000 and cnvml.power_draw(1) == 94000  # mW
    assert cnvml.clock_rate(0) == 1410 and cnvml.clock_rate(1) == 1980  # MHz
    assert cnvml.device_memory_used(0) == 5 * MIB and cnvml.device_memory_used(1) == 7 * MIB
    assert cnvml.utilization() == 11  # None -> current device (0 here)
    assert None in fake_devices.seen and "cuda:1" in fake_devices.seen


def test_list_gpu_processes_exact_text(fake_devices):
    fake_devices(FakeNvml(two_gpu_data(), order=[UUID_B, UUID_A]))
    # Like torch, the header carries NVML's index: CUDA 0 is NVML's device 1 here.
    assert cnvml.list_gpu_processes(0) == (
        "GPU:1\n"
        "process       4242 uses      300.000 MB GPU memory\n"
        "process         17 uses        1.500 MB GPU memory"
    )
    assert cnvml.list_gpu_processes(1) == "GPU:0\nno processes are running"


def test_list_gpu_processes_same_index_without_reordering(fake_devices):
    data = two_gpu_data()
    data[UUID_B]["procs"] = [(7, None), (1234567890, 123456789)]
    fake_devices(FakeNvml(data, order=[UUID_A, UUID_B]))
    assert cnvml.list_gpu_processes(1) == (
        "GPU:1\n"
        "process          7 uses          n/a MB GPU memory\n"
        "process 1234567890 uses      117.738 MB GPU memory"
    )


def test_list_gpu_processes_simulated_says_so(fake_devices):
    fake_devices(FakeNvml(two_gpu_data(), order=[UUID_A, UUID_B], simulated=True))
    text = cnvml.list_gpu_processes(1)
    assert text.splitlines()[0] == "GPU:1 (simulated)"
    assert text.splitlines()[1] == "no processes are running"


@pytest.mark.parametrize(
    "reason, expected",
    [("pynvml", "pynvml module not found, please install nvidia-ml-py"),
     ("library", "cuda driver can't be loaded, is cuda enabled?"),
     ("driver", "cuda driver can't be loaded, is cuda enabled?")],
)
def test_list_gpu_processes_returns_torch_strings_when_nvml_missing(fake_devices, reason, expected):
    fake_devices(FakeNvml(two_gpu_data(), order=[UUID_A, UUID_B], unavailable=reason))
    assert cnvml.list_gpu_processes(0) == expected
    with pytest.raises(NvmlUnavailableError):  # the numeric queries raise instead
        cnvml.utilization(0)


def test_list_gpu_processes_probes_nvml_before_cuda(monkeypatch):
    """No driver at all: a string back, and CUDA is never asked for the device."""
    from cudalab import devices

    def boom(*args, **kwargs):
        raise AssertionError("CUDA was touched")

    monkeypatch.setattr(devices, "get_device_properties", boom)
    monkeypatch.setattr(devices, "device_index", boom)
    monkeypatch.setattr(cnvml, "nvml_backend", lambda: FakeNvml({}, [], unavailable="library"))
    assert cnvml.list_gpu_processes() == "cuda driver can't be loaded, is cuda enabled?"


def test_other_nvml_errors_propagate(fake_devices):
    data = two_gpu_data()
    del data[UUID_B]
    fake_devices(FakeNvml(data, order=[UUID_A], unsupported={"processes"}))
    with pytest.raises(NvmlError, match="not supported"):
        cnvml.list_gpu_processes(0)
    with pytest.raises(NvmlError, match="no device with UUID"):
        cnvml.temperature(1)  # UUID_B unknown to this NVML


def test_device_snapshot(fake_devices):
    fake_devices(FakeNvml(two_gpu_data(), order=[UUID_B, UUID_A], unsupported={"power"}))
    snap = cnvml.device_snapshot(1)
    assert snap == {
        "utilization": 91, "memory_utilization": 92, "temperature": 93, "power_draw": None,
        "clock_rate": 1980, "memory_used": 7 * MIB, "memory_total": 80 * 1024 * MIB,
        "simulated": False,
    }


def test_device_snapshot_without_nvml(fake_devices):
    fake_devices(FakeNvml(two_gpu_data(), order=[UUID_A], unavailable="library", simulated=True))
    snap = cnvml.device_snapshot(0)
    assert snap.pop("simulated") is True
    assert set(snap) == {"utilization", "memory_utilization", "temperature", "power_draw",
                         "clock_rate", "memory_used", "memory_total"}
    assert all(v is None for v in snap.values())


def test_device_count_nvml(monkeypatch):
    monkeypatch.setattr(cnvml, "nvml_backend", lambda: FakeNvml({}, [UUID_A, UUID_B]))
    assert cnvml.device_count_nvml() == 2
    monkeypatch.setattr(cnvml, "nvml_backend", lambda: FakeNvml({}, [], unavailable="driver"))
    assert cnvml.device_count_nvml() is None


def test_top_level_names():
    for name in ("utilization", "memory_usage", "temperature", "power_draw", "clock_rate",
                 "list_gpu_processes", "device_memory_used"):
        assert getattr(cudalab, name) is getattr(cnvml, name)


# ------------------------------------------------------------------------ the active backend
def _active_nvml_or_skip():
    from cudalab import _driver

    nv = _driver.get_backend().nvml()
    try:
        nv.device_count()
    except NvmlUnavailableError as exc:
        pytest.skip(f"NVML unavailable: {exc}")
    return nv


def test_active_backend_end_to_end():
    """Simulator on CI (values simulated, and said so); the real NVML on a GPU host."""
    nv = _active_nvml_or_skip()
    n = cudalab.device_count()
    assert n >= 1
    assert cnvml.device_count_nvml() == nv.device_count() >= n
    for d in range(n):
        uuid = cudalab.get_device_properties(d).nvml_uuid
        assert uuid in nv.uuids()
        text = cnvml.list_gpu_processes(d)
        first = text.splitlines()[0]
        nvml_index = nv.uuids().index(uuid)
        assert first == (f"GPU:{nvml_index} (simulated)" if nv.simulated else f"GPU:{nvml_index}")
        snap = cnvml.device_snapshot(d)
        assert snap["simulated"] is nv.simulated
        assert snap["memory_total"] is None or snap["memory_total"] > 0
        for key in ("utilization", "memory_utilization"):
            assert snap[key] is None or 0 <= snap[key] <= 100
        assert 0 <= cnvml.utilization(d) <= 100
        assert 0 <= cnvml.memory_usage(d) <= 100
        assert cnvml.device_memory_used(d) >= 0
    for spec in (f"cuda:{n - 1}", cudalab.Device("cuda", n - 1), None):
        assert isinstance(cnvml.utilization(spec), int)


def test_internal_clock_event_reasons_asks_the_seam(fake_devices, monkeypatch):
    """cudalab._internal.clock_event_reasons maps the CUDA ordinal to its UUID and asks the
    backend's Nvml; None on any error."""
    from cudalab import _driver, _internal

    data = two_gpu_data()
    data[UUID_B]["reasons"] = 0x4
    fake = FakeNvml(data, order=[UUID_B, UUID_A])
    monkeypatch.setattr(_driver.get_backend(), "nvml", lambda: fake)
    assert _internal.clock_event_reasons(1) == 0x4
    assert _internal.clock_event_reasons(0) == 0
    fake.unsupported.add("reasons")
    assert _internal.clock_event_reasons(1) is None
