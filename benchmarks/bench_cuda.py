"""The CUDA C++ ladder (RMSNorm, softmax) against kernel_lib's Triton kernels, torch.compile and PyTorch eager.

Parts (``--parts``, comma-separated, in this order; ``<out>/cuda_ladder.csv`` is rewritten after each):

* ``build``: the extension compiled into an empty cache folder by a fresh process (the first build: g++, and nvcc
  on a GPU machine), then loaded from that folder by a second process (the cached load: nothing compiled). Both
  report ``kernel_lib.cuda.build_info()``: seconds inside ``load()``, and the process's wall time including
  ``import torch``. This process then loads the same library.
* ``sweep``: RMSNorm forward, RMSNorm forward + backward and softmax forward, in bf16, on rows x D with
  rows * D = 2**27 (256 MiB a tensor, far beyond any L2), at every width of ``--widths``: each step of the CUDA
  ladder (``VARIANTS`` below, and ``best``, the library's choice by width), kernel_lib's Triton kernel
  (``triton``), ``torch.compile`` of the reference (``torch.compile``) and PyTorch's eager op (``eager``:
  ``F.rms_norm``, ``torch.softmax``). Every implementation is checked against float64 with
  ``kernel_lib.validate.check`` (at most 2x PyTorch's own error in the same dtype, plus ``atol``: 1e-2 for RMSNorm,
  whose outputs are O(1), 1e-6 for softmax, whose outputs are as small as 1/D) before it is timed, and again after
  (the output of a call made after the timing loop, against the same reference): an implementation that fails is
  not timed, and the script exits with status 1 once the CSV is written. Timing: ``kernel_lib.bench.time_fn``
  (CUDA events, median, L2 wiped before every call).
* ``graph``: RMSNorm forward + backward at ``--graph-widths``: the CUDA op (``best``), Triton and torch.compile,
  "as called" (as in the sweep) and replayed from a CUDA graph (one step captured with ``torch.cuda.CUDAGraph``
  after a warm-up on a side stream; the replay's outputs are checked against float64 too), so host time drops out.
* ``ncu`` (only with ``--ncu``): Nsight Compute on the best and worst CUDA step of ``--ncu-op`` forward at D = 4096
  (by this run's sweep; ``best`` and ``naive`` without one): ``ncu`` re-runs this script in ``--single`` mode, which
  launches the kernel once between ``cudaProfilerStart`` and ``cudaProfilerStop``, and reads DRAM throughput and
  achieved occupancy (``NCU_METRICS``), with ncu's defaults: clocks locked to base, caches flushed before each
  replay. Skipped with a message where ncu is missing or may not read the GPU's counters.

Bytes counted for GB/s (the fewest a pass must move; 2 bytes an element in bf16; R rows of D)::

    RMSNorm forward             read x, write y, read weight                       (2 R D + D) elements
    softmax forward             read x, write y                                     2 R D      elements
    RMSNorm forward + backward  the forward above, then read dy, x and weight,
                                write dx and dweight                               (5 R D + 3 D) elements

Not counted: rstd (4 bytes a row, written forward and read backward) and the backward's float32 partial rows of
dweight (a few per SM, summed by a last kernel): costs of an implementation, not of the operation. % of copy is
GB/s over the copy bandwidth measured at the start of the same run (``bench.copy_bandwidth``: bytes read +
written). ``vs_triton`` and ``vs_compile`` are that peer's median time over the row's: above 1, the row is faster.

The ladder's steps, their kernels and the ``best`` rule are described in notebook 05a (kernels in
``kernel_lib/cuda/csrc/rms_norm.cu`` and ``softmax.cu``).
RMSNorm has no ``online`` step of its own (``online`` runs its two-pass ``vectorized`` kernel), so it is measured for
softmax only. ``--tiny`` is a smoke test of this script on the CPU, whatever the machine: the C++ CPU operator
(which runs the same loop for every variant), Triton interpreted, ``torch.compile`` with ``backend="eager"``
(Dynamo alone: Inductor's C++ compile of each width would take minutes), float32, tiny sizes; its timings say
nothing about a GPU. Writes ``<out>/cuda_ladder.csv`` and prints one table per pass (rows: implementations,
columns: widths, values: % of the copy ceiling).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and "--tiny" in sys.argv[1:]:
    # CPU only, whatever the machine: no GPU for torch, Triton's interpreter for kernel_lib's kernels. Set before
    # torch and triton are imported.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

import kernel_lib
from kernel_lib import bench, cuda, validate
from kernel_lib.ops.norms import rms_norm_ref
from kernel_lib.ops.softmax import softmax_ref

VARIANTS = {  # the ladder's steps measured for each op ("best": the library's choice by width)
    "rms_norm": ("naive", "block_shared", "warp_shuffle", "vectorized", "registers", "tma", "best"),
    "softmax": ("naive", "block_shared", "warp_shuffle", "vectorized", "registers", "online", "tma", "best"),
}
PEERS = ("triton", "torch.compile", "eager")
PASSES = (("rms_norm", "forward"), ("rms_norm", "forward+backward"), ("softmax", "forward"))
EPS = 1e-6
ATOL = {"rms_norm": 1e-2, "softmax": 1e-6}  # bf16: on top of 2x PyTorch's own error; float32 uses FP32_RULE
FP32_RULE = {"atol": 1e-6, "rtol": 1e-5}  # float32 (--tiny): an ulp or two either way, plus 1e-5 of the largest
NCU_METRICS = (
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",  # DRAM bandwidth used, % of peak
    "sm__warps_active.avg.pct_of_peak_sustained_active",  # achieved occupancy, % of the warps an SM can hold
)
GRAPH_IMPLS = ("best", "triton", "torch.compile")
WIDTHS = ",".join(str(2**k) for k in range(10, 19))  # 1024 ... 262144
GRAPH_WIDTHS = "1024,4096,16384,65536"
TINY = {"elements": 2**13, "widths": "64,1023", "graph_widths": "64"}  # 1023: no vector width divides it
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NO_GRAPH = "CUDA graph: needs a GPU"
COLUMNS = ("part", "op", "pass", "mode", "D", "rows", "impl", "kind", "median_ms", "p20_ms", "p80_ms", "gbps",
           "pct_of_copy", "vs_triton", "vs_compile", "bytes", "check_before", "check_after", "max_abs_err", "allowed",
           "error", "timer", "role", "kernel", "dram_pct", "warps_active_pct", "note", "seconds", "process_s",
           "cached", "with_cuda", "arch", "path")  # fmt: skip


# --------------------------------------------------------------------------------------------------
# What is measured: implementations, inputs, references, bytes
# --------------------------------------------------------------------------------------------------
def implementations(op: str, compiled) -> dict:
    """name -> forward function of the op: every CUDA step, then the peers. ``compiled``: torch.compile'd references."""
    if op == "rms_norm":
        impls = {v: (lambda x, w, v=v: cuda.rms_norm(x, w, EPS, v)) for v in VARIANTS[op]}
        impls["triton"] = lambda x, w: kernel_lib.rms_norm(x, w, EPS)
        impls["torch.compile"] = compiled[op]
        impls["eager"] = lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS)
    else:
        impls = {v: (lambda x, v=v: cuda.softmax(x, v)) for v in VARIANTS[op]}
        impls["triton"] = kernel_lib.softmax
        impls["torch.compile"] = compiled[op]
        impls["eager"] = lambda x: torch.softmax(x, dim=-1)
    return impls


def reference(op: str):
    """The definition (kernel_lib's ``*_ref``): run on float64 copies of the inputs, the truth."""
    return (lambda x, w: rms_norm_ref(x, w, EPS)) if op == "rms_norm" else softmax_ref


def pytorch_lowp(op: str):
    """PyTorch's own result in the inputs' dtype, the rule's yardstick: the reference for RMSNorm (float32 inside,
    one rounding); ``torch.softmax`` for softmax, whose backward, like the kernels', uses the output it saved in
    that dtype (the reference's backward would use its unrounded float32 output)."""
    return reference(op) if op == "rms_norm" else (lambda x: torch.softmax(x, dim=-1))


def make_inputs(op: str, pass_name: str, rows: int, D: int, dtype, device, seed: int = 0) -> list:
    """x (rows, D) and, for RMSNorm, weight (D,); forward + backward: x and weight require grad, dy comes last."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, D, device=device, generator=g).to(dtype)
    inputs = [x, (1 + 0.1 * torch.randn(D, device=device, generator=g)).to(dtype)] if op == "rms_norm" else [3 * x]
    if pass_name == "forward":
        return inputs
    inputs = [t.requires_grad_() for t in inputs]
    return [*inputs, torch.randn(rows, D, device=device, generator=g).to(dtype)]


def forward_backward(fn):
    """fn's forward + backward: the gradients of all its inputs, for the output gradient passed last."""

    def step(*args):
        *inputs, dy = args
        return torch.autograd.grad(fn(*inputs), inputs, dy)

    return step


def elements_moved(op: str, pass_name: str, rows: int, D: int) -> int:
    """The fewest elements the pass must read and write (the table in the module docstring)."""
    if pass_name == "forward+backward":
        return 5 * rows * D + 3 * D
    return 2 * rows * D + (D if op == "rms_norm" else 0)


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------
def _outputs(result) -> tuple:
    return (result,) if isinstance(result, torch.Tensor) else tuple(result)


def _float64(t):
    return t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t


def truth(op: str, pass_name: str, inputs: list) -> tuple[tuple, tuple]:
    """(float64 reference outputs, PyTorch's own outputs in the inputs' dtype): the rule's two yardsticks."""
    ref, low = reference(op), pytorch_lowp(op)
    if pass_name != "forward":
        ref, low = forward_backward(ref), forward_backward(low)
    want = tuple(t.detach() for t in _outputs(ref(*[_float64(t) for t in inputs])))
    lowp = tuple(t.detach() for t in _outputs(low(*inputs)))
    return want, lowp


def verdict(op: str, got, want, lowp, label: str) -> tuple[bool, validate.Check]:
    """kernel_lib.validate.check on every output: (all pass, the check closest to failing or failed)."""
    rule = FP32_RULE if lowp[0].dtype == torch.float32 else {"atol": ATOL[op]}
    checks = [validate.check(o, w, b, name=f"{label} output {i}", **rule)
              for i, (o, w, b) in enumerate(zip(_outputs(got), want, lowp, strict=True))]  # fmt: skip
    worst = max(checks, key=lambda c: c.kernel.max_abs / c.allowed if c.allowed > 0 else float("inf"))
    return all(c.ok for c in checks), worst


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def check_then_time(fn, inputs, want, lowp, op, label, timing_kwargs) -> dict:
    """Check ``fn(*inputs)``, time it, check a call made after the timing loop: the fields of one CSV row."""
    row = {"check_before": "", "check_after": "", "max_abs_err": None, "allowed": None, "error": ""}
    try:
        ok, worst = verdict(op, fn(*inputs), want, lowp, label)
        row.update(check_before="ok" if ok else str(worst), max_abs_err=worst.kernel.max_abs, allowed=worst.allowed)
        if not ok:
            return row
        timing = bench.time_fn(lambda: fn(*inputs), **timing_kwargs)
        ok, worst = verdict(op, fn(*inputs), want, lowp, label)
        row.update(check_after="ok" if ok else str(worst), median_ms=timing.median_ms, p20_ms=timing.p20_ms,
                   p80_ms=timing.p80_ms, timer=timing.timer)  # fmt: skip
        row["max_abs_err"] = max(row["max_abs_err"], worst.kernel.max_abs)
    except Exception as exc:  # a launch that fails is recorded; the sweep goes on (a sticky CUDA error fails the rest)
        row["error"] = _first_line(exc)
    return row


def add_ratios(rows: list[dict]) -> None:
    """vs_triton / vs_compile: the peer's median over the row's, within each (part, op, pass, D, mode)."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault((r["part"], r["op"], r["pass"], r["D"], r.get("mode")), {})[r["impl"]] = r
    for group in groups.values():
        for r in group.values():
            for peer, key in (("triton", "vs_triton"), ("torch.compile", "vs_compile")):
                p = group.get(peer, {}).get("median_ms")
                r[key] = p / r["median_ms"] if p and r.get("median_ms") else None


# --------------------------------------------------------------------------------------------------
# Parts
# --------------------------------------------------------------------------------------------------
def _load_in_subprocess(cache: str, env_extra: dict) -> dict:
    """build_info() of a fresh process whose cache folder is ``cache``, plus that process's wall time."""
    code = (
        "import dataclasses, json, time; t = time.perf_counter(); from kernel_lib import cuda; i = cuda.build_info(); "
        "print(json.dumps({**dataclasses.asdict(i), 'process_s': time.perf_counter() - t}))"
    )
    env = {**os.environ, **env_extra, "KERNEL_LIB_CUDA_CACHE": cache}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"building kernel_lib.cuda in a subprocess failed:\n{done.stderr[-3000:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    info["process_s"] = time.perf_counter() - start  # from the parent: includes starting Python
    return info


def part_build(args, cache: str | None) -> list[dict]:
    """First build into an empty folder, cached load from it by a second process, then this process's load."""
    rows = []
    if cache is not None:
        for impl in ("first build (empty cache, new process)", "cached load (second process)"):
            info = _load_in_subprocess(cache, {})
            rows.append({"part": "build", "impl": impl, **info})
            print(f"{impl}: load() {info['seconds']:.2f} s, process {info['process_s']:.2f} s, "
                  f"cached {info['cached']}, CUDA kernels {info['with_cuda']} {info['arch']}", flush=True)  # fmt: skip
        os.environ["KERNEL_LIB_CUDA_CACHE"] = cache  # this process loads the library just built
    start = time.perf_counter()
    info = cuda.build_info()
    rows.append({"part": "build", "impl": "this process", **vars(info), "process_s": time.perf_counter() - start})
    print(f"this process: load() {info.seconds:.2f} s, cached {info.cached}, CUDA kernels {info.with_cuda} "
          f"{info.arch}, {info.path}", flush=True)  # fmt: skip
    return rows


def measured_row(base: dict, fn, inputs, want, lowp, ctx) -> dict:
    """``base`` plus the checks and timing of ``fn(*inputs)``, GB/s and % of copy (from ``base["bytes"]``)."""
    label = f"{base['op']} {base['pass']} {base['impl']}{' ' + base['mode'] if base.get('mode') else ''} D={base['D']}"
    row = {**base, **check_then_time(fn, inputs, want, lowp, base["op"], label, ctx["timing"])}
    if row.get("median_ms"):
        row["gbps"] = bench.gbps(row["bytes"], row["median_ms"])
        row["pct_of_copy"] = 100 * row["gbps"] / ctx["copy_gbps"]
    _say(row)
    return row


def part_sweep(args, ctx) -> list[dict]:
    """Every implementation of every pass at every width, checked, timed, checked again."""
    rows = []
    for op, pass_name in PASSES:
        if op not in args.ops:
            continue
        for D in args.widths:
            n_rows = max(1, args.elements // D)
            inputs = make_inputs(op, pass_name, n_rows, D, args.dtype, ctx["device"])
            want, lowp = truth(op, pass_name, inputs)
            nbytes = elements_moved(op, pass_name, n_rows, D) * args.dtype.itemsize
            for impl, fwd in implementations(op, ctx["compiled"]).items():
                base = {"part": "sweep", "op": op, "pass": pass_name, "D": D, "rows": n_rows, "impl": impl,
                        "kind": "peer" if impl in PEERS else "cuda", "bytes": nbytes}  # fmt: skip
                fn = fwd if pass_name == "forward" else forward_backward(fwd)
                rows.append(measured_row(base, fn, inputs, want, lowp, ctx))
            del inputs, want, lowp
            _free()
    add_ratios(rows)
    return rows


def graphed(step, inputs):
    """``step(*inputs)`` captured in a CUDA graph after a warm-up on a side stream: a function that replays it and
    returns the graph's outputs (the same tensors, rewritten by each replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*inputs)

    def replay(*_):
        graph.replay()
        return out

    return replay


def part_graph(args, ctx) -> list[dict]:
    """RMSNorm forward + backward as called and replayed from a CUDA graph."""
    rows = []
    op, pass_name = "rms_norm", "forward+backward"
    for D in args.graph_widths:
        n_rows = max(1, args.elements // D)
        inputs = make_inputs(op, pass_name, n_rows, D, args.dtype, ctx["device"])
        want, lowp = truth(op, pass_name, inputs)
        nbytes = elements_moved(op, pass_name, n_rows, D) * args.dtype.itemsize
        impls = implementations(op, ctx["compiled"])
        for impl in GRAPH_IMPLS:
            step = forward_backward(impls[impl])
            base = {"part": "graph", "op": op, "pass": pass_name, "D": D, "rows": n_rows, "impl": impl,
                    "kind": "peer" if impl in PEERS else "cuda", "bytes": nbytes}  # fmt: skip
            rows.append(measured_row({**base, "mode": "as called"}, step, inputs, want, lowp, ctx))
            if ctx["device"] != "cuda":
                rows.append({**base, "mode": "cuda graph", "error": NO_GRAPH})
                continue
            try:
                replay = graphed(step, inputs)
            except Exception as exc:  # capture refused: recorded, the part goes on
                rows.append({**base, "mode": "cuda graph", "error": f"capture: {_first_line(exc)}"})
                _say(rows[-1])
                continue
            rows.append(measured_row({**base, "mode": "cuda graph"}, replay, inputs, want, lowp, ctx))
            del replay
        del inputs, want, lowp
        _free()
    add_ratios(rows)
    return rows


def _ncu_kernel_name(text: str) -> str:
    """The kernel name of the last launch in ``ncu --csv --page raw`` output ('' when none)."""
    import csv

    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("==")]
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        return ""
    table = list(csv.reader(lines[start:]))
    col = table[0].index("Kernel Name") if "Kernel Name" in table[0] else None
    launches = [r for r in table[1:] if col is not None and len(r) > col and r[0].strip().isdigit()]
    return launches[-1][col] if launches else ""


def part_ncu(args, ctx, sweep_rows: list[dict]) -> list[dict]:
    """Nsight Compute readings of the best and worst CUDA step of ``--ncu-op`` forward at D = 4096."""
    from kernel_lib.search.prior import run_ncu

    op, D = args.ncu_op, 4096
    mine = [r for r in sweep_rows if (r["op"], r["pass"], r["D"], r["kind"]) == (op, "forward", D, "cuda")
            and r.get("gbps")]  # fmt: skip
    by_speed = sorted(mine, key=lambda r: r["gbps"])
    if by_speed:
        picks, source = {"best": by_speed[-1]["impl"], "worst": by_speed[0]["impl"]}, "by this run's sweep"
    else:
        picks, source = {"best": "best", "worst": "naive"}, "no sweep at D=4096 in this run: assumed"
    skip = None
    if ctx["device"] != "cuda":
        skip = "Nsight Compute profiles GPU kernels (no GPU in this run)"
    elif shutil.which("ncu") is None:
        skip = "ncu (Nsight Compute) is not on PATH (it ships with the CUDA toolkit)"
    if skip:
        print(f"ncu: skipped: {skip}")
        return [{"part": "ncu", "op": op, "pass": "forward", "D": D, "impl": v, "role": k, "error": skip}
                for k, v in picks.items()]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for role, variant in picks.items():
            log = os.path.join(tmp, f"{role}.csv")
            cmd = ["ncu", "--target-processes", "all", "--profile-from-start", "off", "--csv", "--page", "raw",
                   "--print-units", "base", "--metrics", ",".join(NCU_METRICS), "--launch-count", "1",
                   "--log-file", log, sys.executable, os.path.abspath(__file__), "--single", f"{op}:{variant}:{D}",
                   "--elements", str(args.elements), "--dtype", args.dtype_name]  # fmt: skip
            result = run_ncu(cmd, timeout=600)
            row = {"part": "ncu", "op": op, "pass": "forward", "D": D, "impl": variant, "role": role, "note": source}
            if isinstance(result, str):
                row["error"] = result
                print(f"ncu {role} ({variant}): skipped: {result}", flush=True)
            else:
                row["kernel"] = _ncu_kernel_name(Path(log).read_text(errors="replace")) if os.path.exists(log) else ""
                row["dram_pct"] = result.get(NCU_METRICS[0])
                row["warps_active_pct"] = result.get(NCU_METRICS[1])
                print(f"ncu {role} step ({variant}, {source}), {op} forward D={D}: kernel {row['kernel'] or '?'}: "
                      f"DRAM throughput {row['dram_pct']}% of peak, achieved occupancy {row['warps_active_pct']}% "
                      "of the warps an SM holds", flush=True)  # fmt: skip
            rows.append(row)
    return rows


def run_single(args) -> int:
    """--single OP:VARIANT:D: one forward launch between cudaProfilerStart and cudaProfilerStop (for ncu)."""
    op, variant, D = args.single.split(":")
    D = int(D)
    if op not in VARIANTS or variant not in (*VARIANTS[op], "triton", "eager"):
        raise SystemExit(f"--single: unknown op or variant {args.single!r}; ops and variants: {VARIANTS}, "
                         "or the peers triton and eager")  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda.build_info()
    inputs = make_inputs(op, "forward", max(1, args.elements // D), D, args.dtype, device)
    fn = implementations(op, {op: None})[variant]
    fn(*inputs)  # warm-up: lazy loading of the kernel, the allocator's first blocks
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    else:
        fn(*inputs)
    print(f"single: {op} {variant} D={D} rows={inputs[0].shape[0]} on {device}")
    return 0


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------
def problem(row: dict) -> str:
    """What went wrong with a sweep or graph row ('' when it was checked twice and timed)."""
    if row.get("error"):
        return row["error"]
    if row.get("check_before") != "ok":
        return f"before timing: {row.get('check_before')}"
    if row.get("check_after") != "ok":
        return f"after timing: {row.get('check_after')}"
    return ""


def _say(row: dict) -> None:
    where = f"{row['op']} {row['pass']}{' ' + row['mode'] if row.get('mode') else ''} D={row['D']} {row['impl']}"
    trouble = problem(row)
    if trouble:
        print(f"  {where}: {trouble}", flush=True)
    else:
        print(f"  {where}: {row['median_ms']:.4f} ms, {row['gbps']:,.0f} GB/s, {row['pct_of_copy']:.1f}% of copy",
              flush=True)  # fmt: skip


def _free() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def print_tables(rows: list[dict]) -> None:
    """One table per (part, op, pass, mode): implementations down, widths across, % of copy."""
    frame = bench.to_frame([r for r in rows if r["part"] in ("sweep", "graph")])
    if frame.empty:
        return
    for column, empty in (("mode", ""), ("pct_of_copy", float("nan"))):
        frame[column] = frame[column].fillna(empty) if column in frame else empty
    for (_, op, pass_name, mode), group in frame.groupby(["part", "op", "pass", "mode"], sort=False):
        order = list(dict.fromkeys(group["impl"]))
        table = group.pivot(index="impl", columns="D", values="pct_of_copy").reindex(order)
        print(f"\n{op} {pass_name}{' (' + mode + ')' if mode else ''}: % of the copy ceiling")
        print(table.to_string(float_format=lambda v: f"{v:6.1f}", na_rep="     -"))
        best = group[group.impl == "best"]
        for key in ("vs_triton", "vs_compile"):
            if key in best and best[key].notna().any():
                print(f"  best {key.replace('vs_', 'vs ')}: lowest {best[key].min():.2f}x over the widths")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--parts", default="build,sweep,graph", help="comma-separated: build, sweep, graph, ncu")
    parser.add_argument("--ops", default="rms_norm,softmax", help="comma-separated subset of the sweep's ops")
    parser.add_argument("--widths", default=None, help="row widths D (default 1024, 2048, ..., 262144)")
    parser.add_argument("--graph-widths", default=None, help="widths of the graph part (default 1024,4096,16384,65536)")
    parser.add_argument("--elements", type=int, default=None, help="rows * D of every tensor (default 2**27)")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help="bf16 (fp32 with --tiny)")
    parser.add_argument("--ncu", action="store_true", help="Nsight Compute on the best and worst step at D=4096")
    parser.add_argument("--ncu-op", default="rms_norm", choices=list(VARIANTS))
    parser.add_argument("--fresh-cache", default=None,
                        help="empty folder for the build part's first build (default: a temporary one)")  # fmt: skip
    parser.add_argument("--no-fresh-build", action="store_true", help="build part: skip the first build")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test of this script: tiny sizes, CPU op")
    parser.add_argument("--single", default=None, metavar="OP:VARIANT:D", help="one launch, for ncu (internal)")
    args = parser.parse_args(argv)
    args.dtype_name = args.dtype or ("fp32" if args.tiny else "bf16")
    args.dtype = DTYPES[args.dtype_name]
    args.elements = args.elements or (TINY["elements"] if args.tiny else 2**27)
    if args.single:
        return run_single(args)
    args.ops = args.ops.split(",")
    args.widths = [int(w) for w in (args.widths or (TINY["widths"] if args.tiny else WIDTHS)).split(",")]
    graph_widths = args.graph_widths or (TINY["graph_widths"] if args.tiny else GRAPH_WIDTHS)
    args.graph_widths = [int(w) for w in graph_widths.split(",")]
    parts = args.parts.split(",") + (["ncu"] if args.ncu else [])
    unknown = set(parts) - {"build", "sweep", "graph", "ncu"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from build, sweep, graph, ncu")

    if args.tiny:
        device, env = "cpu", bench.environment("cpu")
        print(f"{env['device']} | torch {env['torch']} | triton {env['triton']}")
        print("--tiny: the C++ CPU operator (every variant runs the same loop), Triton interpreted, torch.compile "
              "with backend='eager', float32, tiny sizes: a smoke test of this script, not a measurement.")  # fmt: skip
        timing = {"warmup_ms": 1, "rep_ms": 3, "device": "cpu"}
        copy_gbps = bench.copy_bandwidth(2**22, device="cpu", warmup_ms=1, rep_ms=5)
    else:
        env = bench.require_gpu("bench_cuda")
        device, timing = "cuda", {"warmup_ms": 25, "rep_ms": 100}
        copy_gbps = bench.copy_bandwidth()
    print(f"copy ceiling (read + write): {copy_gbps:,.0f} GB/s", flush=True)
    # Each compiled reference sees every width, with and without gradients: more graphs than Dynamo's default
    # recompile limit (8), past which it would silently run eagerly (named cache_size_limit before torch 2.6).
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    backend = "eager" if args.tiny else "inductor"
    compiled = {op: torch.compile(reference(op), dynamic=False, backend=backend) for op in VARIANTS}
    ctx = {"device": device, "timing": timing, "copy_gbps": copy_gbps, "compiled": compiled}
    env = {**env, "copy_gbps": copy_gbps, "elements": args.elements, "dtype": args.dtype_name,
           "compile_backend": backend}  # fmt: skip
    path = os.path.join(args.out, "cuda_ladder.csv")
    rows: list[dict] = []

    def save(part: str) -> None:
        if rows:
            bench.write_csv([{**dict.fromkeys(COLUMNS), **r} for r in rows], path, env=env)  # same columns, same order
            print(f"[{part}] wrote {path}", flush=True)

    with tempfile.TemporaryDirectory(prefix="kernel_lib_cuda_") as tmp:
        if "build" in parts:
            cache = None
            if not args.no_fresh_build:
                cache = args.fresh_cache or os.path.join(tmp, "cache")
                if os.path.isdir(cache) and os.listdir(cache):
                    parser.error(f"--fresh-cache {cache} is not empty: the first build would not be a first build")
            rows += part_build(args, cache)
            save("build")
        info = cuda.build_info()
        env.update(cuda_arch=info.arch, cuda_kernels=info.with_cuda)
        if "sweep" in parts:
            rows += part_sweep(args, ctx)
            save("sweep")
        if "graph" in parts:
            rows += part_graph(args, ctx)
            save("graph")
        if "ncu" in parts:
            rows += part_ncu(args, ctx, [r for r in rows if r["part"] == "sweep"])
            save("ncu")
    print_tables(rows)
    failed = [r for r in rows if r["part"] in ("sweep", "graph") and problem(r) and problem(r) != NO_GRAPH]
    if failed:
        print(f"\n{len(failed)} implementation(s) failed a check or raised (the CSV's check_before, check_after and "
              "error columns):")  # fmt: skip
        for r in failed:
            print(f"  {r['op']} {r['pass']} {r.get('mode') or ''} D={r['D']} {r['impl']}: {problem(r)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
