"""kernel_lib.softmax against float64, forward and backward: whole rows a program, and rows shared by a team of
programs (split_rows.py) at small widths (thresholds lowered) and at vocabulary widths."""

import pytest
import torch

# The module itself (kernel_lib.softmax, the attribute, is the function the package exports).
from kernel_lib.ops import softmax as softmax_module
from kernel_lib.ops.softmax import softmax, softmax_ref
from tests._checks import check_forward_backward


def torch_softmax(x):
    """PyTorch's own softmax in x's precision (it saves its low-precision output for backward, as we do)."""
    return torch.softmax(x, dim=-1)


DTYPES = [  # (dtype, atol, rtol): allowance on top of 2x PyTorch's own error in that dtype
    pytest.param(torch.float32, 1e-6, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-4, 0.0, id="fp16"),
    pytest.param(torch.bfloat16, 1e-3, 0.0, id="bf16"),
]

SHAPES = [
    (4, 1),  # one column: every output is exactly 1
    (3, 999),  # not a power of two
    (2, 3000),  # masked tail of a 4096 block
    (2, 5121),  # odd, just past a power of two
    (2, 16385),  # one past 16384
    (2, 65537),  # wider than SPLIT_ABOVE: a team of 17 programs a row, the last with one column
    (130, 48),  # narrow rows packed many to a program, 130 not a multiple of the pack
    (2, 3, 77),  # batched 3-D
]


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(device, shape, dtype, atol, rtol):
    x = (3 * torch.randn(shape, device=device)).to(dtype)
    check_forward_backward(softmax, softmax_ref, [x], atol=atol, rtol=rtol, baseline=torch_softmax)


def split_small(monkeypatch, lane_width: int = 64):
    """Rows wider than 32 columns shared by teams of programs of ``lane_width`` columns each."""
    monkeypatch.setattr(softmax_module, "SPLIT_ABOVE", 32)
    monkeypatch.setattr(softmax_module, "LANE_WIDTH", lane_width)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("width", [33, 64, 100, 1000])  # two half-full lanes, one lane, a partial lane, 16 lanes
def test_split_rows_on_small_rows(device, monkeypatch, width, dtype, atol, rtol):
    split_small(monkeypatch)
    x = (3 * torch.randn(5, width, device=device)).to(dtype)
    check_forward_backward(softmax, softmax_ref, [x], atol=atol, rtol=rtol, baseline=torch_softmax)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 5000])  # one team; fewer rows than teams; rows looping over the teams
def test_split_rows_both_launch_paths_agree(monkeypatch, rows):
    """The barrier path (one launch) and the two-launch path (a GPU that holds too few programs) give the same
    bits: each combines the same partials in the same order."""
    x = (3 * torch.randn(rows, 40000, device="cuda")).bfloat16()
    dy = torch.randn_like(x)
    one = softmax_module._forward(x), softmax_module._backward(dy, x)
    monkeypatch.setattr(softmax_module.split_rows, "resident_programs", lambda *args: 1)
    two = softmax_module._forward(x), softmax_module._backward(dy, x)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_large_magnitude_and_non_contiguous(device, dtype, atol, rtol):
    x = (200 * torch.randn(300, 7, device=device)).to(dtype).t()  # (7, 300), last dim strided
    assert not x.is_contiguous()
    check_forward_backward(softmax, softmax_ref, [x], atol=atol, rtol=rtol, baseline=torch_softmax)


def test_compiles_without_graph_break(device):
    x = torch.randn(4, 50, device=device, requires_grad=True)
    compiled = torch.compile(lambda t: softmax(t * 2) + 1, fullgraph=True)
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, torch.softmax(x.detach() * 2, -1) + 1, atol=1e-6, rtol=1e-5)


def test_opcheck(device):
    torch.library.opcheck(torch.ops.kernel_lib.softmax_fwd.default, (torch.randn(3, 40, device=device),))


@pytest.mark.parametrize(
    "x, error, words",
    [
        (torch.ones(2, 4, dtype=torch.int64), TypeError, "x must have dtype"),
        (torch.tensor(1.0), ValueError, "at least 1 dims"),
        ("not a tensor", TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_input_is_named(x, error, words):
    with pytest.raises(error, match=words):
        softmax(x)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 4096), (64, 131072), (4, 262147), (300, 32769)])  # large; vocabulary-
# wide; odd wide; just past one program's row, with more rows than the GPU holds teams
def test_large_on_gpu(shape):
    x = (3 * torch.randn(shape, device="cuda")).bfloat16()
    check_forward_backward(softmax, softmax_ref, [x], atol=1e-3, baseline=torch_softmax)
