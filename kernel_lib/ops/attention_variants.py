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
3. The backward runs the flash backward's two kernels over the same lists: dQ a program per query block over its
   key blocks, dK/dV a program per key block over the query blocks that see it (the lists transposed), each
   applying ``mask_mod`` on partial blocks only; delta = rowsum(dout * out) is two PyTorch lines.

Score modifiers (``score_mod``, a :class:`ScoreMod`): ``fn(score, b, h, q_idx, kv_idx, captures) -> (score',
d score' / d score)`` changes each scaled score the mask lets through before the softmax; the forward uses the
first value, the backward multiplies dS by the second (Triton has no autograd: the derivative is written with the
function). ``softcap(cap)`` (Gemma 2's ``cap * tanh(score / cap)``) and ``alibi(slopes)`` (a linear bias per head)
are made for you, and ``relative_bias(table)``, a learned bias by relative position whose table gets its gradient:
a ScoreMod's ``grad_fn`` adds the loss's gradient of each modified score into its captured tensors' buffers (the
dQ kernel visits every pair once; atomics, as FlexAttention's captured-buffer gradients; tested under the
interpreter only, not yet on a GPU). Attention sinks (``sinks``, gpt-oss): a learned logit per query head that
joins every query's softmax as a key with a zero value; the forward folds it into the running sum at the end, its
gradient -sum_i exp(sink - lse_i) delta_i is two PyTorch lines (tested under the interpreter only).

Named patterns (``PATTERNS``: causal, sliding_window, document, prefix_lm) are mask functions with their captures
made by ``compile_attention_kernel(pattern, **params)``, which returns a callable ``attend(q, k, v)`` that builds
its block mask on first use for each shape. Tested against the float64 definition under Triton's interpreter and
on an H200. Measured there (2026-11-29, torch 2.11, triton 3.6, bf16, D 128, 16k tokens a batch): 0.86-0.92x
compiled FlexAttention forward, 0.73-0.96x forward + backward (the sparse masks lose most; benchmarks/NOTES.md).
Needs Triton 3.3 or newer (tuples as kernel arguments).
Under ``torch.compile`` the call is a graph break (the mask function cannot be a custom op's argument yet).
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
from .attention_kernels import (
    _dkdv_block,
    _dkdv_scores,
    _dq_scores,
    _fwd_scores,
    _head_base,
    _load_kv,
    _query_block,
    _query_rows,
    _store_tile,
)

__all__ = [
    "BlockMask",
    "create_block_mask",
    "dense_mask",
    "flex_attention",
    "flex_attention_ref",
    "compile_attention_kernel",
    "PATTERNS",
    "ScoreMod",
    "softcap",
    "alibi",
    "alibi_slopes",
    "relative_bias",
    "SCORED_PATTERNS",
]

EMPTY, PARTIAL, FULL = 0, 1, 2  # a block's state: no query sees a key of it; some do; every query sees every key


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------
def flex_attention_ref(q, k, v, mask: torch.Tensor, scale: Optional[float] = None, return_lse: bool = False,
                       score_mod: Optional[ScoreMod] = None, sinks: Optional[torch.Tensor] = None):  # fmt: skip
    """The definition with an explicit boolean ``mask`` broadcastable to (B, Hq, N, M), an optional score modifier
    (its ``reference``) and optional sinks (Hq,): a logit per head in every query's softmax with a zero value. In
    float32 (float64 for float64 input), out in q's dtype, lse in float32 (float64); a query that sees no key gives
    0 and lse -inf (lse = the sink with sinks)."""
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kf, vf = (t.to(compute).repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.to(compute) @ kf.transpose(-1, -2)) * scale
    if score_mod is not None:
        B, H, N, M = scores.shape
        b, h, i, j = (torch.arange(n, device=q.device).view(*([1] * d), n, *([1] * (3 - d)))
                      for d, n in enumerate((B, H, N, M)))  # fmt: skip
        scores = score_mod.reference(scores, b, h, i, j)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(compute)[None, :, None])
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
# Score modifiers: a function of the score with its derivative, and what it captures
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class ScoreMod:
    """A score modifier: ``fn(score, b, h, q_idx, kv_idx, captures) -> (new score, d new / d score)``, a
    ``@triton.jit`` function of tiles (the score is q.k times the scale, float32); ``captures`` a tuple of tensors
    and numbers as for a mask function; ``reference(scores, b, h, q_idx, kv_idx)`` the same in PyTorch on
    broadcast index tensors (the float64 check and the CPU without Triton; None: no fallback). The derivative
    is the caller's to write: Triton has no autograd.

    Captured tensors that require grad get one when ``grad_fn(ds, b, h, q_idx, kv_idx, captures, grads)`` is
    given: ``ds`` is the loss's gradient with respect to each modified score (a tile, zero where masked), ``grads``
    the tuple of ``captures`` with a float32 gradient buffer in place of each tensor that requires grad (0 for
    the others); ``grad_fn`` adds its share into them (``tl.atomic_add``: tiles of many programs meet there).
    Without ``grad_fn``, a captured tensor that requires grad is refused."""

    fn: Callable
    captures: tuple = ()
    reference: Optional[Callable] = None
    grad_fn: Optional[Callable] = None

    @property
    def learned(self) -> tuple[int, ...]:
        """The positions in ``captures`` of the tensors that require grad."""
        return tuple(i for i, c in enumerate(self.captures) if isinstance(c, torch.Tensor) and c.requires_grad)


@triton.jit
def softcap_score(score, b, h, q_idx, kv_idx, captures):
    """cap * tanh(score / cap) and its slope 1 - tanh^2 (tanh from a sigmoid: Triton's interpreter has no tanh).
    captures: (cap,)."""
    t = 2.0 * tl.sigmoid(2.0 * score / captures[0]) - 1.0
    return captures[0] * t, 1.0 - t * t


@triton.jit
def alibi_score(score, b, h, q_idx, kv_idx, captures):
    """score + slope[h] * (kv_idx - q_idx), slope 1. captures: (slopes (Hq,) float32 contiguous,)."""
    return score + tl.load(captures[0] + h) * (kv_idx - q_idx).to(tl.float32), 1.0


@triton.jit
def relative_bias_score(score, b, h, q_idx, kv_idx, captures):
    """score + table[h, clamp(kv_idx - q_idx, -R, R) + R], slope 1. captures: (table (Hq, 2R + 1), R)."""
    rel = tl.minimum(tl.maximum(kv_idx - q_idx, -captures[1]), captures[1]) + captures[1]
    return score + tl.load(captures[0] + h * (2 * captures[1] + 1) + rel).to(tl.float32), 1.0


@triton.jit
def relative_bias_grad(ds, b, h, q_idx, kv_idx, captures, grads):
    """d loss / d table[h, r] = the sum of ds over the pairs at relative position r: one atomic add a pair."""
    rel = tl.minimum(tl.maximum(kv_idx - q_idx, -captures[1]), captures[1]) + captures[1]
    tl.atomic_add(grads[0] + h * (2 * captures[1] + 1) + rel, ds)


def relative_bias(table: torch.Tensor) -> ScoreMod:
    """A learned bias by relative position (T5's idea without the buckets): ``table`` (Hq, 2R + 1), contiguous,
    entry R + d for a key d positions after the query, distances past R clamped. The table is captured as it is
    (an optimizer's in-place updates are seen) and gets its gradient when it requires grad."""
    check_tensor(table, "table", ndim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64))
    if not table.is_contiguous() or table.shape[1] % 2 != 1:
        raise ValueError(f"table must be contiguous (Hq, 2R + 1), got shape {tuple(table.shape)}")
    R = table.shape[1] // 2

    def reference(s, b, h, i, j):
        return s + table.to(s.dtype)[h, (j - i).clamp(-R, R) + R]

    return ScoreMod(relative_bias_score, (table, R), reference, relative_bias_grad)


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping (Gemma 2: ``cap * tanh(score / cap)`` on the scaled scores, cap 50)."""
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")
    cap = float(cap)
    return ScoreMod(softcap_score, (cap,), lambda s, b, h, i, j: cap * torch.tanh(s / cap))


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """ALiBi: a linear bias slope[h] * (kv_idx - q_idx) per query head (Press et al.; slopes (Hq,), e.g.
    2^(-8 (h + 1) / Hq))."""
    check_tensor(slopes, "slopes", ndim=1)
    slopes = slopes.float().contiguous()
    return ScoreMod(alibi_score, (slopes,), lambda s, b, h, i, j: s + slopes.to(s)[h] * (j - i).to(s))


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
    tl.store(states_ptr + (bh.to(tl.int64) * n_qb + qb) * n_kb + kb, state.to(tl.int8))


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
    offsets = bh.to(tl.int64) * N * M + rows[:, None].to(tl.int64) * M + cols[None, :]  # N * M may pass 2^31
    tl.store(out_ptr + offsets, seen.to(tl.int8), mask=inside)


@triton.jit
def _mod_visible(b, h, offs_m, offs_n, N, M, captures, MASK_MOD: tl.constexpr):
    """(BLOCK_M, BLOCK_N): the mask function on a tile, keys past M hidden. It sees indices clamped into [0, N) and
    [0, M); rows past N are never stored (forward, dQ) or read as 0 (dK/dV)."""
    q_idx, kv_idx = tl.minimum(offs_m, N - 1), tl.minimum(offs_n, M - 1)
    return MASK_MOD(b, h, q_idx[:, None], kv_idx[None, :], captures) & (offs_n < M)[None, :]


@triton.jit
def _mod_visible_t(b, h, offs_m, offs_n, N, M, captures, MASK_MOD: tl.constexpr):
    """(BLOCK_N, BLOCK_M): the same with keys along the rows (the dK/dV kernel's orientation)."""
    q_idx, kv_idx = tl.minimum(offs_m, N - 1), tl.minimum(offs_n, M - 1)
    return MASK_MOD(b, h, q_idx[None, :], kv_idx[:, None], captures) & (offs_n < M)[:, None]


@triton.jit
def _key_block(idx_ptr, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn, b, h, N, M, captures,
               MASK: tl.constexpr, MASK_MOD: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr,
               D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr):  # fmt: skip
    """The key block whose index idx_ptr holds: its k and v tiles, and which keys each query sees (all in range
    ones on a full block, the mask function's on a partial one)."""
    offs_n = tl.load(idx_ptr) * BLOCK_N + tl.arange(0, BLOCK_N)
    k, v = _load_kv(k_base, v_base, offs_n, offs_dk, offs_dv, skn, svn, M, D_QK, D_V, BLOCK_DQK, BLOCK_DV, DOT_FP32)
    visible = offs_n[None, :] < M
    if MASK:
        visible = _mod_visible(b, h, offs_m, offs_n, N, M, captures, MASK_MOD)
    return k, v, visible, offs_n


@triton.jit
def _modded(raw, b, h, q_idx, kv_idx, N, M, scale, score_captures, SCORE_MOD: tl.constexpr):
    """A tile's raw products q.k -> its base-2 scores after the score modifier, and the modifier's derivative;
    q_idx and kv_idx broadcast to the tile, clamped into range as the mask function sees them."""
    s, ds = SCORE_MOD(raw * scale, b, h, tl.minimum(q_idx, N - 1), tl.minimum(kv_idx, M - 1), score_captures)
    return s * 1.4426950408889634, ds


@triton.jit
def _scored_block(
    q, idx_ptr, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn, b, h, N, M, scale, captures, score_captures,
    MASK: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, HAS_MOD: tl.constexpr,
    DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """The key block at idx_ptr (``_key_block``) and q's base-2 scores against it, modified when HAS_MOD, with the
    modifier's derivative (1 without one): what the forward and dQ steps share."""
    k, v, visible, offs_n = _key_block(idx_ptr, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn, b, h, N, M,
                                       captures, MASK, MASK_MOD, DOT_FP32, BLOCK_N, D_QK, D_V, BLOCK_DQK,
                                       BLOCK_DV)  # fmt: skip
    if HAS_MOD:
        s, dmod = _modded(tl.dot(q, tl.trans(k)), b, h, offs_m[:, None], offs_n[None, :], N, M, scale,
                          score_captures, SCORE_MOD)  # fmt: skip
    else:
        s, dmod = tl.dot(q, tl.trans(k)) * (scale * 1.4426950408889634), 1.0
    return k, v, visible, s, dmod, offs_n


@triton.jit
def _flex_fwd_steps(
    acc, l_i, m_i, q,  # running output, sum and max of this program's queries; its q tile
    k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
    idx_ptr, count,  # the key blocks to visit: count indices from idx_ptr
    b, h, N, M, scale, captures, score_captures,
    MASK: tl.constexpr,  # partial blocks: apply the mask function (and the key range)
    MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, HAS_MOD: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    for i in range(0, count):
        k, v, visible, s, _, _ = _scored_block(q, idx_ptr + i, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn, b,
                                            h, N, M, scale, captures, score_captures, MASK, MASK_MOD, SCORE_MOD,
                                            HAS_MOD, DOT_FP32, BLOCK_N, D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
        acc, l_i, m_i = _fwd_scores(acc, l_i, m_i, s, v, visible, MASK)
    return acc, l_i, m_i


@triton.jit
def _flex_dq_steps(
    dq, q, do, lse2, delta,  # (BLOCK_M, BLOCK_DQK) float32 accumulator; this block's q, dout, lse2, delta
    k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
    idx_ptr, count,  # the key blocks to visit
    b, h, N, M, scale, captures, score_captures, grad_captures,
    MASK: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, HAS_MOD: tl.constexpr,
    GRAD_FN: tl.constexpr, HAS_GRAD: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    for i in range(0, count):
        k, v, visible, s, dmod, offs_n = _scored_block(q, idx_ptr + i, k_base, v_base, offs_m, offs_dk, offs_dv,
                                                       skn, svn, b, h, N, M, scale, captures, score_captures, MASK,
                                                       MASK_MOD, SCORE_MOD, HAS_MOD, DOT_FP32, BLOCK_N, D_QK, D_V,
                                                       BLOCK_DQK, BLOCK_DV)  # fmt: skip
        dq, ds = _dq_scores(dq, s, dmod, k, v, do, lse2, delta, visible, MASK, HAS_MOD)
        if HAS_GRAD:  # the captured tensors' share: each (query, key) pair is visited here once
            ds = tl.where((offs_m < N)[:, None] & (offs_n < M)[None, :], ds, 0.0)
            GRAD_FN(ds, b, h, tl.minimum(offs_m, N - 1)[:, None], tl.minimum(offs_n, M - 1)[None, :],
                    score_captures, grad_captures)  # fmt: skip
    return dq


@triton.jit
def _flex_dkdv_steps(
    dk, dv, k, v,  # (BLOCK_N, ...) float32 accumulators; this program's key and value tiles
    q_base, do_base, lse2_base, delta_base, offs_n, offs_dk, offs_dv, sqn, son,
    idx_ptr, count,  # the query blocks to visit
    b, h, N, M, scale, captures, score_captures,
    MASK: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, HAS_MOD: tl.constexpr,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
    STEP_M: tl.constexpr,  # queries a step: a divisor of BLOCK_M (fewer live registers than a whole block)
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    STEPS: tl.constexpr = BLOCK_M // STEP_M
    for i in range(0, count * STEPS):  # one loop over every step, not a loop per block: one pipeline
        offs_m = tl.load(idx_ptr + i // STEPS) * BLOCK_M + (i % STEPS) * STEP_M + tl.arange(0, STEP_M)
        q, do, lse2, delta = _query_rows(q_base, do_base, lse2_base, delta_base, offs_m, offs_dk, offs_dv, sqn, son,
                                         N, D_QK, D_V, BLOCK_DQK, BLOCK_DV, DOT_FP32)  # fmt: skip
        visible_t = offs_n[:, None] < M
        if MASK:
            visible_t = _mod_visible_t(b, h, offs_m, offs_n, N, M, captures, MASK_MOD)
        if HAS_MOD:  # rows past N read as 0, but a modified score of 0 need not be: mask them too
            s_t, dmod_t = _modded(tl.dot(k, tl.trans(q)), b, h, offs_m[None, :], offs_n[:, None], N, M, scale,
                                  score_captures, SCORE_MOD)  # fmt: skip
            dk, dv = _dkdv_scores(dk, dv, s_t, dmod_t, v, q, do, lse2, delta, visible_t & (offs_m < N)[None, :],
                                  True, True)  # fmt: skip
        else:
            dk, dv = _dkdv_block(dk, dv, k, v, q, do, lse2, delta, scale * 1.4426950408889634, visible_t, MASK)
    return dk, dv


@triton.jit
def _flex_fwd_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, Hq, N, D_QK), (B, Hkv, M, D_QK), (B, Hkv, M, D_V); unit stride along the head dim
    out_ptr,  # (B, Hq, N, D_V), q's dtype
    lse_ptr,  # (B, Hq, N) float32, natural log, unit stride along positions
    sinks_ptr,  # (Hq,) float32: a logit per head that every query sees, with a zero value (when HAS_SINK)
    part_num_ptr, part_idx_ptr,  # the block mask: per (b', h', query block) the count and indices of partial blocks
    full_num_ptr, full_idx_ptr,  # and of full blocks; indices rows of NK
    smb, smh,  # the block mask's strides over its (B', H') rows, in query blocks (0 where it broadcasts)
    NK,  # key blocks (an index row's length)
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,  # strides of q, k, v: batch, head, position
    sob, soh, son, slb, slh,  # strides of out and lse
    Hq, N, M, GROUP,  # query heads, lengths, query heads per key/value head
    scale,  # of the scores (natural units)
    captures,  # the mask function's tuple
    score_captures,  # the score modifier's tuple
    MASK_MOD: tl.constexpr,
    SCORE_MOD: tl.constexpr, HAS_MOD: tl.constexpr,  # the score modifier, and whether there is one
    HAS_SINK: tl.constexpr,
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
    for MASK in tl.static_range(2):  # the full key blocks, then the partial ones
        num_ptr = full_num_ptr if MASK == 0 else part_num_ptr
        idx_ptr = full_idx_ptr if MASK == 0 else part_idx_ptr
        acc, l_i, m_i = _flex_fwd_steps(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
                                        idx_ptr + row.to(tl.int64) * NK, tl.load(num_ptr + row), b, h, N, M, scale,
                                        captures, score_captures, MASK == 1, MASK_MOD, SCORE_MOD, HAS_MOD, DOT_FP32,
                                        BLOCK_N, D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
    if HAS_SINK:  # the sink joins the softmax's sum as one more key, its value 0: out shrinks, lse grows
        sink2 = tl.load(sinks_ptr + h) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink2)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink2 - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    _store_tile(_head_base(out_ptr, b, h, q0, sob, soh, son, False), out, offs_m, son, N, offs_dv, D_V, BLOCK_DV)
    tl.store(_head_base(lse_ptr, b, h, q0, slb, slh, 1, False) + offs_m, lse, mask=offs_m < N)


@triton.jit
def _flex_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # as in the forward; dout in out's layout
    lse2_ptr, delta_ptr,  # (B, Hq, N) float32, contiguous: base-2 log-sum-exp (+inf for no key), rowsum(dout*out)
    dq_ptr,  # output (B, Hq, N, D_QK), q's strides
    part_num_ptr, part_idx_ptr, full_num_ptr, full_idx_ptr, smb, smh, NK,  # the block mask, as in the forward
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,  # strides of q (and dq), k, v, dout
    Hq, N, M, GROUP, scale, captures, score_captures,
    grad_captures,  # score_captures with a float32 gradient buffer for each learned tensor (HAS_GRAD)
    MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, HAS_MOD: tl.constexpr,
    GRAD_FN: tl.constexpr, HAS_GRAD: tl.constexpr,  # the modifier's gradient function, and whether to call it
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    b, h = tl.program_id(1) // Hq, tl.program_id(1) % Hq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dk, offs_dv = tl.arange(0, BLOCK_DQK), tl.arange(0, BLOCK_DV)
    stats = (b * Hq + h).to(tl.int64) * N
    q, do, lse2, delta = _query_rows(_head_base(q_ptr, b, h, 0, sqb, sqh, sqn, False),
                                     _head_base(do_ptr, b, h, 0, sob, soh, son, False), lse2_ptr + stats,
                                     delta_ptr + stats, offs_m, offs_dk, offs_dv, sqn, son, N, D_QK, D_V, BLOCK_DQK,
                                     BLOCK_DV, DOT_FP32)  # fmt: skip
    k_base = _head_base(k_ptr, b, h // GROUP, 0, skb, skh, skn, False)
    v_base = _head_base(v_ptr, b, h // GROUP, 0, svb, svh, svn, False)
    row = b * smb + h * smh + start_m // BLOCK_M
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    for MASK in tl.static_range(2):  # the full key blocks, then the partial ones
        num_ptr = full_num_ptr if MASK == 0 else part_num_ptr
        idx_ptr = full_idx_ptr if MASK == 0 else part_idx_ptr
        dq = _flex_dq_steps(dq, q, do, lse2, delta, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
                            idx_ptr + row.to(tl.int64) * NK, tl.load(num_ptr + row), b, h, N, M, scale, captures,
                            score_captures, grad_captures, MASK == 1, MASK_MOD, SCORE_MOD, HAS_MOD, GRAD_FN,
                            HAS_GRAD, DOT_FP32, BLOCK_N, D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
    _store_tile(_head_base(dq_ptr, b, h, 0, sqb, sqh, sqn, False), dq * scale, offs_m, sqn, N, offs_dk, D_QK,
                BLOCK_DQK)  # fmt: skip


@triton.jit
def _flex_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse2_ptr, delta_ptr,  # as in _flex_dq_kernel
    dk_ptr, dv_ptr,  # outputs, k's and v's strides
    part_num_ptr, part_idx_ptr, full_num_ptr, full_idx_ptr,  # the block mask transposed: per (b', h', key block)
    smb, smh, NQ,  # its strides over (B', H') in key blocks, and an index row's length
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,  # strides of q, k (and dk), v (and dv), dout
    Hq, Hkv, N, M, GROUP, scale, captures, score_captures,
    MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, HAS_MOD: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STEP_M: tl.constexpr,  # queries a step (see _flex_dkdv_steps)
):  # fmt: skip
    start_n = tl.program_id(0) * BLOCK_N
    b, hk = tl.program_id(1) // Hkv, tl.program_id(1) % Hkv
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dk, offs_dv = tl.arange(0, BLOCK_DQK), tl.arange(0, BLOCK_DV)
    k_base = _head_base(k_ptr, b, hk, 0, skb, skh, skn, False)
    v_base = _head_base(v_ptr, b, hk, 0, svb, svh, svn, False)
    k, v = _load_kv(k_base, v_base, offs_n, offs_dk, offs_dv, skn, svn, M, D_QK, D_V, BLOCK_DQK, BLOCK_DV, DOT_FP32)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for g in range(0, GROUP):  # every query head reading this key/value head
        h = hk * GROUP + g
        q_base = _head_base(q_ptr, b, h, 0, sqb, sqh, sqn, False)
        do_base = _head_base(do_ptr, b, h, 0, sob, soh, son, False)
        stats = (b * Hq + h).to(tl.int64) * N
        row = b * smb + h * smh + start_n // BLOCK_N
        for MASK in tl.static_range(2):  # the full query blocks, then the partial ones
            num_ptr = full_num_ptr if MASK == 0 else part_num_ptr
            idx_ptr = full_idx_ptr if MASK == 0 else part_idx_ptr
            dk, dv = _flex_dkdv_steps(dk, dv, k, v, q_base, do_base, lse2_ptr + stats, delta_ptr + stats, offs_n,
                                      offs_dk, offs_dv, sqn, son, idx_ptr + row.to(tl.int64) * NQ,
                                      tl.load(num_ptr + row), b, h, N, M, scale, captures, score_captures,
                                      MASK == 1, MASK_MOD, SCORE_MOD, HAS_MOD, DOT_FP32, BLOCK_M, STEP_M, D_QK, D_V,
                                      BLOCK_DQK, BLOCK_DV)  # fmt: skip
    _store_tile(_head_base(dk_ptr, b, hk, 0, skb, skh, skn, False), dk * scale, offs_n, skn, M, offs_dk, D_QK,
                BLOCK_DQK)  # fmt: skip
    _store_tile(_head_base(dv_ptr, b, hk, 0, svb, svh, svn, False), dv, offs_n, svn, M, offs_dv, D_V, BLOCK_DV)


# --------------------------------------------------------------------------------------------------
# The block mask
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)  # tensors inside: identity, not elementwise, equality
class BlockMask:
    """Which key blocks each query block visits, for one mask function at one (N, M) and tile shape.

    ``part_num`` / ``full_num``: (B', H', NQ) int32, the partial and full key blocks of each query block;
    ``part_idx`` / ``full_idx``: (B', H', NQ, NK) int32, their indices first (ascending), the rest unused; the
    ``q_*`` lists are the same by key block (the dK/dV kernel's). B' is 1 when the mask does not depend on the
    sequence (it then serves any batch), H' likewise for heads."""

    part_num: torch.Tensor
    part_idx: torch.Tensor
    full_num: torch.Tensor
    full_idx: torch.Tensor
    q_part_num: torch.Tensor  # the same transposed, per key block: (B', H', NK) and (B', H', NK, NQ)
    q_part_idx: torch.Tensor
    q_full_num: torch.Tensor
    q_full_idx: torch.Tensor
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


@torch.compiler.disable  # runs the mask function as a Triton kernel: a graph break under torch.compile
def create_block_mask(mask_mod, B: Optional[int], H: Optional[int], N: int, M: int, captures: tuple = (),
                      device=None, block_m: Optional[int] = None, block_n: Optional[int] = None):  # fmt: skip
    """Evaluate ``mask_mod`` over every block of the (N, M) grid for B sequences and H query heads (None: the mask
    does not depend on them) and list each query block's partial and full key blocks (see the module docstring)."""
    _check_mask_args(mask_mod, captures, N, M)
    tensors = {f"captures[{i}]": c for i, c in enumerate(captures) if isinstance(c, torch.Tensor)}
    device = torch.device(device or next((t.device for t in tensors.values()), "cpu"))
    if device.type == "cuda" and device.index is None:  # "cuda" means the current GPU, as tensors report it
        device = torch.device("cuda", torch.cuda.current_device())
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
    for grid in (states, states.transpose(2, 3)):  # by query block, then by key block
        for state in (PARTIAL, FULL):
            hit = grid == state
            order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True)  # the hits first, in ascending order
            lists += [hit.sum(dim=-1, dtype=torch.int32).contiguous(), order.to(torch.int32).contiguous()]
    return BlockMask(*lists, N=N, M=M, block_m=bm, block_n=bn, mask_mod=mask_mod, captures=captures)


@torch.compiler.disable
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
def _launch_args(q, k, v, block_mask: BlockMask, score_mod: Optional[ScoreMod]) -> tuple[dict, tuple]:
    """The constexprs and launch options every kernel of a call shares, and the block mask's row strides."""
    D, Dv = q.shape[-1], v.shape[-1]
    bm = block_mask.block_m
    warps, stages = (4, 1) if is_interpreting() else ((8, 3) if bm >= 128 else (4, 2))
    b_mask, h_mask = block_mask.part_num.shape[:2]
    consts = dict(MASK_MOD=block_mask.mask_mod, SCORE_MOD=score_mod.fn if score_mod else block_mask.mask_mod,
                  HAS_MOD=score_mod is not None, D_QK=D, D_V=Dv, BLOCK_DQK=max(16, triton.next_power_of_2(D)),
                  BLOCK_DV=max(16, triton.next_power_of_2(Dv)), DOT_FP32=q.device.type == "cpu", BLOCK_M=bm,
                  BLOCK_N=block_mask.block_n, num_warps=warps, num_stages=stages)  # fmt: skip
    return consts, (b_mask > 1, h_mask > 1)


def dkdv_launch(block_m: int, head_width: int) -> dict:
    """The dK/dV kernel's steps and launch: it holds a key block's k, v, dk and dv for the whole program and
    streams a 128-query block in two steps of 64, one warpgroup, two stages: on the H200 (D 128, bf16, NOTES
    2026-11-29) 375 TFLOP/s forward + backward at causal N 16,384 against 241 for whole blocks over eight warps
    and three stages (it spilled), 295 with three stages, 346 with steps of 32. Interpreted: two steps of half a
    block, so the CPU tests run the stepping too."""
    if is_interpreting():
        return dict(STEP_M=max(16, block_m // 2), num_warps=4, num_stages=1)
    return dict(STEP_M=min(block_m, 64), num_warps=4 if head_width <= 256 else 8, num_stages=2)


def _row_strides(lists: torch.Tensor, varies: tuple) -> tuple[int, int]:
    """A (B', H', blocks) list's strides over sequences and heads, 0 where the mask broadcasts."""
    _, h_mask, blocks = lists.shape
    return (h_mask * blocks if varies[0] else 0), (blocks if varies[1] else 0)


def _forward(q, k, v, block_mask: BlockMask, scale: float, score_mod=None, sinks=None):
    B, Hq, N, _ = q.shape
    out = torch.empty((B, Hq, N, v.shape[-1]), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, Hq, N), device=q.device, dtype=torch.float32)
    consts, varies = _launch_args(q, k, v, block_mask, score_mod)
    bmask = block_mask
    _flex_fwd_kernel[(triton.cdiv(N, bmask.block_m), B * Hq)](
        q, k, v, out, lse, lse if sinks is None else sinks, bmask.part_num, bmask.part_idx, bmask.full_num,
        bmask.full_idx,
        *_row_strides(bmask.part_num, varies), bmask.part_idx.shape[-1], *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *out.stride()[:3], *lse.stride()[:2], Hq, N, k.shape[2], Hq // k.shape[1],
        scale, bmask.captures, score_mod.captures if score_mod else (), HAS_SINK=sinks is not None, **consts,
    )  # fmt: skip
    return out, lse


def _backward(dout, dlse, q, k, v, out, lse, block_mask: BlockMask, scale: float, score_mod=None, learned=()):
    """dq, dk, dv, delta (the rowsum of dout * out less dlse) and {position: float32 gradient} for the captured
    tensors of score_mod at the positions ``learned``."""
    B, Hq, N, _ = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    # the prep is two memory-bound lines: rowsum(dout * out) - dlse, and lse in base 2 (+inf: no key, so P = 0)
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - torch.where(torch.isfinite(lse), dlse, 0.0)
    lse2 = torch.where(torch.isfinite(lse), lse * 1.4426950408889634, float("inf")).contiguous()
    delta = delta.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    consts, varies = _launch_args(q, k, v, block_mask, score_mod)
    bmask = block_mask
    mod_captures = score_mod.captures if score_mod else ()
    # a float32 buffer for the gradient of each captured tensor that requires grad, in its place in the tuple
    grads = {i: torch.zeros(mod_captures[i].shape, device=q.device, dtype=torch.float32) for i in learned}
    grad_captures = tuple(grads.get(i, 0) for i in range(len(mod_captures)))
    grad_fn = score_mod.grad_fn if grads else block_mask.mask_mod  # a placeholder, never called, without grads
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    _flex_dq_kernel[(triton.cdiv(N, bmask.block_m), B * Hq)](
        q, k, v, dout, lse2, delta, dq, bmask.part_num, bmask.part_idx, bmask.full_num, bmask.full_idx,
        *_row_strides(bmask.part_num, varies), bmask.part_idx.shape[-1], *strides, Hq, N, M, Hq // Hkv, scale,
        bmask.captures, mod_captures, grad_captures, GRAD_FN=grad_fn, HAS_GRAD=bool(grads), **consts,
    )  # fmt: skip
    consts.update(dkdv_launch(bmask.block_m, consts["BLOCK_DQK"] + consts["BLOCK_DV"]))
    _flex_dkdv_kernel[(triton.cdiv(M, bmask.block_n), B * Hkv)](
        q, k, v, dout, lse2, delta, dk, dv, bmask.q_part_num, bmask.q_part_idx, bmask.q_full_num,
        bmask.q_full_idx, *_row_strides(bmask.q_part_num, varies), bmask.q_part_idx.shape[-1], *strides, Hq, Hkv,
        N, M, Hq // Hkv, scale, bmask.captures, mod_captures, **consts,
    )  # fmt: skip
    return dq, dk, dv, delta, grads


class _FlexAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, block_mask, scale, score_mod, sinks, *learned):  # learned: ScoreMod.learned's tensors
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        sinks32 = None if sinks is None else sinks.float().contiguous()
        out, lse = _forward(q, k, v, block_mask, scale, score_mod, sinks32)
        ctx.save_for_backward(q, k, v, out, lse, sinks32)
        ctx.block_mask, ctx.scale, ctx.score_mod = block_mask, scale, score_mod
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        ctx.learned = score_mod.learned if score_mod is not None else ()  # their positions in its captures
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks32 = ctx.saved_tensors
        wanted = tuple(i for i, need in zip(ctx.learned, ctx.needs_input_grad[7:], strict=True) if need)
        dq, dk, dv, delta, grads = _backward(dout, dlse, q, k, v, out, lse, ctx.block_mask, ctx.scale,
                                             ctx.score_mod, wanted)  # fmt: skip
        dsinks = None
        if sinks32 is not None and ctx.needs_input_grad[6]:
            # the sink is a key whose value is 0: d loss / d sink = -sum over queries of P_sink * delta, delta the
            # backward's rowsum(dout * out) - dlse, P_sink = exp(sink - lse)
            dsinks = -(torch.exp(sinks32[None, :, None] - lse) * delta).sum(dim=(0, 2)).to(ctx.sinks_dtype)
        captures = ctx.score_mod.captures if ctx.score_mod is not None else ()
        d_learned = tuple(grads[i].to(captures[i].dtype) if i in grads else None for i in ctx.learned)
        return dq, dk, dv, None, None, None, dsinks, *d_learned


# --------------------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------------------
def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                   scale: Optional[float] = None, return_lse: bool = False,
                   score_mod: Optional[ScoreMod] = None, sinks: Optional[torch.Tensor] = None):  # fmt: skip
    """Attention of q (B, Hq, N, D) over k (B, Hkv, M, D) and v (B, Hkv, M, Dv) under ``block_mask`` (from
    :func:`create_block_mask` for these N and M, and for this B and Hq unless made for None); float16 or
    bfloat16 (float32 on the CPU, interpreted). ``score_mod``: a :class:`ScoreMod` applied to each scaled score
    the mask lets through (:func:`softcap`, :func:`alibi`, or one of your own). ``sinks`` (Hq,): attention sinks,
    a learned logit per query head that joins every query's softmax with a zero value (gpt-oss). Returns out (B,
    Hq, N, Dv), and the natural-log log-sum-exp (B, Hq, N) float32 with ``return_lse``. Differentiable in q, k, v
    and sinks (and through lse)."""
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
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise TypeError(f"score_mod must be a ScoreMod (softcap(...), alibi(...) or ScoreMod(fn, captures)), got "
                        f"{type(score_mod).__name__}")  # fmt: skip
    if score_mod is not None:
        if not isinstance(score_mod.fn, _JIT_TYPES) or not isinstance(score_mod.captures, tuple):
            raise TypeError("a ScoreMod's fn must be a @triton.jit function (score, b, h, q_idx, kv_idx, captures) "
                            "and its captures a tuple")  # fmt: skip
        if score_mod.learned and not isinstance(score_mod.grad_fn, _JIT_TYPES):
            raise ValueError("a captured tensor of score_mod requires grad, but the ScoreMod has no grad_fn to give "
                             "it one: add a @triton.jit grad_fn, or detach the tensor")  # fmt: skip
        check_same_device(q=q, **{f"score_mod.captures[{i}]": c for i, c in enumerate(score_mod.captures)
                                  if isinstance(c, torch.Tensor)})  # fmt: skip
    if sinks is not None:
        check_tensor(sinks, "sinks", ndim=1)
        check_same_device(q=q, sinks=sinks)
        if sinks.shape[0] != Hq or not sinks.is_floating_point():
            raise ValueError(f"sinks must be a floating tensor of one logit per query head ({Hq},), got "
                             f"{sinks.dtype} of shape {tuple(sinks.shape)}")  # fmt: skip
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not use_triton(q, op="flex_attention"):
        if score_mod is not None and score_mod.reference is None:
            raise RuntimeError("this score_mod has no PyTorch reference to run without Triton: set "
                               "TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU")  # fmt: skip
        return flex_attention_ref(q, k, v, dense_mask(block_mask), scale, return_lse, score_mod, sinks)
    out, lse = _apply(q, k, v, block_mask, scale, score_mod, sinks)
    return (out, lse) if return_lse else out


@torch.compiler.disable  # a graph break under torch.compile: the mask function is no op argument (yet)
def _apply(q, k, v, block_mask, scale, score_mod, sinks):
    learned = [score_mod.captures[i] for i in score_mod.learned] if score_mod is not None else []
    return _FlexAttention.apply(q, k, v, block_mask, scale, score_mod, sinks, *learned)


def alibi_slopes(heads: int, device=None) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8 (h + 1) / heads), float32 (Press et al. 2022)."""
    return 2.0 ** (-8.0 * torch.arange(1, heads + 1, device=device, dtype=torch.float32) / heads)


SCORED_PATTERNS = ("softcap", "alibi")  # causal attention with a score modifier: softcap(cap=50), alibi(slopes)


def compile_attention_kernel(pattern: str, score_mod: Optional[ScoreMod] = None, **params) -> Callable:
    """A callable ``attend(q, k, v, scale=None, return_lse=False, sinks=None)`` for a named pattern with its
    parameters: a mask of ``PATTERNS`` (``window_size`` for sliding_window, ``document_ids`` (B, N) for document,
    ``prefix_length`` for prefix_lm) with an optional score modifier (e.g. ``score_mod=softcap(50.0)``), or one of
    ``SCORED_PATTERNS``: causal attention with ``softcap`` (``cap``, 50 by default) or ``alibi`` (``slopes``
    (Hq,), by default :func:`alibi_slopes` for the query heads of the first call). It builds the block mask for
    each new (N, M, device) on first use and keeps it; ``sinks`` as in :func:`flex_attention`."""
    if pattern not in PATTERNS and pattern not in SCORED_PATTERNS:
        raise ValueError(f"pattern must be one of {sorted(PATTERNS) + list(SCORED_PATTERNS)}, got {pattern!r}")
    if pattern in SCORED_PATTERNS:
        if score_mod is not None:
            raise ValueError(f"{pattern!r} is causal attention with its own score modifier: pass score_mod with a "
                             "mask pattern (e.g. 'causal') instead")  # fmt: skip
        extra = set(params) - {"cap" if pattern == "softcap" else "slopes"}
        if extra:
            raise TypeError(f"pattern {pattern!r} takes {'cap' if pattern == 'softcap' else 'slopes'}, not {extra}")
        if pattern == "softcap":
            score_mod = softcap(params.get("cap", 50.0))
        elif params.get("slopes") is not None:
            score_mod = alibi(params["slopes"])
    mask_pattern = "causal" if pattern in SCORED_PATTERNS else pattern
    made: dict[tuple, BlockMask] = {}
    mods: dict[tuple, ScoreMod] = {}

    def attend(q, k, v, scale=None, return_lse=False, sinks=None):
        key = (q.shape[2], k.shape[2], q.device)
        if key not in made:
            mask_mod, captures = PATTERNS[mask_pattern](q.shape[2], k.shape[2],
                                                        **({} if pattern in SCORED_PATTERNS else params))  # fmt: skip
            per_sequence = pattern == "document"
            made[key] = create_block_mask(mask_mod, q.shape[0] if per_sequence else None, None, *key[:2],
                                          captures=captures, device=q.device)  # fmt: skip
        mod = score_mod
        if pattern == "alibi" and mod is None:  # slopes for these heads, made once per head count and device
            mod = mods.setdefault((q.shape[1], q.device), alibi(alibi_slopes(q.shape[1], q.device)))
        return flex_attention(q, k, v, made[key], scale, return_lse, mod, sinks)

    attend.pattern, attend.params, attend.score_mod = pattern, params, score_mod
    return attend
