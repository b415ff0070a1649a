"""kernel_lib.decode_attention (a decoding step over a KV cache, keys split across programs) against float64, with
FlashAttention's 2x rule against PyTorch's own attention in the inputs' precision; lengths as ints and as tensors
on the device; GQA; several queries a step; bad input."""

import pytest
import torch
import torch.nn.functional as F

from kernel_lib.ops import decode_attention as decode_module
from kernel_lib.ops.decode_attention import decode_attention, decode_attention_ref
from kernel_lib.validate import check

HAS_CUDA = torch.cuda.is_available()
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}  # allowance on top of 2x PyTorch's error


def torch_decode(q, k, v, lengths, scale):
    """PyTorch's own attention in q's precision over each sequence's used cache (SDPA, explicit mask, GQA repeat)."""
    n, L = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    positions = lengths[:, None] - n + torch.arange(n, device=q.device)
    mask = (torch.arange(L, device=q.device) <= positions[:, :, None])[:, None]  # (B, 1, n, L)
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask, scale=scale
    )
    return out.nan_to_num(0.0)


def check_case(B, Hq, Hkv, n, L, D, Dv, lengths, dtype, device, as_tensor=True):
    q = torch.randn(B, Hq, n, D, device=device).to(dtype)
    k = torch.randn(B, Hkv, L, D, device=device).to(dtype)
    v = torch.randn(B, Hkv, L, Dv, device=device).to(dtype)
    lengths = torch.tensor(lengths, device=device, dtype=torch.int32).expand(B)
    kv_len = lengths if as_tensor else int(lengths[0])
    with torch.no_grad():
        out = decode_attention(q, k, v, kv_len)
        want = decode_attention_ref(q.double(), k.double(), v.double(), lengths)
        base = torch_decode(q, k, v, lengths, D**-0.5)
    report = check(out, want, base, name="out", atol=ATOL[dtype])
    assert report.ok, report


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "B, Hq, Hkv, n, L, D, Dv, lengths",
    [
        (1, 4, 1, 1, 200, 64, 64, [77]),  # MQA, one token, a length inside a split
        (2, 4, 2, 1, 130, 32, 32, [130, 5]),  # GQA, one full cache and one nearly empty
        (2, 2, 2, 3, 96, 40, 24, [50, 96]),  # three queries a step (speculative); D, Dv apart and padded
        (1, 8, 2, 4, 64, 16, 16, [3]),  # fewer keys than queries: the first query sees nothing (0)
        (3, 2, 1, 1, 40, 32, 32, [0]),  # no keys at all: zeros
        (1, 2, 1, 1, 0, 32, 32, [0]),  # a cache of no positions
    ],
    ids=str,
)
def test_against_float64(device, B, Hq, Hkv, n, L, D, Dv, lengths, dtype):
    check_case(B, Hq, Hkv, n, L, D, Dv, lengths * B if len(lengths) == 1 else lengths, dtype, device)


def test_int_length_and_many_splits(device, monkeypatch):
    """An int kv_len; and the combine over many chunks (the split count forced up as on a GPU with many SMs)."""
    monkeypatch.setattr(decode_module, "_splits", lambda B, Hkv, L, block_n, dev: (L // 16, 16))
    check_case(1, 2, 1, 1, 160, 32, 32, [150], torch.float32, device, as_tensor=False)


def test_lengths_are_not_read_on_the_host(device, monkeypatch):
    """A tensor kv_len goes to the kernels as it is: no .item() / .tolist() (a CUDA graph could not capture one)."""

    def refuse(*args, **kwargs):
        raise AssertionError("kv_len was read on the host")

    q, k, v = torch.randn(1, 2, 1, 16, device=device), torch.randn(1, 2, 32, 16, device=device), None
    v = torch.randn(1, 2, 32, 16, device=device)
    lengths = torch.tensor([20], device=device, dtype=torch.int32)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    with torch.no_grad():
        out = decode_attention(q, k, v, lengths)
    monkeypatch.undo()
    torch.testing.assert_close(out, decode_attention_ref(q, k, v, lengths), atol=1e-5, rtol=1e-5)


def test_compiles_without_graph_break(device):
    q, k, v = torch.randn(1, 4, 1, 16, device=device), torch.randn(1, 2, 48, 16, device=device), None
    v = torch.randn(1, 2, 48, 16, device=device)
    lengths = torch.tensor([30], device=device, dtype=torch.int32)
    with torch.no_grad():
        out = torch.compile(lambda *a: decode_attention(*a) * 2, fullgraph=True)(q, k, v, lengths)
    torch.testing.assert_close(out, 2 * decode_attention_ref(q, k, v, lengths), atol=1e-5, rtol=1e-5)


def test_opcheck(device):
    q, k, v = torch.randn(1, 2, 1, 16, device=device), torch.randn(1, 1, 32, 16, device=device), None
    v = torch.randn(1, 1, 32, 16, device=device)
    args = (q, k, v, torch.tensor([9], device=device, dtype=torch.int32), 0.25)
    torch.library.opcheck(torch.ops.kernel_lib.decode_attention.default, args)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(q=torch.randn(1, 3, 1, 16)), ValueError, "not a multiple"),
        (dict(k=torch.randn(1, 2, 32, 8)), ValueError, "must match q"),
        (dict(kv_len=33), ValueError, "outside"),
        (dict(kv_len=torch.tensor([1.0])), ValueError, "int tensor"),
        (dict(q=torch.randn(1, 4, 100, 16)), ValueError, "more than 128"),
        (dict(q=torch.randn(1, 2, 1, 16, requires_grad=True)), ValueError, "no_grad"),
        (dict(v=torch.randn(1, 2, 32, 16).half()), TypeError, "one dtype"),
    ],
    ids=["heads", "shapes", "length", "length dtype", "rows", "autograd", "dtype"],
)
def test_bad_input_is_named(change, error, words):
    args = dict(q=torch.randn(1, 2, 1, 16), k=torch.randn(1, 2, 32, 16), v=torch.randn(1, 2, 32, 16), kv_len=10)
    args.update(change)
    with pytest.raises(error, match=words):
        decode_attention(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "B, Hq, Hkv, n, L, D, lengths",
    [
        (1, 32, 8, 1, 32768, 128, [32768]),  # the 1.1B/7B GQA shape at a 32k context
        (4, 32, 8, 1, 8192, 128, [8192, 1, 4000, 8191]),  # ragged batch
        (2, 16, 16, 4, 4096, 64, [4096, 3000]),  # MHA, four queries a step
        (1, 8, 1, 1, 20000, 256, [19999]),  # MQA, head dim 256
    ],
    ids=str,
)
def test_large_on_gpu(B, Hq, Hkv, n, L, D, lengths, dtype):
    check_case(B, Hq, Hkv, n, L, D, D, lengths, dtype, "cuda")
