"""cudalab.comm on four devices, in a subprocess: four simulated ones (the suite's simulator
has two), and four real GPUs where a machine has them (NCCL's cliques of four ranks, peer
copies between every pair)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.gpu import HAS_GPU

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import numpy as np
    import cudalab
    from cudalab import _internal, comm
    from cudalab.comm import _common

    assert cudalab.device_count() == 4
    records = []
    _internal.collective_observers.append(records.append)
    rng = np.random.default_rng(0)
    host = rng.standard_normal((9, 6)).astype(np.float32)

    # broadcast from device 2 to all four, and from the host
    src = cudalab.asarray(host, device=2)
    results = comm.broadcast(src, [0, 1, 2, 3])
    assert results[2] is src
    for d, r in enumerate(results):
        assert r.device_index == d
        np.testing.assert_array_equal(r.numpy(), host)
    for r in comm.broadcast(host, range(4)):
        np.testing.assert_array_equal(r.numpy(), host)

    # reduce_add of four (as installed, then the copy path in torch's order)
    parts = [rng.standard_normal(1000).astype(np.float32) for _ in range(4)]
    inputs = [cudalab.asarray(p, device=d) for d, p in enumerate(parts)]
    total = comm.reduce_add(inputs, destination=3)
    assert total.device_index == 3
    np.testing.assert_allclose(total.numpy(), sum(p.astype(np.float64) for p in parts),
                               rtol=1e-5, atol=1e-5)
    saved, _common.nccl_module = _common.nccl_module, lambda: None
    total = comm.reduce_add(inputs, destination=2)
    expected = ((parts[2] + parts[0]) + parts[1]) + parts[3]
    np.testing.assert_array_equal(total.numpy(), expected)
    _common.nccl_module = saved

    # scatter 9 rows to four devices: chunk gives 3 pieces of 3; then gather them back
    pieces = comm.scatter(cudalab.asarray(host, device=1), [0, 1, 2, 3])
    assert [p.shape for p in pieces] == [(3, 6)] * 3
    assert [p.device_index for p in pieces] == [0, 1, 2]
    back = comm.gather(pieces, destination=3)
    np.testing.assert_array_equal(back.numpy(), host)
    cols = comm.scatter(host, [3, 2, 1, 0], chunk_sizes=[1, 2, 0, 3], dim=1)
    np.testing.assert_array_equal(comm.gather(cols, dim=1, destination="cpu"), host)

    # coalesced over four devices
    arrays = [cudalab.asarray(np.arange(n, dtype=dt), device=0)
              for n, dt in [(5, np.float32), (3, np.int64), (7, np.float32), (2, np.float16)]]
    outputs = comm.broadcast_coalesced(arrays, [0, 1, 2, 3], buffer_size=24)
    for d in range(1, 4):
        for out, a in zip(outputs[d], arrays):
            assert out.device_index == d and out.dtype == a.dtype
            np.testing.assert_array_equal(out.numpy(), a.numpy())
    sums = comm.reduce_add_coalesced(outputs, destination=1, buffer_size=24)
    for s, a in zip(sums, arrays):
        np.testing.assert_array_equal(s.numpy(), 4 * a.numpy())

    names = [(r.name, r.nranks) for r in records if r.name.startswith("comm.")]
    assert names == [("comm.broadcast", 4), ("comm.broadcast", 4), ("comm.reduce_add", 4),
                     ("comm.reduce_add", 4), ("comm.scatter", 3), ("comm.gather", 4),
                     ("comm.scatter", 4), ("comm.gather", 4),
                     ("comm.broadcast_coalesced", 4), ("comm.reduce_add_coalesced", 4)], names
    print("four devices: OK")
""")


@pytest.mark.skipif(HAS_GPU, reason="simulator only (a real machine has its own devices)")
def test_comm_on_four_simulated_devices():
    env = dict(os.environ, CUDALAB_SIMULATOR="1", CUDALAB_SIMULATOR_DEVICES="4")
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("four devices: OK")


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(not HAS_GPU, reason="needs real GPUs")
def test_comm_on_four_real_gpus():
    import cudalab

    if cudalab.device_count() < 4:
        pytest.skip("needs four GPUs")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1,2,3", NCCL_NVLS_ENABLE="0")
    env.pop("CUDALAB_SIMULATOR", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("four devices: OK")
