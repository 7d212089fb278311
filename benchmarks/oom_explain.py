"""Benchmark: from a failed cell to the ``%cuda_memory why`` panel, with a long history.

An IPython shell (IPython's own, in this process) loads the extension, records the
allocator's history while a loop allocates and frees until the history holds ``--entries``
entries (some arrays stay live), then runs a cell that runs out of memory. Measured:

* the failed cell's run time (the out-of-memory observer reads the device state at the
  error) against the same failure with no observer attached;
* ``%cuda_memory why`` until its panel is ready (``explain_oom`` without the replays, and its
  HTML): the goal is <= 2 s with a 1M-entry history;
* the counterfactual replays that then fill the panel in (the autotuner on the history,
  spread over the CPUs).

    python benchmarks/oom_explain.py [--entries 1000000] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import environment, write_json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=1_000_000,
                   help="history entries before the failure (default 1,000,000)")
    p.add_argument("--json", default=None, help="write results as JSON to this path")
    args = p.parse_args()

    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    import cudalab
    import cudalab.memory as cm
    from cudalab import oom
    from cudalab.memory_tools import history

    shell = InteractiveShell.instance()
    cudalab.init()
    simulated = cudalab.devices.backend().simulated
    free, total = cm.mem_get_info()
    shell.run_line_magic("load_ext", "cudalab")
    shell.run_cell("import cudalab, cudalab.memory as cm\n"
                   "cm._record_memory_history(max_entries=10_000_000)\n"
                   f"keep = [cudalab.empty({int(free * 0.1)}, dtype='uint8') for _ in range(4)]",
                   store_history=True)
    t0 = time.perf_counter()
    pairs = max(1, (args.entries - 8) // 3)  # alloc, free_requested, free_completed
    shell.run_cell(f"for i in range({pairs}):\n"
                   "    x = cudalab.empty(4096 + (i % 64) * 512, dtype='uint8')\n"
                   "    del x\n", store_history=True)
    t_fill = time.perf_counter() - t0
    entries = history.entry_count(0)
    big = int(free * 0.8)
    with capture_output():
        t0 = time.perf_counter()
        r = shell.run_cell(f"y = cudalab.empty({big}, dtype='uint8')", store_history=True)
        t_first = time.perf_counter() - t0  # (the first one imports the state readers)
        t0 = time.perf_counter()
        r = shell.run_cell(f"y = cudalab.empty({big}, dtype='uint8')", store_history=True)
        t_cell = time.perf_counter() - t0
    assert not r.success
    with capture_output():
        t0 = time.perf_counter()
        expl = oom.explain_oom(replays=False)
        html = expl._repr_html_()
        t_panel = time.perf_counter() - t0
    t0 = time.perf_counter()
    full = expl.with_counterfactuals()
    t_cf = time.perf_counter() - t0
    # the same failure with no observer attached (the cost the observer adds to the cell)
    from cudalab import _observe

    _observe.unsubscribe_out_of_memory(oom.session._on_cudalab_oom)
    oom.session._watching["cudalab"] = False
    with capture_output():
        t0 = time.perf_counter()
        shell.run_cell(f"y = cudalab.empty({big}, dtype='uint8')", store_history=True)
        t_plain = time.perf_counter() - t0
    label = "SIMULATED" if simulated else cudalab.get_device_properties(0).name
    print(f"from a failed cell to the %cuda_memory why panel ({label}; "
          f"{entries:,} history entries, filled in {t_fill:.1f} s)")
    print(f"  failed cell: {t_cell * 1e3:.1f} ms with the observer ({t_first * 1e3:.1f} ms the "
          f"first time: imports), {t_plain * 1e3:.1f} ms without")
    print(f"  panel (explain_oom + HTML, {len(html):,} characters): {t_panel:.2f} s "
          f"(goal <= 2 s): {'PASS' if t_panel <= 2 else 'FAIL'}; verdict {expl.verdict}")
    cf = full.counterfactuals
    n_cf = 0 if cf is None else len(cf)
    print(f"  counterfactual replays ({n_cf} settings on {entries:,} entries): {t_cf:.1f} s, "
          "filled into the panel after it is shown")
    shell.run_line_magic("unload_ext", "cudalab")
    write_json(args.json, {"environment": environment("simulator" if simulated else "gpu",
                                                      label),
                           "entries": entries, "cell_s": t_cell, "first_cell_s": t_first, "cell_plain_s": t_plain,
                           "panel_s": t_panel, "counterfactuals_s": t_cf,
                           "verdict": expl.verdict})


if __name__ == "__main__":
    main()
