"""The ``kernel_lib_cuda::`` operators from Python: fake implementations, autograd, functions and a module.

The C++ library (``csrc/ops.cpp``, loaded by ``_build.load``) defines four operators and their CPU and CUDA
implementations. This file adds what makes them first-class PyTorch ops: a fake implementation each (shapes and
dtypes only, for torch.compile's tracing), and autograd through ``torch.library.register_autograd`` (the
forward's saved ``rstd`` and ``y`` feed the backward operators). The functions below flatten leading dims and
give the ops rows with unit stride along the last dim.

``variant`` picks a step of the CUDA ladder (``VARIANTS``; ``"best"`` lets the library choose by width and dtype).
On the CPU every variant runs the same C++ loop.
"""

from __future__ import annotations

import torch

from . import _build

VARIANTS = {"naive": 0, "block_shared": 1, "warp_shuffle": 2, "vectorized": 3, "registers": 4, "online": 5,
            "tma": 6, "best": -1}  # fmt: skip
_READY = False


def ensure_loaded() -> _build.BuildInfo:
    """Build or load the library, then register the fake and autograd implementations (once per process)."""
    global _READY
    info = _build.load()
    if _READY:
        return info
    lib = "kernel_lib_cuda"

    @torch.library.register_fake(f"{lib}::rms_norm_fwd")
    def _(x, weight, eps, variant):
        return x.new_empty(x.shape), x.new_empty(x.shape[0], dtype=torch.float32)

    @torch.library.register_fake(f"{lib}::rms_norm_bwd")
    def _(dy, x, weight, rstd, variant):
        return x.new_empty(x.shape), x.new_empty(x.shape[1], dtype=torch.float32)

    @torch.library.register_fake(f"{lib}::softmax_fwd")
    def _(x, variant):
        return x.new_empty(x.shape)

    @torch.library.register_fake(f"{lib}::softmax_bwd")
    def _(y, dy):
        return y.new_empty(y.shape)

    def rms_setup(ctx, inputs, output):
        x, weight, _eps, variant = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.variant = variant
        ctx.mark_non_differentiable(output[1])

    def rms_backward(ctx, dy, _drstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.kernel_lib_cuda.rms_norm_bwd(dy.contiguous(), x, weight, rstd, ctx.variant)
        return dx, dw.to(weight.dtype), None, None

    torch.library.register_autograd(f"{lib}::rms_norm_fwd", rms_backward, setup_context=rms_setup)

    def softmax_setup(ctx, inputs, output):
        ctx.save_for_backward(output)

    def softmax_backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return torch.ops.kernel_lib_cuda.softmax_bwd(y, dy.contiguous()), None

    torch.library.register_autograd(f"{lib}::softmax_fwd", softmax_backward, setup_context=softmax_setup)
    _READY = True
    return info


def _variant(variant: str) -> int:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    return VARIANTS[variant]


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] <= 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, variant: str = "best") -> torch.Tensor:
    """RMSNorm over the last dim in CUDA C++ (C++ on the CPU): ``x * rsqrt(mean(x²) + eps) * weight``."""
    ensure_loaded()
    y, _ = torch.ops.kernel_lib_cuda.rms_norm_fwd(_rows(x, "x"), weight, float(eps), _variant(variant))
    return y.view(x.shape)


def softmax(x: torch.Tensor, variant: str = "best") -> torch.Tensor:
    """Softmax over the last dim in CUDA C++ (C++ on the CPU), computed in float32, returned in x's dtype."""
    ensure_loaded()
    return torch.ops.kernel_lib_cuda.softmax_fwd(_rows(x, "x"), _variant(variant)).view(x.shape)


class RMSNorm(torch.nn.Module):
    """``nn.RMSNorm``-compatible module over the last dim, backed by the CUDA C++ operator."""

    def __init__(self, dim: int, eps: float = 1e-6, variant: str = "best", device=None, dtype=None):
        super().__init__()
        _variant(variant)  # a bad name fails here, not at the first forward
        self.eps, self.variant = eps, variant
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.variant)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, variant={self.variant}"
