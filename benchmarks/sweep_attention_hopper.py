"""The Hopper forward of kernel_lib.flash_attention (``attention_hopper.py``) against the portable Triton kernel
and SDPA's cuDNN and FlashAttention-2 backends, with a sweep of its configs, on an SM90 GPU.

First the library's forward (which takes the Hopper kernel where it applies) is checked on odd cases (GQA,
N != M, windows, head dims 40 to 128, Dv != D, fp16 and bf16) against float64 with FlashAttention's rule: error at
most 2x PyTorch's own in that precision. Then for each shape (bf16, 16k tokens a batch, 2048 / D heads) each
implementation and each config of ``SWEEP`` is timed; the config outputs are checked against the portable
kernel's (and the last 128 queries of one head against float64), on outputs poisoned with NaN before the first
call, whose time (compilation included) is recorded. TFLOP/s counts 4 B H N M D over the visible pairs. Writes
<out>/attention_hopper.csv and prints the table, each shape's fastest first.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

from kernel_lib import attention_ref, bench, flash_attention
from kernel_lib.ops import attention as attention_module
from kernel_lib.ops import attention_hopper as hopper

SHAPES = [  # (N, D, Dv, causal): the table, then the head dims real models use
    (4096, 128, 128, False), (4096, 128, 128, True), (16384, 128, 128, False), (16384, 128, 128, True),
    (4096, 64, 64, False), (16384, 64, 64, True), (4096, 80, 80, False), (4096, 96, 96, True),
    (4096, 128, 64, True),
]  # fmt: skip

SWEEP = [  # launch keywords of the Hopper kernel besides the library's own (hopper.config)
    dict(BLOCK_N=64, STAGES=4, CONSUMER_REGS=240, num_warps=4),
    dict(BLOCK_N=128, STAGES=3, CONSUMER_REGS=232, num_warps=4),
]

# Odd cases checked against float64 before timing: (B, Hq, Hkv, N, M, D, Dv, causal, window, dtype)
CHECKS = [
    (2, 4, 2, 1000, 1000, 128, 128, True, None, torch.bfloat16), (1, 4, 1, 300, 700, 64, 64, True, None, torch.float16),
    (1, 2, 2, 700, 300, 128, 128, True, None, torch.bfloat16), (2, 3, 3, 513, 513, 80, 80, False, None, torch.bfloat16),
    (1, 4, 4, 1024, 1024, 96, 96, True, 200, torch.bfloat16), (1, 2, 1, 129, 1, 40, 40, False, None, torch.float16),
    (1, 2, 2, 4096, 4096, 128, 64, True, 1000, torch.bfloat16), (3, 2, 2, 1, 77, 64, 64, True, None, torch.bfloat16),
    (1, 2, 2, 333, 333, 64, 128, False, None, torch.float16),
]  # fmt: skip


def portable(fn):
    """Run fn with the portable kernel forced (KERNEL_LIB_ATTENTION=portable)."""
    previous = os.environ.get("KERNEL_LIB_ATTENTION")
    os.environ["KERNEL_LIB_ATTENTION"] = "portable"
    try:
        return fn()
    finally:
        if previous is None:
            del os.environ["KERNEL_LIB_ATTENTION"]
        else:
            os.environ["KERNEL_LIB_ATTENTION"] = previous


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def label(config: dict) -> str:
    return f"hopper 128x{config['BLOCK_N']} s{config['STAGES']} r{config['CONSUMER_REGS']}"


def launch(q, k, v, out, lse, causal, config):
    """The Hopper kernel with an explicit config (attention._hopper_forward launches it with hopper.config)."""
    B, H, N, D = q.shape
    grid = (triton.cdiv(N, hopper.BLOCK_M), B * H)
    hopper._attn_fwd_hopper_kernel[grid](
        *hopper.descriptors(q, k, v, out, config["BLOCK_N"]), lse, lse.stride(0), lse.stride(1), H, N, k.shape[2], 1,
        D**-0.5 * attention_module.LOG2E, 0, CAUSAL=causal, WINDOW=False, BLOCK_M=hopper.BLOCK_M,
        BLOCK_DQK=hopper.padded(D), BLOCK_DV=hopper.padded(v.shape[-1]), **config,
    )  # fmt: skip


def check_case(B, Hq, Hkv, N, M, D, Dv, causal, window, dtype) -> bool:
    """The library's forward on one case against float64, and against the portable kernel; prints the case."""
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, M, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, M, Dv, device="cuda", dtype=dtype)
    out = torch.empty(B, Hq, N, Dv, device="cuda", dtype=dtype)
    path = "hopper" if attention_module.uses_hopper_forward(q, k, v, out, D**-0.5) else "portable"
    got = flash_attention(q, k, v, causal=causal, window=window)
    low = portable(lambda: flash_attention(q, k, v, causal=causal, window=window))
    ref = attention_ref(q.double(), k.double(), v.double(), causal, window)
    mask = attention_module._visible(N, M, causal, window, q.device)
    if mask.any(dim=1).all():  # PyTorch's own error in this precision: SDPA with the explicit mask
        group = Hq // Hkv
        own = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             attn_mask=mask, scale=D**-0.5)  # fmt: skip
    else:  # SDPA gives NaN for a query that sees no key (we define 0)
        own = attention_ref(q, k, v, causal, window)
    own_err = (own.double() - ref).abs().max().item()
    err = (got.double() - ref).abs().max().item()
    good = err <= 2 * own_err + (1e-3 if dtype == torch.float16 else 1e-2) and bool(torch.isfinite(got).all())
    print(f"check {(B, Hq, Hkv, N, M, D, Dv, causal, window, str(dtype))} path={path}: err {err:.2e}, PyTorch "
          f"{own_err:.2e}, vs portable {(got - low).abs().max().item():.2e} -> {'ok' if good else 'FAIL'}")  # fmt: skip
    return good


def measure_shape(rows: list, N: int, D: int, Dv: int, causal: bool) -> None:
    from torch.nn.attention import SDPBackend

    B, H = max(1, 16384 // N), 2048 // D
    q, k = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, H, N, Dv, device="cuda", dtype=torch.bfloat16)
    flops = 2 * B * H * (D + Dv) * bench.visible_pairs(N, causal=causal)
    shape = dict(N=N, D=D, Dv=Dv, causal=causal, B=B, H=H)
    want = portable(lambda: flash_attention(q, k, v, causal=causal))
    tail = slice(N - 128, N)
    exact = attention_ref(q[:1, :1, tail].double(), k[:1, :1].double(), v[:1, :1].double(), causal)

    def record(name, fn, result, first_s=None):
        timing = bench.time_fn(fn)
        err = (result.double() - want.double()).abs().max().item()
        err64 = (result[:1, :1, tail].double() - exact).abs().max().item()
        rows.append(bench.result_row("attention forward", timing, flops=flops, **shape, impl=name,
                                     max_err_vs_portable=err, max_err_f64=err64, first_call_s=first_s))  # fmt: skip
        print(f"{shape} {name}: {rows[-1]['tflops']:.0f} TFLOP/s, err {err:.1e}, err64 {err64:.1e}", flush=True)

    record("portable", lambda: portable(lambda: flash_attention(q, k, v, causal=causal)), want)
    record(
        "kernel_lib (auto)", lambda: flash_attention(q, k, v, causal=causal), flash_attention(q, k, v, causal=causal)
    )
    for name, backend in (("SDPA CUDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA FLASH", SDPBackend.FLASH_ATTENTION)):
        try:
            result = sdpa(backend)(q, k, v, causal)
        except Exception as error:  # noqa: BLE001 - a backend that refuses this shape
            print(f"{shape} {name}: unsupported ({type(error).__name__})")
            continue
        record(name, lambda backend=backend: sdpa(backend)(q, k, v, causal), result)
    if max(D, Dv) > hopper.MAX_BLOCK_D:
        return
    out = torch.empty_like(want)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    for config in SWEEP:
        if hopper.shared_bytes(D, Dv, config["BLOCK_N"], config["STAGES"]) > hopper.SHARED_LIMIT:
            continue
        out.fill_(float("nan"))  # poisoned: a block the kernel leaves unwritten shows
        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            launch(q, k, v, out, lse, causal, config)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - a config this Triton cannot build or fit
            print(f"{shape} {label(config)}: failed ({type(error).__name__}: {str(error)[:300]})")
            continue
        first = time.perf_counter() - start
        record(label(config), lambda config=config: launch(q, k, v, out, lse, causal, config), out.clone(), first)


def sweep_shapes(measure, shapes: list, selected: str):
    """``measure(rows, *shape)`` for every shape (or those whose indices ``selected`` lists, comma-separated): the
    rows, and their frame sorted with each shape's fastest first."""
    rows = []
    for shape in [shapes[int(i)] for i in selected.split(",")] if selected else shapes:
        measure(rows, *shape)
        torch.cuda.empty_cache()
    frame = bench.to_frame(rows)
    return rows, frame.sort_values(["N", "D", "Dv", "causal", "tflops"], ascending=[True, True, True, True, False])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--shapes", default="", help="indices into SHAPES, comma-separated (all)")
    args = parser.parse_args()
    env = bench.require_gpu("sweep_attention_hopper")
    checked = all([check_case(*case) for case in CHECKS])
    rows, frame = sweep_shapes(measure_shape, SHAPES, args.shapes)
    print(frame.to_string(index=False, float_format=lambda value: f"{value:,.3g}"))
    print(f"wrote {bench.write_csv(rows, os.path.join(args.out, 'attention_hopper.csv'), env=env)}")
    return 0 if checked and (frame["max_err_vs_portable"] < 2e-2).all() else 1


if __name__ == "__main__":
    sys.exit(main())
