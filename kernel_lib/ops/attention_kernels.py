"""The Triton kernels of kernel_lib.attention (flash attention forward, and its dK/dV and dQ backward kernels).

Split from ``attention.py``, which holds the definition, launchers, registration and API and documents the
algorithm; copy both files (and ``_utils.py``) together.
"""

from typing import Optional

import triton
import triton.language as tl

from ._utils import autotuned

LOG2E = 1.4426950408889634  # log2(e), for host code; kernels spell the literal (jit globals must be constexpr)


# --------------------------------------------------------------------------------------------------
# Configs. Each launch takes the config a heuristic below picks from the shape (``*_preferred``: best first, the
# launcher keeps the first that fits the device's shared memory); KERNEL_LIB_AUTOTUNE=1 searches the whole list.
# The first config of each list runs anywhere and is the one interpreted.
# --------------------------------------------------------------------------------------------------
def _configs(*rows: tuple[int, int, int, int]) -> list:
    """triton.Configs from (BLOCK_M, BLOCK_N, warps, stages) rows; each list's first runs anywhere (interpreted)."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in rows]


def _tiles_bytes(config, args, held: tuple[str, int], streamed: tuple[str, int]) -> int:
    """Shared memory of one program: ``held`` tiles (block name, count) stay; ``streamed`` ones are buffered once per
    pipeline stage but the last. Tiles are (block, HEAD_DIM) in 2-byte elements."""
    d = args.get("HEAD_DIM", 128)
    stages = max(1, config.num_stages - 1)
    return 2 * d * (held[1] * config.kwargs[held[0]] + streamed[1] * config.kwargs[streamed[0]] * stages)


def _smem_bytes(config, args) -> int:
    return _tiles_bytes(config, args, held=("BLOCK_M", 1), streamed=("BLOCK_N", 2))  # q held; k, v streamed


_FWD_CONFIGS = _configs((32, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4))


def fwd_preferred(N: int, D: int, causal: bool, window: bool) -> list:
    """Forward configs for this shape, best first. 128-query tiles win once each program has many key blocks to
    stream; windowed rows, and causal rows shorter than 2,048 keys, leave too little work per tile for them."""
    small, large = _FWD_CONFIGS[1], _FWD_CONFIGS[2]
    few_keys = window or (causal and N < 2048)
    return [small, _FWD_CONFIGS[0]] if few_keys else [large, small, _FWD_CONFIGS[0]]


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
def _sees(key_pos, query_pos, N, M, WINDOW: tl.constexpr, WINDOW_SIZE):
    """Whether each key sees each query under the causal (and window) mask, bottom-right aligned; key_pos and
    query_pos come broadcast against each other, so one helper serves both tile orientations."""
    pos = query_pos + (M - N)
    visible = key_pos <= pos
    if WINDOW:
        visible = visible & (key_pos > pos - WINDOW_SIZE)
    return visible


@triton.jit
def _mask_scores(s, offs_m, offs_n, N, M, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, WINDOW_SIZE):
    """-inf where key offs_n is out of range or not visible to query offs_m (bottom-right aligned)."""
    visible = offs_n[None, :] < M
    if CAUSAL:  # a window comes only with causal (the API checks it)
        visible = visible & _sees(offs_n[None, :], offs_m[:, None], N, M, WINDOW, WINDOW_SIZE)
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


@triton.jit
def _head_base(ptr, b, h, stride_b, stride_h):
    """Pointer to position 0 of head h of batch b; int64 offsets (B * H * N * D may pass 2^31)."""
    return ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def _query_block(q_ptr, k_ptr, v_ptr, sqb, sqh, skb, skh, svb, svh, Hq, GROUP,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """This program's first query, (batch * head) index, query and head-dim offsets, and the q, k and v pointers to
    position 0 of its query head and of the key/value head that head reads (the forward and dQ kernels). Under a
    causal mask the last query blocks see the most keys; they get the first program ids, so the longest programs
    start first and the short ones fill the tail."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = _head_base(q_ptr, b, h, sqb, sqh)
    k_base = _head_base(k_ptr, b, hk, skb, skh)
    v_base = _head_base(v_ptr, b, hk, svb, svh)
    return start_m, bh, offs_m, offs_d, q_base, k_base, v_base


@triton.jit
def _unmasked_keys(start_m, lo, hi, N, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   WINDOW: tl.constexpr, WINDOW_SIZE):  # fmt: skip
    """[full_lo, full_hi): the key blocks within [lo, hi) that every query of the block at start_m sees, so they
    need no mask (the forward and dQ kernels; lo is a multiple of BLOCK_N)."""
    full_lo = lo
    full_hi = hi
    if CAUSAL:  # keys up to the first query's position are seen by every query of the block
        full_hi = tl.minimum(full_hi, (tl.maximum(0, start_m + 1 + (M - N)) // BLOCK_N) * BLOCK_N)
    full_hi = tl.maximum(full_hi, lo)
    if WINDOW:  # keys from the last query's window start on are seen by every query of the block
        full_lo = tl.cdiv(tl.maximum(0, start_m + BLOCK_M + (M - N) - WINDOW_SIZE), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), full_hi)
    return full_lo, full_hi


@triton.jit
def _key_blocks(start_m, N, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                WINDOW: tl.constexpr, WINDOW_SIZE, MASK_TAIL: tl.constexpr):  # fmt: skip
    """lo, hi, full_lo, full_hi: the keys [lo, hi) the query block at start_m sees (lo a multiple of BLOCK_N), and
    within them the key blocks [full_lo, full_hi) that need no mask (the forward and dQ kernels). MASK_TAIL: the
    ragged last key block is masked too (the forward, whose keys past M must score -inf)."""
    lo, hi = _key_range(start_m, N, M, BLOCK_M, CAUSAL, WINDOW, WINDOW_SIZE)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_end = hi
    if MASK_TAIL:
        full_end = (M // BLOCK_N) * BLOCK_N
    full_lo, full_hi = _unmasked_keys(start_m, lo, full_end, N, M, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, WINDOW_SIZE)
    return lo, hi, full_lo, full_hi


@triton.jit
def _fwd_steps(
    acc, l_i, m_i, q,  # running output, sum and max of this program's queries; its q tile
    k_base, v_base, offs_m, offs_d, skn, svn,
    k_start, k_end,  # key blocks [k_start, k_end), k_start a multiple of BLOCK_N
    N, M, qk_scale, WINDOW_SIZE,
    MASK: tl.constexpr,  # apply key-range, causal and window masks (only blocks on their edge need them)
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    for start_n in range(k_start, k_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv(k_base, v_base, offs_n, offs_d, skn, svn, M, DOT_FP32)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), base 2
        if MASK:
            s = _mask_scores(s, offs_m, offs_n, N, M, CAUSAL, WINDOW, WINDOW_SIZE)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = m_new
        if MASK:  # a row that has seen no key yet keeps m = -inf: subtract 0 instead, so p = 0, not NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


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
    start_m, bh, offs_m, offs_d, q_base, k_base, v_base = _query_block(
        q_ptr, k_ptr, v_ptr, sqb, sqh, skb, skh, svb, svh, Hq, GROUP, HEAD_DIM, BLOCK_M
    )
    q = tl.load(q_base + offs_m[:, None] * sqn + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of base-2 scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of 2^(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # unnormalized output
    # Key blocks [full_lo, full_hi) are whole (inside M) and seen by every query of the block: no mask. The
    # blocks before (window edge) and after (causal edge, ragged end of the keys: -inf scores) are masked.
    lo, hi, full_lo, full_hi = _key_blocks(start_m, N, M, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, WINDOW_SIZE, True)
    if WINDOW:
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_d, skn, svn, lo, full_lo,
                                   N, M, qk_scale, WINDOW_SIZE, True, CAUSAL, WINDOW, DOT_FP32, BLOCK_N)  # fmt: skip
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_d, skn, svn, full_lo, full_hi,
                               N, M, qk_scale, WINDOW_SIZE, False, CAUSAL, WINDOW, DOT_FP32, BLOCK_N)  # fmt: skip
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_d, skn, svn, full_hi, hi,
                               N, M, qk_scale, WINDOW_SIZE, True, CAUSAL, WINDOW, DOT_FP32, BLOCK_N)  # fmt: skip
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    row = bh.to(tl.int64) * N + offs_m
    tl.store(
        out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < N
    )
    tl.store(lse_ptr + row, lse, mask=offs_m < N)


# Backward configs, one list per kernel: the dK/dV kernel holds BLOCK_N keys and streams BLOCK_M queries (and
# dout) past them, the dQ kernel the other way round; each kernel's smem estimate counts the streamed tiles.
_DKDV_CONFIGS = _configs((32, 32, 4, 2), (32, 128, 4, 3), (32, 128, 4, 5), (64, 128, 8, 3), (64, 64, 4, 3))
_DQ_CONFIGS = _configs((32, 32, 4, 2), (128, 32, 4, 3), (128, 32, 4, 5), (128, 64, 8, 3), (64, 64, 4, 3))


def dkdv_preferred(N: int, D: int, causal: bool, window: Optional[int] = None) -> list:
    """dK/dV configs, best first: 128 keys held per program; with small heads, 64 keys, unless many queries
    stream past each key block (causal rows of 2,048 or more, windows wider than 2,048)."""
    if D >= 128:
        return [_DKDV_CONFIGS[3], _DKDV_CONFIGS[4], _DKDV_CONFIGS[0]]
    if causal and (N >= 2048 if window is None else window > 2048):
        return [_DKDV_CONFIGS[1], _DKDV_CONFIGS[4], _DKDV_CONFIGS[0]]
    return [_DKDV_CONFIGS[4], _DKDV_CONFIGS[0]]


def dq_preferred(D: int, causal: bool) -> list:
    """dQ configs, best first: 128-query tiles, except small heads under a causal mask."""
    if D <= 64 and causal:
        return [_DQ_CONFIGS[4], _DQ_CONFIGS[0]]
    return [_DQ_CONFIGS[3], _DQ_CONFIGS[4], _DQ_CONFIGS[0]]


def _smem_bytes_dkdv(config, args) -> int:
    return _tiles_bytes(config, args, held=("BLOCK_N", 2), streamed=("BLOCK_M", 2))  # k, v held; q, dout streamed


def _smem_bytes_dq(config, args) -> int:
    return _tiles_bytes(config, args, held=("BLOCK_M", 2), streamed=("BLOCK_N", 2))  # q, dout held; k, v streamed


@triton.jit
def _attn_bwd_prep_kernel(
    out_ptr, do_ptr,  # (rows, D) contiguous each: the forward's output and its gradient
    lse_ptr,  # (rows,) float32: the forward's log-sum-exp (natural log; -inf for a query that sees no key)
    dlse_ptr,  # (rows,) float32: gradient flowing into lse; unused when HAS_DLSE is False
    delta_ptr,  # output (rows,) float32: rowsum(dout * out) - dlse
    lse2_ptr,  # output (rows,) float32: lse in base 2, +inf where lse is -inf (so that 2^(s - lse2) = 0)
    n_rows,  # B * Hq * N
    HEAD_DIM: tl.constexpr, HAS_DLSE: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    out = tl.load(out_ptr + ptrs, mask=row_mask[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + ptrs, mask=row_mask[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(out * do, axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + rows, mask=row_mask, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(delta_ptr + rows, delta, mask=row_mask)
    tl.store(lse2_ptr + rows, lse2, mask=row_mask)


@triton.jit
def _dkdv_steps(
    dk, dv, k, v,  # (BLOCK_N, D) float32 accumulators; this program's key and value tiles
    q_base, do_base, lse2_base, delta_base,  # pointers to row 0 of this query head
    offs_n, offs_d, sqn,  # this program's key positions, the head dim, q's position stride
    q_start, q_end,  # query blocks [q_start, q_end), q_start a multiple of BLOCK_M
    N, M, qk_scale, WINDOW_SIZE,
    MASK: tl.constexpr,  # apply the causal/window mask (only blocks on its edge need it)
    WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # Computed transposed, keys along rows (s^T = k q^T), so p^T and ds^T come out of their dots already in the
    # layout the next dots take (dv += p^T dout, dk += ds^T q): no transpose of a register tile.
    # Rows past N need no mask: their q and dout load as 0, which zeroes their share of dv and ds.
    for start_m in range(q_start, q_end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_valid = offs_m < N
        q = tl.load(q_base + offs_m[:, None] * sqn + offs_d[None, :], mask=m_valid[:, None], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=m_valid[:, None], other=0.0)
        lse2 = tl.load(lse2_base + offs_m, mask=m_valid, other=0.0)
        delta = tl.load(delta_base + offs_m, mask=m_valid, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])  # (BLOCK_N, BLOCK_M)
        if MASK:
            p_t = tl.where(_sees(offs_n[:, None], offs_m[None, :], N, M, WINDOW, WINDOW_SIZE), p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # q (B, Hq, N, D), k and v (B, Hkv, M, D), dout (B, Hq, N, D) contiguous
    lse2_ptr, delta_ptr,  # (B, Hq, N) float32: base-2 log-sum-exp and rowsum(dout * out), from the prep kernel
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
    k_base = _head_base(k_ptr, b, hk, skb, skh)
    v_base = _head_base(v_ptr, b, hk, svb, svh)
    k, v = _load_kv(k_base, v_base, offs_n, offs_d, skn, svn, M, DOT_FP32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # Query blocks, bottom-right alignment (offset M - N): [q_lo, full_lo) and [full_hi, q_hi) see part of this
    # key block (masked), [full_lo, full_hi) see all of it (no mask); without a mask, all of [0, N) is full.
    q_lo = 0
    q_hi = N
    full_lo = 0
    full_hi = N
    if CAUSAL:
        q_lo = (tl.maximum(0, start_n - (M - N)) // BLOCK_M) * BLOCK_M
        last_key = tl.maximum(0, start_n + BLOCK_N - 1 - (M - N))  # first query that sees the block's last key
        full_lo = tl.minimum(tl.maximum(tl.cdiv(last_key, BLOCK_M) * BLOCK_M, q_lo), N)
    if WINDOW:
        q_hi = tl.minimum(N, tl.maximum(0, start_n + BLOCK_N - 1 - (M - N) + WINDOW_SIZE))
        # queries below start_n - (M - N) + W still see the block's first key
        full_hi = (tl.maximum(0, start_n - (M - N) + WINDOW_SIZE) // BLOCK_M) * BLOCK_M
        full_hi = tl.maximum(tl.minimum(full_hi, q_hi), full_lo)
    qk_scale = scale * 1.4426950408889634
    for g in range(0, GROUP):  # every query head reading this key/value head
        h = hk * GROUP + g
        q_base = _head_base(q_ptr, b, h, sqb, sqh)
        row_base = (b * Hq + h).to(tl.int64) * N
        do_base = do_ptr + row_base * HEAD_DIM
        lse2_base = lse2_ptr + row_base
        delta_base = delta_ptr + row_base
        if CAUSAL:
            dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, offs_n, offs_d, sqn,
                                 q_lo, full_lo, N, M, qk_scale, WINDOW_SIZE,
                                 True, WINDOW, DOT_FP32, HEAD_DIM, BLOCK_M)  # fmt: skip
        dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, offs_n, offs_d, sqn,
                             full_lo, full_hi, N, M, qk_scale, WINDOW_SIZE,
                             False, WINDOW, DOT_FP32, HEAD_DIM, BLOCK_M)  # fmt: skip
        if WINDOW:
            dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, offs_n, offs_d, sqn,
                                 full_hi, q_hi, N, M, qk_scale, WINDOW_SIZE,
                                 True, WINDOW, DOT_FP32, HEAD_DIM, BLOCK_M)  # fmt: skip
    kv_mask = offs_n[:, None] < M
    out_rows = (bhk.to(tl.int64) * M + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(dk_ptr + out_rows, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out_rows, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_steps(
    dq, q, do, lse2, delta,  # (BLOCK_M, D) float32 accumulator; this program's q, dout; its lse2 and delta
    k_base, v_base, offs_m, offs_d, skn, svn,
    k_start, k_end,  # key blocks [k_start, k_end), k_start a multiple of BLOCK_N
    N, M, qk_scale, WINDOW_SIZE,
    MASK: tl.constexpr,  # apply the causal/window mask (only blocks on its edge need it)
    WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Keys past M need no mask: their k and v load as 0, so they add nothing to dq.
    for start_n in range(k_start, k_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv(k_base, v_base, offs_n, offs_d, skn, svn, M, DOT_FP32)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])  # (BLOCK_M, BLOCK_N)
        if MASK:
            p = tl.where(_sees(offs_n[None, :], offs_m[:, None], N, M, WINDOW, WINDOW_SIZE), p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # as in the dK/dV kernel
    lse2_ptr, delta_ptr,  # (B, Hq, N) float32
    dq_ptr,  # output (B, Hq, N, D) contiguous
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,  # strides of q, k, v
    Hq, N, M, GROUP,  # heads, lengths, query heads per key/value head
    scale,  # softmax scale
    WINDOW_SIZE,  # window length W (used when WINDOW)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per step
):  # fmt: skip
    start_m, bh, offs_m, offs_d, q_base, k_base, v_base = _query_block(
        q_ptr, k_ptr, v_ptr, sqb, sqh, skb, skh, svb, svh, Hq, GROUP, HEAD_DIM, BLOCK_M
    )
    q_mask = offs_m[:, None] < N
    row = bh.to(tl.int64) * N + offs_m
    q = tl.load(q_base + offs_m[:, None] * sqn + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(do_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
    lse2 = tl.load(lse2_ptr + row, mask=offs_m < N, other=0.0)
    delta = tl.load(delta_ptr + row, mask=offs_m < N, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Key blocks [lo, full_lo) and [full_hi, hi) are seen by part of this query block (masked), [full_lo, full_hi)
    # by all of it; keys past M load as zeros here, which add nothing to dq, so the ragged end needs no mask.
    lo, hi, full_lo, full_hi = _key_blocks(start_m, N, M, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, WINDOW_SIZE, False)
    qk_scale = scale * 1.4426950408889634
    if WINDOW:
        dq = _dq_steps(dq, q, do, lse2, delta, k_base, v_base, offs_m, offs_d, skn, svn,
                       lo, full_lo, N, M, qk_scale, WINDOW_SIZE, True, WINDOW, DOT_FP32, BLOCK_N)  # fmt: skip
    dq = _dq_steps(dq, q, do, lse2, delta, k_base, v_base, offs_m, offs_d, skn, svn,
                   full_lo, full_hi, N, M, qk_scale, WINDOW_SIZE, False, WINDOW, DOT_FP32, BLOCK_N)  # fmt: skip
    if CAUSAL:
        dq = _dq_steps(dq, q, do, lse2, delta, k_base, v_base, offs_m, offs_d, skn, svn,
                       full_hi, hi, N, M, qk_scale, WINDOW_SIZE, True, WINDOW, DOT_FP32, BLOCK_N)  # fmt: skip
    tl.store(dq_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


# The same kernels under triton.autotune, launched instead when KERNEL_LIB_AUTOTUNE=1.
_TUNING_KEY = ["N", "M", "HEAD_DIM", "CAUSAL", "WINDOW"]
_attn_fwd_tuned = autotuned(_attn_fwd_kernel, _FWD_CONFIGS, _TUNING_KEY, _smem_bytes)
_attn_bwd_dkdv_tuned = autotuned(_attn_bwd_dkdv_kernel, _DKDV_CONFIGS, _TUNING_KEY, _smem_bytes_dkdv)
_attn_bwd_dq_tuned = autotuned(_attn_bwd_dq_kernel, _DQ_CONFIGS, _TUNING_KEY, _smem_bytes_dq)
