"""kernel_lib.swiglu (SwiGLU and GeGLU) and swiglu_linear against float64, forward and every gradient."""

import functools

import pytest
import torch
import torch.nn.functional as F

from kernel_lib.ops.swiglu import geglu, geglu_ref, swiglu, swiglu_linear, swiglu_ref
from tests._checks import check_compiled_matches_eager, check_forward_backward, saved_storages

DTYPES = [  # (dtype, atol, rtol): allowance on top of 2x PyTorch's own error in that dtype
    pytest.param(torch.float32, 1e-6, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-3, 0.0, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, 0.0, id="bf16"),
]

OPS = [  # (kernel, reference)
    pytest.param(swiglu, swiglu_ref, id="swiglu"),
    pytest.param(
        functools.partial(geglu, approximate="tanh"),
        functools.partial(geglu_ref, approximate="tanh"),
        id="geglu-tanh",
    ),
    pytest.param(
        functools.partial(geglu, approximate="none"),
        functools.partial(geglu_ref, approximate="none"),
        id="geglu-erf",
    ),
]

SHAPES = [
    (1,),  # one element
    (3, 999),  # not a multiple of the block
    (2, 5, 2048),  # exactly one block per row
    (4, 5121),  # a partial last block
]


@pytest.mark.parametrize("kernel, reference", OPS)
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(device, shape, dtype, atol, rtol, kernel, reference):
    gate = (2 * torch.randn(shape, device=device)).to(dtype)
    up = torch.randn(shape, device=device).to(dtype)
    check_forward_backward(kernel, reference, [gate, up], atol=atol, rtol=rtol)


@pytest.mark.parametrize("kernel, reference", OPS)
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_halves_of_a_fused_projection(device, dtype, atol, rtol, kernel, reference):
    fused = torch.randn(6, 2 * 700, device=device).to(dtype)  # (rows, 2 * d_ff), as one matmul would give it
    gate, up = fused.chunk(2, dim=-1)  # strided views, no copy
    assert not gate.is_contiguous()
    check_forward_backward(kernel, reference, [gate, up], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_transposed_and_large_magnitude(device, dtype, atol, rtol):
    gate = (30 * torch.randn(300, 5, device=device)).to(dtype).t()  # silu saturates at both ends
    up = torch.randn(5, 300, device=device).to(dtype)
    check_forward_backward(swiglu, swiglu_ref, [gate, up], atol=atol, rtol=rtol)


@pytest.mark.parametrize("kernel, reference", OPS)
def test_cpu_without_interpreter_falls_back_to_the_reference(monkeypatch, kernel, reference):
    from kernel_lib.ops import _utils

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_utils, "_warned", set())
    gate, up = torch.randn(5, 33), torch.randn(5, 33)
    with pytest.warns(UserWarning, match="reference runs instead"):
        kernel(gate, up)
    check_forward_backward(kernel, reference, [gate, up], atol=1e-6, rtol=1e-5)


def test_compiles_without_graph_break(device):
    gate = torch.randn(4, 64, device=device, requires_grad=True)
    up = torch.randn(4, 64, device=device, requires_grad=True)
    compiled = torch.compile(lambda g, u: swiglu(g, u) + geglu(g, u), fullgraph=True)
    out = compiled(gate, up)
    out.sum().backward()
    torch.testing.assert_close(out, swiglu_ref(gate, up) + geglu_ref(gate, up), atol=1e-5, rtol=1e-5)
    assert gate.grad is not None and up.grad is not None


def test_opcheck(device):
    args = (torch.randn(3, 40, device=device), torch.randn(3, 40, device=device))
    for activation in ("silu", "gelu_tanh", "gelu"):
        torch.library.opcheck(torch.ops.kernel_lib.gated_act_fwd.default, (*args, activation))
        torch.library.opcheck(torch.ops.kernel_lib.gated_act_bwd_with_out.default, (args[0], *args, activation))


# ------------------------------------------------------------------------------------ swiglu_linear
def _swiglu_linear_ref(gate, up, weight):
    return F.linear(swiglu_ref(gate, up), weight)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize(
    "tokens, d_ff, d_out",
    [
        ((7,), 40, 24),  # a few tokens, dims below one block
        ((2, 5), 700, 48),  # batch and sequence dims; d_ff not a multiple of the block
        ((1,), 1, 3),  # one token, d_ff of one
    ],
    ids=str,
)
def test_swiglu_linear_forward_backward(device, tokens, d_ff, d_out, dtype, atol, rtol):
    fused = torch.randn(*tokens, 2 * d_ff, device=device).to(dtype)  # the halves of one projection, as in an MLP
    gate, up = fused.chunk(2, dim=-1)
    weight = (torch.randn(d_out, d_ff, device=device) / d_ff**0.5).to(dtype)
    check_forward_backward(swiglu_linear, _swiglu_linear_ref, [gate, up, weight], atol=atol, rtol=rtol)


def test_swiglu_linear_keeps_gate_and_up_not_the_product(device):
    """What autograd keeps between forward and backward: with swiglu then F.linear, the (tokens, d_ff) product too;
    with swiglu_linear, only what the activation's backward needs (storages counted once, the weight excluded)."""
    gate_up = torch.randn(64, 2 * 96, device=device, requires_grad=True)
    weight = torch.randn(32, 96, device=device, requires_grad=True)

    gate, up = gate_up.chunk(2, dim=-1)
    unfused, out_unfused = saved_storages(lambda: F.linear(swiglu(gate, up), weight), exclude=[weight])
    fused, out_fused = saved_storages(lambda: swiglu_linear(gate, up, weight), exclude=[weight])
    assert len(unfused) == 2 and len(fused) == 1  # gate_up and the product; gate_up alone
    torch.testing.assert_close(out_fused, out_unfused)
    grads = [torch.autograd.grad(o.sum(), (gate_up, weight)) for o in (out_unfused, out_fused)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a)  # the recomputed product is the forward's, so the gradients agree


def test_swiglu_linear_compiles_without_graph_break(device):
    gate, up = torch.randn(2, 6, 2 * 48, device=device).chunk(2, dim=-1)
    weight = torch.randn(16, 48, device=device)
    inputs = [t.detach().requires_grad_() for t in (gate, up, weight)]
    check_compiled_matches_eager(swiglu_linear, inputs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "weight, error, words",
    [
        (torch.ones(3, 5), ValueError, r"weight must be \(d_out, 4\)"),  # weight's columns are not gate's width
        (torch.ones(3, 4).half(), TypeError, "gate is float32, weight is float16"),
        (torch.ones(4), ValueError, "weight must have 2 dims"),
    ],
)
def test_swiglu_linear_bad_input_is_named(weight, error, words):
    with pytest.raises(error, match=words):
        swiglu_linear(torch.ones(2, 4), torch.ones(2, 4), weight)


@pytest.mark.parametrize(
    "gate, up, kwargs, error, words",
    [
        (torch.ones(2, 4), torch.ones(2, 5), {}, ValueError, r"up must have shape \(2, 4\)"),
        (torch.ones(2, 4), torch.ones(2, 4).half(), {}, TypeError, "gate is float32, up is float16"),
        (torch.ones(2, 4, dtype=torch.int32), torch.ones(2, 4), {}, TypeError, "gate must have dtype"),
        (torch.ones(2, 4), torch.ones(2, 4, device="meta"), {}, ValueError, "gate on cpu, up on meta"),
        (torch.ones(2, 4), torch.ones(2, 4), {"approximate": "fast"}, ValueError, "approximate must be"),
    ],
)
def test_bad_input_is_named(gate, up, kwargs, error, words):
    op = geglu if kwargs else swiglu
    with pytest.raises(error, match=words):
        op(gate, up, **kwargs)


@pytest.mark.gpu
def test_large_on_gpu():
    gate, up = torch.randn(2, 8192, 14336, device="cuda").bfloat16().unbind(0)
    check_forward_backward(swiglu, swiglu_ref, [gate, up], atol=1e-2)
