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
the tensors suit the TMA; the portable Triton kernel serves everything else, and the backward.
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

BLOCK_M = 128  # queries per program: two warpgroups of 64 rows
MAX_BLOCK_D = 128  # widest padded head dim served here (q and k, v apart)
SHARED_LIMIT = 232_448  # bytes of shared memory a block may use on SM90 (227 KiB)

if AVAILABLE:

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


def padded(D: int) -> int:
    """Tile width for a head dim here: 64 or 128."""
    return 64 if D <= 64 else 128


def config(D: int, Dv: int) -> dict:
    """Launch keywords: 128 keys a step in three ring slots, and the registers of each consumer warpgroup (the
    producer warp keeps 24). In an H200 sweep (benchmarks/NOTES.md, "Session of 2026-11-28 from 23:47 UTC") three
    slots of 128 keys beat three, four or five slots of 64 keys at D = 64 and 128."""
    return dict(BLOCK_N=128, STAGES=3, CONSUMER_REGS=240, num_warps=4)


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
                     window: bool = False, varlen: bool = False):  # fmt: skip
    """Compile the kernel for an SM90 target without a GPU (Triton bundles ptxas): what a CPU test checks (it
    builds with this Triton and fits the shared memory) and what a reader inspects (``.asm["ptx"]``,
    ``.metadata.shared``). Uses ``GluonASTSource``, a private name of Triton's; raises ImportError without it."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    element, name = (gl.float16, "fp16") if dtype == torch.float16 else (gl.bfloat16, "bf16")
    flags = dict(
        CAUSAL=causal,
        WINDOW=window,
        VARLEN=varlen,
        BLOCK_M=BLOCK_M,
        BLOCK_DQK=padded(D),
        BLOCK_DV=padded(Dv),
        **config(D, Dv),
    )
    rows = dict(q_desc=BLOCK_M // 2, o_desc=BLOCK_M // 2, k_desc=flags["BLOCK_N"], v_desc=flags["BLOCK_N"])
    widths = dict(q_desc=padded(D), k_desc=padded(D), v_desc=padded(Dv), o_desc=padded(Dv))
    signature = {}
    for arg in inspect.signature(_attn_fwd_hopper_kernel.fn).parameters:
        if arg in flags:
            signature[arg] = "constexpr"
        elif arg in rows:
            block = [1, 1, rows[arg], widths[arg]]
            layout = gl.NVMMASharedLayout.get_default_for(block, element)
            signature[arg] = f"tensordesc<{name}[{', '.join(map(str, block))}],{layout!r}>"
        else:
            pointers = {"lse_ptr": "*fp32", "out_ptr": f"*{name}", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}
            signature[arg] = {**pointers, "qk_scale": "fp32"}.get(arg, "i32")
    source = GluonASTSource(_attn_fwd_hopper_kernel, signature=signature, constexprs=flags)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=flags["num_warps"]))
