"""What torch.compile's front end (Dynamo) says about a model: graph breaks with their reasons and source lines,
and recompiles on repeated identical calls with the guard that failed.

Both run Dynamo with a backend that compiles nothing (the captured graph runs eagerly), so they cost one trace,
not an Inductor build.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Break:
    reason: str
    location: str  # file:line of the user code where the graph broke


@dataclass
class DynamoReport:
    graphs: int = 0  # graphs Dynamo captured for one call
    breaks: list[Break] = field(default_factory=list)
    recompiles: int = 0  # compilations after the first call, over calls with identical inputs
    recompile_reasons: list[str] = field(default_factory=list)
    error: str = ""  # why Dynamo could not run, if it could not

    @property
    def fullgraph(self) -> bool:
        return not self.error and self.graphs == 1 and not self.breaks


def _location(user_stack) -> str:
    if not user_stack:
        return "?"
    frame = user_stack[-1]
    return f"{frame.filename}:{frame.lineno}"


def explain(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> DynamoReport:
    """Graph breaks of ``model(*args, **kwargs)`` from ``torch._dynamo.explain``, deduplicated by reason and line."""
    kwargs = kwargs or {}
    torch._dynamo.reset()
    try:
        out = torch._dynamo.explain(model)(*args, **kwargs)
    except Exception as exc:  # a model Dynamo cannot trace at all is itself a finding
        return DynamoReport(error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    finally:
        torch._dynamo.reset()
    seen, breaks = set(), []
    for reason in out.break_reasons:
        text = " ".join(str(reason.reason).split()).split(" Explanation:")[0]  # the first sentence says it
        location = _location(getattr(reason, "user_stack", None))
        if (text, location) not in seen:
            seen.add((text, location))
            breaks.append(Break(text[:300], location))
    return DynamoReport(graphs=int(out.graph_count), breaks=breaks)


def recompiles(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, calls: int = 3) -> tuple[int, list]:
    """Compilations after the first of ``calls`` identical calls, and the guard failures Dynamo recorded."""
    kwargs = kwargs or {}
    compiled_graphs = []

    def counting_backend(gm, example_inputs):
        compiled_graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    failures = getattr(torch._dynamo.utils, "guard_failures", None)  # a dict in torch 2.x; absent: no reasons
    if failures is not None:
        failures.clear()
    try:
        compiled = torch.compile(model, backend=counting_backend)
        compiled(*args, **kwargs)
        first = len(compiled_graphs)
        for _ in range(calls - 1):
            compiled(*args, **kwargs)
        reasons = []
        if failures is not None:
            for code, items in failures.items():
                where = f"{getattr(code, 'co_filename', '?')}:{getattr(code, 'co_firstlineno', '?')}"
                reasons += [f"{where}: {' '.join(str(item).split())[:300]}" for item in items]
        return len(compiled_graphs) - first, reasons
    finally:
        torch._dynamo.reset()


def analyze(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> DynamoReport:
    report = explain(model, args, kwargs)
    if report.error:
        return report
    try:
        report.recompiles, report.recompile_reasons = recompiles(model, args, kwargs)
    except Exception as exc:
        report.error = f"recompile check failed: {type(exc).__name__}: {exc}"
    return report
