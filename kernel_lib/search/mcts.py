"""The search loop: select, expand, evaluate in parallel, backpropagate, persist; and ``optimize``, its Python API.

One iteration (graph.py has the policy):

1. **select** a path from the root and an untried action at its end;
2. **expand**: apply the action (a rule move, or ask the language model for that canonical move). A variant that
   already exists is a transposition: its known value is backed up, nothing is evaluated;
3. **evaluate** a new variant in a free worker (worker.py): correctness first, then timing, then checks again;
4. **backpropagate** the reward along the path; the incumbent is the fastest correct variant so far.

While workers are busy the loop selects again (in-flight nodes cannot be stepped on), so ``--gpus 0,1`` keeps two
evaluations going. With several workers, an evaluation whose worker process died (``kill -9``, a lost GPU) is
retried once on another worker (event ``retried``) instead of counting as the variant's crash; and when the budget
is spent, the three fastest correct variants are timed again one after another on worker 0 (event ``retimed``,
a table in trace.md), and the fastest of those re-timings is the winner: timings taken on different GPUs, or while
another worker loaded the machine, do not pick it.

Every step is an event in ``events.jsonl`` before the state is replaced (store.py), so a killed
run resumes where it stopped. The budget counts finished evaluations, the baseline included.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import graph as graph_mod
from . import prior as prior_mod
from .graph import FAIL_REWARD, Graph
from .moves import CANONICAL_MOVES, rule_actions
from .pool import TableEvaluator, WorkerPool, devices_for
from .spec import KernelSpec, load_spec, parse_spec
from .store import RunStore
from .variant import Variant

LLM_PRIOR_SHARE = 0.5  # a language-model action starts at half the prior of its move's rule actions
# With a language model configured, at least this share of the expansions asks it (where the walk finds one of its
# actions untried): PUCT alone may never reach actions that start at half the prior. Trace: "language model, ...".
LLM_MIN_SHARE = 0.25
LLM_MAX_UNANSWERED = 3  # requests in a row the endpoint fails (no reply at all) before the run stops asking


# Said wherever a CPU run reports times: the interpreter checks correctness and exercises the search, nothing more.
INTERPRETED_TIMES = (
    "Timed under Triton's interpreter on a CPU: the search checked every variant's correctness, but these times and "
    "speed-ups say nothing about a GPU."
)


@dataclass
class Settings:
    budget: int = 50  # finished evaluations, the baseline included
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    timeout: float = 300.0  # seconds per evaluation, compile included
    seed: int = 0
    min_pred_gain: float = 0.02  # skip actions whose mean gain elsewhere in this run is below this (log units)
    ncu_every: int = 0  # profile every N-th evaluated node with Nsight Compute (0: never)
    small: bool = False  # the spec's small_sizes (the CPU interpreter)
    warmup_ms: float = 10.0
    rep_ms: float = 50.0
    progress: bool = True


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


class Search:
    def __init__(self, spec: KernelSpec, outdir: str, settings: Settings, llm=None, evaluator=None, resume=False):
        self.spec, self.settings, self.llm = spec, settings, llm
        self.store = RunStore(outdir, spec.name)
        if self.store.exists() and not resume:
            raise FileExistsError(f"{self.store.root} holds a run already: pass --resume, or another --outdir")
        self.store.create()
        self.spec_path = self._write_spec()
        self.evaluator = evaluator or WorkerPool(settings.devices, self.store.root / "workers", settings.timeout)
        self.graph = Graph(settings.seed)
        self.variants: dict[str, Variant] = {}
        self.pending: dict[str, dict] = {}  # node id -> {"path", "parent", "key", "move"}
        self.evaluations = 0
        self.last_seq = -1
        self.baseline_id: str | None = None
        self.baseline_ms: float | None = None
        self.bottleneck: str | None = None
        self.tactics = prior_mod.TacticGraph.load(self.store.tactics_path)
        self.move_priors = prior_mod.move_priors(None, self.tactics)  # what earlier kernels taught, pooled
        self.baseline_source = spec.source_text()
        self.notes: list[str] = []
        self._bar = None
        self.retry: list[tuple[str, int | None]] = []  # (node id, worker whose process died) to submit again
        self.retried: set[str] = set()  # node ids retried once already
        self.winner: dict | None = None  # after re-timing: {"id", "ms", "device"}
        # expansions so far, those that asked the language model, its failed requests in a row, and whether it
        # still gets asked (off after LLM_MAX_UNANSWERED requests in a row went unanswered)
        self.llm_use = {"expansions": 0, "asked": 0, "unanswered_in_a_row": 0, "off": None}

    # ---------------------------------------------------------------- files
    def _write_spec(self) -> str:
        """spec.json in the run folder, source inlined and paths absolute: workers read this one."""
        data = self.spec.model_dump(exclude_none=True)
        data.pop("source_path", None)
        data["source"] = self.spec.source_text()
        if self.spec.path is not None:  # the reference's module may sit beside the spec, not beside this copy
            folder = self.spec.reference.search_path or os.path.dirname(self.spec.path)
            data["reference"]["search_path"] = self.spec.resolve(folder)
        for t in data["inputs"]:
            if t.get("file"):
                t["file"] = self.spec.resolve(t["file"])
        path = self.store.root / "spec.json"
        from .store import write_json

        write_json(path, data)
        return str(path)

    def _variant(self, node_id: str) -> Variant:
        if node_id not in self.variants:  # after a resume: read back from the variant's folder
            baseline = node_id == self.baseline_id
            folder = self.store.variant_dir(node_id, baseline)
            control = json.loads((folder / "control.json").read_text())
            source = (folder / self.store.source_name(self.spec.kind)).read_text()
            self.variants[node_id] = Variant.make(source, control["launch"])
        return self.variants[node_id]

    def _control(self) -> dict:
        s = self.settings
        return {
            "spec": self.spec_path, "device": "?", "small": s.small, "seed": s.seed * 2 + 100,
            "fresh_seed": s.seed * 2 + 101, "warmup_ms": s.warmup_ms, "rep_ms": s.rep_ms,
        }  # fmt: skip

    def _prepare(self, variant: Variant, baseline: bool = False) -> str:
        """The variant's folder and control file; written before any event names the variant."""
        control = self._control()
        control["device"] = self.evaluator.device()
        path = self.store.write_variant(variant, self.spec.kind, control, self.baseline_source, baseline)
        self.store.clear_result(variant.id, baseline)
        return path

    def _submit(self, variant: Variant, baseline: bool = False, avoid: int | None = None) -> None:
        if avoid is None:
            self.evaluator.submit(self._prepare(variant, baseline), variant.id)
            return
        control = self._control() | {"device": self.evaluator.device(avoid=avoid)}
        path = self.store.write_variant(variant, self.spec.kind, control, self.baseline_source, baseline)
        self.store.clear_result(variant.id, baseline)
        self.evaluator.submit(path, variant.id, avoid=avoid)

    def _workers(self) -> int:
        """Real worker processes (0 for a table of measurements: nothing to retry or re-time)."""
        return len(self.evaluator.slots) if isinstance(self.evaluator, WorkerPool) else 0

    # ---------------------------------------------------------------- state
    def _state(self) -> dict:
        inc = self.graph.incumbent()
        return {
            "spec": self.spec.name,
            "saved": _now(),
            "budget": self.settings.budget,
            "evaluations": self.evaluations,
            "last_seq": self.last_seq,
            "baseline": {"id": self.baseline_id, "ms": self.baseline_ms},
            "incumbent": None if inc is None else {"id": inc.id, "ms": inc.ms, "reward": inc.reward},
            "winner": self.winner,
            "bottleneck": self.bottleneck,
            "move_priors": self.move_priors,
            "llm_use": self.llm_use,
            "pending": self.pending,
            "graph": self.graph.to_dict(),
        }

    def _save(self) -> None:
        self.store.save_state(self._state())

    def _event(self, kind: str, **fields) -> dict:
        event = self.store.append_event(kind, **fields)
        self.last_seq = event["seq"]
        return event

    # ---------------------------------------------------------------- actions
    def _offer_actions(self, node_id: str) -> None:
        node = self.graph.nodes[node_id]
        if node.expanded:
            return
        actions = rule_actions(self._variant(node_id), self.spec)
        per_move: dict[str, int] = {}
        for a in actions:
            per_move[a.move] = per_move.get(a.move, 0) + 1
        split = lambda move: per_move[move] ** graph_mod.PRIOR_SPLIT  # noqa: E731
        offered = [(a.move, a.label, self.move_priors[a.move] / split(a.move), features(a.child)) for a in actions]
        if self.llm is not None:
            offered += [(m, "llm", LLM_PRIOR_SHARE * self.move_priors[m], []) for m in CANONICAL_MOVES]
        self.graph.set_edges(node, offered)

    def _pruned(self, edge) -> bool:
        count = self.graph.action_gain.get(edge.key, (0, 0.0))[0]
        return count >= 2 and self.graph.gain(edge.key) < self.settings.min_pred_gain * count / (count + 1)

    def _expand(self, parent_id: str, edge) -> tuple[Variant | None, str]:
        """The child an edge leads to (None: the expansion failed, recorded) and the move it is credited to."""
        parent = self._variant(parent_id)
        if edge.label != "llm":
            for a in rule_actions(parent, self.spec):
                if a.key == edge.key:
                    return a.child, edge.move
            edge.failed = "the rule no longer applies"
            return None, edge.move
        measurements = self._measurements()
        proposal = self.llm.propose(edge.move, parent, self.spec, measurements)
        self.llm_use["asked"] += 1
        self.llm_use["unanswered_in_a_row"] = self.llm_use["unanswered_in_a_row"] + 1 if proposal.unanswered else 0
        if self.llm_use["unanswered_in_a_row"] >= LLM_MAX_UNANSWERED and not self.llm_use["off"]:
            self.llm_use["off"] = proposal.error
            why = (f"the language model's endpoint failed {LLM_MAX_UNANSWERED} requests in a row (last: "
                   f"{proposal.error}): no more requests in this run")  # fmt: skip
            self._event("llm_off", reason=why)
            self.store.trace(f"- **{why}**")
            print(f"{self.spec.name}: {why}", file=sys.stderr)
        if proposal.error or proposal.source is None:
            edge.failed = proposal.error or "no source"
            self._event("expansion_failed", parent=parent_id, key=edge.key, reason=edge.failed)
            self.store.trace(f"- language model, `{edge.move}` at `{parent_id}`: failed ({edge.failed})")
            return None, edge.move
        return parent.with_source(proposal.source), proposal.move or edge.move  # credited to the move it names

    def _measurements(self) -> list[dict]:
        """The latest evaluations, with the move that produced each, for the language model's prompt."""
        rows = [
            {"id": e["id"], "move": e.get("key", "baseline"), "status": e.get("status", "ok"), "ms": e.get("ms")}
            for e in self.store.events()
            if e["type"] in ("baseline", "evaluated")
        ]
        return rows[-8:]

    # ---------------------------------------------------------------- the loop
    def _llm_owed(self) -> bool:
        """Whether the next expansion should ask the language model: configured, still asked, below its share."""
        use = self.llm_use
        return self.llm is not None and not use["off"] and use["asked"] < LLM_MIN_SHARE * (use["expansions"] + 1)

    def _skipped(self, edge) -> bool:
        """Untried edges the walk does not expand now: pruned ones; the language model's once it is off; the rule
        moves' while the language model is owed its share."""
        if edge.label == "llm" and self.llm_use["off"]:
            return True
        return self._pruned(edge) or (self._llm_owed() and edge.label != "llm")

    def _dispatch(self) -> bool:
        """Select and expand until one new variant is submitted; False when nothing is left to expand now."""
        while True:
            path, edge = self.graph.select(set(self.pending), self._skipped)
            if edge is None:
                return False
            if edge.label == "llm" and self.llm_use["off"]:  # only reached when nothing else is left
                edge.failed = "the language model is no longer asked in this run"
                continue
            self.llm_use["expansions"] += 1
            parent_id = path[-1]
            child, move = self._expand(parent_id, edge)
            if child is None:
                self._save()
                continue
            node, new = self.graph.add_node(child.id, parent_id, self.graph.nodes[parent_id].depth + 1)
            edge.child = child.id
            if not new:
                self._event("transposition", parent=parent_id, key=edge.key, child=child.id)
                if node.reward is not None and child.id not in path:
                    self.graph.backpropagate(path, node.reward)
                self._save()
                continue
            self.variants[child.id] = child
            control = self._prepare(child)
            node.status = "pending"
            self.pending[child.id] = {"path": path, "parent": parent_id, "key": edge.key, "move": move}
            self._event("dispatched", id=child.id, parent=parent_id, key=edge.key, path=path)
            self._save()
            self.evaluator.submit(control, child.id)
            return True

    def _reward(self, result: dict) -> float:
        if result["status"] != "ok" or not result.get("ms"):
            return FAIL_REWARD
        return math.log(self.baseline_ms / max(result["ms"], 1e-9))

    def _finish(self, node_id: str, result: dict, replay: bool = False) -> None:
        info = self.pending.pop(node_id)
        reward = self._reward(result)
        if not replay:
            self._event(
                "evaluated", id=node_id, parent=info["parent"], key=info["key"], move=info["move"],
                path=info["path"], status=result["status"], reason=result.get("reason", "")[:2000],
                ms=result.get("ms"), reward=reward, device=result.get("device"), seconds=result.get("seconds"),
            )  # fmt: skip
        self._apply(node_id, info, result, reward)
        self._save()

    def _apply(self, node_id: str, info: dict, result: dict, reward: float) -> None:
        before = self.graph.incumbent()
        self.evaluations += 1
        ok = result["status"] == "ok"
        feats = features(self._variant(node_id))
        self.graph.record(node_id, reward, result["status"], result.get("ms"), info["parent"], info["key"], feats)
        self.graph.backpropagate(info["path"] + [node_id], reward)
        parent = self.graph.nodes[info["parent"]]
        gain = reward - parent.reward if ok and parent.reward is not None else None
        if self.bottleneck is not None:  # the tactic graph learns per bottleneck; unprofiled runs teach it nothing
            self.tactics.record(self.bottleneck, info["move"], gain)
            self.tactics.save(self.store.tactics_path)  # a kill loses nothing it learned
        if ok:
            self._offer_actions(node_id)
        after = self.graph.incumbent()
        if after is not None and (before is None or after.id != before.id):
            self.store.set_best(after.id, after.id == self.baseline_id)
        self._trace_evaluation(node_id, info, result, reward, after)
        if self._bar is not None:
            self._bar.update(1)
            if after is not None:
                self._bar.set_postfix_str(f"best {self.baseline_ms / after.ms:.2f}x")

    def _trace_evaluation(self, node_id, info, result, reward, incumbent) -> None:
        moves = " -> ".join(f"`{p[:6]}`" for p in self.graph.lineage(info["parent"]))  # how it was derived
        if result["status"] == "ok":
            what = f"**{result['ms']:.4g} ms** ({self.baseline_ms / result['ms']:.2f}x the baseline)"
        else:
            reason = (result.get("reason") or "").splitlines()
            what = f"**{result['status']}**: {reason[0][:200] if reason else ''}"
        inc = f"`{incumbent.id}` at {self.baseline_ms / incumbent.ms:.2f}x" if incumbent else "none"
        self.store.trace(
            f"{self.evaluations}. path {moves}, move `{info['key']}` -> `{node_id}`: {what}; incumbent {inc}"
        )

    def _baseline(self) -> None:
        root = Variant.baseline(self.spec)
        self.variants[root.id] = root
        self.baseline_id = root.id
        result = self.store.read_result(root.id, baseline=True)
        if result is not None and result.get("id") != root.id:
            result = None  # a result of another baseline: evaluate this one
        if result is None:
            self._submit(root, baseline=True)
            [(_, result)] = self.evaluator.wait()
        if result["status"] != "ok":
            raise RuntimeError(
                f"{self.spec.name}: the baseline fails ({result['status']}): {result.get('reason', '')}\n"
                f"see {self.store.variant_dir(root.id, True)}"
            )
        self.baseline_ms = result["ms"]
        if not any(e["type"] == "baseline" and e["id"] == root.id for e in self.store.events()):
            self._event("baseline", id=root.id, ms=result["ms"], device=result.get("device"), result=result)
        self.graph.add_node(root.id, None, 0)
        self.graph.record(root.id, 0.0, "ok", result["ms"], None, None, features(root))
        self.graph.backpropagate([root.id], 0.0)
        self.evaluations = 1
        self.store.set_best(root.id, baseline=True)
        self.store.trace(
            f"# Search: {self.spec.name}\n\nBaseline `{root.id}`: {result['ms']:.4g} ms on {result.get('device')}.\n"
            + (f"\n**{INTERPRETED_TIMES}**\n" if result.get("device") == "cpu" else "")
        )
        self._profile(root.id, baseline=True)
        self._offer_actions(root.id)
        self._save()

    def _profile(self, node_id: str, baseline: bool = False) -> None:
        """Nsight Compute on this node: classify its bottleneck and set the move priors from it."""
        s = self.settings
        if s.ncu_every <= 0 or not any(d.startswith("cuda") for d in s.devices):
            return
        ok, why = prior_mod.ncu_available()
        if not ok:
            self._note(f"Nsight Compute: {why}; priors stay uniform")
            return
        folder = self.store.variant_dir(node_id, baseline)
        control, report = str(folder / "control.json"), str(folder / "ncu.csv")
        import torch

        metrics_asked = prior_mod.ncu_metrics(torch.cuda.get_device_capability())  # no Hopper-only metric elsewhere
        cmd = prior_mod.ncu_command(sys.executable, control, report, self.spec.entry, metrics=metrics_asked)
        metrics = prior_mod.run_ncu(cmd, timeout=max(120.0, s.timeout))
        if isinstance(metrics, str):
            self._note(f"Nsight Compute: {metrics}; priors stay uniform")
            return
        try:
            bottleneck = prior_mod.classify(metrics)
        except ValueError as exc:
            self._note(f"Nsight Compute: {exc}; priors stay uniform")
            return
        self.bottleneck = bottleneck
        self.move_priors = prior_mod.move_priors(bottleneck, self.tactics)
        wanted = {m.split(".")[0] for m in prior_mod.METRICS}  # ncu's raw page adds device attributes: drop them
        metrics = {k: v for k, v in metrics.items() if k.split(".")[0] in wanted}
        self._event("profile", id=node_id, bottleneck=bottleneck, metrics=metrics, priors=self.move_priors)
        top = sorted(self.move_priors.items(), key=lambda kv: -kv[1])[:4]
        self.store.trace(
            f"- Nsight Compute on `{node_id}`: **{bottleneck}**-bound; priors now favour "
            + ", ".join(f"`{m}` {p:.2f}" for m, p in top)
        )

    def _note(self, text: str) -> None:
        if text not in self.notes:  # said once, not an error
            self.notes.append(text)
            print(f"kernel_lib.search: {text}", file=sys.stderr)
            self.store.trace(f"- note: {text}")

    # ---------------------------------------------------------------- resume
    def _resume(self) -> None:
        state = self.store.load_state()
        events = self.store.events()
        base = next((e for e in events if e["type"] == "baseline"), None)
        if base is not None and base["id"] != Variant.baseline(self.spec).id:
            raise RuntimeError(
                f"{self.store.root} was searched from another baseline (source or launch changed since): "
                "resume it with the spec it ran, or start in another --outdir"
            )
        if state is None or base is None:
            return  # killed before the first state: the baseline runs (or its result.json is adopted)
        self.graph = Graph.from_dict(state["graph"], self.settings.seed)
        self.pending = state["pending"]
        self.baseline_id, self.baseline_ms = base["id"], base["ms"]
        self.bottleneck, self.move_priors = state.get("bottleneck"), state["move_priors"]
        self.llm_use = state.get("llm_use", self.llm_use)
        self.evaluations = state["evaluations"]
        self.last_seq = state["last_seq"]
        for e in events:
            if e["seq"] <= state["last_seq"]:
                continue
            if e["type"] == "evaluated" and e["id"] in self.pending:  # written, but the state was not
                self._finish(e["id"], {"status": e["status"], "ms": e["ms"], "reason": e["reason"]}, replay=True)
            self.last_seq = e["seq"]
        for node_id in list(self.pending):  # finished by a worker after the last event: adopt it
            result = self.store.read_result(node_id)
            if result is not None:
                self._finish(node_id, result)
        self._event("resumed", evaluations=self.evaluations, pending=list(self.pending))
        self.store.trace(f"\n*Resumed at {_now()}: {self.evaluations} evaluations done, {len(self.pending)} re-run.*\n")

    # ---------------------------------------------------------------- several workers
    def _retry(self, node_id: str, result: dict) -> None:
        """The worker died under this evaluation: run it once more, on another worker; it stays pending."""
        self.retried.add(node_id)
        worker = result.get("worker")
        self._event("retried", id=node_id, worker=worker, device=result.get("device"), reason=result.get("reason"))
        self.store.trace(f"- `{node_id}`: {result.get('reason')} on worker {worker}; retried once on another worker")
        self.retry.append((node_id, worker))

    def _retime(self, top: int = 3) -> None:
        """Time the ``top`` fastest correct variants again, one after another on worker 0, and name the fastest
        of those re-timings the winner (``state["winner"]``, the ``best`` folder). Each re-timing is a full
        evaluation (correctness too) into the variant's ``retime.json``; it does not count against the budget."""
        ranked = sorted((n for n in self.graph.nodes.values() if n.status == "ok" and n.ms), key=lambda n: n.ms)
        if len(ranked) < 2:
            return
        where = {e["id"]: e.get("device") for e in self.store.events() if e["type"] in ("baseline", "evaluated")}
        rows = []
        for node in ranked[:top]:
            baseline = node.id == self.baseline_id
            folder = self.store.variant_dir(node.id, baseline)
            control = json.loads((folder / "control.json").read_text())
            control |= {"device": self.evaluator.device(worker=0), "result": str(folder / "retime.json")}
            path = folder / "control-retime.json"
            path.write_text(json.dumps(control, indent=1) + "\n")
            self.evaluator.submit(str(path), node.id, worker=0)
            [(_, result)] = self.evaluator.wait()
            rows.append({
                "id": node.id, "search_ms": node.ms, "search_device": where.get(node.id),
                "status": result["status"], "retimed_ms": result.get("ms") if result["status"] == "ok" else None,
            })  # fmt: skip
        timed = [r for r in rows if r["retimed_ms"]]
        if not timed:
            return
        best = min(timed, key=lambda r: r["retimed_ms"])
        device = control["device"]
        self.winner = {"id": best["id"], "ms": best["retimed_ms"], "device": device}
        self._event("retimed", device=device, rows=rows, winner=best["id"])
        self.store.set_best(best["id"], best["id"] == self.baseline_id)
        lines = [
            f"\nRe-timed on worker 0 ({device}), one after another:\n",
            "| variant | search ms (device) | re-timed ms |",
            "|---|---|---|",
        ]
        for r in rows:
            again = f"{r['retimed_ms']:.4g}" if r["retimed_ms"] else r["status"]
            lines.append(f"| `{r['id']}` | {r['search_ms']:.4g} ({r['search_device']}) | {again} |")
        lines.append(f"\nWinner: `{best['id']}`, {best['retimed_ms']:.4g} ms.")
        self.store.trace("\n".join(lines))
        self._save()

    # ---------------------------------------------------------------- run
    def run(self) -> SearchResult:
        self.store.append_run(
            {"started": _now(), "settings": {**self.settings.__dict__}, "llm": getattr(self.llm, "model", None),
             "python": platform.python_version(), "host": platform.node(), **_versions()}
        )  # fmt: skip
        self._resume()
        if self.baseline_id is None or self.baseline_ms is None:
            self._baseline()
        redo = list(self.pending)  # in flight when the last run stopped: they never finished, so they run now
        budget = self.settings.budget
        self._bar = _progress(self.settings.progress, budget, self.evaluations, self.spec.name)
        try:
            exhausted = False
            while self.evaluations < budget:
                # pending, not the pool's busy count: a worker frees its slot just before its result is taken
                for node_id, avoid in list(self.retry):  # counted in pending already: not against the budget
                    if self.evaluator.free(avoid=avoid):
                        self.retry.remove((node_id, avoid))
                        self._submit(self._variant(node_id), avoid=avoid)
                while self.evaluator.free() and self.evaluations + len(self.pending) - len(redo) < budget:
                    if redo:
                        node_id = redo.pop(0)
                        self._submit(self._variant(node_id))
                    elif exhausted or not self._dispatch():
                        exhausted = True
                        break
                if not self.pending:
                    break  # the reachable graph is fully explored
                for node_id, result in self.evaluator.wait():
                    if result.get("died") and node_id not in self.retried and self._workers() > 1:
                        self._retry(node_id, result)
                        continue
                    self._finish(node_id, result)
                    n = self.evaluations
                    if self.settings.ncu_every and n % self.settings.ncu_every == 0 and result["status"] == "ok":
                        self._profile(node_id)
                exhausted = False
            if self._workers() > 1:
                self._retime()
        finally:
            if self._bar is not None:
                self._bar.close()
            self.evaluator.close()
            self.tactics.save(self.store.tactics_path)
        inc = self.graph.incumbent()
        best_id, best_ms = (self.winner["id"], self.winner["ms"]) if self.winner else (inc.id, inc.ms)
        self._event("finished", evaluations=self.evaluations, incumbent=inc.id if inc else None, winner=best_id)
        self._save()
        self.store.trace(
            f"\nFinished {_now()}: {self.evaluations} evaluations; best `{best_id}` "
            f"{best_ms:.4g} ms, {self.baseline_ms / best_ms:.2f}x the baseline.\n"
        )
        return SearchResult.load(self.store.root)


def features(v: Variant) -> list[str]:
    """What the surrogate model sees of a variant: each knob's value, and which source text it runs."""
    knobs = [f"{k}={val}" for k, val in sorted(v.knobs().items())]
    return knobs + ["source=" + hashlib.sha256(v.source.encode()).hexdigest()[:8]]


def _versions() -> dict:
    import torch

    out = {"torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def _progress(show: bool, total: int, done: int, name: str):
    if not show:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=done, desc=f"search {name}", unit="eval")


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------
@dataclass
class SearchResult:
    """What a run found: the incumbent, its speedup, and every evaluation (``to_dataframe``)."""

    name: str
    folder: str
    baseline_ms: float
    best_id: str
    best_ms: float
    events: list[dict] = field(repr=False, default_factory=list)

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.best_ms

    @property
    def interpreted(self) -> bool:
        """True when the baseline ran on a CPU, under Triton's interpreter: its times say nothing about a GPU."""
        return any(e["type"] == "baseline" and e.get("device") == "cpu" for e in self.events)

    @property
    def trace_path(self) -> str:
        return os.path.join(self.folder, "trace.md")

    @property
    def best_folder(self) -> str:
        return os.path.join(self.folder, "best")

    @staticmethod
    def load(folder: str | os.PathLike) -> SearchResult:
        store = RunStore(Path(folder).parent.parent, Path(folder).name)
        events = store.events()
        base = next(e for e in events if e["type"] == "baseline")
        state = store.load_state() or {}
        inc = state.get("winner") or state.get("incumbent") or {"id": base["id"], "ms": base["ms"]}
        return SearchResult(Path(folder).name, str(folder), base["ms"], inc["id"], inc["ms"], events)

    def to_dataframe(self):
        """One row per finished evaluation, in order: move, status, ms, speedup, best so far."""
        import pandas as pd

        rows, best = [], math.inf
        for e in self.events:
            if e["type"] not in ("baseline", "evaluated"):
                continue
            ms = e.get("ms") if e["type"] == "baseline" or e.get("status") == "ok" else None
            if ms:
                best = min(best, ms)
            rows.append({
                "evaluation": len(rows) + 1, "id": e["id"], "move": e.get("key", "baseline"),
                "status": e.get("status", "ok"), "ms": ms, "speedup": self.baseline_ms / ms if ms else None,
                "best_speedup": self.baseline_ms / best, "reason": (e.get("reason") or "")[:120],
            })  # fmt: skip
        return pd.DataFrame(rows)

    def _repr_html_(self) -> str:
        head = (
            f"<p><b>{self.name}</b>: best <code>{self.best_id}</code> {self.best_ms:.4g} ms, "
            f"<b>{self.speedup:.2f}x</b> the baseline ({self.baseline_ms:.4g} ms) in "
            f"{sum(e['type'] in ('baseline', 'evaluated') for e in self.events)} evaluations; "
            f"files in <code>{self.folder}</code></p>"
        )
        if self.interpreted:
            head += f"<p><b>{INTERPRETED_TIMES}</b></p>"
        return head + self.to_dataframe().to_html(index=False, float_format=lambda x: f"{x:.4g}")


# --------------------------------------------------------------------------------------------------
# Python API
# --------------------------------------------------------------------------------------------------
def as_spec(spec: Any) -> KernelSpec:
    if isinstance(spec, KernelSpec):
        return spec
    if isinstance(spec, dict):
        return parse_spec(spec)
    return load_spec(spec)


def optimize(
    spec: Any,
    budget: int = 50,
    gpus: list[int] | None = None,
    llm: Any = None,
    progress: bool = True,
    outdir: str = "out",
    resume: bool = False,
    table: dict[str, dict] | None = None,
    **settings: Any,
) -> SearchResult:
    """Search variants of one kernel (a spec path, dict or KernelSpec); return the result (``SearchResult``).

    ``gpus``: device indices, one worker each (default ``[0]``; on a machine without a GPU, CPU workers under
    Triton's interpreter, with the spec's ``small_sizes``). ``llm``: an ``llm.LLMClient`` or None (rule moves only).
    ``table``: answer evaluations from measured rows instead of running them (strategy comparisons).
    Other keywords: the fields of ``Settings`` (timeout, seed, min_pred_gain, ncu_every, warmup_ms, rep_ms).
    """
    spec = as_spec(spec)
    devices = devices_for(gpus or [0])
    small = settings.pop("small", None)
    if small is None:
        small = devices[0] == "cpu"
    config = Settings(budget=budget, devices=devices, progress=progress, small=small, **settings)
    evaluator = TableEvaluator(table, parallel=len(devices)) if table is not None else None
    return Search(spec, outdir, config, llm=llm, evaluator=evaluator, resume=resume).run()
