"""Attention variants from a mask function: a mask written in ``triton.language``, compiled into a block-sparse
flash attention (the idea of FlexAttention and FlashAttention-4's ``mask_mod``, on Triton).

    mask_mod(b, h, q_idx, kv_idx, captures) -> bool     True where query q_idx of head h, sequence b sees key kv_idx
    out = softmax(q k^T * scale, keys not seen: -inf) v          a query that sees no key: 0, lse -inf

``mask_mod`` is a ``@triton.jit`` function of index tiles (broadcast against each other) and ``captures``, a tuple
of tensors (their pointers: index them with ``tl.load``) and Python numbers the caller hands in, e.g. a document id
per token. It sees indices inside [0, N) and [0, M) only; its module must import ``triton.language`` (Triton
requires it). Data flow:

1. ``create_block_mask`` evaluates ``mask_mod`` once over every BLOCK_M x BLOCK_N block of the (N, M) grid (a
   Triton kernel, a program a block), classifies each block as empty, partial or full, and lists for each query
   block its full and its partial key blocks (counts and indices, on the device, no host sync). Make it once per
   mask and reuse it: a document mask changes with the batch, a sliding window never.
2. ``flex_attention``'s forward runs a program per (query block, head, sequence): the online softmax of the flash
   forward over the full key blocks without a mask, then over the partial ones with ``mask_mod`` applied element
   by element; empty blocks are never read. GQA: heads share keys as in ``flash_attention``.
3. The backward (not fused yet) recomputes through the float32 definition with the mask materialized, N x M
   booleans a (sequence, head) the mask depends on: correct, but memory-bound and O(N M); the fused backward over
   the same block lists is the next step.

Named patterns (``PATTERNS``: causal, sliding_window, document, prefix_lm) are mask functions with their captures
made by ``compile_attention_kernel(pattern, **params)``, which returns a callable ``attend(q, k, v)`` that builds
its block mask on first use for each shape. Tested against the float64 definition on the CPU under Triton's
interpreter (2026-11-29); not yet run or timed on a GPU. Needs Triton 3.3 or newer (tuples as kernel arguments).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import check_same_device, check_same_dtype, check_tensor, is_interpreting, use_triton
from .attention_kernels import _head_base, _load_kv, _query_block, _store_tile

__all__ = [
    "BlockMask",
    "create_block_mask",
    "dense_mask",
    "flex_attention",
    "flex_attention_ref",
    "compile_attention_kernel",
    "PATTERNS",
]

EMPTY, PARTIAL, FULL = 0, 1, 2  # a block's state: no query sees a key of it; some do; every query sees every key


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------
def flex_attention_ref(q, k, v, mask: torch.Tensor, scale: Optional[float] = None, return_lse: bool = False):
    """The definition with an explicit boolean ``mask`` broadcastable to (B, Hq, N, M), in float32 (float64 for
    float64 input), out in q's dtype, lse in float32 (float64); a query that sees no key gives 0 and lse -inf."""
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kf, vf = (t.to(compute).repeat_interleave(group, dim=1) for t in (k, v))
    scores = ((q.to(compute) @ kf.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = (probs @ vf).to(q.dtype)
    return (out, lse if compute == torch.float64 else lse.float()) if return_lse else out


# --------------------------------------------------------------------------------------------------
# Named patterns: mask functions and what they capture
# --------------------------------------------------------------------------------------------------
@triton.jit
def causal_mask(b, h, q_idx, kv_idx, captures):
    """Bottom-right causal: query i sees keys up to i + (M - N). captures: (M - N,)."""
    return kv_idx <= q_idx + captures[0]


@triton.jit
def sliding_window_mask(b, h, q_idx, kv_idx, captures):
    """Causal within a window of W keys (the query's own included). captures: (M - N, W)."""
    pos = q_idx + captures[0]
    return (kv_idx <= pos) & (kv_idx > pos - captures[1])


@triton.jit
def document_mask(b, h, q_idx, kv_idx, captures):
    """Causal within a document: packed sequences of one row, a document id per token. captures: (doc ids (B, N)
    int32 contiguous, N)."""
    doc = captures[0] + b * captures[1]
    return (kv_idx <= q_idx) & (tl.load(doc + q_idx) == tl.load(doc + kv_idx))


@triton.jit
def prefix_lm_mask(b, h, q_idx, kv_idx, captures):
    """Bidirectional over a prefix, causal after it. captures: (prefix length,)."""
    return (kv_idx <= q_idx) | (kv_idx < captures[0])


def _causal(N, M, **_):
    return causal_mask, (M - N,)


def _sliding_window(N, M, window_size: int, **_):
    if int(window_size) < 1:
        raise ValueError(f"window_size must be a positive number of keys, got {window_size}")
    return sliding_window_mask, (M - N, int(window_size))


def _document(N, M, document_ids: torch.Tensor, **_):
    check_tensor(document_ids, "document_ids", dtypes=(torch.int32, torch.int64), ndim=2)
    if N != M or document_ids.shape[1] != N:
        raise ValueError(f"document masking needs N == M == document_ids.shape[1], got N {N}, M {M} and ids of "
                         f"shape {tuple(document_ids.shape)}")  # fmt: skip
    return document_mask, (document_ids.to(torch.int32).contiguous(), N)


def _prefix_lm(N, M, prefix_length: int, **_):
    if N != M:
        raise ValueError(f"prefix_lm needs as many queries as keys, got {N} and {M}")
    return prefix_lm_mask, (int(prefix_length),)


PATTERNS: dict[str, Callable] = {
    "causal": _causal,
    "sliding_window": _sliding_window,
    "document": _document,
    "prefix_lm": _prefix_lm,
}  # name -> (N, M, **params) -> (mask_mod, captures); "document" masks per sequence (B = the ids' rows)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _block_states_kernel(
    states_ptr,  # (B', H', NQ, NK) int8 output: EMPTY, PARTIAL or FULL
    N, M,  # query and key lengths
    H_MASK,  # heads the mask is evaluated for (1 when it does not depend on the head)
    captures,  # the mask function's tuple
    MASK_MOD: tl.constexpr,  # the mask function
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    qb, kb, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H_MASK, bh % H_MASK
    rows = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    # the mask function sees indices in range; padding rows and columns are judged by in_n and in_m
    seen = MASK_MOD(b, h, tl.minimum(rows, N - 1)[:, None], tl.minimum(cols, M - 1)[None, :], captures)
    in_n, in_m = (rows < N)[:, None], (cols < M)[None, :]
    any_seen = tl.max((seen & in_n & in_m).to(tl.int32))
    # full: every real query sees every key, and no key of the block lies past M (those must score -inf)
    all_seen = tl.min((seen | ~in_n).to(tl.int32)) * tl.min(in_m.to(tl.int32))
    state = tl.where(any_seen == 0, 0, tl.where(all_seen == 1, 2, 1))
    n_qb, n_kb = tl.num_programs(0), tl.num_programs(1)
    tl.store(states_ptr + (bh * n_qb + qb) * n_kb + kb, state.to(tl.int8))


@triton.jit
def _dense_mask_kernel(out_ptr, N, M, H_MASK, captures, MASK_MOD: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):  # fmt: skip
    """The mask element by element, (B', H', N, M) bool (the backward's recomputation and the tests)."""
    qb, kb, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H_MASK, bh % H_MASK
    rows = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    seen = MASK_MOD(b, h, tl.minimum(rows, N - 1)[:, None], tl.minimum(cols, M - 1)[None, :], captures)
    inside = (rows < N)[:, None] & (cols < M)[None, :]
    tl.store(out_ptr + bh.to(tl.int64) * N * M + rows[:, None] * M + cols[None, :], seen.to(tl.int8), mask=inside)


@triton.jit
def _flex_steps(
    acc, l_i, m_i, q,  # running output, sum and max of this program's queries; its q tile
    k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
    idx_ptr, count,  # the key blocks to visit: count indices from idx_ptr
    b, h, N, M, qk_scale, captures,
    MASK: tl.constexpr,  # partial blocks: apply the mask function (and the key range)
    MASK_MOD: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    for i in range(0, count):
        offs_n = tl.load(idx_ptr + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        k, v = _load_kv(k_base, v_base, offs_n, offs_dk, offs_dv, skn, svn, M, D_QK, D_V, BLOCK_DQK, BLOCK_DV, DOT_FP32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), base 2
        if MASK:
            seen = MASK_MOD(b, h, tl.minimum(offs_m, N - 1)[:, None], tl.minimum(offs_n, M - 1)[None, :], captures)
            s = tl.where(seen & (offs_n < M)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: p = 0, not NaN
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flex_fwd_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, Hq, N, D_QK), (B, Hkv, M, D_QK), (B, Hkv, M, D_V); unit stride along the head dim
    out_ptr,  # (B, Hq, N, D_V), q's dtype
    lse_ptr,  # (B, Hq, N) float32, natural log, unit stride along positions
    part_num_ptr, part_idx_ptr,  # the block mask: per (b', h', query block) the count and indices of partial blocks
    full_num_ptr, full_idx_ptr,  # and of full blocks; indices rows of NK
    smb, smh,  # the block mask's strides over its (B', H') rows, in query blocks (0 where it broadcasts)
    NK,  # key blocks (an index row's length)
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,  # strides of q, k, v: batch, head, position
    sob, soh, son, slb, slh,  # strides of out and lse
    Hq, N, M, GROUP,  # query heads, lengths, query heads per key/value head
    qk_scale,  # scale * log2(e)
    captures,  # the mask function's tuple
    MASK_MOD: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    start_m, b, h, q0, N, M, offs_m, offs_dk, offs_dv, q, k_base, v_base = _query_block(
        q_ptr, k_ptr, v_ptr, q_ptr, q_ptr, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, Hq, GROUP, N, M,
        D_QK, BLOCK_DQK, BLOCK_DV, BLOCK_M, False, DOT_FP32,
    )  # fmt: skip
    row = b * smb + h * smh + start_m // BLOCK_M  # this query block's row of the block mask
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc, l_i, m_i = _flex_steps(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
                                full_idx_ptr + row.to(tl.int64) * NK, tl.load(full_num_ptr + row), b, h, N, M,
                                qk_scale, captures, False, MASK_MOD, DOT_FP32, BLOCK_N, D_QK, D_V, BLOCK_DQK,
                                BLOCK_DV)  # fmt: skip
    acc, l_i, m_i = _flex_steps(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
                                part_idx_ptr + row.to(tl.int64) * NK, tl.load(part_num_ptr + row), b, h, N, M,
                                qk_scale, captures, True, MASK_MOD, DOT_FP32, BLOCK_N, D_QK, D_V, BLOCK_DQK,
                                BLOCK_DV)  # fmt: skip
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    _store_tile(_head_base(out_ptr, b, h, q0, sob, soh, son, False), out, offs_m, son, N, offs_dv, D_V, BLOCK_DV)
    tl.store(_head_base(lse_ptr, b, h, q0, slb, slh, 1, False) + offs_m, lse, mask=offs_m < N)


# --------------------------------------------------------------------------------------------------
# The block mask
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Which key blocks each query block visits, for one mask function at one (N, M) and tile shape.

    ``part_num`` / ``full_num``: (B', H', NQ) int32, the partial and full key blocks of each query block;
    ``part_idx`` / ``full_idx``: (B', H', NQ, NK) int32, their indices first (ascending), the rest unused. B' is 1
    when the mask does not depend on the sequence (it then serves any batch), H' likewise for heads."""

    part_num: torch.Tensor
    part_idx: torch.Tensor
    full_num: torch.Tensor
    full_idx: torch.Tensor
    N: int
    M: int
    block_m: int
    block_n: int
    mask_mod: Callable
    captures: tuple

    @property
    def shape(self) -> tuple:
        return (*self.part_num.shape[:2], self.N, self.M)

    def density(self) -> float:
        """The share of key blocks visited (partial or full): what the forward reads of a dense attention's."""
        total = self.part_idx.shape[-1] * self.part_num.numel()
        return float((self.part_num.sum() + self.full_num.sum()).item()) / max(1, total)


def default_blocks(device) -> tuple[int, int]:
    """The tile shape a block mask is made at: the flash forward's 128 x 64 on a GPU; 32 x 32 interpreted."""
    return (32, 32) if torch.device(device).type == "cpu" else (128, 64)


# what @triton.jit returns: a JITFunction, or under the interpreter an InterpretedFunction
_INTERPRETER = getattr(triton.runtime, "interpreter", None)
_JIT_TYPES = tuple(
    t for t in (getattr(triton.runtime, "JITFunction", None), getattr(_INTERPRETER, "InterpretedFunction", None)) if t
)


def _check_mask_args(mask_mod, captures, N: int, M: int) -> tuple:
    if not isinstance(mask_mod, _JIT_TYPES):
        raise TypeError(f"mask_mod must be a @triton.jit function (b, h, q_idx, kv_idx, captures), got "
                        f"{type(mask_mod).__name__}")  # fmt: skip
    if not isinstance(captures, tuple):
        raise TypeError(f"captures must be a tuple of tensors and numbers, got {type(captures).__name__}")
    for i, c in enumerate(captures):
        if not isinstance(c, (torch.Tensor, int, float, bool)):
            raise TypeError(f"captures[{i}] must be a tensor or a number, got {type(c).__name__}")
    if N < 1 or M < 1:
        raise ValueError(f"N and M must be positive, got {N} and {M}")
    return captures


def create_block_mask(mask_mod, B: Optional[int], H: Optional[int], N: int, M: int, captures: tuple = (),
                      device=None, block_m: Optional[int] = None, block_n: Optional[int] = None):  # fmt: skip
    """Evaluate ``mask_mod`` over every block of the (N, M) grid for B sequences and H query heads (None: the mask
    does not depend on them) and list each query block's partial and full key blocks (see the module docstring)."""
    _check_mask_args(mask_mod, captures, N, M)
    tensors = {f"captures[{i}]": c for i, c in enumerate(captures) if isinstance(c, torch.Tensor)}
    device = torch.device(device or next((t.device for t in tensors.values()), "cpu"))
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the block mask is asked for on {device}")
    bm, bn = default_blocks(device)
    bm, bn = block_m or bm, block_n or bn
    b_mask, h_mask = B or 1, H or 1
    n_qb, n_kb = triton.cdiv(N, bm), triton.cdiv(M, bn)
    states = torch.empty((b_mask, h_mask, n_qb, n_kb), device=device, dtype=torch.int8)
    if not use_triton(states, op="create_block_mask"):
        raise RuntimeError("create_block_mask runs the mask function as a Triton kernel: on a CPU, set "
                           "TRITON_INTERPRET=1 before importing triton")  # fmt: skip
    _block_states_kernel[(n_qb, n_kb, b_mask * h_mask)](states, N, M, h_mask, captures, MASK_MOD=mask_mod,
                                                          BLOCK_M=bm, BLOCK_N=bn)  # fmt: skip
    lists = []
    for state in (PARTIAL, FULL):
        hit = states == state
        order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True)  # the hits first, in ascending order
        lists += [hit.sum(dim=-1, dtype=torch.int32), order.to(torch.int32).contiguous()]
    return BlockMask(*lists, N=N, M=M, block_m=bm, block_n=bn, mask_mod=mask_mod, captures=captures)


def dense_mask(block_mask: BlockMask) -> torch.Tensor:
    """The mask element by element, (B', H', N, M) bool: what the block mask was made from."""
    b_mask, h_mask = block_mask.part_num.shape[:2]
    N, M, bm, bn = block_mask.N, block_mask.M, block_mask.block_m, block_mask.block_n
    out = torch.empty((b_mask, h_mask, N, M), device=block_mask.part_num.device, dtype=torch.int8)
    _dense_mask_kernel[(triton.cdiv(N, bm), triton.cdiv(M, bn), b_mask * h_mask)](
        out, N, M, h_mask, block_mask.captures, MASK_MOD=block_mask.mask_mod, BLOCK_M=bm, BLOCK_N=bn
    )
    return out.bool()


# --------------------------------------------------------------------------------------------------
# Launcher and autograd
# --------------------------------------------------------------------------------------------------
def _forward(q, k, v, block_mask: BlockMask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    B, Hq, N, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    out = torch.empty((B, Hq, N, Dv), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, Hq, N), device=q.device, dtype=torch.float32)
    b_mask, h_mask, n_qb = block_mask.part_num.shape
    smb = h_mask * n_qb if b_mask > 1 else 0  # rows of the block mask a sequence / a head moves
    smh = n_qb if h_mask > 1 else 0
    dqk, dv = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(Dv))
    bm, bn = block_mask.block_m, block_mask.block_n
    warps, stages = (4, 1) if is_interpreting() else ((8, 3) if bm >= 128 else (4, 2))
    _flex_fwd_kernel[(triton.cdiv(N, bm), B * Hq)](
        q, k, v, out, lse, block_mask.part_num, block_mask.part_idx, block_mask.full_num, block_mask.full_idx,
        smb, smh, block_mask.part_idx.shape[-1], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *out.stride()[:3], *lse.stride()[:2], Hq, N, k.shape[2], Hq // Hkv, scale * 1.4426950408889634,
        block_mask.captures, MASK_MOD=block_mask.mask_mod, D_QK=D, D_V=Dv, BLOCK_DQK=dqk, BLOCK_DV=dv,
        DOT_FP32=q.device.type == "cpu", BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, lse


class _FlexAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_mask, scale):
        out, lse = _forward(q, k, v, block_mask, scale)
        ctx.save_for_backward(q, k, v)
        ctx.block_mask, ctx.scale = block_mask, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # Not fused yet: the float32 definition with the mask materialized, differentiated by autograd
        q, k, v = ctx.saved_tensors
        mask = dense_mask(ctx.block_mask)
        with torch.enable_grad():
            needs = ctx.needs_input_grad[:3]
            leaves = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), needs, strict=True)]
            out, lse = flex_attention_ref(*leaves, mask, ctx.scale, return_lse=True)
            grads = torch.autograd.grad(
                (out, lse), [t for t in leaves if t.requires_grad],
                (dout, torch.where(torch.isfinite(lse), dlse, 0.0) if dlse is not None else None),
                allow_unused=True,
            )  # fmt: skip
        it = iter(grads)
        return (*(next(it) if need else None for need in ctx.needs_input_grad[:3]), None, None)


# --------------------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------------------
def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                   scale: Optional[float] = None, return_lse: bool = False):  # fmt: skip
    """Attention of q (B, Hq, N, D) over k (B, Hkv, M, D) and v (B, Hkv, M, Dv) under ``block_mask`` (from
    :func:`create_block_mask` for these N and M, and for this B and Hq unless made for None); float16 or
    bfloat16 (float32 on the CPU, interpreted). Returns out (B, Hq, N, Dv), and the natural-log log-sum-exp
    (B, Hq, N) float32 with ``return_lse``. Differentiable in q, k, v (the backward recomputes: module docstring)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, ndim=4)
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v, part_num=block_mask.part_num)
    B, Hq, N, D = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[-1] != D or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not make (B, Hq, N, D) "
                         f"x (B, Hkv, M, D) x (B, Hkv, M, Dv) with Hq a multiple of Hkv")  # fmt: skip
    if max(D, v.shape[-1]) > 256:
        raise ValueError(f"head dims up to 256, got {D} and {v.shape[-1]}")
    b_mask, h_mask = block_mask.part_num.shape[:2]
    if (block_mask.N, block_mask.M) != (N, M) or b_mask not in (1, B) or h_mask not in (1, Hq):
        raise ValueError(f"the block mask was made for {block_mask.shape} (sequences, heads, N, M); these inputs "
                         f"are {B} sequences of {Hq} heads, N {N}, M {M}")  # fmt: skip
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not use_triton(q, op="flex_attention"):
        return flex_attention_ref(q, k, v, dense_mask(block_mask), scale, return_lse)
    out, lse = _FlexAttention.apply(q, k, v, block_mask, scale)
    return (out, lse) if return_lse else out


def compile_attention_kernel(pattern: str, **params) -> Callable:
    """A callable ``attend(q, k, v, scale=None)`` for a named pattern of ``PATTERNS`` with its parameters
    (``window_size`` for sliding_window, ``document_ids`` (B, N) for document, ``prefix_length`` for prefix_lm);
    it builds the block mask for each new (N, M, device) on first use and keeps it."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {sorted(PATTERNS)}, got {pattern!r}")
    made: dict[tuple, BlockMask] = {}

    def attend(q, k, v, scale=None, return_lse=False):
        key = (q.shape[2], k.shape[2], q.device)
        if key not in made:
            mask_mod, captures = PATTERNS[pattern](q.shape[2], k.shape[2], **params)
            per_sequence = pattern == "document"
            made[key] = create_block_mask(mask_mod, q.shape[0] if per_sequence else None, None, *key[:2],
                                          captures=captures, device=q.device)  # fmt: skip
        return flex_attention(q, k, v, made[key], scale, return_lse)

    attend.pattern, attend.params = pattern, params
    return attend
