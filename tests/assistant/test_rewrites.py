"""Each automatic rewrite keeps the numbers (float64 comparison, forward and backward) and the parameter names,
and refuses what it cannot do with a reason."""

import copy

import pytest
import torch

from kernel_lib import ops
from kernel_lib.assistant import detect, rewrites, source
from kernel_lib.assistant import trace as tracing
from kernel_lib.equivalence import ComponentValidator
from kernel_lib.models import GPT, GPTConfig
from tests._checks import saved_storages
from tests.assistant.models import (
    GatedMLP,
    LMHeadLoss,
    LossWithoutProtocol,
    ManualAttention,
    ManualLayerNorm,
    ManualRMSNorm,
    Wrap,
)


def finding(model, args, kind):
    t = tracing.record(model, args)
    found = detect.detect_all(model, t, source.model_loops(model), None, None, compiled=False)
    return next(f for f in found if f.kind == kind)


def rewritten(model, args, kind):
    f = finding(model, args, kind)
    new, _ = rewrites.apply(copy.deepcopy(model), f)
    return new


x3 = lambda d=32, t=8: (torch.randn(2, t, d),)  # noqa: E731


@pytest.mark.parametrize(
    "model, kind, new_type",
    [
        (Wrap(ManualRMSNorm(32)), "manual_norm", "RMSNorm"),
        (Wrap(ManualLayerNorm(32)), "manual_norm", "LayerNorm"),
        (Wrap(GatedMLP(32, 64)), "unfused_activation", "FusedGatedMLP"),
        (Wrap(GatedMLP(32, 64, act="tanh")), "unfused_activation", "FusedGatedMLP"),  # geglu
        (Wrap(ManualAttention(32, 4)), "manual_attention", "FusedSelfAttention"),
    ],
)
def test_module_rewrite_validates_and_keeps_names(model, kind, new_type):
    args = x3()
    new = rewritten(model, args, kind)
    assert type(new.inner).__name__ == new_type
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in model.named_parameters()]
    report = ComponentValidator().validate_model(new, model, args)
    assert report.passed, str(report)


def _saved_elements(model, x) -> int:
    """Elements of the distinct storages the backward keeps for one forward of model(x), parameters left out."""
    return sum(saved_storages(lambda: model(x), exclude=list(model.parameters()))[0].values())


@pytest.mark.skipif(not ops._utils.is_interpreting(), reason="the kernels run on the CPU only under the interpreter")
def test_fused_silu_mlp_keeps_gate_and_up_not_the_product():
    # the memory half of the rewrite: swiglu_linear recomputes act(gate) * up in the backward
    model, (x,) = Wrap(GatedMLP(32, 64)), x3()
    new = rewritten(model, (x,), "unfused_activation")
    tokens = x.numel() // 32
    assert _saved_elements(new, x) == tokens * (32 + 2 * 64)  # x, gate and up: no product, no weight copy
    assert _saved_elements(model, x) > tokens * (32 + 3 * 64)  # the original keeps the product too


def test_attention_rewrite_of_the_naive_gpt_with_rope():
    model = GPT(GPTConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, max_seq_len=16, rope_base=500.0))
    idx = torch.randint(0, 64, (2, 12))
    new = rewritten(model, (idx, idx), "manual_attention")
    attn = new.blocks[0].attn
    assert attn.rope_base == 500.0 and attn.causal is True  # read from the model, not assumed
    report = ComponentValidator().validate_model(new, model, (idx, idx))
    assert report.passed, str(report)


def test_moe_rewrite_matches_the_loop():
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, n_experts=4, top_k=2))
    idx = torch.randint(0, 64, (2, 8))
    new = rewritten(model, (idx, idx), "expert_loop")
    assert type(new.blocks[0].mlp).__name__ == "GroupedMoE"
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert ComponentValidator().validate_model(new, model, (idx, idx)).passed


def test_fused_loss_never_writes_logits():
    model = LMHeadLoss()
    idx, tgt = torch.randint(0, 5000, (2, 8)), torch.randint(0, 5000, (2, 8))
    new = rewritten(model, (idx, tgt), "unfused_cross_entropy")
    assert isinstance(new, rewrites.FusedLossLM)
    t = tracing.record(new, (idx, tgt))
    assert not any(op.module == "model.head" for op in t.ops)  # the head Linear is never called
    assert torch.equal(new(idx), model(idx))  # without targets: the model's logits, unchanged
    assert ComponentValidator().validate_model(new, model, (idx, tgt)).passed


def test_fused_loss_needs_a_way_to_the_hidden_state():
    model = LossWithoutProtocol()
    args = (torch.randint(0, 5000, (2, 8)), torch.randint(0, 5000, (2, 8)))
    with pytest.raises(rewrites.RewriteError, match="linear_cross_entropy"):
        rewrites.apply(model, finding(model, args, "unfused_cross_entropy"))


def test_rewrite_with_a_wrong_eps_fails_validation():
    # the attribute says 1e-6, the forward adds 0.5: the rewrite trusts the attribute and validation catches it
    model = Wrap(ManualRMSNorm(32, eps=1e-6, used_eps=0.5))
    args = x3()
    new = rewritten(model, args, "manual_norm")
    report = ComponentValidator().validate_model(new, model, args)
    assert not report.passed


def test_attention_without_a_mask_becomes_full_attention():
    model = Wrap(ManualAttention(32, 4, causal=False))
    new = rewritten(model, x3(), "manual_attention")
    assert new.inner.causal is False
    assert ComponentValidator().validate_model(new, model, x3()).passed


def test_attention_with_a_mask_it_cannot_read_is_not_guessed():
    model = Wrap(ManualAttention(32, 4))
    f = finding(model, x3(), "manual_attention")
    f.data["inner"]["causal"] = None  # as when the mask is neither causal nor absent (padding, windows)
    with pytest.raises(rewrites.RewriteError, match="mask"):
        rewrites.apply(copy.deepcopy(model), f)


def test_cuda_graphs_need_cuda():
    model = Wrap(ManualRMSNorm(8))
    f = finding(model, x3(8), "manual_norm")
    f.kind = "small_launches"
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    with pytest.raises(rewrites.RewriteError, match="CUDA"):
        rewrites.apply(model, f)


def test_autocast_keeps_a_float64_reference_exact():
    inner = torch.nn.Linear(4, 4).double()
    out = rewrites.Autocast(inner)(torch.randn(2, 4, dtype=torch.float64))
    assert out.dtype == torch.float64


def test_attention_rewrite_in_bfloat16_where_casts_make_new_tensors():
    # softmax(scores.float()).to(bf16) is a new tensor in bf16 (in float32 .to() returns the same one): the data
    # flow must still tell the probabilities from v
    model = GPT(GPTConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, max_seq_len=16), dtype=torch.bfloat16)
    idx = torch.randint(0, 64, (2, 12))
    f = finding(model, (idx, idx), "manual_attention")
    item = f.data["blocks.0.attn"]
    assert (item["q"], item["k"], item["v"]) == (["blocks.0.attn.q"], ["blocks.0.attn.k"], ["blocks.0.attn.v"])
    new, _ = rewrites.apply(copy.deepcopy(model), f)
    assert ComponentValidator().validate_model(new, model, (idx, idx)).passed
