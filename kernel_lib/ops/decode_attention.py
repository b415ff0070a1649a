"""Attention of a decoding step over a KV cache in Triton, with the keys split across programs (FlashDecoding).

    out[b, h, t] = softmax_j(q[b, h, t] . k[b, h // G, j] * scale) v[b, h // G, j],   j <= kv_len[b] - n + t

q (B, Hq, n, D) holds the step's n queries (n = 1 when decoding one token at a time; a few with speculative
decoding), the last n positions of each sequence; the caches k (B, Hkv, L, D) and v (B, Hkv, L, Dv) hold L
positions, of which each sequence uses its first kv_len[b]. G = Hq / Hkv query heads share a key/value head (GQA).

A decoding step reads the whole cache to produce B * Hq * n rows of output. One program per (batch, head) would
leave most of a GPU idle at batch 1 (32 heads on 132 SMs) while each program streams 32k keys alone. So the keys
are split into S chunks, a program per (batch, key/value head, chunk), S chosen to fill the GPU from B, Hkv and
the cache's capacity L (not kv_len: the grid then never depends on a value on the GPU, and a CUDA graph captured
once serves every step). Each program loads the G * n query rows of its key/value head once (the key and value
tiles are read once for all of them), runs the online softmax over its chunk and writes its unnormalized
output with its running maximum m_s and sum l_s (base 2). A second kernel combines the chunks the way the
online softmax combines blocks:

    m = max_s m_s,   l = sum_s l_s 2^(m_s - m),   out = sum_s acc_s 2^(m_s - m) / l

Chunks past a sequence's kv_len (read from the GPU by the kernels) do nothing and count as m_s = -inf, l_s = 0.
A query that sees no key gets 0, as in ``flash_attention``. Inference only (no autograd).

Registered as the ``kernel_lib::decode_attention`` custom op with a fake implementation, so
``torch.compile(fullgraph=True)`` traces through it. Sources: Dao, Haziza, Massa, Sizov, "Flash-Decoding for
long-context inference" (2023); Milakov & Gimelshein (2018) for the online softmax.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import check_same_device, check_same_dtype, check_tensor, is_interpreting, launch_or_op, use_triton

__all__ = ["decode_attention", "decode_attention_ref"]

LOG2E = 1.4426950408889634
MAX_ROWS = 128  # G * n query rows a key/value head: what one program holds (a tile of the dot)


def decode_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len, scale: Optional[float] = None
) -> torch.Tensor:
    """The definition with an explicit mask, in float32 (float64 for float64 input), out in q's dtype."""
    B, Hq, n, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    lengths = torch.as_tensor(kv_len, device=q.device).expand(B).clamp(0, L)
    group = Hq // Hkv
    kf = k.to(compute).repeat_interleave(group, 1)
    vf = v.to(compute).repeat_interleave(group, 1)
    scores = (q.to(compute) @ kf.transpose(-1, -2)) * (D**-0.5 if scale is None else scale)  # (B, Hq, n, L)
    positions = lengths[:, None] - n + torch.arange(n, device=q.device)  # (B, n): each query's position
    visible = torch.arange(L, device=q.device) <= positions[:, :, None]  # (B, n, L)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees no key: 0
    return (probs @ vf).to(q.dtype)


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------
def _splits(B: int, Hkv: int, L: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(chunks, keys a chunk): about two programs per SM over B * Hkv heads, a chunk at least a key tile."""
    tiles = triton.cdiv(L, block_n)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    chunks = max(1, min(tiles, triton.cdiv(2 * sms, B * Hkv)))
    per_chunk = triton.cdiv(tiles, chunks) * block_n
    return triton.cdiv(L, per_chunk), per_chunk


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _decode_split_kernel(
    q_ptr,  # (B, Hq, n, D) queries, unit stride along D
    k_ptr,  # (B, Hkv, L, D) key cache, unit stride along D
    v_ptr,  # (B, Hkv, L, Dv) value cache, unit stride along Dv
    len_ptr,  # (B,) int32: keys each sequence uses (clamped to [0, L] here)
    acc_ptr,  # output (B * Hkv, S, BLOCK_R, BLOCK_DV) float32: each chunk's unnormalized output
    ml_ptr,  # output (B * Hkv, S, 2, BLOCK_R) float32: each chunk's running maximum (base 2), then its sum
    sqb, sqh, sqn,  # q's strides: batch, head, query
    skb, skh, skn,  # k's strides: batch, head, position
    svb, svh, svn,  # v's strides
    Hkv, n, GROUP, L,  # key/value heads, queries a step, query heads a key/value head, cache capacity
    per_chunk,  # keys a chunk (a multiple of BLOCK_N)
    qk_scale,  # scale * log2(e): scores in base 2
    D, Dv,  # head dims of q and k, and of v
    BLOCK_R: tl.constexpr,  # query rows of a program, >= GROUP * n: row r is head GROUP * hk + r // n, query r % n
    BLOCK_N: tl.constexpr,  # keys a step
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,  # D and Dv padded to powers of two
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (the interpreter's bf16 dot is wrong)
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" for float32 inputs (not TF32), else "tf32"
):  # fmt: skip
    bh = tl.program_id(0)
    chunk = tl.program_id(1)
    b = bh // Hkv
    hk = bh % Hkv
    rows = tl.arange(0, BLOCK_R)
    heads = hk * GROUP + rows // n
    t = rows % n
    live = rows < GROUP * n
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + b.to(tl.int64) * sqb + heads.to(tl.int64) * sqh + t.to(tl.int64) * sqn
    q = tl.load(q_rows[:, None] + cols[None, :], mask=live[:, None] & (cols[None, :] < D), other=0.0)
    kv_len = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), L)
    position = kv_len - n + t  # each row's query sees keys j <= position
    lo = chunk * per_chunk
    hi = tl.minimum(lo + per_chunk, kv_len)
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    if DOT_FP32:
        q = q.to(tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + keys[:, None].to(tl.int64) * skn + cols[None, :],
                    mask=(keys[:, None] < hi) & (cols[None, :] < D), other=0.0)  # fmt: skip
        v = tl.load(v_base + keys[:, None].to(tl.int64) * svn + cols_v[None, :],
                    mask=(keys[:, None] < hi) & (cols_v[None, :] < Dv), other=0.0)  # fmt: skip
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where((keys[None, :] <= position[:, None]) & (keys[None, :] < hi), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: no NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    part = bh.to(tl.int64) * tl.num_programs(1) + chunk
    tl.store(acc_ptr + (part * BLOCK_R + rows[:, None]) * BLOCK_DV + cols_v[None, :], acc)
    tl.store(ml_ptr + part * 2 * BLOCK_R + rows, m_i)
    tl.store(ml_ptr + part * 2 * BLOCK_R + BLOCK_R + rows, l_i)


@triton.jit
def _decode_combine_kernel(
    acc_ptr,  # (B * Hkv, S, BLOCK_R, BLOCK_DV) float32 from the split kernel
    ml_ptr,  # (B * Hkv, S, 2, BLOCK_R) float32 from the split kernel
    out_ptr,  # output (B, Hq, n, Dv), contiguous, q's dtype
    S, Hkv, n, GROUP, Dv,  # chunks; key/value heads, queries a step, query heads a key/value head, v's head dim
    BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,  # as in the split kernel
    BLOCK_S: tl.constexpr,  # chunks padded to a power of two
):  # fmt: skip
    bh = tl.program_id(0)
    b = bh // Hkv
    hk = bh % Hkv
    rows = tl.arange(0, BLOCK_R)
    cols_v = tl.arange(0, BLOCK_DV)
    chunks = tl.arange(0, BLOCK_S)
    ml = ml_ptr + bh.to(tl.int64) * S * 2 * BLOCK_R
    m_all = tl.load(ml + chunks[:, None] * 2 * BLOCK_R + rows[None, :], mask=chunks[:, None] < S,
                    other=float("-inf"))  # fmt: skip
    l_all = tl.load(ml + chunks[:, None] * 2 * BLOCK_R + BLOCK_R + rows[None, :], mask=chunks[:, None] < S,
                    other=0.0)  # fmt: skip
    m = tl.max(m_all, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(l_all * tl.exp2(m_all - m_safe[None, :]), axis=0)
    out = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    acc = acc_ptr + bh.to(tl.int64) * S * BLOCK_R * BLOCK_DV
    for s in range(0, S):
        weight = tl.exp2(tl.load(ml + s * 2 * BLOCK_R + rows) - m_safe)  # a chunk that saw nothing: 0
        out += tl.load(acc + (s * BLOCK_R + rows[:, None]) * BLOCK_DV + cols_v[None, :]) * weight[:, None]
    out = tl.where(l[:, None] > 0, out / l[:, None], 0.0)  # a query that sees no key: 0
    heads = hk * GROUP + rows // n
    t = rows % n
    Hq = Hkv * GROUP
    out_rows = out_ptr + ((b.to(tl.int64) * Hq + heads) * n + t) * Dv
    tl.store(out_rows[:, None] + cols_v[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < GROUP * n) & (cols_v[None, :] < Dv))  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------
def _forward(q, k, v, kv_len, scale):
    B, Hq, n, D = q.shape
    Hkv, L, Dv = k.shape[1], k.shape[2], v.shape[-1]
    group = Hq // Hkv
    out = torch.empty((B, Hq, n, Dv), device=q.device, dtype=q.dtype)
    if out.numel() == 0:
        return out
    if L == 0:  # an empty cache: no query sees a key
        return out.zero_()
    interpreted = is_interpreting()
    block_r = max(16, triton.next_power_of_2(group * n))
    block_d, block_dv = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(Dv))
    wide = max(block_d, block_dv) >= 128
    block_n = 16 if interpreted else (64 if max(block_d, block_dv) <= 128 else 32)
    S, per_chunk = _splits(B, Hkv, L, block_n, q.device)
    acc = torch.empty((B * Hkv, S, block_r, block_dv), device=q.device, dtype=torch.float32)
    ml = torch.empty((B * Hkv, S, 2, block_r), device=q.device, dtype=torch.float32)
    _decode_split_kernel[(B * Hkv, S)](
        q, k, v, kv_len, acc, ml, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], Hkv, n, group, L, per_chunk,
        scale * LOG2E, D, Dv,
        BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, DOT_FP32=interpreted,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # 4 warps spill at head dim 128 (255 registers, ptxas for sm_90a); 2 stages keep D 256 in 100 KB of smem
        num_warps=8 if wide else 4, num_stages=1 if interpreted else (2 if max(block_d, block_dv) > 128 else 3),
    )  # fmt: skip
    _decode_combine_kernel[(B * Hkv,)](
        acc, ml, out, S, Hkv, n, group, Dv,
        BLOCK_R=block_r, BLOCK_DV=block_dv, BLOCK_S=triton.next_power_of_2(S), num_warps=4,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------
# torch.library registration: an opaque op with a fake implementation, what torch.compile records
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor, scale: float
) -> torch.Tensor:
    return _forward(q, k, v, kv_len, scale)


@_decode_attention_op.register_fake
def _(q, k, v, kv_len, scale):
    return q.new_empty((*q.shape[:3], v.shape[-1]))


# --------------------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------------------
def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len, scale: Optional[float] = None
) -> torch.Tensor:
    """Attention of a decoding step's queries q (B, Hq, n, D) over the caches k (B, Hkv, L, D), v (B, Hkv, L, Dv):
    query t of sequence b stands at position kv_len[b] - n + t and sees the cached keys up to it. ``kv_len``: an
    int, or an int tensor (B,) or () on q's device (not read on the host: a CUDA graph can capture the call;
    values outside [0, L] are clamped there). Hq a multiple of Hkv; G * n <= 128 query rows a key/value head;
    float16, bfloat16 or float32; any strides with a unit stride along the head dim. Returns (B, Hq, n, Dv) in
    q's dtype. Inference only: call it under ``torch.no_grad()``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, ndim=4)
    check_same_dtype(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v)
    B, Hq, n, D = q.shape
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[-1] != D:
        raise ValueError(f"k (B, Hkv, L, D) and v (B, Hkv, L, Dv) must match q {tuple(q.shape)}: "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")  # fmt: skip
    if Hq % k.shape[1]:
        raise ValueError(f"q's {Hq} heads are not a multiple of k's {k.shape[1]}")
    if (Hq // k.shape[1]) * n > MAX_ROWS:
        rows = (Hq // k.shape[1]) * n
        raise ValueError(f"{rows} query rows a key/value head (heads a group x queries): more than {MAX_ROWS}; "
                         "decode_attention is for a decoding step's few queries, use flash_attention")  # fmt: skip
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("q, k and v need a unit stride along the head dim")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("decode_attention is for inference (no autograd): call it under torch.no_grad()")
    if isinstance(kv_len, torch.Tensor):
        if kv_len.device != q.device or kv_len.dtype not in (torch.int32, torch.int64) or kv_len.numel() not in (1, B):
            raise ValueError(f"kv_len must be an int tensor of shape () or ({B},) on {q.device}, got "
                             f"{kv_len.dtype} {tuple(kv_len.shape)} on {kv_len.device}")  # fmt: skip
        lengths = kv_len.to(torch.int32).reshape(-1).expand(B).contiguous()
    else:
        if not 0 <= int(kv_len) <= k.shape[2]:
            raise ValueError(f"kv_len {kv_len} outside [0, {k.shape[2]}] (the cache's capacity)")
        lengths = torch.full((B,), int(kv_len), device=q.device, dtype=torch.int32)
    scale = D**-0.5 if scale is None else float(scale)
    if not use_triton(q, op="decode_attention"):  # CPU without the interpreter: the reference
        return decode_attention_ref(q, k, v, lengths, scale)
    return launch_or_op(_forward, _decode_attention_op)(q, k, v, lengths, scale)
