"""Shared pieces of the cudalab.comm tests: dtypes, host twins, a recording NCCL stand-in."""

from __future__ import annotations

import numpy as np

import cudalab
from cudalab._driver.base import NCCL_CALL_BROADCAST, NCCL_CALL_REDUCE
from cudalab.array import DeviceArray

#: dtypes the value tests run over (bfloat16 joins when ml_dtypes is installed).
DTYPES = ["float32", "float64", "float16", "int32", "int64", "int8", "uint8", "bool"]
try:
    import ml_dtypes  # noqa: F401

    DTYPES.append("bfloat16")
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    pass


def host_array(shape, dtype, seed=0):
    """A host array of ``shape`` with distinct small values of ``dtype``."""
    rng = np.random.default_rng(seed)
    dt = cudalab.array.normalize_dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dt.kind in "iu":
        return rng.integers(0, 50, size=shape).astype(dt)
    return rng.integers(-64, 64, size=shape).astype(np.float32).astype(dt) / 4


def on(device, host):
    """``host`` copied to ``device``."""
    return cudalab.asarray(host, device=device)


class RecordingNccl:
    """torch.cuda.nccl's API (the part cudalab.comm calls), over host round trips.

    It checks the arguments the way NCCL's single-process API needs them (contiguous
    arrays on distinct devices, one dtype, the output on the root) and records each call,
    so the tests can see that cudalab.comm takes the NCCL branch exactly where torch does
    and passes torch's arguments.
    """

    SUM = 0

    def __init__(self):
        self.calls = []

    def is_available(self, arrays):
        arrays = list(arrays)
        if not all(isinstance(a, DeviceArray) and a.is_contiguous() for a in arrays):
            return False
        devices = [a.device_index for a in arrays]
        return len(set(devices)) == len(devices)

    def clique_call(self, kind, ins, outs, root=0, op=SUM):
        """cudalab.nccl's record builder for cudalab.comm: here a plain tuple for issue()."""
        assert len({a.dtype for a in ins}) == 1  # the caller's guarantee
        return (kind, ins, outs, root, op)

    def issue(self, call):
        """cudalab.nccl's issue of a clique_call record: the public call of that kind."""
        kind, ins, outs, root, op = call
        if kind == NCCL_CALL_BROADCAST:
            assert outs is ins or list(outs) == list(ins)
            self.broadcast(ins, root=root)
        else:
            assert kind == NCCL_CALL_REDUCE
            assert all(o is None for i, o in enumerate(outs) if i != root)
            self.reduce(ins, output=outs[root], root=root, op=op)

    def broadcast(self, inputs, root=0, streams=None, comms=None):
        inputs = list(inputs)
        assert self.is_available(inputs)
        assert len({a.dtype for a in inputs}) == 1
        self.calls.append(("broadcast", tuple(a.device_index for a in inputs), root))
        host = inputs[root].numpy()
        for i, a in enumerate(inputs):
            if i != root:
                a.copy_(host)

    def reduce(self, inputs, output=None, root=0, op=SUM, streams=None, comms=None, *,
               outputs=None):
        inputs = list(inputs)
        assert self.is_available(inputs) and op == self.SUM and outputs is None
        assert output is not None and output.device_index == inputs[root].device_index
        self.calls.append(("reduce", tuple(a.device_index for a in inputs), root))
        total = inputs[0].numpy().astype(np.float64)
        for a in inputs[1:]:
            total = total + a.numpy().astype(np.float64)
        output.copy_(total.astype(output.dtype))
