"""Results and the check-then-time loop: benchmark rows, CSV files and DataFrames, and :func:`sweep`, which checks
every implementation of an operation against a float64 reference and then times them over a list of shapes.

pandas and tqdm are imported inside the functions that need them."""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict

import torch

from .. import validate
from . import timing as _timing
from .machine import environment
from .timing import Timing, gbps, tflops


# --------------------------------------------------------------------------------------------------
# Results: rows, DataFrames, CSV
# --------------------------------------------------------------------------------------------------
def result_row(name: str, timing: Timing, *, nbytes: float | None = None, flops: float | None = None, **fields) -> dict:
    """One benchmark row: name, median and quantiles, GB/s and TFLOP/s where counted, and any extra fields."""
    row = {
        "name": name,
        **fields,
        "median_ms": timing.median_ms,
        "p20_ms": timing.p20_ms,
        "p80_ms": timing.p80_ms,
    }
    row["gbps"] = gbps(nbytes, timing.median_ms) if nbytes is not None else None
    row["tflops"] = tflops(flops, timing.median_ms) if flops is not None else None
    return row


def write_csv(rows: Sequence[dict], path: str | os.PathLike, env: dict | None = None) -> str:
    """Write ``rows`` to ``path`` (creating folders) with the environment in every row; return the path."""
    if not rows:
        raise ValueError("write_csv: no rows to write")
    env = env or environment()
    full = [{**row, **{k: v for k, v in env.items() if k not in row}} for row in rows]
    columns: list[str] = []
    for row in full:
        columns += [k for k in row if k not in columns]
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(full)
    return os.fspath(path)


def to_frame(rows: Sequence[dict]):
    """Rows as a pandas DataFrame."""
    import pandas as pd

    return pd.DataFrame(list(rows))


def timing_frame(timings: dict[str, Timing]):
    """A DataFrame of several Timings, one row each, in milliseconds."""
    rows = [{"name": k, **{f: v for f, v in asdict(t).items() if f != "samples_ms"}} for k, t in timings.items()]
    return to_frame(rows)


# --------------------------------------------------------------------------------------------------
# Check, then time: implementations of one operation over a list of shapes
# --------------------------------------------------------------------------------------------------
def _as_outputs(result) -> tuple:
    """A function's result as a tuple of tensors (a tensor alone, or the tensors of a tuple or list)."""
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (tuple, list)):
        return tuple(result)
    raise TypeError(f"sweep compares tensors or tuples of tensors, got {type(result).__name__}")


def _float64(value):
    """A float64 copy of a floating-point tensor (keeping requires_grad, as a fresh leaf); anything else as is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float64).requires_grad_(value.requires_grad)
    return value


def progress(iterable, **kwargs):
    """``iterable`` behind a ``tqdm.auto`` bar (a widget in a notebook, text in a terminal); bare without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress bars are a nicety
        return iterable
    return tqdm(iterable, **kwargs)


def _progress(items: list, desc: str, show: bool):
    return progress(items, desc=desc, leave=False) if show else items


def sweep(
    implementations: dict[str, Callable[..., object]],
    cases: Iterable[dict],
    make_inputs: Callable[..., Sequence],
    reference: Callable[..., object],
    *,
    baseline: str | None = None,
    nbytes: Callable[..., float] | None = None,
    flops: Callable[..., float] | None = None,
    name: str = "",
    factor: float = 2.0,
    atol: float = 1e-6,
    rtol: float = 0.0,
    progress: bool = True,
    **timing_kwargs,
):
    """Check every implementation against a float64 reference, then time it, for each case: a DataFrame.

    Each case is a dict of shape parameters, e.g. ``{"rows": 32768, "D": 4096}``. For each one in turn:

    1. ``make_inputs(**case)`` builds the inputs (a sequence of tensors and other arguments);
    2. ``reference`` runs on float64 copies of the floating-point inputs (the truth; a copy keeps
       ``requires_grad``, so a reference may differentiate) and on the inputs as given (PyTorch's own rounding);
    3. every implementation runs on the inputs and is compared, output by output (a tensor or a tuple of
       tensors), by :func:`kernel_lib.validate.check` with ``factor``, ``atol`` and ``rtol``. A failure raises
       AssertionError naming the implementation and the case, before any implementation of that case is timed;
    4. :func:`~kernel_lib.bench.timing.time_fn` times each implementation (``timing_kwargs``: ``warmup_ms``,
       ``rep_ms``, ``flush_l2``, ``device``, which defaults to the device of the first tensor input), then checks
       one more call the same way (a kernel that goes wrong only after many calls, racing or reading a stale
       buffer, raises AssertionError too).

    One row per (case, implementation), in that order: ``name``, the case's parameters, ``impl``, ``median_ms``,
    ``p20_ms``, ``p80_ms``, ``gbps`` and ``tflops`` (counted by ``nbytes(**case)`` and ``flops(**case)``, else
    None), ``max_abs_err`` (the largest over the outputs) and ``ratio_to_baseline``: this row's median over the
    ``baseline`` implementation's median in the same case (2.0: twice the baseline's time; with your kernel as
    the baseline, that is your kernel's speed-up over this row), None without a baseline. A progress bar over
    the cases is shown when tqdm is installed (``progress=False`` hides it).
    """
    if baseline is not None and baseline not in implementations:
        raise ValueError(f"baseline {baseline!r} is not one of the implementations {list(implementations)}")
    cases = list(cases)
    rows = []
    for case in _progress(cases, name or "sweep", progress):
        inputs = list(make_inputs(**case))
        want = _as_outputs(reference(*[_float64(value) for value in inputs]))
        torch_lowp = _as_outputs(reference(*inputs))
        checked = dict(want=want, torch_lowp=torch_lowp, factor=factor, atol=atol, rtol=rtol)
        where = {impl: f"{name + ': ' if name else ''}{impl} at {case}" for impl in implementations}
        errors = {}
        for impl, fn in implementations.items():
            errors[impl] = _checked(fn(*inputs), where[impl], "before timing (it was not timed)", **checked)
        device = timing_kwargs.get("device") or next((v.device for v in inputs if isinstance(v, torch.Tensor)), None)
        timing_args = {**timing_kwargs, "device": device}
        case_rows = []
        for impl, fn in implementations.items():
            timing = _timing.time_fn(lambda fn=fn, inputs=inputs: fn(*inputs), **timing_args)
            # a race or a stale buffer shows only on a later call
            errors[impl] = max(errors[impl], _checked(fn(*inputs), where[impl], "after timing it", **checked))
            row = result_row(
                name,
                timing,
                nbytes=nbytes(**case) if nbytes is not None else None,
                flops=flops(**case) if flops is not None else None,
                **case,
                impl=impl,
            )
            case_rows.append({**row, "max_abs_err": errors[impl]})
        base_ms = next((r["median_ms"] for r in case_rows if r["impl"] == baseline), None)
        for row in case_rows:
            row["ratio_to_baseline"] = row["median_ms"] / base_ms if base_ms else None
        rows += case_rows
    return to_frame(rows)


def _checked(result, where: str, when: str, want, torch_lowp, factor, atol, rtol) -> float:
    """The largest error of ``result``'s outputs against ``want`` (float64); AssertionError when one fails."""
    got = _as_outputs(result)
    if len(got) != len(want):
        raise AssertionError(f"{where}: {len(got)} outputs, the reference has {len(want)}")
    worst = 0.0
    for i, (out, ref, base) in enumerate(zip(got, want, torch_lowp, strict=True)):
        label = where if len(want) == 1 else f"{where}, output {i}"
        verdict = validate.check(out, ref, base, name=label, factor=factor, atol=atol, rtol=rtol)
        if not verdict.ok:
            raise AssertionError(f"sweep found a wrong result {when}: {verdict}")
        worst = max(worst, verdict.kernel.max_abs)
    return worst
