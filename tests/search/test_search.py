"""The search end to end: bad variants from a language model never become the incumbent and the run goes on; two
workers evaluate in parallel; a run killed with ``kill -9`` at random moments and resumed loses nothing and
evaluates nothing twice; the budget holds; transpositions are evaluated once.

The runs here are on the CPU (Triton's interpreter, the specs' small sizes). Runs answered from a table of
measurements (pool.TableEvaluator) take milliseconds, so every moment between two writes of a run can be tried."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kernel_lib.search.graph import FAIL_REWARD
from kernel_lib.search.llm import LLMClient
from kernel_lib.search.mcts import Search, Settings
from kernel_lib.search.moves import reachable
from kernel_lib.search.pool import TableEvaluator, WorkerPool
from kernel_lib.search.spec import load_spec
from kernel_lib.search.store import RunStore
from kernel_lib.search.variant import Variant
from tests.search import _tiny_kernel as tiny

ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda:0" if HAS_CUDA else "cpu"
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="CPU workers under the interpreter (--gpus 0,1 on one machine)")


def events_of(root: Path) -> list[dict]:
    """Every line of events.jsonl, each of which must parse."""
    return [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]


def finished_ids(events: list[dict]) -> list[str]:
    """The ids of finished evaluations, in order: the baseline, then each evaluated variant."""
    return [e["id"] for e in events if e["type"] in ("baseline", "evaluated")]


def check_nothing_lost(root: Path, budget: int) -> tuple[list[dict], dict]:
    """The invariants of a finished run: each evaluation recorded exactly once, the budget spent and not passed,
    nothing left pending, the state agreeing with the events. Returns (events, state)."""
    events = events_of(root)
    state = json.loads((root / "search_state.json").read_text())
    ids = finished_ids(events)
    twice = sorted({i for i in ids if ids.count(i) > 1})
    assert not twice, f"evaluated twice: {twice}"
    assert len(ids) == budget == state["evaluations"]
    assert [e["type"] for e in events].count("baseline") == 1
    assert events[-1]["type"] == "finished" and state["pending"] == {}
    nodes = state["graph"]["nodes"]
    for e in events:
        if e["type"] == "evaluated":
            assert nodes[e["id"]]["status"] == e["status"]
            assert json.loads((root / "variants" / e["id"] / "result.json").read_text())["status"] == e["status"]
    return events, state


# --------------------------------------------------------------------------------------------------
# The language model's share of the expansions, and a run that stops asking an endpoint that never answers
# --------------------------------------------------------------------------------------------------
def test_a_configured_language_model_is_asked_its_share(endpoint, tmp_path):
    """With rule moves at full prior and the model's actions at half, PUCT alone may never ask the model: a user who
    configured one gets at least LLM_MIN_SHARE of the expansions sent to it, whatever the timings."""
    from kernel_lib.search.mcts import LLM_MIN_SHARE

    endpoint.requests.clear()
    endpoint.replies.clear()
    endpoint.reply = (200, "Nothing to propose.", 0.0)  # an answer naming no move: a failed expansion, not silence
    client = LLMClient("test-model", base_url=endpoint.url, api_key="none", timeout=10.0)
    settings = Settings(budget=6, devices=[DEVICE], timeout=60.0, small=True, warmup_ms=1, rep_ms=5, progress=False)
    Search(load_spec(ROOT / "specs" / "rms_norm.json"), str(tmp_path), settings, llm=client).run()
    state = json.loads((tmp_path / "kernels" / "rms_norm" / "search_state.json").read_text())
    use = state["llm_use"]
    assert use["asked"] == len(endpoint.requests) >= 2 and not use["off"]
    assert use["asked"] >= LLM_MIN_SHARE * use["expansions"] - 1  # its share, give or take the one in progress
    trace = (tmp_path / "kernels" / "rms_norm" / "trace.md").read_text()
    assert trace.count("- language model, ") == use["asked"]  # each request visible in the trace


def test_an_endpoint_that_never_answers_is_given_up_once(endpoint, tmp_path, capfd):
    from kernel_lib.search.mcts import LLM_MAX_UNANSWERED

    endpoint.requests.clear()
    endpoint.replies.clear()
    endpoint.reply = (503, "overloaded", 0.0)
    client = LLMClient("test-model", base_url=endpoint.url, api_key="none", timeout=10.0)
    settings = Settings(budget=4, devices=[DEVICE], timeout=60.0, small=True, warmup_ms=1, rep_ms=5, progress=False)
    Search(tiny.spec(), str(tmp_path), settings, llm=client).run()  # the tiny spec has no rule move: only the model's
    assert len(endpoint.requests) == LLM_MAX_UNANSWERED  # then no more requests
    root = tmp_path / "kernels" / "double_rows"
    events = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events].count("llm_off") == 1
    assert "HTTP 503" in next(e["reason"] for e in events if e["type"] == "llm_off")
    assert capfd.readouterr().err.count("no more requests in this run") == 1  # said once


# --------------------------------------------------------------------------------------------------
# Bad variants from a language model, evaluated by two workers
# --------------------------------------------------------------------------------------------------
def test_bad_variants_from_a_language_model_never_become_the_incumbent(endpoint, tmp_path):
    """The language model's replies are the variants of _tiny_kernel.py, good and bad, as full sources; the tiny
    spec offers no rule move, so the search expands the replies only. Each bad one is evaluated once, fails with its
    status and reason, and the search goes on to its budget; the incumbent is always the baseline or a good one."""
    skip = {"endless_loop", "unbound_argument"}  # a hang is one enough; unbound_argument: test_worker's known bug
    replies = [b for b in tiny.GOOD + tiny.BAD if b.name not in skip and (HAS_CUDA or not b.gpu)]
    endpoint.requests.clear()
    endpoint.replies[:] = [tiny.reply(b) for b in replies]
    endpoint.reply = (200, "Nothing more to try.", 0.0)  # after the replies: expansions fail, nothing is evaluated
    client = LLMClient("test-model", base_url=endpoint.url, api_key="none", timeout=10.0)
    budget = 1 + len(replies)
    # 30 s an evaluation: a worker's first one includes its start (importing torch and triton) and Triton's compile,
    # which took more than 10 s for the side-stream variant on a fresh GPU machine
    settings = Settings(
        budget=budget, devices=[DEVICE, DEVICE], timeout=30.0, small=True, warmup_ms=1, rep_ms=5, progress=False
    )
    result = Search(tiny.spec(), str(tmp_path), settings, llm=client).run()

    root = tmp_path / "kernels" / "double_rows"
    events, state = check_nothing_lost(root, budget)
    named = {}
    for e in events:
        if e["type"] != "evaluated":
            continue
        name = tiny.variant_name((root / "variants" / e["id"] / "kernel_module.py").read_text())
        named[name] = e
        assert e["status"] in tiny.BY_NAME[name].statuses, (name, e["status"], e["reason"])
        if e["status"] != "ok":
            assert e["reason"].strip() and e["reward"] == FAIL_REWARD
    assert sorted(named) == sorted(b.name for b in replies)  # every reply reached, and evaluated once
    assert len(endpoint.requests) >= len(replies)

    bad_ids = {e["id"] for name, e in named.items() if tiny.BY_NAME[name].statuses != ("ok",)}
    good_ids = {e["id"] for e in events if e["type"] == "baseline"} | (set(e["id"] for e in named.values()) - bad_ids)
    assert state["incumbent"]["id"] in good_ids and result.best_id in good_ids
    assert os.readlink(root / "best") in {"baseline"} | {f"variants/{i}" for i in good_ids}
    trace = (root / "trace.md").read_text()
    incumbents = [line.split("incumbent `")[1][:12] for line in trace.splitlines() if "; incumbent `" in line]
    assert len(incumbents) == budget - 1 and not set(incumbents) & bad_ids  # never, at any step


# --------------------------------------------------------------------------------------------------
# Correct variants, two workers in parallel
# --------------------------------------------------------------------------------------------------
@cpu_only
def test_two_workers_evaluate_in_parallel_and_a_correct_variant_leads(tmp_path):
    """rms_norm at its small sizes, budget 8, two CPU workers: both work, their evaluations overlap in time, every
    rule variant is correct (no crash, no failure), and the incumbent is a correct variant."""
    spec = load_spec(ROOT / "specs" / "rms_norm.json")
    settings = Settings(budget=8, devices=["cpu", "cpu"], small=True, warmup_ms=1, rep_ms=5, progress=False)
    result = Search(spec, str(tmp_path), settings).run()
    root = tmp_path / "kernels" / "rms_norm"
    events, state = check_nothing_lost(root, 8)
    assert {e["status"] for e in events if e["type"] == "evaluated"} == {"ok"}
    assert state["graph"]["nodes"][state["incumbent"]["id"]]["status"] == "ok"
    # two workers: the three fastest correct variants timed again on worker 0, the fastest of those the winner
    [retimed] = [e for e in events if e["type"] == "retimed"]
    assert len(retimed["rows"]) == 3 and all(r["status"] == "ok" for r in retimed["rows"])
    fastest = min(retimed["rows"], key=lambda r: r["retimed_ms"])
    assert state["winner"]["id"] == fastest["id"] == retimed["winner"] == result.best_id
    assert result.best_ms == fastest["retimed_ms"] and result.speedup > 0
    assert os.readlink(root / "best").endswith(result.best_id) or result.best_id == finished_ids(events)[0]
    assert "Re-timed on worker 0" in (root / "trace.md").read_text()
    assert (root / "workers" / "worker-0.log").exists() and (root / "workers" / "worker-1.log").exists()
    dispatched = {e["id"]: e["time"] for e in events if e["type"] == "dispatched"}
    spans = sorted((dispatched[e["id"]], e["time"]) for e in events if e["type"] == "evaluated")
    overlapping = sum(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:], strict=False))
    assert overlapping >= 2, spans  # one worker would finish each evaluation before the next is dispatched


# --------------------------------------------------------------------------------------------------
# kill -9 and --resume
# --------------------------------------------------------------------------------------------------
def _finished(events_path: Path) -> int:
    """Finished evaluations so far, read while the run writes (a last line cut short is not counted)."""
    try:
        data = events_path.read_bytes()
    except FileNotFoundError:
        return 0
    return data.count(b'"type": "evaluated"') + data.count(b'"type": "baseline"')


@cpu_only
def test_kill_9_at_random_moments_loses_nothing(tmp_path):
    """One run of rms_norm (budget 24, two workers) killed with SIGKILL at 5 random moments, resumed after each.
    A moment is a random number of finished evaluations (0: a random time into the start, the baseline's) plus a
    random delay, so the kills spread over the run whatever the machine's speed. search_state.json parses after
    every kill; in the end each evaluation is in events.jsonl exactly once and the budget holds."""
    rng, budget = random.Random(20261123), 24
    out, root = tmp_path / "out", tmp_path / "out" / "kernels" / "rms_norm"
    cmd = [sys.executable, "-m", "kernel_lib.search", "--input", str(ROOT / "specs" / "rms_norm.json")]
    cmd += ["--outdir", str(out), "--no-llm", "--budget", str(budget), "--gpus", "0,1", "--no-progress"]
    kills = []
    for start, target in enumerate(sorted(rng.sample(range(budget - 4), 5))):
        log = open(tmp_path / f"run-{start}.log", "w")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(cmd + (["--resume"] if start else []), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.time() + 60
        while proc.poll() is None and _finished(root / "events.jsonl") < target and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.5, 2.5) if target == 0 else rng.uniform(0.0, 0.25))
        killed = proc.poll() is None
        if killed:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        assert killed, f"run {start} ended before its kill (at {target} evaluations); see {log.name}"
        kills.append((target, _finished(root / "events.jsonl")))
        if (root / "search_state.json").exists():
            json.loads((root / "search_state.json").read_text())  # written atomically: never half a file
    final = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert final.returncode == 0, final.stdout + final.stderr
    assert len(kills) == 5 and kills[-1][1] < budget, kills  # (target, evaluations finished at the kill)
    events, state = check_nothing_lost(root, budget)
    assert {e["status"] for e in events if e["type"] == "evaluated"} == {"ok"}  # a kill is never a variant's failure
    assert [e["type"] for e in events].count("resumed") >= 1  # (a resume killed during its start writes none)
    assert state["graph"]["nodes"][state["incumbent"]["id"]]["status"] == "ok"
    # the trace names how each variant was derived (root to parent), not the walk that reached it
    deepest = max(n["depth"] for n in state["graph"]["nodes"].values())
    paths = [line.split(" path ")[1].split(", move")[0] for line in (root / "trace.md").read_text().splitlines()
             if " path `" in line]  # fmt: skip
    assert paths and all(p.count("`") // 2 <= deepest for p in paths)


def test_the_trace_shows_a_variant_s_lineage_not_the_walk():
    from kernel_lib.search.graph import Graph

    g = Graph()
    for node, parent, depth in [("root", None, 0), ("a", "root", 1), ("b", "a", 2), ("c", "root", 1)]:
        g.add_node(node, parent, depth)
    g.add_node("b", "c", 2)  # a transposition: b reached again from c
    g.add_node("a", "b", 3)  # and a cycle back to a
    assert g.lineage("b") == ["root", "a", "b"]  # first parents: how b was first derived
    assert g.lineage("a") == ["root", "a"]
    assert g.lineage("root") == ["root"]


# --------------------------------------------------------------------------------------------------
# Runs answered from a table: every moment between two writes
# --------------------------------------------------------------------------------------------------
RMS = load_spec(ROOT / "specs" / "rms_norm.json")


def _table(spec) -> dict[str, dict]:
    """A measurement per reachable variant: the baseline 2 ms, others 1-2 ms, one in five wrong."""
    rows = {}
    for i, v in enumerate(reachable(spec)):
        h = int(hashlib.sha256(v.id.encode()).hexdigest()[:8], 16)
        ok = i == 0 or h % 5
        rows[v.id] = {"status": "ok", "ms": 2.0 if i == 0 else 1.0 + h % 1000 / 1000} if ok else {
            "status": "wrong", "reason": "the table says so"
        }  # fmt: skip
    return rows


TABLE = _table(RMS)
WRITES = ("append_event", "save_state", "write_variant", "clear_result", "set_best", "trace")  # RunStore's


class Killed(BaseException):
    """Stands for SIGKILL: not an Exception, so nothing in the search catches it."""


class Killer:
    """Raises Killed before the ``at``-th write of the run folder (RunStore's writing methods, in any order)."""

    def __init__(self, monkeypatch):
        self.at, self.count, self.last = None, 0, None
        self.submitted: list[str] = []  # ids handed to the evaluator, over the runs of one folder
        for name in WRITES:
            original = getattr(RunStore, name)

            def wrapper(store, *args, _original=original, _name=name, **kwargs):
                self.count += 1
                if self.count == self.at:
                    self.last = (_name, store)
                    raise Killed(_name)
                return _original(store, *args, **kwargs)

            monkeypatch.setattr(RunStore, name, wrapper)

    def run(self, outdir: Path, at: int | None, budget: int, resume: bool = False, parallel: int = 2) -> bool:
        """One run, killed before write ``at`` (None: never); whether it was killed."""
        self.at, self.count = at, 0
        if not resume:
            self.submitted = []
        settings = Settings(budget=budget, devices=["cpu"] * parallel, progress=False)
        evaluator = TableEvaluator(TABLE, parallel)
        submit = evaluator.submit

        def counted(control_path, tag):
            submit(control_path, tag)  # the table writes result.json at once: a submitted evaluation is finished
            self.submitted.append(tag)

        evaluator.submit = counted
        search = Search(RMS, str(outdir), settings, evaluator=evaluator, resume=resume)
        try:
            search.run()
        except Killed:
            return True
        return False


BUDGET = 8


def test_a_kill_between_any_two_writes_loses_nothing(monkeypatch, tmp_path):
    """A run killed before its 1st, 2nd, ... write and resumed ends like a run never killed (the invariants of
    check_nothing_lost) and runs no finished evaluation again (a result.json without its event is adopted), apart
    whatever the moment."""
    killer = Killer(monkeypatch)
    assert not killer.run(tmp_path / "whole", None, BUDGET)
    writes = killer.count
    assert writes > 6 * BUDGET
    for at in range(1, writes + 1):
        outdir = tmp_path / str(at)
        assert killer.run(outdir, at, BUDGET)
        assert not killer.run(outdir, None, BUDGET, resume=True)
        check_nothing_lost(outdir / "kernels" / "rms_norm", BUDGET)
        again = sorted({i for i in killer.submitted if killer.submitted.count(i) > 1})
        assert not again, f"kill before write {at}: finished evaluations run again on resume: {again}"


@pytest.mark.parametrize("parallel", [1, 3])
@pytest.mark.parametrize("budget", [1, 2, 9])
def test_the_budget_counts_every_evaluation_the_baseline_included(tmp_path, budget, parallel):
    settings = Settings(budget=budget, devices=["cpu"] * parallel, progress=False)
    Search(RMS, str(tmp_path), settings, evaluator=TableEvaluator(TABLE, parallel)).run()
    check_nothing_lost(tmp_path / "kernels" / "rms_norm", budget)


def test_a_transposition_is_one_node_evaluated_once(tmp_path):
    """Two orders of the same moves meet in one node: a 'transposition' event, a node with two parents."""
    settings = Settings(budget=60, devices=["cpu"], progress=False)
    Search(RMS, str(tmp_path), settings, evaluator=TableEvaluator(TABLE, 1)).run()
    events, state = check_nothing_lost(tmp_path / "kernels" / "rms_norm", 60)
    transpositions = [e for e in events if e["type"] == "transposition"]
    assert transpositions
    assert all(len(state["graph"]["nodes"][e["child"]]["parents"]) >= 2 for e in transpositions)


def test_a_space_explored_before_the_budget_ends_the_run(tmp_path):
    """The tiny spec offers no rule move: without a language model the run stops after the baseline."""
    baseline = Variant.baseline(tiny.spec())
    rows = {baseline.id: {"status": "ok", "ms": 1.0}}
    settings = Settings(budget=10, devices=["cpu"], progress=False)
    result = Search(tiny.spec(), str(tmp_path), settings, evaluator=TableEvaluator(rows, 1)).run()
    assert result.best_id == baseline.id and result.speedup == 1.0
    events = events_of(tmp_path / "kernels" / "double_rows")
    assert [e["type"] for e in events] == ["baseline", "finished"]


# --------------------------------------------------------------------------------------------------
# Several workers: a worker's death is retried elsewhere, once
# --------------------------------------------------------------------------------------------------
class _TwoTableWorkers(WorkerPool):
    """Two workers answering from TABLE (no processes); worker 0 "dies" under the first variant it is given."""

    class _Slot:
        def __init__(self, index):
            self.index, self.device, self.busy = index, f"fake:{index}", False

    def __init__(self):
        self.slots = [self._Slot(0), self._Slot(1)]
        self.finished, self.log = [], []

    def submit(self, control_path, tag, avoid=None, worker=None):
        slot = self._free_slots(avoid, worker)[0]
        control = json.loads(Path(control_path).read_text())
        died = slot.index == 0 and not any(d for *_, d in self.log) and control["id"] != BASE_ID
        result = {"id": control["id"], "status": "crash", "reason": "the worker process died (signal 9)",
                  "died": True} if died else {**TABLE[control["id"]], "id": control["id"]}  # fmt: skip
        result |= {"device": slot.device, "worker": slot.index}
        Path(control["result"]).write_text(json.dumps(result))
        self.log.append((control["id"], slot.index, died))
        self.finished.append((tag, result))

    def wait(self):
        out, self.finished = self.finished, []
        return out

    def close(self):
        pass


BASE_ID = Variant.baseline(RMS).id


def test_a_dead_worker_is_retried_once_on_another(tmp_path):
    """Worker 0 dies under the first variant: the evaluation runs again on worker 1, is counted once, and its
    result is the variant's; the run ends normally, its winner re-timed on worker 0."""
    pool = _TwoTableWorkers()
    settings = Settings(budget=6, devices=["fake:0", "fake:1"], progress=False)
    result = Search(RMS, str(tmp_path), settings, evaluator=pool).run()
    root = tmp_path / "kernels" / "rms_norm"
    events = events_of(root)
    [dead] = [(vid, w) for vid, w, died in pool.log if died]
    [retried] = [e for e in events if e["type"] == "retried"]
    assert (retried["id"], retried["worker"]) == dead == (dead[0], 0)
    again = [w for vid, w, died in pool.log if vid == dead[0] and not died]
    assert again[0] == 1  # elsewhere
    [evaluated] = [e for e in events if e["type"] == "evaluated" and e["id"] == dead[0]]
    assert evaluated["status"] == TABLE[dead[0]]["status"] and evaluated["device"] == "fake:1"
    ids = finished_ids(events)
    assert len(ids) == len(set(ids)) == 6
    assert [e["type"] for e in events][-2:] == ["retimed", "finished"]
    assert result.best_id == json.loads((root / "search_state.json").read_text())["winner"]["id"]


def _fake_python(tmp_path, before: str) -> str:
    """A stand-in for sys.executable that runs ``before`` in the shell, then the real Python."""
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\n{before}\nexec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(
    "before, limit, status, words",
    [
        # a stray line before 'ready' is skipped: the worker starts and evaluates (the control has no spec)
        ("echo noise from an import", 120.0, "runtime_error", "KeyError: 'spec'"),
        ("sleep 30", 2.0, "crash", "did not start within 2 s"),  # a worker that never says ready is killed
    ],
)
def test_a_worker_start_is_waited_for_apart_from_the_timeout(tmp_path, monkeypatch, before, limit, status, words):
    """The pool waits for a new worker's 'ready' (its imports), up to START_LIMIT, before the evaluation's clock
    starts; lines before it are skipped."""
    import kernel_lib.search.pool as pool_module

    monkeypatch.setattr(pool_module, "START_LIMIT", limit)
    monkeypatch.setattr(pool_module.sys, "executable", _fake_python(tmp_path, before))
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"id": "v1", "result": str(tmp_path / "result.json"), "device": "cpu"}))
    pool = WorkerPool(["cpu"], tmp_path / "workers", timeout=60)
    try:
        pool.submit(str(control), "v1")
        [(_, result)] = pool.wait()
    finally:
        pool.close()
    assert result["status"] == status and words in result["reason"], result


def test_a_worker_killed_mid_evaluation_is_reported_as_died(tmp_path):
    """A real worker process killed with SIGKILL while it still starts up (importing torch takes seconds): the
    pool reports a crash marked died, names the worker, and writes result.json itself."""
    pool = WorkerPool(["cpu"], tmp_path / "workers", timeout=60)
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"id": "v1", "result": str(tmp_path / "result.json"), "device": "cpu"}))
    try:
        pool.submit(str(control), "v1")
        deadline = time.time() + 10
        while pool.slots[0].proc is None and time.time() < deadline:
            time.sleep(0.01)
        os.killpg(pool.slots[0].proc.pid, signal.SIGKILL)
        [(tag, result)] = pool.wait()
    finally:
        pool.close()
    assert tag == "v1" and result["status"] == "crash" and result["died"] and result["worker"] == 0
    assert "died (signal 9)" in result["reason"]
    assert json.loads((tmp_path / "result.json").read_text())["died"]
