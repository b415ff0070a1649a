"""Decoding with the static KV cache (GPT.init_cache / forward_step), kernel_lib.models.generate (greedy,
GraphedDecoder, to_hf_llama), and bad input.

The cache path is held to the uncached forward: prefill logits, decode logits at every position, greedy tokens.
Tolerances: in float32 the two paths add the same numbers in a different order (masked SDPA over the cache
against causal attention over the sequence), about 1e-7 on logits of size ~1; the float64 comparison allows
1e-5. In bfloat16 the kernel_lib version (flash_attention over the cache) is held to the rule of the kernel tests
against a float64 run: at most twice the error of the native version in bfloat16, plus 1e-3.

DECODE_BUCKET is set to 16 in the tests that run the tensor-position (CUDA graph) step, so that a generation of
a few tokens crosses bucket boundaries (kv_len 16, 32, 48) without the interpreter running 64-token buckets."""

import pytest
import torch

from kernel_lib.models import GPT, GPTConfig, GraphedDecoder, greedy, kv_bucket, to_hf_llama, transfer_weights
from kernel_lib.models import gpt as gpt_module
from kernel_lib.models.gpt import IMPLS, flash_over_cache
from kernel_lib.ops.attention import attention_ref
from kernel_lib.validate import check, report

# head dim 16; rope_base and norm_eps off their defaults, so a conversion that drops them fails
TINY = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=96, rope_base=500.0, norm_eps=1e-5)
ONE_LAYER = dict(TINY, n_layers=1)  # for the interpreted bfloat16 kernel_lib runs: half the kernel launches
MOE = dict(TINY, n_experts=4, top_k=2, d_ff=64)
GQA = dict(TINY, n_kv_heads=2)  # two query heads per key/value head: the cache holds 2 heads, not 4
T0 = 8  # prompt length


def _model(impl, dtype=torch.float32, **sizes) -> GPT:
    return GPT(GPTConfig(**(sizes or TINY), impl=impl), dtype=dtype)


def _prompt(config, batch=2, length=T0):
    return torch.randint(0, config.vocab_size, (batch, length))


def _teacher_forced(model, seq, pos_kind):
    """Logits (B, T, V) of seq from a prefill of T0 tokens and then one forward_step per token, positions as
    Python ints (eager) or as a tensor with kv_len = kv_bucket (the graph's step)."""
    B, T = seq.shape
    cache = model.init_cache(B, T)
    out = [model.forward_step(seq[:, :T0], cache, 0)]
    pos = torch.zeros(1, dtype=torch.int64)
    for p in range(T0, T):
        if pos_kind == "int":
            out.append(model.forward_step(seq[:, p : p + 1], cache, p))
        else:
            pos.fill_(p)
            out.append(model.forward_step(seq[:, p : p + 1], cache, pos, kv_bucket(p + 1, T)))
    return torch.cat(out, dim=1)


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(gpt_module, "DECODE_BUCKET", 16)


@pytest.mark.parametrize(
    "impl, sizes",
    [
        pytest.param("naive", TINY, id="naive"),
        pytest.param("native", TINY, id="native"),
        pytest.param("kernel_lib", TINY, id="kernel_lib"),
        pytest.param("native", MOE, id="native-moe"),  # experts route each token alone: the same as in forward
        pytest.param("native", GQA, id="native-gqa"),  # a chunk attends with a mask: SDPA on repeated k, v
        pytest.param("kernel_lib", GQA, id="kernel_lib-gqa"),
    ],
)
def test_prefill_and_chunked_prefill_equal_forward(impl, sizes):
    model = _model(impl, **sizes)
    idx = _prompt(model.config, length=20)
    want = model(idx)
    cache = model.init_cache(2, 32)
    torch.testing.assert_close(model.forward_step(idx, cache, 0), want, atol=1e-5, rtol=1e-5)
    cache = model.init_cache(2, 32)
    first = model.forward_step(idx[:, :7], cache, 0)
    rest = model.forward_step(idx[:, 7:], cache, 7)  # 13 queries at positions 7..19: the chunk's causal mask
    torch.testing.assert_close(torch.cat([first, rest], dim=1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sizes", [pytest.param(TINY, id="mha"), pytest.param(GQA, id="gqa")])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pos_kind", ["int", "tensor"])
def test_decode_logits_equal_forward_at_every_position(small_buckets, impl, pos_kind, sizes):
    if impl == "naive" and sizes is GQA:
        pytest.skip("the naive model has no grouped-query attention (GPTConfig refuses it)")
    model = _model(impl, **sizes)
    assert model.init_cache(1, 8).k[0].shape == (1, model.config.n_kv_heads, 8, model.config.head_dim)
    seq = _prompt(model.config, length=40)  # decode at positions 8..39: kv_len 16, 32, 40 with tensor positions
    torch.testing.assert_close(_teacher_forced(model, seq, pos_kind), model(seq), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_cached_greedy_is_token_identical_to_uncached(impl):
    model = _model(impl)
    prompt = _prompt(model.config)
    cached = greedy(model, prompt, 16)
    assert cached.shape == (2, T0 + 16) and torch.equal(cached[:, :T0], prompt)
    assert torch.equal(cached, greedy(model, prompt, 16, use_cache=False))
    assert len(set(cached[:, T0:].flatten().tolist())) >= 5  # not one token repeated: the test could fail


@pytest.mark.parametrize(
    "impl, dtype, pos_kind",
    [
        ("naive", torch.float32, "int"),
        ("native", torch.float32, "int"),
        ("native", torch.float32, "tensor"),
        ("kernel_lib", torch.bfloat16, "int"),  # flash_attention over exactly pos + 1 keys
        ("kernel_lib", torch.bfloat16, "tensor"),  # flash_attention over a bucket, queries in a block
    ],
    ids=str,
)
def test_decode_logits_against_float64(small_buckets, impl, dtype, pos_kind):
    sizes = ONE_LAYER if dtype == torch.bfloat16 else TINY
    model = _model(impl, dtype, **sizes)
    ref = _model("native", torch.float64, **sizes)
    transfer_weights(model, ref)  # the same (possibly bfloat16-rounded) weights, computed in float64
    seq = _prompt(model.config, length=36)
    logits = _teacher_forced(model, seq, pos_kind)
    want = ref(seq)
    steps = [T0 - 1, T0, 15, 16, 35]  # the prefill's last, the first decode, both sides of a bucket edge, the last
    if dtype == torch.float32:
        torch.testing.assert_close(logits[:, steps].double(), want[:, steps], atol=1e-5, rtol=0)
    else:
        base = _model("native", dtype, **sizes)
        transfer_weights(model, base)
        base_logits = _teacher_forced(base, seq, pos_kind)  # PyTorch's own bfloat16 error on the same steps
        result = check(logits[:, steps], want[:, steps], base_logits[:, steps], name="logits", atol=1e-3)
        assert result.ok, report([result])


@pytest.mark.parametrize(
    "M, positions",
    [
        (40, [39]),  # M < DECODE_BUCKET: the block is the whole M x M square
        (128, [64]),  # the first row of the block (pos = M - R): sees 65 keys of 128
        (128, [100]),  # 27 stale keys after it
        (128, [126, 127]),  # two queries: the second sees one key more
        (128, [127]),  # the last row: the whole cache
    ],
    ids=str,
)
def test_flash_over_cache_hides_the_stale_tail(M, positions):
    B, H, D = 1, 2, 16
    positions = torch.tensor(positions)
    q = torch.randn(B, H, len(positions), D, dtype=torch.bfloat16)
    k = torch.randn(B, H, M, D, dtype=torch.bfloat16)
    v = torch.randn(B, H, M, D, dtype=torch.bfloat16)
    stale = positions[-1] + 1
    k[:, :, stale:], v[:, :, stale:] = 30.0, 1e4  # huge scores and values: one leaked key would show
    R = min(M, gpt_module.DECODE_BUCKET)
    rows = positions - (M - R)  # each query's row in the block, as forward_step works it out
    block = q.new_zeros(B, H, R, D).index_copy_(2, rows, q)  # what rope_to_cache writes, here without rotation
    out = flash_over_cache(block, k, v, rows)
    n = int(stale)  # the reference: causal attention over the valid prefix alone
    want = attention_ref(q.double(), k[:, :, :n].double(), v[:, :, :n].double(), causal=True)
    base = attention_ref(q, k[:, :, :n], v[:, :, :n], causal=True)
    result = check(out, want, base, name="out", atol=1e-3)
    assert result.ok, report([result])


@pytest.mark.parametrize(
    "impl, dtype",
    [
        ("naive", torch.float32),
        ("native", torch.float32),
        ("kernel_lib", torch.bfloat16),  # the graph step's flash_attention block against the eager exact one
    ],
    ids=str,
)
@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
def test_graphed_decoder_on_cpu_matches_greedy(small_buckets, impl, dtype, kv_heads):
    if impl == "naive" and kv_heads:
        pytest.skip("the naive model has no grouped-query attention (GPTConfig refuses it)")
    model = _model(impl, dtype, **dict(ONE_LAYER if dtype == torch.bfloat16 else TINY, n_kv_heads=kv_heads))
    decoder = GraphedDecoder(model, batch=2, max_len=48)
    assert not decoder.uses_graphs  # a CPU: the same step, eagerly
    first = _prompt(model.config)
    assert torch.equal(decoder.generate(first, 24), greedy(model, first, 24))  # kv_len 16 then 32
    second = _prompt(model.config, length=3)  # the cache now holds the first sequence: stale, and masked
    assert torch.equal(decoder.generate(second, 8), greedy(model, second, 8))


@pytest.mark.parametrize("impl, dtype", [("native", torch.float32), ("kernel_lib", torch.bfloat16)], ids=str)
def test_graphed_decoder_step_is_a_decode_step(small_buckets, impl, dtype):
    """``step(pos)`` feeds the static token (the last one generate fed, out[:, T0 + 10]) at position pos: here
    one before the position generate last used, so that a step ignoring pos would be caught. Its logits are those
    of forward_step of that token after a prefill of the pos tokens before it."""
    model = _model(impl, dtype, **(ONE_LAYER if dtype == torch.bfloat16 else TINY))
    decoder = GraphedDecoder(model, batch=2, max_len=24)
    out = decoder.generate(_prompt(model.config), 12)  # the last step fed out[:, T0 + 10] at position T0 + 10
    pos = T0 + 5
    logits = decoder.step(pos).clone()  # the cache before pos holds out's tokens: generate wrote them
    cache = model.init_cache(2, 24)
    model.forward_step(out[:, :pos], cache, 0)
    want = model.forward_step(out[:, T0 + 10 : T0 + 11], cache, pos, kv_bucket(pos + 1, 24))
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"pos must be an int in \[0, 24\)"):
        decoder.step(24)


@pytest.mark.parametrize("sizes", [pytest.param(TINY, id="mha"), pytest.param(GQA, id="gqa")])
@pytest.mark.parametrize("impl", IMPLS)
def test_hf_llama_has_the_same_logits_and_greedy_tokens(impl, sizes):
    if impl == "naive" and sizes is GQA:
        pytest.skip("the naive model has no grouped-query attention (GPTConfig refuses it)")
    model = _model(impl, **sizes)
    hf = to_hf_llama(model)
    assert hf.config.num_key_value_heads == model.config.n_kv_heads
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.model.rotary_emb.inv_freq.dtype == torch.float32
    idx = _prompt(model.config, length=32)
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), atol=1e-4, rtol=0)
    prompt = idx[:, :T0]
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
    assert torch.equal(theirs, greedy(model, prompt, 16))


def test_hf_llama_keeps_dtype_and_refuses_experts():
    hf = to_hf_llama(_model("native", torch.bfloat16))
    assert hf.lm_head.weight.dtype == torch.bfloat16 and hf.model.rotary_emb.inv_freq.dtype == torch.float32
    with pytest.raises(ValueError, match="n_experts > 0 does not convert"):
        to_hf_llama(_model("native", **MOE))


def test_kv_bucket():
    assert [kv_bucket(e, 96) for e in (1, 64, 65, 96)] == [64, 64, 96, 96]  # capped at max_len
    assert [kv_bucket(e, 200) for e in (1, 64, 65, 128, 129)] == [64, 64, 128, 128, 192]


F32, I64 = torch.float32, torch.int64
BAD_STEPS = [  # (tokens n, their dtype, cache (batch, max_len, dtype), pos, kv_len, words)
    pytest.param(20, I64, (2, 16, F32), 0, None, "do not fit the cache", id="prompt-longer-than-cache"),
    pytest.param(1, I64, (2, 16, torch.bfloat16), 0, None, "cache is", id="cache-dtype-not-the-models"),
    pytest.param(1, I64, (3, 16, F32), 0, None, "cache is", id="cache-of-another-batch"),
    pytest.param(1, torch.int32, (2, 96, F32), 0, None, "idx must be an int64", id="int32-tokens"),
    pytest.param(1, I64, (2, 96, F32), 3.0, None, "pos must be a Python int", id="float-pos"),
    pytest.param(1, I64, (2, 96, F32), True, None, "pos must be a Python int", id="bool-pos"),  # an int subclass
    pytest.param(1, I64, (2, 96, F32), -1, None, "do not fit the cache", id="negative-pos"),
    pytest.param(1, I64, (2, 96, F32), torch.tensor([5]), None, "give kv_len", id="tensor-pos-no-kv_len"),
    pytest.param(1, I64, (2, 96, F32), torch.tensor([5], dtype=torch.int32), 64, "one int64", id="int32-pos"),
    pytest.param(1, I64, (2, 96, F32), torch.tensor([1, 2]), 64, "one int64", id="two-positions"),
    pytest.param(1, I64, (2, 96, F32), 10, 8, "shorter than the positions", id="kv_len-before-the-token"),
    pytest.param(1, I64, (2, 96, F32), 10, 97, "kv_len must be an int in", id="kv_len-past-the-cache"),
    pytest.param(1, I64, (2, 96, F32), torch.tensor([5]), 96, "DECODE_BUCKET", id="kv_len-91-past-pos"),
]


@pytest.mark.parametrize("n, dtype, cache, pos, kv_len, words", BAD_STEPS)
def test_bad_step_input_is_named(n, dtype, cache, pos, kv_len, words):
    model = _model("native")
    batch, max_len, cache_dtype = cache
    idx, kv_cache = torch.zeros(2, n, dtype=dtype), model.init_cache(batch, max_len, dtype=cache_dtype)
    with pytest.raises(ValueError, match=words):
        model.forward_step(idx, kv_cache, pos, kv_len)


def test_bad_cache_is_named():
    model = _model("native")
    with pytest.raises(ValueError, match="must be a KVCache"):
        model.forward_step(torch.zeros(1, 1, dtype=torch.int64), [torch.zeros(1, 4, 16, 16)], 0)
    with pytest.raises(ValueError, match="max_len must be an integer in"):
        model.init_cache(1, 97)  # longer than max_seq_len: no RoPE angles for it
    with pytest.raises(ValueError, match="batch must be a positive"):
        model.init_cache(0, 16)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda m, p: greedy(m, p, 89), "exceeds the 96 positions"),  # 8 + 89 > max_seq_len
        (lambda m, p: greedy(m, p.int(), 4), "prompt must be an int64"),
        (lambda m, p: greedy(m, p[:, :0], 4), "the prompt is empty"),
        (lambda m, p: greedy(m, p, -1), "max_new_tokens must be a non-negative"),
        (lambda m, p: GraphedDecoder(m, 2, 16).generate(p, 9), "exceeds the 16 positions"),  # the decoder's cache
        (lambda m, p: GraphedDecoder(m, 3, 32).generate(p, 4), "built for"),  # batch 2 into a decoder for 3
    ],
    ids=["too-long", "int32", "empty", "negative", "decoder-too-long", "decoder-batch"],
)
def test_bad_generation_input_is_named(call, words):
    model = _model("native")
    with pytest.raises(ValueError, match=words):
        call(model, _prompt(model.config))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["native", "kernel_lib"])
def test_graphed_decoder_on_gpu(impl):
    sizes = dict(vocab_size=32768, d_model=512, n_layers=4, n_heads=8, max_seq_len=256)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**sizes, impl=impl), device="cuda", dtype=torch.bfloat16)
    prompt = torch.randint(0, sizes["vocab_size"], (1, 40), device="cuda")
    decoder = GraphedDecoder(model, batch=1, max_len=256)
    assert decoder.uses_graphs
    tokens = decoder.generate(prompt, 64)  # positions 40..103: kv_len 64 then 128, two graphs
    assert len(decoder._graphs) == 2
    assert torch.equal(tokens, greedy(model, prompt, 64))  # replayed graphs, token-identical to eager
    again = decoder.generate(prompt, 64)  # replays the graphs captured by the first call
    assert torch.equal(again, tokens)
