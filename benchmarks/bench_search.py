"""How efficient the kernel search is, against the exhaustive best, random search and pattern search (issue 13).

Phases (all by default; ``--phase`` picks one):

1. ``space``: every variant the rule moves reach from each Triton spec's baseline is measured once, with the
   search's own workers and correctness gates (``--workers`` processes on GPU 0 compile in parallel and take turns
   on the GPU). One CSV per spec, GPU and versions in every row: ``<out>/search_space_<name>.csv``. kernel_lib's
   hand-tuned ``rms_norm`` and ``softmax`` forwards are timed at the specs' sizes in the same run
   (``<out>/search_references.csv``).
2. ``compare``: on those tables, the graph search, random search and pattern search each get 10% of the space's
   size as budget, for seeds 0, 1, 2. The table gives, per spec and strategy, the share of the space's best
   throughput found (median over seeds, and each seed); ``<out>/search_efficiency.png`` plots best-so-far.
3. ``live``: the graph search run for real on RMSNorm and softmax (``--live-budget`` evaluations), its best against
   kernel_lib's kernel timed in the same process right after.

Runs on a GPU; ``compare`` alone also runs on a CPU machine from stored CSVs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

from kernel_lib import bench
from kernel_lib.search import strategies
from kernel_lib.search.moves import reachable
from kernel_lib.search.spec import find_specs

SEEDS = (0, 1, 2)
SHARE = 0.10  # budget: this share of the space's size


def phase_space(specs, out: str, workers: int, names: list[str] | None, minutes: float) -> None:
    env = bench.environment()
    for spec in specs:
        if spec.kind != "triton" or (names and spec.name not in names):
            continue
        space = reachable(spec)
        control = {"spec": spec.path, "small": False, "seed": 100, "fresh_seed": 101, "warmup_ms": 5, "rep_ms": 30}
        deadline = time.time() + 60 * minutes
        rows = strategies.exhaustive(
            spec, space, os.path.join(out, "space"), ["cuda:0"] * workers, control, deadline=deadline
        )
        if len(rows) < len(space):
            print(f"{spec.name}: stopped at the deadline after {len(rows)} of {len(space)} variants; run again")
        path = strategies.space_path(out, spec.name)
        strategies.write_space_csv(rows, path, env)
        ok = [r for r in rows if r.get("status") == "ok"]
        best = min(ok, key=lambda r: r["ms"])
        fails = {}
        for r in rows:
            if r.get("status") != "ok":
                fails[r["status"]] = fails.get(r["status"], 0) + 1
        print(
            f"{spec.name}: {len(rows)} variants, {len(ok)} correct, failures {fails}; baseline {rows[0]['ms']:.4g} ms,"
            f" best {best['ms']:.4g} ms ({rows[0]['ms'] / best['ms']:.2f}x) -> {path}"
        )
    references(specs, out, env)


def _reference_ms(name: str, spec) -> tuple[str, float] | None:
    """kernel_lib's own forward at the spec's sizes, timed like the workers time (bench.time_fn, L2 flushed)."""
    from kernel_lib import rms_norm, softmax
    from kernel_lib.search.contract import make_case

    case = make_case(spec, "cuda", 100, small=False)
    if name == "rms_norm":
        x, w = case.inputs["x"], case.inputs["w"]
        fn = lambda: rms_norm(x, w, 1e-6)  # noqa: E731
    elif name == "softmax":
        x = case.inputs["x"]
        fn = lambda: softmax(x)  # noqa: E731
    else:
        return None
    return f"kernel_lib.{name}", bench.time_fn(fn, warmup_ms=10, rep_ms=50).median_ms


def references(specs, out: str, env: dict) -> dict[str, float]:
    rows = []
    for spec in specs:
        got = _reference_ms(spec.name, spec)
        if got is not None:
            rows.append({"spec": spec.name, "kernel": got[0], "ms": got[1]})
            print(f"{got[0]} forward at the {spec.name} spec's sizes: {got[1]:.4g} ms")
    if rows:
        bench.write_csv(rows, os.path.join(out, "search_references.csv"), env)
    return {r["spec"]: r["ms"] for r in rows}


def phase_compare(specs, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = []
    curves = {}
    for spec in specs:
        path = strategies.space_path(out, spec.name)
        if spec.kind != "triton" or not path.exists():
            continue
        table = strategies.read_space_csv(path)
        space = reachable(spec)
        missing = [v.id for v in space if v.id not in table]
        if missing:
            print(f"{spec.name}: {len(missing)} variants of the space are not in {path}; run --phase space again")
            continue
        best = strategies.space_best(table)
        budget = max(2, math.ceil(SHARE * len(space)))
        measure = lambda vid, t=table: t[vid]["ms"] if t[vid]["status"] == "ok" else None  # noqa: E731
        runs = {"graph search": [], "random": [], "pattern": []}
        for seed in SEEDS:
            runs["graph search"].append(strategies.graph_search(spec, table, budget, seed))
            runs["random"].append(strategies.random_search(spec, space, budget, seed))
            runs["pattern"].append(strategies.pattern_search(spec, space, budget, seed, measure))
        curves[spec.name] = (best, {k: [strategies.best_so_far(o, table) for o in v] for k, v in runs.items()})
        for name, orders in runs.items():
            shares = [best / strategies.best_so_far(o, table)[-1] for o in orders]
            evals_to_97 = []
            for o in orders:
                bsf = strategies.best_so_far(o, table)
                evals_to_97.append(next((i + 1 for i, ms in enumerate(bsf) if best / ms >= 0.97), None))
            summary.append({
                "spec": spec.name, "space": len(space), "budget": budget, "strategy": name,
                "best_ms": best, "share_median": statistics.median(shares),
                "shares": " ".join(f"{s:.3f}" for s in shares),
                "evals_to_97": " ".join(str(e) if e else "-" for e in evals_to_97),
            })  # fmt: skip
    if not summary:
        print("no space tables found: run --phase space on a GPU first")
        return
    env_rows = strategies.read_space_csv(strategies.space_path(out, summary[0]["spec"]))
    first = next(iter(env_rows.values()))
    env = {k: first.get(k, "") for k in ("device", "torch", "triton", "timestamp")}
    bench.write_csv(summary, os.path.join(out, "search_efficiency.csv"), env)
    print(f"GPU {env.get('device')}, torch {env.get('torch')}, triton {env.get('triton')}; budget = 10% of the space")
    head = f"{'spec':<11} {'space':>5} {'budget':>6} {'strategy':<13} {'share of best (median)':>22}"
    print(head + "  seeds          evals to 97%")
    for r in summary:
        print(
            f"{r['spec']:<11} {r['space']:>5} {r['budget']:>6} {r['strategy']:<13} {r['share_median']:>22.3f}  "
            f"{r['shares']:<14} {r['evals_to_97']}"
        )
    fig, axes = plt.subplots(1, len(curves), figsize=(3.6 * len(curves), 3.2), squeeze=False)
    for ax, (name, (best, by)) in zip(axes[0], curves.items(), strict=True):
        for (label, runs), color in zip(by.items(), ("C0", "C1", "C2"), strict=True):
            for i, bsf in enumerate(runs):
                ax.plot(range(1, len(bsf) + 1), [best / m if m < math.inf else 0 for m in bsf], color=color,
                        alpha=0.8, lw=1.2, label=label if i == 0 else None)  # fmt: skip
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="exhaustive best")
        ax.axhline(0.97, color="grey", lw=0.6, ls=":")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("evaluations")
        ax.set_ylim(0, 1.05)
    axes[0][0].set_ylabel("share of the space's best throughput")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{env.get('device')}: best so far, 3 seeds each", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "search_efficiency.png"), dpi=110)
    print(f"plot: {os.path.join(out, 'search_efficiency.png')}")


def phase_live(specs, out: str, budget: int, workers: int) -> None:
    from kernel_lib.search import optimize

    env = bench.environment()
    rows = []
    for spec in specs:
        if spec.name not in ("rms_norm", "softmax"):
            continue
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            result = optimize(spec, budget=budget, gpus=[0] * workers, outdir=tmp, progress=False, seed=0)
            ref = _reference_ms(spec.name, spec)[1]
            rows.append({
                "spec": spec.name, "budget": budget, "baseline_ms": result.baseline_ms,
                "search_best_ms": result.best_ms, "kernel_lib_ms": ref, "search_over_kernel_lib": result.best_ms / ref,
                "best_id": result.best_id,
            })  # fmt: skip
            print(
                f"{spec.name}: baseline {result.baseline_ms:.4g} ms, search best {result.best_ms:.4g} ms "
                f"({result.speedup:.2f}x) in {budget} evaluations; kernel_lib {ref:.4g} ms; "
                f"search / kernel_lib = {result.best_ms / ref:.3f}"
            )
    bench.write_csv(rows, os.path.join(out, "search_live.csv"), env)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results")
    p.add_argument("--specs", default="specs")
    p.add_argument("--phase", choices=("space", "compare", "live", "all"), default="all")
    p.add_argument("--only", nargs="*", help="spec names for --phase space")
    p.add_argument("--workers", type=int, default=12, help="worker processes on GPU 0 (compile in parallel)")
    p.add_argument("--live-budget", type=int, default=40)
    p.add_argument("--minutes", type=float, default=30.0, help="--phase space: stop submitting after this, per spec")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    specs = find_specs(args.specs)
    if args.phase in ("space", "live", "all"):
        bench.require_gpu(__file__)
    if args.phase in ("space", "all"):
        phase_space(specs, args.out, args.workers, args.only, args.minutes)
    if args.phase in ("compare", "all"):
        phase_compare(specs, args.out)
    if args.phase in ("live", "all"):
        phase_live(specs, args.out, args.live_budget, max(1, args.workers // 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
