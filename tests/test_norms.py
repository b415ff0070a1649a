"""kernel_lib.rms_norm and kernel_lib.layer_norm against float64, forward and every gradient, plus compile, op
checks and bad input; add_rms_norm (the residual add fused into RMSNorm, for decoding) bit for bit against the
separate add and norm.

Both norms run the same kernels (kernel_lib/ops/norms.py, an IS_RMS switch), so most tests run once per norm
through the ``norm`` fixture; what only one norm has (LayerNorm's bias, RMSNorm's bare mean square) is
parametrized for that norm alone. The finish kernel, which sums the parameter gradients' partials, is tested
directly with every combination of dweight and dbias."""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import triton

from kernel_lib.ops import norms as norm_module
from kernel_lib.ops.norms import (
    _FINISH_BLOCK_D,
    _FINISH_BLOCK_P,
    LayerNorm,
    RMSNorm,
    _norm_bwd_finish_kernel,
    layer_norm,
    layer_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from tests._checks import (
    check_compiled_matches_eager,
    check_cpu_fallback,
    check_forward_backward,
    check_frozen_inputs_get_no_gradient,
    rows_input,
)


@dataclass(frozen=True)
class Norm:
    fn: Callable  # the kernel: fn(x, weight, eps) or fn(x, weight, bias, eps)
    ref: Callable  # its definition in plain PyTorch: the float64 reference, and in low precision the baseline
    eps: float  # the default eps
    has_bias: bool
    offset: float  # the test inputs' mean: LayerNorm's non-zero, as real activations have, for it to subtract
    module: type
    torch_module: type  # the torch.nn module ours must match

    def args(self, x, weight=None, bias=None, eps=None) -> list:
        """The arguments of ``fn`` in order; ``eps`` None: the default."""
        eps = self.eps if eps is None else eps
        if self.has_bias:
            return [x, weight, bias, eps]
        assert bias is None, "RMSNorm takes no bias"
        return [x, weight, eps]

    @property
    def is_rms(self) -> bool:
        return not self.has_bias


NORMS = {
    "rms": Norm(
        rms_norm, rms_norm_ref, 1e-6, has_bias=False, offset=0.0, module=RMSNorm, torch_module=torch.nn.RMSNorm
    ),
    "layer": Norm(
        layer_norm, layer_norm_ref, 1e-5, has_bias=True, offset=2.0, module=LayerNorm, torch_module=torch.nn.LayerNorm
    ),
}


@pytest.fixture(params=NORMS)
def norm(request) -> Norm:
    """Each test taking ``norm`` runs once per norm (ids "rms", "layer"), unless it parametrizes ``norm`` itself
    with names and ``indirect=["norm"]``."""
    return NORMS[request.param]


DTYPES = [  # (dtype, atol, rtol): allowance on top of 2x PyTorch's own error in that dtype
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-3, 0.0, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, 0.0, id="bf16"),
]

SHAPES = [  # both norms
    (3, 999),  # width not a power of two
    (2, 5, 128),  # batched (B, N, D)
    (7, 4096),  # a model-sized row, one row per program
    (4, 5121),  # wide and odd: masked tail of an 8192 block
    (257, 64),  # narrow rows packed several to a program; 257 not a multiple of the pack
]
WIDE = [  # both norms, in bf16 alone (every dtype takes these paths at small widths in the split tests below)
    (1, 16384),  # wider than WIDE_ROW: the backward's loop without prefetch, weight re-read each row
    (1, 16385),  # wider than BWD_SPLIT_ABOVE: one program a row forward, a team of 5 programs backward
    (1, 32769),  # wider than SPLIT_ABOVE: teams of 5 or 9 programs a row, the last with one column
]
ONE_COLUMN = [  # D = 1, a case per norm: rstd = 1/sqrt(eps) amplifies any error
    ("rms", (1, 1)),  # one element: the mean of one square
    ("layer", (2, 1)),  # one column: x - mean is exactly 0, y is the bias
]


def _args(norm, shape, dtype, device, layout="contiguous", weight=True, bias=True, eps=None) -> list:
    """Random ``fn`` arguments: x of ``shape`` in ``layout``, weight near 1 and (LayerNorm) bias near 0."""
    D = shape[-1]
    x = rows_input(shape, dtype, device, layout, offset=norm.offset)
    w = (1 + 0.5 * torch.randn(D, device=device)).to(dtype) if weight else None
    b = (0.5 * torch.randn(D, device=device)).to(dtype) if bias and norm.has_bias else None
    return norm.args(x, w, b, eps)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize(
    "norm, shape", ONE_COLUMN + [(name, shape) for name in NORMS for shape in SHAPES], indirect=["norm"], ids=str
)
def test_forward_backward(device, norm, shape, dtype, atol, rtol):
    check_forward_backward(norm.fn, norm.ref, _args(norm, shape, dtype, device), atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", WIDE, ids=str)
def test_wide_rows(device, norm, shape):
    check_forward_backward(norm.fn, norm.ref, _args(norm, shape, torch.bfloat16, device), atol=1e-2)


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_non_contiguous(device, norm, layout, dtype, atol, rtol):
    args = _args(norm, (6, 300), dtype, device, layout=layout)
    assert not args[0].is_contiguous()
    check_forward_backward(norm.fn, norm.ref, args, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize(
    "norm, weight, bias, eps",
    [
        pytest.param("rms", False, False, 0.5, id="rms-no weight-large eps"),  # eps weighs next to the mean square
        pytest.param("layer", False, False, None, id="layer-none"),
        pytest.param("layer", True, False, None, id="layer-weight only"),
        pytest.param("layer", False, True, None, id="layer-bias only"),
    ],
    indirect=["norm"],
)
def test_partial_affine(device, norm, weight, bias, eps, dtype, atol, rtol):
    args = _args(norm, (9, 200), dtype, device, weight=weight, bias=bias, eps=eps)
    check_forward_backward(norm.fn, norm.ref, args, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_wide_loop_over_many_rows_per_program(device, norm, monkeypatch, dtype, atol, rtol):
    # WIDE_ROW lowered so that small rows take the wide loop, with many rows per program and a ragged last share
    monkeypatch.setattr(norm_module, "WIDE_ROW", 16)
    check_forward_backward(norm.fn, norm.ref, _args(norm, (203, 100), dtype, device), atol=atol, rtol=rtol)


def split_small(monkeypatch):
    """Rows wider than 32 columns shared by teams of programs: lanes of 64 columns forward, 32 backward."""
    monkeypatch.setattr(norm_module, "SPLIT_ABOVE", 32)
    monkeypatch.setattr(norm_module, "BWD_SPLIT_ABOVE", 32)
    monkeypatch.setattr(norm_module, "RMS_FWD_LANES", (64, 4))
    monkeypatch.setattr(norm_module, "LN_FWD_LANES", (64, 4))
    monkeypatch.setattr(norm_module, "BWD_LANES", (32, 4))


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", [(7, 33), (9, 100), (5, 1000)], ids=str)  # a one-column lane; partial; 32 lanes
def test_split_rows_on_small_rows(device, norm, monkeypatch, shape, dtype, atol, rtol):
    split_small(monkeypatch)
    check_forward_backward(norm.fn, norm.ref, _args(norm, shape, dtype, device), atol=atol, rtol=rtol)


@pytest.mark.parametrize("weight, bias", [(False, False), (True, False), (False, True)], ids=str)
def test_split_rows_partial_affine(device, norm, monkeypatch, weight, bias):
    split_small(monkeypatch)
    args = _args(norm, (6, 150), torch.float32, device, weight=weight, bias=bias)
    check_forward_backward(norm.fn, norm.ref, args, atol=1e-6, rtol=1e-5)


def test_split_rows_large_mean(device, monkeypatch):
    """LayerNorm's lanes each sum squares about their own mean, then combine (Chan et al.): a row whose mean is
    a thousand times its spread loses nothing to cancellation."""
    split_small(monkeypatch)
    x = 1000 + torch.randn(4, 300, device=device)
    check_forward_backward(layer_norm, layer_norm_ref, [x, None, None, 1e-5], atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 5000])  # one team; fewer rows than teams; rows looping over the teams
def test_split_rows_both_launch_paths_agree(norm, monkeypatch, rows):
    """The barrier path (one launch) and the two-launch path (a GPU that holds too few programs) combine the same
    partials in the same order: the same output bits. dx agrees to rounding: the two compiled kernels contract
    multiply-adds differently, which g - xhat * c amplifies where it cancels (seen at 5,000 rows); dweight and
    dbias sum over a different number of teams. A race (a lane reading another row's partials) would be off by
    the size of the values, far past these tolerances."""
    x, *params, eps = _args(norm, (rows, 40000), torch.bfloat16, "cuda")
    dy = torch.randn_like(x)

    def run():
        y, mean, rstd = norm_module._forward(x, params[0], params[1] if norm.has_bias else None, eps, norm.is_rms)
        grads = norm_module._backward(dy, x, params[0], params[1] if norm.has_bias else None, mean, rstd,
                                      norm.is_rms)  # fmt: skip
        return y, *grads

    one = run()
    monkeypatch.setattr(norm_module.split_rows, "resident_programs", lambda *args: 1)
    two = run()
    assert torch.equal(one[0], two[0])
    for a, b in zip(one[1:], two[1:], strict=True):
        if a is not None:
            torch.testing.assert_close(a.float(), b.float(), atol=2**-8 * a.float().abs().max().item(), rtol=2**-7)


def test_large_magnitude_inputs_do_not_overflow(device, norm):
    args = _args(norm, (4, 512), torch.float16, device)
    args[0] = args[0] * 300  # x² (LayerNorm: (x - mean)²) overflows float16, not the float32 accumulator
    check_forward_backward(norm.fn, norm.ref, args, atol=1e-3)


def test_empty_batch(device, norm):
    x, *params, eps = _args(norm, (0, 64), torch.float32, device)
    for t in (x, *params):
        t.requires_grad_()
    y = norm.fn(x, *params, eps)
    y.sum().backward()
    assert y.shape == (0, 64) and x.grad.shape == (0, 64)
    for p in params:
        assert torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize(
    "norm, bias",
    [("rms", None), ("layer", True), ("layer", False)],
    indirect=["norm"],
    ids=["rms", "layer", "layer-no bias"],
)
def test_module_matches_torch_nn(device, norm, bias):
    kwargs = {} if bias is None else {"bias": bias}
    ours = norm.module(96, eps=1e-5, device=device, **kwargs)
    theirs = norm.torch_module(96, eps=1e-5, device=device, **kwargs)
    assert (getattr(ours, "bias", None) is not None) == bool(bias)
    with torch.no_grad():
        for mine, its in zip(ours.parameters(), theirs.parameters(), strict=True):  # weight, then bias if any
            mine.normal_()
            its.copy_(mine)
    x = torch.randn(3, 7, 96, device=device)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    assert "96, eps=1e-05" in repr(ours) and (bias is None or f"bias={bias}" in repr(ours))


def test_compiles_without_graph_break(device, norm):  # fullgraph: any graph break raises
    x = torch.randn(4, 32, device=device, requires_grad=True)
    params = [torch.randn(32, device=device, requires_grad=True) for _ in range(1 + norm.has_bias)]
    fn, ref = norm.fn, norm.ref
    y = check_compiled_matches_eager(lambda *a: fn(*a) * 2 + 1, [x, *params])  # output and every gradient
    torch.testing.assert_close(y, ref(x, *params) * 2 + 1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(  # as in fine-tuning with frozen norms
    "norm, frozen", [("rms", "weight"), ("layer", "weight"), ("layer", "bias"), ("layer", "both")], indirect=["norm"]
)
def test_frozen_parameters_get_no_gradient(device, norm, frozen, compiled):
    x = torch.randn(6, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=frozen == "bias")
    b = torch.randn(40, device=device, requires_grad=frozen == "weight") if norm.has_bias else None
    check_frozen_inputs_get_no_gradient(norm.fn, norm.ref, norm.args(x, w, b), compiled=compiled)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "none"])
def test_opcheck(device, norm, affine):  # inputs without requires_grad: the ops have no autograd of their own
    x, dy = torch.randn(3, 40, device=device), torch.randn(3, 40, device=device)
    w = torch.randn(40, device=device) if affine else None
    b = torch.randn(40, device=device) if affine and norm.has_bias else None
    torch.library.opcheck(torch.ops.kernel_lib.norm_fwd.default, (x, w, b, norm.eps, norm.is_rms))
    _, mean, rstd = torch.ops.kernel_lib.norm_fwd(x, w, b, norm.eps, norm.is_rms)
    for weight_grad in [True, False]:  # False: a frozen parameter
        for bias_grad in [True, False]:
            args = (dy, x, w, b, mean, rstd, norm.is_rms, weight_grad, bias_grad)
            torch.library.opcheck(torch.ops.kernel_lib.norm_bwd.default, args)


def test_cpu_without_interpreter_falls_back_to_the_reference(monkeypatch, norm):
    args = _args(norm, (5, 33), torch.float32, "cpu")
    check_cpu_fallback(monkeypatch, norm.fn, norm.ref, args, atol=1e-5, rtol=1e-5)


BAD_INPUTS = [  # (x, weight, bias, eps, error, words), for both norms
    (torch.ones(2, 4, dtype=torch.int32), None, None, 1e-6, TypeError, "x must have dtype"),
    (torch.ones(2, 4), torch.ones(5), None, 1e-6, ValueError, r"weight must have shape \(4,\)"),
    (torch.ones(2, 4), torch.ones(2, 4), None, 1e-6, ValueError, "weight must have 1 dims"),
    (torch.ones(2, 4), torch.ones(4, device="meta"), None, 1e-6, ValueError, "x on cpu, weight on meta"),
    (torch.ones(2, 4), None, None, -1.0, ValueError, "eps must be"),
    ([1.0, 2.0], None, None, 1e-6, TypeError, "x must be a torch.Tensor"),
]
BAD_BIAS = [  # LayerNorm only
    (torch.ones(2, 4), None, torch.ones(3), 1e-5, ValueError, r"bias must have shape \(4,\)"),
    (torch.ones(2, 4), torch.ones(4), torch.ones(4, device="meta"), 1e-5, ValueError, "bias on meta"),
    (torch.ones(2, 4), torch.ones(4), torch.ones(4).half(), 1e-5, TypeError, "weight is float32, bias is float16"),
]


@pytest.mark.parametrize(
    "norm, x, w, b, eps, error, words",
    [(name, *case) for name in NORMS for case in BAD_INPUTS] + [("layer", *case) for case in BAD_BIAS],
    indirect=["norm"],
)
def test_bad_input_is_named(norm, x, w, b, eps, error, words):
    with pytest.raises(error, match=words):
        norm.fn(*norm.args(x, w, b, eps))


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


@pytest.mark.gpu
@pytest.mark.parametrize(  # large; wide; wider rows shared by teams of programs, odd, more rows than teams
    "shape", [(4096, 4096), (1000, 16384), (3, 65536), (64, 131072), (4, 262147), (300, 32769)], ids=str
)
def test_large_on_gpu(norm, shape):
    check_forward_backward(norm.fn, norm.ref, _args(norm, shape, torch.bfloat16, "cuda"), atol=1e-2)


# --------------------------------------------------------------------------------------------------
# add_rms_norm: decoding's residual add and RMSNorm in one kernel
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "shape, layout",
    [
        ((1, 1, 2048), "contiguous"),  # one decoding token of a model with d 2048
        ((3, 999), "contiguous"),  # width not a power of two
        ((257, 64), "contiguous"),  # narrow rows packed several to a program
        ((4, 5121), "sliced"),  # wide, odd, rows strided in memory
        ((3, 40000), "sliced"),  # wider than SPLIT_ABOVE: a team of programs a row
        ((6, 128), "transposed"),  # a layout as_rows must copy
    ],
    ids=str,
)
def test_add_rms_norm_is_the_add_and_the_norm_bit_for_bit(device, shape, layout, dtype):
    """Both outputs equal ``x + residual`` and ``rms_norm`` of it exactly: a decoder that fuses them picks the
    same tokens as one that does not. (That rms_norm itself is right, against float64, the tests above check.)"""
    x = rows_input(shape, dtype, device, layout)
    residual = torch.randn(shape, device=device).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], device=device)).to(dtype)
    with torch.no_grad():
        y, total = norm_module.add_rms_norm(x, residual, weight, 1e-5)
        want_total = x + residual
        want_y = rms_norm(want_total, weight, 1e-5)
    assert total.dtype == y.dtype == dtype
    assert torch.equal(total, want_total)
    assert torch.equal(y, want_y)


def test_add_rms_norm_without_weight(device):
    x, residual = torch.randn(5, 48, device=device), torch.randn(5, 48, device=device)
    y, total = norm_module.add_rms_norm(x, residual)
    assert torch.equal(y, rms_norm(x + residual))


def test_add_rms_norm_opcheck(device):
    x, residual, weight = (torch.randn(4, 32, device=device) for _ in range(3))
    torch.library.opcheck(torch.ops.kernel_lib.add_rms_norm.default, (x, residual, weight, 1e-6))


@pytest.mark.parametrize(
    "x, residual, weight, error, words",
    [
        (torch.ones(2, 4), torch.ones(2, 5), None, ValueError, r"residual must have shape \(2, 4\)"),
        (torch.ones(2, 4), torch.ones(2, 4).half(), None, TypeError, "x is float32, residual is float16"),
        (torch.ones(2, 4), torch.ones(2, 4), torch.ones(3), ValueError, r"weight must have shape \(4,\)"),
        (torch.ones(2, 4), torch.ones(2, 4, device="meta"), None, ValueError, "residual on meta"),
        (torch.ones(2, 4, requires_grad=True), torch.ones(2, 4), None, ValueError, "for inference"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_add_rms_norm_bad_input_is_named(x, residual, weight, error, words):
    with pytest.raises(error, match=words):
        norm_module.add_rms_norm(x, residual, weight)
