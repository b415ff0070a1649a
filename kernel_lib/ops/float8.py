"""FP8 linear layers for training in Triton: e4m3 operands scaled row by row, the scales applied in the epilogue.

    quantize (rowwise):  x[i, :] ~ s[i] * q[i, :],   s[i] = max_k |x[i, k]| / FP8_MAX,   q = round(x / s) in float8
    scaled product:      y = (qa @ qb^T) * sa[:, None] * sb[None, :]      qa (M, K), qb (N, K): rows of K

Hopper's tensor cores multiply float8 (e4m3: 3 mantissa bits, up to 448; e5m2: 2 bits, up to 57344) at twice the
bfloat16 rate. A float8 value alone covers too small a range, so each row of an operand carries a float32 scale:
one per token of the activations and one per output feature of the weight in the forward. The GEMM multiplies the
float8 tiles with float32 accumulation and multiplies the (M, N) result by the two scale vectors once, at the end:
the scales cost nothing inside the K loop. Hopper adds float8 products in a narrower accumulator than float32;
``fast_accum=False`` adds each K step's partial (128 deep) into the float32 accumulator (DeepSeek-V3's promotion),
``fast_accum=True`` lets the tensor cores accumulate all of K (faster, less exact: ``torch._scaled_mm``'s
``use_fast_accum``). The layer uses fast accumulation for its output and promotes for both gradients, as torchao's
recipes do.

A linear layer's three products each need their operands scaled along the rows of the layout the GEMM reads
(K contiguous), so the backward quantizes transposed copies (torchao's "rowwise" recipe does the same):

    forward   y  = x W^T        a = x   (M, K) per token,            b = W   (N, K) per output feature
    dgrad     dx = dy W         a = dy  (M, N) per token,            b = W^T (K, N) per input feature
    wgrad     dW = dy^T x       a = dy^T (N, M) per output feature,  b = x^T (K, M) per input feature

The layer quantizes each tensor both ways in one kernel pair (``quantize_float8_both``: row and column maxima in
one read, then both casts, the column-scaled copy written transposed): x and W in the forward, whose transposed
float8 copies (1 byte an element) are what the backward keeps instead of x and W; dy in the backward. Six row
quantizations of three tensors, three of them of transposed copies, become three two-way ones.

Block scales (``recipe="blockwise"``, DeepSeek-V3's fine-grained recipe): a scale per 1 x 128 block of an
activation or gradient row and per 128 x 128 block of the weight, so one outlier costs the precision of 128
values, not of a whole row. The product then scales inside the K loop: each 128-deep step's partial is multiplied
by its blocks' scales and added to the float32 accumulator (the promotion above, for free):

    y[m, n] = sum_k  sa[m, k] * sb[n // 128, k] * (qa[m, 128k:128k+128] . qb[n, 128k:128k+128])

The weight's 128 x 128 grid serves W^T as it is (transposed), so the backward's dgrad reuses the forward's float8
weight; the wgrad quantizes dy^T and x^T in 1 x 128 blocks along the tokens.

Gradients are quantized to e4m3 by default (``grad_dtype``: e5m2 trades a mantissa bit for range). The bias and
its gradient stay in the layer's dtype. Rounding is to nearest, values clamped to the float8 range (a scale makes
the row's largest magnitude exactly FP8_MAX). The error against bfloat16 is float8's (a relative step of 2^-3 for
e4m3); the float64 references here quantize the same way, so they check the kernels, not the format.

Measured on an H200 (2026-11-29, torch 2.11, triton 3.6; ``benchmarks/bench_float8.py``, 8,192 tokens, Llama-3-8B
projections): the product alone reaches 745-858 TFLOP/s promoted and 996-1,137 fast, against cuBLAS's
(``torch._scaled_mm``) 1,130-1,217 and 1,237-1,404 (bf16 cuBLAS 671-786); a layer's training step is 1.13-1.16x
bf16 at the 14,336-wide projections and 0.74x at 4096 x 4096 (torchao's compiled ``Float8Linear``: 0.78-1.0x).
The block-scaled recipe, same GPU and run: its product 581-644 TFLOP/s (each 128-deep partial scaled in
float32 serializes the tensor-core chain), its step 0.62x bf16. Details and what is left: benchmarks/NOTES.md.

Registered as custom ops (``kernel_lib::float8_quantize``, ``float8_quantize_both``, ``float8_quantize_blocks``,
``float8_scaled_mm``, ``float8_scaled_mm_blocks``) with fake implementations, so ``torch.compile(fullgraph=True)``
traces through them. Sources: Micikevicius et al., "FP8 formats for deep learning" (2022); torchao's float8
training recipes; DeepSeek-V3's fine-grained scaling (2024).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import check_same_device, check_tensor, is_interpreting, launch_or_op, use_triton

__all__ = [
    "quantize_float8",
    "quantize_float8_ref",
    "quantize_float8_both",
    "quantize_float8_blocks",
    "quantize_float8_blocks_ref",
    "scaled_mm",
    "scaled_mm_ref",
    "scaled_mm_blocks",
    "scaled_mm_blocks_ref",
    "float8_linear",
    "float8_linear_ref",
    "Float8Linear",
    "convert_to_float8",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


# --------------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------------
def quantize_float8_ref(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (R, C) float8, scale (R,) float32) with x ~ scale[:, None] * q, row by row; an all-zero row gets scale 1."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / _fp8_max(dtype), torch.ones_like(amax))
    q = (xf / scale[:, None]).clamp(-_fp8_max(dtype), _fp8_max(dtype)).to(dtype)
    return q, scale


def quantize_float8_blocks_ref(x: torch.Tensor, block_rows: int = 1, dtype: torch.dtype = torch.float8_e4m3fn):
    """(q (R, C) float8, scales (ceil(R / block_rows), ceil(C / 128)) float32): x ~ q times the scale of its block
    of ``block_rows`` x 128 (1: a scale per row and 128 columns; 128: per 128 x 128 tile); an all-zero block gets 1.
    """
    R, C = x.shape
    xf = x.float()
    pr, pc = -R % block_rows, -C % BLOCK
    blocks = torch.nn.functional.pad(xf, (0, pc, 0, pr)).reshape((R + pr) // block_rows, block_rows, -1, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / _fp8_max(dtype), torch.ones_like(amax))
    full = scales.repeat_interleave(block_rows, 0)[:R].repeat_interleave(BLOCK, 1)[:, :C]
    q = (xf / full).clamp(-_fp8_max(dtype), _fp8_max(dtype)).to(dtype)
    return q, scales


def _expand_scales(scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A (rows, cols) grid of each element's scale from per-row (rows, KB) or per-tile (ceil(rows / 128), KB)."""
    block_rows = 1 if scales.shape[0] == rows else BLOCK
    return scales.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def scaled_mm_blocks_ref(qa, qb, sa, sb, out_dtype=torch.bfloat16, compute=torch.float64) -> torch.Tensor:
    """The block-scaled product in ``compute``: each float8 operand times its blocks' scales, then multiplied."""
    a = qa.to(compute) * _expand_scales(sa, *qa.shape).to(compute)
    b = qb.to(compute) * _expand_scales(sb, *qb.shape).to(compute)
    return (a @ b.T).to(out_dtype)


def scaled_mm_ref(qa, qb, sa, sb, bias=None, out_dtype=torch.bfloat16, compute=torch.float64) -> torch.Tensor:
    """(qa @ qb^T) * sa[:, None] * sb[None, :] (+ bias) in ``compute`` (float64: the truth), out in ``out_dtype``."""
    y = (qa.to(compute) @ qb.to(compute).T) * sa.to(compute)[:, None] * sb.to(compute)[None, :]
    return (y if bias is None else y + bias.to(compute)).to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------
BLOCK = 128  # the columns (and, for weights, rows) of a scale block: DeepSeek-V3's 1 x 128 and 128 x 128
QUANT_BLOCK = 1024  # columns a step of the quantizer (two passes over a row: its absolute maximum, then the cast)
BOTH_BLOCK_R, BOTH_BLOCK_C = 64, 128  # the two-way quantizer's tile: its transposed store goes 64 rows a line


def _mm_config(M: int, N: int) -> dict:
    """Tiles of the scaled product: 128 x 128 output, 128 columns of K a step (float8 tiles of 16 KB each), in
    groups of 8 row tiles so that neighbouring programs share b's tiles in L2."""
    if is_interpreting():
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=1)  # few programs: fast
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)


def _blocks_config() -> dict:
    """The block-scaled product: K steps of exactly one scale block (128); 128 x 128 output tiles (a weight's
    128-row block under each column tile), three stages (the scales' loads ride beside the tiles')."""
    if is_interpreting():
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=BLOCK, GROUP_M=2, num_warps=4, num_stages=1)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=BLOCK, GROUP_M=8, num_warps=8, num_stages=3)


RECIPES = ("rowwise", "blockwise")


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # (R, C) input, unit stride along C
    q_ptr,  # (R, C) float8 output, contiguous (float32 when HOST_CAST)
    scale_ptr,  # (R,) float32 output
    C,  # columns
    sxr,  # x's row stride
    FP8_MAX: tl.constexpr,  # the float8 format's largest finite value
    BLOCK: tl.constexpr,  # columns a step
    HOST_CAST: tl.constexpr,  # the interpreter: its float32 -> float8 cast is wrong (e4m3: 126.8 -> 64); the
    # scaled values are written in float32 and the launcher casts them with PyTorch
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * sxr
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, C, BLOCK):  # pass 1: the row's largest magnitude
        cols = c0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=cols < C, other=0.0).to(tl.float32)))
    top = tl.max(amax, axis=0)
    scale = tl.where(top > 0, top / FP8_MAX, 1.0)
    tl.store(scale_ptr + row, scale)
    for c0 in range(0, C, BLOCK):  # pass 2: the row again (from L2 for rows of up to a few MB) and the cast
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < C, other=0.0).to(tl.float32)
        # a division, not x * (1 / s): a row whose largest magnitude is below ~5e-36 has a subnormal s, whose
        # inverse overflows (zeros would become NaN); the quotient may still pass FP8_MAX by an ulp
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        if HOST_CAST:
            tl.store(q_ptr + row * C + cols, q, mask=cols < C)
        else:
            tl.store(q_ptr + row * C + cols, q.to(q_ptr.dtype.element_ty), mask=cols < C)


@triton.jit
def _amax_both_kernel(
    x_ptr,  # (R, C) input, unit stride along C
    row_amax_ptr,  # (R,) float32, zeroed: output, each row's largest magnitude
    col_amax_ptr,  # (C,) float32, zeroed: output, each column's largest magnitude
    R, C,  # rows and columns
    sxr,  # x's row stride
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,  # the tile a program reads
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    a = tl.abs(tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cols[None, :], mask=mask, other=0.0).to(tl.float32))
    # the maxima of magnitudes are >= 0: float atomics of max are exact and order-free
    tl.atomic_max(row_amax_ptr + rows, tl.max(a, axis=1), mask=rows < R)
    tl.atomic_max(col_amax_ptr + cols, tl.max(a, axis=0), mask=cols < C)


@triton.jit
def _cast_both_kernel(
    x_ptr,  # (R, C) input, unit stride along C
    q_ptr,  # (R, C) float8 output, contiguous: x scaled by rows (float32 when HOST_CAST)
    qt_ptr,  # (C, R) float8 output, contiguous: x^T scaled by its rows, x's columns (float32 when HOST_CAST)
    row_amax_ptr, col_amax_ptr,  # (R,), (C,) float32 from _amax_both_kernel
    row_scale_ptr, col_scale_ptr,  # (R,), (C,) float32 outputs: amax / FP8_MAX, 1 for an all-zero line
    R, C, sxr,  # as in _amax_both_kernel
    FP8_MAX: tl.constexpr,  # the float8 format's largest finite value
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    HOST_CAST: tl.constexpr,  # as in _quantize_rows_kernel
):  # fmt: skip
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok, c_ok = rows < R, cols < C
    mask = r_ok[:, None] & c_ok[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    top_r = tl.load(row_amax_ptr + rows, mask=r_ok, other=0.0)
    top_c = tl.load(col_amax_ptr + cols, mask=c_ok, other=0.0)
    s_r = tl.where(top_r > 0, top_r / FP8_MAX, 1.0)  # the same arithmetic as the row quantizer's
    s_c = tl.where(top_c > 0, top_c / FP8_MAX, 1.0)
    if pid_c == 0:  # one program a line writes its scale
        tl.store(row_scale_ptr + rows, s_r, mask=r_ok)
    if pid_r == 0:
        tl.store(col_scale_ptr + cols, s_c, mask=c_ok)
    q = tl.minimum(tl.maximum(x / s_r[:, None], -FP8_MAX), FP8_MAX)  # a division, as in _quantize_rows_kernel
    qt = tl.trans(tl.minimum(tl.maximum(x / s_c[None, :], -FP8_MAX), FP8_MAX))  # (BLOCK_C, BLOCK_R)
    q_out = q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :]
    qt_out = qt_ptr + cols[:, None].to(tl.int64) * R + rows[None, :]
    mask_t = c_ok[:, None] & r_ok[None, :]
    if HOST_CAST:
        tl.store(q_out, q, mask=mask)
        tl.store(qt_out, qt, mask=mask_t)
    else:
        tl.store(q_out, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(qt_out, qt.to(qt_ptr.dtype.element_ty), mask=mask_t)


@triton.jit
def _quantize_blocks_kernel(
    x_ptr,  # (R, C) input, unit stride along C or along R (a transposed view: read as it lies, no copy)
    q_ptr,  # (R, C) float8 output, contiguous (float32 when HOST_CAST)
    scale_ptr,  # (R, C / 128) float32 output when PER_ROW, else (R / 128, C / 128): one per block
    R, C, sxr, sxc,  # rows, columns, x's strides
    n_cblocks,  # scale columns: ceil(C / 128)
    FP8_MAX: tl.constexpr,
    PER_ROW: tl.constexpr,  # 1 x 128 blocks (activations, gradients); else 128 x 128 (weights)
    TILE_R: tl.constexpr, BLOCK_C: tl.constexpr,  # rows a program (128 for weights: one block), 128 columns
    HOST_CAST: tl.constexpr,  # as in _quantize_rows_kernel
):  # fmt: skip
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * TILE_R + tl.arange(0, TILE_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxr + cols[None, :].to(tl.int64) * sxc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if PER_ROW:  # a scale per row of the tile
        top = tl.max(tl.abs(x), axis=1)
        scale = tl.where(top > 0, top / FP8_MAX, 1.0)
        tl.store(scale_ptr + rows.to(tl.int64) * n_cblocks + pid_c, scale, mask=rows < R)
        q = x / scale[:, None]
    else:  # one scale for the tile
        top = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = tl.where(top > 0, top / FP8_MAX, 1.0)
        tl.store(scale_ptr + pid_r * n_cblocks + pid_c, scale)
        q = x / scale
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    out = q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :]
    if HOST_CAST:
        tl.store(out, q, mask=mask)
    else:
        tl.store(out, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _output_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's rows and columns of the (M, N) output: programs walk GROUP_M row tiles column by column, so
    neighbours share b's tiles in L2 (grouped ordering)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _scaled_mm_blocks_kernel(
    a_ptr,  # (M, K) float8, unit stride along K
    b_ptr,  # (N, K) float8, unit stride along K
    sa_ptr,  # (M, KB) float32: a's scale per row and 128 columns of K
    sb_ptr,  # (N, KB) float32 when B_PER_ROW, else (ceil(N / 128), KB): per 128 x 128 block
    y_ptr,  # (M, N) output, contiguous
    M, N, K,  # the product's sizes
    sam, sbn,  # row strides of a and b
    KB,  # scale columns: ceil(K / 128)
    B_PER_ROW: tl.constexpr,  # b's scales per row (a gradient or an activation) or per tile (a weight)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # output tile (BLOCK_N 128 when not B_PER_ROW: one b block)
    BLOCK_K: tl.constexpr,  # 128: a scale block a step
    GROUP_M: tl.constexpr,  # as in _scaled_mm_kernel
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (the interpreter)
):  # fmt: skip
    offs_m, offs_n = _output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * sam
    b_cols = b_ptr + offs_n[None, :].to(tl.int64) * sbn
    sa_rows = sa_ptr + offs_m.to(tl.int64) * KB
    if B_PER_ROW:
        sb_rows = sb_ptr + offs_n.to(tl.int64) * KB
    else:
        sb_rows = sb_ptr + (offs_n // BLOCK_K).to(tl.int64) * KB  # BLOCK_N <= 128 tiles sit in one block
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:  # a fresh partial a step: scaled, then added in float32
            part = tl.dot(a, b)
        sa = tl.load(sa_rows + kb, mask=m_mask, other=0.0)
        sb = tl.load(sb_rows + kb, mask=n_mask, other=0.0)
        acc += part * sa[:, None] * sb[None, :]
    out = y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _scaled_mm_kernel(
    a_ptr,  # (M, K) float8, unit stride along K
    b_ptr,  # (N, K) float8, unit stride along K
    sa_ptr,  # (M,) float32: a's row scales
    sb_ptr,  # (N,) float32: b's row scales
    bias_ptr,  # (N,) in y's dtype; unused unless HAS_BIAS
    y_ptr,  # (M, N) output, contiguous
    M, N, K,  # the product's sizes
    sam, sbn,  # row strides of a and b
    HAS_BIAS: tl.constexpr,
    FAST_ACCUM: tl.constexpr,  # accumulate all of K in the tensor cores' narrow accumulator (else promote a step)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # output tile, K a step
    GROUP_M: tl.constexpr,  # row tiles a group: programs of a group walk its columns together (L2 reuse of b)
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (the interpreter)
):  # fmt: skip
    offs_m, offs_n = _output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * sam
    b_cols = b_ptr + offs_n[None, :].to(tl.int64) * sbn  # b^T's tile (BLOCK_K, BLOCK_N) read in place, K-major
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif FAST_ACCUM:  # both tiles K-major, as Hopper's float8 products require; Triton's default on Hopper:
            acc = tl.dot(a, b, acc)  # all of K in the narrow accumulator
        else:  # each step's partial added to acc in float32: errors do not grow with K
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    sa = tl.load(sa_ptr + offs_m, mask=m_mask, other=0.0)
    sb = tl.load(sb_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------
_TL_FP8 = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def _quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = x if x.stride(-1) == 1 else x.contiguous()
    R, C = x.shape
    host_cast = is_interpreting()
    q = torch.empty((R, C), device=x.device, dtype=torch.float32 if host_cast else dtype)
    scale = torch.empty((R,), device=x.device, dtype=torch.float32)
    if R and C:
        _quantize_rows_kernel[(R,)](x, q, scale, C, x.stride(0), FP8_MAX=_fp8_max(dtype), BLOCK=QUANT_BLOCK,
                                    HOST_CAST=host_cast)  # fmt: skip
    elif R:
        scale.fill_(1.0)
    return q.to(dtype), scale


def _quantize_both(x: torch.Tensor, dtype: torch.dtype):
    x = x if x.stride(-1) == 1 else x.contiguous()
    R, C = x.shape
    host_cast = is_interpreting()
    q_dtype = torch.float32 if host_cast else dtype
    q = torch.empty((R, C), device=x.device, dtype=q_dtype)
    qt = torch.empty((C, R), device=x.device, dtype=q_dtype)
    amax = torch.zeros(R + C, device=x.device, dtype=torch.float32)  # one zeroing for both
    scale, scale_t = (torch.ones(n, device=x.device, dtype=torch.float32) for n in (R, C))  # separate: no aliases
    if R and C:
        grid = (triton.cdiv(R, BOTH_BLOCK_R), triton.cdiv(C, BOTH_BLOCK_C))
        _amax_both_kernel[grid](x, amax[:R], amax[R:], R, C, x.stride(0), BLOCK_R=BOTH_BLOCK_R,
                                BLOCK_C=BOTH_BLOCK_C)  # fmt: skip
        _cast_both_kernel[grid](x, q, qt, amax[:R], amax[R:], scale, scale_t, R, C, x.stride(0),
                                FP8_MAX=_fp8_max(dtype), BLOCK_R=BOTH_BLOCK_R, BLOCK_C=BOTH_BLOCK_C,
                                HOST_CAST=host_cast)  # fmt: skip
    return q.to(dtype), scale, qt.to(dtype), scale_t


def _quantize_blocks(x: torch.Tensor, block_rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    transposed = x.stride(0) == 1 and x.stride(1) != 1  # dy^T and x^T of the weight gradient: read in place
    x = x if x.stride(-1) == 1 or transposed else x.contiguous()
    R, C = x.shape
    n_cblocks = triton.cdiv(C, BLOCK)
    host_cast = is_interpreting()
    q = torch.empty((R, C), device=x.device, dtype=torch.float32 if host_cast else dtype)
    scales = torch.ones((R if block_rows == 1 else triton.cdiv(R, BLOCK), n_cblocks), device=x.device,
                        dtype=torch.float32)  # fmt: skip
    if R and C:
        # a weight's tile is its block; a transposed view's tiles are taller: its rows are the contiguous side
        tile_r = BLOCK if block_rows == BLOCK else (16 if host_cast else (64 if transposed else 32))
        _quantize_blocks_kernel[(triton.cdiv(R, tile_r), n_cblocks)](
            x, q, scales, R, C, x.stride(0), x.stride(1), n_cblocks, FP8_MAX=_fp8_max(dtype), PER_ROW=block_rows == 1,
            TILE_R=tile_r, BLOCK_C=BLOCK, HOST_CAST=host_cast, num_warps=8 if tile_r == BLOCK else 4,
        )  # fmt: skip
    return q.to(dtype), scales


def _scaled_mm_blocks(qa, qb, sa, sb, out_dtype: torch.dtype) -> torch.Tensor:
    M, K = qa.shape
    N = qb.shape[0]
    y = torch.empty((M, N), device=qa.device, dtype=out_dtype)
    if M and N:
        c = _blocks_config()
        grid = (triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]),)
        _scaled_mm_blocks_kernel[grid](
            qa, qb, sa, sb, y, M, N, K, qa.stride(0), qb.stride(0), triton.cdiv(K, BLOCK),
            B_PER_ROW=sb.shape[0] == N, DOT_FP32=is_interpreting(), **c,
        )  # fmt: skip
    return y


def _scaled_mm(qa, qb, sa, sb, bias, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    M, K = qa.shape
    N = qb.shape[0]
    y = torch.empty((M, N), device=qa.device, dtype=out_dtype)
    if M and N:
        c = _mm_config(M, N)
        grid = (triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]),)
        _scaled_mm_kernel[grid](
            qa, qb, sa, sb, bias if bias is not None else y, y, M, N, K, qa.stride(0), qb.stride(0),
            HAS_BIAS=bias is not None, FAST_ACCUM=fast_accum, DOT_FP32=is_interpreting(), **c,
        )  # fmt: skip
    return y


# --------------------------------------------------------------------------------------------------
# torch.library registration: opaque ops with fake implementations, what torch.compile records
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::float8_quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize(x, dtype)


@_quantize_op.register_fake
def _(x, dtype):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape[:1], dtype=torch.float32)


@torch.library.custom_op("kernel_lib::float8_quantize_both", mutates_args=())
def _quantize_both_op(
    x: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _quantize_both(x, dtype)


@_quantize_both_op.register_fake
def _(x, dtype):
    R, C = x.shape
    f32 = torch.float32
    return x.new_empty((R, C), dtype=dtype), x.new_empty((R,), dtype=f32), x.new_empty((C, R), dtype=dtype), \
        x.new_empty((C,), dtype=f32)  # fmt: skip


@torch.library.custom_op("kernel_lib::float8_scaled_mm", mutates_args=())
def _scaled_mm_op(
    qa: torch.Tensor, qb: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: Optional[torch.Tensor],
    out_dtype: torch.dtype, fast_accum: bool,
) -> torch.Tensor:  # fmt: skip
    return _scaled_mm(qa, qb, sa, sb, bias, out_dtype, fast_accum)


@_scaled_mm_op.register_fake
def _(qa, qb, sa, sb, bias, out_dtype, fast_accum):
    return qa.new_empty((qa.shape[0], qb.shape[0]), dtype=out_dtype)


@torch.library.custom_op("kernel_lib::float8_quantize_blocks", mutates_args=())
def _quantize_blocks_op(x: torch.Tensor, block_rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_blocks(x, block_rows, dtype)


@_quantize_blocks_op.register_fake
def _(x, block_rows, dtype):
    R, C = x.shape
    rows = R if block_rows == 1 else -(-R // BLOCK)
    return x.new_empty((R, C), dtype=dtype), x.new_empty((rows, -(-C // BLOCK)), dtype=torch.float32)


@torch.library.custom_op("kernel_lib::float8_scaled_mm_blocks", mutates_args=())
def _scaled_mm_blocks_op(
    qa: torch.Tensor, qb: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:  # fmt: skip
    return _scaled_mm_blocks(qa, qb, sa, sb, out_dtype)


@_scaled_mm_blocks_op.register_fake
def _(qa, qb, sa, sb, out_dtype):
    return qa.new_empty((qa.shape[0], qb.shape[0]), dtype=out_dtype)


# --------------------------------------------------------------------------------------------------
# Autograd: the three products of a linear layer, each on operands quantized along its K
# --------------------------------------------------------------------------------------------------
def _q(x, dtype):
    return launch_or_op(_quantize, _quantize_op)(x, dtype)


def _qb(x, block_rows, dtype):
    return launch_or_op(_quantize_blocks, _quantize_blocks_op)(x, block_rows, dtype)


def _mmb(qa, qb, sa, sb, out_dtype):
    return launch_or_op(_scaled_mm_blocks, _scaled_mm_blocks_op)(qa, qb, sa, sb, out_dtype)


def _q2(x, dtype):
    return launch_or_op(_quantize_both, _quantize_both_op)(x, dtype)


def _mm(qa, qb, sa, sb, bias, out_dtype, fast_accum=False):
    return launch_or_op(_scaled_mm, _scaled_mm_op)(qa, qb, sa, sb, bias, out_dtype, fast_accum)


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, grad_dtype, recipe):
        ctx.grad_dtype, ctx.has_bias, ctx.dtypes, ctx.recipe = (
            grad_dtype,
            bias is not None,
            (x.dtype, weight.dtype),
            recipe,
        )
        e4m3 = torch.float8_e4m3fn
        if recipe == "blockwise":  # x in 1 x 128 blocks, W in 128 x 128: W's float8 copy serves the dgrad too
            qx, sx = _qb(x, 1, e4m3)
            qw, sw = _qb(weight, BLOCK, e4m3)
            ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, qw, sw)
            y = _mmb(qx, qw, sx, sw, x.dtype)
            return y if bias is None else y + bias
        # rowwise: each operand quantized both ways when the backward needs its transposed copy (dx needs W^T,
        # dW needs x^T)
        if ctx.needs_input_grad[1]:
            qx, sx, qxt, sxt = _q2(x, e4m3)
        else:
            (qx, sx), qxt, sxt = _q(x, e4m3), None, None
        if ctx.needs_input_grad[0]:
            qw, sw, qwt, swt = _q2(weight, e4m3)
        else:
            (qw, sw), qwt, swt = _q(weight, e4m3), None, None
        ctx.save_for_backward(qxt, sxt, qwt, swt)  # float8 copies: a byte an element kept, not x's and W's two
        return _mm(qx, qw, sx, sw, bias, x.dtype, fast_accum=True)  # the output: fast, as torchao's recipes

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = db = None
        if ctx.recipe == "blockwise":
            x, qw, sw = ctx.saved_tensors
            if need_dx:  # dx = dy W: dy in 1 x 128 blocks along N; W^T's 128 x 128 grid is W's, transposed
                qdy, sdy = _qb(dy, 1, ctx.grad_dtype)
                dx = _mmb(qdy, qw.t().contiguous(), sdy, sw.t().contiguous(), ctx.dtypes[0])
            if need_dw:  # dW = dy^T x: both in 1 x 128 blocks along the tokens
                qdyt, sdyt = _qb(dy.t(), 1, ctx.grad_dtype)
                qxt, sxt = _qb(x.t(), 1, torch.float8_e4m3fn)
                dw = _mmb(qdyt, qxt, sdyt, sxt, ctx.dtypes[1])
        else:
            qxt, sxt, qwt, swt = ctx.saved_tensors
            if need_dx and need_dw:  # dy by rows (dx = dy W) and by columns (dW = dy^T x) from one two-way pass
                qdy, sdy, qdyt, sdyt = _q2(dy, ctx.grad_dtype)
            elif need_dx:
                qdy, sdy = _q(dy, ctx.grad_dtype)
            elif need_dw:
                qdyt, sdyt = _q(dy.t(), ctx.grad_dtype)
            if need_dx:  # dx = dy W: dy per token, W^T per input feature
                dx = _mm(qdy, qwt, sdy, swt, None, ctx.dtypes[0])
            if need_dw:  # dW = dy^T x: dy^T per output feature, x^T per input feature
                dw = _mm(qdyt, qxt, sdyt, sxt, None, ctx.dtypes[1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(dim=0, dtype=torch.float32).to(dy.dtype)
        return dx, dw, db, None, None


# --------------------------------------------------------------------------------------------------
# Functional API and module
# --------------------------------------------------------------------------------------------------
def _check_float8_device(t: torch.Tensor) -> None:
    """Float8 tensor-core products exist from compute capability 8.9 (Ada, Hopper): say so before Triton fails."""
    if t.is_cuda and torch.cuda.get_device_capability(t.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(t.device)
        raise RuntimeError(f"float8 products need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                           f"{torch.cuda.get_device_name(t.device)} is {major}.{minor}")  # fmt: skip


def quantize_float8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (R, C) float8, scale (R,) float32), x (R, C) ~ scale[:, None] * q: each row scaled so its largest
    magnitude is the format's largest value. Any strides; float16, bfloat16 or float32."""
    check_tensor(x, "x", ndim=2)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    if not use_triton(x, op="quantize_float8"):
        return quantize_float8_ref(x, dtype)
    return _q(x, dtype)


def quantize_float8_both(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """``quantize_float8(x) + quantize_float8(x.t())`` in one read of x: (q (R, C), scale (R,), qt (C, R), scale_t
    (C,)), qt x^T's rows (x's columns) scaled each by its largest magnitude, written contiguous."""
    check_tensor(x, "x", ndim=2)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    if not use_triton(x, op="quantize_float8_both"):
        return (*quantize_float8_ref(x, dtype), *quantize_float8_ref(x.t(), dtype))
    return _q2(x, dtype)


def _check_operands(qa, qb, sa, sb, scale_ndim: int) -> None:
    """Float8 operands with a unit stride along K, float32 scales of ``scale_ndim`` dimensions."""
    for name, t in (("qa", qa), ("qb", qb)):
        check_tensor(t, name, dtypes=FP8_DTYPES, ndim=2)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride along K, got strides {t.stride()}")
    check_tensor(sa, "sa", dtypes=(torch.float32,), ndim=scale_ndim)
    check_tensor(sb, "sb", dtypes=(torch.float32,), ndim=scale_ndim)


def scaled_mm(qa, qb, sa, sb, bias=None, out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = False):
    """(qa @ qb^T) * sa[:, None] * sb[None, :] (+ bias) in ``out_dtype``: qa (M, K) and qb (N, K) float8 with a unit
    stride along K (what :func:`quantize_float8` returns), sa (M,) and sb (N,) float32. ``fast_accum``: accumulate
    all of K in Hopper's narrow float8 accumulator (faster, less exact; see the module docstring). No autograd."""
    _check_operands(qa, qb, sa, sb, scale_ndim=1)
    if qa.shape[1] != qb.shape[1] or sa.shape[0] != qa.shape[0] or sb.shape[0] != qb.shape[0]:
        raise ValueError(f"qa {tuple(qa.shape)}, qb {tuple(qb.shape)}, sa {tuple(sa.shape)} and sb "
                         f"{tuple(sb.shape)} do not make (M, K) x (N, K) with a scale a row")  # fmt: skip
    if bias is not None:
        check_tensor(bias, "bias", dtypes=(out_dtype,), ndim=1)
    check_same_device(qa=qa, qb=qb, sa=sa, sb=sb, bias=bias)
    _check_float8_device(qa)
    if not use_triton(qa, op="scaled_mm"):
        return scaled_mm_ref(qa, qb, sa, sb, bias, out_dtype, compute=torch.float32)
    return _mm(qa, qb, sa, sb, bias, out_dtype, bool(fast_accum))


def quantize_float8_blocks(x: torch.Tensor, block_rows: int = 1, dtype: torch.dtype = torch.float8_e4m3fn):
    """(q (R, C) float8, scales float32): a scale per ``block_rows`` x 128 block of x (1: per row and 128 columns,
    shape (R, ceil(C / 128)); 128: per 128 x 128 tile, shape (ceil(R / 128), ceil(C / 128))). Any strides."""
    check_tensor(x, "x", ndim=2)
    if block_rows not in (1, BLOCK):
        raise ValueError(f"block_rows must be 1 (1 x 128 blocks) or {BLOCK} (128 x 128), got {block_rows}")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    if not use_triton(x, op="quantize_float8_blocks"):
        return quantize_float8_blocks_ref(x, block_rows, dtype)
    return _qb(x, block_rows, dtype)


def scaled_mm_blocks(qa, qb, sa, sb, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The block-scaled product (the module docstring): qa (M, K) float8 with sa (M, ceil(K / 128)), qb (N, K)
    float8 with sb (N, ceil(K / 128)) per row or (ceil(N / 128), ceil(K / 128)) per tile, as
    :func:`quantize_float8_blocks` returns them; a unit stride along K. No autograd."""
    _check_operands(qa, qb, sa, sb, scale_ndim=2)
    (M, K), N = qa.shape, qb.shape[0]
    KB = -(-K // BLOCK)
    if qb.shape[1] != K or tuple(sa.shape) != (M, KB) or tuple(sb.shape) not in ((N, KB), (-(-N // BLOCK), KB)):
        raise ValueError(f"qa {tuple(qa.shape)}, qb {tuple(qb.shape)}, sa {tuple(sa.shape)} and sb "
                         f"{tuple(sb.shape)}: want (M, K) x (N, K), sa (M, ceil(K/128)), sb (N or ceil(N/128), "
                         f"ceil(K/128))")  # fmt: skip
    check_same_device(qa=qa, qb=qb, sa=sa, sb=sb)
    _check_float8_device(qa)
    if not use_triton(qa, op="scaled_mm_blocks"):
        return scaled_mm_blocks_ref(qa, qb, sa, sb, out_dtype, compute=torch.float32)
    return _mmb(qa, qb, sa, sb, out_dtype)


def float8_linear_ref(x, weight, bias=None, grad_dtype=torch.float8_e4m3fn, recipe="rowwise"):
    """The forward of :func:`float8_linear` in plain PyTorch, float64 arithmetic on the same float8 operands."""
    rows = x.reshape(-1, x.shape[-1])
    if recipe == "blockwise":
        (qx, sx), (qw, sw) = quantize_float8_blocks_ref(rows, 1), quantize_float8_blocks_ref(weight, BLOCK)
        y = scaled_mm_blocks_ref(qx, qw, sx, sw, torch.float64) + (0 if bias is None else bias.double())
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
    qx, sx = quantize_float8_ref(rows, torch.float8_e4m3fn)
    qw, sw = quantize_float8_ref(weight, torch.float8_e4m3fn)
    return scaled_mm_ref(qx, qw, sx, sw, bias, x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def float8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
    grad_dtype: torch.dtype = torch.float8_e4m3fn, recipe: str = "rowwise",
) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)`` with its three products in float8 (the module docstring): x (..., K) and
    weight (N, K) in float16, bfloat16 or float32, one dtype; returns x's dtype. Differentiable in x, weight and
    bias; ``grad_dtype`` is the gradient's float8 format; ``recipe`` "rowwise" (a scale a row) or "blockwise"
    (1 x 128 blocks of activations and gradients, 128 x 128 of the weight)."""
    check_tensor(x, "x", min_ndim=1)
    check_tensor(weight, "weight", ndim=2)
    if bias is not None:
        check_tensor(bias, "bias", ndim=1)
    check_same_device(x=x, weight=weight, bias=bias)
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"x, weight and bias must share one dtype, got {x.dtype}, {weight.dtype}"
                        f"{'' if bias is None else ', ' + str(bias.dtype)}")  # fmt: skip
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.shape[1]}")
    if grad_dtype not in FP8_DTYPES:
        raise ValueError(f"grad_dtype must be one of {FP8_DTYPES}, got {grad_dtype}")
    _checked_recipe(recipe)
    _check_float8_device(x)
    rows = x.reshape(-1, x.shape[-1])
    if use_triton(x, op="float8_linear"):
        y = _Float8Linear.apply(rows, weight, bias, grad_dtype, recipe)
    else:  # no Triton (CPU without the interpreter): the same forward in PyTorch, the backward not quantized
        y = torch.nn.functional.linear(_fake_quantize(rows, recipe, 1), _fake_quantize(weight, recipe, BLOCK), bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _fake_quantize(t: torch.Tensor, recipe: str = "rowwise", block_rows: int = 1) -> torch.Tensor:
    """t rounded through e4m3 (row by row, or by blocks) in the forward, the identity for gradients."""
    if recipe == "blockwise":
        q, scales = quantize_float8_blocks_ref(t, block_rows)
        rounded = q.float() * _expand_scales(scales, *t.shape)
    else:
        q, scale = quantize_float8_ref(t)
        rounded = q.float() * scale[:, None]
    return t + (rounded.to(t.dtype) - t).detach()


class Float8Linear(torch.nn.Linear):
    """``nn.Linear`` whose forward and backward products run in float8 (:func:`float8_linear`, with its
    ``grad_dtype`` and ``recipe``); the weight stays in its dtype (the optimizer's copy) and is quantized at every
    call, as dynamic scaling does."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 grad_dtype: torch.dtype = torch.float8_e4m3fn, recipe: str = "rowwise"):  # fmt: skip
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.grad_dtype, self.recipe = grad_dtype, _checked_recipe(recipe)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, grad_dtype: torch.dtype = torch.float8_e4m3fn,
                    recipe: str = "rowwise") -> "Float8Linear":  # fmt: skip
        """A Float8Linear holding ``linear``'s own parameters (shared, not copied)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features, new.grad_dtype = linear.in_features, linear.out_features, grad_dtype
        new.recipe = _checked_recipe(recipe)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias, self.grad_dtype, self.recipe)

    def extra_repr(self) -> str:
        grad = str(self.grad_dtype).removeprefix("torch.")
        return super().extra_repr() + f", float8 {self.recipe} (grad {grad})"


def _checked_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    return recipe


def convert_to_float8(model: torch.nn.Module, skip=("lm_head", "head"), grad_dtype=torch.float8_e4m3fn,
                      recipe: str = "rowwise"):  # fmt: skip
    """Swap every ``nn.Linear`` of ``model`` in place for a :class:`Float8Linear` sharing its parameters (with
    ``grad_dtype`` and ``recipe``), except modules whose qualified name ends with an entry of ``skip`` (the output
    projection by default: its logits are the loss's input, where float8's error shows first). Returns the
    model."""
    _checked_recipe(recipe)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is torch.nn.Linear and not any(full.endswith(s) for s in skip):
                setattr(module, child_name, Float8Linear.from_linear(child, grad_dtype, recipe))
    return model
