"""The assistant: analyze a model, suggest the course's fixes, apply them, prove each one.

``optimize_model`` runs four phases on the reader's own model and inputs:

1. **find**: record one forward (``trace.py``), read the forward methods' loops (``source.py``), ask Dynamo for
   graph breaks and recompiles (``dynamo.py``), profile a step on a GPU (``measure.py``); the detectors
   (``detect.py``) turn those into findings;
2. **measure each fix alone**: for every finding with an automatic rewrite, rewrite a copy of the original, validate
   it against the original (float64 reference, outputs and gradients, the course's tolerance rule) and time a
   training step: ``estimated_speedup`` is that measured ratio, never a number from a table;
3. **combine**: apply the validated fixes one after another, best first (module swaps, then the fused loss, then
   precision, then compilation), keeping each only if the combined model still validates and the step gets
   faster by more than the timing noise (2%), or its peak memory drops by more than 10% while the step gets no
   slower than the noise: a fix that makes a fast model slower is reported and not applied;
4. **report**: the before/after table, the waterfall of step times, the validation of the final model.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings
from dataclasses import dataclass, field

import torch

from ..equivalence import ComponentValidator, ValidationReport
from . import detect, dynamo, measure, rewrites, source
from . import trace as tracing
from .findings import KINDS, Finding
from .report import Opportunity, OptimizationResult, WaterfallStep

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NOISE = measure.NOISE  # ratios this close to 1 are a tie: a fix must be faster by more, with confidence...
LEANER = 0.10  # ...or cut the step's peak memory by more than this share, with the step not slower than NOISE


def _worth_keeping(comparison: measure.Comparison, current_peak: float) -> bool:
    """Faster with confidence (the ratio's 95% interval above 1, the ratio beyond NOISE), or leaner by more than
    LEANER and not slower beyond the noise (NaN peaks: no): one noisy round cannot flip the decision, because the
    rounds repeat until the interval decides (``measure.compare``)."""
    if comparison.faster:
        return True
    # as fast within the noise, with confidence (a wide interval is no evidence of "not slower"), and leaner
    return comparison.low > 1 / (1 + NOISE) and comparison.candidate.peak_bytes < current_peak * (1 - LEANER)


def split_inputs(example_inputs) -> tuple[tuple, dict]:
    """A tensor, a tuple/list of positional arguments, or a dict of keyword arguments -> (args, kwargs)."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _tensors(args, kwargs):
    return [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


def check_model_and_inputs(model, args, kwargs) -> torch.device:
    """Clear errors for what the assistant cannot work with; returns the model's device."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    if not params:
        raise ValueError("the model has no parameters: there is nothing to train or optimize")
    device = params[0].device
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    bad = [d for d in dtypes if d not in SUPPORTED_DTYPES]
    if bad:
        names = ", ".join(str(d).replace("torch.", "") for d in bad)
        raise ValueError(
            f"unsupported parameter dtype {names}: the assistant optimizes float32, bfloat16 and float16 models"
        )
    for i, t in enumerate(_tensors(args, kwargs)):
        if t.device != device:
            raise ValueError(
                f"example input {i} is on {t.device}, the model's parameters on {device}: move them to one device"
            )
    return device


def _quiet():
    """Dynamo's own warnings about graph breaks repeat what the report says, at length."""
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torch._dynamo")


class _LossOnly(torch.nn.Module):
    """Compare models that compute their own loss by the loss alone (a fused loss returns no logits)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return measure.loss_of(self.model(*args, **kwargs))


@dataclass
class _Context:
    args: tuple
    kwargs: dict
    device: torch.device
    trace: tracing.Trace | None = None
    dynamo: dynamo.DynamoReport | None = None
    profile: measure.Profile | None = None
    loops: dict = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)


def _why(comparison: measure.Comparison, current_peak: float) -> str:
    """Why a fix was kept, for the waterfall: faster, or leaner and as fast."""
    if comparison.faster:
        return f"faster: {comparison.describe()}"
    saved = 1 - comparison.candidate.peak_bytes / current_peak
    return f"{saved:.0%} less peak memory, as fast within the noise: {comparison.describe()}"


def _reference_runs(step) -> list[str]:
    """The kernel_lib ops that ran their plain PyTorch reference instead of their kernel during ``step()``."""
    from ..ops import _utils

    before = dict(_utils.REFERENCE_RUNS)
    step()
    return sorted(op for op, n in _utils.REFERENCE_RUNS.items() if n > before.get(op, 0))


def _timed_where(model, ctx) -> str:
    """What a ratio measured on the CPU is: said next to the number."""
    return "" if ctx.device.type == "cuda" else " (timed on the CPU: says little about a GPU)"


class CompilerOptimizationAssistant:
    """Finds what slows a model down, applies the course's fixes, and proves each one on this machine.

    ``device``: where to run (default: the model's device). ``train``: time forward + backward (default) or the
    forward alone. ``warmup_ms`` / ``rep_ms``: the timing of each measured round. ``compare_seconds``: how long
    one keep-or-drop comparison may alternate rounds before it settles on what it has. ``progress``: a progress
    bar.
    """

    def __init__(
        self,
        device=None,
        *,
        train: bool = True,
        validator: ComponentValidator | None = None,
        warmup_ms: float | None = None,
        rep_ms: float | None = None,
        compare_seconds: float = 60.0,
        progress: bool = True,
    ):
        self.device = torch.device(device) if device is not None else None
        self.train = train
        self.validator = validator or ComponentValidator()
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.compare_seconds = compare_seconds
        self._comparing = False
        self.progress = progress
        _quiet()

    # ---- finding ---------------------------------------------------------------------------------------------
    def _prepare(self, model, example_inputs) -> _Context:
        args, kwargs = split_inputs(example_inputs)
        if self.device is not None:
            model.to(self.device)
            move = lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t  # noqa: E731
            args, kwargs = tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}
        device = check_model_and_inputs(model, args, kwargs)
        try:
            with torch.no_grad():
                model(*args, **kwargs)
        except Exception as exc:
            raise ValueError(f"the model fails on the example inputs: {type(exc).__name__}: {exc}") from exc
        return _Context(args, kwargs, device)

    def _find(self, model, ctx: _Context) -> list[Finding]:
        compiled = _is_compiled(model)
        eager = model._orig_mod if compiled else model  # a compiled model's patterns are read from its eager code
        ctx.trace = tracing.record(eager, ctx.args, ctx.kwargs)
        ctx.loops = source.model_loops(eager)
        ctx.dynamo = None if compiled else dynamo.analyze(model, ctx.args, ctx.kwargs)
        ctx.profile = measure.profile_step(model, ctx.args, ctx.kwargs, train=self.train)
        ctx.findings = detect.detect_all(eager, ctx.trace, ctx.loops, ctx.dynamo, ctx.profile, compiled)
        return ctx.findings

    def analyze_component(self, module: torch.nn.Module, example_inputs) -> dict:
        """What the assistant sees in ``module`` on ``example_inputs``, without changing anything.

        Returns a dict: ``compilation_readiness`` (graphs, breaks with reasons and lines, recompiles),
        ``fusion_opportunities`` and ``memory_bottlenecks`` (findings with their evidence), ``kernel_efficiency``
        (kernels per step and GPU-busy share from the profiler on a GPU; recorded calls otherwise), and
        ``optimization_suggestions`` (one line per finding: what, where, the fix).
        """
        ctx = self._prepare(module, example_inputs)
        findings = self._find(module, ctx)
        dyn = ctx.dynamo
        fusion = {
            "manual_attention",
            "manual_norm",
            "unfused_activation",
            "separate_qkv",
            "unfused_cross_entropy",
            "expert_loop",
            "python_loop",
        }
        memory = {"manual_attention", "unfused_cross_entropy"}
        largest = sorted(ctx.trace.tensors.values(), key=lambda t: -t.numel() * t.element_size())[:5]
        out = {
            "compilation_readiness": {
                "compiled": _is_compiled(module),
                "graphs": dyn.graphs if dyn else None,
                "fullgraph": dyn.fullgraph if dyn else None,
                "graph_breaks": [{"reason": b.reason, "location": b.location} for b in (dyn.breaks if dyn else [])],
                "recompiles": dyn.recompiles if dyn else None,
                "recompile_reasons": dyn.recompile_reasons if dyn else [],
                "error": dyn.error if dyn else "",
            },
            "fusion_opportunities": [f.to_dict() for f in findings if f.kind in fusion],
            "memory_bottlenecks": [f.to_dict() for f in findings if f.kind in memory]
            + [
                {
                    "kind": "largest_tensor",
                    "shape": tuple(t.shape),
                    "dtype": str(t.dtype).replace("torch.", ""),
                    "MiB": t.numel() * t.element_size() / 2**20,
                }
                for t in largest
            ],
            "kernel_efficiency": self._efficiency(ctx),
            "optimization_suggestions": [f"{f.kind} at {f.location}: {f.fix}" for f in findings],
        }
        ctx.trace = None  # drops the recorded tensors
        return out

    @staticmethod
    def _efficiency(ctx: _Context) -> dict:
        p = ctx.profile
        if p is None:
            return {
                "measured_on": "cpu",
                "recorded_calls_per_forward": len(ctx.trace.ops),
                "note": "kernel counts and GPU-busy time are measured on a GPU",
            }
        return {
            "measured_on": "cuda",
            "kernels_per_step": p.kernels_per_step,
            "device_ms": p.busy_ms,
            "wall_ms": p.wall_ms,
            "gpu_busy": p.busy,
            "top_kernels": p.top[:10],
        }

    # ---- validating and timing -------------------------------------------------------------------------------
    def _cost(self, model, args, kwargs) -> measure.StepCost:
        on_gpu = measure.device_of(model, args, kwargs).type == "cuda"
        warmup = self.warmup_ms if self.warmup_ms is not None else (100 if on_gpu else 5)
        rep = self.rep_ms if self.rep_ms is not None else (500 if on_gpu else 20)
        if self._comparing:  # one of several alternating rounds: a quarter of the time each
            warmup, rep = warmup / 4, rep / 4
        return measure.step_cost(model, args, kwargs, train=self.train, warmup_ms=warmup, rep_ms=rep)

    def _compare(self, current, candidate, args, kwargs) -> measure.Comparison:
        """The step of ``candidate`` against ``current`` in alternating rounds (``measure.compare``), each round a
        quarter of a single measurement's timing."""
        self._comparing = True
        try:
            return measure.compare(
                lambda: self._cost(current, args, kwargs), lambda: self._cost(candidate, args, kwargs),
                max_seconds=self.compare_seconds,
            )  # fmt: skip
        finally:
            self._comparing = False

    def _validate(self, original, optimized, args, kwargs, loss_only: bool, autocast: bool) -> ValidationReport:
        base = rewrites.Autocast(original) if autocast else original
        if loss_only:
            base, optimized = _LossOnly(base), _LossOnly(optimized)
        inputs = dict(kwargs) if kwargs and not args else (args if not kwargs else None)
        if inputs is None:  # both positional and keyword arguments: bind the keywords
            inner_b, inner_o = base, optimized
            base = _Bound(inner_b, kwargs)
            optimized = _Bound(inner_o, kwargs)
            inputs = args
        return self.validator.validate_model(optimized, base, inputs)

    def validate_optimization(self, original, optimized, example_inputs) -> dict:
        """Correctness (errors of outputs and gradients against the original, float64 where it fits), speedup of
        a training step, peak-memory change, and whether the optimized model ran (compiled) at all."""
        args, kwargs = split_inputs(example_inputs)
        check_model_and_inputs(original, args, kwargs)
        with torch.no_grad():
            out = original(*args, **kwargs)
        loss_only = measure.returns_loss(out)
        result = {"compile_success": True, "error": ""}
        try:
            report = self._validate(original, optimized, args, kwargs, loss_only, autocast=False)
        except Exception as exc:
            return {**result, "compile_success": False, "error": f"{type(exc).__name__}: {exc}", "passed": False}
        before = self._cost(original, args, kwargs)
        after = self._cost(optimized, args, kwargs)
        return {
            **result,
            "passed": report.passed,
            "validation": report,
            "max_abs_error": _nanmax(r.max_abs_error for r in report),
            "max_rel_error": _nanmax(r.rel_error for r in report),
            "speedup": before.ms / after.ms,
            "step_ms_before": before.ms,
            "step_ms_after": after.ms,
            "peak_memory_change": (after.peak_bytes - before.peak_bytes) / before.peak_bytes
            if before.peak_bytes == before.peak_bytes and before.peak_bytes > 0
            else math.nan,
        }

    # ---- optimizing ------------------------------------------------------------------------------------------
    def optimize_model(
        self,
        model: torch.nn.Module,
        example_inputs,
        interactive: bool = False,
        apply: bool = True,
        techniques: list[str] | None = None,
    ) -> OptimizationResult:
        """Find, measure each fix alone, combine the ones that help (see the module docstring).

        ``apply=False`` stops after measuring each fix alone. ``techniques`` limits which rewrites are tried.
        ``interactive=True`` (in a notebook) measures, then shows a form to pick which fixes to apply.
        """
        ctx = self._prepare(model, example_inputs)
        findings = self._find(model, ctx)
        ctx.trace = None
        args, kwargs = ctx.args, ctx.kwargs
        with torch.no_grad():
            loss_only = measure.returns_loss(model(*args, **kwargs))
        baseline = self._cost(model, args, kwargs)
        opportunities = []
        candidates = [f for f in findings if f.technique and (techniques is None or f.technique in techniques)]
        for f in findings:
            if f not in candidates:
                note = "no automatic rewrite: " + f.fix if not f.technique else "not among the techniques asked for"
                opportunities.append(Opportunity.from_finding(f, note=note))
        for f in _progress(candidates, "measuring each fix alone", self.progress):
            opportunities.append(self._measure_alone(model, f, ctx, baseline, loss_only))
        result = OptimizationResult(
            model_name=type(model).__name__,
            device=str(ctx.device),
            findings=findings,
            optimization_opportunities=opportunities,
            baseline=baseline,
            optimized_model=model,
            env=_environment(ctx.device),
            args=args,
            kwargs=kwargs,
            loss_only=loss_only,
            _assistant=self,
            _original=model,
        )
        if interactive:
            from .widgets import choose

            choose(result)
        elif apply:
            self.combine(result, [o for o in opportunities if o.validated and o.estimated_speedup])
        return result

    def _rewrite(self, model, findings: list[Finding]) -> tuple[torch.nn.Module, bool]:
        """A rewritten copy. A compiled model is rewritten in its eager code and compiled again afterwards
        (default options), unless one of the fixes compiles it itself."""
        compiled = _is_compiled(model)
        new = copy.deepcopy(model._orig_mod if compiled else model)
        autocast = False
        for f in sorted(findings, key=lambda f: rewrites.REWRITES[f.technique][2]):
            new, _ = rewrites.apply(new, f)
            autocast |= f.technique == "bf16_autocast"
        if compiled and not any(f.technique in ("compile", "cuda_graphs") for f in findings):
            new = torch.compile(new)
        return new, autocast

    def _measure_alone(self, model, finding: Finding, ctx: _Context, baseline, loss_only) -> Opportunity:
        opp = Opportunity.from_finding(finding)
        try:
            new, autocast = self._rewrite(model, [finding])
        except rewrites.RewriteError as exc:
            opp.note = f"not applicable: {exc}"
            return opp
        try:
            report = self._validate(model, new, ctx.args, ctx.kwargs, loss_only, autocast)
        except Exception as exc:
            opp.validated, opp.note = False, f"validation could not run: {type(exc).__name__}: {exc}"
            return opp
        opp.validation, opp.validated = report, report.passed
        if not report.passed:
            opp.note = "failed validation, not applied: " + report.summary()
            return opp
        try:
            fell_back = _reference_runs(lambda: measure.train_step(new, ctx.args, ctx.kwargs))
            comparison = self._compare(model, new, ctx.args, ctx.kwargs)
        except Exception as exc:
            opp.validated, opp.note = False, f"the rewritten model failed to run a step: {type(exc).__name__}: {exc}"
            return opp
        opp.cost, opp.comparison = comparison.candidate, comparison
        if fell_back:  # a kernel swap whose kernel never ran is not credited with what the reference did
            opp.note = (f"validated; not credited: {', '.join(fell_back)} ran the plain PyTorch reference, not the "
                        "Triton kernel (CPU tensors without TRITON_INTERPRET=1)")  # fmt: skip
            return opp
        opp.estimated_speedup = comparison.ratio
        verdict = "" if comparison.faster else "; no faster alone"
        opp.note = f"validated{verdict}: {comparison.describe()}" + _timed_where(model, ctx)
        return opp

    def combine(self, result: OptimizationResult, chosen: list[Opportunity]) -> OptimizationResult:
        """Apply ``chosen`` one after another (module swaps first, best first within a group), keeping each one
        that validates and cuts the step time by more than NOISE (or the peak memory by more than LEANER, no
        slower than NOISE); fills the waterfall and the final model."""
        model, args, kwargs = result._original, result.args, result.kwargs
        kept: list[Opportunity] = []
        current_ms = result.baseline.ms
        steps = [WaterfallStep("original", current_ms, result.baseline.peak_bytes, True, "")]
        compile_like = [o for o in chosen if o.technique in ("compile", "cuda_graphs")]
        on_cuda = measure.device_of(model, args, kwargs).type == "cuda"
        if on_cuda and compile_like and not any(o.technique == "cuda_graphs" for o in compile_like):
            # Kernels swapped in by the rewrites launch from Python: a model that was GPU-bound can become
            # host-bound, which the original's profile could not show. CUDA graphs are tried as the compile step.
            graphs = Opportunity.from_finding(Finding(
                kind="small_launches", location="(model)",
                evidence="tried as the compile step after the rewrites: their kernels launch from Python",
            ), note="tried when combining")  # fmt: skip
            result.optimization_opportunities.append(graphs)
            compile_like.append(graphs)
        order = sorted(
            (o for o in chosen if o.technique not in ("compile", "cuda_graphs")),
            key=lambda o: (rewrites.REWRITES[o.technique][2], -(o.estimated_speedup or 0)),
        )
        for o in chosen:
            o.applied = False
        final_model, final_report, final_cost = model, None, result.baseline
        current_peak = result.baseline.peak_bytes

        def attempt(opp):
            """The kept fixes plus ``opp``: (model, validation, comparison against the current model) or None."""
            try:
                candidate, auto = self._rewrite(model, [k.finding for k in kept] + [opp.finding])
                report = self._validate(model, candidate, args, kwargs, result.loss_only, auto)
                comparison = self._compare(final_model, candidate, args, kwargs) if report.passed else None
            except Exception as exc:
                steps.append(WaterfallStep(opp.technique, math.nan, math.nan, False, f"{type(exc).__name__}: {exc}"))
                return None
            if comparison is None:
                steps.append(WaterfallStep(opp.technique, math.nan, math.nan, False, "failed validation combined"))
                return None
            return candidate, report, comparison

        def keep_if_faster(opp, label: str, not_faster: str) -> None:
            """Try ``opp`` on top of the kept fixes; keep it when ``_worth_keeping``."""
            nonlocal current_ms, current_peak, final_model, final_report, final_cost
            tried = attempt(opp)
            if tried is None:
                return
            candidate, report, comparison = tried
            cost = comparison.candidate
            keep = _worth_keeping(comparison, current_peak)
            reason = _why(comparison, current_peak) if keep else f"{not_faster} ({comparison.describe()})"
            steps.append(WaterfallStep(label, cost.ms, cost.peak_bytes, keep, reason))
            if keep:
                kept.append(opp)
                opp.applied = True
                current_ms, current_peak, final_model, final_report, final_cost = (
                    cost.ms, cost.peak_bytes, candidate, report, cost
                )  # fmt: skip

        for opp in _progress(order, "combining fixes", self.progress):
            keep_if_faster(opp, opp.technique, "not faster on top of the others")
        # The compile step: its modes are alternatives; the fastest one on top of the kept fixes wins.
        tries = [(opp, attempt(opp)) for opp in compile_like]
        tries = [(opp, t) for opp, t in tries if t is not None]
        best = max(tries, key=lambda item: item[1][2].ratio, default=None)
        best_wins = best is not None and _worth_keeping(best[1][2], current_peak)
        for opp, (_, _, comparison) in tries:
            win = opp is best[0] and best_wins
            reason = _why(comparison, current_peak) if win else (
                f"not faster on top of the others ({comparison.describe()})" if opp is best[0]
                else f"another compile mode was faster ({best[1][2].describe()})"
            )  # fmt: skip
            steps.append(WaterfallStep(opp.technique, comparison.candidate.ms, comparison.candidate.peak_bytes, win,
                                       reason))  # fmt: skip
        if best_wins:
            best[0].applied = True
            kept.append(best[0])
            cost = best[1][2].candidate
            current_ms, current_peak = cost.ms, cost.peak_bytes
            final_model, final_report, final_cost = best[1][0], best[1][1], cost
            # Compilation changes what a fix is worth: one dropped as not faster on an eager, host-bound model
            # (its extra launches cost more than the bytes it saved) may pay off once launches are free. Each is
            # tried once more, the compile step last in its rewrite order.
            for opp in [o for o in order if not o.applied]:
                keep_if_faster(opp, f"{opp.technique} (again, compiled)", "not faster once compiled either")
        for o in chosen:
            if not o.applied and o.note.startswith("validated"):
                o.note += "; not kept when combined (see the waterfall)"
        result.optimized_model = final_model
        result.final_validation = final_report
        result.waterfall = steps
        # The measurement that kept the last fix, not a new one: the report then agrees with the waterfall (an
        # H100 run timed a host-bound eager Llama at 40.4 ms when kept and 51.3 ms again), and its peak includes a
        # CUDA graph's memory pool, allocated while capturing, which a second measurement would not see.
        result.final = final_cost
        return result


class _Bound(torch.nn.Module):
    """A model with some keyword arguments fixed: the validator then sees positional inputs only."""

    def __init__(self, model, kwargs):
        super().__init__()
        self.model, self.kw = model, kwargs

    def forward(self, *args):
        return self.model(*args, **self.kw)


def _is_compiled(model) -> bool:
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


def _nanmax(values) -> float:
    """The largest value that is not NaN (informational checks carry NaN errors)."""
    return max((v for v in values if v == v), default=math.nan)


def _environment(device: torch.device) -> dict:
    from .. import bench

    return bench.environment(device.type)


def _progress(items, desc, show):
    if not show or len(items) < 2:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False)


__all__ = ["CompilerOptimizationAssistant", "KINDS", "split_inputs"]
