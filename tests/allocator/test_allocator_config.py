"""Allocator settings: torch's grammar, its checks, cudalab's error messages, the environment."""

from __future__ import annotations

import pytest

from cudalab.allocator.config import (
    UNLIMITED,
    AllocatorConfig,
    config_from_env,
    no_caching_from_env,
    parse_alloc_conf,
)
from cudalab.errors import AllocatorSettingsError

MiB = 1024 * 1024


def test_defaults_are_torchs():
    c = parse_alloc_conf("")
    assert c == AllocatorConfig(text="", source="parse_alloc_conf")
    assert c.max_split_size == UNLIMITED
    assert c.max_non_split_rounding_size == 20 * MiB
    assert c.large_segment_size == 20 * MiB
    assert c.roundup_power2_divisions == (0,) * 16
    assert c.garbage_collection_threshold == 0.0
    assert c.expandable_segments is False and c.backend == "native"
    assert parse_alloc_conf(None) == AllocatorConfig()


def test_full_string_with_spaces_and_trailing_comma():
    c = parse_alloc_conf(
        " max_split_size_mb : 128 , max_non_split_rounding_mb:64, garbage_collection_threshold:0.6,"
        "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],expandable_segments:False,"
        "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,"
        "pinned_num_register_threads:8,pinned_use_background_threads:True,"
        "pinned_reserve_segment_size_mb:64,graph_capture_record_stream_reuse:True,"
        "per_process_memory_fraction:0.5,backend:native,"
    )
    assert c.max_split_size == 128 * MiB
    assert c.max_non_split_rounding_size == 64 * MiB
    assert c.garbage_collection_threshold == 0.6
    assert c.release_lock_on_cudamalloc and c.pinned_use_cuda_host_register
    assert c.pinned_num_register_threads == 8 and c.pinned_use_background_threads
    assert c.pinned_reserve_segment_size_mb == 64 and c.graph_capture_record_stream_reuse
    assert c.per_process_memory_fraction == 0.5
    assert c.keys[0] == "max_split_size_mb" and len(c.keys) == 13


def test_roundup_list_form_follows_torchs_filling_rules():
    c = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    # 256 MiB -> entry 8; the first key also fills every smaller entry; ">" fills the
    # entries after the last key (torch >= 2.9; older torch overwrote the last key too).
    assert c.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    assert c.divisions_for(100 * MiB) == 1
    assert c.divisions_for(600 * MiB) == 2
    assert c.divisions_for(1500 * MiB) == 4
    assert c.divisions_for(40 * 1024 * MiB) == 8
    assert c.divisions_dict()["256"] == 1 and c.divisions_dict()["32768"] == 8
    c = parse_alloc_conf("roundup_power2_divisions:[64:8,256:4,>:0]")
    assert c.roundup_power2_divisions == (8,) * 7 + (0, 4) + (0,) * 7
    c = parse_alloc_conf("roundup_power2_divisions:[65536:2]")  # beyond 32 GiB: last entry
    assert c.roundup_power2_divisions == (2,) * 16
    assert parse_alloc_conf("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16


def test_large_segment_size_is_read_first_and_moves_the_minimums():
    c = parse_alloc_conf("max_split_size_mb:32,large_segment_size_mb:32")
    assert c.large_segment_size == 32 * MiB and c.max_split_size == 32 * MiB
    assert c.max_non_split_rounding_size == 32 * MiB
    with pytest.raises(ValueError, match="max_split_size_mb value '30'"):
        parse_alloc_conf("large_segment_size_mb:32,max_split_size_mb:30")


def test_huge_max_split_is_clamped_like_torch():
    c = parse_alloc_conf("max_split_size_mb:99999999999999999999")
    assert c.max_split_size == (UNLIMITED // MiB) * MiB


@pytest.mark.parametrize("text, option, bad, form", [
    ("foo:1", "foo", None, "accepted options are"),
    ("max_split_size_mb:10", "max_split_size_mb", "10", ">= 20"),
    ("max_split_size_mb:abc", "max_split_size_mb", "abc", "whole number of MiB"),
    ("max_split_size_mb:-5", "max_split_size_mb", "-5", "whole number of MiB"),
    ("max_split_size_mb:20.5", "max_split_size_mb", "20.5", "whole number of MiB"),
    ("max_split_size_mb", "max_split_size_mb", "", "max_split_size_mb:<value>"),
    ("max_split_size_mb:", "max_split_size_mb", "", "whole number"),
    ("max_non_split_rounding_mb:5", "max_non_split_rounding_mb", "5", ">= 20"),
    ("garbage_collection_threshold:1.0", "garbage_collection_threshold", "1.0", "between 0 and 1"),
    ("garbage_collection_threshold:0", "garbage_collection_threshold", "0.0", "between 0 and 1"),
    ("garbage_collection_threshold:nan", "garbage_collection_threshold", "nan", "between 0 and 1"),
    ("roundup_power2_divisions:3", "roundup_power2_divisions", "3", "power of 2"),
    ("roundup_power2_divisions:0", "roundup_power2_divisions", "0", "power of 2"),
    ("roundup_power2_divisions:[256:3]", "roundup_power2_divisions", "256:3", "power of 2"),
    ("roundup_power2_divisions:[300:2]", "roundup_power2_divisions", "300:2", "power of 2"),
    ("roundup_power2_divisions:[256:2", "roundup_power2_divisions", None, "]"),
    ("roundup_power2_divisions:[256:2;512:4]", "roundup_power2_divisions", None, "power of 2"),
    ("expandable_segments:true", "expandable_segments", "true", "True or False"),
    ("expandable_segments:1", "expandable_segments", "1", "True or False"),
    ("release_lock_on_cudamalloc:yes", "release_lock_on_cudamalloc", "yes", "True or False"),
    ("backend:async", "backend", "async", "native or cudaMallocAsync"),
    ("pinned_num_register_threads:3", "pinned_num_register_threads", "3", "power of 2"),
    ("pinned_reserve_segment_size_mb:0", "pinned_reserve_segment_size_mb", "0", "> 0"),
    ("per_process_memory_fraction:1.5", "per_process_memory_fraction", "1.5", "[0, 1]"),
    ("large_segment_size_mb:10", "large_segment_size_mb", "10", "> 10"),
    ("max_split_size_mb:128 garbage_collection_threshold:0.5", "max_split_size_mb", None, None),
    ("max_split_size_mb:128;expandable_segments:True", "max_split_size_mb", None, None),
    (",max_split_size_mb:128", None, None, "key:value pairs"),
])
def test_malformed_settings_name_option_value_and_form(text, option, bad, form):
    with pytest.raises(ValueError) as info:
        parse_alloc_conf(text, source="CUDALAB_ALLOC_CONF")
    msg = str(info.value)
    # torch's own message leads where torch has one (see the test below); then cudalab's
    assert msg.startswith(f"CUDALAB_ALLOC_CONF={text!r}") or f"(CUDALAB_ALLOC_CONF={text!r}" in msg
    if option:
        assert option in msg
    if bad is not None:
        assert repr(bad) in msg
    if form:
        assert form in msg


@pytest.mark.parametrize("text, torch_text", [
    ("expandable_segments:true", "Expected a single True/False argument for expandable_segments"),
    ("release_lock_on_cudamalloc:1",
     "Expected a single True/False argument for release_lock_on_cudamalloc"),
    ("pinned_use_cuda_host_register:yes",
     "Expected a single True/False argument for pinned_use_cuda_host_register"),
    ("per_process_memory_fraction:1.5",
     "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"),
])
def test_invalid_settings_read_as_torchs_first(text, torch_text):
    with pytest.raises(ValueError) as info:
        parse_alloc_conf(text, source="CUDALAB_ALLOC_CONF")
    assert str(info.value).startswith(torch_text + " (CUDALAB_ALLOC_CONF=")


@pytest.mark.parametrize("text", [
    # torch's test_allocator_settings: each raises RuntimeError (TORCH_CHECK) in torch
    "foo:1,bar:2",
    "garbage_collection_threshold:1.2",
    "max_split_size_mb:2",
    "release_lock_on_cudamalloc:none",
    "pinned_use_cuda_host_register:none",
    "pinned_num_register_threads:none",
    "pinned_num_register_threads:1024",
])
def test_invalid_settings_raise_torchs_runtime_error_too(text):
    """A bad value is refused as torch refuses it (RuntimeError, which torch's tests
    assert) and is a ValueError too, naming the option and the value."""
    with pytest.raises(RuntimeError) as info:
        parse_alloc_conf(text, source="_set_allocator_settings")
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, AllocatorSettingsError)
    option = text.split(":")[0]
    assert option in str(info.value)
    if text == "release_lock_on_cudamalloc:none":
        assert str(info.value).startswith(
            "Expected a single True/False argument for release_lock_on_cudamalloc")
        assert "'none'" in str(info.value) and "True or False" in str(info.value)


@pytest.mark.parametrize("spelling", ["true", "false", "TRUE", "1", "0", "yes", "on", ""])
def test_boolean_options_take_exactly_torchs_spellings(spelling):
    """torch 2.11's parser takes exactly ``True`` and ``False`` for every boolean option."""
    for key in ("expandable_segments", "release_lock_on_cudamalloc",
                "pinned_use_cuda_host_register", "pinned_use_background_threads",
                "graph_capture_record_stream_reuse"):
        assert parse_alloc_conf(f"{key}:True") != parse_alloc_conf(f"{key}:False")
        with pytest.raises(ValueError, match=f"True/False argument for {key}"):
            parse_alloc_conf(f"{key}:{spelling}")


def test_async_backend_warns_about_native_only_options():
    with pytest.warns(UserWarning, match="ignores max_split_size_mb"):
        c = parse_alloc_conf("backend:cudaMallocAsync,max_split_size_mb:64")
    assert c.backend == "cudaMallocAsync"


def test_environment_precedence():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:30"}
    assert config_from_env(env).max_split_size == 30 * MiB
    assert config_from_env(env).source == "PYTORCH_CUDA_ALLOC_CONF"
    env["PYTORCH_ALLOC_CONF"] = "max_split_size_mb:40"
    assert config_from_env(env).max_split_size == 40 * MiB
    env["CUDALAB_ALLOC_CONF"] = "max_split_size_mb:50"
    assert config_from_env(env).max_split_size == 50 * MiB
    env["CUDALAB_ALLOC_CONF"] = ""  # set but empty: defaults, torch's variables ignored
    assert config_from_env(env).max_split_size == UNLIMITED
    assert config_from_env({}) == AllocatorConfig()
    env["CUDALAB_ALLOC_CONF"] = "bogus:1"
    with pytest.raises(ValueError, match=r"^CUDALAB_ALLOC_CONF='bogus:1': unknown option 'bogus'"):
        config_from_env(env)


def test_no_caching_variables():
    assert not no_caching_from_env({})
    assert no_caching_from_env({"CUDALAB_NO_MEMORY_CACHING": "1"})
    assert no_caching_from_env({"PYTORCH_NO_CUDA_MEMORY_CACHING": "anything"})
    assert not no_caching_from_env({"PYTORCH_NO_CUDA_MEMORY_CACHING": "0"})
    assert not no_caching_from_env({"CUDALAB_NO_MEMORY_CACHING": "off",
                                    "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})


def test_bad_environment_fails_at_first_allocator_creation_and_keeps_state(monkeypatch, backend):
    """A malformed CUDALAB_ALLOC_CONF raises when the first allocator is created; fixing the
    variable lets the next attempt succeed (nothing half-built is left behind)."""
    from cudalab.allocator import registry as A

    saved = (list(A.allocators), list(A.active), A._config)
    try:
        A._reset_for_tests()
        monkeypatch.setenv("CUDALAB_ALLOC_CONF", "max_split_size_mb:5")
        with pytest.raises(ValueError, match="max_split_size_mb value '5'"):
            A.get_allocator(0)
        assert A.existing_allocator(0) is None and A._config is None
        monkeypatch.setenv("CUDALAB_ALLOC_CONF", "max_split_size_mb:64")
        a = A.get_allocator(0)
        assert a.memory_stats()["max_split_size"] == 64 * MiB
        a.free(a.malloc(100))
        a.empty_cache()
    finally:
        A.allocators[:] = saved[0]
        A.active[:] = saved[1]
        A._config = saved[2]


def test_config_selects_the_allocator_implementation(backend):
    from cudalab.allocator.async_allocator import AsyncPoolAllocator
    from cudalab.allocator.caching import DeviceCachingAllocator
    from cudalab.allocator.expandable import ExpandableCachingAllocator
    from cudalab.allocator.registry import create_allocator

    a = create_allocator(backend, 0, parse_alloc_conf("expandable_segments:True"))
    assert isinstance(a, ExpandableCachingAllocator)
    a = create_allocator(backend, 0, parse_alloc_conf("expandable_segments:False"))
    assert type(a) is DeviceCachingAllocator
    a = create_allocator(backend, 0, parse_alloc_conf("backend:cudaMallocAsync"))
    assert isinstance(a, AsyncPoolAllocator)
    a.close()


def test_per_process_memory_fraction_setting_is_applied(backend):
    from cudalab.allocator.registry import create_allocator

    a = create_allocator(backend, 0, parse_alloc_conf("per_process_memory_fraction:0.25"))
    assert a.get_memory_fraction() == pytest.approx(0.25)
