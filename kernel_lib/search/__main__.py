"""``python -m kernel_lib.search``: the command line (``--help`` lists the flags). See kernel_lib/search/__init__.py."""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kernel_lib.search",
        description="Monte Carlo graph search over variants of a Triton or CUDA kernel, from a JSON spec.",
        epilog="Examples:\n"
        "  python -m kernel_lib.search --input specs/rms_norm.json --outdir out --gpus 0,1 --budget 50\n"
        "  python -m kernel_lib.search --input specs/ --no-llm --budget 20\n"
        "  python -m kernel_lib.search --input specs/rms_norm.json --outdir out --resume\n"
        "One evaluation again, by hand:\n"
        "  python -m kernel_lib.search.worker out/kernels/<name>/variants/<id>/control.json\n"
        "Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1) at the specs' small_sizes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", help="a spec file, or a folder of them (every *.json)")
    p.add_argument("--outdir", default="out", help="where runs are written (default: out)")
    p.add_argument("--gpus", default="0", help="comma-separated GPU indices, one worker process each (default: 0)")
    p.add_argument("--budget", type=int, default=50, help="evaluations per kernel, baseline included (default: 50)")
    p.add_argument("--budget-builds", dest="budget", type=int, help=argparse.SUPPRESS)  # its name until 2026-11
    # moved to `python -m kernel_lib.search.worker` (--serve too); still accepted here, out of --help
    p.add_argument("--worker", metavar="CONTROL_JSON", help=argparse.SUPPRESS)
    p.add_argument("--profile-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--min-pred-gain", type=float, default=0.02, help="skip actions whose gain elsewhere is below it")
    p.add_argument(
        "--llm-model",
        default=os.environ.get("KERNEL_SEARCH_LLM_MODEL"),
        help="model for language-model "
        "moves (default: $KERNEL_SEARCH_LLM_MODEL); endpoint from $OPENAI_BASE_URL, key $OPENAI_API_KEY",
    )
    p.add_argument("--no-llm", action="store_true", help="rule moves only")
    p.add_argument("--ncu-every", type=int, default=0, help="profile every N-th visited node with Nsight Compute")
    p.add_argument("--resume", action="store_true", help="continue a stopped or crashed run in --outdir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout", type=float, default=300.0,
        help="seconds per evaluation, compile included (a new worker's start-up is not counted)",
    )  # fmt: skip
    p.add_argument("--small", action="store_true", help="use the specs' small_sizes (default on a CPU machine)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _missing() -> str | None:
    """The one-line message for a missing required package, or None."""
    for module in ("pydantic", "torch", "triton"):
        try:
            __import__(module)
        except ImportError:
            return f"error: the kernel search needs {module}: pip install 'kernel_lib[search]'"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    missing = _missing()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if args.worker:
        from .worker import main as worker_main

        return worker_main([args.worker, *(["--profile-only"] if args.profile_only else [])])
    if not args.input:
        _parser().error("--input is required (a spec file or a folder of specs)")
    from .spec import SpecError, find_specs

    bad: list[str] = []
    try:
        specs = find_specs(args.input, errors=bad)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for message in bad:  # a folder's bad specs are said and skipped; the good ones run
        print(f"error: {message}", file=sys.stderr)
    if not specs:
        return 2
    try:
        gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    except ValueError:
        print(f"error: --gpus takes comma-separated integers, got {args.gpus!r}", file=sys.stderr)
        return 2
    from .llm import LLMUnavailable, client_from_settings
    from .mcts import optimize

    try:
        llm = client_from_settings(args.llm_model, args.no_llm)
    except LLMUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    status = 1 if bad else 0
    import torch

    if not torch.cuda.is_available() and any(spec.kind != "cuda" for spec in specs):
        print("No CUDA GPU: the workers run the kernels under Triton's interpreter (TRITON_INTERPRET=1) at the specs' "
              "small_sizes. Correctness is checked as on a GPU; the times are not a GPU's.")  # fmt: skip
    for spec in specs:
        if spec.kind == "cuda" and not torch.cuda.is_available():
            print(f"{spec.name}: skipped: a CUDA C++ kernel needs a CUDA GPU (and CuPy); this machine has none")
            continue
        try:
            result = optimize(
                spec, budget=args.budget, gpus=gpus, llm=llm, progress=not args.no_progress,
                outdir=args.outdir, resume=args.resume, seed=args.seed, timeout=args.timeout,
                min_pred_gain=args.min_pred_gain, ncu_every=args.ncu_every, **({"small": True} if args.small else {}),
            )  # fmt: skip
        except (RuntimeError, FileExistsError, SpecError) as exc:
            message = str(exc)  # the kernel's name once: some messages start with it already
            print(message if message.startswith(f"{spec.name}: ") else f"{spec.name}: {message}", file=sys.stderr)
            status = 1
            continue
        print(
            f"{spec.name}: best {result.best_id} {result.best_ms:.4g} ms, {result.speedup:.2f}x the baseline "
            f"({result.baseline_ms:.4g} ms){' under the interpreter: not a GPU speed-up' if result.interpreted else ''}"
            f"; trace {result.trace_path}"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
