"""FlashAttention's own output test grid (its ``tests/test_flash_attn.py::test_flash_attn_output``) run against
kernel_lib.attention on the GPU: every head dim it runs, its sequence-length pairs, MHA, MQA and GQA, fp16 and
bf16, no mask, causal and a causal window, with its rule (error at most 2x PyTorch's own low-precision error) on
out, dq, dk and dv. A slice of it runs on the CPU under the interpreter.

One test per (head dim, dtype, mask) loops over half the length pairs, so the kernels it compiles (N and M are not
specialized on) serve them all; the layouts cycle with the pairs. Which half, and which dtype, alternate so that
every pair of factors meets (see over_the_grid).
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from kernel_lib.ops.attention import _visible, attention_ref, flash_attention
from tests._checks import check_forward_backward

SEQLEN_PAIRS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024), (1023, 1024),
                (1024, 1023), (2048, 2048)]  # fmt: skip
HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
LAYOUTS = [(4, 4), (4, 1), (4, 2)]  # (query heads, key/value heads): MHA, MQA, GQA
MASKS = {"none": (False, None), "causal": (True, None), "window": (True, 77)}
HAS_CUDA = torch.cuda.is_available()
ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}  # allowance on top of 2x PyTorch's own error


def torch_attention(q, k, v, causal, window):
    """PyTorch's own attention in q's precision: SDPA with the explicit mask, heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    mask = _visible(q.shape[2], k.shape[2], causal, window, q.device)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5)


def check_case(B, Hq, Hkv, N, M, D, Dv, causal, window, dtype, device):
    q = torch.randn(B, Hq, N, D, device=device).to(dtype)
    k = torch.randn(B, Hkv, M, D, device=device).to(dtype)
    v = torch.randn(B, Hkv, M, Dv, device=device).to(dtype)
    kernel = functools.partial(flash_attention, causal=causal, window=window)
    reference = functools.partial(attention_ref, causal=causal, window=window)
    sees_nothing = not _visible(N, M, causal, window, device).any(dim=1).all()
    # SDPA gives NaN for a query that sees no key (we define 0); there the baseline is the fp32 reference.
    baseline = reference if sees_nothing else functools.partial(torch_attention, causal=causal, window=window)
    check_forward_backward(kernel, reference, [q, k, v], atol=ATOL[dtype], baseline=baseline, name=f"out {N}x{M}")


def over_the_grid(pairs: list, turn: int = 0):
    """The grid's parametrization, for the fixed-length and the packed tests alike: every head dim with every mask,
    in fp16 or bf16 by turns, and half of the length ``pairs`` by turns (even or odd places), so that each head
    dim, mask, dtype and half meets each other one: every head dim runs every pair and both dtypes, and ``turn`` 0
    and 1 (the fixed-length and the packed grid) together run every (head dim, dtype, mask). The test gets its
    (N, M) pairs as ``pairs``. Kernels compile per (head dim, dtype, mask) and per stride alignment: the halvings
    keep ``make test-gpu`` near its 15 minutes (the whole grid took an hour of one worker). GPU only."""
    dtypes = [(torch.float16, "fp16"), (torch.bfloat16, "bf16")]
    cases = []
    for i, D in enumerate(HEAD_DIMS):
        for j, mask in enumerate(MASKS):
            dtype, name = dtypes[(i + j + turn) % 2]
            half = (i // 2 + j) % 2
            cases.append(pytest.param(D, dtype, mask, pairs[half::2], id=f"{mask}-{name}-{D}-{'eo'[half]}"))

    def wrap(test):
        return pytest.mark.gpu(pytest.mark.parametrize("D, dtype, mask, pairs", cases)(test))

    return wrap


@over_the_grid(SEQLEN_PAIRS)
def test_flash_attention_grid(D, dtype, mask, pairs):
    causal, window = MASKS[mask]
    for i, (N, M) in enumerate(pairs):
        Hq, Hkv = LAYOUTS[i % len(LAYOUTS)]
        check_case(1, Hq, Hkv, N, M, D, D, causal, window, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("D, Dv", [(192, 128), (128, 64), (96, 160)])  # DeepSeek's MLA; v narrower; v wider
def test_value_head_dim_apart_from_the_query_s(D, Dv, mask):
    causal, window = MASKS[mask]
    for i, (N, M) in enumerate(SEQLEN_PAIRS[::3]):
        Hq, Hkv = LAYOUTS[i % len(LAYOUTS)]
        check_case(1, Hq, Hkv, N, M, D, Dv, causal, window, torch.bfloat16, "cuda")


@pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the whole grid above")
@pytest.mark.parametrize("D, Dv", [(40, 40), (80, 80), (24, 56)])  # padded to 64 / 128; v wider than q, k
@pytest.mark.parametrize("mask", MASKS)
def test_grid_slice_interpreted(D, Dv, mask):
    causal, window = MASKS[mask]
    check_case(1, 2, 1, 113, 203 if mask == "none" else 71, D, Dv, causal, window, torch.float16, "cpu")
