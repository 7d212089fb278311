"""The ``cudalab`` command (also ``python -m cudalab``).

Subcommands are one function each (``_cmd_<name>``) registered in :func:`build_parser`;
``info`` is the first. Imports of cudalab's runtime happen inside the subcommands, so
``cudalab --help`` and ``--version`` never touch a driver.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

GIB = 1024**3

SIMULATOR_BANNER = "SIMULATOR: these devices are simulated"
SIMULATOR_BACKEND = "simulator (no GPU used; all values simulated)"
SIMULATOR_HINT = "run `cudalab info --simulator` (or set CUDALAB_SIMULATOR=1) to see simulated devices"


def _version() -> str:
    try:
        import cudalab

        version = getattr(cudalab, "__version__", None)
        if version:
            return str(version)
    except ImportError:
        pass
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        return dist_version("cudalab")
    except (ImportError, PackageNotFoundError):
        return "unknown"


def _cuda_version(value: int) -> str:
    """13000 -> "13.0" (CUDA's major*1000 + minor*10 encoding)."""
    return f"{value // 1000}.{(value % 1000) // 10}"


def _nvrtc_version() -> str:
    try:
        from cudalab._driver import nvrtc

        major, minor = nvrtc.version()
        return f"{major}.{minor}"
    except (ImportError, AttributeError, RuntimeError):
        return "unavailable"


# ---------------------------------------------------------------------------------- info
def _gather_info() -> dict[str, Any]:
    """Everything ``info`` shows, as plain data (the --json output)."""
    from cudalab import _driver
    from cudalab.errors import NvmlError
    from cudalab.memory_tools import stacks

    simulated = _driver.selected_backend_name() == "simulator"
    info: dict[str, Any] = {
        "version": _version(),
        "backend": "simulator" if simulated else "cuda",
        "simulated": simulated,
        "driver_version": None,
        "driver_version_int": None,
        "nvrtc_version": _nvrtc_version(),
        "nvml": None,
        "history_stamp": stacks.stamp_implementation(),  # which stamp records stacks
        "devices": [],
        "error": None,
    }
    try:
        backend = _driver.get_backend()
        backend.init()
        count = backend.device_count()
        driver = backend.driver_version()
    except (ImportError, RuntimeError, OSError) as exc:
        info["error"] = _reason(exc, info["backend"])
        return info
    info["driver_version_int"] = driver
    info["driver_version"] = _cuda_version(driver)
    if not simulated:  # which path kernel launches take (the C fast calls or the bindings)
        from cudalab._driver.cuda_api import FAST

        info["launch_calls"] = "compiled" if FAST.launch_kernel is not None else "cuda.bindings"
    if count == 0:
        info["error"] = "the CUDA driver reports no devices"
        return info
    try:
        backend.nvml().device_count()
        info["nvml"] = "available"
    except NvmlError as exc:
        info["nvml"] = f"unavailable: {exc}"

    from cudalab import devices, nvml

    for index in range(count):
        props = devices.get_device_properties(index)
        free, total = devices.mem_get_info(index)
        row = {
            "index": index,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_free": int(free),
            "memory_total": int(total),
            "multi_processor_count": props.multi_processor_count,
            "uuid": props.nvml_uuid,
        }
        snap = nvml.device_snapshot(index)
        snap.pop("simulated")
        row.update(snap)
        info["devices"].append(row)
    return info


def _reason(exc: BaseException, backend: str) -> str:
    """Why no device can be shown, in one line."""
    if isinstance(exc, ImportError):
        name = exc.name or ""
        if name == "cuda" or name.startswith("cuda."):
            return f"the CUDA Python bindings are not installed ({exc}); pip install cuda-bindings"
        return f"cudalab's {backend} backend could not be imported ({exc})"
    return str(exc).strip() or type(exc).__name__


def _degree() -> str:
    """"°C", or "C" where stdout cannot encode the degree sign."""
    try:
        "°".encode(sys.stdout.encoding or "ascii")
        return "°C"
    except (UnicodeEncodeError, LookupError):
        return "C"


def _na(value: Any, fmt: Callable[[Any], str]) -> str:
    return "n/a" if value is None else fmt(value)


def _table(header: Sequence[str], rows: list[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def _format_info(info: dict[str, Any]) -> str:
    simulated = info["simulated"]
    lines = []
    if simulated:
        lines.append(SIMULATOR_BANNER)
    sim = " (simulated)" if simulated else ""
    lines.append(f"cudalab  {info['version']}")
    lines.append(f"backend  {SIMULATOR_BACKEND if simulated else 'cuda'}")
    if info["driver_version"] is not None:
        lines.append(f"driver   CUDA {info['driver_version']} ({info['driver_version_int']}){sim}")
    else:
        lines.append("driver   unavailable")
    lines.append(f"NVRTC    {info['nvrtc_version']}")
    if "history_stamp" in info:
        stamp = info["history_stamp"]
        lines.append("stacks   " + ("compiled stamp (cudalab.memory_tools._stackstamp)" if stamp == "compiled"
                                  else "pure-Python stamp"))
    if info.get("launch_calls"):
        lines.append("launches " + ("compiled fast calls (cudalab._driver.fastcall)"
                                    if info["launch_calls"] == "compiled"
                                    else "cuda.bindings wrappers"))
    if info["error"] is not None:
        lines.append("")
        lines.append(f"No CUDA devices: {info['error']}")
        if not simulated:
            lines.append(f"hint: {SIMULATOR_HINT}")
        return "\n".join(lines)
    if info["nvml"] != "available":
        lines.append(f"NVML     {info['nvml']}")
    lines.append("")
    deg = _degree()
    header = ["#", "name", "cap", "memory free / total", "SMs", "UUID",
              "util", "temp", "power", "SM clock"]
    rows: list[Sequence[str]] = []
    for d in info["devices"]:
        rows.append([
            str(d["index"]),
            d["name"],
            d["capability"],
            f"{d['memory_free'] / GIB:.1f} / {d['memory_total'] / GIB:.1f} GiB",
            str(d["multi_processor_count"]),
            d["uuid"],
            _na(d["utilization"], lambda v: f"{v} %"),
            _na(d["temperature"], lambda v: f"{v} {deg}"),
            _na(d["power_draw"], lambda v: f"{v / 1000:.1f} W"),
            _na(d["clock_rate"], lambda v: f"{v} MHz"),
        ])
    lines.extend(_table(header, rows, right={0, 3, 4, 6, 7, 8, 9}))
    return "\n".join(lines)


def _cmd_info(args: argparse.Namespace) -> int:
    from cudalab import _driver, devices

    if args.simulator:
        devices.use_simulator()  # the public one: it also forgets a probed device count
    try:
        if _driver.selected_backend_name() == "simulator":
            _driver.get_backend()  # reads CUDALAB_SIMULATOR_DEVICES and _MEMORY (ValueError)
    except ValueError as exc:  # CUDALAB_SIMULATOR(_*) set to something unintelligible
        print(f"cudalab: error: {exc}", file=sys.stderr)
        return 2
    info = _gather_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(_format_info(info))
    return 0


# ---------------------------------------------------------------------------------- replay
def _cmd_replay(args: argparse.Namespace) -> int:
    """``replay`` and ``what-if``: replay a trace through fresh allocators on the simulator."""
    import importlib
    import os
    import warnings

    from cudalab._units import echo, parse_size

    # (by module path: cudalab.memory may export the replay *function* under the same name)
    rp, wi = (importlib.import_module(f"cudalab.memory_tools.{m}") for m in ("replay", "what_if"))

    name = args.command
    try:
        memory = parse_size(args.device_memory, allow_zero=False) if args.device_memory else None
        if args.plot:
            if os.path.splitext(args.plot)[1].lower() not in (".png", ".svg"):
                raise ValueError(f"plot file must end in .png or .svg, got {echo(args.plot)}")
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ValueError("install matplotlib to save plots (pip install matplotlib)") \
                    from None
        progress = bool(args.progress or (sys.stderr.isatty() and not args.json))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if name == "replay":
                result = rp.replay(args.trace, args.conf, device_memory=memory,
                                   device=args.device, progress=progress)
                results = [result]
            elif getattr(args, "search", False):
                at = importlib.import_module("cudalab.memory_tools.autotune")
                capacities = [parse_size(c, allow_zero=False) for c in args.capacity]
                if memory is not None:
                    capacities.insert(0, memory)
                table = at.autotune(args.trace, capacities or None, args.conf or None,
                                    device=args.device, workers=args.workers,
                                    progress=progress)
                results = [r for r in table.attrs["results"] if r is not None]
            else:
                _check_trace_source(args.trace, args.source)
                table = wi.what_if(args.trace, args.conf or None, device_memory=memory,
                                   device=args.device, progress=progress)
                results = table.attrs["results"]
        for w in caught:
            print(f"cudalab {name}: warning: {w.message}", file=sys.stderr)
        if args.plot:
            rp.save_plot(results, args.plot)
    except (ValueError, OSError, ImportError) as exc:  # TraceError is a ValueError
        text = str(exc).strip().splitlines()
        print(f"cudalab {name}: error: {text[0] if text else type(exc).__name__}",
              file=sys.stderr)
        return 2
    if name == "what-if" and getattr(args, "search", False):
        if args.json:
            print(json.dumps(_search_json(table), indent=2))
        else:
            print(at.format_autotune(table, top=args.top))
            if args.plot:
                print(f"plot saved to {args.plot}")
        return 0
    if args.json:
        if name == "replay":
            print(json.dumps(result.to_dict(), indent=2))
        else:
            print(json.dumps({"source": results[0].source if results else args.trace,
                              "note": table.attrs.get("note"),
                              "peak_live": table.attrs.get("peak_live"),
                              "elapsed_s": table.attrs.get("elapsed_s"),
                              "ranking": [{"rank": int(rank), **row} for rank, row in
                                          zip(table.index, table.to_dict("records"))]},
                             indent=2))
    else:
        print(str(result) if name == "replay" else wi.format_what_if(table, target=args.target))
        if args.plot:
            print(f"plot saved to {args.plot}")
    return 0


def _check_trace_source(path: str, source: str) -> None:
    """ValueError unless the trace file ``path`` is ``source``'s (``auto``: any). A snapshot
    names its allocator in its ``identity`` (cudalab writes one; torch's own dumps have none
    and count as torch's); a history CSV names none and is accepted."""
    if source == "auto" or path.lower().endswith(".csv"):
        return
    from cudalab.memory_tools.trace_io import load_snapshot

    snap = load_snapshot(path)
    identity = snap.get("identity") if isinstance(snap, dict) else None
    allocator = identity.get("allocator") if isinstance(identity, dict) else "torch"
    if allocator != source:
        raise ValueError(f"{path} is {allocator}'s trace (its identity says so), not "
                         f"{source}'s (--source {source}); use --source auto to replay it")


def _search_json(table: Any) -> dict[str, Any]:
    """``what-if --search --json``: the autotuner's frame as plain values."""
    rows = []
    for row in table.to_dict("records"):
        rows.append({k: (None if _missing(v) else (v.item() if hasattr(v, "item") else v))
                     for k, v in row.items()})
    rec = dict(table.attrs.get("recommendation") or {})
    return {"source": table.attrs.get("source"), "entries": table.attrs.get("entries"),
            "capacities": table.attrs.get("capacities"),
            "capacity_note": table.attrs.get("capacity_note"),
            "refused": table.attrs.get("refused"), "replays": table.attrs.get("replays"),
            "elapsed_s": table.attrs.get("elapsed_s"), "recommendation": rec, "rows": rows}


def _missing(value: Any) -> bool:
    try:
        return bool(value != value) or type(value).__name__ == "NAType"  # NaN, pd.NA
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cudalab",
        description="cudalab: torch.cuda's runtime without PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"cudalab {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser("info", help="show the driver, NVRTC and the devices",
                          description="Show cudalab's version, the backend, the CUDA driver and "
                                      "NVRTC versions and a table of devices with NVML readings.")
    info.add_argument("--simulator", action="store_true",
                      help="use the simulator (no GPU; all values simulated)")
    info.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    info.set_defaults(func=_cmd_info)

    for cmd in ("replay", "what-if"):
        if cmd == "replay":
            p = sub.add_parser(
                "replay", help="replay a memory trace through the allocator (simulated)",
                description="Replay the alloc/free trace of a memory snapshot pickle "
                            "(cudalab's or torch's _dump_snapshot) or of a history CSV "
                            "(%%cuda_memory history save X.csv) through a fresh caching "
                            "allocator on a private simulated device and print peak "
                            "reserved/allocated memory, device allocations, retries and OOMs.")
            p.add_argument("--conf", default=None, metavar="CONF",
                           help="allocator settings, PYTORCH_ALLOC_CONF grammar "
                                "(e.g. expandable_segments:True,max_split_size_mb:128)")
        else:
            p = sub.add_parser(
                "what-if", help="rank allocator settings by the memory a trace would need",
                description="Replay a memory trace under several allocator settings "
                            "(default: a bounded search over expandable_segments, "
                            "max_split_size_mb, roundup_power2_divisions, "
                            "backend:cudaMallocAsync, their combinations and "
                            "garbage_collection_threshold under per_process_memory_fraction "
                            "caps) and print them ranked by peak reserved memory, with where "
                            "the memory of the reserved peak went.")
            p.add_argument("--conf", action="append", default=[], metavar="CONF",
                           help="a setting to try instead of the default search (repeatable; "
                                "the defaults are always the baseline)")
            p.add_argument("--search", action="store_true",
                           help="the autotuner: replay a grid of settings wider than the "
                                "default search (expandable_segments x max_split_size_mb x "
                                "roundup_power2_divisions, cudaMallocAsync, memory fractions) "
                                "at each --capacity, in parallel, and recommend one line for "
                                "PYTORCH_CUDA_ALLOC_CONF / CUDALAB_ALLOC_CONF")
            p.add_argument("--capacity", action="append", default=[], metavar="SIZE",
                           help="with --search: a device size to model (repeatable; default: "
                                "the trace's own device when it records it)")
            p.add_argument("--workers", type=int, default=None, metavar="N",
                           help="with --search: worker processes (default: the CPUs; 1 is "
                                "serial)")
            p.add_argument("--top", type=int, default=10, metavar="N",
                           help="with --search: rows shown per capacity (default 10)")
            p.add_argument("--source", choices=("cudalab", "torch", "cupy", "auto"),
                           default="auto",
                           help="the allocator whose trace TRACE must be: cudalab (a snapshot "
                                "whose identity names cudalab), torch (torch's _dump_snapshot "
                                "or '%%cuda_memory history save X.pickle --source torch') or "
                                "cupy ('%%cuda_memory history save X.pickle --source cupy'); "
                                "auto (default) replays any")
            p.add_argument("--target", type=float, default=None, metavar="RATIO",
                           help="a goal for peak reserved / peak allocated (e.g. 1.10): say "
                                "which settings reach it, or which comes closest")
        p.add_argument("trace", metavar="TRACE",
                       help="a history: snapshot pickle (%%cuda_memory history save X.pickle, "
                            "_dump_snapshot) or history CSV (history save X.csv); a "
                            "Perfetto JSON is refused (it keeps no event order)")
        p.add_argument("--device", type=int, default=0, help="device trace to replay (default 0)")
        p.add_argument("--device-memory", default=None, metavar="SIZE",
                       help="memory of the simulated device, e.g. 80GiB (default: "
                            "large enough never to matter)")
        p.add_argument("--plot", default=None, metavar="OUT",
                       help="save reserved/allocated over time as OUT.png or OUT.svg "
                            "(needs matplotlib)")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.add_argument("--progress", action="store_true",
                       help="show a progress bar on stderr (default: when it is a terminal)")
        p.set_defaults(func=_cmd_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    return func(args)
