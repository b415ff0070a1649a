"""The optimization assistant: find what slows a PyTorch model down, apply the course's fixes, prove each one.

    from kernel_lib.assistant import CompilerOptimizationAssistant
    result = CompilerOptimizationAssistant().optimize_model(model, (idx, targets))
    result                      # the report (HTML in a notebook); result.optimized_model is the fast model

Modules, one job each: ``findings`` (the table of finding kinds), ``trace`` (record a forward's calls and data
flow), ``source`` (loops in forward methods), ``dynamo`` (graph breaks, recompiles), ``measure`` (step time,
memory, profile), ``detect`` (findings from those), ``rewrites`` (the automatic fixes), ``pipeline`` (the loop:
find, measure each fix alone, combine, validate), ``report`` (the result: tables, text, HTML, JSON, waterfall),
``plan`` (what was kept, saved and applied again), ``by_hand`` (a module rewrite as a diff of the model's
source), ``widgets`` (the notebook form), ``__main__`` (the command
line: ``python -m kernel_lib.assistant --help``).
"""

from .findings import KINDS, Finding, kinds_table
from .pipeline import CompilerOptimizationAssistant, split_inputs
from .plan import apply_plan, load_plan, save_plan
from .report import Opportunity, OptimizationResult

__all__ = [
    "CompilerOptimizationAssistant",
    "KINDS",
    "Finding",
    "OptimizationResult",
    "Opportunity",
    "apply_plan",
    "load_plan",
    "save_plan",
    "kinds_table",
    "split_inputs",
]
