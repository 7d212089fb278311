"""Devices: init, counting, current device, properties, device arguments (both backends)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest

import cudalab
from cudalab import devices
from cudalab._driver.visible_devices import parse_visible_devices


def test_is_available_and_count():
    assert cudalab.is_available()
    n = cudalab.device_count()
    assert n >= 1
    cudalab.init()
    assert cudalab.is_initialized()
    assert cudalab.device_count() == n


def test_device_objects_parse():
    assert cudalab.Device("cuda:1").index == 1
    assert cudalab.Device("cuda").index is None
    assert cudalab.Device(0) == cudalab.Device("cuda:0") == "cuda:0"
    assert str(cudalab.Device("cuda", 2)) == "cuda:2"
    assert hash(cudalab.Device(1)) == hash(cudalab.Device("cuda:1"))
    for bad in ("cpu", "cuda:x", "cuda:-1", "gpu:0"):
        with pytest.raises(ValueError):
            cudalab.Device(bad)
    with pytest.raises(TypeError):
        cudalab.Device(1.5)
    with pytest.raises(ValueError):
        cudalab.Device(-1)


def test_device_index_forms():
    n = cudalab.device_count()
    last = n - 1
    for form in (last, f"cuda:{last}", cudalab.Device(last), cudalab.Device("cuda", last)):
        assert devices.device_index(form) == last
    assert devices.device_index(None) == cudalab.current_device()
    assert devices.device_index("cuda") == cudalab.current_device()


@pytest.mark.parametrize("bad", [99, "cuda:99"])
def test_invalid_device_names_index_and_count(bad):
    n = cudalab.device_count()
    with pytest.raises(ValueError) as info:
        cudalab.get_device_properties(bad)
    msg = str(info.value)
    assert "99" in msg and f"{n} CUDA device" in msg
    with pytest.raises(ValueError):
        cudalab.set_device(bad)
    assert cudalab.current_device() == 0  # state intact


def test_bad_device_types():
    with pytest.raises(TypeError):
        cudalab.set_device(1.0)
    with pytest.raises(TypeError):
        cudalab.set_device(True)
    with pytest.raises(ValueError):
        cudalab.set_device("cpu")


def test_set_device_and_context_managers(two_devices):
    assert cudalab.current_device() == 0
    cudalab.set_device(1)
    assert cudalab.current_device() == 1
    cudalab.set_device(-1)  # negative is ignored, like torch
    assert cudalab.current_device() == 1
    cudalab.set_device("cuda:0")
    with cudalab.device(1):
        assert cudalab.current_device() == 1
        with cudalab.device(None):
            assert cudalab.current_device() == 1
        with cudalab.device(0):
            assert cudalab.current_device() == 0
        assert cudalab.current_device() == 1
    assert cudalab.current_device() == 0
    s = cudalab.Stream(device=1)
    with cudalab.device_of(s):
        assert cudalab.current_device() == 1
    with cudalab.device_of(object()):
        assert cudalab.current_device() == 0
    with pytest.raises(KeyError):
        with cudalab.device(1):
            raise KeyError("x")
    assert cudalab.current_device() == 0


def test_current_device_is_per_thread(two_devices):
    cudalab.set_device(1)
    seen = {}

    def worker():
        seen["start"] = cudalab.current_device()
        cudalab.set_device(0)
        seen["after"] = cudalab.current_device()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"start": 0, "after": 0}
    assert cudalab.current_device() == 1


def test_properties(backend):
    p = cudalab.get_device_properties(0)
    assert p.major >= 7 and p.minor >= 0
    assert p.total_memory > 1 << 30
    assert p.multi_processor_count > 0
    assert p.L2_cache_size > 0
    assert p.max_threads_per_multi_processor >= 1024
    # torch's type: a UUID whose str() has 36 characters and .bytes 16; NVML's spelling beside it
    assert isinstance(p.uuid, uuid.UUID) and len(str(p.uuid)) == 36 and len(p.uuid.bytes) == 16
    assert p.nvml_uuid == f"GPU-{p.uuid}"
    assert ":" in p.pci_bus_id
    assert cudalab.get_device_capability(0) == (p.major, p.minor)
    assert cudalab.get_device_name(0) == p.name
    assert p.simulated == backend.simulated
    if backend.simulated:
        assert "simulated" in p.name and "simulated=True" in repr(p)
    assert repr(p).startswith("_CudaDeviceProperties(name=")
    assert cudalab.get_device_properties(0) is p  # cached


def test_mem_get_info_and_sync():
    free, total = cudalab.mem_get_info()
    assert 0 < free <= total
    assert total == cudalab.get_device_properties(0).total_memory or not cudalab.get_device_properties(0).simulated
    cudalab.synchronize()
    cudalab.synchronize("cuda:0")


def test_peer_access(two_devices):
    assert cudalab.can_device_access_peer(0, 0) is False
    assert isinstance(cudalab.can_device_access_peer(0, 1), bool)
    with pytest.raises(ValueError):
        cudalab.can_device_access_peer(0, 42)


def test_arch_list_and_gencode():
    archs = cudalab.get_arch_list()
    assert "sm_90" in archs and all(a.startswith("sm_") for a in archs)
    assert "-gencode compute=compute_90,code=sm_90" in cudalab.get_gencode_flags()
    cudalab.ipc_collect()


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1", [1]), ("1,0", [1, 0]), ("0,0", []), ("2,-1,0", [2]), ("", []), ("0, 1", [0, 1]),
        ("1x,0", [1, 0]), ("1gpu2,2ampere", [1, 2]), ("abc", []), ("GPU-ab,GPU-cd", ["GPU-ab", "GPU-cd"]), ("GPU-ab,GPU-ab", []),
    ],
)
def test_parse_visible_devices(value, expected):
    assert parse_visible_devices(value) == expected


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CUDALAB_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=120)


def test_device_count_rereads_cuda_visible_devices_until_initialised():
    """torch does not cache the count before CUDA is initialised: a change of
    CUDA_VISIBLE_DEVICES before then is seen (issue 36 item 8), and the count init uses."""
    r = _run("""
        import os, cudalab
        os.environ.pop('CUDA_VISIBLE_DEVICES', None)
        counts = [cudalab.device_count()]
        os.environ['CUDA_VISIBLE_DEVICES'] = '1'
        counts.append(cudalab.device_count())
        os.environ['CUDA_VISIBLE_DEVICES'] = ''
        counts.append(cudalab.device_count())
        os.environ['CUDA_VISIBLE_DEVICES'] = '1,0'
        counts.append(cudalab.device_count())
        os.environ['CUDA_VISIBLE_DEVICES'] = '1'
        counts.append(cudalab.device_count())
        cudalab.init()
        counts.append(cudalab.device_count())
        counts.append(cudalab.get_device_properties(0).pci_bus_id)  # physical device 1's
        os.environ['CUDA_VISIBLE_DEVICES'] = '0,1'
        counts.append(cudalab.device_count())  # fixed once initialised
        print(counts)
    """, CUDALAB_SIMULATOR="1", CUDALAB_SIMULATOR_DEVICES="2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[2, 1, 0, 2, 1, 1, '0000:19:00.0', 1]"


def test_import_creates_no_context_and_is_lazy():
    r = _run("""
        import sys, cudalab
        assert 'cuda.bindings' not in sys.modules and 'cuda.bindings.driver' not in sys.modules
        assert 'numpy' not in sys.modules
        from cudalab import _driver
        assert _driver.current_backend() is None
        assert not cudalab.is_initialized()
        print('ok')
    """, CUDALAB_SIMULATOR="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_no_driver_path_is_clean():
    """Without the simulator and without a driver: not available, count 0, no exception."""
    from tests.helpers.gpu import HAS_GPU

    if HAS_GPU:
        pytest.skip("a real driver is present")
    r = _run("""
        import cudalab
        assert cudalab.is_available() is False
        assert cudalab.device_count() == 0
        try:
            cudalab.current_device()
        except cudalab.CudaUnavailableError as e:
            print('raised:', e)
    """)
    assert r.returncode == 0, r.stderr
    assert "raised:" in r.stdout and "CUDALAB_SIMULATOR=1" in r.stdout


def test_simulator_selection_is_explicit():
    r = _run("""
        import cudalab
        cudalab.use_simulator()
        print(cudalab.get_device_name(0))
        try:
            cudalab.use_simulator(False)
        except RuntimeError as e:
            print('locked:', e)
    """)
    assert r.returncode == 0, r.stderr
    assert "simulated" in r.stdout and "locked:" in r.stdout
    r = _run("import cudalab; cudalab.device_count()", CUDALAB_SIMULATOR="maybe")
    assert r.returncode != 0 and "CUDALAB_SIMULATOR" in r.stderr


def test_fork_after_init_raises_in_child():
    r = _run("""
        import os, cudalab
        cudalab.init()
        pid = os.fork()
        if pid == 0:
            try:
                cudalab.Stream()
            except RuntimeError as e:
                os._exit(0 if 'forked subprocess' in str(e) else 3)
            os._exit(4)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """, CUDALAB_SIMULATOR=os.environ.get("CUDALAB_SIMULATOR", ""))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"
