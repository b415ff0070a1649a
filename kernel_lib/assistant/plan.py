"""What ``--apply`` decided, saved as a plan file, and applied again to a fresh copy of the model.

A plan is a JSON file (``python -m kernel_lib.assistant ... --apply --plan plan.json`` writes it)::

    {"format": "kernel_lib.assistant plan", "version": 1, "model": "MistralForCausalLM",
     "environment": {...}, "speedup": 1.42,
     "fixes": [{"technique": "fused_norm", "kind": "manual_norm", "modules": ["model.layers.0.norm", ...],
                "location": "...", "ratio": 1.21, "ratio_95ci": [1.18, 1.24], "by_hand": "...",
                "diff": "--- a/model.py\n+++ b/model.py\n..."}, ...],
     "by_hand": [{"kind": "...", "location": "...", "fix": "..."}]}

``fixes`` are the rewrites kept, in the order they were applied, with the modules each one changed, what it
measured alone, the change it stands for in the model's source (``by_hand``, a sentence) and, for a module
rewrite, that change as a unified diff of the file defining the module's class (``diff``, see
:mod:`kernel_lib.assistant.by_hand`; null where there is none); ``by_hand`` the findings no rewrite covers.
:func:`save_plan` also writes the diffs, one after another, to a ``.patch`` file beside the plan.
:func:`apply_plan` finds the same things again in a model built the same way (detection traces one forward, so
it needs example inputs), applies the plan's fixes in its order, and refuses a model whose findings no longer
match the plan's modules (a changed model). It checks the result against the original with the float64
validator unless ``validate=False``; it does not time anything.
"""

from __future__ import annotations

import json
import os

import torch

from . import by_hand

FORMAT, VERSION = "kernel_lib.assistant plan", 1


def plan_of(result) -> dict:
    """The plan of an :class:`~kernel_lib.assistant.report.OptimizationResult` (the fixes it kept)."""
    applied = {o.technique: o for o in result.optimization_opportunities if o.applied}
    kept = [step.technique.split(" (")[0] for step in result.waterfall[1:] if step.kept]  # in the order applied
    fixes = []
    for technique in kept:
        opp = applied[technique]
        comparison = opp.comparison
        fixes.append({
            "technique": technique, "kind": opp.kind, "modules": list(opp.finding.modules), "location": opp.location,
            "ratio": opp.estimated_speedup,
            "ratio_95ci": None if comparison is None else [comparison.low, comparison.high],
            "by_hand": opp.finding.fix,  # the change to make in the model's source instead of applying the plan
            "diff": _diff_of(result, opp.finding.modules),
        })  # fmt: skip
    by_hand = [{"kind": o.kind, "location": o.location, "fix": o.finding.fix}
               for o in result.optimization_opportunities if not o.technique]  # fmt: skip
    return {"format": FORMAT, "version": VERSION, "model": result.model_name, "environment": result.env,
            "speedup": result.speedup if kept else 1.0, "fixes": fixes, "by_hand": by_hand}  # fmt: skip


def _module_at(model: torch.nn.Module, path: str):
    """The module at ``path`` in ``model``, looking through the wrappers the assistant adds (compilation, autocast,
    the fused loss), which put the rewritten model one or two names deeper."""
    model = getattr(model, "_orig_mod", model)
    for name, module in model.named_modules():
        if name == path or name.endswith("." + path):
            return module
    return None


def _diff_of(result, modules) -> str | None:
    """The by-hand diff of a module rewrite: one per class among ``modules`` (the first module of each)."""
    original, optimized = getattr(result, "_original", None), result.optimized_model
    if original is None or not modules:
        return None
    diffs, seen = [], set()
    for path in modules:
        old, new = _module_at(original, path), _module_at(optimized, path)
        if old is None or new is None or type(old) in seen:
            continue
        seen.add(type(old))
        diff = by_hand.forward_diff(type(old), new)
        if diff:
            diffs.append(diff)
    return "".join(diffs) or None


def save_plan(result, path: str | os.PathLike) -> str:
    """Write :func:`plan_of` ``result`` to ``path`` (JSON), and its fixes' diffs to the same name with a
    ``.patch`` suffix when there are any (``git apply`` applies it from the directory the paths are relative to,
    the working directory of the run); returns the plan's path."""
    plan = plan_of(result)
    with open(path, "w") as f:
        json.dump(plan, f, indent=2, default=str)
        f.write("\n")
    diffs = [fix["diff"] for fix in plan["fixes"] if fix["diff"]]
    patch = patch_path(path)
    if diffs:
        with open(patch, "w") as f:
            f.write("".join(diffs))
    elif os.path.exists(patch):
        os.remove(patch)  # a stale patch of an earlier plan
    return os.fspath(path)


def patch_path(path: str | os.PathLike) -> str:
    """Where :func:`save_plan` writes the diffs of the plan at ``path``."""
    return os.path.splitext(os.fspath(path))[0] + ".patch"


def load_plan(plan) -> dict:
    """A plan from a path or a dict, its format checked."""
    if not isinstance(plan, dict):
        with open(plan) as f:
            plan = json.load(f)
    if plan.get("format") != FORMAT or plan.get("version") != VERSION:
        raise ValueError(f"not a {FORMAT} (version {VERSION}): format {plan.get('format')!r}, version "
                         f"{plan.get('version')!r}")  # fmt: skip
    return plan


def apply_plan(model: torch.nn.Module, example_inputs, plan, *, validate: bool = True, assistant=None):
    """A rewritten copy of ``model`` with the plan's fixes applied in the plan's order (``model`` is left as it
    is). Raises ValueError when the model's findings do not cover a fix's modules, and, with ``validate``, when
    the rewritten model does not match the original within the validator's tolerances."""
    from .pipeline import CompilerOptimizationAssistant, split_inputs

    plan = load_plan(plan)
    assistant = assistant or CompilerOptimizationAssistant(progress=False)
    ctx = assistant._prepare(model, example_inputs)
    findings = assistant._find(model, ctx)
    chosen = []
    for fix in plan["fixes"]:
        match = next((f for f in findings if f.technique == fix["technique"] and set(fix["modules"]) <= set(f.modules)),
                     None)  # fmt: skip
        if match is None:
            raise ValueError(f"the plan's {fix['technique']} fix changed {', '.join(fix['modules']) or 'the model'}; "
                             "this model has no such finding (built differently from the planned one?)")  # fmt: skip
        chosen.append(match)
    new, autocast = assistant._rewrite(model, chosen)
    if validate and chosen:
        args, kwargs = split_inputs(example_inputs)
        with torch.no_grad():
            from . import measure

            loss_only = measure.returns_loss(model(*args, **kwargs))
        report = assistant._validate(model, new, args, kwargs, loss_only, autocast)
        if not report.passed:
            raise ValueError(f"the plan's fixes do not validate on this model: {report.summary()}")
    return new
