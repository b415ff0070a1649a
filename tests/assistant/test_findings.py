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
