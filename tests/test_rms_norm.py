"""kernel_lib.rms_norm against float64, forward and both gradients, plus compile, op checks and bad input.

RMSNorm and LayerNorm share one kernel file (kernel_lib/ops/norms.py); the finish kernel that sums dweight's
partials is tested in test_layer_norm.py, with every combination of dweight and dbias."""

import pytest
import torch

from kernel_lib.ops import norms as norm_module
from kernel_lib.ops.norms import RMSNorm, rms_norm, rms_norm_ref
from tests._checks import (
    check_compiled_matches_eager,
    check_cpu_fallback,
    check_forward_backward,
    check_frozen_inputs_get_no_gradient,
    rows_input,
)

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


def test_compiles_without_graph_break(device):  # fullgraph: any graph break raises
    x = torch.randn(4, 32, device=device, requires_grad=True)
    w = torch.randn(32, device=device, requires_grad=True)
    y = check_compiled_matches_eager(lambda x, w: rms_norm(x, w) * 2 + 1, [x, w])  # output and both gradients
    torch.testing.assert_close(y, rms_norm_ref(x, w) * 2 + 1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_frozen_weight_gets_no_gradient(device, compiled):  # as in fine-tuning with frozen norms
    x = torch.randn(6, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device)
    check_frozen_inputs_get_no_gradient(rms_norm, rms_norm_ref, [x, w], compiled=compiled)


@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no weight"])
def test_opcheck(device, weight):  # inputs without requires_grad: the ops have no autograd of their own
    x, dy = torch.randn(3, 40, device=device), torch.randn(3, 40, device=device)
    w = torch.randn(40, device=device) if weight else None
    torch.library.opcheck(torch.ops.kernel_lib.norm_fwd.default, (x, w, None, 1e-6, True))
    _, mean, rstd = torch.ops.kernel_lib.norm_fwd(x, w, None, 1e-6, True)
    for weight_grad in [True, False]:  # False: a frozen weight
        args = (dy, x, w, None, mean, rstd, True, weight_grad, False)
        torch.library.opcheck(torch.ops.kernel_lib.norm_bwd.default, args)


def test_cpu_without_interpreter_falls_back_to_the_reference(monkeypatch):
    x, w = torch.randn(5, 33), torch.randn(33)
    check_cpu_fallback(monkeypatch, rms_norm, rms_norm_ref, [x, w, 1e-6], atol=1e-5, rtol=1e-5)


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
