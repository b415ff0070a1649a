"""Rotary position embedding (RoPE) in Triton, rotate-half convention, forward and backward in one pass each.

With x (B, H, N, D), D even, split into halves x1 = x[..., :D/2] and x2 = x[..., D/2:], and cos, sin (N, D/2)::

    out[..., :D/2] = x1 * cos - x2 * sin
    out[..., D/2:] = x2 * cos + x1 * sin

Each (x1, x2) pair is rotated by the angle whose cosine and sine are given, so the backward is the rotation by the
opposite angle: the same kernel with sin negated. The kernel reads x once (and the small cos/sin tables, which
stay in cache) and writes out once; eager PyTorch materializes the two halves, their products and a concatenation.
Gradients for cos and sin (rarely trained) are computed with plain PyTorch when they require grad.

Registered as the ``kernel_lib::rope`` custom op with a fake implementation, which the one
``autograd.Function`` calls under torch.compile, so ``torch.compile(fullgraph=True)`` traces through it. Source:
Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021); the rotate-half layout is
GPT-NeoX's and Llama's.

``rope_to_cache`` is decoding's version (inference only, no autograd): for a step of n tokens at positions
pos..pos+n-1 with q (B, H, n, D) and k, v (B, Hkv, n, D) sliced from the qkv projection, one kernel

    reads the tables' rows at those positions     (no gathered copy of cos and sin)
    writes rope(k) and v into cache_k, cache_v    (B, Hkv, S, D) at those positions
    returns rope(q) in a block of R >= n rows     (B, H, R, D): token t at row pos + t - block_start, other rows 0

where an unfused step runs a gather per table, a rotation per tensor, a cache write per tensor and, for the
query block of ``kernel_lib.models.gpt.flash_over_cache``, a fill and a scatter. pos may be a one-element tensor
(a CUDA graph's step: the position is data). It does the same float32 arithmetic as ``rope``, so a decoder that
calls it rotates exactly as one that calls ``rope`` (bit for bit on the same GPU).
"""

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import check_same_device, check_same_dtype, check_shape, check_tensor, launch_or_op, use_triton

__all__ = ["rope", "rope_ref", "rope_cos_sin", "rope_to_cache", "rope_to_cache_ref"]

BLOCK_N = 16  # positions per program
CACHE_BLOCK_T = 16  # rope_to_cache: tokens (or block rows) per program


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The definition, in plain PyTorch: computed in float32 (float64 for float64 input), returned in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(compute).chunk(2, dim=-1)  # (B, H, N, D/2) each
    c, s = cos.to(compute), sin.to(compute)  # (N, D/2), broadcast over B and H
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope_cos_sin(n: int, dim: int, base: float = 10000.0, device=None, dtype=torch.float32):
    """The standard tables: angle[n, i] = n / base**(2i / dim), for positions 0..n-1; returns (cos, sin), (n, dim/2)."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
    angles = torch.arange(n, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (n, dim/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_to_cache_ref(q, k, v, cos, sin, pos, cache_k, cache_v, block_rows=None, block_start=None):
    """rope_to_cache's definition in plain PyTorch (index ops on a position tensor: no host sync)."""
    n = q.shape[2]
    pos, block_rows, block_start = _cache_place(pos, q, n, block_rows, block_start)
    positions = pos.reshape(1) + torch.arange(n, device=q.device)  # (n,)
    c, s = cos.index_select(0, positions), sin.index_select(0, positions)  # (n, D/2)
    cache_k.index_copy_(2, positions, rope_ref(k, c, s))
    cache_v.index_copy_(2, positions, v)
    block = q.new_zeros(q.shape[0], q.shape[1], block_rows, q.shape[3])
    rows = positions - (pos if block_start is None else block_start)
    return block.index_copy_(2, rows, rope_ref(q, c, s))


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _rope_kernel(
    x_ptr,  # input (B, H, N, D), unit stride along D
    cos_ptr,  # (N, D/2) contiguous
    sin_ptr,  # (N, D/2) contiguous
    out_ptr,  # output (B, H, N, D) contiguous, x's dtype
    stride_b,  # elements between batches of x
    stride_h,  # elements between heads of x
    stride_n,  # elements between positions of x
    H,  # heads
    N,  # positions
    HALF: tl.constexpr,  # D / 2, a model constant: compiled in, so the halves' offsets are known
    SIN_SIGN: tl.constexpr,  # 1.0 forward; -1.0 backward (rotation by the opposite angle)
    BLOCK_N: tl.constexpr,  # positions per program
    BLOCK_HALF: tl.constexpr,  # power of two >= D / 2
):
    bh = tl.program_id(0).to(tl.int64)  # one (batch, head) pair per row of the grid
    b, h = bh // H, bh % H
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, BLOCK_HALF)
    mask = (n[:, None] < N) & (i[None, :] < HALF)
    x_rows = x_ptr + b * stride_b + h * stride_h + n[:, None].to(tl.int64) * stride_n
    x1 = tl.load(x_rows + i[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    # Every (batch, head) program re-reads its block of the tables; they stay in L2. Loading the block once for
    # several heads measured no faster (benchmarks/NOTES.md).
    c = tl.load(cos_ptr + n[:, None] * HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    s = SIN_SIGN * tl.load(sin_ptr + n[:, None] * HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    out_rows = out_ptr + (bh * N + n[:, None].to(tl.int64)) * (2 * HALF)
    tl.store(out_rows + i[None, :], (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_rows + HALF + i[None, :], (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_cache_kernel(
    q_ptr,  # queries (B, H, n, D), unit stride along D
    k_ptr,  # keys (B, Hkv, n, D), unit stride along D
    v_ptr,  # values (B, Hkv, n, D), unit stride along D
    cos_ptr,  # table (L, D/2) contiguous: row p holds position p's angles
    sin_ptr,  # table (L, D/2) contiguous
    pos_ptr,  # (1,) int64: the position of token 0; token t sits at pos + t
    cache_k_ptr,  # key cache (B, Hkv, S, D) contiguous, written at the tokens' positions
    cache_v_ptr,  # value cache (B, Hkv, S, D) contiguous
    block_ptr,  # output (B, H, R, D) contiguous: the rotated queries, token t at row pos + t - BLOCK_START
    stride_qb,  # elements between batches of q
    stride_qh,  # elements between heads of q
    stride_qn,  # elements between tokens of q
    stride_kb,  # the same three for k
    stride_kh,
    stride_kn,
    stride_vb,  # and for v
    stride_vh,
    stride_vn,
    H,  # query heads
    HKV,  # key/value heads
    N,  # tokens in this step
    R,  # rows of the query block
    S,  # positions in the cache
    L,  # rows of the tables
    BLOCK_START,  # the position that block row 0 stands for (unless FROM_POS)
    FROM_POS: tl.constexpr,  # block row 0 stands for pos (a tensor pos, the block = the rotated queries)
    HALF: tl.constexpr,  # D / 2
    BLOCK_T: tl.constexpr,  # tokens or block rows per program
    BLOCK_HALF: tl.constexpr,  # power of two >= D / 2
):
    # Programs along axis 0 are (batch, head) pairs over H query heads then HKV key/value heads; along axis 1,
    # blocks of BLOCK_T rows of the query block (query heads) or of tokens (key/value heads).
    head = tl.program_id(0)
    b, h = (head // (H + HKV)).to(tl.int64), head % (H + HKV)
    p0 = tl.load(pos_ptr)
    r = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # row * stride passes 2**31 in long prefills
    i = tl.arange(0, BLOCK_HALF)
    col = i[None, :] < HALF
    if h < H:  # a query head: every row of the block is written, rows without a token as zeros
        if FROM_POS:
            t = r  # the token that row r holds, if 0 <= t < N
        else:
            t = r + (BLOCK_START - p0)
        pos = p0 + t
        ok = ((r < R) & (t >= 0) & (t < N) & (pos >= 0) & (pos < L))[:, None] & col
        q_src = q_ptr + b * stride_qb + h * stride_qh + t[:, None] * stride_qn
        x1 = tl.load(q_src + i[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(q_src + HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos[:, None] * HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos[:, None] * HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
        out = block_ptr + ((b * H + h) * R + r[:, None]) * (2 * HALF)
        keep = (r < R)[:, None] & col
        tl.store(out + i[None, :], (x1 * c - x2 * s).to(block_ptr.dtype.element_ty), mask=keep)
        tl.store(out + HALF + i[None, :], (x2 * c + x1 * s).to(block_ptr.dtype.element_ty), mask=keep)
    else:  # a key/value head: the step's tokens, rotated keys and plain values into the cache
        kh = h - H
        pos = p0 + r
        # a token outside the cache or the tables is not written (forward_step checks the bounds in eager use)
        ok = ((r < N) & (pos >= 0) & (pos < S) & (pos < L))[:, None] & col
        k_src = k_ptr + b * stride_kb + kh * stride_kh + r[:, None] * stride_kn
        x1 = tl.load(k_src + i[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(k_src + HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos[:, None] * HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos[:, None] * HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
        at = ((b * HKV + kh) * S + pos[:, None]) * (2 * HALF)  # the row's offset in either cache
        tl.store(cache_k_ptr + at + i[None, :], (x1 * c - x2 * s).to(cache_k_ptr.dtype.element_ty), mask=ok)
        tl.store(cache_k_ptr + at + HALF + i[None, :], (x2 * c + x1 * s).to(cache_k_ptr.dtype.element_ty), mask=ok)
        v_src = v_ptr + b * stride_vb + kh * stride_vh + r[:, None] * stride_vn
        tl.store(cache_v_ptr + at + i[None, :], tl.load(v_src + i[None, :], mask=ok, other=0.0), mask=ok)
        tl.store(cache_v_ptr + at + HALF + i[None, :], tl.load(v_src + HALF + i[None, :], mask=ok, other=0.0), mask=ok)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    # The tables are made contiguous, so the kernel indexes them by D/2, a compile-time constant.
    B, H, N, D = x.shape
    out = torch.empty((B, H, N, D), device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    stride_b, stride_h, stride_n, stride_d = x.stride()
    if stride_d != 1:
        x = x.contiguous()
        stride_b, stride_h, stride_n, _ = x.stride()
    cos = cos if cos.is_contiguous() else cos.contiguous()  # (N, D/2): a small copy, and a rare one
    sin = sin if sin.is_contiguous() else sin.contiguous()
    half = D // 2
    _rope_kernel[(B * H, (N + BLOCK_N - 1) // BLOCK_N)](
        x, cos, sin, out, stride_b, stride_h, stride_n, H, N,
        HALF=half, SIN_SIGN=-1.0 if inverse else 1.0, BLOCK_N=BLOCK_N, BLOCK_HALF=_block_half(half), num_warps=4,
    )  # fmt: skip
    return out


def _to_cache(q, k, v, cos, sin, pos, cache_k, cache_v, block_rows: int, block_start: Optional[int]) -> torch.Tensor:
    B, H, n, D = q.shape
    HKV, S = cache_k.shape[1], cache_k.shape[2]
    block = torch.empty((B, H, block_rows, D), device=q.device, dtype=q.dtype)
    if B == 0 or H + HKV == 0:
        return block
    cos = cos if cos.is_contiguous() else cos.contiguous()
    sin = sin if sin.is_contiguous() else sin.contiguous()
    half = D // 2
    grid = (B * (H + HKV), triton.cdiv(max(block_rows, n, 1), CACHE_BLOCK_T))
    _rope_cache_kernel[grid](
        q, k, v, cos, sin, pos, cache_k, cache_v, block, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        H, HKV, n, block_rows, S, cos.shape[0], 0 if block_start is None else block_start,
        FROM_POS=block_start is None, HALF=half, BLOCK_T=CACHE_BLOCK_T, BLOCK_HALF=_block_half(half), num_warps=4,
    )  # fmt: skip
    return block


@functools.cache
def _block_half(half: int) -> int:
    return triton.next_power_of_2(half)


def _table_grads(dy, x, need_cos, need_sin):
    """dcos = sum over B, H of dy1 x1 + dy2 x2;  dsin = sum over B, H of x1 dy2 - x2 dy1 (float32)."""
    if not (need_cos or need_sin):  # the usual case (fixed tables): float32 copies of dy and x cost more than
        return None, None  # the rotation itself
    dy1, dy2 = dy.float().chunk(2, dim=-1)  # (B, H, N, D/2) each
    x1, x2 = x.float().chunk(2, dim=-1)
    dcos = (dy1 * x1 + dy2 * x2).sum(dim=(0, 1)) if need_cos else None  # (N, D/2)
    dsin = (x1 * dy2 - x2 * dy1).sum(dim=(0, 1)) if need_sin else None
    return dcos, dsin


# --------------------------------------------------------------------------------------------------
# torch.library registration: an opaque op with a fake implementation, what torch.compile records
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::rope", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    return _rotate(x, cos, sin, inverse)


@_rope_op.register_fake
def _(x, cos, sin, inverse):
    return x.new_empty(x.shape)


@torch.library.custom_op("kernel_lib::rope_to_cache", mutates_args=("cache_k", "cache_v"))
def _rope_to_cache_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    block_rows: int,
    block_start: Optional[int],
) -> torch.Tensor:
    return _to_cache(q, k, v, cos, sin, pos, cache_k, cache_v, block_rows, block_start)


@_rope_to_cache_op.register_fake
def _(q, k, v, cos, sin, pos, cache_k, cache_v, block_rows, block_start):
    return q.new_empty(q.shape[0], q.shape[1], block_rows, q.shape[3])


# --------------------------------------------------------------------------------------------------
# Autograd: the launcher in eager mode, the op under torch.compile (see _utils.launch_or_op); the backward is
# the same rotation by the opposite angle
# --------------------------------------------------------------------------------------------------
class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        tables_need_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(x if tables_need_grad else None, cos, sin)  # x only for the tables' gradients
        return launch_or_op(_rotate, _rope_op)(x, cos, sin, False)

    @staticmethod
    def backward(ctx, dy):
        x, cos, sin = ctx.saved_tensors
        dx = launch_or_op(_rotate, _rope_op)(dy, cos, sin, True)
        dcos, dsin = _table_grads(dy, x, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        return (
            dx,
            (dcos.to(cos.dtype) if dcos is not None else None),
            (dsin.to(sin.dtype) if dsin is not None else None),
        )


# --------------------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------------------
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, N, D) by the angles of cos, sin (N, D/2), rotate-half convention; returns x's dtype.

    x may have any strides (e.g. q and k sliced from a fused QKV projection); D must be even.
    """
    check_tensor(x, "x", ndim=4)
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"the rotary dim (x's last dim) must be even, got {D}")
    check_tensor(cos, "cos", ndim=2)
    check_tensor(sin, "sin", ndim=2)
    check_shape(cos, "cos", (x.shape[2], D // 2))
    check_shape(sin, "sin", (x.shape[2], D // 2))
    check_same_device(x=x, cos=cos, sin=sin)
    if not use_triton(x, op="rope"):  # CPU without the interpreter: the reference, differentiated by autograd
        return rope_ref(x, cos, sin)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad)
    if not needs_grad and not torch.compiler.is_compiling():
        return _rotate(x, cos, sin, inverse=False)  # eager inference: no autograd node to build
    return _Rope.apply(x, cos, sin)


def check_position(pos, device: torch.device, where: str) -> bool:
    """A decode step's position: a Python int (True), or one int64 element on ``device`` (False: a CUDA graph's step,
    where the position is data); ValueError otherwise, naming ``where`` the tensor should live."""
    if isinstance(pos, int) and not isinstance(pos, bool):
        return True
    if not isinstance(pos, torch.Tensor):
        raise ValueError(f"pos must be a Python int or a one-element int64 tensor, got {type(pos).__name__}")
    if pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != device:
        raise ValueError(
            f"a tensor pos must be one int64 element on {where} ({device}), got {pos.dtype} {tuple(pos.shape)} "
            f"on {pos.device}"
        )
    return False


def _cache_place(pos, q: torch.Tensor, n: int, block_rows, block_start) -> tuple[torch.Tensor, int, Optional[int]]:
    """pos as a (1,) int64 tensor on q's device, and the block's rows and start with their defaults filled in
    (block_start None: a tensor pos whose block is the n rotated queries, row t for token t)."""
    if check_position(pos, q.device, "q's device"):
        block_start = pos if block_start is None else block_start
        pos = torch.tensor([pos], dtype=torch.int64, device=q.device)
    block_rows = n if block_rows is None else block_rows
    if not isinstance(block_rows, int) or block_rows < n:
        raise ValueError(f"block_rows must be an int >= the step's {n} tokens, got {block_rows!r}")
    if block_start is None and block_rows != n:  # a tensor pos: the block is the rotated queries themselves
        raise ValueError("with a tensor pos and block_rows, give block_start (a Python int): the position of row 0")
    if block_start is not None and not isinstance(block_start, int):
        raise ValueError(f"block_start must be a Python int, got {type(block_start).__name__}")
    return pos.reshape(1), block_rows, block_start


def rope_to_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    block_rows: int | None = None,
    block_start: int | None = None,
) -> torch.Tensor:
    """A decoding step's RoPE and KV-cache write in one kernel (the module docstring's last part); no autograd.

    q (B, H, n, D), k and v (B, Hkv, n, D): the step's projections (any strides with unit stride along D, e.g.
    views of a fused qkv output); cos, sin (L, D/2): the whole tables, indexed by position; pos: the first
    token's position, a Python int or a one-element int64 tensor (token t sits at pos + t); cache_k, cache_v
    (B, Hkv, S, D) contiguous, written in place at positions pos..pos+n-1. Returns the rotated queries in a
    (B, H, block_rows, D) block, token t at row pos + t - block_start, rows holding no token zero. Defaults:
    block_rows n, block_start pos, i.e. the rotated q itself (with a tensor pos too: block_rows and block_start
    both left out).

    Positions outside the cache or the tables, and rows outside the block: with an int pos they are refused here;
    a tensor pos is read on the device only, so the caller guarantees them (the kernel skips such tokens rather
    than write out of bounds; the reference, made of index ops, raises).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, ndim=4)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dim (head_dim), got strides {t.stride()}")
    B, H, n, D = q.shape
    if D % 2 or D == 0:
        raise ValueError(f"the head dim (q's last dim) must be even and positive, got {D}")
    HKV = k.shape[1]
    for name, t in (("k", k), ("v", v)):
        check_shape(t, name, (B, HKV, n, D))
    check_tensor(cos, "cos", ndim=2)
    check_tensor(sin, "sin", ndim=2)
    if cos.shape[1] != D // 2 or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be (L, {D // 2}) tables, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    for name, c in (("cache_k", cache_k), ("cache_v", cache_v)):
        check_tensor(c, name, ndim=4)
        if c.shape[0] != B or c.shape[1] != HKV or c.shape[3] != D or not c.is_contiguous():
            raise ValueError(f"{name} must be a contiguous (B={B}, Hkv={HKV}, S, D={D}) cache, got {tuple(c.shape)}")
    if cache_v.shape != cache_k.shape:
        raise ValueError(f"cache_k and cache_v must have one shape, got {tuple(cache_k.shape)}, {tuple(cache_v.shape)}")
    if cache_k.numel() and cache_k.data_ptr() == cache_v.data_ptr():
        raise ValueError("cache_k and cache_v must be two tensors, not one (each is written in place)")
    check_same_dtype(q=q, k=k, v=v, cache_k=cache_k, cache_v=cache_v)
    check_same_device(q=q, k=k, v=v, cos=cos, sin=sin, cache_k=cache_k, cache_v=cache_v)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, cos, sin)):
        raise ValueError("rope_to_cache is for inference (no autograd): call it under torch.no_grad()")
    host_pos = pos if isinstance(pos, int) and not isinstance(pos, bool) else None
    pos, block_rows, block_start = _cache_place(pos, q, n, block_rows, block_start)
    if host_pos is not None:
        S, L = cache_k.shape[2], cos.shape[0]
        if host_pos < 0 or host_pos + n > min(S, L):
            raise ValueError(
                f"positions [{host_pos}, {host_pos + n}) do not fit the cache ({S} positions) and tables ({L} rows)"
            )
        if host_pos - block_start < 0 or host_pos + n - block_start > block_rows:
            raise ValueError(
                f"tokens at positions [{host_pos}, {host_pos + n}) fall outside the block of {block_rows} rows "
                f"starting at position {block_start}"
            )
    if not use_triton(q, op="rope_to_cache"):  # CPU without the interpreter: the reference
        return rope_to_cache_ref(q, k, v, cos, sin, pos, cache_k, cache_v, block_rows, block_start)
    return launch_or_op(_to_cache, _rope_to_cache_op)(q, k, v, cos, sin, pos, cache_k, cache_v, block_rows, block_start)
