"""Rotary position embedding (RoPE) in Triton, rotate-half convention, forward and backward in one pass each.

With x (B, H, N, D), D even, split into halves x1 = x[..., :D/2] and x2 = x[..., D/2:], and cos, sin (N, D/2)::

    out[..., :D/2] = x1 * cos - x2 * sin
    out[..., D/2:] = x2 * cos + x1 * sin

Each (x1, x2) pair is rotated by the angle whose cosine and sine are given, so the backward is the rotation by the
opposite angle: the same kernel with sin negated. The kernel reads x once (and the small cos/sin tables, which
stay in cache) and writes out once; eager PyTorch materializes the two halves, their products and a concatenation.
Gradients for cos and sin (rarely trained) are computed with plain PyTorch when they require grad.

Registered as the ``kernel_lib::rope`` custom op with a fake implementation, which the one
``autograd.Function`` calls under torch.compile, so ``torch.compile(fullgraph=True)`` traces through it. Source:
Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021); the rotate-half layout is
GPT-NeoX's and Llama's.
"""

import functools

import torch
import triton
import triton.language as tl

from ._utils import check_same_device, check_shape, check_tensor, launch_or_op, use_triton

__all__ = ["rope", "rope_ref", "rope_cos_sin"]

BLOCK_N = 16  # positions per program


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The definition, in plain PyTorch: computed in float32 (float64 for float64 input), returned in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(compute).chunk(2, dim=-1)  # (B, H, N, D/2) each
    c, s = cos.to(compute), sin.to(compute)  # (N, D/2), broadcast over B and H
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope_cos_sin(n: int, dim: int, base: float = 10000.0, device=None, dtype=torch.float32):
    """The standard tables: angle[n, i] = n / base**(2i / dim), for positions 0..n-1; returns (cos, sin), (n, dim/2)."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
    angles = torch.arange(n, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (n, dim/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _rope_kernel(
    x_ptr,  # input (B, H, N, D), unit stride along D
    cos_ptr,  # (N, D/2) contiguous
    sin_ptr,  # (N, D/2) contiguous
    out_ptr,  # output (B, H, N, D) contiguous, x's dtype
    stride_b,  # elements between batches of x
    stride_h,  # elements between heads of x
    stride_n,  # elements between positions of x
    H,  # heads
    N,  # positions
    HALF: tl.constexpr,  # D / 2, a model constant: compiled in, so the halves' offsets are known
    SIN_SIGN: tl.constexpr,  # 1.0 forward; -1.0 backward (rotation by the opposite angle)
    BLOCK_N: tl.constexpr,  # positions per program
    BLOCK_HALF: tl.constexpr,  # power of two >= D / 2
):
    bh = tl.program_id(0).to(tl.int64)  # one (batch, head) pair per row of the grid
    b, h = bh // H, bh % H
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, BLOCK_HALF)
    mask = (n[:, None] < N) & (i[None, :] < HALF)
    x_rows = x_ptr + b * stride_b + h * stride_h + n[:, None].to(tl.int64) * stride_n
    x1 = tl.load(x_rows + i[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    # Every (batch, head) program re-reads its block of the tables; they stay in L2. Loading the block once for
    # several heads measured no faster (benchmarks/NOTES.md).
    c = tl.load(cos_ptr + n[:, None] * HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    s = SIN_SIGN * tl.load(sin_ptr + n[:, None] * HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    out_rows = out_ptr + (bh * N + n[:, None].to(tl.int64)) * (2 * HALF)
    tl.store(out_rows + i[None, :], (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_rows + HALF + i[None, :], (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    # The tables are made contiguous, so the kernel indexes them by D/2, a compile-time constant.
    B, H, N, D = x.shape
    out = torch.empty((B, H, N, D), device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    stride_b, stride_h, stride_n, stride_d = x.stride()
    if stride_d != 1:
        x = x.contiguous()
        stride_b, stride_h, stride_n, _ = x.stride()
    cos = cos if cos.is_contiguous() else cos.contiguous()  # (N, D/2): a small copy, and a rare one
    sin = sin if sin.is_contiguous() else sin.contiguous()
    half = D // 2
    _rope_kernel[(B * H, (N + BLOCK_N - 1) // BLOCK_N)](
        x, cos, sin, out, stride_b, stride_h, stride_n, H, N,
        HALF=half, SIN_SIGN=-1.0 if inverse else 1.0, BLOCK_N=BLOCK_N, BLOCK_HALF=_block_half(half), num_warps=4,
    )  # fmt: skip
    return out


@functools.cache
def _block_half(half: int) -> int:
    return triton.next_power_of_2(half)


def _table_grads(dy, x, need_cos, need_sin):
    """dcos = sum over B, H of dy1 x1 + dy2 x2;  dsin = sum over B, H of x1 dy2 - x2 dy1 (float32)."""
    if not (need_cos or need_sin):  # the usual case (fixed tables): float32 copies of dy and x cost more than
        return None, None  # the rotation itself
    dy1, dy2 = dy.float().chunk(2, dim=-1)  # (B, H, N, D/2) each
    x1, x2 = x.float().chunk(2, dim=-1)
    dcos = (dy1 * x1 + dy2 * x2).sum(dim=(0, 1)) if need_cos else None  # (N, D/2)
    dsin = (x1 * dy2 - x2 * dy1).sum(dim=(0, 1)) if need_sin else None
    return dcos, dsin


# --------------------------------------------------------------------------------------------------
# torch.library registration: an opaque op with a fake implementation, what torch.compile records
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::rope", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    return _rotate(x, cos, sin, inverse)


@_rope_op.register_fake
def _(x, cos, sin, inverse):
    return x.new_empty(x.shape)


# --------------------------------------------------------------------------------------------------
# Autograd: the launcher in eager mode, the op under torch.compile (see _utils.launch_or_op); the backward is
# the same rotation by the opposite angle
# --------------------------------------------------------------------------------------------------
class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        tables_need_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(x if tables_need_grad else None, cos, sin)  # x only for the tables' gradients
        return launch_or_op(_rotate, _rope_op)(x, cos, sin, False)

    @staticmethod
    def backward(ctx, dy):
        x, cos, sin = ctx.saved_tensors
        dx = launch_or_op(_rotate, _rope_op)(dy, cos, sin, True)
        dcos, dsin = _table_grads(dy, x, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        return (
            dx,
            (dcos.to(cos.dtype) if dcos is not None else None),
            (dsin.to(sin.dtype) if dsin is not None else None),
        )


# --------------------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------------------
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, N, D) by the angles of cos, sin (N, D/2), rotate-half convention; returns x's dtype.

    x may have any strides (e.g. q and k sliced from a fused QKV projection); D must be even.
    """
    check_tensor(x, "x", ndim=4)
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"the rotary dim (x's last dim) must be even, got {D}")
    check_tensor(cos, "cos", ndim=2)
    check_tensor(sin, "sin", ndim=2)
    check_shape(cos, "cos", (x.shape[2], D // 2))
    check_shape(sin, "sin", (x.shape[2], D // 2))
    check_same_device(x=x, cos=cos, sin=sin)
    if not use_triton(x, op="rope"):  # CPU without the interpreter: the reference, differentiated by autograd
        return rope_ref(x, cos, sin)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad)
    if not needs_grad and not torch.compiler.is_compiling():
        return _rotate(x, cos, sin, inverse=False)  # eager inference: no autograd node to build
    return _Rope.apply(x, cos, sin)
