"""Cross-entropy and linear cross-entropy of kernel_lib against PyTorch eager and torch.compile, on a GPU.

1. cross_entropy, bf16 logits (T, V), T = 8192, V swept up to Llama 3's 128256: forward and forward + backward
   against ``F.cross_entropy(logits.float(), t)`` eager and compiled. GB/s counts the logits read once forward,
   and read twice plus the gradient written once for forward + backward.
2. linear_cross_entropy, T = 8192, d = 4096, V = 128256, bf16: time and peak memory of forward + backward against
   ``F.cross_entropy((h @ W.T).float(), t)`` eager and compiled; TFLOP/s counts the three matmuls (6 T V d).

Every implementation is checked against float64 first. Writes <out>/cross_entropy.csv and prints tables.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from kernel_lib import bench, cross_entropy, cross_entropy_ref, linear_cross_entropy, linear_cross_entropy_ref, validate


def _upcast_ce(logits, target):
    return F.cross_entropy(logits.float(), target)


def _materialized_lce(h, weight, target):
    return F.cross_entropy((h @ weight.T).float(), target)


def bench_cross_entropy(T, vocabularies, rows_out):
    impls = {"kernel_lib": cross_entropy, "F.cross_entropy(float)": _upcast_ce}
    for V in vocabularies:
        impls["compiled F.cross_entropy(float)"] = torch.compile(_upcast_ce, dynamic=False)
        logits = torch.randn(T, V, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, V, (T,), device="cuda")
        target[: T // 10] = -100
        want = cross_entropy_ref(logits.double(), target)
        nbytes = T * V * logits.element_size()
        for impl, fn in impls.items():
            ok = validate.check(fn(logits, target), want, atol=1e-3, rtol=1e-4).ok
            leaf = logits.detach().requires_grad_()
            forward = bench.time_fn(lambda fn=fn, x=logits, t=target: fn(x, t))
            both = bench.time_fn(lambda fn=fn, x=leaf, t=target: torch.autograd.grad(fn(x, t), x))
            for pass_name, timing, moved in (("forward", forward, 1), ("forward+backward", both, 3)):
                row = bench.result_row("cross_entropy", timing, nbytes=moved * nbytes, impl=impl, T=T, V=V)
                rows_out.append({**row, "pass": pass_name, "correct": ok})
            print(
                f"V={V} {impl}: forward {forward.median_ms:.3f} ms, forward+backward {both.median_ms:.3f} ms",
                flush=True,
            )
        del logits
        torch.cuda.empty_cache()


def bench_linear_cross_entropy(T, d, V, rows_out):
    h = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(V, d, device="cuda") / d**0.5).to(torch.bfloat16)
    target = torch.randint(0, V, (T,), device="cuda")
    want = linear_cross_entropy_ref(h.double(), weight.double(), target)
    impls = {
        "kernel_lib": linear_cross_entropy,
        "F.cross_entropy(h @ W.T)": _materialized_lce,
        "compiled F.cross_entropy(h @ W.T)": torch.compile(_materialized_lce, dynamic=False),
    }
    for impl, fn in impls.items():
        ok = validate.check(fn(h, weight, target), want, atol=1e-3, rtol=1e-4).ok
        h_leaf, w_leaf = h.detach().requires_grad_(), weight.detach().requires_grad_()

        def step(fn=fn, h_leaf=h_leaf, w_leaf=w_leaf):
            return torch.autograd.grad(fn(h_leaf, w_leaf, target), (h_leaf, w_leaf))

        timing = bench.time_fn(step, rep_ms=300)
        peak = bench.peak_memory_bytes(step)
        row = bench.result_row("linear_cross_entropy", timing, flops=6 * T * V * d, impl=impl, T=T, d=d, V=V)
        rows_out.append({**row, "pass": "forward+backward", "peak_gib": peak / 2**30, "correct": ok})
        print(f"linear_cross_entropy {impl}: {timing.median_ms:.2f} ms, peak {peak / 2**30:.2f} GiB", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocabularies", default="32000,50257,128256")
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    env = bench.require_gpu("bench_cross_entropy")
    rows = []
    vocabularies = [int(v) for v in args.vocabularies.split(",")]
    bench_cross_entropy(args.tokens, vocabularies, rows)
    bench_linear_cross_entropy(args.tokens, args.hidden, vocabularies[-1], rows)
    frame = bench.to_frame(rows)
    print(frame.drop(columns=["p20_ms", "p80_ms"]).to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
    print(f"wrote {bench.write_csv(rows, os.path.join(args.out, 'cross_entropy.csv'), env=env)}")
    return 0 if frame["correct"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
