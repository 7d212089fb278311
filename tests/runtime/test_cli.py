"""The ``cudalab`` command: ``info`` on the simulator, --json, the no-device path, formatting."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import cudalab
from cudalab import cli

ROOT = pathlib.Path(cudalab.__file__).resolve().parent.parent


def run_cli(*args, simulator_env=None, extra_env=None):
    """``python -m cudalab ARGS`` in a fresh process; CUDALAB_SIMULATOR only if given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDALAB_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONIOENCODING"] = "utf-8"
    if simulator_env is not None:
        env["CUDALAB_SIMULATOR"] = simulator_env
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "cudalab", *args], capture_output=True,
                          text=True, encoding="utf-8", env=env, timeout=120, cwd=str(ROOT))


def device_rows(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
    return [line for line in lines[start + 1:] if line.strip()]


def test_info_simulator_table():
    res = run_cli("info", "--simulator", extra_env={"CUDALAB_SIMULATOR_DEVICES": "2"})
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.splitlines()[0] == "SIMULATOR: these devices are simulated"
    assert "backend  simulator (no GPU used; all values simulated)" in out
    assert f"cudalab  {cudalab.__version__}" in out
    rows = device_rows(out)
    assert len(rows) == 2, out
    for index, row in enumerate(rows):
        assert row.split()[0] == str(index)
        assert "simulated" in row.lower()
        assert "GiB" in row and "GPU-" in row


def test_info_simulator_env_json():
    res = run_cli("info", "--json", simulator_env="1",
                  extra_env={"CUDALAB_SIMULATOR_DEVICES": "2"})
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["backend"] == "simulator" and info["simulated"] is True
    assert info["error"] is None
    assert info["version"] == cudalab.__version__
    assert len(info["devices"]) == 2
    for index, dev in enumerate(info["devices"]):
        assert dev["index"] == index
        assert "simulated" in dev["name"].lower()
        assert dev["uuid"].startswith("GPU-")
        assert 0 < dev["memory_free"] <= dev["memory_total"]
        assert dev["multi_processor_count"] > 0
        assert {"utilization", "memory_utilization", "temperature", "power_draw",
                "clock_rate", "memory_used"} <= set(dev)
    major, minor = info["driver_version"].split(".")
    assert int(major) * 1000 + int(minor) * 10 == info["driver_version_int"]


def test_info_without_gpu():
    """No simulator requested: on a machine without a driver (CI) there are no devices.

    CUDA_VISIBLE_DEVICES="" hides real GPUs too, so the same path runs on a GPU host.
    """
    res = run_cli("info", extra_env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "backend  cuda" in out
    assert "No CUDA devices: " in out
    assert "cudalab info --simulator" in out and "CUDALAB_SIMULATOR=1" in out
    assert cli.SIMULATOR_BANNER not in out
    assert "Traceback" not in res.stderr


def test_info_without_gpu_json():
    res = run_cli("info", "--json", extra_env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["backend"] == "cuda" and info["simulated"] is False
    assert info["devices"] == [] and info["error"]


def test_bad_simulator_variable():
    res = run_cli("info", simulator_env="maybe")
    assert res.returncode == 2
    assert "CUDALAB_SIMULATOR" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("variable, value", [("CUDALAB_SIMULATOR_MEMORY", "12XB"),
                                             ("CUDALAB_SIMULATOR_DEVICES", "two")])
def test_bad_simulator_setting_is_one_line(variable, value):
    """A malformed simulator setting: one clear line on stderr and status 2, no traceback."""
    res = run_cli("info", simulator_env="1", extra_env={variable: value})
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cudalab: error: ")
    assert f"{variable}={value!r}" in lines[0]


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"cudalab {cudalab.__version__}"
    assert cli.main([]) == 0
    assert "info" in capsys.readouterr().out


def test_info_in_process(capsys):
    """Whatever backend the test session uses, ``info --json`` describes it."""
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["devices"], info["error"]
    assert info["simulated"] is (info["backend"] == "simulator")
    assert info["history_stamp"] == cudalab.memory_tools.stacks.stamp_implementation()
    if info["simulated"]:
        assert "launch_calls" not in info
    else:  # the real backend says which path its launches take
        from cudalab._driver.cuda_api import FAST

        expect = "compiled" if FAST.launch_kernel is not None else "cuda.bindings"
        assert info["launch_calls"] == expect


# ------------------------------------------------------------------------ formatting
def sample_info(**over):
    info = {
        "version": "9.9.9", "backend": "cuda", "simulated": False, "driver_version": "13.0",
        "driver_version_int": 13000, "nvrtc_version": "13.0", "nvml": "available", "error": None,
        "devices": [
            {"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": "9.0",
             "memory_free": 80 * 2**30, "memory_total": int(79.2 * 2**30),
             "multi_processor_count": 132, "uuid": "GPU-11111111-2222-3333-4444-555555555555",
             "utilization": 7, "memory_utilization": 1, "temperature": 34, "power_draw": 71234,
             "clock_rate": 1980, "memory_used": 2**30},
            {"index": 1, "name": "NVIDIA H100 80GB HBM3", "capability": "9.0",
             "memory_free": 3 * 2**30, "memory_total": 80 * 2**30,
             "multi_processor_count": 132, "uuid": "GPU-66666666-2222-3333-4444-555555555555",
             "utilization": None, "memory_utilization": None, "temperature": None,
             "power_draw": None, "clock_rate": None, "memory_used": None},
        ],
    }
    info.update(over)
    return info


def test_format_table(monkeypatch):
    monkeypatch.setattr(cli, "_degree", lambda: "°C")
    text = cli._format_info(sample_info())
    lines = text.splitlines()
    assert lines[:4] == ["cudalab  9.9.9", "backend  cuda", "driver   CUDA 13.0 (13000)",
                         "NVRTC    13.0"]
    header, row0, row1 = lines[5:8]
    assert header.split()[:3] == ["#", "name", "cap"]
    assert "80.0 / 79.2 GiB" in row0 and "132" in row0
    assert row0.endswith("7 %  34 °C  71.2 W  1980 MHz")
    assert row1.split()[-4:] == ["n/a"] * 4
    assert len(header) == len(row0)  # columns line up (the widest cells are in row0)
    assert "SIMULATOR" not in text
    assert "stacks" not in text  # (an info without the key)


@pytest.mark.parametrize("stamp, shown", [("compiled", "compiled stamp (cudalab.memory_tools._stackstamp)"),
                                          ("python", "pure-Python stamp")])
def test_format_says_which_stamp_records_stacks(stamp, shown):
    lines = cli._format_info(sample_info(history_stamp=stamp)).splitlines()
    assert lines[4] == f"stacks   {shown}"


@pytest.mark.parametrize("calls, shown", [
    ("compiled", "compiled fast calls (cudalab._driver.fastcall)"),
    ("cuda.bindings", "cuda.bindings wrappers")])
def test_format_says_which_path_launches_take(calls, shown):
    lines = cli._format_info(sample_info(history_stamp="python", launch_calls=calls)).splitlines()
    assert lines[5] == f"launches {shown}"
    assert "launches" not in cli._format_info(sample_info())


def test_format_simulated_and_errors():
    text = cli._format_info(sample_info(simulated=True, backend="simulator"))
    assert text.splitlines()[0] == cli.SIMULATOR_BANNER
    assert "driver   CUDA 13.0 (13000) (simulated)" in text
    text = cli._format_info(sample_info(nvml="unavailable: pynvml module not found"))
    assert "NVML     unavailable: pynvml module not found" in text
    text = cli._format_info(sample_info(devices=[], error="no driver", driver_version=None))
    assert "driver   unavailable" in text
    assert "No CUDA devices: no driver" in text and cli.SIMULATOR_HINT in text


def test_cuda_version():
    assert cli._cuda_version(13000) == "13.0"
    assert cli._cuda_version(12080) == "12.8"
    assert cli._cuda_version(13010) == "13.1"


# ------------------------------------------------------- user-facing text around the command
def test_replay_help_names_the_files_it_reads():
    res = run_cli("replay", "--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "history CSV" in text and "snapshot pickle" in text and "Perfetto JSON" in text


def test_readme_environment_table_has_the_allocator_settings():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next((line for line in readme.splitlines() if line.startswith("| `CUDALAB_ALLOC_CONF`")),
               None)
    assert row is not None, "README's environment table lacks CUDALAB_ALLOC_CONF"
    assert "PYTORCH_CUDA_ALLOC_CONF" in row and "expandable_segments:True" in row
    assert "pytorch.org/docs" in row  # where the grammar is described


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("[a-z]*.py")))
def test_benchmark_help_speaks_of_the_project_only(script):
    """``--help`` prints the docstring: no internal issue numbers there."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    assert "benchmark" in res.stdout.lower() and "issue" not in res.stdout.lower()


def _stub(folder: pathlib.Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.mark.parametrize("apt_rc", [0, 1])
def test_browser_deps_says_what_it_installs_and_never_fails(tmp_path, apt_rc):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    _stub(bin_dir, "id", "echo 0")  # root, with apt-get, and no chromium on this PATH
    _stub(bin_dir, "apt-get", f'echo "$*" >> {log}; exit {apt_rc}')
    hm = tmp_path / "hm"
    (hm / "package" / "dist").mkdir(parents=True)
    (hm / "package" / "dist" / "embed.js").write_text("")
    res = subprocess.run(["/bin/bash", str(ROOT / ".ci" / "browser-deps")], capture_output=True,
                         text=True, timeout=60,
                         env={"PATH": str(bin_dir), "HOME": str(tmp_path),
                              "CUDALAB_HTML_MANAGER_DIR": str(hm)})
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines and "chromium" in lines[0] and "apt-get" in lines[0]
    assert "test_browser" in lines[0]  # why
    assert log.read_text().startswith("update")  # apt-get ran, after the line
    assert ("install" in log.read_text()) == (apt_rc == 0)
    assert ("could not install chromium" in res.stdout) == bool(apt_rc)
