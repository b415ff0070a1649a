"""kernel_lib.attention's packed sequences (flash_attention_varlen, FlashAttention's flash_attn_varlen_func):
each sequence against float64 attention over it alone, forward and backward; offsets checked; the module."""

import functools

import pytest
import torch
import torch.nn.functional as F

from kernel_lib.ops import attention as attention_module
from kernel_lib.ops.attention import (
    MultiHeadAttention,
    _visible,
    attention_ref,
    attention_varlen_ref,
    flash_attention,
    flash_attention_varlen,
)
from tests._checks import check_forward_backward
from tests.test_attention_grid import ATOL, LAYOUTS, MASKS, SEQLEN_PAIRS, over_the_grid

HAS_CUDA = torch.cuda.is_available()


def offsets(lengths, device) -> torch.Tensor:
    """cu_seqlens: int32 (B + 1,) running sum of the lengths from 0."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def torch_attention_varlen(q, k, v, cu_q, cu_k, causal, window):
    """PyTorch's own attention in q's precision, one sequence at a time (SDPA with the explicit mask, heads
    repeated for GQA); a sequence with a query that sees no key (SDPA: NaN) goes through the reference."""
    outs = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    group = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:], strict=False):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        mask = _visible(q1 - q0, k1 - k0, causal, window, q.device)
        if q1 > q0 and not mask.any(dim=1).all():
            out = attention_ref(qs, ks, vs, causal, window)
        else:
            ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=q.shape[-1] ** -0.5)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def check_packed(lengths_q, lengths_k, Hq, Hkv, D, Dv, causal, window, dtype, device, atol):
    cu_q, cu_k = offsets(lengths_q, device), offsets(lengths_k, device)
    q = torch.randn(sum(lengths_q), Hq, D, device=device).to(dtype)
    k = torch.randn(sum(lengths_k), Hkv, D, device=device).to(dtype)
    v = torch.randn(sum(lengths_k), Hkv, Dv, device=device).to(dtype)
    packing = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    kernel = functools.partial(flash_attention_varlen, **packing, causal=causal, window=window)
    reference = functools.partial(attention_varlen_ref, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal,
                                  window=window)  # fmt: skip
    baseline = functools.partial(torch_attention_varlen, cu_q=cu_q, cu_k=cu_k, causal=causal, window=window)
    check_forward_backward(kernel, reference, [q, k, v], atol=atol, baseline=baseline, name=f"out {lengths_q}")


CASES = [  # (query lengths, key lengths, Hq, Hkv, D, Dv, causal, window), the reason for each
    pytest.param([5, 40, 33], [5, 40, 33], 2, 2, 32, 32, False, None, id="self-attention-mixed-lengths"),
    pytest.param([5, 40, 33], [5, 40, 33], 4, 2, 32, 32, True, None, id="causal-gqa"),
    pytest.param([1, 70], [1, 70], 2, 1, 32, 32, True, None, id="one-token-document"),
    pytest.param([7, 0, 30], [9, 0, 30], 2, 2, 32, 32, True, None, id="empty-sequence-between"),
    pytest.param([20, 8], [30, 50], 2, 2, 32, 32, True, None, id="keys-longer-bottom-right"),
    pytest.param([30, 12], [10, 12], 2, 2, 32, 32, True, None, id="queries-longer-see-nothing"),
    pytest.param([12, 9], [0, 9], 2, 2, 32, 32, False, None, id="sequence-without-keys"),  # out 0, lse -inf
    pytest.param([50, 37], [50, 37], 4, 1, 32, 32, True, 9, id="window-mqa"),
    pytest.param([33, 17], [33, 17], 2, 1, 40, 24, True, None, id="head-dims-40-24"),  # padded; v apart from q
]


@pytest.mark.parametrize("lengths_q, lengths_k, Hq, Hkv, D, Dv, causal, window", CASES)
def test_packed_matches_each_sequence_alone(device, lengths_q, lengths_k, Hq, Hkv, D, Dv, causal, window):
    check_packed(lengths_q, lengths_k, Hq, Hkv, D, Dv, causal, window, torch.float16, device, atol=1e-3)


def test_packed_equals_fixed_length_batch(device):
    # B sequences of one length packed are the (B, H, N, D) batch: same kernels, same results to the bit
    B, H, N, D = 3, 2, 37, 32
    q, k, v = (torch.randn(B, N, H, D, device=device).half() for _ in range(3))
    cu = offsets([N] * B, device)
    packed, lse_p = flash_attention_varlen(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, N, N, causal=True,
                                           return_lse=True)  # fmt: skip
    fixed, lse_f = flash_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, return_lse=True)
    assert torch.equal(packed, fixed.transpose(1, 2).flatten(0, 1))
    assert torch.equal(lse_p, lse_f.transpose(0, 1).flatten(1))  # (H, B * N)


def test_log_sum_exp_layout(device):
    lengths = [9, 0, 21]
    cu = offsets(lengths, device)
    q, k, v = (torch.randn(30, 2, 32, device=device).half() for _ in range(3))
    _, lse = flash_attention_varlen(q, k, v, cu, cu, 21, 21, causal=True, return_lse=True)
    _, want = attention_varlen_ref(q.double(), k.double(), v.double(), cu, cu, True, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (2, 30)  # (heads, tokens), FlashAttention's layout
    torch.testing.assert_close(lse.double(), want, atol=1e-4, rtol=1e-4)


def test_compiles_without_graph_break(device):
    cu = offsets([11, 20], device)
    q, k, v = (torch.randn(31, 2, 32, device=device).half().requires_grad_() for _ in range(3))
    fn = functools.partial(flash_attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=20,
                           max_seqlen_k=20, causal=True)  # fmt: skip
    out = torch.compile(lambda q, k, v: fn(q * 2, k, v), fullgraph=True)(q, k, v)
    out.float().sum().backward()
    want = attention_varlen_ref(q.detach() * 2, k.detach(), v.detach(), cu, cu, True)
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
    assert q.grad is not None and v.grad is not None


def test_opcheck(device):
    cu = offsets([11, 20], device)
    q, k, v = (torch.randn(31, 2, 32, device=device).half() for _ in range(3))
    torch.library.opcheck(torch.ops.kernel_lib.flash_attention_fwd.default, (q, k, v, True, 8, 0.2, cu, cu, 20, 20))


@pytest.mark.parametrize(
    "cu_q, max_q, words",
    [
        ([1, 5, 10], 5, "must start at 0"),
        ([0, 6, 4, 10], 6, "must not decrease, got 6 then 4 at index 1"),
        ([0, 5, 12], 7, "must end at the number of tokens \\(10\\), got 12"),  # past the end
        ([0, 5, 9], 5, "must end at the number of tokens \\(10\\), got 9"),  # tokens left over
        ([0, 3, 10], 5, "a sequence of 7 tokens is longer than max_seqlen \\(5\\)"),  # grid would miss rows
        ([], 5, "at least one offset"),
    ],
)
def test_bad_offsets_are_named(cu_q, max_q, words):
    q = torch.randn(10, 2, 32).half()
    cu = torch.tensor(cu_q, dtype=torch.int32)
    cu_k = torch.tensor([0, *[5] * (len(cu_q) - 2), 10], dtype=torch.int32) if cu_q else cu  # valid keys
    with pytest.raises(ValueError, match=words):
        flash_attention_varlen(q, q, q, cu, cu_k, max_q, 10)


def test_offsets_are_read_once_per_tensor(monkeypatch):
    # the layers of a model share one cu_seqlens: only the first call copies it to the host (a wait for the GPU)
    reads = []
    read = attention_module._host_offsets
    monkeypatch.setattr(attention_module, "_host_offsets", lambda cu: reads.append(1) or read(cu))
    q = torch.randn(10, 2, 32).half()
    cu = offsets([4, 6], "cpu")
    for _ in range(3):
        flash_attention_varlen(q, q, q, cu, cu, 6, 6)
    assert len(reads) == 1
    flash_attention_varlen(q, q, q, cu.clone(), cu, 6, 6)  # another tensor with the same values: read
    assert len(reads) == 2


def test_offsets_are_read_again_after_an_in_place_change():
    # checked offsets are remembered (one host read per tensor), but a write to the tensor is seen
    q = torch.randn(10, 2, 32).half()
    cu = offsets([4, 6], "cpu")
    flash_attention_varlen(q, q, q, cu, cu, 6, 6)
    cu[1] = 7  # now 0, 7, 10: a sequence of 7 tokens
    with pytest.raises(ValueError, match="a sequence of 7 tokens is longer than max_seqlen \\(6\\)"):
        flash_attention_varlen(q, q, q, cu, cu, 6, 6)


def test_bad_packing_is_named():
    q = torch.randn(10, 2, 32).half()
    cu = offsets([4, 6], "cpu")
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype"):
        flash_attention_varlen(q, q, q, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="count the same sequences"):
        flash_attention_varlen(q, q, q, cu, offsets([10], "cpu"), 6, 10)
    with pytest.raises(ValueError, match="q must have 3 dims"):
        flash_attention_varlen(q[None], q, q, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="same number of tokens"):
        flash_attention_varlen(q, q, q[:9], cu, cu, 6, 6)
    with pytest.raises(ValueError, match="must be on q's device"):
        flash_attention_varlen(q, q, q, cu.to("meta"), cu, 6, 6)


def test_module_with_packed_documents(device):
    # Packed, the module restarts the rotary positions at each document: each output row equals the module run
    # on its document alone.
    torch.manual_seed(0)
    module = MultiHeadAttention(64, n_heads=4, n_kv_heads=2, causal=True, rope=True, device=device).half()
    lengths = [9, 14]
    x = torch.randn(sum(lengths), 64, device=device).half()
    out = module(x, cu_seqlens=offsets(lengths, device), max_seqlen=max(lengths))
    assert out.shape == x.shape
    alone = torch.cat([module(doc[None])[0] for doc in x.split(lengths)])
    torch.testing.assert_close(out, alone, atol=2e-3, rtol=2e-3)


# On the GPU: FlashAttention's varlen grid (its test_flash_attn_varlen_output): every head dim and mask in the
# dtype the fixed-length grid leaves out, random lengths up to every other length pair of the fixed-length grid,
# three documents a batch.
GRID_PAIRS = SEQLEN_PAIRS[::2]


@over_the_grid(GRID_PAIRS, turn=1)  # the dtypes the fixed-length grid does not run
def test_flash_attention_varlen_grid(D, dtype, mask, pairs):
    causal, window = MASKS[mask]
    gen = torch.Generator().manual_seed(D)
    for i, (N, M) in enumerate(pairs):
        # FlashAttention's random padding: each document between 20 tokens short of the pair and the pair
        lengths_q = torch.randint(max(1, N - 20), N + 1, (3,), generator=gen).tolist()
        lengths_k = torch.randint(max(1, M - 20), M + 1, (3,), generator=gen).tolist()
        Hq, Hkv = LAYOUTS[i % len(LAYOUTS)]
        check_packed(lengths_q, lengths_k, Hq, Hkv, D, D, causal, window, dtype, "cuda", ATOL[dtype])


@pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the whole grid above")
@pytest.mark.parametrize("mask", MASKS)
def test_varlen_grid_slice_interpreted(mask):
    causal, window = MASKS[mask]
    check_packed([60, 113], [71, 203 if mask == "none" else 97], 2, 1, 80, 80, causal, window, torch.bfloat16,
                 "cpu", ATOL[torch.bfloat16])  # fmt: skip
