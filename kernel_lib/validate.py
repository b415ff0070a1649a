"""Correctness before speed: compare a kernel with a float64 reference, and with PyTorch's own rounding.

The rule every kernel in kernel_lib passes, forward and backward::

    max|kernel - ref64|  <=  factor * max|torch_lowp - ref64|  +  atol  +  rtol * max|ref64|     (factor = 2)

``ref64`` is the float64 reference on the same inputs; ``torch_lowp`` is what plain PyTorch computes in
the kernel's own low precision (e.g. the ``*_ref`` run in bfloat16). A kernel may round differently from
PyTorch, but not much worse. A NaN or infinity where the reference is finite fails, whatever the numbers.

:func:`poisoned_like` fills an output with NaN before a kernel writes it, so an element the kernel
forgot stays NaN and fails the check instead of passing as a leftover zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class ErrorStats:
    """How far ``out`` is from a reference."""

    max_abs: float  # max |out - ref|, inf where out has a NaN/inf the reference does not
    rel_l2: float  # ||out - ref|| / ||ref||
    n_bad: int  # elements that are NaN or infinite in out but finite in ref

    def __str__(self) -> str:
        return f"max abs {self.max_abs:.3e}, rel l2 {self.rel_l2:.3e}" + (
            f", {self.n_bad} non-finite" if self.n_bad else ""
        )


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> ErrorStats:
    """Error of ``out`` against ``ref`` in float64; non-finite values the reference lacks count as bad."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shapes differ: out {tuple(out.shape)} against reference {tuple(ref.shape)}")
    # on out's device: a GPU compares 67M elements in milliseconds, a copy to the CPU takes seconds
    out64 = out.detach().to(torch.float64)
    ref64 = ref.detach().to(device=out.device, dtype=torch.float64)
    ref_finite = torch.isfinite(ref64)
    # Where the reference is inf (e.g. -inf logits), a matching inf is exact; anything else is bad.
    same_special = (~ref_finite) & ((out64 == ref64) | (torch.isnan(out64) & torch.isnan(ref64)))
    bad = (ref_finite & ~torch.isfinite(out64)) | (~ref_finite & ~same_special)
    n_bad = int(bad.sum())
    diff = torch.where(ref_finite & torch.isfinite(out64), out64 - ref64, torch.zeros_like(out64))
    max_abs = math.inf if n_bad else (float(diff.abs().max()) if diff.numel() else 0.0)
    ref_norm = float(torch.where(ref_finite, ref64, torch.zeros_like(ref64)).norm())
    rel = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    return ErrorStats(max_abs=max_abs, rel_l2=math.inf if n_bad else rel, n_bad=n_bad)


@dataclass
class Check:
    """The verdict of one comparison, with everything needed to read it."""

    name: str
    ok: bool
    kernel: ErrorStats
    baseline: ErrorStats | None
    allowed: float
    factor: float
    atol: float

    def __str__(self) -> str:
        verdict = "ok  " if self.ok else "FAIL"
        base = f"; torch {self.baseline}" if self.baseline is not None else ""
        return f"{verdict} {self.name}: kernel {self.kernel}{base}; allowed max abs {self.allowed:.3e}"


def check(
    out: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor | None = None,
    *,
    name: str = "out",
    factor: float = 2.0,
    atol: float = 1e-6,
    rtol: float = 0.0,
) -> Check:
    """Apply the rule: ``out`` vs float64 ``ref`` within ``factor`` × ``baseline``'s error + ``atol``.

    ``rtol`` scales with the reference's largest finite magnitude. Without a ``baseline`` the allowance is
    ``atol + rtol * max|ref|`` alone (use it for exact results such as indices).
    """
    kernel = error_stats(out, ref)
    base = error_stats(baseline, ref) if baseline is not None else None
    base_err = base.max_abs if base is not None else 0.0
    ref64 = ref.detach().to(torch.float64)
    finite = ref64[torch.isfinite(ref64)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    allowed = factor * base_err + atol + rtol * scale
    ok = kernel.n_bad == 0 and kernel.max_abs <= allowed
    return Check(name=name, ok=ok, kernel=kernel, baseline=base, allowed=allowed, factor=factor, atol=atol)


def report(checks: Iterable[Check]) -> str:
    """One line per check, failures marked."""
    return "\n".join(str(c) for c in checks)


def assert_close(out: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor | None = None, **rule) -> Check:
    """:func:`check` (``rule``: its keywords ``name``, ``factor``, ``atol``, ``rtol``), raising AssertionError with
    the readable report when the rule fails."""
    result = check(out, ref, baseline, **rule)
    if not result.ok:
        raise AssertionError(str(result))
    return result


def poisoned_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output that looks unwritten: shaped like ``x``, filled with NaN (-1 for integer dtypes)."""
    out = torch.empty_like(x, dtype=dtype or x.dtype)
    if out.is_floating_point() or out.is_complex():
        return out.fill_(float("nan"))
    return out.fill_(-1)


def assert_all_written(out: torch.Tensor, name: str = "out") -> None:
    """Raise AssertionError if a NaN poison value survived in ``out`` (an element nobody wrote)."""
    if out.is_floating_point():
        n = int(torch.isnan(out).sum())
        if n:
            raise AssertionError(f"{name}: {n} of {out.numel()} elements still hold the NaN poison")


def random_inputs(*shapes, dtype=torch.float32, device="cpu", seed: int | None = None, scale: float = 1.0):
    """Fresh standard-normal tensors (never zeros), one per shape; a seed only when asked for."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    tensors = [
        torch.randn(*s, generator=generator, device=device, dtype=torch.float32).mul_(scale).to(dtype) for s in shapes
    ]
    return tensors[0] if len(tensors) == 1 else tensors
