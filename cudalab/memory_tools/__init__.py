"""Tools that observe the caching allocator: history, snapshots, exports, replay and plots.

This package is the tooling half of cudalab's memory story (torch keeps the same split as
``torch.cuda.memory`` and ``torch.cuda._memory_viz``). It reads the allocator runtime in
:mod:`cudalab.memory` through the names meant for it and the history hook protocol
(:mod:`cudalab.memory.hooks`); the runtime never imports this package. The public names are
re-exported by :mod:`cudalab.memory`, as torch's are by ``torch.cuda.memory``.
"""
