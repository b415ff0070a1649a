"""What ``optimize_model`` returns: the opportunities with their measured speedups, the waterfall of the combined
fixes, the before/after table, and the same as text (terminal), HTML (notebook) and JSON (``--json``)."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

import torch

from .findings import Finding


@dataclass
class Opportunity:
    """One suggestion: the finding, the fix, and what applying that fix alone measured."""

    finding: Finding
    technique: str  # the automatic rewrite ("" when a person has to make the change)
    kind: str
    location: str  # module path and source line
    evidence: str
    estimated_speedup: float | None = None  # step time of the original / with this fix alone (measured, the
    # geometric mean of alternating rounds; None when not measured or not credited)
    applied: bool = False  # kept in the optimized model
    validated: bool | None = None  # None: not validated (no rewrite, or not applicable)
    note: str = ""
    validation: object = field(default=None, repr=False)  # the ValidationReport of this fix alone
    cost: object = field(default=None, repr=False)  # its measured StepCost (the median round)
    comparison: object = field(default=None, repr=False)  # the measure.Comparison against the original

    @classmethod
    def from_finding(cls, f: Finding, note: str = "") -> Opportunity:
        return cls(f, f.technique, f.kind, f.location, f.evidence, note=note)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "technique": self.technique or "(by hand)",
            "location": self.location,
            "evidence": self.evidence,
            "estimated_speedup": self.estimated_speedup,
            "speedup_95ci": None if self.comparison is None else [self.comparison.low, self.comparison.high],
            "validated": self.validated,
            "applied": self.applied,
            "note": self.note,
            "fix": self.finding.fix,
        }


@dataclass
class WaterfallStep:
    technique: str  # "original", then each fix tried on top of those kept
    step_ms: float
    peak_bytes: float
    kept: bool
    reason: str  # why not kept


@dataclass
class OptimizationResult:
    model_name: str
    device: str
    findings: list[Finding]
    optimization_opportunities: list[Opportunity]
    baseline: object  # StepCost of the original
    optimized_model: torch.nn.Module
    env: dict
    args: tuple = field(repr=False, default=())
    kwargs: dict = field(repr=False, default_factory=dict)
    loss_only: bool = False  # the model returns its own loss: validation compared losses and gradients
    final: object = None  # StepCost of the optimized model
    final_validation: object = None  # ValidationReport of the optimized model against the original
    waterfall: list[WaterfallStep] = field(default_factory=list)
    _assistant: object = field(repr=False, default=None)
    _original: torch.nn.Module = field(repr=False, default=None)

    # ---- tables ----------------------------------------------------------------------------------------------
    def to_dataframe(self):
        """One row per opportunity: kind, technique, where, evidence, measured speedup alone, validated, applied."""
        import pandas as pd

        return pd.DataFrame([o.to_dict() for o in self.optimization_opportunities])

    @property
    def speedup(self) -> float:
        final = self.final or self.baseline
        return self.baseline.ms / final.ms

    @property
    def before_after(self):
        """Step time, speedup and peak memory of the original and the optimized model."""
        import pandas as pd

        final = self.final or self.baseline
        rows = []
        for name, cost in (("original", self.baseline), ("optimized", final)):
            rows.append(
                {
                    "model": name,
                    "step ms": cost.ms,
                    "speedup": self.baseline.ms / cost.ms,
                    "peak memory GiB": cost.peak_gib,
                    "timer": cost.timer,
                }
            )
        return pd.DataFrame(rows).set_index("model")

    def apply(self, techniques: list[str]):
        """Apply the validated fixes with these technique names (what the notebook form calls)."""
        chosen = [o for o in self.optimization_opportunities if o.technique in techniques and o.validated]
        return self._assistant.combine(self, chosen)

    # ---- text, HTML, JSON ------------------------------------------------------------------------------------
    def _header(self) -> str:
        env = self.env
        return (
            f"{self.model_name} on {env.get('device', self.device)} (torch {env.get('torch')}, triton "
            f"{env.get('triton')})"
        )

    def verdict(self) -> str:
        applied = [o for o in self.optimization_opportunities if o.applied]
        if not applied:
            faster = [o for o in self.optimization_opportunities if o.comparison is not None and o.comparison.faster
                      and o.estimated_speedup]  # fmt: skip
            if not self.waterfall:  # nothing was combined: a report, not a decision
                names = ", ".join(f"{o.technique} {o.estimated_speedup:.2f}x" for o in faster)
                return "Report only, no fix applied" + (f"; faster alone, with confidence: {names}." if names else ".")
            if any(o.estimated_speedup for o in self.optimization_opportunities):
                return (
                    "No fix applied: none made the step faster with confidence (its ratio's 95% interval above 1 "
                    "and beyond the 2% noise), or leaner and not slower, so the model is left as it was."
                )
            return "No fix applied."
        final = self.final or self.baseline
        valid = self.final_validation
        return (
            f"{len(applied)} fix(es) applied: step {self.baseline.ms:.3f} -> {final.ms:.3f} ms "
            f"({self.speedup:.2f}x)" + (f"; {valid.summary()}" if valid is not None else "")
        )

    def report(self) -> str:
        lines = [self._header(), ""]
        lines.append(f"{'kind':<22} {'fix':<27} {'alone':>7}  {'applied':<8} where / evidence")
        for o in self.optimization_opportunities:
            sp = f"{o.estimated_speedup:.2f}x" if o.estimated_speedup else "-"
            lines.append(
                f"{o.kind:<22} {(o.technique or '(by hand)'):<27} {sp:>7}  {('yes' if o.applied else 'no'):<8} "
                f"{o.location}"
            )
            lines.append(f"{'':<68}{o.evidence}")
            if o.note:
                lines.append(f"{'':<68}-> {o.note}")
        if self.waterfall:
            lines += ["", "combined, in order:"]
            width = max(28, *(len(s.technique) for s in self.waterfall))  # long names keep the columns aligned
            for s in self.waterfall:
                ms = "failed" if math.isnan(s.step_ms) else f"{s.step_ms:.3f} ms"
                verdict = ("kept: " if s.kept else "dropped: ") + s.reason if s.reason else "kept"
                lines.append(f"  {s.technique:<{width}} {ms:>12}  {verdict}")
        lines += ["", self.verdict()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()

    def _repr_html_(self) -> str:
        rows = []
        for o in self.optimization_opportunities:
            colour = "#e6f4ea" if o.applied else ("#fdecea" if o.validated is False else "")
            sp = f"{o.estimated_speedup:.2f}×" if o.estimated_speedup else "–"
            cells = [f"<code>{o.kind}</code>", html.escape(o.technique or "(by hand)"), html.escape(o.location),
                     html.escape(o.evidence), sp, "yes" if o.applied else "no", html.escape(o.note)]  # fmt: skip
            rows.append(f"<tr style='background:{colour}'>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        head = "".join(f"<th>{h}</th>" for h in ("kind", "fix", "where", "evidence", "alone", "applied", "note"))
        return (
            f"<div><b>{html.escape(self._header())}</b><table><tr>{head}</tr>{''.join(rows)}</table>"
            f"<p>{html.escape(self.verdict())}</p>{self.before_after.to_html(float_format='{:,.3f}'.format)}</div>"
        )

    def to_json(self) -> dict:
        final = self.final or self.baseline
        return {
            "model": self.model_name,
            "environment": self.env,
            "findings": [f.to_dict() for f in self.findings],
            "opportunities": [o.to_dict() for o in self.optimization_opportunities],
            "waterfall": [vars(s) for s in self.waterfall],
            "step_ms": {"original": self.baseline.ms, "optimized": final.ms},
            "peak_bytes": {"original": self.baseline.peak_bytes, "optimized": final.peak_bytes},
            "final_validation": None if self.final_validation is None else self.final_validation.summary(),
            "verdict": self.verdict(),
        }

    # ---- plot ------------------------------------------------------------------------------------------------
    def plot_waterfall(self, ax=None):
        """Step time after each kept fix: which fix gave what."""
        import matplotlib.pyplot as plt

        steps = [s for s in self.waterfall if s.kept]
        if ax is None:
            _, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * max(len(steps), 1)))
        prev = None
        for i, s in enumerate(steps):
            if prev is None:
                ax.barh(i, s.step_ms, color="#9e9e9e")
                label = f"{s.step_ms:.2f} ms"
            else:
                ax.barh(i, prev - s.step_ms, left=s.step_ms, color="#2e7d32")
                ax.barh(i, s.step_ms, color="#c8e6c9")
                label = f"{s.step_ms:.2f} ms (-{prev - s.step_ms:.2f})"
            ax.text(max(s.step_ms, prev or 0) * 1.01, i, label, va="center", fontsize=8)
            prev = s.step_ms
        ax.set_yticks(range(len(steps)), [s.technique for s in steps])
        ax.invert_yaxis()
        ax.set_xlabel("training step, ms (forward + backward)")
        ax.set_xlim(0, (steps[0].step_ms if steps else 1) * 1.25)
        return ax
