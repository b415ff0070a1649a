"""kernel_lib.layer_norm against float64, forward and all three gradients, plus compile, op checks and bad input.

LayerNorm shares its kernels with RMSNorm (kernel_lib/ops/norms.py); the finish kernel is tested here for both."""

import pytest
import torch
import triton

from kernel_lib.ops import norms as norm_module
from kernel_lib.ops.norms import (
    _FINISH_BLOCK_D,
    _FINISH_BLOCK_P,
    LayerNorm,
    _norm_bwd_finish_kernel,
    layer_norm,
    layer_norm_ref,
)
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
    (2, 1),  # one column: x - mean is exactly 0, y is the bias
    (3, 999),  # width not a power of two
    (2, 5, 128),  # batched (B, N, D)
    (7, 4096),  # a model-sized row
    (4, 5121),  # wide and odd: masked tail of an 8192 block
    (257, 64),  # narrow rows packed several to a program; 257 not a multiple of the pack
    (2, 16385),  # wider than WIDE_ROW: the backward's loop without prefetch, weight re-read each row
]


def _inputs(shape, dtype, device, layout="contiguous", affine=True):
    D = shape[-1]
    x = rows_input(shape, dtype, device, layout, offset=2.0)  # a non-zero mean, as real activations have
    w = (1 + 0.5 * torch.randn(D, device=device)).to(dtype) if affine else None
    b = (0.5 * torch.randn(D, device=device)).to(dtype) if affine else None
    return x, w, b


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(device, shape, dtype, atol, rtol):
    x, w, b = _inputs(shape, dtype, device)
    check_forward_backward(layer_norm, layer_norm_ref, [x, w, b, 1e-5], atol=atol, rtol=rtol)


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_non_contiguous(device, layout, dtype, atol, rtol):
    x, w, b = _inputs((6, 300), dtype, device, layout=layout)
    assert not x.is_contiguous()
    check_forward_backward(layer_norm, layer_norm_ref, [x, w, b, 1e-5], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("affine", ["none", "weight only", "bias only"])
def test_partial_affine(device, dtype, atol, rtol, affine):
    x, w, b = _inputs((9, 200), dtype, device)
    w = w if affine == "weight only" else None
    b = b if affine == "bias only" else None
    check_forward_backward(layer_norm, layer_norm_ref, [x, w, b, 1e-5], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_wide_loop_over_many_rows_per_program(device, monkeypatch, dtype, atol, rtol):
    # WIDE_ROW lowered so that small rows take the wide loop, with many rows per program and a ragged last share
    monkeypatch.setattr(norm_module, "WIDE_ROW", 16)
    x, w, b = _inputs((203, 100), dtype, device)
    check_forward_backward(layer_norm, layer_norm_ref, [x, w, b, 1e-5], atol=atol, rtol=rtol)


FINISH_SHAPES = [  # (programs, D) of the backward kernel's partial sums
    (1, 1),  # one program, one column
    (3, 999),  # width not a multiple of the finish kernel's column block
    (300, 40),  # more programs than one loop step reads, and not a multiple of it
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("affine", ["weight and bias", "weight only", "bias only"])  # weight only: RMSNorm's
@pytest.mark.parametrize("programs, D", FINISH_SHAPES, ids=str)
def test_finish_kernel_sums_the_partials(device, programs, D, affine, dtype):
    has_weight, has_bias = affine != "bias only", affine != "weight only"
    partial = torch.randn(has_weight + has_bias, programs, D, device=device)  # dweight's partials, then dbias's
    dw = torch.full((D,), float("nan"), device=device, dtype=dtype)
    db = torch.full((D,), float("nan"), device=device, dtype=dtype)
    _norm_bwd_finish_kernel[(triton.cdiv(D, _FINISH_BLOCK_D),)](
        partial, dw, db, programs, D, WEIGHT_GRAD=has_weight, BIAS_GRAD=has_bias,
        BLOCK_P=_FINISH_BLOCK_P, BLOCK_D=_FINISH_BLOCK_D,
    )  # fmt: skip
    written = [g for g, has in ((dw, has_weight), (db, has_bias)) if has]
    for got, want in zip(written, partial.double().sum(1), strict=True):  # float32 sums, rounded once to dtype
        torch.testing.assert_close(got, want.to(dtype), atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 2**-7)


def test_module_matches_torch_nn_layernorm(device):
    ours = LayerNorm(96, eps=1e-5, device=device)
    theirs = torch.nn.LayerNorm(96, eps=1e-5, device=device)
    with torch.no_grad():
        ours.weight.normal_()
        ours.bias.normal_()
        theirs.weight.copy_(ours.weight)
        theirs.bias.copy_(ours.bias)
    x = torch.randn(3, 7, 96, device=device)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    assert LayerNorm(8, bias=False).bias is None and "bias=False" in repr(LayerNorm(8, bias=False))


def test_compiles_without_graph_break(device):  # fullgraph: any graph break raises
    x = torch.randn(4, 32, device=device, requires_grad=True)
    w = torch.randn(32, device=device, requires_grad=True)
    b = torch.randn(32, device=device, requires_grad=True)
    y = check_compiled_matches_eager(lambda x, w, b: layer_norm(x, w, b) * 2 + 1, [x, w, b])  # and 3 gradients
    torch.testing.assert_close(y, layer_norm_ref(x, w, b) * 2 + 1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("frozen", ["weight", "bias", "both"])  # as in fine-tuning with frozen norms
def test_frozen_parameters_get_no_gradient(device, frozen, compiled):
    x = torch.randn(6, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=frozen == "bias")
    b = torch.randn(40, device=device, requires_grad=frozen == "weight")
    check_frozen_inputs_get_no_gradient(layer_norm, layer_norm_ref, [x, w, b], compiled=compiled)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "none"])
def test_opcheck(device, affine):  # inputs without requires_grad: the ops have no autograd of their own
    x, dy = torch.randn(3, 40, device=device), torch.randn(3, 40, device=device)
    w, b = (torch.randn(40, device=device), torch.randn(40, device=device)) if affine else (None, None)
    torch.library.opcheck(torch.ops.kernel_lib.norm_fwd.default, (x, w, b, 1e-5, False))
    _, mean, rstd = torch.ops.kernel_lib.norm_fwd(x, w, b, 1e-5, False)
    for weight_grad, bias_grad in [(True, True), (False, True), (False, False)]:  # False: a frozen parameter
        args = (dy, x, w, b, mean, rstd, False, weight_grad, bias_grad)
        torch.library.opcheck(torch.ops.kernel_lib.norm_bwd.default, args)


def test_cpu_without_interpreter_falls_back_to_the_reference(monkeypatch):
    x, w, b = _inputs((5, 33), torch.float32, "cpu")
    check_cpu_fallback(monkeypatch, layer_norm, layer_norm_ref, [x, w, b, 1e-5], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "x, w, b, error, words",
    [
        (torch.ones(2, 4, dtype=torch.int32), None, None, TypeError, "x must have dtype"),
        (torch.ones(2, 4), torch.ones(5), None, ValueError, r"weight must have shape \(4,\)"),
        (torch.ones(2, 4), None, torch.ones(3), ValueError, r"bias must have shape \(4,\)"),
        (torch.ones(2, 4), torch.ones(4), torch.ones(4, device="meta"), ValueError, "bias on meta"),
        (torch.ones(2, 4), torch.ones(4), torch.ones(4).half(), TypeError, "weight is float32, bias is float16"),
    ],
)
def test_bad_input_is_named(x, w, b, error, words):
    with pytest.raises(error, match=words):
        layer_norm(x, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 16384), (3, 65536)])  # large, wide, widest supported
def test_large_on_gpu(shape):
    x, w, b = _inputs(shape, torch.bfloat16, "cuda")
    check_forward_backward(layer_norm, layer_norm_ref, [x, w, b, 1e-5], atol=1e-2)
