"""A small GPT, one architecture written at several levels of the course: ``GPTConfig.impl`` picks the version.

The model is a decoder-only, pre-norm transformer in the Llama style. For tokens idx (B, T)::

    x = embed(idx)                                                  (B, T, d)    no learned position embedding
    for each of the n_layers blocks:
        x = x + attn(attn_norm(x))      causal self-attention, rotary embedding (RoPE) on q and k
        x = x + mlp(mlp_norm(x))        SwiGLU: down(silu(gate(x)) * up(x)), or a top-k mixture of such experts
    h = norm_f(x)                                                   (B, T, d)    what forward_hidden returns
    logits = head(h)                                                (B, T, V)    head untied from embed
    loss = cross_entropy(logits, targets)                           float32, mean over targets != -100

Every norm is an RMSNorm (weight, no bias), no linear layer has a bias, RoPE uses the rotate-half convention
(kernel_lib.rope's), and attention is scaled by 1/sqrt(head_dim). The loss is the cross-entropy alone in every
version: with experts, kernel_lib.MoE's load-balancing loss is dropped (its coefficient set to 0), so that all
versions compute the same number; a training script that wants it adds it itself.

Four versions; the three values of ``impl`` select the submodule classes below, one small class per part:

* ``impl="naive"`` (Level 0): written the way a model is often first written, as in many public model files:
  separate q, k, v projections; RoPE computed in the attention's forward; attention written out as scores, a
  causal mask, a softmax and a product; RMSNorm and the SwiGLU MLP as plain PyTorch ops; the loss on the full
  logits; with experts, a router and a loop over expert MLPs (the routing of ``kernel_lib.moe_ref``).
* ``impl="native"`` (Level 1): the same model written well in plain PyTorch. One fused qkv projection, RoPE
  tables built once as buffers, ``F.scaled_dot_product_attention(is_causal=True)``, ``nn.RMSNorm``, one fused
  gate_up projection; a mixture of experts with stacked weights, tokens sorted by expert once per layer.
* ``torch.compile(GPT(config with impl="native"))`` (Level 2): the native version compiled; no code of its own.
  The dense model compiles without a graph break (the MoE's group sizes are a host sync, hence a break).
* ``impl="kernel_lib"`` (Level 4): the native layout with kernel_lib's Triton kernels: ``RMSNorm``, ``rope``,
  ``flash_attention`` (float16/bfloat16; float32 runs SDPA), ``swiglu_linear``, ``linear_cross_entropy`` (the loss
  without the (B*T, V) logits) and ``MoE`` (grouped GEMMs, no host sync). They are torch.library custom ops, so
  it compiles without a graph break too.

Parameters, with E = n_experts and d_ff the MLP width::

    N = 2 V d  +  d  +  n_layers (2 d² + 2 d kv + 2 d + M)        M = 3 d d_ff (dense)  or  E (3 d d_ff + d) (MoE)

(embedding and head, norm_f, and per block q/k/v/o, two norms and the MLP or the experts with their router);
kv = n_kv_heads * head_dim is d unless ``n_kv_heads`` asks for grouped-query attention (k, v and the KV cache
shrink by n_heads / n_kv_heads; the native and kernel_lib versions support it, the naive one, written per head,
does not).

Weight layout, (out, in) for every nn.Linear weight:

* naive: ``blocks.i.attn.{q,o}.weight`` (d, d), ``blocks.i.attn.{k,v}.weight`` (kv, d);
  ``blocks.i.mlp.{gate,up}.weight`` (d_ff, d),
  ``blocks.i.mlp.down.weight`` (d, d_ff); with experts ``blocks.i.mlp.router.weight`` (E, d) and
  ``blocks.i.mlp.experts.e.{gate,up,down}.weight`` as above.
* native and kernel_lib (one layout, the same names): ``blocks.i.attn.qkv.weight`` (d + 2 kv, d) = [q; k; v] stacked
  along dim 0, ``blocks.i.attn.o.weight``; ``blocks.i.mlp.gate_up.weight`` (2 d_ff, d) = [gate; up],
  ``blocks.i.mlp.down.weight``; with experts ``blocks.i.mlp.router.weight`` and ``blocks.i.mlp.w_gate``,
  ``w_up`` (E, d, d_ff) and ``w_down`` (E, d_ff, d), each expert's Linear weight transposed (kernel_lib.MoE's).
* all: ``embed.weight`` (V, d), ``blocks.i.attn_norm.weight``, ``blocks.i.mlp_norm.weight``, ``norm_f.weight``
  (d,), ``head.weight`` (V, d).

Initialization: every weight is drawn in the naive layout, in one fixed order (``_naive_shapes``), in float32 on
the model's device, then written into the version's layout: normal(0, 0.02) for embeddings and linears, residual
projections (o, down) with std 0.02 / sqrt(2 n_layers) (GPT-2's scaling), norms at 1. The draws come from a
generator seeded by one draw of the global RNG made before any submodule is built (their own initializations,
overwritten, draw different amounts per version), so after ``torch.manual_seed(s)`` every version on one device
starts from the same weights. ``transfer_weights(src, dst)`` copies weights between any two versions, and
``naive_layout(model, grads=...)`` shows any version's weights or gradients under the naive names, for comparing
versions parameter by parameter.

Decoding with a static KV cache (every version; ``kernel_lib.models.generate`` drives it)::

    cache = model.init_cache(batch, max_len)      per layer k, v (B, Hkv, max_len, hd), zeros, allocated once
    logits = model.forward_step(prompt, cache, 0)                 prefill: T0 tokens at positions 0..T0-1
    logits = model.forward_step(token, cache, pos, kv_len)        decode: one token (B, 1) at position pos

A step embeds its n tokens, rotates q and k by the RoPE angles of their positions pos..pos+n-1 (rows of the same
tables as ``forward``), writes k, v into the cache at those positions (``index_copy_`` with a position tensor)
and attends over the first ``kv_len`` cached positions, where query t sees key j iff j <= pos + t. The shapes
depend on n and kv_len alone, never on pos, so one decode step is one fixed sequence of kernels: what a CUDA
graph captures. ``pos`` is therefore a Python int (eager use: attention reads exactly pos + n keys) or a
one-element int64 tensor on the model's device (graph use: the position is data, rewritten before each replay).
With a tensor, ``kv_len`` is a Python int fixed per captured graph: ``kv_bucket(pos + n, max_len)`` rounds up to
a multiple of ``DECODE_BUCKET`` (64) positions, so a generation uses one graph per 64 tokens and reads at most 63
unused positions. Attention over the cache: naive writes the masked scores out; native calls SDPA with a
boolean mask; kernel_lib calls ``decode_attention`` when the step's queries are few (decoding: the keys are
split across programs, and each sequence's length pos + n is a tensor, ``StepPlace.lengths``), else
``flash_attention`` (``flash_over_cache`` explains how it hides the unused tail without a mask argument), after
one ``rope_to_cache`` kernel per layer that rotates q and k, writes k and v into
the cache and places the queries in flash_over_cache's block (the native step's two gathers, two rotations and
two cache writes, and a fill and a scatter for the block), and each residual add is done by the RMSNorm that
reads the sum (``add_norm``: one kernel for the two). Where the tokens sit (``StepPlace``) is worked out once per
step, not per layer.
"""

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..ops.attention import MAX_HEAD_DIM, flash_attention
from ..ops.decode_attention import MAX_ROWS as DECODE_MAX_ROWS
from ..ops.decode_attention import decode_attention
from ..ops.linear_cross_entropy import linear_cross_entropy
from ..ops.moe import MoE
from ..ops.norms import RMSNorm, add_rms_norm
from ..ops.rope import check_position, rope, rope_cos_sin, rope_to_cache
from ..ops.swiglu import swiglu, swiglu_linear

__all__ = [
    "GPT", "GPTConfig", "KVCache", "StepPlace", "transfer_weights", "naive_layout", "kv_bucket", "IMPLS",
    "DECODE_BUCKET",
]  # fmt: skip

IMPLS = ("naive", "native", "kernel_lib")
DECODE_BUCKET = 64  # cache positions per decode bucket: kv_len of a tensor-position step is a multiple of it


@dataclass
class GPTConfig:
    """The model's sizes and version. ``n_kv_heads`` None: every query head has its own keys and values; fewer
    (a divisor of ``n_heads``): grouped-query attention, each key/value head shared by n_heads / n_kv_heads query
    heads (Llama 2 70B and later), which shrinks the k and v projections and the KV cache by that factor. ``d_ff``
    None: 8/3 d rounded up to a multiple of 256 (SwiGLU's width for about the parameters of a 4d GELU MLP).
    ``n_experts`` 0: a dense MLP; > 0: a mixture of that many experts, each token sent to ``top_k`` of them."""

    vocab_size: int = 32768
    d_model: int = 1024
    n_layers: int = 8
    n_heads: int = 16
    n_kv_heads: Optional[int] = None
    d_ff: Optional[int] = None
    max_seq_len: int = 2048
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    n_experts: int = 0
    top_k: int = 2
    impl: str = "naive"

    def __post_init__(self):
        if self.d_ff is None:
            self.d_ff = 256 * math.ceil(8 * self.d_model / 3 / 256)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.impl == "naive" and self.n_kv_heads != self.n_heads:  # the naive model writes attention per head
            raise ValueError(f"impl 'naive' has no grouped-query attention: n_kv_heads must be {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"the head dim d_model / n_heads must be even for RoPE's pairs, got {self.head_dim}")
        if self.impl == "kernel_lib" and self.head_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"impl 'kernel_lib' needs a head dim of at most {MAX_HEAD_DIM} for flash attention, got {self.head_dim}"
            )
        if not self.rope_base > 0 or not self.norm_eps >= 0:
            raise ValueError(f"rope_base must be > 0 and norm_eps >= 0, got {self.rope_base} and {self.norm_eps}")
        if not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"n_experts must be 0 (dense MLP) or a positive integer, got {self.n_experts!r}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be between 1 and n_experts ({self.n_experts}), got {self.top_k}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the k and v projections: n_kv_heads * head_dim (d_model without grouped-query attention)."""
        return self.n_kv_heads * self.head_dim


# --------------------------------------------------------------------------------------------------
# Decoding: the static KV cache and attention over it
# --------------------------------------------------------------------------------------------------
@dataclass
class KVCache:
    """Keys and values of every layer, ``k[i]``, ``v[i]`` (batch, n_kv_heads, max_len, head_dim), allocated once by
    ``GPT.init_cache`` and written in place by ``GPT.forward_step``. They start at zero and positions past the
    current one are always masked, so a cache is reused for a new sequence without clearing it (stale values are
    finite and weighted by exactly 0)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device


def kv_bucket(end: int, max_len: int) -> int:
    """The kv_len of a tensor-position step whose last token sits at position end - 1: ``end`` rounded up to a
    multiple of DECODE_BUCKET, at most max_len."""
    return min(max_len, -(-end // DECODE_BUCKET) * DECODE_BUCKET)


class StepPlace(NamedTuple):
    """Where a decoding step's tokens sit, worked out once per ``GPT.forward_step`` and passed to every layer.

    positions (n,) int64 on the model's device; kv_len, the cache positions attention reads; exact: kv_len is
    pos + n (int pos) rather than a bucket end; rows (n,): for a bucketed step, each query's row in the query
    block of ``flash_over_cache`` (None when exact); lengths (B,) int32, pos + n for every sequence, set for the
    kernel_lib version when its decode_attention takes the step (few queries), else None."""

    positions: torch.Tensor
    kv_len: int
    exact: bool
    rows: Optional[torch.Tensor]
    lengths: Optional[torch.Tensor] = None

    @property
    def block_rows(self) -> int:
        """R, the rows of the query block: n when exact, else min(kv_len, DECODE_BUCKET)."""
        return self.positions.shape[0] if self.exact else min(self.kv_len, DECODE_BUCKET)

    @property
    def block_start(self) -> int:
        """The position that the block's row 0 stands for: kv_len - R (pos itself when exact)."""
        return self.kv_len - self.block_rows


def _cache_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """(n, kv_len) bool, True where query t (at positions[t]) sees cached key j: j <= positions[t]."""
    return torch.arange(kv_len, device=positions.device) <= positions[:, None]


def _write_cache(cache_k, cache_v, k, v, positions, kv_len: int):
    """Write k, v (B, Hkv, n, hd) at ``positions`` (index_copy_: a position tensor, no host value); return the views
    of the first kv_len positions that attention reads."""
    cache_k.index_copy_(2, positions, k)
    cache_v.index_copy_(2, positions, v)
    return cache_k[:, :, :kv_len], cache_v[:, :, :kv_len]


def flash_over_cache(block, keys, values, rows: Optional[torch.Tensor]):
    """kernel_lib.flash_attention of the queries in ``block`` (B, H, R, hd) over the cached ``keys``, ``values``
    (B, Hkv, M, hd), M = kv_len, where the query at position p must see the keys j <= p and no other.

    flash_attention has no mask and no length argument: what a query sees follows from the shapes alone (causal,
    aligned bottom-right: row i of R sees keys j <= i + M - R). So a query at position p is placed at row
    p - (M - R) of the block, and that row sees keys j <= p exactly. When the step is exact (M = pos + n, known
    on the host: prefill and eager decode), the block is the step's queries themselves (R = n, rows None). With a
    position tensor (graph decode), M is a bucket end that may exceed pos + n, and the stale tail must stay
    hidden without reading pos on the host: the block has R = min(M, DECODE_BUCKET) rows, zero but for the
    queries (``kernel_lib.rope_to_cache`` writes it, rotating them on the way), and ``rows`` (n,) picks the
    queries' rows of the output; the others are discarded. R rows cost what one does, as the kernel pads queries
    to a tile of 16 or more rows anyway and decode reads the cache, not the queries. Rejected: slicing k, v to
    pos + 1 (a new shape, hence a new graph, every token); the full square M x M (right, but M² work per token);
    zero keys in the tail with a log-sum-exp correction (their scores are 0, not -inf: the correction cancels
    catastrophically when the true scores are small). Needs pos >= M - R, which kv_bucket guarantees and
    forward_step checks outside graph capture. Returns (B, H, n, hd)."""
    out = flash_attention(block, keys, values, causal=True)
    return out if rows is None else out.index_select(2, rows)


# --------------------------------------------------------------------------------------------------
# Level 0, "naive": how a model is often first written
# --------------------------------------------------------------------------------------------------
class NaiveRMSNorm(nn.Module):
    """RMSNorm as it appears in many model files: normalize in float32, cast back, scale."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class NaiveAttention(nn.Module):
    """Causal self-attention with separate q, k, v projections and the score matrix written out."""

    def __init__(self, config: GPTConfig, device=None, dtype=None):
        super().__init__()
        d = config.d_model
        self.n_heads, self.head_dim, self.rope_base = config.n_heads, config.head_dim, config.rope_base
        self.q = nn.Linear(d, d, bias=False, device=device, dtype=dtype)
        self.k = nn.Linear(d, d, bias=False, device=device, dtype=dtype)
        self.v = nn.Linear(d, d, bias=False, device=device, dtype=dtype)
        self.o = nn.Linear(d, d, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)

        # rotary embedding: pair i of position t turns by the angle t / base^(2i / hd)
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_base ** (torch.arange(0, dim, 2, device=x.device).float() / dim))
        t = torch.arange(T, device=x.device).float()
        freqs = torch.outer(t, inv_freq)  # (T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, T, T)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        scores = scores.masked_fill(mask, float("-inf"))
        att = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        y = att @ v  # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.o(y)

    def step(self, x, cache_k, cache_v, place: StepPlace):
        """x (B, n, C) at ``place.positions`` (n,): q, k, v and RoPE as in forward, k and v written into the
        cache, scores over the first kv_len cached keys with the positions after each query masked out."""
        positions, kv_len = place.positions, place.kv_len
        B, n, C = x.shape
        q = self.q(x).view(B, n, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, n, hd)
        k = self.k(x).view(B, n, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, n, self.n_heads, self.head_dim).transpose(1, 2)

        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_base ** (torch.arange(0, dim, 2, device=x.device).float() / dim))
        freqs = torch.outer(positions.float(), inv_freq)  # (n, hd/2): forward's rows at these positions
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        keys, values = _write_cache(cache_k, cache_v, k, v, positions, kv_len)  # (B, H, kv_len, hd)
        scores = (q @ keys.transpose(-2, -1)) / math.sqrt(self.head_dim)  # (B, H, n, kv_len)
        scores = scores.masked_fill(~_cache_mask(positions, kv_len), float("-inf"))
        att = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        y = att @ values  # (B, H, n, hd)
        return self.o(y.transpose(1, 2).reshape(B, n, C))


class NaiveMLP(nn.Module):
    """SwiGLU MLP with three projections."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(d_ff, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class NaiveMoE(nn.Module):
    """Mixture of SwiGLU experts: softmax router, top-k, a Python loop over the experts."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, device=None, dtype=None):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, n_experts, bias=False, device=device, dtype=dtype)
        self.experts = nn.ModuleList([NaiveMLP(d_model, d_ff, device=device, dtype=dtype) for _ in range(n_experts)])

    def forward(self, x):
        B, T, C = x.shape
        x = x.view(-1, C)
        probs = torch.softmax(self.router(x).float(), dim=-1)
        topk_probs, topk_idx = torch.topk(probs, self.top_k, dim=-1)  # (B*T, k)
        topk_probs = topk_probs / topk_probs.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (topk_idx == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, (expert(x[token]) * topk_probs[token, slot, None]).to(x.dtype))
        return out.view(B, T, C)


# --------------------------------------------------------------------------------------------------
# Level 1, "native": the same model written well in plain PyTorch
# --------------------------------------------------------------------------------------------------
def _rope_buffers(module: nn.Module, config: GPTConfig, device) -> None:
    """cos, sin (max_seq_len, hd/2) float32, built once; non-persistent: rebuilt from the config, not saved.
    (``model.to(dtype)`` would cast them too: build the model in its dtype, ``GPT(config, dtype=...)``, instead.)"""
    cos, sin = rope_cos_sin(config.max_seq_len, config.head_dim, config.rope_base, device=device)
    module.register_buffer("cos", cos, persistent=False)
    module.register_buffer("sin", sin, persistent=False)


def _repeat_kv(x, n_heads: int):
    """Keys or values (B, Hkv, T, hd) repeated to (B, n_heads, T, hd): query head h reads key/value head
    h // (n_heads / Hkv), the grouping of flash_attention, SDPA's enable_gqa and Hugging Face's repeat_kv."""
    group = n_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _sdpa(q, k, v, attn_mask=None, is_causal: bool = False):
    """F.scaled_dot_product_attention, also with k, v of fewer heads than q (grouped-query attention): without a
    mask through SDPA's ``enable_gqa`` (no copy); with one, k and v repeated to q's heads, as not every backend
    takes both."""
    if k.shape[1] == q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    if attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]), attn_mask=attn_mask)


def apply_rope(x, cos, sin):
    """Rotate x (B, H, T, hd) by cos, sin (T, hd/2), rotate-half convention, in float32; returns x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class NativeAttention(nn.Module):
    """Causal self-attention: one qkv matmul, cached RoPE tables, PyTorch's fused attention (SDPA)."""

    def __init__(self, config: GPTConfig, device=None, dtype=None):
        super().__init__()
        d = config.d_model
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.split = (d, config.kv_dim, config.kv_dim)  # q, k, v columns of the fused projection
        self.qkv = nn.Linear(d, sum(self.split), bias=False, device=device, dtype=dtype)
        self.o = nn.Linear(d, d, bias=False, device=device, dtype=dtype)
        _rope_buffers(self, config, device)

    def _heads(self, x):
        """q (B, H, T, hd) and k, v (B, Hkv, T, hd) of x (B, T, C): strided views of one qkv matmul, no copy."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self._heads(x)  # (B, H, T, hd), (B, Hkv, T, hd) twice
        q, k = apply_rope(q, self.cos[:T], self.sin[:T]), apply_rope(k, self.cos[:T], self.sin[:T])
        y = _sdpa(q, k, v, is_causal=True)  # (B, H, T, hd); no T x T tensor on GPUs
        return self.o(y.transpose(1, 2).reshape(B, T, C))

    def step(self, x, cache_k, cache_v, place: StepPlace):
        """x (B, n, C) at ``place.positions`` (n,): RoPE from the tables' rows at those positions, k and v written
        into the cache, attention over the first kv_len cached keys with a boolean mask."""
        positions, kv_len = place.positions, place.kv_len
        B, n, C = x.shape
        q, k, v = self._heads(x)  # (B, H, n, hd), (B, Hkv, n, hd) twice
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)  # (n, hd/2), no sync
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = _write_cache(cache_k, cache_v, k, v, positions, kv_len)  # (B, Hkv, kv_len, hd)
        # a boolean mask (True: attend) over all kv_len keys; SDPA picks a kernel that takes masks
        y = _sdpa(q, keys, values, attn_mask=_cache_mask(positions, kv_len))  # (B, H, n, hd)
        return self.o(y.transpose(1, 2).reshape(B, n, C))


class NativeMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one matmul."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False, device=device, dtype=dtype)
        self.down = nn.Linear(d_ff, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class NativeMoE(nn.Module):
    """Mixture of SwiGLU experts with stacked weights (kernel_lib.MoE's layout): the T*k assignments sorted by
    expert once, each expert's rows a contiguous slice; one host sync per layer for the group sizes."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, device=None, dtype=None):
        super().__init__()
        self.top_k = top_k
        kw = dict(device=device, dtype=dtype)
        self.router = nn.Linear(d_model, n_experts, bias=False, **kw)
        self.w_gate = nn.Parameter(torch.empty(n_experts, d_model, d_ff, **kw))  # filled by GPT.reset_parameters
        self.w_up = nn.Parameter(torch.empty(n_experts, d_model, d_ff, **kw))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_ff, d_model, **kw))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, d) tokens
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        order = experts.flatten().argsort(stable=True)  # the N*k assignments grouped by expert
        token = order // self.top_k
        counts = torch.bincount(experts.flatten(), minlength=self.w_gate.shape[0]).tolist()  # the host sync
        groups = x[token].split(counts)
        out = torch.cat(
            [(F.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])) @ self.w_down[e] for e, xe in enumerate(groups)]
        )  # (N*k, d) in sorted order
        y = torch.zeros(x.shape, device=x.device, dtype=torch.float32)  # sums in float32, as kernel_lib.moe_ref
        y = y.index_add(0, token, out.float() * weights.flatten()[order, None])
        return y.to(x.dtype).reshape(shape)


# --------------------------------------------------------------------------------------------------
# Level 4, "kernel_lib": the native layout on kernel_lib's Triton kernels
# --------------------------------------------------------------------------------------------------
class KernelAttention(NativeAttention):
    """NativeAttention with kernel_lib.rope and kernel_lib.flash_attention."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self._heads(x)  # (B, H, T, hd), (B, Hkv, T, hd) twice
        q, k = rope(q, self.cos[:T], self.sin[:T]), rope(k, self.cos[:T], self.sin[:T])
        if q.dtype in (torch.float16, torch.bfloat16):
            y = flash_attention(q, k, v, causal=True)
        else:  # flash_attention takes 16-bit inputs only (its tiles are 16-bit tensor-core matmuls): SDPA for float32
            y = _sdpa(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))

    def step(self, x, cache_k, cache_v, place: StepPlace):
        """NativeAttention.step with one kernel for RoPE, the cache write and the query block
        (``kernel_lib.rope_to_cache``), then ``decode_attention`` for a step of few queries (``place.lengths``
        set), else ``flash_over_cache``; float32 runs the native step (SDPA)."""
        if x.dtype not in (torch.float16, torch.bfloat16):
            return super().step(x, cache_k, cache_v, place)
        B, n, C = x.shape
        q, k, v = self._heads(x)  # (B, H, n, hd), (B, Hkv, n, hd) twice
        kv = place.kv_len
        if place.lengths is not None:  # decoding: keys split across programs, lengths read on the GPU
            q = rope_to_cache(q, k, v, self.cos, self.sin, place.positions[:1], cache_k, cache_v)  # (B, H, n, hd)
            y = decode_attention(q, cache_k[:, :, :kv], cache_v[:, :, :kv], place.lengths)
            return self.o(y.transpose(1, 2).reshape(B, n, C))
        block = rope_to_cache(
            q, k, v, self.cos, self.sin, place.positions[:1], cache_k, cache_v, place.block_rows, place.block_start
        )  # (B, H, R, hd)
        y = flash_over_cache(block, cache_k[:, :, :kv], cache_v[:, :, :kv], place.rows)  # (B, H, n, hd)
        return self.o(y.transpose(1, 2).reshape(B, n, C))


class KernelMLP(NativeMLP):
    """NativeMLP with kernel_lib's SwiGLU on the two halves of the fused projection (views, no copy), fused with
    the down projection so that the backward recomputes the product instead of keeping it (``swiglu_linear``)."""

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        if type(self.down) is not nn.Linear:  # quantize_'s or convert_to_float8's down projection: its own product
            return self.down(swiglu(gate, up))
        return swiglu_linear(gate, up, self.down.weight)


class KernelMoE(MoE):
    """kernel_lib.MoE returning y alone: its load-balancing loss is off (coefficient 0), so every version's loss is
    the same cross-entropy."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, device=None, dtype=None):
        super().__init__(d_model, d_ff, n_experts, top_k, aux_loss_coef=0.0, device=device, dtype=dtype)

    def forward(self, x):
        y, _ = super().forward(x)
        return y


# (norm, attention, dense MLP, mixture of experts) of each version
_PARTS = {
    "naive": (NaiveRMSNorm, NaiveAttention, NaiveMLP, NaiveMoE),
    "native": (nn.RMSNorm, NativeAttention, NativeMLP, NativeMoE),
    "kernel_lib": (RMSNorm, KernelAttention, KernelMLP, KernelMoE),
}


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig, device=None, dtype=None):
        super().__init__()
        norm, attention, mlp, moe = _PARTS[config.impl]
        kw = dict(device=device, dtype=dtype)
        self.attn_norm = norm(config.d_model, eps=config.norm_eps, **kw)
        self.attn = attention(config, **kw)
        self.mlp_norm = norm(config.d_model, eps=config.norm_eps, **kw)
        if config.n_experts:
            self.mlp = moe(config.d_model, config.d_ff, config.n_experts, config.top_k, **kw)
        else:
            self.mlp = mlp(config.d_model, config.d_ff, **kw)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def step(self, x, delta, cache_k, cache_v, place: StepPlace):
        """A decoding step through the block. ``delta``: the previous block's MLP output, not yet added to the
        residual stream x (None at the first block): each residual add is done by the norm that reads its sum
        (``add_norm``). Returns (x, this block's MLP output)."""
        h, x = add_norm(self.attn_norm, x, delta)
        h, x = add_norm(self.mlp_norm, x, self.attn.step(h, cache_k, cache_v, place))
        return x, self.mlp(h)


def add_norm(norm: nn.Module, x: torch.Tensor, delta: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + delta), x + delta), or (norm(x), x) when delta is None: the residual add and the next norm of a
    decoding step. kernel_lib's RMSNorm does both in one kernel (``add_rms_norm``, equal bit for bit to the two
    apart); the other versions add, then normalize."""
    if delta is None:
        return norm(x), x
    if isinstance(norm, RMSNorm):
        return add_rms_norm(delta, x, norm.weight, norm.eps)
    x = x + delta
    return norm(x), x


class GPT(nn.Module):
    """The decoder-only transformer of the module docstring, in the version ``config.impl``.

    ``forward(idx)`` returns the logits (B, T, V); ``forward(idx, targets)`` the mean cross-entropy (float32
    scalar, targets -100 ignored). ``forward_hidden(idx)`` returns the final-normed hidden states (B, T, d): the
    loss is ``F.cross_entropy(head(forward_hidden(idx)).float().flatten(0, 1), targets.flatten())``, the protocol a
    loss-fusion rewrite uses (the kernel_lib version computes it as ``linear_cross_entropy(h, head.weight, ...)``).
    """

    def __init__(self, config: GPTConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        # The seed of reset_parameters, drawn first: the submodules' own initialization (overwritten below) draws
        # a different amount of randomness in each version.
        seed = int(torch.randint(0, 2**62, ()))
        kw = dict(device=device, dtype=dtype)
        self.embed = nn.Embedding(config.vocab_size, config.d_model, **kw)
        self.blocks = nn.ModuleList([Block(config, **kw) for _ in range(config.n_layers)])
        self.norm_f = _PARTS[config.impl][0](config.d_model, eps=config.norm_eps, **kw)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False, **kw)
        # Activation checkpointing (kernel_lib.distributed.wrap sets it): each block keeps only its input for
        # backward and recomputes the rest there; the parameter names stay those of the plain model.
        self.checkpoint_blocks = False
        if self.head.weight.device.type != "meta":
            self.reset_parameters(torch.Generator(self.head.weight.device).manual_seed(seed))

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw the weights in the naive layout, in a fixed order, and write them into this version's layout: from
        one generator state (the same global seed, on the same device) every version gets the same weights.
        normal(0, 0.02), residual projections (o, down) 0.02 / sqrt(2 n_layers), norms 1."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        device = self.head.weight.device
        weights = {}
        for name, shape in _naive_shapes(self.config):
            if name.endswith("norm.weight") or name == "norm_f.weight":
                weights[name] = torch.ones(shape, device=device)
            else:
                std = residual_std if name.endswith((".o.weight", ".down.weight")) else 0.02
                weights[name] = torch.empty(shape, device=device).normal_(0.0, std, generator=generator)
        _load_naive_layout(self, weights)

    def _check(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> None:
        if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64:
            raise ValueError(f"idx must be an int64 tensor of token ids, got {getattr(idx, 'dtype', type(idx))}")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        if idx.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {idx.shape[1]} is longer than max_seq_len ({self.config.max_seq_len})")
        if targets is not None:
            if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
                raise ValueError(f"targets must be an int64 tensor, got {getattr(targets, 'dtype', type(targets))}")
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")

    def forward_hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states (B, T, d) of tokens idx (B, T): everything but the head."""
        self._check(idx)
        x = self.embed(idx)
        recompute = self.checkpoint_blocks and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.norm_f(x)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._check(idx, targets)
        h = self.forward_hidden(idx)
        if targets is None:
            return self.head(h)
        if self.config.impl == "kernel_lib":  # head and loss fused: the (B*T, V) logits never exist
            return linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.head.weight, targets.reshape(-1))
        logits = self.head(h)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    # ----------------------------------------------------------------------------------------------
    # Decoding with a static KV cache (the module docstring's last section)
    # ----------------------------------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: Optional[int] = None, device=None, dtype=None) -> KVCache:
        """A zeroed KVCache for ``batch`` sequences of up to ``max_len`` tokens (default max_seq_len), on the
        model's device and in its dtype unless given (forward_step needs the model's dtype)."""
        max_len = self.config.max_seq_len if max_len is None else max_len
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive integer, got {batch!r}")
        if not isinstance(max_len, int) or not 1 <= max_len <= self.config.max_seq_len:
            raise ValueError(
                f"max_len must be an integer in [1, max_seq_len={self.config.max_seq_len}] (the RoPE "
                f"tables' length), got {max_len!r}"
            )
        c, w = self.config, self.head.weight
        shape = (batch, c.n_kv_heads, max_len, c.head_dim)
        kw = dict(device=w.device if device is None else device, dtype=w.dtype if dtype is None else dtype)
        return KVCache([torch.zeros(shape, **kw) for _ in self.blocks], [torch.zeros(shape, **kw) for _ in self.blocks])

    def _check_step(self, idx, cache, pos, kv_len) -> StepPlace:
        """Check a step's arguments; return where its tokens sit."""
        self._check(idx)
        B, n = idx.shape
        if not isinstance(cache, KVCache) or len(cache.k) != self.config.n_layers:
            raise ValueError(f"cache must be a KVCache from this model's init_cache, got {type(cache).__name__}")
        w = self.head.weight
        if cache.dtype != w.dtype or cache.device != w.device or cache.batch != B:
            raise ValueError(
                f"cache is (batch {cache.batch}, {cache.dtype}, {cache.device}), the step needs (batch {B}, "
                f"{w.dtype}, {w.device}): the model's dtype and device, idx's batch"
            )
        if not check_position(pos, idx.device, "idx's device"):
            if kv_len is None:
                raise ValueError(
                    f"with a tensor pos, give kv_len (a Python int, the cache positions attention "
                    f"reads): kv_bucket(pos + {n}, {cache.max_len})"
                )
            positions, exact = pos.reshape(1) + torch.arange(n, device=pos.device), False
            capturing = pos.is_cuda and torch.cuda.is_current_stream_capturing()
            host_pos = None if capturing else int(pos)  # int(pos) syncs: checked in eager use only
        else:
            host_pos, kv_len = pos, pos + n if kv_len is None else kv_len
            positions, exact = torch.arange(pos, pos + n, device=idx.device), kv_len == pos + n
        if host_pos is not None and not (0 <= host_pos and host_pos + n <= cache.max_len):
            raise ValueError(
                f"tokens at positions [{host_pos}, {host_pos + n}) do not fit the cache of max_len {cache.max_len}"
            )
        if not isinstance(kv_len, int) or not 1 <= kv_len <= cache.max_len:
            raise ValueError(f"kv_len must be an int in [1, the cache's max_len {cache.max_len}], got {kv_len!r}")
        # unknown during graph capture: kv_bucket's guarantee stands in for these two checks
        if host_pos is not None and host_pos + n > kv_len:
            raise ValueError(f"kv_len {kv_len} is shorter than the positions it must read, pos + n = {host_pos + n}")
        if host_pos is not None and not exact and kv_len - min(kv_len, DECODE_BUCKET) > host_pos:
            raise ValueError(
                f"kv_len {kv_len} reaches more than DECODE_BUCKET ({DECODE_BUCKET}) positions past pos {host_pos} "
                "(flash_over_cache's block of queries): use kv_bucket(pos + n, max_len)"
            )
        place = StepPlace(positions, kv_len, exact, None)
        c = self.config
        if c.impl == "kernel_lib" and n * (c.n_heads // c.n_kv_heads) <= DECODE_MAX_ROWS:
            # decode_attention's kv_len: a tensor, so a captured graph serves every position of its bucket
            return place._replace(lengths=(positions[-1:] + 1).to(torch.int32).expand(B).contiguous())
        if not exact:  # each query's row in flash_over_cache's block, once per step rather than once per layer
            place = place._replace(rows=positions - place.block_start)
        return place

    @torch.no_grad()
    def forward_step(self, idx: torch.Tensor, cache: KVCache, pos, kv_len: Optional[int] = None) -> torch.Tensor:
        """Logits (B, n, V) of tokens idx (B, n) at positions pos..pos+n-1, given the cache's keys and values of
        the positions before pos; writes the new keys and values into the cache (in place, no gradient).

        ``pos``: a Python int (prefill, eager decode), or a one-element int64 tensor on idx's device (the CUDA
        graph's decode step: the position is data). ``kv_len``: the cache positions attention reads, a Python int;
        default pos + n for an int pos; required with a tensor, which needs pos + n <= kv_len <= pos + 64 or
        kv_len <= 64 (``kv_bucket(pos + n, max_len)``; checked unless a CUDA graph is being captured).
        """
        place = self._check_step(idx, cache, pos, kv_len)
        x, delta = self.embed(idx), None
        for block, cache_k, cache_v in zip(self.blocks, cache.k, cache.v, strict=True):
            x, delta = block.step(x, delta, cache_k, cache_v, place)
        return self.head(add_norm(self.norm_f, x, delta)[0])

    def num_parameters(self) -> int:
        """All parameters, counted: the module docstring's N."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward and backward) per token at sequence length ``seq_len``: 6 N_m + 12 L d T.

        N_m counts the weights each token is multiplied by: per layer 2 d² + 2 d kv_dim (attention: q and o, k and
        v; 4 d² without grouped-query attention) and 3 d d_ff per expert it
        visits (top_k of them, plus the router's d E; 1 for a dense MLP), and the head's V d; not the embedding
        lookup or the norms. 12 L d T is the attention's scores and weighted sum (2 matmuls of 2 d T FLOPs per
        token forward, times 3 with backward), counting the whole T x T square as PaLM's appendix B does (a causal
        kernel computes about half). Sources: Kaplan et al. (2020) section 2.1; Chowdhery et al., PaLM (2022).
        """
        c = self.config
        mlp = 3 * c.d_model * c.d_ff * (c.top_k if c.n_experts else 1) + c.d_model * c.n_experts
        attention = 2 * c.d_model**2 + 2 * c.d_model * c.kv_dim  # q and o, k and v
        matmul_weights = c.n_layers * (attention + mlp) + c.vocab_size * c.d_model
        return 6 * matmul_weights + 12 * c.n_layers * c.d_model * seq_len


# --------------------------------------------------------------------------------------------------
# Weights across versions: the naive layout is the common currency
# --------------------------------------------------------------------------------------------------
_FUSED = {  # native/kernel_lib parameter within a block -> its naive parts, concatenated along dim 0
    "attn.qkv.weight": ("attn.q.weight", "attn.k.weight", "attn.v.weight"),
    "mlp.gate_up.weight": ("mlp.gate.weight", "mlp.up.weight"),
}
_STACKED = {  # stacked expert weight (E, in, out) -> each naive expert's nn.Linear weight (out, in), transposed
    "mlp.w_gate": "gate.weight",
    "mlp.w_up": "up.weight",
    "mlp.w_down": "down.weight",
}


def _naive_shapes(config: GPTConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight of the naive version, in the fixed order the initialization draws them."""
    d, d_ff, V, E = config.d_model, config.d_ff, config.vocab_size, config.n_experts
    yield "embed.weight", (V, d)
    for i in range(config.n_layers):
        p = f"blocks.{i}."
        yield p + "attn_norm.weight", (d,)
        for proj, rows in zip("qkvo", (d, config.kv_dim, config.kv_dim, d), strict=True):
            yield f"{p}attn.{proj}.weight", (rows, d)
        yield p + "mlp_norm.weight", (d,)
        if E:
            yield p + "mlp.router.weight", (E, d)
        for mlp in [f"{p}mlp.experts.{e}." for e in range(E)] if E else [p + "mlp."]:
            yield mlp + "gate.weight", (d_ff, d)
            yield mlp + "up.weight", (d_ff, d)
            yield mlp + "down.weight", (d, d_ff)
    yield "norm_f.weight", (d,)
    yield "head.weight", (V, d)


def _split_block_name(name: str) -> tuple[str, str]:
    """'blocks.3.attn.qkv.weight' -> ('blocks.3.', 'attn.qkv.weight'); other names -> ('', name)."""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"blocks.{i}.", rest
    return "", name


def _unwrap(model: nn.Module) -> GPT:
    """The GPT itself, also behind torch.compile (whose module prefixes every name with ``_orig_mod.``)."""
    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, GPT):
        raise TypeError(f"expected a GPT (or a compiled one), got {type(model).__name__}")
    return model


def naive_layout(model: GPT, grads: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights (``grads``: their gradients, zeros where None) in the naive layout, under the naive
    names and in ``_naive_shapes``' order; views of the parameters where the layouts agree. ``model`` may be
    compiled."""
    model = _unwrap(model)
    shapes = dict(_naive_shapes(model.config))
    out = {}
    for name, param in model.named_parameters():
        t = param.detach() if not grads else (param.grad if param.grad is not None else torch.zeros_like(param))
        prefix, rest = _split_block_name(name)
        if rest in _FUSED:
            rows = [shapes[prefix + part][0] for part in _FUSED[rest]]  # q, k, v differ with grouped-query attention
            for part, chunk in zip(_FUSED[rest], t.split(rows), strict=True):
                out[prefix + part] = chunk
        elif rest in _STACKED:
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.{_STACKED[rest]}"] = t[e].T
        else:
            out[name] = t
    return {name: out[name] for name in shapes}


def _load_naive_layout(model: GPT, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` (naive layout and names) into ``model``'s parameters, whatever its version."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            prefix, rest = _split_block_name(name)
            if rest in _FUSED:
                src = torch.cat([weights[prefix + part] for part in _FUSED[rest]])
            elif rest in _STACKED:
                experts = range(param.shape[0])
                src = torch.stack([weights[f"{prefix}mlp.experts.{e}.{_STACKED[rest]}"].T for e in experts])
            else:
                src = weights[name]
            if src.shape != param.shape:  # copy_ would broadcast a wrong shape silently
                raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(src.shape)}")
            param.copy_(src)


def transfer_weights(src: GPT, dst: GPT) -> None:
    """Copy every weight of ``src`` into ``dst``, any two versions of one configuration (impl may differ):
    q, k, v and gate, up are concatenated or split, experts stacked or unstacked; dtype and device follow ``dst``.
    Either may be compiled."""
    src, dst = _unwrap(src), _unwrap(dst)
    same = dataclasses.replace(src.config, impl=dst.config.impl)
    if same != dst.config:
        differ = [f.name for f in dataclasses.fields(same) if getattr(same, f.name) != getattr(dst.config, f.name)]
        raise ValueError(f"src and dst configs differ beyond impl, in: {', '.join(differ)}")
    _load_naive_layout(dst, naive_layout(src))
