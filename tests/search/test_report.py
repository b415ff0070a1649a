"""kernel_lib.search.report and the strategy comparison, on runs answered from a synthetic table (milliseconds, no
kernel runs): the tables agree with the run's events, the graph plot draws every node and rings exactly the variants
reached from two parents, and the comparison's curves are best-so-far curves within the budget."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kernel_lib.search import optimize, report, strategies  # noqa: E402
from kernel_lib.search.moves import reachable  # noqa: E402
from kernel_lib.search.spec import load_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RMS = load_spec(ROOT / "specs" / "rms_norm.json")
SPACE = reachable(RMS)


def _table() -> dict[str, dict]:
    """Every reachable variant measured: the baseline 2 ms, the others 0.5-2 ms by a hash of their id, one in seven
    wrong; GB/s from the spec's bytes, as a worker writes them."""
    nbytes = 2 * (2 * 16384 * 4096 + 4096)
    rows = {}
    for i, v in enumerate(SPACE):
        h = int(hashlib.sha256(v.id.encode()).hexdigest()[:8], 16)
        ms = 2.0 if i == 0 else 0.5 + 1.5 * (h % 1000) / 1000
        ok = i == 0 or h % 7
        rows[v.id] = {"status": "ok", "ms": ms, "gbps": nbytes / ms / 1e6} if ok else {"status": "wrong", "ms": None}
    return rows


TABLE = _table()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return optimize(RMS, budget=16, outdir=str(tmp_path_factory.mktemp("run")), table=TABLE, progress=False, seed=1)


def test_throughput_rows_are_the_baseline_and_the_best(run):
    frame = report.throughput(run)
    assert list(frame.index) == ["baseline", "best"]
    assert frame.loc["best", "id"] == run.best_id
    assert frame.loc["best", "ms"] == pytest.approx(run.best_ms)
    assert frame.loc["best", "gbps"] == pytest.approx(TABLE[run.best_id]["gbps"])
    assert frame.loc["best", "speedup"] == pytest.approx(run.speedup)


def test_winning_path_runs_from_the_baseline_to_the_best(run):
    path = report.winning_path(run)
    assert path["move"].iloc[0] == "baseline" and path["id"].iloc[-1] == run.best_id
    # each step's gain is its parent's time over its own, so the gains multiply to the best's speedup
    assert math.prod(path["step gain"].iloc[1:]) == pytest.approx(run.speedup)


def test_moves_table_counts_every_evaluation_once(run):
    table = report.moves_table(run)
    evaluated = [e for e in run.events if e["type"] == "evaluated"]
    assert table["tried"].sum() == len(evaluated)
    assert table["correct"].sum() == sum(e["status"] == "ok" for e in evaluated)
    assert table["on path"].sum() == len(report.winning_path(run)) - 1
    assert (table["improved"] <= table["correct"]).all()


def test_knob_changes_name_what_the_best_changed(run):
    changes = report.knob_changes(run)
    best = next(v for v in SPACE if v.id == run.best_id)
    base = strategies.describe(SPACE[0], SPACE[0])
    assert set(changes.index) == {k for k, v in strategies.describe(best, SPACE[0]).items() if base.get(k) != v}


def test_plot_graph_draws_every_node_and_rings_transpositions(run):
    state = report.load_state(run.folder)
    pos, edges = report.graph_layout(state)
    nodes = state["graph"]["nodes"]
    assert set(pos) == set(nodes) and len(set(pos.values())) == len(pos)  # one place per node
    assert all(pos[n][0] == nodes[n]["depth"] for n in nodes)
    incoming = {n: {a for a, b, _ in edges if b == n} for n in nodes}
    root = state["graph"]["root"]
    ringed = sum(len(incoming[n]) + (n == root) > 1 for n in nodes)
    ax = report.plot_graph(Path(run.folder) / "search_state.json")
    assert f"{ringed} transpositions" in ax.get_title()
    plt.close("all")


def test_ablation_undoes_one_knob_at_a_time():
    rows = []
    for v in SPACE:
        row = {"id": v.id, **strategies.describe(v, SPACE[0]), **TABLE[v.id]}
        rows.append({k: row.get(k) for k in ("id", "BLOCK_N", "num_warps", "EVEN_TAIL", "cg", "status", "ms", "gbps")})
    frame = report.ablation(pd.DataFrame(rows))
    best = frame.loc["(none)"]
    assert best["ms"] == min(r["ms"] for r in TABLE.values() if r["status"] == "ok")
    by_id = {r["id"]: r for r in rows}
    for knob, r in frame.drop(index="(none)").iterrows():
        undone = by_id[r["id"]]
        assert undone[knob] == rows[0][knob]  # this knob back at the baseline's value
        assert all(undone[k] == by_id[best["id"]][k] for k in ("BLOCK_N", "num_warps", "EVEN_TAIL", "cg") if k != knob)


def test_compare_strategies_gives_best_so_far_curves_within_the_budget():
    curves = strategies.compare_strategies(RMS, TABLE, share=0.05, seeds=(0, 1))
    budget = math.ceil(0.05 * len(SPACE))
    assert set(curves["strategy"]) == set(strategies.STRATEGIES) and set(curves["budget"]) == {budget}
    for _, g in curves.groupby(["strategy", "seed"]):
        assert 2 <= len(g) <= budget and g["id"].iloc[0] == SPACE[0].id
        assert g["share"].is_monotonic_increasing and (g["share"] <= 1.0).all()
    summary = strategies.summarize_comparison(curves)
    assert len(summary) == 3 and summary["share_median"].between(0, 1).all()
    axes = report.plot_best_so_far(curves)
    assert len(axes) == 1
    plt.close("all")


def test_random_odds_match_a_count_of_draws():
    near, p_hit = strategies.random_odds(TABLE, budget=2)  # one draw after the baseline
    assert p_hit == pytest.approx(near / (len(TABLE) - 1))
    assert strategies.random_odds(TABLE, budget=len(TABLE))[1] == pytest.approx(1.0 if near else 0.0)


def test_load_state_takes_the_folder_or_the_file(run):
    by_folder = report.load_state(run.folder)
    assert by_folder == json.loads((Path(run.folder) / "search_state.json").read_text())


def test_a_cpu_run_says_its_times_are_the_interpreter_s():
    # under the interpreter the search checks correctness; its times are no GPU speed-up, and the result says so
    from kernel_lib.search.mcts import INTERPRETED_TIMES, SearchResult

    def result(device):
        events = [{"type": "baseline", "id": "b", "ms": 2.0, "device": device},
                  {"type": "evaluated", "id": "v", "ms": 1.0, "status": "ok", "key": "num_warps=8"}]  # fmt: skip
        return SearchResult("rms_norm", "out/kernels/rms_norm", 2.0, "v", 1.0, events)

    assert result("cpu").interpreted and INTERPRETED_TIMES in result("cpu")._repr_html_()
    assert not result("cuda:0").interpreted and INTERPRETED_TIMES not in result("cuda:0")._repr_html_()
