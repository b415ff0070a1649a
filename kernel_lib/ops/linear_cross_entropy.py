"""Linear layer + cross-entropy without materializing the logits: the loss of ``h @ weight.T``, chunked over rows.

For hidden states h (T, d), an output projection weight (V, d) and targets (T,), the logits (T, V) of a
language model's head are the largest tensor of a training step (8192 tokens x 128256 vocabulary in bf16: 2.1 GB,
and ``F.cross_entropy(logits.float())`` adds float32 copies of the same size). Here the rows are processed in
chunks of C rows, C chosen so a chunk's logits take about ``CHUNK_BYTES``::

    for each chunk c:   logits_c = h_c @ weight.T                       (C, V), cuBLAS
                        loss_c, stats_c = cross-entropy kernel(logits_c) (kernel_lib.cross_entropy)
                        dlogits_c = its backward kernel, written over logits_c (same buffer)
                        dh_c = dlogits_c @ weight;  dweight += dlogits_c.T @ h_c   (addmm into weight's dtype)

With ``reduction="mean"`` or ``"sum"`` the loss is a scalar, so its upstream gradient is a single number: the
gradients for h and weight are computed in that same pass (three matmuls in all, as eager PyTorch does) and the
backward only scales them. With ``reduction="none"`` the per-row upstream gradients are known only in backward,
which then recomputes each chunk's logits (four matmuls). Extra memory is one chunk of logits, never T x V.

Precision: each chunk's dweight product accumulates in float32 inside the matmul and is added to dweight in the
weight's dtype, so dweight is rounded once per chunk, and its error grows with the number of chunks (measured on
the CPU in bf16: benchmarks/NOTES.md, "Linear cross-entropy: chunks and dweight precision"). Hence large chunks:
``MIN_CHUNKS`` = 4 of them (a quarter of the logits alive at a time, within the course's precision rule in that
measurement), more only where a chunk would exceed ``CHUNK_BYTES`` = 512 MB (8192 tokens x 128256 vocabulary in
bf16: 4 chunks); a float32 accumulator would cost 4 V d bytes (2 GB for Llama 3's head), more than chunks save.

Sources: Liger-Kernel's fused linear cross-entropy; Wijmans et al., "Cut Your Losses in Large-Vocabulary
Language Models" (2024).
"""

import torch

from ._utils import check_same_device, check_same_dtype, check_shape, check_tensor, launch_or_op, use_triton
from .cross_entropy import _backward as _ce_backward
from .cross_entropy import _ce_bwd_op, _ce_fwd_op
from .cross_entropy import _forward as _ce_forward

__all__ = ["linear_cross_entropy", "linear_cross_entropy_ref"]

CHUNK_BYTES = 2**29  # logits bytes per chunk of rows (512 MB) at most; fewer chunks, fewer roundings of dweight
MIN_CHUNKS = 4  # but at least this many: a quarter of the logits at a time, precision as measured for 4 chunks


def linear_cross_entropy_ref(
    h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """The definition: ``F.cross_entropy((h @ weight.T).float(), target)``, materializing the logits."""
    logits = h @ weight.T  # (T, V)
    compute = torch.promote_types(logits.dtype, torch.float32)
    return torch.nn.functional.cross_entropy(logits.to(compute), target, ignore_index=ignore_index, reduction=reduction)


def _chunk_rows(T: int, V: int, element_bytes: int) -> int:
    return max(1, min(T, CHUNK_BYTES // max(1, V * element_bytes), -(-T // MIN_CHUNKS)))


def _fused_pass(h, weight, target, ignore_index, dloss_rows, need_loss=True):
    """One pass over the row chunks: row losses (if asked) and, given per-row upstream gradients, dh and dweight."""
    T, d = h.shape
    V = weight.shape[0]
    loss = torch.empty(T, device=h.device, dtype=torch.float32) if need_loss else None
    dh = torch.empty_like(h) if dloss_rows is not None else None
    dweight = torch.zeros_like(weight) if dloss_rows is not None else None
    rows = _chunk_rows(T, V, h.element_size())
    for start in range(0, T, rows):
        h_c, t_c = h[start : start + rows], target[start : start + rows]
        logits = h_c @ weight.T  # (C, V): the only logits alive at any time
        loss_c, stats_c = launch_or_op(_ce_forward, _ce_fwd_op)(logits, t_c, ignore_index, 0.0)
        if need_loss:
            loss[start : start + rows] = loss_c
        if dloss_rows is not None:
            dloss_c = dloss_rows[start : start + rows]
            if torch.compiler.is_compiling():  # the op is functional: a new gradient tensor
                dlogits = _ce_bwd_op(dloss_c, logits, t_c, stats_c, ignore_index, 0.0)
            else:  # eager: the gradient overwrites this chunk's logits, no second (C, V) buffer
                dlogits = _ce_backward(dloss_c, logits, t_c, stats_c, ignore_index, 0.0, out=logits)
            del logits
            torch.mm(dlogits, weight, out=dh[start : start + rows])  # (C, d)
            dweight.addmm_(dlogits.T, h_c)  # float32 inside the matmul, one rounding to weight's dtype per chunk
    return loss, dh, dweight


def _row_weights(target, ignore_index, reduction):
    """d(reduced loss) / d(row loss), on the device with no host synchronization."""
    if reduction == "sum":
        return torch.ones(target.shape, device=target.device, dtype=torch.float32)
    valid = (target != ignore_index).float()
    return valid / valid.sum()  # mean over rows that are not ignored (0 / 0 = NaN rows are zeroed in the kernel)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, ignore_index, reduction):
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if reduction == "none" or not needs_grad:
            loss, _, _ = _fused_pass(h, weight, target, ignore_index, None)
            ctx.save_for_backward(h, weight, target)
        else:
            loss, dh, dweight = _fused_pass(
                h, weight, target, ignore_index, _row_weights(target, ignore_index, reduction)
            )
            ctx.save_for_backward(dh, dweight)
        if reduction == "none":
            return loss
        total = loss.sum()
        return total if reduction == "sum" else total / (target != ignore_index).sum()

    @staticmethod
    def backward(ctx, dloss):
        if ctx.reduction == "none":
            h, weight, target = ctx.saved_tensors
            _, dh, dweight = _fused_pass(h, weight, target, ctx.ignore_index, dloss.float(), need_loss=False)
            return dh, dweight, None, None, None
        dh, dweight = ctx.saved_tensors  # computed in the forward for an upstream gradient of 1
        return dh * dloss, dweight * dloss, None, None, None  # a 0-dim dloss keeps their dtype


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of the logits ``h @ weight.T`` against ``target``, without materializing the logits.

    h (T, d) and weight (V, d) share a float dtype; target (T,) int64. Equals ``F.cross_entropy((h @ weight.T)
    .float(), target, ignore_index=..., reduction=...)``; gradients for h and weight come back in their dtype.
    """
    check_tensor(h, "h", ndim=2)
    check_tensor(weight, "weight", ndim=2)
    check_tensor(target, "target", dtypes=(torch.int64,), ndim=1)
    if weight.shape[1] != h.shape[1]:
        raise ValueError(f"weight must have shape (V, {h.shape[1]}) to match h's last dim, got {tuple(weight.shape)}")
    check_shape(target, "target", (h.shape[0],))
    check_same_dtype(h=h, weight=weight)
    check_same_device(h=h, weight=weight, target=target)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f'reduction must be "mean", "sum" or "none", got {reduction!r}')
    if not use_triton(h, weight, op="linear_cross_entropy"):  # CPU without the interpreter: the reference
        return linear_cross_entropy_ref(h, weight, target, ignore_index, reduction)
    return _LinearCrossEntropy.apply(h, weight, target.contiguous(), int(ignore_index), reduction)
