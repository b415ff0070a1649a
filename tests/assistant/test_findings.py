"""The table of finding kinds: the names the issue and the docs promise, each with its fix and evidence."""

import pytest

from kernel_lib.assistant import KINDS, Finding, kinds_table
from kernel_lib.assistant.rewrites import REWRITES

PROMISED = [
    "graph_break",
    "recompile",
    "host_sync",
    "python_loop",
    "separate_qkv",
    "manual_attention",
    "manual_norm",
    "unfused_activation",
    "unfused_cross_entropy",
    "expert_loop",
    "fp32_compute",
    "small_launches",
    "not_compiled",
]


def test_every_promised_kind_is_in_the_table():
    assert sorted(KINDS) == sorted(PROMISED)
    table = kinds_table()
    assert list(table.columns) == ["what", "evidence", "fix", "rewrite", "chapter"]
    assert all(table["fix"].str.len() > 10)


@pytest.mark.parametrize("name", PROMISED)
def test_each_rewrite_named_exists(name):
    rewrite = KINDS[name].rewrite
    assert rewrite == "" or rewrite in REWRITES


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown finding kind"):
        Finding(kind="slow_model", location="(model)", evidence="")


def test_specific_advice_overrides_the_kind_fix():
    f = Finding(kind="python_loop", location="x", evidence="e", advice="use index_add_")
    assert f.fix == "use index_add_" and f.to_dict()["fix"] == "use index_add_"
    assert Finding(kind="python_loop", location="x", evidence="e").fix == KINDS["python_loop"].fix


def test_the_waterfall_keeps_its_columns_with_long_fix_names():
    # a fix named longer than the column used to push its time out of line with the others
    import torch

    from kernel_lib.assistant.report import OptimizationResult, WaterfallStep
    from kernel_lib.bench import StepCost

    names = ["original", "fused_linear_cross_entropy_with_chunked_vocabulary", "compile"]
    steps = [WaterfallStep(n, 10.0 - i, float("nan"), True, "") for i, n in enumerate(names)]
    result = OptimizationResult("m", "cpu", [], [], StepCost(10.0, 0.01, 10.0, float("nan")), torch.nn.Identity(),
                                {}, final=StepCost(8.0, 0.01, 8.0, float("nan")), waterfall=steps)  # fmt: skip
    lines = result.report().splitlines()
    rows = [line for line in lines if line.strip().split(" ")[0] in names]
    assert len(rows) == 3 and len({line.index(" ms") for line in rows}) == 1  # the times end in one column
