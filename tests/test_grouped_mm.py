"""kernel_lib.grouped_mm against float64, output and the gradients of x and w, with empty and uneven groups."""

import pytest
import torch

import kernel_lib.ops.grouped_mm as grouped_mm_module
from kernel_lib.ops.grouped_mm import grouped_mm, grouped_mm_ref
from tests._checks import check_forward_backward

DTYPES = [  # (dtype, atol, rtol): allowance on top of 2x PyTorch's own error in that dtype
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-3, 0.0, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, 0.0, id="bf16"),
]

GROUPS = [  # rows per group, the reason for each
    pytest.param([5, 0, 40, 3], id="an-empty-group"),
    pytest.param([0, 0, 70], id="every-row-in-the-last-group"),
    pytest.param([1, 1, 1, 1, 1], id="one-row-per-group"),
    pytest.param([33, 31, 0], id="uneven-and-an-empty-last-group"),
]


def torch_grouped_mm(x, w, offs):
    """PyTorch's own computation in x's precision: one matmul per group."""
    out = x.new_zeros((x.shape[0], w.shape[2]))
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def _inputs(counts, K, N, dtype, device):
    x = torch.randn(sum(counts), K, device=device).to(dtype)
    w = (torch.randn(len(counts), K, N, device=device) / K**0.5).to(dtype)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    return x, w, offs


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("counts", GROUPS)
def test_forward_backward(device, counts, dtype, atol, rtol):
    x, w, offs = _inputs(counts, 45, 37, dtype, device)  # K and N not multiples of any block
    check_forward_backward(
        grouped_mm, grouped_mm_ref, [x, w, offs], atol=atol, rtol=rtol, grads=[0, 1], baseline=torch_grouped_mm
    )


def test_empty_group_gets_zero_weight_gradient(device):
    x, w, offs = _inputs([4, 0, 6], 16, 8, torch.float32, device)
    w.requires_grad_()
    grouped_mm(x, w, offs).sum().backward()
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1])) and w.grad[0].abs().sum() > 0


def test_strided_weight_view(device):
    x, w, offs = _inputs([7, 9], 24, 20, torch.float32, device)
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (E, K, N) with strides of (E, N, K)
    torch.testing.assert_close(grouped_mm(x, w_t, offs), grouped_mm_ref(x, w, offs), atol=1e-5, rtol=1e-5)


def test_compiles_without_graph_break(device):
    x, w, offs = _inputs([3, 5], 16, 16, torch.float32, device)
    x.requires_grad_()
    compiled = torch.compile(lambda x, w, o: grouped_mm(x * 2, w, o), fullgraph=True)
    out = compiled(x, w, offs)
    out.sum().backward()
    torch.testing.assert_close(out, grouped_mm_ref(x.detach() * 2, w, offs), atol=1e-5, rtol=1e-5)
    assert x.grad is not None


def test_opcheck(device):
    x, w, offs = _inputs([3, 0, 5], 16, 16, torch.float32, device)
    torch.library.opcheck(torch.ops.kernel_lib.grouped_mm.default, (x, w, offs))


@pytest.mark.parametrize(
    "offs, w_shape, error, words",
    [
        (torch.tensor([2, 5], dtype=torch.int64), (2, 8, 4), TypeError, "offs must have dtype"),
        (torch.tensor([3, 2], dtype=torch.int32), (2, 8, 4), ValueError, "non-decreasing"),
        (torch.tensor([2, 4], dtype=torch.int32), (2, 8, 4), ValueError, r"offs\[-1\] must equal"),
        (torch.tensor([2, 5], dtype=torch.int32), (2, 7, 4), ValueError, "to match x's K"),
        (torch.tensor([5], dtype=torch.int32), (2, 8, 4), ValueError, "one entry per group"),
    ],
)
@pytest.mark.parametrize("path", ["kernel", "reference"])  # reference: CPU without the interpreter checks offs too
def test_bad_input_is_named(offs, w_shape, error, words, path, monkeypatch):
    if path == "reference":
        monkeypatch.setattr(grouped_mm_module, "use_triton", lambda *tensors, op: False)
    with pytest.raises(error, match=words):
        grouped_mm(torch.randn(5, 8), torch.randn(w_shape), offs)


@pytest.mark.gpu
@pytest.mark.gpu_memory  # 28 GiB at its peak on an H100: float64 copies of 98,304 x 2,048 tokens and their gradients
def test_moe_sized_on_gpu():
    counts = torch.multinomial(torch.ones(64), 16384 * 6, replacement=True).bincount(minlength=64).tolist()
    x, w, offs = _inputs(counts, 2048, 1408, torch.bfloat16, "cuda")
    check_forward_backward(grouped_mm, grouped_mm_ref, [x, w, offs], atol=1e-2, grads=[0, 1], baseline=torch_grouped_mm)


def test_unchecked_offs_path(device):
    x, w, offs = _inputs([5, 0, 11], 24, 20, torch.float32, device)
    x.requires_grad_()
    out = grouped_mm(x, w, offs, check_offs=False)
    torch.testing.assert_close(out, grouped_mm_ref(x.detach(), w, offs), atol=1e-5, rtol=1e-5)
    out.sum().backward()  # the unchecked path keeps autograd
    want_dx = grouped_mm_ref(torch.ones_like(out), w.transpose(1, 2), offs)  # dx = dy @ w[e].T per group
    torch.testing.assert_close(x.grad, want_dx, atol=1e-5, rtol=1e-5)
