"""Matmul and FFT benchmark: cudalab.matmul / cudalab.fft beside torch in the same run.

Measures, on one GPU (issue 42's numbers):

* matmul TFLOPS of 4096 x 4096 and a batched (32, 1024, 1024) product, float32 with TF32 off
  and on, float16 and bfloat16 (goal >= 0.95x torch), and whether the results equal torch's
  (bit-equal for float16 / bfloat16, the same cublasGemmEx call; the largest difference
  otherwise);
* the host time of one small (64 x 64) float32 matmul, ``a @ b`` with its output allocated
  (goal <= torch's), and ``matmul(a, b, out=c)``; cudalab's through its C call of cuBLAS
  (cudalab._driver.blascall), and again through its ctypes twin and through cublasGemmEx;
* FFT GB/s (bytes read + written over GPU time) of c2c 2**24 complex64, r2c 2**24 float32 and
  a 2-D c2c 4096 x 4096 complex64 (goal >= 0.95x torch.fft);
* the host time of an FFT whose plan is in the cache (goal <= torch's), and of one with
  ``cufft_plan_cache.max_size = 0``, which builds its plan every call (both libraries).

    python benchmarks/blas_fft.py [--json out.json] [--quick] [--sections host,matmul,fft,fft-host]

GPU times are taken over ``INNER`` calls queued back to back between two events (the mean of
each), so the host's time to queue one call, which differs between the libraries, is hidden
behind the GPU's work as in a loop of real work, and is not counted as GPU time (with one call
per event pair, an idle GPU waits for it: 10-20 us of a 0.2 ms float16 GEMM). Host times are
taken in chunks of ``CHUNK`` calls with the GPU drained between chunks, untimed (a loop the GPU
cannot keep up with would otherwise time the GPU, and leave a full launch queue to the next).
torch is imported lazily and its columns are skipped without it. On the simulator only the
host costs mean anything (the GEMMs and FFTs are numpy).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works uninstalled
from _harness import Table, environment, optional_import, write_json  # noqa: E402

#: The benchmark's sections (``--sections``): matmul TFLOPS, the small matmul's host time,
#: FFT GB/s, the FFT's host time.
SECTIONS = ("matmul", "host", "fft", "fft-host")
#: Calls queued between two timing events for a GPU time (see the module's notes).
INNER = 10
#: Calls timed between two device synchronizations in a host-time loop (see _host_seconds).
CHUNK = 100


def _host_seconds(loops, number: int, rounds: int, synchronize) -> dict:
    """Median host seconds per call of each ``loop(count)``, measured round-robin, in chunks of
    :data:`CHUNK` calls with the device synchronized (untimed) after each chunk and loop.

    Why the chunks: a loop whose calls the GPU runs slower than the host queues them (a 64x64
    GEMM can take the GPU as long as its host call) fills the launch queue; its later calls
    then wait for the GPU, and the next loop starts behind a queue of up to a thousand
    launches. With the GPU drained every ``CHUNK`` calls, each row is the host's own time per
    call, whatever the loop before it queued.
    """
    import statistics
    import time

    for loop in loops.values():
        loop(min(number, 1000))
        synchronize()
    samples: dict = {key: [] for key in loops}
    chunks = max(1, number // CHUNK)
    for _ in range(rounds):
        for key, loop in loops.items():
            total = 0.0
            for _ in range(chunks):
                t0 = time.perf_counter()
                loop(CHUNK)
                total += time.perf_counter() - t0
                synchronize()
            samples[key].append(total / (chunks * CHUNK))
    return {key: statistics.median(values) for key, values in samples.items()}


def _parse_args():
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write results as JSON to this path")
    p.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)")
    args = p.parse_args()
    args.sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.error(f"--sections: unknown section(s) {', '.join(unknown)} (of {', '.join(SECTIONS)})")
    return args


def _gpu_seconds(run, start, end, reps: int, warmup: int = 2, inner: int = 1) -> float:
    """Median GPU seconds of ``run()`` between two timing events (one pair per repetition)."""
    return _paired_gpu_seconds([(run, start, end)], reps, warmup, inner)[0]


def _paired_gpu_seconds(contenders, reps: int, warmup: int = 2, inner: int = 1) -> list[float]:
    """Median GPU seconds of one call of each ``(run, start, end)``: ``inner`` calls between
    the two events, the contenders taking turns within every repetition, so a drift of the
    GPU's clocks during the run falls on all alike."""
    for run, _start, end in contenders:
        for _ in range(warmup):
            run()
        end.synchronize()
    times: list[list[float]] = [[] for _ in contenders]
    for _ in range(reps):
        for i, (run, start, end) in enumerate(contenders):
            start.record()
            for _ in range(inner):
                run()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) / 1e3 / inner)
    return [sorted(t)[len(t) // 2] for t in times]


def main() -> None:  # noqa: C901 - one table, section by section
    args = _parse_args()
    import numpy as np

    import cudalab
    import cudalab._internal

    cudalab.init()
    backend = cudalab._internal.backend()
    sim = backend.simulated
    name = cudalab.get_device_name(0)
    torch = None if sim else optional_import("torch")
    if torch is not None and not torch.cuda.is_available():
        torch = None
    quick = args.quick or sim
    reps = 3 if sim else (9 if quick else 25)
    inner = 1 if sim else INNER
    number = 500 if sim else (2000 if quick else 10000)  # calls per host-time round
    t = Table(f"cudalab matmul / FFT benchmark — {name} ({backend.name})")
    results: dict = {"env": environment(backend.name, name), "tflops": {}, "gbps": {},
                     "us": {}, "equal": {}}
    ours_timer = (cudalab.Event(enable_timing=True), cudalab.Event(enable_timing=True))
    torch_timer = None
    if torch is not None:
        torch_timer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    rng = np.random.default_rng(0)
    settings = cudalab.backends.cuda.matmul

    # ------------------------------------------------------------------ matmul TFLOPS
    if "matmul" in args.sections:
        ml_dtypes = optional_import("ml_dtypes")  # bfloat16 arrays need it
        shapes = [((4096, 4096), (4096, 4096)), ((32, 1024, 1024), (32, 1024, 1024))]
        if sim:
            shapes = [((256, 256), (256, 256)), ((4, 128, 128), (4, 128, 128))]
        modes = [("float32", False), ("float32", True), ("float16", False)]
        if ml_dtypes is not None:
            modes.append(("bfloat16", False))
        else:
            t.add("matmul bfloat16", None, "", "skipped: ml_dtypes is not installed")
        for a_shape, b_shape in shapes:
            m, k = a_shape[-2:]
            n = b_shape[-1]
            batch = a_shape[0] if len(a_shape) == 3 else 1
            flops = 2.0 * batch * m * n * k
            label_shape = "x".join(map(str, a_shape))
            host_a = rng.standard_normal(a_shape).astype(np.float32)
            host_b = rng.standard_normal(b_shape).astype(np.float32)
            for dtype_name, tf32 in modes:
                dtype = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
                a = cudalab.asarray(host_a.astype(dtype))
                b = cudalab.asarray(host_b.astype(dtype))
                settings.allow_tf32 = tf32
                label = f"matmul {label_shape} {dtype_name}{' TF32' if tf32 else ''}"
                out = cudalab.matmul(a, b)
                ours_run = (lambda a=a, b=b, out=out: cudalab.matmul(a, b, out=out), *ours_timer)
                note = "simulator: numpy, not meaningful" if sim else ""
                if torch is None:
                    ours = flops / _gpu_seconds(*ours_run, reps, inner=inner) / 1e12
                else:
                    torch.backends.cuda.matmul.allow_tf32 = tf32
                    ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
                    tout = torch.matmul(ta, tb)
                    seconds = _paired_gpu_seconds(
                        [ours_run, (lambda ta=ta, tb=tb, tout=tout: torch.matmul(ta, tb, out=tout),
                                    *torch_timer)], reps, inner=inner)
                    ours, theirs = flops / seconds[0] / 1e12, flops / seconds[1] / 1e12
                    results["tflops"][f"torch {label}"] = theirs
                    cudalab.matmul(a, b, out=out)
                    torch.matmul(ta, tb, out=tout)
                    torch.cuda.synchronize()
                    mine = torch.from_dlpack(out)
                    same = bool(torch.equal(mine, tout))
                    diff = float((mine.float() - tout.float()).abs().max())
                    scale = float(tout.float().abs().max())
                    results["equal"][label] = {"bit_equal": same, "max_abs_diff": diff,
                                               "max_abs": scale}
                    note = (f"torch {theirs:.1f} TFLOPS, {ours / theirs:.2f}x (goal >= 0.95x); "
                            f"{'bit-equal' if same else f'max diff {diff:.3g} of {scale:.3g}'}")
                    del ta, tb, tout, mine
                results["tflops"][f"cudalab {label}"] = ours
                t.add(label, ours, "TFLOPS", note)
                del a, b, out
        settings.allow_tf32 = False
        if torch is not None:
            torch.backends.cuda.matmul.allow_tf32 = False

    # ------------------------------------------------------------------ matmul host time
    if "host" in args.sections:
        small_a = cudalab.asarray(rng.standard_normal((64, 64)).astype(np.float32))
        small_b = cudalab.asarray(rng.standard_normal((64, 64)).astype(np.float32))

        small_c = cudalab.matmul(small_a, small_b)
        from cudalab import _array_matmul
        from cudalab._driver import cublas as cublas_module

        # Which cuBLAS call path cudalab's float32 rows take: (CUDALAB_FASTCALL, typed entry
        # points). A row switches it only where the row before took another (the cached plans
        # forgotten then, so their calls are resolved again: one slow call per switch, not
        # per chunk of calls).
        saved_env = os.environ.get("CUDALAB_FASTCALL")
        default = (saved_env, cublas_module.TYPED_ENTRY_POINTS)
        path = {"now": default}

        def use(wanted):
            if path["now"] != wanted:
                fastcall, typed = wanted
                if fastcall is None:
                    os.environ.pop("CUDALAB_FASTCALL", None)
                else:
                    os.environ["CUDALAB_FASTCALL"] = fastcall
                cublas_module.TYPED_ENTRY_POINTS = typed
                _array_matmul.clear_plans()
                path["now"] = wanted

        def loop_ours(count, a=small_a, b=small_b):
            use(default)
            for _ in range(count):
                a @ b

        def loop_out(count, a=small_a, b=small_b, c=small_c, matmul=cudalab.matmul):
            use(default)
            for _ in range(count):
                matmul(a, b, out=c)

        loops = {"cudalab a @ b (64x64)": loop_ours}
        if torch is not None:
            tsa, tsb = torch.from_dlpack(small_a), torch.from_dlpack(small_b)
            tsc = torch.from_dlpack(small_c)

            def loop_torch(count, a=tsa, b=tsb):
                for _ in range(count):
                    a @ b

            def loop_torch_out(count, a=tsa, b=tsb, c=tsc, matmul=torch.matmul):
                for _ in range(count):
                    matmul(a, b, out=c)

            loops["torch a @ b (64x64)"] = loop_torch
        loops["cudalab matmul(a, b, out=c) (64x64)"] = loop_out
        if torch is not None:
            loops["torch matmul(a, b, out=c) (64x64)"] = loop_torch_out

        def switched(wanted):
            """loop_ours through another call path."""
            def loop(count, a=small_a, b=small_b):
                use(wanted)
                for _ in range(count):
                    a @ b
            return loop

        if not sim:  # the other cuBLAS call paths of cudalab for float32
            if cublas_module.c_calls_available():
                loops["cudalab a @ b (64x64) via ctypes"] = switched(("0", default[1]))
            loops["cudalab a @ b (64x64) via cublasGemmEx"] = switched((saved_env, False))
        # the parts of a @ b: the output's allocation and release alone, and the GEMM call
        # alone (the plan's call, resolved as matmul resolves it, into small_c: cuBLAS's own
        # host time plus the call's), so "a @ b" minus these is matmul's Python
        from cudalab import _array_state
        from cudalab import blas as blas_module
        from cudalab._driver import blas_seam

        float32, current = np.dtype(np.float32), cudalab.current_stream()

        def loop_alloc(count, dtype=float32, stream=current):
            for _ in range(count):
                _array_state.output((64, 64), dtype, 0, stream)

        bound = blas_module.bound_handle(0)
        gemm = bound.blas.gemm_call(bound.handle, blas_seam.OP_N, blas_seam.OP_N, 64, 64, 64, 1,
                                    64, 0, 64, 0, 0, 64, 64 * 64, 1, blas_seam.CUDA_R_32F,
                                    blas_seam.COMPUTE_32F, blas_seam.GEMM_DEFAULT)

        def loop_gemm(count, call=gemm, a=small_b.ptr, b=small_a.ptr, c=small_c.ptr):
            for _ in range(count):
                call(a, b, c)

        loops["(part) cudalab output allocation + release"] = loop_alloc
        if torch is not None:
            cuda0 = torch.device("cuda", 0)

            def loop_torch_alloc(count, empty=torch.empty, device=cuda0):
                for _ in range(count):
                    empty((64, 64), device=device)

            loops["(part) torch.empty((64, 64)) + release"] = loop_torch_alloc
        loops["(part) cudalab GEMM call alone"] = loop_gemm
        try:
            host = _host_seconds(loops, number, 5 if quick else 9, cudalab.synchronize)
        finally:
            use(default)
        for label, seconds in host.items():
            results["us"][label] = seconds * 1e6
            note = ""
            torch_label = ("torch matmul(a, b, out=c) (64x64)" if "out=" in label
                           else "torch a @ b (64x64)")
            if label.startswith("cudalab") and torch_label in host:
                note = f"{seconds / host[torch_label]:.2f}x torch (goal <= 1x)"
                if "via" in label and not sim and cublas_module.c_calls_available():
                    note += f"; {seconds / host['cudalab a @ b (64x64)']:.2f}x the C call"
            elif label.startswith("cudalab") and "via" not in label and not sim:
                note = ("through the C call (blascall)" if cublas_module.c_calls_available()
                        else "through ctypes (blascall is not built)")
            elif label == "(part) cudalab GEMM call alone" and not sim:
                note = (f"{'C' if type(gemm).__name__ == 'GemmCall' else 'ctypes'} call; a @ b "
                        f"spends {(host['cudalab a @ b (64x64)'] - seconds) * 1e6:.2f} µs "
                        f"beside it, torch {(host.get('torch a @ b (64x64)', seconds) - seconds) * 1e6:.2f}")
            t.add(label, seconds * 1e6, "µs", note)

    # ------------------------------------------------------------------ FFT GB/s
    if "fft" in args.sections:
        size = 1 << (16 if sim else 24)
        side = 256 if sim else 4096
        cases = [
            ("fft c2c complex64", "fft", (size,), np.complex64, {}),
            ("rfft r2c float32", "rfft", (size,), np.float32, {}),
            (f"fft2 c2c {side}x{side} complex64", "fft2", (side, side), np.complex64, {}),
        ]
        for label, fn, shape, dtype, kwargs in cases:
            host_x = rng.standard_normal(shape)
            if np.dtype(dtype).kind == "c":
                host_x = host_x + 1j * rng.standard_normal(shape)
            x = cudalab.asarray(host_x.astype(dtype))
            ours_fn = getattr(cudalab.fft, fn)
            y = ours_fn(x, **kwargs)
            moved = x.nbytes + y.nbytes
            ours_run = (lambda f=ours_fn, x=x, kw=kwargs: f(x, **kw), *ours_timer)
            note = "simulator: numpy, not meaningful" if sim else ""
            if torch is None:
                ours = moved / _gpu_seconds(*ours_run, reps, inner=inner) / 1e9
            else:
                tx = torch.from_dlpack(x)
                tfn = getattr(torch.fft, fn)
                seconds = _paired_gpu_seconds(
                    [ours_run, (lambda f=tfn, x=tx, kw=kwargs: f(x, **kw), *torch_timer)], reps,
                    inner=inner)
                ours, theirs = moved / seconds[0] / 1e9, moved / seconds[1] / 1e9
                results["gbps"][f"torch {label}"] = theirs
                ty = tfn(tx, **kwargs)
                mine = torch.from_dlpack(getattr(cudalab.fft, fn)(x, **kwargs))
                torch.cuda.synchronize()
                diff = float((mine - ty).abs().max() / ty.abs().max())
                results["equal"][label] = {"bit_equal": bool(torch.equal(mine, ty)),
                                           "max_rel_diff": diff}
                note = (f"torch.fft {theirs:.0f} GB/s, {ours / theirs:.2f}x (goal >= 0.95x); "
                        f"{'bit-equal' if torch.equal(mine, ty) else f'max rel diff {diff:.2g}'}")
                del tx, ty, mine
            results["gbps"][f"cudalab {label}"] = ours
            t.add(label, ours, "GB/s", note)
            del x, y

    # ------------------------------------------------------------------ FFT host time
    if "fft-host" in args.sections:
        small = cudalab.asarray((rng.standard_normal(256) + 0j).astype(np.complex64))
        cache = cudalab.backends.cuda.cufft_plan_cache

        def fft_ours(count, x=small, f=cudalab.fft.fft):
            for _ in range(count):
                f(x)

        loops = {"cudalab fft(256) plan-cache hit": fft_ours}
        if torch is not None:
            tsmall = torch.from_dlpack(small)

            def fft_torch(count, x=tsmall, f=torch.fft.fft):
                for _ in range(count):
                    f(x)

            loops["torch fft(256) plan-cache hit"] = fft_torch
        host = _host_seconds(loops, number, 5 if quick else 9, cudalab.synchronize)
        for label, seconds in host.items():
            results["us"][label] = seconds * 1e6
            note = ""
            if label.startswith("cudalab") and "torch fft(256) plan-cache hit" in host:
                note = f"{seconds / host['torch fft(256) plan-cache hit']:.2f}x torch (goal <= 1x)"
            t.add(label, seconds * 1e6, "µs", note)
        cache.max_size = 0
        if torch is not None:
            torch.backends.cuda.cufft_plan_cache.max_size = 0
        loops = {"cudalab fft(256) max_size=0": fft_ours}
        if torch is not None:
            loops["torch fft(256) max_size=0"] = fft_torch
        host = _host_seconds(loops, max(CHUNK, number // 20), 3, cudalab.synchronize)
        for label, seconds in host.items():
            results["us"][label] = seconds * 1e6
            t.add(label, seconds * 1e6, "µs", f"every call builds a plan (cache size "
                  f"{cache.size if label.startswith('cudalab') else torch.backends.cuda.cufft_plan_cache.size})")
        cache.max_size = 4096
        if torch is not None:
            torch.backends.cuda.cufft_plan_cache.max_size = 4096
    cudalab.synchronize()
    print(t.render())
    write_json(args.json, results)


if __name__ == "__main__":
    main()
