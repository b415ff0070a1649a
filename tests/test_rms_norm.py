"""kernel_lib.rms_norm against float64, forward and both gradients, plus compile, op checks and bad input."""

import importlib

import pytest
import torch
import triton

from kernel_lib.rms_norm import (
    _FINISH_BLOCK_D,
    _FINISH_BLOCK_P,
    RMSNorm,
    _rms_norm_bwd_finish_kernel,
    rms_norm,
    rms_norm_ref,
)
from tests._checks import check_forward_backward, rows_input

norm_module = importlib.import_module("kernel_lib.rms_norm")  # not the function of that name

DTYPES = [  # (dtype, atol, rtol): allowance on top of 2x PyTorch's own error in that dtype
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-3, 0.0, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, 0.0, id="bf16"),
]

SHAPES = [
    (1, 1),  # one element: the mean of one square
    (3, 999),  # width not a power of two
    (2, 5, 128),  # batched (B, N, D)
    (7, 4096),  # a model-sized row, one row per program
    (4, 5121),  # wide and odd: masked tail of an 8192 block
    (257, 64),  # narrow rows packed several to a program; 257 not a multiple of the pack
    (2, 16385),  # wider than WIDE_ROW: the backward's loop without prefetch, weight re-read each row
]


def _inputs(shape, dtype, device, layout="contiguous", weight=True):
    D = shape[-1]
    x = rows_input(shape, dtype, device, layout)
    w = (1 + 0.5 * torch.randn(D, device=device)).to(dtype) if weight else None
    return x, w


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(device, shape, dtype, atol, rtol):
    x, w = _inputs(shape, dtype, device)
    check_forward_backward(rms_norm, rms_norm_ref, [x, w, 1e-6], atol=atol, rtol=rtol)


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_non_contiguous(device, layout, dtype, atol, rtol):
    x, w = _inputs((6, 300), dtype, device, layout=layout)
    assert not x.is_contiguous()
    check_forward_backward(rms_norm, rms_norm_ref, [x, w, 1e-6], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_without_weight_and_large_eps(device, dtype, atol, rtol):
    x, _ = _inputs((9, 200), dtype, device, weight=False)
    check_forward_backward(rms_norm, rms_norm_ref, [x, None, 0.5], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_wide_loop_over_many_rows_per_program(device, monkeypatch, dtype, atol, rtol):
    # WIDE_ROW lowered so that small rows take the wide loop, with many rows per program and a ragged last share
    monkeypatch.setattr(norm_module, "WIDE_ROW", 16)
    x, w = _inputs((203, 100), dtype, device)
    check_forward_backward(rms_norm, rms_norm_ref, [x, w, 1e-6], atol=atol, rtol=rtol)


FINISH_SHAPES = [  # (programs, D) of the backward kernel's partial sums
    (1, 1),  # one program, one column
    (3, 999),  # width not a multiple of the finish kernel's column block
    (300, 40),  # more programs than one loop step reads, and not a multiple of it
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("programs, D", FINISH_SHAPES, ids=str)
def test_finish_kernel_sums_the_partials(device, programs, D, dtype):
    partial = torch.randn(programs, D, device=device)
    dw = torch.full((D,), float("nan"), device=device, dtype=dtype)
    _rms_norm_bwd_finish_kernel[(triton.cdiv(D, _FINISH_BLOCK_D),)](
        partial, dw, programs, D, BLOCK_P=_FINISH_BLOCK_P, BLOCK_D=_FINISH_BLOCK_D
    )
    want = partial.double().sum(0).to(dtype)  # float32 sums, rounded once to dtype
    torch.testing.assert_close(dw, want, atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 2**-7)


def test_large_magnitude_inputs_do_not_overflow(device):
    x = torch.randn(4, 512, device=device).mul(300).half()  # x² overflows float16, not the float32 accumulator
    w = torch.randn(512, device=device).half()
    check_forward_backward(rms_norm, rms_norm_ref, [x, w, 1e-6], atol=1e-3)


def test_empty_batch(device):
    x = torch.randn(0, 64, device=device, requires_grad=True)
    w = torch.randn(64, device=device, requires_grad=True)
    y = rms_norm(x, w)
    y.sum().backward()
    assert y.shape == (0, 64) and x.grad.shape == (0, 64) and torch.equal(w.grad, torch.zeros_like(w))


def test_module_matches_torch_nn_rmsnorm(device):
    ours = RMSNorm(96, eps=1e-5, device=device)
    theirs = torch.nn.RMSNorm(96, eps=1e-5, device=device)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 7, 96, device=device)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    assert "96, eps=1e-05" in repr(ours)


def test_compiles_without_graph_break(device):
    x = torch.randn(4, 32, device=device, requires_grad=True)
    w = torch.randn(32, device=device, requires_grad=True)

    def block(x, w):
        return rms_norm(x, w) * 2 + 1

    compiled = torch.compile(block, fullgraph=True)  # fullgraph: any graph break raises
    y = compiled(x, w)
    y.sum().backward()
    torch.testing.assert_close(y, block(x, w), atol=1e-5, rtol=1e-5)
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_frozen_weight_gets_no_gradient(device, compiled):  # as in fine-tuning with frozen norms
    x = torch.randn(6, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device)
    fn = torch.compile(rms_norm, fullgraph=True) if compiled else rms_norm
    dy = torch.randn(6, 40, device=device)
    fn(x, w).backward(dy)
    x_ref = x.detach().requires_grad_()
    rms_norm_ref(x_ref, w).backward(dy)
    assert w.grad is None
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1e-4)


def test_opcheck(device):
    x = torch.randn(3, 40, device=device)
    w = torch.randn(40, device=device)
    torch.library.opcheck(torch.ops.kernel_lib.rms_norm_fwd.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.kernel_lib.rms_norm_fwd.default, (x, None, 1e-6))


def test_cpu_without_interpreter_falls_back_to_the_reference(monkeypatch):
    from kernel_lib import _utils

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_utils, "_warned", set())
    x, w = torch.randn(5, 33, requires_grad=True), torch.randn(33, requires_grad=True)
    with pytest.warns(UserWarning, match="reference runs instead"):
        y = rms_norm(x, w)
    check_forward_backward(rms_norm, rms_norm_ref, [x, w, 1e-6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y, rms_norm_ref(x, w), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "x, w, eps, error, words",
    [
        (torch.ones(2, 4, dtype=torch.int32), None, 1e-6, TypeError, "x must have dtype"),
        (torch.ones(2, 4), torch.ones(5), 1e-6, ValueError, r"weight must have shape \(4,\)"),
        (torch.ones(2, 4), torch.ones(2, 4), 1e-6, ValueError, "weight must have 1 dims"),
        (torch.ones(2, 4), torch.ones(4, device="meta"), 1e-6, ValueError, "x on cpu, weight on meta"),
        (torch.ones(2, 4), None, -1.0, ValueError, "eps must be"),
        ([1.0, 2.0], None, 1e-6, TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_input_is_named(x, w, eps, error, words):
    with pytest.raises(error, match=words):
        rms_norm(x, w, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 16384), (3, 65536)])  # large, wide, widest supported
def test_large_on_gpu(shape):
    x, w = _inputs(shape, torch.bfloat16, "cuda")
    check_forward_backward(rms_norm, rms_norm_ref, [x, w, 1e-6], atol=1e-2)
