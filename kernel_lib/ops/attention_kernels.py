"""The Triton kernels of kernel_lib.attention (flash attention forward, and its dK/dV and dQ backward kernels).

Every kernel serves both layouts: fixed length, (B, H, N, D) tensors with one length for the batch; and packed
sequences (VARLEN), (total tokens, H, D) tensors where sequence b holds rows cu_seqlens[b] to cu_seqlens[b + 1].
A program reads its sequence's first row and length, and addresses every tensor as
``ptr + b * stride_b + h * stride_h + (row0 + position) * stride_position`` (stride_b is 0 when packed, row0 is 0
when not), so the loops, masks and tiles are the same code for both.

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
# launcher keeps the first whose compiled kernel fits the device's shared memory); KERNEL_LIB_AUTOTUNE=1 searches
# the whole list.
# The first config of each list runs anywhere and is the one interpreted.
# --------------------------------------------------------------------------------------------------
def _configs(*rows: tuple[int, int, int, int]) -> list:
    """triton.Configs from (BLOCK_M, BLOCK_N, warps, stages) rows; each list's first runs anywhere (interpreted)."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in rows]


def _tiles_bytes(config, args, held: str, streamed: str) -> int:
    """Shared memory of one program, an estimate that prunes the config lists. ``held``: the block of rows whose
    q/k-wide and v-wide tiles stay for the whole program; ``streamed``: the block whose two tiles are buffered once
    per pipeline stage, every stage counted, as Triton 3.6 allocates them on Hopper (for the forward at D = 256,
    BLOCK_M 128, BLOCK_N 64, 3 stages it asked 262,144 bytes: q's tile plus 3 x (k + v)). Tiles are 2-byte
    elements, padded to the power-of-two head dims BLOCK_DQK and BLOCK_DV. The compiled kernel's own count has the
    last word (_utils.compile_fitting)."""
    width = args.get("BLOCK_DQK", 128) + args.get("BLOCK_DV", args.get("BLOCK_DQK", 128))
    stages = max(1, config.num_stages)
    return 2 * width * (config.kwargs[held] + config.kwargs[streamed] * stages)


def _smem_bytes(config, args) -> int:
    # q held, counted at q's and v's width together (Triton held q alone: a margin); k, v streamed
    return _tiles_bytes(config, args, held="BLOCK_M", streamed="BLOCK_N")


_FWD_CONFIGS = _configs(
    (32, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 32, 4, 2), (128, 32, 8, 3),
)  # fmt: skip


def padded_head_dim(D: int) -> int:
    """The power-of-two tile width (at least 16, tl.dot's smallest) that holds a head dim of D."""
    return max(16, 1 << (D - 1).bit_length())


def fwd_preferred(N: int, width: int, causal: bool, window: bool) -> list:
    """Forward configs for this shape, best first; ``width`` is BLOCK_DQK + BLOCK_DV. 128-query tiles win once each
    program has many key blocks to stream; windowed rows, and causal rows shorter than 2,048 keys, leave too little
    work per tile for them. Heads wider than 128 stream 32 keys a step: 64 with three stages do not fit in shared
    memory (H200 sweep at D = 256 and 192/128 in benchmarks/NOTES.md)."""
    few_keys = window or (causal and N < 2048)
    if width > 256:
        wide, narrow = _FWD_CONFIGS[6], _FWD_CONFIGS[5]
        return [narrow, wide, _FWD_CONFIGS[0]] if few_keys else [wide, narrow, _FWD_CONFIGS[0]]
    small, large = _FWD_CONFIGS[1], _FWD_CONFIGS[2]
    return [small, _FWD_CONFIGS[0]] if few_keys else [large, small, _FWD_CONFIGS[0]]


@triton.jit
def _load_tile(base, offs_r, stride_r, n_rows, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (rows, BLOCK_D) tile with unit stride along d; rows past n_rows and columns past D read as 0 (zero
    columns add nothing to a dot product, so a padded head dim computes the same scores)."""
    mask = offs_r[:, None] < n_rows
    if D < BLOCK_D:
        mask = mask & (offs_d[None, :] < D)
    return tl.load(base + offs_r[:, None] * stride_r + offs_d[None, :], mask=mask, other=0.0)


@triton.jit
def _store_tile(base, value, offs_r, stride_r, n_rows, offs_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store a (rows, BLOCK_D) tile, cast to the destination's dtype, leaving rows past n_rows and columns past D."""
    mask = offs_r[:, None] < n_rows
    if D < BLOCK_D:
        mask = mask & (offs_d[None, :] < D)
    tl.store(base + offs_r[:, None] * stride_r + offs_d[None, :], value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _load_kv(k_base, v_base, offs_n, offs_dk, offs_dv, skn, svn, M, D_QK: tl.constexpr, D_V: tl.constexpr,
             BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """One (BLOCK_N, BLOCK_DQK) tile of k and one (BLOCK_N, BLOCK_DV) of v; rows past M and columns past the head
    dims read as 0; upcast when the dot needs float32."""
    k = _load_tile(k_base, offs_n, skn, M, offs_dk, D_QK, BLOCK_DQK)
    v = _load_tile(v_base, offs_n, svn, M, offs_dv, D_V, BLOCK_DV)
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
def _visible_tile(offs_m, offs_n, N, M, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, WINDOW_SIZE):
    """(BLOCK_M, BLOCK_N): key offs_n in range and visible to query offs_m (bottom-right aligned)."""
    visible = offs_n[None, :] < M
    if CAUSAL:  # a window comes only with causal (the API checks it)
        visible = visible & _sees(offs_n[None, :], offs_m[:, None], N, M, WINDOW, WINDOW_SIZE)
    return visible


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
def _head_offset(b, h, row0, stride_b, stride_h, stride_n, VARLEN: tl.constexpr):
    """Offset of position 0 of head h of sequence b, whose rows start at row0 when packed (VARLEN); int64 (B * H *
    N * D may pass 2^31)."""
    offset = b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    if VARLEN:
        offset += row0.to(tl.int64) * stride_n
    return offset


@triton.jit
def _head_base(ptr, b, h, row0, stride_b, stride_h, stride_n, VARLEN: tl.constexpr):
    """Pointer to position 0 of head h of sequence b (see _head_offset)."""
    return ptr + _head_offset(b, h, row0, stride_b, stride_h, stride_n, VARLEN)


@triton.jit
def _sequence(cu_q_ptr, cu_k_ptr, b, N, M, VARLEN: tl.constexpr):
    """First query row, first key row, and the query and key lengths of sequence b: read from the offsets when
    packed, else 0, 0, N, M."""
    q0 = 0
    k0 = 0
    if VARLEN:
        q0 = tl.load(cu_q_ptr + b)
        N = tl.load(cu_q_ptr + b + 1) - q0
        k0 = tl.load(cu_k_ptr + b)
        M = tl.load(cu_k_ptr + b + 1) - k0
    return q0, k0, N, M


@triton.jit
def _query_block(q_ptr, k_ptr, v_ptr, cu_q_ptr, cu_k_ptr, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, Hq, GROUP,
                 N, M, D_QK: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 VARLEN: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
    """This program's first query, sequence, head, first query row, the sequence's query and key lengths, query
    offsets, q/k and v head-dim offsets, its block of q (float32 if DOT_FP32; rows past N load as 0), and the k and
    v pointers to position 0 of the key/value head its query head reads (the forward and dQ kernels). Under a
    causal mask the last query blocks see the most keys; they get the first program ids, so the longest programs
    start first and the short ones fill the tail. Packed, the grid covers the longest sequence: start_m may pass
    a shorter one's N (the caller returns)."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    hk = h // GROUP
    q0, k0, N, M = _sequence(cu_q_ptr, cu_k_ptr, b, N, M, VARLEN)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = _head_base(q_ptr, b, h, q0, sqb, sqh, sqn, VARLEN)
    k_base = _head_base(k_ptr, b, hk, k0, skb, skh, skn, VARLEN)
    v_base = _head_base(v_ptr, b, hk, k0, svb, svh, svn, VARLEN)
    q = _load_tile(q_base, offs_m, sqn, N, offs_dk, D_QK, BLOCK_DQK)
    if DOT_FP32:
        q = q.to(tl.float32)
    return start_m, b, h, q0, N, M, offs_m, offs_dk, offs_dv, q, k_base, v_base


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
def _fwd_block(acc, l_i, m_i, q, k, v, qk_scale, visible, MASK: tl.constexpr):
    """One key block of the online softmax: scores of q against k (base 2), -inf where not ``visible`` (when MASK),
    the running max, sum and output rescaled and updated with this block's probabilities times v."""
    return _fwd_scores(acc, l_i, m_i, tl.dot(q, tl.trans(k)) * qk_scale, v, visible, MASK)


@triton.jit
def _fwd_scores(acc, l_i, m_i, s, v, visible, MASK: tl.constexpr):
    """_fwd_block from the block's base-2 scores s (BLOCK_M, BLOCK_N): the variants modify them first."""
    if MASK:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = m_new
    if MASK:  # a row that has seen no key yet keeps m = -inf: subtract 0 instead, so p = 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _fwd_steps(
    acc, l_i, m_i, q,  # running output, sum and max of this program's queries; its q tile
    k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
    k_start, k_end,  # key blocks [k_start, k_end), k_start a multiple of BLOCK_N
    N, M, qk_scale, WINDOW_SIZE,
    MASK: tl.constexpr,  # apply key-range, causal and window masks (only blocks on their edge need them)
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    for start_n in range(k_start, k_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv(k_base, v_base, offs_n, offs_dk, offs_dv, skn, svn, M, D_QK, D_V, BLOCK_DQK, BLOCK_DV, DOT_FP32)
        visible = offs_n[None, :] < M
        if MASK:
            visible = _visible_tile(offs_m, offs_n, N, M, CAUSAL, WINDOW, WINDOW_SIZE)
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k, v, qk_scale, visible, MASK)
    return acc, l_i, m_i


# N, M and the window vary from call to call: the forward is not specialized on them (a new length compiles
# nothing new). The backward kernels are, on N and M: unspecialized, they ran 2.5-6.7% slower at D = 64 and 128 (H200).
_VARYING = ["N", "M", "WINDOW_SIZE"]


@triton.jit(do_not_specialize=_VARYING)
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, Hq, N, D_QK), (B, Hkv, M, D_QK), (B, Hkv, M, D_V); unit stride along the head dim
    out_ptr,  # (B, Hq, N, D_V), q's dtype, unit stride along the head dim
    lse_ptr,  # (B, Hq, N) float32, natural log, unit stride along positions
    cu_q_ptr, cu_k_ptr,  # (B + 1,) int32 first row of each sequence in q and k (used when VARLEN)
    sqb, sqh, sqn,  # q strides: batch, head, position (batch strides are 0 when packed)
    skb, skh, skn,  # k strides
    svb, svh, svn,  # v strides
    sob, soh, son,  # out strides
    slb, slh,  # lse strides: batch, head
    Hq, N, M,  # query heads, query length, key length (packed: the longest sequence's)
    GROUP,  # query heads per key/value head
    qk_scale,  # scale * log2(e): scores are kept in base 2
    WINDOW_SIZE,  # window length W (used when WINDOW)
    D_QK: tl.constexpr,  # head dim of q and k
    D_V: tl.constexpr,  # head dim of v and out
    BLOCK_DQK: tl.constexpr,  # D_QK padded to a power of two (padding columns load as 0)
    BLOCK_DV: tl.constexpr,  # D_V padded likewise
    CAUSAL: tl.constexpr,  # bottom-right causal mask
    WINDOW: tl.constexpr,  # sliding window on top of causal
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (the interpreter's bf16 dot is wrong)
    VARLEN: tl.constexpr,  # packed sequences: lengths and first rows from cu_q_ptr, cu_k_ptr
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per step
):  # fmt: skip
    start_m, b, h, q0, N, M, offs_m, offs_dk, offs_dv, q, k_base, v_base = _query_block(
        q_ptr, k_ptr, v_ptr, cu_q_ptr, cu_k_ptr, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, Hq, GROUP, N, M,
        D_QK, BLOCK_DQK, BLOCK_DV, BLOCK_M, VARLEN, DOT_FP32,
    )  # fmt: skip
    if VARLEN:
        if start_m >= N:  # past this sequence's end: the grid covers the longest one
            return
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of base-2 scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of 2^(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # unnormalized output
    # Key blocks [full_lo, full_hi) are whole (inside M) and seen by every query of the block: no mask. The
    # blocks before (window edge) and after (causal edge, ragged end of the keys: -inf scores) are masked.
    lo, hi, full_lo, full_hi = _key_blocks(start_m, N, M, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, WINDOW_SIZE, True)
    if WINDOW:
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn, lo, full_lo,
                                   N, M, qk_scale, WINDOW_SIZE, True, CAUSAL, WINDOW, DOT_FP32, BLOCK_N,
                                   D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn, full_lo, full_hi,
                               N, M, qk_scale, WINDOW_SIZE, False, CAUSAL, WINDOW, DOT_FP32, BLOCK_N,
                               D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
    acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn, full_hi, hi,
                               N, M, qk_scale, WINDOW_SIZE, True, CAUSAL, WINDOW, DOT_FP32, BLOCK_N,
                               D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    _store_tile(_head_base(out_ptr, b, h, q0, sob, soh, son, VARLEN), out, offs_m, son, N, offs_dv, D_V, BLOCK_DV)
    tl.store(_head_base(lse_ptr, b, h, q0, slb, slh, 1, VARLEN) + offs_m, lse, mask=offs_m < N)


# Backward configs, one list per kernel: the dK/dV kernel holds BLOCK_N keys and streams BLOCK_M queries (and
# dout) past them, the dQ kernel the other way round; each kernel's smem estimate counts the streamed tiles.
_DKDV_CONFIGS = _configs(
    (32, 32, 4, 2), (32, 128, 4, 3), (32, 128, 4, 5), (64, 128, 8, 3), (64, 64, 4, 3), (64, 64, 8, 2), (32, 64, 4, 2),
)  # fmt: skip
_DQ_CONFIGS = _configs(
    (32, 32, 4, 2), (128, 32, 4, 3), (128, 32, 4, 5), (128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2),
)  # fmt: skip


def dkdv_preferred(N: int, width: int, causal: bool, window: Optional[int] = None) -> list:
    """dK/dV configs, best first (``width``: BLOCK_DQK + BLOCK_DV): 128 keys held per program; with small heads, 64
    keys, unless many queries stream past each key block (causal rows of 2,048 or more, windows wider than 2,048).
    Wider heads hold 64 keys over two stages, streaming 64 queries at 256/256 and 32 at 256/128."""
    if width > 384:
        return [_DKDV_CONFIGS[5], _DKDV_CONFIGS[6], _DKDV_CONFIGS[0]]
    if width > 256:
        return [_DKDV_CONFIGS[6], _DKDV_CONFIGS[5], _DKDV_CONFIGS[0]]
    if width >= 256:
        return [_DKDV_CONFIGS[3], _DKDV_CONFIGS[4], _DKDV_CONFIGS[0]]
    if causal and (N >= 2048 if window is None else window > 2048):
        return [_DKDV_CONFIGS[1], _DKDV_CONFIGS[4], _DKDV_CONFIGS[0]]
    return [_DKDV_CONFIGS[4], _DKDV_CONFIGS[0]]


def dq_preferred(width: int, causal: bool) -> list:
    """dQ configs, best first (``width``: BLOCK_DQK + BLOCK_DV): 128-query tiles, except small heads under a causal
    mask; wider heads hold 64 queries over two stages."""
    if width > 256:
        return [_DQ_CONFIGS[5], _DQ_CONFIGS[6], _DQ_CONFIGS[0]]
    if width <= 128 and causal:
        return [_DQ_CONFIGS[4], _DQ_CONFIGS[0]]
    return [_DQ_CONFIGS[3], _DQ_CONFIGS[4], _DQ_CONFIGS[0]]


def _smem_bytes_dkdv(config, args) -> int:
    return _tiles_bytes(config, args, held="BLOCK_N", streamed="BLOCK_M")  # k, v held; q, dout streamed


def _smem_bytes_dq(config, args) -> int:
    return _tiles_bytes(config, args, held="BLOCK_M", streamed="BLOCK_N")  # q, dout held; k, v streamed


@triton.jit(do_not_specialize=["N"])
def _attn_bwd_prep_kernel(
    out_ptr, do_ptr,  # (B, Hq, N, D_V) each, same strides: the forward's output and its gradient
    lse_ptr,  # (B, Hq, N) float32: the forward's log-sum-exp (natural log; -inf for a query that sees no key)
    dlse_ptr,  # float32 gradient flowing into lse, lse's layout; unused when HAS_DLSE is False
    delta_ptr,  # output float32 statistics: rowsum(dout * out) - dlse
    lse2_ptr,  # output, delta's layout: lse in base 2, +inf where lse is -inf (so 2^(s - lse2) = 0)
    cu_q_ptr,  # (B + 1,) int32 first row of each sequence (used when VARLEN)
    sob, soh, son,  # strides of out and dout
    slb, slh,  # strides of lse and dlse: batch, head (unit along positions)
    ssb, ssh,  # strides of delta and lse2: batch, head (unit along positions; rows 64-byte aligned unless packed)
    Hq, N,  # query heads, queries per head (packed: the longest sequence's)
    D_V: tl.constexpr, BLOCK_DV: tl.constexpr,  # head dim of out, and its power-of-two padding
    HAS_DLSE: tl.constexpr,
    VARLEN: tl.constexpr,  # packed sequences
    BLOCK_R: tl.constexpr,  # queries per program
):  # fmt: skip
    b = tl.program_id(1) // Hq
    h = tl.program_id(1) % Hq
    q0, _, N, _ = _sequence(cu_q_ptr, cu_q_ptr, b, N, N, VARLEN)
    offs_n = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    n_mask = offs_n < N
    offs_d = tl.arange(0, BLOCK_DV)
    out = _load_tile(_head_base(out_ptr, b, h, q0, sob, soh, son, VARLEN), offs_n, son, N, offs_d, D_V, BLOCK_DV)
    do = _load_tile(_head_base(do_ptr, b, h, q0, sob, soh, son, VARLEN), offs_n, son, N, offs_d, D_V, BLOCK_DV)
    delta = tl.sum(out.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(_head_base(dlse_ptr, b, h, q0, slb, slh, 1, VARLEN) + offs_n, mask=n_mask, other=0.0)
    lse = tl.load(_head_base(lse_ptr, b, h, q0, slb, slh, 1, VARLEN) + offs_n, mask=n_mask, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    stats = _head_offset(b, h, q0, ssb, ssh, 1, VARLEN) + offs_n
    tl.store(delta_ptr + stats, delta, mask=n_mask)
    tl.store(lse2_ptr + stats, lse2, mask=n_mask)


@triton.jit
def _dkdv_block(dk, dv, k, v, q, do, lse2, delta, qk_scale, visible_t, MASK: tl.constexpr):
    """One query block's share of dk and dv, transposed (keys along rows): P^T = 2^(k q^T - lse2), zero where not
    ``visible_t`` (BLOCK_N, BLOCK_M) when MASK; dv += P^T dout; dS^T = P^T (v dout^T - delta); dk += dS^T q."""
    s_t = tl.dot(k, tl.trans(q)) * qk_scale  # (BLOCK_N, BLOCK_M), base 2
    return _dkdv_scores(dk, dv, s_t, 0.0, v, q, do, lse2, delta, visible_t, MASK, False)


@triton.jit
def _dkdv_scores(dk, dv, s_t, dmod_t, v, q, do, lse2, delta, visible_t, MASK: tl.constexpr, MOD: tl.constexpr):
    """_dkdv_block from the base-2 scores s_t; MOD: dS^T is scaled by dmod_t, the score modifier's derivative."""
    p_t = tl.math.exp2(s_t - lse2[None, :])
    if MASK:
        p_t = tl.where(visible_t, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do)
    ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
    if MOD:
        ds_t = ds_t * dmod_t
        if MASK:  # the derivative may be anything where the mask hides the score (0 * inf is NaN)
            ds_t = tl.where(visible_t, ds_t, 0.0)
    dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _query_rows(q_base, do_base, lse2_base, delta_base, offs_m, offs_dk, offs_dv, sqn, son, N,
                D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                DOT_FP32: tl.constexpr):  # fmt: skip
    """A query block's q and dout tiles and its lse2 and delta (rows past N read as 0), upcast when needed."""
    m_valid = offs_m < N
    q = _load_tile(q_base, offs_m, sqn, N, offs_dk, D_QK, BLOCK_DQK)
    do = _load_tile(do_base, offs_m, son, N, offs_dv, D_V, BLOCK_DV)
    lse2 = tl.load(lse2_base + offs_m, mask=m_valid, other=0.0)
    delta = tl.load(delta_base + offs_m, mask=m_valid, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    return q, do, lse2, delta


@triton.jit
def _dkdv_steps(
    dk, dv, k, v,  # (BLOCK_N, BLOCK_DQK / BLOCK_DV) float32 accumulators; this program's key and value tiles
    q_base, do_base, lse2_base, delta_base,  # pointers to row 0 of this query head
    offs_n, offs_dk, offs_dv, sqn, son,  # this program's key positions, the head dims, q's and dout's row strides
    q_start, q_end,  # query blocks [q_start, q_end), q_start a multiple of BLOCK_M
    N, M, qk_scale, WINDOW_SIZE,
    MASK: tl.constexpr,  # apply the causal/window mask (only blocks on its edge need it)
    WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # Computed transposed, keys along rows (s^T = k q^T), so p^T and ds^T come out of their dots already in the
    # layout the next dots take (dv += p^T dout, dk += ds^T q): no transpose of a register tile.
    # Rows past N need no mask: their q and dout load as 0, which zeroes their share of dv and ds.
    for start_m in range(q_start, q_end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, do, lse2, delta = _query_rows(q_base, do_base, lse2_base, delta_base, offs_m, offs_dk, offs_dv, sqn, son,
                                         N, D_QK, D_V, BLOCK_DQK, BLOCK_DV, DOT_FP32)  # fmt: skip
        visible_t = offs_n[:, None] < M
        if MASK:
            visible_t = _sees(offs_n[:, None], offs_m[None, :], N, M, WINDOW, WINDOW_SIZE)
        dk, dv = _dkdv_block(dk, dv, k, v, q, do, lse2, delta, qk_scale, visible_t, MASK)
    return dk, dv


@triton.jit(do_not_specialize=["WINDOW_SIZE"])
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # q (B, Hq, N, D_QK), k (B, Hkv, M, D_QK), v (B, Hkv, M, D_V), dout (out's layout)
    lse2_ptr, delta_ptr,  # float32 statistics from prep: base-2 log-sum-exp and rowsum(dout * out)
    dk_ptr, dv_ptr,  # outputs (B, Hkv, M, D_QK) and (B, Hkv, M, D_V), unit stride along the head dim
    cu_q_ptr, cu_k_ptr,  # (B + 1,) int32 first row of each sequence in q and k (used when VARLEN)
    sqb, sqh, sqn,  # q strides (batch strides are 0 when packed)
    skb, skh, skn,  # k strides
    svb, svh, svn,  # v strides
    sob, soh, son,  # dout strides
    sdkb, sdkh, sdkn,  # dk strides
    sdvb, sdvh, sdvn,  # dv strides
    ssb, ssh,  # strides of lse2 and delta: batch, head (unit along positions)
    Hq, Hkv, N, M, GROUP,  # heads, lengths (packed: the longest sequence's), query heads per key/value head
    scale,  # softmax scale
    WINDOW_SIZE,  # window length W (used when WINDOW)
    D_QK: tl.constexpr, D_V: tl.constexpr,  # head dims, and their power-of-two paddings
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
    VARLEN: tl.constexpr,  # packed sequences
    BLOCK_M: tl.constexpr,  # queries per step
    BLOCK_N: tl.constexpr,  # keys per program
):  # fmt: skip
    start_n = tl.program_id(0) * BLOCK_N
    b = tl.program_id(1) // Hkv
    hk = tl.program_id(1) % Hkv
    q0, k0, N, M = _sequence(cu_q_ptr, cu_k_ptr, b, N, M, VARLEN)
    if VARLEN:
        if start_n >= M:  # past this sequence's keys: the grid covers the longest one
            return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_base = _head_base(k_ptr, b, hk, k0, skb, skh, skn, VARLEN)
    v_base = _head_base(v_ptr, b, hk, k0, svb, svh, svn, VARLEN)
    k, v = _load_kv(k_base, v_base, offs_n, offs_dk, offs_dv, skn, svn, M, D_QK, D_V, BLOCK_DQK, BLOCK_DV, DOT_FP32)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
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
        q_base = _head_base(q_ptr, b, h, q0, sqb, sqh, sqn, VARLEN)
        do_base = _head_base(do_ptr, b, h, q0, sob, soh, son, VARLEN)
        stats = _head_offset(b, h, q0, ssb, ssh, 1, VARLEN)
        lse2_base = lse2_ptr + stats
        delta_base = delta_ptr + stats
        if CAUSAL:
            dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, offs_n, offs_dk, offs_dv,
                                 sqn, son, q_lo, full_lo, N, M, qk_scale, WINDOW_SIZE, True, WINDOW, DOT_FP32, BLOCK_M,
                                 D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
        dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, offs_n, offs_dk, offs_dv,
                             sqn, son, full_lo, full_hi, N, M, qk_scale, WINDOW_SIZE, False, WINDOW, DOT_FP32, BLOCK_M,
                             D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
        if WINDOW:
            dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, lse2_base, delta_base, offs_n, offs_dk, offs_dv,
                                 sqn, son, full_hi, q_hi, N, M, qk_scale, WINDOW_SIZE, True, WINDOW, DOT_FP32, BLOCK_M,
                                 D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
    dk_base = _head_base(dk_ptr, b, hk, k0, sdkb, sdkh, sdkn, VARLEN)
    dv_base = _head_base(dv_ptr, b, hk, k0, sdvb, sdvh, sdvn, VARLEN)
    _store_tile(dk_base, dk * scale, offs_n, sdkn, M, offs_dk, D_QK, BLOCK_DQK)
    _store_tile(dv_base, dv, offs_n, sdvn, M, offs_dv, D_V, BLOCK_DV)


@triton.jit
def _dq_block(dq, q, do, lse2, delta, k, v, qk_scale, visible, MASK: tl.constexpr):
    """One key block's share of dq: P = 2^(q k^T - lse2), zero where not ``visible`` when MASK; dS = P (dout v^T -
    delta); dq += dS k."""
    s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), base 2
    dq, _ = _dq_scores(dq, s, 0.0, k, v, do, lse2, delta, visible, MASK, False)
    return dq


@triton.jit
def _dq_scores(dq, s, dmod, k, v, do, lse2, delta, visible, MASK: tl.constexpr, MOD: tl.constexpr):
    """_dq_block from the base-2 scores s; MOD: dS is scaled by dmod, the score modifier's derivative. Returns dq
    and dS before that scaling (the gradient of the modified score: what a modifier's captured tensors need)."""
    p = tl.math.exp2(s - lse2[:, None])
    if MASK:
        p = tl.where(visible, p, 0.0)
    ds_mod = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    ds = ds_mod
    if MOD:
        ds = ds * dmod
        if MASK:  # the derivative may be anything where the mask hides the score (0 * inf is NaN)
            ds = tl.where(visible, ds, 0.0)
    dq += tl.dot(ds.to(k.dtype), k)
    return dq, ds_mod


@triton.jit
def _dq_steps(
    dq, q, do, lse2, delta,  # (BLOCK_M, BLOCK_DQK) float32 accumulator; this program's q, dout; its lse2, delta
    k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
    k_start, k_end,  # key blocks [k_start, k_end), k_start a multiple of BLOCK_N
    N, M, qk_scale, WINDOW_SIZE,
    MASK: tl.constexpr,  # apply the causal/window mask (only blocks on its edge need it)
    WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_N: tl.constexpr,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # Keys past M need no mask: their k and v load as 0, so they add nothing to dq.
    for start_n in range(k_start, k_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_kv(k_base, v_base, offs_n, offs_dk, offs_dv, skn, svn, M, D_QK, D_V, BLOCK_DQK, BLOCK_DV, DOT_FP32)
        visible = offs_n[None, :] < M
        if MASK:
            visible = _sees(offs_n[None, :], offs_m[:, None], N, M, WINDOW, WINDOW_SIZE)
        dq = _dq_block(dq, q, do, lse2, delta, k, v, qk_scale, visible, MASK)
    return dq


@triton.jit(do_not_specialize=["WINDOW_SIZE"])
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # as in the dK/dV kernel
    lse2_ptr, delta_ptr,  # float32 statistics from prep
    dq_ptr,  # output (B, Hq, N, D_QK), unit stride along the head dim
    cu_q_ptr, cu_k_ptr,  # (B + 1,) int32 first row of each sequence in q and k (used when VARLEN)
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,  # strides of q, k, v
    sob, soh, son,  # dout strides
    sdqb, sdqh, sdqn,  # dq strides
    ssb, ssh,  # strides of lse2 and delta: batch, head (unit along positions)
    Hq, N, M, GROUP,  # heads, lengths (packed: the longest sequence's), query heads per key/value head
    scale,  # softmax scale
    WINDOW_SIZE,  # window length W (used when WINDOW)
    D_QK: tl.constexpr, D_V: tl.constexpr,  # head dims, and their power-of-two paddings
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
    VARLEN: tl.constexpr,  # packed sequences
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per step
):  # fmt: skip
    start_m, b, h, q0, N, M, offs_m, offs_dk, offs_dv, q, k_base, v_base = _query_block(
        q_ptr, k_ptr, v_ptr, cu_q_ptr, cu_k_ptr, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, Hq, GROUP, N, M,
        D_QK, BLOCK_DQK, BLOCK_DV, BLOCK_M, VARLEN, DOT_FP32,
    )  # fmt: skip
    if VARLEN:
        if start_m >= N:  # past this sequence's end: the grid covers the longest one
            return
    do = _load_tile(_head_base(do_ptr, b, h, q0, sob, soh, son, VARLEN), offs_m, son, N, offs_dv, D_V, BLOCK_DV)
    stats = _head_offset(b, h, q0, ssb, ssh, 1, VARLEN)
    lse2 = tl.load(lse2_ptr + stats + offs_m, mask=offs_m < N, other=0.0)
    delta = tl.load(delta_ptr + stats + offs_m, mask=offs_m < N, other=0.0)
    if DOT_FP32:
        do = do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    # Key blocks [lo, full_lo) and [full_hi, hi) are seen by part of this query block (masked), [full_lo, full_hi)
    # by all of it; keys past M load as zeros here, which add nothing to dq, so the ragged end needs no mask.
    lo, hi, full_lo, full_hi = _key_blocks(start_m, N, M, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, WINDOW_SIZE, False)
    qk_scale = scale * 1.4426950408889634
    if WINDOW:
        dq = _dq_steps(dq, q, do, lse2, delta, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
                       lo, full_lo, N, M, qk_scale, WINDOW_SIZE, True, WINDOW, DOT_FP32, BLOCK_N,
                       D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
    dq = _dq_steps(dq, q, do, lse2, delta, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
                   full_lo, full_hi, N, M, qk_scale, WINDOW_SIZE, False, WINDOW, DOT_FP32, BLOCK_N,
                   D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
    if CAUSAL:
        dq = _dq_steps(dq, q, do, lse2, delta, k_base, v_base, offs_m, offs_dk, offs_dv, skn, svn,
                       full_hi, hi, N, M, qk_scale, WINDOW_SIZE, True, WINDOW, DOT_FP32, BLOCK_N,
                       D_QK, D_V, BLOCK_DQK, BLOCK_DV)  # fmt: skip
    dq_base = _head_base(dq_ptr, b, h, q0, sdqb, sdqh, sdqn, VARLEN)
    _store_tile(dq_base, dq * scale, offs_m, sdqn, N, offs_dk, D_QK, BLOCK_DQK)


# The same kernels under triton.autotune, launched instead when KERNEL_LIB_AUTOTUNE=1.
_TUNING_KEY = ["N", "M", "D_QK", "D_V", "CAUSAL", "WINDOW", "VARLEN"]
_attn_fwd_tuned = autotuned(_attn_fwd_kernel, _FWD_CONFIGS, _TUNING_KEY, _smem_bytes)
_attn_bwd_dkdv_tuned = autotuned(_attn_bwd_dkdv_kernel, _DKDV_CONFIGS, _TUNING_KEY, _smem_bytes_dkdv)
_attn_bwd_dq_tuned = autotuned(_attn_bwd_dq_kernel, _DQ_CONFIGS, _TUNING_KEY, _smem_bytes_dq)
