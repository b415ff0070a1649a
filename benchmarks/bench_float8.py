"""A linear layer's training step (forward and both backward products) in float8 against bf16, at Llama-3-8B shapes.

kernel_lib's ``float8_linear`` (rowwise e4m3 scales, and the blockwise recipe; Triton products), bf16 ``F.linear``
(cuBLAS), and when it imports, torchao's ``Float8Linear`` with its rowwise recipe, compiled (``torch.compile``, as
torchao runs it). 8,192 tokens through the 8B model's q (4096 -> 4096), gate (4096 -> 14,336) and down (14,336 ->
4096) projections: forward and backward of x and the weight, 6 M N K FLOPs a step. Each is checked against float64
on the same bf16 inputs before and after timing: the float8 formats within 5% relative error (e4m3's step is 2^-3 of
a value; errors average out over K), bf16 within 1%. Times: ``kernel_lib.bench.time_fn`` with L2 wiped. TFLOP/s
against the bf16 matmul ceiling measured in the same run (float8's tensor-core peak is twice bf16's on Hopper).
First, the forward product alone at each shape: bf16 ``torch.mm``, kernel_lib's ``scaled_mm`` and
``torch._scaled_mm`` (cuBLAS, rowwise scales), each with and without fast accumulation, on the same float8 operands,
to split a step's time between products and casts. Writes <out>/float8.csv and prints a table.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from kernel_lib import bench, float8_linear
from kernel_lib.ops.float8 import (
    quantize_float8,
    quantize_float8_blocks,
    scaled_mm,
    scaled_mm_blocks,
    scaled_mm_blocks_ref,
)

SHAPES = {"q 4096 -> 4096": (4096, 4096), "gate 4096 -> 14336": (4096, 14336), "down 14336 -> 4096": (14336, 4096)}
TOKENS = 8192


def torchao_layer(w: torch.Tensor):
    """A compiled nn.Linear converted by torchao's float8 training (rowwise), or None with the reason printed."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        layer.weight.data.copy_(w)
        holder = torch.nn.Sequential(layer)
        convert_to_float8_training(holder, config=Float8LinearConfig.from_recipe_name("rowwise"))
        return torch.compile(holder)
    except Exception as error:  # noqa: BLE001 - any failure means: not measured, said so
        print(f"torchao not measured ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
        return None


def step(fn, x, w, dy):
    """Forward and backward of one layer; returns (y, dx, dw)."""
    x.grad = w.grad = None
    y = fn(x, w)
    y.backward(dy)
    return y, x.grad, w.grad


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def gemm_alone(M: int, N: int, K: int) -> list[dict]:
    """The forward product alone, (M, K) x (N, K)^T: bf16 ``torch.mm`` (cuBLAS), kernel_lib's ``scaled_mm`` and
    ``torch._scaled_mm`` (cuBLAS, rowwise scales) on the same float8 operands; each checked against float64."""
    a = torch.randn(M, K, device="cuda").bfloat16()
    b = (torch.randn(N, K, device="cuda") * K**-0.5).bfloat16()
    qa, sa = quantize_float8(a)
    qb, sb = quantize_float8(b)
    want = (qa.double() * sa.double()[:, None]) @ (qb.double() * sb.double()[:, None]).T  # the float8 product
    qa1, sa1 = quantize_float8_blocks(a, 1)  # DeepSeek-V3's blocks: 1 x 128 for a, 128 x 128 for b
    qb128, sb128 = quantize_float8_blocks(b, 128)
    want_blocks = scaled_mm_blocks_ref(qa1, qb128, sa1, sb128, torch.float64)
    impls = {
        "bf16 torch.mm": (lambda: a @ b.T, (a.double() @ b.double().T), 0.01),
        "kernel_lib scaled_mm": (lambda: scaled_mm(qa, qb, sa, sb), want, 0.01),
        "kernel_lib scaled_mm fast": (lambda: scaled_mm(qa, qb, sa, sb, fast_accum=True), want, 0.01),
        "kernel_lib scaled_mm_blocks": (lambda: scaled_mm_blocks(qa1, qb128, sa1, sb128), want_blocks, 0.01),
    }
    if hasattr(torch, "_scaled_mm"):
        for fast in (False, True):
            impls[f"torch._scaled_mm rowwise{' fast' if fast else ''}"] = (
                lambda fast=fast: torch._scaled_mm(
                    qa, qb.T, sa[:, None], sb[None, :], out_dtype=torch.bfloat16, use_fast_accum=fast
                ),
                want,
                0.01,
            )
    rows = []
    for name, (fn, truth, allowed) in impls.items():
        try:
            err = relative_error(fn(), truth)
            timing = bench.time_fn(fn)
            err = max(err, relative_error(fn(), truth))
        except Exception as error:  # noqa: BLE001 - a product this torch does not offer is reported, not fatal
            print(f"gemm {M}x{N}x{K} {name}: not measured ({type(error).__name__}: {str(error)[:100]})")
            continue
        tflops = 2 * M * N * K / timing.median_ms / 1e9
        status = "ok" if err <= allowed else "FAIL"
        rows.append(dict(shape=f"gemm {N}x{K}", M=M, N=N, K=K, impl=name, ms=timing.median_ms, tflops=tflops,
                         rel_err=err, status=status))  # fmt: skip
        print(f"gemm M {M} N {N} K {K:<6} {name:<26} {timing.median_ms:8.3f} ms {tflops:7.0f} TFLOP/s  err {err:.1e} "
              f"{status}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--shapes", default="q,gate,down", help="which projections, in this order (q, gate, down)")
    parser.add_argument("--no-gemm", action="store_true", help="skip the products alone; time the layer's step only")
    args = parser.parse_args()
    env = bench.require_gpu("bench_float8")
    ceiling = bench.matmul_tflops(torch.bfloat16)
    print(f"bf16 matmul ceiling {ceiling:,.0f} TFLOP/s")
    rows, failed = [], False
    torch.manual_seed(0)
    names = {name.split()[0]: name for name in SHAPES}
    shapes = {names[key]: SHAPES[names[key]] for key in args.shapes.split(",")}
    for K, N in [] if args.no_gemm else shapes.values():
        gemm_rows = gemm_alone(args.tokens, N, K)
        failed |= any(r["status"] != "ok" for r in gemm_rows)
        rows += gemm_rows
    for shape, (K, N) in shapes.items():
        M = args.tokens
        x = torch.randn(M, K, device="cuda").bfloat16().requires_grad_()
        w = (torch.randn(N, K, device="cuda") * K**-0.5).bfloat16().requires_grad_()
        dy = torch.randn(M, N, device="cuda").bfloat16()
        xd, wd, dyd = x.detach().double(), w.detach().double(), dy.double()
        want = (xd @ wd.T, dyd @ wd, dyd.T @ xd)
        impls = {
            "bf16 F.linear": (F.linear, 0.01),
            "kernel_lib float8_linear": (float8_linear, 0.05),
            "kernel_lib float8_linear blockwise": (lambda x_, w_: float8_linear(x_, w_, recipe="blockwise"), 0.05),
        }
        ao = torchao_layer(w.detach())
        if ao is not None:
            impls["torchao Float8Linear (compiled)"] = (lambda x_, w_, m=ao: m(x_), 0.05)
        for name, (fn, allowed) in impls.items():
            if name.startswith("torchao"):  # its own weight: gradients land there
                weight = ao._orig_mod[0].weight  # the compiled wrapper's module
            else:
                weight = w
            errors = []
            outputs = step(fn, x, weight, dy)
            errors += [relative_error(o, t) for o, t in zip(outputs, want, strict=True)]
            timing = bench.time_fn(lambda fn=fn, weight=weight, x=x, dy=dy: step(fn, x, weight, dy))
            outputs = step(fn, x, weight, dy)
            errors += [relative_error(o, t) for o, t in zip(outputs, want, strict=True)]
            err = max(errors)
            status = "ok" if err <= allowed else "FAIL"
            failed |= status != "ok"
            tflops = 6 * M * N * K / timing.median_ms / 1e9
            rows.append(dict(shape=shape, M=M, N=N, K=K, impl=name, ms=timing.median_ms, tflops=tflops,
                             pct_of_bf16_ceiling=100 * tflops / ceiling, rel_err=err, status=status))  # fmt: skip
            print(f"{shape:<20} {name:<34} {timing.median_ms:8.3f} ms {tflops:7.0f} TFLOP/s  err {err:.1e} {status}",
                  flush=True)  # fmt: skip
    path = bench.write_csv(rows, os.path.join(args.out, "float8.csv"), env={**env, "bf16_ceiling_tflops": ceiling})
    frame = bench.to_frame(rows)
    table = frame.pivot_table(index="impl", columns="shape", values="tflops")
    print(table.to_string(float_format=lambda v: f"{v:.0f}"))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
