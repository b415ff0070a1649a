"""Weight-only int8 / int4 linear layers at decoding's shapes, against bf16 cuBLAS and torchao, in CUDA graphs.

For each weight shape (the 7B Llama's and the 1.1B GQA model's projections) and rows M (1 and 16), int8 and int4
(group 128): the library's default (``kernel_lib.ops.quantized_linear.config``) and, with ``--sweep``, every
setting of its kernels in ``SETTINGS`` (output tile, K step, splits of K, which operand the weight is, warps,
stages); bf16 ``F.linear`` and, when torchao imports, its int8 and int4 weight-only layers compiled
(``torch.compile``, as gpt-fast and torchao's benchmarks run them). Each is checked against the float64
product with its own weight (kernel_lib: the dequantized weight, relative error under 1e-2; torchao: the
original weight, under 3% for int8, 15% for int4) before timing and after.

Timing: a decoding step's kernels take microseconds, so the host is kept out (``bench.graph_ms``: calls replayed
from a CUDA graph) and each replay runs the call on ``copies`` different weights in turn (together over 256 MB,
more than the L2), so every call reads its weight from memory, as a step of a model does. GB/s counts the
layout's weight bytes (bf16: 2 a weight; int8: 1 plus a float32 scale a row; int4: half plus a float32 scale and
zero a group) against the copy ceiling measured in the same run. Writes <out>/quantized_linear.csv and prints, by
case, the best setting, the default and the peers in % of copy.
"""

import argparse
import functools
import itertools
import os
import sys

import torch
import torch.nn.functional as F

from kernel_lib import bench
from kernel_lib.ops import quantized_linear as ql

SHAPES = {  # name -> (N out, K in)
    "7B qkv": (6144, 4096), "7B o": (4096, 4096), "7B gate-up": (28672, 4096), "7B down": (4096, 14336),
    "1B qkv": (3072, 2048), "1B down": (2048, 8192),
}  # fmt: skip
GROUP = 128
COMPILED_LINEAR = torch.compile(F.linear)  # one compilation serves every copy of a torchao weight (same shapes)
SETTINGS = {  # bits -> settings tried: output rows, K a step, splits of K (int4: a step within a group of 128)
    8: [dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, SPLIT_K=sk, SWAP=False, num_warps=4, num_stages=4)
        for n, k, sk in [*itertools.product((32,), (256, 512), (1, 2, 4, 8)),
                         *itertools.product((64,), (256,), (1, 2, 4))]],
    4: [dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, SPLIT_K=sk, SWAP=False, num_warps=4, num_stages=2)
        for n, k, sk in itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8))],
}  # fmt: skip
TIMING = dict(warmup_ms=5, rep_ms=30)  # per setting: a replay of all copies is tens of microseconds


def label(c: dict) -> str:
    swap = "swap " if c.get("SWAP") else ""
    split = f" k/{c['SPLIT_K']}" if c.get("SPLIT_K", 1) > 1 else ""
    return f"{swap}{c['BLOCK_N']}x{c['BLOCK_K']}{split} w{c['num_warps']} s{c['num_stages']}"


def torchao_weights(w: torch.Tensor) -> dict:
    """name -> (w quantized by torchao: a tensor subclass that F.linear dispatches on, its relative error allowed),
    when torchao imports."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except Exception as error:  # noqa: BLE001 - any failure to import means: not measured
        print(f"torchao not measured ({type(error).__name__}: {error})")
        return {}
    layers = {}
    for name, make, allowed in (
        ("torchao int8", lambda: Int8WeightOnlyConfig(), 0.03),
        ("torchao int4", lambda: Int4WeightOnlyConfig(group_size=GROUP, int4_packing_format="tile_packed_to_4d"), 0.15),
    ):
        try:
            layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            layer.weight.data.copy_(w)
            quantize_(layer, make())
            layers[name] = (layer.weight, allowed)
        except Exception as error:  # noqa: BLE001 - a layout this torchao/GPU pair does not offer
            print(f"{name} not measured ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
    return layers


def rotating(calls: list) -> callable:
    """One call after the other over the copies: captured ``len(calls)`` times, each copy once per replay."""
    state = {"i": 0}

    def call():
        out = calls[state["i"] % len(calls)]()
        state["i"] += 1
        return out

    return call


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    parser.add_argument("--sweep", action="store_true", help="every setting too, not only the default")
    args = parser.parse_args()
    env = bench.require_gpu("bench_quantized_linear")
    copy_gbps = bench.copy_bandwidth()
    print(f"copy ceiling {copy_gbps:,.0f} GB/s")
    rows, failures = [], []
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        N, K = SHAPES[shape]
        copies = max(2, min(16, -(-256 * 2**20 // (N * K))))  # int8 copies over 256 MB (bf16 over 512 MB)
        ws = [(torch.randn(N, K, device="cuda") * K**-0.5).bfloat16() for _ in range(copies)]
        q8 = [ql.quantize_int8(w) for w in ws]
        q4 = [ql.quantize_int4(w, GROUP) for w in ws]
        nbytes = {"bf16": 2 * N * K, 8: N * K + 4 * N, 4: N * K // 2 + 8 * N * K // GROUP}
        quantized = [torchao_weights(w) for w in ws]
        ao = {name: [q.get(name) for q in quantized] for name in ("torchao int8", "torchao int4")}
        for M in (int(m) for m in args.rows.split(",")):
            xs = [torch.randn(M, K, device="cuda").bfloat16() for _ in range(copies)]
            truth = {"bf16": xs[0].double() @ ws[0].double().T,
                     8: xs[0].double() @ ql.dequantize_int8(*q8[0]).double().T,
                     4: xs[0].double() @ ql.dequantize_int4(*q4[0]).double().T}  # fmt: skip
            bf16 = [functools.partial(F.linear, x, w) for x, w in zip(xs, ws, strict=True)]
            candidates = [("bf16 F.linear", "bf16", bf16, 1e-2)]
            for name in ao:
                if all(ao[name]):
                    calls = [functools.partial(COMPILED_LINEAR, x, qw) for x, (qw, _) in zip(xs, ao[name], strict=True)]
                    candidates.append((name, 8 if "int8" in name else 4, calls, ao[name][0][1]))
            for bits, packs in ((8, q8), (4, q4)):
                group = GROUP if bits == 4 else 1
                settings = [None] + (SETTINGS[bits] if args.sweep else [])
                for c in settings:
                    calls = [functools.partial(ql._forward, x, p[0], p[1], p[2] if bits == 4 else None, None, bits,
                                               group, c) for x, p in zip(xs, packs, strict=True)]  # fmt: skip
                    candidates.append((f"int{bits} " + ("default" if c is None else label(c)), bits, calls, 1e-2))
            for name, layout, calls, allowed in bench.progress(candidates, desc=f"{shape} M {M}"):
                want = truth["bf16" if name.startswith("torchao") else layout]
                try:
                    with torch.no_grad():
                        err = relative_error(calls[0](), want)
                        if err > allowed:
                            raise AssertionError(f"relative error {err:.2e} > {allowed}")
                        ms = bench.graph_ms(rotating(calls), repeats=copies, **TIMING)
                        err = max(err, relative_error(calls[0](), want))
                except Exception as error:  # noqa: BLE001 - a setting that does not compile or fit is reported
                    failures.append(f"{shape} M {M} {name}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
                    continue
                gbps = nbytes[layout] / ms / 1e6
                rows.append(dict(shape=shape, N=N, K=K, M=M, impl=name, bits=layout, ms=ms, gbps=gbps,
                                 pct_of_copy=100 * gbps / copy_gbps, rel_err=err))  # fmt: skip
        del ws, q8, q4, ao, quantized
        torch.cuda.empty_cache()
    out = os.path.join(args.out, "quantized_linear.csv")
    path = bench.write_csv(rows, out, env={**env, "copy_gbps": copy_gbps})
    frame = bench.to_frame(rows)
    for (shape, M), case in frame.groupby(["shape", "M"], sort=False):
        bf16_us = case[case.impl == "bf16 F.linear"].ms.min() * 1e3
        line = [f"{shape} M {M}: bf16 {bf16_us:.1f} us"]
        for prefix in ("int8", "int4"):
            mine = case[case.impl.str.startswith(prefix)]
            if len(mine):
                best, default = mine.loc[mine.ms.idxmin()], mine[mine.impl == f"{prefix} default"]
                speed = bf16_us / best.ms / 1e3
                line.append(f"{prefix} best [{best.impl[5:]}] {best.pct_of_copy:.0f}% {speed:.2f}x bf16")
                if len(default):
                    line.append(f"default {default.pct_of_copy.iloc[0]:.0f}% {bf16_us / default.ms.iloc[0] / 1e3:.2f}x")
        for name in ("torchao int8", "torchao int4"):
            peer = case[case.impl == name]
            if len(peer):
                line.append(f"{name} {peer.pct_of_copy.iloc[0]:.0f}% {bf16_us / peer.ms.iloc[0] / 1e3:.2f}x")
        print(" | ".join(line))
    for failure in failures:
        print("FAILED", failure)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
