"""The backward of kernel_lib.flash_attention on Hopper: the Gluon kernel of ``attention_hopper.py`` against the
portable Triton kernels and SDPA's cuDNN and FlashAttention-2 backends, on an SM90 GPU.

First the library's backward is checked on odd cases (GQA, N != M, windows, head dims 64 to 128, Dv != D, fp16
and bf16) against float64 with FlashAttention's rule: error of dq, dk and dv at most 2x PyTorch's own in that
precision; each case says which path ran. Then for each shape (bf16, 16k tokens a batch, 2048 / D heads) the
backward alone is timed (autograd with the graph retained, the forward outside the timing) for the library's
choice, the portable kernels (``KERNEL_LIB_ATTENTION=portable``) and SDPA's backends, and the gradients compared
with the portable kernels' before and after the timing (the script fails past 2e-2). TFLOP/s counts 2.5 x 4 B H N M
D over the visible pairs. Writes <out>/attention_backward.csv and prints the table, each shape's fastest first.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from sweep_attention_hopper import portable, sweep_shapes  # this folder's script

from kernel_lib import attention_ref, bench, flash_attention
from kernel_lib.ops import attention as attention_module

SHAPES = [  # (N, D, Dv, causal): the table, then the head dims real models use
    (4096, 128, 128, False), (4096, 128, 128, True), (16384, 128, 128, False), (16384, 128, 128, True),
    (4096, 64, 64, False), (16384, 64, 64, True), (4096, 80, 80, False), (4096, 96, 96, True),
    (4096, 192, 128, True), (4096, 128, 64, True),
]  # fmt: skip

# Odd cases checked against float64 before timing: (B, Hq, Hkv, N, M, D, Dv, causal, window, dtype)
CHECKS = [
    (2, 4, 2, 1000, 1000, 128, 128, True, None, torch.bfloat16), (1, 4, 1, 300, 700, 128, 128, True, None,
    torch.float16), (1, 2, 2, 700, 300, 128, 128, True, None, torch.bfloat16), (2, 3, 3, 513, 513, 80, 80, False,
    None, torch.bfloat16), (1, 4, 4, 1024, 1024, 96, 96, True, 200, torch.bfloat16), (1, 2, 1, 129, 1, 128, 128,
    False, None, torch.float16), (1, 2, 2, 2048, 2048, 128, 64, True, 1000, torch.bfloat16), (3, 2, 2, 1, 77, 72,
    72, True, None, torch.bfloat16), (1, 2, 2, 333, 333, 100, 128, False, None, torch.float16), (2, 2, 2, 4096,
    4096, 128, 128, False, None, torch.bfloat16), (1, 2, 2, 1023, 1024, 64, 64, True, None, torch.float16),
]  # fmt: skip


def grads(fn, inputs, g):
    return torch.autograd.grad(fn(*inputs), inputs, g)


def max_errors(got, want) -> list:
    return [(a.double() - b.double()).abs().max().item() for a, b in zip(got, want, strict=True)]


def check_case(B, Hq, Hkv, N, M, D, Dv, causal, window, dtype) -> bool:
    """The library's gradients on one case against float64, with PyTorch's own error as the yardstick."""
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, M, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, M, Dv, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(B, Hq, N, Dv, device="cuda", dtype=dtype)
    reference = lambda *t: attention_ref(*t, causal, window)  # noqa: E731
    ref = grads(reference, [t.double() for t in (q, k, v)], g.double())
    own = max_errors(grads(reference, [q, k, v], g), ref)
    path = "hopper" if attention_module.uses_hopper_backward(q, k, v, g, D**-0.5, False) else "portable"
    ours = lambda *t: flash_attention(*t, causal=causal, window=window)  # noqa: E731
    got = grads(ours, [q, k, v], g)
    low = portable(lambda: grads(ours, [q, k, v], g))
    errs = max_errors(got, ref)
    slack = 1e-3 if dtype == torch.float16 else 1e-2
    ok = all(e <= 2 * o + slack for e, o in zip(errs, own, strict=True))
    ok = ok and all(bool(torch.isfinite(t).all()) for t in got)
    print(f"check {(B, Hq, Hkv, N, M, D, Dv, causal, window, str(dtype))} path={path}: dq/dk/dv err "
          f"{'/'.join(f'{e:.1e}' for e in errs)}, PyTorch {'/'.join(f'{e:.1e}' for e in own)}, vs portable "
          f"{'/'.join(f'{e:.1e}' for e in max_errors(got, low))} -> {'ok' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return ok


def measure_shape(rows: list, N: int, D: int, Dv: int, causal: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H = max(1, 16384 // N), 2048 // D
    q, k = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, N, Dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(B, H, N, Dv, device="cuda", dtype=torch.bfloat16)
    flops = 2.5 * 2 * B * H * (D + Dv) * bench.visible_pairs(N, causal=causal)
    shape = dict(N=N, D=D, Dv=Dv, causal=causal, B=B, H=H)
    ours = lambda *t: flash_attention(*t, causal=causal)  # noqa: E731
    want = portable(lambda: grads(ours, [q, k, v], g))

    def record(name, forward, wrap=lambda fn: fn()):
        try:
            start = time.perf_counter()
            out = wrap(lambda: forward(q, k, v))
            got = wrap(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
            torch.cuda.synchronize()
            first = time.perf_counter() - start
        except Exception as error:  # noqa: BLE001 - a backend that refuses this shape
            print(f"{shape} {name}: failed ({type(error).__name__}: {str(error)[:200]})", flush=True)
            return
        timing = bench.time_fn(lambda: wrap(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)))
        after = wrap(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))  # checked again after timing
        errs = [max(a, b) for a, b in zip(max_errors(got, want), max_errors(after, want), strict=True)]
        rows.append(bench.result_row("attention backward", timing, flops=flops, **shape, impl=name, first_call_s=first,
                                     err_dq=errs[0], err_dk=errs[1], err_dv=errs[2]))  # fmt: skip
        print(f"{shape} {name}: {rows[-1]['tflops']:.0f} TFLOP/s, first {first:.2f} s, err vs portable "
              f"{'/'.join(f'{e:.1e}' for e in errs)}", flush=True)  # fmt: skip

    path = "hopper" if attention_module.uses_hopper_backward(q, k, v, g, D**-0.5, False) else "portable"
    record(f"kernel_lib ({path})", ours)
    record("kernel_lib portable", ours, portable)
    for name, backend in (("SDPA CUDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA FLASH", SDPBackend.FLASH_ATTENTION)):
        sdpa = lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal)  # noqa: E731
        record(name, sdpa, lambda fn, backend=backend: _within(sdpa_kernel(backend), fn))


def _within(context, fn):
    with context:
        return fn()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--shapes", default="", help="indices into SHAPES, comma-separated (all)")
    parser.add_argument("--no-checks", action="store_true", help="skip the float64 checks")
    args = parser.parse_args()
    env = bench.require_gpu("sweep_attention_backward")
    checked = args.no_checks or all([check_case(*case) for case in CHECKS])
    rows, frame = sweep_shapes(measure_shape, SHAPES, args.shapes)
    columns = ["N", "D", "Dv", "causal", "impl", "median_ms", "tflops", "first_call_s", "err_dq", "err_dk", "err_dv"]
    print(frame[columns].to_string(index=False, float_format=lambda value: f"{value:,.3g}"))
    print(f"wrote {bench.write_csv(rows, os.path.join(args.out, 'attention_backward.csv'), env=env)}")
    agrees = (frame[["err_dq", "err_dk", "err_dv"]] < 2e-2).all().all()  # as sweep_attention_hopper's forward rule
    return 0 if checked and agrees else 1


if __name__ == "__main__":
    sys.exit(main())
