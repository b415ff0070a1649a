"""Weight-only quantized linear layers at decoding's batch sizes: kernel_lib's int8 / int4 against bf16 F.linear and,
when installed, torchao's int8 / int4 weight-only layouts.

The 7B Llama shapes (d 4096, d_ff 14,336: the q/o, the gate-or-up and the down projection) at M = 1 and 16 rows.
Decoding is memory-bound, so GB/s counts the weight bytes each layout reads (bf16: 2 a weight; int8: 1 plus a
float32 scale a row; int4: half plus a float32 scale and zero a group) against the copy ceiling measured in the same
run. Correctness first and again after timing: kernel_lib's kernels against the float64 product with their own
dequantized weights (the quantization is the quantizer's job, tested apart), torchao's output against the float64
product with the original weights within 3% relative error (int8) or 15% (int4). Times: ``kernel_lib.bench.time_fn``
with L2 wiped. Writes <out>/quantized_linear.csv and prints a table.
"""

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

from kernel_lib import bench
from kernel_lib.ops.quantized_linear import (
    dequantize_int4,
    dequantize_int8,
    int4_linear,
    int8_linear,
    quantize_int4,
    quantize_int8,
)

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N out, K in)
GROUP = 128


def torchao_linears(w: torch.Tensor) -> dict:
    """name -> (a bf16 nn.Linear quantized by torchao, its max relative error allowed), when torchao imports."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except Exception as error:  # noqa: BLE001 - any failure to import means: not measured
        print(f"torchao not measured ({type(error).__name__}: {error})")
        return {}
    made = {}
    for name, config, allowed in (("torchao int8", Int8WeightOnlyConfig(), 0.03),
                                  ("torchao int4", Int4WeightOnlyConfig(group_size=GROUP), 0.15)):  # fmt: skip
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(w)
        try:
            quantize_(layer, config)
            made[name] = (layer, allowed)
        except Exception as error:  # noqa: BLE001 - a layout this torchao/GPU pair does not offer
            print(f"{name} not measured ({type(error).__name__}: {str(error)[:200]})")
    return made


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--rows", default="1,16")
    args = parser.parse_args()
    env = bench.require_gpu("bench_quantized_linear")
    copy_gbps = bench.copy_bandwidth()
    print(f"copy ceiling {copy_gbps:,.0f} GB/s")
    rows = []
    torch.manual_seed(0)
    for N, K in SHAPES:
        w = (torch.randn(N, K, device="cuda") * K**-0.5).bfloat16()
        q8, s8 = quantize_int8(w)
        q4, s4, z4 = quantize_int4(w, GROUP)
        w8, w4 = dequantize_int8(q8, s8).double(), dequantize_int4(q4, s4, z4).double()
        weight_bytes = {"bf16 F.linear": 2 * N * K, "kernel_lib int8": N * K + 4 * N,
                        "kernel_lib int4": N * K // 2 + 8 * N * K // GROUP}  # fmt: skip
        weight_bytes.update({"torchao int8": weight_bytes["kernel_lib int8"],
                             "torchao int4": weight_bytes["kernel_lib int4"]})  # fmt: skip
        ao = torchao_linears(w)
        for M in (int(m) for m in args.rows.split(",")):
            x = torch.randn(M, K, device="cuda").bfloat16()
            exact = x.double() @ w.double().T
            impls = {  # name -> (fn, its float64 truth, the largest error allowed, relative)
                "bf16 F.linear": (functools.partial(F.linear, x, w), exact, 1e-2),
                "kernel_lib int8": (functools.partial(int8_linear, x, q8, s8), x.double() @ w8.T, 1e-2),
                "kernel_lib int4": (functools.partial(int4_linear, x, q4, s4, z4), x.double() @ w4.T, 1e-2),
            }
            for name, (layer, allowed) in ao.items():
                impls[name] = (functools.partial(layer, x), exact, allowed)
            for name, (fn, truth, allowed) in impls.items():
                with torch.no_grad():
                    before = relative_error(fn(), truth)
                    timing = bench.time_fn(fn)
                    after = relative_error(fn(), truth)
                err = max(before, after)
                status = "ok" if err <= allowed else "FAIL"
                rows.append(bench.result_row("quantized linear", timing, nbytes=weight_bytes[name], N=N, K=K, M=M,
                                             impl=name, rel_err=err, status=status))  # fmt: skip
                print(f"N {N} K {K} M {M} {name}: {timing.median_ms * 1e3:.1f} us, "
                      f"{rows[-1]['gbps']:,.0f} GB/s, rel err {err:.1e} {status}", flush=True)  # fmt: skip
    path = bench.write_csv(rows, os.path.join(args.out, "quantized_linear.csv"), env={**env, "copy_gbps": copy_gbps})
    frame = bench.to_frame(rows)
    frame["pct_of_copy"] = 100 * frame["gbps"] / copy_gbps
    print(frame.pivot_table(index=["M", "impl"], columns=["N", "K"], values="pct_of_copy").to_string(
        float_format=lambda v: f"{v:.1f}"))  # fmt: skip
    print(f"wrote {path}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
