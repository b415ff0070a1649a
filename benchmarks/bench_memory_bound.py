"""Memory-bound kernels of kernel_lib against PyTorch eager, the PyTorch built-in and torch.compile.

For each op (RMSNorm, LayerNorm, softmax, SwiGLU), bf16, rows x D with rows * D = 2**27 (the 32768 x 4096 of the course
at D = 4096), forward and forward + backward: ``kernel_lib.bench.sweep`` checks every implementation against float64
first (the output forward; the input gradients forward + backward), then times it with L2 wiped between calls
(kernel_lib.bench.time_fn). GB/s counts the fewest bytes each pass must move (inputs read once, outputs written
once); the copy ceiling is measured in the same run. Weights and biases get no gradient, so every implementation
differentiates the same inputs. Writes <out>/memory_bound.csv and prints a table.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from kernel_lib import (
    bench,
    layer_norm,
    layer_norm_ref,
    rms_norm,
    rms_norm_ref,
    softmax,
    softmax_ref,
    swiglu,
    swiglu_ref,
)

DTYPE = torch.bfloat16


def make_ops(device="cuda", dtype=DTYPE, compiled=True):
    """op -> (make_inputs(rows, D), {impl: fn}, reference, inputs that get gradients, tensors moved forward,
    tensors moved forward + backward)."""

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    ops = {
        "rms_norm": (
            lambda rows, D: [randn(rows, D), 1 + 0.1 * randn(D)],
            {
                "kernel_lib": rms_norm,
                "F.rms_norm": lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-6),
                "eager reference": rms_norm_ref,
            },
            rms_norm_ref,
            1,
            2,
            5,
        ),
        "layer_norm": (
            lambda rows, D: [1 + randn(rows, D), 1 + 0.1 * randn(D), 0.1 * randn(D)],
            {
                "kernel_lib": layer_norm,
                "F.layer_norm": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5),
                "eager reference": layer_norm_ref,
            },
            layer_norm_ref,
            1,
            2,
            5,
        ),
        "softmax": (
            lambda rows, D: [3 * randn(rows, D)],
            {"kernel_lib": softmax, "F.softmax": lambda x: F.softmax(x, dim=-1), "eager reference": softmax_ref},
            softmax_ref,
            1,
            2,
            5,
        ),
        "swiglu": (
            lambda rows, D: [randn(rows, D), randn(rows, D)],
            {"kernel_lib": swiglu, "F.silu(g) * u": lambda g, u: F.silu(g) * u, "eager reference": swiglu_ref},
            swiglu_ref,
            2,
            3,
            8,
        ),
    }
    if compiled:
        for _, impls, reference, *_ in ops.values():
            impls["compiled reference"] = torch.compile(reference, dynamic=False)
    return ops


def forward_backward(fn, n_grad):
    """fn's forward + backward: the gradients of its first ``n_grad`` inputs, for the output gradient passed last."""

    def step(*args):
        *inputs, dy = args
        return torch.autograd.grad(fn(*inputs), inputs[:n_grad], dy)

    return step


def with_gradients(make_inputs, n_grad):
    """Inputs for :func:`forward_backward`: the first ``n_grad`` require grad, and an output gradient comes last."""

    def make(rows, D):
        inputs = make_inputs(rows, D)
        for tensor in inputs[:n_grad]:
            tensor.requires_grad_()
        return [*inputs, torch.randn_like(inputs[0])]

    return make


def measure(ops, widths, elements, copy_gbps, element_bytes, **timing_kwargs):
    """Every op's implementations, checked then timed at every width, forward and forward + backward: a DataFrame."""
    cases = [{"D": D, "rows": elements // D} for D in widths]
    frames = []
    for op, (make_inputs, impls, reference, n_grad, moved_fwd, moved_both) in ops.items():
        for pass_name, pass_impls, pass_reference, make, moved in (
            ("forward", impls, reference, make_inputs, moved_fwd),
            (
                "forward+backward",
                {impl: forward_backward(fn, n_grad) for impl, fn in impls.items()},
                forward_backward(reference, n_grad),
                with_gradients(make_inputs, n_grad),
                moved_both,
            ),
        ):
            frame = bench.sweep(
                pass_impls,
                cases,
                make,
                pass_reference,
                baseline="kernel_lib",
                nbytes=lambda D, rows, moved=moved, element_bytes=element_bytes: moved * rows * D * element_bytes,
                name=op,
                atol=1e-2,
                **timing_kwargs,
            )
            frame["pass"] = pass_name
            frames.append(frame)
            ours = frame[frame.impl == "kernel_lib"]
            summary = ", ".join(f"D={d} {g:,.0f}" for d, g in zip(ours["D"], ours["gbps"], strict=True))
            print(f"{op} {pass_name}: kernel_lib GB/s {summary}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    import pandas as pd

    frame = pd.concat(frames, ignore_index=True)
    frame["pct_of_copy"] = 100 * frame["gbps"] / copy_gbps
    # ratio_to_baseline = this row's time over kernel_lib's: kernel_lib's speed-up over this implementation
    return frame.rename(columns={"ratio_to_baseline": "kernel_lib speed-up"})


def prepare() -> float:
    """Let every compiled reference compile, and measure the copy ceiling: its GB/s."""
    # Each compiled reference sees every width, with and without gradients: more graphs than Dynamo's default
    # recompile limit (8), past which it would silently run eagerly (named cache_size_limit before torch 2.6).
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    copy_gbps = bench.copy_bandwidth()
    print(f"copy ceiling {copy_gbps:,.0f} GB/s")
    return copy_gbps


def arguments(doc: str, widths: str, ops: str) -> argparse.ArgumentParser:
    """The command line this script and its neighbours share: --out, --widths, --elements, --ops."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default="results")
    parser.add_argument("--widths", default=widths)
    parser.add_argument("--elements", type=int, default=2**27, help="rows * D for every width")
    parser.add_argument("--ops", default=ops, help="comma-separated subset")
    return parser


def main() -> int:
    args = arguments(__doc__, "512,1024,2048,4096,8192,16384", "rms_norm,layer_norm,softmax,swiglu").parse_args()
    env = bench.require_gpu("bench_memory_bound")
    copy_gbps = prepare()
    widths = [int(w) for w in args.widths.split(",")]
    ops = {op: spec for op, spec in make_ops().items() if op in args.ops.split(",")}
    frame = measure(ops, widths, args.elements, copy_gbps, DTYPE.itemsize)
    frame["dtype"] = str(DTYPE).removeprefix("torch.")
    path = bench.write_csv(
        frame.to_dict("records"),
        os.path.join(args.out, "memory_bound.csv"),
        env={**env, "copy_gbps": copy_gbps},
    )
    show = frame[frame["D"] == 4096][
        ["name", "pass", "impl", "median_ms", "gbps", "pct_of_copy", "kernel_lib speed-up"]
    ]
    print(show.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
    print("\nkernel_lib GB/s by width (forward | forward+backward):")
    for op in frame["name"].unique():
        sub = frame[(frame["name"] == op) & (frame["impl"] == "kernel_lib")]
        cells = [
            f"D={d}: {sub[(sub.D == d) & (sub['pass'] == 'forward')].gbps.iloc[0]:,.0f} | "
            f"{sub[(sub.D == d) & (sub['pass'] == 'forward+backward')].gbps.iloc[0]:,.0f}"
            for d in widths
        ]
        print(f"  {op:9s} " + "; ".join(cells))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
