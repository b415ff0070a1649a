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

Gradients are quantized to e4m3 by default (``grad_dtype``: e5m2 trades a mantissa bit for range). The bias and
its gradient stay in the layer's dtype. Rounding is to nearest, values clamped to the float8 range (a scale makes
the row's largest magnitude exactly FP8_MAX). The error against bfloat16 is float8's (a relative step of 2^-3 for
e4m3); the float64 references here quantize the same way, so they check the kernels, not the format.

Measured on an H200 (2026-11-29, torch 2.11, triton 3.6; ``benchmarks/bench_float8.py``, 8,192 tokens, Llama-3-8B
projections): the product alone reaches 745-858 TFLOP/s promoted and 996-1,137 fast, against cuBLAS's
(``torch._scaled_mm``) 1,130-1,217 and 1,237-1,404 (bf16 cuBLAS 671-786); a layer's training step is 1.13-1.16x
bf16 at the 14,336-wide projections and 0.74x at 4096 x 4096, where torchao's compiled ``Float8Linear`` is 0.78x.
Details and what is left: benchmarks/NOTES.md.

Registered as the ``kernel_lib::float8_quantize``, ``float8_quantize_both`` and ``float8_scaled_mm`` custom ops
with fake implementations, so ``torch.compile(fullgraph=True)`` traces through them. Sources: Micikevicius et al., "FP8
formats for deep learning" (2022); torchao's float8 training recipes; DeepSeek-V3's fine-grained scaling (2024).
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
    "scaled_mm",
    "scaled_mm_ref",
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


def scaled_mm_ref(qa, qb, sa, sb, bias=None, out_dtype=torch.bfloat16, compute=torch.float64) -> torch.Tensor:
    """(qa @ qb^T) * sa[:, None] * sb[None, :] (+ bias) in ``compute`` (float64: the truth), out in ``out_dtype``."""
    y = (qa.to(compute) @ qb.to(compute).T) * sa.to(compute)[:, None] * sb.to(compute)[None, :]
    return (y if bias is None else y + bias.to(compute)).to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------
QUANT_BLOCK = 1024  # columns a step of the quantizer (two passes over a row: its absolute maximum, then the cast)
BOTH_BLOCK_R, BOTH_BLOCK_C = 64, 128  # the two-way quantizer's tile: its transposed store goes 64 rows a line


def _mm_config(M: int, N: int) -> dict:
    """Tiles of the scaled product: 128 x 128 output, 128 columns of K a step (float8 tiles of 16 KB each), in
    groups of 8 row tiles so that neighbouring programs share b's tiles in L2."""
    if is_interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)


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
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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


# --------------------------------------------------------------------------------------------------
# Autograd: the three products of a linear layer, each on operands quantized along its K
# --------------------------------------------------------------------------------------------------
def _q(x, dtype):
    return launch_or_op(_quantize, _quantize_op)(x, dtype)


def _q2(x, dtype):
    return launch_or_op(_quantize_both, _quantize_both_op)(x, dtype)


def _mm(qa, qb, sa, sb, bias, out_dtype, fast_accum=False):
    return launch_or_op(_scaled_mm, _scaled_mm_op)(qa, qb, sa, sb, bias, out_dtype, fast_accum)


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, grad_dtype):
        ctx.grad_dtype, ctx.has_bias, ctx.dtypes = grad_dtype, bias is not None, (x.dtype, weight.dtype)
        e4m3 = torch.float8_e4m3fn
        # each operand quantized both ways when the backward needs its transposed copy (dx needs W^T, dW needs x^T)
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
        qxt, sxt, qwt, swt = ctx.saved_tensors
        dx = dw = db = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
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
        return dx, dw, db, None


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


def scaled_mm(qa, qb, sa, sb, bias=None, out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = False):
    """(qa @ qb^T) * sa[:, None] * sb[None, :] (+ bias) in ``out_dtype``: qa (M, K) and qb (N, K) float8 with a unit
    stride along K (what :func:`quantize_float8` returns), sa (M,) and sb (N,) float32. ``fast_accum``: accumulate
    all of K in Hopper's narrow float8 accumulator (faster, less exact; see the module docstring). No autograd."""
    for name, t in (("qa", qa), ("qb", qb)):
        check_tensor(t, name, dtypes=FP8_DTYPES, ndim=2)
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride along K, got strides {t.stride()}")
    check_tensor(sa, "sa", dtypes=(torch.float32,), ndim=1)
    check_tensor(sb, "sb", dtypes=(torch.float32,), ndim=1)
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


def float8_linear_ref(x, weight, bias=None, grad_dtype=torch.float8_e4m3fn):
    """The forward of :func:`float8_linear` in plain PyTorch, float64 arithmetic on the same float8 operands."""
    qx, sx = quantize_float8_ref(x.reshape(-1, x.shape[-1]), torch.float8_e4m3fn)
    qw, sw = quantize_float8_ref(weight, torch.float8_e4m3fn)
    return scaled_mm_ref(qx, qw, sx, sw, bias, x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def float8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
    grad_dtype: torch.dtype = torch.float8_e4m3fn,
) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)`` with its three products in float8 (the module docstring): x (..., K) and
    weight (N, K) in float16, bfloat16 or float32, one dtype; returns x's dtype. Differentiable in x, weight and
    bias; ``grad_dtype`` is the gradient's float8 format."""
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
    _check_float8_device(x)
    rows = x.reshape(-1, x.shape[-1])
    if use_triton(x, op="float8_linear"):
        y = _Float8Linear.apply(rows, weight, bias, grad_dtype)
    else:  # no Triton (CPU without the interpreter): the same forward in PyTorch, the backward not quantized
        y = torch.nn.functional.linear(_fake_quantize(rows), _fake_quantize(weight), bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _fake_quantize(t: torch.Tensor) -> torch.Tensor:
    """t rounded through e4m3 row by row in the forward, the identity for gradients (straight through)."""
    q, scale = quantize_float8_ref(t)
    return t + ((q.float() * scale[:, None]).to(t.dtype) - t).detach()


class Float8Linear(torch.nn.Linear):
    """``nn.Linear`` whose forward and backward products run in float8 (:func:`float8_linear`); the weight stays
    in its dtype (the optimizer's copy) and is quantized at every call, as dynamic scaling does."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 grad_dtype: torch.dtype = torch.float8_e4m3fn):  # fmt: skip
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.grad_dtype = grad_dtype

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, grad_dtype: torch.dtype = torch.float8_e4m3fn) -> "Float8Linear":
        """A Float8Linear holding ``linear``'s own parameters (shared, not copied)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features, new.grad_dtype = linear.in_features, linear.out_features, grad_dtype
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias, self.grad_dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", float8 (grad {str(self.grad_dtype).removeprefix('torch.')})"


def convert_to_float8(model: torch.nn.Module, skip=("lm_head", "head"), grad_dtype=torch.float8_e4m3fn):
    """Swap every ``nn.Linear`` of ``model`` in place for a :class:`Float8Linear` sharing its parameters, except
    modules whose qualified name ends with an entry of ``skip`` (the output projection by default: its logits are
    the loss's input, where float8's error shows first). Returns the model."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is torch.nn.Linear and not any(full.endswith(s) for s in skip):
                setattr(module, child_name, Float8Linear.from_linear(child, grad_dtype))
    return model
