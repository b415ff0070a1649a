"""Timing that can be trusted, the machine's ceilings, and the tables and plots built from them.

Every number in the course goes through :func:`time_fn`:

* GPU: warm-up, then CUDA events around each call through ``triton.testing.do_bench``, which also wipes
  the L2 cache before every call so that a working set smaller than L2 is not timed from cache.
  ``flush_l2=False`` times the same way without the wipe, to show what the cache does.
* CPU: a ``time.perf_counter`` loop with the same warm-up/median structure (the numbers are CPU numbers).

Results carry the median and the 20th/80th percentiles. :func:`measure_ceilings` measures the two
roofs every throughput is compared with: device-to-device copy bandwidth (bytes read + bytes written)
and dense matmul TFLOP/s per dtype. :func:`environment` records GPU, torch and triton versions and the
time, and every CSV row written here carries them.

pandas, matplotlib and tqdm are imported inside the functions that need them, so kernel files that
import nothing from here stay copyable without them.
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

QUANTILES = (0.5, 0.2, 0.8)


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """Times of one function, in milliseconds."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    samples_ms: list[float] = field(repr=False, default_factory=list)
    timer: str = "cuda-events"  # "cuda-events" or "cpu-perf-counter"
    flushed_l2: bool = True

    @property
    def spread(self) -> float:
        """(p80 - p20) / median: how much the runs disagree."""
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else float("nan")


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of already sorted values."""
    if not sorted_values:
        raise ValueError("no samples to take a quantile of")
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _timing_from_samples(samples: list[float], timer: str, flushed: bool) -> Timing:
    ordered = sorted(samples)
    return Timing(
        median_ms=statistics.median(ordered),
        p20_ms=_quantile(ordered, 0.2),
        p80_ms=_quantile(ordered, 0.8),
        samples_ms=samples,
        timer=timer,
        flushed_l2=flushed,
    )


def _cuda_event_samples(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> list[float]:
    """CUDA-event times of ``fn`` with no cache wipe between calls (the L2 stays warm)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-4)
    n_warmup = max(1, int(warmup_ms / estimate_ms))
    n_rep = max(5, int(rep_ms / estimate_ms))
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def _do_bench_samples(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> list[float]:
    """CUDA-event times of ``fn`` from ``triton.testing.do_bench`` (L2 wiped before every call)."""
    from triton.testing import do_bench

    try:
        samples = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    except (TypeError, ValueError, AssertionError):  # triton without return_mode="all"
        samples = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES))
    if isinstance(samples, (int, float)):
        samples = [float(samples)]
    return [float(s) for s in samples]


def _cpu_samples(fn: Callable[[], object], warmup_ms: float, rep_ms: float, max_reps: int = 1000) -> list[float]:
    """Host-clock times of ``fn`` on the CPU: warm up for ``warmup_ms``, then time single calls."""
    deadline = time.perf_counter() + warmup_ms / 1e3
    fn()
    while time.perf_counter() < deadline:
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < max_reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def time_fn(
    fn: Callable[[], object],
    *,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    flush_l2: bool = True,
    device: str | torch.device | None = None,
) -> Timing:
    """Time ``fn()``: median and quantiles of many calls after a warm-up.

    ``device`` says where ``fn`` runs; by default CUDA when available, else CPU. On CUDA the L2 cache is
    wiped before each call unless ``flush_l2=False``. On the CPU the timer is ``time.perf_counter``.
    """
    device_type = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda":
        if flush_l2:
            return _timing_from_samples(_do_bench_samples(fn, warmup_ms, rep_ms), "cuda-events", True)
        return _timing_from_samples(_cuda_event_samples(fn, warmup_ms, rep_ms), "cuda-events", False)
    if device_type == "cpu":
        return _timing_from_samples(_cpu_samples(fn, warmup_ms, rep_ms), "cpu-perf-counter", False)
    raise ValueError(f"device must be cuda or cpu, got {device_type}")


def repeat_in_graph(
    fn: Callable[[], object], repeats: int, device: str | torch.device | None = None
) -> Callable[[], None]:
    """A callable that runs ``fn`` ``repeats`` times back to back with no launch overhead between them.

    On a GPU the calls are captured once into a CUDA graph (after a warm-up on a side stream, as capture
    requires) and the callable replays it; time it and divide by ``repeats`` to time kernels too short to
    time one by one. ``fn`` must not synchronize or allocate differently between calls. On the CPU the
    callable is a plain loop.
    """
    device_type = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if device_type != "cuda":

        def loop() -> None:
            for _ in range(repeats):
                fn()

        return loop
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    return graph.replay


def gbps(nbytes: float, ms: float) -> float:
    """Throughput in GB/s (1e9 bytes per second) of moving ``nbytes`` in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops: float, ms: float) -> float:
    """Throughput in TFLOP/s (1e12 operations per second) of ``flops`` in ``ms`` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------------------------------
# The machine: environment and ceilings
# --------------------------------------------------------------------------------------------------
def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "not installed"


def device_name(device: str | torch.device | None = None) -> str:
    """'NVIDIA H100 80GB HBM3' for a GPU, the processor's name for the CPU."""
    device_type = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda":
        return torch.cuda.get_device_name(torch.device(device) if device is not None else None)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def environment(device: str | torch.device | None = None) -> dict[str, str]:
    """What every measurement must be reported with: device, versions, and when."""
    info = {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return info


def l2_cache_bytes(device: int = 0) -> int | None:
    """The GPU's L2 cache size in bytes, or None when unknown (e.g. no GPU)."""
    if not torch.cuda.is_available():
        return None
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def copy_bandwidth(nbytes: int | None = None, device: str | None = None, **timing_kwargs) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.

    ``nbytes`` is the size of one buffer (default 1 GiB on a GPU, far beyond any L2; 64 MiB on the CPU).
    """
    device = device or _default_device()
    if nbytes is None:
        nbytes = 2**30 if device.startswith("cuda") else 2**26
    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    timing = time_fn(lambda: dst.copy_(src), device=device, **timing_kwargs)
    if not torch.equal(dst, src):
        raise RuntimeError("copy_bandwidth: the copy is wrong; refusing to report its speed")
    return gbps(2 * n * 4, timing.median_ms)


def peak_memory_bytes(fn: Callable[[], object], device: str | torch.device | None = None) -> int:
    """Peak CUDA memory ``fn()`` allocates above what was allocated when it started, in bytes.

    What a step costs in memory beyond its inputs: activations, temporaries, gradients. CUDA only (the CPU
    allocator keeps no such statistics).
    """
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda":
        raise ValueError(f"peak_memory_bytes measures CUDA memory; got device {device}")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def matmul_tflops(
    dtype: torch.dtype = torch.bfloat16, n: int | None = None, device: str | None = None, **timing_kwargs
) -> float:
    """Dense n×n×n matmul throughput in TFLOP/s (2·n³ operations) through PyTorch (cuBLAS on a GPU).

    ``torch.float32`` is measured in strict fp32; pass the string ``"tf32"`` for the tensor-core mode.
    """
    device = device or _default_device()
    if n is None:
        n = 8192 if device.startswith("cuda") else 512
    use_tf32 = dtype == "tf32"
    torch_dtype = torch.float32 if use_tf32 else dtype
    a = torch.randn(n, n, device=device, dtype=torch_dtype)
    b = torch.randn(n, n, device=device, dtype=torch_dtype)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if use_tf32 else "highest")
    try:
        timing = time_fn(lambda: a @ b, device=device, **timing_kwargs)
        # The timed product must be a real one: check a few entries against float64.
        rows = torch.randint(0, n, (4,), device=device)
        got = (a[rows] @ b).double()
        want = a[rows].double() @ b.double()
        rel = ((got - want).norm() / want.norm()).item()
        if not rel < 5e-2:
            raise RuntimeError(f"matmul_tflops: product off by {rel:.2e} relative; refusing to report its speed")
    finally:
        torch.set_float32_matmul_precision(previous)
    return tflops(2 * n**3, timing.median_ms)


@dataclass
class Ceilings:
    """The roofs of one machine, measured in one run."""

    device: str
    copy_gbps: float
    matmul_tflops: dict[str, float]

    def rows(self) -> list[dict]:
        out = [{"ceiling": "copy (read + write)", "value": self.copy_gbps, "unit": "GB/s"}]
        out += [{"ceiling": f"matmul {k}", "value": v, "unit": "TFLOP/s"} for k, v in self.matmul_tflops.items()]
        return out


def measure_ceilings(
    device: str | None = None,
    dtypes: Iterable = (torch.bfloat16, torch.float16, "tf32", torch.float32),
    matmul_n: int | None = None,
) -> Ceilings:
    """Measure copy bandwidth and matmul TFLOP/s for each dtype on ``device``."""
    device = device or _default_device()
    peaks = {}
    for dtype in dtypes:
        if device == "cpu" and dtype in (torch.float16, "tf32"):
            continue  # no tensor cores, and fp16 matmul on CPU measures an emulation, not a ceiling
        name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
        peaks[name] = matmul_tflops(dtype, n=matmul_n, device=device)
    return Ceilings(device=device_name(device), copy_gbps=copy_bandwidth(device=device), matmul_tflops=peaks)


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
# Plots
# --------------------------------------------------------------------------------------------------
def _axes(ax):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(7, 4), dpi=90)
    return ax


def plot_throughput(
    frame,
    x: str,
    y: str,
    by: str,
    *,
    ceiling: float | None = None,
    ceiling_label: str = "measured ceiling",
    ax=None,
    logx: bool = True,
    xlabel: str | None = None,
    ylabel: str | None = None,
    title: str | None = None,
):
    """Lines of ``y`` against ``x`` for each value of ``by``, with the measured ceiling drawn."""
    ax = _axes(ax)
    for key, group in frame.groupby(by, sort=False):
        group = group.sort_values(x)
        ax.plot(group[x], group[y], marker="o", ms=3, label=str(key))
    if ceiling is not None:
        ax.axhline(ceiling, color="black", ls="--", lw=1)
        ax.annotate(
            f"{ceiling_label}: {ceiling:,.0f}",
            (0.01, ceiling),
            xycoords=("axes fraction", "data"),
            va="bottom",
            fontsize=8,
        )
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_roofline(
    points: Sequence[dict],
    *,
    peak_tflops: float,
    peak_gbps: float,
    ax=None,
    title: str | None = None,
):
    """A roofline: min(peak_tflops, intensity × bandwidth) with measured points on it.

    Each point is a dict with ``name``, ``intensity`` (FLOP per byte moved) and ``tflops`` (achieved).
    """
    import numpy as np

    ax = _axes(ax)
    intensities = [p["intensity"] for p in points]
    lo = min(min(intensities) / 2, 0.05)
    hi = max(max(intensities) * 2, 4 * peak_tflops * 1e3 / peak_gbps)
    xs = np.logspace(np.log10(lo), np.log10(hi), 200)
    roof = np.minimum(peak_tflops, xs * peak_gbps / 1e3)
    ax.plot(xs, roof, color="black", lw=1.5, label="roofline (measured)")
    ridge = peak_tflops * 1e3 / peak_gbps
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak_tflops / 30), rotation=90, fontsize=8, ha="right")
    for key in dict.fromkeys(p.get("group", p["name"]) for p in points):
        group = [p for p in points if p.get("group", p["name"]) == key]
        ax.scatter([p["intensity"] for p in group], [p["tflops"] for p in group], s=18, label=key, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("TFLOP/s")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    return ax


def plot_speedup(
    labels: Sequence[str],
    speedups: Sequence[float],
    *,
    ax=None,
    title: str | None = None,
    baseline: str = "baseline",
):
    """Horizontal bars of speed-up over ``baseline`` (1.0 drawn as a line)."""
    ax = _axes(ax)
    bars = ax.barh(list(labels), list(speedups), color="tab:blue")
    ax.axvline(1.0, color="black", lw=1)
    for bar, value in zip(bars, speedups, strict=True):
        ax.annotate(
            f"{value:.2f}×",
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            va="center",
            fontsize=8,
            xytext=(3, 0),
            textcoords="offset points",
        )
    ax.set_xlabel(f"speed-up over {baseline}")
    if title:
        ax.set_title(title)
    ax.invert_yaxis()
    return ax


# --------------------------------------------------------------------------------------------------
# Notebooks: hand a measured number to the book's prose
# --------------------------------------------------------------------------------------------------
def glue(name: str, value, display: bool = False) -> None:
    """Store ``value`` in the running notebook's outputs under ``name``.

    The book's prose quotes it with MyST-NB's role ``{glue:text}`name:,.0f``` (from another page:
    ``{glue:text}`path/to/notebook.ipynb::name:,.0f```), so a number in a sentence is always the number
    the executed cell measured. This writes the scrapbook record that ``myst_nb.glue`` writes, without
    needing myst-nb in the kernel's environment; outside IPython it does nothing.
    """
    try:
        from IPython import get_ipython
        from IPython.core.formatters import format_display_data
        from IPython.display import display as ipy_display
    except ImportError:
        return
    if get_ipython() is None:
        return
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy / torch scalar: store the plain number
        value = value.item()
    bundle, metadata = format_display_data(value)
    prefix = "" if display else "application/papermill.record/"
    metadata["scrapbook"] = {"name": name, "mime_prefix": prefix}
    ipy_display({prefix + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)
