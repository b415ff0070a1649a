"""Host cost of one eager LayerNorm / RMSNorm forward + backward, kernel_lib against torch.compile, on a GPU.

An experiment log like explore_host.py. At 32768 x 4096 bf16, gradients of x, weight (and bias), three numbers
per implementation:
  as called  bench.time_fn of the step (do_bench: L2 wiped before each call), what a caller sees
  host       median wall time to issue one step, synchronizing after each: Python, autograd, allocations,
             launches
  graph      the step replayed from a CUDA graph (bench.repeat_in_graph), per step: the GPU's time alone
then a cProfile of 200 kernel_lib steps per op, top 15 functions by own time. Runs in well under a minute.
"""

import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernel_lib  # noqa: E402
from kernel_lib import bench  # noqa: E402
from kernel_lib.layer_norm import layer_norm_ref  # noqa: E402
from kernel_lib.rms_norm import rms_norm_ref  # noqa: E402

TIMING = dict(warmup_ms=10, rep_ms=50)  # as notebook 04a


def host_ms(fn, reps=200):
    """Median wall time of issuing fn() once, with the GPU drained before each call (a few slow calls move a mean)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return 1e3 * statistics.median(samples)


def graph_ms(fn, repeats=5):
    replay = bench.repeat_in_graph(fn, repeats)
    return bench.time_fn(replay, **TIMING).median_ms / repeats


def profile_steps(step, steps=200, top=15):
    """cProfile of ``steps`` calls of step(), each drained, printed: the top functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
        torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main() -> int:
    env = bench.environment()
    print(f"{env['device']} | torch {env['torch']} | triton {env['triton']} | {env['timestamp']}")
    x = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5).requires_grad_()
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn_like(x)
    ops = {  # op: (kernel_lib, reference, inputs)
        "layer_norm": (kernel_lib.layer_norm, layer_norm_ref, (x, w, b)),
        "rms_norm": (kernel_lib.rms_norm, rms_norm_ref, (x, w)),
    }
    print(f"{'step (fwd + bwd)':36s} {'as called':>10s} {'host':>10s} {'graph':>10s}   (ms)")
    for op, (ours, reference, inputs) in ops.items():
        compiled = torch.compile(reference, dynamic=False)
        for got, want in zip(torch.autograd.grad(ours(*inputs), inputs, dy),
                             torch.autograd.grad(compiled(*inputs), inputs, dy), strict=True):  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-1, rtol=2e-2)  # the two steps agree before they are timed
        for impl, fn in (("kernel_lib", ours), ("torch.compile(ref)", compiled)):

            def step(fn=fn, inputs=inputs):
                return torch.autograd.grad(fn(*inputs), inputs, dy)

            called = bench.time_fn(step, **TIMING).median_ms
            print(f"{op + ' ' + impl:36s} {called:10.3f} {host_ms(step):10.3f} {graph_ms(step):10.3f}")
    for op, (ours, _, inputs) in ops.items():
        print(f"\n== cProfile, 200 steps of kernel_lib.{op}, top 15 by own time")
        profile_steps(lambda ours=ours, inputs=inputs: torch.autograd.grad(ours(*inputs), inputs, dy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
