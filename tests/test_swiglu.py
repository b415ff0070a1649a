"""kernel_lib.swiglu (SwiGLU and GeGLU) against float64, forward and both gradients."""

import functools

import pytest
import torch

from kernel_lib.ops.swiglu import geglu, geglu_ref, swiglu, swiglu_ref
from tests._checks import check_forward_backward

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
