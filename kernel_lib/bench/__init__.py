"""Timing that can be trusted, the machine's ceilings, and the tables and plots built from them: one module a job.

* :mod:`.timing`: :func:`time_fn` (warm-up, CUDA events through ``triton.testing.do_bench`` with the L2 cache wiped
  before each call; a ``perf_counter`` loop on the CPU), :func:`host_ms`, :func:`graph_ms`, :func:`step_cost`,
  :func:`profile_kernels`, :func:`gbps`, :func:`tflops`;
* :mod:`.machine`: :func:`environment` (GPU, versions, time), :func:`full_sizes`, :func:`require_gpu`, the ceilings
  (:func:`copy_bandwidth`, :func:`matmul_tflops`, :func:`measure_ceilings`) and :func:`peak_memory_bytes`;
* :mod:`.results`: benchmark rows, CSV and DataFrames, and :func:`sweep` (check against float64, then time);
* :mod:`.plots`: the book's palette, plots, tables, :func:`glue` and :func:`show_source`;
* :mod:`.workloads`: what the notebooks and scripts share (MoE routing skews, the per-expert loop, attention's
  visible pairs).

Everything is importable from ``kernel_lib.bench`` as before. The tools (assistant, search worker, capstone
harness) need :mod:`.timing` alone. pandas, matplotlib and tqdm are imported inside the functions that need them,
so kernel files that import nothing from here stay copyable without them.
"""

from .machine import (
    Ceilings,
    copy_bandwidth,
    device_name,
    environment,
    full_sizes,
    l2_cache_bytes,
    matmul_tflops,
    measure_ceilings,
    peak_memory_bytes,
    require_gpu,
)
from .plots import (
    _SPARE,  # noqa: F401 - tests read the spare colours
    PALETTE,
    STYLE,
    Table,
    color,
    draw_ceiling,
    glue,
    legend_outside,
    plot_roofline,
    plot_speedup,
    plot_throughput,
    show_source,
    table,
    use_style,
)
from .results import progress, result_row, sweep, timing_frame, to_frame, write_csv
from .timing import (
    QUANTILES,
    KernelProfile,
    StepCost,
    Timing,
    _cuda_event_samples,  # noqa: F401 - notebook 00 prints its source
    _quantile,  # noqa: F401 - tested
    gbps,
    graph_ms,
    host_ms,
    profile_kernels,
    repeat_in_graph,
    step_cost,
    sync,
    tflops,
    time_fn,
)
from .workloads import expert_counts, group_bounds, imbalance, loop_mm, skew_router, visible_pairs

__all__ = [
    "Ceilings",
    "color",
    "copy_bandwidth",
    "device_name",
    "draw_ceiling",
    "environment",
    "expert_counts",
    "full_sizes",
    "gbps",
    "glue",
    "graph_ms",
    "group_bounds",
    "host_ms",
    "imbalance",
    "KernelProfile",
    "l2_cache_bytes",
    "legend_outside",
    "loop_mm",
    "matmul_tflops",
    "measure_ceilings",
    "PALETTE",
    "peak_memory_bytes",
    "plot_roofline",
    "plot_speedup",
    "plot_throughput",
    "profile_kernels",
    "progress",
    "QUANTILES",
    "repeat_in_graph",
    "require_gpu",
    "result_row",
    "show_source",
    "skew_router",
    "step_cost",
    "StepCost",
    "STYLE",
    "sweep",
    "sync",
    "table",
    "Table",
    "tflops",
    "time_fn",
    "Timing",
    "timing_frame",
    "to_frame",
    "use_style",
    "visible_pairs",
    "write_csv",
]
