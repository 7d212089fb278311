"""cudalab's quickstart as a script: devices, a stream and events, memory, random numbers.

Run it on a GPU machine, or anywhere with the simulator::

    CUDALAB_SIMULATOR=1 python examples/quickstart.py

(tests/test_docs.py runs it on the simulator; the documentation's quickstart page shows it.)
"""

import numpy as np

import cudalab

# Fall back to the simulator where there is no usable GPU (it says so in every name).
if not cudalab.is_available():
    cudalab.use_simulator()

# Devices, as in torch.cuda.
for index in range(cudalab.device_count()):
    props = cudalab.get_device_properties(index)
    print(index, props.name, f"sm_{props.major}{props.minor}", f"{props.total_memory / 2**30:.1f} GiB")

# Arrays on the device: torch-style sizes, numpy dtypes.
x = cudalab.asarray(np.arange(1_000_000, dtype=np.float32))
y = cudalab.zeros(256, 256)
print("x:", x.shape, x.dtype, "on", x.device)

# A stream and two timing events around work on it.
stream = cudalab.Stream()
start, end = cudalab.Event(enable_timing=True), cudalab.Event(enable_timing=True)
with cudalab.stream(stream):
    start.record()
    cudalab.manual_seed(0)
    noise = cudalab.randn(1000, 1000)  # torch's Philox numbers: the same bits as torch.randn
    end.record()
end.synchronize()
print(f"randn(1000, 1000): {start.elapsed_time(end):.3f} ms on", cudalab.get_device_name())
values = noise.numpy()  # a copy to the host
print(f"mean {values.mean():.3f}, std {values.std():.3f}")

# The caching allocator, with torch's statistics.
print("allocated", cudalab.memory_allocated(), "bytes; reserved", cudalab.memory_reserved(), "bytes")
del x, y, noise
cudalab.empty_cache()
print("after empty_cache: reserved", cudalab.memory_reserved(), "bytes")
