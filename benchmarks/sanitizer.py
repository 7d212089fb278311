"""Stream sanitizer benchmark: what the sanitizer costs, on and off.

The loop: 10k iterations, each allocating a small array on one of two streams,
launching a kernel that writes it (a fill) and one that reads it into another array (a
device-to-device copy), with an event ordering the second stream after the first. Rows:
the loop with the sanitizer off, on ("collect" mode), their ratio (the target is <= 3x), and
on a GPU with torch the equivalent torch loop without and with torch's CSAN
(``torch.cuda._sanitizer.enable_cuda_sanitizer()``, in a subprocess: it cannot be turned off).

    python benchmarks/sanitizer.py [--json out.json] [--quick]
"""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works uninstalled
from _harness import Table, environment, optional_import, parse_args, write_json  # noqa: E402

TORCH_LOOP = """
import sys, time, torch
if sys.argv[1] == "csan":
    import torch.cuda._sanitizer as csan
    csan.enable_cuda_sanitizer()
n = int(sys.argv[2])
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
def loop(k):
    for i in range(k):
        s = s1 if i % 2 else s2
        with torch.cuda.stream(s):
            a = torch.empty(256, device="cuda")
            a.fill_(1.0)
            e = torch.cuda.Event()
            e.record(s)
        other = s2 if s is s1 else s1
        other.wait_event(e)
        with torch.cuda.stream(other):
            b = torch.empty(256, device="cuda")
            b.copy_(a)
        a.record_stream(other)
        del a, b
loop(200)
torch.cuda.synchronize()
t0 = time.perf_counter()
loop(n)
torch.cuda.synchronize()
print((time.perf_counter() - t0) / n)
"""


def torch_seconds(mode: str, n: int) -> float | None:
    r = subprocess.run([sys.executable, "-c", TORCH_LOOP, mode, str(n)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        return None
    return float(r.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args(__doc__)
    n = 2000 if args.quick else 10000
    import time

    import cudalab
    import cudalab._internal
    from cudalab import sanitizer

    cudalab.init()
    backend = cudalab._internal.backend()
    name = cudalab.get_device_name(0)
    t = Table(f"cudalab stream sanitizer benchmark — {name} ({backend.name})")
    results: dict = {"env": environment(backend.name, name), "us": {}}
    s1, s2 = cudalab.Stream(), cudalab.Stream()

    def loop(k):
        for i in range(k):
            s = s1 if i % 2 else s2
            with cudalab.stream(s):
                a = cudalab.empty(256)
                a.fill_(1.0)
                e = cudalab.Event()
                e.record(s)
            other = s2 if s is s1 else s1
            other.wait_event(e)
            with cudalab.stream(other):
                b = cudalab.empty(256)
                b.copy_(a)
            a.record_stream(other)
            del a, b

    def timed(k):
        loop(200)
        cudalab.synchronize()
        t0 = time.perf_counter()
        loop(k)
        cudalab.synchronize()
        return (time.perf_counter() - t0) / k

    off, on = [], []
    found = 0
    for _ in range(3 if args.quick else 5):
        off.append(timed(n))
        with sanitizer.sanitize("collect") as session:
            on.append(timed(n))
        found += len(session.reports)
    best_off, best_on = min(off), min(on)
    results["us"]["loop, sanitizer off"] = best_off * 1e6
    results["us"]["loop, sanitizer on"] = best_on * 1e6
    results["ratio"] = best_on / best_off
    results["findings"] = found
    t.add(f"cudalab loop ({n} iterations), sanitizer off", best_off * 1e6, "µs", "per iteration")
    t.add(f"cudalab loop ({n} iterations), sanitizer on", best_on * 1e6, "µs",
          f"per iteration; {found} findings (expected 0)")
    t.add("on / off", best_on / best_off, "x", "target <= 3x")
    torch = None if backend.simulated else optional_import("torch")
    if torch is not None and torch.cuda.is_available():
        plain, csan = torch_seconds("plain", n), torch_seconds("csan", n)
        for label, s in (("torch loop", plain), ("torch loop, CSAN on", csan)):
            results["us"][label] = None if s is None else s * 1e6
            t.add(label, None if s is None else s * 1e6, "µs", "per iteration")
        if plain and csan:
            t.add("torch CSAN on / off", csan / plain, "x", "")
    else:
        t.add("torch loop, CSAN on", None, "µs", "needs torch on a GPU")
    print(t.render())
    write_json(args.json, results)


if __name__ == "__main__":
    main()
