"""Re-execute notebooks in place and record where they ran (`make execute`).

Each notebook runs top to bottom in a fresh kernel started from this Python (so the machine's own PyTorch
is used), its outputs and ipywidgets state are stored, and its metadata gets a ``kernel_course`` entry:
device name, torch, triton and CUDA versions, and the date. A notebook that raises is not written back.

Progress bars (tqdm's notebook widgets) are stored as one line of text with their final state, and those that
closed themselves (``leave=False``, stored hidden) are dropped: a bar is only useful while a cell runs, and a
stored widget renders as a blank gap where the widget manager is not loaded.

    python tools/execute_notebooks.py notebooks/00_measure_your_gpu.ipynb [...] [--timeout 1800]
    python tools/execute_notebooks.py --strip-progress notebooks/*.ipynb   # just the progress-bar step, in place
"""

from __future__ import annotations

import argparse
import html
import os
import re
import sys
import time

import nbformat
from nbclient import NotebookClient

from kernel_lib.bench import environment

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _progress_bar_text(model_id: str, state: dict) -> str | None:
    """The last text of a tqdm bar (``desc: 100% 6/6 [00:05<00:00]``); '' for a hidden bar; None if not a bar."""
    model = state.get(model_id, {})
    children = [c.removeprefix("IPY_MODEL_") for c in model.get("state", {}).get("children", [])]
    names = [state.get(c, {}).get("model_name") for c in children]
    if model.get("model_name") != "HBoxModel" or names != ["HTMLModel", "FloatProgressModel", "HTMLModel"]:
        return None
    layout = state.get(model["state"].get("layout", "").removeprefix("IPY_MODEL_"), {}).get("state", {})
    if layout.get("visibility") == "hidden":
        return ""
    left, _, right = (state[c]["state"] for c in children)  # tqdm writes "desc: 100%" left, "6/6 [time]" right
    text = f"{html.unescape(left.get('value', ''))} {html.unescape(right.get('value', ''))}"
    return re.sub(r"\s+", " ", text).strip() + "\n"


# tqdm's text form of a bar (its widget's text/plain repr): "desc:  40%|████      | 4/10 [00:01<00:02, 3.1it/s]"
_TQDM_TEXT = re.compile(r"\d+%\|.*\|\s*\d+|\d+(?:\.\d+)?(?:it|s)/(?:s|it)\]")


def _plain_progress_text(output) -> str | None:
    """The text/plain form of a widget output whose model was not stored, if it is a progress bar; else None."""
    text = output.get("data", {}).get("text/plain", "")
    text = "".join(text) if isinstance(text, list) else text
    if text and _TQDM_TEXT.search(text) and not text.lstrip().startswith(("VBox(", "HBox(", "interactive(")):
        return text.rstrip("\n") + "\n"
    return None


def _referenced(model_ids: set, state: dict) -> set:
    """The models reachable from ``model_ids`` through their ``IPY_MODEL_`` references."""
    seen, todo = set(), list(model_ids)
    while todo:
        mid = todo.pop()
        if mid in seen or mid not in state:
            continue
        seen.add(mid)
        todo += re.findall(r"IPY_MODEL_([0-9a-f]+)", str(state[mid].get("state", {})))
    return seen


def progress_bars_as_text(notebook) -> int:
    """Store each progress-bar widget output as a line of text (or drop it if hidden); prune the widget state to
    the widgets still shown. Returns the number of bars replaced."""
    widgets = notebook.metadata.get("widgets", {}).get(WIDGET_STATE, {})
    state = widgets.get("state", {})
    replaced, shown = 0, set()
    for cell in notebook.cells:
        outputs = []
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            text = _progress_bar_text(view["model_id"], state) if view else None
            if view and text is None and view.get("model_id") not in state:
                text = _plain_progress_text(output)  # a bar whose widget state was not stored: keep its text form
            if text is None:
                outputs.append(output)
                if view:
                    shown.add(view["model_id"])
                continue
            replaced += 1
            if text:
                outputs.append(nbformat.v4.new_output("stream", name="stdout", text=text))
        if "outputs" in cell:
            cell["outputs"] = outputs
    if state:
        keep = _referenced(shown, state)
        widgets["state"] = {mid: model for mid, model in state.items() if mid in keep}
    return replaced


def execute(path: str, timeout: int, failed_to: str | None = None) -> float:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}},
        store_widget_state=True,
    )
    start = time.perf_counter()
    try:
        client.execute()  # raises CellExecutionError on the first cell that fails; the file is left as it was
    except Exception:
        if failed_to:  # the outputs up to the failing cell, for diagnosis, never in place of the notebook
            os.makedirs(failed_to, exist_ok=True)
            nbformat.write(notebook, os.path.join(failed_to, os.path.basename(path)))
        raise
    seconds = time.perf_counter() - start
    progress_bars_as_text(notebook)
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
    parser.add_argument(
        "--strip-progress",
        "--progress-bars-only",
        dest="progress_bars_only",
        action="store_true",
        help="only replace the stored progress-bar widgets (tqdm) by their text, in place; execute nothing",
    )
    parser.add_argument(
        "--failed-to", metavar="DIR", help="write a notebook that raises, with its outputs so far, into DIR"
    )
    args = parser.parse_args()
    if args.progress_bars_only:
        for path in args.notebooks:
            notebook = nbformat.read(path, as_version=4)
            count = progress_bars_as_text(notebook)
            nbformat.write(notebook, path)
            print(f"{path}: {count} progress bars stored as text")
        return 0
    if os.environ.get("KERNEL_COURSE_SIZES", "full") != "full":  # the book stores full runs only
        parser.error("KERNEL_COURSE_SIZES is set: the stored outputs must come from the full sizes (unset it)")
    env = environment()
    print(f"executing on {env['device']} with torch {env['torch']}, triton {env['triton']}")
    for path in args.notebooks:
        print(f"{path} ...", flush=True)
        print(f"{path}: done in {execute(path, args.timeout, args.failed_to):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
