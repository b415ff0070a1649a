"""Time a model's training step, read its peak memory, and profile where a step's time goes.

A step is what the reader's training loop does to the model: forward, the loss, backward (the optimizer is left
out: no fix touches it). The loss is the model's own when it returns one (a scalar, or ``.loss`` of a Hugging Face
output); otherwise the mean of each floating output, so every output gets a gradient.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..bench import timing as clock  # the timing module alone: no pandas, plots or ceilings


def loss_of(output) -> torch.Tensor:
    """The scalar a training step differentiates (see the module docstring)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    tensors = []
    stack = [output.to_tuple() if hasattr(output, "to_tuple") else output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.is_floating_point() and item.requires_grad:
                tensors.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    if not tensors:
        raise ValueError("the model's output has no floating tensor that needs a gradient: nothing to train")
    if len(tensors) == 1 and tensors[0].dim() == 0:
        return tensors[0]
    return sum(t.float().mean() for t in tensors)


def returns_loss(output) -> bool:
    """Whether the model computes its own loss (then the loss is what validation compares)."""
    loss = getattr(output, "loss", None)
    return (isinstance(loss, torch.Tensor) and loss.dim() == 0) or (
        isinstance(output, torch.Tensor) and output.dim() == 0
    )


def train_step(model: torch.nn.Module, args: tuple, kwargs: dict):
    """One forward and backward; gradients are dropped (set to None) first, as ``zero_grad()`` does."""
    for p in model.parameters():
        p.grad = None
    loss = loss_of(model(*args, **kwargs))
    loss.backward()
    return loss


def forward_only(model: torch.nn.Module, args: tuple, kwargs: dict):
    with torch.no_grad():
        return model(*args, **kwargs)


StepCost, Profile = clock.StepCost, clock.KernelProfile


def device_of(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for t in list(model.parameters()) + [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]:
        return t.device
    return torch.device("cpu")


def step_cost(model, args, kwargs, *, train: bool = True, warmup_ms: float = 50, rep_ms: float = 300) -> StepCost:
    """Median time of a step (forward + backward, or forward alone) and its peak memory (``clock.step_cost``)."""
    fn = (lambda: train_step(model, args, kwargs)) if train else (lambda: forward_only(model, args, kwargs))
    cost = clock.step_cost(fn, device_of(model, args, kwargs), warmup_ms=warmup_ms, rep_ms=rep_ms)
    if train:
        for p in model.parameters():
            p.grad = None
    return cost


def profile_step(model, args, kwargs, *, train: bool = True, steps: int = 3) -> Profile | None:
    """Kernels per step and device-busy time (``clock.profile_kernels``); None without a GPU."""
    device = device_of(model, args, kwargs)
    if device.type != "cuda":
        return None
    fn = (lambda: train_step(model, args, kwargs)) if train else (lambda: forward_only(model, args, kwargs))
    profile = clock.profile_kernels(fn, device, steps)
    if train:
        for p in model.parameters():
            p.grad = None  # the profile leaves the reader's model as it found it
    return profile


# ---- comparing two steps: a ratio with a confidence interval -------------------------------------------------
NOISE = 0.02  # ratios within 2% of 1 are a tie, however tight the interval
MIN_ROUNDS, MAX_ROUNDS = 3, 12  # paired rounds before a decision may stop the comparison; the most it takes
T_975 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26, 11: 2.23, 12: 2.20}


@dataclass
class Comparison:
    """Two steps timed in alternating rounds: ``ratio`` is the geometric mean of the per-round ratios
    baseline / candidate (above 1: the candidate is faster), [low, high] its 95% confidence interval (Student's
    t on the log-ratios). ``baseline`` and ``candidate``: each side's median round."""

    ratio: float
    low: float
    high: float
    rounds: int
    baseline: StepCost
    candidate: StepCost

    @property
    def faster(self) -> bool:
        """The interval excludes 1 on the fast side, and the ratio is more than the NOISE band."""
        return self.low > 1 and self.ratio > 1 + NOISE

    @property
    def slower(self) -> bool:
        """The interval lies below the NOISE band: slower beyond noise."""
        return self.high < 1 / (1 + NOISE)

    @property
    def tie(self) -> bool:
        """The interval lies inside the NOISE band: as fast, within noise."""
        return self.low > 1 / (1 + NOISE) and self.high < 1 + NOISE

    def describe(self) -> str:
        return f"{self.ratio:.2f}x (95% CI {self.low:.2f}-{self.high:.2f}, {self.rounds} rounds)"


def compare(baseline: Callable[[], StepCost], candidate: Callable[[], StepCost], *, min_rounds: int = MIN_ROUNDS,
            max_rounds: int = MAX_ROUNDS, max_seconds: float = 60.0) -> Comparison:  # fmt: skip
    """Time ``baseline`` and ``candidate`` (each returns one round's StepCost) in alternating order (ABBA, so a
    drift of the machine falls on both sides) until the confidence interval of their ratio decides (faster,
    slower or a tie) after at least ``min_rounds`` pairs, or ``max_rounds`` pairs or ``max_seconds`` have passed.
    One noisy round cannot flip the result: the interval widens with the spread of the rounds."""
    start = time.perf_counter()
    logs, base_costs, cand_costs = [], [], []
    while True:
        first, second = (baseline, candidate) if len(logs) % 2 == 0 else (candidate, baseline)
        a, b = first(), second()
        base, cand = (a, b) if first is baseline else (b, a)
        base_costs.append(base)
        cand_costs.append(cand)
        logs.append(math.log(base.ms / cand.ms))
        result = _summarize(logs, base_costs, cand_costs)
        n = len(logs)
        if n >= max_rounds or (n >= min_rounds and (result.faster or result.slower or result.tie)):
            return result
        if n >= min_rounds and time.perf_counter() - start > max_seconds:
            return result


def _summarize(logs: list, base_costs: list, cand_costs: list) -> Comparison:
    n = len(logs)
    mean = sum(logs) / n
    half = math.inf
    if n > 1:
        sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
        half = T_975.get(n, 2.0) * sd / math.sqrt(n)
    median = lambda costs: sorted(costs, key=lambda c: c.ms)[len(costs) // 2]  # noqa: E731
    return Comparison(ratio=math.exp(mean), low=math.exp(mean - half), high=math.exp(mean + half), rounds=n,
                      baseline=median(base_costs), candidate=median(cand_costs))  # fmt: skip
