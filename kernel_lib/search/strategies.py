"""Yardsticks for the search: the exhaustive space, random search and pattern search.

- ``exhaustive`` measures every variant the rule moves reach (``moves.reachable``) with the same workers and the
  same correctness gates as a search, and returns a table (one row per variant; ``write_space_csv`` keeps it with
  the GPU named). That table is the truth a search's efficiency is read against.
- ``random_search`` draws variants of that space uniformly, without replacement, after the baseline.
- ``pattern_search`` is the local strategy of Helion's autotuner: from the incumbent, evaluate every neighbour
  (one knob one step along its list of values, or one source move applied), move to the best improvement, repeat;
  at a local optimum, restart from the best unexplored neighbour of the explored set.
- ``graph_search`` runs the Monte Carlo graph search itself with evaluations answered from the table.

All three answer "which variants, in which order" for a budget; ``best_so_far`` turns an order into a curve.
Comparing them on one measured table means they see exactly the same numbers: no run-to-run noise decides.
"""

from __future__ import annotations

import csv
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .moves import Action, _knob_values, rule_actions
from .pool import WorkerPool
from .spec import KernelSpec
from .store import RunStore
from .variant import Variant


# --------------------------------------------------------------------------------------------------
# The exhaustive space
# --------------------------------------------------------------------------------------------------
def describe(v: Variant, baseline: Variant) -> dict:
    """A variant as a row: its launch knobs and which source moves it carries (relative to the baseline)."""
    row = dict(v.knobs())
    row["EVEN_TAIL"] = "EVEN_TAIL" in v.launch["constexprs"]
    row["GROUP_M"] = v.launch["constexprs"].get("GROUP_M", 0)
    row["cg"] = '".cg"' in v.source and '".cg"' not in baseline.source
    row["exp2_rsqrt"] = v.source.count("tl.exp2(") + v.source.count("tl.rsqrt(") > baseline.source.count(
        "tl.exp2("
    ) + baseline.source.count("tl.rsqrt(")
    return row


def exhaustive(
    spec: KernelSpec,
    variants: list[Variant],
    outdir: str,
    devices: list[str],
    control: dict,
    timeout: float = 300.0,
    progress: bool = True,
    deadline: float | None = None,
) -> list[dict]:
    """Evaluate every variant (``variants[0]`` is the baseline); a folder per variant under ``outdir``.

    Variants whose result.json exists are not run again, so a killed enumeration continues where it stopped.
    After ``deadline`` (a time.time()) nothing new starts; the rows measured so far come back.
    """
    store = RunStore(outdir, spec.name)
    store.create()
    pool = WorkerPool(devices, store.root / "workers", timeout)
    baseline = variants[0]
    rows: dict[str, dict] = {}
    todo = []
    for v in variants:
        done = store.read_result(v.id)
        if done is not None:
            rows[v.id] = {**describe(v, baseline), **done}
        else:
            todo.append(v)
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(variants), initial=len(rows), desc=f"exhaustive {spec.name}", unit="variant")
        except ImportError:
            bar = None
    try:
        while todo or pool.in_flight():
            if deadline is not None and time.time() > deadline:
                todo = []
            while todo and pool.free():
                v = todo.pop(0)
                path = store.write_variant(v, spec.kind, {**control, "device": pool.device()}, baseline.source)
                pool.submit(path, v)
            for v, result in pool.wait():
                rows[v.id] = {**describe(v, baseline), **result}
                if bar is not None:
                    bar.update(1)
    finally:
        pool.close()
        if bar is not None:
            bar.close()
    return [rows[v.id] for v in variants if v.id in rows]


COLUMNS = ("id", "status", "ms", "p20_ms", "p80_ms", "gbps", "tflops", "reason")


def write_space_csv(rows: list[dict], path: str | os.PathLike, env: dict) -> None:
    """One row per variant, knobs first; the environment (GPU, versions, date) in every row, as bench.write_csv."""
    knobs = [k for k in rows[0] if k not in COLUMNS and k not in ("device", "seconds", "errors", "samples", "timer")]
    fields = ["id", *knobs, "status", "ms", "p20_ms", "p80_ms", "gbps", "tflops", "reason", *env]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow(
                {**r, "reason": (r.get("reason") or "").splitlines()[0][:200] if r.get("reason") else "", **env}
            )


def read_space_csv(path: str | os.PathLike) -> dict[str, dict]:
    """id -> {"status", "ms", ...} from ``write_space_csv``'s file, numbers parsed."""
    table = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            r["ms"] = float(r["ms"]) if r.get("ms") else None
            table[r["id"]] = r
    return table


# --------------------------------------------------------------------------------------------------
# Strategies over a table
# --------------------------------------------------------------------------------------------------
def best_so_far(order: list[str], table: dict[str, dict]) -> list[float]:
    """Fastest correct ms after each evaluation of ``order`` (inf until a correct one)."""
    best, out = math.inf, []
    for vid in order:
        r = table.get(vid, {})
        if r.get("status") == "ok" and r.get("ms"):
            best = min(best, r["ms"])
        out.append(best)
    return out


def space_best(table: dict[str, dict]) -> float:
    return min(r["ms"] for r in table.values() if r.get("status") == "ok" and r.get("ms"))


def random_search(spec: KernelSpec, space: list[Variant], budget: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    rest = [v.id for v in space[1:]]
    rng.shuffle(rest)
    return [space[0].id, *rest][:budget]


def _neighbours(v: Variant, spec: KernelSpec) -> list[Action]:
    """One step: a knob to the next value up or down its list, or one source move."""
    out = []
    for a in rule_actions(v, spec):
        if a.move in ("change_block_sizes", "enable_async_pipeline"):
            if "," in a.label:
                continue  # two knobs at once (a block size with its warps scaled): two steps, not one
            knob, value = a.label.split("=")
            current = v.launch[knob] if knob in ("num_warps", "num_stages") else v.launch["constexprs"][knob]
            values = _knob_values(spec, knob)
            i = values.index(current) if current in values else None
            if i is None or int(value) not in (values[max(i - 1, 0)], values[min(i + 1, len(values) - 1)]):
                continue
        out.append(a)
    return out


def pattern_search(
    spec: KernelSpec, space: list[Variant], budget: int, seed: int, measure: Callable[[str], float | None]
) -> list[str]:
    """Helion-style pattern search from the baseline (``measure(id)`` -> ms or None for a failed variant)."""
    rng = random.Random(seed)
    order: list[str] = []
    seen: set[str] = set()
    by_id = {v.id: v for v in space}

    def run(v: Variant) -> float:
        if v.id not in seen and len(order) < budget:
            seen.add(v.id)
            order.append(v.id)
        ms = measure(v.id)
        return ms if ms is not None else math.inf

    current = space[0]
    best = run(current)
    frontier: list[tuple[float, str]] = []
    while len(order) < budget:
        steps = [a.child for a in _neighbours(current, spec) if a.child.id not in seen]
        rng.shuffle(steps)  # the seed decides the order in which ties and the budget's end fall
        improved = None
        for child in steps:
            if len(order) >= budget:
                break
            ms = run(child)
            frontier.append((ms, child.id))
            if ms < best:
                best, improved = ms, child
        if improved is not None:
            current = improved
            continue
        # a local optimum: restart from the fastest evaluated variant whose neighbours are not all seen
        frontier.sort()
        nxt = next(
            (by_id.get(vid) or _find(space, vid) for _, vid in frontier if _unseen(by_id.get(vid), spec, seen)), None
        )
        if nxt is None:
            break
        current = nxt
    return order


def _find(space: list[Variant], vid: str) -> Variant | None:
    return next((v for v in space if v.id == vid), None)


def _unseen(v: Variant | None, spec: KernelSpec, seen: set[str]) -> bool:
    return v is not None and any(a.child.id not in seen for a in _neighbours(v, spec))


def graph_search(spec: KernelSpec, table: dict[str, dict], budget: int, seed: int) -> list[str]:
    """The graph search with evaluations answered from ``table``; the order of its evaluations."""
    from .mcts import optimize

    with tempfile.TemporaryDirectory() as tmp:
        result = optimize(spec, budget=budget, outdir=tmp, table=table, seed=seed, progress=False, gpus=[0])
        return [e["id"] for e in result.events if e["type"] in ("baseline", "evaluated")]


def space_path(folder: str | os.PathLike, name: str) -> Path:
    return Path(folder) / f"search_space_{name}.csv"


# --------------------------------------------------------------------------------------------------
# The comparison: every strategy on one table, the same budget, a few seeds
# --------------------------------------------------------------------------------------------------
STRATEGIES = ("graph search", "random", "pattern")


def compare_strategies(spec: KernelSpec, table: dict[str, dict], share: float = 0.10, seeds=(0, 1, 2)):
    """Best-so-far curves of the graph search, random search and pattern search on one measured ``table``.

    Each strategy gets ``ceil(share * len(space))`` evaluations (at least 2), baseline included, per seed. Returns a
    pandas DataFrame, one row per (strategy, seed, evaluation): ``spec, space, budget, strategy, seed, evaluation,
    id, best_ms`` (fastest correct so far), ``space_best_ms`` (the exhaustive best) and ``share`` (space_best_ms /
    best_ms: 1.0 is the exhaustive best, 0.0 before a correct variant).
    ``summarize_comparison`` turns it into one row per strategy.
    """
    import pandas as pd

    from .moves import reachable

    space = reachable(spec)
    missing = [v.id for v in space if v.id not in table]
    if missing:
        raise ValueError(
            f"{spec.name}: {len(missing)} of the {len(space)} reachable variants are not in the table "
            "(the spec or the moves changed since it was measured): measure the space again"
        )
    best = space_best(table)
    budget = max(2, math.ceil(share * len(space)))

    def measure(vid: str) -> float | None:
        return table[vid]["ms"] if table[vid]["status"] == "ok" else None

    rows = []
    for seed in seeds:
        orders = {
            "graph search": graph_search(spec, table, budget, seed),
            "random": random_search(spec, space, budget, seed),
            "pattern": pattern_search(spec, space, budget, seed, measure),
        }
        for strategy, order in orders.items():
            for i, (vid, ms) in enumerate(zip(order, best_so_far(order, table), strict=True)):
                rows.append({
                    "spec": spec.name, "space": len(space), "budget": budget, "strategy": strategy, "seed": seed,
                    "evaluation": i + 1, "id": vid, "best_ms": ms, "space_best_ms": best,
                    "share": best / ms if ms < math.inf else 0.0,
                })  # fmt: skip
    return pd.DataFrame(rows)


def summarize_comparison(curves, threshold: float = 0.97):
    """One row per (spec, strategy) of ``compare_strategies`` frames (concatenated): the share of the space's best
    reached at the end of the budget (median and worst over seeds, and each seed) and the evaluations each seed
    needed to reach ``threshold`` of it (column ``evals_to_97`` for 0.97; '-': never within the budget)."""
    import pandas as pd

    rows = []
    for (spec, strategy), group in curves.groupby(["spec", "strategy"], sort=False):
        finals = group.groupby("seed")["share"].last()
        reached = [
            next((int(r.evaluation) for r in g.itertuples() if r.share >= threshold), None)
            for _, g in group.groupby("seed")
        ]
        rows.append({
            "spec": spec, "space": int(group["space"].iloc[0]), "budget": int(group["budget"].iloc[0]),
            "strategy": strategy, "best_ms": float(group["space_best_ms"].iloc[0]),
            "share_median": float(finals.median()), "share_min": float(finals.min()),
            "shares": " ".join(f"{s:.3f}" for s in finals),
            f"evals_to_{round(100 * threshold)}": " ".join(str(e) if e else "-" for e in reached),
        })  # fmt: skip
    return pd.DataFrame(rows)


def random_odds(table: dict[str, dict], budget: int, threshold: float = 0.97) -> tuple[int, float]:
    """How broad the top of a measured space is, and what that gives random search: the number k of variants (the
    baseline, the table's first row, aside) within ``threshold`` of the best, and the probability that ``budget`` - 1
    draws without replacement from the n others include at least one: 1 - C(n - k, b) / C(n, b)."""
    best = space_best(table)
    rows = list(table.values())[1:]
    near = sum(r.get("status") == "ok" and bool(r.get("ms")) and best / r["ms"] >= threshold for r in rows)
    draws = min(max(budget - 1, 0), len(rows))
    return near, 1.0 - math.comb(len(rows) - near, draws) / math.comb(len(rows), draws)
