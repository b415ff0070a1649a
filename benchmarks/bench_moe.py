"""grouped_mm and the MoE layer of kernel_lib against torch._grouped_mm, a per-expert loop and torch.compile, on a GPU.

Two shapes, bf16: a fine-grained MoE (T = 16384 tokens, d = 2048, d_ff = 1408, E = 64, top_k = 6) and a
Mixtral-like one (T = 8192, d = 4096, d_ff = 14336, E = 8, top_k = 2).

1. grouped_mm forward on the up-projection, x (T k, d) sorted by expert, w (E, d, d_ff): kernel_lib against
   ``torch._grouped_mm`` (where this PyTorch has it), a per-expert loop of matmuls (its offsets read on the host
   beforehand, which flatters the loop) and one dense matmul of the same FLOPs (the ceiling for this shape).
   TFLOP/s counts 2 T k d d_ff. Uniform routing and skewed routing (a few hot experts) are both measured.
2. The whole layer, forward + backward: kernel_lib's ``MoE`` against ``moe_ref`` (the per-expert loop) eager and
   compiled, with peak memory, for uniform and skewed routing. FLOPs: 3 grouped GEMMs forward of 2 T k d d_ff
   each, 2x that backward.

Every implementation is checked against float64 first. Writes <out>/moe.csv and prints tables.
"""

import argparse
import os
import sys

import torch

from kernel_lib import MoE, bench, grouped_mm, grouped_mm_ref, moe_ref, validate
from kernel_lib.bench import expert_counts, group_bounds, imbalance, loop_mm, skew_router

SHAPES = {
    "fine-grained": dict(T=16384, d=2048, d_ff=1408, E=64, top_k=6),
    "mixtral-like": dict(T=8192, d=4096, d_ff=14336, E=8, top_k=2),
}


def bench_grouped_mm(name, T, d, d_ff, E, top_k, rows_out):
    n = T * top_k
    w = (torch.randn(E, d, d_ff, device="cuda") / d**0.5).to(torch.bfloat16)
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    dense_w = w[0]
    flops = 2 * n * d * d_ff
    for skew in (False, True):
        # skewed: a quarter of the experts 9x as likely, so they take about three quarters of the rows
        counts = expert_counts(n, E, hot_odds=9.0 if skew else 1.0, n_hot=max(1, E // 4), seed=int(skew))
        offs = counts.cumsum(0).to(device="cuda", dtype=torch.int32)
        bounds = group_bounds(offs)
        impls = {
            # check_offs=False: no host read of offs per call (torch._grouped_mm does none either)
            "kernel_lib": lambda offs=offs: grouped_mm(x, w, offs, check_offs=False),
            "per-expert loop": lambda bounds=bounds: loop_mm(x, w, bounds),
        }
        if hasattr(torch, "_grouped_mm"):
            impls["torch._grouped_mm"] = lambda offs=offs: torch._grouped_mm(x, w, offs=offs)
        impls["dense mm, same FLOPs"] = lambda: x @ dense_w
        # A float64 reference of the whole product is large: check the first 512 output columns of every group.
        cols = slice(0, min(d_ff, 512))
        want = grouped_mm_ref(x.double(), w[:, :, cols].double(), offs.cpu())
        baseline = loop_mm(x, w, bounds)[:, cols]
        for impl, fn in impls.items():
            if impl.startswith("dense"):
                ok = True
            else:
                try:
                    ok = validate.check(fn()[:, cols], want, baseline, atol=1e-2).ok
                except (RuntimeError, NotImplementedError) as error:  # e.g. _grouped_mm not built for this GPU
                    print(f"  {impl}: unavailable ({str(error).splitlines()[0][:100]})")
                    continue
            timing = bench.time_fn(fn)
            row = bench.result_row("grouped_mm", timing, flops=flops, impl=impl, shape=name, routing=_routing(skew))
            rows_out.append({**row, "imbalance": imbalance(counts), "correct": ok})
            print(
                f"{name:13s} {_routing(skew):8s} {impl:22s} {timing.median_ms:8.3f} ms "
                f"{row['tflops']:7.1f} TFLOP/s  imbalance {imbalance(counts):.2f}  ok={ok}",
                flush=True,
            )


def _routing(skew) -> str:
    return "skewed" if skew else "uniform"


def bench_layer(name, T, d, d_ff, E, top_k, rows_out, reps_ms):
    torch.manual_seed(0)
    layer = MoE(d, d_ff, E, top_k, device="cuda", dtype=torch.bfloat16)
    params = (layer.router.weight, layer.w_gate, layer.w_up, layer.w_down)
    compiled_ref = torch.compile(moe_ref)
    flops = 3 * (2 * T * top_k * d * d_ff) * 3  # three grouped GEMMs, forward + 2x backward
    for skew in (False, True):
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        if skew:
            x = skew_router(layer, x, max(1, E // 4), strength=4.0)
        with torch.no_grad():
            experts = (x @ layer.router.weight.T).float().topk(top_k, dim=-1).indices
        counts = torch.bincount(experts.reshape(-1), minlength=E).cpu()
        # Correctness on the first 256 tokens against float64 (routing is per token, so a slice is exact).
        xs = x[:256]
        want, _ = moe_ref(xs.double(), *(p.double() for p in params), top_k)
        baseline, _ = moe_ref(xs, *params, top_k)
        impls = {
            "kernel_lib MoE": layer,
            "moe_ref loop (eager)": lambda x: moe_ref(x, *params, top_k),
            "moe_ref loop (compiled)": lambda x: compiled_ref(x, *params, top_k),
        }
        for impl, fn in impls.items():
            got, _ = fn(xs)
            ok = validate.check(got, want, baseline, atol=1e-2).ok
            leaf = x.detach().requires_grad_()
            inputs = (leaf, *params)

            def step(fn=fn, leaf=leaf, inputs=inputs):
                y, aux = fn(leaf)
                return torch.autograd.grad(y.float().square().mean() + aux, inputs)

            timing = bench.time_fn(step, rep_ms=reps_ms)
            peak = bench.peak_memory_bytes(step)
            row = bench.result_row("moe_layer", timing, flops=flops, impl=impl, shape=name, routing=_routing(skew))
            extra = {"pass": "forward+backward", "peak_gib": peak / 2**30, "imbalance": imbalance(counts)}
            rows_out.append({**row, **extra, "correct": ok})
            print(
                f"{name:13s} {_routing(skew):8s} {impl:24s} {timing.median_ms:8.2f} ms {row['tflops']:7.1f} TFLOP/s "
                f"peak {peak / 2**30:6.2f} GiB  imbalance {imbalance(counts):.2f}  ok={ok}",
                flush=True,
            )
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES))
    parser.add_argument("--parts", default="grouped_mm,layer", help="grouped_mm, layer or both")
    parser.add_argument("--layer-rep-ms", type=float, default=300.0)
    args = parser.parse_args()
    env = bench.require_gpu("bench_moe")
    print(f"bf16 matmul ceiling: {bench.matmul_tflops(torch.bfloat16):,.0f} TFLOP/s", flush=True)
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        if "grouped_mm" in args.parts:
            bench_grouped_mm(name, **shape, rows_out=rows)
        if "layer" in args.parts:
            bench_layer(name, **shape, rows_out=rows, reps_ms=args.layer_rep_ms)
    frame = bench.to_frame(rows)
    print(f"wrote {bench.write_csv(rows, os.path.join(args.out, 'moe.csv'), env=env)}")
    return 0 if frame["correct"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
