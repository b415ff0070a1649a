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
host synchronization happens in the forward. The gather by expert and the weighted scatter-add back are PyTorch
indexing ops here (their own Triton kernels, or fusion into the GEMMs' prologue and epilogue, are the next step).

``moe_ref`` is the per-expert Python loop: the definition that tests, notebooks and benchmarks compare against.
"""

import torch
import torch.nn.functional as F

from ._utils import check_tensor
from .grouped_mm import _grouped_mm_op, _GroupedMM
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


def _grouped(x, w, offs):
    # offs are built below and valid by construction: skip the public API's host-side check (a GPU sync).
    if torch.compiler.is_compiling():
        return _grouped_mm_op(x, w, offs)
    return _GroupedMM.apply(x, w, offs)


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
    shape = x.shape
    x = x.reshape(-1, d)  # (T, d)
    logits, probs, weights, experts = _route(x, router_weight, top_k)
    flat_experts = experts.reshape(-1)  # (T*k,)
    order = flat_experts.argsort(stable=True)  # assignments grouped by expert
    token = order // top_k  # the token of each sorted assignment
    offs = torch.bincount(flat_experts, minlength=E).cumsum(0).to(torch.int32)
    xs = x[token]  # (T*k, d), rows of each expert contiguous
    h = swiglu(_grouped(xs, w_gate, offs), _grouped(xs, w_up, offs))  # (T*k, d_ff)
    out = _grouped(h, w_down, offs)  # (T*k, d)
    scale = weights.reshape(-1)[order, None]  # float32 routing weight of each sorted assignment
    y = torch.zeros_like(x, dtype=scale.dtype).index_add(0, token, out.to(scale.dtype) * scale)  # k terms in float32
    y = y.to(x.dtype)
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
