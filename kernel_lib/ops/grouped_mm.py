"""Grouped matrix multiplication in Triton: one launch multiplies each group of rows by its own matrix.

For x (T, K), w (E, K, N) and offs (E,) int32, the cumulative end row of each group (as ``torch._grouped_mm``
takes them; group e owns rows offs[e-1]:offs[e], and a group may be empty)::

    out[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e]                                 out: (T, N)

This is the expert computation of a Mixture-of-Experts layer once tokens are sorted by expert. A per-expert
Python loop launches E matmuls, most of them small; here one launch covers every (group, row tile, column tile).
The grid is sized without reading offs on the host (no synchronization): at most cdiv(T, BLOCK_M) + E row tiles
exist, each program finds its group by scanning offs, and programs past the last tile skip their loop. Tiles
run in bands of a few row tiles (``_tile_of``) so that the programs in flight share operands in L2. Backward:
dx = grouped dy @ w[e].T (the same kernel on a transposed view of w) and dw[e] = x_e.T @ dy_e (a second kernel,
one program per (group, K tile, N tile) looping over the group's rows; an empty group gets zeros).

float32 inputs multiply in full float32 (``input_precision="ieee"``), not TF32, so they match PyTorch's default.
Sources: Gale et al., MegaBlocks (2022); Triton's grouped-GEMM tutorial.
"""

import torch
import triton
import triton.language as tl

from ._utils import (
    autotune_requested,
    autotuned,
    check_same_device,
    check_same_dtype,
    check_tensor,
    launch_or_op,
    pick_config,
    sm_count,
    use_triton,
)

__all__ = ["grouped_mm", "grouped_mm_ref"]


def grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The definition: a loop over groups in plain PyTorch, float32 accumulation (float64 for float64)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    out = x.new_zeros((x.shape[0], w.shape[2]), dtype=compute)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].to(compute) @ w[e].to(compute)
        start = end
    return out.to(x.dtype)


_CONFIGS = [
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=2),  # first: interpreted
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
]
BAND = 8  # row tiles that share one sweep over the column tiles (see _tile_of)


def _smem_bytes(config, args) -> int:
    """Shared memory of one program: a (BLOCK_M, BLOCK_K) and a (BLOCK_K, BLOCK_N) tile per pipeline stage."""
    kw = config.kwargs
    element = args["x_ptr"].element_size() if "x_ptr" in args else 2
    return config.num_stages * (kw["BLOCK_M"] * kw["BLOCK_K"] + kw["BLOCK_K"] * kw["BLOCK_N"]) * element


def fwd_preferred(T: int, N: int, E: int, device: torch.device, transposed: bool = False) -> list:
    """Configs of the forward kernel (and of dx, the same kernel on w transposed), best first. Groups of a tile's
    rows or fewer (T / E <= 64; reading w transposed, <= 128) take 64-row tiles, which pad less. Otherwise
    128 x 256 tiles when there are enough of them to fill the GPU twice over, else 128 x 128 so that more programs
    run; reading w transposed, the wide tiles' strided loads pay off only with four times as many tiles and
    N >= 2048. Fitted on 25 shapes (``benchmarks/NOTES.md``)."""
    big, mid, small, narrow = _CONFIGS[3], _CONFIGS[1], _CONFIGS[0], _CONFIGS[4]
    if T <= (128 if transposed else 64) * E:
        return [narrow, mid, small]
    tiles = (triton.cdiv(T, 128) + E) * triton.cdiv(N, 256)
    sms = (
        sm_count(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else 1
    )
    wide = tiles >= 8 * sms and N >= 2048 if transposed else tiles >= 2 * sms
    return [big, mid, small] if wide else [mid, small]


def dw_preferred() -> list:
    """Configs of the weight-gradient kernel, best first (its reduction runs over a group's rows)."""
    return [_CONFIGS[4], _CONFIGS[0]]


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    if DOT_FP32:  # the interpreter's bf16 dot is wrong: upcast first (CPU only; False on the GPU)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _tile_of(pid, n_row_tiles, n_col_tiles, BAND: tl.constexpr):
    """(row tile, column tile) of program ``pid``, in bands of BAND row tiles, rows fastest within a band.

    Programs that run at the same time then share a few row tiles of one operand and a few column tiles of the
    other, so both stay in L2. With row tiles fastest over the whole grid, every column tile would re-read all
    of x from HBM (with column tiles fastest, all of w).
    """
    per_band = BAND * n_col_tiles
    first_row = (pid // per_band) * BAND
    rows_in_band = tl.minimum(n_row_tiles - first_row, BAND)
    row_tile = first_row + (pid % per_band) % rows_in_band
    col_tile = (pid % per_band) // rows_in_band
    return row_tile, col_tile


@triton.jit
def _grouped_mm_kernel(
    x_ptr,  # (T, K)
    w_ptr,  # (E, K, N), any strides
    offs_ptr,  # (E,) int32 cumulative group ends
    out_ptr,  # (T, N) contiguous
    sxt, sxk,  # x strides
    swe, swk, swn,  # w strides
    T, K, N, E,  # rows, inner size, columns, groups
    DOT_FP32: tl.constexpr,  # upcast before tl.dot (the interpreter's bf16 dot is wrong)
    IEEE: tl.constexpr,  # float32 inputs: full-precision dot, not TF32
    BAND: tl.constexpr,  # row tiles per band of the tile order
    BLOCK_E: tl.constexpr,  # power of two >= E: offs is scanned as one vector
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # At most cdiv(T, BLOCK_M) + E row tiles exist (each group adds at most one partial tile).
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(T, BLOCK_M) + E, tl.cdiv(N, BLOCK_N), BAND)
    # Find this program's (group, row tile): tiles are numbered group after group. All of offs is read at once and
    # scanned as a vector, not in a loop of E scalar loads (H100, E = 64: 460 against 449 TFLOP/s, a small gain).
    es = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + es, mask=es < E, other=0)
    starts = tl.load(offs_ptr + es - 1, mask=(es > 0) & (es < E), other=0)
    tiles = tl.where(es < E, tl.cdiv(ends - starts, BLOCK_M), 0)
    tiles_through = tl.cumsum(tiles, 0)  # row tiles of groups 0..e
    group = tl.sum((tiles_through <= pid_m).to(tl.int32), 0)  # the first group whose tiles reach past pid_m
    mine = es == group  # no group when pid_m is past the last tile: then every row is masked off
    tiles_before = tl.sum(tl.where(mine, tiles_through - tiles, 0), 0)
    row_start = tl.sum(tl.where(mine, starts, 0), 0) + (pid_m - tiles_before) * BLOCK_M
    row_end = tl.sum(tl.where(mine, ends, 0), 0)
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < row_end
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * sxt
    w_group = w_ptr + group.to(tl.int64) * swe
    k_stop = tl.where(row_start < row_end, K, 0)  # a program past the last tile skips the loop
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_stop, BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(x_rows + (k0 + ks)[None, :] * sxk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            w_group + (k0 + ks)[:, None] * swk + cols[None, :] * swn,
            mask=k_ok[:, None] & (cols[None, :] < N),
            other=0.0,
        )
        acc = _dot(a, b, acc, DOT_FP32, IEEE)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < N))


@triton.jit
def _grouped_dw_kernel(
    x_ptr,  # (T, K)
    dy_ptr,  # (T, N) contiguous
    offs_ptr,  # (E,) int32 cumulative group ends
    dw_ptr,  # (E, K, N) contiguous
    sxt, sxk,  # x strides
    K, N, E,  # inner size, columns, groups
    DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
    BAND: tl.constexpr,  # K tiles per band of the tile order
    BLOCK_M: tl.constexpr,  # rows per step
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Group-major order: the programs running together work on one group, whose rows of x and dy they share in L2.
    tiles_per_group = tl.cdiv(K, BLOCK_K) * tl.cdiv(N, BLOCK_N)
    e = tl.program_id(0) // tiles_per_group
    pid_k, pid_n = _tile_of(tl.program_id(0) % tiles_per_group, tl.cdiv(K, BLOCK_K), tl.cdiv(N, BLOCK_N), BAND)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.where(e > 0, tl.load(offs_ptr + e - 1, mask=e > 0, other=0), 0)
    end = tl.load(offs_ptr + e)
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        xt = tl.load(
            x_ptr + rows.to(tl.int64)[None, :] * sxt + ks[:, None] * sxk,
            mask=row_ok[None, :] & (ks[:, None] < K),
            other=0.0,
        )
        dy = tl.load(
            dy_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
            mask=row_ok[:, None] & (cols[None, :] < N),
            other=0.0,
        )
        acc = _dot(xt, dy, acc, DOT_FP32, IEEE)
    dw_ptrs = dw_ptr + e.to(tl.int64) * K * N + ks[:, None] * N + cols[None, :]
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(ks[:, None] < K) & (cols[None, :] < N))


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------
def _forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    T, K = x.shape
    E, _, N = w.shape
    out = torch.empty((T, N), device=x.device, dtype=x.dtype)
    if T == 0 or N == 0:
        return out
    flags = dict(
        BAND=BAND, BLOCK_E=triton.next_power_of_2(E), DOT_FP32=x.device.type == "cpu", IEEE=x.dtype == torch.float32
    )

    def grid(meta):  # one program per (row tile, column tile); tiles past the last group's end return at once
        return ((triton.cdiv(T, meta["BLOCK_M"]) + E) * triton.cdiv(N, meta["BLOCK_N"]),)

    args = (x, w, offs, out, *x.stride(), *w.stride(), T, K, N, E)
    if autotune_requested():
        _grouped_mm_tuned[grid](*args, **flags)
    else:
        preferred = fwd_preferred(T, N, E, x.device, transposed=w.stride(2) != 1)
        config = pick_config(preferred, _CONFIGS[0], _smem_bytes, {"x_ptr": x})
        _grouped_mm_kernel[grid](*args, **flags, **config)
    return out


def _grad_weight(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, E: int) -> torch.Tensor:
    T, K = x.shape
    N = dy.shape[1]
    dw = torch.empty((E, K, N), device=x.device, dtype=x.dtype)
    flags = dict(BAND=BAND, DOT_FP32=x.device.type == "cpu", IEEE=x.dtype == torch.float32)

    def grid(meta):  # one program per (group, K tile, N tile)
        return (E * triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    args = (x, dy.contiguous(), offs, dw, *x.stride(), K, N, E)
    if autotune_requested():
        _grouped_dw_tuned[grid](*args, **flags)
    else:
        _grouped_dw_kernel[grid](*args, **flags, **pick_config(dw_preferred(), _CONFIGS[0], _smem_bytes, {"x_ptr": x}))
    return dw


# --------------------------------------------------------------------------------------------------
# torch.library registration: opaque ops with fake implementations, what torch.compile records
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _forward(x, w, offs)


@_grouped_mm_op.register_fake
def _(x, w, offs):
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("kernel_lib::grouped_mm_grad_weight", mutates_args=())
def _grad_weight_op(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, n_groups: int) -> torch.Tensor:
    return _grad_weight(x, dy, offs, n_groups)


@_grad_weight_op.register_fake
def _(x, dy, offs, n_groups):
    return x.new_empty((n_groups, x.shape[1], dy.shape[1]))


# --------------------------------------------------------------------------------------------------
# Autograd: the launchers in eager mode, the ops under torch.compile (see _utils.launch_or_op)
# --------------------------------------------------------------------------------------------------
class _GroupedMM(torch.autograd.Function):
    """No check of offs here: callers that build offs themselves (the MoE layer) call this directly."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return launch_or_op(_forward, _grouped_mm_op)(x, w, offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dx = (
            launch_or_op(_forward, _grouped_mm_op)(dy.contiguous(), w.transpose(1, 2), offs)
            if ctx.needs_input_grad[0]
            else None
        )
        dw = launch_or_op(_grad_weight, _grad_weight_op)(x, dy, offs, w.shape[0]) if ctx.needs_input_grad[1] else None
        return dx, dw, None


# --------------------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------------------
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, check_offs: bool = True) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of x (T, K) times w[e] (E, K, N); offs int32 (E,), non-decreasing, offs[-1] = T.

    Returns (T, N) in x's dtype (float32, float16 or bfloat16); differentiable in x and w. With ``check_offs``
    (the default, outside torch.compile) the offsets' values are checked on the host, which waits for the GPU
    once per call; pass ``check_offs=False`` where offs is built by code you trust (the MoE layer does), so the
    call stays asynchronous like ``torch._grouped_mm``. Bad offsets are then not detected.
    """
    check_tensor(x, "x", ndim=2)
    check_tensor(w, "w", ndim=3)
    check_tensor(offs, "offs", dtypes=(torch.int32,), ndim=1)
    check_same_dtype(x=x, w=w)
    check_same_device(x=x, w=w, offs=offs)
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w must have shape (E, {x.shape[1]}, N) to match x's K, got {tuple(w.shape)}")
    if offs.shape[0] != w.shape[0]:
        raise ValueError(f"offs must have one entry per group of w ({w.shape[0]}), got {offs.shape[0]}")
    if check_offs and not torch.compiler.is_compiling():  # reading offs on the host would break the graph
        ends = offs.tolist()
        if any(b < a for a, b in zip([0, *ends[:-1]], ends, strict=True)):
            raise ValueError(f"offs must be non-decreasing and start at 0 or more, got {ends}")
        if ends[-1] != x.shape[0]:
            raise ValueError(f"offs[-1] must equal the number of rows of x ({x.shape[0]}), got {ends[-1]}")
    if not use_triton(x, w, op="grouped_mm"):  # CPU without the interpreter: the reference, differentiated
        return grouped_mm_ref(x, w, offs)
    return _GroupedMM.apply(x, w, offs.contiguous())


# --------------------------------------------------------------------------------------------------
# The same kernels under triton.autotune, launched instead when KERNEL_LIB_AUTOTUNE=1
# --------------------------------------------------------------------------------------------------
_grouped_mm_tuned = autotuned(_grouped_mm_kernel, _CONFIGS, ["K", "N", "E"], _smem_bytes)
_grouped_dw_tuned = autotuned(_grouped_dw_kernel, _CONFIGS, ["K", "N", "E"], _smem_bytes)
