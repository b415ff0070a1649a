"""kernel_lib.rope against float64, forward and the gradients of x, cos and sin; rope_to_cache (decoding's
rotation, cache write and query block in one kernel) against float64 and bit for bit against rope."""

import pytest
import torch

from kernel_lib.ops.rope import rope, rope_cos_sin, rope_ref, rope_to_cache, rope_to_cache_ref
from kernel_lib.validate import check, report
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


# --------------------------------------------------------------------------------------------------
# rope_to_cache: decoding's RoPE, cache write and query block in one kernel
# --------------------------------------------------------------------------------------------------
def _step_inputs(device, dtype, B, H, HKV, n, D, S):
    """q, k, v as views of one fused qkv projection (B, n, (H + 2 HKV) D), the layout the GPT's step has, and
    caches full of random values (untouched positions must keep them)."""
    qkv = torch.randn(B, n, (H + 2 * HKV) * D, device=device).to(dtype)
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)
    q = q.view(B, n, H, D).transpose(1, 2)
    k = k.view(B, n, HKV, D).transpose(1, 2)
    v = v.view(B, n, HKV, D).transpose(1, 2)
    cache_k = torch.randn(B, HKV, S, D, device=device).to(dtype)
    cache_v = torch.randn(B, HKV, S, D, device=device).to(dtype)
    return q, k, v, cache_k, cache_v


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize(
    "B, H, HKV, n, D, S, pos, block_rows, block_start",
    [
        (1, 4, 4, 1, 16, 40, 30, 16, 24),  # a graph's decode step: one token in a block of 16 rows
        (2, 4, 2, 2, 16, 40, 17, None, "pos"),  # a graph's step for decode_attention: tensor pos, block = q
        (2, 4, 2, 1, 16, 40, 39, 16, 24),  # grouped-query heads, the last position of the cache
        (2, 4, 4, 5, 32, 50, 10, None, None),  # a prefill chunk: the block is the rotated q itself
        (1, 2, 1, 3, 6, 20, 12, 8, 12),  # D / 2 = 3, not a power of two; queries at the block's first rows
        (1, 3, 3, 20, 8, 24, 0, None, None),  # more tokens than one program's 16 rows
    ],
    ids=str,
)
def test_rope_to_cache_against_float64(device, dtype, atol, rtol, B, H, HKV, n, D, S, pos, block_rows, block_start):
    q, k, v, cache_k, cache_v = _step_inputs(device, dtype, B, H, HKV, n, D, S)
    cos, sin = rope_cos_sin(64, D, device=device)
    want_k, want_v = cache_k.double(), cache_v.double()
    base_k, base_v = cache_k.clone(), cache_v.clone()
    tensor_pos = block_start is not None  # a graph's step passes the position as a tensor
    p = torch.tensor([pos], device=device) if tensor_pos else pos
    block_start = None if block_start == "pos" else block_start  # tensor pos, no block: rows 0..n-1 hold q
    want = rope_to_cache_ref(q.double(), k.double(), v.double(), cos.double(), sin.double(), p, want_k, want_v,
                             block_rows, block_start)  # fmt: skip
    base = rope_to_cache_ref(q, k, v, cos, sin, p, base_k, base_v, block_rows, block_start)  # PyTorch in dtype
    out = rope_to_cache(q, k, v, cos, sin, p, cache_k, cache_v, block_rows, block_start)
    results = [
        check(out, want, base, name="block", atol=atol, rtol=rtol),
        check(cache_k, want_k, base_k, name="cache_k", atol=atol, rtol=rtol),
        check(cache_v, want_v, base_v, name="cache_v", atol=0.0, rtol=0.0),  # copied, not computed
    ]
    assert all(r.ok for r in results), report(results)


def test_rope_to_cache_rotates_bit_for_bit_as_rope(device):
    """A decoder that calls rope_to_cache must pick the same tokens as one that calls rope: the same float32
    arithmetic, rounded once. The block's other rows are zero, and positions not in the step are untouched."""
    B, H, HKV, n, D, S, pos = 2, 4, 2, 3, 32, 48, 20
    q, k, v, cache_k, cache_v = _step_inputs(device, torch.bfloat16, B, H, HKV, n, D, S)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    cos, sin = rope_cos_sin(64, D, device=device)
    block = rope_to_cache(q, k, v, cos, sin, torch.tensor([pos], device=device), cache_k, cache_v, 16, 16)
    c, s = cos[pos : pos + n], sin[pos : pos + n]
    assert torch.equal(block[:, :, pos - 16 : pos - 16 + n], rope(q, c, s))
    assert torch.equal(cache_k[:, :, pos : pos + n], rope(k, c, s))
    assert torch.equal(cache_v[:, :, pos : pos + n], v)
    others = torch.ones(16, dtype=torch.bool)
    others[pos - 16 : pos - 16 + n] = False
    assert not block[:, :, others].any()
    keep = torch.ones(S, dtype=torch.bool)
    keep[pos : pos + n] = False
    assert torch.equal(cache_k[:, :, keep], before_k[:, :, keep])
    assert torch.equal(cache_v[:, :, keep], before_v[:, :, keep])


def test_rope_to_cache_skips_a_tensor_position_past_the_cache(device):
    """A tensor pos is not read on the host, so nothing refuses pos + n > S: the kernel must skip the tokens past
    the cache rather than write beyond it (the caller's guarantee broken, memory still intact)."""
    B, H, HKV, n, D, S = 1, 2, 2, 2, 16, 8
    q, k, v, cache_k, cache_v = _step_inputs(device, torch.float32, B, H, HKV, n, D, S)
    backing_k = torch.randn(2 * S * HKV * D, device=device)  # the cache is the front half of a larger buffer
    cache_k = backing_k[: S * HKV * D].view(B, HKV, S, D)
    after = backing_k[S * HKV * D :].clone()
    cos, sin = rope_cos_sin(16, D, device=device)
    pos = torch.tensor([S - 1], device=device)  # token 1 would land at position S, one past the end
    block = rope_to_cache(q, k, v, cos, sin, pos, cache_k, cache_v, 4, S - 2)
    assert torch.equal(backing_k[S * HKV * D :], after)
    torch.testing.assert_close(cache_k[:, :, S - 1], rope_ref(k, cos[S - 1 : S + 1], sin[S - 1 : S + 1])[:, :, 0])
    assert torch.equal(cache_v[:, :, S - 1], v[:, :, 0])
    # the block starts at position S - 2: tokens in rows 1 and 2, rows 0 and 3 zero; the tables reach position S,
    # so token 1's query is rotated as usual, only its cache write is skipped
    assert block.shape == (B, H, 4, D) and not block[:, :, 0].any() and not block[:, :, 3].any()
    torch.testing.assert_close(block[:, :, 1:3], rope_ref(q, cos[S - 1 : S + 1], sin[S - 1 : S + 1]))


def test_rope_to_cache_opcheck(device):
    q, k, v, cache_k, cache_v = _step_inputs(device, torch.float32, 1, 2, 2, 1, 16, 8)
    cos, sin = rope_cos_sin(8, 16, device=device)
    pos = torch.tensor([5], device=device)
    torch.library.opcheck(torch.ops.kernel_lib.rope_to_cache.default, (q, k, v, cos, sin, pos, cache_k, cache_v, 4, 4))


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(pos=7), ValueError, r"positions \[7, 9\) do not fit the cache"),  # 2 tokens past a cache of 8
        (dict(pos=torch.tensor([1], dtype=torch.int32)), ValueError, "one int64 element"),
        (dict(pos=torch.tensor([1]), block_rows=4), ValueError, "give block_start"),  # a block needs its start
        (dict(block_rows=1), ValueError, "block_rows must be an int >= the step's 2 tokens"),
        (dict(block_rows=4, block_start=4), ValueError, "fall outside the block"),
        (dict(cache_k=torch.zeros(1, 2, 8, 16, dtype=torch.float16)), TypeError, "share one dtype"),
        (dict(cache_v=torch.zeros(1, 2, 16, 8).transpose(2, 3)), ValueError, "cache_v must be a contiguous"),
        (dict(cache_v=None), ValueError, "two tensors, not one"),  # cache_v given as cache_k itself
        (dict(cos=torch.ones(8, 16)), ValueError, r"cos and sin must be \(L, 8\) tables"),
        (dict(k=torch.zeros(1, 2, 2, 32)[..., ::2]), ValueError, "k must have unit stride"),
        (dict(v=torch.zeros(1, 1, 2, 16)), ValueError, r"v must have shape \(1, 2, 2, 16\)"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_rope_to_cache_bad_input_is_named(change, error, words):
    args = dict(
        q=torch.zeros(1, 2, 2, 16), k=torch.zeros(1, 2, 2, 16), v=torch.zeros(1, 2, 2, 16),
        cos=torch.ones(8, 8), sin=torch.zeros(8, 8), pos=0, cache_k=torch.zeros(1, 2, 8, 16),
        cache_v=torch.zeros(1, 2, 8, 16),
    )  # fmt: skip
    args.update(change)
    if args["cache_v"] is None:
        args["cache_v"] = args["cache_k"]
    with pytest.raises(error, match=words):
        rope_to_cache(**args)


def test_rope_to_cache_refuses_autograd():
    q = torch.zeros(1, 1, 1, 8, requires_grad=True)
    cache = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="for inference"):
        rope_to_cache(q, q.detach(), q.detach(), torch.ones(4, 4), torch.zeros(4, 4), 0, cache, cache.clone())
