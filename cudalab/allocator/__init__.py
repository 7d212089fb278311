"""The allocator runtime: torch's caching allocator and the allocators beside it.

This package holds the runtime half of cudalab's memory story; :mod:`cudalab.memory` is the
``torch.cuda.memory`` API over it, and :mod:`cudalab.memory_tools` the tooling that observes
it (history, snapshots, exports, replay). The runtime never imports either of them: the
tooling attaches through the hook protocol of :mod:`cudalab.allocator.hooks`.

==========================  ================================================================
module                      concept
==========================  ================================================================
``policy``                  size rounding and the size rules (512 B, small/large, oversize)
``blocks``                  ``Block``, the block-state constants, free lists and pools
``base``                    the ``Allocator`` interface every allocator implements
``cache_state``             the caching allocator's fields and their invariants
``caching``                 ``DeviceCachingAllocator``: the cache-hit path, in one place
                            (and ``compiled_pair``: the torch-style pair's C twins, ``_pair.c``)
``memo``                    the pair memo (a malloc+free pair deferred, see architecture.md)
``slow_path``               the cache-miss ladder: segment allocation, release, OOM
``inspection``              segments, invariants and the largest free block, for readers
``expandable`` (+ ``expandable_segment``)  ``expandable_segments:True`` over the driver's VMM
``async_allocator``         ``backend:cudaMallocAsync`` over the driver's memory pools
``pools``                   private pools (CUDA graphs, MemPool): ids, routing, lifetime
``private_pool``            a private pool's record, its id and routing filter (below ``pools``)
``mem_pool``                ``MemPool``'s runtime half and ``use_mem_pool``
``pluggable``               ``PluggableAllocator`` (torch's CUDAPluggableAllocator)
``uncached``                ``UncachedAllocator`` (every malloc is a driver call)
``caching_switch``          ``caching_allocator_enable``: caching turned off at run time
``oom_observers``           the out-of-memory observers (torch's OOM observer hook; a bus view)
``registry``                one allocator per device: creation (the class is chosen here)
``config``                  ``CUDALAB_ALLOC_CONF`` with torch's grammar
``stats``                   the counters behind ``memory_stats()`` and ``memory_summary()``
``scope``                   peak scopes (a region's peak without resetting the global one)
``token_lock``              the allocator's lock, a one-element list
``events``                  the pooled events that guard ``record_stream`` reuse
``pinned``                  the caching pinned-host pool
``host_stats``              the pinned pool's statistics in torch's layout
``hooks``                   the protocol a listener (history) attaches through
``replay_target``           ``ReplayTarget``: the allocator's interface for trace replays
==========================  ================================================================

Ctrl-C: every function of this package runs with interrupts deferred (see
:mod:`cudalab._interrupts`): a KeyboardInterrupt is raised in the caller once the allocator
call returns, never between an acquire and its release or inside a paired update.
"""

import os as _os

from cudalab import _interrupts

_interrupts.guard_files([_os.path.dirname(_os.path.abspath(__file__)) + _os.sep])
