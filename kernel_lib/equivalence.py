"""Equivalence of an optimized component, or a whole model, with its original: every output and every gradient.

(Named ``validation`` before: beside :mod:`kernel_lib.validate`, the single-tensor rule this module applies, the
two names read as one; ``kernel_lib.validation`` still imports, as an alias of this module.)

Three runs on the same inputs, all in ``eval()`` mode so that dropout is off and the runs are comparable:

(a) the **reference**: a deep copy of the original with its floating parameters, buffers and floating inputs
    cast to float64 (``reference_dtype``). Where a float64 copy would not fit (twice the parameters' float64
    bytes against the GPU's free memory; on the CPU it is assumed to fit), or where an op has no float64 kernel,
    the reference is float32 instead and every description says so;
(b) the **original** (``baseline``) itself, in its own low precision: how much plain PyTorch rounds;
(c) the **optimized** module.

Every floating output and every gradient passes the course's rule (:func:`kernel_lib.validate.check`)::

    max|optimized - reference|  <=  factor * max|original - reference|  +  atol  +  rtol * max|reference|

Gradients come from one ``torch.autograd.grad`` call per run, w.r.t. the floating inputs and the floating
parameters: the upstream gradient of each floating output is a fixed random tensor (seeded by ``seed`` and the
output's name, drawn in float64, cast to the output's dtype, so the three runs see the same values), or the
gradient of ``loss_fn(outputs)`` when one is given, or 1 when the only output is a scalar. Parameters are
matched by name, then by a unique dotted suffix (an optimized ``model.layers.0.w`` is the original's
``layers.0.w``). Integer and bool outputs must equal the original's exactly.

What fails as a result, never as an exception: a different output structure, shape, dtype or device; an
optimized module that raises; NaN/inf where the reference is finite; a gradient present in one model and not
in the other. Exceptions are kept for misuse: a non-Module, inputs on another device than the parameters, an
original that fails on its own inputs.

The caller's modules come back as they were: train/eval mode of every submodule, ``requires_grad``, ``.grad``
(never populated: no ``.backward()``), and the global RNG state (each run starts from ``seed`` in a forked RNG).
Caveat: the reference runs the original's code in float64, so code that branches on the dtype (``nn.RMSNorm``
with ``eps=None`` takes eps from the input's dtype) runs its float64 branch there.
"""

from __future__ import annotations

import copy
import dataclasses
import html
import math
import zlib
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .validate import check

# About one rounding step at unit scale, so an element the original happens to compute exactly (its own error
# 0) may still round once: bfloat16's eps is 7.8e-3, float16's 9.8e-4. float32 (eps 1.2e-7) and float64 get
# ~100x their eps, room for sums of thousands of terms added in another order.
DEFAULT_ATOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5, torch.float64: 1e-10}


@dataclass
class ValidationResult:
    """One comparison: what was compared, the verdict, and the numbers behind it (nan where not used)."""

    name: str  # "output", "output[1]", "grad input 0", "grad blocks.0.attn.q.weight", "causal mask"
    description: str  # one line: what was compared and how
    passed: bool
    max_abs_error: float = math.nan  # optimized vs the reference
    rel_error: float = math.nan  # relative L2 of optimized vs the reference
    baseline_error: float = math.nan  # the original in its own precision vs the reference
    tolerance: float = math.nan  # the allowance applied: factor * baseline_error + atol + rtol * max|reference|
    kind: str = "output"  # output, loss, grad, layout, structure, error, causal, norm, info
    dtype: str = ""  # the optimized tensor's dtype
    reference_dtype: str = ""
    ratio: float = field(init=False)  # max_abs_error / tolerance: above 1 fails

    def __post_init__(self):
        err, tol = self.max_abs_error, self.tolerance
        if math.isnan(err) or math.isnan(tol):
            self.ratio = math.nan
        else:
            self.ratio = err / tol if tol > 0 else (0.0 if err == 0 else math.inf)


def _times(r: ValidationResult) -> str:
    if math.isinf(r.max_abs_error):
        return "with NaN/inf where the reference is finite"
    return "over a zero allowance" if math.isinf(r.ratio) else f"{r.ratio:.2g}x of its allowance"


class ValidationReport(list):
    """A list of :class:`ValidationResult`; ``passed`` only when there is at least one and none failed."""

    @property
    def passed(self) -> bool:
        return len(self) > 0 and all(r.passed for r in self)

    @property
    def failures(self) -> list[ValidationResult]:
        return [r for r in self if not r.passed]

    def worst(self) -> ValidationResult | None:
        """The result closest to (or furthest past) its allowance."""
        rated = [r for r in self if not math.isnan(r.ratio)]
        return max(rated, key=lambda r: r.ratio) if rated else None

    def summary(self) -> str:
        if not self:
            return "no checks ran (an empty report does not pass)"
        n_ok = sum(r.passed for r in self)
        line = f"{n_ok} of {len(self)} checks passed"
        if self.failures:
            line += "; failed: " + ", ".join(r.name for r in self.failures)
        worst = self.worst()
        return line + (f" (worst: {worst.name} {_times(worst)})" if worst is not None else "")

    def to_dataframe(self):
        import pandas as pd  # only here: the rest of kernel_lib does not need pandas

        columns = [f.name for f in dataclasses.fields(ValidationResult)]
        return pd.DataFrame([dataclasses.asdict(r) for r in self], columns=columns)

    def __str__(self) -> str:
        width = max((len(r.name) for r in self), default=0)
        lines = [self.summary()]
        for r in self:
            nums = "" if math.isnan(r.max_abs_error) else f"  err {r.max_abs_error:.2e}"
            nums += "" if math.isnan(r.tolerance) else f"  allowed {r.tolerance:.2e}"
            tail = f"  {r.description}" if not r.passed or r.kind == "info" else ""
            lines.append(f"  {'ok  ' if r.passed else 'FAIL'} {r.name:<{width}}{nums}{tail}".rstrip())
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        def num(x: float) -> str:
            return "" if math.isnan(x) else f"{x:.2e}"

        rows = []
        for r in self:
            style = ' style="background:#fdd"' if not r.passed else ""
            cells = [
                "ok" if r.passed else "<b>FAIL</b>",
                html.escape(r.name),
                num(r.max_abs_error),
                num(r.tolerance),
                "" if math.isnan(r.ratio) else f"{r.ratio:.2g}",
                num(r.baseline_error),
                num(r.rel_error),
                html.escape(r.description),
            ]
            rows.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        head = "".join(
            f"<th>{h}</th>"
            for h in ("", "check", "max abs error", "allowed", "ratio", "original's error", "rel error", "what")
        )
        return f"<table><caption>{html.escape(self.summary())}</caption><tr>{head}</tr>{''.join(rows)}</table>"


@dataclass
class _Run:
    outputs: dict[str, Any]  # flattened and detached
    loss: torch.Tensor | None
    input_grads: dict[str, torch.Tensor | None]
    param_grads: dict[str, torch.Tensor | None]  # every floating parameter; None where not trainable


class ComponentValidator:
    """Compare an optimized module with its original; see the module docstring for the runs and the rule.

    ``atol`` None takes it from the optimized tensor's dtype (:data:`DEFAULT_ATOL`). ``seed`` fixes the upstream
    gradients, the causal check's noise, and the RNG each forward starts from.
    """

    def __init__(self, factor=2.0, atol=None, rtol=0.0, reference_dtype=torch.float64, seed=0):
        self.factor = float(factor)
        self.atol = atol
        self.rtol = float(rtol)
        self.reference_dtype = reference_dtype
        self.seed = int(seed)
        self._ref_dtype, self._note = _dt(reference_dtype), ""  # set per validation by _compare_runs
        self._compute_atol = 0.0  # set per validation by _validate

    # ---- the public validators -------------------------------------------------------------------------

    def validate_model(self, optimized, baseline, inputs, loss_fn=None) -> ValidationReport:
        """Outputs (values, dtype, shape, device), the loss if ``loss_fn`` is given, and every gradient."""
        return self._validate(optimized, baseline, inputs, loss_fn)

    def validate_mlp_component(self, optimized, baseline, inputs) -> ValidationReport:
        """Outputs and gradients (an MLP has nothing more to check than :meth:`validate_model` does)."""
        return self._validate(optimized, baseline, inputs)

    def validate_norm_component(self, optimized, baseline, inputs) -> ValidationReport:
        """Outputs and gradients, plus "norm output": the shape over the last dim and the dtype are the original's."""

        def norm_check(args, kwargs, base, opt):
            x = next((t for t in _tensors((args, kwargs)) if t.is_floating_point()), None)
            b, o = _first_float(base.outputs), _first_float(opt.outputs)
            if x is None or b is None or o is None:
                return [ValidationResult("norm output", "no floating input or output to check", False, kind="norm")]
            why = f"over the last dim (D={x.shape[-1]}): {_layout(o)}, as the original"
            if o.dtype != b.dtype:
                why = f"optimized returns {_dt(o.dtype)} where the original returns {_dt(b.dtype)}"
            elif o.shape != b.shape:
                why = f"optimized returns shape {tuple(o.shape)} where the original returns {tuple(b.shape)}"
            passed = o.dtype == b.dtype and o.shape == b.shape
            return [ValidationResult("norm output", why, passed, kind="norm", dtype=_dt(o.dtype))]

        return self._validate(optimized, baseline, inputs, extra=norm_check)

    def validate_attention_component(self, optimized, baseline, inputs, causal=None, seq_dim=1) -> ValidationReport:
        """Outputs and gradients, plus with ``causal`` True/False a "causal mask" check along ``seq_dim``.

        The floating inputs (token ids when there are none) change at positions >= T//2; with ``causal=True`` the
        optimized output at positions < T//2 must stay bitwise the same (or, for a module that is not bitwise
        reproducible, within ``factor`` times its own run-to-run difference); with ``causal=False`` it must change.
        ``causal=None`` skips the check.
        """
        if causal not in (None, True, False):
            raise TypeError(f"causal must be True, False or None, got {causal!r}")
        if causal is None:
            return self._validate(optimized, baseline, inputs)
        _require_modules(optimized, baseline)
        args, kwargs = _split_inputs(inputs)
        seq_len = _seq_len(args, kwargs, seq_dim)

        def causal_check(args, kwargs, base, opt):
            return [self._causal_check(optimized, baseline, args, kwargs, causal, seq_dim, seq_len)]

        return self._validate(optimized, baseline, inputs, extra=causal_check)

    # ---- the three runs --------------------------------------------------------------------------------

    def _validate(self, optimized, baseline, inputs, loss_fn=None, extra=None) -> ValidationReport:
        _require_modules(optimized, baseline)
        args, kwargs = _split_inputs(inputs)
        device = _check_devices(optimized, baseline, args, kwargs)
        # A float32 output of a bfloat16 model (a loss) carries bfloat16 rounding: atol follows the lowest precision
        # the original computes in, not only the output's dtype.
        floats = [t.dtype for t in (*baseline.parameters(), *args, *kwargs.values())
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]  # fmt: skip
        self._compute_atol = max((_default_atol(d) for d in floats), default=0.0)
        upstream: dict = {}  # one random upstream gradient per output name and shape, shared by the three runs
        with _untouched(optimized, baseline):
            optimized.eval()
            baseline.eval()
            try:
                base = self._run(baseline, args, kwargs, None, loss_fn, upstream)
            except _LossError:
                raise
            except Exception as e:
                raise ValueError(f"the original module fails on these inputs: {type(e).__name__}: {e}") from e
            ref, ref_dtype, note = self._reference(baseline, args, kwargs, loss_fn, upstream, device)
            try:
                opt = self._run(optimized, args, kwargs, None, loss_fn, upstream)
            except Exception as e:
                why = f"optimized module raised {type(e).__name__}: {_first_line(e)}"
                return ValidationReport([ValidationResult("optimized run", why, False, kind="error")])
            report = ValidationReport(self._compare_runs(base, ref, opt, ref_dtype, note, loss_fn))
            if extra is not None:
                report.extend(extra(args, kwargs, base, opt))
        return report

    def _run(self, module, args, kwargs, dtype, loss_fn, upstream, backward=True) -> _Run:
        """One forward and (``backward``) one autograd.grad; floating inputs cast to ``dtype`` (None: as given)."""
        floats: list = []
        a = tuple(_prepare(v, dtype, f"input {i}", floats) for i, v in enumerate(args))
        k = {key: _prepare(v, dtype, f"input {key}", floats) for key, v in kwargs.items()}
        params = [(n, p) for n, p in module.named_parameters() if p.is_floating_point()]
        trainable = [p for _, p in params if p.requires_grad]
        with torch.enable_grad(), self._seeded():
            _mark_step_begin()
            raw = module(*a, **k)
            outputs = _flatten(raw)
            loss = None
            if loss_fn is not None:
                loss = loss_fn(raw)
                if not (isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1):
                    raise _LossError(f"loss_fn must return a floating scalar tensor, got {_describe(loss)}")
                targets, grads_out = [loss], [torch.ones_like(loss)]
            else:
                targets = [t for t in outputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
                if len(targets) == 1 and targets[0].dim() == 0:
                    grads_out = [torch.ones_like(targets[0])]  # a scalar output is a loss already
                else:
                    names = [n for n, t in outputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
                    grads_out = [self._upstream(n, t, upstream) for n, t in zip(names, targets, strict=True)]
            wrt = [t for _, t in floats] + trainable
            if backward and targets and wrt:
                grads = list(torch.autograd.grad(targets, wrt, grads_out, allow_unused=True))
            else:
                grads = [None] * len(wrt)
        # Copies: a model compiled with CUDA graphs returns tensors in its graph's memory, which its next run
        # (the float64 reference's or the other model's, in the same graph tree) overwrites.
        grads = [None if g is None else g.clone() for g in grads]
        input_grads = {n: g for (n, _), g in zip(floats, grads[: len(floats)], strict=True)}
        by_param = dict(zip(map(id, trainable), grads[len(floats) :], strict=True))
        return _Run(
            outputs={n: t.detach().clone() if isinstance(t, torch.Tensor) else t for n, t in outputs.items()},
            loss=None if loss is None else loss.detach().clone(),
            input_grads=input_grads,
            param_grads={n: by_param.get(id(p)) for n, p in params},
        )

    def _reference(self, baseline, args, kwargs, loss_fn, upstream, device):
        """Run (a): a float64 copy where it fits and works, else float32 with a note saying why."""
        dtype, note = self.reference_dtype, ""
        if dtype == torch.float64:
            need = 2 * sum(t.numel() * 8 for t in _floating_state(baseline))
            free = _free_bytes(device)
            if free is not None and need > free:
                dtype = torch.float32
                note = f"reference in float32: a float64 copy needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} free"
        try:
            return self._run(_cast_copy(baseline, dtype), args, kwargs, dtype, loss_fn, upstream), dtype, note
        except Exception as e:
            if dtype == torch.float32:
                raise ValueError(f"the original module fails in float32 (the reference): {_first_line(e)}") from e
            note = f"reference in float32: float64 failed ({type(e).__name__}: {_first_line(e)})"
        try:
            ref = self._run(_cast_copy(baseline, torch.float32), args, kwargs, torch.float32, loss_fn, upstream)
        except Exception as e:
            raise ValueError(f"the original module fails in float32 (the reference): {_first_line(e)}") from e
        return ref, torch.float32, note

    @contextmanager
    def _seeded(self):
        """Each forward starts from ``seed``; the caller's RNG state comes back afterwards."""
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            yield

    def _upstream(self, name: str, out: torch.Tensor, cache: dict) -> torch.Tensor:
        key = (name, tuple(out.shape), out.device)
        if key not in cache:
            gen = torch.Generator(device=out.device)
            gen.manual_seed(self.seed + zlib.crc32(name.encode()))  # the output's name, not the order of draws
            cache[key] = torch.randn(out.shape, generator=gen, device=out.device, dtype=torch.float64)
        return cache[key].to(out.dtype)

    # ---- comparisons -----------------------------------------------------------------------------------

    def _compare_runs(self, base: _Run, ref: _Run, opt: _Run, ref_dtype, note, loss_fn) -> list[ValidationResult]:
        self._ref_dtype, self._note = _dt(ref_dtype), f"; {note}" if note else ""
        results = []
        missing = [n for n in base.outputs if n not in opt.outputs]
        extra = [n for n in opt.outputs if n not in base.outputs]
        if missing or extra:
            why = f"optimized returns {_names(opt.outputs)}; the original returns {_names(base.outputs)}"
            results.append(ValidationResult("output structure", why, False, kind="structure"))
        for n, b in base.outputs.items():
            if n in opt.outputs:
                results += self._compare_output(n, opt.outputs[n], ref.outputs.get(n), b)
        if loss_fn is not None:
            results.append(self._rule("loss", "loss_fn(outputs)", opt.loss, ref.loss, base.loss, "loss"))
        how = "loss_fn" if loss_fn is not None else f"fixed random upstream gradient, seed {self.seed}"
        for n in base.input_grads:
            results += self._compare_grad(
                f"grad {n}", f"gradient of {n} ({how})", opt.input_grads[n], ref.input_grads[n], base.input_grads[n]
            )
        pairs, lone_opt, lone_base = _match_names(list(opt.param_grads), list(base.param_grads))
        for o, b in pairs.items():
            what = f"gradient of {b}" + (f" (optimized: {o})" if o != b else "") + f" ({how})"
            results += self._compare_grad(
                f"grad {b}", what, opt.param_grads[o], ref.param_grads[b], base.param_grads[b]
            )
        if lone_opt or lone_base:
            why = "not compared: no counterpart in the original: " + (_listed(lone_opt) or "none")
            why += f"; original parameters with no counterpart: {_listed(lone_base)}" if lone_base else ""
            results.append(ValidationResult("unmatched parameters", why, True, kind="info"))
        if not pairs and any(g is not None for g in ref.param_grads.values()):
            why = (
                f"no parameter gradient compared: none of the optimized names ({_listed(list(opt.param_grads))})"
                f" matches the original's ({_listed(list(base.param_grads))})"
            )
            results.append(ValidationResult("parameter gradients", why, False, kind="grad"))
        return results

    def _compare_output(self, name, o, r, b) -> list[ValidationResult]:
        if isinstance(o, _LeftOut) and isinstance(b, _LeftOut):
            return [ValidationResult(name, b.why, True, kind="info")]
        if not isinstance(o, torch.Tensor) or not isinstance(b, torch.Tensor):
            if isinstance(o, float) and isinstance(b, float) and isinstance(r, float):
                t = lambda v: torch.tensor(v, dtype=torch.float64)
                return [self._rule(name, name, t(o), t(r), t(b), "output")]
            if type(o) is type(b) and _equal(o, b):
                return []  # equal non-tensor leaves (None, ints, strings): nothing to report
            return [
                ValidationResult(
                    name,
                    f"optimized returns {_describe(o)} where the original returns {_describe(b)}",
                    False,
                    kind="structure",
                )
            ]
        results = [_layout_result(name, o, b)]
        if o.shape != b.shape:
            return results
        if o.is_floating_point() and b.is_floating_point():
            if r is None or r.shape != o.shape:  # the original's code took another branch in float64
                why = f"the {self._ref_dtype} reference returns {'no' if r is None else 'another shape of'} {name}"
                return results + [ValidationResult(name, why, False, kind="structure")]
            results.append(self._rule(name, name, o, r, b, "output"))
        elif not o.is_floating_point() and not b.is_floating_point():
            results.append(_exact(name, o, b))
        return results

    def _compare_grad(self, name, what, o, r, b) -> list[ValidationResult]:
        if o is None and r is None:
            return []
        if o is None or r is None:
            why = (
                f"{what}: none in the optimized module, the original has one"
                if o is None
                else f"{what}: the optimized module has one, the original has none"
            )
            return [ValidationResult(name, why, False, kind="grad")]
        if o.shape != r.shape:
            why = f"{what}: shape {tuple(o.shape)} where the original's is {tuple(r.shape)}"
            return [ValidationResult(name, why, False, kind="grad")]
        return [self._rule(name, what, o, r, b, "grad")]

    def _rule(self, name, what, o, r, b, kind) -> ValidationResult:
        """The course's rule: ``o`` within factor x ``b``'s error against ``r``, plus atol (and rtol)."""
        atol = self.atol if self.atol is not None else max(_default_atol(o.dtype), self._compute_atol)
        c = check(o, r, b, name=name, factor=self.factor, atol=atol, rtol=self.rtol)
        base_err = c.baseline.max_abs if c.baseline is not None else math.nan
        allowance = f"{self.factor:g} x original's {_dt(b.dtype)} error {base_err:.1e}" if b is not None else "0"
        allowance += f" + atol {atol:.0e}" + (f" + rtol {self.rtol:g} x max|ref|" if self.rtol else "")
        bad = f"{c.kernel.n_bad} NaN/inf where the reference is finite; " if c.kernel.n_bad else ""
        why = f"{bad}{what}: optimized {_dt(o.dtype)} vs {self._ref_dtype} reference, allowed {allowance}{self._note}"
        return ValidationResult(
            name, why, c.ok, c.kernel.max_abs, c.kernel.rel_l2, base_err, c.allowed, kind, _dt(o.dtype), self._ref_dtype
        )

    def _causal_check(self, optimized, baseline, args, kwargs, causal, seq_dim, seq_len) -> ValidationResult:
        half = seq_len // 2
        changed_args, changed_kwargs = self._perturb(args, kwargs, seq_dim, seq_len, half)

        def first_output(module, a, k):
            return _first_float(self._run(module, a, k, None, None, {}, backward=False).outputs)

        b0, b1 = first_output(baseline, args, kwargs), first_output(baseline, changed_args, changed_kwargs)
        if b0 is None or not _has_seq(b0, seq_dim, seq_len):
            shape = None if b0 is None else tuple(b0.shape)
            raise ValueError(f"seq_dim={seq_dim}: the original's output {shape} has no sequence of length {seq_len}")
        try:
            o0, o0_again = first_output(optimized, args, kwargs), first_output(optimized, args, kwargs)
            o1 = first_output(optimized, changed_args, changed_kwargs)
        except Exception as e:
            return ValidationResult(
                "causal mask", f"optimized module raised {type(e).__name__}: {_first_line(e)}", False, kind="causal"
            )
        if o0 is None or o0.shape != b0.shape:
            why = f"optimized output {None if o0 is None else tuple(o0.shape)} is not the original's {tuple(b0.shape)}"
            return ValidationResult("causal mask", why, False, kind="causal")
        d = _dim(seq_dim, o0)
        noise = float(_early_change(o0, o0_again, d, half).max())  # 0 for a module that reproduces bitwise
        change = _early_change(o0, o1, d, half)  # per position < half
        tol = self.factor * noise
        rule = "bitwise" if noise == 0 else f"within {self.factor:g}x its run-to-run difference {noise:.1e}"
        moved = (change > tol).nonzero().flatten()
        original = "changes too" if float(_early_change(b0, b1, d, half).max()) > 0 else "does not change"
        if causal:
            passed = moved.numel() == 0
            why = (
                f"output at positions < {half} unchanged ({rule}) when positions >= {half} along dim {seq_dim} changed"
                if passed
                else f"causal mask: output at position {int(moved[0])} changed when only later positions changed"
                f" (by {float(change[moved[0]]):.2e}; expected unchanged, {rule})"
            )
        else:
            tol = math.nan  # here the module must change by more than its noise: a floor, not an allowance
            passed = moved.numel() > 0
            why = (
                f"changing positions >= {half} changed the output at earlier positions, as a non-causal module's does"
                if passed
                else f"causal mask: output at positions < {half} did not change when later positions changed,"
                " yet causal=False"
            )
        return ValidationResult(
            "causal mask",
            f"{why} (the original's {original})",
            passed,
            max_abs_error=float(change.max()),
            tolerance=tol,
            kind="causal",
        )

    def _perturb(self, args, kwargs, seq_dim, seq_len, half):
        """New inputs equal to the given ones at positions < half along ``seq_dim``, different after."""
        gen = torch.Generator()
        gen.manual_seed(self.seed + 1)
        any_float = any(t.is_floating_point() and _has_seq(t, seq_dim, seq_len) for t in _tensors((args, kwargs)))

        def change(t):
            if not isinstance(t, torch.Tensor) or not _has_seq(t, seq_dim, seq_len):
                return t
            d, later = _dim(seq_dim, t), seq_len - half
            if t.is_floating_point():
                scale = float(t.float().std()) if t.numel() > 1 else 1.0
                noise = torch.randn(t.shape, generator=gen).mul_(scale if scale > 0 else 1.0).to(t)
                out = t.clone()
                out.narrow(d, half, later).add_(noise.narrow(d, half, later))
                return out
            if any_float or t.dtype == torch.bool:
                return t
            lo, hi = int(t.min()), int(t.max()) + 1  # token ids: other ids from the range already in use
            out = t.clone()
            out.narrow(d, half, later).copy_(
                torch.randint(lo, max(hi, lo + 2), out.narrow(d, half, later).shape, generator=gen).to(t)
            )
            return out

        return _map(args, change), _map(kwargs, change)


# ---- helpers ---------------------------------------------------------------------------------------------


class _LossError(TypeError):
    """loss_fn returned something other than a scalar: the caller's mistake, raised as it is."""


def _mark_step_begin() -> None:
    """Tell CUDA-graph trees (torch.compile's "reduce-overhead") that a new, independent run starts."""
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    if mark is not None:
        mark()


def _require_modules(optimized, baseline) -> None:
    for arg, module in (("optimized", optimized), ("baseline", baseline)):
        if not isinstance(module, nn.Module):
            raise TypeError(f"{arg} must be a torch.nn.Module, got {type(module).__name__}")


def _split_inputs(inputs) -> tuple[tuple, dict]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    raise TypeError(
        "inputs must be a tensor, a tuple/list of positional arguments or a dict of keyword arguments, "
        f"got {type(inputs).__name__}"
    )


def _map(obj, fn):
    """``fn`` applied to every leaf of nested tuples, lists and dicts."""
    if isinstance(obj, (tuple, list)):
        items = [_map(v, fn) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, Mapping):
        return {k: _map(v, fn) for k, v in obj.items()}
    return fn(obj)


def _tensors(obj) -> list[torch.Tensor]:
    found: list = []
    _map(obj, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def _prepare(obj, dtype, name, floats: list):
    """A run's own copy of the inputs: floating tensors become fresh leaves (cast to ``dtype``) that get gradients."""
    if isinstance(obj, torch.Tensor):
        if not obj.is_floating_point():
            return obj  # token ids, indices, masks: passed unchanged
        leaf = obj.detach().to(dtype or obj.dtype).requires_grad_(True)
        floats.append((name, leaf))
        return leaf.clone()  # a module that writes into its input must not write into the leaf (or the caller's)
    if isinstance(obj, (tuple, list)):
        items = [_prepare(v, dtype, f"{name}[{i}]", floats) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, Mapping):
        return {k: _prepare(v, dtype, f"{name}.{k}", floats) for k, v in obj.items()}
    return obj


@dataclass(frozen=True)
class _LeftOut:
    """An output that is not a result, with why it is not compared."""

    why: str


def _is_kv_cache(obj) -> bool:
    """A Hugging Face key/value cache (``past_key_values``: a ``transformers`` Cache object)."""
    return type(obj).__module__.startswith("transformers") and callable(getattr(obj, "get_seq_length", None))


def _flatten(obj, name="output", out=None) -> dict[str, Any]:
    """Named leaves of a tensor, tuple/list/namedtuple, dict (Hugging Face ModelOutput), to_tuple(), dataclass. A
    Hugging Face key/value cache is state kept for the next call, not a result: left out, and said so."""
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[name] = obj
    elif _is_kv_cache(obj):
        out[name] = _LeftOut(
            "not compared: a key/value cache kept for the next call (a Hugging Face Cache), not a result; "
            "its keys and values are the attention inputs the outputs already depend on"
        )
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{name}.{k}", out)
    elif hasattr(obj, "_fields"):
        for k in obj._fields:
            _flatten(getattr(obj, k), f"{name}.{k}", out)
    elif isinstance(obj, (tuple, list)) or callable(getattr(obj, "to_tuple", None)):
        for i, v in enumerate(obj if isinstance(obj, (tuple, list)) else obj.to_tuple()):
            _flatten(v, f"{name}[{i}]", out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _flatten(getattr(obj, f.name), f"{name}.{f.name}", out)
    else:
        out[name] = obj
    return out


def _first_float(outputs: dict) -> torch.Tensor | None:
    return next((t for t in outputs.values() if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


def _canonical(name: str) -> str:
    """A parameter name without torch.compile's ``_orig_mod`` wrapper component."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _match_names(opt_names: list[str], base_names: list[str]):
    """{optimized name: original name}: exact names first (ignoring torch.compile's ``_orig_mod``), then a unique
    dotted suffix either way (a wrapper adds a prefix)."""
    canon = {b: _canonical(b) for b in base_names}
    by_canon = {c: b for b, c in canon.items()}
    pairs = {o: by_canon[_canonical(o)] for o in opt_names if _canonical(o) in by_canon}
    taken = set(pairs.values())
    left = [b for b in base_names if b not in taken]
    for o in opt_names:
        if o in pairs:
            continue
        co = _canonical(o)
        found = [b for b in left if co.endswith("." + canon[b]) or canon[b].endswith("." + co)]
        if len(found) == 1:
            pairs[o] = found[0]
            left.remove(found[0])
    return pairs, [o for o in opt_names if o not in pairs], left


@contextmanager
def _untouched(*modules: nn.Module):
    """Give back every submodule's mode and every parameter's requires_grad and .grad as they were."""
    seen: dict[int, nn.Module] = {}
    for module in modules:
        for m in module.modules():
            seen.setdefault(id(m), m)
    modes = [(m, m.training) for m in seen.values()]
    params = {id(p): (p, p.requires_grad, p.grad) for m in modules for p in m.parameters()}
    try:
        yield
    finally:
        for m, training in modes:
            m.train(training)  # through train(): a module may override it
        for m, training in modes:
            m.training = training  # and set alone: train() recursed into children, possibly shared ones
        for p, requires_grad, grad in params.values():
            p.requires_grad_(requires_grad)
            if p.grad is not grad:
                p.grad = grad


def _check_devices(optimized, baseline, args, kwargs) -> torch.device:
    """The device the runs use; a ValueError when the inputs live elsewhere than the parameters."""
    param_devices = {t.device for m in (baseline, optimized) for t in m.parameters()}
    first = next((t.device for m in (baseline, optimized) for t in m.parameters()), None)
    for t in _tensors((args, kwargs)):
        if param_devices and t.device not in param_devices:
            raise ValueError(f"inputs are on {t.device}, the model's parameters on {first}")
    if first is not None:
        return first
    return next((t.device for t in _tensors((args, kwargs))), torch.device("cpu"))


def _floating_state(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]


def _free_bytes(device: torch.device) -> int | None:
    """Free memory on a GPU; None on the CPU, where the reference is assumed to fit."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def _cast_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    try:
        clone = copy.deepcopy(module)
    except Exception as e:
        raise ValueError(f"cannot deep-copy the original module for the reference: {_first_line(e)}") from e
    return clone.to(dtype)  # floating parameters and buffers only; integer buffers keep their dtype


def _seq_len(args, kwargs, seq_dim: int) -> int:
    """T, the length along ``seq_dim`` of the first floating input that has that dim (else of an integer one)."""
    tensors = _tensors((args, kwargs))
    for t in sorted(tensors, key=lambda t: not t.is_floating_point()):
        if -t.dim() <= seq_dim < t.dim() and t.dtype != torch.bool:
            if t.shape[seq_dim] < 2:
                raise ValueError(f"seq_dim={seq_dim}: the inputs have length {t.shape[seq_dim]} there, need >= 2")
            return t.shape[seq_dim]
    raise ValueError(f"seq_dim={seq_dim}: no input tensor has that dimension")


def _dim(seq_dim: int, t: torch.Tensor) -> int:
    return seq_dim % t.dim() if t.dim() else 0


def _has_seq(t: torch.Tensor, seq_dim: int, seq_len: int) -> bool:
    return -t.dim() <= seq_dim < t.dim() and t.shape[seq_dim] == seq_len


def _early_change(a: torch.Tensor, b: torch.Tensor, d: int, half: int) -> torch.Tensor:
    """Per position < half along dim d: the largest change from a to b (inf where a NaN appears or goes)."""
    a64, b64 = a.narrow(d, 0, half).double(), b.narrow(d, 0, half).double()
    same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
    diff = torch.where(same, torch.zeros_like(a64), (a64 - b64).abs().nan_to_num(nan=math.inf))
    return diff.movedim(d, 0).reshape(half, -1).amax(1)


def _layout(t: torch.Tensor) -> str:
    return f"{_dt(t.dtype)} {tuple(t.shape)} on {t.device}"


def _layout_result(name: str, o: torch.Tensor, b: torch.Tensor) -> ValidationResult:
    """Dtype, shape and device of one output against the original's."""
    diffs = []
    if o.dtype != b.dtype:
        diffs.append(f"optimized returns {_dt(o.dtype)} where the original returns {_dt(b.dtype)}")
    if o.shape != b.shape:
        diffs.append(f"shape {tuple(o.shape)} where the original's is {tuple(b.shape)}")
    if o.device != b.device:
        diffs.append(f"on {o.device} where the original's is on {b.device}")
    why = "; ".join(diffs) if diffs else f"{_layout(o)}, as the original"
    return ValidationResult(f"{name} dtype/shape/device", why, not diffs, kind="layout", dtype=_dt(o.dtype))


def _exact(name: str, o: torch.Tensor, b: torch.Tensor) -> ValidationResult:
    """Integer and bool outputs (indices, counts, masks): equal to the original's, element for element."""
    o64, b64 = o.to(torch.int64), b.to(device=o.device, dtype=torch.int64)
    differ = o64 != b64
    n = int(differ.sum())
    worst = float((o64 - b64).abs().max()) if o.numel() else 0.0
    why = f"{_dt(o.dtype)} output: " + (f"{n} of {o.numel()} elements differ from" if n else "equal to")
    why += " the original's, element for element"
    return ValidationResult(name, why, n == 0, worst, n / max(o.numel(), 1), math.nan, 0.0, "output", _dt(o.dtype))


def _default_atol(dtype: torch.dtype) -> float:
    return DEFAULT_ATOL.get(dtype, 1e-2 if dtype.itemsize <= 2 else 1e-5)  # float8 and friends: as bfloat16


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _equal(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def _describe(v) -> str:
    return _layout(v) if isinstance(v, torch.Tensor) else f"{type(v).__name__} {v!r}"[:80]


def _names(outputs: dict) -> str:
    return _listed(list(outputs)) or "nothing"


def _listed(names: list[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]
