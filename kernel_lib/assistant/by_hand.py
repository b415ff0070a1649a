"""The source change a kept module rewrite stands for, as a unified diff of the model's own file.

A module rewrite (``fused_norm``, ``fused_gated_mlp``, ``flash_attention``, ``grouped_moe``) replaces whole
modules of one class with a kernel_lib module that computes the same function (the float64 validation checked
that). By hand, the same change is a new body for that class's ``forward``, calling kernel_lib on the attributes
the class already has. :func:`forward_diff` writes it as a unified diff against the file that defines the class
(``git apply``-able; ``import torch`` and ``import kernel_lib`` added after the file's imports where missing),
from the replacement module the rewrite built: its attribute names, head counts, epsilon. ``None`` where the
class's source cannot be read (defined in a notebook cell that is gone, or compiled), lives in an installed
library (``site-packages``: a Hugging Face model), or the replacement is not one of these.

The body is the function the assistant validated, written plainly: the ``flash_attention`` diff keeps three
projections where the rewrite ran q, k and v as one GEMM (fusing them by hand changes ``__init__`` too) and takes
SDPA for float32 inputs as the rewrite does; the ``fused_gated_mlp`` diff calls ``kernel_lib.swiglu_linear`` (SiLU)
or ``kernel_lib.geglu`` as the rewrite did.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import os
import textwrap

import torch

from ..ops.norms import LayerNorm, RMSNorm
from .rewrites import FusedGatedMLP, FusedSelfAttention, GroupedMoE


def _attr(module, role: str) -> str:
    return "self." + module.names[role]


def forward_body(new: torch.nn.Module, arg: str) -> list[str] | None:
    """Lines (unindented) of a ``forward(self, arg)`` that computes what ``new`` computes, in terms of the original
    class's attributes; None for a module that is not a rewrite's replacement."""
    if isinstance(new, RMSNorm):
        return [f"return kernel_lib.rms_norm({arg}, self.weight, eps={new.eps!r})"]
    if isinstance(new, LayerNorm):
        bias = "self.bias" if new.bias is not None else "None"
        return [f"return kernel_lib.layer_norm({arg}, self.weight, {bias}, eps={new.eps!r})"]
    if isinstance(new, FusedGatedMLP):
        gate, up, down = (_attr(new, role) for role in ("gate", "up", "down"))
        lines = [f"gate, up = {gate}({arg}), {up}({arg})"]
        if new.activation == "silu":
            lines.append(
                f"y = kernel_lib.swiglu_linear(gate, up, {down}.weight)  # the product is recomputed, not kept"
            )
            return lines + [f"return y if {down}.bias is None else y + {down}.bias"]
        return lines + [f"return {down}(kernel_lib.geglu(gate, up, approximate={new.approximate!r}))"]
    if isinstance(new, FusedSelfAttention):
        H, Hkv, D = new.n_heads, new.n_kv_heads, new.head_dim
        lines = [f"B, T, _ = {arg}.shape"]
        if "qkv" in new.names:
            lines.append(f"q, k, v = {_attr(new, 'qkv')}({arg}).split([{H * D}, {Hkv * D}, {Hkv * D}], dim=-1)")
        else:
            lines.append(f"q, k, v = {_attr(new, 'q')}({arg}), {_attr(new, 'k')}({arg}), {_attr(new, 'v')}({arg})")
        lines.append(f"q, k, v = (t.view(B, T, -1, {D}).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, D)")
        if new.rope_base is not None:
            lines += [
                f"cos, sin = kernel_lib.rope_cos_sin(T, {D}, {new.rope_base!r}, device={arg}.device)",
                "q, k = kernel_lib.rope(q, cos, sin), kernel_lib.rope(k, cos, sin)",
            ]
        lines += [
            "if q.dtype in (torch.float16, torch.bfloat16):",
            f"    out = kernel_lib.flash_attention(q, k, v, causal={new.causal!r})",
            "else:  # kernel_lib's kernel takes 16-bit inputs",
            f"    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal={new.causal!r}, "
            f"enable_gqa={Hkv != H!r})",
        ]
        return lines + [f"return {_attr(new, 'o')}(out.transpose(1, 2).reshape(B, T, {H * D}))"]
    if isinstance(new, GroupedMoE):
        lines = [f"experts = self.{new.experts_name}"]
        for role in ("gate", "up", "down"):
            name = new.roles[role]
            lines.append(f"{role} = torch.stack([e.{name}.weight.t() for e in experts]).contiguous()  # (E, in, out)")
        router = f"self.{new.router_name}.weight"
        return lines + [
            f"y, _aux = kernel_lib.moe({arg}, {router}, gate, up, down, {new.top_k}, aux_loss_coef=0.0)",
            "return y",
        ]
    return None


def _with_imports(text: str, names=("torch", "kernel_lib")) -> str:
    """The file with ``import <name>`` after its last top-level import for each name it does not import."""
    tree = ast.parse(text)
    have = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names if a.asname is None}
    missing = [f"import {name}\n" for name in names if name not in have]
    if not missing:
        return text
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    lines = text.splitlines(keepends=True)
    at = imports[-1].end_lineno if imports else 0
    return "".join(lines[:at] + missing + lines[at:])


def forward_patch(original_type: type, new: torch.nn.Module) -> tuple[str, str, str] | None:
    """(file, its text, its text with ``original_type.forward`` given the body :func:`forward_body` writes for
    ``new``), or None where it cannot be written."""
    forward = getattr(original_type, "forward", None)
    if forward is None or original_type.__module__.startswith("torch."):
        return None
    try:
        filename = inspect.getsourcefile(forward)
        lines, start = inspect.getsourcelines(forward)
        with open(filename) as f:
            text = f.read()
    except (OSError, TypeError):
        return None
    if any(part in ("site-packages", "dist-packages") for part in os.path.normpath(filename).split(os.sep)):
        return None  # an installed library's class (a Hugging Face model): not a file its user edits
    node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    if not isinstance(node, ast.FunctionDef) or node.body[0].lineno == node.lineno:  # a one-line forward
        return None
    params = [a.arg for a in node.args.posonlyargs + node.args.args]
    body = forward_body(new, params[1]) if len(params) >= 2 else None
    if body is None:
        return None
    first = node.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    keep = first.end_lineno if docstring else first.lineno - 1  # the forward's lines kept: def (and docstring)
    indent = lines[first.lineno - 1][: len(lines[first.lineno - 1]) - len(lines[first.lineno - 1].lstrip())]
    file_lines = text.splitlines(keepends=True)
    head = file_lines[: start - 1 + keep]
    tail = file_lines[start - 1 + node.end_lineno :]
    return filename, text, _with_imports("".join(head + [indent + line + "\n" for line in body] + tail))


def forward_diff(original_type: type, new: torch.nn.Module, root: str | None = None) -> str | None:
    """:func:`forward_patch` as a unified diff, paths relative to ``root`` (the working directory by default)."""
    patch = forward_patch(original_type, new)
    if patch is None:
        return None
    filename, old_text, new_text = patch
    name = os.path.relpath(filename, root or os.getcwd())
    diff = difflib.unified_diff(old_text.splitlines(keepends=True), new_text.splitlines(keepends=True),
                                fromfile=f"a/{name}", tofile=f"b/{name}")  # fmt: skip
    return "".join(diff)
