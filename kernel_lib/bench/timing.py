"""Timing that can be trusted: every number in the course goes through :func:`time_fn`.

* GPU: warm-up, then CUDA events around each call through ``triton.testing.do_bench``, which also wipes
  the L2 cache before every call so that a working set smaller than L2 is not timed from cache.
  ``flush_l2=False`` times the same way without the wipe, to show what the cache does.
* CPU: a ``time.perf_counter`` loop with the same warm-up/median structure (the numbers are CPU numbers).

Results carry the median and the 20th/80th percentiles. Two other clocks: :func:`host_ms`, what the host
pays to issue one call (Python, dispatch, launches), and :func:`graph_ms`, the GPU time of one call replayed
from a CUDA graph (no host work between kernels); :func:`step_cost` reports both for a training step, and
:func:`profile_kernels` its kernels by name. This module needs torch alone (triton where it times a GPU).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

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
    """Host-clock times of ``fn`` on the CPU: warm up for ``warmup_ms`` (no call when it is 0), then time single
    calls for ``rep_ms``: at least three, or one when that call alone outlasts ``rep_ms`` (an interpreted step of a
    second: its repeats would only cost time; a caller that needs a spread repeats rounds, as ``compare`` does)."""
    deadline = time.perf_counter() + warmup_ms / 1e3
    while time.perf_counter() < deadline:
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(samples) < max_reps:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() >= deadline and (len(samples) >= 3 or samples[0] >= rep_ms):
            break
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
    if not cuda:  # the first call was a warm-up too
        warmup_ms = max(0.0, warmup_ms - first_ms)
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


def sync(device: str | torch.device | None = None) -> None:
    """Wait for everything queued on ``device`` (the default CUDA device; nothing to wait for on the CPU)."""
    if _device_type(device) == "cuda":
        torch.cuda.synchronize(device)
