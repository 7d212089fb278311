"""The process's allocators: one per device, created on first use by the factory that the
settings choose the class in (:func:`create_allocator`; the allocator modules never import
one another's subclasses).

Fields (guarded by ``_registry_lock`` for writes; read without it on the hot getters):

* :data:`allocators` ``[device]``: the device's allocator or None -- public for the readers
  above the allocator (the ``cudalab.memory`` getters, the tooling, ``cudalab._array_memory``);
* :data:`active`: the allocators that exist, in creation order (for pointer lookups and the
  history recorder) -- public for the same readers;
* ``_custom``: the :class:`~cudalab.allocator.pluggable.PluggableAllocator` installed by
  ``change_current_allocator``, or None (read it with :func:`custom_factory`); it can only
  change while :data:`active` is empty;
* ``_on_create``: create hooks (see :func:`add_create_hook`): the observer bus's
  allocator-created list (:data:`cudalab._observe.allocator_created_subscribers`).

Both lists are module-level objects that are never rebound (only appended to, assigned by
index, or cleared by ``_reset_for_tests``), so a reader may bind them once at import
(``from cudalab.allocator.registry import allocators``) and index them without the lock.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from cudalab import _interrupts, _observe
from cudalab import streams as _streams
from cudalab.allocator.async_allocator import AsyncPoolAllocator
from cudalab.allocator.base import Allocator
from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import (
    NATIVE_ONLY_KEYS,
    AllocatorConfig,
    config_from_env,
    merge_settings,
    no_caching_from_env,
    parse_alloc_conf,
)
from cudalab.allocator.expandable import ExpandableCachingAllocator
from cudalab.allocator.uncached import UncachedAllocator

if TYPE_CHECKING:
    from cudalab._driver.base import Backend

__all__ = [
    "DeviceAllocatorFactory",
    "add_create_hook",
    "allocator_config",
    "count_sync_before_creation",
    "active",
    "allocators",
    "create_allocator",
    "custom_factory",
    "existing_allocator",
    "find_owner",
    "get_allocator",
    "native_allocator",
    "remove_create_hook",
    "set_custom_allocator",
    "set_allocator_settings",
    "syncs_before_creation",
]


def native_allocator(backend: Backend, device: int, config: AllocatorConfig | None = None,
                     stream_resolver: Callable[[], int] | None = None
                     ) -> DeviceCachingAllocator:
    """The native caching allocator the settings ask for (backend "native").

    Parameters
    ----------
    backend
        The driver seam.
    device
        The device ordinal.
    config
        The settings (default: parsed from the environment).
    stream_resolver
        Maps ``stream=None`` to a stream key (default: the current stream of ``device``).

    Returns
    -------
    DeviceCachingAllocator
        An :class:`~cudalab.allocator.expandable.ExpandableCachingAllocator` with
        ``expandable_segments:True`` (the setting is fixed for an allocator's lifetime),
        else a plain :class:`~cudalab.allocator.caching.DeviceCachingAllocator`.

    Raises
    ------
    ValueError
        The settings ask for another backend.
    """
    if config is None:
        config = config_from_env()
    cls = ExpandableCachingAllocator if config.expandable_segments else DeviceCachingAllocator
    return cls(backend, device, config, stream_resolver)


def create_allocator(backend: Backend, device: int, config: AllocatorConfig | None = None,
                     no_caching: bool | None = None,
                     stream_resolver: Callable[[], int] | None = None) -> Allocator:
    """The allocator the settings ask for.

    In order: the allocator installed by ``cudalab.memory.change_current_allocator`` (a
    :class:`~cudalab.allocator.pluggable.PluggableDeviceAllocator`); ``backend:cudaMallocAsync``
    (:class:`~cudalab.allocator.async_allocator.AsyncPoolAllocator`, which like torch ignores
    ``CUDALAB_NO_MEMORY_CACHING``); no caching (:class:`~cudalab.allocator.uncached.
    UncachedAllocator`); else the native allocator (:func:`native_allocator`).

    Parameters
    ----------
    backend
        The driver seam.
    device
        The device ordinal.
    config
        The settings (default: parsed from the environment).
    no_caching
        Whether caching is off (default: ``CUDALAB_NO_MEMORY_CACHING``).
    stream_resolver
        Maps ``stream=None`` to a stream key (default: the current stream of ``device``).

    Raises
    ------
    ValueError, NotImplementedError
        Settings the chosen allocator cannot honour.
    """
    if config is None:
        config = config_from_env()
    custom = _custom
    if custom is not None:
        return custom.device_allocator(backend, device, config, stream_resolver)
    if config.backend == "cudaMallocAsync":
        return AsyncPoolAllocator(backend, device, config, stream_resolver)
    if no_caching is None:
        no_caching = no_caching_from_env()
    if no_caching:
        return UncachedAllocator(backend, device, config, stream_resolver)
    return native_allocator(backend, device, config, stream_resolver)


class DeviceAllocatorFactory(Protocol):
    """What the registry needs of an allocator installed for every device (a
    :class:`~cudalab.allocator.pluggable.PluggableAllocator`)."""

    def device_allocator(self, backend: Backend, device: int,
                         config: AllocatorConfig | None = None,
                         stream_resolver: Callable[[], int] | None = None) -> Allocator: ...


#: Guards the writes below (get_allocator reads ``allocators`` without it).
_registry_lock = threading.Lock()
#: ``allocators[device]``: the device's allocator, None where none was created yet.
#: Invariants, so that hot readers may use it without the lock: the list object is never
#: rebound (bind it once at import); it only grows (``extend`` with None) or has a None slot
#: assigned, under ``_registry_lock``; a slot, once set, is never replaced (until
#: ``_reset_for_tests``, which clears the list in place). Read-only for everyone but this module.
allocators: list[Allocator | None] = []
#: ``num_sync_all_streams`` that ``empty_cache()`` counted on each device before the device's
#: allocator existed: torch creates an allocator per device when CUDA initialises, so its
#: counter moves on every device; ours are created on first use, and one created later starts
#: from this count (:func:`get_allocator`), so the two stay equal to torch's. Indexed by device,
#: grown on demand, written under ``_registry_lock``.
syncs_before_creation: list[int] = []
#: The allocators that exist, in creation order (one per device used, so few): for pointer
#: lookups, ``empty_cache`` and the tooling. Same invariants as :data:`allocators`: never
#: rebound, only appended to under ``_registry_lock`` (in the same step that fills the
#: device's :data:`allocators` slot, so the two cannot drift). Iterate a ``list()`` copy
#: where the loop may allocate.
active: list[Allocator] = []
#: The settings, parsed once (allocator_config); None until then.
_config: AllocatorConfig | None = None
#: The allocator of change_current_allocator (None: the settings decide); changes only
#: while ``active`` is empty. Read it with custom_factory().
_custom: DeviceAllocatorFactory | None = None
#: Called with each allocator get_allocator() creates, before it is published (the history
#: recorder attaches itself here, see cudalab.allocator.hooks); a hook must not raise. The
#: bus's allocator-created list (never rebound; its flag follows it).
_on_create: _observe.Subscribers[_observe.AllocatorCreatedObserver] = (
    _observe.allocator_created_subscribers)


def add_create_hook(hook: Callable[[Allocator], None]) -> None:
    """Call ``hook(allocator)`` with every allocator :func:`get_allocator` creates from now
    on, before it is published (once, however often it is added).

    Parameters
    ----------
    hook
        Called with the registry's lock held: it must not raise and must not call back
        into the registry (attaching a trace hook is fine, see
        :func:`cudalab.allocator.hooks.attach_trace`).

    Notes
    -----
    Takes no lock (a list append), so a caller may hold its own lock, as the history
    recorder does.
    """
    if hook not in _on_create:
        _observe.subscribe_allocator_created(hook)


def remove_create_hook(hook: Callable[[Allocator], None]) -> None:
    """Undo :func:`add_create_hook` (nothing if ``hook`` was not added)."""
    _observe.unsubscribe_allocator_created(hook)


def _forget_closed_stream(stream: _streams.Stream) -> None:
    """A Stream was closed: no allocator may keep a fast path to it (see Stream.close)."""
    for a in list(active):
        a.forget_stream(stream)


_streams.close_listeners.append(_forget_closed_stream)


def custom_factory() -> DeviceAllocatorFactory | None:
    """The allocator installed by :func:`set_custom_allocator` for every device, or None
    (the settings decide)."""
    return _custom


def set_custom_allocator(spec: DeviceAllocatorFactory | None) -> None:
    """Install ``spec`` (a PluggableAllocator, or None) as the allocator of every device.

    Raises
    ------
    RuntimeError
        An allocator already exists ("Can't swap an already initialized allocator").
    """
    global _custom
    with _registry_lock:
        if active:
            raise RuntimeError("Can't swap an already initialized allocator")
        _custom = spec


def allocator_config() -> AllocatorConfig:
    """The process-wide allocator settings.

    Returns
    -------
    AllocatorConfig
        Parsed from the environment (``CUDALAB_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF``)
        on the first call, the same object afterwards.

    Raises
    ------
    ValueError
        The settings are malformed (nothing is cached then: the next call parses again).
    """
    global _config
    cfg = _config
    if cfg is None:
        cfg = _config = config_from_env()
    return cfg


def set_allocator_settings(settings: str) -> AllocatorConfig:
    """Change the allocator settings at run time (``cudalab.memory._set_allocator_settings``).

    Parameters
    ----------
    settings : str
        Settings in the ``CUDALAB_ALLOC_CONF`` grammar; the keys it names change, and
        those of ``config.RESET_ON_EACH_PARSE`` it leaves out go back to their defaults
        (as torch's ``parseArgs``).

    Returns
    -------
    AllocatorConfig
        The settings now in force (existing allocators were reconfigured with them).

    Raises
    ------
    TypeError
        When ``settings`` is not a str.
    ValueError
        When it does not parse (nothing changes).
    RuntimeError
        When an allocator exists and the string changes ``backend`` (torch: "Allocator
        backend parsed at runtime != allocator backend parsed at load time") or
        ``expandable_segments`` (fixed for an allocator's lifetime in cudalab; torch applies
        it to new segments); nothing changes.
    """
    global _config
    if not isinstance(settings, str):
        raise TypeError(f"settings must be a str in the CUDALAB_ALLOC_CONF grammar, got "
                        f"{type(settings).__name__} {settings!r}")
    update = parse_alloc_conf(settings, source="_set_allocator_settings")
    with _registry_lock:
        current = _config if _config is not None else config_from_env()
        merged = merge_settings(current, update)
        if active:
            if merged.backend != current.backend:
                raise RuntimeError(
                    f"Allocator backend parsed at runtime != allocator backend parsed at load "
                    f"time ({merged.backend} != {current.backend}): the backend is chosen "
                    "when the first allocator is created")
            if merged.expandable_segments != current.expandable_segments:
                raise RuntimeError(
                    f"expandable_segments:{merged.expandable_segments} cannot be applied at "
                    f"run time: cudalab fixes it when a device's allocator is created (it is "
                    f"{current.expandable_segments}); set it in CUDALAB_ALLOC_CONF or "
                    "before the first allocation")
        if merged.backend == "cudaMallocAsync" and "backend" not in update.keys:
            ignored = [k for k in update.keys if k in NATIVE_ONLY_KEYS]
            if ignored:
                warnings.warn(f"_set_allocator_settings: backend:cudaMallocAsync ignores "
                              f"{', '.join(ignored)}", stacklevel=3)
        _config = merged
        targets = list(active)
    for a in targets:
        a.reconfigure(merged)
    return merged


def get_allocator(device: int) -> Allocator:
    """The allocator of ``device``, created on first use (by :func:`create_allocator`, then
    shown to the create hooks, then published).

    Parameters
    ----------
    device
        A valid device index (not checked here: the public API checks it).

    Returns
    -------
    Allocator
        The same object for the process's lifetime.

    Raises
    ------
    ValueError, NotImplementedError
        The settings cannot be honoured (nothing is published then).
    """
    allocs = allocators
    if device < len(allocs):
        a = allocs[device]
        if a is not None:
            return a
    with _registry_lock:
        if device >= len(allocators):
            allocators.extend([None] * (device + 1 - len(allocators)))
        a = allocators[device]
        if a is None:
            from cudalab import devices

            a = create_allocator(devices.backend(), device, allocator_config())
            # (torch counts them on its native allocators only: the async and pluggable
            # ones keep no such statistic)
            if device < len(syncs_before_creation) and isinstance(
                    a, (DeviceCachingAllocator, UncachedAllocator)):
                a.stats.num_sync_all_streams += syncs_before_creation[device]
            for hook in _on_create:
                hook(a)
            allocators[device] = a
            active.append(a)
            _interrupts.install()  # Ctrl-C deferred across allocator calls (main thread)
        return a


def count_sync_before_creation(device_count: int) -> None:
    """Count one ``empty_cache()`` synchronisation on every device without an allocator yet
    (nothing when the allocators to come are not native ones: torch's async and pluggable
    allocators keep no such statistic).

    Parameters
    ----------
    device_count
        The number of devices (:data:`syncs_before_creation` grows to it).
    """
    if _custom is not None or allocator_config().backend != "native":
        return
    with _registry_lock:
        if len(syncs_before_creation) < device_count:
            syncs_before_creation.extend([0] * (device_count - len(syncs_before_creation)))
        for device in range(device_count):
            if device >= len(allocators) or allocators[device] is None:
                syncs_before_creation[device] += 1


def existing_allocator(device: int) -> Allocator | None:
    """The allocator of ``device`` if one was created, else None (never creates one).

    Parameters
    ----------
    device
        A device index (>= 0).
    """
    allocs = allocators
    return allocs[device] if device < len(allocs) else None


def find_owner(ptr: int) -> Allocator | None:
    """The allocator holding live pointer ``ptr``, None if no allocator of the registry does.

    Parameters
    ----------
    ptr
        A device pointer (int).
    """
    for a in active:
        if a.owns(ptr):
            return a
    return None


def _reset_for_tests() -> None:
    """Forget every allocator and the parsed settings (tests only)."""
    global _config
    with _registry_lock:
        allocators.clear()
        active.clear()
        syncs_before_creation.clear()
        _config = None
