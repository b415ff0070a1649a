"""A Mixture-of-Experts layer with SwiGLU experts: top-k routing, tokens sorted by expert, grouped GEMMs.

For x (T, d) (any leading dims are flattened), a router (E, d) and per-expert weights w_gate, w_up (E, d, d_ff)
and w_down (E, d_ff, d)::

    probs   = softmax(x @ router.T)                         (T, E), in float32
    top-k   experts per token; weights renormalized to sum to 1 over the chosen k
    order   = the T*k (token, expert) assignments sorted by expert; offs = cumulative count per expert
    h       = swiglu(grouped_mm(x[order], w_gate), grouped_mm(x[order], w_up))      (T*k, d_ff)
    y[t]    = sum over t's assignments of weight * grouped_mm(h, w_down)             (weighted scatter-add)
    aux     = aux_loss_coef * E * sum_e fraction_e * mean_prob_e  (+ z_loss_coef * mean(logsumexp(logits)^2))

where fraction_e is the share of the T*k assignments that went to expert e and mean_prob_e the router's mean
probability for e (the load-balancing loss of Switch Transformer / GShard). The expert matmuls run as three
grouped GEMMs (``kernel_lib.grouped_mm``) instead of 3 E small ones; the offsets are built on the device, so no
host synchronization happens in the forward.

The permutation has two Triton kernels of its own, both plain row copies with no atomics:

    gather:   xs[r] = scale[r] * src[index[r]]                  one program per sorted row r
    combine:  y[t]  = sum over j < k of w[t, j] * out[pos[t, j]]  one program per token t, k rows summed in float32

where ``pos`` (T, k) is the inverse of the sort: the sorted row of token t's j-th assignment. Each is the other's
backward: the gradient of a gather is a combine with weights 1 (dx[t] sums the k sorted rows of token t), and the
gradient of a combine is a gather of dy scaled by the routing weights, plus dw[t, j] = <dy[t], out[pos[t, j]]>
(``_combine_dw_kernel``). The combine replaces ``index_add`` of float32-weighted rows, which notebook 04c shows
to be a large share of the layer's forward.

``moe_ref`` is the per-expert Python loop: the definition that tests, notebooks and benchmarks compare against.
"""

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import check_tensor, launch_or_op, use_triton
from .grouped_mm import _GroupedMM
from .swiglu import swiglu

__all__ = ["moe", "moe_ref", "MoE"]


def _route(x, router_weight, top_k):
    logits = x @ router_weight.T  # (T, E)
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    top_probs, experts = probs.topk(top_k, dim=-1)  # (T, k) each
    weights = top_probs / top_probs.sum(dim=-1, keepdim=True)
    return logits, probs, weights, experts


def _aux_loss(logits, probs, experts, n_experts, aux_loss_coef, z_loss_coef):
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts).to(probs.dtype)
    fraction = counts / experts.numel()  # share of the T*k assignments per expert (not differentiable)
    aux = aux_loss_coef * n_experts * (fraction * probs.mean(dim=0)).sum()
    if z_loss_coef:
        aux = aux + z_loss_coef * torch.logsumexp(logits.to(probs.dtype), dim=-1).pow(2).mean()
    return aux


# --------------------------------------------------------------------------------------------------
# Permutation kernels: row gather (tokens -> sorted by expert) and weighted combine (sorted -> tokens)
# --------------------------------------------------------------------------------------------------
BLOCK_COLS = 1024  # columns per program: each program moves a few KB per row


@triton.jit
def _gather_kernel(
    src_ptr,  # (n_src, D) contiguous
    index_ptr,  # (R,) int64: the source row of each output row
    scale_ptr,  # (R,) float32 multiplier of each output row; unused when HAS_SCALE is False
    out_ptr,  # (R, D) contiguous, src's dtype
    D,  # row width
    HAS_SCALE: tl.constexpr,  # multiply each row by its scale
    BLOCK_D: tl.constexpr,  # columns per program
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    row = tl.load(src_ptr + tl.load(index_ptr + r) * D + cols, mask=mask, other=0.0)
    if HAS_SCALE:
        row = (row.to(tl.float32) * tl.load(scale_ptr + r)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * D + cols, row, mask=mask)


@triton.jit
def _combine_kernel(
    src_ptr,  # (T * k, D) contiguous: rows sorted by expert
    pos_ptr,  # (T, k) int64: the sorted row of each (token, slot)
    weight_ptr,  # (T, k) float32 routing weights; unused when HAS_WEIGHT is False (weights of 1)
    out_ptr,  # (T, D) contiguous, src's dtype
    D,  # row width
    K_SLOTS,  # k: assignments per token
    HAS_WEIGHT: tl.constexpr,  # weight each row, or sum them plainly
    BLOCK_K: tl.constexpr,  # power of two >= k
    BLOCK_D: tl.constexpr,  # columns per program
):
    t = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    slot_ok = slots < K_SLOTS
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    pos = tl.load(pos_ptr + t * K_SLOTS + slots, mask=slot_ok, other=0)
    rows = tl.load(src_ptr + pos[:, None] * D + cols[None, :], mask=slot_ok[:, None] & mask[None, :], other=0.0)
    rows = rows.to(tl.float32)  # (BLOCK_K, BLOCK_D): the k rows of this token, summed in float32
    if HAS_WEIGHT:
        rows = rows * tl.load(weight_ptr + t * K_SLOTS + slots, mask=slot_ok, other=0.0)[:, None]
    tl.store(out_ptr + t * D + cols, tl.sum(rows, axis=0).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_dw_kernel(
    dy_ptr,  # (T, D) contiguous: gradient of the combined output
    src_ptr,  # (T * k, D) contiguous: the rows that were combined
    pos_ptr,  # (T, k) int64
    dw_ptr,  # output (T, k) float32: dw[t, j] = <dy[t], src[pos[t, j]]>
    D,  # row width
    K_SLOTS,  # k
    BLOCK_K: tl.constexpr,  # power of two >= k
    BLOCK_D: tl.constexpr,  # columns per step
):
    t = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    slot_ok = slots < K_SLOTS
    pos = tl.load(pos_ptr + t * K_SLOTS + slots, mask=slot_ok, other=0)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = cols < D
        dy = tl.load(dy_ptr + t * D + cols, mask=mask, other=0.0).to(tl.float32)
        rows = tl.load(src_ptr + pos[:, None] * D + cols[None, :], mask=slot_ok[:, None] & mask[None, :], other=0.0)
        acc += tl.sum(rows.to(tl.float32) * dy[None, :], axis=1)
    tl.store(dw_ptr + t * K_SLOTS + slots, acc, mask=slot_ok)


def _gather_rows(src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """out[r] = scale[r] * src[index[r]] (scale None: a plain gather)."""
    src = src.contiguous()
    out = src.new_empty((index.shape[0], src.shape[1]))
    if out.numel() == 0:
        return out
    grid = (index.shape[0], triton.cdiv(src.shape[1], BLOCK_COLS))
    _gather_kernel[grid](
        src, index, scale if scale is not None else index, out, src.shape[1],
        HAS_SCALE=scale is not None, BLOCK_D=BLOCK_COLS, num_warps=4,
    )  # fmt: skip
    return out


def _combine_rows(src: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """out[t] = sum_j weight[t, j] * src[pos[t, j]] (weight None: weights of 1), summed in float32."""
    src = src.contiguous()
    T, k = pos.shape
    out = src.new_empty((T, src.shape[1]))
    if out.numel() == 0:
        return out
    grid = (T, triton.cdiv(src.shape[1], BLOCK_COLS))
    _combine_kernel[grid](
        src, pos, weight if weight is not None else pos, out, src.shape[1], k,
        HAS_WEIGHT=weight is not None, BLOCK_K=triton.next_power_of_2(k), BLOCK_D=BLOCK_COLS, num_warps=4,
    )  # fmt: skip
    return out


def _combine_weight_grad(dy: torch.Tensor, src: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """dw[t, j] = <dy[t], src[pos[t, j]]> in float32."""
    dy, src = dy.contiguous(), src.contiguous()
    T, k = pos.shape
    dw = torch.empty((T, k), device=src.device, dtype=torch.float32)
    if dw.numel() == 0:
        return dw
    _combine_dw_kernel[(T,)](
        dy, src, pos, dw, src.shape[1], k, BLOCK_K=triton.next_power_of_2(k), BLOCK_D=BLOCK_COLS, num_warps=4
    )
    return dw


# --------------------------------------------------------------------------------------------------
# torch.library registration: opaque ops with fake implementations, what torch.compile records
# (typing.Optional in these signatures: the schema inference of older torch releases does not read `X | None`)
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::moe_gather", mutates_args=())
def _gather_op(src: torch.Tensor, index: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    return _gather_rows(src, index, scale)


@torch.library.custom_op("kernel_lib::moe_combine", mutates_args=())
def _combine_op(src: torch.Tensor, pos: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    return _combine_rows(src, pos, weight)


@_gather_op.register_fake
@_combine_op.register_fake
def _(src, index, _weights):
    # both write one row of src's width per row of their index (the gather's rows, the combine's tokens)
    return src.new_empty((index.shape[0], src.shape[1]))


@torch.library.custom_op("kernel_lib::moe_combine_weight_grad", mutates_args=())
def _combine_weight_grad_op(dy: torch.Tensor, src: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return _combine_weight_grad(dy, src, pos)


@_combine_weight_grad_op.register_fake
def _(dy, src, pos):
    return src.new_empty(pos.shape, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Autograd: the launchers in eager mode, the ops under torch.compile (see _utils.launch_or_op); the gather and
# the combine are each other's backward, so each Function calls the other's launcher there
# --------------------------------------------------------------------------------------------------
class _Dispatch(torch.autograd.Function):
    """xs = x[token]: each token's row copied to its k sorted places. Backward: dx[t] = sum of t's k sorted rows."""

    @staticmethod
    def forward(ctx, x, token, pos):
        ctx.save_for_backward(pos)
        return launch_or_op(_gather_rows, _gather_op)(x, token, None)

    @staticmethod
    def backward(ctx, dxs):
        (pos,) = ctx.saved_tensors
        return launch_or_op(_combine_rows, _combine_op)(dxs, pos, None), None, None


class _Combine(torch.autograd.Function):
    """y[t] = sum_j weight[t, j] * src[pos[t, j]]. Backward: dsrc = dy gathered and weighted; dweight = row dots."""

    @staticmethod
    def forward(ctx, src, weight, pos, token, order):
        ctx.save_for_backward(src, weight, pos, token, order)
        return launch_or_op(_combine_rows, _combine_op)(src, pos, weight)

    @staticmethod
    def backward(ctx, dy):
        src, weight, pos, token, order = ctx.saved_tensors
        gather = launch_or_op(_gather_rows, _gather_op)
        weight_grad = launch_or_op(_combine_weight_grad, _combine_weight_grad_op)
        dsrc = gather(dy, token, weight.reshape(-1)[order]) if ctx.needs_input_grad[0] else None
        dweight = weight_grad(dy, src, pos) if ctx.needs_input_grad[1] else None
        return dsrc, dweight, None, None, None


def moe_ref(x, router_weight, w_gate, w_up, w_down, top_k, aux_loss_coef=0.01, z_loss_coef=0.0):
    """The definition: route, then loop over experts in plain PyTorch. Returns (y, aux_loss)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # (T, d)
    logits, probs, weights, experts = _route(x, router_weight, top_k)
    y = torch.zeros_like(x, dtype=probs.dtype)
    for e in range(w_gate.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        h = x[token]
        out = (F.silu(h @ w_gate[e]) * (h @ w_up[e])) @ w_down[e]
        y = y.index_add(0, token, out.to(y.dtype) * weights[token, slot, None])
    aux = _aux_loss(logits, probs, experts, w_gate.shape[0], aux_loss_coef, z_loss_coef)
    return y.to(x.dtype).reshape(shape), aux


def moe(x, router_weight, w_gate, w_up, w_down, top_k, aux_loss_coef=0.01, z_loss_coef=0.0):
    """The MoE layer's forward on x (..., d); returns (y shaped like x, aux_loss). See the module docstring."""
    check_tensor(x, "x", min_ndim=2)
    E, d, d_ff = w_gate.shape
    if x.shape[-1] != d or router_weight.shape != (E, d) or w_up.shape != (E, d, d_ff) or w_down.shape != (E, d_ff, d):
        raise ValueError(
            f"shapes do not fit together: x (..., {x.shape[-1]}), router {tuple(router_weight.shape)}, "
            f"w_gate {tuple(w_gate.shape)}, w_up {tuple(w_up.shape)}, w_down {tuple(w_down.shape)}"
        )
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be between 1 and the number of experts ({E}), got {top_k}")
    if not use_triton(x, op="moe"):  # CPU without the interpreter: the reference, differentiated by autograd
        return moe_ref(x, router_weight, w_gate, w_up, w_down, top_k, aux_loss_coef, z_loss_coef)
    shape = x.shape
    x = x.reshape(-1, d)  # (T, d)
    logits, probs, weights, experts = _route(x, router_weight, top_k)
    flat_experts = experts.reshape(-1)  # (T*k,)
    order = flat_experts.argsort(stable=True)  # assignments grouped by expert
    token = order // top_k  # the token of each sorted assignment
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)  # inverse of the sort
    pos = pos.view(-1, top_k)  # (T, k): the sorted row of each (token, slot)
    offs = torch.bincount(flat_experts, minlength=E).cumsum(0).to(torch.int32)
    xs = _Dispatch.apply(x, token, pos)  # (T*k, d), rows of each expert contiguous
    # offs are valid by construction: the Function skips grouped_mm's host-side check (a GPU sync)
    h = swiglu(_GroupedMM.apply(xs, w_gate, offs), _GroupedMM.apply(xs, w_up, offs))  # (T*k, d_ff)
    out = _GroupedMM.apply(h, w_down, offs)  # (T*k, d)
    y = _Combine.apply(out, weights, pos, token, order)  # (T, d): k weighted rows per token, summed in float32
    aux = _aux_loss(logits, probs, experts, E, aux_loss_coef, z_loss_coef)
    return y.reshape(shape), aux


class MoE(torch.nn.Module):
    """Mixture of SwiGLU experts with a softmax top-k router. ``forward(x)`` returns ``(y, aux_loss)``."""

    def __init__(self, d_model, d_ff, n_experts, top_k, aux_loss_coef=0.01, z_loss_coef=0.0, device=None, dtype=None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be between 1 and n_experts ({n_experts}), got {top_k}")
        self.top_k, self.aux_loss_coef, self.z_loss_coef = top_k, aux_loss_coef, z_loss_coef
        kw = dict(device=device, dtype=dtype)
        self.router = torch.nn.Linear(d_model, n_experts, bias=False, **kw)
        self.w_gate = torch.nn.Parameter(torch.randn(n_experts, d_model, d_ff, **kw) / d_model**0.5)
        self.w_up = torch.nn.Parameter(torch.randn(n_experts, d_model, d_ff, **kw) / d_model**0.5)
        self.w_down = torch.nn.Parameter(torch.randn(n_experts, d_ff, d_model, **kw) / d_ff**0.5)

    def forward(self, x):
        weights = (self.router.weight, self.w_gate, self.w_up, self.w_down)
        return moe(x, *weights, self.top_k, self.aux_loss_coef, self.z_loss_coef)
