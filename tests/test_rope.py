"""kernel_lib.rope against float64, forward and the gradients of x, cos and sin."""

import pytest
import torch

from kernel_lib.ops.rope import rope, rope_cos_sin, rope_ref
from tests._checks import check_forward_backward

DTYPES = [  # (dtype, atol, rtol): allowance on top of 2x PyTorch's own error in that dtype
    pytest.param(torch.float32, 1e-6, 1e-5, id="fp32"),
    pytest.param(torch.float16, 1e-3, 0.0, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, 0.0, id="bf16"),
]

SHAPES = [  # (B, H, N, D)
    (1, 1, 1, 2),  # the smallest rotation: one pair
    (2, 3, 17, 64),  # N not a multiple of the 16 positions per program
    (1, 2, 33, 6),  # D / 2 = 3, not a power of two
    (2, 4, 50, 128),  # a model-sized head
]


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(device, shape, dtype, atol, rtol):
    B, H, N, D = shape
    x = torch.randn(shape, device=device).to(dtype)
    cos, sin = rope_cos_sin(N, D, device=device)
    check_forward_backward(rope, rope_ref, [x, cos, sin], atol=atol, rtol=rtol, grads=[0])


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_q_and_k_sliced_from_a_fused_projection(device, dtype, atol, rtol):
    B, N, H, D = 2, 19, 4, 32
    qkv = torch.randn(B, N, 3, H, D, device=device).to(dtype)  # the layout a fused QKV matmul gives
    q = qkv[:, :, 0].transpose(1, 2)  # (B, H, N, D), strided, no copy
    assert not q.is_contiguous() and q.stride(-1) == 1
    cos, sin = rope_cos_sin(N, D, device=device)
    check_forward_backward(rope, rope_ref, [q, cos, sin], atol=atol, rtol=rtol, grads=[0])


def test_strided_tables_and_a_non_unit_feature_stride(device):
    N, D = 13, 16
    x = torch.randn(1, 2, N, 2 * D, device=device)[..., ::2]  # stride 2 along D: the launcher copies it
    angles = torch.randn(D // 2, N, device=device).t()  # (N, D/2) with stride 1 along N, not along D/2
    cos, sin = angles.cos(), angles.sin()
    assert x.stride(-1) == 2 and not cos.is_contiguous()
    check_forward_backward(rope, rope_ref, [x, cos, sin], atol=1e-5, rtol=1e-5, grads=[0])


def test_gradients_of_the_tables(device):
    x = torch.randn(2, 3, 9, 16, device=device)
    angles = torch.randn(9, 8, device=device)
    check_forward_backward(rope, rope_ref, [x, angles.cos(), angles.sin()], atol=1e-5, rtol=1e-5)


def test_rotation_preserves_norm_and_inverts(device):
    x = torch.randn(2, 2, 40, 64, device=device)
    cos, sin = rope_cos_sin(40, 64, device=device)
    y = rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)  # a rotation keeps lengths
    torch.testing.assert_close(rope(y, cos, -sin), x, atol=1e-5, rtol=1e-5)  # and undoing it gives x back


def test_compiles_without_graph_break(device):
    x = torch.randn(1, 2, 8, 16, device=device, requires_grad=True)
    cos, sin = rope_cos_sin(8, 16, device=device)
    compiled = torch.compile(lambda t: rope(t, cos, sin) * 2, fullgraph=True)
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, rope_ref(x, cos, sin) * 2, atol=1e-5, rtol=1e-5)
    assert x.grad is not None


def test_opcheck(device):
    x = torch.randn(1, 2, 8, 16, device=device)
    cos, sin = rope_cos_sin(8, 16, device=device)
    torch.library.opcheck(torch.ops.kernel_lib.rope.default, (x, cos, sin, False))


@pytest.mark.parametrize(
    "x, cos_shape, error, words",
    [
        (torch.ones(2, 8, 16), (8, 8), ValueError, "x must have 4 dims"),
        (torch.ones(1, 1, 8, 15), (8, 7), ValueError, "must be even"),
        (torch.ones(1, 1, 8, 16), (8, 16), ValueError, r"cos must have shape \(8, 8\)"),
        (torch.ones(1, 1, 8, 16, dtype=torch.int64), (8, 8), TypeError, "x must have dtype"),
    ],
)
def test_bad_input_is_named(x, cos_shape, error, words):
    with pytest.raises(error, match=words):
        rope(x, torch.ones(cos_shape), torch.ones(cos_shape))


def test_tables_on_another_device_are_named():
    with pytest.raises(ValueError, match="cos on meta"):
        rope(torch.ones(1, 1, 4, 8), torch.ones(4, 4, device="meta"), torch.ones(4, 4))


@pytest.mark.gpu
def test_large_on_gpu():
    x = torch.randn(4, 16, 4096, 128, device="cuda").bfloat16()
    cos, sin = rope_cos_sin(4096, 128, device="cuda")
    check_forward_backward(rope, rope_ref, [x, cos, sin], atol=1e-2, grads=[0])
