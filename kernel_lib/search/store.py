"""What a run leaves on disk: everything a person reads, and everything ``--resume`` needs.

::

    out/global_tactic_graph.json      which moves paid off on which bottleneck, across kernels (prior.TacticGraph)
    out/kernels/<name>/
        spec.json                     the spec as run (sources resolved), so the folder stands alone
        baseline/                     run.json (settings and environment of each start or resume, a list),
                                      control.json, result.json, kernel_module.py | kernel.cu (+ .ptx, .sass), logs
        variants/<id>/                control.json, result.json, kernel_module.py | kernel.cu, candidate.diff, logs;
                                      with --ncu-every also ncu.csv (Nsight Compute's raw page) and
                                      profile_control.json / profile_result.json (the profiled launch)
        best -> variants/<id>         the incumbent: the fastest correct variant so far
        search_state.json             the whole graph (nodes, edges, N, Q, incumbent); replaced atomically
        events.jsonl                  one JSON object per line, appended and flushed (fsync) as it happens
        trace.md                      the narrative: each selection path, the candidate, its measurement
        workers/worker-<i>.log        what a worker process printed outside evaluations

Order of writes for one finished evaluation: result.json (by the worker), then the event line, then the state.
A ``kill -9`` between any two leaves a folder that ``--resume`` completes: an event the state lacks is replayed,
a result.json without an event is adopted, and an evaluation in flight is run again (it had not finished).
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .variant import Variant


def replace_atomically(path: str | os.PathLike, write: Callable[[IO], object], binary: bool = False,
                       durable: bool = False) -> None:  # fmt: skip
    """Write ``path`` through a temporary file in its folder, then ``os.replace``: a reader sees the old file or the
    new one, never half of one, and a crash leaves the old one. ``durable``: on disk (fsync) before the rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; these files are for people to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, data: Any, durable: bool = False) -> None:
    """``data`` as indented JSON, written atomically (:func:`replace_atomically`)."""

    def dump(f) -> None:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")

    replace_atomically(path, dump, durable=durable)


class RunStore:
    def __init__(self, outdir: str | os.PathLike, name: str):
        self.outdir = Path(outdir)
        self.root = self.outdir / "kernels" / name
        self.events_path = self.root / "events.jsonl"
        self.state_path = self.root / "search_state.json"
        self.trace_path = self.root / "trace.md"
        self.tactics_path = self.outdir / "global_tactic_graph.json"
        self._seq = None

    # ---------------------------------------------------------------- folders
    def exists(self) -> bool:
        return self.state_path.exists() or self.events_path.exists()

    def create(self) -> None:
        (self.root / "variants").mkdir(parents=True, exist_ok=True)
        (self.root / "workers").mkdir(exist_ok=True)

    def variant_dir(self, node_id: str, baseline: bool = False) -> Path:
        return self.root / "baseline" if baseline else self.root / "variants" / node_id

    def source_name(self, kind: str) -> str:
        return "kernel.cu" if kind == "cuda" else "kernel_module.py"

    def write_variant(self, variant: Variant, kind: str, control: dict, baseline_source: str, baseline=False) -> str:
        """The variant's folder: its source, the diff from the baseline, and the control file a worker reads."""
        folder = self.variant_dir(variant.id, baseline)
        folder.mkdir(parents=True, exist_ok=True)
        source_path = folder / self.source_name(kind)
        source_path.write_text(variant.source)
        name = self.source_name(kind)
        diff = difflib.unified_diff(
            baseline_source.splitlines(keepends=True),
            variant.source.splitlines(keepends=True),
            f"baseline/{name}",
            f"variants/{variant.id}/{name}",
        )
        launch_lines = json.dumps(variant.launch, indent=2, sort_keys=True)
        (folder / "candidate.diff").write_text("".join(diff) + "\n# launch configuration\n" + launch_lines + "\n")
        control = {**control, "id": variant.id, "kernel_file": str(source_path), "launch": variant.launch}
        control["result"] = str(folder / "result.json")
        write_json(folder / "control.json", control)
        return str(folder / "control.json")

    def read_result(self, node_id: str, baseline: bool = False) -> dict | None:
        path = self.variant_dir(node_id, baseline) / "result.json"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def clear_result(self, node_id: str, baseline: bool = False) -> None:
        path = self.variant_dir(node_id, baseline) / "result.json"
        path.unlink(missing_ok=True)

    def set_best(self, node_id: str, baseline: bool = False) -> None:
        """Point ``best`` at the incumbent's folder (a relative symlink, swapped atomically)."""
        target = "baseline" if baseline else f"variants/{node_id}"
        tmp = self.root / f".best-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        try:
            os.symlink(target, tmp)
            os.replace(tmp, self.root / "best")
        except OSError:  # a file system without symlinks: a text file naming the folder
            (self.root / "best.txt").write_text(target + "\n")

    # ---------------------------------------------------------------- events
    def events(self) -> list[dict]:
        """Every event written so far; a last line cut short by a kill is dropped."""
        if not self.events_path.exists():
            return []
        out = []
        for line in self.events_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return out

    def append_event(self, kind: str, **fields: Any) -> dict:
        if self._seq is None:
            events = self.events()
            self._seq = events[-1]["seq"] + 1 if events else 0
            self._repair_tail()
        event = {"seq": self._seq, "time": round(time.time(), 3), "type": kind, **fields}
        with open(self.events_path, "a") as f:
            f.write(json.dumps(event, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._seq += 1
        return event

    def _repair_tail(self) -> None:
        """Cut a half-written last line (a kill during the write) so the next event starts on a line of its own."""
        if not self.events_path.exists():
            return
        data = self.events_path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data[: data.rfind(b"\n") + 1]
            with open(self.events_path, "wb") as f:
                f.write(keep)
                f.flush()
                os.fsync(f.fileno())

    # ---------------------------------------------------------------- state and narrative
    def save_state(self, state: dict) -> None:
        write_json(self.state_path, state)

    def load_state(self) -> dict | None:
        try:
            return json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.state_path}: not valid JSON ({exc.msg}); it is written atomically") from None

    def trace(self, text: str) -> None:
        with open(self.trace_path, "a") as f:
            f.write(text.rstrip("\n") + "\n")
            f.flush()

    def append_run(self, info: dict) -> None:
        (self.root / "baseline").mkdir(parents=True, exist_ok=True)
        path = self.root / "baseline" / "run.json"
        runs = json.loads(path.read_text()) if path.exists() else []
        write_json(path, runs + [info])
