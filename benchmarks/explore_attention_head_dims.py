"""Flash attention on one GPU: the config sweep for heads wider than 128, and old against new kernels at the
issue's rows with cuDNN's and FlashAttention-2's SDPA backends beside (benchmarks/NOTES.md, 2026-11-28 session).

    python benchmarks/explore_attention_head_dims.py [sweep | table | quick]

"old" is commit 936695f's attention, put beside the new one as a package _scratch/oldlib (an __init__.py, and
`git show 936695f:kernel_lib/ops/X` for X in attention.py, attention_kernels.py, _utils.py, rope.py) with its op
namespace renamed (kernel_lib:: -> kernel_lib_old::) so both register. Run from the repository root.
"""

import os
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.getcwd())
from _scratch.oldlib import attention as old  # noqa: E402
from kernel_lib.ops import _utils  # noqa: E402
from kernel_lib.ops import attention as new  # noqa: E402
from kernel_lib.ops import attention_kernels as K  # noqa: E402

print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")  # noqa: E731


def qkv(B, H, N, D, Dv, dtype=torch.bfloat16):
    q = torch.randn(B, H, N, D, device="cuda", dtype=dtype)
    k = torch.randn(B, H, N, D, device="cuda", dtype=dtype)
    v = torch.randn(B, H, N, Dv, device="cuda", dtype=dtype)
    return q, k, v


def flops(B, H, N, D, Dv, causal):
    return 2 * B * H * N * N * (D + Dv) * (0.5 if causal else 1.0)


def time_lib(lib, q, k, v, causal):
    scale = q.shape[-1] ** -0.5
    out, lse = lib._forward(q, k, v, causal, None, scale)
    do = torch.randn_like(out)
    f = bench(lambda: lib._forward(q, k, v, causal, None, scale))
    b = bench(lambda: lib._backward(do, q, k, v, out, lse, None, causal, None, scale))
    # correctness after timing, against float64 on the last 128 queries of head 0
    ref = new.attention_ref(q[:1, :1].double(), k[:1, :1].double(), v[:1, :1].double(), causal)
    err = (out[:1, :1, -128:].double() - ref[..., -128:, :]).abs().max().item()
    return f, b, err


def cfg(m, n, w, s):
    return triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)


def last_choice():
    return list(_utils._fitting_choices.values())[-1]


mode = sys.argv[1] if len(sys.argv) > 1 else "all"
if mode in ("all", "sweep"):
    print("\n== sweep, bf16, 16k tokens, D=256 (8 heads, N=4096) and 192/128", flush=True)
    saved = K.fwd_preferred, K.dkdv_preferred, K.dq_preferred
    fwd_c = [cfg(64, 64, 4, 2), cfg(128, 64, 8, 2), cfg(64, 32, 4, 2), cfg(128, 32, 8, 2), cfg(64, 64, 8, 2),
             cfg(64, 32, 4, 3), cfg(64, 64, 4, 3), cfg(128, 32, 8, 3), cfg(64, 128, 8, 2), cfg(128, 64, 8, 1)]
    dkdv_c = [cfg(32, 64, 4, 2), cfg(64, 64, 8, 2), cfg(32, 128, 8, 2), cfg(16, 64, 4, 2), cfg(64, 64, 4, 2),
              cfg(32, 64, 8, 2), cfg(16, 128, 8, 2), cfg(32, 64, 4, 3), cfg(64, 128, 8, 1)]
    dq_c = [cfg(64, 32, 4, 2), cfg(64, 64, 8, 2), cfg(128, 32, 8, 2), cfg(64, 16, 4, 2), cfg(64, 64, 4, 2),
            cfg(128, 64, 8, 2), cfg(64, 32, 4, 3), cfg(128, 32, 8, 1)]
    for D, Dv in [(256, 256), (192, 128)]:
        for causal in (False, True):
            B, H, N = 4, 8, 4096
            q, k, v = qkv(B, H, N, D, Dv)
            fl = flops(B, H, N, D, Dv, causal)
            scale = D**-0.5
            out, lse = new._forward(q, k, v, causal, None, scale)
            do = torch.randn_like(out)
            K.dkdv_preferred, K.dq_preferred = saved[1], saved[2]
            for c in fwd_c:
                K.fwd_preferred = lambda *a, c=c: [c]
                try:
                    ms = bench(lambda: new._forward(q, k, v, causal, None, scale))
                    print(f"D={D}/{Dv} causal={causal} fwd  {c} -> {last_choice()}: {fl / ms / 1e9:.0f} TFLOP/s", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"D={D}/{Dv} causal={causal} fwd  {c}: {type(e).__name__} {str(e)[:120]}", flush=True)
            K.fwd_preferred = saved[0]
            for which, cands in (("dkdv", dkdv_c), ("dq", dq_c)):
                for c in cands:
                    if which == "dkdv":
                        K.dkdv_preferred = lambda *a, c=c: [c]
                        K.dq_preferred = saved[2]
                    else:
                        K.dkdv_preferred = saved[1]
                        K.dq_preferred = lambda *a, c=c: [c]
                    try:
                        ms = bench(lambda: new._backward(do, q, k, v, out, lse, None, causal, None, scale))
                        print(f"D={D}/{Dv} causal={causal} bwd {which} {c} -> {last_choice()[1:]}: "
                              f"{2.5 * fl / ms / 1e9:.0f} TFLOP/s", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"D={D}/{Dv} causal={causal} bwd {which} {c}: {type(e).__name__} {str(e)[:120]}",
                              flush=True)
            K.fwd_preferred, K.dkdv_preferred, K.dq_preferred = saved

if mode in ("all", "table", "quick"):
    print("\n== old vs new library, bf16, 16k tokens a batch, 2048/D heads; TFLOP/s fwd / bwd (bwd = 2.5x fwd FLOPs)")
    print("| N, D, causal | old | new | cuDNN | flash (SDPA) | new max err |")
    print("|---|---|---|---|---|---|")
    rows = [(4096, 128, False), (4096, 128, True), (16384, 128, False), (16384, 128, True), (4096, 64, False),
            (16384, 64, True), (4096, 256, False), (4096, 256, True), (4096, 96, False), (4096, 80, True),
            (4096, (192, 128), False), (4096, (192, 128), True)]
    for N, D, causal in rows[:6] if mode == "quick" else rows:
        D, Dv = D if isinstance(D, tuple) else (D, D)
        B, H = max(1, 16384 // N), 2048 // D
        q, k, v = qkv(B, H, N, D, Dv)
        fl = flops(B, H, N, D, Dv, causal)
        cells = []
        for lib in (old, new):
            if lib is old and (D not in (16, 32, 64, 128) or D != Dv):
                cells.append("-")
                continue
            try:
                f, b, err = time_lib(lib, q, k, v, causal)
                cells.append(f"{fl / f / 1e9:.0f} / {2.5 * fl / b / 1e9:.0f}")
            except Exception as e:  # noqa: BLE001
                cells.append(type(e).__name__)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            try:
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                with sdpa_kernel(backend):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)  # noqa: E731
                    o = fn()
                    g = torch.randn_like(o)
                    f = bench(fn)
                    fb = bench(lambda: torch.autograd.grad(fn(), (qq, kk, vv), g))
                cells.append(f"{fl / f / 1e9:.0f} / {2.5 * fl / (fb - f) / 1e9:.0f}")
            except Exception as e:  # noqa: BLE001
                cells.append(type(e).__name__)
        print(f"| {N}, {D if D == Dv else f'{D}/{Dv}'}, {'yes' if causal else 'no'} | " + " | ".join(cells) + f" | {err:.1e} |", flush=True)
