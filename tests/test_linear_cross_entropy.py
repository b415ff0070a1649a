"""kernel_lib.linear_cross_entropy against float64, loss and the gradients of h and weight, across row chunks."""

import functools

import pytest
import torch

from kernel_lib.ops import linear_cross_entropy as lce_module
from kernel_lib.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from tests._checks import check_forward_backward

DTYPES = [  # (dtype, atol, rtol): allowance on top of 2x PyTorch's own error in that dtype
    pytest.param(torch.float32, 1e-5, 1e-4, id="fp32"),
    pytest.param(torch.float16, 1e-3, 0.0, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, 0.0, id="bf16"),
]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 rows, so small tests cross every chunk boundary (37 rows: 5 chunks, one rounding of dweight each)."""

    def set_rows(V, element_bytes):
        monkeypatch.setattr(lce_module, "CHUNK_BYTES", 8 * V * element_bytes)

    return set_rows


def _inputs(T, d, V, dtype, device, ignored=0):
    h = torch.randn(T, d, device=device).to(dtype)
    weight = (torch.randn(V, d, device=device) / d**0.5).to(dtype)
    target = torch.randint(0, V, (T,), device=device)
    target[:ignored] = -100
    return h, weight, target


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", [(37, 64, 1000), (8, 48, 257), (1, 16, 5)], ids=str)  # (T, d, V)
def test_forward_backward(device, small_chunks, shape, dtype, atol, rtol, reduction):
    T, d, V = shape  # 37 rows: 5 chunks of 8, the last partial; V = 1000 and 257: not powers of two
    h, weight, target = _inputs(T, d, V, dtype, device, ignored=3 if T > 3 else 0)
    small_chunks(V, h.element_size())
    kernel = functools.partial(linear_cross_entropy, reduction=reduction)
    reference = functools.partial(linear_cross_entropy_ref, reduction=reduction)
    check_forward_backward(kernel, reference, [h, weight, target], atol=atol, rtol=rtol, grads=[0, 1])


@pytest.mark.parametrize(
    "T, V, chunks",
    [
        (4096, 128256, 4),  # Llama 3's head at 2 x 2048 tokens: 4 chunks of 256 MB, not 2 of 512 MB
        (8192, 128256, 4),  # 512 MB chunks: the minimum and the byte cap agree
        (16384, 128256, 8),  # past the cap: chunks of at most 512 MB
        (3, 50, 3),  # fewer rows than MIN_CHUNKS: one row each
    ],
)
def test_chunks_are_at_most_512_mb_and_at_least_four(T, V, chunks):
    rows = lce_module._chunk_rows(T, V, 2)
    assert -(-T // rows) == chunks and rows * V * 2 <= lce_module.CHUNK_BYTES


def test_gradient_of_h_only(device, small_chunks):
    h, weight, target = _inputs(20, 32, 300, torch.float32, device)
    small_chunks(300, 4)
    h.requires_grad_()
    loss = linear_cross_entropy(h, weight, target)
    (dh,) = torch.autograd.grad(loss, h)
    h64 = h.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(linear_cross_entropy_ref(h64, weight.double(), target), h64)
    torch.testing.assert_close(dh.double(), want, atol=1e-6, rtol=1e-5)


def test_no_grad_computes_only_the_loss(device):
    h, weight, target = _inputs(16, 32, 200, torch.float32, device)
    with torch.no_grad():
        loss = linear_cross_entropy(h, weight, target)
    torch.testing.assert_close(loss, linear_cross_entropy_ref(h, weight, target), atol=1e-5, rtol=1e-5)


def test_all_ignored(device):
    h, weight, target = _inputs(6, 16, 50, torch.float32, device, ignored=6)
    h.requires_grad_()
    loss = linear_cross_entropy(h, weight, target)
    assert torch.isnan(loss)  # 0 / 0, as F.cross_entropy
    loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h))


def test_compiles_without_graph_break(device):
    h, weight, target = _inputs(12, 16, 100, torch.float32, device)
    h.requires_grad_()
    compiled = torch.compile(lambda h, w, t: linear_cross_entropy(h * 2, w, t), fullgraph=True)
    loss = compiled(h, weight, target)
    loss.backward()
    torch.testing.assert_close(loss, linear_cross_entropy_ref(h.detach() * 2, weight, target), atol=1e-5, rtol=1e-5)
    assert h.grad is not None


T4 = torch.ones(4, dtype=torch.int64)  # four valid targets


@pytest.mark.parametrize(
    "h, weight, target, kwargs, error, words",
    [
        (torch.ones(4, 8), torch.ones(10, 7), T4, {}, ValueError, r"weight must have shape \(V, 8\)"),
        (torch.ones(4, 8), torch.ones(10, 8).half(), T4, {}, TypeError, "h is float32, weight is float16"),
        (torch.ones(4, 8), torch.ones(10, 8), T4[:3], {}, ValueError, r"target must have shape \(4,\)"),
        (torch.ones(4, 8), torch.ones(10, 8), T4.int(), {}, TypeError, "target must have dtype"),
        (torch.ones(4, 8), torch.ones(10, 8), T4, {"reduction": "max"}, ValueError, "reduction"),
    ],
)
def test_bad_input_is_named(h, weight, target, kwargs, error, words):
    with pytest.raises(error, match=words):
        linear_cross_entropy(h, weight, target, **kwargs)


@pytest.mark.gpu
@pytest.mark.gpu_memory  # float64 copies of a 128,256 x 4,096 weight and its gradient
def test_llama_head_on_gpu():
    h, weight, target = _inputs(1024, 4096, 128256, torch.bfloat16, "cuda", ignored=100)
    check_forward_backward(linear_cross_entropy, linear_cross_entropy_ref, [h, weight, target], atol=1e-2, grads=[0, 1])
