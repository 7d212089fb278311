"""Random numbers on the GPU with ``torch.cuda``'s generator: the same seed gives the same bits.

Each device has a default :class:`Generator` (Philox4x32-10: a 64-bit seed and a 64-bit
offset), seeded non-deterministically when first used unless :func:`manual_seed` or
:func:`set_rng_state` said otherwise. Generation follows torch's CUDA kernels (grid, per-thread
subsequences, offset increments, curand's uint->float and Box-Muller math), so
``cudalab.manual_seed(s); cudalab.rand(n)`` equals ``torch.cuda.manual_seed(s);
torch.rand(n, device="cuda")`` bit for bit on the same GPU model (the grid depends on the
SM count and max threads per SM, as in torch). Kernels run on the current stream.

State API (torch's names and semantics):

* :func:`manual_seed`, :func:`manual_seed_all`, :func:`seed`, :func:`seed_all`,
  :func:`set_rng_state`, :func:`set_rng_state_all` never initialise CUDA: before cudalab is
  initialised they are queued and applied at the first use of a generator afterwards; with
  no GPU they are silently ignored (as in torch).
* :func:`get_rng_state` returns 16 bytes (little-endian uint64 seed, int64 offset) as a numpy
  uint8 array; :func:`set_rng_state` also takes the 8-byte seed-only form. Offsets must be
  multiples of 4. A bad state raises :class:`RandomStateError` (a ValueError and a
  RuntimeError) and changes nothing. None of these functions creates a CUDA context.

CUDA graphs: every generator's state (:attr:`Generator.graph_state`, a :class:`PhiloxState`)
implements torch's graph-safe protocol (``register_graph``, ``capture_prologue``,
``capture_epilogue``, ``replay_prologue``): kernels captured into a graph read the seed and
base offset from device memory plus an offset reserved inside the graph, and each replay
advances the generator by the whole graph's increment, so every replay draws fresh numbers.

Modules: :mod:`~cudalab.random.state` (PhiloxState, seeds, offsets, state bytes),
:mod:`~cudalab.random.generator` (Generator, default generators, the state API),
:mod:`~cudalab.random.launch` (torch's grid and offset increments, the raw launch) and
:mod:`~cudalab.random.sampling` (rand, randn, ...). This package re-exports their public names.
"""

from __future__ import annotations

from typing import Any

from cudalab.random.generator import (
    Generator,
    all_default_generators,
    fork_rng,
    get_rng_state,
    get_rng_state_all,
    initial_seed,
    manual_seed,
    manual_seed_all,
    seed,
    seed_all,
    set_rng_state,
    set_rng_state_all,
)
from cudalab.random.launch import torch_launch_plan
from cudalab.random.sampling import bernoulli_, normal, normal_, rand, randint, randn, uniform_
from cudalab.random.state import DEFAULT_SEED, PhiloxState, RandomStateError  # noqa: F401

__all__ = [
    "Generator",
    "PhiloxState",
    "RandomStateError",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
    "initial_seed",
    "get_rng_state",
    "get_rng_state_all",
    "set_rng_state",
    "set_rng_state_all",
    "fork_rng",
    "default_generators",  # noqa: F822 - a module attribute made on access (__getattr__)
    "rand",
    "randn",
    "randint",
    "normal",
    "uniform_",
    "normal_",
    "bernoulli_",
]

# The public names keep the package as their home (reprs, pickles of Generator, docs), as
# they had before the package was split into modules.
for _obj in (Generator, PhiloxState, RandomStateError, manual_seed, manual_seed_all, seed,
             seed_all, initial_seed, get_rng_state, get_rng_state_all, set_rng_state,
             set_rng_state_all, fork_rng, rand, randn, randint, normal, uniform_, normal_,
             bernoulli_, torch_launch_plan):
    _obj.__module__ = __name__
del _obj


def __getattr__(name: str) -> Any:
    if name == "default_generators":
        return all_default_generators()
    raise AttributeError(f"module 'cudalab.random' has no attribute {name!r}")
