"""The backward of kernel_lib.flash_attention in its three ways of computing dq (``attention.DQ_MODES``) against
SDPA's cuDNN and FlashAttention-2 backends, with a sweep of the dK/dV kernel's configs, on a GPU.

``kernel`` recomputes the scores in a second kernel per query block (seven matmuls, run to run identical);
``atomic`` and ``descriptor`` add each key block's share of dq into a float32 buffer from the dK/dV kernel (five
matmuls), with atomic adds or with the tensor memory accelerator's reductions (SM90). First every mode is checked
on odd cases (GQA, N != M, windows, head dims 40 to 256, Dv != D, fp16 and bf16, packed sequences) against
float64 with FlashAttention's rule: error of dq, dk and dv at most 2x PyTorch's own in that precision. Then for
each shape (bf16, 16k tokens a batch, 2048 / D heads) the backward alone is timed (autograd with the graph
retained, the forward outside the timing) for each mode, each config of ``SWEEP`` and SDPA's backends, and the
gradients compared with the ``kernel`` mode's. TFLOP/s counts 2.5 x 4 B H N M D over the visible pairs. Writes
<out>/attention_backward.csv and prints the table, each shape's fastest first.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

from kernel_lib import attention_ref, bench, flash_attention
from kernel_lib.ops import attention as attention_module
from kernel_lib.ops import attention_kernels as kernels
from kernel_lib.ops.attention import attention_varlen_ref, flash_attention_varlen

SHAPES = [  # (N, D, Dv, causal): the table, then the head dims real models use
    (4096, 128, 128, False), (4096, 128, 128, True), (16384, 128, 128, False), (16384, 128, 128, True),
    (4096, 64, 64, False), (16384, 64, 64, True), (4096, 80, 80, False), (4096, 96, 96, True),
    (4096, 192, 128, True), (4096, 256, 256, True),
]  # fmt: skip

# dK/dV configs (BLOCK_M, BLOCK_N, warps, stages) timed in the atomic modes besides the library's own choice
SWEEP = [(64, 128, 8, 2)]

# Odd cases checked against float64 before timing: (B, Hq, Hkv, N, M, D, Dv, causal, window, dtype)
CHECKS = [
    (2, 4, 2, 1000, 1000, 128, 128, True, None, torch.bfloat16), (1, 4, 1, 300, 700, 64, 64, True, None, torch.float16),
    (1, 2, 2, 700, 300, 128, 128, True, None, torch.bfloat16), (2, 3, 3, 513, 513, 80, 80, False, None, torch.bfloat16),
    (1, 4, 4, 1024, 1024, 96, 96, True, 200, torch.bfloat16), (1, 2, 1, 129, 1, 40, 40, False, None, torch.float16),
    (1, 2, 2, 2048, 2048, 192, 128, True, None, torch.bfloat16), (1, 2, 2, 1023, 1024, 256, 256, True, None,
    torch.float16), (3, 2, 2, 1, 77, 59, 59, True, None, torch.bfloat16),
]  # fmt: skip


def with_mode(mode: str, fn):
    """Run fn with the backward's dq computed the given way (attention.dq_mode patched)."""
    chooser = attention_module.dq_mode
    attention_module.dq_mode = lambda q: mode
    try:
        return fn()
    finally:
        attention_module.dq_mode = chooser


def without_tma(fn):
    """Run fn with the dK/dV kernel's pointer loads of q and dout (attention.dkdv_tma patched)."""
    chooser = attention_module.dkdv_tma
    attention_module.dkdv_tma = lambda q, packed: not packed
    try:
        return fn()
    finally:
        attention_module.dkdv_tma = chooser


def with_config(row: tuple, fn):
    """Run fn with the dK/dV kernel's config forced to (BLOCK_M, BLOCK_N, warps, stages)."""
    preferred = kernels.dkdv_preferred
    kernels.dkdv_preferred = lambda *args, **kwargs: kernels._configs(row)
    try:
        return fn()
    finally:
        kernels.dkdv_preferred = preferred


def grads(fn, inputs, g):
    out = fn(*inputs)
    return torch.autograd.grad(out, inputs, g)


def own_error(ref_grads, low_grads) -> list:
    return [(lo.double() - r).abs().max().item() for lo, r in zip(low_grads, ref_grads)]


def check_case(B, Hq, Hkv, N, M, D, Dv, causal, window, dtype) -> bool:
    """Every mode's gradients on one case against float64, with PyTorch's own error as the yardstick."""
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, M, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, M, Dv, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(B, Hq, N, Dv, device="cuda", dtype=dtype)
    ref = grads(lambda *t: attention_ref(*t, causal, window), [t.double() for t in (q, k, v)], g.double())
    own = own_error(ref, grads(lambda *t: attention_ref(*t, causal, window), [q, k, v], g))
    good = True
    for mode in attention_module.DQ_MODES:
        got = with_mode(mode, lambda: grads(lambda *t: flash_attention(*t, causal=causal, window=window), [q, k, v], g))
        errs = own_error(ref, got)
        slack = 1e-3 if dtype == torch.float16 else 1e-2
        ok = all(e <= 2 * o + slack for e, o in zip(errs, own)) and all(bool(torch.isfinite(t).all()) for t in got)
        good &= ok
        print(f"check {(B, Hq, Hkv, N, M, D, Dv, causal, window, str(dtype))} {mode}: dq/dk/dv err "
              f"{'/'.join(f'{e:.1e}' for e in errs)}, PyTorch {'/'.join(f'{e:.1e}' for e in own)} "
              f"-> {'ok' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return good


def check_packed(dtype=torch.bfloat16, H=4, Hkv=2, D=128) -> bool:
    """Packed sequences (uneven lengths, GQA, causal), every mode, against float64 per sequence."""
    lengths = [1, 300, 129, 1000, 64]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    total = sum(lengths)
    q = torch.randn(total, H, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(total, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(total, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(total, H, D, device="cuda", dtype=dtype)
    ref = grads(lambda *t: attention_varlen_ref(*t, cu, cu, causal=True), [t.double() for t in (q, k, v)], g.double())
    own = own_error(ref, grads(lambda *t: attention_varlen_ref(*t, cu, cu, causal=True), [q, k, v], g))
    good = True
    for mode in attention_module.DQ_MODES:
        run = lambda *t: flash_attention_varlen(*t, cu, cu, max(lengths), max(lengths), causal=True)  # noqa: E731
        errs = own_error(ref, with_mode(mode, lambda: grads(run, [q, k, v], g)))
        ok = all(e <= 2 * o + 1e-2 for e, o in zip(errs, own))
        good &= ok
        print(f"check packed {lengths} {mode}: dq/dk/dv err {'/'.join(f'{e:.1e}' for e in errs)}, PyTorch "
              f"{'/'.join(f'{e:.1e}' for e in own)} -> {'ok' if ok else 'FAIL'}", flush=True)  # fmt: skip
    return good


def measure_shape(rows: list, N: int, D: int, Dv: int, causal: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H = max(1, 16384 // N), 2048 // D
    q, k = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, N, Dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(B, H, N, Dv, device="cuda", dtype=torch.bfloat16)
    flops = 2.5 * 2 * B * H * (D + Dv) * bench.visible_pairs(N, causal=causal)
    shape = dict(N=N, D=D, Dv=Dv, causal=causal, B=B, H=H)
    want = with_mode("kernel", lambda: grads(lambda *t: flash_attention(*t, causal=causal), [q, k, v], g))

    def record(name, forward, wrap=lambda fn: fn()):
        try:
            start = time.perf_counter()
            out = wrap(lambda: forward(q, k, v))
            got = wrap(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
            torch.cuda.synchronize()
            first = time.perf_counter() - start
        except Exception as error:  # noqa: BLE001 - a backend or config that refuses this shape
            print(f"{shape} {name}: failed ({type(error).__name__}: {str(error)[:200]})", flush=True)
            return
        timing = bench.time_fn(lambda: wrap(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)))
        errs = [(a.double() - b.double()).abs().max().item() for a, b in zip(got, want)]
        rows.append(bench.result_row("attention backward", timing, flops=flops, **shape, impl=name, first_call_s=first,
                                     err_dq=errs[0], err_dk=errs[1], err_dv=errs[2]))  # fmt: skip
        print(f"{shape} {name}: {rows[-1]['tflops']:.0f} TFLOP/s, first {first:.2f} s, err vs kernel mode "
              f"{'/'.join(f'{e:.1e}' for e in errs)}", flush=True)  # fmt: skip

    ours = lambda *t: flash_attention(*t, causal=causal)  # noqa: E731
    for mode in attention_module.DQ_MODES:
        record(f"kernel_lib {mode}", ours, lambda fn, mode=mode: with_mode(mode, fn))
        record(f"kernel_lib {mode} TMA", ours, lambda fn, mode=mode: with_mode(mode, lambda: without_tma(fn)))
    for mode in ("atomic", "descriptor"):
        for row in SWEEP:
            record(f"{mode} {row}", ours, lambda fn, mode=mode, row=row: with_mode(mode, lambda: with_config(row, fn)))
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
    checked = True
    if not args.no_checks:
        checked = all([check_case(*case) for case in CHECKS]) & check_packed()
    rows = []
    for N, D, Dv, causal in [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES:
        measure_shape(rows, N, D, Dv, causal)
        torch.cuda.empty_cache()
    frame = bench.to_frame(rows)
    frame = frame.sort_values(["N", "D", "Dv", "causal", "tflops"], ascending=[True, True, True, True, False])
    columns = ["N", "D", "Dv", "causal", "impl", "median_ms", "tflops", "first_call_s", "err_dq", "err_dk", "err_dv"]
    print(frame[columns].to_string(index=False, float_format=lambda value: f"{value:,.3g}"))
    print(f"wrote {bench.write_csv(rows, os.path.join(args.out, 'attention_backward.csv'), env=env)}")
    return 0 if checked else 1


if __name__ == "__main__":
    sys.exit(main())
