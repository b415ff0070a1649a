"""Read the forward methods' source: the Python loops in them, and what each loop runs over.

A loop is only a finding when the trace shows its body doing PyTorch work many times (see ``detect.py``); this
module finds the loops and names what they iterate over from the words in the loop header.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

import torch

# Words in a loop header that say what it runs over. Loops over layers or blocks are the normal way to stack them.
_CATEGORIES = [
    ("experts", ("expert",)),
    ("heads", ("head",)),
    ("edges", ("edge",)),
    ("features", ("embedding", "embed", "feature", "field", "table")),
    ("tokens", ("token", "seq", "position", "pos", "time", "step", "shape[1]", "size(1)")),
]
_NORMAL = ("layer", "block", "stage")


@dataclass
class Loop:
    cls: str  # the module class whose forward holds it
    filename: str
    line: int  # first line of the loop, in the file
    end_line: int
    header: str  # "for e, expert in enumerate(self.experts)"
    category: str  # experts, heads, edges, features, tokens, or "other"

    @property
    def location(self) -> str:
        return f"{self.filename}:{self.line}"


def _category(header: str) -> str:
    text = header.lower()
    if any(word in text for word in _NORMAL):
        return "normal"
    for category, words in _CATEGORIES:
        if any(word in text for word in words):
            return category
    return "other"


def forward_loops(module_type: type) -> list[Loop]:
    """The ``for`` and ``while`` loops (and comprehensions) in ``module_type.forward``; [] when its source is
    unavailable (built-in, compiled, or defined in a notebook cell that is gone)."""
    forward = getattr(module_type, "forward", None)
    if forward is None or module_type.__module__.startswith("torch.nn."):
        return []
    try:
        lines, start = inspect.getsourcelines(forward)
        filename = inspect.getsourcefile(forward) or "?"
    except (OSError, TypeError):
        return []
    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError:
        return []
    loops = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            header = f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)}"
        elif isinstance(node, ast.While):
            header = f"while {ast.unparse(node.test)}"
        elif isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp)):
            gen = node.generators[0]
            header = f"[... for {ast.unparse(gen.target)} in {ast.unparse(gen.iter)}]"
        else:
            continue
        category = _category(header)
        if category == "normal":
            continue
        loops.append(
            Loop(module_type.__name__, filename, start + node.lineno - 1, start + node.end_lineno - 1, header, category)
        )
    return sorted(loops, key=lambda lp: lp.line)


def model_loops(model: torch.nn.Module) -> dict[str, list[Loop]]:
    """Loops per module path (each class's source read once)."""
    by_type: dict[type, list[Loop]] = {}
    out = {}
    for path, module in model.named_modules():
        t = type(module)
        if t not in by_type:
            by_type[t] = forward_loops(t)
        if by_type[t]:
            out[path] = by_type[t]
    return out
