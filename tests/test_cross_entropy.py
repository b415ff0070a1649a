"""kernel_lib.cross_entropy against float64 F.cross_entropy, loss and logits gradient, every reduction."""

import functools

import pytest
import torch

from kernel_lib.ops.cross_entropy import cross_entropy, cross_entropy_ref
from tests._checks import check_forward_backward

DTYPES = [  # (dtype, atol, rtol): allowance on top of 2x PyTorch's own error in that dtype
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-4, 0.0, id="fp16"),
    pytest.param(torch.bfloat16, 1e-3, 0.0, id="bf16"),
]

SHAPES = [  # (T, V)
    (1, 1),  # one class: loss 0, gradient 0
    (3, 999),  # V not a power of two, inside one 4096 step
    (5, 4096),  # exactly one step
    (4, 10001),  # three steps, the last partial
    (2, 32003),  # many steps (a vocabulary-sized row at test scale)
]


def _targets(T, V, device, ignored=0):
    target = torch.randint(0, V, (T,), device=device)
    target[:ignored] = -100
    return target


def _bound(reduction, label_smoothing=0.0, ignore_index=-100):
    kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    return functools.partial(cross_entropy, **kw), functools.partial(cross_entropy_ref, **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(device, shape, dtype, atol, rtol, reduction):
    T, V = shape
    logits = (2 * torch.randn(T, V, device=device)).to(dtype)
    kernel, reference = _bound(reduction)
    check_forward_backward(kernel, reference, [logits, _targets(T, V, device)], atol=atol, rtol=rtol, grads=[0])


@pytest.mark.parametrize("smoothing", [0.1, 1.0])
@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_label_smoothing_and_ignored_rows(device, dtype, atol, rtol, smoothing):
    logits = torch.randn(9, 5000, device=device).to(dtype)
    kernel, reference = _bound("mean", label_smoothing=smoothing)
    target = _targets(9, 5000, device, ignored=3)  # a third of the rows ignored: excluded from the mean
    check_forward_backward(kernel, reference, [logits, target], atol=atol, rtol=rtol, grads=[0])


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_large_magnitude_logits(device, dtype, atol, rtol):
    logits = (1000 * torch.randn(6, 3000, device=device)).to(dtype)  # exp overflows without the running max
    kernel, reference = _bound("sum")
    check_forward_backward(kernel, reference, [logits, _targets(6, 3000, device)], atol=atol, rtol=rtol, grads=[0])


def test_non_contiguous_logits(device):
    logits = torch.randn(3000, 7, device=device).t()  # (7, 3000), the vocabulary strided
    kernel, reference = _bound("mean")
    check_forward_backward(kernel, reference, [logits, _targets(7, 3000, device)], atol=1e-5, rtol=1e-5, grads=[0])


def test_custom_ignore_index(device):
    logits = torch.randn(6, 100, device=device)
    target = _targets(6, 100, device)
    target[1] = 7  # ignore class 7 only
    kernel, reference = _bound("mean", ignore_index=7)
    check_forward_backward(kernel, reference, [logits, target], atol=1e-5, rtol=1e-5, grads=[0])


def test_all_ignored(device):
    logits = torch.randn(4, 300, device=device, requires_grad=True)
    target = torch.full((4,), -100, device=device)
    mean = cross_entropy(logits, target)
    assert torch.isnan(mean) and torch.isnan(cross_entropy_ref(logits, target))  # 0 / 0, as in PyTorch
    mean.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))  # and zero gradient, as in PyTorch
    assert cross_entropy(logits, target, reduction="sum").item() == 0.0


def test_out_of_range_target_gives_nan_in_the_kernel(device):
    logits = torch.randn(3, 50, device=device)
    target = torch.tensor([1, 50, -3], device=device)  # 50 and -3 are neither classes nor ignore_index
    loss = cross_entropy(logits, target, reduction="none")
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1]) and torch.isnan(loss[2])


def test_compiles_without_graph_break(device):
    logits = torch.randn(5, 300, device=device, requires_grad=True)
    target = _targets(5, 300, device)
    compiled = torch.compile(lambda x, t: cross_entropy(x * 2, t), fullgraph=True)
    loss = compiled(logits, target)
    loss.backward()
    torch.testing.assert_close(loss, cross_entropy_ref(logits.detach() * 2, target), atol=1e-5, rtol=1e-5)
    assert logits.grad is not None


def test_opcheck(device):
    args = (torch.randn(4, 300, device=device), _targets(4, 300, device), -100, 0.1)
    torch.library.opcheck(torch.ops.kernel_lib.cross_entropy_fwd.default, args)


@pytest.mark.parametrize(
    "logits, target, kwargs, error, words",
    [
        (torch.ones(4, 5), torch.ones(4, dtype=torch.int32), {}, TypeError, "target must have dtype"),
        (torch.ones(4, 5), torch.ones(3, dtype=torch.int64), {}, ValueError, "one entry per row of logits"),
        (torch.ones(4, 5, dtype=torch.int64), torch.ones(4, dtype=torch.int64), {}, TypeError, "logits must have"),
        (torch.ones(2, 4, 5), torch.ones(2, dtype=torch.int64), {}, ValueError, "logits must have 2 dims"),
        (torch.ones(4, 5), torch.ones(4, dtype=torch.int64), {"reduction": "avg"}, ValueError, "reduction must be"),
        (torch.ones(4, 5), torch.ones(4, dtype=torch.int64), {"label_smoothing": 1.5}, ValueError, "label_smoothing"),
        (torch.ones(4, 5), torch.ones(4, dtype=torch.int64, device="meta"), {}, ValueError, "target on meta"),
    ],
)
def test_bad_input_is_named(logits, target, kwargs, error, words):
    with pytest.raises(error, match=words):
        cross_entropy(logits, target, **kwargs)


@pytest.mark.gpu
def test_llama_vocabulary_on_gpu():
    logits = torch.randn(512, 128256, device="cuda").bfloat16()
    target = _targets(512, 128256, "cuda", ignored=50)
    kernel, reference = _bound("mean")
    check_forward_backward(kernel, reference, [logits, target], atol=1e-3, grads=[0])
