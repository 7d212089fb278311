"""A malformed allocator setting: every reader reports it the same way, and its message
repeats a readable prefix of the setting, never the whole of it."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from cudalab._units import ECHO_LIMIT
from cudalab.allocator.config import parse_alloc_conf

ROOT = Path(__file__).resolve().parents[2]

#: Every reader of the allocator's state, called after CUDA is initialised but before
#: anything was allocated (the state in which some of them used to answer 0).
READERS = {
    "memory_allocated()": "cm.memory_allocated()",
    "memory_allocated(0)": "cm.memory_allocated(0)",
    "memory_reserved()": "cm.memory_reserved()",
    "max_memory_allocated()": "cm.max_memory_allocated()",
    "max_memory_reserved()": "cm.max_memory_reserved()",
    "memory_stats()": "cm.memory_stats()",
    "memory_summary()": "cm.memory_summary()",
    "memory_snapshot()": "cm.memory_snapshot()",
    "get_allocator_backend()": "cm.get_allocator_backend()",
    "caching_allocator_alloc(512)": "cm.caching_allocator_alloc(512)",
}


def _run(code: str, conf: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CUDALAB_", "PYTORCH_"))}
    env.update(CUDALAB_SIMULATOR="1", CUDALAB_ALLOC_CONF=conf, PYTHONIOENCODING="utf-8")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          encoding="utf-8", env=env, timeout=120, cwd=str(ROOT))


def test_every_reader_raises_a_malformed_setting():
    """Not 0 from some readers and a ValueError from others: each one raises the same
    configuration error (torch fails at first use), and fixing nothing keeps raising."""
    calls = "\n".join(
        f"try:\n    out[{name!r}] = repr({expr})\n"
        f"except Exception as exc:\n    out[{name!r}] = type(exc).__name__ + ': ' + str(exc)"
        for name, expr in READERS.items())
    code = ("import json, cudalab, cudalab.memory as cm\ncudalab.init()\nout = {}\n"
            f"{calls}\nprint(json.dumps(out))")
    res = _run(code, "bogus_option:1")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    expected = ("AllocatorSettingsError: CUDALAB_ALLOC_CONF='bogus_option:1': unknown option "
                "'bogus_option'")
    for name in READERS:
        assert out[name].startswith(expected), (name, out[name])


def test_readers_answer_before_cuda_is_initialised():
    """Before CUDA is initialised the statistics readers still answer without initialising
    it (torch's 0 and {}): the settings are read when CUDA is in use."""
    res = _run("import cudalab, cudalab.memory as cm\n"
               "print(cm.memory_allocated(), cm.memory_reserved(), cm.memory_stats(), "
               "cudalab.is_initialized())", "bogus_option:1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", "0", "{}", "False"]


@pytest.mark.parametrize("text", [
    "max_split_size_mb:" + "x" * 200_000,  # a bad value
    "y" * 200_000,  # a bad option name
    "max_split_size_mb:128," * 10_000 + "bogus:1",  # a bad option after a long good part
    "roundup_power2_divisions:[" + "1," * 100_000,  # an unclosed list
])
def test_a_long_setting_is_echoed_as_a_readable_prefix(text):
    with pytest.raises(ValueError) as info:
        parse_alloc_conf(text, source="CUDALAB_ALLOC_CONF")
    msg = str(info.value)
    assert len(msg) < 1000, len(msg)  # (the list of known options is most of it)
    assert msg.startswith(f"CUDALAB_ALLOC_CONF={text[:ECHO_LIMIT]!r}… ({len(text):,} characters)")


@pytest.mark.parametrize("text", ["max_split_size_mb:" + "9" * 5000,
                                  "roundup_power2_divisions:[" + "2" * 5000 + ":1]"])
def test_a_number_too_long_for_int_is_a_setting_error(text):
    """Python refuses int() of over 4,300 digits with its own message; the parser names the
    option instead."""
    with pytest.raises(ValueError, match=r"^CUDALAB_ALLOC_CONF=.*: invalid \w+ value") as info:
        parse_alloc_conf(text, source="CUDALAB_ALLOC_CONF")
    assert "int_max_str_digits" not in str(info.value) and len(str(info.value)) < 1000


def test_the_cli_prints_a_prefix_of_a_long_conf(tmp_path):
    trace = tmp_path / "snapshot.pickle"
    trace.write_bytes(pickle.dumps({"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 1 << 40, "size": 512, "stream": 0, "time_us": 1}]]}))
    conf = "max_split_size_mb:" + "1" * 20_000
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDALAB_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONIOENCODING"] = "utf-8"
    res = subprocess.run([sys.executable, "-m", "cudalab", "replay", str(trace), "--conf", conf],
                         capture_output=True, text=True, encoding="utf-8", env=env,
                         timeout=120, cwd=str(ROOT))
    assert res.returncode == 2
    assert "invalid max_split_size_mb value" in res.stderr
    assert f"({len(conf):,} characters)" in res.stderr
    assert len(res.stderr) < 1000, len(res.stderr)


# --------------------------------------------------------------------------- fuzzing
_PIECES = ["max_split_size_mb", "expandable_segments", "garbage_collection_threshold",
           "roundup_power2_divisions", "backend", "per_process_memory_fraction",
           "release_lock_on_cudamalloc", "pinned_num_register_threads", "large_segment_size_mb",
           ":", ",", "[", "]", ">", "True", "False", "native", "cudaMallocAsync", "0", "1",
           "0.5", "-1", "1e309", "nan", "inf", "256", "512:4", "9" * 30, " ", "\t", "é", "\x00"]


def test_fuzzed_settings_parse_or_raise_a_short_value_error():
    """3,000 random settings strings (torch's tokens, in any order, with junk): each parses
    or raises ValueError with a bounded message; nothing else escapes (no IndexError,
    OverflowError, RecursionError...)."""
    import random
    import warnings

    from cudalab.allocator.config import parse_alloc_conf

    rng = random.Random(23)
    parsed = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (cudaMallocAsync ignoring native options)
        for _ in range(3000):
            text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 12)))
            try:
                parse_alloc_conf(text, source="CUDALAB_ALLOC_CONF")
                parsed += 1
            except ValueError as exc:
                assert len(str(exc)) < 2000, text
    assert 0 < parsed < 3000  # both outcomes were exercised
