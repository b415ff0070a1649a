"""Cross-entropy over a large vocabulary in Triton: float32 loss from logits of any float dtype, without upcasting.

For logits x (T, V), targets t (T,) and label smoothing eps, each row's loss is::

    lse  = log(sum_i exp(x_i))                                   (online: running max and rescaled sum)
    loss = lse - (1 - eps) * x_t - (eps / V) * sum_i x_i          (= (1 - eps) * nll + eps * mean_i(-log p_i))

and its gradient, scaled by the upstream gradient of that row::

    dx_i = (softmax_i - (1 - eps) * [i == t] - eps / V) * dloss_row

The forward reads the logits once and writes three floats per row: the loss, and for the backward the row's
maximum m and log(sum_i exp(x_i - m)), kept apart rather than summed into lse because at large magnitudes lse's
rounding (half an ulp of |lse|: 1.2e-4 at 3000) would become the gradient's relative error (float32 tests with
1000-scale logits failed the 2x rule that way; benchmarks/NOTES.md). The backward reads the
logits once more and writes the gradient once, in the logits' dtype. ``F.cross_entropy(logits.float(), t)``
instead writes a float32 copy of the logits and its log-softmax. Rows whose target is ``ignore_index`` get loss 0
and gradient 0; a target outside [0, V) gives a NaN loss for its row (no host synchronization is spent checking
targets).
The reduction (mean over the rows that are not ignored, sum, or none) is plain PyTorch on the (T,) row losses,
so autograd hands the kernel one upstream gradient per row whatever the reduction; all rows ignored with
``reduction="mean"`` gives NaN, as in PyTorch.

Registered as ``kernel_lib::cross_entropy_fwd`` / ``kernel_lib::cross_entropy_bwd`` custom ops with fake
implementations, which the one ``autograd.Function`` calls under torch.compile, so ``torch.compile(fullgraph=True)``
traces through it. Sources: Milakov & Gimelshein (2018) for the online log-sum-exp; Liger-Kernel's
cross-entropy for the chunked-vocabulary layout.
"""

import torch
import triton
import triton.language as tl

from ._utils import check_same_device, check_tensor, launch_or_op, use_triton

__all__ = ["cross_entropy", "cross_entropy_ref"]

# The forward uses one warp per row: its max and sum are then reduced by shuffles within the warp, where more warps
# would meet at a shared-memory barrier twice per block (the measurements are in benchmarks/NOTES.md). The backward
# has no reduction and streams wide blocks.
FWD_BLOCK_V, FWD_WARPS = 2048, 1
BWD_BLOCK_V, BWD_WARPS = 16384, 16


def cross_entropy_ref(logits: torch.Tensor, target: torch.Tensor, **options) -> torch.Tensor:
    """The definition: ``F.cross_entropy`` on logits upcast to float32 (float64 stays float64).

    ``options`` are F.cross_entropy's (``ignore_index``, ``reduction``, ``label_smoothing``), passed as they are.
    """
    compute = torch.promote_types(logits.dtype, torch.float32)
    return torch.nn.functional.cross_entropy(logits.to(compute), target, **options)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _ce_fwd_kernel(
    logits_ptr,  # (T, V), unit stride along V
    target_ptr,  # (T,) int64
    loss_ptr,  # output (T,) float32: each row's loss
    stats_ptr,  # output (T, 2) float32: each row's max m and log(sum exp(x - m)), saved for backward
    logits_row_stride,  # elements between rows of logits
    V,  # vocabulary size
    ignore_index,  # target value whose row is skipped
    smoothing,  # label smoothing eps in [0, 1]
    HAS_SMOOTHING: tl.constexpr,  # eps > 0: also sum the logits
    BLOCK_V: tl.constexpr,  # vocabulary entries per step
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")  # running maximum
    s = 0.0  # running sum of exp(x - m)
    total = 0.0  # running sum of x (label smoothing)
    # The next block's load is issued before this block's reductions, so it is in flight while they wait (the
    # norms' backward kernels gained 12 to 23% from the same change; benchmarks/NOTES.md).
    x_next = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf"))
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = x_next.to(tl.float32)
        x_next = tl.load(row_ptr + start + BLOCK_V + cols, mask=start + BLOCK_V + cols < V, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # Padding and -inf logits add exp(-inf) = 0; while the row has seen only -inf, shift by 0 instead of
        # m_new = -inf, which would give exp(-inf - -inf) = NaN. A scalar choice: no per-element test.
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            total += tl.sum(tl.where(mask, x, 0.0), axis=0)
    log_s = tl.log(s)
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < V)
    x_t = tl.load(row_ptr + tl.where(in_range, target, 0)).to(tl.float32)
    loss = m - (1.0 - smoothing) * x_t  # lse - x_t, without rounding lse = m + log_s first
    if HAS_SMOOTHING:
        loss -= smoothing / V * total
    loss = tl.where(in_range, loss + log_s, float("nan"))
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss))
    tl.store(stats_ptr + 2 * row, m)
    tl.store(stats_ptr + 2 * row + 1, log_s)


@triton.jit
def _ce_bwd_kernel(
    logits_ptr,  # (T, V), unit stride along V
    target_ptr,  # (T,) int64
    stats_ptr,  # (T, 2) float32 from the forward: row max m, log(sum exp(x - m))
    dloss_ptr,  # (T,) float32: upstream gradient of each row's loss
    dlogits_ptr,  # output (T, V) contiguous, logits' dtype
    logits_row_stride,  # elements between rows of logits
    V,  # vocabulary size
    ignore_index,  # target value whose row gets zero gradient
    smoothing,  # label smoothing eps
    BLOCK_V: tl.constexpr,  # vocabulary entries per step
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    out_ptr = dlogits_ptr + row * V
    target = tl.load(target_ptr + row)
    m = tl.load(stats_ptr + 2 * row)
    log_s = tl.load(stats_ptr + 2 * row + 1)
    scale = tl.where(target == ignore_index, 0.0, tl.load(dloss_ptr + row))
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(row_ptr + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        grad = tl.exp((x - m) - log_s) - smoothing / V - (1.0 - smoothing) * ((start + cols) == target).to(tl.float32)
        grad = tl.where(scale == 0.0, 0.0, grad * scale)  # ignored rows: exactly 0, even when dloss is inf or NaN
        tl.store(out_ptr + start + cols, grad.to(dlogits_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------
def _forward(logits, target, ignore_index, smoothing):
    T, V = logits.shape
    loss = torch.empty(T, device=logits.device, dtype=torch.float32)
    stats = torch.empty((T, 2), device=logits.device, dtype=torch.float32)  # row max, log sum exp(x - max)
    if T == 0:
        return loss, stats
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    _ce_fwd_kernel[(T,)](
        logits, target, loss, stats, logits.stride(0), V, ignore_index, smoothing,
        HAS_SMOOTHING=smoothing > 0, BLOCK_V=FWD_BLOCK_V, num_warps=FWD_WARPS,
    )  # fmt: skip
    return loss, stats


def _backward(dloss, logits, target, stats, ignore_index, smoothing, out=None):
    """The gradient of each row's loss, into ``out`` when given (it may be ``logits`` itself: each program reads
    a block of its row before it writes the same block, so the gradient can overwrite the logits)."""
    T, V = logits.shape
    if out is not None and not (out.is_contiguous() and out.shape == logits.shape and out.dtype == logits.dtype):
        raise ValueError("out must be a contiguous tensor of the logits' shape and dtype")
    dlogits = out if out is not None else torch.empty((T, V), device=logits.device, dtype=logits.dtype)
    if T == 0:
        return dlogits
    dloss = dloss.to(torch.float32).contiguous()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    _ce_bwd_kernel[(T,)](
        logits, target, stats, dloss, dlogits, logits.stride(0), V, ignore_index, smoothing,
        BLOCK_V=BWD_BLOCK_V, num_warps=BWD_WARPS,
    )  # fmt: skip
    return dlogits


# --------------------------------------------------------------------------------------------------
# torch.library registration: opaque ops with fake implementations, what torch.compile records
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::cross_entropy_fwd", mutates_args=())
def _ce_fwd_op(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(logits, target, ignore_index, smoothing)


@_ce_fwd_op.register_fake
def _(logits, target, ignore_index, smoothing):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.float32), logits.new_empty((rows, 2), dtype=torch.float32)


@torch.library.custom_op("kernel_lib::cross_entropy_bwd", mutates_args=())
def _ce_bwd_op(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    ignore_index: int,
    smoothing: float,
) -> torch.Tensor:
    return _backward(dloss, logits, target, stats, ignore_index, smoothing)


@_ce_bwd_op.register_fake
def _(dloss, logits, target, stats, ignore_index, smoothing):
    return logits.new_empty(logits.shape)


# --------------------------------------------------------------------------------------------------
# Autograd: the launchers in eager mode, the ops under torch.compile (see _utils.launch_or_op)
# --------------------------------------------------------------------------------------------------
class _CrossEntropyRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, smoothing):
        loss, stats = launch_or_op(_forward, _ce_fwd_op)(logits, target, ignore_index, smoothing)
        ctx.ignore_index, ctx.smoothing = ignore_index, smoothing
        ctx.save_for_backward(logits, target, stats)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, target, stats = ctx.saved_tensors
        dlogits = launch_or_op(_backward, _ce_bwd_op)(dloss, logits, target, stats, ctx.ignore_index, ctx.smoothing)
        return dlogits, None, None, None


# --------------------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------------------
def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of logits (T, V) (float32, float16 or bfloat16) against int64 targets (T,), in float32.

    Equals ``F.cross_entropy(logits.float(), target, ...)``; the gradient comes back in the logits' dtype.
    ``reduction`` is ``"mean"`` (over rows whose target is not ``ignore_index``), ``"sum"`` or ``"none"``.
    """
    check_tensor(logits, "logits", ndim=2)
    check_tensor(target, "target", dtypes=(torch.int64,), ndim=1)
    if target.shape[0] != logits.shape[0]:
        raise ValueError(f"target must have one entry per row of logits ({logits.shape[0]}), got {target.shape[0]}")
    check_same_device(logits=logits, target=target)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f'reduction must be "mean", "sum" or "none", got {reduction!r}')
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not use_triton(logits, op="cross_entropy"):  # CPU without the interpreter: the reference, differentiated
        return cross_entropy_ref(
            logits, target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
        )
    target = target.contiguous()
    rows = _CrossEntropyRows.apply(logits, target, int(ignore_index), float(label_smoothing))
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / (target != ignore_index).sum()
