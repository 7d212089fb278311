"""Execute a notebook that needs a GPU (and torch) with nbclient and write it, slimmed as the
committed notebooks are (tests/test_notebooks.py's ``slim``), with ``metadata.cudalab.captured_on``
naming the device, so it can be committed with GPU outputs::

    python -m tests.helpers.capture_notebook notebooks/09_torch_sources.ipynb OUT_DIR

The notebook runs in a fresh ``python3`` kernel (ipykernel) in a temporary directory (files it
writes stay there). A failing cell prints its error and writes ``NAME.failed.ipynb`` instead;
the exit status is then 1.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def _device(nb: dict) -> str | None:
    """The device the first code cell printed (``print(torch.__version__, device name)``)."""
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text = "".join(out.get("text", "")).strip().splitlines()
                if text and " " in text[-1]:
                    return text[-1].split(" ", 1)[1].strip()
        return None
    return None


def main(path: str, out_dir: str) -> int:
    import nbclient
    import nbformat

    from tests.test_notebooks import slim

    nb = nbformat.read(path, as_version=4)
    os.makedirs(out_dir, exist_ok=True)
    name = os.path.basename(path)
    work = tempfile.mkdtemp(prefix="cudalab-notebook-")
    client = nbclient.NotebookClient(nb, timeout=150, kernel_name="python3",
                                     resources={"metadata": {"path": work}})
    failed = None
    try:
        client.execute()
    except Exception as exc:  # CellExecutionError, a dead kernel: report and keep the partial
        failed = exc
    data = json.loads(nbformat.writes(nb))
    if failed is None:
        data["metadata"].setdefault("cudalab", {})["captured_on"] = _device(data)
        target = os.path.join(out_dir, name)
    else:
        target = os.path.join(out_dir, name.replace(".ipynb", ".failed.ipynb"))
        print(f"{name}: FAILED: {str(failed)[-1500:]}", file=sys.stderr)
    with open(target, "w") as f:
        f.write(json.dumps(slim(data), indent=1, ensure_ascii=False) + "\n")
    print(f"{name}: wrote {target} ({os.path.getsize(target):,} bytes), captured on "
          f"{data['metadata'].get('cudalab', {}).get('captured_on')}")
    return 1 if failed is not None else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.helpers.capture_notebook NOTEBOOK OUT_DIR")
    sys.exit(main(sys.argv[1], sys.argv[2]))
