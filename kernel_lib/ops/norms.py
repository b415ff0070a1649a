"""LayerNorm and RMSNorm in Triton: one kernel pair for both, one pass over the input forward, one pass backward.

    LayerNorm:  y = (x - mean(x)) * rstd * weight + bias,   rstd = 1/sqrt(var(x) + eps)     x: (..., D)
    RMSNorm:    y = x * rstd * weight,                      rstd = 1/sqrt(mean(x²) + eps)   weight, bias: (D,) or None

RMSNorm is LayerNorm without the mean and the bias, so every kernel here takes an ``IS_RMS`` switch that drops
them at compile time. Forward reads x (weight and bias once per program) and writes y, plus float32 statistics
per row saved for backward: ``rstd``, and for LayerNorm the row ``mean`` (the variance is the biased one, as in
``F.layer_norm``). Every reduction accumulates in float32; y is rounded once to x's dtype. Backward, with
``xhat = (x - mean) * rstd`` (``x * rstd`` for RMSNorm) and ``g = dy * weight``::

    dx      = rstd * (g - mean(g) - xhat * mean(g * xhat))     one pass per row (RMSNorm: no mean(g) term)
    dweight = sum over rows of dy * xhat,   dbias = sum over rows of dy      reduced in two stages

Saved for backward: x, weight, bias, mean (LayerNorm only) and rstd; not y. The parameter gradients are
reductions over all rows: a few persistent programs per SM each loop over a share of the rows, keep float32
partial sums in registers and write them to one float32 buffer, (sums, programs, D) with dweight's partials
before dbias's; a small finish kernel sums each column over the programs in a fixed order and writes dweight
and dbias in the parameters' dtype (no atomics: deterministic). A frozen weight or bias (requires_grad False)
is neither accumulated nor summed.

Rows wider than ``SPLIT_ABOVE`` columns (``BWD_SPLIT_ABOVE`` backward) are shared by a team of programs, a chunk
of columns each (``split_rows.py``): forward, each program reduces its chunk to its sum of squares (LayerNorm: its
sum and its sum of squares about its own mean, combined exactly as Chan, Golub & LeVeque's parallel variance), the
team meets at a barrier and each program normalizes its chunk; backward, the chunks' sums of g * xhat (and of g)
are combined the same way, and each program keeps its columns' dweight and dbias over its team's rows, summed by
the same finish kernel. Every element is still read and written once.

``add_rms_norm(x, residual, weight)`` is decoding's fused residual add: the forward kernel adds the residual to
x first (rounded to x's dtype, as a separate add would), writes that sum, and normalizes it; inference only.

Registered as the ``kernel_lib::norm_fwd`` / ``kernel_lib::norm_bwd`` custom ops with fake implementations,
which the one ``autograd.Function`` calls under torch.compile, so ``torch.compile(fullgraph=True)`` traces
through it. Sources: Ba, Kiros & Hinton, "Layer Normalization" (2016); Zhang & Sennrich, "Root Mean Square
Layer Normalization" (2019); Triton's layer-norm tutorial; flash-attention's ``ops/triton/layer_norm.py``.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from . import split_rows
from ._utils import (
    as_rows,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    launch_or_op,
    persistent_programs,
    row_block_settings,
    use_triton,
)
from .split_rows import lane_of, lane_row, slot_of, team_barrier

__all__ = ["rms_norm", "rms_norm_ref", "RMSNorm", "add_rms_norm", "layer_norm", "layer_norm_ref", "LayerNorm"]

# Rows wider than this run the backward's WIDE loop: holding two such rows (prefetch) spills registers.
WIDE_ROW = 8192
# Rows wider than these are shared by a team of programs (split_rows.py), forward and backward: one program a
# row is as fast forward up to 32,768 columns, but its backward loop falls to 7-11% of the copy rate at
# 32,768-65,536 (an H200 sweep, benchmarks/NOTES.md, session of 2026-11-29 from 06:18 UTC).
SPLIT_ABOVE, BWD_SPLIT_ABOVE = 32768, 16384
# (columns, warps) of each program of a team. In that sweep RMSNorm's forward ran best with 8,192 and 8 (58-62%
# of copy at 65,536-262,144; 49-56% with 4,096 and 4), LayerNorm's, with two statistics, with 4,096 and 4.
RMS_FWD_LANES, LN_FWD_LANES, BWD_LANES = (8192, 8), (4096, 4), (4096, 4)
# The finish kernel's tile: partial rows per loop step, columns per program (the fastest tile tried).
_FINISH_BLOCK_P, _FINISH_BLOCK_D = 128, 16


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """The definition, in plain PyTorch: computed in float32 (float64 for float64 input), returned in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    return y.to(x.dtype)


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
def _norm_fwd_kernel(
    x_ptr,  # input, (n_rows, D) with unit stride along D
    r_ptr,  # residual, (n_rows, D) with unit stride along D, added to x first; unused unless HAS_RESIDUAL
    w_ptr,  # weight (D,); unused when HAS_WEIGHT is False
    b_ptr,  # bias (D,); unused when HAS_BIAS is False
    y_ptr,  # output, (n_rows, D) contiguous, x's dtype
    s_ptr,  # output, (n_rows, D) contiguous, x's dtype: x + residual, the norm's input; unused unless HAS_RESIDUAL
    mean_ptr,  # output, (n_rows,) float32: row means, saved for backward; unused when IS_RMS
    rstd_ptr,  # output, (n_rows,) float32: 1 / sqrt(var + eps), or 1 / rms when IS_RMS; saved for backward
    x_row_stride,  # elements between the starts of consecutive rows of x
    r_row_stride,  # elements between the starts of consecutive rows of the residual
    n_rows,  # number of rows
    D,  # row width
    inv_D,  # 1 / D, rounded once on the host: x / D compiles to an approximate division on GPUs
    eps,  # added to the variance (the mean square when IS_RMS)
    IS_RMS: tl.constexpr,  # RMSNorm: no mean subtracted (and no bias)
    HAS_WEIGHT: tl.constexpr,  # multiply by weight or not
    HAS_BIAS: tl.constexpr,  # add bias or not
    HAS_RESIDUAL: tl.constexpr,  # normalize x + residual (and write it) instead of x
    BLOCK_D: tl.constexpr,  # power of two >= D: a whole row per block
    BLOCK_M: tl.constexpr,  # rows per program (more than one only for narrow rows)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)  # row * stride overflows int32 past 2**31 elements
    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows64[:, None] * r_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # rounded to x's dtype before the norm reads it: the same sum, bit for bit, as a separate add kernel's
        x = (x + r).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + rows64[:, None] * D + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
    if IS_RMS:
        centered = x  # padding loaded as 0 adds nothing to the mean square
    else:
        mean = tl.sum(x, axis=1) * inv_D  # (BLOCK_M,)
        centered = tl.where(mask, x - mean[:, None], 0.0)  # padding must not enter the variance
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) * inv_D + eps)  # (BLOCK_M,)
    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if not IS_RMS:
        tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _norm_bwd_kernel(
    dy_ptr,  # upstream gradient, (n_rows, D) with unit stride along D
    x_ptr,  # forward input, (n_rows, D) with unit stride along D
    w_ptr,  # weight (D,); unused when HAS_WEIGHT is False
    mean_ptr,  # (n_rows,) float32 saved by the forward; unused when IS_RMS
    rstd_ptr,  # (n_rows,) float32 saved by the forward
    dx_ptr,  # output, (n_rows, D) contiguous, x's dtype
    partial_ptr,  # output, (WEIGHT_GRAD + BIAS_GRAD, programs, D) float32: each program's dweight, then dbias
    dy_row_stride,  # elements between rows of dy
    x_row_stride,  # elements between rows of x
    n_rows,  # number of rows
    D,  # row width
    inv_D,  # 1 / D, rounded once on the host (exact for D = 1, where rstd = 1/sqrt(eps) amplifies any error)
    rows_per_program,  # each program handles rows pid * rows_per_program + [0, rows_per_program)
    IS_RMS: tl.constexpr,  # RMSNorm: xhat = x * rstd, no mean(g) term
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
    # Software pipelining by hand: the next row's loads are issued before this row's reductions, so they are in
    # flight while those wait. A wide row cannot be held twice (the registers spill), so WIDE loads as it goes.
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
        if IS_RMS:
            rstd = tl.load(rstd_ptr + row, mask=row < row_end, other=0.0)
            xhat = x * rstd  # padding and rows past the end were loaded as 0
        else:
            mean = tl.load(mean_ptr + row, mask=row < row_end, other=0.0)
            rstd = tl.load(rstd_ptr + row, mask=row < row_end, other=0.0)
            xhat = tl.where(row_mask, (x - mean) * rstd, 0.0)
        g = dy * w if HAS_WEIGHT else dy
        if IS_RMS:
            dx = (g - xhat * (tl.sum(g * xhat, axis=0) * inv_D)) * rstd
        else:
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


@triton.jit(do_not_specialize=["n_rows", "lanes", "teams"])  # the residency estimate holds
def _norm_fwd_split_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, s_ptr, mean_ptr, rstd_ptr,  # as in _norm_fwd_kernel
    part_ptr,  # float32 scratch, (slots, 2, LANES_P2): each lane's sum of x and sum of squares about its own mean
    # (LayerNorm), or its sum of squares (RMSNorm)
    count_ptr,  # (teams,) int32, zeroed: arrivals at each team's barrier (PHASE 0)
    x_row_stride, r_row_stride, n_rows, D, inv_D, eps,  # as in _norm_fwd_kernel
    lanes,  # programs a row: lane l holds columns [l * BLOCK_D, (l + 1) * BLOCK_D)
    teams,  # team t takes rows t, t + teams, ...; programs = teams * lanes
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,  # as there
    LANES_P2: tl.constexpr,  # lanes padded to a power of two
    BLOCK_D: tl.constexpr,  # columns a lane
    PHASE: tl.constexpr,  # 0: one launch, lanes meet at a barrier; 1: store partials; 2: read them, write y
):  # fmt: skip
    team, lane, cols, mask, others, healthy = lane_of(lanes, D, BLOCK_D, LANES_P2)
    # columns of each lane: a lane's partial sum of squares is about its own mean, combined below (Chan et al.)
    n_each = tl.minimum(tl.maximum(D - others * BLOCK_D, 0), BLOCK_D).to(tl.float32)
    n_mine = tl.minimum(D - lane * BLOCK_D, BLOCK_D).to(tl.float32)
    if HAS_WEIGHT:  # the lane's columns of the parameters, loaded once for all its rows
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    k = 0
    # The next row's chunk is loaded while this row's lanes meet (software pipelining by hand)
    x_next = lane_row(x_ptr, team, x_row_stride, cols, mask, n_rows, 0.0)
    if HAS_RESIDUAL:
        r_next = lane_row(r_ptr, team, r_row_stride, cols, mask, n_rows, 0.0)
    for row in range(team, n_rows, teams):
        row64 = tl.cast(row, tl.int64)  # row * stride overflows int32 past 2**31 elements
        nxt = row64 + teams
        x = x_next.to(tl.float32)
        x_next = lane_row(x_ptr, nxt, x_row_stride, cols, mask, n_rows, 0.0)
        if HAS_RESIDUAL:
            r = r_next.to(tl.float32)
            r_next = lane_row(r_ptr, nxt, r_row_stride, cols, mask, n_rows, 0.0)
            x = (x + r).to(s_ptr.dtype.element_ty)  # rounded as a separate add would be
            if PHASE != 2:
                tl.store(s_ptr + row64 * D + cols, x, mask=mask)
            x = x.to(tl.float32)
        slot = slot_of(part_ptr, team, k, row64, 2 * LANES_P2, PHASE)
        if PHASE != 2:
            if IS_RMS:
                tl.store(slot + lane, tl.sum(x * x, axis=0))
            else:
                total = tl.sum(x, axis=0)
                centered = tl.where(mask, x - total / n_mine, 0.0)
                tl.store(slot + lane, total)
                tl.store(slot + LANES_P2 + lane, tl.sum(centered * centered, axis=0))
        if PHASE == 0:
            healthy = team_barrier(count_ptr + team, (k + 1) * lanes, healthy)
        if PHASE != 1:
            firsts = tl.load(slot + others, mask=others < lanes, other=0.0, cache_modifier=".cg")
            if IS_RMS:
                rstd = 1.0 / tl.sqrt(tl.sum(firsts, axis=0) * inv_D + eps)
                y = x * rstd
            else:
                seconds = tl.load(slot + LANES_P2 + others, mask=others < lanes, other=0.0, cache_modifier=".cg")
                mean = tl.sum(firsts, axis=0) * inv_D
                apart = firsts / tl.maximum(n_each, 1.0) - mean  # each lane's mean minus the row's
                rstd = 1.0 / tl.sqrt(tl.sum(seconds + n_each * apart * apart, axis=0) * inv_D + eps)
                y = (x - mean) * rstd
                tl.store(mean_ptr + row64, mean, mask=lane == 0)
            tl.store(rstd_ptr + row64, rstd, mask=lane == 0)
            if HAS_WEIGHT:
                y = y * w
            if HAS_BIAS:
                y = y + b
            y = tl.where(healthy, y, float("nan"))
            tl.store(y_ptr + row64 * D + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        k += 1


@triton.jit(do_not_specialize=["n_rows", "lanes", "teams"])  # the residency estimate holds
def _norm_bwd_split_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr,  # as in _norm_bwd_kernel
    partial_ptr,  # output, (WEIGHT_GRAD + BIAS_GRAD, teams, D) float32: each team's dweight, then dbias
    part_ptr,  # float32 scratch, (slots, 2, LANES_P2): each lane's sum of g * xhat, then of g (LayerNorm)
    count_ptr,  # (teams,) int32, zeroed: arrivals at each team's barrier (PHASE 0)
    dy_row_stride, x_row_stride, n_rows, D, inv_D,  # as in _norm_bwd_kernel
    lanes, teams,  # programs a row; team t takes rows t, t + teams, ...
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr,  # as there
    LANES_P2: tl.constexpr, BLOCK_D: tl.constexpr, PHASE: tl.constexpr,  # as in the forward
):  # fmt: skip
    team, lane, cols, mask, others, healthy = lane_of(lanes, D, BLOCK_D, LANES_P2)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # this team's rows, this lane's columns
    db_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    k = 0
    x_next = lane_row(x_ptr, team, x_row_stride, cols, mask, n_rows, 0.0)
    dy_next = lane_row(dy_ptr, team, dy_row_stride, cols, mask, n_rows, 0.0)
    for row in range(team, n_rows, teams):
        row64 = tl.cast(row, tl.int64)
        nxt = row64 + teams
        x = x_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        x_next = lane_row(x_ptr, nxt, x_row_stride, cols, mask, n_rows, 0.0)
        dy_next = lane_row(dy_ptr, nxt, dy_row_stride, cols, mask, n_rows, 0.0)
        rstd = tl.load(rstd_ptr + row64)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(mean_ptr + row64)) * rstd, 0.0)
        g = dy * w if HAS_WEIGHT else dy
        slot = slot_of(part_ptr, team, k, row64, 2 * LANES_P2, PHASE)
        if PHASE != 2:
            tl.store(slot + lane, tl.sum(g * xhat, axis=0))
            if not IS_RMS:
                tl.store(slot + LANES_P2 + lane, tl.sum(g, axis=0))
        if PHASE == 0:
            healthy = team_barrier(count_ptr + team, (k + 1) * lanes, healthy)
        if PHASE != 1:
            dot = tl.sum(tl.load(slot + others, mask=others < lanes, other=0.0, cache_modifier=".cg"), axis=0)
            dx = g - xhat * (dot * inv_D)
            if not IS_RMS:
                g_sum = tl.load(slot + LANES_P2 + others, mask=others < lanes, other=0.0, cache_modifier=".cg")
                dx -= tl.sum(g_sum, axis=0) * inv_D
            dx = tl.where(healthy, dx * rstd, float("nan"))
            tl.store(dx_ptr + row64 * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if WEIGHT_GRAD:
                dw_acc += dy * xhat
            if BIAS_GRAD:
                db_acc += dy
        k += 1
    if PHASE != 1:
        if WEIGHT_GRAD:
            tl.store(partial_ptr + team * D + cols, dw_acc, mask=mask)
        if BIAS_GRAD:
            db_row = team + teams if WEIGHT_GRAD else team  # dbias's partials follow dweight's
            tl.store(partial_ptr + db_row * D + cols, db_acc, mask=mask)


@triton.jit
def _norm_bwd_finish_kernel(
    partial_ptr,  # (WEIGHT_GRAD + BIAS_GRAD, programs, D) float32 from the backward kernel
    dw_ptr,  # output, (D,) in weight's dtype: dweight; unused when WEIGHT_GRAD is False
    db_ptr,  # output, (D,) in bias's dtype: dbias; unused when BIAS_GRAD is False
    programs,  # partial rows per parameter: the backward kernel's grid
    D,  # row width
    WEIGHT_GRAD: tl.constexpr,  # sum dweight's partials
    BIAS_GRAD: tl.constexpr,  # sum dbias's partials
    BLOCK_P: tl.constexpr,  # partial rows read per loop step
    BLOCK_D: tl.constexpr,  # columns per program
):
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    db_base = partial_ptr + programs * D if WEIGHT_GRAD else partial_ptr
    dw_acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):  # a fixed order: the same sums on every run
        p = start + tl.arange(0, BLOCK_P)
        offsets = p[:, None] * D + cols[None, :]
        mask = (p < programs)[:, None] & col_mask[None, :]
        if WEIGHT_GRAD:
            dw_acc += tl.load(partial_ptr + offsets, mask=mask, other=0.0)
        if BIAS_GRAD:
            db_acc += tl.load(db_base + offsets, mask=mask, other=0.0)
    if WEIGHT_GRAD:
        tl.store(dw_ptr + cols, tl.sum(dw_acc, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
    if BIAS_GRAD:
        tl.store(db_ptr + cols, tl.sum(db_acc, axis=0).to(db_ptr.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------------------------
# Launchers (inputs already checked by the functional API). What they do not compute (RMSNorm's mean, the
# gradient of a frozen parameter) they return as None.
# --------------------------------------------------------------------------------------------------
def _forward(x, weight, bias, eps, is_rms, residual=None):
    """(y, mean, rstd), and with a residual (same shape as x) also x + residual, the input y normalizes."""
    # Allocated in their final shapes, contiguous: the kernel writes them as (n_rows, D) and (n_rows,).
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    mean = None if is_rms else torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    rstd = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    total = None if residual is None else torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if x.numel() == 0:  # no rows, or rows of width 0
        return (y, mean, rstd) if residual is None else (y, mean, rstd, total)
    rows = as_rows(x)  # (n_rows, D)
    res_rows = rows if residual is None else as_rows(residual)
    n_rows, D = rows.shape
    tensors = (rows, res_rows, weight if weight is not None else rows, bias if bias is not None else rows, y,
               total if total is not None else y, rstd if is_rms else mean, rstd)  # fmt: skip
    sizes = (rows.stride(0), res_rows.stride(0), n_rows, D, 1.0 / D, eps)
    flags = dict(IS_RMS=is_rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                 HAS_RESIDUAL=residual is not None)  # fmt: skip
    if D <= SPLIT_ABOVE:
        block_d, block_m, num_warps = row_block_settings(D, x.element_size())
        _norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
            *tensors, *sizes, **flags, BLOCK_D=block_d, BLOCK_M=block_m, num_warps=num_warps
        )
    else:  # a team of programs a row (split_rows.py)
        width, warps = RMS_FWD_LANES if is_rms else LN_FWD_LANES
        block_d = split_rows.lane_block(D, width)
        lanes = triton.cdiv(D, block_d)
        split_rows.launch(
            _norm_fwd_split_kernel, lambda part, count, teams: (*tensors, part, count, *sizes, lanes, teams),
            n_rows, D, block_d, 2, dict(flags, num_warps=warps), x,
        )  # fmt: skip
    return (y, mean, rstd) if residual is None else (y, mean, rstd, total)


def _backward(dy, x, weight, bias, mean, rstd, is_rms, weight_grad=True, bias_grad=True):
    weight_grad, bias_grad = weight is not None and weight_grad, bias is not None and bias_grad
    D = x.shape[-1]
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)  # contiguous: the kernel writes it as (n_rows, D)
    dw = torch.empty(D, device=x.device, dtype=weight.dtype) if weight_grad else None
    db = torch.empty(D, device=x.device, dtype=bias.dtype) if bias_grad else None
    if x.numel() == 0:  # no rows, or rows of width 0
        return dx, (dw.zero_() if weight_grad else None), (db.zero_() if bias_grad else None)
    rows, dy_rows = as_rows(x), as_rows(dy)  # (n_rows, D) each
    n_rows = rows.shape[0]
    sums = weight_grad + bias_grad
    flags = dict(IS_RMS=is_rms, HAS_WEIGHT=weight is not None, WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad)
    if D > BWD_SPLIT_ABOVE:  # a team of programs a row (split_rows.py), each team's parameter gradients apart
        block_d = split_rows.lane_block(D, BWD_LANES[0])
        lanes = triton.cdiv(D, block_d)
        partials = {}

        def arguments(part, count, teams):
            partials[teams] = torch.empty((sums, teams, D), device=x.device, dtype=torch.float32) if sums else dx
            return (dy_rows, rows, weight if weight is not None else rows, rstd if is_rms else mean, rstd, dx,
                    partials[teams], part, count, dy_rows.stride(0), rows.stride(0), n_rows, D, 1.0 / D, lanes,
                    teams)  # fmt: skip

        teams = split_rows.launch(_norm_bwd_split_kernel, arguments, n_rows, D, block_d, 2,
                                  dict(flags, num_warps=BWD_LANES[1]), x).teams  # fmt: skip
        _finish(partials[teams], dw, db, teams, D, weight_grad, bias_grad)
        return dx, dw, db
    block_d, _, num_warps = row_block_settings(D, x.element_size())
    wide = block_d > WIDE_ROW
    if wide and is_rms:  # 8 warps suit RMSNorm's wide loop; LayerNorm's, with two accumulators, spills less with 16
        num_warps = min(num_warps, 8)
    programs = persistent_programs(x.device, n_rows)
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    partial = torch.empty((sums, programs, D), device=x.device, dtype=torch.float32) if sums else dx
    _norm_bwd_kernel[(programs,)](
        dy_rows, rows, weight if weight is not None else rows, rstd if is_rms else mean, rstd, dx, partial,
        dy_rows.stride(0), rows.stride(0), n_rows, D, 1.0 / D, rows_per_program,
        **flags, WIDE=wide, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    _finish(partial, dw, db, programs, D, weight_grad, bias_grad)
    return dx, dw, db


def _finish(partial, dw, db, programs: int, D: int, weight_grad: bool, bias_grad: bool) -> None:
    """Sum the (sums, programs, D) partials of the parameter gradients into dw and db."""
    if weight_grad or bias_grad:
        _norm_bwd_finish_kernel[(triton.cdiv(D, _FINISH_BLOCK_D),)](
            partial, dw if weight_grad else partial, db if bias_grad else partial, programs, D,
            WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad, BLOCK_P=_FINISH_BLOCK_P, BLOCK_D=_FINISH_BLOCK_D,
            num_warps=4,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# torch.library registration: opaque ops with fake implementations, what torch.compile records. Ops return
# tensors only, so the launchers' None becomes an empty tensor here.
# (typing.Optional in these signatures: the schema inference of older torch releases does not read `X | None`.)
# --------------------------------------------------------------------------------------------------
def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t


@torch.library.custom_op("kernel_lib::norm_fwd", mutates_args=())
def _norm_fwd_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float, is_rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, mean, rstd = _forward(x, weight, bias, eps, is_rms)
    return y, _or_empty(mean, rstd), rstd


@_norm_fwd_op.register_fake
def _(x, weight, bias, eps, is_rms):
    stats = x.shape[:-1]
    mean = x.new_empty((0,) if is_rms else stats, dtype=torch.float32)
    return x.new_empty(x.shape), mean, x.new_empty(stats, dtype=torch.float32)


@torch.library.custom_op("kernel_lib::norm_bwd", mutates_args=())
def _norm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    is_rms: bool,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _backward(dy, x, weight, bias, mean, rstd, is_rms, weight_grad, bias_grad)
    return dx, _or_empty(dw, x), _or_empty(db, x)


@_norm_bwd_op.register_fake
def _(dy, x, weight, bias, mean, rstd, is_rms, weight_grad, bias_grad):
    dw = weight.new_empty(weight.shape) if weight is not None and weight_grad else x.new_empty(0)
    db = bias.new_empty(bias.shape) if bias is not None and bias_grad else x.new_empty(0)
    return x.new_empty(x.shape), dw, db


def _add_rms_norm(x, residual, weight, eps):
    y, _, _, total = _forward(x, weight, None, eps, True, residual)
    return y, total


@torch.library.custom_op("kernel_lib::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_rms_norm(x, residual, weight, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


# --------------------------------------------------------------------------------------------------
# Autograd: the launchers in eager mode, the ops under torch.compile (see _utils.launch_or_op)
# --------------------------------------------------------------------------------------------------
class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms):
        y, mean, rstd = launch_or_op(_forward, _norm_fwd_op)(x, weight, bias, eps, is_rms)
        ctx.is_rms = is_rms
        ctx.save_for_backward(x, weight, bias, mean, rstd)  # not y: xhat is recomputed from x and the statistics
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        # A frozen parameter (requires_grad False) gets no gradient, and costs no work.
        weight_grad = weight is not None and ctx.needs_input_grad[1]
        bias_grad = bias is not None and ctx.needs_input_grad[2]
        dx, dw, db = launch_or_op(_backward, _norm_bwd_op)(
            dy, x, weight, bias, mean, rstd, ctx.is_rms, weight_grad, bias_grad
        )
        return dx, (dw if weight_grad else None), (db if bias_grad else None), None, None


# --------------------------------------------------------------------------------------------------
# Functional API and modules
# --------------------------------------------------------------------------------------------------
def _check_eps(eps: float) -> float:
    if not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps}")
    return float(eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any strides; float32, float16 or bfloat16), times ``weight`` (D,).

    Accumulates in float32 and returns x's dtype. Differentiable in x and weight.
    """
    check_tensor(x, "x", min_ndim=1)
    if weight is not None:
        check_tensor(weight, "weight", ndim=1)
        check_shape(weight, "weight", (x.shape[-1],))
        check_same_device(x=x, weight=weight)
    eps = _check_eps(eps)
    if not use_triton(x, op="rms_norm"):  # CPU without the interpreter: the reference, differentiated by autograd
        return rms_norm_ref(x, weight, eps)
    return _Norm.apply(x, weight, None, eps, True)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` and ``rms_norm(s, weight, eps)`` in one kernel; returns (normed, s), both in x's dtype.

    A pre-norm transformer adds each sublayer's output to the residual stream and normalizes the sum for the next
    sublayer: two kernels and an extra pass over the row, which at decoding's single row per sequence cost
    mostly their launches. s is rounded to x's dtype before it is normalized, so both outputs equal the separate
    ``x + residual`` and ``rms_norm`` bit for bit. Inference only (no autograd: call it under
    ``torch.no_grad()``); training uses ``rms_norm``. x and residual: same shape and dtype, any strides with
    unit stride along the last dim."""
    check_tensor(x, "x", min_ndim=1)
    check_tensor(residual, "residual", min_ndim=1)
    check_shape(residual, "residual", x.shape)
    check_same_dtype(x=x, residual=residual)
    if weight is not None:
        check_tensor(weight, "weight", ndim=1)
        check_shape(weight, "weight", (x.shape[-1],))
    check_same_device(x=x, residual=residual, weight=weight)
    eps = _check_eps(eps)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, residual, weight)):
        raise ValueError("add_rms_norm is for inference (no autograd): call it under torch.no_grad()")
    if not use_triton(x, op="add_rms_norm"):  # CPU without the interpreter: the reference
        total = x + residual
        return rms_norm_ref(total, weight, eps), total
    return launch_or_op(_add_rms_norm, _add_rms_norm_op)(x, residual, weight, eps)


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
    eps = _check_eps(eps)
    if not use_triton(x, op="layer_norm"):  # CPU without the interpreter: the reference, differentiated by autograd
        return layer_norm_ref(x, weight, bias, eps)
    return _Norm.apply(x, weight, bias, eps, False)


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
