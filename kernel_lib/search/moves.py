"""The moves: named optimizations that turn one variant into another, and the rule-based generators for them.

The nine canonical moves are the whole vocabulary; a language model is held to it too (see llm.py). Rule generators
exist for six of them on Triton sources (and for block sizes on CUDA sources); the other three come from the
language model alone:

=========================  ================================================================  =================
move                       what it does                                                      rule generator
=========================  ================================================================  =================
enable_async_pipeline      overlap global loads with compute: more software-pipeline stages  num_stages values
vectorize_global_loads     wider loads and stores where aligned                              (language model)
switch_to_mma_or_wgmma     matrix-multiply instructions instead of scalar FMAs               (language model)
pad_tail_and_mask          body unmasked when the sizes divide the blocks (an EVEN_TAIL      masked loads and
                           constexpr computed at launch, so it stays right as blocks change)   stores
change_block_sizes         one knob of ``tunable`` to another power of two                   every other value
cache_policy_cg            ``cache_modifier=".cg"`` on loads: streaming data skips L1         all tl.load calls
avoid_atomics_reduce       restructure reductions to avoid atomics                           (language model)
grouped_gemm_colmajor      grouped tile order (GROUP_M row tiles share column tiles in L2)   pid // and % pair
softmax_math_fusion        exp -> exp2 with log2(e) folded in; x / sqrt(v) -> x * rsqrt(v)   tl.exp, tl.sqrt
=========================  ================================================================  =================

A generator returns every action it offers at a variant; each action is one child. Rewrites go through Python's
``ast`` and regenerate the calls they touch in one canonical form, so two moves applied in either order give the
same text (a transposition the graph can see).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass

from .spec import KernelSpec, pow2_range
from .variant import Variant

CANONICAL_MOVES: dict[str, str] = {
    "enable_async_pipeline": "overlap global loads with compute (more pipeline stages, async copies, TMA)",
    "vectorize_global_loads": "wider global loads and stores where the data is aligned",
    "switch_to_mma_or_wgmma": "matrix-multiply instructions (tl.dot, mma, wgmma) instead of scalar FMAs",
    "pad_tail_and_mask": "pad the tail so the body runs unmasked and vectorized",
    "change_block_sizes": "block sizes, warps, stages, programs per SM",
    "cache_policy_cg": "cache modifiers that keep streaming data out of L1",
    "avoid_atomics_reduce": "restructure reductions to avoid atomics",
    "grouped_gemm_colmajor": "grouped tile ordering for cache reuse",
    "softmax_math_fusion": "fuse or simplify math to relieve the special-function units (exp2, folded scales)",
}
LOG2E = "1.4426950408889634"  # log2(e) to 16 digits: exp(x) == exp2(x * LOG2E)
MOVE_PARAMS = ("EVEN_TAIL", "GROUP_M")  # constexpr parameters the moves add to a kernel


@dataclass(frozen=True)
class Action:
    """One edge: a canonical move with its parameter, and the variant it leads to."""

    move: str
    label: str  # e.g. "BLOCK_N=1024"; unique among a variant's actions
    child: Variant

    @property
    def key(self) -> str:
        return f"{self.move}:{self.label}"


# --------------------------------------------------------------------------------------------------
# Source rewriting through ast
# --------------------------------------------------------------------------------------------------
def _offsets(source: str) -> list[int]:
    starts, total = [0], 0
    for line in source.splitlines(keepends=True):
        total += len(line)
        starts.append(total)
    return starts


def _span(node: ast.AST, starts: list[int]) -> tuple[int, int]:
    # ast columns count UTF-8 bytes; kernel sources are ASCII (checked by the caller)
    return starts[node.lineno - 1] + node.col_offset, starts[node.end_lineno - 1] + node.end_col_offset


def _is_tl_call(node: ast.AST, names: tuple[str, ...]) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "tl"
        and node.func.attr in names
    )


def _entry_def(tree: ast.Module, entry: str) -> ast.FunctionDef | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == entry:
            return node
    return None


def _parse(source: str) -> ast.Module | None:
    if not source.isascii():
        return None
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _replace(source: str, edits: list[tuple[int, int, str]]) -> str:
    """Apply (start, end, text) edits, innermost and last first; overlapping edits keep the outer one."""
    edits = sorted(edits, key=lambda e: (e[0], -e[1]))
    kept: list[tuple[int, int, str]] = []
    for edit in edits:
        if kept and edit[0] < kept[-1][1]:
            continue
        kept.append(edit)
    for start, end, text in reversed(kept):
        source = source[:start] + text + source[end:]
    return source


def _call_text(source: str, starts: list[int], call: ast.Call, drop=(), add: dict[str, str] | None = None) -> str:
    """A call regenerated in canonical form: ``f(a, b, k=v, ...)`` on one line, keywords in their order."""
    seg = lambda n: source[slice(*_span(n, starts))]  # noqa: E731
    parts = [" ".join(seg(a).split()) for a in call.args]
    parts += [f"{k.arg}={' '.join(seg(k.value).split())}" for k in call.keywords if k.arg not in drop]
    parts += [f"{k}={v}" for k, v in (add or {}).items()]
    return f"{seg(call.func)}({', '.join(parts)})"


def _add_constexpr_param(source: str, entry: str, name: str) -> str | None:
    """Add ``name: tl.constexpr`` to the entry's parameters, move-added ones kept in sorted order at the end."""
    tree = _parse(source)
    fn = _entry_def(tree, entry) if tree else None
    if fn is None or not fn.args.args:
        return None
    params = fn.args.args
    if any(a.arg == name for a in params):
        return source
    starts = _offsets(source)
    anchor = params[-1]
    for a in params:  # before the first move-added parameter that sorts after the new one
        if a.arg in MOVE_PARAMS and a.arg > name:
            start = _span(a, starts)[0]
            return source[:start] + f"{name}: tl.constexpr, " + source[start:]
    end = _span(anchor, starts)[1]
    return source[:end] + f", {name}: tl.constexpr" + source[end:]


# --------------------------------------------------------------------------------------------------
# Rule generators: (variant, spec) -> actions
# --------------------------------------------------------------------------------------------------
def _knob_values(spec: KernelSpec, knob: str) -> list[int]:
    low, high = spec.tunable[knob]
    return list(range(low, high + 1)) if knob == "num_stages" else pow2_range(low, high)


def change_block_sizes(v: Variant, spec: KernelSpec) -> list[Action]:
    actions = []
    for knob in sorted(spec.tunable):
        if knob == "num_stages":
            continue  # enable_async_pipeline's knob
        if knob == "num_warps":
            current = v.launch["num_warps"]
        elif knob in v.launch["constexprs"]:
            current = v.launch["constexprs"][knob]
        else:
            continue  # a knob a later move introduces (GROUP_M before grouping)
        for value in _knob_values(spec, knob):
            if value == current:
                continue
            child = v.with_launch(num_warps=value) if knob == "num_warps" else v.with_constexprs(**{knob: value})
            actions.append(Action("change_block_sizes", f"{knob}={value}", child))
            warps = _scaled_warps(v, spec, knob, current, value)
            if warps is not None:  # the same tile change with the warps scaled along: one step, not two
                both = child.with_launch(num_warps=warps)
                actions.append(Action("change_block_sizes", f"{knob}={value},num_warps={warps}", both))
    return actions


def _scaled_warps(v: Variant, spec: KernelSpec, knob: str, old: int, new: int) -> int | None:
    """Warps scaled with a block size (same work per thread), within bounds; None when nothing would change."""
    if knob == "num_warps" or "num_warps" not in spec.tunable or not isinstance(old, int) or old <= 0:
        return None
    low, high = spec.tunable["num_warps"]
    warps = min(max(v.launch["num_warps"] * new // old, low), high) if new > old else None
    if warps is None:
        warps = max(min(max(v.launch["num_warps"] * new // old, 1), high), low)
    return warps if warps != v.launch["num_warps"] else None


def enable_async_pipeline(v: Variant, spec: KernelSpec) -> list[Action]:
    if "num_stages" not in spec.tunable or spec.kind != "triton":
        return []
    if "@triton.jit" in v.source and not re.search(r"\bfor\b.+\brange\(", v.source):
        return []  # stages pipeline loads across loop iterations: a kernel without a loop has nothing to overlap
    return [
        Action("enable_async_pipeline", f"num_stages={n}", v.with_launch(num_stages=n))
        for n in _knob_values(spec, "num_stages")
        if n != v.launch["num_stages"]
    ]


def cache_policy_cg(v: Variant, spec: KernelSpec) -> list[Action]:
    tree = _parse(v.source) if spec.kind == "triton" else None
    if tree is None:
        return []
    calls = [n for n in ast.walk(tree) if _is_tl_call(n, ("load",))]
    if any(_is_tl_call(n, ("dot",)) for n in ast.walk(tree)):
        return []  # tiles of a matmul are re-read from L1/shared memory: not streaming data
    todo = [c for c in calls if not any(k.arg == "cache_modifier" for k in c.keywords)]
    if not todo:
        return []
    starts = _offsets(v.source)
    edits = [(*_span(c, starts), _call_text(v.source, starts, c, add={"cache_modifier": '".cg"'})) for c in todo]
    return [Action("cache_policy_cg", "loads .cg", v.with_source(_replace(v.source, edits)))]


def pad_tail_and_mask(v: Variant, spec: KernelSpec) -> list[Action]:
    tails = spec.tails
    if spec.kind != "triton" or not tails or "EVEN_TAIL" in v.launch["constexprs"]:
        return []
    tree = _parse(v.source)
    fn = _entry_def(tree, spec.entry) if tree else None
    if fn is None:
        return []
    starts = _offsets(v.source)
    edits = []
    for call in ast.walk(fn):
        if not _is_tl_call(call, ("load", "store")) or not any(k.arg == "mask" for k in call.keywords):
            continue
        masked = _call_text(v.source, starts, call)
        bare = _call_text(v.source, starts, call, drop=("mask", "other"))
        edits.append((*_span(call, starts), f"({bare} if EVEN_TAIL else {masked})"))
    if not edits:
        return []
    source = _add_constexpr_param(_replace(v.source, edits), spec.entry, "EVEN_TAIL")
    if source is None:
        return []
    even = " and ".join(f"{size} % {block} == 0" for block, size in sorted(tails.items()))
    child = Variant.make(source, {**v.launch, "constexprs": {**v.launch["constexprs"], "EVEN_TAIL": even}})
    return [Action("pad_tail_and_mask", "EVEN_TAIL", child)]


_PID_PAIR = re.compile(
    r"^(?P<indent>[ \t]*)(?P<m>\w+)\s*=\s*(?P<pid>\w+)\s*//\s*(?P<n_tiles>\w+)[ \t]*\n"
    r"(?P=indent)(?P<n>\w+)\s*=\s*(?P=pid)\s*%\s*(?P=n_tiles)[ \t]*$",
    re.MULTILINE,
)


def grouped_gemm_colmajor(v: Variant, spec: KernelSpec) -> list[Action]:
    if spec.kind != "triton" or "GROUP_M" in v.launch["constexprs"]:
        return []
    found = _PID_PAIR.search(v.source)
    if found is None or not re.search(r"\bnum_pid_m\s*=", v.source[: found.start()]):
        return []  # needs the row-major tile order and the number of row tiles (num_pid_m) defined before it
    i, m, n, pid, n_tiles = (found.group(k) for k in ("indent", "m", "n", "pid", "n_tiles"))
    grouped = (
        f"{i}# grouped order: GROUP_M row tiles walk the column tiles together, sharing them in L2\n"
        f"{i}group_size = GROUP_M * {n_tiles}\n"
        f"{i}first_m = ({pid} // group_size) * GROUP_M\n"
        f"{i}rows_here = tl.minimum(num_pid_m - first_m, GROUP_M)\n"
        f"{i}{m} = first_m + (({pid} % group_size) % rows_here)\n"
        f"{i}{n} = ({pid} % group_size) // rows_here"
    )
    source = _add_constexpr_param(v.source[: found.start()] + grouped + v.source[found.end() :], spec.entry, "GROUP_M")
    if source is None:
        return []
    low, high = spec.tunable.get("GROUP_M", [8, 8])
    group = min(max(8, low), high)  # 8 row tiles per group unless the spec's bounds say otherwise
    child = Variant.make(source, {**v.launch, "constexprs": {**v.launch["constexprs"], "GROUP_M": group}})
    return [Action("grouped_gemm_colmajor", f"GROUP_M={group}", child)]


def softmax_math_fusion(v: Variant, spec: KernelSpec) -> list[Action]:
    tree = _parse(v.source) if spec.kind == "triton" else None
    fn = _entry_def(tree, spec.entry) if tree else None
    if fn is None:
        return []
    starts = _offsets(v.source)
    seg = lambda n: " ".join(v.source[slice(*_span(n, starts))].split())  # noqa: E731
    edits = []
    for node in ast.walk(fn):
        if _is_tl_call(node, ("exp",)) and len(node.args) == 1:
            edits.append((*_span(node, starts), f"tl.exp2(({seg(node.args[0])}) * {LOG2E})"))
        elif (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and _is_tl_call(node.right, ("sqrt",))
            and len(node.right.args) == 1
        ):
            arg = seg(node.right.args[0])
            one = isinstance(node.left, ast.Constant) and node.left.value == 1
            edits.append((*_span(node, starts), f"tl.rsqrt({arg})" if one else f"{seg(node.left)} * tl.rsqrt({arg})"))
    if not edits:
        return []
    return [Action("softmax_math_fusion", "exp2/rsqrt", v.with_source(_replace(v.source, edits)))]


RULES: dict[str, Callable[[Variant, KernelSpec], list[Action]]] = {
    "enable_async_pipeline": enable_async_pipeline,
    "pad_tail_and_mask": pad_tail_and_mask,
    "change_block_sizes": change_block_sizes,
    "cache_policy_cg": cache_policy_cg,
    "grouped_gemm_colmajor": grouped_gemm_colmajor,
    "softmax_math_fusion": softmax_math_fusion,
}


def rule_actions(v: Variant, spec: KernelSpec) -> list[Action]:
    """Every action the rule generators offer at ``v``, in a fixed order (moves, then labels)."""
    actions = []
    for rule in RULES.values():
        actions += rule(v, spec)
    seen, unique = set(), []
    for a in actions:
        if a.child.id != v.id and a.key not in seen:  # a rewrite that changes nothing is no move
            seen.add(a.key)
            unique.append(a)
    return unique


def reachable(spec: KernelSpec, limit: int = 100_000) -> list[Variant]:
    """Every variant the rule moves reach from the baseline (breadth first): the space an exhaustive run measures."""
    root = Variant.baseline(spec)
    order, seen, frontier = [root], {root.id}, [root]
    while frontier:
        nxt = []
        for v in frontier:
            for a in rule_actions(v, spec):
                if a.child.id not in seen:
                    seen.add(a.child.id)
                    order.append(a.child)
                    nxt.append(a.child)
                    if len(order) > limit:
                        raise ValueError(f"{spec.name}: more than {limit} reachable variants; narrow 'tunable'")
        frontier = nxt
    return order
