"""LayerNorm in Triton: one pass over the input forward, one pass backward.

    y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias                   x: (..., D), weight/bias: (D,) or None

Forward reads x (and weight and bias once per program) and writes y, plus two float32 per row, ``mean`` and
``rstd = 1/sqrt(var + eps)`` (biased variance, as ``F.layer_norm``), saved for backward. Every reduction
accumulates in float32; y is rounded once to x's dtype. Backward, with ``xhat = (x - mean) * rstd`` and
``g = dy * weight``::

    dx      = rstd * (g - mean(g) - xhat * mean(g * xhat))                   one pass per row
    dweight = sum over rows of dy * xhat,   dbias = sum over rows of dy      reduced in two stages

The parameter gradients are reductions over all rows: each of a few programs per SM loops over its share of
rows keeping float32 partial sums in registers and writes them to one float32 buffer, (2, programs, D) with
dweight's partials before dbias's (one slice if only one of them is given); a small finish kernel then sums
each column over the programs in float32, in a fixed order, and writes dweight and dbias in the parameters'
dtype (no atomics: deterministic).

Registered as the ``kernel_lib::layer_norm_fwd`` / ``kernel_lib::layer_norm_bwd`` custom ops with fake
implementations and autograd, so ``torch.compile(fullgraph=True)`` traces through it; eager calls use a plain
``torch.autograd.Function`` over the same launchers. Sources: Ba, Kiros & Hinton, "Layer Normalization" (2016);
Triton's layer-norm tutorial; flash-attention's ``ops/triton/layer_norm.py``.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import (
    as_rows,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    persistent_programs,
    row_block_settings,
    use_triton,
)

__all__ = ["layer_norm", "layer_norm_ref", "LayerNorm"]


def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """The definition, in plain PyTorch: computed in float32 (float64 for float64 input), returned in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    mean = xf.mean(dim=-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt((xf - mean).pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr,  # input, (n_rows, D) with unit stride along D
    w_ptr,  # weight (D,); unused when HAS_WEIGHT is False
    b_ptr,  # bias (D,); unused when HAS_BIAS is False
    y_ptr,  # output, (n_rows, D) contiguous, x's dtype
    mean_ptr,  # output, (n_rows,) float32: row means, saved for backward
    rstd_ptr,  # output, (n_rows,) float32: 1 / sqrt(var + eps) of each row, saved for backward
    x_row_stride,  # elements between the starts of consecutive rows of x
    n_rows,  # number of rows
    D,  # row width
    inv_D,  # 1 / D, rounded once on the host: x / D compiles to an approximate division on GPUs
    eps,  # added to the variance
    HAS_WEIGHT: tl.constexpr,  # multiply by weight or not
    HAS_BIAS: tl.constexpr,  # add bias or not
    BLOCK_D: tl.constexpr,  # power of two >= D: a whole row per block
    BLOCK_M: tl.constexpr,  # rows per program (more than one only for narrow rows)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)  # row * stride overflows int32 past 2**31 elements
    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) * inv_D  # (BLOCK_M,)
    centered = tl.where(mask, x - mean[:, None], 0.0)  # padding must not enter the variance
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) * inv_D + eps)
    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr,  # upstream gradient, (n_rows, D) with unit stride along D
    x_ptr,  # forward input, (n_rows, D) with unit stride along D
    w_ptr,  # weight (D,); unused when HAS_WEIGHT is False
    mean_ptr,  # (n_rows,) float32 saved by the forward
    rstd_ptr,  # (n_rows,) float32 saved by the forward
    dx_ptr,  # output, (n_rows, D) contiguous, x's dtype
    partial_ptr,  # output, (WEIGHT_GRAD + BIAS_GRAD, programs, D) float32: each program's share of dweight, then dbias
    dy_row_stride,  # elements between rows of dy
    x_row_stride,  # elements between rows of x
    n_rows,  # number of rows
    D,  # row width
    inv_D,  # 1 / D, rounded once on the host (exact for D = 1, where rstd = 1/sqrt(eps) amplifies any error)
    rows_per_program,  # each program handles rows pid * rows_per_program + [0, rows_per_program)
    HAS_WEIGHT: tl.constexpr,  # weight present: scale dy by it
    WEIGHT_GRAD: tl.constexpr,  # accumulate dweight (weight present and requiring a gradient)
    BIAS_GRAD: tl.constexpr,  # accumulate dbias (bias present and requiring a gradient)
    WIDE: tl.constexpr,  # rows too wide to hold twice in registers: no prefetch, weight re-read each row
    BLOCK_D: tl.constexpr,  # power of two >= D
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if HAS_WEIGHT and not WIDE:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    row = pid.to(tl.int64) * rows_per_program  # int64: row * stride overflows int32 past 2**31 elements
    row_end = tl.minimum(row + rows_per_program, n_rows)  # the last program's share may run past the end
    # The next row's loads are issued before this row's reductions (software pipelining by hand; measured on an
    # H200, D = 4096: 0.261 ms against 0.337 ms without; NOTES.md). A wide row (D > WIDE_ROW) cannot be held
    # twice: the registers spill.
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
        row_mask = mask & (row < row_end)
        mean = tl.load(mean_ptr + row, mask=row < row_end, other=0.0)
        rstd = tl.load(rstd_ptr + row, mask=row < row_end, other=0.0)
        xhat = tl.where(row_mask, (x - mean) * rstd, 0.0)
        g = dy * w if HAS_WEIGHT else dy
        dx = (g - tl.sum(g, axis=0) * inv_D - xhat * (tl.sum(g * xhat, axis=0) * inv_D)) * rstd
        tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
        if WEIGHT_GRAD:
            dw_acc += dy * xhat
        if BIAS_GRAD:
            db_acc += dy
        row = nxt
    if WEIGHT_GRAD:
        tl.store(partial_ptr + pid * D + cols, dw_acc, mask=mask)
    if BIAS_GRAD:
        db_row = pid + tl.num_programs(0) if WEIGHT_GRAD else pid  # dbias's partials follow dweight's
        tl.store(partial_ptr + db_row * D + cols, db_acc, mask=mask)


@triton.jit
def _layer_norm_bwd_finish_kernel(
    partial_ptr,  # (HAS_WEIGHT + HAS_BIAS, programs, D) float32 from the backward kernel
    dw_ptr,  # output, (D,) in weight's dtype: dweight; unused when HAS_WEIGHT is False
    db_ptr,  # output, (D,) in bias's dtype: dbias; unused when HAS_BIAS is False
    programs,  # partial rows per parameter: the backward kernel's grid
    D,  # row width
    HAS_WEIGHT: tl.constexpr,  # sum dweight's partials
    HAS_BIAS: tl.constexpr,  # sum dbias's partials
    BLOCK_P: tl.constexpr,  # partial rows read per loop step
    BLOCK_D: tl.constexpr,  # columns per program
):
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    db_base = partial_ptr + programs * D if HAS_WEIGHT else partial_ptr
    dw_acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):  # a fixed order: the same sums on every run
        p = start + tl.arange(0, BLOCK_P)
        offsets = p[:, None] * D + cols[None, :]
        mask = (p < programs)[:, None] & col_mask[None, :]
        if HAS_WEIGHT:
            dw_acc += tl.load(partial_ptr + offsets, mask=mask, other=0.0)
        if HAS_BIAS:
            db_acc += tl.load(db_base + offsets, mask=mask, other=0.0)
    if HAS_WEIGHT:
        tl.store(dw_ptr + cols, tl.sum(dw_acc, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(db_ptr + cols, tl.sum(db_acc, axis=0).to(db_ptr.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------------------------
# Launchers (inputs already checked by the functional API)
# --------------------------------------------------------------------------------------------------
# The finish kernel's tile: partial rows per loop step, columns per program. The best of 8 tiles tried on an H100
# (528 programs, D = 4096): 4.8 µs for dweight and dbias, against 20.2 µs for PyTorch's sum(0).to(dtype) of each.
_FINISH_BLOCK_P, _FINISH_BLOCK_D = 128, 16
# Rows wider than this run the backward's WIDE loop (no prefetch, weight re-read): at D = 16384 on an H200 the
# prefetching loop spilled registers (benchmarks/explore_wide_norms.py).
WIDE_ROW = 8192


def _forward(x, weight, bias, eps):
    rows = as_rows(x)  # (n_rows, D)
    n_rows, D = rows.shape
    # Allocated in their final shapes, contiguous: the kernel writes them as (n_rows, D) and (n_rows,).
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    mean = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    rstd = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    if n_rows == 0:
        return y, mean, rstd
    if not use_triton(x, op="layer_norm"):
        xf = rows.float()
        mean_f = xf.mean(dim=-1)
        mean.view(-1).copy_(mean_f)
        rstd.view(-1).copy_(torch.rsqrt((xf - mean_f[:, None]).pow(2).mean(dim=-1) + eps))
        y.view(-1, D).copy_(layer_norm_ref(rows, weight, bias, eps))
        return y, mean, rstd
    block_d, block_m, num_warps = row_block_settings(D, x.element_size())
    _layer_norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
        rows, weight if weight is not None else rows, bias if bias is not None else rows, y, mean, rstd,
        rows.stride(0), n_rows, D, 1.0 / D, eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_D=block_d, BLOCK_M=block_m,
        num_warps=num_warps,
    )  # fmt: skip
    return y, mean, rstd


def _backward(dy, x, weight, bias, mean, rstd, weight_grad=True, bias_grad=True):
    # weight_grad / bias_grad False (a frozen parameter): that gradient is neither accumulated nor returned.
    weight_grad, bias_grad = weight is not None and weight_grad, bias is not None and bias_grad
    rows, dy_rows = as_rows(x), as_rows(dy)  # (n_rows, D) each
    n_rows, D = rows.shape
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)  # contiguous: the kernel writes it as (n_rows, D)
    if n_rows == 0:
        dw = torch.zeros_like(weight) if weight_grad else dx.new_empty(0)
        db = torch.zeros_like(bias) if bias_grad else dx.new_empty(0)
        return dx, dw, db
    if not use_triton(x, op="layer_norm"):
        mean, rstd = mean.reshape(-1), rstd.reshape(-1)  # (n_rows,) each
        xhat = (rows.float() - mean[:, None]) * rstd[:, None]
        dyf = dy_rows.float()
        g = dyf * (weight.float() if weight is not None else 1.0)
        dx.view(-1, D).copy_((g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd[:, None])
        dw = (dyf * xhat).sum(0).to(weight.dtype) if weight_grad else dx.new_empty(0)
        db = dyf.sum(0).to(bias.dtype) if bias_grad else dx.new_empty(0)
        return dx, dw, db
    block_d, _, num_warps = row_block_settings(D, x.element_size())
    programs = persistent_programs(x.device, n_rows)
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    sums = weight_grad + bias_grad
    partial = torch.empty((sums, programs, D), device=x.device, dtype=torch.float32) if sums else dx
    _layer_norm_bwd_kernel[(programs,)](
        dy_rows, rows, weight if weight is not None else rows, mean, rstd, dx, partial,
        dy_rows.stride(0), rows.stride(0), n_rows, D, 1.0 / D, rows_per_program,
        HAS_WEIGHT=weight is not None, WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad, WIDE=block_d > WIDE_ROW,
        BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    dw = torch.empty(D, device=x.device, dtype=weight.dtype) if weight_grad else dx.new_empty(0)
    db = torch.empty(D, device=x.device, dtype=bias.dtype) if bias_grad else dx.new_empty(0)
    if sums:
        _layer_norm_bwd_finish_kernel[(triton.cdiv(D, _FINISH_BLOCK_D),)](
            partial, dw, db, programs, D,
            HAS_WEIGHT=weight_grad, HAS_BIAS=bias_grad, BLOCK_P=_FINISH_BLOCK_P,
            BLOCK_D=_FINISH_BLOCK_D, num_warps=4,
        )  # fmt: skip
    return dx, dw, db


# --------------------------------------------------------------------------------------------------
# torch.library registration: opaque ops with fake implementations, so torch.compile sees one node each.
# (typing.Optional in these signatures: the schema inference of older torch releases does not read `X | None`.)
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(x, weight, bias, eps)


@_layer_norm_fwd_op.register_fake
def _(x, weight, bias, eps):
    stats = x.shape[:-1]
    return x.new_empty(x.shape), x.new_empty(stats, dtype=torch.float32), x.new_empty(stats, dtype=torch.float32)


@torch.library.custom_op("kernel_lib::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dy, x, weight, bias, mean, rstd, weight_grad, bias_grad)


@_layer_norm_bwd_op.register_fake
def _(dy, x, weight, bias, mean, rstd, weight_grad, bias_grad):
    dw = weight.new_empty(weight.shape) if weight is not None and weight_grad else x.new_empty(0)
    db = bias.new_empty(bias.shape) if bias is not None and bias_grad else x.new_empty(0)
    return x.new_empty(x.shape), dw, db


# --------------------------------------------------------------------------------------------------
# Autograd of the op (used under torch.compile), and a plain autograd.Function for eager calls, which avoids
# the custom op's Python dispatch (about 0.24 ms per forward + backward, measured on the CPU; benchmarks/NOTES.md)
# --------------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)


def _backward_rule(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    weight_grad, bias_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    dx, dw, db = _layer_norm_bwd_op(dy, x, weight, bias, mean, rstd, weight_grad, bias_grad)
    return (
        dx,
        (dw if weight is not None and weight_grad else None),
        (db if bias is not None and bias_grad else None),
        None,
    )


_layer_norm_fwd_op.register_autograd(_backward_rule, setup_context=_setup_context)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        weight_grad, bias_grad = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx, dw, db = _backward(dy, x, weight, bias, mean, rstd, weight_grad, bias_grad)
        dw = dw if weight is not None and weight_grad else None
        return dx, dw, (db if bias is not None and bias_grad else None), None


# --------------------------------------------------------------------------------------------------
# Functional API and module
# --------------------------------------------------------------------------------------------------
def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim of ``x`` (any strides; float32, float16 or bfloat16), with optional affine
    ``weight`` and ``bias`` (D,). Accumulates in float32 and returns x's dtype. Differentiable in all three."""
    check_tensor(x, "x", min_ndim=1)
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            check_tensor(param, name, ndim=1)
            check_shape(param, name, (x.shape[-1],))
    check_same_device(x=x, weight=weight, bias=bias)
    if weight is not None and bias is not None:
        check_same_dtype(weight=weight, bias=bias)
    if not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps}")
    if torch.compiler.is_compiling():  # torch.compile sees one custom op (with its registered autograd)
        return _layer_norm_fwd_op(x, weight, bias, float(eps))[0]
    return _LayerNorm.apply(x, weight, bias, float(eps))


class LayerNorm(torch.nn.Module):
    """``nn.LayerNorm``-compatible module over the last dim, backed by the Triton kernel."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"
