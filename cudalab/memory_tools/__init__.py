"""Tools that observe the caching allocator: history, snapshots, exports, replay and plots.

This package is the tooling half of cudalab's memory story (torch keeps the same split as
``torch.cuda.memory`` and ``torch.cuda._memory_viz``). It reads the allocator runtime in
:mod:`cudalab.allocator` through the names meant for it and the trace hook protocol
(:mod:`cudalab.allocator.hooks`); the runtime never imports this package, and this package
never imports the :mod:`cudalab.memory` facade. The public names are re-exported by
:mod:`cudalab.memory`, as torch's are by ``torch.cuda.memory``.

Modules, lowest first (each imports only those above it):

* :mod:`~cudalab.memory_tools.stacks` — stack capture (the memo's stamp, its C twin
  ``_stackstamp``);
* :mod:`~cudalab.memory_tools.history` — recording the allocators' history (the ring);
* :mod:`~cudalab.memory_tools.trace_io` — reading and writing snapshot and trace files
  (the restricted unpickler), trace arrays for replay, the history CSV reader;
* :mod:`~cudalab.memory_tools.snapshot` — taking snapshots in torch's format;
* :mod:`~cudalab.memory_tools.trace_columns` — a snapshot's history as columns;
* :mod:`~cudalab.memory_tools.export` (DataFrames), :mod:`~cudalab.memory_tools.perfetto`
  (Chrome/Perfetto JSON), :mod:`~cudalab.memory_tools.plot` (matplotlib figures),
  :mod:`~cudalab.memory_tools.usage_plots` (torch's flame-graph SVGs of a snapshot);
* :mod:`~cudalab.memory_tools.replay` (one replay on a private simulator),
  :mod:`~cudalab.memory_tools.what_if` (a ranked sweep of settings) with
  :mod:`~cudalab.memory_tools.what_if_grid` (its bounded search),
  :mod:`~cudalab.memory_tools.autotune` (the autotuner: a wide grid × device capacities)
  over :mod:`~cudalab.memory_tools.replay_workers` (replays in parallel processes),
  :mod:`~cudalab.memory_tools.progress` (their progress bar);
* :mod:`~cudalab.memory_tools.synthetic` — synthetic snapshots and a ragged-batch
  inference workload for tests and benchmarks.
"""
