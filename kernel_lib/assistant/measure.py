"""Time a model's training step, read its peak memory, and profile where a step's time goes.

A step is what the reader's training loop does to the model: forward, the loss, backward (the optimizer is left
out: no fix touches it). The loss is the model's own when it returns one (a scalar, or ``.loss`` of a Hugging Face
output); otherwise the mean of each floating output, so every output gets a gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import bench


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


@dataclass
class StepCost:
    ms: float  # median step time
    spread: float  # (p80 - p20) / median
    peak_bytes: float  # peak memory above the model and inputs (nan on the CPU: no allocator statistics)
    timer: str

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / 2**30


def device_of(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.device:
    for t in list(model.parameters()) + [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]:
        return t.device
    return torch.device("cpu")


def step_cost(model, args, kwargs, *, train: bool = True, warmup_ms: float = 50, rep_ms: float = 300) -> StepCost:
    """Median time of a step (forward + backward, or forward alone) and its peak memory."""
    fn = (lambda: train_step(model, args, kwargs)) if train else (lambda: forward_only(model, args, kwargs))
    device = device_of(model, args, kwargs)
    fn()  # the first call compiles, autotunes, allocates: not part of the step's cost
    # a step reads far more than the L2 holds: flushing it changes nothing but costs a memset per sample
    timing = bench.time_fn(fn, warmup_ms=warmup_ms, rep_ms=rep_ms, flush_l2=False, device=device.type)
    peak = float(bench.peak_memory_bytes(fn, device)) if device.type == "cuda" else math.nan
    if train:
        for p in model.parameters():
            p.grad = None
    return StepCost(timing.median_ms, timing.spread, peak, timing.timer)


@dataclass
class Profile:
    kernels_per_step: int
    device_ms: float  # time the GPU was busy with kernels, per step
    wall_ms: float  # host time per step
    top: list[tuple[str, float, int]] = field(default_factory=list)  # (kernel, ms per step, calls per step)

    @property
    def busy(self) -> float:
        """Share of the step the GPU spends running kernels (1.0: never waits for the host)."""
        return self.device_ms / self.wall_ms if self.wall_ms > 0 else math.nan


def profile_step(model, args, kwargs, *, train: bool = True, steps: int = 3) -> Profile | None:
    """Kernels per step and device-busy time from ``torch.profiler``; None without a GPU."""
    device = device_of(model, args, kwargs)
    if device.type != "cuda":
        return None
    import time

    from torch.profiler import ProfilerActivity, profile

    fn = (lambda: train_step(model, args, kwargs)) if train else (lambda: forward_only(model, args, kwargs))
    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device)
        wall = (time.perf_counter() - start) * 1e3 / steps
    if train:
        for p in model.parameters():
            p.grad = None  # the profile leaves the reader's model as it found it
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    per_name: dict[str, list[float]] = {}
    for e in kernels:
        per_name.setdefault(e.name, []).append(e.time_range.elapsed_us())  # a kernel event's own span
    top = sorted(((n, sum(v) / 1e3 / steps, len(v) // steps) for n, v in per_name.items()), key=lambda r: -r[1])
    device_ms = sum(r[1] for r in top)
    return Profile(len(kernels) // steps, device_ms, wall, top[:10])
