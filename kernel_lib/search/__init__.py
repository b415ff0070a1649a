"""Monte Carlo graph search over kernel variants: the tool a reader runs on their own Triton or CUDA kernel.

    python -m kernel_lib.search --input specs/rms_norm.json --outdir out --budget 50
    python -m kernel_lib.search --help

or from Python::

    from kernel_lib.search import optimize
    result = optimize("specs/rms_norm.json", budget=50)
    result.to_dataframe()

Modules, one job each: ``spec`` (the kernel spec and its validation), ``contract`` (inputs, references, tensors on
disk), ``variant`` (a node: source + launch), ``moves`` (canonical moves and rule generators), ``graph`` (PUCT,
widening, backpropagation), ``mcts`` (the search loop and ``optimize``), ``worker`` and ``runners`` (one evaluation),
``pool`` (worker processes), ``llm`` (language-model moves), ``prior`` (Nsight Compute bottlenecks, the tactic
graph), ``store`` (the files a run leaves), ``strategies`` (exhaustive, random and pattern search to compare with).
"""

__all__ = ["KernelSpec", "SearchResult", "Settings", "SpecError", "find_specs", "load_spec", "optimize"]

_WHERE = {"SearchResult": "mcts", "Settings": "mcts", "optimize": "mcts"}


def __getattr__(name: str):
    # Imported on first use, so `python -m kernel_lib.search` can say in one line what is missing (pydantic...).
    if name not in __all__:
        raise AttributeError(f"module 'kernel_lib.search' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_WHERE.get(name, 'spec')}", __name__), name)
