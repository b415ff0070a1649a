"""RMSNorm in Triton: one pass over the input forward, one pass backward.

    y = x / sqrt(mean(x², over the last dim) + eps) * weight                 x: (..., D), weight: (D,) or None

Forward reads x (and the weight once per program) and writes y, plus one float32 per row, ``rstd =
1/sqrt(mean(x²) + eps)``, saved for backward. Every reduction accumulates in float32; y is rounded once to
x's dtype. Backward, with ``xhat = x * rstd`` and ``g = dy * weight``::

    dx      = rstd * (g - xhat * mean(g * xhat))                              one pass per row
    dweight = sum over rows of dy * xhat                                      reduced in two stages

The weight gradient is a reduction over all rows: each of a few programs per SM loops over its share of rows
and keeps a float32 partial sum in registers; the partials, (programs, D) float32, are summed over the programs
by a small finish kernel, in float32 and in a fixed order, which writes dweight in the weight's dtype. That
avoids atomics, so results are deterministic.

Registered as the ``kernel_lib::rms_norm_fwd`` / ``kernel_lib::rms_norm_bwd`` custom ops with fake
(meta) implementations and autograd, so ``torch.compile(fullgraph=True)`` traces through it without a graph
break. Sources: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); the kernel structure follows
Triton's layer-norm tutorial and flash-attention's ``ops/triton/layer_norm.py``.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import (
    as_rows,
    check_same_device,
    check_shape,
    check_tensor,
    persistent_programs,
    row_block_settings,
    use_triton,
)

__all__ = ["rms_norm", "rms_norm_ref", "RMSNorm"]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """The definition, in plain PyTorch: computed in float32 (float64 for float64 input), returned in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,  # input, (n_rows, D) with unit stride along D
    w_ptr,  # weight (D,); unused when HAS_WEIGHT is False
    y_ptr,  # output, (n_rows, D) contiguous, x's dtype
    rstd_ptr,  # output, (n_rows,) float32: 1 / rms of each row, saved for backward
    x_row_stride,  # elements between the starts of consecutive rows of x
    n_rows,  # number of rows
    D,  # row width
    eps,  # added to the mean square
    HAS_WEIGHT: tl.constexpr,  # multiply by weight or not
    BLOCK_D: tl.constexpr,  # power of two >= D: a whole row per block
    BLOCK_M: tl.constexpr,  # rows per program (more than one only for narrow rows)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)  # row * stride overflows int32 past 2**31 elements
    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)  # (BLOCK_M,)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = y * w[None, :]
    tl.store(y_ptr + rows64[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,  # upstream gradient, (n_rows, D) with unit stride along D
    x_ptr,  # forward input, (n_rows, D) with unit stride along D
    w_ptr,  # weight (D,); unused when HAS_WEIGHT is False
    rstd_ptr,  # (n_rows,) float32 saved by the forward
    dx_ptr,  # output, (n_rows, D) contiguous, x's dtype
    dw_partial_ptr,  # output, (programs, D) float32: each program's share of dweight
    dy_row_stride,  # elements between rows of dy
    x_row_stride,  # elements between rows of x
    n_rows,  # number of rows
    D,  # row width
    rows_per_program,  # each program handles rows pid * rows_per_program + [0, rows_per_program)
    HAS_WEIGHT: tl.constexpr,  # weight present: scale dy by it
    WEIGHT_GRAD: tl.constexpr,  # accumulate dweight (weight present and requiring a gradient)
    WIDE: tl.constexpr,  # rows too wide to hold twice in registers: no prefetch, weight re-read each row
    BLOCK_D: tl.constexpr,  # power of two >= D
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if HAS_WEIGHT and not WIDE:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    row = pid.to(tl.int64) * rows_per_program  # int64: row * stride overflows int32 past 2**31 elements
    row_end = tl.minimum(row + rows_per_program, n_rows)  # the last program's share may run past the end
    # Software pipelining by hand: the next row's loads are issued before this row's reduction, so they are in
    # flight while it waits (measured on an H200, D = 4096: 0.231 ms against 0.262 ms without; NOTES.md). A wide
    # row (D > WIDE_ROW) cannot be held twice: the registers spill, and the kernel ran 13x slower at D = 16384.
    if not WIDE:
        x_next = tl.load(x_ptr + row * x_row_stride + cols, mask=mask & (row < row_end), other=0.0)
        dy_next = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask & (row < row_end), other=0.0)
    for _ in range(0, rows_per_program):
        nxt = row + 1
        if WIDE:
            x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask & (row < row_end), other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask & (row < row_end), other=0.0).to(tl.float32)
            if HAS_WEIGHT:  # from L1 or L2: one row of registers fewer
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            x_next = tl.load(x_ptr + nxt * x_row_stride + cols, mask=mask & (nxt < row_end), other=0.0)
            dy_next = tl.load(dy_ptr + nxt * dy_row_stride + cols, mask=mask & (nxt < row_end), other=0.0)
        rstd = tl.load(rstd_ptr + row, mask=row < row_end, other=0.0)
        xhat = x * rstd
        g = dy * w if HAS_WEIGHT else dy
        dx = (g - xhat * (tl.sum(g * xhat, axis=0) / D)) * rstd
        tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask & (row < row_end))
        if WEIGHT_GRAD:
            dw_acc += dy * xhat
        row = nxt
    if WEIGHT_GRAD:
        tl.store(dw_partial_ptr + pid * D + cols, dw_acc, mask=mask)


@triton.jit
def _rms_norm_bwd_finish_kernel(
    dw_partial_ptr,  # (programs, D) float32 from the backward kernel
    dw_ptr,  # output, (D,) in weight's dtype: dweight
    programs,  # partial rows: the backward kernel's grid
    D,  # row width
    BLOCK_P: tl.constexpr,  # partial rows read per loop step
    BLOCK_D: tl.constexpr,  # columns per program
):
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):  # a fixed order: the same sum on every run
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < programs)[:, None] & col_mask[None, :]
        acc += tl.load(dw_partial_ptr + p[:, None] * D + cols[None, :], mask=mask, other=0.0)
    tl.store(dw_ptr + cols, tl.sum(acc, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------------------------
# Launchers (inputs already checked by the functional API)
# --------------------------------------------------------------------------------------------------
# The finish kernel's tile: partial rows per loop step, columns per program. The best of 8 tiles tried on an H100
# (528 programs, D = 4096): 3.9 µs, against 10.2 µs for PyTorch's dw_partial.sum(0).to(dtype).
_FINISH_BLOCK_P, _FINISH_BLOCK_D = 128, 16
# Rows wider than this run the backward's WIDE loop (no prefetch, weight re-read): at D = 16384 on an H200 the
# prefetching loop spilled registers and took 3.6 ms, the WIDE loop 0.25 ms (benchmarks/explore_wide_norms.py).
WIDE_ROW = 8192


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows = as_rows(x)  # (n_rows, D)
    n_rows, D = rows.shape
    # Allocated in their final shapes, contiguous: the kernel writes them as (n_rows, D) and (n_rows,).
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    rstd = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    if n_rows == 0:
        return y, rstd
    if not use_triton(x, op="rms_norm"):
        xf = rows.float()
        rstd.view(-1).copy_(torch.rsqrt(xf.pow(2).mean(dim=-1) + eps))
        y.view(-1, D).copy_(rms_norm_ref(rows, weight, eps))
        return y, rstd
    block_d, block_m, num_warps = row_block_settings(D, x.element_size())
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
        rows, weight if weight is not None else rows, y, rstd, rows.stride(0), n_rows, D, eps,
        HAS_WEIGHT=weight is not None, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=num_warps,
    )  # fmt: skip
    return y, rstd


def _backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, weight_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    weight_grad = weight is not None and weight_grad  # False for a frozen weight: dweight is not computed
    rows, dy_rows = as_rows(x), as_rows(dy)  # (n_rows, D) each
    n_rows, D = rows.shape
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)  # contiguous: the kernel writes it as (n_rows, D)
    if n_rows == 0:
        return dx, (torch.zeros_like(weight) if weight_grad else dx.new_empty(0))
    if not use_triton(x, op="rms_norm"):
        rstd = rstd.reshape(-1)  # (n_rows,)
        xhat = rows.float() * rstd[:, None]
        g = dy_rows.float() * (weight.float() if weight is not None else 1.0)
        dx.view(-1, D).copy_((g - xhat * (g * xhat).mean(dim=-1, keepdim=True)) * rstd[:, None])
        dw = (dy_rows.float() * xhat).sum(0).to(weight.dtype) if weight_grad else dx.new_empty(0)
        return dx, dw
    block_d, _, num_warps = row_block_settings(D, x.element_size())
    wide = block_d > WIDE_ROW
    if wide:  # 8 warps measured fastest for the wide loop (H200, D = 16384: 0.248 ms; 16 warps 0.300 ms)
        num_warps = min(num_warps, 8)
    programs = persistent_programs(x.device, n_rows)
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    dw_partial = torch.empty((programs, D), device=x.device, dtype=torch.float32) if weight_grad else dx
    _rms_norm_bwd_kernel[(programs,)](
        dy_rows, rows, weight if weight is not None else rows, rstd, dx, dw_partial,
        dy_rows.stride(0), rows.stride(0), n_rows, D, rows_per_program,
        HAS_WEIGHT=weight is not None, WEIGHT_GRAD=weight_grad, WIDE=wide, BLOCK_D=block_d,
        num_warps=num_warps,
    )  # fmt: skip
    if not weight_grad:
        return dx, dx.new_empty(0)
    dw = torch.empty(D, device=x.device, dtype=weight.dtype)
    _rms_norm_bwd_finish_kernel[(triton.cdiv(D, _FINISH_BLOCK_D),)](
        dw_partial, dw, programs, D, BLOCK_P=_FINISH_BLOCK_P, BLOCK_D=_FINISH_BLOCK_D, num_warps=4
    )
    return dx, dw


# --------------------------------------------------------------------------------------------------
# torch.library registration: opaque ops with fake implementations, so torch.compile sees one node each.
# (typing.Optional in these signatures: the schema inference of older torch releases does not read `X | None`.)
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(x, weight, eps)


@_rms_norm_fwd_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("kernel_lib::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], rstd: torch.Tensor, weight_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, x, weight, rstd, weight_grad)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, weight_grad):
    dw = weight.new_empty(weight.shape) if weight is not None and weight_grad else x.new_empty(0)
    return x.new_empty(x.shape), dw


# --------------------------------------------------------------------------------------------------
# Autograd of the op (used under torch.compile): forward saves x and rstd; backward calls the backward op
# --------------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)


def _backward_rule(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    weight_grad = ctx.needs_input_grad[1]
    dx, dw = _rms_norm_bwd_op(dy, x, weight, rstd, weight_grad)
    return dx, (dw if weight is not None and weight_grad else None), None


_rms_norm_fwd_op.register_autograd(_backward_rule, setup_context=_setup_context)


class _RMSNorm(torch.autograd.Function):
    """Eager-mode autograd over the same launchers, without the custom op's Python dispatch, which cost about
    0.24 ms per forward + backward when measured on the CPU: comparable to the kernels (benchmarks/NOTES.md)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        weight_grad = ctx.needs_input_grad[1]
        dx, dw = _backward(dy, x, weight, rstd, weight_grad)
        return dx, (dw if weight is not None and weight_grad else None), None


# --------------------------------------------------------------------------------------------------
# Functional API and module
# --------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any strides; float32, float16 or bfloat16), times ``weight`` (D,).

    Accumulates in float32 and returns x's dtype. Differentiable in x and weight.
    """
    check_tensor(x, "x", min_ndim=1)
    if weight is not None:
        check_tensor(weight, "weight", ndim=1)
        check_shape(weight, "weight", (x.shape[-1],))
        check_same_device(x=x, weight=weight)
    if not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps}")
    if torch.compiler.is_compiling():  # torch.compile sees one custom op (with its registered autograd)
        return _rms_norm_fwd_op(x, weight, float(eps))[0]
    return _RMSNorm.apply(x, weight, float(eps))


class RMSNorm(torch.nn.Module):
    """``nn.RMSNorm``-compatible module over the last dim, backed by the Triton kernel."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
