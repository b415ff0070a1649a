"""Softmax over the last dim in Triton, forward and backward, one read and one write per element when rows fit.

    y = exp(x - max(x)) / sum(exp(x - max(x)))                                x: (..., D)
    dx = y * (dy - sum(dy * y))                                              (sums over the last dim)

Rows up to ``MAX_FUSED`` elements are held whole in registers: the kernel reads x once and writes y once,
the fewest bytes possible. Wider rows (a 128k-entry vocabulary, say) stream through in chunks with the
*online* softmax: one pass keeps a running maximum ``m`` and a running sum rescaled by ``exp(m_old - m_new)``
whenever the maximum grows, a second pass reads x again and writes the result.
Entries of ``-inf`` get exactly 0; a row that is all ``-inf`` gives NaN, as in PyTorch. Backward saves y, not x.
Arithmetic is in float32; y is rounded once to x's dtype.

Registered as ``kernel_lib::softmax_fwd`` / ``kernel_lib::softmax_bwd`` custom ops with fake implementations,
which the one ``autograd.Function`` calls under torch.compile, so ``torch.compile(fullgraph=True)`` traces
through it. Sources: Milakov & Gimelshein, "Online
normalizer calculation for softmax" (2018); Triton's fused-softmax tutorial.
"""

import torch
import triton
import triton.language as tl

from ._utils import as_rows, check_tensor, launch_or_op, row_block_settings, use_triton

__all__ = ["softmax", "softmax_ref", "MAX_FUSED"]

MAX_FUSED = 32768  # widest row held whole in registers; wider rows use the two-pass online kernel
CHUNK = 4096  # elements per step of the online kernel


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    """The definition, in plain PyTorch: computed in float32 (float64 for float64 input), returned in x's dtype."""
    return torch.softmax(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _softmax_fwd_kernel(
    x_ptr,  # input, (n_rows, D) with unit stride along D
    y_ptr,  # output, (n_rows, D) contiguous, x's dtype
    x_row_stride,  # elements between the starts of consecutive rows of x
    n_rows,  # number of rows
    D,  # row width
    BLOCK_D: tl.constexpr,  # whole row (power of two >= D) when ONE_PASS, else the chunk width
    BLOCK_M: tl.constexpr,  # rows per program (ONE_PASS only; 1 otherwise)
    ONE_PASS: tl.constexpr,  # the row fits in registers
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)  # row * stride overflows int32 past 2**31 elements
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + rows64[:, None] * x_row_stride
    y_rows = y_ptr + rows64[:, None] * D
    if ONE_PASS:
        mask = row_mask[:, None] & (cols[None, :] < D)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        y = e / tl.sum(e, axis=1)[:, None]
        tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        m = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)  # running maximum
        s = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp(x - m)
        for start in range(0, D, BLOCK_D):
            mask = row_mask[:, None] & (start + cols[None, :] < D)
            x = tl.load(x_rows + start + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            # exp(-inf - -inf) is NaN: while a row has seen only -inf, keep its sum at 0.
            rescale = tl.where(m_new == -float("inf"), 0.0, tl.exp(m - m_new))
            shifted = tl.where(m_new[:, None] == -float("inf"), -float("inf"), x - m_new[:, None])
            s = s * rescale + tl.sum(tl.exp(shifted), axis=1)
            m = m_new
        for start in range(0, D, BLOCK_D):
            mask = row_mask[:, None] & (start + cols[None, :] < D)
            x = tl.load(x_rows + start + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
            y = tl.exp(x - m[:, None]) / s[:, None]
            tl.store(y_rows + start + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_kernel(
    dy_ptr,  # upstream gradient, (n_rows, D) with unit stride along D
    y_ptr,  # forward output, (n_rows, D) contiguous
    dx_ptr,  # output, (n_rows, D) contiguous
    dy_row_stride,  # elements between rows of dy
    n_rows,  # number of rows
    D,  # row width
    BLOCK_D: tl.constexpr,  # whole row when ONE_PASS, else the chunk width
    BLOCK_M: tl.constexpr,  # rows per program (ONE_PASS only; 1 otherwise)
    ONE_PASS: tl.constexpr,  # the row fits in registers
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_D)
    dy_rows = dy_ptr + rows64[:, None] * dy_row_stride
    y_rows = y_ptr + rows64[:, None] * D
    dx_rows = dx_ptr + rows64[:, None] * D
    if ONE_PASS:
        mask = row_mask[:, None] & (cols[None, :] < D)
        dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
        tl.store(dx_rows + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        dot = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, D, BLOCK_D):
            mask = row_mask[:, None] & (start + cols[None, :] < D)
            dy = tl.load(dy_rows + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_rows + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dot += tl.sum(dy * y, axis=1)
        for start in range(0, D, BLOCK_D):
            mask = row_mask[:, None] & (start + cols[None, :] < D)
            dy = tl.load(dy_rows + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_rows + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(
                dx_rows + start + cols[None, :],
                (y * (dy - dot[:, None])).to(dx_ptr.dtype.element_ty),
                mask=mask,
            )


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------
def _settings(D: int, element_bytes: int) -> tuple[int, int, int, bool]:
    if D <= MAX_FUSED:
        block_d, block_m, num_warps = row_block_settings(D, element_bytes)
        return block_d, block_m, num_warps, True
    return CHUNK, 1, 8, False


def _launch(kernel, inputs: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Run ``kernel`` over the rows of ``inputs`` (the first gives the row stride; the others are contiguous) into
    a new contiguous tensor shaped like ``like``: the forward (x -> y) and the backward (dy, y -> dx) alike."""
    rows = [as_rows(t) for t in inputs]  # (n_rows, D) each
    n_rows, D = rows[0].shape
    out = torch.empty((n_rows, D), device=like.device, dtype=like.dtype)
    if n_rows and D:
        block_d, block_m, num_warps, one_pass = _settings(D, like.element_size())
        kernel[(triton.cdiv(n_rows, block_m),)](
            *rows, out, rows[0].stride(0), n_rows, D,
            BLOCK_D=block_d, BLOCK_M=block_m, ONE_PASS=one_pass, num_warps=num_warps,
        )  # fmt: skip
    return out.view(like.shape)


def _forward(x: torch.Tensor) -> torch.Tensor:
    return _launch(_softmax_fwd_kernel, [x], x)


def _backward(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _launch(_softmax_bwd_kernel, [dy, y], y)


# --------------------------------------------------------------------------------------------------
# torch.library registration: opaque ops with fake implementations, what torch.compile records
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::softmax_fwd", mutates_args=())
def _softmax_fwd_op(x: torch.Tensor) -> torch.Tensor:
    return _forward(x)


@_softmax_fwd_op.register_fake
def _(x):
    return x.new_empty(x.shape)


@torch.library.custom_op("kernel_lib::softmax_bwd", mutates_args=())
def _softmax_bwd_op(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _backward(dy, y)


@_softmax_bwd_op.register_fake
def _(dy, y):
    return y.new_empty(y.shape)


# --------------------------------------------------------------------------------------------------
# Autograd: the launchers in eager mode, the ops under torch.compile (see _utils.launch_or_op)
# --------------------------------------------------------------------------------------------------
class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = launch_or_op(_forward, _softmax_fwd_op)(x)
        ctx.save_for_backward(y)  # y, not x: dx = y * (dy - sum(dy * y))
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return launch_or_op(_backward, _softmax_bwd_op)(dy, y)


# --------------------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------------------
def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``x`` (any strides; float32, float16 or bfloat16), in x's dtype.

    Equal to ``torch.softmax(x.float(), -1).to(x.dtype)`` up to float32 rounding; differentiable.
    """
    check_tensor(x, "x", min_ndim=1)
    if not use_triton(x, op="softmax"):  # CPU without the interpreter: the reference, differentiated by autograd
        return softmax_ref(x)
    return _Softmax.apply(x)
