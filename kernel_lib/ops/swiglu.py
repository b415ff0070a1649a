"""Gated activations of transformer MLPs in Triton: SwiGLU and GeGLU, forward and backward in one pass each.

    swiglu(gate, up) = silu(gate) * up                      silu(g) = g * sigmoid(g)
    geglu(gate, up)  = gelu(gate) * up                      gelu exact (erf) or its tanh approximation

Forward reads gate and up once and writes the product once (3 tensors moved); eager PyTorch writes silu(gate)
to memory and reads it back (5). Backward recomputes the activation from gate instead of saving it::

    d_up   = dy * act(gate)
    d_gate = dy * up * act'(gate)          silu'(g) = s + g s (1 - s),   s = sigmoid(g)

reading gate, up and dy and writing both gradients (5 tensors). Arithmetic is float32; results are rounded
once to the inputs' dtype. gate and up may be any strided views with a unit-stride last dim (e.g. the two
halves of a fused up-projection) without a copy.

In an MLP the product y feeds the down projection, whose backward needs y for its weight gradient, so autograd
keeps y alive from the forward to the backward: d_ff elements per token and layer, next to gate and up.
``swiglu_linear(gate, up, weight)`` = ``F.linear(swiglu(gate, up), weight)`` keeps only gate and up (which the
activation's backward needs anyway) and has the backward kernel write y again as it computes the gradients::

    dy = dout @ weight;   d_gate, d_up, y = backward kernel(dy, gate, up);   d_weight = dout^T y

one extra write of y in a pass that already reads gate, up and dy, computed by the forward's formula from the same
inputs.

Registered as ``kernel_lib::gated_act_fwd``, ``kernel_lib::gated_act_bwd`` and
``kernel_lib::gated_act_bwd_with_out`` custom ops with fake implementations, which the file's two
``autograd.Function`` classes call under torch.compile, so
``torch.compile(fullgraph=True)`` traces through them. Sources: Shazeer,
"GLU Variants Improve Transformer" (2020); Hendrycks & Gimpel, "Gaussian Error Linear Units" (2016).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import as_rows, check_same_device, check_same_dtype, check_shape, check_tensor, launch_or_op, use_triton

__all__ = ["swiglu", "geglu", "swiglu_linear", "swiglu_ref", "geglu_ref"]

_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # the ACTIVATION constexpr of the kernels
BLOCK = 2048  # elements per program


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in plain PyTorch, computed in float32 (float64 for float64 input), in gate's dtype."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)


def geglu_ref(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up in plain PyTorch (``approximate`` as in ``F.gelu``), computed in float32, in gate's dtype."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    return (F.gelu(gate.to(compute), approximate=approximate) * up.to(compute)).to(gate.dtype)


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _activation_and_slope(g, ACTIVATION: tl.constexpr):
    """act(g) and act'(g) in float32, for ACTIVATION 0 = silu, 1 = gelu (tanh approximation), 2 = gelu (erf)."""
    if ACTIVATION == 0:
        s = tl.sigmoid(g)
        return g * s, s + g * s * (1.0 - s)
    elif ACTIVATION == 1:
        k: tl.constexpr = 0.7978845608028654  # sqrt(2 / pi)
        inner = k * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner), portable across Triton versions and the interpreter
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * g * g)
    else:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))  # Phi(g)
        pdf = tl.exp(-0.5 * g * g) * 0.3989422804014327  # phi(g) = exp(-g^2/2) / sqrt(2 pi)
        return g * cdf, cdf + g * pdf


@triton.jit
def _gated_fwd_kernel(
    gate_ptr,  # (n_rows, D), unit stride along D
    up_ptr,  # (n_rows, D), unit stride along D
    out_ptr,  # (n_rows, D) contiguous
    gate_row_stride,  # elements between rows of gate
    up_row_stride,  # elements between rows of up
    D,  # row width
    blocks_per_row,  # cdiv(D, BLOCK): the 1-D grid is rows x blocks_per_row
    ACTIVATION: tl.constexpr,  # 0 silu, 1 gelu tanh, 2 gelu erf
    BLOCK: tl.constexpr,  # elements per program
):
    pid = tl.program_id(0).to(tl.int64)  # int64: offsets overflow int32 past 2**31 elements
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _activation_and_slope(g, ACTIVATION)
    tl.store(out_ptr + row * D + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(
    dy_ptr,  # (n_rows, D), unit stride along D
    gate_ptr,  # (n_rows, D), unit stride along D
    up_ptr,  # (n_rows, D), unit stride along D
    dgate_ptr,  # (n_rows, D) contiguous
    dup_ptr,  # (n_rows, D) contiguous
    out_ptr,  # (n_rows, D) contiguous: act(gate) * up again, written when WRITE_OUT
    dy_row_stride,  # elements between rows of dy
    gate_row_stride,  # elements between rows of gate
    up_row_stride,  # elements between rows of up
    D,  # row width
    blocks_per_row,  # cdiv(D, BLOCK)
    ACTIVATION: tl.constexpr,  # 0 silu, 1 gelu tanh, 2 gelu erf
    WRITE_OUT: tl.constexpr,  # also write the forward's product (swiglu_linear's weight gradient needs it)
    BLOCK: tl.constexpr,  # elements per program
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    act, slope = _activation_and_slope(g, ACTIVATION)
    tl.store(dgate_ptr + row * D + cols, (dy * u * slope).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + row * D + cols, (dy * act).to(dup_ptr.dtype.element_ty), mask=mask)
    if WRITE_OUT:
        tl.store(out_ptr + row * D + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------
def _grid_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """(n_rows, D) views; fully contiguous inputs become one long row, so narrow D wastes no lanes."""
    if all(t.is_contiguous() for t in tensors):
        return [t.view(1, -1) for t in tensors]  # (1, numel)
    return [as_rows(t) for t in tensors]  # (n_rows, D) each


def _forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    out = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    if gate.numel() == 0:
        return out
    g_rows, u_rows = _grid_rows(gate, up)
    n_rows, D = g_rows.shape
    blocks_per_row = triton.cdiv(D, BLOCK)
    _gated_fwd_kernel[(n_rows * blocks_per_row,)](
        g_rows, u_rows, out, g_rows.stride(0), u_rows.stride(0), D, blocks_per_row,
        ACTIVATION=_ACTIVATIONS[activation], BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
    return out


def _backward(dy, gate, up, activation, with_out: bool = False):
    """(d_gate, d_up), and with ``with_out`` also act(gate) * up as the forward computed it."""
    dgate = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    dup = torch.empty(up.shape, device=up.device, dtype=up.dtype)
    out = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype) if with_out else dgate  # dgate: unused
    if gate.numel() > 0:
        dy_rows, g_rows, u_rows = _grid_rows(dy, gate, up)
        n_rows, D = g_rows.shape
        blocks_per_row = triton.cdiv(D, BLOCK)
        _gated_bwd_kernel[(n_rows * blocks_per_row,)](
            dy_rows, g_rows, u_rows, dgate, dup, out, dy_rows.stride(0), g_rows.stride(0), u_rows.stride(0), D,
            blocks_per_row, ACTIVATION=_ACTIVATIONS[activation], WRITE_OUT=with_out, BLOCK=BLOCK, num_warps=8,
        )  # fmt: skip
    return (dgate, dup, out) if with_out else (dgate, dup)


# --------------------------------------------------------------------------------------------------
# torch.library registration: opaque ops with fake implementations, what torch.compile records
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("kernel_lib::gated_act_fwd", mutates_args=())
def _gated_fwd_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return _forward(gate, up, activation)


@_gated_fwd_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("kernel_lib::gated_act_bwd", mutates_args=())
def _gated_bwd_op(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, gate, up, activation)


@_gated_bwd_op.register_fake
def _(dy, gate, up, activation):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


@torch.library.custom_op("kernel_lib::gated_act_bwd_with_out", mutates_args=())
def _gated_bwd_with_out_op(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dy, gate, up, activation, with_out=True)


@_gated_bwd_with_out_op.register_fake
def _(dy, gate, up, activation):
    return gate.new_empty(gate.shape), up.new_empty(up.shape), gate.new_empty(gate.shape)


# --------------------------------------------------------------------------------------------------
# Autograd: the launchers in eager mode, the ops under torch.compile (see _utils.launch_or_op)
# --------------------------------------------------------------------------------------------------
class _GatedActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.activation = activation
        ctx.save_for_backward(gate, up)  # the activation is recomputed from gate, not saved
        return launch_or_op(_forward, _gated_fwd_op)(gate, up, activation)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dgate, dup = launch_or_op(_backward, _gated_bwd_op)(dy, gate, up, ctx.activation)
        return dgate, dup, None


def _backward_with_out(dy, gate, up, activation):
    return _backward(dy, gate, up, activation, with_out=True)


class _GatedLinear(torch.autograd.Function):
    """F.linear(act(gate) * up, weight) keeping gate and up for the backward, not the product."""

    @staticmethod
    def forward(ctx, gate, up, weight, activation):
        ctx.activation = activation
        ctx.save_for_backward(gate, up, weight)
        return F.linear(launch_or_op(_forward, _gated_fwd_op)(gate, up, activation), weight)

    @staticmethod
    def backward(ctx, dout):
        gate, up, weight = ctx.saved_tensors
        dy = dout.matmul(weight)  # (..., D)
        dgate, dup, y = launch_or_op(_backward_with_out, _gated_bwd_with_out_op)(dy, gate, up, ctx.activation)
        dweight = None
        if ctx.needs_input_grad[2]:  # dout^T y over every token: (d_out, D)
            dweight = dout.reshape(-1, dout.shape[-1]).t().matmul(y.reshape(-1, y.shape[-1]))
        return dgate, dup, dweight, None


# --------------------------------------------------------------------------------------------------
# Functional API
# --------------------------------------------------------------------------------------------------
def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_tensor(gate, "gate", min_ndim=1)
    check_tensor(up, "up", min_ndim=1)
    check_shape(up, "up", gate.shape)
    check_same_dtype(gate=gate, up=up)
    check_same_device(gate=gate, up=up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise; gate and up of one shape and dtype (float32/float16/bfloat16), any strides."""
    _check(gate, up)
    if not use_triton(gate, up, op="swiglu"):  # CPU without the interpreter: the reference, differentiated by autograd
        return swiglu_ref(gate, up)
    return _GatedActivation.apply(gate, up, "silu")


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(swiglu(gate, up), weight)``, an MLP's activation and down projection, keeping gate and up for the
    backward instead of the product (d_ff elements less per token); weight is (d_out, D) for gate and up (..., D)."""
    _check(gate, up)
    check_tensor(weight, "weight", ndim=2)
    if weight.shape[1] != gate.shape[-1]:
        raise ValueError(f"weight must be (d_out, {gate.shape[-1]}) for gate's last dim, got {tuple(weight.shape)}")
    check_same_dtype(gate=gate, weight=weight)
    check_same_device(gate=gate, weight=weight)
    if not use_triton(gate, up, op="swiglu_linear"):  # CPU without the interpreter: the reference, autograd
        return F.linear(swiglu_ref(gate, up), weight)
    return _GatedLinear.apply(gate, up, weight, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up, elementwise; ``approximate`` is ``"tanh"`` or ``"none"`` (exact, with erf), as in ``F.gelu``."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f'approximate must be "tanh" or "none", got {approximate!r}')
    _check(gate, up)
    if not use_triton(gate, up, op="geglu"):  # CPU without the interpreter: the reference, differentiated by autograd
        return geglu_ref(gate, up, approximate)
    return _GatedActivation.apply(gate, up, "gelu_tanh" if approximate == "tanh" else "gelu")
