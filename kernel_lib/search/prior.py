"""The prior: which moves to try first, from Nsight Compute's view of a variant and from what paid off before.

Three steps, each usable alone:

1. **Profile** one evaluation with Nsight Compute (``ncu_command``, ``run_ncu``): the worker runs the kernel a few
   times with ``--profile-only``, ncu collects ``METRICS`` from one launch of the entry kernel and writes them as
   ``--csv --page raw`` (``parse_ncu_csv``). No ``ncu`` on PATH, or a machine that refuses access to the
   performance counters (``ERR_NVGPUCTRPERM``), gives a one-line reason instead of metrics: the priors stay
   uniform and the search goes on.
2. **Classify** the bottleneck (``classify``); the first rule that holds wins:

   ==========  ========================================================================================
   atomics     atomic/reduction sectors at L2 are at least ``ATOMICS_SHARE`` of all L2 sectors
   overlap     SM and memory throughput both under ``LATENCY_PCT`` of peak, or both under
               ``STALL_BUSY_PCT`` while warps stall on global memory (long scoreboard) at least
               ``LONG_SCOREBOARD_PCT`` of their active cycles: latency, not a unit, is the limit
   compute     the tensor pipe (HMMA, or Hopper's GMMA for wgmma) at least ``TENSOR_PCT`` busy
   sfu         the XU pipe (exp, rsqrt, ... on the special-function units) at least ``SFU_PCT`` busy
   smem        shared-memory wavefronts at least ``SMEM_PCT`` of peak and above DRAM throughput
   gmem        memory throughput at least SM throughput (DRAM or L2 is the busier side)
   compute     otherwise (the SM side is the busier one: FMA, ALU or issue bound)
   ==========  ========================================================================================

   Where the numbers come from: they are rules of thumb, not fitted to measurements. Nsight Compute's own
   speed-of-light rule calls a kernel whose compute and memory throughput are both under 60% of peak latency
   bound; this module draws the hard line lower (40%) and asks for stall evidence between 40% and 60%, so a
   kernel that is merely short of peak is not sent to pipelining moves alone. The pipe thresholds (50-60%)
   mark a unit busy enough that relieving it is the first thing to try.
3. **Weight the moves** (``move_priors``): ``MOVE_AFFINITY`` says which canonical moves address each
   bottleneck; the tactic graph (``TacticGraph``, ``out/global_tactic_graph.json``) says which of them paid off
   on earlier kernels with the same bottleneck. A move's weight is
   ``affinity × max(GAIN_FLOOR, 1 + GAIN_SCALE × learned gain)``, normalized to sum to 1. The learned gain is a
   shrunk mean log speedup, ``(sum of gains + FAILED_GAIN × failures) / (tries + SHRINK_TRIES)``, so one lucky
   try does not dominate and moves that keep failing lose weight. With no bottleneck the affinity is 1 for every
   move and the gain is pooled over all bottlenecks; with neither, the prior is uniform.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from .moves import CANONICAL_MOVES
from .store import write_json

# --------------------------------------------------------------------------------------------------
# Metrics (Nsight Compute names) and the classification thresholds
# --------------------------------------------------------------------------------------------------
SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"  # busiest SM sub-unit, % of peak
MEM_PCT = "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"  # busiest memory unit (L1, L2, DRAM)
DRAM_PCT = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
HMMA_PCT = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"  # mma.sync tensor pipe
GMMA_PCT = "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"  # wgmma tensor pipe (sm_90)
XU_PCT = "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"  # special-function units: exp2, rsqrt, ...
SMEM_WAVEFRONTS_PCT = "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed"
RED_SECTORS = "lts__t_sectors_op_red.sum"  # L2 sectors of reductions (atomics whose result is unused)
ATOM_SECTORS = "lts__t_sectors_op_atom.sum"  # L2 sectors of atomics that return a value
L2_SECTORS = "lts__t_sectors.sum"  # all L2 sectors: the denominator of the atomics share
LONG_SCOREBOARD_STALL = "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct"  # waiting on global memory

METRICS: tuple[str, ...] = (
    SM_PCT,
    MEM_PCT,
    DRAM_PCT,
    HMMA_PCT,
    GMMA_PCT,
    XU_PCT,
    SMEM_WAVEFRONTS_PCT,
    RED_SECTORS,
    ATOM_SECTORS,
    L2_SECTORS,
    LONG_SCOREBOARD_STALL,
)
HOPPER_ONLY_METRICS = (GMMA_PCT,)  # ncu refuses a metric the GPU lacks; drop these before sm_90 (ncu_metrics)

BOTTLENECKS = ("compute", "gmem", "sfu", "atomics", "smem", "overlap")
LATENCY_PCT = 40.0  # SM and memory both under this: nothing is near peak, latency is the limit
STALL_BUSY_PCT = 60.0  # ncu's speed-of-light rule: under 60% of peak on both sides suggests latency
LONG_SCOREBOARD_PCT = 50.0  # ... confirmed when warps wait on global memory half their active cycles or more
TENSOR_PCT = 50.0  # tensor pipe half busy: a matmul kernel already on the tensor cores
TENSOR_FED_PCT = 5.0  # tensor pipe in use at all: a matmul-like kernel
DRAM_BOUND_PCT = 50.0  # DRAM under this: global memory is not what holds the kernel back
SFU_PCT = 50.0  # XU pipe half busy: transcendental math competes with everything else
SMEM_PCT = 60.0  # shared-memory pipe busy enough that its bandwidth or bank conflicts matter
ATOMICS_SHARE = 0.05  # atomics are 5% of L2 sectors or more: they serialize at L2 and dominate
ATOMICS_MIN_SECTORS = 100_000.0  # without the L2 total, this many atomic sectors count as significant

NCU_PERMISSION_ERROR = "ERR_NVGPUCTRPERM"


# --------------------------------------------------------------------------------------------------
# Nsight Compute
# --------------------------------------------------------------------------------------------------
def ncu_available() -> tuple[bool, str]:
    """``(True, path of ncu)`` when ``ncu`` is on PATH, else ``(False, one-line message)`` to print once."""
    path = shutil.which("ncu")
    if path:
        return True, path
    return False, (
        "ncu (Nsight Compute) not found on PATH: move priors stay uniform "
        "(it ships with the CUDA toolkit, e.g. /usr/local/cuda/bin)"
    )


def ncu_metrics(compute_capability: tuple[int, int] | None = None) -> tuple[str, ...]:
    """``METRICS`` the GPU has: Hopper's GMMA metric is dropped below sm_90 (ncu fails on a metric it lacks)."""
    if compute_capability is None or compute_capability >= (9, 0):
        return METRICS
    return tuple(m for m in METRICS if m not in HOPPER_ONLY_METRICS)


def ncu_command(
    python: str, control_path: str, report_csv: str, entry: str, *, metrics: tuple[str, ...] = METRICS
) -> list[str]:
    """The command that profiles one worker evaluation: one launch of ``entry``, ``metrics`` as raw CSV.

    ncu's own output (the CSV and any ``==ERROR==`` line) goes to ``report_csv`` (``--log-file``), so what the
    worker prints cannot interleave with it; ``run_ncu`` reads it from there.
    """
    # fmt: off
    return [
        "ncu",
        "--target-processes", "all",
        "--csv",
        "--page", "raw",
        "--print-units", "base",  # counts as plain sectors, never rescaled to Ksector
        "--metrics", ",".join(metrics),
        "--kernel-name-base", "function",  # match the bare function name (no parameters or templates)
        "--kernel-name", f"regex:^{re.escape(entry)}$",  # the entry kernel, not the input-making torch kernels
        "--launch-count", "1",
        "--log-file", report_csv,
        python, "-m", "kernel_lib.search.worker", control_path, "--profile-only",
    ]
    # fmt: on


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))  # ncu writes thousands separators: "1,234,567"
    except ValueError:
        return None  # "n/a" and the like


def parse_ncu_csv(text: str, kernel: str | None = None) -> dict[str, float]:
    """Metrics of the last profiled launch (of ``kernel``, when given) in ``ncu --csv --page raw`` output.

    The format: a header row (``"ID","Process ID",...,"Kernel Name",...`` then one column per metric), a row of
    units (its ID empty), then one row per kernel launch. Lines ncu or the program print around it
    (``==PROF==``, ``==WARNING==``) are skipped. Only metric columns (names with ``__``) are returned, values
    with a number; an empty dict when no launch row is found.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        return {}
    rows = csv.reader(line for line in lines[start:] if line.strip() and not line.startswith("=="))
    header = next(rows)
    kernel_col = header.index("Kernel Name") if "Kernel Name" in header else None
    wanted = re.compile(rf"\b{re.escape(kernel)}\b") if kernel is not None and kernel_col is not None else None
    last: list[str] | None = None
    for row in rows:
        if len(row) != len(header) or not row[0].strip().isdigit():
            continue  # the units row, or a line the program printed
        if wanted is not None and not wanted.search(row[kernel_col]):
            continue
        last = row
    if last is None:
        return {}
    metrics = {}
    for name, value in zip(header, last, strict=True):
        number = _number(value) if "__" in name else None
        if number is not None:
            metrics[name] = number
    return metrics


def run_ncu(cmd: list[str], timeout: float) -> dict[str, float] | str:
    """Run ``cmd`` (from ``ncu_command``): the metrics, or a one-line reason there are none."""
    if shutil.which(cmd[0]) is None:
        return "ncu not found"
    log = Path(cmd[cmd.index("--log-file") + 1]) if "--log-file" in cmd else None
    if log is not None:
        log.unlink(missing_ok=True)  # a report left by an earlier run must not pass for this one's
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"ncu timed out after {timeout:g} s"
    report = log.read_text(errors="replace") if log is not None and log.exists() else done.stdout
    output = "\n".join((report, done.stdout, done.stderr))
    if NCU_PERMISSION_ERROR in output:
        return f"ncu cannot read performance counters on this machine ({NCU_PERMISSION_ERROR})"
    metrics = parse_ncu_csv(report)
    if metrics:
        return metrics  # even when the worker's own exit status is not 0: the launch was profiled
    error = next((line.strip() for line in output.splitlines() if line.startswith("==ERROR==")), None)
    if error:
        return f"ncu failed: {error.removeprefix('==ERROR==').strip()}"
    if done.returncode != 0:
        return f"ncu exited with status {done.returncode} and no metrics"
    return "ncu profiled no launch of the kernel (does the entry name match the kernel's?)"


# --------------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------------
def classify(metrics: dict[str, float]) -> str:
    """The bottleneck (one of ``BOTTLENECKS``) by the rule in the module docstring; missing pipe metrics count 0.

    Raises ValueError when neither SM nor memory throughput is present: there is nothing to classify on.
    """
    if SM_PCT not in metrics and MEM_PCT not in metrics and DRAM_PCT not in metrics:
        raise ValueError(f"no throughput metrics to classify on (need {SM_PCT} or {MEM_PCT}); got {sorted(metrics)}")
    get = lambda name: metrics.get(name, 0.0)
    sm, dram = get(SM_PCT), get(DRAM_PCT)
    mem = max(get(MEM_PCT), dram)  # the memory side: whichever of L1/L2/DRAM is busiest
    atomic = get(RED_SECTORS) + get(ATOM_SECTORS)
    l2_total = get(L2_SECTORS)
    if (l2_total > 0 and atomic / l2_total >= ATOMICS_SHARE) or (l2_total <= 0 and atomic >= ATOMICS_MIN_SECTORS):
        return "atomics"  # first: atomic traffic also shows as L2 throughput and would read as gmem
    busy = max(sm, mem)
    if busy < LATENCY_PCT or (busy < STALL_BUSY_PCT and get(LONG_SCOREBOARD_STALL) >= LONG_SCOREBOARD_PCT):
        return "overlap"
    tensor = max(get(HMMA_PCT), get(GMMA_PCT))
    if tensor >= TENSOR_PCT:
        return "compute"  # before smem: mma.sync matmuls read tiles through shared memory as a matter of course
    if get(XU_PCT) >= SFU_PCT:
        return "sfu"
    if tensor >= TENSOR_FED_PCT and dram < DRAM_BOUND_PCT:
        # A kernel on the tensor cores whose busy memory is on chip (L1, shared, L2), not DRAM: it is starved by
        # how it feeds the tensor cores (small tiles, no pipelining), which the compute moves fix. Measured: the
        # naive 32x32x32 bf16 matmul of specs/ on an H100, memory 96%, DRAM 10%, SM 20%, tensor pipe 14%.
        return "compute"
    if get(SMEM_WAVEFRONTS_PCT) >= SMEM_PCT and get(SMEM_WAVEFRONTS_PCT) > dram:
        return "smem"
    return "gmem" if mem >= sm else "compute"


# --------------------------------------------------------------------------------------------------
# Move priors
# --------------------------------------------------------------------------------------------------
# Weight of each canonical move per bottleneck: 1 neutral, above 1 the moves that address it, 0.5 the rest
# (never 0: a move the profile argues against may still pay off, and the search must be able to find out).
MOVE_AFFINITY: dict[str, dict[str, float]] = {
    "compute": {
        "enable_async_pipeline": 2.0,  # keep the tensor cores fed while the next tiles load
        "vectorize_global_loads": 0.5,
        "switch_to_mma_or_wgmma": 3.0,  # tensor cores instead of FMAs, wgmma instead of mma.sync on Hopper
        "pad_tail_and_mask": 0.5,
        "change_block_sizes": 2.0,  # larger tiles: more math per byte and per instruction
        "cache_policy_cg": 0.5,
        "avoid_atomics_reduce": 0.5,
        "grouped_gemm_colmajor": 2.0,  # tile order that keeps operands in L2
        "softmax_math_fusion": 1.0,
    },
    "gmem": {
        "enable_async_pipeline": 1.0,
        "vectorize_global_loads": 3.0,  # fewer, wider memory transactions
        "switch_to_mma_or_wgmma": 0.5,
        "pad_tail_and_mask": 2.0,  # an unmasked body vectorizes
        "change_block_sizes": 2.0,  # enough bytes in flight per SM to saturate DRAM
        "cache_policy_cg": 3.0,  # streaming data skips L1
        "avoid_atomics_reduce": 0.5,
        "grouped_gemm_colmajor": 1.0,  # reuse in L2 is DRAM traffic saved
        "softmax_math_fusion": 0.5,
    },
    "sfu": {
        "enable_async_pipeline": 0.5,
        "vectorize_global_loads": 0.5,
        "switch_to_mma_or_wgmma": 1.0,
        "pad_tail_and_mask": 0.5,
        "change_block_sizes": 1.5,
        "cache_policy_cg": 0.5,
        "avoid_atomics_reduce": 0.5,
        "grouped_gemm_colmajor": 0.5,
        "softmax_math_fusion": 4.0,  # exp2 with the scale folded in, rsqrt: fewer XU instructions
    },
    "atomics": {
        "enable_async_pipeline": 0.5,
        "vectorize_global_loads": 0.5,
        "switch_to_mma_or_wgmma": 0.5,
        "pad_tail_and_mask": 0.5,
        "change_block_sizes": 2.0,  # fewer, larger programs: fewer atomics per output
        "cache_policy_cg": 0.5,
        "avoid_atomics_reduce": 4.0,  # the direct cure
        "grouped_gemm_colmajor": 0.5,
        "softmax_math_fusion": 0.5,
    },
    "smem": {
        "enable_async_pipeline": 2.0,  # TMA and async copies bypass registers on the way to shared memory
        "vectorize_global_loads": 1.0,
        "switch_to_mma_or_wgmma": 2.0,  # wgmma reads operands from shared memory without ldmatrix
        "pad_tail_and_mask": 1.0,
        "change_block_sizes": 3.0,  # tile shapes set shared-memory traffic and bank conflicts
        "cache_policy_cg": 0.5,
        "avoid_atomics_reduce": 0.5,
        "grouped_gemm_colmajor": 0.5,
        "softmax_math_fusion": 0.5,
    },
    "overlap": {
        "enable_async_pipeline": 3.0,  # loads of the next iteration in flight during this one's math
        "vectorize_global_loads": 1.5,  # more bytes per instruction in flight
        "switch_to_mma_or_wgmma": 0.5,
        "pad_tail_and_mask": 1.0,
        "change_block_sizes": 3.0,  # more warps and programs per SM to hide latency
        "cache_policy_cg": 1.0,
        "avoid_atomics_reduce": 0.5,
        "grouped_gemm_colmajor": 1.0,
        "softmax_math_fusion": 0.5,
    },
}
GAIN_SCALE = 5.0  # a learned mean gain of +0.1 (about 10% faster per try) multiplies the affinity by 1.5
GAIN_FLOOR = 0.1  # a move that lost before keeps a tenth of its weight: it may suit this kernel
SHRINK_TRIES = 2.0  # pseudo-tries at gain 0 in the shrunk mean: one lucky try counts a third
FAILED_GAIN = -0.05  # a failed evaluation counts as a small loss: it spent a build


def move_priors(
    bottleneck: str | None, tactics: TacticGraph | None = None, moves: Iterable[str] | None = None
) -> dict[str, float]:
    """Prior probability of each of ``moves`` (default: all nine canonical moves), summing to 1."""
    moves = list(CANONICAL_MOVES) if moves is None else list(moves)
    if bottleneck is not None and bottleneck not in MOVE_AFFINITY:
        raise ValueError(f"unknown bottleneck {bottleneck!r}; expected one of {BOTTLENECKS}")
    unknown = [m for m in moves if m not in CANONICAL_MOVES]
    if unknown or not moves:
        raise ValueError(f"moves must be canonical move names, at least one; unknown: {unknown}")
    weights = {}
    for move in moves:
        affinity = MOVE_AFFINITY[bottleneck][move] if bottleneck else 1.0
        learned = tactics.gain(bottleneck, move) if tactics is not None else 0.0
        weights[move] = affinity * max(GAIN_FLOOR, 1.0 + GAIN_SCALE * learned)
    total = sum(weights.values())
    return {move: w / total for move, w in weights.items()}


# --------------------------------------------------------------------------------------------------
# The tactic graph: what paid off, across kernels
# --------------------------------------------------------------------------------------------------
TACTIC_GRAPH_FILE = "global_tactic_graph.json"  # under --outdir
_ABOUT = (
    "Which optimization moves paid off on which kind of bottleneck, accumulated over every kernel searched with "
    "this output folder; later searches start from it as a prior. Per bottleneck (from Nsight Compute metrics) "
    "and move: tries (evaluations of a child made by the move), failed (evaluations that crashed or were wrong), "
    "wins (children faster than their parent), mean_gain (mean log(parent_ms / child_ms) over correct children)."
)


class TacticGraph:
    """Per bottleneck per move: tries, failed, wins and the sum of log speedups of correct children."""

    def __init__(self) -> None:
        self.stats: dict[str, dict[str, dict[str, float]]] = {}

    def record(self, bottleneck: str, move: str, gain: float | None) -> None:
        """One evaluated child of ``move`` on a parent with ``bottleneck``: ``gain`` is log(parent/child), None
        when the evaluation failed."""
        if bottleneck not in BOTTLENECKS:
            raise ValueError(f"unknown bottleneck {bottleneck!r}; expected one of {BOTTLENECKS}")
        if move not in CANONICAL_MOVES:
            raise ValueError(f"unknown move {move!r}; expected one of {tuple(CANONICAL_MOVES)}")
        if gain is not None and not math.isfinite(gain):
            raise ValueError(f"gain must be finite or None (failed), got {gain}")
        s = self.stats.setdefault(bottleneck, {}).setdefault(move, _empty())
        s["tries"] += 1
        if gain is None:
            s["failed"] += 1
        else:
            s["sum_gain"] += gain
            s["wins"] += gain > 0

    def gain(self, bottleneck: str | None, move: str) -> float:
        """Shrunk mean gain of ``move`` on ``bottleneck`` (None: pooled over all); 0 when never tried."""
        cells = [self.stats.get(bottleneck, {})] if bottleneck is not None else list(self.stats.values())
        tries = failed = total = 0.0
        for by_move in cells:
            s = by_move.get(move) if by_move else None
            if s:
                tries, failed, total = tries + s["tries"], failed + s["failed"], total + s["sum_gain"]
        return (total + FAILED_GAIN * failed) / (tries + SHRINK_TRIES)

    def to_json(self) -> dict:
        bottlenecks = {}
        for b, by_move in sorted(self.stats.items()):
            bottlenecks[b] = {}
            for move, s in sorted(by_move.items()):
                correct = s["tries"] - s["failed"]
                mean = s["sum_gain"] / correct if correct else 0.0
                cell = {"tries": int(s["tries"]), "failed": int(s["failed"]), "wins": int(s["wins"])}
                bottlenecks[b][move] = {**cell, "mean_gain": round(mean, 6)}
        return {"about": _ABOUT, "bottlenecks": bottlenecks}

    @classmethod
    def load(cls, path: str | os.PathLike) -> TacticGraph:
        """The graph in ``path``; an empty one when the file does not exist. ValueError naming it when malformed."""
        path = Path(path)
        graph = cls()
        if not path.exists():
            return graph
        try:
            data = json.loads(path.read_text())
            for b, by_move in data["bottlenecks"].items():
                if b not in BOTTLENECKS:
                    raise ValueError(f"unknown bottleneck {b!r}")
                for move, cell in by_move.items():
                    if move not in CANONICAL_MOVES:
                        raise ValueError(f"{b}: unknown move {move!r}")
                    tries, failed, wins = (int(cell.get(k, 0)) for k in ("tries", "failed", "wins"))
                    mean = float(cell["mean_gain"])
                    if not (0 <= failed <= tries and 0 <= wins <= tries - failed and math.isfinite(mean)):
                        raise ValueError(f"{b}.{move}: inconsistent counts {cell}")
                    s = {"tries": tries, "failed": failed, "wins": wins, "sum_gain": mean * (tries - failed)}
                    graph.stats.setdefault(b, {})[move] = s
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            detail = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"{path}: not a valid tactic graph ({detail})") from e
        return graph

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically and durably (on disk before the rename makes it the file; a crash leaves the old one)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, self.to_json(), durable=True)


def _empty() -> dict[str, float]:
    return {"tries": 0, "failed": 0, "wins": 0, "sum_gain": 0.0}
