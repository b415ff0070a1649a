"""The Triton kernels of kernel_lib.attention (flash attention forward, and its dK/dV and dQ backward kernels).

Split from ``attention.py``, which holds the definition, launchers, registration and API and documents the
algorithm; copy both files (and ``_utils.py``) together.
"""

import triton
import triton.language as tl

from ._utils import configs_for_autotune, prune_by_shared_memory

LOG2E = 1.4426950408889634  # log2(e), for host code; kernels spell the literal (jit globals must be constexpr)


# --------------------------------------------------------------------------------------------------
# Configs: pruned by shared memory (q tile + double-buffered k and v tiles), one config when interpreting
# --------------------------------------------------------------------------------------------------
def _smem_bytes(config, args) -> int:
    d = args.get("HEAD_DIM", 128)
    m, n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    return 2 * d * (m + 2 * n * max(1, config.num_stages - 1))


_FWD_CONFIGS = [
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=2),  # first: runs anywhere, interpreted
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=4),
]


@triton.jit
def _load_kv(k_base, v_base, offs_n, offs_d, skn, svn, M, DOT_FP32: tl.constexpr):
    """One (BLOCK_N, HEAD_DIM) tile each of k and v; rows past M read as 0; upcast when the dot needs float32."""
    kv_mask = offs_n[:, None] < M
    k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _mask_scores(s, offs_m, offs_n, N, M, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, WINDOW_SIZE):
    """-inf where key offs_n is out of range or not visible to query offs_m (bottom-right aligned)."""
    visible = offs_n[None, :] < M
    pos = offs_m[:, None] + (M - N)
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= pos)
    if WINDOW:
        visible = visible & (offs_n[None, :] > pos - WINDOW_SIZE)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _key_range(start_m, N, M, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, WINDOW_SIZE):
    """[lo, hi): the keys any query of this block can see; blocks outside are skipped entirely."""
    lo = 0
    hi = M
    if CAUSAL:
        hi = tl.minimum(M, tl.maximum(0, start_m + BLOCK_M + M - N))
    if WINDOW:
        lo = tl.maximum(0, start_m + M - N - WINDOW_SIZE + 1)
    return lo, hi


@triton.autotune(
    configs=configs_for_autotune(_FWD_CONFIGS),
    key=["N", "M", "HEAD_DIM", "CAUSAL", "WINDOW"],
    prune_configs_by={"early_config_prune": prune_by_shared_memory(_smem_bytes)},
)
@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, Hq, N, D), (B, Hkv, M, D), (B, Hkv, M, D); unit stride along D
    out_ptr,  # (B, Hq, N, D) contiguous, q's dtype
    lse_ptr,  # (B, Hq, N) float32, natural log
    sqb, sqh, sqn,  # q strides: batch, head, position
    skb, skh, skn,  # k strides
    svb, svh, svn,  # v strides
    Hq, N, M,  # query heads, query length, key length
    GROUP,  # query heads per key/value head
    qk_scale,  # scale * log2(e): scores are kept in base 2
    WINDOW_SIZE,  # window length W (used when WINDOW)
    HEAD_DIM: tl.constexpr,  # D
    CAUSAL: tl.constexpr,  # bottom-right causal mask
    WINDOW: tl.constexpr,  # sliding window on top of causal
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (the interpreter's bf16 dot is wrong)
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per step
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // Hq, bh % Hq
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    q = tl.load(q_base + offs_m[:, None] * sqn + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of base-2 scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of 2^(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # unnormalized output
    lo, hi = _key_range(start_m, N, M, BLOCK_M, CAUSAL, WINDOW, WINDOW_SIZE)
    lo = (lo // BLOCK_N) * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv(k_base, v_base, offs_n, offs_d, skn, svn, M, DOT_FP32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), base 2
        s = _mask_scores(s, offs_m, offs_n, N, M, CAUSAL, WINDOW, WINDOW_SIZE)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    row = bh.to(tl.int64) * N + offs_m
    tl.store(
        out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < N
    )
    tl.store(lse_ptr + row, lse, mask=offs_m < N)


_BWD_CONFIGS = [
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=2),  # first: runs anywhere, interpreted
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
]


@triton.jit
def _probs(q, k, lse, offs_m, offs_n, N, M, scale, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, WINDOW_SIZE):
    """softmax probabilities of one (BLOCK_M, BLOCK_N) tile, recomputed from the forward's log-sum-exp."""
    s = _mask_scores(tl.dot(q, tl.trans(k)) * scale, offs_m, offs_n, N, M, CAUSAL, WINDOW, WINDOW_SIZE)
    return tl.where(s == float("-inf"), 0.0, tl.exp(s - lse[:, None]))  # 0, not NaN, where lse is -inf too


@triton.autotune(
    configs=configs_for_autotune(_BWD_CONFIGS),
    key=["N", "M", "HEAD_DIM", "CAUSAL", "WINDOW"],
    prune_configs_by={"early_config_prune": prune_by_shared_memory(_smem_bytes)},
)
@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # q (B, Hq, N, D), k and v (B, Hkv, M, D), dout (B, Hq, N, D) contiguous
    lse_ptr, delta_ptr,  # (B, Hq, N) float32: forward log-sum-exp; rowsum(dout * out)
    dk_ptr, dv_ptr,  # outputs (B, Hkv, M, D) contiguous
    sqb, sqh, sqn,  # q strides
    skb, skh, skn,  # k strides
    svb, svh, svn,  # v strides
    Hq, Hkv, N, M, GROUP,  # heads, lengths, query heads per key/value head
    scale,  # softmax scale
    WINDOW_SIZE,  # window length W (used when WINDOW)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per step
    BLOCK_N: tl.constexpr,  # keys per program
):  # fmt: skip
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b, hk = bhk // Hkv, bhk % Hkv
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_mask = offs_n[:, None] < M
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    k, v = _load_kv(k_base, v_base, offs_n, offs_d, skn, svn, M, DOT_FP32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # Queries that can see any key of this block (bottom-right alignment, offset M - N).
    q_lo = 0
    q_hi = N
    if CAUSAL:
        q_lo = tl.maximum(0, start_n - (M - N))
    if WINDOW:
        q_hi = tl.minimum(N, tl.maximum(0, start_n + BLOCK_N - 1 - (M - N) + WINDOW_SIZE))
    q_lo = (q_lo // BLOCK_M) * BLOCK_M
    for g in range(0, GROUP):  # every query head reading this key/value head
        h = hk * GROUP + g
        q_base = q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        row_base = (b * Hq + h).to(tl.int64) * N
        for start_m in range(q_lo, q_hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_mask = offs_m[:, None] < N
            q = tl.load(q_base + offs_m[:, None] * sqn + offs_d[None, :], mask=q_mask, other=0.0)
            do = tl.load(do_ptr + (row_base + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(lse_ptr + row_base + offs_m, mask=offs_m < N, other=0.0)
            delta = tl.load(delta_ptr + row_base + offs_m, mask=offs_m < N, other=0.0)
            if DOT_FP32:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            p = _probs(q, k, lse, offs_m, offs_n, N, M, scale, CAUSAL, WINDOW, WINDOW_SIZE)  # (BLOCK_M, BLOCK_N)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    out_rows = (bhk.to(tl.int64) * M + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(dk_ptr + out_rows, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out_rows, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.autotune(
    configs=configs_for_autotune(_BWD_CONFIGS),
    key=["N", "M", "HEAD_DIM", "CAUSAL", "WINDOW"],
    prune_configs_by={"early_config_prune": prune_by_shared_memory(_smem_bytes)},
)
@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # as in the dK/dV kernel
    lse_ptr, delta_ptr,  # (B, Hq, N) float32
    dq_ptr,  # output (B, Hq, N, D) contiguous
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,  # strides of q, k, v
    Hq, N, M, GROUP,  # heads, lengths, query heads per key/value head
    scale,  # softmax scale
    WINDOW_SIZE,  # window length W (used when WINDOW)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per step
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // Hq, bh % Hq
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_mask = offs_m[:, None] < N
    row = bh.to(tl.int64) * N + offs_m
    q = tl.load(
        q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqn + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    do = tl.load(do_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(lse_ptr + row, mask=offs_m < N, other=0.0)
    delta = tl.load(delta_ptr + row, mask=offs_m < N, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, hi = _key_range(start_m, N, M, BLOCK_M, CAUSAL, WINDOW, WINDOW_SIZE)
    lo = (lo // BLOCK_N) * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv(k_base, v_base, offs_n, offs_d, skn, svn, M, DOT_FP32)
        p = _probs(q, k, lse, offs_m, offs_n, N, M, scale, CAUSAL, WINDOW, WINDOW_SIZE)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=q_mask)
