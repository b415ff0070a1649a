"""Each finding kind on a model that has it, at the right place; a clean model has none of them."""

import pytest
import torch

from kernel_lib.assistant import detect, dynamo, source
from kernel_lib.assistant import trace as tracing
from kernel_lib.models import zoo
from tests.assistant.models import (
    Clean,
    GatedMLP,
    HeadLoopAttention,
    LMHeadLoss,
    ManualAttention,
    ManualLayerNorm,
    ManualRMSNorm,
    StepCounter,
    SyncsAndPrints,
    Wrap,
)


def findings_of(model, args, with_dynamo=False):
    t = tracing.record(model, args)
    dyn = dynamo.analyze(model, args) if with_dynamo else None
    return detect.detect_all(model, t, source.model_loops(model), dyn, None, compiled=False)


def kinds(findings):
    return {f.kind for f in findings}


x3 = lambda d=32, t=8: (torch.randn(2, t, d),)  # noqa: E731


@pytest.mark.parametrize(
    "model, args, kind, modules",
    [
        (Wrap(ManualRMSNorm(32)), x3(), "manual_norm", ["inner"]),
        (Wrap(ManualLayerNorm(32)), x3(), "manual_norm", ["inner"]),
        (Wrap(ManualAttention(32, 4)), x3(), "manual_attention", ["inner"]),
        (Wrap(ManualAttention(32, 4)), x3(), "separate_qkv", ["inner"]),
        (Wrap(GatedMLP(32, 64)), x3(), "unfused_activation", ["inner"]),
        (Wrap(GatedMLP(32, 64, act="tanh")), x3(), "unfused_activation", ["inner"]),  # geglu, tanh approximation
        (LMHeadLoss(), (torch.randint(0, 5000, (2, 8)), torch.randint(0, 5000, (2, 8))), "unfused_cross_entropy", [""]),
        (Wrap(HeadLoopAttention(64, 8)), x3(64), "python_loop", ["inner"]),  # a loop over heads
        (zoo.EdgeLoopGNN(8, 16, 4), zoo.gnn_inputs(10, 30, 8), "python_loop", [""]),  # a loop over edges
        (zoo.EdgeLoopGNN(8, 16, 4), zoo.gnn_inputs(10, 30, 8), "host_sync", [""]),  # .item() per edge
        (
            zoo.EmbeddingLoopRecommender([50, 20, 10, 5]),
            (zoo.recommender_inputs(4, [50, 20, 10, 5]),),
            "python_loop",
            [""],
        ),  # a loop over embedding tables
        (Wrap(ManualAttention(32, 4)), x3(), "fp32_compute", [""]),
    ],
)
def test_kind_found_where_it_is(model, args, kind, modules):
    found = [f for f in findings_of(model, args) if f.kind == kind]
    assert len(found) == 1, [f.kind for f in findings_of(model, args)]
    assert found[0].modules == modules
    assert found[0].evidence and found[0].location


def test_python_loop_says_what_it_runs_over():
    f = next(f for f in findings_of(*[zoo.EdgeLoopGNN(8, 16, 4), zoo.gnn_inputs(10, 30, 8)]) if f.kind == "python_loop")
    assert "edges" in f.evidence and "index_add_" in f.fix


def test_causal_mask_is_read_from_the_mask_tensor():
    causal = findings_of(Wrap(ManualAttention(32, 4, causal=True)), x3())
    full = findings_of(Wrap(ManualAttention(32, 4, causal=False)), x3())
    item = lambda fs: next(f for f in fs if f.kind == "manual_attention").data["inner"]  # noqa: E731
    assert item(causal)["causal"] is True
    assert item(full)["causal"] is False  # no mask at all: full attention
    assert item(causal)["q"] == ["inner.q"] and item(causal)["o"] == ["inner.o"] and item(causal)["heads"] == 4


def test_expert_loop_in_the_naive_moe():
    from kernel_lib.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, n_experts=4, top_k=2))
    idx = torch.randint(0, 64, (2, 8))
    f = next(f for f in findings_of(model, (idx, idx)) if f.kind == "expert_loop")
    assert f.modules == ["blocks.0.mlp"]
    assert f.data["blocks.0.mlp"]["router"] == "router" and f.data["blocks.0.mlp"]["top_k"] == 2


def test_graph_break_and_host_sync_with_source_line():
    found = findings_of(Wrap(SyncsAndPrints()), (torch.randn(3, 16),), with_dynamo=True)
    brk = next(f for f in found if f.kind == "graph_break")
    sync = next(f for f in found if f.kind == "host_sync")
    assert "item" in brk.evidence.lower() and brk.location.startswith("(models.py:")
    assert sync.modules == ["inner"] and "item" in sync.evidence
    if not torch.cuda.is_available():  # on a CPU nothing waits: the finding says what it would cost on a GPU
        assert "each would wait for a GPU (on this CPU nothing waits)" in sync.evidence


def test_a_small_model_s_float32_matmuls_are_counted_in_a_unit_that_shows_them():
    # a small head's matmuls are a few MFLOP: "0.00 GFLOP" said nothing
    assert detect._flop_text(3.2e6) == "3.20 MFLOP" and detect._flop_text(2.5e9) == "2.50 GFLOP"
    assert detect._flop_text(640) == "640 FLOP"
    found = findings_of(Wrap(ManualAttention(32, 4)), x3())
    f = next(f for f in found if f.kind == "fp32_compute")
    assert " 0.00 GFLOP" not in f.evidence and "FLOP of matmuls run in float32" in f.evidence


def test_recompile_on_changing_python_state():
    found = findings_of(StepCounter(), (torch.randn(3, 16),), with_dynamo=True)
    f = next(f for f in found if f.kind == "recompile")
    assert f.count >= 1 and "calls" in f.evidence


def test_clean_model_has_no_fusion_findings():
    model = Clean().to(torch.bfloat16)
    found = findings_of(model, (torch.randn(2, 8, 32, dtype=torch.bfloat16),), with_dynamo=True)
    assert kinds(found) == {"not_compiled"}


def test_small_launches_from_the_op_count_without_a_gpu():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(detect.CPU_OP_COUNT)])
    f = next(f for f in findings_of(model, (torch.randn(2, 4),)) if f.kind == "small_launches")
    assert "no GPU here" in f.evidence and f.data["measured"] is False
