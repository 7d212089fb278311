"""The observer bus (cudalab._observe): per family, the flag follows the subscriber list, the
old idiom and the bus are one, an observer that raises keeps its family's rule, and Ctrl-C
in the middle of a change leaves the list and the flag in agreement."""

from __future__ import annotations

import ast
import gc
import signal
import time
import warnings
from pathlib import Path

import pytest

import cudalab
from cudalab import _internal, _interrupts, _observe, _sanitizer_hook, sanitizer
from cudalab.allocator import hooks, oom_observers, registry
from cudalab.allocator.caching import DeviceCachingAllocator

FAMILIES = _observe.FAMILIES


def _flag(family):
    return getattr(_observe, family + "_on")


def _subscribers(family):
    return getattr(_observe, family + "_subscribers")


def _observer(*args, **kwargs):
    """A do-nothing observer of any family (a new function object per test)."""


@pytest.fixture(autouse=True)
def _agreeing():
    """Every test starts and ends with each family's flag equal to its list's truth."""
    for family in FAMILIES:
        assert _flag(family) == bool(_subscribers(family)), family
    yield
    for family in FAMILIES:
        assert _flag(family) == bool(_subscribers(family)), family


def test_the_module_imports_nothing_of_cudalab():
    tree = ast.parse(Path(_observe.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported and not [m for m in imported if m.split(".")[0] == "cudalab"]


@pytest.mark.parametrize("family", FAMILIES)
def test_subscribe_turns_the_flag_on_and_unsubscribe_off(family):
    subscribe = getattr(_observe, "subscribe_" + family)
    unsubscribe = getattr(_observe, "unsubscribe_" + family)
    before = list(_subscribers(family))

    def observer(*args, **kwargs):
        pass

    subscribe(observer)
    try:
        assert _flag(family) is True
        assert _subscribers(family)[-1] is observer
    finally:
        assert unsubscribe(observer) is True
    assert list(_subscribers(family)) == before
    assert _flag(family) is bool(before)
    assert unsubscribe(observer) is False  # (a second time: nothing to undo)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_list_change_sets_the_flag(family):
    subscribers = _subscribers(family)
    saved = list(subscribers)
    try:
        subscribers.clear()
        assert _flag(family) is False
        subscribers.append(_observer)
        assert _flag(family) is True
        subscribers.remove(_observer)
        assert _flag(family) is False
        subscribers.extend([_observer, _observer])
        assert _flag(family) is True
        subscribers.pop()
        del subscribers[0]
        assert _flag(family) is False
        subscribers.insert(0, _observer)
        assert _flag(family) is True
        subscribers *= 0
        assert _flag(family) is False and not subscribers
        subscribers += [_observer]
        assert _flag(family) is True
        subscribers[:] = []
        assert _flag(family) is False
        with pytest.raises(ValueError):
            subscribers.remove(_observer)  # (list's error, and the flag still agrees)
        assert _flag(family) is False
    finally:
        subscribers[:] = saved
    assert _flag(family) is bool(saved)


# ------------------------------------------------------------------ the idioms are views
def test_launch_observers_is_the_launch_family():
    assert _internal.launch_observers is _observe.launch_subscribers
    calls = []

    def observer(name, device, stream, grid, block):
        calls.append(name)

    assert not _observe.launch_on
    _internal.launch_observers.append(observer)
    try:
        assert _observe.launch_on
        cudalab.uniform_(cudalab.empty(64))
    finally:
        _internal.launch_observers.remove(observer)
    assert not _observe.launch_on
    assert calls  # the RNG's launch was told
    cudalab.uniform_(cudalab.empty(64))
    assert len(calls) == 1 or calls.count(calls[0]) == len(calls)


def test_a_launch_observer_that_raises_stops_the_launch_caller():
    def observer(*args):
        raise LookupError("observer failed")

    _observe.subscribe_launch(observer)
    try:
        with pytest.raises(LookupError):
            cudalab.uniform_(cudalab.empty(64))
        assert _observe.launch_on  # still subscribed: raising does not unsubscribe
    finally:
        _observe.unsubscribe_launch(observer)
    assert not _observe.launch_on


def test_collective_observers_is_the_collective_family():
    assert _internal.collective_observers is _observe.collective_subscribers
    assert _internal.CollectiveRecord is _observe.CollectiveRecord
    seen = []
    _internal.collective_observers.append(seen.append)
    try:
        assert _observe.collective_on
        _internal.notify_collective("all_reduce", 64, 2, 1.0, (0, 1))
    finally:
        _internal.collective_observers.remove(seen.append)
    assert not _observe.collective_on
    assert seen == [_observe.CollectiveRecord("all_reduce", 64, 2, 1.0, (0, 1))]

    def raising(record):
        raise LookupError(record.name)

    _observe.subscribe_collective(raising)
    try:
        with pytest.raises(LookupError, match="broadcast"):
            _internal.notify_collective("broadcast", 8, 1, 1.0, (0,))
    finally:
        _observe.unsubscribe_collective(raising)


def test_oom_observers_is_the_out_of_memory_family():
    assert oom_observers.observers is _observe.out_of_memory_subscribers
    seen = []

    def observer(device, alloc, device_allocated, device_free):
        seen.append((device, alloc, device_allocated, device_free))

    def raising(*args):
        raise LookupError("observer failed")

    cudalab.memory._attach_out_of_memory_observer(raising)
    oom_observers.attach_out_of_memory_observer(observer)
    try:
        assert _observe.out_of_memory_on
        assert _observe.out_of_memory_subscribers[-2:] == [raising, observer]
        with pytest.warns(RuntimeWarning, match="LookupError"):
            oom_observers.notify_out_of_memory(0, 1, 2, 3)
        assert seen == [(0, 1, 2, 3)]  # the one after the raising one still ran
    finally:
        _observe.unsubscribe_out_of_memory(observer)
        _observe.unsubscribe_out_of_memory(raising)
    assert observer not in oom_observers.observers


def test_create_hooks_are_the_allocator_created_family():
    def hook(allocator):
        pass

    registry.add_create_hook(hook)
    registry.add_create_hook(hook)  # (once, however often it is added)
    try:
        assert _observe.allocator_created_subscribers.count(hook) == 1
        assert _observe.allocator_created_on
    finally:
        registry.remove_create_hook(hook)
    assert hook not in _observe.allocator_created_subscribers
    registry.remove_create_hook(hook)  # (nothing to undo)


def test_attach_trace_is_the_allocation_trace_family():
    cudalab.init()
    b = cudalab._internal.backend()
    allocator = DeviceCachingAllocator(b, 0)
    entries = []
    before = list(_observe.trace_subscribers)

    def trace(action, addr, size, stream):
        entries.append(action)

    def other(action, addr, size, stream):
        pass

    hooks.attach_trace(allocator, trace)
    try:
        assert _observe.trace_on and list(_observe.trace_subscribers) == before + [trace]
        hooks.attach_trace(allocator, other)  # replaces: the bus loses the old one
        assert list(_observe.trace_subscribers) == before + [other]
        hooks.attach_trace(allocator, trace)
        ptr = allocator.malloc(512)
        allocator.free(ptr)
    finally:
        hooks.detach_trace(allocator)
    assert list(_observe.trace_subscribers) == before
    assert _observe.trace_on is bool(before)
    assert "alloc" in entries and "free_requested" in entries
    hooks.detach_trace(allocator)  # (no hook: nothing to undo)
    allocator.empty_cache()


def test_an_allocator_dropped_while_traced_leaves_the_bus():
    cudalab.init()
    allocator = DeviceCachingAllocator(cudalab._internal.backend(), 0)
    before = list(_observe.trace_subscribers)

    def trace(action, addr, size, stream):
        pass

    hooks.attach_trace(allocator, trace)
    assert trace in _observe.trace_subscribers and _observe.trace_on
    del allocator
    gc.collect()
    assert trace not in _observe.trace_subscribers
    assert list(_observe.trace_subscribers) == before
    assert _observe.trace_on is bool(before)


def test_the_sanitizer_is_a_memory_access_observer():
    cudalab.init()
    assert not _observe.access_on and _observe.access_tracker is None
    session = sanitizer.enable("collect")
    try:
        assert _observe.access_on and _sanitizer_hook.on
        assert _sanitizer_hook.tracker is _observe.access_tracker
        assert len(_observe.access_subscribers) == 1
        sanitizer.enable("collect")  # enabling again replaces the tracker, never adds one
        assert len(_observe.access_subscribers) == 1
    finally:
        sanitizer.disable()
    assert session is not None
    assert not _observe.access_on and _sanitizer_hook.tracker is None
    with pytest.raises(AttributeError):
        _sanitizer_hook.on = True  # a view: the bus is changed by subscribing


def test_several_memory_access_observers_each_hear_every_call():
    class Counter:
        def __init__(self):
            self.calls = []

        def __getattr__(self, hook):
            return lambda *args, **kwargs: self.calls.append(hook)

    first, second = Counter(), Counter()
    _observe.subscribe_access(first)
    _observe.subscribe_access(second)
    try:
        assert _observe.access_tracker is not first  # a fan-out
        _observe.access_tracker.device_synchronize(0)
        _observe.unsubscribe_access(first)
        assert _observe.access_tracker is second
        _observe.access_tracker.freed(16)
    finally:
        _observe.unsubscribe_access(first)
        _observe.unsubscribe_access(second)
    assert first.calls == ["device_synchronize"]
    assert second.calls == ["device_synchronize", "freed"]
    assert _observe.access_tracker is None


def test_an_access_observer_that_raises_reaches_the_operation():
    class Raising:
        def __getattr__(self, hook):
            def fail(*args, **kwargs):
                raise LookupError(hook)

            return fail

    cudalab.init()
    raising = Raising()
    _observe.subscribe_access(raising)
    try:
        with pytest.raises(LookupError, match="device_synchronize"):
            cudalab.synchronize()
    finally:
        _observe.unsubscribe_access(raising)


def test_sync_debug_mode_is_a_synchronization_observer():
    cudalab.init()
    assert not _observe.sync_on
    seen = []
    _observe.subscribe_sync(seen.append)
    try:
        cudalab.synchronize()
        cudalab.current_stream().synchronize()
    finally:
        _observe.unsubscribe_sync(seen.append)
    assert seen == ["cudalab.synchronize()", "Stream.synchronize()"]
    cudalab.set_sync_debug_mode("warn")
    try:
        assert _observe.sync_on and len(_observe.sync_subscribers) == 1
        cudalab.set_sync_debug_mode("error")  # (one subscription, whatever the mode)
        assert len(_observe.sync_subscribers) == 1
        with pytest.raises(RuntimeError, match="Stream.synchronize"):
            cudalab.current_stream().synchronize()  # the observer's error stops it
        cudalab.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cudalab.synchronize()
        assert [Path(w.filename).name for w in caught] == [Path(__file__).name]
    finally:
        cudalab.set_sync_debug_mode("default")
    assert not _observe.sync_on and not _observe.sync_subscribers


# ----------------------------------------------------------------------------------- Ctrl-C
class _CodeFrame:
    """A stand-in frame of ``function`` (its code, no caller): what ``deferring`` reads."""

    def __init__(self, function):
        self.f_code = function.__code__
        self.f_back = None


@pytest.mark.parametrize("function", _observe.MUTATORS, ids=lambda f: f.__qualname__)
def test_every_change_defers_ctrl_c(function):
    assert _interrupts.deferring(_CodeFrame(function))


def test_every_method_of_the_lists_is_a_guarded_change():
    methods = {f for name, f in vars(_observe.Subscribers).items()
               if callable(f) and name != "__init__"}
    assert methods and methods <= set(_observe.MUTATORS)


def test_ctrl_c_in_the_middle_of_a_change_leaves_list_and_flag_agreeing():
    """A real SIGINT, raised while ``launch_observers.remove`` runs (from the ``__eq__`` the
    list calls), is deferred until the list and its flag are both changed."""
    if not _interrupts.install():
        pytest.skip("cudalab's SIGINT wrapper cannot be installed here")

    def observer(*args):
        pass

    class Key:
        def __eq__(self, other):
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the list is being changed
            return other is observer

        __hash__ = object.__hash__

    _internal.launch_observers.append(observer)
    try:
        with pytest.raises(KeyboardInterrupt):
            _internal.launch_observers.remove(Key())
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # the owed interrupt is raised here
                pass
        assert observer not in _internal.launch_observers
        assert _observe.launch_on is bool(_internal.launch_observers)
    finally:
        _observe.unsubscribe_launch(observer)
