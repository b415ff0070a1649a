"""How good the config heuristics of the matmul-like kernels are, and what a first call at a new shape costs, on a GPU.

1. Heuristic against full autotune. Flash attention (forward, dK/dV, dQ) and the grouped GEMM (forward, dx, dW)
   launch one config that a heuristic picks from the shape (``*_preferred`` in their files). Here each kernel is
   also run under ``KERNEL_LIB_AUTOTUNE=1``, so Triton's autotuner times every config of its list at the shape;
   the row reports the best time and the heuristic pick's time from those same measurements, at shapes the
   heuristics were not fitted on.
2. First calls. Each op runs in a fresh process with an empty Triton cache: the process's Triton start-up (one
   trivial kernel, paid once whatever runs first), the first forward and backward (compiling every kernel they
   launch), then a second shape in the same process (what a reader pays at a new sequence length). A second process
   then repeats the first calls on the cache the first left (Triton's on-disk cache: nothing should compile).

Writes <out>/autotune.csv and <out>/first_calls.csv and prints both tables.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from kernel_lib import bench, flash_attention, grouped_mm
from kernel_lib.ops import attention_kernels as ak
from kernel_lib.ops import grouped_mm as gmm_module
from kernel_lib.ops._utils import meta, pick_config

# Shapes the heuristics were not fitted on (the fits of 2026-11-24: 35 attention and 25 grouped shapes, NOTES.md):
# other lengths, windows and expert counts, some on either side of a heuristic's threshold.
ATTENTION_SHAPES = [  # (N, D, causal, window); 16k tokens per batch, 2048 / D heads
    (1280, 128, True, None), (1280, 64, True, None), (2560, 128, True, None), (2560, 64, False, None),
    (5120, 64, True, None), (5120, 128, False, None), (8192, 128, True, None), (16384, 64, False, None),
    (10240, 64, True, 768), (10240, 128, True, 3072), (12288, 64, True, 3072), (8192, 64, True, 2048),
]  # fmt: skip
GROUPED_SHAPES = [  # (name, T tokens x top_k, d, d_ff, E)
    ("deepseek-lite-like", 4096 * 6, 2048, 1408, 64), ("t384", 384 * 2, 2048, 5632, 8),
    ("t3k-e32", 3072 * 4, 1024, 1024, 32), ("t24k", 24576 * 2, 2048, 4096, 8), ("t2k-e128", 2048 * 8, 1024, 512, 128),
    ("t12k-d3072", 12288 * 2, 3072, 8192, 8),
]  # fmt: skip


def _timings(tuner) -> dict:
    """{launch keywords as a sorted tuple: ms} from the autotuner's own measurements at its last new key."""
    out = {}
    for config, value in (getattr(tuner, "configs_timings", None) or {}).items():
        out[tuple(sorted(meta(config).items()))] = float(value[0] if isinstance(value, (list, tuple)) else value)
    return out


def _fresh(tuners) -> None:
    for tuner in tuners:
        tuner.cache.clear()
        tuner.cache_results = False  # measure now, not a choice kept on disk by an earlier run


def _row(kernel, shape, timings, pick) -> dict:
    best = min(timings.values())
    chosen = timings.get(tuple(sorted(pick.items())), float("nan"))
    return dict(kernel=kernel, shape=shape, best_ms=best, heuristic_ms=chosen, heuristic_over_best=chosen / best)


def heuristic_rows(kernels=("attention", "grouped")) -> list[dict]:
    os.environ["KERNEL_LIB_AUTOTUNE"] = "1"
    tuners = [
        ak._attn_fwd_tuned,
        ak._attn_bwd_dkdv_tuned,
        ak._attn_bwd_dq_tuned,
    ]
    rows = []
    for N, D, causal, window in ATTENTION_SHAPES if "attention" in kernels else []:
        B, H = max(1, 16384 // N), 2048 // D
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        _fresh(tuners)
        out = flash_attention(q, k, v, causal=causal, window=window)
        fwd = _timings(tuners[0])
        out.backward(torch.randn_like(out))
        shape = f"N={N} D={D} causal={causal} window={window}"
        smem = {"BLOCK_DQK": D, "BLOCK_DV": D, "q": q}  # widths: q/k and v tiles
        picks = [
            pick_config(ak.fwd_preferred(N, 2 * D, causal, window is not None), None, ak._smem_bytes, smem),
            pick_config(ak.dkdv_preferred(N, 2 * D, causal, window), None, ak._smem_bytes_dkdv, smem),
            pick_config(ak.dq_preferred(2 * D, causal), None, ak._smem_bytes_dq, smem),
        ]
        names = ("attention fwd", "attention dK/dV", "attention dQ")
        measured = (fwd, _timings(tuners[1]), _timings(tuners[2]))
        for name, timings, pick in zip(names, measured, picks, strict=True):
            rows.append(_row(name, shape, timings, pick))
        del q, k, v, out
    grouped = [gmm_module._grouped_mm_tuned, gmm_module._grouped_dw_tuned]
    for name, T, d, d_ff, E in GROUPED_SHAPES if "grouped" in kernels else []:
        counts = torch.bincount(torch.randint(0, E, (T,)), minlength=E)
        offs = counts.cumsum(0).to(torch.int32).cuda()
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(E, d, d_ff, device="cuda", dtype=torch.bfloat16) / d**0.5).requires_grad_()
        _fresh(grouped)
        y = grouped_mm(x, w, offs, check_offs=False)
        fwd = _timings(grouped[0])
        _fresh(grouped[:1])
        y.backward(torch.randn_like(y))
        fits, smem = gmm_module._smem_bytes, {"x_ptr": x}
        picks = {  # the configs the launchers take: forward (N = d_ff), dx (the forward kernel, N = d), dW
            "grouped fwd": (fwd, gmm_module.fwd_preferred(T, d_ff, E, x.device)),
            "grouped dx": (_timings(grouped[0]), gmm_module.fwd_preferred(T, d, E, x.device, transposed=True)),
            "grouped dW": (_timings(grouped[1]), gmm_module.dw_preferred()),
        }
        for kernel, (timings, preferred) in picks.items():
            rows.append(_row(kernel, name, timings, pick_config(preferred, preferred[-1], fits, smem)))
        del x, w, y
    del os.environ["KERNEL_LIB_AUTOTUNE"]
    return rows


FIRST_CALL = r"""
import json, sys, time, torch
from kernel_lib import (flash_attention, grouped_mm, rms_norm, layer_norm, softmax, swiglu, rope, rope_cos_sin,
                        cross_entropy)
op = sys.argv[1]
def inputs(n):
    if op == "flash_attention":
        q = torch.randn(16384 // n, 16, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return lambda: flash_attention(q, q, q, causal=True)
    if op == "grouped_mm":
        x = torch.randn(n * 8, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(8, 2048, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        offs = torch.linspace(0, n * 8, 9, device="cuda")[1:].round().to(torch.int32)
        return lambda: grouped_mm(x, w, offs, check_offs=False)
    x = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if op == "rope":
        q = torch.randn(4, 16, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        cos, sin = rope_cos_sin(n, 128, device="cuda")
        return lambda: rope(q, cos, sin)
    target = torch.randint(0, 4096, (n,), device="cuda")
    calls = {"rms_norm": lambda: rms_norm(x, w), "layer_norm": lambda: layer_norm(x, w, w),
             "softmax": lambda: softmax(x), "swiglu": lambda: swiglu(x, x),
             "cross_entropy": lambda: cross_entropy(x, target)}
    return calls[op]
def timed(call):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    y = call(); torch.cuda.synchronize(); t1 = time.perf_counter()
    y.float().sum().backward(); torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t1
import triton, triton.language as tl
@triton.jit
def _touch(x_ptr):  # the smallest kernel: its first launch is the process's Triton start-up, paid once by any op
    tl.store(x_ptr, tl.load(x_ptr) + 1)
t0 = time.perf_counter(); _touch[(1,)](torch.zeros(1, device="cuda")); torch.cuda.synchronize()
startup = time.perf_counter() - t0
cold = timed(inputs(4096))
new_shape = timed(inputs(3000))
print(json.dumps(dict(op=op, triton_startup_s=startup, first_fwd_s=cold[0], first_bwd_s=cold[1],
                      new_shape_fwd_s=new_shape[0], new_shape_bwd_s=new_shape[1])))
"""


def _first_call(script: str, op: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, script, op], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"first call of {op} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_call_rows() -> list[dict]:
    """Per op: a process with an empty Triton cache, then a second process on the cache the first one left."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "first_call.py")  # a file, not `python -c`: @triton.jit reads its source
        with open(script, "w") as f:
            f.write(FIRST_CALL)
        for op in ("flash_attention", "grouped_mm", "rms_norm", "layer_norm", "softmax", "swiglu", "rope",
                   "cross_entropy"):  # fmt: skip
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TRITON_CACHE_DIR": cache}
                env.pop("KERNEL_LIB_AUTOTUNE", None)
                row = _first_call(script, op, env)
                again = _first_call(script, op, env)
            row.update(second_process_fwd_s=again["first_fwd_s"], second_process_bwd_s=again["first_bwd_s"])
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results", help="folder for the CSV files")
    parser.add_argument("--skip-heuristics", action="store_true", help="only the first-call measurements")
    parser.add_argument("--skip-first-calls", action="store_true", help="only the heuristics against autotune")
    parser.add_argument("--kernels", default="attention,grouped", help="heuristics of: attention, grouped, or both")
    args = parser.parse_args()
    bench.require_gpu("bench_autotune.py")
    if not args.skip_first_calls:
        first = first_call_rows()
        print(bench.to_frame(first).round(2).to_string(index=False))
        bench.write_csv(first, os.path.join(args.out, "first_calls.csv"))
    if not args.skip_heuristics:
        rows = heuristic_rows(args.kernels.split(","))
        frame = bench.to_frame(rows)
        print(frame.round(3).to_string(index=False))
        ratio = frame.heuristic_over_best
        print(f"heuristic / best: worst {ratio.max():.3f}, median {ratio.median():.3f}")
        bench.write_csv(rows, os.path.join(args.out, "autotune.csv"))


if __name__ == "__main__":
    main()
