"""kernel_lib.softmax against float64, forward and backward, both the one-pass and the online (chunked) kernel."""

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
    (2, 65536),  # wider than MAX_FUSED: the online two-pass kernel
    (130, 48),  # narrow rows packed many to a program, 130 not a multiple of the pack
    (2, 3, 77),  # batched 3-D
]


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(device, shape, dtype, atol, rtol):
    x = (3 * torch.randn(shape, device=device)).to(dtype)
    check_forward_backward(softmax, softmax_ref, [x], atol=atol, rtol=rtol, baseline=torch_softmax)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("width", [64, 100, 1000])  # one chunk exactly, a partial chunk, many chunks
def test_online_kernel_on_small_rows(device, monkeypatch, width, dtype, atol, rtol):
    monkeypatch.setattr(softmax_module, "MAX_FUSED", 32)
    monkeypatch.setattr(softmax_module, "CHUNK", 64)
    x = (3 * torch.randn(5, width, device=device)).to(dtype)
    check_forward_backward(softmax, softmax_ref, [x], atol=atol, rtol=rtol, baseline=torch_softmax)


@pytest.mark.parametrize("online", [False, True])
def test_minus_infinity_gives_exact_zeros(device, monkeypatch, online):
    if online:
        monkeypatch.setattr(softmax_module, "MAX_FUSED", 32)
        monkeypatch.setattr(softmax_module, "CHUNK", 64)
    x = torch.randn(4, 200, device=device)
    x[0, :150] = float("-inf")  # the online kernel sees whole chunks of -inf before any finite value
    x[1, ::3] = float("-inf")
    x[2, :] = float("-inf")  # all masked: NaN, as in PyTorch
    y = softmax(x)
    assert (y[0, :150] == 0).all() and (y[1, ::3] == 0).all()
    assert torch.isnan(y[2]).all() and torch.isnan(torch.softmax(x, -1)[2]).all()
    torch.testing.assert_close(y[[0, 1, 3]], torch.softmax(x, -1)[[0, 1, 3]], atol=1e-6, rtol=1e-5)


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
@pytest.mark.parametrize("shape", [(8192, 4096), (64, 131072), (4, 262147)])  # large; vocabulary-wide; odd wide
def test_large_on_gpu(shape):
    x = (3 * torch.randn(shape, device="cuda")).bfloat16()
    check_forward_backward(softmax, softmax_ref, [x], atol=1e-3, baseline=torch_softmax)
