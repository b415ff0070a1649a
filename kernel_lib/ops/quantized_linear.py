"""Weight-only quantized linear layers for decoding in Triton: int8 per output channel, int4 in groups.

    int8:  W[n, k] ~ scale[n] * q[n, k]                        q in [-127, 127],  scale[n] = max_k |W[n, k]| / 127
    int4:  W[n, k] ~ scale[n, g] * (q[n, k] - zero[n, g])      q in [0, 15],  g = k // group  (asymmetric)

    y = x @ W^T (+ bias)          x (..., K) in float16 / bfloat16 / float32, W (N, K) quantized

Decoding one token reads every weight of the model once per step and does two FLOPs per weight: its time is the
weights' bytes over the memory bandwidth. int8 halves those bytes against bfloat16, int4 quarters them (plus one
scale and one zero point a group). The kernel loads the quantized tile, converts it in registers and feeds the
tensor cores in x's dtype, so nothing but the small integers and the scales comes from memory. Two int4 values share
a byte, the even column in the low nibble. int8's scale multiplies the accumulator once at the end (one scale a
row); int4's scale and zero point act on the partial product of each group (the kernel's comments say how).

Speed (H200, bf16, one row, CUDA graphs, weights read from memory; benchmarks/NOTES.md, 2026-11-29): int8 is
0.93-1.54x bf16 ``F.linear`` at the 7B and 1B shapes (20-70% of the copy ceiling, where cuBLAS reads bf16 at
42-90%), short of the 2x its bytes allow; torchao's compiled int8 is ahead at the 7B qkv, o and gate-up shapes
(1.14-1.77x) and behind at the others (0.17-0.83x). int4 is correct but slower than bf16 (0.6-0.97x, 10-23% of
copy): for int4 weights use torchao's ``Int4WeightOnlyConfig`` (tinygemm, 1.2-1.95x bf16 at one row) for now.

Rounding is to nearest. Quantization error: at most scale / 2 a weight (int8: max |W[n]| / 254; int4: the group's
range / 30); the kernel's own error is float32 accumulation. Inference only (no autograd).

Registered as the ``kernel_lib::int8_linear`` and ``kernel_lib::int4_linear`` custom ops with fake
implementations, so ``torch.compile(fullgraph=True)`` traces through them. Sources: Dettmers et al., "LLM.int8()"
(2022) for per-channel absmax scales; Frantar et al., "GPTQ" (2023) and torchao's int4 weight-only layout for
group-wise asymmetric int4 (this file's packing is its own).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ._utils import as_rows, check_same_device, check_tensor, is_interpreting, launch_or_op, use_triton

__all__ = [
    "quantize_int8",
    "quantize_int4",
    "dequantize_int8",
    "dequantize_int4",
    "int8_linear",
    "int4_linear",
    "QuantizedLinear",
    "quantize_",
    "config",
]


# --------------------------------------------------------------------------------------------------
# Quantizers and their inverses (the references)
# --------------------------------------------------------------------------------------------------
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (N, K), scale float32 (N,)) with weight ~ scale[:, None] * q; a zero row gets scale 1."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale[:, None]


def quantize_int4(weight: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 (N, K / 2), scale float32 (N, K / group), zero float32 (N, K / group)) with weight ~
    scale * (q - zero) group by group: scale = (max - min) / 15, zero = -min / scale (kept as a float, so the 16
    levels run from the group's min to its max); q in [0, 15], two a byte (even column low). ``group`` a power of
    two >= 32 (the kernel's smallest step along K: 16 bytes a row, each a product 16 wide) dividing K."""
    N, K = weight.shape
    if group < 32 or group & (group - 1) or K % group:
        raise ValueError(f"int4 needs a group that is a power of two >= 32 and divides K: K = {K}, group = {group}")
    w = weight.detach().float().reshape(N, K // group, group)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = -low / scale  # a float: the 16 levels span exactly [low, high], so no weight is clipped
    q = torch.round(w / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8).reshape(N, K)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, zero


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    N = packed.shape[0]
    q = torch.stack((packed & 15, packed >> 4), dim=2).reshape(N, -1).float()
    group = q.shape[1] // scale.shape[1]
    return (q.reshape(N, -1, group) - zero[..., None]).mul(scale[..., None]).reshape(N, -1)


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------
# x's dtype -> (bits, value) of the float whose mantissa's low bits take an int4 value exactly (see the kernel)
MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


def config(M: int, N: int, K: int, bits: int, group: int, device: torch.device, x_bytes: int = 2) -> dict:
    """The kernel's tile and launch settings for y (M, N) = x (M, K) @ W^T: 16 rows of x a program for a decoding
    step (the smallest tile of a tensor-core product), and narrow output tiles, so that the programs cover every
    SM and the weight is streamed by the whole GPU. ``benchmarks/bench_quantized_linear.py --sweep`` measures the
    alternatives."""
    if is_interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2 if K >= 128 else 1, SWAP=False, num_warps=4,
                    num_stages=1)  # fmt: skip
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    # The best settings of benchmarks/bench_quantized_linear.py --sweep (H200, 2026-11-29, benchmarks/NOTES.md):
    # int8 32 output rows a program (64 for long rows), 256 columns a step; int4 128 rows, 128 columns (64
    # bytes a row, one group); then splits of K, at most 4 (int8) or 8 (int4), until about four programs an SM
    # stream the weight.
    block_m = 16 if M <= 16 else 64
    if bits == 8:
        block_n, block_k, most, stages = (64 if K >= 12288 else 32), 256, 4, 4
    else:
        block_n, block_k, most, stages = 128, min(group, 128), 8, 2
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    split = 1
    while split < most and tiles * split * 2 <= 4 * sms and K // (split * 2) >= 2 * block_k:
        split *= 2
    if block_m == 64 or x_bytes == 4:  # x's tile grows: keep the stages within shared memory
        block_n, block_k, stages = min(block_n, 64), min(block_k, 128), min(stages, 3)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, SWAP=False,
                num_warps=4 if block_m == 16 else 8, num_stages=stages)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------
@triton.jit
def _mma(x, w, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """x (BLOCK_M, k) times w (BLOCK_N, k) transposed, in float32: (BLOCK_M, BLOCK_N), or its transpose if SWAP
    (the weight tile as the product's left operand)."""
    # constexpr branches with one result each: Triton types a helper's returns before it drops the dead branch
    if SWAP:
        if IEEE:
            r = tl.dot(w, tl.trans(x), input_precision="ieee")
        else:
            r = tl.dot(w, tl.trans(x))
    else:
        if IEEE:
            r = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            r = tl.dot(x, tl.trans(w))
    return r


@triton.jit
def _per_n(v, SWAP: tl.constexpr):
    """A vector over output features, broadcast along the accumulator's N axis."""
    if SWAP:
        r = v[:, None]
    else:
        r = v[None, :]
    return r


@triton.jit
def _per_m(v, SWAP: tl.constexpr):
    """A vector over rows of x, broadcast along the accumulator's M axis."""
    if SWAP:
        r = v[None, :]
    else:
        r = v[:, None]
    return r


@triton.jit
def _quantized_linear_kernel(
    x_ptr,  # (M, K) activations, unit stride along K
    w_ptr,  # int8 (N, K) (BITS 8) or uint8 (N, K / 2) (BITS 4), contiguous
    scale_ptr,  # float32 (N,) (BITS 8) or (N, K / GROUP) (BITS 4)
    zero_ptr,  # float32 (N, K / GROUP) (BITS 4; unused for 8)
    bias_ptr,  # (N,) in x's dtype; unused unless HAS_BIAS
    y_ptr,  # output (M, N), contiguous, x's dtype
    part_ptr,  # float32 (SPLIT_K, M, N): each split's partial product (SPLIT_K > 1)
    count_ptr,  # int32 (output tiles,), zero: splits done a tile (SPLIT_K > 1)
    M, N, K,  # rows of x, output features, input features
    sxm,  # x's row stride
    K_SPLIT,  # columns of K a split, a multiple of BLOCK_K
    BITS: tl.constexpr,  # 8 or 4
    GROUP: tl.constexpr,  # columns a scale and zero point (BITS 4), a multiple of BLOCK_K
    MAGIC_BITS: tl.constexpr,  # BITS 4: the bits of MAGIC in x's 16-bit dtype (0x4300 bfloat16, 0x6400 float16), or 0
    MAGIC: tl.constexpr,  # its value (128.0, 1024.0; 0.0 with float32 x: a plain conversion)
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs along K a tile of y; the last to finish adds the partials up
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # tile of y, and of K a step
    SWAP: tl.constexpr,  # accumulate y^T (BLOCK_N, BLOCK_M): the weight tile is the product's left operand
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (the interpreter's bf16 dot is wrong)
):  # fmt: skip
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask, m_mask = offs_n < N, offs_m < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * sxm
    k_lo = tl.program_id(2) * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    IEEE: tl.constexpr = DOT_FP32 or x_ptr.dtype.element_ty == tl.float32  # float32 x: full precision, not TF32
    if DOT_FP32:
        compute = tl.float32
    else:
        compute = x_ptr.dtype.element_ty
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BITS == 8:  # q exact in x's dtype (|q| <= 127); the row's scale multiplies the sum once, at the end
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0)  # fmt: skip
            acc += _mma(x.to(compute), w.to(compute), SWAP, IEEE)
    else:
        # Byte j of a row holds columns 2j (low nibble) and 2j + 1 (high): the low nibbles meet the even columns
        # of x, the high ones the odd columns, two products of half the width. A step stays in one group, so
        # sum_k x_k s (q_k - z) = s (sum_k x_k q_k - z sum_k x_k): the scale and zero point act on the
        # (BLOCK_M, BLOCK_N) partial product, not on every weight. q is not converted by an int-to-float
        # instruction (a quarter of the FP32 rate): written into the low mantissa bits of MAGIC (128 in
        # bfloat16, 1024 in float16, floats spaced 1 apart there), its bits read as MAGIC + q; the products
        # then count MAGIC sum_k x_k extra, taken off with z. The next step's bytes, scales and zero points are
        # loaded before this step's products (Triton's pipelining does not take these loads, which feed integer
        # operations, not a product directly), so a step's memory latency hides behind the previous step.
        offs_j = tl.arange(0, BLOCK_K // 2)
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * (K // 2)
        groups = offs_n.to(tl.int64) * (K // GROUP)
        first = k_lo // 2 + offs_j
        byte_next = tl.load(w_rows + first[None, :], mask=n_mask[:, None] & (first < k_hi // 2)[None, :], other=0)
        scale_next = tl.load(scale_ptr + groups + k_lo // GROUP, mask=n_mask & (k_lo < k_hi), other=0.0)
        zero_next = tl.load(zero_ptr + groups + k_lo // GROUP, mask=n_mask & (k_lo < k_hi), other=0.0)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            byte, scale, zero = byte_next, scale_next, zero_next
            k1 = k0 + BLOCK_K
            nxt = k1 // 2 + offs_j
            byte_next = tl.load(w_rows + nxt[None, :], mask=n_mask[:, None] & (nxt < k_hi // 2)[None, :], other=0)
            scale_next = tl.load(scale_ptr + groups + k1 // GROUP, mask=n_mask & (k1 < k_hi), other=0.0)
            zero_next = tl.load(zero_ptr + groups + k1 // GROUP, mask=n_mask & (k1 < k_hi), other=0.0)
            offs_b = k0 // 2 + offs_j
            x_mask = m_mask[:, None] & (offs_b < k_hi // 2)[None, :]
            x_even = tl.load(x_rows + 2 * offs_b[None, :], mask=x_mask, other=0.0)
            x_odd = tl.load(x_rows + 2 * offs_b[None, :] + 1, mask=x_mask, other=0.0)
            if MAGIC_BITS:
                lo = ((byte & 15).to(tl.int32) | MAGIC_BITS).to(tl.uint16).to(x_ptr.dtype.element_ty, bitcast=True)
                hi = ((byte >> 4).to(tl.int32) | MAGIC_BITS).to(tl.uint16).to(x_ptr.dtype.element_ty, bitcast=True)
            else:
                lo, hi = byte & 15, byte >> 4
            part = _mma(x_even.to(compute), lo.to(compute), SWAP, IEEE)
            part += _mma(x_odd.to(compute), hi.to(compute), SWAP, IEEE)
            x_sum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=1)  # (BLOCK_M,)
            acc += (part - _per_n(zero + MAGIC, SWAP) * _per_m(x_sum, SWAP)) * _per_n(scale, SWAP)
    tile = pid_m * tl.num_programs(0) + pid_n
    _finish(acc, offs_m, offs_n, M, N, tile, tl.program_id(2), scale_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
            BITS, HAS_BIAS, SPLIT_K, SWAP)  # fmt: skip


@triton.jit
def _finish(acc, offs_m, offs_n, M, N, tile, split_id, scale_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
            BITS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SWAP: tl.constexpr):  # fmt: skip
    """Write a program's tile of y: its partial product, scaled (int8), biased and rounded, or with SPLIT_K > 1 its
    share into part_ptr, the split that arrives last at the tile's counter adding them all up, in split order."""
    n_mask, m_mask = offs_n < N, offs_m < M
    if SWAP:
        at = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        keep = m_mask[None, :] & n_mask[:, None]
    else:
        at = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        keep = m_mask[:, None] & n_mask[None, :]
    last = True
    if SPLIT_K > 1:
        tl.store(part_ptr + split_id * M * N + at, acc, mask=keep)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = done == SPLIT_K - 1
        if last:
            acc = tl.load(part_ptr + at, mask=keep, other=0.0, cache_modifier=".cg")
            for split in range(1, SPLIT_K):
                acc += tl.load(part_ptr + split * M * N + at, mask=keep, other=0.0, cache_modifier=".cg")
    if last:
        if BITS == 8:
            acc = acc * _per_n(tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0), SWAP)
        if HAS_BIAS:
            acc = acc + _per_n(tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32), SWAP)
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=keep)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------
def _forward(x, weight, scale, zero, bias, bits: int, group: int, settings: Optional[dict] = None) -> torch.Tensor:
    rows = as_rows(x)
    M, K = rows.shape
    N = weight.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M and N:
        c = dict(settings or config(M, N, K, bits, group, x.device, x.element_size()))
        split = c.pop("SPLIT_K", 1)
        if bits == 4 and group % c["BLOCK_K"]:
            raise ValueError(f"int4: BLOCK_K {c['BLOCK_K']} must divide the group {group} (one group a step)")
        k_split = triton.cdiv(triton.cdiv(K, split), c["BLOCK_K"]) * c["BLOCK_K"]
        split = triton.cdiv(K, k_split)  # no split without columns
        grid = (triton.cdiv(N, c["BLOCK_N"]), triton.cdiv(M, c["BLOCK_M"]), split)
        part = torch.empty((split, M, N) if split > 1 else (1,), device=x.device, dtype=torch.float32)
        count = torch.zeros(grid[0] * grid[1] if split > 1 else 1, device=x.device, dtype=torch.int32)
        magic_bits, magic = MAGIC.get(x.dtype, (0, 0.0))
        args = (weight, scale, zero if zero is not None else scale, bias if bias is not None else y, y, part, count)
        constants = dict(BITS=bits, GROUP=group, MAGIC_BITS=magic_bits, MAGIC=magic, HAS_BIAS=bias is not None,
                         SPLIT_K=split)  # fmt: skip
        _quantized_linear_kernel[grid](
            rows, *args, M, N, K, rows.stride(0), k_split, DOT_FP32=is_interpreting(), **constants, **c
        )
    return y.view(*x.shape[:-1], N)


@torch.library.custom_op("kernel_lib::int8_linear", mutates_args=())
def _int8_linear_op(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    return _forward(x, q, scale, None, bias, 8, 1)


@_int8_linear_op.register_fake
def _(x, q, scale, bias):
    return x.new_empty((*x.shape[:-1], q.shape[0]))


@torch.library.custom_op("kernel_lib::int4_linear", mutates_args=())
def _int4_linear_op(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    return _forward(x, packed, scale, zero, bias, 4, 2 * packed.shape[1] // scale.shape[1])


@_int4_linear_op.register_fake
def _(x, packed, scale, zero, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


# --------------------------------------------------------------------------------------------------
# Functional API and module
# --------------------------------------------------------------------------------------------------
def _check(x, weight, scale, bias, K: int, dtype: torch.dtype) -> None:
    check_tensor(x, "x", min_ndim=1)
    check_tensor(weight, "weight", dtypes=(dtype,), ndim=2)
    check_tensor(scale, "scale", dtypes=(torch.float32,))
    if bias is not None:
        check_tensor(bias, "bias", dtypes=(x.dtype,), ndim=1)
    check_same_device(x=x, weight=weight, scale=scale, bias=bias)
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {K}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError("quantized linear layers are for inference (no autograd): call them under torch.no_grad()")


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None):
    """x @ (scale[:, None] * q)^T (+ bias) with q int8 (N, K) and scale float32 (N,) from :func:`quantize_int8`."""
    _check(x, q, scale, bias, q.shape[1], torch.int8)
    if not use_triton(x, op="int8_linear"):  # CPU without the interpreter: the reference
        y = x.float() @ dequantize_int8(q, scale).T
        return (y if bias is None else y + bias.float()).to(x.dtype)
    return launch_or_op(lambda *a: _forward(*a[:3], None, a[3], 8, 1), _int8_linear_op)(x, q, scale, bias)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                bias: Optional[torch.Tensor] = None):  # fmt: skip
    """x @ W^T (+ bias) with W stored as :func:`quantize_int4` packs it: packed uint8 (N, K / 2), scale and zero
    float32 (N, K / group)."""
    _check(x, packed, scale, bias, 2 * packed.shape[1], torch.uint8)
    check_tensor(zero, "zero", dtypes=(torch.float32,))
    if zero.shape != scale.shape or packed.shape[0] != scale.shape[0] or (2 * packed.shape[1]) % scale.shape[1]:
        raise ValueError(f"packed {tuple(packed.shape)}, scale {tuple(scale.shape)} and zero {tuple(zero.shape)} "
                         "do not describe one int4 weight")  # fmt: skip
    group = 2 * packed.shape[1] // scale.shape[1]
    if not use_triton(x, op="int4_linear"):
        y = x.float() @ dequantize_int4(packed, scale, zero).T
        return (y if bias is None else y + bias.float()).to(x.dtype)
    launch = lambda *a: _forward(*a[:4], a[4], 4, group)  # noqa: E731
    return launch_or_op(launch, _int4_linear_op)(x, packed, scale, zero, bias)


class QuantizedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is stored in int8 (per output channel) or int4 (groups), for inference."""

    def __init__(self, linear: torch.nn.Linear, bits: int = 8, group: int = 128):
        super().__init__()
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        self.bits, self.group = bits, group
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if bits == 8:
            q, scale = quantize_int8(linear.weight)
            self.register_buffer("zero", None)
        else:
            q, scale, zero = quantize_int4(linear.weight, group)
            self.register_buffer("zero", zero)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return int8_linear(x, self.qweight, self.scale, self.bias)
        return int4_linear(x, self.qweight, self.scale, self.zero, self.bias)

    def extra_repr(self) -> str:
        group = "" if self.bits == 8 else f", group={self.group}"
        return f"{self.in_features}, {self.out_features}, bits={self.bits}{group}, bias={self.bias is not None}"


def quantize_(model: torch.nn.Module, bits: int = 8, group: int = 128, skip=("lm_head",)) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` in place by a :class:`QuantizedLinear` (int4: those whose input
    features ``group`` divides), except modules whose qualified name ends with an entry of ``skip`` (the output
    projection by default). Returns the model."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, torch.nn.Linear) or any(full.endswith(s) for s in skip):
                continue
            if bits == 4 and child.in_features % group:
                continue
            setattr(module, child_name, QuantizedLinear(child, bits, group))
    return model
