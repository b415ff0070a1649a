"""The detectors: from a recorded trace, the forward methods' loops, Dynamo's report and the profile, the findings.

Each detector is one function returning findings of one or two kinds; ``detect_all`` runs them. Patterns are
matched on the data flow (which op read which op's output), not on names, so they hold for code written in any
style; names are only used to say what a loop runs over and to find an eps or a top-k attribute.
"""

from __future__ import annotations

import math
import os

import torch

from .dynamo import DynamoReport
from .findings import Finding
from .measure import Profile
from .source import Loop
from .trace import HOST_SYNC_OPS, VIEW_OPS, Op, Trace

LARGE_VOCAB = 4096  # a Linear with at least this many outputs feeding cross_entropy is a vocabulary head
LOOP_CALLS = 8  # a loop whose body made at least this many recorded calls per forward is a finding
SMALL_KERNEL_COUNT = 100  # kernels per step above which launch overhead can dominate
BUSY_SHARE = 0.8  # ... when the GPU is busy for less than this share of the step
CPU_OP_COUNT = 200  # without a GPU: recorded calls per forward above which launches would dominate
_SCORE_OPS = VIEW_OPS | {"masked_fill", "where", "add", "mul", "div", "sub", "float"}  # between scores and softmax
_ROPE_OPS = {"mul", "add", "sub", "cat", "neg", "stack"}


def short(location: str) -> str:
    path, _, line = location.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else location


def where(module: str, location: str) -> str:
    return f"{module or '(model)'} ({short(location)})"


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _rel(path: str, parent: str) -> str:
    return path[len(parent) + 1 :] if parent else path


LOOP_ADVICE = {
    "heads": "put the heads in a tensor dimension: view (B, T, H, D) and transpose, then one batched matmul or SDPA",
    "tokens": "vectorize over the sequence (cumsum, a causal mask, or one batched op over all positions)",
    "edges": "gather all messages with x[edge_index[0]], sum them with index_add_ (or scatter_add_) into the "
    "destinations: two kernels for all edges",
    "features": "one embedding table for all features with per-feature offsets (or nn.EmbeddingBag), and the "
    "pairwise interactions as one batched matmul of the stacked embeddings",
    "other": "express the loop's body over all iterations at once with tensor indexing",
}


def _group(found: dict, kind: str, evidence_of, advice_of=None) -> list[Finding]:
    """One finding per (source line): the same code in eight blocks is one thing to fix, in eight places."""
    by_line: dict[str, list] = {}
    for path, item in found.items():
        by_line.setdefault(item["location"], []).append((path, item))
    out = []
    for location, items in by_line.items():
        paths = [p for p, _ in items]
        first = items[0][1]
        out.append(
            Finding(
                kind=kind,
                location=where(paths[0], location) + (f" and {len(paths) - 1} more" if len(paths) > 1 else ""),
                evidence=evidence_of(first, len(paths)),
                modules=paths,
                count=len(paths),
                data={p: it for p, it in items},
                advice=advice_of(first) if advice_of else "",
            )
        )
    return out


def _back_to_linears(trace: Trace, tid: int, depth: int = 16) -> tuple[list[str], set[str]]:
    """Linear modules reached walking back from ``tid`` (any ops between), and the names of the ops passed."""
    linears, passed, stack, seen = [], set(), [(tid, 0)], set()
    while stack:
        t, d = stack.pop()
        if t in seen or d > depth or t not in trace.producer:
            continue
        seen.add(t)
        op = trace.ops[trace.producer[t]]
        path = trace.linear_module(op)
        if path is not None:
            if path not in linears:
                linears.append(path)
            continue
        passed.add(op.name)
        for i in op.inputs:
            if i not in trace.param_names:
                stack.append((i, d + 1))
    return linears, passed


def _is_causal_mask(mask) -> bool | None:
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return None
    m = mask.reshape(-1, *mask.shape[-2:])[0]
    if m.dtype == torch.bool:
        upper = torch.triu(torch.ones_like(m), 1)
        return bool(torch.equal(m, upper)) or bool(torch.equal(~m, upper))
    upper = torch.triu(torch.ones(m.shape, dtype=torch.bool, device=m.device), 1)
    return bool(torch.isinf(m[upper]).all() and (m[~upper] == 0).all())


def manual_attention(trace: Trace) -> list[Finding]:
    found = {}
    for op in trace.ops:
        if op.name != "softmax" or not op.inputs:
            continue
        chain, tid = [], op.inputs[0]
        src = None
        while tid in trace.producer and len(chain) < 16:  # back through mask, scale, casts to the score matmul
            prev = trace.ops[trace.producer[tid]]
            if prev.name == "matmul":
                src = prev
                break
            if prev.name not in _SCORE_OPS or not prev.inputs:
                break
            chain.append(prev)
            tid = prev.inputs[0]
        users = trace.uses(op.outputs[0])
        pv = next((u for u in users if u.name == "matmul"), None)
        if src is None or pv is None or len(src.inputs) < 2:
            continue
        causal, masked = None, False
        for c in chain:
            mask = c.args[1] if c.name in ("masked_fill", "where") and len(c.args) > 1 else None
            if c.name == "add" and len(c.args) > 1:
                mask = c.args[1]
            masked |= isinstance(mask, torch.Tensor)
            verdict = _is_causal_mask(mask)
            if verdict is not None:
                causal = verdict
        if not masked:
            causal = False  # no mask at all: every query sees every key
        scores = op.out_shapes[0]
        q_lin, q_ops = _back_to_linears(trace, src.inputs[0])
        k_lin, k_ops = _back_to_linears(trace, src.inputs[1])
        probs_first = trace.origin(pv.inputs[0], skip=VIEW_OPS | {"dropout"}) is op  # which operand is softmax's
        v_lin, _ = _back_to_linears(trace, pv.inputs[1] if probs_first else pv.inputs[0])
        out_lin = [trace.linear_module(u) for u in trace.uses(pv.outputs[0])]
        found.setdefault(
            op.module,
            {
                "location": op.location,
                "heads": scores[-3] if len(scores) >= 4 else 1,
                "n": scores[-2],
                "m": scores[-1],
                "causal": causal,
                "q": q_lin,
                "k": k_lin,
                "v": v_lin,
                "o": [p for p in out_lin if p],
                "rope": bool((q_ops | k_ops) & {"cat", "neg"}),
                "score_bytes": math.prod(scores)
                * torch.empty(0, dtype=trace.tensors[op.outputs[0]].dtype).element_size(),
            },
        )

    def evidence(item, n):
        mib = item["score_bytes"] / 2**20
        return (
            f"softmax over a {item['n']} x {item['m']} score matrix per head ({item['heads']} heads) between two "
            f"matmuls; the scores take {mib:,.1f} MiB per call, written and read again"
            + (", causal mask applied by hand" if item["causal"] else "")
        )

    return _group(found, "manual_attention", evidence)


def manual_norm(trace: Trace) -> list[Finding]:
    found = {}
    for op in trace.ops:
        if op.name not in ("rsqrt", "sqrt") or not op.inputs:
            continue
        mean = trace.origin(op.inputs[0], skip=VIEW_OPS | {"add"})
        if mean is None or mean.name not in ("mean", "var"):
            continue
        if mean.name == "var":
            kind = "layer"
        else:
            sq = trace.origin(mean.inputs[0])
            if sq is None or sq.name not in ("pow", "square", "mul"):
                continue
            centered = sq.inputs and trace.origin(sq.inputs[0])
            kind = "layer" if centered is not None and centered and centered.name == "sub" else "rms"
        module = trace.modules.get(op.module)
        if isinstance(module, (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", ()))):
            continue
        weight = getattr(module, "weight", None)
        found.setdefault(
            op.module,
            {
                "location": op.location,
                "norm": kind,
                "width": op.in_shapes[0][-1] if op.in_shapes else None,
                "has_weight": isinstance(weight, torch.Tensor) and weight.dim() == 1,
                "eps": next(
                    (
                        getattr(module, a)
                        for a in ("eps", "variance_epsilon", "epsilon")
                        if isinstance(getattr(module, a, None), float)
                    ),
                    None,
                ),
                "calls": len(trace.ops_in(op.module)),
            },
        )

    def evidence(item, n):
        name = "RMSNorm" if item["norm"] == "rms" else "LayerNorm"
        return f"{name} written out: {item['calls']} recorded PyTorch calls per norm, each a pass over the activations"

    return _group(found, "manual_norm", evidence)


def unfused_activation(trace: Trace) -> list[Finding]:
    found = {}
    for op in trace.ops:
        if op.name != "mul" or len(op.inputs) != 2:
            continue
        a, b = (trace.origin(t) for t in op.inputs)
        for act, other in ((a, b), (b, a)):
            if act is None or act.name not in ("silu", "gelu") or other is None:
                continue
            gate = trace.linear_module(trace.origin(act.inputs[0]))
            up = trace.linear_module(other)
            downs = [trace.linear_module(u) for u in trace.uses(op.outputs[0])]
            down = next((d for d in downs if d), None)
            if gate is None or up is None or gate == up:
                continue
            approximate = act.kwargs.get("approximate", act.args[1] if len(act.args) > 1 else "none")
            found.setdefault(
                op.module,
                {
                    "location": op.location,
                    "activation": act.name,
                    "approximate": approximate,
                    "gate": gate,
                    "up": up,
                    "down": down,
                    "shape": op.out_shapes[0],
                },
            )
            break

    def evidence(item, n):
        name = "silu" if item["activation"] == "silu" else f"gelu({item['approximate']})"
        return (
            f"{name}(gate) * up as separate kernels on a {tuple(item['shape'])} tensor, gate and up as two "
            "projections of one input"
        )

    return _group(found, "unfused_activation", evidence)


def separate_projections(trace: Trace, exclude: set[str]) -> list[Finding]:
    groups: dict[tuple, list[Op]] = {}
    for op in trace.ops:
        path = trace.linear_module(op)
        if path is None or path in exclude or not op.inputs:
            continue
        tid = op.inputs[0]
        while tid in trace.producer and trace.ops[trace.producer[tid]].name in VIEW_OPS:
            tid = trace.ops[trace.producer[tid]].inputs[0]
        groups.setdefault((_parent(path), tid), []).append(op)
    found = {}
    for (parent, _), ops in groups.items():
        paths = list(dict.fromkeys(trace.linear_module(o) for o in ops))
        if len(paths) >= 3:
            found.setdefault(parent, {"location": ops[0].location, "linears": paths})

    def evidence(item, n):
        names = ", ".join(p.rpartition(".")[2] for p in item["linears"])
        return f"{len(item['linears'])} Linear calls ({names}) read the same input: {len(item['linears'])} GEMMs"

    return _group(found, "separate_qkv", evidence)


def unfused_cross_entropy(trace: Trace, model: torch.nn.Module) -> list[Finding]:
    found = {}
    for op in trace.ops:
        if op.name not in ("cross_entropy", "nll_loss") or not op.inputs:
            continue
        src = trace.origin(op.inputs[0], skip=VIEW_OPS | {"log_softmax"})
        head = trace.linear_module(src)
        if head is None:
            continue
        linear = trace.modules[head]
        if linear.out_features < LARGE_VOCAB:
            continue
        logits = trace.tensors[src.outputs[0]]
        ce_in = trace.tensors[op.inputs[0]]
        protocol = (
            "forward_hidden"
            if callable(getattr(model, "forward_hidden", None))
            else "hf"
            if hasattr(model, "get_decoder") and hasattr(model, "lm_head")
            else ""
        )
        found.setdefault(
            op.module,
            {
                "location": op.location,
                "head": head,
                "vocab": linear.out_features,
                "logits_bytes": logits.numel() * logits.element_size(),
                "loss_input_dtype": str(ce_in.dtype),
                "protocol": protocol,
                "tokens": logits.numel() // linear.out_features,
            },
        )

    def evidence(item, n):
        return (
            f"{item['head']} writes {item['tokens']:,} x {item['vocab']:,} logits ({item['logits_bytes'] / 2**20:,.0f}"
            f" MiB), cross-entropy reads them as {item['loss_input_dtype'].replace('torch.', '')}; the backward "
            "writes a gradient of the same size"
        )

    return _group(found, "unfused_cross_entropy", evidence)


def loops(trace: Trace, model_loops: dict[str, list[Loop]]) -> list[Finding]:
    """python_loop and expert_loop: loops in forward whose body made many recorded calls."""
    found: dict[str, dict[str, dict]] = {"python_loop": {}, "expert_loop": {}}
    for path, loop_list in model_loops.items():
        body: dict[int, list[Op]] = {i: [] for i in range(len(loop_list))}
        for op in trace.ops_in(path):  # each call counts for the innermost loop around its line
            file, _, line = op.location.rpartition(":")
            inside = [
                i
                for i, lp in enumerate(loop_list)
                if lp.filename == file and line.isdigit() and lp.line <= int(line) <= lp.end_line
            ]
            if inside:
                body[min(inside, key=lambda i: loop_list[i].end_line - loop_list[i].line)].append(op)
        for i, loop in enumerate(loop_list):
            # a loop of unknown purpose (often over layers) must do far more work to count
            if len(body[i]) < (LOOP_CALLS if loop.category != "other" else 4 * LOOP_CALLS):
                continue
            kind = "expert_loop" if loop.category == "experts" else "python_loop"
            module = trace.modules[path]
            item = {
                "location": loop.location,
                "header": loop.header,
                "category": loop.category,
                "calls": len(body[i]),
                "syncs": sum(op.name in HOST_SYNC_OPS for op in body[i]),
            }
            if kind == "expert_loop":
                experts = next((m for m in module.children() if isinstance(m, torch.nn.ModuleList)), None)
                router = next(
                    (
                        n
                        for n, m in module.named_children()
                        if isinstance(m, torch.nn.Linear) and experts is not None and m.out_features == len(experts)
                    ),
                    None,
                )
                item.update(
                    router=router,
                    n_experts=len(experts) if experts is not None else 0,
                    top_k=next(
                        (
                            getattr(module, a)
                            for a in ("top_k", "num_experts_per_tok", "k")
                            if isinstance(getattr(module, a, None), int)
                        ),
                        None,
                    ),
                )
            found[kind].setdefault(path if path not in found[kind] else f"{path}@{loop.line}", item)

    def evidence(item, n):
        sync = f", {item['syncs']} of them host syncs" if item["syncs"] else ""
        return f"`{item['header']}` ({item['category']}) made {item['calls']} PyTorch calls per forward{sync}"

    advice = lambda item: LOOP_ADVICE.get(item["category"], LOOP_ADVICE["other"])  # noqa: E731
    return _group(found["python_loop"], "python_loop", evidence, advice) + _group(
        found["expert_loop"], "expert_loop", evidence
    )


def host_syncs(trace: Trace) -> list[Finding]:
    by_line: dict[str, list[Op]] = {}
    for op in trace.ops:
        if op.name in HOST_SYNC_OPS:
            by_line.setdefault(op.location, []).append(op)
    on_gpu = any(t.is_cuda for t in trace.tensors.values()) or any(p.is_cuda for p in trace.model.parameters())
    # on a CPU nothing runs ahead of Python, so nothing waits: say what it would cost on a GPU
    cost = "each waits for the GPU" if on_gpu else "each would wait for a GPU (on this CPU nothing waits)"
    out = []
    for location, ops in by_line.items():
        names = sorted({op.name.replace("float_", "float").replace("repr", "print") for op in ops})
        modules = list(dict.fromkeys(op.module for op in ops))
        out.append(
            Finding(
                kind="host_sync",
                location=where(modules[0], location),
                evidence=f"{len(ops)} call(s) of {', '.join(names)} per forward at this line; {cost}",
                modules=modules,
                count=len(ops),
            )
        )
    return out


def _flop_text(flops: float) -> str:
    """A FLOP count in the unit that shows it (a small model's matmuls are MFLOPs, not 0.00 GFLOP)."""
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= scale:
            return f"{flops / scale:,.2f} {unit}"
    return f"{flops:,.0f} FLOP"


def fp32_compute(trace: Trace) -> list[Finding]:
    flops = {torch.float32: 0.0, "all": 0.0}
    for op in trace.ops:
        if op.name not in ("linear", "matmul") or not op.in_shapes or not op.out_shapes:
            continue
        f = 2.0 * math.prod(op.out_shapes[0]) * (op.in_shapes[0][-1] if op.in_shapes[0] else 1)
        flops["all"] += f
        if op.in_dtypes[0] == torch.float32:
            flops[torch.float32] += f
    if flops["all"] == 0 or flops[torch.float32] / flops["all"] < 0.5:
        return []
    share = flops[torch.float32] / flops["all"]
    return [
        Finding(
            kind="fp32_compute",
            location="(model)",
            evidence=f"{share:.0%} of the forward's {_flop_text(flops['all'])} of matmuls run in float32",
            modules=[""],
            data={"share": share},
        )
    ]


def dynamo_findings(report: DynamoReport | None) -> list[Finding]:
    if report is None:
        return []
    out = [
        Finding(kind="graph_break", location=f"({short(b.location)})", evidence=b.reason, data={"where": b.location})
        for b in report.breaks
    ]
    if report.error:
        out.append(Finding(kind="graph_break", location="(model)", evidence=f"Dynamo could not trace: {report.error}"))
    if report.recompiles:
        reasons = "; ".join(report.recompile_reasons[:3]) or "Dynamo recorded no reason"
        out.append(
            Finding(
                kind="recompile",
                location="(model)",
                evidence=f"{report.recompiles} recompile(s) over 3 identical calls: {reasons}",
                count=report.recompiles,
            )
        )
    return out


def launches(trace: Trace, profile: Profile | None, compiled: bool) -> list[Finding]:
    if profile is not None:
        if profile.kernels_per_step >= SMALL_KERNEL_COUNT and profile.busy < BUSY_SHARE:
            return [
                Finding(
                    kind="small_launches",
                    location="(model)",
                    evidence=f"{profile.kernels_per_step:,} kernels per step; the GPU is busy "
                    f"{profile.busy_ms:,.2f} ms of a {profile.wall_ms:,.2f} ms step ({profile.busy:.0%})",
                    data={"measured": True},
                )
            ]
        return []
    if not compiled and len(trace.ops) >= CPU_OP_COUNT:
        return [
            Finding(
                kind="small_launches",
                location="(model)",
                evidence=f"{len(trace.ops):,} PyTorch calls per forward (no GPU here: kernel count and "
                "busy time are measured on a GPU)",
                data={"measured": False},
            )
        ]
    return []


def detect_all(model, trace: Trace, model_loops, dynamo: DynamoReport | None, profile: Profile | None, compiled: bool):
    findings = []
    if not compiled:
        findings.append(
            Finding(
                kind="not_compiled",
                location="(model)",
                evidence=f"eager: {len(trace.ops):,} PyTorch calls per forward, each its own kernel(s)",
            )
        )
    findings += dynamo_findings(dynamo)
    findings += host_syncs(trace)
    findings += loops(trace, model_loops)
    attention = manual_attention(trace)
    findings += attention
    gated = unfused_activation(trace)
    findings += gated
    gate_up = {item[r] for f in gated for item in f.data.values() for r in ("gate", "up")}  # already a finding
    findings += separate_projections(trace, exclude=gate_up)
    findings += manual_norm(trace)
    findings += unfused_cross_entropy(trace, model)
    findings += fp32_compute(trace)
    findings += launches(trace, profile, compiled)
    return findings
