"""Why the norms' backward falls behind at D = 16384: launch settings and a variant without the prefetch, on a GPU.

Not a benchmark of the library: an experiment log (results in benchmarks/NOTES.md). bf16, rows x D = 2^27,
x, weight (and bias) gradients. For each width and variant: the backward kernel's time and GB/s (x and dy read,
dx written; the float32 partials are small), its registers per thread and spilled registers as Triton reports
them, and the compiled reference's forward + backward for scale.

Variants of kernel_lib's persistent backward kernel (one program walks rows_per_program rows, keeping a float32
dweight partial, and dbias for LayerNorm, in registers), W warps (0: row_block_settings' choice), P programs per SM:
  prefetch:{W}p{P}  the loop that loads the next row while this one is reduced (WIDE=False; before this change,
                    every width)
  wide:{W}p{P}      the loop without the prefetch, weight re-read each row (WIDE=True; now rows wider than 8192)
The first run of this script (NOTES.md) also timed a loop without the prefetch that kept the weight in registers.
"""

import argparse
import importlib
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel_lib import bench  # noqa: E402
from kernel_lib._utils import row_block_settings, sm_count  # noqa: E402

rms_mod = importlib.import_module("kernel_lib.rms_norm")
ln_mod = importlib.import_module("kernel_lib.layer_norm")
ROWS = []


def launch(op, variant, warps, per_sm, tensors):
    """Launch one backward variant; returns (compiled kernel, dx, partials)."""
    x, dy, w, stats = tensors
    n_rows, D = x.shape
    block_d = triton.next_power_of_2(D)
    programs = min(n_rows, per_sm * sm_count(x.device.index or 0))
    rows_per_program = triton.cdiv(n_rows, programs)
    programs = triton.cdiv(n_rows, rows_per_program)
    dx = torch.empty_like(x)
    partial = torch.empty((2 if op == "layer_norm" else 1, programs, D), device=x.device, dtype=torch.float32)
    wide = variant == "wide"
    if op == "rms_norm":
        (rstd,) = stats
        kernel = rms_mod._rms_norm_bwd_kernel[(programs,)](
            dy, x, w, rstd, dx, partial, dy.stride(0), x.stride(0), n_rows, D, rows_per_program,
            HAS_WEIGHT=True, WEIGHT_GRAD=True, WIDE=wide, BLOCK_D=block_d, num_warps=warps,
        )  # fmt: skip
    else:
        mean, rstd = stats
        kernel = ln_mod._layer_norm_bwd_kernel[(programs,)](
            dy, x, w, mean, rstd, dx, partial, dy.stride(0), x.stride(0), n_rows, D, 1.0 / D, rows_per_program,
            HAS_WEIGHT=True, WEIGHT_GRAD=True, BIAS_GRAD=True, WIDE=wide, BLOCK_D=block_d, num_warps=warps,
        )  # fmt: skip
    return kernel, dx, partial


def explore(op, D, variants):
    n_rows = 2**27 // D
    x = torch.randn(n_rows, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5
    if op == "rms_norm":
        _, rstd = rms_mod._forward(x, w, 1e-6)
        stats = (rstd,)
        want_dx, want_dw = rms_mod._backward(dy, x, w, rstd)
        bias = None
    else:
        bias = torch.randn(D, device="cuda", dtype=torch.bfloat16)
        _, mean, rstd = ln_mod._forward(x, w, bias, 1e-5)
        stats = (mean, rstd)
        want_dx, want_dw, want_db = ln_mod._backward(dy, x, w, bias, mean, rstd)
    nbytes = 3 * x.numel() * x.element_size()
    _, _, shipped_warps = row_block_settings(D, x.element_size())
    for variant in variants:
        kind, settings = variant.split(":")
        warps, per_sm = (int(v) for v in settings.split("p"))
        warps = warps or shipped_warps
        try:
            kernel, dx, partial = launch(op, kind, warps, per_sm, (x, dy, w, stats))
            torch.testing.assert_close(dx, want_dx, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(partial[0].sum(0).to(w.dtype), want_dw, atol=1e-1, rtol=2e-2)
            if op == "layer_norm":
                torch.testing.assert_close(partial[1].sum(0).to(w.dtype), want_db, atol=1e-1, rtol=2e-2)
        except Exception as error:  # noqa: BLE001 - an experiment: report and go on
            print(f"{op} D={D} {variant}: FAILED {type(error).__name__}: {str(error)[:160]}", flush=True)
            continue
        ms = bench.time_fn(lambda k=kind, w_=warps, p=per_sm: launch(op, k, w_, p, (x, dy, w, stats))).median_ms
        regs, spills = getattr(kernel, "n_regs", -1), getattr(kernel, "n_spills", -1)
        name = f"{kind} w{warps} p{per_sm}"
        ROWS.append({"case": f"{op} bwd D={D}", "variant": name, "ms": ms, "GB/s": bench.gbps(nbytes, ms),
                     "regs": regs, "spills": spills})  # fmt: skip
        print(f"{op:10s} D={D:5d} {name:20s} {ms:7.4f} ms {bench.gbps(nbytes, ms):7.0f} GB/s regs {regs} spills "
              f"{spills}", flush=True)  # fmt: skip
    # The compiled reference's forward + backward (x, weight and bias gradients), for scale.
    leaves = [t.detach().requires_grad_(True) for t in ([x, w] if bias is None else [x, w, bias])]
    ref = rms_mod.rms_norm_ref if op == "rms_norm" else ln_mod.layer_norm_ref
    compiled = torch.compile(ref, dynamic=False)
    ours = rms_mod.rms_norm if op == "rms_norm" else ln_mod.layer_norm
    for got, want in zip(torch.autograd.grad(ours(*leaves), leaves, dy),
                         torch.autograd.grad(compiled(*leaves), leaves, dy), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-1, rtol=2e-2)  # the two steps agree before they are timed
    for impl, fn in [("compiled reference", compiled), ("kernel_lib", ours)]:

        def step(fn=fn):
            return torch.autograd.grad(fn(*leaves), leaves, dy)

        ms = bench.time_fn(bench.repeat_in_graph(step, 5)).median_ms / 5
        ROWS.append({"case": f"{op} fwd+bwd D={D} (graph)", "variant": impl, "ms": ms})
        print(f"{op:10s} D={D:5d} fwd+bwd from a CUDA graph, {impl:20s} {ms:7.4f} ms", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--widths", default="8192,16384")
    parser.add_argument(
        "--variants",
        default="prefetch:0p4,prefetch:16p2,wide:0p4,wide:8p4,wide:16p2,wide:32p1,wide:8p2,wide:4p4",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("explore_wide_norms.py needs a CUDA GPU")
        return 0
    env = bench.environment()
    print(env, flush=True)
    for op in ["rms_norm", "layer_norm"]:
        for D in [int(d) for d in args.widths.split(",")]:
            explore(op, D, args.variants.split(","))
    print(bench.to_frame(ROWS).to_string(), flush=True)
    print("wrote", bench.write_csv(ROWS, os.path.join(args.out, "explore_wide_norms.csv"), env))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
