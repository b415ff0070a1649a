"""kernel_lib.attention against a float64 explicit-mask reference: output, log-sum-exp and dq, dk, dv."""

import functools

import pytest
import torch
import torch.nn.functional as F
import triton

from kernel_lib.ops import attention as attention_module
from kernel_lib.ops._utils import meta
from kernel_lib.ops.attention import MultiHeadAttention, _visible, attention_ref, flash_attention
from tests._checks import check_forward_backward

DTYPES = [  # (dtype, atol): allowance on top of 2x PyTorch's own error in that dtype
    pytest.param(torch.float16, 1e-3, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, id="bf16"),
]

CASES = [  # (B, Hq, Hkv, N, M, D, causal, window), the reason for each
    pytest.param(1, 2, 2, 99, 99, 32, False, None, id="odd-length"),
    pytest.param(2, 2, 2, 70, 70, 64, True, None, id="causal"),
    pytest.param(1, 2, 2, 1, 300, 32, True, None, id="one-query-many-keys"),  # decoding against a cache
    pytest.param(1, 2, 2, 40, 130, 32, True, None, id="query-prefix-shorter"),  # bottom-right alignment
    pytest.param(1, 1, 1, 50, 30, 32, True, None, id="more-queries-than-keys"),  # first 20 queries see nothing
    pytest.param(1, 2, 2, 64, 65, 32, True, None, id="key-block-boundary"),  # query 31 sees key 32, next block
    pytest.param(1, 8, 2, 45, 45, 32, True, None, id="gqa-group-4"),
    pytest.param(1, 4, 1, 33, 33, 64, False, None, id="mqa"),
    pytest.param(1, 2, 2, 100, 100, 32, True, 10, id="window-below-block"),
    pytest.param(1, 4, 2, 100, 100, 32, True, 70, id="window-above-block"),
    pytest.param(1, 1, 1, 37, 37, 128, True, None, id="head-dim-128"),
    pytest.param(1, 2, 1, 45, 45, 40, True, None, id="head-dim-40"),  # padded to 64 inside the kernels
    pytest.param(1, 2, 2, 33, 50, 59, False, None, id="head-dim-59"),  # odd: rows not 16-byte aligned
    pytest.param(1, 2, 2, 40, 40, (48, 24), True, None, id="head-dims-48-24"),  # v narrower than q, k (MLA)
]


def torch_attention(q, k, v, causal, window):
    """PyTorch's own attention in q's precision: SDPA with the explicit mask."""
    group = q.shape[1] // k.shape[1]
    mask = _visible(q.shape[2], k.shape[2], causal, window, q.device)
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask
    )


def _qkv(B, Hq, Hkv, N, M, D, dtype, device):
    """Random q, k, v; D is one head dim, or (q/k's, v's)."""
    D, Dv = D if isinstance(D, tuple) else (D, D)
    q = torch.randn(B, Hq, N, D, device=device).to(dtype)
    k = torch.randn(B, Hkv, M, D, device=device).to(dtype)
    v = torch.randn(B, Hkv, M, Dv, device=device).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype, atol", DTYPES)
@pytest.mark.parametrize("B, Hq, Hkv, N, M, D, causal, window", CASES)
def test_forward_backward(device, B, Hq, Hkv, N, M, D, causal, window, dtype, atol):
    q, k, v = _qkv(B, Hq, Hkv, N, M, D, dtype, device)
    kernel = functools.partial(flash_attention, causal=causal, window=window)
    reference = functools.partial(attention_ref, causal=causal, window=window)
    sees_nothing = not _visible(N, M, causal, window, device).any(dim=1).all()
    # SDPA gives NaN for a query that sees no key (we define 0); there, PyTorch's baseline is the fp32 reference.
    baseline = reference if sees_nothing else functools.partial(torch_attention, causal=causal, window=window)
    check_forward_backward(kernel, reference, [q, k, v], atol=atol, baseline=baseline)


BLOCK_SHAPES = [  # (queries, keys) per tile of both backward kernels: moves the masked/unmasked block split
    pytest.param(16, 64, id="key-tile-spans-4-query-tiles"),
    pytest.param(64, 16, id="query-tile-spans-4-key-tiles"),
]
SPLIT_CASES = [  # (B, Hq, Hkv, N, M, causal, window): where the split of each key or query range can go wrong
    pytest.param(1, 2, 1, 130, 130, True, None, id="causal-ragged-end"),
    pytest.param(1, 2, 2, 40, 130, True, None, id="queries-see-all-early-keys"),
    pytest.param(1, 1, 1, 150, 30, True, None, id="early-queries-see-nothing"),
    pytest.param(1, 2, 2, 130, 130, True, 20, id="window-between-tile-sizes"),
    pytest.param(1, 2, 1, 200, 200, True, 70, id="window-spans-full-tiles"),
]


@pytest.mark.parametrize("block_q, block_k", BLOCK_SHAPES)
@pytest.mark.parametrize("B, Hq, Hkv, N, M, causal, window", SPLIT_CASES)
def test_backward_with_other_tile_shapes(device, monkeypatch, B, Hq, Hkv, N, M, causal, window, block_q, block_k):
    # The backward kernels mask only the tiles on the mask's edge; the tests above run one tile shape (32 x 32
    # when interpreted), so the split is checked here with tiles of unequal sides.
    config = triton.Config({"BLOCK_M": block_q, "BLOCK_N": block_k}, num_warps=4, num_stages=2)
    monkeypatch.setattr(attention_module, "configs_that_fit", lambda *args: [meta(config)])  # every kernel: this tile
    q, k, v = _qkv(B, Hq, Hkv, N, M, 32, torch.float16, device)
    kernel = functools.partial(flash_attention, causal=causal, window=window)
    reference = functools.partial(attention_ref, causal=causal, window=window)
    sees_nothing = not _visible(N, M, causal, window, device).any(dim=1).all()
    baseline = reference if sees_nothing else functools.partial(torch_attention, causal=causal, window=window)
    check_forward_backward(kernel, reference, [q, k, v], atol=1e-3, baseline=baseline)


@pytest.mark.parametrize("B, Hq, Hkv, N, M, D, causal, window", CASES[:6] + CASES[8:9])
def test_log_sum_exp(device, B, Hq, Hkv, N, M, D, causal, window):
    q, k, v = _qkv(B, Hq, Hkv, N, M, D, torch.float16, device)
    _, lse = flash_attention(q, k, v, causal=causal, window=window, return_lse=True)
    _, want = attention_ref(q.double(), k.double(), v.double(), causal, window, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (B, Hq, N)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(lse), finite)  # -inf exactly where a query sees nothing
    torch.testing.assert_close(lse.double()[finite], want[finite], atol=1e-4, rtol=1e-4)


def test_gradient_through_the_log_sum_exp(device):
    q, k, v = _qkv(1, 2, 1, 30, 30, 32, torch.float16, device)

    def kernel(q, k, v):
        out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
        return out.float().sum(-1) + lse  # (B, H, N): uses both outputs

    def reference(q, k, v):
        out, lse = attention_ref(q, k, v, True, return_lse=True)
        return out.to(lse.dtype).sum(-1) + lse

    check_forward_backward(kernel, reference, [q, k, v], atol=1e-3)


def test_non_contiguous_q_k_v_from_a_fused_projection(device):
    qkv = torch.randn(2, 48, 3, 2, 32, device=device).half()  # (B, N, 3, H, D), as a fused QKV matmul gives it
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D) strided views
    assert not q.is_contiguous()
    check_forward_backward(
        flash_attention,
        attention_ref,
        [q, k, v],
        atol=1e-3,
        baseline=functools.partial(torch_attention, causal=False, window=None),
    )


def test_module_matches_its_reference(device):
    torch.manual_seed(0)
    module = MultiHeadAttention(64, n_heads=4, n_kv_heads=2, causal=True, rope=True, device=device).half()
    x = torch.randn(2, 24, 64, device=device).half()
    from kernel_lib.ops.rope import rope_cos_sin, rope_ref

    q, k, v = module.qkv(x).split([64, 32, 32], dim=-1)
    q = q.view(2, 24, 4, 16).transpose(1, 2)
    k = k.view(2, 24, 2, 16).transpose(1, 2)
    v = v.view(2, 24, 2, 16).transpose(1, 2)
    cos, sin = rope_cos_sin(24, 16, device=device)
    want = attention_ref(rope_ref(q, cos, sin), rope_ref(k, cos, sin), v, causal=True)
    want = module.proj(want.transpose(1, 2).reshape(2, 24, 64))
    torch.testing.assert_close(module(x), want, atol=2e-3, rtol=2e-3)


def test_compiles_without_graph_break(device):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 1, 20, 20, 32, torch.float16, device))
    compiled = torch.compile(lambda q, k, v: flash_attention(q * 2, k, v, causal=True), fullgraph=True)
    out = compiled(q, k, v)
    out.float().sum().backward()
    torch.testing.assert_close(out, attention_ref(q.detach() * 2, k.detach(), v.detach(), True), atol=2e-3, rtol=2e-3)
    assert q.grad is not None and k.grad is not None


def test_compiles_with_a_value_head_dim_apart_from_the_query_s(device):
    # torch.compile sizes outputs from the op's fake: out is (B, H, N, Dv), not q's shape
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 1, 20, 20, (48, 24), torch.float16, device))
    out = torch.compile(lambda q, k, v: flash_attention(q, k, v, causal=True), fullgraph=True)(q, k, v)
    assert out.shape == (1, 2, 20, 24)
    out.float().sum().backward()
    torch.testing.assert_close(out, attention_ref(q.detach(), k.detach(), v.detach(), True), atol=2e-3, rtol=2e-3)


def test_opcheck(device):
    q, k, v = _qkv(1, 2, 1, 20, 20, 32, torch.float16, device)
    torch.library.opcheck(torch.ops.kernel_lib.flash_attention_fwd.default, (q, k, v, True, 8, 0.2))


@pytest.mark.parametrize(
    "shapes, kwargs, error, words",
    [
        (((2, 8, 32), (1, 2, 8, 32), (1, 2, 8, 32)), {}, ValueError, "q must have 4 dims"),
        (((1, 2, 8, 32), (1, 2, 8, 64), (1, 2, 8, 64)), {}, ValueError, "same head dim"),
        (((1, 3, 8, 32), (1, 2, 8, 32), (1, 2, 8, 32)), {}, ValueError, "multiple of key/value heads"),
        (((1, 2, 8, 320), (1, 2, 8, 320), (1, 2, 8, 32)), {}, ValueError, "q and k must be between 1 and 256"),
        (((1, 2, 8, 32), (1, 2, 8, 32), (1, 2, 8, 264)), {}, ValueError, "head dim of v must be between 1 and 256"),
        (((1, 2, 8, 32), (1, 2, 8, 32), (1, 2, 9, 32)), {}, ValueError, "k and v must have the same length"),
        (((1, 2, 8, 32), (1, 2, 8, 32), (1, 1, 8, 32)), {}, ValueError, "same number of heads"),
        (((2, 2, 8, 32), (1, 2, 8, 32), (1, 2, 8, 32)), {}, ValueError, "same batch size"),
        (((1, 2, 8, 32), (1, 2, 8, 32), (1, 2, 8, 32)), {"window": 4}, ValueError, "window needs causal"),
        (((1, 2, 8, 32), (1, 2, 8, 32), (1, 2, 8, 32)), {"window": 0, "causal": True}, ValueError, "positive"),
    ],
)
def test_bad_input_is_named(shapes, kwargs, error, words):
    q, k, v = (torch.randn(s).half() for s in shapes)
    with pytest.raises(error, match=words):
        flash_attention(q, k, v, **kwargs)


def test_mixed_dtypes_and_devices_are_named():
    q = torch.randn(1, 2, 8, 32).half()
    with pytest.raises(TypeError, match="q is float16, k is bfloat16"):
        flash_attention(q, q.bfloat16(), q)
    with pytest.raises(TypeError, match="q must have dtype"):
        flash_attention(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="k on meta"):
        flash_attention(q, q.to("meta"), q)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 1024)])
def test_long_sequences_on_gpu(causal, window):
    q, k, v = _qkv(1, 4, 2, 8192, 8192, 128, torch.bfloat16, "cuda")
    out, lse = flash_attention(q, k, v, causal=causal, window=window, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    rows = slice(-256, None)  # compare the last queries, which see the most keys, against float64
    want = attention_ref(q[:, :, rows].double(), k.double(), v.double(), causal, window)
    torch.testing.assert_close(out[:, :, rows].double(), want, atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, atol", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_model_sized_on_gpu(causal, dtype, atol):
    q, k, v = _qkv(2, 8, 2, 1027, 1027, 128, dtype, "cuda")
    kernel = functools.partial(flash_attention, causal=causal)
    reference = functools.partial(attention_ref, causal=causal)
    check_forward_backward(
        kernel, reference, [q, k, v], atol=atol, baseline=functools.partial(torch_attention, causal=causal, window=None)
    )


def test_forward_config_is_what_the_forward_launches_with(device):
    q, k, v = _qkv(1, 2, 1, 40, 40, (80, 48), torch.float16, device)
    config = attention_module.forward_config(q, k, v, causal=True)
    assert set(config) == {"path", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
    if config.pop("path") == "hopper":  # SM90: the Hopper kernel's one config
        assert config["BLOCK_N"] == attention_module.hopper.config(80, 48)["BLOCK_N"]
    elif device == "cpu":  # interpreted: the smallest tiles
        assert config == meta(attention_module.kernels._FWD_CONFIGS[0])
    else:  # the heuristic's first pick that fits (padded widths 128 + 64), compiled to check it
        fits = attention_module.configs_that_fit(
            attention_module.kernels.fwd_preferred(40, 192, True, False),
            attention_module.kernels._FWD_CONFIGS[0],
            attention_module.kernels._smem_bytes,
            {"BLOCK_DQK": 128, "BLOCK_DV": 64, "q": q},
        )
        assert config == fits[0]
