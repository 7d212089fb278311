"""Small fakes of ``torch`` (``torch.cuda``'s memory API) and ``cupy`` (its default pools),
to put into ``sys.modules`` on the simulator: the memory sources read them as they read the
real libraries (``cudalab.memory_sources``).

The fake allocators keep torch's counters by their rules (a current figure, its peak since
the last reset, the totals; reserved in 2 MiB segments), so a test compares a source's figures
with the fake's own ``memory_stats()`` and never with hard-coded numbers.

::

    torch = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    ptr = torch.cuda.alloc(3 << 20)

or, in a test module, the fixtures ``torch`` and ``cupy`` (each a fake put into
``sys.modules`` for the test): ``from tests.helpers.fake_allocators import fake_torch,
fake_cupy`` (imported under these names, they are used as ``torch`` and ``cupy``).
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import types
from typing import Any

import pytest

__all__ = ["FakeTorch", "FakeCupy", "FakeMemoryHook", "FakeOutOfMemoryError", "SEGMENT",
           "fake_torch", "fake_cupy", "get_memory_hooks"]

#: The fake torch's segment size: reserved grows by whole segments.
SEGMENT = 2 << 20
_COUNTERS = ("allocated_bytes", "reserved_bytes", "requested_bytes", "allocation", "segment",
             "active_bytes", "active")


class _Device:
    def __init__(self) -> None:
        self.current = dict.fromkeys(_COUNTERS, 0)
        self.peak = dict.fromkeys(_COUNTERS, 0)
        self.allocated = dict.fromkeys(_COUNTERS, 0)
        self.freed = dict.fromkeys(_COUNTERS, 0)
        self.blocks: dict[int, tuple[int, int]] = {}  # address -> (size, requested)
        self.num_ooms = 0
        self.num_alloc_retries = 0

    def add(self, key: str, amount: int) -> None:
        self.current[key] += amount
        if amount > 0:
            self.allocated[key] += amount
            self.peak[key] = max(self.peak[key], self.current[key])
        else:
            self.freed[key] -= amount


class FakeTorchCuda(types.ModuleType):
    """``torch.cuda``: is_available, is_initialized, memory_stats (flat and nested),
    memory_allocated/reserved, max_memory_allocated/reserved, reset_peak_memory_stats,
    empty_cache, current_stream, memory._snapshot / _record_memory_history; ``alloc`` and
    ``free`` drive the fake allocator."""

    def __init__(self, available: bool = True, initialized: bool = True, devices: int = 1):
        super().__init__("torch.cuda")
        self.available = available
        self.initialized = initialized and available
        self.devices = [_Device() for _ in range(devices)]
        self._addresses = itertools.count(0x7F0000000000, SEGMENT)
        self.calls: list[str] = []  # the names of the mutating calls made (resets, ...)
        self.memory = types.ModuleType("torch.cuda.memory")
        self.memory._snapshot = self._snapshot
        self.memory._record_memory_history = self._record_memory_history
        self.history: dict[str, Any] | None = None  # the recording's settings, None: off
        self.traces: list[list[dict]] = [[] for _ in range(devices)]
        self.stream = types.SimpleNamespace(cuda_stream=0)

    # ------------------------------------------------------------------ the allocator
    def alloc(self, nbytes: int, device: int = 0) -> int:
        d = self.devices[device]
        size = -(-nbytes // 512) * 512
        held = d.current["reserved_bytes"] - d.current["allocated_bytes"]
        address = next(self._addresses)
        if size > held:
            grow = -(-(size - held) // SEGMENT) * SEGMENT
            d.add("reserved_bytes", grow)
            d.add("segment", 1)
            self._record(device, "segment_alloc", address, grow)
        self._record(device, "alloc", address, size)
        d.blocks[address] = (size, nbytes)
        for key, amount in (("allocated_bytes", size), ("requested_bytes", nbytes),
                            ("allocation", 1), ("active_bytes", size), ("active", 1)):
            d.add(key, amount)
        return address

    def free(self, address: int, device: int = 0) -> None:
        d = self.devices[device]
        size, nbytes = d.blocks.pop(address)
        self._record(device, "free_requested", address, size)
        self._record(device, "free_completed", address, size)
        for key, amount in (("allocated_bytes", size), ("requested_bytes", nbytes),
                            ("allocation", 1), ("active_bytes", size), ("active", 1)):
            d.add(key, -amount)

    def _record(self, device: int, action: str, address: int, size: int) -> None:
        """A trace entry in torch's schema, while recording (the ring keeps max_entries)."""
        if self.history is None:
            return
        import time

        trace = self.traces[device]
        trace.append({"action": action, "addr": address, "size": size, "stream": 0,
                      "time_us": int(time.time() * 1e6), "compile_context": "N/A",
                      "user_metadata": "",
                      "frames": [{"name": "train_step", "filename": "train.py", "line": 7}]})
        del trace[:-self.history["max_entries"]]

    # ------------------------------------------------------------------ torch.cuda's API
    def is_available(self) -> bool:
        return self.available

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return len(self.devices)

    def _index(self, device: Any) -> int:
        return 0 if device is None else int(getattr(device, "index", device))

    def memory_stats_as_nested_dict(self, device: Any = None) -> dict:
        return self.nested_stats(device)

    def nested_stats(self, device: Any = None) -> dict:
        if not self.initialized:
            return {}
        d = self.devices[self._index(device)]
        out: dict[str, Any] = {}
        for key in _COUNTERS:
            figures = {"current": d.current[key], "peak": d.peak[key],
                       "allocated": d.allocated[key], "freed": d.freed[key]}
            out[key] = {pool: dict(figures) for pool in ("all", "large_pool", "small_pool")}
        out["num_ooms"] = d.num_ooms
        out["num_alloc_retries"] = d.num_alloc_retries
        return out

    def memory_stats(self, device: Any = None) -> dict:
        flat: dict[str, Any] = {}

        def walk(prefix: str, node: Any) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                flat[prefix] = node

        walk("", self.nested_stats(device))
        return dict(sorted(flat.items()))

    def memory_allocated(self, device: Any = None) -> int:
        return self.devices[self._index(device)].current["allocated_bytes"]

    def memory_reserved(self, device: Any = None) -> int:
        return self.devices[self._index(device)].current["reserved_bytes"]

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.devices[self._index(device)].peak["allocated_bytes"]

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.devices[self._index(device)].peak["reserved_bytes"]

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.calls.append("reset_peak_memory_stats")
        d = self.devices[self._index(device)]
        d.peak = dict(d.current)

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        for d in self.devices:
            keep = -(-d.current["allocated_bytes"] // SEGMENT) * SEGMENT
            if d.current["reserved_bytes"] > keep:
                d.add("reserved_bytes", keep - d.current["reserved_bytes"])

    def current_stream(self, device: Any = None) -> Any:
        return self.stream

    def current_device(self) -> int:
        return 0

    class Event:
        """``torch.cuda.Event``: host-clock times (the fake has no GPU work)."""

        def __init__(self, enable_timing: bool = False):
            self.time: float | None = None

        def record(self, stream: Any = None) -> None:
            import time

            self.time = time.perf_counter()

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return self.time is not None

        def elapsed_time(self, end: Any) -> float:
            return (end.time - self.time) * 1e3

    def get_allocator_backend(self) -> str:
        return "native"

    def _snapshot(self, device: Any = None) -> dict:
        segments = []
        for index, d in enumerate(self.devices):
            for address, (size, requested) in d.blocks.items():
                segments.append({
                    "device": index, "address": address, "total_size": SEGMENT,
                    "allocated_size": size, "active_size": size, "requested_size": requested,
                    "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                    "is_expandable": False, "frames": [],
                    "blocks": [{"address": address, "size": size, "requested_size": requested,
                                "state": "active_allocated", "frames": []}]})
        return {"segments": segments, "device_traces": [list(t) for t in self.traces],
                "allocator_settings": {}, "external_annotations": []}

    def _record_memory_history(self, enabled: Any = "all", context: Any = "all",
                               stacks: str = "all", max_entries: int = 1 << 62,
                               **kwargs: Any) -> None:
        self.calls.append("_record_memory_history")
        if enabled is None:  # as torch: turning history off clears it
            self.traces = [[] for _ in self.devices]
        self.history = None if enabled is None else {
            "enabled": enabled, "context": context, "stacks": stacks,
            "max_entries": max_entries, **kwargs}


class FakeTorch(types.ModuleType):
    """``torch`` with a :class:`FakeTorchCuda` as ``torch.cuda`` and
    ``torch._C._cuda_isHistoryEnabled``."""

    def __init__(self, **cuda: Any):
        super().__init__("torch")
        self.cuda = FakeTorchCuda(**cuda)
        self.__version__ = "2.11.0+fake"
        self._C = types.SimpleNamespace(
            _cuda_isHistoryEnabled=lambda: self.cuda.history is not None)


class FakeMemoryHook:
    """``cupy.cuda.MemoryHook`` as CuPy defines it (cupy/cuda/memory_hook.pyx): entered as a
    context manager into the calling thread's ordered dict of hooks by ``name`` (a
    KeyError when that name is entered already); the six callbacks do nothing."""

    name = "MemoryHook"

    def __enter__(self) -> Any:
        hooks = get_memory_hooks()
        if self.name in hooks:
            raise KeyError(f"memory hook {self.name} already exists")
        hooks[self.name] = self
        return self

    def __exit__(self, *_: Any) -> None:
        del get_memory_hooks()[self.name]

    def alloc_preprocess(self, **kwargs: Any) -> None:
        pass

    def alloc_postprocess(self, **kwargs: Any) -> None:
        pass

    def malloc_preprocess(self, **kwargs: Any) -> None:
        pass

    def malloc_postprocess(self, **kwargs: Any) -> None:
        pass

    def free_preprocess(self, **kwargs: Any) -> None:
        pass

    def free_postprocess(self, **kwargs: Any) -> None:
        pass


_hook_threads = threading.local()


def get_memory_hooks() -> collections.OrderedDict:
    """The calling thread's memory hooks (CuPy's ``memory_hook.get_memory_hooks``)."""
    hooks = getattr(_hook_threads, "memory_hooks", None)
    if hooks is None:
        hooks = _hook_threads.memory_hooks = collections.OrderedDict()
    return hooks


class FakeOutOfMemoryError(MemoryError):
    """``cupy.cuda.memory.OutOfMemoryError``."""


class _FakePool:
    """CuPy's default ``MemoryPool``, one ``SingleDeviceMemoryPool`` per device, as CuPy's
    memory.pyx runs it: sizes rounded to 512 bytes; a new segment (``cudaMalloc``) of
    exactly the rounded size when no free chunk fits; best fit among the free chunks of the
    current stream's arena, split, the rest kept free; a freed chunk merged with its free
    neighbours; ``free_all_blocks`` releases the free chunks that fill a whole segment (and
    calls no hook); a failed ``cudaMalloc`` (past ``limit``) releases them and retries once.
    The hooks are called with CuPy's keyword arguments: ``malloc_pre/postprocess``
    around a malloc, ``alloc_pre/postprocess`` around a new segment, ``free_pre/
    postprocess`` around a free."""

    def __init__(self) -> None:
        self.device = 0  # set by the fake cupy before each call (its current device)
        self.stream = 0  # the current stream's pointer (the arena)
        self.limit = 1 << 62  # the most bytes the pool may hold (set_limit's size)
        self.freed_all = 0
        self.used: dict[int, int] = {}
        self.total: dict[int, int] = {}
        self._addresses = itertools.count(0x7E0000000000, 1 << 32)  # segments never touch
        #: device -> segment address -> (stream, [[offset, size, live], ...] by offset)
        self.segments: dict[int, dict[int, tuple[int, list[list[Any]]]]] = {}
        self.live: dict[int, tuple[int, int, int]] = {}  # pointer -> (device, segment, size)

    def used_bytes(self) -> int:
        return self.used.get(self.device, 0)

    def total_bytes(self) -> int:
        return self.total.get(self.device, 0)

    def free_bytes(self) -> int:
        return self.total_bytes() - self.used_bytes()

    def n_free_blocks(self) -> int:
        return sum(1 for _, chunks in self.segments.get(self.device, {}).values()
                   for c in chunks if not c[2])

    def set_limit(self, size: int = 0) -> None:
        self.limit = size or 1 << 62

    def free_all_blocks(self, stream: Any = None) -> None:
        self.freed_all += 1
        self._release(self.device)

    def _release(self, device: int) -> None:
        segs = self.segments.get(device, {})
        for addr in [a for a, (_, ch) in segs.items() if len(ch) == 1 and not ch[0][2]]:
            self.total[device] -= segs.pop(addr)[1][0][1]

    def _hooks(self) -> list[Any]:
        return list(get_memory_hooks().values())

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` on the current device; the block's pointer (0 for 0 bytes).
        Named as the pool's own method (``get_allocator`` compares it)."""
        device = self.device
        size = -(-nbytes // 512) * 512
        hooks = self._hooks()
        for h in hooks:
            h.malloc_preprocess(device_id=device, size=nbytes, mem_size=size)
        ptr = 0
        try:
            ptr = self._malloc(device, size, hooks)
        finally:
            for h in hooks:
                h.malloc_postprocess(device_id=device, size=nbytes, mem_size=size,
                                     mem_ptr=ptr, pmem_id=id(self) + ptr if ptr else 0)
        return ptr

    def _malloc(self, device: int, size: int, hooks: list[Any]) -> int:
        if size == 0:
            return 0
        segs = self.segments.setdefault(device, {})
        best = None
        for addr, (stream, chunks) in segs.items():
            if stream != self.stream:
                continue
            for c in chunks:
                if not c[2] and c[1] >= size and (best is None or c[1] < best[1][1]):
                    best = (addr, c)
        if best is None:
            addr = self._segment(device, size, hooks)
            best = (addr, segs[addr][1][0])
        addr, c = best
        chunks = segs[addr][1]
        if c[1] > size:  # split: the rest stays free
            chunks.insert(chunks.index(c) + 1, [c[0] + size, c[1] - size, False])
            c[1] = size
        c[2] = True
        self.used[device] = self.used.get(device, 0) + size
        self.live[addr + c[0]] = (device, addr, size)
        return addr + c[0]

    def _segment(self, device: int, size: int, hooks: list[Any]) -> int:
        if self.total.get(device, 0) + size > self.limit:
            self._release(device)  # CuPy: free_all_blocks, then retry once
            if self.total.get(device, 0) + size > self.limit:
                raise FakeOutOfMemoryError(f"out of memory allocating {size} bytes")
        for h in hooks:
            h.alloc_preprocess(device_id=device, mem_size=size)
        addr = next(self._addresses)
        self.segments[device][addr] = (self.stream, [[0, size, False]])
        self.total[device] = self.total.get(device, 0) + size
        for h in hooks:
            h.alloc_postprocess(device_id=device, mem_size=size, mem_ptr=addr)
        return addr

    def free(self, ptr: int) -> None:
        """Give the block at ``ptr`` back (``PooledMemory.free``)."""
        device, addr, size = self.live.pop(ptr)
        hooks = self._hooks()
        pmem = id(self) + ptr
        for h in hooks:
            h.free_preprocess(device_id=device, mem_size=size, mem_ptr=ptr, pmem_id=pmem)
        chunks = self.segments[device][addr][1]
        i = next(i for i, c in enumerate(chunks) if c[0] == ptr - addr)
        chunks[i][2] = False
        self.used[device] -= size
        if i + 1 < len(chunks) and not chunks[i + 1][2]:  # merge with the free neighbours
            chunks[i][1] += chunks.pop(i + 1)[1]
        if i > 0 and not chunks[i - 1][2]:
            chunks[i - 1][1] += chunks.pop(i)[1]
        for h in hooks:
            h.free_postprocess(device_id=device, mem_size=size, mem_ptr=ptr, pmem_id=pmem)


class FakeCupy(types.ModuleType):
    """``cupy`` with ``cuda.is_available``, ``cuda.runtime.getDevice`` / ``memGetInfo``,
    ``cuda.Device``, ``cuda.get_allocator`` / ``set_allocator``, ``cuda.get_current_stream``,
    ``cuda.MemoryHook`` and ``cuda.memory_hook`` (CuPy's hook API, per thread),
    ``get_default_memory_pool`` and ``get_default_pinned_memory_pool``; ``alloc`` / ``free``
    drive the pool as CuPy's arrays do (``alloc`` returns the block's pointer)."""

    def __init__(self, available: bool = True):
        super().__init__("cupy")
        self.pool = _FakePool()
        self.pinned = types.SimpleNamespace(n_free_blocks=lambda: 2, freed=[],
                                            free_all_blocks=lambda: None)
        self._current = 0
        self._allocator: Any = self.pool.malloc
        fake = self

        class Device:
            def __init__(self, index: int):
                self.index = index

            def __enter__(self) -> Any:
                self.previous = fake._current
                fake._current = fake.pool.device = self.index
                return self

            def __exit__(self, *exc: Any) -> None:
                fake._current = fake.pool.device = self.previous

        self.cuda = types.SimpleNamespace(
            is_available=lambda: available,
            runtime=types.SimpleNamespace(getDevice=lambda: fake._current,
                                          memGetInfo=lambda: (1 << 30, 80 << 30)),
            Device=Device,
            get_allocator=lambda: fake._allocator,
            set_allocator=self._set_allocator,
            get_current_stream=lambda: types.SimpleNamespace(ptr=fake.pool.stream),
            MemoryHook=FakeMemoryHook,
            memory_hook=types.SimpleNamespace(MemoryHook=FakeMemoryHook,
                                              get_memory_hooks=get_memory_hooks),
            memory=types.SimpleNamespace(OutOfMemoryError=FakeOutOfMemoryError),
        )

    def _set_allocator(self, allocator: Any = None) -> None:
        self._allocator = self.pool.malloc if allocator is None else allocator

    def get_default_memory_pool(self) -> _FakePool:
        return self.pool

    def get_default_pinned_memory_pool(self) -> Any:
        return self.pinned

    def alloc(self, nbytes: int, device: int = 0) -> int:
        """An array's allocation of ``nbytes`` on ``device``: its pointer."""
        with self.cuda.Device(device):
            return self.pool.malloc(nbytes)

    def free(self, ptr: int) -> None:
        """The array at ``ptr`` goes away: its block goes back to the pool."""
        self.pool.free(ptr)


@pytest.fixture(name="torch")
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> FakeTorch:
    """A :class:`FakeTorch` in ``sys.modules`` for the test (restored afterwards)."""
    fake = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    return fake


@pytest.fixture(name="cupy")
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> FakeCupy:
    """A :class:`FakeCupy` in ``sys.modules`` for the test (restored afterwards)."""
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return fake
