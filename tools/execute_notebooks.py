"""Re-execute notebooks in place and record where they ran (`make execute`).

Each notebook runs top to bottom in a fresh kernel started from this Python (so the machine's own PyTorch
is used), its outputs and ipywidgets state are stored, and its metadata gets a ``kernel_course`` entry:
device name, torch, triton and CUDA versions, and the date. A notebook that raises is not written back.

    python tools/execute_notebooks.py notebooks/00_measure_your_gpu.ipynb [...] [--timeout 1800]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import nbformat
from nbclient import NotebookClient

from kernel_lib.bench import environment


def execute(path: str, timeout: int) -> float:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}},
        store_widget_state=True,
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first cell that fails; the file is left as it was
    seconds = time.perf_counter() - start
    env = environment()
    notebook.metadata["kernel_course"] = {
        "device": env["device"],
        "torch": env["torch"],
        "triton": env["triton"],
        "cuda": env["cuda"],
        "python": env["python"],
        "executed": env["timestamp"],
        "execution_seconds": round(seconds, 1),
    }
    nbformat.write(notebook, path)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per cell")
    args = parser.parse_args()
    env = environment()
    print(f"executing on {env['device']} with torch {env['torch']}, triton {env['triton']}")
    for path in args.notebooks:
        print(f"{path} ...", flush=True)
        print(f"{path}: done in {execute(path, args.timeout):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
