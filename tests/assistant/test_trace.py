"""The recorded forward: op names, module paths, source lines, and data flow through views and casts."""

import inspect

import torch

from kernel_lib.assistant import trace as tracing
from tests.assistant.models import GatedMLP, ManualAttention, Wrap


def test_ops_carry_module_path_and_source_line():
    model = Wrap(GatedMLP(8, 16))
    t = tracing.record(model, (torch.randn(2, 3, 8),))
    names = [op.name for op in t.ops]
    assert names == ["linear", "silu", "linear", "mul", "linear"]
    assert [op.module for op in t.ops] == ["inner.gate", "inner", "inner.up", "inner", "inner.down"]
    lines, start = inspect.getsourcelines(GatedMLP.forward)
    mul_line = start + next(i for i, line in enumerate(lines) if "a * self.up(x)" in line)
    assert t.ops[3].location.endswith(f"models.py:{mul_line}")
    assert t.linear_module(t.ops[0]) == "inner.gate" and t.linear_module(t.ops[1]) is None


def test_origin_and_uses_look_through_views():
    t = tracing.record(Wrap(ManualAttention(16, 2)), (torch.randn(1, 5, 16),))
    softmax = next(op for op in t.ops if op.name == "softmax")
    score = t.origin(softmax.inputs[0], skip=tracing.VIEW_OPS | {"masked_fill", "div"})
    assert score.name == "matmul"
    assert [op.name for op in t.uses(softmax.outputs[0])] == ["matmul"]
    q_view = t.origin(score.inputs[0])  # q went through view and transpose: its origin is the q projection
    assert t.linear_module(q_view) == "inner.q"


def test_host_syncs_are_recorded_even_without_tensor_results():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            n = int((x > 0).sum().item())
            return self.w * x * n

    t = tracing.record(M(), (torch.randn(3),))
    assert "item" in [op.name for op in t.ops]
    assert all(op.name not in ("size", "dim") for op in t.ops)  # shape queries move no data


def test_hooks_are_removed_after_recording():
    model = Wrap(GatedMLP(8, 16))
    tracing.record(model, (torch.randn(2, 8),))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
