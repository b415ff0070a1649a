"""Tables and plots that read what a search run left on disk (notebook 07 shows them; so can anyone reading a run).

- ``throughput(result)``: the baseline and the best variant side by side: ms, GB/s, TFLOP/s (from each result.json);
- ``winning_path(result)``: the moves from the baseline to the best variant, each step's gain;
- ``knob_changes(result)``: what the best variant changed, knob by knob;
- ``moves_table(result)``: every evaluation grouped by move: how often it was tried, how often it was correct,
  its mean and best gain over the variant it was applied to;
- ``ablation(space)``: in a measured space (an exhaustive table), the best variant with each of its changes undone;
- ``plot_graph(state_path)``: the search graph of ``search_state.json``, laid out by depth, nodes colored by speedup,
  transpositions (variants reached by more than one parent) ringed;
- ``plot_best_so_far(curves)``: best-so-far curves of ``strategies.compare_strategies``, one panel per spec.

matplotlib and pandas only.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .strategies import STRATEGIES


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------
def _evaluations(result) -> list[dict]:
    return [e for e in result.events if e["type"] in ("baseline", "evaluated")]


def _ms_by_id(result) -> dict[str, float]:
    """ms of every correct evaluation (the baseline included)."""
    return {
        e["id"]: e["ms"]
        for e in _evaluations(result)
        if (e["type"] == "baseline" or e.get("status") == "ok") and e["ms"]
    }


def _result_json(result, node_id: str) -> dict:
    base = next(e for e in result.events if e["type"] == "baseline")
    folder = Path(result.folder) / ("baseline" if node_id == base["id"] else f"variants/{node_id}")
    try:
        return json.loads((folder / "result.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def throughput(result):
    """Baseline and best: id, ms, GB/s and TFLOP/s (where the spec counts bytes and FLOPs), speedup."""
    import pandas as pd

    base_id = next(e["id"] for e in result.events if e["type"] == "baseline")
    rows = []
    for label, node_id in (("baseline", base_id), ("best", result.best_id)):
        r = _result_json(result, node_id)
        ms = r.get("ms") or (result.baseline_ms if label == "baseline" else result.best_ms)
        rows.append({"variant": label, "id": node_id, "ms": ms, "gbps": r.get("gbps", math.nan),
                     "tflops": r.get("tflops", math.nan), "speedup": result.baseline_ms / ms})  # fmt: skip
    return pd.DataFrame(rows).set_index("variant")


def winning_path(result):
    """The moves that led from the baseline to the best variant (through the parent each was first reached from)."""
    import pandas as pd

    by_id = {e["id"]: e for e in _evaluations(result)}
    ms = _ms_by_id(result)
    steps, node_id, seen = [], result.best_id, set()
    while node_id in by_id and node_id not in seen:
        seen.add(node_id)
        e = by_id[node_id]
        parent = e.get("parent")
        steps.append({
            "move": e.get("key", "baseline"), "id": node_id, "ms": e["ms"], "speedup": result.baseline_ms / e["ms"],
            "step gain": ms[parent] / e["ms"] if parent in ms else math.nan,
        })  # fmt: skip
        node_id = parent
    return pd.DataFrame(steps[::-1])


def _variant(result, node_id: str):
    from .variant import Variant

    base = next(e for e in result.events if e["type"] == "baseline")
    folder = Path(result.folder) / ("baseline" if node_id == base["id"] else f"variants/{node_id}")
    source = next(folder.glob("kernel_module.py"), None) or next(folder.glob("kernel.cu"))
    return Variant.make(source.read_text(), json.loads((folder / "control.json").read_text())["launch"])


def knob_changes(result):
    """What the best variant changed, knob by knob (``strategies.describe``: launch knobs and source moves)."""
    import pandas as pd

    from .strategies import describe

    base_id = next(e["id"] for e in result.events if e["type"] == "baseline")
    base = _variant(result, base_id)
    before, after = describe(base, base), describe(_variant(result, result.best_id), base)
    rows = [{"knob": k, "baseline": before.get(k), "best": v} for k, v in after.items() if before.get(k) != v]
    return pd.DataFrame(rows, columns=["knob", "baseline", "best"]).set_index("knob")


def ablation(space, variant_id: str | None = None, value: str = "gbps"):
    """Undo the changes of one variant (default: the fastest correct one) one knob at a time, in a measured space
    (``pandas.read_csv`` of an exhaustive table; its first row is the baseline): the variant each undo leads to,
    its ms and ``value``, and the share of the variant's throughput it keeps. Knobs: the columns between ``id``
    and ``status``."""
    import pandas as pd

    cols = list(space.columns)
    knobs = cols[cols.index("id") + 1 : cols.index("status")]
    ok = space[space["status"] == "ok"]
    row = ok.loc[ok["ms"].idxmin()] if variant_id is None else space.set_index("id").loc[variant_id].copy()
    if variant_id is not None:
        row["id"] = variant_id
    base = space.iloc[0]
    out = [{"undo": "(none)", "from": "", "to": "", "id": row["id"], "ms": row["ms"], value: row[value]}]
    for knob in knobs:
        if row[knob] == base[knob]:
            continue
        match = space
        for k in knobs:
            match = match[match[k] == (base[k] if k == knob else row[k])]
        if len(match):
            m = match.iloc[0]
            out.append({"undo": knob, "from": row[knob], "to": base[knob], "id": m["id"], "ms": m["ms"],
                        value: m[value] if m["status"] == "ok" else math.nan})  # fmt: skip
    frame = pd.DataFrame(out)
    frame["keeps"] = row["ms"] / frame["ms"]
    return frame.set_index("undo")


def moves_table(result):
    """Evaluations grouped by move: tried, correct, improved (faster than the variant it was applied to), the
    geometric-mean and best gain over that parent, the best label, and how many steps of the winning path it made."""
    import pandas as pd

    ms = _ms_by_id(result)
    on_path = winning_path(result)["move"].tolist()
    rows = []
    for e in _evaluations(result):
        if e["type"] != "evaluated":
            continue
        ok = e.get("status") == "ok" and e["parent"] in ms and e.get("ms")
        rows.append({"move": e.get("move") or e["key"].split(":")[0], "key": e["key"], "ok": e.get("status") == "ok",
                     "gain": ms[e["parent"]] / e["ms"] if ok else math.nan})  # fmt: skip
    if not rows:
        return pd.DataFrame(columns=["tried", "correct", "improved", "mean gain", "best gain", "best", "on path"])
    frame = pd.DataFrame(rows)
    out = []
    for move, g in frame.groupby("move"):
        gains = g["gain"].dropna()
        top = g.loc[gains.idxmax()] if len(gains) else None
        out.append({
            "move": move, "tried": len(g), "correct": int(g["ok"].sum()), "improved": int((gains > 1).sum()),
            "mean gain": math.exp(gains.map(math.log).mean()) if len(gains) else math.nan,
            "best gain": gains.max() if len(gains) else math.nan, "best": "" if top is None else top["key"],
            "on path": sum(k.split(":")[0] == move for k in on_path),
        })  # fmt: skip
    return pd.DataFrame(out).sort_values("best gain", ascending=False).set_index("move")


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------
def load_state(path: str | os.PathLike) -> dict:
    """``search_state.json`` (given it, or the run's folder)."""
    path = Path(path)
    return json.loads((path / "search_state.json" if path.is_dir() else path).read_text())


def graph_layout(state: dict) -> tuple[dict[str, tuple[float, float]], list[tuple[str, str, str]]]:
    """Positions (depth, rank) of the nodes and the edges (parent, child, move). Within a depth, nodes are ordered
    by the mean rank of their parents (a barycentre pass), which keeps most edges from crossing."""
    nodes = state["graph"]["nodes"]
    edges = [(nid, e["child"], e["move"]) for nid, n in nodes.items() for e in n["edges"] if e.get("child") in nodes]
    parents: dict[str, list[str]] = {nid: [] for nid in nodes}
    for a, b, _ in edges:
        parents[b].append(a)
    pos: dict[str, tuple[float, float]] = {}
    for depth in sorted({n["depth"] for n in nodes.values()}):
        layer = [nid for nid, n in nodes.items() if n["depth"] == depth]
        placed = lambda nid: [pos[p][1] for p in parents[nid] if p in pos]  # noqa: E731
        layer.sort(key=lambda nid: (sum(placed(nid)) / len(placed(nid)) if placed(nid) else 0.0, nid))
        for i, nid in enumerate(layer):
            pos[nid] = (float(depth), i - (len(layer) - 1) / 2)
    return pos, edges


def plot_graph(state_path: str | os.PathLike, ax=None, title: str | None = None):
    """The search graph: x is the depth (moves from the baseline), nodes colored by speedup over the baseline and
    sized by visits, failed variants as red crosses, transpositions ringed, the best variant starred; edges colored
    by move, an edge back to a shallower node (a move undone) dashed."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    state = load_state(state_path)
    nodes, base_ms = state["graph"]["nodes"], state["baseline"]["ms"]
    best = (state.get("incumbent") or {}).get("id")
    pos, edges = graph_layout(state)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4.5))
    moves = sorted({m for _, _, m in edges})
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(moves)}
    incoming: dict[str, set] = {nid: set() for nid in nodes}
    for a, b, move in edges:
        incoming[b].add(a)
        (x0, y0), (x1, y1) = pos[a], pos[b]
        back = x1 <= x0
        ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(
            arrowstyle="-", color=colors[move], lw=1.0, alpha=0.35 if back else 0.8, ls="--" if back else "-",
            connectionstyle="arc3,rad=0.35" if back else "arc3,rad=0"))  # fmt: skip
    ok = [nid for nid, n in nodes.items() if n["status"] == "ok" and n.get("ms")]
    speed = [base_ms / nodes[nid]["ms"] for nid in ok]
    size = lambda nid: 25 + 12 * math.sqrt(nodes[nid]["visits"])  # noqa: E731
    dots = ax.scatter([pos[n][0] for n in ok], [pos[n][1] for n in ok], c=speed, s=[size(n) for n in ok],
                      cmap="viridis", zorder=3, edgecolors="none")  # fmt: skip
    failed = [nid for nid, n in nodes.items() if n["status"] not in ("ok", "new", "pending")]
    ax.scatter([pos[n][0] for n in failed], [pos[n][1] for n in failed], marker="x", color="red", s=30, zorder=3)
    root = state["graph"]["root"]
    ringed = [nid for nid in nodes if len(incoming[nid]) + (nid == root) > 1]
    ax.scatter([pos[n][0] for n in ringed], [pos[n][1] for n in ringed], s=[size(n) * 3 for n in ringed],
               facecolors="none", edgecolors="black", linewidths=1.4, zorder=4)  # fmt: skip
    if best in pos:
        ax.scatter(*pos[best], marker="*", s=260, color="gold", edgecolors="black", zorder=5)
    if speed:
        plt.colorbar(dots, ax=ax, label="speedup over the baseline", fraction=0.04)
    handles = [Line2D([], [], color=colors[m], label=m) for m in moves]
    handles += [
        Line2D([], [], ls="", marker="o", mfc="none", mec="black", ms=9, label="transposition (> 1 parent)"),
        Line2D([], [], ls="", marker="*", mfc="gold", mec="black", ms=12, label="best"),
    ]
    if failed:
        handles.append(Line2D([], [], ls="", marker="x", color="red", label="failed"))
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    ax.set_xlabel("depth (moves from the baseline)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yticks([])
    ax.grid(False)
    ax.set_title(title or f"{state['spec']}: {len(nodes)} variants, {len(ringed)} transpositions", fontsize=10)
    return ax


def plot_best_so_far(curves, axes=None, threshold: float = 0.97):
    """Best-so-far share of the space's best against evaluations, one panel per spec of ``curves``
    (``strategies.compare_strategies`` frames, concatenated), one line per strategy and seed."""
    import matplotlib.pyplot as plt

    specs = list(dict.fromkeys(curves["spec"]))
    if axes is None:
        cols = min(len(specs), 2)
        rows = math.ceil(len(specs) / cols)
        _, grid = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False, sharey=True)
        axes = grid.ravel()[: len(specs)]
    colors = {s: f"C{i}" for i, s in enumerate(STRATEGIES)}
    for ax, spec in zip(axes, specs, strict=True):
        for (strategy, seed), g in curves[curves["spec"] == spec].groupby(["strategy", "seed"], sort=False):
            first = seed == curves["seed"].min()
            ax.plot(g["evaluation"], g["share"], color=colors.get(strategy), lw=1.2, alpha=0.8,
                    label=strategy if first else None)  # fmt: skip
        ax.axhline(1.0, color="black", lw=0.8, ls="--", label="exhaustive best")
        ax.axhline(threshold, color="grey", lw=0.6, ls=":", label=f"{threshold:.0%} of it")
        g = curves[curves["spec"] == spec]
        ax.set_title(f"{spec}: {g['space'].iloc[0]} variants, budget {g['budget'].iloc[0]}", fontsize=9)
        ax.set_xlabel("evaluations")
        ax.set_ylim(0, 1.05)
    for ax in axes[:: min(len(specs), 2)]:
        ax.set_ylabel("share of the space's best")
    axes[0].legend(fontsize=7, loc="lower right")
    return axes
