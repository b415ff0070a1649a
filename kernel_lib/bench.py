"""Timing that can be trusted, the machine's ceilings, and the tables and plots built from them.

Every number in the course goes through :func:`time_fn`:

* GPU: warm-up, then CUDA events around each call through ``triton.testing.do_bench``, which also wipes
  the L2 cache before every call so that a working set smaller than L2 is not timed from cache.
  ``flush_l2=False`` times the same way without the wipe, to show what the cache does.
* CPU: a ``time.perf_counter`` loop with the same warm-up/median structure (the numbers are CPU numbers).

Results carry the median and the 20th/80th percentiles. Two other clocks: :func:`host_ms`, what the host
pays to issue one call (Python, dispatch, launches), and :func:`graph_ms`, the GPU time of one call replayed
from a CUDA graph (no host work between kernels). :func:`sweep` checks every implementation of an operation
against a float64 reference and then times them over a list of shapes, as a DataFrame.

:func:`measure_ceilings` measures the two roofs every throughput is compared with: device-to-device copy
bandwidth (bytes read + bytes written) and dense matmul TFLOP/s per dtype. :func:`environment` records GPU,
torch and triton versions and the time, and every CSV row written here carries them. The last section holds
the workloads the notebooks and the benchmark scripts share (MoE routing, the per-expert loop, attention's
visible pairs), so that both measure the same thing.

pandas, matplotlib and tqdm are imported inside the functions that need them, so kernel files that
import nothing from here stay copyable without them.
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from . import validate

QUANTILES = (0.5, 0.2, 0.8)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_type(device: str | torch.device | None) -> str:
    """'cuda' or 'cpu' (or whatever ``device`` names); by default CUDA when available."""
    return torch.device(device).type if device is not None else _default_device()


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
    device_type = _device_type(device)
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
    device_type = _device_type(device)
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


def host_ms(
    fn: Callable[[], object], reps: int = 200, warmup: int = 10, device: str | torch.device | None = None
) -> float:
    """Host time of one call of ``fn``, in ms: the median wall time of ``reps`` calls issued one at a time.

    What a Python caller pays to issue the call (Python, PyTorch's dispatcher, autograd's bookkeeping, kernel
    launches): the host's time, not the GPU's. ``warmup`` calls come first (compiling, autotuning). On a GPU the
    device is drained after each call, outside the timed region, so that every timed call starts with an empty
    launch queue: were the queue to fill (a step whose kernels take longer than the host needs to issue them),
    the host would wait for the GPU and the timer would measure the GPU instead. No synchronization sits inside
    the timed region. The median, not the mean: a few calls slowed by the operating system move a mean.
    On the CPU (``device="cpu"``, or no GPU) the same loop times calls that do their work on the host.
    """
    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    sync = torch.cuda.synchronize if _device_type(device) == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        sync()
    return 1e3 * statistics.median(samples)


def graph_ms(
    fn: Callable[[], object], repeats: int = 5, device: str | torch.device | None = None, **timing_kwargs
) -> float:
    """GPU time of one call of ``fn``, in ms, with the host out of the way: replayed from a CUDA graph.

    :func:`repeat_in_graph` captures ``repeats`` back-to-back calls (after a warm-up on a side stream) and
    :func:`time_fn` times the replay (``timing_kwargs``: ``warmup_ms``, ``rep_ms``, ``flush_l2``); the median is
    divided by ``repeats``. ``fn`` must be capturable: no synchronization, no host reads of device values. On
    the CPU the "graph" is a plain loop, so the result is the loop's time per call.
    """
    replay = repeat_in_graph(fn, repeats, device=device)
    return time_fn(replay, device=device, **timing_kwargs).median_ms / repeats


@dataclass
class StepCost:
    """What one training (or inference) step costs: :func:`step_cost`'s result."""

    ms: float  # median step time
    spread: float  # (p80 - p20) / median
    first_ms: float  # the first call alone: compilation, CUDA-graph capture, autotuning, optimizer states
    peak_bytes: float  # peak allocated above what was allocated before the first call (nan on the CPU)
    timer: str = "cuda-events"

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / 2**30


def step_cost(step: Callable[[], object], device=None, warmup_ms: float = 100, rep_ms: float = 500) -> StepCost:
    """Time a whole step (:func:`time_fn`, median, no L2 wipe: a step reads far more than the L2 holds) after
    timing its first call alone, and read its peak memory.

    The peak is CUDA's max_memory_allocated over the first call and the timed ones, minus what was allocated before
    the first call (weights, inputs): gradients, optimizer states, activations, temporaries and, under CUDA graphs,
    their memory pool. The first call counts because a graph's pool is allocated while it is captured.
    """
    device = torch.device(device) if device is not None else torch.device(_default_device())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize(device)
    first_ms = (time.perf_counter() - start) * 1e3
    timing = time_fn(step, warmup_ms=warmup_ms, rep_ms=rep_ms, flush_l2=False, device=device.type)
    peak = float(torch.cuda.max_memory_allocated(device) - base) if cuda else math.nan
    return StepCost(timing.median_ms, timing.spread, first_ms, peak, timing.timer)


@dataclass
class KernelProfile:
    """Where a step's time goes: :func:`profile_kernels`' result."""

    by_name: dict[str, tuple[float, int]]  # kernel (GPU) or operator (CPU) -> (ms per step, calls per step)
    busy_ms: float  # GPU time in kernels per step (nan on the CPU)
    wall_ms: float  # host time per step, under the profiler
    kernels_per_step: int
    clock: str  # "gpu kernels" or "cpu operators (self time)"

    @property
    def busy(self) -> float:
        """Share of the step the GPU spends running kernels (1.0: it never waits for the host)."""
        return self.busy_ms / self.wall_ms if self.wall_ms > 0 else math.nan

    @property
    def top(self) -> list[tuple[str, float, int]]:
        """(name, ms per step, calls per step), the most expensive first."""
        return sorted(((n, ms, c) for n, (ms, c) in self.by_name.items()), key=lambda row: -row[1])


def profile_kernels(step: Callable[[], object], device=None, steps: int = 3) -> KernelProfile:
    """Profile ``steps`` calls of ``step`` with torch.profiler, after one untimed call.

    On a GPU each kernel's own span counts, so ``busy_ms`` is the time the GPU ran kernels and ``wall_ms - busy_ms``
    the time it waited (for the host, mostly). The profiler adds host time per operator, so ``wall_ms`` is longer
    than a step timed without it. On the CPU there are no kernels: the operators' self time stands in.
    """
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device) if device is not None else torch.device(_default_device())
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    spans: dict[str, list[float]] = {}
    if cuda:
        for event in prof.events():
            if getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA:
                spans.setdefault(event.name, []).append(event.time_range.elapsed_us())  # the kernel's own span
    else:
        for event in prof.key_averages():
            if event.self_cpu_time_total > 0:
                spans[event.key] = [event.self_cpu_time_total] + [0.0] * (event.count - 1)
    by_name = {name: (sum(v) / 1e3 / steps, len(v) // steps) for name, v in spans.items()}
    busy = sum(ms for ms, _ in by_name.values()) if cuda else math.nan
    count = sum(len(v) for v in spans.values()) // steps
    return KernelProfile(by_name, busy, wall_ms, count, "gpu kernels" if cuda else "cpu operators (self time)")


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
    device_type = _device_type(device)
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


def full_sizes() -> bool:
    """Whether a notebook runs its full, published problem sizes: on a CUDA GPU, unless ``KERNEL_COURSE_SIZES=small``.

    ``make test-gpu`` sets it for its pass over the notebooks: every kernel, check and plot runs on the GPU at the
    sizes the CPU uses, which proves the notebooks work in minutes but times nothing worth reading. ``make execute``
    leaves it unset and stores the full runs the book shows.
    """
    size = os.environ.get("KERNEL_COURSE_SIZES", "full")
    if size not in ("full", "small"):
        raise ValueError(f"KERNEL_COURSE_SIZES must be 'full' or 'small', got {size!r}")
    return torch.cuda.is_available() and size == "full"


def require_gpu(script: str) -> dict[str, str]:
    """For benchmark scripts: exit with one line without a CUDA GPU; else print and return :func:`environment`."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    env = environment()
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']}", flush=True)
    return env


def l2_cache_bytes(device: int = 0) -> int | None:
    """The GPU's L2 cache size in bytes, or None when unknown (e.g. no GPU)."""
    if not torch.cuda.is_available():
        return None
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)


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


def show_source(obj) -> None:
    """Print the source of a function or of a Triton kernel (jitted, autotuned or interpreted)."""
    import inspect

    while hasattr(obj, "fn"):  # autotuner -> jit function -> Python function
        obj = obj.fn
    print(inspect.getsource(obj))


def sync(device: str | torch.device | None = None) -> None:
    """Wait for everything queued on ``device`` (the default CUDA device; nothing to wait for on the CPU)."""
    if _device_type(device) == "cuda":
        torch.cuda.synchronize(device)


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
    4. :func:`time_fn` times each implementation (``timing_kwargs``: ``warmup_ms``, ``rep_ms``, ``flush_l2``,
       ``device``, which defaults to the device of the first tensor input).

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
        errors = {}
        for impl, fn in implementations.items():
            got = _as_outputs(fn(*inputs))
            where = f"{name + ': ' if name else ''}{impl} at {case}"
            if len(got) != len(want):
                raise AssertionError(f"{where}: {len(got)} outputs, the reference has {len(want)}")
            errors[impl] = 0.0
            for i, (out, ref, base) in enumerate(zip(got, want, torch_lowp, strict=True)):
                label = where if len(want) == 1 else f"{where}, output {i}"
                verdict = validate.check(out, ref, base, name=label, factor=factor, atol=atol, rtol=rtol)
                if not verdict.ok:
                    raise AssertionError(f"sweep refuses to time a wrong result: {verdict}")
                errors[impl] = max(errors[impl], verdict.kernel.max_abs)
        del want, torch_lowp
        device = timing_kwargs.get("device") or next((v.device for v in inputs if isinstance(v, torch.Tensor)), None)
        timing_args = {**timing_kwargs, "device": device}
        case_rows = []
        for impl, fn in implementations.items():
            timing = time_fn(lambda fn=fn, inputs=inputs: fn(*inputs), **timing_args)
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


# --------------------------------------------------------------------------------------------------
# Plots and tables: one style for the whole book
# --------------------------------------------------------------------------------------------------
# One colour per implementation, the same on every page; matched on the lowercased label, first hit wins.
PALETTE = (
    ("ceiling", "black"),
    ("kernel_lib", "#d62728"),  # ours: red everywhere
    ("ours", "#d62728"),
    ("triton", "#d62728"),
    ("cuda", "#9467bd"),
    ("compile", "#1f77b4"),
    ("inductor", "#1f77b4"),
    ("liger", "#2ca02c"),
    ("flash", "#ff7f0e"),
    ("fa2", "#ff7f0e"),
    ("sdpa", "#8c564b"),
    ("hf", "#e377c2"),
    ("hugging", "#e377c2"),
    ("naive", "#7f7f7f"),
    ("eager", "#17becf"),
    ("torch", "#17becf"),
    ("pytorch", "#17becf"),
)
_SPARE = ("#bcbd22", "#8c564b", "#e377c2", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5")
STYLE = {
    "figure.dpi": 90,
    "savefig.dpi": 90,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "figure.constrained_layout.use": True,
}


def color(label: str) -> str:
    """The book's colour for an implementation, from its label (kernel_lib red, torch.compile blue, ...)."""
    low = str(label).lower()
    for key, value in PALETTE:
        if key in low:
            return value
    return _SPARE[sum(map(ord, low)) % len(_SPARE)]  # stable across processes, unlike hash()


def use_style() -> None:
    """Set matplotlib's defaults to the book's: readable font sizes, a light grid, room for outside legends."""
    import matplotlib as mpl

    mpl.rcParams.update(STYLE)


def legend_outside(ax, **kwargs):
    """The legend to the right of the axes, where it covers no data."""
    kwargs.setdefault("loc", "upper left")
    kwargs.setdefault("bbox_to_anchor", (1.01, 1.0))
    kwargs.setdefault("borderaxespad", 0.0)
    kwargs.setdefault("frameon", False)
    return ax.legend(**kwargs)


def draw_ceiling(ax, value: float, label: str = "measured ceiling", unit: str = "", horizontal: bool = True):
    """A labelled dashed line at a measured ceiling.

    A ceiling is a reference measured in the same run (the best simple copy, the best large matmul), not a law:
    a kernel that moves the same bytes with another access pattern, or timing noise of 1-3%, can pass it.
    """
    text = f"{label}: {value:,.0f}{(' ' + unit) if unit else ''}"
    if horizontal:
        ax.axhline(value, color="black", ls="--", lw=1, zorder=1)
        ax.annotate(text, (0.01, value), xycoords=("axes fraction", "data"), va="bottom", fontsize=8)
    else:
        ax.axvline(value, color="black", ls="--", lw=1, zorder=1)
        ax.annotate(text, (value, 0.01), xycoords=("data", "axes fraction"), rotation=90, ha="right", fontsize=8)


def _axes(ax):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    use_style()
    _, ax = plt.subplots(figsize=(7.5, 4))
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
    """Lines of ``y`` against ``x`` for each value of ``by``, with the measured ceiling drawn and labelled."""
    ax = _axes(ax)
    for key, group in frame.groupby(by, sort=False):
        group = group.sort_values(x)
        ours = "kernel_lib" in str(key).lower()
        # ours on top and a touch wider, so a peer with the same numbers cannot hide it
        ax.plot(group[x], group[y], marker="o", ms=3, lw=2.0 if ours else 1.4, zorder=3 if ours else 2,
                color=color(key), label=str(key))  # fmt: skip
    if ceiling is not None:
        draw_ceiling(ax, ceiling, ceiling_label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel or y)
    if title:
        ax.set_title(title)
    legend_outside(ax)
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
    ax.plot(xs, roof, color="black", lw=1.5, label="roofline (measured ceilings)")
    ridge = peak_tflops * 1e3 / peak_gbps
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak_tflops / 30), rotation=90, fontsize=8, ha="right")
    for key in dict.fromkeys(p.get("group", p["name"]) for p in points):
        group = [p for p in points if p.get("group", p["name"]) == key]
        xs_, ys_ = [p["intensity"] for p in group], [p["tflops"] for p in group]
        ax.scatter(xs_, ys_, s=18, label=key, zorder=3, color=color(key))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of memory traffic)")
    ax.set_ylabel("TFLOP/s")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    legend_outside(ax)
    return ax


def plot_speedup(
    labels: Sequence[str],
    speedups: Sequence[float],
    *,
    ax=None,
    title: str | None = None,
    baseline: str = "baseline",
):
    """Horizontal bars of speed-up over ``baseline`` (1.0 drawn as a line), each bar in its implementation's colour."""
    ax = _axes(ax)
    bars = ax.barh(list(labels), list(speedups), color=[color(label) for label in labels])
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


def _format_cell(value, fmt: str | None) -> str:
    """One table cell as text: "—" for a missing value, thousands separators, no trailing noise digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if fmt is not None:
        return format(value, fmt)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return f"{int(value):,}"
    if isinstance(value, float):
        mag = abs(value)
        if mag >= 100:
            return f"{value:,.0f}"
        if mag >= 10:
            return f"{value:.1f}"
        if mag >= 0.01 or mag == 0:
            return f"{value:.2f}"
        return f"{value:.2e}"
    return str(value)


@dataclass
class Table:
    """A formatted table: HTML in a notebook (so the book wraps nothing), aligned text elsewhere."""

    columns: list[str]
    rows: list[list[str]]
    caption: str | None = None

    def __repr__(self) -> str:
        widths = [
            max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c) for i, c in enumerate(self.columns)
        ]
        lines = ["  ".join(c.ljust(w) for c, w in zip(self.columns, widths, strict=True))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in self.rows]
        return "\n".join(([self.caption] if self.caption else []) + lines)

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f'<td style="text-align:right">{html.escape(v)}</td>' for v in r) + "</tr>"
            for r in self.rows
        )
        cap = f"<caption>{html.escape(self.caption)}</caption>" if self.caption else ""
        return f'<table class="kernel-course-table">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def table(
    data, columns: Sequence[str] | None = None, formats: dict[str, str] | None = None, caption: str | None = None
):
    """The columns a text needs from a DataFrame or a list of dicts, numbers formatted for reading.

    ``columns`` picks and orders them (``{"old name": "shown name"}`` renames); ``formats`` maps a column to a
    format spec (``{"GB/s": ",.0f", "% of ceiling": ".1f"}``); missing values show as "—".
    """
    records = data.to_dict("records") if hasattr(data, "to_dict") else [dict(r) for r in data]
    if columns is None:
        columns = list(records[0]) if records else []
    names = dict(columns) if isinstance(columns, dict) else {c: c for c in columns}
    formats = formats or {}
    rows = [
        [_format_cell(rec.get(src), formats.get(shown, formats.get(src))) for src, shown in names.items()]
        for rec in records
    ]
    return Table(list(names.values()), rows, caption)


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


# --------------------------------------------------------------------------------------------------
# Workloads the notebooks and the scripts share
# --------------------------------------------------------------------------------------------------
def expert_counts(n_rows: int, E: int, hot_odds: float = 1.0, n_hot: int = 1, seed: int = 0) -> torch.Tensor:
    """Rows per expert as a router deals them: an int64 tensor of E counts summing to ``n_rows``.

    Each of the ``n_rows`` assignments (T tokens times top_k) picks an expert at random, the first ``n_hot``
    experts ``hot_odds`` times as likely as the others: 1 is uniform routing, ``math.inf`` sends every row to
    the hot experts. The course's skewed routing is ``hot_odds=9, n_hot=max(1, E // 4)`` (a quarter of the
    experts take three quarters of the rows). Drawn on the CPU from ``seed``: the same seed, the same counts.
    """
    finite = math.isfinite(hot_odds)
    odds = torch.ones(E) if finite else torch.zeros(E)
    odds[:n_hot] = hot_odds if finite else 1.0
    generator = torch.Generator().manual_seed(seed)
    picks = torch.multinomial(odds / odds.sum(), n_rows, replacement=True, generator=generator)
    return torch.bincount(picks, minlength=E)


def imbalance(counts: torch.Tensor) -> float:
    """The largest group over the mean group: 1.0 is perfect balance."""
    return float(counts.max() / counts.float().mean())


def group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) rows of every group from grouped_mm's cumulative ends ``offs``, on the host.

    ``offs.tolist()`` waits until the GPU has computed ``offs``: call it once, outside a timed loop, unless the
    synchronization is what is measured.
    """
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def loop_mm(x: torch.Tensor, w: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The per-expert loop that a grouped GEMM replaces: out[start:end] = x[start:end] @ w[e] for each group.

    x (rows, K) sorted by group, w (E, K, N), ``bounds`` from :func:`group_bounds`, already on the host (which
    flatters the loop: a real one reads them from the device). One matmul launch per non-empty group, written
    straight into the output.
    """
    out = x.new_empty(x.shape[0], w.shape[2])
    for e, (start, end) in enumerate(bounds):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
    return out


def skew_router(layer, x: torch.Tensor, n_hot: int, strength: float = 4.0, seed: int = 7) -> torch.Tensor:
    """Tilt an MoE layer's router toward its first ``n_hot`` experts; return the tokens to route.

    Adds one random unit direction (drawn from ``seed`` on x's device), times ``strength``, to those experts'
    router rows (in place, without gradient), and returns ``x`` plus that direction: every token then scores
    the hot experts higher. ``layer`` is anything with a ``router.weight`` of shape (E, d), e.g.
    ``kernel_lib.MoE``.
    """
    generator = torch.Generator(device=x.device).manual_seed(seed)
    direction = torch.randn(x.shape[-1], device=x.device, generator=generator)
    direction = direction / direction.norm()
    with torch.no_grad():
        layer.router.weight[:n_hot] += (strength * direction).to(layer.router.weight.dtype)
    return x + direction.to(x.dtype)


def _pairs_up_to(n: int, window: int | None) -> int:
    """Keys seen by the queries at positions 0 .. n-1 of a causal mask: sum over p of min(p + 1, window)."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def visible_pairs(N: int, M: int | None = None, *, causal: bool = False, window: int | None = None) -> int:
    """Query-key pairs an attention mask keeps, for N queries over M keys (M = N by default).

    The masks of :func:`kernel_lib.flash_attention`, bottom-right aligned (query i sits at key position
    i + M - N, so the last query sees the last key): causal keeps keys j <= i + M - N, a window of W (which
    needs causal) keeps the last W of those. Attention's FLOPs are 4 D per visible pair forward.
    """
    M = N if M is None else M
    if window is not None:
        if not causal:
            raise ValueError("window needs causal=True (a sliding window looks back from each query)")
        if window < 1:
            raise ValueError(f"window must be a positive number of keys, got {window}")
    if not causal:
        return N * M
    # Queries sit at key positions M - N .. M - 1; a position p < 0 (N > M) sees no key.
    return _pairs_up_to(M, window) - _pairs_up_to(max(0, M - N), window)
