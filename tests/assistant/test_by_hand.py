"""kernel_lib.assistant.by_hand: the diff a kept module rewrite stands for applies to the model's own file, and the
class it patches computes what the original did."""

import copy
import importlib.util
import os
import shutil
import subprocess

import pytest
import torch

from kernel_lib.assistant import CompilerOptimizationAssistant, by_hand
from kernel_lib.models import GPT, GPTConfig
from tests.assistant import models
from tests.assistant.models import GatedMLP, ManualAttention, ManualLayerNorm, ManualRMSNorm, Wrap

MODELS_FILE = models.__file__


def rewritten(model, inputs, technique):
    """The findings of ``technique`` on ``model`` and the rewritten copy (no timing: what apply_plan runs)."""
    assistant = CompilerOptimizationAssistant(progress=False)
    ctx = assistant._prepare(model, inputs)
    found = [f for f in assistant._find(model, ctx) if f.technique == technique]
    assert found, f"no {technique} finding"
    new, _ = assistant._rewrite(model, found)
    return found[0], new


def patched_class(tmp_path, source_file, original_type, new_module):
    """Apply the diff with ``git apply`` to a copy of ``source_file``; the patched class from that copy."""
    root = tmp_path / "repo"
    name = os.path.basename(source_file)
    (root).mkdir()
    shutil.copy(source_file, root / name)
    diff = by_hand.forward_diff(original_type, new_module, root=os.path.dirname(source_file))
    assert diff.startswith(f"--- a/{name}\n+++ b/{name}\n")
    (tmp_path / "fix.patch").write_text(diff)
    subprocess.run(["git", "apply", "--unsafe-paths", str(tmp_path / "fix.patch")], cwd=root, check=True)
    spec = importlib.util.spec_from_file_location(f"patched_{original_type.__name__}", root / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, original_type.__name__), diff


@pytest.mark.parametrize(
    "make, technique, calls",
    [
        (lambda: Wrap(ManualRMSNorm(32)), "fused_norm", "kernel_lib.rms_norm("),
        (lambda: Wrap(ManualLayerNorm(32)), "fused_norm", "kernel_lib.layer_norm("),
        (lambda: Wrap(GatedMLP(32, 64)), "fused_gated_mlp", "kernel_lib.swiglu_linear("),
        (lambda: Wrap(GatedMLP(32, 64, act="tanh")), "fused_gated_mlp", "kernel_lib.geglu("),  # GeGLU
        (lambda: Wrap(ManualAttention(32, 4)), "flash_attention", "kernel_lib.flash_attention("),
    ],
    ids=["rms_norm", "layer_norm", "swiglu", "geglu", "attention"],
)
def test_the_diff_applies_and_the_patched_class_computes_the_same(tmp_path, make, technique, calls):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(2, 8, 32)
    finding, new = rewritten(model, (x,), technique)
    path = finding.modules[0]
    original = model.get_submodule(path)
    patched_type, diff = patched_class(tmp_path, MODELS_FILE, type(original), new.get_submodule(path))
    assert calls in diff and "+import kernel_lib\n" in diff
    patched = copy.deepcopy(original)
    patched.__class__ = patched_type  # the same attributes and weights, the patched forward
    with torch.no_grad():
        torch.testing.assert_close(patched(x), original(x), atol=1e-5, rtol=1e-5)


def test_the_expert_loop_becomes_one_moe_call(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16, n_experts=4, top_k=2))
    idx = torch.randint(0, 64, (2, 8))
    finding, new = rewritten(model, (idx, idx), "grouped_moe")
    original = model.get_submodule(finding.modules[0])
    patch = by_hand.forward_patch(type(original), new.get_submodule(finding.modules[0]))
    assert patch is not None and "kernel_lib.moe(" in patch[2] and patch[0].endswith(os.path.join("models", "gpt.py"))
    x = torch.randn(2, 8, 32)
    namespace = {"__name__": "kernel_lib.models._patched_gpt", "__package__": "kernel_lib.models"}
    exec(compile(patch[2], patch[0], "exec"), namespace)  # the patched gpt.py, run as a fresh module beside it
    patched = copy.deepcopy(original)
    patched.__class__ = namespace[type(original).__name__]
    with torch.no_grad():
        want = original(x)
        torch.testing.assert_close(patched(x), want[0] if isinstance(want, tuple) else want, atol=1e-5, rtol=1e-5)


def test_classes_without_readable_source_get_no_diff():
    norm = torch.nn.LayerNorm(8)  # PyTorch's own class: nothing of the user's to patch
    assert by_hand.forward_diff(type(norm), norm) is None
    assert by_hand.forward_body(torch.nn.Linear(2, 2), "x") is None  # not a rewrite's replacement
