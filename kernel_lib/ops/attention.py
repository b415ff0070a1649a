"""Flash attention in Triton: tiled attention with the online softmax, forward and backward, with causal,
sliding-window and grouped-query attention.

For q (B, Hq, N, D), k (B, Hkv, M, D) and v (B, Hkv, M, Dv) with Hq a multiple of Hkv (query head h reads
key/value head h // (Hq / Hkv)), any head dims up to 256 (Dv may differ from D), and scale s (default
1/sqrt(D))::

    out[i] = sum_j softmax_j(s * q_i . k_j over visible j) v_j          lse[i] = log sum_j exp(s * q_i . k_j)

Visibility, with the bottom-right alignment of FlashAttention (offset = M - N, so the last query sees the last
key; equal to PyTorch's ``is_causal`` when N = M):

* causal:          j <= i + offset
* window W:        i + offset - W < j <= i + offset         (requires causal)

A query that sees no key (N > M, causal) gets out = 0 and lse = -inf, and no gradient.

Forward: each program owns a block of BLOCK_M queries of one head, streams the visible key/value blocks through
shared memory, and keeps a running maximum, a running sum and an unnormalized output in registers (online
softmax, in base 2 for the hardware's exp2). It writes out and lse; nothing of size N x M ever reaches memory.
Backward recomputes the probabilities blockwise from lse. A small kernel first reads out and dout once to form
delta = rowsum(dout * out) (minus any gradient of lse) and lse in base 2. Then one kernel owns a key/value block
and loops over the query blocks of every query head of its group (dK, dV, summed over the group in registers;
computed transposed, s^T = k q^T, so no register tile is transposed); a second owns a query block and loops over
key blocks (dQ). Only tiles on the edge of the causal or window mask apply it; rows past N and keys past M load
as zeros, which contribute nothing. No atomics, so results are deterministic. A head dim that is not a power of
two is padded to one inside the kernels (the padding columns load as zeros, so the scores do not change).

Configs come from a heuristic per shape, and each must fit the GPU's shared memory: the estimate prunes the list,
then the compiled kernel's own count (Triton's ``metadata.shared``) has the last word, so a config the compiler
makes larger than estimated moves to the next one instead of failing at launch.

The Triton kernels live in the sibling ``attention_kernels.py``. Registered as the
``kernel_lib::flash_attention_fwd`` / ``kernel_lib::flash_attention_bwd`` custom ops with fake implementations,
which the one ``autograd.Function`` calls under torch.compile, so ``torch.compile(fullgraph=True)`` traces
through it. Sources: Dao et al., FlashAttention (2022) and FlashAttention-2 (2023); Triton's
fused-attention tutorial.
"""

import math
from typing import Optional

import torch
import triton

from . import attention_kernels as kernels
from ._utils import (
    autotune_requested,
    check_same_device,
    check_same_dtype,
    check_tensor,
    compile_fitting,
    configs_that_fit,
    launch_or_op,
    use_triton,
)
from .attention_kernels import LOG2E, _attn_bwd_prep_kernel

__all__ = ["flash_attention", "attention_ref", "MultiHeadAttention", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256  # FlashAttention's limit too; any head dim up to it, q/k and v apart


def _visible(N: int, M: int, causal: bool, window: Optional[int], device) -> torch.Tensor:
    """(N, M) boolean mask: which keys each query sees."""
    i = torch.arange(N, device=device)[:, None] + (M - N)  # query positions aligned to the keys' end
    j = torch.arange(M, device=device)[None, :]
    mask = torch.ones(N, M, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    if window is not None:
        mask &= j > i - window
    return mask


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """The definition with an explicit (N, M) mask, in float32 (float64 for float64 input), out in q's dtype."""
    compute = torch.promote_types(q.dtype, torch.float32)
    B, Hq, N, D = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kf = k.to(compute).repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, M, D)
    vf = v.to(compute).repeat_interleave(Hq // Hkv, dim=1)
    scores = (q.to(compute) @ kf.transpose(-1, -2)) * scale  # (B, Hq, N, M)
    scores = scores.masked_fill(~_visible(N, M, causal, window, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, N); -inf where a query sees nothing
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(compute).min)).nan_to_num(0.0)
    out = (probs @ vf).to(q.dtype)
    return (out, lse.float() if compute != torch.float64 else lse) if return_lse else out


# --------------------------------------------------------------------------------------------------
# Launchers (inputs already checked by the functional API)
# --------------------------------------------------------------------------------------------------
def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _shapes(q, k, v):
    B, Hq, N, D = q.shape
    return B, Hq, k.shape[1], N, k.shape[2], D, v.shape[-1]


def _dims(D: int, Dv: int) -> dict:
    """The head-dim constexprs: the true dims and their power-of-two tile widths."""
    return dict(D_QK=D, D_V=Dv, BLOCK_DQK=kernels.padded_head_dim(D), BLOCK_DV=kernels.padded_head_dim(Dv))


def _int_key(*ints: int) -> tuple:
    """What Triton specializes int arguments on (1, multiples of 16), for compile keys (the forward is not
    specialized on N, M and the window: ``attention_kernels._VARYING``)."""
    return tuple((i == 1, i % 16 == 0) for i in ints)


def _forward_launch(q, k, v, out, lse, causal, window, scale):
    """The forward's grid, arguments, constexpr flags and launch config for these tensors (q, k, v of unit stride
    along the head dim); the config is the heuristic's pick that fits this GPU, compiled to check it."""
    B, Hq, Hkv, N, M, D, Dv = _shapes(q, k, v)

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_M"]), B * Hq)

    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    args = (q, k, v, out, lse, *strides, Hq, N, M, Hq // Hkv, scale * LOG2E, window or 0)
    dims = _dims(D, Dv)
    flags = dict(**dims, CAUSAL=causal, WINDOW=window is not None, DOT_FP32=q.device.type == "cpu")
    if autotune_requested():
        return grid, args, flags, None
    width = dims["BLOCK_DQK"] + dims["BLOCK_DV"]
    preferred = kernels.fwd_preferred(N, width, causal, window is not None)
    candidates = configs_that_fit(preferred, kernels._FWD_CONFIGS[0], kernels._smem_bytes, {**dims, "q": q})
    key = ("fwd", q.device, q.dtype, *flags.values(), *(tuple(c.items()) for c in candidates),
           *_int_key(*strides, Hq, Hq // Hkv))  # fmt: skip
    (config,) = compile_fitting(key, [(kernels._attn_fwd_kernel, grid, args, flags, candidates)])
    return grid, args, flags, config


def forward_config(q, k, v, causal: bool = False, window: Optional[int] = None) -> dict:
    """The tiles, warps and stages the forward launches with for these inputs on their device (the smallest
    tiles when interpreted), as the launcher picks them."""
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    config = _forward_launch(q, k, v, out, lse, causal, window, 1.0)[3]
    if config is None:
        raise RuntimeError("KERNEL_LIB_AUTOTUNE=1: the forward's config is Triton's autotuner's choice")
    return config


def _forward(q, k, v, causal, window, scale):
    B, Hq, Hkv, N, M, D, Dv = _shapes(q, k, v)
    out = torch.empty((B, Hq, N, Dv), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, Hq, N), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    grid, args, flags, config = _forward_launch(q, k, v, out, lse, causal, window, scale)
    if config is None:
        kernels._attn_fwd_tuned[grid](*args, **flags)
    else:
        kernels._attn_fwd_kernel[grid](*args, **flags, **config)
    return out, lse


def _backward(do, q, k, v, out, lse, dlse, causal, window, scale):
    B, Hq, Hkv, N, M, D, Dv = _shapes(q, k, v)
    do = do.contiguous()
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    dq = torch.empty((B, Hq, N, D), device=q.device, dtype=q.dtype)
    dk = torch.empty((B, Hkv, M, D), device=k.device, dtype=k.dtype)
    dv = torch.empty((B, Hkv, M, Dv), device=v.device, dtype=v.dtype)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # One pass over out and dout: delta = rowsum(dout * out) - dlse, and lse in base 2 (+inf for a query that
    # sees nothing, so its probabilities recompute as 0), float32, each head's row padded to a multiple of 16
    # so the backward kernels load them aligned whatever N is (N is not specialized on).
    stat_stride = triton.cdiv(N, 16) * 16
    delta_lse2 = torch.empty((2, B * Hq, stat_stride), device=q.device, dtype=torch.float32)
    dims = _dims(D, Dv)
    block_r = max(1, 4096 // dims["BLOCK_DV"])
    prep_grid = (triton.cdiv(N, block_r), B * Hq)
    prep_args = (out.contiguous(), do, lse.contiguous(), dlse.float().contiguous() if dlse is not None else lse,
                 delta_lse2[0], delta_lse2[1], N, stat_stride)  # fmt: skip
    prep_flags = dict(D_V=Dv, BLOCK_DV=dims["BLOCK_DV"], HAS_DLSE=dlse is not None, BLOCK_R=block_r)
    delta, lse2 = delta_lse2[0], delta_lse2[1]
    flags = dict(**dims, CAUSAL=causal, WINDOW=window is not None, DOT_FP32=q.device.type == "cpu")
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    dkdv_grid = lambda meta: (triton.cdiv(M, meta["BLOCK_N"]), B * Hkv)  # noqa: E731
    dkdv_args = (q, k, v, do, lse2, delta, dk, dv, *strides, Hq, Hkv, N, M, Hq // Hkv, stat_stride, scale, window or 0)
    dq_grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), B * Hq)  # noqa: E731
    dq_args = (q, k, v, do, lse2, delta, dq, *strides, Hq, N, M, Hq // Hkv, stat_stride, scale, window or 0)
    if autotune_requested():
        _attn_bwd_prep_kernel[prep_grid](*prep_args, **prep_flags)
        kernels._attn_bwd_dkdv_tuned[dkdv_grid](*dkdv_args, **flags)
        kernels._attn_bwd_dq_tuned[dq_grid](*dq_args, **flags)
        return dq, dk, dv
    width = dims["BLOCK_DQK"] + dims["BLOCK_DV"]
    smem_args = {**dims, "q": q}
    dkdv_candidates = configs_that_fit(
        kernels.dkdv_preferred(N, width, causal, window), kernels._DKDV_CONFIGS[0], kernels._smem_bytes_dkdv, smem_args
    )
    dq_candidates = configs_that_fit(
        kernels.dq_preferred(width, causal), kernels._DQ_CONFIGS[0], kernels._smem_bytes_dq, smem_args
    )
    # The first backward at a new specialization compiles three kernels: side by side, not one after another;
    # each keeps the first candidate whose compiled shared memory fits the device.
    key = (q.device, q.dtype, dlse is not None, *flags.values(), *(tuple(c.items()) for c in dkdv_candidates),
           *(tuple(c.items()) for c in dq_candidates), *_int_key(*strides, Hq, Hkv, Hq // Hkv, N, M))  # fmt: skip
    _, dkdv, dq_config = compile_fitting(key, [
        (_attn_bwd_prep_kernel, prep_grid, prep_args, prep_flags, [{}]),
        (kernels._attn_bwd_dkdv_kernel, dkdv_grid, dkdv_args, flags, dkdv_candidates),
        (kernels._attn_bwd_dq_kernel, dq_grid, dq_args, flags, dq_candidates),
    ])  # fmt: skip
    _attn_bwd_prep_kernel[prep_grid](*prep_args, **prep_flags)
    kernels._attn_bwd_dkdv_kernel[dkdv_grid](*dkdv_args, **flags, **dkdv)
    kernels._attn_bwd_dq_kernel[dq_grid](*dq_args, **flags, **dq_config)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------
# torch.library registration: opaque ops with fake implementations, what torch.compile records
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::flash_attention_fwd", mutates_args=())
def _attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: Optional[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, causal, window, scale)


@_attn_fwd_op.register_fake
def _(q, k, v, causal, window, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("kernel_lib::flash_attention_bwd", mutates_args=())
def _attn_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: Optional[torch.Tensor],
    causal: bool,
    window: Optional[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, out, lse, dlse, causal, window, scale)


@_attn_bwd_op.register_fake
def _(do, q, k, v, out, lse, dlse, causal, window, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# --------------------------------------------------------------------------------------------------
# Autograd: the launchers in eager mode, the ops under torch.compile (see _utils.launch_or_op)
# --------------------------------------------------------------------------------------------------
class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, window, scale):
        out, lse = launch_or_op(_forward, _attn_fwd_op)(q, k, v, causal, window, scale)
        ctx.causal, ctx.window, ctx.scale = causal, window, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        args = (dout, q, k, v, out, lse, dlse, ctx.causal, ctx.window, ctx.scale)
        dq, dk, dv = launch_or_op(_backward, _attn_bwd_op)(*args)
        return dq, dk, dv, None, None, None


# --------------------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------------------
def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window: Optional[int] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Attention of q (B, Hq, N, D) over k (B, Hkv, M, D) and v (B, Hkv, M, Dv), Hq a multiple of Hkv, float16
    or bfloat16, any head dims D and Dv up to 256 (Dv may differ from D, as in multi-head latent attention).

    ``causal`` aligns the mask bottom-right (query i sees keys j <= i + M - N; PyTorch's ``is_causal`` when
    N = M); ``window=W`` (with causal) also hides keys j <= i + M - N - W. ``scale`` defaults to 1/sqrt(D).
    Returns out (B, Hq, N, Dv) in q's dtype, and with ``return_lse`` also the float32 log-sum-exp (B, Hq, N).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, dtypes=(torch.float16, torch.bfloat16), ndim=4)
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v)
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on batch, heads and length, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    for name, t in (("q and k", q), ("v", v)):
        if not 1 <= t.shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(f"head dim of {name} must be between 1 and {MAX_HEAD_DIM}, got {t.shape[-1]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if window is not None:
        if not causal:
            raise ValueError("window needs causal=True (a sliding window looks back from each query)")
        if int(window) < 1:
            raise ValueError(f"window must be a positive number of keys, got {window}")
        window = int(window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if use_triton(q, k, v, op="flash_attention"):
        out, lse = _FlashAttention.apply(q, k, v, bool(causal), window, scale)
    else:  # CPU without the interpreter: the reference, differentiated by autograd
        out, lse = attention_ref(q, k, v, bool(causal), window, scale, return_lse=True)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------------
# Module
# --------------------------------------------------------------------------------------------------
class MultiHeadAttention(torch.nn.Module):
    """Self-attention with one fused QKV projection, optional rotary embedding, flash attention and an output
    projection. ``n_kv_heads`` < ``n_heads`` gives grouped-query attention (1: multi-query)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: Optional[int] = None,
        causal: bool = True,
        window: Optional[int] = None,
        rope: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"dim ({dim}) must divide into n_heads ({n_heads}), a multiple of n_kv_heads ({n_kv_heads})"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.causal, self.window, self.rope = causal, window, rope
        qkv_out = (n_heads + 2 * n_kv_heads) * self.head_dim
        self.qkv = torch.nn.Linear(dim, qkv_out, bias=False, device=device, dtype=dtype)
        self.proj = torch.nn.Linear(dim, dim, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(B, N, H, D).transpose(1, 2)  # (B, H, N, D)
        k = k.view(B, N, Hkv, D).transpose(1, 2)  # (B, Hkv, N, D)
        v = v.view(B, N, Hkv, D).transpose(1, 2)
        if self.rope:
            from .rope import rope, rope_cos_sin  # imported here: without rope this file needs only _utils.py

            cos, sin = rope_cos_sin(N, D, device=x.device)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        out = flash_attention(q, k, v, causal=self.causal, window=self.window)  # (B, H, N, D)
        return self.proj(out.transpose(1, 2).reshape(B, N, H * D))
