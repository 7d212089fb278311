"""The process's allocators: one per device, created on first use by the factory that the
settings choose the class in (:func:`create_allocator`; the allocator modules never import
one another's subclasses).

Fields (guarded by ``_registry_lock`` for writes; read without it on the hot getters):

* ``_allocators[device]``: the device's allocator or None (never replaced once set, until
  ``_reset_for_tests``);
* ``_active``: the allocators that exist, in creation order (for pointer lookups and the
  history recorder);
* ``_custom``: the :class:`~cudalab.allocator.pluggable.PluggableAllocator` installed by
  ``change_current_allocator``, or None; it can only change while ``_active`` is empty;
* ``_on_create``: create hooks (see :func:`add_create_hook`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from cudalab.allocator.async_allocator import AsyncPoolAllocator
from cudalab.allocator.base import Allocator
from cudalab.allocator.caching import DeviceCachingAllocator
from cudalab.allocator.config import AllocatorConfig, config_from_env, no_caching_from_env
from cudalab.allocator.expandable import ExpandableCachingAllocator
from cudalab.allocator.uncached import UncachedAllocator

if TYPE_CHECKING:
    from cudalab._driver.base import Backend

__all__ = [
    "DeviceAllocatorFactory",
    "add_create_hook",
    "allocator_config",
    "create_allocator",
    "existing_allocator",
    "find_owner",
    "get_allocator",
    "native_allocator",
    "remove_create_hook",
    "set_custom_allocator",
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


#: Guards the writes below (get_allocator reads _allocators without it).
_registry_lock = threading.Lock()
#: _allocators[device]: the device's allocator, None until first use; set once.
_allocators: list[Allocator | None] = []
#: Allocators that exist, for pointer lookups (few: one per device used).
_active: list[Allocator] = []
#: The settings, parsed once (allocator_config); None until then.
_config: AllocatorConfig | None = None
#: The allocator of change_current_allocator (None: the settings decide); changes only
#: while _active is empty.
_custom: DeviceAllocatorFactory | None = None
#: Called with each allocator get_allocator() creates, before it is published (the history
#: recorder attaches itself here, see cudalab.allocator.hooks); a hook must not raise.
_on_create: list[Callable[[Allocator], None]] = []


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
        _on_create.append(hook)


def remove_create_hook(hook: Callable[[Allocator], None]) -> None:
    """Undo :func:`add_create_hook` (nothing if ``hook`` was not added)."""
    if hook in _on_create:
        _on_create.remove(hook)


def set_custom_allocator(spec: DeviceAllocatorFactory | None) -> None:
    """Install ``spec`` (a PluggableAllocator, or None) as the allocator of every device.

    Raises
    ------
    RuntimeError
        An allocator already exists ("Can't swap an already initialized allocator").
    """
    global _custom
    with _registry_lock:
        if _active:
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
    allocs = _allocators
    if device < len(allocs):
        a = allocs[device]
        if a is not None:
            return a
    with _registry_lock:
        if device >= len(_allocators):
            _allocators.extend([None] * (device + 1 - len(_allocators)))
        a = _allocators[device]
        if a is None:
            from cudalab import devices

            a = create_allocator(devices._backend(), device, allocator_config())
            for hook in _on_create:
                hook(a)
            _allocators[device] = a
            _active.append(a)
        return a


def existing_allocator(device: int) -> Allocator | None:
    """The allocator of ``device`` if one was created, else None (never creates one).

    Parameters
    ----------
    device
        A device index (>= 0).
    """
    allocs = _allocators
    return allocs[device] if device < len(allocs) else None


def find_owner(ptr: int) -> Allocator | None:
    """The allocator holding live pointer ``ptr``, None if no allocator of the registry does.

    Parameters
    ----------
    ptr
        A device pointer (int).
    """
    for a in _active:
        if a.owns(ptr):
            return a
    return None


def _reset_for_tests() -> None:
    """Forget every allocator and the parsed settings (tests only)."""
    global _config
    with _registry_lock:
        _allocators.clear()
        _active.clear()
        _config = None
