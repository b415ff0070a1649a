"""kernel_lib.flash_attention against PyTorch's SDPA backends and compiled FlexAttention, on a GPU.

bf16, 16k tokens per batch (B = 16384 / N), 2048 / D heads, N from 1k to 16k, D 64 and 128, causal and not, plus a
sliding window of 1024 at N = 8192. TFLOP/s counts 4 B H N M D for the forward (only the visible part of the
matrix: half when causal, the band for a window) and 2.5x that for the backward. Every implementation's output is
compared with kernel_lib's and, on the last 128 queries of one head, with float64. Peak memory of forward +
backward is measured against the eager reference that materializes the N x N scores. Writes
<out>/attention.csv and prints a table.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from kernel_lib import attention_ref, bench, flash_attention


def sdpa_with(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal, window):
        if window is not None:
            raise NotImplementedError("no sliding window in SDPA without an explicit mask")
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def flex_attention_runner():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One compiled function serves every shape, mask and requires_grad setting of the sweep: more recompilations
    # than Dynamo's default limit of 8, after which it silently runs the unfused eager flex_attention (measured:
    # 2 TFLOP/s for the sliding window, the last case). Raise the limit (named cache_size_limit before torch 2.6).
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, causal, window):
        key = (q.shape[2], causal, window)
        if key not in masks:
            if window is not None:

                def mask_mod(b, h, i, j):
                    return (j <= i) & (j > i - window)
            elif causal:

                def mask_mod(b, h, i, j):
                    return j <= i
            else:
                mask_mod = None
            masks[key] = (
                create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device="cuda") if mask_mod else None
            )
        return compiled(q, k, v, block_mask=masks[key])

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--head-dims", default="64,128")
    args = parser.parse_args()
    env = bench.require_gpu("bench_attention")
    from torch.nn.attention import SDPBackend

    peak = bench.matmul_tflops(torch.bfloat16)
    print(f"bf16 matmul ceiling: {peak:,.0f} TFLOP/s")
    impls = {
        "kernel_lib": lambda q, k, v, causal, window: flash_attention(q, k, v, causal=causal, window=window),
        "SDPA FLASH": sdpa_with(SDPBackend.FLASH_ATTENTION),
        "SDPA CUDNN": sdpa_with(SDPBackend.CUDNN_ATTENTION),
        "SDPA EFFICIENT": sdpa_with(SDPBackend.EFFICIENT_ATTENTION),
        "FlexAttention (compiled)": flex_attention_runner(),
    }
    lengths = [int(n) for n in args.lengths.split(",")]
    head_dims = [int(d) for d in args.head_dims.split(",")]
    cases = [(N, D, causal, None) for D in head_dims for N in lengths for causal in (False, True)]
    cases.append((8192, 128, True, 1024))
    rows = []
    for N, D, causal, window in cases:
        B, H = max(1, 16384 // N), 2048 // D
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        pairs = bench.visible_pairs(N, causal=causal, window=window)
        fwd_flops = 4 * B * H * D * pairs
        ours = flash_attention(q, k, v, causal=causal, window=window)
        tail = slice(N - 128, N)
        want = attention_ref(q[:1, :1, tail].double(), k[:1, :1].double(), v[:1, :1].double(), causal, window)
        for name, fn in impls.items():
            try:
                out = fn(q, k, v, causal, window)
            except Exception as error:  # a backend that does not support this case
                print(f"N={N} D={D} causal={causal} window={window} {name}: unsupported ({type(error).__name__})")
                continue
            ok = bool((out[:1, :1, tail].double() - want).abs().max() < 2e-2) and bool((out - ours).abs().max() < 5e-2)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            dout = torch.randn_like(out)
            flags = (causal, window)
            forward = bench.time_fn(lambda fn=fn, qkv=(q, k, v), flags=flags: fn(*qkv, *flags))
            both = bench.time_fn(
                lambda fn=fn, leaves=leaves, dout=dout, flags=flags: torch.autograd.grad(
                    fn(*leaves, *flags), leaves, dout
                )
            )
            base = dict(impl=name, B=B, H=H, N=N, D=D, causal=causal, window=window, correct=ok)
            rows.append({**bench.result_row("attention", forward, flops=fwd_flops, **base), "pass": "forward"})
            rows.append(
                {**bench.result_row("attention", both, flops=3.5 * fwd_flops, **base), "pass": "forward+backward"}
            )
            print(f"N={N} D={D} causal={causal} window={window} {name}: forward {rows[-2]['tflops']:.0f} TFLOP/s, "
                  f"forward+backward {rows[-1]['tflops']:.0f} TFLOP/s, correct={ok}", flush=True)  # fmt: skip
        del q, k, v
        torch.cuda.empty_cache()

    # Peak memory of forward + backward: kernel_lib against the eager reference that stores N x N scores.
    for N in (1024, 2048, 4096, 8192):
        q, k, v = (
            torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        )
        for name, fn in (("kernel_lib", flash_attention), ("eager reference", attention_ref)):
            peak = bench.peak_memory_bytes(lambda fn=fn, qkv=(q, k, v): fn(*qkv, True).float().sum().backward())
            rows.append({"name": "attention peak memory", "impl": name, "N": N, "D": 128, "causal": True,
                         "peak_mib": peak / 2**20})  # fmt: skip
            q.grad = k.grad = v.grad = None
    frame = bench.to_frame(rows)
    print(frame.to_string(index=False, float_format=lambda value: f"{value:,.2f}"))
    print(f"wrote {bench.write_csv(rows, os.path.join(args.out, 'attention.csv'), env=env)}")
    return 0 if frame["correct"].dropna().all() else 1


if __name__ == "__main__":
    sys.exit(main())
