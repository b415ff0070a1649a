"""How much of a forward + backward's measured time is the host's, for kernel_lib and torch.compile, on a GPU.

An experiment log like explore_variants.py. For RMSNorm (x and weight gradients) and RoPE (x gradient, strided
q) at 2^27 bf16 elements, three numbers per implementation:
  flushed    triton.testing.do_bench: L2 wiped before each call, so the GPU idles while the host prepares the
             call after the short wipe: host overhead beyond the wipe shows up in the time
  pipelined  CUDA events around back-to-back calls: the host runs ahead, the time is the GPU's
  host       wall time of enqueueing one call (no synchronization): the Python, autograd and launch cost
and, for kernel_lib's RoPE, the forward and backward kernels alone.
"""

import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernel_lib  # noqa: E402
from kernel_lib import bench  # noqa: E402

rms_mod = importlib.import_module("kernel_lib.rms_norm")
rope_mod = importlib.import_module("kernel_lib.rope")


def host_ms(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
        torch.cuda.synchronize()
    return 1e3 * total / reps


def report(label, fn):
    flushed = bench.time_fn(fn).median_ms
    pipelined = bench.time_fn(fn, flush_l2=False).median_ms
    print(f"{label:44s} flushed {flushed:7.3f} ms   pipelined {pipelined:7.3f} ms   host {host_ms(fn):7.3f} ms")


def main() -> int:
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    env = bench.environment()
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']}")
    D = 4096
    x = torch.randn(2**27 // D, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5).requires_grad_()
    dy = torch.randn_like(x)
    compiled = torch.compile(rms_mod.rms_norm_ref, dynamic=False)
    for label, fn in (("rms_norm kernel_lib", kernel_lib.rms_norm), ("rms_norm compiled ref", compiled)):
        report(f"{label} fwd+bwd", lambda fn=fn: torch.autograd.grad(fn(x, w), (x, w), dy))
        report(f"{label} fwd", lambda fn=fn: fn(x.detach(), w.detach()))

    B, H, hd = 4, 32, 128
    n = 2**27 // (B * H * hd)
    q = torch.randn(B, n, H, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    cos, sin = rope_mod.rope_cos_sin(n, hd, device="cuda")
    dq = torch.randn(B, H, n, hd, device="cuda", dtype=torch.bfloat16)
    compiled_rope = torch.compile(rope_mod.rope_ref, dynamic=False)
    for label, fn in (("rope kernel_lib", kernel_lib.rope), ("rope compiled ref", compiled_rope)):
        report(f"{label} fwd+bwd", lambda fn=fn: torch.autograd.grad(fn(q, cos, sin), (q,), dq))
        report(f"{label} fwd", lambda fn=fn: fn(q.detach(), cos, sin))
    report("rope kernel_lib _rotate on strided q", lambda: rope_mod._rotate(q.detach(), cos, sin, False))
    report("rope kernel_lib _rotate on contiguous dy", lambda: rope_mod._rotate(dq, cos, sin, True))
    report("rope kernel_lib _table_grads (none needed)", lambda: rope_mod._table_grads(dq, q.detach(), False, False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
