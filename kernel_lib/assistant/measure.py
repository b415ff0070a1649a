"""Time a model's training step, read its peak memory, and profile where a step's time goes.

A step is what the reader's training loop does to the model: forward, the loss, backward (the optimizer is left
out: no fix touches it). The loss is the model's own when it returns one (a scalar, or ``.loss`` of a Hugging Face
output); otherwise the mean of each floating output, so every output gets a gradient.
"""

from __future__ import annotations

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
