"""Attention variants from a mask function (kernel_lib/ops/attention_variants.py): the block mask against the mask
element by element, the forward and its (recomputed) backward against the float64 definition for each named
pattern and for a mask function written here, masks per sequence, bad input named."""

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401 - Triton wants it visible where a jit function is defined

from kernel_lib.ops import attention_variants as av
from kernel_lib.ops.attention_variants import (
    PATTERNS,
    ScoreMod,
    alibi,
    compile_attention_kernel,
    create_block_mask,
    default_blocks,
    dense_mask,
    flex_attention,
    flex_attention_ref,
    relative_bias,
    softcap,
)


def torch_mask(pattern: str, N: int, M: int, device, **params) -> torch.Tensor:
    """The pattern's (B', 1, N, M) mask written in PyTorch: what the Triton mask functions must equal."""
    i = torch.arange(N, device=device)[:, None]
    j = torch.arange(M, device=device)[None, :]
    if pattern == "causal":
        return (j <= i + (M - N))[None, None]
    if pattern == "sliding_window":
        pos = i + (M - N)
        return ((j <= pos) & (j > pos - params["window_size"]))[None, None]
    if pattern == "document":
        ids = params["document_ids"]
        return ((j <= i)[None] & (ids[:, :, None] == ids[:, None, :]))[:, None]
    if pattern == "prefix_lm":
        return ((j <= i) | (j < params["prefix_length"]))[None, None]
    raise AssertionError(pattern)


def _params(pattern: str, B: int, N: int, device) -> dict:
    if pattern == "sliding_window":
        return {"window_size": 37}
    if pattern == "document":  # documents of 1 to 40 tokens; each sequence its own split
        gen = torch.Generator().manual_seed(N)
        ids = torch.cumsum(torch.rand(B, N, generator=gen) < 0.08, dim=1).to(torch.int32)
        return {"document_ids": ids.to(device)}
    if pattern == "prefix_lm":
        return {"prefix_length": 45}
    return {}


CASES = [  # (pattern, B, Hq, Hkv, N, M): ragged blocks everywhere (the interpreter's blocks are 32 x 32)
    ("causal", 2, 4, 2, 100, 100),  # GQA
    ("causal", 1, 2, 1, 70, 130),  # M > N: bottom-right
    ("causal", 1, 2, 2, 130, 70),  # N > M: queries that see no key
    ("sliding_window", 1, 3, 3, 150, 150),  # empty blocks skipped on both sides
    ("document", 2, 2, 1, 120, 120),  # a mask per sequence, from a captured tensor
    ("prefix_lm", 1, 2, 2, 99, 99),
]


@pytest.mark.parametrize("pattern, B, Hq, Hkv, N, M", CASES, ids=lambda c: str(c))
def test_block_mask_lists_what_the_mask_sees(device, pattern, B, Hq, Hkv, N, M):
    params = _params(pattern, B, N, device)
    mask_mod, captures = PATTERNS[pattern](N, M, **params)
    bm = create_block_mask(mask_mod, B if pattern == "document" else None, None, N, M, captures, device=device)
    want = torch_mask(pattern, N, M, device, **params)
    assert torch.equal(dense_mask(bm), want)
    # each query block visits exactly the key blocks where it sees something; full blocks are seen entirely
    blocks = torch.nn.functional.pad(want, (0, -M % bm.block_n, 0, -N % bm.block_m))
    blocks = blocks.reshape(*want.shape[:2], -1, bm.block_m, blocks.shape[-1] // bm.block_n, bm.block_n)
    any_seen = blocks.any(dim=(3, 5))
    for b in range(want.shape[0]):
        for qb in range(any_seen.shape[2]):
            part = set(bm.part_idx[b, 0, qb, : bm.part_num[b, 0, qb]].tolist())
            full = set(bm.full_idx[b, 0, qb, : bm.full_num[b, 0, qb]].tolist())
            assert not part & full
            assert part | full == set(torch.nonzero(any_seen[b, 0, qb]).flatten().tolist())
            for kb in full:
                rows = slice(qb * bm.block_m, min(N, (qb + 1) * bm.block_m))
                cols = slice(kb * bm.block_n, (kb + 1) * bm.block_n)
                assert cols.stop <= M and want[b, 0, rows, cols].all()


def _check(out, want, atol):
    torch.testing.assert_close(out.double(), want.double(), atol=atol, rtol=0)


@pytest.mark.parametrize("pattern, B, Hq, Hkv, N, M", CASES, ids=lambda c: str(c))
def test_forward_backward_against_float64(device, pattern, B, Hq, Hkv, N, M):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    atol = 2e-2 if device == "cpu" else 3e-2  # the interpreter truncates to bf16 in the dots: see the guide
    params = _params(pattern, B, N, device)
    attend = compile_attention_kernel(pattern, **params)
    q = torch.randn(B, Hq, N, 40, device=device, dtype=dtype, requires_grad=True)  # head dim 40: padded to 64
    k = torch.randn(B, Hkv, M, 40, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, M, 24, device=device, dtype=dtype, requires_grad=True)  # Dv != D
    out, lse = attend(q, k, v, return_lse=True)
    mask = torch_mask(pattern, N, M, device, **params)
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, want_lse = flex_attention_ref(*inputs64, mask, return_lse=True)
    _check(out, want, atol)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen)  # -inf exactly where a query sees no key
    assert (out[~seen] == 0).all()
    torch.testing.assert_close(lse[seen].double(), want_lse[seen], atol=atol, rtol=0)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, inputs64, dout.double())
    for got, exact in zip(grads, want_grads, strict=True):
        _check(got, exact, atol * 2)


@triton.jit
def _dilated(b, h, q_idx, kv_idx, captures):
    """A mask function written by a user: causal, every other key, plus the first `captures[0]` keys."""
    return (kv_idx <= q_idx) & (((q_idx - kv_idx) % 2 == 0) | (kv_idx < captures[0]))


def test_a_mask_function_of_one_s_own(device):
    N = 90
    bm = create_block_mask(_dilated, None, None, N, N, (5,), device=device)
    i, j = torch.arange(N, device=device)[:, None], torch.arange(N, device=device)[None, :]
    want_mask = (j <= i) & (((i - j) % 2 == 0) | (j < 5))
    assert torch.equal(dense_mask(bm)[0, 0], want_mask)
    q = torch.randn(1, 2, N, 32, device=device, dtype=torch.float32 if device == "cpu" else torch.float16)
    _check(flex_attention(q, q, q, bm), flex_attention_ref(q.double(), q.double(), q.double(), want_mask), 2e-2)


def test_sliding_window_skips_the_blocks_outside(device):
    # 16 query blocks at the device's tile: the band's blocks shrink with the length, the triangle's do not
    N = 16 * default_blocks(device)[0]
    mask_mod, captures = PATTERNS["sliding_window"](N, N, window_size=32)
    band = create_block_mask(mask_mod, None, None, N, N, captures, device=device)
    assert band.density() < 0.2  # a band of blocks along the diagonal, not the whole lower triangle
    mask_mod, captures = PATTERNS["causal"](N, N)
    assert create_block_mask(mask_mod, None, None, N, N, captures, device=device).density() > 0.5


def test_bad_input_is_named(device):
    q = torch.randn(1, 2, 16, 16, device=device)
    bm = create_block_mask(av.causal_mask, None, None, 16, 16, (0,), device=device)
    with pytest.raises(TypeError, match="mask_mod must be a @triton.jit"):
        create_block_mask(lambda b, h, i, j, c: i >= j, None, None, 16, 16)
    with pytest.raises(TypeError, match="captures must be a tuple"):
        create_block_mask(av.causal_mask, None, None, 16, 16, [0])
    with pytest.raises(ValueError, match="made for"):
        flex_attention(torch.randn(1, 2, 20, 16, device=device), q, q, bm)
    with pytest.raises(TypeError, match="one dtype"):
        flex_attention(q, q.half(), q, bm)
    with pytest.raises(ValueError, match="pattern must be one of"):
        compile_attention_kernel("dilated")
    with pytest.raises(ValueError, match="window_size"):
        compile_attention_kernel("sliding_window", window_size=0)(q, q, q)
    with pytest.raises(ValueError, match="document masking needs"):
        compile_attention_kernel("document", document_ids=torch.zeros(1, 8, dtype=torch.int32))(q, q, q)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_model_sized_on_gpu_within_twice_pytorch_s_error(pattern):
    B, H, N, D = 2, 8, 2048, 128
    params = _params(pattern, B, N, "cuda")
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    mask = torch_mask(pattern, N, N, "cuda", **params)
    out = compile_attention_kernel(pattern, **params)(q, k, v)
    lowp = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # PyTorch's own rounding
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = flex_attention_ref(*inputs64, mask)
    for ours, theirs, want in zip(
        (out, *torch.autograd.grad(out, (q, k, v), dout)),
        (lowp, *torch.autograd.grad(lowp, (q, k, v), dout)),
        (exact, *torch.autograd.grad(exact, inputs64, dout.double())),
        strict=True,
    ):
        allowed = 2 * (theirs.double() - want).nan_to_num().abs().max().item() + 1e-2
        assert (ours.double() - want).abs().max().item() <= allowed


@triton.jit
def _window_per_head(b, h, q_idx, kv_idx, captures):
    """Causal, head h seeing the last captures[0] * (h + 1) keys: a mask that differs by head."""
    return (kv_idx <= q_idx) & (kv_idx > q_idx - captures[0] * (h + 1))


def test_a_mask_per_head_with_grouped_heads_and_the_lse_gradient(device):
    B, Hq, Hkv, N = 2, 4, 2, 75
    bm = create_block_mask(_window_per_head, None, Hq, N, N, (9,), device=device)
    assert bm.part_num.shape[:2] == (1, Hq)
    i, j = torch.arange(N, device=device)[:, None], torch.arange(N, device=device)[None, :]
    mask = torch.stack([(j <= i) & (j > i - 9 * (h + 1)) for h in range(Hq)])[None]
    assert torch.equal(dense_mask(bm), mask)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(B, Hq, N, 32, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, Hkv, N, 32, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    out, lse = flex_attention(q, k, v, bm, return_lse=True)
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, want_lse = flex_attention_ref(*inputs64, mask, return_lse=True)
    _check(out, want, 2e-2)
    loss = (out.float() ** 2).sum() + lse.sum()  # gradients through the output and the log-sum-exp
    want_loss = (want**2).sum() + want_lse.sum()
    for got, exact in zip(torch.autograd.grad(loss, (q, k, v)), torch.autograd.grad(want_loss, inputs64), strict=True):
        torch.testing.assert_close(got.double(), exact, atol=0.05 * exact.abs().max().item(), rtol=0)


def test_under_torch_compile_it_runs_as_a_graph_break(device):
    attend = compile_attention_kernel("causal")
    q = torch.randn(1, 2, 40, 16, device=device, dtype=torch.float32 if device == "cpu" else torch.float16)
    compiled = torch.compile(lambda q: attend(q, q, q) * 2)
    torch.testing.assert_close(compiled(q), attend(q, q, q) * 2)


# --------------------------------------------------------------------------------------------------
# Score modifiers
# --------------------------------------------------------------------------------------------------
def _slopes(H: int, device) -> torch.Tensor:
    return 2.0 ** (-8.0 * torch.arange(1, H + 1, device=device) / H)  # ALiBi's geometric slopes


SCORE_CASES = [  # (modifier, pattern, B, Hq, Hkv, N, M)
    ("softcap", "causal", 2, 4, 2, 100, 100),  # a cap of 0.5: most scores bent, so the slope 1 - tanh^2 matters
    ("softcap", "sliding_window", 1, 2, 2, 90, 90),  # partial and full blocks both modified
    ("alibi", "causal", 1, 4, 2, 70, 130),  # a bias by query head under GQA; M > N (queries at the end)
    ("alibi", "document", 2, 2, 1, 120, 120),  # a captured tensor in the mask and in the modifier at once
]


@pytest.mark.parametrize("name, pattern, B, Hq, Hkv, N, M", SCORE_CASES, ids=lambda c: str(c))
def test_score_mods_against_float64(device, name, pattern, B, Hq, Hkv, N, M):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    atol = 2e-2 if device == "cpu" else 3e-2
    mod = softcap(0.5) if name == "softcap" else alibi(_slopes(Hq, device))
    params = _params(pattern, B, N, device)
    attend = compile_attention_kernel(pattern, score_mod=mod, **params)
    q = torch.randn(B, Hq, N, 32, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, Hkv, M, 32, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    out, lse = attend(q, k, v, return_lse=True)
    mask = torch_mask(pattern, N, M, device, **params)
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, want_lse = flex_attention_ref(*inputs64, mask, return_lse=True, score_mod=mod)
    plain = flex_attention_ref(*inputs64, mask)
    assert (want - plain).abs().max() > 0.1  # the modifier changes the answer, so the check below can fail
    _check(out, want, atol)
    seen = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[seen].double(), want_lse[seen], atol=atol, rtol=0)
    loss, want_loss = (out.float() * out.float()).sum() + lse.sum(), (want * want).sum() + want_lse.sum()
    for got, exact in zip(torch.autograd.grad(loss, (q, k, v)), torch.autograd.grad(want_loss, inputs64), strict=True):
        torch.testing.assert_close(got.double(), exact, atol=0.03 * exact.abs().max().item(), rtol=0)


@triton.jit
def _temperature(score, b, h, q_idx, kv_idx, captures):
    """A user's modifier: scores divided by a temperature per head (captures: (temperatures (H,),)), slope 1/t."""
    t = tl.load(captures[0] + h)
    return score / t, 1.0 / t


def test_a_score_mod_of_one_s_own_and_its_reference(device):
    B, H, N = 1, 3, 64
    temps = torch.tensor([0.5, 1.0, 2.0], device=device)
    mod = ScoreMod(_temperature, (temps,), lambda s, b, h, i, j: s / temps.to(s)[h])
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v = (torch.randn(B, H, N, 16, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    attend = compile_attention_kernel("causal", score_mod=mod)
    out = attend(q, k, v)
    # a temperature t is a scale of 1 / (t sqrt(D)): the plain kernel with that scale, head by head
    for h in range(H):
        plain = compile_attention_kernel("causal")(q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1],
                                                   scale=1 / (temps[h].item() * 4.0))  # fmt: skip
        _check(out[:, h : h + 1], plain, 2e-3)
    dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = flex_attention_ref(*inputs64, torch_mask("causal", N, N, device), score_mod=mod)
    for got, exact in zip((dq, dk, dv), torch.autograd.grad(want.sum(), inputs64), strict=True):
        _check(got, exact, 2e-2)


def test_named_scored_patterns_are_causal_with_their_modifier(device):
    """'softcap' and 'alibi' as patterns: the causal mask with the modifier, ALiBi's slopes made for the heads."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v = (torch.randn(1, 4, 50, 16, device=device, dtype=dtype) for _ in range(3))
    pairs = [
        (compile_attention_kernel("softcap", cap=2.0), compile_attention_kernel("causal", score_mod=softcap(2.0))),
        (compile_attention_kernel("alibi"), compile_attention_kernel("causal", score_mod=alibi(_slopes(4, device)))),
    ]
    for named, spelled in pairs:
        torch.testing.assert_close(named(q, k, v), spelled(q, k, v), atol=0, rtol=0)
    with pytest.raises(ValueError, match="its own score modifier"):
        compile_attention_kernel("softcap", score_mod=softcap(2.0))
    with pytest.raises(TypeError, match="takes slopes"):
        compile_attention_kernel("alibi", cap=3.0)


def test_bad_score_mods_are_named(device):
    q = torch.randn(1, 2, 16, 16, device=device)
    bm = create_block_mask(av.causal_mask, None, None, 16, 16, (0,), device=device)
    with pytest.raises(TypeError, match="score_mod must be a ScoreMod"):
        flex_attention(q, q, q, bm, score_mod=lambda s: s)
    with pytest.raises(TypeError, match="fn must be a @triton.jit"):
        flex_attention(q, q, q, bm, score_mod=ScoreMod(lambda s: s))
    with pytest.raises(ValueError, match="cap must be positive"):
        softcap(0.0)
    with pytest.raises(ValueError, match="slopes must have 1 dims"):
        alibi(torch.ones(2, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["softcap", "alibi"])
def test_score_mods_model_sized_on_gpu_within_twice_pytorch_s_error(name):
    """Gemma 2's cap (50) on scores scaled to reach it, and ALiBi's slopes, at N 2048, D 128: our error at most
    twice PyTorch's own in bf16 (SDPA with the modified scores' bias where it is additive, the eager softmax
    otherwise), forward and backward."""
    B, H, N, D = 2, 8, 2048, 128
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    mod = softcap(50.0) if name == "softcap" else alibi(_slopes(H, "cuda"))
    scale = 8.0 if name == "softcap" else None  # scores of +-100 or so: the cap bends them
    mask = torch_mask("causal", N, N, "cuda")
    out = compile_attention_kernel("causal", score_mod=mod)(q, k, v, scale=scale)

    def eager(q, k, v):  # PyTorch's own rounding: bf16 products, the modifier and softmax in float32
        s = (q @ k.transpose(-1, -2)).float() * (scale or D**-0.5)
        i, j = torch.arange(N, device="cuda")[:, None], torch.arange(N, device="cuda")[None, :]
        s = mod.reference(s, 0, torch.arange(H, device="cuda")[:, None, None], i, j).masked_fill(~mask, -torch.inf)
        return torch.softmax(s, -1).to(v.dtype) @ v

    lowp = eager(q, k, v)
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = flex_attention_ref(*inputs64, mask, scale=scale, score_mod=mod)
    for ours, theirs, want in zip(
        (out, *torch.autograd.grad(out, (q, k, v), dout)),
        (lowp, *torch.autograd.grad(lowp, (q, k, v), dout)),
        (exact, *torch.autograd.grad(exact, inputs64, dout.double())),
        strict=True,
    ):
        allowed = 2 * (theirs.double() - want).abs().max().item() + 1e-2
        assert (ours.double() - want).abs().max().item() <= allowed


# --------------------------------------------------------------------------------------------------
# Attention sinks
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pattern, N, M, mod",
    [
        ("causal", 70, 50, None),  # N > M: 20 queries see no key, only the sink: out 0, lse the sink
        ("sliding_window", 90, 90, None),  # gpt-oss: sinks with a sliding window
        ("causal", 64, 64, "softcap"),  # a sink and a score modifier together
    ],
    ids=str,
)
def test_sinks_against_float64(device, pattern, N, M, mod):
    B, Hq, Hkv = 2, 4, 2
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    params = _params(pattern, B, N, device)
    score_mod = softcap(0.5) if mod else None
    attend = compile_attention_kernel(pattern, score_mod=score_mod, **params)
    q = torch.randn(B, Hq, N, 32, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, Hkv, M, 32, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    sinks = (torch.randn(Hq, device=device) * 2).requires_grad_()  # logits from -4 to 4: from no effect to most
    out, lse = attend(q, k, v, return_lse=True, sinks=sinks)
    mask = torch_mask(pattern, N, M, device, **params)
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    want, want_lse = flex_attention_ref(*inputs64[:3], mask, return_lse=True, score_mod=score_mod, sinks=inputs64[3])
    _check(out, want, 2e-2 if device == "cpu" else 3e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-2, rtol=0)  # finite everywhere: the sink is seen
    if N > M:
        assert (out[:, :, : N - M] == 0).all()
    dout = torch.randn_like(out)
    loss, want_loss = (out * dout).float().sum() + lse.sum(), (want * dout.double()).sum() + want_lse.sum()
    grads = torch.autograd.grad(loss, (q, k, v, sinks))
    for got, exact in zip(grads, torch.autograd.grad(want_loss, inputs64), strict=True):
        torch.testing.assert_close(got.double(), exact, atol=0.03 * exact.abs().max().item(), rtol=0)


def test_bad_sinks_are_named(device):
    q = torch.randn(1, 2, 16, 16, device=device)
    bm = create_block_mask(av.causal_mask, None, None, 16, 16, (0,), device=device)
    with pytest.raises(ValueError, match=r"one logit per query head \(2,\)"):
        flex_attention(q, q, q, bm, sinks=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="sinks must have 1 dims"):
        flex_attention(q, q, q, bm, sinks=torch.zeros(1, 2, device=device))


# --------------------------------------------------------------------------------------------------
# Gradients into captured tensors: a learned relative-position bias
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pattern, Hq, Hkv, N, M, R",
    [
        ("causal", 4, 2, 100, 100, 6),  # GQA; distances past 6 clamp: the two end buckets collect many pairs
        ("sliding_window", 2, 2, 90, 90, 40),  # R beyond the window: the buckets past it get no gradient
        ("causal", 2, 1, 50, 80, 3),  # M > N
    ],
    ids=str,
)
def test_relative_bias_and_its_table_gradient_against_float64(device, pattern, Hq, Hkv, N, M, R):
    B = 2
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    params = _params(pattern, B, N, device)
    table = torch.randn(Hq, 2 * R + 1, device=device, requires_grad=True)
    attend = compile_attention_kernel(pattern, score_mod=relative_bias(table), **params)
    q = torch.randn(B, Hq, N, 32, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, Hkv, M, 32, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    out, lse = attend(q, k, v, return_lse=True)
    mask = torch_mask(pattern, N, M, device, **params)
    inputs64 = [t.detach().double().requires_grad_() for t in (q, k, v, table)]
    want, want_lse = flex_attention_ref(*inputs64[:3], mask, return_lse=True, score_mod=relative_bias(inputs64[3]))
    _check(out, want, 2e-2 if device == "cpu" else 3e-2)
    dout = torch.randn_like(out)
    loss, want_loss = (out * dout).float().sum() + lse.sum(), (want * dout.double()).sum() + want_lse.sum()
    grads = torch.autograd.grad(loss, (q, k, v, table))
    want_grads = torch.autograd.grad(want_loss, inputs64)
    assert want_grads[3].abs().max() > 1  # the table's gradient is not trivially zero
    for got, exact in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got.double(), exact, atol=0.03 * exact.abs().max().item(), rtol=0)


def test_a_learned_capture_needs_a_grad_fn(device):
    q = torch.randn(1, 2, 16, 16, device=device)
    bm = create_block_mask(av.causal_mask, None, None, 16, 16, (0,), device=device)
    temps = torch.ones(2, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="has no grad_fn"):
        flex_attention(q, q, q, bm, score_mod=ScoreMod(_temperature, (temps,)))
    frozen = ScoreMod(_temperature, (temps.detach(),))  # detached: no gradient asked, none refused
    assert flex_attention(q, q, q, bm, score_mod=frozen).shape == q.shape
    with pytest.raises(ValueError, match="contiguous"):
        relative_bias(torch.zeros(5, 2, device=device).t())
