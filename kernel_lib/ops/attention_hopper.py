"""The flash-attention forward for Hopper GPUs (SM90), in Gluon, Triton's lower-level language.

The algorithm is the forward of ``attention.py``: each program owns BLOCK_M = 128 queries of one head, streams the
key/value blocks it sees, and keeps a running max m, sum l and unnormalized output O (online softmax, base 2).
What changes is the schedule, which Triton's compiler did not produce on SM90 for this kernel (Triton 3.6's
``tl.range(warp_specialize=True)`` left the PTX of a 128-query, 8-warp tile identical; its Hopper pass acts only
at 4 warps, per its source, and the 4-warp tiles tried gave no faster kernel):

* **Copies by the tensor memory accelerator (TMA)**, from a producer warp of its own: q once per warpgroup, then
  k and v blocks into a ring of STAGES shared-memory slots; each slot has a ``ready`` barrier (the copy landed)
  and a ``free`` barrier (both warpgroups are done with it). Rows past N or M and head-dim columns past D arrive
  as zeros; the output's store drops them.
* **Two consumer warpgroups**, 64 query rows each, multiplying with asynchronous warpgroup MMAs (``wgmma``).
  At step j a warpgroup issues S_j = q k_j^T and O += P_{j-1} v_{j-1}, waits for S_j alone and computes its
  softmax while the tensor cores still work on the product (FlashAttention-3's intra-warpgroup overlap); then it
  waits for the product, rescales O and frees the slot.
* **Ping-pong**: the warpgroups take turns issuing their products (a ``turn`` barrier each), so while one
  exponentiates, the other's products run, and the tensor cores are not idle while both compute softmaxes.

Data per program: q (128 x D) read once, each visible k and v block read once, O (128 x Dv) and lse written once.
Scores are masked only in key blocks on the edge of the causal or window mask or past M (a uniform branch per
block). ``attention.py`` runs it on SM90 when Gluon's Hopper module is present, the head dims are at most 128 and
the tensors suit the TMA; the portable Triton kernel serves everything else.

**The backward** (``_attn_bwd_hopper_kernel``) takes FlashAttention-3's shape: a program owns BWD_BLOCK_N = 128
keys of a key/value head (64 per consumer warpgroup) and streams BWD_BLOCK_M = 64 queries at a time of every query
head of its group, q and dout copied by a producer warp into a ring of slots. Per step each warpgroup computes
S^T = k q^T and dP^T = v dout^T, then P^T = 2^(S^T - lse2) and dS^T = P^T (dP^T - delta) in registers, adds
dV += P^T dout and dK += dS^T q (accumulators in registers for the whole program), and writes dS^T to shared
memory. Once both halves are there, warpgroup w multiplies dS (BLOCK_M x 128 keys) by its half of k's columns and
adds that (64 x 64) share of dq into a float32 buffer through the TMA's reduction (cp.reduce.async.bulk.tensor):
five matmuls a step, against seven for the portable kernels, which recompute the scores in a second kernel for
dq. Adds in no fixed order: dq is not run to run identical (``attention.py`` keeps the portable kernels when
deterministic algorithms are asked for). Served: fixed-length tensors, q/k head dims of 65 to 128 (dq's columns
split at 64), v head dims up to 128.
Sources: Shah et al., FlashAttention-3 (2024); Triton's Gluon tutorials (05-wgmma, 08-warp-specialization).
"""

import functools
import inspect

import torch
import triton

try:  # Gluon and its Hopper module: Triton 3.5 and later (experimental; absent before)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Gluon is experimental: its warp_specialize took other arguments before Triton 3.6. This file is written
    # for the (functions_and_args, worker_num_warps, worker_num_regs) form of 3.6 and 3.7.
    AVAILABLE = list(inspect.signature(gl.warp_specialize).parameters)[:1] == ["functions_and_args"]
except ImportError:  # an older Triton: the portable kernel serves every GPU
    AVAILABLE = False

try:  # the backward adds dq through the TMA's reduction, an op Gluon 3.6 and 3.7 build but do not name
    from triton._C.libtriton import gluon_ir as _gluon_ir
    from triton._C.libtriton import ir as _triton_ir
    from triton.experimental.gluon.language._core import builtin as _gluon_builtin

    BWD_AVAILABLE = AVAILABLE and hasattr(_gluon_ir.GluonOpBuilder, "create_async_tma_reduce")
except ImportError:  # the portable backward serves
    BWD_AVAILABLE = False

BLOCK_M = 128  # queries per program: two warpgroups of 64 rows
MAX_BLOCK_D = 128  # widest padded head dim served here (q and k, v apart)
SHARED_LIMIT = 232_448  # bytes of shared memory a block may use on SM90 (227 KiB)

if AVAILABLE:
    # the warps of one partition wait for each other: gl.thread_barrier in Triton 3.6, gl.barrier from 3.7
    _sync_warps = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

    @gluon.jit
    def _softmax_step(s, m_i, l_i, start_n, offs_m, N, M, qk_scale, WINDOW_SIZE, lo_full, hi_full,
                      s_layout: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
                      BLOCK_N: gl.constexpr):  # fmt: skip
        """Probabilities of one score block (base 2, relative to the new running max), the new max, the factor
        that rescales what came before, and the new running sum. Blocks outside [lo_full, hi_full) are masked."""
        if (start_n < lo_full) or (start_n >= hi_full):
            offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            visible = offs_n[None, :] < M
            if CAUSAL:
                pos = offs_m[:, None] + (M - N)
                visible = visible & (offs_n[None, :] <= pos)
                if WINDOW:
                    visible = visible & (offs_n[None, :] > pos - WINDOW_SIZE)
            s = gl.where(visible, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: p = 0, not NaN
            p = gl.exp2(s - m_safe[:, None])
        else:  # the scale (> 0) commutes with the max and joins the subtraction in one multiply-add
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            m_safe = m_new
            p = gl.exp2(s * qk_scale - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, alpha, l_i

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, kv_ready, kv_free, bd, h, hk,
                  q_row, k_row, n_blocks, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr):  # fmt: skip
        """Copies in the order the consumers use them: each warpgroup's q rows (from q_row), then the key/value
        blocks from k_row, each into the next ring slot once both warpgroups have freed it. bd: the batch
        index of the descriptors (0 when packed)."""
        for wg in gl.static_range(2):
            mbarrier.expect(q_ready.index(wg), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [bd, h, q_row + wg * HALF_M, 0], q_ready.index(wg),
                                            q_smem.index(wg))  # fmt: skip
        for i in range(n_blocks):
            slot = i % STAGES
            if i >= STAGES:  # wait until both warpgroups have finished with the block this slot held
                mbarrier.wait(kv_free.index(slot), ((i // STAGES) - 1) & 1)
            bar = kv_ready.index(slot)
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [bd, hk, k_row + i * BLOCK_N, 0], bar, k_smem.index(slot))
            tma.async_copy_global_to_shared(v_desc, [bd, hk, k_row + i * BLOCK_N, 0], bar, v_smem.index(slot))

    @gluon.jit
    def _consumer(o_desc, o_base, son, D_V, lse_base, q_smem, k_smem, v_smem, o_smem, q_ready, kv_ready, kv_free,
                  turn, bd, h, q0, start_m, N, M, qk_scale, WINDOW_SIZE, lo, lo_full, hi_full, n_blocks,
                  WG: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, VARLEN: gl.constexpr,
                  HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_DQK: gl.constexpr, BLOCK_DV: gl.constexpr,
                  STAGES: gl.constexpr):  # fmt: skip
        """One warpgroup's 64 query rows (WG 0 or 1): the online softmax over n_blocks key blocks from lo, in
        turns with the other warpgroup, then out and lse. o_base, lse_base: this sequence's row 0 of head h."""
        dtype: gl.constexpr = o_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_DV, 16])  # fmt: skip
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        row0 = start_m + WG * HALF_M
        offs_m = row0 + gl.arange(0, HALF_M, layout=rows_s)
        m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=rows_s)
        l_i = gl.zeros([HALF_M], gl.float32, layout=rows_s)
        acc = gl.zeros([HALF_M, BLOCK_DV], gl.float32, layout=o_layout)
        s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
        mbarrier.wait(q_ready.index(WG), 0)
        q = q_smem.index(WG).reshape([HALF_M, BLOCK_DQK])
        mine = turn.index(WG)
        theirs = turn.index(1 - WG)
        if n_blocks > 0:
            mbarrier.wait(kv_ready.index(0), 0)
            mbarrier.wait(mine, 0)
            s = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, BLOCK_DQK]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)  # fmt: skip
            mbarrier.arrive(theirs, count=1)
            s = warpgroup_mma_wait(0, deps=[s])
            p, m_i, alpha, l_i = _softmax_step(s, m_i, l_i, lo, offs_m, N, M, qk_scale, WINDOW_SIZE, lo_full,
                                               hi_full, s_layout, CAUSAL, WINDOW, BLOCK_N)  # fmt: skip
            for j in range(1, n_blocks):
                slot = j % STAGES
                prev = (j - 1) % STAGES
                mbarrier.wait(kv_ready.index(slot), (j // STAGES) & 1)
                k = k_smem.index(slot).reshape([BLOCK_N, BLOCK_DQK])
                v_prev = v_smem.index(prev).reshape([BLOCK_N, BLOCK_DV])
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                mbarrier.wait(mine, j & 1)
                s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc_tok = warpgroup_mma(p_op, v_prev, acc, is_async=True)
                mbarrier.arrive(theirs, count=1)
                s = warpgroup_mma_wait(1, deps=[s_tok])
                p, m_i, alpha, l_i = _softmax_step(s, m_i, l_i, lo + j * BLOCK_N, offs_m, N, M, qk_scale,
                                                   WINDOW_SIZE, lo_full, hi_full, s_layout, CAUSAL, WINDOW,
                                                   BLOCK_N)  # fmt: skip
                acc = warpgroup_mma_wait(0, deps=[acc_tok])
                mbarrier.arrive(kv_free.index(prev), count=1)
                acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
            last = (n_blocks - 1) % STAGES
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(mine, n_blocks & 1)
            acc = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, BLOCK_DV]), acc, is_async=True)
            mbarrier.arrive(theirs, count=1)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(kv_free.index(last), count=1)
        seen = l_i > 0
        l_safe = gl.where(seen, l_i, 1.0)
        out = acc / gl.convert_layout(l_safe, rows_o)[:, None]
        lse = gl.where(seen, (m_i + gl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
        gl.store(lse_base + offs_m, lse, mask=offs_m < N)
        if VARLEN:  # rows past this sequence belong to the next one: a masked store, not the TMA's
            rows = row0 + gl.arange(0, HALF_M, layout=rows_o)
            cols = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, o_layout))
            keep = (rows[:, None] < N) & (cols[None, :] < D_V)
            gl.store(o_base + rows[:, None].to(gl.int64) * son + cols[None, :], out.to(dtype), mask=keep)
        else:
            o_tile = o_smem.index(WG)
            o_tile.reshape([HALF_M, BLOCK_DV]).store(out.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [bd, h, q0 + row0, 0], o_tile)
            tma.store_wait(pendings=0)

    @gluon.jit
    def _attn_fwd_hopper_kernel(
        q_desc,  # descriptor of q (B, Hq, N, D_QK), blocks (1, 1, BLOCK_M / 2, BLOCK_DQK): one per warpgroup
        k_desc,  # descriptor of k (B, Hkv, M, D_QK), blocks (1, 1, BLOCK_N, BLOCK_DQK)
        v_desc,  # descriptor of v (B, Hkv, M, D_V), blocks (1, 1, BLOCK_N, BLOCK_DV)
        o_desc,  # descriptor of out (B, Hq, N, D_V), blocks (1, 1, BLOCK_M / 2, BLOCK_DV); packed: unused
        # (packed sequences, VARLEN: the descriptors view the (tokens, H, D) tensors as (1, H, tokens, D))
        out_ptr, soh, son,  # packed: out (tokens, Hq, D_V) and its head and token strides (a masked store)
        D_V,  # head dim of v and out (the masked store's columns)
        lse_ptr, slb, slh,  # float32 log-sum-exp, (B, Hq, N) or packed (Hq, tokens), and its batch, head strides
        cu_q_ptr, cu_k_ptr,  # packed: (B + 1,) int32 first row of each sequence in q and k
        Hq, N, M,  # query heads, query length, key length (packed: the longest sequence's)
        GROUP,  # query heads per key/value head
        qk_scale,  # scale * log2(e) > 0: scores are kept in base 2
        WINDOW_SIZE,  # window length W (used when WINDOW)
        CAUSAL: gl.constexpr, WINDOW: gl.constexpr,  # bottom-right causal mask; sliding window on top of it
        VARLEN: gl.constexpr,  # packed sequences: lengths and first rows from cu_q_ptr, cu_k_ptr
        BLOCK_M: gl.constexpr,  # queries per program, half per consumer warpgroup
        BLOCK_N: gl.constexpr,  # keys per step
        BLOCK_DQK: gl.constexpr, BLOCK_DV: gl.constexpr,  # padded head dims (the descriptors' block widths)
        STAGES: gl.constexpr,  # key/value ring slots
        CONSUMER_REGS: gl.constexpr,  # registers per thread of the second consumer warpgroup
        num_warps: gl.constexpr,  # 4: the first consumer warpgroup (the default partition)
    ):  # fmt: skip
        HALF_M: gl.constexpr = BLOCK_M // 2
        dtype: gl.constexpr = q_desc.dtype
        start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
        b = gl.program_id(1) // Hq
        h = gl.program_id(1) % Hq
        hk = h // GROUP
        bd = b  # the descriptors' batch index
        q0 = 0
        k0 = 0
        if VARLEN:
            bd = 0
            q0 = gl.load(cu_q_ptr + b)
            N = gl.load(cu_q_ptr + b + 1) - q0
            k0 = gl.load(cu_k_ptr + b)
            M = gl.load(cu_k_ptr + b + 1) - k0
        lo = 0
        hi = M
        if CAUSAL:
            hi = gl.minimum(M, gl.maximum(0, start_m + BLOCK_M + M - N))
        if WINDOW:
            lo = (gl.maximum(0, start_m + M - N - WINDOW_SIZE + 1) // BLOCK_N) * BLOCK_N
        hi_full = (M // BLOCK_N) * BLOCK_N
        if CAUSAL:
            hi_full = gl.minimum(hi_full, (gl.maximum(0, start_m + 1 + M - N) // BLOCK_N) * BLOCK_N)
        lo_full = lo
        if WINDOW:
            lo_full = gl.cdiv(gl.maximum(0, start_m + BLOCK_M + M - N - WINDOW_SIZE), BLOCK_N) * BLOCK_N
        n_blocks = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        if start_m >= N:  # packed: past this sequence's end (the grid covers the longest); nothing to compute
            n_blocks = 0
        o_base = out_ptr + h.to(gl.int64) * soh + q0.to(gl.int64) * son
        lse_base = lse_ptr + b.to(gl.int64) * slb + h.to(gl.int64) * slh + q0

        q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, HALF_M, BLOCK_DQK], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, BLOCK_DQK], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, BLOCK_DV], v_desc.layout)
        if BLOCK_DQK == BLOCK_DV:  # each warpgroup stages its output in its own q tile, read for the last time
            o_smem = q_smem
        else:
            o_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, HALF_M, BLOCK_DV], o_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_free.index(i), count=2)  # both warpgroups release a block
        mbarrier.arrive(turn.index(0), count=1)  # the first warpgroup starts

        gl.warp_specialize(
            [  # the default partition (num_warps = 4) and the second warpgroup consume; one warp produces
                (_consumer, (o_desc, o_base, son, D_V, lse_base, q_smem, k_smem, v_smem, o_smem, q_ready, kv_ready,
                             kv_free, turn, bd, h, q0, start_m, N, M, qk_scale, WINDOW_SIZE, lo, lo_full, hi_full,
                             n_blocks, 0, CAUSAL, WINDOW, VARLEN, HALF_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, STAGES)),
                (_consumer, (o_desc, o_base, son, D_V, lse_base, q_smem, k_smem, v_smem, o_smem, q_ready, kv_ready,
                             kv_free, turn, bd, h, q0, start_m, N, M, qk_scale, WINDOW_SIZE, lo, lo_full, hi_full,
                             n_blocks, 1, CAUSAL, WINDOW, VARLEN, HALF_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, STAGES)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, kv_ready, kv_free, bd, h, hk,
                             q0 + start_m, k0 + lo, n_blocks, HALF_M, BLOCK_N, STAGES)),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip
        for i in gl.static_range(2):
            mbarrier.invalidate(q_ready.index(i))
            mbarrier.invalidate(turn.index(i))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(kv_ready.index(i))
            mbarrier.invalidate(kv_free.index(i))


if BWD_AVAILABLE:

    @_gluon_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """Add a shared-memory tile into global memory at coord through the TMA (cp.reduce.async.bulk.tensor),
        as Triton's own descriptor ``atomic_add`` does; Gluon 3.6/3.7 build the op but do not name it (private)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        kind = _triton_ir.DESCRIPTOR_REDUCE_KIND.ADD
        _semantic.builder.create_async_tma_reduce(kind, tensor_desc.handle, coord, src.handle)

    # ----------------------------------------------------------------------------------------------
    # Backward: one program per block of BLOCK_N keys of a key/value head, streaming the query blocks
    # ----------------------------------------------------------------------------------------------
    @gluon.jit
    def _bwd_producer(q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_ready, ready, free,
                      b, hk, start_n, q_lo, n_mblocks, n_steps, GROUP, BLOCK_M: gl.constexpr,
                      STAGES: gl.constexpr):  # fmt: skip
        """k and v of this key block once, then q and dout of every query block of every query head that reads
        this key/value head, in the consumers' order, each pair into the next ring slot once both freed it."""
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, start_n, 0], kv_ready, k_smem)
        tma.async_copy_global_to_shared(v_desc, [b, hk, start_n, 0], kv_ready, v_smem)
        for i in range(n_steps):
            h = hk * GROUP + i // n_mblocks
            row = q_lo + (i % n_mblocks) * BLOCK_M
            slot = i % STAGES
            if i >= STAGES:
                mbarrier.wait(free.index(slot), ((i // STAGES) - 1) & 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, row, 0], bar, q_smem.index(slot))
            tma.async_copy_global_to_shared(do_desc, [b, h, row, 0], bar, do_smem.index(slot))

    @gluon.jit
    def _bwd_consumer(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_desc, kv_ready, ready, free, ds_ready,
                      lse2_ptr, delta_ptr, ssb, ssh, dk_ptr, sdkb, sdkh, sdkn, dv_ptr, sdvb, sdvh, sdvn,
                      b, hk, start_n, q_lo, full_lo, full_hi, n_mblocks, n_steps, GROUP,
                      N, M, qk_scale, scale, WINDOW_SIZE, D_QK, D_V, WG: gl.constexpr, CAUSAL: gl.constexpr,
                      WINDOW: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_DQK: gl.constexpr, BLOCK_DV: gl.constexpr, STAGES: gl.constexpr,
                      DQ_BUFS: gl.constexpr):  # fmt: skip
        """One warpgroup's BLOCK_N / 2 keys (WG 0 or 1). Per query block, transposed so that the keys run
        along the rows: S^T = k q^T and dP^T = v dout^T, P^T = 2^(S^T - lse2), dS^T = P^T (dP^T - delta);
        dV += P^T dout and dK += dS^T q stay in registers; dS^T goes to shared memory, where, once both
        warpgroups have written theirs, this warpgroup multiplies dS with its half of k's columns and adds the
        (BLOCK_M, BLOCK_DQK / 2) result into dq's float32 accumulator with atomics."""
        HALF_N: gl.constexpr = BLOCK_N // 2
        HALF_DQK: gl.constexpr = BLOCK_DQK // 2
        dtype: gl.constexpr = q_smem.dtype
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_M, 16])  # fmt: skip
        dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_DQK, 16])  # fmt: skip
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_DV, 16])  # fmt: skip
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HALF_DQK, 16])  # fmt: skip
        pv_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
        dsq_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)
        cols_st: gl.constexpr = gl.SliceLayout(0, st_layout)
        offs_n = start_n + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, st_layout))
        dk = gl.zeros([HALF_N, BLOCK_DQK], gl.float32, layout=dk_layout)
        dv = gl.zeros([HALF_N, BLOCK_DV], gl.float32, layout=dv_layout)
        st_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=st_layout)
        dq_zero = gl.zeros([BLOCK_M, HALF_DQK], gl.float32, layout=dq_layout)
        mbarrier.wait(kv_ready, 0)
        k_all = k_smem.reshape([BLOCK_N, BLOCK_DQK])
        k_mine = k_all.slice(WG * HALF_N, HALF_N, dim=0)
        v_mine = v_smem.reshape([BLOCK_N, BLOCK_DV]).slice(WG * HALF_N, HALF_N, dim=0)
        k_cols = k_all.slice(WG * HALF_DQK, HALF_DQK, dim=1)
        for i in range(n_steps):
            h = hk * GROUP + i // n_mblocks
            start_m = q_lo + (i % n_mblocks) * BLOCK_M
            slot = i % STAGES
            q = q_smem.index(slot).reshape([BLOCK_M, BLOCK_DQK])
            do = do_smem.index(slot).reshape([BLOCK_M, BLOCK_DV])
            offs_m = start_m + gl.arange(0, BLOCK_M, layout=cols_st)
            stats = b.to(gl.int64) * ssb + h.to(gl.int64) * ssh + offs_m
            lse2 = gl.load(lse2_ptr + stats, mask=offs_m < N, other=float("inf"))  # rows past N: P = 0
            delta = gl.load(delta_ptr + stats, mask=offs_m < N, other=0.0)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            s_tok = warpgroup_mma(k_mine, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(v_mine, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s_tok])
            p = gl.exp2(s * qk_scale - lse2[None, :])
            if (start_m < full_lo) or (start_m + BLOCK_M > full_hi):  # on the mask's edge, or past N
                pos = offs_m[None, :] + (M - N)
                visible = offs_n[:, None] <= pos if CAUSAL else offs_n[:, None] >= 0
                if WINDOW:
                    visible = visible & (offs_n[:, None] > pos - WINDOW_SIZE)
                p = gl.where(visible, p, 0.0)
            dp = warpgroup_mma_wait(0, deps=[dp_tok])
            ds = (p * (dp - delta[None, :])).to(dtype)
            dv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), pv_op), do, dv, is_async=True)
            dk_tok = warpgroup_mma(gl.convert_layout(ds, dsq_op), q, dk, is_async=True)
            ds_buf = ds_smem.index(i % 2)
            ds_buf.slice(WG * HALF_N, HALF_N, dim=0).store(ds)
            fence_async_shared()
            _sync_warps()
            mbarrier.arrive(ds_ready.index(i % 2), count=1)
            mbarrier.wait(ds_ready.index(i % 2), (i // 2) & 1)  # both halves of dS^T written
            dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])  # their register operands die here
            mbarrier.arrive(free.index(slot), count=1)
            dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(0, deps=[dq_tok])
            # dq += this key block's share, through the TMA's reduction: float atomics from registers took
            # the backward from 700 to 408 TFLOP/s on the H200 (NOTES), the TMA's to 472
            tma.store_wait(pendings=DQ_BUFS - 1)  # the reduction that last used this tile has read it
            dq_tile = dq_smem.index(WG * DQ_BUFS + i % DQ_BUFS)
            dq_tile.reshape([BLOCK_M, HALF_DQK]).store(dq * scale)
            fence_async_shared()
            _tma_reduce_add(dq_desc, [b, h, start_m, WG * HALF_DQK], dq_tile)
        tma.store_wait(pendings=0)
        rows_k = start_n + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, dk_layout))
        cols_k = gl.arange(0, BLOCK_DQK, layout=gl.SliceLayout(0, dk_layout))
        dk_base = dk_ptr + b.to(gl.int64) * sdkb + hk.to(gl.int64) * sdkh
        gl.store(dk_base + rows_k[:, None].to(gl.int64) * sdkn + cols_k[None, :], (dk * scale).to(dtype),
                 mask=(rows_k[:, None] < M) & (cols_k[None, :] < D_QK))  # fmt: skip
        rows_v = start_n + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, dv_layout))
        cols_v = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, dv_layout))
        dv_base = dv_ptr + b.to(gl.int64) * sdvb + hk.to(gl.int64) * sdvh
        gl.store(dv_base + rows_v[:, None].to(gl.int64) * sdvn + cols_v[None, :], dv.to(dtype),
                 mask=(rows_v[:, None] < M) & (cols_v[None, :] < D_V))  # fmt: skip

    @gluon.jit
    def _attn_bwd_hopper_kernel(
        q_desc, do_desc,  # descriptors of q (B, Hq, N, D_QK) and dout (B, Hq, N, D_V), blocks (1, 1, BLOCK_M, *)
        dq_desc,  # descriptor of dq's float32 accumulator, zeroed, (B, Hq, N, BLOCK_DQK), blocks (1, 1, BLOCK_M,
        # BLOCK_DQK / 2): each warpgroup adds its half of the columns (rows past N fall outside, dropped)
        k_desc, v_desc,  # descriptors of k (B, Hkv, M, D_QK) and v (B, Hkv, M, D_V), blocks (1, 1, BLOCK_N, *)
        lse2_ptr, delta_ptr, ssb, ssh,  # float32 statistics of the prep kernel (base-2 lse, rowsum(dout out)),
        # and their batch and head strides (unit along positions)
        dk_ptr, sdkb, sdkh, sdkn,  # output dk, k's shape, and its strides (unit along the head dim)
        dv_ptr, sdvb, sdvh, sdvn,  # output dv likewise
        Hkv, N, M, GROUP,  # key/value heads, query and key lengths, query heads per key/value head
        qk_scale, scale,  # scale * log2(e) (scores in base 2) and the softmax scale
        WINDOW_SIZE,  # window length W (used when WINDOW)
        D_QK, D_V,  # head dims (the stores' columns)
        CAUSAL: gl.constexpr, WINDOW: gl.constexpr,  # bottom-right causal mask; sliding window on top of it
        BLOCK_M: gl.constexpr,  # queries per step
        BLOCK_N: gl.constexpr,  # keys per program, half per consumer warpgroup
        BLOCK_DQK: gl.constexpr, BLOCK_DV: gl.constexpr,  # padded head dims (the descriptors' block widths)
        STAGES: gl.constexpr,  # q/dout ring slots
        DQ_BUFS: gl.constexpr,  # dq tiles per warpgroup: 2 lets a reduction run behind the next step
        ds_layout: gl.constexpr,  # shared layout of the (BLOCK_N, BLOCK_M) dS^T tile
        CONSUMER_REGS: gl.constexpr,  # registers per thread of the second consumer warpgroup
        num_warps: gl.constexpr,  # 4: the first consumer warpgroup (the default partition)
    ):  # fmt: skip
        dtype: gl.constexpr = q_desc.dtype
        start_n = gl.program_id(0) * BLOCK_N
        b = gl.program_id(1) // Hkv
        hk = gl.program_id(1) % Hkv
        # Query blocks this key block meets (bottom-right alignment, offset M - N), [q_lo, q_hi), and those
        # that see all of it, [full_lo, full_hi): the others are masked.
        q_lo = 0
        q_hi = N
        full_lo = 0
        full_hi = (N // BLOCK_M) * BLOCK_M
        if CAUSAL:
            q_lo = (gl.maximum(0, start_n - (M - N)) // BLOCK_M) * BLOCK_M
            last_key = gl.maximum(0, start_n + BLOCK_N - 1 - (M - N))
            full_lo = gl.minimum(gl.maximum(gl.cdiv(last_key, BLOCK_M) * BLOCK_M, q_lo), N)
        if WINDOW:
            q_hi = gl.minimum(N, gl.maximum(0, start_n + BLOCK_N - 1 - (M - N) + WINDOW_SIZE))
            full_hi = gl.minimum(full_hi, (gl.maximum(0, start_n - (M - N) + WINDOW_SIZE) // BLOCK_M) * BLOCK_M)
        n_mblocks = gl.cdiv(gl.maximum(q_hi - q_lo, 0), BLOCK_M)
        n_steps = GROUP * n_mblocks

        q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, BLOCK_DQK], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, BLOCK_DV], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, BLOCK_DQK], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, BLOCK_DV], v_desc.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        dq_tiles: gl.constexpr = [2 * DQ_BUFS, 1, 1, BLOCK_M, BLOCK_DQK // 2]  # DQ_BUFS a consumer warpgroup
        dq_smem = gl.allocate_shared_memory(gl.float32, dq_tiles, dq_desc.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=2)  # both warpgroups release a query block
        for i in gl.static_range(2):
            mbarrier.init(ds_ready.index(i), count=2)  # both warpgroups wrote their half of dS^T

        gl.warp_specialize(
            [
                (_bwd_consumer, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_desc, kv_ready, ready, free,
                                 ds_ready,
                                 lse2_ptr, delta_ptr, ssb, ssh, dk_ptr, sdkb, sdkh, sdkn, dv_ptr, sdvb, sdvh, sdvn,
                                 b, hk, start_n, q_lo, full_lo, full_hi, n_mblocks,
                                 n_steps, GROUP, N, M, qk_scale, scale, WINDOW_SIZE, D_QK, D_V, 0, CAUSAL, WINDOW,
                                 BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, STAGES, DQ_BUFS)),
                (_bwd_consumer, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, dq_desc, kv_ready, ready, free,
                                 ds_ready,
                                 lse2_ptr, delta_ptr, ssb, ssh, dk_ptr, sdkb, sdkh, sdkn, dv_ptr, sdvb, sdvh, sdvn,
                                 b, hk, start_n, q_lo, full_lo, full_hi, n_mblocks,
                                 n_steps, GROUP, N, M, qk_scale, scale, WINDOW_SIZE, D_QK, D_V, 1, CAUSAL, WINDOW,
                                 BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, STAGES, DQ_BUFS)),
                (_bwd_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, k_smem, v_smem, do_smem, kv_ready, ready,
                                 free, b, hk, start_n, q_lo, n_mblocks, n_steps, GROUP, BLOCK_M, STAGES)),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip
        mbarrier.invalidate(kv_ready)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(free.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(ds_ready.index(i))


def padded(D: int) -> int:
    """Tile width for a head dim here: 64 or 128."""
    return 64 if D <= 64 else 128


def config(D: int, Dv: int) -> dict:
    """Launch keywords: 128 keys a step in three ring slots, and the registers of each consumer warpgroup (the
    producer warp keeps 24). In an H200 sweep (benchmarks/NOTES.md, "Session of 2026-11-28 from 23:47 UTC") three
    slots of 128 keys beat three, four or five slots of 64 keys at D = 64 and 128."""
    return dict(BLOCK_N=128, STAGES=3, CONSUMER_REGS=240, num_warps=4)


BWD_BLOCK_M = 64  # queries per backward step
BWD_BLOCK_N = 128  # keys per backward program: two warpgroups of 64


def bwd_config(D: int, Dv: int) -> dict:
    """Launch keywords of the backward: two ring slots of q and dout, two dq tiles per consumer warpgroup (a
    reduction runs behind the next step: +4.6% at N 16384, D 128 on the H200, NOTES), 240 registers each."""
    return dict(STAGES=2, DQ_BUFS=2, CONSUMER_REGS=240, num_warps=4)


def backward_descriptors(q, k, v, do, dq_acc):
    """Gluon tensor descriptors over q, k, v and dout (B, H, N, D) and dq's float32 accumulator: BWD_BLOCK_M rows
    of q and dout, BWD_BLOCK_N rows of k and v, BWD_BLOCK_M rows and half the columns of the accumulator."""
    fp16 = q.dtype == torch.float16

    def make(t, rows, width=None):
        block = (1, 1, rows, width or padded(t.shape[-1]))
        if t.dtype == torch.float32:
            layout = gl.NVMMASharedLayout.get_default_for(list(block), gl.float32)
        else:
            layout = _shared_layout(block, fp16)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), layout)

    return (make(q, BWD_BLOCK_M), make(do, BWD_BLOCK_M), make(dq_acc, BWD_BLOCK_M, dq_acc.shape[-1] // 2),
            make(k, BWD_BLOCK_N), make(v, BWD_BLOCK_N))  # fmt: skip


def ds_layout(fp16: bool):
    """Shared layout of the backward's (BWD_BLOCK_N, BWD_BLOCK_M) dS^T tile."""
    return _shared_layout((BWD_BLOCK_N, BWD_BLOCK_M), fp16)


def shared_bytes(D: int, Dv: int, block_n: int = 128, stages: int = 3) -> int:
    """Shared memory of one program: q (reused for the output when the widths match), the ring of k and v slots,
    the output tiles otherwise, and the barriers."""
    dqk, dv = padded(D), padded(Dv)
    out = 0 if dqk == dv else BLOCK_M * dv
    return 2 * (BLOCK_M * dqk + stages * block_n * (dqk + dv) + out) + 8 * (4 + 2 * stages)


@functools.cache
def _shared_layout(block: tuple, fp16: bool):
    """The shared-memory layout (swizzle) of a tile, the same for every call with this block: built once."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float16 if fp16 else gl.bfloat16)


def descriptors(q, k, v, out, block_n: int, packed: bool = False):
    """Gluon tensor descriptors over the four (B, H, N, D) tensors (any strides the TMA accepts) with this
    kernel's block shapes: BLOCK_M / 2 rows of q and out (one warpgroup's), block_n rows of k and v. Packed
    (tokens, H, D) tensors are viewed as (1, H, tokens, D)."""
    fp16 = q.dtype == torch.float16

    def make(t, rows):
        t = t.unsqueeze(0).transpose(1, 2) if packed else t
        block = (1, 1, rows, padded(t.shape[-1]))
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _shared_layout(block, fp16))

    return make(q, BLOCK_M // 2), make(k, block_n), make(v, block_n), make(out, BLOCK_M // 2)


def compile_for_sm90(D: int, Dv: int, dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                     window: bool = False, varlen: bool = False, backward: bool = False):  # fmt: skip
    """Compile the forward kernel (or the backward's) for an SM90 target without a GPU (Triton bundles ptxas):
    what a CPU test checks (it builds with this Triton and fits the shared memory) and what a reader inspects
    (``.asm["ptx"]``, ``.metadata.shared``). Uses ``GluonASTSource``, a private name of Triton's; raises
    ImportError without it."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    element, name = (gl.float16, "fp16") if dtype == torch.float16 else (gl.bfloat16, "bf16")
    flags = dict(CAUSAL=causal, WINDOW=window, BLOCK_DQK=padded(D), BLOCK_DV=padded(Dv))
    if backward:
        kernel = _attn_bwd_hopper_kernel
        flags.update(BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, ds_layout=ds_layout(dtype == torch.float16),
                     **bwd_config(D, Dv))  # fmt: skip
        rows = dict(q_desc=BWD_BLOCK_M, do_desc=BWD_BLOCK_M, dq_desc=BWD_BLOCK_M, k_desc=BWD_BLOCK_N,
                    v_desc=BWD_BLOCK_N)  # fmt: skip
        widths = dict(q_desc=padded(D), do_desc=padded(Dv), dq_desc=64, k_desc=padded(D), v_desc=padded(Dv))
        pointers = {"lse2_ptr": "*fp32", "delta_ptr": "*fp32", "dk_ptr": f"*{name}", "dv_ptr": f"*{name}",
                    "qk_scale": "fp32", "scale": "fp32"}  # fmt: skip
    else:
        kernel = _attn_fwd_hopper_kernel
        flags.update(VARLEN=varlen, BLOCK_M=BLOCK_M, **config(D, Dv))
        rows = dict(q_desc=BLOCK_M // 2, o_desc=BLOCK_M // 2, k_desc=flags["BLOCK_N"], v_desc=flags["BLOCK_N"])
        widths = dict(q_desc=padded(D), k_desc=padded(D), v_desc=padded(Dv), o_desc=padded(Dv))
        pointers = {"lse_ptr": "*fp32", "out_ptr": f"*{name}", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32",
                    "qk_scale": "fp32"}  # fmt: skip
    signature = {}
    for arg in inspect.signature(kernel.fn).parameters:
        if arg in flags:
            signature[arg] = "constexpr"
        elif arg in rows:
            block = [1, 1, rows[arg], widths[arg]]
            element_of, name_of = (gl.float32, "fp32") if arg == "dq_desc" else (element, name)
            layout = gl.NVMMASharedLayout.get_default_for(block, element_of)
            signature[arg] = f"tensordesc<{name_of}[{', '.join(map(str, block))}],{layout!r}>"
        else:
            signature[arg] = pointers.get(arg, "i32")
    source = GluonASTSource(kernel, signature=signature, constexprs=flags)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=flags["num_warps"]))
