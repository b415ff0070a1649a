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
import os
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
    import pandas as pd

    from kernel_lib.search import report

    frames = []
    for spec in specs:
        path = strategies.space_path(out, spec.name)
        if spec.kind != "triton" or not path.exists():
            continue
        try:
            frames.append(strategies.compare_strategies(spec, strategies.read_space_csv(path), SHARE, SEEDS))
        except ValueError as exc:  # the space changed since it was measured
            print(f"{exc}; run --phase space again")
    if not frames:
        print("no space tables found: run --phase space on a GPU first")
        return
    curves = pd.concat(frames, ignore_index=True)
    summary = strategies.summarize_comparison(curves)
    first = next(iter(strategies.read_space_csv(strategies.space_path(out, summary["spec"].iloc[0])).values()))
    env = {k: first.get(k, "") for k in ("device", "torch", "triton", "timestamp")}
    bench.write_csv(summary.to_dict("records"), os.path.join(out, "search_efficiency.csv"), env)
    print(f"GPU {env['device']}, torch {env['torch']}, triton {env['triton']}; budget = 10% of the space")
    print(summary.drop(columns=["best_ms"]).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    report.plot_best_so_far(curves)
    plt.suptitle(f"{env['device']}: best so far, 3 seeds each", fontsize=10)
    plt.tight_layout()
    plt.savefig(os.path.join(out, "search_efficiency.png"), dpi=110)
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
