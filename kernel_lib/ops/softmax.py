"""Softmax over the last dim in Triton, forward and backward, one read and one write per element when rows fit.

    y = exp(x - max(x)) / sum(exp(x - max(x)))                                x: (..., D)
    dx = y * (dy - sum(dy * y))                                              (sums over the last dim)

Rows up to ``SPLIT_ABOVE`` elements are held whole in registers by one program: the kernel reads x once and
writes y once, the fewest bytes possible. Wider rows (a 128k-entry vocabulary, say) are shared by a team of
programs (``split_rows.py``), a chunk of columns each, still read once: each program reduces its chunk to a
maximum m_l and a sum s_l of exp(x - m_l), the team meets at a barrier, and each program combines the partials
the way the *online* softmax does, m = max_l m_l and s = sum_l s_l exp(m_l - m), then writes its chunk.
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

from . import split_rows
from ._utils import as_rows, check_tensor, launch_or_op, row_block_settings, use_triton
from .split_rows import lane_of, lane_row, slot_of, team_barrier

__all__ = ["softmax", "softmax_ref", "SPLIT_ABOVE"]

SPLIT_ABOVE = 32768  # widest row one program holds; wider rows are shared by a team of programs
LANE_WIDTH, LANE_WARPS = 4096, 4  # columns and warps of each program of a team


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
    BLOCK_D: tl.constexpr,  # whole row: power of two >= D
    BLOCK_M: tl.constexpr,  # rows per program
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)  # row * stride overflows int32 past 2**31 elements
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols[None, :] < D)
    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=-float("inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    y = e / tl.sum(e, axis=1)[:, None]
    tl.store(y_ptr + rows64[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_kernel(
    dy_ptr,  # upstream gradient, (n_rows, D) with unit stride along D
    y_ptr,  # forward output, (n_rows, D) contiguous
    dx_ptr,  # output, (n_rows, D) contiguous
    dy_row_stride,  # elements between rows of dy
    n_rows,  # number of rows
    D,  # row width
    BLOCK_D: tl.constexpr,  # whole row: power of two >= D
    BLOCK_M: tl.constexpr,  # rows per program
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols[None, :] < D)
    dy = tl.load(dy_ptr + rows64[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + rows64[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(dx_ptr + rows64[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "lanes", "teams"])  # the residency estimate holds
def _softmax_fwd_split_kernel(
    x_ptr,  # input, (n_rows, D) with unit stride along D
    y_ptr,  # output, (n_rows, D) contiguous, x's dtype
    part_ptr,  # float32 scratch, (slots, 2, LANES_P2): each lane's max, then its sum of exp(x - max)
    count_ptr,  # (teams,) int32, zeroed: arrivals at each team's barrier (PHASE 0)
    x_row_stride,  # elements between the starts of consecutive rows of x
    n_rows,  # number of rows
    D,  # row width
    lanes,  # programs a row: lane l holds columns [l * BLOCK_D, (l + 1) * BLOCK_D)
    teams,  # team t takes rows t, t + teams, ...; programs = teams * lanes
    LANES_P2: tl.constexpr,  # lanes padded to a power of two
    BLOCK_D: tl.constexpr,  # columns a lane
    PHASE: tl.constexpr,  # 0: one launch, lanes meet at a barrier; 1: store partials; 2: read them, write y
):
    team, lane, cols, mask, others, healthy = lane_of(lanes, D, BLOCK_D, LANES_P2)
    k = 0
    # The next row's chunk is loaded while this row's lanes meet (software pipelining by hand)
    x_next = lane_row(x_ptr, team, x_row_stride, cols, mask, n_rows, -float("inf"))
    for row in range(team, n_rows, teams):
        row64 = tl.cast(row, tl.int64)  # row * stride overflows int32 past 2**31 elements
        x = x_next.to(tl.float32)
        nxt = row64 + teams
        x_next = lane_row(x_ptr, nxt, x_row_stride, cols, mask, n_rows, -float("inf"))
        slot = slot_of(part_ptr, team, k, row64, 2 * LANES_P2, PHASE)
        if PHASE != 2:
            m = tl.max(x, axis=0)
            s = tl.sum(tl.exp(x - m), axis=0)
            tl.store(slot + lane, m)
            tl.store(slot + LANES_P2 + lane, tl.where(m == -float("inf"), 0.0, s))  # all -inf: NaN above
        if PHASE == 0:
            healthy = team_barrier(count_ptr + team, (k + 1) * lanes, healthy)
        if PHASE != 1:
            ms = tl.load(slot + others, mask=others < lanes, other=-float("inf"), cache_modifier=".cg")
            ss = tl.load(slot + LANES_P2 + others, mask=others < lanes, other=0.0, cache_modifier=".cg")
            m_row = tl.max(ms, axis=0)
            s_row = tl.sum(tl.where(ms == -float("inf"), 0.0, ss * tl.exp(ms - m_row)), axis=0)
            y = tl.exp(x - m_row) / s_row  # a row of -inf: 0 / 0, NaN as in PyTorch
            y = tl.where(healthy, y, float("nan"))
            tl.store(y_ptr + row64 * D + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        k += 1


@triton.jit(do_not_specialize=["n_rows", "lanes", "teams"])  # the residency estimate holds
def _softmax_bwd_split_kernel(
    dy_ptr,  # upstream gradient, (n_rows, D) with unit stride along D
    y_ptr,  # forward output, (n_rows, D) contiguous
    dx_ptr,  # output, (n_rows, D) contiguous
    part_ptr,  # float32 scratch, (slots, LANES_P2): each lane's sum of dy * y
    count_ptr,  # (teams,) int32, zeroed: arrivals at each team's barrier (PHASE 0)
    dy_row_stride,  # elements between rows of dy
    n_rows,  # number of rows
    D,  # row width
    lanes,  # programs a row
    teams,  # team t takes rows t, t + teams, ...
    LANES_P2: tl.constexpr,  # lanes padded to a power of two
    BLOCK_D: tl.constexpr,  # columns a lane
    PHASE: tl.constexpr,  # as in the forward
):
    team, lane, cols, mask, others, healthy = lane_of(lanes, D, BLOCK_D, LANES_P2)
    k = 0
    dy_next = lane_row(dy_ptr, team, dy_row_stride, cols, mask, n_rows, 0.0)
    y_next = lane_row(y_ptr, team, D, cols, mask, n_rows, 0.0)
    for row in range(team, n_rows, teams):
        row64 = tl.cast(row, tl.int64)
        dy = dy_next.to(tl.float32)
        y = y_next.to(tl.float32)
        nxt = row64 + teams
        dy_next = lane_row(dy_ptr, nxt, dy_row_stride, cols, mask, n_rows, 0.0)
        y_next = lane_row(y_ptr, nxt, D, cols, mask, n_rows, 0.0)
        slot = slot_of(part_ptr, team, k, row64, LANES_P2, PHASE)
        if PHASE != 2:
            tl.store(slot + lane, tl.sum(dy * y, axis=0))
        if PHASE == 0:
            healthy = team_barrier(count_ptr + team, (k + 1) * lanes, healthy)
        if PHASE != 1:
            dot = tl.sum(tl.load(slot + others, mask=others < lanes, other=0.0, cache_modifier=".cg"), axis=0)
            dx = tl.where(healthy, y * (dy - dot), float("nan"))
            tl.store(dx_ptr + row64 * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        k += 1


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------
def _launch(kernel, split_kernel, inputs: list[torch.Tensor], like: torch.Tensor, stats: int) -> torch.Tensor:
    """Run the forward (x -> y) or the backward (dy, y -> dx) over the rows of ``inputs`` (the first gives the row
    stride; the others are contiguous) into a new contiguous tensor shaped like ``like``: whole rows a program
    up to ``SPLIT_ABOVE`` columns, else a team of programs a row (split_rows.py) with ``stats`` floats a lane."""
    rows = [as_rows(t) for t in inputs]  # (n_rows, D) each
    n_rows, D = rows[0].shape
    out = torch.empty((n_rows, D), device=like.device, dtype=like.dtype)
    if n_rows == 0 or D == 0:
        return out.view(like.shape)
    if D <= SPLIT_ABOVE:
        block_d, block_m, num_warps = row_block_settings(D, like.element_size())
        kernel[(triton.cdiv(n_rows, block_m),)](
            *rows, out, rows[0].stride(0), n_rows, D, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=num_warps
        )
    else:
        block_d = split_rows.lane_block(D, LANE_WIDTH)
        lanes = triton.cdiv(D, block_d)
        split_rows.launch(
            split_kernel, lambda part, count, teams: (*rows, out, part, count, rows[0].stride(0), n_rows, D, lanes,
                                                      teams),
            n_rows, D, block_d, stats, dict(num_warps=LANE_WARPS), like,
        )  # fmt: skip
    return out.view(like.shape)


def _forward(x: torch.Tensor) -> torch.Tensor:
    return _launch(_softmax_fwd_kernel, _softmax_fwd_split_kernel, [x], x, stats=2)


def _backward(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _launch(_softmax_bwd_kernel, _softmax_bwd_split_kernel, [dy, y], y, stats=1)


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
