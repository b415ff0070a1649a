"""Command line: ``python -m kernel_lib.assistant path/to/file.py:make_model --input-shape 8,1024 [--apply]``.

``make_model`` is a function in that file returning an ``nn.Module`` (called with no arguments). The example
input is random token ids of ``--input-shape`` below ``--vocab`` (default: the model's ``config.vocab_size`` or
``vocab_size`` attribute) when the model starts with an embedding, else random floats of that shape in
``--dtype``. ``--labels`` also passes the same ids as ``labels=`` (Hugging Face) so the model computes its loss.
Prints the report (``--json``: the JSON report on stdout). ``--apply --plan plan.json`` also writes what was kept
as a plan file (``kernel_lib/assistant/plan.py`` describes it), which
``kernel_lib.assistant.apply_plan(model, inputs, "plan.json")`` applies to the model again in Python, and, where
the kept fixes are module rewrites, ``plan.patch``: the same changes as a diff of the model's source.
Exit status 0; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def load_factory(spec: str):
    """``file.py:function`` -> the function (the file imported as a module)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"expected path/to/file.py:function, got {spec!r}")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"no such file: {file}")
    module_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(file.parent.resolve()))
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"{file} has no function {name!r}")
    return factory


def _vocab(model) -> int | None:
    for owner in (getattr(model, "config", None), model):
        v = getattr(owner, "vocab_size", None)
        if isinstance(v, int):
            return v
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None


def make_inputs(model, shape, dtype, vocab, labels, device):
    first = next((m for m in model.modules() if not list(m.children())), None)
    g = torch.Generator().manual_seed(0)
    if isinstance(first, torch.nn.Embedding) or vocab:
        vocab = vocab or _vocab(model)
        ids = torch.randint(0, vocab, shape, generator=g).to(device)
        return {"input_ids": ids, "labels": ids} if labels else (ids,)
    return (torch.randn(shape, generator=g).to(device=device, dtype=dtype),)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernel_lib.assistant",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="path/to/file.py:make_model (a function returning the nn.Module)")
    parser.add_argument("--input-shape", required=True, help="comma-separated, e.g. 8,1024 (batch, tokens)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="model dtype (default fp32)")
    parser.add_argument("--vocab", type=int, default=None, help="token ids below this (default: the model's)")
    parser.add_argument("--labels", action="store_true", help="also pass labels=input_ids (Hugging Face loss)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--apply", action="store_true", help="combine the validated fixes (default: measure only)")
    parser.add_argument("--forward-only", action="store_true", help="time the forward alone, not a training step")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of text")
    parser.add_argument(
        "--compare-seconds",
        type=float,
        default=60.0,
        metavar="S",
        help="how long one keep-or-drop comparison may alternate rounds (default 60; it always takes 3 rounds)",
    )
    parser.add_argument(
        "--plan",
        default=None,
        metavar="PATH",
        help="with --apply: write the fixes kept to this JSON plan (apply_plan applies it again)",
    )
    args = parser.parse_args(argv)
    try:
        shape = tuple(int(s) for s in args.input_shape.split(","))
        if not shape or min(shape) <= 0:
            raise ValueError
    except ValueError:
        parser.error(f"--input-shape must be positive integers separated by commas, got {args.input_shape!r}")
    if args.plan and not args.apply:
        parser.error("--plan writes what --apply decided: pass --apply too")
    try:
        factory = load_factory(args.model)
    except ValueError as exc:
        parser.error(str(exc))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = factory()
    if not isinstance(model, torch.nn.Module):
        print(f"error: {args.model} returned {type(model).__name__}, not a torch.nn.Module", file=sys.stderr)
        return 2
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) and not args.labels:
        print(f"error: {type(model).__name__} is an encoder-decoder model: its decoder reads labels, pass --labels",
              file=sys.stderr)  # fmt: skip
        return 2
    model = model.to(device=device, dtype=DTYPES[args.dtype])
    inputs = make_inputs(model, shape, DTYPES[args.dtype], args.vocab, args.labels, device)

    from .pipeline import CompilerOptimizationAssistant

    assistant = CompilerOptimizationAssistant(
        train=not args.forward_only, progress=not args.json, compare_seconds=args.compare_seconds
    )
    try:
        result = assistant.optimize_model(model, inputs, apply=args.apply)
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=2, default=str) if args.json else result.report())
    if args.plan:
        from .plan import patch_path, save_plan

        saved = save_plan(result, args.plan)
        out = sys.stderr if args.json else sys.stdout
        print(f"plan written to {saved}: kernel_lib.assistant.apply_plan(model, inputs, {saved!r}) applies it",
              file=out)  # fmt: skip
        if os.path.exists(patch_path(saved)):
            print(f"the same changes by hand, as a diff of your source: {patch_path(saved)} (git apply)", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
